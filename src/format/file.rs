//! F and E records: where each file (tree entry) begins, with its id, kind
//! and name field, and where it ends, with its size and check.

use super::{check_seal, seal, u16le, u32le, u64le, REC_END, REC_FILE};
use crate::error::{Error, Result};

/// What an entry holds; page images get page-aware blocks. Directories
/// and symbolic links occur only in tree archives
/// ([`FLAG_TREE`](super::FLAG_TREE)): a directory has no blocks, a link's
/// blocks hold its target.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum FileKind {
    Plain = 0,
    Pages = 1,
    Dir = 2,
    Symlink = 3,
}

impl FileKind {
    /// CRIU names page images `pages-<id>.img`; everything else is metadata.
    /// In a tree, the last component of the path decides.
    pub fn for_name(name: &str) -> Self {
        let base = name.rsplit('/').next().unwrap_or(name);
        if base.starts_with("pages-") && base.ends_with(".img") {
            FileKind::Pages
        } else {
            FileKind::Plain
        }
    }

    /// A regular file (its bytes are data, not a link target or nothing).
    pub fn is_file(self) -> bool {
        matches!(self, FileKind::Plain | FileKind::Pages)
    }

    pub(super) fn from_u8(v: u8, offset: u64) -> Result<Self> {
        match v {
            0 => Ok(FileKind::Plain),
            1 => Ok(FileKind::Pages),
            2 => Ok(FileKind::Dir),
            3 => Ok(FileKind::Symlink),
            _ => Err(Error::corrupt(offset, format!("unknown file kind {v}"))),
        }
    }
}

/// Fixed part of an F record, before the name.
pub const FILE_FIXED: usize = 8;
/// Length of an E record.
pub const END_LEN: usize = 28;

/// Name length of an F record from its fixed part.
pub fn file_record_name_len(fixed: &[u8]) -> usize {
    u16le(&fixed[2..]) as usize
}

/// What an F record says. The name field is the sealed one in an encrypted
/// archive; [`NameField::decode`](super::NameField::decode) takes it apart.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FileRecord<'a> {
    pub file_id: u32,
    pub name: &'a [u8],
    pub kind: FileKind,
}

impl<'a> FileRecord<'a> {
    /// Decodes a whole F record (fixed part, name field, seal).
    pub fn decode(rec: &'a [u8], offset: u64) -> Result<Self> {
        let n =
            rec.len().checked_sub(FILE_FIXED + 4).ok_or_else(|| Error::corrupt(offset, "file record is too short"))?;
        if rec[0] != REC_FILE || file_record_name_len(rec) != n {
            return Err(Error::corrupt(offset, "not a file record"));
        }
        check_seal(rec, offset, "file record")?;
        let kind = FileKind::from_u8(rec[1], offset + 1)?;
        Ok(FileRecord { file_id: u32le(&rec[4..]), name: &rec[FILE_FIXED..FILE_FIXED + n], kind })
    }
}

/// Encodes an F record around a name field
/// ([`encode_name_field`](super::encode_name_field), sealed in an encrypted
/// archive).
pub fn encode_file_record_bytes(file_id: u32, name: &[u8], kind: FileKind, out: &mut Vec<u8>) {
    let start = out.len();
    out.push(REC_FILE);
    out.push(kind as u8);
    out.extend_from_slice(&(name.len() as u16).to_le_bytes());
    out.extend_from_slice(&file_id.to_le_bytes());
    out.extend_from_slice(name);
    seal(out, start);
}

/// What an E record (file end) says.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FileEnd {
    pub file_id: u32,
    pub raw_size: u64,
    pub file_check: u64,
}

pub fn encode_end_record(e: &FileEnd, out: &mut Vec<u8>) {
    let start = out.len();
    out.push(REC_END);
    out.extend_from_slice(&[0, 0, 0]);
    out.extend_from_slice(&e.file_id.to_le_bytes());
    out.extend_from_slice(&e.raw_size.to_le_bytes());
    out.extend_from_slice(&e.file_check.to_le_bytes());
    seal(out, start);
}

pub fn decode_end_record(rec: &[u8; END_LEN], offset: u64) -> Result<FileEnd> {
    if rec[0] != REC_END {
        return Err(Error::corrupt(offset, "not a file end record"));
    }
    check_seal(rec, offset, "file end record")?;
    if rec[1..4] != [0, 0, 0] {
        return Err(Error::corrupt(offset + 1, "reserved file end bytes are not zero"));
    }
    Ok(FileEnd { file_id: u32le(&rec[4..]), raw_size: u64le(&rec[8..]), file_check: u64le(&rec[16..]) })
}

//! Entry names: the name field of F records and index entries (in a tree
//! archive, the entry's mode and mtime in front of its path), and the rules
//! a name must follow before it is used as a path.

use super::{u32le, u64le};
use crate::error::{Error, Result};

/// Longest symbolic link target a tree carries (Linux's PATH_MAX).
pub const MAX_LINK_TARGET: u64 = 4096;
/// Bytes of [`EntryMeta`] in front of a tree entry's path.
pub const META_LEN: usize = 16;

/// What a tree archive keeps of an entry besides its path and bytes: the
/// permission bits and the modification time. Owners are not kept (an
/// unpack makes the files the caller's, as `tar` does for a non-root user).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct EntryMeta {
    /// Permission bits (`mode & 0o7777`); the type is the entry's kind.
    pub mode: u32,
    pub mtime: i64,
    pub mtime_nsec: u32,
}

impl EntryMeta {
    fn encode(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.mode.to_le_bytes());
        out.extend_from_slice(&self.mtime.to_le_bytes());
        out.extend_from_slice(&self.mtime_nsec.to_le_bytes());
    }

    fn decode(b: &[u8], offset: u64) -> Result<Self> {
        let m = EntryMeta { mode: u32le(b), mtime: u64le(&b[4..]) as i64, mtime_nsec: u32le(&b[12..]) };
        if m.mode & !0o7777 != 0 {
            return Err(Error::corrupt(offset, format!("entry mode {:#o} has bits beyond 0o7777", m.mode)));
        }
        if m.mtime_nsec >= 1_000_000_000 {
            return Err(Error::corrupt(offset + 12, "entry mtime nanoseconds out of range"));
        }
        Ok(m)
    }
}

/// An entry's name field as stored: the path, behind its [`EntryMeta`] in
/// a tree archive (`meta` is `Some` exactly then).
pub fn encode_name_field(name: &str, meta: Option<&EntryMeta>) -> Vec<u8> {
    let mut out = Vec::with_capacity(META_LEN + name.len());
    if let Some(m) = meta {
        m.encode(&mut out);
    }
    out.extend_from_slice(name.as_bytes());
    out
}

/// A name field taken apart: the path, and in a tree archive the entry's
/// [`EntryMeta`] (`meta` is `Some` exactly then).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NameField {
    pub name: String,
    pub meta: Option<EntryMeta>,
}

impl NameField {
    /// Splits a name field (opened, if sealed) into path and meta; `tree`
    /// says whether the archive is a tree. The path is not yet checked as a
    /// name.
    pub fn decode(field: Vec<u8>, tree: bool, offset: u64) -> Result<Self> {
        if !tree {
            return Ok(NameField { name: file_name(field, offset)?, meta: None });
        }
        if field.len() <= META_LEN {
            return Err(Error::corrupt(offset, "tree entry name field is too short"));
        }
        let meta = EntryMeta::decode(&field[..META_LEN], offset)?;
        Ok(NameField { name: file_name(field[META_LEN..].to_vec(), offset + META_LEN as u64)?, meta: Some(meta) })
    }
}

/// Checks a name taken from an archive before it is used as a path: one
/// plain file name, or in a tree (`tree`) a relative path of such names
/// joined by `/`. Neither can leave the directory it is unpacked into.
pub fn check_entry_name(name: &str, tree: bool) -> std::result::Result<(), &'static str> {
    let limit = if tree { u16::MAX as usize - META_LEN } else { u16::MAX as usize };
    if name.len() > limit {
        return Err("name too long");
    }
    if !tree && name.contains('/') {
        return Err("name contains '/'");
    }
    for part in name.split('/') {
        if part.is_empty() || part == "." || part == ".." {
            return Err("empty or dot path component");
        }
        if part.contains('\0') {
            return Err("name contains NUL");
        }
    }
    Ok(())
}

/// The directory a tree entry sits in (`None` at the top).
pub fn parent_path(name: &str) -> Option<&str> {
    name.rsplit_once('/').map(|(dir, _)| dir)
}

/// A file name from its bytes, which must be UTF-8.
pub fn file_name(bytes: Vec<u8>, offset: u64) -> Result<String> {
    String::from_utf8(bytes).map_err(|_| Error::corrupt(offset, "file name is not UTF-8"))
}

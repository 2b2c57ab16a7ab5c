//! Proving an archive as it is opened, two ways.
//!
//! [`walk`] proves a seekable archive whole: every record header from the
//! first to the trailer through `check` (file ids, block order, sizes,
//! chained file checks, E records, the index against the stream), keeping
//! the proven block headers, a few dozen bytes per block. A block read
//! later must then be, byte for byte, the header proven at its position (so
//! a file changed after opening is caught too), with a payload that matches
//! its payload check; decoding it proves its data.
//!
//! From a cold cache a walk would wait for the device once per block, so it
//! first asks for every record start its index places, all at once
//! (`RecordStore::prefetch_heads`), and its reads never move a store's
//! read-ahead (which would read every payload it skips).
//!
//! [`from_table`] is the one exception, for a restore from an object still
//! arriving: header, C record and index alone (every archive criuz writes
//! carries a copy of each block header in its index), after
//! `check::check_table`. Blocks read are checked against the table as
//! against a walk, but the index itself may be a forgery with every check
//! recomputed, so the opened archive runs [`walk`] behind and a reader
//! waits for it before its point of no return.

use super::check::{check_table, Checked, CheckedRecords, Payloads};
use super::fetch::StoreInput;
use crate::error::{Error, Result, TruncatedUnderReader};
use crate::format::{
    BlockCodec, BlockHeader, ChainEntry, Header, Index, IndexFixed, Trailer, FLAG_PARENT, FLAG_TABLE, HEADER_LEN,
    INDEX_FIXED, TRAILER_LEN,
};
use crate::io::RecordStore;
use crate::seal::ArchiveKey;
use std::sync::Arc;

/// What the opening walk proved about a block.
pub(crate) struct ProvenBlock {
    pub(crate) header: BlockHeader,
    /// Position of its first byte in its file.
    pub(crate) raw_pos: u64,
    /// For a dedup block, the pages its P record lists: its literal pages
    /// must be exactly these (checked whenever it is decoded).
    pub(crate) literal_pages: Option<u32>,
}

/// What a walk of every record header through the checks proved.
pub(crate) struct Walked {
    pub(crate) header: Header,
    pub(crate) index: Index,
    pub(crate) blocks: Vec<Vec<ProvenBlock>>,
    pub(crate) chain: Vec<ChainEntry>,
    pub(crate) key: Option<Arc<ArchiveKey>>,
}

/// Walks every record header of `store` through the checks.
pub(crate) fn walk(store: &dyn RecordStore) -> Result<Walked> {
    let mut records = CheckedRecords::new(StoreInput::heads(store), Payloads::None)?;
    let header = records.header().clone();
    let key = records.key().cloned();
    prefetch_heads(store, &header, key.as_deref());
    let mut blocks: Vec<Vec<ProvenBlock>> = Vec::new();
    let mut chain = Vec::new();
    loop {
        match records.next_record()? {
            Some((_, Checked::FileBegin { .. })) => blocks.push(Vec::new()),
            Some((_, Checked::Block { header, raw_pos, .. })) => {
                blocks[header.file_id as usize].push(ProvenBlock { header, raw_pos, literal_pages: None });
            }
            Some((_, Checked::Ids { file_id, count, .. })) => {
                if let Some(b) = blocks[file_id as usize].last_mut().filter(|b| b.header.codec == BlockCodec::Dedup) {
                    b.literal_pages = Some(count);
                }
            }
            Some((_, Checked::Chain(entries))) => chain = entries,
            Some((_, Checked::FileEnd(_))) => {}
            Some((_, Checked::Index(index))) => return Ok(Walked { header, index, blocks, chain, key }),
            None => unreachable!("the index ends the records"),
        }
    }
}

/// Largest index whose record starts a walk asks for ahead: 4M blocks.
const PREFETCH_INDEX_MAX: u64 = 64 << 20;

/// Asks `store` ahead for the first bytes of every record that the index
/// at its end places (each file's F record and blocks), so a walk from a
/// cold cache waits for the device once, not once per block. Only a hint:
/// the walk checks whatever it reads, and an index that cannot be read
/// (or is too large to read on speculation) leaves the walk to say why.
fn prefetch_heads(store: &dyn RecordStore, header: &Header, key: Option<&ArchiveKey>) {
    // A download's index comes last: reading it first would wait for all.
    if store.arriving() {
        return;
    }
    let Ok((index, _)) = read_index(store, header, key, PREFETCH_INDEX_MAX) else { return };
    let mut offsets: Vec<u64> = index
        .files
        .iter()
        .flat_map(|f| std::iter::once(f.record_offset).chain(f.blocks.iter().map(|b| b.offset)))
        .collect();
    offsets.sort_unstable();
    store.prefetch_heads(&offsets);
}

/// Reads and checks the trailer and the index it points at (refused when
/// its record is longer than `most` bytes); returns the index and its offset.
fn read_index(store: &dyn RecordStore, header: &Header, key: Option<&ArchiveKey>, most: u64) -> Result<(Index, u64)> {
    let size = store.size();
    let truncated = || Error::corrupt(size, "archive is truncated (no trailer)");
    if size < (HEADER_LEN + TRAILER_LEN) as u64 {
        return Err(truncated());
    }
    let at = size - TRAILER_LEN as u64;
    let trailer: [u8; TRAILER_LEN] = read_head(store, TRAILER_LEN, at)?.try_into().expect("trailer length");
    let Trailer { index_offset: offset, index_len: len } = Trailer::decode(&trailer, at)?;
    // The format bounds the index body below 4 GiB, so a damaged trailer
    // cannot make this read more.
    if offset.checked_add(len) != Some(at) || !((INDEX_FIXED + 8) as u64..(1 << 32) + 28).contains(&len) {
        return Err(Error::corrupt(at, "trailer does not point at the index"));
    }
    if len > most {
        return Err(Error::corrupt(offset, format!("index record of {len} bytes is longer than {most} allowed here")));
    }
    let rec = read_head(store, len as usize, offset)?;
    let IndexFixed { count, body_len } =
        IndexFixed::decode(rec[..INDEX_FIXED].try_into().expect("index header"), offset)?;
    if body_len + (INDEX_FIXED + 8) as u64 != len {
        return Err(Error::corrupt(at, "trailer does not point at the index"));
    }
    let body = &rec[INDEX_FIXED..INDEX_FIXED + body_len as usize];
    let check = u64::from_le_bytes(rec[INDEX_FIXED + body.len()..].try_into().expect("index check"));
    let index = super::records::index_from_body(key, body, check, count, offset + INDEX_FIXED as u64, header.flags)?;
    Ok((index, offset))
}

/// `len` bytes at `offset`, read as record headers are (a store's read-ahead
/// does not follow the jump to the index at the end). Callers read within
/// the size the store gave: a read that meets the end met a truncation.
fn read_head(store: &dyn RecordStore, len: usize, offset: u64) -> std::io::Result<Vec<u8>> {
    let mut buf = vec![0; len];
    store.read_head_at(&mut buf, offset).map_err(|e| TruncatedUnderReader::wrap(e, offset))?;
    Ok(buf)
}

/// What [`from_table`] read: as a walk would give it, but proven only
/// against the index's own block table.
///
/// `None` for an archive without a block table (`FLAG_TABLE`), which must be
/// walked instead.
pub(crate) fn from_table(store: &dyn RecordStore) -> Result<Option<Walked>> {
    let mut records = CheckedRecords::new(StoreInput::heads(store), Payloads::None)?;
    let header = records.header().clone();
    if header.flags & FLAG_TABLE == 0 {
        return Ok(None);
    }
    let key = records.key().cloned();
    let after_key = records.offset();
    let (chain, data_start) = if header.flags & FLAG_PARENT != 0 {
        match records.next_record()? {
            Some((_, Checked::Chain(chain))) => (chain, records.offset()),
            _ => unreachable!("the checks let only the chain record come first"),
        }
    } else {
        (Vec::new(), after_key)
    };
    drop(records);
    let (index, index_offset) = read_index(store, &header, key.as_deref(), u64::MAX)?;
    check_table(&header, &chain, data_start, &index, index_offset)?;
    let blocks = index
        .files
        .iter()
        .map(|f| {
            let mut raw_pos = 0;
            f.table
                .iter()
                .map(|t| {
                    let literal_pages = (t.header.codec == BlockCodec::Dedup).then_some(t.ids);
                    let b = ProvenBlock { header: t.header.clone(), raw_pos, literal_pages };
                    raw_pos += u64::from(t.header.raw_len);
                    b
                })
                .collect()
        })
        .collect();
    Ok(Some(Walked { header, index, blocks, chain, key }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::archive::{write::Packer, BlockSource, Options};
    use crate::io::read_ahead::ReadAhead;

    /// An archive of one 4 MiB file of incompressible bytes (16 blocks).
    fn random_archive() -> tempfile::NamedTempFile {
        let tmp = tempfile::NamedTempFile::new().unwrap();
        let packer = Packer::start(tmp.reopen().unwrap(), &Options::default(), None).unwrap();
        let mut sink = packer.begin_file("pages-1.img").unwrap();
        sink.write(&crate::archive::noise(4 << 20)).unwrap();
        sink.finish().unwrap();
        packer.finish().unwrap();
        tmp
    }

    /// A walk reads record headers only: were the read-ahead to follow it,
    /// it would read every payload the walk skips (from a cold cache, the
    /// whole archive before a lazy restore's process could run).
    #[test]
    fn a_walk_does_not_drag_the_read_ahead_behind_it() {
        let tmp = random_archive();
        let store = ReadAhead::new(std::fs::File::open(tmp.path()).unwrap());
        let walked = walk(&store).unwrap();
        assert_eq!(walked.blocks[0].len(), 16, "a walk over every block");
        assert_eq!(store.wanted(), 0);
        let table = from_table(&store).unwrap().expect("a block table");
        assert_eq!(table.index, walked.index);
        assert_eq!(store.wanted(), 0);
    }

    /// A file cut short under its reader (after the store took its size)
    /// is damage, exit 3, where the walk said "failed to fill whole
    /// buffer", exit 1 (found by hand, session 59: a lazy restore of an
    /// archive truncated as it was proven behind the running tree).
    #[test]
    fn an_archive_truncated_under_its_walk_is_damage() {
        let tmp = random_archive();
        let store = ReadAhead::new(std::fs::File::open(tmp.path()).unwrap());
        tmp.as_file().set_len(store.size() / 2).unwrap();
        let err = walk(&store).err().expect("a walk of a truncated archive fails");
        assert_eq!(err.kind(), crate::error::Kind::Archive, "{err}");
        assert!(err.to_string().contains("archive was truncated after it was opened"), "{err}");

        // Cut short between the store's size and the read of the index
        // at its end (a store that still gives the size it had).
        struct CutShort(Vec<u8>, u64);
        impl RecordStore for CutShort {
            fn size(&self) -> u64 {
                self.1
            }
            fn read_exact_at(&self, buf: &mut [u8], offset: u64) -> std::io::Result<()> {
                self.0.read_exact_at(buf, offset)
            }
        }
        let bytes = std::fs::read(random_archive().path()).unwrap();
        let size = bytes.len() as u64;
        let err = from_table(&CutShort(bytes[..bytes.len() - 64].to_vec(), size)).err().expect("no index to read");
        assert_eq!(err.kind(), crate::error::Kind::Archive, "{err}");
        assert!(err.to_string().contains("archive was truncated after it was opened"), "{err}");

        // Cut short once opened: a file read says which archive and file.
        let tmp = random_archive();
        let at = crate::io::Location::File(tmp.path().to_path_buf());
        let archive = crate::archive::open(&at, &crate::archive::OpenOptions::default()).unwrap();
        tmp.as_file().set_len(std::fs::metadata(tmp.path()).unwrap().len() / 2).unwrap();
        let entry = archive.find("pages-1.img").unwrap();
        let err = archive.read_file(entry).expect_err("a read of a truncated archive fails");
        assert_eq!(err.kind(), crate::error::Kind::Archive, "{err}");
        let said = err.to_string();
        assert!(said.starts_with(&format!("{}: pages-1.img: offset ", at.label())), "{said}");
    }

    #[test]
    fn a_file_read_that_fails_names_the_archive_and_the_file_once() {
        // A store whose reads fail with EIO once it is armed (after the
        // archive was opened and proven from it).
        struct Failing(Vec<u8>, std::sync::atomic::AtomicBool);
        impl RecordStore for Failing {
            fn size(&self) -> u64 {
                self.0.len() as u64
            }
            fn read_exact_at(&self, buf: &mut [u8], offset: u64) -> std::io::Result<()> {
                if self.1.load(std::sync::atomic::Ordering::Relaxed) {
                    return Err(std::io::Error::from_raw_os_error(libc::EIO));
                }
                self.0.read_exact_at(buf, offset)
            }
        }
        let bytes = std::fs::read(random_archive().path()).unwrap();
        let store = Arc::new(Failing(bytes, false.into()));
        struct Shared(Arc<Failing>);
        impl RecordStore for Shared {
            fn size(&self) -> u64 {
                self.0.size()
            }
            fn read_exact_at(&self, buf: &mut [u8], offset: u64) -> std::io::Result<()> {
                self.0.read_exact_at(buf, offset)
            }
        }
        let archive = crate::archive::Archive::walked(Box::new(Shared(store.clone())), "t.czr".into()).unwrap();
        store.1.store(true, std::sync::atomic::Ordering::Relaxed);
        let entry = archive.find("pages-1.img").unwrap();
        let said = archive.read_file(entry).expect_err("a failing read fails").to_string();
        assert!(said.starts_with("t.czr: pages-1.img: "), "{said}");
        assert_eq!(said.matches("t.czr").count(), 1, "{said}");
    }
}

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
//! On four cores or more, worker threads read and parse the records ahead
//! of the walk from those same starts (`walk_ahead`), and the walk checks
//! them in order: on 16 cores a lazy restore of a 4 GiB archive had its
//! proof 0.6-1.2 ms after CRIU's handover instead of 12-18 ms (session 83).
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
use super::records::Input;
use super::walk_ahead::{AheadInput, RecordsAhead};
use crate::error::{Error, Result, TruncatedUnderReader};
use crate::format::{
    BlockCodec, BlockHeader, ChainEntry, Header, Index, IndexFixed, Trailer, FLAG_PARENT, FLAG_TABLE, HEADER_LEN,
    INDEX_FIXED, TRAILER_LEN,
};
use crate::io::RecordStore;
use crate::seal::ArchiveKey;
use std::sync::{Arc, OnceLock};

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

/// Walks every record header of `store` through the checks, with the heads
/// read and parsed ahead on other cores where the index places enough
/// records (`walk_ahead`).
pub(crate) fn walk(store: &dyn RecordStore) -> Result<Walked> {
    walk_guessing(store, RecordsAhead::workers(), |header, key| prefetch_heads(store, header, key)).0
}

/// [`walk`] with `workers` threads parsing ahead (none: the walk reads
/// alone) from the record starts `guess` gives (the index's, in a walk);
/// and how many records the walk took parsed.
fn walk_guessing(
    store: &dyn RecordStore,
    workers: usize,
    guess: impl FnOnce(&Header, Option<&ArchiveKey>) -> Option<Vec<u64>>,
) -> (Result<Walked>, usize) {
    let ahead = OnceLock::new();
    let input = StoreInput::heads(store);
    let (len, _) = input.len_and_pos();
    let mut records = match CheckedRecords::new(AheadInput::new(input, &ahead), Payloads::None) {
        Ok(records) => records,
        Err(e) => return (Err(e), 0),
    };
    let header = records.header().clone();
    let key = records.key().cloned();
    let starts = guess(&header, key.as_deref());
    let parse =
        starts.filter(|_| workers > 0).and_then(|s| RecordsAhead::new(store, len, header.clone(), key.clone(), &s));
    let Some(parse) = parse else {
        return (walk_records(&mut records, header, key), 0);
    };
    let parse = ahead.get_or_init(|| parse);
    std::thread::scope(|s| {
        let started = (0..workers)
            .filter(|i| {
                let worker = std::thread::Builder::new().name(format!("criuz-walk-{i}"));
                worker.spawn_scoped(s, || parse.work()).is_ok()
            })
            .count();
        if started == 0 {
            parse.stop();
        }
        let walked = walk_records(&mut records, header, key);
        parse.stop();
        (walked, parse.taken())
    })
}

/// The walk proper: every record of `records` through the checks.
fn walk_records<I: Input>(
    records: &mut CheckedRecords<I>,
    header: Header,
    key: Option<Arc<ArchiveKey>>,
) -> Result<Walked> {
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
/// cold cache waits for the device once, not once per block; returns those
/// starts, ascending, for the walk's workers (`walk_ahead`). Only a hint:
/// the walk checks whatever it reads, and an index that cannot be read
/// (or is too large to read on speculation) leaves the walk to say why.
fn prefetch_heads(store: &dyn RecordStore, header: &Header, key: Option<&ArchiveKey>) -> Option<Vec<u64>> {
    // A download's index comes last: reading it first would wait for all.
    if store.arriving() {
        return None;
    }
    let (index, _) = read_index(store, header, key, PREFETCH_INDEX_MAX).ok()?;
    Some(prefetch_starts(store, &index))
}

/// Asks `store` ahead for the record starts `index` places; returns them,
/// ascending.
fn prefetch_starts(store: &dyn RecordStore, index: &Index) -> Vec<u64> {
    let mut offsets: Vec<u64> = index
        .files
        .iter()
        .flat_map(|f| std::iter::once(f.record_offset).chain(f.blocks.iter().map(|b| b.offset)))
        .collect();
    offsets.sort_unstable();
    store.prefetch_heads(&offsets);
    offsets
}

/// [`walk`] of an archive already opened from `index` (its block table,
/// [`from_table`]): the record starts come from that index instead of a
/// second read of it (which a lazy tree's start waited for on 16 cores),
/// still only a guess the walk checks.
pub(crate) fn walk_opened(store: &dyn RecordStore, index: &Index) -> Result<Walked> {
    let guess = |_: &Header, _: Option<&ArchiveKey>| (!store.arriving()).then(|| prefetch_starts(store, index));
    walk_guessing(store, RecordsAhead::workers(), guess).0
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

    /// What a walk proved, or the error it stopped at, to compare walks.
    type Summary = std::result::Result<(Index, Vec<Vec<(BlockHeader, u64, Option<u32>)>>, Vec<ChainEntry>), String>;

    fn summary(walked: Result<Walked>) -> Summary {
        walked.map_err(|e| e.to_string()).map(|w| {
            let blocks =
                w.blocks.iter().map(|f| f.iter().map(|b| (b.header.clone(), b.raw_pos, b.literal_pages)).collect());
            (w.index, blocks.collect(), w.chain)
        })
    }

    /// An archive of 1,300 small blocks with page ids (a P record after
    /// each): noise, zero pages and text, and a second file.
    fn many_blocks() -> Vec<u8> {
        let tmp = tempfile::NamedTempFile::new().unwrap();
        let opts = Options { block_size: crate::format::MIN_BLOCK, ids: true, ..Options::default() };
        let packer = Packer::start(tmp.reopen().unwrap(), &opts, None).unwrap();
        let mut sink = packer.begin_file("pages-1.img").unwrap();
        let noise = crate::archive::noise(1 << 20);
        for i in 0..600usize {
            let page = match i % 3 {
                0 => noise[(i * 4096) % (1 << 20)..][..4096].to_vec(),
                1 => vec![0u8; 4096],
                _ => format!("page {i} ").repeat(1000).into_bytes()[..4096].to_vec(),
            };
            sink.write(&page).unwrap();
            sink.write(&noise[(i * 977) % (1 << 19)..][..4096]).unwrap();
        }
        sink.finish().unwrap();
        let mut sink = packer.begin_file("pages-2.img").unwrap();
        sink.write(&noise[..400 << 10]).unwrap();
        sink.finish().unwrap();
        packer.finish().unwrap();
        std::fs::read(tmp.path()).unwrap()
    }

    /// Records parsed ahead on other threads change nothing a walk proves
    /// or refuses, whatever starts the index gives them: honest ones, ones
    /// off by a byte, ones a record late, made up, out of order; over an
    /// intact archive, and over the same one damaged in a block header, a
    /// page id record, the index, or cut short.
    #[test]
    fn a_walk_parsed_ahead_proves_and_refuses_what_a_walk_alone_does() {
        let intact = many_blocks();
        let honest = prefetch_heads(&intact, &Header::decode(intact[..HEADER_LEN].try_into().unwrap()).unwrap(), None)
            .expect("the index's starts");
        assert!(honest.len() > 1300, "{} records", honest.len());
        let at = |i: usize| honest[i] as usize;
        let mut damaged = vec![("intact", intact.clone())];
        for (what, offset) in [
            ("a block header", at(700) + 9),
            ("a page id record", at(900) - 20),
            ("the index", intact.len() - 200),
            ("the first block", at(2) + 1),
        ] {
            let mut bytes = intact.clone();
            bytes[offset] ^= 0x40;
            damaged.push((what, bytes));
        }
        damaged.push(("cut short", intact[..at(1000) + 30].to_vec()));
        let guesses: Vec<(&str, Option<Vec<u64>>)> = vec![
            ("honest", Some(honest.clone())),
            ("a byte off", Some(honest.iter().map(|o| o + 1).collect())),
            ("a record late", Some(honest[1..].to_vec())),
            ("made up", Some((0..3000).map(|i| 64 + i * 397).collect())),
            ("out of order", Some(honest.iter().rev().copied().collect())),
        ];
        for (what, bytes) in &damaged {
            let alone = summary(walk_guessing(bytes, 0, |_, _| None).0);
            assert_eq!(alone.is_ok(), *what == "intact", "{what}: {:?}", alone.as_ref().err());
            for (guessed, starts) in &guesses {
                let (walked, taken) = walk_guessing(bytes, 3, |_, _| starts.clone());
                let ahead = summary(walked);
                assert!(
                    ahead == alone,
                    "{what}, starts {guessed}: {:?} against {:?}",
                    ahead.err(),
                    alone.as_ref().err()
                );
                if *what == "intact" && ["honest", "a record late"].contains(guessed) {
                    assert!(taken > 1000, "{guessed}: the walk took {taken} records parsed");
                }
            }
        }
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

//! Opening an archive from its index (`archive::open` with `Proof::Behind`, what a restore
//! from an object store does) against crafted indexes, without CRIU: what
//! the index alone can prove is refused at once, what only the records can
//! tell (a forged index with every check recomputed) is refused by the walk
//! behind, through `BlockSource::proven`, which a restore waits for before
//! CRIU can finish. Blocks read meanwhile are still each checked.

// Tests start processes of their own; clippy.toml's rule is for the
// programs criuz runs.
#![allow(clippy::disallowed_methods)]

mod common;
use common::{forge_index, swap_indexed_blocks};
use criuz::archive::records::ArchiveWriter;
use criuz::archive::{Archive, BlockSource, OpenOptions, Options, Packer, Proof};
use criuz::error::Kind;
use criuz::format::{FileKind, Header, FLAG_TABLE};
use criuz::io::Location;
use std::io::Write;
use std::sync::Arc;

/// Pages of three kinds (text, zero, random) so blocks differ and compress.
fn pages(n: usize) -> Vec<u8> {
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    let mut out = Vec::new();
    for p in 0..n {
        for _ in 0..4096 / 8 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let word = match p % 3 {
                0 => u64::from_le_bytes(*b"restore "),
                1 => 0,
                _ => x,
            };
            out.extend_from_slice(&word.to_le_bytes());
        }
    }
    out
}

fn files() -> Vec<(&'static str, Vec<u8>)> {
    vec![("pages-1.img", pages(96)), ("pagemap-1.img", b"pagemap".to_vec()), ("core-1.img", pages(1))]
}

fn archive() -> Vec<u8> {
    archive_with(Options::default())
}

fn archive_with(opts: Options) -> Vec<u8> {
    let opts = Options { block_size: 64 << 10, threads: 2, ..opts };
    let tmp = tempfile::NamedTempFile::new().unwrap();
    let packer = Packer::start(tmp.reopen().unwrap(), &opts, None).unwrap();
    for (name, data) in files() {
        let mut sink = packer.begin_file(name).unwrap();
        sink.write(&data).unwrap();
        sink.finish().unwrap();
    }
    packer.finish().unwrap();
    std::fs::read(tmp.path()).unwrap()
}

fn open(bytes: Vec<u8>) -> criuz::error::Result<Arc<Archive>> {
    let how = OpenOptions { proof: Proof::Behind, ..OpenOptions::default() };
    criuz::archive::open(&Location::memory("test.czr", bytes), &how)
}

fn read_all(a: &Archive) -> Vec<(&'static str, Vec<u8>)> {
    files().into_iter().map(|(name, _)| (name, a.read_file(a.find(name).unwrap()).unwrap())).collect()
}

#[test]
fn an_intact_archive_opens_from_its_index_and_proves_whole() {
    let bytes = archive();
    assert_ne!(Header::decode(bytes[..64].try_into().unwrap()).unwrap().flags & FLAG_TABLE, 0);
    let a = open(bytes).unwrap();
    assert_eq!(read_all(&a), files());
    a.proven().unwrap();
}

#[test]
fn a_forged_index_is_refused_by_the_walk_behind() {
    let forged = forge_index(&archive(), swap_indexed_blocks);
    // Nothing in the index alone gives it away, and each block read is the
    // block its entry names ...
    let a = open(forged).expect("the forgery passes the index's own rules");
    let pages = a.read_file(a.find("pages-1.img").unwrap()).unwrap();
    assert_ne!(pages, files()[0].1, "the forgery reorders the pages");
    // ... so the proof, which a restore waits for, must refuse it.
    let e = a.proven().expect_err("the walk must refuse a forged index");
    assert_eq!(e.kind(), Kind::Archive, "{e}");
    assert!(e.to_string().contains("test.czr"), "{e}");
}

fn pages_entry(index: &mut criuz::format::Index) -> &mut criuz::format::FileEntry {
    index.files.iter_mut().find(|f| f.name == "pages-1.img").unwrap()
}

#[test]
fn an_index_naming_one_block_twice_is_refused_at_once() {
    let forged = forge_index(&archive(), |index| {
        let f = pages_entry(index);
        f.blocks[1] = f.blocks[0];
        f.table[1] = f.table[0].clone();
    });
    let e = open(forged).err().expect("a duplicated block must be refused");
    assert_eq!(e.kind(), Kind::Archive, "{e}");
    assert!(e.to_string().contains("same bytes"), "{e}");
}

#[test]
fn a_table_entry_listing_page_ids_no_record_holds_is_refused_at_once() {
    // Page ids follow the blocks of page images only.
    let with_ids = archive_with(Options { ids: true, ..Options::default() });
    let forged = forge_index(&with_ids, |index| {
        index.files.iter_mut().find(|f| f.name == "core-1.img").unwrap().table[0].ids = 1
    });
    let e = open(forged).err().expect("page ids no record holds must be refused");
    assert_eq!(e.kind(), Kind::Archive, "{e}");
    assert!(e.to_string().contains("page id"), "{e}");
}

#[test]
fn a_table_entry_that_lies_fails_its_block_and_the_proof() {
    let forged = forge_index(&archive(), |index| {
        let f = pages_entry(index);
        f.table[2].header.data_check ^= 1;
    });
    let a = open(forged).unwrap();
    let pages = a.find("pages-1.img").unwrap().file_id;
    let e = a.block(pages, 2).err().expect("the block no longer matches its entry");
    assert_eq!(e.kind(), Kind::Archive, "{e}");
    assert_eq!(a.proven().unwrap_err().kind(), Kind::Archive);
}

#[test]
fn damage_anywhere_in_the_index_or_trailer_is_refused_at_once() {
    let bytes = archive();
    let index_start = {
        let t = bytes.len() - 32;
        u64::from_le_bytes(bytes[t + 8..t + 16].try_into().unwrap()) as usize
    };
    for at in index_start..bytes.len() {
        let mut v = bytes.clone();
        v[at] ^= 0x10;
        let e = open(v).err().unwrap_or_else(|| panic!("a flip at {at} of the index or trailer went unseen"));
        assert_eq!(e.kind(), Kind::Archive, "{e}");
    }
}

#[test]
fn an_archive_without_a_table_is_walked_first() {
    let tmp = tempfile::NamedTempFile::new().unwrap();
    let mut w = ArchiveWriter::new(tmp.reopen().unwrap(), &Header::new(64 << 10), &[]).unwrap();
    let id = w.begin_file("core-1.img", FileKind::Plain, None).unwrap();
    let mut enc = criuz::codec::Encoder::new(Default::default());
    let mut block = enc.encode(id, b"core", false);
    block.header.file_id = id;
    w.write_block(&block.header, &block.payload).unwrap();
    w.end_file(id).unwrap();
    let (mut out, _, _) = w.finish().unwrap();
    out.flush().unwrap();
    let a = open(std::fs::read(tmp.path()).unwrap()).unwrap();
    a.proven().unwrap();
    assert_eq!(a.read_file(a.find("core-1.img").unwrap()).unwrap(), b"core");
}

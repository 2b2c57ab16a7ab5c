//! The worked example of docs/FORMAT.md, built byte by byte from the spec's
//! tables (not from criuz's encoders) and compared with what the writer
//! produces; then read back through every reader. If this test and FORMAT.md
//! disagree, one of them is wrong.

use criuz::archive::records::ArchiveWriter;
use criuz::archive::{Archive, BlockSource};
use criuz::format::{FileKind, Header};
use xxhash_rust::xxh3::xxh3_64;

const ID: [u8; 16] = *b"golden-archiveid";

fn seal(rec: &mut Vec<u8>) {
    let s = xxh3_64(rec) as u32;
    rec.extend_from_slice(&s.to_le_bytes());
}

/// The header and the F record of file `x` at 64: magic, `version`, `flags`,
/// block size 256 KiB, id, parent id 0, shard 0 of 1, reserved 0, xxh3 of
/// the first 56 bytes; then 46 00 01 00 00 00 00 00 78 + seal.
fn header_and_x(version: u8, flags: u8) -> Vec<u8> {
    let mut a = Vec::new();
    a.extend_from_slice(b"\x89CRIUZ\r\n");
    a.extend_from_slice(&[version, 0x00, flags, 0x00, 0x00, 0x00, 0x04, 0x00]);
    a.extend_from_slice(&ID);
    a.extend_from_slice(&[0u8; 16]);
    a.extend_from_slice(&[0, 0, 1, 0, 0, 0, 0, 0]);
    let h = xxh3_64(&a);
    a.extend_from_slice(&h.to_le_bytes());
    assert_eq!(a.len(), 64);
    let mut f = vec![0x46, 0x00, 0x01, 0x00, 0x00, 0x00, 0x00, 0x00, b'x'];
    seal(&mut f);
    a.extend_from_slice(&f);
    a
}

/// A sealed E record of file 0: raw size and file check.
fn e_record(raw_size: u64, check: [u8; 8]) -> Vec<u8> {
    let mut e = vec![0x45, 0, 0, 0, 0, 0, 0, 0];
    e.extend_from_slice(&raw_size.to_le_bytes());
    e.extend_from_slice(&check);
    seal(&mut e);
    e
}

/// The fixed part of file `x`'s index entry (id 0, kind plain, F at 64),
/// up to its block count; block references follow.
fn entry_x(raw_size: u64, check: u64, blocks: u32) -> Vec<u8> {
    let mut body = Vec::new();
    body.extend_from_slice(&0u32.to_le_bytes());
    body.extend_from_slice(&[0, 0]);
    body.extend_from_slice(&1u16.to_le_bytes());
    body.push(b'x');
    body.extend_from_slice(&raw_size.to_le_bytes());
    body.extend_from_slice(&check.to_le_bytes());
    body.extend_from_slice(&64u64.to_le_bytes());
    body.extend_from_slice(&blocks.to_le_bytes());
    body
}

/// An I record of one entry: sealed fixed part, `body`, body check.
fn i_record(body: &[u8]) -> Vec<u8> {
    let mut i = vec![0x49, 0, 0, 0];
    i.extend_from_slice(&1u32.to_le_bytes());
    i.extend_from_slice(&(body.len() as u64).to_le_bytes());
    seal(&mut i);
    i.extend_from_slice(body);
    i.extend_from_slice(&xxh3_64(body).to_le_bytes());
    i
}

/// The 202-byte archive of FORMAT.md's worked example: one empty plain file `x`.
fn from_the_spec() -> Vec<u8> {
    let mut a = header_and_x(1, 0);
    // E at 77: id 0, raw size 0, file check of no blocks = xxh3("").
    a.extend_from_slice(&e_record(0, [0xC2, 0x94, 0xD3, 0x38, 0x05, 0x80, 0x06, 0x2D]));
    // I at 105: one entry (id 0, kind 0, name x, size 0, check, F at 64, no blocks).
    let body = entry_x(0, 0x2D06800538D394C2, 0);
    assert_eq!(body.len(), 37);
    let i = i_record(&body);
    assert_eq!(i.len(), 65);
    a.extend_from_slice(&i);
    // Trailer at 170: magic, index offset 105, index length 65, check.
    let mut t = b"CRIUZEND".to_vec();
    t.extend_from_slice(&105u64.to_le_bytes());
    t.extend_from_slice(&65u64.to_le_bytes());
    let c = xxh3_64(&t);
    t.extend_from_slice(&c.to_le_bytes());
    a.extend_from_slice(&t);
    a
}

#[test]
fn xxh3_of_nothing_is_the_documented_constant() {
    assert_eq!(xxh3_64(b""), 0x2D06800538D394C2);
}

#[test]
fn writer_produces_the_worked_example_byte_for_byte() {
    let spec = from_the_spec();
    assert_eq!(spec.len(), 202);
    let mut w = ArchiveWriter::new(Vec::new(), &Header::with_id(256 << 10, ID), &[]).unwrap();
    let id = w.begin_file("x", FileKind::Plain).unwrap();
    w.end_file(id).unwrap();
    let (written, _, len) = w.finish().unwrap();
    assert_eq!(len, 202);
    assert_eq!(written, spec, "the writer and FORMAT.md's worked example differ");
}

#[test]
fn every_reader_accepts_the_worked_example() {
    let spec = from_the_spec();
    let a = Archive::from_store(Box::new(spec.clone()), "golden".into()).unwrap();
    assert_eq!(a.index().files.len(), 1);
    let x = a.find("x").unwrap();
    assert_eq!(a.read_file(x).unwrap(), Vec::<u8>::new());
    let rep = criuz::offline::inspect(&spec[..]).unwrap();
    assert_eq!(rep.archive_bytes, 202);
    assert_eq!(rep.files[0].name, "x");
    let (files, bytes) = criuz::offline::verify(
        criuz::offline::Reading::Stream("golden".into(), Box::new(std::io::Cursor::new(spec))),
        &criuz::archive::Options::default(),
        criuz::progress::Progress::hidden(),
    )
    .unwrap();
    assert_eq!((files, bytes), (1, 0));
}

/// FORMAT.md's block table (version 2, flag `TABLE`), built from its tables:
/// one plain file `x` holding the raw block `hi`.
fn table_archive_from_the_spec() -> Vec<u8> {
    // Version 2, flags 4 (TABLE).
    let mut a = header_and_x(2, 4);
    // B at 77: raw, no bitmap, file 0, raw_len 2, stored_len 2, checks, seal; payload "hi".
    let block_at = a.len() as u64;
    assert_eq!(block_at, 77);
    let mut b = vec![0x42, 0x00, 0x00, 0x00, 0, 0, 0, 0];
    b.extend_from_slice(&2u32.to_le_bytes());
    b.extend_from_slice(&2u32.to_le_bytes());
    b.extend_from_slice(&xxh3_64(b"hi").to_le_bytes());
    b.extend_from_slice(&(xxh3_64(b"hi") as u32).to_le_bytes());
    seal(&mut b);
    let block_header = b.clone();
    a.extend_from_slice(&b);
    a.extend_from_slice(b"hi");
    let file_check = xxh3_64(&xxh3_64(b"hi").to_le_bytes());
    a.extend_from_slice(&e_record(2, file_check.to_le_bytes()));
    let index_at = a.len() as u64;
    let mut body = entry_x(2, file_check, 1);
    // The reference, then its table entry: the B record's first 32 bytes.
    body.extend_from_slice(&block_at.to_le_bytes());
    body.extend_from_slice(&2u32.to_le_bytes());
    body.extend_from_slice(&34u32.to_le_bytes());
    body.extend_from_slice(&block_header);
    let i = i_record(&body);
    let index_len = i.len() as u64;
    a.extend_from_slice(&i);
    let mut t = b"CRIUZEND".to_vec();
    t.extend_from_slice(&index_at.to_le_bytes());
    t.extend_from_slice(&index_len.to_le_bytes());
    let c = xxh3_64(&t);
    t.extend_from_slice(&c.to_le_bytes());
    a.extend_from_slice(&t);
    a
}

#[test]
fn the_block_table_is_laid_out_as_documented_and_opens_from_the_index() {
    let spec = table_archive_from_the_spec();
    let mut header = Header::with_id(256 << 10, ID);
    header.flags = criuz::format::FLAG_TABLE;
    let mut w = ArchiveWriter::new(Vec::new(), &header, &[]).unwrap();
    let id = w.begin_file("x", FileKind::Plain).unwrap();
    let block = criuz::format::BlockHeader {
        codec: criuz::format::BlockCodec::Raw,
        file_id: id,
        raw_len: 2,
        stored_len: 2,
        data_check: xxh3_64(b"hi"),
        payload_check: xxh3_64(b"hi") as u32,
        zero_bitmap: Vec::new(),
    };
    w.write_block(&block, b"hi").unwrap();
    w.end_file(id).unwrap();
    let (written, _, _) = w.finish().unwrap();
    assert_eq!(written, spec, "the writer and FORMAT.md's block table differ");
    let a = Archive::open_indexed(Box::new(spec.clone()), "golden".into()).unwrap();
    assert_eq!(a.read_file(a.find("x").unwrap()).unwrap(), b"hi");
    a.proven().unwrap();
    let walked = Archive::from_store(Box::new(spec), "golden".into()).unwrap();
    assert_eq!(walked.index(), a.index());
}

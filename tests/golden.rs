//! The worked example of docs/FORMAT.md, built byte by byte from the spec's
//! tables (not from criuz's encoders) and compared with what the writer
//! produces; then read back through every reader. If this test and FORMAT.md
//! disagree, one of them is wrong.

use criuz::archive::records::ArchiveWriter;
use criuz::archive::{open, BlockSource, OpenOptions, Proof};
use criuz::format::{FileKind, Header};
use criuz::io::Location;
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
    let id = w.begin_file("x", FileKind::Plain, None).unwrap();
    w.end_file(id).unwrap();
    let (written, _, len) = w.finish().unwrap();
    assert_eq!(len, 202);
    assert_eq!(written, spec, "the writer and FORMAT.md's worked example differ");
}

#[test]
fn every_reader_accepts_the_worked_example() {
    let spec = from_the_spec();
    let a = open(&Location::memory("golden", spec.clone()), &OpenOptions::default()).unwrap();
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
    end_of_one_block(&mut a, 2, xxh3_64(b"hi"), block_at, 34, &block_header);
    a
}

/// The rest of an archive whose file `x` holds one block of `raw_len` bytes
/// (data check `data_check`, record of `record_len` bytes at `block_at`,
/// whose first 32 bytes are `block_header`): E, then I with the block's
/// reference and its table entry, then the trailer.
fn end_of_one_block(
    a: &mut Vec<u8>,
    raw_len: u32,
    data_check: u64,
    block_at: u64,
    record_len: u32,
    block_header: &[u8],
) {
    let file_check = xxh3_64(&data_check.to_le_bytes());
    a.extend_from_slice(&e_record(raw_len.into(), file_check.to_le_bytes()));
    let index_at = a.len() as u64;
    let mut body = entry_x(raw_len.into(), file_check, 1);
    // The reference, then its table entry: the B record's first 32 bytes.
    body.extend_from_slice(&block_at.to_le_bytes());
    body.extend_from_slice(&raw_len.to_le_bytes());
    body.extend_from_slice(&record_len.to_le_bytes());
    body.extend_from_slice(block_header);
    let i = i_record(&body);
    let index_len = i.len() as u64;
    a.extend_from_slice(&i);
    let mut t = b"CRIUZEND".to_vec();
    t.extend_from_slice(&index_at.to_le_bytes());
    t.extend_from_slice(&index_len.to_le_bytes());
    let c = xxh3_64(&t);
    t.extend_from_slice(&c.to_le_bytes());
    a.extend_from_slice(&t);
}

#[test]
fn the_block_table_is_laid_out_as_documented_and_opens_from_the_index() {
    let spec = table_archive_from_the_spec();
    let mut header = Header::with_id(256 << 10, ID);
    header.flags = criuz::format::FLAG_TABLE;
    let mut w = ArchiveWriter::new(Vec::new(), &header, &[]).unwrap();
    let id = w.begin_file("x", FileKind::Plain, None).unwrap();
    let block = criuz::format::BlockHeader {
        codec: criuz::format::BlockCodec::Raw,
        file_id: id,
        raw_len: 2,
        stored_len: 2,
        data_check: xxh3_64(b"hi"),
        payload_check: xxh3_64(b"hi") as u32,
        zero_bitmap: criuz::format::PageBits::new(),
        sealed: false,
    };
    w.write_block(&block, b"hi").unwrap();
    w.end_file(id).unwrap();
    let (written, _, _) = w.finish().unwrap();
    assert_eq!(written, spec, "the writer and FORMAT.md's block table differ");
    let a = open(
        &Location::memory("golden", spec.clone()),
        &OpenOptions { proof: Proof::Behind, ..OpenOptions::default() },
    )
    .unwrap();
    assert_eq!(a.read_file(a.find("x").unwrap()).unwrap(), b"hi");
    a.proven().unwrap();
    let walked = open(&Location::memory("golden", spec), &OpenOptions::default()).unwrap();
    assert_eq!(walked.index(), a.index());
}

/// FORMAT.md's version 3 (flags TABLE | PLANES): file `x` holds one block of
/// 32 bf16 words 0x3C00 (1.0), stored as codec 4: each word rotated left by
/// one bit is 0x7800, so the low plane is 32 zero bytes (stored raw) and the
/// high plane 32 bytes 0x78, stored as a hand-made LZ4 block.
fn planes_archive_from_the_spec() -> (Vec<u8>, Vec<u8>) {
    let s: Vec<u8> = std::iter::repeat_n([0x00, 0x3C], 32).flatten().collect();
    let mut a = header_and_x(3, 4 | 32);
    let block_at = a.len() as u64;
    // LZ4: 1 literal then a 26-byte match at offset 1 (token 1F, length
    // 15 + 7); then the 5 final literals (token 50).
    let high = [0x1F, 0x78, 0x01, 0x00, 0x07, 0x50, 0x78, 0x78, 0x78, 0x78, 0x78];
    let mut payload = vec![32, 0, 0, 0, 0b10, 0, 0, 0];
    payload.extend_from_slice(&[0u8; 32]);
    payload.extend_from_slice(&high);
    assert_eq!(payload.len(), 51);
    // B: codec 4, no bitmap, file 0, raw_len 64, stored_len 51, checks.
    let mut b = vec![0x42, 0x04, 0x00, 0x00, 0, 0, 0, 0];
    b.extend_from_slice(&64u32.to_le_bytes());
    b.extend_from_slice(&51u32.to_le_bytes());
    b.extend_from_slice(&xxh3_64(&s).to_le_bytes());
    b.extend_from_slice(&(xxh3_64(&payload) as u32).to_le_bytes());
    seal(&mut b);
    let block_header = b.clone();
    a.extend_from_slice(&b);
    a.extend_from_slice(&payload);
    end_of_one_block(&mut a, 64, xxh3_64(&s), block_at, 32 + 51, &block_header);
    (a, s)
}

#[test]
fn a_byte_planes_block_decodes_by_the_spec_through_every_reader() {
    let (spec, s) = planes_archive_from_the_spec();
    let a = open(&Location::memory("golden", spec.clone()), &OpenOptions::default()).unwrap();
    assert_eq!(a.read_file(a.find("x").unwrap()).unwrap(), s);
    let rep = criuz::offline::inspect(&spec[..]).unwrap();
    assert_eq!((rep.version, rep.total.codecs.planes, rep.total.codecs.lz4), (3, 1, 1));
    let (files, bytes) = criuz::offline::verify(
        criuz::offline::Reading::Stream("golden".into(), Box::new(std::io::Cursor::new(spec.clone()))),
        &criuz::archive::Options::default(),
        criuz::progress::Progress::hidden(),
    )
    .unwrap();
    assert_eq!((files, bytes), (1, 64));
    // The version goes with the flag: version 2 with PLANES is corrupt.
    let mut v2 = spec;
    v2[8] = 2;
    let h = xxh3_64(&v2[..56]);
    v2[56..64].copy_from_slice(&h.to_le_bytes());
    let Err(e) = open(&Location::memory("golden", v2), &OpenOptions::default()) else {
        panic!("version 2 with PLANES opened")
    };
    assert_eq!(e.kind(), criuz::error::Kind::Archive, "{e}");
}

/// An encrypted archive written by criuz, opened by the rules of FORMAT.md's
/// "Encrypted archives" alone: age to unwrap the chain key, HKDF-SHA256 and
/// AES-256-GCM straight from `ring`, offsets from the tables.
#[test]
fn an_encrypted_archive_opens_by_the_spec() {
    use ring::aead::{Aad, LessSafeKey, Nonce, UnboundKey, AES_256_GCM};
    use ring::hkdf;
    use std::str::FromStr;

    let id = age::x25519::Identity::generate();
    let public = id.to_public().to_string();
    let recipients = criuz::seal::keyring::Recipients::from_args(&[public], &[], None).unwrap().unwrap();
    let codec = criuz::codec::CodecConfig::new(criuz::codec::Codec::None, None).unwrap();
    let opts = criuz::archive::Options { seal: Some(std::sync::Arc::new(recipients)), codec, ..Default::default() };
    let mut data = vec![0u8; 4096];
    data.extend((0..4096u32).map(|i| (i * 7 % 251) as u8));
    let tmp = tempfile::NamedTempFile::new().unwrap();
    let packer = criuz::archive::Packer::start(tmp.reopen().unwrap(), &opts, None).unwrap();
    let mut f = packer.begin_file("pages-1.img").unwrap();
    f.write(&data).unwrap();
    f.finish().unwrap();
    packer.finish().unwrap();
    let a = std::fs::read(tmp.path()).unwrap();

    let u32le = |at: usize| u32::from_le_bytes(a[at..at + 4].try_into().unwrap()) as usize;
    let h = &a[..56];
    assert_eq!(u16::from_le_bytes([a[10], a[11]]) & 8, 8, "flag SEALED");
    // K at 64.
    assert_eq!(a[64], b'K');
    assert_eq!(a[65], 1, "AES-256-GCM");
    let n = u32le(68);
    let key_id = &a[72..88];
    let wrapped = &a[88..88 + n];
    let identity = age::x25519::Identity::from_str(age::secrecy::ExposeSecret::expose_secret(&id.to_string())).unwrap();
    let dec = age::Decryptor::new_buffered(wrapped).unwrap();
    let mut ck = Vec::new();
    std::io::Read::read_to_end(&mut dec.decrypt(std::iter::once(&identity as &dyn age::Identity)).unwrap(), &mut ck)
        .unwrap();
    assert_eq!(ck.len(), 32);
    struct L(usize);
    impl hkdf::KeyType for L {
        fn len(&self) -> usize {
            self.0
        }
    }
    let derive = |salt: &[u8], info: &[u8], len: usize| {
        let mut out = vec![0u8; len];
        let prk = hkdf::Salt::new(hkdf::HKDF_SHA256, salt).extract(&ck);
        prk.expand(&[info], L(len)).unwrap().fill(&mut out).unwrap();
        out
    };
    assert_eq!(derive(b"", b"criuz key id", 16), key_id, "key id");
    let ak = LessSafeKey::new(UnboundKey::new(&AES_256_GCM, &derive(&a[16..32], b"criuz archive key", 32)).unwrap());
    let nonce = |domain: u8, x: u32, y: u32| {
        let mut b = [0u8; 12];
        b[0] = domain;
        b[4..8].copy_from_slice(&x.to_le_bytes());
        b[8..12].copy_from_slice(&y.to_le_bytes());
        Nonce::assume_unique_for_key(b)
    };
    // F right after K: a sealed name of 11 + 16 bytes.
    let mut at = 88 + n + 4;
    assert_eq!(a[at], b'F');
    let name_len = u16::from_le_bytes([a[at + 2], a[at + 3]]) as usize;
    assert_eq!(name_len, "pages-1.img".len() + 16);
    let mut name = a[at + 8..at + 8 + name_len].to_vec();
    let ad = [h, &[a[at + 1]]].concat();
    let plain = ak.open_in_place(nonce(2, 0, 0), Aad::from(&ad), &mut name).unwrap();
    assert_eq!(plain, b"pages-1.img");
    at += 8 + name_len + 4;
    // B: a page image block with a bitmap (2 pages: 1 byte), sealed.
    assert_eq!(a[at], b'B');
    let flags = u16::from_le_bytes([a[at + 2], a[at + 3]]);
    assert_eq!(flags, 3, "bitmap and sealed");
    let (raw_len, stored_len) = (u32le(at + 8), u32le(at + 12));
    assert_eq!(&a[at + 16..at + 24], &[0u8; 8], "no data check in the clear");
    assert_eq!(a[at + 28], 0b01, "page 0 is zero");
    let m = 1;
    let payload = &a[at + 32 + m..at + 32 + m + stored_len];
    assert_eq!(xxh3_64(payload) as u32, u32le(at + 24) as u32, "payload check over the sealed payload");
    let mut ad = h.to_vec();
    ad.extend_from_slice(&a[at..at + 28 + m]);
    ad[56 + 24..56 + 28].fill(0);
    let tag = ring::aead::Tag::try_from(&payload[..16]).unwrap();
    let mut body = payload[16..].to_vec();
    let opened = ak.open_in_place_separate_tag(nonce(1, 0, 0), Aad::from(&ad), tag, &mut body, 0..).unwrap();
    let (d, p) = opened.split_at(8);
    assert_eq!(u64::from_le_bytes(d.try_into().unwrap()), xxh3_64(p), "data check of the stored pages");
    assert_eq!(raw_len, data.len());
    assert_eq!(p, &data[4096..], "raw codec: the stored page itself");
    // The index: sealed body, nonce (3, file count, 0).
    let t = a.len() - 32;
    let index_at = u64::from_le_bytes(a[t + 8..t + 16].try_into().unwrap()) as usize;
    assert_eq!(a[index_at], b'I');
    let count = u32le(index_at + 4) as u32;
    let l = u64::from_le_bytes(a[index_at + 8..index_at + 16].try_into().unwrap()) as usize;
    let mut body = a[index_at + 20..index_at + 20 + l].to_vec();
    let plain = ak.open_in_place(nonce(3, count, 0), Aad::from(h), &mut body).unwrap();
    assert_eq!(&plain[8..8 + 11], b"pages-1.img", "the index names the file inside its seal");
}

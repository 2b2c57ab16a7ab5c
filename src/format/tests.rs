//! Round trips of the records through their encoders and decoders; the byte
//! layout itself is proven by `tests/golden.rs`.

use super::*;
use crate::error::Kind;

#[test]
fn new_headers_get_distinct_random_ids() {
    let (a, b) = (Header::new(256 << 10), Header::new(256 << 10));
    assert_ne!(a.archive_id, b.archive_id);
    assert_ne!(a.archive_id, [0; 16]);
    assert_eq!(Header::decode(&a.encode()).unwrap(), a);
}

#[test]
fn trailer_and_index_fixed_part_round_trip() {
    let index = Index::default();
    let bytes = encode_index_and_trailer(&index, 1000, 0);
    let t = Trailer::decode(bytes[bytes.len() - TRAILER_LEN..].try_into().unwrap(), 5).unwrap();
    assert_eq!(t, Trailer { index_offset: 1000, index_len: (bytes.len() - TRAILER_LEN) as u64 });
    let fixed = IndexFixed::decode(bytes[..INDEX_FIXED].try_into().unwrap(), 1000).unwrap();
    assert_eq!(fixed, IndexFixed { count: 0, body_len: 0 });

    let mut damaged = t.encode();
    damaged[9] ^= 1;
    let e = Trailer::decode(&damaged, 5).unwrap_err();
    assert_eq!(e.to_string(), "offset 29: trailer checksum mismatch");
    assert_eq!(e.kind(), Kind::Archive);
}

#[test]
fn file_and_ids_records_round_trip() {
    let field = encode_name_field("dir/pages-1.img", Some(&EntryMeta { mode: 0o644, mtime: -3, mtime_nsec: 7 }));
    let mut rec = Vec::new();
    encode_file_record_bytes(4, &field, FileKind::Pages, &mut rec);
    let f = FileRecord::decode(&rec, 0).unwrap();
    assert_eq!(f, FileRecord { file_id: 4, name: &field, kind: FileKind::Pages });
    let n = NameField::decode(f.name.to_vec(), true, 8).unwrap();
    assert_eq!(n.name, "dir/pages-1.img");
    assert_eq!(n.meta, Some(EntryMeta { mode: 0o644, mtime: -3, mtime_nsec: 7 }));
    assert_eq!(NameField::decode(b"x".to_vec(), false, 8).unwrap(), NameField { name: "x".into(), meta: None });
    assert_eq!(
        NameField::decode(b"x".to_vec(), true, 8).unwrap_err().to_string(),
        "offset 8: tree entry name field is too short"
    );

    let mut rec = Vec::new();
    encode_ids_record(9, &[[1; PAGE_ID_LEN], [2; PAGE_ID_LEN]], &mut rec);
    let fixed = IdsFixed::decode(rec[..IDS_FIXED].try_into().unwrap(), 0).unwrap();
    assert_eq!(fixed, IdsFixed { file_id: 9, count: 2 });
    assert_eq!(decode_ids_body(&rec[IDS_FIXED..], 16).unwrap(), vec![[1; PAGE_ID_LEN], [2; PAGE_ID_LEN]]);
}

#[test]
fn a_block_header_decodes_with_its_length() {
    let mut zero = PageBits::with_pages(3);
    zero.insert(1);
    let h = BlockHeader {
        codec: BlockCodec::Lz4,
        file_id: 2,
        raw_len: 3 * PAGE_SIZE as u32,
        stored_len: 100,
        data_check: 11,
        payload_check: 12,
        zero_bitmap: zero,
        sealed: false,
    };
    let mut rec = Vec::new();
    h.encode(&mut rec);
    assert_eq!(rec.len(), BLOCK_FIXED + 1 + 4);
    assert_eq!(block_header_len(&rec, 0).unwrap(), BLOCK_FIXED + 1);
    rec.extend_from_slice(&[0; 100]);
    let d = BlockHeader::decode(&rec, 0).unwrap();
    assert_eq!(d, DecodedBlockHeader { header: h.clone(), len: BLOCK_FIXED + 1 + 4 });
    assert_eq!((d.header.zero_pages(), d.header.stored_raw_len()), (1, 2 * PAGE_SIZE));
    assert!(d.header.is_zero_page(1) && !d.header.is_zero_page(0) && !d.header.is_zero_page(2));
}

#[test]
fn page_bits_hold_pages_lsb_first() {
    let mut b = PageBits::new();
    assert!(b.is_empty() && !b.contains(0) && b.count() == 0);
    b.insert_growing(9);
    b.insert_growing(0);
    assert_eq!(b.as_bytes(), &[0b1, 0b10]);
    assert!(b.contains(0) && b.contains(9) && !b.contains(8) && !b.contains(1000));
    assert_eq!((b.count(), b.byte_len()), (2, 2));
    assert_eq!(PageBits::from_bytes(vec![0b1, 0b10]), b);
    assert_eq!(PageBits::with_pages(17).as_bytes(), &[0, 0, 0]);
}

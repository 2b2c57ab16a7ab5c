//! Structured mutations of criuz archives: a lenient record walk, edits of
//! records and index entries, and re-sealing so that damage passes the
//! checksums. Pure functions over bytes (only xxHash), so the real-CRIU
//! attack tests of the main crate include this file as a module too.
#![allow(dead_code)]

use std::collections::BTreeMap;
use xxhash_rust::xxh3::xxh3_64;

/// A small, fast PRNG (xorshift64*): reproducible cases from a seed.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }
    pub fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    pub fn below(&mut self, n: usize) -> usize {
        if n == 0 {
            0
        } else {
            (self.next_u64() % n as u64) as usize
        }
    }
}

/// One record of an archive, found by a lenient walk (for mutating).
#[derive(Clone, Copy, Debug)]
pub struct Rec {
    pub kind: u8,
    pub start: usize,
    pub len: usize,
    /// For B records: header length without the seal.
    pub header_len: usize,
}

fn u16le(b: &[u8], at: usize) -> usize {
    u16::from_le_bytes([b[at], b[at + 1]]) as usize
}
fn u32le(b: &[u8], at: usize) -> usize {
    u32::from_le_bytes(b[at..at + 4].try_into().unwrap()) as usize
}
fn u64le(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().unwrap())
}

/// Walks records without checking anything; stops at the first one that
/// does not fit. The index record, if found, is last.
pub fn records(a: &[u8]) -> Vec<Rec> {
    let mut out = Vec::new();
    let mut pos = 64;
    while pos < a.len() {
        let kind = a[pos];
        let (len, header_len) = match kind {
            b'F' if pos + 8 <= a.len() => (12 + u16le(a, pos + 2), 0),
            b'B' if pos + 28 <= a.len() => {
                let raw = u32le(a, pos + 8);
                let m = if u16le(a, pos + 2) & 1 != 0 { raw.div_ceil(4096).div_ceil(8) } else { 0 };
                (32 + m + u32le(a, pos + 12), 28 + m)
            }
            b'E' => (28, 0),
            b'K' if pos + 8 <= a.len() => (28 + u32le(a, pos + 4), 0),
            b'C' if pos + 12 <= a.len() => (16 + u32le(a, pos + 8), 0),
            b'P' if pos + 12 <= a.len() => (24 + 16 * u32le(a, pos + 8), 0),
            b'I' if pos + 16 <= a.len() => {
                let l = u64le(a, pos + 8).min(a.len() as u64) as usize;
                (28 + l, 0)
            }
            _ => break,
        };
        if pos + len > a.len() {
            break;
        }
        out.push(Rec { kind, start: pos, len, header_len });
        pos += len;
        if kind == b'I' {
            break;
        }
    }
    out
}

fn seal_at(a: &mut [u8], start: usize, sealed_len: usize) {
    let s = xxh3_64(&a[start..start + sealed_len]) as u32;
    a[start + sealed_len..start + sealed_len + 4].copy_from_slice(&s.to_le_bytes());
}

/// How much of an archive's checking to redo after a mutation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reseal {
    /// Nothing: the damage stays visible to the checksums.
    None,
    /// Record seals and the header check.
    Seals,
    /// Seals, the index body check and the trailer (a crafted index).
    Index,
    /// Everything, E records and index rebuilt from the stream: a
    /// consistent, different archive (only authentication could tell).
    All,
}

/// Recomputes checks after a mutation, as much as `how` says.
pub fn reseal(a: &mut Vec<u8>, how: Reseal) {
    if how == Reseal::None || a.len() < 64 {
        return;
    }
    let h = xxh3_64(&a[..56]);
    a[56..64].copy_from_slice(&h.to_le_bytes());
    let recs = records(a);
    let (_, with_ids) = table_flags(a);
    // Per file id: (raw size, data checks) as the stream has them.
    let mut files = StreamFiles::new();
    for (k, r) in recs.iter().enumerate() {
        match r.kind {
            b'F' | b'C' | b'K' => seal_at(a, r.start, r.len - 4),
            b'P' => {
                seal_at(a, r.start, 12);
                let c = xxh3_64(&a[r.start + 16..r.start + r.len - 8]);
                a[r.start + r.len - 8..r.start + r.len].copy_from_slice(&c.to_le_bytes());
            }
            b'B' => {
                seal_at(a, r.start, r.header_len);
                let id = u32le(a, r.start + 4) as u32;
                let raw = u32le(a, r.start + 8) as u32;
                let mut entry = a[r.start..r.start + r.header_len + 4].to_vec();
                if with_ids {
                    let next = recs.get(k + 1).filter(|n| n.kind == b'P');
                    let count = next.map_or(0, |n| u32le(a, n.start + 8) as u32);
                    entry.extend_from_slice(&count.to_le_bytes());
                }
                let f = files.entry(id).or_default();
                f.0 += u64::from(raw);
                f.1.extend_from_slice(&a[r.start + 16..r.start + 24]);
                f.2.push((r.start as u64, raw, r.len as u32, entry));
            }
            b'E' => {
                if how == Reseal::All {
                    let id = u32le(a, r.start + 4) as u32;
                    let (size, checks, _) = files.get(&id).cloned().unwrap_or_default();
                    a[r.start + 8..r.start + 16].copy_from_slice(&size.to_le_bytes());
                    a[r.start + 16..r.start + 24].copy_from_slice(&xxh3_64(&checks).to_le_bytes());
                }
                seal_at(a, r.start, 24);
            }
            b'I' => {
                if how == Reseal::All {
                    rebuild_index(a, r, &files);
                } else {
                    seal_at(a, r.start, 16);
                    let body = r.len - 28;
                    let c = xxh3_64(&a[r.start + 20..r.start + 20 + body]);
                    a[r.start + 20 + body..r.start + 28 + body].copy_from_slice(&c.to_le_bytes());
                }
                if matches!(how, Reseal::Index | Reseal::All) {
                    fix_trailer(a, r.start);
                }
            }
            _ => {}
        }
    }
}

/// Per file id: raw size, data checks, and per block (offset, raw_len,
/// record_len, its block-table entry: header bytes with seal, then the P
/// count when the archive has page ids).
type StreamFiles = BTreeMap<u32, (u64, Vec<u8>, Vec<(u64, u32, u32, Vec<u8>)>)>;

/// (block table, page ids) flags of the archive's header.
fn table_flags(a: &[u8]) -> (bool, bool) {
    if a.len() < 12 {
        return (false, false);
    }
    let flags = u16le(a, 10);
    (flags & 4 != 0, flags & 2 != 0)
}

/// Length of the block-table entry at `at` (0 without a table).
fn table_entry_len(a: &[u8], at: usize, end: usize) -> usize {
    let (table, ids) = table_flags(a);
    if !table {
        return 0;
    }
    if at + 28 > end {
        return end - at.min(end);
    }
    let raw = u32le(a, at + 8);
    let m = if u16le(a, at + 2) & 1 != 0 { raw.div_ceil(4096).div_ceil(8) } else { 0 };
    32 + m + if ids { 4 } else { 0 }
}

/// Rewrites the block lists, sizes and checks of the index entries as the
/// stream has them (names and kinds stay).
fn rebuild_index(a: &mut Vec<u8>, r: &Rec, files: &StreamFiles) {
    let count = u32le(a, r.start + 4);
    let body = a[r.start + 20..r.start + r.len - 8].to_vec();
    let mut out = Vec::new();
    let mut p = 0;
    for _ in 0..count {
        if p + 8 > body.len() {
            return;
        }
        let id = u32le(&body, p) as u32;
        let n = u16le(&body, p + 6);
        if p + 8 + n + 28 > body.len() {
            return;
        }
        let nb = u32le(&body, p + 8 + n + 24);
        let mut next = p + 8 + n + 28;
        for _ in 0..nb {
            // A mutated count can be in the billions: past the body's end no
            // step moves `next`, so stop there rather than count them all.
            if next >= body.len() {
                break;
            }
            let step = 16 + table_entry_len(a, r.start + 20 + next + 16, r.start + r.len - 8);
            next = (next + step).min(body.len());
        }
        out.extend_from_slice(&body[p..p + 8 + n]);
        let (size, checks, blocks) = files.get(&id).cloned().unwrap_or_default();
        out.extend_from_slice(&size.to_le_bytes());
        out.extend_from_slice(&xxh3_64(&checks).to_le_bytes());
        out.extend_from_slice(&body[p + 8 + n + 16..p + 8 + n + 24]);
        out.extend_from_slice(&(blocks.len() as u32).to_le_bytes());
        let table = table_flags(a).0;
        for (off, raw, len, entry) in blocks {
            out.extend_from_slice(&off.to_le_bytes());
            out.extend_from_slice(&raw.to_le_bytes());
            out.extend_from_slice(&len.to_le_bytes());
            if table {
                out.extend_from_slice(&entry);
            }
        }
        p = next;
    }
    let mut rec = a[r.start..r.start + 8].to_vec();
    rec.extend_from_slice(&(out.len() as u64).to_le_bytes());
    let s = xxh3_64(&rec) as u32;
    rec.extend_from_slice(&s.to_le_bytes());
    rec.extend_from_slice(&out);
    rec.extend_from_slice(&xxh3_64(&out).to_le_bytes());
    let tail = a.split_off(r.start + r.len);
    a.truncate(r.start);
    a.extend_from_slice(&rec);
    if tail.len() >= 32 {
        a.extend_from_slice(&tail[tail.len() - 32..]);
    } else {
        a.extend_from_slice(&tail);
    }
}

fn fix_trailer(a: &mut [u8], index_start: usize) {
    if a.len() < index_start + 32 {
        return;
    }
    let t = a.len() - 32;
    a[t..t + 8].copy_from_slice(b"CRIUZEND");
    a[t + 8..t + 16].copy_from_slice(&(index_start as u64).to_le_bytes());
    a[t + 16..t + 24].copy_from_slice(&((t - index_start) as u64).to_le_bytes());
    let c = xxh3_64(&a[t..t + 24]);
    a[t + 24..t + 32].copy_from_slice(&c.to_le_bytes());
}

/// Byte offsets of the index's block references: (entry file id, position
/// of the 16-byte reference in the archive); with a block table, the
/// block's table entry follows its reference (see [`index_entries`]).
pub fn index_refs(a: &[u8]) -> Vec<(u32, usize)> {
    index_entries(a).into_iter().map(|(id, at, _)| (id, at)).collect()
}

/// Like [`index_refs`], with the length of each whole entry (16, plus the
/// table entry when the archive has a block table).
pub fn index_entries(a: &[u8]) -> Vec<(u32, usize, usize)> {
    let Some(r) = records(a).into_iter().find(|r| r.kind == b'I') else { return Vec::new() };
    let count = u32le(a, r.start + 4);
    let (body, end) = (r.start + 20, r.start + r.len - 8);
    let mut refs = Vec::new();
    let mut p = body;
    for _ in 0..count {
        if p + 8 > end {
            break;
        }
        let id = u32le(a, p) as u32;
        let n = u16le(a, p + 6);
        if p + 8 + n + 28 > end {
            break;
        }
        let nb = u32le(a, p + 8 + n + 24);
        p += 8 + n + 28;
        for _ in 0..nb {
            let len = 16 + table_entry_len(a, p + 16, end);
            if p + len > end {
                return refs;
            }
            refs.push((id, p, len));
            p += len;
        }
    }
    refs
}

/// Applies one structured mutation; returns its name.
pub fn mutate(a: &mut Vec<u8>, other: &[u8], rng: &mut Rng) -> &'static str {
    if a.is_empty() {
        return "none"; // an earlier mutation truncated it all away
    }
    let recs = records(a);
    let blocks: Vec<Rec> = recs.iter().copied().filter(|r| r.kind == b'B').collect();
    let pick = |rng: &mut Rng, v: &[Rec]| v.get(rng.below(v.len())).copied();
    match rng.below(17) {
        0 => {
            let n = 1 + rng.below(3);
            for _ in 0..n {
                let i = rng.below(a.len());
                a[i] ^= 1 << rng.below(8);
            }
            "flip"
        }
        1 => {
            let n = rng.below(a.len());
            a.truncate(n);
            "truncate"
        }
        2 | 3 => {
            // Swap two block records of equal length (same file or not).
            let (Some(x), Some(y)) = (pick(rng, &blocks), pick(rng, &blocks)) else { return "none" };
            if x.len == y.len && x.start != y.start {
                let bx = a[x.start..x.start + x.len].to_vec();
                let by = a[y.start..y.start + y.len].to_vec();
                a[x.start..x.start + x.len].copy_from_slice(&by);
                a[y.start..y.start + y.len].copy_from_slice(&bx);
                "swap-blocks"
            } else {
                // Swap unequal records by rebuilding the stream.
                let (x, y) = if x.start < y.start { (x, y) } else { (y, x) };
                if x.start == y.start {
                    return "none";
                }
                let mut out = a[..x.start].to_vec();
                out.extend_from_slice(&a[y.start..y.start + y.len]);
                out.extend_from_slice(&a[x.start + x.len..y.start]);
                out.extend_from_slice(&a[x.start..x.start + x.len]);
                out.extend_from_slice(&a[y.start + y.len..]);
                *a = out;
                "swap-unequal-blocks"
            }
        }
        4 => {
            // Duplicate a block record over another of the same length.
            let (Some(x), Some(y)) = (pick(rng, &blocks), pick(rng, &blocks)) else { return "none" };
            if x.len != y.len || x.start == y.start {
                return "none";
            }
            let bx = a[x.start..x.start + x.len].to_vec();
            a[y.start..y.start + y.len].copy_from_slice(&bx);
            "duplicate-block"
        }
        5 => {
            // Insert a copy of a record right after itself.
            let Some(x) = pick(rng, &recs) else { return "none" };
            let copy = a[x.start..x.start + x.len].to_vec();
            a.splice(x.start + x.len..x.start + x.len, copy);
            "insert-copy"
        }
        6 => {
            let Some(x) = pick(rng, &recs) else { return "none" };
            a.drain(x.start..x.start + x.len);
            "drop-record"
        }
        7 | 8 => {
            // Re-point an index reference at another block (of any file).
            let refs = index_entries(a);
            let (Some(&(_, at, len)), Some(y)) = (refs.get(rng.below(refs.len())), pick(rng, &blocks)) else {
                return "none";
            };
            a[at..at + 8].copy_from_slice(&(y.start as u64).to_le_bytes());
            if rng.below(2) == 0 {
                let raw = u32le(a, y.start + 8) as u32;
                a[at + 8..at + 12].copy_from_slice(&raw.to_le_bytes());
                a[at + 12..at + 16].copy_from_slice(&(y.len as u32).to_le_bytes());
                // With a block table: its entry too, when it fits.
                if len > 16 && y.header_len + 4 <= len - 16 {
                    let header = a[y.start..y.start + y.header_len + 4].to_vec();
                    a[at + 16..at + 16 + header.len()].copy_from_slice(&header);
                }
            }
            "repoint-index"
        }
        9 => {
            // Swap two index references.
            let refs = index_entries(a);
            if refs.len() < 2 {
                return "none";
            }
            let ((_, i, li), (_, j, lj)) = (refs[rng.below(refs.len())], refs[rng.below(refs.len())]);
            // Whole entries (reference and table entry) when they are of a size.
            let n = if li == lj && rng.below(2) == 0 { li } else { 16 };
            let ri = a[i..i + n].to_vec();
            let rj = a[j..j + n].to_vec();
            a[i..i + n].copy_from_slice(&rj);
            a[j..j + n].copy_from_slice(&ri);
            "swap-index-refs"
        }
        10 => {
            // A block of another archive in place of one of ours.
            let theirs: Vec<Rec> = records(other).into_iter().filter(|r| r.kind == b'B').collect();
            let (Some(x), Some(y)) = (pick(rng, &blocks), theirs.get(rng.below(theirs.len())).copied()) else {
                return "none";
            };
            let file_id = a[x.start + 4..x.start + 8].to_vec();
            a.splice(x.start..x.start + x.len, other[y.start..y.start + y.len].iter().copied());
            if rng.below(2) == 0 {
                a[x.start + 4..x.start + 8].copy_from_slice(&file_id);
            }
            "splice-foreign-block"
        }
        11 => {
            // Edit a field of a block header: file id, raw_len, stored_len, codec, flags.
            let Some(x) = pick(rng, &blocks) else { return "none" };
            let field = [4usize, 8, 12, 1, 2][rng.below(5)];
            let v = rng.next_u64() as u8;
            a[x.start + field] = if rng.below(2) == 0 { a[x.start + field].wrapping_add(1) } else { v };
            "edit-block-field"
        }
        12 => {
            // Edit an E record or an F record field.
            let ends: Vec<Rec> = recs.iter().copied().filter(|r| matches!(r.kind, b'E' | b'F')).collect();
            let Some(x) = pick(rng, &ends) else { return "none" };
            let at = x.start + 1 + rng.below(x.len - 5);
            a[at] = a[at].wrapping_add(1 + rng.below(255) as u8);
            "edit-file-record"
        }
        14 | 15 => {
            // Re-point or reorder the references of a dedup block, its
            // payload check and seal recomputed: only the data check (after
            // resolving) can tell.
            let dedup: Vec<Rec> = blocks.iter().copied().filter(|r| a[r.start + 1] == 3).collect();
            let Some(x) = pick(rng, &dedup) else { return "none" };
            let payload = x.start + x.header_len + 4;
            let end = x.start + x.len;
            if payload + 4 > end {
                return "none";
            }
            let n = u32le(a, payload);
            let ext = |i: usize| payload + 4 + 20 * i;
            if n == 0 || ext(n) > end {
                return "none";
            }
            let i = rng.below(n);
            let what = if rng.below(2) == 0 {
                // A field of one extent: source, file id, block, first or count.
                let field = [0usize, 4, 8, 12, 16][rng.below(5)];
                let at = ext(i) + field;
                let v = u32le(a, at) as u32;
                let new = match rng.below(3) {
                    0 => v.wrapping_add(1),
                    1 => v.wrapping_sub(1),
                    _ => rng.below(8) as u32,
                };
                let w = if field == 0 { 2 } else { 4 };
                a[at..at + w].copy_from_slice(&new.to_le_bytes()[..w]);
                "edit-dedup-extent"
            } else {
                let j = rng.below(n);
                let (ei, ej) = (a[ext(i)..ext(i) + 20].to_vec(), a[ext(j)..ext(j) + 20].to_vec());
                a[ext(i)..ext(i) + 20].copy_from_slice(&ej);
                a[ext(j)..ext(j) + 20].copy_from_slice(&ei);
                "swap-dedup-extents"
            };
            let c = xxh3_64(&a[x.start + x.header_len + 4..end]) as u32;
            a[x.start + 24..x.start + 28].copy_from_slice(&c.to_le_bytes());
            seal_at(a, x.start, x.header_len);
            what
        }
        16 => {
            // Drop or add a page id in a P record (count and checks fixed):
            // the record then lists the wrong pages for its block.
            let ids: Vec<Rec> = recs.iter().copied().filter(|r| r.kind == b'P').collect();
            let Some(x) = pick(rng, &ids) else { return "none" };
            let n = u32le(a, x.start + 8);
            let new = if n > 0 && rng.below(2) == 0 {
                a.drain(x.start + 16..x.start + 32);
                n - 1
            } else {
                let id: Vec<u8> = (0..16).map(|_| rng.next_u64() as u8).collect();
                a.splice(x.start + 16..x.start + 16, id);
                n + 1
            };
            a[x.start + 8..x.start + 12].copy_from_slice(&(new as u32).to_le_bytes());
            seal_at(a, x.start, 12);
            let end = x.start + 24 + 16 * new;
            let c = xxh3_64(&a[x.start + 16..end - 8]);
            a[end - 8..end].copy_from_slice(&c.to_le_bytes());
            "resize-page-ids"
        }
        _ => {
            // Random bytes inserted somewhere.
            let at = rng.below(a.len());
            let n = 1 + rng.below(64);
            let bytes: Vec<u8> = (0..n).map(|_| rng.next_u64() as u8).collect();
            a.splice(at..at, bytes);
            "insert-garbage"
        }
    }
}

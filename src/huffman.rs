//! zstd frames of Huffman-coded bytes, coded with a table made from a
//! histogram the caller already has: the high plane of 16-bit floats.
//!
//! Why: zstd at its fastest setting spends most of its time on such a plane
//! in two passes, its histogram of the plane and its Huffman coder (one
//! core, 128 MiB of bf16 in 256 KiB blocks: 0.44 ns a block byte, of which
//! the histogram about two fifths). The planes' trial has already counted a
//! sample of the block, so the histogram pass is spent twice. Here the table
//! is made from the sample's counts, with a code for every byte value
//! between the plane's least and greatest byte (found in one vectorised
//! pass): every byte of the plane has a code, whatever the sample missed.
//! Same bench: 0.26 ns a block byte, 0.325 of the plane as zstd stores it.
//!
//! What is written is an ordinary zstd frame (RFC 8878): a single-segment
//! frame header, then per 128 KiB of input one compressed block holding
//! only literals (a Huffman table and four streams) and no sequences.
//! Readers decode it as any other frame; the archive format is unchanged.
//!
//! The coder is zstd's own (`HUF_*`), linked from the zstd-sys build that
//! the zstd crate uses. Those functions are not zstd's public API: their
//! signatures below are zstd 1.5.7's, and they are called only when the
//! linked library says it is that version. Elsewhere [`frame`] says no and
//! the caller compresses with zstd as before; this module's tests then
//! fail, so that an update of zstd-sys is noticed and these signatures
//! checked against the new version's `huf.h`.

use std::ffi::{c_int, c_uint, c_void};

/// The zstd whose internal Huffman signatures are declared below (1.5.7).
const ZSTD_VERSION: u32 = 10507;

/// The most literals one zstd block holds (`ZSTD_BLOCKSIZE_MAX`).
const BLOCK_MAX: usize = 128 << 10;

/// Longest code (`HUF_TABLELOG_DEFAULT`, what zstd itself uses at fast levels).
const MAX_CODE_BITS: c_uint = 11;

/// How much a byte counted in the sample weighs against one it missed
/// (which gets a count of 1 and so one of the longest codes).
const SAMPLE_WEIGHT: u32 = 16;

/// Table slots: `HUF_CTABLE_SIZE_ST(255)`.
const CTABLE_LEN: usize = 257;

/// Scratch for building and writing a table: at least
/// `HUF_CTABLE_WORKSPACE_SIZE` (4,864 bytes), 8-byte aligned.
const WORKSPACE_U64: usize = 1024;

/// Frame header: magic, descriptor (single segment, 4-byte content size).
const MAGIC: u32 = 0xFD2F_B528;
const SINGLE_SEGMENT_FCS4: u8 = 0xA0;

/// Literals section header of a Huffman-coded block in four streams with
/// 18-bit sizes (`Size_Format` 3): 5 bytes.
const LITERALS_HEADER: usize = 5;

mod ffi {
    use super::*;
    // zstd 1.5.7, lib/common/huf.h; `HUF_CElt` is `size_t`.
    extern "C" {
        pub fn HUF_buildCTable_wksp(
            tree: *mut usize,
            count: *const c_uint,
            max_symbol_value: c_uint,
            max_nb_bits: c_uint,
            workspace: *mut c_void,
            workspace_size: usize,
        ) -> usize;
        pub fn HUF_writeCTable_wksp(
            dst: *mut c_void,
            max_dst_size: usize,
            ctable: *const usize,
            max_symbol_value: c_uint,
            huff_log: c_uint,
            workspace: *mut c_void,
            workspace_size: usize,
        ) -> usize;
        pub fn HUF_compress4X_usingCTable(
            dst: *mut c_void,
            dst_size: usize,
            src: *const c_void,
            src_size: usize,
            ctable: *const usize,
            flags: c_int,
        ) -> usize;
    }
}

/// `HUF_flags_bmi2`: the coder's BMI2 build, for CPUs that have BMI1 and
/// BMI2 (zstd's own test). A zstd built without that variant ignores it.
fn bmi2_flag() -> c_int {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("bmi1") && std::arch::is_x86_feature_detected!("bmi2") {
        return 1;
    }
    0
}

fn is_error(code: usize) -> bool {
    // SAFETY: a pure function of its argument.
    unsafe { zstd::zstd_safe::zstd_sys::ZSTD_isError(code) != 0 }
}

/// A zstd frame of `src`, Huffman-coded with a table from `sample` (byte
/// counts of a sample of such bytes); None where the linked zstd is another
/// version, where `src` holds one byte value (zstd stores that as a run),
/// or where the frame would not be smaller than `src`.
pub fn frame(src: &[u8], sample: &[u32; 256]) -> Option<Vec<u8>> {
    if src.is_empty() || zstd::zstd_safe::version_number() != ZSTD_VERSION {
        return None;
    }
    let content_size = u32::try_from(src.len()).ok()?;
    let (least, greatest) = byte_range(src);
    let mut workspace = [0u64; WORKSPACE_U64];
    let table = Table::new(sample, least, greatest, &mut workspace)?;
    let mut out = Vec::with_capacity(src.len() + 16);
    out.extend_from_slice(&MAGIC.to_le_bytes());
    out.push(SINGLE_SEGMENT_FCS4);
    out.extend_from_slice(&content_size.to_le_bytes());
    // Blocks of equal size, so that none is too short for four streams.
    let blocks = src.len().div_ceil(BLOCK_MAX);
    let per_block = src.len().div_ceil(blocks);
    for (i, literals) in src.chunks(per_block).enumerate() {
        let last = i + 1 == blocks;
        if !table.append_block(literals, last, &mut workspace, &mut out) || out.len() >= src.len() {
            return None;
        }
    }
    Some(out)
}

/// A Huffman table (zstd's `HUF_CElt` array) with a code for every byte
/// value from `least` to `greatest`.
struct Table {
    codes: [usize; CTABLE_LEN],
    max_symbol: c_uint,
    code_bits: c_uint,
    /// `HUF_flags_bmi2` where the CPU has BMI2 (the coder's faster build).
    flags: c_int,
}

impl Table {
    /// The table for bytes in `least..=greatest` counted as `sample` counts
    /// them, each at least once; None for a single value or a zstd error.
    fn new(sample: &[u32; 256], least: u8, greatest: u8, workspace: &mut [u64; WORKSPACE_U64]) -> Option<Self> {
        if least >= greatest {
            return None;
        }
        let mut count = [0 as c_uint; 256];
        for byte in least..=greatest {
            let b = usize::from(byte);
            count[b] = sample[b].saturating_mul(SAMPLE_WEIGHT).saturating_add(1);
        }
        let mut table =
            Table { codes: [0; CTABLE_LEN], max_symbol: c_uint::from(greatest), code_bits: 0, flags: bmi2_flag() };
        // SAFETY: `codes` has `HUF_CTABLE_SIZE_ST(max_symbol)` slots
        // (max_symbol <= 255), `count` `max_symbol + 1` counts, the
        // workspace the size given.
        let code_bits = unsafe {
            ffi::HUF_buildCTable_wksp(
                table.codes.as_mut_ptr(),
                count.as_ptr(),
                table.max_symbol,
                MAX_CODE_BITS,
                workspace.as_mut_ptr().cast(),
                std::mem::size_of_val(workspace),
            )
        };
        if is_error(code_bits) {
            return None;
        }
        table.code_bits = c_uint::try_from(code_bits).ok()?;
        Some(table)
    }

    /// Appends one compressed block of `literals` (bytes the table codes)
    /// and no sequences; false (and `out` as it was) where the block would
    /// not be smaller than `literals`.
    fn append_block(
        &self,
        literals: &[u8],
        last: bool,
        workspace: &mut [u64; WORKSPACE_U64],
        out: &mut Vec<u8>,
    ) -> bool {
        let start = out.len();
        // Block header (3 bytes) and literals header, filled in below; room
        // for the coded literals up to the size that would not pay.
        let room = literals.len();
        out.reserve(3 + LITERALS_HEADER + room + 1);
        let body = start + 3 + LITERALS_HEADER;
        let dst = out.spare_capacity_mut().as_mut_ptr().cast::<u8>();
        // SAFETY: `dst + (body - start)` is writable for `room` bytes
        // (reserved above); zstd writes at most the size it is given and
        // returns how much it wrote or an error. The table was built for
        // `max_symbol` and `code_bits`, and codes every byte of `literals`
        // (`frame` made it from their range).
        let coded = unsafe {
            let at = dst.add(body - start);
            let table_len = ffi::HUF_writeCTable_wksp(
                at.cast(),
                room,
                self.codes.as_ptr(),
                self.max_symbol,
                self.code_bits,
                workspace.as_mut_ptr().cast(),
                std::mem::size_of_val(workspace),
            );
            if is_error(table_len) || table_len >= room {
                return false;
            }
            let streams = ffi::HUF_compress4X_usingCTable(
                at.add(table_len).cast(),
                room - table_len,
                literals.as_ptr().cast(),
                literals.len(),
                self.codes.as_ptr(),
                self.flags,
            );
            if is_error(streams) || streams == 0 {
                return false;
            }
            table_len + streams
        };
        // Literals header, then a sequences section of no sequences (one 0).
        let block_len = LITERALS_HEADER + coded + 1;
        if block_len + 3 >= literals.len() {
            return false;
        }
        // SAFETY: zstd initialised `coded` bytes from `body` on, within the
        // capacity reserved above; the headers are written next.
        unsafe { out.set_len(body + coded) };
        out.push(0);
        let (regenerated, compressed) = (literals.len() as u64, coded as u64);
        let literals_header = 2 | 3 << 2 | regenerated << 4 | compressed << 22;
        out[start + 3..body].copy_from_slice(&literals_header.to_le_bytes()[..LITERALS_HEADER]);
        let block_header = u32::from(last) | 2 << 1 | (block_len as u32) << 3;
        out[start..start + 3].copy_from_slice(&block_header.to_le_bytes()[..3]);
        true
    }
}

/// The least and greatest byte of `src` (not empty), 32 lanes at a time
/// (the compiler makes each lane's min and max vector instructions).
fn byte_range(src: &[u8]) -> (u8, u8) {
    let (mut least, mut greatest) = ([u8::MAX; 32], [0u8; 32]);
    let mut chunks = src.chunks_exact(32);
    for chunk in &mut chunks {
        for (i, &b) in chunk.iter().enumerate() {
            least[i] = least[i].min(b);
            greatest[i] = greatest[i].max(b);
        }
    }
    for &b in chunks.remainder() {
        least[0] = least[0].min(b);
        greatest[0] = greatest[0].max(b);
    }
    (least.into_iter().min().unwrap_or(0), greatest.into_iter().max().unwrap_or(0))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::planes::byte_histogram as histogram;
    use crate::planes::tests::xorshift;

    /// Bytes drawn from a skewed distribution over `lo..=hi`, as a float
    /// plane's exponents are, with `rare` bytes anywhere in 0..=255.
    fn skewed(len: usize, lo: u8, hi: u8, rare: usize, seed: u64) -> Vec<u8> {
        let mut next = xorshift(seed);
        let span = u64::from(hi - lo) + 1;
        let mut v: Vec<u8> = (0..len)
            .map(|_| {
                let r = next();
                // The least of three draws: most bytes near `lo`.
                let d = (r % span).min((r >> 20) % span).min((r >> 40) % span);
                lo + d as u8
            })
            .collect();
        for _ in 0..rare.min(len) {
            let r = next();
            v[(r % len as u64) as usize] = (r >> 32) as u8;
        }
        v
    }

    fn decode(frame: &[u8], len: usize) -> Vec<u8> {
        zstd::bulk::decompress(frame, len).expect("an ordinary zstd frame")
    }

    #[test]
    fn a_frame_decodes_to_its_bytes_with_zstd_at_every_size_and_sample() {
        for (i, len) in
            [16 << 10, (16 << 10) + 1, 100_000, 128 << 10, (128 << 10) + 1, 300_001, 1 << 20].into_iter().enumerate()
        {
            let plane = skewed(len, 0x70, 0x7E, 0, i as u64 + 1);
            // The sample: the plane's own head, a distribution that misses
            // bytes the plane has, and nothing at all.
            let own = histogram(&plane[..8192]);
            let narrow = histogram(&skewed(8192, 0x74, 0x76, 0, 99));
            for sample in [own, narrow, [0; 256]] {
                let out = frame(&plane, &sample).unwrap_or_else(|| panic!("{len} bytes"));
                assert!(out.len() < len * 3 / 4, "{len} bytes coded to {}", out.len());
                assert_eq!(decode(&out, len), plane, "{len} bytes");
            }
        }
    }

    #[test]
    fn bytes_the_sample_never_saw_still_have_codes() {
        // Rare bytes anywhere in 0..=255, two values, and the full range.
        let cases = [skewed(64 << 10, 0x60, 0x7F, 40, 7), skewed(64 << 10, 3, 4, 0, 8), skewed(64 << 10, 0, 255, 0, 9)];
        for plane in cases {
            let sample = histogram(&skewed(8192, 0x70, 0x72, 0, 10));
            if let Some(out) = frame(&plane, &sample) {
                assert_eq!(decode(&out, plane.len()), plane);
            }
        }
        // A skewed plane with rare outliers must compress, outliers and all.
        let plane = skewed(64 << 10, 0x60, 0x6F, 40, 11);
        let out = frame(&plane, &histogram(&plane[..4096])).expect("a skewed plane compresses");
        assert_eq!(decode(&out, plane.len()), plane);
    }

    #[test]
    fn no_frame_where_it_would_not_pay_or_zstd_stores_a_run() {
        let mut next = xorshift(5);
        let noise: Vec<u8> = (0..65536).map(|_| next() as u8).collect();
        assert!(frame(&noise, &histogram(&noise)).is_none());
        assert!(frame(&[9u8; 65536], &[0; 256]).is_none());
        assert!(frame(&[], &[0; 256]).is_none());
    }

    #[test]
    fn short_input_gets_no_frame_or_one_that_decodes() {
        // The planes' blocks are 16 KiB or more; the function takes any
        // length, and four streams need at least six literals.
        for len in 1..300 {
            let plane = skewed(len, 0x70, 0x73, 0, len as u64);
            if let Some(out) = frame(&plane, &histogram(&plane)) {
                assert_eq!(decode(&out, len), plane, "{len} bytes");
            }
        }
    }

    #[test]
    fn byte_range_is_the_least_and_greatest_byte() {
        let mut next = xorshift(3);
        for len in [1, 31, 32, 33, 1000] {
            let v: Vec<u8> = (0..len).map(|_| 50 + (next() % 100) as u8).collect();
            let want = (*v.iter().min().unwrap(), *v.iter().max().unwrap());
            assert_eq!(byte_range(&v), want, "{len}");
        }
    }
}

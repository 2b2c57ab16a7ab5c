//! The decoding side: one reader's [`Decoder`] (its zstd context and
//! planes buffer kept across blocks) checks a stored block against its
//! record and rebuilds the image bytes, zero pages included.

use super::{check_parts, DecodeError};
use crate::format::{BlockCodec, BlockHeader, PlanesPrefix, PAGE_SIZE};
use crate::planes;
use std::sync::Arc;
use xxhash_rust::xxh3::xxh3_64;

pub struct Decoder {
    zstd: zstd::bulk::Decompressor<'static>,
    planes: Vec<u8>,
}

impl Default for Decoder {
    fn default() -> Self {
        Self::new()
    }
}

impl Decoder {
    pub fn new() -> Self {
        Decoder { zstd: zstd::bulk::Decompressor::new().expect("zstd context"), planes: Vec::new() }
    }

    /// Decodes a block into `out` (replacing its contents) and checks its data
    /// checksum. The error says what is wrong; the caller adds where.
    ///
    /// The stored pages are decoded into `out` and then moved out to their
    /// places in it, last first, with the zero pages filled in between: every
    /// move is a whole number of pages, where copying them from a second
    /// buffer at whatever offset the heap gave it may crawl (see
    /// [`PageBuf`](super::PageBuf): in a restore the two buffers sat 16 bytes
    /// apart modulo a page).
    pub fn decode(&mut self, header: &BlockHeader, payload: &[u8], out: &mut Vec<u8>) -> Result<(), DecodeError> {
        self.decode_stored(header, payload, out)?;
        if header.zero_pages() > 0 {
            spread_stored_pages(header, out);
        }
        Ok(())
    }

    /// Checks a raw block's payload, which is its stored pages as they are.
    pub fn check_raw(&self, header: &BlockHeader, payload: &[u8]) -> Result<(), DecodeError> {
        check_parts(header, &[payload])
    }

    /// Decodes only the stored pages of a block (zero pages left out) into
    /// `stored` and checks them against the block's data check.
    pub fn decode_stored(
        &mut self,
        header: &BlockHeader,
        payload: &[u8],
        stored: &mut Vec<u8>,
    ) -> Result<(), DecodeError> {
        stored.clear();
        self.decode_stored_after(header, payload, stored)
    }

    /// As [`decode_stored`](Self::decode_stored), appending to what `stored`
    /// holds (onto a page boundary its caller chose).
    pub fn decode_stored_after(
        &mut self,
        header: &BlockHeader,
        payload: &[u8],
        stored: &mut Vec<u8>,
    ) -> Result<(), DecodeError> {
        let at = stored.len();
        self.decompress_after(header.codec, payload, header.stored_raw_len(), stored)?;
        if xxh3_64(&stored[at..]) != header.data_check {
            return Err(DecodeError::DataCheck);
        }
        Ok(())
    }

    /// Decompresses `payload` to exactly `expect` bytes (no data check: the
    /// caller checks what the bytes become part of).
    pub fn decompress(
        &mut self,
        codec: BlockCodec,
        payload: &[u8],
        expect: usize,
        out: &mut Vec<u8>,
    ) -> Result<(), DecodeError> {
        out.clear();
        self.decompress_after(codec, payload, expect, out)
    }

    /// As [`decompress`](Self::decompress), appending to what `out` holds
    /// (without moving it when its capacity suffices: a caller can decode
    /// onto a page boundary it chose).
    pub fn decompress_after(
        &mut self,
        codec: BlockCodec,
        payload: &[u8],
        expect: usize,
        out: &mut Vec<u8>,
    ) -> Result<(), DecodeError> {
        let at = out.len();
        match codec {
            BlockCodec::Dedup => return Err(DecodeError::Unresolved),
            BlockCodec::Lz4Planes | BlockCodec::ZstdPlanes => {
                let (prefix, low, high) = PlanesPrefix::decode(payload)?;
                // A raw plane is joined from where it lies in the payload; a
                // compressed one is decoded first (the low plane before the
                // high one, into one buffer).
                let mut planar = std::mem::take(&mut self.planes);
                planar.clear();
                let (low_len, high_len) = (expect.div_ceil(2), expect / 2);
                let mut plane = |compressed: bool, stored: &[u8], len: usize, planar: &mut Vec<u8>| {
                    if compressed {
                        self.decompress_after(codec.without_planes(), stored, len, planar)
                    } else if stored.len() != len {
                        Err(DecodeError::RawLength { got: stored.len(), expect: len })
                    } else {
                        Ok(())
                    }
                };
                let decoded = plane(prefix.low_compressed, low, low_len, &mut planar).and_then(|()| {
                    let at = planar.len();
                    plane(prefix.high_compressed, high, high_len, &mut planar).map(|()| at)
                });
                if let Ok(at) = decoded {
                    let even = if prefix.low_compressed { &planar[..at] } else { low };
                    let odd = if prefix.high_compressed { &planar[at..] } else { high };
                    planes::join_into(even, odd, out);
                }
                self.planes = planar;
                return decoded.map(|_| ());
            }
            BlockCodec::Raw => {
                if payload.len() != expect {
                    return Err(DecodeError::RawLength { got: payload.len(), expect });
                }
                out.extend_from_slice(payload);
            }
            BlockCodec::Lz4 => {
                out.reserve(expect);
                // SAFETY: LZ4_decompress_safe reads `payload.len()` bytes and
                // writes at most `expect` bytes into `out`'s spare capacity
                // (at least `expect` after `reserve`); it returns the count
                // written, or a negative value on bad input.
                let n = unsafe {
                    lz4::liblz4::LZ4_decompress_safe(
                        payload.as_ptr().cast(),
                        out.as_mut_ptr().add(at).cast(),
                        payload.len() as i32,
                        expect as i32,
                    )
                };
                if n < 0 {
                    return Err(DecodeError::Lz4);
                }
                // SAFETY: LZ4 initialised the `n` (<= expect) bytes after `at`.
                unsafe { out.set_len(at + n as usize) };
                if n as usize != expect {
                    return Err(DecodeError::Lz4Length { got: n as usize, expect });
                }
            }
            BlockCodec::Zstd => {
                out.reserve(expect);
                let mut after = std::io::Cursor::new(&mut *out);
                after.set_position(at as u64);
                let n =
                    self.zstd.decompress_to_buffer(payload, &mut after).map_err(|e| DecodeError::Zstd(Arc::new(e)))?;
                if n != expect {
                    return Err(DecodeError::ZstdLength { got: n, expect });
                }
            }
        }
        Ok(())
    }
}

/// Turns `buf`, a block's stored pages (as checked), into the whole block:
/// each stored page moved to its own place, from the last to the first, so
/// that no page is overwritten before it has moved (a page never moves
/// back), and the zero pages filled in.
fn spread_stored_pages(header: &BlockHeader, buf: &mut Vec<u8>) {
    let raw_len = header.raw_len as usize;
    let stored_len = buf.len();
    let mut stored_end = stored_len;
    buf.resize(raw_len, 0);
    for p in (0..header.pages()).rev() {
        let start = p * PAGE_SIZE;
        let len = PAGE_SIZE.min(raw_len - start);
        if header.is_zero_page(p) {
            // Past the stored bytes, `resize` left zeros already.
            let dirty_end = (start + len).min(stored_len);
            if start < dirty_end {
                buf[start..dirty_end].fill(0);
            }
        } else {
            stored_end -= len;
            if stored_end != start {
                buf.copy_within(stored_end..stored_end + len, start);
            }
        }
    }
    debug_assert_eq!(stored_end, 0, "stored pages left over");
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::codec::{scatter, CodecConfig, Encoder};
    use crate::planes::tests::xorshift;

    /// Every mix of zero and stored pages, the last page whole or cut,
    /// decodes to what `scatter` rebuilds from the stored pages, into a
    /// buffer that held a larger block before (its stale bytes must not
    /// show through a zero page).
    #[test]
    fn stored_pages_spread_in_place_match_a_scatter_into_a_second_buffer() {
        let mut rng = xorshift(33);
        let mut dec = Decoder::new();
        let mut out = vec![0xa5; 80 * PAGE_SIZE];
        for case in 0..200 {
            let pages = 1 + case % 17;
            let cut = if case % 3 == 0 { 1000 } else { 0 };
            let len = pages * PAGE_SIZE - cut;
            let mut data = vec![0u8; len];
            for (p, page) in data.chunks_mut(PAGE_SIZE).enumerate() {
                // Mostly stored pages, some zero; page 0 of every 5th case zero.
                if (rng() % 3 != 0) && !(case % 5 == 0 && p == 0) {
                    page.iter_mut().for_each(|b| *b = (rng() % 7) as u8 + 1);
                }
            }
            let block = Encoder::new(CodecConfig::default()).encode(1, &data, true);
            let mut stored = Vec::new();
            dec.decode_stored(&block.header, &block.payload, &mut stored).unwrap();
            let mut scattered = Vec::new();
            scatter(&block.header, &stored, &|_| false, &mut scattered);
            dec.decode(&block.header, &block.payload, &mut out).unwrap();
            assert!(out == scattered && out == data, "case {case}: {pages} pages, cut {cut}");
        }
    }
}

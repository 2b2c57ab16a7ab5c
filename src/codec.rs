//! Block codec: turns one block of image bytes into a stored block and back.
//!
//! Page images are page-aware: all-zero 4 KiB pages are recorded in a bitmap
//! and not stored; the remaining pages are compressed together with LZ4 or
//! zstd, and stored raw when that saves less than 1/8 (incompressible data
//! then costs one memcpy to restore instead of a failed decompression).
//!
//! LZ4 comes from the `lz4` crate (the reference C library) rather than the
//! pure-Rust `lz4_flex` because only the C library exposes the acceleration
//! knob that trades ratio for speed; both decode at memory speed. Encoders and
//! decoders keep their buffers and zstd contexts, one per worker thread.
//!
//! Blocks of 16-bit words (bf16/fp16 weights and caches) may be stored as
//! byte planes under the same codec, where a sample says that pays
//! (`planes`); the block's codec records it.

use crate::format::{BlockHeader, PageBits, PAGE_SIZE};
use xxhash_rust::xxh3::xxh3_64;

pub use crate::error::DecodeError;

mod decode;
mod encode;
mod page_buf;

pub use decode::Decoder;
pub use encode::{EncodedBlock, Encoder};
pub use page_buf::PageBuf;

static ZERO_PAGE: [u8; PAGE_SIZE] = [0; PAGE_SIZE];

/// The compression the user asks for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Codec {
    None,
    Lz4,
    Zstd,
}

/// A codec setting that cannot be had: a usage error.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ConfigError {
    #[error("unknown codec {0:?} (expected lz4, zstd or none)")]
    UnknownCodec(String),
    #[error("LZ4 acceleration must be 1..=65537, got {0}")]
    Lz4Acceleration(i32),
    #[error("zstd level must be in {range:?} and not 0, got {level}")]
    ZstdLevel { level: i32, range: std::ops::RangeInclusive<i32> },
    #[error("--codec none takes no level (a level {0} would be ignored)")]
    NoLevel(i32),
}

impl std::str::FromStr for Codec {
    type Err = ConfigError;
    fn from_str(s: &str) -> Result<Self, ConfigError> {
        match s {
            "none" => Ok(Codec::None),
            "lz4" => Ok(Codec::Lz4),
            "zstd" => Ok(Codec::Zstd),
            _ => Err(ConfigError::UnknownCodec(s.to_string())),
        }
    }
}

impl std::fmt::Display for Codec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Codec::None => "none",
            Codec::Lz4 => "lz4",
            Codec::Zstd => "zstd",
        })
    }
}

/// Codec and its level: LZ4 acceleration (1 = best ratio, higher = faster) or
/// zstd level (negative = fast levels).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CodecConfig {
    pub codec: Codec,
    pub level: i32,
    /// Store a block as 16-bit byte planes where that shrinks it by
    /// [`planes::MIN_GAIN`](crate::planes::MIN_GAIN) more (archive version 3).
    pub planes: bool,
}

impl CodecConfig {
    pub fn new(codec: Codec, level: Option<i32>) -> Result<Self, ConfigError> {
        let level = match (codec, level) {
            (Codec::Lz4, Some(l)) if !(1..=65537).contains(&l) => return Err(ConfigError::Lz4Acceleration(l)),
            (Codec::Zstd, Some(l)) if !(zstd::compression_level_range().contains(&l)) || l == 0 => {
                return Err(ConfigError::ZstdLevel { level: l, range: zstd::compression_level_range() })
            }
            (Codec::None, Some(l)) => return Err(ConfigError::NoLevel(l)),
            (_, Some(l)) => l,
            (Codec::Lz4, None) => 1,
            // zstd is the size option. Level 5, by measurement on the mixed
            // workload (`criuz pack --level N` of one 256 MiB dump): level 1
            // gives 0.292 of raw at 1.7 GiB/s, 3: 0.291, 4: 0.289 (0.2903 at
            // 1 GiB), 5: 0.288 at 0.9 GiB/s, the first clearly under 0.29.
            // `--level 1` keeps the fast end.
            (Codec::Zstd, None) => 5,
            (Codec::None, None) => 0,
        };
        Ok(CodecConfig { codec, level, planes: codec != Codec::None })
    }

    /// Whether blocks may be stored as byte planes.
    pub fn may_use_planes(self) -> bool {
        self.planes && self.codec != Codec::None
    }

    /// The setting for a block's planes: zstd, whatever the codec asked, at
    /// level 1 unless zstd at level 12 or more was asked (see
    /// `encode::planes_compressor`). What the planes of 16-bit floats gain is
    /// entropy coding, which LZ4 does not do: by measurement on the `bf16`
    /// workload (1 GiB, 2 cores), LZ4 over the planes stores 0.826 of raw
    /// and made the dump 2.27 s, zstd 0.663 in 1.44 s; zstd's planes decode
    /// at about 1.8 GB/s a core, LZ4's at 2.8.
    fn for_planes(self) -> CodecConfig {
        let level = if self.codec == Codec::Zstd && self.level >= 12 { self.level } else { PLANES_FAST };
        CodecConfig { codec: Codec::Zstd, level, ..self }
    }
}

impl CodecConfig {
    /// The setting for blocks compressed while a backlog builds (a dump whose
    /// absorb budget is nearly spent while the process is frozen): LZ4 at
    /// acceleration at least [`HURRIED_LZ4_ACCELERATION`], in place of zstd too.
    /// Each block records its codec, so readers need nothing more.
    pub fn hurried(self) -> CodecConfig {
        match self.codec {
            Codec::None => self,
            Codec::Lz4 | Codec::Zstd => CodecConfig {
                codec: Codec::Lz4,
                level: if self.codec == Codec::Lz4 { self.level.max(HURRIED_LZ4_ACCELERATION) } else { 1 },
                planes: false,
            },
        }
    }
}

/// The planes' setting ([`CodecConfig::for_planes`]) that stands for the
/// fast one: the high plane Huffman-coded, else zstd at its fastest
/// (`encode::planes_compressor`).
const PLANES_FAST: i32 = 1;

/// LZ4 acceleration of hurried blocks when LZ4 was asked for.
pub const HURRIED_LZ4_ACCELERATION: i32 = 8;

impl Default for CodecConfig {
    fn default() -> Self {
        CodecConfig { codec: Codec::Lz4, level: 1, planes: true }
    }
}

/// Whether `page` (a whole page) is all zero.
pub fn is_zero_page(page: &[u8]) -> bool {
    page == ZERO_PAGE
}

/// One bit per page of `data` (LSB first), set for all-zero whole pages; a
/// short tail is always stored. An all-clear bitmap is kept so readers know
/// the block is page-aware.
pub fn zero_bitmap(data: &[u8]) -> PageBits {
    let mut bitmap = PageBits::with_pages(data.len().div_ceil(PAGE_SIZE));
    for (i, page) in data.chunks(PAGE_SIZE).enumerate() {
        if page.len() == PAGE_SIZE && is_zero_page(page) {
            bitmap.insert(i);
        }
    }
    bitmap
}

/// Checks a block's stored pages, given as consecutive parts (a raw payload,
/// or the pieces a resolved dedup block is made of), against its data check.
pub fn check_parts(header: &BlockHeader, parts: &[&[u8]]) -> Result<(), DecodeError> {
    let len: usize = parts.iter().map(|p| p.len()).sum();
    if len != header.stored_raw_len() {
        return Err(DecodeError::RawLength { got: len, expect: header.stored_raw_len() });
    }
    let check = match parts {
        [one] => xxh3_64(one),
        _ => {
            let mut h = xxhash_rust::xxh3::Xxh3::new();
            parts.iter().for_each(|p| h.update(p));
            h.digest()
        }
    };
    if check != header.data_check {
        return Err(DecodeError::DataCheck);
    }
    Ok(())
}

/// Rebuilds block bytes from its stored pages onto the end of `out`, leaving
/// out the zero pages for which `omit(page)` is true (they are then not part
/// of `out` at all).
pub fn scatter(header: &BlockHeader, stored: &[u8], omit: &dyn Fn(usize) -> bool, out: &mut Vec<u8>) {
    out.reserve(header.raw_len as usize);
    let raw_len = header.raw_len as usize;
    let mut src = 0;
    for p in 0..header.pages() {
        let len = PAGE_SIZE.min(raw_len - p * PAGE_SIZE);
        if header.is_zero_page(p) {
            if !omit(p) {
                out.extend_from_slice(&ZERO_PAGE[..len]);
            }
        } else {
            out.extend_from_slice(&stored[src..src + len]);
            src += len;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::format::{BlockCodec, PlanesPrefix};
    use crate::planes::tests::xorshift;

    /// 16-bit words from `word`, 64 pages of them.
    fn words(mut word: impl FnMut(usize) -> u16) -> Vec<u8> {
        (0..64 * PAGE_SIZE / 2).flat_map(|i| word(i).to_le_bytes()).collect()
    }

    fn round_trip(config: CodecConfig, data: &[u8]) -> (BlockCodec, Option<PlanesPrefix>) {
        let block = Encoder::new(config).encode(1, data, true);
        let mut out = Vec::new();
        Decoder::new().decode(&block.header, &block.payload, &mut out).expect("decodes");
        assert!(out == data, "{:?} does not give back what it stored", block.header.codec);
        let prefix = block.header.codec.is_planes().then(|| PlanesPrefix::decode(&block.payload).unwrap().0);
        (block.header.codec, prefix)
    }

    /// Byte planes round-trip whichever of them compresses: bf16 values
    /// (the low plane noise, stored raw where it lies) and words whose low
    /// bytes take few values too (both planes compressed, the payload
    /// rebuilt).
    #[test]
    fn byte_planes_give_back_every_word_whichever_plane_compresses() {
        let mut next = xorshift(7);
        let bf16 = words(|_| {
            // A rough normal: the sum of four uniforms, scaled like weights.
            let u: f32 = (0..4).map(|_| (next() >> 40) as f32 / (1u64 << 24) as f32).sum::<f32>() - 2.0;
            ((u * 0.02).to_bits() >> 16) as u16
        });
        let mut next = xorshift(11);
        let both = words(|_| (0x3c00 | ((next() % 4) << 8) | (next() % 4)) as u16);
        for codec in [Codec::Lz4, Codec::Zstd] {
            let config = CodecConfig::new(codec, None).unwrap();
            let (c, prefix) = round_trip(config, &bf16);
            let prefix = prefix.unwrap_or_else(|| panic!("{codec:?}: bf16 stored as {c:?}, not as planes"));
            assert!(!prefix.low_compressed && prefix.high_compressed, "{codec:?}: {prefix:?}");
            let (c, prefix) = round_trip(config, &both);
            let prefix = prefix.unwrap_or_else(|| panic!("{codec:?}: stored as {c:?}, not as planes"));
            assert!(prefix.low_compressed && prefix.high_compressed, "{codec:?}: {prefix:?}");
            // Without planes the same bytes come back too.
            round_trip(CodecConfig { planes: false, ..config }, &bf16);
        }
    }

    #[test]
    fn a_hurried_block_is_worth_redoing_unless_nothing_would_shrink_it() {
        let mut next = xorshift(5);
        let random: Vec<u8> = (0..64 * PAGE_SIZE).map(|_| next() as u8).collect();
        let text: Vec<u8> = b"a dump hurried while CRIU writes ".iter().copied().cycle().take(64 * PAGE_SIZE).collect();
        // Noisy low bytes, high bytes from a few values: LZ4 leaves these raw,
        // the planes do not.
        let bf16 = words(|_| (0x3c00 | ((next() % 4) << 8) | (next() % 256)) as u16);
        for codec in [Codec::Lz4, Codec::Zstd] {
            let mut enc = Encoder::new(CodecConfig::new(codec, None).unwrap());
            enc.hurry(true);
            assert_eq!(enc.compress(&random).0, BlockCodec::Raw);
            assert!(!enc.take_worth_redoing(), "{codec:?}: random bytes");
            enc.compress(&text);
            assert!(enc.take_worth_redoing(), "{codec:?}: text");
            assert!(!enc.take_worth_redoing(), "{codec:?}: taking it clears it");
            assert_eq!(enc.compress(&bf16).0, BlockCodec::Raw, "{codec:?}");
            assert!(enc.take_worth_redoing(), "{codec:?}: 16-bit words");
            enc.hurry(false);
            enc.compress(&text);
            assert!(!enc.take_worth_redoing(), "{codec:?}: not hurried");
        }
    }
}

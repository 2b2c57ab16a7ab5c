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

use crate::format::{BlockCodec, BlockHeader, PageBits, PlanesPrefix, PAGE_SIZE, PLANES_PREFIX};
use crate::{huffman, planes};
use std::sync::Arc;
use xxhash_rust::xxh3::xxh3_64;

pub use crate::error::DecodeError;

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
    /// [`planes_compressor`]). What the planes of 16-bit floats gain is
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

/// LZ4 acceleration of hurried blocks when LZ4 was asked for.
pub const HURRIED_LZ4_ACCELERATION: i32 = 8;

impl Default for CodecConfig {
    fn default() -> Self {
        CodecConfig { codec: Codec::Lz4, level: 1, planes: true }
    }
}

/// A block ready to be written (file id is filled in by the caller).
pub struct EncodedBlock {
    pub header: BlockHeader,
    pub payload: Vec<u8>,
    /// Ids of the stored pages, for archives that carry them.
    pub ids: Option<Vec<crate::format::PageId>>,
}

pub struct Encoder {
    config: CodecConfig,
    zstd: Option<zstd::bulk::Compressor<'static>>,
    /// The zstd context for byte planes, when their level differs.
    planes_zstd: Option<zstd::bulk::Compressor<'static>>,
    gathered: Vec<u8>,
    hurried: bool,
    /// Whether a hurried block since the last
    /// [`take_worth_redoing`](Self::take_worth_redoing) may be stored smaller
    /// by the configured codec.
    worth_redoing: bool,
    sample: Vec<u8>,
}

impl Encoder {
    pub fn new(config: CodecConfig) -> Self {
        let zstd = match config.codec {
            Codec::Zstd => Some(zstd::bulk::Compressor::new(config.level).expect("zstd level was validated")),
            _ => None,
        };
        let planes = config.for_planes();
        let planes_zstd = config.may_use_planes().then(|| planes_compressor(planes.level));
        Encoder {
            config,
            zstd,
            planes_zstd,
            gathered: Vec::new(),
            hurried: false,
            worth_redoing: false,
            sample: Vec::new(),
        }
    }

    /// Compress the next blocks with [`CodecConfig::hurried`] (or, given
    /// false, with the configured codec again).
    pub fn hurry(&mut self, hurried: bool) {
        self.hurried = hurried;
    }

    /// Whether a block compressed hurried since the last call may be stored
    /// smaller by the configured codec, so that redoing it pays; clears it.
    /// A hurried block that LZ4 left raw and whose sample no entropy coder
    /// shrinks, as it is or as planes (random memory, compressed data), is
    /// final: redoing it would rewrite the archive for nothing.
    pub fn take_worth_redoing(&mut self) -> bool {
        std::mem::take(&mut self.worth_redoing)
    }

    /// Encodes `data`; with `page_aware`, zero pages are elided.
    pub fn encode(&mut self, file_id: u32, data: &[u8], page_aware: bool) -> EncodedBlock {
        let zero_bitmap = if page_aware { zero_bitmap(data) } else { PageBits::new() };
        if zero_bitmap.count() == 0 {
            // Every page stored: the data is its own stored bytes, no copy
            // (a block of floats, or of a dense heap, has no zero page).
            let (codec, payload) = self.compress(data);
            return EncodedBlock::new(codec, file_id, data.len(), zero_bitmap, data, payload);
        }
        let stored = self.gather(data, &zero_bitmap);
        let (codec, payload) = self.compress(&stored);
        let block = EncodedBlock::new(codec, file_id, data.len(), zero_bitmap, &stored, payload);
        self.recycle(stored);
        block
    }

    /// The stored pages of `data`: all but those `zero_bitmap` marks.
    pub fn gather(&mut self, data: &[u8], zero_bitmap: &PageBits) -> Vec<u8> {
        let mut out = std::mem::take(&mut self.gathered);
        out.clear();
        for (i, page) in data.chunks(PAGE_SIZE).enumerate() {
            if !zero_bitmap.contains(i) {
                out.extend_from_slice(page);
            }
        }
        out
    }

    /// Gives a buffer back for the next [`gather`](Self::gather).
    pub fn recycle(&mut self, buf: Vec<u8>) {
        self.gathered = buf;
    }

    /// Compresses with the configured codec, over byte planes where a sample
    /// says that pays; raw when that saves less than 1/8.
    pub fn compress(&mut self, src: &[u8]) -> (BlockCodec, Vec<u8>) {
        if self.hurried {
            let (codec, out) = compress(self.config.hurried(), None, src);
            // One page from the middle says it: this runs while CRIU waits.
            let middle = src.len() / PAGE_SIZE / 2 * PAGE_SIZE;
            self.worth_redoing |= codec != BlockCodec::Raw
                || src.len() < planes::MIN_LEN
                || planes::entropy_may_shrink(&src[middle..middle + PAGE_SIZE]);
            return (codec, out);
        }
        if self.config.may_use_planes() && src.len() >= planes::MIN_LEN {
            if let Some(done) = self.compress_planes(src) {
                return done;
            }
        }
        compress(self.config, self.zstd.as_mut(), src)
    }

    /// `src` compressed as byte planes, if its sample shrinks by
    /// [`planes::MIN_GAIN`] more that way; else None (the caller compresses
    /// it as it is). The sample is compressed as it is; its planes are
    /// estimated from their byte histograms ([`planes::PlaneHistograms`]), and
    /// each plane of the block is compressed only where its estimate says
    /// that pays.
    fn compress_planes(&mut self, src: &[u8]) -> Option<(BlockCodec, Vec<u8>)> {
        planes::sample(src, &mut self.sample);
        let histograms = planes::PlaneHistograms::of(&self.sample);
        if !histograms.look_like_words() {
            return None;
        }
        let plain = compress(self.config, self.zstd.as_mut(), &self.sample).1.len();
        let ((low_len, try_low), (high_len, try_high)) = histograms.coded_lens();
        if (PLANES_PREFIX + low_len + high_len) as f64 > plain as f64 * (1.0 - planes::MIN_GAIN) {
            return None;
        }
        let config = self.config.for_planes();
        let mut zstd = self.planes_zstd.as_mut();
        // Split straight into the payload after its prefix: the low plane,
        // usually stored raw, is then where it belongs without a copy.
        let mut payload = Vec::with_capacity(src.len() + PLANES_PREFIX);
        payload.extend_from_slice(&[0; PLANES_PREFIX]);
        planes::split_into(src, &mut payload);
        let high_at = PLANES_PREFIX + src.len().div_ceil(2);
        let mut attempt = |on: bool, plane: &[u8]| {
            if !on {
                return None;
            }
            match compress(config, zstd.as_deref_mut(), plane) {
                (BlockCodec::Lz4 | BlockCodec::Zstd, out) => Some(out),
                _ => None,
            }
        };
        let low_out = attempt(try_low, &payload[PLANES_PREFIX..high_at]);
        // At the fast setting the high plane is Huffman-coded from the
        // sample's counts: zstd's frame without zstd's own histogram pass.
        let high = &payload[high_at..];
        let high_out = if try_high && config.level == PLANES_FAST {
            huffman::frame(high, histograms.high()).or_else(|| attempt(true, high))
        } else {
            attempt(try_high, high)
        };
        let (low_compressed, high_compressed) = (low_out.is_some(), high_out.is_some());
        let low_len = match low_out {
            // Rare (the low plane of floats is noise): rebuilt around it.
            Some(low) => {
                let mut rebuilt = Vec::with_capacity(PLANES_PREFIX + low.len() + payload.len() - high_at);
                rebuilt.extend_from_slice(&[0; PLANES_PREFIX]);
                rebuilt.extend_from_slice(&low);
                rebuilt.extend_from_slice(high_out.as_deref().unwrap_or(&payload[high_at..]));
                payload = rebuilt;
                low.len()
            }
            None => {
                if let Some(high) = high_out {
                    payload.truncate(high_at);
                    payload.extend_from_slice(&high);
                }
                high_at - PLANES_PREFIX
            }
        };
        let prefix = PlanesPrefix { low_len: low_len as u32, low_compressed, high_compressed };
        payload[..PLANES_PREFIX].copy_from_slice(&prefix.encode());
        if payload.len() > src.len() - src.len() / 8 {
            // The sample said planes beat the codec alone: neither saves an eighth.
            return Some((BlockCodec::Raw, src.to_vec()));
        }
        Some((BlockCodec::ZstdPlanes, payload))
    }
}

/// The zstd context for byte planes. The high plane is a small alphabet
/// whose gain is entropy coding; short matches only cost time there. By
/// measurement on the `bf16` workload's high planes (32 MiB in 128 KiB
/// planes, one core): level 1 stores 0.373 of them in 109 ms, level 5 0.398
/// in 302 ms (the lazier match finders spend literals on short matches);
/// level 1 with a minimum match of 7 0.343 in 82 ms, and with that and a
/// 64-entry hash table (a match finder that barely looks) 0.326 in 42 ms,
/// decoding in 15 ms instead of 25. (LZ4 stores 0.653 of them in 94 ms;
/// acceleration 2-16 trades that for 0.67-0.84 at 4-45% less time.)
///
/// Session 28, 64 MiB of such planes: zstd's fast levels (below 1) skip
/// ahead where they find no match and leave literals unencoded; with the
/// literals Huffman-coded anyway (an experimental parameter of zstd 1.5)
/// level -20 stores 0.325 at 908 MB/s against level 1's 0.326 at 719, and
/// decodes as fast (2.4 GB/s). What is left is zstd's histogram and
/// Huffman coder. Session 31, 128 MiB of bf16 (sigma 0.02) in 256 KiB
/// blocks, one core: level -100 took 0.454 ns a block byte against
/// -20's 0.487 for the same 0.325 of the plane (the match finder skips
/// further). The frames are ordinary zstd frames: readers need nothing
/// new. Session 32: the high plane at this setting goes to
/// [`huffman::frame`] first (zstd's Huffman coder with the sample's
/// table, 0.25 ns a block byte for the same size); this context codes
/// what that declines, and low planes.
fn planes_compressor(level: i32) -> zstd::bulk::Compressor<'static> {
    use zstd::zstd_safe::{CParameter, ParamSwitch};
    if level != PLANES_FAST {
        return zstd::bulk::Compressor::new(level).expect("zstd level was validated");
    }
    let mut z = zstd::bulk::Compressor::new(PLANES_FAST_LEVEL).expect("a valid zstd level");
    // Valid for every zstd build this crate links. Were one refused, the
    // planes would compress less, and the sample would find them not worth
    // it: blocks stored as they are, never wrong.
    let _ = z.set_parameter(CParameter::LiteralCompressionMode(ParamSwitch::Enable));
    let _ = z.set_parameter(CParameter::MinMatch(7));
    let _ = z.set_parameter(CParameter::HashLog(6));
    z
}

/// zstd's level for byte planes where the codec's fastest was asked (see
/// [`planes_compressor`]).
const PLANES_FAST_LEVEL: i32 = -100;

/// The planes' setting ([`CodecConfig::for_planes`]) that stands for the
/// fast one: the high plane Huffman-coded, else zstd at [`PLANES_FAST_LEVEL`].
const PLANES_FAST: i32 = 1;

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

impl EncodedBlock {
    /// A block record for `stored` (the block's stored pages) encoded as
    /// `payload` with `codec`. The data check covers the stored pages only:
    /// zero pages are rebuilt from the bitmap, which the record's seal covers.
    pub fn new(
        codec: BlockCodec,
        file_id: u32,
        raw_len: usize,
        zero_bitmap: PageBits,
        stored: &[u8],
        payload: Vec<u8>,
    ) -> Self {
        EncodedBlock {
            header: BlockHeader {
                codec,
                file_id,
                raw_len: raw_len as u32,
                stored_len: payload.len() as u32,
                data_check: xxh3_64(stored),
                payload_check: xxh3_64(&payload) as u32,
                zero_bitmap,
                sealed: false,
            },
            payload,
            ids: None,
        }
    }
}

fn compress(
    config: CodecConfig,
    zstd: Option<&mut zstd::bulk::Compressor<'static>>,
    src: &[u8],
) -> (BlockCodec, Vec<u8>) {
    if src.is_empty() {
        return (BlockCodec::Raw, Vec::new());
    }
    // Worth keeping only if it saves at least 1/8.
    let limit = src.len() - src.len() / 8;
    let compressed = match config.codec {
        Codec::None => None,
        Codec::Lz4 => {
            use lz4::liblz4::{LZ4_compressBound, LZ4_compress_fast};
            // Raw calls into the C library let LZ4 write straight into
            // uninitialised capacity (the block API would zero it first).
            // SAFETY: LZ4_compressBound is a pure size computation.
            let bound = unsafe { LZ4_compressBound(src.len() as i32) };
            let mut out: Vec<u8> = Vec::with_capacity(bound.max(0) as usize);
            // SAFETY: LZ4 reads `src.len()` bytes of `src` and writes at most
            // `bound` bytes into `out`'s capacity, returning how many (0 on failure).
            let n = unsafe {
                LZ4_compress_fast(src.as_ptr().cast(), out.as_mut_ptr().cast(), src.len() as i32, bound, config.level)
            };
            (n > 0).then(|| {
                // SAFETY: LZ4 initialised the first `n` bytes.
                unsafe { out.set_len(n as usize) };
                (BlockCodec::Lz4, out)
            })
        }
        Codec::Zstd => {
            let mut out = Vec::with_capacity(zstd::zstd_safe::compress_bound(src.len()));
            let z = zstd.expect("zstd encoder");
            z.compress_to_buffer(src, &mut out).ok().map(|_| (BlockCodec::Zstd, out))
        }
    };
    match compressed {
        Some((codec, out)) if out.len() <= limit => (codec, out),
        _ => (BlockCodec::Raw, src.to_vec()),
    }
}

pub struct Decoder {
    zstd: zstd::bulk::Decompressor<'static>,
    scratch: Vec<u8>,
    planes: Vec<u8>,
}

impl Default for Decoder {
    fn default() -> Self {
        Self::new()
    }
}

impl Decoder {
    pub fn new() -> Self {
        Decoder {
            zstd: zstd::bulk::Decompressor::new().expect("zstd context"),
            scratch: Vec::new(),
            planes: Vec::new(),
        }
    }

    /// Decodes a block into `out` (replacing its contents) and checks its data
    /// checksum. The error says what is wrong; the caller adds where.
    pub fn decode(&mut self, header: &BlockHeader, payload: &[u8], out: &mut Vec<u8>) -> Result<(), DecodeError> {
        if header.zero_pages() == 0 {
            return self.decode_stored(header, payload, out);
        }
        let mut stored = std::mem::take(&mut self.scratch);
        let r = self.decode_stored(header, payload, &mut stored);
        if r.is_ok() {
            scatter(header, &stored, &|_| false, out);
        }
        self.scratch = stored;
        r
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
        self.decompress(header.codec, payload, header.stored_raw_len(), stored)?;
        let check = xxh3_64(stored);
        if check != header.data_check {
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

/// Rebuilds block bytes from its stored pages, leaving out the zero pages for
/// which `omit(page)` is true (they are then not part of `out` at all).
pub fn scatter(header: &BlockHeader, stored: &[u8], omit: &dyn Fn(usize) -> bool, out: &mut Vec<u8>) {
    out.clear();
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
    use crate::format::PlanesPrefix;
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

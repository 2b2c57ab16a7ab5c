//! The encoding side: one worker's [`Encoder`] (its buffers and zstd
//! contexts kept across blocks) turns a block of image bytes into an
//! [`EncodedBlock`]: zero pages left out, the rest compressed with the
//! configured codec or as byte planes where a sample says that pays, or
//! stored raw where neither saves an eighth.

use super::{zero_bitmap, Codec, CodecConfig, PageBuf, PLANES_FAST};
use crate::format::{BlockCodec, BlockHeader, PageBits, PlanesPrefix, PAGE_SIZE, PLANES_PREFIX};
use crate::{huffman, planes};
use xxhash_rust::xxh3::xxh3_64;
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
    /// Page-aligned: see `PageBuf` for what copying pages into a heap
    /// `Vec` cost.
    gathered: PageBuf,
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
            gathered: PageBuf::new(),
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
    pub fn gather(&mut self, data: &[u8], zero_bitmap: &PageBits) -> PageBuf {
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
    pub fn recycle(&mut self, buf: PageBuf) {
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
        let histograms = planes::PlaneHistograms::of_sample(src);
        if !histograms.look_like_words() {
            return None;
        }
        planes::sample(src, &mut self.sample);
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

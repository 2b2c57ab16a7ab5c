//! Byte planes of 16-bit words: the transform that makes bf16/fp16 memory
//! (model weights, KV caches) compressible.
//!
//! A 16-bit float's high byte (sign, exponent, top of the mantissa) takes
//! few values; its low byte is nearly random. Interleaved, LZ4 finds no
//! matches and zstd's entropy coder sees both kinds of byte in one alphabet.
//! Split into a plane of low bytes followed by a plane of high bytes, the
//! high plane compresses to about 0.4 and the low plane passes through.
//!
//! Whether a block gets the transform is decided per block, cheaply: a
//! sample of spread-out pages is measured first (do bytes at even and odd
//! offsets differ in distribution?). Only a sample that looks like 16-bit
//! words is then compressed as it is, and its planes' sizes estimated from
//! their byte histograms (what an entropy coder makes of them, which is
//! what zstd does with such planes). The block is split only when that
//! estimate is [`MIN_GAIN`] smaller: text, code and random memory pay one
//! histogram of a few pages per block, float blocks a few percent more
//! work. (Compressing the sample's planes too, as this did before session
//! 28, cost a fifth of the planes' compression work for the same choice
//! on bf16.)

use crate::format::PAGE_SIZE;

/// The least improvement over the codec alone for which a block is split.
pub const MIN_GAIN: f64 = 0.05;

/// Pages a block's sample takes, spread across it.
const SAMPLE_PAGES: usize = 4;

/// Blocks smaller than this are never split (the sample would be the block).
pub const MIN_LEN: usize = 8 * PAGE_SIZE;

/// Appends the planes of `src` to `out`. Each little-endian 16-bit word is
/// first rotated left by one bit, so that a float's sign joins the noisy low
/// byte and its high byte is the whole exponent (bf16; fp16's five bits and
/// three of mantissa): one bit of noise fewer in the plane that compresses.
/// Then the low bytes of the words, then their high bytes (the "low" and
/// "high" planes). An odd length's last byte ends the low plane as it is.
///
/// Written straight into `out`'s spare capacity (no zeroing first), sixteen
/// words at a time with SSE2 on x86-64 and eight at a time as two u64s
/// elsewhere: on a restore of bf16 memory, joining the planes and zeroing
/// their buffer first were 18% of `criuz unpack`'s CPU with the u64 form.
pub fn split_into(src: &[u8], out: &mut Vec<u8>) {
    let n = src.len();
    let (half, words) = (n.div_ceil(2), n / 2);
    out.reserve(n);
    let start = out.len();
    let dst = out.spare_capacity_mut().as_mut_ptr().cast::<u8>();
    // SAFETY: `dst` has room for `n` bytes (reserved above). The low plane
    // is its first `half` bytes, the high plane the `words` after them; each
    // step below writes words `i..i + k` of both planes, from bytes
    // `2 * i..2 * (i + k)` of `src`, with `i + k <= words`.
    unsafe {
        let (even, odd) = (dst, dst.add(half));
        let mut i = 0;
        #[cfg(target_arch = "x86_64")]
        while i + 16 <= words {
            sse2::split16(src.as_ptr().add(2 * i), even.add(i), odd.add(i));
            i += 16;
        }
        while i + 8 <= words {
            let word = |k: usize| u64::from_le_bytes(src[2 * i + k..2 * i + k + 8].try_into().expect("8 bytes"));
            let (a, b) = (rotl_lanes(word(0)), rotl_lanes(word(8)));
            even.add(i).cast::<[u8; 8]>().write_unaligned((pack_bytes(a) | pack_bytes(b) << 32).to_le_bytes());
            odd.add(i).cast::<[u8; 8]>().write_unaligned((pack_bytes(a >> 8) | pack_bytes(b >> 8) << 32).to_le_bytes());
            i += 8;
        }
        while i < words {
            let [lo, hi] = u16::from_le_bytes([src[2 * i], src[2 * i + 1]]).rotate_left(1).to_le_bytes();
            even.add(i).write(lo);
            odd.add(i).write(hi);
            i += 1;
        }
        if n % 2 == 1 {
            even.add(half - 1).write(src[n - 1]);
        }
        out.set_len(start + n);
    }
}

/// Appends to `out` the bytes whose low plane is `even` and high plane is
/// `odd` (the inverse of [`split_into`], written the same way). The planes
/// may lie apart (a raw plane where it is in the payload, the other
/// decoded elsewhere).
///
/// # Panics
/// If `even` is not as long as `odd` or one byte longer (planes of one
/// block always are).
pub fn join_into(even: &[u8], odd: &[u8], out: &mut Vec<u8>) {
    let words = odd.len();
    assert!(even.len() == words || even.len() == words + 1, "planes of {} and {} bytes", even.len(), words);
    let n = even.len() + words;
    out.reserve(n);
    let start = out.len();
    let dst = out.spare_capacity_mut().as_mut_ptr().cast::<u8>();
    // SAFETY: `dst` has room for `n` bytes (reserved above); each step below
    // reads words `i..i + k` of both planes (both hold at least `words`) and
    // writes bytes `2 * i..2 * (i + k)`, with `i + k <= words`, and an odd
    // length's last byte after them.
    unsafe {
        let mut i = 0;
        #[cfg(target_arch = "x86_64")]
        while i + 16 <= words {
            sse2::join16(even.as_ptr().add(i), odd.as_ptr().add(i), dst.add(2 * i));
            i += 16;
        }
        while i + 8 <= words {
            let plane = |p: &[u8]| u64::from_le_bytes(p[i..i + 8].try_into().expect("8 bytes"));
            let (e, o) = (plane(even), plane(odd));
            let a = rotr_lanes(spread_bytes(e) | spread_bytes(o) << 8);
            let b = rotr_lanes(spread_bytes(e >> 32) | spread_bytes(o >> 32) << 8);
            dst.add(2 * i).cast::<[u8; 8]>().write_unaligned(a.to_le_bytes());
            dst.add(2 * i + 8).cast::<[u8; 8]>().write_unaligned(b.to_le_bytes());
            i += 8;
        }
        while i < words {
            let [lo, hi] = u16::from_le_bytes([even[i], odd[i]]).rotate_right(1).to_le_bytes();
            dst.add(2 * i).write(lo);
            dst.add(2 * i + 1).write(hi);
            i += 1;
        }
        if n % 2 == 1 {
            dst.add(n - 1).write(even[words]);
        }
        out.set_len(start + n);
    }
}

/// Sixteen words at a time with SSE2, which every x86-64 CPU has.
#[cfg(target_arch = "x86_64")]
mod sse2 {
    use std::arch::x86_64::*;

    /// Splits the 16 words at `src` (rotated left by one bit) into 16 low
    /// bytes at `even` and 16 high bytes at `odd`.
    ///
    /// # Safety
    /// `src` must be readable for 32 bytes, `even` and `odd` writable for 16.
    #[inline]
    pub(super) unsafe fn split16(src: *const u8, even: *mut u8, odd: *mut u8) {
        // SAFETY: the caller's promise; SSE2 is part of x86-64.
        unsafe {
            let rotl = |x| _mm_or_si128(_mm_slli_epi16(x, 1), _mm_srli_epi16(x, 15));
            let a = rotl(_mm_loadu_si128(src.cast()));
            let b = rotl(_mm_loadu_si128(src.add(16).cast()));
            let low = _mm_set1_epi16(0x00FF);
            let lows = _mm_packus_epi16(_mm_and_si128(a, low), _mm_and_si128(b, low));
            let highs = _mm_packus_epi16(_mm_srli_epi16(a, 8), _mm_srli_epi16(b, 8));
            _mm_storeu_si128(even.cast(), lows);
            _mm_storeu_si128(odd.cast(), highs);
        }
    }

    /// Joins 16 low bytes at `even` and 16 high bytes at `odd` into 16
    /// words at `dst`, each rotated right by one bit.
    ///
    /// # Safety
    /// `even` and `odd` must be readable for 16 bytes, `dst` writable for 32.
    #[inline]
    pub(super) unsafe fn join16(even: *const u8, odd: *const u8, dst: *mut u8) {
        // SAFETY: the caller's promise; SSE2 is part of x86-64.
        unsafe {
            let rotr = |x| _mm_or_si128(_mm_srli_epi16(x, 1), _mm_slli_epi16(x, 15));
            let (e, o) = (_mm_loadu_si128(even.cast()), _mm_loadu_si128(odd.cast()));
            _mm_storeu_si128(dst.cast(), rotr(_mm_unpacklo_epi8(e, o)));
            _mm_storeu_si128(dst.add(16).cast(), rotr(_mm_unpackhi_epi8(e, o)));
        }
    }
}

/// Each 16-bit lane of `x` rotated left by one bit.
fn rotl_lanes(x: u64) -> u64 {
    ((x << 1) & 0xFFFE_FFFE_FFFE_FFFE) | ((x >> 15) & 0x0001_0001_0001_0001)
}

/// Each 16-bit lane of `x` rotated right by one bit.
fn rotr_lanes(x: u64) -> u64 {
    ((x >> 1) & 0x7FFF_7FFF_7FFF_7FFF) | ((x << 15) & 0x8000_8000_8000_8000)
}

/// The low bytes of the four 16-bit lanes of `x`, packed into 32 bits.
fn pack_bytes(x: u64) -> u64 {
    let x = x & 0x00FF_00FF_00FF_00FF;
    let x = (x | x >> 8) & 0x0000_FFFF_0000_FFFF;
    (x | x >> 16) & 0x0000_0000_FFFF_FFFF
}

/// The four low bytes of `x`, each into the low byte of a 16-bit lane.
fn spread_bytes(x: u64) -> u64 {
    let x = x & 0x0000_0000_FFFF_FFFF;
    let x = (x | x << 16) & 0x0000_FFFF_0000_FFFF;
    (x | x << 8) & 0x00FF_00FF_00FF_00FF
}

/// A sample of `src` for the trial: [`SAMPLE_PAGES`] pages spread evenly.
pub fn sample(src: &[u8], out: &mut Vec<u8>) {
    out.clear();
    sample_pages(src).for_each(|page| out.extend_from_slice(page));
}

/// The pages of `src` that [`sample`] takes, in order.
fn sample_pages(src: &[u8]) -> impl Iterator<Item = &[u8]> {
    let pages = src.len() / PAGE_SIZE;
    (0..SAMPLE_PAGES).map(move |i| {
        let p = (2 * i + 1) * pages / (2 * SAMPLE_PAGES);
        &src[p * PAGE_SIZE..(p + 1) * PAGE_SIZE]
    })
}

/// The byte histograms of a sample's two planes (its words rotated as
/// [`split_into`] rotates them), counted in one pass: they say both
/// whether the sample looks like 16-bit words and what its planes would
/// cost, without splitting it (before, the trial made four passes over
/// the sample and a split copy of it).
pub struct PlaneHistograms {
    low: [u32; 256],
    high: [u32; 256],
}

impl PlaneHistograms {
    const EMPTY: Self = PlaneHistograms { low: [0; 256], high: [0; 256] };

    /// Counts the planes of `sample` (an odd length's last byte is left out).
    pub fn of(sample: &[u8]) -> Self {
        let mut h = Self::EMPTY;
        h.count(sample);
        h
    }

    /// Counts the planes of what [`sample`] would take of `src`, without
    /// copying it (most blocks go no further than [`look_like_words`](Self::look_like_words)).
    pub fn of_sample(src: &[u8]) -> Self {
        let mut h = Self::EMPTY;
        // Pages have an even length: their pairs are the sample's pairs.
        sample_pages(src).for_each(|page| h.count(page));
        h
    }

    fn count(&mut self, bytes: &[u8]) {
        for pair in bytes.chunks_exact(2) {
            let [lo, hi] = u16::from_le_bytes([pair[0], pair[1]]).rotate_left(1).to_le_bytes();
            self.low[lo as usize] += 1;
            self.high[hi as usize] += 1;
        }
    }

    /// Whether the two planes are distributed so differently that
    /// splitting may pay: the order-0 entropy of the planes taken apart is
    /// at least half a bit per byte below that of their bytes together.
    /// Text, code and random bytes show no such difference.
    ///
    /// That difference is the Jensen-Shannon divergence of the two planes'
    /// distributions (in bits), which never exceeds their total variation
    /// distance: where that is under a half (with a margin for rounding),
    /// the answer is no without a logarithm (768 of them a block otherwise,
    /// about 3% of a dump's CPU on memory that is not words).
    pub fn look_like_words(&self) -> bool {
        !self.surely_not_words() && self.divergence() >= 0.5
    }

    /// Whether the planes' total variation distance is under 0.49, so that
    /// their divergence is under a half too (see [`look_like_words`](Self::look_like_words)).
    fn surely_not_words(&self) -> bool {
        let pairs: u64 = self.low.iter().map(|&c| u64::from(c)).sum();
        let differ: u64 = self.low.iter().zip(&self.high).map(|(&l, &h)| u64::from(l.abs_diff(h))).sum();
        // The total variation distance is differ / (2 * pairs).
        (differ as f64) < 0.98 * pairs as f64
    }

    /// How many bits a byte the planes' entropies taken apart are below
    /// that of their bytes together.
    fn divergence(&self) -> f64 {
        let mut both = [0u32; 256];
        for (b, (l, h)) in both.iter_mut().zip(self.low.iter().zip(&self.high)) {
            *b = l + h;
        }
        entropy(&both) - (entropy(&self.low) + entropy(&self.high)) / 2.0
    }

    /// What an entropy coder would store of the low plane and of the high
    /// plane, and whether each saves an eighth ([`coded_len_of`]).
    pub fn coded_lens(&self) -> ((usize, bool), (usize, bool)) {
        (coded_len_of(&self.low), coded_len_of(&self.high))
    }

    /// The high plane's byte counts (for [`crate::huffman::frame`]'s table).
    pub fn high(&self) -> &[u32; 256] {
        &self.high
    }
}

/// Whether an entropy coder could store `sample` an eighth smaller, as its
/// bytes are or as planes (by their order-0 entropy). Where it could not,
/// and LZ4 found no matches worth an eighth either, no codec here stores
/// such bytes smaller.
pub fn entropy_may_shrink(sample: &[u8]) -> bool {
    let planes = PlaneHistograms::of(sample);
    coded_len_of(&byte_histogram(sample)).1 || coded_len_of(&planes.low).1 || coded_len_of(&planes.high).1
}

/// How many times each byte value occurs in `bytes`.
pub fn byte_histogram(bytes: &[u8]) -> [u32; 256] {
    let mut hist = [0u32; 256];
    for &b in bytes {
        hist[usize::from(b)] += 1;
    }
    hist
}

/// What an entropy coder would store of the plane whose byte histogram is
/// `hist`, by its order-0 entropy (plus a table's worth), and whether that
/// saves the eighth that decides whether a block is stored compressed: the
/// planes are an entropy coder's input, and zstd over them stores within a
/// few percent of it (bf16 high planes: 0.325 of their size by zstd, 0.31
/// by this estimate).
fn coded_len_of(hist: &[u32; 256]) -> (usize, bool) {
    let len = hist.iter().map(|&c| c as usize).sum::<usize>();
    let estimate = (entropy(hist) * len as f64 / 8.0) as usize + CODE_TABLE_LEN;
    let pays = estimate <= len - len / 8;
    (if pays { estimate } else { len }, pays)
}

/// About what a Huffman table costs in a compressed plane.
const CODE_TABLE_LEN: usize = 64;

/// Order-0 entropy of a histogram, in bits per symbol.
fn entropy(hist: &[u32; 256]) -> f64 {
    let total: u64 = hist.iter().map(|&c| u64::from(c)).sum();
    if total == 0 {
        return 0.0;
    }
    let total = total as f64;
    hist.iter().filter(|&&c| c > 0).map(|&c| c as f64 / total).map(|p| -p * p.log2()).sum()
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// A xorshift stream: the same bytes on every run (for the tests of
    /// this module and of `codec`).
    pub(crate) fn xorshift(seed: u64) -> impl FnMut() -> u64 {
        let mut s = seed | 1;
        move || {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            s
        }
    }

    /// [`coded_len_of`] a plane's bytes.
    fn coded_len(plane: &[u8]) -> (usize, bool) {
        coded_len_of(&byte_histogram(plane))
    }

    #[test]
    fn join_undoes_split_for_every_length() {
        for len in [0, 1, 2, 3, 4, 7, 15, 16, 17, 31, 33, 4096, 4097] {
            let src: Vec<u8> = (0..len).map(|i| (i * 7 + i / 3) as u8).collect();
            let mut planes = vec![9];
            split_into(&src, &mut planes);
            assert_eq!(planes.len(), len + 1);
            let mut back = vec![1, 2];
            let (even, odd) = planes[1..].split_at(len.div_ceil(2));
            join_into(even, odd, &mut back);
            assert_eq!(&back[2..], &src[..], "length {len}");
        }
    }

    #[test]
    fn split_and_join_agree_with_a_word_at_a_time_at_every_length() {
        // Lengths around the 16- and 8-word steps and their tails, and a
        // page-sized one, each appended after bytes already there.
        for len in (0usize..80).chain([4095, 4096, 4097, 4096 + 33]) {
            let src: Vec<u8> = (0..len).map(|i| (i * 131 + i / 7) as u8).collect();
            let mut want = vec![7u8];
            let (half, words) = (len.div_ceil(2), len / 2);
            want.resize(1 + len, 0);
            for i in 0..words {
                let [lo, hi] = u16::from_le_bytes([src[2 * i], src[2 * i + 1]]).rotate_left(1).to_le_bytes();
                want[1 + i] = lo;
                want[1 + half + i] = hi;
            }
            if len % 2 == 1 {
                want[half] = src[len - 1];
            }
            let mut planes = vec![7u8];
            split_into(&src, &mut planes);
            assert_eq!(planes, want, "split, length {len}");
            let mut back = vec![9u8];
            let (even, odd) = planes[1..].split_at(half);
            join_into(even, odd, &mut back);
            assert_eq!(&back[1..], &src[..], "join, length {len}");
        }
    }

    #[test]
    fn split_puts_rotated_low_bytes_first() {
        let mut planes = Vec::new();
        // 0xAA11 rotated left by one is 0x5423; 0xBB22 is 0x7645.
        split_into(&[0x11, 0xAA, 0x22, 0xBB, 0x33], &mut planes);
        assert_eq!(planes, [0x23, 0x45, 0x33, 0x54, 0x76]);
    }

    #[test]
    fn coded_len_follows_the_entropy_and_says_when_it_pays() {
        let mut next = xorshift(0x9E37_79B9_7F4A_7C15);
        let noise: Vec<u8> = (0..8192).map(|_| next() as u8).collect();
        assert_eq!(coded_len(&noise), (8192, false), "noise is stored as it is");
        // Four values, evenly: two bits a byte.
        let four: Vec<u8> = (0..8192).map(|_| (next() % 4) as u8).collect();
        let (len, pays) = coded_len(&four);
        assert!(pays && (2048..2048 + 2 * CODE_TABLE_LEN).contains(&len), "{len}");
        assert_eq!(coded_len(&[7u8; 4096]), (CODE_TABLE_LEN, true), "one value costs its table");
    }

    #[test]
    fn the_histograms_are_those_of_the_split_planes() {
        // Words whose bytes differ in distribution, so that a swapped or
        // unrotated plane would count differently; an odd length.
        let mut next = xorshift(3);
        let src: Vec<u8> = (0..2048).flat_map(|_| [next() as u8, 0x3C + (next() % 4) as u8]).chain([0xEE]).collect();
        let mut planes = Vec::new();
        split_into(&src, &mut planes);
        let (low, high) = planes.split_at(src.len().div_ceil(2));
        let h = PlaneHistograms::of(&src);
        // The odd length's last byte ends the low plane but is no word's.
        assert_eq!(h.low, byte_histogram(&low[..low.len() - 1]));
        assert_eq!(h.high, byte_histogram(high));
        assert_ne!(h.low, h.high);
    }

    #[test]
    fn only_word_shaped_bytes_look_like_words() {
        // bf16-like: a high byte from a few values, a low byte from all.
        let mut next = xorshift(1);
        let words: Vec<u8> = (0..8192).flat_map(|_| [next() as u8, 0x3C + (next() % 4) as u8]).collect();
        assert!(PlaneHistograms::of(&words).look_like_words());
        let random: Vec<u8> = (0..16384).map(|_| next() as u8).collect();
        assert!(!PlaneHistograms::of(&random).look_like_words());
        let text: Vec<u8> =
            b"the quick brown fox jumps over the lazy dog. ".iter().copied().cycle().take(16384).collect();
        assert!(!PlaneHistograms::of(&text).look_like_words());
        // A binary: the middle of this test executable (code and data).
        let code = std::fs::read("/proc/self/exe").expect("the test binary");
        let code = &code[code.len() / 2..][..16384];
        assert!(!PlaneHistograms::of(code).look_like_words());
    }

    /// The shortcut (total variation under a half) only ever answers no
    /// where the divergence is under a half too, over planes from alike to
    /// disjoint and near the line; and the sample's histograms are counted
    /// in place as they are from its copy.
    #[test]
    fn the_shortcut_never_changes_the_answer() {
        let mut next = xorshift(84);
        let (mut shortcuts, mut words) = (0, 0);
        for case in 0..3000 {
            // The high byte from `spread` values around a centre that moves
            // with the case; the low byte from all 256 or from few.
            let spread = 1 + (case % 64) as u64 * 4;
            let low_spread = if case % 3 == 0 { 256 } else { spread };
            let centre = (case * 7 % 256) as u64;
            let bytes: Vec<u8> = (0..8192)
                .flat_map(|_| [(centre + next() % low_spread) as u8, (centre / 2 + next() % spread) as u8])
                .collect();
            let h = PlaneHistograms::of(&bytes);
            assert_eq!(h.look_like_words(), h.divergence() >= 0.5, "case {case}");
            shortcuts += usize::from(h.surely_not_words());
            words += usize::from(h.look_like_words());
        }
        assert!(shortcuts > 300 && words > 300, "both answers reached: {shortcuts} shortcuts, {words} words");
        let block: Vec<u8> = (0..64 * PAGE_SIZE).map(|_| next() as u8 & 0x3F).collect();
        let mut copy = Vec::new();
        sample(&block, &mut copy);
        let (counted, copied) = (PlaneHistograms::of_sample(&block), PlaneHistograms::of(&copy));
        assert_eq!((counted.low, counted.high), (copied.low, copied.high));
    }
}

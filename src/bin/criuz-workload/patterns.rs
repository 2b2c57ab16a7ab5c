//! The memory patterns: each page's bytes depend only on its number (and,
//! for `elf`, on the corpus of the machine's binaries read once), so a fill
//! on any number of threads, or a later check, gives the same memory.

use crate::PAGE;
use std::path::{Path, PathBuf};
use xxhash_rust::xxh3::xxh3_64;

pub(crate) struct Rng(pub(crate) u64);
impl Rng {
    pub(crate) fn next(&mut self) -> u64 {
        // xorshift64*
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545F4914F6CDD1D)
    }
}

const WORDS: &[&str] = &[
    "the",
    "of",
    "and",
    "checkpoint",
    "restore",
    "process",
    "memory",
    "page",
    "kernel",
    "image",
    "socket",
    "container",
    "thread",
    "signal",
    "buffer",
    "server",
    "request",
    "latency",
    "snapshot",
    "migration",
    "to",
    "in",
    "is",
    "that",
    "for",
    "with",
    "on",
    "as",
    "by",
    "at",
    "from",
    "inference",
    "model",
    "weights",
    "cache",
    "value",
    "key",
    "error",
    "state",
    "file",
    "log",
    "user",
    "time",
    "data",
    "stream",
    "compress",
    "zero",
];
const LEVELS: &[&str] = &["INFO", "INFO", "INFO", "DEBUG", "WARN", "ERROR"];
const PATHS: &[&str] = &["/v1/models/llama/infer", "/v1/health", "/api/items", "/api/users/search", "/metrics"];

/// Text as a server holds it: access-log lines and JSON records, with
/// timestamps that move forward, a small population of users and paths, and
/// mostly-successful statuses, as real service logs and caches have. (Real
/// logs compress 4-10x; uniformly random fields would be far less typical.)
pub(crate) fn fill_text(page: &mut [u8], rng: &mut Rng) {
    let mut s = String::with_capacity(page.len() + 256);
    let mut ms = rng.next() % 86_400_000;
    while s.len() < page.len() {
        let r = rng.next();
        ms += r % 40;
        let user = (r >> 8) % 64;
        let word = WORDS[((r >> 16) % 12) as usize];
        if r % 4 == 0 {
            s.push_str(&format!(
                "{{\"id\":{},\"user\":\"user{user}\",\"model\":\"llama-8b\",\"tokens\":{},\"cache\":\"{word}\",\"ok\":true}}\n",
                100_000 + (r >> 24) % 1000,
                (r >> 34) % 512
            ));
        } else {
            s.push_str(&format!(
                "2026-11-21T{:02}:{:02}:{:02}.{:03}Z {} [worker-{}] {} {} user=user{user} status={} latency_ms={}\n",
                ms / 3_600_000 % 24,
                ms / 60_000 % 60,
                ms / 1000 % 60,
                ms % 1000,
                LEVELS[((r >> 35) % LEVELS.len() as u64) as usize],
                (r >> 38) % 4,
                if r & 8 == 0 { "GET" } else { "POST" },
                PATHS[((r >> 42) % PATHS.len() as u64) as usize],
                if (r >> 45) % 20 == 0 { 503 } else { 200 },
                (r >> 48) % 50
            ));
        }
    }
    page.copy_from_slice(&s.as_bytes()[..page.len()]);
}

pub(crate) fn fill_random(page: &mut [u8], rng: &mut Rng) {
    for c in page.chunks_mut(8) {
        let v = rng.next().to_le_bytes();
        c.copy_from_slice(&v[..c.len()]);
    }
}

/// A page of bf16 values ~ N(0, 0.02^2), rounded to nearest even from f32
/// (normal deviates by Box-Muller, two per pair of uniforms).
fn fill_bf16(page: &mut [u8], rng: &mut Rng) {
    fill_normal_bf16(page, rng, 0.02)
}

/// What page `n` of the `gpu-image` pattern holds, in the shares the host
/// image of `../shared/gpu/gpuapp.py` had once its device memory was copied
/// to the host (session 29, 5,292,373 pages), in runs of pages as the
/// image's regions are, repeated every [`GPU_IMAGE_PERIOD`] pages:
/// weights (bf16, sigma 0.02) 19.8%; the KV cache's filled part (bf16,
/// sigma 1) 14.8%; its unfilled part (zero) 44.5%; a copy of filled cache
/// pages 12.5% (the freed temporary the cache was filled from, which the
/// page ids of a CUDA dump store once); other memory (the `mixed` pattern)
/// the rest.
enum GpuImagePage {
    Weights,
    Cache,
    Zero,
    CacheCopy(usize),
    Other,
}

const GPU_IMAGE_PERIOD: usize = 1000;

fn gpu_image_page(n: usize) -> GpuImagePage {
    let (period, at) = (n / GPU_IMAGE_PERIOD, n % GPU_IMAGE_PERIOD);
    match at {
        0..198 => GpuImagePage::Weights,
        198..346 => GpuImagePage::Cache,
        346..791 => GpuImagePage::Zero,
        // The cache page this one copies: the same page number, the same bytes.
        791..916 => GpuImagePage::CacheCopy(period * GPU_IMAGE_PERIOD + 198 + (at - 791)),
        _ => GpuImagePage::Other,
    }
}

/// A page of bf16 values ~ N(0, sigma^2), as [`fill_bf16`].
fn fill_normal_bf16(page: &mut [u8], rng: &mut Rng, sigma: f64) {
    let bf16 = |x: f32| {
        let bits = x.to_bits();
        ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) as u16
    };
    for pair in page.chunks_mut(4) {
        let r = rng.next();
        let u1 = ((r >> 40) as f64 + 1.0) / (1u64 << 24) as f64;
        let u2 = ((r & 0xFF_FFFF) as f64) / (1u64 << 24) as f64;
        let radius = (-2.0 * u1.ln()).sqrt() * sigma;
        let angle = std::f64::consts::TAU * u2;
        let (a, b) = (bf16((radius * angle.cos()) as f32), bf16((radius * angle.sin()) as f32));
        pair[..2].copy_from_slice(&a.to_le_bytes());
        pair[2..].copy_from_slice(&b.to_le_bytes());
    }
}

/// The machine's own ELF files, in path order within each directory,
/// concatenated up to `limit` bytes. Which files, and where each goes, is
/// worked out first from each file's size and first bytes; then they are
/// read on every core into their places: the bytes reading them in turn
/// gave (a file that cannot be read by then leaves its place zero).
pub(crate) fn elf_corpus(limit: usize) -> Vec<u8> {
    elf_corpus_on(limit, criuz::engine::default_threads())
}

/// [`elf_corpus`], read on `threads` threads.
fn elf_corpus_on(limit: usize, threads: usize) -> Vec<u8> {
    use std::io::Read;
    let is_elf = |p: &Path| {
        let mut magic = [0u8; 4];
        std::fs::File::open(p).and_then(|mut f| f.read_exact(&mut magic)).is_ok() && &magic == b"\x7fELF"
    };
    let mut plan: Vec<(PathBuf, usize)> = Vec::new();
    let mut total = 0;
    'dirs: for dir in ["/usr/bin", "/usr/lib/x86_64-linux-gnu", "/usr/lib", "/usr/sbin"] {
        let Ok(rd) = std::fs::read_dir(dir) else { continue };
        let mut paths: Vec<PathBuf> = rd.filter_map(|e| e.ok().map(|e| e.path())).collect();
        paths.sort();
        for p in paths {
            if total >= limit {
                break 'dirs;
            }
            let Ok(meta) = std::fs::metadata(&p) else { continue };
            if !meta.is_file() || meta.len() < 4096 || !is_elf(&p) {
                continue;
            }
            let take = usize::try_from(meta.len()).unwrap_or(usize::MAX).min(limit - total);
            plan.push((p, take));
            total += take;
        }
    }
    let mut out = vec![0u8; total];
    let mut places = Vec::with_capacity(plan.len());
    let mut rest = out.as_mut_slice();
    for (p, take) in &plan {
        let (place, after) = rest.split_at_mut(*take);
        places.push((p.as_path(), place));
        rest = after;
    }
    let places = std::sync::Mutex::new(places.into_iter());
    std::thread::scope(|s| {
        for _ in 0..threads {
            spawn_small(s, || loop {
                let Some((p, place)) = places.lock().unwrap().next() else { return };
                if std::fs::File::open(p).and_then(|mut f| f.read_exact(place)).is_err() {
                    place.fill(0);
                }
            });
        }
    });
    out
}

/// Fills the whole of `buf` with `pattern` on every core this process may
/// use (the bench's `--cpus` pins it): a page's bytes depend only on its
/// number (and for `elf` on the corpus, read once), so any thread count
/// gives the same memory. On one thread 1 GiB of `text` took 3.1 s to
/// fill and `bf16` 9.0 s (2-core VM), four times that at 4 GiB: most of a
/// 16-core bench run. The threads end before this returns: a `tree` forks
/// next, a `single` is one thread.
pub(crate) fn fill_all(buf: &mut [u8], pattern: &str) {
    // The threads allocate (a little) from the main arena, so none of them
    // leaves an arena of its own mapped in the process that is dumped.
    // SAFETY: mallopt only sets an allocator parameter.
    unsafe { libc::mallopt(libc::M_ARENA_MAX, 1) };
    fill_on(buf, pattern, criuz::engine::default_threads());
}

/// [`fill_all`] on `threads` threads.
fn fill_on(buf: &mut [u8], pattern: &str, threads: usize) {
    let elf = if pattern == "elf" { elf_corpus_on(buf.len(), threads) } else { Vec::new() };
    let per = buf.len().div_ceil(PAGE).div_ceil(threads).max(1) * PAGE;
    std::thread::scope(|s| {
        for (k, part) in buf.chunks_mut(per).enumerate() {
            let elf = &elf;
            spawn_small(s, move || fill_pages(part, pattern, k * per / PAGE, elf));
        }
    });
}

/// A thread of the fill, with a small stack: it needs little, and the C
/// library keeps an ended thread's stack mapped (so it is dumped).
fn spawn_small<'s, F: FnOnce() + Send + 's>(s: &'s std::thread::Scope<'s, '_>, f: F) {
    std::thread::Builder::new().stack_size(64 << 10).spawn_scoped(s, f).expect("fill thread");
}

/// Fills `buf`, pages `first_page`.. of `pattern` (`elf`: pages of `elf`,
/// the corpus, as [`elf_corpus`] reads it for the whole memory).
pub(crate) fn fill_pages(buf: &mut [u8], pattern: &str, first_page: usize, elf: &[u8]) {
    for (i, page) in buf.chunks_mut(PAGE).enumerate() {
        let n = first_page + i;
        let mut rng = page_rng(n);
        match pattern {
            "zero" => page.fill(0),
            "random" => fill_random(page, &mut rng),
            "text" => fill_text(page, &mut rng),
            "bf16" => fill_bf16(page, &mut rng),
            "gpu-image" => match gpu_image_page(n) {
                GpuImagePage::Weights => fill_bf16(page, &mut rng),
                GpuImagePage::Cache => fill_normal_bf16(page, &mut rng, 1.0),
                GpuImagePage::Zero => page.fill(0),
                GpuImagePage::CacheCopy(of) => fill_normal_bf16(page, &mut page_rng(of), 1.0),
                GpuImagePage::Other => fill_mixed(page, &mut rng),
            },
            "elf" if !elf.is_empty() => {
                let off = (n * PAGE) % (elf.len() - elf.len() % PAGE).max(PAGE);
                let src = &elf[off.min(elf.len())..];
                let m = page.len().min(src.len());
                page[..m].copy_from_slice(&src[..m]);
                page[m..].fill(0);
            }
            "elf" => fill_random(page, &mut rng),
            "mixed" => fill_mixed(page, &mut rng),
            _ => {
                eprintln!("criuz-workload: unknown pattern {pattern}");
                std::process::exit(2)
            }
        }
    }
}

/// The generator page `n` of a pattern is filled from: the same bytes for
/// the same page number on every run.
fn page_rng(n: usize) -> Rng {
    Rng(xxh3_64(&(n as u64).to_le_bytes()) | 1)
}

/// Half the pages zero, a quarter text, a quarter random.
fn fill_mixed(page: &mut [u8], rng: &mut Rng) {
    match rng.next() % 4 {
        0 | 1 => page.fill(0),
        2 => fill_text(page, rng),
        _ => fill_random(page, rng),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The fill's bytes do not depend on how many threads made them (the
    /// bench's runs on 2 and 16 cores dump the same memory).
    #[test]
    fn every_pattern_fills_the_same_bytes_on_any_number_of_threads() {
        for pattern in ["zero", "mixed", "random", "text", "elf", "bf16", "gpu-image"] {
            // 129 pages: the threads' shares are uneven.
            let mut one = vec![1u8; 129 * PAGE];
            let mut three = vec![2u8; 129 * PAGE];
            fill_on(&mut one, pattern, 1);
            fill_on(&mut three, pattern, 3);
            assert!(one == three, "{pattern}: one thread and three differ");
            assert!(pattern == "zero" || one.iter().any(|&b| b != 0), "{pattern}: nothing filled");
        }
        assert_eq!(elf_corpus_on(3 << 20, 1), elf_corpus_on(3 << 20, 4));
    }
}

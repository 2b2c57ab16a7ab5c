//! What a lazy or placed restore has ready before CRIU starts: the images
//! written (`session::placement`), the working set earlier restores
//! recorded, the shared memory a lazy tree is served, and, with
//! `verify_first`, every stored byte proven meanwhile; and how many threads
//! decode ahead of a running tree's fill.

use super::LazyRestore;
use crate::archive::BlockSource;
use crate::error::{Error, Result};
use crate::format::FileKind;
use crate::session::blocks::Blocks;
use crate::session::placement::{
    materialize, Materialized, Placement, HELD_MIN_ZERO_RUN, KEPT_ZERO_RUN, LAZY_MIN_ZERO_RUN,
};
use crate::session::serve::pages_images_named_once;
use crate::session::shmem;
use crate::session::working_set::{load_touches, touch_path};
use std::collections::{HashMap, HashSet};

/// What a lazy or held restore has ready before CRIU starts.
pub(super) struct Prepared {
    /// Where this restore's faults are recorded (`session::working_set`),
    /// and those earlier restores recorded.
    pub(super) touch: Option<std::path::PathBuf>,
    pub(super) recorded: Vec<(u32, u64)>,
    /// A lazy tree's shared memory that no descriptor opens: served as it
    /// runs, like its private memory.
    pub(super) served_shared: Vec<shmem::LazyShared>,
    /// The images written for CRIU, and what of the memory criuz serves.
    pub(super) materialized: Materialized,
}

impl LazyRestore<'_> {
    /// Writes CRIU's images (`session::placement`), with `planned` where a
    /// placed restore worked the pagemaps out already, and plans the shared
    /// memory a lazy (`gated`) tree is served; with `verify_first`, proves
    /// every stored byte meanwhile. `hold`: a tree held stopped until every
    /// page is in; `keep_zeros`: every zero page placed too.
    pub(super) fn prepare(
        &self,
        blocks: &Blocks,
        hold: bool,
        gated: bool,
        planned: Option<Placement>,
        keep_zeros: bool,
    ) -> Result<Prepared> {
        // Until CRIU has restored the tree, what CRIU reads comes first: from
        // a cold cache the archive's read-ahead beside it made CRIU's part of
        // a 1 GiB lazy restore 0.17 s instead of 0.03, and a placed restore
        // 0.71 s instead of 0.47 (docs/BENCHMARKS.md). A restore opens its
        // archive with it paused already (`OpenOptions::read_ahead_at_once`).
        // It resumes when the tree runs (lazy) or the held fill
        // starts (`Pager::fill_held`).
        self.source.read_ahead(false);
        // A lazy tree waits for the proof's walk before it runs: the walk
        // starts now, beside the images and CRIU (started at the images'
        // end instead, it slowed CRIU's start from a cold cache as much:
        // session 89). A held tree's fill starts it, as it is waited for
        // only once every page is in.
        if !hold {
            self.source.start_proof();
        }
        // A held tree never runs before every page is in: no working set to
        // learn from, nor to bring first.
        let touch = if hold { None } else { touch_path(self.input) };
        let recorded = load_touches(touch.as_deref());
        // Found once: the lazy plan of shared memory and the images below
        // both ask which pages images one pagemap alone names. A placed
        // restore's plan found them already.
        let named_once = if planned.is_some() { HashSet::new() } else { pages_images_named_once(&*self.source)? };
        let served_shared = if gated { shmem::plan_lazy(&*self.source, &named_once)? } else { Vec::new() };
        let placed = self.shared.iter().map(|o| (o.pagemap.as_str(), o.pages_id));
        let left_empty: HashMap<&str, u32> =
            placed.chain(served_shared.iter().map(|o| (o.pagemap.as_str(), o.pages_id))).collect();
        // With `verify_first`, every stored byte is proven before the tree
        // may run, beside the images being written (which decode and prove
        // their own blocks); otherwise behind the running tree.
        let (proven, materialized) = std::thread::scope(|s| {
            let proving = self.verify_first.then(|| s.spawn(|| self.source.prove_stored()));
            let min_zero_run = match (keep_zeros, hold) {
                (true, _) => KEPT_ZERO_RUN,
                (false, true) => HELD_MIN_ZERO_RUN,
                (false, false) => LAZY_MIN_ZERO_RUN,
            };
            let materialized =
                materialize(blocks, self.images, min_zero_run, planned, &named_once, &left_empty, self.threads);
            (proving.map_or(Ok(()), |p| p.join().unwrap_or(Err(Error::Cancelled))), materialized)
        });
        proven?;
        let materialized = materialized?;
        blocks.reset_cursor();
        Ok(Prepared { touch, recorded, served_shared, materialized })
    }

    /// Decoders for a running tree's fill one block at a time (one core):
    /// where zstd blocks dominate, decoding is slower than copying, so every
    /// core but one (left to the tree) decodes; LZ4 and raw blocks decode
    /// faster than one thread copies them in (2 cores: lz4 restores took
    /// 0.33-0.52 s with one decoder, 0.46-0.56 s with two; zstd 0.41-1.10 s
    /// with one, 0.49-0.84 s with two), so one decoder keeps up. A fill in
    /// steps needs none: its threads decode their own blocks
    /// (`session::place`).
    pub(super) fn decoders(&self, fill_threads: usize) -> usize {
        if fill_threads > 1 {
            0
        } else if mostly_zstd(&*self.source) {
            self.threads.saturating_sub(1).max(1)
        } else {
            1
        }
    }
}

/// Whether most page blocks of the archive are zstd blocks.
fn mostly_zstd(source: &dyn BlockSource) -> bool {
    let (mut zstd, mut all) = (0usize, 0usize);
    for f in source.index().files.iter().filter(|f| f.kind == FileKind::Pages) {
        let mut i = 0;
        while let Some((h, _)) = source.block_header(f.file_id, i) {
            zstd += usize::from(h.codec.without_planes() == crate::format::BlockCodec::Zstd);
            all += 1;
            i += 1;
        }
    }
    zstd * 2 > all
}

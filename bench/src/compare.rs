//! The comparison itself: each workload under each configuration, run
//! after run, a fresh process each time, and each restore checked by
//! asking the restored process what it asked before the dump. A run that
//! fails is recorded with why and the rest go on; an interrupt (SIGINT)
//! ends the loop after the run under way, and what was measured is kept.

use crate::config::{self, Config, Env, Place};
use crate::error::{Error, Result};
use crate::proc;
use crate::report::{Pair, Sample};
use crate::workload::{self, Running, Tools};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

/// The workloads, configurations and runs of a comparison.
pub struct Matrix<'a> {
    pub workloads: &'a [String],
    pub configs: &'a [Config],
    pub runs: usize,
    /// Why a workload or configuration (by name) cannot run on this
    /// machine: each of its runs fails with that.
    pub unavailable: &'a [(String, String)],
}

/// Runs every workload x configuration `m.runs` times, workload by
/// workload, the configurations in turn within each run (so that a slow
/// drift of the machine touches them alike); one [`Pair`] each, in the
/// order of `m.workloads` then `m.configs`.
pub fn measure(ctx: &Ctx, m: &Matrix) -> Vec<Pair> {
    stop_on_interrupt();
    let mut pairs: Vec<Pair> = Vec::new();
    for w in m.workloads {
        for c in m.configs {
            pairs.push(Pair { workload: w.clone(), config: c.name(), runs: 0, samples: vec![], failures: vec![] });
        }
    }
    let total = pairs.len() * m.runs;
    let mut k = 0;
    'all: for (wi, w) in m.workloads.iter().enumerate() {
        for run in 1..=m.runs {
            for (ci, c) in m.configs.iter().enumerate() {
                if interrupted() {
                    break 'all;
                }
                k += 1;
                let pair = &mut pairs[wi * m.configs.len() + ci];
                pair.runs += 1;
                let tag = format!("[{k}/{total}] {w} / {} run {run}/{}", c.name(), m.runs);
                if let Some((_, why)) = m.unavailable.iter().find(|(n, _)| n == w || n == c.name()) {
                    eprintln!("bench: {tag}: FAILED: {why}");
                    pair.failures.push(format!("run {run}: {why}"));
                    continue;
                }
                match one_run(ctx, w, *c, k) {
                    Ok(mut s) => {
                        s.run = run;
                        eprintln!("bench: {tag}: {}, intact", summary(&s));
                        pair.samples.push(s);
                    }
                    Err(e) => {
                        eprintln!("bench: {tag}: FAILED: {e}");
                        pair.failures.push(format!("run {run}: {e}"));
                    }
                }
                proc::reap_zombies();
            }
        }
    }
    pairs
}

/// One run's progress line.
fn summary(s: &Sample) -> String {
    format!(
        "dump {:.2}s (frozen {}), restore {:.2}s, {} -> {}, cpu {:.2}s{}",
        s.dump_s,
        s.frozen_s.map(|f| format!("{f:.2}s")).unwrap_or_else(|| "?".into()),
        s.restore_s,
        human(s.raw_bytes),
        human(s.bytes),
        s.cpu_s,
        s.criuz_rss_kib.map(|k| format!(", criuz RSS {}", human(k << 10))).unwrap_or_default()
    )
}

static INTERRUPTED: AtomicBool = AtomicBool::new(false);

extern "C" fn on_interrupt(_: libc::c_int) {
    INTERRUPTED.store(true, Ordering::SeqCst);
}

/// From here, a SIGINT ends the comparison after the run under way.
fn stop_on_interrupt() {
    // SAFETY: the handler only stores to an atomic.
    unsafe { libc::signal(libc::SIGINT, on_interrupt as *const () as libc::sighandler_t) };
}

/// Whether a SIGINT asked the comparison to end.
pub fn interrupted() -> bool {
    INTERRUPTED.load(Ordering::SeqCst)
}

/// Removes a directory when the run ends, however it ends.
struct Scratch(PathBuf);

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

pub fn mkdir(p: &Path) -> Result<()> {
    std::fs::create_dir_all(p).map_err(|e| Error::file(p, e))
}

/// What every run of the comparison shares.
pub struct Ctx<'a> {
    pub env: &'a Env,
    pub tools: &'a Tools,
    /// Where each run's directory goes.
    pub work: &'a Path,
    /// Where the tmpfs configurations keep their checkpoints.
    pub tmpfs: Option<&'a Path>,
    pub mib: u64,
    /// Drop the page cache before each restore.
    pub cold: bool,
    /// Waited between each dump and its restore (`--settle`).
    pub settle: Duration,
}

/// One checkpoint and restore of a fresh workload; Ok only if the restored
/// process answers exactly as it did before the dump.
fn one_run(ctx: &Ctx, w: &str, cfg: Config, id: usize) -> Result<Sample> {
    let dir = ctx.work.join(format!("run-{id}"));
    let _dir = Scratch(dir.clone());
    let logs = dir.join("logs");
    mkdir(&logs)?;
    let store = match (cfg.on_tmpfs(), ctx.tmpfs) {
        (true, Some(t)) => t.join(format!("run-{id}")),
        (true, None) => return Err(Error::Invalid("no tmpfs".into())),
        (false, _) => dir.join("store"),
    };
    let _store = Scratch(store.clone());
    mkdir(&store)?;
    let place = Place { store, logs, key: format!("run-{id}.czr") };

    let mut app = Running::start(w, ctx.mib, &dir.join("app"), ctx.tools)
        .map_err(|e| Error::Invalid(format!("starting {w}: {e}")))?;
    let before = app.fingerprint().map_err(|e| Error::Invalid(format!("asking {w} before the dump: {e}")))?;
    let pids = proc::tree(app.pid);
    let cpu_before: f64 = pids.iter().filter_map(|p| proc::cpu_seconds(*p)).sum();
    let tree_before_kib = proc::pss_anon_kib(&pids);
    let huge_before_kib = proc::anon_huge_kib(&pids);
    let read_ns_before = app.random_read_ns();

    // The previous run's writeback must not run inside this one's dump.
    // SAFETY: sync(2) has no preconditions.
    unsafe { libc::sync() };
    let d = config::dump(cfg, ctx.env, &place, app.pid)?;

    // CRIU ended the tree: reap it so its pids are free for the restore. Its
    // CPU during the dump (CRIU's parasite code runs inside it) counts.
    let mut cpu_after = 0.0;
    let mut all_ours = true;
    for p in &pids {
        match proc::reap(*p, Duration::from_secs(30))? {
            Some(u) => cpu_after += u.cpu_s,
            None => all_ours = false,
        }
    }
    let dumped_cpu = if all_ours { (cpu_after - cpu_before).max(0.0) } else { 0.0 };

    // Cold: the disk's plain sequential read of the same checkpoint first,
    // then the restore, each from a dropped page cache.
    let mut disk_read_bps = None;
    if ctx.cold {
        if let Some(path) = config::checkpoint_path(cfg, ctx.env, &place) {
            proc::drop_caches()?;
            let (n, secs) = proc::read_through(&path)?;
            disk_read_bps = Some(n as f64 / secs.max(1e-9));
        }
        proc::drop_caches()?;
    }
    std::thread::sleep(ctx.settle);
    let r = config::restore(cfg, ctx.env, &place)?;
    // CPU the restored processes spent being restored (CRIU fills their memory
    // from inside them).
    let restored = proc::tree(app.pid);
    let restored_cpu: f64 = restored.iter().filter_map(|p| proc::cpu_seconds(*p)).sum();
    let tree_restored_kib = proc::pss_anon_kib(&restored);
    let huge_restored_kib = proc::anon_huge_kib(&restored);
    if !proc::alive(app.pid) {
        return Err(Error::Invalid(format!("the restored process {} is not running", app.pid)));
    }
    let after = app.fingerprint().map_err(|e| Error::Invalid(format!("asking {w} after the restore: {e}")))?;
    if after != before {
        return Err(Error::Invalid(format!("restored {w} is not intact: before {before:?}, after {after:?}")));
    }
    let read_ns_restored = app.random_read_ns();
    // Cold: the same checkpoint again from the now warm page cache, so that
    // what the cold reads added shows (pattern workloads answer the same
    // request again; restores that unpack first would need their directory
    // emptied).
    let mut warm_restore_s = None;
    if ctx.cold && workload::PATTERNS.contains(&w) && cfg.restores_from_checkpoint() && ctx.env.link.is_none() {
        let restored = proc::tree(app.pid);
        proc::kill_tree(&restored);
        for p in &restored {
            proc::reap(*p, Duration::from_secs(30))?;
        }
        let again = config::restore(cfg, ctx.env, &place)?;
        let answer = app.fingerprint().map_err(|e| Error::Invalid(format!("asking {w} after a warm restore: {e}")))?;
        if answer != before {
            return Err(Error::Invalid(format!("{w} restored again is not intact: {answer:?}")));
        }
        warm_restore_s = Some(again.restore_s);
    }
    drop(app);
    let cold_extra = warm_restore_s.map(|warm| r.restore_s - warm).filter(|&extra| extra > 0.0);
    Ok(Sample {
        run: 0,
        dump_s: d.dump_s,
        frozen_s: d.frozen_s,
        restore_s: r.restore_s,
        bytes: d.bytes,
        raw_bytes: d.raw_bytes,
        cpu_s: d.usage.cpu_s + dumped_cpu + r.usage.cpu_s + restored_cpu,
        dump_cpu_s: d.usage.cpu_s + dumped_cpu,
        peak_rss_kib: d.usage.maxrss_kib.max(r.usage.maxrss_kib),
        dump_rss_kib: d.usage.maxrss_kib,
        criuz_rss_kib: d.criuz_rss_kib,
        warm_restore_s,
        cold_read_bps: cold_extra.map(|extra| d.bytes as f64 / extra),
        disk_read_bps,
        tree_before_kib,
        tree_restored_kib,
        huge_before_kib,
        huge_restored_kib,
        read_ns_before,
        read_ns_restored,
    })
}

fn human(b: u64) -> String {
    format!("{:.1} MiB", b as f64 / (1u64 << 20) as f64)
}

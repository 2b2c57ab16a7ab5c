//! `criuz-bench --load N`: an eviction wave. N processes of the workload
//! are dumped by N `criuz dump`s started together, then restored by N
//! `criuz restore`s started together; then the same work is done one
//! process at a time. Every restore is checked by the workload's own
//! fingerprint. Reported: the wall time of each wave against the one at a
//! time, and the criuz processes' peak RSS added up (an upper bound of what
//! they held at once) against the machine share the dumps draw their
//! absorb memory from (`criuz::proc::budget`).

use crate::config::{self, Config, Env, Place};
use crate::error::{Error, Result};
use crate::workload::{Running, Tools};
use std::path::Path;
use std::time::Instant;

#[derive(Clone, Debug, serde::Serialize)]
pub struct LoadRow {
    pub workload: String,
    pub processes: usize,
    pub mib: u64,
    /// Wall seconds of the concurrent wave, and of the same work one at a time.
    pub dump_wave_s: f64,
    pub dump_serial_s: f64,
    pub restore_wave_s: f64,
    pub restore_serial_s: f64,
    /// Peak RSS of the concurrent dumps added up, and the largest one, MiB.
    pub dump_wave_rss_sum_mib: f64,
    pub dump_wave_rss_max_mib: f64,
    pub restore_wave_rss_sum_mib: f64,
    /// The machine share the dumps' absorb memory comes from, MiB.
    pub share_mib: f64,
    pub intact: bool,
}

fn place(work: &Path, i: usize) -> Result<Place> {
    let store = work.join(format!("load-{i}"));
    let logs = store.join("logs");
    std::fs::create_dir_all(&logs).map_err(|e| Error::file(&logs, e))?;
    Ok(Place { store, logs, key: format!("load-{i}.czr") })
}

/// Starts `n` workloads (in directories of their own, named by `phase`)
/// and fingerprints them.
fn start(w: &str, n: usize, mib: u64, work: &Path, phase: &str, tools: &Tools) -> Result<Vec<(Running, String)>> {
    (0..n)
        .map(|i| {
            let mut app = Running::start(w, mib, &work.join(format!("app-{phase}-{i}")), tools)?;
            let sum = app.fingerprint()?;
            Ok((app, sum))
        })
        .collect()
}

/// Checks every restored workload against its fingerprint, then ends it.
fn check(apps: Vec<(Running, String)>) -> Result<bool> {
    let mut intact = true;
    for (mut app, before) in apps {
        intact &= app.fingerprint()? == before;
    }
    Ok(intact)
}

fn reap(apps: &[(Running, String)]) -> Result<()> {
    for (app, _) in apps {
        crate::proc::reap(app.pid, std::time::Duration::from_secs(30))?;
    }
    Ok(())
}

const MIB: f64 = (1u64 << 20) as f64;

pub fn measure(w: &str, n: usize, mib: u64, work: &Path, tools: &Tools, env: &Env) -> Result<LoadRow> {
    let cfg = Config::CriuzLz4;
    let places: Vec<Place> = (0..n).map(|i| place(work, i)).collect::<Result<_>>()?;

    // The wave: N dumps at once, then N restores at once.
    let apps = start(w, n, mib, work, "wave", tools)?;
    // SAFETY: sync(2) has no preconditions.
    unsafe { libc::sync() };
    let t = Instant::now();
    let dumped: Vec<Result<config::Dumped>> = std::thread::scope(|s| {
        let runs: Vec<_> =
            apps.iter().zip(&places).map(|((app, _), p)| s.spawn(move || config::dump(cfg, env, p, app.pid))).collect();
        runs.into_iter().map(|r| r.join().unwrap_or_else(|_| Err(Error::Invalid("dump thread".into())))).collect()
    });
    let dump_wave_s = t.elapsed().as_secs_f64();
    let dumped = dumped.into_iter().collect::<Result<Vec<_>>>()?;
    reap(&apps)?;
    let t = Instant::now();
    let restored: Vec<Result<config::Restored>> = std::thread::scope(|s| {
        let runs: Vec<_> = places.iter().map(|p| s.spawn(move || config::restore(cfg, env, p))).collect();
        runs.into_iter().map(|r| r.join().unwrap_or_else(|_| Err(Error::Invalid("restore thread".into())))).collect()
    });
    let restore_wave_s = t.elapsed().as_secs_f64();
    let restored = restored.into_iter().collect::<Result<Vec<_>>>()?;
    let mut intact = check(apps)?;

    // The same work, one process at a time.
    let (mut dump_serial_s, mut restore_serial_s) = (0.0, 0.0);
    for p in &places {
        let _ = std::fs::remove_dir_all(&p.store);
    }
    let places: Vec<Place> = (0..n).map(|i| place(work, i)).collect::<Result<_>>()?;
    let apps = start(w, n, mib, work, "serial", tools)?;
    for ((app, _), p) in apps.iter().zip(&places) {
        // SAFETY: as above.
        unsafe { libc::sync() };
        let t = Instant::now();
        config::dump(cfg, env, p, app.pid)?;
        dump_serial_s += t.elapsed().as_secs_f64();
    }
    reap(&apps)?;
    for p in &places {
        let t = Instant::now();
        config::restore(cfg, env, p)?;
        restore_serial_s += t.elapsed().as_secs_f64();
    }
    intact &= check(apps)?;
    for p in &places {
        let _ = std::fs::remove_dir_all(&p.store);
    }

    let rss = |kib: &mut dyn Iterator<Item = u64>| kib.map(|k| k as f64 * 1024.0 / MIB).collect::<Vec<f64>>();
    let dump_rss = rss(&mut dumped.iter().map(|d| d.usage.maxrss_kib));
    let restore_rss = rss(&mut restored.iter().map(|r| r.usage.maxrss_kib));
    Ok(LoadRow {
        workload: w.to_string(),
        processes: n,
        mib,
        dump_wave_s,
        dump_serial_s,
        restore_wave_s,
        restore_serial_s,
        dump_wave_rss_sum_mib: dump_rss.iter().sum(),
        dump_wave_rss_max_mib: dump_rss.iter().copied().fold(0.0, f64::max),
        restore_wave_rss_sum_mib: restore_rss.iter().sum(),
        share_mib: criuz::proc::budget::machine_share() as f64 / MIB,
        intact,
    })
}

pub fn table(rows: &[LoadRow]) -> String {
    let mut out = String::from(
        "workload  N  MiB  dump wave s (one at a time)  restore wave s (one at a time)  dump RSS sum / max MiB  restore RSS sum MiB  share MiB  intact\n",
    );
    for r in rows {
        out.push_str(&format!(
            "{:<8} {:>2} {:>4}  {:>10.2} ({:>6.2})            {:>10.2} ({:>6.2})               {:>8.0} / {:>6.0}        {:>10.0}  {:>9.0}  {}\n",
            r.workload,
            r.processes,
            r.mib,
            r.dump_wave_s,
            r.dump_serial_s,
            r.restore_wave_s,
            r.restore_serial_s,
            r.dump_wave_rss_sum_mib,
            r.dump_wave_rss_max_mib,
            r.restore_wave_rss_sum_mib,
            r.share_mib,
            if r.intact { "yes" } else { "NO" }
        ));
    }
    out
}

//! `criuz-bench --lazy`: lazy restore against plain restore of one archive.
//!
//! Per workload: one `criuz dump`, then rounds of three restores in
//! rotating order, each after the same pause and guest-memory warm-up:
//! - plain: `criuz restore -d`, then the workload's own full read of its
//!   memory (its fingerprint): restore time, and restore + read time;
//! - lazy: `criuz restore --lazy -d --pidfile`: time until the pidfile
//!   appears (the tree runs) and until criuz exits (every page in), with
//!   criuz's peak RSS (criuz with its guard, and CRIU, as wait4 reports them);
//! - lazy + read: the same, with the full read sent the moment the tree
//!   runs: time until the read's answer.
//!
//! - with the working set: one lazy restore + read records the pages it saw
//!   faulted (`<archive>.touch`); then rounds of lazy + read restoring from
//!   that record (the fill brings those pages' blocks first).
//!
//! - the floor users compare to: `criu restore -D -d` of the same
//!   checkpoint (the archive unpacked once), timed until it returns.
//!
//! With `--verify-first`, every lazy restore passes it (the archive proven
//! before CRIU starts): the tree's start in that order, and CRIU's part of
//! it timed with no proof running beside it.
//!
//! The plain lazy rounds remove the record first. Every restore is checked
//! by the workload's fingerprint. With `--cold` the page cache is dropped
//! before each restore (after the warm-up), so the archive, criuz's and
//! CRIU's binaries and the workload's files are all read from the disk.

use crate::error::{Error, Result};
use crate::proc::{self, Dst, Src, Usage};
use crate::workload::{Running, Tools};
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

#[derive(Clone, Debug, serde::Serialize)]
pub struct LazyRow {
    pub workload: String,
    /// The dump's codec.
    pub codec: String,
    /// Every restore started from a dropped page cache.
    pub cold: bool,
    /// The lazy restores proved the archive before CRIU started.
    pub verify_first: bool,
    pub raw_bytes: u64,
    pub archive_bytes: u64,
    /// Medians over the rounds, seconds.
    pub plain_restore_s: f64,
    pub plain_restore_read_s: f64,
    /// `criu restore -D -d` of the same checkpoint, unpacked.
    pub criu_restore_s: f64,
    pub lazy_running_s: f64,
    /// Of `lazy_running_s`, criuz's own part before it started CRIU
    /// (opening the archive, writing CRIU's images; criuz's report).
    pub lazy_criu_started_s: f64,
    /// Then, on criuz's clock (its report): CRIU had handed the tree over,
    /// the walks had proven the index (no earlier than the handover), and
    /// CRIU exited; the tree runs once the last of these has passed.
    pub lazy_handed_over_s: f64,
    pub lazy_index_proven_s: f64,
    pub lazy_criu_exited_s: f64,
    /// CRIU's own part: from criuz starting it to its exit, the median of
    /// each restore's.
    pub lazy_criu_s: f64,
    pub lazy_resident_s: f64,
    pub lazy_running_read_s: f64,
    /// With the working set a first lazy restore + read recorded
    /// (`<archive>.touch`): until running, and the full read.
    pub ws_running_s: f64,
    pub ws_running_read_s: f64,
    /// Until the working set was in place (criuz's report).
    pub ws_in_s: f64,
    pub working_set_pages: u64,
    /// Peak RSS of `criuz restore` (with its children), MiB.
    pub plain_rss_mib: f64,
    pub lazy_rss_mib: f64,
    /// The restored tree's anonymous memory (its processes' PSS) once every
    /// page is in, MiB: what each way of restoring costs the tree itself
    /// (pages that read as zero may be the kernel's zero page).
    pub plain_tree_mib: f64,
    pub lazy_tree_mib: f64,
    /// From criuz's report of the last lazy restore.
    pub lazy_pages: u64,
    /// Zero pages the last lazy restore mapped rather than copied.
    pub lazy_zero_pages_mapped: u64,
    pub faults: u64,
    pub intact: bool,
}

fn median(v: &[f64]) -> f64 {
    crate::report::median(v).unwrap_or(f64::NAN)
}

/// One lazy restore's command: `criuz restore --lazy -d --json --pidfile`
/// of `arc`, with `--verify-first` where asked.
struct LazyCommand<'a> {
    criuz: &'a Path,
    arc: &'a Path,
    pidfile: &'a Path,
    logs: &'a Path,
    verify_first: bool,
}

impl LazyCommand<'_> {
    /// Runs the restore in the background; `on_running` is called once the
    /// pidfile appears, with the time since the start. Returns the time
    /// until criuz exited, its usage, and its standard output.
    fn run(&self, mut on_running: impl FnMut(f64) -> Result<()>) -> Result<(f64, Usage, Vec<u8>)> {
        let pidfile = self.pidfile;
        let _ = std::fs::remove_file(pidfile);
        let mut cmd = Command::new(self.criuz);
        cmd.args(["restore", "--lazy", "-d", "--json", "--pidfile"]).arg(pidfile).arg("-i").arg(self.arc);
        if self.verify_first {
            cmd.arg("--verify-first");
        }
        let t = Instant::now();
        std::thread::scope(|s| {
            let run = s.spawn(|| proc::pipeline(vec![cmd], Src::Null, Dst::Capture, self.logs, "lazy-restore"));
            while !pidfile.exists() {
                if run.is_finished() {
                    break;
                }
                std::thread::sleep(Duration::from_micros(500));
            }
            if pidfile.exists() {
                on_running(t.elapsed().as_secs_f64())?;
            }
            let f = run.join().map_err(|_| Error::Invalid("the lazy restore thread panicked".into()))??;
            Ok((t.elapsed().as_secs_f64(), f.usage, f.stdout))
        })
    }

    /// The restore with the workload's full read (its fingerprint, checked
    /// against `before`) sent the moment the tree runs: the time until it
    /// ran, until the read's answer, and criuz's report.
    fn run_and_read(&self, app: &mut Running, before: &str, intact: &mut bool) -> Result<(f64, f64, Vec<u8>)> {
        let mut times = None;
        let (_, _, out) = self.run(|t0| {
            let t = Instant::now();
            *intact &= app.fingerprint().map(|after| after == before).unwrap_or(false);
            times = Some((t0, t0 + t.elapsed().as_secs_f64()));
            Ok(())
        })?;
        let (running, read) = times.ok_or_else(|| Error::Invalid("the lazy restore never ran".into()))?;
        Ok((running, read, out))
    }
}

fn settle(mib: u64, cold: bool) -> Result<()> {
    std::thread::sleep(Duration::from_secs(1));
    proc::warm_guest_memory(proc::warm_bytes(mib));
    if cold {
        proc::drop_caches()?;
    }
    Ok(())
}

/// What one lazy row measures: a workload of `mib` MiB dumped with `codec`,
/// restored `runs` times each way (at least 3), from a dropped page cache
/// if `cold`.
pub struct Shape<'a> {
    pub workload: &'a str,
    pub codec: &'a str,
    pub mib: u64,
    pub runs: usize,
    pub cold: bool,
    /// Lazy restores with `--verify-first`.
    pub verify_first: bool,
}

pub fn measure(shape: &Shape, work: &Path, tools: &Tools, criuz: &Path, criu: &Path) -> Result<LazyRow> {
    let &Shape { workload: name, codec, mib, runs, cold, verify_first } = shape;
    let dir = work.join(format!("lazy-{name}"));
    let logs = dir.join("logs");
    std::fs::create_dir_all(&logs).map_err(|e| Error::file(&logs, e))?;
    let mut app = Running::start(name, mib, &dir.join("app"), tools)?;
    let arc = dir.join("archive.czr");
    let before = app.fingerprint()?;
    let pids = proc::tree(app.pid);
    let pid = app.pid.to_string();
    let dump = Command::new(criuz).args(["dump", "--codec", codec, "-t", &pid, "-o"]).arg(&arc).output()?;
    if !dump.status.success() {
        return Err(Error::Invalid(format!("criuz dump: {}", String::from_utf8_lossy(&dump.stderr).trim())));
    }
    for &p in &pids {
        proc::reap(p, Duration::from_secs(60))?;
    }
    proc::reap_zombies();
    let pidfile = dir.join("restored.pid");
    let lazy = LazyCommand { criuz, arc: &arc, pidfile: &pidfile, logs: &logs, verify_first };
    let touch = dir.join("archive.czr.touch");
    let (mut plain, mut plain_read, mut running, mut resident, mut running_read) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let (mut plain_rss, mut lazy_rss, mut report) = (0u64, 0u64, serde_json::Value::Null);
    let (mut criu_started, mut handed_over, mut index_proven, mut criu_exited, mut criu_part) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let (mut plain_tree, mut lazy_tree) = (Vec::new(), Vec::new());
    let tree_mib = |app: &Running| proc::pss_anon_kib(&proc::tree(app.pid)) as f64 / 1024.0;
    let mut intact = true;
    let end = |app: &mut Running, intact: &mut bool| {
        *intact &= app.fingerprint().map(|after| after == before).unwrap_or(false);
        proc::kill_tree(&proc::tree(app.pid));
        proc::reap_zombies();
    };
    for round in 0..runs.max(3) {
        for step in 0..3 {
            settle(mib, cold)?;
            match (round + step) % 3 {
                0 => {
                    let mut cmd = Command::new(criuz);
                    cmd.args(["restore", "-d", "-i"]).arg(&arc);
                    let t = Instant::now();
                    let f = proc::pipeline(vec![cmd], Src::Null, Dst::Null, &logs, "restore")?;
                    plain.push(t.elapsed().as_secs_f64());
                    plain_rss = plain_rss.max(f.usage.maxrss_kib);
                    plain_tree.push(tree_mib(&app));
                    intact &= app.fingerprint().map(|after| after == before).unwrap_or(false);
                    plain_read.push(t.elapsed().as_secs_f64());
                    proc::kill_tree(&proc::tree(app.pid));
                    proc::reap_zombies();
                }
                1 => {
                    let _ = std::fs::remove_file(&touch);
                    let (all, usage, out) = lazy.run(|t| {
                        running.push(t);
                        Ok(())
                    })?;
                    resident.push(all);
                    lazy_rss = lazy_rss.max(usage.maxrss_kib);
                    lazy_tree.push(tree_mib(&app));
                    report = serde_json::from_slice(&out).unwrap_or(serde_json::Value::Null);
                    let seconds = |key: &str| report[key].as_f64().unwrap_or(f64::NAN);
                    criu_started.push(seconds("criu_started_seconds"));
                    handed_over.push(seconds("handed_over_seconds"));
                    index_proven.push(seconds("index_proven_seconds"));
                    criu_exited.push(seconds("criu_exited_seconds"));
                    criu_part.push(seconds("criu_exited_seconds") - seconds("criu_started_seconds"));
                    end(&mut app, &mut intact);
                }
                _ => {
                    let _ = std::fs::remove_file(&touch);
                    let (_, read, _) = lazy.run_and_read(&mut app, &before, &mut intact)?;
                    running_read.push(read);
                    end(&mut app, &mut intact);
                }
            }
        }
    }
    // The working set: recorded by one lazy restore + read, then restored
    // from that same record each round.
    let _ = std::fs::remove_file(&touch);
    lazy.run_and_read(&mut app, &before, &mut intact)?;
    end(&mut app, &mut intact);
    let record = dir.join("working-set");
    std::fs::copy(&touch, &record).map_err(|e| Error::file(&touch, e))?;
    let (mut ws_running, mut ws_read, mut ws_in, mut ws_pages) = (Vec::new(), Vec::new(), Vec::new(), 0);
    for _ in 0..runs.max(3) {
        std::fs::copy(&record, &touch).map_err(|e| Error::file(&record, e))?;
        settle(mib, cold)?;
        let (running, read, out) = lazy.run_and_read(&mut app, &before, &mut intact)?;
        ws_running.push(running);
        ws_read.push(read);
        let rep: serde_json::Value = serde_json::from_slice(&out).unwrap_or(serde_json::Value::Null);
        ws_pages = rep["working_set_pages"].as_u64().unwrap_or(0);
        ws_in.push(rep["working_set_seconds"].as_f64().unwrap_or(f64::NAN));
        end(&mut app, &mut intact);
    }
    // The floor users compare to: `criu restore -D` of the same checkpoint.
    let img = dir.join("img");
    let unpacked = Command::new(criuz).arg("unpack").arg(&arc).arg("-d").arg(&img).output()?;
    if !unpacked.status.success() {
        return Err(Error::Invalid(format!("criuz unpack: {}", String::from_utf8_lossy(&unpacked.stderr).trim())));
    }
    let mut criu_restore = Vec::new();
    for _ in 0..runs.max(3) {
        settle(mib, cold)?;
        let mut cmd = Command::new(criu);
        cmd.args(["restore", "-d", "-D"]).arg(&img).arg("--work-dir").arg(&logs).args(["-o", "criu-restore.log"]);
        let t = Instant::now();
        proc::pipeline(vec![cmd], Src::Null, Dst::Null, &logs, "criu-restore")?;
        criu_restore.push(t.elapsed().as_secs_f64());
        end(&mut app, &mut intact);
    }
    let raw_bytes = {
        use criuz::archive::BlockSource;
        let a = criuz::archive::open(&criuz::io::Location::File(arc.clone()), &Default::default())?;
        a.index().files.iter().map(|f| f.raw_size).sum()
    };
    let row = LazyRow {
        workload: name.to_string(),
        codec: codec.to_string(),
        cold,
        verify_first,
        raw_bytes,
        archive_bytes: proc::file_bytes(&arc),
        plain_restore_s: median(&plain),
        plain_restore_read_s: median(&plain_read),
        criu_restore_s: median(&criu_restore),
        lazy_running_s: median(&running),
        lazy_criu_started_s: median(&criu_started),
        lazy_handed_over_s: median(&handed_over),
        lazy_index_proven_s: median(&index_proven),
        lazy_criu_exited_s: median(&criu_exited),
        lazy_criu_s: median(&criu_part),
        lazy_resident_s: median(&resident),
        lazy_running_read_s: median(&running_read),
        ws_running_s: median(&ws_running),
        ws_running_read_s: median(&ws_read),
        ws_in_s: median(&ws_in),
        working_set_pages: ws_pages,
        plain_rss_mib: plain_rss as f64 / 1024.0,
        lazy_rss_mib: lazy_rss as f64 / 1024.0,
        plain_tree_mib: median(&plain_tree),
        lazy_tree_mib: median(&lazy_tree),
        lazy_pages: report["lazy_pages"].as_u64().unwrap_or(0),
        lazy_zero_pages_mapped: report["zero_pages_mapped"].as_u64().unwrap_or(0),
        faults: report["faults"].as_u64().unwrap_or(0),
        intact,
    };
    drop(app);
    let _ = std::fs::remove_dir_all(&dir);
    Ok(row)
}

/// The table, with each lazy time as a ratio of the plain restore.
pub fn table(rows: &[LazyRow]) -> String {
    let mut s = format!(
        "{:<8} {:<5} {:>8} {:>9} {:>10} {:>10} {:>14} {:>15} {:>15} {:>9} {:>9} {:>7}\n",
        "workload",
        "codec",
        "raw MiB",
        "plain s",
        "plain+rd s",
        "running s",
        "resident s",
        "lazy+read s",
        "lazy pages/faults",
        "RSS MiB",
        "lazy RSS",
        "intact"
    );
    for r in rows {
        let x = |v: f64, of: f64| format!("{v:.2} ({:.2}x)", v / of);
        s.push_str(&format!(
            "{:<8} {:<5} {:>8.1} {:>9.2} {:>10.2} {:>10} {:>14} {:>15} {:>15} {:>9.1} {:>9.1} {:>7}\n",
            r.workload,
            r.codec,
            r.raw_bytes as f64 / (1 << 20) as f64,
            r.plain_restore_s,
            r.plain_restore_read_s,
            x(r.lazy_running_s, r.plain_restore_s),
            x(r.lazy_resident_s, r.plain_restore_s),
            x(r.lazy_running_read_s, r.plain_restore_read_s),
            format!("{}/{}", r.lazy_pages, r.faults),
            r.plain_rss_mib,
            r.lazy_rss_mib,
            if r.intact { "yes" } else { "NO" }
        ));
    }
    for r in rows {
        s.push_str(&format!(
            "{} {}: with the recorded working set ({} pages first, in after {:.2}s): running {:.2}s ({:.2}x), \
             lazy+read {:.2}s ({:.2}x)\n",
            r.workload,
            r.codec,
            r.working_set_pages,
            r.ws_in_s,
            r.ws_running_s,
            r.ws_running_s / r.plain_restore_s,
            r.ws_running_read_s,
            r.ws_running_read_s / r.plain_restore_read_s
        ));
    }
    for r in rows {
        s.push_str(&format!(
            "{} {}{}: of the lazy tree's start, criuz's own (opening the archive, writing CRIU's images) {:.1} ms, \
             then CRIU's restore and the tree's release {:.1} ms; on criuz's clock, CRIU handed the tree over at \
             {:.1} ms, the index was proven at {:.1} ms, CRIU exited at {:.1} ms (CRIU's own part {:.1} ms)\n",
            r.workload,
            r.codec,
            if r.verify_first { " (--verify-first)" } else { "" },
            r.lazy_criu_started_s * 1e3,
            (r.lazy_running_s - r.lazy_criu_started_s) * 1e3,
            r.lazy_handed_over_s * 1e3,
            r.lazy_index_proven_s * 1e3,
            r.lazy_criu_exited_s * 1e3,
            r.lazy_criu_s * 1e3
        ));
    }
    for r in rows {
        s.push_str(&format!(
            "{} {}: the restored tree's anonymous memory once every page is in: plain {:.0} MiB, lazy {:.0} MiB\n",
            r.workload, r.codec, r.plain_tree_mib, r.lazy_tree_mib
        ));
    }
    for r in rows {
        s.push_str(&format!(
            "{} {}: criu restore -D of the same checkpoint {:.2}s: running {:.2}x, resident {:.2}x of it\n",
            r.workload,
            r.codec,
            r.criu_restore_s,
            r.lazy_running_s / r.criu_restore_s,
            r.lazy_resident_s / r.criu_restore_s
        ));
    }
    s.push_str(
        "running/resident: x plain restore; lazy+read: full read sent when the tree runs, x (plain restore + read)\n",
    );
    if rows.iter().any(|r| r.cold) {
        s.push_str("cold: the page cache dropped before every restore\n");
    }
    s
}

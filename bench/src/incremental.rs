//! `criuz-bench --incremental`: periodic checkpoints of a running process.
//!
//! Per workload and share P: a full `criuz dump --leave-running`, then per
//! run: rewrite P% of the workload's state in place, `criuz dump --parent`
//! (incremental, against the previous run's full dump) and a full `criuz
//! dump` of the same state, both with `--leave-running`, timed side by side
//! in alternating order. The last child is then restored (the
//! process checked by its own fingerprint). Sizes: the child against the raw
//! bytes rewritten (pattern workloads know them). Then a chain: a full
//! `--ids` dump and ten generations of 5% rewrites of the `mixed` pattern,
//! restored from the chain and from its flattened archive in the order
//! chain, flat, flat, chain (at least six each), with CPU time and peak RSS.

use crate::error::{Error, Result};
use crate::proc::{self, Dst, Src, Usage};
use crate::workload::{Running, Tools};
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

#[derive(Clone, Debug, serde::Serialize)]
pub struct IncRow {
    pub workload: String,
    pub percent: f64,
    pub raw_bytes: u64,
    /// Bytes of pages rewritten (pattern workloads), else null.
    pub rewritten_bytes: Option<u64>,
    pub full_bytes: u64,
    pub child_bytes: u64,
    /// Medians over the runs, seconds: a plain full dump, a full dump with
    /// page ids (the parent of a series), the incremental dump from such a
    /// parent, and from a plain full dump.
    pub full_dump_s: f64,
    pub full_ids_dump_s: f64,
    pub incremental_dump_s: f64,
    pub incremental_plain_parent_dump_s: f64,
    pub child_restore_s: f64,
    pub child_restore_rss_mib: f64,
    pub intact: bool,
}

#[derive(Clone, Debug, serde::Serialize)]
pub struct ChainRow {
    pub workload: String,
    pub depth: usize,
    pub percent: f64,
    pub raw_bytes: u64,
    pub full_bytes: u64,
    /// Sum of the ten children.
    pub children_bytes: u64,
    pub flat_bytes: u64,
    /// Medians over the runs, seconds, and peak RSS of criuz restore.
    pub chain_restore_s: f64,
    pub flat_restore_s: f64,
    /// Medians of CPU seconds (criuz and CRIU, user and system).
    pub chain_restore_cpu_s: f64,
    pub flat_restore_cpu_s: f64,
    pub chain_restore_rss_mib: f64,
    pub flat_restore_rss_mib: f64,
    pub intact: bool,
}

struct Ctx<'a> {
    criuz: &'a Path,
    logs: &'a Path,
}

impl Ctx<'_> {
    fn run(&self, args: &[&str], step: &str) -> Result<(f64, Usage)> {
        let mut cmd = Command::new(self.criuz);
        cmd.args(args);
        let t = Instant::now();
        let f = proc::pipeline(vec![cmd], Src::Null, Dst::Null, self.logs, step)?;
        Ok((t.elapsed().as_secs_f64(), f.usage))
    }

    fn dump(&self, pid: i32, out: &Path, parent: Option<&Path>, leave_running: bool) -> Result<f64> {
        self.dump_with(pid, out, parent, leave_running, &[])
    }

    fn dump_with(
        &self,
        pid: i32,
        out: &Path,
        parent: Option<&Path>,
        leave_running: bool,
        extra: &[&str],
    ) -> Result<f64> {
        let _ = std::fs::remove_file(out);
        let pid = pid.to_string();
        let mut args = vec!["dump", "-t", &pid, "-o", out.to_str().expect("utf-8 path")];
        if let Some(p) = parent {
            args.extend(["--parent", p.to_str().expect("utf-8 path")]);
        }
        if leave_running {
            args.push("--leave-running");
        }
        args.extend_from_slice(extra);
        Ok(self.run(&args, "dump")?.0)
    }

    fn restore(&self, arc: &Path) -> Result<(f64, Usage)> {
        self.run(&["restore", "-d", "-i", arc.to_str().expect("utf-8 path")], "restore")
    }
}

fn median(v: &[f64]) -> f64 {
    crate::report::median(v).unwrap_or(f64::NAN)
}

fn mib(kib: u64) -> f64 {
    kib as f64 / 1024.0
}

/// The process tree is gone after a dump without --leave-running: reap it.
fn reap_all(pids: &[i32]) -> Result<()> {
    for &p in pids {
        proc::reap(p, Duration::from_secs(60))?;
    }
    proc::reap_zombies();
    Ok(())
}

fn raw_of(arc: &Path) -> Result<u64> {
    use criuz::archive::BlockSource;
    let a = criuz::archive::open(&criuz::io::Location::File(arc.into()), &Default::default())?;
    Ok(a.index().files.iter().map(|f| f.raw_size).sum())
}

/// One workload at one share P.
pub fn measure(
    name: &str,
    percent: f64,
    mib_size: u64,
    runs: usize,
    work: &Path,
    tools: &Tools,
    criuz: &Path,
) -> Result<IncRow> {
    let dir = work.join(format!("inc-{name}-{percent}"));
    let logs = dir.join("logs");
    std::fs::create_dir_all(&logs).map_err(|e| Error::file(&logs, e))?;
    let ctx = Ctx { criuz, logs: &logs };
    let mut app = Running::start(name, mib_size, &dir.join("app"), tools)?;
    // Each run's children have the previous run's full dumps as parents, so
    // they hold one rewrite's worth of changes. The parent of a series is a
    // full dump with --ids (as the README advises); the child of a plain full
    // dump is timed too (criuz must then hash the parent's pages first).
    let mut base = dir.join("base-0.czr");
    let mut plain_base = dir.join("plain-0.czr");
    ctx.dump_with(app.pid, &base, None, true, &["--ids"])?;
    ctx.dump(app.pid, &plain_base, None, true)?;
    let (child, plain_child, full) = (dir.join("child.czr"), dir.join("plain-child.czr"), dir.join("full.czr"));
    let (mut full_s, mut inc_s, mut plain_inc_s, mut ids_s, mut rewritten) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new(), None);
    for run in 0..runs.max(1) {
        rewritten = app.rewrite(percent, run as u64 + 1)?;
        let (next_base, next_plain) =
            (dir.join(format!("base-{}.czr", run + 1)), dir.join(format!("plain-{}.czr", run + 1)));
        // Alternate the order, so no dump always follows another.
        let order = if run % 2 == 0 { [0, 1, 2, 3] } else { [3, 2, 1, 0] };
        for step in order {
            match step {
                0 => inc_s.push(ctx.dump(app.pid, &child, Some(&base), true)?),
                1 => plain_inc_s.push(ctx.dump(app.pid, &plain_child, Some(&plain_base), true)?),
                2 => full_s.push(ctx.dump(app.pid, &full, None, true)?),
                _ => ids_s.push(ctx.dump_with(app.pid, &next_base, None, true, &["--ids"])?),
            }
        }
        std::fs::copy(&full, &next_plain).map_err(|e| Error::file(&full, e))?;
        if run + 1 < runs.max(1) {
            let _ = std::fs::remove_file(&base);
            let _ = std::fs::remove_file(&plain_base);
            (base, plain_base) = (next_base, next_plain);
        }
    }
    let before = app.fingerprint()?;
    let pids = proc::tree(app.pid);
    ctx.dump(app.pid, &child, Some(&base), false)?;
    reap_all(&pids)?;
    proc::warm_guest_memory(proc::warm_bytes(mib_size));
    let (restore_s, usage) = ctx.restore(&child)?;
    let intact = app.fingerprint().map(|after| after == before).unwrap_or(false);
    let row = IncRow {
        workload: name.to_string(),
        percent,
        raw_bytes: raw_of(&full)?,
        rewritten_bytes: rewritten,
        full_bytes: proc::file_bytes(&full),
        child_bytes: proc::file_bytes(&child),
        full_dump_s: median(&full_s),
        full_ids_dump_s: median(&ids_s),
        incremental_dump_s: median(&inc_s),
        incremental_plain_parent_dump_s: median(&plain_inc_s),
        child_restore_s: restore_s,
        child_restore_rss_mib: mib(usage.maxrss_kib),
        intact,
    };
    drop(app);
    let _ = std::fs::remove_dir_all(&dir);
    Ok(row)
}

/// A chain of `depth` generations of `percent`% rewrites of a pattern
/// workload; restores from the chain and from the flattened archive.
pub fn chain(
    name: &str,
    (depth, percent): (usize, f64),
    mib_size: u64,
    runs: usize,
    work: &Path,
    tools: &Tools,
    criuz: &Path,
) -> Result<ChainRow> {
    let dir = work.join(format!("chain-{name}"));
    let logs = dir.join("logs");
    std::fs::create_dir_all(&logs).map_err(|e| Error::file(&logs, e))?;
    let ctx = Ctx { criuz, logs: &logs };
    let mut app = Running::start(name, mib_size, &dir.join("app"), tools)?;
    let full = dir.join("gen0.czr");
    // The first checkpoint of a series carries page ids (the README's advice).
    ctx.dump_with(app.pid, &full, None, true, &["--ids"])?;
    let mut prev = full.clone();
    let mut children_bytes = 0;
    let mut before = String::new();
    for g in 1..=depth {
        app.rewrite(percent, g as u64)?;
        let next = dir.join(format!("gen{g}.czr"));
        let last = g == depth;
        let pids = proc::tree(app.pid);
        if last {
            before = app.fingerprint()?;
        }
        ctx.dump(app.pid, &next, Some(&prev), !last)?;
        if last {
            reap_all(&pids)?;
        }
        children_bytes += proc::file_bytes(&next);
        prev = next;
    }
    let flat = dir.join("flat.czr");
    ctx.run(&["flatten", prev.to_str().expect("utf-8"), "-o", flat.to_str().expect("utf-8")], "flatten")?;
    let (mut chain_s, mut flat_s, mut chain_rss, mut flat_rss) = (Vec::new(), Vec::new(), 0u64, 0u64);
    let (mut chain_cpu, mut flat_cpu) = (Vec::new(), Vec::new());
    let mut intact = true;
    // At least six of each, in the order chain, flat, flat, chain, ...: on
    // this VM a restore's time depends on what ran just before it (guest
    // pages handed back to the host, page cache reclaimed), so each side
    // gets the first and the second place equally often, after the same
    // pause.
    for run in 0..runs.max(6) * 2 {
        let from_chain = matches!(run % 4, 0 | 3);
        std::thread::sleep(Duration::from_secs(1));
        proc::warm_guest_memory(proc::warm_bytes(mib_size));
        let (s, u) = ctx.restore(if from_chain { &prev } else { &flat })?;
        intact &= app.fingerprint().map(|after| after == before).unwrap_or(false);
        if from_chain {
            chain_s.push(s);
            chain_cpu.push(u.cpu_s);
            chain_rss = chain_rss.max(u.maxrss_kib);
        } else {
            flat_s.push(s);
            flat_cpu.push(u.cpu_s);
            flat_rss = flat_rss.max(u.maxrss_kib);
        }
        proc::kill_tree(&proc::tree(app.pid));
        proc::reap_zombies();
    }
    let row = ChainRow {
        workload: name.to_string(),
        depth,
        percent,
        raw_bytes: raw_of(&flat)?,
        full_bytes: proc::file_bytes(&full),
        children_bytes,
        flat_bytes: proc::file_bytes(&flat),
        chain_restore_s: median(&chain_s),
        flat_restore_s: median(&flat_s),
        chain_restore_cpu_s: median(&chain_cpu),
        flat_restore_cpu_s: median(&flat_cpu),
        chain_restore_rss_mib: mib(chain_rss),
        flat_restore_rss_mib: mib(flat_rss),
        intact,
    };
    drop(app);
    let _ = std::fs::remove_dir_all(&dir);
    Ok(row)
}

/// The table; "incr*" is the incremental dump from a parent without page ids.
pub fn table(rows: &[IncRow], chains: &[ChainRow]) -> String {
    let m = |b: u64| b as f64 / (1 << 20) as f64;
    let mut s = format!(
        "{:<8} {:>4} {:>8} {:>10} {:>9} {:>9} {:>9} {:>8} {:>9} {:>8} {:>10} {:>9} {:>8} {:>7}\n",
        "workload",
        "P%",
        "raw MiB",
        "rewr. MiB",
        "full MiB",
        "child MiB",
        "limit MiB",
        "full s",
        "--ids s",
        "incr s",
        "incr* s",
        "restore s",
        "RSS MiB",
        "intact"
    );
    for r in rows {
        let limit = r.rewritten_bytes.map(|w| format!("{:.1}", m(w) * 1.1 + 1.0)).unwrap_or("-".into());
        let rewr = r.rewritten_bytes.map(|w| format!("{:.1}", m(w))).unwrap_or("-".into());
        s.push_str(&format!(
            "{:<8} {:>4} {:>8.1} {:>10} {:>9.1} {:>9.2} {:>9} {:>8.2} {:>9.2} {:>8.2} {:>10.2} {:>9.2} {:>8.1} {:>7}\n",
            r.workload,
            r.percent,
            m(r.raw_bytes),
            rewr,
            m(r.full_bytes),
            m(r.child_bytes),
            limit,
            r.full_dump_s,
            r.full_ids_dump_s,
            r.incremental_dump_s,
            r.incremental_plain_parent_dump_s,
            r.child_restore_s,
            r.child_restore_rss_mib,
            if r.intact { "yes" } else { "NO" }
        ));
    }
    for c in chains {
        s.push_str(&format!(
            "chain of {} x {}% ({}): restore {:.2}s from the chain vs {:.2}s flattened ({:.2}x), CPU {:.2}s vs {:.2}s; \
             peak RSS {:.1} vs {:.1} MiB; children {:.1} MiB in all, full {:.1} MiB, flat {:.1} MiB; intact: {}\n",
            c.depth,
            c.percent,
            c.workload,
            c.chain_restore_s,
            c.flat_restore_s,
            c.chain_restore_s / c.flat_restore_s,
            c.chain_restore_cpu_s,
            c.flat_restore_cpu_s,
            c.chain_restore_rss_mib,
            c.flat_restore_rss_mib,
            m(c.children_bytes),
            m(c.full_bytes),
            m(c.flat_bytes),
            if c.intact { "yes" } else { "NO" }
        ));
    }
    s
}

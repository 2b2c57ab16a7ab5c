//! The fault campaign (`criuz-faults`): on every path through criuz (dump
//! to a file, a pipe, S3, encrypted, left running; an incremental child; a
//! dump holding TCP connections; a page-server dump; runc checkpoint and
//! restore; pack, unpack and flatten; restore placed, streamed, lazy,
//! lazy verified first, in the foreground, encrypted, from a pipe, from S3,
//! of a chain, of huge pages) it injects faults at random moments (SIGKILL
//! of criuz, of CRIU, of the S3 server; a Ctrl-C of criuz; a full disk; a
//! dead pipe peer; a SIGCONT of the tree being restored) into real
//! processes checkpointed with real CRIU, and checks after each:
//!
//! - the checkpointed process runs with its own checksum unchanged, or the
//!   archive is complete and restores it intact (no process lost);
//! - no archive (or object) appears unless complete;
//! - a restore runs the process with its checksum intact, or leaves none;
//! - the retry succeeds and restores intact, and after it nothing is left:
//!   no temporary file, work directory, grant, stopped or stray process,
//!   incomplete multipart upload. An interrupted criuz must have left no
//!   file or directory before any retry.
//!
//! A clean run of each path first measures how long it takes (and must
//! pass); each fault then strikes uniformly within that time. Paths and
//! faults are taken in turn (each path's first fault, then each one's
//! second, ...) until the asked number of faults was injected.

pub mod check;
pub mod inject;
pub mod paths;

use crate::error::{Error, Result};
use crate::proc;
use crate::workload::Tools;
use check::{Places, Violation};
use inject::Fault;
use paths::{Ctx, Route, ROUTES};
use serde::Serialize;
use std::path::{Path, PathBuf};
use std::time::Instant;

/// What the campaign is asked to do.
pub struct Plan {
    /// Faults to inject (trials whose operation ended before the fault
    /// could strike do not count).
    pub faults: usize,
    pub mib: u64,
    pub seed: u64,
    /// Routes by name; empty: all.
    pub routes: Vec<String>,
    /// Faults by name; empty: every fault of each route.
    pub kinds: Vec<String>,
    pub criu: Option<PathBuf>,
    pub json: Option<PathBuf>,
    /// Keep the work directory (logs of every step) for a look afterwards.
    pub keep: bool,
}

/// Per route and fault: how many trials, faults struck, and what broke.
#[derive(Debug, Default, Serialize)]
pub struct Row {
    pub route: &'static str,
    pub fault: &'static str,
    pub trials: usize,
    pub injected: usize,
    /// Injected and every invariant held.
    pub survived: usize,
    pub lost_processes: usize,
    pub partial_archives: usize,
    pub wrong_memory: usize,
    pub leftovers: usize,
    pub other: usize,
    /// Processes lost to CRIU's own breakpoint as it was killed
    /// (`paths::CRIU_TRAP`): counted apart, not as criuz's violations.
    pub criu_traps: usize,
}

#[derive(Debug, Serialize)]
pub struct Report {
    pub seed: u64,
    pub mib: u64,
    pub seconds: f64,
    pub trials: usize,
    pub injected: usize,
    pub survived: usize,
    pub criu_traps: usize,
    pub rows: Vec<Row>,
    pub violations: Vec<Violation>,
}

pub fn run(plan: &Plan) -> Result<Report> {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        return Err(Error::Invalid("criuz-faults needs root (CRIU checkpoints and restores processes)".into()));
    }
    let routes: Vec<Route> = if plan.routes.is_empty() {
        ROUTES.to_vec()
    } else {
        plan.routes
            .iter()
            .map(|n| {
                ROUTES.iter().copied().find(|r| r.name() == n).ok_or_else(|| {
                    let all: Vec<&str> = ROUTES.iter().map(|r| r.name()).collect();
                    Error::Usage(format!("unknown path {n} (one of {})", all.join(", ")))
                })
            })
            .collect::<Result<_>>()?
    };
    // Before the clean runs, which take minutes.
    if let Some(path) = &plan.json {
        crate::output::check(path)?;
    }
    if let Some(k) = plan.kinds.iter().find(|k| !inject::FAULTS.iter().any(|f| f.name() == k.as_str())) {
        let all: Vec<&str> = inject::FAULTS.iter().map(|f| f.name()).collect();
        return Err(Error::Usage(format!("unknown fault {k} (one of {})", all.join(", "))));
    }
    let wanted = |f: &Fault| plan.kinds.is_empty() || plan.kinds.iter().any(|k| k == f.name());
    // Interleaved by route (each route's first fault, then each one's
    // second, ...), so that a short campaign strikes every route.
    let per_route: Vec<Vec<(Route, Fault)>> =
        routes.iter().map(|&r| r.faults().iter().filter(|f| wanted(f)).map(|&f| (r, f)).collect()).collect();
    let deepest = per_route.iter().map(Vec::len).max().unwrap_or(0);
    let combos: Vec<(Route, Fault)> =
        (0..deepest).flat_map(|j| per_route.iter().filter_map(move |faults| faults.get(j).copied())).collect();
    if combos.is_empty() {
        return Err(Error::Usage(format!("no path of those chosen takes the faults {}", plan.kinds.join(", "))));
    }
    let (criu, _) = criuz::criu::locate(plan.criu.as_deref())?;
    proc::become_subreaper()?;
    let work = tempfile::Builder::new().prefix("criuz-faults-").tempdir_in("/var/tmp")?;
    let bin = work.path().join("bin");
    std::fs::create_dir_all(&bin).map_err(|e| Error::file(&bin, e))?;
    let here = std::env::current_exe()?;
    let criuz = proc::copy_exe(&here.with_file_name("criuz"), &bin)?;
    let workload = proc::copy_exe(&here.with_file_name("criuz-workload"), &bin)?;
    let tools = Tools::prepare(work.path(), &["mixed".to_string()], workload, plan.mib)?;
    let mut ctx = Ctx::new(criuz, criu.path.clone(), tools, plan.mib, work.path(), plan.seed)?;
    let places = Places::new(ctx.tmp.clone(), vec![ctx.out.clone()]);
    let started = Instant::now();
    let mut rows: Vec<Row> = Vec::new();
    let mut violations = Vec::new();

    for &r in &routes {
        eprintln!("faults: {}: clean run", r.name());
        let f = ctx.trial(r, None)?;
        record(&mut ctx, &places, r, None, f, &mut rows, &mut violations);
    }
    let mut injected = 0;
    let mut k = 0;
    while injected < plan.faults && k < plan.faults * 3 {
        let (r, fault) = combos[k % combos.len()];
        k += 1;
        let f = match ctx.trial(r, Some(fault)) {
            Ok(f) => f,
            Err(e) => paths::Finding { broken: vec![("harness", e.to_string())], ..Default::default() },
        };
        injected += f.injected as usize;
        eprintln!(
            "faults: {:>4}/{} {} {}: {}",
            injected,
            plan.faults,
            r.name(),
            fault.name(),
            match (&f.criu_trap, f.broken.is_empty()) {
                (Some(_), true) => "lost to CRIU's trap".to_string(),
                (_, true) => "held".to_string(),
                _ => format!("{:?}", f.broken),
            }
        );
        record(&mut ctx, &places, r, Some(fault), f, &mut rows, &mut violations);
    }
    let report = Report {
        seed: plan.seed,
        mib: plan.mib,
        seconds: started.elapsed().as_secs_f64(),
        trials: rows.iter().map(|r| r.trials).sum(),
        injected: rows.iter().map(|r| r.injected).sum(),
        survived: rows.iter().map(|r| r.survived).sum(),
        criu_traps: rows.iter().map(|r| r.criu_traps).sum(),
        rows,
        violations,
    };
    if plan.keep {
        eprintln!("faults: work directory kept: {}", work.keep().display());
    }
    Ok(report)
}

/// Adds a trial's finding (and the leftovers after it) to the report.
fn record(
    ctx: &mut Ctx,
    places: &Places,
    route: Route,
    fault: Option<Fault>,
    mut f: paths::Finding,
    rows: &mut Vec<Row>,
    violations: &mut Vec<Violation>,
) {
    let spared: Vec<i32> = ctx.s3.pid().into_iter().collect();
    for l in check::leftovers(places, &spared, || check::multipart_uploads(crate::s3::BUCKET)) {
        f.broken.push(("leftover", l));
    }
    if fault.is_none() {
        ctx.clean_seconds.retain(|(r, _)| *r != route);
        ctx.clean_seconds.push((route, f.seconds.max(0.05)));
    } else if !f.injected {
        // The operation ended before the fault: strike sooner next time
        // (CRIU's part of a dump to S3 is a fraction of the whole).
        for (_, s) in ctx.clean_seconds.iter_mut().filter(|(r, _)| *r == route) {
            *s = (*s * 0.7).max(0.01);
        }
    }
    let fname = fault.map(Fault::name).unwrap_or("none");
    let i = match rows.iter().position(|r| r.route == route.name() && r.fault == fname) {
        Some(i) => i,
        None => {
            rows.push(Row { route: route.name(), fault: fname, ..Default::default() });
            rows.len() - 1
        }
    };
    let row = &mut rows[i];
    row.trials += 1;
    row.injected += f.injected as usize;
    row.survived += (f.injected && f.broken.is_empty() && f.criu_trap.is_none()) as usize;
    if let Some(detail) = &f.criu_trap {
        row.criu_traps += 1;
        eprintln!("faults: CRIU TRAP {} {} trial {}: {detail}", route.name(), fname, ctx.trial);
    }
    for (kind, detail) in f.broken {
        match kind {
            "lost-process" => row.lost_processes += 1,
            "partial-archive" => row.partial_archives += 1,
            "wrong-memory" => row.wrong_memory += 1,
            "leftover" => row.leftovers += 1,
            _ => row.other += 1,
        }
        eprintln!("faults: VIOLATION {} {} trial {}: {kind}: {detail}", route.name(), fname, ctx.trial);
        violations.push(Violation { path: route.name(), fault: fname, trial: ctx.trial, kind, detail });
    }
}

/// The report as a table, one line per route and fault.
pub fn table(r: &Report) -> String {
    let mut s = format!(
        "{:<18} {:<10} {:>6} {:>8} {:>8} {:>5} {:>7} {:>6} {:>9} {:>5} {:>9}\n",
        "path",
        "fault",
        "trials",
        "injected",
        "survived",
        "lost",
        "partial",
        "wrong",
        "leftovers",
        "other",
        "criu-trap"
    );
    for row in &r.rows {
        s.push_str(&format!(
            "{:<18} {:<10} {:>6} {:>8} {:>8} {:>5} {:>7} {:>6} {:>9} {:>5} {:>9}\n",
            row.route,
            row.fault,
            row.trials,
            row.injected,
            row.survived,
            row.lost_processes,
            row.partial_archives,
            row.wrong_memory,
            row.leftovers,
            row.other,
            row.criu_traps
        ));
    }
    s.push_str(&format!(
        "{} trials, {} faults injected, {} survived, {} violations, {} lost to CRIU's trap, {:.0} s (seed {}, {} MiB)\n",
        r.trials,
        r.injected,
        r.survived,
        r.violations.len(),
        r.criu_traps,
        r.seconds,
        r.seed,
        r.mib
    ));
    s
}

/// Writes the report as JSON.
pub fn write_json(r: &Report, path: &Path) -> Result<()> {
    let text = serde_json::to_string_pretty(r).map_err(|e| Error::Invalid(e.to_string()))?;
    crate::output::write(path, &(text + "\n"))
}

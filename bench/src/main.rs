//! `criuz-bench`: checkpoints and restores workloads under several
//! configurations (plain CRIU to a directory or tmpfs, CRIU then lz4/zstd,
//! criuz pack, criuz streaming), several runs each, and reports median, min
//! and max of each figure. Every restore is checked by asking the restored
//! process about its own state; a restore that does not check out is a
//! failure, never a time. See docs/BENCHMARKS.md.

use config::{Config, Env, Place};
use criuz_bench::error::{Error, Result};
use criuz_bench::{
    aead, codecs, config, containers, gpu, incremental, lazy, load, output, plot, proc, report, s3, workload,
};
use report::{criu_kernel_cache, Document, Machine, Pair, ResultJson, Sample, Settings};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};
use workload::{Running, Tools};

#[derive(clap::Parser, Clone, Debug)]
#[command(name = "criuz-bench", version, about = "Compare criuz with what CRIU users do today, every restore checked")]
pub struct BenchArgs {
    /// Workloads, comma separated [default: all but shared, threaded, hugetlb and shared-cache]:
    /// zero,mixed,random,text,elf,bf16,gpu-image (memory patterns), forked (a parent and three
    /// forked children), redis,jvm,python (applications); shared (text in shared anonymous
    /// memory, which CRIU restores itself), threaded (mixed in one process of 256 threads),
    /// hugetlb (mixed in private huge pages, reserved for the run with vm.nr_hugepages), shared-cache
    /// (mixed in shared anonymous memory written by a child that has exited)
    #[arg(long, value_delimiter = ',', value_name = "LIST")]
    pub workloads: Option<Vec<String>>,
    /// Configurations, comma separated [default: all but the S3, sealed, place, stream, ids, flat
    /// and sync ones]:
    /// criu-dir, criu-tmpfs,criu+lz4,criu+zstd,criuz-pack,criuz-lz4,criuz-zstd; criu-dir+sync (criu
    /// dump -D, then sync, timed); criuz-s3,criuz+boto3 (a
    /// local SeaweedFS `weed mini` in the work dir serves them); criuz-lz4-sealed,
    /// criuz-zstd-sealed (encrypted to an age key made in the work dir); criuz-lz4-place,
    /// criuz-zstd-place (restored with --fill place), criuz-lz4-stream, criuz-zstd-stream
    /// (restored with --fill stream, through CRIU's image stream), criuz-lz4-ids,
    /// criuz-zstd-ids (dumped with --ids), criuz-lz4-flat, criuz-zstd-flat (dumped with
    /// --no-planes)
    #[arg(long, value_delimiter = ',', value_name = "LIST")]
    pub configs: Option<Vec<String>>,
    /// Memory of each workload in MiB [default: 1024, or 32 with --quick]
    #[arg(long, value_name = "MB")]
    pub size: Option<u64>,
    /// Runs of each workload x configuration [default: 3, or 1 with --quick]
    #[arg(long, value_name = "N")]
    pub runs: Option<usize>,
    /// Drop the page cache before each restore (sync; echo 3 > /proc/sys/vm/drop_caches); with --lazy too
    #[arg(long)]
    pub cold: bool,
    /// Write the results as JSON
    #[arg(long, value_name = "FILE")]
    pub json: Option<PathBuf>,
    /// Draw dump time, restore time and size per configuration into a PNG
    #[arg(long, value_name = "FILE.png")]
    pub plot: Option<PathBuf>,
    /// Smoke run: every workload and configuration, small sizes, one run
    #[arg(long)]
    pub quick: bool,
    /// Send checkpoints through a link of this many bytes/s (K/M/G = 10^3/10^6/10^9, e.g. 125M)
    #[arg(long, value_name = "RATE", value_parser = parse_rate)]
    pub link: Option<u64>,
    /// Give `criuz dump` this absorb budget (criuz-lz4, criuz-zstd; e.g. 256M
    /// to see blocks hurried and redone)
    #[arg(long, value_name = "SIZE")]
    pub absorb: Option<String>,
    /// CRIU binary (default: $CRIUZ_CRIU, the setup cache, then PATH)
    #[arg(long = "criu", value_name = "PATH")]
    pub criu: Option<PathBuf>,
    /// Instead of the comparison: archive size and pack/unpack throughput per
    /// memory pattern and codec (criu dump -D once, then criuz pack/unpack)
    #[arg(long)]
    pub codec_table: bool,
    /// Instead of the comparison: seal and open throughput of the AEADs
    /// considered for encrypted archives, one core (no CRIU needed)
    #[arg(long)]
    pub aead: bool,
    /// Instead of the comparison: incremental checkpoints (criuz dump
    /// --parent) of running workloads after P% of their state changed, for P
    /// in 1, 5, 25 (patterns) and 5 (applications), and a chain of ten
    /// generations restored against its flattened archive
    #[arg(long)]
    pub incremental: bool,
    /// With --incremental: the shares P to rewrite, comma separated; 0 skips
    /// the single-child rows (only the chain, when `mixed` is measured)
    #[arg(long, value_delimiter = ',', value_name = "LIST", requires = "incremental")]
    pub shares: Option<Vec<f64>>,
    /// Instead of the comparison: lazy restore (criuz restore --lazy) against
    /// plain restore of the same archive: time until the tree runs, until
    /// every page is in, and a full read of memory right after the restore;
    /// dumped with LZ4, or each codec --configs names of criuz-lz4,criuz-zstd
    #[arg(long, conflicts_with = "incremental")]
    pub lazy: bool,
    /// Instead of the comparison: a workload in a runc container (mixed, or
    /// shared-cache with --workloads), runc-dir and runc+zstd against
    /// criuz-runc (and its routes), at --size MiB [default: 256 and 1024, or 32
    /// with --quick]
    #[arg(long, conflicts_with_all = ["incremental", "lazy"])]
    pub containers: bool,
    /// Where to put checkpoints and scratch files (on the disk to measure)
    #[arg(long, value_name = "DIR", default_value = "/var/tmp")]
    pub work_dir: PathBuf,
    /// Instead of the comparison: an eviction wave of N processes of each
    /// workload (criuz-lz4): N dumps started together, then N restores,
    /// against the same work one at a time; peak RSS of the criuz processes
    /// added up, against the machine share of memory they draw on
    #[arg(long, value_name = "N", conflicts_with_all = ["incremental", "lazy", "containers"])]
    pub load: Option<usize>,
    /// Pin the whole run (this process, CRIU, criuz, the workloads) to the
    /// first N of the CPUs it may use, to show scaling (e.g. 1, 2, 4, 8, 16)
    #[arg(long, value_name = "N")]
    pub cpus: Option<usize>,
    /// Keep N idle processes beside the whole run (each a `sleep`, ended
    /// with the run), as on a busy host: what a dump's walks of every
    /// process (whose descriptors hold a userfaultfd, or the other end of
    /// the tree's pipes) cost there
    #[arg(long, value_name = "N", default_value_t = 0)]
    pub idle_processes: usize,
    /// Instead of the comparison: a CUDA process (PyTorch, bf16 weights and
    /// KV cache on the GPU) with criu-dir (CUDA suspended through the
    /// driver, then criu dump -D; criu restore, then the driver's resume)
    /// against criuz-lz4 and criuz-zstd, each restored placed, and with
    /// every zero page placed or streamed (--configs picks among the
    /// three); skips with a line saying why on a machine without a GPU
    #[arg(long, conflicts_with_all = ["incremental", "lazy", "containers", "load", "codec_table"])]
    pub gpu: bool,
    /// With --gpu: GiB of bf16 weights on the GPU
    #[arg(long, value_name = "GIB", default_value_t = 4.0, requires = "gpu")]
    pub gpu_weights: f64,
    /// With --gpu: GiB of the bf16 KV cache on the GPU
    #[arg(long, value_name = "GIB", default_value_t = 12.0, requires = "gpu")]
    pub gpu_kv: f64,
    /// With --gpu: the share of the KV cache filled
    #[arg(long, value_name = "SHARE", default_value_t = 0.25, requires = "gpu")]
    pub gpu_kv_fill: f64,
    /// With --gpu: criuz dumps with --no-ids (a tree holding CUDA state
    /// stores page ids by default, each page that occurs more than once
    /// stored once): what the ids cost and save
    #[arg(long, requires = "gpu")]
    pub gpu_no_ids: bool,
    /// With --gpu: criuz dumps with --no-planes, to compare the dump's CPU
    /// with the byte planes of 16-bit floats and without
    #[arg(long, requires = "gpu")]
    pub gpu_no_planes: bool,
    /// With --gpu: restore criuz's archives eagerly only, without the
    /// zeros-placed and zeros-streamed rows (a shorter run, for the dump's
    /// figures and more runs in a device call's time)
    #[arg(long, requires = "gpu")]
    pub gpu_eager_only: bool,
}

/// `125M` -> 125_000_000 bytes per second (decimal units, as link rates are quoted).
fn parse_rate(s: &str) -> std::result::Result<u64, String> {
    let t = s.trim().trim_end_matches("/s").trim_end_matches(['B', 'b']);
    let (num, mul) = match t.chars().last() {
        Some('k' | 'K') => (&t[..t.len() - 1], 1e3),
        Some('m' | 'M') => (&t[..t.len() - 1], 1e6),
        Some('g' | 'G') => (&t[..t.len() - 1], 1e9),
        _ => (t, 1.0),
    };
    let n: f64 = num.parse().map_err(|_| format!("not a rate: {s:?} (use e.g. 125M or 1G bytes/s)"))?;
    let r = n * mul;
    if !(1.0..1e15).contains(&r) {
        return Err(format!("rate out of range: {s}"));
    }
    Ok(r as u64)
}

static INTERRUPTED: AtomicBool = AtomicBool::new(false);

extern "C" fn on_interrupt(_: libc::c_int) {
    INTERRUPTED.store(true, Ordering::SeqCst);
}

/// What the run needs from the args, defaults applied.
struct Plan {
    workloads: Vec<String>,
    configs: Vec<Config>,
    mib: u64,
    runs: usize,
}

impl Plan {
    fn of(a: &BenchArgs) -> Result<Plan> {
        let mut workloads: Vec<String> = Vec::new();
        for w in a.workloads.clone().unwrap_or_else(|| workload::all().iter().map(|s| s.to_string()).collect()) {
            let w = w.trim().to_string();
            if !workload::known().contains(&w.as_str()) {
                return Err(Error::Usage(format!("unknown workload {w:?} (known: {})", workload::known().join(","))));
            }
            if !workloads.contains(&w) {
                workloads.push(w);
            }
        }
        let mut configs = Vec::new();
        match &a.configs {
            None => configs.extend(Config::ALL),
            Some(list) => {
                for c in list {
                    let cfg = Config::parse(c.trim()).ok_or_else(|| {
                        let known: Vec<&str> = Config::every().map(|c| c.name()).collect();
                        Error::Usage(format!("unknown configuration {c:?} (known: {})", known.join(",")))
                    })?;
                    if !configs.contains(&cfg) {
                        configs.push(cfg);
                    }
                }
            }
        }
        let mib = a.size.unwrap_or(if a.quick { 32 } else { 1024 });
        let runs = a.runs.unwrap_or(if a.quick { 1 } else { 3 });
        if mib == 0 || runs == 0 || workloads.is_empty() || configs.is_empty() {
            return Err(Error::Usage("nothing to run: size, runs, workloads and configs must be non-empty".into()));
        }
        Ok(Plan { workloads, configs, mib, runs })
    }
}

/// A table run's JSON, where `--json` asked for it (`path`): the machine,
/// the size and runs, and `rows` (an object whose fields are added to the
/// document).
fn write_table_json(path: Option<&Path>, machine: &Machine, plan: &Plan, rows: serde_json::Value) -> Result<()> {
    let Some(path) = path else { return Ok(()) };
    let mut doc = serde_json::json!({ "machine": machine, "size_mib": plan.mib, "runs": plan.runs });
    if let (Some(d), serde_json::Value::Object(r)) = (doc.as_object_mut(), rows) {
        d.extend(r);
    }
    let text = serde_json::to_string_pretty(&doc).map_err(|e| Error::Invalid(e.to_string()))?;
    output::write(path, &(text + "\n"))
}

/// Removes a directory when the run ends, however it ends.
struct Scratch(PathBuf);

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn mkdir(p: &Path) -> Result<()> {
    std::fs::create_dir_all(p).map_err(|e| Error::file(p, e))
}

struct Ctx<'a> {
    env: &'a Env,
    tools: &'a Tools,
    work: &'a Path,
    tmpfs: Option<&'a Path>,
    mib: u64,
    cold: bool,
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
    let r = config::restore(cfg, ctx.env, &place)?;
    // CPU the restored processes spent being restored (CRIU fills their memory
    // from inside them).
    let restored = proc::tree(app.pid);
    let restored_cpu: f64 = restored.iter().filter_map(|p| proc::cpu_seconds(*p)).sum();
    let tree_restored_kib = proc::pss_anon_kib(&restored);
    if !proc::alive(app.pid) {
        return Err(Error::Invalid(format!("the restored process {} is not running", app.pid)));
    }
    let after = app.fingerprint().map_err(|e| Error::Invalid(format!("asking {w} after the restore: {e}")))?;
    if after != before {
        return Err(Error::Invalid(format!("restored {w} is not intact: before {before:?}, after {after:?}")));
    }
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
    })
}

fn human(b: u64) -> String {
    format!("{:.1} MiB", b as f64 / (1u64 << 20) as f64)
}

pub fn run(args: &BenchArgs) -> Result<()> {
    for path in [&args.json, &args.plot].into_iter().flatten() {
        output::check(path)?;
    }
    if let Some(n) = args.cpus {
        // Before any thread or child: they all inherit the mask.
        let pinned = proc::pin_to_cpus(n)?;
        eprintln!("bench: pinned to CPUs {pinned:?}");
    }
    if args.aead {
        let rows = aead::rows();
        print!("{}", aead::table(&rows));
        if let Some(path) = &args.json {
            let doc = serde_json::json!({ "aead": rows });
            let text = serde_json::to_string_pretty(&doc).map_err(|e| Error::Invalid(e.to_string()))?;
            output::write(path, &(text + "\n"))?;
        }
        return Ok(());
    }
    let plan = Plan::of(args)?;
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        return Err(Error::Invalid("criuz-bench needs root (CRIU checkpoints and restores processes)".into()));
    }
    let (criu, _) = criuz::criu::locate(args.criu.as_deref())?;
    // Every criuz the bench runs runs this CRIU too: the baselines and
    // criuz are measured on the same one. Set before any thread starts.
    std::env::set_var("CRIUZ_CRIU", &criu.path);
    let kernel_cache = criu_kernel_cache(&criu.path);
    match &kernel_cache {
        Some(file) => eprintln!("bench: CRIU keeps its kernel probes in {file}"),
        None => eprintln!(
            "bench: CRIU keeps no kernel cache here (it keeps one only on a tmpfs): every CRIU start probes the \
             kernel again (scripts/setup.sh builds a CRIU that keeps it)"
        ),
    }
    // Probed once, after any pinning (its cores are the run's).
    let machine = Machine::probe(&criu.version, kernel_cache, args.idle_processes);
    // criuz and criuz-workload are built beside this binary.
    let criuz = std::env::current_exe()?.with_file_name("criuz");
    let workload_bin = criuz.with_file_name("criuz-workload");
    if args.cold {
        proc::drop_caches()?;
    }
    proc::become_subreaper()?;
    let _idle = proc::IdleProcesses::start(args.idle_processes)?;
    if args.idle_processes > 0 {
        eprintln!("bench: {} idle processes run beside it", args.idle_processes);
    }
    let started = Instant::now();

    // Why a workload or configuration cannot run at all on this machine.
    let mut unavailable: Vec<(String, String)> = Vec::new();
    for c in &plan.configs {
        for t in c.tools() {
            if criuz::criu::on_path(t).is_none() {
                unavailable.push((c.name().to_string(), format!("{t} is not installed")));
            }
        }
    }
    for w in &plan.workloads {
        let need = match w.as_str() {
            "redis" => Some("redis-server"),
            "jvm" => Some("java"),
            p if (workload::PATTERNS.contains(&p) || workload::ON_REQUEST.contains(&p)) && !workload_bin.is_file() => {
                unavailable.push((w.clone(), format!("{} not found", workload_bin.display())));
                None
            }
            _ => None,
        };
        if let Some(t) = need.filter(|t| criuz::criu::on_path(t).is_none()) {
            unavailable.push((w.clone(), format!("{t} is not installed")));
        }
    }

    std::fs::create_dir_all(&args.work_dir).map_err(|e| Error::file(&args.work_dir, e))?;
    let work = tempfile::Builder::new().prefix("criuz-bench-").tempdir_in(&args.work_dir)?;
    let tmpfs = if plan.configs.iter().any(|c| c.on_tmpfs()) {
        match proc::Tmpfs::mount(&work.path().join("tmpfs")) {
            Ok(t) => Some(t),
            Err(e) => {
                unavailable.push((Config::CriuTmpfs.name().to_string(), e.to_string()));
                None
            }
        }
    } else {
        None
    };
    let tmp = work.path().join("tmp");
    mkdir(&tmp)?;
    let s3_server = match plan.configs.iter().find(|c| c.uses_s3()) {
        Some(c) if !unavailable.iter().any(|(n, _)| n == c.name()) => {
            Some(s3::Server::start(&work.path().join("s3"), args.link)?)
        }
        _ => None,
    };
    // Private copies of our binaries: CRIU refuses to restore a process whose
    // executable changed size since the dump, as a rebuild during a long run
    // would do; and every run then measures the same criuz.
    let bin = work.path().join("bin");
    mkdir(&bin)?;
    if !criuz.is_file() {
        return Err(Error::Invalid(format!("{}: not built (cargo build --release --workspace)", criuz.display())));
    }
    let criuz = proc::copy_exe(&criuz, &bin)?;
    let workload_bin = if workload_bin.is_file() { proc::copy_exe(&workload_bin, &bin)? } else { workload_bin };
    if args.gpu {
        let known = ["criu-dir", "criuz-lz4", "criuz-zstd"];
        let configs: Vec<&str> = match &args.configs {
            None => known.to_vec(),
            Some(_) => known.iter().copied().filter(|k| plan.configs.iter().any(|c| c.name() == *k)).collect(),
        };
        if let Some(why) = gpu::unavailable() {
            println!("criuz-bench --gpu: skipped, no GPU to measure here: {why}");
            return Ok(());
        }
        let gpu_plan = gpu::GpuPlan {
            weights_gib: args.gpu_weights,
            kv_gib: args.gpu_kv,
            kv_fill: args.gpu_kv_fill,
            no_ids: args.gpu_no_ids,
            no_planes: args.gpu_no_planes,
            eager_only: args.gpu_eager_only,
        };
        let rows = gpu::measure(&configs, gpu_plan, plan.runs, args.cold, work.path(), &criu, &criuz)?;
        print!("{}", gpu::table(&rows));
        write_table_json(args.json.as_deref(), &machine, &plan, serde_json::json!({ "gpu": rows, "app": gpu_plan }))?;
        if rows.iter().any(|r| !r.intact) {
            return Err(Error::Invalid("a GPU restore is not intact".into()));
        }
        return Ok(());
    }
    if args.containers {
        let sizes = match args.size {
            Some(s) => vec![s],
            None if args.quick => vec![32],
            None => vec![256, 1024],
        };
        // `mixed` unless asked.
        let kinds = args.workloads.clone().unwrap_or_else(|| vec!["mixed".into()]);
        if let Some(k) = kinds.iter().find(|k| !containers::WORKLOADS.contains(&k.as_str())) {
            return Err(Error::Usage(format!(
                "--containers runs {} in a container, not {k}",
                containers::WORKLOADS.join(" or ")
            )));
        }
        let mut rows = Vec::new();
        for kind in &kinds {
            for &mib in &sizes {
                let r = containers::measure(kind, mib, plan.runs, work.path(), &workload_bin, &criuz, &criu.path)?;
                if r.iter().any(|r| !r.intact) {
                    return Err(Error::Invalid(format!("{kind}, {mib} MiB: a container restore is not intact")));
                }
                rows.extend(r);
            }
        }
        print!("{}", containers::table(&rows));
        write_table_json(args.json.as_deref(), &machine, &plan, serde_json::json!({ "containers": rows }))?;
        return Ok(());
    }
    let tools = Tools::prepare(work.path(), &plan.workloads, workload_bin, plan.mib)?;
    if let Err(why) = &tools.java_classes {
        if plan.workloads.iter().any(|w| w == "jvm") {
            unavailable.push(("jvm".into(), why.clone()));
        }
    }
    if args.incremental {
        let mut rows = Vec::new();
        for w in &plan.workloads {
            let default: &[f64] = if workload::PATTERNS.contains(&w.as_str()) { &[1.0, 5.0, 25.0] } else { &[5.0] };
            let shares = args.shares.as_deref().unwrap_or(default);
            for &p in shares.iter().filter(|&&p| p > 0.0) {
                eprintln!("bench: incremental: {w}, {p}% rewritten, {} MiB", plan.mib);
                let row = incremental::measure(w, p, plan.mib, plan.runs, work.path(), &tools, &criuz)?;
                if !row.intact {
                    return Err(Error::Invalid(format!("{w}: the restored child is not intact")));
                }
                rows.push(row);
            }
        }
        let mut chains = Vec::new();
        if plan.workloads.iter().any(|w| w == "mixed") {
            eprintln!("bench: incremental: chain of 10 x 5% (mixed), {} MiB", plan.mib);
            let c = incremental::chain("mixed", (10, 5.0), plan.mib, plan.runs, work.path(), &tools, &criuz)?;
            if !c.intact {
                return Err(Error::Invalid("the chain restore is not intact".into()));
            }
            chains.push(c);
        }
        print!("{}", incremental::table(&rows, &chains));
        write_table_json(
            args.json.as_deref(),
            &machine,
            &plan,
            serde_json::json!({ "incremental": rows, "chains": chains }),
        )?;
        return Ok(());
    }
    if args.lazy {
        // The dump's codec: criuz-zstd among --configs adds zstd rows; LZ4
        // (the default) unless --configs leaves it out.
        let codecs: Vec<&str> = match &args.configs {
            None => vec!["lz4"],
            Some(_) => [(Config::CriuzLz4, "lz4"), (Config::CriuzZstd, "zstd")]
                .into_iter()
                .filter(|(c, _)| plan.configs.contains(c))
                .map(|(_, codec)| codec)
                .collect(),
        };
        if codecs.is_empty() {
            return Err(Error::Usage("--lazy measures criuz-lz4 and criuz-zstd; --configs names neither".into()));
        }
        let mut rows = Vec::new();
        for w in &plan.workloads {
            for codec in &codecs {
                eprintln!("bench: lazy: {w}, {codec}, {} MiB", plan.mib);
                let shape = lazy::Shape { workload: w, codec, mib: plan.mib, runs: plan.runs, cold: args.cold };
                let row = lazy::measure(&shape, work.path(), &tools, &criuz, &criu.path)?;
                if !row.intact {
                    return Err(Error::Invalid(format!("{w}: a restore is not intact")));
                }
                rows.push(row);
            }
        }
        print!("{}", lazy::table(&rows));
        write_table_json(args.json.as_deref(), &machine, &plan, serde_json::json!({ "lazy": rows }))?;
        return Ok(());
    }
    if args.codec_table {
        let mut rows = Vec::new();
        for w in plan.workloads.iter().filter(|w| workload::PATTERNS.contains(&w.as_str())) {
            eprintln!("bench: codec table: {w}, {} MiB", plan.mib);
            rows.extend(codecs::measure(w, plan.mib, plan.runs, work.path(), &tools, &criu, &criuz)?);
        }
        print!("{}", codecs::table(&rows));
        write_table_json(args.json.as_deref(), &machine, &plan, serde_json::json!({ "codec_table": rows }))?;
        return Ok(());
    }
    let key = if plan.configs.iter().any(|c| Config::SEALED.contains(c)) {
        Some(make_key(&criuz, work.path())?)
    } else {
        None
    };
    let env = Env { criu: criu.clone(), criuz, link: args.link, tmp, absorb: args.absorb.clone(), key };
    if let Some(n) = args.load {
        let mut rows = Vec::new();
        for w in &plan.workloads {
            eprintln!("bench: load: {n} x {w}, {} MiB", plan.mib);
            let row = load::measure(w, n, plan.mib, work.path(), &tools, &env)?;
            if !row.intact {
                return Err(Error::Invalid(format!("{w}: a restore under load is not intact")));
            }
            rows.push(row);
        }
        print!("{}", load::table(&rows));
        write_table_json(args.json.as_deref(), &machine, &plan, serde_json::json!({ "load": rows }))?;
        return Ok(());
    }
    let ctx = Ctx {
        env: &env,
        tools: &tools,
        work: work.path(),
        tmpfs: tmpfs.as_ref().map(|t| t.path()),
        mib: plan.mib,
        cold: args.cold,
    };

    eprintln!(
        "bench: {} workload(s) x {} configuration(s) x {} run(s), {} MiB, CRIU {} at {}{}{}",
        plan.workloads.len(),
        plan.configs.len(),
        plan.runs,
        plan.mib,
        criu.version,
        criu.path.display(),
        if args.cold { ", cold cache" } else { "" },
        args.link.map(|r| format!(", link {:.1} MB/s", r as f64 / 1e6)).unwrap_or_default()
    );
    // SAFETY: the handler only stores to an atomic.
    unsafe { libc::signal(libc::SIGINT, on_interrupt as *const () as libc::sighandler_t) };

    let mut pairs: Vec<Pair> = Vec::new();
    for w in &plan.workloads {
        for c in &plan.configs {
            pairs.push(Pair { workload: w.clone(), config: c.name(), runs: 0, samples: vec![], failures: vec![] });
        }
    }
    let total = pairs.len() * plan.runs;
    let mut k = 0;
    'all: for (wi, w) in plan.workloads.iter().enumerate() {
        for run in 1..=plan.runs {
            for (ci, c) in plan.configs.iter().enumerate() {
                if INTERRUPTED.load(Ordering::SeqCst) {
                    break 'all;
                }
                k += 1;
                let pair = &mut pairs[wi * plan.configs.len() + ci];
                pair.runs += 1;
                let tag = format!("[{k}/{total}] {w} / {} run {run}/{}", c.name(), plan.runs);
                if let Some((_, why)) = unavailable.iter().find(|(n, _)| n == w || n == c.name()) {
                    eprintln!("bench: {tag}: FAILED: {why}");
                    pair.failures.push(format!("run {run}: {why}"));
                    continue;
                }
                match one_run(&ctx, w, *c, k) {
                    Ok(mut s) => {
                        s.run = run;
                        eprintln!(
                            "bench: {tag}: dump {:.2}s (frozen {}), restore {:.2}s, {} -> {}, cpu {:.2}s{}, intact",
                            s.dump_s,
                            s.frozen_s.map(|f| format!("{f:.2}s")).unwrap_or_else(|| "?".into()),
                            s.restore_s,
                            human(s.raw_bytes),
                            human(s.bytes),
                            s.cpu_s,
                            s.criuz_rss_kib.map(|k| format!(", criuz RSS {}", human(k << 10))).unwrap_or_default()
                        );
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
    drop(tmpfs);
    drop(s3_server);
    drop(work);

    let results: Vec<ResultJson> = pairs.iter().filter(|p| p.runs > 0).map(ResultJson::of).collect();
    let doc = Document {
        machine,
        settings: Settings {
            size_mib: plan.mib,
            runs: plan.runs,
            cold: args.cold,
            quick: args.quick,
            link_bytes_per_s: args.link,
            absorb: args.absorb.clone(),
            workloads: plan.workloads.clone(),
            configs: plan.configs.iter().map(|c| c.name().to_string()).collect(),
        },
        results,
    };
    print!("{}", report::table(&doc.results));
    eprintln!("bench: finished in {:.0}s", started.elapsed().as_secs_f64());
    if let Some(path) = &args.json {
        let text = serde_json::to_string_pretty(&doc).map_err(|e| Error::Invalid(e.to_string()))?;
        output::write(path, &(text + "\n"))?;
        eprintln!("bench: wrote {}", path.display());
    }
    if let Some(path) = &args.plot {
        plot::draw(path, &doc)?;
        eprintln!("bench: wrote {}", path.display());
    }
    if INTERRUPTED.load(Ordering::SeqCst) {
        return Err(Error::Invalid("interrupted".into()));
    }
    let bad = doc.results.iter().filter(|r| !r.intact).count();
    if bad > 0 {
        return Err(Error::Invalid(format!(
            "{bad} of {} workload x configuration results not intact (see FAILED above)",
            doc.results.len()
        )));
    }
    Ok(())
}

fn main() {
    let args = <BenchArgs as clap::Parser>::parse();
    let ran = run(&args);
    // Every measurement has ended its processes by now (the run is their
    // subreaper): one still running ran on beside every later cycle, its
    // memory taken from theirs, in any mode. The run fails, and they end.
    let left_running = proc::live_children();
    proc::kill_tree(&left_running);
    let ran = ran.and_then(|()| match left_running.len() {
        0 => Ok(()),
        n => Err(Error::Invalid(format!(
            "{n} process(es) of the workloads were left running after their cycles ({left_running:?}; ended now): \
             later cycles ran beside them"
        ))),
    });
    if let Err(e) = ran {
        eprintln!("criuz-bench: {e}");
        std::process::exit(e.exit_code());
    }
}

/// An age identity for the sealed configurations (`criuz keygen` in the work
/// directory), also given to this process, which reads archives it times.
fn make_key(criuz: &Path, work: &Path) -> Result<(PathBuf, String)> {
    let identity = work.join("bench.key");
    let out = std::process::Command::new(criuz)
        .args(["keygen", "-o"])
        .arg(&identity)
        .output()
        .map_err(|e| Error::file(criuz, e))?;
    if !out.status.success() {
        return Err(Error::Invalid(format!("criuz keygen failed: {}", String::from_utf8_lossy(&out.stderr))));
    }
    criuz::seal::keyring::add_identity_file(&identity)?;
    Ok((identity, String::from_utf8_lossy(&out.stdout).trim().to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rates() {
        assert_eq!(parse_rate("125M"), Ok(125_000_000));
        assert_eq!(parse_rate("1G"), Ok(1_000_000_000));
        assert_eq!(parse_rate("1.5G"), Ok(1_500_000_000));
        assert_eq!(parse_rate("200MB/s"), Ok(200_000_000));
        assert_eq!(parse_rate("64k"), Ok(64_000));
        assert!(parse_rate("fast").is_err());
        assert!(parse_rate("0").is_err());
    }

    #[test]
    fn a_plan_that_names_nothing_runnable_is_a_usage_error() {
        let parse = |args: &[&str]| <BenchArgs as clap::Parser>::parse_from(["criuz-bench"].iter().chain(args));
        for args in [&["--workloads", "mixd"][..], &["--configs", "criuz-lz5"], &["--runs", "0"]] {
            let e = Plan::of(&parse(args)).err().unwrap_or_else(|| panic!("{args:?} was planned"));
            assert_eq!(e.exit_code(), 2, "{args:?}: {e}");
        }
        assert!(Plan::of(&parse(&["--workloads", "mixed", "--configs", "criu-dir"])).is_ok());
    }

    #[test]
    fn medians() {
        assert_eq!(report::median(&[3.0, 1.0, 2.0]), Some(2.0));
        assert_eq!(report::median(&[4.0, 1.0, 2.0, 3.0]), Some(2.5));
        assert_eq!(report::median(&[]), None);
        let f = report::figure(&[2.0, 9.0, 1.0]).unwrap();
        assert_eq!((f.median, f.min, f.max), (2.0, 1.0, 9.0));
    }

    #[test]
    fn stats_dump() {
        // service image: two magics, length, stats_entry { dump { frozen_time = 1234567 } }
        let inner = [0x10u8, 0x87, 0xAD, 0x4B]; // field 2 varint 1234567
        let mut entry = vec![0x0A, inner.len() as u8];
        entry.extend_from_slice(&inner);
        let mut img = vec![0u8; 8];
        img.extend_from_slice(&(entry.len() as u32).to_ne_bytes());
        img.extend_from_slice(&entry);
        assert_eq!(config::frozen_from_stats(&img), Some(1.234567));
        assert_eq!(config::frozen_from_stats(&img[..10]), None);
    }
}

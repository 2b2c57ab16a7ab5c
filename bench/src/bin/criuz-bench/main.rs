//! `criuz-bench`: checkpoints and restores workloads under several
//! configurations (plain CRIU to a directory or tmpfs, CRIU then lz4/zstd,
//! criuz pack, criuz streaming), several runs each, and reports median, min
//! and max of each figure. Every restore is checked by asking the restored
//! process about its own state; a restore that does not check out is a
//! failure, never a time. See docs/BENCHMARKS.md.

mod tables;

use compare::{mkdir, Ctx, Matrix};
use config::{Config, Env};
use criuz_bench::error::{Error, Result};
use criuz_bench::{compare, config, output, plot, proc, report, s3, workload};
use report::{criu_kernel_cache, Document, Machine, Pair, ResultJson, Settings};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};
use workload::Tools;

#[derive(clap::Parser, Clone, Debug)]
#[command(name = "criuz-bench", version, about = "Compare criuz with what CRIU users do today, every restore checked")]
pub struct BenchArgs {
    /// Workloads, comma separated [default: all but shared, threaded, hugetlb, shared-cache and thp]:
    /// zero,mixed,random,text,elf,bf16,gpu-image (memory patterns), forked (a parent and three
    /// forked children), redis,jvm,python (applications); shared (text in shared anonymous
    /// memory, which CRIU restores itself), threaded (mixed in one process of 256 threads),
    /// hugetlb (mixed in private huge pages, reserved for the run with vm.nr_hugepages), shared-cache
    /// (mixed in shared anonymous memory written by a child that has exited), thp (mixed in
    /// memory asked to be transparent huge pages, MADV_HUGEPAGE; random reads of it timed before
    /// the dump and after the restore)
    #[arg(long, value_delimiter = ',', value_name = "LIST")]
    pub workloads: Option<Vec<String>>,
    /// Configurations, comma separated [default: all but the S3, sealed, place, stream, ids, flat
    /// and sync ones]:
    /// criu-dir, criu-tmpfs,criu+lz4,criu+zstd,criuz-pack,criuz-lz4,criuz-zstd; criu-dir+sync (criu
    /// dump -D, then sync, timed); criuz-s3, criuz-s3-stream (restored with --fill stream),
    /// criuz+boto3 (a local SeaweedFS `weed mini` in the work dir serves them); criuz-lz4-sealed,
    /// criuz-zstd-sealed (encrypted to an age key made in the work dir); criuz-lz4-place,
    /// criuz-zstd-place (restored with --fill place), criuz-lz4-stream, criuz-zstd-stream
    /// (restored with --fill stream, through CRIU's image stream), criuz-lz4-4k (restored with
    /// --no-huge-pages), criuz-lz4-huge (restored with --huge-page-floor 0), criuz-lz4-ids,
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
    /// Wait this many seconds between each dump and its restore, the dumped
    /// process's memory freed: a VM that hands freed memory back to its host
    /// (virtio-balloon free page reporting, about 2 s after it is freed) has
    /// done so by then, and the restore gets memory the host backs again as
    /// it is first touched (what a restore on a machine that ran other work
    /// since meets; e.g. `--workloads thp --settle 3`)
    #[arg(
        long,
        value_name = "SECONDS",
        default_value_t = 0.0,
        value_parser = parse_seconds,
        conflicts_with_all = ["codec_table", "aead", "incremental", "lazy", "containers", "load", "gpu"]
    )]
    pub settle: f64,
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
    /// With --lazy: the lazy restores prove the archive before CRIU starts
    /// (criuz restore --lazy --verify-first): what that order costs the
    /// tree's start, and CRIU's part of it timed with no proof beside it
    #[arg(long, requires = "lazy")]
    pub verify_first: bool,
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

/// `--settle`: seconds, 0 to an hour.
fn parse_seconds(s: &str) -> std::result::Result<f64, String> {
    match s.trim().parse::<f64>() {
        Ok(t) if (0.0..=3600.0).contains(&t) => Ok(t),
        _ => Err(format!("not a number of seconds from 0 to 3600: {s:?}")),
    }
}

/// What the run needs from the args, defaults applied.
pub(crate) struct Plan {
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
pub(crate) fn write_table_json(
    path: Option<&Path>,
    machine: &Machine,
    plan: &Plan,
    rows: serde_json::Value,
) -> Result<()> {
    let Some(path) = path else { return Ok(()) };
    let mut doc = serde_json::json!({ "machine": machine, "size_mib": plan.mib, "runs": plan.runs });
    if let (Some(d), serde_json::Value::Object(r)) = (doc.as_object_mut(), rows) {
        d.extend(r);
    }
    let text = serde_json::to_string_pretty(&doc).map_err(|e| Error::Invalid(e.to_string()))?;
    output::write(path, &(text + "\n"))
}

/// The run's scratch space, removed when the run ends, however it ends: the
/// tmpfs (mounted inside it) and the S3 server (serving from it) go first,
/// as the fields' order drops them.
struct Site {
    tmpfs: Option<proc::Tmpfs>,
    /// Held for the run: the S3 configurations reach it by its address.
    _s3_server: Option<s3::Server>,
    work: tempfile::TempDir,
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
        return tables::aead_table(args.json.as_deref());
    }
    let plan = Plan::of(args)?;
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        return Err(Error::Invalid("criuz-bench needs root (CRIU checkpoints and restores processes)".into()));
    }
    let (criu, machine) = criu_and_machine(args)?;
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
    let mut unavailable = missing_tools(&plan, &workload_bin);
    let site = Site::prepare(args, &plan, &mut unavailable)?;
    let work = site.work.path();
    let tmp = work.join("tmp");
    mkdir(&tmp)?;
    // Private copies of our binaries: CRIU refuses to restore a process whose
    // executable changed size since the dump, as a rebuild during a long run
    // would do; and every run then measures the same criuz.
    let bin = work.join("bin");
    mkdir(&bin)?;
    if !criuz.is_file() {
        return Err(Error::Invalid(format!("{}: not built (cargo build --release --workspace)", criuz.display())));
    }
    let criuz = proc::copy_exe(&criuz, &bin)?;
    let workload_bin = if workload_bin.is_file() { proc::copy_exe(&workload_bin, &bin)? } else { workload_bin };
    let table = tables::Table { json: args.json.as_deref(), machine: &machine, plan: &plan };
    if args.gpu {
        return tables::gpu_table(args, &table, work, &criu, &criuz);
    }
    if args.containers {
        return tables::containers_table(args, &table, work, &workload_bin, &criuz, &criu.path);
    }
    let tools = Tools::prepare(work, &plan.workloads, workload_bin, plan.mib)?;
    if let Err(why) = &tools.java_classes {
        for w in plan.workloads.iter().filter(|w| w.starts_with("jvm")) {
            unavailable.push((w.clone(), why.clone()));
        }
    }
    if args.incremental {
        return tables::incremental_table(args, &table, work, &tools, &criuz);
    }
    if args.lazy {
        return tables::lazy_table(args, &table, work, &tools, &criuz, &criu.path);
    }
    if args.codec_table {
        return tables::codec_table(&table, work, &tools, &criu, &criuz);
    }
    let key =
        if plan.configs.iter().any(|c| Config::SEALED.contains(c)) { Some(make_key(&criuz, work)?) } else { None };
    let env = Env { criu: criu.clone(), criuz, link: args.link, tmp, absorb: args.absorb.clone(), key };
    if let Some(n) = args.load {
        return tables::load_table(n, &table, work, &tools, &env);
    }
    let ctx = Ctx {
        env: &env,
        tools: &tools,
        work,
        tmpfs: site.tmpfs.as_ref().map(|t| t.path()),
        mib: plan.mib,
        cold: args.cold,
        settle: Duration::from_secs_f64(args.settle),
    };
    eprintln!(
        "bench: {} workload(s) x {} configuration(s) x {} run(s), {} MiB, CRIU {} at {}{}{}{}",
        plan.workloads.len(),
        plan.configs.len(),
        plan.runs,
        plan.mib,
        criu.version,
        criu.path.display(),
        if args.cold { ", cold cache" } else { "" },
        if args.settle > 0.0 { format!(", {} s settled before each restore", args.settle) } else { String::new() },
        args.link.map(|r| format!(", link {:.1} MB/s", r as f64 / 1e6)).unwrap_or_default()
    );
    let matrix =
        Matrix { workloads: &plan.workloads, configs: &plan.configs, runs: plan.runs, unavailable: &unavailable };
    let pairs = compare::measure(&ctx, &matrix);
    drop(site);
    report_comparison(args, &plan, machine, &pairs, started)
}

/// The CRIU every run uses, and the machine it runs on.
fn criu_and_machine(args: &BenchArgs) -> Result<(criuz::criu::Criu, Machine)> {
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
    Ok((criu, machine))
}

/// Why a workload or configuration cannot run at all on this machine: a
/// program it needs is not installed.
fn missing_tools(plan: &Plan, workload_bin: &Path) -> Vec<(String, String)> {
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
            "jvm" | "jvm-thp" => Some("java"),
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
    unavailable
}

impl Site {
    /// A work directory under `--work-dir`, with a tmpfs where a
    /// configuration keeps its checkpoints there and an S3 server where one
    /// uses S3; what cannot be had goes to `unavailable`.
    fn prepare(args: &BenchArgs, plan: &Plan, unavailable: &mut Vec<(String, String)>) -> Result<Site> {
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
        let s3_server = match plan.configs.iter().find(|c| c.uses_s3()) {
            Some(c) if !unavailable.iter().any(|(n, _)| n == c.name()) => {
                Some(s3::Server::start(&work.path().join("s3"), args.link)?)
            }
            _ => None,
        };
        Ok(Site { tmpfs, _s3_server: s3_server, work })
    }
}

/// The comparison's table, JSON and plot; an error if it was interrupted
/// or a result is not intact.
fn report_comparison(args: &BenchArgs, plan: &Plan, machine: Machine, pairs: &[Pair], started: Instant) -> Result<()> {
    let results: Vec<ResultJson> = pairs.iter().filter(|p| p.runs > 0).map(ResultJson::of).collect();
    let doc = Document {
        machine,
        settings: Settings {
            size_mib: plan.mib,
            runs: plan.runs,
            cold: args.cold,
            settle_s: args.settle,
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
    if compare::interrupted() {
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

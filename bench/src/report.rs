//! Results: per-run samples, their median/min/max, the JSON document and
//! the table printed on stdout.

use serde::Serialize;

/// One intact run (a run whose restore did not check out is never a sample).
#[derive(Clone, Debug, Serialize)]
pub struct Sample {
    pub run: usize,
    pub dump_s: f64,
    pub frozen_s: Option<f64>,
    pub restore_s: f64,
    pub bytes: u64,
    pub raw_bytes: u64,
    pub cpu_s: f64,
    /// The dump's part of `cpu_s`: its commands (criuz and CRIU, or CRIU
    /// and the archiver) and CRIU's parasite code in the dumped tree.
    pub dump_cpu_s: f64,
    /// The larger of the dump's and the restore's peak RSS.
    pub peak_rss_kib: u64,
    /// The dump's alone (with `--absorb`, criuz holds the pages CRIU wrote
    /// until they are compressed).
    pub dump_rss_kib: u64,
    /// `criuz dump`'s own, CRIU's not counted (its `--json`): where CRIU
    /// maps the tree's shared memory to dump it, `dump_rss_kib` is CRIU's.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub criuz_rss_kib: Option<u64>,
    /// With `--cold`: the same checkpoint restored again right after, from
    /// a warm page cache (pattern workloads, configurations that restore
    /// from the checkpoint in place), and checked again.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub warm_restore_s: Option<f64>,
    /// With `--cold`: the restore's read rate, the checkpoint's bytes over
    /// what reading them added to the restore (cold minus warm seconds; none
    /// when the reads were all hidden behind the restore's other work), and
    /// a plain sequential read of the same checkpoint (bytes per second),
    /// both from a dropped page cache.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cold_read_bps: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub disk_read_bps: Option<f64>,
    /// The workload tree's anonymous memory (its processes' `Pss_Anon`
    /// added up: a page shared copy-on-write counts once) before the dump,
    /// and right after the restore, before anything reads it.
    pub tree_before_kib: u64,
    pub tree_restored_kib: u64,
    /// Of that memory, what was transparent huge pages, before and after.
    pub huge_before_kib: u64,
    pub huge_restored_kib: u64,
    /// The `thp` workload: nanoseconds a random read of its memory took,
    /// before the dump and after the restore.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub read_ns_before: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub read_ns_restored: Option<f64>,
}

/// Everything measured for one workload x configuration.
#[derive(Clone, Debug)]
pub struct Pair {
    pub workload: String,
    pub config: &'static str,
    pub runs: usize,
    pub samples: Vec<Sample>,
    pub failures: Vec<String>,
}

impl Pair {
    /// Every run restored and checked out.
    pub fn intact(&self) -> bool {
        self.runs > 0 && self.failures.is_empty() && self.samples.len() == self.runs
    }
}

#[derive(Clone, Copy, Debug, Serialize)]
pub struct Figure {
    pub median: f64,
    pub min: f64,
    pub max: f64,
}

pub fn median(v: &[f64]) -> Option<f64> {
    let mut s: Vec<f64> = v.iter().copied().filter(|x| x.is_finite()).collect();
    if s.is_empty() {
        return None;
    }
    s.sort_by(f64::total_cmp);
    let m = s.len() / 2;
    Some(if s.len() % 2 == 1 { s[m] } else { (s[m - 1] + s[m]) / 2.0 })
}

pub fn figure(v: &[f64]) -> Option<Figure> {
    let med = median(v)?;
    let min = v.iter().copied().fold(f64::INFINITY, f64::min);
    let max = v.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    Some(Figure { median: med, min, max })
}

#[derive(Clone, Debug, Serialize)]
pub struct Machine {
    pub cores: usize,
    /// Bytes of RAM.
    pub memory: u64,
    pub kernel: String,
    pub cpu: String,
    pub criu_version: String,
    /// The file where CRIU keeps what it probes of the kernel at its start,
    /// null where it keeps none (and pays the probes, about 25 ms here, at
    /// every start: dumps, restores and a lazy tree's start alike).
    pub criu_kernel_cache: Option<String>,
    pub criuz_version: String,
    /// Idle processes kept beside the run (`--idle-processes`).
    pub idle_processes: usize,
}

/// Where `criu` keeps its kernel cache (`kerndat`), as CRIU itself says
/// (`criuz::criu::probe`: it keeps one only on a tmpfs, in a directory fixed
/// when it was built).
pub fn criu_kernel_cache(criu: &std::path::Path) -> Option<String> {
    let log = std::env::temp_dir().join(format!("criuz-bench-kerndat-{}.log", std::process::id()));
    let found = criuz::criu::probe::check_kernel(criu, &log).ok().and_then(|c| c.kernel_cache);
    let _ = std::fs::remove_file(&log);
    found.map(|f| f.display().to_string())
}

impl Machine {
    pub fn probe(criu_version: &str, criu_kernel_cache: Option<String>, idle_processes: usize) -> Machine {
        let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
        let memory = meminfo
            .lines()
            .find_map(|l| l.strip_prefix("MemTotal:"))
            .and_then(|v| v.split_whitespace().next()?.parse::<u64>().ok())
            .unwrap_or(0)
            * 1024;
        let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
        let cpu = cpuinfo
            .lines()
            .find_map(|l| {
                l.strip_prefix("model name").and_then(|r| r.split_once(':')).map(|(_, v)| v.trim().to_string())
            })
            .unwrap_or_default();
        Machine {
            cores: std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1),
            memory,
            kernel: std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default().trim().to_string(),
            cpu,
            criu_version: criu_version.to_string(),
            criu_kernel_cache,
            criuz_version: env!("CARGO_PKG_VERSION").to_string(),
            idle_processes,
        }
    }
}

fn is_zero(t: &f64) -> bool {
    *t == 0.0
}

#[derive(Clone, Debug, Serialize)]
pub struct Settings {
    pub size_mib: u64,
    pub runs: usize,
    pub cold: bool,
    /// `--settle`: seconds waited between each dump and its restore.
    #[serde(skip_serializing_if = "is_zero")]
    pub settle_s: f64,
    pub quick: bool,
    /// Link rate in bytes per second, null without --link.
    pub link_bytes_per_s: Option<u64>,
    /// `--absorb` given to criuz dumps, null for the default.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub absorb: Option<String>,
    pub workloads: Vec<String>,
    pub configs: Vec<String>,
}

/// One result object of the JSON. Figures are null unless every run was intact.
#[derive(Clone, Debug, Serialize)]
pub struct ResultJson {
    pub workload: String,
    pub config: String,
    pub runs: usize,
    pub intact: bool,
    pub dump_s: Option<Figure>,
    pub frozen_s: Option<Figure>,
    pub restore_s: Option<Figure>,
    pub cpu_s: Option<Figure>,
    pub dump_cpu_s: Option<Figure>,
    /// Medians over the runs.
    pub bytes: Option<u64>,
    pub raw_bytes: Option<u64>,
    /// bytes / raw_bytes.
    pub ratio: Option<f64>,
    /// Largest over the runs: dump or restore, and the dump's alone.
    pub peak_rss_kib: Option<u64>,
    pub dump_rss_kib: Option<u64>,
    /// Largest over the runs: `criuz dump`'s own.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub criuz_rss_kib: Option<u64>,
    /// Medians: the tree's anonymous memory before the dump and restored.
    pub tree_before_kib: Option<u64>,
    pub tree_restored_kib: Option<u64>,
    /// Medians: of that memory, what was transparent huge pages.
    pub huge_before_kib: Option<u64>,
    pub huge_restored_kib: Option<u64>,
    /// The `thp` workload: a random read of its memory, nanoseconds.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub read_ns_before: Option<Figure>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub read_ns_restored: Option<Figure>,
    /// With `--cold`: the warm restore right after, the restore's read rate
    /// (checkpoint bytes over cold minus warm restore seconds) and the plain
    /// sequential read rate of the same checkpoint.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub warm_restore_s: Option<Figure>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cold_read_bps: Option<Figure>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub disk_read_bps: Option<Figure>,
    pub failures: Vec<String>,
    pub samples: Vec<Sample>,
}

#[derive(Clone, Debug, Serialize)]
pub struct Document {
    pub machine: Machine,
    pub settings: Settings,
    pub results: Vec<ResultJson>,
}

fn median_u64(v: impl Iterator<Item = u64>) -> Option<u64> {
    let v: Vec<f64> = v.map(|x| x as f64).collect();
    median(&v).map(|m| m.round() as u64)
}

impl ResultJson {
    pub fn of(p: &Pair) -> ResultJson {
        let ok = p.intact();
        let fig = |f: &dyn Fn(&Sample) -> Option<f64>| -> Option<Figure> {
            if !ok {
                return None;
            }
            let v: Vec<f64> = p.samples.iter().filter_map(f).collect();
            if v.len() == p.samples.len() {
                figure(&v)
            } else {
                None
            }
        };
        let bytes = if ok { median_u64(p.samples.iter().map(|s| s.bytes)) } else { None };
        let raw_bytes = if ok { median_u64(p.samples.iter().map(|s| s.raw_bytes)) } else { None };
        ResultJson {
            workload: p.workload.clone(),
            config: p.config.to_string(),
            runs: p.runs,
            intact: ok,
            dump_s: fig(&|s| Some(s.dump_s)),
            frozen_s: fig(&|s| s.frozen_s),
            restore_s: fig(&|s| Some(s.restore_s)),
            cpu_s: fig(&|s| Some(s.cpu_s)),
            dump_cpu_s: fig(&|s| Some(s.dump_cpu_s)),
            bytes,
            raw_bytes,
            ratio: bytes.zip(raw_bytes).map(|(b, r)| b as f64 / r.max(1) as f64),
            peak_rss_kib: if ok { p.samples.iter().map(|s| s.peak_rss_kib).max() } else { None },
            dump_rss_kib: if ok { p.samples.iter().map(|s| s.dump_rss_kib).max() } else { None },
            criuz_rss_kib: if ok { p.samples.iter().filter_map(|s| s.criuz_rss_kib).max() } else { None },
            tree_before_kib: if ok { median_u64(p.samples.iter().map(|s| s.tree_before_kib)) } else { None },
            tree_restored_kib: if ok { median_u64(p.samples.iter().map(|s| s.tree_restored_kib)) } else { None },
            huge_before_kib: if ok { median_u64(p.samples.iter().map(|s| s.huge_before_kib)) } else { None },
            huge_restored_kib: if ok { median_u64(p.samples.iter().map(|s| s.huge_restored_kib)) } else { None },
            read_ns_before: fig(&|s| s.read_ns_before),
            read_ns_restored: fig(&|s| s.read_ns_restored),
            warm_restore_s: fig(&|s| s.warm_restore_s),
            cold_read_bps: fig(&|s| s.cold_read_bps),
            disk_read_bps: fig(&|s| s.disk_read_bps),
            failures: p.failures.clone(),
            samples: p.samples.clone(),
        }
    }
}

fn fmt_fig(f: Option<Figure>, runs: usize) -> String {
    match f {
        None => "-".into(),
        Some(f) if runs <= 1 => format!("{:.2}", f.median),
        Some(f) => format!("{:.2} [{:.2}-{:.2}]", f.median, f.min, f.max),
    }
}

fn mib(b: Option<u64>) -> String {
    b.map(|b| format!("{:.1}", b as f64 / (1u64 << 20) as f64)).unwrap_or_else(|| "-".into())
}

/// Where the tree had transparent huge pages before the dump or after the
/// restore: how many MiB, and with the `thp` workload what a random read
/// of its memory took, before / after.
fn huge_cell(r: &ResultJson) -> String {
    let (b, a) = (r.huge_before_kib.unwrap_or(0), r.huge_restored_kib.unwrap_or(0));
    if b == 0 && a == 0 {
        return String::new();
    }
    let reads = match (r.read_ns_before, r.read_ns_restored) {
        (Some(b), Some(a)) => format!(", reads {:.1} / {:.1} ns", b.median, a.median),
        _ => String::new(),
    };
    format!(" (huge {:.0} / {:.0}{reads})", b as f64 / 1024.0, a as f64 / 1024.0)
}

/// The readable table: one line per workload x configuration.
pub fn table(results: &[ResultJson]) -> String {
    let head = [
        "workload",
        "config",
        "dump s",
        "frozen s",
        "restore s",
        "size MiB",
        "raw MiB",
        "ratio",
        "cpu s",
        "dump cpu s",
        "dump RSS MiB",
        "peak RSS MiB",
        "tree MiB before / restored",
        "warm restore s / cold read MB/s (disk)",
        "intact",
    ];
    let mut rows: Vec<Vec<String>> = vec![head.iter().map(|s| s.to_string()).collect()];
    for r in results {
        if !r.intact {
            let mut row = vec![r.workload.clone(), r.config.clone()];
            row.extend(std::iter::repeat_n("-".to_string(), head.len() - 3));
            row.push("FAILED".into());
            rows.push(row);
            continue;
        }
        rows.push(vec![
            r.workload.clone(),
            r.config.clone(),
            fmt_fig(r.dump_s, r.runs),
            fmt_fig(r.frozen_s, r.runs),
            fmt_fig(r.restore_s, r.runs),
            mib(r.bytes),
            mib(r.raw_bytes),
            r.ratio.map(|x| format!("{x:.3}")).unwrap_or_else(|| "-".into()),
            fmt_fig(r.cpu_s, r.runs),
            fmt_fig(r.dump_cpu_s, r.runs),
            r.dump_rss_kib.map(|k| format!("{:.1}", k as f64 / 1024.0)).unwrap_or_else(|| "-".into()),
            r.peak_rss_kib.map(|k| format!("{:.1}", k as f64 / 1024.0)).unwrap_or_else(|| "-".into()),
            match (r.tree_before_kib, r.tree_restored_kib) {
                (Some(b), Some(a)) => format!("{:.0} / {:.0}{}", b as f64 / 1024.0, a as f64 / 1024.0, huge_cell(r)),
                _ => "-".into(),
            },
            match (r.warm_restore_s, r.cold_read_bps, r.disk_read_bps) {
                (Some(w), Some(c), Some(d)) => {
                    format!("{:.2} / {:.0} ({:.0})", w.median, c.median / 1e6, d.median / 1e6)
                }
                (Some(w), None, Some(d)) => format!("{:.2} / hidden ({:.0})", w.median, d.median / 1e6),
                (None, _, Some(d)) => format!("- ({:.0})", d.median / 1e6),
                _ => "-".into(),
            },
            "yes".into(),
        ]);
    }
    let widths: Vec<usize> =
        (0..head.len()).map(|i| rows.iter().map(|r| r[i].chars().count()).max().unwrap_or(0)).collect();
    let mut out = String::new();
    for (k, row) in rows.iter().enumerate() {
        let cells: Vec<String> = row
            .iter()
            .enumerate()
            .map(|(i, c)| if i < 2 { format!("{c:<w$}", w = widths[i]) } else { format!("{c:>w$}", w = widths[i]) })
            .collect();
        out.push_str(cells.join("  ").trim_end());
        out.push('\n');
        if k == 0 {
            out.push_str(&"-".repeat(widths.iter().sum::<usize>() + 2 * (widths.len() - 1)));
            out.push('\n');
        }
    }
    for r in results.iter().filter(|r| !r.intact) {
        for f in &r.failures {
            out.push_str(&format!("FAILED {} / {}: {f}\n", r.workload, r.config));
        }
    }
    out
}

//! `criuz-bench --gpu`: a CUDA process (`bench/gpu_app.py`: PyTorch, bf16
//! weights and a partly filled bf16 KV cache on the GPU) checkpointed and
//! restored as users do it today against criuz's one command each way.
//!
//! - `criu-dir`: the CUDA state suspended through the driver (lock +
//!   checkpoint: what `cuda-checkpoint` does), `criu dump -D` then `sync`;
//!   restore with `criu restore -D -d`, then the driver's restore + unlock.
//! - `criuz-lz4`, `criuz-zstd`: `criuz dump` (which suspends CUDA itself) and
//!   `criuz restore -d` (`eager`: placed, as `--lazy` is too for CUDA
//!   processes); `zeros-placed`: placed with every zero page as a page of
//!   memory (`--fill place --keep-zero-pages`); `zeros-streamed`: streamed
//!   through CRIU with every zero page (`--fill stream --keep-zero-pages`).
//!   The driver's resume after a placed restore took 4.0-4.2 s against
//!   3.3-3.6 s after CRIU's own (session 24); a placed restore leaves zero
//!   pages unmapped where CRIU writes them, and these rows say whether that
//!   is the difference, and what placing them costs.
//!
//! criuz stores page ids for a tree holding CUDA state by default (each
//! page that occurs twice stored once: PyTorch's allocator keeps freed
//! blocks, such as the temporary a tensor was filled from, with their
//! bytes); `--gpu-no-ids` dumps with `--no-ids`, to see what they cost and
//! save. `--gpu-no-planes` dumps with `--no-planes`: beside a default dump,
//! what the byte planes of 16-bit floats cost in dump CPU on this image.
//! `--gpu-eager-only` leaves out the two zero-page rows: a shorter run.
//!
//! One dump per configuration and run; the archive (or directory) is then
//! restored each way, each restore followed by a
//! request whose answer must equal the one before the dump: the first
//! answer's time counts from the restore's start. With `--cold` the page
//! cache is dropped before each restore. Columns: suspend, durable dump
//! without the suspend, the dump's CPU and peak memory (criuz and CRIU, or
//! CRIU alone; the suspend's share is the driver's, in the app), CRIU's
//! frozen time, size, restore (CRIU's part), resume, first answer, intact.
//! On a machine without a GPU (no driver, no device, or no PyTorch that
//! sees one) it says so and measures nothing.

use crate::error::{Error, Result};
use crate::proc;
use crate::workload::{log_tail, spawn_detached};
use criuz::criu::Criu;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const APP: &str = include_str!("../gpu_app.py");

/// The app's sizes, and how criuz dumps and restores it.
#[derive(Clone, Copy, Debug, serde::Serialize)]
pub struct GpuPlan {
    pub weights_gib: f64,
    pub kv_gib: f64,
    pub kv_fill: f64,
    /// criuz dumps without page ids (`--no-ids`).
    pub no_ids: bool,
    /// criuz dumps without byte planes (`--no-planes`).
    pub no_planes: bool,
    /// criuz's archives restored eagerly only (`--gpu-eager-only`).
    pub eager_only: bool,
}

#[derive(Clone, Debug, serde::Serialize)]
pub struct GpuRow {
    pub config: String,
    /// eager, or (criuz) zeros-placed or zeros-streamed.
    pub restore: String,
    pub cold: bool,
    /// Medians over the runs, seconds.
    pub suspend_s: f64,
    pub dump_s: f64,
    /// User and system CPU of the dump's commands: criuz and the CRIU it
    /// runs, or `criu dump` (the suspend is the driver's work, in the app).
    pub dump_cpu_s: f64,
    /// Largest over the runs: the dump commands' peak resident memory (the
    /// largest of criuz and its CRIU, or of `criu dump`).
    pub dump_rss_kib: u64,
    pub frozen_s: f64,
    pub restore_s: f64,
    pub resume_s: f64,
    pub first_answer_s: f64,
    /// The host image (raw) and what was stored.
    pub raw_bytes: u64,
    pub stored_bytes: u64,
    pub intact: bool,
    /// criuz's dump report and `criuz inspect --json` of the first run's
    /// archive (null for criu-dir).
    pub archive: serde_json::Value,
}

/// Why this machine cannot run the GPU bench, if it cannot.
pub fn unavailable() -> Option<String> {
    let driver = match criuz::cuda::driver::Driver::load() {
        Ok(d) => d,
        Err(e) => return Some(e.to_string()),
    };
    if let Err(e) = driver.init() {
        return Some(format!("the CUDA driver does not start: {e}"));
    }
    match driver.gpus() {
        Ok(g) if !g.is_empty() => {}
        Ok(_) => return Some("the CUDA driver lists no GPU".into()),
        Err(e) => return Some(e.to_string()),
    }
    let torch = Command::new("python3")
        .args(["-c", "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status();
    match torch {
        Ok(s) if s.success() => None,
        _ => Some("python3 with a PyTorch that sees the GPU is not installed".into()),
    }
}

struct App {
    pid: i32,
    dir: PathBuf,
}

impl App {
    fn start(work: &Path, plan: GpuPlan) -> Result<App> {
        let dir = work.join("app");
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).map_err(|e| Error::file(&dir, e))?;
        let script = work.join("gpu_app.py");
        std::fs::write(&script, APP).map_err(|e| Error::file(&script, e))?;
        let mut cmd = Command::new("python3");
        cmd.arg(&script).arg(&dir);
        cmd.env("W_GIB", plan.weights_gib.to_string())
            .env("KV_GIB", plan.kv_gib.to_string())
            .env("KV_FILL", plan.kv_fill.to_string());
        let log = work.join("app.log");
        let pid = spawn_detached(cmd, &log)?;
        let ready = dir.join("ready");
        let t = Instant::now();
        while !ready.exists() {
            if !proc::alive(pid) || t.elapsed() > Duration::from_secs(600) {
                return Err(Error::Invalid(format!("the GPU app did not start: {}", log_tail(&log))));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        Ok(App { pid, dir })
    }

    fn answer(&self, n: usize) -> Option<String> {
        std::fs::read_to_string(self.dir.join(format!("sum.{n}"))).ok()
    }

    /// Asks the (restored) app for answer `n`; waits for it.
    fn ask(&self, n: usize, timeout: Duration) -> Result<String> {
        // SAFETY: signalling the app we started (or restored).
        unsafe { libc::kill(self.pid, libc::SIGUSR1) };
        let t = Instant::now();
        loop {
            if let Some(a) = self.answer(n) {
                return Ok(a);
            }
            if !proc::alive(self.pid) || t.elapsed() > timeout {
                return Err(Error::Invalid(format!("the restored GPU app gave no answer {n}")));
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    fn end(&self) {
        proc::kill_tree(&proc::tree(self.pid));
        let _ = proc::reap(self.pid, Duration::from_secs(30));
        proc::reap_zombies();
    }
}

/// Runs `cmd`; its wall time and standard output, or its failure.
fn run(cmd: &mut Command, what: &str) -> Result<(f64, Vec<u8>)> {
    proc::run_measured(cmd, what).map(|(secs, _, out)| (secs, out))
}

/// Runs one dump command to its end: its wall seconds, standard output,
/// and CPU and peak memory (from wait4, with the processes it waited for).
fn dump_command(cmd: Command, logs: &Path, step: &str) -> Result<(f64, Vec<u8>, proc::Usage)> {
    let t = Instant::now();
    let done = proc::pipeline(vec![cmd], proc::Src::Null, proc::Dst::Capture, logs, step)?;
    Ok((t.elapsed().as_secs_f64(), done.stdout, done.usage))
}

fn json(bytes: &[u8]) -> serde_json::Value {
    serde_json::from_slice(bytes).unwrap_or_default()
}

/// One sample of a row.
#[derive(Default, Clone)]
struct Sample {
    suspend_s: f64,
    dump_s: f64,
    dump_cpu_s: f64,
    dump_rss_kib: u64,
    frozen_s: f64,
    restore_s: f64,
    resume_s: f64,
    first_answer_s: f64,
    raw_bytes: u64,
    stored_bytes: u64,
    intact: bool,
    /// criuz's dump report and `criuz inspect` of the archive (criuz only).
    archive: serde_json::Value,
}

/// Restores the app that `restore` brings back, asks it, checks the answer.
fn restored(app: &App, expect: &str, cold: bool, restore: impl FnOnce() -> Result<(f64, f64)>) -> Result<Sample> {
    if cold {
        proc::drop_caches()?;
    }
    let t = Instant::now();
    let (restore_s, resume_s) = restore()?;
    let answer = app.ask(1, Duration::from_secs(600))?;
    let first_answer_s = t.elapsed().as_secs_f64();
    let _ = std::fs::remove_file(app.dir.join("sum.1"));
    app.end();
    Ok(Sample { restore_s, resume_s, first_answer_s, intact: answer == expect, ..Sample::default() })
}

/// Rows of every configuration: `runs` dumps each, every dump restored
/// eagerly (criuz's also with every zero page placed, then streamed,
/// unless `eager_only`).
pub fn measure(
    configs: &[&str],
    plan: GpuPlan,
    runs: usize,
    cold: bool,
    work: &Path,
    criu: &Criu,
    criuz: &Path,
) -> Result<Vec<GpuRow>> {
    let mut rows = Vec::new();
    for &config in configs {
        let hows: &[&str] = if config == "criu-dir" || plan.eager_only {
            &["eager"]
        } else {
            &["eager", "zeros-placed", "zeros-streamed"]
        };
        let mut samples: Vec<Vec<Sample>> = vec![Vec::new(); hows.len()];
        for run_no in 0..runs.max(1) {
            eprintln!("bench: gpu: {config}, run {}", run_no + 1);
            let store = work.join("store");
            let _ = std::fs::remove_dir_all(&store);
            std::fs::create_dir_all(&store).map_err(|e| Error::file(&store, e))?;
            let app = App::start(work, plan)?;
            let expect = app.answer(0).unwrap_or_default();
            let mut dumped = Sample::default();
            let (image, arc) = (store.join("img"), store.join("gpu.czr"));
            if config == "criu-dir" {
                std::fs::create_dir_all(&image).map_err(|e| Error::file(&image, e))?;
                // What a user's script does (as cuda-checkpoint would):
                // lock and checkpoint through the driver, then CRIU.
                let driver = criuz::cuda::driver::Driver::load().map_err(|e| Error::Invalid(e.to_string()))?;
                let t = Instant::now();
                let suspended =
                    driver.lock(app.pid, criuz::cuda::LOCK_TIMEOUT_MS).and_then(|()| driver.checkpoint(app.pid));
                if let Err(e) = suspended {
                    let _ = criuz::cuda::resume_pids(&driver, &[app.pid], &[]);
                    return Err(Error::Invalid(e.to_string()));
                }
                dumped.suspend_s = t.elapsed().as_secs_f64();
                let t = Instant::now();
                let mut cmd = Command::new(&criu.path);
                cmd.args(["dump", "-o", "dump.log", "-t", &app.pid.to_string(), "-D"]).arg(&image);
                match dump_command(cmd, &store, "criu-dump") {
                    Ok((_, _, usage)) => (dumped.dump_cpu_s, dumped.dump_rss_kib) = (usage.cpu_s, usage.maxrss_kib),
                    Err(e) => {
                        let _ = criuz::cuda::resume_pids(&driver, &[app.pid], &[]);
                        return Err(e);
                    }
                }
                // SAFETY: sync(2) has no preconditions: the image made durable,
                // as criuz's archive is.
                unsafe { libc::sync() };
                dumped.dump_s = t.elapsed().as_secs_f64();
                dumped.frozen_s =
                    crate::config::frozen_from_stats(&std::fs::read(image.join("stats-dump")).unwrap_or_default())
                        .unwrap_or(f64::NAN);
                dumped.raw_bytes = proc::dir_bytes(&image);
                dumped.stored_bytes = dumped.raw_bytes;
            } else {
                let codec = config.trim_start_matches("criuz-");
                let mut cmd = Command::new(criuz);
                cmd.args(["dump", "-t", &app.pid.to_string(), "-o"]).arg(&arc).args(["--codec", codec, "--json"]);
                if plan.no_ids {
                    cmd.arg("--no-ids");
                }
                if plan.no_planes {
                    cmd.arg("--no-planes");
                }
                let (secs, out, usage) = dump_command(cmd, &store, "criuz-dump")?;
                (dumped.dump_cpu_s, dumped.dump_rss_kib) = (usage.cpu_s, usage.maxrss_kib);
                let d = json(&out);
                dumped.suspend_s = d["cuda"]["suspend_seconds"].as_f64().unwrap_or(f64::NAN);
                dumped.dump_s = secs - dumped.suspend_s;
                dumped.frozen_s = d["criu_stats"]["frozen_time_us"].as_f64().map_or(f64::NAN, |us| us / 1e6);
                dumped.raw_bytes = d["raw_bytes"].as_u64().unwrap_or(0);
                dumped.stored_bytes = proc::file_bytes(&arc);
                // What the archive is made of (zero pages, blocks by codec,
                // hurried blocks; per file), to explain its size.
                let (_, inspected) = run(Command::new(criuz).arg("inspect").arg("--json").arg(&arc), "criuz inspect")?;
                let mut report = d.clone();
                if let Some(r) = report.as_object_mut() {
                    r.remove("criu_stats");
                }
                dumped.archive = serde_json::json!({ "dump": report, "inspect": json(&inspected) });
            }
            proc::reap(app.pid, Duration::from_secs(60))?;
            for (i, how) in hows.iter().enumerate() {
                let s = if config == "criu-dir" {
                    let driver = criuz::cuda::driver::Driver::load().map_err(|e| Error::Invalid(e.to_string()))?;
                    driver.init().map_err(|e| Error::Invalid(e.to_string()))?;
                    restored(&app, &expect, cold, || {
                        let (secs, _) = run(
                            Command::new(&criu.path).args(["restore", "-d", "-o", "restore.log", "-D"]).arg(&image),
                            "criu restore",
                        )?;
                        let t = Instant::now();
                        criuz::cuda::resume_pids(&driver, &[app.pid], &[])?;
                        Ok((secs, t.elapsed().as_secs_f64()))
                    })?
                } else {
                    restored(&app, &expect, cold, || {
                        let mut cmd = Command::new(criuz);
                        cmd.args(["restore", "-d", "-i"]).arg(&arc).arg("--json");
                        match *how {
                            "zeros-placed" => cmd.args(["--fill", "place", "--keep-zero-pages"]),
                            "zeros-streamed" => cmd.args(["--fill", "stream", "--keep-zero-pages"]),
                            _ => &mut cmd,
                        };
                        let (secs, out) = run(&mut cmd, "criuz restore")?;
                        let resume = json(&out)["cuda_resume_seconds"].as_f64().unwrap_or(f64::NAN);
                        Ok((secs - resume, resume))
                    })?
                };
                samples[i].push(Sample {
                    restore_s: s.restore_s,
                    resume_s: s.resume_s,
                    first_answer_s: s.first_answer_s,
                    intact: s.intact,
                    ..dumped.clone()
                });
            }
        }
        for (how, got) in hows.iter().zip(samples) {
            let med = |f: fn(&Sample) -> f64| {
                crate::report::median(&got.iter().map(f).collect::<Vec<_>>()).unwrap_or(f64::NAN)
            };
            rows.push(GpuRow {
                config: config.to_string(),
                restore: how.to_string(),
                cold,
                suspend_s: med(|s| s.suspend_s),
                dump_s: med(|s| s.dump_s),
                dump_cpu_s: med(|s| s.dump_cpu_s),
                dump_rss_kib: got.iter().map(|s| s.dump_rss_kib).max().unwrap_or(0),
                frozen_s: med(|s| s.frozen_s),
                restore_s: med(|s| s.restore_s),
                resume_s: med(|s| s.resume_s),
                first_answer_s: med(|s| s.first_answer_s),
                raw_bytes: got.first().map_or(0, |s| s.raw_bytes),
                stored_bytes: got.first().map_or(0, |s| s.stored_bytes),
                intact: got.iter().all(|s| s.intact),
                archive: got.first().map(|s| s.archive.clone()).unwrap_or_default(),
            });
        }
    }
    Ok(rows)
}

pub fn table(rows: &[GpuRow]) -> String {
    let mut s = format!(
        "{:<11} {:<14} {:>9} {:>7} {:>8} {:>8} {:>7} {:>9} {:>6} {:>8} {:>7} {:>8} {:>7}\n",
        "config",
        "how",
        "suspend s",
        "dump s",
        "dump CPU",
        "dump MiB",
        "frozen",
        "GB",
        "ratio",
        "restore",
        "resume",
        "answer",
        "intact"
    );
    for r in rows {
        s.push_str(&format!(
            "{:<11} {:<14} {:>9.2} {:>7.2} {:>8.2} {:>8.0} {:>7.2} {:>9.2} {:>6.3} {:>8.2} {:>7.2} {:>8.2} {:>7}\n",
            r.config,
            r.restore,
            r.suspend_s,
            r.dump_s,
            r.dump_cpu_s,
            r.dump_rss_kib as f64 / 1024.0,
            r.frozen_s,
            r.stored_bytes as f64 / 1e9,
            r.stored_bytes as f64 / r.raw_bytes.max(1) as f64,
            r.restore_s,
            r.resume_s,
            r.first_answer_s,
            if r.intact { "yes" } else { "NO" }
        ));
    }
    s
}

//! `criuz-bench --containers`: the workload inside a runc container,
//! checkpointed and restored side by side in one run by
//! - `runc-dir`: `runc checkpoint --image-path DIR` / `runc restore` from it
//!   (DIR on the bench's work disk, as a runc user does);
//! - `runc+zstd`: the same, then `tar | zstd -1 -T0` into one file (what a
//!   runc user does for a checkpoint to keep or move; the images directory
//!   is removed untimed) / `zstd -d | tar -x`, then `runc restore`;
//! - `criuz-runc`: `criuz runc checkpoint -o FILE` / `criuz runc restore -i
//!   FILE` as they are by default: the page server (CRIU sends its pages to
//!   criuz over loopback TCP), and a lazy restore (the container runs at
//!   once, criuz serves its pages; the command, and the time, end once every
//!   page is in);
//! - `criuz-runc-follow`: checkpoint `--via follow` (CRIU's images followed
//!   in tmpfs and compressed as they grow);
//! - `criuz-runc-eager`: checkpoint as `criuz-runc`, restore `--eager` (every
//!   page written for CRIU before it starts).
//!
//! The container's workload is `mixed` in private memory, or (`--workloads
//! shared-cache`) in shared memory a child of the init filled and left, as
//! a database's workers fill its shared buffers.
//!
//! Configurations alternate within each round so drift hits all alike, and
//! each run starts after a `sync`, so no run pays for the writeback of the
//! one before (runc-dir's images are never synced; a criuz archive is
//! fsynced before it is renamed into place, and that is timed).
//! Times are wall time of the one command; every restore is checked by the
//! workload's own checksum, read through `runc kill USR1`. The root
//! filesystem is busybox plus the workload (`scripts/rootfs.sh`).

use crate::error::{Error, Result};
use crate::proc::{self, Dst, Src};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

pub const CONFIGS: [&str; 5] = ["runc-dir", "runc+zstd", "criuz-runc", "criuz-runc-follow", "criuz-runc-eager"];

/// The workloads a container can run (see the module doc).
pub const WORKLOADS: [&str; 2] = ["mixed", "shared-cache"];

/// `criuz-workload`'s arguments after `--mib` for `workload`.
fn workload_args(workload: &str) -> &'static [&'static str] {
    match workload {
        "shared-cache" => &["--pattern", "mixed", "--shared", "1", "--filled-by-child", "1"],
        _ => &["--pattern", "mixed"],
    }
}

#[derive(Clone, Debug, serde::Serialize)]
pub struct ContainerRow {
    pub config: String,
    pub workload: String,
    pub mib: u64,
    /// Medians over the runs, seconds.
    pub checkpoint_s: f64,
    pub restore_s: f64,
    /// A lazy restore: until the container ran, median (`restore_s` is
    /// until every page was in).
    pub running_s: Option<f64>,
    pub checkpoint_runs: Vec<f64>,
    pub restore_runs: Vec<f64>,
    /// CRIU's images (runc-dir), or the archive's raw bytes.
    pub raw_bytes: u64,
    /// What is stored: the image directory, or the archive.
    pub stored_bytes: u64,
    pub ratio: f64,
    /// Against runc-dir, measured in the same rounds.
    pub checkpoint_vs_runc: f64,
    pub restore_vs_runc: f64,
    pub intact: bool,
}

/// A runc bundle whose container runs `criuz-workload` (mixed pattern).
pub struct Bundle {
    pub dir: PathBuf,
    pub root: PathBuf,
    pub id: String,
    pub criu: PathBuf,
}

impl Bundle {
    pub fn runc(&self) -> Command {
        let mut c = Command::new("runc");
        c.arg("--root").arg(&self.root).arg("--criu").arg(&self.criu);
        c
    }
    pub fn wl(&self) -> PathBuf {
        self.dir.join("rootfs/wl")
    }
    pub fn wait(&self, f: &Path, what: &str) -> Result<()> {
        let t = Instant::now();
        while !f.exists() {
            if t.elapsed() > Duration::from_secs(120) {
                return Err(Error::Invalid(format!("timed out waiting for {what}")));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        Ok(())
    }
    pub fn start(&self) -> Result<()> {
        let _ = std::fs::remove_file(self.wl().join("ready"));
        // The container keeps runc's stdio: nothing a wait could hang on.
        let st = self
            .runc()
            .args(["run", "-d", "-b"])
            .arg(&self.dir)
            .arg(&self.id)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()?;
        if !st.success() {
            return Err(Error::Invalid(format!("runc run {} failed ({st})", self.id)));
        }
        self.wait(&self.wl().join("ready"), "the container's workload")
    }
    pub fn sum(&self) -> Result<String> {
        let f = self.wl().join("sum-root");
        let _ = std::fs::remove_file(&f);
        quiet(self.runc().args(["kill", &self.id, "USR1"]), "runc kill")?;
        self.wait(&f, "the workload's checksum")?;
        std::fs::read_to_string(&f).map_err(|e| Error::file(&f, e))
    }
    pub fn delete(&self) {
        // A restore cut short can leave the rootfs mounted in the state
        // directory, which `runc delete` removes recursively.
        criuz::io::leftover::detach_mounts_below(&self.root.join(&self.id));
        let _ = self.runc().args(["delete", "-f", &self.id]).output();
    }
}

fn quiet(cmd: &mut Command, what: &str) -> Result<()> {
    let out = cmd.stdin(Stdio::null()).stdout(Stdio::null()).stderr(Stdio::piped()).output()?;
    if !out.status.success() {
        return Err(Error::Invalid(format!("{what} failed: {}", String::from_utf8_lossy(&out.stderr).trim())));
    }
    Ok(())
}

/// Times one command, its output discarded (errors carry its stderr).
fn timed(cmd: Command, logs: &Path, what: &str) -> Result<f64> {
    let t = Instant::now();
    proc::pipeline(vec![cmd], Src::Null, Dst::Null, logs, what)?;
    Ok(t.elapsed().as_secs_f64())
}

pub fn make_bundle(work: &Path, workload: &Path, kind: &str, mib: u64, criu: &Path) -> Result<Bundle> {
    let dir = work.join(format!("bundle-{kind}-{mib}"));
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../scripts/rootfs.sh");
    quiet(Command::new("bash").arg(&script).arg(dir.join("rootfs")).arg(workload), "scripts/rootfs.sh")?;
    std::fs::create_dir_all(dir.join("rootfs/wl")).map_err(|e| Error::file(&dir, e))?;
    quiet(Command::new("runc").args(["spec", "-b"]).arg(&dir), "runc spec")?;
    let cfg = dir.join("config.json");
    let text = std::fs::read(&cfg).map_err(|e| Error::file(&cfg, e))?;
    let mut spec: serde_json::Value = serde_json::from_slice(&text).map_err(|e| Error::Invalid(e.to_string()))?;
    spec["process"]["terminal"] = false.into();
    let mut argv =
        vec!["/bin/criuz-workload".to_string(), "--dir".into(), "/wl".into(), "--mib".into(), mib.to_string()];
    argv.extend(workload_args(kind).iter().map(|a| a.to_string()));
    spec["process"]["args"] = serde_json::json!(argv);
    spec["root"] = serde_json::json!({"path": "rootfs", "readonly": false});
    std::fs::write(&cfg, serde_json::to_vec_pretty(&spec).map_err(|e| Error::Invalid(e.to_string()))?)
        .map_err(|e| Error::file(&cfg, e))?;
    let root = work.join(format!("runc-root-{kind}-{mib}"));
    std::fs::create_dir_all(&root).map_err(|e| Error::file(&root, e))?;
    Ok(Bundle { dir, root, id: format!("criuz-bench-{}-{mib}", std::process::id()), criu: criu.to_path_buf() })
}

struct Run {
    checkpoint_s: f64,
    restore_s: f64,
    /// A lazy restore: until the container ran (its pages still arriving).
    running_s: Option<f64>,
    raw: u64,
    stored: u64,
    intact: bool,
}

fn one(cfg: &str, b: &Bundle, criuz: &Path, work: &Path, logs: &Path) -> Result<Run> {
    // What the run before left dirty (runc-dir never syncs its images) is
    // written now, untimed, not during this run's own writes and fsync.
    // SAFETY: sync(2) has no preconditions.
    unsafe { libc::sync() };
    b.start()?;
    let before = b.sum()?;
    let store = work.join(format!("store-{cfg}"));
    let _ = std::fs::remove_dir_all(&store);
    std::fs::create_dir_all(&store).map_err(|e| Error::file(&store, e))?;
    let mut running = None;
    let (checkpoint_s, restore_s, raw, stored) = if cfg == "runc-dir" {
        let img = store.join("img");
        let mut c = b.runc();
        c.args(["checkpoint", "--image-path"]).arg(&img).arg(&b.id);
        let d = timed(c, logs, "runc-checkpoint")?;
        let bytes = proc::dir_bytes(&img);
        let mut r = b.runc();
        r.args(["restore", "-d", "--image-path"]).arg(&img).arg("-b").arg(&b.dir).arg(&b.id);
        let s = timed(r, logs, "runc-restore")?;
        (d, s, bytes, bytes)
    } else if cfg == "runc+zstd" {
        let img = store.join("img");
        let arc = store.join("ckpt.tar.zst");
        let t = Instant::now();
        let mut c = b.runc();
        c.args(["checkpoint", "--image-path"]).arg(&img).arg(&b.id);
        proc::pipeline(vec![c], Src::Null, Dst::Null, logs, "runc-checkpoint")?;
        let mut z = Command::new("zstd");
        z.args(["-1", "-T0", "-c", "-q"]);
        let tar = crate::config::tar_create(&img);
        proc::pipeline(vec![tar, z], Src::Null, Dst::File(arc.clone()), logs, "tar-zstd")?;
        let d = t.elapsed().as_secs_f64();
        let raw = proc::dir_bytes(&img);
        std::fs::remove_dir_all(&img).map_err(|e| Error::file(&img, e))?;
        let t = Instant::now();
        let rimg = store.join("rimg");
        std::fs::create_dir_all(&rimg).map_err(|e| Error::file(&rimg, e))?;
        let mut z = Command::new("zstd");
        z.args(["-d", "-c", "-q"]);
        proc::pipeline(vec![z, crate::config::tar_extract(&rimg)], Src::File(arc.clone()), Dst::Null, logs, "unzstd")?;
        let mut r = b.runc();
        r.args(["restore", "-d", "--image-path"]).arg(&rimg).arg("-b").arg(&b.dir).arg(&b.id);
        proc::pipeline(vec![r], Src::Null, Dst::Null, logs, "runc-restore")?;
        (d, t.elapsed().as_secs_f64(), raw, proc::file_bytes(&arc))
    } else {
        let arc = store.join("ckpt.czr");
        let mut c = Command::new(criuz);
        c.args(["runc", "checkpoint", &b.id, "-o"]).arg(&arc).arg("--root").arg(&b.root);
        if cfg == "criuz-runc-follow" {
            c.args(["--via", "follow"]);
        }
        c.arg("--criu").arg(&b.criu);
        let d = timed(c, logs, "criuz-runc-checkpoint")?;
        let mut r = Command::new(criuz);
        r.args(["runc", "restore", &b.id, "-d", "-i"]).arg(&arc).arg("-b").arg(&b.dir).arg("--root").arg(&b.root);
        r.arg("--json");
        if cfg == "criuz-runc-eager" {
            r.arg("--eager");
        }
        r.arg("--criu").arg(&b.criu);
        let s = timed(r, logs, "criuz-runc-restore")?;
        running = lazy_running(&logs.join("criuz-runc-restore-0.stderr"));
        let raw = {
            use criuz::archive::BlockSource;
            let a = criuz::archive::open(&criuz::io::Location::File(arc.clone()), &Default::default())?;
            a.index().files.iter().map(|f| f.raw_size).sum()
        };
        (d, s, raw, proc::file_bytes(&arc))
    };
    let after = b.sum()?;
    b.delete();
    let _ = std::fs::remove_dir_all(&store);
    Ok(Run { checkpoint_s, restore_s, running_s: running, raw, stored, intact: before == after })
}

/// When a lazy restore's container ran (its `--json` report on stderr).
fn lazy_running(stderr: &Path) -> Option<f64> {
    let text = std::fs::read_to_string(stderr).ok()?;
    let v: serde_json::Value = serde_json::from_str(&text[text.find('{')?..]).ok()?;
    v["lazy"]["running_seconds"].as_f64()
}

/// Every configuration at `mib` with `kind` in the container, `runs`
/// rounds, configurations rotating.
pub fn measure(
    kind: &str,
    mib: u64,
    runs: usize,
    work: &Path,
    workload: &Path,
    criuz: &Path,
    criu: &Path,
) -> Result<Vec<ContainerRow>> {
    for t in ["runc", "busybox", "tar", "zstd"] {
        if criuz::criu::on_path(t).is_none() {
            return Err(Error::Invalid(format!("--containers needs {t} (scripts/setup.sh installs it)")));
        }
    }
    let logs = work.join("logs");
    std::fs::create_dir_all(&logs).map_err(|e| Error::file(&logs, e))?;
    let b = make_bundle(work, workload, kind, mib, criu)?;
    let mut runs_of: Vec<Vec<Run>> = CONFIGS.iter().map(|_| Vec::new()).collect();
    for round in 0..runs {
        for k in 0..CONFIGS.len() {
            let i = (k + round) % CONFIGS.len();
            eprintln!("bench: containers: {kind}, {} MiB, {}, run {}", mib, CONFIGS[i], round + 1);
            let r = one(CONFIGS[i], &b, criuz, work, &logs);
            if r.is_err() {
                b.delete();
            }
            runs_of[i].push(r?);
        }
    }
    let med = |v: Vec<f64>| crate::report::median(&v).unwrap_or(f64::NAN);
    let base = (
        med(runs_of[0].iter().map(|r| r.checkpoint_s).collect()),
        med(runs_of[0].iter().map(|r| r.restore_s).collect()),
    );
    Ok(CONFIGS
        .iter()
        .zip(runs_of)
        .map(|(cfg, rs)| {
            let d: Vec<f64> = rs.iter().map(|r| r.checkpoint_s).collect();
            let s: Vec<f64> = rs.iter().map(|r| r.restore_s).collect();
            let running: Vec<f64> = rs.iter().filter_map(|r| r.running_s).collect();
            let (raw, stored) = rs.last().map(|r| (r.raw, r.stored)).unwrap_or_default();
            ContainerRow {
                config: cfg.to_string(),
                workload: kind.to_string(),
                mib,
                checkpoint_s: med(d.clone()),
                restore_s: med(s.clone()),
                running_s: (!running.is_empty()).then(|| med(running)),
                checkpoint_vs_runc: med(d.clone()) / base.0,
                restore_vs_runc: med(s.clone()) / base.1,
                checkpoint_runs: d,
                restore_runs: s,
                raw_bytes: raw,
                stored_bytes: stored,
                ratio: stored as f64 / raw.max(1) as f64,
                intact: rs.iter().all(|r| r.intact),
            }
        })
        .collect())
}

pub fn table(rows: &[ContainerRow]) -> String {
    let mut s = String::from(
        "| workload | MiB | config | checkpoint s | vs runc | restore s | vs runc | running s | stored MiB | ratio | intact |\n| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |\n",
    );
    for r in rows {
        s += &format!(
            "| {} | {} | {} | {:.2} | {:.2}x | {:.2} | {:.2}x | {} | {:.1} | {:.3} | {} |\n",
            r.workload,
            r.mib,
            r.config,
            r.checkpoint_s,
            r.checkpoint_vs_runc,
            r.restore_s,
            r.restore_vs_runc,
            r.running_s.map_or("-".to_string(), |t| format!("{t:.2}")),
            r.stored_bytes as f64 / (1 << 20) as f64,
            r.ratio,
            if r.intact { "yes" } else { "NO" }
        );
    }
    s
}

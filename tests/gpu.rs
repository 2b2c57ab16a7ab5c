//! CUDA processes through dump and restore, against a fake driver
//! (`tests/fake_cuda/fakecuda.c`, built here with the system's C compiler
//! and loaded through `CRIUZ_LIBCUDA`): CI has no GPU. The fake keeps the
//! driver's state machine and logs every call with the target's state at
//! that moment, so these tests see the order: the suspend happens while no
//! tracer (CRIU) holds the process, the resume once the restored process
//! runs, and every failure resumes what was suspended. Real CRIU, real
//! processes whose own checksums are compared.

// Tests start processes of their own; clippy.toml's rule is for the
// programs criuz runs.
#![allow(clippy::disallowed_methods)]

mod common;
use common::*;
use std::path::{Path, PathBuf};
use std::process::Command;

const FAKE_UUID: &str = "GPU-00112233-4455-6677-8899-aabbccddeeff";
const OTHER_UUID: &str = "GPU-99999999-8888-7777-6666-555555555555";

/// A fake driver's state directory, and criuz run against it.
struct Fake {
    dir: tempfile::TempDir,
}

impl Fake {
    fn new() -> Fake {
        Fake { dir: tempfile::tempdir().unwrap() }
    }

    fn fail(&self, call: &str, on: bool) {
        let p = self.dir.path().join(format!("fail-{call}"));
        if on {
            std::fs::write(p, "").unwrap();
        } else {
            let _ = std::fs::remove_file(p);
        }
    }

    fn devices(&self, lines: &str) {
        std::fs::write(self.dir.path().join("devices"), lines).unwrap();
    }

    /// The state of the CUDA process with FAKE_CUDA_ID `id`.
    fn state(&self, id: &str) -> i32 {
        std::fs::read_to_string(self.dir.path().join(format!("state-{id}")))
            .map_or(0, |s| s.trim().parse().unwrap_or(-1))
    }

    fn set_state(&self, id: &str, state: i32) {
        std::fs::write(self.dir.path().join(format!("state-{id}")), state.to_string()).unwrap();
    }

    /// The calls logged so far, one line each.
    fn log(&self) -> Vec<String> {
        std::fs::read_to_string(self.dir.path().join("log")).unwrap_or_default().lines().map(String::from).collect()
    }

    fn clear_log(&self) {
        let _ = std::fs::remove_file(self.dir.path().join("log"));
    }

    fn criuz(&self, args: &[&str]) -> std::process::Output {
        run(Command::new(env!("CARGO_BIN_EXE_criuz"))
            .args(args)
            .env("CRIUZ_LIBCUDA", fake_cuda_library())
            .env("FAKE_CUDA_DIR", self.dir.path()))
    }
}

/// The calls of `log`, as `call caller`, in order.
fn calls(log: &[String]) -> Vec<String> {
    log.iter()
        .map(|l| {
            let mut w = l.split_whitespace();
            let call = w.next().unwrap_or("");
            let caller = l.split_whitespace().find_map(|f| f.strip_prefix("caller=")).unwrap_or("?");
            format!("{call} {caller}")
        })
        .collect()
}

fn field<'a>(line: &'a str, key: &str) -> &'a str {
    line.split_whitespace().find_map(|f| f.strip_prefix(key)).unwrap_or("")
}

fn ok(out: std::process::Output, what: &str) -> serde_json::Value {
    assert!(out.status.success(), "{what} failed: {}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).unwrap_or(serde_json::Value::Null)
}

fn dump(fake: &Fake, w: &Workload, arc: &Path, extra: &[&str]) -> std::process::Output {
    let pid = w.pid.to_string();
    let mut args = vec!["dump", "-t", &pid, "-o", arc.to_str().unwrap(), "--json"];
    args.extend_from_slice(extra);
    fake.criuz(&args)
}

fn restore(fake: &Fake, arc: &Path, extra: &[&str]) -> std::process::Output {
    let mut args = vec!["restore", "-d", "-i", arc.to_str().unwrap(), "--json"];
    args.extend_from_slice(extra);
    fake.criuz(&args)
}

/// One test's setup: the real-CRIU lock, a fake driver, a directory and
/// the archive's path in it (None where real-CRIU tests skip).
fn setup() -> Option<(std::sync::MutexGuard<'static, ()>, Fake, tempfile::TempDir, PathBuf)> {
    criu()?;
    let g = serial();
    let tmp = tempfile::tempdir().unwrap();
    let arc = tmp.path().join("gpu.czr");
    Some((g, Fake::new(), tmp, arc))
}

/// A workload the fake driver takes for a CUDA process (`FAKE_CUDA_ID=w`).
fn cuda_workload() -> Workload {
    Workload::start(Spec { env: &[("FAKE_CUDA_ID", "w")], ..Default::default() })
}

/// A CUDA workload, dumped (and ended) into `arc`.
fn dumped(fake: &Fake, arc: &Path) -> (Workload, std::collections::BTreeMap<String, String>) {
    let mut w = cuda_workload();
    let before = w.sums();
    ok(dump(fake, &w, arc, &[]), "criuz dump");
    w.reap_original();
    (w, before)
}

#[test]
fn a_cuda_process_is_suspended_before_criu_and_resumed_once_restored() {
    let Some((_g, fake, _tmp, arc)) = setup() else { return };
    let mut w = cuda_workload();
    let before = w.sums();
    let d = ok(dump(&fake, &w, &arc, &[]), "criuz dump");
    // Locked and checkpointed by the dump, while nothing traced the
    // process (CRIU had not seized it) and it ran; nothing resumed.
    let log = fake.log();
    assert_eq!(calls(&log), ["lock dump", "checkpoint dump"], "{log:?}");
    for l in &log {
        assert_eq!(field(l, "tracer="), "0", "called while traced: {l}");
        assert_ne!(field(l, "proc="), "t", "called while stopped: {l}");
        assert_eq!(field(l, "result="), "0", "{l}");
    }
    assert_eq!(field(&log[0], "timeout="), "10000");
    assert_eq!(fake.state("w"), 2);
    // What the archive records, and the report.
    assert_eq!(d["cuda"]["pids"], serde_json::json!([w.pid]));
    assert_eq!(d["cuda"]["driver_version"], 12080);
    assert_eq!(d["cuda"]["gpus"][0]["uuid"], FAKE_UUID);
    assert_eq!(d["cuda"]["gpus"][0]["name"], "Fake GPU");
    assert!(d["cuda"]["suspend_seconds"].as_f64().is_some(), "{d}");
    let inspect = ok(criuz(&["inspect", "--json", arc.to_str().unwrap()]), "inspect");
    let files: Vec<&str> = inspect["files"].as_array().unwrap().iter().filter_map(|f| f["name"].as_str()).collect();
    assert!(files.contains(&"criuz-cuda.json"), "{files:?}");
    // A tree holding CUDA state stores page ids by default (a GPU
    // allocator's freed blocks keep copies of tensors' bytes).
    assert!(inspect["page_id_bytes"].as_u64().unwrap() > 0, "{inspect}");

    w.reap_original();
    fake.clear_log();
    let r = ok(restore(&fake, &arc, &[]), "criuz restore");
    assert!(r["cuda_resume_seconds"].as_f64().is_some(), "{r}");
    // Restored and unlocked by the restore, the restored process running
    // and no longer traced (CRIU was done with it).
    let log = fake.log();
    assert_eq!(calls(&log), ["restore restore", "unlock restore"], "{log:?}");
    assert_eq!(field(&log[0], "tracer="), "0", "{log:?}");
    assert!(matches!(field(&log[0], "proc="), "S" | "R"), "{log:?}");
    assert_eq!(field(&log[0], "pairs="), "0", "{log:?}");
    assert_eq!(fake.state("w"), 0);
    assert_eq!(w.sums(), before, "restored memory differs");
    w.stop();

    // With every zero page, placed and streamed through CRIU (the bench's
    // zeros-placed and zeros-streamed rows): resumed the same way. The
    // process restored again is, as far as the driver knows, checkpointed
    // again.
    for fill in ["place", "stream"] {
        fake.set_state("w", 2);
        fake.clear_log();
        let r = ok(restore(&fake, &arc, &["--fill", fill, "--keep-zero-pages"]), "criuz restore --keep-zero-pages");
        assert_eq!(r["fill"], fill, "{r}");
        assert_eq!(r["zero_pages_skipped"].as_u64(), Some(0), "{r}");
        assert!(r["cuda_resume_seconds"].as_f64().is_some(), "{r}");
        assert_eq!(calls(&fake.log()), ["restore restore", "unlock restore"]);
        assert_eq!(fake.state("w"), 0);
        assert_eq!(w.sums(), before, "memory restored with --fill {fill} differs");
        w.stop();
    }
}

#[test]
fn a_dump_that_leaves_the_process_running_resumes_its_cuda() {
    let Some((_g, fake, _tmp, arc)) = setup() else { return };
    let mut w = cuda_workload();
    let before = w.sums();
    let d = ok(dump(&fake, &w, &arc, &["--leave-running", "--no-ids"]), "criuz dump --leave-running");
    assert_eq!(calls(&fake.log()), ["lock dump", "checkpoint dump", "restore dump", "unlock dump"]);
    assert!(d["cuda"]["resume_seconds"].as_f64().is_some(), "{d}");
    let inspect = ok(criuz(&["inspect", "--json", arc.to_str().unwrap()]), "inspect");
    assert_eq!(inspect["page_id_bytes"].as_u64(), Some(0), "--no-ids: {inspect}");
    assert_eq!(fake.state("w"), 0);
    assert!(w.alive());
    assert_eq!(w.sums(), before);
    w.stop();
}

#[test]
fn every_failure_after_the_suspend_resumes_and_leaves_the_process_running() {
    let Some((_g, fake, _tmp, arc)) = setup() else { return };
    let mut w = cuda_workload();
    let before = w.sums();
    // The driver's checkpoint fails: the lock is undone.
    fake.fail("checkpoint", true);
    let out = dump(&fake, &w, &arc, &[]);
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("cuCheckpointProcessCheckpoint") && err.contains("CUDA_ERROR_UNKNOWN"), "{err}");
    assert_eq!(calls(&fake.log()), ["lock dump", "checkpoint dump", "unlock dump"]);
    fake.fail("checkpoint", false);
    // CRIU fails after the suspend (an option it refuses): restored and unlocked.
    fake.clear_log();
    let out = dump(&fake, &w, &arc, &["--", "--no-such-criu-option"]);
    assert_eq!(out.status.code(), Some(1), "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(calls(&fake.log()), ["lock dump", "checkpoint dump", "restore dump", "unlock dump"]);
    // Nothing published, the process running with its memory and its CUDA.
    assert!(!arc.exists());
    assert_eq!(fake.state("w"), 0);
    assert!(w.alive());
    assert_eq!(w.sums(), before);
    // A process whose CUDA is locked by someone else is not dumped.
    fake.set_state("w", 1);
    let out = dump(&fake, &w, &arc, &[]);
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("locked by someone else"));
    assert!(w.alive() && !arc.exists());
    w.stop();
}

/// criuz killed between the lock and the checkpoint: its guard runs
/// `criuz gpu resume`, which unlocks the process; nothing stays suspended.
#[test]
fn a_dump_killed_after_the_suspend_leaves_nothing_suspended() {
    let Some((_g, fake, _tmp, arc)) = setup() else { return };
    let mut w = cuda_workload();
    let before = w.sums();
    std::fs::write(fake.dir.path().join("slow-checkpoint"), "3").unwrap();
    let pid = w.pid.to_string();
    let mut dump = Command::new(env!("CARGO_BIN_EXE_criuz"))
        .args(["dump", "-t", &pid, "-o", arc.to_str().unwrap()])
        .env("CRIUZ_LIBCUDA", fake_cuda_library())
        .env("FAKE_CUDA_DIR", fake.dir.path())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    wait_for("the lock", std::time::Duration::from_secs(10), || fake.state("w") == 1);
    std::thread::sleep(std::time::Duration::from_millis(300));
    dump.kill().unwrap();
    dump.wait().unwrap();
    wait_for("the guard's resume", std::time::Duration::from_secs(20), || fake.state("w") == 0);
    let log = calls(&fake.log());
    assert_eq!(log.first().map(String::as_str), Some("lock dump"), "{log:?}");
    assert_eq!(log.last().map(String::as_str), Some("unlock gpu"), "{log:?}");
    assert!(!arc.exists());
    assert!(w.alive());
    assert_eq!(w.sums(), before);
    w.stop();
}

#[test]
fn a_restore_checks_the_gpus_before_criu_and_maps_them_on_request() {
    let Some((_g, fake, _tmp, arc)) = setup() else { return };
    let (mut w, before) = dumped(&fake, &arc);
    fake.clear_log();
    // This machine has another GPU: refused before CRIU ran, nothing restored.
    fake.devices("99999999888877776666555555555555 Fake GPU\n");
    let out = restore(&fake, &arc, &[]);
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains(FAKE_UUID) && err.contains("--gpu-map"), "{err}");
    assert!(!w.alive() && fake.log().is_empty());
    // Mapped onto a GPU of another kind: refused.
    fake.devices("99999999888877776666555555555555 Other GPU\n");
    let map = format!("{FAKE_UUID}={OTHER_UUID}");
    let out = restore(&fake, &arc, &["--gpu-map", &map]);
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("same kind"));
    assert!(!w.alive());
    // A map naming a GPU the archive never held is a usage error.
    let out = restore(&fake, &arc, &["--gpu-map", &format!("{OTHER_UUID}={FAKE_UUID}")]);
    assert_eq!(out.status.code(), Some(2));
    // Mapped onto one of the same kind: restored there. Asked for lazily,
    // its pages are placed before it runs (the resume reads them all), and
    // the restore says so.
    fake.devices("99999999888877776666555555555555 Fake GPU\n");
    let out = restore(&fake, &arc, &["--gpu-map", &map, "--lazy"]);
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    let r = ok(out, "criuz restore --gpu-map --lazy");
    assert_eq!(r["fill"], "place", "{r}");
    assert!(r["not_lazy"].as_str().is_some_and(|w| w.contains("CUDA")), "the report says why: {r}");
    assert!(err.contains("placed before the tree ran, not lazily"), "{err}");
    let log = fake.log();
    assert_eq!(calls(&log), ["restore restore", "unlock restore"], "{log:?}");
    assert!(log[0].contains("pairs=1 00112233445566778899aabbccddeeff>99999999888877776666555555555555"), "{log:?}");
    assert_eq!(w.sums(), before);
    w.stop();
}

#[test]
fn a_failed_cuda_resume_kills_the_restored_tree_and_no_driver_is_a_clear_error() {
    let Some((_g, fake, _tmp, arc)) = setup() else { return };
    let (mut w, _) = dumped(&fake, &arc);
    // Without a driver: refused before CRIU, saying what the archive holds.
    let out = run(Command::new(env!("CARGO_BIN_EXE_criuz"))
        .args(["restore", "-d", "-i", arc.to_str().unwrap()])
        .env("CRIUZ_LIBCUDA", "/nonexistent/libcuda.so.1"));
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("CUDA state of process") && err.contains("no CUDA driver"), "{err}");
    assert!(!w.alive());
    // The driver's restore fails: the restored tree is killed, not left
    // running without its GPU state; the next restore succeeds.
    fake.fail("restore", true);
    let out = restore(&fake, &arc, &[]);
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("restored tree killed"));
    wait_for("the restored tree's end", std::time::Duration::from_secs(10), || !w.alive());
    fake.fail("restore", false);
    fake.set_state("w", 2);
    reap_zombies();
    // In the foreground: resumed once the tree runs, then waited for (its
    // root is criuz's child), criuz exiting as the root does.
    let restore = Command::new(env!("CARGO_BIN_EXE_criuz"))
        .args(["restore", "-i", arc.to_str().unwrap()])
        .env("CRIUZ_LIBCUDA", fake_cuda_library())
        .env("FAKE_CUDA_DIR", fake.dir.path())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    wait_for("the resumed tree", std::time::Duration::from_secs(30), || w.alive() && fake.state("w") == 0);
    w.stop();
    let out = restore.wait_with_output().unwrap();
    assert!(out.status.success(), "criuz restore in the foreground: {}", String::from_utf8_lossy(&out.stderr));
}

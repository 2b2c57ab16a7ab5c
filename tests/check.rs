//! `criuz check` against this machine: the CRIU it names is the one a dump
//! runs, CRIU's own check runs, and the CUDA driver is asked (a fake one,
//! `tests/fake_cuda`, as CI has no GPU).

// Tests start processes of their own; clippy.toml's rule is for the
// programs criuz runs.
#![allow(clippy::disallowed_methods)]

mod common;
use common::*;
use std::process::Command;

fn check(args: &[&str], libcuda: &str, cuda_dir: Option<&std::path::Path>) -> std::process::Output {
    let mut cmd = Command::new(CRIUZ);
    cmd.arg("check").args(args).env("CRIUZ_LIBCUDA", libcuda);
    if let Some(dir) = cuda_dir {
        cmd.env("FAKE_CUDA_DIR", dir);
    }
    run(&mut cmd)
}

/// The findings of `--json` output, by topic: (verdict, text) each.
fn findings(out: &std::process::Output) -> Vec<(String, String, String)> {
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).expect("check --json prints JSON");
    let list = report["findings"].as_array().expect("a findings list");
    list.iter()
        .map(|f| {
            let s = |k: &str| f[k].as_str().unwrap_or_default().to_string();
            (s("topic"), s("verdict"), s("text"))
        })
        .collect()
}

fn the<'a>(found: &'a [(String, String, String)], topic: &str) -> &'a (String, String, String) {
    found.iter().find(|f| f.0 == topic).unwrap_or_else(|| panic!("no {topic} finding in {found:?}"))
}

#[test]
fn the_check_names_the_criu_a_dump_runs_and_passes_on_this_machine() {
    let Some(criu) = criu() else { return };
    let _g = serial();
    let version = criuz::criu::locate(None).unwrap().0.version;
    let out = check(&["--json"], "/nonexistent/libcuda.so.1", None);
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    let found = findings(&out);
    let criu_found = the(&found, "CRIU");
    assert_eq!(criu_found.1, "ok", "{criu_found:?}");
    assert!(criu_found.2.starts_with(&format!("{version} at {}", criu.display())), "{criu_found:?}");
    assert_eq!(the(&found, "criu check").1, "ok", "{found:?}");
    let uffd = the(&found, "userfaultfd");
    let expected = if criuz::criu::uffd::lazy_restore_available() { "ok" } else { "warn" };
    assert_eq!(uffd.1, expected, "{uffd:?}");
    let gpu = the(&found, "GPU");
    assert_eq!(gpu.1, "note");
    assert!(gpu.2.contains("no CUDA driver"), "{gpu:?}");
    let cores = the(&found, "cores");
    let n = std::thread::available_parallelism().map_or(1, |n| n.get());
    assert!(cores.2.starts_with(&format!("{n} core(s) for criuz")), "{cores:?}");
    // The same findings, a line each, verdict first.
    let out = check(&[], "/nonexistent/libcuda.so.1", None);
    assert_eq!(out.status.code(), Some(0));
    let text = String::from_utf8_lossy(&out.stdout);
    assert_eq!(text.lines().count(), found.len(), "{text}");
    for line in text.lines() {
        let verdict = line.split_whitespace().next().unwrap_or_default();
        assert!(["ok", "note", "warn", "fail"].contains(&verdict), "{line}");
    }
}

#[test]
fn a_criu_that_is_none_fails_the_check_and_a_wrong_name_is_a_usage_error() {
    if !is_root() {
        return;
    }
    let _g = serial();
    // Runs, but is no CRIU: the check goes on, and fails.
    let out = check(&["--json", "--criu", "/bin/true"], "/nonexistent/libcuda.so.1", None);
    assert_eq!(out.status.code(), Some(1));
    let found = findings(&out);
    let criu_found = the(&found, "CRIU");
    assert_eq!(criu_found.1, "fail");
    assert!(criu_found.2.contains("/bin/true"), "{criu_found:?}");
    assert!(found.iter().all(|f| f.0 != "criu check"), "{found:?}");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("cannot dump or restore"), "{err}");
    // Names nothing at all: refused as a dump refuses it.
    let out = check(&["--criu", "/nonexistent/criu"], "/nonexistent/libcuda.so.1", None);
    assert_eq!(out.status.code(), Some(2), "{}", String::from_utf8_lossy(&out.stderr));
}

#[test]
fn the_check_asks_the_cuda_driver_for_its_version_and_gpus() {
    let _g = serial();
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("devices"), "00112233445566778899aabbccddeeff Fake H100 80GB HBM3\n").unwrap();
    let lib = fake_cuda_library();
    let out = check(&["--json"], lib.to_str().unwrap(), Some(dir.path()));
    let found = findings(&out);
    let gpu = the(&found, "GPU");
    assert_eq!(gpu.1, "ok", "{gpu:?}");
    assert!(gpu.2.contains("CUDA driver 12.8"), "{gpu:?}");
    assert!(gpu.2.contains("Fake H100 80GB HBM3 (GPU-00112233-4455-6677-8899-aabbccddeeff)"), "{gpu:?}");
    // A driver that cannot start (the fake, without its state directory,
    // fails cuInit): GPU processes cannot be dumped, said as such.
    let out = check(&["--json"], lib.to_str().unwrap(), None);
    let gpu = the(&findings(&out), "GPU").clone();
    assert_eq!(gpu.1, "warn", "{gpu:?}");
    assert!(gpu.2.contains("cuInit"), "{gpu:?}");
}

/// The cores a dump and a restore take are those criuz may run on: pinned
/// to one, no worker compresses while CRIU writes.
#[test]
fn the_cores_reported_are_those_criuz_may_run_on() {
    use std::os::unix::process::CommandExt;
    let mut cmd = Command::new(CRIUZ);
    cmd.args(["check", "--json", "--criu", "/bin/true"]).env("CRIUZ_LIBCUDA", "/nonexistent/libcuda.so.1");
    // SAFETY: sched_setaffinity on the child itself, between fork and exec,
    // with a set built on its own stack.
    unsafe {
        cmd.pre_exec(|| {
            let mut set: libc::cpu_set_t = std::mem::zeroed();
            libc::CPU_SET(0, &mut set);
            if libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let out = run(&mut cmd);
    let found = findings(&out);
    let cores = the(&found, "cores");
    assert_eq!(cores.1, "note", "{cores:?}");
    assert!(
        cores.2.starts_with("1 core(s) for criuz") && cores.2.contains("compresses on 0 worker(s) while CRIU writes"),
        "{cores:?}"
    );
}

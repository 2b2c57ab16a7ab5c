//! Real CRIU, runc and podman: `criuz page-server` behind a plain `criu
//! dump --page-server`, `criuz runc checkpoint|restore` by both routes
//! (followed directory, page server), and `criuz podman checkpoint|restore`
//! of a tree sharing its memory, with a changed and a deleted file in the
//! container's root filesystem.
//! Every restore is checked by the workload's own checksum of its memory.
//! The containers run the workload from a busybox root filesystem built
//! here (`scripts/rootfs.sh`; no registry is reachable).

// Tests start processes of their own; clippy.toml's rule is for the
// programs criuz runs.
#![allow(clippy::disallowed_methods)]

mod common;
use common::*;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

const MIB: &str = "64";

fn p(x: &Path) -> &str {
    x.to_str().unwrap()
}

fn ok(out: std::process::Output, what: &str) -> std::process::Output {
    assert!(
        out.status.success(),
        "{what}: {}\n{}",
        String::from_utf8_lossy(&out.stderr),
        String::from_utf8_lossy(&out.stdout)
    );
    out
}

/// runc and podman are part of what CI must test: missing, they fail the
/// test wherever CRIU is required.
fn tool(name: &str) -> PathBuf {
    criuz::criu::on_path(name).unwrap_or_else(|| panic!("{name} is not installed (scripts/setup.sh installs it)"))
}

/// A busybox root filesystem holding the workload and its libraries.
fn rootfs(dir: &Path) {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/rootfs.sh");
    run_ok(Command::new("bash").arg(script).arg(dir).arg(WORKLOAD).stdout(Stdio::null()));
    std::fs::create_dir_all(dir.join("wl")).unwrap();
}

/// Asks the container's workload for its checksum through `kill`.
fn sum(wl: &Path, kill: &mut Command) -> String {
    let f = wl.join("sum-root");
    let _ = std::fs::remove_file(&f);
    run_ok(kill);
    wait_for("the container's checksum", Duration::from_secs(60), || f.exists());
    // pid= is the pid inside the container: 1 before and after.
    std::fs::read_to_string(&f).unwrap()
}

/// A container that is not there, or a bundle that is not: runc fails
/// before it runs CRIU, and the message named a CRIU log that never was
/// (and a restore wrote the whole archive out for CRIU first).
#[test]
fn what_fails_before_criu_runs_names_no_criu_log() {
    let Some(_criu) = criu() else { return };
    tool("runc");
    let tmp = tempfile::tempdir().unwrap();
    let arc = tmp.path().join("c.czr");
    let id = "criuz-test-no-such-container";
    for how in ["page-server", "follow"] {
        let out = criuz(&["runc", "checkpoint", id, "-o", p(&arc), "--via", how]);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{how}: {err}");
        assert!(err.contains("CRIU wrote no log") && !err.contains("log: /"), "{how}: {err}");
        assert!(!arc.exists());
    }
    std::fs::write(&arc, b"").unwrap();
    let missing = tmp.path().join("no-bundle");
    let out = criuz(&["runc", "restore", id, "-i", p(&arc), "-b", p(&missing)]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains("--bundle") && err.contains("no-bundle: no such directory"), "{err}");
}

/// The archive is written inside the images directory, which holds
/// another run's leftovers: the archive takes only what this dump wrote,
/// not a partial copy of itself (it did, as `.ps.czr.criuz-tmp-PID`) nor
/// the leftovers, and says what it left out.
#[test]
fn a_page_server_dump_restores() {
    let Some(criu) = criu() else { return };
    let _g = serial();
    let mut w = Workload::start(Spec { mib: 64, ..Spec::default() });
    let before = w.sums();
    let t = tempfile::tempdir().unwrap();
    let img = t.path().join("img");
    let arc = img.join("ps.czr");
    std::fs::create_dir_all(img.join("old")).unwrap();
    std::fs::write(img.join("core-4194303.img"), b"another dump's").unwrap();
    std::fs::write(img.join("old/inventory.img"), b"another dump's").unwrap();
    let pid = w.pid.to_string();
    let dump = [p(&criu), "dump", "-t", &pid, "-D", p(&img), "-o", "dump.log", "--page-server"];
    let mut args = vec!["page-server", "-D", p(&img), "-o", p(&arc), "--"];
    args.extend(dump);
    args.extend(["--address", "{ip}", "--port", "{port}"]);
    let out = ok(criuz(&args), "criuz page-server");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("(4.2+ protocol)"), "{err}");
    assert!(
        err.contains("left out of the archive") && err.contains("core-4194303.img, old/inventory.img, old"),
        "{err}"
    );
    assert_eq!(std::fs::metadata(&arc).map(|m| std::os::unix::fs::MetadataExt::mode(&m) & 0o777).unwrap(), 0o600);
    w.reap_original();
    let inspect = ok(criuz(&["inspect", "--json", p(&arc)]), "inspect");
    let v: serde_json::Value = serde_json::from_slice(&inspect.stdout).unwrap();
    let names: Vec<&str> = v["files"].as_array().unwrap().iter().map(|f| f["name"].as_str().unwrap()).collect();
    assert!(names.contains(&"pages-65537.img") && names.contains(&"inventory.img"), "{names:?}");
    assert!(!names.iter().any(|n| n.contains("ps.czr") || n.contains("4194303") || n.starts_with("old")), "{names:?}");
    ok(criuz(&["restore", "-d", "-i", p(&arc), "--criu", p(&criu)]), "criuz restore");
    assert_eq!(w.sums(), before, "restored memory differs");
    w.stop();

    // A dump that fails publishes nothing and says so.
    let bad = t.path().join("bad.czr");
    let img2 = t.path().join("img2");
    std::fs::create_dir(&img2).unwrap();
    let out = criuz(&[
        "page-server",
        "-D",
        p(&img2),
        "-o",
        p(&bad),
        "--",
        p(&criu),
        "dump",
        "-t",
        "999999999",
        "-D",
        p(&img2),
        "--page-server",
        "--address",
        "127.0.0.1",
        "--port",
        "{port}",
    ]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(!err.contains("resumed"), "no process to resume: {err}");
    assert!(!bad.exists());
}

/// A plain `criu dump` ends its tree once the page server has every page;
/// the images it writes then join the archive after. An archive that fails
/// there (a full disk) must not lose the process: criuz has the dump leave
/// it stopped and resumes it. The images directory holds 4 MiB that join
/// the archive last (as a large ghost image of a deleted file would; an
/// action script of the dump writes them), on a
/// file system with room for the pages only. A dump with
/// `--tcp-established` is held at CRIU's post-dump hook too, so that CRIU
/// rolls it back: its connection works on (resumed by criuz alone, it got
/// "permission denied"); and a complete one restores with it.
#[test]
fn a_page_server_dump_whose_archive_fails_after_the_pages_resumes_the_process() {
    let Some(criu) = criu() else { return };
    let _g = serial();
    for tcp in [false, true] {
        let spec = Spec { mib: 32, tcp_peer: tcp.then(echo_peer), ..Spec::default() };
        let mut w = Workload::start(spec);
        let before = w.sums();
        assert_eq!(before["root"].contains("tcp=echoed"), tcp, "{before:?}");
        let t = tempfile::tempdir().unwrap();
        let img = t.path().join("img");
        std::fs::create_dir(&img).unwrap();
        // Incompressible: splitmix64's output.
        let filler: Vec<u8> = (0..(4u64 << 20) / 8)
            .flat_map(|i| {
                let mut z = i.wrapping_add(1).wrapping_mul(0x9E37_79B9_7F4A_7C15);
                z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
                z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
                (z ^ (z >> 31)).to_le_bytes()
            })
            .collect();
        // Written into the images directory as the dump begins (its
        // pre-dump action): what was there before is not the dump's.
        let source = t.path().join("filler");
        std::fs::write(&source, filler).unwrap();
        let script = t.path().join("write-filler.sh");
        let copy = format!("cp {} {}", p(&source), p(&img.join("filler.img")));
        std::fs::write(&script, format!("#!/bin/sh\n[ \"$CRTOOLS_SCRIPT_ACTION\" != pre-dump ] || {copy}\n")).unwrap();
        std::fs::set_permissions(&script, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
        // 32 MiB of `mixed` store in 9.8 MiB.
        let small = t.path().join("small");
        std::fs::create_dir(&small).unwrap();
        run_ok(Command::new("mount").args(["-t", "tmpfs", "-o", "size=12m", "tmpfs"]).arg(&small));
        let pid = w.pid.to_string();
        let page_server = |arc: &Path| {
            let mut args = vec!["page-server", "-D", p(&img), "-o", p(arc), "--", p(&criu), "dump", "-t", &pid];
            args.extend(["-D", p(&img), "--page-server", "--address", "{ip}", "--port", "{port}"]);
            args.extend(["--action-script", p(&script)]);
            if tcp {
                args.push("--tcp-established");
            }
            criuz(&args)
        };
        let out = page_server(&small.join("ps.czr"));
        let _ = Command::new("umount").arg(&small).status();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "tcp {tcp}: {err}");
        assert!(err.contains("No space left") && err.contains(&format!("process {pid} runs on")), "{err}");
        assert_eq!(w.sums(), before, "tcp {tcp}: the process (and its connection) must run on, untouched");
        if tcp {
            let arc = t.path().join("ps.czr");
            ok(page_server(&arc), "a page-server dump with room");
            w.reap_original();
            ok(criuz(&["restore", "-d", "-i", p(&arc), "--", "--tcp-established"]), "restore");
            assert_eq!(w.sums(), before, "memory or the TCP connection did not survive the page-server dump");
        }
        w.stop();
    }
}

struct Runc {
    id: String,
    bundle: PathBuf,
    root: tempfile::TempDir,
}

impl Runc {
    /// A bundle under `dir` whose init is the workload (`mib`, `pattern`),
    /// its stdio runc's (nothing CRIU cannot dump).
    fn bundle(dir: &Path, prefix: &str, mib: &str, pattern: &str) -> Runc {
        Self::bundle_with(dir, prefix, &["--mib", mib, "--pattern", pattern])
    }
    /// The same, with the workload's arguments (after `--dir`) given.
    fn bundle_with(dir: &Path, prefix: &str, args: &[&str]) -> Runc {
        let bundle = dir.join("bundle");
        rootfs(&bundle.join("rootfs"));
        run_ok(Command::new(tool("runc")).args(["spec", "-b", p(&bundle)]));
        let cfg = bundle.join("config.json");
        let mut spec: serde_json::Value = serde_json::from_slice(&std::fs::read(&cfg).unwrap()).unwrap();
        spec["process"]["terminal"] = false.into();
        let mut argv = vec!["/bin/criuz-workload", "--dir", "/wl"];
        argv.extend_from_slice(args);
        spec["process"]["args"] = serde_json::json!(argv);
        spec["root"] = serde_json::json!({"path": "rootfs", "readonly": false});
        std::fs::write(&cfg, serde_json::to_vec_pretty(&spec).unwrap()).unwrap();
        Runc { id: format!("{prefix}-{}", std::process::id()), bundle, root: tempfile::tempdir().unwrap() }
    }
    fn cmd(&self) -> Command {
        let mut c = Command::new(tool("runc"));
        c.arg("--root").arg(self.root.path());
        c
    }
    fn wl(&self) -> PathBuf {
        self.bundle.join("rootfs/wl")
    }
    fn sum(&self) -> String {
        sum(&self.wl(), self.cmd().args(["kill", &self.id, "USR1"]))
    }
    fn start(&self, criu: &Path) {
        let _ = std::fs::remove_file(self.wl().join("ready"));
        run_ok(
            self.cmd()
                .arg("--criu")
                .arg(criu)
                .args(["run", "-d", "-b", p(&self.bundle), &self.id])
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::null()),
        );
        wait_for("the container's workload", Duration::from_secs(60), || self.wl().join("ready").exists());
    }
    /// `criuz runc ARGS` in the background, with this runc's root and `criu`.
    fn spawn_criuz(&self, args: &[&str], criu: &Path) -> std::process::Child {
        let mut c = Command::new(CRIUZ);
        c.arg("runc").args(args).args(["--root", p(self.root.path()), "--criu", p(criu)]);
        c.stdin(Stdio::null()).stdout(Stdio::null()).stderr(Stdio::null()).spawn().unwrap()
    }
    /// `criuz runc restore` of `arc` into this bundle, detached.
    fn restore(&self, arc: &Path, extra: &[&str], criu: &Path) -> std::process::Output {
        let head = ["restore", &self.id, "-i", p(arc), "-b", p(&self.bundle), "-d", "--criu", p(criu)];
        self.criuz(&[&head[..], extra].concat())
    }
    fn criuz(&self, args: &[&str]) -> std::process::Output {
        self.criuz_with(args, &[])
    }
    fn criuz_with(&self, args: &[&str], env: &[(&str, &std::ffi::OsStr)]) -> std::process::Output {
        // runc's root before the options after `--`, which go to runc.
        let (head, extra) = args.split_at(args.iter().position(|a| *a == "--").unwrap_or(args.len()));
        let mut c = Command::new(CRIUZ);
        c.args(["runc"]).args(head).args(["--root", p(self.root.path())]).args(extra);
        c.envs(env.iter().copied());
        c.stdin(Stdio::null()).stdout(Stdio::null()).stderr(Stdio::piped());
        c.output().unwrap()
    }
    /// Limits the container's memory and swap together to `bytes`.
    fn limit_memory(&self, bytes: u64) {
        let cfg = self.bundle.join("config.json");
        let mut spec: serde_json::Value = serde_json::from_slice(&std::fs::read(&cfg).unwrap()).unwrap();
        spec["linux"]["resources"]["memory"] = serde_json::json!({"limit": bytes, "swap": bytes});
        std::fs::write(&cfg, serde_json::to_vec_pretty(&spec).unwrap()).unwrap();
    }
    /// Sets an environment variable of the container's init.
    fn set_env(&self, var: &str) {
        let cfg = self.bundle.join("config.json");
        let mut spec: serde_json::Value = serde_json::from_slice(&std::fs::read(&cfg).unwrap()).unwrap();
        spec["process"]["env"].as_array_mut().unwrap().push(var.into());
        std::fs::write(&cfg, serde_json::to_vec_pretty(&spec).unwrap()).unwrap();
    }
}

impl Drop for Runc {
    fn drop(&mut self) {
        let _ = self.cmd().args(["delete", "-f", &self.id]).output();
    }
}

/// A container whose init uses CUDA (the fake driver, tests/fake_cuda, takes
/// it for one by its FAKE_CUDA_ID): suspended before runc freezes it,
/// recorded, and resumed once the restored container runs, under its new
/// host pid; a `--leave-running` checkpoint resumes it at once.
#[test]
fn a_runc_container_using_cuda_is_suspended_and_resumed() {
    let Some(criu) = criu() else { return };
    let _g = serial();
    let t = tempfile::tempdir().unwrap();
    let r = Runc::bundle(t.path(), "criuz-gpu", MIB, "mixed");
    r.set_env("FAKE_CUDA_ID=c");
    r.start(&criu);
    let before = r.sum();
    let fake = tempfile::tempdir().unwrap();
    let lib = fake_cuda_library();
    let env = [("CRIUZ_LIBCUDA", lib.as_os_str()), ("FAKE_CUDA_DIR", fake.path().as_os_str())];
    let log = || std::fs::read_to_string(fake.path().join("log")).unwrap_or_default();
    let calls = || log().lines().map(|l| l.split_whitespace().next().unwrap_or("").to_string()).collect::<Vec<_>>();
    let state = || std::fs::read_to_string(fake.path().join("state-c")).unwrap_or_default().trim().to_string();
    let arc = t.path().join("gpu.czr");
    let out = r.criuz_with(&["checkpoint", &r.id, "-o", p(&arc), "--json", "--criu", p(&criu)], &env);
    let out = ok(out, "criuz runc checkpoint of a CUDA container");
    let json = &out.stderr[out.stderr.iter().position(|&b| b == b'{').unwrap()..];
    let report: serde_json::Value = serde_json::from_slice(json).unwrap();
    assert_eq!(report["cuda"]["pids"].as_array().map(|a| a.len()), Some(1), "{report}");
    assert_eq!(calls(), ["lock", "checkpoint"], "{}", log());
    assert!(log().lines().all(|l| l.contains("tracer=0")), "{}", log());
    assert_eq!(state(), "2");
    // Page ids by default, as for `criuz dump` of a CUDA tree.
    let inspect = criuz(&["inspect", "--json", p(&arc)]);
    let inspect: serde_json::Value = serde_json::from_slice(&inspect.stdout).unwrap();
    assert!(inspect["page_id_bytes"].as_u64().unwrap() > 0, "{inspect}");
    std::fs::remove_file(fake.path().join("log")).unwrap();
    let head = ["restore", &r.id, "-i", p(&arc), "-b", p(&r.bundle), "-d", "--criu", p(&criu), "--json"];
    let out = ok(r.criuz_with(&head, &env), "criuz runc restore of a CUDA container");
    // Lazy by default, but not with CUDA: the driver's resume reads every
    // page at once, so every page is written before the container runs.
    let json = &out.stderr[out.stderr.iter().position(|&b| b == b'{').unwrap()..];
    let report: serde_json::Value = serde_json::from_slice(json).unwrap();
    assert!(report["eager"].is_object(), "{report}");
    assert!(report["not_lazy"].as_str().is_some_and(|w| w.contains("CUDA")), "{report}");
    assert!(String::from_utf8_lossy(&out.stderr).contains("not lazily"));
    assert_eq!(calls(), ["restore", "unlock"], "{}", log());
    assert_eq!(state(), "0");
    assert_eq!(r.sum(), before, "memory after a restore of a CUDA container");
    std::fs::remove_file(fake.path().join("log")).unwrap();
    let out = r.criuz_with(
        &["checkpoint", &r.id, "-o", p(&t.path().join("again.czr")), "--leave-running", "--criu", p(&criu)],
        &env,
    );
    ok(out, "criuz runc checkpoint --leave-running of a CUDA container");
    assert_eq!(calls(), ["lock", "checkpoint", "restore", "unlock"], "{}", log());
    assert_eq!(r.sum(), before);
}

#[test]
fn runc_containers_round_trip_by_both_routes() {
    let Some(criu) = criu() else { return };
    let _g = serial();
    let t = tempfile::tempdir().unwrap();
    // Holding a database's lock: checkpointed with runc's --file-locks, and
    // restored with it unasked (runc's CRIU dropped it without a word).
    let locked = ["--open-file", "/wl/held.dat", "--lock-file", "1"];
    let r = Runc::bundle_with(t.path(), "criuz-test", &[&["--mib", MIB, "--pattern", "mixed"][..], &locked].concat());
    r.start(&criu);
    let before = r.sum();
    let held = r.wl().join("held.dat");
    assert!(lock_holder(&held).is_some(), "the container's init holds no lock on {held:?}");
    for via in ["follow", "page-server"] {
        let arc = t.path().join(format!("{via}.czr"));
        let out =
            r.criuz(&["checkpoint", &r.id, "-o", p(&arc), "--via", via, "--criu", p(&criu), "--", "--file-locks"]);
        ok(out, &format!("criuz runc checkpoint --via {via}"));
        let state = r.cmd().args(["state", &r.id]).output().unwrap();
        assert!(!state.status.success(), "the checkpointed container is gone");
        // runc's own file travels in the archive.
        let inspect = ok(criuz(&["inspect", "--json", p(&arc)]), "inspect");
        assert!(String::from_utf8_lossy(&inspect.stdout).contains("\"descriptors.json\""));
        // The page-server archive comes back as by default, lazily: criuz
        // serves the pages and returns once all are in.
        let (how, args): (_, &[&str]) = if via == "page-server" { ("lazy", &[]) } else { ("eager", &["--eager"]) };
        let out = ok(r.restore(&arc, &[args, &["--json"]].concat(), &criu), &format!("criuz runc restore ({via})"));
        let json = &out.stderr[out.stderr.iter().position(|&b| b == b'{').unwrap()..];
        let report: serde_json::Value = serde_json::from_slice(json).unwrap();
        assert!(report[how].is_object(), "restored {how}: {report}");
        assert_eq!(r.sum(), before, "memory after a restore ({how}) of a {via} checkpoint");
        assert!(lock_holder(&held).is_some(), "restored ({how}), the container's init holds no lock on {held:?}");
    }
    // Encrypted with a passphrase: the wrong one restores nothing (exit 3,
    // no container, lazily or not), the right one restores it intact.
    let (pass, bad, enc) = (t.path().join("pass"), t.path().join("bad"), t.path().join("sealed.czr"));
    std::fs::write(&pass, "correct horse battery staple\n").unwrap();
    std::fs::write(&bad, "incorrect horse\n").unwrap();
    let sealed = ["-o", p(&enc), "--passphrase-file", p(&pass), "--criu", p(&criu), "--", "--file-locks"];
    ok(r.criuz(&[&["checkpoint", &r.id][..], &sealed[..]].concat()), "criuz runc checkpoint (sealed)");
    for lazy in ["--eager", "--lazy"] {
        let out = r.restore(&enc, &[lazy, "--passphrase-file", p(&bad)], &criu);
        assert_eq!(out.status.code(), Some(3), "wrong passphrase, {lazy}: {}", String::from_utf8_lossy(&out.stderr));
        assert!(!r.cmd().args(["state", &r.id]).output().unwrap().status.success(), "{lazy}: no container");
    }
    let out = r.restore(&enc, &["--passphrase-file", p(&pass)], &criu);
    ok(out, "criuz runc restore (sealed)");
    assert_eq!(r.sum(), before, "memory after a restore of a sealed checkpoint");
    // A damaged archive restores nothing: the container stays absent.
    let arc = t.path().join("follow.czr");
    let last_arc = t.path().join("last.czr");
    let last = ["checkpoint", &r.id, "-o", p(&last_arc), "--criu", p(&criu), "--", "--file-locks"];
    ok(r.criuz(&last), "checkpoint");
    let mut bytes = std::fs::read(&last_arc).unwrap();
    let mid = bytes.len() / 2;
    bytes[mid] ^= 0x40;
    std::fs::write(&arc, &bytes).unwrap();
    // Eagerly, and lazily with --verify-first, the damage is found before
    // the container starts; lazily by default, behind it, which kills it.
    for (how, before_start) in [(&["--eager"][..], true), (&["--lazy", "--verify-first"], true), (&["--lazy"], false)] {
        let out = r.restore(&arc, how, &criu);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(3), "{how:?}: {err}");
        assert!(err.contains("checksum"), "{how:?}: {err}");
        assert!(!before_start || !err.contains("killed"), "{how:?}: found before the container started: {err}");
        assert!(!r.cmd().args(["state", &r.id]).output().unwrap().status.success(), "{how:?}: no container is left");
    }
}

/// Runs a restore whose CRIU is made to wait for good: criuz must end it
/// within `limit` (a criuz that waits with CRIU fails the test rather than
/// hang it), exit 1 and say why. Its stderr.
fn ended_for_waiting_for_good(restore: &mut Command, limit: Duration, what: &str) -> String {
    let Some((status, err)) = status_and_stderr_within(restore, limit) else {
        panic!("{what}: criuz still waited with CRIU after {limit:?}")
    };
    assert_eq!(status.code(), Some(1), "{what}: {err}");
    assert!(err.contains("CRIU waited for good") && err.contains("continued (SIGCONT)"), "{what}: {err}");
    err
}

/// A container whose CRIU (runc's) waits for good on a thread that a
/// SIGCONT stopped in a ptrace trap (`tests/sigcont_shim`, preloaded into
/// CRIU at the one moment that hangs CRIU 4.2.1) is not left restoring:
/// criuz ends CRIU with the container's processes, the restore fails
/// saying why and leaves no container, and restored again with CRIU alone
/// the container runs intact. Eagerly and lazily.
#[test]
fn a_container_whose_criu_waits_for_good_is_ended_and_restores_again() {
    let Some(criu) = criu() else { return };
    let _g = serial();
    let t = tempfile::tempdir().unwrap();
    let wrapper = criu_made_to_wait_for_good(t.path(), &criu);
    let r = Runc::bundle(t.path(), "criuz-stuck", "32", "mixed");
    r.start(&criu);
    let before = r.sum();
    let arc = t.path().join("stuck.czr");
    for how in ["--eager", "--lazy"] {
        ok(r.criuz(&["checkpoint", &r.id, "-o", p(&arc), "--force", "--criu", p(&criu)]), "criuz runc checkpoint");
        let head = ["runc", "restore", &r.id, "-i", p(&arc), "-b", p(&r.bundle), "-d", how, "--criu", p(&wrapper)];
        let mut restore = Command::new(CRIUZ);
        restore.args(head).args(["--root", p(r.root.path())]);
        ended_for_waiting_for_good(&mut restore, Duration::from_secs(60), how);
        assert!(!r.cmd().args(["state", &r.id]).output().unwrap().status.success(), "{how}: no container is left");
        ok(r.restore(&arc, &[how], &criu), &format!("criuz runc restore {how}, again"));
        assert_eq!(r.sum(), before, "{how}: memory after the restore run again");
    }
}

/// Restored without --detach, runc waits for the container and exits as
/// its init does: criuz passes that on (it took any non-zero status for a
/// failed restore, exit 1 with CRIU's log), eagerly and lazily.
#[test]
fn a_container_restored_in_the_foreground_ends_criuz_as_its_init_ends() {
    let Some(criu) = criu() else { return };
    let _g = serial();
    let t = tempfile::tempdir().unwrap();
    let r = Runc::bundle(t.path(), "criuz-fg", "32", "mixed");
    r.start(&criu);
    let before = r.sum();
    let arc = t.path().join("fg.czr");
    let pidfile = t.path().join("init.pid");
    for (how, code) in [("--eager", 5), ("--lazy", 6)] {
        ok(r.criuz(&["checkpoint", &r.id, "-o", p(&arc), "--force", "--criu", p(&criu)]), "criuz runc checkpoint");
        let _ = std::fs::remove_file(&pidfile);
        let mut c = Command::new(CRIUZ);
        c.args(["runc", "restore", &r.id, "-i", p(&arc), "-b", p(&r.bundle), how, "--pid-file", p(&pidfile)]);
        c.args(["--root", p(r.root.path()), "--criu", p(&criu)]);
        let child = c.stdin(Stdio::null()).stdout(Stdio::null()).stderr(Stdio::piped()).spawn().unwrap();
        wait_for("the container to run", Duration::from_secs(60), || pidfile.exists());
        assert_eq!(r.sum(), before, "{how}: memory after a foreground restore");
        std::fs::write(r.wl().join("rewrite"), format!("exit {code}")).unwrap();
        run_ok(r.cmd().args(["kill", &r.id, "USR2"]));
        let out = child.wait_with_output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(code), "{how}: {err}");
        assert!(!err.contains("failed"), "{how}: {err}");
        let _ = r.cmd().args(["delete", "-f", &r.id]).output();
        if how == "--eager" {
            r.start(&criu);
        }
    }
}

/// A container whose processes share their memory (a workload that forked
/// two children): checkpointed with each shared page stored once, restored
/// eagerly by default (CRIU keeps the pages shared; lazily each process
/// would get a copy), every process's memory intact.
#[test]
fn a_container_whose_processes_share_memory_stores_it_once_and_restores_it_shared() {
    let Some(criu) = criu() else { return };
    let _g = serial();
    let t = tempfile::tempdir().unwrap();
    let args = ["--mib", "32", "--pattern", "mixed", "--mode", "tree", "--children", "2"];
    let r = Runc::bundle_with(t.path(), "criuz-tree", &args);
    r.start(&criu);
    // Every process's checksum: the root passes the signal on.
    let sums = || -> Vec<String> {
        let files: Vec<PathBuf> =
            ["root", "child1", "child2"].iter().map(|k| r.wl().join(format!("sum-{k}"))).collect();
        for f in &files {
            let _ = std::fs::remove_file(f);
        }
        run_ok(r.cmd().args(["kill", &r.id, "USR1"]));
        wait_for("the container's checksums", Duration::from_secs(60), || files.iter().all(|f| f.exists()));
        files.iter().map(|f| std::fs::read_to_string(f).unwrap()).collect()
    };
    let before = sums();
    let arc = t.path().join("tree.czr");
    ok(r.criuz(&["checkpoint", &r.id, "-o", p(&arc), "--criu", p(&criu)]), "criuz runc checkpoint");
    let inspect: serde_json::Value =
        serde_json::from_slice(&ok(criuz(&["inspect", "--json", p(&arc)]), "inspect").stdout).unwrap();
    assert!(inspect["total"]["blocks_dedup"].as_u64().unwrap() > 0, "{inspect}");
    let out = ok(r.restore(&arc, &["--json"], &criu), "criuz runc restore");
    let json = &out.stderr[out.stderr.iter().position(|&b| b == b'{').unwrap()..];
    let report: serde_json::Value = serde_json::from_slice(json).unwrap();
    assert!(report["eager"].is_object(), "restored eagerly: {report}");
    assert!(report["not_lazy"].as_str().is_some_and(|w| w.contains("share")), "{report}");
    assert_eq!(sums(), before, "every process's memory after the restore");
}

/// A container whose memory is shared (anonymous shared memory a child of
/// its init filled and left, as a database's workers fill its shared
/// buffers): restored lazily, its shared memory is served as the container
/// runs (runc's CRIU holds the container at its pre-resume hook until criuz
/// has registered that memory in every process; before, CRIU restored all
/// of it first), and comes back intact. A damaged block of it, met once the
/// container runs, kills the container: exit 3, no container left.
#[test]
fn a_container_s_shared_memory_is_served_as_it_runs() {
    let Some(criu) = criu() else { return };
    let _g = serial();
    let t = tempfile::tempdir().unwrap();
    let args = ["--mib", MIB, "--pattern", "mixed", "--shared", "1", "--filled-by-child", "1"];
    let r = Runc::bundle_with(t.path(), "criuz-shm", &args);
    r.start(&criu);
    let before = r.sum();
    let arc = t.path().join("shm.czr");
    ok(r.criuz(&["checkpoint", &r.id, "-o", p(&arc), "--criu", p(&criu)]), "criuz runc checkpoint");
    let out = ok(r.restore(&arc, &["--json"], &criu), "criuz runc restore");
    let json = &out.stderr[out.stderr.iter().position(|&b| b == b'{').unwrap()..];
    let report: serde_json::Value = serde_json::from_slice(json).unwrap();
    let served = report["lazy"]["shared_pages"].as_u64().unwrap_or(0);
    assert!(served > 1000, "the shared memory was served as the container ran: {report}");
    assert!(report["lazy"]["eager_pages"].as_u64().unwrap() < 1000, "not written for CRIU first: {report}");
    assert_eq!(r.sum(), before, "memory after a lazy restore of shared memory");
    let _ = r.cmd().args(["delete", "-f", &r.id]).output();
    flip_a_byte_of_the_largest_pages_image(&arc);
    let out = r.restore(&arc, &[], &criu);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(3), "{err}");
    assert!(err.contains("checksum") && err.contains("killed"), "{err}");
    assert!(!r.cmd().args(["state", &r.id]).output().unwrap().status.success(), "no container is left: {err}");
}

/// A container whose memory its bundle's limit cannot hold is refused
/// before runc runs, naming the group and the limit, lazily and eagerly (a
/// lazy restore failed with a CRIU log that never said why, an eager one
/// with "killed by signal 9"); under a limit that holds it, it restores.
#[test]
fn a_container_past_its_memory_limit_is_refused_before_runc_runs() {
    let Some(criu) = criu() else { return };
    let _g = serial();
    let t = tempfile::tempdir().unwrap();
    let r = Runc::bundle(t.path(), "criuz-limit", "48", "random");
    r.start(&criu);
    let before = r.sum();
    let arc = t.path().join("a.czr");
    ok(r.criuz(&["checkpoint", &r.id, "-o", p(&arc), "--criu", p(&criu)]), "criuz runc checkpoint");
    r.limit_memory(32 << 20);
    let dirs = work_dirs();
    for how in ["--lazy", "--eager"] {
        let out = r.restore(&arc, &[how], &criu);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{how}: {err}");
        let config = r.bundle.join("config.json");
        let why = format!("has room for (32 MiB, the limit {} gives it)", config.display());
        assert!(err.contains("its tree needs") && err.contains(&why), "{how}: {err}");
        assert!(!err.contains("log:"), "{how}: refused before runc ran: {err}");
        assert!(!r.cmd().args(["state", &r.id]).output().unwrap().status.success(), "{how}: no container");
        assert_eq!(work_dirs(), dirs, "{how}: no work directory is left");
    }
    r.limit_memory(128 << 20);
    ok(r.restore(&arc, &[], &criu), "criuz runc restore under a limit that holds it");
    assert_eq!(r.sum(), before, "memory after the restore");
}

/// criuz's private work directories on tmpfs.
fn work_dirs() -> std::collections::HashSet<PathBuf> {
    std::fs::read_dir("/dev/shm")
        .map(|d| {
            d.flatten()
                .filter(|e| e.file_name().to_string_lossy().starts_with("criuz-runc-"))
                .map(|e| e.path())
                .collect()
        })
        .unwrap_or_default()
}

/// The first process named `name` below `root` (children through /proc).
fn descendant_named(root: i32, name: &str) -> Option<i32> {
    let mut todo = vec![root];
    while let Some(pid) = todo.pop() {
        for task in std::fs::read_dir(format!("/proc/{pid}/task")).ok()?.flatten() {
            let children = std::fs::read_to_string(task.path().join("children")).unwrap_or_default();
            for c in children.split_whitespace().filter_map(|c| c.parse::<i32>().ok()) {
                if std::fs::read_to_string(format!("/proc/{c}/comm")).is_ok_and(|n| n.trim() == name) {
                    return Some(c);
                }
                todo.push(c);
            }
        }
    }
    None
}

/// A runc checkpoint whose CRIU or criuz is killed mid-dump fails and
/// leaves the container running intact; a runc container restored lazily
/// whose criuz is killed while its pages still arrive is killed by the
/// guard (its cgroup), so it never runs on with zeros where pages had not
/// arrived.
#[test]
fn killed_mid_dump_the_container_runs_on_and_killed_mid_lazy_restore_it_dies() {
    let Some(criu) = criu() else { return };
    let _g = serial();
    let t = tempfile::tempdir().unwrap();
    // Random pages do not compress: the fill takes a while.
    let r = Runc::bundle(t.path(), "criuz-test-lazy", "512", "random");
    r.start(&criu);
    let before = r.sum();
    let shm_before = work_dirs();
    // Killed mid-dump, CRIU or criuz itself: no archive, and the container
    // runs on with its memory (a killed criuz breaks the page server's
    // connection; on the follow route its guard kills CRIU, else runc would
    // finish a checkpoint nobody packs and end it).
    for (via, victim) in [("follow", "criu"), ("page-server", "criu"), ("follow", "criuz"), ("page-server", "criuz")] {
        let out = t.path().join(format!("killed-{via}-{victim}.czr"));
        let mut child = r.spawn_criuz(&["checkpoint", &r.id, "-o", p(&out), "--via", via], &criu);
        // Pages are arriving once the archive's temporary file grows.
        let growing = || {
            std::fs::read_dir(t.path()).unwrap().flatten().any(|e| {
                e.file_name().to_string_lossy().contains("criuz-tmp") && e.metadata().is_ok_and(|m| m.len() > 16 << 20)
            })
        };
        wait_for("the checkpoint's pages", Duration::from_secs(60), growing);
        let pid = if victim == "criuz" {
            child.id() as i32
        } else {
            descendant_named(child.id() as i32, "criu").expect("CRIU")
        };
        // SAFETY: our child, or CRIU under it.
        unsafe { libc::kill(pid, libc::SIGKILL) };
        let status = child.wait().unwrap();
        assert!(!status.success(), "{via}, {victim} killed: the checkpoint failed");
        assert!(!out.exists(), "{via}, {victim} killed: no archive");
        let names: Vec<String> =
            std::fs::read_dir(t.path()).unwrap().flatten().map(|e| e.file_name().to_string_lossy().into()).collect();
        assert!(
            !names.iter().any(|n| n.contains("criuz-tmp")) || victim == "criuz",
            "{via}: temporary file left: {names:?}"
        );
        assert_eq!(r.sum(), before, "{via}, {victim} killed mid-dump: the container runs on intact");
        for e in std::fs::read_dir(t.path()).unwrap().flatten() {
            if e.file_name().to_string_lossy().contains("criuz-tmp") {
                let _ = std::fs::remove_file(e.path());
            }
        }
    }
    let arc = t.path().join("big.czr");
    ok(r.criuz(&["checkpoint", &r.id, "-o", p(&arc), "--criu", p(&criu)]), "criuz runc checkpoint");
    let pidfile = t.path().join("init.pid");
    let mut child = r.spawn_criuz(
        &["restore", &r.id, "-i", p(&arc), "-b", p(&r.bundle), "-d", "--lazy", "--pid-file", p(&pidfile)],
        &criu,
    );
    wait_for("the container to run", Duration::from_secs(60), || pidfile.exists());
    // SAFETY: killing our own child.
    unsafe { libc::kill(child.id() as i32, libc::SIGKILL) };
    child.wait().unwrap();
    let init: i32 = std::fs::read_to_string(&pidfile).unwrap().trim().parse().unwrap();
    let gone = || {
        std::fs::read_to_string(format!("/proc/{init}/stat"))
            .map_or(true, |s| s.rsplit(')').next().unwrap_or("").trim_start().starts_with('Z'))
    };
    wait_for("the guard to kill the container (had every page arrived already?)", Duration::from_secs(10), gone);
    let state = r.cmd().args(["state", &r.id]).output().unwrap();
    assert!(!String::from_utf8_lossy(&state.stdout).contains("\"running\""), "the container is not running");
    // A SIGKILLed criuz cannot remove its work directory.
    for d in work_dirs().difference(&shm_before) {
        let _ = std::fs::remove_dir_all(d);
    }
}

struct Podman {
    name: String,
    image: String,
    wl: tempfile::TempDir,
}

impl Podman {
    fn cmd() -> Command {
        Command::new(tool("podman"))
    }

    /// A container (runc) of `criuz-workload`: a root and two forked
    /// children of `mixed` memory, with `args` added, from a local image of
    /// the test's root filesystem (no registry), once it is ready.
    fn start(dir: &Path, args: &[&str]) -> Podman {
        let root = dir.join("rootfs");
        rootfs(&root);
        static STARTED: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let tag = format!("{}-{}", std::process::id(), STARTED.fetch_add(1, std::sync::atomic::Ordering::Relaxed));
        let pm = Podman {
            name: format!("criuz-test-{tag}"),
            image: format!("localhost/criuz-test:{tag}"),
            wl: tempfile::tempdir().unwrap(),
        };
        let rootfs_tar = dir.join("rootfs.tar");
        run_ok(Command::new("tar").arg("-C").arg(&root).arg("-cf").arg(&rootfs_tar).arg("."));
        run_ok(Self::cmd().args(["import", p(&rootfs_tar), &pm.image]).stdout(Stdio::null()));
        let volume = format!("{}:/wl", p(pm.wl.path()));
        run_ok(
            Self::cmd()
                .args(["run", "-d", "--name", &pm.name, "--runtime", "runc", "--network", "none"])
                .args(["--ulimit", "nofile=1024:1024", "--ulimit", "nproc=1024:1024", "-v", &volume, &pm.image])
                .args(["/bin/criuz-workload", "--dir", "/wl", "--mib", MIB, "--pattern", "mixed"])
                .args(["--mode", "tree", "--children", "2"])
                .args(args)
                .stdout(Stdio::null()),
        );
        wait_for("the container's workload", Duration::from_secs(60), || pm.wl.path().join("ready").exists());
        pm
    }
    /// A container started ([`Self::start`]), its checksums, and its
    /// checkpoint (`podman.czr` in `dir`); the container is removed.
    fn checkpointed(dir: &Path, criu: &Path) -> (Podman, Vec<String>, PathBuf) {
        let pm = Self::start(dir, &[]);
        let before = pm.sums();
        let arc = dir.join("podman.czr");
        pm.checkpoint_and_remove(&arc, criu);
        (pm, before, arc)
    }

    /// Whether podman lists the container (in any state, its storage's
    /// too).
    fn listed(&self) -> bool {
        let all = run_ok(Self::cmd().args(["ps", "-a", "--external", "--format", "{{.Names}}"]));
        String::from_utf8_lossy(&all.stdout).lines().any(|n| n == self.name)
    }

    /// `criuz podman checkpoint` into `arc`, then the container removed.
    fn checkpoint_and_remove(&self, arc: &Path, criu: &Path) {
        ok(criuz(&["podman", "checkpoint", &self.name, "-o", p(arc), "--criu", p(criu)]), "criuz podman checkpoint");
        run_ok(Self::cmd().args(["rm", "-f", &self.name]).stdout(Stdio::null()));
    }

    /// Every process's checksum (a tree of a root and two children: the
    /// root passes the signal on).
    fn sums(&self) -> Vec<String> {
        let files: Vec<PathBuf> =
            ["root", "child1", "child2"].iter().map(|k| self.wl.path().join(format!("sum-{k}"))).collect();
        for f in &files {
            let _ = std::fs::remove_file(f);
        }
        run_ok(Self::cmd().args(["kill", "-s", "USR1", &self.name]));
        wait_for("the container's checksums", Duration::from_secs(60), || files.iter().all(|f| f.exists()));
        files.iter().map(|f| std::fs::read_to_string(f).unwrap()).collect()
    }
}

impl Drop for Podman {
    fn drop(&mut self) {
        let _ = Self::cmd().args(["rm", "-f", &self.name]).output();
        let _ = Self::cmd().args(["rmi", "-f", &self.image]).output();
    }
}

#[test]
fn podman_export_and_import_keep_memory_and_root_filesystem_changes() {
    let Some(criu) = criu() else { return };
    let _g = serial();
    let t = tempfile::tempdir().unwrap();
    // A database's lock: checkpointed with -- --file-locks, and restored
    // with it unasked.
    let pm = Podman::start(t.path(), &["--open-file", "/wl/held.dat", "--lock-file", "1"]);
    run_ok(Podman::cmd().args(["exec", &pm.name, "/bin/sh", "-c", "echo changed > /root/newfile && rm /etc/group"]));
    let before = pm.sums();
    let held = pm.wl.path().join("held.dat");
    assert!(lock_holder(&held).is_some(), "the container's process holds no lock on {held:?}");
    let arc = t.path().join("podman.czr");
    let checkpoint = ["podman", "checkpoint", &pm.name, "-o", p(&arc), "--criu", p(&criu), "--", "--file-locks"];
    ok(criuz(&checkpoint), "criuz podman checkpoint");
    let inspect = ok(criuz(&["inspect", "--json", p(&arc)]), "inspect");
    let listing = String::from_utf8_lossy(&inspect.stdout);
    // Its processes share most of their memory (forked children): page
    // ids by default, each shared page stored once.
    let report: serde_json::Value = serde_json::from_slice(&inspect.stdout).unwrap();
    assert!(report["total"]["blocks_dedup"].as_u64().unwrap() > 0, "{report}");
    for name in
        ["checkpoint/pages-1.img", "checkpoint/inventory.img", "rootfs-diff.tar", "deleted.files", "config.dump"]
    {
        assert!(listing.contains(&format!("\"{name}\"")), "{name} missing from the archive");
    }
    run_ok(Podman::cmd().args(["rm", "-f", &pm.name]).stdout(Stdio::null()));
    ok(criuz(&["podman", "restore", "-i", p(&arc), "--criu", p(&criu)]), "criuz podman restore");
    assert_eq!(pm.sums(), before, "every process's memory after podman import");
    assert!(lock_holder(&held).is_some(), "the restored container holds no lock on {held:?}");
    let new = run_ok(Podman::cmd().args(["exec", &pm.name, "cat", "/root/newfile"]));
    assert_eq!(String::from_utf8_lossy(&new.stdout).trim(), "changed");
    let gone = Podman::cmd().args(["exec", &pm.name, "ls", "/etc/group"]).output().unwrap();
    assert!(!gone.status.success(), "the deleted file came back");
}

/// podman's CRIU runs below conmon, outside criuz's tree, but with the
/// `PATH` criuz gave podman: criuz finds it there and, when it waits for
/// good (a SIGCONT to the tree in its last restore stage), ends it and the
/// half-restored tree as it does runc's, and fails saying so (it waited
/// forever). CRIU's cgroup yard is not left mounted, nor the container
/// podman made for the restore, so the archive restores again.
#[test]
fn a_podman_restore_whose_criu_waits_for_good_is_ended_and_restores_again() {
    let Some(criu) = criu() else { return };
    let _g = serial();
    let t = tempfile::tempdir().unwrap();
    let (pm, before, arc) = Podman::checkpointed(t.path(), &criu);
    let wrapper = criu_made_to_wait_for_good(t.path(), &criu);
    let mut restore = Command::new(CRIUZ);
    restore.args(["podman", "restore", "-i", p(&arc), "--criu", p(&wrapper)]);
    let err = ended_for_waiting_for_good(&mut restore, Duration::from_secs(90), "podman");
    assert!(err.contains("criuz removed the container podman had made for it"), "{err}");
    assert!(!pm.listed(), "no container is left");
    let yards = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
    assert!(!yards.contains(".criu.cgyard."), "CRIU's cgroup yard is left mounted");
    ok(criuz(&["podman", "restore", "-i", p(&arc), "--criu", p(&criu)]), "criuz podman restore, again");
    assert_eq!(pm.sums(), before, "every process's memory after the restore run again");
}

/// A `criuz podman restore` interrupted while podman restores lets podman
/// end first: podman's CRIU runs through criuz's work directory, which,
/// removed under it, failed the restore half-way and left the container
/// podman had made. The message says so, and names no file as staying that
/// went with the work directory (the tar podman imports). Ctrl-C (SIGINT
/// to criuz's whole process group) does not reach podman, which runs in a
/// group of its own: interrupted mid-restore, podman exited at once while
/// its runc finished the restore, leaving a running container podman
/// recorded as "created".
#[test]
fn a_podman_restore_interrupted_lets_podman_end_first() {
    use std::os::unix::process::{CommandExt, ExitStatusExt};
    let Some(criu) = criu() else { return };
    let _g = serial();
    let t = tempfile::tempdir().unwrap();
    let (pm, before, arc) = Podman::checkpointed(t.path(), &criu);
    // SIGINT to criuz alone (as a supervisor sends it), then to its
    // process group (as Ctrl-C does).
    for group in [false, true] {
        let restore = Command::new(CRIUZ)
            .args(["podman", "restore", "-i", p(&arc), "--criu", p(&criu)])
            .stdin(Stdio::null())
            .stderr(Stdio::piped())
            .process_group(0)
            .spawn()
            .unwrap();
        let me = restore.id();
        let podman_runs = || {
            let kids = std::fs::read_to_string(format!("/proc/{me}/task/{me}/children")).unwrap_or_default();
            kids.split_whitespace()
                .any(|k| std::fs::read_to_string(format!("/proc/{k}/comm")).is_ok_and(|c| c.trim() == "podman"))
        };
        wait_for("criuz to run podman", Duration::from_secs(60), podman_runs);
        // SAFETY: signalling our own child, or the group it leads.
        unsafe { libc::kill(if group { -(me as i32) } else { me as i32 }, libc::SIGINT) };
        let out = restore.wait_with_output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.signal(), Some(libc::SIGINT), "group {group}: {err}");
        assert!(err.contains("the podman it ran was let end first"), "group {group}: {err}");
        assert!(!err.contains("stays"), "group {group}: no file is said to stay: {err}");
        assert_eq!(pm.sums(), before, "group {group}: podman's restore ended, and the container runs intact");
        run_ok(Podman::cmd().args(["rm", "-f", &pm.name]).stdout(Stdio::null()));
    }
}

/// Any failed `criuz podman restore` leaves no container behind: podman
/// keeps the one it made for the import ("created"), and a second import
/// of the same export then fails on its id, so criuz removes it, saying
/// so, and the restore runs again. A container that was there before the
/// restore (here the one that restore brought back, on whose name the
/// next import fails) is left as it was.
#[test]
fn a_failed_podman_restore_leaves_no_container_and_runs_again() {
    use std::os::unix::fs::PermissionsExt;
    let Some(criu) = criu() else { return };
    let _g = serial();
    let t = tempfile::tempdir().unwrap();
    let (pm, before, arc) = Podman::checkpointed(t.path(), &criu);
    // podman asks CRIU for its version through CRIU's RPC mode (`criu
    // swrk`) once it has made the container: a CRIU that fails there.
    let failing = t.path().join("criu");
    let script = format!("#!/bin/sh\n[ \"$1\" = swrk ] && exit 1\nexec {} \"$@\"\n", criu.display());
    std::fs::write(&failing, script).unwrap();
    std::fs::set_permissions(&failing, std::fs::Permissions::from_mode(0o755)).unwrap();
    let out = criuz(&["podman", "restore", "-i", p(&arc), "--criu", p(&failing)]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("podman container restore --import failed"), "{err}");
    assert!(err.contains("criuz removed the container podman had made for it"), "{err}");
    assert!(!pm.listed(), "no container is left");
    ok(criuz(&["podman", "restore", "-i", p(&arc), "--criu", p(&criu)]), "criuz podman restore, again");
    assert_eq!(pm.sums(), before, "every process's memory after the restore run again");
    let out = criuz(&["podman", "restore", "-i", p(&arc), "--criu", p(&criu)]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "a second import beside the first fails: {err}");
    assert!(!err.contains("removed the container"), "{err}");
    assert_eq!(pm.sums(), before, "the container that was there runs on, untouched");
}

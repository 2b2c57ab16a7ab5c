//! Shared harness for tests that checkpoint and restore real processes.
//!
//! Real-CRIU tests need root and CRIU >= 4. As root (and always under CI) a
//! missing CRIU fails the test; a developer's non-root run skips and says so.
#![allow(dead_code)]

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

pub const CRIUZ: &str = env!("CARGO_BIN_EXE_criuz");
pub const WORKLOAD: &str = env!("CARGO_BIN_EXE_criuz-workload");

static SERIAL: Mutex<()> = Mutex::new(());

/// One real-CRIU test at a time: they are heavy and share the pid space.
pub fn serial() -> MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

pub fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions.
    unsafe { libc::geteuid() == 0 }
}

/// The CRIU to test with, or None when this run may skip (non-root, not CI).
pub fn criu() -> Option<PathBuf> {
    let in_ci = std::env::var_os("CI").is_some();
    if !is_root() && !in_ci {
        eprintln!("SKIP: real-CRIU test needs root (CI runs it as root)");
        return None;
    }
    match criuz::criu::locate(None) {
        Ok((c, _)) => Some(c.path),
        Err(e) => panic!("real-CRIU tests must run here (root/CI) but CRIU is unusable: {e}"),
    }
}

/// Restored trees are re-parented to us rather than to an init that may not reap.
pub fn become_subreaper() {
    // SAFETY: prctl with constant arguments.
    unsafe { libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) };
}

pub struct Workload {
    pub dir: tempfile::TempDir,
    pub child: Option<Child>,
    pub pid: i32,
    pub roles: Vec<String>,
    /// Pids of the tree, as last reported.
    pub pids: Vec<i32>,
}

pub struct Spec<'a> {
    pub mib: usize,
    pub pattern: &'a str,
    pub mode: &'a str,
    pub children: usize,
    pub open_file: bool,
    /// Hold a POSIX write lock on all of the open file.
    pub lock_file: bool,
    pub extra_maps: bool,
    /// The memory is shared anonymous memory instead of private.
    pub shared: bool,
    /// Hold an established TCP connection to this address.
    pub tcp_peer: Option<String>,
    /// Tree mode: children write identical pages.
    pub same_children: bool,
    /// More environment for the workload.
    pub env: &'a [(&'a str, &'a str)],
    /// A cgroup the workload starts in (its memory charged there from the
    /// first page).
    pub group: Option<&'a LimitGroup>,
    /// A descriptor this high held open (/dev/null), the open-files limit
    /// raised for it: a process that has used many descriptors.
    pub high_fd: Option<i32>,
    /// MiB of private huge-page memory (reserve the pages first).
    pub huge_mib: usize,
    /// That huge-page memory is shared (MAP_SHARED), not private.
    pub huge_shared: bool,
    /// The (shared) memory is written by a child that then exits, and
    /// writes its checksum to DIR/sum-filler first.
    pub filled_by_child: bool,
    /// The memory is asked to be transparent huge pages (MADV_HUGEPAGE).
    pub thp: bool,
    /// Standard output (else /dev/null).
    pub stdout: Option<&'a std::os::fd::OwnedFd>,
}

impl Default for Spec<'_> {
    fn default() -> Self {
        Spec {
            mib: 32,
            pattern: "mixed",
            mode: "single",
            children: 2,
            open_file: false,
            lock_file: false,
            extra_maps: false,
            shared: false,
            tcp_peer: None,
            same_children: false,
            env: &[],
            group: None,
            high_fd: None,
            huge_mib: 0,
            huge_shared: false,
            filled_by_child: false,
            thp: false,
            stdout: None,
        }
    }
}

/// One field of `pid`'s `/proc/PID/smaps_rollup` (`name` with its colon), KiB.
pub fn rollup_kib(pid: i32, name: &str) -> u64 {
    let rollup = std::fs::read_to_string(format!("/proc/{pid}/smaps_rollup")).unwrap();
    let kib = rollup.lines().find_map(|l| l.strip_prefix(name)?.split_whitespace().next()?.parse().ok());
    kib.unwrap_or_else(|| panic!("no {name} in the smaps_rollup of {pid}"))
}

/// The state letter of /proc/PID/stat (R, S, T, Z...), if the pid exists.
pub fn process_state(pid: i32) -> Option<char> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    stat.rsplit_once(')')?.1.trim_start().chars().next()
}

pub fn wait_for(what: &str, timeout: Duration, mut f: impl FnMut() -> bool) {
    let t = Instant::now();
    while !f() {
        assert!(t.elapsed() < timeout, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

impl Workload {
    pub fn start(spec: Spec) -> Workload {
        become_subreaper();
        let dir = tempfile::Builder::new().prefix("criuz-wl-").tempdir().unwrap();
        let mut cmd = Command::new(WORKLOAD);
        cmd.args(["--dir", dir.path().to_str().unwrap()])
            .args(["--mib", &spec.mib.to_string(), "--pattern", spec.pattern, "--mode", spec.mode])
            .args(["--children", &spec.children.to_string()])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        if spec.extra_maps {
            cmd.args(["--extra-maps", "1"]);
        }
        if spec.shared {
            cmd.args(["--shared", "1"]);
        }
        if spec.same_children {
            cmd.args(["--same-children", "1"]);
        }
        if spec.filled_by_child {
            cmd.args(["--filled-by-child", "1"]);
        }
        if let Some(peer) = &spec.tcp_peer {
            cmd.args(["--tcp-peer", peer]);
        }
        if spec.open_file {
            cmd.args(["--open-file", dir.path().join("held-open.dat").to_str().unwrap()]);
        }
        if spec.lock_file {
            cmd.args(["--lock-file", "1"]);
        }
        if let Some(fd) = spec.stdout {
            cmd.stdout(Stdio::from(fd.try_clone().unwrap()));
        }
        cmd.envs(spec.env.iter().copied());
        if let Some(group) = spec.group {
            group.join_on_exec(&mut cmd);
        }
        if spec.thp {
            cmd.args(["--thp", "1"]);
        }
        if spec.huge_mib > 0 {
            cmd.args(["--huge-mib", &spec.huge_mib.to_string()]);
            if spec.huge_shared {
                cmd.args(["--huge-shared", "1"]);
            }
        }
        if let Some(fd) = spec.high_fd {
            use std::os::unix::process::CommandExt;
            let limit = fd as u64 + 64;
            with_rlimit(&mut cmd, libc::RLIMIT_NOFILE, limit, limit);
            // SAFETY: between fork and exec only open(2), dup2(2) and
            // close(2), which are async-signal-safe, on a constant path.
            unsafe {
                cmd.pre_exec(move || {
                    let null = libc::open(c"/dev/null".as_ptr(), libc::O_RDONLY);
                    if null < 0 || libc::dup2(null, fd) != fd {
                        return Err(std::io::Error::last_os_error());
                    }
                    libc::close(null);
                    Ok(())
                });
            }
        }
        let child = cmd.spawn().expect("start workload");
        let ready = dir.path().join("ready");
        wait_for("workload ready", Duration::from_secs(60), || ready.exists());
        let pid: i32 = std::fs::read_to_string(&ready).unwrap().trim().parse().unwrap();
        let mut roles = vec!["root".to_string()];
        if spec.mode == "tree" {
            roles.extend((1..=spec.children).map(|k| format!("child{k}")));
        }
        Workload { dir, child: Some(child), pid, roles, pids: vec![pid] }
    }

    /// Asks every process for the checksum of its own memory.
    pub fn sums(&mut self) -> BTreeMap<String, String> {
        match self.sums_within(Duration::from_secs(60)) {
            Ok(sums) => sums,
            Err(role) => panic!("timed out waiting for checksum from {role}"),
        }
    }

    /// [`sums`](Self::sums), each process given at most `limit` to answer:
    /// the role of the first that did not (a process that runs but does not
    /// answer is stuck).
    pub fn sums_within(&mut self, limit: Duration) -> Result<BTreeMap<String, String>, String> {
        for r in &self.roles {
            let _ = std::fs::remove_file(self.dir.path().join(format!("sum-{r}")));
        }
        // SAFETY: signalling our own workload.
        assert_eq!(unsafe { libc::kill(self.pid, libc::SIGUSR1) }, 0, "workload {} is not running", self.pid);
        let mut out = BTreeMap::new();
        for r in &self.roles {
            let p = self.dir.path().join(format!("sum-{r}"));
            let t = Instant::now();
            while !p.exists() {
                if t.elapsed() > limit {
                    return Err(r.clone());
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            out.insert(r.clone(), std::fs::read_to_string(&p).unwrap());
        }
        self.pids = out
            .values()
            .filter_map(|l| l.split_whitespace().find_map(|w| w.strip_prefix("pid=")).and_then(|p| p.parse().ok()))
            .collect();
        Ok(out)
    }

    /// Has every process rewrite `percent`% of its pages with random bytes.
    pub fn rewrite(&mut self, percent: f64, seed: u64) {
        std::fs::write(self.dir.path().join("rewrite"), format!("{percent} {seed}")).unwrap();
        for r in &self.roles {
            let _ = std::fs::remove_file(self.dir.path().join(format!("rewrote-{r}")));
        }
        // SAFETY: signalling our own workload.
        assert_eq!(unsafe { libc::kill(self.pid, libc::SIGUSR2) }, 0, "workload {} is not running", self.pid);
        for r in &self.roles {
            let p = self.dir.path().join(format!("rewrote-{r}"));
            wait_for(&format!("rewrite in {r}"), Duration::from_secs(60), || p.exists());
        }
    }

    /// After `criu dump` killed the original: reap the whole tree so its pids
    /// are free for the restore.
    pub fn reap_original(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.wait();
        }
        let pids = self.pids.clone();
        wait_for("the checkpointed tree to be gone", Duration::from_secs(20), || {
            // SAFETY: non-blocking reap of zombies re-parented to us.
            while unsafe { libc::waitpid(-1, std::ptr::null_mut(), libc::WNOHANG) } > 0 {}
            pids.iter().all(|p| !Path::new(&format!("/proc/{p}")).exists())
        });
    }

    /// Kills the workload's root (a restored one too) and waits until its
    /// pids are free again.
    pub fn kill_and_reap(&mut self) {
        // SAFETY: signalling our own workload.
        unsafe { libc::kill(self.pid, libc::SIGKILL) };
        self.reap_original();
    }

    pub fn alive(&self) -> bool {
        process_state(self.pid).is_some_and(|s| s != 'Z')
    }

    pub fn stop(&mut self) {
        // SAFETY: our own workload (original or restored); SIGCONT lets a
        // process left stopped (a failed test of a dump) act on the SIGTERM.
        unsafe {
            libc::kill(self.pid, libc::SIGTERM);
            libc::kill(self.pid, libc::SIGCONT);
        }
        if let Some(mut c) = self.child.take() {
            let _ = c.wait();
        } else {
            let mut st = 0;
            // SAFETY: reaping a child we were made subreaper of; ECHILD is fine.
            unsafe { libc::waitpid(self.pid, &mut st, 0) };
        }
        // Reap any children re-parented to us.
        // SAFETY: non-blocking reap of any zombie children.
        while unsafe { libc::waitpid(-1, std::ptr::null_mut(), libc::WNOHANG) } > 0 {}
    }
}

impl Drop for Workload {
    fn drop(&mut self) {
        if self.alive() {
            self.stop();
        }
        // A test that failed with its root gone (OOM-killed, say) would
        // leave the tree's other processes running: ended by pid, each only
        // while it is still this workload (its command names our dir).
        let dir = self.dir.path().as_os_str().as_encoded_bytes().to_vec();
        for &pid in &self.pids {
            let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
            if cmdline.windows(dir.len()).any(|w| w == dir.as_slice()) {
                // SAFETY: signalling a process of this workload (checked above).
                unsafe { libc::kill(pid, libc::SIGKILL) };
            }
        }
    }
}

/// The fake CUDA driver of `tests/fake_cuda` (see there), built once per
/// test binary with the system's C compiler.
pub fn fake_cuda_library() -> PathBuf {
    static BUILT: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    BUILT.get_or_init(|| shared_library("tests/fake_cuda/fakecuda.c", "libfakecuda.so")).clone()
}

/// The shim of `tests/sigcont_shim` (see there) that makes CRIU wait for
/// good, built once per test binary.
pub fn sigcont_shim_library() -> PathBuf {
    static BUILT: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    BUILT
        .get_or_init(|| shared_library("tests/sigcont_shim/sigcont_after_seize.c", "libsigcont_after_seize.so"))
        .clone()
}

/// A `criu` in `dir` that runs `real` with the shim of `tests/sigcont_shim`
/// preloaded: CRIU 4.2.1 then waits for good in its last restore stage.
pub fn criu_made_to_wait_for_good(dir: &Path, real: &Path) -> PathBuf {
    use std::os::unix::fs::PermissionsExt;
    let wrapper = dir.join("criu");
    let script = format!("#!/bin/sh\nLD_PRELOAD={} exec {} \"$@\"\n", sigcont_shim_library().display(), real.display());
    std::fs::write(&wrapper, script).unwrap();
    std::fs::set_permissions(&wrapper, std::fs::Permissions::from_mode(0o755)).unwrap();
    wrapper
}

/// Runs `cmd` (stdin and stdout null, stderr read) for at most `limit`:
/// its status and stderr, or `None` where it still ran then (it is killed,
/// and its stderr, which what it started may still hold, is not read).
pub fn status_and_stderr_within(cmd: &mut Command, limit: Duration) -> Option<(std::process::ExitStatus, String)> {
    let mut child = cmd.stdin(Stdio::null()).stdout(Stdio::null()).stderr(Stdio::piped()).spawn().unwrap();
    let mut stderr = child.stderr.take().unwrap();
    let reader = std::thread::spawn(move || {
        let mut text = String::new();
        let _ = std::io::Read::read_to_string(&mut stderr, &mut text);
        text
    });
    let t = std::time::Instant::now();
    while child.try_wait().unwrap().is_none() && t.elapsed() < limit {
        std::thread::sleep(Duration::from_millis(20));
    }
    let ran_on = child.try_wait().unwrap().is_none();
    let _ = child.kill();
    let status = child.wait().unwrap();
    (!ran_on).then(|| (status, reader.join().unwrap()))
}

/// `src` (from the project root) built as the shared library `name` in
/// the test target's scratch directory, with the system's C compiler.
fn shared_library(src: &str, name: &str) -> PathBuf {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join(src);
    let out = Path::new(env!("CARGO_TARGET_TMPDIR")).join(name);
    let st =
        Command::new("cc").args(["-shared", "-fPIC", "-O1", "-Wall", "-o"]).arg(&out).arg(&src).arg("-ldl").status();
    assert!(st.is_ok_and(|s| s.success()), "building {} with cc failed", src.display());
    out
}

/// Lets the command take SIGINT the way a terminal user's criuz does: a
/// test run in the background of a shell without job control inherits
/// SIGINT ignored, and so would the command (which keeps it ignored).
pub fn takes_sigint(cmd: &mut Command) -> &mut Command {
    use std::os::unix::process::CommandExt;
    // SAFETY: between fork and exec only signal(2), which is async-signal-safe.
    unsafe {
        cmd.pre_exec(|| {
            libc::signal(libc::SIGINT, libc::SIG_DFL);
            Ok(())
        })
    }
}

pub fn run(cmd: &mut Command) -> std::process::Output {
    cmd.output().expect("run command")
}

pub fn run_ok(cmd: &mut Command) -> std::process::Output {
    let out = run(cmd);
    assert!(
        out.status.success(),
        "{:?} failed: {}\n{}",
        cmd,
        String::from_utf8_lossy(&out.stderr),
        String::from_utf8_lossy(&out.stdout)
    );
    out
}

pub fn criu_dump(criu: &Path, pid: i32, dir: &Path, extra: &[&str]) {
    std::fs::create_dir_all(dir).unwrap();
    let out = run(Command::new(criu)
        .args(["dump", "-t", &pid.to_string(), "-D"])
        .arg(dir)
        .args(["-o", "dump.log"])
        .args(extra));
    assert!(out.status.success(), "criu dump failed:\n{}", log_tail(&dir.join("dump.log")));
}

pub fn criu_restore(criu: &Path, dir: &Path) {
    let out = run(Command::new(criu).args(["restore", "-d", "-D"]).arg(dir).args(["-o", "restore.log"]));
    assert!(out.status.success(), "criu restore failed:\n{}", log_tail(&dir.join("restore.log")));
}

pub fn log_tail(p: &Path) -> String {
    let s = std::fs::read_to_string(p).unwrap_or_default();
    s.lines().rev().take(15).collect::<Vec<_>>().into_iter().rev().collect::<Vec<_>>().join("\n")
}

/// Sets `resource` (an `RLIMIT_*`) of the process `cmd` starts to `soft`
/// (`hard`), between fork and exec, as `ulimit` would.
pub fn with_rlimit(cmd: &mut Command, resource: libc::__rlimit_resource_t, soft: u64, hard: u64) -> &mut Command {
    // SAFETY: only setrlimit(2), async-signal-safe, between fork and exec.
    unsafe {
        std::os::unix::process::CommandExt::pre_exec(cmd, move || {
            let lim = libc::rlimit { rlim_cur: soft, rlim_max: hard };
            if libc::setrlimit(resource, &lim) == 0 {
                Ok(())
            } else {
                Err(std::io::Error::last_os_error())
            }
        })
    }
}

/// Flips one byte near the end of a block halfway through the archive's
/// largest pages image (a process's shared memory, where its private
/// memory is small).
#[allow(dead_code)]
pub fn flip_a_byte_of_the_largest_pages_image(arc: &Path) {
    use criuz::archive::BlockSource;
    let a = criuz::archive::open(&criuz::io::Location::File(arc.to_path_buf()), &Default::default()).unwrap();
    let pages = a.index().files.iter().filter(|f| f.name.starts_with("pages-")).max_by_key(|f| f.raw_size).unwrap();
    let b = pages.blocks[pages.blocks.len() / 2];
    let mut bytes = std::fs::read(arc).unwrap();
    bytes[(b.offset + u64::from(b.record_len) - 100) as usize] ^= 0x40;
    std::fs::write(arc, &bytes).unwrap();
}

pub fn criuz(args: &[&str]) -> std::process::Output {
    run(Command::new(CRIUZ).args(args))
}

/// Rewrites an archive's index through `edit` as a careful forger would: the
/// sizes and file checks recomputed from the (edited) block table, and the
/// index's own checks and the trailer redone. Only a reader that compares
/// the index with the records themselves can tell.
pub fn forge_index(bytes: &[u8], edit: impl FnOnce(&mut criuz::format::Index)) -> Vec<u8> {
    use criuz::format::*;
    let header = Header::decode(bytes[..HEADER_LEN].try_into().unwrap()).unwrap();
    let at = bytes.len() - TRAILER_LEN;
    let Trailer { index_offset: ioff, index_len: ilen } =
        Trailer::decode(bytes[at..].try_into().unwrap(), at as u64).unwrap();
    let rec = &bytes[ioff as usize..(ioff + ilen) as usize];
    let IndexFixed { count, body_len } = IndexFixed::decode(rec[..INDEX_FIXED].try_into().unwrap(), ioff).unwrap();
    let body = &rec[INDEX_FIXED..INDEX_FIXED + body_len as usize];
    let check = u64::from_le_bytes(rec[INDEX_FIXED + body.len()..].try_into().unwrap());
    let mut index = decode_index_body(body, check, count, ioff + INDEX_FIXED as u64, header.flags).unwrap();
    edit(&mut index);
    for f in &mut index.files {
        let mut h = xxhash_rust::xxh3::Xxh3::new();
        f.table.iter().for_each(|t| h.update(&t.header.data_check.to_le_bytes()));
        f.file_check = h.digest();
        f.raw_size = f.table.iter().map(|t| u64::from(t.header.raw_len)).sum();
    }
    let mut out = bytes[..ioff as usize].to_vec();
    out.extend_from_slice(&encode_index_and_trailer(&index, ioff, header.flags));
    out
}

/// Swaps two full blocks of the first page image in the index (references
/// and table entries): each still points at a real block whose header
/// matches its entry, but the file's pages come out in the wrong order.
pub fn swap_indexed_blocks(index: &mut criuz::format::Index) {
    let f = index.files.iter_mut().find(|f| f.name.starts_with("pages-") && f.blocks.len() >= 2).expect("a page image");
    let (i, j) = (0, 1);
    assert_eq!(f.blocks[i].raw_len, f.blocks[j].raw_len, "two full blocks");
    f.blocks.swap(i, j);
    f.table.swap(i, j);
}

/// Reaps exited processes adopted by this (subreaper) test process: a
/// restore that fails mid-way leaves the tree CRIU had begun to us, and a
/// zombie keeps its pid taken from the next restore.
pub fn reap_zombies() {
    let mut status = 0;
    // SAFETY: waitpid with WNOHANG only collects exited children of ours.
    while unsafe { libc::waitpid(-1, &mut status, libc::WNOHANG) } > 0 {}
}

/// A TCP peer that echoes every line back, on the connection a workload
/// holds through checkpoint and restore; its address.
pub fn echo_peer() -> String {
    use std::io::{BufRead, Write};
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    std::thread::spawn(move || {
        let (s, _) = listener.accept().unwrap();
        let mut r = std::io::BufReader::new(s.try_clone().unwrap());
        let mut w = s;
        let mut line = String::new();
        while r.read_line(&mut line).map(|n| n > 0).unwrap_or(false) {
            if w.write_all(line.as_bytes()).is_err() {
                break;
            }
            line.clear();
        }
    });
    addr
}

/// A cgroup of the test's own, for one controller (`pids`, `memory`): in
/// cgroup v1's hierarchy of that controller, or a cgroup v2 mount that has
/// it. Removed on drop (once its processes are gone).
pub struct LimitGroup {
    pub dir: PathBuf,
    v2: bool,
}

impl LimitGroup {
    pub fn new(controller: &str) -> LimitGroup {
        let v1 = Path::new("/sys/fs/cgroup").join(controller);
        let v2 = Path::new("/sys/fs/cgroup");
        let (base, is_v2) = if v1.join("cgroup.procs").exists() {
            (v1, false)
        } else {
            let controllers = std::fs::read_to_string(v2.join("cgroup.controllers")).unwrap_or_default();
            assert!(controllers.split_whitespace().any(|c| c == controller), "no {controller} cgroup controller here");
            let _ = std::fs::write(v2.join("cgroup.subtree_control"), format!("+{controller}"));
            (v2.to_path_buf(), true)
        };
        let dir = base.join(format!("criuz-test-{controller}-{}", std::process::id()));
        std::fs::create_dir(&dir).unwrap();
        LimitGroup { dir, v2: is_v2 }
    }

    /// Sets the limit in `v1_file` or `v2_file` (by the hierarchy).
    pub fn limit(&self, v1_file: &str, v2_file: &str, value: u64) {
        let file = self.dir.join(if self.v2 { v2_file } else { v1_file });
        std::fs::write(&file, value.to_string()).unwrap_or_else(|e| panic!("{}: {e}", file.display()));
    }

    /// Limits a memory group to `bytes`, swap included: v1 bounds memory
    /// and swap together (never below the memory limit: raised first,
    /// lowered last), v2 swap alone (none). False where the group cannot
    /// bound swap and the machine has some: the caller skips.
    pub fn limit_memory(&self, bytes: u64) -> bool {
        let swap = ["memory.memsw.limit_in_bytes", "memory.swap.max"].into_iter().find(|f| self.dir.join(f).exists());
        match swap {
            Some("memory.swap.max") => std::fs::write(self.dir.join("memory.swap.max"), "0").unwrap(),
            Some(memsw) => {
                let _ = std::fs::write(self.dir.join(memsw), bytes.to_string());
                self.limit("memory.limit_in_bytes", "memory.max", bytes);
                std::fs::write(self.dir.join(memsw), bytes.to_string()).unwrap();
                return true;
            }
            None if !std::fs::read_to_string("/proc/meminfo").unwrap().contains("SwapTotal:              0 kB") => {
                return false
            }
            None => {}
        }
        self.limit("memory.limit_in_bytes", "memory.max", bytes);
        true
    }

    /// `cmd` starts in the group.
    pub fn join_on_exec(&self, cmd: &mut Command) {
        use std::os::unix::process::CommandExt;
        let procs =
            std::ffi::CString::new(self.dir.join("cgroup.procs").into_os_string().into_encoded_bytes()).unwrap();
        // SAFETY: between fork and exec only open(2), write(2) and close(2),
        // which are async-signal-safe, on a path made before the fork.
        unsafe {
            cmd.pre_exec(move || {
                let fd = libc::open(procs.as_ptr(), libc::O_WRONLY);
                let joined = fd >= 0 && libc::write(fd, b"0".as_ptr().cast(), 1) == 1;
                libc::close(fd);
                if joined {
                    Ok(())
                } else {
                    Err(std::io::Error::last_os_error())
                }
            })
        };
    }

    /// The kernel's count of OOM kills in the group.
    pub fn oom_kills(&self) -> u64 {
        let file = if self.v2 { "memory.events" } else { "memory.oom_control" };
        let text = std::fs::read_to_string(self.dir.join(file)).unwrap_or_default();
        text.lines().find_map(|l| l.strip_prefix("oom_kill ")?.trim().parse().ok()).unwrap_or(0)
    }
}

impl Drop for LimitGroup {
    fn drop(&mut self) {
        for _ in 0..500 {
            if std::fs::remove_dir(&self.dir).is_ok() {
                return;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

/// The process holding a POSIX lock on `path` that a write lock of ours
/// would conflict with (F_GETLK), if any.
pub fn lock_holder(path: &Path) -> Option<i32> {
    let file = std::fs::OpenOptions::new().read(true).write(true).open(path).unwrap();
    // SAFETY: a zeroed flock struct is a valid value.
    let mut probe: libc::flock = unsafe { std::mem::zeroed() };
    probe.l_type = libc::F_WRLCK as _;
    probe.l_whence = libc::SEEK_SET as _;
    // SAFETY: F_GETLK on a descriptor we own, into `probe`.
    assert_eq!(unsafe { libc::fcntl(std::os::fd::AsRawFd::as_raw_fd(&file), libc::F_GETLK, &mut probe) }, 0);
    (i32::from(probe.l_type) != libc::F_UNLCK).then_some(probe.l_pid)
}

//! The processes the bench checkpoints, and how each proves after a restore
//! that it is intact: by asking the process itself.
//!
//! - Memory patterns (`criuz-workload`): SIGUSR1 makes it write a checksum of
//!   its memory to DIR/sum-root.
//! - redis: DBSIZE and sampled GETs over TCP on loopback, as users run it
//!   (dumping a TCP socket needs CRIU >= 4.2 on Linux >= 6.16).
//! - jvm, python: a request file makes them walk their whole object graph and
//!   write a checksum to an answer file.

use crate::error::{Error, Result};
use crate::proc;
use std::io::{BufRead, BufReader, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

pub const PATTERNS: &[&str] = &["zero", "mixed", "random", "text", "elf", "bf16", "gpu-image"];
pub const APPS: &[&str] = &["redis", "jvm", "python"];

const JAVA_SOURCE: &str = include_str!("../../bench/BenchApp.java");
const PYTHON_SOURCE: &str = include_str!("../../bench/bench_app.py");

/// A tree as a pre-forking server makes it: the `mixed` pattern filled by
/// a parent, then [`FORKED_CHILDREN`] children forked, each rewriting a
/// few of its pages; the rest stay shared with the parent. `--size` is the
/// whole tree's (each process maps a quarter).
pub const TREES: &[&str] = &["forked"];
const FORKED_CHILDREN: usize = 3;

/// Run only when named: `shared` (the `text` pattern in shared anonymous
/// memory, which CRIU restores itself, from the images criuz writes first),
/// and `threaded` (the `mixed` pattern in one process of
/// [`THREADED_THREADS`] threads, as a server's thread pools make one: an
/// inference server's OpenMP, CUDA and tokenizer threads; each thread's
/// stack is a mapping of its own), and `hugetlb` (the `mixed` pattern in
/// private huge pages, `MAP_HUGETLB`, as a database's or a JVM's large
/// pages; the bench reserves the pages, vm.nr_hugepages, for the run and
/// gives them back after), and `shared-cache` (the `mixed` pattern in
/// shared anonymous memory written by a child that has exited, as a
/// server's workers fill its shared cache: PostgreSQL's shared buffers;
/// the process dumped has touched none of it), and `thp` (the `mixed`
/// pattern in private memory the process asked to be transparent huge
/// pages, `MADV_HUGEPAGE`, as a JVM run with `-XX:+UseTransparentHugePages`
/// does; it also times random reads of it before the dump and after the
/// restore, [`Running::random_read_ns`]).
pub const ON_REQUEST: &[&str] = &["shared", "threaded", "hugetlb", "shared-cache", "thp"];
/// Applications not in the default set either: `jvm-thp`, the `jvm` heap
/// with `-XX:+UseTransparentHugePages` (a real heap in memory the process
/// asked to be transparent huge pages).
pub const APPS_ON_REQUEST: &[&str] = &["jvm-thp"];
const THREADED_THREADS: usize = 256;

/// The workloads a run does by default.
pub fn all() -> Vec<&'static str> {
    PATTERNS.iter().chain(TREES).chain(APPS).copied().collect()
}

/// Every workload a run may name.
pub fn known() -> Vec<&'static str> {
    all().into_iter().chain(ON_REQUEST.iter().copied()).chain(APPS_ON_REQUEST.iter().copied()).collect()
}

/// What the workloads need, prepared once per bench.
pub struct Tools {
    pub workload_bin: PathBuf,
    /// Compiled BenchApp classes, or why the jvm workload cannot run.
    pub java_classes: std::result::Result<PathBuf, String>,
    pub python_script: PathBuf,
    pub python: PathBuf,
    /// The huge pages the `hugetlb` workload needs, reserved for the run.
    _huge_pages: Option<HugePages>,
}

/// Huge pages of the default size reserved (vm.nr_hugepages raised) for as
/// long as this lives; given back when dropped.
struct HugePages {
    had: u64,
}

const NR_HUGEPAGES: &str = "/proc/sys/vm/nr_hugepages";

impl HugePages {
    /// Enough for one process of `mib` MiB of huge pages at a time (the
    /// bench ends each before the next starts), and some to spare.
    fn reserve(mib: u64) -> Result<HugePages> {
        let read = || -> Result<u64> {
            let text = std::fs::read_to_string(NR_HUGEPAGES).map_err(|e| Error::file(NR_HUGEPAGES, e))?;
            text.trim().parse().map_err(|_| Error::Invalid(format!("{NR_HUGEPAGES}: {text:?}")))
        };
        let had = read()?;
        let more = mib.div_ceil(2) + 8;
        std::fs::write(NR_HUGEPAGES, (had + more).to_string()).map_err(|e| Error::file(NR_HUGEPAGES, e))?;
        let held = HugePages { had };
        let now = read()?;
        if now < had + more {
            return Err(Error::Invalid(format!(
                "hugetlb: the system gave {} of the {more} huge pages asked for ({NR_HUGEPAGES})",
                now.saturating_sub(had)
            )));
        }
        Ok(held)
    }
}

impl Drop for HugePages {
    fn drop(&mut self) {
        let _ = std::fs::write(NR_HUGEPAGES, self.had.to_string());
    }
}

impl Tools {
    /// What `workloads` of `mib` MiB need.
    pub fn prepare(work: &Path, workloads: &[String], workload_bin: PathBuf, mib: u64) -> Result<Tools> {
        let python_script = work.join("bench_app.py");
        std::fs::write(&python_script, PYTHON_SOURCE).map_err(|e| Error::file(&python_script, e))?;
        let python =
            if Path::new("/usr/bin/python3").exists() { PathBuf::from("/usr/bin/python3") } else { "python3".into() };
        let java_classes = if workloads.iter().any(|w| w.starts_with("jvm")) {
            compile_java(work)
        } else {
            Err("not compiled".to_string())
        };
        let huge_pages = workloads.iter().any(|w| w == "hugetlb").then(|| HugePages::reserve(mib)).transpose()?;
        Ok(Tools { workload_bin, java_classes, python_script, python, _huge_pages: huge_pages })
    }
}

fn compile_java(work: &Path) -> std::result::Result<PathBuf, String> {
    let src_dir = work.join("java-src");
    let classes = work.join("java");
    std::fs::create_dir_all(&src_dir).map_err(|e| e.to_string())?;
    std::fs::create_dir_all(&classes).map_err(|e| e.to_string())?;
    let src = src_dir.join("BenchApp.java");
    std::fs::write(&src, JAVA_SOURCE).map_err(|e| e.to_string())?;
    let out = Command::new("javac")
        .arg("-d")
        .arg(&classes)
        .arg(&src)
        .stdin(Stdio::null())
        .output()
        .map_err(|e| format!("cannot run javac: {e}"))?;
    if !out.status.success() {
        return Err(format!("javac failed: {}", String::from_utf8_lossy(&out.stderr).trim()));
    }
    Ok(classes)
}

/// One running workload. Dropping it kills and reaps its process tree.
pub struct Running {
    pub pid: i32,
    /// The file name of the program it runs (`/proc/PID/exe`), read when it
    /// was started: what tells the workload from another program given its
    /// pid once it is gone.
    program: String,
    dir: PathBuf,
    kind: Kind,
    nonce: u64,
}

enum Kind {
    /// `criuz-workload`: its root, and as many forked children.
    Pattern {
        children: usize,
        /// Its memory was written by a child that has exited (the
        /// `shared-cache` workload): the first fingerprint is that child's
        /// checksum, so the root has touched none of it when it is dumped.
        /// Its fingerprints are the checksum alone (the filler's pid and
        /// threads are not the root's).
        filled_by_child: bool,
        untouched: bool,
    },
    Redis {
        addr: SocketAddr,
        keys: u64,
        idle_sockets: usize,
    },
    Answering,
}

fn wait_for(what: &str, timeout: Duration, pid: i32, mut ready: impl FnMut() -> bool) -> Result<()> {
    let t = Instant::now();
    while !ready() {
        if !proc::alive(pid) {
            return Err(Error::Invalid(format!("{what}: process {pid} is gone")));
        }
        if t.elapsed() > timeout {
            return Err(Error::Invalid(format!("timed out after {timeout:?} waiting for {what}")));
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    Ok(())
}

pub fn log_tail(path: &Path) -> String {
    let s = std::fs::read_to_string(path).unwrap_or_default();
    let v: Vec<&str> = s.lines().filter(|l| !l.trim().is_empty()).collect();
    v[v.len().saturating_sub(3)..].join(" | ")
}

/// Starts `cmd` in its own session, standard streams to /dev/null and a log,
/// so CRIU can dump it without --shell-job.
pub fn spawn_detached(mut cmd: Command, log: &Path) -> Result<i32> {
    let out = std::fs::File::create(log).map_err(|e| Error::file(log, e))?;
    let err = out.try_clone().map_err(|e| Error::file(log, e))?;
    cmd.stdin(Stdio::null()).stdout(out).stderr(err);
    // SAFETY: setsid is async-signal-safe; nothing else runs between fork and exec.
    unsafe {
        cmd.pre_exec(|| {
            libc::setsid();
            Ok(())
        });
    }
    let name = cmd.get_program().to_string_lossy().into_owned();
    let child = cmd.spawn().map_err(|e| Error::Invalid(format!("cannot run {name}: {e}")))?;
    Ok(child.id() as i32)
}

/// Redis keys for a size: a million at the default 1024 MiB.
pub fn redis_keys(mib: u64) -> u64 {
    (mib * 1_000_000 / 1024).max(10_000)
}

impl Running {
    /// Takes the pid of the process just started, and the program it runs.
    fn spawned(&mut self, pid: i32) {
        self.pid = pid;
        self.program = proc::program(pid).unwrap_or_default();
    }

    /// Whether its pid now names a process of another program
    /// ([`proc::taken_by_another`]).
    pub fn pid_given_away(&self) -> bool {
        proc::taken_by_another(self.pid, &self.program)
    }

    pub fn start(name: &str, mib: u64, dir: &Path, tools: &Tools) -> Result<Running> {
        Self::start_with(name, mib, dir, tools, None)
    }

    /// A memory pattern whose process also holds an established TCP
    /// connection to an echo peer (a thread of this process, for as long as
    /// the connection lasts): its checksum line says whether the connection
    /// still echoes (`tcp=echoed`), so a checkpoint that kills the
    /// connection shows as a changed fingerprint.
    pub fn start_with_tcp_peer(pattern: &str, mib: u64, dir: &Path, tools: &Tools) -> Result<Running> {
        let listener =
            TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).map_err(|e| Error::Invalid(format!("echo peer: {e}")))?;
        let addr = listener.local_addr().map_err(|e| Error::Invalid(format!("echo peer: {e}")))?;
        std::thread::spawn(move || {
            let Ok((stream, _)) = listener.accept() else { return };
            let Ok(reading) = stream.try_clone() else { return };
            let mut w = stream;
            for line in BufReader::new(reading).lines() {
                let Ok(line) = line else { break };
                if writeln!(w, "{line}").is_err() {
                    break;
                }
            }
        });
        Self::start_with(pattern, mib, dir, tools, Some(addr))
    }

    fn start_with(name: &str, mib: u64, dir: &Path, tools: &Tools, tcp_peer: Option<SocketAddr>) -> Result<Running> {
        std::fs::create_dir_all(dir).map_err(|e| Error::file(dir, e))?;
        let log = dir.join("app.log");
        let ready = dir.join("ready");
        let mut run =
            Running { pid: 0, program: String::new(), dir: dir.to_path_buf(), kind: Kind::Answering, nonce: 0 };
        match name {
            p if PATTERNS.contains(&p) || TREES.contains(&p) || ON_REQUEST.contains(&p) => {
                let mut cmd = Command::new(&tools.workload_bin);
                cmd.arg("--dir").arg(dir);
                let children = match p {
                    "shared" => {
                        cmd.args(["--mib", &mib.to_string(), "--pattern", "text", "--shared", "1"]);
                        0
                    }
                    "hugetlb" => {
                        cmd.args(["--mib", "4", "--pattern", "mixed", "--huge-mib", &mib.to_string()]);
                        0
                    }
                    "thp" => {
                        cmd.args(["--mib", &mib.to_string(), "--pattern", "mixed", "--thp", "1"]);
                        0
                    }
                    "shared-cache" => {
                        cmd.args(["--mib", &mib.to_string(), "--pattern", "mixed", "--shared", "1"]);
                        cmd.args(["--filled-by-child", "1"]);
                        0
                    }
                    "threaded" => {
                        let threads = THREADED_THREADS.to_string();
                        cmd.args(["--mib", &mib.to_string(), "--pattern", "mixed", "--mode", "threads"]);
                        cmd.args(["--threads", &threads]);
                        0
                    }
                    "forked" => {
                        let each = (mib / (FORKED_CHILDREN as u64 + 1)).max(1).to_string();
                        let children = FORKED_CHILDREN.to_string();
                        cmd.args(["--mib", &each, "--pattern", "mixed", "--mode", "tree", "--children", &children]);
                        FORKED_CHILDREN
                    }
                    _ => {
                        cmd.args(["--mib", &mib.to_string(), "--pattern", p]);
                        0
                    }
                };
                if let Some(peer) = tcp_peer {
                    cmd.args(["--tcp-peer", &peer.to_string()]);
                }
                run.spawned(spawn_detached(cmd, &log)?);
                let filled_by_child = p == "shared-cache";
                run.kind = Kind::Pattern { children, filled_by_child, untouched: filled_by_child };
                wait_for("the workload to fill its memory", Duration::from_secs(900), run.pid, || ready.exists())
                    .map_err(|e| Error::Invalid(format!("{e}: {}", log_tail(&log))))?;
            }
            "redis" => {
                let addr = free_loopback_port()?;
                let mut cmd = Command::new("redis-server");
                cmd.args(["--bind", "127.0.0.1", "--port", &addr.port().to_string()])
                    .args(["--save", "", "--appendonly", "no", "--daemonize", "no"])
                    .args(["--enable-debug-command", "yes", "--dir"])
                    .arg(dir)
                    .arg("--logfile")
                    .arg(&log);
                run.spawned(spawn_detached(cmd, &dir.join("stdout.log"))?);
                wait_for("redis to listen", Duration::from_secs(60), run.pid, || TcpStream::connect(addr).is_ok())
                    .map_err(|e| Error::Invalid(format!("{e}: {}", log_tail(&log))))?;
                let idle_sockets = socket_fds(run.pid);
                let keys = redis_keys(mib);
                run.kind = Kind::Redis { addr, keys, idle_sockets };
                {
                    let mut c = Redis::connect(addr)?;
                    c.call(&["DEBUG", "POPULATE", &keys.to_string()])?;
                }
                run.wait_no_clients()?;
            }
            "jvm" | "jvm-thp" => {
                let classes = tools.java_classes.clone().map_err(Error::Invalid)?;
                let heap_mib = mib * 2 + 256;
                let mut cmd = Command::new("java");
                if name == "jvm-thp" {
                    cmd.arg("-XX:+UseTransparentHugePages");
                }
                cmd.args(["-XX:-UsePerfData", "-XX:+DisableAttachMechanism", &format!("-Xmx{heap_mib}m"), "-cp"])
                    .arg(&classes)
                    .arg("BenchApp")
                    .arg(dir)
                    .arg(mib.to_string());
                run.spawned(spawn_detached(cmd, &log)?);
                wait_for("the JVM to build its object graph", Duration::from_secs(900), run.pid, || ready.exists())
                    .map_err(|e| Error::Invalid(format!("{e}: {}", log_tail(&log))))?;
            }
            "python" => {
                let mut cmd = Command::new(&tools.python);
                cmd.arg(&tools.python_script).arg(dir).arg(mib.to_string());
                run.spawned(spawn_detached(cmd, &log)?);
                wait_for("python to build its data", Duration::from_secs(900), run.pid, || ready.exists())
                    .map_err(|e| Error::Invalid(format!("{e}: {}", log_tail(&log))))?;
            }
            other => return Err(Error::Invalid(format!("unknown workload {other}"))),
        }
        Ok(run)
    }

    /// Nanoseconds a random read of its memory took, as the `thp` workload
    /// times it with each [`fingerprint`](Self::fingerprint) (before the
    /// checksum it writes); `None` for any other workload.
    pub fn random_read_ns(&self) -> Option<f64> {
        std::fs::read_to_string(self.dir.join("reads-root")).ok()?.trim().parse().ok()
    }

    /// What the process says about its own state; equal before the dump and
    /// after the restore if and only if the restore is intact.
    pub fn fingerprint(&mut self) -> Result<String> {
        self.fingerprint_within(Duration::from_secs(300))
    }

    /// [`fingerprint`](Self::fingerprint), failing after `timeout`.
    pub fn fingerprint_within(&mut self, timeout: Duration) -> Result<String> {
        match &mut self.kind {
            Kind::Pattern { children, filled_by_child, untouched } => {
                let (children, filled_by_child, first) = (*children, *filled_by_child, std::mem::take(untouched));
                if !filled_by_child {
                    return self.pattern_sums(children, timeout);
                }
                let line = if first {
                    let filler = self.dir.join("sum-filler");
                    std::fs::read_to_string(&filler).map_err(|e| Error::file(&filler, e))?
                } else {
                    self.pattern_sums(children, timeout)?
                };
                let checksum = line.split_whitespace().filter(|f| f.starts_with("sum=") || f.starts_with("bytes="));
                Ok(checksum.collect::<Vec<_>>().join(" "))
            }
            Kind::Redis { addr, keys, .. } => {
                let keys = *keys;
                let mut out;
                {
                    let mut c = Redis::connect(*addr)?;
                    let n = c.call(&["DBSIZE"])?;
                    out = format!("dbsize={n}");
                    let mut samples = vec![0, keys - 1];
                    samples.extend((1..15u64).map(|k| k.wrapping_mul(2_654_435_761) % keys));
                    for i in samples {
                        let key = format!("key:{i}");
                        let v = c.call(&["GET", &key])?;
                        if v != format!("value:{i}") {
                            return Err(Error::Invalid(format!("redis {key} holds {v:?}, expected \"value:{i}\"")));
                        }
                        out.push_str(&format!(" {key}={v}"));
                    }
                }
                self.wait_no_clients()?;
                Ok(out)
            }
            Kind::Answering => self.ask("", "the application's answer"),
        }
    }

    /// The checksum lines of a `criuz-workload` tree: every process checks
    /// its own memory (the root passes the signal on to its children).
    fn pattern_sums(&self, children: usize, timeout: Duration) -> Result<String> {
        let roles: Vec<String> =
            std::iter::once("root".to_string()).chain((1..=children).map(|k| format!("child{k}"))).collect();
        let sums: Vec<PathBuf> = roles.iter().map(|r| self.dir.join(format!("sum-{r}"))).collect();
        for sum in &sums {
            let _ = std::fs::remove_file(sum);
        }
        let processes = proc::tree(self.pid).len();
        if processes != roles.len() {
            return Err(Error::Invalid(format!(
                "workload {} has {processes} processes, not {}",
                self.pid,
                roles.len()
            )));
        }
        // SAFETY: signalling our own workload.
        if unsafe { libc::kill(self.pid, libc::SIGUSR1) } != 0 {
            return Err(Error::Invalid(format!("workload {} is not running", self.pid)));
        }
        wait_for("the workload's checksums", timeout, self.pid, || sums.iter().all(|s| s.exists()))?;
        let mut all = Vec::with_capacity(sums.len());
        for sum in &sums {
            all.push(std::fs::read_to_string(sum).map_err(|e| Error::file(sum, e))?.trim().to_string());
        }
        Ok(all.join(" "))
    }

    /// Rewrites about `percent`% of the workload's state in place, as a
    /// running service does between two checkpoints: pattern pages with new
    /// random bytes, redis keys SET again (new allocations), JVM nodes given
    /// new values. Returns the bytes rewritten where the workload knows them
    /// (pattern workloads: whole pages).
    pub fn rewrite(&mut self, percent: f64, seed: u64) -> Result<Option<u64>> {
        let timeout = Duration::from_secs(300);
        match &self.kind {
            Kind::Pattern { .. } => {
                let done = self.dir.join("rewrote-root");
                let _ = std::fs::remove_file(&done);
                let spec = self.dir.join("rewrite");
                std::fs::write(&spec, format!("{percent} {seed}")).map_err(|e| Error::file(&spec, e))?;
                // SAFETY: signalling our own workload.
                if unsafe { libc::kill(self.pid, libc::SIGUSR2) } != 0 {
                    return Err(Error::Invalid(format!("workload {} is not running", self.pid)));
                }
                wait_for("the workload's rewrite", timeout, self.pid, || done.exists())?;
                let pages: u64 = std::fs::read_to_string(&done).unwrap_or_default().trim().parse().unwrap_or(0);
                Ok(Some(pages * 4096))
            }
            Kind::Redis { addr, keys, .. } => {
                let (addr, keys) = (*addr, *keys);
                {
                    let mut c = Redis::connect(addr)?;
                    let stride = (100.0 / percent.clamp(0.001, 100.0)) as u64;
                    let mut i = seed % stride.max(1);
                    while i < keys {
                        c.call(&["SET", &format!("key:{i}"), &format!("value:{i}")])?;
                        i += stride.max(1);
                    }
                }
                self.wait_no_clients()?;
                Ok(None)
            }
            Kind::Answering => self.ask(&format!("rewrite {percent} "), "the application's rewrite").map(|_| None),
        }
    }

    /// Sends an application (JVM, Python) a request, `{command}{nonce}`, and
    /// returns its answer after `nonce=N `.
    fn ask(&mut self, command: &str, what: &str) -> Result<String> {
        self.nonce += 1;
        let nonce = self.nonce;
        let answer = self.dir.join("answer");
        let _ = std::fs::remove_file(&answer);
        let tmp = self.dir.join("request.tmp");
        std::fs::write(&tmp, format!("{command}{nonce}\n")).map_err(|e| Error::file(&tmp, e))?;
        std::fs::rename(&tmp, self.dir.join("request")).map_err(|e| Error::file(&tmp, e))?;
        let prefix = format!("nonce={nonce} ");
        let mut line = String::new();
        wait_for(what, Duration::from_secs(300), self.pid, || {
            line = std::fs::read_to_string(&answer).unwrap_or_default();
            line.starts_with(&prefix)
        })?;
        Ok(line.trim()[prefix.len()..].to_string())
    }

    /// Redis must have no client connection when CRIU dumps it (a connected
    /// socket whose peer is outside the dump is refused).
    fn wait_no_clients(&self) -> Result<()> {
        if let Kind::Redis { idle_sockets, .. } = &self.kind {
            let idle = *idle_sockets;
            wait_for("redis to close client connections", Duration::from_secs(20), self.pid, || {
                socket_fds(self.pid) <= idle
            })?;
        }
        Ok(())
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        // A pid given to another program since is not this workload's.
        if self.pid > 0 && !self.pid_given_away() {
            proc::kill_tree(&proc::tree(self.pid));
        }
    }
}

fn socket_fds(pid: i32) -> usize {
    let Ok(rd) = std::fs::read_dir(format!("/proc/{pid}/fd")) else { return 0 };
    rd.flatten()
        .filter(|e| std::fs::read_link(e.path()).map(|l| l.to_string_lossy().starts_with("socket:")).unwrap_or(false))
        .count()
}

/// A minimal RESP client: enough for DEBUG POPULATE, DBSIZE and GET.
/// A loopback address with a port nobody listens on right now.
fn free_loopback_port() -> Result<SocketAddr> {
    Ok(TcpListener::bind((Ipv4Addr::LOCALHOST, 0))?.local_addr()?)
}

struct Redis(BufReader<TcpStream>);

impl Redis {
    fn connect(addr: SocketAddr) -> Result<Redis> {
        let s = TcpStream::connect(addr).map_err(|e| Error::Invalid(format!("redis at {addr}: {e}")))?;
        s.set_read_timeout(Some(Duration::from_secs(300)))?;
        Ok(Redis(BufReader::new(s)))
    }

    /// Sends a command; returns the reply as text (status, integer or bulk).
    fn call(&mut self, args: &[&str]) -> Result<String> {
        let mut req = format!("*{}\r\n", args.len());
        for a in args {
            req.push_str(&format!("${}\r\n{a}\r\n", a.len()));
        }
        self.0.get_mut().write_all(req.as_bytes())?;
        let bad = |what: String| Error::Invalid(format!("redis {}: {what}", args[0]));
        let mut line = String::new();
        self.0.read_line(&mut line)?;
        let line = line.trim_end();
        let (kind, rest) = line.split_at(line.len().min(1));
        match kind {
            "+" | ":" => Ok(rest.to_string()),
            "-" => Err(bad(rest.to_string())),
            "$" => {
                let n: i64 = rest.parse().map_err(|_| bad(format!("bad reply {line:?}")))?;
                if n < 0 {
                    return Ok("(nil)".into());
                }
                let mut buf = vec![0u8; n as usize + 2];
                std::io::Read::read_exact(&mut self.0, &mut buf)?;
                buf.truncate(n as usize);
                Ok(String::from_utf8_lossy(&buf).into_owned())
            }
            _ => Err(bad(format!("unexpected reply {line:?}"))),
        }
    }
}

//! The CRIU side: finding a usable CRIU (>= 4.0) here; its streamer protocol
//! (`streamer`), handing bytes to its pipes (`splice`), the few image files
//! criuz reads (`images`), CRIU's dump statistics (`stats`), the options a
//! run of it reads (`options`), its version (`version`, remembered per
//! binary) and what `criu check` says of this kernel (`probe`) in the
//! submodules.
//!
//! Order: `--criu PATH`, then `$CRIUZ_CRIU`, then the build cache that
//! `scripts/setup.sh` fills (`$CRIUZ_CACHE`, else `$XDG_CACHE_HOME/criuz`, else
//! `~/.cache/criuz`), then `criu` on `PATH`. An explicitly named CRIU that is
//! unusable is an error; other candidates are skipped with the reason.

use crate::error::{Error, Result};
use std::path::{Path, PathBuf};

pub mod images;
pub mod options;
pub mod page_server;
pub mod probe;
pub mod scm;
pub mod splice;
pub mod stats;
pub mod streamer;
pub mod uffd;
mod version;

pub const MIN_MAJOR: u32 = 4;
/// Versions `scripts/setup.sh` may have built into the cache, newest first.
/// 4.2 is the first that dumps TCP sockets on Linux >= 6.16; 4.1.1 still works
/// for everything else.
pub const CACHED_VERSIONS: [&str; 2] = ["4.2.1", "4.1.1"];

#[derive(Clone, Debug)]
pub struct Criu {
    pub path: PathBuf,
    pub version: String,
    /// Where it was found: "--criu", "CRIUZ_CRIU", "cache" or "PATH".
    pub source: &'static str,
}

/// Major and minor of a release, CRIU's (`4.2.1`) or the kernel's
/// (`6.8.0-51-generic`).
pub(crate) fn release_of(text: &str) -> Option<(u32, u32)> {
    let mut parts = text.split(|c: char| !c.is_ascii_digit()).map(|p| p.parse().ok());
    Some((parts.next()??, parts.next()??))
}

impl Criu {
    /// Major and minor version, where the version reads so.
    pub(crate) fn release(&self) -> Option<(u32, u32)> {
        release_of(&self.version)
    }

    /// The `CRIU_FAULT` that has this CRIU catch a restored task at the end
    /// of its restorer by tracing its system calls instead of with a
    /// hardware breakpoint (`FI_NO_BREAKPOINTS`, 130 from 3.x to 4.2; the way
    /// it catches tasks where the kernel has no breakpoints). Setting a
    /// breakpoint allocates a perf event, which waits for an RCU grace
    /// period: 5.6 ms of a lazy restore's start on this project's VM (a
    /// `perf` trace of one), while tracing the restorer's last system calls
    /// costs microseconds.
    pub fn no_breakpoints_fault(&self) -> Option<&'static str> {
        matches!(self.release(), Some((4, 0..=2))).then_some("130")
    }
}

/// How a candidate was judged, for the user.
#[derive(Clone, Debug)]
pub struct Rejected {
    pub path: PathBuf,
    pub source: &'static str,
    pub why: String,
}

pub fn cache_dir() -> PathBuf {
    if let Some(d) = std::env::var_os("CRIUZ_CACHE") {
        return PathBuf::from(d);
    }
    if let Some(d) = std::env::var_os("XDG_CACHE_HOME") {
        return PathBuf::from(d).join("criuz");
    }
    let home = std::env::var_os("HOME").map(PathBuf::from).unwrap_or_else(|| PathBuf::from("/root"));
    home.join(".cache").join("criuz")
}

/// `Version: 4.1.1` -> (4, "4.1.1")
fn probe_version(path: &Path) -> std::result::Result<(u32, String), String> {
    let version = version::version_of(path, &version::record_path(&cache_dir()))?;
    let major = version.split('.').next().and_then(|m| m.parse().ok()).ok_or(format!("odd version {version}"))?;
    Ok((major, version))
}

fn judge(path: &Path, source: &'static str) -> std::result::Result<Criu, Rejected> {
    let reject = |why: String| Rejected { path: path.to_path_buf(), source, why };
    match probe_version(path) {
        Ok((major, version)) if major >= MIN_MAJOR => Ok(Criu { path: path.to_path_buf(), version, source }),
        Ok((_, version)) => Err(reject(format!("version {version} is older than {MIN_MAJOR}.0"))),
        Err(why) => Err(reject(why)),
    }
}

/// The first file called `name` in a `PATH` directory.
pub fn on_path(name: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path).map(|d| d.join(name)).find(|p| p.is_file())
}

/// Finds CRIU; returns it with the candidates skipped on the way. Clears
/// the way for CRIU's kernel cache first ([`unblock_kerndat_cache`]).
pub fn locate(explicit: Option<&Path>) -> Result<(Criu, Vec<Rejected>)> {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } == 0 {
        for dir in KERNDAT_DIRS {
            unblock_kerndat_cache(Path::new(dir));
        }
    }
    find(explicit)
}

/// Where CRIU keeps its kernel cache (below): `/run`, CRIU's default, and
/// `/run/criu`, where `scripts/setup.sh` builds it to keep it on a machine
/// whose `/run` is not a tmpfs (CRIU keeps the cache only on one).
const KERNDAT_DIRS: [&str; 2] = ["/run", "/run/criu"];

/// CRIU keeps what it probes of the kernel at its start (`kerndat`: dozens
/// of probes, forks and ptrace among them) in `/run/criu.kdat`, written
/// through `criu.kdat.tmp`, which it creates exclusively. A CRIU killed
/// between the two (as criuz's CRIU is when criuz dies) leaves that file,
/// and every later CRIU, finding it, probes the kernel again and saves
/// nothing: each run pays the probes, and one killed among them can leave
/// a probe's child stopped for good. CRIU writes the file in microseconds:
/// one older than a minute is such a leftover, removed here so that the
/// next CRIU saves its cache again.
fn unblock_kerndat_cache(dir: &Path) {
    let tmp = dir.join("criu.kdat.tmp");
    let Ok(meta) = std::fs::symlink_metadata(&tmp) else { return };
    let age = meta.modified().ok().and_then(|t| t.elapsed().ok());
    if meta.is_file() && age.is_some_and(|a| a > std::time::Duration::from_secs(60)) {
        let _ = std::fs::remove_file(&tmp);
    }
}

fn find(explicit: Option<&Path>) -> Result<(Criu, Vec<Rejected>)> {
    // A named CRIU that is not there, or not a file, is a wrong name (exit
    // 2), as any other input is; one that runs and is no CRIU >= 4 fails.
    let explicit_err = |r: Rejected| {
        let text = format!("CRIU from {} ({}): {}", r.source, r.path.display(), r.why);
        if r.path.is_file() {
            Error::Criu(text)
        } else {
            Error::Usage(text)
        }
    };
    if let Some(p) = explicit {
        return judge(p, "--criu").map(|c| (c, vec![])).map_err(explicit_err);
    }
    if let Some(p) = std::env::var_os("CRIUZ_CRIU") {
        return judge(Path::new(&p), "CRIUZ_CRIU").map(|c| (c, vec![])).map_err(explicit_err);
    }
    let mut rejected = Vec::new();
    let mut candidates: Vec<(PathBuf, &'static str)> = Vec::new();
    for v in CACHED_VERSIONS {
        candidates.push((cache_dir().join(format!("criu-{v}")).join("criu"), "cache"));
    }
    if let Some(p) = on_path("criu") {
        candidates.push((p, "PATH"));
    }
    for (path, source) in candidates {
        if source == "cache" && !path.exists() {
            continue;
        }
        match judge(&path, source) {
            Ok(c) => return Ok((c, rejected)),
            Err(r) => rejected.push(r),
        }
    }
    let mut msg = String::from("no usable CRIU >= 4.0 found (run scripts/setup.sh, or pass --criu PATH)");
    for r in &rejected {
        msg.push_str(&format!("; skipped {} from {}: {}", r.path.display(), r.source, r.why));
    }
    // setup.sh builds CRIU into root's cache, which another user neither
    // finds nor could run as it must.
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        msg.push_str("; criuz runs CRIU, which dumps and restores as root (or, with `-- --unprivileged`, holding CAP_CHECKPOINT_RESTORE)");
    }
    Err(Error::Criu(msg))
}

/// CRIU's errors that only say that it failed, or that the failure ended
/// a process: what caused it was logged before them.
const AFTERMATH: [&str; 4] =
    ["Restoring FAILED", "Dumping FAILED", "exited, status=", "Killing processes because of failure"];

/// At most `max` lines of a CRIU log that say what went wrong: its first
/// error, where the cause is (a file a restore could not open: "Can't open
/// file PATH: No such file or directory", three errors before the end),
/// and the last ones, leaving out those that only report the failure.
pub fn log_errors(log: &Path, max: usize) -> Vec<String> {
    let text = std::fs::read_to_string(log).unwrap_or_default();
    // CRIU logs its failure to raise its own descriptor limit as an error
    // and carries on: not what stopped it.
    let errs: Vec<String> = text
        .lines()
        .filter(|l| (l.contains("Error") || l.contains("rror (")) && !l.contains("Can't setup RLIMIT_NOFILE"))
        .map(String::from)
        .collect();
    let causes: Vec<String> = errs.iter().filter(|l| !AFTERMATH.iter().any(|a| l.contains(a))).cloned().collect();
    let lines = match (causes.is_empty(), errs.is_empty()) {
        (false, _) => causes,
        (true, false) => errs,
        (true, true) => text.lines().map(String::from).collect(),
    };
    if lines.len() <= max || max < 2 {
        return lines[lines.len().saturating_sub(max)..].to_vec();
    }
    let mut kept = vec![lines[0].clone()];
    kept.extend_from_slice(&lines[lines.len() - (max - 1)..]);
    kept
}

/// CRIU's errors that a criuz option, a CRIU option given after `--`, or
/// waiting answers: what CRIU logged (every part on one line), and what to
/// tell the user.
const HINTS: [(&[&str], &str); 25] = [
    (
        // The kernel refuses to pass an io_uring descriptor over a socket
        // (EINVAL), and CRIU's parasite hands the tree's descriptors over
        // one: the log says only "send_fds failed (-22)".
        &["send_fds failed (-22)"],
        "CRIU could not take a descriptor of the tree: an io_uring instance, most likely, which CRIU cannot \
         checkpoint (Node.js 20 and later open one unless started with UV_USE_IO_URING=0)",
    ),
    (
        &["Can't chose service_fd_base"],
        "the tree had more files open than CRIU may open under criuz's open-files limit (`ulimit -n`, whose hard \
         limit criuz raises its own to): raise the hard limit and restore again",
    ),
    (
        &["Some file locks are hold by dumping tasks"],
        "the tree holds file locks: dump with -- --file-locks (criuz restores such a checkpoint with its locks)",
    ),
    (
        &["Can't dump ghost file", "increase limit"],
        "the tree holds open a deleted file larger than CRIU keeps (1 MiB by default): dump with -- --ghost-limit \
         SIZE",
    ),
    (
        &["External socket is used"],
        "the tree is connected to a unix socket outside it: dump with -- --ext-unix-sk (a datagram socket with a \
         named peer only; close a stream connection first)",
    ),
    (
        &["External socket found in image"],
        "the checkpoint holds a unix socket connected outside the tree (dumped with -- --ext-unix-sk): restore \
         with -- --ext-unix-sk",
    ),
    (
        &["Connected TCP socket, consider using --tcp-established"],
        "the process has established TCP connections: dump with -- --tcp-established (criuz restores such a \
         checkpoint with its connections)",
    ),
    (
        &["In-flight connections can be ignored"],
        "a listening socket of the tree holds connections it has not accepted yet: dump with -- \
         --skip-in-flight (those connections are dropped: their clients see them reset), or dump once they are \
         accepted",
    ),
    (
        &["Connected TCP socket in image"],
        "the checkpoint holds established TCP connections: restore with -- --tcp-established",
    ),
    (&["Found dangling tty"], "a process attached to a terminal: dump and restore with --shell-job"),
    (
        &["Can't bind inet socket", "Address already in use"],
        "an address the tree had bound (a listening port) is taken by another process (ss -ltnp names it): free \
         it and restore again",
    ),
    (
        &["without correspond master peer"],
        "the tree was on a terminal (dumped with --shell-job): restore it with --shell-job, from a terminal",
    ),
    (
        &["Don't have tty to inherit session from"],
        "the tree was on a terminal: restore it with --shell-job from a terminal (criuz's standard input)",
    ),
    (
        &["Can't lookup mount=", "for fd="],
        "the tree has a file open on a file system CRIU does not find among its mounts, which it cannot \
         checkpoint: an internal one (a POSIX message queue from mq_open, memfd_secret memory) or one of another \
         mount namespace; close it before the dump",
    ),
    (
        &["Can't dump file", "of that type"],
        "the tree holds a kind of file CRIU cannot checkpoint (its kind in brackets: a userfaultfd, a perf event, \
         ...): close it before the dump",
    ),
    (
        &["Unknown socket collected"],
        "the tree holds a socket of a family CRIU cannot checkpoint (40 is AF_VSOCK): close it before the dump",
    ),
    (
        &["SysVIPC shmem map", "doesn't live in IPC ns"],
        "the tree maps SysV shared memory, which CRIU checkpoints only in an IPC namespace of the tree's own: \
         start it under unshare --ipc",
    ),
    (
        // Reading another user's limits (prlimit) takes CAP_SYS_RESOURCE,
        // which a container or a service manager may drop even for root.
        &["Can't get rlimit", "Operation not permitted"],
        "CRIU could not read the resource limits of a process that runs as another user: that takes \
         CAP_SYS_RESOURCE, which criuz runs without here (dropped by a container or a service manager); run it \
         with CAP_SYS_RESOURCE",
    ),
    (&["has uprobes vma"], "the process has uprobes: dump and restore with -- --allow-uprobes"),
    (
        &["has bad size", "expect"],
        "a file the tree had open or mapped is not as it was at the dump (changed or replaced since: an upgraded \
         binary or library?); put it back as it was to restore",
    ),
    (
        &["Can't open file", "No such file or directory"],
        "a file the tree had open is no longer where it was (CRIU opens each again by its path, written from /): \
         put it back and restore again",
    ),
    (
        &["Unable to reserve mem"],
        "CRIU could not reserve the restored process's memory: the restore runs under an address-space limit \
         (ulimit -v) or with less memory than the process had",
    ),
    (
        &["Unable to interrupt task", "Operation not permitted"],
        "CRIU could not trace a process of the tree: another process traces it (a debugger, strace: detach the \
         tracer and dump again), or CRIU lacks the right to (run it as root)",
    ),
    (
        &["Can't fork for", "File exists"],
        "a pid of the tree was taken while CRIU restored it (another restore of this checkpoint, or a new \
         process), or a process that outlived the tree still has it as its session (ps -eo pid,sid,comm names \
         it): restore again once it is free",
    ),
    (
        // criu/shmem.c (v4.2) reads a memfd's contents through a private
        // mapping of its own; of huge pages (shared MAP_HUGETLB memory,
        // which CRIU dumps as a memfd), that mapping reserves the whole
        // size from the pool, and fails where the pool has not that many.
        &["Can't mmap shmem", "Cannot allocate memory"],
        "CRIU could not map the tree's shared memory: of huge pages (MAP_HUGETLB, hugetlbfs), CRIU's dump maps \
         it privately, which takes as many free huge pages as it holds, and a restore needs as many: raise \
         vm.nr_hugepages by that much and run again",
    ),
];

/// The pid of the process CRIU could not stop to dump it ("Unable to
/// interrupt task: PID (...)"): one that ended meanwhile, or one traced
/// by another process.
pub fn log_uninterrupted(log: &Path) -> Option<i32> {
    let text = std::fs::read_to_string(log).ok()?;
    text.lines().find_map(|l| l.split_once("Unable to interrupt task: ")?.1.split_once(' ')?.0.parse().ok())
}

/// The pid CRIU could not fork a process of the tree with, for it was
/// taken ("Can't fork for PID: File exists").
pub fn log_pid_taken(log: &Path) -> Option<i32> {
    let text = std::fs::read_to_string(log).ok()?;
    text.lines().find_map(|l| {
        let (_, rest) = l.split_once("Can't fork for ")?;
        let (pid, why) = rest.split_once(':')?;
        why.contains("File exists").then(|| pid.trim().parse().ok()).flatten()
    })
}

/// What to do about the failure CRIU's `log` records, where criuz knows.
pub fn log_hint(log: &Path) -> Option<&'static str> {
    let text = std::fs::read_to_string(log).unwrap_or_default();
    HINTS
        .iter()
        .find(|(logged, _)| text.lines().any(|line| logged.iter().all(|part| line.contains(part))))
        .map(|(_, hint)| *hint)
}

#[cfg(test)]
mod tests {
    use super::Criu;

    fn criu(version: &str) -> Criu {
        Criu { path: "/x/criu".into(), version: version.into(), source: "PATH" }
    }

    /// CRIU's versions and the kernel's releases read the same way.
    #[test]
    fn a_release_reads_as_major_and_minor() {
        use super::release_of;
        assert_eq!(release_of("6.18.44"), Some((6, 18)));
        assert_eq!(release_of("6.8.0-51-generic"), Some((6, 8)));
        assert_eq!(release_of("5.15"), Some((5, 15)));
        assert_eq!(release_of(""), None);
        assert!(release_of("6.16.1") >= Some((6, 16)) && release_of("6.8.0") < Some((6, 16)));
        assert_eq!(criu("4.2.1").release(), Some((4, 2)));
        assert_eq!(criu("3.19").release(), Some((3, 19)));
    }

    #[test]
    fn a_log_says_what_stopped_criu_and_what_to_do() {
        let dir = tempfile::tempdir().unwrap();
        let log = dir.path().join("restore.log");
        let text = "Error (criu/util.c:1534): rlimit: Can't setup RLIMIT_NOFILE for self: Operation not permitted\n\
                    (00.01) 7: Error (criu/sk-inet.c:912): inet: Connected TCP socket in image\n\
                    Error (criu/cr-restore.c:2331): Restoring FAILED.\n";
        std::fs::write(&log, text).unwrap();
        let errors = super::log_errors(&log, 3);
        assert_eq!(errors.len(), 1, "{errors:?}");
        assert!(errors[0].contains("Connected TCP socket in image"), "{errors:?}");
        assert!(super::log_hint(&log).is_some_and(|h| h.contains("restore with -- --tcp-established")));
        // The cause comes first, three errors before the end.
        let text = " 21121: Error (criu/files-reg.c:2353): Can't open file tmp/w/held.dat on restore: No such file or directory\n\
                    \x20 21121: Error (criu/files-reg.c:2267): Can't open file tmp/w/held.dat: No such file or directory\n\
                    \x20 21121: Error (criu/files.c:1221): Unable to open fd=3 id=0x8\n\
                    \x20 21121: Error (criu/files.c:1221): Unable to open fd=4 id=0x9\n\
                    Error (criu/cr-restore.c:1265): 21121 exited, status=1\n\
                    Error (criu/cr-restore.c:2331): Restoring FAILED.\n";
        std::fs::write(&log, text).unwrap();
        let errors = super::log_errors(&log, 3);
        assert_eq!(errors.len(), 3, "{errors:?}");
        assert!(errors[0].contains("held.dat on restore: No such file"), "{errors:?}");
        assert!(errors[2].contains("fd=4"), "{errors:?}");
        // A log of nothing but the failure says that much.
        std::fs::write(&log, "Error (criu/cr-restore.c:2331): Restoring FAILED.\n").unwrap();
        assert_eq!(super::log_errors(&log, 3), vec!["Error (criu/cr-restore.c:2331): Restoring FAILED.".to_string()]);
        std::fs::write(&log, "Error (criu/cr-restore.c:1237): Can't fork for 32281: File exists\n").unwrap();
        assert!(super::log_hint(&log).is_some_and(|h| h.contains("another restore of this checkpoint")));
        assert_eq!(super::log_pid_taken(&log), Some(32281));
        std::fs::write(
            &log,
            "Warn  (compel/src/lib/infect.c:132): Unable to interrupt task: 23098 (No such process)\n",
        )
        .unwrap();
        assert_eq!(super::log_uninterrupted(&log), Some(23098));
        std::fs::write(
            &log,
            "Error (criu/cr-restore.c:1237): Can't fork for 32281: Resource temporarily unavailable\n",
        )
        .unwrap();
        assert_eq!(super::log_hint(&log), None);
        assert_eq!(super::log_pid_taken(&log), None);
        for (logged, says) in [
            ("Error (criu/file-lock.c:110): Some file locks are hold by dumping tasks! You can try --file-locks to dump them.", "dump with -- --file-locks"),
            ("Error (criu/files-reg.c:1031): Can't dump ghost file /tmp/x of 2101248 size, increase limit", "-- --ghost-limit"),
            ("Error (criu/sk-unix.c:874): External socket is used. Consider using --ext-unix-sk option.", "-- --ext-unix-sk"),
            ("Warn  (compel/src/lib/infect.c:132): Unable to interrupt task: 29543 (Operation not permitted)", "detach the tracer"),
            (" 20432: Error (criu/files-reg.c:2175): File tmp/app has bad size 82343424 (expect 82499456)", "changed or replaced since"),
            (" 20432: Error (criu/mem.c:1363): Unable to reserve memory (541536256 bytes): Cannot allocate memory", "ulimit -v"),
            ("pie: 12047: Error (criu/pie/parasite.c:588): send_fds failed (-22)", "io_uring"),
            (" 27862: Error (criu/servicefd.c:282): sfd: Can't chose service_fd_base: 1024 15038", "raise the hard limit"),
            ("  2133: Error (criu/tty.c:1010): tty: Don't have tty to inherit session from, aborting", "from a terminal"),
            (" 11053: Error (criu/tty.c:410): tty: Found slave peer index 0 without correspond master peer", "restore it with --shell-job"),
            (" 11535: Error (criu/sk-inet.c:1059): inet: Can't bind inet socket (id 26): Address already in use", "ss -ltnp"),
            ("Error (criu/cr-dump.c:478): Task 29081 with SysVIPC shmem map @7f32d0600000 doesn't live in IPC ns", "unshare --ipc"),
            ("Error (criu/cr-dump.c:389): Can't get rlimit 0: Operation not permitted", "CAP_SYS_RESOURCE"),
            ("  7: Error (criu/sk-unix.c:1912): unix: External socket found in image. Consider using the --ext-unix-sk option to allow restoring it.", "restore with -- --ext-unix-sk"),
            (" 21121: Error (criu/files-reg.c:2267): Can't open file tmp/w/held.dat: No such file or directory", "put it back"),
            ("Error (criu/sk-inet.c:186): inet: In-flight connections can be ignored with the --skip-in-flight option.", "-- --skip-in-flight"),
            ("Error (criu/files-reg.c:1790): Can't lookup mount=21 for fd=3 path=/p54q", "POSIX message queue"),
            ("Error (criu/files-reg.c:1790): Can't lookup mount=15 for fd=3 path=/secretmem (deleted)", "memfd_secret"),
            ("Error (criu/files-ext.c:94): Can't dump file 3 of that type [600] (anon anon_inode:[perf_event])", "a kind of file CRIU cannot checkpoint"),
            ("Error (criu/sockets.c:767): sockets: BUG! Unknown socket collected (family 40)", "AF_VSOCK"),
        ] {
            std::fs::write(&log, format!("{logged}\n")).unwrap();
            assert!(super::log_hint(&log).is_some_and(|h| h.contains(says)), "{logged}");
        }
        std::fs::write(&log, "Error (criu/cr-restore.c:2331): Restoring FAILED.\n").unwrap();
        assert_eq!(super::log_hint(&log), None);
    }

    #[test]
    fn a_kernel_cache_file_a_killed_criu_left_is_removed_and_a_fresh_one_kept() {
        let dir = tempfile::tempdir().unwrap();
        let tmp = dir.path().join("criu.kdat.tmp");
        std::fs::write(&tmp, b"").unwrap();
        super::unblock_kerndat_cache(dir.path());
        assert!(tmp.exists(), "a CRIU may be writing it now");
        let old = std::time::SystemTime::now() - std::time::Duration::from_secs(120);
        std::fs::File::options().write(true).open(&tmp).unwrap().set_modified(old).unwrap();
        super::unblock_kerndat_cache(dir.path());
        assert!(!tmp.exists(), "left by a CRIU killed two minutes ago");
    }

    #[test]
    fn breakpoints_are_left_out_only_where_the_fault_number_was_read() {
        for v in ["4.0", "4.1.1", "4.2", "4.2.1"] {
            assert_eq!(criu(v).no_breakpoints_fault(), Some("130"), "{v}");
        }
        // A later CRIU may number its faults otherwise; an odd version is not guessed at.
        for v in ["4.3", "5.0", "3.17", "4", "four.two"] {
            assert_eq!(criu(v).no_breakpoints_fault(), None, "{v}");
        }
    }
}

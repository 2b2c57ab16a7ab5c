//! cgroup v2: the group of a restored container, killed whole (its
//! `cgroup.kill`) when the processes of a pid namespace of its own cannot
//! be named by pid from here. Only a group that holds nothing but criuz's
//! own descendants, and not criuz itself, is ever offered for killing.

use crate::proc::holder::descends_from;
use std::path::PathBuf;

/// Why the cgroup of a process is not one criuz may kill.
#[derive(Debug, thiserror::Error)]
pub enum CgroupError {
    /// A file of /proc or of the group could not be read. The message
    /// includes the cause, so it is not chained as a `source` too.
    #[error("{}: {err}", path.display())]
    Unreadable { path: PathBuf, err: std::io::Error },
    /// The process is in no cgroup v2 group (cgroup v1 only).
    #[error("no cgroup v2 group")]
    NoGroup,
    /// The root group, or a path that climbs out of the hierarchy.
    #[error("its cgroup v2 group is {group:?}")]
    RootOrOutside { group: String },
    /// criuz itself is in no cgroup v2 group.
    #[error("criuz is in no cgroup v2 group")]
    CriuzInNoGroup,
    /// criuz is in the group or below it (`cgroup.kill` takes those too).
    #[error("its group {group} holds criuz itself")]
    HoldsCriuz { group: String },
    /// No cgroup v2 hierarchy is mounted whole here.
    #[error("no cgroup v2 mount")]
    NoMount,
    /// The group also holds a process that is not criuz's descendant.
    #[error("its group {group} also holds pid {pid} ({comm}), not one of criuz's")]
    Stranger { group: String, pid: String, comm: String },
    /// The group has no `cgroup.kill` (a kernel before 5.14).
    #[error("{} is missing", .0.display())]
    NoKillFile(PathBuf),
}

/// The `cgroup.kill` of the cgroup v2 group process `pid` is in, if there
/// is one to kill that holds nothing but descendants of `owner` (criuz,
/// which started runc, which started CRIU and, beside CRIU, the restored
/// tree; not without a cgroup v2 mount, not the root group, not a group
/// criuz is in itself); otherwise why not.
pub fn cgroup_kill_of(pid: u32, owner: u32) -> Result<PathBuf, CgroupError> {
    let read = |path: PathBuf| std::fs::read_to_string(&path).map_err(|err| CgroupError::Unreadable { path, err });
    let text = read(PathBuf::from(format!("/proc/{pid}/cgroup")))?;
    let group = text.lines().find_map(|l| l.strip_prefix("0::")).ok_or(CgroupError::NoGroup)?;
    if group == "/" || group.split('/').any(|c| c == "..") {
        return Err(CgroupError::RootOrOutside { group: group.to_string() });
    }
    // cgroup.kill takes the group's descendants too: never one that holds
    // criuz itself (a container run in criuz's own group).
    let own = read(PathBuf::from("/proc/self/cgroup"))?;
    let own = own.lines().find_map(|l| l.strip_prefix("0::")).ok_or(CgroupError::CriuzInNoGroup)?;
    if own == group || own.starts_with(&format!("{group}/")) {
        return Err(CgroupError::HoldsCriuz { group: group.to_string() });
    }
    let dir = cgroup2_mount().ok_or(CgroupError::NoMount)?.join(group.trim_start_matches('/'));
    // Only a group of criuz's own processes: runc moves CRIU into the
    // container's group to restore, and CRIU forks the restored tree's root
    // as its own sibling (a child of runc), so both are there; a CRIU left
    // in a group shared with anything else (cgroups not managed) would make
    // the kill take that too.
    let procs = read(dir.join("cgroup.procs"))?;
    if let Some(other) = procs.split_whitespace().find(|p| stranger_in(group, p, owner)) {
        let comm = std::fs::read_to_string(format!("/proc/{other}/comm")).unwrap_or_default();
        return Err(CgroupError::Stranger {
            group: group.to_string(),
            pid: other.to_string(),
            comm: comm.trim().to_string(),
        });
    }
    let kill = dir.join("cgroup.kill");
    if kill.is_file() {
        Ok(kill)
    } else {
        Err(CgroupError::NoKillFile(kill))
    }
}

/// Whether `pid` (as `cgroup.procs` lists it) is in `group` and does not
/// descend from `owner`. A process gone since the list was read is none: a
/// short-lived child of CRIU's (its action scripts, run at each step of a
/// restore) exits between the list and the look at its parents.
fn stranger_in(group: &str, pid: &str, owner: u32) -> bool {
    let Ok(pid) = pid.parse::<u32>() else { return true };
    if descends_from(pid, owner) {
        return false;
    }
    let now = std::fs::read_to_string(format!("/proc/{pid}/cgroup"));
    now.is_ok_and(|text| text.lines().any(|l| l.strip_prefix("0::") == Some(group)))
}

/// Where the whole cgroup v2 hierarchy is mounted (its root, from
/// mountinfo: id parent dev root mountpoint opts... - fstype source opts).
fn cgroup2_mount() -> Option<PathBuf> {
    let mounts = std::fs::read_to_string("/proc/self/mountinfo").ok()?;
    mounts.lines().find_map(|l| {
        let (pre, post) = l.split_once(" - ")?;
        (post.split(' ').next() == Some("cgroup2") && pre.split(' ').nth(3) == Some("/"))
            .then(|| pre.split(' ').nth(4).map(PathBuf::from))?
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::ffi::OsStringExt;
    use std::os::unix::process::CommandExt;
    use std::path::Path;
    use std::process::{Child, Command};

    /// A cgroup v2 group made for one test, removed (its processes killed
    /// first) when dropped.
    struct TestGroup(PathBuf);

    impl TestGroup {
        fn new(name: &str) -> TestGroup {
            let mount = cgroup2_mount().expect("a cgroup v2 mount (lazy container restores need one)");
            let dir = mount.join(format!("criuz-test-{name}-{}", std::process::id()));
            std::fs::create_dir(&dir).unwrap();
            TestGroup(dir)
        }
        fn admit(&self, pid: u32) {
            std::fs::write(self.0.join("cgroup.procs"), pid.to_string()).unwrap();
        }
    }

    impl Drop for TestGroup {
        fn drop(&mut self) {
            let _ = std::fs::write(self.0.join("cgroup.kill"), "1");
            for _ in 0..500 {
                for sub in std::fs::read_dir(&self.0).into_iter().flatten().flatten() {
                    let _ = std::fs::remove_dir(sub.path());
                }
                if std::fs::remove_dir(&self.0).is_ok() {
                    return;
                }
                std::thread::sleep(std::time::Duration::from_millis(10));
            }
        }
    }

    fn sleeper() -> Child {
        Command::new("sleep").arg("60").spawn().unwrap()
    }

    /// A shell (standing in for CRIU) with a child of its own.
    fn parent_with_child() -> (Child, u32) {
        let sh = Command::new("sh").args(["-c", "sleep 60 & wait"]).spawn().unwrap();
        let mut kid = None;
        for _ in 0..500 {
            let kids = std::fs::read_to_string(format!("/proc/{0}/task/{0}/children", sh.id())).unwrap_or_default();
            kid = kids.split_whitespace().next().map(|k| k.parse().unwrap());
            if kid.is_some() {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        match kid {
            Some(kid) => (sh, kid),
            None => {
                reap(vec![sh]);
                panic!("the shell started no child")
            }
        }
    }

    fn reap(mut children: Vec<Child>) {
        for c in &mut children {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// What `cgroup_kill_of(pid, ..)` says when criuz is in group `dir`: the
    /// test binary runs [`own_group_probe`] there.
    fn probe_in(dir: &Path, pid: u32) -> String {
        let procs = std::ffi::CString::new(dir.join("cgroup.procs").into_os_string().into_vec()).unwrap();
        let mut probe = Command::new(std::env::current_exe().unwrap());
        probe.args(["--exact", "proc::cgroup::tests::own_group_probe", "--ignored", "--nocapture"]);
        probe.env("CRIUZ_PROBE_PID", pid.to_string());
        // Everything in the groups descends from the test: only the rule
        // under test can refuse.
        probe.env("CRIUZ_PROBE_OWNER", std::process::id().to_string());
        // SAFETY: open, write and close are async-signal-safe; `procs` was
        // built before the fork.
        unsafe {
            probe.pre_exec(move || {
                let fd = libc::open(procs.as_ptr(), libc::O_WRONLY | libc::O_CLOEXEC);
                if fd < 0 {
                    return Err(std::io::Error::last_os_error());
                }
                // "0": the writer itself.
                let n = libc::write(fd, b"0".as_ptr().cast(), 1);
                libc::close(fd);
                if n == 1 {
                    Ok(())
                } else {
                    Err(std::io::Error::last_os_error())
                }
            })
        };
        let out = probe.output().unwrap();
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        assert!(out.status.success(), "{text}");
        text
    }

    #[test]
    #[ignore = "run by a_group_criuz_is_in_is_never_killed, in a group of its own"]
    fn own_group_probe() {
        let var = |name: &str| match std::env::var(name).map(|p| p.parse().unwrap()) {
            Ok(0) | Err(_) => std::process::id(),
            Ok(p) => p,
        };
        println!("probe: {:?}", cgroup_kill_of(var("CRIUZ_PROBE_PID"), var("CRIUZ_PROBE_OWNER")).ok());
    }

    #[test]
    fn a_group_criuz_is_in_is_never_killed() {
        // Each group below holds nothing but processes of the test's own:
        // every other rule would let it be killed.
        let group = TestGroup::new("own");
        let text = probe_in(&group.0, 0);
        assert!(text.contains("probe: None"), "{text}");
        // criuz in a group below the one asked about (cgroup.kill takes the
        // descendant groups too).
        let below = group.0.join("criuz");
        std::fs::create_dir(&below).unwrap();
        let child = sleeper();
        group.admit(child.id());
        assert_eq!(
            cgroup_kill_of(child.id(), std::process::id()).map_err(|e| e.to_string()),
            Ok(group.0.join("cgroup.kill"))
        );
        let text = probe_in(&below, child.id());
        assert!(text.contains("probe: None"), "{text}");
        drop(group);
        reap(vec![child]);
    }

    /// A process of the test's own making that is not its descendant (a
    /// shell's background child, orphaned when the shell exits).
    fn stranger() -> u32 {
        let out = Command::new("sh").args(["-c", "sleep 60 >/dev/null 2>&1 & echo $!"]).output().unwrap();
        String::from_utf8_lossy(&out.stdout).trim().parse().unwrap()
    }

    #[test]
    fn only_a_group_of_criuz_s_own_processes_is_killed() {
        let me = std::process::id();
        let group = TestGroup::new("private");
        let (criu, kid) = parent_with_child();
        group.admit(criu.id());
        group.admit(kid);
        assert_eq!(cgroup_kill_of(criu.id(), me).map_err(|e| e.to_string()), Ok(group.0.join("cgroup.kill")));
        // CRIU's sibling (the restored tree's root, a child of runc).
        let sibling = sleeper();
        group.admit(sibling.id());
        assert_eq!(cgroup_kill_of(criu.id(), me).map_err(|e| e.to_string()), Ok(group.0.join("cgroup.kill")));
        // Anything else in the group (cgroups not managed, a group shared
        // with another container): the group is refused, not killed.
        let stranger = stranger();
        group.admit(stranger);
        let why = cgroup_kill_of(criu.id(), me).unwrap_err().to_string();
        assert!(why.contains(&format!("pid {stranger}")), "{why}");
        // Gone since the group's list was read: no stranger (one of CRIU's
        // action scripts ended meanwhile).
        let group_name = format!("/{}", group.0.file_name().unwrap().to_string_lossy());
        assert!(stranger_in(&group_name, &stranger.to_string(), me));
        let ended = sleeper();
        let gone = ended.id();
        reap(vec![ended]);
        assert!(!stranger_in(&group_name, &gone.to_string(), me));
        drop(group);
        reap(vec![criu, sibling]);
    }
}

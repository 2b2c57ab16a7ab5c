//! The memory criuz may count on: the machine's (`/proc/meminfo`), and,
//! where criuz runs in a memory cgroup (a container, a pod, a systemd
//! slice), what that group and each group above it leave. A dump sized by
//! the machine alone, inside a group with a limit, could take the group
//! over its limit, and the kernel's OOM killer then kills the biggest
//! process there: often the very process being checkpointed.
//!
//! A group's headroom is its limit less what it uses, page cache that can
//! be dropped (its inactive file pages) not counted as used, as the
//! kubelet counts a pod's working set. cgroup v1 (`memory.limit_in_bytes`)
//! and v2 (`memory.max`) are read alike; where no group can be read, the
//! machine's figures stand.
//!
//! A limit on criuz's own address space (`ulimit -v`, as batch schedulers
//! set for a job) bounds it too: half of what is left of it, the other half
//! for thread stacks, allocator arenas and what the budget does not count.
//! A budget past it failed an allocation mid-dump, which aborts the process
//! (no unwinding from an allocation failure).
//!
//! Beside those: criuz's own peak memory (for `dump --json`), and the
//! machine's count of OOM kills, noted at the start, so that a process
//! killed under CRIU can be told apart from one the OOM killer ended.

use crate::criu::images::DumpedMemoryLimit;
use std::path::{Path, PathBuf};

/// Bytes criuz may still take: the machine's `MemAvailable`, or less where
/// a memory cgroup above criuz leaves less.
pub fn available() -> u64 {
    let machine = meminfo("MemAvailable:").unwrap_or(0);
    let room = groups().iter().filter_map(|g| g.headroom()).fold(machine, u64::min);
    address_space_left().map_or(room, |left| room.min(left / 2))
}

/// What criuz's address-space limit (`RLIMIT_AS`) leaves of it now, if it
/// has one.
pub fn address_space_left() -> Option<u64> {
    let mut limit = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit writes into the struct we pass.
    if unsafe { libc::getrlimit(libc::RLIMIT_AS, &mut limit) } != 0 || limit.rlim_cur == libc::RLIM_INFINITY {
        return None;
    }
    Some(limit.rlim_cur.saturating_sub(address_space_used()))
}

/// The least address space criuz starts with: its threads, one allocator
/// arena and the smallest pipeline. Below it a dump failed an allocation at
/// random (an abort), so a limit that leaves less is refused at the start.
/// By measurement (a 256 MiB process dumped five times a limit): a limit of
/// 70 MiB aborted 4 of 5, 90 MiB failed 2 of 5, 100 and 120 MiB never; criuz
/// starts at about 21 MiB.
pub const LEAST_ADDRESS_SPACE: u64 = 96 << 20;

/// An error if criuz's address-space limit leaves it less than
/// [`LEAST_ADDRESS_SPACE`].
pub fn check_address_space() -> crate::error::Result<()> {
    match address_space_left() {
        Some(left) if left < LEAST_ADDRESS_SPACE => Err(crate::error::Error::Io(std::io::Error::new(
            std::io::ErrorKind::OutOfMemory,
            format!(
                "an address space of at least {} MiB is needed, and criuz's limit (ulimit -v) leaves {} MiB",
                LEAST_ADDRESS_SPACE >> 20,
                left >> 20
            ),
        ))),
        _ => Ok(()),
    }
}

/// criuz's address space now (`VmSize`).
fn address_space_used() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmSize:"))
        .and_then(|v| v.split_whitespace().next()?.parse::<u64>().ok())
        .unwrap_or(0)
        .saturating_mul(1024)
}

/// The memory criuz runs in: the machine's `MemTotal`, or the lowest limit
/// of the memory cgroups above criuz.
pub fn total() -> u64 {
    let machine = meminfo("MemTotal:").unwrap_or(0);
    groups().iter().filter_map(|g| g.limit()).fold(machine, u64::min)
}

/// The memory the machine can still give: what it has available (free,
/// and page cache it can drop) and its free swap. A tree larger than that
/// is OOM-killed as it comes back, or another process for it.
pub fn machine_room() -> u64 {
    meminfo("MemAvailable:").unwrap_or(u64::MAX).saturating_add(meminfo("SwapFree:").unwrap_or(0))
}

/// Huge pages of `size` bytes the system's pool can still give: the free
/// ones less those already promised to mappings (`resv_hugepages`); 0 where
/// the system has no pool of that size. `None` where the pools cannot be
/// read at all (no sysfs, as in some containers): unknown, not empty.
pub fn huge_page_room(size: u64) -> Option<u64> {
    const POOLS: &str = "/sys/kernel/mm/hugepages";
    let dir = format!("{POOLS}/hugepages-{}kB", size >> 10);
    let read = |file: &str| std::fs::read_to_string(format!("{dir}/{file}")).ok()?.trim().parse::<u64>().ok();
    match read("free_hugepages") {
        Some(free) => Some(free.saturating_sub(read("resv_hugepages").unwrap_or(0))),
        None => std::path::Path::new(POOLS).is_dir().then_some(0),
    }
}

/// The system's default huge page size, for a mapping that names none.
pub fn default_huge_page_size() -> u64 {
    meminfo("Hugepagesize:").unwrap_or(2 << 20)
}

/// Where memory is charged, for [`rooms_for`].
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum ChargedTo {
    /// criuz's memory cgroup (what CRIU's restored tree inherits).
    Own,
    /// The memory cgroup at `path` (as /proc/PID/cgroup names it) of the
    /// v1 memory hierarchy, or of v2's (`v2`).
    Group { path: String, v2: bool },
}

/// The memory cgroups that bound memory charged `to`, its own group first,
/// each with the room its limit leaves (`Group::room`). A group that is not
/// there is made by CRIU as it restores, with the limit it was dumped with
/// where `made` (the dumped groups' limits) gives one: all of it is room.
pub fn rooms_for(to: &ChargedTo, made: &[DumpedMemoryLimit]) -> Vec<(PathBuf, u64)> {
    let swap = meminfo("SwapTotal:").unwrap_or(0);
    let (groups, mut rooms) = match to {
        ChargedTo::Own => (groups(), Vec::new()),
        // Read beside a crafted archive's path: nothing outside the hierarchy.
        ChargedTo::Group { path, .. } if path.split('/').any(|c| c == "..") => (Vec::new(), Vec::new()),
        ChargedTo::Group { path: dumped, v2 } => {
            let named = if *v2 { format!("0::{dumped}\n") } else { format!("1:memory:{dumped}\n") };
            let mounts = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
            let Some((mount, path, v2)) = memory_group(&named, &mounts) else { return Vec::new() };
            let mut dir = mount.join(path.trim_start_matches('/'));
            let mut dumped = dumped.trim_end_matches('/').to_string();
            let mut anew = Vec::new();
            while !dir.is_dir() && dir.starts_with(&mount) {
                if let Some(m) = made.iter().find(|m| m.path == dumped && m.v2 == v2) {
                    anew.push((dir.clone(), made_room(m, swap)));
                }
                dumped.truncate(dumped.rfind('/').unwrap_or(0));
                if !dir.pop() {
                    break;
                }
            }
            (chain(&mount, dir, v2), anew)
        }
    };
    rooms.extend(groups.into_iter().filter_map(|g| g.room(swap).map(|room| (g.dir, room))));
    rooms
}

/// Where runc puts a container's memory cgroup: at `cgroups_path`
/// (config.json's `linux.cgroupsPath`, else the container's id) from the
/// hierarchy's root where it is absolute, below runc's own group (criuz's,
/// which runc inherits) where it is relative, as libcontainer's cgroup
/// managers place it. `None` where there is no memory hierarchy.
pub fn container_group(cgroups_path: &str) -> Option<ChargedTo> {
    let own = std::fs::read_to_string("/proc/self/cgroup").ok()?;
    let mounts = std::fs::read_to_string("/proc/self/mountinfo").ok()?;
    let (_, _, v2) = memory_group(&own, &mounts)?;
    let path = if cgroups_path.starts_with('/') {
        cgroups_path.to_string()
    } else {
        let (mine, _) = named_path(&own)?;
        format!("{}/{cgroups_path}", mine.trim_end_matches('/'))
    };
    Some(ChargedTo::Group { path, v2 })
}

/// The room of a group CRIU makes anew with limit `m`: all of it, with
/// the swap it may use (as `Group::room` counts it).
fn made_room(m: &DumpedMemoryLimit, swap: u64) -> u64 {
    match (m.v2, m.swap) {
        (true, swap_max) => m.limit.saturating_add(swap_max.map_or(swap, |s| s.min(swap))),
        (false, Some(memsw)) => memsw,
        (false, None) => m.limit.saturating_add(swap),
    }
}

/// criuz's own peak resident memory so far, in bytes (`ru_maxrss` of
/// `RUSAGE_SELF`: the CRIU it ran is not counted, nor any other child).
pub fn own_peak_rss() -> u64 {
    // SAFETY: an all-zero rusage is valid; getrusage fills it.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: getrusage writes into the struct we pass.
    if unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut usage) } != 0 {
        return 0;
    }
    (usage.ru_maxrss.max(0) as u64).saturating_mul(1024)
}

/// The OOM kills the machine had counted when [`note_oom_kills`] ran.
static OOM_KILLS_NOTED: std::sync::OnceLock<u64> = std::sync::OnceLock::new();

/// Notes the OOM kills the machine has counted so far (`oom_kill` of
/// /proc/vmstat, memory cgroups' kills included), once per process: a CRIU
/// that later fails on a process "killed by signal 9" can then say whether
/// the OOM killer did it ([`oom_kills_since_noted`]).
pub fn note_oom_kills() {
    OOM_KILLS_NOTED.get_or_init(|| vmstat("oom_kill").unwrap_or(u64::MAX));
}

/// The OOM kills the machine has counted since [`note_oom_kills`]; `None`
/// where it was not called or /proc/vmstat cannot say.
pub fn oom_kills_since_noted() -> Option<u64> {
    let noted = *OOM_KILLS_NOTED.get()?;
    Some(vmstat("oom_kill")?.saturating_sub(noted))
}

fn vmstat(field: &str) -> Option<u64> {
    named_value(&std::fs::read_to_string("/proc/vmstat").ok()?, field)
}

fn meminfo(field: &str) -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with(field))?;
    Some(line.split_whitespace().nth(1)?.parse::<u64>().ok()?.saturating_mul(1024))
}

/// One memory cgroup's directory, and its version's file names.
struct Group {
    dir: PathBuf,
    v2: bool,
}

impl Group {
    fn read(&self, name: &str) -> Option<u64> {
        let text = std::fs::read_to_string(self.dir.join(name)).ok()?;
        // v2 says "max" for no limit; v1 gives a number near 2^63.
        text.trim().parse().ok().filter(|&n: &u64| n < 1 << 60)
    }

    fn limit(&self) -> Option<u64> {
        self.read(if self.v2 { "memory.max" } else { "memory.limit_in_bytes" })
    }

    /// The processes its OOM killer has killed (v1: `oom_kill` of
    /// `memory.oom_control`; v2: of `memory.events`).
    fn oom_kills(&self) -> u64 {
        let file = if self.v2 { "memory.events" } else { "memory.oom_control" };
        stat_field(&std::fs::read_to_string(self.dir.join(file)).unwrap_or_default(), "oom_kill")
    }

    /// What more its processes may hold before its OOM killer kills one:
    /// its limit, counting what it may swap (v1 bounds memory and swap
    /// together where it accounts swap; v2 bounds swap alone), less what it
    /// holds that cannot be dropped (all but its file cache). `None`: no
    /// limit.
    fn room(&self, swap: u64) -> Option<u64> {
        let limit = self.limit()?;
        let stat = std::fs::read_to_string(self.dir.join("memory.stat")).unwrap_or_default();
        let (limit, held) = if self.v2 {
            let limit = limit.saturating_add(self.read("memory.swap.max").map_or(swap, |s| s.min(swap)));
            let held = self.read("memory.current").unwrap_or(0) + self.read("memory.swap.current").unwrap_or(0);
            (limit, held.saturating_sub(stat_field(&stat, "active_file") + stat_field(&stat, "inactive_file")))
        } else {
            let (limit, held) = match self.read("memory.memsw.limit_in_bytes") {
                Some(memsw) => (memsw, self.read("memory.memsw.usage_in_bytes")),
                None => (limit.saturating_add(swap), self.read("memory.usage_in_bytes")),
            };
            let cache = stat_field(&stat, "total_active_file") + stat_field(&stat, "total_inactive_file");
            (limit, held.unwrap_or(0).saturating_sub(cache))
        };
        Some(limit.saturating_sub(held))
    }

    fn headroom(&self) -> Option<u64> {
        let limit = self.limit()?;
        let used = self.read(if self.v2 { "memory.current" } else { "memory.usage_in_bytes" }).unwrap_or(0);
        let stat = std::fs::read_to_string(self.dir.join("memory.stat")).unwrap_or_default();
        let droppable = stat_field(&stat, if self.v2 { "inactive_file" } else { "total_inactive_file" });
        Some(limit.saturating_sub(used.saturating_sub(droppable)))
    }
}

fn stat_field(stat: &str, name: &str) -> u64 {
    named_value(stat, name).unwrap_or(0)
}

/// The value of the `name value` line of `text` (memory.stat, /proc/vmstat).
fn named_value(text: &str, name: &str) -> Option<u64> {
    text.lines().find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.trim().parse().ok())
}

/// Process `pid`'s memory cgroup and each group above it, with the OOM
/// kills each has counted. A process that has exited reads as being in the
/// root group (v1): read it while it lives.
pub fn oom_kills_of(pid: i32) -> Vec<(PathBuf, u64)> {
    groups_of(&pid.to_string()).into_iter().map(|g| (g.oom_kills(), g.dir)).map(|(n, d)| (d, n)).collect()
}

/// The OOM kills memory cgroup `dir` has counted (0 where it cannot say).
pub fn oom_kills_in(dir: &Path) -> u64 {
    Group { dir: dir.to_path_buf(), v2: dir.join("memory.events").exists() }.oom_kills()
}

/// criuz's memory cgroup and every group above it, in the hierarchy that
/// has the memory controller (v1's `memory`, else v2's).
fn groups() -> Vec<Group> {
    groups_of("self")
}

/// Process `pid`'s ("self": criuz's) memory cgroup and every group above
/// it, its own first.
fn groups_of(pid: &str) -> Vec<Group> {
    let own = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).unwrap_or_default();
    let mounts = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    let Some((mount, path, v2)) = memory_group(&own, &mounts) else { return Vec::new() };
    chain(&mount, mount.join(path.trim_start_matches('/')), v2)
}

/// Group `dir` of the hierarchy mounted at `mount`, and each above it.
fn chain(mount: &Path, mut dir: PathBuf, v2: bool) -> Vec<Group> {
    let mut out = Vec::new();
    while dir.starts_with(mount) {
        out.push(Group { dir: dir.clone(), v2 });
        if !dir.pop() {
            break;
        }
    }
    out
}

/// From `/proc/self/cgroup` and `/proc/self/mountinfo`: where the memory
/// hierarchy is mounted, criuz's group's path below that mount, and
/// whether it is cgroup v2.
fn memory_group(own: &str, mounts: &str) -> Option<(PathBuf, String, bool)> {
    // id parent dev root mountpoint opts... - fstype source superopts
    let mount_of = |v2: bool| {
        mounts.lines().find_map(|l| {
            let (pre, post) = l.split_once(" - ")?;
            let mut post = post.split(' ');
            let fstype = post.next()?;
            let superopts = post.nth(1).unwrap_or_default();
            let fits = if v2 {
                fstype == "cgroup2"
            } else {
                fstype == "cgroup" && superopts.split(',').any(|o| o == "memory")
            };
            let mut pre = pre.split(' ');
            let root = pre.nth(3)?;
            let mountpoint = pre.next()?;
            fits.then(|| (PathBuf::from(mountpoint), root.to_string()))
        })
    };
    let below = |path: &str, root: &str| -> String {
        // A mount of a group below the hierarchy's root (a container's
        // view) shows that group's path as its root.
        let rest = if root == "/" { Some(path) } else { path.strip_prefix(root) };
        rest.unwrap_or("/").to_string()
    };
    let (path, v2) = named_path(own)?;
    if !v2 {
        let (mount, root) = mount_of(false)?;
        return Some((mount, below(path, &root), false));
    }
    let (mount, root) = mount_of(true)?;
    Path::new(&mount).join("cgroup.controllers").exists().then_some(())?;
    Some((mount, below(path, &root), true))
}

/// The memory group's path as a `/proc/PID/cgroup` text names it: v1's
/// `memory` hierarchy's, else v2's (`true`).
fn named_path(own: &str) -> Option<(&str, bool)> {
    let v1 = own.lines().find_map(|l| {
        let mut f = l.splitn(3, ':');
        let (_, controllers, path) = (f.next()?, f.next()?, f.next()?);
        controllers.split(',').any(|c| c == "memory").then_some(path)
    });
    match v1 {
        Some(path) => Some((path, false)),
        None => Some((own.lines().find_map(|l| l.strip_prefix("0::"))?, true)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn own_peak_memory_counts_what_this_process_touched() {
        let touched = vec![1u8; 64 << 20];
        assert!(own_peak_rss() >= 64 << 20, "{} bytes after touching 64 MiB", own_peak_rss());
        drop(std::hint::black_box(touched));
    }

    #[test]
    fn a_pool_of_huge_pages_the_system_lacks_has_no_room() {
        assert!(std::path::Path::new("/sys/kernel/mm/hugepages").is_dir(), "sysfs here");
        assert_eq!(huge_page_room(1 << 40), Some(0), "no pool of 1 TiB pages");
        assert!(huge_page_room(default_huge_page_size()).is_some());
    }

    const MOUNTS: &str = "\
25 20 0:22 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw
30 20 0:27 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory
31 20 0:28 / /sys/fs/cgroup/pids rw,relatime - cgroup cgroup rw,pids
";

    #[test]
    fn the_memory_group_is_found_in_either_hierarchy() {
        let v1 = "12:pids:/a\n9:memory:/pod/box\n0::/pod/box\n";
        assert_eq!(memory_group(v1, MOUNTS), Some((PathBuf::from("/sys/fs/cgroup/memory"), "/pod/box".into(), false)));
        // A container's view: the hierarchy mounted from its own group.
        let inside = "30 20 0:27 /pod/box /sys/fs/cgroup/memory rw - cgroup cgroup rw,memory\n";
        assert_eq!(
            memory_group("9:memory:/pod/box/app\n", inside),
            Some((PathBuf::from("/sys/fs/cgroup/memory"), "/app".into(), false))
        );
        assert_eq!(memory_group("12:pids:/a\n", MOUNTS), None, "no memory line, no v2 line");
        assert_eq!(named_path(v1), Some(("/pod/box", false)));
        assert_eq!(named_path("12:pids:/a\n0::/user.slice/x\n"), Some(("/user.slice/x", true)));
        // A container's group: where runc puts it, below criuz's own group
        // unless its path is absolute.
        let Some((own, v2)) = std::fs::read_to_string("/proc/self/cgroup").ok().and_then(|o| {
            let (p, v2) = named_path(&o)?;
            Some((p.trim_end_matches('/').to_string(), v2))
        }) else {
            return;
        };
        if memory_group(
            &std::fs::read_to_string("/proc/self/cgroup").unwrap(),
            &std::fs::read_to_string("/proc/self/mountinfo").unwrap(),
        )
        .is_some()
        {
            assert_eq!(container_group("box"), Some(ChargedTo::Group { path: format!("{own}/box"), v2 }));
            assert_eq!(container_group("/pods/box"), Some(ChargedTo::Group { path: "/pods/box".into(), v2 }));
        }
        assert_eq!(stat_field("cache 5\ntotal_inactive_file 4096\ninactive_file 1\n", "total_inactive_file"), 4096);
        assert_eq!(stat_field("inactive_file_x 3\ninactive_file 7\n", "inactive_file"), 7);
    }

    #[test]
    fn a_groups_room_is_its_limit_less_what_it_cannot_drop() {
        let dir = tempfile::tempdir().unwrap();
        let put = |name: &str, text: &str| std::fs::write(dir.path().join(name), text).unwrap();
        let v2 = Group { dir: dir.path().to_path_buf(), v2: true };
        put("memory.max", "max\n");
        assert_eq!(v2.room(0), None, "no limit");
        put("memory.max", "1000000\n");
        put("memory.current", "700000\n");
        put("memory.stat", "anon 400000\nactive_file 100000\ninactive_file 200000\n");
        assert_eq!(v2.room(0), Some(600_000), "file cache can be dropped");
        put("memory.swap.max", "50000\n");
        put("memory.swap.current", "10000\n");
        assert_eq!(v2.room(1 << 20), Some(640_000), "the swap it may use");
        let v1 = Group { dir: dir.path().to_path_buf(), v2: false };
        put("memory.limit_in_bytes", "1000000\n");
        put("memory.usage_in_bytes", "700000\n");
        put("memory.stat", "cache 300000\ntotal_active_file 100000\ntotal_inactive_file 200000\ntotal_shmem 0\n");
        assert_eq!(v1.room(0), Some(600_000));
        put("memory.memsw.limit_in_bytes", "1200000\n");
        put("memory.memsw.usage_in_bytes", "800000\n");
        assert_eq!(v1.room(1 << 20), Some(700_000), "memory and swap bounded together");
        let _ = rooms_for(&ChargedTo::Own, &[]);
        assert_eq!(rooms_for(&ChargedTo::Group { path: "/../../etc".into(), v2: false }, &[]), Vec::new());
    }

    #[test]
    fn a_group_limit_caps_the_machine_figures() {
        let dir = tempfile::tempdir().unwrap();
        let g = Group { dir: dir.path().to_path_buf(), v2: true };
        std::fs::write(dir.path().join("memory.max"), "max\n").unwrap();
        assert_eq!((g.limit(), g.headroom()), (None, None), "no limit");
        std::fs::write(dir.path().join("memory.max"), "419430400\n").unwrap();
        std::fs::write(dir.path().join("memory.current"), "300000000\n").unwrap();
        std::fs::write(dir.path().join("memory.stat"), "anon 1\ninactive_file 100000000\n").unwrap();
        assert_eq!(g.limit(), Some(419_430_400));
        assert_eq!(g.headroom(), Some(419_430_400 - 200_000_000), "droppable cache is not counted as used");
        let v1 = Group { dir: dir.path().to_path_buf(), v2: false };
        std::fs::write(dir.path().join("memory.limit_in_bytes"), "9223372036854771712\n").unwrap();
        assert_eq!(v1.limit(), None, "v1's unlimited");
        assert!(available() <= meminfo("MemAvailable:").unwrap() && total() <= meminfo("MemTotal:").unwrap());
    }

    /// In a child (the limit is the process's): under `ulimit -v`, half
    /// of what is left of the address space bounds what criuz counts on.
    #[test]
    fn an_address_space_limit_caps_the_memory_counted_on() {
        assert_eq!(address_space_left(), None, "the test runs without a limit");
        // SAFETY: the child only calls setrlimit, reads /proc and exits.
        let child = unsafe { libc::fork() };
        if child == 0 {
            let limit = address_space_used() + (400 << 20);
            let rlimit = libc::rlimit { rlim_cur: limit, rlim_max: limit };
            // SAFETY: setrlimit reads the struct we pass.
            let ok = unsafe { libc::setrlimit(libc::RLIMIT_AS, &rlimit) } == 0
                && address_space_left().is_some_and(|left| (380 << 20..=400 << 20).contains(&left))
                && available() <= 200 << 20;
            // SAFETY: ends the forked child at once.
            unsafe { libc::_exit(if ok { 0 } else { 1 }) }
        }
        let mut status = 0;
        // SAFETY: waits for our own child.
        assert_eq!(unsafe { libc::waitpid(child, &mut status, 0) }, child);
        assert!(libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0, "status {status:#x}");
    }
}

//! Who the checkpointed processes are: the process tree (pstree.img), each
//! task's core (how it was stopped, its stack pointer, its cgroup set), and
//! the cgroups a dump recorded (their memory limits and paths).

use super::proto::*;
use prost::Message;

/// Every process and thread id of a checkpointed tree (pstree.img);
/// `None` if the image is not as expected.
pub fn pstree_pids(img: &[u8]) -> Option<Vec<u32>> {
    let mut pids = Vec::new();
    for obj in objects(img, PSTREE_MAGIC)? {
        let e = PstreeEntry::decode(obj).ok()?;
        pids.push(e.pid);
        pids.extend(e.threads.into_iter().filter(|&t| t != e.pid));
    }
    Some(pids)
}

/// Every process of a checkpointed tree with its parent's pid (0 for the
/// root), parents first (pstree.img); `None` if the image is not as
/// expected.
pub fn pstree_parents(img: &[u8]) -> Option<Vec<(u32, u32)>> {
    objects(img, PSTREE_MAGIC)?.into_iter().map(|obj| PstreeEntry::decode(obj).ok().map(|e| (e.pid, e.ppid))).collect()
}

/// The thread ids of process `pid` (pstree.img); `None` if the image is not
/// as expected or does not hold `pid`.
pub fn pstree_threads(img: &[u8], pid: u32) -> Option<Vec<u32>> {
    for obj in objects(img, PSTREE_MAGIC)? {
        let e = PstreeEntry::decode(obj).ok()?;
        if e.pid == pid {
            return Some(if e.threads.is_empty() { vec![pid] } else { e.threads });
        }
    }
    None
}

/// CRIU's task state of a process dumped stopped (compel's
/// `COMPEL_TASK_STOPPED`).
pub(super) const TASK_STOPPED: u32 = 3;

/// The signal that had stopped a process dumped stopped (SIGSTOP, SIGTSTP,
/// ...: CRIU stops it with the same one as it restores it), from its
/// main thread's core image; `None` for one that ran (or an image not as
/// expected).
pub fn core_stopped_by(core: &[u8]) -> Option<i32> {
    let tc = CoreEntry::decode(*objects(core, CORE_MAGIC)?.first()?).ok()?.tc?;
    if tc.task_state? != TASK_STOPPED {
        return None;
    }
    Some(tc.stop_signo.filter(|&s| s > 0).map_or(libc::SIGSTOP, |s| s as i32))
}

/// The cgroup set a process was dumped in (its main thread's core image:
/// per thread since CRIU 3.x, in the task's part before; 0: none of its
/// own, as a zombie's), to look up in cgroup.img.
pub fn core_cg_set(core: &[u8]) -> Option<u32> {
    let c = CoreEntry::decode(*objects(core, CORE_MAGIC)?.first()?).ok()?;
    let per_thread = c.thread_core.and_then(|t| t.cg_set);
    Some(per_thread.or_else(|| c.tc.and_then(|t| t.cg_set)).unwrap_or(0))
}

/// The cgroup set CRIU itself ran in at the dump (inventory.img): a
/// process in that set inherits its cgroups from whatever restores it.
pub fn inventory_root_cg_set(img: &[u8]) -> Option<u32> {
    if u32::from_ne_bytes(img.get(0..4)?.try_into().ok()?) != INVENTORY_MAGIC {
        return None;
    }
    let len = u32::from_ne_bytes(img.get(4..8)?.try_into().ok()?) as usize;
    InventoryEntry::decode(img.get(8..8 + len)?).ok()?.root_cg_set
}

/// A memory cgroup's limits as dumped (cgroup.img), which CRIU gives the
/// group where it makes it anew at the restore.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct DumpedMemoryLimit {
    /// Its path in the memory hierarchy (v1's, or v2's with `v2`).
    pub path: String,
    pub v2: bool,
    /// `memory.limit_in_bytes` (v1) or `memory.max` (v2).
    pub limit: u64,
    /// `memory.memsw.limit_in_bytes` (v1: memory and swap) or
    /// `memory.swap.max` (v2: swap alone), where dumped.
    pub swap: Option<u64>,
}

/// Every memory cgroup with a limit among those dumped (cgroup.img's
/// directories of the memory controller, v1's or v2's); empty where the
/// image says none or is not as expected.
pub fn cgroup_dumped_memory_limits(img: &[u8]) -> Vec<DumpedMemoryLimit> {
    let Some(entry) = objects(img, CGROUP_MAGIC).and_then(|o| CgroupEntry::decode(*o.first()?).ok()) else {
        return Vec::new();
    };
    fn walk(dirs: &[CgroupDirEntry], above: &str, v2: bool, out: &mut Vec<DumpedMemoryLimit>) {
        let (limit_name, swap_name) = if v2 {
            ("memory.max", "memory.swap.max")
        } else {
            ("memory.limit_in_bytes", "memory.memsw.limit_in_bytes")
        };
        for d in dirs {
            let path = format!("{above}/{}", d.dir_name.trim_matches('/'));
            // "max" (v2) or v1's near 2^63: no limit.
            let value = |name: &str| {
                d.properties.iter().find(|p| p.name == name)?.value.trim().parse::<u64>().ok().filter(|&n| n < 1 << 60)
            };
            if let Some(limit) = value(limit_name) {
                out.push(DumpedMemoryLimit { path: path.clone(), v2, limit, swap: value(swap_name) });
            }
            walk(&d.children, &path, v2, out);
        }
    }
    let mut out = Vec::new();
    for c in &entry.controllers {
        let v1 = c.cnames.iter().any(|n| n.split(',').any(|n| n == "memory"));
        let v2 = c.cnames.iter().all(|n| n.is_empty());
        if v1 || v2 {
            walk(&c.dirs, "", !v1, &mut out);
        }
    }
    out
}

/// The memory cgroup of each cgroup set (cgroup.img): set id -> (its path
/// in the memory hierarchy, whether that is cgroup v2's). A set without
/// one is left out; `None` if the image is not as expected.
pub fn cgroup_memory_paths(img: &[u8]) -> Option<Vec<(u32, String, bool)>> {
    let entry = CgroupEntry::decode(*objects(img, CGROUP_MAGIC)?.first()?).ok()?;
    let memory_of = |set: &CgSetEntry| {
        let v1 = set.ctls.iter().find(|c| c.name.split(',').any(|n| n == "memory"));
        // v2's one hierarchy has no controller name.
        v1.map(|c| (c.path.clone(), false))
            .or_else(|| set.ctls.iter().find(|c| c.name.is_empty()).map(|c| (c.path.clone(), true)))
    };
    Some(entry.sets.iter().filter_map(|set| memory_of(set).map(|(path, v2)| (set.id, path, v2))).collect())
}

/// The stack pointer a thread was dumped with (`core-<tid>.img`); x86_64
/// only, `None` otherwise or if the image is not as expected.
pub fn core_stack_pointer(core: &[u8]) -> Option<u64> {
    let c = CoreEntry::decode(*objects(core, CORE_MAGIC)?.first()?).ok()?;
    if c.mtype != MARCH_X86_64 {
        return None;
    }
    c.thread_info?.gpregs?.sp
}

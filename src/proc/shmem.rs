//! The shared memory objects a tree maps whose content CRIU dumps whole:
//! anonymous shared memory (`/dev/zero (deleted)` in /proc/PID/maps),
//! System V segments (`/SYSV…`) and memfds (`/memfd:…`). CRIU writes every
//! page such an object holds, but a process's resident set counts only the
//! pages that process has touched: PostgreSQL's shared buffers, filled by
//! backends that have since exited, were 556 MiB of a dump whose tree's
//! `VmRSS` added up to about 120 MiB.
//!
//! Each object is counted once (by device and inode, however many
//! processes map it), by what it has allocated (`st_blocks` of its
//! `/proc/PID/map_files` link, which needs the root a dump runs with; an
//! object that cannot be read counts nothing, as before). Pages of it that
//! a process also maps are counted in that process's resident set too: an
//! estimate that errs high, which costs only a larger reservation from
//! the machine's share (`budget`), where one that errs low compresses
//! pages in haste and then again. Objects held only as descriptors, and
//! System V segments no process attaches, are not found.

use std::collections::HashSet;
use std::os::unix::fs::MetadataExt;

/// Bytes the shared memory objects mapped by `pids` hold (each once).
pub(crate) fn dumped_shared_bytes(pids: &[i32]) -> u64 {
    let mut seen = HashSet::new();
    let mut total = 0u64;
    for pid in pids {
        let Ok(maps) = std::fs::read_to_string(format!("/proc/{pid}/maps")) else { continue };
        for object in maps.lines().filter_map(SharedObject::parse) {
            if seen.contains(&(object.device, object.inode)) {
                continue;
            }
            // Counted where it can be read: a process that exited meanwhile
            // leaves the object to the next one that maps it.
            let link = format!("/proc/{pid}/map_files/{:x}-{:x}", object.start, object.end);
            if let Ok(meta) = std::fs::metadata(link) {
                seen.insert((object.device, object.inode));
                total = total.saturating_add(meta.blocks().saturating_mul(512));
            }
        }
    }
    total
}

/// One line of /proc/PID/maps that maps a shared memory object CRIU dumps.
#[derive(Debug, PartialEq)]
struct SharedObject {
    start: u64,
    end: u64,
    /// Major and minor number.
    device: (u32, u32),
    inode: u64,
}

impl SharedObject {
    /// `start-end perms offset device inode path`; `None` for any other
    /// mapping (private anonymous memory is in the resident set already,
    /// file contents stay in their files).
    fn parse(line: &str) -> Option<SharedObject> {
        let mut fields = line.splitn(6, ' ');
        let (range, perms, _offset, device, inode) =
            (fields.next()?, fields.next()?, fields.next()?, fields.next()?, fields.next()?);
        let path = fields.next()?.trim_start();
        let shared_anonymous = perms.ends_with('s') && path == "/dev/zero (deleted)";
        let dumped_whole = path.starts_with("/SYSV") || path.starts_with("/memfd:");
        if !(shared_anonymous || dumped_whole) {
            return None;
        }
        let (start, end) = range.split_once('-')?;
        let (major, minor) = device.split_once(':')?;
        Some(SharedObject {
            start: u64::from_str_radix(start, 16).ok()?,
            end: u64::from_str_radix(end, 16).ok()?,
            device: (u32::from_str_radix(major, 16).ok()?, u32::from_str_radix(minor, 16).ok()?),
            inode: inode.parse().ok()?,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shared_objects_criu_dumps_are_found_in_maps_lines() {
        let object = |line| SharedObject::parse(line).map(|o| (o.start, o.end, o.device, o.inode));
        assert_eq!(
            object("7fc002a2f000-7fc02bc00000 rw-s 00000000 00:01 4                          /dev/zero (deleted)"),
            Some((0x7fc0_02a2_f000, 0x7fc0_2bc0_0000, (0, 1), 4))
        );
        assert_eq!(
            object("7f00aa000000-7f00aa001000 rw-s 00000000 00:01 9                          /SYSV00994149 (deleted)"),
            Some((0x7f00_aa00_0000, 0x7f00_aa00_1000, (0, 1), 9))
        );
        assert_eq!(
            object("00400000-00452000 r--p 00000000 00:1a 1031                       /memfd:weights (deleted)"),
            Some((0x40_0000, 0x45_2000, (0, 0x1a), 1031))
        );
        // Private anonymous memory, a private /dev/zero mapping, a file and a
        // POSIX shared memory file (its content stays in /dev/shm).
        for line in [
            "7ffd1c3e0000-7ffd1c401000 rw-p 00000000 00:00 0                          [stack]",
            "7f5a00000000-7f5a00021000 rw-p 00000000 00:00 0 ",
            "7f5a10000000-7f5a10021000 rw-p 00000000 00:05 6                          /dev/zero",
            "55d0c0a00000-55d0c0a28000 r--p 00000000 08:01 1311                       /usr/bin/cat",
            "7f5a20000000-7f5a20400000 rw-s 00000000 00:19 27                         /dev/shm/cache",
            "garbage",
        ] {
            assert_eq!(object(line), None, "{line}");
        }
    }

    /// A shared anonymous mapping written only by a child that then exited:
    /// its parent's resident set holds none of it, the object all of it.
    #[test]
    fn shared_memory_written_by_an_exited_child_is_counted_once() {
        let len = 8 << 20;
        // SAFETY: a fresh shared anonymous mapping of our own, unmapped below.
        let map = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        assert_ne!(map, libc::MAP_FAILED);
        // SAFETY: the child only writes the mapping and exits without
        // running anything of the parent's (no allocation, no locks).
        let child = unsafe { libc::fork() };
        if child == 0 {
            // SAFETY: the mapping is `len` bytes long and writable.
            unsafe {
                std::ptr::write_bytes(map as *mut u8, 0x5a, len);
                libc::_exit(0);
            }
        }
        let mut status = 0;
        // SAFETY: waiting for our own child.
        assert_eq!(unsafe { libc::waitpid(child, &mut status, 0) }, child);
        let me = std::process::id() as i32;
        let (once, twice) = (dumped_shared_bytes(&[me]), dumped_shared_bytes(&[me, me]));
        // SAFETY: the mapping made above, used no more.
        unsafe { libc::munmap(map, len) };
        assert!(once >= len as u64, "{once} bytes counted, {len} written");
        assert_eq!(once, twice, "an object mapped by two processes counts once");
    }
}

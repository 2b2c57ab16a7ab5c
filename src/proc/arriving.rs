//! Whether a tree's memory is still arriving from a lazy restore. A page
//! that a lazy restore (criuz's, or CRIU's lazy-pages daemon) has not yet
//! copied in is absent from the process, in a range registered with a
//! userfaultfd that another process holds. CRIU dumps only the pages a
//! process has, so a dump taken then stored an archive without them, and
//! its restore read zeros there: a 2 GiB process dumped 0.8 s into its lazy
//! restore came back with 543 MiB and a wrong checksum. Such a tree is
//! refused until its pages are all in.
//!
//! The registration shows only in `/proc/PID/smaps` (`VmFlags: um`),
//! which walks the page tables (about 20 ms a resident GiB). It is read
//! only where some process holds a userfaultfd (a scan of `/proc/*/fd`,
//! fractions of a millisecond on a quiet machine): nearly every dump pays
//! only the scan. A holder that criuz cannot see (in a pid namespace above
//! it) goes unseen.

use crate::error::{Error, Result};

/// Refuses the tree of `root` while a process of it has memory still
/// arriving through a userfaultfd.
pub fn refuse_while_arriving(root: i32) -> Result<()> {
    match memory_arriving(&super::tree::tree_pids(&[root])) {
        None => Ok(()),
        Some(pid) => Err(Error::Criu(format!(
            "process {pid} of the tree is still being restored lazily: CRIU would dump the pages not yet copied in \
             as never written, and they would come back as zeros; dump it once its restore has every page in \
             (`criuz restore --lazy` returns then)"
        ))),
    }
}

/// The first of `pids` with memory still arriving through a userfaultfd.
fn memory_arriving(pids: &[i32]) -> Option<i32> {
    if !userfaultfd_held() {
        return None;
    }
    pids.iter().copied().find(|&pid| registered_for_missing_pages(pid))
}

/// Whether any process criuz can see holds a userfaultfd (or one whose
/// descriptors cannot be read: then it may).
fn userfaultfd_held() -> bool {
    let Ok(procs) = std::fs::read_dir("/proc") else { return true };
    procs.flatten().filter(|e| e.file_name().to_str().is_some_and(|n| n.bytes().all(|b| b.is_ascii_digit()))).any(|e| {
        match std::fs::read_dir(e.path().join("fd")) {
            Ok(fds) => fds.flatten().any(|fd| {
                std::fs::read_link(fd.path()).is_ok_and(|target| target.as_os_str() == "anon_inode:[userfaultfd]")
            }),
            // Gone meanwhile: holds nothing.
            Err(err) if err.kind() == std::io::ErrorKind::NotFound => false,
            Err(_) => true,
        }
    })
}

/// Whether a mapping of `pid` is registered for missing-page faults.
fn registered_for_missing_pages(pid: i32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/smaps")).is_ok_and(|smaps| {
        smaps
            .lines()
            .filter_map(|l| l.strip_prefix("VmFlags:"))
            .any(|flags| flags.split_whitespace().any(|f| f == "um"))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_process_with_no_userfaultfd_has_nothing_arriving() {
        assert_eq!(memory_arriving(&[std::process::id() as i32]), None);
        assert!(!registered_for_missing_pages(std::process::id() as i32));
    }
}

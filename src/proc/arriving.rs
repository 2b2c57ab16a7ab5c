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
//! only where a process outside the tree holds a userfaultfd (seen in the
//! walk of their descriptors, `outside`): nearly every dump pays only
//! that walk. A holder that criuz
//! cannot see (in a pid namespace above it) goes unseen.

use crate::error::{Error, Result};

/// Refuses a tree of which process `arriving` ([`arriving_in`]) has memory
/// still arriving.
pub fn refuse(arriving: Option<i32>) -> Result<()> {
    match arriving {
        None => Ok(()),
        Some(pid) => Err(Error::Criu(format!(
            "process {pid} of the tree has memory still arriving through a userfaultfd held outside it (a lazy \
             restore not yet done?): CRIU would dump the pages not yet copied in as never written, and they would \
             come back as zeros; dump it once they are all in (criuz's lazy restore, `restore --lazy` or `runc \
             restore`, returns then)"
        ))),
    }
}

/// The first of the tree `pids` with memory still arriving through a
/// userfaultfd held outside it, given whether a process outside holds one
/// (`None`: one that could not be read might). One the tree holds itself
/// is CRIU's to refuse (it cannot checkpoint a userfaultfd, and says so).
pub(crate) fn arriving_in(pids: &[i32], held_outside: Option<bool>) -> Option<i32> {
    if held_outside == Some(false) {
        return None;
    }
    pids.iter().copied().find(|&pid| registered_for_missing_pages(pid))
}

/// Whether a process whose descriptors read `links` holds a userfaultfd;
/// `None` where they could not be read (it might).
pub(crate) fn holds_userfaultfd(links: &std::io::Result<super::Links>) -> Option<bool> {
    match links {
        Ok(links) => Some(links.iter().any(|(_, t)| t.as_os_str() == "anon_inode:[userfaultfd]")),
        // Gone meanwhile: holds nothing.
        Err(err) if err.kind() == std::io::ErrorKind::NotFound => Some(false),
        Err(_) => None,
    }
}

/// Whether a mapping of `pid` is registered for missing-page faults. Read
/// line by line: smaps runs to tens of megabytes for a process of many
/// mappings.
fn registered_for_missing_pages(pid: i32) -> bool {
    use std::io::BufRead;
    let Ok(smaps) = std::fs::File::open(format!("/proc/{pid}/smaps")) else { return false };
    std::io::BufReader::new(smaps)
        .lines()
        .map_while(|l| l.ok())
        .any(|l| l.strip_prefix("VmFlags:").is_some_and(|flags| flags.split_whitespace().any(|f| f == "um")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_process_with_no_userfaultfd_has_nothing_arriving() {
        let me = std::process::id() as i32;
        assert_eq!(holds_userfaultfd(&crate::proc::fd_links(me)), Some(false));
        assert_eq!(arriving_in(&[me], None), None);
        assert!(!registered_for_missing_pages(std::process::id() as i32));
    }
}

//! Transparent huge pages in a restored process: where the kernel would
//! back its private anonymous memory with them, and a writer that lets it.
//!
//! `UFFDIO_COPY` places 4 KiB pages only, so memory a placed restore copies
//! in through userfaultfd comes back without the huge pages the process had
//! (with THP `always`, or under `MADV_HUGEPAGE`), and stays so until
//! khugepaged gets to it (4,096 pages every 10 s by default): random reads
//! of 1 GiB took 47-56% longer on the 2-core VM (docs/BENCHMARKS.md,
//! session 92). Written through the process's memory instead
//! (`process_vm_writev`), with its userfaultfd taken off those ranges, each
//! 2 MiB-aligned piece faults in as a huge page where the kernel allows one,
//! as it did for the process itself. Trade-off: the kernel zeroes each huge
//! page before the copy, and where huge pages are scarce or slow to get (a
//! fragmented host, a VM that hands freed memory back) placing takes longer;
//! where they come too slowly, the fill gives up on them and places the rest
//! in 4 KiB pages (`session::pager`'s `fill_held_back`).
//!
//! Only what `/proc/PID/smaps` calls eligible (`THPeligible: 1`: the
//! system's mode, the mapping's `MADV_HUGEPAGE`/`MADV_NOHUGEPAGE` and the
//! process's `PR_SET_THP_DISABLE` folded in), private, anonymous and
//! writable is chosen; file-backed, shared and read-only memory keep their
//! paths.

use std::io::{self, BufRead};

/// The size of a huge page a page table's middle level maps (2 MiB on
/// x86-64 and on arm64 with 4 KiB pages); `None` where the kernel has no
/// transparent huge pages.
fn pmd_size() -> Option<u64> {
    let text = std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/hpage_pmd_size").ok()?;
    text.trim().parse().ok().filter(|&n: &u64| n.is_power_of_two() && n > 4096)
}

/// The ranges of `pid`'s private anonymous memory the kernel would back with
/// huge pages, each cut to whole huge pages (`[start, end)`, in address
/// order). Empty where the kernel has none, or every mapping is ineligible.
pub(crate) fn eligible_spans(pid: u32) -> io::Result<Vec<(u64, u64)>> {
    let Some(huge) = pmd_size() else { return Ok(Vec::new()) };
    // Read line by line: smaps runs to tens of megabytes for a process of
    // many mappings.
    let smaps = std::fs::File::open(format!("/proc/{pid}/smaps"))?;
    spans_in(io::BufReader::new(smaps), huge)
}

/// [`eligible_spans`] of an smaps text.
fn spans_in(smaps: impl BufRead, huge: u64) -> io::Result<Vec<(u64, u64)>> {
    let mut spans = Vec::new();
    // The current mapping, if it is private and anonymous.
    let mut anonymous: Option<(u64, u64)> = None;
    for line in smaps.lines() {
        let line = line?;
        if let Some(range) = mapping_header(&line) {
            anonymous = range;
        } else if let Some(value) = line.strip_prefix("THPeligible:") {
            if let (Some((start, end)), "1") = (anonymous.take(), value.trim()) {
                let (start, end) = (start.next_multiple_of(huge), end / huge * huge);
                if start < end {
                    spans.push((start, end));
                }
            }
        }
    }
    Ok(spans)
}

/// A mapping's first line in smaps: `Some(Some(range))` for private,
/// writable anonymous memory, `Some(None)` for any other mapping; `None`
/// for a field line.
fn mapping_header(line: &str) -> Option<Option<(u64, u64)>> {
    let m = super::MapsLine::parse(line)?;
    // A path such as `[heap]` or `[anon:name]` is still anonymous memory;
    // `[stack]` grows down, and `[vdso]` and its kind are not memory of the
    // process's own.
    let anonymous = m.inode == "0" && (m.path.is_empty() || m.path == "[heap]" || m.path.starts_with("[anon:"));
    // Private, and writable as `process_vm_writev` needs (it does not force
    // its way into memory the process may not write, as `UFFDIO_COPY` does).
    let private_writable = m.perms.starts_with("rw") && m.perms.ends_with('p');
    Some((anonymous && private_writable).then_some((m.start, m.end)))
}

/// Whether criuz may write `pid`'s memory (the ptrace access check
/// `process_vm_writev` makes), asked without touching it: opening
/// `/proc/PID/mem` makes the same check.
pub(crate) fn may_write_memory(pid: u32) -> bool {
    std::fs::OpenOptions::new().read(true).write(true).open(format!("/proc/{pid}/mem")).is_ok()
}

/// Writes `bytes` at `addr` of `pid`'s memory, faulting in what is not
/// there as the process's own write would. `ESRCH`: the process is gone.
pub(crate) fn write_memory(pid: u32, addr: u64, bytes: &[u8]) -> io::Result<()> {
    let mut done = 0;
    while done < bytes.len() {
        let left = &bytes[done..];
        let local = libc::iovec { iov_base: left.as_ptr() as *mut libc::c_void, iov_len: left.len() };
        let remote = libc::iovec { iov_base: (addr + done as u64) as *mut libc::c_void, iov_len: left.len() };
        // SAFETY: `local` covers `left`, which lives across the call and is
        // only read; `remote` names memory of another process, which the
        // kernel checks.
        let n = unsafe { libc::process_vm_writev(pid as libc::pid_t, &local, 1, &remote, 1, 0) };
        match n {
            n if n > 0 => done += n as usize,
            0 => return Err(io::Error::new(io::ErrorKind::WriteZero, "process_vm_writev wrote nothing")),
            _ => {
                let err = io::Error::last_os_error();
                if err.kind() != io::ErrorKind::Interrupted {
                    return Err(err);
                }
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB2: u64 = 2 << 20;

    #[test]
    fn only_eligible_private_anonymous_mappings_count_cut_to_whole_huge_pages() {
        let smaps = "\
55d0c0a00000-55d0c0c00000 r-xp 00000000 fd:01 1234 /usr/bin/app
THPeligible:    1
7f0000100000-7f0000900000 rw-p 00000000 00:00 0 
Rss:                   0 kB
AnonHugePages:         0 kB
THPeligible:    1
VmFlags: rd wr mr mw me ac hg
7f0001000000-7f0001200000 rw-p 00000000 00:00 0 
THPeligible:    0
7f0002000000-7f0002600000 rw-s 00000000 00:01 99 /dev/zero (deleted)
THPeligible:    1
7f0003000000-7f0003400000 rw-p 00000000 00:00 0 [heap]
THPeligible:    1
7f0004000000-7f0004100000 rw-p 00000000 00:00 0 
THPeligible:    1
7f0005000000-7f0005400000 r--p 00000000 00:00 0 
THPeligible:    1
7f0006000000-7f0006400000 ---p 00000000 00:00 0 
THPeligible:    1
7ffc00000000-7ffc00400000 rw-p 00000000 00:00 0 [stack]
THPeligible:    1
";
        let got = spans_in(smaps.as_bytes(), MIB2).expect("parse");
        assert_eq!(got, vec![(0x7f0000200000, 0x7f0000800000), (0x7f0003000000, 0x7f0003400000)]);
    }

    #[test]
    fn this_process_s_spans_are_whole_huge_pages_inside_its_mappings() {
        let Some(huge) = pmd_size() else { return };
        for (start, end) in eligible_spans(std::process::id()).expect("own smaps") {
            assert!(start < end && start % huge == 0 && end % huge == 0, "{start:x}-{end:x}");
        }
    }

    #[test]
    fn a_write_lands_in_the_process_s_memory() {
        // This process writes its own memory, as it would a restored one's.
        let mut target = vec![0u8; 3 * 4096];
        let bytes: Vec<u8> = (0..3 * 4096).map(|i| (i % 251) as u8).collect();
        assert!(may_write_memory(std::process::id()));
        write_memory(std::process::id(), target.as_mut_ptr() as u64, &bytes).expect("write");
        assert_eq!(std::hint::black_box(&target), &bytes);
        let gone = write_memory(i32::MAX as u32, target.as_mut_ptr() as u64, &bytes).expect_err("no such process");
        assert_eq!(gone.raw_os_error(), Some(libc::ESRCH));
    }
}

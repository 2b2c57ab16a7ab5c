//! The machine around the runs: memory the guest must hand out before a
//! timed run, the page cache dropped for cold runs and a plain read of a
//! file to compare against, tmpfs mounts, and file sizes.

use crate::error::{Error, Result};
use std::io;
use std::path::{Path, PathBuf};

/// Touches `bytes` of fresh anonymous memory and frees it again, just before
/// a timed restore. This VM hands free guest memory back to the host
/// (virtio-balloon free page reporting, about 2 s after it is freed), and a
/// restore that lands on such memory spends 2-3x as long in page faults as
/// one that does not: six consecutive restores of one 1 GiB archive took
/// 0.60-1.95 s, and mostly 0.5-0.55 s when warmed first. Warming gives every
/// configuration the same, host-backed start, so ratios measure criuz (it
/// does not remove all noise: a warmed restore still lands at 1.0 s now and
/// then).
pub fn warm_guest_memory(bytes: usize) {
    const PAGE: usize = 4096;
    // In a child of its own: a process's peak RSS passes to the children it
    // forks (and through their exec), so warming in the bench itself would
    // show up as the peak RSS of every criuz it runs afterwards.
    // SAFETY: the child only maps, writes and unmaps its own memory and
    // exits without running any of our code (no locks, no allocation).
    unsafe {
        let pid = libc::fork();
        if pid == 0 {
            let p = libc::mmap(
                std::ptr::null_mut(),
                bytes,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            );
            if p != libc::MAP_FAILED {
                let base = p as *mut u8;
                let mut off = 0;
                while off < bytes {
                    std::ptr::write_volatile(base.add(off), 1);
                    off += PAGE;
                }
                libc::munmap(p, bytes);
            }
            libc::_exit(0);
        }
        if pid > 0 {
            let mut status = 0;
            libc::waitpid(pid, &mut status, 0);
        }
    }
}

/// Guest memory warmed before a timed restore of an `mib` workload (the
/// incremental and lazy runs): its memory and CRIU's, with room to spare.
/// The main table is not warmed, so it stays comparable with its reruns;
/// warming its dumps and restores too (session 95) left `criu dump -D`'s
/// spread as it was and made huge-page restores slower.
pub fn warm_bytes(mib: u64) -> usize {
    ((mib + mib / 4 + 256) << 20) as usize
}

/// Flushes dirty data and drops the page cache, so the next read comes from disk.
pub fn drop_caches() -> Result<()> {
    // SAFETY: sync has no preconditions.
    unsafe { libc::sync() };
    std::fs::write("/proc/sys/vm/drop_caches", "3")
        .map_err(|e| Error::Invalid(format!("cannot drop the page cache (/proc/sys/vm/drop_caches): {e}")))
}

/// Reads every file under `path` (a file or a directory) front to back
/// through a 1 MiB buffer, as `cat` would: the device's plain sequential
/// read rate when the page cache was dropped first. Returns the bytes read
/// and the seconds it took.
pub fn read_through(path: &Path) -> Result<(u64, f64)> {
    fn walk(p: &Path, buf: &mut [u8], total: &mut u64) -> Result<()> {
        let meta = std::fs::symlink_metadata(p).map_err(|e| Error::file(p, e))?;
        if meta.is_dir() {
            for e in std::fs::read_dir(p).map_err(|e| Error::file(p, e))?.flatten() {
                walk(&e.path(), buf, total)?;
            }
        } else if meta.is_file() {
            let mut f = std::fs::File::open(p).map_err(|e| Error::file(p, e))?;
            loop {
                match std::io::Read::read(&mut f, buf).map_err(|e| Error::file(p, e))? {
                    0 => break,
                    n => *total += n as u64,
                }
            }
        }
        Ok(())
    }
    let mut buf = vec![0u8; 1 << 20];
    let mut total = 0;
    let t = std::time::Instant::now();
    walk(path, &mut buf, &mut total)?;
    Ok((total, t.elapsed().as_secs_f64()))
}

/// A tmpfs mounted for the run, unmounted on drop.
pub struct Tmpfs(PathBuf);

impl Tmpfs {
    pub fn mount(path: &Path) -> Result<Tmpfs> {
        Self::mount_with(path, c"mode=0700")
    }

    /// A tmpfs of `bytes` (rounded up to pages): a disk that fills up.
    pub fn mount_sized(path: &Path, bytes: u64) -> Result<Tmpfs> {
        let opts = std::ffi::CString::new(format!("mode=0700,size={bytes}"))
            .map_err(|_| Error::Invalid("bad tmpfs options".into()))?;
        Self::mount_with(path, &opts)
    }

    fn mount_with(path: &Path, opts: &std::ffi::CStr) -> Result<Tmpfs> {
        use std::os::unix::ffi::OsStrExt;
        std::fs::create_dir_all(path).map_err(|e| Error::file(path, e))?;
        let target = std::ffi::CString::new(path.as_os_str().as_bytes())
            .map_err(|_| Error::Invalid(format!("bad path {}", path.display())))?;
        // SAFETY: all arguments are valid NUL-terminated strings.
        let r =
            unsafe { libc::mount(c"tmpfs".as_ptr(), target.as_ptr(), c"tmpfs".as_ptr(), 0, opts.as_ptr() as *const _) };
        if r != 0 {
            let e = io::Error::last_os_error();
            return Err(Error::Invalid(format!("cannot mount a tmpfs on {}: {e}", path.display())));
        }
        Ok(Tmpfs(path.to_path_buf()))
    }

    pub fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        use std::os::unix::ffi::OsStrExt;
        if let Ok(target) = std::ffi::CString::new(self.0.as_os_str().as_bytes()) {
            // SAFETY: a valid path string; MNT_DETACH as a fallback if busy.
            unsafe {
                if libc::umount2(target.as_ptr(), 0) != 0 {
                    libc::umount2(target.as_ptr(), libc::MNT_DETACH);
                }
            }
        }
    }
}

/// Sum of the sizes of the regular files in `dir` (not recursive: CRIU's
/// images directory is flat).
pub fn dir_bytes(dir: &Path) -> u64 {
    let Ok(rd) = std::fs::read_dir(dir) else { return 0 };
    rd.flatten().filter_map(|e| e.metadata().ok()).filter(|m| m.is_file()).map(|m| m.len()).sum()
}

pub fn file_bytes(path: &Path) -> u64 {
    std::fs::metadata(path).map(|m| m.len()).unwrap_or(0)
}

/// A copy of `exe` in `dir`: what a run executes and CRIU restores from
/// stays put while cargo rebuilds the original.
pub fn copy_exe(exe: &Path, dir: &Path) -> Result<PathBuf> {
    let to = dir.join(exe.file_name().unwrap_or_default());
    std::fs::copy(exe, &to).map_err(|e| Error::file(exe, e))?;
    Ok(to)
}

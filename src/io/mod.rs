//! Where archive bytes go and come from: files, `-` (standard input or
//! output) and `s3://bucket/key` objects ([`s3`]), each named by a
//! [`Location`] parsed once from what the user typed.
//!
//! An [`Output`] is published only by [`Output::commit`]: a file is written
//! under a temporary name beside the target (mode 0600, since archives hold
//! process memory), fsynced, then renamed into place; dropped uncommitted, the
//! temporary file is removed, and one left by a criuz that was killed is
//! removed by the next writer of the same target ([`leftover`]).
//! Standard output cannot be taken back, so a writer that fails must stop short of the trailer (see `archive::write`):
//! the reader then sees a truncated archive. An object is a multipart
//! upload that only `commit` completes.

use crate::error::{Error, IoContext, Result};
use std::fs::{File, OpenOptions};
use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

pub mod leftover;
mod location;
mod output;
pub mod read_ahead;
pub mod s3;
pub mod sparse;
mod store;
pub mod unfinished;

pub use location::{Location, SPOOL_CAP};
pub use output::{AtomicFile, FileId, Output};
pub use store::RecordStore;

/// A file the user named as an input (an archive, a parent, a key file):
/// one that is not there, or a directory where a file is meant, is a bad
/// argument named in one line (exit 2), not a failed operation (exit 1).
/// Any other failure to open it is left to the open that follows.
pub fn named_file(path: &Path) -> Result<()> {
    match std::fs::metadata(path) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            Err(Error::Usage(format!("{}: no such file", path.display())))
        }
        Ok(m) if m.is_dir() => Err(Error::Usage(format!("{}: a directory, not a file", path.display()))),
        _ => Ok(()),
    }
}

/// [`named_file`] for a directory the user named (`pack DIR`).
pub fn named_dir(path: &Path) -> Result<()> {
    match std::fs::metadata(path) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            Err(Error::Usage(format!("{}: no such directory", path.display())))
        }
        Err(e) if e.raw_os_error() == Some(libc::ENOTDIR) => {
            Err(Error::Usage(format!("{}: not a directory", path.display())))
        }
        Ok(m) if !m.is_dir() => Err(Error::Usage(format!("{}: not a directory", path.display()))),
        _ => Ok(()),
    }
}

/// The first `limit` bytes of the regular file at `path` (a link there is
/// not followed): what a writer about to replace it sniffs to tell a file
/// worth keeping (an archive, a key) from one it may replace. None where
/// nothing is there, it is no regular file, or it cannot be read.
pub fn regular_file_head(path: &Path, limit: u64) -> Option<Vec<u8>> {
    use std::io::Read;
    if !std::fs::symlink_metadata(path).is_ok_and(|md| md.is_file()) {
        return None;
    }
    let mut head = Vec::new();
    File::open(path).and_then(|f| f.take(limit).read_to_end(&mut head)).ok()?;
    Some(head)
}

/// Makes `dir` (0700), or finds it, as this user's own private directory:
/// no link, owned by this user, writable by no one else. For a name known in
/// advance in a shared `/tmp` (CRIU's logs, criuz's runtime files): a
/// directory, or a link to one, that another user put there would be given
/// criuz's files to read, replace or lock, and its links followed.
pub fn private_dir(dir: &Path) -> std::io::Result<()> {
    use std::os::unix::fs::{DirBuilderExt, MetadataExt};
    match std::fs::DirBuilder::new().mode(0o700).create(dir) {
        Err(e) if e.kind() != std::io::ErrorKind::AlreadyExists => return Err(e),
        _ => {}
    }
    let meta = std::fs::symlink_metadata(dir)?;
    // SAFETY: geteuid has no preconditions.
    let own = meta.file_type().is_dir() && meta.uid() == unsafe { libc::geteuid() } && meta.mode() & 0o022 == 0;
    if own {
        Ok(())
    } else {
        Err(std::io::Error::other(format!("{} is not this user's private directory", dir.display())))
    }
}

/// `$TMPDIR` (or `/tmp`), where criuz spools a piped archive, downloads an
/// object and makes CRIU's work directories: one set to no directory is a
/// usage error that says so, not a bare "No such file or directory".
pub fn temp_dir() -> Result<PathBuf> {
    let dir = temp_root();
    named_dir(&dir).and_then(|()| writable_dir(&dir)).map_err(|e| e.context("$TMPDIR"))?;
    Ok(dir)
}

/// A directory criuz must make files in (a read-only mount, one without
/// write permission): a usage error that says what to change, before
/// anything else is done, not a staging name of criuz's own in an I/O error.
fn writable_dir(dir: &Path) -> Result<()> {
    use nix::unistd::{faccessat, AccessFlags};
    // As the effective user, who makes the files (plain access(2) asks
    // for the real one).
    let flags = AccessFlags::W_OK | AccessFlags::X_OK;
    faccessat(nix::fcntl::AT_FDCWD, dir, flags, nix::fcntl::AtFlags::AT_EACCESS).map_err(|e| {
        Error::Usage(format!(
            "{}: {}: criuz makes its work files there; set TMPDIR to a writable directory",
            dir.display(),
            std::io::Error::from(e)
        ))
    })
}

/// `$TMPDIR` (or `/tmp`) as an absolute path, whether or not it is there.
/// CRIU works from its work directory made there, so a relative `$TMPDIR`
/// named every path given to CRIU from the wrong place (every restore
/// failed "Can't write pidfile").
pub fn temp_root() -> PathBuf {
    let dir = std::env::temp_dir();
    match std::env::current_dir() {
        Ok(cwd) if dir.is_relative() => cwd.join(dir),
        _ => dir,
    }
}

/// The name of criuz's own file beside the user's `name` (its staging
/// file, say): `.NAME.criuz-WHAT`, then at most `tail` more bytes (a pid).
/// A name too long for that within a file name's 255 bytes keeps its head
/// and gains a hash of the whole: a 250-byte name, which the file system
/// takes, was refused as "File name too long" for its staging file's.
pub fn name_beside(name: &std::ffi::OsStr, what: &str, tail: usize) -> String {
    const NAME_MAX: usize = 255;
    let name = name.to_string_lossy();
    let fixed = ".".len() + ".criuz-".len() + what.len() + tail;
    if name.len() + fixed <= NAME_MAX {
        return format!(".{name}.criuz-{what}");
    }
    let hash = format!("~{:016x}", xxhash_rust::xxh3::xxh3_64(name.as_bytes()));
    let mut head = NAME_MAX - fixed - hash.len();
    while !name.is_char_boundary(head) {
        head -= 1;
    }
    format!(".{}{hash}.criuz-{what}", &name[..head])
}

/// Replaces the user's small file `target` (a pid file, a lazy restore's
/// working-set record) with `bytes`, whole or not at all: written to
/// criuz's own file beside it (`.NAME.criuz-tmp-PID`), made anew
/// (`O_EXCL`), then renamed over `target`, which replaces a link there
/// rather than following it. Written with an ordinary open, a link left
/// under the temporary name by anyone who may write the directory had
/// root's criuz write over the file it pointed to.
pub fn replace_small_file(target: &Path, mode: u32, bytes: &[u8]) -> Result<()> {
    let name = target.file_name().unwrap_or_default();
    let tmp = target.with_file_name(format!("{}{}", name_beside(name, "tmp-", 10), std::process::id()));
    let create = || OpenOptions::new().write(true).create_new(true).mode(mode).open(&tmp);
    // Errors name the user's path: the temporary name means nothing to them.
    let ((), unfinished) = unfinished::Unfinished::made(|| -> std::io::Result<((), PathBuf)> {
        let mut file = match create() {
            // A link, or what a criuz of this pid killed before its rename
            // left: removed (a link itself, not what it points to).
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
                std::fs::remove_file(&tmp)?;
                create()?
            }
            made => made?,
        };
        file.write_all(bytes).inspect_err(|_| {
            let _ = std::fs::remove_file(&tmp);
        })?;
        Ok(((), tmp.clone()))
    })
    .at(target)?;
    unfinished
        .publish(|| std::fs::rename(&tmp, target))
        .inspect_err(|_| {
            let _ = std::fs::remove_file(&tmp);
        })
        .at(target)
}

/// The open-files limit, its soft limit raised to the hard one first (once
/// per process; later calls return what the first found). Shells and
/// service managers start processes at a soft 1024 under a far higher hard
/// limit: CRIU, which inherits criuz's, then failed to restore a process
/// that had used more descriptors ("Can't chose service_fd_base"), and a
/// dump held fewer pipes than it could. The restored tree gets its own
/// limits back from its images.
pub fn open_files_limit() -> u64 {
    static LIMIT: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
    *LIMIT.get_or_init(|| {
        let mut lim = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
        // SAFETY: getrlimit/setrlimit on a struct we own.
        unsafe {
            if libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) != 0 {
                return 0;
            }
            let raised = libc::rlimit { rlim_cur: lim.rlim_max, ..lim };
            if lim.rlim_cur < lim.rlim_max && libc::setrlimit(libc::RLIMIT_NOFILE, &raised) == 0 {
                lim = raised;
            }
        }
        lim.rlim_cur
    })
}

/// Bytes free for an unprivileged file in `dir` (`None` if unknown): work
/// that cannot fit fails, or goes another way, before it starts, not when
/// the disk fills.
pub fn free_bytes(dir: &Path) -> Option<u64> {
    use std::os::unix::ffi::OsStrExt;
    let path = std::ffi::CString::new(dir.as_os_str().as_bytes()).ok()?;
    let mut st = std::mem::MaybeUninit::<libc::statvfs>::uninit();
    // SAFETY: `path` is NUL-terminated and `st` is written by statvfs before
    // it is read, only when it returns 0.
    let st = unsafe {
        if libc::statvfs(path.as_ptr(), st.as_mut_ptr()) != 0 {
            return None;
        }
        st.assume_init()
    };
    Some((st.f_bavail as u64).saturating_mul(st.f_frsize as u64))
}

/// Whether programs may run from `dir` (its file system is not mounted
/// `noexec`, as a hardened `/dev/shm` or `/tmp` is); true where unknown.
pub fn runs_programs(dir: &Path) -> bool {
    use nix::sys::statvfs::{statvfs, FsFlags};
    statvfs(dir).map_or(true, |st| !st.flags().contains(FsFlags::ST_NOEXEC))
}

/// Bytes shared between a reader and the pipe they are handed to: kept
/// alive (and unchanged) until the other side has read them.
pub type SharedBytes = std::sync::Arc<dyn AsRef<[u8]> + Send + Sync>;

/// Makes a rename durable; best effort (some filesystems refuse to fsync dirs).
pub fn sync_parent(path: &Path) {
    sync_dir(path.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new(".")));
}

/// Makes the entries made or renamed in `dir` durable; best effort.
pub fn sync_dir(dir: &Path) {
    if let Ok(d) = File::open(dir) {
        let _ = d.sync_all();
    }
}

/// A new pipe (read end, write end), both close-on-exec.
pub fn pipe() -> std::io::Result<(std::os::fd::OwnedFd, std::os::fd::OwnedFd)> {
    use std::os::fd::FromRawFd;
    let mut fds = [0; 2];
    // SAFETY: pipe2 writes two descriptors into the array we pass.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: both descriptors are new and ours.
    Ok(unsafe { (std::os::fd::OwnedFd::from_raw_fd(fds[0]), std::os::fd::OwnedFd::from_raw_fd(fds[1])) })
}

/// Makes a file system node (`mknod`: a FIFO, a device) for a test.
#[cfg(test)]
pub(crate) fn make_node(path: &Path, mode: libc::mode_t, dev: libc::dev_t) {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(path.as_os_str().as_bytes()).unwrap();
    // SAFETY: mknod on a NUL-terminated path.
    let made = unsafe { libc::mknod(c.as_ptr(), mode, dev) };
    assert_eq!(made, 0, "{}: {}", path.display(), std::io::Error::last_os_error());
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Links left at the temporary name and at the target by someone who may
    /// write the directory are replaced, never written through (found by
    /// hand: root's restore wrote its pid and working-set record over the
    /// file such links pointed to).
    #[test]
    fn a_small_file_is_replaced_never_written_through_a_link() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let victim = dir.path().join("victim");
        std::fs::write(&victim, b"precious").unwrap();
        let target = dir.path().join("app.pid");
        let tmp = dir.path().join(format!(".app.pid.criuz-tmp-{}", std::process::id()));
        std::os::unix::fs::symlink(&victim, &tmp).unwrap();
        std::os::unix::fs::symlink(&victim, &target).unwrap();
        replace_small_file(&target, 0o600, b"1234\n").unwrap();
        assert_eq!(std::fs::read(&victim).unwrap(), b"precious");
        let meta = std::fs::symlink_metadata(&target).unwrap();
        assert!(meta.file_type().is_file() && meta.permissions().mode() & 0o777 == 0o600);
        assert_eq!(std::fs::read(&target).unwrap(), b"1234\n");
        replace_small_file(&target, 0o600, b"5678\n").unwrap();
        assert_eq!(std::fs::read(&target).unwrap(), b"5678\n");
        let names: Vec<_> = std::fs::read_dir(dir.path()).unwrap().map(|e| e.unwrap().file_name()).collect();
        assert_eq!(names.len(), 2, "nothing left beside them: {names:?}");
    }
}

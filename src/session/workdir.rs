//! Work directories: the private images directory a CRIU run reads or
//! writes (in `$TMPDIR`, or on tmpfs for containers, where it holds RAM),
//! removed when the run ends, and where CRIU's logs go when it fails.
//!
//! A criuz that is SIGKILLed (or whose machine loses power) cannot remove
//! its directory, and on `/dev/shm` a container's images are memory held
//! until reboot. So each directory is locked (`flock`) for its owner's
//! lifetime, and every new one first removes the abandoned directories of
//! its kind: unlocked, and unchanged for [`ABANDONED_AFTER`] (the age covers
//! the instant between a directory's creation and its lock). A lock, unlike
//! a pid, is released by the kernel when its holder dies, whatever pid
//! namespace either side runs in. A directory kept on purpose (it holds the
//! only copy of a checkpoint) is renamed `…-kept` and never removed.

use crate::error::{IoContext, Result};
use std::fs::File;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{DirBuilderExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

/// How long an unlocked work directory must have been left alone before
/// it counts as abandoned.
const ABANDONED_AFTER: Duration = Duration::from_secs(60);

/// What a kept directory's name ends with.
const KEPT_SUFFIX: &str = "-kept";

/// How many failure logs [`log_dir`] keeps.
const KEPT_LOGS: usize = 8;

/// Where the logs of failed CRIU runs are kept: `$TMPDIR/criuz-logs` (0700).
pub fn log_dir() -> PathBuf {
    std::env::temp_dir().join("criuz-logs")
}

/// A private work directory (0700), locked while it lives and removed on
/// drop unless [`kept`](WorkDir::keep).
pub struct WorkDir {
    dir: tempfile::TempDir,
    _lock: File,
}

impl WorkDir {
    pub fn new(prefix: &str) -> Result<Self> {
        Self::new_in(&std::env::temp_dir(), prefix)
    }

    /// A new directory `base/{prefix}XXXXXX`, after removing the abandoned
    /// ones with the same prefix.
    pub fn new_in(base: &Path, prefix: &str) -> Result<Self> {
        remove_abandoned(base, prefix);
        let dir = tempfile::Builder::new().prefix(prefix).tempdir_in(base).at(base)?;
        let lock = File::open(dir.path()).at(dir.path())?;
        // A fresh name nobody else has seen: the lock is free.
        let _ = try_lock(&lock);
        Ok(WorkDir { dir, _lock: lock })
    }

    pub fn path(&self) -> &Path {
        self.dir.path()
    }

    /// Keeps the directory (something in it is all that is left of a
    /// checkpoint) under a name no later run removes; returns it.
    pub fn keep(self) -> PathBuf {
        let path = self.dir.keep();
        let mut kept = path.clone().into_os_string();
        kept.push(KEPT_SUFFIX);
        let kept = PathBuf::from(kept);
        match std::fs::rename(&path, &kept) {
            Ok(()) => kept,
            Err(_) => path,
        }
    }

    /// Saves CRIU's log `name` (if any) to [`log_dir`], dropping the oldest
    /// saved logs beyond [`KEPT_LOGS`]; returns where it went.
    pub fn save_log(&self, name: &str) -> PathBuf {
        let src = self.path().join(name);
        let dir = log_dir();
        let stamp = SystemTime::now().duration_since(SystemTime::UNIX_EPOCH).unwrap_or_default();
        let dest =
            dir.join(format!("{}-{}-{}.log", name.trim_end_matches(".log"), stamp.as_secs(), std::process::id()));
        let saved = std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(&dir)
            .and_then(|_| std::fs::copy(&src, &dest));
        if saved.is_err() {
            return src;
        }
        let mut logs: Vec<_> = std::fs::read_dir(&dir)
            .map(|d| d.filter_map(|e| e.ok()).filter(|e| e.file_name().to_string_lossy().ends_with(".log")).collect())
            .unwrap_or_default();
        logs.sort_by_key(|e| e.metadata().and_then(|m| m.modified()).ok());
        for old in logs.iter().take(logs.len().saturating_sub(KEPT_LOGS)) {
            let _ = std::fs::remove_file(old.path());
        }
        dest
    }
}

/// An exclusive lock on `f`, if nobody holds one.
fn try_lock(f: &File) -> bool {
    // SAFETY: flock on a descriptor we own.
    unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) == 0 }
}

/// Removes `base/{prefix}*` directories of criuz's own user that nobody
/// holds and nobody touched for [`ABANDONED_AFTER`]. Best effort.
fn remove_abandoned(base: &Path, prefix: &str) {
    let Ok(entries) = std::fs::read_dir(base) else { return };
    // SAFETY: geteuid has no preconditions.
    let uid = unsafe { libc::geteuid() };
    for e in entries.flatten() {
        let name = e.file_name();
        let Some(name) = name.to_str() else { continue };
        if !name.starts_with(prefix) || name.ends_with(KEPT_SUFFIX) {
            continue;
        }
        let path = e.path();
        // Not through a symlink: only a directory of our own is taken.
        let Ok(meta) = std::fs::symlink_metadata(&path) else { continue };
        let idle = meta.modified().ok().and_then(|m| m.elapsed().ok()).unwrap_or_default();
        if !meta.is_dir() || meta.uid() != uid || idle < ABANDONED_AFTER {
            continue;
        }
        let Ok(dir) = File::open(&path) else { continue };
        if try_lock(&dir) {
            let _ = std::fs::remove_dir_all(&path);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A directory named like a work directory, last changed `age` ago.
    fn left_behind(base: &Path, name: &str, age: Duration) -> PathBuf {
        let p = base.join(name);
        std::fs::create_dir(&p).unwrap();
        std::fs::write(p.join("pages-1.img"), b"x").unwrap();
        let then = SystemTime::now() - age;
        File::open(&p).unwrap().set_modified(then).unwrap();
        p
    }

    #[test]
    fn abandoned_work_directories_are_removed_and_no_other() {
        let base = tempfile::tempdir().unwrap();
        let old = Duration::from_secs(3600);
        let abandoned = left_behind(base.path(), "criuz-t-dead", old);
        let held = left_behind(base.path(), "criuz-t-live", old);
        let holder = File::open(&held).unwrap();
        assert!(try_lock(&holder));
        let kept = left_behind(base.path(), "criuz-t-x-kept", old);
        let young = left_behind(base.path(), "criuz-t-young", Duration::ZERO);
        let other = left_behind(base.path(), "someone-else", old);

        let w = WorkDir::new_in(base.path(), "criuz-t-").unwrap();
        assert!(!abandoned.exists(), "an unlocked, idle work directory is removed");
        for p in [&held, &kept, &young, &other] {
            assert!(p.join("pages-1.img").exists(), "{} was removed", p.display());
        }
        // The new one is locked against the next run's sweep.
        assert!(!try_lock(&File::open(w.path()).unwrap()));
        let kept_now = w.keep();
        assert!(kept_now.to_str().unwrap().ends_with(KEPT_SUFFIX));
        File::open(&kept_now).unwrap().set_modified(SystemTime::now() - old).unwrap();
        drop(holder);
        let _next = WorkDir::new_in(base.path(), "criuz-t-").unwrap();
        assert!(!held.exists(), "released by its holder, it is abandoned");
        assert!(kept_now.exists(), "a kept directory stays");
    }
}

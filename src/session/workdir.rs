//! Work directories: the private images directory a CRIU run reads or
//! writes (in `$TMPDIR`, or on tmpfs for containers, where it holds RAM),
//! removed when the run ends, and where CRIU's logs go when it fails.
//!
//! A work directory is held while it lives ([`leftover`]), so one that a
//! killed criuz left behind is removed by the next criuz that makes one of
//! its kind; one kept on purpose (it holds the only copy of a checkpoint)
//! is renamed `…-kept` and stays.

use crate::error::{IoContext, Result};
use crate::io::leftover;
use crate::io::unfinished::{self, Unfinished};
use std::fs::File;
use std::os::unix::fs::DirBuilderExt;
use std::path::{Path, PathBuf};
use std::time::SystemTime;

/// How many failure logs [`log_dir`] keeps.
const KEPT_LOGS: usize = 8;

/// Where the logs of failed CRIU runs are kept: `$TMPDIR/criuz-logs` (0700).
pub fn log_dir() -> PathBuf {
    std::env::temp_dir().join("criuz-logs")
}

/// A private work directory (0700), held while it lives and removed on
/// drop unless [`kept`](WorkDir::keep).
pub struct WorkDir {
    path: PathBuf,
    _held: File,
    kept: bool,
    /// Removed should criuz be interrupted, unless marked the only copy.
    unfinished: Unfinished,
}

impl WorkDir {
    pub fn new(prefix: &str) -> Result<Self> {
        Self::new_in(&crate::io::temp_dir()?, prefix)
    }

    /// A new directory `base/{prefix}XXXXXX`, after removing the abandoned
    /// ones with the same prefix.
    pub fn new_in(base: &Path, prefix: &str) -> Result<Self> {
        let (path, held, unfinished) = unfinished::held_dir(base, prefix).at(base)?;
        Ok(WorkDir { path, _held: held, kept: false, unfinished })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Keeps the directory (something in it is all that is left of a
    /// checkpoint) under a name no later run removes; returns it.
    pub fn keep(mut self) -> PathBuf {
        self.kept = true;
        self.unfinished.publish(|| leftover::keep(&self.path)).unwrap_or_else(|_| self.path.clone())
    }

    /// From now on an interrupted criuz keeps the directory (renamed
    /// `…-kept`) instead of removing it: it holds the only copy of a
    /// checkpoint.
    pub fn keep_on_interrupt(&self) {
        self.unfinished.keep_on_interrupt();
    }

    /// Saves CRIU's log `name`, if CRIU wrote one, to [`log_dir`], dropping
    /// the oldest saved logs beyond [`KEPT_LOGS`]; says where it went. (A
    /// runc that failed before it ran CRIU leaves none: a message naming
    /// one would send the user to a file that never was.)
    pub fn save_log(&self, name: &str) -> SavedLog {
        let src = self.path().join(name);
        if !src.exists() {
            return SavedLog(None);
        }
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
            return SavedLog(Some(src));
        }
        let mut logs: Vec<_> = std::fs::read_dir(&dir)
            .map(|d| d.filter_map(|e| e.ok()).filter(|e| e.file_name().to_string_lossy().ends_with(".log")).collect())
            .unwrap_or_default();
        logs.sort_by_key(|e| e.metadata().and_then(|m| m.modified()).ok());
        for old in logs.iter().take(logs.len().saturating_sub(KEPT_LOGS)) {
            let _ = std::fs::remove_file(old.path());
        }
        SavedLog(Some(dest))
    }
}

/// Where [`WorkDir::save_log`] kept a failed run's CRIU log, if CRIU wrote
/// one; shown as `CRIU log: PATH`, or `CRIU wrote no log`.
pub struct SavedLog(Option<PathBuf>);

impl SavedLog {
    pub fn path(&self) -> Option<&Path> {
        self.0.as_deref()
    }
}

impl std::fmt::Display for SavedLog {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.0 {
            Some(p) => write!(f, "CRIU log: {}", p.display()),
            None => f.write_str("CRIU wrote no log"),
        }
    }
}

impl Drop for WorkDir {
    fn drop(&mut self) {
        if !self.kept {
            let _ = leftover::remove_dir(&self.path);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::io::leftover::KEPT_SUFFIX;

    #[test]
    fn a_work_directory_is_held_removed_or_kept() {
        let base = tempfile::tempdir().unwrap();
        let left = base.path().join("criuz-t-dead");
        std::fs::create_dir(&left).unwrap();
        std::fs::write(left.join("pages-1.img"), b"x").unwrap();

        let w = WorkDir::new_in(base.path(), "criuz-t-").unwrap();
        assert!(!left.exists(), "a directory nobody holds is removed");
        let second = WorkDir::new_in(base.path(), "criuz-t-").unwrap();
        assert!(w.path().exists(), "a held one stays");
        let dropped = second.path().to_path_buf();
        drop(second);
        assert!(!dropped.exists(), "dropped, it is removed");
        let kept = w.keep();
        assert!(kept.to_str().unwrap().ends_with(KEPT_SUFFIX));
        let _next = WorkDir::new_in(base.path(), "criuz-t-").unwrap();
        assert!(kept.exists(), "a kept directory stays");
        let staged = std::fs::read_dir(base.path())
            .unwrap()
            .flatten()
            .filter(|e| e.file_name().to_string_lossy().starts_with(".criuz-new-"))
            .count();
        assert_eq!(staged, 0, "no staging name is left");
    }
}

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
use std::path::{Path, PathBuf};
use std::time::SystemTime;

/// How many failure logs [`log_dir`] keeps.
const KEPT_LOGS: usize = 8;

/// Where the logs of failed CRIU runs are kept: `$TMPDIR/criuz-logs` for
/// root, `criuz-logs-UID` for another user (so users do not share one);
/// 0700, and used only while it is the user's own
/// ([`private_dir`](crate::io::private_dir)).
pub fn log_dir() -> PathBuf {
    // SAFETY: geteuid has no preconditions.
    let euid = unsafe { libc::geteuid() };
    let name = if euid == 0 { "criuz-logs".to_string() } else { format!("criuz-logs-{euid}") };
    crate::io::temp_root().join(name)
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
        self.save_log_in(name, &log_dir())
    }

    fn save_log_in(&self, name: &str, dir: &Path) -> SavedLog {
        let src = self.path().join(name);
        if !src.exists() {
            return said_on_output(self.path()).map_or(SavedLog::None, SavedLog::Said);
        }
        let stamp = SystemTime::now().duration_since(SystemTime::UNIX_EPOCH).unwrap_or_default();
        let dest =
            dir.join(format!("{}-{}-{}.log", name.trim_end_matches(".log"), stamp.as_secs(), std::process::id()));
        if let Err(e) = crate::io::private_dir(dir).and_then(|()| std::fs::copy(&src, &dest)) {
            // Read for its last errors before the work directory goes.
            return SavedLog::NotKept { read_from: src, why: e.to_string() };
        }
        let mut logs: Vec<_> = std::fs::read_dir(dir)
            .map(|d| d.filter_map(|e| e.ok()).filter(|e| e.file_name().to_string_lossy().ends_with(".log")).collect())
            .unwrap_or_default();
        logs.sort_by_key(|e| e.metadata().and_then(|m| m.modified()).ok());
        for old in logs.iter().take(logs.len().saturating_sub(KEPT_LOGS)) {
            let _ = std::fs::remove_file(old.path());
        }
        SavedLog::Kept(dest)
    }
}

/// The file in a CRIU run's work directory that takes CRIU's standard
/// output and error ([`criu_output`]).
const CRIU_OUTPUT: &str = "criu-output";

/// CRIU's standard output and error for a run whose work directory is
/// `dir`: one file there, not criuz's own streams. CRIU writes its log only
/// once it has read its options and checked its rights; what stops it
/// before that (an option it does not know, a capability it lacks) it says
/// on standard error or, for the capability, standard output, and nowhere
/// else.
pub(crate) fn criu_output(dir: &Path) -> (std::process::Stdio, std::process::Stdio) {
    use std::process::Stdio;
    match std::fs::File::create(dir.join(CRIU_OUTPUT)) {
        // One open file for both: they share its offset, so neither
        // overwrites what the other wrote.
        Ok(file) => match file.try_clone() {
            Ok(second) => (file.into(), second.into()),
            Err(_) => (Stdio::null(), file.into()),
        },
        Err(_) => (Stdio::null(), Stdio::null()),
    }
}

/// The first line CRIU wrote to its standard streams in `dir` (CRIU puts
/// the cause first, its usage text after), if any; with the line after it
/// when it ends in a colon ("needs the capability:" then the command that
/// grants it).
fn said_on_output(dir: &Path) -> Option<String> {
    let text = std::fs::read_to_string(dir.join(CRIU_OUTPUT)).ok()?;
    let mut lines = text.lines().map(str::trim).filter(|l| !l.is_empty());
    let first = lines.next()?;
    let said = match lines.next() {
        Some(next) if first.ends_with(':') => format!("{first} {next}"),
        _ => first.to_string(),
    };
    Some(said.chars().take(300).collect())
}

/// Where [`WorkDir::save_log`] kept a failed run's CRIU log: shown as
/// `CRIU log: PATH`, `CRIU log not kept: WHY`, `CRIU wrote no log` or, when
/// it stopped before it wrote one, what it said.
pub enum SavedLog {
    Kept(PathBuf),
    /// It could not be kept; `read_from` holds it until the work directory
    /// is removed.
    NotKept {
        read_from: PathBuf,
        why: String,
    },
    /// No log; CRIU's first line on standard error.
    Said(String),
    None,
}

impl SavedLog {
    /// Where the log can be read now (for its last errors).
    pub fn path(&self) -> Option<&Path> {
        match self {
            SavedLog::Kept(p) | SavedLog::NotKept { read_from: p, .. } => Some(p),
            SavedLog::Said(_) | SavedLog::None => None,
        }
    }
}

impl std::fmt::Display for SavedLog {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            SavedLog::Kept(p) => write!(f, "CRIU log: {}", p.display()),
            SavedLog::NotKept { why, .. } => write!(f, "CRIU log not kept: {why}"),
            SavedLog::Said(line) => write!(f, "CRIU wrote no log; it said: {line}"),
            SavedLog::None => f.write_str("CRIU wrote no log"),
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
    fn logs_are_kept_only_in_a_private_directory_of_this_user() {
        use std::os::unix::fs::PermissionsExt;
        let base = tempfile::tempdir().unwrap();
        let work = WorkDir::new_in(base.path(), "criuz-t-").unwrap();
        std::fs::write(work.path().join("dump.log"), b"Error (criu/cr-dump.c:1): x\n").unwrap();
        // Someone else's directory of logs, and a link to it where criuz
        // keeps its own: nothing is copied there, nothing removed.
        let theirs = base.path().join("theirs");
        std::fs::create_dir(&theirs).unwrap();
        for i in 0..KEPT_LOGS + 2 {
            std::fs::write(theirs.join(format!("app-{i}.log")), b"keep").unwrap();
        }
        let link = base.path().join("criuz-logs");
        std::os::unix::fs::symlink(&theirs, &link).unwrap();
        let open = base.path().join("open-logs");
        std::fs::create_dir(&open).unwrap();
        std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o777)).unwrap();
        for dir in [&link, &open] {
            let saved = work.save_log_in("dump.log", dir);
            assert!(matches!(saved, SavedLog::NotKept { .. }), "{}: {saved}", dir.display());
            assert!(saved.to_string().contains("not this user's private directory"), "{saved}");
            assert!(saved.path().is_some_and(|p| p.starts_with(work.path())), "its errors are still read");
        }
        assert_eq!(std::fs::read_dir(&theirs).unwrap().count(), KEPT_LOGS + 2);
        assert_eq!(std::fs::read_dir(&open).unwrap().count(), 0);
        // A directory of its own is made private, and keeps the log.
        let own = base.path().join("own-logs");
        let SavedLog::Kept(kept) = work.save_log_in("dump.log", &own) else { panic!("not kept") };
        assert!(kept.starts_with(&own) && kept.exists());
        assert_eq!(std::fs::metadata(&own).unwrap().permissions().mode() & 0o777, 0o700);
        assert!(matches!(work.save_log_in("restore.log", &own), SavedLog::None));
        // No log, but CRIU said why on its standard error: its first line.
        drop(criu_output(work.path()));
        assert!(matches!(work.save_log_in("restore.log", &own), SavedLog::None), "an empty one says nothing");
        std::fs::write(work.path().join(CRIU_OUTPUT), "\ncriu: unrecognized option '--x'\n\nUsage:\n").unwrap();
        let said = work.save_log_in("restore.log", &own);
        assert_eq!(said.to_string(), "CRIU wrote no log; it said: criu: unrecognized option '--x'");
        // A line that ends in a colon is said with the one after it.
        let needs = "CRIU needs to have the CAP_SYS_ADMIN or the CAP_CHECKPOINT_RESTORE capability: \n\
                     setcap cap_checkpoint_restore+eip /x/criu\n";
        std::fs::write(work.path().join(CRIU_OUTPUT), needs).unwrap();
        assert_eq!(
            work.save_log_in("lazy.log", &own).to_string(),
            "CRIU wrote no log; it said: CRIU needs to have the CAP_SYS_ADMIN or the CAP_CHECKPOINT_RESTORE \
             capability: setcap cap_checkpoint_restore+eip /x/criu"
        );
    }

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

//! What this criuz has begun and not yet published: temporary archives,
//! work and staging directories. An interrupted criuz (SIGINT, SIGTERM,
//! SIGHUP; `proc::interrupt`) removes them before it dies, so a Ctrl-C
//! leaves nothing behind, where a SIGKILL leaves them to the next run's
//! sweep ([`leftover`]).
//!
//! One registry for the whole process, behind one lock. Publishing (the
//! rename that makes a file or directory the user's) runs under that lock
//! ([`Unfinished::publish`]), and an interruption takes the lock for good,
//! so each entry is either published whole or removed, never removed after
//! it became the user's. An entry that is the only copy of a checkpoint
//! (a container CRIU already stopped, its images not yet in an archive) is
//! marked [`keep_on_interrupt`](Unfinished::keep_on_interrupt): then it is
//! renamed `…-kept`, as a failed run keeps it, and named in the message.

use crate::io::leftover;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard};

/// What an interruption does with an entry.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum OnInterrupt {
    Remove,
    Keep,
}

struct Entry {
    id: u64,
    path: PathBuf,
    on_interrupt: OnInterrupt,
}

static REGISTRY: Mutex<Registry> = Mutex::new(Registry { entries: Vec::new(), published: Vec::new() });

struct Registry {
    entries: Vec<Entry>,
    /// What this criuz published (for the interruption's message).
    published: Vec<PathBuf>,
}
static NEXT_ID: AtomicU64 = AtomicU64::new(0);

/// The registry; a thread that panicked while holding it left it whole
/// (every change is one push, retain or field write).
fn registry() -> MutexGuard<'static, Registry> {
    REGISTRY.lock().unwrap_or_else(|p| p.into_inner())
}

/// One unfinished file or directory, registered while this lives.
#[derive(Debug)]
pub struct Unfinished {
    id: u64,
}

impl Unfinished {
    /// Registers `path`, made before (criuz registers what it makes as it
    /// makes it, [`made`](Self::made)).
    #[cfg(test)]
    fn register(path: &Path) -> Self {
        Self::register_in(&mut registry(), path)
    }

    fn register_in(registry: &mut Registry, path: &Path) -> Self {
        let id = NEXT_ID.fetch_add(1, Ordering::Relaxed);
        registry.entries.push(Entry { id, path: path.to_path_buf(), on_interrupt: OnInterrupt::Remove });
        Unfinished { id }
    }

    /// Runs `make` (which makes a file or directory and returns its path
    /// with what else it made) and registers the path, with no instant
    /// between the two in which an interruption could miss it. `make` must
    /// not register or drop an entry (the registry is held).
    pub fn made<T, E>(make: impl FnOnce() -> Result<(T, PathBuf), E>) -> Result<(T, Self), E> {
        let mut registry = registry();
        let (made, path) = make()?;
        Ok((made, Self::register_in(&mut registry, &path)))
    }

    /// From now on an interruption keeps the entry (renamed `…-kept`): it
    /// holds the only copy of a checkpoint.
    pub fn keep_on_interrupt(&self) {
        if let Some(e) = registry().entries.iter_mut().find(|e| e.id == self.id) {
            e.on_interrupt = OnInterrupt::Keep;
        }
    }

    /// Runs `publish` (the rename that hands the entry to the user) where
    /// no interruption can remove the entry meanwhile, and forgets the
    /// entry once it succeeded. `publish` must not register or drop an
    /// entry (the registry is held).
    pub fn publish<T, E>(&self, publish: impl FnOnce() -> Result<T, E>) -> Result<T, E> {
        self.publish_as(None, publish)
    }

    /// [`publish`](Self::publish) of the command's output `to` (an archive,
    /// an unpacked directory), which an interruption's message names.
    pub fn publish_output<T, E>(&self, to: &Path, publish: impl FnOnce() -> Result<T, E>) -> Result<T, E> {
        self.publish_as(Some(to), publish)
    }

    fn publish_as<T, E>(&self, to: Option<&Path>, publish: impl FnOnce() -> Result<T, E>) -> Result<T, E> {
        let mut registry = registry();
        let published = publish()?;
        registry.entries.retain(|e| e.id != self.id);
        registry.published.extend(to.map(Path::to_path_buf));
        Ok(published)
    }
}

impl Drop for Unfinished {
    fn drop(&mut self) {
        registry().entries.retain(|e| e.id != self.id);
    }
}

/// Runs `f`, a step criuz must not die in the middle of (letting a held
/// tree run once its guard is released: died between the two, criuz would
/// leave the tree stopped for good), where an interruption waits until it
/// is done. `f` must not register or drop an entry (the registry is held).
pub fn uninterrupted<T>(f: impl FnOnce() -> T) -> T {
    let _held = registry();
    f()
}

/// A new private directory `base/{prefix}XXXXXX` (0700), held while the
/// returned handle lives and registered as it gets its name, after the
/// sweep of the abandoned ones of its kind (`leftover::sweep_for_dir`).
pub fn held_dir(base: &Path, prefix: &str) -> std::io::Result<(PathBuf, std::fs::File, Unfinished)> {
    leftover::sweep_for_dir(base, prefix);
    let ((path, held), unfinished) = Unfinished::made(|| {
        let (path, held) = leftover::make_held_dir(base, prefix)?;
        Ok::<_, std::io::Error>(((path.clone(), held), path))
    })?;
    Ok((path, held, unfinished))
}

/// What [`end_unfinished`] did.
#[derive(Debug, Default)]
pub struct Ended {
    /// Removed (files and directories).
    pub removed: usize,
    /// Kept on purpose, under these names.
    pub kept: Vec<PathBuf>,
    /// Could not be removed (named in the message, for the user to).
    pub left: Vec<PathBuf>,
    /// Outputs published before the interruption (they stay).
    pub published: Vec<PathBuf>,
    /// The registry could not be had ([`end_unfinished_within`]): nothing
    /// was removed.
    pub busy: bool,
}

/// Holds the registry from now on, so nothing is published after, runs
/// `first` (ending what still works in the entries: CRIU), then removes
/// every unfinished entry (keeps those marked so): for a criuz that is
/// about to die by a signal.
pub fn end_unfinished(first: impl FnOnce()) -> Ended {
    end_held(registry(), first)
}

/// [`end_unfinished`] for a criuz ending on a panic, which may have come
/// while its own thread held the registry (making an entry): the registry
/// is waited for `wait` at most; then `first` runs, nothing is removed, and
/// what is left is the next run's to sweep ([`Ended::busy`]).
pub fn end_unfinished_within(wait: std::time::Duration, first: impl FnOnce()) -> Ended {
    let since = std::time::Instant::now();
    loop {
        match REGISTRY.try_lock() {
            Ok(held) => return end_held(held, first),
            Err(std::sync::TryLockError::Poisoned(p)) => return end_held(p.into_inner(), first),
            Err(std::sync::TryLockError::WouldBlock) if since.elapsed() < wait => {
                std::thread::sleep(std::time::Duration::from_millis(10))
            }
            Err(std::sync::TryLockError::WouldBlock) => {
                first();
                return Ended { busy: true, ..Ended::default() };
            }
        }
    }
}

fn end_held(mut entries: MutexGuard<'static, Registry>, first: impl FnOnce()) -> Ended {
    first();
    let mut ended = end_entries(&mut entries.entries);
    ended.published = still_there(&entries.published);
    // Held until the process dies: a publish racing the interruption
    // waits here instead of handing the user a half-made file.
    std::mem::forget(entries);
    ended
}

fn end_entries(entries: &mut Vec<Entry>) -> Ended {
    let mut ended = Ended::default();
    for e in entries.drain(..) {
        match e.on_interrupt {
            OnInterrupt::Keep => ended.kept.push(leftover::keep(&e.path).unwrap_or(e.path)),
            OnInterrupt::Remove if remove(&e.path) => ended.removed += 1,
            OnInterrupt::Remove => ended.left.push(e.path),
        }
    }
    ended
}

/// The published outputs that are still there: one made inside a work
/// directory (the tar `criuz podman restore` hands podman) went with it,
/// and the message must not say it stays.
fn still_there(published: &[PathBuf]) -> Vec<PathBuf> {
    published.iter().filter(|p| p.symlink_metadata().is_ok()).cloned().collect()
}

/// Removes a file or directory; whether it is gone. A directory is tried
/// a few times: a CRIU still at work in it may add a file between the
/// removal's listing and its last `rmdir` (it dies with criuz, after).
fn remove(path: &Path) -> bool {
    const TRIES: usize = 5;
    for _ in 0..TRIES {
        let removed = match path.symlink_metadata() {
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return true,
            Err(_) => return false,
            Ok(m) if m.is_dir() => leftover::remove_dir(path),
            Ok(_) => std::fs::remove_file(path),
        };
        match removed {
            Ok(()) => return true,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return true,
            Err(_) => std::thread::sleep(std::time::Duration::from_millis(20)),
        }
    }
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    fn registered(path: &Path) -> bool {
        registry().entries.iter().any(|e| e.path == path)
    }

    #[test]
    fn an_interruption_removes_unfinished_entries_and_keeps_marked_ones() {
        let base = tempfile::tempdir().unwrap();
        let file = base.path().join(".a.czr.criuz-tmp-1");
        let dir = base.path().join("criuz-dump-x");
        let only_copy = base.path().join("criuz-runc-y");
        std::fs::write(&file, b"partial").unwrap();
        std::fs::create_dir_all(dir.join("sub")).unwrap();
        std::fs::write(dir.join("sub/pages-1.img"), b"x").unwrap();
        std::fs::create_dir(&only_copy).unwrap();
        let published = base.path().join("published");
        std::fs::write(&published, b"done").unwrap();
        let published_inside = dir.join("checkpoint.tar");
        std::fs::write(&published_inside, b"done").unwrap();

        let a = Unfinished::register(&file);
        let b = Unfinished::register(&dir);
        let c = Unfinished::register(&only_copy);
        c.keep_on_interrupt();
        let d = Unfinished::register(&published);
        assert!(d.publish_output(&published, || Err::<(), ()>(())).is_err());
        assert!(registered(&published), "an entry whose publishing failed stays unfinished");
        assert_eq!(d.publish_output(&published, || Ok::<_, ()>(7)), Ok(7), "publish runs the rename's closure");
        assert!(registry().published.contains(&published), "an output published is named");
        assert!(!registered(&published), "a published entry is no longer the registry's");

        // Only this test's entries: other tests register their own paths.
        let mut ours = Vec::new();
        registry().entries.retain(|e| {
            let mine = e.path.starts_with(base.path());
            if mine {
                ours.push(Entry { id: e.id, path: e.path.clone(), on_interrupt: e.on_interrupt });
            }
            !mine
        });
        let ended = end_entries(&mut ours);
        assert_eq!(ended.removed, 2);
        assert!(ended.left.is_empty());
        assert!(!file.exists() && !dir.exists(), "unfinished entries are removed");
        assert_eq!(ended.kept, vec![base.path().join("criuz-runc-y-kept")]);
        assert!(ended.kept[0].is_dir(), "the only copy stays, renamed");
        assert!(published.exists(), "what was published stays");
        assert_eq!(
            still_there(&[published.clone(), published_inside]),
            vec![published],
            "an output made inside a removed directory is not said to stay"
        );
        drop((a, b, c));
    }

    #[test]
    fn a_dropped_entry_is_forgotten() {
        let path = PathBuf::from("/nonexistent/criuz-unfinished-drop");
        let u = Unfinished::register(&path);
        assert!(registered(&path));
        drop(u);
        assert!(!registered(&path));
    }
}

//! What a killed criuz leaves behind: a temporary archive beside its target
//! (as large as what was written) and a work directory (on `/dev/shm`, a
//! container's images held in RAM until reboot). Neither can be removed by
//! a process that was SIGKILLed or lost its machine, so the next criuz that
//! makes one of the same kind removes them.
//!
//! Each is `flock`ed by its owner for as long as it lives, from before it
//! appears under its name ([`publish_held`]: made under a staging name,
//! locked, then renamed), so an unlocked one is abandoned, with no age or
//! grace period to guess. A lock, unlike a pid in the name, is released by
//! the kernel when its holder dies and means the same in every pid
//! namespace: a criuz in a container sharing `/tmp` with the host never
//! takes the other's live files for dead ones. A work directory kept on
//! purpose (the only copy of a checkpoint) is renamed `…-kept` and stays.

use std::fs::File;
use std::os::fd::AsRawFd;
use std::os::unix::fs::MetadataExt;
use std::path::Path;

/// What the name of a leftover kept on purpose ends with.
pub const KEPT_SUFFIX: &str = "-kept";

/// Takes the lock on `handle` (the file, or the directory, at `staging`)
/// and renames it to `name`: under `name` it is held from the first instant.
pub fn publish_held(handle: &File, staging: &Path, name: &Path) -> std::io::Result<()> {
    if !try_lock(handle) {
        return Err(std::io::Error::last_os_error());
    }
    std::fs::rename(staging, name)
}

/// An exclusive lock on `f`, if nobody holds one.
fn try_lock(f: &File) -> bool {
    // SAFETY: flock on a descriptor we own.
    unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) == 0 }
}

/// Removes the files and directories `dir/{prefix}*` of criuz's own user
/// that nobody holds, except those kept on purpose. Best effort.
pub fn remove_abandoned(dir: &Path, prefix: &str) {
    let Ok(entries) = std::fs::read_dir(dir) else { return };
    // SAFETY: geteuid has no preconditions.
    let uid = unsafe { libc::geteuid() };
    for e in entries.flatten() {
        let name = e.file_name();
        let Some(name) = name.to_str() else { continue };
        if !name.starts_with(prefix) || name.ends_with(KEPT_SUFFIX) {
            continue;
        }
        let path = e.path();
        // Not through a symlink: only a file or directory of our own is taken.
        let Ok(meta) = std::fs::symlink_metadata(&path) else { continue };
        if meta.uid() != uid || !(meta.is_dir() || meta.is_file()) {
            continue;
        }
        let Ok(handle) = File::open(&path) else { continue };
        if !try_lock(&handle) {
            continue;
        }
        let _ = if meta.is_dir() { std::fs::remove_dir_all(&path) } else { std::fs::remove_file(&path) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A file and a directory of each kind: abandoned (unlocked), held,
    /// kept, another prefix; only the abandoned ones go.
    #[test]
    fn only_what_nobody_holds_is_removed() {
        let base = tempfile::tempdir().unwrap();
        let at = |n: &str| base.path().join(n);
        let mut held = Vec::new();
        for (name, dir) in [("x-1", false), ("x-2", true)] {
            let staging = at(&format!("staging-{name}"));
            let handle = if dir {
                std::fs::create_dir(&staging).unwrap();
                File::open(&staging).unwrap()
            } else {
                File::create(&staging).unwrap()
            };
            publish_held(&handle, &staging, &at(name)).unwrap();
            held.push(handle);
        }
        std::fs::write(at("x-3"), b"partial").unwrap();
        std::fs::create_dir(at("x-4")).unwrap();
        std::fs::write(at("x-4/pages-1.img"), b"x").unwrap();
        std::fs::create_dir(at("x-5-kept")).unwrap();
        std::fs::write(at("y-1"), b"other").unwrap();

        remove_abandoned(base.path(), "x-");
        assert!(!at("x-3").exists() && !at("x-4").exists(), "abandoned ones are removed");
        for n in ["x-1", "x-2", "x-5-kept", "y-1"] {
            assert!(at(n).exists(), "{n} was removed");
        }
        drop(held);
        remove_abandoned(base.path(), "x-");
        assert!(!at("x-1").exists() && !at("x-2").exists(), "released by their holder, they are abandoned");
        assert!(at("x-5-kept").exists());
    }
}

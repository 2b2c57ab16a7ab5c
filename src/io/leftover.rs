//! What a killed criuz leaves behind: a temporary archive beside its target
//! (as large as what was written) and a work directory (on `/dev/shm`, a
//! container's images held in RAM until reboot). Neither can be removed by
//! a process that was SIGKILLed or lost its machine, so the next criuz that
//! makes one of the same kind removes them. (An interrupted criuz removes
//! its own before it dies: `unfinished`.)
//!
//! Each is `flock`ed by its owner for as long as it lives, from before it
//! appears under its name ([`publish_held`]: made under a staging name,
//! locked, then renamed), so an unlocked one is abandoned, with no age or
//! grace period to guess. A lock, unlike a pid in the name, is released by
//! the kernel when its holder dies and means the same in every pid
//! namespace: a criuz in a container sharing `/tmp` with the host never
//! takes the other's live files for dead ones. A work directory kept on
//! purpose (the only copy of a checkpoint) is renamed `…-kept` and stays.
//! The staging name is unheld for the instant between its creation and its
//! lock; a criuz killed in that instant leaves it, so unheld staging
//! entries go too (a maker caught in that very instant by another
//! criuz's sweep makes its entry again, `made_again_if_swept`).

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

/// Renames `path` to its kept name (`…-kept`), which no sweep takes;
/// returns that name.
pub fn keep(path: &Path) -> std::io::Result<std::path::PathBuf> {
    let mut kept = path.as_os_str().to_owned();
    kept.push(KEPT_SUFFIX);
    let kept = std::path::PathBuf::from(kept);
    std::fs::rename(path, &kept)?;
    Ok(kept)
}

/// A new private directory `base/{prefix}XXXXXX` (0700), held from the
/// moment it has that name, after removing the abandoned ones with the same
/// prefix (what killed runs of the same kind left there). The directory is
/// held for as long as the returned handle lives. (criuz makes its own
/// through `unfinished::held_dir`, which registers them as they are made.)
#[cfg(test)]
fn held_dir(base: &Path, prefix: &str) -> std::io::Result<(std::path::PathBuf, File)> {
    sweep_for_dir(base, prefix);
    make_held_dir(base, prefix)
}

/// The sweep before a held directory is made: the
/// abandoned directories `base/{prefix}*`, and those killed before their
/// staging directory got its held name.
pub fn sweep_for_dir(base: &Path, prefix: &str) {
    remove_abandoned_of(base, &[prefix, STAGING_DIR_PREFIX]);
}

/// A new private directory `base/{prefix}XXXXXX` (0700), held from the
/// moment it has that name (held while the returned handle lives), without
/// the sweep ([`sweep_for_dir`]).
pub fn make_held_dir(base: &Path, prefix: &str) -> std::io::Result<(std::path::PathBuf, File)> {
    made_again_if_swept(|| {
        let staging = make_staging_dir(base)?;
        // Not held: removed (still empty) by this run, not left to a sweep.
        hold_staged_dir(&staging, base, prefix).inspect_err(|_| {
            let _ = std::fs::remove_dir(&staging);
        })
    })
}

/// A new empty directory `base/.criuz-new-XXXXXX` (0700). Made here rather
/// than by tempfile, whose errors carry no OS error code (a caller tells no
/// permission, which has a way round, from a failure that has none) and
/// name the random name tried, which means nothing to the user.
fn make_staging_dir(base: &Path) -> std::io::Result<std::path::PathBuf> {
    use std::os::unix::fs::DirBuilderExt;
    let mut tries = 0;
    loop {
        let unique: String = std::iter::repeat_with(fastrand::alphanumeric).take(6).collect();
        let path = base.join(format!("{STAGING_DIR_PREFIX}{unique}"));
        match std::fs::DirBuilder::new().mode(0o700).create(&path) {
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists && tries < 64 => tries += 1,
            made => return made.map(|()| path),
        }
    }
}

/// Runs `make` (which makes a staging entry and publishes it held) again
/// when it fails as another criuz's sweep (`remove_abandoned`) makes it
/// fail. Such a sweep takes a staging entry that is not yet locked: ours,
/// in the instant between its creation and its lock, when several start
/// together. Then ours is gone, locked by the sweeper, or its name still
/// taken until the sweeper removes it ([`MaybeSwept`]), and `make` makes it
/// anew; after [`STAGING_TRIES`] more tries the last error stands. Any other
/// failure (no permission, no space) stands at once.
pub fn made_again_if_swept<T, E: MaybeSwept>(mut make: impl FnMut() -> Result<T, E>) -> Result<T, E> {
    let mut tries = 0;
    loop {
        match make() {
            Err(e) if e.maybe_swept() && tries < STAGING_TRIES => tries += 1,
            made => return made,
        }
    }
}

/// Whether an error is one a sweep of our staging entry by another criuz
/// causes (see [`made_again_if_swept`]).
pub trait MaybeSwept {
    fn maybe_swept(&self) -> bool;
}

impl MaybeSwept for std::io::Error {
    fn maybe_swept(&self) -> bool {
        use std::io::ErrorKind::{AlreadyExists, NotFound, WouldBlock};
        matches!(self.kind(), NotFound | WouldBlock | AlreadyExists)
    }
}

impl MaybeSwept for crate::error::Error {
    fn maybe_swept(&self) -> bool {
        matches!(self, crate::error::Error::File { err, .. } if err.maybe_swept())
    }
}

/// What a staging directory's name starts with, before it is held.
const STAGING_DIR_PREFIX: &str = ".criuz-new-";

/// How many times a staging entry is made again after a failure.
const STAGING_TRIES: u32 = 16;

/// Locks the staging directory and renames it `base/{prefix}XXXXXX`.
fn hold_staged_dir(staging: &Path, base: &Path, prefix: &str) -> std::io::Result<(std::path::PathBuf, File)> {
    let held = File::open(staging)?;
    let unique = staging.file_name().and_then(|n| n.to_str()).unwrap_or_default();
    let path = base.join(format!("{prefix}{}", unique.trim_start_matches(STAGING_DIR_PREFIX)));
    publish_held(&held, staging, &path)?;
    Ok((path, held))
}

/// Kills the processes of user `uid` whose command line names `dir` (or a
/// path in it) that are stopped or restoring: what the run that died left
/// on its work directory. A CRIU killed with criuz (it dies with criuz,
/// `session::criu_run`) while its start-up probe of hardware breakpoints
/// was stopped under its ptrace leaves that probe stopped for good, a copy
/// of CRIU's command line (`-D` this directory) that no one resumes or
/// reaps; a restoring CRIU's helper can sleep on for good. A dumping CRIU
/// still at work there (curing its tree after criuz died) is let finish.
fn end_processes_of(dir: &Path, uid: u32) {
    use std::os::unix::ffi::OsStrExt;
    let Ok(procs) = std::fs::read_dir("/proc") else { return };
    let me = std::process::id();
    let dir = dir.as_os_str().as_bytes();
    for e in procs.flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|n| n.parse::<u32>().ok()) else { continue };
        if pid == me || e.metadata().map(|m| m.uid()).ok() != Some(uid) {
            continue;
        }
        let Ok(cmdline) = std::fs::read(e.path().join("cmdline")) else { continue };
        let names_dir =
            cmdline.split(|&b| b == 0).any(|a| a.starts_with(dir) && matches!(a.get(dir.len()), None | Some(b'/')));
        let stat = std::fs::read_to_string(e.path().join("stat")).unwrap_or_default();
        let stopped =
            stat.rsplit_once(')').is_some_and(|(_, r)| matches!(r.trim_start().chars().next(), Some('T' | 't')));
        // A restoring CRIU (or a task it forked) of a dead criuz can only
        // fail (its tree is killed by criuz's guard): it goes whatever its
        // state. A dumping one goes only if stopped.
        let restoring = cmdline.split(|&b| b == 0).nth(1) == Some(b"restore".as_slice());
        if names_dir && (stopped || restoring) {
            // SAFETY: a process of our own user that works on an abandoned
            // directory of criuz's; nothing else names that directory.
            unsafe { libc::kill(pid as i32, libc::SIGKILL) };
        }
    }
}

/// Removes a directory criuz made and everything in it, first detaching
/// whatever is mounted below it: CRIU mounts its cgroup yard in the images
/// directory of a container's restore (`.criu.cgyard.*`, a tmpfs with the
/// cgroup hierarchies), and a CRIU killed mid-restore leaves it mounted,
/// which no plain removal gets past.
pub fn remove_dir(path: &Path) -> std::io::Result<()> {
    detach_mounts_below(path);
    std::fs::remove_dir_all(path)
}

/// Detaches (lazily, `MNT_DETACH`) everything mounted strictly below
/// `path`, deepest first, so that a recursive removal of `path` removes
/// only what is really in it, never a file system mounted into it.
pub fn detach_mounts_below(path: &Path) {
    use std::os::unix::ffi::OsStrExt;
    let mounts = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    let mut below: Vec<std::path::PathBuf> = mounts
        .lines()
        .filter_map(|l| l.split(' ').nth(4))
        .map(|p| std::path::PathBuf::from(unescape_mount_path(p)))
        .filter(|p| p.starts_with(path) && p != path)
        .collect();
    // Deepest first (a detach of the top would take the rest along, but
    // leave them mounted out of sight).
    below.sort_by_key(|p| std::cmp::Reverse(p.components().count()));
    for m in below {
        if let Ok(c) = std::ffi::CString::new(m.as_os_str().as_bytes()) {
            // SAFETY: a valid NUL-terminated path; MNT_DETACH never blocks.
            unsafe { libc::umount2(c.as_ptr(), libc::MNT_DETACH) };
        }
    }
}

/// Detaches the cgroup yards (`.criu.cgyard.*`) that CRIU mounted in its
/// work directory `dir`, with what is mounted in them: a CRIU killed
/// mid-restore leaves them mounted, and podman then cannot remove the
/// container it was restoring (its files are below them).
pub fn detach_cgroup_yards(dir: &Path) {
    use std::os::unix::ffi::OsStrExt;
    let Ok(entries) = std::fs::read_dir(dir) else { return };
    for yard in entries.flatten().filter(|e| e.file_name().as_bytes().starts_with(b".criu.cgyard.")) {
        let yard = yard.path();
        detach_mounts_below(&yard);
        if let Ok(c) = std::ffi::CString::new(yard.as_os_str().as_bytes()) {
            // SAFETY: a valid NUL-terminated path; MNT_DETACH never blocks.
            unsafe { libc::umount2(c.as_ptr(), libc::MNT_DETACH) };
        }
    }
}

/// mountinfo escapes space, tab, newline and backslash as `\ooo`.
fn unescape_mount_path(p: &str) -> String {
    let b = p.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        let octal = b.get(i + 1..i + 4).and_then(|o| u8::from_str_radix(std::str::from_utf8(o).ok()?, 8).ok());
        match (b[i], octal) {
            (b'\\', Some(c)) => {
                out.push(c);
                i += 4;
            }
            (c, _) => {
                out.push(c);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// An exclusive lock on `f`, if nobody holds one.
fn try_lock(f: &File) -> bool {
    // SAFETY: flock on a descriptor we own.
    unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) == 0 }
}

/// Removes the files and directories `dir/{prefix}*` of criuz's own user
/// that nobody holds, except those kept on purpose. Best effort.
pub fn remove_abandoned(dir: &Path, prefix: &str) {
    remove_abandoned_of(dir, &[prefix]);
}

/// [`remove_abandoned`] for several prefixes in one look at `dir` (a
/// `$TMPDIR` may hold thousands of entries).
fn remove_abandoned_of(dir: &Path, prefixes: &[&str]) {
    let Ok(entries) = std::fs::read_dir(dir) else { return };
    // SAFETY: geteuid has no preconditions.
    let uid = unsafe { libc::geteuid() };
    for e in entries.flatten() {
        let name = e.file_name();
        let Some(name) = name.to_str() else { continue };
        if !prefixes.iter().any(|p| name.starts_with(p)) || name.ends_with(KEPT_SUFFIX) {
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
        if meta.is_dir() {
            end_processes_of(&path, uid);
            let _ = remove_dir(&path);
        } else {
            let _ = std::fs::remove_file(&path);
        }
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

    /// Making a directory sweeps, in one look, the abandoned ones of its
    /// prefix and the staging ones a killed maker left, and nothing else.
    #[test]
    fn a_new_directory_sweeps_its_kind_and_abandoned_staging() {
        let base = tempfile::tempdir().unwrap();
        let at = |n: &str| base.path().join(n);
        for n in ["criuz-t-old", &format!("{STAGING_DIR_PREFIX}old"), "criuz-u-other"] {
            std::fs::create_dir(at(n)).unwrap();
        }
        let (made, _held) = held_dir(base.path(), "criuz-t-").unwrap();
        assert!(!at("criuz-t-old").exists(), "an abandoned one of its kind is removed");
        assert!(!at(&format!("{STAGING_DIR_PREFIX}old")).exists(), "an abandoned staging one is removed");
        assert!(at("criuz-u-other").exists() && made.exists(), "another kind, and the new one, stay");
    }

    /// Makers started together sweep each other's staging directories in
    /// the instant before they are locked; every maker still gets one.
    #[test]
    fn directories_made_together_are_all_made() {
        let base = tempfile::tempdir().unwrap();
        let made: Vec<_> = std::thread::scope(|s| {
            let makers: Vec<_> = (0..8)
                .map(|_| {
                    s.spawn(|| {
                        (0..200)
                            .map(|_| held_dir(base.path(), "criuz-t-").map(|(p, _)| p))
                            .collect::<std::io::Result<Vec<_>>>()
                    })
                })
                .collect();
            makers.into_iter().map(|m| m.join().unwrap()).collect()
        });
        let made: Vec<_> = made.into_iter().map(|m| m.expect("every maker gets its directory")).collect();
        assert_eq!(made.iter().map(Vec::len).sum::<usize>(), 1600);
    }

    /// Only what a sweep causes is tried again: a refusal stands at once.
    #[test]
    fn only_a_swept_entry_is_made_again() {
        let kinds = [std::io::ErrorKind::PermissionDenied, std::io::ErrorKind::NotFound];
        let tries: Vec<u32> = kinds
            .iter()
            .map(|&kind| {
                let mut tries = 0;
                let made: std::io::Result<()> = made_again_if_swept(|| {
                    tries += 1;
                    Err(std::io::Error::from(kind))
                });
                assert_eq!(made.map_err(|e| e.kind()), Err(kind));
                tries
            })
            .collect();
        assert_eq!(tries, [1, STAGING_TRIES + 1]);
    }

    #[test]
    fn mount_paths_are_unescaped() {
        assert_eq!(unescape_mount_path(r"/dev/shm/a\040b\011c\134d"), "/dev/shm/a b\tc\\d");
        assert_eq!(unescape_mount_path("/plain/path"), "/plain/path");
        assert_eq!(unescape_mount_path(r"/trailing\04"), r"/trailing\04");
    }

    /// What CRIU leaves mounted in a work directory (its cgroup yard) does
    /// not stop the removal, and what is mounted there is not removed with
    /// it: the file system mounted inside keeps its files.
    #[test]
    fn a_directory_with_a_mount_inside_is_removed_without_its_mount() {
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } != 0 {
            eprintln!("needs root (mount): CI runs it as root");
            return;
        }
        let base = tempfile::tempdir().unwrap();
        let elsewhere = tempfile::tempdir().unwrap();
        std::fs::write(elsewhere.path().join("keep"), b"not criuz's").unwrap();
        let work = base.path().join("criuz-x-1");
        let inner = work.join(".criu.cgyard.x/deeper");
        std::fs::create_dir_all(&inner).unwrap();
        let c = |p: &Path| std::ffi::CString::new(p.to_str().unwrap()).unwrap();
        let (src, dst) = (c(elsewhere.path()), c(&inner));
        // SAFETY: valid NUL-terminated paths; a bind mount of our own.
        let r = unsafe { libc::mount(src.as_ptr(), dst.as_ptr(), std::ptr::null(), libc::MS_BIND, std::ptr::null()) };
        assert_eq!(r, 0, "bind mount: {}", std::io::Error::last_os_error());
        remove_dir(&work).unwrap();
        assert!(!work.exists(), "the directory is removed");
        assert!(elsewhere.path().join("keep").exists(), "the mounted file system kept its files");
    }

    /// A cgroup yard as CRIU leaves it in a container's directory (a tmpfs
    /// with more mounted in it) is detached, yard and all, and nothing else
    /// mounted there is.
    #[test]
    fn a_cgroup_yard_left_mounted_is_detached_and_only_it() {
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } != 0 {
            eprintln!("needs root (mount): CI runs it as root");
            return;
        }
        let dir = tempfile::tempdir().unwrap();
        let (yard, shm) = (dir.path().join(".criu.cgyard.x"), dir.path().join("shm"));
        let inner = yard.join("pids");
        for d in [&yard, &shm] {
            std::fs::create_dir(d).unwrap();
        }
        let c = |p: &Path| std::ffi::CString::new(p.to_str().unwrap()).unwrap();
        let tmpfs = |at: &Path| {
            let (src, dst, fs) = (c(Path::new("none")), c(at), c(Path::new("tmpfs")));
            // SAFETY: valid NUL-terminated strings; a tmpfs of our own.
            let r = unsafe { libc::mount(src.as_ptr(), dst.as_ptr(), fs.as_ptr(), 0, std::ptr::null()) };
            assert_eq!(r, 0, "mount {at:?}: {}", std::io::Error::last_os_error());
        };
        tmpfs(&yard);
        std::fs::create_dir(&inner).unwrap();
        tmpfs(&inner);
        tmpfs(&shm);
        let mounted = |p: &Path| {
            let info = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
            info.lines().any(|l| l.split(' ').nth(4) == Some(p.to_str().unwrap()))
        };
        assert!(mounted(&yard) && mounted(&inner) && mounted(&shm));
        detach_cgroup_yards(dir.path());
        assert!(!mounted(&yard) && !mounted(&inner), "the yard and what is in it are detached");
        assert!(mounted(&shm), "what else is mounted there stays");
        // SAFETY: a valid NUL-terminated path; our own mount.
        unsafe { libc::umount2(c(&shm).as_ptr(), libc::MNT_DETACH) };
    }
}

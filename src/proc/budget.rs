//! One memory budget for every criuz on the machine. A dump that absorbs
//! CRIU's pages before compressing them can hold about the whole image; an
//! eviction wave starts many dumps at once, and each taking a quarter of
//! the memory it saw at its start would together take all of it. So each
//! takes its absorb memory from one machine-wide share (a quarter of the
//! machine's memory by default, `CRIUZ_MEMORY_SHARE` bytes to change it):
//! a grant is a small file in a private directory (`/run/criuz` for root),
//! `flock`ed by its holder for as long as it lives, so the kernel releases
//! the grant of a criuz that dies and the next one removes the file (as
//! for leftovers, `io::leftover`). Grants are given under an exclusive
//! lock on the directory's lock file, the used total being the sum of the
//! files still held. A dump that gets less than it asked for compresses as
//! it goes for the rest; it never fails for want of budget. An interrupted
//! criuz removes its grant on its way out (`io::unfinished`).

use crate::io::leftover;
use crate::io::unfinished::Unfinished;
use std::fs::File;
use std::io::Write;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};

/// Names of grant files.
const GRANT_PREFIX: &str = "grant-";

/// Memory granted to one criuz; given back when dropped.
#[derive(Debug)]
pub struct Grant {
    /// Bytes granted (0: none).
    pub bytes: usize,
    held: Option<(File, PathBuf, Unfinished)>,
}

impl Drop for Grant {
    fn drop(&mut self) {
        if let Some((_, path, _)) = self.held.take() {
            let _ = std::fs::remove_file(path);
        }
    }
}

impl Grant {
    /// Nothing granted.
    pub fn none() -> Grant {
        Grant { bytes: 0, held: None }
    }
}

/// Bytes every criuz on the machine may hold together: `CRIUZ_MEMORY_SHARE`
/// bytes, or a quarter of the memory criuz runs in (the machine's, or its
/// memory cgroup's limit: `memory::total`).
pub fn machine_share() -> usize {
    if let Some(n) = std::env::var("CRIUZ_MEMORY_SHARE").ok().and_then(|v| v.trim().parse().ok()) {
        return n;
    }
    usize::try_from(super::memory::total() / 4).unwrap_or(usize::MAX)
}

/// criuz's runtime directory, where grants (and claims, `claim`) live:
/// `/run/criuz` for root, else under `$XDG_RUNTIME_DIR`, else under the
/// temporary directory.
pub(crate) fn runtime_dir() -> PathBuf {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } == 0 {
        return PathBuf::from("/run/criuz");
    }
    match std::env::var_os("XDG_RUNTIME_DIR") {
        Some(d) => PathBuf::from(d).join("criuz"),
        // SAFETY: as above.
        None => crate::io::temp_root().join(format!("criuz-{}", unsafe { libc::geteuid() })),
    }
}

/// Asks for `want` bytes of the machine's share; gets what is left of it,
/// up to `want` (maybe 0). Best effort: where grants cannot be kept (no
/// writable directory), `want` is granted as if alone.
pub fn reserve(want: usize) -> Grant {
    reserve_in(&runtime_dir(), machine_share(), want)
}

pub(crate) fn reserve_in(dir: &Path, share: usize, want: usize) -> Grant {
    if want == 0 {
        return Grant { bytes: 0, held: None };
    }
    let alone = Grant { bytes: want, held: None };
    // Only a directory of this user's own: grants in one another user made
    // could be forged, and its links followed.
    let made = crate::io::private_dir(dir);
    let Ok(lock) = made.and_then(|()| File::create(dir.join("budget.lock"))) else { return alone };
    // SAFETY: flock on a descriptor we own; released when `lock` closes.
    if unsafe { libc::flock(lock.as_raw_fd(), libc::LOCK_EX) } != 0 {
        return alone;
    }
    leftover::remove_abandoned(dir, GRANT_PREFIX);
    let used: usize = std::fs::read_dir(dir)
        .map(|d| {
            d.flatten()
                .filter(|e| e.file_name().to_string_lossy().starts_with(GRANT_PREFIX))
                .filter_map(|e| std::fs::read_to_string(e.path()).ok()?.trim().parse::<usize>().ok())
                .sum()
        })
        .unwrap_or(0);
    let bytes = want.min(share.saturating_sub(used));
    if bytes == 0 {
        return Grant { bytes: 0, held: None };
    }
    let stamp = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos());
    let id = format!("{}-{stamp}", std::process::id());
    let staging = dir.join(format!("new-{id}"));
    let name = dir.join(format!("{GRANT_PREFIX}{id}"));
    // Registered as it is made: an interruption removes it.
    let written = Unfinished::made(|| {
        File::create(&staging).and_then(|mut f| {
            f.write_all(bytes.to_string().as_bytes())?;
            leftover::publish_held(&f, &staging, &name)?;
            Ok((f, name.clone()))
        })
    });
    match written {
        Ok((f, unfinished)) => Grant { bytes, held: Some((f, name, unfinished)) },
        Err(_) => {
            let _ = std::fs::remove_file(&staging);
            alone
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grants_share_the_machine_budget_and_come_back() {
        let dir = tempfile::tempdir().unwrap();
        let share = 100;
        let a = reserve_in(dir.path(), share, 60);
        let b = reserve_in(dir.path(), share, 60);
        let c = reserve_in(dir.path(), share, 60);
        assert_eq!((a.bytes, b.bytes, c.bytes), (60, 40, 0), "together within the share");
        drop(a);
        let d = reserve_in(dir.path(), share, 80);
        assert_eq!(d.bytes, 60, "a grant given back is free again");
        // A grant whose holder died (its file left, unlocked) is free too.
        std::fs::write(dir.path().join("grant-4242-1"), b"30").unwrap();
        drop(b);
        assert_eq!(reserve_in(dir.path(), share, 100).bytes, 40, "held grants count, abandoned ones do not");
        assert!(!dir.path().join("grant-4242-1").exists(), "the abandoned grant is removed");
        drop((c, d));
    }
}

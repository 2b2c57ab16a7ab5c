//! The working set a lazy restore saw, kept beside the archive as
//! `<archive>.touch`: the pages each process faulted first, in order, which
//! the next lazy restore's fill brings before the rest. Only a hint, read
//! with care (a regular file, no more than a record can hold): a wrong one
//! changes the order pages arrive in, never their bytes.

use crate::error::Result;
use crate::io::Location;
use crate::session::pager::TOUCHED_MAX;
use std::collections::HashSet;
use std::path::Path;

/// Pages by pid that a lazy restore saw faulted (first touches, in order),
/// kept beside the archive as `<archive>.touch`: the next lazy restore's
/// fill brings their blocks first, in that order, so the working set
/// arrives before the rest while the process already runs. Only a hint: a
/// wrong one changes the order pages arrive in, never their bytes, which
/// always come from checked blocks. The record's first line:
const TOUCH_HEADER: &str = "criuz working set 1";

pub(super) fn touch_path(input: &Location) -> Option<std::path::PathBuf> {
    input.path().map(|path| {
        let mut p = path.as_os_str().to_owned();
        p.push(".touch");
        p.into()
    })
}

/// The recorded faults, in order; empty if there is no usable record. Only
/// a regular file is read, and only as much as a record can hold: anyone
/// who may write beside the archive could have put a FIFO there (the
/// restore waited on it for good) or a link to `/dev/zero` (read until
/// memory ran out).
pub(super) fn load_touches(path: Option<&Path>) -> Vec<(u32, u64)> {
    use std::io::Read;
    use std::os::unix::fs::OpenOptionsExt;
    // A line is a pid, a space, an address in hex and a newline.
    const MOST_BYTES: u64 = TOUCH_HEADER.len() as u64 + 1 + TOUCHED_MAX as u64 * 28;
    let read = |p: &Path| -> std::io::Result<String> {
        let file = std::fs::OpenOptions::new().read(true).custom_flags(libc::O_NONBLOCK | libc::O_NOFOLLOW).open(p)?;
        if !file.metadata()?.is_file() {
            return Err(std::io::ErrorKind::InvalidInput.into());
        }
        let mut text = String::new();
        file.take(MOST_BYTES).read_to_string(&mut text)?;
        Ok(text)
    };
    let Some(text) = path.and_then(|p| read(p).ok()) else { return Vec::new() };
    let mut lines = text.lines();
    if lines.next() != Some(TOUCH_HEADER) {
        return Vec::new();
    }
    lines
        .filter_map(|l| {
            let (pid, vaddr) = l.split_once(' ')?;
            Some((pid.parse().ok()?, u64::from_str_radix(vaddr, 16).ok()?))
        })
        .take(TOUCHED_MAX)
        .collect()
}

/// Writes the old record followed by the new faults (complete or not at all,
/// 0600: it maps the process's memory).
fn save_touches(path: &Path, old: &[(u32, u64)], new: &[(u32, u64)]) -> Result<()> {
    let mut seen = HashSet::new();
    let mut text = format!("{TOUCH_HEADER}\n");
    for &(pid, vaddr) in old.iter().chain(new).take(TOUCHED_MAX) {
        if seen.insert((pid, vaddr)) {
            text.push_str(&format!("{pid} {vaddr:x}\n"));
        }
    }
    crate::io::replace_small_file(path, 0o600, text.as_bytes())
}

/// Records `faults` after the `recorded` ones at `touch` (beside the
/// archive) where some are new; the file, if written. Where the archive's
/// directory is read-only, the next restore loses its head start, not this
/// one.
pub(super) fn record_new_faults(
    touch: Option<&Path>,
    recorded: &[(u32, u64)],
    faults: &[(u32, u64)],
) -> Option<String> {
    let known: HashSet<&(u32, u64)> = recorded.iter().collect();
    let new_faults = faults.iter().any(|f| !known.contains(f));
    touch.filter(|t| new_faults && save_touches(t, recorded, faults).is_ok()).map(|t| t.display().to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A working-set record is read only from a regular file, and only as
    /// much as a record holds: a FIFO or a link to `/dev/zero` in its place
    /// (found by hand: the restore waited on the FIFO for good) reads as no
    /// record, at once.
    #[test]
    fn only_a_regular_file_is_read_as_a_working_set_record() {
        let dir = tempfile::tempdir().unwrap();
        let record = dir.path().join("a.czr.touch");
        save_touches(&record, &[(7, 0x1000)], &[(7, 0x3000), (8, 0x2000)]).unwrap();
        assert_eq!(load_touches(Some(&record)), vec![(7, 0x1000), (7, 0x3000), (8, 0x2000)]);
        let fifo = dir.path().join("fifo.touch");
        nix::unistd::mkfifo(&fifo, nix::sys::stat::Mode::S_IRWXU).unwrap();
        let zero = dir.path().join("zero.touch");
        std::os::unix::fs::symlink("/dev/zero", &zero).unwrap();
        for path in [&fifo, &zero, &dir.path().join("none.touch")] {
            assert_eq!(load_touches(Some(path)), Vec::new(), "{}", path.display());
        }
    }
}

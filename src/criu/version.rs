//! Which version a CRIU binary is: what `criu --version` says, remembered
//! per binary.
//!
//! Asking costs 3-4 ms (CRIU loads its libraries first), paid by every
//! command before anything else: a tenth of the time a 1 GiB lazy restore
//! takes to let its tree run on 2 cores. So the answer is kept in the cache
//! directory, under what changes whenever the file does (device, inode,
//! size, modification and change times): a binary rebuilt, replaced or
//! touched, even under the same name, is asked again. The record is only a
//! shortcut: missing, damaged, not the user's own, or not writable, CRIU is
//! simply asked.

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

/// The record's first line; a record that does not start with it is ignored.
const HEADER: &str = "criuz criu versions 1";
/// Binaries remembered: the newest answers are kept.
const KEPT: usize = 16;

/// The version of the CRIU at `path` (`criu --version`'s "Version:" line),
/// from the record at `record` where it knows this very file.
pub(crate) fn version_of(path: &Path, record: &Path) -> Result<String, String> {
    let key = identity(path);
    if let Some(v) = key.as_deref().and_then(|k| recorded(record, k)) {
        return Ok(v);
    }
    let version = ask(path)?;
    if let Some(k) = key {
        remember(record, &k, &version);
    }
    Ok(version)
}

/// Where the record lives.
pub(crate) fn record_path(cache: &Path) -> PathBuf {
    cache.join("criu-versions")
}

/// `criu --version`, run.
fn ask(path: &Path) -> Result<String, String> {
    let out = crate::spawn::command(path).arg("--version").output().map_err(|e| format!("cannot run: {e}"))?;
    let text = String::from_utf8_lossy(&out.stdout);
    text.lines()
        .find_map(|l| l.strip_prefix("Version:"))
        .map(|v| v.trim().to_string())
        .filter(|v| !v.is_empty() && !v.contains(char::is_whitespace))
        .ok_or_else(|| "no version in `criu --version` output".to_string())
}

/// What identifies the file's contents without reading them.
fn identity(path: &Path) -> Option<String> {
    let m = std::fs::metadata(path).ok()?;
    Some(format!(
        "{} {} {} {}.{} {}.{}",
        m.dev(),
        m.ino(),
        m.size(),
        m.mtime(),
        m.mtime_nsec(),
        m.ctime(),
        m.ctime_nsec()
    ))
}

/// The record's lines, `(identity, version)`, if it is one this user may
/// trust: their own file, writable by no one else.
fn entries(record: &Path) -> Vec<(String, String)> {
    let trusted = std::fs::symlink_metadata(record)
        // SAFETY: geteuid has no preconditions and cannot fail.
        .is_ok_and(|m| m.is_file() && m.uid() == unsafe { libc::geteuid() } && m.mode() & 0o022 == 0);
    if !trusted {
        return Vec::new();
    }
    let text = std::fs::read_to_string(record).unwrap_or_default();
    let mut lines = text.lines();
    if lines.next() != Some(HEADER) {
        return Vec::new();
    }
    lines
        .filter_map(|l| l.rsplit_once(' '))
        .filter(|(k, v)| !k.is_empty() && !v.is_empty())
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

fn recorded(record: &Path, key: &str) -> Option<String> {
    entries(record).into_iter().find(|(k, _)| k == key).map(|(_, v)| v)
}

/// Adds an answer to the record (best effort: a write that fails leaves
/// the next command to ask again). Written whole and renamed into place,
/// so a command reading it meanwhile sees the old record or the new one.
fn remember(record: &Path, key: &str, version: &str) {
    let mut kept: Vec<(String, String)> = entries(record).into_iter().filter(|(k, _)| k != key).collect();
    kept.push((key.to_string(), version.to_string()));
    let from = kept.len().saturating_sub(KEPT);
    let mut text = format!("{HEADER}\n");
    for (k, v) in &kept[from..] {
        text.push_str(&format!("{k} {v}\n"));
    }
    let Some(dir) = record.parent() else { return };
    if std::fs::create_dir_all(dir).is_err() {
        return;
    }
    let Ok(mut tmp) = tempfile::Builder::new().prefix(".criu-versions-").tempfile_in(dir) else { return };
    use std::io::Write;
    if tmp.write_all(text.as_bytes()).is_ok() {
        let _ = tmp.persist(record);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    /// A stand-in CRIU that says `version` and counts how often it was asked.
    fn fake_criu(dir: &Path, version: &str) -> PathBuf {
        let path = dir.join("criu");
        let count = dir.join("asked");
        let script =
            format!("#!/bin/sh\n[ \"$1\" = --version ] && echo x >> {}\necho 'Version: {version}'\n", count.display());
        std::fs::write(&path, script).expect("write fake criu");
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).expect("chmod");
        // Another test thread's fork may hold the file open for writing a
        // moment longer (ETXTBSY): wait until it runs.
        for _ in 0..100 {
            if std::process::Command::new(&path).output().is_ok() {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        path
    }

    fn asked(dir: &Path) -> usize {
        std::fs::read_to_string(dir.join("asked")).map_or(0, |s| s.lines().count())
    }

    #[test]
    fn a_binary_is_asked_once_and_again_when_it_changes() {
        let dir = tempfile::tempdir().expect("tempdir");
        let record = record_path(&dir.path().join("cache"));
        let criu = fake_criu(dir.path(), "4.2.1");
        assert_eq!(version_of(&criu, &record).as_deref(), Ok("4.2.1"));
        assert_eq!(version_of(&criu, &record).as_deref(), Ok("4.2.1"));
        assert_eq!(asked(dir.path()), 1, "the second answer came from the record");

        // Replaced under the same name: a new file, asked again.
        std::fs::remove_file(&criu).expect("rm");
        let criu = fake_criu(dir.path(), "3.19");
        assert_eq!(version_of(&criu, &record).as_deref(), Ok("3.19"));
        assert_eq!(asked(dir.path()), 2);
    }

    #[test]
    fn a_record_not_to_trust_is_not_read() {
        let dir = tempfile::tempdir().expect("tempdir");
        let record = record_path(dir.path());
        let criu = fake_criu(dir.path(), "4.2.1");
        let key = identity(&criu).expect("identity");
        // A record saying something else about this very file.
        std::fs::write(&record, format!("{HEADER}\n{key} 9.9\n")).expect("write record");
        std::fs::set_permissions(&record, std::fs::Permissions::from_mode(0o666)).expect("chmod");
        assert_eq!(version_of(&criu, &record).as_deref(), Ok("4.2.1"), "writable by others: not trusted");
        assert_eq!(asked(dir.path()), 1);

        std::fs::write(&record, format!("something else\n{key} 9.9\n")).expect("write record");
        std::fs::set_permissions(&record, std::fs::Permissions::from_mode(0o600)).expect("chmod");
        assert_eq!(version_of(&criu, &record).as_deref(), Ok("4.2.1"), "foreign header: not read");
        assert_eq!(asked(dir.path()), 2);

        std::fs::write(&record, format!("{HEADER}\n{key} 9.9\n")).expect("write record");
        assert_eq!(version_of(&criu, &record).as_deref(), Ok("9.9"), "a trusted record is believed");
        assert_eq!(asked(dir.path()), 2);
    }

    #[test]
    fn the_record_keeps_the_newest_answers() {
        let dir = tempfile::tempdir().expect("tempdir");
        let record = record_path(dir.path());
        for i in 0..KEPT + 4 {
            remember(&record, &format!("1 {i} 0 0.0 0.0"), "4.2.1");
        }
        let kept = entries(&record);
        assert_eq!(kept.len(), KEPT);
        assert_eq!(kept.last().map(|(k, _)| k.as_str()), Some(format!("1 {} 0 0.0 0.0", KEPT + 3).as_str()));
    }

    #[test]
    fn a_criu_that_says_no_version_is_refused() {
        let dir = tempfile::tempdir().expect("tempdir");
        let record = record_path(dir.path());
        let criu = fake_criu(dir.path(), "");
        assert!(version_of(&criu, &record).is_err());
        assert!(entries(&record).is_empty(), "nothing remembered");
    }
}

//! Where a run's reports go (`--json`, `--plot`). A path is checked before
//! the run, by creating a file beside it (the only test a read-only mount,
//! an ACL or root on NFS answers truly), so a report that cannot be written
//! is a usage error in the first second, not after half an hour of
//! measuring. A JSON report is written whole, a temporary file renamed over
//! the path, so an interrupted run leaves no half a report.

use crate::error::{Error, Result};
use std::io::Write;
use std::path::Path;

/// The directory a report at `path` goes to.
fn dir_of(path: &Path) -> &Path {
    match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    }
}

/// Refuses (a usage error) a report path that cannot be written.
pub fn check(path: &Path) -> Result<()> {
    if path.is_dir() {
        return Err(Error::Usage(format!("{}: is a directory: give a file for the report", path.display())));
    }
    tempfile::Builder::new()
        .prefix(".criuz-report-")
        .tempfile_in(dir_of(path))
        .map(drop)
        .map_err(|e| Error::Usage(format!("{}: cannot write the report there: {e}", path.display())))
}

/// Writes `text` to `path` whole, or leaves `path` as it was.
pub fn write(path: &Path, text: &str) -> Result<()> {
    let mut f = tempfile::Builder::new()
        .prefix(".criuz-report-")
        .tempfile_in(dir_of(path))
        .map_err(|e| Error::file(path, e))?;
    f.write_all(text.as_bytes()).map_err(|e| Error::file(path, e))?;
    f.persist(path).map_err(|e| Error::file(path, e.error))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_report_path_that_cannot_be_written_is_refused_before_the_run() {
        let d = tempfile::tempdir().unwrap();
        assert!(check(&d.path().join("r.json")).is_ok());
        let missing = d.path().join("no-such-dir/r.json");
        let e = check(&missing).unwrap_err();
        assert_eq!(e.exit_code(), 2, "{e}");
        assert!(e.to_string().starts_with(&missing.display().to_string()), "{e}");
        assert_eq!(check(d.path()).unwrap_err().exit_code(), 2);
        // The check leaves nothing behind.
        assert_eq!(std::fs::read_dir(d.path()).unwrap().count(), 0);
    }

    #[test]
    fn a_report_is_written_whole_over_what_was_there() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("r.json");
        std::fs::write(&p, "old").unwrap();
        write(&p, "{\"new\": 1}\n").unwrap();
        assert_eq!(std::fs::read_to_string(&p).unwrap(), "{\"new\": 1}\n");
        assert_eq!(std::fs::read_dir(d.path()).unwrap().count(), 1);
    }
}

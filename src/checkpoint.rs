//! One-command dump and restore: runs stock CRIU in stream mode against our
//! capture or serve endpoint in a private temporary images directory.
//!
//! Dump: the archive is committed only if CRIU exits 0 and the stream held
//! `inventory.img` (CRIU writes it last); otherwise nothing appears under the
//! output name. CRIU's `stats-dump` (written locally, not streamed) is added to
//! the archive and reported. Restore: the archive is served by index (or from
//! a pipe); a damaged block makes the serve fail, which aborts CRIU's restore
//! before the process runs. On failure the temporary directory with CRIU's log
//! is kept and its path reported.

use crate::archive::{Options, PackStats, Packer};
use crate::criu::{self, Criu};
use crate::error::{Error, Result};
use crate::output::Output;
use crate::stream::{self, Listener, ServeOptions};
use prost::Message;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

#[derive(Clone, Debug, Default)]
pub struct DumpOptions {
    pub pid: i32,
    pub output: PathBuf,
    pub force: bool,
    pub leave_running: bool,
    pub shell_job: bool,
    pub extra: Vec<String>,
}

/// CRIU's own dump statistics (stats-dump), in microseconds and pages.
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct CriuDumpStats {
    pub freezing_time_us: u32,
    pub frozen_time_us: u32,
    pub memdump_time_us: u32,
    pub memwrite_time_us: u32,
    pub pages_scanned: u64,
    pub pages_written: u64,
}

#[derive(Clone, Debug, serde::Serialize)]
pub struct DumpReport {
    pub output: PathBuf,
    pub criu: PathBuf,
    pub criu_version: String,
    pub criu_source: String,
    pub raw_bytes: u64,
    pub archive_bytes: u64,
    pub ratio: f64,
    pub seconds: f64,
    pub raw_bytes_per_second: f64,
    pub files: u64,
    pub zero_pages: u64,
    pub criu_stats: Option<CriuDumpStats>,
    #[serde(skip)]
    pub pack: PackStats,
}

#[derive(Clone, PartialEq, Message)]
struct DumpStatsEntry {
    #[prost(uint32, required, tag = "1")]
    freezing_time: u32,
    #[prost(uint32, required, tag = "2")]
    frozen_time: u32,
    #[prost(uint32, required, tag = "3")]
    memdump_time: u32,
    #[prost(uint32, required, tag = "4")]
    memwrite_time: u32,
    #[prost(uint64, required, tag = "5")]
    pages_scanned: u64,
    #[prost(uint64, required, tag = "6")]
    pages_skipped_parent: u64,
    #[prost(uint64, required, tag = "7")]
    pages_written: u64,
}

#[derive(Clone, PartialEq, Message)]
struct StatsEntry {
    #[prost(message, optional, tag = "1")]
    dump: Option<DumpStatsEntry>,
}

/// Parses CRIU's stats-dump: two magics (service image), then a u32-length
/// prefixed stats_entry.
pub fn parse_stats(bytes: &[u8]) -> Option<CriuDumpStats> {
    let len = u32::from_ne_bytes(bytes.get(8..12)?.try_into().ok()?) as usize;
    let e = StatsEntry::decode(bytes.get(12..12 + len)?).ok()?.dump?;
    Some(CriuDumpStats {
        freezing_time_us: e.freezing_time,
        frozen_time_us: e.frozen_time,
        memdump_time_us: e.memdump_time,
        memwrite_time_us: e.memwrite_time,
        pages_scanned: e.pages_scanned,
        pages_written: e.pages_written,
    })
}

/// A private temporary images directory, kept (with CRIU's log) on failure.
struct WorkDir(Option<tempfile::TempDir>);

impl WorkDir {
    fn new(prefix: &str) -> Result<Self> {
        Ok(WorkDir(Some(tempfile::Builder::new().prefix(prefix).tempdir()?)))
    }
    fn path(&self) -> &Path {
        self.0.as_ref().expect("work dir").path()
    }
    /// Keeps the directory and returns the log path for the error message.
    fn keep(&mut self, log: &str) -> PathBuf {
        let dir = self.0.take().expect("work dir").keep();
        dir.join(log)
    }
}

fn criu_failure(what: &str, status: std::process::ExitStatus, log: &Path) -> Error {
    let errs = criu::log_errors(log, 3).join(" | ");
    Error::Criu(format!("{what} failed ({status}); log: {}; {errs}", log.display()))
}

/// Checkpoints process tree `pid` into an archive through CRIU's stream mode.
pub fn dump(o: &DumpOptions, archive: &Options, criu: &Criu) -> Result<DumpReport> {
    archive.validate()?;
    let started = Instant::now();
    let out = Output::open(&o.output, o.force)?;
    let mut work = WorkDir::new("criuz-dump-")?;
    let listener = Listener::bind(work.path(), stream::CAPTURE_SOCKET)?;
    let packer = Packer::start(out.writer()?, archive)?;
    let stop = AtomicBool::new(false);

    let mut cmd = Command::new(&criu.path);
    cmd.args(["dump", "--stream", "-o", "dump.log", "-t", &o.pid.to_string(), "-D"])
        .arg(work.path())
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    if o.leave_running {
        cmd.arg("--leave-running");
    }
    if o.shell_job {
        cmd.arg("--shell-job");
    }
    cmd.args(&o.extra);

    let (status, captured) = std::thread::scope(|s| {
        let cap = s.spawn(|| stream::capture(&listener, &packer, &stop));
        let status = cmd.status();
        stop.store(true, Ordering::Relaxed);
        (status, cap.join().unwrap_or(Err(Error::Cancelled)))
    });
    let log = work.path().join("dump.log");
    let status = status.map_err(|e| Error::Criu(format!("cannot run {}: {e}", criu.path.display())))?;
    if !status.success() {
        let err = criu_failure("criu dump", status, &log);
        packer.abort();
        work.keep("dump.log");
        return Err(err);
    }
    let report = match captured {
        Ok(Some(r)) => r,
        Ok(None) => {
            packer.abort();
            let log = work.keep("dump.log");
            return Err(Error::Criu(format!("CRIU never connected to the capture socket; log: {}", log.display())));
        }
        Err(e) => {
            let e = packer.abort().unwrap_or(e);
            let log = work.keep("dump.log");
            return Err(Error::Criu(format!("capture failed: {e}; CRIU log: {}", log.display())));
        }
    };
    if !report.files.iter().any(|f| f == "inventory.img") {
        packer.abort();
        let log = work.keep("dump.log");
        return Err(Error::Criu(format!("the dump stream has no inventory.img (incomplete); log: {}", log.display())));
    }
    let stats_bytes = std::fs::read(work.path().join("stats-dump")).ok();
    if let Some(bytes) = &stats_bytes {
        let mut sink = packer.begin_file("stats-dump")?;
        sink.write(bytes)?;
        sink.finish()?;
    }
    let (pack, _) = packer.finish()?;
    out.commit()?;
    let seconds = started.elapsed().as_secs_f64();
    Ok(DumpReport {
        output: o.output.clone(),
        criu: criu.path.clone(),
        criu_version: criu.version.clone(),
        criu_source: criu.source.to_string(),
        raw_bytes: pack.raw_bytes,
        archive_bytes: pack.archive_bytes,
        ratio: pack.archive_bytes as f64 / pack.raw_bytes.max(1) as f64,
        seconds,
        raw_bytes_per_second: pack.raw_bytes as f64 / seconds.max(1e-9),
        files: pack.files,
        zero_pages: pack.zero_pages,
        criu_stats: stats_bytes.as_deref().and_then(parse_stats),
        pack,
    })
}

#[derive(Clone, Debug, Default)]
pub struct RestoreOptions {
    /// Archive path, or "-" for standard input.
    pub input: PathBuf,
    pub detach: bool,
    pub shell_job: bool,
    pub extra: Vec<String>,
    /// Cap on compressed bytes buffered when reading the archive from a pipe.
    pub pipe_buffer: u64,
    /// Send CRIU every zero page instead of leaving them out where that is safe.
    pub keep_zero_pages: bool,
}

#[derive(Clone, Debug, serde::Serialize)]
pub struct RestoreReport {
    pub pid: Option<i32>,
    pub seconds: f64,
    pub served_bytes: u64,
    pub zero_pages_skipped: u64,
    pub files: usize,
    pub criu_exit: i32,
}

/// Restores from an archive through CRIU's stream mode.
pub fn restore(o: &RestoreOptions, archive: &Options, criu: &Criu) -> Result<RestoreReport> {
    let started = Instant::now();
    let (source, block_size) = stream::open_source(&o.input, o.pipe_buffer, archive.block_size)?;
    let mut work = WorkDir::new("criuz-restore-")?;
    let listener = Listener::bind(work.path(), stream::SERVE_SOCKET)?;
    let pidfile = work.path().join("restored.pid");
    let stop = AtomicBool::new(false);
    let opts = ServeOptions {
        threads: archive.threads,
        prefetch_bytes: 16 << 20,
        block_size,
        skip_zero_pages: !o.keep_zero_pages,
    };

    let mut cmd = Command::new(&criu.path);
    cmd.args(["restore", "--stream", "-o", "restore.log", "--pidfile"]).arg(&pidfile).arg("-D").arg(work.path());
    if o.detach {
        cmd.arg("--restore-detached");
        cmd.stdin(Stdio::null()).stdout(Stdio::null()).stderr(Stdio::null());
    }
    if o.shell_job {
        cmd.arg("--shell-job");
    }
    cmd.args(&o.extra);

    let (status, served) = std::thread::scope(|s| {
        let srv = s.spawn(|| stream::serve(&listener, source, opts, &stop));
        let status = cmd.status();
        stop.store(true, Ordering::Relaxed);
        (status, srv.join().unwrap_or(Err(Error::Cancelled)))
    });
    let status = status.map_err(|e| Error::Criu(format!("cannot run {}: {e}", criu.path.display())))?;
    let pid = std::fs::read_to_string(&pidfile).ok().and_then(|s| s.trim().parse().ok());
    let report = match served {
        Err(e) => {
            let log = work.keep("restore.log");
            return Err(Error::Criu(format!("restore aborted: {e}; CRIU log: {}", log.display())));
        }
        Ok(None) if !status.success() => return Err(criu_failure("criu restore", status, &work.keep("restore.log"))),
        Ok(None) => return Err(Error::Criu("CRIU never connected to the serve socket".into())),
        Ok(Some(report)) => report,
    };
    // Without -d, CRIU's exit status is the restored tree's; a detached restore
    // (or one that never got as far as a pid) must exit 0.
    if !status.success() && (o.detach || pid.is_none()) {
        return Err(criu_failure("criu restore", status, &work.keep("restore.log")));
    }
    Ok(RestoreReport {
        pid,
        seconds: started.elapsed().as_secs_f64(),
        served_bytes: report.bytes,
        zero_pages_skipped: report.zero_pages_skipped,
        files: report.served.len(),
        criu_exit: status.code().unwrap_or(-1),
    })
}

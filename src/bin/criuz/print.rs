//! What the commands print: sizes, rates, result lines, `inspect`'s table.
//! Results go to stderr (stdout may carry an archive); JSON and `inspect`
//! go to stdout.

use criuz::archive::PackStats;
use criuz::io::Location;
use criuz::offline;
use criuz::session::checkpoint::DumpReport;
use criuz::session::restore::Restored;
use std::io::Write;
use std::sync::Mutex;

/// `println!` that never panics: it stops printing quietly when stdout is
/// closed early (`criuz inspect F | head`), and keeps any other failure (a
/// full disk under `> report.json`) for [`stdout_failure`]. SIGPIPE stays
/// ignored: criuz must see EPIPE, not die, when CRIU closes one of its pipes.
macro_rules! out {
    ($($t:tt)*) => {
        $crate::print::line(format_args!($($t)*))
    };
}
pub(crate) use out;

/// The first failure to write stdout, EPIPE aside.
static STDOUT_FAILED: Mutex<Option<std::io::Error>> = Mutex::new(None);

pub fn line(text: std::fmt::Arguments) {
    note_stdout(writeln!(std::io::stdout().lock(), "{text}"));
}

fn note_stdout(written: std::io::Result<()>) {
    match written {
        // A closed pipe only means nobody reads the rest.
        Err(e) if e.kind() != std::io::ErrorKind::BrokenPipe => {
            STDOUT_FAILED.lock().unwrap_or_else(|p| p.into_inner()).get_or_insert(e);
        }
        _ => {}
    }
}

/// Flushes stdout and returns the first failure to write it, if any: a
/// report that did not reach its reader fails its command; a summary of
/// work done is said lost on stderr (see main).
pub fn stdout_failure() -> Option<std::io::Error> {
    note_stdout(std::io::stdout().flush());
    STDOUT_FAILED.lock().unwrap_or_else(|p| p.into_inner()).take()
}

/// Says on stderr that the summary of work done did not reach stdout.
pub fn summary_lost(e: &std::io::Error) {
    criuz::say!("criuz: standard output: {e}: the summary printed there is lost (the work itself is done)");
}

/// Prints `value` as pretty JSON on stdout, or stderr with `to_stderr`
/// (when stdout carries the archive).
pub fn json(value: &impl serde::Serialize, to_stderr: bool) -> anyhow::Result<()> {
    let text = serde_json::to_string_pretty(value)?;
    if to_stderr {
        criuz::say!("{text}");
    } else {
        out!("{text}");
    }
    Ok(())
}

pub fn human(bytes: u64) -> String {
    let b = bytes as f64;
    if b >= (1u64 << 30) as f64 {
        format!("{:.2} GiB", b / (1u64 << 30) as f64)
    } else if b >= (1 << 20) as f64 {
        format!("{:.1} MiB", b / (1 << 20) as f64)
    } else if b >= 1024.0 {
        format!("{:.1} KiB", b / 1024.0)
    } else {
        format!("{bytes} B")
    }
}

pub fn rate(bytes: u64, secs: f64) -> String {
    format!("{}/s", human((bytes as f64 / secs.max(1e-9)) as u64))
}

/// `raw -> archive (ratio of raw)`, as every writing command reports it.
pub fn sizes(s: &PackStats) -> String {
    format!("{} -> {} ({:.3} of raw)", human(s.raw_bytes), human(s.archive_bytes), s.ratio())
}

/// The result lines of `criuz dump`.
pub fn dump(pid: i32, r: &DumpReport) {
    criuz::say!(
        "checkpointed {pid} into {}: {} -> {} ({:.3} of raw), {} zero pages elided, {:.2}s, {}",
        r.output.display(),
        human(r.raw_bytes),
        human(r.archive_bytes),
        r.ratio,
        r.zero_pages,
        r.seconds,
        rate(r.raw_bytes, r.seconds)
    );
    if r.hurried_blocks > 0 {
        let then = match (&r.recompressed, &r.recompress_failed) {
            (true, _) => "then rewritten with the codec asked for".to_string(),
            (false, Some(e)) => format!("rewriting them failed, the archive keeps them: {e}"),
            (false, None) => "kept so (an incremental, piped or S3 archive is not rewritten)".to_string(),
        };
        criuz::say!(
            "{} blocks were compressed with LZ4 while the absorb budget was spent (--absorb raises it); {then}",
            r.hurried_blocks
        );
    }
    if let Some(c) = &r.cuda {
        let resumed = c.resume_seconds.map_or(String::new(), |t| format!(", resumed in {t:.2}s"));
        criuz::say!(
            "CUDA: {} process(es) on {} suspended in {:.2}s before CRIU{resumed}",
            c.record.pids.len(),
            c.record.gpus.iter().map(|g| format!("{} ({})", g.uuid, g.name)).collect::<Vec<_>>().join(", "),
            c.suspend_seconds
        );
    }
    if let Some(s) = &r.criu_stats {
        criuz::say!(
            "CRIU: frozen {:.3}s, freezing {:.3}s, memory dump {:.3}s, memory write {:.3}s, pages scanned {}, written {}",
            s.frozen_time_us as f64 / 1e6,
            s.freezing_time_us as f64 / 1e6,
            s.memdump_time_us as f64 / 1e6,
            s.memwrite_time_us as f64 / 1e6,
            s.pages_scanned,
            s.pages_written
        );
    }
}

pub fn inspect(rep: &offline::InspectReport) {
    out!(
        "criuz archive v{}, block size {}, id {}{}{}",
        rep.version,
        human(u64::from(rep.block_size)),
        rep.archive_id,
        if rep.page_ids { format!(", with page ids ({})", human(rep.page_id_bytes)) } else { String::new() },
        if rep.block_table { ", block table in the index" } else { "" }
    );
    if let Some(e) = &rep.encryption {
        let mut kinds: Vec<(String, usize)> = Vec::new();
        for k in &e.wrapped_for {
            match kinds.iter_mut().find(|(n, _)| n == k) {
                Some((_, c)) => *c += 1,
                None => kinds.push((k.clone(), 1)),
            }
        }
        let whom: Vec<String> = kinds
            .iter()
            .map(|(k, n)| if k == "scrypt" { "a passphrase".into() } else { format!("{n} {k} recipient(s)") })
            .collect();
        out!("encrypted with {}, key {}, wrapped for {}", e.algorithm, e.key_id, whom.join(", "));
        if e.locked {
            out!("locked: no key given opens it, so names show as #<file id> and references are not counted");
        }
    }
    for (i, p) in rep.chain.iter().enumerate() {
        let what = if i == 0 { "parent" } else { "ancestor" };
        out!(
            "{what} {} ({}): {} of this archive's pages stored there",
            p.archive_id,
            p.hint,
            human(p.referenced_bytes)
        );
    }
    if rep.total.codecs.lz4 > 0 && rep.total.codecs.zstd > 0 {
        out!(
            "codecs: {} blocks zstd, {} LZ4 (a dump hurries blocks to LZ4 while its absorb budget is spent)",
            rep.total.codecs.zstd,
            rep.total.codecs.lz4
        );
    }
    if !rep.chain.is_empty() || rep.total.referenced_bytes > 0 {
        out!(
            "this archive: stored {}, referenced {} ({} within itself), dedup ratio {:.3} of raw",
            human(rep.total.stored_bytes),
            human(rep.total.referenced_bytes),
            human(rep.internal_referenced_bytes),
            rep.dedup_ratio
        );
    }
    out!(
        "{:<28} {:>6} {:>12} {:>12} {:>7} {:>10} {:>10}  blocks raw/lz4/zstd/dedup",
        "file",
        "kind",
        "raw",
        "stored",
        "ratio",
        "pages",
        "zero"
    );
    for f in rep.files.iter().chain(std::iter::once(&rep.total)) {
        out!(
            "{:<28} {:>6} {:>12} {:>12} {:>7.3} {:>10} {:>10}  {}/{}/{}/{}",
            f.name,
            f.kind,
            f.raw_bytes,
            f.stored_bytes,
            f.ratio,
            f.pages,
            f.zero_pages,
            f.codecs.raw,
            f.codecs.lz4,
            f.codecs.zstd,
            f.codecs.dedup
        );
    }
}

/// The result line of `criuz restore`.
pub fn restored(input: &Location, r: &Restored) {
    let cuda = match r {
        Restored::Eager(r) => r.cuda_resume_seconds,
        Restored::Placed(r) | Restored::Lazy(r) => r.cuda_resume_seconds,
    };
    restored_line(input, r);
    if let Some(t) = cuda {
        criuz::say!("CUDA: resumed in {t:.2}s after CRIU (restore and unlock)");
    }
}

/// When a lazy restore's pages were all in, or, where processes ended
/// before theirs were, when it was done.
pub fn lazy_filled(r: &criuz::session::lazy::LazyReport) -> String {
    match r.ended_unfilled {
        0 => format!("every page in after {:.2}s", r.resident_seconds),
        1 => format!("done after {:.2}s: a process ended before its pages were all in", r.resident_seconds),
        n => format!("done after {:.2}s: {n} processes ended before their pages were all in", r.resident_seconds),
    }
}

fn restored_line(input: &Location, r: &Restored) {
    match r {
        Restored::Lazy(r) => {
            if let Some(pid) = r.pid {
                let filled = lazy_filled(r);
                criuz::say!(
                    "restored {pid} lazily from {input}: running after {:.2}s, {filled} \
                     ({} pages restored by CRIU, {} copied in lazily, {} zero pages mapped, {} faults)",
                    r.running_seconds,
                    r.eager_pages,
                    r.lazy_pages,
                    r.zero_pages_mapped,
                    r.faults
                );
            }
        }
        Restored::Placed(r) => {
            if let Some(pid) = r.pid {
                criuz::say!(
                    "restored {pid} from {input}: every page placed by criuz, running after {:.2}s \
                     ({} pages restored by CRIU, {} copied in)",
                    r.running_seconds,
                    r.eager_pages,
                    r.lazy_pages
                );
            }
        }
        Restored::Eager(r) => {
            if let Some(pid) = r.pid {
                criuz::say!(
                    "restored {pid} from {input}: {} served, {} zero pages left out, {:.2}s",
                    human(r.served_bytes),
                    r.zero_pages_skipped,
                    r.seconds
                );
            }
        }
    }
}

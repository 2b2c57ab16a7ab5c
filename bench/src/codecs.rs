//! `criuz-bench --codec-table`: for each memory pattern, one plain
//! `criu dump -D`, then `criuz pack` with each codec and `criuz unpack` of
//! the result: archive size against the raw image size, pack and unpack
//! throughput (raw image bytes per second of wall time), and the CPU time
//! of a pack. Each codec runs with byte planes (the default) and without
//! (`-flat`, `--no-planes`): what the 16-bit float transform gains and
//! costs, on the `bf16` pattern and on every other.

use crate::error::{Error, Result};
use crate::proc;
use crate::workload::{Running, Tools};
use criuz::criu::Criu;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

#[derive(Clone, Debug, serde::Serialize)]
pub struct CodecRow {
    pub workload: String,
    pub codec: String,
    pub raw_bytes: u64,
    pub archive_bytes: u64,
    pub ratio: f64,
    /// Median over the runs, raw image bytes per second.
    pub pack_bytes_per_s: f64,
    pub unpack_bytes_per_s: f64,
    /// Median over the runs: user and system CPU seconds of one pack.
    pub pack_cpu_s: f64,
}

/// Each codec's name in the table and its `criuz pack` options.
pub const CODECS: &[(&str, &[&str])] = &[
    ("lz4", &["--codec", "lz4"]),
    ("lz4-flat", &["--codec", "lz4", "--no-planes"]),
    ("zstd", &["--codec", "zstd"]),
    ("zstd-flat", &["--codec", "zstd", "--no-planes"]),
];

/// Runs `cmd` to its end: wall seconds and CPU seconds.
fn timed(cmd: &mut Command) -> Result<(f64, f64)> {
    let what = format!("{cmd:?}");
    proc::run_measured(cmd, &what).map(|(wall, cpu, _)| (wall, cpu))
}

/// Rows for one pattern: dumps a fresh workload once, then `runs` rounds,
/// each packing and unpacking it with every codec.
pub fn measure(
    pattern: &str,
    mib: u64,
    runs: usize,
    work: &Path,
    tools: &Tools,
    criu: &Criu,
    criuz: &Path,
) -> Result<Vec<CodecRow>> {
    let dir = work.join(format!("codec-{pattern}"));
    let img = dir.join("img");
    std::fs::create_dir_all(&img).map_err(|e| Error::file(&img, e))?;
    let app = Running::start(pattern, mib, &dir.join("app"), tools)?;
    let pids = proc::tree(app.pid);
    timed(
        Command::new(&criu.path)
            .args(["dump", "-o", "dump.log", "-t", &app.pid.to_string(), "-D"])
            .arg(&img)
            .stdout(Stdio::null()),
    )?;
    for p in pids {
        proc::reap(p, Duration::from_secs(30))?;
    }
    drop(app);
    let raw_bytes = proc::dir_bytes(&img);
    // Runs alternate between the codecs (each round packs with every one),
    // so that a drift of the machine's speed during the table falls on all
    // of them alike rather than on whichever codec ran then.
    let mut times = vec![(Vec::new(), Vec::new(), Vec::new()); CODECS.len()];
    for _ in 0..runs.max(1) {
        for ((codec, options), (pack, unpack, cpu)) in CODECS.iter().zip(&mut times) {
            let arc = dir.join(format!("{codec}.czr"));
            let _ = std::fs::remove_file(&arc);
            let (wall, used) = timed(Command::new(criuz).arg("pack").arg(&img).arg("-o").arg(&arc).args(*options))?;
            pack.push(wall);
            cpu.push(used);
            let out = dir.join("out");
            let _ = std::fs::remove_dir_all(&out);
            unpack.push(timed(Command::new(criuz).arg("unpack").arg(&arc).arg("-d").arg(&out))?.0);
            std::fs::remove_dir_all(&out).map_err(|e| Error::file(&out, e))?;
        }
    }
    let mut rows = Vec::new();
    for ((codec, _), (pack, unpack, cpu)) in CODECS.iter().zip(&times) {
        let archive_bytes = proc::file_bytes(&dir.join(format!("{codec}.czr")));
        rows.push(CodecRow {
            workload: pattern.to_string(),
            codec: codec.to_string(),
            raw_bytes,
            archive_bytes,
            ratio: archive_bytes as f64 / raw_bytes.max(1) as f64,
            pack_bytes_per_s: raw_bytes as f64 / crate::report::median(pack).unwrap_or(f64::NAN),
            unpack_bytes_per_s: raw_bytes as f64 / crate::report::median(unpack).unwrap_or(f64::NAN),
            pack_cpu_s: crate::report::median(cpu).unwrap_or(f64::NAN),
        });
    }
    let _ = std::fs::remove_dir_all(&dir);
    Ok(rows)
}

pub fn table(rows: &[CodecRow]) -> String {
    let mut s = format!(
        "{:<8} {:<9} {:>9} {:>11} {:>7} {:>11} {:>12} {:>13}\n",
        "pattern", "codec", "raw MiB", "archive MiB", "ratio", "pack MiB/s", "pack CPU s", "unpack MiB/s"
    );
    for r in rows {
        s.push_str(&format!(
            "{:<8} {:<9} {:>9.1} {:>11.1} {:>7.3} {:>11.0} {:>12.3} {:>13.0}\n",
            r.workload,
            r.codec,
            r.raw_bytes as f64 / (1 << 20) as f64,
            r.archive_bytes as f64 / (1 << 20) as f64,
            r.ratio,
            r.pack_bytes_per_s / (1 << 20) as f64,
            r.pack_cpu_s,
            r.unpack_bytes_per_s / (1 << 20) as f64
        ));
    }
    s
}

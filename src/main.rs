//! criuz command line: parses arguments, calls the library, prints results.
//! Every error ends as one line `criuz: ...` and a non-zero exit.

use anyhow::{Context, Result};
use clap::{Args, Parser, Subcommand};
use criuz::archive::Options;
use criuz::codec::{Codec, CodecConfig};
use criuz::output::Output;
use criuz::progress::Progress;
use criuz::{engine, ops};
use std::fs::File;
use std::io::{BufReader, Read};
use std::path::{Path, PathBuf};
use std::time::Instant;

#[derive(Parser)]
#[command(name = "criuz", version, about = "Small, fast, safe CRIU checkpoints with stock CRIU")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Args, Clone)]
struct CodecArgs {
    /// Compression: lz4, zstd or none (zero pages are elided with every codec)
    #[arg(long, default_value = "lz4")]
    codec: Codec,
    /// LZ4 acceleration (1 = best ratio) or zstd level (negative = faster)
    #[arg(long, allow_hyphen_values = true)]
    level: Option<i32>,
    /// Block size, a multiple of 4K from 4K to 4M (K/M suffixes)
    #[arg(long, default_value = "256K", value_parser = parse_size)]
    block_size: usize,
    #[command(flatten)]
    threads: ThreadArgs,
}

#[derive(Args, Clone)]
struct ThreadArgs {
    /// Worker threads (default: all cores)
    #[arg(short = 'j', long = "jobs")]
    jobs: Option<usize>,
}

impl ThreadArgs {
    fn options(&self) -> Options {
        Options { threads: self.jobs.unwrap_or_else(engine::default_threads), ..Options::default() }
    }
}

impl CodecArgs {
    fn options(&self) -> Result<Options> {
        let codec = CodecConfig::new(self.codec, self.level).map_err(anyhow::Error::msg)?;
        let opts = Options { codec, block_size: self.block_size, ..self.threads.options() };
        opts.validate()?;
        Ok(opts)
    }
}

#[derive(Subcommand)]
enum Cmd {
    /// Pack a CRIU images directory into an archive
    Pack {
        dir: PathBuf,
        /// Archive to write ("-" for stdout)
        #[arg(short = 'o', long)]
        output: PathBuf,
        /// Replace an existing archive
        #[arg(long)]
        force: bool,
        #[command(flatten)]
        codec: CodecArgs,
    },
    /// Unpack an archive into a CRIU images directory (restorable with criu restore -D)
    Unpack {
        /// Archive to read ("-" for stdin)
        archive: PathBuf,
        #[arg(short = 'd', long = "dir")]
        dir: PathBuf,
        /// Replace existing files in the directory
        #[arg(long)]
        force: bool,
        #[command(flatten)]
        threads: ThreadArgs,
    },
    /// Show per-file sizes, ratios, zero pages and codecs
    Inspect {
        archive: PathBuf,
        /// Print JSON
        #[arg(long)]
        json: bool,
    },
    /// Check every checksum; exit 0 only if all hold
    Verify {
        archive: PathBuf,
        #[command(flatten)]
        threads: ThreadArgs,
    },
}

fn parse_size(s: &str) -> Result<usize, String> {
    let s = s.trim();
    let (num, mul) = match s.chars().last() {
        Some('k' | 'K') => (&s[..s.len() - 1], 1usize << 10),
        Some('m' | 'M') => (&s[..s.len() - 1], 1 << 20),
        Some('g' | 'G') => (&s[..s.len() - 1], 1 << 30),
        _ => (s, 1),
    };
    let n: usize = num.parse().map_err(|_| format!("not a size: {s:?} (use e.g. 256K or 1M)"))?;
    n.checked_mul(mul).ok_or_else(|| format!("size too large: {s}"))
}

fn open_input(path: &Path) -> Result<(Box<dyn Read + Send>, Option<u64>)> {
    if path == Path::new("-") {
        return Ok((Box::new(BufReader::with_capacity(1 << 20, std::io::stdin())), None));
    }
    let f = File::open(path).with_context(|| path.display().to_string())?;
    let len = f.metadata().ok().map(|m| m.len());
    Ok((Box::new(BufReader::with_capacity(1 << 20, f)), len))
}

fn human(bytes: u64) -> String {
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

fn rate(bytes: u64, secs: f64) -> String {
    format!("{}/s", human((bytes as f64 / secs.max(1e-9)) as u64))
}

fn run(cli: Cli) -> Result<()> {
    match cli.cmd {
        Cmd::Pack { dir, output, force, codec } => {
            let opts = codec.options()?;
            let (files, skipped) = ops::image_files(&dir).with_context(|| dir.display().to_string())?;
            for s in &skipped {
                eprintln!("criuz: skipping {} (not a regular file)", dir.join(s).display());
            }
            let total: u64 = files.iter().map(|f| f.1).sum();
            let out = Output::open(&output, force)?;
            let t = Instant::now();
            let mut progress = Progress::new("pack", Some(total));
            let stats = ops::pack_dir(&dir, out.writer()?, &opts, &mut progress)
                .with_context(|| format!("packing {}", dir.display()))?;
            progress.finish();
            out.commit()?;
            let secs = t.elapsed().as_secs_f64();
            eprintln!(
                "packed {} files: {} -> {} ({:.3} of raw), {} zero pages elided, {:.2}s, {}",
                stats.files,
                human(stats.raw_bytes),
                human(stats.archive_bytes),
                stats.archive_bytes as f64 / stats.raw_bytes.max(1) as f64,
                stats.zero_pages,
                secs,
                rate(stats.raw_bytes, secs)
            );
        }
        Cmd::Unpack { archive, dir, force, threads } => {
            let (inp, _) = open_input(&archive)?;
            let t = Instant::now();
            let st =
                ops::unpack(inp, &dir, force, &threads.options()).with_context(|| archive.display().to_string())?;
            let secs = t.elapsed().as_secs_f64();
            eprintln!(
                "unpacked {} files, {} into {}, {:.2}s, {}",
                st.files,
                human(st.bytes),
                dir.display(),
                secs,
                rate(st.bytes, secs)
            );
        }
        Cmd::Inspect { archive, json } => {
            let (inp, _) = open_input(&archive)?;
            let rep = ops::inspect(inp).with_context(|| archive.display().to_string())?;
            if json {
                println!("{}", serde_json::to_string_pretty(&rep)?);
            } else {
                print_inspect(&rep);
            }
        }
        Cmd::Verify { archive, threads } => {
            let (inp, len) = open_input(&archive)?;
            let _ = len;
            let progress = Progress::new("verify", None);
            let (files, bytes) =
                ops::verify(inp, &threads.options(), progress).with_context(|| archive.display().to_string())?;
            println!("{}: OK, {} files, {} checked", archive.display(), files, human(bytes));
        }
    }
    Ok(())
}

fn print_inspect(rep: &ops::InspectReport) {
    println!("criuz archive v{}, block size {}, id {}", rep.version, human(u64::from(rep.block_size)), rep.archive_id);
    println!(
        "{:<28} {:>6} {:>12} {:>12} {:>7} {:>10} {:>10}  blocks raw/lz4/zstd",
        "file", "kind", "raw", "stored", "ratio", "pages", "zero"
    );
    for f in rep.files.iter().chain(std::iter::once(&rep.total)) {
        println!(
            "{:<28} {:>6} {:>12} {:>12} {:>7.3} {:>10} {:>10}  {}/{}/{}",
            f.name,
            f.kind,
            f.raw_bytes,
            f.stored_bytes,
            f.ratio,
            f.pages,
            f.zero_pages,
            f.blocks_raw,
            f.blocks_lz4,
            f.blocks_zstd
        );
    }
}

fn main() {
    let cli = Cli::parse();
    if let Err(e) = run(cli) {
        eprintln!("criuz: {e:#}");
        std::process::exit(1);
    }
}

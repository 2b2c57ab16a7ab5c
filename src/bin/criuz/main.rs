//! criuz command line: parses arguments, calls the library, prints results.
//! Every error ends as one line `criuz: ...` and an exit status by kind:
//! 1 the operation failed, 2 usage, 3 the archive is damaged, foreign or
//! unsupported (see `criuz::error::Kind`).

use anyhow::{Context, Result};
use clap::{Args, Parser, Subcommand};
use criuz::archive::Options;
use criuz::codec::{Codec, CodecConfig};
use criuz::io::{is_stdio, open_input, Output};
use criuz::progress::Progress;
use criuz::{engine, offline};
use std::path::PathBuf;
use std::time::Instant;

mod containers;

/// `println!` that ends quietly when stdout is closed early (`criuz inspect
/// F | head`) instead of panicking. SIGPIPE stays ignored: criuz must see
/// EPIPE, not die, when CRIU closes one of its pipes.
macro_rules! out {
    ($($t:tt)*) => {{
        use std::io::Write;
        if let Err(e) = writeln!(std::io::stdout().lock(), $($t)*) {
            if e.kind() == std::io::ErrorKind::BrokenPipe {
                std::process::exit(0);
            }
        }
    }};
}

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
    /// Store page ids, so the archive can be the parent of an incremental one
    /// without being decoded (and identical pages within it are stored once)
    #[arg(long)]
    ids: bool,
    #[command(flatten)]
    threads: ThreadArgs,
}

/// Keys that open encrypted archives (secrets only ever from files).
#[derive(Args, Clone, Default)]
struct KeyArgs {
    /// age identity file that opens encrypted archives (made by `criuz keygen`; repeatable)
    #[arg(long = "identity", value_name = "FILE")]
    identities: Vec<PathBuf>,
    /// File whose first line is the passphrase of encrypted archives
    #[arg(long, value_name = "FILE")]
    passphrase_file: Option<PathBuf>,
}

impl KeyArgs {
    /// Gives the keys to the process's keyring, through which every archive
    /// it opens is unlocked.
    fn load(&self) -> Result<()> {
        for f in &self.identities {
            criuz::seal::keyring::add_identity_file(f)?;
        }
        if let Some(f) = &self.passphrase_file {
            criuz::seal::keyring::add_passphrase_file(f)?;
        }
        Ok(())
    }
}

/// Encryption of a new archive, and the keys of an encrypted parent.
#[derive(Args, Clone, Default)]
struct SealArgs {
    /// Encrypt the archive to this age public key (age1...; repeatable)
    #[arg(long = "recipient", value_name = "KEY")]
    recipients: Vec<String>,
    /// Encrypt the archive to the age public keys in FILE, one a line (repeatable)
    #[arg(long = "recipients-file", value_name = "FILE")]
    recipients_files: Vec<PathBuf>,
    /// age identity that opens an encrypted parent (repeatable); with no
    /// --recipient, the archive is encrypted to the identities' own keys
    #[arg(long = "identity", value_name = "FILE")]
    identities: Vec<PathBuf>,
    /// Encrypt the archive with the passphrase on FILE's first line (and open an encrypted parent with it)
    #[arg(long, value_name = "FILE")]
    passphrase_file: Option<PathBuf>,
}

impl SealArgs {
    /// Loads the keys and sets `opts.seal` when the archive is to be encrypted.
    fn apply(&self, opts: &mut Options) -> Result<()> {
        KeyArgs { identities: self.identities.clone(), passphrase_file: self.passphrase_file.clone() }.load()?;
        let mut keys = self.recipients.clone();
        if keys.is_empty() && self.recipients_files.is_empty() && self.passphrase_file.is_none() {
            for f in &self.identities {
                keys.extend(criuz::seal::keyring::recipients_of_identity_file(f)?);
            }
        }
        let r = criuz::seal::keyring::Recipients::from_args(
            &keys,
            &self.recipients_files,
            self.passphrase_file.as_deref(),
        )?;
        opts.seal = r.map(std::sync::Arc::new);
        Ok(())
    }
}

/// How a new archive is written: its codec and its encryption.
#[derive(Args, Clone)]
struct ArchiveArgs {
    #[command(flatten)]
    codec: CodecArgs,
    #[command(flatten)]
    seal: SealArgs,
}

impl ArchiveArgs {
    fn options(&self) -> Result<Options> {
        let mut opts = self.codec.options()?;
        self.seal.apply(&mut opts)?;
        Ok(opts)
    }
}

#[derive(Args, Clone)]
struct AbsorbArgs {
    /// Memory for CRIU's pages not yet compressed: while CRIU writes, criuz
    /// only takes pages in, and compresses once CRIU is done (or, when the
    /// budget is nearly spent, at once with LZ4) (K/M/G; default: a quarter
    /// of available memory, but 64M for an s3:// output, which bounds an
    /// upload's memory; 0: 64M, compressing alongside CRIU throughout)
    #[arg(long, value_name = "SIZE", value_parser = parse_size)]
    absorb: Option<usize>,
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
        let codec = CodecConfig::new(self.codec, self.level).map_err(|e| criuz::Error::Usage(e.to_string()))?;
        let opts = Options { codec, block_size: self.block_size, ids: self.ids, ..self.threads.options() };
        opts.validate()?;
        Ok(opts)
    }
}

#[derive(Subcommand)]
enum Cmd {
    /// Checkpoint a process tree into an archive (runs criu dump --stream)
    Dump {
        /// Root of the process tree
        #[arg(short = 't', long = "tree")]
        pid: i32,
        /// Archive to write ("-" for stdout)
        #[arg(short = 'o', long)]
        output: PathBuf,
        /// Replace an existing archive
        #[arg(long)]
        force: bool,
        #[command(flatten)]
        criu: CriuArgs,
        /// Keep the process running after the checkpoint
        #[arg(long)]
        leave_running: bool,
        /// Allow a process attached to a terminal
        #[arg(long)]
        shell_job: bool,
        /// Print the summary as JSON on stdout (stderr when the archive goes to stdout)
        #[arg(long)]
        json: bool,
        /// Write an incremental archive: pages already in this archive (or its
        /// parents) are stored as references
        #[arg(long, value_name = "FILE")]
        parent: Option<PathBuf>,
        #[command(flatten)]
        write: ArchiveArgs,
        #[command(flatten)]
        absorb: AbsorbArgs,
        /// Extra arguments for criu dump (after --)
        #[arg(last = true)]
        extra: Vec<String>,
    },
    /// Restore a process tree from an archive (runs criu restore --stream)
    Restore {
        /// Archive to read ("-" for stdin)
        #[arg(short = 'i', long)]
        input: PathBuf,
        /// Detach from the restored tree once it runs (criu --restore-detached)
        #[arg(short = 'd', long)]
        detach: bool,
        #[command(flatten)]
        criu: CriuArgs,
        /// Allow a process attached to a terminal
        #[arg(long)]
        shell_job: bool,
        /// Cap on the archive bytes spooled to a private temporary file when the archive comes from a pipe
        #[arg(long, default_value = "2G", value_parser = parse_size)]
        pipe_buffer: usize,
        /// Send CRIU every zero page (default: leave out those CRIU restores as zero anyway)
        #[arg(long)]
        keep_zero_pages: bool,
        /// Run the process at once and fetch its memory on demand (criu lazy-pages, criuz as page server); returns when every page is in
        #[arg(long, conflicts_with = "keep_zero_pages")]
        lazy: bool,
        /// Print the summary as JSON on stdout
        #[arg(long)]
        json: bool,
        /// Write the restored pid to FILE once the tree runs (with --lazy: while its pages still arrive)
        #[arg(long, value_name = "FILE", requires = "detach")]
        pidfile: Option<PathBuf>,
        #[command(flatten)]
        parents: ParentArgs,
        #[command(flatten)]
        threads: ThreadArgs,
        #[command(flatten)]
        keys: KeyArgs,
        /// Extra arguments for criu restore (after --)
        #[arg(last = true)]
        extra: Vec<String>,
    },
    /// Pack a CRIU images directory, or any directory tree, into an archive
    /// (subdirectories, symbolic links, modes and mtimes are kept)
    Pack {
        /// Directory to pack
        #[arg(required_unless_present = "tar", conflicts_with = "tar")]
        dir: Option<PathBuf>,
        /// Pack a tar stream instead (plain, zstd or gzip; "-" for stdin),
        /// e.g. from podman container checkpoint --export
        #[arg(long, value_name = "FILE")]
        tar: Option<PathBuf>,
        /// Archive to write ("-" for stdout)
        #[arg(short = 'o', long)]
        output: PathBuf,
        /// Replace an existing archive
        #[arg(long)]
        force: bool,
        /// Write an incremental archive against this parent
        #[arg(long, value_name = "FILE")]
        parent: Option<PathBuf>,
        #[command(flatten)]
        write: ArchiveArgs,
    },
    /// Write a self-contained archive from an incremental one and its parents
    Flatten {
        /// Incremental archive to read ("-" for stdin)
        archive: PathBuf,
        /// Archive to write ("-" for stdout)
        #[arg(short = 'o', long)]
        output: PathBuf,
        /// Replace an existing archive
        #[arg(long)]
        force: bool,
        #[command(flatten)]
        parents: ParentArgs,
        #[command(flatten)]
        write: ArchiveArgs,
    },
    /// Unpack an archive into a CRIU images directory (restorable with criu restore -D)
    Unpack {
        /// Archive to read ("-" for stdin)
        archive: PathBuf,
        /// Directory to unpack into (created if missing)
        #[arg(short = 'd', long = "dir", required_unless_present = "tar", conflicts_with = "tar")]
        dir: Option<PathBuf>,
        /// Write a tar stream instead ("-" for stdout), e.g. for podman
        /// container restore --import
        #[arg(long, value_name = "FILE")]
        tar: Option<PathBuf>,
        /// Replace existing files in the directory (or the tar file)
        #[arg(long)]
        force: bool,
        #[command(flatten)]
        parents: ParentArgs,
        #[command(flatten)]
        threads: ThreadArgs,
        #[command(flatten)]
        keys: KeyArgs,
    },
    /// Show per-file sizes, ratios, zero pages, codecs, and an incremental archive's parents
    Inspect {
        archive: PathBuf,
        /// Print JSON
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        keys: KeyArgs,
    },
    /// Check every checksum (of an incremental archive, with its parents); exit 0 only if all hold
    Verify {
        archive: PathBuf,
        #[command(flatten)]
        parents: ParentArgs,
        #[command(flatten)]
        threads: ThreadArgs,
        #[command(flatten)]
        keys: KeyArgs,
    },
    /// Serve CRIU's dump stream (criu dump --stream -D DIR) into an archive
    Capture {
        /// Images directory CRIU is given with -D
        #[arg(short = 'D', long = "images-dir")]
        dir: PathBuf,
        /// Archive to write ("-" for stdout)
        #[arg(short = 'o', long)]
        output: PathBuf,
        #[arg(long)]
        force: bool,
        #[command(flatten)]
        write: ArchiveArgs,
        #[command(flatten)]
        absorb: AbsorbArgs,
    },
    /// Serve an archive to CRIU's restore stream (criu restore --stream -D DIR)
    Serve {
        /// Images directory CRIU is given with -D
        #[arg(short = 'D', long = "images-dir")]
        dir: PathBuf,
        /// Archive to read ("-" for stdin)
        #[arg(short = 'i', long)]
        input: PathBuf,
        /// Cap on the archive bytes spooled to a private temporary file when the archive comes from a pipe
        #[arg(long, default_value = "2G", value_parser = parse_size)]
        pipe_buffer: usize,
        /// Send CRIU every zero page (default: leave out those CRIU restores as zero anyway)
        #[arg(long)]
        keep_zero_pages: bool,
        #[command(flatten)]
        parents: ParentArgs,
        #[command(flatten)]
        threads: ThreadArgs,
        #[command(flatten)]
        keys: KeyArgs,
    },
    /// Receive a dump over CRIU's page-server protocol (criu dump --page-server,
    /// runc checkpoint --page-server) into one archive, running the dump itself
    PageServer(containers::PageServerArgs),
    /// Checkpoint and restore runc containers through criuz archives
    #[command(subcommand)]
    Runc(containers::RuncCmd),
    /// Checkpoint and restore podman containers through criuz archives
    #[command(subcommand)]
    Podman(containers::PodmanCmd),
    /// Make an age identity for encrypted archives (mode 0600) and print its public key
    Keygen {
        /// Identity file to write
        #[arg(short = 'o', long)]
        output: PathBuf,
        /// Replace an existing file
        #[arg(long)]
        force: bool,
    },
}

/// Where the parents of an incremental archive are.
#[derive(Args, Clone)]
struct ParentArgs {
    /// A parent archive (repeatable); by default each is looked for where it
    /// was when the child was written
    #[arg(long = "parent", value_name = "FILE")]
    parents: Vec<PathBuf>,
    /// A directory to search for parent archives (*.czr; repeatable)
    #[arg(long = "parent-dir", value_name = "DIR")]
    parent_dirs: Vec<PathBuf>,
}

impl ParentArgs {
    fn search(&self) -> criuz::archive::parent::ParentSearch {
        criuz::archive::parent::ParentSearch { files: self.parents.clone(), dirs: self.parent_dirs.clone() }
    }
}

#[derive(Args, Clone)]
struct CriuArgs {
    /// CRIU binary (default: $CRIUZ_CRIU, the setup cache, then PATH)
    #[arg(long = "criu")]
    criu: Option<PathBuf>,
}

impl CriuArgs {
    fn locate(&self) -> Result<criuz::criu::Criu> {
        let (c, rejected) = criuz::criu::locate(self.criu.as_deref())?;
        for r in rejected {
            eprintln!("criuz: skipped CRIU {} (from {}): {}", r.path.display(), r.source, r.why);
        }
        eprintln!("criuz: using CRIU {} at {} (from {})", c.version, c.path.display(), c.source);
        Ok(c)
    }
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
        Cmd::Pack { dir, tar, output, force, parent, write } => {
            let opts = write.options()?;
            let dedup = criuz::session::checkpoint::dedup_for(parent.as_deref(), &output)?;
            let t = Instant::now();
            let (stats, progress, out) = if let Some(tar) = tar {
                if dedup.is_some() {
                    return Err(criuz::Error::Usage("--parent works with a directory, not --tar".into()).into());
                }
                let inp = open_input(&tar)?;
                let out = Output::open(&output, force)?;
                let mut progress = Progress::new("pack", None);
                let label = if is_stdio(&tar) { "stdin".to_string() } else { tar.display().to_string() };
                let stats = offline::pack_tar(inp, &label, out.writer()?, &opts, &mut progress)?;
                (stats, progress, out)
            } else {
                let dir = dir.expect("clap requires a directory or --tar");
                let entries = criuz::tree::scan(&dir)?;
                let total: u64 = entries.iter().filter(|e| e.kind.is_file()).map(|e| e.size).sum();
                let out = Output::open(&output, force)?;
                let mut progress = Progress::new("pack", Some(total));
                let stats = offline::pack_dir(&dir, &entries, out.writer()?, &opts, dedup, &mut progress)
                    .with_context(|| format!("packing {}", dir.display()))?;
                (stats, progress, out)
            };
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
        Cmd::Flatten { archive, output, force, parents, write } => {
            let opts = write.options()?;
            let source = criuz::archive::parent::open(&archive, DEFAULT_SPOOL_CAP, &parents.search())?;
            let out = Output::open(&output, force)?;
            let t = Instant::now();
            let stats = offline::flatten(source, out.writer()?, &opts)?;
            out.commit()?;
            eprintln!(
                "flattened {} into {}: {} files, {} -> {} ({:.3} of raw), {:.2}s",
                archive.display(),
                output.display(),
                stats.files,
                human(stats.raw_bytes),
                human(stats.archive_bytes),
                stats.archive_bytes as f64 / stats.raw_bytes.max(1) as f64,
                t.elapsed().as_secs_f64()
            );
        }
        Cmd::Unpack { archive, dir, tar, force, parents, threads, keys } => {
            keys.load()?;
            let inp = offline::Reading::open(&archive, DEFAULT_SPOOL_CAP, &parents.search())?;
            let t = Instant::now();
            if let Some(tar) = tar {
                let out = Output::open(&tar, force)?;
                let (entries, bytes, w) = offline::unpack_tar(inp, out.writer()?, &threads.options())?;
                drop(w);
                out.commit()?;
                let secs = t.elapsed().as_secs_f64();
                eprintln!("unpacked {entries} entries, {} into tar {}, {secs:.2}s", human(bytes), tar.display());
                return Ok(());
            }
            let dir = dir.expect("clap requires a directory or --tar");
            let progress = Progress::new("unpack", None);
            let st = offline::unpack(inp, &dir, force, &threads.options(), progress)?;
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
        Cmd::Inspect { archive, json, keys } => {
            keys.load()?;
            let inp = open_input(&archive)?;
            let rep = offline::inspect(inp).with_context(|| archive.display().to_string())?;
            if json {
                out!("{}", serde_json::to_string_pretty(&rep)?);
            } else {
                print_inspect(&rep);
            }
        }
        Cmd::Dump { pid, output, force, criu, leave_running, shell_job, json, parent, write, absorb, extra } => {
            let opts = criuz::session::checkpoint::with_absorb(write.options()?, absorb.absorb, &output);
            let c = criu.locate()?;
            let meter = criuz::progress::Meter::new();
            let o = criuz::session::checkpoint::DumpOptions {
                pid,
                output,
                force,
                leave_running,
                shell_job,
                extra,
                parent,
                meter: Some(meter.clone()),
            };
            let ticker = criuz::progress::Ticker::start(move || meter.dump_line());
            let r = criuz::session::checkpoint::dump(&o, &opts, &c);
            drop(ticker);
            let r = r?;
            if json && is_stdio(&o.output) {
                // The archive went to stdout.
                eprintln!("{}", serde_json::to_string_pretty(&r)?);
            } else if json {
                out!("{}", serde_json::to_string_pretty(&r)?);
            } else {
                eprintln!(
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
                    eprintln!(
                        "{} blocks were compressed with LZ4 while the absorb budget was spent (--absorb raises it); {then}",
                        r.hurried_blocks
                    );
                }
                if let Some(s) = &r.criu_stats {
                    eprintln!(
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
        }
        Cmd::Restore {
            input,
            detach,
            criu,
            shell_job,
            pipe_buffer,
            keep_zero_pages,
            lazy,
            json,
            pidfile,
            parents,
            threads,
            keys,
            extra,
        } => {
            keys.load()?;
            let c = criu.locate()?;
            let o = criuz::session::checkpoint::RestoreOptions {
                input,
                detach,
                shell_job,
                extra,
                pipe_buffer: pipe_buffer as u64,
                keep_zero_pages,
                parents: parents.search(),
                pidfile,
                meter: Some(criuz::progress::Meter::new()),
            };
            if lazy {
                let r = criuz::session::lazy::restore_lazy(&o, &c)?;
                if json {
                    out!("{}", serde_json::to_string_pretty(&r)?);
                } else if let Some(pid) = r.pid {
                    eprintln!(
                        "restored {pid} lazily from {}: running after {:.2}s, every page in after {:.2}s \
                         ({} pages restored by CRIU, {} copied in lazily, {} faults)",
                        o.input.display(),
                        r.running_seconds,
                        r.resident_seconds,
                        r.eager_pages,
                        r.lazy_pages,
                        r.faults
                    );
                }
                if !detach && r.criu_exit != 0 {
                    std::process::exit(r.criu_exit.clamp(1, 255));
                }
                return Ok(());
            }
            let meter = o.meter.clone().unwrap_or_default();
            let ticker = criuz::progress::Ticker::start(move || meter.restore_line());
            let r = criuz::session::checkpoint::restore(&o, &threads.options(), &c);
            drop(ticker);
            let r = r?;
            if json {
                out!("{}", serde_json::to_string_pretty(&r)?);
            } else if let Some(pid) = r.pid {
                eprintln!(
                    "restored {pid} from {}: {} served, {} zero pages left out, {:.2}s",
                    o.input.display(),
                    human(r.served_bytes),
                    r.zero_pages_skipped,
                    r.seconds
                );
            }
            if !detach && r.criu_exit != 0 {
                std::process::exit(r.criu_exit.clamp(1, 255));
            }
        }
        Cmd::Capture { dir, output, force, write, absorb } => {
            let opts = criuz::session::checkpoint::with_absorb(write.options()?, absorb.absorb, &output);
            let out = Output::open(&output, force)?;
            let listener = criuz::criu::streamer::Listener::bind(&dir, criuz::criu::streamer::CAPTURE_SOCKET)?;
            eprintln!("criuz: waiting for criu dump --stream -D {}", dir.display());
            let packer = criuz::archive::Packer::start(out.writer()?, &opts, None)?;
            let never = std::sync::atomic::AtomicBool::new(false);
            let captured = criuz::session::capture::capture(&listener, &packer, &never);
            let (packer, _) = criuz::session::capture::settle(packer, captured)
                .map_err(|e| e.context(format!("{} not written", output.display())))?;
            let (stats, _) = packer.finish()?;
            out.commit()?;
            eprintln!(
                "captured {} files: {} -> {} ({:.3} of raw)",
                stats.files,
                human(stats.raw_bytes),
                human(stats.archive_bytes),
                stats.archive_bytes as f64 / stats.raw_bytes.max(1) as f64
            );
        }
        Cmd::Serve { dir, input, pipe_buffer, keep_zero_pages, parents, threads, keys } => {
            keys.load()?;
            let opts = threads.options();
            let source = criuz::archive::parent::open(&input, pipe_buffer as u64, &parents.search())?;
            let listener = criuz::criu::streamer::Listener::bind(&dir, criuz::criu::streamer::SERVE_SOCKET)?;
            eprintln!("criuz: waiting for criu restore --stream -D {}", dir.display());
            let never = std::sync::atomic::AtomicBool::new(false);
            let sopts = criuz::session::serve::ServeOptions {
                meter: criuz::progress::Meter::new(),
                threads: opts.threads,
                prefetch_bytes: criuz::session::serve::PREFETCH_BYTES,
                skip_zero_pages: !keep_zero_pages,
            };
            let r = criuz::session::serve::serve(&listener, source, sopts, &never)?.expect("serve waits for CRIU");
            eprintln!(
                "served {} files ({}), {} not in the archive, {} zero pages left out",
                r.served.len(),
                human(r.bytes),
                r.missing.len(),
                r.zero_pages_skipped
            );
        }
        Cmd::Verify { archive, parents, threads, keys } => {
            keys.load()?;
            let inp = offline::Reading::open(&archive, DEFAULT_SPOOL_CAP, &parents.search())?;
            let progress = Progress::new("verify", None);
            let (files, bytes) = offline::verify(inp, &threads.options(), progress)?;
            out!("{}: OK, {} files, {} checked", archive.display(), files, human(bytes));
        }
        Cmd::PageServer(a) => containers::page_server(a)?,
        Cmd::Runc(c) => containers::runc(c)?,
        Cmd::Podman(c) => containers::podman(c)?,
        Cmd::Keygen { output, force } => {
            use criuz::seal::keyring;
            use std::io::Write;
            let (secret, public) = keyring::generate();
            // Like ssh-keygen: a missing key directory is made, private.
            if let Some(dir) = output.parent().filter(|d| !d.as_os_str().is_empty() && !d.exists()) {
                use std::os::unix::fs::DirBuilderExt;
                std::fs::DirBuilder::new()
                    .recursive(true)
                    .mode(0o700)
                    .create(dir)
                    .with_context(|| dir.display().to_string())?;
            }
            let file = criuz::io::AtomicFile::create(&output, force)?;
            let mut w = file.writer()?;
            w.write_all(age::secrecy::ExposeSecret::expose_secret(&secret).as_bytes())
                .and_then(|()| w.flush())
                .with_context(|| output.display().to_string())?;
            drop(w);
            file.commit()?;
            eprintln!("criuz: wrote the identity to {} (keep it secret; it opens your archives)", output.display());
            out!("{public}");
        }
    }
    Ok(())
}

/// What `unpack`, `verify` and `flatten` may spool of an incremental archive
/// arriving on a pipe.
const DEFAULT_SPOOL_CAP: u64 = 2 << 30;

fn print_inspect(rep: &offline::InspectReport) {
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

fn main() {
    // Blocks are 4 KiB..4 MiB buffers allocated and freed at a high rate on
    // several threads; with glibc's default threshold each one is a fresh
    // mmap (page faults, zeroing, munmap). Keeping them on the heap lets freed
    // blocks be reused. (Not measured on its own: with 2 cores, the dump's
    // time was dominated by CRIU and by writing the archive.)
    // SAFETY: mallopt only tunes the allocator, before any other thread exists.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, 64 << 20);
        libc::mallopt(libc::M_TRIM_THRESHOLD, 256 << 20);
    }
    let cli = Cli::parse();
    if let Err(e) = run(cli) {
        eprintln!("criuz: {e:#}");
        std::process::exit(exit_code(&e));
    }
}

/// The exit status for an error: by the kind of the library error behind it
/// (contexts added here do not change it); 1 for anything else.
fn exit_code(e: &anyhow::Error) -> i32 {
    e.chain().find_map(|c| c.downcast_ref::<criuz::Error>()).map_or(1, |e| e.kind().exit_code())
}

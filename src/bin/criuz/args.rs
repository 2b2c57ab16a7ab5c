//! Flags, and what they become: each group of flags turns into the
//! library's own option types (`criuz::archive::Options`, the keys of
//! `criuz::seal::keyring`, `criuz::io::Location`, ...). Policy (encryption
//! defaults, the absorb budget, eager or lazy) lives in the library.

use crate::containers;
use anyhow::Result;
use clap::{Args, Parser, Subcommand};
use criuz::archive::{Options, ParentSearch};
use criuz::codec::{Codec, CodecConfig};
use criuz::engine;
use criuz::io::{Location, SPOOL_CAP};
use criuz::seal::keyring::Keys;
use criuz::session::place::HugePages;
use std::path::PathBuf;

#[derive(Parser)]
#[command(name = "criuz", version, about = "Small, fast, safe CRIU checkpoints with stock CRIU")]
pub struct Cli {
    #[command(subcommand)]
    pub cmd: Cmd,
}

#[derive(Args, Clone)]
pub struct CodecArgs {
    /// Compression: lz4, zstd or none (zero pages are elided with every codec)
    #[arg(long, default_value = "lz4")]
    pub codec: Codec,
    /// LZ4 acceleration (1 = best ratio) or zstd level (negative = faster)
    #[arg(long, allow_hyphen_values = true)]
    pub level: Option<i32>,
    /// Never store blocks as 16-bit byte planes (by default a block of
    /// bf16/fp16 words is, where that makes it at least 5% smaller)
    #[arg(long)]
    pub no_planes: bool,
    /// Block size, a multiple of 4K from 4K to 4M (K/M suffixes)
    #[arg(long, default_value = "256K", value_parser = parse_size)]
    pub block_size: usize,
    /// Store page ids, so the archive can be the parent of an incremental one
    /// without being decoded (and identical pages within it are stored once)
    #[arg(long)]
    pub ids: bool,
    #[command(flatten)]
    pub threads: ThreadArgs,
}

/// Keys that open encrypted archives (secrets only ever from files).
#[derive(Args, Clone, Default)]
pub struct KeyArgs {
    /// age identity file that opens encrypted archives (made by `criuz keygen`; repeatable)
    #[arg(long = "identity", value_name = "FILE")]
    pub identities: Vec<PathBuf>,
    /// File whose first line is the passphrase of encrypted archives
    #[arg(long, value_name = "FILE")]
    pub passphrase_file: Option<PathBuf>,
}

impl KeyArgs {
    /// Loads the keys into the keyring (every archive opened is unlocked through it).
    pub fn load(&self) -> Result<()> {
        Ok(Keys { identities: self.identities.clone(), passphrase_file: self.passphrase_file.clone() }.load()?)
    }
}

/// Encryption of a new archive, and the keys of an encrypted parent.
#[derive(Args, Clone, Default)]
pub struct SealArgs {
    /// Encrypt the archive to this age public key (age1...; repeatable)
    #[arg(long = "recipient", value_name = "KEY")]
    pub recipients: Vec<String>,
    /// Encrypt the archive to the age public keys in FILE, one a line (repeatable)
    #[arg(long = "recipients-file", value_name = "FILE")]
    pub recipients_files: Vec<PathBuf>,
    /// age identity that opens an encrypted parent (repeatable); with no
    /// --recipient, the archive is encrypted to the identities' own keys
    #[arg(long = "identity", value_name = "FILE")]
    pub identities: Vec<PathBuf>,
    /// Encrypt the archive with the passphrase on FILE's first line (and open an encrypted parent with it)
    #[arg(long, value_name = "FILE")]
    pub passphrase_file: Option<PathBuf>,
}

impl SealArgs {
    /// Loads the keys and sets `opts.seal` when the archive is to be
    /// encrypted (the library's rule: [`Keys::for_new_archive`]).
    pub fn apply(&self, opts: &mut Options) -> Result<()> {
        let keys = Keys { identities: self.identities.clone(), passphrase_file: self.passphrase_file.clone() };
        opts.seal = keys.for_new_archive(&self.recipients, &self.recipients_files)?.map(std::sync::Arc::new);
        Ok(())
    }
}

/// How a new archive is written: its codec and its encryption.
#[derive(Args, Clone)]
pub struct ArchiveArgs {
    #[command(flatten)]
    pub codec: CodecArgs,
    #[command(flatten)]
    pub seal: SealArgs,
}

impl ArchiveArgs {
    pub fn options(&self) -> Result<Options> {
        let mut opts = self.codec.options()?;
        self.seal.apply(&mut opts)?;
        Ok(opts)
    }
}

#[derive(Args, Clone)]
pub struct AbsorbArgs {
    /// Memory for CRIU's pages not yet compressed: while CRIU writes, criuz
    /// takes pages in and compresses them on the cores CRIU does not need
    /// (all but one: 1 of 2, 15 of 16), the rest once CRIU is done (or, when
    /// the budget is nearly spent, at once with LZ4) (K/M/G; default: a quarter
    /// of available memory, but 64M for an s3:// output, which bounds an
    /// upload's memory; 0: 64M, compressing alongside CRIU throughout)
    #[arg(long, value_name = "SIZE", value_parser = parse_size)]
    pub absorb: Option<usize>,
}

#[derive(Args, Clone)]
pub struct ThreadArgs {
    /// Worker threads (default: all cores)
    #[arg(short = 'j', long = "jobs", value_parser = parse_jobs)]
    pub jobs: Option<usize>,
}

/// `-j N`: 1 to [`engine::MAX_THREADS`].
fn parse_jobs(s: &str) -> Result<usize, String> {
    let n: usize = s.trim().parse().map_err(|_| format!("not a thread count: {s:?}"))?;
    if !(1..=engine::MAX_THREADS).contains(&n) {
        return Err(format!("between 1 and {} threads, got {n}", engine::MAX_THREADS));
    }
    Ok(n)
}

impl ThreadArgs {
    pub fn options(&self) -> Options {
        criuz::session::checkpoint::pipeline_options(self.jobs.unwrap_or_else(engine::default_threads))
    }
}

impl CodecArgs {
    pub fn options(&self) -> Result<Options> {
        // A usage error (exit 2), not a plain failure.
        let mut codec = CodecConfig::new(self.codec, self.level).map_err(|e| criuz::Error::Usage(e.to_string()))?;
        codec.planes &= !self.no_planes;
        let opts = Options { codec, block_size: self.block_size, ids: self.ids, ..self.threads.options() };
        opts.validate()?;
        Ok(opts)
    }
}

#[derive(Subcommand)]
pub enum Cmd {
    /// Checkpoint a process tree into an archive (runs criu dump --stream)
    Dump {
        /// Root of the process tree
        #[arg(short = 't', long = "tree", value_parser = clap::value_parser!(i32).range(1..))]
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
        /// Leave the tree's CUDA processes as they are (by default their GPU
        /// state is suspended into host memory before CRIU freezes the tree)
        #[arg(long)]
        no_gpu: bool,
        /// Store no page ids unless --ids asks (by default a tree of several
        /// processes that share much of their memory, or one holding CUDA
        /// state, stores them, and each page that occurs more than once in
        /// it only once)
        #[arg(long, conflicts_with = "ids")]
        no_ids: bool,
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
    /// Restore a process tree from an archive (criu restore, its memory placed by criuz or streamed)
    Restore {
        /// Archive to read ("-" for stdin)
        #[arg(short = 'i', long, value_name = "ARCHIVE")]
        input: Option<PathBuf>,
        /// The archive to read, given without -i (as inspect and verify take it)
        #[arg(value_name = "ARCHIVE", conflicts_with = "input", required_unless_present = "input")]
        archive: Option<PathBuf>,
        /// Return once the restored tree runs (by default criuz waits for the
        /// tree, passes the signals it is sent on to the tree's root, and
        /// exits as the root does: its exit status, or 128 + the signal that
        /// killed it)
        #[arg(short = 'd', long)]
        detach: bool,
        #[command(flatten)]
        criu: CriuArgs,
        /// Allow a process attached to a terminal
        #[arg(long)]
        shell_job: bool,
        /// Cap on the archive bytes spooled to a private temporary file when the archive comes from a pipe
        #[arg(long, default_value_t = SPOOL_CAP, value_parser = parse_spool)]
        pipe_buffer: u64,
        /// Restore every zero page as a page of memory (default: leave out those that read as zero anyway)
        #[arg(long)]
        keep_zero_pages: bool,
        /// Run the process at once and fetch its memory on demand (criu lazy-pages, criuz as page server); with -d, returns when every page is in
        #[arg(long, conflicts_with = "keep_zero_pages")]
        lazy: bool,
        /// With --lazy: read every stored byte against its check before the
        /// process runs (damage at rest then stops the restore while nothing
        /// runs), instead of behind the running process (damage found then
        /// kills it); the process then starts later
        #[arg(long, requires = "lazy")]
        verify_first: bool,
        /// How an eager restore's memory comes back: place (criuz copies
        /// every page in with userfaultfd, on every core, while CRIU holds
        /// the restored tree stopped, then lets it run), stream (through
        /// CRIU's image stream, one thread), or auto: place where it can
        /// (see docs/usage.md), else stream
        #[arg(long, value_enum, default_value = "auto", conflicts_with = "lazy")]
        fill: Fill,
        /// A placed restore writes private memory in 4 KiB pages even where
        /// the process had transparent huge pages: quicker to place where
        /// huge pages are slow to get (each is zeroed first), but the process
        /// then runs on small pages until khugepaged merges them
        #[arg(long, conflicts_with = "lazy")]
        no_huge_pages: bool,
        /// Where the kernel gives huge pages slower than this, in GB/s a
        /// placing thread, a placed restore places the rest in 4 KiB pages
        /// (each huge page is zeroed first, and a VM whose host took freed
        /// memory back may give them at a twentieth of memory's pace); 0
        /// keeps huge pages however slowly they come
        #[arg(long, value_name = "GBPS", default_value_t = HugePages::DEFAULT_FLOOR / 1e9, value_parser = parse_rate, conflicts_with_all = ["lazy", "no_huge_pages"])]
        huge_page_floor: f64,
        /// Print the summary as JSON on stdout
        #[arg(long)]
        json: bool,
        /// Write the restored pid to FILE once the tree runs (with --lazy: while its pages still arrive); a FILE that cannot be written fails the restore and kills the tree; one that holds more than a pid (an archive, a key) is refused before anything runs
        #[arg(long, value_name = "FILE")]
        pidfile: Option<PathBuf>,
        /// Restore CUDA state dumped from GPU OLD onto GPU NEW (UUIDs as
        /// nvidia-smi -L prints them; the same kind of GPU; repeatable)
        #[arg(long, value_name = "OLD=NEW", value_parser = criuz::cuda::parse_gpu_map)]
        gpu_map: Vec<(String, String)>,
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
        /// Directory to unpack into (created if missing; the alias is
        /// CRIU's own name for an images directory)
        #[arg(
            short = 'd',
            long = "dir",
            visible_short_alias = 'D',
            required_unless_present = "tar",
            conflicts_with = "tar"
        )]
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
        /// Replace an existing archive
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
        #[arg(long, default_value_t = SPOOL_CAP, value_parser = parse_spool)]
        pipe_buffer: u64,
        /// Restore every zero page as a page of memory (default: leave out those that read as zero anyway)
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
    /// The CUDA driver's checkpoint state of processes, or resume those left
    /// suspended (a dump resumes what it suspended; this is for a dump cut
    /// short, or a suspend made by hand)
    #[command(subcommand)]
    Gpu(GpuCmd),
    /// Check whether this machine can dump and restore, and which of criuz's
    /// ways it can take (CRIU and its own check, privileges, userfaultfd, the
    /// cores and memory a dump takes, the CUDA driver, runc, podman); exit 0
    /// unless none can run
    Check {
        #[command(flatten)]
        criu: CriuArgs,
        /// Print the findings as JSON
        #[arg(long)]
        json: bool,
    },
    /// Make an age identity for encrypted archives (mode 0600) and print its public key
    Keygen {
        /// Identity file to write (- for standard output, the public key then on standard error)
        #[arg(short = 'o', long)]
        output: PathBuf,
        /// Replace an existing file (never an identity or an archive)
        #[arg(long)]
        force: bool,
    },
    /// The wait of `criuz restore` without -d for its tree's root, its own
    /// child (run by criuz itself, in place of the restore, not by hand)
    #[command(hide = true)]
    WaitTree {
        /// The restored tree's root
        pid: i32,
    },
    /// CRIU's action script where CRIU waits for criuz: a dump's post-dump,
    /// a container's lazy restore's pre-resume (run by CRIU, not by hand)
    #[command(hide = true)]
    CriuHook {
        /// The action criuz waits at (post-dump, pre-resume)
        at: String,
        /// criuz's hook socket
        socket: PathBuf,
    },
}

impl Cmd {
    /// Whether what the command prints on stdout is its product (a report
    /// read from an archive or a process), not a summary of work it did.
    pub fn reports_on_stdout(&self) -> bool {
        matches!(self, Cmd::Inspect { .. } | Cmd::Verify { .. } | Cmd::Check { .. } | Cmd::Gpu(GpuCmd::State { .. }))
    }
}

#[derive(Subcommand)]
pub enum GpuCmd {
    /// Print each process's CUDA checkpoint state
    State {
        #[arg(required = true)]
        pids: Vec<i32>,
    },
    /// Restore and unlock the CUDA state of suspended processes
    Resume {
        #[arg(required = true)]
        pids: Vec<i32>,
    },
}

/// Where the parents of an incremental archive are.
#[derive(Args, Clone)]
pub struct ParentArgs {
    /// A parent archive (repeatable); by default each is looked for where it
    /// was when the child was written
    #[arg(long = "parent", value_name = "FILE")]
    pub parents: Vec<PathBuf>,
    /// A directory to search for parent archives (*.czr; repeatable)
    #[arg(long = "parent-dir", value_name = "DIR")]
    pub parent_dirs: Vec<PathBuf>,
}

impl ParentArgs {
    pub fn search(&self) -> ParentSearch {
        ParentSearch { files: self.parents.clone(), dirs: self.parent_dirs.clone() }
    }
}

#[derive(Args, Clone)]
pub struct CriuArgs {
    /// CRIU binary (default: $CRIUZ_CRIU, the setup cache, then PATH)
    #[arg(long = "criu")]
    pub criu: Option<PathBuf>,
}

impl CriuArgs {
    pub fn locate(&self) -> Result<criuz::criu::Criu> {
        let (c, rejected) = criuz::criu::locate(self.criu.as_deref())?;
        for r in rejected {
            criuz::say!("criuz: skipped CRIU {} (from {}): {}", r.path.display(), r.source, r.why);
        }
        criuz::say!("criuz: using CRIU {} at {} (from {})", c.version, c.path.display(), c.source);
        Ok(c)
    }
}

pub fn parse_size(s: &str) -> Result<usize, String> {
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

/// How an eager restore's memory comes back (`--fill`).
#[derive(Clone, Copy, clap::ValueEnum)]
pub enum Fill {
    Auto,
    Stream,
    Place,
}

/// `--huge-page-floor`: a rate in GB/s, a finite number, 0 or more.
fn parse_rate(s: &str) -> Result<f64, String> {
    match s.trim().parse::<f64>() {
        Ok(r) if r.is_finite() && r >= 0.0 => Ok(r),
        _ => Err(format!("{s:?} is not a rate in GB/s (a number, 0 or more)")),
    }
}

/// `--pipe-buffer`: a size, as `parse_size` reads it.
fn parse_spool(s: &str) -> Result<u64, String> {
    parse_size(s).map(|n| n as u64)
}

/// An archive named on the command line (`-`, a path or `s3://bucket/key`).
pub fn location(spec: &std::path::Path) -> Result<Location> {
    Ok(Location::parse(spec)?)
}

/// An archive to read: as [`location`], checked by `Location::check_input`
/// (`-` not a terminal, where criuz would wait for an archive nobody types;
/// a file that is there).
pub fn input_location(spec: &std::path::Path) -> Result<Location> {
    let at = location(spec)?;
    at.check_input()?;
    Ok(at)
}

//! `criuz page-server`, `criuz runc ...` and `criuz podman ...`: argument
//! parsing and printing; the work is in `criuz::session::{receive, container, podman}`.

use crate::args::{input_location, location, ArchiveArgs, CriuArgs, KeyArgs, ThreadArgs};
use crate::print::{self, human};
use anyhow::Result;
use clap::{Args, Subcommand};
use criuz::session::container::{self, Memory, RestoredHow, Runc, RuncCheckpoint, RuncRestore, Via};
use criuz::session::podman;
use criuz::session::receive::PageServer;
use criuz::session::standalone;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Instant;

/// Receive a dump over CRIU's page-server protocol into one archive
#[derive(Args)]
pub struct PageServerArgs {
    /// The dump's images directory (its metadata joins the archive)
    #[arg(short = 'D', long = "images-dir")]
    dir: PathBuf,
    /// Archive to write ("-" for stdout)
    #[arg(short = 'o', long)]
    output: PathBuf,
    /// Replace an existing archive
    #[arg(long)]
    force: bool,
    /// Address to listen on; port 0 picks a free port. No authentication in
    /// the protocol: on loopback only criuz's own user is served; across
    /// hosts, use a tunnel
    #[arg(long, default_value = "127.0.0.1:0")]
    listen: String,
    #[command(flatten)]
    write: ArchiveArgs,
    /// The dump to run, e.g. criu dump ... --page-server --address {ip} --port {port};
    /// {ip}, {port} and {addr} (IP:PORT, as runc checkpoint --page-server takes it) are
    /// replaced by where criuz listens
    #[arg(last = true, required = true)]
    command: Vec<String>,
}

pub fn page_server(a: PageServerArgs) -> Result<()> {
    let opts = a.write.options()?;
    let server = PageServer::bind(&a.listen)?;
    let addr = server.local_addr()?;
    if !addr.ip().is_loopback() {
        criuz::say!("criuz: page server on {addr}: not loopback, and the protocol has no authentication");
    }
    let args: Vec<String> = a
        .command
        .iter()
        .map(|s| {
            s.replace("{addr}", &addr.to_string())
                .replace("{ip}", &addr.ip().to_string())
                .replace("{port}", &addr.port().to_string())
        })
        .collect();
    // Said before the dump's own checks (its images directory, its output),
    // which may still refuse it: what it is to run, not that it runs.
    criuz::say!("criuz: page server on {addr}, for the dump {}", args.join(" "));
    let t = Instant::now();
    let output = location(&a.output)?;
    let (stats, rx) = standalone::page_server_dump(&server, &args, &a.dir, &output, a.force, &opts)?;
    if !rx.left_out.is_empty() {
        const NAMED: usize = 3;
        let more = rx.left_out.len().saturating_sub(NAMED);
        criuz::say!(
            "note: {}: left out of the archive, as there before this dump and not written by it: {}{}",
            a.dir.display(),
            rx.left_out[..rx.left_out.len().min(NAMED)].join(", "),
            if more > 0 { format!(" and {more} more") } else { String::new() }
        );
    }
    criuz::say!(
        "received {} pages ({} protocol) and {} files: {}, {:.2}s",
        rx.pages,
        rx.protocol,
        stats.files,
        print::sizes(&stats),
        t.elapsed().as_secs_f64()
    );
    Ok(())
}

#[derive(Clone, Copy, clap::ValueEnum)]
pub enum ViaArg {
    Follow,
    PageServer,
}

#[derive(Args)]
pub struct RuncGlobal {
    /// runc binary
    #[arg(long, default_value = "runc")]
    runc: PathBuf,
    /// runc's state root (runc --root)
    #[arg(long)]
    root: Option<PathBuf>,
    #[command(flatten)]
    criu: CriuArgs,
}

impl RuncGlobal {
    fn runc(&self) -> Runc {
        Runc { binary: self.runc.clone(), root: self.root.clone() }
    }
}

#[derive(Subcommand)]
pub enum RuncCmd {
    /// Checkpoint a runc container into one archive (pages compressed as CRIU sends them)
    Checkpoint {
        /// Container id
        id: String,
        /// Archive to write ("-" for stdout)
        #[arg(short = 'o', long)]
        output: PathBuf,
        /// Replace an existing archive
        #[arg(long)]
        force: bool,
        /// Keep the container running after the checkpoint
        #[arg(long)]
        leave_running: bool,
        /// How pages reach the archive: page-server (CRIU sends them to
        /// criuz over loopback TCP; nothing written locally) or follow (CRIU
        /// writes a private tmpfs directory, compressed as it grows)
        #[arg(long, value_enum, default_value = "page-server")]
        via: ViaArg,
        /// Leave the container's CUDA processes as they are (by default their
        /// GPU state is suspended into host memory before the container is frozen)
        #[arg(long)]
        no_gpu: bool,
        /// Store no page ids unless --ids asks (by default a container whose
        /// processes share much of their memory, or that holds CUDA state,
        /// stores them, and each page that occurs more than once in it only
        /// once)
        #[arg(long, conflicts_with = "ids")]
        no_ids: bool,
        /// Print a JSON report
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        global: RuncGlobal,
        #[command(flatten)]
        write: ArchiveArgs,
        /// More runc checkpoint options (after --), e.g. --tcp-established
        #[arg(last = true)]
        extra: Vec<String>,
    },
    /// Restore a runc container from an archive
    Restore {
        /// Container id
        id: String,
        /// Archive to read ("-" for stdin)
        #[arg(short = 'i', long)]
        input: PathBuf,
        /// The container's bundle (runc restore --bundle)
        #[arg(short = 'b', long)]
        bundle: Option<PathBuf>,
        /// Detach from the restored container (runc restore --detach)
        #[arg(short = 'd', long)]
        detach: bool,
        /// Write the restored init's pid here (runc restore --pid-file)
        #[arg(long)]
        pid_file: Option<PathBuf>,
        /// Start the container before its memory is in: criuz serves the
        /// pages as they are touched and fills the rest, and returns once
        /// all are in (a failure then kills the container's cgroup). The
        /// default where the kernel allows it; the archive's stored bytes
        /// are all checked behind the running container (--verify-first:
        /// before it starts)
        #[arg(long, conflicts_with = "eager")]
        lazy: bool,
        /// Lazily: read every stored byte against its check before the
        /// container starts, instead of behind the running container
        #[arg(long, conflicts_with = "eager")]
        verify_first: bool,
        /// Restore CUDA state dumped from GPU OLD onto GPU NEW (UUIDs as
        /// nvidia-smi -L prints them; the same kind of GPU; repeatable)
        #[arg(long, value_name = "OLD=NEW", value_parser = criuz::cuda::parse_gpu_map)]
        gpu_map: Vec<(String, String)>,
        /// Write every page for CRIU before the container starts (the
        /// container never runs before all of its memory is in place)
        #[arg(long)]
        eager: bool,
        /// Print a JSON report
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        global: RuncGlobal,
        #[command(flatten)]
        threads: ThreadArgs,
        #[command(flatten)]
        keys: KeyArgs,
        /// More runc restore options (after --)
        #[arg(last = true)]
        extra: Vec<String>,
    },
}

/// A runc subcommand; its exit status (a container restored without
/// --detach ends criuz as its init ended).
pub fn runc(cmd: RuncCmd) -> Result<ExitCode> {
    match cmd {
        RuncCmd::Checkpoint { id, output, force, leave_running, via, no_gpu, no_ids, json, global, write, extra } => {
            let opts = write.options()?;
            let criu = global.criu.locate()?;
            let via = match via {
                ViaArg::Follow => Via::Follow,
                ViaArg::PageServer => Via::PageServer,
            };
            let o = RuncCheckpoint { id, output, force, leave_running, via, extra, no_gpu, auto_ids: !no_ids };
            let r = container::runc_checkpoint(&global.runc(), &o, &opts, &criu)?;
            if json {
                print::json(&r, true)?;
            } else {
                criuz::say!(
                    "checkpointed container {} into {} ({}): {} -> {} ({:.3} of raw), {:.2}s",
                    o.id,
                    r.output.display(),
                    if r.via == Via::Follow { "followed" } else { "page server" },
                    human(r.raw_bytes),
                    human(r.archive_bytes),
                    r.ratio,
                    r.seconds
                );
                if let Some(c) = &r.cuda {
                    let resumed = c.resume_seconds.map_or(String::new(), |t| format!(", resumed in {t:.2}s"));
                    criuz::say!(
                        "CUDA: {} process(es) suspended in {:.2}s before the container was frozen{resumed}",
                        c.record.pids.len(),
                        c.suspend_seconds
                    );
                }
            }
        }
        RuncCmd::Restore {
            id,
            input,
            bundle,
            detach,
            pid_file,
            lazy,
            eager,
            verify_first,
            gpu_map,
            json,
            global,
            threads,
            keys,
            extra,
        } => {
            keys.load()?;
            let criu = global.criu.locate()?;
            let memory = match (lazy, eager) {
                (true, _) => Memory::Lazy,
                (_, true) => Memory::Eager,
                _ => Memory::Auto,
            };
            let input = input_location(&input)?;
            let o = RuncRestore { id, input, bundle, detach, pid_file, memory, verify_first, extra, gpu_map };
            let r = container::runc_restore(&global.runc(), &o, &threads.options(), &criu)?;
            if let Some(why) = r.not_lazy {
                criuz::say!("criuz: {}: {why}", o.input);
            }
            if json {
                print::json(&r, true)?;
            } else {
                match &r.how {
                    RestoredHow::Lazy(l) => criuz::say!(
                        "restored container {} from {} lazily: running after {:.2}s, {} ({} pages copied in, {} faults)",
                        o.id,
                        o.input,
                        l.running_seconds,
                        print::lazy_filled(l),
                        l.lazy_pages,
                        l.faults
                    ),
                    RestoredHow::Eager { unpack_seconds, bytes, .. } => criuz::say!(
                        "restored container {} from {}: {} unpacked in {:.2}s, {:.2}s in all",
                        o.id,
                        o.input,
                        human(*bytes),
                        unpack_seconds,
                        r.seconds
                    ),
                }
                if let Some(t) = r.cuda_resume_seconds {
                    criuz::say!("CUDA: resumed in {t:.2}s after runc (restore and unlock)");
                }
            }
            // Without --detach: as the container's init ended.
            if let Some(code) = r.exit_status {
                return Ok(ExitCode::from(code.clamp(0, 255) as u8));
            }
        }
    }
    Ok(ExitCode::SUCCESS)
}

#[derive(Subcommand)]
pub enum PodmanCmd {
    /// Checkpoint a podman container (podman container checkpoint --export) into an archive
    Checkpoint {
        /// Container name or id
        id: String,
        /// Archive to write ("-" for stdout)
        #[arg(short = 'o', long)]
        output: PathBuf,
        /// Replace an existing archive
        #[arg(long)]
        force: bool,
        /// podman binary
        #[arg(long, default_value = "podman")]
        podman: PathBuf,
        #[command(flatten)]
        criu: CriuArgs,
        #[command(flatten)]
        write: ArchiveArgs,
        /// Store no page ids unless --ids asks (by default a container whose
        /// processes share much of their memory stores them, and each page
        /// that occurs more than once in it only once)
        #[arg(long, conflicts_with = "ids")]
        no_ids: bool,
        /// More podman container checkpoint options (after --)
        #[arg(last = true)]
        extra: Vec<String>,
    },
    /// Restore a podman container from an archive (podman container restore --import)
    Restore {
        /// Archive to read ("-" for stdin)
        #[arg(short = 'i', long)]
        input: PathBuf,
        /// podman binary
        #[arg(long, default_value = "podman")]
        podman: PathBuf,
        #[command(flatten)]
        criu: CriuArgs,
        #[command(flatten)]
        threads: ThreadArgs,
        #[command(flatten)]
        keys: KeyArgs,
        /// More podman container restore options (after --)
        #[arg(last = true)]
        extra: Vec<String>,
    },
}

pub fn podman(cmd: PodmanCmd) -> Result<()> {
    match cmd {
        PodmanCmd::Checkpoint { id, output, force, podman, criu, write, no_ids, extra } => {
            let opts = write.options()?;
            let criu = criu.locate()?;
            let t = Instant::now();
            let o = podman::PodmanCheckpoint { id: &id, output: &output, force, extra: &extra, auto_ids: !no_ids };
            let s = podman::podman_checkpoint(&podman, &criu, &o, &opts)?;
            criuz::say!(
                "checkpointed container {id} into {}: {}, {:.2}s",
                output.display(),
                print::sizes(&s),
                t.elapsed().as_secs_f64()
            );
        }
        PodmanCmd::Restore { input, podman, criu, threads, keys, extra } => {
            keys.load()?;
            let criu = criu.locate()?;
            let t = Instant::now();
            podman::podman_restore(&podman, &criu, &input_location(&input)?, &extra, &threads.options())?;
            criuz::say!("restored from {} in {:.2}s", input.display(), t.elapsed().as_secs_f64());
        }
    }
    Ok(())
}

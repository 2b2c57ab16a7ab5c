//! One short function per command: flags to the library's option types,
//! one library call, the result printed.

use crate::args::{
    input_location, location, AbsorbArgs, ArchiveArgs, Cli, Cmd, CriuArgs, Fill, GpuCmd, KeyArgs, ParentArgs,
    ThreadArgs,
};
use crate::containers;
use crate::print::{self, human, out, rate};
use anyhow::{Context, Result};
use criuz::archive::OpenOptions;
use criuz::io::Output;
use criuz::offline::{self, Reading};
use criuz::progress::{Meter, Progress, Ticker};
use criuz::session::checkpoint::{self, DumpOptions, RestoreReport};
use criuz::session::criu_run::RestoreOptions;
use std::os::unix::process::CommandExt;

use criuz::session::lazy::LazyReport;
use criuz::session::place::HugePages;
use criuz::session::restore::{How, Restored};
use criuz::session::standalone;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Instant;

/// Runs the command; the exit code when it did not fail (a restore without
/// `-d` exits with CRIU's status, which CRIU gives once the tree has ended).
pub fn run(cli: Cli) -> Result<ExitCode> {
    match cli.cmd {
        Cmd::Pack { dir, tar, output, force, parent, write } => pack(dir, tar, &output, force, parent, &write)?,
        Cmd::Flatten { archive, output, force, parents, write } => flatten(&archive, &output, force, &parents, &write)?,
        Cmd::Unpack { archive, dir, tar, force, parents, threads, keys } => {
            unpack(&archive, dir, tar, force, &parents, &threads, &keys)?
        }
        Cmd::Inspect { archive, json, keys } => inspect(&archive, json, &keys)?,
        Cmd::Verify { archive, parents, threads, keys } => verify(&archive, &parents, &threads, &keys)?,
        Cmd::Dump {
            pid,
            output,
            force,
            criu,
            leave_running,
            shell_job,
            no_gpu,
            no_ids,
            json,
            parent,
            write,
            absorb,
            extra,
        } => {
            let auto_ids = !no_ids;
            let o = DumpOptions {
                pid,
                output,
                force,
                leave_running,
                shell_job,
                extra,
                parent,
                meter: None,
                no_gpu,
                auto_ids,
            };
            dump(o, &criu, json, &write, &absorb)?
        }
        Cmd::Restore {
            input,
            archive,
            detach,
            criu,
            shell_job,
            pipe_buffer,
            keep_zero_pages,
            lazy,
            verify_first,
            fill,
            no_huge_pages,
            huge_page_floor,
            json,
            pidfile,
            gpu_map,
            parents,
            threads,
            keys,
            extra,
        } => {
            keys.load()?;
            let input = input.or(archive).expect("clap requires an archive, with -i or without");
            let o = RestoreOptions {
                input: input_location(&input)?,
                detach,
                shell_job,
                extra,
                pipe_buffer,
                keep_zero_pages,
                huge_pages: if no_huge_pages { HugePages::Off } else { HugePages::On { floor: huge_page_floor * 1e9 } },
                parents: parents.search(),
                pidfile,
                meter: Some(Meter::new()),
                verify_first,
                gpu_map,
            };
            let how = match (lazy, fill) {
                (true, _) => How::Lazy,
                (false, Fill::Auto) => How::Auto,
                (false, Fill::Stream) => How::Stream,
                (false, Fill::Place) => How::Placed,
            };
            return restore(&o, how, json, &criu, &threads);
        }
        Cmd::Capture { dir, output, force, write, absorb } => capture(&dir, &output, force, &write, &absorb)?,
        Cmd::Serve { dir, input, pipe_buffer, keep_zero_pages, parents, threads, keys } => {
            keys.load()?;
            let o = RestoreOptions {
                input: input_location(&input)?,
                detach: false,
                shell_job: false,
                extra: Vec::new(),
                pipe_buffer,
                keep_zero_pages,
                huge_pages: HugePages::default(),
                parents: parents.search(),
                pidfile: None,
                meter: Some(Meter::new()),
                verify_first: false,
                gpu_map: Vec::new(),
            };
            serve(&dir, &o, &threads)?
        }
        Cmd::PageServer(a) => containers::page_server(a)?,
        Cmd::Runc(c) => return containers::runc(c),
        Cmd::Podman(c) => containers::podman(c)?,
        Cmd::Gpu(GpuCmd::State { pids }) => {
            for (pid, state) in criuz::cuda::states(&pids)? {
                match state {
                    Ok(s) => out!("{pid}: {}", serde_json::to_value(s).unwrap_or_default().as_str().unwrap_or("?")),
                    Err(e) => out!("{pid}: not a CUDA process ({e})"),
                }
            }
        }
        Cmd::Gpu(GpuCmd::Resume { pids }) => criuz::cuda::resume_command(&pids)?,
        Cmd::Check { criu, json } => check(&criu, json)?,
        Cmd::Keygen { output, force } => keygen(&output, force)?,
        Cmd::WaitTree { pid } => return wait_tree(pid),
        Cmd::CriuHook { at, socket } => {
            use criuz::session::criu_hook::{run_hook, At};
            let at = At::named(&at).ok_or_else(|| criuz::Error::Usage(format!("criu-hook: no such action {at:?}")))?;
            let action = std::env::var("CRTOOLS_SCRIPT_ACTION").unwrap_or_default();
            let init_pid = std::env::var("CRTOOLS_INIT_PID").ok().and_then(|p| p.parse().ok());
            let status = run_hook(&action, at, &socket, init_pid);
            return Ok(ExitCode::from(status as u8));
        }
    }
    Ok(ExitCode::SUCCESS)
}

fn pack(
    dir: Option<PathBuf>,
    tar: Option<PathBuf>,
    output: &Path,
    force: bool,
    parent: Option<PathBuf>,
    write: &ArchiveArgs,
) -> Result<()> {
    let opts = write.options()?;
    let dedup = checkpoint::dedup_for(parent.as_deref(), output)?;
    let t = Instant::now();
    let (stats, progress, out) = if let Some(tar) = tar {
        if dedup.is_some() {
            return Err(criuz::Error::Usage("--parent works with a directory, not --tar".into()).into());
        }
        let tar = input_location(&tar)?;
        let inp = tar.reader()?;
        let out = Output::open(output, force)?;
        let mut progress = Progress::new("pack", None);
        let stats = offline::pack_tar(inp, &tar.label(), out.writer()?, &opts, &mut progress)?;
        (stats, progress, out)
    } else {
        let dir = dir.expect("clap requires a directory or --tar");
        criuz::io::named_dir(&dir)?;
        // Opened first, so that the scan sees where it writes.
        let out = Output::open(output, force)?;
        let (entries, own) = criuz::tree::scan_without(&dir, &out.own_files())?;
        if own {
            let what = if output == Path::new("-") { "standard output" } else { &*output.to_string_lossy() };
            criuz::say!("note: {what} is the archive being written, in {}; it is not packed", dir.display());
        }
        let total: u64 = entries.iter().filter(|e| e.kind.is_file()).map(|e| e.size).sum();
        let mut progress = Progress::new("pack", Some(total));
        let stats = offline::pack_dir(&dir, &entries, out.writer()?, &opts, dedup, &mut progress)
            .with_context(|| format!("packing {}", dir.display()))?;
        (stats, progress, out)
    };
    progress.finish();
    out.commit()?;
    let secs = t.elapsed().as_secs_f64();
    criuz::say!(
        "packed {} files: {}, {} zero pages elided, {:.2}s, {}",
        stats.files,
        print::sizes(&stats),
        stats.zero_pages,
        secs,
        rate(stats.raw_bytes, secs)
    );
    Ok(())
}

fn flatten(archive: &Path, output: &Path, force: bool, parents: &ParentArgs, write: &ArchiveArgs) -> Result<()> {
    let opts = write.options()?;
    let how = OpenOptions { search: parents.search(), ..OpenOptions::default() };
    let at = input_location(archive)?;
    let source = criuz::archive::open(&at, &how)?;
    // The archive itself may be flattened in place; one it needs may not
    // be replaced by it.
    if let Some(needed) = criuz::archive::ancestor_at(&source, &at, &how.search, output)? {
        return Err(criuz::Error::Usage(format!(
            "{}: {} is a parent of {} that it still needs; flatten into another file",
            output.display(),
            needed.display(),
            archive.display()
        ))
        .into());
    }
    let out = Output::open(output, force)?;
    let t = Instant::now();
    let stats = offline::flatten(source, out.writer()?, &opts)?;
    out.commit()?;
    let (from, to, secs) = (archive.display(), output.display(), t.elapsed().as_secs_f64());
    criuz::say!("flattened {from} into {to}: {} files, {}, {secs:.2}s", stats.files, print::sizes(&stats));
    Ok(())
}

fn unpack(
    archive: &Path,
    dir: Option<PathBuf>,
    tar: Option<PathBuf>,
    force: bool,
    parents: &ParentArgs,
    threads: &ThreadArgs,
    keys: &KeyArgs,
) -> Result<()> {
    keys.load()?;
    let how = OpenOptions { search: parents.search(), ..OpenOptions::default() };
    let at = input_location(archive)?;
    let t = Instant::now();
    if let Some(tar) = tar {
        let inp = Reading::for_tar(&at, &how)?;
        let out = Output::open(&tar, force)?;
        let (entries, bytes, w) = offline::unpack_tar(inp, out.writer()?, &threads.options())?;
        drop(w);
        out.commit()?;
        let secs = t.elapsed().as_secs_f64();
        criuz::say!("unpacked {entries} entries, {} into tar {}, {secs:.2}s", human(bytes), tar.display());
        return Ok(());
    }
    let dir = dir.expect("clap requires a directory or --tar");
    let inp = Reading::new(&at, &how)?;
    let st = offline::unpack(inp, &dir, force, &threads.options(), Progress::new("unpack", None))?;
    let secs = t.elapsed().as_secs_f64();
    let (files, bytes) = (st.files, human(st.bytes));
    criuz::say!("unpacked {files} files, {bytes} into {}, {secs:.2}s, {}", dir.display(), rate(st.bytes, secs));
    Ok(())
}

fn inspect(archive: &Path, json: bool, keys: &KeyArgs) -> Result<()> {
    keys.load()?;
    let rep = offline::inspect(input_location(archive)?.reader()?).with_context(|| archive.display().to_string())?;
    if json {
        return print::json(&rep, false);
    }
    print::inspect(&rep);
    Ok(())
}

fn verify(archive: &Path, parents: &ParentArgs, threads: &ThreadArgs, keys: &KeyArgs) -> Result<()> {
    keys.load()?;
    let how = OpenOptions { search: parents.search(), ..OpenOptions::default() };
    let inp = Reading::new(&input_location(archive)?, &how)?;
    let (files, bytes) = offline::verify(inp, &threads.options(), Progress::new("verify", None))?;
    out!("{}: OK, {} files, {} checked", archive.display(), files, human(bytes));
    Ok(())
}

fn dump(mut o: DumpOptions, criu: &CriuArgs, json: bool, write: &ArchiveArgs, absorb: &AbsorbArgs) -> Result<()> {
    let opts = checkpoint::with_absorb(write.options()?, absorb.absorb, &o.output);
    let c = criu.locate()?;
    let meter = Meter::new();
    o.meter = Some(meter.clone());
    let ticker = Ticker::start(move || meter.dump_line());
    let r = checkpoint::dump(&o, &opts, &c);
    drop(ticker);
    let r = r?;
    if json {
        // With the archive on stdout, the report goes to stderr.
        return print::json(&r, location(&o.output)?.is_stdout());
    }
    print::dump(o.pid, &r);
    Ok(())
}

fn restore(o: &RestoreOptions, how: How, json: bool, criu: &CriuArgs, threads: &ThreadArgs) -> Result<ExitCode> {
    let c = criu.locate()?;
    let meter = o.meter.clone().unwrap_or_default();
    // An eager restore's progress is the pages served or placed; a lazy one
    // reports its own stages.
    let ticker = (how != How::Lazy).then(|| Ticker::start(move || meter.restore_line()));
    if !o.detach {
        criuz::proc::interrupt::stand_in_once_restored();
    }
    let r = criuz::session::restore::restore(o, how, &threads.options(), &c);
    drop(ticker);
    let r = r?;
    // Whatever path the restore took, its tree runs: criuz stands in for it
    // from here (`interrupt`).
    if let (false, Some(root)) = (o.detach, r.pid()) {
        criuz::proc::interrupt::forward_to(root);
    }
    if let Restored::Placed(LazyReport { not_lazy: Some(why), .. })
    | Restored::Eager(RestoreReport { not_placed: Some(why), .. }) = &r
    {
        criuz::say!("criuz: {}: {why}", o.input);
    }
    if let Restored::Placed(LazyReport { copied_apart_bytes: copied @ 1.., .. }) = &r {
        criuz::say!(
            "criuz: {}: {} of private memory its processes shared copy-on-write placed as a copy in each (--fill \
             stream keeps it shared)",
            o.input,
            human(*copied)
        );
    }
    if let Restored::Placed(LazyReport { slow_huge_pages: Some(slow), .. }) = &r {
        criuz::say!(
            "criuz: {}: huge pages came at {:.2} GB/s a thread here, too slowly to wait for: {} placed in 4 KiB \
             pages instead (--no-huge-pages places none)",
            o.input,
            slow.bytes_per_second / 1e9,
            human(slow.small_page_bytes)
        );
    }
    if json {
        print::json(&r, false)?;
    } else {
        print::restored(&o.input, &r);
    }
    if o.detach {
        return Ok(ExitCode::SUCCESS);
    }
    // In the foreground: criuz exits as the tree's root does. It may wait
    // for days beside the tree, so it waits as a fresh image of itself
    // (same pid, so the root stays its child): the restore's worker threads
    // left their malloc arenas' free memory, which glibc's malloc_trim does
    // not return (a streamed 1 GiB restore's criuz held 41 MiB while it
    // waited, 8 MiB with one arena).
    let root = r.pid().ok_or_else(|| criuz::Error::Criu("CRIU wrote no pid for the restored tree".into()))?;
    if let Ok(exe) = std::env::current_exe() {
        // What the summary left buffered would be lost with the image.
        if let Some(e) = print::stdout_failure() {
            print::summary_lost(&e);
        }
        criuz::proc::interrupt::hold_through_exec();
        // Not `spawn::command`: the new image keeps the mask that holds
        // criuz's signals back, until it passes them on.
        #[allow(clippy::disallowed_methods)]
        let failed = std::process::Command::new(exe).args(["wait-tree", &root.to_string()]).exec();
        criuz::say!("criuz: waiting for the restored tree in place ({failed})");
    }
    wait_tree(root)
}

/// Waits for the restored tree's root, `root` (criuz's own child), and
/// exits as it did (`restore` without -d).
pub fn wait_tree(root: i32) -> Result<ExitCode> {
    Ok(ExitCode::from(criuz::proc::foreground::wait_for_root(root)?.exit_code()))
}

fn capture(dir: &Path, output: &Path, force: bool, write: &ArchiveArgs, absorb: &AbsorbArgs) -> Result<()> {
    let opts = checkpoint::with_absorb(write.options()?, absorb.absorb, output);
    let capture = standalone::Capture::bind(dir)?;
    criuz::say!("criuz: waiting for criu dump --stream -D {}", dir.display());
    let stats = capture.run(&location(output)?, force, &opts)?;
    criuz::say!("captured {} files: {}", stats.files, print::sizes(&stats));
    Ok(())
}

fn serve(dir: &Path, o: &RestoreOptions, threads: &ThreadArgs) -> Result<()> {
    let serve = standalone::Serve::bind(dir, o)?;
    criuz::say!("criuz: waiting for criu restore --stream -D {}", dir.display());
    let r = serve.run(o, threads.options().threads)?;
    let (served, missing) = (r.served.len(), r.missing.len());
    let skipped = r.zero_pages_skipped;
    criuz::say!(
        "served {served} files ({}), {missing} not in the archive, {skipped} zero pages left out",
        human(r.bytes)
    );
    Ok(())
}

/// `criuz check`: the findings, one a line (or as JSON); fails, after
/// them, where no dump or restore can run.
fn check(criu: &CriuArgs, json: bool) -> Result<()> {
    use criuz::session::check::{check_machine, CheckOptions, Verdict};
    let found = check_machine(&CheckOptions { criu: criu.criu.clone() })?;
    let failed = found.iter().filter(|f| f.verdict == Verdict::Fail).count();
    if json {
        out!("{}", serde_json::json!({ "ok": failed == 0, "findings": found }));
    } else {
        for f in &found {
            out!("{:<5} {:<13} {}", f.verdict.word(), f.topic, f.text);
        }
    }
    match failed {
        0 => Ok(()),
        n => Err(anyhow::anyhow!("this machine cannot dump or restore: {n} finding(s) marked fail")),
    }
}

fn keygen(output: &Path, force: bool) -> Result<()> {
    if output == Path::new("-") {
        // The identity is standard output's; the public key goes beside it.
        let public =
            criuz::seal::keyring::write_identity_to(&mut std::io::stdout().lock(), Path::new("standard output"))?;
        criuz::say!("criuz: public key: {public}");
        return Ok(());
    }
    let public = criuz::seal::keyring::write_identity(output, force)?;
    criuz::say!("criuz: wrote the identity to {} (keep it secret; it opens your archives)", output.display());
    out!("{public}");
    Ok(())
}

//! criuz command line: `args` turns flags into the library's option types,
//! `commands` makes one library call per command, `print` shows the result.
//! Every error ends as one line `criuz: ...` and an exit status by kind:
//! 1 the operation failed, 2 usage, 3 the archive is damaged, foreign or
//! unsupported (see `criuz::error::Kind`).

use clap::Parser;
use std::process::ExitCode;

mod args;
mod commands;
mod containers;
mod print;

fn main() -> ExitCode {
    // Blocks are 4 KiB..4 MiB buffers allocated and freed at a high rate on
    // several threads; with glibc's default threshold each one is a fresh
    // mmap (page faults, zeroing, munmap). Keeping them on the heap lets freed
    // blocks be reused. Measured on 2 cores against a build without these
    // two calls (docs/BENCHMARKS.md, session 76; 1 GiB, three rounds in
    // turn): durable LZ4 dumps 0.57-0.60 s against 0.63-0.72 s (mixed) and
    // 0.72-0.88 s against 0.81-1.05 s (random), bought with dump memory
    // (28-31 MiB against 24; random 109-120 against 90-95) and, on random,
    // frozen time (0.35-0.39 s against 0.27-0.31 s); zstd's dumps and every
    // restore alike. Kept for the durable time, which a dump that ends its
    // process is waited for by.
    // SAFETY: mallopt only tunes the allocator, before any other thread exists.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, 64 << 20);
        libc::mallopt(libc::M_TRIM_THRESHOLD, 256 << 20);
    }
    // Under an address-space limit (`ulimit -v`), each of glibc's
    // per-thread arenas reserves 64 MiB of it: a dump's dozen threads took
    // 400 MiB before its pipeline had any, and an allocation then failed
    // (an abort). A quarter of the space goes to arenas, at least one.
    if let Some(left) = criuz::proc::memory::address_space_left() {
        let arenas = (left / (256 << 20)).clamp(1, 64) as i32;
        // SAFETY: as above: before any other thread exists.
        unsafe { libc::mallopt(libc::M_ARENA_MAX, arenas) };
    }
    // Before any CRIU is started: it inherits the limit.
    criuz::io::open_files_limit();
    // So that a restore whose process is killed under CRIU can say whether
    // the OOM killer did it.
    criuz::proc::memory::note_oom_kills();
    // A Ctrl-C removes what criuz had not finished before it dies.
    criuz::proc::interrupt::install();
    // A panic (a thread the system would not start, or a bug) ends criuz
    // the same way, in one line, exit status 1.
    criuz::proc::interrupt::end_on_panic();
    let cli = args::Cli::parse();
    let reports = cli.cmd.reports_on_stdout();
    let done =
        criuz::proc::memory::check_address_space().map_err(anyhow::Error::from).and_then(|()| commands::run(cli));
    // A report that never reached its reader (`inspect F > full/disk/f`)
    // is a failure; a dump's or restore's summary is not worth failing work
    // that is done (the process ended, the tree running) for.
    let done = done.and_then(|code| match print::stdout_failure() {
        Some(e) if reports => Err(anyhow::anyhow!("standard output: {e}")),
        Some(e) => {
            print::summary_lost(&e);
            Ok(code)
        }
        None => Ok(code),
    });
    criuz::proc::interrupt::wait_for_interruption();
    match done {
        Ok(code) => code,
        Err(e) => {
            criuz::say!("criuz: {}{}", one_line(&format!("{e:#}")), remedy(&e));
            ExitCode::from(exit_code(&e))
        }
    }
}

/// The error as one line, whatever it quotes: a file name, or text from CRIU,
/// may hold a newline or another control character, and a supervisor reads
/// criuz's error as one line. Those characters are written escaped (`\n`,
/// `\u{1b}`), as Rust writes them in a string literal.
fn one_line(text: &str) -> String {
    text.chars().fold(String::with_capacity(text.len()), |mut line, c| {
        if c.is_control() {
            line.extend(c.escape_default());
        } else {
            line.push(c);
        }
        line
    })
}

/// What to do, where an error's cause is a limit of the user's to raise.
fn remedy(e: &anyhow::Error) -> String {
    let err = e.chain().find_map(|c| c.downcast_ref::<criuz::Error>());
    match err.and_then(criuz::Error::raw_os_error) {
        Some(libc::EMFILE) => " (criuz and CRIU need more open files than `ulimit -n` allows: raise it)".into(),
        Some(libc::ENFILE) => " (the system's open files limit, fs.file-max, is reached)".into(),
        Some(libc::EFBIG) => " (larger than the file-size limit, `ulimit -f`, or its file system allows)".into(),
        // A work directory's file: the user's outputs are named as such,
        // and the fix for this one is where $TMPDIR points.
        Some(libc::ENOSPC | libc::EDQUOT) => match err.map(criuz::Error::root) {
            Some(criuz::Error::File { path, .. }) if path.starts_with(criuz::io::temp_root()) => format!(
                " (criuz works in $TMPDIR, {}: point TMPDIR at a file system with room)",
                criuz::io::temp_root().display()
            ),
            _ => String::new(),
        },
        _ => String::new(),
    }
}

/// The exit status for an error: by the kind of the library error behind it
/// (contexts added here do not change it); 1 for anything else.
fn exit_code(e: &anyhow::Error) -> u8 {
    e.chain().find_map(|c| c.downcast_ref::<criuz::Error>()).map_or(1, |e| e.kind().exit_code() as u8)
}

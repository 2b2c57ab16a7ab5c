//! Pipelines of commands (`a | b | c`) as the bench times them: summed CPU
//! and largest peak memory from wait4, each command's errors in a file of
//! its own, and a rate-limited relay standing in for a network link.

use super::{alive, describe_status, is_ours, wait4, Usage};
use crate::error::{Error, Result};
use std::fs::File;
use std::io::{self, Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// Copies `src` to `dst`, at most `rate` bytes per second when given (a token
/// bucket with a 256 KiB burst), as a network link or object store would.
pub fn relay(src: &mut dyn Read, dst: &mut dyn Write, rate: Option<u64>) -> io::Result<u64> {
    const BURST: u64 = 256 << 10;
    let mut buf = vec![0u8; 64 << 10];
    let start = Instant::now();
    let mut sent = 0u64;
    loop {
        let n = match src.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        };
        if let Some(r) = rate.filter(|r| *r > 0) {
            let due = (sent + n as u64).saturating_sub(BURST) as f64 / r as f64;
            let now = start.elapsed().as_secs_f64();
            if due > now {
                std::thread::sleep(Duration::from_secs_f64(due - now));
            }
        }
        dst.write_all(&buf[..n])?;
        sent += n as u64;
    }
    dst.flush()?;
    Ok(sent)
}

/// Standard input of a pipeline's first command.
pub enum Src {
    Null,
    File(PathBuf),
    /// The file, read back through the rate limit.
    Link(PathBuf, Option<u64>),
}

/// Standard output of a pipeline's last command.
pub enum Dst {
    Null,
    File(PathBuf),
    /// Through the rate limit into the file.
    Link(PathBuf, Option<u64>),
    Capture,
}

pub struct Finished {
    pub stdout: Vec<u8>,
    pub usage: Usage,
}

fn tail(path: &Path, lines: usize) -> String {
    let s = std::fs::read_to_string(path).unwrap_or_default();
    let v: Vec<&str> = s.lines().filter(|l| !l.trim().is_empty()).collect();
    v[v.len().saturating_sub(lines)..].join(" | ")
}

fn label(cmd: &Command) -> String {
    let prog = Path::new(cmd.get_program()).file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    let first = cmd.get_args().next().map(|a| a.to_string_lossy().into_owned()).unwrap_or_default();
    if first.starts_with('-') || first.is_empty() {
        prog
    } else {
        format!("{prog} {first}")
    }
}

/// Longest a step of a checkpoint or restore may take.
const STEP_TIMEOUT: Duration = Duration::from_secs(30 * 60);

/// Runs `cmds` as a shell pipeline (`a | b | c`), waits for all of them and
/// returns their summed CPU and largest peak RSS. Each command's standard
/// error goes to a file in `logs`; a failing command's error names it with
/// the tail of that file.
pub fn pipeline(cmds: Vec<Command>, src: Src, dst: Dst, logs: &Path, step: &str) -> Result<Finished> {
    let n = cmds.len();
    let mut pids: Vec<(i32, String, PathBuf)> = Vec::new();
    let mut prev_out: Option<std::process::ChildStdout> = None;
    let mut feeder: Option<(PathBuf, Option<u64>, std::process::ChildStdin)> = None;
    let mut drain: Option<std::process::ChildStdout> = None;
    let mut spawn_err = None;
    for (i, mut cmd) in cmds.into_iter().enumerate() {
        let name = label(&cmd);
        let err_path = logs.join(format!("{step}-{i}.stderr"));
        let stderr = match File::create(&err_path) {
            Ok(f) => Stdio::from(f),
            Err(_) => Stdio::null(),
        };
        cmd.stderr(stderr);
        let mut link_in = None;
        if i == 0 {
            match &src {
                Src::Null => {
                    cmd.stdin(Stdio::null());
                }
                Src::File(p) => match File::open(p) {
                    Ok(f) => {
                        cmd.stdin(Stdio::from(f));
                    }
                    Err(e) => {
                        spawn_err = Some(Error::file(p, e));
                        break;
                    }
                },
                Src::Link(p, rate) => {
                    cmd.stdin(Stdio::piped());
                    link_in = Some((p.clone(), *rate));
                }
            }
        } else if let Some(o) = prev_out.take() {
            cmd.stdin(Stdio::from(o));
        }
        if i + 1 < n {
            cmd.stdout(Stdio::piped());
        } else {
            match &dst {
                Dst::Null => {
                    cmd.stdout(Stdio::null());
                }
                Dst::File(p) => match File::create(p) {
                    Ok(f) => {
                        cmd.stdout(Stdio::from(f));
                    }
                    Err(e) => {
                        spawn_err = Some(Error::file(p, e));
                        break;
                    }
                },
                Dst::Link(..) | Dst::Capture => {
                    cmd.stdout(Stdio::piped());
                }
            }
        }
        match cmd.spawn() {
            Ok(mut child) => {
                pids.push((child.id() as i32, name, err_path));
                if let (Some((p, r)), Some(stdin)) = (link_in, child.stdin.take()) {
                    feeder = Some((p, r, stdin));
                }
                if i + 1 < n {
                    prev_out = child.stdout.take();
                } else {
                    drain = child.stdout.take();
                }
            }
            Err(e) => {
                spawn_err = Some(Error::Invalid(format!("cannot run {name}: {e}")));
                break;
            }
        }
        // The Command (and with it our copies of the pipe ends) drops here,
        // so a command that dies gives its neighbours EOF or EPIPE.
    }
    drop(prev_out);
    if let Some(e) = spawn_err {
        drop(feeder);
        drop(drain);
        for (pid, ..) in &pids {
            // SAFETY: a command we just spawned.
            unsafe { libc::kill(*pid, libc::SIGKILL) };
            let _ = wait4(*pid, false);
        }
        return Err(e);
    }

    let feed = feeder.map(|(path, rate, mut stdin)| {
        std::thread::spawn(move || -> io::Result<u64> {
            let mut f = File::open(&path)?;
            relay(&mut f, &mut stdin, rate)
        })
    });
    let link_out = match &dst {
        Dst::Link(p, r) => Some((p.clone(), *r)),
        _ => None,
    };
    let capture = matches!(dst, Dst::Capture);
    let out = drain.map(|mut stdout| {
        std::thread::spawn(move || -> io::Result<Vec<u8>> {
            if let Some((path, rate)) = link_out {
                let mut f = File::create(&path)?;
                relay(&mut stdout, &mut f, rate)?;
                Ok(Vec::new())
            } else {
                let mut v = Vec::new();
                stdout.read_to_end(&mut v)?;
                Ok(if capture { v } else { Vec::new() })
            }
        })
    });

    // A hung command (CRIU waiting on something that never comes) must not
    // hang the whole bench.
    let (done, finished) = std::sync::mpsc::channel::<()>();
    let watched: Vec<i32> = pids.iter().map(|p| p.0).collect();
    let watchdog = std::thread::spawn(move || {
        if finished.recv_timeout(STEP_TIMEOUT) == Err(std::sync::mpsc::RecvTimeoutError::Timeout) {
            for p in watched {
                if alive(p) && is_ours(p) {
                    // SAFETY: a command of this pipeline, not yet reaped.
                    unsafe { libc::kill(p, libc::SIGKILL) };
                }
            }
            return true;
        }
        false
    });

    let mut usage = Usage::default();
    let mut failures = Vec::new();
    for (pid, name, err_path) in &pids {
        match wait4(*pid, false) {
            Ok(Some((status, u))) => {
                usage.add(u);
                if !(libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0) {
                    failures.push(format!("{name}: {}: {}", describe_status(status), tail(err_path, 4)));
                }
            }
            Ok(None) => failures.push(format!("{name}: lost")),
            Err(e) => failures.push(format!("{name}: wait: {e}")),
        }
    }
    let _ = done.send(());
    if watchdog.join().unwrap_or(false) {
        failures.insert(0, format!("{step}: still running after {STEP_TIMEOUT:?}, killed"));
    }
    let fed = feed.map(|h| h.join().unwrap_or_else(|_| Err(io::Error::other("relay thread panicked"))));
    let drained = out.map(|h| h.join().unwrap_or_else(|_| Err(io::Error::other("relay thread panicked"))));
    if !failures.is_empty() {
        return Err(Error::Invalid(failures.join("; ")));
    }
    if let Some(Err(e)) = fed {
        return Err(Error::Invalid(format!("{step}: feeding input: {e}")));
    }
    let stdout = match drained {
        Some(Ok(v)) => v,
        Some(Err(e)) => return Err(Error::Invalid(format!("{step}: writing output: {e}"))),
        None => Vec::new(),
    };
    Ok(Finished { stdout, usage })
}

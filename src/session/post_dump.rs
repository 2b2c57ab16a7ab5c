//! CRIU's post-dump hook, for dumps whose tree only CRIU can hand back
//! whole after a failure.
//!
//! A dump ends with the tree stopped (`--leave-stopped`); criuz kills it
//! once the archive is durable, or resumes it (SIGCONT) should the archive
//! fail after CRIU finished. That resume cannot undo what CRIU leaves in
//! place for a restore: with `--tcp-established` the tree's connections
//! stay in repair mode behind CRIU's network lock (the resumed process got
//! "permission denied" on them), with `--link-remap` the links CRIU made
//! for deleted files stay. For such dumps criuz answers CRIU's post-dump
//! action script instead: CRIU runs it with every image written and the
//! tree still frozen, and waits while criuz writes and commits the
//! archive. A failure fails the script, and CRIU rolls back as after any
//! failed dump (connections unlocked, links removed, each process resumed
//! as it was). The price: such a tree stays frozen until its archive is
//! durable, not only while CRIU writes.
//!
//! The script is a two-line shell file in the dump's private work
//! directory that runs `criuz dump-hook SOCKET`: CRIU runs action scripts
//! by path, without arguments. The hook connects to criuz's socket there;
//! a criuz that is gone (no listener, or a connection that closes) counts
//! as a failure, so CRIU rolls back rather than wait for ever.

use crate::criu::options::CriuOptions;
use crate::criu::streamer::Listener;
use crate::error::{Error, IoContext, Result};
use std::io::{BufRead, BufReader, Write};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicBool;

/// CRIU options after which only CRIU's own rollback hands a tree back
/// whole (see the module doc).
const CRIU_ROLLS_BACK: [&str; 2] = ["tcp-established", "link-remap"];

/// What the hook sends when CRIU runs it, and what criuz answers.
const ASKED: &str = "post-dump";
const WRITTEN: &str = "written";
const FAILED: &str = "failed";

/// Whether a dump with these CRIU options (given after `--` or in CRIU's
/// config files; and not left running, which CRIU rolls back itself)
/// needs the hook.
pub fn needed(options: &CriuOptions) -> bool {
    CRIU_ROLLS_BACK.iter().any(|name| options.is_set(name))
}

/// The hook's socket in the work directory.
const SOCKET: &str = "post-dump.sock";

/// criuz's end: the socket the hook connects to, and the script CRIU runs.
pub struct PostDumpHook {
    listener: Listener,
    script: PathBuf,
}

impl PostDumpHook {
    /// Makes the socket and the script in `work` (the dump's private work
    /// directory, removed with it).
    pub fn bind(work: &Path) -> Result<Self> {
        let listener = Listener::bind(work, SOCKET)?;
        let exe = std::env::current_exe()?;
        let script = work.join("post-dump.sh");
        let text = format!("#!/bin/sh\nexec {} dump-hook {}\n", quoted(&exe), quoted(listener.path()));
        std::fs::write(&script, text).at(&script)?;
        std::fs::set_permissions(&script, std::fs::Permissions::from_mode(0o700)).at(&script)?;
        Ok(PostDumpHook { listener, script })
    }

    /// The action script to give CRIU (`--action-script`).
    pub fn script(&self) -> &Path {
        &self.script
    }

    /// Waits until CRIU runs the hook (every image written, the tree still
    /// frozen); `None` once `criu_ended` is set first (CRIU failed before).
    pub fn wait_asked(&self, criu_ended: &AtomicBool) -> Result<Option<Asked>> {
        let Some(conn) = self.listener.accept(criu_ended)? else { return Ok(None) };
        let mut line = String::new();
        BufReader::new(&conn).read_line(&mut line)?;
        if line.trim() != ASKED {
            return Err(Error::Criu(format!("CRIU's post-dump hook said {:?}", line.trim())));
        }
        Ok(Some(Asked(conn)))
    }
}

/// CRIU waiting at its post-dump hook.
pub struct Asked(UnixStream);

impl Asked {
    /// Lets CRIU go on: to end the tree (`written`), or to roll back.
    pub fn answer(mut self, written: bool) {
        let _ = writeln!(self.0, "{}", if written { WRITTEN } else { FAILED });
    }
}

/// The hook itself (`criuz dump-hook SOCKET`, run by CRIU for every action
/// of the dump, named by `$CRTOOLS_SCRIPT_ACTION`): for the post-dump
/// action, waits for criuz's answer; its exit status, 0 to let CRIU end the
/// tree.
pub fn run_hook(action: &str, socket: &Path) -> i32 {
    if action != ASKED {
        return 0;
    }
    let answer = || -> std::io::Result<String> {
        let mut conn = UnixStream::connect(socket)?;
        writeln!(conn, "{ASKED}")?;
        let mut line = String::new();
        BufReader::new(&conn).read_line(&mut line)?;
        Ok(line)
    };
    match answer() {
        Ok(line) if line.trim() == WRITTEN => 0,
        _ => 1,
    }
}

/// `path` as one word for sh.
fn quoted(path: &Path) -> String {
    format!("'{}'", path.to_string_lossy().replace('\'', r"'\''"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_options_criu_alone_undoes_need_the_hook() {
        // Without the machine's config files.
        let args = |a: &[&str]| {
            let words: Vec<String> = ["--no-default-config"].iter().chain(a).map(|s| s.to_string()).collect();
            CriuOptions::read(&words)
        };
        assert!(needed(&args(&["--tcp-established"])));
        assert!(needed(&args(&["--ext-unix-sk", "--link-remap"])));
        assert!(!needed(&args(&["--ext-unix-sk"])));
        assert!(!needed(&args(&["--tcp-established", "--no-tcp-established"])));
        assert_eq!(quoted(Path::new("/a b/it's")), r"'/a b/it'\''s'");
    }

    #[test]
    fn the_hook_says_what_criuz_answered_and_fails_without_criuz() {
        let dir = tempfile::tempdir().unwrap();
        let hook = PostDumpHook::bind(dir.path()).unwrap();
        let socket = hook.listener.path().to_path_buf();
        let script = std::fs::read_to_string(hook.script()).unwrap();
        assert!(script.contains("dump-hook") && script.contains("post-dump.sock"), "{script}");
        assert_eq!(run_hook("network-lock", &socket), 0, "other actions pass");
        for written in [true, false] {
            let s = socket.clone();
            let t = std::thread::spawn(move || run_hook(ASKED, &s));
            hook.wait_asked(&AtomicBool::new(false)).unwrap().expect("asked").answer(written);
            assert_eq!(t.join().unwrap(), if written { 0 } else { 1 });
        }
        // criuz gone: nothing listens (its socket removed with it).
        drop(hook);
        assert_eq!(run_hook(ASKED, &socket), 1);
    }
}

//! CRIU's action scripts, where CRIU must wait for criuz before it goes on.
//!
//! **post-dump**, for dumps whose tree only CRIU can hand back whole after
//! a failure. A dump ends with the tree stopped (`--leave-stopped`); criuz
//! kills it once the archive is durable, or resumes it (SIGCONT) should the
//! archive fail after CRIU finished. That resume cannot undo what CRIU
//! leaves in place for a restore: with `--tcp-established` the tree's
//! connections stay in repair mode behind CRIU's network lock (the resumed
//! process got "permission denied" on them), with `--link-remap` the links
//! CRIU made for deleted files stay. For such dumps criuz answers CRIU's
//! post-dump hook instead: CRIU runs it with every image written and the
//! tree still frozen, and waits while criuz writes and commits the
//! archive. A failure fails the script, and CRIU rolls back as after any
//! failed dump (connections unlocked, links removed, each process resumed
//! as it was). The price: such a tree stays frozen until its archive is
//! durable, not only while CRIU writes.
//!
//! **pre-resume**, for a container's lazy restore. runc's CRIU cannot leave
//! a tree stopped for criuz, as a bare restore's does (`--leave-stopped`),
//! and a container that runs before criuz has registered its shared memory
//! in every process would read zeros there. CRIU runs this hook with every
//! process restored, stopped, and handed over to criuz; the tree runs once
//! criuz answers. CRIU resumes a tree whose pre-resume script failed (it
//! only logs it), so a hook criuz does not tell to go kills the tree
//! itself before it exits (criuz killed, or its restore failed).
//!
//! The script is a short shell file in the command's private work
//! directory that runs `criuz criu-hook ACTION SOCKET` at its action: CRIU
//! runs action scripts by path, without arguments, for every action. Where
//! that directory's file system runs no programs (a `/dev/shm` mounted
//! `noexec`), the scripts go to a private directory of their own in
//! `$TMPDIR`. runc gives its CRIU no options of criuz's: it runs a wrapper
//! beside the script ([`ActionHook::criu_wrapper`]) that adds
//! `--action-script`, which CRIU's RPC mode runs beside runc's own
//! notifications. The hook connects to
//! criuz's socket there; a criuz that is gone (no listener, or a
//! connection that closes) counts as a failure, so CRIU rolls back (or the
//! tree dies) rather than wait for ever.

use crate::criu::options::CriuOptions;
use crate::criu::streamer::Listener;
use crate::error::{Error, IoContext, Result};
use crate::session::workdir::WorkDir;
use std::io::{BufRead, BufReader, Write};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicBool;

/// CRIU options after which only CRIU's own rollback hands a tree back
/// whole (see the module doc).
const CRIU_ROLLS_BACK: [&str; 2] = ["tcp-established", "link-remap"];

/// What criuz answers the hook: CRIU may go on (the archive is durable, or
/// the tree may run). Anything else, or nothing, fails it.
const GO: &str = "go";
const FAILED: &str = "failed";

/// Whether a dump with these CRIU options (given after `--` or in CRIU's
/// config files; and not left running, which CRIU rolls back itself)
/// needs the post-dump hook.
pub fn needed(options: &CriuOptions) -> bool {
    CRIU_ROLLS_BACK.iter().any(|name| options.is_set(name))
}

/// The action at which CRIU waits for criuz.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum At {
    /// A dump's images all written, its tree still frozen.
    PostDump,
    /// A restored tree stopped, about to run.
    PreResume,
}

impl At {
    /// CRIU's name for it (`$CRTOOLS_SCRIPT_ACTION`).
    pub fn name(self) -> &'static str {
        match self {
            At::PostDump => "post-dump",
            At::PreResume => "pre-resume",
        }
    }

    /// The action CRIU names `name`, among those criuz waits at.
    pub fn named(name: &str) -> Option<At> {
        [At::PostDump, At::PreResume].into_iter().find(|a| a.name() == name)
    }
}

/// criuz's end: the socket the hook connects to, and the script CRIU runs.
pub struct ActionHook {
    at: At,
    listener: Listener,
    script: PathBuf,
    /// Where the scripts are when not in the work directory (see the
    /// module doc), removed with the hook.
    _scripts_dir: Option<WorkDir>,
}

impl ActionHook {
    /// Makes the socket and the script in `work` (the command's private
    /// work directory, removed with it).
    pub fn bind(work: &Path, at: At) -> Result<Self> {
        let listener = Listener::bind(work, &format!("{}.sock", at.name()))?;
        let exe = std::env::current_exe()?;
        let scripts_dir = scripts_dir(work)?;
        let script = scripts_dir.as_ref().map_or(work, |d| d.path()).join(format!("{}.sh", at.name()));
        // CRIU runs it at each of its actions (seven in a container's
        // restore): sh alone passes the others, not criuz's start each time
        // (it cost a container's lazy start 0.03 s).
        let text = format!(
            "#!/bin/sh\n[ \"$CRTOOLS_SCRIPT_ACTION\" = {name} ] || exit 0\nexec {} criu-hook {name} {}\n",
            quoted(&exe),
            quoted(listener.path()),
            name = at.name()
        );
        executable(&script, &text)?;
        Ok(ActionHook { at, listener, script, _scripts_dir: scripts_dir })
    }

    /// The action script to give CRIU (`--action-script`).
    pub fn script(&self) -> &Path {
        &self.script
    }

    /// A program beside the script that runs `criu` with this hook as an
    /// action script, for a caller that runs CRIU itself (`runc --criu`).
    pub fn criu_wrapper(&self, criu: &Path) -> Result<PathBuf> {
        let path = self.script.with_file_name("criu");
        let text = format!("#!/bin/sh\nexec {} --action-script {} \"$@\"\n", quoted(criu), quoted(&self.script));
        executable(&path, &text)?;
        Ok(path)
    }

    /// Waits until CRIU runs the hook at its action; `None` once
    /// `criu_ended` is set first (CRIU failed before, or never runs it).
    pub fn wait_asked(&self, criu_ended: &AtomicBool) -> Result<Option<Asked>> {
        let Some(conn) = self.listener.accept(criu_ended)? else { return Ok(None) };
        let mut line = String::new();
        BufReader::new(&conn).read_line(&mut line)?;
        if line.trim() != self.at.name() {
            return Err(Error::Criu(format!("CRIU's {} hook said {:?}", self.at.name(), line.trim())));
        }
        Ok(Some(Asked(conn)))
    }
}

/// Where the scripts go: `work` (None), or, where its file system runs no
/// programs, a private directory in `$TMPDIR`.
fn scripts_dir(work: &Path) -> Result<Option<WorkDir>> {
    if crate::io::runs_programs(work) {
        return Ok(None);
    }
    let dir = WorkDir::new("criuz-hook-")?;
    if crate::io::runs_programs(dir.path()) {
        return Ok(Some(dir));
    }
    Err(Error::Usage(format!(
        "criuz runs CRIU's action script from a private directory, but {} and {} are on file systems mounted \
         noexec: set TMPDIR to a directory programs may run from",
        work.display(),
        dir.path().parent().unwrap_or(dir.path()).display()
    )))
}

/// Writes `text` to `path`, executable by its owner only.
fn executable(path: &Path, text: &str) -> Result<()> {
    std::fs::write(path, text).at(path)?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o700)).at(path)
}

/// CRIU waiting at its hook.
pub struct Asked(UnixStream);

impl Asked {
    /// Lets CRIU go on (`go`: to end the dumped tree, or to let the
    /// restored one run), or fails the hook.
    pub fn answer(mut self, go: bool) {
        let _ = writeln!(self.0, "{}", if go { GO } else { FAILED });
    }
}

/// The hook itself (`criuz criu-hook ACTION SOCKET`, run by CRIU for every
/// action, the one now named by `$CRTOOLS_SCRIPT_ACTION`): at `at`, waits
/// for criuz's answer; its exit status, 0 to let CRIU go on. A pre-resume
/// hook not told to go kills the restored tree (`init_pid`, CRIU's
/// `$CRTOOLS_INIT_PID`, and its descendants) first: CRIU would let it run.
pub fn run_hook(action: &str, at: At, socket: &Path, init_pid: Option<i32>) -> i32 {
    if action != at.name() {
        return 0;
    }
    let answer = || -> std::io::Result<String> {
        let mut conn = UnixStream::connect(socket)?;
        writeln!(conn, "{}", at.name())?;
        let mut line = String::new();
        BufReader::new(&conn).read_line(&mut line)?;
        Ok(line)
    };
    match answer() {
        Ok(line) if line.trim() == GO => 0,
        _ => {
            if let Some(root) = init_pid.filter(|&p| at == At::PreResume && p > 1) {
                // Stopped by CRIU (traced) until the hook returns: nothing
                // of it forks or runs meanwhile.
                crate::proc::tree::kill_tree(&[root]);
            }
            1
        }
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
        let hook = ActionHook::bind(dir.path(), At::PostDump).unwrap();
        let socket = hook.listener.path().to_path_buf();
        let script = std::fs::read_to_string(hook.script()).unwrap();
        assert!(script.contains("criu-hook post-dump") && script.contains("post-dump.sock"), "{script}");
        assert_eq!(run_hook("network-lock", At::PostDump, &socket, None), 0, "other actions pass");
        // The script passes other actions itself, without starting criuz
        // (here the test binary, which would take its arguments for filters).
        let other = std::process::Command::new(hook.script()).env("CRTOOLS_SCRIPT_ACTION", "network-lock").output();
        assert_eq!(other.unwrap().status.code(), Some(0));
        for go in [true, false] {
            let s = socket.clone();
            let t = std::thread::spawn(move || run_hook("post-dump", At::PostDump, &s, None));
            hook.wait_asked(&AtomicBool::new(false)).unwrap().expect("asked").answer(go);
            assert_eq!(t.join().unwrap(), if go { 0 } else { 1 });
        }
        // criuz gone: nothing listens (its socket removed with it).
        drop(hook);
        assert_eq!(run_hook("post-dump", At::PostDump, &socket, None), 1);
        assert_eq!(At::named("pre-resume"), Some(At::PreResume));
        assert_eq!(At::named("post-restore"), None);
    }

    #[test]
    fn a_pre_resume_hook_not_told_to_go_kills_the_tree_and_the_wrapper_adds_it() {
        let dir = tempfile::tempdir().unwrap();
        let hook = ActionHook::bind(dir.path(), At::PreResume).unwrap();
        let socket = hook.listener.path().to_path_buf();
        let mut tree = std::process::Command::new("sleep").arg("60").spawn().unwrap();
        let root = tree.id() as i32;
        let s = socket.clone();
        let t = std::thread::spawn(move || run_hook("pre-resume", At::PreResume, &s, Some(root)));
        hook.wait_asked(&AtomicBool::new(false)).unwrap().expect("asked").answer(false);
        assert_eq!(t.join().unwrap(), 1);
        use std::os::unix::process::ExitStatusExt;
        assert_eq!(tree.wait().unwrap().signal(), Some(libc::SIGKILL), "the tree is killed before CRIU resumes it");
        // Told to go, it leaves the tree alone.
        let mut tree = std::process::Command::new("sleep").arg("60").spawn().unwrap();
        let root = tree.id() as i32;
        let t = std::thread::spawn(move || run_hook("pre-resume", At::PreResume, &socket, Some(root)));
        hook.wait_asked(&AtomicBool::new(false)).unwrap().expect("asked").answer(true);
        assert_eq!(t.join().unwrap(), 0);
        assert!(tree.try_wait().unwrap().is_none(), "the tree runs on");
        tree.kill().unwrap();
        tree.wait().unwrap();
        // CRIU behind the wrapper gets the hook first, then runc's arguments.
        let wrapper = hook.criu_wrapper(Path::new("/bin/echo")).unwrap();
        let out = std::process::Command::new(&wrapper).args(["swrk", "3"]).output().unwrap();
        let said = String::from_utf8(out.stdout).unwrap();
        assert_eq!(said.trim(), format!("--action-script {} swrk 3", hook.script().display()));
        assert_eq!(wrapper.parent(), Some(dir.path()));
    }

    /// A work directory on a file system mounted `noexec` (a hardened
    /// `/dev/shm`): the scripts go where they can run (CRIU failed to run
    /// them, and runc its CRIU, "permission denied").
    #[test]
    fn the_scripts_run_from_a_work_directory_mounted_noexec() {
        let dir = tempfile::tempdir().unwrap();
        let mount = std::process::Command::new("mount")
            .args(["-t", "tmpfs", "-o", "noexec,size=1m", "criuz-test"])
            .arg(dir.path())
            .status()
            .unwrap();
        assert!(mount.success(), "mount a noexec tmpfs (the tests run as root)");
        assert!(!crate::io::runs_programs(dir.path()));
        let ran = std::panic::catch_unwind(|| {
            let hook = ActionHook::bind(dir.path(), At::PreResume).unwrap();
            assert!(!hook.script().starts_with(dir.path()), "{}", hook.script().display());
            assert!(hook.listener.path().starts_with(dir.path()));
            let other = std::process::Command::new(hook.script()).env("CRTOOLS_SCRIPT_ACTION", "post-restore").output();
            assert_eq!(other.unwrap().status.code(), Some(0));
            let wrapper = hook.criu_wrapper(Path::new("/bin/true")).unwrap();
            assert!(std::process::Command::new(&wrapper).status().unwrap().success());
            let scripts = hook.script().parent().unwrap().to_path_buf();
            drop(hook);
            assert!(!scripts.exists(), "removed with the hook");
        });
        let _ = std::process::Command::new("umount").arg(dir.path()).status();
        ran.unwrap();
    }
}

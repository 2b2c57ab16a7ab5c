//! The paths the campaign attacks, and for each one trial: set up, run with
//! the fault, judge what the fault left, then run the same operation again
//! without a fault (the retry a user makes) and judge that too: it must
//! succeed, restore intact, and leave nothing behind.
//!
//! A dump-side trial checkpoints a fresh workload: afterwards the process
//! must run with its own checksum unchanged, or the archive must be
//! complete and restore it intact. A restore-side trial restores a
//! prepared archive (its process gone): afterwards the restored process
//! runs with its checksum intact, or there is none.

use super::check::{self, Settled};
use super::inject::{self, Fault, Op, Outcome, S3};
use crate::containers::Bundle;
use crate::error::{Error, Result};
use crate::proc::Tmpfs;
use crate::s3;
use crate::workload::{Running, Tools};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

mod dump;
mod offline;
mod restore;
mod runc;

/// One path through criuz.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Route {
    DumpFile,
    /// A dump of shared memory only the tree reaches (`shared-cache`),
    /// held by reference as the tree's private memory is.
    DumpShared,
    DumpPipe,
    DumpS3,
    DumpChild,
    DumpTcp,
    DumpPageServer,
    DumpPageServerTcp,
    DumpRunning,
    DumpEncrypted,
    RuncCheckpoint,
    Pack,
    Unpack,
    Flatten,
    RestoreFile,
    RestoreShared,
    RestoreSharedLazy,
    RestoreLazy,
    RestorePipe,
    RestoreS3,
    RestoreChain,
    RestoreStream,
    RestoreVerifyFirst,
    RestoreForeground,
    RestoreEncrypted,
    /// A placed restore of memory that was transparent huge pages (`thp`),
    /// written without its userfaultfd while the tree is held.
    RestoreHuge,
    RuncRestore,
    /// A container whose memory is shared (`shared-cache`): its lazy
    /// restore holds it at CRIU's pre-resume hook.
    RuncRestoreShared,
}

pub const ROUTES: &[Route] = &[
    Route::DumpFile,
    Route::DumpShared,
    Route::DumpPipe,
    Route::DumpS3,
    Route::DumpChild,
    Route::DumpTcp,
    Route::DumpPageServer,
    Route::DumpPageServerTcp,
    Route::DumpRunning,
    Route::DumpEncrypted,
    Route::RuncCheckpoint,
    Route::Pack,
    Route::Unpack,
    Route::Flatten,
    Route::RestoreFile,
    Route::RestoreShared,
    Route::RestoreSharedLazy,
    Route::RestoreLazy,
    Route::RestorePipe,
    Route::RestoreS3,
    Route::RestoreChain,
    Route::RestoreStream,
    Route::RestoreVerifyFirst,
    Route::RestoreForeground,
    Route::RestoreEncrypted,
    Route::RestoreHuge,
    Route::RuncRestore,
    Route::RuncRestoreShared,
];

impl Route {
    pub fn name(self) -> &'static str {
        match self {
            Route::DumpFile => "dump-file",
            Route::DumpShared => "dump-shared",
            Route::DumpPipe => "dump-pipe",
            Route::DumpS3 => "dump-s3",
            Route::DumpChild => "dump-incremental",
            Route::DumpTcp => "dump-tcp",
            Route::DumpPageServer => "dump-page-server",
            Route::DumpPageServerTcp => "dump-page-server-tcp",
            Route::DumpRunning => "dump-leave-running",
            Route::DumpEncrypted => "dump-encrypted",
            Route::RuncCheckpoint => "runc-checkpoint",
            Route::Pack => "pack",
            Route::Unpack => "unpack",
            Route::Flatten => "flatten",
            Route::RestoreFile => "restore-file",
            Route::RestoreShared => "restore-shared",
            Route::RestoreSharedLazy => "restore-shared-lazy",
            Route::RestoreLazy => "restore-lazy",
            Route::RestorePipe => "restore-pipe",
            Route::RestoreS3 => "restore-s3",
            Route::RestoreChain => "restore-chain",
            Route::RestoreStream => "restore-stream",
            Route::RestoreVerifyFirst => "restore-verify-first",
            Route::RestoreForeground => "restore-foreground",
            Route::RestoreEncrypted => "restore-encrypted",
            Route::RestoreHuge => "restore-huge-pages",
            Route::RuncRestore => "runc-restore",
            Route::RuncRestoreShared => "runc-restore-shared",
        }
    }

    /// The faults that mean something on this path.
    pub fn faults(self) -> &'static [Fault] {
        use Fault::*;
        match self {
            Route::DumpFile
            | Route::DumpShared
            | Route::DumpChild
            | Route::DumpPageServer
            | Route::DumpRunning
            | Route::DumpEncrypted => &[KillCriuz, KillCriu, Enospc, InterruptCriuz],
            Route::DumpPipe => &[KillCriuz, KillCriu, PeerDies, InterruptCriuz],
            Route::DumpS3 => &[KillCriuz, KillCriu, KillS3, InterruptCriuz],
            // A killed CRIU leaves the connections it locked for the
            // restore locked, as `criu dump` alone does: only CRIU's own
            // rollback frees them, so only faults that let it roll back.
            Route::DumpTcp | Route::DumpPageServerTcp => &[KillCriuz, Enospc, InterruptCriuz],
            Route::RuncCheckpoint => &[KillCriuz, KillCriu, Enospc, InterruptCriuz],
            Route::Pack | Route::Unpack | Route::Flatten => &[KillCriuz, Enospc, InterruptCriuz],
            // A tree continued from outside mid-fill runs intact (its
            // reads wait on the userfaultfd) or, where memory is written
            // without one, is killed: first where that matters.
            Route::RestoreHuge => &[ContinueTree, KillCriuz, KillCriu, InterruptCriuz],
            Route::RestoreFile | Route::RestoreLazy | Route::RestoreStream => {
                &[KillCriuz, KillCriu, InterruptCriuz, ContinueTree]
            }
            Route::RestoreShared
            | Route::RestoreSharedLazy
            | Route::RestoreChain
            | Route::RestoreVerifyFirst
            | Route::RestoreForeground
            | Route::RestoreEncrypted
            | Route::RuncRestore
            | Route::RuncRestoreShared => &[KillCriuz, KillCriu, InterruptCriuz],
            Route::RestorePipe => &[KillCriuz, KillCriu, PeerDies, InterruptCriuz],
            Route::RestoreS3 => &[KillCriuz, KillCriu, KillS3, InterruptCriuz],
        }
    }

    fn restores(self) -> bool {
        matches!(
            self,
            Route::RestoreFile
                | Route::RestoreShared
                | Route::RestoreSharedLazy
                | Route::RestoreLazy
                | Route::RestorePipe
                | Route::RestoreS3
                | Route::RestoreChain
                | Route::RestoreStream
                | Route::RestoreVerifyFirst
                | Route::RestoreForeground
                | Route::RestoreEncrypted
                | Route::RestoreHuge
        )
    }

    /// A route whose archives are encrypted (to the campaign's identity).
    fn encrypted(self) -> bool {
        matches!(self, Route::DumpEncrypted | Route::RestoreEncrypted)
    }
}

/// What every trial needs.
pub struct Ctx {
    pub criuz: PathBuf,
    pub criu: PathBuf,
    pub tools: Tools,
    pub mib: u64,
    pub work: PathBuf,
    /// criuz's TMPDIR.
    pub tmp: PathBuf,
    /// Where outputs go (a directory on the work disk).
    pub out: PathBuf,
    pub s3: S3,
    /// The runc bundles made so far, by the workload in them
    /// (`containers::WORKLOADS`).
    pub bundles: Vec<(&'static str, Bundle)>,
    /// The workload of the container the trial at work runs.
    container: &'static str,
    pub logs: PathBuf,
    /// The age identity encrypted routes encrypt to and open with.
    key: PathBuf,
    /// A clean run of each route took this long (the fault strikes within).
    pub clean_seconds: Vec<(Route, f64)>,
    /// The archives restore-side trials restore, made once.
    prepared: Vec<(Route, Prepared)>,
    /// An images directory (`criu dump -D`) for pack, and its archive.
    images: Option<(PathBuf, PathBuf)>,
    pub rng: fastrand::Rng,
    pub trial: usize,
    /// Where an interrupted criuz must have left nothing.
    places: check::Places,
    /// What an interrupted criuz of this trial left, seen before any retry.
    interrupt_left: Vec<String>,
}

/// An archive of a process that is gone, to restore again and again.
struct Prepared {
    archive: String,
    /// Its tree's root pid and its checksum before the dump.
    pid: i32,
    sum: String,
    workload: Running,
}

/// What a trial found.
#[derive(Debug, Default)]
pub struct Finding {
    pub injected: bool,
    /// (kind, detail) of each broken promise.
    pub broken: Vec<(&'static str, String)>,
    /// A process lost to CRIU's own trap (see [`CRIU_TRAP`]), not criuz's doing.
    pub criu_trap: Option<String>,
    pub seconds: f64,
}

/// CRIU runs system calls inside the process it dumps by pointing it at an
/// injected instruction followed by a breakpoint, which CRIU catches as its
/// tracer. Killed in that instant, CRIU is no longer there to catch it: the
/// kernel ends the process with SIGTRAP. `criu dump` alone, killed within
/// its first 60 ms, lost its process that way 2 times in 100
/// (`scripts/criu-kill-trap.sh`, RELIABILITY.md); nothing above CRIU can
/// stop it. Counted apart, with the evidence.
pub const CRIU_TRAP: &str = "criu-trap";

impl Finding {
    fn broke(&mut self, kind: &'static str, detail: String) {
        self.broken.push((kind, detail));
    }
}

/// How long a process may take to be resumed, killed or restored after a
/// fault before it counts as stuck.
const SETTLE: Duration = Duration::from_secs(30);
/// No operation of the campaign takes this long unless it hangs.
const LIMIT: Duration = Duration::from_secs(180);

impl Ctx {
    pub fn new(criuz: PathBuf, criu: PathBuf, tools: Tools, mib: u64, work: &Path, seed: u64) -> Result<Ctx> {
        let mk = |d: PathBuf| -> Result<PathBuf> {
            std::fs::create_dir_all(&d).map_err(|e| Error::file(&d, e))?;
            Ok(d)
        };
        let s3 = S3::start(&work.join("s3"))?;
        let (tmp, out) = (mk(work.join("tmp"))?, mk(work.join("out"))?);
        let key = work.join("campaign.key");
        let made =
            Command::new(&criuz).arg("keygen").arg("-o").arg(&key).stdout(std::process::Stdio::null()).output()?;
        if !made.status.success() {
            return Err(Error::Invalid(format!("criuz keygen: {}", String::from_utf8_lossy(&made.stderr).trim())));
        }
        Ok(Ctx {
            key,
            criuz,
            criu,
            tools,
            mib,
            places: check::Places::new(tmp.clone(), vec![out.clone()]),
            interrupt_left: Vec::new(),
            tmp,
            out,
            logs: mk(work.join("logs"))?,
            work: work.to_path_buf(),
            s3,
            bundles: Vec::new(),
            container: "mixed",
            clean_seconds: Vec::new(),
            prepared: Vec::new(),
            images: None,
            rng: fastrand::Rng::with_seed(seed),
            trial: 0,
        })
    }

    fn criuz(&self) -> Command {
        use std::os::unix::process::CommandExt;
        let mut c = Command::new(&self.criuz);
        c.env("TMPDIR", &self.tmp).env("CRIUZ_CRIU", &self.criu);
        // A campaign started in the background of a shell without job
        // control inherits SIGINT ignored; criuz would keep it so, and the
        // interrupt fault would strike nothing.
        // SAFETY: between fork and exec only signal(2), async-signal-safe.
        unsafe {
            c.pre_exec(|| {
                libc::signal(libc::SIGINT, libc::SIG_DFL);
                Ok(())
            });
        }
        c
    }

    fn log(&self, what: &str) -> PathBuf {
        self.logs.join(format!("{:04}-{what}.log", self.trial))
    }

    fn run(&mut self, op: Op, fault: Option<Fault>, delay: Duration, what: &str) -> Result<Outcome> {
        let log = self.log(what);
        let o = inject::run(op, fault, delay, &mut self.s3, &log, LIMIT);
        if fault == Some(Fault::InterruptCriuz) && o.as_ref().is_ok_and(|o| o.injected && !o.ok) {
            // Judged now: the next run would sweep it.
            self.interrupt_left.extend(check::left_files(&self.places));
        }
        self.s3.ensure()?;
        o
    }

    /// Runs a step that must succeed (set-up, or the retry after a fault).
    fn must(&mut self, op: Op, what: &str) -> std::result::Result<(), String> {
        match self.run(op, None, Duration::ZERO, what) {
            Ok(o) if o.ok => Ok(()),
            Ok(o) => Err(format!("{what}: {}", o.said)),
            Err(e) => Err(format!("{what}: {e}")),
        }
    }

    /// The bundle of the trial's container, made the first time.
    fn bundle(&mut self) -> Result<&Bundle> {
        let kind = self.container;
        if !self.bundles.iter().any(|(k, _)| *k == kind) {
            let b = crate::containers::make_bundle(&self.work, &self.tools.workload_bin, kind, self.mib, &self.criu)?;
            b.delete();
            self.bundles.push((kind, b));
        }
        Ok(self.bundles.iter().find(|(k, _)| *k == kind).map(|(_, b)| b).expect("made"))
    }

    /// The archive-side key or path of a route's output in this trial.
    fn target(&self, route: Route, dir: &Path) -> String {
        match route {
            Route::DumpS3 => s3::url(&format!("faults/{}.czr", self.trial)),
            _ => dir.join(format!("{}.czr", route.name())).display().to_string(),
        }
    }

    /// A random moment within a clean run of `route`.
    pub fn delay(&mut self, route: Route) -> Duration {
        let clean = self.clean_seconds.iter().find(|(r, _)| *r == route).map(|(_, s)| *s).unwrap_or(1.0);
        Duration::from_secs_f64(self.rng.f64() * clean)
    }

    /// One trial of `route` under `fault` (`None`: a clean calibration run).
    pub fn trial(&mut self, route: Route, fault: Option<Fault>) -> Result<Finding> {
        self.trial += 1;
        let delay = match fault {
            Some(_) => self.delay(route),
            None => Duration::ZERO,
        };
        let mut f = Finding::default();
        match route {
            Route::DumpFile
            | Route::DumpShared
            | Route::DumpPipe
            | Route::DumpS3
            | Route::DumpChild
            | Route::DumpTcp
            | Route::DumpPageServer
            | Route::DumpPageServerTcp
            | Route::DumpRunning
            | Route::DumpEncrypted => self.dump_trial(route, fault, delay, &mut f)?,
            Route::RuncCheckpoint => {
                self.container = "mixed";
                self.runc_checkpoint_trial(fault, delay, &mut f)?
            }
            Route::RuncRestore | Route::RuncRestoreShared => {
                self.container = if route == Route::RuncRestore { "mixed" } else { "shared-cache" };
                self.runc_restore_trial(fault, delay, &mut f)?
            }
            Route::Pack => self.pack_trial(fault, delay, &mut f)?,
            Route::Unpack => self.unpack_trial(fault, delay, &mut f)?,
            Route::Flatten => self.flatten_trial(fault, delay, &mut f)?,
            r if r.restores() => self.restore_trial(route, fault, delay, &mut f)?,
            _ => unreachable!("every route is matched"),
        }
        for left in self.interrupt_left.drain(..) {
            f.broke("leftover", format!("right after the interruption: {left}"));
        }
        Ok(f)
    }

    /// Where a trial writes its output: for a full-disk fault, a tmpfs with
    /// room for part of `bytes` only (kept mounted while the handle lives);
    /// otherwise the output directory.
    fn output_dir(&mut self, fault: Option<Fault>, bytes: u64) -> Result<(Option<Tmpfs>, PathBuf)> {
        if fault != Some(Fault::Enospc) {
            return Ok((None, self.out.clone()));
        }
        let dir = self.work.join(format!("full-{}", self.trial));
        let size = 64 * 1024 + (self.rng.f64() * 0.9 * bytes as f64) as u64;
        let full = Tmpfs::mount_sized(&dir, size)?;
        Ok((Some(full), dir))
    }

    fn reference_size(&self) -> u64 {
        (self.mib << 20) / 2
    }
}

/// What a process of the tree says once it has settled after a fault.
enum Asked {
    Gone,
    Stopped,
    Sum(String),
    /// It runs but does not answer (hung, or its memory broken).
    Silent(String),
}

/// Waits for the process to settle and asks for its checksum. One that
/// dies while asked (a guard ending a tree whose criuz was killed) is gone:
/// the promise is about a process that runs, and it never answered.
fn ask(w: &mut Running) -> Asked {
    if w.pid_given_away() {
        return Asked::Gone;
    }
    match check::settle(w.pid, SETTLE) {
        Settled::Gone => Asked::Gone,
        Settled::Stopped => Asked::Stopped,
        Settled::Running => match w.fingerprint_within(SETTLE) {
            Ok(s) => Asked::Sum(s),
            Err(_) if check::settle(w.pid, Duration::from_secs(5)) == Settled::Gone => Asked::Gone,
            Err(e) => Asked::Silent(e.to_string()),
        },
    }
}

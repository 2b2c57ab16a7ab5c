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
use crate::proc::{self, Tmpfs};
use crate::s3;
use crate::workload::{Running, Tools};
use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

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
            Route::RestoreFile
            | Route::RestoreShared
            | Route::RestoreSharedLazy
            | Route::RestoreLazy
            | Route::RestoreChain
            | Route::RestoreStream
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

    fn dump_trial(&mut self, route: Route, fault: Option<Fault>, delay: Duration, f: &mut Finding) -> Result<()> {
        let dir = self.work.join(format!("wl-{}", self.trial));
        let mut w = match route {
            Route::DumpTcp | Route::DumpPageServerTcp => {
                Running::start_with_tcp_peer("mixed", self.mib, &dir, &self.tools)?
            }
            Route::DumpShared => Running::start("shared-cache", self.mib, &dir, &self.tools)?,
            _ => Running::start("mixed", self.mib, &dir, &self.tools)?,
        };
        let extra = self.restore_extra(route);
        let parent = self.out.join(format!("parent-{}.czr", self.trial));
        if route == Route::DumpChild {
            let mut c = self.criuz();
            c.args(["dump", "--leave-running", "--ids", "-t", &w.pid.to_string(), "-o"]).arg(&parent);
            self.must(Op::Alone(c), "parent-dump").map_err(Error::Invalid)?;
            w.rewrite(5.0, self.trial as u64)?;
        }
        let before = w.fingerprint()?;
        let (full, dir) = self.output_dir(fault, self.reference_size())?;
        let target = self.target(route, &dir);
        // Judged is what this trial wrote, never an earlier trial's file.
        let _ = std::fs::remove_file(&target);
        let _ = std::fs::remove_file(self.target(route, &self.out));
        let pid = w.pid.to_string();
        let images = self.work.join(format!("img-{}", self.trial));
        let dump = |ctx: &Ctx, target: &str| {
            let mut c = ctx.criuz();
            if matches!(route, Route::DumpPageServer | Route::DumpPageServerTcp) {
                // The images directory of the dump criuz runs, fresh for each run.
                let _ = std::fs::remove_dir_all(&images);
                let _ = std::fs::create_dir_all(&images);
                c.arg("page-server").arg("-D").arg(&images).args(["-o", target, "--force", "--"]);
                c.arg(&ctx.criu).args(["dump", "-t", &pid, "-D"]).arg(&images);
                c.args(["--page-server", "--address", "{ip}", "--port", "{port}"]);
                if route == Route::DumpPageServerTcp {
                    c.arg("--tcp-established");
                }
                return Op::Alone(c);
            }
            c.args(["dump", "-t", &pid]);
            if route == Route::DumpChild {
                c.arg("--parent").arg(&parent);
            }
            if route == Route::DumpRunning {
                c.arg("--leave-running");
            }
            if route.encrypted() {
                c.arg("--identity").arg(&ctx.key);
            }
            match route {
                Route::DumpPipe => {
                    c.args(["-o", "-"]);
                    Op::PipeTo(c, PathBuf::from(target))
                }
                _ => {
                    c.args(["-o", target, "--force"]);
                    if route == Route::DumpTcp {
                        // CRIU's option for the connection, on dump and restore alike.
                        c.args(["--", "--tcp-established"]);
                    }
                    Op::Alone(c)
                }
            }
        };
        let key = route.encrypted().then(|| self.key.clone());
        let o = self.run(dump(self, &target), fault, delay, "dump")?;
        f.injected = o.injected && fault.is_some();
        f.seconds = o.seconds;
        let has = self.archive_there(route, &target);
        let keeps_running = route == Route::DumpRunning;
        match ask(&mut w) {
            Asked::Stopped => f.broke("stuck-process", format!("pid {} still stopped or traced ({})", w.pid, o.said)),
            Asked::Silent(e) => f.broke("stuck-process", format!("pid {} does not answer: {e}", w.pid)),
            Asked::Sum(s) if s != before => {
                f.broke("wrong-memory", format!("pid {} runs with checksum {s}, was {before}", w.pid))
            }
            Asked::Sum(_) => {
                if o.ok && !keeps_running {
                    f.broke("lost-process", format!("the dump said done but the process runs on ({})", o.said));
                }
                let verified = check::verify(&self.criuz, &target, key.as_deref());
                if let (true, Err(e), false) = (has, &verified, route == Route::DumpPipe) {
                    f.broke("partial-archive", format!("{target} published incomplete: {e} ({})", o.said));
                }
                if keeps_running && o.ok {
                    if verified.is_err() {
                        f.broke(
                            "partial-archive",
                            format!("the dump said done but {target} is not whole ({})", o.said),
                        );
                    } else if let Err(e) = self.end_and_restore(&target, &extra, &mut w, &before) {
                        f.broke("wrong-memory", format!("the published archive: {e}"));
                    }
                }
            }
            Asked::Gone => {
                let complete = has && check::complete(&self.criuz, &target, key.as_deref());
                let trapped = fault == Some(Fault::KillCriu) && proc::killed_by(w.pid) == Some(libc::SIGTRAP);
                if (!complete || keeps_running) && trapped {
                    f.criu_trap = Some(format!("pid {} killed by SIGTRAP as its CRIU was killed ({})", w.pid, o.said));
                } else if keeps_running {
                    f.broke("lost-process", format!("pid {} was to keep running and is gone ({})", w.pid, o.said));
                } else if !complete {
                    f.broke("lost-process", format!("pid {} gone and no complete archive ({})", w.pid, o.said));
                } else if let Err(e) = self.restore_and_check(&target, &extra, &mut w, &before) {
                    f.broke("wrong-memory", format!("the published archive: {e}"));
                }
            }
        }
        drop(full);
        // The retry: the same dump, no fault, into the same place (the
        // file system that filled is gone: the regular output directory).
        if check::settle(w.pid, Duration::ZERO) == Settled::Running && f.broken.is_empty() {
            let target = self.target(route, &self.out);
            if let Err(e) = self.must(dump(self, &target), "retry-dump") {
                f.broke("next-run-failed", e);
            } else {
                let _ = check::settle(w.pid, SETTLE);
                let restored = match keeps_running {
                    true => self.end_and_restore(&target, &extra, &mut w, &before),
                    false => self.restore_and_check(&target, &extra, &mut w, &before),
                };
                if let Err(e) = restored {
                    f.broke("next-run-failed", format!("restore of the retried dump: {e}"));
                }
            }
        }
        drop(w);
        let _ = std::fs::remove_file(&parent);
        let _ = std::fs::remove_dir_all(&images);
        Ok(())
    }

    /// What a restore of this route's archives adds: the key of an
    /// encrypted one, CRIU's option for a connection.
    fn restore_extra(&self, route: Route) -> Vec<OsString> {
        match route {
            Route::DumpTcp | Route::DumpPageServerTcp => vec!["--".into(), "--tcp-established".into()],
            r if r.encrypted() => vec!["--identity".into(), self.key.clone().into()],
            _ => Vec::new(),
        }
    }

    fn archive_there(&self, route: Route, target: &str) -> bool {
        match route {
            Route::DumpS3 => check::complete(&self.criuz, target, None) || self.s3_has(target),
            _ => Path::new(target).exists(),
        }
    }

    fn s3_has(&self, url: &str) -> bool {
        let key = url.trim_start_matches(&format!("s3://{}/", s3::BUCKET));
        let out = Command::new("python3")
            .args(["-c", "import sys,boto3; boto3.client('s3').head_object(Bucket=sys.argv[1],Key=sys.argv[2])"])
            .args([s3::BUCKET, key])
            .output();
        out.is_ok_and(|o| o.status.success())
    }

    /// Restores `archive` (the process it holds must be gone), checks the
    /// restored process's checksum, and leaves it running.
    fn restore_and_check(&mut self, archive: &str, extra: &[OsString], w: &mut Running, before: &str) -> Result<()> {
        let _ = check::settle(w.pid, SETTLE);
        let mut c = self.criuz();
        c.args(["restore", "-d", "-i", archive]).args(extra);
        self.must(Op::Alone(c), "restore").map_err(Error::Invalid)?;
        let s = w.fingerprint()?;
        if s != before {
            return Err(Error::Invalid(format!("restored checksum {s}, was {before}")));
        }
        Ok(())
    }

    /// [`Self::restore_and_check`], ending first a process its dump left
    /// running.
    fn end_and_restore(&mut self, archive: &str, extra: &[OsString], w: &mut Running, before: &str) -> Result<()> {
        if !w.pid_given_away() && check::settle(w.pid, Duration::ZERO) == Settled::Running {
            proc::kill_tree(&proc::tree(w.pid));
            if check::settle(w.pid, SETTLE) != Settled::Gone {
                return Err(Error::Invalid(format!("pid {} outlived its kill", w.pid)));
            }
        }
        self.restore_and_check(archive, extra, w, before)
    }

    /// The archive a restore-side route restores, made on first use.
    fn prepared(&mut self, route: Route) -> Result<usize> {
        let key = match route {
            Route::RestorePipe
            | Route::RestoreLazy
            | Route::RestoreStream
            | Route::RestoreVerifyFirst
            | Route::RestoreForeground => Route::RestoreFile,
            Route::RestoreSharedLazy => Route::RestoreShared,
            Route::Flatten => Route::RestoreChain,
            r => r,
        };
        if let Some(i) = self.prepared.iter().position(|(r, _)| *r == key) {
            if !self.prepared[i].1.workload.pid_given_away() {
                return Ok(i);
            }
            // Its pid was given to another program meanwhile (a restarted S3
            // server took one): no restore of it can run here until that
            // program ends, so it is prepared again.
            self.prepared.remove(i);
        }
        // Shared memory, which a placed restore fills and a lazy one serves
        // through the tree's mappings of it (`session::shmem`); else
        // private memory.
        let workload = if key == Route::RestoreShared { "shared" } else { "mixed" };
        let mut w = Running::start(workload, self.mib, &self.work.join(format!("prep-{}", key.name())), &self.tools)?;
        let archive = match key {
            Route::RestoreS3 => s3::url(&format!("faults/prepared-{}.czr", key.name())),
            _ => self.out.join(format!("prepared-{}.czr", key.name())).display().to_string(),
        };
        if key == Route::RestoreChain {
            let parent = self.out.join("prepared-parent.czr");
            let mut c = self.criuz();
            c.args(["dump", "--leave-running", "--ids", "-t", &w.pid.to_string(), "-o"]).arg(&parent);
            self.must(Op::Alone(c), "prepare-parent").map_err(Error::Invalid)?;
            w.rewrite(5.0, 7)?;
        }
        let sum = w.fingerprint()?;
        let mut c = self.criuz();
        c.args(["dump", "-t", &w.pid.to_string(), "-o", &archive, "--force"]);
        if key == Route::RestoreChain {
            c.arg("--parent").arg(self.out.join("prepared-parent.czr"));
        }
        if key.encrypted() {
            c.arg("--identity").arg(&self.key);
        }
        self.must(Op::Alone(c), "prepare").map_err(Error::Invalid)?;
        if check::settle(w.pid, SETTLE) != Settled::Gone {
            return Err(Error::Invalid(format!("pid {} outlived its dump", w.pid)));
        }
        let pid = w.pid;
        self.prepared.push((key, Prepared { archive, pid, sum, workload: w }));
        Ok(self.prepared.len() - 1)
    }

    /// Where a foreground restore writes the restored pid.
    fn pidfile(&self) -> PathBuf {
        self.work.join("foreground.pid")
    }

    fn restore_op(&self, route: Route, archive: &str) -> Op {
        let mut c = self.criuz();
        c.arg("restore");
        match route {
            Route::RestoreLazy | Route::RestoreSharedLazy => {
                c.arg("--lazy");
            }
            Route::RestoreVerifyFirst => {
                c.args(["--lazy", "--verify-first"]);
            }
            Route::RestoreStream => {
                c.args(["--fill", "stream"]);
            }
            Route::RestoreEncrypted => {
                c.arg("--identity").arg(&self.key);
            }
            _ => {}
        }
        if route == Route::RestoreForeground {
            // Judged is this run's pid file, never the last one's.
            let _ = std::fs::remove_file(self.pidfile());
            c.args(["-i", archive, "--pidfile"]).arg(self.pidfile());
            return Op::Foreground(c, self.pidfile());
        }
        c.arg("-d");
        match route {
            Route::RestorePipe => {
                c.args(["-i", "-"]);
                Op::PipeFrom(PathBuf::from(archive), c)
            }
            _ => {
                c.args(["-i", archive]);
                Op::Alone(c)
            }
        }
    }

    fn restore_trial(&mut self, route: Route, fault: Option<Fault>, delay: Duration, f: &mut Finding) -> Result<()> {
        let i = self.prepared(route)?;
        let (archive, pid, sum) = {
            let p = &self.prepared[i].1;
            (p.archive.clone(), p.pid, p.sum.clone())
        };
        let mut o = self.run(self.restore_op(route, &archive), fault, delay, "restore")?;
        f.injected = o.injected && fault.is_some();
        f.seconds = o.seconds;
        self.judge_restored(i, pid, &sum, &mut o, fault == Some(Fault::InterruptCriuz), f);
        if f.broken.is_empty() {
            let mut o = self.run(self.restore_op(route, &archive), None, Duration::ZERO, "retry-restore")?;
            if !o.ok {
                f.broke("next-run-failed", format!("restore after the fault: {}", o.said));
            } else {
                self.judge_restored(i, pid, &sum, &mut o, false, f);
            }
        }
        Ok(())
    }

    /// After a restore: the tree runs intact, or there is none; then it is
    /// ended so the next restore finds its pids free. A foreground criuz
    /// still waiting for the tree must then end as its root did (SIGKILL).
    /// A SIGINT it was sent (`sigint`) once the tree ran whole, before its
    /// pidfile was out, went on to the root (`proc::interrupt`): the root
    /// may have ended by it, and criuz as the root did.
    fn judge_restored(&mut self, i: usize, pid: i32, sum: &str, o: &mut Outcome, sigint: bool, f: &mut Finding) {
        let passed_on = sigint && o.waiting.is_some();
        let w = &mut self.prepared[i].1.workload;
        match ask(w) {
            Asked::Stopped => f.broke("stuck-process", format!("restored pid {pid} left stopped ({})", o.said)),
            Asked::Silent(e) => f.broke("stuck-process", format!("restored pid {pid} does not answer: {e}")),
            Asked::Gone if o.ok && !passed_on => {
                f.broke("lost-process", format!("the restore said done but pid {pid} is gone ({})", o.said))
            }
            Asked::Gone => {}
            Asked::Sum(s) if s != sum => {
                f.broke("wrong-memory", format!("restored pid {pid} has checksum {s}, was {sum}"))
            }
            Asked::Sum(_) => {}
        }
        if !self.prepared[i].1.workload.pid_given_away() {
            proc::kill_tree(&proc::tree(pid));
            let _ = check::settle(pid, SETTLE);
        }
        if let Some(mut criuz) = o.waiting.take() {
            const KILLED: i32 = 128 + libc::SIGKILL;
            const INTERRUPTED: i32 = 128 + libc::SIGINT;
            match proc::ended_as(&mut criuz, SETTLE) {
                Some(KILLED) => {}
                Some(INTERRUPTED) if passed_on => {}
                Some(code) => f.broke("other", format!("criuz exited {code} after its tree was killed (not {KILLED})")),
                None => {
                    let _ = criuz.kill();
                    let _ = criuz.wait();
                    f.broke("stuck-process", "criuz still waited after its tree was killed".into());
                }
            }
        }
    }

    /// `criuz flatten` of the prepared incremental archive: what it
    /// publishes must verify, and the retried flattening must restore the
    /// chain's process intact on its own.
    fn flatten_trial(&mut self, fault: Option<Fault>, delay: Duration, f: &mut Finding) -> Result<()> {
        let i = self.prepared(Route::Flatten)?;
        let (child, pid, sum) = {
            let p = &self.prepared[i].1;
            (p.archive.clone(), p.pid, p.sum.clone())
        };
        let (full, dir) = self.output_dir(fault, self.reference_size())?;
        let target = dir.join("flat.czr");
        let _ = std::fs::remove_file(&target);
        let flatten = |ctx: &Ctx, to: &Path| {
            let mut c = ctx.criuz();
            c.args(["flatten", &child, "--force", "-o"]).arg(to);
            Op::Alone(c)
        };
        let o = self.run(flatten(self, &target), fault, delay, "flatten")?;
        f.injected = o.injected && fault.is_some();
        f.seconds = o.seconds;
        let shown = target.display().to_string();
        if target.exists() && !check::complete(&self.criuz, &shown, None) {
            f.broke("partial-archive", format!("{shown} published incomplete ({})", o.said));
        }
        // A criuz killed (or interrupted) just after it published leaves
        // its archive, complete (checked above).
        if o.ok != target.exists() && !(o.by_signal && target.exists()) {
            f.broke("partial-archive", format!("flatten exit {} but archive present: {}", o.said, target.exists()));
        }
        drop(full);
        let target = self.out.join("flat.czr");
        if let Err(e) = self.must(flatten(self, &target), "retry-flatten") {
            f.broke("next-run-failed", e);
            return Ok(());
        }
        let mut c = self.criuz();
        c.args(["restore", "-d", "-i"]).arg(&target);
        let mut o = self.run(Op::Alone(c), None, Duration::ZERO, "restore-flat")?;
        if !o.ok {
            f.broke("next-run-failed", format!("restore of the flattened archive: {}", o.said));
        }
        self.judge_restored(i, pid, &sum, &mut o, false, f);
        let _ = std::fs::remove_file(&target);
        Ok(())
    }

    fn runc_archive(&self, dir: &Path) -> PathBuf {
        dir.join("runc.czr")
    }

    fn runc_checkpoint_op(&mut self, archive: &Path) -> Result<Op> {
        let mut c = self.criuz();
        let b = self.bundle()?;
        c.args(["runc", "checkpoint", &b.id, "--force", "-o"]).arg(archive);
        c.arg("--root").arg(&b.root).arg("--criu").arg(&b.criu);
        Ok(Op::Alone(c))
    }

    fn runc_restore_op(&mut self, archive: &Path) -> Result<Op> {
        let mut c = self.criuz();
        let b = self.bundle()?;
        c.args(["runc", "restore", &b.id, "-d", "-i"]).arg(archive);
        c.arg("-b").arg(&b.dir).arg("--root").arg(&b.root).arg("--criu").arg(&b.criu);
        Ok(Op::Alone(c))
    }

    /// The container's state as runc says it (None: runc knows no such
    /// container).
    fn runc_state(&mut self) -> Result<Option<String>> {
        let b = self.bundle()?;
        let out = b.runc().args(["state", &b.id]).output()?;
        if !out.status.success() {
            return Ok(None);
        }
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap_or_default();
        Ok(v["status"].as_str().map(String::from))
    }

    /// Waits for the container to run or be gone; judges its checksum.
    fn judge_container(&mut self, before: &str, said: &str, f: &mut Finding) -> Result<bool> {
        let t = std::time::Instant::now();
        loop {
            match self.runc_state()?.as_deref() {
                Some("running") => break,
                None | Some("stopped") => return Ok(false),
                _ if t.elapsed() > SETTLE => {
                    f.broke("stuck-process", format!("container neither running nor gone ({said})"));
                    return Ok(false);
                }
                _ => std::thread::sleep(Duration::from_millis(50)),
            }
        }
        match self.bundle()?.sum() {
            Ok(s) if s == before => {}
            Ok(s) => f.broke("wrong-memory", format!("container checksum {s}, was {before}")),
            // Killed since runc said it runs: the guard of a criuz killed
            // while the container's pages still arrived strikes a moment
            // after criuz's end. None is left, as after any failed restore.
            Err(_) if !matches!(self.runc_state()?.as_deref(), Some("running")) => return Ok(false),
            Err(e) => f.broke("stuck-process", format!("container does not answer: {e}")),
        }
        Ok(true)
    }

    fn runc_checkpoint_trial(&mut self, fault: Option<Fault>, delay: Duration, f: &mut Finding) -> Result<()> {
        self.bundle()?.start()?;
        let before = self.bundle()?.sum()?;
        let (full, dir) = self.output_dir(fault, self.reference_size())?;
        let archive = self.runc_archive(&dir);
        let op = self.runc_checkpoint_op(&archive)?;
        let o = self.run(op, fault, delay, "runc-checkpoint")?;
        f.injected = o.injected && fault.is_some();
        f.seconds = o.seconds;
        let running = self.judge_container(&before, &o.said, f)?;
        let has = archive.exists();
        if running && has && !check::complete(&self.criuz, &archive.display().to_string(), None) {
            f.broke("partial-archive", format!("{} published incomplete", archive.display()));
        }
        if !running && f.broken.is_empty() {
            if !has || !check::complete(&self.criuz, &archive.display().to_string(), None) {
                f.broke("lost-process", format!("container gone and no complete archive ({})", o.said));
            } else {
                self.bundle()?.delete();
                let op = self.runc_restore_op(&archive)?;
                if let Err(e) = self.must(op, "runc-restore") {
                    f.broke("wrong-memory", format!("the published archive: {e}"));
                }
                self.judge_container(&before, "restore of the published archive", f)?;
            }
        }
        drop(full);
        if f.broken.is_empty() {
            let archive = self.runc_archive(&self.out);
            let op = self.runc_checkpoint_op(&archive)?;
            match self.must(op, "retry-checkpoint") {
                Err(e) => f.broke("next-run-failed", e),
                Ok(()) => {
                    self.bundle()?.delete();
                    self.retry_runc_restore(&archive, &before, f)?;
                }
            }
        }
        self.bundle()?.delete();
        Ok(())
    }

    fn runc_restore_trial(&mut self, fault: Option<Fault>, delay: Duration, f: &mut Finding) -> Result<()> {
        let archive = self.out.join(format!("prepared-runc-{}.czr", self.container));
        let before_file = self.out.join(format!("prepared-runc-{}.sum", self.container));
        if !archive.exists() {
            self.bundle()?.start()?;
            let before = self.bundle()?.sum()?;
            let op = self.runc_checkpoint_op(&self.out.join("runc.czr"))?;
            self.must(op, "prepare-runc").map_err(Error::Invalid)?;
            std::fs::rename(self.out.join("runc.czr"), &archive).map_err(|e| Error::file(&archive, e))?;
            std::fs::write(&before_file, before).map_err(|e| Error::file(&before_file, e))?;
            self.bundle()?.delete();
        }
        let before = std::fs::read_to_string(&before_file).map_err(|e| Error::file(&before_file, e))?;
        let op = self.runc_restore_op(&archive)?;
        let o = self.run(op, fault, delay, "runc-restore")?;
        f.injected = o.injected && fault.is_some();
        f.seconds = o.seconds;
        let running = self.judge_container(&before, &o.said, f)?;
        if o.ok && !running {
            f.broke("lost-process", format!("runc restore said done, no container ({})", o.said));
        }
        self.bundle()?.delete();
        if f.broken.is_empty() {
            self.retry_runc_restore(&archive, &before, f)?;
        }
        self.bundle()?.delete();
        Ok(())
    }

    /// The faultless `runc restore` after a fault: it must run the
    /// container with its checksum intact.
    fn retry_runc_restore(&mut self, archive: &Path, before: &str, f: &mut Finding) -> Result<()> {
        let op = self.runc_restore_op(archive)?;
        match self.must(op, "retry-restore") {
            Err(e) => f.broke("next-run-failed", e),
            Ok(()) => {
                if !self.judge_container(before, "retry", f)? {
                    f.broke("next-run-failed", "the retried restore left no container".into());
                }
            }
        }
        Ok(())
    }

    /// A CRIU images directory (of a process now gone) and its archive.
    fn images(&mut self) -> Result<(PathBuf, PathBuf)> {
        if let Some(i) = &self.images {
            return Ok(i.clone());
        }
        let img = self.work.join("images");
        std::fs::create_dir_all(&img).map_err(|e| Error::file(&img, e))?;
        let w = Running::start("mixed", self.mib, &self.work.join("wl-images"), &self.tools)?;
        let out = Command::new(&self.criu)
            .args(["dump", "-t", &w.pid.to_string(), "-D"])
            .arg(&img)
            .args(["-o", "dump.log", "--shell-job"])
            .output()?;
        if !out.status.success() {
            return Err(Error::Criu(format!("criu dump for the pack path failed; see {}/dump.log", img.display())));
        }
        let _ = check::settle(w.pid, SETTLE);
        drop(w);
        let _ = std::fs::remove_file(img.join("dump.log"));
        let archive = self.out.join("images.czr");
        let mut c = self.criuz();
        c.arg("pack").arg(&img).arg("-o").arg(&archive).arg("--force");
        self.must(Op::Alone(c), "prepare-pack").map_err(Error::Invalid)?;
        self.images = Some((img, archive));
        Ok(self.images.clone().expect("set"))
    }

    fn pack_trial(&mut self, fault: Option<Fault>, delay: Duration, f: &mut Finding) -> Result<()> {
        let (img, _) = self.images()?;
        let (full, dir) = self.output_dir(fault, self.reference_size())?;
        let target = dir.join("packed.czr");
        let _ = std::fs::remove_file(&target);
        let pack = |ctx: &Ctx, to: &Path| {
            let mut c = ctx.criuz();
            c.arg("pack").arg(&img).arg("-o").arg(to).arg("--force");
            Op::Alone(c)
        };
        let o = self.run(pack(self, &target), fault, delay, "pack")?;
        f.injected = o.injected && fault.is_some();
        f.seconds = o.seconds;
        if target.exists() && !check::complete(&self.criuz, &target.display().to_string(), None) {
            f.broke("partial-archive", format!("{} published incomplete ({})", target.display(), o.said));
        }
        // A criuz killed (or interrupted) just after it published leaves
        // its archive, complete (checked above).
        if o.ok != target.exists() && !(o.by_signal && target.exists()) {
            f.broke("partial-archive", format!("pack exit {} but archive present: {}", o.said, target.exists()));
        }
        if let Some(t) = &full {
            let left: Vec<_> = std::fs::read_dir(t.path()).map(|r| r.flatten().collect()).unwrap_or_default();
            if !o.ok && !left.is_empty() {
                f.broke("leftover", format!("a failed pack left {} entries on the full disk", left.len()));
            }
        }
        drop(full);
        let target = self.out.join("packed.czr");
        if let Err(e) = self.must(pack(self, &target), "retry-pack") {
            f.broke("next-run-failed", e);
        } else if !check::complete(&self.criuz, &target.display().to_string(), None) {
            f.broke("next-run-failed", "the retried pack does not verify".into());
        }
        Ok(())
    }

    fn unpack_trial(&mut self, fault: Option<Fault>, delay: Duration, f: &mut Finding) -> Result<()> {
        let (img, archive) = self.images()?;
        let (full, base) = self.output_dir(fault, proc::dir_bytes(&img))?;
        let dir = base.join("unpacked");
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).map_err(|e| Error::file(&dir, e))?;
        let unpack = |ctx: &Ctx, to: &Path| {
            let mut c = ctx.criuz();
            c.arg("unpack").arg(&archive).arg("-d").arg(to).arg("--force");
            Op::Alone(c)
        };
        let o = self.run(unpack(self, &dir), fault, delay, "unpack")?;
        f.injected = o.injected && fault.is_some();
        f.seconds = o.seconds;
        match same_files(&img, &dir) {
            Ok(Shown::Nothing) if !o.ok => {}
            Ok(Shown::All) => {}
            Ok(Shown::Part(differ)) => f.broke(
                "partial-archive",
                format!("unpack left part of the images in {} (differing: {differ:?}) ({})", dir.display(), o.said),
            ),
            Ok(Shown::Nothing) => f.broke("partial-archive", format!("unpack said done, {} is empty", dir.display())),
            Err(e) => f.broke("partial-archive", format!("{}: {e}", dir.display())),
        }
        // Killed, it cannot clean up; otherwise it must have.
        if fault != Some(Fault::KillCriuz) || !o.injected {
            staged(&dir, "a failed unpack", f);
        }
        drop(full);
        let dir = self.out.join("unpacked");
        if let Err(e) = self.must(unpack(self, &dir), "retry-unpack") {
            f.broke("next-run-failed", e);
        } else if !matches!(same_files(&img, &dir), Ok(Shown::All)) {
            f.broke("next-run-failed", "the retried unpack differs from the images".into());
        }
        staged(&dir, "the next unpack", f);
        let _ = std::fs::remove_dir_all(&dir);
        Ok(())
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

/// A staging entry (hidden) left in an unpack's target is a leftover.
fn staged(dir: &Path, after: &str, f: &mut Finding) {
    let left: Vec<String> = std::fs::read_dir(dir)
        .map(|r| r.flatten().filter_map(|e| e.file_name().to_str().map(String::from)).collect())
        .unwrap_or_default();
    let left: Vec<String> = left.into_iter().filter(|n| n.starts_with('.')).collect();
    if !left.is_empty() {
        f.broke("leftover", format!("after {after}: {left:?} in {}", dir.display()));
    }
}

/// What an unpacked directory shows of the images it came from.
enum Shown {
    Nothing,
    All,
    /// Some files, or files that differ: names of the first few.
    Part(Vec<String>),
}

fn same_files(images: &Path, dir: &Path) -> Result<Shown> {
    let visible = |d: &Path| -> Result<Vec<String>> {
        let mut v: Vec<String> = std::fs::read_dir(d)
            .map_err(|e| Error::file(d, e))?
            .flatten()
            .filter_map(|e| e.file_name().to_str().map(String::from))
            .filter(|n| !n.starts_with('.'))
            .collect();
        v.sort();
        Ok(v)
    };
    let (want, got) = (visible(images)?, visible(dir)?);
    if got.is_empty() {
        return Ok(Shown::Nothing);
    }
    let differ: Vec<String> = want
        .iter()
        .filter(|n| std::fs::read(images.join(n)).ok() != std::fs::read(dir.join(n)).ok())
        .take(4)
        .cloned()
        .collect();
    Ok(if differ.is_empty() && want == got { Shown::All } else { Shown::Part(differ) })
}

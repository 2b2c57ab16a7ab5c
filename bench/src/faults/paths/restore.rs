//! The restore-side trials: a prepared archive (its process gone)
//! restored with the fault; afterwards the restored process runs with its
//! checksum intact, or there is none, and the retried restore is whole.

use super::{ask, Asked, Ctx, Finding, Prepared, Route, SETTLE};
use crate::error::{Error, Result};
use crate::faults::check::{self, Settled};
use crate::faults::inject::{Fault, Op, Outcome};
use crate::proc;
use crate::s3;
use crate::workload::Running;
use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

impl Ctx {
    /// What a restore of this route's archives adds: the key of an
    /// encrypted one, CRIU's option for a connection.
    pub(super) fn restore_extra(&self, route: Route) -> Vec<OsString> {
        match route {
            Route::DumpTcp | Route::DumpPageServerTcp => vec!["--".into(), "--tcp-established".into()],
            r if r.encrypted() => vec!["--identity".into(), self.key.clone().into()],
            _ => Vec::new(),
        }
    }

    pub(super) fn archive_there(&self, route: Route, target: &str) -> bool {
        match route {
            Route::DumpS3 => check::complete(&self.criuz, target, None) || self.s3_has(target),
            _ => Path::new(target).exists(),
        }
    }

    pub(super) fn s3_has(&self, url: &str) -> bool {
        let key = url.trim_start_matches(&format!("s3://{}/", s3::BUCKET));
        let out = Command::new("python3")
            .args(["-c", "import sys,boto3; boto3.client('s3').head_object(Bucket=sys.argv[1],Key=sys.argv[2])"])
            .args([s3::BUCKET, key])
            .output();
        out.is_ok_and(|o| o.status.success())
    }

    /// Restores `archive` (the process it holds must be gone), checks the
    /// restored process's checksum, and leaves it running.
    pub(super) fn restore_and_check(
        &mut self,
        archive: &str,
        extra: &[OsString],
        w: &mut Running,
        before: &str,
    ) -> Result<()> {
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
    pub(super) fn end_and_restore(
        &mut self,
        archive: &str,
        extra: &[OsString],
        w: &mut Running,
        before: &str,
    ) -> Result<()> {
        if !w.pid_given_away() && check::settle(w.pid, Duration::ZERO) == Settled::Running {
            proc::kill_tree(&proc::tree(w.pid));
            if check::settle(w.pid, SETTLE) != Settled::Gone {
                return Err(Error::Invalid(format!("pid {} outlived its kill", w.pid)));
            }
        }
        self.restore_and_check(archive, extra, w, before)
    }

    /// The archive a restore-side route restores, made on first use.
    pub(super) fn prepared(&mut self, route: Route) -> Result<usize> {
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
        // through the tree's mappings of it (`session::shmem`); private
        // memory the process asked to be huge pages; else private memory.
        let workload = match key {
            Route::RestoreShared => "shared",
            Route::RestoreHuge => "thp",
            _ => "mixed",
        };
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
    pub(super) fn pidfile(&self) -> PathBuf {
        self.work.join("foreground.pid")
    }

    pub(super) fn restore_op(&self, route: Route, archive: &str) -> Op {
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

    pub(super) fn restore_trial(
        &mut self,
        route: Route,
        fault: Option<Fault>,
        delay: Duration,
        f: &mut Finding,
    ) -> Result<()> {
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
    pub(super) fn judge_restored(
        &mut self,
        i: usize,
        pid: i32,
        sum: &str,
        o: &mut Outcome,
        sigint: bool,
        f: &mut Finding,
    ) {
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
}

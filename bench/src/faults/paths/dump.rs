//! The dump-side trials: a fresh workload checkpointed with the fault;
//! afterwards the process runs with its checksum unchanged, or the archive
//! is complete and restores it intact, and the retried dump succeeds.

use super::{ask, Asked, Ctx, Finding, Route, SETTLE};
use crate::error::{Error, Result};
use crate::faults::check::{self, Settled};
use crate::faults::inject::{Fault, Op};
use crate::proc;
use crate::workload::Running;
use std::path::PathBuf;
use std::time::Duration;

impl Ctx {
    pub(super) fn dump_trial(
        &mut self,
        route: Route,
        fault: Option<Fault>,
        delay: Duration,
        f: &mut Finding,
    ) -> Result<()> {
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
}

//! The container trials: `criuz runc checkpoint` and `runc restore` with
//! the fault; afterwards the container runs with its checksum intact (or,
//! for a restore, is gone), and the retry succeeds.

use super::{Ctx, Finding, SETTLE};
use crate::error::{Error, Result};
use crate::faults::check;
use crate::faults::inject::{Fault, Op};
use std::path::{Path, PathBuf};
use std::time::Duration;

impl Ctx {
    pub(super) fn runc_archive(&self, dir: &Path) -> PathBuf {
        dir.join("runc.czr")
    }

    pub(super) fn runc_checkpoint_op(&mut self, archive: &Path) -> Result<Op> {
        let mut c = self.criuz();
        let b = self.bundle()?;
        c.args(["runc", "checkpoint", &b.id, "--force", "-o"]).arg(archive);
        c.arg("--root").arg(&b.root).arg("--criu").arg(&b.criu);
        Ok(Op::Alone(c))
    }

    pub(super) fn runc_restore_op(&mut self, archive: &Path) -> Result<Op> {
        let mut c = self.criuz();
        let b = self.bundle()?;
        c.args(["runc", "restore", &b.id, "-d", "-i"]).arg(archive);
        c.arg("-b").arg(&b.dir).arg("--root").arg(&b.root).arg("--criu").arg(&b.criu);
        Ok(Op::Alone(c))
    }

    /// The container's state as runc says it (None: runc knows no such
    /// container).
    pub(super) fn runc_state(&mut self) -> Result<Option<String>> {
        let b = self.bundle()?;
        let out = b.runc().args(["state", &b.id]).output()?;
        if !out.status.success() {
            return Ok(None);
        }
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap_or_default();
        Ok(v["status"].as_str().map(String::from))
    }

    /// Waits for the container to run or be gone; judges its checksum.
    pub(super) fn judge_container(&mut self, before: &str, said: &str, f: &mut Finding) -> Result<bool> {
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

    pub(super) fn runc_checkpoint_trial(
        &mut self,
        fault: Option<Fault>,
        delay: Duration,
        f: &mut Finding,
    ) -> Result<()> {
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

    pub(super) fn runc_restore_trial(&mut self, fault: Option<Fault>, delay: Duration, f: &mut Finding) -> Result<()> {
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
    pub(super) fn retry_runc_restore(&mut self, archive: &Path, before: &str, f: &mut Finding) -> Result<()> {
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
}

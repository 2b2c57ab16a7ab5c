//! The trials of the commands that run without a process: flatten, pack
//! and unpack. What they publish must verify, or nothing is published, and
//! the retry's result restores the process intact.

use super::{Ctx, Finding, Route, SETTLE};
use crate::error::{Error, Result};
use crate::faults::check;
use crate::faults::inject::{Fault, Op};
use crate::proc;
use crate::workload::Running;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

impl Ctx {
    /// `criuz flatten` of the prepared incremental archive: what it
    /// publishes must verify, and the retried flattening must restore the
    /// chain's process intact on its own.
    pub(super) fn flatten_trial(&mut self, fault: Option<Fault>, delay: Duration, f: &mut Finding) -> Result<()> {
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

    /// A CRIU images directory (of a process now gone) and its archive.
    pub(super) fn images(&mut self) -> Result<(PathBuf, PathBuf)> {
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

    pub(super) fn pack_trial(&mut self, fault: Option<Fault>, delay: Duration, f: &mut Finding) -> Result<()> {
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

    pub(super) fn unpack_trial(&mut self, fault: Option<Fault>, delay: Duration, f: &mut Finding) -> Result<()> {
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

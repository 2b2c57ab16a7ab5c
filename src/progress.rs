//! Progress bar on a terminal for work that lasts more than a second; silent
//! when stderr is not a terminal (scripts, CI, pipes).

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use std::io::IsTerminal;
use std::time::{Duration, Instant};

pub struct Progress {
    bar: ProgressBar,
    started: Instant,
    enabled: bool,
    shown: bool,
}

impl Progress {
    pub fn new(label: &str, total: Option<u64>) -> Self {
        let bar = match total {
            Some(t) => ProgressBar::with_draw_target(Some(t), ProgressDrawTarget::hidden()),
            None => ProgressBar::with_draw_target(None, ProgressDrawTarget::hidden()),
        };
        let template = if total.is_some() {
            "{msg} [{bar:30}] {bytes}/{total_bytes} {binary_bytes_per_sec} eta {eta}"
        } else {
            "{msg} {spinner} {bytes} {binary_bytes_per_sec}"
        };
        if let Ok(style) = ProgressStyle::with_template(template) {
            bar.set_style(style.progress_chars("=> "));
        }
        bar.set_message(label.to_string());
        Progress { bar, started: Instant::now(), enabled: std::io::stderr().is_terminal(), shown: false }
    }

    /// A bar that never draws (library callers, tests).
    pub fn hidden() -> Self {
        let mut p = Self::new("", None);
        p.enabled = false;
        p
    }

    pub fn set(&mut self, pos: u64) {
        if self.enabled && !self.shown && self.started.elapsed() > Duration::from_secs(1) {
            self.bar.set_draw_target(ProgressDrawTarget::stderr());
            self.shown = true;
        }
        self.bar.set_position(pos);
    }

    pub fn finish(&self) {
        self.bar.finish_and_clear();
    }
}

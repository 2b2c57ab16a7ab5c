//! Progress on a terminal for work that lasts more than a second; silent
//! when stderr is not a terminal (scripts, CI, pipes). [`Progress`] is a bar
//! for offline commands; a [`Meter`] counts a dump's or restore's bytes from
//! the threads that move them, and a [`Ticker`] draws its line.

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use std::io::IsTerminal;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
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

/// Live counters of a dump or a restore, shared by the threads doing the
/// work and read by a [`Ticker`]. Counting costs an atomic add per block.
#[derive(Debug)]
pub struct Meter {
    started: Instant,
    /// Dump: image bytes taken in from CRIU. Restore: page bytes handed to
    /// CRIU, or placed by criuz.
    pub taken: AtomicU64,
    /// Dump: image bytes compressed and written to the archive.
    pub stored: AtomicU64,
    /// Microseconds from the start until CRIU finished writing (0: not yet).
    criu_done_us: AtomicU64,
}

impl Default for Meter {
    fn default() -> Self {
        Meter {
            started: Instant::now(),
            taken: AtomicU64::new(0),
            stored: AtomicU64::new(0),
            criu_done_us: AtomicU64::new(0),
        }
    }
}

impl Meter {
    pub fn new() -> Arc<Meter> {
        Arc::new(Meter::default())
    }

    /// CRIU has written everything (a dump's process is no longer frozen).
    pub fn criu_done(&self) {
        let us = self.started.elapsed().as_micros().max(1) as u64;
        let _ = self.criu_done_us.compare_exchange(0, us, Ordering::Relaxed, Ordering::Relaxed);
    }

    /// How long CRIU has run, and whether it is done.
    pub fn criu_time(&self) -> (Duration, bool) {
        match self.criu_done_us.load(Ordering::Relaxed) {
            0 => (self.started.elapsed(), false),
            us => (Duration::from_micros(us), true),
        }
    }

    pub fn elapsed(&self) -> Duration {
        self.started.elapsed()
    }

    /// The dump's progress line: what was taken in, how fast, how long the
    /// process has been frozen, and the backlog still to compress.
    pub fn dump_line(&self) -> String {
        let taken = self.taken.load(Ordering::Relaxed);
        let backlog = taken.saturating_sub(self.stored.load(Ordering::Relaxed));
        match self.criu_time() {
            (criu, false) => format!(
                "dump: {} taken from CRIU ({}/s), frozen {:.1}s, backlog {}",
                mib(taken),
                mib((taken as f64 / criu.as_secs_f64().max(1e-3)) as u64),
                criu.as_secs_f64(),
                mib(backlog)
            ),
            (criu, true) => format!(
                "dump: CRIU done after {:.1}s ({} taken), compressing: {} left",
                criu.as_secs_f64(),
                mib(taken),
                mib(backlog)
            ),
        }
    }

    /// The restore's progress line: pages handed to CRIU and how fast.
    pub fn restore_line(&self) -> String {
        let taken = self.taken.load(Ordering::Relaxed);
        let secs = self.elapsed().as_secs_f64();
        format!("restore: {} of pages in ({}/s), {secs:.1}s", mib(taken), mib((taken as f64 / secs.max(1e-3)) as u64))
    }
}

fn mib(bytes: u64) -> String {
    format!("{:.0} MiB", bytes as f64 / (1u64 << 20) as f64)
}

/// A live status line on stderr, redrawn from `line` a few times a second
/// once the work has lasted a second; nothing when stderr is not a terminal.
/// Cleared when dropped.
pub struct Ticker {
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Ticker {
    pub fn start(line: impl Fn() -> String + Send + 'static) -> Ticker {
        let stop = Arc::new(AtomicBool::new(false));
        if !std::io::stderr().is_terminal() {
            return Ticker { stop, thread: None };
        }
        let halt = stop.clone();
        let thread = std::thread::Builder::new()
            .name("criuz-progress".into())
            .spawn(move || {
                let started = Instant::now();
                let bar = ProgressBar::with_draw_target(None, ProgressDrawTarget::stderr());
                if let Ok(style) = ProgressStyle::with_template("{spinner} {msg}") {
                    bar.set_style(style);
                }
                while !halt.load(Ordering::Relaxed) {
                    if started.elapsed() > Duration::from_secs(1) {
                        bar.set_message(line());
                        bar.tick();
                    }
                    std::thread::sleep(Duration::from_millis(200));
                }
                bar.finish_and_clear();
            })
            .ok();
        Ticker { stop, thread }
    }
}

impl Drop for Ticker {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

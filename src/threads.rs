//! Threads that run job after job, so a restore does not take a new pid for
//! each of its short jobs.
//!
//! A thread's id comes from the same counter as process ids. CRIU restores
//! a tree with the pids it had, one process after another, and fails on a
//! pid that another task holds at that moment ("Can't fork for N: File
//! exists"). A streamed restore spawned a writer for every image CRIU
//! opened and a pool of decoders for every page image: about ten thread
//! ids per process (528 for a tree of 51 processes, 33 now), which walked
//! the counter through the tree's pids while CRIU still created them,
//! wherever it started below them (a freshly booted machine, a counter
//! that wrapped). A tree of 301 processes restored from a counter just
//! below its pids took 2,500 of them and failed, twice in two; now about
//! 150, and it restored. (The restore also moves the counter past the
//! tree's pids first, `proc::holder::allocate_new_pids_above`, where it may.)
//!
//! [`spawn`] runs a job on a thread that finished its last one if there is
//! one, and on a new thread otherwise, which then waits [`IDLE_FOR`] for
//! another job before it ends. Threads are never shared while busy: a job
//! may block as long as it likes (a writer waiting for CRIU to read), and
//! no job waits for another to start.

use crossbeam_channel::{bounded, Receiver, RecvTimeoutError, Sender};
use std::sync::Mutex;
use std::time::Duration;

type Job = Box<dyn FnOnce() + Send + 'static>;

/// How long a thread with nothing to do waits for another job before it
/// ends: longer than the gaps between the images of a restore.
pub const IDLE_FOR: Duration = Duration::from_secs(10);

/// The threads waiting for a job, each by the sender that hands it one,
/// and the process they are threads of.
static IDLE: Mutex<(u32, Vec<Sender<Job>>)> = Mutex::new((0, Vec::new()));

fn idle() -> std::sync::MutexGuard<'static, (u32, Vec<Sender<Job>>)> {
    // A job runs outside the lock, so a poisoned lock holds a sound list.
    let mut idle = IDLE.lock().unwrap_or_else(|p| p.into_inner());
    // A forked child has none of its parent's threads: a job handed to one
    // would never run.
    let me = std::process::id();
    if idle.0 != me {
        *idle = (me, Vec::new());
    }
    idle
}

/// A job's end, as a thread's join handle tells it.
pub struct Finished(Receiver<()>);

impl Finished {
    /// Waits for the job; whether it ran to its end (false: it panicked).
    pub fn join(self) -> bool {
        self.0.recv().is_ok()
    }
}

/// Runs `job` on an idle thread, or on a new one (named `name`) if none is
/// idle. Fails only as `std::thread::Builder::spawn` does.
pub fn spawn(name: &str, job: impl FnOnce() + Send + 'static) -> std::io::Result<Finished> {
    let (done, finished) = bounded(1);
    // `done` is dropped unsent if the job panics: `join` then says so.
    let mut job: Job = Box::new(move || {
        job();
        let _ = done.send(());
    });
    loop {
        let Some(thread) = idle().1.pop() else { break };
        match thread.send(job) {
            Ok(()) => return Ok(Finished(finished)),
            // That thread ended meanwhile (it was idle too long).
            Err(back) => job = back.into_inner(),
        }
    }
    let (hand, jobs) = bounded::<Job>(1);
    std::thread::Builder::new().name(name.to_string()).spawn(move || {
        job();
        loop {
            idle().1.push(hand.clone());
            match jobs.recv_timeout(IDLE_FOR) {
                Ok(next) => next(),
                Err(RecvTimeoutError::Timeout) => {
                    let mut waiting = idle();
                    if let Some(i) = waiting.1.iter().position(|s| s.same_channel(&hand)) {
                        waiting.1.swap_remove(i);
                        return;
                    }
                    drop(waiting);
                    // Taken from the list just now: its job is on the way.
                    match jobs.recv() {
                        Ok(next) => next(),
                        Err(_) => return,
                    }
                }
                Err(RecvTimeoutError::Disconnected) => return,
            }
        }
    })?;
    Ok(Finished(finished))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;

    fn thread_id() -> i64 {
        // SAFETY: gettid has no arguments and cannot fail.
        unsafe { libc::syscall(libc::SYS_gettid) }
    }

    /// Jobs run one after another reuse one thread: one thread id, not one
    /// each; jobs running at once each have a thread of their own.
    #[test]
    fn finished_threads_take_the_next_jobs() {
        let ids = Arc::new(Mutex::new(std::collections::BTreeSet::new()));
        for _ in 0..50 {
            let ids = ids.clone();
            let ran = spawn("test", move || {
                ids.lock().unwrap().insert(thread_id());
            });
            assert!(ran.unwrap().join());
        }
        // Other tests may hand jobs to the same threads: a few, not 50.
        assert!(ids.lock().unwrap().len() <= 4, "{:?}", ids.lock().unwrap());
        let (release, wait) = bounded::<()>(0);
        let running = Arc::new(AtomicUsize::new(0));
        let jobs: Vec<_> = (0..8)
            .map(|_| {
                let (wait, running) = (wait.clone(), running.clone());
                spawn("test", move || {
                    running.fetch_add(1, Ordering::SeqCst);
                    let _ = wait.recv();
                })
                .unwrap()
            })
            .collect();
        while running.load(Ordering::SeqCst) < 8 {
            std::thread::sleep(Duration::from_millis(1));
        }
        drop(release);
        for j in jobs {
            assert!(j.join());
        }
    }

    #[test]
    fn a_job_that_panics_is_told_apart() {
        assert!(!spawn("test", || panic!("on purpose")).unwrap().join());
        assert!(spawn("test", || {}).unwrap().join());
    }
}

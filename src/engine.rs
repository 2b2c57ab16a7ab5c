//! Parallel, ordered, memory-bounded job engine.
//!
//! Producers (any number of threads) submit jobs through a cloneable
//! [`Submitter`]; a pool of worker threads transforms them; one [`Collector`]
//! hands results back in submission order. At most `window` jobs are in flight
//! between submit and collect, which bounds memory whatever the input size:
//! with 256 KiB blocks and the default 64 MiB budget that is 128 blocks.
//! Submitting blocks while the window is full, so a slow consumer paces the
//! producers (and, through them, CRIU) instead of growing queues.
//!
//! A [`Hold`] keeps the workers idle while a producer must have the cores
//! it needs (CRIU writing a frozen process's pages): they take jobs only
//! when the queue passes its high-water mark, and freely once the hold is
//! released or every submitter is gone. A hold may leave some workers free
//! (the cores the producer does not need): they work as jobs arrive, so
//! the queue grows only by what they cannot keep up with. Work a held
//! worker does under the hold is work done under backlog, which
//! [`Hold::hurried`] lets the job know.
//!
//! The workers also stop taking jobs while `ahead` results are done but not
//! yet collected (a slow consumer, such as a disk slower than the codec):
//! what waits for the consumer then waits as jobs, not as results. That
//! matters where a job's input costs no memory (a dump's pages held by
//! reference, `archive::held`) and its result does (incompressible pages).

use crate::error::{Error, Result};
use crossbeam_channel::{bounded, unbounded, Receiver, Sender};
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};

/// Default bytes of block data allowed in flight.
pub const DEFAULT_MEMORY_BUDGET: usize = 64 << 20;

/// The least a dump's pipeline is given, where memory is short (a memory
/// cgroup with little room left): two 4 MiB blocks' worth.
pub const MIN_MEMORY_BUDGET: usize = 8 << 20;

/// A dump pipeline's own budget with `available` bytes to count on: a
/// quarter of them, between [`MIN_MEMORY_BUDGET`] and
/// [`DEFAULT_MEMORY_BUDGET`]. In a memory cgroup with little room, a
/// pipeline sized for the machine would take the group over its limit, and
/// the OOM killer would kill the biggest process there, often the one being
/// checkpointed (measured: a 256 MiB process in a 300 MiB group, killed by
/// a dump at the default budget; plain `criu dump -D` there survives).
pub fn pipeline_budget(available: u64) -> usize {
    usize::try_from(available / 4).unwrap_or(usize::MAX).clamp(MIN_MEMORY_BUDGET, DEFAULT_MEMORY_BUDGET)
}

/// The default budget of a dump (`--absorb`): a quarter of the memory
/// `available` now (`proc::memory::available`: the machine's, or less in a
/// memory cgroup), so CRIU's pages are taken in as fast as CRIU writes them
/// and compressed behind, and the process is frozen for the dump rather than
/// for the codec (on 2 cores, LZ4 on a JVM heap keeps pace with CRIU only at
/// about half its speed). Never below the pipeline's own
/// ([`pipeline_budget`]). Blocks a dump holds by reference (`archive::held`)
/// count against it as if copied, though they cost no memory of criuz's.
pub fn default_absorb(available: u64) -> usize {
    usize::try_from(available / 4).unwrap_or(usize::MAX).max(pipeline_budget(available))
}

/// Cores a dump leaves to CRIU while it writes (CRIU writes from one
/// thread; criuz's thread that drains its pipes mostly waits in splice).
/// By measurement on 2 cores (1 GiB, `criuz-bench --configs
/// criu-dir,criu-tmpfs,criuz-lz4`, two rounds of 3 runs each way, session
/// 20): one worker compressing while CRIU writes against none, durable dump
/// mixed 0.59-0.60 s against 0.90-1.34, text 0.92-0.95 against 1.33-1.53,
/// jvm 1.23-1.24 against 1.47; frozen 0.39-0.48 s against 0.46-0.76 (CRIU
/// alone on tmpfs: 0.49-0.52); dump memory 421-860 MiB against 1035-1055.
pub const CAPTURE_CORES: usize = 1;

/// Workers of `threads` that compress while CRIU still writes, on the cores
/// it leaves spare: 1 of 2, 15 of 16. What they cannot keep up with is
/// absorbed (the budget), and held workers join only when it is nearly spent.
pub fn free_while_capturing(threads: usize) -> usize {
    threads.min(default_threads().saturating_sub(CAPTURE_CORES))
}

/// The most worker threads a pipeline is given (`-j`): well past the cores
/// of any machine criuz runs on (the pipelines scale to the cores, not
/// beyond), and far from the thread limits a mistyped `-j` would run into.
pub const MAX_THREADS: usize = 1024;

/// Number of worker threads to use when the user did not say: all cores
/// (as affinity and a cgroup's CPU quota allow). Asked once: the answer
/// reads the cgroup's files, and a command asks more than once.
pub fn default_threads() -> usize {
    static CORES: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *CORES.get_or_init(|| std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1))
}

/// Results a dump's workers may finish ahead of its writer: the default
/// budget's worth of blocks, at least two per worker.
pub fn results_ahead(block_size: usize, threads: usize) -> usize {
    (DEFAULT_MEMORY_BUDGET / block_size.max(1)).max(2 * threads).max(2)
}

/// Jobs in flight for a memory budget, counting input and output of each block.
pub fn window_for(budget: usize, block_size: usize, threads: usize) -> usize {
    (budget / (2 * block_size.max(1))).max(2 * threads).max(2)
}

/// Runs `step` on `threads` threads (the caller's among them), each with a
/// state of its own from `state` (its decoder, its buffer), until every
/// thread's `step` says there is no more work (`Ok(false)`) or one fails:
/// the first error stops the other threads before their next step and is
/// returned. For work that needs no order, only that nothing goes on after
/// a failure (a restore's blocks, placed or written for CRIU).
pub fn until_done_or_failed<S>(
    threads: usize,
    state: impl Fn() -> S + Sync,
    step: impl Fn(&mut S) -> Result<bool> + Sync,
) -> Result<()> {
    until_done_or_failed_on(Crew::Spawn(threads), state, step)
}

/// The threads that run [`until_done_or_failed_on`]'s work.
#[derive(Clone, Copy)]
pub enum Crew<'p> {
    /// This many, spawned for the call (the calling thread is one of them).
    Spawn(usize),
    /// Every thread of a pool kept across calls, while the calling thread
    /// waits: for work cut into short calls, each of which would otherwise
    /// pay for spawning its threads.
    Pool(&'p rayon::ThreadPool),
}

/// [`until_done_or_failed`] on the threads of `crew`.
pub fn until_done_or_failed_on<S>(
    crew: Crew<'_>,
    state: impl Fn() -> S + Sync,
    step: impl Fn(&mut S) -> Result<bool> + Sync,
) -> Result<()> {
    let stop = AtomicBool::new(false);
    let failed: Mutex<Option<Error>> = Mutex::new(None);
    let work = || {
        let mut own = state();
        while !stop.load(Ordering::Relaxed) {
            match step(&mut own) {
                Ok(true) => {}
                Ok(false) => return,
                Err(e) => {
                    failed.lock().unwrap_or_else(|p| p.into_inner()).get_or_insert(e);
                    stop.store(true, Ordering::Relaxed);
                    return;
                }
            }
        }
    };
    match crew {
        Crew::Spawn(threads) => std::thread::scope(|s| {
            for _ in 1..threads.max(1) {
                s.spawn(work);
            }
            work();
        }),
        Crew::Pool(pool) => {
            pool.broadcast(|_| work());
        }
    }
    failed.into_inner().unwrap_or_else(|p| p.into_inner()).map_or(Ok(()), Err)
}

/// Keeps an engine's workers back until its queue nears full or the hold is
/// released (see the module doc).
#[derive(Default)]
pub struct Hold {
    held: AtomicBool,
    /// Workers (the first ones) that the hold never holds.
    free: usize,
    lock: Mutex<()>,
    turn: Condvar,
}

thread_local! {
    /// Whether this thread is a worker its hold leaves free.
    static FREE_WORKER: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

impl Hold {
    /// A hold in force from the start.
    pub fn new() -> Arc<Hold> {
        Hold::with_free(0)
    }

    /// A hold in force from the start that leaves the first `free` workers
    /// free.
    pub fn with_free(free: usize) -> Arc<Hold> {
        Arc::new(Hold { held: AtomicBool::new(true), free, ..Hold::default() })
    }

    /// Whether the calling worker runs under backlog: held, it was started
    /// only because the queue neared full.
    pub fn hurried(&self) -> bool {
        self.is_held() && !FREE_WORKER.with(|f| f.get())
    }

    /// A hold that never holds.
    pub fn released() -> Arc<Hold> {
        Arc::new(Hold::default())
    }

    pub fn is_held(&self) -> bool {
        self.held.load(Ordering::Acquire)
    }

    /// Lets the workers run freely from now on.
    pub fn release(&self) {
        let _guard = self.lock.lock().unwrap_or_else(|p| p.into_inner());
        self.held.store(false, Ordering::Release);
        self.turn.notify_all();
    }

    /// Waits until a worker may take a job from a queue holding `queued`.
    fn wait_turn(&self, queued: &dyn Fn() -> usize, high_water: usize) {
        let mut guard = self.lock.lock().unwrap_or_else(|p| p.into_inner());
        while self.is_held() && queued() < high_water {
            guard = self.turn.wait(guard).unwrap_or_else(|p| p.into_inner());
        }
    }

    /// A submit left `queued` jobs waiting: wakes the workers at high water.
    fn submitted(&self, queued: usize, high_water: usize) {
        if self.is_held() && queued >= high_water {
            let _guard = self.lock.lock().unwrap_or_else(|p| p.into_inner());
            self.turn.notify_all();
        }
    }
}

/// The queue length at which held workers start: three quarters of the
/// window, so the producer stalls only once the budget is really spent.
fn high_water(window: usize) -> usize {
    (window - window / 4).max(1)
}

struct SubmitState<J> {
    next_seq: u64,
    jobs: Sender<(u64, J)>,
    hold: Arc<Hold>,
    high_water: usize,
}

impl<J> Drop for SubmitState<J> {
    /// No more jobs will come: held workers must drain what is queued.
    fn drop(&mut self) {
        self.hold.release();
    }
}

pub struct Submitter<J> {
    state: Arc<Mutex<SubmitState<J>>>,
    tokens: Sender<()>,
}

impl<J> Clone for Submitter<J> {
    fn clone(&self) -> Self {
        Submitter { state: self.state.clone(), tokens: self.tokens.clone() }
    }
}

impl<J: Send> Submitter<J> {
    /// Queues a job behind every job submitted before it. Blocks while the
    /// window is full; fails with `Cancelled` once the collector is gone.
    pub fn submit(&self, job: J) -> Result<()> {
        let mut st = self.state.lock().map_err(|_| Error::Cancelled)?;
        self.tokens.send(()).map_err(|_| Error::Cancelled)?;
        let seq = st.next_seq;
        st.next_seq += 1;
        st.jobs.send((seq, job)).map_err(|_| Error::Cancelled)?;
        st.hold.submitted(st.jobs.len(), st.high_water);
        Ok(())
    }
}

pub struct Collector<R> {
    results: Receiver<(u64, R)>,
    tokens: Receiver<()>,
    pending: BTreeMap<u64, R>,
    next: u64,
    workers: Vec<crate::threads::Finished>,
    ahead: Arc<Ahead>,
}

/// Results done and not yet collected, and how many the workers may run
/// ahead of the collector.
struct Ahead {
    done: Mutex<usize>,
    turn: Condvar,
    most: usize,
    /// The collector is gone: nobody will collect, so nobody waits.
    closed: AtomicBool,
}

impl Ahead {
    fn new(most: usize) -> Ahead {
        Ahead { done: Mutex::new(0), turn: Condvar::new(), most: most.max(1), closed: AtomicBool::new(false) }
    }

    /// Waits until a worker may start another job. The oldest job not yet
    /// collected is always being worked on or done (jobs are taken in
    /// order), so the collector can always make room.
    fn wait_room(&self) {
        let mut done = self.done.lock().unwrap_or_else(|p| p.into_inner());
        while *done >= self.most && !self.closed.load(Ordering::Acquire) {
            done = self.turn.wait(done).unwrap_or_else(|p| p.into_inner());
        }
    }

    fn finished_one(&self) {
        *self.done.lock().unwrap_or_else(|p| p.into_inner()) += 1;
    }

    fn collected_one(&self) {
        let mut done = self.done.lock().unwrap_or_else(|p| p.into_inner());
        *done = done.saturating_sub(1);
        self.turn.notify_one();
    }

    fn close(&self) {
        let _guard = self.done.lock().unwrap_or_else(|p| p.into_inner());
        self.closed.store(true, Ordering::Release);
        self.turn.notify_all();
    }
}

impl<R> Drop for Collector<R> {
    fn drop(&mut self) {
        self.ahead.close();
    }
}

impl<R> Collector<R> {
    /// The next result in submission order if it is ready, without waiting.
    pub fn try_next(&mut self) -> Option<R> {
        while let Ok((seq, r)) = self.results.try_recv() {
            self.pending.insert(seq, r);
        }
        let r = self.pending.remove(&self.next)?;
        self.next += 1;
        self.ahead.collected_one();
        let _ = self.tokens.recv();
        Some(r)
    }
}

impl<R> Iterator for Collector<R> {
    type Item = R;

    /// The next result in submission order; `None` once every submitter is
    /// dropped and every job is collected.
    fn next(&mut self) -> Option<R> {
        loop {
            if let Some(r) = self.pending.remove(&self.next) {
                self.next += 1;
                self.ahead.collected_one();
                let _ = self.tokens.recv();
                return Some(r);
            }
            match self.results.recv() {
                Ok((seq, r)) => {
                    self.pending.insert(seq, r);
                }
                Err(_) => {
                    for w in self.workers.drain(..) {
                        let _ = w.join();
                    }
                    return None;
                }
            }
        }
    }
}

/// Starts `threads` workers. Each builds its state with `init` and runs `work`
/// on the jobs it takes.
pub fn start<J, R, S, I, W>(threads: usize, window: usize, init: I, work: W) -> (Submitter<J>, Collector<R>)
where
    J: Send + 'static,
    R: Send + 'static,
    I: Fn() -> S + Send + Sync + 'static,
    W: Fn(&mut S, J) -> R + Send + Sync + 'static,
{
    start_held(threads, window, window, Hold::released(), init, work)
}

/// [`start`] with the workers behind `hold`, and at most `ahead` results
/// done before the collector takes them (see the module doc).
pub fn start_held<J, R, S, I, W>(
    threads: usize,
    window: usize,
    ahead: usize,
    hold: Arc<Hold>,
    init: I,
    work: W,
) -> (Submitter<J>, Collector<R>)
where
    J: Send + 'static,
    R: Send + 'static,
    I: Fn() -> S + Send + Sync + 'static,
    W: Fn(&mut S, J) -> R + Send + Sync + 'static,
{
    let window = window.max(1);
    let high_water = high_water(window);
    let (job_tx, job_rx) = bounded::<(u64, J)>(window);
    let (res_tx, res_rx) = unbounded::<(u64, R)>();
    let (tok_tx, tok_rx) = bounded::<()>(window);
    let init = Arc::new(init);
    let work = Arc::new(work);
    let ahead = Arc::new(Ahead::new(ahead));
    let mut workers: Vec<crate::threads::Finished> = Vec::new();
    for i in 0..threads.max(1) {
        let (job_rx, res_tx, init, work) = (job_rx.clone(), res_tx.clone(), init.clone(), work.clone());
        let (hold, ahead) = (hold.clone(), ahead.clone());
        let spawned = crate::threads::spawn("criuz-worker", move || {
            let free = i < hold.free;
            FREE_WORKER.with(|f| f.set(free));
            let mut state = init();
            loop {
                if !free {
                    hold.wait_turn(&|| job_rx.len(), high_water);
                }
                ahead.wait_room();
                let Ok((seq, job)) = job_rx.recv() else { break };
                let result = work(&mut state, job);
                ahead.finished_one();
                if res_tx.send((seq, result)).is_err() {
                    break;
                }
            }
        });
        match spawned {
            Ok(worker) => workers.push(worker),
            // Out of threads (a container's pids limit): the pipeline runs
            // on the workers it has, more slowly, rather than not at all.
            Err(_) if !workers.is_empty() => break,
            // Worded as std's own spawn failure, which ends criuz in one
            // line (`proc::interrupt::end_on_panic`).
            Err(e) => panic!("failed to spawn thread: not a single worker: {e}"),
        }
    }
    let state = SubmitState { next_seq: 0, jobs: job_tx, hold, high_water };
    let submitter = Submitter { state: Arc::new(Mutex::new(state)), tokens: tok_tx };
    let collector = Collector { results: res_rx, tokens: tok_rx, pending: BTreeMap::new(), next: 0, workers, ahead };
    (submitter, collector)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every item is taken once; after a failure no thread takes another,
    /// and the failure is what the call returns.
    #[test]
    fn work_until_done_or_the_first_failure() {
        use std::sync::atomic::AtomicUsize;
        let (next, done) = (AtomicUsize::new(0), AtomicUsize::new(0));
        let step = |_: &mut ()| -> Result<bool> {
            if next.fetch_add(1, Ordering::Relaxed) >= 1000 {
                return Ok(false);
            }
            done.fetch_add(1, Ordering::Relaxed);
            Ok(true)
        };
        until_done_or_failed(4, || (), step).expect("no failure");
        assert_eq!(done.load(Ordering::Relaxed), 1000);

        let (next, after) = (AtomicUsize::new(0), AtomicUsize::new(0));
        let step = |_: &mut ()| -> Result<bool> {
            let i = next.fetch_add(1, Ordering::Relaxed);
            if i == 10 {
                return Err(Error::Usage("item 10".into()));
            }
            if i > 10 {
                after.fetch_add(1, Ordering::Relaxed);
            }
            Ok(i < 1_000_000)
        };
        let err = until_done_or_failed(4, || (), step).expect_err("item 10 fails");
        assert!(err.to_string().contains("item 10"), "{err}");
        // Threads already inside a step may finish it; none goes on.
        assert!(after.load(Ordering::Relaxed) < 1000, "work went on after the failure");
    }

    /// Workers stop once `ahead` results wait for the collector, and go on
    /// as it takes them; every result still comes back, in order.
    #[test]
    fn workers_wait_for_a_collector_that_falls_behind() {
        use std::sync::atomic::AtomicUsize;
        let worked = Arc::new(AtomicUsize::new(0));
        let counted = worked.clone();
        let (sub, col) = start_held(
            2,
            64,
            4,
            Hold::released(),
            || (),
            move |_, x: u32| {
                counted.fetch_add(1, Ordering::SeqCst);
                x
            },
        );
        for i in 0..40 {
            sub.submit(i).unwrap();
        }
        std::thread::sleep(std::time::Duration::from_millis(100));
        // Two workers may both pass the gate at its last place.
        assert!(worked.load(Ordering::SeqCst) <= 5, "{} jobs done ahead", worked.load(Ordering::SeqCst));
        drop(sub);
        assert_eq!(col.collect::<Vec<_>>(), (0..40).collect::<Vec<_>>());
        assert_eq!(worked.load(Ordering::SeqCst), 40);
    }

    #[test]
    fn the_default_absorb_is_a_share_of_available_memory() {
        assert_eq!(default_absorb(8 << 30), 2 << 30);
        assert_eq!(default_absorb(100 << 20), 25 << 20, "a quarter, where memory is short");
        assert_eq!(default_absorb(0), MIN_MEMORY_BUDGET, "never below the pipeline's least");
        assert_eq!(pipeline_budget(8 << 30), DEFAULT_MEMORY_BUDGET);
        assert_eq!(pipeline_budget(100 << 20), 25 << 20);
        assert_eq!(pipeline_budget(0), MIN_MEMORY_BUDGET);
    }

    #[test]
    fn results_come_back_in_order_from_many_producers() {
        let (sub, col) = start(
            4,
            8,
            || (),
            |_, x: (u32, u32)| {
                if x.1 % 7 == 0 {
                    std::thread::sleep(std::time::Duration::from_millis(1));
                }
                x
            },
        );
        let producers: Vec<_> = (0..3)
            .map(|p| {
                let sub = sub.clone();
                std::thread::spawn(move || {
                    for i in 0..200 {
                        sub.submit((p, i)).unwrap();
                    }
                })
            })
            .collect();
        drop(sub);
        let collected = std::thread::spawn(move || col.collect::<Vec<_>>());
        for p in producers {
            p.join().unwrap();
        }
        let out = collected.join().unwrap();
        assert_eq!(out.len(), 600);
        for p in 0..3 {
            let mine: Vec<u32> = out.iter().filter(|x| x.0 == p).map(|x| x.1).collect();
            assert_eq!(mine, (0..200).collect::<Vec<_>>());
        }
    }

    #[test]
    fn held_workers_wait_for_high_water_or_release() {
        use std::sync::atomic::AtomicUsize;
        let ran = Arc::new(AtomicUsize::new(0));
        let hold = Hold::new();
        let counted = ran.clone();
        // Window 8: held workers start at 6 queued jobs.
        let (sub, mut col) = start_held(
            2,
            8,
            8,
            hold.clone(),
            || (),
            move |_, x: u32| {
                counted.fetch_add(1, Ordering::SeqCst);
                x
            },
        );
        for i in 0..5 {
            sub.submit(i).unwrap();
        }
        std::thread::sleep(std::time::Duration::from_millis(100));
        assert_eq!(ran.load(Ordering::SeqCst), 0, "held workers took jobs below high water");
        sub.submit(5).unwrap();
        let first = (0..200).find_map(|_| {
            std::thread::sleep(std::time::Duration::from_millis(5));
            col.try_next()
        });
        assert_eq!(first, Some(0), "high water did not start the workers");
        let before_release = ran.load(Ordering::SeqCst);
        assert!(before_release < 6, "workers drained below high water while held: {before_release}");
        hold.release();
        drop(sub);
        assert_eq!(col.collect::<Vec<_>>(), (1..6).collect::<Vec<_>>());
        assert_eq!(ran.load(Ordering::SeqCst), 6);
    }

    #[test]
    fn a_free_worker_runs_while_held_and_is_not_hurried() {
        // One free worker of two: below high water it takes every job, and
        // knows it does not work under backlog.
        let (sub, mut col) = start_held(2, 8, 8, Hold::with_free(1), || (), |_, x: u32| x);
        for i in 0..3 {
            sub.submit(i).unwrap();
        }
        let got: Vec<u32> = (0..3)
            .map(|_| {
                (0..400)
                    .find_map(|_| {
                        std::thread::sleep(std::time::Duration::from_millis(5));
                        col.try_next()
                    })
                    .expect("a free worker took the job below high water")
            })
            .collect();
        assert_eq!(got, vec![0, 1, 2]);
        let hold = Hold::with_free(1);
        let (sub, col) = start_held(2, 8, 8, hold.clone(), || (), {
            let hold = hold.clone();
            move |_, x: u32| (x, hold.hurried())
        });
        let mut col = col;
        sub.submit(9).unwrap();
        // Still held (the submitter lives): only the free worker can run it.
        let done = (0..400).find_map(|_| {
            std::thread::sleep(std::time::Duration::from_millis(5));
            col.try_next()
        });
        assert_eq!(done, Some((9, false)), "the free worker ran it under the hold, not hurried");
        assert!(hold.is_held());
        drop(sub);
    }

    #[test]
    fn dropping_every_submitter_releases_a_hold() {
        let (sub, col) = start_held(1, 64, 64, Hold::new(), || (), |_, x: u32| x);
        sub.submit(7).unwrap();
        drop(sub);
        assert_eq!(col.collect::<Vec<_>>(), vec![7]);
    }

    #[test]
    fn submit_fails_after_collector_is_dropped() {
        let (sub, col) = start(1, 2, || (), |_, x: u32| x);
        drop(col);
        let mut failed = false;
        for i in 0..10 {
            if sub.submit(i).is_err() {
                failed = true;
                break;
            }
        }
        assert!(failed);
    }
}

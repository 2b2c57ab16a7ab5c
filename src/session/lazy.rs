//! Lazy restore: the process runs at once, its memory arrives on demand.
//!
//! CRIU's lazy-pages daemon registers the restored process's private
//! anonymous memory with userfaultfd and fetches each page on first touch,
//! then every page left, from a page server; criuz is that page server,
//! answering from the archive's checked blocks (`criu::pageserver`). CRIU
//! cannot stream a lazy restore, so the metadata images go to a private
//! work directory (0700), with each process's pages image holding only the
//! pages CRIU restores itself (those not marked lazy; the lazy ones are
//! holes in a sparse file, which CRIU skips). Shared memory and other page
//! images are written whole.
//!
//! No silent zeros: a page the process never got reads as zero once the
//! daemon is gone. A failure criuz finds (a damaged block, an I/O error)
//! kills the restored tree before criuz's end of the page-server socket
//! closes; the daemon runs under a guard process (`session::guard`) that
//! kills the tree the moment the daemon fails, or criuz dies.

use crate::archive::{parent, BlockSource};
use crate::codec::Decoder;
use crate::criu::images::{self, PageRun};
use crate::criu::pageserver::{self, Request, Wire};
use crate::criu::Criu;
use crate::error::{Error, IoContext, Result, ResultContext};
use crate::format::{check_entry_name, FileKind, PAGE_SIZE};
use crate::session::checkpoint::{
    check_pids_free, criu_failure, publish_pidfile, restore_command, RestoreOptions, WorkDir,
};
use crate::session::guard::{kill_tree, Guard};
use crate::session::serve::zero_plan;
use std::collections::{HashMap, HashSet};
use std::ffi::OsStr;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::fs::FileExt;
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Where the daemon listens for the restore (criu/uffd.c).
const LAZY_SOCKET: &str = "lazy-pages.socket";

#[derive(Clone, Debug, serde::Serialize)]
pub struct LazyReport {
    pub pid: Option<i32>,
    /// Until `criu restore` returned: with `--restore-detached`, until the
    /// tree runs.
    pub running_seconds: f64,
    /// Until the daemon had every page in place.
    pub resident_seconds: f64,
    /// Pages restored by CRIU itself (not lazy).
    pub eager_pages: u64,
    /// Of those, pages made eager as the working set recorded beside the
    /// archive (`<archive>.touch`) by an earlier lazy restore.
    pub working_set_pages: u64,
    /// Where this restore's faults were recorded (none if there were no new
    /// ones, the archive came from a pipe, or its directory is read-only).
    pub working_set_file: Option<String>,
    /// Pages the daemon fetched, and in how many requests.
    pub lazy_pages: u64,
    pub requests: u64,
    pub criu_exit: i32,
}

/// One process's lazily served memory.
struct Process {
    pages_file: u32,
    runs: Vec<PageRun>,
}

/// Decoded blocks kept for the page server: the daemon's background fill
/// asks in address order while faults ask anywhere, so one cached block
/// would be decoded again at every switch. Bounded in bytes; least
/// recently used first out.
const CACHE_BYTES: usize = 24 << 20;
/// Blocks a decoder thread prepares beyond the last one asked for.
const DECODE_AHEAD: usize = 8;

type Key = (u32, usize);

#[derive(Default)]
struct Cache {
    blocks: HashMap<Key, Arc<Vec<u8>>>,
    order: std::collections::VecDeque<Key>,
    bytes: usize,
    /// The last block asked for, and whether the decoder should stop.
    cursor: Option<Key>,
    done: bool,
}

impl Cache {
    fn get(&mut self, k: Key) -> Option<Arc<Vec<u8>>> {
        let b = self.blocks.get(&k)?.clone();
        if let Some(i) = self.order.iter().position(|o| *o == k) {
            self.order.remove(i);
            self.order.push_back(k);
        }
        Some(b)
    }

    fn put(&mut self, k: Key, b: Arc<Vec<u8>>) {
        if self.blocks.contains_key(&k) {
            return;
        }
        self.bytes += b.len();
        self.blocks.insert(k, b);
        self.order.push_back(k);
        while self.bytes > CACHE_BYTES && self.order.len() > 1 {
            let old = self.order.pop_front().expect("non-empty");
            if let Some(b) = self.blocks.remove(&old) {
                self.bytes -= b.len();
            }
        }
    }
}

/// The pages of an archive's pages images through their checked blocks.
struct Blocks {
    source: Arc<dyn BlockSource>,
    starts: std::sync::Mutex<HashMap<u32, Arc<Vec<u64>>>>,
    cache: std::sync::Mutex<Cache>,
    wake: std::sync::Condvar,
}

impl Blocks {
    fn new(source: Arc<dyn BlockSource>) -> Blocks {
        Blocks { source, starts: Default::default(), cache: Default::default(), wake: Default::default() }
    }

    /// Where each block of image `file_id` starts (raw bytes).
    fn starts(&self, file_id: u32) -> Arc<Vec<u64>> {
        let mut m = self.starts.lock().expect("starts lock");
        m.entry(file_id)
            .or_insert_with(|| {
                let mut v = Vec::new();
                while let Some((_, raw_pos)) = self.source.block_header(file_id, v.len()) {
                    v.push(raw_pos);
                }
                Arc::new(v)
            })
            .clone()
    }

    fn decode(&self, dec: &mut Decoder, k: Key) -> Result<Arc<Vec<u8>>> {
        let b = self.source.block(k.0, k.1)?.ok_or_else(|| Error::corrupt(0, format!("block {} is missing", k.1)))?;
        let mut out = Vec::new();
        b.decode(dec, &mut out)?;
        Ok(Arc::new(out))
    }

    /// Up to `n` pages from page `page` of image `file_id` (fewer at a block
    /// end): the decoded block and the byte range in it.
    fn pages(
        &self,
        dec: &mut Decoder,
        file_id: u32,
        page: u64,
        n: u64,
    ) -> Result<(Arc<Vec<u8>>, std::ops::Range<usize>)> {
        let starts = self.starts(file_id);
        let at = page * PAGE_SIZE as u64;
        let i = starts.partition_point(|&s| s <= at).checked_sub(1);
        let i = i.ok_or_else(|| Error::corrupt(0, format!("page {page} lies before the first block")))?;
        let k = (file_id, i);
        // Only the daemon's background fill (several pages a request, in
        // address order) moves the decoder: a fault asks for one page
        // anywhere, and decoding after it would take CPU from the fill.
        let cached = {
            let mut c = self.cache.lock().expect("cache lock");
            if n > 1 {
                c.cursor = Some(k);
            }
            c.get(k)
        };
        if n > 1 {
            self.wake.notify_one();
        }
        let data = match cached {
            Some(d) => d,
            None => {
                let d = self.decode(dec, k)?;
                self.cache.lock().expect("cache lock").put(k, d.clone());
                d
            }
        };
        let start = (at - starts[i]) as usize;
        let whole = data.len().saturating_sub(start) / PAGE_SIZE;
        let take = (n as usize).min(whole);
        if take == 0 {
            return Err(Error::corrupt(0, format!("page {page} is not stored whole")));
        }
        Ok((data, start..start + take * PAGE_SIZE))
    }

    /// Decodes the blocks after the last one asked for until `finish`. A
    /// block that fails is left to the request that needs it, which reports
    /// the failure.
    fn decode_ahead(&self) {
        let mut dec = Decoder::new();
        let mut c = self.cache.lock().expect("cache lock");
        loop {
            if c.done {
                return;
            }
            let Some((file, i)) = c.cursor else {
                c = self.wake.wait(c).expect("cache lock");
                continue;
            };
            let n = self.starts(file).len();
            let next = (i + 1..(i + 1 + DECODE_AHEAD).min(n)).find(|&j| !c.blocks.contains_key(&(file, j)));
            let Some(j) = next else {
                c = self.wake.wait(c).expect("cache lock");
                continue;
            };
            drop(c);
            let got = self.decode(&mut dec, (file, j));
            c = self.cache.lock().expect("cache lock");
            match got {
                Ok(d) => c.put((file, j), d),
                // Leave it to the request path; wait for the next request.
                Err(_) => c = self.wake.wait(c).expect("cache lock"),
            }
        }
    }

    fn finish(&self) {
        self.cache.lock().expect("cache lock").done = true;
        self.wake.notify_all();
    }
}

/// Zero runs shorter than this stay in a lazy pagemap (sent as zeros): the
/// daemon fetches each gap-free range apart, so leaving out scattered zero
/// pages would multiply its requests. 16 pages is its smallest transfer.
const LAZY_MIN_ZERO_RUN: u64 = 16;

/// A process's pagemap as written for a lazy restore: its runs with their
/// pages' positions in the archive's image (`first`), and where CRIU finds
/// each run in the pages image written for it.
struct LazyPagemap {
    pid: u32,
    pages_id: u32,
    runs: Vec<(PageRun, u64)>,
    image_pages: u64,
    /// Pages made eager because the last lazy restore saw them faulted.
    working_set: u64,
}

/// Rewrites a process's pagemap without its long zero runs (those read as
/// zero anyway); `None` if CRIU's pagemap is not one criuz can rewrite.
fn lazy_pagemap(
    source: &dyn BlockSource,
    pid: &str,
    pagemap: &[u8],
    hot: Option<&HashSet<u64>>,
) -> Result<Option<(Vec<u8>, LazyPagemap)>> {
    let Some((pages_id, original)) = images::pagemap_runs(pagemap) else { return Ok(None) };
    let plan = zero_plan(source, pid, pagemap, LAZY_MIN_ZERO_RUN)?;
    let mut written = plan.as_ref().map_or(pagemap, |p| &p.pagemap[..]).to_vec();
    let Some((_, kept)) = images::pagemap_runs(&written) else { return Ok(None) };
    let mut by_vaddr = original.clone();
    by_vaddr.sort_by_key(|r| r.vaddr);
    let mut runs = Vec::with_capacity(kept.len());
    for k in kept {
        // Each kept run lies inside one original entry: its pages sit
        // together in the archive's image.
        let i = by_vaddr.partition_point(|r| r.vaddr <= k.vaddr).checked_sub(1);
        let o = i.map(|i| by_vaddr[i]).filter(|o| (k.vaddr - o.vaddr) / PAGE_SIZE as u64 + k.nr <= o.nr);
        let Some(o) = o else { return Ok(None) };
        let at = PageRun { first: o.first + (k.vaddr - o.vaddr) / PAGE_SIZE as u64, ..k };
        runs.push((at, k.first));
    }
    let mut working_set = 0;
    if let Some(hot) = hot.filter(|h| !h.is_empty()) {
        // The pages the last lazy restore saw faulted become eager: CRIU
        // restores them before the process runs.
        let mut split = Vec::with_capacity(runs.len());
        for (r, at) in runs {
            let is_hot = |j: u64| r.lazy && hot.contains(&(r.vaddr + j * PAGE_SIZE as u64));
            let mut j = 0;
            while j < r.nr {
                let h = is_hot(j);
                let mut end = j + 1;
                while end < r.nr && is_hot(end) == h {
                    end += 1;
                }
                let piece = PageRun {
                    vaddr: r.vaddr + j * PAGE_SIZE as u64,
                    nr: end - j,
                    first: r.first + j,
                    lazy: r.lazy && !h,
                };
                working_set += if h { end - j } else { 0 };
                split.push((piece, at + j));
                j = end;
            }
        }
        runs = split;
        let in_image: Vec<PageRun> = runs.iter().map(|&(r, at)| PageRun { first: at, ..r }).collect();
        written = images::pagemap_of_runs(pages_id, &in_image);
    }
    let image_pages = runs.iter().map(|(r, _)| r.nr).sum();
    let pid = pid.parse().map_err(|_| Error::corrupt(0, format!("pagemap-{pid}.img: not a pid")))?;
    Ok(Some((written, LazyPagemap { pid, pages_id, runs, image_pages, working_set })))
}

/// Writes the archive's files into `dir` for CRIU: every plain file, each
/// process's pagemap without long zero runs, and its pages image with only
/// the pages that pagemap does not mark lazy. Returns the lazily served
/// processes by pid, and the eager page count.
fn materialize(blocks: &Blocks, dir: &Path, hot: &WorkingSet) -> Result<(HashMap<u32, Process>, u64, u64)> {
    let source = &blocks.source;
    let mut dec = Decoder::new();
    let label = source.label().to_string();
    let files = source.index().files.clone();
    let mut lazy_images: HashMap<u32, LazyPagemap> = HashMap::new();
    let mut working_set = 0;
    for f in files.iter().filter(|f| f.kind == FileKind::Plain) {
        check_entry_name(&f.name).map_err(|e| Error::corrupt(0, format!("{}: {e}", f.name)))?;
        let mut bytes = source.read_file(f).context(|| format!("{label}: {}", f.name))?;
        if let Some(pid) = images::process_pagemap_pid(&f.name) {
            let pid_hot = pid.parse().ok().and_then(|p: u32| hot.get(&p));
            let (written, lazy) =
                lazy_pagemap(&**source, pid, &bytes, pid_hot).context(|| format!("{label}: {}", f.name))?.ok_or_else(
                    || Error::Usage(format!("{label}: {}: cannot restore lazily: pagemap not understood", f.name)),
                )?;
            bytes = written;
            working_set += lazy.working_set;
            lazy_images.insert(lazy.pages_id, lazy);
        }
        let path = dir.join(&f.name);
        std::fs::write(&path, &bytes).at(&path)?;
    }
    let mut processes = HashMap::new();
    let mut eager = 0;
    for f in files.iter().filter(|f| f.kind == FileKind::Pages) {
        check_entry_name(&f.name).map_err(|e| Error::corrupt(0, format!("{}: {e}", f.name)))?;
        let path = dir.join(&f.name);
        let out = std::fs::File::create(&path).at(&path)?;
        let lazy = images::pages_image_id(&f.name).and_then(|id| lazy_images.remove(&id));
        let total_pages = f.raw_size.div_ceil(PAGE_SIZE as u64);
        // Runs CRIU reads itself, (archive page, image page, pages): all of
        // a non-process image, the eager runs of a process's.
        let eager_runs: Vec<(u64, u64, u64)> = match &lazy {
            Some(l) => l.runs.iter().filter(|(r, _)| !r.lazy).map(|(r, at)| (r.first, *at, r.nr)).collect(),
            None => vec![(0, 0, total_pages)],
        };
        for (first, at, nr) in eager_runs {
            let mut done = 0;
            while done < nr {
                let (block, range) = blocks
                    .pages(&mut dec, f.file_id, first + done, nr - done)
                    .context(|| format!("{label}: {}", f.name))?;
                out.write_all_at(&block[range.clone()], (at + done) * PAGE_SIZE as u64).at(&path)?;
                done += (range.len() / PAGE_SIZE) as u64;
            }
            eager += nr;
        }
        let image_len = lazy.as_ref().map_or(f.raw_size, |l| l.image_pages * PAGE_SIZE as u64);
        out.set_len(image_len).at(&path)?;
        if let Some(l) = lazy {
            let mut runs: Vec<PageRun> = l.runs.into_iter().map(|(r, _)| r).collect();
            runs.sort_by_key(|r| r.vaddr);
            processes.insert(l.pid, Process { pages_file: f.file_id, runs });
        }
    }
    Ok((processes, eager, working_set))
}

/// Answers the daemon until it closes; returns (pages, requests).
fn serve_pages(
    blocks: &Blocks,
    processes: &HashMap<u32, Process>,
    mut sock: &UnixStream,
    wire: Wire,
    faults: &mut Vec<(u32, u64)>,
) -> Result<(u64, u64)> {
    let label = blocks.source.label().to_string();
    let mut dec = Decoder::new();
    let (mut pages, mut requests) = (0u64, 0u64);
    let proto = |e: pageserver::ProtocolError| Error::Protocol(e.to_string());
    while let Some(req) = pageserver::read_request(&mut sock, wire).map_err(proto)? {
        let (pid, vaddr, nr_pages) = match req {
            Request::Close => {
                pageserver::send_closed(&mut sock)?;
                break;
            }
            Request::Get { pid, vaddr, nr_pages } => (pid, vaddr, nr_pages),
        };
        requests += 1;
        // The daemon asks for a faulted page alone; its fill asks for more.
        if nr_pages == 1 && faults.len() < WORKING_SET_MAX {
            faults.push((pid, vaddr));
        }
        let unknown =
            || Error::Protocol(format!("the daemon asked for pages of {pid} at {vaddr:#x}, which it has not"));
        let p = processes.get(&pid).ok_or_else(unknown)?;
        let i = p.runs.partition_point(|r| r.vaddr <= vaddr).checked_sub(1).ok_or_else(unknown)?;
        let run = p.runs[i];
        let off = (vaddr - run.vaddr) / PAGE_SIZE as u64;
        if vaddr % PAGE_SIZE as u64 != 0 || off >= run.nr || !run.lazy {
            return Err(unknown());
        }
        let (block, range) = blocks
            .pages(&mut dec, p.pages_file, run.first + off, nr_pages.min(run.nr - off))
            .context(|| label.clone())?;
        pageserver::send_pages(&mut sock, wire, pid, vaddr, &block[range.clone()])?;
        pages += (range.len() / PAGE_SIZE) as u64;
    }
    Ok((pages, requests))
}

/// Copies of the userfaultfds the daemon holds for the restored tree. While
/// any copy is open, the kernel keeps the tree's lazy ranges registered:
/// a thread faulting there after the daemon died waits (for the guard's
/// kill) instead of getting a zero page.
struct HeldUffds {
    daemon: OwnedFd,
    daemon_pid: i32,
    seen: HashSet<i32>,
    held: Vec<OwnedFd>,
}

impl HeldUffds {
    fn new(daemon_pid: i32) -> Result<HeldUffds> {
        // SAFETY: pidfd_open returns a new descriptor or -1.
        let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, daemon_pid, 0) } as i32;
        if fd < 0 {
            return Err(std::io::Error::last_os_error().into());
        }
        // SAFETY: the descriptor is new and ours.
        let daemon = unsafe { OwnedFd::from_raw_fd(fd) };
        Ok(HeldUffds { daemon, daemon_pid, seen: HashSet::new(), held: Vec::new() })
    }

    /// Takes a copy of every userfaultfd the daemon got since the last call.
    fn collect(&mut self) -> Result<()> {
        let dir = format!("/proc/{}/fd", self.daemon_pid);
        let Ok(entries) = std::fs::read_dir(&dir) else { return Ok(()) };
        for e in entries.flatten() {
            let Some(n) = e.file_name().to_str().and_then(|n| n.parse::<i32>().ok()) else { continue };
            if self.seen.contains(&n) {
                continue;
            }
            let is_uffd = std::fs::read_link(e.path()).is_ok_and(|l| l.as_os_str() == "anon_inode:[userfaultfd]");
            if !is_uffd {
                continue;
            }
            // SAFETY: pidfd_getfd returns a new descriptor or -1.
            let fd = unsafe { libc::syscall(libc::SYS_pidfd_getfd, self.daemon.as_raw_fd(), n, 0) } as i32;
            if fd < 0 {
                let e = std::io::Error::last_os_error();
                return Err(Error::Criu(format!("cannot hold the restored tree's userfaultfd: {e}")));
            }
            self.seen.insert(n);
            // SAFETY: the descriptor is new and ours.
            self.held.push(unsafe { OwnedFd::from_raw_fd(fd) });
        }
        Ok(())
    }
}

/// Pages by pid that a lazy restore saw faulted (first touches, in order),
/// kept beside the archive as `<archive>.touch`: the next lazy restore
/// makes them eager, so the working set is in place before the process
/// runs (stock CRIU fetches in its own order; this is the order we can set).
/// Only a hint: a wrong one changes which pages come eagerly, never their
/// bytes, which always come from checked blocks.
type WorkingSet = HashMap<u32, HashSet<u64>>;

const WORKING_SET_MAX: usize = 1 << 20;
const TOUCH_HEADER: &str = "criuz working set 1";

fn touch_path(input: &Path) -> Option<std::path::PathBuf> {
    (input != Path::new("-")).then(|| {
        let mut p = input.as_os_str().to_owned();
        p.push(".touch");
        p.into()
    })
}

/// The recorded faults, in order; empty if there is no usable record.
fn load_touches(path: Option<&Path>) -> Vec<(u32, u64)> {
    let Some(text) = path.and_then(|p| std::fs::read_to_string(p).ok()) else { return Vec::new() };
    let mut lines = text.lines();
    if lines.next() != Some(TOUCH_HEADER) {
        return Vec::new();
    }
    lines
        .filter_map(|l| {
            let (pid, vaddr) = l.split_once(' ')?;
            Some((pid.parse().ok()?, u64::from_str_radix(vaddr, 16).ok()?))
        })
        .take(WORKING_SET_MAX)
        .collect()
}

/// Writes the old record followed by the new faults (complete or not at all,
/// 0600: it maps the process's memory).
fn save_touches(path: &Path, old: &[(u32, u64)], new: &[(u32, u64)]) -> Result<()> {
    let mut seen = HashSet::new();
    let mut text = format!("{TOUCH_HEADER}\n");
    for &(pid, vaddr) in old.iter().chain(new).take(WORKING_SET_MAX) {
        if seen.insert((pid, vaddr)) {
            text.push_str(&format!("{pid} {vaddr:x}\n"));
        }
    }
    let tmp = path.with_extension("touch.criuz-tmp");
    {
        use std::io::Write;
        use std::os::unix::fs::OpenOptionsExt;
        let mut f =
            std::fs::OpenOptions::new().write(true).create(true).truncate(true).mode(0o600).open(&tmp).at(&tmp)?;
        f.write_all(text.as_bytes()).at(&tmp)?;
    }
    std::fs::rename(&tmp, path).at(path)
}

/// Restores lazily: see the module documentation.
pub fn restore_lazy(o: &RestoreOptions, criu: &Criu) -> Result<LazyReport> {
    let started = Instant::now();
    let archive = parent::open(&o.input, o.pipe_buffer, &o.parents)?;
    check_pids_free(&*archive)?;
    let source: Arc<dyn BlockSource> = archive;
    let pids: Vec<i32> = match source.find("pstree.img") {
        Some(e) => images::pstree_pids(&source.read_file(e)?).unwrap_or_default(),
        None => Vec::new(),
    }
    .into_iter()
    .map(|p| p as i32)
    .collect();
    if pids.is_empty() {
        return Err(Error::Usage(format!("{}: no process tree to restore lazily", source.label())));
    }
    let work = WorkDir::new("criuz-lazy-")?;
    let blocks = Blocks::new(source.clone());
    let touch = touch_path(&o.input);
    let recorded = load_touches(touch.as_deref());
    let mut hot = WorkingSet::new();
    for &(pid, vaddr) in &recorded {
        hot.entry(pid).or_default().insert(vaddr);
    }
    let (processes, eager_pages, working_set_pages) = materialize(&blocks, work.path(), &hot)?;
    let mut faults = Vec::new();
    blocks.cache.lock().expect("cache lock").cursor = None;

    let (ours, theirs) = UnixStream::pair()?;
    let fd = theirs.as_raw_fd().to_string();
    let words = ["lazy-pages", "--page-server", "--ps-socket", &fd, "-o", "lazy-pages.log", "-D"];
    let args: Vec<&OsStr> = words.iter().map(OsStr::new).chain([work.path().as_os_str()]).collect();
    let mut guard = Guard::start(&criu.path, &args, theirs.as_raw_fd(), &pids)?;
    drop(theirs);
    let waited = Instant::now();
    while !work.path().join(LAZY_SOCKET).exists() {
        if let Some(status) = guard.daemon_ended() {
            return Err(criu_failure("criu lazy-pages", status, &work.save_log("lazy-pages.log")));
        }
        if waited.elapsed() > Duration::from_secs(30) {
            return Err(Error::Criu("criu lazy-pages did not start listening within 30 s".into()));
        }
        std::thread::sleep(Duration::from_millis(2));
    }

    let mut uffds = HeldUffds::new(guard.daemon_pid)?;
    let restoring = AtomicBool::new(true);
    let wire = Wire::for_version(&criu.version);
    let pidfile = work.path().join("restored.pid");
    let mut cmd = restore_command(criu, o, "--lazy-pages", work.path(), &pidfile);

    // Kills the tree before the daemon sees the socket end (it would leave
    // the process with holes that read as zeros), then ends the socket for
    // every copy (the guard's too), so the daemon stops waiting.
    let abort = || {
        kill_tree(&pids);
        let _ = ours.shutdown(std::net::Shutdown::Both);
    };
    let (served, held, status, running, published) = std::thread::scope(|s| {
        s.spawn(|| blocks.decode_ahead());
        let server = s.spawn(|| {
            let r = serve_pages(&blocks, &processes, &ours, wire, &mut faults);
            blocks.finish();
            if r.is_err() {
                abort();
            }
            r
        });
        // The daemon receives one userfaultfd per process while CRIU
        // restores, before the tree resumes: collected every millisecond
        // meanwhile, and once more when the tree runs.
        let holder = s.spawn(|| {
            while restoring.load(Ordering::Relaxed) {
                uffds.collect()?;
                std::thread::sleep(Duration::from_millis(1));
            }
            uffds.collect()
        });
        let status = cmd.status();
        restoring.store(false, Ordering::Relaxed);
        let held = holder.join().unwrap_or(Err(Error::Cancelled));
        let running = started.elapsed().as_secs_f64();
        let mut published = Ok(());
        if status.as_ref().is_ok_and(|s| s.success()) {
            // The tree runs while its pages still arrive.
            published = publish_pidfile(&pidfile, o.pidfile.as_deref());
        } else {
            // The restore failed (or, without -d, the tree ended badly): the
            // daemon would wait for it forever.
            guard.stop_daemon();
        }
        if held.is_err() {
            // Without the copies a dead daemon would mean zeros: not run so.
            abort();
        }
        (server.join().unwrap_or(Err(Error::Cancelled)), held, status, running, published)
    });
    let status = status.map_err(|e| Error::Criu(format!("cannot run {}: {e}", criu.path.display())))?;
    let stopped = !status.success();
    let daemon_status = guard.wait_daemon();
    let resident = started.elapsed().as_secs_f64();
    let pid = std::fs::read_to_string(&pidfile).ok().and_then(|s| s.trim().parse().ok());
    let (lazy_pages, requests) = match served {
        Err(e) => {
            let log = work.save_log("lazy-pages.log");
            return Err(e.context(format!("lazy restore failed, restored tree killed (daemon log: {})", log.display())));
        }
        Ok(n) => n,
    };
    held.map_err(|e| e.context("restored tree killed".to_string()))?;
    if o.detach && !status.success() {
        return Err(criu_failure("criu restore", status, &work.save_log("restore.log")));
    }
    if !stopped && !daemon_status.success() {
        // The guard killed the tree the moment the daemon ended.
        return Err(criu_failure(
            "criu lazy-pages (restored tree killed)",
            daemon_status,
            &work.save_log("lazy-pages.log"),
        ));
    }
    published?;
    // Beside the archive, where the archive's directory allows it: a
    // read-only place costs the next restore its head start, not this one.
    let new_faults = faults.iter().any(|f| !hot.get(&f.0).is_some_and(|h| h.contains(&f.1)));
    let working_set_file =
        touch.filter(|t| new_faults && save_touches(t, &recorded, &faults).is_ok()).map(|t| t.display().to_string());
    Ok(LazyReport {
        pid,
        running_seconds: running,
        resident_seconds: resident,
        eager_pages,
        working_set_pages,
        working_set_file,
        lazy_pages,
        requests,
        criu_exit: status.code().unwrap_or(-1),
    })
}

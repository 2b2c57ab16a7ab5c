//! Test and benchmark workload: a process (or tree, or thread group) that fills
//! memory with a chosen pattern and, on SIGUSR1, writes a checksum it computes
//! over its own memory. After a restore the same signal proves the restored
//! process sees exactly the bytes it had.
//!
//! Patterns: zero, mixed (50% zero / 25% text / 25% random pages), random,
//! text, elf (pages of the machine's own binaries), bf16 (16-bit floats drawn
//! from a normal distribution with sigma 0.02, as freshly initialised model
//! weights are: what a GPU process's memory holds once CUDA has copied it
//! to the host), gpu-image (a CPU stand-in for the host image of a
//! suspended CUDA inference process: see `patterns::gpu_image_page`).
//! Modes: single; tree (children share the parent's pages copy-on-write, and
//! each rewrites or zeroes some of them); threads (several threads write the
//! memory and stay alive). With `--shared 1 --filled-by-child 1` (single
//! mode) a child writes the shared memory, writes DIR/sum-filler and exits:
//! the root maps pages it has never touched, as a server whose exited
//! workers filled its shared cache (PostgreSQL's shared buffers).
//!
//! Writes DIR/ready (root pid) once set up; on SIGUSR1 every process writes
//! `DIR/sum-<role>` ("root", "child1", ...); on SIGUSR2 every process rewrites
//! the share of its pages that DIR/rewrite names ("P" percent, or "P SEED")
//! in place with random bytes, then writes `DIR/rewrote-<role>` (the page
//! count): what an incremental checkpoint then has to store; if DIR/rewrite
//! says "fork", the root forks a child instead (see `fork_late`), and
//! "dontneed" discards the second half of the memory (MADV_DONTNEED: it then
//! reads as zero) and writes `DIR/dontneed-<role>`; "mremap" moves the second
//! half of the memory elsewhere and back (its bytes unchanged) and writes
//! `DIR/mremapped-<role>`; "orphans N" leaves N short-lived processes
//! orphaned (see `orphan`) and writes `DIR/orphaned-<role>`; "exit N" ends the
//! tree, the root with exit status N; SIGTERM ends the tree (status 0).
//! With `--thp 1` the memory is asked to be transparent huge pages, and
//! each SIGUSR1 first writes `DIR/reads-<role>`: nanoseconds a random read
//! of it takes.

use std::ffi::CString;
use std::io::Write;
use std::path::{Path, PathBuf};
use xxhash_rust::xxh3::{xxh3_64, Xxh3};

mod patterns;

use patterns::{elf_corpus, fill_all, fill_pages, fill_random, fill_text, Rng};

const PAGE: usize = 4096;

struct Args {
    mib: usize,
    pattern: String,
    mode: String,
    children: usize,
    threads: usize,
    dir: PathBuf,
    open_file: Option<PathBuf>,
    /// Hold a POSIX write lock on all of `open_file`.
    lock_file: bool,
    extra_maps: bool,
    /// The memory is shared anonymous memory (CRIU restores it itself, from
    /// its own pages image) instead of private.
    shared: bool,
    tcp_peer: Option<String>,
    /// Tree mode: every child writes the same bytes (workers that rebuilt the
    /// same data: identical pages that are not shared copy-on-write).
    same_children: bool,
    /// MiB of private huge-page memory (MAP_HUGETLB) filled with the
    /// pattern, in the checksum too.
    huge_mib: usize,
    /// That huge-page memory is shared (MAP_SHARED), not private.
    huge_shared: bool,
    /// The (shared) memory is written by a child that then exits.
    filled_by_child: bool,
    /// The memory is asked to be transparent huge pages (MADV_HUGEPAGE,
    /// 2 MiB-aligned), and each report also times random reads of it.
    thp: bool,
}

fn usage() -> ! {
    eprintln!(
        "usage: criuz-workload --dir DIR [--mib N] [--pattern zero|mixed|random|text|elf|bf16|gpu-image] \
         [--mode single|tree|threads] [--children N] [--threads N] [--open-file PATH] [--lock-file 1] [--extra-maps 1] [--shared 1] \
         [--tcp-peer HOST:PORT] [--same-children 1] [--huge-mib N] [--huge-shared 1] \
         [--filled-by-child 1] [--thp 1]"
    );
    std::process::exit(2)
}

fn parse_args() -> Args {
    let mut a = Args {
        mib: 64,
        pattern: "mixed".into(),
        mode: "single".into(),
        children: 2,
        threads: 4,
        dir: PathBuf::new(),
        open_file: None,
        lock_file: false,
        extra_maps: false,
        shared: false,
        tcp_peer: None,
        same_children: false,
        huge_mib: 0,
        huge_shared: false,
        filled_by_child: false,
        thp: false,
    };
    let mut it = std::env::args().skip(1);
    while let Some(k) = it.next() {
        let v = it.next().unwrap_or_else(|| usage());
        match k.as_str() {
            "--mib" => a.mib = v.parse().unwrap_or_else(|_| usage()),
            "--pattern" => a.pattern = v,
            "--mode" => a.mode = v,
            "--children" => a.children = v.parse().unwrap_or_else(|_| usage()),
            "--threads" => a.threads = v.parse().unwrap_or_else(|_| usage()),
            "--dir" => a.dir = v.into(),
            "--open-file" => a.open_file = Some(v.into()),
            "--lock-file" => a.lock_file = v == "1",
            "--extra-maps" => a.extra_maps = v == "1",
            "--shared" => a.shared = v == "1",
            "--tcp-peer" => a.tcp_peer = Some(v),
            "--same-children" => a.same_children = v == "1",
            "--huge-mib" => a.huge_mib = v.parse().unwrap_or_else(|_| usage()),
            "--huge-shared" => a.huge_shared = v == "1",
            "--filled-by-child" => a.filled_by_child = v == "1",
            "--thp" => a.thp = v == "1",
            _ => usage(),
        }
    }
    if a.dir.as_os_str().is_empty() || (a.filled_by_child && (!a.shared || a.mode != "single")) || (a.thp && a.shared) {
        usage()
    }
    a
}

/// [`fill_all`] in a child that then writes DIR/sum-filler and exits; the
/// caller, whose `buf` is shared memory, waits for it and never reads
/// `buf` itself until asked for its checksum.
fn fill_in_child(buf: &mut [u8], pattern: &str, dir: &Path, file_fd: Option<i32>) {
    // SAFETY: the caller is single-threaded here; the child fills, reports
    // and leaves with _exit (nothing of the parent's runs twice).
    let child = unsafe { libc::fork() };
    if child < 0 {
        eprintln!("criuz-workload: cannot fork the child filling the memory");
        std::process::exit(1)
    }
    if child == 0 {
        fill_all(buf, pattern);
        write_atomic(&dir.join("sum-filler"), &report(buf, file_fd));
        // SAFETY: ends the child without running the parent's exit handlers.
        unsafe { libc::_exit(0) };
    }
    let mut status = 0;
    // SAFETY: waits for the child just forked.
    let waited = unsafe { libc::waitpid(child, &mut status, 0) };
    if waited != child || !libc::WIFEXITED(status) || libc::WEXITSTATUS(status) != 0 {
        eprintln!("criuz-workload: the child filling the memory failed");
        std::process::exit(1)
    }
}

/// Where transparent huge pages are asked for (`--thp`), the memory starts
/// on a huge page's boundary (2 MiB on x86-64 and arm64).
const HUGE_ALIGN: usize = 2 << 20;

fn alloc(bytes: usize, shared: bool, thp: bool) -> &'static mut [u8] {
    let kind = if shared { libc::MAP_SHARED } else { libc::MAP_PRIVATE };
    let slack = if thp { HUGE_ALIGN } else { 0 };
    // SAFETY: a fresh anonymous mapping, owned for the process lifetime;
    // the slice starts inside it and ends `slack` bytes before its end at
    // the latest.
    unsafe {
        let p = libc::mmap(
            std::ptr::null_mut(),
            bytes.max(PAGE) + slack,
            libc::PROT_READ | libc::PROT_WRITE,
            kind | libc::MAP_ANONYMOUS,
            -1,
            0,
        );
        if p == libc::MAP_FAILED {
            eprintln!("criuz-workload: mmap of {bytes} bytes failed");
            std::process::exit(1)
        }
        let start = (p as usize).next_multiple_of(slack.max(1)) as *mut u8;
        if thp && libc::madvise(start.cast(), bytes, libc::MADV_HUGEPAGE) != 0 {
            eprintln!("criuz-workload: madvise(MADV_HUGEPAGE) failed: {}", std::io::Error::last_os_error());
            std::process::exit(1)
        }
        std::slice::from_raw_parts_mut(start, bytes)
    }
}

/// Nanoseconds a random one-byte read of `buf` takes (a cache line at a
/// time, spread over all of it): what huge pages or their absence cost a
/// process whose reads miss the TLB.
fn random_read_ns(buf: &[u8]) -> f64 {
    const READS: usize = 8 << 20;
    let lines = (buf.len() / 64).max(1);
    let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
    let mut acc = 0u64;
    let t = std::time::Instant::now();
    for _ in 0..READS {
        acc = acc.wrapping_add(u64::from(buf[(rng.next() as usize % lines) * 64]));
    }
    let ns = t.elapsed().as_nanos() as f64 / READS as f64;
    std::hint::black_box(acc);
    ns
}

fn write_atomic(path: &Path, text: &str) {
    let tmp = path.with_extension("tmp");
    let ok = std::fs::File::create(&tmp).and_then(|mut f| f.write_all(text.as_bytes())).is_ok();
    if ok {
        let _ = std::fs::rename(&tmp, path);
    }
}

fn thread_count() -> usize {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| s.lines().find_map(|l| l.strip_prefix("Threads:").and_then(|v| v.trim().parse().ok())))
        .unwrap_or(0)
}

/// What this process reports: a checksum over its memory and open file.
/// Memory beyond the main buffer that the checksum covers.
static EXTRA: std::sync::OnceLock<Vec<(usize, usize)>> = std::sync::OnceLock::new();

/// `--thp 1`: each report times random reads of the memory first.
static THP: std::sync::OnceLock<bool> = std::sync::OnceLock::new();

/// Mappings whose zero pages must survive a restore byte for byte: a private
/// file mapping with zeroed (copy-on-write) pages, where a page left out
/// would show the file's bytes, and shared anonymous memory with zero pages;
/// and a memfd mapped read-only.
fn extra_maps(dir: &Path) -> Vec<(usize, usize)> {
    const PAGES: usize = 64;
    let len = PAGES * PAGE;
    let path = dir.join("mapped-file.dat");
    let mut content = vec![0u8; len];
    fill_text(&mut content, &mut Rng(11));
    std::fs::write(&path, &content).expect("write mapped file");
    let c = CString::new(path.as_os_str().as_encoded_bytes()).expect("path");
    // SAFETY: fresh mappings of our own file and of anonymous shared memory;
    // every access stays within `len` bytes of each mapping.
    unsafe {
        let fd = libc::open(c.as_ptr(), libc::O_RDONLY);
        let private =
            libc::mmap(std::ptr::null_mut(), len, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_PRIVATE, fd, 0);
        libc::close(fd);
        let shared = libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED | libc::MAP_ANONYMOUS,
            -1,
            0,
        );
        if private == libc::MAP_FAILED || shared == libc::MAP_FAILED {
            eprintln!("criuz-workload: extra mappings failed");
            std::process::exit(1)
        }
        let private = std::slice::from_raw_parts_mut(private as *mut u8, len);
        let shared = std::slice::from_raw_parts_mut(shared as *mut u8, len);
        let mut rng = Rng(13);
        for p in 0..PAGES {
            let page = p * PAGE..(p + 1) * PAGE;
            match p % 4 {
                0 | 2 => private[page.clone()].fill(0),
                1 => fill_random(&mut private[page.clone()], &mut rng),
                _ => {} // left as the file's bytes
            }
            if p % 2 == 0 {
                shared[page].fill(0);
            } else {
                fill_random(&mut shared[page], &mut rng);
            }
        }
        // A memfd of data mapped only through a descriptor opened
        // read-only: no copy can be made into that mapping (criuz leaves
        // the memfd to CRIU; copying through it failed the restore).
        let memfd = libc::memfd_create(c"criuz-workload-ro".as_ptr(), 0);
        let mut data = vec![0u8; len];
        fill_random(&mut data, &mut rng);
        let written = memfd >= 0 && libc::write(memfd, data.as_ptr().cast(), len) == len as isize;
        let reopened = CString::new(format!("/proc/self/fd/{memfd}")).expect("path");
        let ro = if written { libc::open(reopened.as_ptr(), libc::O_RDONLY) } else { -1 };
        let read_only = libc::mmap(std::ptr::null_mut(), len, libc::PROT_READ, libc::MAP_SHARED, ro, 0);
        libc::close(ro);
        libc::close(memfd);
        if read_only == libc::MAP_FAILED {
            eprintln!("criuz-workload: read-only memfd mapping failed");
            std::process::exit(1)
        }
        vec![(private.as_ptr() as usize, len), (shared.as_ptr() as usize, len), (read_only as usize, len)]
    }
}

/// `len` bytes of huge-page memory, private or `shared` (the system's huge
/// pages, which must be reserved: vm.nr_hugepages), filled with `pattern`.
fn huge_pages(len: usize, pattern: &str, shared: bool) -> (usize, usize) {
    // SAFETY: a fresh anonymous mapping of our own, written within `len`.
    unsafe {
        let flags = if shared { libc::MAP_SHARED } else { libc::MAP_PRIVATE } | libc::MAP_ANONYMOUS | libc::MAP_HUGETLB;
        let p = libc::mmap(std::ptr::null_mut(), len, libc::PROT_READ | libc::PROT_WRITE, flags, -1, 0);
        if p == libc::MAP_FAILED {
            eprintln!("criuz-workload: huge pages: {}", std::io::Error::last_os_error());
            std::process::exit(1)
        }
        fill_all(std::slice::from_raw_parts_mut(p as *mut u8, len), pattern);
        (p as usize, len)
    }
}

fn report(buf: &[u8], file_fd: Option<i32>) -> String {
    let mut h = Xxh3::new();
    h.update(buf);
    for &(ptr, len) in EXTRA.get().map(|v| v.as_slice()).unwrap_or(&[]) {
        // SAFETY: the extra mappings live for the whole process.
        h.update(unsafe { std::slice::from_raw_parts(ptr as *const u8, len) });
    }
    let mut file = "-".to_string();
    if let Some(fd) = file_fd {
        // SAFETY: fd is our own open descriptor; reads go into a local buffer.
        unsafe {
            let pos = libc::lseek(fd, 0, libc::SEEK_CUR);
            let mut content = vec![0u8; 1 << 16];
            let n = libc::pread(fd, content.as_mut_ptr() as *mut _, content.len(), 0);
            file = format!("{:016x}@{pos}", xxh3_64(&content[..n.max(0) as usize]));
        }
    }
    let sum = h.digest();
    format!(
        "sum={sum:016x} bytes={} pid={} threads={} file={file} tcp={}\n",
        buf.len(),
        std::process::id(),
        thread_count(),
        tcp_echo(sum)
    )
}

/// An established TCP connection held for the whole run (`--tcp-peer`), to
/// prove it survives checkpoint and restore (CRIU's --tcp-established).
static TCP: std::sync::OnceLock<std::net::TcpStream> = std::sync::OnceLock::new();

/// Sends the checksum to the peer and reads its echo: "echoed" when the
/// connection carried it both ways, "-" without a connection.
fn tcp_echo(sum: u64) -> String {
    use std::io::{BufRead, Write};
    let Some(s) = TCP.get() else { return "-".into() };
    let line = format!("{sum:016x}\n");
    let mut back = String::new();
    let r = (&*s).write_all(line.as_bytes()).and_then(|_| std::io::BufReader::new(s).read_line(&mut back));
    match r {
        Ok(_) if back == line => "echoed".into(),
        Ok(_) => format!("wrong-echo:{}", back.trim()),
        Err(e) => format!("error:{}", e.kind()),
    }
}

fn block_signals() -> libc::sigset_t {
    // SAFETY: plain signal-mask manipulation on a local set.
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        libc::sigaddset(&mut set, libc::SIGUSR1);
        libc::sigaddset(&mut set, libc::SIGUSR2);
        libc::sigaddset(&mut set, libc::SIGTERM);
        libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut());
        set
    }
}

/// Rewrites `percent`% of the pages of `buf` with random bytes: evenly
/// spread (every 100/P-th page, from an offset the seed picks), as a running
/// service rewrites scattered objects. Returns the pages rewritten.
fn rewrite(buf: &mut [u8], percent: f64, seed: u64) -> usize {
    let pages = buf.len() / PAGE;
    if percent <= 0.0 || pages == 0 {
        return 0;
    }
    let stride = (100.0 / percent.min(100.0)).max(1.0);
    let mut rng = Rng(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1);
    let mut x = (rng.next() % stride.ceil() as u64) as f64;
    let mut n = 0;
    while (x as usize) < pages {
        let p = x as usize;
        fill_random(&mut buf[p * PAGE..(p + 1) * PAGE], &mut rng);
        n += 1;
        x += stride;
    }
    n
}

/// Serves SIGUSR1 (report) and SIGUSR2 (rewrite) until SIGTERM.
fn serve_signals(
    set: &libc::sigset_t,
    dir: &Path,
    role: &str,
    buf: &mut [u8],
    file_fd: Option<i32>,
    children: &[i32],
) -> ! {
    loop {
        // SAFETY: waits on the blocked set; the info struct is ours.
        let sig = unsafe {
            let mut info: libc::siginfo_t = std::mem::zeroed();
            libc::sigwaitinfo(set, &mut info)
        };
        if sig == libc::SIGUSR1 {
            // Before the checksum, which its reader waits for.
            if THP.get() == Some(&true) {
                write_atomic(&dir.join(format!("reads-{role}")), &format!("{:.2}\n", random_read_ns(buf)));
            }
            write_atomic(&dir.join(format!("sum-{role}")), &report(buf, file_fd));
            for &c in children {
                // SAFETY: signalling our own children.
                unsafe { libc::kill(c, libc::SIGUSR1) };
            }
        } else if sig == libc::SIGUSR2 {
            let spec = std::fs::read_to_string(dir.join("rewrite")).unwrap_or_default();
            if spec.trim() == "fork" && role == "root" {
                fork_late(set, dir, buf, file_fd);
                continue;
            }
            if spec.trim() == "dontneed" {
                // The second half reads as zero from now on.
                let half = (buf.len() / 2) & !(PAGE - 1);
                // SAFETY: advice on our own mapping; it only discards pages.
                unsafe { libc::madvise(buf[half..].as_mut_ptr().cast(), buf.len() - half, libc::MADV_DONTNEED) };
                write_atomic(&dir.join(format!("dontneed-{role}")), "done\n");
                continue;
            }
            if let Some(n) = spec.trim().strip_prefix("orphans ") {
                orphan(n.parse().unwrap_or(1));
                write_atomic(&dir.join(format!("orphaned-{role}")), "done\n");
                continue;
            }
            if let Some(code) = spec.trim().strip_prefix("exit ") {
                for &c in children {
                    // SAFETY: signalling our own children.
                    unsafe { libc::kill(c, libc::SIGTERM) };
                }
                std::process::exit(code.parse().unwrap_or(1));
            }
            if spec.trim() == "mremap" {
                let half = (buf.len() / 2) & !(PAGE - 1);
                move_and_back(&mut buf[half..]);
                write_atomic(&dir.join(format!("mremapped-{role}")), "done\n");
                continue;
            }
            let mut words = spec.split_whitespace();
            let percent: f64 = words.next().and_then(|w| w.parse().ok()).unwrap_or(0.0);
            let seed: u64 = words.next().and_then(|w| w.parse().ok()).unwrap_or(1);
            let role_seed = role.bytes().fold(seed, |h, b| h.wrapping_mul(31).wrapping_add(u64::from(b)));
            let n = rewrite(buf, percent, role_seed);
            for &c in children {
                // SAFETY: signalling our own children.
                unsafe { libc::kill(c, libc::SIGUSR2) };
            }
            write_atomic(&dir.join(format!("rewrote-{role}")), &format!("{n}\n"));
        } else if sig == libc::SIGTERM {
            for &c in children {
                // SAFETY: as above.
                unsafe { libc::kill(c, libc::SIGTERM) };
            }
            std::process::exit(0);
        }
    }
}

/// Moves `part` (page-aligned, of our own mapping) to another address with
/// mremap(2) and back again, touching none of its bytes: a lazily restored
/// process whose memory moves while its pages still arrive.
fn move_and_back(part: &mut [u8]) {
    let len = part.len();
    // SAFETY: a fresh reservation, then moves of our own mapping's pages
    // into it and back to exactly where they were; no byte is read or
    // written, and `part` is valid again once they are back.
    unsafe {
        let spot =
            libc::mmap(std::ptr::null_mut(), len, libc::PROT_NONE, libc::MAP_PRIVATE | libc::MAP_ANONYMOUS, -1, 0);
        assert_ne!(spot, libc::MAP_FAILED, "reserve {len} bytes");
        let flags = libc::MREMAP_MAYMOVE | libc::MREMAP_FIXED;
        let moved = libc::mremap(part.as_mut_ptr().cast(), len, len, flags, spot);
        assert_eq!(moved, spot, "mremap away: {}", std::io::Error::last_os_error());
        let home: *mut libc::c_void = part.as_mut_ptr().cast();
        let back = libc::mremap(moved, len, len, flags, home);
        assert_eq!(back, home, "mremap back: {}", std::io::Error::last_os_error());
    }
}

/// Leaves `n` processes orphaned, each ending 20 ms later (a shell's
/// background job, a daemon's double fork): a child forks a grandchild and
/// exits, so the grandchild goes to the nearest subreaper above us.
fn orphan(n: usize) {
    for _ in 0..n {
        // SAFETY: fork in a single-threaded process; the child and the
        // grandchild call only fork, nanosleep and _exit.
        unsafe {
            let child = libc::fork();
            if child == 0 {
                if libc::fork() == 0 {
                    let rest = libc::timespec { tv_sec: 0, tv_nsec: 20_000_000 };
                    libc::nanosleep(&rest, std::ptr::null_mut());
                }
                libc::_exit(0);
            }
            if child > 0 {
                libc::waitpid(child, std::ptr::null_mut(), 0);
            }
        }
    }
}

/// Forks a child ("late") that writes DIR/late-pid, then its checksum of the
/// memory it inherited (DIR/sum-late), then serves signals like the others:
/// a process forked after a restore, while its memory may still arrive.
fn fork_late(set: &libc::sigset_t, dir: &Path, buf: &mut [u8], file_fd: Option<i32>) {
    // SAFETY: fork in a single-threaded process (single and tree modes).
    let pid = unsafe { libc::fork() };
    if pid == 0 {
        write_atomic(&dir.join("late-pid"), &format!("{}\n", std::process::id()));
        write_atomic(&dir.join("sum-late"), &report(buf, file_fd));
        serve_signals(set, dir, "late", buf, file_fd, &[]);
    }
}

fn main() {
    let a = parse_args();
    if let Err(e) = std::fs::create_dir_all(&a.dir) {
        eprintln!("criuz-workload: cannot create {}: {e}", a.dir.display());
        std::process::exit(1)
    }
    // SAFETY: setsid has no memory effects; failing (already a leader) is fine.
    unsafe { libc::setsid() };
    let set = block_signals();
    let bytes = a.mib << 20;
    let buf = alloc(bytes, a.shared, a.thp);
    let _ = THP.set(a.thp);
    let mut extra = Vec::new();
    if a.extra_maps {
        extra.extend(extra_maps(&a.dir));
    }
    if a.huge_mib > 0 {
        extra.push(huge_pages(a.huge_mib << 20, &a.pattern, a.huge_shared));
    }
    let _ = EXTRA.set(extra);

    if let Some(peer) = &a.tcp_peer {
        let s = std::net::TcpStream::connect(peer.as_str()).unwrap_or_else(|e| {
            eprintln!("criuz-workload: cannot connect to {peer}: {e}");
            std::process::exit(1)
        });
        let _ = TCP.set(s);
    }
    let file_fd = a.open_file.as_ref().map(|p| {
        let c = CString::new(p.as_os_str().as_encoded_bytes()).expect("path");
        // SAFETY: opening and writing a file we name; the buffer is local.
        unsafe {
            let fd = libc::open(c.as_ptr(), libc::O_RDWR | libc::O_CREAT | libc::O_TRUNC, 0o600);
            if fd < 0 {
                eprintln!("criuz-workload: cannot open {}", p.display());
                std::process::exit(1)
            }
            let mut content = vec![0u8; 1 << 16];
            fill_text(&mut content, &mut Rng(7));
            libc::write(fd, content.as_ptr() as *const _, content.len());
            libc::lseek(fd, 12345, libc::SEEK_SET);
            if a.lock_file {
                let mut whole: libc::flock = std::mem::zeroed();
                whole.l_type = libc::F_WRLCK as _;
                whole.l_whence = libc::SEEK_SET as _;
                if libc::fcntl(fd, libc::F_SETLK, &whole) != 0 {
                    eprintln!("criuz-workload: cannot lock {}", p.display());
                    std::process::exit(1)
                }
            }
            fd
        }
    });

    match a.mode.as_str() {
        "threads" => {
            let n = a.threads.max(1);
            let chunk = (bytes / PAGE).div_ceil(n) * PAGE;
            let parts: Vec<(usize, &'static mut [u8])> = {
                let mut v = Vec::new();
                let mut rest: &'static mut [u8] = buf;
                let mut start = 0;
                while !rest.is_empty() {
                    let (a1, b1) = rest.split_at_mut(chunk.min(rest.len()));
                    v.push((start, a1));
                    start += chunk;
                    rest = b1;
                }
                v
            };
            // Fewer parts than threads where pages do not divide evenly
            // (64 MiB on 300 threads: 298 parts of 55 pages); one each.
            let started = parts.len();
            let (tx, rx) = std::sync::mpsc::channel();
            let mut ptrs = Vec::new();
            // Shared while the threads fill, freed once they all have (the
            // threads stay, the corpus must not be dumped with them).
            let elf = std::sync::Arc::new(if a.pattern == "elf" { elf_corpus(bytes) } else { Vec::new() });
            for (start, part) in parts {
                ptrs.push((part.as_ptr() as usize, part.len()));
                let tx = tx.clone();
                let pattern = a.pattern.clone();
                let elf = elf.clone();
                std::thread::spawn(move || {
                    fill_pages(part, &pattern, start / PAGE, &elf);
                    drop(elf);
                    tx.send(()).unwrap();
                    loop {
                        std::thread::sleep(std::time::Duration::from_millis(50));
                    }
                });
            }
            for _ in 0..started {
                rx.recv().unwrap();
            }
            drop(elf);
            // SAFETY: the parts were written once before the threads signalled;
            // the threads never touch them again, so from here on this view is
            // the only one in use.
            let whole = unsafe { std::slice::from_raw_parts_mut(ptrs[0].0 as *mut u8, bytes) };
            write_atomic(&a.dir.join("ready"), &format!("{}\n", std::process::id()));
            serve_signals(&set, &a.dir, "root", whole, file_fd, &[]);
        }
        "tree" => {
            fill_all(buf, &a.pattern);
            let pages = bytes / PAGE;
            let mut children = Vec::new();
            let mut ready = [0i32; 2];
            // SAFETY: a pipe for readiness; fds are closed after use.
            unsafe { libc::pipe(ready.as_mut_ptr()) };
            for k in 1..=a.children {
                // SAFETY: fork in a single-threaded process.
                let pid = unsafe { libc::fork() };
                if pid == 0 {
                    // Child k rewrites every (children+1)-th page at offset k: half
                    // with its own bytes, half with zeros (a copy-on-write page that
                    // must restore as zero, not as the parent's bytes).
                    let stride = a.children + 1;
                    let mut rng = Rng(0x9e37_79b9 * if a.same_children { 1 } else { k as u64 } + 1);
                    let mut p = if a.same_children { 1 } else { k };
                    let mut zero = true;
                    while p < pages {
                        let page = &mut buf[p * PAGE..(p + 1) * PAGE];
                        if zero {
                            page.fill(0);
                        } else {
                            fill_random(page, &mut rng);
                        }
                        zero = !zero;
                        p += stride * 2;
                    }
                    // SAFETY: signal readiness through the inherited pipe.
                    unsafe {
                        libc::close(ready[0]);
                        libc::write(ready[1], b"r".as_ptr() as *const _, 1);
                        libc::close(ready[1]);
                    }
                    serve_signals(&set, &a.dir, &format!("child{k}"), buf, file_fd, &[]);
                }
                children.push(pid);
            }
            // SAFETY: read one byte per child, then close the pipe.
            unsafe {
                libc::close(ready[1]);
                let mut b = [0u8; 1];
                for _ in 0..a.children {
                    libc::read(ready[0], b.as_mut_ptr() as *mut _, 1);
                }
                libc::close(ready[0]);
            }
            write_atomic(&a.dir.join("ready"), &format!("{}\n", std::process::id()));
            serve_signals(&set, &a.dir, "root", buf, file_fd, &children);
        }
        "single" if a.filled_by_child => {
            fill_in_child(buf, &a.pattern, &a.dir, file_fd);
            write_atomic(&a.dir.join("ready"), &format!("{}\n", std::process::id()));
            serve_signals(&set, &a.dir, "root", buf, file_fd, &[]);
        }
        "single" => {
            fill_all(buf, &a.pattern);
            write_atomic(&a.dir.join("ready"), &format!("{}\n", std::process::id()));
            serve_signals(&set, &a.dir, "root", buf, file_fd, &[]);
        }
        m => {
            eprintln!("criuz-workload: unknown mode {m}");
            std::process::exit(2)
        }
    }
}

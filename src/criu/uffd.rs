//! The lazy-pages side of `criu restore --lazy-pages`: the socket on which
//! CRIU hands over each restored process's userfaultfd, and the userfaultfd
//! calls that put pages in place (criu/uffd.c, linux/userfaultfd.h).
//!
//! CRIU connects to `lazy-pages.socket` in its work directory and sends, for
//! every process of the tree, its pid as a native `i32` (negative for a
//! zombie, which has no memory) and then, for a live one, the userfaultfd
//! (`criu::scm`). When the tree is restored it sends
//! [`RESTORE_FINISHED`] in the same `i32` slot; from then on the lazy ranges
//! are registered and pages may be copied in.
//!
//! The userfaultfd ABI is written out here (six ioctls, one 32-byte message)
//! rather than taken from the `userfaultfd` crate, whose `-sys` half runs
//! bindgen, so libclang, at build time.

use crate::criu::scm;
use crate::error::{Error, Result};
use std::io::{self, Read};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::Path;

/// The socket CRIU connects to, in its work directory.
pub const LAZY_SOCKET: &str = "lazy-pages.socket";
/// "ReSTore Finished" (criu/uffd.c): the tree runs, its ranges are registered.
pub const RESTORE_FINISHED: i32 = 0x5253_5446;

/// What CRIU sends on the lazy-pages socket.
#[derive(Debug)]
pub enum Handover {
    /// A restored process and its userfaultfd.
    Process {
        pid: i32,
        uffd: Uffd,
    },
    /// A zombie: nothing to serve.
    Zombie {
        pid: i32,
    },
    Finished,
}

/// Binds the lazy-pages socket in `dir`, owner-only like every criuz socket.
/// CRIU connects by the name alone, from its work directory; a socket
/// address holds a path of 107 bytes at most, so where `dir`'s is longer (a
/// long `$TMPDIR`) the socket is bound through a descriptor of `dir`.
pub fn listen(dir: &Path) -> io::Result<UnixListener> {
    let path = dir.join(LAZY_SOCKET);
    let listener = if path.as_os_str().len() < super::streamer::SUN_PATH_MAX {
        UnixListener::bind(&path)?
    } else {
        let held = std::fs::File::open(dir)?;
        UnixListener::bind(format!("/proc/self/fd/{}/{LAZY_SOCKET}", std::os::fd::AsRawFd::as_raw_fd(&held)))?
    };
    std::fs::set_permissions(&path, std::os::unix::fs::PermissionsExt::from_mode(0o600))?;
    Ok(listener)
}

/// Reads the next handover from CRIU's connection; `None` at its end.
pub fn read_handover(sock: &mut UnixStream) -> Result<Option<Handover>> {
    let mut word = [0u8; 4];
    match sock.read_exact(&mut word) {
        Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return Ok(None),
        r => r.map_err(|e| Error::Protocol(format!("lazy-pages socket: {e}")))?,
    }
    let pid = i32::from_ne_bytes(word);
    if pid == RESTORE_FINISHED {
        return Ok(Some(Handover::Finished));
    }
    if pid < 0 {
        return Ok(Some(Handover::Zombie { pid: -pid }));
    }
    let fd = scm::recv_fd(sock, &format!("the userfaultfd of process {pid}"))?;
    Ok(Some(Handover::Process { pid, uffd: Uffd(fd) }))
}

const UFFD_EVENT_PAGEFAULT: u8 = 0x12;
const UFFD_EVENT_FORK: u8 = 0x13;
const UFFD_EVENT_REMAP: u8 = 0x14;
const UFFD_EVENT_REMOVE: u8 = 0x15;
const UFFD_EVENT_UNMAP: u8 = 0x16;

/// `_IOC(dir, 0xAA, nr, size)` from linux/userfaultfd.h.
const fn uffd_ioctl(dir: u64, nr: u64, size: u64) -> u64 {
    (dir << 30) | (size << 16) | (0xAA << 8) | nr
}
const IOC_READ: u64 = 2;
const IOC_READ_WRITE: u64 = 3;
const UFFDIO_API: u64 = uffd_ioctl(IOC_READ_WRITE, 0x3F, 24);
const UFFDIO_REGISTER: u64 = uffd_ioctl(IOC_READ_WRITE, 0x00, 32);
const UFFDIO_UNREGISTER: u64 = uffd_ioctl(IOC_READ, 0x01, 16);
const UFFDIO_WAKE: u64 = uffd_ioctl(IOC_READ, 0x02, 16);
const UFFDIO_COPY: u64 = uffd_ioctl(IOC_READ_WRITE, 0x03, 40);
const UFFDIO_ZEROPAGE: u64 = uffd_ioctl(IOC_READ_WRITE, 0x04, 32);

/// The API version, and the events CRIU's lazy restore needs
/// (`NEED_UFFD_API_FEATURES` in criu/uffd.c): fork, mremap, munmap and
/// MADV_DONTNEED of the restored memory.
const UFFD_API: u64 = 0xAA;
const FEATURES_CRIU_NEEDS: u64 = (1 << 1) | (1 << 2) | (1 << 3) | (1 << 6);

#[repr(C)]
struct Api {
    api: u64,
    features: u64,
    ioctls: u64,
}

/// Whether this kernel gives this process a userfaultfd with the events a
/// lazy restore needs (CRIU asks for the same in the restored tree).
pub fn lazy_restore_available() -> bool {
    // SAFETY: userfaultfd(2) takes only flags; a descriptor it returns is ours.
    let fd = unsafe { libc::syscall(libc::SYS_userfaultfd, libc::O_CLOEXEC | libc::O_NONBLOCK) };
    if fd < 0 {
        return false;
    }
    // SAFETY: a fresh descriptor nothing else owns.
    let uffd = Uffd(unsafe { OwnedFd::from_raw_fd(fd as RawFd) });
    let mut api = Api { api: UFFD_API, features: FEATURES_CRIU_NEEDS, ioctls: 0 };
    uffd.ioctl(UFFDIO_API, &mut api).is_ok() && api.features & FEATURES_CRIU_NEEDS == FEATURES_CRIU_NEEDS
}

#[repr(C)]
struct Range {
    start: u64,
    len: u64,
}

#[repr(C)]
struct Register {
    range: Range,
    mode: u64,
    ioctls: u64,
}

/// `UFFDIO_REGISTER_MODE_MISSING`: a fault where no page is.
const REGISTER_MODE_MISSING: u64 = 1;

#[repr(C)]
struct Copy {
    dst: u64,
    src: u64,
    len: u64,
    mode: u64,
    copy: i64,
}

#[repr(C)]
struct ZeroPage {
    range: Range,
    mode: u64,
    zeropage: i64,
}

/// A message read from a userfaultfd.
#[derive(Debug)]
pub enum Event {
    Fault {
        addr: u64,
    },
    /// The process forked: the child's memory has its own userfaultfd.
    Fork {
        child: Uffd,
    },
    Remap {
        from: u64,
        to: u64,
        len: u64,
    },
    /// `MADV_DONTNEED` and the like: the range reads as zero from now on.
    Remove {
        start: u64,
        end: u64,
    },
    Unmap {
        start: u64,
        end: u64,
    },
}

/// How a copy ended.
#[derive(Debug, PartialEq, Eq)]
pub enum Copied {
    /// `n` bytes from the start are in place (all of them, unless the next
    /// page was already there or is no longer registered).
    Bytes(u64),
    /// The address space is changing (an event is waiting to be read):
    /// nothing more was copied; read the events, then try again.
    Changing,
    /// The process has exited.
    Gone,
}

/// How a copy of a whole range ended ([`Uffd::copy_all`],
/// [`Uffd::copy_all_mapping_zeros`]).
#[derive(Debug, PartialEq, Eq)]
pub enum CopiedAll {
    /// All in place; `pages` were copied and `zeros` mapped to the zero page
    /// (the others were there already).
    Done { pages: u64, zeros: u64 },
    /// An event waits: the first `done` bytes are in place (`pages` of
    /// them copied, `zeros` mapped); read the events, then copy the rest.
    Changing { done: u64, pages: u64, zeros: u64 },
    /// The process has exited.
    Gone,
}

/// A userfaultfd: a process's lazily restored memory.
#[derive(Debug)]
pub struct Uffd(pub OwnedFd);

impl Uffd {
    fn ioctl<T>(&self, request: u64, arg: &mut T) -> io::Result<()> {
        // SAFETY: `arg` is the repr(C) struct the kernel expects for
        // `request`, living across the call.
        let r = unsafe { libc::ioctl(self.0.as_raw_fd(), request as _, arg as *mut T) };
        if r < 0 {
            Err(io::Error::last_os_error())
        } else {
            Ok(())
        }
    }

    /// The next message, if one is waiting (CRIU opens the descriptor
    /// non-blocking).
    pub fn read_event(&self) -> io::Result<Option<Event>> {
        let mut msg = [0u8; 32];
        // SAFETY: reading at most 32 bytes into a 32-byte buffer.
        let n = unsafe { libc::read(self.0.as_raw_fd(), msg.as_mut_ptr().cast(), msg.len()) };
        if n < 0 {
            let e = io::Error::last_os_error();
            return if e.kind() == io::ErrorKind::WouldBlock { Ok(None) } else { Err(e) };
        }
        if n != 32 {
            return Err(io::Error::new(io::ErrorKind::InvalidData, format!("userfaultfd message of {n} bytes")));
        }
        let u64_at = |o: usize| u64::from_ne_bytes(msg[o..o + 8].try_into().expect("8 bytes"));
        Ok(Some(match msg[0] {
            UFFD_EVENT_PAGEFAULT => Event::Fault { addr: u64_at(16) },
            UFFD_EVENT_FORK => {
                let fd = u32::from_ne_bytes(msg[8..12].try_into().expect("4 bytes")) as RawFd;
                // SAFETY: the kernel installed the child's descriptor for us.
                Event::Fork { child: Uffd(unsafe { OwnedFd::from_raw_fd(fd) }) }
            }
            UFFD_EVENT_REMAP => Event::Remap { from: u64_at(8), to: u64_at(16), len: u64_at(24) },
            UFFD_EVENT_REMOVE => Event::Remove { start: u64_at(8), end: u64_at(16) },
            UFFD_EVENT_UNMAP => Event::Unmap { start: u64_at(8), end: u64_at(16) },
            other => {
                return Err(io::Error::new(io::ErrorKind::InvalidData, format!("unknown userfaultfd event {other:#x}")))
            }
        }))
    }

    /// Registers `[start, start + len)` of the process (whole mappings, or
    /// the kernel splits them) for copies into pages not there yet. Works on
    /// another process's descriptor: the kernel takes the address space
    /// the descriptor was made for, not the caller's. Shared memory too
    /// (`session::place` fills a held tree's), whose pages a copy then
    /// charges to the process's memory cgroup, as CRIU's own restore of it
    /// would.
    pub fn register_missing(&self, start: u64, len: u64) -> io::Result<()> {
        let mut r = Register { range: Range { start, len }, mode: REGISTER_MODE_MISSING, ioctls: 0 };
        self.ioctl(UFFDIO_REGISTER, &mut r)?;
        if r.ioctls & (1 << 3) == 0 {
            // `_UFFDIO_COPY` is not among what the range allows.
            return Err(io::Error::new(io::ErrorKind::Unsupported, "no copies into this memory"));
        }
        Ok(())
    }

    /// Copies `src` to `dst` in the process and wakes threads waiting there.
    /// A page already in place ends the copy before it (`Bytes`); so does a
    /// range no longer registered or spanning two mappings (the caller goes
    /// on page by page).
    pub fn copy(&self, dst: u64, src: &[u8]) -> io::Result<Copied> {
        let mut c = Copy { dst, src: src.as_ptr() as u64, len: src.len() as u64, mode: 0, copy: 0 };
        let r = self.ioctl(UFFDIO_COPY, &mut c);
        range_ended(r, c.copy, src.len() as u64)
    }

    /// Maps the zero page over `len` bytes at `dst`, and wakes threads
    /// waiting there; ends as [`copy`](Self::copy) does.
    pub fn zero(&self, dst: u64, len: u64) -> io::Result<Copied> {
        let mut z = ZeroPage { range: Range { start: dst, len }, mode: 0, zeropage: 0 };
        let r = self.ioctl(UFFDIO_ZEROPAGE, &mut z);
        range_ended(r, z.zeropage, len)
    }

    /// Copies all of `src` to `dst`, going on page by page past a page
    /// already there or not registered (those are skipped, not copied).
    pub fn copy_all(&self, dst: u64, src: &[u8]) -> io::Result<CopiedAll> {
        put_all(src.len() as u64, |off, n| self.copy(dst + off, &src[off as usize..(off + n) as usize]))
    }

    /// As [`copy_all`](Self::copy_all) for whole pages, but the pages
    /// `is_zero` names (by index in `src`) are mapped to the kernel's zero
    /// page instead of copied: no memory of their own and no copy, as if
    /// the process had never written them (a write gets a page then).
    pub fn copy_all_mapping_zeros(
        &self,
        dst: u64,
        src: &[u8],
        is_zero: impl Fn(usize) -> bool,
    ) -> io::Result<CopiedAll> {
        const PAGE: usize = 4096;
        let pages = src.len() / PAGE;
        if src.len() % PAGE != 0 {
            return self.copy_all(dst, src);
        }
        // Run by run (a range with no zero page is one run, one copy): each
        // page is asked about once, which for a cached block is a look at
        // its bytes.
        let (mut copied, mut zeros, mut at) = (0, 0, 0);
        while at < pages {
            let zero = is_zero(at);
            let end = (at..pages).find(|&k| is_zero(k) != zero).unwrap_or(pages);
            let (off, len) = ((at * PAGE) as u64, ((end - at) * PAGE) as u64);
            let to = dst + off;
            let got = if zero {
                put_all(len, |o, n| self.zero(to + o, n))?
            } else {
                put_all(len, |o, n| self.copy(to + o, &src[(off + o) as usize..(off + o + n) as usize]))?
            };
            let (n, stopped_at) = match got {
                CopiedAll::Done { pages, .. } => (pages, None),
                CopiedAll::Changing { done, pages, .. } => (pages, Some(off + done)),
                CopiedAll::Gone => return Ok(CopiedAll::Gone),
            };
            if zero {
                zeros += n;
            } else {
                copied += n;
            }
            if let Some(done) = stopped_at {
                return Ok(CopiedAll::Changing { done, pages: copied, zeros });
            }
            at = end;
        }
        Ok(CopiedAll::Done { pages: copied, zeros })
    }

    /// Maps the zero page at `page` (a fault outside every lazy range).
    pub fn zero_page(&self, page: u64, len: u64) -> io::Result<Copied> {
        let mut z = ZeroPage { range: Range { start: page, len }, mode: 0, zeropage: 0 };
        match self.ioctl(UFFDIO_ZEROPAGE, &mut z) {
            Ok(()) => Ok(Copied::Bytes(len)),
            Err(e) if e.raw_os_error() == Some(libc::EAGAIN) => Ok(Copied::Changing),
            // Already there (another thread's fault): wake whoever waits.
            Err(e) if e.raw_os_error() == Some(libc::EEXIST) => {
                self.wake(page, len)?;
                Ok(Copied::Bytes(len))
            }
            Err(e) if e.raw_os_error() == Some(libc::ENOENT) => Ok(Copied::Bytes(0)),
            Err(e) if matches!(e.raw_os_error(), Some(libc::ESRCH | libc::ENOSPC)) => Ok(Copied::Gone),
            Err(e) => Err(e),
        }
    }

    pub fn wake(&self, start: u64, len: u64) -> io::Result<()> {
        let mut r = Range { start, len };
        match self.ioctl(UFFDIO_WAKE, &mut r) {
            Err(e) if !matches!(e.raw_os_error(), Some(libc::ESRCH | libc::ENOSPC | libc::ENOENT)) => Err(e),
            _ => Ok(()),
        }
    }

    /// Stops handling faults in a removed range: they get the kernel's zero
    /// page, as `MADV_DONTNEED` promises.
    pub fn unregister(&self, start: u64, len: u64) -> io::Result<()> {
        let mut r = Range { start, len };
        match self.ioctl(UFFDIO_UNREGISTER, &mut r) {
            // The process is gone, or the range is no longer mapped.
            Err(e) if !matches!(e.raw_os_error(), Some(libc::ENOMEM | libc::ESRCH | libc::EINVAL | libc::ENOENT)) => {
                Err(e)
            }
            _ => Ok(()),
        }
    }
}

/// How a copy or a zero-page mapping of `len` bytes ended, from its
/// ioctl's result and its count (bytes done, or a negative error).
fn range_ended(r: io::Result<()>, count: i64, len: u64) -> io::Result<Copied> {
    match r {
        Ok(()) => Ok(Copied::Bytes(len)),
        // Partly done (the count says how far), or an event pending.
        Err(e) if e.raw_os_error() == Some(libc::EAGAIN) => {
            Ok(if count > 0 { Copied::Bytes(count as u64) } else { Copied::Changing })
        }
        Err(e) if matches!(e.raw_os_error(), Some(libc::EEXIST | libc::ENOENT | libc::EINVAL)) => Ok(Copied::Bytes(0)),
        Err(e) if matches!(e.raw_os_error(), Some(libc::ESRCH | libc::ENOSPC)) => Ok(Copied::Gone),
        Err(e) => Err(e),
    }
}

/// Puts `len` bytes in place with `put(offset, bytes)`, going on page by
/// page past a page already there or not registered (skipped, not
/// counted); the pages put count as copied.
fn put_all(len: u64, mut put: impl FnMut(u64, u64) -> io::Result<Copied>) -> io::Result<CopiedAll> {
    const PAGE: u64 = 4096;
    let (mut done, mut pages, mut single) = (0u64, 0u64, false);
    while done < len {
        let n = if single { PAGE } else { len - done };
        match put(done, n)? {
            Copied::Bytes(0) if !single && n > PAGE => single = true,
            Copied::Bytes(0) => {
                done += PAGE;
                single = false;
            }
            Copied::Bytes(b) => {
                done += b;
                pages += b / PAGE;
                single = false;
            }
            Copied::Changing => return Ok(CopiedAll::Changing { done, pages, zeros: 0 }),
            Copied::Gone => return Ok(CopiedAll::Gone),
        }
    }
    Ok(CopiedAll::Done { pages, zeros: 0 })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ioctl_numbers_match_the_kernel_headers() {
        // Values of UFFDIO_* on x86_64 and arm64 (linux/userfaultfd.h).
        assert_eq!(UFFDIO_API, 0xc018_aa3f);
        assert_eq!(UFFDIO_REGISTER, 0xc020_aa00);
        assert_eq!(std::mem::size_of::<Register>(), 32);
        assert_eq!(UFFDIO_UNREGISTER, 0x8010_aa01);
        assert_eq!(UFFDIO_WAKE, 0x8010_aa02);
        assert_eq!(UFFDIO_COPY, 0xc028_aa03);
        assert_eq!(UFFDIO_ZEROPAGE, 0xc020_aa04);
        assert_eq!(std::mem::size_of::<Copy>(), 40);
        assert_eq!(std::mem::size_of::<ZeroPage>(), 32);
        assert_eq!(std::mem::size_of::<Api>(), 24);
    }

    #[test]
    fn root_gets_the_userfaultfd_a_lazy_restore_needs() {
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } == 0 {
            assert!(lazy_restore_available(), "this kernel (as root) restores lazily");
        }
    }
}

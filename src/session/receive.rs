//! Receive: criuz as the page server of a dump (`criu dump --page-server`,
//! `runc checkpoint --page-server`). The dump sends its pages over TCP
//! (`criu::page_server`) instead of writing them; each pagemap's pages go
//! into the [`Packer`] as they arrive, as the `pages-<id>.img` CRIU's own
//! page server would have written (ids from 65537 in order, as CRIU counts),
//! and the pagemap built from the runs follows it. [`finish_with_images`]
//! then adds the metadata the dump left in its images directory, so one
//! archive holds the whole checkpoint.
//!
//! The CLOSE reply is the commit point: CRIU kills (or resumes) the tree
//! after it. So it is sent only once every page is in the output, and a
//! writer failure is answered with a non-zero status, which fails the dump
//! while the tree still lives. A connection that ends before CLOSE is a
//! failed dump; the caller aborts the packer and nothing is published.
//!
//! Authentication: none in the protocol (CRIU's `--tls` is not spoken).
//! The listener binds to loopback unless told otherwise and serves exactly
//! one connection; on loopback, one only from a socket of criuz's own user
//! (the kernel's socket table says whose: `proc::socket`), so another local user cannot
//! race CRIU to the port and feed the archive pages. Across hosts, carry it
//! over a tunnel (SSH, WireGuard) rather than an open port.

use crate::archive::{PackStats, Packer};
use crate::criu::images::{pe, PagemapBuilder};
use crate::criu::page_server::{self as ps, proto, CommandReader, Target};
use crate::error::{Error, Result};
use crate::format::{EntryMeta, FileKind, PAGE_SIZE};
use crate::proc::socket::{peer_socket, uncork_dump, widen_receive_buffer};
use crate::session::criu_run::cannot_run;
use crate::tree;
use std::collections::HashSet;
use std::io::Write;
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::fd::{AsFd, AsRawFd};
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};

/// CRIU numbers the pages images its page server writes from here on.
const FIRST_PAGES_ID: u32 = 1 + 0x10000;

/// A bound page-server listener.
pub struct PageServer {
    listener: TcpListener,
}

impl PageServer {
    /// Listens on `addr` (`HOST:PORT`; port 0 picks a free one).
    pub fn bind(addr: &str) -> Result<Self> {
        let listener =
            TcpListener::bind(addr).map_err(|e| Error::Usage(format!("page server: cannot listen on {addr}: {e}")))?;
        listener.set_nonblocking(true)?;
        widen_receive_buffer(&listener);
        Ok(PageServer { listener })
    }

    pub fn local_addr(&self) -> Result<SocketAddr> {
        Ok(self.listener.local_addr()?)
    }

    /// The one dump's connection, or `None` once `stop` is set first; on
    /// loopback, with the inode of the dump's end of it.
    fn accept(&self, stop: &AtomicBool) -> Result<Option<(TcpStream, Option<u64>)>> {
        loop {
            match self.listener.accept() {
                Ok((sock, peer)) => {
                    let mut inode = None;
                    if peer.ip().is_loopback() {
                        // SAFETY: geteuid has no preconditions.
                        let uid = unsafe { libc::geteuid() };
                        match peer_socket(&sock, peer) {
                            Some((owner, ino)) if owner == uid => inode = Some(ino),
                            _ => {
                                // Another user's connection to our port: it could
                                // feed pages into the archive. Not the dump's; wait on.
                                crate::say!(
                                    "criuz: page server: refused a connection from {peer}, a socket of another user"
                                );
                                continue;
                            }
                        }
                    }
                    sock.set_nonblocking(false)?;
                    sock.set_nodelay(true)?;
                    return Ok(Some((sock, inode)));
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    if stop.load(Ordering::Relaxed) {
                        return Ok(None);
                    }
                    // CRIU waits for the answer to its first command: a
                    // connection is taken at once, `stop` seen within 20 ms.
                    let mut ready = libc::pollfd { fd: self.listener.as_raw_fd(), events: libc::POLLIN, revents: 0 };
                    // SAFETY: poll(2) on one pollfd that lives across the call.
                    unsafe { libc::poll(&mut ready, 1, 20) };
                }
                Err(e) => return Err(Error::Protocol(format!("page server: accept: {e}"))),
            }
        }
    }
}

/// What a dump sent.
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct ReceiveReport {
    /// The image files written into the archive (pages, pagemaps).
    pub files: Vec<String>,
    pub pages: u64,
    /// "4.2+" or "pre-4.2" (the command header layout the dump used).
    pub protocol: String,
    /// What the images directory held before the dump and still held as
    /// it was: left out of the archive.
    pub left_out: Vec<String>,
}

/// The pagemap being received: its pages go straight into the packer.
struct Open {
    target: Target,
    pages_name: String,
    builder: PagemapBuilder,
    sink: crate::archive::FileSink,
}

/// Mode and mtime of the images a receive writes (a tree archive's entries
/// need them): private, like the archive.
fn image_meta() -> EntryMeta {
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
    EntryMeta { mode: 0o600, mtime: now.as_secs() as i64, mtime_nsec: now.subsec_nanos() }
}

/// Receives one dump into `packer` (a tree archive). Returns `None` if
/// `stop` was set before a dump connected.
pub fn receive(server: &PageServer, packer: &Packer, stop: &AtomicBool) -> Result<Option<ReceiveReport>> {
    let Some((mut sock, inode)) = server.accept(stop)? else { return Ok(None) };
    let meta = image_meta();
    let mut report = ReceiveReport::default();
    let mut reader = CommandReader::new();
    let mut open: Option<Open> = None;
    let mut next_id = FIRST_PAGES_ID;
    let mut seen: HashSet<Target> = HashSet::new();
    let close = |open: Option<Open>, report: &mut ReceiveReport| -> Result<()> {
        let Some(o) = open else { return Ok(()) };
        o.sink.finish()?;
        let name = o.target.pagemap_name();
        let mut sink = packer.begin_entry(&name, FileKind::Plain, Some(meta))?;
        sink.write(&o.builder.finish())?;
        sink.finish()?;
        report.files.push(o.pages_name);
        report.files.push(name);
        Ok(())
    };
    let mut first = true;
    loop {
        let Some(c) = reader.next(&mut sock)? else {
            return Err(Error::Criu("the dump closed the page-server connection before it finished".into()));
        };
        if let Some(inode) = inode.filter(|_| std::mem::take(&mut first)) {
            // CRIU corks before its first command: the cork is on by now.
            let _ = uncork_dump(inode);
        }
        match c.cmd {
            ps::PS_IOV_OPEN2 => {
                close(open.take(), &mut report)?;
                let target = c.target()?;
                if !seen.insert(target) {
                    return Err(proto(format!("{} opened twice", target.pagemap_name())));
                }
                let pages_name = format!("pages-{next_id}.img");
                let sink = packer.begin_entry(&pages_name, FileKind::Pages, Some(meta))?;
                open = Some(Open { target, pages_name, builder: PagemapBuilder::new(next_id), sink });
                next_id += 1;
                // No parent: CRIU then sends every page (never PE_PARENT).
                reply(&mut sock, &[0u8])?;
            }
            ps::PS_IOV_PARENT => reply(&mut sock, &0i32.to_ne_bytes())?,
            ps::PS_IOV_ADD_F | ps::PS_IOV_ADD => {
                let flags = if c.cmd == ps::PS_IOV_ADD { pe::PRESENT } else { c.flags };
                let o = open.as_mut().ok_or_else(|| proto("pages before any pagemap was opened"))?;
                if c.target()? != o.target {
                    return Err(proto(format!(
                        "pages for {} while {} is open",
                        c.target()?.pagemap_name(),
                        o.target.pagemap_name()
                    )));
                }
                if flags & pe::PARENT != 0 || flags & pe::PRESENT == 0 {
                    return Err(proto(format!(
                        "an entry without its pages (flags {flags:#x}): lazy or incremental dumps are not received"
                    )));
                }
                let bytes = c
                    .nr_pages
                    .checked_mul(PAGE_SIZE as u64)
                    .filter(|b| *b <= 1 << 48)
                    .ok_or_else(|| proto(format!("impossible page count {}", c.nr_pages)))?;
                receive_pages(&mut sock, &mut o.sink, bytes)?;
                o.builder.push(c.vaddr, c.nr_pages, flags);
                report.pages += c.nr_pages;
            }
            ps::PS_IOV_CLOSE | ps::PS_IOV_FORCE_CLOSE => {
                let closed = close(open.take(), &mut report).and_then(|_| packer.wait_written());
                // Non-zero fails the dump: CRIU then resumes the tree.
                let status: i32 = if closed.is_ok() { 0 } else { -1 };
                let replied = reply(&mut sock, &status.to_ne_bytes());
                closed?;
                replied?;
                // CRIU closes its end next; reading to EOF leaves the
                // TIME_WAIT with it.
                let _ = std::io::copy(&mut sock, &mut std::io::sink());
                report.protocol =
                    if reader.layout() == Some(ps::Layout::Narrow) { "pre-4.2" } else { "4.2+" }.to_string();
                return Ok(Some(report));
            }
            other => return Err(proto(format!("unexpected command {other:#x}"))),
        }
    }
}

fn reply(sock: &mut TcpStream, b: &[u8]) -> Result<()> {
    sock.write_all(b).map_err(|e| proto(format!("replying to the dump: {e}")))
}

/// Moves exactly `bytes` of page data from the socket into the pages sink.
fn receive_pages(sock: &mut TcpStream, sink: &mut crate::archive::FileSink, mut bytes: u64) -> Result<()> {
    while bytes > 0 {
        let n = sink
            .read_up_to(&sock.as_fd(), bytes.min(usize::MAX as u64) as usize)
            .map_err(|e| proto(format!("reading pages from the dump: {e}")))?;
        if n == 0 {
            return Err(Error::Criu("the dump closed the page-server connection inside a run of pages".into()));
        }
        bytes -= n as u64;
    }
    Ok(())
}

/// Completes a dump whose page images are already in `packer`: adds what
/// else the dump wrote in its images directory (`dir`: CRIU's metadata
/// images, runc's own files; what it held `before` the dump and still
/// holds as it was is left out, and named in the result), each entry as
/// `take` says (false: already in, skipped; an error refuses the dump),
/// and finishes the archive. `inventory.img` must be one of them (CRIU
/// writes it last).
pub fn finish_with_images(
    packer: Packer,
    dir: &Path,
    before: &tree::Before,
    take: &dyn Fn(&tree::Entry) -> Result<bool>,
) -> Result<(PackStats, Vec<String>)> {
    let fed = (|| -> Result<Vec<String>> {
        let (written, stale) = before.scan_since(dir)?;
        let mut entries = Vec::with_capacity(written.len());
        for e in written {
            if take(&e)? {
                entries.push(e);
            }
        }
        if !entries.iter().any(|e| e.path == "inventory.img") {
            return Err(Error::Criu(format!("{}: no inventory.img: the dump did not finish", dir.display())));
        }
        tree::feed_dir(&packer, dir, &entries, &mut |_| {})?;
        Ok(stale)
    })();
    match fed {
        Ok(stale) => packer.finish().map(|(stats, _)| (stats, stale)),
        Err(e) => Err(packer.abort().unwrap_or(e)),
    }
}

/// Runs `cmd`, a dump told to send its pages to `server` and its other
/// images to `dir` (which held `before` as it began), and writes the whole
/// checkpoint into `packer`. Complete only when the dump exits 0 after a
/// CLOSE and wrote `inventory.img` in `dir`;
/// otherwise the packer is aborted and the error says why (`what` names the
/// dump in it).
pub fn run_dump(
    server: &PageServer,
    mut cmd: std::process::Command,
    what: &str,
    dir: &Path,
    before: &tree::Before,
    packer: Packer,
    guard: Option<&crate::proc::guard::Guard>,
) -> Result<(PackStats, ReceiveReport)> {
    let stop = AtomicBool::new(false);
    let (status, received) = std::thread::scope(|s| {
        let rx = s.spawn(|| receive(server, &packer, &stop));
        let status = crate::session::criu_run::run_criu_told(&mut cmd, &[], guard);
        stop.store(true, Ordering::Relaxed);
        (status, rx.join().unwrap_or(Err(Error::Cancelled)))
    });
    match (status, received) {
        (Ok(st), Ok(Some(report))) if st.success() => complete(packer, dir, before, report),
        (status, received) => Err(packer.abort().unwrap_or_else(|| failure(status, received, what))),
    }
}

/// Completes a dump whose pages all came in (`report`): what it wrote in
/// its images directory (see [`finish_with_images`]) must be none of the
/// images it sent, and joins the archive.
pub fn complete(
    packer: Packer,
    dir: &Path,
    before: &tree::Before,
    report: ReceiveReport,
) -> Result<(PackStats, ReceiveReport)> {
    // CRIU writes no page images locally when it has a page server.
    let not_sent = |e: &tree::Entry| match report.files.contains(&e.path) {
        true => Err(Error::Criu(format!(
            "{}: the dump wrote it and sent it to the page server too",
            dir.join(&e.path).display()
        ))),
        false => Ok(true),
    };
    let (stats, left_out) = finish_with_images(packer, dir, before, &not_sent)?;
    Ok((stats, ReceiveReport { left_out, ..report }))
}

/// Why a dump that ended (`status`) with what the page server received is
/// not a checkpoint (see [`run_dump`]).
pub fn failure(
    status: std::io::Result<std::process::ExitStatus>,
    received: Result<Option<ReceiveReport>>,
    what: &str,
) -> Error {
    match (status, received) {
        (Err(e), _) => cannot_run(what, e),
        // The dump's own failure is the one to report; a receive error
        // that made it fail (a full disk) is its cause, when there is one.
        (Ok(st), Err(e)) if !st.success() && !e.is_cancelled() => e.context(format!("{what} failed ({st})")),
        (Ok(st), _) if !st.success() => Error::Criu(format!("{what} failed ({st})")),
        (Ok(_), Ok(None)) => Error::Criu(format!("{what} exited 0 but never connected to the page server")),
        (Ok(_), Ok(Some(_))) => Error::Criu(format!("{what} exited 0 before its checkpoint was written")),
        (Ok(_), Err(e)) => e,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proc::socket::their_fd;
    use std::os::fd::RawFd;
    use std::time::Duration;

    /// TCP_CORK of descriptor `fd` of process `pid`.
    fn corked(pid: u32, fd: RawFd) -> bool {
        let theirs = their_fd(pid as i32, fd).expect("pidfd_getfd");
        let mut v: libc::c_int = -1;
        let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
        // SAFETY: getsockopt writes one c_int into `v`.
        let r = unsafe {
            libc::getsockopt(
                theirs.as_raw_fd(),
                libc::IPPROTO_TCP,
                libc::TCP_CORK,
                (&mut v as *mut libc::c_int).cast(),
                &mut len,
            )
        };
        assert_eq!(r, 0, "getsockopt TCP_CORK");
        v != 0
    }

    /// A page server on loopback and its port, for a test that needs root
    /// (CI has it); `None` otherwise.
    fn server_as_root(why: &str) -> Option<(PageServer, u16)> {
        // SAFETY: geteuid has no preconditions.
        let root = unsafe { libc::geteuid() } == 0;
        assert!(root || std::env::var_os("CI").is_none(), "CI runs the tests as root ({why})");
        let server = root.then(|| PageServer::bind("127.0.0.1:0").unwrap())?;
        let port = server.local_addr().unwrap().port();
        Some((server, port))
    }

    /// A python3 child (behind `wrapper`, e.g. setpriv) that connects to
    /// `port`, runs `then` (its socket is `s`) and sleeps; with the first
    /// line it printed.
    fn connecting_child(wrapper: &[&str], port: u16, then: &str) -> (std::process::Child, String) {
        let script =
            format!("import socket,time; s=socket.create_connection(('127.0.0.1',{port})); {then}; time.sleep(30)");
        let argv: Vec<&str> = wrapper.iter().copied().chain(["/usr/bin/python3", "-c"]).collect();
        let mut child = std::process::Command::new(argv[0])
            .args(&argv[1..])
            .arg(script)
            .stdout(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let mut line = String::new();
        let out = child.stdout.take().unwrap();
        std::io::BufRead::read_line(&mut std::io::BufReader::new(out), &mut line).unwrap();
        (child, line.trim().to_string())
    }

    /// The dump's end of the connection (a child that corks its socket,
    /// as CRIU does) is found and uncorked, and what it held arrives.
    #[test]
    fn the_dumps_socket_is_uncorked() {
        let Some((server, port)) = server_as_root("reaching into another process's descriptors takes root") else {
            return;
        };
        let cork =
            "s.setsockopt(socket.IPPROTO_TCP, socket.TCP_CORK, 1); s.send(b'c' * 32); print(s.fileno(), flush=True)";
        let (mut dump, line) = connecting_child(&[], port, cork);
        let fd: RawFd = line.parse().unwrap();
        let (mut sock, inode) = server.accept(&AtomicBool::new(false)).unwrap().unwrap();
        assert!(corked(dump.id(), fd));
        assert!(uncork_dump(inode.expect("a loopback connection's inode")));
        assert!(!corked(dump.id(), fd));
        let mut held = [0u8; 32];
        std::io::Read::read_exact(&mut sock, &mut held).unwrap();
        assert_eq!(held, [b'c'; 32]);
        let _ = dump.kill();
        let _ = dump.wait();
    }

    /// Another user's connection to the page server's port is refused, and
    /// the one from criuz's own user that follows is served.
    #[test]
    fn another_users_connection_is_refused() {
        let Some((server, port)) = server_as_root("connecting as another user takes setpriv") else { return };
        let nobody = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"];
        let (mut stranger, line) = connecting_child(&nobody, port, "print(s.getsockname()[1], flush=True)");
        let stranger_port: u16 = line.parse().unwrap();
        let ours = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(200));
            let s = TcpStream::connect(("127.0.0.1", port)).unwrap();
            let p = s.local_addr().unwrap().port();
            std::thread::sleep(Duration::from_millis(500));
            p
        });
        let stop = AtomicBool::new(false);
        let (got, _) = server.accept(&stop).unwrap().expect("a connection");
        let served = got.peer_addr().unwrap().port();
        assert_ne!(served, stranger_port, "the stranger's connection was served");
        assert_eq!(served, ours.join().unwrap(), "our own connection is served");
        let _ = stranger.kill();
        let _ = stranger.wait();
    }
}

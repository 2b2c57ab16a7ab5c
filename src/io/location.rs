//! Where an archive is, parsed once from what the user typed: standard
//! input or output (`-`), a file, an object (`s3://bucket/key`), or bytes
//! in memory (tests and the fuzzer). Every question whose answer depends on
//! that is answered here and nowhere else: the archive's label in messages,
//! the directory its parents' hints are relative to, a reader front to
//! back, a random-access store, an output.
//!
//! Standard input cannot be read twice, so its first bytes, once peeked
//! ([`Location::head`], to tell what an archive is), are kept and handed
//! back in front of the rest by [`Location::reader`]. A path that names no
//! regular file (a named pipe, `/dev/stdin`, a shell's `<(…)` or `>(…)`, a
//! device) is the same: a [`Location::Stream`], opened once and read or
//! written front to back, never reopened (a FIFO's second open would wait
//! for a new writer, or read on mid-stream). A random-access store
//! of a pipe is the pipe spooled to a private unnamed temporary file, of at
//! most [`SPOOL_CAP`] bytes unless the caller gives another cap: CRIU asks
//! for `inventory.img` first and it is written last, so a restore cannot
//! start before the stream has ended anyway, and one read path with bounded
//! memory beats holding the archive in RAM.

use super::{s3, Output, RecordStore};
use crate::error::{Error, IoContext, Result, ResultContext};
use std::fs::File;
use std::io::{IsTerminal, Read, Write};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

/// What an archive arriving on a pipe may spool by default (`--pipe-buffer`).
pub const SPOOL_CAP: u64 = 2 << 30;

/// Read buffer of a front-to-back reader.
const READ_BUF: usize = 1 << 20;

/// Where an archive is.
#[derive(Clone, Debug)]
pub enum Location {
    /// `-`: standard input to read, standard output to write.
    Stdio,
    File(PathBuf),
    /// A path to no regular file or directory: read, or written, as a stream.
    Stream(Arc<NamedStream>),
    Object(s3::ObjectUrl),
    /// Bytes held in memory, under a label for messages.
    Memory {
        label: String,
        bytes: Arc<Vec<u8>>,
    },
}

/// Bytes of standard input read ahead to tell what the archive is; handed
/// back first by the next reader of standard input.
static STDIN_PEEKED: Mutex<Vec<u8>> = Mutex::new(Vec::new());

/// Whether standard input is a regular file whose offset was 0 when this
/// was first asked, before criuz read any of it: asked first by every
/// reader of standard input, so the answer is what the user redirected.
fn stdin_is_a_file_from_its_start() -> bool {
    static FROM_START: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *FROM_START.get_or_init(|| {
        let Ok(meta) = std::fs::metadata("/proc/self/fd/0") else { return false };
        // SAFETY: lseek on descriptor 0 with SEEK_CUR moves nothing; it
        // fails on a pipe or a terminal.
        meta.is_file() && unsafe { libc::lseek(0, 0, libc::SEEK_CUR) } == 0
    })
}

/// A path read or written as a stream (see the module's docs): opened once,
/// on first use, as standard input is open once; its peeked bytes kept as
/// [`STDIN_PEEKED`] keeps standard input's.
#[derive(Debug)]
pub struct NamedStream {
    path: PathBuf,
    /// Opened for reading, with the bytes peeked but not yet read.
    reading: Mutex<Option<(File, Vec<u8>)>>,
}

impl NamedStream {
    /// Runs `f` on the stream opened for reading (opened now, the first
    /// time: a FIFO's open waits for its writer).
    fn with_reading<T>(&self, f: impl FnOnce(&mut File, &mut Vec<u8>) -> T) -> Result<T> {
        let mut reading = self.reading.lock().unwrap_or_else(|e| e.into_inner());
        if reading.is_none() {
            *reading = Some((File::open(&self.path).at(&self.path)?, Vec::new()));
        }
        let (file, peeked) = reading.as_mut().expect("opened above");
        Ok(f(file, peeked))
    }
}

impl Location {
    /// `-`, an `s3://` URL, or a path.
    pub fn parse(spec: &Path) -> Result<Location> {
        if spec == Path::new("-") {
            Ok(Location::Stdio)
        } else if s3::is_url(spec) {
            Ok(Location::Object(s3::ObjectUrl::parse(spec)?))
        } else if descriptor_entry(spec).is_some() || std::fs::metadata(spec).is_ok_and(|m| !m.is_file() && !m.is_dir())
        {
            let path = spec.to_path_buf();
            Ok(Location::Stream(Arc::new(NamedStream { path, reading: Mutex::new(None) })))
        } else {
            Ok(Location::File(spec.to_path_buf()))
        }
    }

    /// An archive held in memory.
    pub fn memory(label: impl Into<String>, bytes: Vec<u8>) -> Location {
        Location::Memory { label: label.into(), bytes: Arc::new(bytes) }
    }

    /// Read or written once, front to back: standard input or output, or a
    /// named stream.
    pub fn is_stream(&self) -> bool {
        matches!(self, Location::Stdio | Location::Stream(_))
    }

    /// Whether writing here writes to criuz's standard output: `-`, or a
    /// name for the same open file (`/dev/stdout`), where a report must not
    /// go too.
    pub fn is_stdout(&self) -> bool {
        use std::os::unix::fs::MetadataExt;
        match self {
            Location::Stdio => true,
            Location::Stream(s) => {
                let Ok(named) = std::fs::metadata(&s.path) else { return false };
                let Ok(out) = std::fs::metadata("/proc/self/fd/1") else { return false };
                (named.dev(), named.ino()) == (out.dev(), out.ino())
            }
            _ => false,
        }
    }

    pub fn is_object(&self) -> bool {
        matches!(self, Location::Object(_))
    }

    /// The file's path, for a file.
    pub fn path(&self) -> Option<&Path> {
        match self {
            Location::File(p) => Some(p),
            _ => None,
        }
    }

    /// Names the archive in messages (`stdin` for standard input).
    pub fn label(&self) -> String {
        match self {
            Location::Stdio => "stdin".into(),
            Location::File(p) => p.display().to_string(),
            Location::Stream(s) => s.path.display().to_string(),
            Location::Object(u) => u.to_string(),
            Location::Memory { label, .. } => label.clone(),
        }
    }

    /// The directory a parent's hint is relative to: the archive's own, the
    /// current directory for a stream (a pipe's `/dev/fd` says nothing of
    /// where the archive was); `None` for bytes in memory, which are
    /// nowhere (their hints are not followed).
    pub fn base_dir(&self) -> Option<PathBuf> {
        let spec = match self {
            Location::File(p) => p.clone(),
            Location::Object(u) => PathBuf::from(u.to_string()),
            Location::Stdio | Location::Stream(_) => return Some(PathBuf::from(".")),
            Location::Memory { .. } => return None,
        };
        match spec.parent() {
            Some(d) if !d.as_os_str().is_empty() => Some(d.to_path_buf()),
            _ => Some(PathBuf::from(".")),
        }
    }

    /// The first `len` bytes (`None` if there are fewer or they cannot be
    /// read): enough to tell what an archive is without fetching it. On
    /// standard input they are kept for the next reader.
    pub fn head(&self, len: usize) -> Option<Vec<u8>> {
        match self {
            Location::Stdio => {
                stdin_is_a_file_from_its_start();
                let mut peeked = STDIN_PEEKED.lock().unwrap_or_else(|e| e.into_inner());
                if peeked.len() < len {
                    let have = peeked.len();
                    peeked.resize(len, 0);
                    let got = read_up_to(&mut std::io::stdin().lock(), &mut peeked[have..]);
                    peeked.truncate(have + got);
                }
                peeked.get(..len).map(<[u8]>::to_vec)
            }
            Location::File(p) => {
                let mut b = vec![0u8; len];
                File::open(p).ok()?.read_exact(&mut b).ok()?;
                Some(b)
            }
            Location::Stream(s) => s
                .with_reading(|file, peeked| {
                    if peeked.len() < len {
                        let have = peeked.len();
                        peeked.resize(len, 0);
                        let got = read_up_to(file, &mut peeked[have..]);
                        peeked.truncate(have + got);
                    }
                    peeked.get(..len).map(<[u8]>::to_vec)
                })
                .ok()
                .flatten(),
            Location::Object(u) => s3::read_head(u, len).ok(),
            Location::Memory { bytes, .. } => bytes.get(..len).map(<[u8]>::to_vec),
        }
    }

    /// The archive front to back.
    pub fn reader(&self) -> Result<Box<dyn Read + Send>> {
        Ok(match self {
            Location::Stdio => {
                stdin_is_a_file_from_its_start();
                let peeked = std::mem::take(&mut *STDIN_PEEKED.lock().unwrap_or_else(|e| e.into_inner()));
                let rest = std::io::BufReader::with_capacity(READ_BUF, std::io::stdin());
                Box::new(std::io::Cursor::new(peeked).chain(rest))
            }
            Location::File(p) => Box::new(std::io::BufReader::with_capacity(READ_BUF, File::open(p).at(p)?)),
            Location::Stream(s) => {
                // A second handle on the one open file: a later reader goes
                // on where this one stopped, as standard input's does.
                let (peeked, rest) = s.with_reading(|file, peeked| (std::mem::take(peeked), file.try_clone()))?;
                let rest = std::io::BufReader::with_capacity(READ_BUF, rest.at(&s.path)?);
                Box::new(std::io::Cursor::new(peeked).chain(rest))
            }
            Location::Object(u) => {
                Box::new(std::io::BufReader::with_capacity(READ_BUF, s3::Download::start(u)?.reader()))
            }
            Location::Memory { bytes, .. } => Box::new(std::io::Cursor::new(SharedVec(bytes.clone()))),
        })
    }

    /// Random access to the archive: a file, an object being fetched (reads
    /// wait for the bytes they need), memory, or a stream spooled to a
    /// private unnamed temporary file of at most `spool_cap` bytes (but
    /// one with a file behind it, `< a.czr`, read in place).
    pub fn store(&self, spool_cap: u64) -> Result<Box<dyn RecordStore>> {
        Ok(match self {
            Location::Stdio | Location::Stream(_) => match self.file_behind()? {
                Some(file) => Box::new(file),
                None => {
                    // Outside the archive's label: a `$TMPDIR` that cannot
                    // take the spool is no fault of the archive.
                    let dir = super::temp_dir()?;
                    Box::new(spool(self.reader()?, &dir, spool_cap).context(|| self.label())?)
                }
            },
            Location::File(p) => Box::new(File::open(p).at(p)?),
            Location::Object(u) => Box::new(s3::Download::start(u)?),
            Location::Memory { bytes, .. } => Box::new(SharedVec(bytes.clone())),
        })
    }

    /// [`store`](Self::store), a local file read ahead of its readers
    /// ([`ReadAhead`](super::read_ahead::ReadAhead)): for an archive read
    /// through (a restore, a verify), not for one read in a few places (a
    /// parent).
    pub fn store_reading_ahead(&self, spool_cap: u64) -> Result<Box<dyn RecordStore>> {
        let file = match self {
            Location::File(p) => File::open(p).at(p)?,
            Location::Stdio | Location::Stream(_) => match self.file_behind()? {
                Some(file) => file,
                None => return self.store(spool_cap),
            },
            _ => return self.store(spool_cap),
        };
        Ok(Box::new(super::read_ahead::ReadAhead::new(file)))
    }

    /// A stream that is a regular file read from its start (standard input
    /// redirected from an archive, `/dev/stdin` then, or a descriptor a
    /// script opened): a handle of its own to read at random, where a pipe
    /// would be spooled (the spool doubles the reads, and `--pipe-buffer`
    /// caps it). `None` for a pipe, a device, or standard input that was
    /// not at its file's start when criuz first read it.
    fn file_behind(&self) -> Result<Option<File>> {
        match self {
            Location::Stdio => {
                if !stdin_is_a_file_from_its_start() {
                    return Ok(None);
                }
                let fd = std::os::fd::AsFd::as_fd(&std::io::stdin()).try_clone_to_owned().at(Path::new("-"))?;
                Ok(Some(File::from(fd)))
            }
            // Opened here, at the file's start.
            Location::Stream(s) => s
                .with_reading(|file, _| file.metadata().is_ok_and(|m| m.is_file()).then(|| file.try_clone()))?
                .transpose()
                .at(&s.path),
            _ => Ok(None),
        }
    }

    /// Checks an archive the user named to be read, before anything runs:
    /// standard input on a terminal (bytes nobody types), a file that is not
    /// there or is a directory, are bad arguments (exit 2), not failed
    /// operations.
    pub fn check_input(&self) -> Result<()> {
        match self {
            Location::Stdio if std::io::stdin().is_terminal() => {
                Err(Error::Usage("-: standard input is a terminal; pipe or redirect the archive into criuz".into()))
            }
            Location::File(p) => super::named_file(p),
            Location::Stream(s) => match s.with_reading(|file, _| file.is_terminal())? {
                true => Err(Error::Usage(format!(
                    "{}: a terminal; pipe or redirect the archive into criuz",
                    s.path.display()
                ))),
                false => Ok(()),
            },
            _ => Ok(()),
        }
    }

    /// A new archive here, published only by [`Output::commit`]; an existing
    /// one is refused unless `force`.
    pub fn output(&self, force: bool) -> Result<Output> {
        match self {
            // Refused before anything runs: a dump would end its process
            // with the archive scrolled past on a screen.
            Location::Stdio if std::io::stdout().is_terminal() => Err(Error::Usage(
                "-: standard output is a terminal; redirect the archive to a file or pipe it on".into(),
            )),
            Location::Stdio => Ok(Output::Stdout),
            Location::Stream(s) => {
                // Written as it is (no file is replaced): opened for writing
                // now, before anything runs, so a FIFO waits for its reader
                // here, and a terminal is refused as standard output's is.
                // One of criuz's own descriptors is written through a copy
                // of it, as `-` writes through descriptor 1 (`>>` appends).
                let file = match own_descriptor(&s.path) {
                    // SAFETY: a descriptor this process holds open (it
                    // named it a moment ago); dup'd, ours to own.
                    Some(fd) => std::os::fd::AsFd::as_fd(&unsafe { std::os::fd::BorrowedFd::borrow_raw(fd) })
                        .try_clone_to_owned()
                        .map(File::from)
                        .at(&s.path)?,
                    None => std::fs::OpenOptions::new().write(true).open(&s.path).at(&s.path)?,
                };
                if file.is_terminal() {
                    return Err(Error::Usage(format!(
                        "{}: a terminal; redirect the archive to a file or pipe it on",
                        s.path.display()
                    )));
                }
                Ok(Output::Stream(file, s.path.clone()))
            }
            Location::File(p) => Ok(Output::File(super::AtomicFile::create(p, force)?)),
            Location::Object(u) => Ok(Output::Object(s3::Upload::start(u.clone(), force)?)),
            Location::Memory { label, .. } => Err(Error::Usage(format!("{label}: cannot write an archive to memory"))),
        }
    }
}

impl std::fmt::Display for Location {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            // What the user typed.
            Location::Stdio => f.write_str("-"),
            _ => f.write_str(&self.label()),
        }
    }
}

/// Bytes in memory shared by every reader of a [`Location::Memory`].
#[derive(Clone, Debug)]
struct SharedVec(Arc<Vec<u8>>);

impl AsRef<[u8]> for SharedVec {
    fn as_ref(&self) -> &[u8] {
        &self.0
    }
}

impl RecordStore for SharedVec {
    fn size(&self) -> u64 {
        self.0.size()
    }
    fn read_exact_at(&self, buf: &mut [u8], offset: u64) -> std::io::Result<()> {
        self.0.read_exact_at(buf, offset)
    }
}

/// The `/proc/PID/fd/N` entry `path` leads to, if it names an open
/// descriptor (`/dev/stdout`, `/dev/fd/3`, `/proc/self/fd/1`), whatever
/// file is behind it: one to use as it is, as `-` is, never a file to
/// replace (a rename over `/dev/stdout` would replace the link in `/dev`).
fn descriptor_entry(path: &Path) -> Option<PathBuf> {
    let in_fd_dir = |dir: &Path| {
        let parts: Vec<_> = dir.components().map(|c| c.as_os_str().to_owned()).collect();
        matches!(&parts[..], [root, proc, _, fd] if root == "/" && proc == "proc" && fd == "fd")
    };
    let mut at = path.to_path_buf();
    // Each link of the last component followed (`/dev/stdout` ->
    // `/proc/self/fd/1`), a few at most.
    for _ in 0..8 {
        let parent = at.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
        let parent = parent.canonicalize().ok()?;
        if in_fd_dir(&parent) {
            return Some(parent.join(at.file_name()?));
        }
        at = parent.join(at.read_link().ok()?);
    }
    None
}

/// This process's descriptor `path` names (`/dev/stdout`: 1), to write
/// through as it is: opened again, a file behind it would be written from
/// its start, over what a `>>` redirection keeps.
fn own_descriptor(path: &Path) -> Option<std::os::fd::RawFd> {
    let entry = descriptor_entry(path)?;
    let ours = Path::new("/proc/self/fd").canonicalize().ok()?;
    (entry.parent()? == ours).then(|| entry.file_name()?.to_str()?.parse().ok()).flatten()
}

/// Reads until `buf` is full or the input ends; the bytes read.
fn read_up_to(inp: &mut impl Read, buf: &mut [u8]) -> usize {
    let mut got = 0;
    while got < buf.len() {
        match inp.read(&mut buf[got..]) {
            Ok(0) => break,
            Ok(n) => got += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(_) => break,
        }
    }
    got
}

/// Copies an archive arriving on a pipe into an unnamed temporary file
/// (mode 0600, gone when closed).
fn spool(mut inp: impl Read, dir: &Path, cap: u64) -> Result<File> {
    let mut file = tempfile::tempfile_in(dir).at(dir)?;
    let copied = std::io::copy(&mut (&mut inp).take(cap.saturating_add(1)), &mut file)
        .map_err(|e| match e.raw_os_error() {
            Some(libc::ENOSPC | libc::EDQUOT) => std::io::Error::new(
                std::io::ErrorKind::StorageFull,
                format!("no room to spool the piped archive ({e}); set TMPDIR to a larger file system, or restore from a file"),
            ),
            _ => e,
        })
        .at(dir)?;
    if copied > cap {
        return Err(Error::Usage(format!(
            "the archive is larger than --pipe-buffer ({cap} bytes); raise it, or restore from a file"
        )));
    }
    file.flush().at(dir)?;
    Ok(file)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_location_is_parsed_once_with_its_label_and_base() {
        let stdio = Location::parse(Path::new("-")).unwrap();
        assert!(stdio.is_stream() && stdio.is_stdout());
        assert_eq!((stdio.label(), stdio.base_dir()), ("stdin".to_string(), Some(PathBuf::from("."))));
        let file = Location::parse(Path::new("dir/a.czr")).unwrap();
        assert_eq!((file.label(), file.base_dir()), ("dir/a.czr".to_string(), Some(PathBuf::from("dir"))));
        assert_eq!(Location::parse(Path::new("a.czr")).unwrap().base_dir(), Some(PathBuf::from(".")));
        let object = Location::parse(Path::new("s3://bucket/dir/a.czr")).unwrap();
        assert!(object.is_object());
        assert_eq!(object.base_dir(), Some(PathBuf::from("s3://bucket/dir")));
        assert_eq!(Location::memory("m", Vec::new()).base_dir(), None);
        assert!(Location::parse(Path::new("s3://bucket/")).is_err());
    }

    /// `/dev/stdout` with a file behind it was that file, and `--force`
    /// renamed the archive over the link in `/dev`; a FIFO's head, once
    /// peeked, was gone from the reader that followed.
    #[test]
    fn a_descriptor_or_a_fifo_is_a_stream() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("a.czr");
        std::fs::write(&file, b"x").unwrap();
        let link = dir.path().join("link.czr");
        std::os::unix::fs::symlink(&file, &link).unwrap();
        for plain in [&file, &link, &dir.path().join("new.czr")] {
            assert!(matches!(Location::parse(plain).unwrap(), Location::File(_)), "{}", plain.display());
        }
        let held = File::open(&file).unwrap();
        let fd = std::os::fd::AsRawFd::as_raw_fd(&held);
        for named in [format!("/proc/self/fd/{fd}"), format!("/dev/fd/{fd}"), "/dev/stdout".into()] {
            let at = Location::parse(Path::new(&named)).unwrap();
            assert!(at.is_stream() && at.path().is_none(), "{named} is not a stream");
        }
        // A file behind a descriptor is read in place: no spool (a cap of
        // 0 holds nothing), from its start.
        let at = Location::parse(Path::new(&format!("/proc/self/fd/{fd}"))).unwrap();
        assert_eq!(at.store(0).unwrap().read_vec(1, 0).unwrap(), b"x");
        let fifo = dir.path().join("fifo");
        super::super::make_node(&fifo, libc::S_IFIFO | 0o600, 0);
        let writer = {
            let fifo = fifo.clone();
            std::thread::spawn(move || std::fs::write(fifo, b"0123456789").unwrap())
        };
        let at = Location::parse(&fifo).unwrap();
        assert!(at.is_stream() && !at.is_stdout());
        assert_eq!(at.head(4).unwrap(), b"0123");
        let mut all = Vec::new();
        at.reader().unwrap().read_to_end(&mut all).unwrap();
        assert_eq!(all, b"0123456789", "the peeked bytes come first, then the rest of the one stream");
        writer.join().unwrap();
    }

    /// `-o /dev/stdout >> log` opened the file again and wrote over its
    /// start; it now writes through the descriptor, as `-o -` does.
    #[test]
    fn an_own_descriptor_is_written_through() {
        use std::io::Write;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("log");
        std::fs::write(&path, b"kept ").unwrap();
        let held = File::options().append(true).open(&path).unwrap();
        let fd = std::os::fd::AsRawFd::as_raw_fd(&held);
        assert_eq!(own_descriptor(Path::new(&format!("/dev/fd/{fd}"))), Some(fd));
        assert_eq!(own_descriptor(Path::new("/dev/stdout")), Some(1));
        assert_eq!(own_descriptor(&path), None);
        let out = Location::parse(Path::new(&format!("/proc/self/fd/{fd}"))).unwrap().output(false).unwrap();
        {
            let mut w = out.writer().unwrap();
            w.write_all(b"archive").unwrap();
            w.flush().unwrap();
        }
        out.commit().unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), b"kept archive");
    }

    #[test]
    fn memory_reads_front_to_back_and_at_random() {
        let loc = Location::memory("m", b"0123456789".to_vec());
        assert_eq!(loc.head(4).unwrap(), b"0123");
        assert!(loc.head(11).is_none());
        let mut all = Vec::new();
        loc.reader().unwrap().read_to_end(&mut all).unwrap();
        assert_eq!(all, b"0123456789");
        let store = loc.store(0).unwrap();
        assert_eq!(store.read_vec(3, 7).unwrap(), b"789");
    }

    #[test]
    fn a_pipe_larger_than_its_cap_is_refused() {
        let e = spool(&b"0123456789"[..], &std::env::temp_dir(), 4).unwrap_err();
        assert_eq!(e.kind(), crate::Kind::Usage);
        let f = spool(&b"0123"[..], &std::env::temp_dir(), 4).unwrap();
        assert_eq!(RecordStore::size(&f), 4);
    }
}

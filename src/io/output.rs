//! Publish-on-commit outputs: an [`Output`] is a file written under a
//! temporary name and renamed into place by [`Output::commit`] (fsynced
//! first, its writeback started as it is written), standard output, a named
//! stream, or an object upload; dropped uncommitted, nothing is published.

use super::{leftover, name_beside, named_dir, s3, sync_parent, unfinished, Location};
use crate::error::{Error, IoContext, Result};
use std::fs::{File, OpenOptions};
use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

pub struct AtomicFile {
    file: Option<File>,
    tmp: PathBuf,
    target: PathBuf,
    force: bool,
    /// Whether its writers' flusher threads may flush (see `EarlyWriteback`).
    flush_behind: Arc<AtomicBool>,
    /// Removed should criuz be interrupted before the commit.
    unfinished: unfinished::Unfinished,
    published: bool,
}

impl AtomicFile {
    /// Refuses an existing target unless `force`, and, even with `force`,
    /// a target that is not a file: the rename that publishes the archive
    /// would replace a device node (`-o /dev/null` as root), or fail only
    /// once the whole dump was done (a directory).
    pub fn create(target: &Path, force: bool) -> Result<Self> {
        if let Some(kind) = not_a_file(target) {
            return Err(Error::Usage(format!(
                "{}: {kind}, not a file criuz may replace (standard output is -)",
                target.display()
            )));
        }
        if !force && target.symlink_metadata().is_ok() {
            return Err(Error::Exists(target.to_path_buf()));
        }
        let name = target.file_name().ok_or_else(|| Error::Usage(format!("{}: not a file name", target.display())))?;
        let dir = target.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
        // A mistyped directory is the user's to fix (exit 2), found before a
        // dump freezes anything. (`unpack -d` and `keygen` make theirs first.)
        named_dir(dir).map_err(|e| e.context(target.display().to_string()))?;
        // Room for a pid of up to 10 digits.
        let prefix = name_beside(name, "tmp-", 10);
        leftover::remove_abandoned(dir, &prefix);
        // A writer killed before its staging file got its held name.
        let new_prefix = name_beside(name, "new-", 10);
        leftover::remove_abandoned(dir, &new_prefix);
        let tmp = dir.join(format!("{prefix}{}", std::process::id()));
        if tmp.symlink_metadata().is_ok() {
            // Held: another writer of this target in this very process.
            return Err(Error::Exists(tmp));
        }
        let staging = dir.join(format!("{new_prefix}{}", std::process::id()));
        // Registered as it is made: an interruption removes it.
        let (file, unfinished) = unfinished::Unfinished::made(|| {
            // Another writer of this target sweeps unheld staging files (above).
            leftover::made_again_if_swept(|| -> Result<File> {
                // Errors name the user's target: the temporary names mean
                // nothing to them.
                let file = OpenOptions::new().write(true).create_new(true).mode(0o600).open(&staging).at(target)?;
                leftover::publish_held(&file, &staging, &tmp)
                    .inspect_err(|_| {
                        let _ = std::fs::remove_file(&staging);
                    })
                    .at(target)?;
                Ok(file)
            })
            .map(|file| (file, tmp.clone()))
        })?;
        Ok(AtomicFile {
            file: Some(file),
            tmp,
            target: target.to_path_buf(),
            force,
            flush_behind: Default::default(),
            unfinished,
            published: false,
        })
    }

    pub fn file(&self) -> &File {
        self.file.as_ref().expect("open until commit")
    }

    /// A second handle for a writer that must own its output.
    pub fn writer(&self) -> Result<File> {
        self.file().try_clone().at(&self.tmp)
    }

    pub fn commit(mut self) -> Result<()> {
        let file = self.file.take().expect("open until commit");
        // Named as the user named it: the temporary name means nothing to them.
        file.sync_all().at(&self.target)?;
        drop(file);
        // Whole or not at all: an interruption either removed the temporary
        // file before this or waits until it is the target.
        let (tmp, target, force) = (&self.tmp, &self.target, self.force);
        let published = self.unfinished.publish_output(target, || match force {
            true => std::fs::rename(tmp, target),
            false => rename_new(tmp, target),
        });
        match published {
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => return Err(Error::Exists(target.clone())),
            other => other.at(target)?,
        }
        self.published = true;
        sync_parent(&self.target);
        Ok(())
    }
}

/// Renames `from` to `to` unless `to` exists, in one step
/// (`renameat2(RENAME_NOREPLACE)`): of two writers of one target without
/// `--force` (two dumps of two processes to one name), the second fails
/// with `AlreadyExists` where a check and then a rename could let it
/// replace the first's archive, whose process is gone. A file system
/// without that rename (EINVAL) gets the check and the rename.
fn rename_new(from: &Path, to: &Path) -> std::io::Result<()> {
    use std::os::unix::ffi::OsStrExt;
    let c = |p: &Path| std::ffi::CString::new(p.as_os_str().as_bytes()).map_err(std::io::Error::other);
    let (f, t) = (c(from)?, c(to)?);
    // SAFETY: renameat2 on two NUL-terminated paths.
    let r = unsafe { libc::renameat2(libc::AT_FDCWD, f.as_ptr(), libc::AT_FDCWD, t.as_ptr(), libc::RENAME_NOREPLACE) };
    if r == 0 {
        return Ok(());
    }
    let e = std::io::Error::last_os_error();
    if !matches!(e.raw_os_error(), Some(libc::EINVAL | libc::ENOSYS)) {
        return Err(e);
    }
    if to.symlink_metadata().is_ok() {
        return Err(std::io::ErrorKind::AlreadyExists.into());
    }
    std::fs::rename(from, to)
}

/// What `target` is where it names no file a rename may replace: a
/// directory (or a name ending in `/`), a device, a FIFO or a socket. A
/// symbolic link is replaced itself, as `mv` would, not what it points to.
fn not_a_file(target: &Path) -> Option<&'static str> {
    use std::os::unix::ffi::OsStrExt;
    use std::os::unix::fs::FileTypeExt;
    if target.as_os_str().as_bytes().ends_with(b"/") {
        return Some("a directory");
    }
    let kind = target.symlink_metadata().ok()?.file_type();
    [
        (kind.is_dir(), "a directory"),
        (kind.is_char_device(), "a character device"),
        (kind.is_block_device(), "a block device"),
        (kind.is_fifo(), "a FIFO"),
        (kind.is_socket(), "a socket"),
    ]
    .into_iter()
    .find_map(|(is, name)| is.then_some(name))
}

impl Drop for AtomicFile {
    fn drop(&mut self) {
        if !self.published {
            let _ = std::fs::remove_file(&self.tmp);
        }
    }
}

/// Starts writeback of every few MiB as soon as it is written, so the fsync
/// before the rename finds little left to do instead of the whole archive:
/// the disk works while CRIU is still dumping. The writeback is started by a
/// thread of its own (`sync_file_range` "does not wait", but it blocks while
/// the device's queue is full): the writer stays at page-cache speed, so the
/// dump's backlog waits as dirty pages, as raw CRIU's images do, not as
/// compressed blocks in criuz's memory. On 16 cores, random memory (an
/// archive as large as the image, written faster than the disk takes it)
/// held 1.9 GiB of blocks when the writer started the writeback itself.
///
/// Once told to ([`Output::flush_behind`]), the thread also flushes what
/// it started (`fdatasync`) every [`FLUSH_STEP`]: a disk with a volatile
/// write cache reports writeback done while the data still waits in its
/// cache, and the final fsync's cache flush then waits for all of it (on
/// the 2-core VM, about 0.2 s of a 0.8 s 512 MiB dump; docs/BENCHMARKS.md).
/// Not before it is told: a dump tells it once CRIU is done, so that what
/// runs while the tree is frozen stays as it was (flushes from the start
/// came with 0.02-0.03 s more frozen time of about 0.4 s in two runs, near
/// this VM's noise, but not a trade to make unseen). The thread flushes
/// through an open file description of its own (a reopen, not a `dup`):
/// Linux reports a writeback error once per description, so an error the
/// thread meets and drops still fails the final fsync of the writer's own
/// description.
struct EarlyWriteback {
    file: File,
    written: u64,
    started: u64,
    /// Ranges for the flusher thread; it ends when this is dropped.
    ranges: Option<std::sync::mpsc::Sender<(u64, u64)>>,
}

const WRITEBACK_STEP: u64 = 8 << 20;
const FLUSH_STEP: u64 = 32 << 20;

impl EarlyWriteback {
    fn new(file: File, flush_behind: Arc<AtomicBool>) -> Self {
        let ranges = own_description(&file).and_then(|flushed| {
            let (tx, rx) = std::sync::mpsc::channel::<(u64, u64)>();
            let flusher = move || {
                let mut next_flush = FLUSH_STEP;
                for (at, len) in rx {
                    // SAFETY: sync_file_range on a descriptor this thread
                    // owns; failure only means the final fsync does the work.
                    unsafe {
                        libc::sync_file_range(
                            std::os::fd::AsRawFd::as_raw_fd(&flushed),
                            at as i64,
                            len as i64,
                            libc::SYNC_FILE_RANGE_WRITE,
                        )
                    };
                    if at + len >= next_flush && flush_behind.load(Ordering::Relaxed) {
                        // An error is the final fsync's to report (see
                        // above); the flushes stop there.
                        next_flush = match flushed.sync_data() {
                            Ok(()) => at + len + FLUSH_STEP,
                            Err(_) => u64::MAX,
                        };
                    }
                }
            };
            // Without the thread, the final fsync does all the writeback.
            std::thread::Builder::new().name("criuz-writeback".into()).spawn(flusher).ok().map(|_| tx)
        });
        EarlyWriteback { file, written: 0, started: 0, ranges }
    }
}

/// The file `file` is, opened again: an open file description of its own.
fn own_description(file: &File) -> Option<File> {
    let fd = std::os::fd::AsRawFd::as_raw_fd(file);
    OpenOptions::new().read(true).custom_flags(libc::O_CLOEXEC).open(format!("/proc/self/fd/{fd}")).ok()
}

impl Write for EarlyWriteback {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let n = self.file.write(buf)?;
        self.written += n as u64;
        if self.written - self.started >= WRITEBACK_STEP {
            if let Some(ranges) = &self.ranges {
                let _ = ranges.send((self.started, self.written - self.started));
            }
            self.started = self.written;
        }
        Ok(n)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.file.flush()
    }
}

/// A file's identity: its device and inode.
pub type FileId = (u64, u64);

/// An archive destination: a file (atomic), standard output, a named
/// stream (a FIFO, a device: written as standard output is), or an object.
pub enum Output {
    File(AtomicFile),
    Stdout,
    Stream(File, PathBuf),
    Object(s3::Upload),
}

/// A writer whose I/O errors name the output it writes, as the user named
/// it: a full disk under a dump or a pack otherwise reached the user as a
/// bare "No space left on device", and an unpack to a tar stream named its
/// input archive in front of it, as if the input were at fault.
struct Named {
    name: PathBuf,
    inner: Box<dyn Write + Send>,
}

impl Named {
    fn new(name: &Path, inner: Box<dyn Write + Send>) -> Self {
        Named { name: name.to_path_buf(), inner }
    }
}

impl Write for Named {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.inner.write(buf).map_err(|e| crate::error::WriteError::wrap(&self.name, e))
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.inner.flush().map_err(|e| crate::error::WriteError::wrap(&self.name, e))
    }
}

impl Output {
    /// A new archive at `spec` (see [`Location::output`]).
    pub fn open(spec: &Path, force: bool) -> Result<Self> {
        Location::parse(spec)?.output(force)
    }

    /// A writer whose errors name the output (see [`Named`]).
    pub fn writer(&self) -> Result<Box<dyn Write + Send>> {
        let buffered = |name: &Path, w| Box::new(std::io::BufWriter::with_capacity(1 << 20, Named::new(name, w)));
        Ok(match self {
            Output::File(f) => buffered(&f.target, Box::new(EarlyWriteback::new(f.writer()?, f.flush_behind.clone()))),
            Output::Stdout => buffered(Path::new("standard output"), Box::new(std::io::stdout())),
            Output::Stream(f, path) => buffered(path, Box::new(f.try_clone().at(path)?)),
            // Gathers whole parts itself, and names its URL in its errors.
            Output::Object(u) => Box::new(u.writer()),
        })
    }

    /// The files this output writes or replaces (device and inode): a
    /// directory packed while it is written, with the output inside it,
    /// must leave them out, or the archive would hold a partial copy of
    /// itself.
    pub fn own_files(&self) -> Vec<FileId> {
        use std::os::fd::AsFd;
        use std::os::unix::fs::MetadataExt;
        let id = |md: std::fs::Metadata| (md.dev(), md.ino());
        match self {
            Output::File(f) => f
                .file
                .iter()
                .filter_map(|file| file.metadata().ok())
                .chain(std::fs::symlink_metadata(&f.target).ok())
                .map(id)
                .collect(),
            Output::Stdout => {
                let out = std::io::stdout();
                nix::sys::stat::fstat(out.as_fd()).map(|st| vec![(st.st_dev, st.st_ino)]).unwrap_or_default()
            }
            Output::Stream(file, _) => file.metadata().map(id).into_iter().collect(),
            Output::Object(_) => Vec::new(),
        }
    }

    /// Lets a file's writers flush what they wrote while they go on (see
    /// `EarlyWriteback`), so that the commit's fsync finds little left;
    /// other outputs have nothing to flush.
    pub fn flush_behind(&self) {
        if let Output::File(f) = self {
            f.flush_behind.store(true, Ordering::Relaxed);
        }
    }

    pub fn commit(self) -> Result<()> {
        match self {
            Output::File(f) => f.commit(),
            Output::Stdout => Ok(std::io::stdout().flush()?),
            // Its writers flushed what they wrote; a File holds no buffer.
            Output::Stream(..) => Ok(()),
            Output::Object(u) => u.commit(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::io::make_node;

    #[test]
    fn a_dead_writers_temporary_file_is_removed() {
        let dir = tempfile::tempdir().unwrap();
        // Nobody holds it: its writer is gone.
        let stale = dir.path().join(".a.czr.criuz-tmp-4242");
        std::fs::write(&stale, b"partial").unwrap();
        // Held: a writer at work (in whatever pid namespace).
        let live = dir.path().join(".a.czr.criuz-tmp-1");
        let staging = dir.path().join("staging");
        let holder = File::create(&staging).unwrap();
        leftover::publish_held(&holder, &staging, &live).unwrap();
        let other = dir.path().join(".b.czr.criuz-tmp-4242");
        std::fs::write(&other, b"partial").unwrap();
        let out = AtomicFile::create(&dir.path().join("a.czr"), false).unwrap();
        assert!(!stale.exists(), "a dead writer's temporary file is removed");
        assert!(live.exists() && other.exists(), "a live writer's, and another target's, are not");
        drop(out);
    }

    /// Any name the file system takes can be written: the staging file's
    /// name beside it keeps within 255 bytes, and names that share a long
    /// head still get names of their own.
    #[test]
    fn a_name_up_to_the_longest_is_written() {
        let dir = tempfile::tempdir().unwrap();
        for (len, c) in [(200, "a"), (250, "b"), (255, "c"), (254, "\u{e9}")] {
            let name = c.repeat(len / c.len());
            let target = dir.path().join(&name);
            let mut out = AtomicFile::create(&target, false).unwrap();
            out.file.as_mut().unwrap().write_all(name.as_bytes()).unwrap();
            out.commit().unwrap();
            assert_eq!(std::fs::read(&target).unwrap(), name.as_bytes());
        }
        let near = |tail: &str| std::ffi::OsString::from(format!("{}{tail}", "d".repeat(250)));
        let (x, y) = (name_beside(&near("x"), "tmp-", 10), name_beside(&near("y"), "tmp-", 10));
        assert!(x != y && x.len() <= 255 - 10 && y.len() <= 255 - 10, "{x} {y}");
        assert_eq!(name_beside(std::ffi::OsStr::new("a.czr"), "tmp-", 10), ".a.czr.criuz-tmp-");
    }

    /// `-o /dev/null --force` as root replaced the device node with the
    /// archive; `-o DIR --force` dumped the whole tree before its rename
    /// failed. Refused first, with --force too, and left as they were.
    #[test]
    fn only_a_file_is_replaced() {
        use std::os::unix::fs::FileTypeExt;
        let dir = tempfile::tempdir().unwrap();
        let node = |name: &str, mode: libc::mode_t, dev: libc::dev_t| {
            let path = dir.path().join(name);
            make_node(&path, mode, dev);
            path
        };
        let fifo = node("fifo", libc::S_IFIFO | 0o600, 0);
        let sub = dir.path().join("sub");
        std::fs::create_dir(&sub).unwrap();
        let mut refused = vec![(fifo.clone(), "a FIFO"), (sub.clone(), "a directory")];
        refused.push((dir.path().join("new/"), "a directory"));
        // SAFETY: geteuid has no preconditions.
        let root = unsafe { libc::geteuid() } == 0;
        let null = root.then(|| node("null", libc::S_IFCHR | 0o666, libc::makedev(1, 3)));
        refused.extend(null.iter().map(|n| (n.clone(), "a character device")));
        for (target, kind) in refused {
            for force in [false, true] {
                let Err(Error::Usage(why)) = AtomicFile::create(&target, force) else {
                    panic!("{} (force {force}) is not refused as a usage error", target.display())
                };
                assert!(why.contains(kind), "{why}");
            }
        }
        assert!(std::fs::symlink_metadata(&fifo).unwrap().file_type().is_fifo() && sub.is_dir());
        if let Some(null) = null {
            assert!(std::fs::symlink_metadata(null).unwrap().file_type().is_char_device());
        }
        // A file, and a symbolic link (replaced itself), are replaced with --force.
        let file = dir.path().join("a.czr");
        std::fs::write(&file, b"old").unwrap();
        let link = dir.path().join("link.czr");
        std::os::unix::fs::symlink(&fifo, &link).unwrap();
        for target in [&file, &link] {
            assert!(matches!(AtomicFile::create(target, false), Err(Error::Exists(_))));
            AtomicFile::create(target, true).unwrap().commit().unwrap();
            assert!(std::fs::symlink_metadata(target).unwrap().is_file());
        }
        assert!(std::fs::symlink_metadata(&fifo).unwrap().file_type().is_fifo());
    }

    #[test]
    fn an_output_whose_directory_is_not_there_is_a_usage_error() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("a.czr");
        std::fs::write(&file, b"old").unwrap();
        for (target, why) in [
            (dir.path().join("gone/a.czr"), "gone: no such directory"),
            (dir.path().join("a.czr/b.czr"), "a.czr: not a directory"),
        ] {
            for force in [false, true] {
                let Err(e) = AtomicFile::create(&target, force) else { panic!("{} was made", target.display()) };
                assert_eq!(e.kind(), crate::error::Kind::Usage, "{} (force {force}): {e}", target.display());
                let said = e.to_string();
                assert!(said.starts_with(&target.display().to_string()) && said.contains(why), "{said}");
            }
        }
        assert!(!dir.path().join("gone").exists() && std::fs::read(&file).unwrap() == b"old");
    }

    /// A target that appeared while the archive was written is not
    /// replaced without --force, and the refusal is the rename itself (no
    /// window between a check and a rename for a second writer).
    #[test]
    fn a_target_made_meanwhile_is_kept_without_force() {
        let dir = tempfile::tempdir().unwrap();
        let target = dir.path().join("a.czr");
        let out = AtomicFile::create(&target, false).unwrap();
        std::fs::write(&target, b"the other writer's").unwrap();
        assert!(matches!(out.commit(), Err(Error::Exists(_))));
        assert_eq!(std::fs::read(&target).unwrap(), b"the other writer's");
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1, "the temporary file is gone");
        let mine = dir.path().join("mine");
        std::fs::write(&mine, b"mine").unwrap();
        let e = rename_new(&mine, &target).unwrap_err();
        assert_eq!(e.kind(), std::io::ErrorKind::AlreadyExists);
        rename_new(&mine, &dir.path().join("b.czr")).unwrap();
    }

    #[test]
    fn the_flusher_has_an_open_file_description_of_its_own() {
        use std::io::{Seek, SeekFrom};
        let tmp = tempfile::NamedTempFile::new().unwrap();
        let mut file = File::options().read(true).write(true).open(tmp.path()).unwrap();
        let mut own = own_description(&file).expect("reopened");
        file.seek(SeekFrom::Start(100)).unwrap();
        // A dup would share the offset (and the writeback error's report).
        assert_eq!(own.stream_position().unwrap(), 0);
    }

    #[test]
    fn a_file_written_past_several_flushes_is_whole() {
        let dir = tempfile::tempdir().unwrap();
        let target = dir.path().join("big.czr");
        let out = Output::open(&target, false).unwrap();
        out.flush_behind();
        let chunk: Vec<u8> = (0..(1u32 << 20)).map(|i| (i.wrapping_mul(2_654_435_761) >> 24) as u8).collect();
        let total = (2 * FLUSH_STEP + WRITEBACK_STEP + 12_345) as usize;
        {
            let mut w = out.writer().unwrap();
            let mut left = total;
            while left > 0 {
                let n = left.min(chunk.len());
                w.write_all(&chunk[..n]).unwrap();
                left -= n;
            }
            w.flush().unwrap();
        }
        out.commit().unwrap();
        let got = std::fs::read(&target).unwrap();
        assert_eq!(got.len(), total);
        assert!(got.chunks(chunk.len()).all(|c| c == &chunk[..c.len()]));
    }
}

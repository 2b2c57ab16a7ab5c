//! Tar streams in and out of tree archives, for podman: `podman container
//! checkpoint --export` writes a tar (zstd or gzip compressed by default,
//! detected from its first bytes) and `podman container restore --import`
//! reads one. The `tar` crate parses and builds the headers (ustar, GNU
//! long names, PAX); this module maps entries to tree entries with the same
//! rules as a directory scan: a hard link, device, fifo or sparse file is an
//! error naming it, a path that would leave the tree ("..", absolute) is an
//! error, a path given twice is an error. Directories a tar implies but
//! does not list are added (0755, the child's mtime) so parents come first.

use super::Entry;
use crate::archive::{EntryStart, Packer, SeqSink};
use crate::error::{Error, IoContext, Result};
use crate::format::{check_entry_name, parent_path, EntryMeta, FileKind, MAX_LINK_TARGET};
use std::collections::{HashMap, HashSet};
use std::io::{BufRead, BufReader, Read, Seek, Write};
use std::path::Component;

const ZSTD_MAGIC: [u8; 4] = [0x28, 0xb5, 0x2f, 0xfd];
const GZIP_MAGIC: [u8; 2] = [0x1f, 0x8b];

fn bad(label: &str, what: impl std::fmt::Display) -> Error {
    Error::Usage(format!("{label}: {what}"))
}

/// Decompresses a tar stream if it starts like zstd or gzip.
fn decompressed(inp: Box<dyn Read + Send>, label: &str) -> Result<Box<dyn Read + Send>> {
    let mut r = BufReader::with_capacity(1 << 20, inp);
    let head = r.fill_buf().map_err(|e| bad(label, e))?;
    Ok(if head.starts_with(&ZSTD_MAGIC) {
        Box::new(zstd::stream::read::Decoder::with_buffer(r).map_err(|e| bad(label, e))?)
    } else if head.starts_with(&GZIP_MAGIC) {
        Box::new(flate2::bufread::MultiGzDecoder::new(r))
    } else {
        Box::new(r)
    })
}

/// A tar entry's path as a tree path, or `None` for the root (`./`).
fn tree_path(raw: &std::path::Path, label: &str) -> Result<Option<String>> {
    let mut parts = Vec::new();
    for c in raw.components() {
        match c {
            Component::CurDir => {}
            Component::Normal(p) => parts
                .push(p.to_str().ok_or_else(|| bad(label, format!("{}: a name that is not UTF-8", raw.display())))?),
            _ => return Err(bad(label, format!("{}: a path that leaves the tree", raw.display()))),
        }
    }
    Ok((!parts.is_empty()).then(|| parts.join("/")))
}

/// The contents of member `name` of the plain tar file `tar`, at most
/// `limit` bytes of it (`None`: no such member, or not a tar that can be
/// read). Members before it are skipped by seeking, not read.
pub fn member(tar: &std::path::Path, name: &str, limit: u64) -> Option<Vec<u8>> {
    let mut archive = tar::Archive::new(std::fs::File::open(tar).ok()?);
    for entry in archive.entries_with_seek().ok()? {
        let entry = entry.ok()?;
        if tree_path(&entry.path().ok()?, "").ok()?.as_deref() == Some(name) {
            let mut bytes = Vec::new();
            entry.take(limit).read_to_end(&mut bytes).ok()?;
            return Some(bytes);
        }
    }
    None
}

/// Packs every entry of a tar stream (compressed or not) into `packer`,
/// which writes a tree archive. Returns the entries packed.
pub fn pack_tar(
    inp: Box<dyn Read + Send>,
    label: &str,
    packer: &Packer,
    progress: &mut dyn FnMut(u64),
) -> Result<usize> {
    let mut archive = tar::Archive::new(decompressed(inp, label)?);
    let mut seen: HashSet<String> = HashSet::new();
    let mut dirs: HashSet<String> = HashSet::new();
    let mut done = 0u64;
    let mut count = 0;
    for entry in archive.entries().map_err(|e| bad(label, e))? {
        let mut entry = entry.map_err(|e| bad(label, format!("bad tar entry: {e}")))?;
        let raw = entry.path().map_err(|e| bad(label, e))?.into_owned();
        let Some(path) = tree_path(&raw, label)? else { continue };
        let h = entry.header();
        let meta = EntryMeta {
            mode: h.mode().map_err(|e| bad(label, e))? & 0o7777,
            mtime: h.mtime().map_err(|e| bad(label, e))? as i64,
            mtime_nsec: 0,
        };
        let what =
            |w: &str| bad(label, format!("{path}: {w}; criuz carries regular files, directories and symbolic links"));
        let kind = match h.entry_type() {
            tar::EntryType::Regular | tar::EntryType::Continuous => FileKind::for_name(&path),
            tar::EntryType::Directory => FileKind::Dir,
            tar::EntryType::Symlink => FileKind::Symlink,
            tar::EntryType::Link => return Err(what("a hard link")),
            tar::EntryType::Char | tar::EntryType::Block | tar::EntryType::Fifo => {
                return Err(what("a device or fifo"))
            }
            other => return Err(what(&format!("tar entry type {other:?}"))),
        };
        check_entry_name(&path, true).map_err(&what)?;
        // Directories the stream implies before it lists them (or never does).
        let mut missing = Vec::new();
        let mut up = parent_path(&path);
        while let Some(dir) = up {
            if dirs.contains(dir) {
                break;
            }
            if seen.contains(dir) {
                return Err(bad(label, format!("{path}: {dir} is not a directory")));
            }
            missing.push(dir.to_string());
            up = parent_path(dir);
        }
        for dir in missing.into_iter().rev() {
            packer.begin_entry(&dir, FileKind::Dir, Some(EntryMeta { mode: 0o755, ..meta }))?.finish()?;
            seen.insert(dir.clone());
            dirs.insert(dir);
            count += 1;
        }
        if !seen.insert(path.clone()) {
            return Err(bad(label, format!("{path}: listed twice")));
        }
        let mut sink = packer.begin_entry(&path, kind, Some(meta))?;
        match kind {
            FileKind::Dir => {
                dirs.insert(path.clone());
            }
            FileKind::Symlink => {
                let target = entry.link_name_bytes().ok_or_else(|| what("a link without a target"))?.into_owned();
                if target.is_empty() || target.len() as u64 > MAX_LINK_TARGET {
                    return Err(what("an empty link target or one longer than 4096 bytes"));
                }
                sink.write(&target)?;
            }
            _ => {
                let mut buf = vec![0u8; 1 << 20];
                loop {
                    let n = entry.read(&mut buf).map_err(|e| bad(label, format!("{path}: {e}")))?;
                    if n == 0 {
                        break;
                    }
                    sink.write(&buf[..n])?;
                    done += n as u64;
                    progress(done);
                }
            }
        }
        sink.finish()?;
        count += 1;
    }
    Ok(count)
}

/// A [`SeqSink`] writing a tree archive (or a plain one: files 0600) as an
/// uncompressed tar stream. A tar entry's bytes follow its header, which
/// needs the size, while an archive's files may interleave (a dump writes
/// its pages image alongside the others). One file at a time whose size the
/// index gives goes straight out; any other is spooled to an unlinked
/// temporary file and goes out at its end, or once the file going straight
/// out has ended. An archive read as a stream learns sizes only at each
/// file's end, so everything it holds is spooled.
pub struct TarSink<W: Write> {
    out: tar::Builder<W>,
    /// Files begun and not ended, by file id.
    open: HashMap<u32, Current>,
    /// The file whose header is out and whose bytes go straight out.
    direct: Option<u32>,
    /// Ended while another went straight out: written after it, in order.
    waiting: Vec<Current>,
    pub entries: usize,
    pub bytes: u64,
}

struct Current {
    entry: Entry,
    /// Bytes written straight to the output (size known up front).
    written: u64,
    spool: Option<std::fs::File>,
    link: Vec<u8>,
}

impl<W: Write> TarSink<W> {
    pub fn new(out: W) -> Self {
        let out = tar::Builder::new(out);
        TarSink { out, open: HashMap::new(), direct: None, waiting: Vec::new(), entries: 0, bytes: 0 }
    }

    /// Writes the end-of-archive blocks; returns the output.
    pub fn finish(mut self) -> Result<W> {
        if let Some(cur) = self.open.values().next() {
            return Err(Error::corrupt(0, format!("{}: not ended", cur.entry.path)));
        }
        self.write_waiting()?;
        self.out.into_inner().map_err(Error::Io)
    }

    fn header(e: &Entry) -> tar::Header {
        let mut h = tar::Header::new_gnu();
        h.set_entry_type(match e.kind {
            FileKind::Dir => tar::EntryType::Directory,
            FileKind::Symlink => tar::EntryType::Symlink,
            _ => tar::EntryType::Regular,
        });
        h.set_mode(e.meta.mode);
        h.set_mtime(e.meta.mtime.max(0) as u64);
        h.set_size(if e.kind.is_file() { e.size } else { 0 });
        // Owners are not kept: the entries are whoever imports them.
        h.set_uid(0);
        h.set_gid(0);
        h
    }

    /// Writes an ended entry that did not go straight out.
    fn write_whole(&mut self, mut cur: Current) -> Result<()> {
        match (cur.entry.kind, cur.spool.take()) {
            (FileKind::Dir, _) => {
                let mut h = Self::header(&cur.entry);
                self.out.append_data(&mut h, format!("{}/", cur.entry.path), std::io::empty())?;
            }
            (FileKind::Symlink, _) => {
                if cur.link.is_empty() || cur.link.contains(&0) {
                    return Err(Error::corrupt(0, format!("link {}: empty target or NUL in it", cur.entry.path)));
                }
                let mut h = Self::header(&cur.entry);
                let target = std::ffi::OsStr::from_bytes(&cur.link);
                self.out.append_link(&mut h, &cur.entry.path, target)?;
            }
            (_, Some(mut f)) => {
                f.rewind()?;
                let mut h = Self::header(&cur.entry);
                self.out.append_data(&mut h, &cur.entry.path, f)?;
            }
            // Only the file going straight out has no spool, and `end` writes it.
            (_, None) => return Err(Error::corrupt(0, format!("{}: its bytes were not kept", cur.entry.path))),
        }
        self.entries += 1;
        Ok(())
    }

    fn write_waiting(&mut self) -> Result<()> {
        for cur in std::mem::take(&mut self.waiting) {
            self.write_whole(cur)?;
        }
        Ok(())
    }
}

impl<W: Write> SeqSink for TarSink<W> {
    fn begin(&mut self, s: &EntryStart) -> Result<()> {
        check_entry_name(s.name, s.meta.is_some())
            .map_err(|why| Error::corrupt(0, format!("refusing archive entry {:?}: {why}", s.name)))?;
        let meta = s.meta.unwrap_or(EntryMeta { mode: 0o600, mtime: 0, mtime_nsec: 0 });
        let entry = Entry { path: s.name.to_string(), kind: s.kind, meta, size: s.size.unwrap_or(0) };
        let mut cur = Current { entry, written: 0, spool: None, link: Vec::new() };
        match (s.kind, s.size) {
            (FileKind::Dir | FileKind::Symlink, _) => {}
            (_, Some(_)) if self.direct.is_none() => {
                // The header goes out now and the bytes follow as they are
                // decoded: `append_data` with an empty reader writes exactly
                // the header, and `end` pads the data to 512 bytes.
                let mut h = Self::header(&cur.entry);
                self.out.append_data(&mut h, s.name, std::io::empty())?;
                self.direct = Some(s.file_id);
            }
            _ => {
                // Named by its directory, `$TMPDIR`, so a full one is told
                // as such, not blamed on the archive.
                let dir = crate::io::temp_dir()?;
                cur.spool = Some(tempfile::tempfile_in(&dir).at(&dir)?);
            }
        }
        if self.open.insert(s.file_id, cur).is_some() {
            return Err(Error::corrupt(0, format!("{}: file id {} begun twice", s.name, s.file_id)));
        }
        Ok(())
    }

    fn data(&mut self, file_id: u32, data: &[u8]) -> Result<()> {
        let cur = self.open.get_mut(&file_id).ok_or_else(|| Error::corrupt(0, "data outside a file"))?;
        match (cur.entry.kind, cur.spool.as_mut()) {
            (FileKind::Symlink, _) => cur.link.extend_from_slice(data),
            (FileKind::Dir, _) => return Err(Error::corrupt(0, format!("{}: data for a directory", cur.entry.path))),
            (_, Some(f)) => f.write_all(data).at(crate::io::temp_root())?,
            // Only the file going straight out has no spool.
            (_, None) => {
                cur.written += data.len() as u64;
                if cur.written > cur.entry.size {
                    return Err(Error::corrupt(0, format!("{}: more bytes than its index says", cur.entry.path)));
                }
                self.out.get_mut().write_all(data)?;
            }
        }
        self.bytes += data.len() as u64;
        Ok(())
    }

    fn end(&mut self, file_id: u32, raw_size: u64) -> Result<()> {
        let mut cur = self.open.remove(&file_id).ok_or_else(|| Error::corrupt(0, "end outside a file"))?;
        if self.direct == Some(file_id) {
            if cur.written != raw_size {
                return Err(Error::corrupt(0, format!("{}: not the size its index says", cur.entry.path)));
            }
            let pad = (512 - raw_size % 512) % 512;
            self.out.get_mut().write_all(&[0u8; 512][..pad as usize])?;
            self.direct = None;
            self.entries += 1;
            return self.write_waiting();
        }
        cur.entry.size = raw_size;
        if self.direct.is_some() {
            self.waiting.push(cur);
            return Ok(());
        }
        self.write_whole(cur)
    }
}

use std::os::unix::ffi::OsStrExt;

#[cfg(test)]
mod tests {
    use super::*;

    fn start(file_id: u32, name: &str, size: Option<u64>) -> EntryStart<'_> {
        EntryStart { file_id, name, kind: FileKind::for_name(name), meta: None, size }
    }

    /// A member is found by its tree path (`./` and all), past a large
    /// one before it, and read up to the limit; a missing one, or a file
    /// that is no tar, is `None`.
    #[test]
    fn a_member_is_read_by_name() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.tar");
        let mut b = tar::Builder::new(std::fs::File::create(&path).unwrap());
        for (name, data) in
            [("./checkpoint/pages-1.img", vec![7u8; 3 << 20]), ("./config.dump", b"{\"id\":\"x\"}".to_vec())]
        {
            let mut h = tar::Header::new_gnu();
            h.set_size(data.len() as u64);
            h.set_mode(0o600);
            b.append_data(&mut h, name, &data[..]).unwrap();
        }
        b.finish().unwrap();
        drop(b);
        assert_eq!(member(&path, "config.dump", 1 << 20).as_deref(), Some(&b"{\"id\":\"x\"}"[..]));
        assert_eq!(member(&path, "config.dump", 3).as_deref(), Some(&b"{\"i"[..]), "up to the limit");
        assert_eq!(member(&path, "spec.dump", 1 << 20), None);
        std::fs::write(dir.path().join("not.tar"), b"not a tar").unwrap();
        assert_eq!(member(&dir.path().join("not.tar"), "config.dump", 1 << 20), None);
    }

    /// A dump's files interleave (its pages image is written alongside the
    /// others): each must come out whole, as one entry, with its own bytes.
    #[test]
    fn interleaved_files_come_out_whole() {
        for sized in [false, true] {
            let size = |n: usize| sized.then_some(n as u64);
            let pages: Vec<u8> = (0..3000u32).map(|i| (i % 251) as u8).collect();
            let mut sink = TarSink::new(Vec::new());
            sink.begin(&start(0, "pages-1.img", size(pages.len()))).unwrap();
            sink.data(0, &pages[..1000]).unwrap();
            sink.begin(&start(1, "pagemap-7.img", size(6))).unwrap();
            sink.data(1, b"map").unwrap();
            sink.data(0, &pages[1000..]).unwrap();
            sink.begin(&start(2, "core-7.img", size(4))).unwrap();
            sink.data(2, b"core").unwrap();
            sink.end(2, 4).unwrap();
            sink.data(1, b"ped").unwrap();
            sink.end(1, 6).unwrap();
            sink.end(0, pages.len() as u64).unwrap();
            sink.begin(&start(3, "inventory.img", size(3))).unwrap();
            sink.data(3, b"inv").unwrap();
            sink.end(3, 3).unwrap();
            assert_eq!(sink.entries, 4);
            let tar = sink.finish().unwrap();
            let mut got = Vec::new();
            for e in tar::Archive::new(&tar[..]).entries().unwrap() {
                let mut e = e.unwrap();
                let name = e.path().unwrap().to_str().unwrap().to_string();
                let mut bytes = Vec::new();
                e.read_to_end(&mut bytes).unwrap();
                got.push((name, bytes));
            }
            let want = |n: &str| got.iter().find(|(name, _)| name == n).map(|(_, b)| b.clone());
            assert_eq!(got.len(), 4, "sized {sized}: {:?}", got.iter().map(|g| &g.0).collect::<Vec<_>>());
            assert_eq!(want("pages-1.img").unwrap(), pages);
            assert_eq!(want("pagemap-7.img").unwrap(), b"mapped");
            assert_eq!(want("core-7.img").unwrap(), b"core");
            assert_eq!(want("inventory.img").unwrap(), b"inv");
        }
    }

    /// A file begun twice, or one never ended, is damage, not a tar with a
    /// file missing.
    #[test]
    fn a_file_begun_twice_or_never_ended_is_refused() {
        let mut sink = TarSink::new(Vec::new());
        sink.begin(&start(0, "a.img", None)).unwrap();
        assert!(matches!(sink.begin(&start(0, "b.img", None)), Err(Error::Corrupt { .. })));
        let mut sink = TarSink::new(Vec::new());
        sink.begin(&start(0, "a.img", Some(1))).unwrap();
        sink.data(0, b"x").unwrap();
        assert!(matches!(sink.finish(), Err(Error::Corrupt { .. })));
    }
}

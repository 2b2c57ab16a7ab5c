//! Shared memory as a dump sees it: the anonymous shared and memfd
//! mappings of a process (mm.img), the memfds its descriptors open
//! (files.img, fdinfo), and their inodes.

use super::proto::*;
use prost::Message;
use std::collections::HashMap;

/// The file ids (files.img) a process's descriptors open
/// (`fdinfo-<id>.img`); `None` if the image is not as expected.
pub fn fd_file_ids(fdinfo: &[u8]) -> Option<Vec<u64>> {
    objects(fdinfo, FDINFO_MAGIC)?.into_iter().map(|o| Some(u64::from(FdinfoEntry::decode(o).ok()?.id))).collect()
}

/// Which shared memory object a mapping shows: anonymous shared memory by
/// its id (that of its `pagemap-shmem-<id>.img`), or a memfd by the id of
/// its file (files.img, then memfd.img: [`memfds`]). CRIU 4.2 dumps
/// anonymous shared memory as a memfd too, where the kernel allows.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum SharedId {
    Anon(u64),
    MemfdFile(u64),
}

/// A shared mapping (`mm-<pid>.img`): `[start, end)` shows `object` from
/// byte `pgoff` on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SharedMapping {
    pub start: u64,
    pub end: u64,
    pub pgoff: u64,
    pub object: SharedId,
    /// Mapped writable. A read-only mapping may come from a descriptor
    /// opened read-only, which the kernel lets take no copy (no
    /// `VM_MAYWRITE`); a writable one is one CRIU made from a writable
    /// descriptor.
    pub writable: bool,
}

impl SharedMapping {
    /// The address that shows byte `offset` of the object, if this mapping
    /// shows it, and how many bytes on from there it shows.
    pub fn address_of(&self, offset: u64) -> Option<(u64, u64)> {
        let into = offset.checked_sub(self.pgoff)?;
        let addr = self.start.checked_add(into)?;
        (addr < self.end).then_some((addr, self.end - addr))
    }
}

/// The plain shared mappings of shared memory in a process (`MAP_SHARED`,
/// not of huge pages, of anonymous shared memory or a memfd; read-only
/// ones too, marked so), and the objects it maps some other way (System V segments, huge pages, a memfd
/// mapped privately, a status criuz does not know): whoever fills an object
/// through its mappings must leave those to CRIU. `None` if the image is
/// not as expected, a mapping is not whole pages, or mappings overlap or
/// are out of address order, which CRIU never writes (a page copied
/// through the first would land in whatever the later one maps there).
pub fn shared_mappings(mm: &[u8]) -> Option<(Vec<SharedMapping>, Vec<SharedId>)> {
    let mm = MmEntry::decode(*objects(mm, MM_MAGIC)?.first()?).ok()?;
    let (mut plain, mut other) = (Vec::new(), Vec::new());
    let page = |v: u64| v % 4096 == 0;
    let mut after = 0;
    for v in &mm.vmas {
        (v.start >= after && v.end > v.start).then_some(())?;
        after = v.end;
    }
    for v in &mm.vmas {
        let memfd = v.status & VMA_AREA_MEMFD != 0;
        if !memfd && v.status & (VMA_ANON_SHARED | VMA_AREA_SYSVIPC) == 0 {
            continue;
        }
        let object = if memfd { SharedId::MemfdFile(v.shmid) } else { SharedId::Anon(v.shmid) };
        // What else a plain mapping of the kind may have.
        let kind = if memfd { VMA_AREA_MEMFD | VMA_FILE_SHARED } else { VMA_ANON_SHARED };
        let special = v.status & VMA_SPECIAL & !kind != 0;
        let huge = v.flags & libc::MAP_HUGETLB as u32 != 0;
        let shared = v.flags & libc::MAP_SHARED as u32 != 0 && v.flags & libc::MAP_PRIVATE as u32 == 0;
        if v.status & VMA_AREA_REGULAR == 0 || v.status & kind != kind || special || huge || !shared {
            other.push(object);
            continue;
        }
        (v.start < v.end && page(v.start) && page(v.end) && page(v.pgoff)).then_some(())?;
        v.pgoff.checked_add(v.end - v.start)?;
        let writable = v.prot & libc::PROT_WRITE as u32 != 0;
        plain.push(SharedMapping { start: v.start, end: v.end, pgoff: v.pgoff, object, writable });
    }
    Some((plain, other))
}

/// A memfd as CRIU restores it (memfd.img): its pages are
/// `pagemap-shmem-<shmid>.img`'s, and CRIU reads them into its first
/// `size` bytes (rounded up to a page).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Memfd {
    pub shmid: u64,
    pub size: u64,
    /// Neither of huge pages nor sealed against writes: its mappings can
    /// take copies.
    pub writable: bool,
}

/// Each memfd file of files.img (by file id) and its memfd (memfd.img);
/// `None` if either image is not as expected.
pub fn memfds(files: &[u8], memfd: &[u8]) -> Option<HashMap<u64, Memfd>> {
    // F_SEAL_WRITE, F_SEAL_FUTURE_WRITE.
    const SEALED_AGAINST_WRITES: u32 = 0x08 | 0x10;
    let mut inodes = HashMap::new();
    for obj in objects(memfd, MEMFD_INODE_MAGIC)? {
        let e = MemfdInodeEntry::decode(obj).ok()?;
        let writable = e.hugetlb_flag.unwrap_or(0) == 0 && e.seals.unwrap_or(0) & SEALED_AGAINST_WRITES == 0;
        let m = Memfd { shmid: u64::from(e.shmid), size: e.size.unwrap_or(0), writable };
        inodes.insert(e.inode_id.unwrap_or(0), m);
    }
    let mut out = HashMap::new();
    for obj in objects(files, FILES_MAGIC)? {
        let e = FileEntry::decode(obj).ok()?;
        let Some(mfe) = e.memfd.filter(|_| e.r#type == FD_TYPE_MEMFD) else { continue };
        out.insert(u64::from(e.id), *inodes.get(&u64::from(mfe.inode_id))?);
    }
    Some(out)
}

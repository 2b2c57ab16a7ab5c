//! CRIU's image framing and the messages criuz reads of it: an image is a
//! magic (after the common one, but for inventory.img) and then entries,
//! each a 32-bit length and a protobuf message (criu/protobuf.c). Only the
//! fields criuz uses are declared; prost skips the rest. The magics and
//! flag bits are CRIU's (criu/include/magic.h, images/*.proto).

use prost::Message;

pub(super) const IMG_COMMON_MAGIC: u32 = 0x5456_4319;
pub(super) const PAGEMAP_MAGIC: u32 = 0x5608_4025;
pub(super) const MM_MAGIC: u32 = 0x5749_2820;
pub(super) const MEMFD_INODE_MAGIC: u32 = 0x4845_3499;
pub(super) const FILES_MAGIC: u32 = 0x5630_3138;
pub(super) const FDINFO_MAGIC: u32 = 0x5621_3732;
/// `fd_types.MEMFD` (images/fdinfo.proto).
pub(super) const FD_TYPE_MEMFD: i32 = 18;
pub(super) const PSTREE_MAGIC: u32 = 0x5027_3030;
pub(super) const CORE_MAGIC: u32 = 0x5505_3847;
pub(super) const CGROUP_MAGIC: u32 = 0x5938_3330;
/// inventory.img starts with its own magic alone (no common one).
pub(super) const INVENTORY_MAGIC: u32 = 0x5831_3116;
/// `core_entry.march` of x86_64 (images/core.proto).
pub(super) const MARCH_X86_64: i32 = 1;

pub(super) const PE_PARENT: u32 = 1 << 0;
pub(super) const PE_LAZY: u32 = 1 << 1;
pub(super) const PE_PRESENT: u32 = 1 << 2;

pub(super) const VMA_AREA_REGULAR: u32 = 1 << 0;
/// The kernel's own mappings: vsyscall, vDSO and its data (vvar).
pub(super) const VMA_KERNEL: u32 = (1 << 2) | (1 << 3) | (1 << 12);
pub(super) const VMA_ANON_SHARED: u32 = 1 << 8;
pub(super) const VMA_ANON_PRIVATE: u32 = 1 << 9;
pub(super) const VMA_FILE_SHARED: u32 = 1 << 7;
pub(super) const VMA_AREA_SYSVIPC: u32 = 1 << 10;
pub(super) const VMA_AREA_MEMFD: u32 = 1 << 14;
/// Any of these makes a VMA more than plain private anonymous memory.
pub(super) const VMA_SPECIAL: u32 = (1 << 2) // vsyscall
    | (1 << 3) // vdso
    | (1 << 6) // file private
    | (1 << 7) // file shared
    | (1 << 8) // anon shared
    | (1 << 10) // SysV IPC
    | (1 << 11) // socket
    | (1 << 12) // vvar
    | (1 << 13) // AIO ring
    | (1 << 14) // memfd
    | (1 << 15) // shadow stack
    | (1 << 16) // guard
    | (1 << 17) // uprobes
    | (1 << 27) // plugin
    | (1 << 31); // unsupported

#[derive(Clone, PartialEq, Message)]
pub(super) struct PagemapHead {
    #[prost(uint32, required, tag = "1")]
    pub(super) pages_id: u32,
}

#[derive(Clone, PartialEq, Message)]
pub(super) struct PagemapEntry {
    #[prost(uint64, required, tag = "1")]
    pub(super) vaddr: u64,
    #[prost(uint32, required, tag = "2")]
    pub(super) nr_pages: u32,
    #[prost(bool, optional, tag = "3")]
    pub(super) in_parent: Option<bool>,
    #[prost(uint32, optional, tag = "4")]
    pub(super) flags: Option<u32>,
    /// Newer CRIU: 64-bit page count (field 2 then holds a compat copy).
    #[prost(uint64, optional, tag = "5")]
    pub(super) nr_pages64: Option<u64>,
}

#[derive(Clone, PartialEq, Message)]
pub(super) struct PstreeEntry {
    #[prost(uint32, required, tag = "1")]
    pub(super) pid: u32,
    #[prost(uint32, required, tag = "2")]
    pub(super) ppid: u32,
    #[prost(uint32, repeated, packed = "false", tag = "5")]
    pub(super) threads: Vec<u32>,
}

#[derive(Clone, PartialEq, Message)]
pub(super) struct CoreEntry {
    #[prost(int32, required, tag = "1")]
    pub(super) mtype: i32,
    #[prost(message, optional, tag = "2")]
    pub(super) thread_info: Option<ThreadInfoX86>,
    #[prost(message, optional, tag = "3")]
    pub(super) tc: Option<TaskCoreEntry>,
    #[prost(message, optional, tag = "5")]
    pub(super) thread_core: Option<ThreadCoreEntry>,
}

#[derive(Clone, PartialEq, Message)]
pub(super) struct ThreadCoreEntry {
    #[prost(uint32, optional, tag = "16")]
    pub(super) cg_set: Option<u32>,
}

#[derive(Clone, PartialEq, Message)]
pub(super) struct TaskCoreEntry {
    #[prost(uint32, optional, tag = "1")]
    pub(super) task_state: Option<u32>,
    #[prost(uint32, optional, tag = "9")]
    pub(super) cg_set: Option<u32>,
    #[prost(uint32, optional, tag = "21")]
    pub(super) stop_signo: Option<u32>,
}

#[derive(Clone, PartialEq, Message)]
pub(super) struct ThreadInfoX86 {
    #[prost(message, optional, tag = "2")]
    pub(super) gpregs: Option<UserX86Regs>,
}

#[derive(Clone, PartialEq, Message)]
pub(super) struct UserX86Regs {
    #[prost(uint64, optional, tag = "20")]
    pub(super) sp: Option<u64>,
}

#[derive(Clone, PartialEq, Message)]
pub(super) struct InventoryEntry {
    #[prost(uint32, optional, tag = "5")]
    pub(super) root_cg_set: Option<u32>,
}

#[derive(Clone, PartialEq, Message)]
pub(super) struct CgMemberEntry {
    #[prost(string, required, tag = "1")]
    pub(super) name: String,
    #[prost(string, required, tag = "2")]
    pub(super) path: String,
}

#[derive(Clone, PartialEq, Message)]
pub(super) struct CgSetEntry {
    #[prost(uint32, required, tag = "1")]
    pub(super) id: u32,
    #[prost(message, repeated, tag = "2")]
    pub(super) ctls: Vec<CgMemberEntry>,
}

#[derive(Clone, PartialEq, Message)]
pub(super) struct CgroupPropEntry {
    #[prost(string, required, tag = "1")]
    pub(super) name: String,
    #[prost(string, required, tag = "2")]
    pub(super) value: String,
}

#[derive(Clone, PartialEq, Message)]
pub(super) struct CgroupDirEntry {
    #[prost(string, required, tag = "1")]
    pub(super) dir_name: String,
    #[prost(message, repeated, tag = "2")]
    pub(super) children: Vec<CgroupDirEntry>,
    #[prost(message, repeated, tag = "3")]
    pub(super) properties: Vec<CgroupPropEntry>,
}

#[derive(Clone, PartialEq, Message)]
pub(super) struct CgControllerEntry {
    #[prost(string, repeated, tag = "1")]
    pub(super) cnames: Vec<String>,
    #[prost(message, repeated, tag = "2")]
    pub(super) dirs: Vec<CgroupDirEntry>,
}

#[derive(Clone, PartialEq, Message)]
pub(super) struct CgroupEntry {
    #[prost(message, repeated, tag = "1")]
    pub(super) sets: Vec<CgSetEntry>,
    #[prost(message, repeated, tag = "2")]
    pub(super) controllers: Vec<CgControllerEntry>,
}

#[derive(Clone, PartialEq, Message)]
pub(super) struct VmaEntry {
    #[prost(uint64, required, tag = "1")]
    pub(super) start: u64,
    #[prost(uint64, required, tag = "2")]
    pub(super) end: u64,
    /// Where in its file or shared memory object the mapping starts (bytes).
    #[prost(uint64, required, tag = "3")]
    pub(super) pgoff: u64,
    #[prost(uint64, required, tag = "4")]
    pub(super) shmid: u64,
    #[prost(uint32, required, tag = "5")]
    pub(super) prot: u32,
    #[prost(uint32, required, tag = "6")]
    pub(super) flags: u32,
    #[prost(uint32, required, tag = "7")]
    pub(super) status: u32,
}

/// CRIU's `memfd_inode_entry` (images/memfd.proto), the fields read here.
#[derive(Clone, PartialEq, Message)]
pub(super) struct MemfdInodeEntry {
    #[prost(uint64, optional, tag = "4")]
    pub(super) size: Option<u64>,
    #[prost(uint32, required, tag = "5")]
    pub(super) shmid: u32,
    #[prost(uint32, optional, tag = "6")]
    pub(super) seals: Option<u32>,
    #[prost(uint64, optional, tag = "7")]
    pub(super) inode_id: Option<u64>,
    #[prost(uint32, optional, tag = "8")]
    pub(super) hugetlb_flag: Option<u32>,
}

/// CRIU's `file_entry` (images/fdinfo.proto), the fields read here.
#[derive(Clone, PartialEq, Message)]
pub(super) struct FileEntry {
    #[prost(int32, required, tag = "1")]
    pub(super) r#type: i32,
    #[prost(uint32, required, tag = "2")]
    pub(super) id: u32,
    #[prost(message, optional, tag = "20")]
    pub(super) memfd: Option<MemfdFileEntry>,
}

/// CRIU's `fdinfo_entry` (images/fdinfo.proto), the field read here.
#[derive(Clone, PartialEq, Message)]
pub(super) struct FdinfoEntry {
    #[prost(uint32, required, tag = "1")]
    pub(super) id: u32,
}

/// CRIU's `memfd_file_entry` (images/memfd.proto), the field read here.
#[derive(Clone, PartialEq, Message)]
pub(super) struct MemfdFileEntry {
    #[prost(uint32, required, tag = "5")]
    pub(super) inode_id: u32,
}

#[derive(Clone, PartialEq, Message)]
pub(super) struct MmEntry {
    #[prost(message, repeated, tag = "14")]
    pub(super) vmas: Vec<VmaEntry>,
}

/// Splits an image into its protobuf objects after checking its magics.
pub(super) fn objects(img: &[u8], magic: u32) -> Option<Vec<&[u8]>> {
    if img.len() < 8 || u32::from_ne_bytes(img[0..4].try_into().ok()?) != IMG_COMMON_MAGIC {
        return None;
    }
    if u32::from_ne_bytes(img[4..8].try_into().ok()?) != magic {
        return None;
    }
    let mut out = Vec::new();
    let mut pos = 8;
    while pos < img.len() {
        let len = u32::from_ne_bytes(img.get(pos..pos + 4)?.try_into().ok()?) as usize;
        out.push(img.get(pos + 4..pos + 4 + len)?);
        pos += 4 + len;
    }
    Some(out)
}

/// Decodes a message we rewrite, only if it holds nothing but the fields we
/// know: re-encoded, it must give back the same bytes. A field added by a
/// newer CRIU (such as the compressed size of pages CRIU compressed itself,
/// which would make "page N of the pages image" mean something else) means
/// no plan, and the images are served untouched.
pub(super) fn decode_exact<M: Message + Default>(obj: &[u8]) -> Option<M> {
    let m = M::decode(obj).ok()?;
    (m.encode_to_vec() == obj).then_some(m)
}

pub(super) fn push_object(out: &mut Vec<u8>, obj: &[u8]) {
    out.extend_from_slice(&(obj.len() as u32).to_ne_bytes());
    out.extend_from_slice(obj);
}

pub(super) fn push_entry(out: &mut Vec<u8>, like: &PagemapEntry, vaddr: u64, nr: u64) {
    let e = PagemapEntry {
        vaddr,
        nr_pages: nr.min(u64::from(u32::MAX)) as u32,
        in_parent: like.in_parent.map(|_| false),
        flags: like.flags,
        nr_pages64: like.nr_pages64.map(|_| nr),
    };
    push_object(out, &e.encode_to_vec());
}

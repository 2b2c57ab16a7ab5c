//! Just enough of CRIU's image files to restore without sending zero pages.
//!
//! CRIU restores a private anonymous mapping as fresh (zero) memory and then
//! reads every page its pagemap lists. A page that is all zero need not be
//! listed at all: left out, it stays zero. That holds in a process tree too:
//! for a copy-on-write mapping inherited from a parent, CRIU drops
//! (MADV_DONTNEED) every page the child's pagemap does not list, so a child's
//! zeroed page cannot come back as the parent's bytes (criu/mem.c,
//! restore_priv_vma_content). It does not hold for private file mappings (a
//! missing page shows the file) nor for shared memory (its own pagemaps), so
//! only zero pages inside private anonymous VMAs (from `mm-<pid>.img`) are left
//! out. The plan rewrites `pagemap-<pid>.img` accordingly and tells the page
//! server which pages of `pages-<id>.img` to skip.
//!
//! Anything unexpected (magics, fields, flags) means no plan: the images are
//! served untouched, which is always correct.

//!
//! The images by family: `proto` (framing, messages, magics), `process`
//! (pstree, cores, cgroups), `pagemap` (runs and names), `zero_plan`,
//! `lazy_marks`, `shared` (shared memory and memfds) and `huge` (hugetlb).

mod huge;
mod lazy_marks;
mod pagemap;
mod process;
mod proto;
mod shared;
mod zero_plan;

pub use huge::{huge_memfds, huge_memory, private_huge_pages, shared_huge_pages, HugeMemory};
pub use lazy_marks::{lazy_runs_registered, mark_lazy};
pub(crate) use pagemap::in_ranges;
pub use pagemap::{
    joined_pagemap, pagemap_criu_opens, pagemap_pages_id, pagemap_runs, pages_image_id, pe, process_pagemap_pid,
    shmem_pagemap_id, PageRun, PagemapBuilder,
};
pub use process::{
    cgroup_dumped_memory_limits, cgroup_memory_paths, core_cg_set, core_stack_pointer, core_stopped_by,
    inventory_root_cg_set, pstree_parents, pstree_pids, pstree_threads, DumpedMemoryLimit,
};
pub use shared::{fd_file_ids, memfds, shared_mappings, Memfd, SharedId, SharedMapping};
pub use zero_plan::{plan, plan_runs, ZeroPlan};

#[cfg(test)]
mod tests;

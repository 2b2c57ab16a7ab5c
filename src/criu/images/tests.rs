use super::huge::MAP_HUGE_SHIFT;
use super::process::TASK_STOPPED;
use super::proto::*;
use super::*;
use crate::format::PageBits;
use prost::Message;

fn image(magic: u32, objs: &[Vec<u8>]) -> Vec<u8> {
    let mut v = IMG_COMMON_MAGIC.to_ne_bytes().to_vec();
    v.extend_from_slice(&magic.to_ne_bytes());
    for o in objs {
        push_object(&mut v, o);
    }
    v
}

fn vma(start: u64, end: u64, flags: i32, status: u32) -> VmaEntry {
    let prot = (libc::PROT_READ | libc::PROT_WRITE) as u32;
    VmaEntry { start, end, pgoff: 0, shmid: 0, prot, flags: flags as u32, status }
}

#[test]
fn zero_pages_of_private_anonymous_memory_are_left_out() {
    let anon = libc::MAP_PRIVATE | libc::MAP_ANONYMOUS;
    let mm = MmEntry {
        vmas: vec![
            vma(0x10000, 0x14000, anon, VMA_AREA_REGULAR | VMA_ANON_PRIVATE),
            vma(0x20000, 0x24000, libc::MAP_PRIVATE, VMA_AREA_REGULAR | (1 << 6)),
        ],
    };
    let mm = image(MM_MAGIC, &[mm.encode_to_vec()]);
    let entry = |vaddr, nr| {
        PagemapEntry { vaddr, nr_pages: nr, in_parent: None, flags: Some(PE_PRESENT), nr_pages64: None }.encode_to_vec()
    };
    let pm = image(PAGEMAP_MAGIC, &[PagemapHead { pages_id: 7 }.encode_to_vec(), entry(0x10000, 4), entry(0x20000, 4)]);
    // pages 0..8: anon 0 1 2 3, file 4 5 6 7; zero: 1, 2, 5
    let mut zero = PageBits::new();
    for p in [1, 2, 5] {
        zero.insert_growing(p);
    }
    let plan = plan(&mm, &pm, &zero).unwrap();
    assert_eq!(plan.pages_id, 7);
    assert_eq!(plan.skipped_pages, 2);
    assert!(plan.is_skipped(1) && plan.is_skipped(2));
    assert!(!plan.is_skipped(5), "a zero page of a private file mapping must be kept");
    let objs = objects(&plan.pagemap, PAGEMAP_MAGIC).unwrap();
    let entries: Vec<(u64, u32)> =
        objs[1..].iter().map(|o| PagemapEntry::decode(*o).unwrap()).map(|e| (e.vaddr, e.nr_pages)).collect();
    assert_eq!(entries, vec![(0x10000, 1), (0x13000, 1), (0x20000, 4)]);
}

#[test]
fn only_long_zero_runs_are_left_out_when_asked() {
    let anon = libc::MAP_PRIVATE | libc::MAP_ANONYMOUS;
    let mm = MmEntry { vmas: vec![vma(0x100000, 0x100000 + 40 * 4096, anon, VMA_AREA_REGULAR | VMA_ANON_PRIVATE)] };
    let mm = image(MM_MAGIC, &[mm.encode_to_vec()]);
    let e = PagemapEntry {
        vaddr: 0x100000,
        nr_pages: 40,
        in_parent: None,
        flags: Some(PE_PRESENT | PE_LAZY),
        nr_pages64: None,
    };
    let pm = image(PAGEMAP_MAGIC, &[PagemapHead { pages_id: 3 }.encode_to_vec(), e.encode_to_vec()]);
    // Zero: 2..5 (too short to leave out), 10..30 (long), 39 (short, at the end).
    let mut zero = PageBits::new();
    zero.insert_range(2, 5);
    zero.insert_range(10, 30);
    zero.insert_growing(39);
    let plan = plan_runs(&mm, &pm, &zero, 16).unwrap();
    assert_eq!(plan.skipped_pages, 20);
    assert!((0..40).all(|p| plan.is_skipped(p) == (10..30).contains(&p)));
    let objs = objects(&plan.pagemap, PAGEMAP_MAGIC).unwrap();
    let entries: Vec<(u64, u32, Option<u32>)> =
        objs[1..].iter().map(|o| PagemapEntry::decode(*o).unwrap()).map(|e| (e.vaddr, e.nr_pages, e.flags)).collect();
    let lazy = Some(PE_PRESENT | PE_LAZY);
    assert_eq!(entries, vec![(0x100000, 10, lazy), (0x100000 + 30 * 4096, 10, lazy)]);
}

fn entries(pagemap: &[u8]) -> Vec<(u64, u64, Option<u32>)> {
    objects(pagemap, PAGEMAP_MAGIC).unwrap()[1..]
        .iter()
        .map(|o| PagemapEntry::decode(*o).unwrap())
        .map(|e| (e.vaddr, e.nr_pages64.unwrap_or(e.nr_pages.into()), e.flags))
        .collect()
}

#[test]
fn pages_criu_left_eager_for_a_page_aligned_stack_pointer_are_marked_lazy() {
    let anon = libc::MAP_PRIVATE | libc::MAP_ANONYMOUS;
    let regular = VMA_AREA_REGULAR | VMA_ANON_PRIVATE;
    let mm = MmEntry {
        vmas: vec![
            vma(0x10000, 0x20000, anon, regular),
            vma(0x20000, 0x22000, anon | libc::MAP_LOCKED, regular),
            vma(0x30000, 0x32000, libc::MAP_PRIVATE, VMA_AREA_REGULAR | (1 << 6)),
            // The stack: its pointer page-aligned at 0x48000.
            vma(0x40000, 0x50000, anon | libc::MAP_GROWSDOWN, regular | (1 << 1)),
        ],
    };
    let mm = image(MM_MAGIC, &[mm.encode_to_vec()]);
    let entry = |vaddr, nr, flags| {
        PagemapEntry { vaddr, nr_pages: nr, in_parent: None, flags: Some(flags), nr_pages64: None }.encode_to_vec()
    };
    let eager = PE_PRESENT;
    let lazy = PE_PRESENT | PE_LAZY;
    let pm = image(
        PAGEMAP_MAGIC,
        &[
            PagemapHead { pages_id: 1 }.encode_to_vec(),
            entry(0x10000, 16, eager),
            entry(0x20000, 2, eager),
            entry(0x30000, 2, eager),
            entry(0x40000, 16, eager),
        ],
    );
    let marked = mark_lazy(&mm, &pm, &[0x48000]).unwrap();
    assert_eq!(
        entries(&marked),
        vec![
            (0x10000, 16, Some(lazy)),
            (0x20000, 2, Some(eager)),
            (0x30000, 2, Some(eager)),
            (0x40000, 7, Some(lazy)),
            (0x47000, 2, Some(eager)),
            (0x49000, 7, Some(lazy)),
        ],
        "locked and file memory stay eager, and the pages at and below the stack pointer"
    );
    // A dump CRIU marked right is left as it is: its pages images match.
    assert_eq!(mark_lazy(&mm, &marked, &[0x48000]).unwrap(), marked);
    // Without the pointer's page, nothing near it stays eager.
    assert_eq!(entries(&mark_lazy(&mm, &pm, &[0x100000]).unwrap())[3], (0x40000, 16, Some(lazy)));
}

#[test]
fn a_process_dumped_stopped_is_known_by_its_core_image() {
    let core = |task_state, stop_signo| {
        let tc = TaskCoreEntry { task_state: Some(task_state), stop_signo, cg_set: None };
        image(
            CORE_MAGIC,
            &[CoreEntry { mtype: MARCH_X86_64, thread_info: None, tc: Some(tc), thread_core: None }.encode_to_vec()],
        )
    };
    assert_eq!(core_stopped_by(&core(1, None)), None, "alive");
    assert_eq!(core_stopped_by(&core(TASK_STOPPED, Some(libc::SIGTSTP as u32))), Some(libc::SIGTSTP));
    // CRIU before stop_signo, or one it could not tell: SIGSTOP, as CRIU does.
    assert_eq!(core_stopped_by(&core(TASK_STOPPED, None)), Some(libc::SIGSTOP));
    assert_eq!(core_stopped_by(&core(TASK_STOPPED, Some(0))), Some(libc::SIGSTOP));
    let thread = CoreEntry { mtype: MARCH_X86_64, thread_info: None, tc: None, thread_core: None }.encode_to_vec();
    assert_eq!(core_stopped_by(&image(CORE_MAGIC, &[thread])), None, "a thread's core has no task state");
}

#[test]
fn stack_pointers_come_from_the_threads_core_images() {
    let regs = UserX86Regs { sp: Some(0x7ffe_1234_5000) };
    let core = CoreEntry {
        mtype: MARCH_X86_64,
        thread_info: Some(ThreadInfoX86 { gpregs: Some(regs.clone()) }),
        tc: None,
        thread_core: None,
    };
    assert_eq!(core_stack_pointer(&image(CORE_MAGIC, &[core.encode_to_vec()])), Some(0x7ffe_1234_5000));
    let other =
        CoreEntry { mtype: 3, thread_info: Some(ThreadInfoX86 { gpregs: Some(regs) }), tc: None, thread_core: None };
    assert_eq!(core_stack_pointer(&image(CORE_MAGIC, &[other.encode_to_vec()])), None, "aarch64");
    assert_eq!(core_stack_pointer(&image(MM_MAGIC, &[core.encode_to_vec()])), None, "not a core image");
    let tree = image(
        PSTREE_MAGIC,
        &[
            PstreeEntry { pid: 7, ppid: 1, threads: vec![7, 9] }.encode_to_vec(),
            PstreeEntry { pid: 8, ppid: 7, threads: vec![] }.encode_to_vec(),
        ],
    );
    assert_eq!(pstree_threads(&tree, 7), Some(vec![7, 9]));
    assert_eq!(pstree_threads(&tree, 8), Some(vec![8]));
    assert_eq!(pstree_threads(&tree, 10), None);
}

#[test]
fn a_pagemap_with_fields_we_do_not_know_gets_no_plan() {
    let anon = libc::MAP_PRIVATE | libc::MAP_ANONYMOUS;
    let mm = MmEntry { vmas: vec![vma(0x10000, 0x14000, anon, VMA_AREA_REGULAR | VMA_ANON_PRIVATE)] };
    let mm = image(MM_MAGIC, &[mm.encode_to_vec()]);
    let mut entry =
        PagemapEntry { vaddr: 0x10000, nr_pages: 4, in_parent: None, flags: Some(PE_PRESENT), nr_pages64: None }
            .encode_to_vec();
    let pm = |entry: &[u8]| image(PAGEMAP_MAGIC, &[PagemapHead { pages_id: 1 }.encode_to_vec(), entry.to_vec()]);
    let mut all = PageBits::new();
    all.insert_range(0, 4);
    assert!(plan(&mm, &pm(&entry), &all).is_some(), "the plain pagemap gets a plan");
    // Pages compressed by CRIU itself (upstream `--compress`, PR 2895):
    // the sizes of the compressed blocks are in new pagemap fields, and
    // "page N of the pages image" no longer means N * 4096 bytes in. Both
    // schemas seen upstream must disable the plan.
    let compressed_a = [
        vec![6 << 3 | 2, 2, 0xd2, 0x09], // repeated uint32 compressed_size = 6 [packed]: [1234]
        vec![7 << 3, 0xd2, 0x09],        // optional uint64 total_compressed_size = 7
        vec![8 << 3, 64],                // optional uint32 region_pages = 8
    ]
    .concat();
    let compressed_b = vec![6 << 3 | 2, 7, 1 << 3 | 2, 2, 0xd2, 0x09, 2 << 3, 0xd2, 0x09]; // blocks = 6 {..}
    for extra in [compressed_a, compressed_b] {
        let mut e = entry.clone();
        e.extend_from_slice(&extra);
        assert!(plan(&mm, &pm(&e), &all).is_none(), "a compressed pagemap must get no plan");
    }
    // PE_PAYLOAD_ALIGNED (1 << 3), which compressed images use, is unknown to the plan too.
    let aligned =
        PagemapEntry { flags: Some(PE_PRESENT | 8), ..PagemapEntry::decode(&entry[..]).unwrap() }.encode_to_vec();
    assert!(plan(&mm, &pm(&aligned), &all).is_none());
    entry.extend_from_slice(&[9 << 3, 1]);
    assert!(plan(&mm, &pm(&entry), &all).is_none(), "any unknown field must disable the plan");
}

#[test]
fn a_pagemap_out_of_order_or_overlapping_is_neither_placed_nor_rewritten() {
    let anon = libc::MAP_PRIVATE | libc::MAP_ANONYMOUS;
    let mm = MmEntry { vmas: vec![vma(0x10000, 0x20000, anon, VMA_AREA_REGULAR | VMA_ANON_PRIVATE)] };
    let mm = image(MM_MAGIC, &[mm.encode_to_vec()]);
    let entry = |vaddr: u64, nr: u32, flags: u32| {
        PagemapEntry { vaddr, nr_pages: nr, in_parent: None, flags: Some(flags), nr_pages64: None }.encode_to_vec()
    };
    let pm = |entries: &[(u64, u32, u32)]| {
        let mut objs = vec![PagemapHead { pages_id: 1 }.encode_to_vec()];
        objs.extend(entries.iter().map(|&(v, n, f)| entry(v, n, f)));
        image(PAGEMAP_MAGIC, &objs)
    };
    // Page 0 of the image is zero, page 1 is not.
    let mut zero = PageBits::new();
    zero.insert_range(0, 1);
    let lazy = PE_PRESENT | PE_LAZY;
    // As CRIU writes them: ascending, a gap or none between entries.
    for good in [vec![(0x10000, 1, lazy), (0x11000, 1, lazy)], vec![(0x10000, 1, lazy), (0x15000, 1, PE_PRESENT)]] {
        assert!(pagemap_runs(&pm(&good)).is_some(), "{good:x?}");
        assert!(plan(&mm, &pm(&good), &zero).is_some(), "{good:x?}");
    }
    // The same page twice (CRIU would restore the second copy; a copy by
    // userfaultfd keeps the first, and leaving out the zero one would
    // unmask the first), an entry reaching into the next, one before the
    // one it follows, and one after a parent's entry it overlaps.
    for bad in [
        vec![(0x10000, 1, lazy), (0x10000, 1, lazy)],
        vec![(0x10000, 2, lazy), (0x11000, 1, lazy)],
        vec![(0x12000, 1, lazy), (0x10000, 1, lazy)],
    ] {
        assert!(pagemap_runs(&pm(&bad)).is_none(), "{bad:x?}");
        assert!(plan(&mm, &pm(&bad), &zero).is_none(), "{bad:x?}");
    }
    assert!(plan(&mm, &pm(&[(0x10000, 2, PE_PARENT), (0x11000, 1, lazy)]), &zero).is_none());
}

#[test]
fn an_entry_in_a_parent_is_read_as_criu_reads_it() {
    let anon = libc::MAP_PRIVATE | libc::MAP_ANONYMOUS;
    let mm = MmEntry { vmas: vec![vma(0x10000, 0x14000, anon, VMA_AREA_REGULAR | VMA_ANON_PRIVATE)] };
    let mm = image(MM_MAGIC, &[mm.encode_to_vec()]);
    let pm = |in_parent: Option<bool>, flags: Option<u32>| {
        let e = PagemapEntry { vaddr: 0x10000, nr_pages: 2, in_parent, flags, nr_pages64: None };
        image(PAGEMAP_MAGIC, &[PagemapHead { pages_id: 1 }.encode_to_vec(), e.encode_to_vec()])
    };
    let zero = PageBits::with_pages(2);
    // No flags: present (CRIU before flags); `in_parent` false changes nothing.
    for plain in [pm(None, None), pm(Some(false), Some(PE_PRESENT))] {
        assert!(pagemap_runs(&plain).is_some());
        assert!(plan(&mm, &plain, &zero).is_some());
    }
    // `in_parent` makes the pages the parent's whatever the flags say (CRIU
    // ORs PE_PARENT in): neither placed, planned nor marked lazy.
    for parent in [pm(Some(true), None), pm(Some(true), Some(PE_PRESENT)), pm(Some(true), Some(PE_PRESENT | PE_LAZY))] {
        assert!(pagemap_runs(&parent).is_none());
        assert!(plan(&mm, &parent, &zero).is_none());
        assert_eq!(mark_lazy(&mm, &parent, &[]).as_deref(), Some(&parent[..]), "left as it is");
    }
}

#[test]
fn pages_flagged_lazy_must_lie_where_criu_registers_userfaultfd() {
    let anon = libc::MAP_PRIVATE | libc::MAP_ANONYMOUS;
    let mm = MmEntry {
        vmas: vec![
            vma(0x10000, 0x12000, anon, VMA_AREA_REGULAR | VMA_ANON_PRIVATE),
            vma(0x12000, 0x14000, anon, VMA_AREA_REGULAR | VMA_ANON_PRIVATE),
            vma(0x20000, 0x22000, libc::MAP_PRIVATE, VMA_AREA_REGULAR | (1 << 6)), // file private
            vma(0x30000, 0x32000, anon | libc::MAP_LOCKED, VMA_AREA_REGULAR | VMA_ANON_PRIVATE),
            vma(0x40000, 0x42000, anon, VMA_AREA_REGULAR | (1 << 3)), // vDSO
        ],
    };
    let mm = image(MM_MAGIC, &[mm.encode_to_vec()]);
    let run = |vaddr: u64, nr: u64, lazy: bool| PageRun { vaddr, nr, first: 0, lazy };
    // Across two adjacent VMAs CRIU registers: as CRIU merges them.
    assert!(lazy_runs_registered(&mm, &[run(0x10000, 4, true)]));
    // Pages CRIU restores itself may lie anywhere.
    assert!(lazy_runs_registered(&mm, &[run(0x20000, 2, false), run(0x30000, 1, false)]));
    for outside in [
        run(0x20000, 1, true), // a file mapping
        run(0x30000, 1, true), // locked memory
        run(0x40000, 1, true), // the vDSO
        run(0x13000, 2, true), // past the end of the memory
        run(0x50000, 1, true), // no VMA at all
    ] {
        assert!(!lazy_runs_registered(&mm, &[run(0x10000, 1, true), outside]), "{outside:x?}");
    }
    assert!(!lazy_runs_registered(b"garbage", &[]), "an image not as expected");
    // VMAs that overlap, or out of address order: never placed.
    for vmas in [
        vec![vma(0x10000, 0x14000, anon, VMA_AREA_REGULAR | VMA_ANON_PRIVATE), vma(0x12000, 0x13000, anon, 0)],
        vec![vma(0x20000, 0x21000, anon, 0), vma(0x10000, 0x14000, anon, VMA_AREA_REGULAR | VMA_ANON_PRIVATE)],
    ] {
        let mm = image(MM_MAGIC, &[MmEntry { vmas }.encode_to_vec()]);
        assert!(!lazy_runs_registered(&mm, &[run(0x10000, 1, true)]));
    }
}

#[test]
fn unexpected_images_get_no_plan() {
    assert!(plan(b"garbage", b"garbage", &PageBits::with_pages(8)).is_none());
}

/// The plan page by page, as a reference: (kept entries as (vaddr, pages),
/// pages left out).
fn plan_page_by_page(
    vmas: &[(u64, u64, bool)],
    entries: &[(u64, u64)],
    zero: &[bool],
    min_run: u64,
) -> (Vec<(u64, u64)>, Vec<u64>) {
    let anon = |a: u64| vmas.iter().any(|&(s, e, anon)| anon && s <= a && a < e);
    let (mut kept, mut left_out, mut page) = (Vec::new(), Vec::new(), 0u64);
    for &(vaddr, nr) in entries {
        let skippable = |i: u64| zero[(page + i) as usize] && anon(vaddr + i * 4096);
        let (mut i, mut run): (u64, Option<(u64, u64)>) = (0, None);
        while i < nr {
            let mut end = i;
            while end < nr && skippable(end) {
                end += 1;
            }
            if end > i && end - i >= min_run {
                left_out.extend(page + i..page + end);
                kept.extend(run.take());
                i = end;
                continue;
            }
            let upto = end.max(i + 1);
            run = Some(run.map_or((vaddr + i * 4096, upto - i), |(s, n)| (s, n + upto - i)));
            i = upto;
        }
        kept.extend(run);
        page += nr;
    }
    (kept, left_out)
}

#[test]
fn zero_runs_found_a_byte_at_a_time_match_page_by_page() {
    let mut x = 0x2545_f491_4f6c_dd1du64;
    let mut rand = move |n: u64| {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x % n
    };
    let anon = libc::MAP_PRIVATE | libc::MAP_ANONYMOUS;
    for round in 0..300u64 {
        // VMAs back to back, anonymous or file-backed; entries inside them,
        // some crossing from one into the next.
        let mut vmas = Vec::new();
        let mut at = 0x100000u64;
        for _ in 0..1 + rand(4) {
            let len = (1 + rand(90)) * 4096;
            vmas.push((at, at + len, rand(3) != 0));
            at += len + rand(2) * 4096;
        }
        let mut entries = Vec::new();
        let mut a = vmas[0].0;
        while a < at && entries.len() < 6 {
            let nr = 1 + rand(120);
            entries.push((a, nr));
            a += (nr + rand(4)) * 4096;
        }
        let pages: u64 = entries.iter().map(|e| e.1).sum();
        let dense = round % 3;
        let zero: Vec<bool> = (0..pages).map(|_| rand(4) < dense + 1).collect();
        let min_run = [1, 2, 16, u64::MAX][round as usize % 4];

        let mm = MmEntry {
            vmas: vmas
                .iter()
                .map(|&(s, e, is_anon)| {
                    if is_anon {
                        vma(s, e, anon, VMA_AREA_REGULAR | VMA_ANON_PRIVATE)
                    } else {
                        vma(s, e, libc::MAP_PRIVATE, VMA_AREA_REGULAR | (1 << 6))
                    }
                })
                .collect(),
        };
        let mm = image(MM_MAGIC, &[mm.encode_to_vec()]);
        let mut objs = vec![PagemapHead { pages_id: 2 }.encode_to_vec()];
        for &(vaddr, nr) in &entries {
            let e =
                PagemapEntry { vaddr, nr_pages: nr as u32, in_parent: None, flags: Some(PE_PRESENT), nr_pages64: None };
            objs.push(e.encode_to_vec());
        }
        let pm = image(PAGEMAP_MAGIC, &objs);
        let mut bits = PageBits::new();
        for (p, _) in zero.iter().enumerate().filter(|(_, z)| **z) {
            bits.insert_growing(p);
        }
        let plan = plan_runs(&mm, &pm, &bits, min_run).unwrap();
        let (kept, left_out) = plan_page_by_page(&vmas, &entries, &zero, min_run);
        let got: Vec<(u64, u64)> = self::entries(&plan.pagemap).into_iter().map(|(v, n, _)| (v, n)).collect();
        assert_eq!(got, kept, "round {round}: kept entries");
        assert_eq!(plan.skipped_pages, left_out.len() as u64, "round {round}");
        assert!((0..pages).all(|p| plan.is_skipped(p) == left_out.contains(&p)), "round {round}: pages left out");
    }
}

#[test]
fn the_cgroups_a_tree_was_dumped_in_are_read_from_its_images() {
    let member = |name: &str, path: &str| CgMemberEntry { name: name.into(), path: path.into() };
    let set = |id, ctls| CgSetEntry { id, ctls };
    let cgroups = CgroupEntry {
        controllers: vec![],
        sets: vec![
            set(1, vec![member("cpu,cpuacct", "/"), member("memory", "/"), member("", "/")]),
            set(2, vec![member("memory", "/pod/box"), member("", "/pod/box")]),
            set(3, vec![member("", "/v2only")]),
            set(4, vec![member("pids", "/p")]),
        ],
    };
    let paths = cgroup_memory_paths(&image(CGROUP_MAGIC, &[cgroups.encode_to_vec()])).unwrap();
    assert!(cgroup_dumped_memory_limits(&image(CGROUP_MAGIC, &[cgroups.encode_to_vec()])).is_empty(), "no dirs");
    let want = [(1, "/", false), (2, "/pod/box", false), (3, "/v2only", true)];
    assert_eq!(paths, want.map(|(id, p, v2)| (id, p.to_string(), v2)).to_vec(), "v1's memory first, else v2's");
    assert_eq!(cgroup_memory_paths(&image(CORE_MAGIC, &[cgroups.encode_to_vec()])), None, "not a cgroup image");

    // The set is per thread since CRIU 3.x; before, the task's.
    let core = |tc: Option<u32>, thread: Option<u32>| {
        let c = CoreEntry {
            mtype: MARCH_X86_64,
            thread_info: None,
            tc: Some(TaskCoreEntry { task_state: Some(1), stop_signo: None, cg_set: tc }),
            thread_core: thread.map(|t| ThreadCoreEntry { cg_set: Some(t) }),
        };
        image(CORE_MAGIC, &[c.encode_to_vec()])
    };
    assert_eq!(core_cg_set(&core(Some(5), Some(2))), Some(2));
    assert_eq!(core_cg_set(&core(Some(5), None)), Some(5));
    assert_eq!(core_cg_set(&core(None, None)), Some(0), "a zombie's: its parent's");

    // inventory.img has its own magic alone before its one object.
    let entry = InventoryEntry { root_cg_set: Some(1) }.encode_to_vec();
    let mut inventory = INVENTORY_MAGIC.to_ne_bytes().to_vec();
    inventory.extend_from_slice(&(entry.len() as u32).to_ne_bytes());
    inventory.extend_from_slice(&entry);
    assert_eq!(inventory_root_cg_set(&inventory), Some(1));
    assert_eq!(inventory_root_cg_set(&inventory[..inventory.len() - 1]), None, "cut short");
    assert_eq!(inventory_root_cg_set(&image(INVENTORY_MAGIC, &[entry])), None, "a common magic first");

    let tree = image(
        PSTREE_MAGIC,
        &[
            PstreeEntry { pid: 7, ppid: 1, threads: vec![] }.encode_to_vec(),
            PstreeEntry { pid: 8, ppid: 7, threads: vec![] }.encode_to_vec(),
        ],
    );
    assert_eq!(pstree_parents(&tree), Some(vec![(7, 1), (8, 7)]));
}

#[test]
fn the_limits_of_dumped_memory_groups_are_read_from_their_directories() {
    let prop = |name: &str, value: &str| CgroupPropEntry { name: name.into(), value: value.into() };
    let dir = |name: &str, properties, children| CgroupDirEntry { dir_name: name.into(), children, properties };
    let cgroups = CgroupEntry {
        sets: vec![],
        controllers: vec![
            CgControllerEntry {
                cnames: vec!["memory".into()],
                dirs: vec![dir(
                    "pod",
                    vec![prop("memory.limit_in_bytes", "9223372036854771712")],
                    vec![dir(
                        "box",
                        vec![
                            prop("memory.limit_in_bytes", "167772160"),
                            prop("memory.memsw.limit_in_bytes", "201326592"),
                        ],
                        vec![],
                    )],
                )],
            },
            CgControllerEntry {
                cnames: vec!["cpu,cpuacct".into()],
                dirs: vec![dir("c", vec![prop("memory.max", "1")], vec![])],
            },
            CgControllerEntry {
                cnames: vec!["".into()],
                dirs: vec![dir(
                    "u",
                    vec![prop("memory.max", "max")],
                    vec![dir("v", vec![prop("memory.max", "4096")], vec![])],
                )],
            },
        ],
    };
    let limits = cgroup_dumped_memory_limits(&image(CGROUP_MAGIC, &[cgroups.encode_to_vec()]));
    let want = [
        DumpedMemoryLimit { path: "/pod/box".into(), v2: false, limit: 167_772_160, swap: Some(201_326_592) },
        DumpedMemoryLimit { path: "/u/v".into(), v2: true, limit: 4096, swap: None },
    ];
    assert_eq!(limits, want, "unlimited groups and other controllers left out");
    assert!(cgroup_dumped_memory_limits(b"not an image").is_empty());
}

#[test]
fn huge_page_memory_is_found_in_the_images() {
    const HUGE: u64 = 2 << 20;
    const GIGANTIC: u64 = 1 << 30;
    let anon = libc::MAP_PRIVATE | libc::MAP_ANONYMOUS;
    let huge = anon | libc::MAP_HUGETLB;
    let private = VMA_AREA_REGULAR | VMA_ANON_PRIVATE;
    let mm = MmEntry {
        vmas: vec![
            vma(0x10000, 0x14000, anon, private),
            vma(0x4000_0000, 0x4000_0000 + 2 * HUGE, huge, private),
            vma(0x8000_0000, 0x8000_0000 + GIGANTIC, huge | (30 << MAP_HUGE_SHIFT), private),
        ],
    };
    let mm = image(MM_MAGIC, &[mm.encode_to_vec()]);
    let entry = |vaddr, nr| {
        PagemapEntry { vaddr, nr_pages: nr, in_parent: None, flags: Some(PE_PRESENT), nr_pages64: None }.encode_to_vec()
    };
    let head = |pages_id| PagemapHead { pages_id }.encode_to_vec();
    // Pages 0..4 ordinary; 4..8 across the first two huge pages; 8 in the
    // gigantic one.
    let pm = image(
        PAGEMAP_MAGIC,
        &[head(7), entry(0x10000, 4), entry(0x4000_0000 + HUGE - 0x2000, 4), entry(0x8000_0000, 1)],
    );
    let h = huge_memory(&mm, &pm, HUGE).unwrap();
    assert_eq!(h.private_pages, vec![(4, 9)]);
    assert_eq!(h.private_huge, vec![(HUGE, 2), (GIGANTIC, 1)]);
    assert!(h.shared.is_empty());
    assert_eq!(huge_memory(&mm, b"garbage", HUGE), None, "a pagemap not as expected");
    // Shared memory of huge pages, dumped as memfds.
    let memfd = |shmid, hugetlb_flag| MemfdInodeEntry { shmid, hugetlb_flag, ..Default::default() }.encode_to_vec();
    let memfds = image(MEMFD_INODE_MAGIC, &[memfd(77, Some(4)), memfd(78, None), memfd(79, Some(4 | (30 << 26)))]);
    assert_eq!(huge_memfds(&memfds, HUGE), Some(vec![(77, HUGE), (79, GIGANTIC)]));
    let shared = image(PAGEMAP_MAGIC, &[head(3), entry(0, 2), entry(HUGE - 0x1000, 2), entry(5 * HUGE, 0)]);
    assert_eq!(shared_huge_pages(&shared, HUGE), Some((3, 2)));
}

#[test]
fn shared_memory_is_filled_only_through_plain_shared_mappings() {
    let shared = libc::MAP_SHARED | libc::MAP_ANONYMOUS;
    let with = |mut v: VmaEntry, pgoff, shmid| {
        v.pgoff = pgoff;
        v.shmid = shmid;
        v
    };
    let memfd = VMA_AREA_REGULAR | VMA_AREA_MEMFD | VMA_FILE_SHARED;
    let mm = MmEntry {
        vmas: vec![
            // Plain anonymous shared memory, the second one from byte 8192.
            with(vma(0x10000, 0x14000, shared, VMA_AREA_REGULAR | VMA_ANON_SHARED), 0, 11),
            with(vma(0x20000, 0x22000, shared, VMA_AREA_REGULAR | VMA_ANON_SHARED), 8192, 11),
            // A System V segment, huge pages, a memfd mapped privately:
            // left to CRIU.
            with(vma(0x30000, 0x31000, shared, VMA_AREA_REGULAR | VMA_ANON_SHARED | VMA_AREA_SYSVIPC), 0, 12),
            with(vma(0x400000, 0x600000, shared | libc::MAP_HUGETLB, VMA_AREA_REGULAR | VMA_ANON_SHARED), 0, 13),
            with(vma(0x700000, 0x701000, libc::MAP_PRIVATE, VMA_AREA_REGULAR | VMA_AREA_MEMFD | (1 << 6)), 0, 4),
            // Private memory is no object's.
            vma(0x800000, 0x801000, libc::MAP_PRIVATE | libc::MAP_ANONYMOUS, VMA_AREA_REGULAR | VMA_ANON_PRIVATE),
            // A memfd (how CRIU 4.2 dumps anonymous shared memory too).
            with(vma(0x900000, 0x901000, libc::MAP_SHARED, memfd), 0, 3),
        ],
    };
    let (plain, other) = shared_mappings(&image(MM_MAGIC, &[mm.encode_to_vec()])).unwrap();
    let anon = SharedId::Anon(11);
    assert_eq!(
        plain,
        vec![
            SharedMapping { start: 0x10000, end: 0x14000, pgoff: 0, object: anon, writable: true },
            SharedMapping { start: 0x20000, end: 0x22000, pgoff: 8192, object: anon, writable: true },
            SharedMapping { start: 0x900000, end: 0x901000, pgoff: 0, object: SharedId::MemfdFile(3), writable: true },
        ]
    );
    assert_eq!(other, vec![SharedId::Anon(12), SharedId::Anon(13), SharedId::MemfdFile(4)]);
    assert_eq!(plain[1].address_of(8192), Some((0x20000, 0x2000)));
    assert_eq!(plain[1].address_of(12288), Some((0x21000, 0x1000)));
    assert_eq!(plain[1].address_of(4096), None, "before the mapping");
    assert_eq!(plain[1].address_of(16384), None, "past its end");
    // A mapping that is not whole pages is not one CRIU wrote.
    let odd = MmEntry { vmas: vec![with(vma(0x10000, 0x14000, shared, VMA_AREA_REGULAR | VMA_ANON_SHARED), 100, 11)] };
    assert_eq!(shared_mappings(&image(MM_MAGIC, &[odd.encode_to_vec()])), None);
    // A read-only mapping is marked so (it may come from a descriptor
    // opened read-only, which takes no copy).
    let mut read_only = with(vma(0x10000, 0x14000, shared, VMA_AREA_REGULAR | VMA_ANON_SHARED), 0, 11);
    read_only.prot = libc::PROT_READ as u32;
    let mm = MmEntry { vmas: vec![read_only] };
    let only = SharedMapping { start: 0x10000, end: 0x14000, pgoff: 0, object: anon, writable: false };
    assert_eq!(shared_mappings(&image(MM_MAGIC, &[mm.encode_to_vec()])), Some((vec![only], vec![])));
    // Nor are overlapping mappings: a copy through the first would land in
    // the second's object.
    let a = with(vma(0x10000, 0x14000, shared, VMA_AREA_REGULAR | VMA_ANON_SHARED), 0, 11);
    let b = vma(0x12000, 0x13000, libc::MAP_PRIVATE | libc::MAP_ANONYMOUS, VMA_AREA_REGULAR | VMA_ANON_PRIVATE);
    let overlapping = MmEntry { vmas: vec![a, b] };
    assert_eq!(shared_mappings(&image(MM_MAGIC, &[overlapping.encode_to_vec()])), None);
    assert_eq!(shmem_pagemap_id("pagemap-shmem-11.img"), Some(11));
    assert_eq!(shmem_pagemap_id("pagemap-shmem-011.img"), None);
    assert_eq!(shmem_pagemap_id("pagemap-11.img"), None);
}

#[test]
fn a_memfd_file_leads_to_its_pages_and_size() {
    let inode = |inode_id, shmid, seals, hugetlb_flag| {
        MemfdInodeEntry { size: Some(3 << 20), shmid, seals: Some(seals), inode_id: Some(inode_id), hugetlb_flag }
            .encode_to_vec()
    };
    let memfd =
        image(MEMFD_INODE_MAGIC, &[inode(1, 500, 0, None), inode(2, 501, 0x08, None), inode(3, 502, 0, Some(4))]);
    let file = |id, inode_id| {
        FileEntry { r#type: FD_TYPE_MEMFD, id, memfd: Some(MemfdFileEntry { inode_id }) }.encode_to_vec()
    };
    let other = FileEntry { r#type: 1, id: 9, memfd: None }.encode_to_vec();
    let files = image(FILES_MAGIC, &[file(5, 1), other, file(6, 2), file(7, 3), file(8, 1)]);
    let got = memfds(&files, &memfd).unwrap();
    assert_eq!(got.len(), 4);
    assert_eq!(got[&5], Memfd { shmid: 500, size: 3 << 20, writable: true });
    assert_eq!(got[&8], got[&5], "two files of one memfd");
    assert!(!got[&6].writable, "sealed against writes");
    assert!(!got[&7].writable, "of huge pages");
    // A memfd file whose memfd is not there: not an image CRIU wrote.
    assert_eq!(memfds(&image(FILES_MAGIC, &[file(5, 4)]), &memfd), None);
}

/// CRIU cuts a dump's runs where its page pipes end (256 pages at a 1 MiB
/// pipe); handed back joined, its restore walks one entry per run of
/// pages that continue each other with the same flags, and each page keeps
/// its place in the pages image.
#[test]
fn runs_that_continue_each_other_are_handed_to_criu_joined() {
    let entry = |vaddr: u64, nr: u64, flags| {
        PagemapEntry { vaddr, nr_pages: nr as u32, in_parent: None, flags: Some(flags), nr_pages64: Some(nr) }
            .encode_to_vec()
    };
    let lazy = PE_PRESENT | PE_LAZY;
    let at = |page: u64| 0x7f00_0000_0000 + page * 4096;
    let pm = image(
        PAGEMAP_MAGIC,
        &[
            PagemapHead { pages_id: 3 }.encode_to_vec(),
            entry(at(0), 256, lazy),
            entry(at(256), 256, lazy),
            entry(at(512), 100, lazy),
            // Not lazy: a run of its own.
            entry(at(612), 2, PE_PRESENT),
            // After a hole.
            entry(at(700), 256, lazy),
            entry(at(956), 4, lazy),
        ],
    );
    let (id, runs) = pagemap_runs(&pm).unwrap();
    let joined = joined_pagemap(id, &runs);
    let (id, runs) = pagemap_runs(&joined).unwrap();
    assert_eq!(id, 3);
    let run = |page, nr, first, lazy| PageRun { vaddr: at(page), nr, first, lazy };
    assert_eq!(runs, vec![run(0, 612, 0, true), run(612, 2, 612, false), run(700, 260, 614, true)]);
    // CRIU 4.2 reads field 5, older CRIU field 2: both say the run's length.
    let objs = objects(&joined, PAGEMAP_MAGIC).unwrap();
    let first = PagemapEntry::decode(objs[1]).unwrap();
    assert_eq!((first.nr_pages, first.nr_pages64), (612, Some(612)));
}

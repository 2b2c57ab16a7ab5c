//! Real CRIU against damaged and crafted archives: block records swapped,
//! duplicated, re-pointed (with the index check recomputed), taken from
//! another process's archive, F and E records edited, truncation. Every
//! variant is restored from a file and from a pipe; each must fail as a
//! damaged archive (exit 3), leave no process running on wrong memory, and
//! leave no work directory behind; a tree's dedup references re-pointed
//! too. The undamaged archive then restores with the workload's own
//! checksums, so the test can tell success from failure. A pagemap crafted
//! to list a page twice is left to CRIU's own reading.

// Tests start processes of their own; clippy.toml's rule is for the
// programs criuz runs.
#![allow(clippy::disallowed_methods)]

mod common;
#[path = "../fuzz/src/mutate.rs"]
mod mutate;

use common::*;
use mutate::{index_refs, records, reseal, Rec, Reseal};
use std::path::Path;
use std::process::{Command, Stdio};

fn dump_to(w: &Workload, arc: &Path, extra: &[&str]) {
    let pid = w.pid.to_string();
    let mut args = vec!["dump", "-t", &pid, "-o", arc.to_str().unwrap(), "--codec", "none", "--block-size", "64K"];
    args.extend_from_slice(extra);
    let out = criuz(&args);
    assert!(out.status.success(), "criuz dump: {}", String::from_utf8_lossy(&out.stderr));
}

/// Block records of the file named `name` (by its F record's file id).
fn blocks_of(a: &[u8], name: &str) -> Vec<Rec> {
    let recs = records(a);
    let id = recs
        .iter()
        .find(|r| r.kind == b'F' && &a[r.start + 8..r.start + r.len - 4] == name.as_bytes())
        .map(|r| u32::from_le_bytes(a[r.start + 4..r.start + 8].try_into().unwrap()))
        .unwrap_or_else(|| panic!("no {name} in the archive"));
    recs.into_iter().filter(|r| r.kind == b'B' && a[r.start + 4..r.start + 8] == id.to_le_bytes()).collect()
}

fn pages_name(a: &[u8]) -> String {
    let r = records(a)
        .into_iter()
        .find(|r| r.kind == b'F' && a[r.start + 8..r.start + r.len - 4].starts_with(b"pages-"))
        .expect("a pages image");
    String::from_utf8(a[r.start + 8..r.start + r.len - 4].to_vec()).unwrap()
}

/// Two full blocks of equal record length and different content.
fn two_equal_blocks(a: &[u8], blocks: &[Rec]) -> (Rec, Rec) {
    for (i, x) in blocks.iter().enumerate() {
        for y in &blocks[i + 1..] {
            if x.len == y.len && a[x.start + 16..x.start + 24] != a[y.start + 16..y.start + 24] {
                return (*x, *y);
            }
        }
    }
    panic!("no two distinct blocks of equal length");
}

fn swap(a: &mut [u8], x: Rec, y: Rec) {
    let bx = a[x.start..x.start + x.len].to_vec();
    let by = a[y.start..y.start + y.len].to_vec();
    a[x.start..x.start + x.len].copy_from_slice(&by);
    a[y.start..y.start + y.len].copy_from_slice(&bx);
}

/// The index reference that points at `block`.
fn ref_to(a: &[u8], block: Rec) -> usize {
    index_refs(a)
        .into_iter()
        .map(|(_, at)| at)
        .find(|&at| u64::from_le_bytes(a[at..at + 8].try_into().unwrap()) == block.start as u64)
        .expect("an index reference to the block")
}

fn variants(good: &[u8], foreign: &[u8]) -> Vec<(&'static str, Vec<u8>)> {
    let pages = pages_name(good);
    let blocks = blocks_of(good, &pages);
    let (x, y) = two_equal_blocks(good, &blocks);
    let mut out = Vec::new();

    let mut v = good.to_vec();
    swap(&mut v, x, y);
    out.push(("swapped pages blocks", v.clone()));
    reseal(&mut v, Reseal::Index);
    out.push(("swapped pages blocks, seals and index check recomputed", v));

    let mut v = good.to_vec();
    let bx = v[x.start..x.start + x.len].to_vec();
    v[y.start..y.start + y.len].copy_from_slice(&bx);
    out.push(("duplicated pages block", v.clone()));
    reseal(&mut v, Reseal::Seals);
    out.push(("duplicated pages block, seals recomputed", v));

    let mut v = good.to_vec();
    let at = ref_to(&v, y);
    v[at..at + 8].copy_from_slice(&(x.start as u64).to_le_bytes());
    reseal(&mut v, Reseal::Index);
    out.push(("index re-pointed at another block of the same file, index check recomputed", v));

    let other = records(good)
        .into_iter()
        .find(|r| r.kind == b'B' && r.start != x.start && !blocks.iter().any(|b| b.start == r.start))
        .expect("a block of another file");
    let mut v = good.to_vec();
    let at = ref_to(&v, x);
    v[at..at + 8].copy_from_slice(&(other.start as u64).to_le_bytes());
    v[at + 8..at + 12].copy_from_slice(&good[other.start + 8..other.start + 12]);
    v[at + 12..at + 16].copy_from_slice(&(other.len as u32).to_le_bytes());
    reseal(&mut v, Reseal::Index);
    out.push(("index re-pointed at a block of another file, index check recomputed", v));

    let theirs = blocks_of(foreign, &pages_name(foreign));
    let t = theirs
        .iter()
        .find(|t| t.len == x.len && foreign[t.start + 16..t.start + 24] != good[x.start + 16..x.start + 24])
        .expect("a foreign block of the same length");
    let mut v = good.to_vec();
    v[x.start..x.start + x.len].copy_from_slice(&foreign[t.start..t.start + t.len]);
    v[x.start + 4..x.start + 8].copy_from_slice(&good[x.start + 4..x.start + 8]);
    reseal(&mut v, Reseal::Seals);
    out.push(("block of another process's pages image, seals recomputed", v));

    for (kind, what) in [(b'F', "F record name edited"), (b'E', "E record size edited")] {
        let r = records(good).into_iter().find(|r| r.kind == kind).unwrap();
        let mut v = good.to_vec();
        v[r.start + 9] ^= 0x01;
        out.push((what, v.clone()));
        reseal(&mut v, Reseal::Seals);
        out.push((if kind == b'F' { "F record name edited, resealed" } else { "E record edited, resealed" }, v));
    }

    let mut v = good.to_vec();
    v.truncate(good.len() - 100);
    out.push(("truncated", v));

    // Restores open an archive from its index and walk it behind: an index
    // whose references and table entries were swapped (every check
    // recomputed) names real blocks with matching headers, so only that walk
    // can tell, and the tree must not run before it has.
    out.push(("index and block table reordered, every check recomputed", forge_index(good, swap_indexed_blocks)));
    out
}

/// `criuz restore -d -i -` with the archive at `arc` on its standard input.
fn restore_from_pipe(arc: &Path) -> std::process::Output {
    Command::new(CRIUZ)
        .args(["restore", "-d", "-i", "-"])
        .stdin(std::fs::File::open(arc).unwrap())
        .stdout(Stdio::null())
        .output()
        .unwrap()
}

fn restore_dirs() -> usize {
    std::fs::read_dir(std::env::temp_dir())
        .unwrap()
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().starts_with("criuz-restore-"))
        .count()
}

#[test]
fn damaged_and_crafted_archives_never_restore_wrong_memory() {
    let Some(_criu) = criu() else { return };
    let _g = serial();
    let tmp = tempfile::tempdir().unwrap();
    let foreign = tmp.path().join("foreign.czr");
    {
        let mut f = Workload::start(Spec { mib: 8, pattern: "text", ..Default::default() });
        dump_to(&f, &foreign, &["--leave-running"]);
        f.stop();
    }
    let mut w = Workload::start(Spec { mib: 8, pattern: "text", ..Default::default() });
    let before = w.sums();
    let arc = tmp.path().join("good.czr");
    dump_to(&w, &arc, &[]);
    w.reap_original();
    let good = std::fs::read(&arc).unwrap();
    let dirs_before = restore_dirs();

    for (what, bytes) in variants(&good, &std::fs::read(&foreign).unwrap()) {
        let bad = tmp.path().join("bad.czr");
        std::fs::write(&bad, &bytes).unwrap();
        let out = criuz(&["restore", "-d", "-i", bad.to_str().unwrap()]);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(3), "{what}: restore from a file must fail as damaged: {err}");
        assert!(err.contains(bad.to_str().unwrap()), "{what}: the error must name the archive: {err}");
        assert!(!w.alive(), "{what}: a process runs after a failed restore");

        let out = restore_from_pipe(&bad);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(3), "{what}: restore from a pipe must fail as damaged: {err}");
        assert!(!w.alive(), "{what}: a process runs after a failed pipe restore");

        // Lazily the tree runs once CRIU restored it: what the walk finds
        // (beside CRIU) must stop it before (a tree killed for damage found
        // behind it is dead too).
        let out = criuz(&["restore", "--lazy", "-d", "-i", bad.to_str().unwrap()]);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(3), "{what}: a lazy restore must fail as damaged: {err}");
        if what.starts_with("index and block table") {
            // Each block passes its own checks: the tree must not have run.
            assert!(
                err.contains("before the restored tree ran") && !err.contains("restored tree killed"),
                "{what}: the lazy tree ran before the walk refused it: {err}"
            );
        }
        reap_zombies();
        assert!(!w.alive(), "{what}: a process runs after a failed lazy restore");

        let out = criuz(&["verify", bad.to_str().unwrap()]);
        assert_eq!(out.status.code(), Some(3), "{what}: verify must reject it");
    }
    assert_eq!(restore_dirs(), dirs_before, "failed restores left work directories behind");

    let out = criuz(&["restore", "-d", "-i", arc.to_str().unwrap()]);
    assert!(out.status.success(), "the undamaged archive must restore: {}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(w.sums(), before, "restored memory differs");
    w.stop();
}

/// Byte-planes blocks (bf16 memory, version 3) crafted by someone who
/// recomputes every check but the data check the seal covers: a byte of the
/// raw low plane changed, the prefix's "compressed" bits or plane length
/// changed, the codec changed from zstd planes to LZ4 planes. Restored from
/// a file, from a pipe and lazily, each fails as damaged (exit 3) and no
/// process runs on the result; the undamaged archive restores intact.
#[test]
fn crafted_byte_planes_blocks_never_restore_wrong_memory() {
    let Some(_criu) = criu() else { return };
    let _g = serial();
    let tmp = tempfile::tempdir().unwrap();
    let mut w = Workload::start(Spec { mib: 8, pattern: "bf16", ..Default::default() });
    let before = w.sums();
    let arc = tmp.path().join("good.czr");
    let pid = w.pid.to_string();
    let out = criuz(&["dump", "-t", &pid, "-o", arc.to_str().unwrap(), "--codec", "zstd"]);
    assert!(out.status.success(), "criuz dump: {}", String::from_utf8_lossy(&out.stderr));
    w.reap_original();
    let good = std::fs::read(&arc).unwrap();
    let block = records(&good)
        .into_iter()
        .find(|r| r.kind == b'B' && good[r.start + 1] == 5)
        .expect("a zstd byte-planes block");
    let payload = block.start + block.header_len + 4;
    let craft = |edit: &dyn Fn(&mut Vec<u8>)| {
        let mut v = good.clone();
        edit(&mut v);
        let check = xxhash_rust::xxh3::xxh3_64(&v[payload..block.start + block.len]) as u32;
        v[block.start + 24..block.start + 28].copy_from_slice(&check.to_le_bytes());
        reseal(&mut v, Reseal::All);
        v
    };
    // The control: crafted without an edit, the archive still verifies, so
    // what the variants below are refused for is their edit.
    let control = tmp.path().join("control.czr");
    std::fs::write(&control, craft(&|_| {})).unwrap();
    assert_eq!(criuz(&["verify", control.to_str().unwrap()]).status.code(), Some(0), "the resealing itself breaks");
    let variants: Vec<(&str, Vec<u8>)> = vec![
        ("a byte of the raw low plane", craft(&|v| v[payload + 8 + 100] ^= 0x10)),
        ("the low plane marked compressed", craft(&|v| v[payload + 4] ^= 1)),
        ("the high plane marked raw", craft(&|v| v[payload + 4] ^= 2)),
        ("the low plane one byte longer", craft(&|v| v[payload] = v[payload].wrapping_add(1))),
        ("LZ4 planes in place of zstd planes", craft(&|v| v[block.start + 1] = 4)),
    ];
    for (what, bytes) in variants {
        let bad = tmp.path().join("bad.czr");
        std::fs::write(&bad, &bytes).unwrap();
        for how in [&["-d"][..], &["-d", "--lazy"]] {
            let mut args = vec!["restore", "-i", bad.to_str().unwrap()];
            args.extend_from_slice(how);
            let out = criuz(&args);
            let err = String::from_utf8_lossy(&out.stderr);
            assert_eq!(out.status.code(), Some(3), "{what} {how:?}: must fail as damaged: {err}");
            wait_for("the crafted restore's tree to be gone", std::time::Duration::from_secs(10), || !w.alive());
            reap_zombies();
        }
        let out = restore_from_pipe(&bad);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(3), "{what}: restore from a pipe must fail as damaged: {err}");
        assert!(!w.alive(), "{what}: a process runs after a failed pipe restore");
        assert_eq!(criuz(&["verify", bad.to_str().unwrap()]).status.code(), Some(3), "{what}: verify must reject it");
    }
    let out = criuz(&["restore", "-d", "-i", arc.to_str().unwrap()]);
    assert!(out.status.success(), "the undamaged archive must restore: {}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(w.sums(), before, "restored memory differs");
    w.stop();
}

/// Where the references of a tree's archive point: a child's dedup block
/// names pages of its parent's pages image. Crafted by someone who re-points
/// a reference at other real pages (one page back in the same block, or the
/// same pages of another block of the same size) and recomputes every check
/// but the block's data check: the reference resolves, only the pages it
/// yields are wrong. Restored streamed (a tree's default), placed, lazily and
/// from a pipe, each fails as damaged (exit 3) and no process of the tree
/// runs; the undamaged archive restores every process intact.
#[test]
fn crafted_references_in_a_tree_archive_never_restore_wrong_memory() {
    let Some(_criu) = criu() else { return };
    let _g = serial();
    let tmp = tempfile::tempdir().unwrap();
    // Random pages: no two equal, so a reference moved anywhere yields
    // other bytes.
    let mut w = Workload::start(Spec { mib: 8, pattern: "random", mode: "tree", children: 2, ..Default::default() });
    let before = w.sums();
    let arc = tmp.path().join("good.czr");
    dump_to(&w, &arc, &[]);
    w.reap_original();
    let good = std::fs::read(&arc).unwrap();
    let recs = records(&good);
    let u32_at = |at: usize| u32::from_le_bytes(good[at..at + 4].try_into().unwrap());
    // The blocks of a file in order (a reference names the block's index).
    let file_blocks = |id: u32| -> Vec<Rec> {
        recs.iter().copied().filter(|r| r.kind == b'B' && u32_at(r.start + 4) == id).collect()
    };
    // A reference into an ordinary block that can move one page back, and
    // another ordinary block of the same size to move it to.
    let mut found = None;
    'blocks: for x in recs.iter().filter(|r| r.kind == b'B' && good[r.start + 1] == 3) {
        let payload = x.start + x.header_len + 4;
        for i in 0..u32_at(payload) as usize {
            let at = payload + 4 + 20 * i;
            let (source, file, block, first) = (&good[at..at + 2], u32_at(at + 4), u32_at(at + 8), u32_at(at + 12));
            if source != [0, 0] || first == 0 {
                continue;
            }
            let targets = file_blocks(file);
            let target = targets[block as usize];
            let other = targets.iter().position(|t| {
                t.start != target.start && good[t.start + 1] != 3 && u32_at(t.start + 8) == u32_at(target.start + 8)
            });
            if let (true, Some(other)) = (good[target.start + 1] != 3, other) {
                found = Some((*x, at, other as u32));
                break 'blocks;
            }
        }
    }
    let (x, extent, other) = found.expect("a child's reference to its parent's pages");
    let craft = |edit: &dyn Fn(&mut Vec<u8>)| {
        let mut v = good.clone();
        edit(&mut v);
        let payload = x.start + x.header_len + 4;
        let check = xxhash_rust::xxh3::xxh3_64(&v[payload..x.start + x.len]) as u32;
        v[x.start + 24..x.start + 28].copy_from_slice(&check.to_le_bytes());
        reseal(&mut v, Reseal::All);
        v
    };
    let control = tmp.path().join("control.czr");
    std::fs::write(&control, craft(&|_| {})).unwrap();
    assert_eq!(criuz(&["verify", control.to_str().unwrap()]).status.code(), Some(0), "the resealing itself breaks");
    let first = u32_at(extent + 12);
    let variants: Vec<(&str, Vec<u8>)> = vec![
        (
            "a reference moved one page back",
            craft(&|v| v[extent + 12..extent + 16].copy_from_slice(&(first - 1).to_le_bytes())),
        ),
        (
            "a reference moved to another block",
            craft(&|v| v[extent + 8..extent + 12].copy_from_slice(&other.to_le_bytes())),
        ),
    ];
    let tree_gone = |w: &Workload| w.pids.iter().all(|p| process_state(*p).is_none_or(|s| s == 'Z'));
    for (what, bytes) in variants {
        let bad = tmp.path().join("bad.czr");
        std::fs::write(&bad, &bytes).unwrap();
        let out = criuz(&["verify", bad.to_str().unwrap()]);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(3), "{what}: verify must reject it");
        assert!(
            err.contains("checksum mismatch after resolving"),
            "{what}: the reference must resolve, its pages be wrong: {err}"
        );
        for how in [&["-d"][..], &["-d", "--fill", "place"], &["-d", "--lazy"]] {
            let mut args = vec!["restore", "-i", bad.to_str().unwrap()];
            args.extend_from_slice(how);
            let out = criuz(&args);
            let err = String::from_utf8_lossy(&out.stderr);
            assert_eq!(out.status.code(), Some(3), "{what} {how:?}: must fail as damaged: {err}");
            wait_for("the crafted restore's tree to be gone", std::time::Duration::from_secs(10), || {
                reap_zombies();
                tree_gone(&w)
            });
        }
        let out = restore_from_pipe(&bad);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(3), "{what}: restore from a pipe must fail as damaged: {err}");
        reap_zombies();
        assert!(tree_gone(&w), "{what}: a process runs after a failed pipe restore");
    }
    let out = criuz(&["restore", "-d", "-i", arc.to_str().unwrap()]);
    assert!(out.status.success(), "the undamaged archive must restore: {}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(w.sums(), before, "restored memory differs");
    w.stop();
}

/// The archive `arc` unpacked into `tmp/img`, edited there by `edit`, and
/// packed again: an archive whose every check holds.
fn repacked(tmp: &Path, arc: &Path, edit: impl FnOnce(&Path)) -> std::path::PathBuf {
    let dir = tmp.join("img");
    let out = criuz(&["unpack", arc.to_str().unwrap(), "-D", dir.to_str().unwrap()]);
    assert!(out.status.success(), "unpack: {}", String::from_utf8_lossy(&out.stderr));
    edit(&dir);
    let crafted = tmp.join("crafted.czr");
    let out = criuz(&["pack", dir.to_str().unwrap(), "-o", crafted.to_str().unwrap()]);
    assert!(out.status.success(), "pack: {}", String::from_utf8_lossy(&out.stderr));
    crafted
}

/// `--fill place` and `--lazy` must refuse `crafted` before anything runs,
/// and the default restore stream it through CRIU (criuz places and
/// rewrites only pagemaps as CRIU writes them).
fn refused_placed_then_streamed(crafted: &Path, w: &Workload) {
    let c = crafted.to_str().unwrap();
    for how in [&["--fill", "place"][..], &["--lazy"]] {
        let out = criuz(&[&["restore", "-d", "-i", c][..], how].concat());
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains("pagemap not understood") && err.contains("hands it to CRIU"), "{how:?}: {err}");
        // Not a damaged archive: the default restore takes it.
        assert_eq!(out.status.code(), Some(2), "{how:?}: must not place it: {err}");
        reap_zombies();
        assert!(!w.alive(), "{how:?}: a process runs after a refused restore");
    }
    let out = criuz(&["restore", "-d", "-i", c]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success() && err.contains("streamed through CRIU"), "the default restore streams it: {err}");
}

/// A process of 8 MiB of random memory dumped, and its images repacked
/// after `edit` rewrote its pagemap (given CRIU's runs and the process's
/// /proc/PID/maps at the dump, returning the runs to write: (run, its
/// flags, a copy of its first page to list after it)), each such copy's
/// 0xab page inserted into the pages image after the run's pages; then
/// restored as [`refused_placed_then_streamed`] wants. Returns the restored
/// workload and its memory's sums before the dump.
fn restored_after_pagemap_edit(
    tmp: &Path,
    mut edit: impl FnMut(&[criuz::criu::images::PageRun], &str) -> Vec<(criuz::criu::images::PageRun, u32, bool)>,
) -> (Workload, std::collections::BTreeMap<String, String>) {
    use criuz::criu::images::{pagemap_runs, PagemapBuilder};
    let mut w = Workload::start(Spec { mib: 8, pattern: "random", ..Default::default() });
    let before = w.sums();
    let maps = std::fs::read_to_string(format!("/proc/{}/maps", w.pid)).unwrap();
    let arc = tmp.join("good.czr");
    dump_to(&w, &arc, &[]);
    w.reap_original();
    let crafted = repacked(tmp, &arc, |dir| {
        let pagemap = dir.join(format!("pagemap-{}.img", w.pid));
        let (pages_id, runs) = pagemap_runs(&std::fs::read(&pagemap).unwrap()).expect("CRIU's own pagemap");
        let pages = dir.join(format!("pages-{pages_id}.img"));
        let mut bytes = std::fs::read(&pages).unwrap();
        let mut pm = PagemapBuilder::new(pages_id);
        let mut inserted = 0;
        for (r, flags, twice) in edit(&runs, &maps) {
            pm.push(r.vaddr, r.nr, flags);
            if twice {
                pm.push(r.vaddr, 1, flags);
                let at = ((r.first + r.nr + inserted) * 4096) as usize;
                bytes.splice(at..at, [0xab; 4096]);
                inserted += 1;
            }
        }
        std::fs::write(&pagemap, pm.finish()).unwrap();
        std::fs::write(&pages, bytes).unwrap();
    });
    refused_placed_then_streamed(&crafted, &w);
    (w, before)
}

/// Bytes of the restored process `pid` at `vaddr`.
fn memory_of(pid: i32, vaddr: u64, len: usize) -> Vec<u8> {
    let mut seen = vec![0u8; len];
    let mem = std::fs::File::open(format!("/proc/{pid}/mem")).unwrap();
    std::os::unix::fs::FileExt::read_exact_at(&mem, &mut seen, vaddr).unwrap();
    seen
}

fn flags_of(r: &criuz::criu::images::PageRun) -> u32 {
    use criuz::criu::images::pe;
    if r.lazy {
        pe::PRESENT | pe::LAZY
    } else {
        pe::PRESENT
    }
}

/// A pagemap crafted to list one page twice. CRIU's reading restores the
/// second copy; a placement by userfaultfd would keep the first (and
/// leaving out a zero copy would unmask the other).
#[test]
fn a_pagemap_listing_a_page_twice_is_left_to_criu() {
    let Some(_criu) = criu() else { return };
    let _g = serial();
    let tmp = tempfile::tempdir().unwrap();
    let mut twice = None;
    let (mut w, before) = restored_after_pagemap_edit(tmp.path(), |runs, _| {
        // The longest run: the workload's data. Not told by its lazy flag,
        // which CRIU leaves off every page in about one dump in 256 (its
        // stack test, `criu::images::lazy_marks`).
        let longest = *runs.iter().max_by_key(|r| r.nr).expect("a run");
        twice = Some(longest);
        runs.iter().map(|r| (*r, flags_of(r), *r == longest)).collect()
    });
    let twice = twice.unwrap();
    assert_eq!(memory_of(w.pid, twice.vaddr, 4096), [0xab; 4096], "the page holds CRIU's reading: its second copy");
    assert_ne!(w.sums(), before, "the process sees the page the archive gave it last");
    w.stop();
}

/// A pagemap crafted to flag lazy the pages CRIU stored of file mappings
/// (relocated data of the program and its libraries). CRIU's lazy restore
/// leaves every page flagged lazy to the page server, but registers no
/// userfaultfd over a file mapping: no copy could reach them, and the
/// process would read the file's bytes. CRIU's own reading of the images
/// restores the stored pages.
#[test]
fn a_pagemap_flagging_lazy_a_page_no_userfaultfd_covers_is_left_to_criu() {
    use criuz::criu::images::pe;
    let Some(_criu) = criu() else { return };
    let _g = serial();
    let tmp = tempfile::tempdir().unwrap();
    let mut flagged = Vec::new();
    let (mut w, before) = restored_after_pagemap_edit(tmp.path(), |runs, maps| {
        let files: Vec<(u64, u64)> = maps
            .lines()
            .filter(|l| l.split_whitespace().nth(5).is_some_and(|p| p.starts_with('/')))
            .filter_map(|l| {
                let (s, e) = l.split_whitespace().next()?.split_once('-')?;
                Some((u64::from_str_radix(s, 16).ok()?, u64::from_str_radix(e, 16).ok()?))
            })
            .collect();
        assert!(!files.is_empty(), "the dumped process maps files");
        runs.iter()
            .map(|r| {
                let in_file = files.iter().any(|&(s, e)| s <= r.vaddr && r.vaddr < e);
                if in_file && !r.lazy {
                    flagged.push(*r);
                    (*r, pe::PRESENT | pe::LAZY, false)
                } else {
                    (*r, flags_of(r), false)
                }
            })
            .collect()
    });
    assert!(!flagged.is_empty(), "CRIU stored pages of file mappings");
    let stored = std::fs::read(tmp.path().join("img").join(format!(
        "pages-{}.img",
        criuz::criu::images::pagemap_runs(
            &std::fs::read(tmp.path().join("img").join(format!("pagemap-{}.img", w.pid))).unwrap()
        )
        .unwrap()
        .0
    )))
    .unwrap();
    for r in &flagged {
        let at = (r.first * 4096) as usize;
        let want = &stored[at..at + (r.nr * 4096) as usize];
        assert!(memory_of(w.pid, r.vaddr, want.len()) == want, "{:#x}: the pages the archive stored", r.vaddr);
    }
    assert_eq!(w.sums(), before, "restored memory differs");
    w.stop();
}

/// Two processes' pagemaps naming one pages image: a forked child's
/// pagemap replaced by its parent's. CRIU gives each the pages its own
/// pagemap lists, from the start of that image; criuz, which writes each
/// process's image for CRIU with only its eager pages, kept one of the two
/// and let the other process run on zeros (it died).
#[test]
fn two_pagemaps_naming_one_pages_image_are_left_to_criu() {
    use criuz::criu::images::pagemap_runs;
    let Some(_criu) = criu() else { return };
    let _g = serial();
    let tmp = tempfile::tempdir().unwrap();
    let mut w = Workload::start(Spec { mib: 8, pattern: "random", mode: "tree", children: 1, ..Default::default() });
    w.sums();
    let arc = tmp.path().join("good.czr");
    dump_to(&w, &arc, &[]);
    w.reap_original();
    let root = w.pid;
    let child = *w.pids.iter().find(|&&p| p != root).expect("the child's pid");
    let crafted = repacked(tmp.path(), &arc, |dir| {
        let root_pagemap = dir.join(format!("pagemap-{root}.img"));
        std::fs::copy(root_pagemap, dir.join(format!("pagemap-{child}.img"))).unwrap();
    });
    refused_placed_then_streamed(&crafted, &w);
    // Both processes hold the workload's data the pagemap lists as its
    // pages image stores it (the long runs; the child runs on its parent's
    // memory, its stack among it, as CRIU reads the images: what it does
    // then is not asked, and what either writes since is not compared).
    let img = tmp.path().join("img");
    let (pages_id, runs) = pagemap_runs(&std::fs::read(img.join(format!("pagemap-{root}.img"))).unwrap()).unwrap();
    let stored = std::fs::read(img.join(format!("pages-{pages_id}.img"))).unwrap();
    // Told by length, not by the lazy flag, which CRIU leaves off every
    // page in about one dump in 256 (its stack test, `criu::images::lazy_marks`;
    // CI met it, session 88): the stack and heap run a few pages.
    let data: Vec<_> = runs.iter().filter(|r| r.nr >= 256).collect();
    assert!(data.iter().map(|r| r.nr).sum::<u64>() >= 1024, "the workload's 8 MiB in long runs: {runs:x?}");
    for pid in [root, child] {
        for r in &data {
            let at = (r.first * 4096) as usize;
            let want = &stored[at..at + (r.nr * 4096) as usize];
            assert!(memory_of(pid, r.vaddr, want.len()) == want, "{pid} at {:#x}: the pages stored", r.vaddr);
        }
    }
    for pid in [child, root] {
        // SAFETY: the restored processes of our own workload.
        unsafe { libc::kill(pid, libc::SIGKILL) };
    }
    w.reap_original();
}

/// A decoy beside a pages image, under a name CRIU never opens
/// (`pages-01.img` beside `pages-1.img`), holding other bytes, with or
/// without a decoy pagemap (`pagemap-0N.img` beside `pagemap-N.img`).
/// criuz took the decoy's pages for the process's lazy ones (by hand: CRIU
/// failed on the eager pages, "vdso: Invalid ELF magic"; where they line
/// up, the process gets the decoy's bytes). Every path must restore the
/// process's own memory.
#[test]
fn decoy_images_under_names_criu_never_opens_are_ignored() {
    use criuz::criu::images::pagemap_pages_id;
    let Some(_criu) = criu() else { return };
    let _g = serial();
    for decoy_pagemap in [false, true] {
        let tmp = tempfile::tempdir().unwrap();
        let mut w = Workload::start(Spec { mib: 8, pattern: "random", ..Default::default() });
        let before = w.sums();
        let arc = tmp.path().join("good.czr");
        dump_to(&w, &arc, &[]);
        w.reap_original();
        let pid = w.pid;
        let crafted = repacked(tmp.path(), &arc, |dir| {
            let pagemap = std::fs::read(dir.join(format!("pagemap-{pid}.img"))).unwrap();
            let id = pagemap_pages_id(&pagemap).unwrap();
            let len = std::fs::metadata(dir.join(format!("pages-{id}.img"))).unwrap().len() as usize;
            std::fs::write(dir.join(format!("pages-0{id}.img")), vec![0xcd; len]).unwrap();
            if decoy_pagemap {
                std::fs::write(dir.join(format!("pagemap-0{pid}.img")), &pagemap).unwrap();
            }
        });
        let c = crafted.to_str().unwrap();
        for how in [&[][..], &["--fill", "place"], &["--lazy"]] {
            let out = criuz(&[&["restore", "-d", "-i", c][..], how].concat());
            let err = String::from_utf8_lossy(&out.stderr);
            assert!(out.status.success(), "{how:?}, decoy pagemap {decoy_pagemap}: {err}");
            assert_eq!(w.sums(), before, "{how:?}, decoy pagemap {decoy_pagemap}: restored memory differs");
            w.kill_and_reap();
        }
    }
}

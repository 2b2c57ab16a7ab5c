//! Real CRIU, offline path: criu dump -D, criuz pack, verify, unpack, criu
//! restore -D; the restored processes report the checksums they had.

// Tests start processes of their own; clippy.toml's rule is for the
// programs criuz runs.
#![allow(clippy::disallowed_methods)]

mod common;
use common::*;

fn pack_roundtrip(spec: Spec, pack_args: &[&str]) {
    let Some(criu) = criu() else { return };
    let _g = serial();
    let mut w = Workload::start(spec);
    let before = w.sums();
    let work = tempfile::tempdir().unwrap();
    let (img, img2, arc) = (work.path().join("img"), work.path().join("img2"), work.path().join("ckpt.czr"));
    criu_dump(&criu, w.pid, &img, &[]);
    w.reap_original();
    assert!(!w.alive(), "criu dump should have ended the original");

    let mut args = vec!["pack", img.to_str().unwrap(), "-o", arc.to_str().unwrap()];
    args.extend_from_slice(pack_args);
    let out = criuz(&args);
    assert!(out.status.success(), "pack: {}", String::from_utf8_lossy(&out.stderr));
    let out = criuz(&["verify", arc.to_str().unwrap()]);
    assert!(out.status.success(), "verify: {}", String::from_utf8_lossy(&out.stderr));
    let out = criuz(&["unpack", arc.to_str().unwrap(), "-d", img2.to_str().unwrap()]);
    assert!(out.status.success(), "unpack: {}", String::from_utf8_lossy(&out.stderr));

    for e in std::fs::read_dir(&img).unwrap() {
        let e = e.unwrap();
        let a = std::fs::read(e.path()).unwrap();
        let b = std::fs::read(img2.join(e.file_name())).unwrap();
        assert!(a == b, "{:?} differs after pack/unpack", e.file_name());
    }
    criu_restore(&criu, &img2);
    assert_eq!(w.sums(), before, "restored memory differs from the checkpointed memory");
    w.stop();
}

#[test]
fn zero_pattern_lz4() {
    pack_roundtrip(Spec { pattern: "zero", ..Default::default() }, &["--codec", "lz4"]);
}

#[test]
fn mixed_pattern_zstd() {
    pack_roundtrip(Spec { pattern: "mixed", ..Default::default() }, &["--codec", "zstd", "--level", "3"]);
}

#[test]
fn random_pattern_lz4_small_blocks() {
    pack_roundtrip(Spec { pattern: "random", ..Default::default() }, &["--codec", "lz4", "--block-size", "4K"]);
}

#[test]
fn text_pattern_zstd_fast_big_blocks() {
    pack_roundtrip(
        Spec { pattern: "text", ..Default::default() },
        &["--codec", "zstd", "--level", "-3", "--block-size", "4M"],
    );
}

#[test]
fn elf_pattern_lz4() {
    pack_roundtrip(Spec { pattern: "elf", ..Default::default() }, &["-j", "1"]);
}

#[test]
fn process_tree_with_cow_pages() {
    pack_roundtrip(Spec { mode: "tree", children: 3, ..Default::default() }, &[]);
}

#[test]
fn multi_threaded_process() {
    pack_roundtrip(Spec { mode: "threads", ..Default::default() }, &["--codec", "zstd"]);
}

/// A `criuz dump` archive as a tar, from a file and from a pipe. A
/// self-contained archive is read front to back, where its files
/// interleave (a pages image is written alongside the others), and
/// `unpack --tar` called every such archive damaged ("data outside a
/// file", exit 3). A file, and a tree whose processes share pages (its
/// pages have ids), is read file by file. The tar must hold what `unpack
/// -d` writes, and CRIU must restore from it.
#[test]
fn a_dump_archive_unpacks_to_a_tar_that_criu_restores() {
    let Some(criu) = criu() else { return };
    let _g = serial();
    for spec in [Spec::default(), Spec { mode: "tree", children: 2, ..Default::default() }] {
        tar_round_trip(&criu, spec);
    }
}

fn tar_round_trip(criu: &std::path::Path, spec: Spec) {
    let mut w = Workload::start(spec);
    let before = w.sums();
    let work = tempfile::tempdir().unwrap();
    let at = |n: &str| work.path().join(n);
    let p = |b: &std::path::PathBuf| b.to_str().unwrap().to_string();
    let out = criuz(&["dump", "-t", &w.pid.to_string(), "-o", &p(&at("a.czr"))]);
    assert!(out.status.success(), "dump: {}", String::from_utf8_lossy(&out.stderr));
    w.reap_original();
    // From a file it is read through its index, each size known before
    // the file's bytes: nothing is spooled to $TMPDIR (here none at all).
    let out = std::process::Command::new(CRIUZ)
        .args(["unpack", &p(&at("a.czr")), "--tar", &p(&at("a.tar"))])
        .env("TMPDIR", at("no-such-dir"))
        .output()
        .unwrap();
    assert!(out.status.success(), "unpack --tar: {}", String::from_utf8_lossy(&out.stderr));
    let piped = std::process::Command::new(CRIUZ)
        .args(["unpack", "-", "--tar", "-"])
        .stdin(std::fs::File::open(at("a.czr")).unwrap())
        .output()
        .unwrap();
    assert!(piped.status.success(), "unpack - --tar -: {}", String::from_utf8_lossy(&piped.stderr));
    let out = criuz(&["unpack", &p(&at("a.czr")), "-d", &p(&at("dir"))]);
    assert!(out.status.success(), "unpack -d: {}", String::from_utf8_lossy(&out.stderr));
    let from_file = at("from-file");
    tar::Archive::new(std::fs::File::open(at("a.tar")).unwrap()).unpack(&from_file).unwrap();
    tar::Archive::new(&piped.stdout[..]).unpack(at("from-pipe")).unwrap();
    let names = |d: &std::path::Path| {
        let mut v: Vec<_> = std::fs::read_dir(d).unwrap().map(|e| e.unwrap().file_name()).collect();
        v.sort();
        v
    };
    let want = names(&at("dir"));
    assert!(want.iter().any(|n| n.to_string_lossy().starts_with("pages-")), "{want:?}");
    for d in [&from_file, &at("from-pipe")] {
        assert_eq!(names(d), want, "{}", d.display());
        for n in &want {
            let (a, b) = (std::fs::read(at("dir").join(n)).unwrap(), std::fs::read(d.join(n)).unwrap());
            assert!(a == b, "{n:?} in {} differs from unpack -d", d.display());
        }
    }
    criu_restore(criu, &from_file);
    assert_eq!(w.sums(), before, "restored from the tar, memory differs");
    w.stop();
}

//! Real CRIU, offline path: criu dump -D, criuz pack, verify, unpack, criu
//! restore -D; the restored processes report the checksums they had.

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

//! Incremental checkpoints with real CRIU: a child archive stores only what
//! changed since its parent; restores of a child and of a chain of three come
//! back with the processes' own checksums; a missing, wrong or replaced
//! parent fails before CRIU starts, a damaged or truncated one before any
//! process runs; flatten gives a self-contained
//! archive; identical pages across a process tree are stored once.

// Tests start processes of their own; clippy.toml's rule is for the
// programs criuz runs.
#![allow(clippy::disallowed_methods)]

mod common;
#[path = "../fuzz/src/mutate.rs"]
mod mutate;

use common::*;
use std::path::Path;
use std::process::{Command, Stdio};

fn ok(out: std::process::Output, what: &str) -> std::process::Output {
    assert!(out.status.success(), "{what} failed: {}", String::from_utf8_lossy(&out.stderr));
    out
}

fn dump(w: &Workload, arc: &Path, extra: &[&str]) {
    let pid = w.pid.to_string();
    let mut args = vec!["dump", "-t", &pid, "-o", arc.to_str().unwrap()];
    args.extend_from_slice(extra);
    ok(criuz(&args), "criuz dump");
}

fn inspect(arc: &Path) -> serde_json::Value {
    let out = ok(criuz(&["inspect", "--json", arc.to_str().unwrap()]), "criuz inspect");
    serde_json::from_slice(&out.stdout).unwrap()
}

fn size(p: &Path) -> u64 {
    std::fs::metadata(p).unwrap().len()
}

#[test]
fn child_and_chain_of_three_restore_intact_and_flatten() {
    let Some(_criu) = criu() else { return };
    let _g = serial();
    let tmp = tempfile::tempdir().unwrap();
    let (full, inc1, inc2) = (tmp.path().join("full.czr"), tmp.path().join("inc1.czr"), tmp.path().join("inc2.czr"));
    let mut w = Workload::start(Spec { mib: 32, pattern: "mixed", ..Default::default() });
    dump(&w, &full, &["--leave-running"]);
    w.rewrite(5.0, 1);
    dump(&w, &inc1, &["--leave-running", "--parent", full.to_str().unwrap()]);
    w.rewrite(5.0, 2);
    let before = w.sums();
    dump(&w, &inc2, &["--parent", inc1.to_str().unwrap()]);
    w.reap_original();

    // 5% of 32 MiB rewritten with random bytes: about 1.6 MiB that cannot
    // compress; the rest must be references.
    let rewritten = (32u64 << 20) / 20;
    for child in [&inc1, &inc2] {
        assert!(size(child) < rewritten * 11 / 10 + (1 << 20), "{} is {} bytes", child.display(), size(child));
    }
    let rep = inspect(&inc2);
    assert_eq!(rep["chain"].as_array().unwrap().len(), 2, "{rep}");
    assert_eq!(rep["chain"][0]["hint"], "inc1.czr");
    assert!(rep["total"]["referenced_bytes"].as_u64().unwrap() > 10 << 20, "{rep}");
    // Most pages are found in the grandparent through its own page ids (inc1
    // lists only the pages it stores: about 16 bytes for each of the 5%
    // rewritten, not for every page).
    assert!(rep["chain"][1]["referenced_bytes"].as_u64().unwrap() > 10 << 20, "{rep}");
    let all_pages_ids = (32u64 << 20) / 4096 * 16;
    for child in [&inc1, &inc2] {
        let ids = inspect(child)["page_id_bytes"].as_u64().unwrap();
        assert!(ids > 0 && ids < all_pages_ids / 4, "{}: {ids} bytes of page ids", child.display());
    }
    ok(criuz(&["verify", inc2.to_str().unwrap()]), "verify of a child with its chain");

    // An id that names other bytes, with every check over it recomputed:
    // nothing restores from ids, but a child written against it would refer
    // to the wrong pages, so verify must find it.
    let lying = tmp.path().join("lying.czr");
    let mut bytes = std::fs::read(&inc1).unwrap();
    let p = mutate::records(&bytes).into_iter().find(|r| r.kind == b'P' && r.len > 24).expect("a P record with ids");
    bytes[p.start + 16] ^= 0x01;
    mutate::reseal(&mut bytes, mutate::Reseal::Seals);
    std::fs::write(&lying, &bytes).unwrap();
    let out = criuz(&["verify", lying.to_str().unwrap(), "--parent", full.to_str().unwrap()]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(3), "verify must reject a lying page id: {err}");
    assert!(err.contains("lying.czr") && err.contains("page ids do not match"), "{err}");
    std::fs::remove_file(&lying).unwrap();

    ok(criuz(&["restore", "-d", "-i", inc2.to_str().unwrap()]), "restore of a chain of three");
    assert_eq!(w.sums(), before, "memory restored from the chain differs");
    w.stop();

    let flat = tmp.path().join("flat.czr");
    ok(criuz(&["flatten", inc2.to_str().unwrap(), "-o", flat.to_str().unwrap()]), "flatten");
    let rep = inspect(&flat);
    assert!(rep["chain"].as_array().unwrap().is_empty() && rep["page_ids"] == false, "{rep}");
    // The flat archive stands alone: restore it with the parents gone.
    std::fs::remove_file(&full).unwrap();
    std::fs::remove_file(&inc1).unwrap();
    w.reap_original();
    ok(criuz(&["restore", "-d", "-i", flat.to_str().unwrap()]), "restore of the flattened archive");
    assert_eq!(w.sums(), before, "memory restored from the flattened archive differs");
    w.stop();
}

#[test]
fn missing_wrong_replaced_and_damaged_parents_fail_before_criu() {
    let Some(_criu) = criu() else { return };
    let _g = serial();
    let tmp = tempfile::tempdir().unwrap();
    let (full, child) = (tmp.path().join("full.czr"), tmp.path().join("child.czr"));
    let other = tmp.path().join("other.czr");
    {
        let o = Workload::start(Spec { mib: 8, pattern: "text", ..Default::default() });
        dump(&o, &other, &["--leave-running"]);
    }
    let mut w = Workload::start(Spec { mib: 16, pattern: "text", ..Default::default() });
    dump(&w, &full, &["--leave-running"]);
    w.rewrite(5.0, 3);
    let before = w.sums();
    dump(&w, &child, &["--parent", full.to_str().unwrap()]);
    w.reap_original();
    let c = child.to_str().unwrap();

    // Missing: moved away.
    let moved = tmp.path().join("moved");
    std::fs::create_dir(&moved).unwrap();
    std::fs::rename(&full, moved.join("full.czr")).unwrap();
    let out = criuz(&["restore", "-d", "-i", c]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("parent archive") && err.contains("not found"), "{err}");
    assert!(!w.alive());

    // Wrong: an archive that is no parent of it.
    let out = criuz(&["restore", "-d", "-i", c, "--parent", other.to_str().unwrap()]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(3), "{err}");
    assert!(err.contains("is not a parent"), "{err}");

    // Named wrongly: no such file, a directory, a pipe (a parent is read at
    // random). Bad arguments (exit 2), not damage (they were exit 3).
    let named_wrongly = [
        (tmp.path().join("no-such.czr"), "no such file"),
        (moved.clone(), "a directory"),
        ("/dev/stdin".into(), "a stream"),
    ];
    for (parent, says) in named_wrongly {
        let out = Command::new(CRIUZ)
            .args(["restore", "-d", "-i", c, "--parent", parent.to_str().unwrap()])
            .stdin(std::fs::File::open(moved.join("full.czr")).unwrap())
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{}: {err}", parent.display());
        assert!(err.contains("--parent") && err.contains(says), "{err}");
        assert!(!w.alive());
    }
    // Not found, with a --parent-dir that is not there: that is said.
    let out = criuz(&["restore", "-d", "-i", c, "--parent-dir", tmp.path().join("no-such-dir").to_str().unwrap()]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains("--parent-dir") && err.contains("no-such-dir: no such directory"), "{err}");

    // Replaced: another archive at the parent's place.
    std::fs::copy(&other, &full).unwrap();
    let out = criuz(&["restore", "-d", "-i", c]);
    assert_eq!(out.status.code(), Some(1), "{}", String::from_utf8_lossy(&out.stderr));
    std::fs::remove_file(&full).unwrap();

    // Damaged: a byte in the payload of the parent's middle page image block
    // (all but 5% of it is referenced); the structure stays intact, so this
    // is found while the blocks are served, after CRIU has started.
    let parent = moved.join("full.czr");
    let good = std::fs::read(&parent).unwrap();
    let pages: Vec<_> = mutate::records(&good)
        .into_iter()
        .filter(|r| r.kind == b'B' && good[r.start + 2] & 1 != 0 && r.len > r.header_len + 4 + 4096)
        .collect();
    let b = pages[pages.len() / 2];
    let mut bad = good.clone();
    bad[b.start + b.len - 17] ^= 0x10;
    // A restore with `parent` holding `bytes` must fail as damaged, name the
    // parent and leave no process running. CRIU may have got as far as
    // forking the tree; its dead children are ours (subreaper) to reap.
    let fails_naming_parent = |w: &mut Workload, bytes: &[u8], what: &str| {
        std::fs::write(&parent, bytes).unwrap();
        let out = criuz(&["restore", "-d", "-i", c, "--parent-dir", moved.to_str().unwrap()]);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(3), "{what}: {err}");
        assert!(err.contains("full.czr"), "the error must name the {what} parent: {err}");
        assert!(!w.alive(), "a process runs after a restore from a {what} parent");
        w.reap_original();
    };
    fails_naming_parent(&mut w, &bad, "damaged");

    // Truncated: the parent's header (and id) is intact, so it is found
    // before CRIU starts; its walk, which runs while CRIU starts, fails, and
    // CRIU must be stopped before any process runs.
    fails_naming_parent(&mut w, &good[..good.len() - 100], "truncated");

    // Lazily too: the tree, which CRIU leaves stopped, waits for that walk
    // and never runs.
    let out = criuz(&["restore", "--lazy", "-d", "-i", c, "--parent-dir", moved.to_str().unwrap()]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(3), "lazy, truncated parent: {err}");
    assert!(err.contains("full.czr") && !err.contains("restored tree killed"), "lazy, truncated parent: {err}");
    assert!(!w.alive(), "a process runs after a lazy restore from a truncated parent");
    w.reap_original();
    std::fs::write(&parent, &good).unwrap();

    // Found through --parent-dir, and from a pipe.
    let out = Command::new(CRIUZ)
        .args(["restore", "-d", "-i", "-", "--parent-dir", moved.to_str().unwrap()])
        .stdin(std::fs::File::open(&child).unwrap())
        .stdout(Stdio::null())
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(w.sums(), before, "memory restored through --parent-dir differs");
    w.stop();
}

#[test]
fn identical_pages_across_a_process_tree_are_stored_once() {
    let Some(_criu) = criu() else { return };
    let _g = serial();
    let tmp = tempfile::tempdir().unwrap();
    let (plain, ids) = (tmp.path().join("plain.czr"), tmp.path().join("ids.czr"));
    let mut w = Workload::start(Spec {
        mib: 16,
        pattern: "text",
        mode: "tree",
        children: 3,
        same_children: true,
        ..Default::default()
    });
    let before = w.sums();
    dump(&w, &plain, &["--leave-running", "--no-ids"]);
    dump(&w, &ids, &["--ids"]);
    w.reap_original();
    let rep = inspect(&ids);
    assert!(rep["total"]["referenced_bytes"].as_u64().unwrap() > 4 << 20, "{rep}");
    assert!(size(&ids) < size(&plain) * 3 / 4, "{} vs {}", size(&ids), size(&plain));
    ok(criuz(&["restore", "-d", "-i", ids.to_str().unwrap()]), "restore of a tree with shared pages");
    assert_eq!(w.sums(), before, "memory of the tree differs");
    w.stop();
}

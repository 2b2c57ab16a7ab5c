//! Lazy restore with real CRIU (`criu lazy-pages`, criuz as its page
//! server): a process tree restored lazily comes back with every process's
//! own checksum; a damaged block deep inside the archive, found only after
//! the process runs, kills the restored tree (no silent zeros) and fails as
//! damaged.

mod common;
#[path = "../fuzz/src/mutate.rs"]
mod mutate;

use common::*;
use std::path::Path;

fn dump(w: &Workload, arc: &Path) {
    let pid = w.pid.to_string();
    let out = criuz(&["dump", "-t", &pid, "-o", arc.to_str().unwrap()]);
    assert!(out.status.success(), "criuz dump: {}", String::from_utf8_lossy(&out.stderr));
}

#[test]
fn a_tree_restored_lazily_keeps_its_checksums() {
    let Some(_criu) = criu() else { return };
    let _g = serial();
    let tmp = tempfile::tempdir().unwrap();
    let arc = tmp.path().join("tree.czr");
    let mut w = Workload::start(Spec { mib: 48, pattern: "mixed", mode: "tree", ..Default::default() });
    let before = w.sums();
    dump(&w, &arc);
    w.reap_original();

    let out = criuz(&["restore", "--lazy", "-d", "--json", "-i", arc.to_str().unwrap()]);
    assert!(out.status.success(), "lazy restore: {}", String::from_utf8_lossy(&out.stderr));
    let rep: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    // The memory came through the page server, not through CRIU's images.
    let lazy = rep["lazy_pages"].as_u64().unwrap();
    assert!(lazy > (48 << 20) / 4096 / 2, "{rep}");
    assert!(rep["eager_pages"].as_u64().unwrap() < lazy / 10, "{rep}");
    assert_eq!(w.sums(), before, "a lazily restored process sees other memory");
    w.stop();
}

#[test]
fn a_damaged_block_found_after_the_process_runs_kills_it() {
    let Some(_criu) = criu() else { return };
    let _g = serial();
    let tmp = tempfile::tempdir().unwrap();
    let arc = tmp.path().join("one.czr");
    let mut w = Workload::start(Spec { mib: 48, pattern: "mixed", ..Default::default() });
    w.sums();
    dump(&w, &arc);
    w.reap_original();

    // Damage the payload of a page block three quarters in: the daemon
    // fetches it after the restored process already runs.
    let mut bytes = std::fs::read(&arc).unwrap();
    let blocks: Vec<_> = mutate::records(&bytes)
        .into_iter()
        .filter(|r| r.kind == b'B' && bytes[r.start + 2] & 1 != 0 && r.len > r.header_len + 4 + 4096)
        .collect();
    let b = blocks[blocks.len() * 3 / 4];
    bytes[b.start + b.len - 17] ^= 0x10;
    std::fs::write(&arc, &bytes).unwrap();

    let out = criuz(&["restore", "--lazy", "-d", "-i", arc.to_str().unwrap()]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(3), "{err}");
    assert!(err.contains("one.czr") && err.contains("killed"), "{err}");
    // The restored process must be gone (it is ours to reap: subreaper).
    wait_for("the restored process to be killed", std::time::Duration::from_secs(10), || {
        // SAFETY: non-blocking reap of zombies re-parented to us.
        while unsafe { libc::waitpid(-1, std::ptr::null_mut(), libc::WNOHANG) } > 0 {}
        !w.alive()
    });
}

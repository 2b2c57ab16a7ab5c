//! Encrypted checkpoints with real CRIU: an archive encrypted to an age
//! recipient, and one encrypted with a passphrase, restore with the
//! processes' own checksums, from a file and from a pipe; without a key a
//! restore fails as exit 2 (usage), with the wrong one as exit 3, before
//! any process runs;
//! damaged or rearranged ciphertext never restores; an archive written
//! with `--codec none` holds none of the workload's text or file names; an
//! encrypted incremental child shares its parent's key and restores intact.

// Tests start processes of their own; clippy.toml's rule is for the
// programs criuz runs.
#![allow(clippy::disallowed_methods)]

mod common;
#[path = "../fuzz/src/mutate.rs"]
mod mutate;

use common::*;
use mutate::{records, reseal, Rec, Reseal};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

fn ok(out: std::process::Output, what: &str) -> std::process::Output {
    assert!(out.status.success(), "{what} failed: {}", String::from_utf8_lossy(&out.stderr));
    out
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// A new identity in `dir`; returns its path and public key.
fn keygen(dir: &Path, name: &str) -> (PathBuf, String) {
    let key = dir.join(name);
    let out = ok(criuz(&["keygen", "-o", s(&key)]), "criuz keygen");
    let public = String::from_utf8(out.stdout).unwrap().trim().to_string();
    assert!(public.starts_with("age1"), "keygen printed {public:?}");
    use std::os::unix::fs::PermissionsExt;
    assert_eq!(std::fs::metadata(&key).unwrap().permissions().mode() & 0o777, 0o600, "identity must be 0600");
    (key, public)
}

fn dump(w: &Workload, arc: &Path, extra: &[&str]) {
    let pid = w.pid.to_string();
    let mut args = vec!["dump", "-t", &pid, "-o", s(arc)];
    args.extend_from_slice(extra);
    ok(criuz(&args), "criuz dump");
}

fn restore_fails(w: &Workload, arc: &Path, extra: &[&str], what: &str) -> String {
    restore_fails_as(3, w, arc, extra, what)
}

/// A restore that fails with exit status `code`, naming the archive in one
/// line, with no process left running.
fn restore_fails_as(code: i32, w: &Workload, arc: &Path, extra: &[&str], what: &str) -> String {
    let mut args = vec!["restore", "-d", "-i", s(arc)];
    args.extend_from_slice(extra);
    let out = criuz(&args);
    reap_zombies();
    let err = String::from_utf8_lossy(&out.stderr).to_string();
    assert_eq!(out.status.code(), Some(code), "{what}: must fail as exit {code}: {err}");
    assert!(err.contains(s(arc)), "{what}: the error must name the archive: {err}");
    let said = err.lines().filter(|l| l.starts_with("criuz: ") && !l.contains(" CRIU ")).count();
    assert_eq!(said, 1, "{what}: one line of error: {err}");
    assert!(!w.alive(), "{what}: a process runs after a failed restore");
    err
}

fn restore_from_pipe(arc: &Path, key: &Path) -> std::process::Output {
    Command::new(CRIUZ)
        .args(["restore", "-d", "-i", "-", "--identity", s(key)])
        .stdin(std::fs::File::open(arc).unwrap())
        .stdout(Stdio::null())
        .output()
        .unwrap()
}

fn contains(hay: &[u8], needle: &str) -> bool {
    hay.windows(needle.len()).any(|w| w == needle.as_bytes())
}

/// `keygen -o -` writes the identity to standard output (for a secret
/// store) and its public key to standard error; no file named `-` is made.
/// A key file never read to its end; and a new key never written over an
/// identity or an archive.
#[test]
fn an_identity_made_on_standard_output_opens_what_is_sealed_for_it() {
    let tmp = tempfile::tempdir().unwrap();
    let out = Command::new(CRIUZ).args(["keygen", "-o", "-"]).current_dir(tmp.path()).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "keygen -o -: {err}");
    let public = err.trim().strip_prefix("criuz: public key: ").unwrap_or_else(|| panic!("no public key: {err}"));
    assert!(!tmp.path().join("-").exists(), "keygen -o - made a file named -");
    let key = tmp.path().join("from-stdout.key");
    std::fs::write(&key, &out.stdout).unwrap();
    let img = tmp.path().join("img");
    std::fs::create_dir(&img).unwrap();
    std::fs::write(img.join("inventory.img"), b"sealed for the key on standard output").unwrap();
    let arc = tmp.path().join("a.czr");
    ok(criuz(&["pack", s(&img), "-o", s(&arc), "--recipient", public]), "pack");
    assert_eq!(criuz(&["verify", s(&arc)]).status.code(), Some(2), "verify without the key");
    ok(criuz(&["verify", s(&arc), "--identity", s(&key)]), "verify with the key from standard output");
    // A key file that never ends is refused after its first MiB (it was
    // read until memory ran out).
    for args in [["verify", s(&arc), "--identity", "/dev/zero"], ["verify", s(&arc), "--passphrase-file", "/dev/zero"]]
    {
        let out = criuz(&args);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
        assert!(err.contains("/dev/zero: not a key or passphrase file (it holds more than 1 MiB)"), "{args:?}: {err}");
    }
    let out = criuz(&["pack", s(&img), "-o", s(&tmp.path().join("b.czr")), "--recipients-file", "/dev/zero"]);
    assert_eq!(out.status.code(), Some(2), "{}", String::from_utf8_lossy(&out.stderr));
    // A new key never replaces an identity (the archive above would open
    // no more) or an archive, even with --force; another file it does.
    let (key_bytes, arc_bytes) = (std::fs::read(&key).unwrap(), std::fs::read(&arc).unwrap());
    for (path, holds) in [(&key, "an age identity"), (&arc, "a criuz archive")] {
        let out = criuz(&["keygen", "-o", s(path), "--force"]);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{err}");
        assert!(err.contains(s(path)) && err.contains(holds) && err.lines().count() == 1, "{err}");
    }
    assert_eq!((std::fs::read(&key).unwrap(), std::fs::read(&arc).unwrap()), (key_bytes, arc_bytes));
    let notes = tmp.path().join("notes.txt");
    std::fs::write(&notes, b"not a key").unwrap();
    ok(criuz(&["keygen", "-o", s(&notes), "--force"]), "keygen over another file, with --force");
}

#[test]
fn encrypted_archives_round_trip_and_hold_no_plaintext() {
    let Some(_criu) = criu() else { return };
    let _g = serial();
    let tmp = tempfile::tempdir().unwrap();
    // A key directory that does not exist yet is made, private.
    let (key, public) = keygen(&tmp.path().join("keys"), "me.key");
    use std::os::unix::fs::PermissionsExt;
    let mode = std::fs::metadata(tmp.path().join("keys")).unwrap().permissions().mode();
    assert_eq!(mode & 0o777, 0o700, "the key directory must be private");
    let (wrong, _) = keygen(tmp.path(), "other.key");

    // To a recipient, uncompressed: the text pages would be there in the
    // clear without encryption.
    let mut w = Workload::start(Spec { mib: 16, pattern: "text", ..Default::default() });
    let arc = tmp.path().join("text.czr");
    let plain = tmp.path().join("plain.czr");
    dump(&w, &plain, &["--codec", "none", "--leave-running"]);
    let before = w.sums();
    dump(&w, &arc, &["--codec", "none", "--recipient", &public]);
    w.reap_original();
    let bytes = std::fs::read(&arc).unwrap();
    let clear = std::fs::read(&plain).unwrap();
    for needle in
        ["/v1/models/llama/infer", "llama-8b", "\"user\":\"user", "criuz-workload", "pages-1.img", "inventory.img"]
    {
        assert!(contains(&clear, needle), "the unencrypted archive should hold {needle:?} (test is void)");
        assert!(!contains(&bytes, needle), "the encrypted archive holds {needle:?} in the clear");
    }
    // The same pages, sealed: about 24 bytes a block more.
    let (a, b) = (bytes.len() as f64, clear.len() as f64);
    assert!(a / b < 1.005, "encrypted {a} bytes against {b}");

    // What inspect shows without the key.
    let out = ok(criuz(&["inspect", "--json", s(&arc)]), "inspect without a key");
    let rep: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(rep["encryption"]["locked"], true, "{rep}");
    assert_eq!(rep["encryption"]["wrapped_for"], serde_json::json!(["X25519"]), "{rep}");
    assert!(rep["files"].as_array().unwrap().iter().all(|f| f["name"].as_str().unwrap().starts_with('#')), "{rep}");
    let out = ok(criuz(&["inspect", "--json", s(&arc), "--identity", s(&key)]), "inspect with the key");
    let rep: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(rep["encryption"]["locked"], false);
    assert!(rep["files"].as_array().unwrap().iter().any(|f| f["name"] == "inventory.img"), "{rep}");

    // No key given is a usage error (2): the archive is not damaged, and
    // must not be taken for it; a key that does not open it, as foreign (3).
    let err = restore_fails_as(2, &w, &arc, &[], "no key");
    assert!(err.contains("--identity"), "the error must say what to give: {err}");
    let out = criuz(&["verify", s(&arc)]);
    assert_eq!(out.status.code(), Some(2), "verify without a key");
    restore_fails(&w, &arc, &["--identity", s(&wrong)], "the wrong key");
    let out = criuz(&["verify", s(&arc), "--identity", s(&wrong)]);
    assert_eq!(out.status.code(), Some(3), "verify with the wrong key");
    ok(criuz(&["verify", s(&arc), "--identity", s(&key)]), "verify with the key");

    // From a pipe.
    let out = restore_from_pipe(&arc, &key);
    assert!(out.status.success(), "pipe restore: {}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(w.sums(), before, "memory restored from a pipe differs");

    // With a passphrase, compressed, restored from a file.
    let pass = tmp.path().join("pass.txt");
    std::fs::write(&pass, "correct horse battery staple\n").unwrap();
    let parc = tmp.path().join("pass.czr");
    let before = w.sums();
    dump(&w, &parc, &["--codec", "zstd", "--passphrase-file", s(&pass)]);
    w.reap_original();
    let out = ok(criuz(&["inspect", "--json", s(&parc)]), "inspect");
    let rep: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(rep["encryption"]["wrapped_for"], serde_json::json!(["scrypt"]), "{rep}");
    restore_fails_as(2, &w, &parc, &["--identity", s(&key)], "an identity for a passphrase archive");
    let bad = tmp.path().join("bad-pass.txt");
    std::fs::write(&bad, "wrong horse\n").unwrap();
    restore_fails(&w, &parc, &["--passphrase-file", s(&bad)], "the wrong passphrase");
    ok(criuz(&["restore", "-d", "-i", s(&parc), "--passphrase-file", s(&pass)]), "passphrase restore");
    assert_eq!(w.sums(), before, "memory restored with the passphrase differs");
    w.stop();
}

/// Flips, swaps, duplicates and transplants in an encrypted archive.
fn variants(good: &[u8], foreign: &[u8]) -> Vec<(&'static str, Vec<u8>)> {
    let blocks: Vec<Rec> = records(good).into_iter().filter(|r| r.kind == b'B').collect();
    let big: Vec<Rec> = blocks.iter().copied().filter(|r| r.len > 4096).collect();
    let (x, y) = big
        .iter()
        .enumerate()
        .find_map(|(i, x)| big[i + 1..].iter().find(|y| y.len == x.len).map(|y| (*x, *y)))
        .expect("two sealed blocks of equal length");
    let mut out = Vec::new();
    let payload_check = |v: &mut Vec<u8>, r: Rec| {
        let c = xxhash_rust::xxh3::xxh3_64(&v[r.start + r.header_len + 4..r.start + r.len]) as u32;
        v[r.start + 24..r.start + 28].copy_from_slice(&c.to_le_bytes());
    };

    let mut v = good.to_vec();
    v[x.start + x.header_len + 4 + 100] ^= 0x01;
    out.push(("flipped ciphertext byte", v.clone()));
    payload_check(&mut v, x);
    reseal(&mut v, Reseal::Seals);
    out.push(("flipped ciphertext byte, payload check and seals recomputed", v));

    let mut v = good.to_vec();
    let (bx, by) = (good[x.start..x.start + x.len].to_vec(), good[y.start..y.start + y.len].to_vec());
    v[x.start..x.start + x.len].copy_from_slice(&by);
    v[y.start..y.start + y.len].copy_from_slice(&bx);
    out.push(("swapped sealed blocks", v.clone()));
    reseal(&mut v, Reseal::Seals);
    out.push(("swapped sealed blocks, seals recomputed", v));

    let mut v = good.to_vec();
    v[y.start..y.start + y.len].copy_from_slice(&bx);
    reseal(&mut v, Reseal::Seals);
    out.push(("duplicated sealed block, seals recomputed", v));

    let t = records(foreign)
        .into_iter()
        .find(|r| r.kind == b'B' && r.len == x.len)
        .expect("a block of equal length in the other archive");
    let mut v = good.to_vec();
    v[x.start..x.start + x.len].copy_from_slice(&foreign[t.start..t.start + t.len]);
    v[x.start + 4..x.start + 8].copy_from_slice(&good[x.start + 4..x.start + 8]);
    reseal(&mut v, Reseal::Seals);
    out.push(("sealed block of another archive with the same key, seals recomputed", v));

    let k = records(good).into_iter().find(|r| r.kind == b'K').expect("a key record");
    let mut v = good.to_vec();
    v[k.start + 40] ^= 0x01;
    reseal(&mut v, Reseal::Seals);
    out.push(("wrapped key edited, seals recomputed", v));

    // The key id (bytes 8..24 of the K record): with the identity, the key
    // unwrapped is not the one named (the fuzzer, holding no identity, is
    // told to give one).
    let mut v = good.to_vec();
    v[k.start + 8] ^= 0x01;
    reseal(&mut v, Reseal::Seals);
    out.push(("key id edited, seals recomputed", v));

    let mut v = good.to_vec();
    v[10] &= !8;
    reseal(&mut v, Reseal::Seals);
    out.push(("encryption flag cleared, header check recomputed", v));
    out
}

#[test]
fn tampered_encrypted_archives_never_restore() {
    let Some(_criu) = criu() else { return };
    let _g = serial();
    let tmp = tempfile::tempdir().unwrap();
    let (key, public) = keygen(tmp.path(), "me.key");
    let flags = ["--codec", "none", "--block-size", "64K", "--recipient", &public];
    let foreign = tmp.path().join("foreign.czr");
    {
        let mut f = Workload::start(Spec { mib: 8, pattern: "text", ..Default::default() });
        dump(&f, &foreign, &[&flags[..], &["--leave-running"]].concat());
        f.stop();
    }
    let mut w = Workload::start(Spec { mib: 8, pattern: "text", ..Default::default() });
    let before = w.sums();
    let arc = tmp.path().join("good.czr");
    dump(&w, &arc, &flags);
    w.reap_original();
    let good = std::fs::read(&arc).unwrap();
    for (what, bytes) in variants(&good, &std::fs::read(&foreign).unwrap()) {
        let bad = tmp.path().join("bad.czr");
        std::fs::write(&bad, &bytes).unwrap();
        let err = restore_fails(&w, &bad, &["--identity", s(&key)], what);
        eprintln!("{what}: {}", err.lines().last().unwrap_or(""));
        let out = restore_from_pipe(&bad, &key);
        reap_zombies();
        assert_eq!(out.status.code(), Some(3), "{what}: pipe restore: {}", String::from_utf8_lossy(&out.stderr));
        assert!(!w.alive(), "{what}: a process runs after a failed pipe restore");
        let out = criuz(&["verify", s(&bad), "--identity", s(&key)]);
        assert_eq!(out.status.code(), Some(3), "{what}: verify must reject it");
    }
    ok(criuz(&["restore", "-d", "-i", s(&arc), "--identity", s(&key)]), "the undamaged archive must restore");
    assert_eq!(w.sums(), before, "restored memory differs");
    w.stop();
}

#[test]
fn an_encrypted_child_shares_its_parents_key() {
    let Some(_criu) = criu() else { return };
    let _g = serial();
    let tmp = tempfile::tempdir().unwrap();
    let (key, public) = keygen(tmp.path(), "me.key");
    let (full, inc) = (tmp.path().join("full.czr"), tmp.path().join("inc.czr"));
    let mut w = Workload::start(Spec { mib: 32, pattern: "mixed", ..Default::default() });
    dump(&w, &full, &["--leave-running", "--recipient", &public, "--ids"]);
    w.rewrite(5.0, 1);
    let before = w.sums();
    // Without the key the parent cannot be read, and the child would not be encrypted.
    let pid = w.pid.to_string();
    let out = criuz(&["dump", "-t", &pid, "-o", s(&inc), "--leave-running", "--parent", s(&full)]);
    assert_eq!(out.status.code(), Some(2), "child of a locked parent: {}", String::from_utf8_lossy(&out.stderr));
    assert!(!inc.exists());
    // --identity alone: the parent opens, and the child is encrypted to the same key.
    dump(&w, &inc, &["--parent", s(&full), "--identity", s(&key)]);
    w.reap_original();
    let out = ok(criuz(&["inspect", "--json", s(&inc), "--identity", s(&key)]), "inspect child");
    let rep: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let parent = ok(criuz(&["inspect", "--json", s(&full)]), "inspect parent");
    let prep: serde_json::Value = serde_json::from_slice(&parent.stdout).unwrap();
    assert_eq!(rep["encryption"]["key_id"], prep["encryption"]["key_id"], "a child shares its parent's key");
    assert!(rep["total"]["referenced_bytes"].as_u64().unwrap() > 10 << 20, "keyed ids must still dedup: {rep}");
    // Without the key, the public view of a child: its dedup blocks' payloads
    // are not read, so what they refer to is not counted (this panicked once).
    let out = ok(criuz(&["inspect", "--json", s(&inc)]), "inspect child without a key");
    let locked: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(locked["encryption"]["locked"], true, "{locked}");
    assert_eq!(locked["total"]["referenced_bytes"], 0, "{locked}");
    assert!(std::fs::metadata(&inc).unwrap().len() < 4 << 20, "the child stores only what changed");
    restore_fails_as(2, &w, &inc, &[], "child without a key");
    ok(criuz(&["restore", "-d", "-i", s(&inc), "--identity", s(&key)]), "restore of the encrypted child");
    assert_eq!(w.sums(), before, "restored memory differs");
    w.stop();
}

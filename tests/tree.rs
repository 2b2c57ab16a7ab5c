//! Whole trees through `criuz pack` / `unpack`, as directories and as tar
//! streams: nothing lost (subdirectories, links, modes, mtimes, bytes),
//! nothing carried that a tree cannot hold (a clear error instead), and no
//! crafted tree archive writes outside the directory it is unpacked into.

// Tests start processes of their own; clippy.toml's rule is for the
// programs criuz runs.
#![allow(clippy::disallowed_methods)]

mod common;
use common::*;
use criuz::archive::records::ArchiveWriter;
use criuz::format::{EntryMeta, FileKind, Header, FLAG_TABLE, FLAG_TREE};
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::Path;
use std::process::{Command, Stdio};

/// Every entry under `root`: (path, type, mode, mtime, link target or content hash).
fn listing(root: &Path) -> Vec<String> {
    fn walk(root: &Path, dir: &Path, out: &mut Vec<String>) {
        let mut names: Vec<_> = std::fs::read_dir(dir).unwrap().map(|e| e.unwrap().file_name()).collect();
        names.sort();
        for n in names {
            let p = dir.join(&n);
            let rel = p.strip_prefix(root).unwrap().display().to_string();
            let md = std::fs::symlink_metadata(&p).unwrap();
            let ft = md.file_type();
            let what = if ft.is_symlink() {
                format!("link {}", std::fs::read_link(&p).unwrap().display())
            } else if ft.is_dir() {
                "dir".to_string()
            } else {
                format!("file {:016x}", xxhash_rust::xxh3::xxh3_64(&std::fs::read(&p).unwrap()))
            };
            // A link's own mode is always 0777 on Linux; its mtime is kept.
            out.push(format!("{rel} {what} {:o} {}.{:09}", md.mode() & 0o7777, md.mtime(), md.mtime_nsec()));
            if ft.is_dir() {
                walk(root, &p, out);
            }
        }
    }
    let mut out = Vec::new();
    walk(root, root, &mut out);
    out
}

fn set_mtime(p: &Path, secs: i64, nsec: i64) {
    let t = nix::sys::time::TimeSpec::new(secs, nsec);
    nix::sys::stat::utimensat(nix::fcntl::AT_FDCWD, p, &t, &t, nix::sys::stat::UtimensatFlags::NoFollowSymlink)
        .unwrap();
}

/// A podman-export-like tree: images in a subdirectory, files beside it,
/// links (relative, absolute, dangling, CRIU's `parent`), odd modes, an
/// empty directory, an empty file and one that is all zero pages.
fn sample_tree(root: &Path) {
    let ck = root.join("checkpoint");
    std::fs::create_dir_all(ck.join("deep/er")).unwrap();
    std::fs::create_dir_all(root.join("empty")).unwrap();
    let mut pages = vec![0u8; 300 << 10];
    for (i, b) in pages.iter_mut().enumerate().skip(64 << 10) {
        *b = (i * 7 % 251) as u8;
    }
    std::fs::write(ck.join("pages-1.img"), &pages).unwrap();
    std::fs::write(ck.join("pages-2.img"), vec![0u8; 64 << 10]).unwrap();
    std::fs::write(ck.join("inventory.img"), b"inventory").unwrap();
    std::fs::write(ck.join("deep/er/note"), b"deep").unwrap();
    std::fs::write(root.join("config.dump"), b"{\"x\": 1}").unwrap();
    std::fs::write(root.join("empty.file"), b"").unwrap();
    std::os::unix::fs::symlink("../config.dump", ck.join("cfg")).unwrap();
    std::os::unix::fs::symlink("/etc/hostname", root.join("abs")).unwrap();
    std::os::unix::fs::symlink("nowhere/at/all", root.join("dangling")).unwrap();
    std::os::unix::fs::symlink("../img-0", ck.join("parent")).unwrap();
    std::fs::set_permissions(root.join("config.dump"), std::fs::Permissions::from_mode(0o640)).unwrap();
    std::fs::set_permissions(ck.join("inventory.img"), std::fs::Permissions::from_mode(0o4755)).unwrap();
    std::fs::set_permissions(ck.join("deep"), std::fs::Permissions::from_mode(0o751)).unwrap();
    std::fs::set_permissions(root.join("empty"), std::fs::Permissions::from_mode(0o700)).unwrap();
    for (i, p) in
        ["checkpoint/pages-1.img", "config.dump", "abs", "checkpoint/deep/er", "checkpoint/deep", "checkpoint", "empty"]
            .iter()
            .enumerate()
    {
        set_mtime(&root.join(p), 1_600_000_000 + i as i64 * 1000, 123_456_789);
    }
}

fn ok(out: std::process::Output, what: &str) -> std::process::Output {
    assert!(out.status.success(), "{what}: {}", String::from_utf8_lossy(&out.stderr));
    out
}

fn p(x: &Path) -> &str {
    x.to_str().unwrap()
}

#[test]
fn a_whole_tree_comes_back_as_it_was() {
    let t = tempfile::tempdir().unwrap();
    let (src, out, arc) = (t.path().join("src"), t.path().join("out"), t.path().join("a.czr"));
    sample_tree(&src);
    ok(criuz(&["pack", p(&src), "-o", p(&arc)]), "pack");
    assert_eq!(std::fs::metadata(&arc).unwrap().mode() & 0o777, 0o600);
    ok(criuz(&["verify", p(&arc)]), "verify");
    ok(criuz(&["unpack", p(&arc), "-d", p(&out)]), "unpack");
    assert_eq!(listing(&src), listing(&out));
    // From a pipe too (the stream reader), and nothing left of the staging.
    let out2 = t.path().join("out2");
    let piped = Command::new(CRIUZ)
        .args(["unpack", "-", "-d", p(&out2)])
        .stdin(std::fs::File::open(&arc).unwrap())
        .output()
        .unwrap();
    ok(piped, "unpack from a pipe");
    assert_eq!(listing(&src), listing(&out2));
    // The page images keep page-aware blocks in their subdirectory.
    let rep = ok(criuz(&["inspect", "--json", p(&arc)]), "inspect");
    let v: serde_json::Value = serde_json::from_slice(&rep.stdout).unwrap();
    let pages = v["files"].as_array().unwrap().iter().find(|f| f["name"] == "checkpoint/pages-1.img").unwrap();
    assert_eq!(pages["kind"], "pages");
    assert_eq!(pages["zero_pages"], 16);
    // An existing entry is not replaced without --force.
    let again = criuz(&["unpack", p(&arc), "-d", p(&out)]);
    assert_eq!(again.status.code(), Some(2), "{}", String::from_utf8_lossy(&again.stderr));
    assert_eq!(listing(&src), listing(&out));
}

/// A user's own directory under one they cannot write (root's /srv, say):
/// the unpack cannot stage beside it, so it stages inside it. It used to
/// fail ("Permission denied ... at path PARENT/.criuz-new-Xy12Ab"): the
/// staging directory's error carried no OS error code, so the way round
/// was never taken. And where neither can be written, the one line names
/// the directory, no staging name.
#[test]
fn an_unpack_where_only_the_target_is_writable_stages_inside_it() {
    let t = tempfile::tempdir().unwrap();
    std::fs::set_permissions(t.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let (src, arc) = (t.path().join("src"), t.path().join("a.czr"));
    std::fs::create_dir_all(src.join("sub")).unwrap();
    std::fs::write(src.join("sub/f"), b"theirs").unwrap();
    ok(criuz(&["pack", p(&src), "-o", p(&arc)]), "pack");
    std::fs::set_permissions(&arc, std::fs::Permissions::from_mode(0o644)).unwrap();
    let (theirs, not_theirs) = (t.path().join("theirs"), t.path().join("root-owned"));
    for d in [&theirs, &not_theirs] {
        std::fs::create_dir(d).unwrap();
    }
    std::os::unix::fs::chown(&theirs, Some(65534), Some(65534)).unwrap();
    let as_nobody = |dest: &Path| {
        let mut cmd = Command::new("setpriv");
        cmd.args(["--reuid=65534", "--regid=65534", "--clear-groups", "--", CRIUZ, "unpack", p(&arc), "-d", p(dest)]);
        cmd.output().unwrap()
    };
    ok(as_nobody(&theirs), "unpack into their own directory");
    assert_eq!(listing(&src), listing(&theirs));
    assert_eq!(std::fs::read_dir(t.path()).unwrap().count(), 4, "nothing left beside it");
    let refused = as_nobody(&not_theirs);
    let err = String::from_utf8_lossy(&refused.stderr);
    assert_eq!(refused.status.code(), Some(1), "{err}");
    assert_eq!(err.trim(), format!("criuz: {}: Permission denied (os error 13)", not_theirs.display()));
    assert_eq!(std::fs::read_dir(&not_theirs).unwrap().count(), 0);
}

#[test]
fn an_archive_written_into_the_tree_it_packs_is_not_packed_into_itself() {
    let t = tempfile::tempdir().unwrap();
    let (src, out) = (t.path().join("src"), t.path().join("out"));
    sample_tree(&src);
    let before = listing(&src);
    let arc = src.join("self.czr");
    ok(criuz(&["pack", p(&src), "-o", p(&arc)]), "pack");
    // Again, replacing it: the archive it replaces is skipped, with a note.
    let again = ok(criuz(&["pack", p(&src), "-o", p(&arc), "--force"]), "pack --force");
    assert!(String::from_utf8_lossy(&again.stderr).contains("self.czr is the archive being written"));
    ok(criuz(&["unpack", p(&arc), "-d", p(&out)]), "unpack");
    assert_eq!(before, listing(&out), "the tree as it was before any archive was in it");
    // Through standard output redirected into the tree: a partial copy of
    // itself was packed. The tree holds 5 MiB that LZ4 cannot shrink, so
    // part of the archive reached the file before pack read its last name.
    std::fs::remove_file(&arc).unwrap();
    let big: Vec<u8> =
        (0u64..(5 << 20) / 8).flat_map(|i| i.wrapping_mul(0x9E37_79B9_7F4A_7C15).to_le_bytes()).collect();
    std::fs::write(src.join("big.bin"), big).unwrap();
    let before = listing(&src);
    let redirected = std::fs::File::create(src.join("zz.czr")).unwrap();
    let out3 = t.path().join("out3");
    let piped = Command::new(CRIUZ).args(["pack", p(&src), "-o", "-"]).stdout(redirected).output().unwrap();
    assert!(piped.status.success(), "{}", String::from_utf8_lossy(&piped.stderr));
    ok(criuz(&["unpack", p(&src.join("zz.czr")), "-d", p(&out3)]), "unpack");
    assert_eq!(before, listing(&out3), "the tree without the archive it was written into");
    assert!(String::from_utf8_lossy(&piped.stderr).contains("standard output is the archive being written"));
}

/// Past the files an unpack syncs one by one, the rest are synced by one
/// syncfs before the publish: a tree of many files comes back whole.
#[test]
fn a_tree_of_many_files_comes_back_whole() {
    let t = tempfile::tempdir().unwrap();
    let (src, out, arc) = (t.path().join("src"), t.path().join("out"), t.path().join("a.czr"));
    for d in 0..3 {
        let dir = src.join(format!("d{d}"));
        std::fs::create_dir_all(&dir).unwrap();
        for i in 0..200 {
            std::fs::write(dir.join(format!("f{i}")), format!("{d}/{i}").repeat(i)).unwrap();
        }
    }
    // Files counted alike both ways (the three directories are not files).
    let packed = ok(criuz(&["pack", p(&src), "-o", p(&arc)]), "pack");
    assert!(String::from_utf8_lossy(&packed.stderr).contains("packed 600 files"));
    let unpacked = ok(criuz(&["unpack", p(&arc), "-d", p(&out)]), "unpack");
    assert!(String::from_utf8_lossy(&unpacked.stderr).contains("unpacked 600 files"));
    assert_eq!(listing(&src), listing(&out));
}

/// A sparse file comes back with its bytes, holes where it had them (an
/// unpack wrote every zero: a 64 MiB hole took 64 MiB of disk), from a
/// file and from a pipe; zeros written as data (1 MiB) become a hole too.
/// A CRIU page image gets holes only in tmpfs (CRIU reads written zeros
/// back from a disk faster), where its zero memory would cost RAM.
#[test]
fn a_sparse_file_comes_back_sparse() {
    let t = tempfile::tempdir().unwrap();
    let (src, arc) = (t.path().join("src"), t.path().join("a.czr"));
    std::fs::create_dir(&src).unwrap();
    use std::os::unix::fs::FileExt;
    for name in ["sparse", "pages-1.img"] {
        let f = std::fs::File::create(src.join(name)).unwrap();
        // A hole, data, a hole, written zeros, data, a hole to the end.
        f.write_all_at(b"middle", 32 << 20).unwrap();
        f.write_all_at(&vec![0; 1 << 20], 48 << 20).unwrap();
        f.write_all_at(&[7; 5000], 49 << 20).unwrap();
        f.set_len(96 << 20).unwrap();
    }
    ok(criuz(&["pack", p(&src), "-o", p(&arc)]), "pack");
    let shm = tempfile::tempdir_in("/dev/shm").unwrap();
    for (out, piped) in [(t.path().join("out"), false), (t.path().join("out2"), true), (shm.path().join("out"), false)]
    {
        let mut cmd = Command::new(CRIUZ);
        cmd.args(["unpack", if piped { "-" } else { p(&arc) }, "-d", p(&out)]);
        if piped {
            cmd.stdin(std::fs::File::open(&arc).unwrap());
        }
        ok(cmd.output().unwrap(), "unpack");
        for name in ["sparse", "pages-1.img"] {
            let back = out.join(name);
            assert_eq!(std::fs::read(&back).unwrap(), std::fs::read(src.join(name)).unwrap(), "{}", back.display());
            let disk = std::fs::metadata(&back).unwrap().blocks() * 512;
            let holes = name == "sparse" || out.starts_with("/dev/shm");
            assert_eq!(disk <= 64 << 10, holes, "{}: 96 MiB with 13 KiB of data took {disk} bytes", back.display());
        }
    }
}

#[test]
fn tar_streams_in_and_out() {
    let t = tempfile::tempdir().unwrap();
    let (src, arc) = (t.path().join("src"), t.path().join("a.czr"));
    sample_tree(&src);
    ok(criuz(&["pack", p(&src), "-o", p(&arc)]), "pack");
    // unpack --tar, read back by GNU tar.
    let tar = t.path().join("x.tar");
    ok(criuz(&["unpack", p(&arc), "--tar", p(&tar)]), "unpack --tar");
    assert_eq!(std::fs::metadata(&tar).unwrap().mode() & 0o777, 0o600);
    let untar = t.path().join("untar");
    std::fs::create_dir(&untar).unwrap();
    run_ok(Command::new("tar").arg("-C").arg(&untar).arg("-xpf").arg(&tar));
    let secs = |l: Vec<String>| -> Vec<String> {
        // tar keeps whole seconds only.
        l.into_iter().map(|s| s.rsplit_once('.').unwrap().0.to_string()).collect()
    };
    assert_eq!(secs(listing(&src)), secs(listing(&untar)));
    // pack --tar of what GNU tar writes: plain, gzip and zstd, and from stdin.
    for (flag, name) in [("-cf", "g.tar"), ("-czf", "g.tar.gz"), ("--zstd -cf", "g.tar.zst")] {
        let made = t.path().join(name);
        let mut cmd = Command::new("tar");
        cmd.args(flag.split(' ')).arg(&made).arg("-C").arg(&src).arg(".");
        run_ok(&mut cmd);
        let arc2 = t.path().join(format!("{name}.czr"));
        let packed = Command::new(CRIUZ)
            .args(["pack", "--tar", "-", "-o", p(&arc2)])
            .stdin(std::fs::File::open(&made).unwrap())
            .output()
            .unwrap();
        ok(packed, &format!("pack --tar {name}"));
        let back = t.path().join(format!("{name}.out"));
        ok(criuz(&["unpack", p(&arc2), "-d", p(&back)]), "unpack");
        assert_eq!(secs(listing(&src)), secs(listing(&back)), "{name}");
    }
    // unpack --tar to stdout.
    let to_stdout = Command::new(CRIUZ).args(["unpack", p(&arc), "--tar", "-"]).stderr(Stdio::null()).output().unwrap();
    assert!(to_stdout.status.success());
    assert_eq!(to_stdout.stdout, std::fs::read(&tar).unwrap());
}

#[test]
fn what_a_tree_cannot_carry_is_refused_by_name() {
    let t = tempfile::tempdir().unwrap();
    let arc = t.path().join("a.czr");
    let refused = |dir: &Path, needle: &str| {
        let out = criuz(&["pack", p(dir), "-o", p(&arc)]);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{err}");
        assert!(err.contains(needle), "{err}");
        assert_eq!(err.trim().lines().count(), 1, "{err}");
        assert!(!arc.exists(), "nothing is published");
    };
    let fifo = t.path().join("fifo");
    std::fs::create_dir_all(fifo.join("sub")).unwrap();
    nix::unistd::mkfifo(&fifo.join("sub/pipe"), nix::sys::stat::Mode::from_bits_truncate(0o600)).unwrap();
    refused(&fifo, "sub/pipe: a device, socket or fifo");
    let sock = t.path().join("sock");
    std::fs::create_dir(&sock).unwrap();
    let _l = std::os::unix::net::UnixListener::bind(sock.join("s")).unwrap();
    refused(&sock, "a device, socket or fifo");
    let hard = t.path().join("hard");
    std::fs::create_dir(&hard).unwrap();
    std::fs::write(hard.join("a"), b"x").unwrap();
    std::fs::hard_link(hard.join("a"), hard.join("b")).unwrap();
    refused(&hard, "a hard link (2 names)");
    // The same from a tar stream: a hard link entry, and a path that leaves.
    let tar = t.path().join("h.tar");
    run_ok(Command::new("tar").arg("-cf").arg(&tar).arg("-C").arg(&hard).args(["a", "b"]));
    let out = criuz(&["pack", "--tar", p(&tar), "-o", p(&arc)]);
    assert_eq!(out.status.code(), Some(2), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(String::from_utf8_lossy(&out.stderr).contains("b: a hard link"));
    let evil = t.path().join("evil.tar");
    {
        let mut b = tar::Builder::new(std::fs::File::create(&evil).unwrap());
        let mut h = tar::Header::new_gnu();
        h.set_size(1);
        h.set_mode(0o644);
        // `append_data` refuses "..", so the name goes into the header raw.
        h.as_gnu_mut().unwrap().name[..7].copy_from_slice(b"../x.sh");
        h.set_cksum();
        b.append(&h, &b"x"[..]).unwrap();
        b.finish().unwrap();
    }
    let out = criuz(&["pack", "--tar", p(&evil), "-o", p(&arc)]);
    assert_eq!(out.status.code(), Some(2), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(String::from_utf8_lossy(&out.stderr).contains("leaves the tree"));
    assert!(!arc.exists());
}

/// A tree archive the writer lets through but every reader must refuse.
fn crafted(entries: &[(&str, FileKind, &[u8])]) -> Vec<u8> {
    let mut h = Header::new(64 << 10);
    h.flags |= FLAG_TREE | FLAG_TABLE;
    let mut w = ArchiveWriter::new(Vec::new(), &h, &[]).unwrap();
    let meta = EntryMeta { mode: 0o644, mtime: 1, mtime_nsec: 0 };
    for (name, kind, data) in entries {
        let id = w.begin_file(name, *kind, Some(meta)).unwrap();
        if !data.is_empty() {
            let mut enc = criuz::codec::Encoder::new(criuz::codec::CodecConfig::default());
            let mut b = enc.encode(id, data, false);
            b.header.file_id = id;
            w.write_block(&b.header, &b.payload).unwrap();
        }
        w.end_file(id).unwrap();
    }
    w.finish().unwrap().0
}

#[test]
fn crafted_trees_cannot_reach_outside() {
    let t = tempfile::tempdir().unwrap();
    let outside = t.path().join("outside");
    std::fs::create_dir(&outside).unwrap();
    let cases: Vec<(&str, Vec<u8>)> = vec![
        // A link, then a file "through" it.
        (
            "through a link",
            crafted(&[
                ("a", FileKind::Symlink, outside.to_str().unwrap().as_bytes()),
                ("a/evil", FileKind::Plain, b"owned"),
            ]),
        ),
        // A file under a directory the archive never made.
        ("undeclared parent", crafted(&[("d/evil", FileKind::Plain, b"x")])),
        // A file whose parent is a file.
        ("file as parent", crafted(&[("f", FileKind::Plain, b"x"), ("f/evil", FileKind::Plain, b"x")])),
        ("twice", crafted(&[("d", FileKind::Dir, b""), ("d", FileKind::Plain, b"x")])),
        ("a directory with bytes", crafted(&[("d", FileKind::Dir, b"x")])),
        ("an empty link", crafted(&[("l", FileKind::Symlink, b"")])),
        ("a long link", crafted(&[("l", FileKind::Symlink, &[b'a'; 5000])])),
    ];
    for (what, bytes) in cases {
        let arc = t.path().join("c.czr");
        std::fs::write(&arc, &bytes).unwrap();
        let dest = t.path().join("dest");
        for args in
            [vec!["unpack", p(&arc), "-d", p(&dest)], vec!["verify", p(&arc)], vec!["unpack", p(&arc), "--tar", "-"]]
        {
            let out = criuz(&args);
            assert_eq!(out.status.code(), Some(3), "{what}: {args:?}: {}", String::from_utf8_lossy(&out.stderr));
        }
        assert!(std::fs::read_dir(&outside).unwrap().next().is_none(), "{what}: wrote outside");
        let left: Vec<_> =
            std::fs::read_dir(&dest).map(|d| d.flatten().map(|e| e.file_name()).collect()).unwrap_or_default();
        assert!(left.is_empty(), "{what}: left {left:?}");
    }
}

/// An unpack interrupted halfway (here: waiting for the rest of its archive
/// on a pipe) removes its staging directory, dies by the signal, and leaves
/// the target as it was.
#[test]
fn an_interrupted_unpack_leaves_the_target_as_it_was() {
    use std::io::Write;
    use std::os::unix::process::ExitStatusExt;
    let tmp = tempfile::tempdir().unwrap();
    let src = tmp.path().join("src");
    sample_tree(&src);
    std::fs::write(src.join("big.bin"), vec![7u8; 8 << 20]).unwrap();
    let arc = tmp.path().join("tree.czr");
    ok(criuz(&["pack", p(&src), "-o", p(&arc)]), "pack");
    let bytes = std::fs::read(&arc).unwrap();
    let root = tmp.path().join("target");
    let out = root.join("out");
    std::fs::create_dir_all(&out).unwrap();
    std::fs::write(out.join("mine"), b"stays").unwrap();
    let before = listing(&root);
    let mut unpack = takes_sigint(&mut Command::new(CRIUZ))
        .args(["unpack", "-", "-d", p(&out)])
        .stdin(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdin = unpack.stdin.take().unwrap();
    stdin.write_all(&bytes[..bytes.len() / 2]).unwrap();
    stdin.flush().unwrap();
    let staged = || {
        std::fs::read_dir(&root)
            .unwrap()
            .flatten()
            .any(|e| e.file_name().to_string_lossy().starts_with(".criuz-unpack-"))
    };
    wait_for("the unpack's staging directory", std::time::Duration::from_secs(30), staged);
    // SAFETY: signalling the criuz this test started.
    unsafe { libc::kill(unpack.id() as i32, libc::SIGINT) };
    let mut err = String::new();
    std::io::Read::read_to_string(unpack.stderr.as_mut().unwrap(), &mut err).unwrap();
    let status = unpack.wait().unwrap();
    drop(stdin);
    assert_eq!(status.signal(), Some(libc::SIGINT), "{err}");
    assert!(err.contains("interrupted"), "{err}");
    assert!(!staged(), "the staging directory must be removed");
    assert_eq!(listing(&root), before, "the target must be as it was");
}

//! The streamer protocol without CRIU or root: a fake CRIU client speaks
//! `criu/img-streamer.c`'s side of the conversation (a u32 native-endian
//! length and an `img_streamer_request_entry` per file, a pipe end passed with
//! SCM_RIGHTS and one dummy byte, `img_streamer_reply_entry` on restore) to
//! `criuz capture` and `criuz serve`.

// Tests start processes of their own; clippy.toml's rule is for the
// programs criuz runs.
#![allow(clippy::disallowed_methods)]

mod common;
use common::CRIUZ;
use std::io::{Read, Write};
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// The fake CRIU.
struct FakeCriu(UnixStream);

impl FakeCriu {
    fn connect(sock: &Path) -> FakeCriu {
        let t = Instant::now();
        loop {
            match UnixStream::connect(sock) {
                Ok(s) => return FakeCriu(s),
                Err(_) if t.elapsed() < Duration::from_secs(20) => std::thread::sleep(Duration::from_millis(20)),
                Err(e) => panic!("{}: {e}", sock.display()),
            }
        }
    }

    fn request(&mut self, name: &str) {
        // protobuf: field 1, wire type 2 (string)
        let mut body = vec![0x0a, name.len() as u8];
        body.extend_from_slice(name.as_bytes());
        let mut msg = (body.len() as u32).to_ne_bytes().to_vec();
        msg.extend_from_slice(&body);
        self.0.write_all(&msg).unwrap();
    }

    fn send_fd(&self, fd: &OwnedFd) {
        let iov = [std::io::IoSlice::new(&[0u8])];
        let fds = [fd.as_raw_fd()];
        let cmsg = [nix::sys::socket::ControlMessage::ScmRights(&fds)];
        nix::sys::socket::sendmsg::<()>(self.0.as_raw_fd(), &iov, &cmsg, nix::sys::socket::MsgFlags::empty(), None)
            .unwrap();
    }

    /// Dump side: opens an image and returns the pipe to write it into.
    fn open_for_write(&mut self, name: &str) -> std::fs::File {
        self.request(name);
        let (rd, wr) = nix::unistd::pipe().unwrap();
        self.send_fd(&rd);
        std::fs::File::from(wr)
    }

    /// Restore side: asks for an image; `None` if the archive lacks it.
    fn read(&mut self, name: &str) -> Option<Vec<u8>> {
        self.request(name);
        let mut len = [0u8; 4];
        self.0.read_exact(&mut len).unwrap();
        let mut reply = vec![0u8; u32::from_ne_bytes(len) as usize];
        self.0.read_exact(&mut reply).unwrap();
        let exists = reply == [0x08, 0x01];
        if !exists {
            assert!(reply == [0x08, 0x00] || reply.is_empty(), "odd reply {reply:?}");
            return None;
        }
        let (rd, wr) = nix::unistd::pipe().unwrap();
        self.send_fd(&wr);
        drop(wr);
        let mut data = Vec::new();
        std::fs::File::from(rd).read_to_end(&mut data).unwrap();
        Some(data)
    }
}

fn images() -> Vec<(&'static str, Vec<u8>)> {
    let mut pages = Vec::new();
    for p in 0..300u32 {
        match p % 3 {
            0 => pages.extend_from_slice(&[0u8; 4096]),
            1 => pages.extend((0..4096u32).map(|i| (i.wrapping_mul(2654435761).wrapping_add(p) >> 13) as u8)),
            _ => pages.extend((0..4096).map(|i| b"page text "[(i + p as usize) % 10])),
        }
    }
    vec![
        ("pages-1.img", pages),
        ("pagemap-1.img", (0..900u32).flat_map(|i| i.to_le_bytes()).collect()),
        ("core-1.img", b"core".to_vec()),
        ("inventory.img", b"inventory".to_vec()),
    ]
}

fn spawn(args: &[&str]) -> Child {
    Command::new(CRIUZ).args(args).stdin(Stdio::null()).stderr(Stdio::piped()).spawn().unwrap()
}

fn finish(child: Child) -> (Option<i32>, String) {
    let out = child.wait_with_output().unwrap();
    (out.status.code(), String::from_utf8_lossy(&out.stderr).to_string())
}

/// Captures `files` through the fake CRIU; pages and pagemap are written
/// interleaved, as CRIU writes several images at once.
fn capture(dir: &Path, arc: &Path, files: &[(&str, Vec<u8>)]) -> (Option<i32>, String) {
    let child = spawn(&["capture", "-D", dir.to_str().unwrap(), "-o", arc.to_str().unwrap(), "--block-size", "16K"]);
    let mut criu = FakeCriu::connect(&dir.join("streamer-capture.sock"));
    let mut pipes: Vec<(std::fs::File, &[u8])> = files.iter().map(|(n, d)| (criu.open_for_write(n), &d[..])).collect();
    while pipes.iter().any(|(_, d)| !d.is_empty()) {
        for (pipe, data) in pipes.iter_mut() {
            let n = data.len().min(10_000);
            pipe.write_all(&data[..n]).unwrap();
            *data = &data[n..];
        }
    }
    drop(pipes);
    drop(criu);
    finish(child)
}

#[test]
fn capture_then_serve_any_order_any_number_of_times() {
    let tmp = tempfile::tempdir().unwrap();
    let arc = tmp.path().join("a.czr");
    let files = images();
    let (code, err) = capture(tmp.path(), &arc, &files);
    assert_eq!(code, Some(0), "{err}");
    assert!(!tmp.path().join("streamer-capture.sock").exists(), "the socket must be removed");

    let child = spawn(&["serve", "-D", tmp.path().to_str().unwrap(), "-i", arc.to_str().unwrap()]);
    let mut criu = FakeCriu::connect(&tmp.path().join("streamer-serve.sock"));
    let mode = std::fs::metadata(tmp.path().join("streamer-serve.sock")).unwrap();
    assert_eq!(std::os::unix::fs::PermissionsExt::mode(&mode.permissions()) & 0o777, 0o600);
    for (name, data) in files.iter().rev().chain(files.iter()) {
        assert!(criu.read(name).as_deref() == Some(&data[..]), "{name} served differently");
    }
    assert_eq!(criu.read("missing.img"), None);
    drop(criu);
    let (code, err) = finish(child);
    assert_eq!(code, Some(0), "{err}");
}

#[test]
fn capture_without_inventory_publishes_nothing() {
    let tmp = tempfile::tempdir().unwrap();
    let arc = tmp.path().join("a.czr");
    let files: Vec<_> = images().into_iter().filter(|f| f.0 != "inventory.img").collect();
    let (code, err) = capture(tmp.path(), &arc, &files);
    assert_eq!(code, Some(1), "{err}");
    assert!(err.contains("inventory.img"), "{err}");
    assert!(!arc.exists());
    let left: Vec<_> = std::fs::read_dir(tmp.path()).unwrap().flatten().map(|e| e.file_name()).collect();
    assert!(left.is_empty(), "left behind: {left:?}");
}

#[test]
fn capture_to_stdout_that_fails_does_not_verify() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("stdout.czr");
    let child = Command::new(CRIUZ)
        .args(["capture", "-D", tmp.path().to_str().unwrap(), "-o", "-"])
        .stdout(std::fs::File::create(&out).unwrap())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut criu = FakeCriu::connect(&tmp.path().join("streamer-capture.sock"));
    let mut pipe = criu.open_for_write("pages-1.img");
    pipe.write_all(&vec![7u8; 1 << 20]).unwrap();
    drop(pipe);
    drop(criu);
    let (code, err) = finish(child);
    assert_eq!(code, Some(1), "{err}");
    // Whatever went out before the abort (the header, perhaps blocks) must
    // not read as an archive.
    let v = Command::new(CRIUZ).arg("verify").arg(&out).output().unwrap();
    assert_eq!(v.status.code(), Some(3), "an aborted capture must not verify");
    assert!(String::from_utf8_lossy(&v.stderr).contains("truncated"));
}

#[test]
fn serve_refuses_crafted_archives_before_anything_is_served() {
    let tmp = tempfile::tempdir().unwrap();
    let arc = tmp.path().join("a.czr");
    let (code, err) = capture(tmp.path(), &arc, &images());
    assert_eq!(code, Some(0), "{err}");
    let good = std::fs::read(&arc).unwrap();
    // Two blocks of pages-1.img with equal record lengths, swapped.
    let mut blocks = Vec::new();
    let mut pos = 64;
    while pos < good.len() && good[pos] != b'I' {
        let len = match good[pos] {
            b'F' => 12 + u16::from_le_bytes([good[pos + 2], good[pos + 3]]) as usize,
            b'B' => {
                let raw = u32::from_le_bytes(good[pos + 8..pos + 12].try_into().unwrap()) as usize;
                let m = if good[pos + 2] & 1 != 0 { raw.div_ceil(4096).div_ceil(8) } else { 0 };
                32 + m + u32::from_le_bytes(good[pos + 12..pos + 16].try_into().unwrap()) as usize
            }
            _ => 28,
        };
        if good[pos] == b'B' {
            blocks.push((pos, len));
        }
        pos += len;
    }
    let (x, y) = blocks
        .iter()
        .enumerate()
        .find_map(|(i, a)| {
            blocks[i + 1..]
                .iter()
                .find(|b| b.1 == a.1 && good[a.0 + 4..a.0 + 8] == good[b.0 + 4..b.0 + 8])
                .map(|b| (*a, *b))
        })
        .expect("two blocks of one file with equal lengths");
    let mut bad = good.clone();
    bad[x.0..x.0 + x.1].copy_from_slice(&good[y.0..y.0 + y.1]);
    bad[y.0..y.0 + y.1].copy_from_slice(&good[x.0..x.0 + x.1]);
    let bad_path = tmp.path().join("bad.czr");
    std::fs::write(&bad_path, &bad).unwrap();
    let (code, err) = finish(spawn(&["serve", "-D", tmp.path().to_str().unwrap(), "-i", bad_path.to_str().unwrap()]));
    assert_eq!(code, Some(3), "{err}");
    assert!(err.contains("does not match its end record"), "{err}");
    assert!(!tmp.path().join("streamer-serve.sock").exists(), "nothing may be served");

    // A damaged payload deep in the pages image: structure intact, so serving
    // starts; the pages image must stop short and serve must fail as damaged.
    // The block is one of the pages image's (the file with most blocks) with
    // a payload to damage: the archive's block order depends on how capture
    // interleaved the files, and a zero block's record is all header.
    let file_of = |b: &(usize, usize)| good[b.0 + 4..b.0 + 8].to_vec();
    let pages_file =
        blocks.iter().map(file_of).max_by_key(|f| blocks.iter().filter(|b| file_of(b) == *f).count()).unwrap();
    let stored = |b: &(usize, usize)| u32::from_le_bytes(good[b.0 + 12..b.0 + 16].try_into().unwrap());
    let payloads: Vec<_> = blocks.iter().filter(|b| file_of(b) == pages_file && stored(b) >= 16).collect();
    let mut bad = good.clone();
    let &(b, len) = payloads[payloads.len() / 2];
    bad[b + len - 10] ^= 0x20;
    std::fs::write(&bad_path, &bad).unwrap();
    let child = spawn(&["serve", "-D", tmp.path().to_str().unwrap(), "-i", bad_path.to_str().unwrap()]);
    let mut criu = FakeCriu::connect(&tmp.path().join("streamer-serve.sock"));
    let files = images();
    let served = criu.read("pages-1.img").unwrap_or_default();
    assert!(served.len() < files[0].1.len(), "a damaged pages image was served whole");
    drop(criu);
    let (code, err) = finish(child);
    assert_eq!(code, Some(3), "{err}");
}

/// A CRIU image: the common magic, the image's magic, then u32-length
/// prefixed protobuf objects.
fn criu_image(magic: u32, objs: &[Vec<u8>]) -> Vec<u8> {
    let mut v = 0x5456_4319u32.to_ne_bytes().to_vec();
    v.extend_from_slice(&magic.to_ne_bytes());
    for o in objs {
        v.extend_from_slice(&(o.len() as u32).to_ne_bytes());
        v.extend_from_slice(o);
    }
    v
}

fn varint(mut x: u64, out: &mut Vec<u8>) {
    while x >= 0x80 {
        out.push(x as u8 | 0x80);
        x >>= 7;
    }
    out.push(x as u8);
}

fn field(tag: u64, value: u64, out: &mut Vec<u8>) {
    varint(tag << 3, out);
    varint(value, out);
}

/// A process whose private anonymous memory has zero pages, with a pagemap
/// as CRIU writes it, or with the fields of CRIU's own page compression.
fn process_images(compressed: bool) -> Vec<(&'static str, Vec<u8>)> {
    let mut vma = Vec::new();
    field(1, 0x10000, &mut vma);
    field(2, 0x18000, &mut vma);
    field(6, (libc::MAP_PRIVATE | libc::MAP_ANONYMOUS) as u64, &mut vma);
    field(7, 1 | 1 << 9, &mut vma); // VMA_AREA_REGULAR | VMA_ANON_PRIVATE
    let mut mm = vec![14 << 3 | 2];
    varint(vma.len() as u64, &mut mm);
    mm.extend_from_slice(&vma);
    let mut head = Vec::new();
    field(1, 1, &mut head);
    let mut entry = Vec::new();
    field(1, 0x10000, &mut entry);
    field(2, 8, &mut entry);
    field(4, 4, &mut entry); // PE_PRESENT
    if compressed {
        entry.extend_from_slice(&[6 << 3 | 2, 2, 0x80, 0x20]); // compressed_size = [4096]
        field(7, 4096, &mut entry); // total_compressed_size
        field(8, 8, &mut entry); // region_pages
    }
    let mut pages = vec![0u8; 8 * 4096];
    for p in [1usize, 4, 6] {
        pages[p * 4096..(p + 1) * 4096].fill(p as u8 + 1);
    }
    vec![
        ("mm-7.img", criu_image(0x5749_2820, &[mm])),
        ("pagemap-7.img", criu_image(0x5608_4025, &[head, entry])),
        ("pages-1.img", pages),
        ("inventory.img", b"inventory".to_vec()),
    ]
}

#[test]
fn pages_compressed_by_criu_itself_are_served_untouched() {
    for compressed in [false, true] {
        let tmp = tempfile::tempdir().unwrap();
        let arc = tmp.path().join("a.czr");
        let files = process_images(compressed);
        let (code, err) = capture(tmp.path(), &arc, &files);
        assert_eq!(code, Some(0), "{err}");
        let child = spawn(&["serve", "-D", tmp.path().to_str().unwrap(), "-i", arc.to_str().unwrap()]);
        let mut criu = FakeCriu::connect(&tmp.path().join("streamer-serve.sock"));
        let pagemap = criu.read("pagemap-7.img").unwrap();
        let pages = criu.read("pages-1.img").unwrap();
        drop(criu);
        let (code, err) = finish(child);
        assert_eq!(code, Some(0), "{err}");
        if compressed {
            assert!(pagemap == files[1].1, "a compressed pagemap must be served as it was");
            assert!(pages == files[2].1, "compressed pages must be served as they were");
        } else {
            // Control: the plain pagemap is rewritten and its zero pages left out.
            assert!(pagemap != files[1].1, "the zero-page plan should apply to a plain pagemap");
            assert_eq!(pages.len(), 3 * 4096);
        }
    }
}

#[test]
fn an_incremental_archive_is_served_with_its_parent() {
    let tmp = tempfile::tempdir().unwrap();
    let (img, arc, child) = (tmp.path().join("img"), tmp.path().join("a.czr"), tmp.path().join("b.czr"));
    std::fs::create_dir(&img).unwrap();
    let mut files = images();
    for (name, data) in &files {
        std::fs::write(img.join(name), data).unwrap();
    }
    let pack = |out: &std::path::Path, parent: Option<&std::path::Path>| {
        let mut cmd = Command::new(CRIUZ);
        cmd.arg("pack").arg(&img).arg("-o").arg(out).args(["--block-size", "16K"]);
        if let Some(p) = parent {
            cmd.arg("--parent").arg(p);
        }
        let out = cmd.output().unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    };
    pack(&arc, None);
    // A few pages of the pages image change; the rest must come from the parent.
    files[0].1[5 * 4096..6 * 4096].fill(0x5a);
    std::fs::write(img.join(files[0].0), &files[0].1).unwrap();
    pack(&child, Some(&arc));
    assert!(std::fs::metadata(&child).unwrap().len() * 4 < std::fs::metadata(&arc).unwrap().len());

    let child_path = child.to_str().unwrap();
    let child_run = spawn(&["serve", "-D", tmp.path().to_str().unwrap(), "-i", child_path]);
    let mut criu = FakeCriu::connect(&tmp.path().join("streamer-serve.sock"));
    for (name, data) in &files {
        assert!(criu.read(name).as_deref() == Some(&data[..]), "{name} served differently");
    }
    drop(criu);
    let (code, err) = finish(child_run);
    assert_eq!(code, Some(0), "{err}");

    // Without its parent, nothing is served.
    std::fs::rename(&arc, tmp.path().join("gone.czr")).unwrap();
    let (code, err) = finish(spawn(&["serve", "-D", tmp.path().to_str().unwrap(), "-i", child_path]));
    assert_eq!(code, Some(1), "{err}");
    assert!(err.contains("not found"), "{err}");
}

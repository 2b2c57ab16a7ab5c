//! Archives in S3 with real CRIU, against moto's S3 server on 127.0.0.1: a
//! dump to an object restores intact, placed and streamed; inspect, verify and unpack read
//! objects; a missing bucket, wrong credentials, an existing key, no room in
//! TMPDIR, a garbage or damaged object, and a forged index that only the
//! walk behind a restore started from the index can tell, each give one line
//! and the exit status of their kind; a dump that fails leaves neither an
//! object nor an open multipart upload; the server dying mid-upload leaves
//! the process running and mid-restore starts nothing; an incremental child
//! and its parent both in S3; a lazy restore from an object; `capture -o
//! s3://` and `serve -i s3://` for stock CRIU. And migration: `dump -o - |
//! restore -i -` through a pipe.

// Tests start processes of their own; clippy.toml's rule is for the
// programs criuz runs.
#![allow(clippy::disallowed_methods)]

mod common;

use common::*;
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

const BUCKET: &str = "ckpt";

/// A moto S3 server of our own on a free loopback port, killed on drop.
struct Moto {
    child: Child,
    port: u16,
}

impl Moto {
    /// `auth`: check credentials (moto accepts any by default).
    fn start(auth: bool) -> Moto {
        let port = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let mut cmd = Command::new("moto_server");
        cmd.args(["-H", "127.0.0.1", "-p", &port.to_string()]).stdout(Stdio::null()).stderr(Stdio::null());
        if auth {
            cmd.env("INITIAL_NO_AUTH_ACTION_COUNT", "0");
        }
        // As for CRIU: a root or CI run must have the server (setup installs it).
        let child = cmd.spawn().expect("moto_server must be installed (scripts/setup.sh installs it)");
        let m = Moto { child, port };
        wait_for("moto_server to listen", Duration::from_secs(30), || TcpStream::connect(("127.0.0.1", port)).is_ok());
        m
    }

    /// A server that accepts any credentials, with the tests' bucket.
    fn with_bucket() -> Moto {
        let m = Moto::start(false);
        m.create_bucket(BUCKET);
        m
    }

    fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// A raw, unsigned request (moto does not check signatures unless told
    /// to): the test's own view of the bucket, independent of criuz.
    fn http(&self, method: &str, path: &str, body: &[u8]) -> (u16, String) {
        let mut s = TcpStream::connect(("127.0.0.1", self.port)).unwrap();
        let head = format!(
            "{method} {path} HTTP/1.1\r\nHost: 127.0.0.1:{}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
            self.port,
            body.len()
        );
        s.write_all(head.as_bytes()).unwrap();
        s.write_all(body).unwrap();
        let mut reply = String::new();
        s.read_to_string(&mut reply).unwrap();
        let status = reply.split_whitespace().nth(1).and_then(|c| c.parse().ok()).unwrap_or(0);
        (status, reply)
    }

    fn create_bucket(&self, name: &str) {
        let (status, reply) = self.http("PUT", &format!("/{name}"), b"");
        assert_eq!(status, 200, "create bucket: {reply}");
    }

    /// Keys in the bucket and multipart uploads still open.
    fn keys_and_uploads(&self) -> (Vec<String>, usize) {
        let (_, list) = self.http("GET", &format!("/{BUCKET}?list-type=2"), b"");
        let keys = list.split("<Key>").skip(1).filter_map(|k| k.split("</Key>").next()).map(String::from).collect();
        let (_, uploads) = self.http("GET", &format!("/{BUCKET}?uploads"), b"");
        (keys, uploads.matches("<Upload>").count())
    }

    fn criuz(&self, args: &[&str]) -> std::process::Output {
        run(&mut self.command(args))
    }

    fn command(&self, args: &[&str]) -> Command {
        let mut c = Command::new(CRIUZ);
        c.args(args)
            .env("AWS_ENDPOINT_URL", self.endpoint())
            .env("AWS_ACCESS_KEY_ID", "criuz-test")
            .env("AWS_SECRET_ACCESS_KEY", "criuz-test-secret")
            .env("AWS_REGION", "us-east-1");
        c
    }
}

impl Drop for Moto {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn ok(out: std::process::Output, what: &str) -> std::process::Output {
    assert!(out.status.success(), "{what} failed: {}", String::from_utf8_lossy(&out.stderr));
    out
}

/// Exit status `code` and a single line of error naming `url` (besides
/// the line that says which CRIU is used).
fn fails(out: &std::process::Output, code: i32, url: &str, what: &str) -> String {
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    assert_eq!(out.status.code(), Some(code), "{what}: {err}");
    one_error_line(&err, url, what);
    err
}

/// The JSON report a command printed.
fn json(out: std::process::Output) -> serde_json::Value {
    serde_json::from_slice(&out.stdout).unwrap()
}

fn one_error_line(err: &str, url: &str, what: &str) {
    let lines: Vec<&str> = err.lines().filter(|l| !l.starts_with("criuz: using CRIU")).collect();
    assert_eq!(lines.len(), 1, "{what}: one line expected: {err}");
    assert!(lines[0].contains(url), "{what}: the error must name {url}: {err}");
}

#[test]
fn dump_to_and_restore_from_s3_with_faults() {
    let Some(_criu) = criu() else { return };
    let _g = serial();
    let moto = Moto::with_bucket();
    let url = format!("s3://{BUCKET}/ckpt/mixed.czr");
    let mut w = Workload::start(Spec { mib: 32, pattern: "mixed", mode: "tree", ..Default::default() });
    let before = w.sums();

    // A dump that CRIU fails (an option it does not know): the upload had
    // begun, and must be gone.
    let pid = w.pid.to_string();
    let out = moto.criuz(&["dump", "-t", &pid, "-o", &url, "--leave-running", "--", "--no-such-criu-option"]);
    assert_eq!(out.status.code(), Some(1), "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(moto.keys_and_uploads(), (vec![], 0), "a failed dump must leave no object and no open upload");
    assert!(w.alive());

    ok(moto.criuz(&["dump", "-t", &pid, "-o", &url]), "dump to S3");
    assert_eq!(moto.keys_and_uploads(), (vec!["ckpt/mixed.czr".to_string()], 0));
    w.reap_original();

    // Readers take the object.
    let rep = json(ok(moto.criuz(&["inspect", "--json", &url]), "inspect"));
    assert!(rep["total"]["raw_bytes"].as_u64().unwrap() > 32 << 20, "{rep}");
    ok(moto.criuz(&["verify", &url]), "verify");
    let tmp = tempfile::tempdir().unwrap();
    let img = tmp.path().join("img");
    ok(moto.criuz(&["unpack", &url, "--dir", img.to_str().unwrap()]), "unpack");
    assert!(img.join("inventory.img").exists());

    // An existing key is kept unless --force.
    let out = moto.criuz(&["pack", img.to_str().unwrap(), "-o", &url]);
    fails(&out, 2, &url, "pack over an existing object");
    let copy = format!("s3://{BUCKET}/ckpt/copy.czr");
    ok(moto.criuz(&["pack", img.to_str().unwrap(), "-o", &copy]), "pack to S3");

    // A forked tree sharing its memory streams by default, as from a file
    // (restore_from_s3_is_placed_by_default has a tree that does not);
    // placed if asked.
    let rep = json(ok(moto.criuz(&["restore", "-d", "--json", "-i", &url]), "restore from S3"));
    assert_eq!(rep["fill"], "stream", "{rep}");
    assert!(rep["not_placed"].as_str().unwrap().contains("share"), "{rep}");
    assert_eq!(w.sums(), before, "memory restored from S3 differs");
    w.stop();
    w.reap_original();
    let rep =
        json(ok(moto.criuz(&["restore", "-d", "--json", "--fill", "place", "-i", &url]), "placed restore from S3"));
    assert_eq!(rep["fill"], "place", "{rep}");
    assert_eq!(w.sums(), before, "memory placed from S3 differs");
    w.stop();
    w.reap_original();

    // Garbage, and a real archive with one byte changed: exit 3, nothing runs.
    let (status, reply) = moto.http("PUT", &format!("/{BUCKET}/garbage.czr"), &[0x5a; 100_000]);
    assert_eq!(status, 200, "{reply}");
    let garbage = format!("s3://{BUCKET}/garbage.czr");
    fails(&moto.criuz(&["restore", "-d", "-i", &garbage]), 3, &garbage, "restore of garbage");
    let packed = tmp.path().join("packed.czr");
    ok(moto.criuz(&["pack", img.to_str().unwrap(), "-o", packed.to_str().unwrap()]), "pack");
    let mut bytes = std::fs::read(&packed).unwrap();
    let at = bytes.len() / 2;
    bytes[at] ^= 0x40;
    let (status, reply) = moto.http("PUT", &format!("/{BUCKET}/damaged.czr"), &bytes);
    assert_eq!(status, 200, "{reply}");
    let damaged = format!("s3://{BUCKET}/damaged.czr");
    fails(&moto.criuz(&["restore", "-d", "-i", &damaged]), 3, &damaged, "restore of a damaged object");
    assert!(!w.alive(), "nothing may run from a damaged archive");
    // CRIU may have begun the tree (it starts from the index): its dead
    // tasks are re-parented to this test, which must reap them.
    w.reap_original();

    // A forged index (two pages blocks swapped, every check recomputed): the
    // restore starts CRIU from the index, so only the walk behind it can
    // tell. Placed, the tree it held is killed before it ran; streamed, CRIU
    // is stopped before the process runs.
    let forged = forge_index(&std::fs::read(&packed).unwrap(), swap_indexed_blocks);
    let (status, reply) = moto.http("PUT", &format!("/{BUCKET}/forged.czr"), &forged);
    assert_eq!(status, 200, "{reply}");
    let forged = format!("s3://{BUCKET}/forged.czr");
    let err = fails(&moto.criuz(&["restore", "-d", "-i", &forged]), 3, &forged, "restore of a forged index");
    assert!(err.contains("before the restored tree ran") && err.contains("does not match"), "CRIU had started: {err}");
    assert!(!w.alive(), "nothing may run from a forged index");
    w.reap_original();
    let streamed = moto.criuz(&["restore", "-d", "--fill", "stream", "-i", &forged]);
    let err = fails(&streamed, 3, &forged, "streamed restore of a forged index");
    assert!(err.contains("restore aborted") && err.contains("does not match"), "CRIU had started: {err}");
    assert!(!w.alive(), "nothing may run from a forged index");
    w.reap_original();

    // Missing key, missing bucket: wrong names, exit 2, as a missing file's.
    let missing = format!("s3://{BUCKET}/nope.czr");
    let err = fails(&moto.criuz(&["restore", "-d", "-i", &missing]), 2, &missing, "missing key");
    assert!(err.contains("no such object"), "{err}");
    let nobucket = "s3://no-such-bucket/x.czr";
    let err = fails(&moto.criuz(&["inspect", nobucket]), 2, nobucket, "missing bucket");
    assert!(err.contains("no such bucket"), "{err}");
    let err = fails(&moto.criuz(&["pack", img.to_str().unwrap(), "-o", nobucket]), 2, nobucket, "missing bucket");
    assert!(err.contains("NoSuchBucket"), "{err}");

    // No room in $TMPDIR for the download: said before anything is fetched.
    let small = tmp.path().join("small");
    std::fs::create_dir(&small).unwrap();
    let mounted = run(Command::new("mount").args(["-t", "tmpfs", "-o", "size=1m", "tmpfs"]).arg(&small));
    assert!(mounted.status.success(), "mount a small tmpfs: {}", String::from_utf8_lossy(&mounted.stderr));
    let out = run(moto.command(&["restore", "-d", "-i", &url]).env("TMPDIR", &small));
    let _ = Command::new("umount").arg(&small).status();
    let err = fails(&out, 1, &url, "a download with no room");
    assert!(err.contains("no room") && err.contains(small.to_str().unwrap()), "{err}");

    // Wrong credentials, on a server that checks them.
    let strict = Moto::start(true);
    let err = fails(&strict.criuz(&["inspect", &url]), 1, &url, "wrong credentials");
    assert!(err.contains("access denied"), "{err}");
    let err = fails(&strict.criuz(&["pack", img.to_str().unwrap(), "-o", &url]), 1, &url, "wrong credentials");
    assert!(err.contains("access denied"), "{err}");
}

/// Runs `cmd`, stops the server once `when` returns, and expects `cmd` to
/// fail with exit status 1; gives its stderr.
fn stop_server_during(moto: Moto, mut cmd: Command, when: impl FnOnce(&Moto)) -> String {
    let mut child = cmd.stderr(Stdio::piped()).spawn().unwrap();
    when(&moto);
    drop(moto);
    let mut err = String::new();
    child.stderr.take().unwrap().read_to_string(&mut err).unwrap();
    assert_eq!(child.wait().unwrap().code(), Some(1), "with the server gone: {err}");
    err
}

#[test]
fn server_dying_mid_upload_keeps_the_process_and_mid_restore_starts_nothing() {
    let Some(_criu) = criu() else { return };
    let _g = serial();
    // Random pages do not compress: the upload, not CRIU, sets the pace.
    let mut w = Workload::start(Spec { mib: 256, pattern: "random", ..Default::default() });
    let before = w.sums();
    let url = format!("s3://{BUCKET}/big.czr");
    let pid = w.pid.to_string();

    let moto = Moto::with_bucket();
    let dump = moto.command(&["dump", "-t", &pid, "-o", &url]);
    let err = stop_server_during(moto, dump, |m| {
        wait_for("the upload to begin", Duration::from_secs(30), || m.keys_and_uploads().1 == 1);
        std::thread::sleep(Duration::from_millis(300));
    });
    one_error_line(&err, &url, "dump with the server gone");
    assert!(w.alive(), "CRIU had not finished: the process must still run");
    assert_eq!(w.sums(), before, "the process's memory changed");

    let moto = Moto::with_bucket();
    ok(moto.criuz(&["dump", "-t", &pid, "-o", &url]), "dump to S3");
    w.reap_original();
    let restore = moto.command(&["restore", "-d", "-i", &url]);
    let err = stop_server_during(moto, restore, |_| std::thread::sleep(Duration::from_millis(400)));
    one_error_line(&err, &url, "restore with the server gone");
    assert!(!w.alive(), "nothing may run from a partly fetched archive");
}

/// Live migration's shape: the dump's stdout is the restore's stdin (ssh in
/// real life). The relay keeps the restore's stdin open until the original
/// is reaped, as on another host its pid would be free.
#[test]
fn migration_through_a_pipe() {
    let Some(_criu) = criu() else { return };
    let _g = serial();
    let mut w = Workload::start(Spec { mib: 64, pattern: "mixed", mode: "tree", ..Default::default() });
    let before = w.sums();
    let pid = w.pid.to_string();
    let mut dump = Command::new(CRIUZ).args(["dump", "-t", &pid, "-o", "-"]).stdout(Stdio::piped()).spawn().unwrap();
    let mut restore = Command::new(CRIUZ)
        .args(["restore", "-d", "-i", "-"])
        .stdin(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let (mut from, mut to) = (dump.stdout.take().unwrap(), restore.stdin.take().unwrap());
    let relay = std::thread::spawn(move || {
        std::io::copy(&mut from, &mut to).unwrap();
        to
    });
    assert!(dump.wait().unwrap().success(), "dump to stdout");
    let to = relay.join().unwrap();
    w.reap_original();
    drop(to);
    let mut err = String::new();
    restore.stderr.take().unwrap().read_to_string(&mut err).unwrap();
    assert!(restore.wait().unwrap().success(), "restore from stdin: {err}");
    assert_eq!(w.sums(), before, "memory migrated through the pipe differs");
    w.stop();
}

/// An incremental chain kept in S3: the child names its parent's key, and a
/// restore from the child's URL finds the parent there.
#[test]
fn incremental_child_and_parent_in_s3() {
    let Some(_criu) = criu() else { return };
    let _g = serial();
    let moto = Moto::with_bucket();
    let (full, child) = (format!("s3://{BUCKET}/inc/full.czr"), format!("s3://{BUCKET}/inc/child.czr"));
    let mut w = Workload::start(Spec { mib: 32, pattern: "mixed", ..Default::default() });
    let pid = w.pid.to_string();
    ok(moto.criuz(&["dump", "-t", &pid, "-o", &full, "--leave-running"]), "full dump to S3");
    w.rewrite(5.0, 7);
    let before = w.sums();
    ok(moto.criuz(&["dump", "-t", &pid, "-o", &child, "--parent", &full]), "incremental dump to S3");
    w.reap_original();

    let rep = json(ok(moto.criuz(&["inspect", "--json", &child]), "inspect"));
    assert_eq!(rep["chain"][0]["hint"], "full.czr", "{rep}");
    let stored = rep["archive_bytes"].as_u64().unwrap();
    let rewritten = (32u64 << 20) / 20;
    assert!(stored < rewritten * 11 / 10 + (1 << 20), "the child stores {stored} bytes");
    ok(moto.criuz(&["verify", &child]), "verify of the child with its parent in S3");
    ok(moto.criuz(&["restore", "-d", "-i", &child]), "restore of the child from S3");
    assert_eq!(w.sums(), before, "memory restored from the chain in S3 differs");
    w.stop();
}

/// A restore from an object places the memory by default, as from a file
/// (the fill reads each block as its chunk arrives), and a damaged block
/// kills the held tree before it ran; `--fill stream` still streams it.
#[test]
fn restore_from_s3_is_placed_by_default() {
    let Some(_criu) = criu() else { return };
    let _g = serial();
    let moto = Moto::with_bucket();
    let url = format!("s3://{BUCKET}/placed.czr");
    let mut w = Workload::start(Spec { mib: 64, pattern: "text", mode: "threads", ..Default::default() });
    let before = w.sums();
    let tmp = tempfile::tempdir().unwrap();
    let file = tmp.path().join("placed.czr");
    ok(moto.criuz(&["dump", "-t", &w.pid.to_string(), "-o", file.to_str().unwrap()]), "dump");
    w.reap_original();
    let bytes = std::fs::read(&file).unwrap();
    let (status, reply) = moto.http("PUT", &format!("/{BUCKET}/placed.czr"), &bytes);
    assert_eq!(status, 200, "{reply}");

    let rep = json(ok(moto.criuz(&["restore", "-d", "--json", "-i", &url]), "restore from S3"));
    assert_eq!(rep["fill"], "place", "{rep}");
    assert!(rep["not_placed"].is_null(), "{rep}");
    assert_eq!(w.sums(), before, "memory placed from S3 differs");
    w.kill_and_reap();
    let rep = json(ok(moto.criuz(&["restore", "-d", "--json", "--fill", "stream", "-i", &url]), "streamed restore"));
    assert_eq!(rep["fill"], "stream", "{rep}");
    assert_eq!(w.sums(), before, "memory streamed from S3 differs");
    w.kill_and_reap();

    // One byte flipped in the middle of the pages: the fill finds it, and
    // the tree it held never runs.
    let mut damaged = bytes;
    let at = damaged.len() / 2;
    damaged[at] ^= 0x40;
    let (status, reply) = moto.http("PUT", &format!("/{BUCKET}/damaged.czr"), &damaged);
    assert_eq!(status, 200, "{reply}");
    let damaged = format!("s3://{BUCKET}/damaged.czr");
    let err = fails(&moto.criuz(&["restore", "-d", "-i", &damaged]), 3, &damaged, "placed restore of damage");
    assert!(err.contains("before the restored tree ran"), "{err}");
    assert!(!w.alive(), "nothing may run from a damaged archive");
    w.reap_original();
}

/// A lazy restore from an object: the process runs, then its pages arrive.
#[test]
fn lazy_restore_from_s3() {
    let Some(_criu) = criu() else { return };
    let _g = serial();
    let moto = Moto::with_bucket();
    let url = format!("s3://{BUCKET}/lazy.czr");
    let mut w = Workload::start(Spec { mib: 32, pattern: "mixed", mode: "tree", ..Default::default() });
    let before = w.sums();
    ok(moto.criuz(&["dump", "-t", &w.pid.to_string(), "-o", &url]), "dump to S3");
    w.reap_original();
    ok(moto.criuz(&["restore", "--lazy", "-d", "-i", &url]), "lazy restore from S3");
    assert_eq!(w.sums(), before, "memory restored lazily from S3 differs");
    w.stop();
}

/// An encrypted archive in an object store: restored eagerly (opened from
/// its sealed index while it downloads) and lazily; without the key, nothing.
#[test]
fn encrypted_archive_in_s3_restores_eagerly_and_lazily() {
    let Some(_criu) = criu() else { return };
    let _g = serial();
    let moto = Moto::with_bucket();
    let tmp = tempfile::tempdir().unwrap();
    let key = tmp.path().join("me.key");
    let out = ok(criuz(&["keygen", "-o", key.to_str().unwrap()]), "keygen");
    let public = String::from_utf8(out.stdout).unwrap().trim().to_string();
    let url = format!("s3://{BUCKET}/sealed.czr");
    let mut w = Workload::start(Spec { mib: 32, pattern: "mixed", mode: "tree", ..Default::default() });
    let before = w.sums();
    ok(moto.criuz(&["dump", "-t", &w.pid.to_string(), "-o", &url, "--recipient", &public]), "encrypted dump to S3");
    w.reap_original();
    let out = moto.criuz(&["restore", "-d", "-i", &url]);
    fails(&out, 2, &url, "restore without the key");
    assert!(!w.alive(), "a process runs after a restore without the key");
    let k = key.to_str().unwrap();
    ok(moto.criuz(&["restore", "-d", "-i", &url, "--identity", k]), "restore from S3");
    assert_eq!(w.sums(), before, "memory restored from S3 differs");
    w.stop();
    let pids = w.pids.clone();
    wait_for("the restored tree to be gone", Duration::from_secs(10), || {
        reap_zombies();
        pids.iter().all(|p| process_state(*p).is_none())
    });
    ok(moto.criuz(&["restore", "--lazy", "-d", "-i", &url, "--identity", k]), "lazy restore from S3");
    assert_eq!(w.sums(), before, "memory restored lazily from S3 differs");
    w.stop();
}

/// Stock CRIU through criuz's socket protocol, the archive in S3: `capture
/// -o s3://` under `criu dump --stream`, then `serve -i s3://` under `criu
/// restore --stream`.
#[test]
fn capture_to_and_serve_from_s3_for_stock_criu() {
    let Some(criu) = criu() else { return };
    let _g = serial();
    let moto = Moto::with_bucket();
    let url = format!("s3://{BUCKET}/captured.czr");
    let mut w = Workload::start(Spec { mode: "tree", ..Default::default() });
    let before = w.sums();
    let tmp = tempfile::tempdir().unwrap();
    let (dumped, served) = (tmp.path().join("dump"), tmp.path().join("serve"));
    std::fs::create_dir(&dumped).unwrap();
    std::fs::create_dir(&served).unwrap();

    let mut capture = moto.command(&["capture", "-D", dumped.to_str().unwrap(), "-o", &url]).spawn().unwrap();
    wait_for("capture socket", Duration::from_secs(10), || dumped.join("streamer-capture.sock").exists());
    let pid = w.pid.to_string();
    let out = run(Command::new(&criu).args(["dump", "--stream", "-o", "dump.log", "-t", &pid, "-D"]).arg(&dumped));
    assert!(out.status.success(), "criu dump --stream: {}", log_tail(&dumped.join("dump.log")));
    assert!(capture.wait().unwrap().success(), "capture to S3");
    assert_eq!(moto.keys_and_uploads(), (vec!["captured.czr".to_string()], 0));
    w.reap_original();

    let mut serve = moto.command(&["serve", "-D", served.to_str().unwrap(), "-i", &url]).spawn().unwrap();
    wait_for("serve socket", Duration::from_secs(10), || served.join("streamer-serve.sock").exists());
    let out = run(Command::new(&criu).args(["restore", "--stream", "-d", "-o", "restore.log", "-D"]).arg(&served));
    assert!(out.status.success(), "criu restore --stream: {}", log_tail(&served.join("restore.log")));
    assert!(serve.wait().unwrap().success(), "serve from S3");
    assert_eq!(w.sums(), before, "memory served from S3 differs");
    w.stop();
}

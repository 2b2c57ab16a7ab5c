//! The configurations compared: how a checkpoint is taken, stored and brought
//! back. Each runs the same commands a user would, and is timed from the
//! first command until the checkpoint is complete at its destination (dump)
//! or until CRIU reports the process restored (restore).

use crate::error::{Error, Result};
use crate::proc::{self, Dst, Src, Usage};
use criuz::criu::Criu;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Config {
    /// criu dump -D / criu restore -D on the local disk.
    CriuDir,
    /// The same on a tmpfs.
    CriuTmpfs,
    /// criu dump -D, then `sync`: the images made as durable as criuz's
    /// archive (fsynced before it is published) is. Restored as criu-dir.
    CriuDirSync,
    /// criu dump -D, then tar | lz4 -1 into one file.
    CriuLz4,
    /// criu dump -D, then tar | zstd -1 -T0 into one file.
    CriuZstd,
    /// criu dump -D, then criuz pack; criuz unpack, then criu restore -D.
    CriuzPack,
    /// criuz dump / criuz restore (its default: memory placed by criuz), lz4.
    CriuzLz4,
    /// criuz dump / criuz restore, zstd.
    CriuzZstd,
    /// criuz-lz4, the archive encrypted to an age recipient (restored with
    /// its identity).
    CriuzLz4Sealed,
    /// criuz-zstd, encrypted.
    CriuzZstdSealed,
    /// criuz-lz4, restored with `--fill place` (criuz copies every page in
    /// while the tree is held stopped).
    CriuzLz4Place,
    /// criuz-zstd, restored with `--fill place`.
    CriuzZstdPlace,
    /// criuz-lz4, restored with `--fill stream` (every page through CRIU's
    /// image stream).
    CriuzLz4Stream,
    /// criuz-zstd, restored with `--fill stream`.
    CriuzZstdStream,
    /// criuz-lz4, restored with `--no-huge-pages` (4 KiB pages placed even
    /// where the process had transparent huge pages).
    CriuzLz4SmallPages,
    /// criuz-lz4, restored with `--huge-page-floor 0` (huge pages placed
    /// however slowly the kernel gives them: what giving up on slow ones
    /// saves).
    CriuzLz4HugeAlways,
    /// criuz-lz4 dumped with `--ids` (every stored page hashed, each page
    /// stored once): what the ids cost where the memory repeats nothing.
    CriuzLz4Ids,
    /// criuz-zstd dumped with `--ids`.
    CriuzZstdIds,
    /// criuz-lz4 dumped with `--no-planes`: what the byte planes of 16-bit
    /// floats cost and gain.
    CriuzLz4Flat,
    /// criuz-zstd dumped with `--no-planes`.
    CriuzZstdFlat,
    /// criuz-lz4 dumped with `--ids --no-planes`: against criuz-lz4-ids,
    /// what the planes cost in a dump of a CUDA tree (which has page ids by
    /// default), on the `gpu-image` stand-in.
    CriuzLz4IdsFlat,
    /// criuz dump -o s3://... / criuz restore -i s3://... (lz4).
    CriuzS3,
    /// criuz-s3 restored through CRIU's stream (`--fill stream`), as a
    /// restore from an object was before session 97.
    CriuzS3Stream,
    /// criuz dump to a file, then boto3 uploads it; boto3 downloads it,
    /// then criuz restore from the file.
    CriuzBoto3,
}

impl Config {
    pub const ALL: [Config; 7] = [
        Config::CriuDir,
        Config::CriuTmpfs,
        Config::CriuLz4,
        Config::CriuZstd,
        Config::CriuzPack,
        Config::CriuzLz4,
        Config::CriuzZstd,
    ];

    /// Run only when asked for (`--configs`): they start an S3 server.
    pub const S3: [Config; 3] = [Config::CriuzS3, Config::CriuzS3Stream, Config::CriuzBoto3];

    /// Run only when asked for: raw CRIU's images made durable.
    pub const SYNCED: [Config; 1] = [Config::CriuDirSync];

    /// Run only when asked for: encrypted archives (issue 12's comparison).
    pub const SEALED: [Config; 2] = [Config::CriuzLz4Sealed, Config::CriuzZstdSealed];

    /// Run only when asked for: restores placed by criuz whatever the
    /// default (`--fill place`), or streamed through CRIU (`--fill stream`).
    pub const FILL: [Config; 6] = [
        Config::CriuzLz4Place,
        Config::CriuzZstdPlace,
        Config::CriuzLz4Stream,
        Config::CriuzZstdStream,
        Config::CriuzLz4SmallPages,
        Config::CriuzLz4HugeAlways,
    ];

    /// Run only when asked for: dumps with page ids.
    pub const IDS: [Config; 2] = [Config::CriuzLz4Ids, Config::CriuzZstdIds];

    /// Run only when asked for: dumps without byte planes.
    pub const FLAT: [Config; 2] = [Config::CriuzLz4Flat, Config::CriuzZstdFlat];

    /// Run only when asked for: dumps with page ids and without byte planes.
    pub const IDS_FLAT: [Config; 1] = [Config::CriuzLz4IdsFlat];

    /// Whether a restore reads the checkpoint where it lies (no directory
    /// unpacked first), so that it can be restored twice in a row.
    pub fn restores_from_checkpoint(self) -> bool {
        matches!(
            self,
            Config::CriuDir
                | Config::CriuTmpfs
                | Config::CriuDirSync
                | Config::CriuzLz4
                | Config::CriuzZstd
                | Config::CriuzLz4Place
                | Config::CriuzZstdPlace
                | Config::CriuzLz4Stream
                | Config::CriuzZstdStream
                | Config::CriuzLz4SmallPages
                | Config::CriuzLz4HugeAlways
                | Config::CriuzLz4Sealed
                | Config::CriuzZstdSealed
                | Config::CriuzLz4Ids
                | Config::CriuzZstdIds
                | Config::CriuzLz4Flat
                | Config::CriuzZstdFlat
                | Config::CriuzLz4IdsFlat
        )
    }

    pub fn name(self) -> &'static str {
        match self {
            Config::CriuDir => "criu-dir",
            Config::CriuTmpfs => "criu-tmpfs",
            Config::CriuDirSync => "criu-dir+sync",
            Config::CriuLz4 => "criu+lz4",
            Config::CriuZstd => "criu+zstd",
            Config::CriuzPack => "criuz-pack",
            Config::CriuzLz4 => "criuz-lz4",
            Config::CriuzZstd => "criuz-zstd",
            Config::CriuzLz4Sealed => "criuz-lz4-sealed",
            Config::CriuzZstdSealed => "criuz-zstd-sealed",
            Config::CriuzLz4Place => "criuz-lz4-place",
            Config::CriuzZstdPlace => "criuz-zstd-place",
            Config::CriuzLz4Stream => "criuz-lz4-stream",
            Config::CriuzZstdStream => "criuz-zstd-stream",
            Config::CriuzLz4SmallPages => "criuz-lz4-4k",
            Config::CriuzLz4HugeAlways => "criuz-lz4-huge",
            Config::CriuzLz4Ids => "criuz-lz4-ids",
            Config::CriuzZstdIds => "criuz-zstd-ids",
            Config::CriuzLz4Flat => "criuz-lz4-flat",
            Config::CriuzZstdFlat => "criuz-zstd-flat",
            Config::CriuzLz4IdsFlat => "criuz-lz4-ids-flat",
            Config::CriuzS3 => "criuz-s3",
            Config::CriuzS3Stream => "criuz-s3-stream",
            Config::CriuzBoto3 => "criuz+boto3",
        }
    }

    /// Every configuration: the default ones, then those run only when asked for.
    pub fn every() -> impl Iterator<Item = Config> {
        Config::ALL
            .into_iter()
            .chain(Config::S3)
            .chain(Config::SEALED)
            .chain(Config::FILL)
            .chain(Config::IDS)
            .chain(Config::FLAT)
            .chain(Config::IDS_FLAT)
            .chain(Config::SYNCED)
    }

    pub fn parse(s: &str) -> Option<Config> {
        Config::every().find(|c| c.name() == s)
    }

    /// Whether criuz dumps with `--ids`.
    fn with_ids(self) -> bool {
        Config::IDS.contains(&self) || Config::IDS_FLAT.contains(&self)
    }

    /// Whether criuz dumps with `--no-planes`.
    fn without_planes(self) -> bool {
        Config::FLAT.contains(&self) || Config::IDS_FLAT.contains(&self)
    }

    pub fn uses_s3(self) -> bool {
        Config::S3.contains(&self)
    }

    pub fn on_tmpfs(self) -> bool {
        self == Config::CriuTmpfs
    }

    /// External programs besides CRIU and criuz.
    pub fn tools(self) -> &'static [&'static str] {
        match self {
            Config::CriuDir | Config::CriuTmpfs | Config::CriuDirSync => &["tar"],
            Config::CriuLz4 => &["tar", "lz4"],
            Config::CriuZstd => &["tar", "zstd"],
            Config::CriuzS3 | Config::CriuzS3Stream => &["weed"],
            Config::CriuzBoto3 => &["weed", "python3"],
            _ => &[],
        }
    }

    fn checkpoint_file(self, link: bool) -> &'static str {
        match self {
            Config::CriuDir | Config::CriuTmpfs | Config::CriuDirSync if link => "ckpt.tar",
            Config::CriuDir | Config::CriuTmpfs | Config::CriuDirSync => "img",
            Config::CriuLz4 => "ckpt.tar.lz4",
            Config::CriuZstd => "ckpt.tar.zst",
            _ => "ckpt.czr",
        }
    }
}

/// Shared by every run.
pub struct Env {
    pub criu: Criu,
    pub criuz: PathBuf,
    /// Link rate in bytes per second, if the checkpoint goes through a link.
    pub link: Option<u64>,
    /// TMPDIR for criuz (its private images directories), inside the work dir.
    pub tmp: PathBuf,
    /// `--absorb` for criuz dumps, when not the default.
    pub absorb: Option<String>,
    /// The age identity file and its public key of the sealed configurations.
    pub key: Option<(PathBuf, String)>,
}

impl Env {
    /// Arguments that encrypt a dump of `cfg` (none unless it is sealed).
    fn seal_args(&self, cfg: Config) -> Vec<String> {
        match (&self.key, Config::SEALED.contains(&cfg)) {
            (Some((_, public)), true) => vec!["--recipient".into(), public.clone()],
            _ => Vec::new(),
        }
    }

    /// Arguments that open an encrypted archive of `cfg`.
    fn key_args(&self, cfg: Config) -> Vec<String> {
        match (&self.key, Config::SEALED.contains(&cfg)) {
            (Some((identity, _)), true) => vec!["--identity".into(), identity.display().to_string()],
            _ => Vec::new(),
        }
    }
}

/// Where one run keeps its checkpoint and logs.
pub struct Place {
    pub store: PathBuf,
    pub logs: PathBuf,
    /// The run's object key (S3 configurations).
    pub key: String,
}

pub struct Dumped {
    pub dump_s: f64,
    pub frozen_s: Option<f64>,
    pub bytes: u64,
    pub raw_bytes: u64,
    pub usage: Usage,
    /// `criuz dump`'s own peak RSS (its `--json`), CRIU's not counted.
    pub criuz_rss_kib: Option<u64>,
}

pub struct Restored {
    pub restore_s: f64,
    pub usage: Usage,
}

/// CRIU's frozen time, in seconds, from a stats-dump image.
pub fn frozen_from_stats(bytes: &[u8]) -> Option<f64> {
    criuz::criu::stats::parse_stats(bytes).map(|s| f64::from(s.frozen_time_us) / 1e6)
}

/// CRIU writes stats-dump into its --work-dir (the run's log directory).
fn frozen_in_dir(dir: &Path) -> Option<f64> {
    frozen_from_stats(&std::fs::read(dir.join("stats-dump")).ok()?)
}

/// Raw bytes and frozen time recorded in a criuz archive.
fn archive_facts(path: &Path) -> Result<(u64, Option<f64>)> {
    use criuz::archive::BlockSource;
    let arc = criuz::archive::open(&criuz::io::Location::File(path.into()), &Default::default())?;
    let raw = arc.index().files.iter().map(|f| f.raw_size).sum();
    let frozen = arc.find("stats-dump").and_then(|e| frozen_from_stats(&arc.read_file(e).ok()?));
    Ok((raw, frozen))
}

fn criu_cmd(env: &Env, p: &Place, args: &[&str], img: &Path, log: &str) -> Command {
    let mut c = Command::new(&env.criu.path);
    c.args(args).arg("-D").arg(img).arg("--work-dir").arg(&p.logs).args(["-o", log]);
    c
}

fn criu_failed(what: &str, e: Error, log: &Path) -> Error {
    let errs = criuz::criu::log_errors(log, 4).join(" | ");
    Error::Criu(format!("{what} failed: {e}; CRIU log: {errs}"))
}

fn criu_dump(env: &Env, p: &Place, pid: i32, img: &Path) -> Result<Usage> {
    std::fs::create_dir_all(img).map_err(|e| Error::file(img, e))?;
    let cmd = criu_cmd(env, p, &["dump", "-t", &pid.to_string()], img, "dump.log");
    proc::pipeline(vec![cmd], Src::Null, Dst::Null, &p.logs, "criu-dump")
        .map(|f| f.usage)
        .map_err(|e| criu_failed("criu dump", e, &p.logs.join("dump.log")))
}

fn criu_restore(env: &Env, p: &Place, img: &Path) -> Result<Usage> {
    let cmd = criu_cmd(env, p, &["restore", "-d"], img, "restore.log");
    proc::pipeline(vec![cmd], Src::Null, Dst::Null, &p.logs, "criu-restore")
        .map(|f| f.usage)
        .map_err(|e| criu_failed("criu restore", e, &p.logs.join("restore.log")))
}

fn criuz_cmd(env: &Env, args: &[&str]) -> Command {
    let mut c = Command::new(&env.criuz);
    c.args(args).env("TMPDIR", &env.tmp);
    c
}

pub fn tar_create(img: &Path) -> Command {
    let mut c = Command::new("tar");
    c.arg("-C").arg(img).args(["-cf", "-", "."]);
    c
}

pub fn tar_extract(dir: &Path) -> Command {
    let mut c = Command::new("tar");
    c.arg("-C").arg(dir).args(["-xf", "-"]);
    c
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap_or_default()
}

/// `criuz dump --json`'s raw bytes, archive bytes, frozen seconds and own
/// peak RSS in KiB.
fn dump_report(stdout: &[u8]) -> Result<(u64, u64, Option<f64>, Option<u64>)> {
    let v: serde_json::Value =
        serde_json::from_slice(stdout).map_err(|e| Error::Invalid(format!("criuz dump --json: bad output: {e}")))?;
    let frozen = v["criu_stats"]["frozen_time_us"].as_f64().map(|us| us / 1e6);
    let rss = v["peak_rss_bytes"].as_u64().map(|b| b >> 10);
    Ok((v["raw_bytes"].as_u64().unwrap_or(0), v["archive_bytes"].as_u64().unwrap_or(0), frozen, rss))
}

/// Checkpoints `pid` (CRIU ends it) and stores the checkpoint.
pub fn dump(cfg: Config, env: &Env, p: &Place, pid: i32) -> Result<Dumped> {
    let img = p.store.join("img");
    let ckpt = p.store.join(cfg.checkpoint_file(env.link.is_some()));
    let to_dest = |path: &Path| match env.link {
        Some(r) => Dst::Link(path.to_path_buf(), Some(r)),
        None => Dst::File(path.to_path_buf()),
    };
    let criu = s(&env.criu.path).to_string();
    let mut usage = Usage::default();
    let t = Instant::now();
    let (frozen_s, raw_bytes, staged) = match cfg {
        Config::CriuzS3 | Config::CriuzS3Stream | Config::CriuzBoto3 => {
            let url = crate::s3::url(&p.key);
            let out = if cfg == Config::CriuzBoto3 { s(&ckpt) } else { url.as_str() };
            let pid = pid.to_string();
            let args = ["dump", "-t", &pid, "-o", out, "--criu", &criu, "--json"];
            let done = proc::pipeline(vec![criuz_cmd(env, &args)], Src::Null, Dst::Capture, &p.logs, "criuz-dump")?;
            usage.add(done.usage);
            if cfg == Config::CriuzBoto3 {
                let up = crate::s3::boto3("up", &p.key, &ckpt);
                usage.add(proc::pipeline(vec![up], Src::Null, Dst::Null, &p.logs, "boto3-up")?.usage);
            }
            let dump_s = t.elapsed().as_secs_f64();
            let (raw_bytes, bytes, frozen_s, criuz_rss_kib) = dump_report(&done.stdout)?;
            return Ok(Dumped { dump_s, frozen_s, bytes, raw_bytes, usage, criuz_rss_kib });
        }
        Config::CriuzLz4
        | Config::CriuzZstd
        | Config::CriuzLz4Sealed
        | Config::CriuzZstdSealed
        | Config::CriuzLz4Place
        | Config::CriuzZstdPlace
        | Config::CriuzLz4Stream
        | Config::CriuzZstdStream
        | Config::CriuzLz4SmallPages
        | Config::CriuzLz4HugeAlways
        | Config::CriuzLz4Ids
        | Config::CriuzZstdIds
        | Config::CriuzLz4Flat
        | Config::CriuzZstdFlat
        | Config::CriuzLz4IdsFlat => {
            let zstd = matches!(
                cfg,
                Config::CriuzZstd
                    | Config::CriuzZstdSealed
                    | Config::CriuzZstdPlace
                    | Config::CriuzZstdStream
                    | Config::CriuzZstdIds
                    | Config::CriuzZstdFlat
            );
            let codec = if zstd { "zstd" } else { "lz4" };
            let pid = pid.to_string();
            let seal = env.seal_args(cfg);
            let mut extra: Vec<&str> = seal.iter().map(String::as_str).collect();
            if cfg.with_ids() {
                extra.push("--ids");
            }
            if cfg.without_planes() {
                extra.push("--no-planes");
            }
            if env.link.is_some() {
                let mut args = vec!["dump", "-t", &pid, "-o", "-", "--codec", codec, "--criu", &criu];
                args.extend(&extra);
                let cmd = criuz_cmd(env, &args);
                usage.add(proc::pipeline(vec![cmd], Src::Null, to_dest(&ckpt), &p.logs, "criuz-dump")?.usage);
                let secs = t.elapsed().as_secs_f64();
                let (raw, frozen) = archive_facts(&ckpt)?;
                return Ok(Dumped {
                    dump_s: secs,
                    frozen_s: frozen,
                    bytes: proc::file_bytes(&ckpt),
                    raw_bytes: raw,
                    usage,
                    criuz_rss_kib: None,
                });
            }
            let mut args = vec!["dump", "-t", &pid, "-o", s(&ckpt), "--codec", codec, "--criu", &criu, "--json"];
            args.extend(&extra);
            if let Some(a) = &env.absorb {
                args.extend(["--absorb", a.as_str()]);
            }
            let done = proc::pipeline(vec![criuz_cmd(env, &args)], Src::Null, Dst::Capture, &p.logs, "criuz-dump")?;
            let secs = t.elapsed().as_secs_f64();
            usage.add(done.usage);
            let (raw, _, frozen, criuz_rss_kib) = dump_report(&done.stdout)?;
            return Ok(Dumped {
                dump_s: secs,
                frozen_s: frozen,
                bytes: proc::file_bytes(&ckpt),
                raw_bytes: raw,
                usage,
                criuz_rss_kib,
            });
        }
        _ => {
            usage.add(criu_dump(env, p, pid, &img)?);
            let frozen = frozen_in_dir(&p.logs);
            let raw = proc::dir_bytes(&img);
            match cfg {
                Config::CriuDir | Config::CriuTmpfs if env.link.is_none() => (frozen, raw, false),
                Config::CriuDirSync if env.link.is_none() => {
                    // SAFETY: sync(2) has no preconditions.
                    unsafe { libc::sync() };
                    (frozen, raw, false)
                }
                Config::CriuDir | Config::CriuTmpfs | Config::CriuDirSync => {
                    let f = proc::pipeline(vec![tar_create(&img)], Src::Null, to_dest(&ckpt), &p.logs, "tar")?;
                    usage.add(f.usage);
                    (frozen, raw, true)
                }
                Config::CriuLz4 | Config::CriuZstd => {
                    let mut z = Command::new(if cfg == Config::CriuLz4 { "lz4" } else { "zstd" });
                    if cfg == Config::CriuLz4 {
                        z.args(["-1", "-c", "-q"]);
                    } else {
                        z.args(["-1", "-T0", "-c", "-q"]);
                    }
                    let f = proc::pipeline(vec![tar_create(&img), z], Src::Null, to_dest(&ckpt), &p.logs, "compress")?;
                    usage.add(f.usage);
                    (frozen, raw, true)
                }
                _ => {
                    let out = if env.link.is_some() { "-" } else { s(&ckpt) };
                    let cmd = criuz_cmd(env, &["pack", s(&img), "-o", out]);
                    let dst = if env.link.is_some() { to_dest(&ckpt) } else { Dst::Null };
                    usage.add(proc::pipeline(vec![cmd], Src::Null, dst, &p.logs, "criuz-pack")?.usage);
                    (frozen, raw, true)
                }
            }
        }
    };
    let dump_s = t.elapsed().as_secs_f64();
    // Deleting the staged images directory is housekeeping after the
    // checkpoint is complete: not timed.
    if staged {
        std::fs::remove_dir_all(&img).map_err(|e| Error::file(&img, e))?;
    }
    let bytes = if staged { proc::file_bytes(&ckpt) } else { raw_bytes };
    Ok(Dumped { dump_s, frozen_s, bytes, raw_bytes, usage, criuz_rss_kib: None })
}

/// Where `dump` stored the checkpoint of `cfg` (a file or a directory);
/// `None` when it is in object storage.
pub fn checkpoint_path(cfg: Config, env: &Env, p: &Place) -> Option<PathBuf> {
    (!cfg.uses_s3()).then(|| p.store.join(cfg.checkpoint_file(env.link.is_some())))
}

/// Restores from the checkpoint `dump` stored; returns once CRIU reports the
/// process tree restored (it runs detached, re-parented to the bench).
pub fn restore(cfg: Config, env: &Env, p: &Place) -> Result<Restored> {
    let link = env.link.is_some();
    let ckpt = p.store.join(cfg.checkpoint_file(link));
    let from_dest = || match env.link {
        Some(r) => Src::Link(ckpt.clone(), Some(r)),
        None => Src::File(ckpt.clone()),
    };
    let rimg = p.store.join("restore-img");
    let criu = s(&env.criu.path).to_string();
    let mut usage = Usage::default();
    let t = Instant::now();
    let img = match cfg {
        Config::CriuzS3 | Config::CriuzS3Stream | Config::CriuzBoto3 => {
            let fetched = p.store.join("fetched.czr");
            let input = if cfg == Config::CriuzBoto3 {
                let down = crate::s3::boto3("down", &p.key, &fetched);
                usage.add(proc::pipeline(vec![down], Src::Null, Dst::Null, &p.logs, "boto3-down")?.usage);
                s(&fetched).to_string()
            } else {
                crate::s3::url(&p.key)
            };
            let mut args = vec!["restore", "-d", "-i", &input, "--criu", &criu];
            if cfg == Config::CriuzS3Stream {
                args.extend(["--fill", "stream"]);
            }
            let cmd = criuz_cmd(env, &args);
            usage.add(proc::pipeline(vec![cmd], Src::Null, Dst::Null, &p.logs, "criuz-restore")?.usage);
            return Ok(Restored { restore_s: t.elapsed().as_secs_f64(), usage });
        }
        Config::CriuzLz4
        | Config::CriuzZstd
        | Config::CriuzLz4Sealed
        | Config::CriuzZstdSealed
        | Config::CriuzLz4Place
        | Config::CriuzZstdPlace
        | Config::CriuzLz4Stream
        | Config::CriuzZstdStream
        | Config::CriuzLz4SmallPages
        | Config::CriuzLz4HugeAlways
        | Config::CriuzLz4Ids
        | Config::CriuzZstdIds
        | Config::CriuzLz4Flat
        | Config::CriuzZstdFlat
        | Config::CriuzLz4IdsFlat => {
            let input = if link { "-" } else { s(&ckpt) };
            let keys = env.key_args(cfg);
            let mut args = vec!["restore", "-d", "-i", input, "--criu", &criu];
            match cfg {
                Config::CriuzLz4Place | Config::CriuzZstdPlace => args.extend(["--fill", "place"]),
                Config::CriuzLz4Stream | Config::CriuzZstdStream => args.extend(["--fill", "stream"]),
                Config::CriuzLz4SmallPages => args.push("--no-huge-pages"),
                Config::CriuzLz4HugeAlways => args.extend(["--huge-page-floor", "0"]),
                _ => {}
            }
            args.extend(keys.iter().map(String::as_str));
            let cmd = criuz_cmd(env, &args);
            let src = if link { from_dest() } else { Src::Null };
            usage.add(proc::pipeline(vec![cmd], src, Dst::Null, &p.logs, "criuz-restore")?.usage);
            return Ok(Restored { restore_s: t.elapsed().as_secs_f64(), usage });
        }
        Config::CriuDir | Config::CriuTmpfs | Config::CriuDirSync if !link => ckpt.clone(),
        Config::CriuDir | Config::CriuTmpfs | Config::CriuDirSync => {
            std::fs::create_dir_all(&rimg).map_err(|e| Error::file(&rimg, e))?;
            usage.add(proc::pipeline(vec![tar_extract(&rimg)], from_dest(), Dst::Null, &p.logs, "untar")?.usage);
            rimg
        }
        Config::CriuLz4 | Config::CriuZstd => {
            std::fs::create_dir_all(&rimg).map_err(|e| Error::file(&rimg, e))?;
            let mut z = Command::new(if cfg == Config::CriuLz4 { "lz4" } else { "zstd" });
            z.args(["-d", "-c", "-q"]);
            let cmds = vec![z, tar_extract(&rimg)];
            usage.add(proc::pipeline(cmds, from_dest(), Dst::Null, &p.logs, "decompress")?.usage);
            rimg
        }
        Config::CriuzPack => {
            let input = if link { "-" } else { s(&ckpt) };
            let cmd = criuz_cmd(env, &["unpack", input, "-d", s(&rimg)]);
            let src = if link { from_dest() } else { Src::Null };
            usage.add(proc::pipeline(vec![cmd], src, Dst::Null, &p.logs, "criuz-unpack")?.usage);
            rimg
        }
    };
    usage.add(criu_restore(env, p, &img)?);
    Ok(Restored { restore_s: t.elapsed().as_secs_f64(), usage })
}

//! Real CRIU, streaming path: `criuz dump` / `criuz restore`, `capture` /
//! `serve` interop with plain CRIU, zero pages left out on restore, and fault
//! behaviour. Every round trip checks the checksums the restored processes
//! compute over their own memory.

// Tests start processes of their own; clippy.toml's rule is for the
// programs criuz runs.
#![allow(clippy::disallowed_methods)]

mod common;
use common::*;
use std::fs::File;
use std::os::unix::fs::{FileTypeExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

fn ok(out: std::process::Output, what: &str) -> std::process::Output {
    assert!(out.status.success(), "{what} failed: {}", String::from_utf8_lossy(&out.stderr));
    out
}

fn dump(w: &Workload, arc: &Path, extra: &[&str]) -> serde_json::Value {
    let pid = w.pid.to_string();
    let mut args = vec!["dump", "-t", &pid, "-o", arc.to_str().unwrap(), "--json"];
    args.extend_from_slice(extra);
    let out = ok(criuz(&args), "criuz dump");
    serde_json::from_slice(&out.stdout).expect("dump --json")
}

fn restore(arc: &Path, extra: &[&str]) -> serde_json::Value {
    let mut args = vec!["restore", "-d", "-i", arc.to_str().unwrap(), "--json"];
    args.extend_from_slice(extra);
    let out = ok(criuz(&args), "criuz restore");
    serde_json::from_slice(&out.stdout).expect("restore --json")
}

/// dump -> (original gone) -> restore -> same checksums. Returns the restore summary.
fn roundtrip(spec: Spec, dump_args: &[&str], restore_args: &[&str]) -> serde_json::Value {
    roundtrip_then(spec, dump_args, restore_args, |_| {})
}

/// As `roundtrip`, with `restored` run on the restored workload before its
/// checksums are taken.
fn roundtrip_then(
    spec: Spec,
    dump_args: &[&str],
    restore_args: &[&str],
    restored: impl FnOnce(&Workload),
) -> serde_json::Value {
    let Some(_criu) = criu() else { return serde_json::Value::Null };
    let _g = serial();
    let mut w = Workload::start(spec);
    let before = w.sums();
    let tmp = tempfile::tempdir().unwrap();
    let arc = tmp.path().join("ckpt.czr");
    let d = dump(&w, &arc, dump_args);
    assert!(d["raw_bytes"].as_u64().unwrap() > 0 && d["archive_bytes"].as_u64().unwrap() > 0);
    assert_eq!(std::fs::metadata(&arc).unwrap().permissions().mode() & 0o777, 0o600);
    w.reap_original();
    assert!(!w.alive());
    let r = restore(&arc, restore_args);
    assert_eq!(r["pid"].as_i64(), Some(w.pid as i64));
    restored(&w);
    assert_eq!(w.sums(), before, "restored memory differs");
    w.stop();
    r
}

/// CRIU starts with none of criuz's signals held back. criuz's threads hold
/// SIGINT, SIGTERM, SIGHUP, SIGQUIT and SIGUSR1/2 back (only its signal
/// thread takes them, `proc::interrupt`), and a child keeps the mask of
/// the thread that started it: a CRIU (or runc, or what they start) would
/// hold them back too. A wrapper records the mask CRIU starts with, for a
/// dump and a restore (placed and streamed).
#[test]
fn criu_starts_with_no_signal_of_criuz_held_back() {
    let Some(real) = criu() else { return };
    let dir = tempfile::tempdir().unwrap();
    let masks = dir.path().join("masks");
    let wrapper = dir.path().join("criu");
    // Python, not a shell: sh clears its mask as it starts. Python keeps it
    // (it ignores SIGPIPE, which CRIU then inherits: harmless here).
    let script = format!(
        "#!/usr/bin/python3\nimport os, sys\nmask = [l for l in open('/proc/self/status') if l.startswith('SigBlk')]\n\
         open('{masks}', 'a').write(mask[0])\nos.execv('{real}', ['{real}'] + sys.argv[1:])\n",
        masks = masks.display(),
        real = real.display()
    );
    std::fs::write(&wrapper, script).unwrap();
    std::fs::set_permissions(&wrapper, std::fs::Permissions::from_mode(0o755)).unwrap();
    let with = ["--criu", wrapper.to_str().unwrap()];
    let spec = || Spec { pattern: "mixed", mib: 16, ..Default::default() };
    roundtrip(spec(), &with, &with);
    roundtrip(spec(), &with, &[&with[..], &["--fill", "stream"]].concat());
    let held_back: u64 = [libc::SIGINT, libc::SIGTERM, libc::SIGHUP, libc::SIGQUIT, libc::SIGUSR1, libc::SIGUSR2]
        .iter()
        .map(|sig| 1u64 << (sig - 1))
        .sum();
    let text = std::fs::read_to_string(&masks).unwrap();
    let started: Vec<u64> =
        text.lines().map(|l| u64::from_str_radix(l.split_whitespace().last().unwrap(), 16).unwrap()).collect();
    assert!(started.len() >= 4, "CRIU ran {} times: {text}", started.len());
    assert!(started.iter().all(|m| m & held_back == 0), "CRIU started with criuz's signals held back: {text}");
}

#[test]
fn every_pattern_round_trips_through_dump_and_restore() {
    for (pattern, codec) in [("zero", "lz4"), ("mixed", "zstd"), ("random", "lz4"), ("text", "zstd"), ("elf", "lz4")] {
        roundtrip(Spec { pattern, ..Default::default() }, &["--codec", codec], &[]);
    }
    // Without an absorb budget beyond the pipeline's: CRIU paced by the codec.
    roundtrip(Spec { pattern: "text", ..Default::default() }, &["--codec", "zstd", "--absorb", "0"], &[]);
}

/// bf16 memory (what a GPU process holds once CUDA copied it to the host) is
/// stored as byte planes with both codecs (archive version 3) and restores
/// intact, eagerly and lazily; with `--no-planes` it is not.
#[test]
fn bf16_memory_is_stored_as_byte_planes_and_restores_intact() {
    let Some(_criu) = criu() else { return };
    for (codec, lazy) in [("lz4", false), ("zstd", true)] {
        let _g = serial();
        let mut w = Workload::start(Spec { pattern: "bf16", ..Default::default() });
        let before = w.sums();
        let tmp = tempfile::tempdir().unwrap();
        let arc = tmp.path().join("ckpt.czr");
        let d = dump(&w, &arc, &["--codec", codec]);
        let ratio = d["archive_bytes"].as_f64().unwrap() / d["raw_bytes"].as_f64().unwrap();
        assert!(ratio < if codec == "lz4" { 0.9 } else { 0.75 }, "{codec}: {ratio}");
        let inspect = inspect(&arc);
        assert_eq!(inspect["version"], 3);
        assert!(inspect["total"]["blocks_planes"].as_u64().unwrap() > 0, "{inspect}");
        w.reap_original();
        restore(&arc, if lazy { &["--lazy"] } else { &[] });
        assert_eq!(w.sums(), before, "restored bf16 memory differs ({codec})");
        w.stop();
    }
    let _g = serial();
    let mut w = Workload::start(Spec { pattern: "bf16", ..Default::default() });
    let tmp = tempfile::tempdir().unwrap();
    let arc = tmp.path().join("plain.czr");
    dump(&w, &arc, &["--no-planes", "--leave-running"]);
    assert_eq!(inspect(&arc)["total"]["blocks_planes"].as_u64(), Some(0));
    w.stop();
}

fn inspect(arc: &Path) -> serde_json::Value {
    let out = ok(criuz(&["inspect", "--json", arc.to_str().unwrap()]), "criuz inspect");
    serde_json::from_slice(&out.stdout).expect("inspect --json")
}

#[test]
fn zero_pages_are_left_out_and_restore_intact() {
    let r = roundtrip(Spec { pattern: "mixed", ..Default::default() }, &[], &[]);
    if r.is_null() {
        return;
    }
    // A 32 MiB mixed workload has about 4096 zero pages; they must not be sent.
    assert!(r["zero_pages_skipped"].as_u64().unwrap() > 3000, "{r}");
    let r = roundtrip(Spec { pattern: "mixed", ..Default::default() }, &[], &["--keep-zero-pages"]);
    assert_eq!(r["zero_pages_skipped"].as_u64(), Some(0));
    // Placed with every zero page kept: each one is a page of the restored
    // process's memory (what CRIU's own restore makes), not a hole. In 4 KiB
    // pages both times: under THP `always` a huge page would hold the zero
    // pages either way.
    let rss_anon_kib = |w: &Workload| -> u64 {
        let status = std::fs::read_to_string(format!("/proc/{}/status", w.pid)).unwrap();
        let line = status.lines().find(|l| l.starts_with("RssAnon:")).expect("RssAnon");
        line.split_whitespace().nth(1).unwrap().parse().unwrap()
    };
    let mut rss = Vec::new();
    let placed = ["--fill", "place", "--no-huge-pages"];
    for keep in [&placed[..], &[&placed[..], &["--keep-zero-pages"]].concat()] {
        let r =
            roundtrip_then(Spec { pattern: "mixed", ..Default::default() }, &[], keep, |w| rss.push(rss_anon_kib(w)));
        assert_eq!(r["fill"].as_str(), Some("place"), "{r}");
        assert_eq!(r["zero_pages_skipped"].as_u64() == Some(0), keep.len() > placed.len(), "{r}");
    }
    assert!(rss[1] >= rss[0] + 12 * 1024, "zero pages kept: RssAnon {} KiB against {} KiB", rss[1], rss[0]);
}

/// The default eager restore places private memory itself, and plain
/// shared memory (however much of it there is); it streams where the
/// tree's processes share pages, and where asked to.
#[test]
fn eager_restores_place_memory_unless_streaming_suits_better() {
    let fill = |r: &serde_json::Value| r["fill"].as_str().map(str::to_string);
    let r = roundtrip(Spec { pattern: "text", ..Default::default() }, &[], &[]);
    if r.is_null() {
        return;
    }
    assert_eq!(fill(&r).as_deref(), Some("place"), "{r}");
    assert!(r["lazy_pages"].as_u64().unwrap() > (32 << 20) / 4096 * 9 / 10, "{r}");
    let r = roundtrip(Spec { pattern: "text", ..Default::default() }, &[], &["--fill", "stream"]);
    assert_eq!(fill(&r).as_deref(), Some("stream"), "{r}");
    assert!(r["not_placed"].is_null(), "streamed as asked: {r}");
    // Why a default restore streamed, in its report.
    let why = |r: &serde_json::Value| r["not_placed"].as_str().unwrap_or_default().to_string();
    // Memory that is nearly all shared: placed too, criuz filling the
    // shared memory itself (`session::shmem`), however much of it there is
    // (more than PLACE_EAGER_MAX, 256 MiB, streamed when CRIU restored it
    // from $TMPDIR). What CRIU would restore itself (System V segments,
    // private file mappings) still streams past that (the unit test of
    // `why_not_placed`).
    let shared = |mib| Spec { mib, pattern: "text", shared: true, ..Default::default() };
    for mib in [32, 300] {
        let r = roundtrip(shared(mib), &[], &[]);
        assert_eq!(fill(&r).as_deref(), Some("place"), "{r}");
        assert!(r["shared_pages"].as_u64().unwrap() > (mib as u64) << 20 >> 12 >> 1, "{r}");
    }
    // A tree whose processes share pages: streamed by default (CRIU keeps
    // them shared), placed when asked.
    let tree = || Spec { mode: "tree", children: 2, ..Default::default() };
    let r = roundtrip(tree(), &[], &[]);
    assert_eq!(fill(&r).as_deref(), Some("stream"), "{r}");
    assert!(why(&r).contains("share much of their memory"), "{r}");
    let r = roundtrip(tree(), &[], &["--fill", "place"]);
    assert_eq!(fill(&r).as_deref(), Some("place"), "{r}");
}

#[test]
fn process_tree_children_keep_their_zeroed_cow_pages() {
    // Each child zeroes pages it shares copy-on-write with the parent; with
    // zero pages left out, the restore must still give the child zeros.
    for fill in ["stream", "place"] {
        let r = roundtrip(Spec { mode: "tree", children: 3, ..Default::default() }, &[], &["--fill", fill]);
        if !r.is_null() {
            assert!(r["zero_pages_skipped"].as_u64().unwrap() > 0);
        }
    }
}

/// A tree's processes share most of their memory (forked children): CRIU
/// dumps each one's pages, and the archive stores each page once (page ids
/// by default for a tree, `--no-ids` to go without).
#[test]
fn a_tree_stores_the_pages_its_processes_share_once() {
    let Some(_criu) = criu() else { return };
    let _g = serial();
    let mut w = Workload::start(Spec { mode: "tree", children: 3, ..Default::default() });
    let before = w.sums();
    // The tree's anonymous memory, a page shared copy-on-write counted once.
    let pss_anon_kib = |pids: &[i32]| -> u64 { pids.iter().map(|&p| rollup_kib(p, "Pss_Anon:")).sum() };
    let pids = w.pids.clone();
    assert_eq!(pids.len(), 4, "{pids:?}");
    let memory_before = pss_anon_kib(&pids);
    let tmp = tempfile::tempdir().unwrap();
    let (deduped, plain) = (tmp.path().join("deduped.czr"), tmp.path().join("plain.czr"));
    let p = dump(&w, &plain, &["--leave-running", "--no-ids"]);
    let d = dump(&w, &deduped, &[]);
    let (di, pi) = (inspect(&deduped), inspect(&plain));
    assert!(di["total"]["blocks_dedup"].as_u64().unwrap() > 0 && di["page_id_bytes"].as_u64().unwrap() > 0, "{di}");
    assert_eq!((pi["total"]["blocks_dedup"].as_u64(), pi["page_id_bytes"].as_u64()), (Some(0), Some(0)), "{pi}");
    let size = |r: &serde_json::Value| r["archive_bytes"].as_u64().unwrap();
    assert!(size(&d) * 2 < size(&p), "deduped {} bytes against {}", size(&d), size(&p));
    w.reap_original();
    let r = restore(&deduped, &[]);
    assert_eq!(r["pid"].as_i64(), Some(w.pid as i64));
    // Streamed (CRIU keeps the pages shared, as they were): no more memory
    // than before the dump, where placing gives each process its own copy.
    assert_eq!(r["fill"].as_str(), Some("stream"), "{r}");
    let memory_restored = pss_anon_kib(&pids);
    assert!(memory_restored <= memory_before, "restored {memory_restored} KiB against {memory_before} KiB");
    assert_eq!(w.sums(), before, "restored memory differs");
    w.stop();
}

/// A tree that shares little of its memory (a shell and the program it
/// started) stores no page ids unless asked: hashing every page would cost
/// more than it finds.
#[test]
fn a_tree_that_shares_little_stores_no_page_ids() {
    let Some(_criu) = criu() else { return };
    let _g = serial();
    become_subreaper();
    let dir = tempfile::tempdir().unwrap();
    let script = format!("{WORKLOAD} --dir {} --mib 32 --pattern mixed & wait", dir.path().display());
    let mut sh = Command::new("sh");
    sh.args(["-c", &script]).stdin(Stdio::null()).stdout(Stdio::null()).stderr(Stdio::null());
    // SAFETY: setsid(2) is async-signal-safe: CRIU dumps a session leader.
    unsafe {
        std::os::unix::process::CommandExt::pre_exec(&mut sh, || {
            libc::setsid();
            Ok(())
        })
    };
    let mut sh = sh.spawn().unwrap();
    let ready = dir.path().join("ready");
    wait_for("workload ready", Duration::from_secs(60), || ready.exists());
    let program: i32 = std::fs::read_to_string(&ready).unwrap().trim().parse().unwrap();
    let arc = dir.path().join("wrapped.czr");
    let shell = sh.id().to_string();
    ok(criuz(&["dump", "-t", &shell, "-o", arc.to_str().unwrap(), "--leave-running"]), "criuz dump");
    let i = inspect(&arc);
    // SAFETY: ending the program this test started; the shell then exits.
    unsafe { libc::kill(program, libc::SIGKILL) };
    let _ = sh.wait();
    assert_eq!(i["page_id_bytes"].as_u64(), Some(0), "{i}");
    assert!(i["total"]["pages"].as_u64().unwrap() > 32 * 256, "the program's memory is in the archive: {i}");
}

/// Private file mappings and shared memory keep every zero page; a memfd
/// mapped only read-only (no copy can go through that mapping, nor can it
/// be registered with a userfaultfd) is left to CRIU: placed or served
/// lazily through it, the restore failed "Operation not permitted".
#[test]
fn private_file_and_shared_mappings_keep_every_zero_page() {
    roundtrip(Spec { extra_maps: true, ..Default::default() }, &[], &[]);
    roundtrip(Spec { extra_maps: true, mode: "tree", children: 2, ..Default::default() }, &["--codec", "zstd"], &[]);
    roundtrip(Spec { extra_maps: true, ..Default::default() }, &[], &["--lazy"]);
}

/// Placing a restore's memory writes CRIU's images, and the memory CRIU
/// restores itself, to `$TMPDIR` first; the stream writes none of it. With
/// no room there, a default restore failed "No space left on device" where
/// the stream would have worked: it streams now, saying why, and a placed
/// restore asked for says where `$TMPDIR` points.
#[test]
fn a_tmpdir_without_room_streams_a_default_restore() {
    let Some(_criu) = criu() else { return };
    let _g = serial();
    // 512 KiB of shared and private file mappings that CRIU restores itself.
    let mut w = Workload::start(Spec { extra_maps: true, ..Default::default() });
    let before = w.sums();
    let tmp = tempfile::tempdir().unwrap();
    let arc = tmp.path().join("a.czr");
    dump(&w, &arc, &[]);
    w.reap_original();
    let tiny = tmp.path().join("tiny");
    std::fs::create_dir(&tiny).unwrap();
    run_ok(Command::new("mount").args(["-t", "tmpfs", "-o", "size=256k", "tmpfs"]).arg(&tiny));
    let restore_in_tiny = |extra: &[&str]| {
        let mut args = vec!["restore", "-d", arc.to_str().unwrap(), "--json"];
        args.extend_from_slice(extra);
        run(Command::new(CRIUZ).args(&args).env("TMPDIR", &tiny))
    };
    let out = restore_in_tiny(&["--fill", "place"]);
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    let left = std::fs::read_dir(&tiny).unwrap().count();
    let streamed = restore_in_tiny(&[]);
    let _ = Command::new("umount").arg(&tiny).status();
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains(&format!("criuz works in $TMPDIR, {}", tiny.display())), "{err}");
    assert_eq!(left, 0, "the failed restore's work directory is gone");
    let said = String::from_utf8_lossy(&streamed.stderr);
    assert!(streamed.status.success(), "{said}");
    let report: serde_json::Value = serde_json::from_slice(&streamed.stdout).unwrap();
    assert_eq!(report["fill"], "stream", "{report}");
    assert!(report["not_placed"].as_str().is_some_and(|w| w.contains("$TMPDIR has no room")), "{report}");
    assert_eq!(w.sums(), before, "the restored memory differs");
    w.stop();
}

/// A 4 MiB tmpfs mounted at `dir`/small: an archive of a few MiB does not
/// fit (a dump that fails after CRIU). The caller unmounts it.
fn small_fs(dir: &Path) -> std::path::PathBuf {
    let small = dir.join("small");
    std::fs::create_dir(&small).unwrap();
    let mounted = run(Command::new("mount").args(["-t", "tmpfs", "-o", "size=4m", "tmpfs"]).arg(&small));
    assert!(mounted.status.success(), "mount a small tmpfs: {}", String::from_utf8_lossy(&mounted.stderr));
    small
}

/// An established TCP connection survives checkpoint and restore
/// (`--tcp-established`); and a dump of it that fails after CRIU (the
/// archive cannot be written) resumes the process with its connection
/// working: CRIU leaves the connections locked and in repair for the
/// restore, which only its own rollback undoes (`session::criu_hook`).
#[test]
fn established_tcp_connection_round_trips() {
    let Some(_criu) = criu() else { return };
    let _g = serial();
    let mut w = Workload::start(Spec { tcp_peer: Some(echo_peer()), ..Default::default() });
    let before = w.sums();
    assert!(before["root"].contains("tcp=echoed"), "{before:?}");
    let tmp = tempfile::tempdir().unwrap();
    let small = small_fs(tmp.path());
    let full = small.join("big.czr").display().to_string();
    let pid = w.pid.to_string();
    // Asked for in a CRIU config file, as a site that always dumps its
    // connections would: CRIU reads it, and so must criuz.
    let config = tmp.path().join("criu.conf");
    std::fs::write(&config, "tcp-established\n").unwrap();
    let out = run(Command::new(CRIUZ)
        .args(["dump", "-t", &pid, "-o", &full, "--codec", "zstd", "--level", "19"])
        .env("CRIU_CONFIG_FILE", &config));
    let _ = Command::new("umount").arg(&small).status();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("resumed"), "{err}");
    assert_eq!(w.sums(), before, "memory or the TCP connection did not survive the failed dump: {err}");

    let arc = tmp.path().join("tcp.czr");
    // Without CRIU's option: CRIU's error and what to do.
    let out = criuz(&["dump", "-t", &pid, "-o", arc.to_str().unwrap()]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("dump with -- --tcp-established"), "{err}");
    dump(&w, &arc, &["--", "--tcp-established"]);
    w.reap_original();
    // What the dump was asked for, the restore does, unasked (CRIU failed
    // "Connected TCP socket in image" without it).
    restore(&arc, &[]);
    assert_eq!(w.sums(), before, "memory or the TCP connection did not survive");
    // Asked for the connections closed instead: restored with them closed.
    w.kill_and_reap();
    restore(&arc, &["--", "--tcp-close"]);
    let after = w.sums();
    let sum = |report: &str| report.split_whitespace().next().map(String::from);
    assert_eq!(sum(&after["root"]), sum(&before["root"]), "restored memory differs");
    assert!(!after["root"].contains("tcp=echoed"), "a connection restored closed still echoed: {after:?}");
    w.stop();
}

/// A criuz that dies just after the archive of a dump held at CRIU's
/// post-dump hook is committed. Killed before it answered the hook, CRIU
/// rolls back and the process runs on, its connection working; killed
/// after, CRIU completes and leaves the tree stopped with its connection
/// locked for the restore, and the guard ends the tree as the dump would
/// have (it resumed it before: the process ran on, "permission denied" on
/// its connection), and the archive restores it, its connection working.
/// At moments after the commit that meet both on this project's machines
/// (a kill 250 µs after it met the second, 100 µs the first).
#[test]
fn a_tcp_dump_whose_criuz_dies_after_its_archive_is_committed_loses_nothing() {
    let Some(_criu) = criu() else { return };
    let _g = serial();
    for after in [0u64, 100, 250, 500, 1000] {
        let mut w = Workload::start(Spec { tcp_peer: Some(echo_peer()), ..Default::default() });
        let before = w.sums();
        let tmp = tempfile::tempdir().unwrap();
        let arc = tmp.path().join("tcp.czr");
        let pid = w.pid.to_string();
        let mut dump = Command::new(CRIUZ)
            .args(["dump", "-t", &pid, "-o", arc.to_str().unwrap(), "--codec", "zstd", "--level", "19"])
            .args(["--", "--tcp-established"])
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        // The archive appears as it is committed, while CRIU still waits
        // at its hook (zstd 19 keeps the dump long enough to see it come).
        while !arc.exists() && dump.try_wait().unwrap().is_none() {
            std::hint::spin_loop();
        }
        let committed = Instant::now();
        while committed.elapsed() < Duration::from_micros(after) {
            std::hint::spin_loop();
        }
        let _ = dump.kill();
        dump.wait().unwrap();
        // Settled: gone, or running (neither stopped nor traced) for 300 ms.
        let t = Instant::now();
        let mut running_since = None;
        while w.alive() && t.elapsed() < Duration::from_secs(20) {
            let runs = process_state(w.pid).is_some_and(|s| matches!(s, 'S' | 'R' | 'D'));
            running_since = if runs { running_since.or(Some(Instant::now())) } else { None };
            if running_since.is_some_and(|s| s.elapsed() > Duration::from_millis(300)) {
                break;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        assert!(running_since.is_some() || !w.alive(), "{after} µs: the tree stays stopped");
        if w.alive() {
            // Rolled back: its connection is its own again (a restore would
            // need it ended, which closes the connection).
            assert_eq!(w.sums(), before, "{after} µs: the process runs on, but not as it was");
        } else {
            w.reap_original();
            restore(&arc, &["--", "--tcp-established"]);
            assert_eq!(w.sums(), before, "{after} µs: memory or the TCP connection did not survive");
        }
        w.stop();
    }
}

/// A dump's or restore's `--json` summary that cannot be written (stdout on
/// a full disk) does not fail work that is done: the dump ended the process,
/// the restore runs it. Both say the summary is lost and exit 0 (a report,
/// `inspect` or `verify`, fails instead: tests/archive.rs).
#[test]
fn a_summary_that_cannot_be_printed_is_said_lost_and_the_work_stands() {
    let Some(_criu) = criu() else { return };
    let _g = serial();
    let mut w = Workload::start(Spec { mib: 16, ..Default::default() });
    let before = w.sums();
    let tmp = tempfile::tempdir().unwrap();
    let arc = tmp.path().join("ckpt.czr");
    let pid = w.pid.to_string();
    let to_full = |args: &[&str]| {
        let full = std::fs::OpenOptions::new().write(true).open("/dev/full").unwrap();
        let out = Command::new(CRIUZ).args(args).stdout(full).output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr).into_owned();
        assert!(out.status.success(), "{args:?}: {err}");
        let lost = "criuz: standard output: No space left on device (os error 28): the summary printed there is lost";
        assert!(err.contains(lost), "{args:?}: {err}");
    };
    to_full(&["dump", "-t", &pid, "-o", arc.to_str().unwrap(), "--json"]);
    w.reap_original();
    to_full(&["restore", "-d", "-i", arc.to_str().unwrap(), "--json"]);
    assert_eq!(w.sums(), before, "restored memory differs");
    w.stop();
}

#[test]
fn multi_threaded_process() {
    roundtrip(Spec { mode: "threads", ..Default::default() }, &["-j", "1"], &[]);
}

#[test]
fn process_with_an_open_regular_file() {
    roundtrip(Spec { open_file: true, ..Default::default() }, &["--block-size", "64K"], &[]);
}

/// CRIU restores file locks only when told `--file-locks` at the restore
/// as at the dump; told nothing, it restored the tree without its locks and
/// without a word (found by hand: an SQLite process holding its database
/// locked came back holding nothing, and another process wrote the
/// database under it). criuz restores a checkpoint that holds locks with
/// them: the restored process holds its lock, which no other may take.
#[test]
fn a_file_lock_the_tree_held_is_held_again_after_the_restore() {
    roundtrip_then(
        Spec { open_file: true, lock_file: true, ..Default::default() },
        &["--", "--file-locks"],
        &[],
        |w| {
            let path = w.dir.path().join("held-open.dat");
            assert_eq!(lock_holder(&path), Some(w.pid), "the restored process holds no lock on {path:?}");
        },
    );
}

/// CRIU creates each process of a restored tree with its old pid, one after
/// another; a task started meanwhile by anyone (criuz's own threads too)
/// that got one of those pids first failed the restore ("Can't fork for N:
/// File exists"). Where the pid counter stood below the tree's pids (a
/// fresh machine, a counter that wrapped), a streamed restore of 301
/// processes walked it through them and failed so each time (found by hand,
/// session 56). criuz now moves the counter past the tree's pids before
/// CRIU starts: tasks started after it get higher pids.
#[test]
fn tasks_started_during_a_restore_get_pids_above_the_tree() {
    let Some(_criu) = criu() else { return };
    let _g = serial();
    let mut w = Workload::start(Spec { mib: 8, mode: "tree", children: 2, ..Default::default() });
    let before = w.sums();
    let tmp = tempfile::tempdir().unwrap();
    let arc = tmp.path().join("a.czr");
    dump(&w, &arc, &[]);
    w.reap_original();
    let (lowest, highest) = (*w.pids.iter().min().unwrap(), *w.pids.iter().max().unwrap());
    for fill in ["stream", "place"] {
        std::fs::write("/proc/sys/kernel/ns_last_pid", (lowest - 100).to_string()).unwrap();
        restore(&arc, &["--fill", fill]);
        let mut next = Command::new("true").spawn().unwrap();
        let _ = next.wait();
        assert!(next.id() as i32 > highest, "{fill}: pid {} after a tree of {:?}", next.id(), w.pids);
        assert_eq!(w.sums(), before, "{fill}");
        w.stop();
        w.reap_original();
    }
}

/// CRIU restores every process under its old pid, so a restore is refused
/// by name while one is taken. The kernel frees a pid only once no process
/// names it as its session or process group: a restored session leader
/// killed while a child it forked lives on leaves its pid with no /proc
/// entry, yet taken. That restore failed in CRIU ("Can't fork for PID:
/// File exists") and was told to try again once the pid was free, which it
/// would never be. It is now refused before CRIU runs, naming the process
/// that keeps the pid, and runs once that process has ended. (The dump
/// keeps its process running, `--leave-running`, for the first refusal.)
#[test]
fn a_pid_in_use_or_still_naming_a_session_is_refused_by_name() {
    let Some(_criu) = criu() else { return };
    let _g = serial();
    let mut w = Workload::start(Spec::default());
    let before = w.sums();
    let tmp = tempfile::tempdir().unwrap();
    let arc = tmp.path().join("ckpt.czr");
    dump(&w, &arc, &["--leave-running"]);
    assert!(w.alive(), "--leave-running must keep the process");
    assert_eq!(w.sums(), before);
    let refused = |what: &str| {
        let out = criuz(&["restore", "-d", "-i", arc.to_str().unwrap()]);
        let err = String::from_utf8_lossy(&out.stderr).to_string();
        assert_eq!(out.status.code(), Some(1), "{what}: {err}");
        assert!(!err.contains("criu restore failed"), "{what}: refused only by CRIU: {err}");
        err
    };
    let err = refused("the dumped process still running");
    let in_use = format!("pid {} of the checkpointed tree is in use by criuz-workload (running)", w.pid);
    assert!(err.contains(&in_use), "{err}");
    w.kill_and_reap();
    restore(&arc, &[]);
    assert_eq!(w.sums(), before, "restored memory differs");

    // The restored root (a session leader) forks a child, then is killed.
    let late_pid = w.dir.path().join("late-pid");
    std::fs::write(w.dir.path().join("rewrite"), "fork").unwrap();
    // SAFETY: signalling our own workload.
    assert_eq!(unsafe { libc::kill(w.pid, libc::SIGUSR2) }, 0);
    wait_for("the restored root's fork", Duration::from_secs(30), || late_pid.exists());
    let late: i32 = std::fs::read_to_string(&late_pid).unwrap().trim().parse().unwrap();
    w.kill_and_reap();
    let err = refused("the killed root's session held by its child");
    let named =
        format!("pid {} of the checkpointed tree is still the session of process {late} (criuz-workload)", w.pid);
    assert!(err.contains(&named), "{err}");

    // SAFETY: killing the workload's own child, then reaping it (re-parented
    // to this test, a subreaper).
    unsafe {
        libc::kill(late, libc::SIGKILL);
        libc::waitpid(late, std::ptr::null_mut(), 0);
    }
    restore(&arc, &[]);
    assert_eq!(w.sums(), before, "restored memory differs");
    w.stop();
}

#[test]
fn archive_from_pipe_restores_and_pipe_buffer_cap_is_enforced() {
    let Some(_criu) = criu() else { return };
    let _g = serial();
    let mut w = Workload::start(Spec::default());
    let before = w.sums();
    let tmp = tempfile::tempdir().unwrap();
    let arc = tmp.path().join("ckpt.czr");
    // A $TMPDIR that is no directory, or one too long for the socket CRIU
    // connects to in the work directory made there: named, exit 2, before
    // anything is frozen.
    let pid = w.pid.to_string();
    let no_tmp = tmp.path().join("no-tmp");
    let long_tmp = tmp.path().join("t".repeat(100));
    std::fs::create_dir(&long_tmp).unwrap();
    for (dir, says) in [(&no_tmp, "no-tmp: no such directory"), (&long_tmp, "too long for the socket CRIU connects to")]
    {
        let out = Command::new(CRIUZ)
            .args(["dump", "-t", &pid, "-o", arc.to_str().unwrap()])
            .env("TMPDIR", dir)
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{err}");
        assert!(err.contains("$TMPDIR") && err.contains(says), "{err}");
        assert!(!arc.exists() && w.sums() == before, "a dump refused for its $TMPDIR changed something");
    }
    assert_eq!(std::fs::read_dir(&long_tmp).unwrap().count(), 0, "its work directory is left");
    dump(&w, &arc, &[]);
    w.reap_original();
    // A placed or lazy restore needs no socket path CRIU must connect by
    // (it connects by the name, from the work directory): the long $TMPDIR
    // does for them.
    // (The archive named without -i, as inspect takes it.) A relative
    // $TMPDIR too: CRIU works from its work directory, so every restore
    // failed "Can't write pidfile" there.
    std::fs::create_dir(tmp.path().join("rel")).unwrap();
    for (fill, tmpdir) in [("--fill=place", &long_tmp), ("--lazy", &long_tmp), ("--fill=stream", &"rel".into())] {
        let out = Command::new(CRIUZ)
            .args(["restore", "-d", arc.to_str().unwrap(), fill])
            .env("TMPDIR", tmpdir)
            .current_dir(tmp.path())
            .output()
            .unwrap();
        assert!(out.status.success(), "{fill}: {}", String::from_utf8_lossy(&out.stderr));
        assert_eq!(w.sums(), before, "{fill}");
        w.stop();
        w.reap_original();
    }
    // Through a pipe (`cat a.czr | criuz restore -i -`), or, `from_file`,
    // redirected from the archive (`< a.czr`). A piped archive is spooled to
    // $TMPDIR.
    let run_stdin = |extra: &[&str], from_file: bool| {
        let mut child = Command::new(CRIUZ)
            .args(["restore", "-d", "-i", "-"])
            .args(extra.iter().filter(|a| !a.starts_with("TMPDIR=")))
            .envs(extra.iter().filter_map(|a| a.strip_prefix("TMPDIR=")).map(|dir| ("TMPDIR", dir)))
            .stdin(if from_file { Stdio::from(File::open(&arc).unwrap()) } else { Stdio::piped() })
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let feed = child.stdin.take().map(|mut pipe| {
            let arc = arc.clone();
            // A restore that refuses the archive closes the pipe early.
            std::thread::spawn(move || drop(std::io::copy(&mut File::open(arc).unwrap(), &mut pipe)))
        });
        let mut err = String::new();
        std::io::Read::read_to_string(child.stderr.as_mut().unwrap(), &mut err).unwrap();
        let st = child.wait().unwrap();
        if let Some(f) = feed {
            f.join().unwrap();
        }
        (st, err)
    };
    let (st, err) = run_stdin(&["--pipe-buffer", "64K"], false);
    assert!(!st.success(), "a 64K pipe buffer cannot hold this archive");
    assert!(err.contains("--pipe-buffer"), "{err}");
    assert!(!w.alive(), "a failed restore must not leave the process running");
    let (st, err) = run_stdin(&[&format!("TMPDIR={}", no_tmp.display())], false);
    assert_eq!(st.code(), Some(2), "{err}");
    assert!(err.contains("$TMPDIR") && err.contains("no-tmp: no such directory"), "{err}");
    assert!(!w.alive(), "a failed restore must not leave the process running");
    // A read-only one is told as such, piped or not, before anything is
    // made there (it named a staging directory of criuz's own).
    let ro = tmp.path().join("ro");
    std::fs::create_dir(&ro).unwrap();
    let mounted = run(Command::new("mount").args(["-t", "tmpfs", "-o", "ro,size=1m", "tmpfs"]).arg(&ro));
    assert!(mounted.status.success(), "mount a read-only tmpfs: {}", String::from_utf8_lossy(&mounted.stderr));
    let told = [false, true].map(|from_file| run_stdin(&[&format!("TMPDIR={}", ro.display())], from_file));
    let _ = Command::new("umount").arg(&ro).status();
    for (st, err) in told {
        assert_eq!(st.code(), Some(2), "{err}");
        assert_eq!(err.lines().last(), Some(&*format!("criuz: $TMPDIR: {}: Read-only file system (os error 30): criuz makes its work files there; set TMPDIR to a writable directory", ro.display())), "{err}");
        assert!(!w.alive(), "a failed restore must not leave the process running");
    }
    // A $TMPDIR too small for the spool says so, and what to do.
    let small = small_fs(tmp.path());
    let mut child = Command::new(CRIUZ)
        .args(["restore", "-d", "-i", "-"])
        .env("TMPDIR", &small)
        .stdin(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut pipe = child.stdin.take().unwrap();
    let mut bytes = std::fs::read(&arc).unwrap();
    bytes.resize(bytes.len() + (5 << 20), 0);
    let feed = std::thread::spawn(move || drop(std::io::Write::write_all(&mut pipe, &bytes)));
    let out = child.wait_with_output().unwrap();
    feed.join().unwrap();
    let _ = Command::new("umount").arg(&small).status();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("no room to spool") && err.contains("set TMPDIR"), "{err}");
    assert!(!w.alive(), "a failed restore must not leave the process running");
    let (st, err) = run_stdin(&[], false);
    assert!(st.success(), "{err}");
    assert_eq!(w.sums(), before);
    w.kill_and_reap();
    // Redirected from the file, it is read in place: no spool, no cap.
    let (st, err) = run_stdin(&["--pipe-buffer", "64K"], true);
    assert!(st.success(), "{err}");
    assert_eq!(w.sums(), before);
    w.stop();
}

/// A named pipe (a FIFO, a shell's `<(…)` and `>(…)`, `/dev/stdin`) is
/// read and written as a stream, as `-` is: a restore from a FIFO said the
/// archive was truncated (exit 3), a verify or an unpack "bad magic" (its
/// first bytes were read, then the FIFO opened again).
#[test]
fn an_archive_goes_through_named_pipes_both_ways() {
    let Some(_criu) = criu() else { return };
    let _g = serial();
    let mut w = Workload::start(Spec { pattern: "mixed", mib: 16, ..Default::default() });
    let before = w.sums();
    let tmp = tempfile::tempdir().unwrap();
    let fifo = tmp.path().join("fifo");
    let c = std::ffi::CString::new(std::os::unix::ffi::OsStrExt::as_bytes(fifo.as_os_str())).unwrap();
    // SAFETY: mkfifo on a NUL-terminated path in our temporary directory.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
    let arc = tmp.path().join("w.czr");
    // Whatever criuz writes into the FIFO, copied to a file.
    let copy_out = {
        let (fifo, arc) = (fifo.clone(), arc.clone());
        std::thread::spawn(move || std::io::copy(&mut File::open(fifo).unwrap(), &mut File::create(arc).unwrap()))
    };
    ok(criuz(&["dump", "-t", &w.pid.to_string(), "-o", fifo.to_str().unwrap()]), "criuz dump -o FIFO");
    copy_out.join().unwrap().unwrap();
    w.reap_original();
    assert!(fifo.metadata().unwrap().file_type().is_fifo(), "the FIFO is left as it was");
    ok(criuz(&["verify", arc.to_str().unwrap()]), "criuz verify");
    // The archive fed into the FIFO for each reader.
    let feed = || {
        let (fifo, arc) = (fifo.clone(), arc.clone());
        std::thread::spawn(move || {
            let _ = std::io::copy(&mut File::open(arc).unwrap(), &mut File::options().write(true).open(fifo).unwrap());
        })
    };
    for args in [&["verify"][..], &["unpack", "-d", tmp.path().join("img").to_str().unwrap()]] {
        let fed = feed();
        let mut a = args.to_vec();
        a.insert(1, fifo.to_str().unwrap());
        ok(criuz(&a), &format!("criuz {args:?} FIFO"));
        fed.join().unwrap();
    }
    assert!(tmp.path().join("img/pagemap-".to_string() + &w.pid.to_string() + ".img").exists());
    for how in [&["--fill", "place"][..], &["--lazy"]] {
        let fed = feed();
        restore(&fifo, how);
        fed.join().unwrap();
        assert_eq!(w.sums(), before, "{how:?}: the restored memory differs");
        w.kill_and_reap();
    }
}

/// A stream that is no archive at all is told from its header, before
/// anything is spooled: `restore -i /dev/zero` copied 2 GiB of zeros to
/// `$TMPDIR` and then blamed `--pipe-buffer` (exit 2).
#[test]
fn a_stream_that_is_no_archive_is_refused_before_it_is_spooled() {
    let Some(_criu) = criu() else { return };
    let from_stdin = Command::new(CRIUZ)
        .args(["restore", "-d", "-i", "-"])
        .stdin(File::open("/dev/zero").unwrap())
        .output()
        .unwrap();
    for out in [criuz(&["restore", "-d", "-i", "/dev/zero"]), from_stdin] {
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(3), "{err}");
        assert!(err.contains("not a criuz archive") && !err.contains("--pipe-buffer"), "{err}");
    }
    // Nothing at all (a pipe whose writer failed, an empty file) is said
    // to be empty, not a truncated archive.
    let tmp = tempfile::tempdir().unwrap();
    let empty = tmp.path().join("empty.czr");
    File::create(&empty).unwrap();
    let empty = empty.to_str().unwrap();
    for (args, label) in
        [(&["restore", "-d", "-i", "/dev/null"][..], "/dev/null"), (&["restore", "-d", "-i", empty, "--lazy"], empty)]
    {
        let out = criuz(args);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(3), "{err}");
        assert_eq!(
            err.lines().last(),
            Some(&*format!("criuz: {label}: empty (0 bytes): not a criuz archive")),
            "{err}"
        );
    }
}

/// capture + plain `criu dump --stream`, then unpack + plain `criu restore -D`.
#[test]
fn capture_archive_unpacks_for_plain_criu_restore() {
    let Some(criu) = criu() else { return };
    let _g = serial();
    let mut w = Workload::start(Spec { mode: "tree", ..Default::default() });
    let before = w.sums();
    let tmp = tempfile::tempdir().unwrap();
    let (dir, arc, img) = (tmp.path().join("stream"), tmp.path().join("cap.czr"), tmp.path().join("img"));
    std::fs::create_dir(&dir).unwrap();
    let mut cap = Command::new(CRIUZ)
        .args(["capture", "-D", dir.to_str().unwrap(), "-o", arc.to_str().unwrap()])
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let sock = dir.join("streamer-capture.sock");
    wait_for("capture socket", Duration::from_secs(10), || sock.exists());
    assert_eq!(std::fs::metadata(&sock).unwrap().permissions().mode() & 0o777, 0o600, "socket must be 0600");
    let out = Command::new(&criu)
        .args(["dump", "--stream", "-o", "dump.log", "-t", &w.pid.to_string(), "-D"])
        .arg(&dir)
        .output()
        .unwrap();
    assert!(out.status.success(), "criu dump --stream: {}", log_tail(&dir.join("dump.log")));
    assert!(cap.wait().unwrap().success());
    w.reap_original();
    ok(criuz(&["unpack", arc.to_str().unwrap(), "-d", img.to_str().unwrap()]), "unpack");
    criu_restore(&criu, &img);
    assert_eq!(w.sums(), before);
    w.stop();
}

/// plain `criu dump -D`, pack, then `criuz restore`.
#[test]
fn packed_directory_restores_through_criuz_restore() {
    let Some(criu) = criu() else { return };
    let _g = serial();
    let mut w = Workload::start(Spec { mode: "tree", extra_maps: true, ..Default::default() });
    let before = w.sums();
    let tmp = tempfile::tempdir().unwrap();
    let (img, arc) = (tmp.path().join("img"), tmp.path().join("packed.czr"));
    criu_dump(&criu, w.pid, &img, &[]);
    w.reap_original();
    ok(criuz(&["pack", img.to_str().unwrap(), "-o", arc.to_str().unwrap(), "--codec", "zstd"]), "pack");
    let r = restore(&arc, &[]);
    assert!(r["zero_pages_skipped"].as_u64().unwrap() > 0);
    assert_eq!(w.sums(), before);
    w.stop();
}

/// The temporary archive a running `criuz dump -o arc` is writing.
fn temp_archive(arc: &Path) -> Option<PathBuf> {
    let dir = arc.parent().unwrap();
    let name = arc.file_name().unwrap().to_string_lossy().to_string();
    std::fs::read_dir(dir)
        .ok()?
        .filter_map(|e| e.ok())
        .map(|e| e.path())
        .find(|p| p.file_name().unwrap().to_string_lossy().starts_with(&format!(".{name}.criuz-tmp-")))
}

/// The children of `pid` (of each of its threads).
fn children_of(pid: u32) -> Vec<i32> {
    let mut out = Vec::new();
    if let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) {
        for t in tasks.flatten() {
            let c = std::fs::read_to_string(t.path().join("children")).unwrap_or_default();
            out.extend(c.split_whitespace().filter_map(|p| p.parse::<i32>().ok()));
        }
    }
    out
}

/// The CRIU processes criuz `pid` runs (not its other children: a dump's
/// guard is a fork of criuz).
fn criu_children_of(pid: u32) -> Vec<i32> {
    let mut out = children_of(pid);
    out.retain(|p| std::fs::read_to_string(format!("/proc/{p}/comm")).is_ok_and(|c| c.trim() == "criu"));
    out
}

/// Starts `criuz dump` of a large workload and waits until data flows,
/// CRIU still dumping: without an absorb budget CRIU waits for the codec.
fn dump_in_flight(w: &Workload, arc: &Path) -> std::process::Child {
    let child = Command::new(CRIUZ)
        .args([
            "dump",
            "-t",
            &w.pid.to_string(),
            "-o",
            arc.to_str().unwrap(),
            "-j",
            "1",
            "--codec",
            "zstd",
            "--level",
            "19",
            "--absorb",
            "0",
        ])
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    wait_for("the dump to be under way", Duration::from_secs(60), || {
        temp_archive(arc).and_then(|p| std::fs::metadata(p).ok()).is_some_and(|m| m.len() > 1 << 20)
    });
    child
}

#[test]
fn criu_dying_mid_dump_leaves_no_archive() {
    let Some(_criu) = criu() else { return };
    let _g = serial();
    let mut w = Workload::start(Spec { mib: 256, pattern: "text", ..Default::default() });
    let tmp = tempfile::tempdir().unwrap();
    let arc = tmp.path().join("ckpt.czr");
    let mut child = dump_in_flight(&w, &arc);
    let criu_pid = *criu_children_of(child.id()).first().expect("criu is running under criuz dump");
    // SAFETY: killing the CRIU we started through criuz.
    unsafe { libc::kill(criu_pid, libc::SIGKILL) };
    let mut err = String::new();
    std::io::Read::read_to_string(child.stderr.as_mut().unwrap(), &mut err).unwrap();
    assert!(!child.wait().unwrap().success());
    assert!(err.contains("criu dump failed") && err.contains("log:"), "{err}");
    assert!(!arc.exists(), "no archive may appear under the final name");
    assert!(temp_archive(&arc).is_none(), "the temporary archive must be removed");
    w.stop();
}

#[test]
fn criuz_killed_mid_dump_lets_criu_resume_the_process() {
    let Some(_criu) = criu() else { return };
    let _g = serial();
    let mut w = Workload::start(Spec { mib: 256, pattern: "text", ..Default::default() });
    let before = w.sums();
    let tmp = tempfile::tempdir().unwrap();
    let arc = tmp.path().join("ckpt.czr");
    let mut child = dump_in_flight(&w, &arc);
    let criu_pid = *criu_children_of(child.id()).first().expect("criu is running under criuz dump");
    child.kill().unwrap();
    child.wait().unwrap();
    // CRIU (now orphaned) must fail on the broken pipe and resume the tree.
    wait_for("CRIU to give up", Duration::from_secs(60), || {
        // SAFETY: reaping zombies re-parented to us.
        while unsafe { libc::waitpid(-1, std::ptr::null_mut(), libc::WNOHANG) } > 0 {}
        !Path::new(&format!("/proc/{criu_pid}")).exists()
    });
    assert!(w.alive(), "the process must keep running after a failed dump");
    assert_eq!(w.sums(), before, "the resumed process must be unchanged");
    assert!(!arc.exists());
    w.stop();
}

#[test]
fn corrupt_block_aborts_restore_before_the_process_runs() {
    let Some(_criu) = criu() else { return };
    let _g = serial();
    let arc = a_damaged_block_stops_the_restore(Spec { pattern: "text", ..Default::default() }, &[]);
    let out = criuz(&["verify", arc.path().join("ckpt.czr").to_str().unwrap()]);
    assert!(!out.status.success());
}

/// Dumps a workload of `spec`, damages one byte in the payload of a block
/// in the middle of its largest pages image, and checks that the restore
/// fails as damaged with the process never running. The archive's
/// directory is returned (`ckpt.czr` in it).
fn a_damaged_block_stops_the_restore(spec: Spec, restore_args: &[&str]) -> tempfile::TempDir {
    let mut w = Workload::start(spec);
    w.sums();
    let tmp = tempfile::tempdir().unwrap();
    let arc = tmp.path().join("ckpt.czr");
    dump(&w, &arc, &[]);
    w.reap_original();
    flip_a_byte_of_the_largest_pages_image(&arc);
    let out = criuz(&[&["restore", "-d", "-i", arc.to_str().unwrap()], restore_args].concat());
    assert_eq!(out.status.code(), Some(3), "restore from a damaged archive must fail as damaged");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("checksum") && err.contains("offset"), "{err}");
    std::thread::sleep(Duration::from_millis(300));
    assert!(!w.alive(), "the process must not run after an aborted restore");
    tmp
}

/// What of `pid`'s memory is transparent huge pages, KiB.
fn anon_huge_kib(pid: i32) -> u64 {
    rollup_kib(pid, "AnonHugePages:")
}

/// Whether this kernel gives memory asked for with MADV_HUGEPAGE huge pages.
fn transparent_huge_pages_on() -> bool {
    let mode = std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/enabled").unwrap_or_default();
    mode.contains("[always]") || mode.contains("[madvise]")
}

/// `UFFDIO_COPY` places 4 KiB pages only: memory the process had as
/// transparent huge pages came back from a placed restore in small pages
/// (and CRIU's own restore gives them back only under THP `always`). The
/// fill now writes such memory through the process's memory, where it
/// faults in as huge pages again; `--no-huge-pages` keeps 4 KiB pages, and
/// so does the rest of it once huge pages come slower than
/// `--huge-page-floor`. The memory is intact every way.
#[test]
fn memory_that_was_huge_pages_is_placed_as_huge_pages() {
    let Some(_criu) = criu() else { return };
    let _g = serial();
    let mut w = Workload::start(Spec { mib: 64, thp: true, ..Default::default() });
    let before = w.sums();
    let huge_before = anon_huge_kib(w.pid);
    let on = transparent_huge_pages_on();
    assert_eq!(huge_before > 0, on, "huge pages before the dump: {huge_before} KiB");
    let tmp = tempfile::tempdir().unwrap();
    let arc = tmp.path().join("ckpt.czr");
    dump(&w, &arc, &[]);
    w.reap_original();
    // Floor 0: huge pages however slowly they come (this VM's may come
    // slowly at times, and the default would then give up on them).
    let r = restore(&arc, &["--huge-page-floor", "0"]);
    assert_eq!(r["fill"], "place", "{r}");
    assert!(r.get("slow_huge_pages").is_none(), "{r}");
    let huge_after = anon_huge_kib(w.pid);
    if on {
        assert!(r["huge_page_bytes"].as_u64().unwrap_or(0) >= 62 << 20, "{r}");
        assert!(huge_after >= huge_before * 3 / 4, "huge pages {huge_before} KiB before, {huge_after} after");
    }
    assert_eq!(w.sums(), before, "restored memory differs");
    w.kill_and_reap();
    let r = restore(&arc, &["--no-huge-pages"]);
    assert_eq!(r["fill"], "place", "{r}");
    assert!(r.get("huge_page_bytes").is_none(), "{r}");
    assert_eq!(anon_huge_kib(w.pid), 0, "--no-huge-pages placed huge pages");
    assert_eq!(w.sums(), before, "restored memory differs (--no-huge-pages)");
    w.kill_and_reap();
    // Huge pages slower than the floor (here any: 1000 GB/s a thread) are
    // given up on after the first step (two threads: 32 MiB), and the rest
    // placed in 4 KiB pages through the userfaultfd, mid-span.
    let r = restore(&arc, &["--huge-page-floor", "1000", "-j", "2"]);
    assert_eq!(r["fill"], "place", "{r}");
    if on {
        let huge = r["huge_page_bytes"].as_u64().unwrap_or(0);
        let small = r["slow_huge_pages"]["small_page_bytes"].as_u64().unwrap_or(0);
        // One step of the 64 MiB (more only where THP `always` makes a
        // smaller mapping eligible too, whose step is too small to judge).
        assert!((32 << 20..62 << 20).contains(&huge), "one step written as huge pages: {r}");
        assert!(small > 0 && huge + small >= 62 << 20, "the rest in 4 KiB pages: {r}");
        assert!(r["slow_huge_pages"]["bytes_per_second"].as_f64().is_some_and(|b| b > 0.0), "{r}");
        let huge_after = anon_huge_kib(w.pid);
        assert!(huge_after > 0 && huge_after <= huge >> 10, "{huge_after} KiB of huge pages after {huge} bytes");
    }
    assert_eq!(w.sums(), before, "restored memory differs (huge pages given up on)");
    w.stop();
}

/// Memory placed as huge pages has no userfaultfd behind it while it is
/// written: a tree continued from outside (SIGCONT) in the middle of its
/// fill could read zeros there. A tree that is not stopped once CRIU has
/// exited is killed and the restore fails, rather than letting it run on
/// memory it may have read too early.
#[test]
fn a_held_tree_continued_from_outside_mid_fill_is_killed_not_let_run() {
    let Some(_criu) = criu() else { return };
    let _g = serial();
    continued_mid_fill(None);
}

/// The same, continued and stopped again before the fill ends: the tree
/// looks held when the fill ends, yet it ran meanwhile (its threads' run
/// times tell), so it is killed too.
#[test]
fn a_held_tree_continued_and_stopped_again_mid_fill_is_killed_not_let_run() {
    let Some(_criu) = criu() else { return };
    let _g = serial();
    continued_mid_fill(Some(Duration::from_millis(50)));
}

/// Restores 512 MiB of zstd text advised as huge pages on one thread (its
/// fill takes about a second once CRIU has left the tree stopped), sends
/// the tree SIGCONT 150 ms after it is first seen stopped (CRIU has exited
/// by then), and, with `stop_again`, SIGSTOP that long after; the restore
/// must fail and the tree be gone.
fn continued_mid_fill(stop_again: Option<Duration>) {
    assert!(transparent_huge_pages_on(), "this test needs transparent huge pages (always or madvise)");
    let mut w = Workload::start(Spec { mib: 512, pattern: "text", thp: true, ..Default::default() });
    let before = w.sums();
    let tmp = tempfile::tempdir().unwrap();
    let arc = tmp.path().join("ckpt.czr");
    dump(&w, &arc, &["--codec", "zstd"]);
    w.reap_original();
    let pid = w.pid;
    let continuer = std::thread::spawn(move || {
        let t = Instant::now();
        while t.elapsed() < Duration::from_secs(60) {
            if process_state(pid) == Some('T') {
                std::thread::sleep(Duration::from_millis(150));
                // SAFETY: signalling the test's own restored workload.
                unsafe { libc::kill(pid, libc::SIGCONT) };
                if let Some(after) = stop_again {
                    std::thread::sleep(after);
                    // SAFETY: as above.
                    unsafe { libc::kill(pid, libc::SIGSTOP) };
                }
                return true;
            }
            std::thread::sleep(Duration::from_micros(200));
        }
        false
    });
    let out = criuz(&["restore", "-d", "-i", arc.to_str().unwrap(), "-j", "1"]);
    assert!(continuer.join().unwrap(), "the held tree was never seen stopped");
    let err = String::from_utf8_lossy(&out.stderr);
    if out.status.success() {
        assert_eq!(w.sums(), before, "restored memory differs");
        w.stop();
        panic!("the restore let the tree run: it was not seen running mid-fill, or the fill ended first");
    }
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("continued the restored tree (SIGCONT) before its memory was all in"), "{err}");
    std::thread::sleep(Duration::from_millis(300));
    assert!(!w.alive(), "the continued tree must be killed");
}

/// A block that does not check out stops a placed restore before the tree
/// runs, where the fill writes through the process's memory too (no
/// userfaultfd there to hold a read of a page not yet in).
#[test]
fn a_damaged_block_of_huge_page_memory_stops_the_restore_before_the_process_runs() {
    let Some(_criu) = criu() else { return };
    let _g = serial();
    a_damaged_block_stops_the_restore(Spec { mib: 64, pattern: "text", thp: true, ..Default::default() }, &[]);
}

/// The same where huge pages were given up on after the first 16 MiB (one
/// thread, and a floor no kernel reaches): the damaged block, halfway
/// through the memory, lies in what is placed through the userfaultfd then.
#[test]
fn a_damaged_block_placed_after_huge_pages_were_given_up_on_stops_the_restore_before_the_process_runs() {
    let Some(_criu) = criu() else { return };
    let _g = serial();
    let spec = Spec { mib: 64, pattern: "text", thp: true, ..Default::default() };
    a_damaged_block_stops_the_restore(spec, &["--huge-page-floor", "1000", "-j", "1"]);
}

#[test]
fn dump_of_a_process_that_is_not_there_fails_cleanly() {
    let Some(_criu) = criu() else { return };
    let tmp = tempfile::tempdir().unwrap();
    let arc = tmp.path().join("none.czr");
    // A pid above the kernel's pid_max cannot exist.
    let out = criuz(&["dump", "-t", "99999999", "-o", arc.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(2), "a pid that names no process is a usage error");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("process 99999999 does not exist"), "{err}");
    assert!(!arc.exists());
    assert_eq!(std::fs::read_dir(tmp.path()).unwrap().count(), 0, "no temporary archive may be left");
    // A kernel thread was blamed on a tracer (CRIU cannot interrupt it).
    let kthreadd = (1..100).find(|&p| comm_of(p) == "kthreadd").expect("kthreadd among the first pids");
    let out = criuz(&["dump", "-t", &kthreadd.to_string(), "-o", arc.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(2), "a kernel thread is a usage error");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains(&format!("process {kthreadd} (kthreadd) is a kernel thread")), "{err}");
    assert!(!arc.exists());
}

fn comm_of(pid: i32) -> String {
    std::fs::read_to_string(format!("/proc/{pid}/comm")).unwrap_or_default().trim().to_string()
}

/// A workload of `spec`, its checksums, and its archive (in the directory
/// returned with it), dumped by criuz: its pids are free for a restore.
fn dumped(spec: Spec) -> (Workload, std::collections::BTreeMap<String, String>, tempfile::TempDir, PathBuf) {
    let mut w = Workload::start(spec);
    let before = w.sums();
    let tmp = tempfile::tempdir().unwrap();
    let arc = tmp.path().join("ckpt.czr");
    dump(&w, &arc, &[]);
    w.reap_original();
    (w, before, tmp, arc)
}

/// Whether the restored workload still runs 10 s after its criuz was
/// killed (zombies reaped meanwhile: the test is the tree's subreaper).
fn outlives_its_criuz(w: &Workload) -> bool {
    let t = Instant::now();
    while w.alive() && t.elapsed() < Duration::from_secs(10) {
        reap_zombies();
        std::thread::sleep(Duration::from_millis(10));
    }
    w.alive()
}

/// A restore in the foreground gives CRIU criuz's standard streams only for
/// the tree to take (`--shell-job`, `--inherit-fd`). Given them always,
/// every helper CRIU forked held them too, and one that a SIGKILL of criuz
/// during CRIU's start left stopped (its kernel probe, under its ptrace)
/// kept a pipe out of criuz open: `criuz restore | …` never ended.
#[test]
fn a_foreground_restore_killed_as_criu_starts_ends_its_output() {
    let Some(_criu) = criu() else { return };
    let _g = serial();
    let (mut w, before, _tmp, arc) = dumped(Spec::default());
    let mut restore = Command::new(CRIUZ)
        .args(["restore", "-i", arc.to_str().unwrap()])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut out = restore.stdout.take().unwrap();
    let reader = std::thread::spawn(move || std::io::Read::read_to_end(&mut out, &mut Vec::new()));
    // CRIU, then (if seen in time) its probe stopped under its ptrace.
    let t = Instant::now();
    let mut criu_pid = None;
    let mut stdout_of_criu = String::new();
    let mut helpers = Vec::new();
    let mut probe_stopped = false;
    while t.elapsed() < Duration::from_secs(10) {
        if criu_pid.is_none() {
            criu_pid = criu_children_of(restore.id()).first().copied();
            if let Some(c) = criu_pid {
                let fd1 = std::fs::read_link(format!("/proc/{c}/fd/1"));
                stdout_of_criu = fd1.map(|l| l.display().to_string()).unwrap_or_default();
            }
        }
        if let Some(c) = criu_pid {
            helpers = children_of(c as u32);
            probe_stopped = helpers.iter().any(|&h| matches!(process_state(h), Some('t' | 'T')));
            if probe_stopped || comm_of(c) != "criu" {
                break;
            }
        }
        std::thread::sleep(Duration::from_micros(200));
    }
    restore.kill().unwrap();
    restore.wait().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || tx.send(reader.join()));
    let ended = rx.recv_timeout(Duration::from_secs(10)).is_ok();
    // What a killed criuz leaves (the next criuz sweeps it): ours to end here.
    for h in helpers.iter().filter(|&&h| comm_of(h) == "criu") {
        // SAFETY: a probe of the CRIU this test's criuz ran.
        unsafe { libc::kill(*h, libc::SIGKILL) };
    }
    assert!(criu_pid.is_some(), "CRIU was never seen");
    // A file of its own in its work directory, not criuz's pipe.
    assert!(stdout_of_criu.ends_with("/criu-output"), "CRIU held criuz's standard output: {stdout_of_criu}");
    assert!(ended, "criuz's output did not end after criuz was killed");
    // Killed while CRIU started, criuz leaves no tree; but where CRIU (with
    // its kernel cache, a few milliseconds) was done before the kill, the
    // tree may have run whole by then, and a whole tree outlives criuz.
    if outlives_its_criuz(&w) {
        assert!(!probe_stopped, "killed while CRIU's probe was stopped, criuz left its tree running");
        assert_eq!(w.sums(), before, "a tree that outlived criuz must be whole");
        w.stop();
    }
}

/// CRIU writes its pidfile before it lets the restored tasks out of its
/// restorer, where they wait for it with every signal blocked. A criuz
/// killed between the two takes its CRIU with it (`PR_SET_PDEATHSIG`): a
/// guard released at the pidfile left the tree running and answering
/// nothing, for good (the fault campaign's restore-stream kill-criuz, 1
/// trial in some hundreds). Caught here every time, with CRIU stopped as
/// its pidfile appears: the tree must be gone, or run whole.
#[test]
fn a_restore_whose_criuz_dies_as_criu_names_the_tree_leaves_nothing_stuck() {
    let Some(_criu) = criu() else { return };
    let _g = serial();
    // Detached, or in the foreground (the root criuz's own child).
    for how in [&["--fill", "stream", "-d"][..], &["--fill", "place", "-d"], &["--fill", "stream"]] {
        let said = how.join(" ");
        let (mut w, before, _tmp, arc) = dumped(Spec { mode: "tree", children: 1, mib: 16, ..Default::default() });
        let mut restore = Command::new(CRIUZ)
            .arg("restore")
            .args(how)
            .args(["-i", arc.to_str().unwrap()])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let t = Instant::now();
        let mut criu_and_pidfile: Option<(i32, PathBuf)> = None;
        let mut caught = false;
        while t.elapsed() < Duration::from_secs(30) && !caught {
            if criu_and_pidfile.is_none() {
                criu_and_pidfile = criu_children_of(restore.id()).first().and_then(|&c| {
                    let cmdline = std::fs::read(format!("/proc/{c}/cmdline")).ok()?;
                    let args: Vec<&[u8]> = cmdline.split(|&b| b == 0).collect();
                    let at = args.iter().position(|a| *a == b"--pidfile")?;
                    Some((c, PathBuf::from(String::from_utf8_lossy(args.get(at + 1)?).into_owned())))
                });
            }
            if let Some((c, pidfile)) = &criu_and_pidfile {
                if pidfile.exists() {
                    // SAFETY: the CRIU of this test's criuz (it dies with it).
                    unsafe { libc::kill(*c, libc::SIGSTOP) };
                    caught = true;
                    // Long enough for criuz to see the pidfile too.
                    std::thread::sleep(Duration::from_millis(100));
                }
            }
            if restore.try_wait().unwrap().is_some() {
                break;
            }
            std::thread::sleep(Duration::from_micros(50));
        }
        restore.kill().unwrap();
        restore.wait().unwrap();
        assert!(caught, "{said}: CRIU's pidfile was never seen while criuz ran");
        if outlives_its_criuz(&w) {
            let tree: Vec<i32> = [vec![w.pid], children_of(w.pid as u32)].concat();
            let answered = w.sums_within(Duration::from_secs(5));
            // The whole tree: its child outlives a killed root (it has no
            // parent-death signal), and the reap waits for every pid.
            for &p in &tree {
                // SAFETY: the tree this test restored.
                unsafe { libc::kill(p, libc::SIGKILL) };
            }
            match answered {
                Ok(sums) => assert_eq!(sums, before, "{said}: a tree that outlived criuz must be whole"),
                Err(role) => {
                    panic!("{said}: criuz killed as CRIU named the tree left {role} running and answering nothing")
                }
            }
            w.reap_original();
        }
        reap_zombies();
    }
}

/// CRIU 4.2.1 waits for good where a SIGCONT from outside stops a thread
/// it has seized in its last restore stage (a ptrace trap it does not
/// answer, while it waits on a futex for that thread). criuz sees it
/// (`proc::stuck`), ends CRIU and the half-restored tree, and says why:
/// exit 1, nothing left, and the restore run again (with CRIU alone)
/// restores the tree intact. A shim preloaded into CRIU sends the SIGCONT
/// at the one moment that hangs it, every time (`tests/sigcont_shim`). On
/// every restore path, detached and in the foreground (where CRIU seized
/// the root earlier, as its sibling), a tree of two processes.
#[test]
fn a_criu_waiting_for_good_on_a_continued_thread_is_ended_and_the_restore_fails() {
    let Some(real) = criu() else { return };
    let _g = serial();
    let dir = tempfile::tempdir().unwrap();
    let wrapper = criu_made_to_wait_for_good(dir.path(), &real);
    for how in [&["--fill", "place", "-d"][..], &["--fill", "stream", "-d"], &["--lazy", "-d"], &["--fill", "place"]] {
        let said = how.join(" ");
        let (mut w, before, _tmp, arc) = dumped(Spec { mode: "tree", children: 1, mib: 16, ..Default::default() });
        let tree: Vec<i32> = w.pids.clone();
        let mut restore = Command::new(CRIUZ);
        restore.args(["restore", "-i", arc.to_str().unwrap(), "--criu", wrapper.to_str().unwrap()]).args(how);
        // A criuz that waits with CRIU fails the test rather than hang it
        // (killed, it takes CRIU and the tree with it).
        let Some((status, err)) = status_and_stderr_within(&mut restore, Duration::from_secs(30)) else {
            panic!("{said}: criuz still waited with CRIU after 30 s")
        };
        assert_eq!(status.code(), Some(1), "{said}: {err}");
        assert!(err.contains("CRIU waited for good") && err.contains("continued (SIGCONT)"), "{said}: {err}");
        reap_zombies();
        wait_for(&format!("{said}: the half-restored tree gone"), Duration::from_secs(5), || {
            reap_zombies();
            tree.iter().all(|&p| process_state(p).is_none_or(|s| s == 'Z'))
        });
        let out = criuz(&["restore", "-d", "-i", arc.to_str().unwrap()]);
        assert!(out.status.success(), "{said}: again: {}", String::from_utf8_lossy(&out.stderr));
        assert_eq!(w.sums(), before, "{said}: restored again");
        w.stop();
    }
}

/// A pidfile that could not be written once the tree runs is refused
/// first where that can be seen (no such directory, a directory named);
/// one that still fails once the tree runs (here, in /proc, where nothing
/// can be created) fails the restore and kills the tree, on every fill:
/// exit 1 with the tree running would have left a supervisor a process it
/// has no pid for, holding the pids of its next try.
#[test]
fn a_restore_whose_pidfile_cannot_be_written_leaves_nothing_running() {
    let Some(_criu) = criu() else { return };
    let _g = serial();
    let tmp = tempfile::tempdir().unwrap();
    let missing = tmp.path().join("no-such-dir/restored.pid");
    // Refused before the archive is opened: an empty file does (one that is
    // not there is refused first, as a named input).
    let arc = tmp.path().join("any.czr");
    std::fs::write(&arc, b"").unwrap();
    for (pidfile, says) in [(missing.as_path(), "no-such-dir is not a directory"), (tmp.path(), "is a directory")] {
        let out = criuz(&["restore", "-d", "-i", arc.to_str().unwrap(), "--pidfile", pidfile.to_str().unwrap()]);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{err}");
        assert!(err.contains("--pidfile") && err.contains(says), "{err}");
    }
    let mut w = Workload::start(Spec { pattern: "mixed", mib: 16, ..Default::default() });
    let before = w.sums();
    let arc = tmp.path().join("w.czr");
    dump(&w, &arc, &[]);
    w.reap_original();
    let unwritable = "/proc/criuz-test-restored.pid";
    // Streamed several times: criuz lets go of a streamed tree as CRIU
    // writes its pidfile, and as CRIU exits the tree goes to criuz or, now
    // and then (2 of 12 by hand), above it; either way it is this
    // restore's to end (a build that ended only criuz's descendants left
    // it running).
    let stream = &["--fill", "stream"][..];
    for how in [stream, stream, stream, stream, stream, stream, &["--fill", "place"], &["--lazy"]] {
        let mut args = vec!["restore", "-d", "-i", arc.to_str().unwrap(), "--pidfile", unwritable];
        args.extend_from_slice(how);
        let out = criuz(&args);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{how:?}: {err}");
        assert!(err.contains("cannot write --pidfile, restored tree killed"), "{how:?}: {err}");
        reap_zombies();
        assert!(!w.alive(), "{how:?}: the restore failed, but its tree runs");
    }
    // Its pids free at once, the archive restores.
    restore(&arc, &[]);
    assert_eq!(w.sums(), before, "the restored memory differs");
}

/// CRIU options criuz sets itself, given again after `--`, would override
/// criuz's (CRIU's last word wins): a dump with `-D` lost its images and
/// its log, one with `-s` its process. They are refused before CRIU runs.
#[test]
fn criu_options_that_criuz_sets_are_refused_after_the_double_dash() {
    let Some(_criu) = criu() else { return };
    let _g = serial();
    let mut w = Workload::start(Spec::default());
    let before = w.sums();
    let tmp = tempfile::tempdir().unwrap();
    let arc = tmp.path().join("ckpt.czr");
    // What the restore names is there (an empty file: refused before it is read).
    let input = tmp.path().join("in.czr");
    std::fs::write(&input, b"").unwrap();
    let (a, i, pid) = (arc.to_str().unwrap(), input.to_str().unwrap(), w.pid.to_string());
    for (args, names) in [
        (vec!["dump", "-t", &pid, "-o", a, "--", "--tcp-established", "-D", "/tmp"], "-D"),
        (vec!["dump", "-t", &pid, "-o", a, "--", "-js"], "criuz dump --leave-running"),
        (vec!["restore", "-i", i, "--", "--restore-det"], "criuz restore -d"),
    ] {
        let out = criuz(&args);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
        assert!(err.contains(names), "{args:?}: {err}");
    }
    // An option CRIU does not know is CRIU's to refuse, before it opens its
    // log: what it said on its standard error is quoted (it was "CRIU wrote
    // no log", nothing more).
    let out = criuz(&["dump", "-t", &pid, "-o", a, "--", "--no-such-option"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("it said: ") && err.contains("unrecognized option '--no-such-option'"), "{err}");
    assert!(!arc.exists());
    assert_eq!(w.sums(), before, "the process must run on, untouched");
    w.stop();
}

/// Run by a user other than root, CRIU stops before its log with "CRIU
/// needs to have the CAP_SYS_ADMIN or the CAP_CHECKPOINT_RESTORE
/// capability", written to its standard output, which criuz threw away:
/// the dump said "CRIU wrote no log" and nothing more. And where CRIU is
/// not found (setup builds it into root's cache), the user is told that it
/// must run as root.
#[test]
fn a_user_without_criu_s_rights_is_told_what_it_needs() {
    let Some(criu) = criu() else { return };
    let _g = serial();
    let tmp = tempfile::tempdir().unwrap();
    std::fs::set_permissions(tmp.path(), std::fs::Permissions::from_mode(0o777)).unwrap();
    let theirs = tmp.path().join("criu");
    std::fs::copy(&criu, &theirs).unwrap();
    let arc = tmp.path().join("ckpt.czr");
    let as_nobody = |args: &[&str]| {
        let mut cmd = Command::new("setpriv");
        cmd.args(["--reuid=65534", "--regid=65534", "--clear-groups", "--", CRIUZ]).args(args);
        cmd.env("HOME", tmp.path()).env("PATH", "/usr/bin:/bin").env_remove("CRIUZ_CRIU");
        let out = run(&mut cmd);
        (out.status.code(), String::from_utf8_lossy(&out.stderr).into_owned())
    };
    let (a, c) = (arc.to_str().unwrap(), theirs.to_str().unwrap());
    // A process of root's (not criuz's ancestor, which is refused first):
    // CRIU refuses for want of rights before any target matters.
    let mut roots = Command::new("sleep").arg("60").stdout(Stdio::null()).spawn().unwrap();
    let target = roots.id().to_string();
    for verb in [vec!["dump", "-t", &target, "-o", a], vec!["restore", "-d", "-i", a]] {
        if verb[0] == "restore" {
            // An archive of their own to restore (refused by CRIU's rights
            // before any pid matters).
            let mut w = Workload::start(Spec::default());
            let mine = tmp.path().join("mine.czr");
            let out = criuz(&["dump", "-t", &w.pid.to_string(), "-o", mine.to_str().unwrap(), "--leave-running"]);
            assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
            std::fs::set_permissions(&mine, std::fs::Permissions::from_mode(0o644)).unwrap();
            std::fs::rename(&mine, &arc).unwrap();
            w.stop();
        }
        let (code, err) = as_nobody(&[&verb[..], &["--criu", c]].concat());
        assert_eq!(code, Some(1), "{verb:?}: {err}");
        assert!(
            err.contains(
                "it said: CRIU needs to have the CAP_SYS_ADMIN or the CAP_CHECKPOINT_RESTORE capability: setcap"
            ),
            "{verb:?}: {err}"
        );
        let (code, err) = as_nobody(&verb);
        assert_eq!(code, Some(1), "{verb:?}: {err}");
        assert!(err.contains("no usable CRIU") && err.contains("as root"), "{verb:?}: {err}");
    }
    let _ = (roots.kill(), roots.wait());
}

/// A process started in a pid namespace of its own (`unshare -pf`, a
/// sandbox) was dumped and ended, and its restore then failed: "pid 1 of
/// the checkpointed tree is in use by process_api", the archive's pids
/// (numbered in that namespace) taken for pids here, where criuz also
/// ends and resumes a restored tree by them. criuz takes no pid namespaces
/// (containers go through runc): the dump is refused before anything
/// ends, and such an archive's restore says how to restore it, which is
/// then done as it says.
#[test]
fn a_pid_namespace_of_its_own_is_refused_before_anything_ends() {
    let Some(criu) = criu() else { return };
    let _g = serial();
    become_subreaper();
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("wl");
    std::fs::create_dir(&dir).unwrap();
    let mut unshare = Command::new("unshare")
        .args(["--pid", "--fork", "--", WORKLOAD, "--dir", dir.to_str().unwrap(), "--mib", "8"])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    wait_for("workload ready", Duration::from_secs(60), || dir.join("ready").exists());
    assert_eq!(std::fs::read_to_string(dir.join("ready")).unwrap().trim(), "1", "pid 1 in its namespace");
    let children = format!("/proc/{0}/task/{0}/children", unshare.id());
    let pid: i32 = std::fs::read_to_string(children).unwrap().trim().parse().unwrap();
    let sum = || {
        let _ = std::fs::remove_file(dir.join("sum-root"));
        // SAFETY: signalling our own workload.
        assert_eq!(unsafe { libc::kill(pid, libc::SIGUSR1) }, 0);
        wait_for("checksum", Duration::from_secs(30), || dir.join("sum-root").exists());
        let line = std::fs::read_to_string(dir.join("sum-root")).unwrap();
        line.split_whitespace().next().unwrap().to_string()
    };
    let before = sum();
    let arc = tmp.path().join("ns.czr");
    let (a, p) = (arc.to_str().unwrap(), pid.to_string());
    let out = criuz(&["dump", "-t", &p, "-o", a]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains(&format!("process {pid} is the init of its own pid namespace")), "{err}");
    assert!(!arc.exists());
    assert_ne!(process_state(pid), Some('T'));
    assert_eq!(sum(), before, "the process runs on, untouched");

    // An archive of it all the same (CRIU's images, packed): refused by
    // name, and restored as the refusal says.
    let images = tmp.path().join("images");
    criu_dump(&criu, pid, &images, &[]);
    unshare.wait().unwrap();
    assert!(criuz(&["pack", images.to_str().unwrap(), "-o", a]).status.success());
    let out = criuz(&["restore", "-d", a]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("its tree was the init of its own pid namespace") && err.contains("criuz unpack"), "{err}");
    let unpacked = tmp.path().join("unpacked");
    assert!(criuz(&["unpack", a, "-d", unpacked.to_str().unwrap()]).status.success());
    let pidfile = tmp.path().join("restored.pid");
    let out = run(Command::new(&criu)
        .args(["restore", "-d", "-D"])
        .arg(&unpacked)
        .args(["-o", "restore.log", "--pidfile"])
        .arg(&pidfile));
    assert!(out.status.success(), "{}", log_tail(&unpacked.join("restore.log")));
    let restored: i32 = std::fs::read_to_string(&pidfile).unwrap().trim().parse().unwrap();
    let _ = std::fs::remove_file(dir.join("sum-root"));
    // SAFETY: the process this test restored.
    assert_eq!(unsafe { libc::kill(restored, libc::SIGUSR1) }, 0);
    wait_for("checksum", Duration::from_secs(30), || dir.join("sum-root").exists());
    let after = std::fs::read_to_string(dir.join("sum-root")).unwrap();
    assert_eq!(after.split_whitespace().next().unwrap(), before, "the restored memory differs");
    // SAFETY: as above; the namespace ends with its init.
    unsafe { libc::kill(restored, libc::SIGKILL) };
    reap_zombies();
}

/// CRIU works from its work directory, so a relative path given to it
/// after `--` named a file there: `-- --action-script ./hook.sh` failed the
/// dump "Pre dump script failed". Such paths are made absolute from where
/// criuz runs, as the user meant them.
#[test]
fn a_relative_action_script_runs_on_dump_and_restore() {
    let Some(_criu) = criu() else { return };
    let _g = serial();
    let mut w = Workload::start(Spec::default());
    let before = w.sums();
    let tmp = tempfile::tempdir().unwrap();
    let said = tmp.path().join("actions");
    let hook = tmp.path().join("hook.sh");
    std::fs::write(&hook, format!("#!/bin/sh\necho \"$CRTOOLS_SCRIPT_ACTION\" >> {}\n", said.display())).unwrap();
    std::fs::set_permissions(&hook, std::fs::Permissions::from_mode(0o755)).unwrap();
    let in_tmp = |args: &[&str]| {
        let out = run(Command::new(CRIUZ).args(args).current_dir(tmp.path()));
        assert!(out.status.success(), "{args:?}: {}", String::from_utf8_lossy(&out.stderr));
    };
    let pid = w.pid.to_string();
    in_tmp(&["dump", "-t", &pid, "-o", "a.czr", "--", "--action-script", "./hook.sh"]);
    w.reap_original();
    in_tmp(&["restore", "-d", "a.czr", "--", "--action=hook.sh"]);
    assert_eq!(w.sums(), before, "the restored memory differs");
    let actions = std::fs::read_to_string(&said).unwrap();
    for action in ["pre-dump", "post-dump", "pre-restore", "post-restore"] {
        assert!(actions.lines().any(|l| l == action), "{action} not run: {actions}");
    }
    w.stop();
}

/// Two restores of one checkpoint at once (a retry started while the first
/// still ran): both find the pids free, one's CRIU takes them, and the
/// other's fails "Can't fork ... File exists". That one's cleanup waited
/// for the tree's pids to be free and, after a second, killed what held
/// them: the tree the first restore had just reported restored. A failed
/// restore now waits for and kills only what it restored itself.
#[test]
fn two_restores_of_one_checkpoint_at_once_leave_the_winner_running() {
    let Some(_criu) = criu() else { return };
    let _g = serial();
    let mut w = Workload::start(Spec::default());
    let before = w.sums();
    let tmp = tempfile::tempdir().unwrap();
    let arc = tmp.path().join("a.czr");
    dump(&w, &arc, &[]);
    w.reap_original();
    for fill in ["stream", "place", "stream"] {
        let start = || {
            Command::new(CRIUZ)
                .args(["restore", "-d", arc.to_str().unwrap(), "--fill", fill])
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap()
        };
        let (a, b) = (start(), start());
        let (a, b) = (a.wait_with_output().unwrap(), b.wait_with_output().unwrap());
        let said = format!("{}{}", String::from_utf8_lossy(&a.stderr), String::from_utf8_lossy(&b.stderr));
        assert_eq!(u8::from(a.status.success()) + u8::from(b.status.success()), 1, "{fill}: one restore wins: {said}");
        // The loser's cleanup, had it been let, killed after a second.
        std::thread::sleep(Duration::from_millis(1500));
        assert!(w.alive(), "{fill}: the restored tree was killed: {said}");
        assert_eq!(w.sums(), before, "{fill}");
        w.stop();
        w.reap_original();
    }
    w.stop();
}

/// CRIU needs an open-files limit above the highest descriptor a restored
/// process had, and inherits criuz's. Started, as shells and service
/// managers start it, at a soft 1024 under a higher hard limit, a restore
/// of a process that had used descriptor 3000 failed "Can't chose
/// service_fd_base". criuz raises its soft limit to the hard one first;
/// where the hard limit is too low as well, the failure says so.
#[test]
fn a_process_of_many_descriptors_restores_under_a_low_soft_limit() {
    let Some(_criu) = criu() else { return };
    let _g = serial();
    let mut w = Workload::start(Spec { high_fd: Some(3000), ..Default::default() });
    let before = w.sums();
    let tmp = tempfile::tempdir().unwrap();
    let arc = tmp.path().join("a.czr");
    dump(&w, &arc, &[]);
    w.reap_original();
    let restore_under = |soft, hard| {
        let mut cmd = Command::new(CRIUZ);
        cmd.args(["restore", "-d", arc.to_str().unwrap()]);
        run(with_rlimit(&mut cmd, libc::RLIMIT_NOFILE, soft, hard))
    };
    let out = restore_under(1024, 1024);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("raise the hard limit"), "{err}");
    let out = restore_under(1024, 4096);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(w.sums(), before, "the restored memory differs");
    let fd = std::fs::read_link(format!("/proc/{}/fd/3000", w.pid)).unwrap();
    assert_eq!(fd, Path::new("/dev/null"), "its descriptor comes back");
    w.stop();
}

/// Private huge-page memory (`MAP_HUGETLB`: a JVM's large pages, DPDK)
/// CRIU restores in its restorer, reading the pages image at random,
/// which its image stream cannot do: a streamed restore failed "Can't read
/// pages data (-29)", and so did every default restore that streams (from
/// S3, with `--keep-zero-pages`). The default now places such a tree
/// whatever else would stream it, and `--fill stream` is refused by name.
/// And the dump counts those pages as memory the tree holds (they are not
/// in its `VmRSS`): it absorbs them like any other, where it used to size
/// its absorb budget for the rest and compress the huge pages in haste.
#[test]
fn private_huge_pages_are_placed_never_streamed() {
    let Some(_criu) = criu() else { return };
    let _g = serial();
    let _reserved = HugePages::reserve(40);
    let (mib, huge_mib) = (8, 64);
    let mut w = Workload::start(Spec { mib, huge_mib, ..Default::default() });
    let before = w.sums();
    let tmp = tempfile::tempdir().unwrap();
    let arc = tmp.path().join("a.czr");
    let report = dump(&w, &arc, &[]);
    // Three times what the tree holds, beyond the pipeline's own 64 MiB
    // (`session::checkpoint::granted`).
    let budget = report["absorb_budget"].as_u64().unwrap();
    assert!(budget >= (64 + 3 * (mib + huge_mib) as u64) << 20, "absorb budget {budget}: {report}");
    assert_eq!(report["hurried_blocks"], 0, "{report}");
    w.reap_original();
    let out = criuz(&["restore", "-d", arc.to_str().unwrap(), "--fill", "stream"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains("private huge-page memory (MAP_HUGETLB)"), "{err}");
    for extra in [&[][..], &["--keep-zero-pages"], &["--lazy"]] {
        let report = restore(&arc, extra);
        assert_ne!(report["fill"], "stream", "{extra:?}: {report}");
        assert_eq!(w.sums(), before, "{extra:?}: the restored memory differs");
        w.kill_and_reap();
    }
    w.stop();
}

/// Shared memory written by a process that has since exited (PostgreSQL's
/// shared buffers, filled by backends that come and go) is in no process's
/// resident set, yet CRIU dumps all of it. The absorb budget, sized by the
/// resident sets alone, ran out: a 556 MiB PostgreSQL dump compressed 991
/// blocks in haste and then again. It counts what the shared objects hold
/// now, and the memory restores as the filler wrote it.
#[test]
fn shared_memory_no_process_of_the_tree_touched_is_absorbed_not_hurried() {
    let Some(_criu) = criu() else { return };
    let _g = serial();
    let mib = 128;
    let mut w = Workload::start(Spec { mib, shared: true, filled_by_child: true, ..Default::default() });
    let sum = |line: &str| line.split_whitespace().find(|f| f.starts_with("sum=")).map(str::to_string);
    let filled = std::fs::read_to_string(w.dir.path().join("sum-filler")).unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let arc = tmp.path().join("a.czr");
    let report = dump(&w, &arc, &[]);
    let budget = report["absorb_budget"].as_u64().unwrap();
    assert!(budget >= (64 + 3 * mib as u64) << 20, "absorb budget {budget}: {report}");
    assert_eq!(report["hurried_blocks"], 0, "{report}");
    // Within its budget (shared memory only the tree reaches is held by
    // reference, as below): its own peak, as it reports it.
    let peak = report["peak_rss_bytes"].as_u64().unwrap();
    assert!(peak > 0 && peak <= budget + (64 << 20), "criuz's peak {peak}: {report}");
    w.reap_original();
    restore(&arc, &[]);
    let restored = w.sums();
    assert_eq!(sum(&restored["root"]), sum(&filled), "the restored shared memory differs");
    w.kill_and_reap();
    w.stop();
}

/// The shared anonymous memory of process `pid`, mapped into this test
/// process through /proc/PID/map_files: a process outside the tree that
/// could write it. Unmapped when dropped.
struct MappedFromOutside {
    addr: *mut libc::c_void,
    len: usize,
}

impl MappedFromOutside {
    fn of(pid: i32) -> MappedFromOutside {
        let maps = std::fs::read_to_string(format!("/proc/{pid}/maps")).unwrap();
        let line = maps.lines().find(|l| l.ends_with("/dev/zero (deleted)")).expect("shared anonymous memory");
        let range = line.split(' ').next().unwrap();
        let (start, end) = range.split_once('-').unwrap();
        let len = (u64::from_str_radix(end, 16).unwrap() - u64::from_str_radix(start, 16).unwrap()) as usize;
        let file = File::open(format!("/proc/{pid}/map_files/{range}")).unwrap();
        // SAFETY: a fresh read-only shared mapping of that object, unmapped
        // on drop; nothing here reads it.
        let addr = unsafe {
            let fd = std::os::fd::AsRawFd::as_raw_fd(&file);
            libc::mmap(std::ptr::null_mut(), len, libc::PROT_READ, libc::MAP_SHARED, fd, 0)
        };
        assert_ne!(addr, libc::MAP_FAILED, "{}", std::io::Error::last_os_error());
        MappedFromOutside { addr, len }
    }
}

impl Drop for MappedFromOutside {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `of`, unmapped once.
        unsafe { libc::munmap(self.addr, self.len) };
    }
}

/// Shared memory that only the dumped tree reaches is held by reference
/// while the tree is stopped, as its private memory is: no copy, and none
/// of criuz's memory. Shared memory a process outside the tree maps is
/// copied as CRIU writes it, since that process may write it meanwhile.
/// A process outside that maps it while the checkpoint is written gets the
/// dump refused before it commits: no archive, and the process runs on,
/// unchanged.
#[test]
fn shared_memory_is_held_only_while_the_tree_alone_reaches_it() {
    let Some(_criu) = criu() else { return };
    let _g = serial();
    let mib = 64;
    let shared_blocks = ((mib as u64) << 20) / (256 << 10);
    let sum = |line: &str| line.split_whitespace().find(|f| f.starts_with("sum=")).map(str::to_string);
    let tmp = tempfile::tempdir().unwrap();
    let spec = || Spec { mib, shared: true, filled_by_child: true, ..Default::default() };
    let filled = |w: &Workload| std::fs::read_to_string(w.dir.path().join("sum-filler")).unwrap();

    // Dumped (with this process mapping the memory, outside the tree, if
    // asked) and restored whole: the dump's report.
    let round_trip = |name: &str, mapped_outside: bool| {
        let mut w = Workload::start(spec());
        let before = filled(&w);
        let outside = mapped_outside.then(|| MappedFromOutside::of(w.pid));
        let arc = tmp.path().join(name);
        let report = dump(&w, &arc, &[]);
        drop(outside);
        w.reap_original();
        restore(&arc, &[]);
        assert_eq!(sum(&w.sums()["root"]), sum(&before), "{name}: the restored shared memory differs");
        w.kill_and_reap();
        w.stop();
        report
    };
    // The tree's alone: every block of it held.
    let report = round_trip("alone.czr", false);
    let held = report["held_blocks"].as_u64().unwrap();
    assert!(held >= shared_blocks, "{held} blocks held, {shared_blocks} of shared memory: {report}");
    // Mapped by this process, outside the tree: copied, not held.
    let report = round_trip("outside.czr", true);
    let held = report["held_blocks"].as_u64().unwrap();
    assert!(held < shared_blocks / 4, "{held} blocks held of memory mapped outside the tree: {report}");

    // Mapped from outside once CRIU has the tree: refused before it commits.
    let mut w = Workload::start(spec());
    let before = w.sums();
    let arc = tmp.path().join("late.czr");
    let mut child = dump_in_flight(&w, &arc);
    let outside = MappedFromOutside::of(w.pid);
    let mut err = String::new();
    std::io::Read::read_to_string(child.stderr.as_mut().unwrap(), &mut err).unwrap();
    let status = child.wait().unwrap();
    drop(outside);
    assert_eq!(status.code(), Some(1), "{err}");
    assert!(err.contains("mapped or opened its shared memory") && err.contains("was resumed"), "{err}");
    assert!(!arc.exists() && temp_archive(&arc).is_none(), "an archive was left");
    assert_eq!(w.sums(), before, "the process must run on unchanged");
    w.stop();
}

/// A disk that fills while a dump of held shared memory is written: the
/// dump ends, saying so, and the process runs on unchanged. Once, criuz
/// stopped taking CRIU's pipes at the failure while one still waited in
/// the connection: CRIU blocked writing into it, and the dump hung (3 to
/// 6 of 8 such dumps by hand, at these sizes). And a disk that filled only
/// once every image was in was reported as "cancelled".
#[test]
fn a_disk_that_fills_under_held_shared_memory_ends_the_dump() {
    let Some(_criu) = criu() else { return };
    let _g = serial();
    let tmp = tempfile::tempdir().unwrap();
    // A 256 MiB `mixed` archive is about 79 MiB: these fill mid-way.
    for size in ["34m", "36m", "38m", "40m", "42m", "44m", "46m", "48m"] {
        let mut w = Workload::start(Spec { mib: 256, shared: true, filled_by_child: true, ..Default::default() });
        let before = w.sums();
        let small = tmp.path().join(format!("small-{size}"));
        std::fs::create_dir(&small).unwrap();
        let mount =
            run(Command::new("mount").args(["-t", "tmpfs", "-o", &format!("size={size}"), "tmpfs"]).arg(&small));
        assert!(mount.status.success(), "mount a small tmpfs: {}", String::from_utf8_lossy(&mount.stderr));
        let arc = small.join("a.czr");
        let mut child = Command::new(CRIUZ)
            .args(["dump", "-t", &w.pid.to_string(), "-o", arc.to_str().unwrap()])
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let mut waited = Duration::ZERO;
        let status = loop {
            if let Some(status) = child.try_wait().unwrap() {
                break Some(status);
            }
            if waited > Duration::from_secs(30) {
                let _ = child.kill();
                let _ = child.wait();
                break None;
            }
            std::thread::sleep(Duration::from_millis(50));
            waited += Duration::from_millis(50);
        };
        let mut err = String::new();
        std::io::Read::read_to_string(child.stderr.as_mut().unwrap(), &mut err).unwrap();
        let _ = Command::new("umount").arg(&small).status();
        let status = status.unwrap_or_else(|| panic!("{size}: the dump hung: {err}"));
        assert_eq!(status.code(), Some(1), "{size}: {err}");
        assert!(err.contains("No space left on device"), "{size}: the cause is not named: {err}");
        assert_eq!(w.sums(), before, "{size}: the process must run on unchanged");
        w.stop();
    }
}

/// Shared memory (a memfd, as CRIU 4.2 dumps anonymous shared memory) is
/// placed by criuz in the held tree, on every core, not read by CRIU
/// through its one stream (1.2-1.6x `criu restore -D`'s time, session 65):
/// every process that maps it sees the same bytes, its zero pages stay
/// holes (CRIU's restore allocated them), and a damaged block of it stops
/// the restore before the tree runs.
#[test]
fn shared_memory_is_placed_with_its_zero_pages_left_as_holes() {
    let Some(_criu) = criu() else { return };
    let _g = serial();
    let tmp = tempfile::tempdir().unwrap();
    let arc = tmp.path().join("a.czr");
    // Three processes mapping 64 MiB of `mixed` (half of it zero pages).
    let mib = 64;
    let mut w = Workload::start(Spec { mib, shared: true, mode: "tree", children: 2, ..Default::default() });
    let before = w.sums();
    dump(&w, &arc, &[]);
    w.reap_original();
    // Its processes share a few private pages copy-on-write: placed by
    // default all the same, those copied apart, and the report says so.
    let r = restore(&arc, &[]);
    assert_eq!(r["fill"], "place", "{r}");
    let apart = r["copied_apart_bytes"].as_u64().unwrap_or(0);
    assert!(apart > 0 && apart < 8 << 20, "{r}");
    let data_pages = ((mib as u64) << 20) / 4096 / 2;
    let placed = r["shared_pages"].as_u64().unwrap();
    assert!(placed > data_pages * 9 / 10 && placed < data_pages * 11 / 10, "{r}");
    let status = std::fs::read_to_string(format!("/proc/{}/status", w.pid)).unwrap();
    let shmem_kib: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("RssShmem:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .unwrap();
    assert!(shmem_kib > 0 && shmem_kib < ((mib as u64) << 10) * 6 / 10, "zero pages allocated: {shmem_kib} KiB");
    assert_eq!(w.sums(), before, "restored shared memory differs");
    w.stop();

    let mut w = Workload::start(Spec { mib, shared: true, ..Default::default() });
    let before = w.sums();
    let arc = tmp.path().join("b.czr");
    dump(&w, &arc, &[]);
    w.reap_original();
    let r = restore(&arc, &[]);
    assert_eq!(r["fill"], "place", "placed by default: {r}");
    assert_eq!(w.sums(), before, "restored shared memory differs");
    w.kill_and_reap();
    // One byte of a block of the shared memory's pages image (the largest:
    // the private memory is small).
    flip_a_byte_of_the_largest_pages_image(&arc);
    let out = criuz(&["restore", "-d", "-i", arc.to_str().unwrap()]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(3), "{err}");
    assert!(err.contains("checksum"), "{err}");
    std::thread::sleep(Duration::from_millis(300));
    assert!(!w.alive(), "the tree must not run after an aborted restore");
    w.stop();
}

/// Huge pages (of the default size) reserved for a test, given back when
/// it is dropped.
struct HugePages(u64);

impl HugePages {
    const RESERVED: &str = "/proc/sys/vm/nr_hugepages";

    fn read(file: &str) -> u64 {
        std::fs::read_to_string(file).unwrap().trim().parse().unwrap()
    }

    /// `more` huge pages than the system has.
    fn reserve(more: u64) -> HugePages {
        let had = Self::read(Self::RESERVED);
        std::fs::write(Self::RESERVED, (had + more).to_string()).unwrap();
        let held = HugePages(had);
        let now = Self::read(Self::RESERVED);
        assert!(now >= had + more, "could reserve only {now} huge pages");
        held
    }

    /// Shrinks the pool to `free` free pages (of those not in use).
    fn leave_free(&self, free: u64) {
        let pool = "/sys/kernel/mm/hugepages/hugepages-2048kB";
        let (total, now_free) =
            (Self::read(&format!("{pool}/nr_hugepages")), Self::read(&format!("{pool}/free_hugepages")));
        std::fs::write(Self::RESERVED, (total - now_free + free).to_string()).unwrap();
    }
}

impl Drop for HugePages {
    fn drop(&mut self) {
        let _ = std::fs::write(Self::RESERVED, self.0.to_string());
    }
}

/// Huge-page memory comes from the system's pool (vm.nr_hugepages), which
/// no memory cgroup's limit counts: a process holding 64 MiB of it ran in
/// a group limited to 48 MiB, yet its restore there was refused as needing
/// more than the group had room for. It restores there now. And where the
/// pool has not the pages, the restore is refused before anything runs,
/// naming them: CRIU failed in its restorer, "Can't restore 0x7fea2f800000
/// mapping with 0xfffffffffffffff4".
#[test]
fn huge_page_memory_is_counted_in_the_pool_not_the_memory_cgroup() {
    let Some(_criu) = criu() else { return };
    let _g = serial();
    // Private huge pages, which CRIU restores from the process's pages
    // image; shared ones, which it dumps as a memfd's.
    for huge_shared in [false, true] {
        let reserved = HugePages::reserve(40);
        let group = LimitGroup::new("memory");
        if !group.limit_memory(48 << 20) {
            return eprintln!("SKIP: swap here, and no swap limit for the group");
        }
        let spec = Spec { mib: 8, huge_mib: 64, huge_shared, group: Some(&group), ..Default::default() };
        let mut w = Workload::start(spec);
        let before = w.sums();
        let tmp = tempfile::tempdir().unwrap();
        let arc = tmp.path().join("a.czr");
        // CRIU's dump maps shared huge pages privately, which takes as
        // many free huge pages again: with 8 free, it fails, saying so,
        // and the process runs on.
        let _more = huge_shared.then(|| {
            let out = criuz(&["dump", "-t", &w.pid.to_string(), "-o", arc.to_str().unwrap()]);
            let err = String::from_utf8_lossy(&out.stderr);
            assert_eq!(out.status.code(), Some(1), "{err}");
            assert!(err.contains("raise vm.nr_hugepages by that much"), "{err}");
            assert_eq!(w.sums(), before, "the process runs on");
            HugePages::reserve(40)
        });
        dump(&w, &arc, &[]);
        w.reap_original();
        let in_group = || {
            let mut cmd = Command::new(CRIUZ);
            cmd.args(["restore", "-d", arc.to_str().unwrap()]);
            group.join_on_exec(&mut cmd);
            run(&mut cmd)
        };
        ok(in_group(), &format!("restore in the group (shared: {huge_shared})"));
        assert_eq!(w.sums(), before, "shared: {huge_shared}: the restored memory differs");
        assert_eq!(group.oom_kills(), 0);
        w.kill_and_reap();
        reserved.leave_free(8);
        let out = in_group();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "shared: {huge_shared}: {err}");
        let why = "its tree needs 32 huge pages of 2048 KiB (MAP_HUGETLB memory), and the system has 8 free";
        assert!(err.contains(why), "shared: {huge_shared}: {err}");
        assert!(!w.alive(), "shared: {huge_shared}: nothing restored");
        w.stop();
    }
}

/// A pid file that names an archive (a variable mixed up: `--pidfile
/// $ARCHIVE`) replaced the restore's own archive with a pid once the tree
/// ran, and `criuz runc restore --pid-file` deleted it before runc began:
/// the only copy of the checkpoint, lost. Both are refused first, as is
/// any file that holds more than a pid (an age identity, say).
#[test]
fn a_pid_file_never_replaces_an_archive() {
    let Some(_criu) = criu() else { return };
    let tmp = tempfile::tempdir().unwrap();
    let src = tmp.path().join("src");
    std::fs::create_dir(&src).unwrap();
    std::fs::write(src.join("inventory.img"), b"x").unwrap();
    let arc = tmp.path().join("a.czr");
    ok(criuz(&["pack", src.to_str().unwrap(), "-o", arc.to_str().unwrap()]), "pack");
    let a = arc.to_str().unwrap();
    for args in [
        vec!["restore", "-d", a, "--pidfile", a],
        vec!["runc", "restore", "--input", a, "--pid-file", a, "--bundle", src.to_str().unwrap(), "c"],
    ] {
        let out = criuz(&args);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
        assert!(err.contains("holds a criuz archive, which the pid would replace"), "{args:?}: {err}");
        ok(criuz(&["verify", a]), "the archive is intact");
    }
    let key = tmp.path().join("key.txt");
    std::fs::write(&key, "AGE-SECRET-KEY-1X\n").unwrap();
    let out = criuz(&["restore", "-d", a, "--pidfile", key.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(2), "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(std::fs::read_to_string(&key).unwrap(), "AGE-SECRET-KEY-1X\n");
}

/// An archive is binary: `-o -` on a terminal is refused before CRIU runs
/// (the dump would end its process with the archive scrolled past on the
/// screen), and `-i -` on a terminal is refused, not waited on.
#[test]
fn archives_are_neither_written_to_nor_read_from_a_terminal() {
    let Some(_criu) = criu() else { return };
    let _g = serial();
    let mut w = Workload::start(Spec::default());
    let before = w.sums();
    for (cmd, says) in [
        (format!("{CRIUZ} dump -t {} -o -", w.pid), "-: standard output is a terminal"),
        (format!("{CRIUZ} restore -i -"), "-: standard input is a terminal"),
        (format!("{CRIUZ} verify -"), "-: standard input is a terminal"),
    ] {
        // script(1) runs the command on a terminal of its own and exits as
        // it does; what the command wrote there comes out on its stdout.
        let out = Command::new("script").args(["-qec", &cmd, "/dev/null"]).stdin(Stdio::null()).output().unwrap();
        let said = String::from_utf8_lossy(&out.stdout);
        assert_eq!(out.status.code(), Some(2), "{cmd}: {said}");
        assert!(said.contains(says), "{cmd}: {said}");
    }
    assert_eq!(w.sums(), before, "the process must run on, untouched");
    w.stop();
}

/// A process on a terminal round-trips as a shell job: dumped with
/// `--shell-job`, restored with `--shell-job` on a terminal (script(1)'s),
/// in the foreground and then detached, where CRIU gets criuz's standard
/// streams for the tree to take; the process answers with its own
/// checksum, unchanged.
#[test]
fn a_shell_job_restored_in_the_foreground_or_detached_takes_the_terminal() {
    let Some(_criu) = criu() else { return };
    let _g = serial();
    let tmp = tempfile::tempdir().unwrap();
    let t = tmp.path().display();
    // The workload writes its checksum to {t}/w/sum-root on SIGUSR1.
    let job = format!(
        r#"{WORKLOAD} --dir {t}/w --mib 8 --pattern mixed &
until [ -s {t}/w/ready ]; do sleep 0.05; done; P=$(cat {t}/w/ready)
sum() {{ rm -f {t}/w/sum-root; kill -USR1 $P || return; for i in $(seq 200); do [ -s {t}/w/sum-root ] && break; sleep 0.05; done; echo "sum $(cut -d' ' -f1 {t}/w/sum-root)"; }}
sum
{CRIUZ} dump -t $P -o {t}/a.czr --shell-job; echo "dump $?"
wait $P
while [ -e /proc/$P ]; do sleep 0.05; done
{CRIUZ} restore -i {t}/a.czr --shell-job --pidfile {t}/pid </dev/tty &
R=$!
until [ -s {t}/pid ] || ! kill -0 $R 2>/dev/null; do sleep 0.05; done
sum
kill $P 2>/dev/null; wait $R; echo "restore $?"
while [ -e /proc/$P ]; do sleep 0.05; done
{CRIUZ} restore -d -i {t}/a.czr --shell-job </dev/tty; echo "detached $?"
sum
case "$(readlink /proc/$P/fd/1)" in /dev/tty|/dev/pts/*) echo "on the terminal";; esac
kill $P
"#
    );
    let file = tmp.path().join("job.sh");
    std::fs::write(&file, job).unwrap();
    let cmd = format!("bash {}", file.display());
    let out = Command::new("script").args(["-qec", &cmd, "/dev/null"]).stdin(Stdio::null()).output().unwrap();
    let said = String::from_utf8_lossy(&out.stdout).replace('\r', "");
    let sums: Vec<&str> = said.lines().filter(|l| l.starts_with("sum sum=")).collect();
    assert_eq!(sums.len(), 3, "a checksum before and after each restore: {said}");
    assert!(sums[0] == sums[1] && sums[0] == sums[2], "the restored process's memory differs: {said}");
    assert!(said.lines().any(|l| l == "dump 0"), "{said}");
    // The workload ends on SIGTERM with status 0; criuz exits as it did.
    assert!(said.lines().any(|l| l == "restore 0"), "{said}");
    // Detached, CRIU was given no terminal: "Don't have tty to inherit
    // session from".
    assert!(said.lines().any(|l| l == "detached 0") && said.contains("on the terminal"), "{said}");
}

/// `-- --inherit-fd` on a detached restore: the tree takes what criuz was
/// given, here a pipe as standard output in place of the /dev/null the
/// workload had. Detached, CRIU was given its own output file instead, and
/// the tree wrote into that (deleted) file.
#[test]
fn a_detached_restore_hands_the_tree_what_inherit_fd_names() {
    let Some(_criu) = criu() else { return };
    let _g = serial();
    let mut w = Workload::start(Spec { mib: 8, ..Default::default() });
    let before = w.sums();
    let tmp = tempfile::tempdir().unwrap();
    let arc = tmp.path().join("x.czr");
    ok(criuz(&["dump", "-t", &w.pid.to_string(), "-o", arc.to_str().unwrap()]), "dump");
    w.reap_original();
    restore_onto_a_new_pipe(&mut w, &arc, "fd[1]:dev/null", &before);
    w.stop();
}

/// Restores `arc` detached with `-- --inherit-fd KEY`, criuz's standard
/// output a new pipe, and checks that the restored process has the memory
/// it had (`before`) and that pipe as its standard output.
fn restore_onto_a_new_pipe(
    w: &mut Workload,
    arc: &Path,
    key: &str,
    before: &std::collections::BTreeMap<String, String>,
) {
    let (read, write) = criuz::io::pipe().unwrap();
    let ours = fd_link(&write);
    let out = run(Command::new(CRIUZ)
        .args(["restore", "-d", arc.to_str().unwrap(), "--", "--inherit-fd", key])
        .stdout(Stdio::from(write)));
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(&w.sums(), before, "restored memory differs");
    let theirs = std::fs::read_link(format!("/proc/{}/fd/1", w.pid)).unwrap();
    assert_eq!(theirs, ours, "the restored tree's standard output is not the pipe given to criuz");
    drop(read);
}

/// What descriptor `fd` of this process names (`pipe:[N]`).
fn fd_link(fd: &std::os::fd::OwnedFd) -> PathBuf {
    std::fs::read_link(format!("/proc/self/fd/{}", std::os::fd::AsRawFd::as_raw_fd(fd))).unwrap()
}

/// A process writing to a pipe that a process outside its tree reads
/// (`app | logger`): CRIU dumps it, and restored it finds nobody reading.
/// The dump says so and how to hand the restore a pipe of one's own; the
/// restore done that way writes to the pipe given.
#[test]
fn a_pipe_to_outside_the_tree_is_told_and_can_be_handed_over() {
    let Some(_criu) = criu() else { return };
    let _g = serial();
    let (read, write) = criuz::io::pipe().unwrap();
    let mut w = Workload::start(Spec { mib: 8, stdout: Some(&write), ..Default::default() });
    drop(write);
    let before = w.sums();
    let tmp = tempfile::tempdir().unwrap();
    let arc = tmp.path().join("x.czr");
    let out = ok(criuz(&["dump", "-t", &w.pid.to_string(), "-o", arc.to_str().unwrap()]), "dump");
    w.reap_original();
    let said = String::from_utf8_lossy(&out.stderr);
    let key = format!("fd[1]:{}", fd_link(&read).display());
    let warned = format!(
        "warning: process {} (criuz-workload) writes to a pipe (its fd 1) that process {}",
        w.pid,
        std::process::id()
    );
    assert!(said.contains(&warned) && said.contains(&format!("--inherit-fd '{key}'")), "{said}");
    drop(read);
    restore_onto_a_new_pipe(&mut w, &arc, &key, &before);
    w.stop();
}

/// What criuz may inherit from whoever starts it: a standard error nobody
/// reads (a supervisor's log pipe closed), and SIGCHLD ignored (the kernel
/// then reaps criuz's children itself). A dump and a restore do their work
/// either way and say how it went in their exit status. Before, the first
/// failed at its first message (exit 1, no checkpoint), and the second
/// failed "No child processes" with its tree left stopped for good.
#[test]
fn an_odd_inheritance_stops_neither_a_dump_nor_a_restore() {
    let Some(_criu) = criu() else { return };
    let _g = serial();
    let mut w = Workload::start(Spec { mib: 16, ..Default::default() });
    let before = w.sums();
    let tmp = tempfile::tempdir().unwrap();
    let arc = tmp.path().join("x.czr");
    let unread = || {
        let (read, write) = criuz::io::pipe().unwrap();
        drop(read);
        Stdio::from(write)
    };
    for sigchld_ignored in [false, true] {
        let run = |args: &[&str]| {
            let mut cmd = Command::new(CRIUZ);
            cmd.args(args).stdout(Stdio::null());
            if sigchld_ignored {
                // SAFETY: signal() only, between fork and exec.
                unsafe {
                    std::os::unix::process::CommandExt::pre_exec(&mut cmd, || {
                        libc::signal(libc::SIGCHLD, libc::SIG_IGN);
                        Ok(())
                    })
                };
            } else {
                cmd.stderr(unread());
            }
            cmd.status().unwrap()
        };
        let dumped = run(&["dump", "-t", &w.pid.to_string(), "-o", arc.to_str().unwrap(), "--force"]);
        assert!(dumped.success(), "dump (SIGCHLD ignored: {sigchld_ignored}): {dumped}");
        w.reap_original();
        let restored = run(&["restore", "-d", arc.to_str().unwrap()]);
        assert!(restored.success(), "restore (SIGCHLD ignored: {sigchld_ignored}): {restored}");
        assert_eq!(w.sums(), before);
        // And an error still gets its exit status.
        assert_eq!(run(&["verify", tmp.path().join("none.czr").to_str().unwrap()]).code(), Some(2));
    }
    w.stop();
}

/// `-t` naming a thread (CRIU aborts on an assertion), a zombie or criuz's
/// own shell is refused before CRIU runs, naming what to give instead.
#[test]
fn a_dump_of_a_thread_or_a_zombie_is_refused_by_name() {
    let Some(_criu) = criu() else { return };
    let _g = serial();
    let mut w = Workload::start(Spec { mib: 8, mode: "threads", ..Default::default() });
    let before = w.sums();
    let tmp = tempfile::tempdir().unwrap();
    let arc = tmp.path().join("x.czr");
    let thread = std::fs::read_dir(format!("/proc/{}/task", w.pid))
        .unwrap()
        .filter_map(|e| e.unwrap().file_name().to_str()?.parse::<i32>().ok())
        .find(|&t| t != w.pid)
        .expect("the workload runs threads");
    let out = criuz(&["dump", "-t", &thread.to_string(), "-o", arc.to_str().unwrap()]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains(&format!("{thread} is a thread of process {0}: dump the process (-t {0})", w.pid)), "{err}");
    assert_eq!(w.sums(), before, "the process must run on, untouched");
    // A thread another process traces (as strace -p would): CRIU failed
    // on it with "Unable to interrupt task". The tracer here is a thread of
    // this test; its trace ends when it exits. (No signal may reach the
    // workload meanwhile: the traced thread would stop for its tracer.)
    let (release, released) = std::sync::mpsc::channel::<()>();
    let (seized_tx, seized) = std::sync::mpsc::channel();
    let tracer = std::thread::spawn(move || {
        // SAFETY: PTRACE_SEIZE of our own workload's thread; it is not stopped.
        let r = unsafe { libc::ptrace(libc::PTRACE_SEIZE, thread, 0, 0) };
        seized_tx.send(r).unwrap();
        let _ = released.recv();
    });
    assert_eq!(seized.recv().unwrap(), 0, "PTRACE_SEIZE: {}", std::io::Error::last_os_error());
    let out = criuz(&["dump", "-t", &w.pid.to_string(), "-o", arc.to_str().unwrap()]);
    release.send(()).unwrap();
    tracer.join().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains(&format!("process {thread} is traced by process")) && err.contains("detach the tracer"),
        "{err}"
    );
    assert!(!arc.exists());
    assert_eq!(w.sums(), before, "the traced process must run on, untouched");
    w.stop();
    // A child that exited and is not reaped yet.
    let mut child = Command::new("true").spawn().unwrap();
    let pid = child.id() as i32;
    while !std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap().contains(") Z") {
        std::thread::sleep(Duration::from_millis(5));
    }
    let out = criuz(&["dump", "-t", &pid.to_string(), "-o", arc.to_str().unwrap()]);
    let err = String::from_utf8_lossy(&out.stderr);
    child.wait().unwrap();
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains(&format!("process {pid} has exited")), "{err}");
    assert!(!arc.exists());
    // The shell criuz runs in (`-t $$`): its tree holds criuz and CRIU,
    // and CRIU's refusal read as a tracing failure ("another process
    // traces it"). The `; exit` keeps sh from exec-ing criuz.
    let out =
        Command::new("sh").args(["-c", &format!("{CRIUZ} dump -t $$ -o {}; exit $?", arc.display())]).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains("is criuz or an ancestor of it") && !err.contains("CRIU could not trace"), "{err}");
    assert!(!arc.exists());
}

/// Two dumps of one tree at once both failed (each saw the tree resumed by
/// the other). The second is now refused while the first holds its claim,
/// and the first completes.
#[test]
fn a_second_dump_of_a_tree_being_dumped_is_refused_and_the_first_completes() {
    let Some(_criu) = criu() else { return };
    let _g = serial();
    let mut w = Workload::start(Spec::default());
    let before = w.sums();
    let tmp = tempfile::tempdir().unwrap();
    // The first dump writes to a pipe nobody reads yet: it holds its claim.
    let mut first = Command::new(CRIUZ)
        .args(["dump", "-t", &w.pid.to_string(), "-o", "-"])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let claim = std::path::PathBuf::from(format!("/run/criuz/dump-{}.lock", w.pid));
    let t = Instant::now();
    while !claim.exists() {
        assert!(t.elapsed() < Duration::from_secs(30), "the first dump never claimed the tree");
        std::thread::sleep(Duration::from_millis(5));
    }
    let second = tmp.path().join("second.czr");
    let out = criuz(&["dump", "-t", &w.pid.to_string(), "-o", second.to_str().unwrap()]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    let by = format!("process {} is being checkpointed by another criuz (criuz pid {})", w.pid, first.id());
    assert!(err.contains(&by), "{err}");
    assert!(!second.exists());
    let arc = tmp.path().join("first.czr");
    std::io::copy(&mut first.stdout.take().unwrap(), &mut std::fs::File::create(&arc).unwrap()).unwrap();
    let done = first.wait_with_output().unwrap();
    assert!(done.status.success(), "{}", String::from_utf8_lossy(&done.stderr));
    assert!(!claim.exists(), "the claim goes with its dump");
    w.reap_original();
    restore(&arc, &[]);
    assert_eq!(w.sums(), before, "restored memory differs");
    w.stop();
}

/// CRIU's refusals that one of its options answers come with that option
/// (file locks, a deleted file larger than CRIU keeps, a unix socket whose
/// peer is outside the tree), and the process runs on each time.
#[test]
fn criu_refusals_name_the_option_that_answers_them() {
    use std::io::BufRead;
    let Some(_criu) = criu() else { return };
    let _g = serial();
    let tmp = tempfile::tempdir().unwrap();
    let t = tmp.path().display().to_string();
    let sock = tmp.path().join("peer.sock");
    // The peer end, accepted outside the tree and held.
    let listener = std::os::unix::net::UnixListener::bind(&sock).unwrap();
    std::thread::spawn(move || {
        let mut held = Vec::new();
        for conn in listener.incoming() {
            held.push(conn);
        }
    });
    let arc = tmp.path().join("x.czr");
    for (setup, says) in [
        (format!("import fcntl; f = open('{t}/locked', 'w'); fcntl.flock(f, fcntl.LOCK_EX)"), "-- --file-locks"),
        (
            format!("import os; f = open('{t}/ghost', 'wb'); f.write(os.urandom(3 << 20)); f.flush(); os.unlink('{t}/ghost')"),
            "-- --ghost-limit",
        ),
        (
            format!("import socket; s = socket.socket(socket.AF_UNIX); s.connect('{}')", sock.display()),
            "-- --ext-unix-sk",
        ),
    ] {
        // A session leader of its own (setsid), as CRIU wants a tree's root.
        let script = format!("{setup}; print('ready', flush=True); import time; time.sleep(120)");
        let mut p = Command::new("setsid")
            .args(["python3", "-c", &script])
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let mut ready = String::new();
        std::io::BufReader::new(p.stdout.take().unwrap()).read_line(&mut ready).unwrap();
        assert_eq!(ready.trim(), "ready", "{setup}");
        let pid = p.id().to_string();
        let out = criuz(&["dump", "-t", &pid, "-o", arc.to_str().unwrap()]);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{setup}: {err}");
        assert!(err.contains(says), "{setup}: {err}");
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
        let state = stat.rsplit_once(')').unwrap().1.trim_start().chars().next();
        assert!(matches!(state, Some('S' | 'R')), "{setup}: the process must run on: {stat}");
        assert!(!arc.exists());
        p.kill().unwrap();
        p.wait().unwrap();
    }
}

/// A packed directory that is not a checkpoint is refused by every restore
/// path with one line saying so, before CRIU runs.
#[test]
fn an_archive_that_holds_no_process_tree_is_refused_by_every_restore() {
    let Some(_criu) = criu() else { return };
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("notes");
    std::fs::create_dir(&dir).unwrap();
    std::fs::write(dir.join("readme.txt"), "not a checkpoint\n").unwrap();
    let arc = tmp.path().join("notes.czr");
    ok(criuz(&["pack", dir.to_str().unwrap(), "-o", arc.to_str().unwrap()]), "criuz pack");
    let a = arc.to_str().unwrap();
    for how in [&[][..], &["--fill", "stream"], &["--fill", "place"], &["--lazy"]] {
        let mut args = vec!["restore", "-d", "-i", a];
        args.extend_from_slice(how);
        let out = criuz(&args);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{how:?}: {err}");
        assert!(err.contains(&format!("{a}: not a process checkpoint (it holds no pstree.img)")), "{how:?}: {err}");
    }
}

/// A dump whose absorb budget runs out while CRIU writes: the blocks taken
/// meanwhile are hurried (LZ4), CRIU is not held back by zstd, and the
/// archive is rewritten with zstd once the process is done with; it restores
/// intact.
#[test]
fn a_dump_beyond_its_absorb_budget_hurries_then_recompresses() {
    let Some(_criu) = criu() else { return };
    let _g = serial();
    let mut w = Workload::start(Spec { pattern: "text", mib: 160, ..Default::default() });
    let before = w.sums();
    let tmp = tempfile::tempdir().unwrap();
    let arc = tmp.path().join("hurried.czr");
    let r = dump(&w, &arc, &["--codec", "zstd", "--absorb", "80M"]);
    assert!(r["hurried_blocks"].as_u64().unwrap() > 0, "the budget never ran out: {r}");
    assert_eq!(r["recompressed"], true, "{r}");
    assert_eq!(std::fs::metadata(&arc).unwrap().len(), r["archive_bytes"].as_u64().unwrap());
    let out = ok(criuz(&["inspect", "--json", arc.to_str().unwrap()]), "criuz inspect");
    let rep: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(rep["total"]["blocks_lz4"], 0, "hurried blocks left after the rewrite: {}", rep["total"]);
    assert!(rep["total"]["blocks_zstd"].as_u64().unwrap() > 0);
    w.reap_original();
    restore(&arc, &[]);
    assert_eq!(w.sums(), before, "restored memory differs");
    // Encrypted: the blocks kept as they were are sealed again for the
    // rewritten archive (its own key), and it restores intact.
    let key = tmp.path().join("key");
    let public = ok(criuz(&["keygen", "-o", key.to_str().unwrap()]), "criuz keygen");
    let public = String::from_utf8_lossy(&public.stdout).trim().to_string();
    let sealed = tmp.path().join("sealed.czr");
    let r = dump(&w, &sealed, &["--codec", "zstd", "--absorb", "80M", "--recipient", &public]);
    assert!(r["hurried_blocks"].as_u64().unwrap() > 0 && r["recompressed"] == true, "{r}");
    w.reap_original();
    restore(&sealed, &["--identity", key.to_str().unwrap()]);
    assert_eq!(w.sums(), before, "restored memory of the sealed rewrite differs");
    w.stop();
}

/// criuz killed after CRIU left the process stopped (its archive still
/// compressing) must not leave the process stopped for good: the dump's
/// guard resumes it, with its memory as it was, and no archive appears.
#[test]
fn a_dump_whose_criuz_is_killed_resumes_the_process() {
    let Some(_criu) = criu() else { return };
    let _g = serial();
    let mut w = Workload::start(Spec { pattern: "text", mib: 48, ..Default::default() });
    let before = w.sums();
    let tmp = tempfile::tempdir().unwrap();
    let arc = tmp.path().join("killed.czr");
    let pid = w.pid.to_string();
    // zstd at its slowest: the archive is far from written when CRIU is done.
    let mut dump = Command::new(CRIUZ)
        .args(["dump", "-t", &pid, "-o", arc.to_str().unwrap(), "--codec", "zstd", "--level", "19"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    wait_for("CRIU to leave the process stopped", Duration::from_secs(60), || process_state(w.pid) == Some('T'));
    dump.kill().unwrap();
    dump.wait().unwrap();
    wait_for("the guard to resume the process", Duration::from_secs(10), || {
        process_state(w.pid).is_some_and(|s| s != 'T')
    });
    assert!(!arc.exists(), "an archive appeared under its final name");
    assert!(w.alive(), "the process must run on");
    assert_eq!(w.sums(), before, "the resumed process's memory changed");
    w.stop();
}

/// CRIU finishes into the absorb budget before the archive is written; an
/// archive that then cannot be written (here: a full file system) must not
/// take the process with it: CRIU left it stopped, and criuz resumes it.
#[test]
fn a_dump_that_fails_after_criu_resumes_the_process() {
    let Some(_criu) = criu() else { return };
    let _g = serial();
    let mut w = Workload::start(Spec { pattern: "mixed", ..Default::default() });
    let before = w.sums();
    let tmp = tempfile::tempdir().unwrap();
    let small = small_fs(tmp.path());
    let arc = small.join("big.czr");
    // zstd at its slowest: CRIU is done long before 4 MiB are compressed.
    let pid = w.pid.to_string();
    let out = criuz(&["dump", "-t", &pid, "-o", arc.to_str().unwrap(), "--codec", "zstd", "--level", "19"]);
    let left = std::fs::read_dir(&small).unwrap().count();
    let _ = Command::new("umount").arg(&small).status();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("resumed"), "CRIU should have finished first: {err}");
    assert_eq!(left, 0, "nothing may be left in the output's directory");
    assert!(w.alive(), "the process must run on: {err}");
    assert_eq!(w.sums(), before, "the resumed process's memory changed");
    w.stop();
}

/// A process stopped when dumped (a job a shell stopped, one paused with
/// SIGSTOP) stays stopped, as with CRIU alone: after a dump that failed
/// (criuz resumes the tree CRIU left stopped, but not it), and after every
/// kind of restore (placed and lazy trees are held stopped by CRIU, then
/// let run by criuz; it must not be among them). Continued, its memory is
/// its own.
#[test]
fn a_process_dumped_stopped_stays_stopped() {
    let Some(_criu) = criu() else { return };
    let _g = serial();
    let tmp = tempfile::tempdir().unwrap();
    let small = small_fs(tmp.path());
    let stop = |pid: i32| {
        // SAFETY: the workload of this test.
        unsafe { libc::kill(pid, libc::SIGSTOP) };
        wait_for("the workload to stop", Duration::from_secs(10), || process_state(pid) == Some('T'));
    };
    let mut w = Workload::start(Spec { pattern: "mixed", ..Default::default() });
    let before = w.sums();
    stop(w.pid);
    let pid = w.pid.to_string();
    let full = small.join("big.czr");
    let out = criuz(&["dump", "-t", &pid, "-o", full.to_str().unwrap(), "--codec", "zstd", "--level", "19"]);
    let _ = Command::new("umount").arg(&small).status();
    assert_eq!(out.status.code(), Some(1), "{}", String::from_utf8_lossy(&out.stderr));
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(process_state(w.pid), Some('T'), "a failed dump continued a process stopped before it");
    let arc = tmp.path().join("stopped.czr");
    dump(&w, &arc, &[]);
    w.reap_original();
    for how in [&["--fill", "place"][..], &["--lazy"], &["--fill", "stream"]] {
        restore(&arc, how);
        std::thread::sleep(Duration::from_millis(300));
        assert_eq!(process_state(w.pid), Some('T'), "{how:?}: restored running, dumped stopped");
        // SAFETY: as above.
        unsafe { libc::kill(w.pid, libc::SIGCONT) };
        assert_eq!(w.sums(), before, "{how:?}: the restored memory differs");
        stop(w.pid);
        // SAFETY: as above; its parent (this test, the subreaper) reaps it.
        unsafe { libc::kill(w.pid, libc::SIGKILL) };
        wait_for("the restored workload's end", Duration::from_secs(10), || {
            // SAFETY: non-blocking reaps of our own children.
            while unsafe { libc::waitpid(-1, std::ptr::null_mut(), libc::WNOHANG) } > 0 {}
            process_state(w.pid).is_none()
        });
    }
}

/// A dump takes its absorb memory from the machine's share, which every
/// criuz on the machine draws on (`/run/criuz`, grants held by `flock`):
/// alone it gets about what the tree holds; while another criuz holds the
/// whole share it compresses as CRIU writes, within the pipeline's own
/// memory, and the archive restores intact.
#[test]
fn a_dump_takes_its_absorb_memory_from_the_machine_share() {
    use std::os::fd::AsRawFd;
    let Some(_criu) = criu() else { return };
    let _g = serial();
    let mut w = Workload::start(Spec { pattern: "mixed", mib: 96, ..Default::default() });
    let before = w.sums();
    let tmp = tempfile::tempdir().unwrap();
    let pipeline = 64u64 << 20;
    let alone = dump(&w, &tmp.path().join("alone.czr"), &["--leave-running"]);
    let granted = alone["absorb_budget"].as_u64().unwrap();
    assert!(granted > pipeline + (48 << 20) && granted < pipeline + (1 << 30), "{alone}");

    // Another criuz holding the whole share (a grant file it keeps locked).
    std::fs::create_dir_all("/run/criuz").unwrap();
    let other = std::path::Path::new("/run/criuz").join(format!("grant-test-{}", std::process::id()));
    std::fs::write(&other, format!("{}", u64::MAX / 4)).unwrap();
    let held = std::fs::File::open(&other).unwrap();
    // SAFETY: flock on a descriptor we own.
    assert_eq!(unsafe { libc::flock(held.as_raw_fd(), libc::LOCK_EX) }, 0);
    let arc = tmp.path().join("squeezed.czr");
    let squeezed = dump(&w, &arc, &[]);
    drop(held);
    let _ = std::fs::remove_file(&other);
    assert_eq!(squeezed["absorb_budget"].as_u64(), Some(pipeline), "{squeezed}");
    w.reap_original();
    restore(&arc, &[]);
    assert_eq!(w.sums(), before, "restored memory differs");
    w.stop();
}

/// A dump holds the stopped tree's own pages by reference until its
/// archive is written (src/archive/held.rs), so the tree must not run
/// before then. Resumed meanwhile by someone else (here a SIGCONT, then a
/// rewrite of its memory), the dump must fail and publish nothing: its held
/// pages may no longer be what CRIU dumped.
#[test]
fn a_tree_resumed_while_its_archive_is_written_gets_no_checkpoint() {
    let Some(_criu) = criu() else { return };
    let _g = serial();
    let mut w = Workload::start(Spec { pattern: "text", mib: 48, ..Default::default() });
    w.sums();
    let tmp = tempfile::tempdir().unwrap();
    let arc = tmp.path().join("resumed.czr");
    let pid = w.pid.to_string();
    // zstd at its slowest: the archive is far from written when CRIU is done.
    let dump = Command::new(CRIUZ)
        .args(["dump", "-t", &pid, "-o", arc.to_str().unwrap(), "--codec", "zstd", "--level", "19"])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    wait_for("CRIU to leave the process stopped", Duration::from_secs(60), || {
        process_state(w.pid) == Some('T') && criu_children_of(dump.id()).is_empty()
    });
    // criuz takes the tree's CPU times once CRIU is gone (a few ms); resumed
    // before that, the dump fails too, with "did not stay stopped".
    std::thread::sleep(Duration::from_millis(500));
    // SAFETY: resuming the workload this test started.
    unsafe { libc::kill(w.pid, libc::SIGCONT) };
    w.rewrite(50.0, 7);
    let out = dump.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "the dump must fail: {err}");
    assert!(err.contains("ran while its checkpoint was written"), "{err}");
    assert!(!arc.exists(), "an archive appeared under its final name");
    assert!(temp_archive(&arc).is_none(), "the temporary archive must be removed");
    assert!(w.alive(), "the process must run on");
    w.stop();
}

/// A dump short of descriptors holds what blocks it can by reference and
/// copies the rest (a pipe per held block; src/archive/held.rs), and the
/// archive restores intact.
#[test]
fn a_dump_short_of_descriptors_copies_what_it_cannot_hold() {
    use std::os::unix::process::CommandExt;
    let Some(_criu) = criu() else { return };
    let _g = serial();
    let mut w = Workload::start(Spec { pattern: "mixed", mib: 96, ..Default::default() });
    let before = w.sums();
    let tmp = tempfile::tempdir().unwrap();
    let arc = tmp.path().join("few-fds.czr");
    let mut cmd = Command::new(CRIUZ);
    // A slow codec, so that CRIU writes far ahead of the worker that
    // compresses while it writes: with LZ4 that worker kept pace, gave
    // each held block's descriptor back soon after, and a dump held 358
    // blocks in all at 128 descriptors (a CI run, session 79).
    let pid = w.pid.to_string();
    cmd.args(["dump", "--json", "--codec", "zstd", "--level", "15", "-t", &pid, "-o", arc.to_str().unwrap()]);
    // 128 descriptors, no more to raise to: 96 of them for held blocks, so
    // at most 95 held at once (one descriptor each, two while one fills),
    // of the 384 this memory makes.
    // SAFETY: setrlimit only, between fork and exec.
    unsafe {
        cmd.pre_exec(|| {
            let few = libc::rlimit { rlim_cur: 128, rlim_max: 128 };
            if libc::setrlimit(libc::RLIMIT_NOFILE, &few) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let out = ok(run(&mut cmd), "criuz dump with 128 descriptors");
    let r: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let held = r["held_blocks"].as_u64().unwrap();
    assert!(held > 0 && held < 300, "{held} of the 384 blocks of pages held: {r}");
    w.reap_original();
    restore(&arc, &[]);
    assert_eq!(w.sums(), before, "restored memory differs");
    w.stop();
}

/// A Ctrl-C (or SIGTERM) ends criuz cleanly: while CRIU streams and after
/// CRIU left the tree stopped, the interrupted dump removes its temporary
/// archive and its work directory, dies by the signal it got, and the
/// process runs on with its memory as it was.
#[test]
fn an_interrupted_dump_leaves_nothing_behind_and_the_process_running() {
    use std::os::unix::process::ExitStatusExt;
    let Some(_criu) = criu() else { return };
    let _g = serial();
    let mut w = Workload::start(Spec { pattern: "text", mib: 64, ..Default::default() });
    let before = w.sums();
    let out_dir = tempfile::tempdir().unwrap();
    let work_base = tempfile::tempdir().unwrap();
    let arc = out_dir.path().join("interrupted.czr");
    let pid = w.pid.to_string();
    // zstd at its slowest, so that both moments are long enough to hit.
    let slow = ["-j", "1", "--codec", "zstd", "--level", "19"];
    for (signal, absorb, under_way) in [(libc::SIGINT, "0", "CRIU streaming"), (libc::SIGTERM, "1G", "CRIU done")] {
        let mut dump = takes_sigint(&mut Command::new(CRIUZ))
            .args(["dump", "-t", &pid, "-o", arc.to_str().unwrap(), "--absorb", absorb])
            .args(slow)
            .env("TMPDIR", work_base.path())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        wait_for(under_way, Duration::from_secs(60), || match under_way {
            "CRIU streaming" => {
                temp_archive(&arc).and_then(|p| std::fs::metadata(p).ok()).is_some_and(|m| m.len() > 1 << 20)
                    && !criu_children_of(dump.id()).is_empty()
            }
            _ => process_state(w.pid) == Some('T') && criu_children_of(dump.id()).is_empty(),
        });
        // SAFETY: signalling the criuz this test started.
        unsafe { libc::kill(dump.id() as i32, signal) };
        let mut err = String::new();
        std::io::Read::read_to_string(dump.stderr.as_mut().unwrap(), &mut err).unwrap();
        let status = dump.wait().unwrap();
        assert_eq!(status.signal(), Some(signal), "criuz must die by the signal it got ({under_way}): {err}");
        assert!(err.contains("interrupted") && err.contains("removed"), "{under_way}: {err}");
        let left: Vec<_> = std::fs::read_dir(out_dir.path()).unwrap().flatten().map(|e| e.file_name()).collect();
        assert!(left.is_empty(), "{under_way}: left beside the archive: {left:?}");
        let left: Vec<_> = std::fs::read_dir(work_base.path())
            .unwrap()
            .flatten()
            .map(|e| e.file_name())
            .filter(|n| !n.to_string_lossy().starts_with("criuz-logs"))
            .collect();
        assert!(left.is_empty(), "{under_way}: left in TMPDIR: {left:?}");
        wait_for("the process to run again", Duration::from_secs(30), || {
            // SAFETY: reaping zombies re-parented to us (CRIU, the guard).
            while unsafe { libc::waitpid(-1, std::ptr::null_mut(), libc::WNOHANG) } > 0 {}
            process_state(w.pid).is_some_and(|s| s != 'T')
        });
        assert!(w.alive(), "{under_way}: the process must run on");
        assert_eq!(w.sums(), before, "{under_way}: the process's memory changed");
    }
    w.stop();
}

/// The children of `pid` that are zombies.
fn zombie_children_of(pid: u32) -> Vec<i32> {
    let mut out = children_of(pid);
    out.retain(|&p| process_state(p) == Some('Z'));
    out
}

/// How often the thread `pid` of a process has given up its core.
fn voluntary_switches(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/task/{pid}/status")).unwrap();
    let line = status.lines().find(|l| l.starts_with("voluntary_ctxt_switches:")).unwrap();
    line.split_whitespace().nth(1).unwrap().parse().unwrap()
}

/// Dumps `w` into DIR/fg.czr and restores it without -d, `how`, its
/// `--pidfile` DIR/fg.pid (gone before): the waiting criuz, stderr piped,
/// and the pidfile.
fn dump_and_restore_in_the_foreground(w: &mut Workload, dir: &Path, how: &[&str]) -> (std::process::Child, PathBuf) {
    let arc = dir.join("fg.czr");
    let pidfile = dir.join("fg.pid");
    let _ = std::fs::remove_file(&pidfile);
    dump(w, &arc, &["--force"]);
    w.reap_original();
    let restore = Command::new(CRIUZ)
        .args(["restore", "-i", arc.to_str().unwrap(), "--pidfile", pidfile.to_str().unwrap()])
        .args(how)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    (restore, pidfile)
}

/// Without -d, criuz waits for the restored tree as its parent (a
/// container's entrypoint, a service's main process): it exits as the
/// tree's root does (its status, or 128 + the signal that killed it) and
/// passes the signals it is sent on to the root. While it waits it neither
/// collects what the tree orphans as zombies of its own nor wakes up.
#[test]
fn a_restore_waited_for_ends_as_the_tree_does_and_passes_signals_on() {
    use std::os::unix::process::ExitStatusExt;
    let Some(_criu) = criu() else { return };
    let _g = serial();
    let dir = tempfile::tempdir().unwrap();
    let ends = [
        (&["--fill", "place"][..], "exit 7"),
        (&["--fill", "stream"], "SIGTERM to criuz"),
        (&["--lazy"], "SIGKILL to the root"),
    ];
    for (how, end) in ends {
        let mut w = Workload::start(Spec { pattern: "mixed", mib: 32, ..Default::default() });
        let before = w.sums();
        let (mut restore, pidfile) = dump_and_restore_in_the_foreground(&mut w, dir.path(), how);
        wait_for("the restored tree to run", Duration::from_secs(60), || pidfile.exists());
        assert_eq!(std::fs::read_to_string(&pidfile).unwrap().trim(), w.pid.to_string(), "{how:?}");
        assert!(children_of(restore.id()).contains(&w.pid), "{how:?}: the root must be criuz's own child");
        assert_eq!(w.sums(), before, "{how:?}: the restored memory differs");
        std::fs::write(w.dir.path().join("rewrite"), "orphans 20").unwrap();
        // SAFETY: signalling the restored workload of this test.
        unsafe { libc::kill(w.pid, libc::SIGUSR2) };
        let orphaned = w.dir.path().join("orphaned-root");
        wait_for("the tree's orphans", Duration::from_secs(30), || orphaned.exists());
        let switches = voluntary_switches(restore.id());
        std::thread::sleep(Duration::from_secs(2));
        let zombies = zombie_children_of(restore.id());
        assert!(zombies.is_empty(), "{how:?}: criuz holds the tree's orphans as zombies: {zombies:?}");
        let woke = voluntary_switches(restore.id()) - switches;
        assert!(woke < 20, "{how:?}: criuz woke {woke} times in 2 s while the tree ran");
        // It waits as a fresh image: none of the restore's heap (tens of
        // MiB of its worker threads' arenas) stays with it.
        let status = std::fs::read_to_string(format!("/proc/{}/status", restore.id())).unwrap();
        let anon_kb: u64 = status
            .lines()
            .find_map(|l| l.strip_prefix("RssAnon:"))
            .and_then(|v| v.split_whitespace().next()?.parse().ok())
            .unwrap();
        assert!(anon_kb < 8 << 10, "{how:?}: criuz holds {anon_kb} kB of anonymous memory while it waits");
        let expected = match end {
            "exit 7" => {
                std::fs::write(w.dir.path().join("rewrite"), "exit 7").unwrap();
                // SAFETY: as above.
                unsafe { libc::kill(w.pid, libc::SIGUSR2) };
                7
            }
            // The workload ends with status 0 on SIGTERM; criuz, had it not
            // passed the signal on, would have died by it.
            "SIGTERM to criuz" => {
                // SAFETY: signalling the criuz this test started.
                unsafe { libc::kill(restore.id() as i32, libc::SIGTERM) };
                0
            }
            _ => {
                // SAFETY: as above.
                unsafe { libc::kill(w.pid, libc::SIGKILL) };
                128 + libc::SIGKILL
            }
        };
        let mut err = String::new();
        std::io::Read::read_to_string(restore.stderr.as_mut().unwrap(), &mut err).unwrap();
        let status = restore.wait().unwrap();
        assert_eq!((status.code(), status.signal()), (Some(expected), None), "{how:?}, {end}: {err}");
        assert!(!err.contains("interrupted"), "{how:?}, {end}: {err}");
        assert!(!w.alive(), "{how:?}, {end}: the tree must have ended");
    }
}

/// A signal sent to criuz the moment a foreground restore's pidfile names
/// the tree goes on to the tree's root, as it does once criuz waits for it:
/// before, in the few milliseconds between the pidfile and that wait (the
/// summary, criuz's fresh image), a SIGTERM ended criuz while the tree ran
/// on without it (found by the fault campaign, `restore-foreground`).
/// Whatever the signal does, criuz never ends with the tree running on.
/// `--fill place` is tried four times: before every thread but the signal
/// thread held them back (`proc::interrupt`), a signal that came as criuz
/// replaced its image to wait was lost (4 of 40 restores in a stress run).
#[test]
fn a_signal_sent_as_the_pidfile_appears_goes_on_to_the_root() {
    use std::os::unix::process::ExitStatusExt;
    let Some(_criu) = criu() else { return };
    let _g = serial();
    let dir = tempfile::tempdir().unwrap();
    let place: &[&str] = &["--fill", "place"];
    for how in [place; 4].into_iter().chain([&["--fill", "stream"][..], &["--lazy"]]) {
        let mut w = Workload::start(Spec { pattern: "mixed", mib: 32, ..Default::default() });
        let (mut restore, pidfile) = dump_and_restore_in_the_foreground(&mut w, dir.path(), how);
        // Polled without a pause: the signal must land in the window.
        let deadline = Instant::now() + Duration::from_secs(60);
        while !std::fs::read_to_string(&pidfile).is_ok_and(|p| p.trim() == w.pid.to_string()) {
            assert!(Instant::now() < deadline, "{how:?}: the restored tree never ran");
            assert!(restore.try_wait().unwrap().is_none(), "{how:?}: the restore ended before its tree ran");
            std::hint::spin_loop();
        }
        // SAFETY: signalling the criuz this test started.
        unsafe { libc::kill(restore.id() as i32, libc::SIGTERM) };
        let deadline = Instant::now() + Duration::from_secs(30);
        let status = loop {
            if let Some(status) = restore.try_wait().unwrap() {
                break Some(status);
            }
            if Instant::now() > deadline {
                break None;
            }
            std::thread::sleep(Duration::from_millis(10));
        };
        let alive = w.alive();
        if alive {
            // SAFETY: ending the restored workload of this test (it holds
            // criuz's stderr too).
            unsafe { libc::kill(w.pid, libc::SIGKILL) };
        }
        let _ = restore.kill();
        let mut err = String::new();
        std::io::Read::read_to_string(restore.stderr.as_mut().unwrap(), &mut err).unwrap();
        let _ = restore.wait();
        let status = status.unwrap_or_else(|| panic!("{how:?}: the signal was lost, criuz still waits: {err}"));
        assert!(!alive, "{how:?}: the tree runs on without criuz: {err}");
        // The workload ends with status 0 on SIGTERM; criuz exits as it did.
        // A lazy tree whose pages are not all in is ended by an interruption
        // instead, as before its pidfile (`proc::interrupt`).
        if how != ["--lazy"] || !err.contains("interrupted (SIGTERM)") {
            assert_eq!((status.code(), status.signal()), (Some(0), None), "{how:?}: {err}");
        }
    }
}

/// Under a pids limit (a container's `pids.max`) criuz cannot start every
/// thread it wants. Whatever the limit, it either works or fails in one
/// line with exit status 1: never a hang, never a panic's backtrace. A
/// restore streamed through CRIU whose thread watching for CRIU's pidfile
/// could not start waited forever for a CRIU it never ran; other limits
/// ended in a backtrace (exit 101). A failed dump leaves its process
/// running with its memory; a failed restore leaves nothing running.
#[test]
fn a_pids_limit_ends_criuz_in_one_line_never_in_a_hang() {
    let Some(_criu) = criu() else { return };
    let _g = serial();
    let group = LimitGroup::new("pids");
    let mut w = Workload::start(Spec::default());
    let before = w.sums();
    let tmp = tempfile::tempdir().unwrap();
    let arc = tmp.path().join("a.czr");
    let pid = w.pid.to_string();
    // criuz under a limit of `max` tasks: its exit status and error text.
    let limited = |max: u32, args: &[&str]| -> (i32, String) {
        let log = tmp.path().join("stderr");
        let mut cmd = Command::new(CRIUZ);
        cmd.args(args).stdout(Stdio::null()).stderr(File::create(&log).unwrap());
        group.limit("pids.max", "pids.max", max as u64);
        group.join_on_exec(&mut cmd);
        let mut child = cmd.spawn().unwrap();
        let t = Instant::now();
        let status = loop {
            if let Some(st) = child.try_wait().unwrap() {
                break st;
            }
            if t.elapsed() > Duration::from_secs(60) {
                let _ = child.kill();
                let _ = child.wait();
                panic!("{args:?} under pids.max {max} hung: {}", std::fs::read_to_string(&log).unwrap());
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        let err = std::fs::read_to_string(&log).unwrap();
        let code = status.code().unwrap_or_else(|| panic!("{args:?} under pids.max {max}: {status}: {err}"));
        assert!(!err.contains("panicked") && !err.contains("backtrace"), "{args:?} under pids.max {max}: {err}");
        if code != 0 {
            assert_eq!(code, 1, "{args:?} under pids.max {max}: {err}");
            let said: Vec<&str> = err.lines().filter(|l| !l.contains("using CRIU")).collect();
            assert!(said.len() == 1 && said[0].starts_with("criuz: "), "{args:?} under pids.max {max}: {err}");
        }
        (code, err)
    };
    let reaped = |w: &mut Workload| {
        reap_zombies();
        wait_for("the pid to be free", Duration::from_secs(20), || {
            reap_zombies();
            process_state(w.pid).is_none()
        });
    };
    let (mut failed, mut worked) = (0, 0);
    for max in [3, 6, 9, 12, 16, 24] {
        let (code, err) = limited(max, &["dump", "-t", &pid, "-o", arc.to_str().unwrap(), "--force"]);
        if code == 0 {
            worked += 1;
            w.reap_original();
            ok(criuz(&["restore", "-d", "-i", arc.to_str().unwrap()]), "restore unlimited");
        } else {
            failed += 1;
        }
        assert_eq!(w.sums(), before, "after a dump under pids.max {max}: {err}");
    }
    ok(criuz(&["dump", "-t", &pid, "-o", arc.to_str().unwrap(), "--force"]), "dump unlimited");
    w.reap_original();
    for fill in [&["--fill", "place"][..], &["--lazy"], &["--fill", "stream"]] {
        for max in [4, 8, 12, 16] {
            let mut args = vec!["restore", "-d", "-i", arc.to_str().unwrap()];
            args.extend_from_slice(fill);
            let (code, err) = limited(max, &args);
            if code == 0 {
                worked += 1;
                assert_eq!(w.sums(), before, "{fill:?} under pids.max {max}: {err}");
                // SAFETY: our own restored workload.
                unsafe { libc::kill(w.pid, libc::SIGKILL) };
            } else {
                failed += 1;
                assert!(!w.alive(), "{fill:?} under pids.max {max} failed and left its tree running: {err}");
            }
            reaped(&mut w);
        }
    }
    assert!(failed > 0 && worked > 0, "the limits must both stop and let criuz run ({failed} failed, {worked} worked)");
    ok(criuz(&["restore", "-d", "-i", arc.to_str().unwrap()]), "restore unlimited");
    assert_eq!(w.sums(), before);
    w.stop();
    reaped(&mut w);
}

/// Under an address-space limit (`ulimit -v`, as a batch scheduler sets
/// for a job), glibc's per-thread arenas took the space before the
/// pipeline had any, and a dump aborted on a failed allocation (exit 134,
/// a backtrace) at 200 MiB to 1 GiB. It now works there, sized by what is
/// left, and a limit too small for it ends in one line, exit 1.
#[test]
fn a_dump_under_an_address_space_limit_works_or_fails_in_one_line() {
    let Some(_criu) = criu() else { return };
    let _g = serial();
    let mut w = Workload::start(Spec { mib: 256, pattern: "random", ..Default::default() });
    let before = w.sums();
    let tmp = tempfile::tempdir().unwrap();
    let arc = tmp.path().join("a.czr");
    let pid = w.pid.to_string();
    for mib in [60u64, 200, 400, 1024] {
        let mut cmd = Command::new(CRIUZ);
        cmd.args(["dump", "-t", &pid, "-o", arc.to_str().unwrap(), "--force", "--leave-running"]);
        let out = run(with_rlimit(&mut cmd, libc::RLIMIT_AS, mib << 20, mib << 20));
        let err = String::from_utf8_lossy(&out.stderr);
        if mib == 60 {
            assert_eq!(out.status.code(), Some(1), "{mib} MiB: {err}");
            assert!(
                err.contains("ulimit -v") && err.lines().filter(|l| !l.contains("using CRIU")).count() == 1,
                "{err}"
            );
        } else {
            assert!(out.status.success(), "{mib} MiB: {err}");
            ok(criuz(&["verify", arc.to_str().unwrap()]), "verify");
        }
        assert_eq!(w.sums(), before, "{mib} MiB");
    }
    w.stop();
}

/// A restore in a memory cgroup whose limit the tree's memory exceeds (a
/// pod sized for less than the checkpoint) had the restored process
/// OOM-killed as its pages came in, and criuz with it: exit 137, not a
/// word. It is refused before CRIU runs, naming the limit, whichever way
/// the memory would come back.
#[test]
fn a_restore_larger_than_its_memory_cgroup_is_refused_first() {
    let Some(_criu) = criu() else { return };
    let _g = serial();
    let group = LimitGroup::new("memory");
    if !group.limit_memory(48 << 20) {
        return eprintln!("SKIP: swap here, and no swap limit for the group");
    }
    let mut w = Workload::start(Spec { mib: 96, pattern: "random", ..Default::default() });
    let before = w.sums();
    let tmp = tempfile::tempdir().unwrap();
    let arc = tmp.path().join("a.czr");
    dump(&w, &arc, &[]);
    w.reap_original();
    // Each restore is refused, saying `why`, before anything ran: run in
    // the group, or (`outside`) from outside it, by a criuz whose tree CRIU
    // puts back in the group it was dumped in.
    let refused_from = |w: &Workload, fill: &[&str], why: &str, outside: bool| {
        let mut cmd = Command::new(CRIUZ);
        cmd.args(["restore", "-d", arc.to_str().unwrap()]).args(fill);
        if !outside {
            group.join_on_exec(&mut cmd);
        }
        let out = run(&mut cmd);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{fill:?}: {err}");
        assert!(err.contains(why), "{fill:?}: {err}");
        assert_eq!(group.oom_kills(), 0, "{fill:?}: {err}");
        assert!(!w.alive(), "{fill:?}: nothing restored");
    };
    let refused = |w: &Workload, fill: &[&str], why: &str| refused_from(w, fill, why, false);
    for fill in [&[][..], &["--fill", "stream"], &["--lazy"]] {
        refused(&w, fill, &format!("of memory, more than memory cgroup {} has room for", group.dir.display()));
    }
    ok(criuz(&["restore", "-d", arc.to_str().unwrap()]), "restore outside the group");
    assert_eq!(w.sums(), before);
    w.stop();
    // A forked tree in the group whose processes share most of their pages
    // (84 MiB in all) fits there where CRIU restores them shared (streamed,
    // the default for it, and CRIU puts the tree back in its group), not
    // where userfaultfd copies them into each process: placed or lazily,
    // its 4 processes would hold 48 MiB each, over the 160 MiB limit.
    group.limit_memory(160 << 20);
    let spec =
        Spec { mib: 48, mode: "tree", children: 3, pattern: "random", group: Some(&group), ..Default::default() };
    let mut w = Workload::start(spec);
    let before = w.sums();
    dump(&w, &arc, &["--force"]);
    w.reap_original();
    for fill in [&["--fill", "place"][..], &["--lazy"]] {
        refused(&w, fill, "each a copy of its own of the pages they shared");
        // From outside the group: its root was OOM-killed, and the restore
        // said "restored", exit 0.
        let why = format!("more than memory cgroup {} has room for", group.dir.display());
        refused_from(&w, fill, &why, true);
    }
    let out = ok(criuz(&["restore", "-d", arc.to_str().unwrap(), "--json"]), "restore");
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(report["fill"], "stream", "{report}");
    let in_group = std::fs::read_to_string(format!("/proc/{}/cgroup", w.pid)).unwrap();
    assert!(in_group.contains(group.dir.file_name().unwrap().to_str().unwrap()), "{in_group}");
    assert_eq!(w.sums(), before);
    assert_eq!(group.oom_kills(), 0);
    w.stop();
    // A group gone at the restore is made anew by CRIU with the limit it
    // was dumped with, which counts as the group's would (the groups above
    // it have none).
    wait_for("the tree gone and its group removed", Duration::from_secs(10), || {
        reap_zombies();
        std::fs::remove_dir(&group.dir).is_ok()
    });
    for fill in [&["--fill", "place"][..], &["--lazy"]] {
        refused_from(&w, fill, &format!("more than memory cgroup {} has room for", group.dir.display()), true);
        assert!(!group.dir.exists(), "{fill:?}: nothing made");
    }
    ok(criuz(&["restore", "-d", arc.to_str().unwrap()]), "restore into a group made anew");
    let limit =
        ["memory.limit_in_bytes", "memory.max"].iter().find_map(|f| std::fs::read_to_string(group.dir.join(f)).ok());
    assert_eq!(limit.as_deref().map(str::trim), Some((160u64 << 20).to_string().as_str()));
    assert_eq!(w.sums(), before);
    w.stop();
}

/// Shared memory comes back whole, zero pages too (only a process's zero
/// runs are left out of a restore): counted without them, a 512 MiB shared
/// mapping half of zeros was taken for 256 MiB, and its restore in a group
/// with 300 MiB free was OOM-killed ("killed by signal 9"). It is refused
/// first, however it would fill, and restores outside the group. (Placed,
/// criuz leaves the zero pages holes, `session::shmem`; they are memory
/// again as soon as the tree reads them, as when it was dumped.)
#[test]
fn shared_memory_is_counted_with_its_zero_pages() {
    let Some(_criu) = criu() else { return };
    let _g = serial();
    let group = LimitGroup::new("memory");
    if !group.limit_memory(72 << 20) {
        return eprintln!("SKIP: swap here, and no swap limit for the group");
    }
    // `mixed`: half of the 96 MiB are zero pages.
    let mut w = Workload::start(Spec { mib: 96, shared: true, ..Default::default() });
    let before = w.sums();
    let tmp = tempfile::tempdir().unwrap();
    let arc = tmp.path().join("a.czr");
    dump(&w, &arc, &[]);
    w.reap_original();
    for fill in [&[][..], &["--fill", "place"], &["--lazy"]] {
        let mut cmd = Command::new(CRIUZ);
        cmd.args(["restore", "-d", arc.to_str().unwrap()]).args(fill);
        group.join_on_exec(&mut cmd);
        let out = run(&mut cmd);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{fill:?}: {err}");
        let why = format!("of memory, more than memory cgroup {} has room for", group.dir.display());
        assert!(err.contains(&why), "{fill:?}: {err}");
        assert_eq!(group.oom_kills(), 0, "{fill:?}: {err}");
        assert!(!w.alive(), "{fill:?}: nothing restored");
    }
    ok(criuz(&["restore", "-d", arc.to_str().unwrap()]), "restore outside the group");
    assert_eq!(w.sums(), before);
    w.stop();
}

/// A tree that fits its memory cgroup's limit but not what the group's
/// other processes leave of it is refused before anything runs, however it
/// would fill (placed, the OOM killer killed the tree's process and then
/// the group's other process, since the copy still held the dead tree's
/// memory: the restore said "restored", exit 0). A process of a held tree
/// killed as its pages come in fails the restore, and the rest of the tree
/// goes, where it said "restored" with the process dead.
#[test]
fn a_tree_is_not_restored_into_a_group_without_room_nor_with_a_process_killed() {
    let Some(_criu) = criu() else { return };
    let _g = serial();
    let group = LimitGroup::new("memory");
    if !group.limit_memory(192 << 20) {
        return eprintln!("SKIP: swap here, and no swap limit for the group");
    }
    let mut w = Workload::start(Spec { mib: 160, pattern: "random", group: Some(&group), ..Default::default() });
    let before = w.sums();
    let tmp = tempfile::tempdir().unwrap();
    let arc = tmp.path().join("a.czr");
    dump(&w, &arc, &[]);
    w.reap_original();
    let restore = |fill: &[&str]| run(Command::new(CRIUZ).args(["restore", "-d", arc.to_str().unwrap()]).args(fill));
    // Another process of the group holds 64 MiB: 160 more do not fit.
    let mut other = Workload::start(Spec { mib: 64, pattern: "random", group: Some(&group), ..Default::default() });
    for fill in [&["--fill", "place"][..], &["--lazy"], &["--fill", "stream"]] {
        let out = restore(fill);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{fill:?}: {err}");
        assert!(err.contains(&format!("more than memory cgroup {} has room for", group.dir.display())), "{err}");
        assert_eq!(group.oom_kills(), 0, "{fill:?}: {err}");
        assert!(!w.alive() && other.alive(), "{fill:?}: nothing restored, nothing killed");
    }
    other.stop();
    // Killed by a signal as its pages are placed (the tree held stopped):
    // the restore fails, and no process of it is left.
    let killer = {
        let pid = w.pid;
        std::thread::spawn(move || {
            let t = Instant::now();
            while t.elapsed() < Duration::from_secs(30) {
                let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
                let field =
                    |name: &str| status.lines().find_map(|l| l.strip_prefix(name)).map(str::trim).map(String::from);
                let held = field("State:").is_some_and(|s| s.starts_with('t') || s.starts_with('T'));
                let rss_kib: u64 = field("VmRSS:").and_then(|v| v.split_whitespace().next()?.parse().ok()).unwrap_or(0);
                if held && rss_kib > 16 << 10 {
                    // SAFETY: the test's own restored workload, held stopped.
                    unsafe { libc::kill(pid, libc::SIGKILL) };
                    return true;
                }
                std::thread::sleep(Duration::from_micros(200));
            }
            false
        })
    };
    let out = restore(&["--fill", "place"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(killer.join().unwrap(), "the held tree was seen: {err}");
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains(&format!("restored process {} was", w.pid)), "{err}");
    assert!(err.contains("before the tree ran, as its memory was placed: something outside criuz killed it"), "{err}");
    assert!(!w.alive());
    ok(criuz(&["restore", "-d", arc.to_str().unwrap()]), "restore with room");
    assert_eq!(w.sums(), before);
    w.stop();
}

/// A dump in a memory cgroup with little room left (a pod whose process
/// fills most of its limit) sizes itself to that room, as `criu dump -D`
/// needs none: sized by the machine's memory, the dump took the group over
/// its limit and the OOM killer killed the process being checkpointed (1 of
/// 2 dumps of a 256 MiB process in a 400 MiB group; every one at 300 MiB).
#[test]
fn a_dump_in_a_tight_memory_cgroup_leaves_its_process_alive() {
    let Some(_criu) = criu() else { return };
    let _g = serial();
    let group = LimitGroup::new("memory");
    group.limit("memory.limit_in_bytes", "memory.max", 300 << 20);
    let mut w = Workload::start(Spec { mib: 256, pattern: "random", group: Some(&group), ..Default::default() });
    let before = w.sums();
    let tmp = tempfile::tempdir().unwrap();
    let arc = tmp.path().join("a.czr");
    let pid = w.pid.to_string();
    // Three dumps that leave it running, then one that ends it.
    for round in 0..4 {
        let mut cmd = Command::new(CRIUZ);
        cmd.args(["dump", "-t", &pid, "-o", arc.to_str().unwrap(), "--force", "--json"]);
        if round < 3 {
            cmd.arg("--leave-running");
        }
        group.join_on_exec(&mut cmd);
        let out = run(&mut cmd);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(group.oom_kills(), 0, "round {round}: the OOM killer ran in the group: {err}");
        assert!(out.status.success(), "round {round}: {err}");
        let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        let budget = report["absorb_budget"].as_u64().unwrap();
        assert!(budget <= 16 << 20, "round {round}: a budget of {budget} bytes in a group with 40 MiB to spare");
        if round < 3 {
            assert_eq!(w.sums(), before, "round {round}");
        }
    }
    w.reap_original();
    ok(criuz(&["restore", "-d", "-i", arc.to_str().unwrap()]), "restore");
    assert_eq!(w.sums(), before);
    w.stop();
    reap_zombies();
    wait_for("the restored workload to end", Duration::from_secs(20), || {
        reap_zombies();
        !w.alive()
    });
}

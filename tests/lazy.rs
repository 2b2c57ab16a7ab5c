//! Lazy restore with real CRIU (`criu restore --lazy-pages`, criuz serving
//! the faults): a process tree restored lazily comes back with every
//! process's own checksum, from a file, from a pipe and from an incremental
//! child; a block damaged at rest stops the restore before the process
//! runs, and one crafted to pass every check but its data check, found
//! only after the process runs, kills the restored tree (no silent zeros)
//! and fails as damaged; criuz killed or interrupted while pages still arrive ends in the
//! tree's SIGKILL (and that of a child it forked meanwhile), not in a process
//! running (or crashing) on zeros; memory discarded meanwhile reads as zero.

// Tests start processes of their own; clippy.toml's rule is for the
// programs criuz runs.
#![allow(clippy::disallowed_methods)]

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

/// A workload started from `spec` and checkpointed into `arc` (the
/// original reaped), with the checksums its processes gave before.
fn dumped(spec: Spec, arc: &Path) -> (Workload, std::collections::BTreeMap<String, String>) {
    let mut w = Workload::start(spec);
    let before = w.sums();
    dump(&w, arc);
    w.reap_original();
    (w, before)
}

/// The report of `criuz restore --lazy -d --json -i arc`, which must succeed.
fn restored_lazily(arc: &Path) -> serde_json::Value {
    let out = criuz(&["restore", "--lazy", "-d", "--json", "-i", arc.to_str().unwrap()]);
    assert!(out.status.success(), "lazy restore: {}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).unwrap()
}

#[test]
fn a_tree_restored_lazily_keeps_its_checksums() {
    let Some(_criu) = criu() else { return };
    let _g = serial();
    let tmp = tempfile::tempdir().unwrap();
    let arc = tmp.path().join("tree.czr");
    let (mut w, before) = dumped(Spec { mib: 48, pattern: "mixed", mode: "tree", ..Default::default() }, &arc);

    let rep = restored_lazily(&arc);
    // The memory came through criuz's pager, not through CRIU's images.
    let lazy = rep["lazy_pages"].as_u64().unwrap();
    assert!(lazy > (48 << 20) / 4096 / 2, "{rep}");
    assert!(rep["eager_pages"].as_u64().unwrap() < lazy / 10, "{rep}");
    // The start's steps, in the order the tree waits for them: it runs
    // only once CRIU handed it over, the index was proven and CRIU exited.
    let at = |step: &str| rep[step].as_f64().unwrap_or_else(|| panic!("no {step}: {rep}"));
    assert!(at("criu_started_seconds") <= at("handed_over_seconds"), "{rep}");
    assert!(at("handed_over_seconds") <= at("index_proven_seconds"), "{rep}");
    assert!(at("index_proven_seconds") <= at("running_seconds"), "{rep}");
    assert!(at("criu_exited_seconds") <= at("running_seconds"), "{rep}");
    assert_eq!(w.sums(), before, "a lazily restored process sees other memory");
    w.stop();
}

/// Shared memory every process of the tree maps is served like private
/// memory: CRIU makes and maps it, criuz copies its pages in once the tree
/// runs, and a flipped byte in one of its blocks kills the tree.
#[test]
fn shared_memory_is_served_lazily_to_every_process() {
    let Some(_criu) = criu() else { return };
    let _g = serial();
    let tmp = tempfile::tempdir().unwrap();
    let arc = tmp.path().join("shared.czr");
    let mib = 48;
    let spec = Spec { mib, shared: true, mode: "tree", children: 2, ..Default::default() };
    let (mut w, before) = dumped(spec, &arc);
    let rep = restored_lazily(&arc);
    // Half of `mixed` is zero pages: holes, not copied.
    let data_pages = ((mib as u64) << 20) / 4096 / 2;
    let served = rep["shared_pages"].as_u64().unwrap();
    assert!(served > data_pages * 9 / 10 && served < data_pages * 11 / 10, "{rep}");
    assert!(rep["eager_pages"].as_u64().unwrap() < data_pages / 10, "CRIU restored the shared memory: {rep}");
    assert_eq!(w.sums(), before, "a lazily restored process sees other shared memory");
    w.stop();

    // One byte of a block of the shared memory's pages image (the largest).
    let arc = tmp.path().join("flipped.czr");
    let (w, _) = dumped(Spec { mib, shared: true, ..Default::default() }, &arc);
    flip_a_byte_of_the_largest_pages_image(&arc);
    let out = criuz(&["restore", "--lazy", "-d", "-i", arc.to_str().unwrap()]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(3), "{err}");
    assert!(err.contains("checksum"), "{err}");
    wait_for("the restored process to be gone", std::time::Duration::from_secs(10), || {
        // SAFETY: non-blocking reap of zombies re-parented to us.
        while unsafe { libc::waitpid(-1, std::ptr::null_mut(), libc::WNOHANG) } > 0 {}
        !w.alive()
    });
}

/// 1 GiB of random pages in shared memory, dumped into `arc` (the original
/// reaped), and the checksum of its memory before.
fn big_shared_dumped(tmp: &Path) -> (Workload, std::path::PathBuf, String) {
    let arc = tmp.join("big-shared.czr");
    let mut w = Workload::start(Spec { mib: BIG_MIB, pattern: "random", shared: true, ..Default::default() });
    let before = memory_sum(&w.sums()["root"]);
    dump(&w, &arc);
    w.reap_original();
    (w, arc, before)
}

/// A child forked while shared memory still arrives maps it too: its
/// faults are served through its own userfaultfd, and it reads the bytes
/// that were dumped.
#[test]
fn a_child_forked_while_shared_memory_arrives_reads_it_whole() {
    let Some(_criu) = criu() else { return };
    let _g = serial();
    let tmp = tempfile::tempdir().unwrap();
    let (mut w, arc, before) = big_shared_dumped(tmp.path());
    let child = lazy_restore_until_running(&arc, &tmp.path().join("restored.pid"));
    command(&w, "fork", "late-pid");
    let late_sum = w.dir.path().join("sum-late");
    wait_for("the forked child's checksum", std::time::Duration::from_secs(60), || late_sum.exists());
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let late: i32 = std::fs::read_to_string(w.dir.path().join("late-pid")).unwrap().trim().parse().unwrap();
    assert_eq!(memory_sum(&std::fs::read_to_string(&late_sum).unwrap()), before, "the fork read other memory");
    assert_eq!(memory_sum(&w.sums()["root"]), before, "the restored process reads other memory");
    // SAFETY: ending the workload's own child.
    unsafe { libc::kill(late, libc::SIGKILL) };
    w.stop();
}

/// Shared memory moved while its pages still arrive could grow to show
/// pages the pager cannot tell apart: the tree is killed rather than left
/// to read zeros there. Should every page be in first, the move is the
/// process's own business and the memory keeps its bytes.
#[test]
fn shared_memory_moved_while_pages_arrive_kills_the_tree_or_keeps_its_bytes() {
    shared_memory_changed_while_pages_arrive("mremap", "mremapped-root", "moved shared memory");
}

/// Shared memory discarded (`MADV_DONTNEED`) while its pages still arrive:
/// the event does not say whether the pages left the object or only the
/// mapping, so the tree is killed; should every page be in first, the
/// discard only drops the mapping's view and the memory keeps its bytes.
#[test]
fn shared_memory_discarded_while_pages_arrive_kills_the_tree_or_keeps_its_bytes() {
    shared_memory_changed_while_pages_arrive("dontneed", "dontneed-root", "discarded shared memory");
}

/// Restores 1 GiB of shared memory lazily and has the workload do `what`
/// to it at once (it writes `done` when it has): either criuz fails saying
/// `said` and the tree is killed, or, every page having been in first, the
/// memory keeps its bytes.
fn shared_memory_changed_while_pages_arrive(what: &str, done: &str, said: &str) {
    let Some(_criu) = criu() else { return };
    let _g = serial();
    let tmp = tempfile::tempdir().unwrap();
    let (mut w, arc, before) = big_shared_dumped(tmp.path());
    let child = lazy_restore_until_running(&arc, &tmp.path().join("restored.pid"));
    let done = w.dir.path().join(done);
    std::fs::write(w.dir.path().join("rewrite"), what).unwrap();
    // SAFETY: signalling our own workload.
    unsafe { libc::kill(w.pid, libc::SIGUSR2) };
    let out = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    eprintln!("criuz restore --lazy, {what} of the shared memory meanwhile: {}", err.trim());
    if out.status.success() {
        wait_for(&format!("the workload's {what}"), std::time::Duration::from_secs(30), || done.exists());
        assert_eq!(memory_sum(&w.sums()["root"]), before, "shared memory changed by {what}");
        w.stop();
    } else {
        // criuz, the tree's subreaper, reaped it and says how it ended.
        assert!(err.contains(said), "{err}");
        assert!(err.contains(&format!("pid {} killed by signal 9", w.pid)), "{err}");
        assert!(!w.alive(), "the restored process was killed");
    }
}

/// Anonymous memory resident in process `pid` (kB), from smaps_rollup: a
/// page mapped to the kernel's zero page does not count.
fn anonymous_kb(pid: i32) -> u64 {
    rollup_kib(pid, "Anonymous:")
}

#[test]
fn a_lazy_restore_maps_the_zero_pages_it_keeps_instead_of_copying_them() {
    let Some(_criu) = criu() else { return };
    let _g = serial();
    let tmp = tempfile::tempdir().unwrap();
    let arc = tmp.path().join("one.czr");
    // Half of `mixed`'s pages are zero, in runs too short for the pagemap to
    // leave out: the fill meets them among the pages it copies.
    let (mut w, before) = dumped(Spec { mib: 48, pattern: "mixed", ..Default::default() }, &arc);

    let rep = restored_lazily(&arc);
    let pages = (48 << 20) / 4096;
    assert!(rep["zero_pages_mapped"].as_u64().unwrap() > pages / 3, "{rep}");
    // Every page is in (the restore returned): the process holds memory for
    // its non-zero half, not for all of it.
    let kb = anonymous_kb(w.pid);
    assert!(kb < 48 * 1024 * 7 / 10, "{kb} kB of anonymous memory resident after a lazy restore; {rep}");
    assert_eq!(w.sums(), before, "a lazily restored process sees other memory");
    // Its zero pages take writes as any page does.
    w.rewrite(100.0, 7);
    w.sums();
    w.stop();
}

#[test]
fn a_damaged_block_found_after_the_process_runs_kills_it() {
    let Some(_criu) = criu() else { return };
    let _g = serial();
    let tmp = tempfile::tempdir().unwrap();
    let arc = tmp.path().join("one.czr");
    // The restored process already runs when criuz's fill finds the damage.
    let w = dumped_with_a_crafted_block(&arc);
    let out = criuz(&["restore", "--lazy", "-d", "-i", arc.to_str().unwrap()]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(3), "{err}");
    assert!(err.contains("one.czr") && err.contains("data checksum") && err.contains("killed"), "{err}");
    // criuz, the tree's subreaper, reaped it (its pid free again) and says
    // how it ended: killed, not crashed on a page that read as zeros.
    assert!(err.contains(&format!("pid {} killed by signal 9", w.pid)), "{err}");
    assert!(!w.alive(), "the restored process was killed");
}

/// A 48 MiB mixed workload dumped into `arc`, its original reaped, and the
/// LZ4 payload of a page block three quarters in crafted: one of its last
/// literals changed and every check but the block's data check recomputed,
/// so the stored bytes prove good and the damage is found only as the block
/// is decoded.
fn dumped_with_a_crafted_block(arc: &Path) -> Workload {
    let mut w = Workload::start(Spec { mib: 48, pattern: "mixed", ..Default::default() });
    w.sums();
    dump(&w, arc);
    w.reap_original();
    let mut bytes = std::fs::read(arc).unwrap();
    let b = page_block_three_quarters_in(&bytes, Some(1));
    bytes[b.start + b.len - 3] ^= 0x10;
    let payload = xxhash_rust::xxh3::xxh3_64(&bytes[b.start + b.header_len + 4..b.start + b.len]) as u32;
    bytes[b.start + 24..b.start + 28].copy_from_slice(&payload.to_le_bytes());
    mutate::reseal(&mut bytes, mutate::Reseal::All);
    std::fs::write(arc, &bytes).unwrap();
    w
}

/// A block of page data three quarters into the archive (of `codec`, if
/// given): far enough in that a lazy restore's fill reaches it late.
fn page_block_three_quarters_in(bytes: &[u8], codec: Option<u8>) -> mutate::Rec {
    let blocks: Vec<_> = mutate::records(bytes)
        .into_iter()
        .filter(|r| r.kind == b'B' && r.len > r.header_len + 4 + 4096)
        .filter(|r| codec.is_none_or(|c| bytes[r.start + 1] == c))
        .collect();
    blocks[blocks.len() * 3 / 4]
}

/// Writes `arc` to `to` with one bit of a stored page flipped at rest, in a
/// page block of `codec` three quarters in (0 raw: its data check finds it;
/// 1 LZ4: its payload check does).
fn write_rotted(arc: &Path, codec: u8, to: &Path) {
    let mut bytes = std::fs::read(arc).unwrap();
    let b = page_block_three_quarters_in(&bytes, Some(codec));
    bytes[b.start + b.len - 17] ^= 0x10;
    std::fs::write(to, &bytes).unwrap();
}

#[test]
fn a_damaged_block_stops_a_lazy_restore_before_the_process_runs() {
    let Some(_criu) = criu() else { return };
    let _g = serial();
    let tmp = tempfile::tempdir().unwrap();
    let arc = tmp.path().join("rot.czr");
    // One bit of a stored page flipped at rest, in a raw block (proven by
    // its data check; random pages are stored raw) and in an LZ4 one (by
    // its payload check): every stored byte is read against its check
    // before CRIU starts.
    for (pattern, codec) in [("random", 0), ("mixed", 1)] {
        let mut w = Workload::start(Spec { mib: 16, pattern, ..Default::default() });
        w.sums();
        dump(&w, &arc);
        w.reap_original();
        write_rotted(&arc, codec, &arc);
        let out = criuz(&["restore", "--lazy", "--verify-first", "-d", "-i", arc.to_str().unwrap()]);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(3), "{pattern}: {err}");
        assert!(err.contains("rot.czr") && err.contains("checksum") && !err.contains("killed"), "{pattern}: {err}");
        assert!(!w.alive(), "{pattern}: nothing was restored");
        std::fs::remove_file(&arc).unwrap();
    }
}

#[test]
fn a_damaged_block_found_behind_a_lazily_restored_process_kills_it() {
    let Some(_criu) = criu() else { return };
    let _g = serial();
    let tmp = tempfile::tempdir().unwrap();
    let arc = tmp.path().join("rot.czr");
    // As above, but in the default order: the proof of the stored bytes
    // runs behind the process, and the damage it (or the fill) finds kills
    // the tree; the command fails as damaged.
    for (pattern, codec) in [("random", 0), ("mixed", 1)] {
        let mut w = Workload::start(Spec { mib: 16, pattern, ..Default::default() });
        w.sums();
        dump(&w, &arc);
        w.reap_original();
        write_rotted(&arc, codec, &arc);
        let out = criuz(&["restore", "--lazy", "-d", "-i", arc.to_str().unwrap()]);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(3), "{pattern}: {err}");
        assert!(err.contains("rot.czr") && err.contains("checksum") && err.contains("killed"), "{pattern}: {err}");
        // Killed, whether CRIU was still finishing it (CRIU reaps it) or it
        // ran (ours to reap, as subreaper).
        wait_for(pattern, std::time::Duration::from_secs(10), || {
            // SAFETY: non-blocking reap of zombies re-parented to us.
            while unsafe { libc::waitpid(-1, std::ptr::null_mut(), libc::WNOHANG) } > 0 {}
            !w.alive()
        });
        std::fs::remove_file(&arc).unwrap();
    }
}

/// Starts a detached lazy restore of `arc` in the background; returns it once
/// the restored tree runs (its pidfile is there), with every page not yet in.
fn lazy_restore_until_running(arc: &Path, pidfile: &Path) -> std::process::Child {
    let mut cmd = std::process::Command::new(CRIUZ);
    cmd.args(["restore", "--lazy", "-d", "--pidfile", pidfile.to_str().unwrap(), "-i", arc.to_str().unwrap()])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped());
    // The interrupt test sends it a Ctrl-C.
    let mut child = takes_sigint(&mut cmd).spawn().unwrap();
    let t = std::time::Instant::now();
    while !pidfile.exists() {
        if let Some(st) = child.try_wait().unwrap() {
            panic!("criuz ended ({st}) before the tree ran");
        }
        assert!(t.elapsed().as_secs() < 120, "the restored tree never ran");
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
    child
}

/// Waits for the restored process (ours to reap: subreaper) to end, and
/// checks that it was killed, not crashed on a page that read as zeros.
fn assert_killed(w: &Workload, why: &str) {
    assert_sigkilled(w.pid, why);
    // SAFETY: non-blocking reap of other zombies re-parented to us.
    while unsafe { libc::waitpid(-1, std::ptr::null_mut(), libc::WNOHANG) } > 0 {}
}

/// Reaps `pid` (ours, or re-parented to us) and checks it died of SIGKILL.
fn assert_sigkilled(pid: i32, why: &str) {
    let mut st = 0;
    wait_for(why, std::time::Duration::from_secs(10), || {
        // SAFETY: non-blocking reap of our (re-parented) child.
        unsafe { libc::waitpid(pid, &mut st, libc::WNOHANG) == pid }
    });
    assert!(libc::WIFSIGNALED(st) && libc::WTERMSIG(st) == libc::SIGKILL, "{why}: it ended with wait status {st:#x}");
}

/// A process whose memory arrives over half a second or more: random pages
/// cannot be compressed, so the background fill takes a while.
/// Large enough that its lazy fill is still under way when a test acts on
/// the running tree: 512 MiB of random pages were all in 0.24 s after the
/// start on two cores, and a loaded test machine can take that long to send
/// a signal.
const BIG_MIB: usize = 1024;

fn big_dumped(tmp: &Path, name: &str) -> (Workload, std::path::PathBuf) {
    let arc = tmp.join(name);
    let mut w = Workload::start(Spec { mib: BIG_MIB, pattern: "random", ..Default::default() });
    w.sums();
    dump(&w, &arc);
    w.reap_original();
    (w, arc)
}

/// `big_dumped`, restored lazily in the background: running, pages arriving.
fn big_restored_lazily(tmp: &Path) -> (Workload, std::process::Child) {
    let (w, arc) = big_dumped(tmp, "big.czr");
    let child = lazy_restore_until_running(&arc, &tmp.join("restored.pid"));
    (w, child)
}

#[test]
fn criuz_killed_mid_fill_takes_the_tree_with_it() {
    let Some(_criu) = criu() else { return };
    let _g = serial();
    let tmp = tempfile::tempdir().unwrap();
    let (w, mut child) = big_restored_lazily(tmp.path());
    // SAFETY: killing our own child.
    unsafe { libc::kill(child.id() as i32, libc::SIGKILL) };
    child.wait().unwrap();
    // Without the guard's copies of the userfaultfds, the kernel would let
    // the process run on with zeros where its pages had not arrived.
    assert_killed(&w, "the guard to kill the restored process (had every page arrived already?)");
}

#[test]
fn criuz_interrupted_mid_fill_takes_the_tree_with_it() {
    let Some(_criu) = criu() else { return };
    let _g = serial();
    for _attempt in 0..3 {
        let tmp = tempfile::tempdir().unwrap();
        let (mut w, arc) = big_dumped(tmp.path(), "big.czr");
        let started = std::time::Instant::now();
        let child = lazy_restore_until_running(&arc, &tmp.path().join("restored.pid"));
        // Ctrl-C: criuz ends; its guard ignores SIGINT and kills the tree.
        let signalled = started.elapsed().as_secs_f64();
        // SAFETY: signalling our own child.
        unsafe { libc::kill(child.id() as i32, libc::SIGINT) };
        let out = child.wait_with_output().unwrap();
        if out.status.success() {
            // Only fine if every page was in before the signal was sent
            // (criuz counts from its own start, after `started`): then this
            // run proved nothing, and the next one tries again.
            let said = String::from_utf8_lossy(&out.stderr).into_owned();
            let all_in = said.split("every page in after ").nth(1).and_then(|r| r.split('s').next()?.parse().ok());
            let all_in: f64 = all_in.unwrap_or_else(|| panic!("no fill time in criuz's report: {said}"));
            assert!(all_in <= signalled, "criuz finished despite SIGINT sent {signalled:.3} s in: {said}");
            w.stop();
            continue;
        }
        assert_killed(&w, "the guard to kill the restored process");
        return;
    }
    panic!("every page was in before the signal, three times over: the fill outran the test");
}

#[test]
fn a_child_forked_while_pages_arrive_dies_with_the_tree() {
    let Some(_criu) = criu() else { return };
    let _g = serial();
    let tmp = tempfile::tempdir().unwrap();
    let (w, mut child) = big_restored_lazily(tmp.path());
    // The restored process forks; the child reads all the memory it shares.
    command(&w, "fork", "late-pid");
    let late = std::fs::read_to_string(w.dir.path().join("late-pid")).unwrap();
    let late: i32 = late.trim().parse().unwrap();
    // SAFETY: killing our own child.
    unsafe { libc::kill(child.id() as i32, libc::SIGKILL) };
    child.wait().unwrap();
    // The fork is no restored pid: the guard must find it among the tree's
    // descendants, or it would go on with zeros for the pages it missed.
    assert_sigkilled(late, "the guard to kill the forked child");
    // Had it read all its memory before the kill, it saw the dumped bytes.
    let sum = |role: &str| std::fs::read_to_string(w.dir.path().join(format!("sum-{role}"))).ok();
    if let Some(late) = sum("late") {
        assert_eq!(memory_sum(&late), memory_sum(&sum("root").unwrap()), "the fork read other memory");
    }
    assert_killed(&w, "the guard to kill the restored process");
}

/// Sends the workload a command through DIR/rewrite and SIGUSR2, and waits
/// for the file that says it is done.
fn command(w: &Workload, what: &str, done: &str) {
    let done = w.dir.path().join(done);
    let _ = std::fs::remove_file(&done);
    std::fs::write(w.dir.path().join("rewrite"), what).unwrap();
    // SAFETY: signalling our own workload.
    unsafe { libc::kill(w.pid, libc::SIGUSR2) };
    wait_for(&format!("the workload to {what}"), std::time::Duration::from_secs(30), || done.exists());
}

/// The `sum=` word of a checksum report (the rest names the process).
fn memory_sum(report: &str) -> String {
    report.split_whitespace().find(|w| w.starts_with("sum=")).unwrap_or_default().to_string()
}

#[test]
fn memory_discarded_while_pages_arrive_reads_as_zero() {
    let Some(_criu) = criu() else { return };
    let _g = serial();
    let tmp = tempfile::tempdir().unwrap();
    let (mut w, child) = big_restored_lazily(tmp.path());
    // Half the memory discarded before its pages arrived: it must read as
    // zero, not as the archive's pages copied in afterwards.
    command(&w, "dontneed", "dontneed-root");
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let restored = memory_sum(&w.sums()["root"]);
    w.stop();
    // The same process, never checkpointed, doing the same.
    let mut fresh = Workload::start(Spec { mib: BIG_MIB, pattern: "random", ..Default::default() });
    command(&fresh, "dontneed", "dontneed-root");
    let expected = memory_sum(&fresh.sums()["root"]);
    fresh.stop();
    assert_eq!(restored, expected, "discarded memory came back after a lazy restore");
}

/// Memory moved (mremap) while its pages still arrive keeps its bytes: the
/// pager must follow the move, copying nothing into the range the memory
/// left and leaving nothing missing where it went.
#[test]
fn memory_moved_while_pages_arrive_keeps_its_bytes() {
    let Some(_criu) = criu() else { return };
    let _g = serial();
    let tmp = tempfile::tempdir().unwrap();
    let (mut w, arc) = big_dumped(tmp.path(), "big.czr");
    let before = std::fs::read_to_string(w.dir.path().join("sum-root")).unwrap();
    let child = lazy_restore_until_running(&arc, &tmp.path().join("restored.pid"));
    command(&w, "mremap", "mremapped-root");
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let restored = memory_sum(&w.sums()["root"]);
    w.stop();
    assert_eq!(restored, memory_sum(&before), "memory moved during a lazy restore changed");
}

#[test]
fn an_incremental_child_restores_lazily_through_its_parent() {
    let Some(_criu) = criu() else { return };
    let _g = serial();
    let tmp = tempfile::tempdir().unwrap();
    let (full, child) = (tmp.path().join("full.czr"), tmp.path().join("child.czr"));
    let mut w = Workload::start(Spec { mib: 48, pattern: "mixed", ..Default::default() });
    let pid = w.pid.to_string();
    let out = criuz(&["dump", "--leave-running", "--ids", "-t", &pid, "-o", full.to_str().unwrap()]);
    assert!(out.status.success(), "full dump: {}", String::from_utf8_lossy(&out.stderr));
    w.rewrite(5.0, 1);
    let before = w.sums();
    let out = criuz(&["dump", "-t", &pid, "--parent", full.to_str().unwrap(), "-o", child.to_str().unwrap()]);
    assert!(out.status.success(), "child dump: {}", String::from_utf8_lossy(&out.stderr));
    w.reap_original();

    // Most pages live in the parent: the pager gets them through references.
    let out = criuz(&["restore", "--lazy", "-d", "--json", "-i", child.to_str().unwrap()]);
    assert!(out.status.success(), "lazy restore: {}", String::from_utf8_lossy(&out.stderr));
    let rep: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(w.sums(), before, "a child restored lazily through its parent sees other memory ({rep})");
    // Lazily even when CRIU marked no page lazy (a page-aligned stack
    // pointer, see `criu::images::mark_lazy`): about one run in a hundred.
    assert!(rep["lazy_pages"].as_u64().unwrap() > (48 << 20) / 4096 / 2, "{rep}");
    w.stop();
}

#[test]
fn a_lazy_restore_reads_its_archive_from_a_pipe() {
    let Some(_criu) = criu() else { return };
    let _g = serial();
    let tmp = tempfile::tempdir().unwrap();
    let arc = tmp.path().join("piped.czr");
    let (mut w, before) = dumped(Spec { mib: 32, pattern: "mixed", ..Default::default() }, &arc);

    // A real pipe (a file on stdin would be read in place).
    let mut cat = std::process::Command::new("cat").arg(&arc).stdout(std::process::Stdio::piped()).spawn().unwrap();
    let out = std::process::Command::new(CRIUZ)
        .args(["restore", "--lazy", "-d", "--json", "-i", "-"])
        .stdin(cat.stdout.take().unwrap())
        .output()
        .unwrap();
    cat.wait().unwrap();
    assert!(out.status.success(), "lazy restore from a pipe: {}", String::from_utf8_lossy(&out.stderr));
    let rep: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert!(rep["lazy_pages"].as_u64().unwrap() > (32 << 20) / 4096 / 2, "{rep}");
    assert_eq!(w.sums(), before, "a process restored lazily from a pipe sees other memory");
    w.stop();
}

#[test]
fn the_pages_a_lazy_restore_saw_faulted_come_first_the_next_time() {
    let Some(_criu) = criu() else { return };
    let _g = serial();
    let tmp = tempfile::tempdir().unwrap();
    let arc = tmp.path().join("ws.czr");
    let (mut w, before) = dumped(Spec { mib: 256, pattern: "random", ..Default::default() }, &arc);

    // Read all memory while its pages still arrive: faults get recorded.
    let pidfile = tmp.path().join("restored.pid");
    let child = lazy_restore_until_running(&arc, &pidfile);
    assert_eq!(w.sums(), before, "first lazy restore");
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let touch = tmp.path().join("ws.czr.touch");
    let meta = std::fs::metadata(&touch).expect("a working set recorded beside the archive");
    assert_eq!(std::os::unix::fs::PermissionsExt::mode(&meta.permissions()) & 0o777, 0o600);
    let recorded = std::fs::read_to_string(&touch).unwrap().lines().count() - 1;
    assert!(recorded > 0, "no fault recorded");
    w.stop();
    wait_for("the restored process to be gone", std::time::Duration::from_secs(10), || {
        !Path::new(&format!("/proc/{}", w.pid)).exists()
    });

    let out = criuz(&["restore", "--lazy", "-d", "--json", "-i", arc.to_str().unwrap()]);
    assert!(out.status.success(), "second lazy restore: {}", String::from_utf8_lossy(&out.stderr));
    let rep: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(rep["working_set_pages"].as_u64().unwrap(), recorded as u64, "{rep}");
    let ws_in = rep["working_set_seconds"].as_f64().expect("the working set's arrival");
    assert!(ws_in <= rep["resident_seconds"].as_f64().unwrap(), "{rep}");
    assert_eq!(w.sums(), before, "a process restored with its working set first sees other memory");
    w.stop();
}

#[test]
fn an_eager_restore_placed_by_criuz_keeps_its_checksums() {
    let Some(_criu) = criu() else { return };
    let _g = serial();
    let tmp = tempfile::tempdir().unwrap();
    let arc = tmp.path().join("placed.czr");
    let (mut w, before) = dumped(Spec { mib: 48, pattern: "mixed", mode: "tree", ..Default::default() }, &arc);

    let out = criuz(&["restore", "--fill", "place", "-d", "--json", "-i", arc.to_str().unwrap()]);
    assert!(out.status.success(), "placed restore: {}", String::from_utf8_lossy(&out.stderr));
    let rep: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    // The memory came through criuz's copies, not through CRIU's images,
    // and the tree ran only once all of it was in.
    let placed = rep["lazy_pages"].as_u64().unwrap();
    assert!(placed > (48 << 20) / 4096 / 2, "{rep}");
    assert!(rep["eager_pages"].as_u64().unwrap() < placed / 10, "{rep}");
    assert!(rep["running_seconds"].as_f64().unwrap() >= rep["resident_seconds"].as_f64().unwrap(), "{rep}");
    // CRIU's part, then the fill: in that order, within the restore.
    let fill_started = rep["fill_started_seconds"].as_f64().unwrap();
    assert!(rep["criu_started_seconds"].as_f64().unwrap() < fill_started, "{rep}");
    assert!(fill_started < rep["running_seconds"].as_f64().unwrap(), "{rep}");
    assert!(!tmp.path().join("placed.czr.touch").exists(), "a placed restore records no working set");
    assert_eq!(w.sums(), before, "a process restored by placing its memory sees other memory");
    w.stop();
}

#[test]
fn a_crafted_block_kills_a_placed_restore_before_it_runs() {
    let Some(_criu) = criu() else { return };
    let _g = serial();
    let tmp = tempfile::tempdir().unwrap();
    let arc = tmp.path().join("one.czr");
    // Only the block's data check can tell, as the block is decoded.
    let w = dumped_with_a_crafted_block(&arc);

    let out = criuz(&["restore", "--fill", "place", "-d", "-i", arc.to_str().unwrap()]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(3), "{err}");
    assert!(err.contains("one.czr") && err.contains("data checksum") && err.contains("killed"), "{err}");
    // Held stopped, it is killed before it runs (by CRIU's own reaping if
    // CRIU was still finishing, else ours as subreaper).
    wait_for("the held tree to be gone", std::time::Duration::from_secs(10), || {
        // SAFETY: non-blocking reap of zombies re-parented to us.
        while unsafe { libc::waitpid(-1, std::ptr::null_mut(), libc::WNOHANG) } > 0 {}
        !w.alive()
    });
}

#[test]
fn without_detach_the_restored_tree_reads_its_zero_pages_once_all_are_in() {
    let Some(_criu) = criu() else { return };
    let _g = serial();
    let tmp = tempfile::tempdir().unwrap();
    let arc = tmp.path().join("attached.czr");
    // Mixed memory is half zero pages; runs of them are left out of the lazy
    // pagemap and read as zero once criuz lets go of the userfaultfds. Without
    // -d, criuz waits for the tree: the tree must not wait for criuz.
    for how in [&["--lazy"][..], &["--fill", "place"]] {
        let (mut w, before) = dumped(Spec { mib: 48, pattern: "mixed", ..Default::default() }, &arc);
        let restore = std::process::Command::new(CRIUZ)
            .args(["restore", "-i", arc.to_str().unwrap()])
            .args(how)
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        wait_for("the restored tree", std::time::Duration::from_secs(30), || w.alive());
        // Time for every page to come in, so the checksum reads the pages
        // left out after criuz is done (before, it would serve them).
        std::thread::sleep(std::time::Duration::from_secs(1));
        assert_eq!(w.sums(), before, "{how:?}: the attached restore sees other memory");
        w.stop();
        let out = restore.wait_with_output().unwrap();
        assert!(out.status.success(), "{how:?}: {}", String::from_utf8_lossy(&out.stderr));
        std::fs::remove_file(&arc).unwrap();
    }
}

/// A lazily restored process that dies while its pages still arrive (its
/// own crash, a kill) ends no restore in failure: criuz waiting for it in
/// the foreground exits as the process did (137 for a SIGKILL), and the
/// summary says it ended before its pages were all in, not "every page in".
#[test]
fn a_process_that_dies_while_its_pages_arrive_is_reported_as_it_ended() {
    let Some(_criu) = criu() else { return };
    let _g = serial();
    let tmp = tempfile::tempdir().unwrap();
    let arc = tmp.path().join("dies.czr");
    let pidfile = tmp.path().join("dies.pid");
    // Large enough that its fill outlasts the kill below by far (text on 2
    // cores fills at about 3 GB/s; the kill comes within milliseconds).
    let (w, _) = dumped(Spec { mib: 512, pattern: "text", ..Default::default() }, &arc);
    let restore = std::process::Command::new(CRIUZ)
        .args(["restore", "--lazy", "--json", "-i", arc.to_str().unwrap(), "--pidfile", pidfile.to_str().unwrap()])
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let t = std::time::Instant::now();
    while !pidfile.exists() && t.elapsed() < std::time::Duration::from_secs(60) {
        std::thread::sleep(std::time::Duration::from_micros(500));
    }
    // SAFETY: the restored workload of this test.
    unsafe { libc::kill(w.pid, libc::SIGKILL) };
    let out = restore.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(128 + libc::SIGKILL), "{err}");
    let rep: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(rep["ended_unfilled"], 1, "{rep}");
    assert!(rep["lazy_pages"].as_u64().unwrap() < (512 << 20) / 4096, "{rep}");
}

#[test]
fn a_restore_retried_right_after_a_failed_one_succeeds() {
    let Some(_criu) = criu() else { return };
    let _g = serial();
    let tmp = tempfile::tempdir().unwrap();
    let arc = tmp.path().join("good.czr");
    let bad = tmp.path().join("bad.czr");
    let (mut w, before) = dumped(Spec { mib: 16, pattern: "mixed", ..Default::default() }, &arc);
    // A page block damaged three quarters in: CRIU has forked the tree when
    // it is found, and CRIU leaves the tree's corpses behind. criuz, their
    // subreaper, reaps them before it returns, so the pids are free again.
    write_rotted(&arc, 1, &bad);
    let rounds: Vec<&[&str]> =
        std::iter::repeat_n(&[][..], 20).chain([&["--fill", "place"][..], &["--fill", "place"], &["--lazy"]]).collect();
    for (round, how) in rounds.into_iter().enumerate() {
        let out = criuz(&[&["restore", "-d", "-i", bad.to_str().unwrap()][..], how].concat());
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(3), "round {round} {how:?}: {err}");
        let out = criuz(&[&["restore", "-d", "-i", arc.to_str().unwrap()][..], how].concat());
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "round {round} {how:?}: the retry failed: {err}");
        assert_eq!(w.sums(), before, "round {round} {how:?}: restored memory differs");
        w.stop();
    }
}

/// A tree whose lazy restore is still copying its memory in is refused by a
/// dump: CRIU dumps only the pages a process has, so the archive lacked the
/// rest, and its restore read zeros there (a 2 GiB process dumped 0.8 s
/// into its lazy restore came back with 543 MiB and another checksum).
/// Once every page is in, it dumps and comes back whole.
#[test]
fn a_tree_still_being_restored_lazily_is_not_dumped() {
    let Some(_criu) = criu() else { return };
    let _g = serial();
    for _attempt in 0..3 {
        let tmp = tempfile::tempdir().unwrap();
        let arc = tmp.path().join("big.czr");
        let (mut w, before) = dumped(Spec { mib: BIG_MIB, pattern: "random", ..Default::default() }, &arc);
        let child = lazy_restore_until_running(&arc, &tmp.path().join("restored.pid"));
        // The fill held where it is.
        // SAFETY: signalling our own child.
        unsafe { libc::kill(child.id() as i32, libc::SIGSTOP) };
        let smaps = std::fs::read_to_string(format!("/proc/{}/smaps", w.pid)).unwrap();
        let arriving = smaps.lines().any(|l| l.starts_with("VmFlags:") && l.split_whitespace().any(|f| f == "um"));
        let again = tmp.path().join("again.czr");
        let out = criuz(&["dump", "-t", &w.pid.to_string(), "-o", again.to_str().unwrap()]);
        // SAFETY: as above.
        unsafe { libc::kill(child.id() as i32, libc::SIGCONT) };
        let restored = child.wait_with_output().unwrap();
        if !arriving {
            // Every page was in before the stop: this run proved nothing.
            assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
            w.reap_original();
            continue;
        }
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{err}");
        assert!(
            err.contains(&format!(
                "process {} of the tree has memory still arriving through a userfaultfd held outside it",
                w.pid
            )),
            "{err}"
        );
        assert!(!again.exists(), "no archive of the tree mid-fill");
        assert!(restored.status.success(), "the lazy restore: {}", String::from_utf8_lossy(&restored.stderr));
        assert_eq!(w.sums(), before, "the tree runs on, intact");
        dump(&w, &again);
        w.reap_original();
        let out = criuz(&["restore", "-d", "-i", again.to_str().unwrap()]);
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        assert_eq!(w.sums(), before, "dumped once every page was in, it comes back whole");
        return;
    }
    panic!("three lazy restores had every page in before criuz could be stopped");
}

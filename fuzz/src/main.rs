//! `criuz-fuzz`: runs structured mutations of seed archives through every
//! archive reader for a given time (see the library docs for the oracle).
//!
//! criuz-fuzz [--seconds N] [--seed S] [--corpus DIR]... [--crashes DIR]
//! criuz-fuzz --replay FILE...
//!
//! Exits 0 when no case failed; a failing case is saved to the crashes
//! directory with a note of what went wrong, for `fuzz/regressions/`. An
//! incremental archive `X.czr` comes with its parent as `X.parent.czr` (in a
//! corpus, in the crashes directory, for --replay).

use criuz_fuzz::{judge, mutate, records, reseal, run_readers, synthetic_seeds, Files, Reseal, Rng, Seed};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

static PANICKED: AtomicBool = AtomicBool::new(false);
/// A case that runs longer than this many watchdog ticks (about a second
/// each) is a hang. Ticks, not wall time: a fuzzer paused with SIGSTOP (to
/// keep a benchmark quiet) pauses its watchdog too.
const HANG_TICKS: u64 = 60;

struct Args {
    seconds: u64,
    seed: u64,
    corpus: Vec<PathBuf>,
    crashes: PathBuf,
    replay: Vec<PathBuf>,
}

fn parse_args() -> Result<Args, String> {
    let mut a = Args { seconds: 60, seed: 1, corpus: Vec::new(), crashes: "fuzz-crashes".into(), replay: Vec::new() };
    let mut it = std::env::args().skip(1);
    while let Some(arg) = it.next() {
        let mut val = || it.next().ok_or(format!("{arg} needs a value"));
        match arg.as_str() {
            "--seconds" => a.seconds = val()?.parse().map_err(|e| format!("--seconds: {e}"))?,
            "--seed" => a.seed = val()?.parse().map_err(|e| format!("--seed: {e}"))?,
            "--corpus" => a.corpus.push(val()?.into()),
            "--crashes" => a.crashes = val()?.into(),
            "--replay" => a.replay.extend(it.by_ref().map(PathBuf::from)),
            other => return Err(format!("unknown argument {other}")),
        }
    }
    Ok(a)
}

fn main() {
    let args = parse_args().unwrap_or_else(|e| {
        eprintln!("criuz-fuzz: {e}");
        std::process::exit(2)
    });
    let default_hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        PANICKED.store(true, Ordering::SeqCst);
        default_hook(info);
    }));
    if !args.replay.is_empty() {
        let mut bad = 0;
        for f in &args.replay {
            let bytes = std::fs::read(f).unwrap_or_else(|e| refuse(f, e, 2));
            let parent = parent_of(f);
            if let Err(why) = check_case(&bytes, parent.as_deref(), None) {
                eprintln!("{}: {why}", f.display());
                bad += 1;
            }
        }
        println!("replayed {} cases, {bad} failed", args.replay.len());
        std::process::exit(i32::from(bad > 0));
    }
    std::process::exit(fuzz(&args));
}

/// A file given on the command line that cannot be read, or the crashes
/// directory that cannot be made: one line naming it, and `status` (2: the
/// command line named what is not there; 1: the run could not proceed).
fn refuse(path: &Path, e: std::io::Error, status: i32) -> ! {
    eprintln!("criuz-fuzz: {}: {e}", path.display());
    std::process::exit(status)
}

/// `X.parent.czr` beside `X.czr`, if there is one.
fn parent_of(f: &Path) -> Option<PathBuf> {
    let stem = f.file_stem()?.to_string_lossy().into_owned();
    let p = f.with_file_name(format!("{stem}.parent.czr"));
    p.exists().then_some(p)
}

/// Runs the readers on one case, catching panics; returns why it failed.
fn check_case(bytes: &[u8], parent: Option<&Path>, original: Option<&Files>) -> Result<(), String> {
    PANICKED.store(false, Ordering::SeqCst);
    let outcome = std::panic::catch_unwind(|| run_readers(bytes, parent, bytes.len() % 16 == 0))
        .map_err(|_| "a reader panicked".to_string())?;
    if PANICKED.load(Ordering::SeqCst) {
        return Err("a reader thread panicked".into());
    }
    judge(&outcome, original)
}

fn fuzz(args: &Args) -> i32 {
    let mut seeds = synthetic_seeds();
    for dir in &args.corpus {
        for e in std::fs::read_dir(dir).unwrap_or_else(|e| refuse(dir, e, 2)).flatten() {
            let p = e.path();
            if p.extension().is_some_and(|x| x == "czr") && !p.to_string_lossy().ends_with(".parent.czr") {
                let parent_path = parent_of(&p);
                let bytes = std::fs::read(&p).unwrap_or_else(|e| refuse(&p, e, 2));
                // A seed is mutated from a good archive: one the readers refuse
                // as it is would be judged against nothing.
                if let Err(k) = run_readers(&bytes, parent_path.as_deref(), false).verify {
                    eprintln!(
                        "criuz-fuzz: {}: a seed must verify ({k:?}): a child needs its parent beside it as \
                         NAME.parent.czr, and the fuzzer holds no key for an encrypted archive",
                        p.display()
                    );
                    return 2;
                }
                let parent = parent_path.map(|pp| std::fs::read(&pp).unwrap_or_else(|e| refuse(&pp, e, 2)));
                seeds.push(Seed { bytes, parent });
            }
        }
    }
    let work = tempfile::tempdir().expect("temp dir");
    // Each seed's pristine parent on disk, and a place for a mutated one.
    let parents: Vec<Option<PathBuf>> = seeds
        .iter()
        .enumerate()
        .map(|(i, s)| {
            s.parent.as_ref().map(|p| {
                let path = work.path().join(format!("seed-{i}.parent.czr"));
                std::fs::write(&path, p).expect("parent");
                path
            })
        })
        .collect();
    let mutated_parent = work.path().join("case.parent.czr");
    let originals: Vec<Files> = seeds
        .iter()
        .zip(&parents)
        .map(|(s, p)| {
            // Every reader, both unpacks too, must agree on each seed as it
            // is: the mutants run the unpacks on one case in sixteen.
            let outcome = run_readers(&s.bytes, p.as_deref(), true);
            // A finding before any mutation: the readers disagree on a good
            // archive (the corpus seeds were checked to verify above).
            judge(&outcome, None).and(outcome.verify.map_err(|k| format!("it does not verify ({k:?})"))).unwrap_or_else(
                |why| {
                    eprintln!("criuz-fuzz: FAILED on a seed archive as it is: {why}");
                    std::process::exit(1)
                },
            )
        })
        .collect();
    std::fs::create_dir_all(&args.crashes).unwrap_or_else(|e| refuse(&args.crashes, e, 1));
    let current: Arc<std::sync::Mutex<Vec<u8>>> = Arc::default();
    // The number of the case running now (0: none).
    let running = Arc::new(AtomicU64::new(0));
    let t0 = Instant::now();
    {
        let (current, running, crashes) = (current.clone(), running.clone(), args.crashes.clone());
        std::thread::spawn(move || {
            let (mut seen, mut ticks) = (0, 0);
            loop {
                std::thread::sleep(Duration::from_secs(1));
                let now = running.load(Ordering::SeqCst);
                ticks = if now != 0 && now == seen { ticks + 1 } else { 0 };
                seen = now;
                if ticks > HANG_TICKS {
                    let path = crashes.join(format!("hang-{}.czr", std::process::id()));
                    let _ = std::fs::write(&path, &*current.lock().unwrap());
                    eprintln!("criuz-fuzz: a case ran over {HANG_TICKS} s; saved {}", path.display());
                    std::process::exit(3);
                }
            }
        });
    }
    let mut rng = Rng::new(args.seed);
    let (mut execs, mut failures, mut accepted) = (0u64, 0u64, 0u64);
    let mut by_mutation: std::collections::BTreeMap<&str, u64> = Default::default();
    let mut last_report = Instant::now();
    let deadline = Duration::from_secs(args.seconds);
    while t0.elapsed() < deadline {
        let i = rng.below(seeds.len());
        let other = &seeds[rng.below(seeds.len())].bytes;
        let mut case = seeds[i].bytes.clone();
        let mut parent = parents[i].clone();
        // Sometimes the child stays as it was and its parent is damaged.
        let target_parent = seeds[i].parent.is_some() && rng.below(4) == 0;
        let mut victim = if target_parent { seeds[i].parent.clone().expect("parent") } else { case.clone() };
        let mut names = Vec::new();
        for _ in 0..1 + rng.below(3) {
            names.push(mutate(&mut victim, other, &mut rng));
        }
        let how = [Reseal::None, Reseal::None, Reseal::Seals, Reseal::Index, Reseal::All][rng.below(5)];
        reseal(&mut victim, how);
        if target_parent {
            names.push("(in the parent)");
            std::fs::write(&mutated_parent, &victim).expect("parent");
            parent = Some(mutated_parent.clone());
        } else {
            case = victim;
        }
        for n in &names {
            *by_mutation.entry(n).or_default() += 1;
        }
        // A consistent re-sealed archive may differ from the seed, unless
        // it is encrypted: without the key, nothing can be made to differ.
        let sealed = seeds[i].bytes.len() >= 64 && seeds[i].bytes[10] & criuz::format::FLAG_SEALED as u8 != 0;
        let original = (how != Reseal::All || sealed).then_some(&originals[i]);
        *current.lock().unwrap() = case.clone();
        running.store(execs + 1, Ordering::SeqCst);
        let r = check_case(&case, parent.as_deref(), original);
        running.store(0, Ordering::SeqCst);
        execs += 1;
        if case != seeds[i].bytes && run_accepts(&case) {
            accepted += 1;
        }
        if let Err(why) = r {
            failures += 1;
            let path = args.crashes.join(format!("crash-{}-{execs}.czr", args.seed));
            std::fs::write(&path, &case).expect("save crash");
            if let Some(p) = &parent {
                std::fs::copy(p, args.crashes.join(format!("crash-{}-{execs}.parent.czr", args.seed))).expect("save");
            }
            let note = format!(
                "{why}\nmutations: {names:?}, reseal: {how:?}, seed archive {i}, records {}\n",
                records(&case).len()
            );
            std::fs::write(path.with_extension("txt"), &note).expect("save note");
            eprintln!("criuz-fuzz: FAILED case {execs}: {why} ({names:?}, {how:?}); saved {}", path.display());
        }
        if last_report.elapsed() > Duration::from_secs(60) {
            last_report = Instant::now();
            eprintln!("criuz-fuzz: {:.0}s, {execs} cases, {failures} failed", t0.elapsed().as_secs_f64());
        }
    }
    println!(
        "criuz-fuzz: {execs} cases in {:.0}s from {} seeds, {failures} failed, {accepted} mutants accepted (all as the original or a consistent re-sealed archive); mutations: {by_mutation:?}",
        t0.elapsed().as_secs_f64(),
        seeds.len()
    );
    i32::from(failures > 0)
}

/// Whether the block source accepts an archive (cheap: no decoding).
fn run_accepts(bytes: &[u8]) -> bool {
    criuz::archive::open(&criuz::io::Location::memory("x", bytes.to_vec()), &Default::default()).is_ok()
}

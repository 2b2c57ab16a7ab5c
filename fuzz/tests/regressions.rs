//! Archives the fuzzer found, kept as regression tests (`fuzz/regressions`,
//! each with a note of how it was found): every reader must reject each one
//! as damaged, and the readers must agree. Those found with a rule disabled
//! (a sabotaged build) prove that rule still holds. Also a short fuzz run, so
//! the harness itself keeps working.

use criuz_fuzz::{judge, mutate, reseal, run_readers, synthetic_seeds, Reseal, Rng};

#[test]
fn kept_cases_are_rejected_by_every_reader() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("regressions");
    let mut n = 0;
    for e in std::fs::read_dir(&dir).unwrap().flatten() {
        if e.path().extension().is_none_or(|x| x != "czr") || e.path().to_string_lossy().ends_with(".parent.czr") {
            continue;
        }
        let bytes = std::fs::read(e.path()).unwrap();
        let stem = e.path().file_stem().unwrap().to_string_lossy().into_owned();
        let parent = e.path().with_file_name(format!("{stem}.parent.czr"));
        let o = run_readers(&bytes, parent.exists().then_some(parent.as_path()), true);
        judge(&o, None).unwrap_or_else(|why| panic!("{}: {why}", e.path().display()));
        assert!(o.verify.is_err() && o.source.is_err(), "{} was accepted", e.path().display());
        n += 1;
    }
    assert!(n >= 10, "the regression cases are missing from {}", dir.display());
}

#[test]
fn a_short_fuzz_run_finds_nothing() {
    let seeds = synthetic_seeds();
    let dir = tempfile::tempdir().unwrap();
    let parents: Vec<Option<std::path::PathBuf>> = seeds
        .iter()
        .enumerate()
        .map(|(i, s)| {
            s.parent.as_ref().map(|p| {
                let path = dir.path().join(format!("{i}.parent.czr"));
                std::fs::write(&path, p).unwrap();
                path
            })
        })
        .collect();
    let originals: Vec<_> =
        seeds.iter().zip(&parents).map(|(s, p)| run_readers(&s.bytes, p.as_deref(), false).verify.unwrap()).collect();
    assert!(originals.iter().any(|f| !f.is_empty()));
    let mut rng = Rng::new(42);
    for _ in 0..2000 {
        let i = rng.below(seeds.len());
        let mut case = seeds[i].bytes.clone();
        mutate(&mut case, &seeds[rng.below(seeds.len())].bytes, &mut rng);
        let how = [Reseal::None, Reseal::Seals, Reseal::Index, Reseal::All][rng.below(4)];
        reseal(&mut case, how);
        let original = (how != Reseal::All).then_some(&originals[i]);
        judge(&run_readers(&case, parents[i].as_deref(), rng.below(16) == 0), original).unwrap();
    }
}

/// Each seed as it is, through every reader and both unpacks (into a
/// directory and as a tar): one seed's files interleave, as a dump's do,
/// and `unpack --tar` wrote their bytes under the wrong names.
#[test]
fn every_reader_agrees_on_every_seed() {
    let seeds = synthetic_seeds();
    let dir = tempfile::tempdir().unwrap();
    for (i, s) in seeds.iter().enumerate() {
        let parent = s.parent.as_ref().map(|p| {
            let path = dir.path().join(format!("{i}.parent.czr"));
            std::fs::write(&path, p).unwrap();
            path
        });
        let o = run_readers(&s.bytes, parent.as_deref(), true);
        judge(&o, None).unwrap_or_else(|why| panic!("seed {i}: {why}"));
        assert!(o.verify.is_ok() && o.tar.is_some_and(|t| t.is_ok()), "seed {i}");
    }
}

#[test]
fn the_seeds_hold_byte_planes_blocks() {
    let with_planes = synthetic_seeds()
        .iter()
        .filter_map(|s| criuz::offline::inspect(&s.bytes[..]).ok())
        .filter(|r| r.total.codecs.planes > 0)
        .count();
    // Written by the LZ4 and the zstd seeds alike (planes are zstd's).
    assert!(with_planes >= 2, "{with_planes} seeds hold byte-planes blocks");
}

/// Found by a five-minute fuzz run (session 48, "a damaged archive gave a
/// Usage error"): an encrypted seed whose K record names another key (its
/// key id rewritten, the record's seal recomputed). No reader here can open
/// it: the fuzzer holds the seeds' chain keys and no identity, so a reader
/// says what it says to a user without the identity ("give the identity",
/// exit 2), and to one with it, damage (the unwrapped key is not the one
/// the record names). Not kept as a file: the seeds' keys are new in every
/// process, so only a case made here names a key that is not this one's.
#[test]
fn a_key_record_naming_another_key_is_rejected() {
    let sealed = encrypted_seed(false);
    let case = naming_another_key(&sealed.bytes);
    let o = run_readers(&case, None, true);
    judge(&o, None).unwrap();
    assert!(o.verify.is_err() && o.source.is_err(), "an archive naming another key was read");
}

/// The same, in the parent of an intact encrypted child (seed 5451, case
/// 34061 of a 30-minute run, session 54: the oracle looked at the child's
/// K record alone and called the parent's "give the identity" a usage
/// error on damage).
#[test]
fn a_parent_whose_key_record_names_another_key_is_rejected() {
    let sealed = encrypted_seed(true);
    let parent = naming_another_key(sealed.parent.as_deref().expect("parent"));
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("parent.czr");
    std::fs::write(&path, &parent).unwrap();
    let o = run_readers(&sealed.bytes, Some(&path), true);
    judge(&o, None).unwrap();
    assert!(o.verify.is_err() && o.source.is_err(), "a child was read through a parent naming another key");
}

/// An encrypted synthetic seed, incremental (with its parent) or full.
fn encrypted_seed(incremental: bool) -> criuz_fuzz::Seed {
    synthetic_seeds()
        .into_iter()
        .find(|s| s.parent.is_some() == incremental && s.bytes[10] & criuz::format::FLAG_SEALED as u8 != 0)
        .expect("an encrypted seed of that kind")
}

/// `archive` with its K record naming another key, its seals recomputed.
fn naming_another_key(archive: &[u8]) -> Vec<u8> {
    let mut case = archive.to_vec();
    // The key id: bytes 8..24 of the K record, right after the 64-byte header.
    case[64 + 8] ^= 0x01;
    reseal(&mut case, Reseal::Seals);
    case
}

#[test]
fn a_corpus_or_case_that_is_not_there_is_named_in_one_line() {
    let d = tempfile::tempdir().unwrap();
    let missing = d.path().join("no-corpus");
    let crashes = d.path().join("crashes");
    let run = |args: &[&std::ffi::OsStr]| {
        std::process::Command::new(env!("CARGO_BIN_EXE_criuz-fuzz")).args(args).output().unwrap()
    };
    for out in [
        run(&[
            "--seconds".as_ref(),
            "1".as_ref(),
            "--corpus".as_ref(),
            missing.as_ref(),
            "--crashes".as_ref(),
            crashes.as_ref(),
        ]),
        run(&["--replay".as_ref(), missing.as_ref()]),
    ] {
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{err}");
        assert_eq!(err.trim(), format!("criuz-fuzz: {}: No such file or directory (os error 2)", missing.display()));
    }
}

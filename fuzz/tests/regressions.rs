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
        if e.path().extension().is_none_or(|x| x != "czr") {
            continue;
        }
        let bytes = std::fs::read(e.path()).unwrap();
        let o = run_readers(&bytes, true);
        judge(&o, None).unwrap_or_else(|why| panic!("{}: {why}", e.path().display()));
        assert!(o.verify.is_err() && o.source.is_err(), "{} was accepted", e.path().display());
        n += 1;
    }
    assert!(n >= 10, "the regression cases are missing from {}", dir.display());
}

#[test]
fn a_short_fuzz_run_finds_nothing() {
    let seeds = synthetic_seeds();
    let originals: Vec<_> = seeds.iter().map(|s| run_readers(s, false).verify.unwrap()).collect();
    let mut rng = Rng::new(42);
    for _ in 0..2000 {
        let i = rng.below(seeds.len());
        let mut case = seeds[i].clone();
        mutate(&mut case, &seeds[rng.below(seeds.len())], &mut rng);
        let how = [Reseal::None, Reseal::Seals, Reseal::Index, Reseal::All][rng.below(4)];
        reseal(&mut case, how);
        let original = (how != Reseal::All).then_some(&originals[i]);
        judge(&run_readers(&case, rng.below(16) == 0), original).unwrap();
    }
}

//! `criuz-faults`: the fault campaign (see `criuz_bench::faults`). Exits 0
//! when every invariant held, 1 when one broke (each is printed), 2 on a
//! usage error.

use clap::Parser;
use std::path::PathBuf;
use std::process::ExitCode;

#[derive(Parser)]
#[command(about = "Inject faults into every criuz path with real processes and real CRIU; check nothing is lost")]
struct Args {
    /// Faults to inject in all (CI's short form: 36; the long form: 320)
    #[arg(long, default_value_t = 36)]
    faults: usize,
    /// Size of each checkpointed process, MiB
    #[arg(long, default_value_t = 32)]
    mib: u64,
    /// Seed of the fault schedule (when and how much); default: from the clock
    #[arg(long)]
    seed: Option<u64>,
    /// Paths to attack, comma-separated (default: all)
    #[arg(long, value_delimiter = ',')]
    paths: Vec<String>,
    /// Faults to inject, comma-separated (kill-criuz, sigint-criuz,
    /// kill-criu, kill-s3, enospc, peer-dies, sigcont-tree; default: each path's all)
    #[arg(long, value_delimiter = ',')]
    kinds: Vec<String>,
    /// CRIU binary (default: as criuz finds it)
    #[arg(long)]
    criu: Option<PathBuf>,
    /// Write the report as JSON here
    #[arg(long)]
    json: Option<PathBuf>,
    /// Keep the work directory with every step's log
    #[arg(long)]
    keep: bool,
}

fn main() -> ExitCode {
    let a = Args::parse();
    let seed = a.seed.unwrap_or_else(|| {
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(1)
    });
    let plan = criuz_bench::faults::Plan {
        faults: a.faults,
        mib: a.mib,
        seed,
        routes: a.paths,
        kinds: a.kinds,
        criu: a.criu,
        json: a.json,
        keep: a.keep,
    };
    let report = match criuz_bench::faults::run(&plan) {
        Ok(r) => r,
        Err(e) => {
            eprintln!("criuz-faults: {e}");
            return ExitCode::from(e.exit_code() as u8);
        }
    };
    print!("{}", criuz_bench::faults::table(&report));
    if let Some(p) = &plan.json {
        if let Err(e) = criuz_bench::faults::write_json(&report, p) {
            eprintln!("criuz-faults: {e}");
            return ExitCode::FAILURE;
        }
    }
    if report.violations.is_empty() {
        ExitCode::SUCCESS
    } else {
        eprintln!("criuz-faults: {} invariant violations (listed above)", report.violations.len());
        ExitCode::FAILURE
    }
}

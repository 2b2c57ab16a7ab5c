//! The bench's modes that measure one thing each instead of the comparison
//! (`--aead`, `--gpu`, `--containers`, `--incremental`, `--lazy`,
//! `--codec-table`, `--load`): each runs its harness over the plan, prints
//! its table, writes its JSON where `--json` asked, and fails if a restore
//! it checked is not intact.

use crate::{write_table_json, BenchArgs, Plan};
use criuz_bench::config::{Config, Env};
use criuz_bench::error::{Error, Result};
use criuz_bench::report::Machine;
use criuz_bench::workload::{self, Tools};
use criuz_bench::{aead, codecs, containers, gpu, incremental, lazy, load, output};
use std::path::Path;

/// Where a table mode's figures go: printed, and with `--json`, written
/// with the machine, the size and the runs.
pub(crate) struct Table<'a> {
    pub json: Option<&'a Path>,
    pub machine: &'a Machine,
    pub plan: &'a Plan,
}

impl Table<'_> {
    /// Prints `text` and writes `rows` (an object whose fields are added to
    /// the document) where `--json` asked.
    fn out(&self, text: &str, rows: serde_json::Value) -> Result<()> {
        print!("{text}");
        write_table_json(self.json, self.machine, self.plan, rows)
    }
}

/// `--aead`: no CRIU, no processes.
pub(crate) fn aead_table(json: Option<&Path>) -> Result<()> {
    let rows = aead::rows();
    print!("{}", aead::table(&rows));
    if let Some(path) = json {
        let doc = serde_json::json!({ "aead": rows });
        let text = serde_json::to_string_pretty(&doc).map_err(|e| Error::Invalid(e.to_string()))?;
        output::write(path, &(text + "\n"))?;
    }
    Ok(())
}

/// `--gpu`: criu-dir, criuz-lz4 and criuz-zstd (those `--configs` names)
/// over a CUDA process.
pub(crate) fn gpu_table(
    args: &BenchArgs,
    table: &Table,
    work: &Path,
    criu: &criuz::criu::Criu,
    criuz: &Path,
) -> Result<()> {
    let known = ["criu-dir", "criuz-lz4", "criuz-zstd"];
    let configs: Vec<&str> = match &args.configs {
        None => known.to_vec(),
        Some(_) => known.iter().copied().filter(|k| table.plan.configs.iter().any(|c| c.name() == *k)).collect(),
    };
    if let Some(why) = gpu::unavailable() {
        println!("criuz-bench --gpu: skipped, no GPU to measure here: {why}");
        return Ok(());
    }
    let gpu_plan = gpu::GpuPlan {
        weights_gib: args.gpu_weights,
        kv_gib: args.gpu_kv,
        kv_fill: args.gpu_kv_fill,
        no_ids: args.gpu_no_ids,
        no_planes: args.gpu_no_planes,
        eager_only: args.gpu_eager_only,
    };
    let rows = gpu::measure(&configs, gpu_plan, table.plan.runs, args.cold, work, criu, criuz)?;
    table.out(&gpu::table(&rows), serde_json::json!({ "gpu": rows, "app": gpu_plan }))?;
    if rows.iter().any(|r| !r.intact) {
        return Err(Error::Invalid("a GPU restore is not intact".into()));
    }
    Ok(())
}

/// `--containers`: a workload in a runc container, at each size.
pub(crate) fn containers_table(
    args: &BenchArgs,
    table: &Table,
    work: &Path,
    workload_bin: &Path,
    criuz: &Path,
    criu: &Path,
) -> Result<()> {
    let sizes = match args.size {
        Some(s) => vec![s],
        None if args.quick => vec![32],
        None => vec![256, 1024],
    };
    // `mixed` unless asked.
    let kinds = args.workloads.clone().unwrap_or_else(|| vec!["mixed".into()]);
    if let Some(k) = kinds.iter().find(|k| !containers::WORKLOADS.contains(&k.as_str())) {
        return Err(Error::Usage(format!(
            "--containers runs {} in a container, not {k}",
            containers::WORKLOADS.join(" or ")
        )));
    }
    let mut rows = Vec::new();
    for kind in &kinds {
        for &mib in &sizes {
            let r = containers::measure(kind, mib, table.plan.runs, work, workload_bin, criuz, criu)?;
            if r.iter().any(|r| !r.intact) {
                return Err(Error::Invalid(format!("{kind}, {mib} MiB: a container restore is not intact")));
            }
            rows.extend(r);
        }
    }
    table.out(&containers::table(&rows), serde_json::json!({ "containers": rows }))
}

/// `--incremental`: children after a share of each workload changed, and a
/// chain of ten generations (where `mixed` is measured).
pub(crate) fn incremental_table(
    args: &BenchArgs,
    table: &Table,
    work: &Path,
    tools: &Tools,
    criuz: &Path,
) -> Result<()> {
    let plan = table.plan;
    let mut rows = Vec::new();
    for w in &plan.workloads {
        let default: &[f64] = if workload::PATTERNS.contains(&w.as_str()) { &[1.0, 5.0, 25.0] } else { &[5.0] };
        let shares = args.shares.as_deref().unwrap_or(default);
        for &p in shares.iter().filter(|&&p| p > 0.0) {
            eprintln!("bench: incremental: {w}, {p}% rewritten, {} MiB", plan.mib);
            let row = incremental::measure(w, p, plan.mib, plan.runs, work, tools, criuz)?;
            if !row.intact {
                return Err(Error::Invalid(format!("{w}: the restored child is not intact")));
            }
            rows.push(row);
        }
    }
    let mut chains = Vec::new();
    if plan.workloads.iter().any(|w| w == "mixed") {
        eprintln!("bench: incremental: chain of 10 x 5% (mixed), {} MiB", plan.mib);
        let c = incremental::chain("mixed", (10, 5.0), plan.mib, plan.runs, work, tools, criuz)?;
        if !c.intact {
            return Err(Error::Invalid("the chain restore is not intact".into()));
        }
        chains.push(c);
    }
    table.out(&incremental::table(&rows, &chains), serde_json::json!({ "incremental": rows, "chains": chains }))
}

/// `--lazy`: lazy against plain restores of each workload, per codec.
pub(crate) fn lazy_table(
    args: &BenchArgs,
    table: &Table,
    work: &Path,
    tools: &Tools,
    criuz: &Path,
    criu: &Path,
) -> Result<()> {
    let plan = table.plan;
    // The dump's codec: criuz-zstd among --configs adds zstd rows; LZ4
    // (the default) unless --configs leaves it out.
    let codecs: Vec<&str> = match &args.configs {
        None => vec!["lz4"],
        Some(_) => [(Config::CriuzLz4, "lz4"), (Config::CriuzZstd, "zstd")]
            .into_iter()
            .filter(|(c, _)| plan.configs.contains(c))
            .map(|(_, codec)| codec)
            .collect(),
    };
    if codecs.is_empty() {
        return Err(Error::Usage("--lazy measures criuz-lz4 and criuz-zstd; --configs names neither".into()));
    }
    let mut rows = Vec::new();
    for w in &plan.workloads {
        for codec in &codecs {
            eprintln!("bench: lazy: {w}, {codec}, {} MiB", plan.mib);
            let shape = lazy::Shape {
                workload: w,
                codec,
                mib: plan.mib,
                runs: plan.runs,
                cold: args.cold,
                verify_first: args.verify_first,
            };
            let row = lazy::measure(&shape, work, tools, criuz, criu)?;
            if !row.intact {
                return Err(Error::Invalid(format!("{w}: a restore is not intact")));
            }
            rows.push(row);
        }
    }
    table.out(&lazy::table(&rows), serde_json::json!({ "lazy": rows }))
}

/// `--codec-table`: size and throughput per memory pattern and codec.
pub(crate) fn codec_table(
    table: &Table,
    work: &Path,
    tools: &Tools,
    criu: &criuz::criu::Criu,
    criuz: &Path,
) -> Result<()> {
    let plan = table.plan;
    let mut rows = Vec::new();
    for w in plan.workloads.iter().filter(|w| workload::PATTERNS.contains(&w.as_str())) {
        eprintln!("bench: codec table: {w}, {} MiB", plan.mib);
        rows.extend(codecs::measure(w, plan.mib, plan.runs, work, tools, criu, criuz)?);
    }
    table.out(&codecs::table(&rows), serde_json::json!({ "codec_table": rows }))
}

/// `--load N`: an eviction wave of N processes of each workload.
pub(crate) fn load_table(n: usize, table: &Table, work: &Path, tools: &Tools, env: &Env) -> Result<()> {
    let plan = table.plan;
    let mut rows = Vec::new();
    for w in &plan.workloads {
        eprintln!("bench: load: {n} x {w}, {} MiB", plan.mib);
        let row = load::measure(w, n, plan.mib, work, tools, env)?;
        if !row.intact {
            return Err(Error::Invalid(format!("{w}: a restore under load is not intact")));
        }
        rows.push(row);
    }
    table.out(&load::table(&rows), serde_json::json!({ "load": rows }))
}

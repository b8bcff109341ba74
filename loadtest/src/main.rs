//! `cargo run --release -p loadtest -- <benchmark>`: benchmarks of traffic-policy-operator
//! on the real local control plane. Results go to stdout as a table and to a JSON file.

mod args;
mod at_rest;
mod balance;
mod cache_bytes;
mod chart;
mod cluster;
mod compare;
mod deploy;
mod fencing_cost;
mod gateway;
mod handoff;
mod interrupt;
mod ownership_cost;
mod replicas;
mod run;
mod sample;
mod server_load;
mod workload;

use clap::{Parser, Subcommand};

#[global_allocator]
static ALLOCATOR: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

#[derive(Parser)]
#[command(about = "Benchmarks of traffic-policy-operator on a real local control plane")]
struct Cli {
    #[command(subcommand)]
    benchmark: Benchmark,
}

#[derive(Subcommand)]
enum Benchmark {
    /// Heap bytes per cached ApplicationTrafficPolicy: whole, trimmed, and in the compact form
    /// the operator keeps, measured side by side on the same objects read from the API server.
    CacheBytes(cache_bytes::Args),
    /// The per-write cost of the fencing ValidatingAdmissionPolicy, with and without it.
    FencingCost(fencing_cost::Args),
    /// The per-reconcile cost of the sharding layer's ownership checks.
    OwnershipCost(ownership_cost::Args),
    /// Create policies and measure convergence by the operator (or the API write floor).
    Run(Box<args::Args>),
    /// The write floor, the operator and its peers on the same policies, with the ratios.
    Compare(compare::Args),
}

#[tokio::main]
async fn main() {
    let result = match Cli::parse().benchmark {
        Benchmark::CacheBytes(args) => cache_bytes::run(args).await,
        Benchmark::FencingCost(args) => fencing_cost::run(args).await,
        Benchmark::OwnershipCost(args) => ownership_cost::run(args).await,
        Benchmark::Run(args) => run_and_report(*args).await,
        Benchmark::Compare(args) => compare::run(args).await,
    };
    if let Err(error) = result {
        eprintln!("loadtest: {error:#}");
        std::process::exit(1);
    }
}

async fn run_and_report(args: args::Args) -> anyhow::Result<()> {
    let out = args.out.clone();
    // A bad SLO file fails before any object is created.
    let slo = args.slo.as_deref().map(cluster::Slo::read).transpose()?;
    let result = run::run(args).await?;
    print!("{}", run::summary(&result));
    if let Some(dir) = out.parent() {
        std::fs::create_dir_all(dir)?;
    }
    std::fs::write(&out, serde_json::to_string_pretty(&result)?)?;
    eprintln!("wrote {}", out.display());
    if let Some(timeout) = result["timeout"].as_str() {
        anyhow::bail!("{timeout}");
    }
    let Some(slo) = slo else { return Ok(()) };
    let verdicts = slo.judge(&result);
    for (met, what) in &verdicts {
        println!("SLO {}: {what}", if *met { "met" } else { "MISSED" });
    }
    let missed = verdicts.iter().filter(|(met, _)| !met).count();
    anyhow::ensure!(missed == 0, "{missed} of {} SLO thresholds missed", verdicts.len());
    Ok(())
}

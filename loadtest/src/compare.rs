//! `loadtest compare`: the same policies, one mode after another in one invocation, each on
//! a fresh control plane: the API write floor, the operator (one replica, then three) in
//! shard-selector and in label mode, the controller-runtime peer and the kube-rs peers (plain,
//! and with a trimmed cache). Prints the ratios that count, each against its target
//! (issue 11's, set for 20k policies) with a pass or fail.

use std::path::PathBuf;

use serde_json::{Value, json};

use crate::run::{self, Mode, Sharding};

#[derive(clap::Args)]
pub struct Args {
    #[arg(long, default_value_t = 5000)]
    objects: usize,
    #[arg(long, default_value_t = 100)]
    namespaces: usize,
    /// Workers per operator replica.
    #[arg(long, default_value_t = 8)]
    workers: u16,
    #[arg(long, default_value = "target/loadtest/compare.json")]
    out: PathBuf,
}

pub async fn run(args: Args) -> anyhow::Result<()> {
    use Sharding::{Labels, ShardSelector};
    let plan = [
        ("floor", Mode::Floor, 1, ShardSelector),
        ("operator x1", Mode::Operator, 1, ShardSelector),
        ("operator x1 labels", Mode::Operator, 1, Labels),
        ("controller-runtime", Mode::ControllerRuntime, 1, ShardSelector),
        ("kube-rs Controller", Mode::KubeRs, 1, ShardSelector),
        ("kube-rs Controller, trimmed", Mode::KubeRsTrimmed, 1, ShardSelector),
        ("operator x3", Mode::Operator, 3, ShardSelector),
        ("operator x3 labels", Mode::Operator, 3, Labels),
    ];
    let mut results: Vec<(&str, Value)> = Vec::new();
    for (label, mode, replicas, sharding) in plan {
        eprintln!("== {label}");
        let run_args = run::Args {
            objects: args.objects,
            sharding,
            namespaces: args.namespaces,
            zipf: None,
            mode,
            replicas,
            workers: args.workers,
            concurrency: 64,
            update_fraction: 0.0,
            kill_after: None,
            preload: false,
            edits: 0,
            at_rest: false,
            handoff: false,
            resync_seconds: None,
            delete: false,
            idle_seconds: 0,
            operator_binary: None,
            timeout_seconds: 1800,
            out: args.out.with_file_name(format!("compare-{}.json", label.replace(' ', "-"))),
            kubeconfig: None,
            operator_namespace: "traffic-policy-operator".into(),
            slo: None,
            namespace_prefix: "load-".into(),
            run_label: None,
        };
        let result = run::run(run_args).await?;
        eprint!("{}", run::summary(&result));
        results.push((label, result));
    }

    let get = |label: &str| &results.iter().find(|(l, _)| *l == label).expect("ran").1;
    let seconds = |r: &Value| r["convergence_seconds"].as_f64().unwrap_or(f64::NAN);
    let cpu = |r: &Value| {
        r["replica_stats"].as_array().map_or(0.0, |a| a.iter().map(|s| s["cpu_seconds"].as_f64().unwrap_or(0.0)).sum())
    };
    let peak = |r: &Value| {
        r["replica_stats"]
            .as_array()
            .map_or(0.0, |a| a.iter().map(|s| s["peak_rss_bytes"].as_f64().unwrap_or(0.0)).fold(0.0, f64::max))
    };
    println!("| run | converged in | CPU-seconds | peak RSS per process | p50 / p99 latency |");
    println!("|---|---|---|---|---|");
    for (label, r) in &results {
        // The floor has no controller process to measure.
        let has_process = r["replica_stats"].as_array().is_some_and(|a| !a.is_empty());
        let (cpu, peak) = match has_process {
            true => (format!("{:.1}", cpu(r)), format!("{:.1} MiB", peak(r) / 1048576.0)),
            false => ("–".to_string(), "–".to_string()),
        };
        println!(
            "| {label} | {:.1} s | {cpu} | {peak} | {:.0} / {:.0} ms |",
            seconds(r),
            r["latency_ms"]["p50"].as_f64().unwrap_or_default(),
            r["latency_ms"]["p99"].as_f64().unwrap_or_default()
        );
    }
    let ours = get("operator x1");
    let three = get("operator x3");
    let floor = seconds(get("floor"));
    let mut ratios = json!({});
    println!();
    println!("| ratio | value | target | |");
    println!("|---|---|---|---|");
    let mut report = |key: String, what: String, value: f64, target: Option<f64>| {
        let verdict = target.map_or("", |t| if value <= t { "pass" } else { "fail" });
        let target = target.map_or(String::new(), |t| format!("≤ {t}"));
        println!("| {what} | {value:.2} | {target} | {verdict} |");
        ratios[key] = json!(value);
    };
    for (label, target) in
        [("operator x1", 1.2), ("operator x1 labels", 1.5), ("operator x3", 1.2), ("operator x3 labels", 1.5)]
    {
        let key = format!("{}_convergence_over_floor", label.replace(' ', "_"));
        report(key, format!("{label} convergence / write floor"), seconds(get(label)) / floor, Some(target));
    }
    for (peer, target) in
        [("controller-runtime", Some(0.5)), ("kube-rs Controller", None), ("kube-rs Controller, trimmed", None)]
    {
        let p = get(peer);
        let key = |what: &str| format!("{}_{what}", peer.replace([' ', ','], "_"));
        report(key("cpu"), format!("operator / {peer}: CPU-seconds"), cpu(ours) / cpu(p), target);
        report(key("peak_rss"), format!("operator / {peer}: peak RSS"), peak(ours) / peak(p), target);
        report(key("convergence"), format!("operator / {peer}: convergence time"), seconds(ours) / seconds(p), None);
    }
    report(
        "three_replica_rss_ratio".into(),
        "largest replica's peak RSS, 3 replicas / 1 replica".into(),
        peak(three) / peak(ours),
        Some(0.4),
    );

    if let Some(dir) = args.out.parent() {
        std::fs::create_dir_all(dir)?;
    }
    let all: Vec<Value> = results
        .into_iter()
        .map(|(label, mut r)| {
            r["label"] = json!(label);
            r
        })
        .collect();
    std::fs::write(&args.out, serde_json::to_string_pretty(&json!({ "ratios": ratios, "runs": all }))?)?;
    eprintln!("wrote {}", args.out.display());
    Ok(())
}

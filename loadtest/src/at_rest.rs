//! `loadtest run --at-rest`: what the operator writes when nothing changed, counted by the
//! API server itself (`apiserver_request_total`, which counts an apply that changes nothing
//! too). Two phases after convergence:
//! - a forced resync: every replica runs with a short `--resync-period`, and the phase lasts
//!   until every policy has been reconciled again;
//! - a rolling restart: each replica in turn gets SIGTERM and starts again, as a StatefulSet
//!   rollout does, and the phase lasts until the last one's queue is empty.

use std::time::{Duration, Instant};

use kube::Client;
use serde_json::json;

use crate::args::Args;
use crate::replicas::{Replica, Watched, start_replica};
use crate::sample::{self, label};

/// Child applies and status writes the API server has counted so far.
#[derive(Clone, Copy, Debug, Default)]
struct Writes {
    child_applies: f64,
    status_writes: f64,
}

impl Writes {
    fn since(self, earlier: Writes) -> Writes {
        Writes {
            child_applies: self.child_applies - earlier.child_applies,
            status_writes: self.status_writes - earlier.status_writes,
        }
    }

    fn report(self, objects: usize) -> serde_json::Value {
        let per_policy = (self.child_applies + self.status_writes) / objects as f64;
        json!({ "child_applies": self.child_applies, "status_writes": self.status_writes, "writes_per_policy": per_policy })
    }
}

/// Reads the counters from kube-apiserver's /metrics.
async fn writes(client: &Client) -> anyhow::Result<Writes> {
    let text = sample::apiserver_metrics(client).await?;
    let requests = |keep: &dyn Fn(&str, &str, &str) -> bool| {
        sample::metric_where(&text, "apiserver_request_total", |l| {
            keep(label(l, "verb"), label(l, "resource"), label(l, "subresource"))
        })
    };
    Ok(Writes {
        child_applies: requests(&|verb, resource, _| {
            verb == "APPLY" && matches!(resource, "configmaps" | "networkpolicies")
        }),
        status_writes: requests(&|verb, resource, sub| {
            verb == "PATCH" && resource == "applicationtrafficpolicies" && sub == "status"
        }),
    })
}

fn replica_metric(replica: &Replica, name: &str) -> f64 {
    let exposition = controlplane::http_get_plain(replica.metrics_port, "/metrics").unwrap_or_default();
    sample::policy_controllers_metric(&exposition, name)
}

fn reconciles(replicas: &[Replica]) -> f64 {
    replicas.iter().map(|r| replica_metric(r, "controller_runtime_reconcile_total")).sum()
}

/// Polls `done` every 200 ms for up to `timeout`.
async fn until(what: &str, timeout: Duration, mut done: impl FnMut() -> bool) -> anyhow::Result<()> {
    let deadline = Instant::now() + timeout;
    while !done() {
        anyhow::ensure!(Instant::now() < deadline, "timed out waiting until {what}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    Ok(())
}

pub async fn measure(
    cp: &controlplane::ControlPlane,
    client: &Client,
    args: &Args,
    replicas: &mut [Replica],
    pids: &Watched,
) -> anyhow::Result<serde_json::Value> {
    let timeout = Duration::from_secs(args.timeout_seconds);
    let period = args.resync_seconds.expect("--at-rest sets a resync period");
    // Resync: every policy reconciled once more (the resync is jittered by up to 10%).
    let before = writes(client).await?;
    let started = reconciles(replicas);
    eprintln!("at rest: waiting for a full resync (period {period} s)...");
    until("every policy is reconciled again", timeout, || reconciles(replicas) >= started + args.objects as f64)
        .await?;
    let resync = writes(client).await?.since(before);
    eprintln!("at rest: resync: {resync:?}");

    // Rolling restart, last replica first (as a StatefulSet does).
    let before = writes(client).await?;
    for i in (0..replicas.len()).rev() {
        let name = replicas[i].name.clone();
        eprintln!("at rest: restarting {name}...");
        let status = replicas[i].process.stop(Duration::from_secs(30));
        anyhow::ensure!(status.is_some_and(|s| s.success()), "{name} did not exit 0 on SIGTERM: {status:?}");
        replicas[i] = start_replica(cp, args, &name).await?;
        pids.lock().unwrap()[i].1 = replicas[i].process.pid();
        pids.lock().unwrap()[i].2 = replicas[i].metrics_port;
    }
    // Settled: every policy is cached by some replica, each has been reconciled since, and no queue holds work.
    until("the restarted replicas cache every policy", timeout, || {
        replicas.iter().map(|r| replica_metric(r, "traffic_policy_cached_objects")).sum::<f64>() as usize
            == args.objects
    })
    .await?;
    until("the restarted replicas reconciled every policy", timeout, || reconciles(replicas) >= args.objects as f64)
        .await?;
    until("every queue is empty", timeout, || replicas.iter().all(|r| replica_metric(r, "workqueue_depth") == 0.0))
        .await?;
    let restart = writes(client).await?.since(before);
    eprintln!("at rest: rolling restart: {restart:?}");
    Ok(json!({
        "resync_period_seconds": period,
        "resync": resync.report(args.objects),
        "rolling_restart": restart.report(args.objects),
    }))
}

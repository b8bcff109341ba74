//! The sharding protocol against the real control plane. Replicas are separate processes of
//! the real binary, each under its own service account, so kube-apiserver's audit log tells
//! them apart; safety is judged from what the server received (see `server`), and from the
//! replicas' own audit logs for timings.
//!
//! One scenario per test. They run one at a time (every fleet watches every namespace) and
//! each starts its own fleet in its own operator namespace, with its own policies.

mod audit;
mod capacity;
#[path = "../common/mod.rs"]
mod common;
mod faults;
mod fleet;
mod gateway_timeout;
mod grants;
mod handoff;
mod membership;
mod modes;
mod ranges;
mod server;
mod trust;

use std::collections::BTreeSet;
use std::time::Duration;

use fleet::{Fleet, lease_duration, now_ns};
use tokio::sync::Mutex;

/// Scenarios take turns.
pub static SERIAL: Mutex<()> = Mutex::const_new(());

/// Seconds from `t0` until a replica other than `victim` first started reconciling an
/// object in one of the buckets `victim` owned at `t0`; `None` while none has.
fn takeover_seconds(entries: &[audit::Entry], victim: &str, t0: u128) -> Option<f64> {
    let buckets = audit::ownership_changes(entries)
        .into_iter()
        .rfind(|(t, r, _)| r == victim && *t < t0)
        .map(|(_, _, b)| b)
        .unwrap_or_default();
    let first = entries.iter().find(|e| {
        e.t > t0
            && e.event == "reconcile_start"
            && e.replica != victim
            && e.detail.parse::<u16>().is_ok_and(|b| buckets.contains(&b))
    })?;
    Some((first.t - t0) as f64 / 1e9)
}

/// How soon, in seconds, another replica must reconcile in the buckets of one killed with
/// `kill -9`: its Lease expires, and a handoff follows.
fn kill_takeover_bound() -> f64 {
    (lease_duration() + Duration::from_secs(3)).as_secs_f64()
}

/// Waits until another replica has taken over `victim`'s buckets. Before `victim` starts
/// again: a new process of the same name would rejoin at the same place on the ring and
/// could get its buckets back first, with long leases.
async fn taken_over(fleet: &Fleet, victim: &str, t0: u128) {
    common::eventually(&format!("another replica reconciles in {victim}'s buckets"), || async {
        takeover_seconds(&fleet.audit(), victim, t0)
    })
    .await;
}

/// Replica-side check: no object was reconciled by two processes at once.
fn assert_no_overlapping_reconciles(fleet: &Fleet, forced_ends: &[(u128, String)]) -> usize {
    let entries = fleet.audit();
    let intervals = audit::reconcile_intervals(&entries, forced_ends, now_ns());
    let overlaps = audit::overlaps(&intervals);
    assert!(
        overlaps.is_empty(),
        "two processes reconciled one object at once: {:?}",
        &overlaps[..overlaps.len().min(5)]
    );
    intervals.len()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scaling_and_takeover_after_kill_and_sigterm() {
    let _turn = SERIAL.lock().await;
    let mut fleet = Fleet::new("scale", 40).await;
    for name in ["r-0", "r-1", "r-2"] {
        fleet.start(name).await;
    }
    assert_eq!(fleet.converged("the initial creation").await, fleet.total());
    println!("three replicas, (buckets owned, objects cached): {:?}", fleet.balanced().await);
    let (stop_churn, churner) = fleet.churn();

    fleet.start("r-3").await;
    fleet.start("r-4").await;
    fleet.converged("scaling to 5").await;
    println!("five replicas: {:?}", fleet.balanced().await);
    for name in ["r-2", "r-3", "r-4"] {
        fleet.terminate(name);
    }
    fleet.converged("scaling to 2").await;
    fleet.start("r-2").await;
    fleet.balanced().await;

    let t_kill = fleet.kill("r-0");
    taken_over(&fleet, "r-0", t_kill).await;
    fleet.converged("kill -9").await;
    fleet.start("r-0").await;
    fleet.balanced().await;
    let t_term = fleet.terminate("r-1");
    taken_over(&fleet, "r-1", t_term).await;
    fleet.converged("SIGTERM").await;
    fleet.start("r-1").await;
    fleet.balanced().await;

    stop_churn.store(true, std::sync::atomic::Ordering::Relaxed);
    let changes = churner.await.unwrap();
    fleet.converged("the last change").await;
    let entries = fleet.audit();
    let kill_takeover = takeover_seconds(&entries, "r-0", t_kill).expect("taken over");
    let term_takeover = takeover_seconds(&entries, "r-1", t_term).expect("taken over");
    let reconciles = assert_no_overlapping_reconciles(&fleet, &[(t_kill, "r-0".into())]);
    let verdict = fleet.finish().await;
    println!(
        "sharding summary: lease timings {:?}; takeover after kill -9 {kill_takeover:.2} s, after SIGTERM {term_takeover:.2} s; \
         {changes} spec changes, {reconciles} reconciles, {} writes seen by the server, {} overlapping, {} fenced",
        crate::common::lease_timings(),
        verdict.writes,
        verdict.overlapping.len(),
        verdict.fenced
    );
    assert_eq!(verdict.fenced, 0, "the timing layer let a late write reach the fencing policy");
    let kill_bound = kill_takeover_bound();
    assert!(kill_takeover <= kill_bound, "takeover after kill -9 took {kill_takeover:.2} s (bound {kill_bound} s)");
    assert!(term_takeover <= 3.0, "takeover after SIGTERM took {term_takeover:.2} s (bound 3 s)");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn freezes_across_the_lease_boundary_never_overlap() {
    let _turn = SERIAL.lock().await;
    // Below, at and beyond the renew deadline and the lease duration.
    let verdict = freeze_sweep("freeze", 30, &[0.5, 1.0, 1.5, 2.0]).await;
    assert_eq!(verdict.fenced, 0, "the timing layer let a late write reach the fencing policy");
}

/// The same sweep with the fencing policy's binding removed: the timing layer holds alone,
/// judged by the grants each accepted write came after (see `grants`). Smaller, at the
/// freezes that cross the lease boundary: the sweep above already shows that nothing
/// reached the fencing policy, so this one only confirms it without the policy there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn freezes_across_the_lease_boundary_never_overlap_without_fencing() {
    let _turn = SERIAL.lock().await;
    let unfenced = common::Unfenced::remove().await;
    freeze_sweep("freeze-unfenced", 10, &[1.0, 1.5]).await;
    unfenced.restore().await;
}

/// Freezes one of three replicas (SIGSTOP) for each of `fractions` of a lease duration in
/// turn, under spec churn over `namespaces` × 5 policies.
async fn freeze_sweep(scenario: &str, namespaces: usize, fractions: &[f64]) -> server::Verdict {
    let mut fleet = Fleet::new(scenario, namespaces).await;
    for name in ["r-0", "r-1", "r-2"] {
        fleet.start(name).await;
    }
    fleet.converged("the initial creation").await;
    let (stop_churn, churner) = fleet.churn();
    for &fraction in fractions {
        let length = lease_duration().mul_f64(fraction);
        let frozen = &fleet.replicas["r-2"];
        frozen.process.signal(libc::SIGSTOP);
        tokio::time::sleep(length).await; // the fault itself lasts this long
        frozen.process.signal(libc::SIGCONT);
        fleet.converged(&format!("a {length:?} freeze")).await;
        fleet.balanced().await;
    }
    stop_churn.store(true, std::sync::atomic::Ordering::Relaxed);
    let changes = churner.await.unwrap();
    fleet.converged("the last change").await;
    let verdict = fleet.finish().await;
    println!(
        "sharding summary: {scenario}: freezes of {fractions:?} lease durations under {changes} spec changes: \
         {} writes seen by the server, {} overlapping, {} after a grant to another, {} fenced",
        verdict.writes,
        verdict.overlapping.len(),
        verdict.after_grant.len(),
        verdict.fenced
    );
    verdict
}

/// The users (processes) that wrote, from the server's audit log, among `candidates`.
fn writers(fleet: &Fleet, candidates: &[String]) -> BTreeSet<String> {
    let users: BTreeSet<String> = candidates.iter().cloned().collect();
    server::writes(&fleet.env.cp.audit_log_path(), &users).into_iter().map(|w| w.user).collect()
}

//! The assignment protocol, model-checked exhaustively with stateright on the operator's own
//! decision functions: the leader's `starting_point`, `planning::plan` and `may_reassign`,
//! the view's `Published::after_read`, the member's `Slice` and the leader's `MemberTable`.
//! Only the plumbing between them (who reads what when, a server that stores the assignment
//! with a resourceVersion precondition and accepts writes) is written here (protocol.rs).
//!
//! Time is real time in milliseconds; each process reads its own clock (clock.rs). Lease
//! duration 4 s and renew deadline 3 s, as the suites run. Every running process acts at
//! least once a second (a second waits for them), in any order with the others. Two members;
//! one bucket, the first the ring gives to member `a`; one leader, or two at once. One fault
//! in the first seconds: a member crashes or pauses past its lease duration, or is cut off
//! from its Lease while its writes still land, or the assignment is deleted, or an older copy
//! of it is restored, or the operator is reinstalled (its namespace with the assignment and
//! every Lease deleted, every process started again; only the generation floor on the CRD
//! survives), or a rolling update moves every process to the other sharding mode.
//!
//! Clocks keep real time in most models, and processes act at whole seconds: a write lands
//! within the whole margin between lease duration and renew deadline, or never. The drift
//! models run each clock fast or slow by a rate (every combination), give writes the
//! operator's own landing bound, and let time stop at every instant within a second at which
//! a decision changes by some process's clock: a right to write ends, a write's bound passes,
//! a leader sees a Lease expire or a revocation age.
//!
//! Properties:
//! - no write the server accepted came from a member after the bucket was granted to another
//!   (judged with the fencing policy off: the timing layer on its own);
//! - tokens never go backwards: every grant of the bucket carries a higher epoch than the last;
//! - the bucket is owned by a running member at the horizon, when the last fault came early
//!   enough to recover from.
//!
//! Broken decisions (a revoked bucket given away at once, a reinstall that ignores the floor,
//! clocks drifting past the bound docs/sharding.md derives) must make the checker fail, with
//! the trace.

mod clock;
mod processes;
mod protocol;

// The search allocates and frees states by the million; jemalloc, as the operator's binary
// uses, takes much less of its time than the system allocator.
#[global_allocator]
static ALLOCATOR: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

use std::time::Duration;

use stateright::{Checker, HasDiscoveries, Model};
use traffic_policy_operator::coordination::ShardConfig;

use protocol::{Action, Faults, LEASE, Protocol};

/// Breadth first, so a search cut at `limit` states has covered every interleaving up to
/// some depth; `TPO_MODEL_STATE_LIMIT` overrides the limit (0: none).
fn check(protocol: Protocol, limit: usize) -> impl Checker<Protocol> {
    let limit = std::env::var("TPO_MODEL_STATE_LIMIT").ok().and_then(|v| v.parse().ok()).unwrap_or(limit);
    let limit = if limit == 0 { usize::MAX } else { limit };
    let checker = protocol.checker().threads(2).target_state_count(limit);
    checker.finish_when(HasDiscoveries::AnyFailures).spawn_bfs().join()
}

fn keeps_every_property(name: &str, protocol: Protocol) {
    // Two leaders double the interleavings, a change of mode has three processes restart at
    // any second, and a lost or restored assignment can come at any second: their searches
    // are cut to keep CI's budget (`TPO_MODEL_STATE_LIMIT=0` runs them whole, docs/testing.md).
    let limit = match (protocol.leaders, protocol.faults) {
        (2.., _) | (_, Faults::Assignment) => 1_000_000,
        (_, Faults::ModeChange) => 600_000,
        _ => 0,
    };
    let checker = check(protocol, limit);
    println!(
        "{name}: {} states, {} unique, depth {}",
        checker.state_count(),
        checker.unique_state_count(),
        checker.max_depth()
    );
    checker.assert_properties();
}

#[test]
fn members_crashing_or_pausing_under_one_leader() {
    keeps_every_property("crash or pause, one leader", Protocol::correct(1, Faults::Members));
}

#[test]
fn members_crashing_or_pausing_under_two_leaders_at_once() {
    keeps_every_property("crash or pause, two leaders", Protocol::correct(2, Faults::Members));
}

#[test]
fn the_assignment_deleted_or_rolled_back() {
    keeps_every_property("deleted or restored assignment", Protocol::correct(1, Faults::Assignment));
}

#[test]
fn a_reinstall_of_the_operator() {
    keeps_every_property("reinstall", Protocol::correct(1, Faults::Reinstall));
}

#[test]
fn a_reinstall_without_the_generation_floor_fails_with_a_trace() {
    let broken = Protocol { floor: false, ..Protocol::correct(1, Faults::Reinstall) };
    let checker = check(broken, 0);
    let trace = checker.discovery("tokens never go backwards").expect("without the floor, epochs start again");
    println!("counterexample in {} steps: {:?}", trace.clone().into_actions().len(), trace.into_actions());
}

#[test]
fn a_rolling_update_to_the_other_mode() {
    keeps_every_property("change of mode", Protocol::correct(1, Faults::ModeChange));
}

#[test]
fn a_leader_that_takes_an_assignment_of_the_other_mode_for_its_own_fails_with_a_trace() {
    let broken = Protocol { modes_kept: false, ..Protocol::correct(1, Faults::ModeChange) };
    finds_a_late_write("a leader that ignores the assignment's mode", broken);
}

#[test]
fn a_bucket_given_away_without_waiting_for_its_owner_fails_with_a_trace() {
    let broken = Protocol { release: |_, _| true, ..Protocol::correct(1, Faults::Members) };
    finds_a_late_write("reassigning without waiting for the revoked owner", broken);
}

/// Checks that `broken` lets a write land after its bucket went to another, and prints the trace.
fn finds_a_late_write(name: &str, broken: Protocol) {
    let checker = check(broken, 0);
    let trace = checker
        .discovery("no accepted write after the bucket was granted to another")
        .unwrap_or_else(|| panic!("{name} must let a late write land"));
    let steps: Vec<Action> = trace.clone().into_actions();
    let last = trace.last_state();
    let violation = last.violation.as_deref().unwrap_or_default();
    println!("{name}: counterexample in {} steps: {steps:?}\n{violation}", steps.len());
    assert!(last.violation.is_some());
}

/// The operator's own landing bound at the model's timings (`ShardConfig::landing_bound`).
fn landing_bound() -> u64 {
    let config = ShardConfig {
        identity: String::new(),
        incarnation: String::new(),
        namespace: String::new(),
        lease_duration: Duration::from_millis(LEASE),
        renew_deadline: Duration::from_millis(protocol::RENEW_DEADLINE),
        retry_period: Duration::from_secs(1),
        drain_timeout: Duration::from_secs(1),
        balance: Default::default(),
        floor_object: String::new(),
        names: traffic_policy_operator::coordination::NAMES,
        version: String::new(),
        capacity: None,
        split_ranges: false,
        watch_namespace: None,
    };
    config.landing_bound().as_millis() as u64
}

/// A member cut off from its Lease keeps writing to the end of its right, with clocks running
/// fast or slow by `share_of_bound` of the bound docs/sharding.md derives ("The margin":
/// `ρ ≤ (LD − RD − 2W) / (LD + RD + 2W)`).
fn drifting(share_of_bound: f64) -> (Protocol, i64) {
    let (lease, renew, landing) = (LEASE as f64, protocol::RENEW_DEADLINE as f64, landing_bound() as f64);
    let bound = (lease - renew - landing) / (lease + renew + landing);
    let drift_ppm = (bound * share_of_bound * 1e6) as i64;
    let protocol = Protocol { landing_bound: landing_bound(), drift_ppm, ..Protocol::correct(1, Faults::CutOff) };
    (protocol, drift_ppm)
}

#[test]
fn a_member_cut_off_from_its_lease_with_clocks_drifting_within_the_bound() {
    let (protocol, drift_ppm) = drifting(0.9);
    keeps_every_property(&format!("cut off, clocks {drift_ppm} ppm fast or slow"), protocol);
}

#[test]
fn clocks_drifting_past_the_bound_fail_with_a_trace() {
    let (broken, drift_ppm) = drifting(1.1);
    finds_a_late_write(&format!("clocks {drift_ppm} ppm fast or slow, past the bound"), broken);
}

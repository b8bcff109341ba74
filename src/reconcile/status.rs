//! Status from the outcome of a reconcile: pure, with the clock passed in.
//!
//! `lastTransitionTime` moves only when a condition's status changes, so a status that
//! says the same thing compares equal and is not written again.

use std::time::Duration;

use super::gateway::verdict::{RATE_LIMIT_ACCEPTED, ROUTE_ACCEPTED, Verdict};
use crate::api::{ApplicationTrafficPolicyStatus, Condition, ConditionStatus, Time};

pub const READY: &str = "Ready";
/// The Ready reason (and Warning event) of a policy whose writes a foreign fencing token refuses.
pub const TOKEN_CONFLICT: &str = "FencingTokenConflict";
/// The Ready reason (and Warning event) of a policy a child of which would take the name of an
/// object that is not the policy's.
pub const CONFLICT: &str = "Conflict";
/// The Ready reason of a policy whose objects are in place but whose gateway refuses them.
pub const GATEWAY_NOT_ACCEPTED: &str = "GatewayNotAccepted";
/// The condition types this operator writes; others (another writer's) are kept as they are.
const OURS: [&str; 3] = [READY, ROUTE_ACCEPTED, RATE_LIMIT_ACCEPTED];

/// What a reconcile concluded about a policy.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// Every child is in place.
    Applied,
    /// The spec can never succeed as written; retrying will not help.
    InvalidSpec(String),
    /// Applying failed for a reason that may pass (API errors, permissions).
    ApplyFailed(String),
    /// A child or the status carries a fencing token this operator cannot beat.
    TokenConflict(String),
    /// A child's name is taken by an object that is not the policy's: nothing was written.
    Conflict(String),
}

impl Outcome {
    fn condition(&self) -> (ConditionStatus, &'static str, String) {
        match self {
            Self::Applied => {
                (ConditionStatus::True, "Applied", "NetworkPolicy and rate-limit ConfigMap are in place".into())
            }
            Self::InvalidSpec(message) => (ConditionStatus::False, "InvalidSpec", message.clone()),
            Self::ApplyFailed(message) => (ConditionStatus::False, "ApplyFailed", message.clone()),
            Self::TokenConflict(message) => (ConditionStatus::False, TOKEN_CONFLICT, message.clone()),
            Self::Conflict(message) => (ConditionStatus::False, CONFLICT, message.clone()),
        }
    }

    /// The Ready condition's reason and message for this outcome.
    pub fn reason_and_message(&self) -> (&'static str, String) {
        let (_, reason, message) = self.condition();
        (reason, message)
    }
}

/// The `(ready, reason)` pairs `traffic_policy_policies` reports: a fixed set, so the metric
/// stays bounded whatever a status says. A policy without a Ready condition for its current
/// generation is `("Unknown", "Pending")`.
pub const READY_STATES: [(&str, &str); 8] = [
    ("True", "Applied"),
    ("False", GATEWAY_NOT_ACCEPTED),
    ("False", CONFLICT),
    ("False", "InvalidSpec"),
    ("False", "ApplyFailed"),
    ("False", TOKEN_CONFLICT),
    ("Unknown", "Pending"),
    ("Unknown", "Other"),
];

/// Which of [`READY_STATES`] a policy of `generation` is in, given its Ready condition's
/// `(status, reason, observedGeneration)`.
pub fn ready_state(generation: Option<i64>, ready: Option<(&str, &str, Option<i64>)>) -> usize {
    match ready {
        Some((status, reason, observed)) if observed == generation => {
            READY_STATES.iter().position(|&(s, r)| s == status && r == reason).unwrap_or(READY_STATES.len() - 1)
        }
        _ => READY_STATES.len() - 2,
    }
}

/// Whether a Ready condition `(status, reason, observedGeneration)` already says the
/// policy's `generation` is applied.
pub fn says_applied(ready: Option<(&str, &str, Option<i64>)>, generation: Option<i64>) -> bool {
    READY_STATES[ready_state(generation, ready)] == ("True", "Applied")
}

/// The status to hold after `outcome` for `generation`, given the current one. `gateway`
/// holds the conditions of the policy's gateway half; `None` keeps those in place (the
/// reconcile did not get as far as the gateway).
pub fn next_status(
    current: Option<&ApplicationTrafficPolicyStatus>,
    generation: Option<i64>,
    outcome: &Outcome,
    gateway: Option<&[Verdict]>,
    now: &Time,
) -> ApplicationTrafficPolicyStatus {
    let (mut status, mut reason, mut message) = outcome.condition();
    let refused = gateway.unwrap_or_default().iter().find(|v| v.status == ConditionStatus::False);
    if let (Outcome::Applied, Some(refused)) = (outcome, refused) {
        (status, reason, message) =
            (ConditionStatus::False, GATEWAY_NOT_ACCEPTED, format!("{}: {}", refused.type_, refused.message));
    }
    let previous = |type_: &str| current.and_then(|s| s.conditions.iter().find(|c| c.type_ == type_));
    let condition = |type_: &str, status: ConditionStatus, reason: &str, message: &str| {
        let last_transition_time = match previous(type_) {
            Some(p) if p.status == status => p.last_transition_time.clone(),
            _ => now.clone(),
        };
        Condition {
            type_: type_.into(),
            status: status.as_str().into(),
            reason: reason.into(),
            message: truncate(message, 1024),
            last_transition_time,
            observed_generation: generation,
        }
    };
    let mut conditions = vec![condition(READY, status, reason, &message)];
    match gateway {
        Some(verdicts) => {
            conditions.extend(verdicts.iter().map(|v| condition(v.type_, v.status, v.reason, &v.message)));
        }
        None => {
            conditions.extend([ROUTE_ACCEPTED, RATE_LIMIT_ACCEPTED].iter().filter_map(|type_| previous(type_).cloned()))
        }
    }
    // Keep conditions of other types (another writer's) as they are.
    if let Some(current) = current {
        conditions.extend(current.conditions.iter().filter(|c| !OURS.contains(&c.type_.as_str())).cloned());
    }
    // The epoch is stamped by the write itself; unchanged here, so that a new owner with
    // nothing new to report writes nothing.
    let shard_epoch = current.and_then(|s| s.shard_epoch);
    ApplicationTrafficPolicyStatus { observed_generation: generation, conditions, shard_epoch }
}

/// How long the gateway has left the conditions in `status` pending, at `now`.
pub fn pending_for(status: Option<&ApplicationTrafficPolicyStatus>, now: &Time) -> Duration {
    let since = status
        .into_iter()
        .flat_map(|s| &s.conditions)
        .filter(|c| c.reason == super::gateway::verdict::PENDING && c.status == ConditionStatus::Unknown)
        .map(|c| c.last_transition_time.0)
        .min();
    since.map_or(Duration::ZERO, |since| Duration::try_from(now.0.duration_since(since)).unwrap_or_default())
}

fn truncate(message: &str, max_chars: usize) -> String {
    message.chars().take(max_chars).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(rfc3339: &str) -> Time {
        Time(rfc3339.parse().unwrap())
    }

    const T1: &str = "2026-01-01T00:00:00Z";
    const T2: &str = "2026-01-01T00:05:00Z";

    #[test]
    fn first_status_is_stamped_now() {
        let s = next_status(None, Some(1), &Outcome::Applied, None, &at(T1));
        assert_eq!(s.observed_generation, Some(1));
        let ready = &s.conditions[0];
        assert_eq!(
            (ready.status.as_str(), ready.reason.as_str(), &ready.last_transition_time),
            (ConditionStatus::True.as_str(), "Applied", &at(T1))
        );
    }

    #[test]
    fn same_status_keeps_transition_time_and_compares_equal() {
        let first = next_status(None, Some(1), &Outcome::Applied, None, &at(T1));
        let again = next_status(Some(&first), Some(1), &Outcome::Applied, None, &at(T2));
        assert_eq!(again, first, "nothing changed, so nothing to write");
    }

    #[test]
    fn new_generation_advances_observed_generation_but_not_transition_time() {
        let first = next_status(None, Some(1), &Outcome::Applied, None, &at(T1));
        let next = next_status(Some(&first), Some(2), &Outcome::Applied, None, &at(T2));
        assert_eq!(next.observed_generation, Some(2));
        assert_eq!(next.conditions[0].observed_generation, Some(2));
        assert_eq!(next.conditions[0].last_transition_time, at(T1));
    }

    #[test]
    fn status_change_moves_transition_time() {
        let ok = next_status(None, Some(1), &Outcome::Applied, None, &at(T1));
        let bad = next_status(Some(&ok), Some(2), &Outcome::InvalidSpec("spec.x: bad".into()), None, &at(T2));
        let ready = &bad.conditions[0];
        assert_eq!(
            (ready.status.as_str(), ready.reason.as_str(), ready.message.as_str()),
            ("False", "InvalidSpec", "spec.x: bad")
        );
        assert_eq!(ready.last_transition_time, at(T2));
        // False -> False with another reason is not a transition.
        let failed = next_status(
            Some(&bad),
            Some(2),
            &Outcome::ApplyFailed("forbidden".into()),
            None,
            &at("2026-01-01T00:09:00Z"),
        );
        assert_eq!(failed.conditions[0].last_transition_time, at(T2));
        assert_eq!(failed.conditions[0].reason, "ApplyFailed");
    }

    #[test]
    fn applied_only_for_the_generation_it_observed() {
        assert!(says_applied(Some(("True", "Applied", Some(2))), Some(2)));
        assert!(!says_applied(Some(("True", "Applied", Some(1))), Some(2)), "an older generation");
        assert!(!says_applied(Some(("False", "ApplyFailed", Some(2))), Some(2)));
        assert!(!says_applied(None, Some(2)), "no status yet");
    }

    #[test]
    fn other_conditions_are_kept() {
        let mut current = next_status(None, Some(1), &Outcome::Applied, None, &at(T1));
        current.conditions.push(Condition {
            type_: "Audited".into(),
            status: ConditionStatus::Unknown.as_str().into(),
            reason: "Pending".into(),
            message: String::new(),
            last_transition_time: at(T1),
            observed_generation: None,
        });
        let next = next_status(Some(&current), Some(1), &Outcome::Applied, None, &at(T2));
        assert_eq!(next.conditions.len(), 2);
        assert_eq!(next.conditions[1].type_, "Audited");
    }

    #[test]
    fn gateway_verdicts_become_conditions_and_a_refusal_makes_ready_false() {
        use ConditionStatus::{False, True, Unknown};
        let verdict = |type_, status, reason: &'static str| Verdict { type_, status, reason, message: "m".into() };
        let pending = [verdict(ROUTE_ACCEPTED, Unknown, "Pending")];
        let first = next_status(None, Some(1), &Outcome::Applied, Some(&pending), &at(T1));
        assert_eq!(first.conditions[0].reason, "Applied", "a gateway still answering is no failure");
        assert_eq!(
            (first.conditions[1].type_.as_str(), first.conditions[1].status.as_str()),
            (ROUTE_ACCEPTED, "Unknown")
        );
        assert_eq!(pending_for(Some(&first), &at(T2)), Duration::from_secs(300));
        let refused = [verdict(ROUTE_ACCEPTED, True, "Accepted"), verdict(RATE_LIMIT_ACCEPTED, False, "NotAttached")];
        let next = next_status(Some(&first), Some(1), &Outcome::Applied, Some(&refused), &at(T2));
        let ready = &next.conditions[0];
        assert_eq!((ready.status.as_str(), ready.reason.as_str()), ("False", GATEWAY_NOT_ACCEPTED));
        assert_eq!(ready.message, "RateLimitAccepted: m");
        assert_eq!(next.conditions.len(), 3);
        // A failed reconcile keeps the gateway conditions; none drops them.
        let failed = next_status(Some(&next), Some(1), &Outcome::ApplyFailed("x".into()), None, &at(T2));
        assert_eq!(failed.conditions.len(), 3);
        let dropped = next_status(Some(&next), Some(2), &Outcome::Applied, Some(&[]), &at(T2));
        assert_eq!(dropped.conditions.len(), 1);
        assert_eq!(pending_for(Some(&dropped), &at(T2)), Duration::ZERO);
    }
}

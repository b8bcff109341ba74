//! Status from the outcome of a reconcile: pure, with the clock passed in.
//!
//! `lastTransitionTime` moves only when a condition's status changes, so a status that
//! says the same thing compares equal and is not written again.

use crate::api::{ApplicationTrafficPolicyStatus, Condition, ConditionStatus, Time};

pub const READY: &str = "Ready";
/// The Ready reason (and Warning event) of a policy whose writes a foreign fencing token refuses.
pub const TOKEN_CONFLICT: &str = "FencingTokenConflict";

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
        }
    }
}

/// The `(ready, reason)` pairs `traffic_policy_policies` reports: a fixed set, so the metric
/// stays bounded whatever a status says. A policy without a Ready condition for its current
/// generation is `("Unknown", "Pending")`.
pub const READY_STATES: [(&str, &str); 6] = [
    ("True", "Applied"),
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

/// The status to hold after `outcome` for `generation`, given the current one.
pub fn next_status(
    current: Option<&ApplicationTrafficPolicyStatus>,
    generation: Option<i64>,
    outcome: &Outcome,
    now: &Time,
) -> ApplicationTrafficPolicyStatus {
    let (status, reason, message) = outcome.condition();
    let previous = current.and_then(|s| s.conditions.iter().find(|c| c.type_ == READY));
    let last_transition_time = match previous {
        Some(p) if p.status == status => p.last_transition_time.clone(),
        _ => now.clone(),
    };
    let ready = Condition {
        type_: READY.into(),
        status: status.as_str().into(),
        reason: reason.into(),
        message: truncate(&message, 1024),
        last_transition_time,
        observed_generation: generation,
    };
    // Keep conditions of other types (another writer's) as they are.
    let mut conditions: Vec<Condition> =
        current.map(|s| s.conditions.iter().filter(|c| c.type_ != READY).cloned().collect()).unwrap_or_default();
    conditions.insert(0, ready);
    // The epoch is stamped by the write itself; unchanged here, so that a new owner with
    // nothing new to report writes nothing.
    let shard_epoch = current.and_then(|s| s.shard_epoch);
    ApplicationTrafficPolicyStatus { observed_generation: generation, conditions, shard_epoch }
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
        let s = next_status(None, Some(1), &Outcome::Applied, &at(T1));
        assert_eq!(s.observed_generation, Some(1));
        let ready = &s.conditions[0];
        assert_eq!(
            (ready.status.as_str(), ready.reason.as_str(), &ready.last_transition_time),
            (ConditionStatus::True.as_str(), "Applied", &at(T1))
        );
    }

    #[test]
    fn same_status_keeps_transition_time_and_compares_equal() {
        let first = next_status(None, Some(1), &Outcome::Applied, &at(T1));
        let again = next_status(Some(&first), Some(1), &Outcome::Applied, &at(T2));
        assert_eq!(again, first, "nothing changed, so nothing to write");
    }

    #[test]
    fn new_generation_advances_observed_generation_but_not_transition_time() {
        let first = next_status(None, Some(1), &Outcome::Applied, &at(T1));
        let next = next_status(Some(&first), Some(2), &Outcome::Applied, &at(T2));
        assert_eq!(next.observed_generation, Some(2));
        assert_eq!(next.conditions[0].observed_generation, Some(2));
        assert_eq!(next.conditions[0].last_transition_time, at(T1));
    }

    #[test]
    fn status_change_moves_transition_time() {
        let ok = next_status(None, Some(1), &Outcome::Applied, &at(T1));
        let bad = next_status(Some(&ok), Some(2), &Outcome::InvalidSpec("spec.x: bad".into()), &at(T2));
        let ready = &bad.conditions[0];
        assert_eq!(
            (ready.status.as_str(), ready.reason.as_str(), ready.message.as_str()),
            ("False", "InvalidSpec", "spec.x: bad")
        );
        assert_eq!(ready.last_transition_time, at(T2));
        // False -> False with another reason is not a transition.
        let failed =
            next_status(Some(&bad), Some(2), &Outcome::ApplyFailed("forbidden".into()), &at("2026-01-01T00:09:00Z"));
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
        let mut current = next_status(None, Some(1), &Outcome::Applied, &at(T1));
        current.conditions.push(Condition {
            type_: "Audited".into(),
            status: ConditionStatus::Unknown.as_str().into(),
            reason: "Pending".into(),
            message: String::new(),
            last_transition_time: at(T1),
            observed_generation: None,
        });
        let next = next_status(Some(&current), Some(1), &Outcome::Applied, &at(T2));
        assert_eq!(next.conditions.len(), 2);
        assert_eq!(next.conditions[1].type_, "Audited");
    }
}

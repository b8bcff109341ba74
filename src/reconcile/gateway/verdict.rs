//! What the gateway reported, read into the policy's conditions: pure, from the objects read.
//!
//! A route reports per parent Gateway in `status.parents[].conditions` (`Accepted`,
//! `ResolvedRefs`), each with the route generation it describes; Envoy Gateway's policies
//! report per ancestor in `status.ancestors[].conditions`.

use std::time::Duration;

use serde_json::Value;

use super::Provider;
use crate::api::{ConditionStatus, RateLimit};

/// The condition type saying whether the gateway accepted the policy's routes.
pub const ROUTE_ACCEPTED: &str = "RouteAccepted";
/// The condition type saying whether the gateway enforces the policy's rate limit.
pub const RATE_LIMIT_ACCEPTED: &str = "RateLimitAccepted";
/// The reason of a condition still waiting for the gateway's report.
pub const PENDING: &str = "Pending";

/// One condition of the gateway half, as it will be written.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Verdict {
    pub type_: &'static str,
    pub status: ConditionStatus,
    pub reason: &'static str,
    pub message: String,
}

impl Verdict {
    fn new(type_: &'static str, status: ConditionStatus, reason: &'static str, message: String) -> Self {
        Self { type_, status, reason, message }
    }

    pub fn is_pending(&self) -> bool {
        self.status == ConditionStatus::Unknown && self.reason == PENDING
    }
}

/// A route as read: its name and the object, or `None` when it does not exist.
pub type RouteRead = (String, Option<Value>);

/// Whether the gateway accepted every route. `gateway_missing` names a declared Gateway that
/// does not exist; `written` says the route was just changed, so what it reports is stale.
pub fn route_verdict(gateway_missing: Option<&str>, routes: &[RouteRead], written: bool) -> Verdict {
    use ConditionStatus::{False, True, Unknown};
    let verdict = |status, reason, message| Verdict::new(ROUTE_ACCEPTED, status, reason, message);
    if let Some(gateway) = gateway_missing {
        return verdict(False, "GatewayNotFound", format!("Gateway {gateway} does not exist"));
    }
    let all = || routes.iter().map(|(n, _)| n.as_str()).collect::<Vec<_>>().join(", ");
    if written {
        return verdict(Unknown, PENDING, format!("waiting for the gateway to report on HTTPRoute {}", all()));
    }
    let mut pending = Vec::new();
    for (name, route) in routes {
        let Some(route) = route else {
            return verdict(False, "RouteNotFound", format!("HTTPRoute {name} does not exist"));
        };
        match route_report(route) {
            Report::Refused { reason, message } => {
                return verdict(False, "NotAccepted", format!("HTTPRoute {name}: {reason}: {message}"));
            }
            Report::Pending => pending.push(name.as_str()),
            Report::Accepted => {}
        }
    }
    if !pending.is_empty() {
        return verdict(
            Unknown,
            PENDING,
            format!("waiting for the gateway to report on HTTPRoute {}", pending.join(", ")),
        );
    }
    verdict(True, "Accepted", format!("the gateway accepted HTTPRoute {}", all()))
}

enum Report {
    Accepted,
    Pending,
    Refused { reason: String, message: String },
}

/// What a route's parents say, for the route's current generation.
fn route_report(route: &Value) -> Report {
    let generation = route["metadata"]["generation"].as_i64();
    let parents = route["status"]["parents"].as_array().map(Vec::as_slice).unwrap_or_default();
    if parents.is_empty() {
        return Report::Pending;
    }
    let mut current = true;
    for parent in parents {
        for type_ in ["Accepted", "ResolvedRefs"] {
            let conditions = parent["conditions"].as_array().map(Vec::as_slice).unwrap_or_default();
            let Some(condition) = conditions.iter().find(|c| c["type"] == type_) else {
                current = false;
                continue;
            };
            current &= generation.is_none() || condition["observedGeneration"].as_i64() == generation;
            if condition["status"] == "False" {
                let text = |field: &str| condition[field].as_str().unwrap_or_default().to_string();
                return Report::Refused { reason: format!("{type_} {}", text("reason")), message: text("message") };
            }
        }
    }
    if current { Report::Accepted } else { Report::Pending }
}

/// Whether the gateway enforces the limit; `None` when the policy has none.
pub fn rate_limit_verdict(
    limit: Option<&RateLimit>,
    provider: Option<&dyn Provider>,
    no_provider: &str,
    route: &Verdict,
    unattached: Option<String>,
    limit_status: Option<&Value>,
    written: bool,
) -> Option<Verdict> {
    use ConditionStatus::{False, True, Unknown};
    let limit = limit?;
    let verdict = |status, reason, message| Some(Verdict::new(RATE_LIMIT_ACCEPTED, status, reason, message));
    let Some(provider) = provider else {
        return verdict(Unknown, "NoProvider", no_provider.to_string());
    };
    if let Some(message) = unattached {
        return verdict(False, "NotAttached", message);
    }
    match route.status {
        ConditionStatus::False => return verdict(False, "RouteNotAccepted", route.message.clone()),
        ConditionStatus::Unknown => return verdict(Unknown, PENDING, route.message.clone()),
        ConditionStatus::True => {}
    }
    // A provider whose object reports for itself (Envoy Gateway) has the last word.
    if let Some(status) = limit_status.filter(|_| provider.reports_in_own_status()) {
        let ancestors = status["ancestors"].as_array().map(Vec::as_slice).unwrap_or_default();
        let accepted: Vec<_> = ancestors
            .iter()
            .filter_map(|a| a["conditions"].as_array()?.iter().find(|c| c["type"] == "Accepted"))
            .collect();
        if let Some(refused) = accepted.iter().find(|c| c["status"] == "False") {
            let text = |field: &str| refused[field].as_str().unwrap_or_default().to_string();
            return verdict(False, "Rejected", format!("{}: {}: {}", provider.name(), text("reason"), text("message")));
        }
        if written || accepted.is_empty() {
            return verdict(Unknown, PENDING, format!("waiting for {} to report on the limit", provider.name()));
        }
    } else if provider.reports_in_own_status() {
        return verdict(Unknown, PENDING, format!("waiting for {} to report on the limit", provider.name()));
    }
    verdict(True, "Accepted", provider.describe(limit))
}

/// When to look again: soon while the gateway has not answered (backing off with how long
/// it has been waiting), seldom once it refused, never when all is settled (resync aside).
pub fn recheck_after(verdicts: &[Verdict], pending_for: Duration) -> Option<Duration> {
    if verdicts.iter().any(Verdict::is_pending) {
        Some((pending_for / 2).clamp(Duration::from_secs(1), Duration::from_secs(30)))
    } else if verdicts.iter().any(|v| v.status == ConditionStatus::False) {
        Some(Duration::from_secs(60))
    } else {
        None
    }
}

/// Says that `route` lacks `filter`, and what to add.
pub fn unattached(route: &str, filter: &Value) -> String {
    let target = &filter["extensionRef"];
    format!(
        "HTTPRoute {route} does not apply the limit: add a filter of type ExtensionRef naming {} {} (group {}) to each \
         of its rules",
        target["kind"].as_str().unwrap_or_default(),
        target["name"].as_str().unwrap_or_default(),
        target["group"].as_str().unwrap_or_default()
    )
}

/// Whether the route carries `filter` in every rule (a gateway attached through the route).
pub fn carries_filter(route: &Value, filter: &Value) -> bool {
    let rules = route["spec"]["rules"].as_array().map(Vec::as_slice).unwrap_or_default();
    !rules.is_empty()
        && rules.iter().all(|rule| {
            rule["filters"].as_array().is_some_and(|filters| {
                filters.iter().any(|f| f["type"] == filter["type"] && f["extensionRef"] == filter["extensionRef"])
            })
        })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::reconcile::gateway::{EnvoyGateway, Traefik};
    use serde_json::json;

    fn route(generation: i64, accepted: (&str, i64), resolved: (&str, i64)) -> Value {
        json!({
            "metadata": { "generation": generation },
            "status": { "parents": [{ "parentRef": { "name": "edge" }, "conditions": [
                { "type": "Accepted", "status": accepted.0, "reason": "NotAllowedByListeners",
                  "message": "no listener", "observedGeneration": accepted.1 },
                { "type": "ResolvedRefs", "status": resolved.0, "reason": "BackendNotFound",
                  "message": "no service", "observedGeneration": resolved.1 }
            ] }] }
        })
    }

    fn read(value: Value) -> Vec<RouteRead> {
        vec![("web".to_string(), Some(value))]
    }

    const LIMIT: RateLimit = RateLimit { requests_per_second: 5, burst: 2 };

    #[test]
    fn route_accepted_only_for_its_current_generation() {
        let ok = route_verdict(None, &read(route(2, ("True", 2), ("True", 2))), false);
        assert_eq!((ok.status, ok.reason), (ConditionStatus::True, "Accepted"));
        let stale = route_verdict(None, &read(route(3, ("True", 2), ("True", 2))), false);
        assert!(stale.is_pending(), "{stale:?}");
        let just_written = route_verdict(None, &read(route(2, ("True", 2), ("True", 2))), true);
        assert!(just_written.is_pending());
        assert!(route_verdict(None, &[("web".into(), None)], true).is_pending(), "just created");
        let unreported = route_verdict(None, &read(json!({ "metadata": { "generation": 1 } })), false);
        assert!(unreported.is_pending());
    }

    #[test]
    fn refusals_and_missing_objects_say_what_is_wrong() {
        let refused = route_verdict(None, &read(route(1, ("True", 1), ("False", 1))), false);
        assert_eq!((refused.status, refused.reason), (ConditionStatus::False, "NotAccepted"));
        assert!(refused.message.contains("ResolvedRefs BackendNotFound: no service"), "{}", refused.message);
        let missing = route_verdict(None, &[("web".into(), None)], false);
        assert_eq!((missing.reason, missing.message.as_str()), ("RouteNotFound", "HTTPRoute web does not exist"));
        let no_gateway = route_verdict(Some("infra/edge"), &[("web".into(), None)], false);
        assert_eq!(
            (no_gateway.reason, no_gateway.message.as_str()),
            ("GatewayNotFound", "Gateway infra/edge does not exist")
        );
    }

    #[test]
    fn traefik_limit_follows_the_route() {
        let accepted = route_verdict(None, &read(route(1, ("True", 1), ("True", 1))), false);
        let v = rate_limit_verdict(Some(&LIMIT), Some(&Traefik), "", &accepted, None, None, true).unwrap();
        assert_eq!((v.status, v.reason), (ConditionStatus::True, "Accepted"));
        assert!(v.message.contains("5 requests/s, burst 2"), "{}", v.message);
        let filter = json!({ "type": "ExtensionRef", "extensionRef": { "group": "traefik.io", "kind": "Middleware", "name": "web" } });
        let message = Some(super::unattached("mine", &filter));
        let unattached = rate_limit_verdict(Some(&LIMIT), Some(&Traefik), "", &accepted, message, None, false).unwrap();
        assert_eq!((unattached.status, unattached.reason), (ConditionStatus::False, "NotAttached"));
        assert!(unattached.message.contains("HTTPRoute mine") && unattached.message.contains("Middleware web"));
        let refused = route_verdict(None, &read(route(1, ("False", 1), ("True", 1))), false);
        let v = rate_limit_verdict(Some(&LIMIT), Some(&Traefik), "", &refused, None, None, false).unwrap();
        assert_eq!((v.status, v.reason), (ConditionStatus::False, "RouteNotAccepted"));
        assert!(rate_limit_verdict(None, Some(&Traefik), "", &accepted, None, None, false).is_none());
    }

    #[test]
    fn envoy_gateway_has_the_last_word_on_its_policy() {
        let accepted = route_verdict(None, &read(route(1, ("True", 1), ("True", 1))), false);
        let status = |s: &str| {
            json!({ "ancestors": [{ "conditions": [{ "type": "Accepted", "status": s,
            "reason": "Invalid", "message": "bad limit" }] }] })
        };
        let eg = |st: Option<&Value>, written| {
            rate_limit_verdict(Some(&LIMIT), Some(&EnvoyGateway), "", &accepted, None, st, written).unwrap()
        };
        assert_eq!(eg(Some(&status("True")), false).status, ConditionStatus::True);
        let rejected = eg(Some(&status("False")), false);
        assert_eq!((rejected.reason, rejected.message.as_str()), ("Rejected", "Envoy Gateway: Invalid: bad limit"));
        assert!(eg(None, false).is_pending() && eg(Some(&json!({})), false).is_pending());
        assert!(eg(Some(&status("True")), true).is_pending(), "a report on the previous limit");
    }

    #[test]
    fn no_provider_is_reported_not_hidden() {
        let accepted = route_verdict(None, &read(route(1, ("True", 1), ("True", 1))), false);
        let v = rate_limit_verdict(Some(&LIMIT), None, "no provider for x", &accepted, None, None, false).unwrap();
        assert_eq!(
            (v.status, v.reason, v.message.as_str()),
            (ConditionStatus::Unknown, "NoProvider", "no provider for x")
        );
    }

    #[test]
    fn rechecks_back_off_and_stop() {
        let pending = route_verdict(None, &[], true);
        assert_eq!(recheck_after(std::slice::from_ref(&pending), Duration::ZERO), Some(Duration::from_secs(1)));
        assert_eq!(
            recheck_after(std::slice::from_ref(&pending), Duration::from_secs(20)),
            Some(Duration::from_secs(10))
        );
        assert_eq!(
            recheck_after(std::slice::from_ref(&pending), Duration::from_secs(600)),
            Some(Duration::from_secs(30))
        );
        let missing = route_verdict(None, &[("web".into(), None)], false);
        assert_eq!(recheck_after(&[missing], Duration::ZERO), Some(Duration::from_secs(60)));
        let ok = route_verdict(None, &read(route(1, ("True", 1), ("True", 1))), false);
        assert_eq!(recheck_after(&[ok], Duration::ZERO), None);
    }

    #[test]
    fn finds_the_filter_in_every_rule() {
        let filter = Traefik
            .route_filter(&crate::api::ApplicationTrafficPolicy::new(
                "web",
                serde_json::from_value(json!({ "applicationSelector": { "matchLabels": { "app": "web" } } })).unwrap(),
            ))
            .unwrap();
        let with =
            |filters: Value| json!({ "spec": { "rules": [{ "filters": filters }, { "filters": [filter.clone()] }] } });
        assert!(carries_filter(&with(json!([filter.clone()])), &filter));
        assert!(!carries_filter(&with(json!([])), &filter), "one rule without it");
        assert!(!carries_filter(&json!({ "spec": {} }), &filter));
    }
}

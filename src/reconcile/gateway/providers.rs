//! The two gateways the operator writes rate limits for.

use kube::ResourceExt;
use kube::core::ApiResource;
use serde_json::json;

use super::{Provider, resource};
use crate::api::{ApplicationTrafficPolicy, RateLimit};

/// Traefik v3: a `Middleware` with `rateLimit`, attached by an `ExtensionRef` filter on the route.
pub struct Traefik;

/// Traefik's bucket holds `burst` requests, refilled at `average` per `period`; it admits
/// nothing at burst 0, so the bucket holds at least one (docs/gateways.md).
fn traefik_burst(limit: &RateLimit) -> i32 {
    limit.burst.max(1)
}

impl Provider for Traefik {
    fn name(&self) -> &'static str {
        "Traefik"
    }

    fn controller_name(&self) -> &'static str {
        "traefik.io/gateway-controller"
    }

    fn resource(&self) -> ApiResource {
        resource("traefik.io", "v1alpha1", "Middleware", "middlewares")
    }

    fn limit_spec(&self, limit: &RateLimit, _routes: &[String]) -> serde_json::Value {
        json!({ "rateLimit": { "average": limit.requests_per_second, "burst": traefik_burst(limit), "period": "1s" } })
    }

    fn route_filter(&self, policy: &ApplicationTrafficPolicy) -> Option<serde_json::Value> {
        Some(json!({
            "type": "ExtensionRef",
            "extensionRef": { "group": "traefik.io", "kind": "Middleware", "name": policy.name_any() }
        }))
    }

    fn describe(&self, limit: &RateLimit) -> String {
        format!(
            "Traefik Middleware: {} requests/s, burst {}, per gateway replica",
            limit.requests_per_second,
            traefik_burst(limit)
        )
    }
}

/// Envoy Gateway: a `BackendTrafficPolicy` with a local rate limit that targets the routes.
pub struct EnvoyGateway;

impl Provider for EnvoyGateway {
    fn name(&self) -> &'static str {
        "Envoy Gateway"
    }

    fn controller_name(&self) -> &'static str {
        "gateway.envoyproxy.io/gatewayclass-controller"
    }

    fn resource(&self) -> ApiResource {
        resource("gateway.envoyproxy.io", "v1alpha1", "BackendTrafficPolicy", "backendtrafficpolicies")
    }

    fn limit_spec(&self, limit: &RateLimit, routes: &[String]) -> serde_json::Value {
        let target = |name: &String| json!({ "group": "gateway.networking.k8s.io", "kind": "HTTPRoute", "name": name });
        json!({
            "targetRefs": routes.iter().map(target).collect::<Vec<_>>(),
            "rateLimit": {
                "type": "Local",
                "local": { "rules": [{ "limit": { "requests": limit.requests_per_second, "unit": "Second" } }] }
            }
        })
    }

    fn route_filter(&self, _: &ApplicationTrafficPolicy) -> Option<serde_json::Value> {
        None // the BackendTrafficPolicy targets the route itself
    }

    fn reports_in_own_status(&self) -> bool {
        true
    }

    fn describe(&self, limit: &RateLimit) -> String {
        // Envoy's local limit is a bucket of `requests` tokens refilled each unit: no separate burst.
        format!(
            "Envoy Gateway BackendTrafficPolicy: {} requests/s, local, per Envoy replica (burst is not expressible: \
             the bucket holds one second's requests)",
            limit.requests_per_second
        )
    }
}

//! The gateway half of a policy: the HTTPRoute its limit applies to, and the gateway's own
//! rate-limit object (docs/gateways.md).
//!
//! A [`Provider`] turns a limit into one gateway's resource. Which provider serves a policy
//! is the flag's choice, or, in `auto`, that of the controller named by the GatewayClass of
//! the policy's Gateway. A gateway no provider knows reads the rate-limit ConfigMap.
//!
//! Everything here is pure: [`objects`] computes the desired objects, [`verdict`] reads
//! what the gateway reported into conditions. [`sync`] does the reads and writes.

pub mod objects;
mod providers;
mod sync;
pub mod verdict;

use kube::core::{ApiResource, GroupVersionKind};

pub use providers::{EnvoyGateway, Traefik};

use crate::api::{ApplicationTrafficPolicy, RateLimit};

/// Which provider the operator uses (`--gateway-provider`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum ProviderChoice {
    /// The provider of the controller named by the Gateway's GatewayClass.
    #[default]
    Auto,
    Traefik,
    EnvoyGateway,
    /// No gateway object: the rate-limit ConfigMap is the only output.
    None,
}

impl ProviderChoice {
    /// The provider for a Gateway whose class names `controller` (read only in `Auto`).
    pub fn provider(self, controller: Option<&str>) -> Option<&'static dyn Provider> {
        match self {
            Self::Traefik => Some(&Traefik),
            Self::EnvoyGateway => Some(&EnvoyGateway),
            Self::None => None,
            Self::Auto => PROVIDERS.iter().copied().find(|p| Some(p.controller_name()) == controller),
        }
    }

    /// Whether the provider depends on the Gateway's class, so that it must be read.
    pub fn reads_gateway_class(self) -> bool {
        self == Self::Auto
    }
}

/// Every provider the operator has.
pub const PROVIDERS: [&dyn Provider; 2] = [&Traefik, &EnvoyGateway];

/// Turns a policy's rate limit into one gateway's own resource.
pub trait Provider: Sync {
    /// As users know it, for messages: "Traefik".
    fn name(&self) -> &'static str;
    /// The `spec.controllerName` of the GatewayClasses this gateway serves.
    fn controller_name(&self) -> &'static str;
    /// The kind of its rate-limit object.
    fn resource(&self) -> ApiResource;
    /// Its rate-limit object for `limit` on `routes`, without metadata (the caller adds it).
    fn limit_spec(&self, limit: &RateLimit, routes: &[String]) -> serde_json::Value;
    /// The HTTPRoute filter that applies the limit, for gateways attached through the route.
    fn route_filter(&self, policy: &ApplicationTrafficPolicy) -> Option<serde_json::Value>;
    /// What the limit is, as this gateway enforces it, for the status.
    fn describe(&self, limit: &RateLimit) -> String;
    /// Whether its object reports acceptance in its own `status.ancestors` (else the route's
    /// status says it all).
    fn reports_in_own_status(&self) -> bool {
        false
    }
}

pub fn resource(group: &str, version: &str, kind: &str, plural: &str) -> ApiResource {
    ApiResource::from_gvk_with_plural(&GroupVersionKind::gvk(group, version, kind), plural)
}

pub fn http_route() -> ApiResource {
    resource("gateway.networking.k8s.io", "v1", "HTTPRoute", "httproutes")
}

pub fn gateway() -> ApiResource {
    resource("gateway.networking.k8s.io", "v1", "Gateway", "gateways")
}

pub fn gateway_class() -> ApiResource {
    resource("gateway.networking.k8s.io", "v1", "GatewayClass", "gatewayclasses")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn auto_follows_the_gateway_class() {
        let auto = ProviderChoice::Auto;
        assert_eq!(auto.provider(Some("traefik.io/gateway-controller")).map(|p| p.name()), Some("Traefik"));
        assert_eq!(
            auto.provider(Some("gateway.envoyproxy.io/gatewayclass-controller")).map(|p| p.name()),
            Some("Envoy Gateway")
        );
        assert!(auto.provider(Some("example.com/other")).is_none(), "another gateway reads the ConfigMap");
        assert!(auto.provider(None).is_none());
        assert_eq!(ProviderChoice::Traefik.provider(Some("example.com/other")).map(|p| p.name()), Some("Traefik"));
        assert!(ProviderChoice::None.provider(Some("traefik.io/gateway-controller")).is_none());
    }
}

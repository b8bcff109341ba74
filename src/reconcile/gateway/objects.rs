//! The gateway objects a policy asks for, computed from its spec alone.

use std::collections::BTreeMap;

use kube::ResourceExt;
use kube::api::DynamicObject;
use kube::core::ApiResource;
use serde_json::json;

use super::{Provider, http_route};
use crate::api::{ApplicationTrafficPolicy, GatewayRouting, PathMatchType};
use crate::reconcile::desired::child_meta;

/// What the gateway half of a policy writes, and where it looks for the verdict.
#[derive(Debug, PartialEq)]
pub struct Outputs {
    /// The routes the limit applies to, in the policy's namespace.
    pub routes: Vec<String>,
    /// The generated HTTPRoute, when the policy declares one.
    pub generated_route: Option<DynamicObject>,
    /// The gateway's own rate-limit object, when there is a limit and a provider.
    pub limit: Option<(ApiResource, DynamicObject)>,
}

/// The Gateway a policy's route hangs under: `(namespace, name, sectionName)`, when the policy
/// names one (generated routes). For named routes it comes from the route's parentRefs.
pub fn declared_gateway(policy: &ApplicationTrafficPolicy) -> Option<(String, String, Option<String>)> {
    let parent = policy.spec.gateway.as_ref()?.parent_ref.as_ref()?;
    let namespace = parent.namespace.clone().or_else(|| policy.namespace()).unwrap_or_default();
    Some((namespace, parent.name.clone(), parent.section_name.clone()))
}

pub fn outputs(
    policy: &ApplicationTrafficPolicy,
    routing: &GatewayRouting,
    provider: Option<&dyn Provider>,
    labels: &BTreeMap<String, String>,
) -> Outputs {
    let generated_route = routing.parent_ref.as_ref().map(|_| generated_route(policy, routing, provider, labels));
    let routes = match &routing.http_routes {
        Some(named) => named.iter().map(|r| r.name.clone()).collect(),
        None => vec![policy.name_any()],
    };
    let limit = provider.zip(policy.spec.rate_limit.as_ref()).map(|(provider, limit)| {
        let resource = provider.resource();
        let mut object = DynamicObject::new(&policy.name_any(), &resource);
        object.metadata = child_meta(policy, labels);
        object.data = json!({ "spec": provider.limit_spec(limit, &routes) });
        (resource, object)
    });
    Outputs { routes, generated_route, limit }
}

/// An HTTPRoute of the policy's name: its hostnames and paths under its Gateway, to its Service.
fn generated_route(
    policy: &ApplicationTrafficPolicy,
    routing: &GatewayRouting,
    provider: Option<&dyn Provider>,
    labels: &BTreeMap<String, String>,
) -> DynamicObject {
    let (namespace, name, section) = declared_gateway(policy).expect("a generated route has a parentRef");
    let mut parent = json!({ "group": "gateway.networking.k8s.io", "kind": "Gateway", "name": name });
    if Some(&namespace) != policy.namespace().as_ref() {
        parent["namespace"] = json!(namespace);
    }
    if let Some(section) = section {
        parent["sectionName"] = json!(section);
    }
    let paths = routing.paths.as_deref().unwrap_or_default();
    let matches: Vec<_> = if paths.is_empty() {
        vec![json!({ "path": { "type": "PathPrefix", "value": "/" } })]
    } else {
        paths
            .iter()
            .map(|p| {
                let kind = match p.match_type {
                    PathMatchType::PathPrefix => "PathPrefix",
                    PathMatchType::Exact => "Exact",
                };
                json!({ "path": { "type": kind, "value": p.value } })
            })
            .collect()
    };
    let backend = routing.backend_ref.as_ref().expect("admission requires backendRef with parentRef");
    let mut rule = json!({
        "matches": matches,
        "backendRefs": [{ "group": "", "kind": "Service", "name": backend.name, "port": backend.port, "weight": 1 }]
    });
    // The filter only while there is a limit: without one, the route carries no reference to
    // an object that does not exist.
    if let Some(filter) = provider.filter(|_| policy.spec.rate_limit.is_some()).and_then(|p| p.route_filter(policy)) {
        rule["filters"] = json!([filter]);
    }
    let mut spec = json!({ "parentRefs": [parent], "rules": [rule] });
    if let Some(hostnames) = routing.hostnames.as_ref().filter(|h| !h.is_empty()) {
        spec["hostnames"] = json!(hostnames);
    }
    let mut route = DynamicObject::new(&policy.name_any(), &http_route());
    route.metadata = child_meta(policy, labels);
    route.data = json!({ "spec": spec });
    route
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::reconcile::gateway::{EnvoyGateway, Traefik};

    fn policy(gateway: serde_json::Value, rate_limit: bool) -> ApplicationTrafficPolicy {
        let mut spec = json!({ "applicationSelector": { "matchLabels": { "app": "web" } }, "gateway": gateway });
        if rate_limit {
            spec["rateLimit"] = json!({ "requestsPerSecond": 5, "burst": 0 });
        }
        let mut p = ApplicationTrafficPolicy::new("web", serde_json::from_value(spec).unwrap());
        p.metadata.namespace = Some("shop".into());
        p.metadata.uid = Some("uid-1".into());
        p
    }

    fn generated() -> serde_json::Value {
        json!({
            "parentRef": { "name": "edge", "namespace": "infra", "sectionName": "http" },
            "hostnames": ["shop.example.com"],
            "paths": [{ "value": "/api" }, { "type": "Exact", "value": "/health" }],
            "backendRef": { "name": "web", "port": 8080 }
        })
    }

    fn outputs_of(p: &ApplicationTrafficPolicy, provider: Option<&dyn Provider>) -> Outputs {
        outputs(p, p.spec.gateway.as_ref().unwrap(), provider, &BTreeMap::new())
    }

    #[test]
    fn generates_a_route_with_the_traefik_filter_and_middleware() {
        let p = policy(generated(), true);
        let out = outputs_of(&p, Some(&Traefik));
        assert_eq!(out.routes, ["web"]);
        let route = out.generated_route.unwrap();
        assert_eq!(route.metadata.owner_references.as_ref().unwrap()[0].uid, "uid-1");
        let spec = &route.data["spec"];
        assert_eq!(
            spec["parentRefs"][0],
            json!({ "group": "gateway.networking.k8s.io", "kind": "Gateway",
            "name": "edge", "namespace": "infra", "sectionName": "http" })
        );
        assert_eq!(spec["hostnames"], json!(["shop.example.com"]));
        let rule = &spec["rules"][0];
        assert_eq!(rule["matches"][0]["path"], json!({ "type": "PathPrefix", "value": "/api" }));
        assert_eq!(rule["matches"][1]["path"], json!({ "type": "Exact", "value": "/health" }));
        assert_eq!(rule["backendRefs"][0]["name"], "web");
        assert_eq!(rule["backendRefs"][0]["port"], 8080);
        assert_eq!(
            rule["filters"][0]["extensionRef"],
            json!({ "group": "traefik.io", "kind": "Middleware", "name": "web" })
        );
        let (resource, middleware) = out.limit.unwrap();
        assert_eq!((resource.kind.as_str(), resource.api_version.as_str()), ("Middleware", "traefik.io/v1alpha1"));
        assert_eq!(middleware.data["spec"]["rateLimit"], json!({ "average": 5, "burst": 1, "period": "1s" }));
    }

    #[test]
    fn no_limit_means_no_filter_and_no_limit_object() {
        let p = policy(generated(), false);
        let out = outputs_of(&p, Some(&Traefik));
        assert!(out.limit.is_none());
        assert!(out.generated_route.unwrap().data["spec"]["rules"][0].get("filters").is_none());
    }

    #[test]
    fn every_path_when_none_is_given_and_the_policys_namespace_by_default() {
        let p = policy(json!({ "parentRef": { "name": "edge" }, "backendRef": { "name": "web", "port": 80 } }), false);
        let spec = outputs_of(&p, None).generated_route.unwrap().data["spec"].clone();
        assert_eq!(spec["rules"][0]["matches"][0]["path"], json!({ "type": "PathPrefix", "value": "/" }));
        assert!(spec["parentRefs"][0].get("namespace").is_none() && spec.get("hostnames").is_none());
    }

    #[test]
    fn envoy_gateway_targets_the_named_routes() {
        let p = policy(json!({ "httpRoutes": [{ "name": "a" }, { "name": "b" }] }), true);
        let out = outputs_of(&p, Some(&EnvoyGateway));
        assert!(out.generated_route.is_none());
        assert_eq!(out.routes, ["a", "b"]);
        let (resource, btp) = out.limit.unwrap();
        assert_eq!(resource.kind, "BackendTrafficPolicy");
        let spec = &btp.data["spec"];
        assert_eq!(
            spec["targetRefs"][1],
            json!({ "group": "gateway.networking.k8s.io", "kind": "HTTPRoute", "name": "b" })
        );
        assert_eq!(spec["rateLimit"]["local"]["rules"][0]["limit"], json!({ "requests": 5, "unit": "Second" }));
    }

    #[test]
    fn no_provider_writes_no_gateway_object() {
        let p = policy(json!({ "httpRoutes": [{ "name": "a" }] }), true);
        let out = outputs_of(&p, None);
        assert!(out.limit.is_none() && out.generated_route.is_none());
    }
}

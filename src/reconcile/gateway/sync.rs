//! The reads and writes of a policy's gateway half.
//!
//! Gateway objects are not watched (their CRDs may not be installed at all). Each reconcile
//! of a policy with a gateway half reads them: an output is applied only when what it holds
//! differs from what the policy asks (the content annotation), and the routes' reports are
//! read for the conditions. While the gateway has not answered, the policy is looked at
//! again with a backoff ([`verdict::recheck_after`]).

use std::collections::BTreeMap;

use kube::ResourceExt;
use kube::api::{Api, DeleteParams, DynamicObject, ObjectMeta};
use kube::core::{ApiResource, Request};
use serde::de::IgnoredAny;
use serde_json::Value;

use super::objects::{self, Outputs};
use super::verdict::{self, RouteRead, Verdict};
use super::{PROVIDERS, Provider, gateway, gateway_class, http_route};
use crate::api::{ApplicationTrafficPolicy, ConditionStatus};
use crate::error::{Error, Result};
use crate::reconcile::CONTENT_ANNOTATION;
use crate::reconcile::TrafficPolicyReconciler;
use crate::reconcile::ownership::{self, Claim};
use crate::runtime::ObjectKey;
use crate::runtime::child_versions::ContentStamp;
use crate::runtime::child_versions::content_hash;
use crate::runtime::gate::{WriteGate, bounded, with_server_timeout};

impl TrafficPolicyReconciler {
    /// Brings the policy's gateway objects in line with its spec and reads what the gateway
    /// says of them. Empty when the policy has no gateway half; then any outputs an earlier
    /// spec asked for are removed.
    pub(in crate::reconcile) async fn sync_gateway(
        &self,
        policy: &ApplicationTrafficPolicy,
        key: &ObjectKey,
        gate: &dyn WriteGate,
        labels: &BTreeMap<String, String>,
    ) -> Result<Vec<Verdict>> {
        let Some(routing) = &policy.spec.gateway else {
            if had_gateway_half(policy) {
                self.remove_outputs(policy, gate, &[]).await?;
            }
            return Ok(Vec::new());
        };
        let namespace = policy.namespace().unwrap_or_default();
        let routes_api = Api::<DynamicObject>::namespaced_with(self.client.clone(), &namespace, &http_route());
        let route_names: Vec<String> = match &routing.http_routes {
            Some(named) => named.iter().map(|r| r.name.clone()).collect(),
            None => vec![policy.name_any()],
        };
        let mut routes: Vec<RouteRead> = Vec::new();
        for name in &route_names {
            let route = routes_api.get_opt(name).await?.map(|r| serde_json::to_value(r).expect("serializes"));
            routes.push((name.clone(), route));
        }
        // The Gateway: declared, or the first parent of the first named route.
        let gateway_ref = objects::declared_gateway(policy).map(|(ns, name, _)| (ns, name)).or_else(|| {
            let parent = &routes.iter().find_map(|(_, r)| r.as_ref())?["spec"]["parentRefs"][0];
            let name = parent["name"].as_str()?.to_string();
            Some((parent["namespace"].as_str().map_or(namespace.clone(), str::to_string), name))
        });
        let (gateway_missing, controller) = match &gateway_ref {
            Some((ns, name)) if self.gateway_provider.reads_gateway_class() || routing.parent_ref.is_some() => {
                self.gateway_controller(ns, name).await?
            }
            _ => (false, None),
        };
        let provider = self.gateway_provider.provider(controller.as_deref());
        let Outputs { generated_route, limit, .. } = objects::outputs(policy, routing, provider, labels);

        let mut verdicts = Vec::new();
        let mut route_written = false;
        if let Some(route) = generated_route
            && !gateway_missing
        {
            match self.apply_output(key, gate, &http_route(), route, routes[0].1.as_ref()).await? {
                Output::InPlace { written } => route_written = written,
                Output::Refused(verdict) => verdicts.push(verdict),
            }
        }
        let mut limit_written = false;
        let mut limit_status = None;
        if let Some((resource, object)) = limit {
            let api = Api::<DynamicObject>::namespaced_with(self.client.clone(), &namespace, &resource);
            let current = api.get_opt(&object.name_any()).await?.map(|o| serde_json::to_value(o).expect("serializes"));
            limit_status = current.as_ref().map(|c| c["status"].clone());
            match self.apply_output(key, gate, &resource, object, current.as_ref()).await? {
                Output::InPlace { written } => limit_written = written,
                Output::Refused(verdict) => verdicts.push(verdict),
            }
        }
        let keep: Vec<&str> = [
            routing.parent_ref.as_ref().map(|_| "HTTPRoute"),
            provider.filter(|_| policy.spec.rate_limit.is_some()).map(|p| p.resource().kind).map(|k| kind_name(&k)),
        ]
        .into_iter()
        .flatten()
        .collect();
        self.remove_outputs(policy, gate, &keep).await?;
        if !verdicts.is_empty() {
            return Ok(verdicts); // an object of ours could not be written: say only that
        }

        let gateway_name = gateway_ref.as_ref().map(|(ns, name)| format!("{ns}/{name}"));
        let missing = gateway_missing.then_some(gateway_name.as_deref().unwrap_or_default());
        let route = verdict::route_verdict(missing, &routes, route_written);
        let unattached = provider.and_then(|p| p.route_filter(policy)).and_then(|filter| {
            let named = routing.http_routes.as_ref()?;
            let bare = named
                .iter()
                .zip(&routes)
                .find(|(_, (_, r))| r.as_ref().is_some_and(|r| !verdict::carries_filter(r, &filter)));
            bare.map(|(r, _)| verdict::unattached(&r.name, &filter))
        });
        let no_provider = format!(
            "no provider writes a limit for {}: the limit is published in ConfigMap {namespace}/{} for a gateway that \
             reads it (docs/gateways.md)",
            match (&controller, &gateway_name) {
                (Some(c), _) => format!("the controller {c}"),
                (None, Some(g)) => format!("Gateway {g}"),
                (None, None) => "routes without a Gateway".to_string(),
            },
            policy.name_any()
        );
        verdicts.push(route.clone());
        verdicts.extend(verdict::rate_limit_verdict(
            policy.spec.rate_limit.as_ref(),
            provider,
            &no_provider,
            &route,
            unattached,
            limit_status.as_ref().filter(|s| !s.is_null()),
            limit_written,
        ));
        Ok(verdicts)
    }

    /// `(missing, controller)`: whether the Gateway is missing, and its class's controller.
    async fn gateway_controller(&self, namespace: &str, name: &str) -> Result<(bool, Option<String>)> {
        let gateways = Api::<DynamicObject>::namespaced_with(self.client.clone(), namespace, &gateway());
        let Some(found) = gateways.get_opt(name).await? else {
            return Ok((true, None));
        };
        let Some(class) = found.data["spec"]["gatewayClassName"].as_str() else {
            return Ok((false, None));
        };
        let classes = Api::<DynamicObject>::all_with(self.client.clone(), &gateway_class());
        let controller =
            classes.get_opt(class).await?.and_then(|c| c.data["spec"]["controllerName"].as_str().map(String::from));
        Ok((false, controller))
    }

    /// Applies one output unless `current` already holds it; refuses to take over an object
    /// of the same name that is not the policy's.
    async fn apply_output(
        &self,
        key: &ObjectKey,
        gate: &dyn WriteGate,
        resource: &ApiResource,
        object: DynamicObject,
        current: Option<&Value>,
    ) -> Result<Output> {
        let kind = resource.kind.as_str();
        let content = content_hash(&object);
        let claim = ownership::claim(metadata(current).as_ref(), key.name());
        if let Claim::Foreign { holder } = &claim {
            let message = ownership::clash_message(kind, key.namespace(), &object.name_any(), holder);
            let type_ = if kind == "HTTPRoute" { verdict::ROUTE_ACCEPTED } else { verdict::RATE_LIMIT_ACCEPTED };
            return Ok(Output::Refused(Verdict { type_, status: ConditionStatus::False, reason: "Conflict", message }));
        }
        if let Some(current) = current {
            let stamped = current["metadata"]["annotations"][CONTENT_ANNOTATION].as_str();
            if stamped.and_then(ContentStamp::parse) == Some(content) {
                return Ok(Output::InPlace { written: false });
            }
        }
        let api = Api::<DynamicObject>::namespaced_with(self.client.clone(), key.namespace(), resource);
        match self.send_apply(kind, api.resource_url(), object, content, &claim, key, gate).await {
            Ok(_) => Ok(Output::InPlace { written: true }),
            // The API server does not serve the kind: the gateway's CRDs are not installed.
            Err(Error::Kube(kube::Error::Api(status))) if status.code == 404 => {
                let message = format!(
                    "the API server does not serve {} {kind}: install the gateway's CRDs",
                    resource.api_version
                );
                let type_ = if kind == "HTTPRoute" { verdict::ROUTE_ACCEPTED } else { verdict::RATE_LIMIT_ACCEPTED };
                Ok(Output::Refused(Verdict { type_, status: ConditionStatus::False, reason: "NotInstalled", message }))
            }
            Err(error) => Err(error),
        }
    }

    /// Deletes the policy's gateway outputs whose kind is not in `keep`: only objects it
    /// owns, read first, so that a policy without any writes nothing.
    async fn remove_outputs(
        &self,
        policy: &ApplicationTrafficPolicy,
        gate: &dyn WriteGate,
        keep: &[&str],
    ) -> Result<()> {
        let namespace = policy.namespace().unwrap_or_default();
        let kinds = std::iter::once(http_route()).chain(PROVIDERS.iter().map(|p: &&dyn Provider| p.resource()));
        for resource in kinds.filter(|r| !keep.contains(&r.kind.as_str())) {
            let api = Api::<DynamicObject>::namespaced_with(self.client.clone(), &namespace, &resource);
            let Some(found) = api.get_opt(&policy.name_any()).await? else { continue };
            if !matches!(ownership::claim(Some(&found.metadata), &policy.name_any()), Claim::Ours { .. }) {
                continue;
            }
            // Like an apply: sent under a permit, bounded by the write bound (a delete that
            // does not answer in time is abandoned, and the gate waits out the bound), and
            // only if the object is still the version just read and found ours.
            let permit = gate.check(&resource.kind)?;
            let params = DeleteParams {
                preconditions: Some(kube::api::Preconditions {
                    uid: found.metadata.uid.clone(),
                    resource_version: found.metadata.resource_version.clone(),
                }),
                ..Default::default()
            };
            let request = Request::new(api.resource_url())
                .delete(&policy.name_any(), &params)
                .map_err(kube::Error::BuildRequest)?;
            let request = with_server_timeout(request, gate.write_bound());
            match bounded(gate, &permit, self.client.request::<IgnoredAny>(request)).await {
                Ok(_) => {}
                Err(Error::Kube(kube::Error::Api(s))) if s.code == 404 => {}
                // A 409 (changed since it was read) is refused like any other: it is retried.
                Err(e) => {
                    let object = || format!("{} {namespace}/{}", resource.kind, policy.name_any());
                    return Err(e.refusing(object));
                }
            }
        }
        Ok(())
    }
}

enum Output {
    /// In place; `written` when this reconcile wrote it.
    InPlace { written: bool },
    /// Not written, and why.
    Refused(Verdict),
}

/// The kinds [`TrafficPolicyReconciler::remove_outputs`] knows, as `'static` names.
fn kind_name(kind: &str) -> &'static str {
    ["HTTPRoute", "Middleware", "BackendTrafficPolicy"].into_iter().find(|k| *k == kind).unwrap_or("")
}

/// The metadata of an object read as JSON.
fn metadata(object: Option<&Value>) -> Option<ObjectMeta> {
    object.map(|o| serde_json::from_value(o["metadata"].clone()).unwrap_or_default())
}

/// Whether the policy's status shows a gateway half it may still have objects of.
fn had_gateway_half(policy: &ApplicationTrafficPolicy) -> bool {
    policy.status.as_ref().is_some_and(|s| {
        s.conditions.iter().any(|c| c.type_ == verdict::ROUTE_ACCEPTED || c.type_ == verdict::RATE_LIMIT_ACCEPTED)
    })
}

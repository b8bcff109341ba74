//! The traffic-policy reconcile: compute the desired children from the spec
//! ([`desired`]), apply them with server-side apply, then write status ([`status`]) and
//! events.
//!
//! Idempotent: applying unchanged children is a no-op on the server (resourceVersions stay
//! the same), and status is written only when it differs.
//!
//! Sharded: a reconcile runs only while this replica owns the policy's bucket, and checks
//! ownership again right before every write.

pub mod desired;
pub mod status;

use std::collections::BTreeMap;
use std::sync::Arc;

use k8s_openapi::api::core::v1::ConfigMap;
use k8s_openapi::api::networking::v1::NetworkPolicy;
use kube::api::{Api, Patch, PatchParams};
use kube::runtime::events::{Event, EventType, Recorder};
use kube::{Client, Resource, ResourceExt};
use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::api::ApplicationTrafficPolicy;
use crate::error::{Error, Result};
use crate::runtime::child_versions::{ApplyEffect, ChildVersions};
use crate::runtime::{Action, ObjectKey, Reconciler};
use crate::shard::ownership::{InFlight, Ownership};
use crate::sharding::bucket::{self, BUCKET_LABEL};
use crate::telemetry::audit::Audit;
use status::Outcome;

/// The field manager of every write we make.
pub const FIELD_MANAGER: &str = "traffic-policy-operator";

/// Drops what the reconcile never reads before a policy is cached (the cache holds one per
/// policy, so every field counts): managed fields, annotations, the creation timestamp,
/// and labels. The bucket label is kept only when it differs from the one the namespace
/// implies (set by hand), since [`bucket_of_policy`] falls back to the namespace.
pub fn trim_for_cache(policy: &mut ApplicationTrafficPolicy) {
    crate::runtime::watch::trim(policy);
    let implied = bucket::label_value(bucket::bucket_of(&policy.namespace().unwrap_or_default()));
    let meta = &mut policy.metadata;
    meta.annotations = None;
    meta.creation_timestamp = None;
    meta.labels = match meta.labels.take().and_then(|mut labels| labels.remove(BUCKET_LABEL)) {
        Some(label) if label != implied => Some(BTreeMap::from([(BUCKET_LABEL.to_string(), label)])),
        _ => None,
    };
}

/// The bucket a policy belongs to: its label, or, once trimmed, the namespace's bucket.
pub fn bucket_of_policy(policy: &ApplicationTrafficPolicy) -> Option<bucket::Bucket> {
    match policy.labels().get(BUCKET_LABEL) {
        Some(label) => bucket::parse_label(label),
        None => Some(bucket::bucket_of(&policy.namespace().unwrap_or_default())),
    }
}

pub struct TrafficPolicyReconciler {
    client: Client,
    recorder: Recorder,
    child_versions: Arc<ChildVersions>,
    ownership: Arc<Ownership>,
    audit: Audit,
}

/// One reconcile's right to write: the bucket's in-flight registration, and the key for
/// the audit log.
struct Turn<'a> {
    in_flight: InFlight,
    key: &'a ObjectKey,
    audit: &'a Audit,
}

impl Turn<'_> {
    /// Called right before every API write.
    fn may_write(&self, what: &str) -> Result<()> {
        if !self.in_flight.still_owned() {
            self.audit.record("write_refused", self.key, what);
            return Err(Error::LostOwnership);
        }
        self.audit.record("write", self.key, what);
        Ok(())
    }
}

impl TrafficPolicyReconciler {
    pub fn new(
        client: Client,
        recorder: Recorder,
        child_versions: Arc<ChildVersions>,
        ownership: Arc<Ownership>,
        audit: Audit,
    ) -> Self {
        Self { client, recorder, child_versions, ownership, audit }
    }

    /// Applies both children; returns what each apply did.
    async fn apply_children(
        &self,
        policy: &ApplicationTrafficPolicy,
        turn: &Turn<'_>,
    ) -> Result<Vec<(&'static str, ApplyEffect)>> {
        // Children carry the bucket too, so their watches are filtered by the API server.
        let labels = BTreeMap::from([(BUCKET_LABEL.to_string(), bucket::label_value(turn.in_flight.bucket))]);
        let namespace = policy.namespace().unwrap_or_default();
        let np = desired::network_policy(policy, &labels);
        let cm = desired::rate_limit_config_map(policy, &labels);
        let nps = Api::<NetworkPolicy>::namespaced(self.client.clone(), &namespace);
        let np_effect = self.apply("NetworkPolicy", nps, &np, policy, turn).await?;
        let cms = Api::<ConfigMap>::namespaced(self.client.clone(), &namespace);
        let cm_effect = self.apply("ConfigMap", cms, &cm, policy, turn).await?;
        Ok(vec![("NetworkPolicy", np_effect), ("ConfigMap", cm_effect)])
    }

    async fn apply<C>(
        &self,
        kind: &'static str,
        api: Api<C>,
        child: &C,
        policy: &ApplicationTrafficPolicy,
        turn: &Turn<'_>,
    ) -> Result<ApplyEffect>
    where
        C: Resource + Serialize + DeserializeOwned + Clone + std::fmt::Debug,
    {
        turn.may_write(kind)?;
        let params = PatchParams::apply(FIELD_MANAGER).force();
        let applied = api.patch(&child.name_any(), &params, &Patch::Apply(child)).await.map_err(|e| match e {
            // The server refused the object as invalid: the spec holds something the CRD
            // schema could not rule out (e.g. an invalid label key). Retrying won't help.
            kube::Error::Api(status) if status.code == 422 || status.code == 400 => {
                Error::InvalidSpec(format!("{kind} rejected by the API server: {}", status.message))
            }
            other => Error::Kube(other),
        })?;
        let version = applied.resource_version().unwrap_or_default();
        Ok(self.child_versions.written(kind, turn.key, &version, policy.meta().generation))
    }

    /// Writes status if it differs from what the cache holds.
    async fn write_status(&self, policy: &ApplicationTrafficPolicy, outcome: &Outcome, turn: &Turn<'_>) -> Result<()> {
        let now = chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Secs, true);
        let next = status::next_status(policy.status.as_ref(), policy.meta().generation, outcome, &now);
        if policy.status.as_ref() == Some(&next) {
            return Ok(());
        }
        turn.may_write("status")?;
        let api =
            Api::<ApplicationTrafficPolicy>::namespaced(self.client.clone(), &policy.namespace().unwrap_or_default());
        let patch = serde_json::json!({ "status": next });
        match api.patch_status(&policy.name_any(), &PatchParams::default(), &Patch::Merge(&patch)).await {
            Ok(_) => Ok(()),
            // Deleted meanwhile: nothing left to report on.
            Err(kube::Error::Api(s)) if s.code == 404 => Ok(()),
            Err(e) => Err(e.into()),
        }
    }

    /// Publishes an event; failures are logged, never fatal. The recorder aggregates
    /// repeats into a series instead of one event per retry.
    async fn event(
        &self,
        policy: &ApplicationTrafficPolicy,
        turn: &Turn<'_>,
        type_: EventType,
        reason: &str,
        note: String,
    ) {
        if turn.may_write("event").is_err() {
            return;
        }
        let event =
            Event { type_, reason: reason.into(), note: Some(note), action: "Reconcile".into(), secondary: None };
        if let Err(error) = self.recorder.publish(&event, &policy.object_ref(&())).await {
            tracing::debug!(%error, reason, "could not publish event");
        }
    }
}

impl Reconciler<ApplicationTrafficPolicy> for TrafficPolicyReconciler {
    async fn reconcile(&self, policy: Arc<ApplicationTrafficPolicy>) -> Result<Action> {
        let key = ObjectKey::of(policy.as_ref());
        let Some(in_flight) = bucket_of_policy(&policy).and_then(|b| self.ownership.begin(b)) else {
            return Ok(Action::Skip);
        };
        let turn = Turn { in_flight, key: &key, audit: &self.audit };
        self.audit.record("reconcile_start", &key, &turn.in_flight.bucket.to_string());
        let result = self.reconcile_owned(&policy, &turn).await;
        self.audit.record("reconcile_end", &key, result.as_ref().map_or_else(|e| e.kind(), |_| "ok"));
        result
    }

    fn forget(&self, key: &ObjectKey) {
        self.child_versions.forget_owner(key);
    }
}

impl TrafficPolicyReconciler {
    async fn reconcile_owned(&self, policy: &ApplicationTrafficPolicy, turn: &Turn<'_>) -> Result<Action> {
        let generation = policy.meta().generation.unwrap_or_default();
        let write = self.child_versions.begin_write(turn.key);
        let applied = self.apply_children(policy, turn).await;
        let changed_meanwhile = write.finish();
        match applied {
            Ok(effects) => {
                self.write_status(policy, &Outcome::Applied, turn).await?;
                // One event per reconcile that changed something: events are writes too.
                let kinds = |wanted: &[ApplyEffect]| -> Vec<&str> {
                    effects.iter().filter(|(_, e)| wanted.contains(e)).map(|(k, _)| *k).collect()
                };
                let repaired = kinds(&[ApplyEffect::Repaired]);
                let applied = kinds(&[ApplyEffect::Applied, ApplyEffect::Updated]);
                if !repaired.is_empty() {
                    let note = format!("Restored {} after an outside change", repaired.join(" and "));
                    self.event(policy, turn, EventType::Normal, "Repaired", note).await;
                } else if !applied.is_empty() {
                    let note = format!("Applied {} for generation {generation}", applied.join(" and "));
                    self.event(policy, turn, EventType::Normal, "Applied", note).await;
                }
                // Someone changed a child while we wrote it: look again at once.
                Ok(if changed_meanwhile { Action::RequeueAfter(std::time::Duration::ZERO) } else { Action::Done })
            }
            Err(Error::InvalidSpec(message)) => {
                self.write_status(policy, &Outcome::InvalidSpec(message.clone()), turn).await?;
                self.event(policy, turn, EventType::Warning, "InvalidSpec", message.clone()).await;
                Err(Error::InvalidSpec(message))
            }
            Err(Error::LostOwnership) => Err(Error::LostOwnership),
            Err(error) => {
                // Best effort: the API may be what is failing.
                let _ = self.write_status(policy, &Outcome::ApplyFailed(error.to_string()), turn).await;
                self.event(policy, turn, EventType::Warning, "ApplyFailed", error.to_string()).await;
                Err(error)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::{ApplicationSelector, ApplicationTrafficPolicySpec};

    fn policy(namespace: &str, labels: &[(&str, &str)]) -> ApplicationTrafficPolicy {
        let selector = ApplicationSelector { match_labels: [("app", "web")].into_iter().collect() };
        let spec = ApplicationTrafficPolicySpec {
            application_selector: selector,
            ingress_rules: vec![],
            egress_rules: vec![],
            rate_limit: None,
        };
        let mut p = ApplicationTrafficPolicy::new("web", spec);
        p.metadata.namespace = Some(namespace.into());
        p.metadata.labels = Some(labels.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect());
        p.metadata.annotations = Some(BTreeMap::from([("note".to_string(), "x".to_string())]));
        p
    }

    #[test]
    fn trimming_keeps_the_bucket_the_reconcile_needs() {
        let implied = bucket::label_value(bucket::bucket_of("shop"));
        let mut usual = policy("shop", &[(BUCKET_LABEL, &implied), ("team", "blue")]);
        trim_for_cache(&mut usual);
        assert!(usual.metadata.labels.is_none() && usual.metadata.annotations.is_none());
        assert_eq!(bucket_of_policy(&usual), Some(bucket::bucket_of("shop")));

        let other = if implied == "7" { "8" } else { "7" };
        let mut by_hand = policy("shop", &[(BUCKET_LABEL, other)]);
        trim_for_cache(&mut by_hand);
        assert_eq!(bucket_of_policy(&by_hand), bucket::parse_label(other), "a hand-set bucket wins, as in the watch");
    }
}

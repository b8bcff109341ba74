//! The traffic-policy reconcile: compute the desired children from the spec
//! ([`desired`]), apply them with server-side apply, then write status ([`status`]) and
//! events.
//!
//! Idempotent: applying unchanged children is a no-op on the server (resourceVersions stay
//! the same), and status is written only when it differs.

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
use status::Outcome;

/// The field manager of every write we make.
pub const FIELD_MANAGER: &str = "traffic-policy-operator";

pub struct TrafficPolicyReconciler {
    client: Client,
    recorder: Recorder,
    child_versions: Arc<ChildVersions>,
}

impl TrafficPolicyReconciler {
    pub fn new(client: Client, recorder: Recorder, child_versions: Arc<ChildVersions>) -> Self {
        Self { client, recorder, child_versions }
    }

    /// Applies both children; returns the strongest effect seen.
    async fn apply_children(&self, policy: &ApplicationTrafficPolicy) -> Result<Vec<(&'static str, ApplyEffect)>> {
        let labels = BTreeMap::new();
        let namespace = policy.namespace().unwrap_or_default();
        let np = desired::network_policy(policy, &labels);
        let cm = desired::rate_limit_config_map(policy, &labels);
        let np_effect = self
            .apply("NetworkPolicy", Api::<NetworkPolicy>::namespaced(self.client.clone(), &namespace), &np, policy)
            .await?;
        let cm_effect =
            self.apply("ConfigMap", Api::<ConfigMap>::namespaced(self.client.clone(), &namespace), &cm, policy).await?;
        Ok(vec![("NetworkPolicy", np_effect), ("ConfigMap", cm_effect)])
    }

    async fn apply<C>(
        &self,
        kind: &'static str,
        api: Api<C>,
        child: &C,
        policy: &ApplicationTrafficPolicy,
    ) -> Result<ApplyEffect>
    where
        C: Resource + Serialize + DeserializeOwned + Clone + std::fmt::Debug,
    {
        let params = PatchParams::apply(FIELD_MANAGER).force();
        let applied = api.patch(&child.name_any(), &params, &Patch::Apply(child)).await.map_err(|e| match e {
            // The server refused the object as invalid: the spec holds something the CRD
            // schema could not rule out (e.g. an invalid label key). Retrying won't help.
            kube::Error::Api(status) if status.code == 422 || status.code == 400 => {
                Error::InvalidSpec(format!("{kind} rejected by the API server: {}", status.message))
            }
            other => Error::Kube(other),
        })?;
        let key = ObjectKey::of(policy);
        Ok(self.child_versions.written(
            kind,
            &key,
            &applied.resource_version().unwrap_or_default(),
            policy.meta().generation,
        ))
    }

    /// Writes status if it differs from what the cache holds.
    async fn write_status(&self, policy: &ApplicationTrafficPolicy, outcome: &Outcome) -> Result<()> {
        let now = chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Secs, true);
        let next = status::next_status(policy.status.as_ref(), policy.meta().generation, outcome, &now);
        if policy.status.as_ref() == Some(&next) {
            return Ok(());
        }
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
    async fn event(&self, policy: &ApplicationTrafficPolicy, type_: EventType, reason: &str, note: String) {
        let event =
            Event { type_, reason: reason.into(), note: Some(note), action: "Reconcile".into(), secondary: None };
        if let Err(error) = self.recorder.publish(&event, &policy.object_ref(&())).await {
            tracing::debug!(%error, reason, "could not publish event");
        }
    }
}

impl Reconciler<ApplicationTrafficPolicy> for TrafficPolicyReconciler {
    async fn reconcile(&self, policy: Arc<ApplicationTrafficPolicy>) -> Result<Action> {
        let generation = policy.meta().generation.unwrap_or_default();
        let key = ObjectKey::of(policy.as_ref());
        let write = self.child_versions.begin_write(&key);
        let applied = self.apply_children(&policy).await;
        let changed_meanwhile = write.finish();
        match applied {
            Ok(effects) => {
                self.write_status(&policy, &Outcome::Applied).await?;
                for (kind, effect) in effects {
                    match effect {
                        ApplyEffect::Repaired => {
                            self.event(
                                &policy,
                                EventType::Normal,
                                "Repaired",
                                format!("Restored {kind} after an outside change"),
                            )
                            .await
                        }
                        ApplyEffect::Applied | ApplyEffect::Updated => {
                            self.event(
                                &policy,
                                EventType::Normal,
                                "Applied",
                                format!("Applied {kind} for generation {generation}"),
                            )
                            .await
                        }
                        ApplyEffect::Unchanged => {}
                    }
                }
                // Someone changed a child while we wrote it: look again at once.
                Ok(if changed_meanwhile { Action::RequeueAfter(std::time::Duration::ZERO) } else { Action::Done })
            }
            Err(Error::InvalidSpec(message)) => {
                self.write_status(&policy, &Outcome::InvalidSpec(message.clone())).await?;
                self.event(&policy, EventType::Warning, "InvalidSpec", message.clone()).await;
                Err(Error::InvalidSpec(message))
            }
            Err(error) => {
                // Best effort: the API may be what is failing.
                let _ = self.write_status(&policy, &Outcome::ApplyFailed(error.to_string())).await;
                self.event(&policy, EventType::Warning, "ApplyFailed", error.to_string()).await;
                Err(error)
            }
        }
    }

    fn forget(&self, key: &ObjectKey) {
        self.child_versions.forget_owner(key);
    }
}

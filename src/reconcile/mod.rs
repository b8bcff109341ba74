//! The traffic-policy reconcile: compute the desired children from the spec
//! ([`desired`]), apply them with server-side apply, then write status ([`status`]) and
//! events.
//!
//! Writes only what changes: a child known to hold what we would apply (see
//! [`ChildVersions::holds`]) is not applied again, and status is written only when it
//! differs. So a resync, a restart or a handoff of unchanged policies writes nothing.
//!
//! Every write goes through the [`WriteGate`] it is given: checked right before it is sent,
//! stamped with the gate's fencing token, and bounded in time on both ends. Who may write,
//! how the token is carried and how a refusal of it reads (sharding and fencing) are the
//! gate's business, not this module's.

pub mod cached;
pub mod desired;
pub mod events;
pub mod gateway;
pub mod ownership;
pub mod status;

use std::collections::BTreeMap;
use std::sync::Arc;

use k8s_openapi::api::core::v1::ConfigMap;
use k8s_openapi::api::networking::v1::NetworkPolicy;
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, Patch, PatchParams};
use kube::core::Request;
use kube::runtime::events::EventType;
use kube::{Client, Resource, ResourceExt};
use serde::de::IgnoredAny;
use serde::{Deserialize, Serialize};

use self::cached::CachedPolicy;
use self::events::{Events, Occurrence};
use self::gateway::verdict::Verdict;
use self::ownership::Claim;
use crate::api::{ApplicationTrafficPolicy, Time};
use crate::error::{Error, Result};
use crate::runtime::child_versions::{ApplyEffect, ChildVersions, ContentStamp, content_hash};
use crate::runtime::gate::{WriteGate, bounded, with_server_timeout};
use crate::runtime::{Action, ObjectKey, Priority, Reconciler};
use crate::test_faults::TestFaults;
use status::Outcome;

/// The field manager of every write we make.
pub const FIELD_MANAGER: &str = "traffic-policy-operator";

/// On every child we write: the [`content_hash`] of what we wrote, in hex.
pub const CONTENT_ANNOTATION: &str = "trafficpolicy.dev/content";

/// How the child watches tell a child still as we wrote it (see [`ChildVersions`]).
pub const CONTENT_STAMP: ContentStamp = ContentStamp { annotation: CONTENT_ANNOTATION, field_manager: FIELD_MANAGER };

/// All the reconcile reads of a child's apply answer: its new resourceVersion. Reading
/// only this lets serde skip the rest of the object unparsed, its managedFields above all,
/// which the answer repeats in full (the status and event answers are skipped whole).
#[derive(Deserialize)]
struct ApplyAnswer {
    metadata: AnswerMetadata,
}

#[derive(Deserialize)]
struct AnswerMetadata {
    #[serde(rename = "resourceVersion", default)]
    resource_version: String,
}

/// A child as the policy asks for it, with the [`content_hash`] of what that is.
struct Desired<C> {
    kind: &'static str,
    object: C,
    content: u64,
}

impl<C: Serialize> Desired<C> {
    fn new(kind: &'static str, object: C) -> Self {
        let content = content_hash(&object);
        Self { kind, object, content }
    }
}

pub struct TrafficPolicyReconciler {
    client: Client,
    events: Events,
    child_versions: Arc<ChildVersions>,
    /// What the tests make a reconcile do (nothing, without the `test-faults` feature).
    pub faults: TestFaults,
    /// Which gateway provider writes the rate limits (`--gateway-provider`).
    pub gateway_provider: gateway::ProviderChoice,
}

impl TrafficPolicyReconciler {
    pub fn new(client: Client, events: Events, child_versions: Arc<ChildVersions>) -> Self {
        Self { client, events, child_versions, faults: TestFaults::default(), gateway_provider: Default::default() }
    }

    /// Applies both children, side by side (neither depends on the other, and a reconcile
    /// takes one round trip to the API server instead of two); returns what each apply did.
    /// Each child to be written is read first, and while either name is someone else's
    /// object, neither is written ([`ownership`]).
    async fn apply_children(
        &self,
        policy: &ApplicationTrafficPolicy,
        key: &ObjectKey,
        gate: &dyn WriteGate,
        labels: &BTreeMap<String, String>,
    ) -> Result<Vec<(&'static str, ApplyEffect)>> {
        // Not even a read for a replica that may not write.
        if !gate.permitted() {
            return Err(Error::LostOwnership);
        }
        let namespace = policy.namespace().unwrap_or_default();
        let np = Desired::new("NetworkPolicy", desired::network_policy(policy, labels));
        let cm = Desired::new("ConfigMap", desired::rate_limit_config_map(policy, labels));
        let nps = Api::<NetworkPolicy>::namespaced(self.client.clone(), &namespace);
        let cms = Api::<ConfigMap>::namespaced(self.client.clone(), &namespace);
        let (np_claim, cm_claim) = futures::try_join!(self.claim(&nps, &np, key), self.claim(&cms, &cm, key))?;
        let clashes: Vec<String> = [(np.kind, &np_claim), (cm.kind, &cm_claim)]
            .into_iter()
            .filter_map(|(kind, claim)| match claim {
                Some(Claim::Foreign { holder }) => {
                    Some(ownership::clash_message(kind, &namespace, &policy.name_any(), holder))
                }
                _ => None,
            })
            .collect();
        if !clashes.is_empty() {
            return Err(Error::NotOwned(clashes.join("; ")));
        }
        // Both run to their end, so that what each did is recorded whatever the other did.
        let (np_effect, cm_effect) = futures::join!(
            self.apply(nps, np, np_claim, policy, key, gate),
            self.apply(cms, cm, cm_claim, policy, key, gate),
        );
        Ok(vec![("NetworkPolicy", np_effect?), ("ConfigMap", cm_effect?)])
    }

    /// Whose the object of `child`'s name is; `None` when the child is known to hold what we
    /// would write, and nothing is to be written. A child known to be as our last write left
    /// it (the child watch saw no one else change it) is ours without a read; any other is
    /// read from the server.
    async fn claim<C>(&self, api: &Api<C>, child: &Desired<C>, key: &ObjectKey) -> Result<Option<Claim>>
    where
        C: Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug,
    {
        if self.child_versions.holds(child.kind, key, child.content) {
            return Ok(None);
        }
        if self.child_versions.as_written(child.kind, key) {
            return Ok(Some(Claim::Ours { resource_version: None }));
        }
        let name = child.object.name_any();
        let existing = api
            .get_metadata_opt(&name)
            .await
            .map_err(|e| Error::from(e).refusing(|| format!("{} {}/{name}", child.kind, key.namespace())))?;
        Ok(Some(ownership::claim(existing.as_ref().map(|e| &e.metadata), key.name())))
    }

    async fn apply<C>(
        &self,
        api: Api<C>,
        child: Desired<C>,
        claim: Option<Claim>,
        policy: &ApplicationTrafficPolicy,
        key: &ObjectKey,
        gate: &dyn WriteGate,
    ) -> Result<ApplyEffect>
    where
        C: Resource + Serialize,
    {
        let Some(claim) = claim else {
            return Ok(ApplyEffect::Unchanged);
        };
        let Desired { kind, object, content } = child;
        let version = self.send_apply(kind, api.resource_url(), object, content, &claim, key, gate).await?;
        Ok(self.child_versions.written(kind, key, &version, policy.meta().generation, content))
    }

    /// Server-side applies `child`, stamped with its `content` hash and the gate's fencing
    /// token; returns its new resourceVersion. `claim` says what it meets: an absent object is
    /// created by a plain apply, which fails on a same-named object made meanwhile whose
    /// fields differ; the policy's own is forced back to what we apply, provided it is still at
    /// the version read, if one was, so that an object someone else made in its place
    /// meanwhile is not taken over.
    #[allow(clippy::too_many_arguments)]
    async fn send_apply<C>(
        &self,
        kind: &str,
        url: &str,
        mut child: C,
        content: u64,
        claim: &Claim,
        key: &ObjectKey,
        gate: &dyn WriteGate,
    ) -> Result<String>
    where
        C: Resource + Serialize,
    {
        let params = match claim {
            Claim::Absent => PatchParams::apply(FIELD_MANAGER),
            Claim::Ours { resource_version } => {
                child.meta_mut().resource_version = resource_version.clone();
                PatchParams::apply(FIELD_MANAGER).force()
            }
            Claim::Foreign { holder } => {
                let message = ownership::clash_message(kind, key.namespace(), &child.name_any(), holder);
                return Err(Error::NotOwned(message));
            }
        };
        let permit = gate.check(kind)?;
        CONTENT_STAMP.put(child.annotations_mut(), content);
        gate.stamp(&permit, child.annotations_mut());
        let request = Request::new(url)
            .patch(&child.name_any(), &params, &Patch::Apply(&child))
            .map_err(kube::Error::BuildRequest)?;
        let request = with_server_timeout(request, gate.write_bound());
        let answer: ApplyAnswer = bounded(gate, &permit, self.client.request(request)).await.map_err(|e| match e {
            Error::Fenced(refusal) => {
                Error::Fenced(format!("{kind} {}/{}: {refusal}", key.namespace(), child.name_any()))
            }
            // The server refused the object as invalid: the spec holds something the CRD
            // schema could not rule out (e.g. an invalid label key). Retrying won't help.
            Error::Kube(kube::Error::Api(status)) if status.code == 422 || status.code == 400 => {
                Error::InvalidSpec(format!("{kind} rejected by the API server: {}", status.message))
            }
            other => other.refusing(|| format!("{kind} {}/{}", key.namespace(), child.name_any())),
        })?;
        Ok(answer.metadata.resource_version)
    }

    /// Writes status if it differs from what the cache holds (the fencing token aside).
    async fn write_status(
        &self,
        policy: &ApplicationTrafficPolicy,
        outcome: &Outcome,
        gateway: Option<&[Verdict]>,
        gate: &dyn WriteGate,
    ) -> Result<()> {
        let now = now();
        let mut next = status::next_status(policy.status.as_ref(), policy.meta().generation, outcome, gateway, &now);
        // Unchanged: nothing to write, even when a previous owner's epoch is on it (see
        // docs/sharding.md, "Fencing without rewrites").
        if policy.status.as_ref() == Some(&next) {
            return Ok(());
        }
        let permit = gate.check("status")?;
        next.shard_epoch = Some(permit.token);
        let api =
            Api::<ApplicationTrafficPolicy>::namespaced(self.client.clone(), &policy.namespace().unwrap_or_default());
        let patch = serde_json::json!({ "status": next });
        let request = Request::new(api.resource_url())
            .patch_subresource("status", &policy.name_any(), &PatchParams::default(), &Patch::Merge(&patch))
            .map_err(kube::Error::BuildRequest)?;
        let request = with_server_timeout(request, gate.write_bound());
        match bounded(gate, &permit, self.client.request::<IgnoredAny>(request)).await {
            Ok(_) => Ok(()),
            // Deleted meanwhile: nothing left to report on.
            Err(Error::Kube(kube::Error::Api(s))) if s.code == 404 => Ok(()),
            Err(Error::Fenced(refusal)) => {
                let policy = format!("{}/{}", policy.namespace().unwrap_or_default(), policy.name_any());
                Err(Error::Fenced(format!("the status of ApplicationTrafficPolicy {policy}: {refusal}")))
            }
            Err(e) => Err(e),
        }
    }

    /// A write was fenced although this replica still owns the policy's bucket. A bucket
    /// moves only once its owner has let go, so no newer owner of this install wrote the
    /// stored token: the generation floor was lost, or another install or a hand edit set
    /// it. The gate has told the leader, which grants above it; until then say so in the
    /// status (if the status itself is not what is fenced) and in a Warning event.
    async fn token_conflict(&self, policy: &ApplicationTrafficPolicy, gate: &dyn WriteGate, refused: &str) -> Error {
        let message = format!(
            "{refused}. This replica owns the policy's bucket, so the stored fencing token was written by an earlier \
             install whose generation floor was lost, by another install, or by hand. The leader revokes every \
             bucket and grants above it within a lease duration; if this stays, see docs/operations.md, \
             \"Fencing token conflicts\""
        );
        if let Err(error) = self.write_status(policy, &Outcome::TokenConflict(message.clone()), None, gate).await {
            tracing::debug!(%error, "could not report the fencing token conflict in the status");
        }
        self.event(policy, gate, Occurrence::Repeating(EventType::Warning), status::TOKEN_CONFLICT, message.clone())
            .await;
        Error::ForeignToken(message)
    }

    /// Says in the status and in a Warning event (of the outcome's reason) why the policy is
    /// not applied; the result is the status write's.
    async fn report_failure(
        &self,
        policy: &ApplicationTrafficPolicy,
        gate: &dyn WriteGate,
        outcome: Outcome,
    ) -> Result<()> {
        let written = self.write_status(policy, &outcome, None, gate).await;
        let (reason, message) = outcome.reason_and_message();
        self.event(policy, gate, Occurrence::Repeating(EventType::Warning), reason, message).await;
        written
    }

    /// Publishes an event; failures are logged, never fatal. True when it was published.
    async fn event(
        &self,
        policy: &ApplicationTrafficPolicy,
        gate: &dyn WriteGate,
        occurrence: Occurrence,
        reason: &str,
        note: String,
    ) -> bool {
        if gate.check("event").is_err() {
            return false;
        }
        match self.events.publish(policy, occurrence, reason, note).await {
            Ok(()) => true,
            Err(error) => {
                tracing::debug!(%error, reason, "could not publish event");
                false
            }
        }
    }
}

/// Now, in whole seconds, as the API server keeps metav1.Time.
fn now() -> Time {
    Time(Timestamp::from_second(Timestamp::now().as_second()).expect("now is in range"))
}

impl Reconciler<CachedPolicy> for TrafficPolicyReconciler {
    async fn reconcile(
        &self,
        key: &ObjectKey,
        cached: Arc<CachedPolicy>,
        gate: &dyn WriteGate,
        _: Priority,
    ) -> Result<Action> {
        self.faults.before_reconcile(key).await;
        // The policy in full for this reconcile only: the cache keeps it compact.
        let policy = cached.to_policy(key);
        let generation = policy.meta().generation.unwrap_or_default();
        let uid = policy.meta().uid.as_deref().unwrap_or_default();
        // Children carry the gate's routing labels, so their watches are filtered by the API server.
        let labels: BTreeMap<String, String> = gate.routing_labels().into_iter().collect();
        let write = self.child_versions.begin_write(key);
        let children = self.apply_children(&policy, key, gate, &labels).await;
        let changed_meanwhile = write.finish();
        let written = match children {
            Ok(effects) => self.sync_gateway(&policy, key, gate, &labels).await.map(|verdicts| (effects, verdicts)),
            Err(error) => Err(error),
        };
        match written {
            Ok((effects, verdicts)) => {
                // Reported once per generation: the cache may not show yet the status this
                // replica wrote with its event, so its own last event counts too.
                let already_reported = status::says_applied(cached.ready(), Some(generation))
                    || self.child_versions.reported(key, uid, Some(generation));
                let reports = events::after_apply(&effects, generation, already_reported);
                let repaired = async {
                    if let Some(events::Report { occurrence, reason, note }) = reports.repaired {
                        self.event(&policy, gate, occurrence, reason, note).await;
                    }
                };
                let applied_event = async {
                    if let Some(events::Report { occurrence, reason, note }) = reports.applied
                        && self.event(&policy, gate, occurrence, reason, note).await
                    {
                        self.child_versions.mark_reported(key, uid, Some(generation));
                    }
                };
                // The status and the events side by side: none waits for another.
                let (status, (), ()) = futures::join!(
                    self.write_status(&policy, &Outcome::Applied, Some(&verdicts), gate),
                    repaired,
                    applied_event
                );
                match status {
                    // Fenced while this replica owns the bucket: a foreign token, as for a child.
                    Err(Error::Fenced(refused)) if gate.permitted() => {
                        return Err(self.token_conflict(&policy, gate, &refused).await);
                    }
                    status => status?,
                }
                let recheck =
                    gateway::verdict::recheck_after(&verdicts, status::pending_for(policy.status.as_ref(), &now()));
                Ok(match (changed_meanwhile, recheck) {
                    // Someone changed a child while we wrote it: look again at once.
                    (true, _) => Action::RequeueAfter(std::time::Duration::ZERO),
                    // The gateway has yet to answer, or refused: look again later.
                    (false, Some(after)) => Action::RequeueAfter(after),
                    (false, None) => Action::Done,
                })
            }
            Err(Error::InvalidSpec(message)) => {
                self.report_failure(&policy, gate, Outcome::InvalidSpec(message.clone())).await?;
                Err(Error::InvalidSpec(message))
            }
            // Nothing was written: the status says whose object is in the way.
            Err(Error::NotOwned(message)) => {
                self.report_failure(&policy, gate, Outcome::Conflict(message.clone())).await?;
                Err(Error::NotOwned(message))
            }
            Err(Error::Fenced(refused)) if gate.permitted() => Err(self.token_conflict(&policy, gate, &refused).await),
            Err(error @ (Error::LostOwnership | Error::Fenced(_) | Error::EarlierWriteLanding(_))) => Err(error),
            Err(error) => {
                // Best effort: the API may be what is failing.
                let _ = self.report_failure(&policy, gate, Outcome::ApplyFailed(error.to_string())).await;
                Err(error)
            }
        }
    }

    fn forget(&self, key: &ObjectKey) {
        self.child_versions.forget_owner(key);
    }
}

#[cfg(test)]
mod tests;

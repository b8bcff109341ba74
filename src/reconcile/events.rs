//! Events on policies, as `events.k8s.io/v1` Events.
//!
//! An event that happens once per generation of a policy ("Applied") is created directly
//! ([`Occurrence::Once`]). kube's `Recorder` would keep it for six minutes to fold repeats into a
//! series: one cache entry per policy of the slice, and a scan of the whole cache on every
//! publish. Events that can repeat (a warning on every retry, a repair on every outside
//! change) go through the `Recorder` ([`Occurrence::Repeating`]), whose cache then holds only the
//! policies that are failing or being fought over.

use k8s_openapi::api::core::v1::ObjectReference;
use k8s_openapi::api::events::v1::Event as K8sEvent;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
use kube::api::{Api, ObjectMeta, PostParams};
use kube::core::Request;
use kube::runtime::events::{Event, EventType, Recorder, Reporter};
use kube::{Client, Resource};
use serde::de::IgnoredAny;

use crate::api::ApplicationTrafficPolicy;
use crate::runtime::child_versions::ApplyEffect;

/// How often an event can happen for one generation of a policy.
#[derive(Clone, Copy, Debug)]
pub enum Occurrence {
    /// Once (a Normal event): created as it is, nothing kept.
    Once,
    /// Again and again: repeats within six minutes become one event with a count.
    Repeating(EventType),
}

#[derive(Clone)]
pub struct Events {
    client: Client,
    reporter: Reporter,
    folded: Recorder,
}

impl Events {
    pub fn new(client: Client, reporter: Reporter) -> Self {
        Self { folded: Recorder::new(client.clone(), reporter.clone()), client, reporter }
    }

    /// Publishes an event about `policy`.
    pub async fn publish(
        &self,
        policy: &ApplicationTrafficPolicy,
        occurrence: Occurrence,
        reason: &str,
        note: String,
    ) -> Result<(), kube::Error> {
        match occurrence {
            Occurrence::Repeating(type_) => {
                let event =
                    Event { type_, reason: reason.into(), note: Some(note), action: ACTION.into(), secondary: None };
                self.folded.publish(&event, &policy.object_ref(&())).await
            }
            Occurrence::Once => {
                let event = self.normal(policy.object_ref(&()), reason, note);
                let namespace = event.metadata.namespace.clone().unwrap_or_default();
                let url = Api::<K8sEvent>::namespaced(self.client.clone(), &namespace).resource_url().to_string();
                let body = serde_json::to_vec(&event).map_err(kube::Error::SerdeError)?;
                let request =
                    Request::new(url).create(&PostParams::default(), body).map_err(kube::Error::BuildRequest)?;
                // The answer repeats the event: nothing in it is read, so it is skipped unparsed.
                self.client.request::<IgnoredAny>(request).await.map(drop)
            }
        }
    }

    /// A Normal event, named as kube's `Recorder` names its events (object name and time;
    /// a policy always has a name and a namespace).
    fn normal(&self, reference: ObjectReference, reason: &str, note: String) -> K8sEvent {
        let now = k8s_openapi::jiff::Timestamp::now();
        let name = reference.name.clone().unwrap_or_default();
        K8sEvent {
            metadata: ObjectMeta {
                namespace: reference.namespace.clone(),
                name: Some(format!("{name}.{:x}", now.as_nanosecond())),
                ..Default::default()
            },
            event_time: Some(MicroTime(now)),
            action: Some(ACTION.into()),
            reason: Some(reason.into()),
            note: Some(note),
            regarding: Some(reference),
            reporting_controller: Some(self.reporter.controller.clone()),
            reporting_instance: Some(
                self.reporter.instance.clone().unwrap_or_else(|| self.reporter.controller.clone()),
            ),
            type_: Some("Normal".into()),
            ..Default::default()
        }
    }
}

/// An event to publish, as decided from what a reconcile did.
#[derive(Debug)]
pub struct Report {
    pub occurrence: Occurrence,
    pub reason: &'static str,
    pub note: String,
}

/// What a reconcile that put every child in place reports.
#[derive(Debug)]
pub struct Reports {
    /// Children someone else had changed or deleted, restored.
    pub repaired: Option<Report>,
    /// The generation is in place: once per generation, and whenever a child was written for it.
    pub applied: Option<Report>,
}

/// What to report, given what each apply did (`effects`, by kind) and whether `generation`
/// was reported already (by the policy's status, or by this replica's last event).
///
/// Every generation that becomes Ready gets its "Applied" event, even when this reconcile
/// found the children in place: a replica may have applied them and then stopped, or lost
/// the policy, before it wrote status and event. Whoever writes that status reports it.
pub fn after_apply(effects: &[(&str, ApplyEffect)], generation: i64, already_reported: bool) -> Reports {
    let kinds = |wanted: &[ApplyEffect]| -> Vec<&str> {
        effects.iter().filter(|(_, e)| wanted.contains(e)).map(|(k, _)| *k).collect()
    };
    let repaired = kinds(&[ApplyEffect::Repaired]);
    let written = kinds(&[ApplyEffect::FirstWrite, ApplyEffect::Updated]);
    let repaired = (!repaired.is_empty()).then(|| Report {
        occurrence: Occurrence::Repeating(EventType::Normal),
        reason: "Repaired",
        note: format!("Restored {} after an outside change", repaired.join(" and ")),
    });
    let note = if !written.is_empty() {
        Some(format!("Applied {} for generation {generation}", written.join(" and ")))
    } else if !already_reported {
        let all: Vec<&str> = effects.iter().map(|(k, _)| *k).collect();
        Some(format!("{} in place for generation {generation}", all.join(" and ")))
    } else {
        None
    };
    let applied = note.map(|note| Report { occurrence: Occurrence::Once, reason: "Applied", note });
    Reports { repaired, applied }
}

/// What every event of ours says the operator did.
const ACTION: &str = "Reconcile";

#[cfg(test)]
mod tests {
    use super::*;
    use ApplyEffect::*;

    fn notes(reports: Reports) -> [Option<String>; 2] {
        [reports.repaired.map(|r| r.note), reports.applied.map(|r| r.note)]
    }

    #[test]
    fn a_repair_is_reported_as_it_repeats() {
        let reports = after_apply(&[("NetworkPolicy", Repaired), ("ConfigMap", Unchanged)], 3, true);
        assert!(matches!(reports.repaired, Some(Report { occurrence: Occurrence::Repeating(EventType::Normal), .. })));
        assert_eq!(notes(reports), [Some("Restored NetworkPolicy after an outside change".into()), None]);
    }

    #[test]
    fn what_was_written_is_reported_once() {
        let reports = after_apply(&[("NetworkPolicy", Updated), ("ConfigMap", Unchanged)], 2, true);
        assert!(matches!(reports.applied, Some(Report { occurrence: Occurrence::Once, reason: "Applied", .. })));
        assert_eq!(notes(reports), [None, Some("Applied NetworkPolicy for generation 2".into())]);
    }

    #[test]
    fn children_found_in_place_for_an_unreported_generation_are_reported() {
        let reports = after_apply(&[("NetworkPolicy", Unchanged), ("ConfigMap", Unchanged)], 4, false);
        assert_eq!(notes(reports), [None, Some("NetworkPolicy and ConfigMap in place for generation 4".into())]);
    }

    #[test]
    fn a_repair_of_an_unreported_generation_reports_both() {
        let reports = after_apply(&[("NetworkPolicy", Repaired), ("ConfigMap", Unchanged)], 5, false);
        assert_eq!(
            notes(reports),
            [
                Some("Restored NetworkPolicy after an outside change".into()),
                Some("NetworkPolicy and ConfigMap in place for generation 5".into())
            ]
        );
    }

    #[test]
    fn nothing_new_is_not_reported() {
        let reports = after_apply(&[("NetworkPolicy", Unchanged), ("ConfigMap", Unchanged)], 4, true);
        assert_eq!(notes(reports), [None, None]);
    }
}

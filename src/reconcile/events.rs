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

/// What every event of ours says the operator did.
const ACTION: &str = "Reconcile";

//! The leader's first labelling duty in label mode: each namespace carries its own bucket
//! label, so that deploy/'s MutatingAdmissionPolicy (components/bucket-labels) can copy it onto
//! every policy the API server admits there. A policy then carries its bucket from its first
//! write, reaches its owner at once, and costs the leader no PATCH of its own: one write per
//! namespace replaces one per policy. CEL cannot compute the bucket (an xxh3 hash), hence the
//! label on the namespace.
//!
//! Without the admission policy the namespace labels do nothing, and [`super::labeller`] labels
//! each policy, as it still does for one admitted before its namespace was labelled.

use futures::StreamExt;
use k8s_openapi::api::core::v1::Namespace;
use kube::api::{Api, PartialObjectMeta, Patch, PatchParams};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Client, ResourceExt};

use crate::sharding::bucket::{BUCKET_LABEL, bucket_of, label_value};
use crate::telemetry::metrics as m;

/// Namespaces labelled at once after a (re)list: a cluster may have thousands.
const CONCURRENCY: usize = 16;

/// Keeps every watched namespace's bucket label right (a namespace created later, or a label
/// removed or changed by hand, included). Runs while leading. Returns if RBAC refuses it: the
/// policy labeller covers for it, more slowly.
pub async fn label_namespaces(client: Client, watch_namespace: Option<String>) {
    let api: Api<Namespace> = Api::all(client.clone());
    let metadata: Api<PartialObjectMeta<Namespace>> = Api::all(client);
    let config = match &watch_namespace {
        Some(name) => watcher::Config::default().fields(&format!("metadata.name={name}")),
        None => watcher::Config::default(),
    };
    let events = watcher(metadata, config).default_backoff();
    // A watch error other than 403 ends nothing: the watcher retries with backoff, and its
    // relist brings every namespace again, so a labelling that failed is tried again then.
    let outcomes = events
        .map(|event| async {
            match event {
                Ok(watcher::Event::Apply(ns) | watcher::Event::InitApply(ns)) => {
                    let bucket = label_value(bucket_of(&ns.name_any()));
                    if ns.labels().get(BUCKET_LABEL) == Some(&bucket) {
                        return Outcome::Done;
                    }
                    label_one(&api, ns.name_any(), bucket).await
                }
                Ok(_) => Outcome::Done,
                Err(watcher::Error::InitialListFailed(kube::Error::Api(s))) if s.code == 403 => Outcome::Forbidden,
                Err(error) => {
                    m::count_watch_error("Namespace");
                    tracing::warn!(%error, "namespace watch failed; retrying");
                    Outcome::Failed
                }
            }
        })
        .buffer_unordered(CONCURRENCY);
    let mut outcomes = std::pin::pin!(outcomes);
    while let Some(outcome) = outcomes.next().await {
        if outcome == Outcome::Forbidden {
            tracing::warn!(
                "may not list or label namespaces (RBAC: list, watch and patch on namespaces); \
                 the leader labels each policy instead"
            );
            return;
        }
    }
}

#[derive(PartialEq, Eq)]
enum Outcome {
    Done,
    Failed,
    Forbidden,
}

/// Puts `bucket` as the label on namespace `name`.
async fn label_one(api: &Api<Namespace>, name: String, bucket: String) -> Outcome {
    let patch = serde_json::json!({ "metadata": { "labels": { BUCKET_LABEL: bucket } } });
    match api.patch_metadata(&name, &PatchParams::default(), &Patch::Merge(&patch)).await {
        Ok(_) => {
            m::count_namespace_label();
            Outcome::Done
        }
        Err(kube::Error::Api(s)) if s.code == 404 => Outcome::Done,
        Err(kube::Error::Api(s)) if s.code == 403 => {
            m::count_bucket_label_error();
            Outcome::Forbidden
        }
        Err(error) => {
            m::count_bucket_label_error();
            tracing::warn!(%error, namespace = %name, "labelling a namespace failed; retried at the next relist");
            Outcome::Failed
        }
    }
}

//! The leader's labelling duty: every policy gets its bucket label, so that each replica's
//! watches can ask the API server for its own buckets only.

use std::collections::BTreeSet;
use std::sync::Mutex;
use std::time::Duration;

use futures::StreamExt;
use kube::api::{Api, PartialObjectMeta, Patch, PatchParams};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Client, ResourceExt};

use crate::api::ApplicationTrafficPolicy;
use crate::sharding::bucket::{BUCKET_LABEL, bucket_of, label_value};
use crate::telemetry::metrics as m;

/// Labels every policy that has no bucket label yet. Runs while leading; the selector
/// makes the API server send only unlabelled policies, so this costs nothing at rest.
pub async fn label_unlabeled_policies(client: Client, namespace: Option<String>) {
    let api: Api<PartialObjectMeta<ApplicationTrafficPolicy>> = match &namespace {
        Some(ns) => Api::namespaced(client.clone(), ns),
        None => Api::all(client.clone()),
    };
    let config = watcher::Config::default().labels(&format!("!{BUCKET_LABEL}"));
    let events = watcher(api, config).default_backoff();
    // Labels are independent writes: several in flight, so a burst of new policies is not
    // held up behind one request at a time. Failures are retried every second.
    let retry: Mutex<BTreeSet<(String, String)>> = Mutex::default();
    let label_all = events.for_each_concurrent(LABEL_CONCURRENCY, |event| async {
        match event {
            Ok(watcher::Event::Apply(p) | watcher::Event::InitApply(p)) => {
                let key = (p.namespace().unwrap_or_default(), p.name_any());
                if !label(&client, &key).await {
                    retry.lock().unwrap_or_else(|e| e.into_inner()).insert(key);
                }
            }
            Err(error) => tracing::warn!(%error, "unlabelled-policy watch failed; retrying"),
            _ => {}
        }
    });
    let retry_failed = async {
        let mut tick = tokio::time::interval(Duration::from_secs(1));
        loop {
            tick.tick().await;
            let keys = std::mem::take(&mut *retry.lock().unwrap_or_else(|e| e.into_inner()));
            for key in keys {
                if !label(&client, &key).await {
                    retry.lock().unwrap_or_else(|e| e.into_inner()).insert(key);
                }
            }
        }
    };
    tokio::select! {
        () = label_all => {}
        () = retry_failed => {}
    }
}

/// Label patches in flight at once while leading.
const LABEL_CONCURRENCY: usize = 16;

/// True when labelled (or gone).
async fn label(client: &Client, (namespace, name): &(String, String)) -> bool {
    let api = Api::<ApplicationTrafficPolicy>::namespaced(client.clone(), namespace);
    let patch = serde_json::json!({ "metadata": { "labels": { BUCKET_LABEL: label_value(bucket_of(namespace)) } } });
    match api.patch(name, &PatchParams::default(), &Patch::Merge(&patch)).await {
        Ok(_) => {
            m::count_bucket_label();
            true
        }
        Err(kube::Error::Api(s)) if s.code == 404 => true,
        Err(error) => {
            tracing::warn!(%error, policy = %format!("{namespace}/{name}"), "labelling failed; retrying");
            false
        }
    }
}

//! The leader's labelling duty: every policy gets its bucket label, so that each replica's
//! watches can ask the API server for its own buckets only. Where the bucket-label admission
//! policy is installed, the API server sets the label as policies are written (the leader
//! labels namespaces for it, see [`super::namespace_labels`]), and this labels only what came
//! without one: policies written before their namespace was labelled, as after a preload.
//!
//! It is a controller on the runtime, named `policy-labels` in the workqueue and controller
//! metrics: a watch of the policies without a bucket label (so it costs nothing at rest), one
//! reconcile per policy that patches the label, per-key backoff for a patch that fails. A
//! policy a watch *event* reports (created, or edited while still unlabelled) goes in the
//! queue's high lane, before the backlog of the first list: a user waiting on an edit must
//! not wait behind a preload. How many patches are in flight adapts to the API server
//! through the client's [`Pacer`].

use std::sync::Arc;
use std::time::Duration;

use futures::future::BoxFuture;
use kube::api::{Api, PartialObjectMeta, Patch, PatchParams};
use kube::{Client, ResourceExt};
use tokio_util::sync::CancellationToken;

use super::leader::LeaderDuties;
use super::namespace_labels::label_namespaces;
use super::{BACKLOG_ANNOTATION, BUCKET_LABEL};
use crate::api::ApplicationTrafficPolicy;
use crate::error::Result;
use crate::runtime::backoff::Backoff;
use crate::runtime::cache::{self, Cache};
use crate::runtime::child_versions::ChildVersions;
use crate::runtime::gate::WriteGate;
use crate::runtime::health::Health;
use crate::runtime::pacer::{Pacer, paced};
use crate::runtime::parts::{self, Buckets, SliceSelector, Slicing};
use crate::runtime::reconciler::Unguarded;
use crate::runtime::watch_health::WatchHealth;
use crate::runtime::{Action, Controller, ObjectKey, Priority, Reconciler, Settings, watch};
use crate::sharding::bucket::{Mode, bucket_of, label_value};
use crate::telemetry::metrics as m;

/// The operator's leader duties: in label mode, bucket labels on namespaces and on the
/// policies that came without one. (With the shard selector, watches select by namespace:
/// nothing to label.)
pub struct BucketLabelling {
    /// The work client, under its rate limit if one applies.
    pub client: Client,
    /// The operator's `--watch-namespace`.
    pub watch_namespace: Option<String>,
}

impl LeaderDuties for BucketLabelling {
    fn lead(&self, mode: Mode, stop: CancellationToken) -> Option<BoxFuture<'static, ()>> {
        if mode != Mode::Labels {
            return None;
        }
        let client = paced(self.client.clone(), Pacer::new());
        let namespace = self.watch_namespace.clone();
        Some(Box::pin(async move {
            tokio::join!(
                label_namespaces(client.clone(), namespace.clone(), BUCKET_LABEL, stop.clone()),
                label_unlabeled_policies(client, namespace, stop)
            );
        }))
    }

    fn stopped(&self) {
        m::set_unlabelled(0);
    }
}

type UnlabelledPolicy = PartialObjectMeta<ApplicationTrafficPolicy>;

/// Labels every policy that has no bucket label yet, until `stop`.
pub async fn label_unlabeled_policies(client: Client, namespace: Option<String>, stop: CancellationToken) {
    let api: Api<UnlabelledPolicy> = match &namespace {
        Some(namespace) => Api::namespaced(client.clone(), namespace),
        None => Api::all(client.clone()),
    };
    // One bucket holds every policy: the leader labels them all.
    let unlabelled = format!("!{BUCKET_LABEL}");
    let slicing = Slicing::new(|_| Some(0), |_| 0, move |_| Some(SliceSelector::Labels(unlabelled.clone())));
    let (_keep_slice, slice) = tokio::sync::watch::channel(Some(Buckets::from([0])));
    let watch_health = WatchHealth::new();
    let events = parts::watch(api, None, slice.clone(), slicing, watch_health.clone());
    let (cache, writer) = cache::new::<UnlabelledPolicy>();
    let primary = watch::primary(events, |_| false, writer);
    let settings = Settings {
        name: "policy-labels",
        workers: Pacer::MAX,
        resync: Duration::from_secs(600),
        drain_timeout: Duration::from_secs(5),
        reconcile_timeout: Duration::from_secs(30),
        list_deadline: Duration::from_secs(600),
        backoff: Backoff::default(),
    };
    let controller = Controller::new(settings, cache.clone(), Health::with_gates(&[]), watch_health);
    let gate = Arc::new(Unguarded { write_bound: Duration::from_secs(30) });
    let labeller = Arc::new(PolicyLabeller { client });
    let versions = Arc::new(ChildVersions::default());
    let labelling = controller.run(primary, Vec::new(), slice, versions, labeller, gate, stop);
    tokio::select! {
        _ = labelling => {}
        () = report_unlabelled(cache) => {}
    }
}

/// Keeps `traffic_policy_unlabelled_policies` current: the cache holds exactly the policies
/// without a label.
async fn report_unlabelled(cache: Cache<UnlabelledPolicy>) {
    let mut tick = tokio::time::interval(Duration::from_secs(2));
    loop {
        tick.tick().await;
        m::set_unlabelled(cache.len());
    }
}

struct PolicyLabeller {
    client: Client,
}

impl Reconciler<UnlabelledPolicy> for PolicyLabeller {
    /// Labels one policy. One from the backlog also gets [`BACKLOG_ANNOTATION`], so that the
    /// replica that sees it appear queues it behind real changes.
    async fn reconcile(
        &self,
        key: &ObjectKey,
        _: Arc<UnlabelledPolicy>,
        gate: &dyn WriteGate,
        lane: Priority,
    ) -> Result<Action> {
        gate.check("ApplicationTrafficPolicy")?;
        let api = Api::<ApplicationTrafficPolicy>::namespaced(self.client.clone(), key.namespace());
        let labels = serde_json::json!({ BUCKET_LABEL: label_value(bucket_of(key.namespace())) });
        let patch = match lane {
            Priority::High => serde_json::json!({ "metadata": { "labels": labels } }),
            Priority::Low => {
                serde_json::json!({ "metadata": { "labels": labels, "annotations": { BACKLOG_ANNOTATION: "true" } } })
            }
        };
        match api.patch_metadata(key.name(), &PatchParams::default(), &Patch::Merge(&patch)).await {
            Ok(_) => {
                m::count_bucket_label();
                Ok(Action::Done)
            }
            // Gone: its watch event makes the controller forget it.
            Err(kube::Error::Api(s)) if s.code == 404 => Ok(Action::Done),
            // The pacer has slowed down; try again after the server's pause.
            Err(kube::Error::Api(s)) if s.code == 429 => {
                let seconds = s.details.as_ref().map(|d| d.retry_after_seconds).filter(|s| *s > 0).unwrap_or(1);
                Ok(Action::RequeueAfter(Duration::from_secs(u64::from(seconds))))
            }
            Err(error) => {
                m::count_bucket_label_error();
                Err(error.into())
            }
        }
    }

    fn forget(&self, _: &ObjectKey) {}
}

/// Whether the leader labelled `object` from its backlog (read from the watch event, before
/// the cache keeps its compact copy), so that it is queued behind real changes.
pub fn labelled_from_backlog(object: &impl ResourceExt) -> bool {
    object.annotations().contains_key(BACKLOG_ANNOTATION)
}

//! The traffic-policy controller over this replica's slice: the policy watch into the
//! compact cache, metadata-only watches of the NetworkPolicy and ConfigMap children, and the
//! reconciler behind the sharding gatekeeper.

use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use futures::stream::BoxStream;
use k8s_openapi::api::core::v1::ConfigMap;
use k8s_openapi::api::networking::v1::NetworkPolicy;
use kube::Client;
use kube::api::{Api, PartialObjectMeta};
use kube::runtime::events::Reporter;
use tokio_util::sync::CancellationToken;

use super::CONTROLLER_NAME;
use crate::cli::RunArgs;
use crate::coordination::audit::Audit;
use crate::coordination::sharded::{self, Sharded};
use crate::coordination::{BUCKET_LABEL, Coordination, NAMES, ShardConfig, labeller};
use crate::reconcile::cached::CachedPolicy;
use crate::reconcile::desired::{MANAGED_BY_LABEL, MANAGED_BY_VALUE};
use crate::reconcile::events::Events;
use crate::reconcile::{CONTENT_STAMP, TrafficPolicyReconciler};
use crate::runtime::backoff::Backoff;
use crate::runtime::cache::Cache;
use crate::runtime::child_versions::ChildVersions;
use crate::runtime::health::Health;
use crate::runtime::parts::{self, SliceWatch, Slicing, WatchScope, Watchable};
use crate::runtime::stored::Stored as _;
use crate::runtime::watch::ChildEvent;
use crate::runtime::watch_health::WatchHealth;
use crate::runtime::{Controller, Settings, watch};
use crate::telemetry::metrics;

/// Builds the controller and returns what runs it until `shutdown`, answering whether every
/// in-flight reconcile finished.
pub(super) fn start(
    args: &RunArgs,
    shard: &ShardConfig,
    client: &Client,
    sharding: &Coordination,
    health: &Arc<Health>,
    audit: &Audit,
    shutdown: CancellationToken,
) -> impl Future<Output = bool> + use<> {
    let (cache, writer) = crate::runtime::cache::new();
    tokio::spawn(report_policies(cache.clone()));
    let slicing = sharded::slicing(&sharding.ownership, BUCKET_LABEL);
    let watch_health = &sharding.watch_health;
    let policies = parts::watch(api(client, args), None, sharding.slice.clone(), slicing.clone(), watch_health.clone());
    let primary = watch::primary(policies, labeller::labelled_from_backlog, writer);
    let children = vec![
        child_watch::<NetworkPolicy>(client, args, &sharding.slice, &slicing, watch_health),
        child_watch::<ConfigMap>(client, args, &sharding.slice, &slicing, watch_health),
    ];

    let child_versions = Arc::new(ChildVersions::default());
    let reporter = Reporter { controller: "traffic-policy-operator".into(), instance: Some(shard.identity.clone()) };
    let events = Events::new(client.clone(), reporter);
    let mut reconciler = TrafficPolicyReconciler::new(client.clone(), events, child_versions.clone());
    reconciler.faults = args.test_faults.clone();
    reconciler.gateway_provider = args.gateway_provider;
    let gatekeeper = Arc::new(Sharded::new(sharding.ownership.clone(), NAMES, audit.clone()));
    let settings = Settings {
        name: CONTROLLER_NAME,
        workers: args.workers.into(),
        resync: args.resync_period,
        drain_timeout: args.drain_timeout,
        reconcile_timeout: args.reconcile_timeout,
        list_deadline: args.list_deadline,
        backoff: Backoff::default(),
    };
    let controller = Controller::new(settings, cache.clone(), health.clone(), watch_health.clone());
    tokio::spawn({
        let (load, ownership, listed) = (sharding.load.clone(), sharding.ownership.clone(), controller.listed());
        async move { load.keep(cache, ownership, listed).await }
    });
    let slice = sharding.slice.clone();
    controller.run(primary, children, slice, child_versions, Arc::new(reconciler), gatekeeper, shutdown)
}

/// The metadata-only watch of the operator's children of kind `C` in the slice.
fn child_watch<C>(
    client: &Client,
    args: &RunArgs,
    slice: &SliceWatch,
    slicing: &Slicing,
    watch_health: &Arc<WatchHealth>,
) -> BoxStream<'static, ChildEvent>
where
    C: Watchable + k8s_openapi::Resource,
{
    let owned = Some(format!("{MANAGED_BY_LABEL}={MANAGED_BY_VALUE}"));
    let events = parts::watch(
        api::<PartialObjectMeta<C>>(client, args),
        owned,
        slice.clone(),
        slicing.clone(),
        watch_health.clone(),
    );
    watch::children(events, <C as k8s_openapi::Resource>::KIND, "ApplicationTrafficPolicy", CONTENT_STAMP).boxed()
}

/// All namespaces, or the one `--watch-namespace` names.
fn api<K: Watchable>(client: &Client, args: &RunArgs) -> Api<K> {
    K::Scope::api(client.clone(), args.watch_namespace.as_deref())
}

/// Keeps `traffic_policy_policies` (our slice by Ready status and reason) current.
async fn report_policies(cache: Cache<CachedPolicy>) {
    use crate::reconcile::status::{READY_STATES, ready_state};
    let mut tick = tokio::time::interval(Duration::from_secs(10));
    loop {
        tick.tick().await;
        let mut tally = [0; READY_STATES.len()];
        for (_, policy) in cache.state() {
            tally[ready_state(policy.generation(), policy.ready())] += 1;
        }
        metrics::set_policies(&READY_STATES, &tally);
    }
}

//! A leader's labelling duty in label mode: each namespace carries its own bucket label, so
//! that an admission policy can copy it onto every object the API server admits there. An
//! object then carries its bucket from its first write, reaches its owner at once, and costs
//! the leader no PATCH of its own: one write per namespace replaces one per object. CEL
//! cannot compute the bucket (an xxh3 hash), hence the label on the namespace.
//!
//! It runs on the runtime's controller, like any controller: a watch of the namespaces'
//! metadata into a cache that keeps their labels, a reconcile per namespace that puts the
//! label right, per-key backoff for a patch that fails. What is its own is the memory of a
//! contested label ([`Contested`]): one removed soon after each write (by a controller that
//! disagrees) is put back after a growing backoff rather than at once, so that the two never
//! patch in a hot loop.
//!
//! The program grants the list, watch and patch on namespaces this needs with that policy.
//! Without the grant the list is refused, asked again every [`GRANT_RETRY`], and the
//! program's own labeller must label each object, as it still must for one admitted before
//! its namespace was labelled.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use k8s_openapi::api::core::v1::Namespace;
use kube::api::{Api, ListParams, PartialObjectMeta, Patch, PatchParams};
use kube::{Client, ResourceExt};
use sharded_runtime::backoff::Backoff;
use sharded_runtime::child_versions::ChildVersions;
use sharded_runtime::error::Result;
use sharded_runtime::gate::WriteGate;
use sharded_runtime::health::Health;
use sharded_runtime::parts::{self, Buckets, SliceSelector, Slicing};
use sharded_runtime::reconciler::Unguarded;
use sharded_runtime::stored::Stored;
use sharded_runtime::watch_health::WatchHealth;
use sharded_runtime::{Action, Controller, ObjectKey, Priority, Reconciler, Settings, cache, watch};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::metrics as m;
use crate::bucket::{bucket_of, label_value};

/// Namespaces labelled at once: after the first list, a cluster may have thousands to label,
/// and an object written in one of them meanwhile waits for the program's labeller.
const WORKERS: usize = 16;

/// A label removed this soon after the leader wrote it was removed by someone else, such as
/// a controller that disagrees: putting it back at once each time would make the two patch
/// in a hot loop.
const CONTESTED_WITHIN: Duration = Duration::from_secs(10);

/// How often a refused list of namespaces is asked again, so that a grant added later takes
/// effect without a restart.
pub const GRANT_RETRY: Duration = Duration::from_secs(30);

/// The label every namespace carries with its own name (Kubernetes 1.21 and later): a
/// selector on it selects every namespace, or one.
const NAME_LABEL: &str = "kubernetes.io/metadata.name";

/// Keeps every watched namespace's bucket label right (a namespace created later, or a label
/// removed or changed by hand, included), until `stop`.
pub async fn label_namespaces(
    client: Client,
    watch_namespace: Option<String>,
    bucket_label: &'static str,
    stop: CancellationToken,
) {
    let metadata: Api<PartialObjectMeta<Namespace>> = Api::all(client.clone());
    let selector = match &watch_namespace {
        Some(name) => format!("{NAME_LABEL}={name}"),
        None => NAME_LABEL.to_string(),
    };
    if !granted(&metadata, &selector, &stop).await {
        return;
    }
    // One bucket holds every namespace: the leader labels them all.
    let slicing = Slicing::new(|_| Some(0), |_| 0, move |_| Some(SliceSelector::Labels(selector.clone())));
    let (_keep_slice, slice) = tokio::sync::watch::channel(Some(Buckets::from([0])));
    let watch_health = WatchHealth::new();
    let events = parts::watch(metadata, None, slice.clone(), slicing, watch_health.clone());
    let (cache, writer) = cache::new::<NamespaceLabels>();
    let primary = watch::primary(events, |_| false, writer);
    let settings = Settings {
        name: "namespace-labels",
        workers: WORKERS,
        resync: Duration::from_secs(600),
        drain_timeout: Duration::from_secs(5),
        reconcile_timeout: Duration::from_secs(30),
        list_deadline: Duration::from_secs(600),
        backoff: Backoff::default(),
    };
    let controller = Controller::new(settings, cache, Health::with_gates(&[]), watch_health);
    let labeller = Arc::new(NamespaceLabeller { api: Api::all(client), bucket_label, contested: Mutex::default() });
    let gate = Arc::new(Unguarded { write_bound: Duration::from_secs(30) });
    controller.run(primary, Vec::new(), slice, Arc::new(ChildVersions::default()), labeller, gate, stop).await;
}

/// Waits until the namespaces may be listed; false when stopped first.
async fn granted(namespaces: &Api<PartialObjectMeta<Namespace>>, selector: &str, stop: &CancellationToken) -> bool {
    let mut said = false;
    loop {
        let params = ListParams::default().labels(selector).limit(1);
        match namespaces.list_metadata(&params).await {
            Ok(_) => return true,
            Err(kube::Error::Api(s)) if s.code == 403 => {
                if !std::mem::replace(&mut said, true) {
                    tracing::info!(
                        "namespaces are not labelled with their bucket (no permission to list them); \
                         the leader labels each object instead"
                    );
                }
            }
            Err(error) => tracing::warn!(%error, "cannot list namespaces; asking again"),
        }
        tokio::select! {
            _ = tokio::time::sleep(GRANT_RETRY) => {}
            _ = stop.cancelled() => return false,
        }
    }
}

/// A namespace as the labeller caches it: its labels, which are what a change means here.
pub struct NamespaceLabels {
    uid: Option<String>,
    resource_version: Option<String>,
    labels: BTreeMap<String, String>,
}

impl Stored for NamespaceLabels {
    type Object = PartialObjectMeta<Namespace>;

    fn store(namespace: &Self::Object) -> Self {
        let meta = &namespace.metadata;
        Self {
            uid: meta.uid.clone(),
            resource_version: meta.resource_version.clone(),
            labels: meta.labels.clone().unwrap_or_default(),
        }
    }

    fn has_uid(&self, uid: Option<&str>) -> bool {
        self.uid.as_deref() == uid
    }

    fn generation(&self) -> Option<i64> {
        None
    }

    fn changed(&self, namespace: &Self::Object) -> bool {
        namespace.metadata.labels.as_ref().map_or(!self.labels.is_empty(), |labels| *labels != self.labels)
    }

    fn is_version(&self, resource_version: Option<&str>) -> bool {
        self.resource_version.is_some() && self.resource_version.as_deref() == resource_version
    }
}

struct NamespaceLabeller {
    api: Api<Namespace>,
    bucket_label: &'static str,
    contested: Mutex<Contested>,
}

impl NamespaceLabeller {
    fn contested(&self) -> std::sync::MutexGuard<'_, Contested> {
        self.contested.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl Reconciler<NamespaceLabels> for NamespaceLabeller {
    async fn reconcile(
        &self,
        key: &ObjectKey,
        namespace: Arc<NamespaceLabels>,
        gate: &dyn WriteGate,
        _: Priority,
    ) -> Result<Action> {
        let name = key.name();
        let bucket = label_value(bucket_of(name));
        if namespace.labels.get(self.bucket_label) == Some(&bucket) {
            self.contested().settled(name);
            return Ok(Action::Done);
        }
        match self.contested().seen_without_label(name, namespace.resource_version.as_deref()) {
            Removal::Stale => return Ok(Action::Done),
            Removal::Contested(wait) => return Ok(Action::RequeueAfter(wait)),
            Removal::PutBack => {}
        }
        gate.check("Namespace")?;
        let patch = serde_json::json!({ "metadata": { "labels": { self.bucket_label: &bucket } } });
        match self.api.patch_metadata(name, &PatchParams::default(), &Patch::Merge(&patch)).await {
            Ok(patched) => {
                self.contested().labelled(name, namespace.resource_version.clone());
                if patched.labels().get(self.bucket_label) == Some(&bucket) {
                    m::count_namespace_label();
                    return Ok(Action::Done);
                }
                // Stripped as it was written (a webhook): contested from the first time.
                let wait = match self.contested().seen_without_label(name, patched.resource_version().as_deref()) {
                    Removal::Contested(wait) => wait,
                    _ => Backoff::default().delay(1),
                };
                Ok(Action::RequeueAfter(wait))
            }
            // Gone: its watch event makes the controller forget it.
            Err(kube::Error::Api(s)) if s.code == 404 => Ok(Action::Done),
            Err(error) => {
                m::count_bucket_label_error();
                Err(error.into())
            }
        }
    }

    fn forget(&self, key: &ObjectKey) {
        self.contested().forget(key.name());
    }
}

/// What a namespace seen without its label calls for.
#[derive(Debug, PartialEq, Eq)]
enum Removal {
    /// Put the label back now.
    PutBack,
    /// The cache still shows the namespace as it was before our last patch: wait for the
    /// patch's own event.
    Stale,
    /// The label was removed soon after the leader wrote it: put it back after this long.
    Contested(Duration),
}

/// Per namespace the leader labelled: when, from which resourceVersion, how many times in a
/// row the label was then removed within [`CONTESTED_WITHIN`], and when it may be put back.
#[derive(Default)]
struct Contested(HashMap<String, Label>);

struct Label {
    written_at: Instant,
    /// The resourceVersion the namespace had when we patched it.
    patched_from: Option<String>,
    streak: u32,
    retry_at: Option<Instant>,
}

impl Contested {
    fn labelled(&mut self, name: &str, patched_from: Option<String>) {
        let now = Instant::now();
        let label = self.0.entry(name.to_owned()).or_insert(Label {
            written_at: now,
            patched_from: None,
            streak: 0,
            retry_at: None,
        });
        (label.written_at, label.patched_from, label.retry_at) = (now, patched_from, None);
    }

    fn forget(&mut self, name: &str) {
        self.0.remove(name);
    }

    /// Seen with its label: drops an entry that tells nothing any more (written long ago,
    /// no retry pending; a removal now would start a new streak anyway).
    fn settled(&mut self, name: &str) {
        if self.0.get(name).is_some_and(|l| l.written_at.elapsed() >= CONTESTED_WITHIN && l.retry_at.is_none()) {
            self.0.remove(name);
        }
    }

    /// Seen without its label, at `resource_version`.
    fn seen_without_label(&mut self, name: &str, resource_version: Option<&str>) -> Removal {
        let Some(label) = self.0.get_mut(name) else { return Removal::PutBack };
        let now = Instant::now();
        if let Some(at) = label.retry_at {
            if now < at {
                return Removal::Contested(at - now);
            }
            label.retry_at = None;
            return Removal::PutBack;
        }
        if resource_version.is_some() && label.patched_from.as_deref() == resource_version {
            return Removal::Stale;
        }
        if label.written_at.elapsed() >= CONTESTED_WITHIN {
            label.streak = 0;
            return Removal::PutBack;
        }
        label.streak += 1;
        let wait = Backoff::default().delay(label.streak);
        label.retry_at = Some(now + wait);
        m::count_bucket_label_error();
        if label.streak == 1 {
            tracing::warn!(
                namespace = name,
                "the namespace's bucket label was removed or changed within {CONTESTED_WITHIN:?} of being \
                 written (does another controller remove it?); it is put back after a growing backoff"
            );
        }
        Removal::Contested(wait)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const NS: &str = "a";

    #[tokio::test(start_paused = true)]
    async fn a_label_removed_soon_after_each_write_is_contested_for_longer_each_time() {
        let mut contested = Contested::default();
        assert_eq!(contested.seen_without_label(NS, Some("1")), Removal::PutBack, "never labelled: at once");
        contested.labelled(NS, Some("1".into()));
        let Removal::Contested(first) = contested.seen_without_label(NS, Some("3")) else { panic!("contested") };
        tokio::time::advance(first / 2).await;
        assert_eq!(contested.seen_without_label(NS, Some("4")), Removal::Contested(first / 2), "still waiting");
        tokio::time::advance(first / 2).await;
        assert_eq!(contested.seen_without_label(NS, Some("4")), Removal::PutBack, "due: put back");
        contested.labelled(NS, Some("4".into()));
        tokio::time::advance(CONTESTED_WITHIN - Duration::from_millis(1)).await;
        let Removal::Contested(second) = contested.seen_without_label(NS, Some("6")) else { panic!("contested") };
        assert!(second > first, "the streak goes on across writes: {second:?} after {first:?}");
    }

    #[tokio::test(start_paused = true)]
    async fn a_label_that_lasted_is_put_back_at_once_and_a_new_streak_starts() {
        let mut contested = Contested::default();
        contested.labelled(NS, Some("1".into()));
        assert!(matches!(contested.seen_without_label(NS, Some("3")), Removal::Contested(_)));
        tokio::time::advance(Duration::from_secs(60)).await;
        assert_eq!(contested.seen_without_label(NS, Some("3")), Removal::PutBack);
        contested.labelled(NS, Some("3".into()));
        tokio::time::advance(CONTESTED_WITHIN).await;
        assert_eq!(contested.seen_without_label(NS, Some("5")), Removal::PutBack, "it lasted ten seconds");
        contested.labelled(NS, Some("5".into()));
        let Removal::Contested(wait) = contested.seen_without_label(NS, Some("7")) else { panic!("contested") };
        assert_eq!(wait, Backoff::default().delay(1), "a new streak starts from the first removal");
    }

    #[tokio::test(start_paused = true)]
    async fn the_cache_before_our_own_patch_is_not_a_removal() {
        let mut contested = Contested::default();
        contested.labelled(NS, Some("1".into()));
        assert_eq!(contested.seen_without_label(NS, Some("1")), Removal::Stale, "our patch's event is on its way");
        assert!(matches!(contested.seen_without_label(NS, Some("3")), Removal::Contested(_)));
    }

    #[test]
    fn a_change_of_labels_is_worth_a_reconcile_and_nothing_else_is() {
        let namespace = |labels: &[(&str, &str)], version: &str| {
            let mut ns = PartialObjectMeta::<Namespace>::default();
            ns.metadata.uid = Some("u".into());
            ns.metadata.resource_version = Some(version.into());
            ns.metadata.labels =
                (!labels.is_empty()).then(|| labels.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect());
            ns
        };
        let cached = NamespaceLabels::store(&namespace(&[("team", "a")], "1"));
        assert!(!cached.changed(&namespace(&[("team", "a")], "2")), "an annotation or a finalizer changed");
        assert!(cached.changed(&namespace(&[("team", "a"), ("example.com/bucket", "7")], "3")), "a label added");
        assert!(cached.changed(&namespace(&[], "4")), "every label removed");
        assert!(!NamespaceLabels::store(&namespace(&[], "1")).changed(&namespace(&[], "2")));
    }

    #[tokio::test(start_paused = true)]
    async fn settled_entries_go_and_pending_retries_stay() {
        let mut contested = Contested::default();
        for name in ["old", "waiting", "fresh"] {
            contested.labelled(name, None);
        }
        assert!(matches!(contested.seen_without_label("waiting", Some("2")), Removal::Contested(_)));
        tokio::time::advance(CONTESTED_WITHIN).await;
        contested.labelled("fresh", None);
        for name in ["old", "waiting", "fresh"] {
            contested.settled(name);
        }
        let mut kept: Vec<&str> = contested.0.keys().map(String::as_str).collect();
        kept.sort_unstable();
        assert_eq!(kept, ["fresh", "waiting"], "a streak with its retry pending survives its ten seconds");
    }
}

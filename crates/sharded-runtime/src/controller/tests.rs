use super::*;
use crate::gate::WriteGate;
use crate::parts::Scope;
use crate::reconciler::Unguarded;
use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::ObjectMeta;
use kube::runtime::watcher;
use std::sync::atomic::{AtomicUsize, Ordering};

/// Panics on its first call, succeeds after.
struct PanicsOnce(AtomicUsize);

impl Reconciler<ConfigMap> for PanicsOnce {
    async fn reconcile(&self, _: &ObjectKey, _: Arc<ConfigMap>, _: &dyn WriteGate, _: Priority) -> Result<Action> {
        if self.0.fetch_add(1, Ordering::SeqCst) == 0 {
            panic!("a bug in the reconcile");
        }
        Ok(Action::Done)
    }
    fn forget(&self, _: &ObjectKey) {}
}

/// Records what it is asked to do, in order.
#[derive(Default)]
struct Records(std::sync::Mutex<Vec<String>>);

impl Reconciler<ConfigMap> for Records {
    async fn reconcile(
        &self,
        key: &ObjectKey,
        object: Arc<ConfigMap>,
        _: &dyn WriteGate,
        _: Priority,
    ) -> Result<Action> {
        let uid = object.metadata.uid.clone().unwrap_or_default();
        self.0.lock().unwrap().push(format!("reconcile {key} {uid}"));
        Ok(Action::Done)
    }
    fn forget(&self, key: &ObjectKey) {
        self.0.lock().unwrap().push(format!("forget {key}"));
    }
}

fn unguarded() -> Arc<Unguarded> {
    Arc::new(Unguarded { write_bound: Duration::from_secs(5) })
}

fn config_map(uid: &str) -> ConfigMap {
    let metadata = ObjectMeta {
        name: Some("a".into()),
        namespace: Some("ns".into()),
        uid: Some(uid.into()),
        // Each uid its own version: a relist keeps an object of the same version as cached.
        resource_version: Some(uid.into()),
        ..Default::default()
    };
    ConfigMap { metadata, ..Default::default() }
}

/// Runs a controller of one worker over `events`, each applied to its cache as the
/// controller reads it, as the watch does.
fn start<R: Reconciler<ConfigMap>>(
    events: Vec<watcher::Event<ConfigMap>>,
    reconciler: Arc<R>,
) -> (tokio::task::JoinHandle<bool>, CancellationToken) {
    let (run, shutdown, _) = start_with_children(events, Vec::new(), reconciler);
    (run, shutdown)
}

/// [`start`] with child watches that send `children`.
fn start_with_children<R: Reconciler<ConfigMap>>(
    events: Vec<watcher::Event<ConfigMap>>,
    children: Vec<BoxStream<'static, ChildEvent>>,
    reconciler: Arc<R>,
) -> (tokio::task::JoinHandle<bool>, CancellationToken, Arc<WatchHealth>) {
    let (cache, mut writer) = crate::cache::new::<ConfigMap>();
    let scope = Scope::everything();
    let primary = futures::stream::iter(events)
        .map(move |event| {
            let applied = writer.apply(0, &scope, &event);
            let (key, sight, gone) = (applied.key, applied.sight, applied.gone);
            Cached::Event { part: 0, scope: scope.clone(), event, key, sight, backlog: false, gone }
        })
        .chain(futures::stream::pending());
    let settings = Settings {
        name: "test",
        workers: 1,
        resync: Duration::from_secs(3600),
        drain_timeout: Duration::from_secs(1),
        reconcile_timeout: Duration::from_secs(10),
        list_deadline: LIST_DEADLINE,
        backoff: Backoff::default(),
    };
    let watch_health = WatchHealth::new();
    let controller = Controller::new(settings, cache, Health::with_gates(&[]), watch_health.clone());
    let shutdown = CancellationToken::new();
    let versions = Arc::new(ChildVersions::default());
    let (_slice_tx, slice) = tokio::sync::watch::channel(Some(Buckets::from([0])));
    let run = controller.run(primary, children, slice, versions, reconciler, unguarded(), shutdown.clone());
    (tokio::spawn(run), shutdown, watch_health)
}

const LIST_DEADLINE: Duration = Duration::from_secs(30);

/// Polls `done` on the paused clock, which jumps over backoffs and resyncs, for up to a minute.
async fn until(done: impl Fn() -> bool) {
    for _ in 0..600 {
        if done() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(start_paused = true)]
async fn a_panicking_reconcile_is_caught_and_its_key_retried() {
    let events = vec![watcher::Event::Init, watcher::Event::InitApply(config_map("u1")), watcher::Event::InitDone];
    let reconciler = Arc::new(PanicsOnce(AtomicUsize::new(0)));
    let (run, shutdown) = start(events, reconciler.clone());
    // A wedged key would never be called again.
    until(|| reconciler.0.load(Ordering::SeqCst) >= 2).await;
    assert_eq!(reconciler.0.load(Ordering::SeqCst), 2, "retried once after the panic, then done");
    shutdown.cancel();
    assert!(run.await.unwrap(), "drained: no worker died with the panic");
}

/// An object deleted and created again under its name while the watch was down: what was
/// kept for the old one (its children's versions, the generation it reported) is dropped
/// before the new one is reconciled, whether a relist or a watch event brings it.
#[tokio::test(start_paused = true)]
async fn a_new_uid_under_a_known_name_forgets_the_old_object_first() {
    use watcher::Event::{Apply, Init, InitApply, InitDone};
    let relist = vec![Init, InitApply(config_map("u1")), InitDone, Init, InitApply(config_map("u2")), InitDone];
    let event = vec![Init, InitApply(config_map("u1")), InitDone, Apply(config_map("u2"))];
    for (how, events) in [("relist", relist), ("watch event", event)] {
        let reconciler = Arc::new(Records::default());
        let (run, shutdown) = start(events, reconciler.clone());
        let records = || reconciler.0.lock().unwrap().clone();
        until(|| records().last().is_some_and(|last| last == "reconcile ns/a u2")).await;
        shutdown.cancel();
        assert!(run.await.unwrap());
        let records = records();
        let forgotten = records.iter().position(|r| r == "forget ns/a");
        let reconciled = records.iter().position(|r| r == "reconcile ns/a u2");
        assert!(
            forgotten.is_some() && forgotten < reconciled,
            "{how}: the old object forgotten, then the new one reconciled: {records:?}"
        );
    }
}

/// A child watch whose list never completes (a proxy answers it 504 for ever): no object of
/// the slice is reconciled, so past the deadline the process says it cannot work.
#[tokio::test(start_paused = true)]
async fn a_child_watch_that_never_lists_misses_the_list_deadline() {
    let events = vec![watcher::Event::Init, watcher::Event::InitApply(config_map("u1")), watcher::Event::InitDone];
    let listing = ChildEvent::Listing { kind: "Secret", part: 0, scope: Scope::everything() };
    let children = vec![futures::stream::iter([listing]).chain(futures::stream::pending()).boxed()];
    let reconciler = Arc::new(Records::default());
    let started = Instant::now();
    let (run, shutdown, watch_health) = start_with_children(events, children, reconciler.clone());
    until(|| watch_health.broken().is_some()).await;
    let why = watch_health.broken().unwrap();
    assert!(started.elapsed() >= LIST_DEADLINE, "not before the deadline: {:?}", started.elapsed());
    assert!(why.contains("1 of the slice's 1 buckets"), "{why}");
    assert!(reconciler.0.lock().unwrap().is_empty(), "nothing was reconciled without the child list");
    shutdown.cancel();
    run.await.unwrap();
}

//! The leader's labelling duty: every policy gets its bucket label, so that each replica's
//! watches can ask the API server for its own buckets only. Where the bucket-label admission
//! policy is installed, the API server sets the label as policies are written (the leader
//! labels namespaces for it, see [`super::namespace_labels`]), and this labels only what came without one: policies
//! written before their namespace was labelled, as after a preload.
//!
//! A policy an unlabelled-policy watch *event* reports (created, or edited while still
//! unlabelled) is labelled before the backlog of the initial list: a user waiting on an edit
//! must not wait behind a preload. How many patches are in flight adapts to the API server:
//! halved on 429 (after the pause its Retry-After asks for), grown by one per batch that
//! went through (additive increase, multiplicative decrease, as TCP does).

use std::collections::{HashMap, VecDeque};
use std::time::Duration;

use futures::StreamExt;
use futures::future::{BoxFuture, join_all};
use kube::api::{Api, PartialObjectMeta, Patch, PatchParams};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Client, ResourceExt};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use super::leader::LeaderDuties;
use super::namespace_labels::label_namespaces;
use super::{BACKLOG_ANNOTATION, BUCKET_LABEL};
use crate::api::ApplicationTrafficPolicy;
use crate::runtime::retries::Retries;
use crate::sharding::bucket::{Mode, bucket_of, label_value};
use crate::telemetry::metrics as m;

type Key = (String, String);

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
        let (client, namespace) = (self.client.clone(), self.watch_namespace.clone());
        Some(Box::pin(async move {
            let policies = label_unlabeled_policies(client.clone(), namespace.clone());
            tokio::join!(label_namespaces(client, namespace, BUCKET_LABEL, stop.clone()), async {
                tokio::select! {
                    () = policies => {}
                    () = stop.cancelled() => {}
                }
            });
        }))
    }

    fn stopped(&self) {
        m::set_unlabelled(0);
    }
}

/// Labels every policy that has no bucket label yet. Runs while leading; the selector
/// makes the API server send only unlabelled policies, so this costs nothing at rest.
pub async fn label_unlabeled_policies(client: Client, namespace: Option<String>) {
    let api: Api<PartialObjectMeta<ApplicationTrafficPolicy>> = match &namespace {
        Some(ns) => Api::namespaced(client.clone(), ns),
        None => Api::all(client.clone()),
    };
    let config = watcher::Config::default().labels(&format!("!{BUCKET_LABEL}"));
    let events = watcher(api, config).default_backoff();
    let pending = watch::Sender::new(Pending::default());
    let feed = events.for_each(|event| {
        match event {
            Ok(watcher::Event::Apply(p)) => pending.send_modify(|q| q.push(key(&p), Lane::Fresh)),
            Ok(watcher::Event::InitApply(p)) => pending.send_modify(|q| q.push(key(&p), Lane::Backlog)),
            Ok(watcher::Event::Delete(p)) => pending.send_modify(|q| q.remove(&key(&p))),
            Ok(watcher::Event::Init | watcher::Event::InitDone) => {}
            Err(error) => {
                m::count_watch_error("ApplicationTrafficPolicy");
                tracing::warn!(%error, "unlabelled-policy watch failed; retrying")
            }
        }
        std::future::ready(())
    });
    tokio::select! {
        () = feed => {}
        () = label_pending(&client, &pending) => {}
    }
}

fn key(policy: &PartialObjectMeta<ApplicationTrafficPolicy>) -> Key {
    (policy.namespace().unwrap_or_default(), policy.name_any())
}

/// Takes batches of pending keys, fresh ones first, as many as the pacer allows.
async fn label_pending(client: &Client, pending: &watch::Sender<Pending>) {
    let mut pacer = Pacer::default();
    let mut retries = Retries::default();
    let mut changed = pending.subscribe();
    loop {
        tokio::select! {
            _ = changed.wait_for(|q| !q.is_empty()) => {}
            Some(key) = retries.next_due() => {
                pending.send_modify(|q| q.push(key, Lane::Backlog));
                continue;
            }
        }
        let batch = {
            let mut batch = Vec::new();
            pending.send_modify(|q| batch = q.take(pacer.in_flight()));
            batch
        };
        m::set_unlabelled(pending.borrow().len() + batch.len() + retries.len());
        let results = join_all(batch.iter().map(|(key, lane)| label(client, key, *lane))).await;
        let mut retry_after = None;
        for ((key, _), result) in batch.into_iter().zip(results) {
            match result {
                Labelled::Done => retries.forget(&key),
                Labelled::Throttled(after) => {
                    retry_after = retry_after.max(Some(after));
                    pending.send_modify(|q| q.push(key, Lane::Fresh));
                }
                Labelled::Failed => retries.later(key),
            }
        }
        m::set_unlabelled(pending.borrow().len() + retries.len());
        if let Some(pause) = pacer.after_batch(retry_after) {
            tokio::time::sleep(pause).await;
        }
    }
}

enum Labelled {
    /// Labelled, or gone.
    Done,
    /// The API server answered 429; it asks for this pause.
    Throttled(Duration),
    /// Any other failure: retried after the backlog.
    Failed,
}

/// Whether the leader labelled `object` from its backlog (read from the watch event, before
/// the cache keeps its compact copy), so that it is queued behind real changes.
pub fn labelled_from_backlog(object: &impl ResourceExt) -> bool {
    object.annotations().contains_key(BACKLOG_ANNOTATION)
}

/// Labels one policy. One from the backlog also gets [`BACKLOG_ANNOTATION`], so that the
/// replica that sees it appear queues it behind real changes.
async fn label(client: &Client, (namespace, name): &Key, lane: Lane) -> Labelled {
    let api = Api::<ApplicationTrafficPolicy>::namespaced(client.clone(), namespace);
    let labels = serde_json::json!({ BUCKET_LABEL: label_value(bucket_of(namespace)) });
    let patch = match lane {
        Lane::Fresh => serde_json::json!({ "metadata": { "labels": labels } }),
        Lane::Backlog => {
            serde_json::json!({ "metadata": { "labels": labels, "annotations": { BACKLOG_ANNOTATION: "true" } } })
        }
    };
    match api.patch(name, &PatchParams::default(), &Patch::Merge(&patch)).await {
        Ok(_) => {
            m::count_bucket_label();
            Labelled::Done
        }
        Err(kube::Error::Api(s)) if s.code == 404 => Labelled::Done,
        Err(kube::Error::Api(s)) if s.code == 429 => {
            let seconds = s.details.as_ref().map(|d| d.retry_after_seconds).filter(|s| *s > 0).unwrap_or(1);
            Labelled::Throttled(Duration::from_secs(u64::from(seconds)))
        }
        Err(error) => {
            m::count_bucket_label_error();
            tracing::warn!(%error, policy = %format!("{namespace}/{name}"), "labelling failed; retrying");
            Labelled::Failed
        }
    }
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Lane {
    /// Seen through a watch event: someone is likely waiting on it.
    Fresh,
    /// From a (re)list.
    Backlog,
}

/// Unlabelled policies waiting, in two lanes, each key once. `queued` says which lane a key
/// is in; copies left in the other lane's deque (moved up, or removed) are skipped when
/// reached, so that no step scans a lane: the backlog may hold 50,000 keys.
#[derive(Default)]
struct Pending {
    fresh: VecDeque<Key>,
    backlog: VecDeque<Key>,
    queued: HashMap<Key, Lane>,
}

impl Pending {
    /// Queues `key`; a key already in the backlog moves up when it shows up fresh.
    fn push(&mut self, key: Key, lane: Lane) {
        match (self.queued.get(&key), lane) {
            (Some(Lane::Fresh), _) | (Some(Lane::Backlog), Lane::Backlog) => return,
            _ => {}
        }
        self.queued.insert(key.clone(), lane);
        match lane {
            Lane::Fresh => self.fresh.push_back(key),
            Lane::Backlog => self.backlog.push_back(key),
        }
    }

    fn remove(&mut self, key: &Key) {
        self.queued.remove(key);
    }

    /// Up to `n` keys, fresh ones first, with the lane each came from.
    fn take(&mut self, n: usize) -> Vec<(Key, Lane)> {
        let mut taken = Vec::with_capacity(n);
        for (deque, lane) in [(&mut self.fresh, Lane::Fresh), (&mut self.backlog, Lane::Backlog)] {
            while taken.len() < n {
                let Some(key) = deque.pop_front() else { break };
                if self.queued.get(&key) == Some(&lane) {
                    self.queued.remove(&key);
                    taken.push((key, lane));
                }
            }
        }
        taken
    }

    fn len(&self) -> usize {
        self.queued.len()
    }

    fn is_empty(&self) -> bool {
        self.queued.is_empty()
    }
}

/// How many label patches go out at once: additive increase, multiplicative decrease.
struct Pacer {
    limit: usize,
}

impl Default for Pacer {
    fn default() -> Self {
        Self { limit: Self::START }
    }
}

impl Pacer {
    const START: usize = 16;
    const MAX: usize = 64;

    fn in_flight(&self) -> usize {
        self.limit
    }

    /// After a batch: halve on a 429 and pause as asked; otherwise grow by one.
    fn after_batch(&mut self, throttled: Option<Duration>) -> Option<Duration> {
        match throttled {
            Some(pause) => {
                self.limit = (self.limit / 2).max(1);
                Some(pause)
            }
            None => {
                self.limit = (self.limit + 1).min(Self::MAX);
                None
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn k(name: &str) -> Key {
        ("ns".to_string(), name.to_string())
    }

    #[test]
    fn policies_seen_in_watch_events_go_before_the_backlog() {
        let mut q = Pending::default();
        for name in ["a", "b", "c"] {
            q.push(k(name), Lane::Backlog);
        }
        q.push(k("new"), Lane::Fresh);
        q.push(k("c"), Lane::Fresh); // edited while still waiting in the backlog
        q.push(k("new"), Lane::Fresh);
        assert_eq!(q.len(), 4, "each key once");
        let taken: Vec<Key> = q.take(3).into_iter().map(|(key, _)| key).collect();
        assert_eq!(taken, vec![k("new"), k("c"), k("a")]);
        q.remove(&k("b"));
        assert!(q.is_empty(), "deleted while waiting");
        assert!(q.take(10).is_empty(), "copies left behind in the backlog are skipped");
    }

    #[test]
    fn the_pacer_halves_on_429_and_grows_by_one_otherwise() {
        let mut pacer = Pacer::default();
        assert_eq!(pacer.after_batch(None), None);
        assert_eq!(pacer.in_flight(), Pacer::START + 1);
        let pause = Duration::from_secs(3);
        assert_eq!(pacer.after_batch(Some(pause)), Some(pause), "the server's Retry-After is honoured");
        assert_eq!(pacer.in_flight(), 8, "17 halved");
        for _ in 0..10 {
            pacer.after_batch(Some(pause));
        }
        assert_eq!(pacer.in_flight(), 1, "never below one");
        for _ in 0..200 {
            pacer.after_batch(None);
        }
        assert_eq!(pacer.in_flight(), Pacer::MAX);
    }
}

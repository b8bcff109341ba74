//! A leader's labelling duty in label mode: each namespace carries its own bucket label, so
//! that an admission policy can copy it onto every object the API server admits there. An
//! object then carries its bucket from its first write, reaches its owner at once, and costs
//! the leader no PATCH of its own: one write per namespace replaces one per object. CEL
//! cannot compute the bucket (an xxh3 hash), hence the label on the namespace.
//!
//! The program grants the list, watch and patch on namespaces this needs with that policy.
//! Without the grant the list is refused (and tried again after the watcher's backoff, so
//! that a grant added later takes effect), and the program's own labeller must label each
//! object, as it still must for one admitted before its namespace was labelled.

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::core::v1::Namespace;
use kube::api::{Api, PartialObjectMeta, Patch, PatchParams};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Client, ResourceExt};
use tokio::task::JoinSet;
use tokio::time::Instant;

use super::metrics as m;
use crate::bucket::{bucket_of, label_value};
use sharded_runtime::retries::Retries;

/// Namespaces labelled at once: after the first list, a cluster may have thousands to label,
/// and an object written in one of them meanwhile waits for the program's labeller.
const CONCURRENCY: usize = 16;

/// A label removed this soon after the leader wrote it was removed by someone else, such as
/// a controller that disagrees: putting it back at once each time would make the two patch
/// in a hot loop.
const CONTESTED_WITHIN: Duration = Duration::from_secs(10);

/// Keeps every watched namespace's bucket label right (a namespace created later, or a label
/// removed or changed by hand, included). Runs while leading. A namespace whose patch fails
/// (a webhook refusing it, a 429, or a webhook that strips the label as it is written) is
/// retried after its own backoff, and its watch events are ignored meanwhile, as they are
/// while its patch is in flight, so that no failure becomes a hot loop. A label that keeps
/// being removed soon after it is written is put back after a backoff too.
pub async fn label_namespaces(client: Client, watch_namespace: Option<String>, bucket_label: &'static str) {
    let api: Api<Namespace> = Api::all(client.clone());
    let metadata: Api<PartialObjectMeta<Namespace>> = Api::all(client);
    let config = match &watch_namespace {
        Some(name) => watcher::Config::default().fields(&format!("metadata.name={name}")),
        None => watcher::Config::default(),
    };
    let mut events = std::pin::pin!(watcher(metadata, config).default_backoff());
    let mut retries = Retries::<String>::default();
    // Dropped (aborting what is in flight) when the leader stops this task.
    let mut in_flight = JoinSet::new();
    // Names in flight, each with whether an event came for it meanwhile (then it is checked
    // again: the event may tell of a later state than the patch saw).
    let mut busy: HashMap<String, bool> = HashMap::new();
    // Whose each task is, so that a task that panicked still frees its namespace.
    let mut tasks: HashMap<tokio::task::Id, String> = HashMap::new();
    let mut list_refused = false;
    let mut contested = Contested::default();
    // Namespaces whose last patch failed: only the first failure of a run is a warning (a
    // contested label waits in `retries` too, yet its last patch succeeded).
    let mut refused: HashSet<String> = HashSet::new();
    loop {
        let room = in_flight.len() < CONCURRENCY;
        let name = tokio::select! {
            Some(done) = in_flight.join_next_with_id() => {
                let (id, outcome) = match done {
                    Ok((id, outcome)) => (id, outcome),
                    // Only a panic: the set is never aborted while this loop runs. Logged as an
                    // error each time (a bug, not a refusal), at the pace of the namespace's backoff.
                    Err(error) => {
                        m::count_bucket_label_error();
                        let namespace = tasks.get(&error.id()).map(String::as_str);
                        tracing::error!(%error, namespace, "labelling a namespace panicked; retrying");
                        (error.id(), Labelling::Failed)
                    }
                };
                let Some(name) = tasks.remove(&id) else { continue };
                let stale = busy.remove(&name).unwrap_or(false);
                if matches!(outcome, Labelling::Failed) {
                    refused.insert(name.clone());
                } else {
                    refused.remove(&name);
                }
                match outcome {
                    Labelling::Failed => retries.later(name),
                    Labelling::Gone => {
                        retries.forget(&name);
                        contested.forget(&name);
                    }
                    Labelling::Done => {
                        retries.forget(&name);
                        contested.labelled(&name);
                        // Removed while the patch was on its way back: contested too, so that a
                        // controller quicker than this loop cannot make it patch without backoff.
                        if stale && !contested.back_off(&mut retries, &name) {
                            retries.later(name);
                        }
                    }
                }
                continue;
            }
            event = events.next(), if room => match event {
                Some(Ok(watcher::Event::Apply(ns) | watcher::Event::InitApply(ns))) => {
                    let name = ns.name_any();
                    let labelled = ns.labels().get(bucket_label) == Some(&label_value(bucket_of(&name)));
                    if let Some(stale) = busy.get_mut(&name).filter(|_| !labelled) {
                        *stale = true;
                    }
                    if labelled || busy.contains_key(&name) || retries.failing(&name) {
                        continue;
                    }
                    if contested.back_off(&mut retries, &name) {
                        continue;
                    }
                    name
                }
                Some(Ok(watcher::Event::Delete(ns))) => {
                    let name = ns.name_any();
                    contested.forget(&name);
                    refused.remove(&name);
                    continue;
                }
                // After each (re)list: what a missed Delete left behind goes.
                Some(Ok(watcher::Event::InitDone)) => {
                    contested.prune(&retries);
                    continue;
                }
                Some(Ok(watcher::Event::Init)) => continue,
                // Without the component's grant: the watcher tries again after its backoff (up
                // to 30 s apart), so a grant added later takes effect without a restart.
                Some(Err(watcher::Error::InitialListFailed(kube::Error::Api(s)))) if s.code == 403 => {
                    if !std::mem::replace(&mut list_refused, true) {
                        tracing::info!(
                            "namespaces are not labelled with their bucket (no permission to list them); \
                             the leader labels each object instead"
                        );
                    }
                    continue;
                }
                Some(Err(error)) => {
                    sharded_runtime::metrics::count_watch_error("Namespace");
                    tracing::warn!(%error, "namespace watch failed; retrying");
                    continue;
                }
                None => return,
            },
            Some(name) = retries.next_due(), if room => name,
        };
        busy.insert(name.clone(), false);
        let (api, first_failure, task_name) = (api.clone(), !refused.contains(&name), name.clone());
        let task = in_flight.spawn(async move { label(&api, &task_name, bucket_label, first_failure).await });
        tasks.insert(task.id(), name);
    }
}

/// When the leader last labelled each namespace it labelled (one entry per namespace that
/// exists), and how many times in a row the label was then removed within [`CONTESTED_WITHIN`].
#[derive(Default)]
struct Contested(HashMap<String, (Instant, u32)>);

impl Contested {
    fn labelled(&mut self, name: &str) {
        let now = Instant::now();
        self.0.entry(name.to_owned()).and_modify(|(labelled_at, _)| *labelled_at = now).or_insert((now, 0));
    }

    fn forget(&mut self, name: &str) {
        self.0.remove(name);
    }

    /// Drops the entries that tell nothing: labelled long ago, with no retry pending (a
    /// removal now would start a new streak anyway).
    fn prune(&mut self, retries: &Retries<String>) {
        self.0.retain(|name, (labelled_at, _)| labelled_at.elapsed() < CONTESTED_WITHIN || retries.failing(name));
    }

    /// For a namespace seen without its label: when the label was removed soon after the
    /// leader wrote it, schedules it again after the streak's backoff, counts and logs that,
    /// and returns true; false when it should be put back at once.
    fn back_off(&mut self, retries: &mut Retries<String>, name: &str) -> bool {
        let Some(streak) = self.note_removal(name) else { return false };
        m::count_bucket_label_error();
        if streak == 1 {
            tracing::warn!(
                namespace = name,
                "the namespace's bucket label was removed or changed within {CONTESTED_WITHIN:?} of being \
                 written (does another controller remove it?); it is put back after a growing backoff"
            );
        }
        retries.later_with_failures(name.to_owned(), streak);
        true
    }

    /// For a namespace seen without its label: how many times in a row it was removed soon
    /// after being written, or `None` when it was not (then it is put back at once).
    fn note_removal(&mut self, name: &str) -> Option<u32> {
        let (labelled_at, streak) = self.0.get_mut(name)?;
        if labelled_at.elapsed() >= CONTESTED_WITHIN {
            *streak = 0;
            return None;
        }
        *streak += 1;
        Some(*streak)
    }
}

/// Puts the namespace's bucket label on it (done only when the answer shows the label). A
/// failure is logged as a warning the first time since the namespace last succeeded, and at
/// debug level on its retries: a namespace that a policy engine protects is refused for good.
async fn label(api: &Api<Namespace>, name: &str, bucket_label: &str, first_failure: bool) -> Labelling {
    let bucket = label_value(bucket_of(name));
    let patch = serde_json::json!({ "metadata": { "labels": { bucket_label: &bucket } } });
    match api.patch_metadata(name, &PatchParams::default(), &Patch::Merge(&patch)).await {
        Ok(ns) if ns.labels().get(bucket_label) == Some(&bucket) => {
            m::count_namespace_label();
            Labelling::Done
        }
        Ok(_) => {
            m::count_bucket_label_error();
            tracing::warn!(namespace = name, "the namespace's bucket label was removed as it was written; retrying");
            Labelling::Failed
        }
        Err(kube::Error::Api(s)) if s.code == 404 => Labelling::Gone,
        Err(error) if first_failure => {
            m::count_bucket_label_error();
            tracing::warn!(%error, namespace = name, "labelling a namespace failed; retrying");
            Labelling::Failed
        }
        Err(error) => {
            m::count_bucket_label_error();
            tracing::debug!(%error, namespace = name, "labelling a namespace failed again; retrying");
            Labelling::Failed
        }
    }
}

/// What became of one patch of a namespace's label.
enum Labelling {
    Done,
    /// The namespace is gone.
    Gone,
    Failed,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn a_label_removed_soon_after_each_write_is_contested_for_longer_each_time() {
        let mut contested = Contested::default();
        assert_eq!(contested.note_removal("a"), None, "never labelled by this leader: put back at once");
        contested.labelled("a");
        assert_eq!(contested.note_removal("a"), Some(1));
        contested.labelled("a");
        tokio::time::advance(CONTESTED_WITHIN - Duration::from_millis(1)).await;
        assert_eq!(contested.note_removal("a"), Some(2), "the streak goes on across writes");
        contested.labelled("a");
        tokio::time::advance(CONTESTED_WITHIN).await;
        assert_eq!(contested.note_removal("a"), None, "a label that lasted is put back at once");
        contested.labelled("a");
        assert_eq!(contested.note_removal("a"), Some(1), "and a new streak starts from the first failure");
    }

    #[tokio::test(start_paused = true)]
    async fn pruning_keeps_what_a_streak_still_needs() {
        let (mut contested, mut retries) = (Contested::default(), Retries::default());
        for name in ["old", "waiting"] {
            contested.labelled(name);
        }
        assert!(contested.back_off(&mut retries, "waiting"), "removed at once: contested");
        tokio::time::advance(CONTESTED_WITHIN).await;
        contested.labelled("fresh");
        contested.prune(&retries);
        let mut kept: Vec<&str> = contested.0.keys().map(String::as_str).collect();
        kept.sort_unstable();
        assert_eq!(kept, ["fresh", "waiting"], "a streak with its retry pending survives its ten seconds");
    }
}

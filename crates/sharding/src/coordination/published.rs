//! The published assignment as this replica knows it: the newest one read (shared by the
//! lease, the follower and the leader), and the ConfigMap it is published in.

use std::sync::Arc;

use futures::StreamExt;
use k8s_openapi::api::core::v1::ConfigMap;
use kube::ResourceExt;
use kube::api::Api;
use kube::runtime::{WatchStreamExt, watcher};
use tokio::sync::watch;

use crate::assignment::Assignment;

/// The newest assignment this replica knows.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Published {
    pub assignment: Assignment,
    /// The ConfigMap's resourceVersion, the precondition of the next write; `None` once the
    /// ConfigMap was seen deleted: the next write creates it.
    pub resource_version: Option<String>,
    /// The ConfigMap does not hold this assignment: it was deleted, or an older copy was
    /// restored over it (a backup, a GitOps tool). The leader publishes it again, above
    /// every generation seen, before anything else moves.
    pub republish: bool,
}

impl Published {
    /// What we know after reading `assignment` from the ConfigMap at `resource_version`,
    /// when that changes what we knew (`known`). An older generation stored after the newer
    /// one we know (a restored copy) is treated as a loss: we keep the newer content, and
    /// the leader overwrites the copy.
    pub fn after_read(
        known: Option<&Published>,
        assignment: Assignment,
        resource_version: Option<String>,
    ) -> Option<Self> {
        let Some(known) = known else {
            return Some(Published { assignment, resource_version, republish: false });
        };
        let generation = assignment.generation;
        let same_copy = known.resource_version == resource_version;
        if generation > known.assignment.generation || (generation == known.assignment.generation && !same_copy) {
            return Some(Published { assignment, resource_version, republish: false });
        }
        // A watch event older than a read we already took is no restore.
        if generation == known.assignment.generation
            || same_copy
            || stored_before(resource_version.as_deref(), known.resource_version.as_deref())
        {
            return None;
        }
        tracing::warn!(
            stored = generation,
            known = known.assignment.generation,
            "an older assignment was stored over a newer one; it counts as lost"
        );
        Some(Published { resource_version, republish: true, ..known.clone() })
    }
}

/// The newest assignment, shared by the follower and the lease (which read it) and the
/// leader (which writes it). It never goes back to an older generation.
pub struct AssignmentView {
    current: watch::Sender<Option<Published>>,
}

impl Default for AssignmentView {
    fn default() -> Self {
        Self { current: watch::channel(None).0 }
    }
}

impl AssignmentView {
    /// The newest assignment read.
    pub fn get(&self) -> Option<Published> {
        self.current.borrow().clone()
    }

    /// The newest assignment if its generation is above `generation` (cloned only then).
    pub fn newer_than(&self, generation: u64) -> Option<Published> {
        self.current.borrow().as_ref().filter(|p| p.assignment.generation > generation).cloned()
    }

    /// Keeps the newer of what we have and `assignment`, read from the ConfigMap at
    /// `resource_version` (see [`Published::after_read`]).
    pub fn offer(&self, assignment: Assignment, resource_version: Option<String>) {
        self.current.send_if_modified(|current| {
            match Published::after_read(current.as_ref(), assignment, resource_version) {
                Some(next) => {
                    *current = Some(next);
                    true
                }
                None => false,
            }
        });
    }

    /// The ConfigMap is gone: keep its content (and its generation, which must not go
    /// back), and create it anew at the next write.
    pub fn gone(&self) {
        self.current.send_if_modified(|current| match current {
            Some(p) if p.resource_version.is_some() => {
                p.resource_version = None;
                p.republish = true;
                true
            }
            _ => false,
        });
    }

    /// Changes with every newer assignment.
    pub fn subscribe(&self) -> watch::Receiver<Option<Published>> {
        self.current.subscribe()
    }
}

/// Records every assignment published in `configmaps` from now on, in order, until the
/// returned task is stopped (for tools and tests that follow the leader's steps).
pub fn record_published(
    configmaps: Api<ConfigMap>,
    name: &str,
) -> (Arc<std::sync::Mutex<Vec<Assignment>>>, tokio::task::JoinHandle<()>) {
    let recorded = Arc::new(std::sync::Mutex::new(Vec::new()));
    let task = tokio::spawn({
        let recorded = recorded.clone();
        published(configmaps, name).for_each(move |assignment| {
            recorded.lock().unwrap_or_else(|p| p.into_inner()).push(assignment);
            std::future::ready(())
        })
    });
    (recorded, task)
}

/// Every assignment published in the ConfigMap `name` of `configmaps` from now on, newer
/// generations only (for tools and tests that follow the leader's steps).
pub fn published(configmaps: Api<ConfigMap>, name: &str) -> impl futures::Stream<Item = Assignment> + Send + use<> {
    let config = watcher::Config::default().fields(&format!("metadata.name={name}"));
    let mut last = 0;
    watcher(configmaps, config).default_backoff().applied_objects().filter_map(move |event| {
        let newer = event.ok().as_ref().and_then(decode).map(|(a, _)| a).filter(|a| a.generation > last);
        if let Some(assignment) = &newer {
            last = assignment.generation;
        }
        std::future::ready(newer)
    })
}

/// Whether resourceVersion `a` was stored before `b`. Kubernetes 1.35 made resourceVersions
/// comparable as integers (KEP-5504); anything else compares as not before.
fn stored_before(a: Option<&str>, b: Option<&str>) -> bool {
    let number = |rv: Option<&str>| rv.and_then(|rv| rv.parse::<u128>().ok());
    matches!((number(a), number(b)), (Some(a), Some(b)) if a < b)
}

/// The assignment in `cm`, with its resourceVersion; `None` (logged) when malformed.
pub fn decode(cm: &ConfigMap) -> Option<(Assignment, String)> {
    let data = cm.data.as_ref()?;
    match Assignment::decode(data) {
        Ok(assignment) => Some((assignment, cm.resource_version().unwrap_or_default())),
        Err(error) => {
            tracing::error!(%error, "the published assignment is malformed; keeping the previous one");
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn generation(generation: u64) -> Assignment {
        Assignment { generation, ..Default::default() }
    }

    fn known(view: &AssignmentView) -> (u64, Option<String>, bool) {
        let p = view.get().unwrap();
        (p.assignment.generation, p.resource_version, p.republish)
    }

    #[test]
    fn a_restored_older_copy_counts_as_lost_and_keeps_the_newer_content() {
        let view = AssignmentView::default();
        view.offer(generation(5), Some("100".into()));
        view.offer(generation(7), Some("120".into()));
        view.offer(generation(5), Some("130".into()));
        assert_eq!(known(&view), (7, Some("130".into()), true), "overwrite the copy, keep generation 7");
        view.offer(generation(8), Some("140".into()));
        assert_eq!(known(&view), (8, Some("140".into()), false), "published again");
    }

    #[test]
    fn a_late_watch_event_is_no_restore() {
        let view = AssignmentView::default();
        view.offer(generation(7), Some("120".into()));
        view.offer(generation(6), Some("110".into()));
        assert_eq!(known(&view), (7, Some("120".into()), false));
    }

    #[test]
    fn a_deleted_configmap_is_published_again() {
        let view = AssignmentView::default();
        view.offer(generation(7), Some("120".into()));
        view.gone();
        assert_eq!(known(&view), (7, None, true));
        view.offer(generation(8), Some("150".into()));
        assert_eq!(known(&view), (8, Some("150".into()), false));
    }
}

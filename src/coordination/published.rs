//! The published assignment as this replica knows it: the newest one read (shared by the
//! lease, the follower and the leader), and the ConfigMap it is published in.

use std::sync::Arc;

use futures::StreamExt;
use k8s_openapi::api::core::v1::ConfigMap;
use kube::ResourceExt;
use kube::api::Api;
use kube::runtime::{WatchStreamExt, watcher};
use tokio::sync::watch;

use super::ASSIGNMENT_CONFIGMAP;
use crate::sharding::assignment::Assignment;

/// The newest assignment this replica knows.
#[derive(Clone, Debug)]
pub struct Published {
    pub assignment: Assignment,
    /// `None` once the ConfigMap was seen deleted: the next write creates it.
    pub resource_version: Option<String>,
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
    pub fn get(&self) -> Option<Published> {
        self.current.borrow().clone()
    }

    /// The newest assignment if its generation is above `generation` (cloned only then).
    pub fn newer_than(&self, generation: u64) -> Option<Published> {
        self.current.borrow().as_ref().filter(|p| p.assignment.generation > generation).cloned()
    }

    /// Keeps the newer of what we have and `assignment`.
    pub fn offer(&self, assignment: Assignment, resource_version: Option<String>) {
        self.current.send_if_modified(|current| {
            let newer = current.as_ref().is_none_or(|p| {
                assignment.generation > p.assignment.generation
                    || (assignment.generation == p.assignment.generation && p.resource_version != resource_version)
            });
            if newer {
                *current = Some(Published { assignment, resource_version });
            }
            newer
        });
    }

    /// The ConfigMap is gone: keep its content (and its generation, which must not go
    /// back), and create it anew at the next write.
    pub fn gone(&self) {
        self.current.send_if_modified(|current| match current {
            Some(p) if p.resource_version.is_some() => {
                p.resource_version = None;
                true
            }
            _ => false,
        });
    }

    pub fn subscribe(&self) -> watch::Receiver<Option<Published>> {
        self.current.subscribe()
    }
}

/// Records every assignment published in `configmaps` from now on, in order, until the
/// returned task is stopped (for tools and tests that follow the leader's steps).
pub fn record_published(
    configmaps: Api<ConfigMap>,
) -> (Arc<std::sync::Mutex<Vec<Assignment>>>, tokio::task::JoinHandle<()>) {
    let recorded = Arc::new(std::sync::Mutex::new(Vec::new()));
    let task = tokio::spawn({
        let recorded = recorded.clone();
        published(configmaps).for_each(move |assignment| {
            recorded.lock().unwrap_or_else(|p| p.into_inner()).push(assignment);
            std::future::ready(())
        })
    });
    (recorded, task)
}

/// Every assignment published in `configmaps` from now on, newer generations only (for tools
/// and tests that follow the leader's steps).
pub fn published(configmaps: Api<ConfigMap>) -> impl futures::Stream<Item = Assignment> + Send {
    let config = watcher::Config::default().fields(&format!("metadata.name={ASSIGNMENT_CONFIGMAP}"));
    let mut last = 0;
    watcher(configmaps, config).default_backoff().applied_objects().filter_map(move |event| {
        let newer = event.ok().as_ref().and_then(decode).map(|(a, _)| a).filter(|a| a.generation > last);
        if let Some(assignment) = &newer {
            last = assignment.generation;
        }
        std::future::ready(newer)
    })
}

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

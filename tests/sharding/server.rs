//! Safety judged from what the API server received, not from what replicas say they did.
//!
//! - [`judge`] reads kube-apiserver's audit log. Every replica process runs as its own
//!   service account, so the audit log tells processes apart, and every write of ours
//!   carries its bucket's fencing epoch. Epochs are granted to one incarnation each, so two
//!   processes writing one object with the same epoch, or an accepted write with a lower
//!   epoch than one already accepted, is an overlap. A write the fencing policy refused is
//!   a fenced late write.
//!   The gateway objects (HTTPRoute, Middleware) are judged as the other children are.
//! - [`ForwardOnly`] watches the rate-limit ConfigMaps: the tests write an ever-growing
//!   counter into the specs, so a child whose counter goes back was written from an older
//!   spec after a newer one.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::sync::{Arc, Mutex};

use futures::StreamExt;
use k8s_openapi::api::core::v1::ConfigMap;
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Api, Client, ResourceExt};

const FENCE: &str = "trafficpolicy.dev/shard-epoch";

#[derive(Clone, Debug)]
pub struct Write {
    pub at: String,
    pub user: String,
    pub object: String,
    pub code: u16,
    pub epoch: Option<u64>,
    /// For a rate-limit ConfigMap, the spec counter it carries: which spec change it applies.
    pub rate: Option<u64>,
    pub fenced: bool,
}

/// Our writes in the audit log: SSA patches of children and status patches, by `users`.
pub fn writes(audit_log: &Path, users: &BTreeSet<String>) -> Vec<Write> {
    let text = std::fs::read_to_string(audit_log).unwrap_or_default();
    let mut writes: Vec<Write> = text
        .lines()
        .filter_map(|line| serde_json::from_str::<serde_json::Value>(line).ok())
        .filter(|e| e["stage"] == "ResponseComplete" && e["verb"] == "patch")
        // The audit log also has Lease writes (for `grants`); the leader Lease is patched.
        .filter(|e| e["objectRef"]["resource"] != "leases")
        .filter_map(|e| {
            let user = e["user"]["username"].as_str()?.to_string();
            if !users.contains(&user) {
                return None;
            }
            let r = &e["objectRef"];
            let subresource = r["subresource"].as_str().unwrap_or_default();
            let object = format!(
                "{}/{}/{}{}",
                r["resource"].as_str()?,
                r["namespace"].as_str()?,
                r["name"].as_str()?,
                if subresource.is_empty() { String::new() } else { format!("/{subresource}") }
            );
            let request = &e["requestObject"];
            let epoch = match subresource {
                "status" => request["status"]["shardEpoch"].as_u64(),
                _ => request["metadata"]["annotations"][FENCE].as_str().and_then(|v| v.parse().ok()),
            };
            // The spec counter: in the rate-limit ConfigMap's document, or a Middleware's average.
            let rate = request["data"].as_object().and_then(|d| d.values().next()?.as_str()).and_then(rate_in);
            let rate = rate.or_else(|| request["spec"]["rateLimit"]["average"].as_u64());
            let code = e["responseStatus"]["code"].as_u64().unwrap_or(0) as u16;
            let message = e["responseStatus"]["message"].as_str().unwrap_or_default();
            Some(Write {
                at: e["stageTimestamp"].as_str()?.to_string(),
                user,
                object,
                code,
                epoch,
                rate,
                fenced: message.contains("refused a write with shard epoch"),
            })
        })
        .collect();
    writes.sort_by(|a, b| a.at.cmp(&b.at));
    writes
}

#[derive(Debug, Default)]
pub struct Verdict {
    pub writes: usize,
    /// Accepted writes that overlapped another owner's (must be 0).
    pub overlapping: Vec<String>,
    /// Late writes the fencing policy refused.
    pub fenced: usize,
    /// The processes (users) whose writes were fenced.
    pub fenced_by: BTreeSet<String>,
    /// Accepted writes that came after their bucket was granted to another process (must be 0;
    /// see `grants`).
    pub after_grant: Vec<String>,
}

pub fn judge(writes: &[Write]) -> Verdict {
    judge_by(writes, true)
}

/// `judge`, with the epoch-free check only when `spec_changes` is set: a change of sharding
/// mode changes the children's labels, so every new owner rightly applies each spec once more
/// and only the epochs tell an overlap there.
pub fn judge_by(writes: &[Write], spec_changes: bool) -> Verdict {
    let mut verdict = Verdict { writes: writes.len(), ..Default::default() };
    let mut highest: BTreeMap<&str, u64> = BTreeMap::new();
    let mut writers: BTreeMap<(&str, u64), BTreeSet<&str>> = BTreeMap::new();
    // Epoch-free, so it also judges code that writes no epochs: one spec change applied by
    // two processes means both reconciled it, which a handoff never causes (a new owner
    // skips a child that already holds what it would apply).
    let mut applied: BTreeMap<(&str, u64), BTreeSet<&str>> = BTreeMap::new();
    for w in writes {
        if w.fenced {
            verdict.fenced += 1;
            verdict.fenced_by.insert(w.user.clone());
            continue;
        }
        if !(200..300).contains(&w.code) {
            continue;
        }
        if let Some(rate) = w.rate.filter(|_| spec_changes) {
            let users = applied.entry((&w.object, rate)).or_default();
            users.insert(&w.user);
            if users.len() == 2 {
                verdict.overlapping.push(format!("{} given spec change {rate} by both {users:?}", w.object));
            }
        }
        let Some(epoch) = w.epoch else { continue };
        let top = highest.entry(&w.object).or_insert(epoch);
        if epoch < *top {
            verdict.overlapping.push(format!("{} by {} at {}: epoch {epoch} after {top}", w.object, w.user, w.at));
        }
        *top = (*top).max(epoch);
        let users = writers.entry((&w.object, epoch)).or_default();
        users.insert(&w.user);
        if users.len() == 2 {
            verdict.overlapping.push(format!("{} written with epoch {epoch} by {users:?}", w.object));
        }
    }
    verdict
}

/// Per child, the highest counter seen; and every step back seen.
type Seen = (BTreeMap<String, u64>, Vec<String>);

/// Counts rate-limit children whose counter went backwards, as the server stored them.
#[derive(Clone, Default)]
pub struct ForwardOnly {
    state: Arc<Mutex<Seen>>,
}

impl ForwardOnly {
    pub fn watch(client: Client) -> (Self, tokio::task::JoinHandle<()>) {
        let this = Self::default();
        let config = watcher::Config::default().labels("app.kubernetes.io/managed-by=traffic-policy-operator");
        let events = watcher(Api::<ConfigMap>::all(client), config).default_backoff().applied_objects();
        let state = this.state.clone();
        let task = tokio::spawn(async move {
            let mut events = std::pin::pin!(events);
            while let Some(Ok(cm)) = events.next().await {
                let Some(rate) = rate_of(&cm) else { continue };
                let key = format!("{}/{}", cm.namespace().unwrap_or_default(), cm.name_any());
                let mut state = state.lock().unwrap();
                let (last, regressions) = &mut *state;
                let seen = last.entry(key.clone()).or_insert(rate);
                if rate < *seen {
                    regressions.push(format!("{key}: {seen} -> {rate}"));
                }
                *seen = rate.max(*seen);
            }
        });
        (this, task)
    }

    pub fn regressions(&self) -> Vec<String> {
        self.state.lock().unwrap().1.clone()
    }

    /// The counter the child of `key` (`namespace/name` of the ConfigMap) last showed.
    pub fn last(&self, key: &str) -> Option<u64> {
        self.state.lock().unwrap().0.get(key).copied()
    }
}

pub fn rate_of(cm: &ConfigMap) -> Option<u64> {
    rate_in(cm.data.as_ref()?.values().next()?)
}

/// The spec counter in a rate-limit ConfigMap's document.
fn rate_in(document: &str) -> Option<u64> {
    let doc: serde_json::Value = serde_json::from_str(document).ok()?;
    doc["rateLimit"]["requestsPerSecond"].as_u64()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn w(at: &str, user: &str, epoch: u64, code: u16, fenced: bool) -> Write {
        Write {
            at: at.into(),
            user: user.into(),
            object: "cm/ns/a".into(),
            code,
            epoch: Some(epoch),
            rate: None,
            fenced,
        }
    }

    fn unfenced(at: &str, user: &str, rate: u64) -> Write {
        Write {
            at: at.into(),
            user: user.into(),
            object: "cm/ns/a".into(),
            code: 200,
            epoch: None,
            rate: Some(rate),
            fenced: false,
        }
    }

    #[test]
    fn overlaps_are_two_writers_of_one_epoch_or_an_epoch_going_back() {
        let clean = [w("1", "a", 1, 200, false), w("2", "a", 1, 200, false), w("3", "b", 4, 200, false)];
        assert!(judge(&clean).overlapping.is_empty());
        let fenced = [w("1", "b", 4, 200, false), w("2", "a", 1, 403, true)];
        assert_eq!((judge(&fenced).overlapping.len(), judge(&fenced).fenced), (0, 1));
        let late = [w("1", "b", 4, 200, false), w("2", "a", 1, 200, false)];
        assert_eq!(judge(&late).overlapping.len(), 1, "a late write that was not fenced");
        let twins = [w("1", "a", 1, 200, false), w("2", "b", 1, 200, false)];
        assert_eq!(judge(&twins).overlapping.len(), 1, "two processes under one grant");
    }

    #[test]
    fn without_epochs_one_spec_change_applied_by_two_processes_is_an_overlap() {
        let handoff = [unfenced("1", "a", 7), unfenced("2", "a", 8), unfenced("3", "b", 9)];
        assert!(judge(&handoff).overlapping.is_empty());
        let both = [unfenced("1", "a", 7), unfenced("2", "b", 7)];
        assert_eq!(judge(&both).overlapping.len(), 1);
    }
}

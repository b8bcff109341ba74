//! A judge that knows the grants: kube-apiserver's audit log replayed against the history of
//! the published assignment. A write the server accepted from a process after the write's
//! bucket was granted to another process is a violation, whatever token it carried, so this
//! judges the timing layer on its own, as if there were no fencing.
//!
//! The audit log has every assignment the fleet published (with its content), every member
//! Lease write (which names the incarnation each service account holds), and every write of
//! ours, deletes included. An assignment whose generation is not above every earlier one is
//! not a grant: it is a restored copy, which members treat as lost.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

use serde_json::Value;
use traffic_policy_operator::coordination::ASSIGNMENT_CONFIGMAP;
use traffic_policy_operator::sharding::assignment::{Assignment, Slot};

/// One grant: when the assignment that made it was stored, and the assignment.
struct Published {
    stored: String,
    assignment: Assignment,
}

/// One write of ours the server accepted.
struct Accepted {
    received: String,
    user: String,
    namespace: String,
    what: String,
}

/// The writes of `users` the server accepted after their bucket was granted to another of them.
pub fn violations(audit_log: &Path, users: &BTreeSet<String>) -> Vec<String> {
    let text = std::fs::read_to_string(audit_log).unwrap_or_default();
    let events = text.lines().filter_map(|line| serde_json::from_str::<Value>(line).ok());
    let accepted = events.filter(|e| {
        let code = e["responseStatus"]["code"].as_u64().unwrap_or(0);
        e["stage"] == "ResponseComplete" && (200..300).contains(&code)
    });
    let mut user_of: BTreeMap<String, String> = BTreeMap::new();
    let mut history: Vec<Published> = Vec::new();
    let mut writes: Vec<Accepted> = Vec::new();
    for e in accepted {
        let Some(user) = e["user"]["username"].as_str().filter(|u| users.contains(*u)) else { continue };
        let (resource, name) = (e["objectRef"]["resource"].as_str(), e["objectRef"]["name"].as_str());
        let request = &e["requestObject"];
        match (resource, name, e["verb"].as_str()) {
            (Some("leases"), _, _) => {
                if let Some(holder) = request["spec"]["holderIdentity"].as_str().filter(|h| !h.is_empty()) {
                    user_of.insert(holder.to_string(), user.to_string());
                }
            }
            (Some("configmaps"), Some(ASSIGNMENT_CONFIGMAP), Some("create" | "update")) => {
                let data: Option<BTreeMap<String, String>> = serde_json::from_value(request["data"].clone()).ok();
                if let (Some(assignment), Some(stored)) =
                    (data.and_then(|d| Assignment::decode(&d).ok()), e["stageTimestamp"].as_str())
                {
                    history.push(Published { stored: stored.to_string(), assignment });
                }
            }
            // The leader's bucket labels on policies are written alike by whoever leads; a
            // policy's own writes go to its status.
            (Some("applicationtrafficpolicies"), _, _) if e["objectRef"]["subresource"] != "status" => {}
            // A delete is a write too: the gateway outputs a policy no longer asks for.
            (Some(resource), Some(name), Some("patch" | "delete")) => writes.push(Accepted {
                received: e["requestReceivedTimestamp"].as_str().unwrap_or_default().to_string(),
                user: user.to_string(),
                namespace: e["objectRef"]["namespace"].as_str().unwrap_or_default().to_string(),
                what: format!("{} {resource} {name}", e["verb"].as_str().unwrap_or_default()),
            }),
            _ => {}
        }
    }
    history.sort_by(|a, b| a.stored.cmp(&b.stored));
    let mut highest = 0;
    history.retain(|p| {
        let grows = p.assignment.generation > highest;
        highest = highest.max(p.assignment.generation);
        grows
    });
    judge(&history, &writes, &user_of)
}

fn judge(history: &[Published], writes: &[Accepted], user_of: &BTreeMap<String, String>) -> Vec<String> {
    let mut violations = Vec::new();
    for write in writes {
        // Audit timestamps are RFC 3339 with microseconds, all in UTC: they order as text. A
        // write received after the grant was stored certainly came after it.
        let Some(grant) = history.iter().rev().find(|p| p.stored < write.received) else { continue };
        let bucket = grant.assignment.bucket_of(&write.namespace);
        let Slot::Owned { member, .. } = &grant.assignment.slots[usize::from(bucket)] else { continue };
        match user_of.get(member) {
            Some(owner) if *owner != write.user => violations.push(format!(
                "{} in {} by {} (received {}) after generation {} (stored {}) granted bucket {bucket} to {member}",
                write.what, write.namespace, write.user, write.received, grant.assignment.generation, grant.stored
            )),
            _ => {}
        }
    }
    violations
}

#[cfg(test)]
mod tests {
    use super::*;
    use traffic_policy_operator::sharding::bucket::Mode;

    fn granted(stored: &str, generation: u64, member: &str, namespace: &str) -> Published {
        let mut assignment = Assignment { generation, mode: Mode::Labels, ..Assignment::default() };
        assignment.slots[usize::from(Mode::Labels.bucket_of(namespace))] =
            Slot::Owned { member: member.into(), epoch: generation };
        Published { stored: stored.into(), assignment }
    }

    fn write(received: &str, user: &str) -> Accepted {
        Accepted { received: received.into(), user: user.into(), namespace: "shop".into(), what: "cm a".into() }
    }

    #[test]
    fn a_write_after_its_bucket_went_to_another_process_is_a_violation() {
        let user_of =
            BTreeMap::from([("a_1".to_string(), "sa-a".to_string()), ("b_1".to_string(), "sa-b".to_string())]);
        let history = [granted("t1", 1, "a_1", "shop"), granted("t3", 2, "b_1", "shop")];
        let fine = [write("t2", "sa-a"), write("t4", "sa-b")];
        assert!(judge(&history, &fine, &user_of).is_empty());
        let late = [write("t4", "sa-a")];
        assert_eq!(judge(&history, &late, &user_of).len(), 1, "a's write came after b was granted the bucket");
    }
}

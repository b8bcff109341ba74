//! Unit tests of [`ChildVersions`](super::ChildVersions).

use super::*;

#[test]
fn classifies_writes_and_filters_echoes() {
    let v = ChildVersions::default();
    let k = ObjectKey::new("ns", "a");
    assert_eq!(v.written("Secret", &k, "10", Some(1), 1), ApplyEffect::FirstWrite);
    assert!(!v.observe("Secret", &k, Some("10"), None), "echo of our own write");
    assert_eq!(v.written("Secret", &k, "10", Some(1), 1), ApplyEffect::Unchanged);
    assert!(v.observe("Secret", &k, Some("11"), None), "someone else edited it");
    assert_eq!(v.written("Secret", &k, "12", Some(1), 1), ApplyEffect::Repaired);
    assert!(v.observe("Secret", &k, None, None), "deleted");
    assert_eq!(v.written("Secret", &k, "13", Some(1), 1), ApplyEffect::Repaired);
    assert_eq!(v.written("Secret", &k, "14", Some(2), 2), ApplyEffect::Updated);
    v.forget_owner(&k);
    assert!(v.is_empty());
}

#[test]
fn an_apply_is_skipped_only_while_the_child_holds_what_we_would_write() {
    let v = ChildVersions::default();
    let k = ObjectKey::new("ns", "a");
    assert!(!v.holds("ConfigMap", &k, 7), "nothing known yet");
    v.written("ConfigMap", &k, "10", Some(1), 7);
    assert!(v.holds("ConfigMap", &k, 7));
    assert!(!v.holds("ConfigMap", &k, 8), "the spec changed: different content");
    assert!(v.observe("ConfigMap", &k, Some("11"), None), "edited by someone else");
    assert!(!v.holds("ConfigMap", &k, 7), "edited: repair it");
    assert!(v.observe("ConfigMap", &k, Some("12"), Some(7)), "applied by another replica of ours");
    assert!(v.holds("ConfigMap", &k, 7));
    assert!(v.observe("ConfigMap", &k, None, Some(7)), "deleted");
    assert!(!v.holds("ConfigMap", &k, 7), "deleted: create it again");
}

fn meta(stamp: Option<&str>, entries: &[(&str, &str)]) -> ObjectMeta {
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ManagedFieldsEntry, Time};
    let entry = |(manager, time): &(&str, &str)| ManagedFieldsEntry {
        manager: Some(manager.to_string()),
        time: Some(Time(time.parse().unwrap())),
        ..Default::default()
    };
    ObjectMeta {
        annotations: stamp.map(|s| [("example.com/content".to_string(), s.to_string())].into()),
        managed_fields: Some(entries.iter().map(entry).collect()),
        ..Default::default()
    }
}

#[test]
fn a_stamp_counts_only_when_no_other_manager_changed_the_child_since() {
    let (t1, t2) = ("2026-01-01T00:00:01Z", "2026-01-01T00:00:02Z");
    let us = ContentStamp { annotation: "example.com/content", field_manager: "operator" };
    let ours = us.field_manager;
    assert_eq!(stamped_content(&meta(Some("ff"), &[(ours, t1)]), us), Some(255));
    assert_eq!(stamped_content(&meta(Some("ff"), &[("kubectl-label", t1), (ours, t2)]), us), Some(255));
    assert_eq!(stamped_content(&meta(Some("ff"), &[(ours, t1), ("kubectl-edit", t2)]), us), None, "edited after");
    assert_eq!(stamped_content(&meta(Some("ff"), &[(ours, t1), ("kubectl-edit", t1)]), us), None, "same second");
    assert_eq!(stamped_content(&meta(None, &[(ours, t1)]), us), None, "no stamp");
    assert_eq!(stamped_content(&meta(Some("ff"), &[("kubectl-create", t1)]), us), None, "never applied by us");
}

#[test]
fn content_hashes_follow_the_content() {
    let cm = |value: &str| k8s_openapi::api::core::v1::ConfigMap {
        data: Some([("k".to_string(), value.to_string())].into()),
        ..Default::default()
    };
    assert_eq!(content_hash(&cm("a")), content_hash(&cm("a")));
    assert_ne!(content_hash(&cm("a")), content_hash(&cm("b")));
}

#[test]
fn the_deletion_of_a_forgotten_owners_child_leaves_nothing_behind() {
    let v = ChildVersions::default();
    let k = ObjectKey::new("ns", "a");
    v.written("ConfigMap", &k, "10", Some(1), 7);
    v.forget_owner(&k);
    assert!(v.observe("ConfigMap", &k, None, None), "news: the owner looks again, and finds itself gone");
    assert!(v.is_empty(), "collected children of a deleted owner must not stay known");
}

#[test]
fn echoes_arriving_before_the_write_returns_are_recognised() {
    let v = ChildVersions::default();
    let k = ObjectKey::new("ns", "a");
    let write = v.begin_write(&k);
    assert!(!v.observe("ConfigMap", &k, Some("5"), None), "held while writing");
    assert_eq!(v.written("ConfigMap", &k, "5", Some(1), 1), ApplyEffect::FirstWrite);
    assert!(!write.finish(), "it was our own echo");
    assert!(!v.observe("ConfigMap", &k, Some("5"), None));

    let write = v.begin_write(&k);
    assert_eq!(v.written("ConfigMap", &k, "5", Some(1), 1), ApplyEffect::Unchanged);
    assert!(!v.observe("ConfigMap", &k, Some("6"), None), "held");
    assert!(write.finish(), "someone else wrote after us: look again");

    drop(v.begin_write(&k));
    assert!(v.observe("ConfigMap", &k, Some("7"), None), "a dropped write holds nothing back");
}

#[test]
fn a_write_that_ends_after_its_owner_was_forgotten_brings_nothing_back() {
    let v = ChildVersions::default();
    let k = ObjectKey::new("ns", "a");
    // The owner is deleted, or leaves the slice, while its children are being written.
    let write = v.begin_write(&k);
    v.forget_owner(&k);
    assert!(!v.observe("ConfigMap", &k, Some("5"), Some(1)), "held while writing");
    assert_eq!(v.written("ConfigMap", &k, "5", Some(1), 1), ApplyEffect::FirstWrite);
    assert!(write.finish(), "what the list of an owner that came back would bring: look again");
    assert!(v.is_empty(), "nothing would ever forget it again");

    // One kind's watch lets go of the owner's bucket while the owner is being written.
    let write = v.begin_write(&k);
    v.forget_kind_where("ConfigMap", |_| true);
    v.written("ConfigMap", &k, "6", Some(1), 1);
    v.written("Secret", &k, "7", Some(1), 2);
    assert!(!write.finish());
    assert!(!v.holds("ConfigMap", &k, 1), "forgotten");
    assert!(v.holds("Secret", &k, 2), "that kind's watch still covers the owner");
}

#[test]
fn a_reported_generation_is_remembered_while_the_children_are_known() {
    let v = ChildVersions::default();
    let k = ObjectKey::new("ns", "a");
    v.mark_reported(&k, "u1", Some(1));
    assert!(!v.reported(&k, "u1", Some(1)), "nothing known of the children: nothing to remember it with");
    v.written("ConfigMap", &k, "5", Some(1), 1);
    assert!(!v.reported(&k, "u1", Some(1)));
    v.mark_reported(&k, "u1", Some(1));
    assert!(v.reported(&k, "u1", Some(1)));
    assert!(!v.reported(&k, "u1", Some(2)), "a new generation is reported anew");
    assert!(!v.reported(&k, "u1", None), "an object without a generation has nothing reported");
    assert!(!v.reported(&k, "u2", Some(1)), "another object under the same name: its generation 1 is its own");
    v.mark_reported(&k, "u1", Some(i64::from(u32::MAX) + 1));
    assert!(!v.reported(&k, "u1", Some(i64::from(u32::MAX) + 1)), "beyond 2^32 never taken as reported");
    v.mark_reported(&k, "u1", Some(1));
    v.forget_kind_where("ConfigMap", |_| true);
    assert!(!v.reported(&k, "u1", Some(1)), "forgotten with the children");
    assert!(v.is_empty());
}

#[test]
fn a_first_write_of_a_kind_is_forgotten_too_when_its_watch_lets_go_first() {
    let v = ChildVersions::default();
    let k = ObjectKey::new("ns", "a");
    let write = v.begin_write(&k);
    v.forget_kind_where("ConfigMap", |_| true);
    v.written("ConfigMap", &k, "5", Some(1), 1);
    assert!(!write.finish(), "no event was held");
    assert!(v.is_empty());
}

#[test]
fn a_dropped_scope_forgets_its_kind_and_empty_entries() {
    let versions = ChildVersions::default();
    let (kept, dropped) = (ObjectKey::new("kept", "p"), ObjectKey::new("dropped", "p"));
    for owner in [&kept, &dropped] {
        versions.observe("Secret", owner, Some("1"), Some(7));
        versions.observe("ConfigMap", owner, Some("1"), Some(8));
    }
    let in_dropped = |owner: &ObjectKey| owner.namespace() == "dropped";
    versions.forget_kind_where("Secret", in_dropped);
    assert!(versions.holds("Secret", &kept, 7));
    assert!(!versions.holds("Secret", &dropped, 7));
    assert!(versions.holds("ConfigMap", &dropped, 8), "the other kind's watch has not dropped it yet");
    versions.forget_kind_where("ConfigMap", in_dropped);
    assert_eq!(versions.lock().known.len(), 1, "nothing is left of the dropped owner");
}

#[test]
fn an_owner_entry_keeps_its_children_and_reported_generation_in_56_bytes() {
    assert_eq!(std::mem::size_of::<Children>(), 56, "two slots of 24 bytes and 8, kinds named once");
}

#[test]
fn a_child_a_list_does_not_find_is_known_deleted_unless_it_changed_since() {
    let versions = ChildVersions::default();
    let (gone, kept, rewritten) =
        (ObjectKey::new("n", "gone"), ObjectKey::new("n", "kept"), ObjectKey::new("n", "new"));
    for owner in [&gone, &kept, &rewritten] {
        versions.observe("ConfigMap", owner, Some("1"), Some(7));
    }
    let before = versions.known_where("ConfigMap", |_| true);
    // Written by us while the list ran, after its snapshot.
    versions.written("ConfigMap", &rewritten, "2", Some(1), 7);
    let found = HashSet::from([kept.clone()]);
    assert_eq!(versions.missing_from_list("ConfigMap", before, &found), std::slice::from_ref(&gone));
    assert!(!versions.holds("ConfigMap", &gone, 7), "applied again at the next reconcile");
    assert!(versions.holds("ConfigMap", &kept, 7) && versions.holds("ConfigMap", &rewritten, 7));
}

use super::*;
use proptest::prelude::*;
use std::time::Duration;

pub(crate) fn set(members: &[&str]) -> BTreeSet<String> {
    members.iter().map(|m| m.to_string()).collect()
}

pub(crate) fn never(_: &str, _: u64) -> bool {
    false
}

pub(crate) fn always(_: &str, _: u64) -> bool {
    true
}

#[test]
fn first_assignment_gives_everything_out_with_its_generation_as_epoch() {
    let a = plan(&Assignment::default(), &set(&["a", "b", "c"]), &never, None).unwrap();
    assert_eq!(a.generation, 1);
    let shares = a.shares();
    assert_eq!(shares.values().sum::<usize>(), usize::from(BUCKETS));
    assert_eq!(shares.len(), 3);
    assert!(a.owned_by("a", Mode::Labels).values().all(|e| *e == 1));
    assert_eq!(plan(&a, &set(&["a", "b", "c"]), &never, None), None, "stable once settled");
}

#[test]
fn a_live_owner_drains_before_anyone_else_gets_its_buckets() {
    let settled = plan(&Assignment::default(), &set(&["a", "b"]), &never, None).unwrap();
    let grown = set(&["a", "b", "c"]);
    let draining = plan(&settled, &grown, &never, None).unwrap();
    assert!(draining.owned_by("c", Mode::Labels).is_empty(), "c gets nothing until the old owners let go");
    let moving = draining.slots.iter().filter(|s| matches!(s, Slot::Draining { .. })).count();
    assert!(moving > 0);
    assert_eq!(plan(&draining, &grown, &never, None), None);
    let done = plan(&draining, &grown, &always, None).unwrap();
    assert_eq!(done.unowned(&grown), 0);
    assert!(done.owned_by("c", Mode::Labels).values().all(|e| *e == done.generation), "a new owner gets a new epoch");
    let before = settled.owned_by("a", Mode::Labels);
    let kept: Vec<_> = done.owned_by("a", Mode::Labels).into_iter().filter(|(b, _)| before.contains_key(b)).collect();
    assert!(!kept.is_empty() && kept.iter().all(|(b, e)| before[b] == *e), "kept buckets keep their epoch");
}

#[test]
fn a_dead_owner_is_revoked_first_too() {
    let settled = plan(&Assignment::default(), &set(&["a", "b", "c"]), &never, None).unwrap();
    let lost = settled.owned_by("c", Mode::Labels);
    let revoked = plan(&settled, &set(&["a", "b"]), &never, None).unwrap();
    for bucket in lost.keys() {
        assert!(
            matches!(&revoked.slots[usize::from(*bucket)], Slot::Draining { from, .. } if from == "c"),
            "c's bucket {bucket} must be revoked, not handed over"
        );
    }
    let moved = plan(&revoked, &set(&["a", "b"]), &|from: &str, _: u64| from == "c", None).unwrap();
    assert!(lost.keys().all(|b| !matches!(&moved.slots[usize::from(*b)], Slot::Draining { .. })));
}

#[test]
fn no_member_is_given_more_than_it_can_hold_and_the_rest_is_freed() {
    let members = set(&["a", "b"]);
    let objects: Counts = (0..BUCKETS).map(|b| (b, 10)).collect();
    let settled = plan(&Assignment::default(), &members, &never, Some(objects.clone())).unwrap();
    assert_eq!(settled.unowned(&members), 0);
    // Room for 3,000 of the 10,240 objects each.
    let capacities = Capacities::from([("a".into(), 3000), ("b".into(), 3000)]);
    let revoked = plan_within(&settled, &members, &capacities, &never, None).unwrap();
    let draining = revoked.slots.iter().filter(|s| matches!(s, Slot::Draining { .. })).count();
    assert!(draining >= 1024 - 600, "what does not fit is revoked: {draining}");
    let freed = plan_within(&revoked, &members, &capacities, &always, None).unwrap();
    let free = freed.slots.iter().filter(|s| **s == Slot::Free).count();
    let left_out = Wanted::of(&settled, &members, &capacities, None).unplaced(&members);
    assert_eq!(free, left_out.len(), "freed once released: exactly what fits nowhere");
    assert_eq!(left_out.values().map(|n| u64::from(*n)).sum::<u64>(), 10240 - 6000);
    for member in ["a", "b"] {
        let held: u64 = freed.owned_by(member, Mode::Labels).keys().map(|b| u64::from(objects[b])).sum();
        assert_eq!(held, 3000, "{member} is filled to its capacity, and no further");
    }
    assert_eq!(plan_within(&freed, &members, &capacities, &always, None), None, "and it stays so");
    // Without capacities, the free buckets are given again (and a few others move).
    let given = plan(&freed, &members, &always, None).unwrap();
    assert!(given.slots.iter().all(|s| *s != Slot::Free));
}

#[test]
fn a_change_of_ranges_revokes_and_frees_the_changed_buckets_only() {
    let settled = plan(&Assignment::default(), &set(&["a_1", "b_1"]), &never, None).unwrap();
    let changed = BTreeSet::from([3, 700]);
    let revoked = vacate_buckets(&settled, &changed, &never).unwrap();
    for b in 0..BUCKETS {
        let (was, is) = (&settled.slots[usize::from(b)], &revoked.slots[usize::from(b)]);
        match changed.contains(&b) {
            true => assert!(matches!(is, Slot::Draining { since, .. } if *since == revoked.generation)),
            false => assert_eq!(is, was, "bucket {b} keeps its owner and epoch"),
        }
    }
    assert_eq!(vacate_buckets(&revoked, &changed, &never), None, "nothing to do until they are let go");
    let freed = vacate_buckets(&revoked, &changed, &always).unwrap();
    assert!(changed.iter().all(|b| freed.slots[usize::from(*b)] == Slot::Free));
    assert_eq!(freed.shares().values().sum::<usize>(), 1022);
}

#[test]
fn split_ranges_are_written_in_a_mode_older_versions_cannot_read() {
    let namespaces = (1..=40).map(|n| (format!("team-{n}"), 100)).collect();
    let split = HashRanges::uniform().split(&crate::hash_ranges::by_hash(&namespaces));
    let a = Assignment { mode: Mode::ShardSelector, ranges: Ranges::new(split), ..Assignment::default() };
    let data = a.encode();
    assert_eq!(data["mode"], SPLIT_RANGES_MODE);
    assert_eq!(Mode::parse(&data["mode"]), None, "what an older version does with it: unknown mode");
    assert_eq!(Assignment::decode(&data).unwrap(), a);
    assert_eq!(a.bucket_of("team-7"), a.ranges.bucket_of("team-7"));
    let uniform = Assignment { mode: Mode::ShardSelector, ..Assignment::default() };
    assert_eq!(uniform.encode()["mode"], "shard-selector", "uniform ranges: as before");
    let mut missing = data.clone();
    missing.remove("ranges");
    assert!(Assignment::decode(&missing).unwrap_err().contains("ranges"));
}

#[test]
fn without_receivers_nothing_moves() {
    let settled = plan(&Assignment::default(), &set(&["a"]), &never, None).unwrap();
    assert_eq!(plan(&settled, &BTreeSet::new(), &always, None), None);
}

#[test]
fn encoding_round_trips() {
    let mut a = plan(&Assignment::default(), &set(&["pod-0_x1", "pod-1_y2"]), &never, None).unwrap();
    a.slots[5] = Slot::Draining { from: "pod-1_y2".into(), since: 9 };
    a.slots[6] = Slot::Free;
    assert_eq!(Assignment::decode(&a.encode()).unwrap(), a);
    let shard_mode = Assignment { mode: Mode::ShardSelector, ..a.clone() };
    assert_eq!(Assignment::decode(&shard_mode.encode()).unwrap(), shard_mode);
    let weighted = Assignment { objects: Some(Counts::from([(1, 5), (700, 3)])), ..a.clone() };
    assert_eq!(weighted.encode()["objects"], "1:5,700:3");
    assert_eq!(Assignment::decode(&weighted.encode()).unwrap(), weighted);
    assert!(Assignment::decode(&BTreeMap::new()).unwrap_err().contains("generation"));
    let mut bad = a.encode();
    bad.insert("slots".into(), vec!["x"; 1024].join(","));
    assert!(Assignment::decode(&bad).unwrap_err().contains("bad slot"));
    // The format before epochs: bare member indexes, read as epoch 0.
    let legacy = BTreeMap::from([
        ("generation".to_string(), "4".to_string()),
        ("members".to_string(), "pod-0".to_string()),
        ("slots".to_string(), vec!["0"; 1024].join(",")),
    ]);
    let legacy = Assignment::decode(&legacy).unwrap();
    assert_eq!(legacy.slots[0], Slot::Owned { member: "pod-0".into(), epoch: 0 });
    assert_eq!(legacy.mode, Mode::Labels, "written before modes existed");
}

#[test]
fn a_member_of_another_mode_owns_nothing_and_plans_keep_the_mode() {
    let a = plan(&Assignment { mode: Mode::ShardSelector, ..Default::default() }, &set(&["a"]), &never, None).unwrap();
    assert_eq!(a.mode, Mode::ShardSelector);
    assert_eq!(a.owned_by("a", Mode::ShardSelector).len(), usize::from(BUCKETS));
    assert!(a.owned_by("a", Mode::Labels).is_empty(), "its buckets would be other namespaces");
    // A change of mode: every bucket revoked in the old mode, and freed once its owner let go.
    let revoked = vacate(&a, &never).unwrap();
    assert!(revoked.slots.iter().all(|s| matches!(s, Slot::Draining { from, .. } if from == "a")));
    assert!(vacate(&revoked, &never).is_none(), "nothing is freed before its owner lets go");
    let freed = vacate(&revoked, &|_: &str, _: u64| true).unwrap();
    assert!(freed.is_vacant() && freed.generation > revoked.generation);
}

#[test]
fn when_a_revoked_member_may_be_replaced() {
    let ld = Duration::from_secs(15);
    let base = DrainFacts { lease_duration: ld, ..Default::default() };
    let table: &[(&str, DrainFacts, bool)] = &[
        ("nothing known yet", base, false),
        ("acknowledged an older generation", DrainFacts { acked: Some(6), ..base }, false),
        ("acknowledged the revoking generation", DrainFacts { acked: Some(7), ..base }, true),
        ("acknowledged a later one", DrainFacts { acked: Some(9), ..base }, true),
        ("released its lease", DrainFacts { released: true, ..base }, true),
        ("confirmed silent by a quorum read", DrainFacts { confirmed_silent: true, ..base }, true),
        (
            "revoked just under a lease duration ago",
            DrainFacts { revoked_for: ld - Duration::from_millis(1), ..base },
            false,
        ),
        ("revoked a lease duration ago", DrainFacts { revoked_for: ld, ..base }, true),
    ];
    for (case, facts, expected) in table {
        assert_eq!(may_reassign(7, *facts), *expected, "{case}");
    }
}

proptest! {
    /// Over any sequence of views, releases and rebalances, a bucket never goes from one
    /// owner to another without a draining step that the releasing rule allowed to end,
    /// and epochs only grow.
    #[test]
    fn ownership_never_jumps_and_epochs_grow(
        steps in prop::collection::vec((
            prop::collection::btree_set(0usize..5, 0..5),
            any::<bool>(),
            prop::option::of(prop::collection::btree_map(0..BUCKETS, 1u32..5_000, 0..40)),
        ), 1..12)
    ) {
        let names = ["a", "b", "c", "d", "e"];
        let mut current = Assignment::default();
        for (alive_idx, release, rebalanced) in steps {
            let alive: BTreeSet<String> = alive_idx.iter().map(|&i| names[i].to_string()).collect();
            let rule = move |_: &str, _: u64| release;
            if let Some(next) = plan(&current, &alive, &rule, rebalanced) {
                for (before, after) in current.slots.iter().zip(&next.slots) {
                    if let (Slot::Owned { member: x, epoch: e0 }, Slot::Owned { member: y, epoch: e1 }) = (before, after) {
                        prop_assert!(x == y && e0 == e1, "{x} -> {y} without revocation");
                    }
                    if let (Slot::Draining { from, .. }, Slot::Owned { member: y, epoch }) = (before, after) {
                        prop_assert!(from == y || release);
                        prop_assert_eq!(*epoch, next.generation);
                    }
                }
                prop_assert_eq!(next.generation, current.generation + 1);
                current = next;
            }
        }
    }
}

#[test]
fn a_member_gains_what_it_owns_now_and_did_not_before() {
    let owned = |member: &str| Slot::Owned { member: member.into(), epoch: 1 };
    let mut before = Assignment::default();
    before.slots[0] = owned("a");
    before.slots[1] = owned("a");
    before.slots[2] = Slot::Draining { from: "b".into(), since: 1 };
    let mut after = before.clone();
    after.slots[1] = owned("b");
    after.slots[2] = owned("b");
    after.slots[3] = owned("c");
    assert_eq!(after.gained_since(&before), [("b", 1), ("b", 2), ("c", 3)]);
    assert!(before.gained_since(&before).is_empty());
}

#[test]
fn a_leader_that_knows_less_than_its_members_revokes_before_it_grants() {
    let settled = plan(&Assignment::default(), &set(&["a", "b"]), &never, None).unwrap();
    let known = Assignment { generation: 7, ..settled.clone() };
    let revoked_above = |current: &Assignment, generation: u64| {
        current.generation == generation
            && current.slots.iter().all(|s| matches!(s, Slot::Draining { from, .. } if from == UNKNOWN_OWNER))
    };
    // (what the leader knows, whether it writes anew, the reservation, the highest generation seen)
    let lost: [(Option<Assignment>, bool, u64, u64, u64); 5] = [
        (None, true, 0, 7, 8),                      // deleted, no floor
        (None, true, 1007, 7, 1007),                // deleted, a floor above what members saw
        (Some(known.clone()), true, 1007, 9, 1007), // an older copy restored, a floor above
        (Some(known.clone()), false, 0, 9, 10),     // a member saw a newer one, or its token
        (None, true, 5000, 9000, 9001),             // a token above the floor: the floor was lost
    ];
    for (known, republish, reserved, seen, generation) in lost {
        let current = starting_point(known.clone(), republish, reserved, seen, Mode::Labels);
        assert!(revoked_above(&current, generation), "{known:?} {republish} {reserved} {seen}: {current:?}");
    }
    // Nothing lost: what we know stands, raised to the floor when written anew.
    let kept = starting_point(Some(known.clone()), true, 1007, 7, Mode::Labels);
    assert_eq!((kept.generation, &kept.slots), (1007, &known.slots));
    assert_eq!(starting_point(Some(known.clone()), false, 0, 7, Mode::Labels), known);
    let fresh = starting_point(None, true, 1007, 0, Mode::Labels);
    assert!(fresh.generation == 1007 && fresh.slots.iter().all(|s| *s == Slot::Free), "a first install");
}

#[test]
fn a_revocation_after_a_loss_is_published_before_any_grant() {
    let members = set(&["a", "b"]);
    let settled = plan(&Assignment::default(), &members, &never, None).unwrap();
    let known = Assignment { generation: 7, ..settled };
    // The ConfigMap intact, a member reporting a token of generation 9000 (a lost floor).
    let republish = must_republish(false, known.generation, 9000);
    assert!(republish, "what members hold is unknown: the revocation must be written");
    let current = starting_point(Some(known.clone()), republish, 0, 9000, Mode::Labels);
    let wanted = Wanted::of(&current, &members, &Default::default(), None);
    let published = next_assignment(&current, &members, wanted, &never, republish).expect("a revocation to write");
    assert!(published.generation > 9000);
    assert!(
        published.slots.iter().all(|s| matches!(s, Slot::Draining { from, .. } if from == UNKNOWN_OWNER)),
        "granted before the revocation was written: {published:?}"
    );
    assert!(!must_republish(false, 9000, 9000), "nothing lost, nothing written anew");
}

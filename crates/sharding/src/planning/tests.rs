use super::*;
use crate::assignment::plan as plan_by_ring;
use crate::assignment::tests::{always, never, set};
use crate::bucket::BUCKETS;
use crate::hash_ranges::{HashRanges, by_hash};

/// A step of a leader of `mode` from `current`, with `ranges` wanted and nothing else set.
fn step(current: &Assignment, mode: Mode, ranges: &Ranges, release: &dyn Fn(&str, u64) -> bool) -> Plan {
    let receivers = set(&["a_1", "b_1"]);
    plan(Inputs {
        current: current.clone(),
        republish: false,
        mode,
        receivers: &receivers,
        ranges: ranges.clone(),
        census: None,
        capacities: &Capacities::new(),
        rebalanced: None,
        release: &release,
    })
}

fn settled(mode: Mode) -> Assignment {
    let start = Assignment { mode, ..Assignment::default() };
    plan_by_ring(&start, &set(&["a_1", "b_1"]), &never, None).unwrap()
}

fn draining(a: &Assignment) -> usize {
    a.slots.iter().filter(|s| matches!(s, Slot::Draining { .. })).count()
}

fn owned(a: &Assignment) -> usize {
    a.slots.iter().filter(|s| matches!(s, Slot::Owned { .. })).count()
}

fn crowded() -> (BTreeMap<String, u32>, Ranges) {
    let namespaces: BTreeMap<String, u32> = (1..=20).map(|n| (format!("team-{n}"), 100)).collect();
    let split = Ranges::new(HashRanges::uniform().split(&by_hash(&namespaces)));
    (namespaces, split)
}

#[test]
fn a_change_of_mode_revokes_and_frees_every_bucket_before_giving_any() {
    let labels = settled(Mode::Labels);
    let uniform = Ranges::default();
    let Plan::VacateMode { from: Mode::Labels, next: Some(revoked) } =
        step(&labels, Mode::ShardSelector, &uniform, &never)
    else {
        panic!("a leader of the other mode must revoke first")
    };
    assert_eq!((revoked.mode, draining(&revoked)), (Mode::Labels, usize::from(BUCKETS)));
    assert_eq!(
        step(&revoked, Mode::ShardSelector, &uniform, &never),
        Plan::VacateMode { from: Mode::Labels, next: None },
        "nothing moves before the owners let go"
    );
    let Plan::VacateMode { next: Some(freed), .. } = step(&revoked, Mode::ShardSelector, &uniform, &always) else {
        panic!("let go: freed")
    };
    assert!(freed.is_vacant() && freed.mode == Mode::Labels, "freed in the old mode, given in none");
    let Plan::Place { next: Some(given), .. } = step(&freed, Mode::ShardSelector, &uniform, &never) else {
        panic!("vacant: placed in the new mode")
    };
    assert_eq!((given.mode, owned(&given)), (Mode::ShardSelector, usize::from(BUCKETS)));
    assert!(given.generation > freed.generation);
}

#[test]
fn a_change_of_ranges_revokes_the_changed_buckets_then_publishes_the_ranges() {
    let (namespaces, split) = crowded();
    let changed = HashRanges::uniform().changed(&split);
    let before = settled(Mode::ShardSelector);
    let Plan::VacateRanges { buckets, next: Some(revoked) } = step(&before, Mode::ShardSelector, &split, &never) else {
        panic!("changed buckets that are owned are revoked first")
    };
    assert_eq!((buckets, draining(&revoked)), (changed.len(), changed.len()));
    assert!(revoked.ranges.is_uniform(), "the ranges are not published before the buckets are free");
    let Plan::VacateRanges { next: Some(freed), .. } = step(&revoked, Mode::ShardSelector, &split, &always) else {
        panic!("let go: freed")
    };
    let receivers = set(&["a_1", "b_1"]);
    let published = plan(Inputs {
        current: freed.clone(),
        republish: false,
        mode: Mode::ShardSelector,
        receivers: &receivers,
        ranges: split.clone(),
        census: Some(&namespaces),
        capacities: &Capacities::new(),
        rebalanced: None,
        release: &never,
    });
    let Plan::Place { next: Some(next), new_ranges: Some((n, true)), .. } = published else {
        panic!("free: the new ranges are published, got {published:?}")
    };
    assert_eq!((n, next.ranges.clone()), (changed.len(), split));
    assert_eq!(next.objects, Some(next.count(&namespaces)), "placed by the count under the new ranges");
    let given = |b: &u16| matches!(next.slots[usize::from(*b)], Slot::Owned { epoch, .. } if epoch == next.generation);
    assert!(changed.iter().all(given), "and the freed buckets given again, under the new ranges");
}

#[test]
fn a_leader_of_labels_mode_wants_no_split_ranges_left_from_the_shard_selector() {
    let (_, split) = crowded();
    let vacant = Assignment { generation: 9, mode: Mode::ShardSelector, ranges: split, ..Assignment::default() };
    let Plan::Place { next: Some(next), new_ranges: None, .. } =
        step(&vacant, Mode::Labels, &Ranges::default(), &never)
    else {
        panic!("a vacant assignment of the other mode is placed in this one")
    };
    assert!(next.mode == Mode::Labels && next.ranges.is_uniform());
}

#[test]
fn with_capacities_nothing_is_planned_before_a_count() {
    let receivers = set(&["a_1", "b_1"]);
    let capacities = Capacities::from([("a_1".to_string(), 10)]);
    let never = &never;
    let inputs = |census| Inputs {
        current: Assignment::default(),
        republish: false,
        mode: Mode::Labels,
        receivers: &receivers,
        ranges: Ranges::default(),
        census,
        capacities: &capacities,
        rebalanced: None,
        release: never,
    };
    assert_eq!(plan(inputs(None)), Plan::Uncounted);
    let (namespaces, _) = crowded();
    assert!(matches!(plan(inputs(Some(&namespaces))), Plan::Place { next: Some(_), .. }));
}

#[test]
fn a_republished_assignment_is_written_under_a_new_generation_even_when_nothing_moves() {
    let known = settled(Mode::Labels);
    let receivers = set(&["a_1", "b_1"]);
    let (never, capacities) = (&never, Capacities::new());
    let inputs = |republish| Inputs {
        current: known.clone(),
        republish,
        mode: Mode::Labels,
        receivers: &receivers,
        ranges: Ranges::default(),
        census: None,
        capacities: &capacities,
        rebalanced: None,
        release: never,
    };
    let Plan::Place { next: None, unowned: 0, unplaced_buckets: 0, .. } = plan(inputs(false)) else {
        panic!("settled: nothing to publish")
    };
    let Some(again) = plan(inputs(true)).into_next() else { panic!("republished") };
    assert_eq!((again.generation, &again.slots), (known.generation + 1, &known.slots));
}

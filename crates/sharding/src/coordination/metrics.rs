//! The protocol's metrics, under the runtime's metric prefix (`sharded_runtime::metrics::set_prefix`):
//! `<prefix>_lease_held`, `<prefix>_buckets_owned` and so on, and client-go's
//! `leader_election_master_status`. Labels are bounded: a result, a direction, a mode.

use std::sync::LazyLock;
use std::time::Duration;

use metrics::{counter, describe_counter, describe_gauge, gauge};

/// The metric names, made once, from the prefix in force at the first use.
struct MetricNames {
    lease_held: &'static str,
    lease_renewals: &'static str,
    slice_imbalance: &'static str,
    members_alive: &'static str,
    members_idle: &'static str,
    working: &'static str,
    shard_mode: &'static str,
    buckets_owned: &'static str,
    handoffs: &'static str,
    unowned_buckets: &'static str,
    unowned_milliseconds: &'static str,
    bucket_label_errors: &'static str,
    namespace_labels: &'static str,
    capacity: &'static str,
    unplaced_objects: &'static str,
    unplaced_buckets: &'static str,
    install_blocked: &'static str,
}

static NAMES: LazyLock<MetricNames> = LazyLock::new(|| {
    let prefix = sharded_runtime::metrics::prefix();
    let name = |suffix: &str| -> &'static str { Box::leak(format!("{prefix}_{suffix}").into_boxed_str()) };
    MetricNames {
        lease_held: name("lease_held"),
        lease_renewals: name("lease_renewals_total"),
        slice_imbalance: name("slice_imbalance"),
        members_alive: name("members_alive"),
        members_idle: name("members_idle"),
        working: name("working"),
        shard_mode: name("shard_mode"),
        buckets_owned: name("buckets_owned"),
        handoffs: name("bucket_handoffs_total"),
        unowned_buckets: name("unowned_buckets"),
        unowned_milliseconds: name("unowned_milliseconds_total"),
        bucket_label_errors: name("bucket_label_errors_total"),
        namespace_labels: name("namespace_labels_total"),
        capacity: name("capacity_objects"),
        unplaced_objects: name("unplaced_objects"),
        unplaced_buckets: name("unplaced_buckets"),
        install_blocked: name("install_blocked"),
    }
});

/// Describes every metric of the protocol to the installed recorder.
pub fn describe() {
    let n = &*NAMES;
    describe_gauge!(n.shard_mode, "1 for the sharding mode in use: labels or shard-selector.");
    describe_counter!(n.bucket_label_errors, "Failed bucket labellings (retried).");
    describe_gauge!(n.lease_held, "1 while a renewal cycle has confirmed this replica's right to write.");
    describe_counter!(
        n.lease_renewals,
        "Attempts to renew the member Lease, by result (renewed, held_by_other, failed)."
    );
    describe_gauge!("leader_election_master_status", "1 while this replica is the leader.");
    describe_gauge!(n.members_alive, "Replicas this replica sees alive, from observed lease renewals.");
    describe_gauge!(
        n.members_idle,
        "Replicas that renew their Lease but get no buckets: another sharding mode, refused watches (leader)."
    );
    describe_gauge!(
        n.working,
        "1 while this replica can do its work (watches not refused, renewal cycles complete); 0 gives its slice up."
    );
    describe_gauge!(n.buckets_owned, "Namespace buckets this replica owns.");
    describe_counter!(n.handoffs, "Buckets acquired or released by this replica.");
    describe_gauge!(
        n.unowned_buckets,
        "Buckets no live replica owns, other than those no replica has room for (reported by the leader)."
    );
    describe_gauge!(n.capacity, "Objects this replica can hold, as advertised on its Lease (absent: no bound).");
    describe_gauge!(
        n.unplaced_objects,
        "Objects in buckets that no replica has room for: nobody reconciles them (reported by the leader)."
    );
    describe_gauge!(n.unplaced_buckets, "Buckets that no replica has room for (reported by the leader).");
    describe_gauge!(
        n.install_blocked,
        "1 while another live install watches namespaces this one would: this replica does nothing."
    );
    describe_gauge!(
        n.slice_imbalance,
        "The largest replica's objects over the mean, from the replicas' reports (reported by the leader)."
    );
    describe_counter!(n.unowned_milliseconds, "Milliseconds during which some bucket had no live owner (leader).");
    describe_counter!(
        n.namespace_labels,
        "Namespaces the leader labelled with their bucket, for the bucket-label admission policy."
    );
}

fn flag(on: bool) -> f64 {
    if on { 1.0 } else { 0.0 }
}

/// Whether another live install holds the install record (see `coordination::install`).
pub fn set_install_blocked(blocked: bool) {
    gauge!(NAMES.install_blocked).set(flag(blocked));
}

/// Whether a renewal cycle has confirmed this replica's right to write.
pub fn set_lease_held(held: bool) {
    gauge!(NAMES.lease_held).set(flag(held));
}

/// One attempt to renew the member Lease: `renewed`, `held_by_other` or `failed`.
pub fn count_lease_renewal(result: &'static str) {
    counter!(NAMES.lease_renewals, "result" => result).increment(1);
}

/// client-go's leader metric, labelled with the program's name.
pub fn set_leader(program: &'static str, leading: bool) {
    gauge!("leader_election_master_status", "name" => program).set(flag(leading));
}

/// The largest replica's objects over the mean (leader).
pub fn set_slice_imbalance(ratio: f64) {
    gauge!(NAMES.slice_imbalance).set(ratio);
}

/// Replicas seen renewing.
pub fn set_members_alive(count: usize) {
    gauge!(NAMES.members_alive).set(count as f64);
}

/// Renewing replicas given no buckets (leader).
pub fn set_members_idle(count: usize) {
    gauge!(NAMES.members_idle).set(count as f64);
}

/// Whether this replica can do its work.
pub fn set_working(working: bool) {
    gauge!(NAMES.working).set(flag(working));
}

/// 1 for the sharding mode in use (`labels` or `shard-selector`).
pub fn set_shard_mode(mode: &'static str) {
    gauge!(NAMES.shard_mode, "mode" => mode).set(1.0);
}

/// Buckets this replica owns.
pub fn set_buckets_owned(count: usize) {
    gauge!(NAMES.buckets_owned).set(count as f64);
}

/// Buckets this replica released and acquired.
pub fn count_handoffs(released: usize, acquired: usize) {
    counter!(NAMES.handoffs, "direction" => "released").increment(released as u64);
    counter!(NAMES.handoffs, "direction" => "acquired").increment(acquired as u64);
}

/// Reported by the leader; `elapsed` is added to the unowned time when `unowned > 0`.
pub fn record_unowned(unowned: usize, elapsed: Duration) {
    gauge!(NAMES.unowned_buckets).set(unowned as f64);
    if unowned > 0 {
        counter!(NAMES.unowned_milliseconds).increment(elapsed.as_millis() as u64);
    }
}

/// The objects this replica can hold.
pub fn set_capacity(objects: u64) {
    gauge!(NAMES.capacity).set(objects as f64);
}

/// What no replica has room for (leader).
pub fn set_unplaced(buckets: usize, objects: u64) {
    gauge!(NAMES.unplaced_buckets).set(buckets as f64);
    gauge!(NAMES.unplaced_objects).set(objects as f64);
}

/// Labelling an object (retried) or a namespace with its bucket failed.
pub fn count_bucket_label_error() {
    counter!(NAMES.bucket_label_errors).increment(1);
}

/// The leader labelled a namespace with its bucket (for the bucket-label admission policy).
pub fn count_namespace_label() {
    counter!(NAMES.namespace_labels).increment(1);
}

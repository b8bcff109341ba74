//! What the sharding layer adds to each reconcile with one replica: the ownership checks
//! (one at the start, one before each of the four writes), timed in a tight loop. The
//! other per-replica costs are fixed, not per object: one Lease renewal (a GET and a
//! PATCH) per retry period, and, owning every bucket, the selector `trafficpolicy.dev/bucket`.

use std::time::{Duration, Instant};

use traffic_policy_operator::coordination::ownership::Ownership;
use traffic_policy_operator::sharding::assignment::{Assignment, Slot};
use traffic_policy_operator::sharding::bucket::{BUCKETS, Mode};

#[derive(clap::Args)]
pub struct Args {
    /// Reconciles to simulate.
    #[arg(long, default_value_t = 2_000_000)]
    iterations: u32,
}

pub async fn run(args: Args) -> anyhow::Result<()> {
    let ownership = Ownership::new("me_1", Mode::Labels, Duration::from_secs(10), Duration::from_secs(5));
    let slots = vec![Slot::Owned { member: "me_1".into(), epoch: 1 }; BUCKETS.into()];
    let all = Assignment { generation: 1, slots, ..Default::default() };
    ownership.confirm(tokio::time::Instant::now(), &all);
    let started = Instant::now();
    for i in 0..args.iterations {
        let turn = ownership.begin((i % u32::from(BUCKETS)) as u16).expect("owned");
        for _ in 0..4 {
            std::hint::black_box(turn.permit());
        }
    }
    let per_reconcile = started.elapsed() / args.iterations;
    println!("ownership checks per reconcile (begin + 4 write checks): {per_reconcile:?}");
    Ok(())
}

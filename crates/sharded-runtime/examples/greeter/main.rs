//! A second controller on the runtime, sharded by the `sharding` crate: for each `Greeting`
//! (`example.com/v1`), a ConfigMap `<name>-greeting` that says hello to `spec.name`.
//!
//! Run one process per member. Each reconciles only the namespaces whose buckets the ring
//! gives it among the members, and its watches ask the API server for those namespaces
//! only (a shard selector; a server without them sends everything, and the runtime drops
//! what is not the member's). The members are fixed here, so no bucket ever moves and the
//! gate is [`Unguarded`]. The sharding crate's example, `leased_greeter`, runs the same
//! greeter with Leases, handoffs and fencing tokens.
//!
//! ```sh
//! cargo run -q -p sharded-runtime --example greeter -- crd | kubectl apply -f -
//! cargo run -p sharded-runtime --example greeter -- run a a,b &   # member a of a and b
//! cargo run -p sharded-runtime --example greeter -- run b a,b &
//! ```

mod greeting;

use std::time::Duration;

use kube::{Client, CustomResourceExt};
use sharded_runtime::health::Health;
use sharded_runtime::parts::{Buckets, SliceSelector, Slicing};
use sharded_runtime::reconciler::Unguarded;
use sharded_runtime::watch_health::WatchHealth;
use sharding::bucket::{Bucket, Mode};
use sharding::{hash_ranges::HashRanges, ring::Ring, shard_range};
use tokio_util::sync::CancellationToken;

pub use greeting::{Greeting, GreetingSpec, MEMBER_ANNOTATION};

/// The buckets `member` owns among `members`: the same on every member.
pub fn slice_of(member: &str, members: &[&str]) -> Buckets {
    let ring = Ring::new(members);
    let owners = ring.assign_names();
    (0..).zip(owners).filter(|(_, owner)| *owner == Some(member)).map(|(bucket, _)| bucket).collect()
}

/// A namespace's bucket, as the API server's shard selector hashes it.
pub fn bucket_of(namespace: &str) -> Bucket {
    Mode::ShardSelector.bucket_of(namespace)
}

/// Runs `member`'s controller until `shutdown`; returns whether it drained.
pub async fn run(client: Client, member: &str, members: &[&str], shutdown: CancellationToken) -> bool {
    let (_keep_slice, slice) = tokio::sync::watch::channel(Some(slice_of(member, members)));
    let slicing = Slicing::new(
        |meta| Some(bucket_of(meta.namespace.as_deref().unwrap_or_default())),
        bucket_of,
        |buckets| shard_range::selector(&HashRanges::uniform(), buckets).map(SliceSelector::Shards),
    );
    let member = greeting::Member {
        name: member.to_string(),
        slice,
        slicing,
        health: Health::with_gates(&[]),
        watch_health: WatchHealth::new(),
        gatekeeper: std::sync::Arc::new(Unguarded { write_bound: Duration::from_secs(10) }),
    };
    greeting::run_controller(client, member, shutdown).await
}

#[cfg_attr(test, allow(dead_code))]
#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args.iter().map(String::as_str).collect::<Vec<_>>().as_slice() {
        ["crd"] => println!("{}", serde_json::to_string_pretty(&Greeting::crd())?),
        ["run", member, members] => {
            let members: Vec<&str> = members.split(',').collect();
            anyhow::ensure!(members.contains(member), "{member} is not one of the members {members:?}");
            let shutdown = CancellationToken::new();
            let stop = shutdown.clone();
            tokio::spawn(async move {
                let _ = tokio::signal::ctrl_c().await;
                stop.cancel();
            });
            run(Client::try_default().await?, member, &members, shutdown).await;
        }
        _ => anyhow::bail!("usage: greeter crd | greeter run MEMBER MEMBER,MEMBER,..."),
    }
    Ok(())
}

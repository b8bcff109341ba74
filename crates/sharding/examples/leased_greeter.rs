//! The runtime's example controller, the greeter (`crates/sharded-runtime/examples/greeter/`),
//! sharded by this crate's protocol: each member renews a Lease, one of them leads and
//! publishes which buckets of namespaces each member owns, a member that stops hands its
//! buckets over, and every ConfigMap it writes carries its bucket's fencing token.
//!
//! Members here ask for the shard selector (kube-apiserver's `ShardedListAndWatch` feature
//! gate): in label mode, the program must label its objects with their bucket, as
//! traffic-policy-operator's leader does (`LeaderDuties`).
//!
//! ```sh
//! kubectl create namespace greeters
//! cargo run -q -p sharded-runtime --example greeter -- crd | kubectl apply -f -
//! cargo run -p sharding --example leased_greeter -- a greeters &   # member a
//! cargo run -p sharding --example leased_greeter -- b greeters &   # member b
//! ```

#[path = "../../sharded-runtime/examples/greeter/greeting.rs"]
mod greeting;

use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use kube::Client;
use sharded_runtime::health::Health;
use sharding::balance::Balance;
use sharding::coordination::audit::Audit;
use sharding::coordination::leader::NoDuties;
use sharding::coordination::mode::Requested;
use sharding::coordination::sharded::{self, Sharded};
use sharding::coordination::tasks::Start;
use sharding::coordination::{Coordination, Names, ShardConfig};
use sharding::membership::incarnation;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

pub use greeting::{Greeting, GreetingSpec, MEMBER_ANNOTATION};

/// `greeter-member-<name>` Leases, the `greeter-assignment` ConfigMap, `example.com/…`
/// labels and annotations.
pub const NAMES: Names = sharding::names!("greeter", "example.com");

/// Runs member `name`, with its coordination objects in `namespace`, until `shutdown`; then
/// hands its buckets over. Returns whether it drained.
pub async fn run(client: Client, name: &str, namespace: &str, shutdown: CancellationToken) -> anyhow::Result<bool> {
    let nonce = SystemTime::now().duration_since(UNIX_EPOCH)?.subsec_nanos();
    let config = ShardConfig {
        identity: name.into(),
        incarnation: incarnation(name, &format!("{nonce:08x}")),
        namespace: namespace.into(),
        lease_duration: Duration::from_secs(15),
        renew_deadline: Duration::from_secs(10),
        retry_period: Duration::from_secs(2),
        drain_timeout: Duration::from_secs(10),
        balance: Balance::default(),
        floor_object: "greetings.example.com".into(),
        names: NAMES,
        version: env!("CARGO_PKG_VERSION").into(),
        capacity: None,
        split_ranges: false,
        watch_namespace: None,
    };
    let (health, audit) = (Health::with_gates(&["members", "assignment"]), Audit::default());
    let mut critical = JoinSet::new();
    let start = Start {
        config: &config,
        client: &client,
        mode: Requested::ShardSelector,
        health: &health,
        audit: &audit,
        duties: Arc::new(NoDuties),
        follower_wrapper: None,
    };
    let mut coordination = Coordination::start(start, &mut critical).await?;
    let slicing = sharded::slicing(&coordination.ownership, NAMES.bucket_label);
    let member = greeting::Member {
        name: name.into(),
        slice: coordination.slice.clone(),
        slicing,
        health,
        watch_health: coordination.watch_health.clone(),
        gatekeeper: Arc::new(Sharded::new(coordination.ownership.clone(), NAMES, audit.clone())),
    };
    let controller = greeting::run_controller(client, member, shutdown.clone());
    let mut controller = std::pin::pin!(controller);
    // A protocol task that ends first is a failure: stop, and hand over what can be.
    let drained = tokio::select! {
        drained = &mut controller => drained,
        ended = coordination.task_ended() => {
            tracing::error!(%ended, "stopping");
            shutdown.cancel();
            controller.await
        }
    };
    coordination.shut_down(drained, config.landing_bound(), &audit).await;
    Ok(drained)
}

#[cfg_attr(test, allow(dead_code))]
#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [name, namespace] = args.as_slice() else { anyhow::bail!("usage: leased_greeter MEMBER NAMESPACE") };
    let shutdown = CancellationToken::new();
    let stop = shutdown.clone();
    tokio::spawn(async move {
        let _ = tokio::signal::ctrl_c().await;
        stop.cancel();
    });
    run(Client::try_default().await?, name, namespace, shutdown).await?;
    Ok(())
}

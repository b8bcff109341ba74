//! Which sharding mode this process uses, chosen once at start-up: the API server's shard
//! selector where it honours one (kube-apiserver with the `ShardedListAndWatch` feature
//! gate), bucket labels otherwise. The choice is logged, exported as `<prefix>_shard_mode`,
//! and written into the assignment by the leader.

use std::time::Duration;

use k8s_openapi::api::core::v1::ConfigMap;
use kube::Client;
use kube::api::{Api, ListParams};

use super::metrics;
use crate::bucket::{BUCKETS, Mode};
use crate::hash_ranges::HashRanges;
use crate::shard_range;
use sharded_runtime::backoff::Backoff;

/// The mode a program asks for (the operator's `--shard-mode`; a command-line value with the
/// `clap` feature).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[cfg_attr(feature = "clap", derive(clap::ValueEnum))]
pub enum Requested {
    /// The shard selector if the API server honours it, else labels.
    #[default]
    Auto,
    /// Bucket labels, whatever the server offers.
    Labels,
    /// The shard selector; start-up fails if the server does not honour it.
    ShardSelector,
}

/// The mode to run in, as `requested` and as the API server allows (asking it with a list in
/// `namespace`).
pub async fn choose(client: &Client, namespace: &str, requested: Requested) -> anyhow::Result<Mode> {
    let mode = match requested {
        Requested::Labels => Mode::Labels,
        Requested::Auto => probe_until_answered(client, namespace).await,
        Requested::ShardSelector => match server_honours_shard_selector(client, namespace).await? {
            true => Mode::ShardSelector,
            false => anyhow::bail!(
                "--shard-mode=shard-selector: the API server ignores shardSelector (no metadata.shardInfo in a \
                 list response); enable kube-apiserver's ShardedListAndWatch feature gate, or use --shard-mode=auto"
            ),
        },
    };
    tracing::info!(mode = mode.as_str(), ?requested, "sharding mode chosen");
    metrics::set_shard_mode(mode.as_str());
    Ok(mode)
}

/// Asks until the API server answers: a replica that fell back to labels on a failed probe
/// would compute buckets unlike the rest of the fleet (and own nothing under its assignment).
/// Not Ready meanwhile, since nothing else starts before the mode is known.
async fn probe_until_answered(client: &Client, namespace: &str) -> Mode {
    let backoff = Backoff::new(Duration::from_millis(500), Duration::from_secs(30));
    let mut failures = 0;
    loop {
        match server_honours_shard_selector(client, namespace).await {
            Ok(true) => return Mode::ShardSelector,
            Ok(false) => return Mode::Labels,
            Err(error) => {
                failures += 1;
                let retry = backoff.delay(failures);
                tracing::warn!(%error, ?retry, "cannot tell whether the API server honours shard selectors; asking again");
                tokio::time::sleep(retry).await;
            }
        }
    }
}

/// Lists one ConfigMap of our namespace with a shard selector: a server that honoured it
/// says so in `metadata.shardInfo`. (ConfigMaps, because kube-apiserver 1.36 filters custom
/// resources by the selector but does not report `shardInfo` for them; the gate is
/// server-wide.)
async fn server_honours_shard_selector(client: &Client, namespace: &str) -> anyhow::Result<bool> {
    let everything = shard_range::selector(&HashRanges::uniform(), &(0..BUCKETS).collect()).expect("all buckets");
    let client = sharded_runtime::client::with_query(client.clone(), "shardSelector", &everything);
    let list = Api::<ConfigMap>::namespaced(client, namespace).list(&ListParams::default().limit(1)).await?;
    Ok(list.metadata.shard_info.is_some())
}

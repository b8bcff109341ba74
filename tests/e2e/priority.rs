//! Real changes go before backlog: policies of the initial list (as after a preload) wait in
//! the low lane, and an edit of one of them jumps ahead. In label mode, those the leader
//! labels from its backlog are marked so, and wait there too.

use futures::future::join_all;
use kube::ResourceExt;
use kube::api::{ListParams, Patch, PatchParams, PostParams};
use serde_json::json;
use traffic_policy_operator::api::ApplicationTrafficPolicy;
use traffic_policy_operator::coordination::{BACKLOG_ANNOTATION, BUCKET_LABEL};
use traffic_policy_operator::sharding::bucket::Mode;

use crate::lifecycle::policy;
use crate::support::{TestEnv, eventually, expected_mode};

const BACKLOG: usize = 300;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_edit_goes_before_a_preloaded_backlog() {
    let env = TestEnv::new("e2e-priority").await;
    let policies = env.api::<ApplicationTrafficPolicy>();
    // A preload: unlabelled policies that exist before the operator starts (so before its
    // leader labels the namespace, which would have the API server label them as created).
    let created = join_all((0..BACKLOG).map(|i| {
        let policies = policies.clone();
        async move { policies.create(&PostParams::default(), &policy(&format!("app-{i:03}"), 8000)).await }
    }))
    .await;
    assert!(created.iter().all(Result::is_ok), "creating the backlog failed");
    // One worker, so that the backlog takes a while.
    let _operator = env.start_operator(&["--workers=1"]).await;

    let last = format!("app-{:03}", BACKLOG - 1);
    match expected_mode() {
        // The last policy of the list is labelled last, from the backlog, and marked so.
        Mode::Labels => {
            let labelled = eventually("the last policy of the backlog is labelled", || async {
                let p = policies.get_opt(&last).await.ok()??;
                p.labels().contains_key(BUCKET_LABEL).then_some(p)
            })
            .await;
            assert_eq!(labelled.annotations().get(BACKLOG_ANNOTATION).map(String::as_str), Some("true"));
        }
        // The shard-selected watch needs no label (checked at the end).
        Mode::ShardSelector => {}
    }
    let edited = policies
        .patch(
            &last,
            &PatchParams::default(),
            &Patch::Merge(json!({ "spec": { "rateLimit": { "requestsPerSecond": 7 } } })),
        )
        .await
        .unwrap();
    let generation = edited.metadata.generation;

    // The edit is served while most of the backlog still waits.
    let ready_when_served = eventually("the edit is Ready", || async {
        let list = policies.list(&ListParams::default()).await.ok()?;
        let target = list.items.iter().find(|p| p.name_any() == last)?;
        (target.is_ready() && target.metadata.generation == generation)
            .then(|| list.items.iter().filter(|p| p.is_ready()).count())
    })
    .await;
    println!("the edit was served when {ready_when_served} of {BACKLOG} policies were Ready");
    assert!(
        ready_when_served < BACKLOG / 2,
        "the edit waited behind the backlog: {ready_when_served} of {BACKLOG} were Ready first"
    );
    if expected_mode() == Mode::ShardSelector {
        let labelled = policies.list(&ListParams::default()).await.unwrap().items.into_iter();
        let labelled: Vec<String> =
            labelled.filter(|p| p.labels().contains_key(BUCKET_LABEL)).map(|p| p.name_any()).collect();
        assert!(labelled.is_empty(), "policies were labelled although the server selects by namespace: {labelled:?}");
    }
}

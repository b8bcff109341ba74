//! Label mode's bucket labels are set by the API server at admission: the leader labels each
//! namespace once, and the bucket-label component's MutatingAdmissionPolicy copies that label
//! onto every policy written there, so the leader patches no policy and a new policy is in its
//! owner's watch from its first write.

use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Namespace;
use kube::ResourceExt;
use kube::api::{Api, Patch, PatchParams, PostParams};
use serde_json::json;
use traffic_policy_operator::api::{ApplicationTrafficPolicy, ConditionStatus};
use traffic_policy_operator::coordination::BUCKET_LABEL;
use traffic_policy_operator::runtime::backoff::Backoff;
use traffic_policy_operator::sharding::bucket::{BUCKETS, bucket_of, label_value};

use crate::lifecycle::policy;
use crate::support::{TestEnv, eventually};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_policy_carries_its_bucket_label_from_its_first_write() {
    if !controlplane::ControlPlane::shared().release().has_mutating_admission_policy() {
        // The harness leaves the component out on such a server, so every suite there runs
        // label mode as the default install does: the leader labels each policy itself.
        println!("skipped: this kube-apiserver has no MutatingAdmissionPolicy v1 (1.36+)");
        return;
    }
    let env = TestEnv::new("e2e-bucket-labels").await;
    // A namespace outside the operator's --watch-namespace, which it must leave alone.
    let sibling = TestEnv::new("e2e-bucket-labels-sibling").await;
    // Label mode, whatever the shared control plane offers.
    let operator = env.start_operator(&["--shard-mode=labels"]).await;
    let bucket = label_value(bucket_of(&env.namespace));
    let policies = env.api::<ApplicationTrafficPolicy>();

    // Admission reads namespaces from the API server's cache, so wait on what admission does:
    // a dry-run create whose answer carries the label.
    let dry_run = PostParams { dry_run: true, ..Default::default() };
    eventually("the API server labels a new policy with its namespace's bucket", || async {
        let answer = policies.create(&dry_run, &policy("web", 80)).await.ok()?;
        (answer.labels().get(BUCKET_LABEL) == Some(&bucket)).then_some(())
    })
    .await;
    let namespaces = Api::<Namespace>::all(env.client.clone());
    let sibling_labels = namespaces.get(&sibling.namespace).await.unwrap().labels().clone();
    assert!(!sibling_labels.contains_key(BUCKET_LABEL), "a namespace it does not watch was labelled");

    // The API server's answer to the create carries the label: set at admission, not patched
    // on afterwards.
    let created = policies.create(&PostParams::default(), &policy("web", 80)).await.unwrap();
    assert_eq!(created.labels().get(BUCKET_LABEL), Some(&bucket), "labels at creation: {:?}", created.labels());
    env.wait_ready("web", ConditionStatus::True).await;

    // A label changed or removed by hand is put back by the same write.
    let other = label_value((bucket_of(&env.namespace) + 1) % BUCKETS);
    for label in [json!(other), json!(null)] {
        let patch = json!({ "metadata": { "labels": { BUCKET_LABEL: label } } });
        let edited = policies.patch("web", &PatchParams::default(), &Patch::Merge(&patch)).await.unwrap();
        assert_eq!(edited.labels().get(BUCKET_LABEL), Some(&bucket), "after setting {label}: {:?}", edited.labels());
    }

    // The namespace's label removed by hand: the leader puts it back.
    let unlabel = json!({ "metadata": { "labels": { BUCKET_LABEL: null } } });
    namespaces.patch(&env.namespace, &PatchParams::default(), &Patch::Merge(&unlabel)).await.unwrap();
    eventually("the leader labels the namespace again", || async {
        let labelled = namespaces.get(&env.namespace).await.ok()?.labels().get(BUCKET_LABEL) == Some(&bucket);
        (labelled && operator.metric("traffic_policy_namespace_labels_total", None) >= 2.0).then_some(())
    })
    .await;

    // A controller that removes the label as soon as it is back: the leader puts it back after
    // a growing backoff, not in a hot loop, so the removals take at least the backoff's delays.
    const REMOVALS: u32 = 9;
    let labels_before = operator.metric("traffic_policy_namespace_labels_total", None);
    let started = Instant::now();
    let mut removed = 0;
    let mut last_removal = started;
    while removed < REMOVALS {
        assert!(started.elapsed() < Duration::from_secs(60), "the label came back only {removed} times in 60 s");
        let labels = namespaces.get(&env.namespace).await.unwrap().labels().clone();
        if labels.get(BUCKET_LABEL) == Some(&bucket) {
            namespaces.patch(&env.namespace, &PatchParams::default(), &Patch::Merge(&unlabel)).await.unwrap();
            removed += 1;
            last_removal = Instant::now();
        } else {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
    let patches = eventually("the leader labels the namespace after the last removal", || async {
        let labels = namespaces.get(&env.namespace).await.ok()?.labels().clone();
        let patches = operator.metric("traffic_policy_namespace_labels_total", None) - labels_before;
        (labels.get(BUCKET_LABEL) == Some(&bucket) && patches >= f64::from(REMOVALS)).then_some(patches)
    })
    .await;
    let (took, last_took) = (started.elapsed(), last_removal.elapsed());
    let backoff = Backoff::default();
    let least: Duration = (1..=REMOVALS).map(|n| backoff.delay(n)).sum();
    assert!(took >= least, "{REMOVALS} removals answered in {took:?}, less than the backoff's {least:?}");
    let last_least = backoff.delay(REMOVALS);
    assert!(last_took >= last_least, "the last removal answered in {last_took:?}, before its backoff's {last_least:?}");
    // A patch per removal, and at most one more each: a retry for an event seen while a patch
    // was on its way re-patches whatever that event showed.
    assert!(patches <= f64::from(2 * REMOVALS), "{patches} patches answered {REMOVALS} removals");

    let policy_labels = operator.metric("traffic_policy_bucket_labels_total", None);
    assert_eq!(policy_labels, 0.0, "the leader patched {policy_labels} policies with their label");
}

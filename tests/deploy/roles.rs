//! The built-in view and edit roles, with the operator's aggregated ClusterRoles folded in.

use std::time::Duration;

use kube::api::Api;

use crate::common::eventually_within;
use crate::kubectl;

/// Tenants bound to the built-in `edit` role may write policies, those bound to `view` may
/// read them, and neither may write the status that the operator reports.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_built_in_view_and_edit_roles_cover_policies() {
    use k8s_openapi::api::authorization::v1::{ResourceAttributes, SubjectAccessReview, SubjectAccessReviewSpec};
    let env = crate::common::TestEnv::new("deploy-tenant-roles").await;
    let (ok, _, err) = kubectl(env.cp, &["apply", "-f", "deploy/base/aggregated-clusterroles.yaml"]);
    assert!(ok, "{err}");
    for (user, role) in [("alice", "edit"), ("bob", "view")] {
        let (ok, _, err) = kubectl(
            env.cp,
            &[
                "create",
                "rolebinding",
                user,
                "-n",
                &env.namespace,
                &format!("--clusterrole={role}"),
                &format!("--user={user}"),
            ],
        );
        assert!(ok, "{err}");
    }
    let reviews = Api::<SubjectAccessReview>::all(env.client.clone());
    let allowed = |user: &str, verb: &str, subresource: Option<&str>| {
        let review = SubjectAccessReview {
            spec: SubjectAccessReviewSpec {
                user: Some(user.into()),
                resource_attributes: Some(ResourceAttributes {
                    group: Some("trafficpolicy.dev".into()),
                    resource: Some("applicationtrafficpolicies".into()),
                    subresource: subresource.map(Into::into),
                    namespace: Some(env.namespace.clone()),
                    verb: Some(verb.into()),
                    ..Default::default()
                }),
                ..Default::default()
            },
            ..Default::default()
        };
        let reviews = reviews.clone();
        async move { reviews.create(&Default::default(), &review).await.unwrap().status.unwrap().allowed }
    };
    // The aggregation controller folds the roles into view and edit shortly after they exist.
    eventually_within(Duration::from_secs(60), "edit and view include the policies", || async {
        (allowed("alice", "create", None).await && allowed("bob", "list", None).await).then_some(())
    })
    .await;
    assert!(allowed("alice", "delete", None).await, "edit may delete policies");
    assert!(!allowed("alice", "patch", Some("status")).await, "edit may not write the operator's status");
    assert!(allowed("bob", "get", Some("status")).await, "view may read the status");
    assert!(!allowed("bob", "create", None).await, "view may not create policies");
}

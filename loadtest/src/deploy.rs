//! Objects from the repository's deploy/ directory, installed as deploy/ would install them.

use std::path::Path;
use std::time::Duration;

use controlplane::manifests;
use kube::Client;
use kube::api::DynamicObject;

pub use controlplane::manifests::api_for;

/// The objects of a YAML file under deploy/.
pub fn objects(file: &str) -> anyhow::Result<Vec<DynamicObject>> {
    manifests::read(&Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy").join(file))
}

/// Server-side applies cluster-scoped objects of any kind.
pub async fn apply(client: &Client, objects: &[DynamicObject]) -> anyhow::Result<()> {
    manifests::apply(client, objects, "loadtest").await
}

/// Installs the bucket-label component's admission policy, and waits until the API server
/// admits policies under it.
pub async fn install_bucket_labels(client: &Client, namespace: &str) -> anyhow::Result<()> {
    apply(client, &objects("components/bucket-labels/bucket-labels.yaml")?).await?;
    manifests::wait_policies_admitted(client, namespace, Duration::from_secs(60)).await
}

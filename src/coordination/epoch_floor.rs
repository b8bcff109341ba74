//! The floor under every assignment generation, kept where it outlives the operator's own
//! namespace: an annotation on the CustomResourceDefinition of the objects we shard.
//!
//! Generations are fencing epochs, stamped on the policies and their children. Those live
//! exactly as long as the CRD, while the assignment and the Leases live in the operator's
//! namespace, which a reinstall, a namespace move or a restore may lose or roll back. A
//! leader therefore reserves generations on the CRD in blocks before it publishes one of
//! them, and an assignment published anew starts above the reservation: above every token
//! any install of the operator can have written. One write per [`BLOCK`] generations.

use std::sync::Mutex;

use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{Api, Patch, PatchParams};
use kube::{Client, ResourceExt};

/// On the CRD: the highest generation any leader may have published.
pub const FLOOR_ANNOTATION: &str = "trafficpolicy.dev/reserved-generation";
/// How many generations one write of the reservation covers.
pub const BLOCK: u64 = 1000;

#[derive(Debug, thiserror::Error)]
pub enum FloorError {
    #[error(
        "reading or raising the generation floor on CustomResourceDefinition {object} failed (the operator needs get and \
         patch on it, see deploy/base/clusterrole.yaml): {source}"
    )]
    Api { object: String, source: Box<kube::Error> },
    #[error("the generation floor on CustomResourceDefinition {0} is not a number")]
    Malformed(String),
}

pub struct EpochFloor {
    crds: Api<CustomResourceDefinition>,
    object: String,
    /// The reservation as last read or written; `None` until first read.
    reserved: Mutex<Option<u64>>,
}

impl EpochFloor {
    /// The floor kept on CRD `object`.
    pub fn new(client: Client, object: &str) -> Self {
        Self { crds: Api::all(client), object: object.to_string(), reserved: Mutex::new(None) }
    }

    /// The highest generation reserved so far, by any install.
    pub async fn reserved(&self) -> Result<u64, FloorError> {
        if let Some(reserved) = *self.lock() {
            return Ok(reserved);
        }
        self.read().await
    }

    /// Reserves every generation up to `generation`; writes only when it is above the
    /// reservation, and then a block ahead.
    pub async fn reserve(&self, generation: u64) -> Result<(), FloorError> {
        for _ in 0..3 {
            let reserved = self.reserved().await?;
            if generation <= reserved {
                return Ok(());
            }
            let crd = self.crds.get(&self.object).await.map_err(|source| self.api_error(source))?;
            let stored = parse(&crd, &self.object)?;
            let next = stored.max(generation.saturating_add(BLOCK));
            // The resourceVersion makes this a compare-and-swap: two leaders at once never lower it.
            let patch = serde_json::json!({
                "metadata": {
                    "resourceVersion": crd.resource_version(),
                    "annotations": { FLOOR_ANNOTATION: next.to_string() },
                }
            });
            match self.crds.patch(&self.object, &PatchParams::default(), &Patch::Merge(&patch)).await {
                Ok(_) => {
                    tracing::info!(reserved = next, "reserved assignment generations");
                    *self.lock() = Some(next);
                }
                Err(kube::Error::Api(status)) if status.code == 409 => *self.lock() = None,
                Err(source) => return Err(self.api_error(source)),
            }
        }
        match self.reserved().await? {
            reserved if generation <= reserved => Ok(()),
            _ => Err(self.api_error(kube::Error::Service("the CRD kept changing while we raised the floor".into()))),
        }
    }

    async fn read(&self) -> Result<u64, FloorError> {
        let crd = self.crds.get(&self.object).await.map_err(|source| self.api_error(source))?;
        let reserved = parse(&crd, &self.object)?;
        *self.lock() = Some(reserved);
        Ok(reserved)
    }

    fn api_error(&self, source: kube::Error) -> FloorError {
        FloorError::Api { object: self.object.clone(), source: Box::new(source) }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Option<u64>> {
        self.reserved.lock().unwrap_or_else(|p| p.into_inner())
    }
}

fn parse(crd: &CustomResourceDefinition, object: &str) -> Result<u64, FloorError> {
    match crd.annotations().get(FLOOR_ANNOTATION) {
        None => Ok(0),
        Some(value) => value.parse().map_err(|_| FloorError::Malformed(object.to_string())),
    }
}

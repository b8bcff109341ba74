//! The floor under every assignment generation, kept where it outlives the program's own
//! namespace: an annotation ([`Names::floor_annotation`](super::Names)) on the
//! CustomResourceDefinition of the objects we shard.
//!
//! Generations are fencing epochs, stamped on the sharded objects and their children. Those
//! live exactly as long as the CRD, while the assignment and the Leases live in the program's
//! namespace, which a reinstall, a namespace move or a restore may lose or roll back. A
//! leader therefore reserves generations on the CRD in blocks before it publishes one of
//! them, and an assignment published anew starts above the reservation: above every token
//! any install of the program can have written. One write per [`BLOCK`] generations.

use std::sync::Mutex;

use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{Api, Patch, PatchParams};
use kube::{Client, ResourceExt};

/// How many generations one write of the reservation covers.
pub const BLOCK: u64 = 1000;

/// Why the floor could not be read or raised.
#[derive(Debug, thiserror::Error)]
pub enum FloorError {
    #[error(
        "reading or raising the generation floor on CustomResourceDefinition {object} failed (this process needs get and \
         patch on it): {source}"
    )]
    Api { object: String, source: Box<kube::Error> },
    #[error("the generation floor on CustomResourceDefinition {0} is not a number")]
    Malformed(String),
}

/// The generation floor on one CustomResourceDefinition, as last read or written.
pub struct EpochFloor {
    crds: Api<CustomResourceDefinition>,
    object: String,
    annotation: &'static str,
    /// The reservation as last read or written; `None` until first read.
    reserved: Mutex<Option<u64>>,
}

impl EpochFloor {
    /// The floor kept on CRD `object`, in its `annotation`.
    pub fn new(client: Client, object: &str, annotation: &'static str) -> Self {
        Self { crds: Api::all(client), object: object.to_string(), annotation, reserved: Mutex::new(None) }
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
            let stored = self.parse(&crd)?;
            let next = stored.max(generation.saturating_add(BLOCK));
            // The resourceVersion makes this a compare-and-swap: two leaders at once never lower it.
            let patch = serde_json::json!({
                "metadata": {
                    "resourceVersion": crd.resource_version(),
                    "annotations": { self.annotation: next.to_string() },
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
        let reserved = self.parse(&crd)?;
        *self.lock() = Some(reserved);
        Ok(reserved)
    }

    fn api_error(&self, source: kube::Error) -> FloorError {
        FloorError::Api { object: self.object.clone(), source: Box::new(source) }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Option<u64>> {
        self.reserved.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn parse(&self, crd: &CustomResourceDefinition) -> Result<u64, FloorError> {
        match crd.annotations().get(self.annotation) {
            None => Ok(0),
            Some(value) => value.parse().map_err(|_| FloorError::Malformed(self.object.clone())),
        }
    }
}

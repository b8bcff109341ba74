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
//!
//! Admins lose the annotation: `kubectl replace -f` of the CRD from git, a GitOps sync that
//! replaces, a restore. While it leads, the leader writes its reservation back within
//! [`RECHECK`] ([`EpochFloor::keep`]). Lost while no install runs, the floor restarts low,
//! and the fencing policy refuses the first writes below the tokens stored; the replicas
//! report those tokens, and the leader grants above them (`assignment::starting_point`). A
//! value that is not a number counts as lost the same way, rather than stop every failover.

use std::sync::Mutex;
use std::time::Duration;

use tokio::time::Instant;

use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{Api, Patch, PatchParams};
use kube::{Client, ResourceExt};

/// How many generations one write of the reservation covers.
pub const BLOCK: u64 = 1000;

/// How often a leader checks that its reservation is still on the CRD.
pub const RECHECK: Duration = Duration::from_secs(30);

/// The first generation never granted: 10^18, the smallest of 19 digits. A fencing token is
/// 1 to 18 digits, which a CEL int holds and the fencing policy parses; it refuses a longer
/// one rather than read it as no token.
pub const EPOCH_LIMIT: u64 = 1_000_000_000_000_000_000;

/// Why the floor could not be read or raised.
#[derive(Debug, thiserror::Error)]
pub enum FloorError {
    #[error(
        "reading or raising the generation floor on CustomResourceDefinition {object} failed (this process needs get and \
         patch on it): {source}"
    )]
    Api { object: String, source: Box<kube::Error> },
    #[error(
        "generation {generation} is past the last fencing epoch ({}): the floor on CustomResourceDefinition {object} \
         leaves no epoch to grant",
        EPOCH_LIMIT - 1
    )]
    Exhausted { object: String, generation: u64 },
}

/// The reservation to write so that `generation` may be granted, given the `stored` one:
/// a block ahead, never past [`EPOCH_LIMIT`]; an error when `generation` itself is past it.
fn next_reservation(stored: u64, generation: u64, object: &str) -> Result<u64, FloorError> {
    if generation >= EPOCH_LIMIT {
        return Err(FloorError::Exhausted { object: object.to_string(), generation });
    }
    Ok(stored.max(generation.saturating_add(BLOCK).min(EPOCH_LIMIT - 1)))
}

/// The generation floor on one CustomResourceDefinition, as last read or written.
pub struct EpochFloor {
    crds: Api<CustomResourceDefinition>,
    object: String,
    annotation: &'static str,
    /// The reservation as last read or written; `None` until first read.
    reserved: Mutex<Option<u64>>,
    /// When [`Self::keep`] last read the CRD.
    kept_at: Mutex<Option<Instant>>,
    /// The highest reservation this process wrote or read: what [`Self::keep`] restores.
    /// Unlike `reserved`, a read of a lowered floor never lowers it.
    high_water: Mutex<u64>,
}

impl EpochFloor {
    /// The floor kept on CRD `object`, in its `annotation`.
    pub fn new(client: Client, object: &str, annotation: &'static str) -> Self {
        Self {
            crds: Api::all(client),
            object: object.to_string(),
            annotation,
            reserved: Mutex::new(None),
            kept_at: Mutex::new(None),
            high_water: Mutex::new(0),
        }
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
        next_reservation(0, generation, &self.object)?;
        for _ in 0..3 {
            let reserved = self.reserved().await?;
            if generation <= reserved {
                return Ok(());
            }
            let crd = self.crds.get(&self.object).await.map_err(|source| self.api_error(source))?;
            let stored = self.parse(&crd);
            let next = next_reservation(stored, generation, &self.object)?;
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
                    self.cache(next);
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

    /// Writes our reservation back if the CRD lost or lowered it, and at least `known`, the
    /// generation of the assignment the leader knows; reads the CRD at most once per
    /// [`RECHECK`]. The leader calls it while it leads.
    pub async fn keep(&self, known: u64) -> Result<(), FloorError> {
        {
            let mut kept_at = self.kept_at.lock().unwrap_or_else(|p| p.into_inner());
            if kept_at.is_some_and(|t| t.elapsed() < RECHECK) {
                return Ok(());
            }
            *kept_at = Some(Instant::now());
        }
        let ours = known.max(*self.lock_high_water());
        if ours == 0 {
            return Ok(());
        }
        let crd = self.crds.get(&self.object).await.map_err(|source| self.api_error(source))?;
        let stored = self.parse(&crd);
        if stored >= ours {
            return Ok(());
        }
        tracing::warn!(
            stored,
            reserved = ours,
            object = %self.object,
            "the generation floor on the CRD was removed or lowered (a replace or a restore); writing it back"
        );
        // What we just read is the reservation now: `reserve` reads the CRD only to write it.
        self.cache(stored);
        self.reserve(ours).await
    }

    fn lock_high_water(&self) -> std::sync::MutexGuard<'_, u64> {
        self.high_water.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Caches `reserved` as the CRD's reservation now (read or written).
    fn cache(&self, reserved: u64) {
        *self.lock() = Some(reserved);
        let mut high_water = self.lock_high_water();
        *high_water = (*high_water).max(reserved);
    }

    async fn read(&self) -> Result<u64, FloorError> {
        let crd = self.crds.get(&self.object).await.map_err(|source| self.api_error(source))?;
        let reserved = self.parse(&crd);
        self.cache(reserved);
        Ok(reserved)
    }

    fn api_error(&self, source: kube::Error) -> FloorError {
        FloorError::Api { object: self.object.clone(), source: Box::new(source) }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Option<u64>> {
        self.reserved.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The stored reservation; one that is not a number counts as none (see the module's doc).
    fn parse(&self, crd: &CustomResourceDefinition) -> u64 {
        let value = crd.annotations().get(self.annotation);
        let parsed = value.map(|v| v.parse::<u64>());
        if let Some(Err(_)) = parsed {
            tracing::warn!(
                value = value.map(String::as_str),
                object = %self.object,
                annotation = self.annotation,
                "the generation floor is not a number; counting it as lost (writes below a stored token are \
                 refused and raise it again)"
            );
        }
        parsed.and_then(Result::ok).unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reservations_stay_within_the_epoch_space() {
        let at = |stored, generation| next_reservation(stored, generation, "crd").map_err(|e| e.to_string());
        assert_eq!(at(0, 1), Ok(1 + BLOCK), "a block ahead");
        assert_eq!(at(5_000, 1), Ok(5_000), "never lowered");
        assert_eq!(at(0, EPOCH_LIMIT - 10), Ok(EPOCH_LIMIT - 1), "the block stops at the last epoch");
        assert_eq!(at(0, EPOCH_LIMIT - 1), Ok(EPOCH_LIMIT - 1), "the last epoch, 18 digits, is granted");
        assert_eq!((EPOCH_LIMIT - 1).to_string().len(), 18);
        let past = at(0, EPOCH_LIMIT).unwrap_err();
        assert!(past.contains("past the last fencing epoch (999999999999999999)"), "{past}");
        assert!(at(EPOCH_LIMIT, u64::MAX).is_err(), "a floor at the limit leaves nothing to grant");
    }
}

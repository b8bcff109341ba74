//! What the controller calls for each object: the [`Reconciler`], the business logic, and the
//! [`Gatekeeper`], which gives each reconcile the [`WriteGate`] it writes through (or says the
//! object is not this process's to reconcile now).

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use kube::core::Status;
use tokio::time::Instant;

use super::gate::{Permit, WriteGate};
use super::key::ObjectKey;
use super::queue::Priority;
use crate::error::Result;

/// What to do after a successful reconcile.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Action {
    /// Nothing until the next change or resync.
    Done,
    /// Look again after this long.
    RequeueAfter(Duration),
    /// Not ours to reconcile (another replica owns it): no resync either.
    Skip,
}

/// The business logic plugged into the runtime.
pub trait Reconciler<S>: Send + Sync + 'static {
    /// Reconciles `object`, whose key is `key` (the cache's own, so whatever keeps it shares
    /// it), writing only through `gate`. `lane` is the queue's lane the key was taken from:
    /// [`Priority::Low`] for a backlog (a first list, a handoff, a resync), [`Priority::High`]
    /// for a change.
    fn reconcile(
        &self,
        key: &ObjectKey,
        object: Arc<S>,
        gate: &dyn WriteGate,
        lane: Priority,
    ) -> impl Future<Output = Result<Action>> + Send;
    /// The watch says the object is gone (deleted, or out of the slice): drop any state kept
    /// for it.
    fn forget(&self, key: &ObjectKey);
}

/// Who may write, asked by the controller before each reconcile: the gate it gives is the
/// one the reconcile writes through. Sharding is one (it lets a reconcile write while its
/// object's bucket is this process's); [`Unguarded`] lets every write through.
pub trait Gatekeeper: Send + Sync + 'static {
    type Gate<'a>: WriteGate
    where
        Self: 'a;
    /// The gate for one reconcile of `key`, whose cache entry has it in `bucket`; `None` when
    /// the object is not this process's to reconcile now.
    fn admit<'a>(&'a self, key: &'a ObjectKey, bucket: Option<u16>) -> Option<Self::Gate<'a>>;
    /// The reconcile `gate` admitted returned `outcome`. Not called for a reconcile that
    /// panicked or timed out: its writes may still be on their way.
    fn finished(&self, gate: Self::Gate<'_>, outcome: &Result<Action>) {
        let _ = (gate, outcome);
    }
}

/// Lets every write through, with token 0 and no stamp: for a controller whose objects no
/// other process writes.
pub struct Unguarded {
    pub write_bound: Duration,
}

impl Gatekeeper for Unguarded {
    type Gate<'a> = &'a Unguarded;
    fn admit<'a>(&'a self, _: &'a ObjectKey, _: Option<u16>) -> Option<&'a Unguarded> {
        Some(self)
    }
}

impl WriteGate for &Unguarded {
    fn check(&self, _: &str) -> Result<Permit> {
        Ok(Permit { token: 0, sent: Instant::now() })
    }
    fn permitted(&self) -> bool {
        true
    }
    fn write_bound(&self) -> Duration {
        self.write_bound
    }
    fn routing_labels(&self) -> Vec<(String, String)> {
        Vec::new()
    }
    fn abandoned(&self, _: Instant) {}
    fn stamp(&self, _: &Permit, _: &mut BTreeMap<String, String>) {}
    fn is_fenced(&self, _: &Status) -> bool {
        false
    }
}

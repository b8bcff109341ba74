//! Readiness and liveness, built from parts: each component that must have done its first
//! real work (synced a watch, applied an assignment) is a named gate that it opens. Ready
//! once every gate is open and the process is not shutting down; live until a critical task
//! has ended. The admin server serves it as `/readyz` and `/livez`.

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

/// Readiness and liveness inputs, shared with every component.
#[derive(Default)]
pub struct Health {
    waiting: Mutex<BTreeSet<&'static str>>,
    shutting_down: AtomicBool,
    failed: Mutex<Option<String>>,
}

impl Health {
    /// Health that is ready once each of `gates` is opened with [`Health::ready`].
    pub fn with_gates(gates: &[&'static str]) -> Arc<Self> {
        Arc::new(Self { waiting: Mutex::new(gates.iter().copied().collect()), ..Default::default() })
    }

    /// Opens readiness gate `gate`.
    pub fn ready(&self, gate: &'static str) {
        self.set(gate, true);
    }

    /// Opens or closes `gate`: for a condition that can stop holding (a lapsed lease).
    pub fn set(&self, gate: &'static str, ready: bool) {
        let mut waiting = self.waiting.lock().unwrap_or_else(|p| p.into_inner());
        if ready {
            waiting.remove(gate);
        } else {
            waiting.insert(gate);
        }
    }

    /// Not ready from now on: the process is shutting down.
    pub fn set_shutting_down(&self) {
        self.shutting_down.store(true, Ordering::Relaxed);
    }

    /// A critical task ended: the process is no longer live.
    pub fn fail(&self, what: String) {
        *self.failed.lock().unwrap_or_else(|p| p.into_inner()) = Some(what);
    }

    /// What readiness still waits for; empty when ready.
    pub fn waiting_for(&self) -> Vec<&'static str> {
        let mut waiting: Vec<&'static str> =
            self.waiting.lock().unwrap_or_else(|p| p.into_inner()).iter().copied().collect();
        if self.shutting_down.load(Ordering::Relaxed) {
            waiting.push("shutdown");
        }
        waiting
    }

    /// Whether every gate is open and the process is not shutting down.
    pub fn is_ready(&self) -> bool {
        self.waiting_for().is_empty()
    }

    /// What failed, if something did.
    pub fn failure(&self) -> Option<String> {
        self.failed.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }
}

//! The audit log, for tests of the sharding protocol: one JSON line per reconcile start,
//! API write and reconcile end, with this replica's name and a wall-clock timestamp in
//! nanoseconds. Replicas on one machine share the clock, so their logs can be merged to
//! check that no two replicas ever worked on one object at once. Off unless
//! `--audit-log` is given.

use std::fs::File;
use std::io::Write;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{SystemTime, UNIX_EPOCH};

/// Where the audit lines go (nowhere by default).
#[derive(Clone, Default)]
pub struct Audit {
    sink: Option<Arc<Mutex<File>>>,
    replica: Arc<str>,
    incarnation: Arc<str>,
}

impl Audit {
    /// An audit log appended to `path`, its lines naming `replica` and `incarnation`.
    pub fn open(path: &Path, replica: &str, incarnation: &str) -> anyhow::Result<Self> {
        let file = File::options()
            .create(true)
            .append(true)
            .open(path)
            .map_err(|e| anyhow::anyhow!("cannot open --audit-log {}: {e}", path.display()))?;
        Ok(Self { sink: Some(Arc::new(Mutex::new(file))), replica: replica.into(), incarnation: incarnation.into() })
    }

    /// Writes one line: `event` about `object`, with `detail`.
    pub fn record(&self, event: &str, object: &dyn std::fmt::Display, detail: &str) {
        let Some(sink) = &self.sink else { return };
        let t = SystemTime::now().duration_since(UNIX_EPOCH).unwrap_or_default().as_nanos();
        let line = serde_json::json!({
            "t": t.to_string(), "replica": &*self.replica, "incarnation": &*self.incarnation, "event": event, "object": object.to_string(), "detail": detail
        });
        let mut file = sink.lock().unwrap_or_else(|p| p.into_inner());
        // One write per line; O_APPEND keeps lines whole.
        let _ = file.write_all(format!("{line}\n").as_bytes());
    }
}

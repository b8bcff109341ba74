//! Which installs of the program may run: recorded on the CustomResourceDefinition that keeps
//! the generation floor ([`Names::install_annotation`](super::Names)).
//!
//! Installs share the CRD, the objects and their fencing tokens, but each has its own
//! namespace, Leases and assignment. Two installs that watch the same namespaces would each
//! grant buckets, and a token above every generation an install knows could be the other's
//! rather than a lost floor. So the CRD records each install's namespace with the namespaces
//! it watches (`*` for all), as JSON: `{"platform":"*"}`. Installs whose scopes do not overlap
//! (each with its own `--watch-namespace`) run side by side.
//! - A replica starts its part only once the record holds its install and no other live one
//!   that overlaps it. An overlapping install is gone once its leader Lease has stayed missing
//!   (deleted with its namespace) or unchanged here for a lease duration (released or
//!   unrenewed); its entry is then removed. A missing record (a new CRD, `kubectl replace -f
//!   crds/`) is written anew.
//! - While a live one holds it, the replica waits: not ready, the reason in the log and
//!   `<prefix>_install_blocked` at 1; it asks again every [`WAIT_POLL`].
//! - While it runs, it reads the record every [`RECHECK`]: a lost entry is written back; if two
//!   checks in a row find an overlapping live install holding it, this replica stops, and waits
//!   after its restart.

use std::collections::BTreeMap;
use std::sync::Mutex;
use std::time::Duration;

use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{Api, Patch, PatchParams};
use kube::{Client, ResourceExt};
use sharded_runtime::health::Health;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::ShardConfig;
use super::epoch_floor::RECHECK;
use super::lease::ForeignHold;
use super::metrics as m;

/// The readiness gate closed while another install holds the record.
pub const READINESS_GATE: &str = "install record";
/// How often a waiting replica asks again.
pub const WAIT_POLL: Duration = Duration::from_secs(2);
/// How a missing leader Lease is held in [`ForeignHold`]: no incarnation is named so.
const NO_LEASE: &str = "(no leader Lease)";
/// The scope of an install that watches every namespace.
pub const ALL_NAMESPACES: &str = "*";

/// Install namespace → the namespace it watches, or [`ALL_NAMESPACES`].
pub type Installs = BTreeMap<String, String>;

/// What is known of another install's leader Lease.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Rival {
    /// Deleted, or unchanged here for a lease duration: that install is gone.
    Gone,
    /// Renewed, or not yet seen unchanged for a lease duration.
    Live,
    /// It could not be read.
    Unknown(String),
}

/// What the record says this replica may do.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Standing {
    /// The record holds our install, and no live install that overlaps it.
    Ours,
    /// Ours once this record is written.
    Claim(Installs),
    /// Another install, live or not known to be gone, watches what we would.
    Blocked { namespace: String, why: String },
}

fn overlap(a: &str, b: &str) -> bool {
    a == ALL_NAMESPACES || b == ALL_NAMESPACES || a == b
}

/// The installs in `record`, other than `ours`, that watch some namespace `scope` covers.
pub fn rivals<'a>(record: &'a Installs, ours: &str, scope: &str) -> Vec<&'a str> {
    record.iter().filter(|(ns, s)| ns.as_str() != ours && overlap(s, scope)).map(|(ns, _)| ns.as_str()).collect()
}

/// The standing of install `ours` watching `scope`, given the `stored` record, the rivals this
/// process saw live before (`remembered`: a record lost meanwhile does not make them gone), and
/// what is known of each rival's leader Lease.
pub fn standing(
    stored: &Installs,
    remembered: &Installs,
    ours: &str,
    scope: &str,
    rival: impl Fn(&str) -> Rival,
) -> Standing {
    let mut record = remembered.clone();
    record.extend(stored.iter().map(|(ns, s)| (ns.clone(), s.clone())));
    let mut next = stored.clone();
    for namespace in rivals(&record, ours, scope) {
        let why = match rival(namespace) {
            Rival::Gone => {
                next.remove(namespace);
                continue;
            }
            Rival::Live => "its leader Lease is renewed".to_string(),
            Rival::Unknown(error) => format!("its leader Lease cannot be read: {error}"),
        };
        return Standing::Blocked { namespace: namespace.to_string(), why };
    }
    next.insert(ours.to_string(), scope.to_string());
    if next == *stored { Standing::Ours } else { Standing::Claim(next) }
}

/// The record on one CRD, as this install reads and claims it.
pub struct InstallRecord {
    crds: Api<CustomResourceDefinition>,
    client: Client,
    object: String,
    annotation: &'static str,
    leader_lease: &'static str,
    ours: String,
    scope: String,
    lease_duration: Duration,
    /// Each rival's leader Lease as first seen unchanged, by our clock.
    holds: Mutex<BTreeMap<String, ForeignHold>>,
    /// The rivals last seen live, with their scopes.
    remembered: Mutex<Installs>,
}

impl InstallRecord {
    pub fn new(client: Client, config: &ShardConfig) -> Self {
        Self {
            crds: Api::all(client.clone()),
            client,
            object: config.floor_object.clone(),
            annotation: config.names.install_annotation,
            leader_lease: config.names.leader_lease,
            ours: config.namespace.clone(),
            scope: config.watch_namespace.clone().unwrap_or_else(|| ALL_NAMESPACES.to_string()),
            lease_duration: config.lease_duration,
            holds: Mutex::default(),
            remembered: Mutex::default(),
        }
    }

    /// Reads the record and claims it when it is ours to take; what it found.
    pub async fn check(&self) -> Result<Standing, kube::Error> {
        for _ in 0..3 {
            let crd = self.crds.get(&self.object).await?;
            let stored = self.parse(&crd);
            let remembered = self.remembered.lock().unwrap_or_else(|p| p.into_inner()).clone();
            let mut record = remembered.clone();
            record.extend(stored.clone());
            let mut seen = BTreeMap::new();
            for namespace in rivals(&record, &self.ours, &self.scope) {
                seen.insert(namespace.to_string(), self.rival(namespace).await);
            }
            let live = record.into_iter().filter(|(ns, _)| seen.get(ns).is_some_and(|r| *r != Rival::Gone));
            *self.remembered.lock().unwrap_or_else(|p| p.into_inner()) = live.collect();
            let standing = standing(&stored, &remembered, &self.ours, &self.scope, |ns| seen[ns].clone());
            let Standing::Claim(next) = &standing else { return Ok(standing) };
            match self.write(&crd, next).await {
                Ok(()) => {
                    tracing::info!(record = ?next, object = %self.object, "recorded this install on the CRD");
                    return Ok(Standing::Ours);
                }
                Err(kube::Error::Api(s)) if s.code == 409 => continue,
                Err(error) => return Err(error),
            }
        }
        Err(kube::Error::Service("the CRD kept changing while we recorded this install".into()))
    }

    /// Waits until the record is ours; false if `stop` came first. Readiness waits meanwhile.
    pub async fn wait_until_ours(&self, health: &Health, stop: &CancellationToken) -> bool {
        let mut said = String::new();
        loop {
            let (blocked, say) = match self.check().await {
                Ok(Standing::Ours | Standing::Claim(_)) => break,
                Ok(Standing::Blocked { namespace, why }) => (true, self.blocked_message(&namespace, &why)),
                // Without the record nothing tells this install from another: it waits, as
                // the generation floor, which needs the same get and patch, would stop it anyway.
                Err(error) => (
                    false,
                    format!(
                        "cannot read or write the install record on CustomResourceDefinition {} (this process needs \
                         get and patch on it); retrying: {error}",
                        self.object
                    ),
                ),
            };
            m::set_install_blocked(blocked);
            health.set(READINESS_GATE, false);
            if say != said {
                tracing::error!("{say}");
                said = say;
            }
            tokio::select! {
                _ = tokio::time::sleep(WAIT_POLL) => {}
                _ = stop.cancelled() => return false,
            }
        }
        m::set_install_blocked(false);
        health.ready(READINESS_GATE);
        true
    }

    /// While this install runs: rewrites a lost entry every [`RECHECK`]; returns why it must
    /// stop once an overlapping live install holds the record (a critical task: it ends only
    /// then). Read errors wait for the next check.
    pub async fn keep(&self) -> String {
        // A rival seen for the first time counts as live until its Lease has stood for a lease
        // duration (a restore may bring back the entry of an install long gone): this install
        // stops only when two checks in a row find the same one live.
        let mut blocked_by: Option<String> = None;
        loop {
            tokio::time::sleep(RECHECK).await;
            match self.check().await {
                Ok(Standing::Blocked { namespace, why }) if blocked_by.as_ref() == Some(&namespace) => {
                    m::set_install_blocked(true);
                    return self.blocked_message(&namespace, &why);
                }
                Ok(Standing::Blocked { namespace, why }) => {
                    tracing::warn!(rival = %namespace, %why, "another install holds the install record; checking again");
                    blocked_by = Some(namespace);
                }
                Ok(_) => blocked_by = None,
                Err(error) => tracing::warn!(%error, "could not check the install record"),
            }
        }
    }

    /// Removes our entry, as the last replica of this install leaves, so that another install
    /// may start at once rather than after a lease duration. Best effort: a left entry only
    /// makes the next install wait.
    pub async fn release(&self) {
        for _ in 0..3 {
            let Ok(crd) = self.crds.get(&self.object).await else { return };
            let mut record = self.parse(&crd);
            if record.remove(&self.ours).is_none() {
                return;
            }
            match self.write(&crd, &record).await {
                Ok(()) => return tracing::info!("the last replica of this install left: removed it from the record"),
                Err(kube::Error::Api(s)) if s.code == 409 => continue,
                Err(error) => return tracing::warn!(%error, "could not remove this install from the record"),
            }
        }
    }

    /// Writes `record` over the one `crd` holds. The resourceVersion makes it a compare-and-swap:
    /// of two writes at once, one wins and the other reads again.
    async fn write(&self, crd: &CustomResourceDefinition, record: &Installs) -> Result<(), kube::Error> {
        let value = serde_json::to_string(record).expect("a map of strings");
        let patch = serde_json::json!({
            "metadata": { "resourceVersion": crd.resource_version(), "annotations": { self.annotation: value } }
        });
        self.crds.patch(&self.object, &PatchParams::default(), &Patch::Merge(&patch)).await.map(drop)
    }

    fn blocked_message(&self, namespace: &str, why: &str) -> String {
        format!(
            "another install, in namespace {namespace}, watches namespaces this one would ({why}); this replica does \
             nothing until that install is removed (its leader Lease deleted or unrenewed for a lease duration), or \
             its entry is removed from annotation {} of CustomResourceDefinition {} and this replica restarted",
            self.annotation, self.object
        )
    }

    async fn rival(&self, namespace: &str) -> Rival {
        let leases = Api::<Lease>::namespaced(self.client.clone(), namespace);
        // A missing Lease counts like one unchanged: gone only once it has stayed missing for a
        // lease duration, since an install that just recorded itself elects its leader after.
        let (holder, renew_time, duration) = match leases.get_opt(self.leader_lease).await {
            Ok(Some(lease)) => {
                let spec = lease.spec.unwrap_or_default();
                let duration = Duration::from_secs(spec.lease_duration_seconds.unwrap_or(0).max(0) as u64);
                (spec.holder_identity.unwrap_or_default(), spec.renew_time, duration)
            }
            Ok(None) => (NO_LEASE.to_string(), None, Duration::ZERO),
            Err(error) => return Rival::Unknown(error.to_string()),
        };
        // A released Lease counts only once it stays released: a rolling update hands it on.
        let mut holds = self.holds.lock().unwrap_or_else(|p| p.into_inner());
        let hold = holds.entry(namespace.to_string()).or_default();
        match hold.expired(&holder, renew_time, duration.max(self.lease_duration), Instant::now()) {
            true => Rival::Gone,
            false => Rival::Live,
        }
    }

    /// The recorded installs; a value that is not such a map counts as none, with a warning.
    fn parse(&self, crd: &CustomResourceDefinition) -> Installs {
        let Some(value) = crd.annotations().get(self.annotation) else { return Installs::new() };
        serde_json::from_str(value).unwrap_or_else(|error| {
            tracing::warn!(%value, %error, annotation = self.annotation, "the install record is malformed; rewriting it");
            Installs::new()
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(entries: &[(&str, &str)]) -> Installs {
        entries.iter().map(|(ns, scope)| (ns.to_string(), scope.to_string())).collect()
    }

    #[test]
    fn an_install_runs_only_beside_installs_that_watch_other_namespaces() {
        let live = |_: &str| Rival::Live;
        let gone = |_: &str| Rival::Gone;
        let claim = |entries: &[(&str, &str)]| Standing::Claim(record(entries));
        let blocked = |ns: &str| Standing::Blocked { namespace: ns.into(), why: "its leader Lease is renewed".into() };
        type Case<'a> = (&'a str, Installs, &'a str, &'a dyn Fn(&str) -> Rival, Standing);
        let cases: Vec<Case> = vec![
            ("a new CRD", record(&[]), "*", &live, claim(&[("a", "*")])),
            ("already ours", record(&[("a", "*")]), "*", &live, Standing::Ours),
            ("our scope changed", record(&[("a", "t1")]), "*", &live, claim(&[("a", "*")])),
            ("another, live, watching all", record(&[("b", "*")]), "t1", &live, blocked("b")),
            ("another, live, same namespace", record(&[("b", "t1")]), "t1", &live, blocked("b")),
            ("we watch all, another one", record(&[("b", "t1")]), "*", &live, blocked("b")),
            ("disjoint", record(&[("b", "t1")]), "t2", &live, claim(&[("a", "t2"), ("b", "t1")])),
            ("another, gone", record(&[("b", "*")]), "*", &gone, claim(&[("a", "*")])),
            ("ours and a gone rival", record(&[("a", "*"), ("b", "*")]), "*", &gone, claim(&[("a", "*")])),
        ];
        for (case, stored, scope, rival, expected) in cases {
            assert_eq!(standing(&stored, &Installs::new(), "a", scope, rival), expected, "{case}");
        }
        let lost = standing(&record(&[]), &record(&[("b", "*")]), "a", "*", live);
        assert_eq!(lost, blocked("b"), "a record lost while a rival lives does not make it gone");
        let lost_and_gone = standing(&record(&[]), &record(&[("b", "*")]), "a", "*", gone);
        assert_eq!(lost_and_gone, claim(&[("a", "*")]));
        let unknown =
            standing(&record(&[("b", "*")]), &Installs::new(), "a", "*", |_| Rival::Unknown("403 forbidden".into()));
        assert!(
            matches!(unknown, Standing::Blocked { why, .. } if why.contains("403 forbidden")),
            "never assumed gone"
        );
    }
}

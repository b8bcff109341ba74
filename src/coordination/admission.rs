//! Whether the admission policies the operator relies on are in force for its own identity.
//!
//! Both bindings name their parameter, the operator's Namespace, with
//! `parameterNotFoundAction: Allow`: should that Namespace be missing, or the policy's
//! identity expression name another service account (an overlay that renamed it), the API
//! server applies neither policy and says nothing. So the operator asks the server, at start
//! and every minute, with two dry-run creates in its own namespace that each policy must
//! refuse (nothing is ever stored):
//! - a ConfigMap named like the assignment (which operator-reach lets through) carrying the
//!   malformed fencing token `probe`: the fencing policy refuses it as malformed when it
//!   takes us for the operator, and as someone else's token when it does not;
//! - an unlabelled ConfigMap: operator-reach refuses it when it takes us for the operator.
//!
//! The answers go to `traffic_policy_admission_policy_in_force{policy}`, to the log when they
//! change, and, with `--admission-policies=required` (the shipped install's setting), to
//! readiness (docs/operations.md, "Admission policies in force").

use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::{Api, ObjectMeta, PostParams};
use kube::core::Status;
use kube::{Client, ResourceExt};
use tokio_util::sync::CancellationToken;

use super::{ASSIGNMENT_CONFIGMAP, FENCE_ANNOTATION};
use crate::runtime::health::Health;

/// The readiness gate that waits for both policies, with `--admission-policies=required`.
pub const READINESS_GATE: &str = "admission policies";
/// How often the policies are asked again.
const PERIOD: Duration = Duration::from_secs(60);

pub const FENCING: &str = "fencing";
pub const OPERATOR_REACH: &str = "operator-reach";

/// What a probe found of one policy.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Standing {
    /// It refused the probe as it refuses the operator.
    InForce,
    /// It let the probe through: not applied (its parameter Namespace or binding missing).
    NotApplied,
    /// It is applied, but does not take this process's identity for the operator's.
    WrongIdentity,
    /// The probe's answer says neither (an API error): asked again at the next period.
    Unknown(String),
}

/// What the fencing policy's answer to the probe says of it.
/// `refusal` is `None` when the server accepted the probe.
pub fn fencing_standing(refusal: Option<&Status>) -> Standing {
    match refusal {
        None => Standing::NotApplied,
        Some(s) if s.code == 409 => Standing::NotApplied, // admitted, then found to exist
        Some(s) if s.code == 403 && s.message.contains("malformed shard epoch") => Standing::InForce,
        Some(s) if s.code == 403 && s.message.contains("may not set, change or remove it") => Standing::WrongIdentity,
        Some(s) => Standing::Unknown(format!("{} {}", s.code, s.message)),
    }
}

/// What the operator-reach policy's answer to the probe says of it.
pub fn reach_standing(refusal: Option<&Status>) -> Standing {
    match refusal {
        // The policy passes anyone it does not take for the operator: a wrong identity
        // reads the same as a missing parameter.
        None => Standing::NotApplied,
        Some(s) if s.code == 403 && s.message.contains("trafficpolicy.dev-operator-reach") => Standing::InForce,
        Some(s) => Standing::Unknown(format!("{} {}", s.code, s.message)),
    }
}

/// Asks the server about both policies, in the operator's namespace `namespace`.
pub async fn probe(client: &Client, namespace: &str) -> [(&'static str, Standing); 2] {
    let api = Api::<ConfigMap>::namespaced(client.clone(), namespace);
    let mut fenced = probe_object(ASSIGNMENT_CONFIGMAP);
    fenced.annotations_mut().insert(FENCE_ANNOTATION.into(), "probe".into());
    let unlabelled = probe_object("traffic-policy-operator-reach-probe");
    let (fencing, reach) = futures::join!(dry_run(&api, &fenced), dry_run(&api, &unlabelled));
    [
        (FENCING, fencing.map_or_else(|e| Standing::Unknown(e.to_string()), |r| fencing_standing(r.as_ref()))),
        (OPERATOR_REACH, reach.map_or_else(|e| Standing::Unknown(e.to_string()), |r| reach_standing(r.as_ref()))),
    ]
}

fn probe_object(name: &str) -> ConfigMap {
    ConfigMap { metadata: ObjectMeta { name: Some(name.into()), ..Default::default() }, ..Default::default() }
}

/// A dry-run create: the server's refusal (`None` when it accepted), or a transport error.
async fn dry_run(api: &Api<ConfigMap>, object: &ConfigMap) -> kube::Result<Option<Status>> {
    match api.create(&PostParams { dry_run: true, ..Default::default() }, object).await {
        Ok(_) => Ok(None),
        Err(kube::Error::Api(status)) => Ok(Some(*status)),
        Err(other) => Err(other),
    }
}

/// Probes every [`PERIOD`] until `shutdown`: sets the metric, logs each change, and holds the
/// readiness gate [`READINESS_GATE`] open only while both policies are in force, when
/// `required`.
pub async fn watch(
    client: Client,
    namespace: String,
    health: Arc<Health>,
    required: bool,
    shutdown: CancellationToken,
) {
    let mut last: Option<[(&'static str, Standing); 2]> = None;
    loop {
        let found = probe(&client, &namespace).await;
        for (policy, standing) in &found {
            crate::telemetry::metrics::set_admission_policy_in_force(policy, *standing == Standing::InForce);
        }
        if last.as_ref() != Some(&found) {
            for (policy, standing) in &found {
                match standing {
                    Standing::InForce => tracing::info!(policy, "admission policy in force"),
                    other => {
                        tracing::warn!(policy, standing = ?other, "admission policy NOT in force for this identity")
                    }
                }
            }
        }
        // An unknown answer changes nothing: a passing API error must not flap readiness.
        if required && found.iter().all(|(_, s)| !matches!(s, Standing::Unknown(_))) {
            health.set(READINESS_GATE, found.iter().all(|(_, s)| *s == Standing::InForce));
        }
        last = Some(found);
        tokio::select! {
            _ = tokio::time::sleep(PERIOD) => {}
            _ = shutdown.cancelled() => return,
        }
    }
}

/// What a binding of one of the policies says, for the `shards` command: `binding` is the
/// Namespace its `paramRef` names (`Some(None)`: bound without a parameter; `None`: no
/// binding), and `exists` whether that Namespace exists.
pub fn binding_state(policy: &str, binding: Option<Option<&str>>, exists: bool) -> String {
    match binding {
        None => format!("{policy} NOT APPLIED (no binding trafficpolicy.dev-{policy})"),
        Some(None) => format!("{policy} bound without a parameter"),
        Some(Some(namespace)) if !exists => {
            format!("{policy} NOT APPLIED (its parameter, Namespace {namespace}, does not exist)")
        }
        Some(Some(namespace)) => format!("{policy} bound to Namespace {namespace}"),
    }
}

/// The `shards` command's line on both bindings, read as any user (who may not read them).
pub async fn bindings_line(client: &Client) -> String {
    use k8s_openapi::api::admissionregistration::v1::ValidatingAdmissionPolicyBinding;
    use k8s_openapi::api::core::v1::Namespace;
    let bindings = Api::<ValidatingAdmissionPolicyBinding>::all(client.clone());
    let namespaces = Api::<Namespace>::all(client.clone());
    let mut states = Vec::new();
    for policy in [FENCING, OPERATOR_REACH] {
        let state = match bindings.get_opt(&format!("trafficpolicy.dev-{policy}")).await {
            Err(error) => format!("{policy} unknown ({error})"),
            Ok(binding) => {
                let param: Option<Option<String>> = binding.map(|b| b.spec.param_ref.and_then(|p| p.name));
                let exists = match param.as_ref().and_then(Option::as_deref) {
                    Some(name) => namespaces.get_opt(name).await.map(|n| n.is_some()).unwrap_or(true),
                    None => true,
                };
                binding_state(policy, param.as_ref().map(Option::as_deref), exists)
            }
        };
        states.push(state);
    }
    format!(
        "admission policies: {} (whether each takes the replicas for the operator: \
         traffic_policy_admission_policy_in_force)",
        states.join("; ")
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn what_the_shards_command_says_of_a_binding() {
        let cases = [
            (None, true, "fencing NOT APPLIED (no binding trafficpolicy.dev-fencing)"),
            (Some(None), true, "fencing bound without a parameter"),
            (Some(Some("tpo")), false, "fencing NOT APPLIED (its parameter, Namespace tpo, does not exist)"),
            (Some(Some("tpo")), true, "fencing bound to Namespace tpo"),
        ];
        for (binding, exists, expected) in cases {
            assert_eq!(binding_state(FENCING, binding, exists), expected);
        }
    }

    fn refused(code: u16, message: &str) -> Status {
        Status::failure(message, "Forbidden").with_code(code)
    }

    #[test]
    fn what_each_answer_says_of_a_policy() {
        let malformed = refused(403, "trafficpolicy.dev-fencing: refused a write with the malformed shard epoch probe");
        let foreign = refused(
            403,
            "trafficpolicy.dev-fencing: ... is the operator's fencing token: system:serviceaccount:x:renamed may not set, change or remove it (absent -> probe)",
        );
        let exists = refused(409, "configmaps \"traffic-policy-operator-assignment\" already exists");
        let reach = refused(403, "trafficpolicy.dev-operator-reach: the operator writes only the objects it manages");
        let rbac = refused(403, "configmaps is forbidden: User \"x\" cannot create resource \"configmaps\"");
        let cases: [(&str, Standing, Standing); 6] = [
            ("refused as the operator's", fencing_standing(Some(&malformed)), Standing::InForce),
            ("refused as someone else's", fencing_standing(Some(&foreign)), Standing::WrongIdentity),
            ("let through", fencing_standing(None), Standing::NotApplied),
            ("let through to storage", fencing_standing(Some(&exists)), Standing::NotApplied),
            ("operator-reach refuses", reach_standing(Some(&reach)), Standing::InForce),
            ("operator-reach lets through", reach_standing(None), Standing::NotApplied),
        ];
        for (case, found, expected) in cases {
            assert_eq!(found, expected, "{case}");
        }
        assert!(matches!(fencing_standing(Some(&rbac)), Standing::Unknown(_)), "RBAC says nothing of the policy");
        assert!(matches!(reach_standing(Some(&rbac)), Standing::Unknown(_)));
    }
}

//! Whose an existing object is, decided before the operator writes it.
//!
//! A child (a NetworkPolicy, a ConfigMap, a gateway object) is written only when no object of
//! its name exists, or when the one that exists is the policy's own. Anything else belongs to
//! someone: it is never written or deleted, and the policy reports whose it is. The
//! operator-reach admission policy refuses the same writes on the server, as a second line
//! where it is installed (docs/operations.md, "Name clashes").
//!
//! Pure: the caller reads the object's metadata and acts on the [`Claim`].

use kube::api::ObjectMeta;
use kube::core::Resource;

use super::FIELD_MANAGER;
use super::desired::{MANAGED_BY_LABEL, MANAGED_BY_VALUE};
use crate::api::ApplicationTrafficPolicy;

/// What a write of a child named like the policy would meet.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Claim {
    /// No object of that name: the write creates it.
    Absent,
    /// The policy's own: read at this resourceVersion, which the write requires; `None` when
    /// it is known from the operator's own writes, unchanged by anyone since, and not read.
    Ours { resource_version: Option<String> },
    /// Someone else's: who, in words ("managed by kubectl-client-side-apply").
    Foreign { holder: String },
}

/// Whose `existing` is, for the policy named `policy`. The policy's own is an object whose
/// controller is an ApplicationTrafficPolicy of that name (of any uid: a policy deleted and
/// made again, as a restore does, takes over what the one before it wrote), or one that has
/// no controller at all but our managed-by label and fields written by our field manager
/// (what `kubectl delete --cascade=orphan` leaves of a policy's child).
pub fn claim(existing: Option<&ObjectMeta>, policy: &str) -> Claim {
    let Some(meta) = existing else {
        return Claim::Absent;
    };
    let owners = meta.owner_references.as_deref().unwrap_or_default();
    let controller = owners.iter().find(|o| o.controller == Some(true));
    let ours = match controller {
        Some(c) => {
            c.kind == ApplicationTrafficPolicy::kind(&()).as_ref()
                && c.api_version.split('/').next() == Some(ApplicationTrafficPolicy::group(&()).as_ref())
                && c.name == policy
        }
        None => orphan_of_ours(meta),
    };
    if ours {
        return Claim::Ours { resource_version: meta.resource_version.clone() };
    }
    let holder = match controller {
        Some(c) => format!("controlled by {} {}", c.kind, c.name),
        None => match managers(meta).as_slice() {
            [] => "made by someone else".to_string(),
            managers => format!("managed by {}", managers.join(", ")),
        },
    };
    Claim::Foreign { holder }
}

/// Carries our managed-by label and fields of our field manager's.
fn orphan_of_ours(meta: &ObjectMeta) -> bool {
    let labelled = meta.labels.as_ref().and_then(|l| l.get(MANAGED_BY_LABEL)).is_some_and(|v| v == MANAGED_BY_VALUE);
    labelled && managers(meta).contains(&FIELD_MANAGER)
}

/// The field managers of `meta`, each once, in order.
fn managers(meta: &ObjectMeta) -> Vec<&str> {
    let mut names: Vec<&str> = Vec::new();
    for entry in meta.managed_fields.iter().flatten() {
        if let Some(name) = entry.manager.as_deref().filter(|n| !names.contains(n)) {
            names.push(name);
        }
    }
    names
}

/// What a policy's status and Warning event say of a clash: the object, whose it is, and
/// how to resolve it.
pub fn clash_message(kind: &str, namespace: &str, name: &str, holder: &str) -> String {
    format!(
        "{kind} {namespace}/{name} exists and is not this policy's ({holder}): the operator does not write or delete \
         it. Rename the policy, or delete that {kind} (docs/operations.md, \"Name clashes\")"
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ManagedFieldsEntry, OwnerReference};

    fn controller(api_version: &str, kind: &str, name: &str, is_controller: bool) -> OwnerReference {
        OwnerReference {
            api_version: api_version.into(),
            kind: kind.into(),
            name: name.into(),
            uid: "some-uid".into(),
            controller: Some(is_controller),
            block_owner_deletion: None,
        }
    }

    fn meta(owner: Option<OwnerReference>, labelled: bool, managers: &[&str]) -> ObjectMeta {
        ObjectMeta {
            resource_version: Some("42".into()),
            owner_references: owner.map(|o| vec![o]),
            labels: labelled.then(|| [(MANAGED_BY_LABEL.to_string(), MANAGED_BY_VALUE.to_string())].into()),
            managed_fields: Some(
                managers
                    .iter()
                    .map(|m| ManagedFieldsEntry { manager: Some(m.to_string()), ..Default::default() })
                    .collect(),
            ),
            ..Default::default()
        }
    }

    #[test]
    fn whose_an_object_is() {
        let ours = Claim::Ours { resource_version: Some("42".into()) };
        let foreign = |holder: &str| Claim::Foreign { holder: holder.into() };
        let atp =
            |name, is_controller| controller("trafficpolicy.dev/v1", "ApplicationTrafficPolicy", name, is_controller);
        let cases: [(&str, Option<ObjectMeta>, Claim); 10] = [
            ("nothing of that name", None, Claim::Absent),
            ("this policy's child", Some(meta(Some(atp("web", true)), true, &[FIELD_MANAGER])), ours.clone()),
            (
                "an earlier policy's of the name (a restore)",
                Some(meta(Some(atp("web", true)), false, &[])),
                ours.clone(),
            ),
            (
                "an orphan of ours (--cascade=orphan)",
                Some(meta(None, true, &[FIELD_MANAGER, "kube-controller-manager"])),
                ours.clone(),
            ),
            (
                "a tenant's, unlabelled",
                Some(meta(None, false, &["kubectl-client-side-apply"])),
                foreign("managed by kubectl-client-side-apply"),
            ),
            (
                "a tenant's that carries our label",
                Some(meta(None, true, &["kubectl-create", "kubectl-edit", "kubectl-create"])),
                foreign("managed by kubectl-create, kubectl-edit"),
            ),
            ("a tenant's with no managed fields", Some(meta(None, false, &[])), foreign("made by someone else")),
            (
                "another policy's child",
                Some(meta(Some(atp("api", true)), true, &[FIELD_MANAGER])),
                foreign("controlled by ApplicationTrafficPolicy api"),
            ),
            (
                "another controller's",
                Some(meta(Some(controller("apps/v1", "Deployment", "web", true)), true, &[FIELD_MANAGER])),
                foreign("controlled by Deployment web"),
            ),
            (
                "a policy that is an owner but not the controller",
                Some(meta(Some(atp("web", false)), false, &["helm"])),
                foreign("managed by helm"),
            ),
        ];
        for (case, existing, expected) in cases {
            assert_eq!(claim(existing.as_ref(), "web"), expected, "{case}");
        }
    }

    #[test]
    fn the_clash_message_names_the_object_its_holder_and_the_way_out() {
        let message = clash_message("NetworkPolicy", "shop", "web", "managed by kubectl-client-side-apply");
        assert!(message.starts_with("NetworkPolicy shop/web exists and is not this policy's"), "{message}");
        assert!(message.contains("(managed by kubectl-client-side-apply)"), "{message}");
        assert!(message.contains("Rename the policy, or delete that NetworkPolicy"), "{message}");
    }
}

//! Restricted identities: a ServiceAccount bound to given roles, with a token from the
//! TokenRequest API, so tests can run the operator with exactly the RBAC that deploy/ grants.

use std::path::PathBuf;

use anyhow::{Context, Result};
use k8s_openapi::api::authentication::v1::{TokenRequest, TokenRequestSpec};
use k8s_openapi::api::core::v1::{Namespace, ServiceAccount};
use k8s_openapi::api::rbac::v1::{ClusterRoleBinding, RoleBinding, RoleRef, Subject};
use kube::api::{Api, ObjectMeta, Patch, PatchParams, PostParams};

use crate::ControlPlane;

/// A role to bind to an identity.
#[derive(Clone, Debug)]
pub enum Grant {
    /// A ClusterRole bound cluster-wide.
    ClusterRole(String),
    /// A Role (in `namespace`) bound in that namespace.
    Role { namespace: String, name: String },
}

/// A ServiceAccount identity with a bearer token.
pub struct Identity {
    /// `system:serviceaccount:NAMESPACE:NAME`
    pub user: String,
    pub token: String,
    pub kubeconfig_path: PathBuf,
}

impl Identity {
    pub async fn client(&self, cp: &ControlPlane) -> Result<kube::Client> {
        cp.client_for_token(&self.token, &self.user).await
    }
}

impl ControlPlane {
    /// Creates (or reuses) ServiceAccount `namespace/name`, binds `grants` to it, and mints
    /// a token valid for a day. Roles themselves are the caller's to create.
    pub async fn identity(&self, namespace: &str, name: &str, grants: &[Grant]) -> Result<Identity> {
        let client = self.client().await?;
        let apply = PatchParams::apply("controlplane-harness").force();
        let ns = Namespace {
            metadata: ObjectMeta { name: Some(namespace.into()), ..Default::default() },
            ..Default::default()
        };
        Api::<Namespace>::all(client.clone()).patch(namespace, &apply, &Patch::Apply(&ns)).await?;
        let sa = ServiceAccount {
            metadata: ObjectMeta { name: Some(name.into()), namespace: Some(namespace.into()), ..Default::default() },
            ..Default::default()
        };
        let accounts = Api::<ServiceAccount>::namespaced(client.clone(), namespace);
        accounts.patch(name, &apply, &Patch::Apply(&sa)).await?;
        let subject = Subject {
            kind: "ServiceAccount".into(),
            name: name.into(),
            namespace: Some(namespace.into()),
            ..Default::default()
        };
        for grant in grants {
            let (role_kind, role_name, binding_ns) = match grant {
                Grant::ClusterRole(role) => ("ClusterRole", role, None),
                Grant::Role { namespace, name } => ("Role", name, Some(namespace)),
            };
            let binding_name = format!("{namespace}-{name}-{role_name}");
            let metadata =
                ObjectMeta { name: Some(binding_name.clone()), namespace: binding_ns.cloned(), ..Default::default() };
            let role_ref = RoleRef {
                api_group: Some("rbac.authorization.k8s.io".into()),
                kind: role_kind.into(),
                name: role_name.clone(),
            };
            match binding_ns {
                None => {
                    let binding = ClusterRoleBinding { metadata, role_ref, subjects: Some(vec![subject.clone()]) };
                    Api::<ClusterRoleBinding>::all(client.clone())
                        .patch(&binding_name, &apply, &Patch::Apply(&binding))
                        .await?;
                }
                Some(ns) => {
                    let binding = RoleBinding { metadata, role_ref, subjects: Some(vec![subject.clone()]) };
                    Api::<RoleBinding>::namespaced(client.clone(), ns)
                        .patch(&binding_name, &apply, &Patch::Apply(&binding))
                        .await?;
                }
            }
        }
        let request = TokenRequest {
            spec: Some(TokenRequestSpec { expiration_seconds: Some(86_400), ..Default::default() }),
            ..Default::default()
        };
        let token = accounts
            .create_token_request(name, &PostParams::default(), &request)
            .await
            .context("TokenRequest")?
            .status
            .context("TokenRequest returned no status")?
            .token
            .context("TokenRequest returned no token")?;
        let user = format!("system:serviceaccount:{namespace}:{name}");
        let kubeconfig_path = self.dir.join(format!("{namespace}-{name}.kubeconfig"));
        std::fs::write(&kubeconfig_path, self.kubeconfig_yaml(&token, &user))?;
        Ok(Identity { user, token, kubeconfig_path })
    }
}

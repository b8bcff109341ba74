//! The objects an ApplicationTrafficPolicy asks for, computed from its spec alone.
//!
//! Pure functions: no client, no clock. Each child has the policy's name, a controller
//! owner reference to it, and our labels. Fields the API server would default are set
//! explicitly, so what we apply is what the server stores.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::ConfigMap;
use k8s_openapi::api::networking::v1::{
    IPBlock, NetworkPolicy, NetworkPolicyEgressRule, NetworkPolicyIngressRule, NetworkPolicyPeer, NetworkPolicyPort,
    NetworkPolicySpec,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, OwnerReference};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use kube::api::ObjectMeta;
use kube::{Resource, ResourceExt};
use serde::Serialize;

use crate::api::{ApplicationTrafficPolicy, LabelMap, Peer, PortRule, Protocol, RateLimit};

/// Marks every object this operator writes; child watches select on it.
pub const MANAGED_BY_LABEL: &str = "app.kubernetes.io/managed-by";
pub const MANAGED_BY_VALUE: &str = "traffic-policy-operator";
/// Names the policy a child belongs to.
pub const POLICY_LABEL: &str = "trafficpolicy.dev/policy";
/// The ConfigMap key holding the gateway's rate-limit document.
pub const RATE_LIMIT_KEY: &str = "ratelimit.json";

/// The metadata every child carries.
pub(crate) fn child_meta(policy: &ApplicationTrafficPolicy, extra_labels: &BTreeMap<String, String>) -> ObjectMeta {
    let mut labels = extra_labels.clone();
    labels.insert(MANAGED_BY_LABEL.into(), MANAGED_BY_VALUE.into());
    labels.insert(POLICY_LABEL.into(), truncate_label(&policy.name_any()));
    ObjectMeta {
        name: Some(policy.name_any()),
        namespace: policy.namespace(),
        labels: Some(labels),
        owner_references: Some(vec![owner_reference(policy)]),
        ..Default::default()
    }
}

/// A controller reference; GC deletes the child with its owner.
pub fn owner_reference(policy: &ApplicationTrafficPolicy) -> OwnerReference {
    OwnerReference {
        api_version: ApplicationTrafficPolicy::api_version(&()).into_owned(),
        kind: ApplicationTrafficPolicy::kind(&()).into_owned(),
        name: policy.name_any(),
        uid: policy.uid().unwrap_or_default(),
        controller: Some(true),
        block_owner_deletion: None,
    }
}

/// Label values are at most 63 characters; object names may be longer.
fn truncate_label(value: &str) -> String {
    value.chars().take(63).collect::<String>().trim_end_matches(['-', '.', '_']).to_string()
}

pub fn network_policy(policy: &ApplicationTrafficPolicy, extra_labels: &BTreeMap<String, String>) -> NetworkPolicy {
    let spec = &policy.spec;
    NetworkPolicy {
        metadata: child_meta(policy, extra_labels),
        spec: Some(NetworkPolicySpec {
            pod_selector: Some(LabelSelector {
                match_labels: Some(spec.application_selector.match_labels.to_btree()),
                match_expressions: None,
            }),
            // Both types, always: a policy with no rules of a kind denies that direction.
            policy_types: Some(vec!["Ingress".into(), "Egress".into()]),
            ingress: non_empty(
                spec.ingress_rules
                    .iter()
                    .map(|rule| NetworkPolicyIngressRule { from: peers(&rule.from), ports: ports(&rule.ports) }),
            ),
            egress: non_empty(
                spec.egress_rules
                    .iter()
                    .map(|rule| NetworkPolicyEgressRule { to: peers(&rule.to), ports: ports(&rule.ports) }),
            ),
        }),
    }
}

fn peers(peers: &[Peer]) -> Option<Vec<NetworkPolicyPeer>> {
    non_empty(peers.iter().map(|peer| NetworkPolicyPeer {
        ip_block: Some(IPBlock {
            cidr: peer.ip_block.cidr.0.clone(),
            except: non_empty(peer.ip_block.except.iter().map(|c| c.0.clone())),
        }),
        ..Default::default()
    }))
}

fn ports(ports: &[PortRule]) -> Option<Vec<NetworkPolicyPort>> {
    non_empty(ports.iter().map(|p| NetworkPolicyPort {
        protocol: Some(network_protocol(p.protocol).into()),
        port: Some(IntOrString::Int(p.port)),
        end_port: None,
    }))
}

/// NetworkPolicies know transports only; HTTP runs over TCP.
pub fn network_protocol(protocol: Protocol) -> &'static str {
    match protocol {
        Protocol::Tcp | Protocol::Http => "TCP",
        Protocol::Udp => "UDP",
        Protocol::Sctp => "SCTP",
    }
}

fn non_empty<T>(items: impl Iterator<Item = T>) -> Option<Vec<T>> {
    Some(items.collect::<Vec<_>>()).filter(|v| !v.is_empty())
}

/// The gateway's view of one policy; documented in docs/gateway-ratelimit.md.
#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct RateLimitDocument<'a> {
    version: u32,
    policy: String,
    pod_selector: &'a LabelMap,
    /// `null` means unlimited.
    rate_limit: Option<&'a RateLimit>,
}

pub fn rate_limit_config_map(policy: &ApplicationTrafficPolicy, extra_labels: &BTreeMap<String, String>) -> ConfigMap {
    let document = RateLimitDocument {
        version: 1,
        policy: format!("{}/{}", policy.namespace().unwrap_or_default(), policy.name_any()),
        pod_selector: &policy.spec.application_selector.match_labels,
        rate_limit: policy.spec.rate_limit.as_ref(),
    };
    let json = serde_json::to_string_pretty(&document).expect("the document serializes");
    ConfigMap {
        metadata: child_meta(policy, extra_labels),
        data: Some(BTreeMap::from([(RATE_LIMIT_KEY.to_string(), json)])),
        ..Default::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::{ApplicationSelector, ApplicationTrafficPolicySpec, Cidr, EgressRule, IngressRule, IpBlock};

    fn policy(spec: ApplicationTrafficPolicySpec) -> ApplicationTrafficPolicy {
        let mut p = ApplicationTrafficPolicy::new("web", spec);
        p.metadata.namespace = Some("shop".into());
        p.metadata.uid = Some("uid-1".into());
        p
    }

    fn selector() -> ApplicationSelector {
        ApplicationSelector { match_labels: [("app", "web")].into_iter().collect() }
    }

    fn block(cidr: &str, except: &[&str]) -> Peer {
        Peer {
            ip_block: IpBlock { cidr: Cidr(cidr.into()), except: except.iter().map(|s| Cidr(s.to_string())).collect() },
        }
    }

    #[test]
    fn translates_rules_and_maps_http_to_tcp() {
        let p = policy(ApplicationTrafficPolicySpec {
            application_selector: selector(),
            ingress_rules: vec![IngressRule {
                from: vec![block("10.0.0.0/8", &["10.1.0.0/16"])],
                ports: vec![
                    PortRule { protocol: Protocol::Http, port: 8080 },
                    PortRule { protocol: Protocol::Udp, port: 53 },
                ],
            }],
            egress_rules: vec![EgressRule { to: vec![], ports: vec![PortRule { protocol: Protocol::Sctp, port: 9 }] }],
            rate_limit: None,
            gateway: None,
        });
        let np = network_policy(&p, &BTreeMap::new());
        let spec = np.spec.unwrap();
        assert_eq!(spec.pod_selector.unwrap().match_labels.unwrap()["app"], "web");
        assert_eq!(spec.policy_types.unwrap(), ["Ingress", "Egress"]);
        let ingress = &spec.ingress.unwrap()[0];
        let from = ingress.from.as_ref().unwrap()[0].ip_block.as_ref().unwrap();
        assert_eq!(from.cidr, "10.0.0.0/8");
        assert_eq!(from.except.as_deref(), Some(&["10.1.0.0/16".to_string()][..]));
        let ports = ingress.ports.as_ref().unwrap();
        assert_eq!(ports[0].protocol.as_deref(), Some("TCP"));
        assert_eq!(ports[0].port, Some(IntOrString::Int(8080)));
        assert_eq!(ports[1].protocol.as_deref(), Some("UDP"));
        let egress = &spec.egress.unwrap()[0];
        assert!(egress.to.is_none(), "no peers means anywhere, as an absent list");
        assert_eq!(egress.ports.as_ref().unwrap()[0].protocol.as_deref(), Some("SCTP"));
    }

    #[test]
    fn no_rules_denies_both_directions() {
        let p = policy(ApplicationTrafficPolicySpec {
            application_selector: selector(),
            ingress_rules: vec![],
            egress_rules: vec![],
            rate_limit: None,
            gateway: None,
        });
        let spec = network_policy(&p, &BTreeMap::new()).spec.unwrap();
        assert!(spec.ingress.is_none() && spec.egress.is_none());
        assert_eq!(spec.policy_types.unwrap().len(), 2);
    }

    #[test]
    fn children_are_owned_and_labelled() {
        let p = policy(ApplicationTrafficPolicySpec {
            application_selector: selector(),
            ingress_rules: vec![],
            egress_rules: vec![],
            rate_limit: Some(RateLimit { requests_per_second: 100, burst: 20 }),
            gateway: None,
        });
        let extra = BTreeMap::from([("extra".to_string(), "1".to_string())]);
        let cm = rate_limit_config_map(&p, &extra);
        let owner = &cm.metadata.owner_references.as_ref().unwrap()[0];
        assert_eq!(
            (owner.kind.as_str(), owner.uid.as_str(), owner.controller),
            ("ApplicationTrafficPolicy", "uid-1", Some(true))
        );
        let labels = cm.metadata.labels.unwrap();
        assert_eq!(labels[MANAGED_BY_LABEL], MANAGED_BY_VALUE);
        assert_eq!(labels[POLICY_LABEL], "web");
        assert_eq!(labels["extra"], "1");
        let doc: serde_json::Value = serde_json::from_str(&cm.data.unwrap()[RATE_LIMIT_KEY]).unwrap();
        assert_eq!(doc["policy"], "shop/web");
        assert_eq!(doc["podSelector"]["app"], "web");
        assert_eq!(doc["rateLimit"]["requestsPerSecond"], 100);
        assert_eq!(doc["rateLimit"]["burst"], 20);
    }

    #[test]
    fn unlimited_when_no_rate_limit() {
        let p = policy(ApplicationTrafficPolicySpec {
            application_selector: selector(),
            ingress_rules: vec![],
            egress_rules: vec![],
            rate_limit: None,
            gateway: None,
        });
        let doc: serde_json::Value =
            serde_json::from_str(&rate_limit_config_map(&p, &BTreeMap::new()).data.unwrap()[RATE_LIMIT_KEY]).unwrap();
        assert!(doc["rateLimit"].is_null());
    }

    #[test]
    fn long_names_give_valid_label_values() {
        let long = format!("{}-x", "a".repeat(62));
        assert_eq!(truncate_label(&long), "a".repeat(62));
        assert!(truncate_label(&"b".repeat(200)).len() <= 63);
    }
}

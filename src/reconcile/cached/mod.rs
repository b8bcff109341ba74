//! What the cache keeps of a policy: a compact, typed copy of what the reconcile reads.
//!
//! The cache holds one per policy, so its size is the operator's memory per policy. The
//! whole object spends 360 bytes on `ObjectMeta` alone and a `String` on every field; this
//! copy keeps the uid as 16 bytes and the resourceVersion as 8, CIDRs as addresses, and
//! texts many policies share (label keys, condition types, reasons and messages) once.
//! The name and namespace are the cache's key, so they are not kept twice.
//!
//! [`CachedPolicy::to_policy`] gives the policy back as the reconcile reads it: the same
//! spec and status, field for field, and the metadata it reads (name, namespace, uid,
//! generation, resourceVersion). A unit test holds the two forms equal. Labels are not
//! kept: the bucket a policy's labels may route it to is kept with it by the cache.

use std::num::NonZeroI64;
use std::sync::Arc;

use kube::api::ObjectMeta;

mod text;

use crate::api::{
    ApplicationSelector, ApplicationTrafficPolicy, ApplicationTrafficPolicySpec, ApplicationTrafficPolicyStatus, Cidr,
    Condition, EgressRule, GatewayRouting, IngressRule, IpBlock, Peer, PortRule, RateLimit, Time,
};
use crate::runtime::ObjectKey;
use crate::runtime::stored::Stored;
use text::{CidrRange, Shared, Token};

/// A policy as the cache keeps it: about 620 bytes with its key, against 1,300 for the
/// object trimmed of managed fields and last-applied (`loadtest cache-bytes`).
#[derive(Clone, Debug, PartialEq)]
pub struct CachedPolicy {
    uid: Option<Token>,
    resource_version: Option<Token>,
    /// The API server starts generations at 1, so 0 is `None`, and the option costs nothing.
    generation: Option<NonZeroI64>,
    spec: Spec,
    status: Option<Status>,
}

#[derive(Clone, Debug, PartialEq)]
struct Spec {
    selector: Box<[(Arc<str>, Box<str>)]>,
    ingress: Box<[Rule]>,
    egress: Box<[Rule]>,
    rate_limit: Option<RateLimit>,
    /// Rare, so boxed: eight bytes for the policies without one.
    gateway: Option<Box<GatewayRouting>>,
}

/// An ingress or egress rule: its peers (`from` or `to`) and ports.
#[derive(Clone, Debug, PartialEq)]
struct Rule {
    peers: Box<[Block]>,
    ports: Box<[PortRule]>,
}

#[derive(Clone, Debug, PartialEq)]
struct Block {
    cidr: CidrRange,
    except: Box<[CidrRange]>,
}

#[derive(Clone, Debug, PartialEq)]
struct Status {
    observed_generation: Option<i64>,
    conditions: Box<[CachedCondition]>,
    shard_epoch: Option<u64>,
}

#[derive(Clone, Debug, PartialEq)]
struct CachedCondition {
    texts: Arc<ConditionTexts>,
    last_transition_time: Time,
    observed_generation: Option<i64>,
}

/// What a condition says: the same for most policies, so held once (see [`CONDITIONS`]).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
struct ConditionTexts {
    type_: String,
    status: String,
    reason: String,
    message: String,
}

static LABEL_KEYS: Shared<str> = Shared::new();
static CONDITIONS: Shared<ConditionTexts> = Shared::new();

impl CachedPolicy {
    pub fn new(policy: &ApplicationTrafficPolicy) -> Self {
        let meta = &policy.metadata;
        Self {
            uid: meta.uid.as_deref().map(Token::new),
            resource_version: meta.resource_version.as_deref().map(Token::new),
            generation: meta.generation.and_then(NonZeroI64::new),
            spec: Spec::new(&policy.spec),
            status: policy.status.as_ref().map(Status::new),
        }
    }

    /// The policy of `key`, as the reconcile reads it.
    pub fn to_policy(&self, key: &ObjectKey) -> ApplicationTrafficPolicy {
        let metadata = ObjectMeta {
            name: Some(key.name().into()),
            namespace: Some(key.namespace().into()),
            uid: self.uid.as_ref().map(Token::to_string),
            resource_version: self.resource_version.as_ref().map(Token::to_string),
            generation: self.generation(),
            ..Default::default()
        };
        ApplicationTrafficPolicy {
            metadata,
            spec: self.spec.to_spec(),
            status: self.status.as_ref().map(Status::to_status),
        }
    }

    /// The Ready condition's `(status, reason, observedGeneration)`, if there is one.
    pub fn ready(&self) -> Option<(&str, &str, Option<i64>)> {
        let conditions = self.status.as_ref().map_or(&[][..], |status| &status.conditions[..]);
        let ready = conditions.iter().find(|c| c.texts.type_ == super::status::READY)?;
        Some((&ready.texts.status, &ready.texts.reason, ready.observed_generation))
    }
}

impl Stored for CachedPolicy {
    type Object = ApplicationTrafficPolicy;

    fn store(object: &ApplicationTrafficPolicy) -> Self {
        Self::new(object)
    }

    fn has_uid(&self, uid: Option<&str>) -> bool {
        match (&self.uid, uid) {
            (Some(cached), Some(uid)) => cached.is(uid),
            (None, None) => true,
            _ => false,
        }
    }

    fn generation(&self) -> Option<i64> {
        self.generation.map(NonZeroI64::get)
    }

    fn is_version(&self, resource_version: Option<&str>) -> bool {
        self.resource_version.as_ref().zip(resource_version).is_some_and(|(cached, other)| cached.is(other))
    }

    /// Edited since the status was written, or since it was created if it has none: a
    /// policy edited while its bucket moved, or while the operator was down.
    fn shows_unobserved_change(policy: &ApplicationTrafficPolicy) -> bool {
        let observed = policy.status.as_ref().and_then(|status| status.observed_generation).unwrap_or(1);
        policy.metadata.generation.is_some_and(|generation| generation > observed)
    }
}

impl Spec {
    fn new(spec: &ApplicationTrafficPolicySpec) -> Self {
        let selector = spec
            .application_selector
            .match_labels
            .iter()
            .map(|(k, v)| (LABEL_KEYS.get(k, || k.into()), v.into()))
            .collect();
        Self {
            selector,
            ingress: spec.ingress_rules.iter().map(|rule| Rule::new(&rule.from, &rule.ports)).collect(),
            egress: spec.egress_rules.iter().map(|rule| Rule::new(&rule.to, &rule.ports)).collect(),
            rate_limit: spec.rate_limit.clone(),
            gateway: spec.gateway.clone().map(Box::new),
        }
    }

    fn to_spec(&self) -> ApplicationTrafficPolicySpec {
        let match_labels = self.selector.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        ApplicationTrafficPolicySpec {
            application_selector: ApplicationSelector { match_labels },
            ingress_rules: self
                .ingress
                .iter()
                .map(|r| IngressRule { from: r.to_peers(), ports: r.ports.to_vec() })
                .collect(),
            egress_rules: self
                .egress
                .iter()
                .map(|r| EgressRule { to: r.to_peers(), ports: r.ports.to_vec() })
                .collect(),
            rate_limit: self.rate_limit.clone(),
            gateway: self.gateway.as_deref().cloned(),
        }
    }
}

impl Rule {
    fn new(peers: &[Peer], ports: &[PortRule]) -> Self {
        let peers = peers
            .iter()
            .map(|peer| Block {
                cidr: CidrRange::new(&peer.ip_block.cidr.0),
                except: peer.ip_block.except.iter().map(|cidr| CidrRange::new(&cidr.0)).collect(),
            })
            .collect();
        Self { peers, ports: ports.into() }
    }

    fn to_peers(&self) -> Vec<Peer> {
        let cidr = |range: &CidrRange| Cidr(range.to_string());
        self.peers
            .iter()
            .map(|block| Peer {
                ip_block: IpBlock { cidr: cidr(&block.cidr), except: block.except.iter().map(cidr).collect() },
            })
            .collect()
    }
}

impl Status {
    fn new(status: &ApplicationTrafficPolicyStatus) -> Self {
        let conditions = status
            .conditions
            .iter()
            .map(|c| CachedCondition {
                texts: {
                    let texts = ConditionTexts {
                        type_: c.type_.clone(),
                        status: c.status.clone(),
                        reason: c.reason.clone(),
                        message: c.message.clone(),
                    };
                    CONDITIONS.get(&texts, || Arc::new(texts.clone()))
                },
                last_transition_time: c.last_transition_time.clone(),
                observed_generation: c.observed_generation,
            })
            .collect();
        Self { observed_generation: status.observed_generation, conditions, shard_epoch: status.shard_epoch }
    }

    fn to_status(&self) -> ApplicationTrafficPolicyStatus {
        let conditions = self
            .conditions
            .iter()
            .map(|c| Condition {
                type_: c.texts.type_.clone(),
                status: c.texts.status.clone(),
                reason: c.texts.reason.clone(),
                message: c.texts.message.clone(),
                last_transition_time: c.last_transition_time.clone(),
                observed_generation: c.observed_generation,
            })
            .collect();
        ApplicationTrafficPolicyStatus {
            observed_generation: self.observed_generation,
            conditions,
            shard_epoch: self.shard_epoch,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::Protocol;

    fn policy() -> ApplicationTrafficPolicy {
        let spec: ApplicationTrafficPolicySpec = serde_json::from_value(serde_json::json!({
            "applicationSelector": { "matchLabels": { "app": "shop", "tier": "web" } },
            "ingressRules": [
                { "from": [{ "ipBlock": { "cidr": "10.0.0.0/8", "except": ["10.1.0.0/16", "10.2.3.4/32"] } },
                           { "ipBlock": { "cidr": "fd00::/8" } }],
                  "ports": [{ "protocol": "HTTP", "port": 8080 }, { "port": 443 }] },
                { "ports": [{ "protocol": "SCTP", "port": 9 }] }
            ],
            "egressRules": [{ "to": [{ "ipBlock": { "cidr": "10.0.0.1/8" } }, { "ipBlock": { "cidr": "::ffff:10.0.0.0/104" } }] }],
            "rateLimit": { "requestsPerSecond": 100, "burst": 20 },
            "gateway": { "parentRef": { "name": "edge", "sectionName": "web" }, "hostnames": ["shop.example.com"],
                         "paths": [{ "type": "Exact", "value": "/api" }], "backendRef": { "name": "web", "port": 80 } }
        }))
        .unwrap();
        let mut policy = ApplicationTrafficPolicy::new("web", spec);
        let meta = &mut policy.metadata;
        meta.namespace = Some("shop".into());
        meta.uid = Some("0b6e2a8c-4f0e-4d55-9a3b-8d1f0c2e7a91".into());
        meta.resource_version = Some("123456".into());
        meta.generation = Some(3);
        let status = serde_json::json!({ "observedGeneration": 3, "shardEpoch": 7, "conditions": [
            { "type": "Ready", "status": "True", "reason": "Applied", "message": "in place",
              "lastTransitionTime": "2026-01-01T00:00:00Z", "observedGeneration": 3 },
            { "type": "Audited", "status": "Unknown", "reason": "Pending", "message": "",
              "lastTransitionTime": "2026-01-02T00:00:00Z" }
        ] });
        policy.status = Some(serde_json::from_value(status).unwrap());
        policy
    }

    /// Equal in every field, as the API server would see them.
    fn assert_same(got: ApplicationTrafficPolicy, want: ApplicationTrafficPolicy) {
        assert_eq!(serde_json::to_value(got).unwrap(), serde_json::to_value(want).unwrap());
    }

    fn key() -> ObjectKey {
        ObjectKey::new("shop", "web")
    }

    #[test]
    fn an_edit_the_status_has_not_observed_is_no_backlog() {
        let with = |generation: i64, observed: Option<i64>| {
            let mut policy = policy();
            policy.metadata.generation = Some(generation);
            policy.status =
                observed.map(|g| ApplicationTrafficPolicyStatus { observed_generation: Some(g), ..Default::default() });
            CachedPolicy::shows_unobserved_change(&policy)
        };
        assert!(!with(3, Some(3)), "reconciled as it is");
        assert!(with(4, Some(3)), "edited since its status was written");
        assert!(!with(1, None), "created, never reconciled: backlog");
        assert!(with(2, None), "edited before its first reconcile");
    }

    #[test]
    fn gives_back_the_policy_the_reconcile_reads() {
        let mut original = policy();
        original.metadata.annotations = Some([("note".to_string(), "dropped".to_string())].into());
        original.metadata.labels = Some([("team".to_string(), "dropped".to_string())].into());
        original.metadata.managed_fields = Some(vec![Default::default()]);
        assert_same(CachedPolicy::new(&original).to_policy(&key()), policy());
    }

    #[test]
    fn keeps_odd_texts_as_they_are() {
        let mut original = policy();
        original.metadata.uid = Some("not-a-UUID".into());
        original.metadata.resource_version = Some("0042".into());
        original.spec.egress_rules[0].to[0].ip_block.cidr = Cidr("010.0.0.0/8".into());
        original.spec.egress_rules[0].ports = vec![PortRule { protocol: Protocol::Udp, port: 53 }];
        assert_same(CachedPolicy::new(&original).to_policy(&key()), original.clone());
        let without_status = ApplicationTrafficPolicy { status: None, ..original };
        assert_same(CachedPolicy::new(&without_status).to_policy(&key()), without_status);
    }

    #[test]
    fn compares_as_the_runtime_needs() {
        let cached = CachedPolicy::new(&policy());
        assert!(cached.has_uid(Some("0b6e2a8c-4f0e-4d55-9a3b-8d1f0c2e7a91")));
        assert!(!cached.has_uid(Some("0b6e2a8c-4f0e-4d55-9a3b-8d1f0c2e7a92")) && !cached.has_uid(None));
        assert!(cached.is_version(Some("123456")));
        assert!(!cached.is_version(Some("1234567")) && !cached.is_version(None));
        assert_eq!(cached.generation(), Some(3));
        assert_eq!(cached.ready(), Some(("True", "Applied", Some(3))));
    }

    #[test]
    fn shares_texts_between_policies() {
        let (a, b) = (CachedPolicy::new(&policy()), CachedPolicy::new(&policy()));
        let message = |p: &CachedPolicy| p.status.as_ref().unwrap().conditions[0].texts.clone();
        assert!(Arc::ptr_eq(&message(&a), &message(&b)));
        assert!(Arc::ptr_eq(&a.spec.selector[0].0, &b.spec.selector[0].0));
    }

    #[test]
    fn fits_the_192_byte_size_class() {
        // The struct itself, in its `Arc`; the spec's and status's parts are allocated apart.
        let arc = 2 * size_of::<usize>() + size_of::<CachedPolicy>();
        assert!(arc <= 192, "Arc<CachedPolicy> takes {arc} bytes");
    }

    #[test]
    fn is_cached_with_its_bucket_and_kept_by_a_relist() {
        use crate::runtime::cache;
        use crate::runtime::parts::Slicing;
        use kube::runtime::watcher::Event;

        // The bucket comes from a label, which the compact copy does not keep: the cache keeps
        // it beside the copy, as the slicing read it from the whole object.
        const LABEL: &str = "example.com/bucket";
        let from_label = |meta: &ObjectMeta| meta.labels.as_ref()?.get(LABEL)?.parse().ok();
        let slicing = Slicing::new(from_label, |_| 0, |_| None);
        let scope = slicing.scope(Arc::new([7].into()));
        let mut labelled = policy();
        labelled.metadata.labels = Some([(LABEL.to_string(), "7".to_string())].into());
        let (cache, mut writer) = cache::new::<CachedPolicy>();
        writer.apply(0, &scope, &Event::Apply(labelled.clone()));
        let entry = cache.entry(&key()).unwrap();
        assert_eq!(entry.bucket, Some(7), "the bucket as the slicing saw it");
        writer.apply(0, &scope, &Event::Init);
        writer.apply(0, &scope, &Event::InitApply(labelled.clone()));
        writer.apply(0, &scope, &Event::InitDone);
        assert!(Arc::ptr_eq(&entry.object, &cache.get(&key()).unwrap()), "a relist keeps what it finds unchanged");
    }
}

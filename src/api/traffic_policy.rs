use std::borrow::Cow;

pub use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use kube::CustomResource;
use schemars::{JsonSchema, Schema, SchemaGenerator, json_schema};
use serde::{Deserialize, Serialize};

use super::LabelMap;

/// Declares the network access and the gateway rate limit of one application.
///
/// The operator turns it into a NetworkPolicy and a rate-limit ConfigMap of the same name.
#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[kube(
    group = "trafficpolicy.dev",
    version = "v1",
    kind = "ApplicationTrafficPolicy",
    plural = "applicationtrafficpolicies",
    shortname = "atp",
    namespaced,
    doc = "An application's allowed network traffic and gateway rate limit, turned into a NetworkPolicy and a rate-limit ConfigMap.",
    status = "ApplicationTrafficPolicyStatus",
    printcolumn = r#"{"name":"Ready","type":"string","jsonPath":".status.conditions[?(@.type==\"Ready\")].status"}"#,
    printcolumn = r#"{"name":"Reason","type":"string","jsonPath":".status.conditions[?(@.type==\"Ready\")].reason"}"#,
    printcolumn = r#"{"name":"Age","type":"date","jsonPath":".metadata.creationTimestamp"}"#,
    printcolumn = r#"{"name":"Message","type":"string","priority":1,"jsonPath":".status.conditions[?(@.type==\"Ready\")].message"}"#,
    category = "trafficpolicy"
)]
#[serde(rename_all = "camelCase")]
pub struct ApplicationTrafficPolicySpec {
    /// Selects the application's pods: the policy applies to pods carrying all these labels.
    pub application_selector: ApplicationSelector,
    /// Traffic allowed into the application. No rules means no ingress is allowed.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 32))]
    pub ingress_rules: Vec<IngressRule>,
    /// Traffic allowed out of the application. No rules means no egress is allowed.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 32))]
    pub egress_rules: Vec<EgressRule>,
    /// The gateway's request rate limit for the application. Absent means unlimited.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rate_limit: Option<RateLimit>,
    /// Which HTTP traffic the rate limit applies to, in Gateway API terms. Absent means the
    /// limit is published only in the rate-limit ConfigMap, for a gateway that reads it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gateway: Option<GatewayRouting>,
}

/// Selects pods by their labels.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ApplicationSelector {
    /// Labels the application's pods carry (1 to 16 entries); values are Kubernetes label values.
    #[schemars(schema_with = "match_labels_schema")]
    pub match_labels: LabelMap,
}

/// One set of allowed sources and ports.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct IngressRule {
    /// Sources allowed by this rule. Empty means from anywhere.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 16))]
    pub from: Vec<Peer>,
    /// Ports allowed by this rule. Empty means all ports.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 16))]
    pub ports: Vec<PortRule>,
}

/// One set of allowed destinations and ports.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct EgressRule {
    /// Destinations allowed by this rule. Empty means to anywhere.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 16))]
    pub to: Vec<Peer>,
    /// Ports allowed by this rule. Empty means all ports.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 16))]
    pub ports: Vec<PortRule>,
}

/// A network peer.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Peer {
    /// An IP address range.
    pub ip_block: IpBlock,
}

/// An IP range, minus some sub-ranges.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("x-kubernetes-validations" = [{
    "rule": "!has(self.except) || !isCIDR(self.cidr) || self.except.all(e, !isCIDR(e) || (cidr(self.cidr).containsCIDR(e) && cidr(e).prefixLength() > cidr(self.cidr).prefixLength()))",
    "message": "every except entry must be a CIDR strictly inside cidr",
    "fieldPath": ".except"
}]))]
pub struct IpBlock {
    /// The range, as a CIDR such as 10.0.0.0/8 or fd00::/8.
    pub cidr: Cidr,
    /// Sub-ranges of cidr to exclude, as CIDRs inside cidr.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 16))]
    pub except: Vec<Cidr>,
}

/// An IP range in CIDR notation, such as 10.0.0.0/8 or fd00::/8.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[serde(transparent)]
pub struct Cidr(pub String);

impl JsonSchema for Cidr {
    fn schema_name() -> Cow<'static, str> {
        "Cidr".into()
    }

    fn inline_schema() -> bool {
        true
    }

    fn json_schema(_: &mut SchemaGenerator) -> Schema {
        json_schema!({
            "type": "string",
            "description": "An IP range in CIDR notation, such as 10.0.0.0/8 or fd00::/8.",
            "maxLength": 43,
            "x-kubernetes-validations": [{
                "rule": "isCIDR(self)",
                "message": "must be a CIDR such as 10.0.0.0/8 or fd00::/8"
            }]
        })
    }
}

/// A port and its protocol.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct PortRule {
    /// The protocol: TCP, UDP, SCTP, or HTTP (enforced as TCP by the NetworkPolicy).
    #[serde(default)]
    pub protocol: Protocol,
    /// The port number, 1 to 65535.
    #[schemars(range(min = 1, max = 65535))]
    pub port: i32,
}

/// A transport protocol, or HTTP.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq, JsonSchema)]
pub enum Protocol {
    #[default]
    #[serde(rename = "TCP")]
    Tcp,
    #[serde(rename = "UDP")]
    Udp,
    #[serde(rename = "SCTP")]
    Sctp,
    #[serde(rename = "HTTP")]
    Http,
}

/// A token-bucket rate limit.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct RateLimit {
    /// Sustained requests per second, at least 1.
    #[schemars(range(min = 1, max = 1_000_000))]
    pub requests_per_second: i32,
    /// Extra requests allowed in a burst above the sustained rate, at least 0.
    #[serde(default)]
    #[schemars(range(min = 0, max = 1_000_000))]
    pub burst: i32,
}

/// The HTTP traffic a policy's limit applies to: existing HTTPRoutes, or a route the operator
/// generates under a Gateway (docs/gateways.md).
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("x-kubernetes-validations" = [
    {
        "rule": "has(self.httpRoutes) != has(self.parentRef)",
        "message": "set either httpRoutes (existing HTTPRoutes) or parentRef (a Gateway for a route the operator generates), not both"
    },
    {
        "rule": "!has(self.parentRef) || has(self.backendRef)",
        "message": "a generated route needs backendRef: the application's Service and port",
        "fieldPath": ".backendRef"
    },
    {
        "rule": "has(self.parentRef) || (!has(self.hostnames) && !has(self.paths) && !has(self.backendRef))",
        "message": "hostnames, paths and backendRef describe a generated route: set parentRef too, or name existing httpRoutes only"
    }
]))]
pub struct GatewayRouting {
    /// Existing HTTPRoutes in the policy's namespace that the limit applies to.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 16))]
    pub http_routes: Option<Vec<RouteRef>>,
    /// The Gateway under which the operator generates an HTTPRoute of the policy's name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parent_ref: Option<GatewayRef>,
    /// The generated route's hostnames. Empty means every hostname the listener accepts.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 16))]
    pub hostnames: Option<Vec<Hostname>>,
    /// The generated route's path matches. Empty means every path (prefix `/`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 16))]
    pub paths: Option<Vec<PathMatch>>,
    /// The application's Service, which the generated route sends traffic to.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub backend_ref: Option<BackendRef>,
}

/// An HTTPRoute in the policy's namespace.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
pub struct RouteRef {
    /// The HTTPRoute's name.
    #[schemars(length(min = 1, max = 253))]
    pub name: String,
}

/// A Gateway, by name.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct GatewayRef {
    /// The Gateway's name.
    #[schemars(length(min = 1, max = 253))]
    pub name: String,
    /// The Gateway's namespace; absent means the policy's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 63))]
    pub namespace: Option<String>,
    /// One listener of the Gateway, by name; absent means every listener that allows the route.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 253))]
    pub section_name: Option<String>,
}

/// A hostname as Gateway API spells it: a DNS name, optionally with a leading `*.` wildcard.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, JsonSchema)]
#[serde(transparent)]
pub struct Hostname(
    #[schemars(
        length(min = 1, max = 253),
        regex(pattern = r"^(\*\.)?[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
    )]
    pub String,
);

/// A path match of the generated route.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct PathMatch {
    /// How the path matches: `PathPrefix` (the default) or `Exact`.
    #[serde(default, rename = "type")]
    pub match_type: PathMatchType,
    /// The path, starting with `/`.
    #[schemars(length(min = 1, max = 1024), regex(pattern = r"^/[^\s?#]*$"))]
    pub value: String,
}

/// How a path matches.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq, JsonSchema)]
pub enum PathMatchType {
    #[default]
    PathPrefix,
    Exact,
}

/// A Service port in the policy's namespace.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
pub struct BackendRef {
    /// The Service's name.
    #[schemars(length(min = 1, max = 63))]
    pub name: String,
    /// The Service port, 1 to 65535.
    #[schemars(range(min = 1, max = 65535))]
    pub port: i32,
}

impl ApplicationTrafficPolicy {
    /// Whether the status says Ready=True for the policy's current generation.
    pub fn is_ready(&self) -> bool {
        self.status.as_ref().is_some_and(|s| {
            s.observed_generation == self.metadata.generation
                && s.conditions.iter().any(|c| c.type_ == "Ready" && c.status == ConditionStatus::True)
        })
    }
}

/// What the operator last did with the policy.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ApplicationTrafficPolicyStatus {
    /// The metadata.generation that the conditions describe.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// The policy's conditions (metav1.Condition, one per type); `Ready` says whether its
    /// objects are in place.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 8), extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["type"]))]
    pub conditions: Vec<Condition>,
    /// The fencing epoch of the replica that last wrote this status. A write carrying a
    /// lower one is refused when the fencing policy is installed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    // The API server knows int32 and int64 only ("uint64" draws a warning on every apply);
    // epochs stay far below 2^63.
    #[schemars(extend("format" = "int64"))]
    pub shard_epoch: Option<u64>,
}

/// The status of a condition, as metav1.Condition spells it in `status`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ConditionStatus {
    True,
    False,
    Unknown,
}

impl ConditionStatus {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::True => "True",
            Self::False => "False",
            Self::Unknown => "Unknown",
        }
    }
}

/// So that `condition.status == ConditionStatus::True` reads as it means.
impl PartialEq<ConditionStatus> for String {
    fn eq(&self, other: &ConditionStatus) -> bool {
        self == other.as_str()
    }
}

fn match_labels_schema(_: &mut SchemaGenerator) -> Schema {
    json_schema!({
        "type": "object",
        "description": "Labels the application's pods carry (1 to 16 entries); values are Kubernetes label values.",
        "minProperties": 1,
        "maxProperties": 16,
        // Keys are label keys: rejected at admission, naming the field, not found later.
        "x-kubernetes-validations": [{
            "rule": "self.all(k, !format.qualifiedName().validate(k).hasValue())",
            "messageExpression": "'label key ' + self.filter(k, format.qualifiedName().validate(k).hasValue())[0] + ' is not a valid label key: an optional DNS subdomain and /, then at most 63 characters: letters, digits, -, _ and ., starting and ending with a letter or digit'"
        }],
        "additionalProperties": {
            "type": "string",
            "maxLength": 63,
            "pattern": "^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$"
        }
    })
}

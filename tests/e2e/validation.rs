//! Bad input is refused by the API server itself, with a message that names the field.

use kube::api::{Api, DynamicObject, PostParams};
use kube::core::{ApiResource, GroupVersionKind};
use serde_json::{Value, json};

use crate::support::TestEnv;

fn valid_spec() -> Value {
    json!({
        "applicationSelector": { "matchLabels": { "app": "web" } },
        "ingressRules": [{ "from": [{ "ipBlock": { "cidr": "10.0.0.0/8", "except": ["10.1.0.0/16"] } }],
                           "ports": [{ "protocol": "TCP", "port": 80 }] }],
        "egressRules": [{ "to": [{ "ipBlock": { "cidr": "192.168.0.0/16" } }], "ports": [{ "port": 53 }] }],
        "rateLimit": { "requestsPerSecond": 10, "burst": 5 }
    })
}

/// Turns the valid spec into an invalid one.
type Breaker = Box<dyn Fn(&mut Value)>;

/// (what, how to break a valid spec, what the message must contain)
fn cases() -> Vec<(&'static str, Breaker, &'static str)> {
    vec![
        (
            "malformed CIDR",
            Box::new(|s| s["ingressRules"][0]["from"][0]["ipBlock"]["cidr"] = json!("10.0.0.0/33")),
            "spec.ingressRules[0].from[0].ipBlock.cidr: Invalid value: \"10.0.0.0/33\": must be a CIDR",
        ),
        (
            "not an IP at all",
            Box::new(|s| s["egressRules"][0]["to"][0]["ipBlock"]["cidr"] = json!("example.com")),
            "spec.egressRules[0].to[0].ipBlock.cidr: Invalid value: \"example.com\": must be a CIDR",
        ),
        (
            "except outside cidr",
            Box::new(|s| s["ingressRules"][0]["from"][0]["ipBlock"]["except"] = json!(["11.0.0.0/16"])),
            "spec.ingressRules[0].from[0].ipBlock.except: Invalid value: every except entry must be a CIDR strictly inside cidr",
        ),
        (
            "except equal to cidr",
            Box::new(|s| s["ingressRules"][0]["from"][0]["ipBlock"]["except"] = json!(["10.0.0.0/8"])),
            "spec.ingressRules[0].from[0].ipBlock.except: Invalid value: every except entry",
        ),
        (
            "malformed except",
            Box::new(|s| s["ingressRules"][0]["from"][0]["ipBlock"]["except"] = json!(["10.1.0.0/99"])),
            "spec.ingressRules[0].from[0].ipBlock.except[0]: Invalid value: \"10.1.0.0/99\": must be a CIDR",
        ),
        (
            "port 0",
            Box::new(|s| s["ingressRules"][0]["ports"][0]["port"] = json!(0)),
            "spec.ingressRules[0].ports[0].port: Invalid value: 0: spec.ingressRules[0].ports[0].port in body should be greater than or equal to 1",
        ),
        (
            "port 70000",
            Box::new(|s| s["egressRules"][0]["ports"][0]["port"] = json!(70000)),
            "spec.egressRules[0].ports[0].port: Invalid value: 70000: spec.egressRules[0].ports[0].port in body should be less than or equal to 65535",
        ),
        (
            "port as a name",
            Box::new(|s| s["ingressRules"][0]["ports"][0]["port"] = json!("http")),
            "spec.ingressRules[0].ports[0].port: Invalid value: \"string\": spec.ingressRules[0].ports[0].port in body must be of type integer",
        ),
        (
            "missing port",
            Box::new(|s| s["egressRules"][0]["ports"][0] = json!({ "protocol": "UDP" })),
            "spec.egressRules[0].ports[0].port: Required value",
        ),
        (
            "unknown protocol",
            Box::new(|s| s["ingressRules"][0]["ports"][0]["protocol"] = json!("ICMP")),
            "spec.ingressRules[0].ports[0].protocol: Unsupported value: \"ICMP\"",
        ),
        (
            "missing selector",
            Box::new(|s| {
                s.as_object_mut().unwrap().remove("applicationSelector");
            }),
            "spec.applicationSelector: Required value",
        ),
        (
            "selector without labels",
            Box::new(|s| s["applicationSelector"] = json!({})),
            "spec.applicationSelector.matchLabels: Required value",
        ),
        (
            "empty matchLabels",
            Box::new(|s| s["applicationSelector"]["matchLabels"] = json!({})),
            "spec.applicationSelector.matchLabels: Invalid value: 0: spec.applicationSelector.matchLabels in body should have at least 1 properties",
        ),
        (
            "over-long label value",
            Box::new(|s| s["applicationSelector"]["matchLabels"]["app"] = json!("x".repeat(64))),
            "spec.applicationSelector.matchLabels.app: Too long: may not be more than 63 bytes",
        ),
        (
            "label value with a space",
            Box::new(|s| s["applicationSelector"]["matchLabels"]["app"] = json!("my app")),
            "spec.applicationSelector.matchLabels.app in body should match",
        ),
        (
            "label key that is not a label key",
            Box::new(|s| s["applicationSelector"]["matchLabels"]["bad key!"] = json!("x")),
            "spec.applicationSelector.matchLabels: Invalid value: label key bad key! is not a valid label key",
        ),
        (
            "negative burst",
            Box::new(|s| s["rateLimit"]["burst"] = json!(-1)),
            "spec.rateLimit.burst: Invalid value: -1: spec.rateLimit.burst in body should be greater than or equal to 0",
        ),
        (
            "zero requests per second",
            Box::new(|s| s["rateLimit"]["requestsPerSecond"] = json!(0)),
            "spec.rateLimit.requestsPerSecond: Invalid value: 0: spec.rateLimit.requestsPerSecond in body should be greater than or equal to 1",
        ),
        (
            "rate limit without a rate",
            Box::new(|s| s["rateLimit"] = json!({ "burst": 3 })),
            "spec.rateLimit.requestsPerSecond: Required value",
        ),
        (
            "too many rules",
            Box::new(|s| s["ingressRules"] = Value::Array(vec![json!({}); 33])),
            "spec.ingressRules: Too many: 33: must have at most 32 items",
        ),
        (
            "too many ports",
            Box::new(|s| s["ingressRules"][0]["ports"] = Value::Array(vec![json!({ "port": 1 }); 17])),
            "spec.ingressRules[0].ports: Too many: 17: must have at most 16 items",
        ),
        (
            "peer without ipBlock",
            Box::new(|s| s["ingressRules"][0]["from"][0] = json!({})),
            "spec.ingressRules[0].from[0].ipBlock: Required value",
        ),
        (
            "both existing routes and a generated one",
            Box::new(|s| {
                s["gateway"] = json!({ "httpRoutes": [{ "name": "r" }], "parentRef": { "name": "edge" },
                                                 "backendRef": { "name": "web", "port": 80 } })
            }),
            "spec.gateway: Invalid value: set either httpRoutes (existing HTTPRoutes) or parentRef",
        ),
        (
            "a generated route without its backend",
            Box::new(|s| s["gateway"] = json!({ "parentRef": { "name": "edge" } })),
            "spec.gateway.backendRef: Invalid value: a generated route needs backendRef",
        ),
        (
            "route fields without a Gateway",
            Box::new(|s| s["gateway"] = json!({ "httpRoutes": [{ "name": "r" }], "hostnames": ["a.example.com"] })),
            "hostnames, paths and backendRef describe a generated route",
        ),
        (
            "a hostname with a port",
            Box::new(|s| {
                s["gateway"] = json!({ "parentRef": { "name": "edge" }, "hostnames": ["a.example.com:80"],
                                                 "backendRef": { "name": "web", "port": 80 } })
            }),
            "spec.gateway.hostnames[0]: Invalid value: \"a.example.com:80\": spec.gateway.hostnames[0] in body should match",
        ),
        (
            "a relative path",
            Box::new(|s| {
                s["gateway"] = json!({ "parentRef": { "name": "edge" }, "paths": [{ "value": "api" }],
                                                 "backendRef": { "name": "web", "port": 80 } })
            }),
            "spec.gateway.paths[0].value: Invalid value: \"api\": spec.gateway.paths[0].value in body should match",
        ),
    ]
}

/// Whether the server's `message` says `expected`, `<field>: Invalid value: "<value>": <why>`
/// (a CEL rule on an object shows no value). Older servers show the value's type instead
/// (`Invalid value: "string": <why>`) where a CEL rule fails: that form is accepted there.
fn says(message: &str, expected: &str, names_the_value: bool) -> bool {
    if message.contains(expected) {
        return true;
    }
    if names_the_value {
        return false;
    }
    let Some((field, rest)) = expected.split_once(": Invalid value: ") else { return false };
    let why = match rest.strip_prefix('"') {
        Some(quoted) => quoted.split_once("\": ").map_or(rest, |(_, why)| why),
        None => rest,
    };
    ["string", "object", "array", "integer"]
        .iter()
        .any(|type_name| message.contains(&format!("{field}: Invalid value: \"{type_name}\": {why}")))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn invalid_policies_are_rejected_with_the_field_named() {
    let env = TestEnv::new("e2e-validation").await;
    let resource = ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk("trafficpolicy.dev", "v1", "ApplicationTrafficPolicy"),
        "applicationtrafficpolicies",
    );
    let api: Api<DynamicObject> = Api::namespaced_with(env.client.clone(), &env.namespace, &resource);
    let create = |name: &str, spec: Value| {
        let object: DynamicObject = serde_json::from_value(json!({
            "apiVersion": "trafficpolicy.dev/v1", "kind": "ApplicationTrafficPolicy",
            "metadata": { "name": name }, "spec": spec
        }))
        .unwrap();
        let api = api.clone();
        async move { api.create(&PostParams { dry_run: true, ..Default::default() }, &object).await }
    };

    create("valid", valid_spec()).await.expect("the unbroken spec is valid");
    let cases = cases();
    assert!(cases.len() >= 15);
    let mut failures = Vec::new();
    let names_the_value = env.cp.release().names_the_invalid_value();
    for (what, break_it, expected) in &cases {
        let mut spec = valid_spec();
        break_it(&mut spec);
        match create("invalid", spec).await {
            Err(kube::Error::Api(status)) if status.code == 422 && says(&status.message, expected, names_the_value) => {
            }
            Err(kube::Error::Api(status)) => failures.push(format!("{what}: got {} {:?}", status.code, status.message)),
            other => failures.push(format!("{what}: accepted or odd error: {other:?}")),
        }
    }
    assert!(failures.is_empty(), "{} of {} cases failed:\n{}", failures.len(), cases.len(), failures.join("\n"));
}

/// Conditions are metav1.Conditions in a list keyed by type: a second condition of one type
/// and a time that is not RFC 3339 are refused, naming the field.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn conditions_are_keyed_by_type_and_times_are_checked() {
    use kube::api::{Patch, PatchParams};
    let env = TestEnv::new("e2e-conditions").await;
    let policies = env.api::<traffic_policy_operator::api::ApplicationTrafficPolicy>();
    let policy = serde_json::from_value(json!({
        "apiVersion": "trafficpolicy.dev/v1", "kind": "ApplicationTrafficPolicy",
        "metadata": { "name": "conditions" }, "spec": valid_spec()
    }))
    .unwrap();
    policies.create(&PostParams::default(), &policy).await.unwrap();
    let condition = |time: &str| json!({ "type": "Ready", "status": "True", "reason": "Applied", "message": "", "lastTransitionTime": time });
    let status = |conditions: Value| json!({ "status": { "conditions": conditions } });
    let refused = |result: kube::Result<_>| match result {
        Err(kube::Error::Api(status)) if status.code == 422 => status.message,
        other => panic!("expected a 422, got {other:?}"),
    };
    let twice = status(json!([condition("2026-01-01T00:00:00Z"), condition("2026-01-01T00:00:00Z")]));
    let message = refused(policies.patch_status("conditions", &PatchParams::default(), &Patch::Merge(&twice)).await);
    assert!(message.contains("status.conditions[1]: Duplicate value"), "{message}");
    let bad_time = status(json!([condition("yesterday")]));
    let message = refused(policies.patch_status("conditions", &PatchParams::default(), &Patch::Merge(&bad_time)).await);
    assert!(message.contains("status.conditions[0].lastTransitionTime"), "{message}");
    let good = status(json!([condition("2026-01-01T00:00:00Z")]));
    policies.patch_status("conditions", &PatchParams::default(), &Patch::Merge(&good)).await.unwrap();
}

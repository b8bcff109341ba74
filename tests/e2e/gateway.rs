//! The gateway half against a real gateway: Traefik v3 built from its Go module, run against
//! the test control plane, with backends in network namespaces of the test's own; and
//! Envoy Gateway's real CRDs, which must accept what the operator writes for it.

use std::time::{Duration, Instant};

use controlplane::gateway::{Backend, TRAEFIK_CONTROLLER, Traefik};
use k8s_openapi::api::core::v1::Service;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::ResourceExt;
use kube::api::{Api, DeleteParams, DynamicObject, Patch, PatchParams, PostParams};
use serde_json::{Value, json};
use traffic_policy_operator::api::{ApplicationTrafficPolicy, ConditionStatus};
use traffic_policy_operator::coordination::FENCE_ANNOTATION;
use traffic_policy_operator::reconcile::gateway::{self, Provider, objects};

use crate::support::{TestEnv, eventually, eventually_within, install_gateway_crds};

const HOST: &str = "shop.test";

fn dynamic(env: &TestEnv, resource: &kube::core::ApiResource) -> Api<DynamicObject> {
    Api::namespaced_with(env.client.clone(), &env.namespace, resource)
}

async fn create(api: &Api<DynamicObject>, object: Value) {
    let object: DynamicObject = serde_json::from_value(object).unwrap();
    api.create(&PostParams::default(), &object).await.unwrap();
}

/// A GatewayClass served by `controller` and a Gateway `edge` with one HTTP listener on `port`.
async fn gateway_with_class(env: &TestEnv, controller: &str, port: u16) {
    let class = format!("class-{}", env.namespace);
    let classes = Api::<DynamicObject>::all_with(env.client.clone(), &gateway::gateway_class());
    create(
        &classes,
        json!({ "apiVersion": "gateway.networking.k8s.io/v1", "kind": "GatewayClass",
        "metadata": { "name": class }, "spec": { "controllerName": controller } }),
    )
    .await;
    create(
        &dynamic(env, &gateway::gateway()),
        json!({ "apiVersion": "gateway.networking.k8s.io/v1", "kind": "Gateway",
        "metadata": { "name": "edge" },
        "spec": { "gatewayClassName": class, "listeners": [{ "name": "web", "port": port, "protocol": "HTTP",
            "allowedRoutes": { "namespaces": { "from": "Same" } } }] } }),
    )
    .await;
}

/// A Service `name` (port 80) whose one endpoint is `backend`: no selector, an EndpointSlice of its own.
async fn service_for(env: &TestEnv, name: &str, backend: &Backend) {
    let service: Service = serde_json::from_value(json!({ "metadata": { "name": name },
        "spec": { "ports": [{ "port": 80, "targetPort": backend.port, "protocol": "TCP" }] } }))
    .unwrap();
    env.api::<Service>().create(&PostParams::default(), &service).await.unwrap();
    let slice: EndpointSlice = serde_json::from_value(json!({
        "metadata": { "name": name, "labels": { "kubernetes.io/service-name": name } },
        "addressType": "IPv4",
        "endpoints": [{ "addresses": [backend.address.to_string()], "conditions": { "ready": true } }],
        "ports": [{ "port": backend.port, "protocol": "TCP" }]
    }))
    .unwrap();
    env.api::<EndpointSlice>().create(&PostParams::default(), &slice).await.unwrap();
}

fn policy(name: &str, gateway: Value, rate_limit: Option<(i32, i32)>) -> ApplicationTrafficPolicy {
    let mut spec = json!({ "applicationSelector": { "matchLabels": { "app": name } }, "gateway": gateway });
    if let Some((rps, burst)) = rate_limit {
        spec["rateLimit"] = json!({ "requestsPerSecond": rps, "burst": burst });
    }
    ApplicationTrafficPolicy::new(name, serde_json::from_value(spec).unwrap())
}

/// Waits until condition `type_` of `name` has `status` and `reason` for the policy's
/// generation; its message. On timeout, says what the conditions were.
async fn wait_condition(env: &TestEnv, name: &str, type_: &str, status: ConditionStatus, reason: &str) -> String {
    let api = env.api::<ApplicationTrafficPolicy>();
    let deadline = Instant::now() + crate::support::DEADLINE;
    loop {
        let policy = api.get(name).await.unwrap();
        let conditions = policy.status.map(|s| s.conditions).unwrap_or_default();
        if let Some(c) = conditions.iter().find(|c| {
            c.type_ == type_
                && c.status == status
                && c.reason == reason
                && c.observed_generation == policy.metadata.generation
        }) {
            return c.message.clone();
        }
        let seen: Vec<_> =
            conditions.iter().map(|c| format!("{}={} {}: {}", c.type_, c.status, c.reason, c.message)).collect();
        assert!(Instant::now() < deadline, "{name} never had {type_}={status:?} ({reason}); it has {seen:#?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Requests sent one after another for `window`: (answered 200, answered 429, anything else).
async fn send_for(traefik: &Traefik, path: &str, window: Duration) -> (u32, u32, u32) {
    let port = traefik.web_port;
    let path = path.to_string();
    tokio::task::spawn_blocking(move || {
        let (mut ok, mut limited, mut other) = (0, 0, 0);
        let end = Instant::now() + window;
        while Instant::now() < end {
            match controlplane::gateway::get(port, HOST, &path).map(|r| r.status) {
                Ok(200) => ok += 1,
                Ok(429) => limited += 1,
                _ => other += 1,
            }
        }
        (ok, limited, other)
    })
    .await
    .unwrap()
}

/// Lets a token bucket of `burst` at `rate` per second fill up again before a measured window:
/// the bucket's own physics, not a stand-in for a condition.
async fn refill(rate: i32, burst: i32) {
    tokio::time::sleep(Duration::from_secs_f64(burst.max(1) as f64 / rate as f64 + 0.5)).await;
}

fn assert_near(what: &str, got: u32, expected: f64) {
    let (low, high) = (expected * 0.9, expected * 1.1);
    assert!((low..=high).contains(&(got as f64)), "{what}: {got} accepted, expected {expected} ± 10 %");
}

#[tokio::test(flavor = "multi_thread")]
async fn traefik_enforces_the_limit_routes_by_path_and_follows_edits() {
    let env = TestEnv::new("gw-traefik").await;
    install_gateway_crds(&env.client).await;
    let (app_a, app_b) = tokio::task::spawn_blocking(|| {
        (Backend::start(&[("a/index.html", "app-a")]).unwrap(), Backend::start(&[("b/index.html", "app-b")]).unwrap())
    })
    .await
    .unwrap();
    let cp = env.cp;
    let namespace = env.namespace.clone();
    let traefik = tokio::task::spawn_blocking(move || Traefik::start(cp, &[&namespace], "traefik-gw-traefik").unwrap())
        .await
        .unwrap();
    gateway_with_class(&env, TRAEFIK_CONTROLLER, traefik.web_port).await;
    service_for(&env, "app-a", &app_a).await;
    service_for(&env, "app-b", &app_b).await;
    let _operator = env.start_operator(&[]).await;
    let policies = env.api::<ApplicationTrafficPolicy>();
    let routed = |app: &str| {
        json!({ "parentRef": { "name": "edge" }, "hostnames": [HOST], "paths": [{ "value": format!("/{app}") }],
                "backendRef": { "name": format!("app-{app}"), "port": 80 } })
    };
    let (rate, burst) = (20, 10);
    for p in [policy("app-a", routed("a"), Some((rate, burst))), policy("app-b", routed("b"), None)] {
        policies.create(&PostParams::default(), &p).await.unwrap();
    }
    let message = wait_condition(&env, "app-a", "RateLimitAccepted", ConditionStatus::True, "Accepted").await;
    assert!(message.contains("20 requests/s, burst 10"), "{message}");
    wait_condition(&env, "app-a", "RouteAccepted", ConditionStatus::True, "Accepted").await;
    wait_condition(&env, "app-b", "RouteAccepted", ConditionStatus::True, "Accepted").await;
    let ready = env.wait_ready("app-b", ConditionStatus::True).await;
    assert!(ready.status.unwrap().conditions.iter().all(|c| c.type_ != "RateLimitAccepted"), "no limit, no condition");

    // The HTTP rules route each path to its application, through the gateway.
    for (path, body) in [("/a/", "app-a"), ("/b/", "app-b")] {
        eventually(&format!("GET {path} reaches {body}"), || async {
            let r = traefik.get(HOST, path).ok()?;
            (r.status == 200 && r.body.contains(body)).then_some(())
        })
        .await;
    }

    // R·t + B requests pass in a window of t seconds; every other answer is 429.
    refill(rate, burst).await;
    let window = Duration::from_secs(4);
    let (ok, limited, other) = send_for(&traefik, "/a/", window).await;
    eprintln!("limit {rate}/s burst {burst}: {ok} accepted, {limited} limited, {other} other in {window:?}");
    assert_near("the first limit", ok, rate as f64 * 4.0 + burst as f64);
    assert!(limited > ok && other == 0, "{limited} answered 429, {other} otherwise");
    let (ok_b, limited_b, _) = send_for(&traefik, "/b/", Duration::from_secs(1)).await;
    assert!(
        limited_b == 0 && ok_b as f64 > 1.5 * (rate + burst) as f64,
        "app-b has no limit: {ok_b} ok, {limited_b} limited"
    );

    // An edit takes effect without a gateway restart; time it from the edit to enforcement.
    let new_rate = 60;
    let edited = Instant::now();
    let patch = json!({ "spec": { "rateLimit": { "requestsPerSecond": new_rate, "burst": burst } } });
    policies.patch("app-a", &PatchParams::default(), &Patch::Merge(&patch)).await.unwrap();
    let to_enforcement = eventually_within(Duration::from_secs(60), "the new limit is enforced", || async {
        let (ok, _, _) = send_for(&traefik, "/a/", Duration::from_secs(1)).await;
        // Between the two rates: the old one admits at most 20 + 10 in a second.
        (ok as f64 > (rate + burst) as f64 * 1.3).then(|| edited.elapsed())
    })
    .await;
    eprintln!("edit to enforcement: at most {to_enforcement:?}");
    assert!(to_enforcement < Duration::from_secs(30), "the edit took {to_enforcement:?} to take effect");
    refill(new_rate, burst).await;
    let (ok, limited, _) = send_for(&traefik, "/a/", window).await;
    eprintln!("limit {new_rate}/s burst {burst}: {ok} accepted, {limited} limited in {window:?}");
    assert_near("the edited limit", ok, new_rate as f64 * 4.0 + burst as f64);

    // Removing the limit removes the Middleware and the route's filter: nothing is limited.
    let middlewares = dynamic(&env, &gateway::Traefik.resource());
    let patch = json!({ "spec": { "rateLimit": null } });
    policies.patch("app-a", &PatchParams::default(), &Patch::Merge(&patch)).await.unwrap();
    eventually("the Middleware is deleted", || async {
        middlewares.get_opt("app-a").await.ok()?.is_none().then_some(())
    })
    .await;
    eventually_within(Duration::from_secs(30), "nothing is limited", || async {
        let (ok, limited, other) = send_for(&traefik, "/a/", Duration::from_secs(1)).await;
        (limited == 0 && other == 0 && ok as f64 > 1.5 * (new_rate + burst) as f64).then_some(())
    })
    .await;

    // Deleting the policy deletes its route (garbage collection): the path is gone.
    policies
        .patch(
            "app-a",
            &PatchParams::default(),
            &Patch::Merge(&json!({ "spec": { "rateLimit": { "requestsPerSecond": 1 } } })),
        )
        .await
        .unwrap();
    eventually("the Middleware is back", || async { middlewares.get_opt("app-a").await.ok()?.map(|_| ()) }).await;
    policies.delete("app-a", &DeleteParams::foreground()).await.unwrap();
    let routes = dynamic(&env, &gateway::http_route());
    eventually("the route and the Middleware are collected", || async {
        let gone = routes.get_opt("app-a").await.ok()?.is_none() && middlewares.get_opt("app-a").await.ok()?.is_none();
        gone.then_some(())
    })
    .await;
    eventually("GET /a/ is no longer routed", || async {
        (traefik.get(HOST, "/a/").ok()?.status == 404).then_some(())
    })
    .await;
    assert_eq!(traefik.get(HOST, "/b/").unwrap().status, 200, "the other policy's route stays");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_missing_gateway_route_or_filter_is_reported() {
    let env = TestEnv::new("gw-missing").await;
    install_gateway_crds(&env.client).await;
    let _operator = env.start_operator(&["--gateway-provider=traefik"]).await;
    let policies = env.api::<ApplicationTrafficPolicy>();
    let routes = dynamic(&env, &gateway::http_route());
    create(&routes, json!({ "apiVersion": "gateway.networking.k8s.io/v1", "kind": "HTTPRoute",
        "metadata": { "name": "mine" },
        "spec": { "parentRefs": [{ "name": "edge" }], "rules": [{ "backendRefs": [{ "name": "web", "port": 80 }] }] } })).await;
    let cases = [
        (
            policy(
                "no-gateway",
                json!({ "parentRef": { "name": "nowhere" }, "backendRef": { "name": "web", "port": 80 } }),
                Some((5, 1)),
            ),
            "RouteAccepted",
            "GatewayNotFound",
            format!("Gateway {}/nowhere does not exist", env.namespace),
        ),
        (
            policy("no-route", json!({ "httpRoutes": [{ "name": "missing" }] }), Some((5, 1))),
            "RouteAccepted",
            "RouteNotFound",
            "HTTPRoute missing does not exist".to_string(),
        ),
        (
            policy("no-filter", json!({ "httpRoutes": [{ "name": "mine" }] }), Some((5, 1))),
            "RateLimitAccepted",
            "NotAttached",
            "ExtensionRef naming Middleware no-filter (group traefik.io)".to_string(),
        ),
    ];
    for (p, ..) in &cases {
        policies.create(&PostParams::default(), p).await.unwrap();
    }
    for (p, type_, reason, message) in &cases {
        let said = wait_condition(&env, &p.name_any(), type_, ConditionStatus::False, reason).await;
        assert!(said.contains(message.as_str()), "{}: {said}", p.name_any());
        let ready = wait_condition(&env, &p.name_any(), "Ready", ConditionStatus::False, "GatewayNotAccepted").await;
        assert!(ready.contains(message.as_str()), "Ready says why: {ready}");
    }
    // The user's route is read, never written.
    let mine = routes.get("mine").await.unwrap();
    assert!(
        mine.metadata
            .managed_fields
            .unwrap_or_default()
            .iter()
            .all(|f| f.manager.as_deref() != Some("traffic-policy-operator"))
    );
    // Fixing the route clears the condition, with no restart.
    let filter = gateway::Traefik.route_filter(&cases[2].0).unwrap();
    let patch =
        json!({ "spec": { "rules": [{ "filters": [filter], "backendRefs": [{ "name": "web", "port": 80 }] }] } });
    routes.patch("mine", &PatchParams::default(), &Patch::Merge(&patch)).await.unwrap();
    // No gateway runs here, so the route is never accepted: the limit waits for it.
    let waiting = eventually_within(Duration::from_secs(90), "the filter is seen", || async {
        let policy = policies.get("no-filter").await.ok()?;
        let c = policy.status?.conditions.into_iter().find(|c| c.type_ == "RateLimitAccepted")?;
        (c.reason == "Pending").then_some(c.message)
    })
    .await;
    assert!(waiting.contains("HTTPRoute mine"), "{waiting}");
}

#[tokio::test(flavor = "multi_thread")]
async fn envoy_gateway_output_is_accepted_by_its_crds() {
    let env = TestEnv::new("gw-envoy").await;
    install_gateway_crds(&env.client).await;
    gateway_with_class(&env, gateway::EnvoyGateway.controller_name(), 8080).await;
    // `auto`: the GatewayClass's controller chooses Envoy Gateway.
    let _operator = env.start_operator(&[]).await;
    let generated = json!({ "parentRef": { "name": "edge" }, "backendRef": { "name": "web", "port": 80 } });
    let policy = policy("web", generated, Some((7, 3)));
    env.api::<ApplicationTrafficPolicy>().create(&PostParams::default(), &policy).await.unwrap();
    let btps = dynamic(&env, &gateway::EnvoyGateway.resource());
    let written = eventually("the BackendTrafficPolicy is written", || async { btps.get_opt("web").await.ok()? }).await;
    let spec = &written.data["spec"];
    assert_eq!(
        spec["targetRefs"][0],
        json!({ "group": "gateway.networking.k8s.io", "kind": "HTTPRoute", "name": "web" })
    );
    assert_eq!(spec["rateLimit"]["local"]["rules"][0]["limit"], json!({ "requests": 7, "unit": "Second" }));
    assert_eq!(written.owner_references()[0].name, "web");
    // The fencing policy covers the gateway kinds: no one but the operator may touch a token.
    let routes = dynamic(&env, &gateway::http_route());
    for (api, kind) in [(&btps, "BackendTrafficPolicy"), (&routes, "HTTPRoute")] {
        let forged = json!({ "metadata": { "annotations": { FENCE_ANNOTATION: "999999" } } });
        let refused = api.patch("web", &PatchParams::default(), &Patch::Merge(&forged)).await.unwrap_err().to_string();
        assert!(refused.contains("may not set, change or remove it"), "{kind}: {refused}");
    }
    // No Envoy Gateway runs here: the policy says it waits for one, and hides nothing.
    let message = wait_condition(&env, "web", "RouteAccepted", ConditionStatus::Unknown, "Pending").await;
    assert!(message.contains("HTTPRoute web"), "{message}");

    // Every shape the provider writes passes the real CRD's validation (server-side dry run).
    let mut named =
        self::policy("named", json!({ "httpRoutes": [{ "name": "a" }, { "name": "b" }] }), Some((1_000_000, 0)));
    named.metadata.namespace = Some(env.namespace.clone());
    let outputs = objects::outputs(
        &named,
        named.spec.gateway.as_ref().unwrap(),
        Some(&gateway::EnvoyGateway),
        &Default::default(),
    );
    let (_, mut object) = outputs.limit.unwrap();
    object.metadata.owner_references = None;
    let dry_run = PostParams { dry_run: true, ..Default::default() };
    btps.create(&dry_run, &object).await.unwrap();
    let mut bad = object.clone();
    bad.data["spec"]["rateLimit"]["local"]["rules"][0]["limit"]["unit"] = json!("Fortnight");
    let refused = btps.create(&dry_run, &bad).await.unwrap_err().to_string();
    assert!(refused.contains("unit"), "the CRD checks what we write: {refused}");
}

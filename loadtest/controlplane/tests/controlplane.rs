//! The test bed itself, checked against the real servers it starts.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use controlplane::{Config, ControlPlane, Grant};
use futures::{StreamExt, TryStreamExt};
use k8s_openapi::api::core::v1::{ConfigMap, Namespace};
use k8s_openapi::api::rbac::v1::{PolicyRule, Role};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;
use kube::api::{Api, DeleteParams, ObjectMeta, PostParams};
use kube::runtime::watcher;

const DEADLINE: Duration = Duration::from_secs(120);

async fn eventually<F, Fut>(what: &str, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let deadline = Instant::now() + DEADLINE;
    while !check().await {
        assert!(Instant::now() < deadline, "timed out waiting until {what}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

async fn namespace(client: &kube::Client, name: &str) -> Api<ConfigMap> {
    let ns = Namespace { metadata: ObjectMeta { name: Some(name.into()), ..Default::default() }, ..Default::default() };
    Api::<Namespace>::all(client.clone()).create(&PostParams::default(), &ns).await.unwrap();
    Api::namespaced(client.clone(), name)
}

fn config_map(name: &str) -> ConfigMap {
    ConfigMap { metadata: ObjectMeta { name: Some(name.into()), ..Default::default() }, ..Default::default() }
}

#[tokio::test]
async fn serves_the_pinned_version_and_the_resources_we_need() {
    let cp = ControlPlane::shared();
    let client = cp.client().await.unwrap();
    assert_eq!(client.apiserver_version().await.unwrap().git_version, cp.release().version());

    let discovery = kube::Discovery::new(client).run().await.unwrap();
    let has = |group: &str, plural: &str| {
        discovery
            .groups()
            .filter(|g| g.name() == group)
            .flat_map(|g| g.recommended_resources())
            .any(|(r, _)| r.plural == plural)
    };
    assert!(has("coordination.k8s.io", "leases"));
    assert!(has("networking.k8s.io", "networkpolicies"));
    assert!(has("events.k8s.io", "events"));
}

#[tokio::test]
async fn garbage_collector_deletes_owned_children() {
    let client = ControlPlane::shared().client().await.unwrap();
    let cms = namespace(&client, "gc-test").await;
    let parent = cms.create(&PostParams::default(), &config_map("parent")).await.unwrap();
    let mut child = config_map("child");
    child.metadata.owner_references = Some(vec![OwnerReference {
        api_version: "v1".into(),
        kind: "ConfigMap".into(),
        name: "parent".into(),
        uid: parent.metadata.uid.unwrap(),
        ..Default::default()
    }]);
    cms.create(&PostParams::default(), &child).await.unwrap();
    cms.delete("parent", &DeleteParams::default()).await.unwrap();
    eventually("the child is garbage-collected", || async { cms.get_opt("child").await.unwrap().is_none() }).await;
}

#[tokio::test]
async fn namespace_controller_finishes_deletion() {
    let client = ControlPlane::shared().client().await.unwrap();
    let cms = namespace(&client, "ns-delete-test").await;
    cms.create(&PostParams::default(), &config_map("content")).await.unwrap();
    let namespaces = Api::<Namespace>::all(client);
    namespaces.delete("ns-delete-test", &DeleteParams::default()).await.unwrap();
    eventually("the namespace is gone", || async { namespaces.get_opt("ns-delete-test").await.unwrap().is_none() })
        .await;
}

#[tokio::test]
async fn restricted_identity_gets_exactly_its_role() {
    let cp = ControlPlane::shared();
    let admin = cp.client().await.unwrap();
    namespace(&admin, "rbac-test").await;
    let role = Role {
        metadata: ObjectMeta {
            name: Some("cm-reader".into()),
            namespace: Some("rbac-test".into()),
            ..Default::default()
        },
        rules: Some(vec![PolicyRule {
            api_groups: Some(vec!["".into()]),
            resources: Some(vec!["configmaps".into()]),
            verbs: vec!["get".into(), "list".into()],
            ..Default::default()
        }]),
    };
    Api::<Role>::namespaced(admin.clone(), "rbac-test").create(&PostParams::default(), &role).await.unwrap();
    let grant = Grant::Role { namespace: "rbac-test".into(), name: "cm-reader".into() };
    let identity = cp.identity("rbac-test", "reader", &[grant]).await.unwrap();
    assert_eq!(identity.user, "system:serviceaccount:rbac-test:reader");

    let cms = Api::<ConfigMap>::namespaced(identity.client(cp).await.unwrap(), "rbac-test");
    cms.list(&Default::default()).await.expect("list is granted");
    match cms.create(&PostParams::default(), &config_map("x")).await {
        Err(kube::Error::Api(status)) => assert_eq!(status.code, 403, "{status:?}"),
        other => panic!("create must be forbidden, got {other:?}"),
    }
}

/// Its own control plane: restarting the shared one would disturb the other tests.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn watch_survives_an_apiserver_restart() {
    let cp =
        tokio::task::spawn_blocking(|| ControlPlane::start(Config { controller_manager: false, ..Config::default() }))
            .await
            .unwrap()
            .unwrap();
    let client = cp.client().await.unwrap();
    let cms = namespace(&client, "restart-test").await;
    let mut names = watcher(cms.clone(), watcher::Config::default())
        .try_filter_map(|event| async move {
            Ok(match event {
                watcher::Event::Apply(cm) | watcher::Event::InitApply(cm) => cm.metadata.name,
                _ => None,
            })
        })
        .boxed();
    cms.create(&PostParams::default(), &config_map("before")).await.unwrap();
    assert_eq!(next_name(&mut names).await, "before");

    let cp = tokio::task::spawn_blocking(move || {
        cp.restart_apiserver().unwrap();
        cp
    })
    .await
    .unwrap();
    let cms = Api::<ConfigMap>::namespaced(cp.client().await.unwrap(), "restart-test");
    cms.create(&PostParams::default(), &config_map("after")).await.unwrap();
    let deadline = Instant::now() + DEADLINE;
    loop {
        assert!(Instant::now() < deadline, "the watch never saw the object created after the restart");
        if next_name(&mut names).await == "after" {
            break;
        }
    }
}

async fn next_name(names: &mut (impl futures::Stream<Item = Result<String, watcher::Error>> + Unpin)) -> String {
    loop {
        match tokio::time::timeout(DEADLINE, names.next()).await {
            Ok(Some(Ok(name))) => return name,
            // Errors while the apiserver is down are expected: the watcher retries.
            Ok(Some(Err(_))) => continue,
            Ok(None) => panic!("the watch stream ended"),
            Err(_) => panic!("no watch event within {DEADLINE:?}"),
        }
    }
}

#[test]
fn an_occupied_port_is_a_clear_error() {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let err =
        ControlPlane::start(Config { apiserver_port: Some(port), controller_manager: false, ..Config::default() })
            .err()
            .expect("start must fail")
            .to_string();
    assert!(err.starts_with(&format!("kube-apiserver: port 127.0.0.1:{port} is already in use (log: ")), "{err}");
    assert!(!err.contains('\n'), "{err}");
    let log = err.split("(log: ").nth(1).unwrap().trim_end_matches(')');
    std::fs::remove_dir_all(std::path::Path::new(log).parent().unwrap()).unwrap();
}

#[test]
fn a_component_that_exits_at_start_is_a_clear_error() {
    let config =
        Config { apiserver_args: vec!["--no-such-flag".into()], controller_manager: false, ..Config::default() };
    let err = ControlPlane::start(config).err().expect("start must fail").to_string();
    assert!(err.starts_with("kube-apiserver: exited during start-up"), "{err}");
    assert!(!err.contains('\n'), "{err}");
    // The log named in the error is kept for reading, and says why.
    let log = err.split("(log: ").nth(1).unwrap().trim_end_matches(')');
    assert!(std::fs::read_to_string(log).unwrap().contains("unknown flag: --no-such-flag"));
    std::fs::remove_dir_all(std::path::Path::new(log).parent().unwrap()).unwrap();
}

#[test]
fn a_missing_go_toolchain_is_a_clear_error() {
    let cache = tempfile::tempdir().unwrap();
    let out = Command::new("bash")
        .arg(concat!(env!("CARGO_MANIFEST_DIR"), "/build.sh"))
        .env("TPO_CONTROLPLANE_CACHE", cache.path())
        .env("PATH", "/usr/bin:/bin")
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(stderr.lines().count(), 1, "{stderr}");
    assert!(stderr.starts_with("controlplane-build: error: the Go toolchain ('go') is not on PATH"), "{stderr}");
}

/// `kill -9` of the process that started the control plane leaves no server behind.
#[test]
fn killing_the_owner_process_leaves_no_servers() {
    let mut owner = Command::new(env!("CARGO_BIN_EXE_controlplane"))
        .args(["--kubeconfig", tempfile::tempdir().unwrap().path().join("kc").to_str().unwrap()])
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(owner.stdout.take().unwrap()).lines();
    assert!(lines.next().unwrap().unwrap().contains("control plane ready"));
    let data_line = lines.next().unwrap().unwrap();
    let data_dir =
        data_line.trim().strip_prefix("logs and data: ").expect("second line names the data dir").to_string();
    let servers = children_of(owner.id());
    assert_eq!(servers.len(), 3, "etcd, kube-apiserver and kube-controller-manager: {servers:?}");

    owner.kill().unwrap(); // SIGKILL: no destructor runs
    owner.wait().unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    while servers.iter().any(|pid| std::path::Path::new(&format!("/proc/{pid}")).exists() && !is_zombie(*pid)) {
        assert!(Instant::now() < deadline, "servers outlived their owner: {servers:?}");
        std::thread::sleep(Duration::from_millis(100));
    }
    // A SIGKILLed owner cannot clean up its directory; the test does.
    std::fs::remove_dir_all(data_dir).unwrap();
}

fn children_of(parent: u32) -> Vec<u32> {
    std::fs::read_dir("/proc")
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| stat_field(*pid, 1).as_deref() == Some(&parent.to_string()))
        .collect()
}

fn is_zombie(pid: u32) -> bool {
    stat_field(pid, 0).as_deref() == Some("Z")
}

/// Fields of /proc/PID/stat after the command name: 0 is the state, 1 the parent PID.
fn stat_field(pid: u32, index: usize) -> Option<String> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    stat.rsplit_once(") ")?.1.split(' ').nth(index).map(str::to_string)
}

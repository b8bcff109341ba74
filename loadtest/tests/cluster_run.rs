//! `loadtest run --kubeconfig`, aimed at a cluster where the operator already runs (here a
//! local control plane with the operator as a process): the run converges its policies,
//! leaves the operator running and nothing of its own behind, and exits non-zero naming the
//! threshold when an SLO is missed.

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use controlplane::process::Process;
use controlplane::{Config, ControlPlane};

fn kubectl(cp: &ControlPlane, args: &[&str]) -> String {
    let out =
        Command::new("kubectl").args(args).env("KUBECONFIG", cp.kubeconfig_path()).output().expect("kubectl runs");
    assert!(out.status.success(), "kubectl {args:?}: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout).unwrap()
}

#[test]
fn a_run_against_an_existing_cluster_cleans_up_and_judges_its_slo() {
    let cp = ControlPlane::start(Config { controller_manager: true, ..Config::default() }).unwrap();
    let crds = concat!(env!("CARGO_MANIFEST_DIR"), "/../crds/");
    kubectl(&cp, &["apply", "-f", crds]);
    kubectl(
        &cp,
        &["wait", "--for=condition=established", "--timeout=60s", "crd/applicationtrafficpolicies.trafficpolicy.dev"],
    );
    kubectl(&cp, &["create", "namespace", "traffic-policy-operator"]);
    let bin = Path::new(env!("CARGO_BIN_EXE_loadtest"));
    let operator = bin.with_file_name("traffic-policy-operator");
    assert!(operator.is_file(), "build the operator first: cargo build --bins");
    let (metrics, probes) = (controlplane::free_port().unwrap(), controlplane::free_port().unwrap());
    let args = [
        format!("--kubeconfig={}", cp.kubeconfig_path().display()),
        "--namespace=traffic-policy-operator".to_string(),
        "--pod-name=traffic-policy-operator-0".to_string(),
        format!("--metrics-addr=127.0.0.1:{metrics}"),
        format!("--health-probe-addr=127.0.0.1:{probes}"),
    ];
    let mut running =
        Process::start("traffic-policy-operator", &operator, &args, &cp.dir().join("operator.log")).unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    while !controlplane::http_get_plain(probes, "/readyz").is_ok_and(|r| r.contains(" 200 ")) {
        assert!(Instant::now() < deadline, "{}", running.failure("not ready"));
        std::thread::sleep(Duration::from_millis(100));
    }

    let dir = tempfile::tempdir().unwrap();
    let loadtest = |slo: &str| {
        let slo_path = dir.path().join("slo.yaml");
        std::fs::write(&slo_path, slo).unwrap();
        Command::new(bin)
            .args(["run", "--objects=200", "--namespaces=10"])
            .arg(format!("--kubeconfig={}", cp.kubeconfig_path().display()))
            .arg(format!("--slo={}", slo_path.display()))
            .arg(format!("--out={}", dir.path().join("run.json").display()))
            .output()
            .unwrap()
    };

    let passing = loadtest("convergence_p99_seconds: 60\nmax_errors: 0\n");
    let stdout = String::from_utf8_lossy(&passing.stdout);
    println!("{stdout}");
    assert!(passing.status.success(), "{stdout}{}", String::from_utf8_lossy(&passing.stderr));
    assert!(stdout.contains("SLO met: convergence p99") && stdout.contains("SLO met: errors 0"), "{stdout}");
    let result: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.path().join("run.json")).unwrap()).unwrap();
    assert_eq!((result["converged"].as_u64(), result["errors"].as_u64()), (Some(200), Some(0)));

    let failing = loadtest("convergence_p99_seconds: 0.001\nmax_errors: 0\n");
    let stdout = String::from_utf8_lossy(&failing.stdout);
    let stderr = String::from_utf8_lossy(&failing.stderr);
    println!("{stdout}{}", stderr.lines().last().unwrap_or_default());
    assert!(!failing.status.success(), "a missed SLO must fail the run");
    assert!(stdout.contains("SLO MISSED: convergence p99"), "{stdout}");
    assert!(stderr.contains("1 of 2 SLO thresholds missed"), "{stderr}");

    let misspelt = loadtest("max_error: 0\n");
    assert!(!misspelt.status.success());
    assert!(String::from_utf8_lossy(&misspelt.stderr).contains("not a valid SLO file"));

    // The operator was left running, and nothing of the runs is left.
    assert!(running.exited().is_none(), "the run stopped the operator");
    let left = kubectl(&cp, &["get", "namespaces", "-l", "trafficpolicy.dev/loadtest", "-o", "name"]);
    assert!(left.trim().is_empty(), "left behind: {left}");
    let policies = kubectl(&cp, &["get", "atp", "-A", "-o", "name"]);
    assert!(policies.trim().is_empty(), "policies left behind: {policies}");
    running.stop(Duration::from_secs(20));
}

//! The CI-sized load run: 500 policies on 2 replicas, in namespaces of Zipf-distributed
//! sizes, a tenth of them changed afterwards, and one replica killed midway. Asserts
//! correctness only (all converged, slices balanced by policies, nothing left behind), never
//! speed.

use std::process::Command;

#[test]
fn five_hundred_policies_on_two_replicas_converge_and_leave_nothing_behind() {
    let bin = std::path::Path::new(env!("CARGO_BIN_EXE_loadtest"));
    let operator = bin.with_file_name("traffic-policy-operator");
    assert!(operator.is_file(), "build the operator first: cargo build --bins");
    let out = tempfile::tempdir().unwrap().keep().join("run.json");
    let run = Command::new(bin)
        .args(["run", "--objects=500", "--namespaces=25", "--zipf=1", "--replicas=2"])
        .args(["--update-fraction=0.1", "--kill-after=2"])
        // The default (200 policies over the mean) is sized for large fleets.
        .env("TPO_REBALANCE_MIN_OBJECTS", "20")
        .arg(format!("--operator-binary={}", operator.display()))
        .arg(format!("--out={}", out.display()))
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&run.stderr);
    let stdout = String::from_utf8_lossy(&run.stdout);
    println!("{stdout}");
    assert!(run.status.success(), "the run failed:\n{stderr}");

    let result: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&out).unwrap()).unwrap();
    assert_eq!(result["converged"], 500);
    assert!(result["update_seconds"].as_f64().is_some(), "the updates converged too");
    // Read from the API server once the leader would change nothing more: the assignment, the
    // member Leases' reports, and the policies the run created.
    let balance = &result["balance"];
    let ratio = balance["largest_over_mean"].as_f64().expect("the slices settled");
    assert!(ratio <= 1.1, "the largest replica holds {ratio:.3} × the mean: {balance}");

    // Nothing left: the run's control-plane directory is gone, and no process still uses it.
    let dir = stderr.lines().find_map(|l| l.strip_prefix("control plane: ")).expect("the run names its control plane");
    assert!(!std::path::Path::new(dir).exists(), "{dir} was left behind");
    for entry in std::fs::read_dir("/proc").unwrap().flatten() {
        let cmdline = std::fs::read(entry.path().join("cmdline")).unwrap_or_default();
        assert!(!String::from_utf8_lossy(&cmdline).contains(dir), "a process outlived the run: {:?}", entry.path());
    }
    std::fs::remove_dir_all(out.parent().unwrap()).unwrap();
}

//! Prometheus metrics, named after client-go's workqueue and controller-runtime's
//! controller metrics so that existing dashboards and alerts apply.
//!
//! Labels are bounded: the controller name, a result, an error kind. Never an object or a
//! namespace. Histograms are real histograms with buckets (the exporter would otherwise
//! render summaries, which cannot be summed across replicas).

use std::time::Duration;

use metrics::{counter, gauge, histogram};

pub use crate::runtime::metrics::count_watch_error;
pub use crate::sharding::coordination::metrics::count_bucket_label_error;
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};

/// client-go's buckets for `rest_client_request_duration_seconds`.
const REQUEST_BUCKETS: [f64; 12] = [0.005, 0.025, 0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 15.0, 30.0, 60.0];

/// `process_*` metrics (CPU, resident memory, open fds, start time), read at each scrape.
static PROCESS: std::sync::LazyLock<metrics_process::Collector> =
    std::sync::LazyLock::new(metrics_process::Collector::default);

/// The text of `/metrics`, with the process metrics read now.
pub fn render(handle: &PrometheusHandle) -> String {
    PROCESS.collect();
    handle.render()
}

/// Installs the global recorder and returns the handle that renders `/metrics`.
pub fn install() -> anyhow::Result<PrometheusHandle> {
    // controller-runtime: workqueue durations 1e-8 s … 1e3 s in ×10 steps.
    let queue_buckets: Vec<f64> = (-8..=3).map(|e| 10f64.powi(e)).collect();
    let reconcile_buckets = [
        0.005, 0.01, 0.025, 0.05, 0.1, 0.15, 0.2, 0.25, 0.3, 0.35, 0.4, 0.45, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0, 1.25, 1.5,
        1.75, 2.0, 2.5, 3.0, 3.5, 4.0, 4.5, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0, 15.0, 20.0, 25.0, 30.0, 40.0, 50.0, 60.0,
    ];
    let handle = PrometheusBuilder::new()
        .set_buckets_for_metric(Matcher::Prefix("workqueue_".into()), &queue_buckets)?
        .set_buckets_for_metric(Matcher::Full("controller_runtime_reconcile_time_seconds".into()), &reconcile_buckets)?
        .set_buckets_for_metric(Matcher::Full("rest_client_request_duration_seconds".into()), &REQUEST_BUCKETS)?
        .set_buckets_for_metric(Matcher::Full("rest_client_rate_limiter_duration_seconds".into()), &REQUEST_BUCKETS)?
        .install_recorder()?;
    // The runtime's cache and watch metrics, under the names dashboards and alerts know.
    crate::runtime::metrics::set_prefix("traffic_policy");
    describe();
    set_build_info();
    Ok(handle)
}

/// The exporter's periodic housekeeping (histogram maintenance), every 5 s.
pub async fn upkeep(handle: PrometheusHandle) {
    let mut tick = tokio::time::interval(Duration::from_secs(5));
    loop {
        tick.tick().await;
        handle.run_upkeep();
    }
}

fn describe() {
    use metrics::{describe_counter, describe_gauge, describe_histogram};
    PROCESS.describe();
    crate::runtime::metrics::describe();
    crate::sharding::coordination::metrics::describe();
    describe_gauge!(
        "traffic_policy_client_rate_limit_qps",
        "Requests a second the work client may make (--kube-api-qps as resolved); 0 when off."
    );
    describe_counter!("rest_client_requests_total", "API requests, by method and status code.");
    describe_histogram!("rest_client_request_duration_seconds", "API request latency until the response headers.");
    describe_histogram!(
        "rest_client_rate_limiter_duration_seconds",
        "Time a request waited for the client-side rate limiter (none while the limit is off)."
    );
    describe_gauge!("traffic_policy_operator_build_info", "1, labelled with the operator's version.");
    describe_gauge!("traffic_policy_policies", "Policies of this replica's slice, by Ready status and reason.");
    describe_counter!("traffic_policy_bucket_labels_total", "Policies the leader labelled with their bucket.");
    describe_gauge!(
        "traffic_policy_unlabelled_policies",
        "Policies waiting for their bucket label (reported by the leader; 0 elsewhere)."
    );
    describe_gauge!(
        "traffic_policy_admission_policy_in_force",
        "1 while the admission policy (fencing, operator-reach) refuses what it must for this replica's identity."
    );
}

/// 1, with the operator's version: joins other series to the version that exported them.
fn set_build_info() {
    gauge!("traffic_policy_operator_build_info", "version" => env!("CARGO_PKG_VERSION")).set(1.0);
}

/// How long a request waited for the client-side rate limiter (client-go's name).
pub fn rate_limiter_waited(waited: Duration) {
    histogram!("rest_client_rate_limiter_duration_seconds").record(waited.as_secs_f64());
}

/// The client-side rate limit in force, in requests per second; 0 when off.
pub fn set_client_rate_limit(qps: u32) {
    gauge!("traffic_policy_client_rate_limit_qps").set(f64::from(qps));
}

/// One API request: `method` is an HTTP method, `status` its code (`None`: no response).
pub fn api_request(method: &str, status: Option<u16>, took: Duration) {
    let method = match method {
        "GET" => "GET",
        "POST" => "POST",
        "PUT" => "PUT",
        "PATCH" => "PATCH",
        "DELETE" => "DELETE",
        _ => "other",
    };
    let code = status.map_or_else(|| "<error>".to_string(), |code| code.to_string());
    counter!("rest_client_requests_total", "method" => method, "code" => code).increment(1);
    histogram!("rest_client_request_duration_seconds", "verb" => method).record(took);
}

/// Policies of this replica's slice by their Ready condition: `states[i]` is the
/// `(ready, reason)` pair counted by `counts[i]`.
pub fn set_policies(states: &[(&'static str, &'static str)], counts: &[usize]) {
    for (&(ready, reason), &count) in states.iter().zip(counts) {
        gauge!("traffic_policy_policies", "ready" => ready, "reason" => reason).set(count as f64);
    }
}

/// Whether admission policy `policy` (one of a fixed two) is in force for our identity.
pub fn set_admission_policy_in_force(policy: &'static str, in_force: bool) {
    gauge!("traffic_policy_admission_policy_in_force", "policy" => policy).set(if in_force { 1.0 } else { 0.0 });
}

pub fn set_unlabelled(count: usize) {
    gauge!("traffic_policy_unlabelled_policies").set(count as f64);
}

pub fn count_bucket_label() {
    counter!("traffic_policy_bucket_labels_total").increment(1);
}

//! Structured logs with `tracing`: JSON for machines, text for people.

use clap::ValueEnum;
use tracing_subscriber::EnvFilter;

#[derive(Clone, Copy, Debug, ValueEnum)]
pub enum LogFormat {
    Json,
    Text,
}

/// `level` is an EnvFilter directive such as `info` or `traffic_policy_operator=debug`.
pub fn init(format: LogFormat, level: &str) -> anyhow::Result<()> {
    let filter = EnvFilter::try_new(level).map_err(|e| anyhow::anyhow!("invalid --log-level {level:?}: {e}"))?;
    let builder = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr);
    match format {
        LogFormat::Json => builder.json().flatten_event(true).with_current_span(true).with_span_list(false).init(),
        LogFormat::Text => builder.init(),
    }
    Ok(())
}

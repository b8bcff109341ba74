//! Structured logs with `tracing`: JSON for machines, text for people.

use clap::ValueEnum;
use tracing_subscriber::EnvFilter;

#[derive(Clone, Copy, Debug, ValueEnum)]
pub enum LogFormat {
    Json,
    Text,
}

/// `level` is an EnvFilter directive such as `info` or `traffic_policy_operator=debug`;
/// without one, `RUST_LOG` applies as in most Rust programs, and without that, `info`.
pub fn init(format: LogFormat, level: Option<&str>) -> anyhow::Result<()> {
    let filter = filter(level, std::env::var("RUST_LOG").ok().as_deref())?;
    let builder = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr);
    match format {
        LogFormat::Json => builder.json().flatten_event(true).with_current_span(true).with_span_list(false).init(),
        LogFormat::Text => builder.init(),
    }
    Ok(())
}

/// The filter from the flag, else from `RUST_LOG`, else `info`; a bad one names its source.
fn filter(flag: Option<&str>, rust_log: Option<&str>) -> anyhow::Result<EnvFilter> {
    let (source, directives) = match (flag, rust_log) {
        (Some(flag), _) => ("--log-level", flag),
        (None, Some(env)) if !env.trim().is_empty() => ("RUST_LOG", env),
        _ => ("the default", "info"),
    };
    EnvFilter::try_new(directives).map_err(|e| anyhow::anyhow!("invalid {source} {directives:?}: {e}"))
}

#[cfg(test)]
mod tests {
    use super::filter;

    #[test]
    fn the_flag_wins_then_rust_log_then_info() {
        let shown = |flag, env| filter(flag, env).unwrap().to_string();
        assert_eq!(shown(Some("warn"), Some("debug")), "warn");
        assert_eq!(shown(None, Some("kube=debug,info")), "kube=debug,info");
        assert_eq!(shown(None, Some(" ")), "info");
        assert_eq!(shown(None, None), "info");
    }

    #[test]
    fn a_bad_filter_names_where_it_came_from() {
        let error = filter(None, Some("kube=loud")).unwrap_err().to_string();
        assert!(error.starts_with("invalid RUST_LOG \"kube=loud\""), "{error}");
        let error = filter(Some("kube=loud"), None).unwrap_err().to_string();
        assert!(error.starts_with("invalid --log-level"), "{error}");
    }
}

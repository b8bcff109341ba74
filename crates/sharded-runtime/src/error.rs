//! Errors of a reconcile, with their retry class and a bounded metric label.

use std::time::Duration;

/// Why a reconcile failed, and so whether it is retried.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The spec can never be applied as written (the API server refused it as invalid).
    #[error("invalid spec: {0}")]
    InvalidSpec(String),
    /// An API call failed; it may succeed on retry.
    #[error("kubernetes API: {}", describe(.0))]
    Kube(#[from] kube::Error),
    /// The API server refused a write to `object` (RBAC, an admission policy, a precondition);
    /// it may pass on retry. Carries the object, so that a status can say what was refused.
    #[error("{object}: {}", refusal(.status))]
    Refused { object: String, status: Box<kube::core::Status> },
    /// An object the reconcile would write exists and is not its owner's (someone else made
    /// it): nothing is written. Retried with backoff, so that it heals once that object is gone.
    #[error("{0}")]
    NotOwned(String),
    /// This replica no longer owns the object's bucket (handoff or fail-stop); the new owner
    /// takes over, so there is nothing to retry here.
    #[error("ownership of the object's bucket was lost")]
    LostOwnership,
    /// The API server refused a write as fenced: a newer owner of the bucket has written since.
    /// Carries what was refused and the server's message.
    #[error("the write was fenced: {0}")]
    Fenced(String),
    /// A write was fenced while this replica still owned the object's bucket: the stored
    /// token came from elsewhere (another install, a hand edit), and no write of ours can
    /// beat it. Retried with backoff, so that it heals once the token is removed.
    #[error("{0}")]
    ForeignToken(String),
    /// The reconcile panicked; the panic was caught and the key is retried with backoff.
    #[error("reconcile panicked: {0}")]
    Panicked(String),
    /// A write of the object's bucket was given up unanswered and may still land for this
    /// long: a newer write waits until it no longer can, so that the late one never
    /// overwrites it. The object is looked at again then.
    #[error("an earlier write of the object's bucket may still land for {0:?}; writing after that")]
    EarlierWriteLanding(Duration),
    /// An API call did not answer in time.
    #[error("API call timed out after {0:?}")]
    Timeout(Duration),
}

/// A reconcile's result.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// A client error in a line a person reads: the server's own message for an API error, never
/// the Debug dump of its Status.
fn describe(error: &kube::Error) -> String {
    match error {
        kube::Error::Api(status) => refusal(status),
        other => other.to_string(),
    }
}

/// Who refused a request and why, from the server's Status: `the API server refused it (403
/// Forbidden): <message>`. The message names the refusing admission policy or the missing
/// permission.
fn refusal(status: &kube::core::Status) -> String {
    let reason = if status.reason.is_empty() { String::new() } else { format!(" {}", status.reason) };
    let message = if status.message.is_empty() { "no message" } else { status.message.as_str() };
    format!("the API server refused it ({}{reason}): {message}", status.code)
}

impl Error {
    /// A write to `object` that the API server answered with an error Status becomes a
    /// [`Error::Refused`] naming it; any other error is returned as it is.
    pub fn refusing(self, object: impl FnOnce() -> String) -> Self {
        match self {
            Self::Kube(kube::Error::Api(status)) => Self::Refused { object: object(), status },
            other => other,
        }
    }

    /// A caught panic, with its message when it has one.
    pub fn panicked(panic: &(dyn std::any::Any + Send)) -> Self {
        let message = match (panic.downcast_ref::<&str>(), panic.downcast_ref::<String>()) {
            (Some(message), _) => message.to_string(),
            (_, Some(message)) => message.clone(),
            _ => "a panic without a message".into(),
        };
        Self::Panicked(message)
    }

    /// A fixed label for metrics: never a message or an object name.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::InvalidSpec(_) => "invalid_spec",
            Self::LostOwnership => "lost_ownership",
            Self::Fenced(_) => "fenced",
            Self::ForeignToken(_) => "foreign_token",
            Self::Panicked(_) => "panic",
            Self::Timeout(_) => "timeout",
            Self::EarlierWriteLanding(_) => "earlier_write_landing",
            Self::NotOwned(_) => "not_owned",
            Self::Kube(kube::Error::Api(status)) | Self::Refused { status, .. } => match status.code {
                403 => "forbidden",
                404 => "not_found",
                409 => "conflict",
                429 => "throttled",
                code if code >= 500 => "server_error",
                _ => "client_error",
            },
            Self::Kube(_) => "transport",
        }
    }

    /// Terminal errors are not retried with backoff; the object waits for a new spec.
    pub fn is_terminal(&self) -> bool {
        matches!(self, Self::InvalidSpec(_) | Self::LostOwnership | Self::Fenced(_))
    }

    /// Terminal errors other than lost ownership still resync: the object stays ours.
    pub fn keeps_resync(&self) -> bool {
        !matches!(self, Self::LostOwnership | Self::Fenced(_))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn api_error(code: u16, reason: &str, message: &str) -> kube::Error {
        kube::Error::Api(Box::new(kube::core::Status::failure(message, reason).with_code(code)))
    }

    #[test]
    fn a_refusal_reads_as_one_line_naming_the_object_who_refused_and_why() {
        let message = "trafficpolicy.dev-operator-reach: the operator writes only the objects it manages";
        let refused = Error::from(api_error(403, "Forbidden", message)).refusing(|| "NetworkPolicy shop/web".into());
        assert_eq!(
            refused.to_string(),
            format!("NetworkPolicy shop/web: the API server refused it (403 Forbidden): {message}")
        );
        assert_eq!(refused.kind(), "forbidden", "the metric label follows the code");
        let unnamed = Error::from(api_error(500, "", "etcdserver: request timed out"));
        assert_eq!(
            unnamed.to_string(),
            "kubernetes API: the API server refused it (500): etcdserver: request timed out"
        );
        assert!(!unnamed.to_string().contains("Status {"), "no Debug dump of the client's error");
        let timeout = Error::Timeout(Duration::from_secs(3)).refusing(|| unreachable!("not an API error"));
        assert!(matches!(timeout, Error::Timeout(_)));
    }
}

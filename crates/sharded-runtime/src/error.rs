//! Errors of a reconcile, with their retry class and a bounded metric label.

use std::time::Duration;

/// Why a reconcile failed, and so whether it is retried.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The spec can never be applied as written (the API server refused it as invalid).
    #[error("invalid spec: {0}")]
    InvalidSpec(String),
    /// An API call failed; it may succeed on retry.
    #[error("kubernetes API: {0}")]
    Kube(#[from] kube::Error),
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
    /// An API call did not answer in time.
    #[error("API call timed out after {0:?}")]
    Timeout(Duration),
}

/// A reconcile's result.
pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
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
            Self::Kube(kube::Error::Api(status)) => match status.code {
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

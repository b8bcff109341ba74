//! Who may read `/metrics`, decided as controller-runtime's metrics filter
//! (`filters.WithAuthenticationAndAuthorization`) and kube-rbac-proxy decide it: the bearer
//! token is checked with a TokenReview, and its user must be allowed `get` on the
//! non-resource URL `/metrics` by a SubjectAccessReview. Verdicts are cached for a minute,
//! as theirs are, so a scraper costs two API requests a minute, not two a scrape.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::extract::{Request, State};
use axum::http::{StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use k8s_openapi::api::authentication::v1::{TokenReview, TokenReviewSpec};
use k8s_openapi::api::authorization::v1::{NonResourceAttributes, SubjectAccessReview, SubjectAccessReviewSpec};
use kube::api::{Api, PostParams};

const CACHE_TTL: Duration = Duration::from_secs(60);
/// Distinct tokens remembered at once; the cache starts over beyond that.
const CACHE_ENTRIES: usize = 256;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Verdict {
    Allowed,
    Unauthenticated,
    Forbidden,
}

#[derive(Clone)]
pub struct MetricsAuth {
    client: kube::Client,
    cache: Arc<Mutex<HashMap<String, (Verdict, Instant)>>>,
}

impl MetricsAuth {
    pub fn new(client: kube::Client) -> Self {
        Self { client, cache: Arc::default() }
    }

    async fn verdict(&self, token: &str) -> Result<Verdict, kube::Error> {
        let now = Instant::now();
        if let Some((verdict, at)) = self.cache.lock().unwrap_or_else(|p| p.into_inner()).get(token)
            && now.duration_since(*at) < CACHE_TTL
        {
            return Ok(*verdict);
        }
        let verdict = self.review(token).await?;
        let mut cache = self.cache.lock().unwrap_or_else(|p| p.into_inner());
        if cache.len() >= CACHE_ENTRIES {
            cache.clear();
        }
        cache.insert(token.to_string(), (verdict, now));
        Ok(verdict)
    }

    async fn review(&self, token: &str) -> Result<Verdict, kube::Error> {
        let review = TokenReview {
            spec: TokenReviewSpec { token: token.to_string(), ..Default::default() },
            ..Default::default()
        };
        let reviewed = Api::<TokenReview>::all(self.client.clone()).create(&PostParams::default(), &review).await?;
        let status = reviewed.status.unwrap_or_default();
        let Some(user) = status.user.filter(|_| status.authenticated == Some(true)) else {
            return Ok(Verdict::Unauthenticated);
        };
        let access = SubjectAccessReview {
            spec: SubjectAccessReviewSpec {
                user: user.username,
                groups: user.groups,
                uid: user.uid,
                extra: user.extra,
                non_resource_attributes: Some(NonResourceAttributes {
                    path: Some("/metrics".into()),
                    verb: Some("get".into()),
                }),
                ..Default::default()
            },
            ..Default::default()
        };
        let decided =
            Api::<SubjectAccessReview>::all(self.client.clone()).create(&PostParams::default(), &access).await?;
        Ok(if decided.status.is_some_and(|s| s.allowed) { Verdict::Allowed } else { Verdict::Forbidden })
    }
}

/// The axum middleware: 401 without a valid bearer token, 403 when its user may not read
/// `/metrics`, 500 when the API server cannot say.
pub async fn require(State(auth): State<MetricsAuth>, request: Request, next: Next) -> Response {
    let token = request
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|value| value.to_str().ok())
        .and_then(|value| value.strip_prefix("Bearer "))
        .map(str::trim)
        .filter(|token| !token.is_empty());
    let Some(token) = token else {
        return (StatusCode::UNAUTHORIZED, "Unauthorized: a bearer token is required\n").into_response();
    };
    match auth.verdict(token).await {
        Ok(Verdict::Allowed) => next.run(request).await,
        Ok(Verdict::Unauthenticated) => (StatusCode::UNAUTHORIZED, "Unauthorized\n").into_response(),
        Ok(Verdict::Forbidden) => {
            (StatusCode::FORBIDDEN, "Forbidden: get on the non-resource URL /metrics is not allowed\n").into_response()
        }
        Err(error) => {
            tracing::warn!(%error, "metrics: could not review a scraper's token");
            (StatusCode::INTERNAL_SERVER_ERROR, "the API server could not review the token\n").into_response()
        }
    }
}

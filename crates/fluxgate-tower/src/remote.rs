//! [`RemoteHandler`]: the layer's decisions asked of a rate-limit service
//! (`fluxgate-server`) over HTTP.

use std::fmt;
use std::time::Duration;

use bytes::Bytes;
use fluxgate_core::api::{
    ApiError, CheckRequest, CheckResponse, ERROR_HEADER, ERROR_OVERLOADED, MAX_CHECK_BYTES, MAX_WAIT_MS,
};
use fluxgate_core::{Decision, Error, MaybeReady, RateLimitHandler, RequestContext, RuleError};
use http::{header, Method, Request, StatusCode, Uri};
use http_body_util::{BodyExt, Full, Limited};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;

/// The deadline of one check unless another is given.
pub const DEFAULT_REMOTE_TIMEOUT: Duration = Duration::from_millis(100);

/// How long an idle connection stays in the pool unless another is given: less than the
/// service keeps an idle connection open (`[http] header_timeout_ms`, 10 s by default), so
/// that a check is never sent on a connection the service is closing.
pub const DEFAULT_POOL_IDLE_TIMEOUT: Duration = Duration::from_secs(5);

/// The largest answer read from the service.
const MAX_ANSWER: usize = 1024 * 1024;

/// Asks a rate-limit service (`POST <base>/api/ratelimit/check`) for each decision, over a
/// pooled keep-alive HTTP/1.1 client, within a deadline.
///
/// The service answers with the decision and every band, so the layer writes the same
/// headers as with a local engine. The service's own errors are no failure of it: its `400`
/// (a value beyond its bounds) is [`Error::Refused`] and its `500` (a rule it cannot
/// decide, marked with its [`ERROR_HEADER`]: upgrade services before their gateways)
/// [`Error::Rule`], and its `503` marked [`ERROR_OVERLOADED`] (the request's rule set not
/// looked up in time) [`Error::Overloaded`], all refused whatever the failure policy. Any failure (the
/// deadline, a refused connection, another answer than 200, an answer that is not a
/// decision, a 400 or 500 without the service's error) is [`Error::Backend`]: wrap the handler in a
/// [`CircuitBreaker`](fluxgate_core::CircuitBreaker) to stop waiting for a service that is
/// down, and choose with the layer's `on_error` what such a failure means (fail open, or
/// answer 503), as for the Redis backend.
///
/// The request sent is [`CheckRequest::from_context`]: the raw path (the service matches
/// rules against it and its normalized form, as the layer does), the method, the client IP,
/// the user, the API key and the attributes.
///
/// ```no_run
/// use fluxgate_core::{CircuitBreaker, FailurePolicy};
/// use fluxgate_tower::remote::RemoteHandler;
/// use fluxgate_tower::RateLimitLayer;
///
/// # fn run() -> Result<(), Box<dyn std::error::Error>> {
/// let remote = RemoteHandler::builder("http://127.0.0.1:8082")?
///     .timeout(std::time::Duration::from_millis(50))
///     .build();
/// let layer = RateLimitLayer::builder(CircuitBreaker::new(remote))
///     .on_error(FailurePolicy::FailOpen)
///     .build()?;
/// # drop(layer);
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct RemoteHandler {
    client: Client<HttpConnector, Full<Bytes>>,
    check: Uri,
    timeout: Duration,
}

/// Builds a [`RemoteHandler`].
#[derive(Debug)]
pub struct RemoteHandlerBuilder {
    check: Uri,
    timeout: Duration,
    pool_idle_timeout: Duration,
    pool_max_idle_per_host: usize,
}

/// Why the service gave no decision.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RemoteError {
    /// The base URL cannot be used.
    #[error("rate-limit service URL `{url}`: {reason}")]
    Url {
        /// The URL given, its user and password (anything before an `@`) shown as `***`.
        url: String,
        /// What is wrong.
        reason: String,
    },
    /// No answer within the deadline.
    #[error("the rate-limit service did not answer within {0:?}")]
    Timeout(Duration),
    /// The connection or the exchange failed.
    #[error("rate-limit service request failed: {0}")]
    Http(String),
    /// An answer other than 200.
    #[error("the rate-limit service answered {status}: {body}")]
    Status {
        /// The status.
        status: StatusCode,
        /// The start of the body.
        body: String,
    },
    /// A 200 answer that is not a decision.
    #[error("the rate-limit service's answer is not a decision: {0}")]
    Answer(String),
    /// The service's own refusal to decide the request as described: a 400 whose body is
    /// the service's error (a value beyond its bounds). Not a failure of the service.
    #[error("the rate-limit service refused the request: {0}")]
    Refused(String),
    /// The service cannot decide the request's rules: a `500` whose body is the service's
    /// error, marked with its [`ERROR_HEADER`] (a configuration error at the service). Not a
    /// failure of the service either.
    #[error("the rate-limit service cannot decide the request's rules: {0}")]
    Misconfigured(String),
    /// The service could not look the request's rule set up in time: a `503` marked
    /// [`ERROR_OVERLOADED`] (see [`Error::Overloaded`]). Not a failure of the service:
    /// requests can cause it, and the request is refused whatever the failure policy.
    #[error("the rate-limit service could not look the request's rule set up in time: {0}")]
    Overloaded(String),
}

impl fmt::Debug for RemoteHandler {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RemoteHandler")
            .field("check", &self.check)
            .field("timeout", &self.timeout)
            .finish_non_exhaustive()
    }
}

impl RemoteHandler {
    /// A builder for the service at `base` (`http://host:port`, optionally with a path
    /// prefix).
    ///
    /// # Errors
    ///
    /// [`RemoteError::Url`] when `base` is not an `http://` URL, or holds an `@` (a user
    /// or a password, anywhere: the check API takes no credentials, and none would be
    /// sent). The error shows the URL without what comes before its `@`.
    pub fn builder(base: &str) -> Result<RemoteHandlerBuilder, RemoteError> {
        let bad = |reason: &str| RemoteError::Url {
            url: without_userinfo(base),
            reason: reason.to_owned(),
        };
        // Before parsing: `http::Uri` ends the authority at the first `/`, `?` or `#`, so
        // that a password holding one would be read as a host and a port, and shown.
        if base.contains('@') {
            return Err(bad(
                "a user or password in the URL would not be sent: the check API takes no credentials; \
                 keep the service on a private network",
            ));
        }
        let base: Uri = base.parse().map_err(|_| bad("not a URL"))?;
        if base.scheme_str() != Some("http") {
            return Err(bad(
                "only http:// is supported; put TLS in front, or keep the service on a private network",
            ));
        }
        let authority = base.authority().ok_or_else(|| bad("no host"))?.clone();
        let prefix = base.path().trim_end_matches('/');
        let check = Uri::builder()
            .scheme("http")
            .authority(authority)
            .path_and_query(format!("{prefix}/api/ratelimit/check"))
            .build()
            .map_err(|e| bad(&e.to_string()))?;
        Ok(RemoteHandlerBuilder {
            check,
            timeout: DEFAULT_REMOTE_TIMEOUT,
            pool_idle_timeout: DEFAULT_POOL_IDLE_TIMEOUT,
            pool_max_idle_per_host: 64,
        })
    }

    /// The check endpoint's URL.
    pub fn check_uri(&self) -> &Uri {
        &self.check
    }

    async fn ask(
        client: Client<HttpConnector, Full<Bytes>>,
        check: Uri,
        body: Vec<u8>,
    ) -> Result<Decision, RemoteError> {
        let request = Request::builder()
            .method(Method::POST)
            .uri(check)
            .header(header::CONTENT_TYPE, "application/json")
            .body(Full::new(Bytes::from(body)))
            .map_err(|e| RemoteError::Http(e.to_string()))?;
        let response = client
            .request(request)
            .await
            .map_err(|e| RemoteError::Http(e.to_string()))?;
        let status = response.status();
        let marked = response.headers().contains_key(ERROR_HEADER);
        let overloaded = response
            .headers()
            .get(ERROR_HEADER)
            .is_some_and(|mark| mark.as_bytes() == ERROR_OVERLOADED.as_bytes());
        let body = Limited::new(response.into_body(), MAX_ANSWER)
            .collect()
            .await
            .map_err(|e| RemoteError::Http(e.to_string()))?
            .to_bytes();
        // The service's error names what it refused (400), or the rule it cannot decide
        // (500), marked as the service's own; a 400 from a service of an earlier release,
        // unmarked, has exactly the service's fields. A 400 or 500 of anything else on the
        // way (a proxy, another framework's JSON error, a wrong base path) is a failure of
        // the service, for `on_error`.
        if status == StatusCode::BAD_REQUEST || status == StatusCode::INTERNAL_SERVER_ERROR {
            let error = if marked {
                serde_json::from_slice::<ApiError>(&body).ok()
            } else if status == StatusCode::BAD_REQUEST {
                exact_api_error(&body)
            } else {
                None
            };
            if let Some(error) = error {
                return Err(if status == StatusCode::BAD_REQUEST {
                    RemoteError::Refused(error.to_string())
                } else {
                    RemoteError::Misconfigured(error.to_string())
                });
            }
        }
        if status == StatusCode::SERVICE_UNAVAILABLE && overloaded {
            let error = serde_json::from_slice::<ApiError>(&body).map_or_else(
                |_| "the service could not look the rule set up in time".to_owned(),
                |e| e.to_string(),
            );
            return Err(RemoteError::Overloaded(error));
        }
        if status != StatusCode::OK {
            let text: String = String::from_utf8_lossy(&body).chars().take(200).collect();
            return Err(RemoteError::Status { status, body: text });
        }
        let answer: CheckResponse = serde_json::from_slice(&body).map_err(|e| RemoteError::Answer(e.to_string()))?;
        Ok(answer.to_decision())
    }
}

impl RemoteHandlerBuilder {
    /// The deadline of one check, connecting included. Default 100 ms.
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// How long an idle connection stays in the pool. Default 5 s
    /// ([`DEFAULT_POOL_IDLE_TIMEOUT`]): keep it below the service's
    /// `[http] header_timeout_ms`, after which the service closes an idle connection.
    pub fn pool_idle_timeout(mut self, idle: Duration) -> Self {
        self.pool_idle_timeout = idle;
        self
    }

    /// The most idle connections kept. Default 64.
    pub fn pool_max_idle(mut self, max: usize) -> Self {
        self.pool_max_idle_per_host = max;
        self
    }

    /// The handler. Needs a tokio runtime when it is used.
    pub fn build(self) -> RemoteHandler {
        let mut connector = HttpConnector::new();
        connector.set_nodelay(true);
        let client = Client::builder(TokioExecutor::new())
            .pool_idle_timeout(self.pool_idle_timeout)
            .pool_max_idle_per_host(self.pool_max_idle_per_host)
            .build(connector);
        RemoteHandler {
            client,
            check: self.check,
            timeout: self.timeout,
        }
    }
}

impl RateLimitHandler for RemoteHandler {
    fn check(&self, ctx: &RequestContext) -> MaybeReady<Result<Decision, Error>> {
        // A wait for the refill at the service ends within half the deadline, the other
        // half left for the exchange: the answer then comes before the handler gives up,
        // rather than a timeout that a failure policy would admit while the service still
        // held the request's place.
        let mut request = CheckRequest::from_context(ctx);
        let ours = wait_bound(self.timeout);
        request.max_wait_ms = Some(request.max_wait_ms.map_or(ours, |theirs| theirs.min(ours)));
        let body = match serde_json::to_vec(&request) {
            Ok(body) => body,
            Err(e) => return MaybeReady::ready(Err(Error::Backend(Box::new(RemoteError::Http(e.to_string()))))),
        };
        if body.len() > MAX_CHECK_BYTES {
            // Only a request the service would refuse is this large (a rule set id a
            // customizer took from a header): refused here as there, rather than sent to
            // be answered 413, a failure that a failure policy would admit.
            let error = request.to_context().err().map_or_else(
                || format!("the check is larger than {MAX_CHECK_BYTES} bytes"),
                |e| e.to_string(),
            );
            return MaybeReady::ready(Err(Error::Refused(error)));
        }
        let (client, check, timeout) = (self.client.clone(), self.check.clone(), self.timeout);
        MaybeReady::boxed(async move {
            let answer = match tokio::time::timeout(timeout, Self::ask(client, check, body)).await {
                Ok(answer) => answer,
                Err(_) => Err(RemoteError::Timeout(timeout)),
            };
            answer.map_err(|error| match error {
                // The service is up and refuses this request as described: no failure of
                // the service (no circuit opens), and the request is refused, never
                // admitted uncounted by a failure policy.
                // What the request holds decides it, so the client can cause it at will:
                // the layer logs it at debug level.
                RemoteError::Refused(message) => Error::Refused(message),
                // A configuration error at the service: refused whatever the failure
                // policy, as a rule this engine could not decide would be.
                RemoteError::Misconfigured(message) => Error::Rule(RuleError::Service { message }),
                // The service is up and could not look the request's rule set up in time:
                // requests can cause it, so it is refused whatever the failure policy (and
                // opens no circuit).
                RemoteError::Overloaded(message) => Error::Overloaded(message),
                // Logged where the failure is covered, once: by the layer's `on_error`, or
                // by a `FallbackHandler` that decides it locally (a warning each).
                error => {
                    tracing::debug!(%error, "rate-limit service failed");
                    Error::Backend(Box::new(error))
                }
            })
        })
    }
}

/// The service's error, its fields and no other (`error`, and `field` when it names one):
/// how a 400 of a service that does not mark its errors ([`ERROR_HEADER`]) is told from
/// another server's JSON error.
fn exact_api_error(body: &[u8]) -> Option<ApiError> {
    let serde_json::Value::Object(fields) = serde_json::from_slice(body).ok()? else {
        return None;
    };
    let error = fields.get("error")?.as_str()?;
    let field = match fields.get("field") {
        None => None,
        Some(field) => Some(field.as_str()?),
    };
    if fields.len() != 1 + usize::from(field.is_some()) {
        return None;
    }
    Some(match field {
        Some(field) => ApiError::field(field, error),
        None => ApiError::general(error),
    })
}

/// The longest wait at the service for a handler of deadline `timeout`, in ms: half of it,
/// and no more than the service takes (a longer bound would be refused).
fn wait_bound(timeout: Duration) -> u64 {
    u64::try_from((timeout / 2).as_millis()).map_or(MAX_WAIT_MS, |ms| ms.min(MAX_WAIT_MS))
}

/// `url` with everything between its scheme and its last `@`, a user and a password
/// (which may hold `/`, `?` or `#`), shown as `***`.
fn without_userinfo(url: &str) -> String {
    let start = url.find("://").map_or(0, |scheme| scheme + 3);
    match url[start..].rfind('@') {
        Some(at) => format!("{}***{}", &url[..start], &url[start + at..]),
        None => url.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A URL with credentials is refused, and no error shows them: hyper would send
    /// neither, and the handler's `Debug` and errors would show the password.
    #[test]
    fn a_url_with_credentials_is_refused_without_showing_them() {
        for url in [
            "http://gateway:s3cret@127.0.0.1:8082",
            "http://gateway:s3cret@127.0.0.1:8082/prefix?x=1",
            "http://s3cret@127.0.0.1:8082",
            "https://gateway:s3cret@127.0.0.1:8082",
            "http://gateway:s3cret@[::1:8082",
            "http://gateway:s3/cret@127.0.0.1:8082",
            "http://gateway:s3?cret@127.0.0.1:8082",
            "http://gateway:s3#cret@127.0.0.1:8082",
            "http://gateway:s3%40cret@127.0.0.1:8082",
            "HTTP://gateway:s3cret@127.0.0.1:8082",
        ] {
            let Err(error) = RemoteHandler::builder(url) else {
                panic!("{url} accepted");
            };
            let shown = format!("{error} {error:?}");
            assert!(!shown.contains("cret"), "{shown}");
            assert!(shown.contains("***@"), "{shown}");
        }
        let Err(error) = RemoteHandler::builder("http://gateway:s3cret@127.0.0.1:8082") else {
            unreachable!()
        };
        assert!(error.to_string().contains("would not be sent"), "{error}");
    }

    #[test]
    fn everything_up_to_the_last_at_sign_is_hidden() {
        assert_eq!(without_userinfo("http://u:p/q?r#s@h:1/a"), "http://***@h:1/a");
        assert_eq!(without_userinfo("http://h:1/a"), "http://h:1/a");
        assert_eq!(without_userinfo("u:p@h"), "***@h");
        assert_eq!(without_userinfo("http://a@b@h"), "http://***@h");
        assert_eq!(without_userinfo(""), "");
    }

    /// Without the service's mark, only a body of exactly the service's fields is its error.
    #[test]
    fn an_unmarked_error_is_the_services_only_with_its_fields_alone() {
        assert_eq!(
            exact_api_error(br#"{"error": "too long", "field": "method"}"#),
            Some(ApiError::field("method", "too long"))
        );
        assert_eq!(exact_api_error(br#"{"error": "x"}"#), Some(ApiError::general("x")));
        for other in [
            &br#"{"error": "Internal Server Error", "status": 500}"#[..],
            br#"{"error": "x", "field": 3}"#,
            br#"{"field": "x"}"#,
            br#"["error"]"#,
            b"<html>",
        ] {
            assert_eq!(exact_api_error(other), None, "{}", String::from_utf8_lossy(other));
        }
    }

    /// Half the deadline, within what the service takes, for any deadline.
    #[test]
    fn the_wait_bound_is_half_the_deadline_within_the_services_own() {
        assert_eq!(wait_bound(Duration::from_millis(100)), 50);
        assert_eq!(wait_bound(Duration::ZERO), 0);
        assert_eq!(wait_bound(Duration::from_secs(10 * 86_400)), MAX_WAIT_MS);
        assert_eq!(wait_bound(Duration::MAX), MAX_WAIT_MS);
    }
}

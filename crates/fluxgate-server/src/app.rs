//! The HTTP API: routes, handlers and the state they share.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::{DefaultBodyLimit, Path, State};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use fluxgate_core::api::{ApiError, BatchCheckRequest, BatchCheckResponse, CheckRequest, CheckResponse};
use fluxgate_core::{Engine, Error, RuleSetSpec, Shown};
use fluxgate_redis::{AdminError, RedisLimiter, RuleAdmin, StoreError};
use serde::de::{DeserializeOwned, DeserializeSeed, IgnoredAny, MapAccess, SeqAccess, Visitor};
use serde::{Deserializer, Serialize};

use crate::openapi;

/// What the handlers share.
pub struct AppState {
    /// The engine deciding every check.
    pub engine: Engine,
    /// The Redis limiter, for `/health`; `None` when buckets are kept in memory.
    pub redis: Option<RedisLimiter>,
    /// The rule store's admin; `None` when rules come from a file.
    pub admin: Option<RuleAdmin>,
    /// The admin endpoints' bearer token; `None` turns them off.
    pub admin_token: Option<String>,
    /// The most requests in one batch.
    pub max_batch: usize,
    /// The largest request body, in bytes; at least
    /// [`MAX_CHECK_BYTES`](fluxgate_core::api::MAX_CHECK_BYTES) is taken, so that every
    /// check a gateway sends is read.
    pub max_body_bytes: usize,
    /// Renders `/metrics`; `None` answers 404.
    pub metrics: Option<Arc<dyn Fn() -> String + Send + Sync>>,
}

impl std::fmt::Debug for AppState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AppState")
            .field("engine", &self.engine)
            .field("redis", &self.redis)
            .field("admin", &self.admin)
            .field("admin_token", &self.admin_token.as_ref().map(|_| "…"))
            .field("max_batch", &self.max_batch)
            .field("max_body_bytes", &self.max_body_bytes)
            .finish_non_exhaustive()
    }
}

/// The service's routes over `state`.
pub fn router(state: Arc<AppState>) -> Router {
    // Never below the largest check: a gateway's check answered 413 would be a failure of
    // the service, which its failure policy decides (`fail_open` admits it uncounted).
    let limit = state.max_body_bytes.max(fluxgate_core::api::MAX_CHECK_BYTES);
    Router::new()
        .route("/api/ratelimit/check", post(check))
        .route("/api/ratelimit/check/batch", post(check_batch))
        .route("/api/rulesets", get(list_rule_sets))
        .route(
            "/api/rulesets/{id}",
            get(get_rule_set).put(put_rule_set).delete(delete_rule_set),
        )
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .route("/openapi.json", get(openapi_document))
        .fallback(not_found)
        .layer(DefaultBodyLimit::max(limit))
        .with_state(state)
}

/// An error answer: a status and `{"error", "field"}`, marked with
/// [`ERROR_HEADER`](fluxgate_core::api::ERROR_HEADER) (its value the third field).
pub(crate) struct Failure(pub(crate) StatusCode, pub(crate) ApiError, pub(crate) &'static str);

impl Failure {
    /// An error answer of the service, marked as such.
    pub(crate) fn new(status: StatusCode, error: ApiError) -> Self {
        Self(status, error, "1")
    }
}

/// An error answer's `error` holds at most its first [`ERROR_HEAD`] and last
/// [`ERROR_TAIL`] characters. Parsers quote what they refuse (serde's `invalid type:
/// string "…"`, `unknown variant`, `unknown field`, a rule's pattern), and a body of up to
/// `[http] max_body_bytes` was answered with all of it, twice for an unknown field: the
/// start says what is wrong, the end what was expected and where (`expected one of …, at
/// line 1 column 9`, the longest list of a rule's fields included).
const ERROR_HEAD: usize = 192;
const ERROR_TAIL: usize = 320;
/// The most characters of an error answer's `field` (a path such as `attributes.<name>`,
/// whose name the caller wrote): its first [`FIELD_HEAD`] and last [`FIELD_TAIL`].
const FIELD_HEAD: usize = 64;
const FIELD_TAIL: usize = 32;

/// `text` when it has at most `head + tail` characters, else its first `head` and last
/// `tail` characters with `…` between them.
fn cut(text: String, head: usize, tail: usize) -> String {
    let count = text.chars().count();
    if count <= head + tail {
        return text;
    }
    let mut out: String = text.chars().take(head).collect();
    out.push('…');
    out.extend(text.chars().skip(count - tail));
    out
}

impl IntoResponse for Failure {
    fn into_response(self) -> Response {
        let Failure(status, mut error, mark) = self;
        error.error = cut(error.error, ERROR_HEAD, ERROR_TAIL);
        error.field = error.field.map(|field| cut(field, FIELD_HEAD, FIELD_TAIL));
        let mut response = (status, Json(error)).into_response();
        response.headers_mut().insert(
            header::HeaderName::from_static(fluxgate_core::api::ERROR_HEADER),
            HeaderValue::from_static(mark),
        );
        if status == StatusCode::UNAUTHORIZED {
            response
                .headers_mut()
                .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
        }
        response
    }
}

fn bad_request(error: ApiError) -> Failure {
    Failure::new(StatusCode::BAD_REQUEST, error)
}

/// Reads a JSON object body, naming the field at fault.
fn parse<T: DeserializeOwned>(body: &[u8]) -> Result<T, Failure> {
    parse_with(body, std::marker::PhantomData::<T>)
}

/// [`parse`], the body read by `seed`.
fn parse_with<'de, S: DeserializeSeed<'de>>(body: &'de [u8], seed: S) -> Result<S::Value, Failure> {
    // Structs would also read from arrays (fields by position): only objects are accepted.
    if body.iter().find(|b| !b.is_ascii_whitespace()) != Some(&b'{') {
        return Err(bad_request(ApiError::general("the body must be a JSON object")));
    }
    let mut json = serde_json::Deserializer::from_slice(body);
    let mut track = serde_path_to_error::Track::new();
    let read = seed.deserialize(serde_path_to_error::Deserializer::new(&mut json, &mut track));
    let value = read.map_err(|error| {
        let path = track.path().to_string();
        let message = if error.is_eof() {
            "the body is not complete JSON".to_owned()
        } else {
            error.to_string()
        };
        if path.is_empty() || path == "." || path == "?" {
            bad_request(ApiError::general(message))
        } else {
            bad_request(ApiError::field(path, message))
        }
    })?;
    json.end()
        .map_err(|_| bad_request(ApiError::general("trailing characters after the JSON value")))?;
    Ok(value)
}

/// An engine error as an answer: the backend or the rule provider failed (503), a rule
/// cannot be decided (500, a configuration error), the request cannot be decided as
/// described (400: a path too long to match; the gateway refuses it too, and no failure
/// policy admits it), or its rule set could not be looked up in time (503 marked
/// [`ERROR_OVERLOADED`](fluxgate_core::api::ERROR_OVERLOADED): requests can cause it, and
/// the gateway refuses the request whatever its failure policy).
fn engine_failure(error: &Error) -> Failure {
    match error {
        Error::Refused(reason) => bad_request(ApiError::general(reason.clone())),
        Error::Overloaded(reason) => Failure(
            StatusCode::SERVICE_UNAVAILABLE,
            ApiError::general(reason.clone()),
            fluxgate_core::api::ERROR_OVERLOADED,
        ),
        Error::Rule(e) => {
            tracing::error!(error = %e, "a rule cannot be decided");
            Failure::new(StatusCode::INTERNAL_SERVER_ERROR, ApiError::general(e.to_string()))
        }
        other => Failure::new(
            StatusCode::SERVICE_UNAVAILABLE,
            ApiError::general(format!("the rate-limit backend is unavailable: {other}")),
        ),
    }
}

async fn decide(engine: &Engine, request: &CheckRequest) -> Result<CheckResponse, Failure> {
    let ctx = request.to_context().map_err(bad_request)?;
    match engine.check(&ctx).await {
        Ok(decision) => Ok(CheckResponse::from_decision(&decision)),
        Err(error) => Err(engine_failure(&error)),
    }
}

/// Decides one request.
#[utoipa::path(
    post,
    path = "/api/ratelimit/check",
    request_body = CheckRequest,
    responses(
        (status = 200, description = "The decision (allowed or not)", body = CheckResponse),
        (status = 400, description = "A field is missing, of the wrong type or invalid", body = ApiError),
        (status = 408, description = "The body did not arrive in time", body = ApiError),
        (status = 413, description = "The body is larger than the limit"),
        (status = 503, description = "The backend is unavailable and the failure policy answers no decision", body = ApiError),
    ),
    tag = "check"
)]
pub(crate) async fn check(State(state): State<Arc<AppState>>, body: Bytes) -> Result<Response, Failure> {
    let request: CheckRequest = parse(&body)?;
    Ok(Json(decide(&state.engine, &request).await?).into_response())
}

/// Decides many requests, each on its own, in order.
#[utoipa::path(
    post,
    path = "/api/ratelimit/check/batch",
    request_body = BatchCheckRequest,
    responses(
        (status = 200, description = "One result per request, in order: its decision, or the error that kept it from one (`error`)", body = BatchCheckResponse),
        (status = 400, description = "A request of the batch is invalid (the field names it), or the batch is too large", body = ApiError),
        (status = 408, description = "The body did not arrive in time", body = ApiError),
        (status = 413, description = "The body is larger than the limit"),
    ),
    tag = "check"
)]
pub(crate) async fn check_batch(State(state): State<Arc<AppState>>, body: Bytes) -> Result<Response, Failure> {
    let batch = parse_with(&body, Batch { max: state.max_batch })?;
    // Every request is checked before any is decided: an invalid one decides nothing.
    let contexts = batch
        .requests
        .iter()
        .enumerate()
        .map(|(i, request)| {
            request
                .to_context()
                .map_err(|e| bad_request(e.within(&format!("requests[{i}]"))))
        })
        .collect::<Result<Vec<_>, _>>()?;
    let decisions = futures_util::future::join_all(contexts.iter().map(|ctx| state.engine.check(ctx))).await;
    // Each request's own result: a failure of one takes none of the others' decisions
    // (made, and their permits taken) from the caller.
    let results = decisions
        .iter()
        .zip(&contexts)
        .map(|(decision, ctx)| match decision {
            Ok(decision) => CheckResponse::from_decision(decision),
            Err(error) => {
                let Failure(_, answer, _) = engine_failure(error);
                CheckResponse::failed(ctx.rule_set_id(), answer.error)
            }
        })
        .collect();
    Ok(Json(BatchCheckResponse::new(results)).into_response())
}

/// Reads a [`BatchCheckRequest`] of at most `max` requests: the reading stops at the one
/// past it, so that a body of a million `{}` is refused before it becomes as many requests
/// (of about 200 bytes each, 70 times the body). Fields other than `requests` are ignored,
/// as [`BatchCheckRequest`]'s own reading ignores them.
struct Batch {
    max: usize,
}

impl<'de> DeserializeSeed<'de> for Batch {
    type Value = BatchCheckRequest;

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<Self::Value, D::Error> {
        deserializer.deserialize_map(self)
    }
}

impl<'de> Visitor<'de> for Batch {
    type Value = BatchCheckRequest;

    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("an object of `requests`")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        use serde::de::Error as _;
        let mut requests = None;
        while let Some(key) = map.next_key::<std::borrow::Cow<'de, str>>()? {
            if key == "requests" {
                if requests.is_some() {
                    return Err(A::Error::duplicate_field("requests"));
                }
                requests = Some(map.next_value_seed(Requests { max: self.max })?);
            } else {
                map.next_value::<IgnoredAny>()?;
            }
        }
        let requests = requests.ok_or_else(|| A::Error::missing_field("requests"))?;
        let mut batch = BatchCheckRequest::default();
        batch.requests = requests;
        Ok(batch)
    }
}

/// The requests of a [`Batch`], at most `max`.
struct Requests {
    max: usize,
}

impl<'de> DeserializeSeed<'de> for Requests {
    type Value = Vec<CheckRequest>;

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<Self::Value, D::Error> {
        deserializer.deserialize_seq(self)
    }
}

impl<'de> Visitor<'de> for Requests {
    type Value = Vec<CheckRequest>;

    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("an array of requests")
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
        use serde::de::Error as _;
        let mut requests = Vec::with_capacity(seq.size_hint().unwrap_or(0).min(self.max));
        while let Some(request) = seq.next_element::<CheckRequest>()? {
            if requests.len() == self.max {
                return Err(A::Error::custom(format!(
                    "more than {max} requests: at most {max} in one batch",
                    max = self.max
                )));
            }
            requests.push(request);
        }
        Ok(requests)
    }
}

/// The token of an `Authorization: Bearer <token>` value: the scheme in any case, as
/// HTTP's authentication schemes are (RFC 9110, 11.1), then one or more spaces.
fn bearer_token(value: &str) -> Option<&str> {
    let (scheme, token) = value.split_once(' ')?;
    scheme
        .eq_ignore_ascii_case("bearer")
        .then(|| token.trim_start_matches(' '))
}

/// Checks the bearer token; answers the admin when the endpoints are on.
fn admin<'a>(state: &'a AppState, headers: &HeaderMap) -> Result<&'a RuleAdmin, Failure> {
    let Some(token) = &state.admin_token else {
        return Err(Failure::new(StatusCode::NOT_FOUND, ApiError::general("not found")));
    };
    let given = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(bearer_token)
        .unwrap_or("");
    if !constant_time_eq(given.as_bytes(), token.as_bytes()) {
        return Err(Failure::new(
            StatusCode::UNAUTHORIZED,
            ApiError::general("a valid bearer token is required"),
        ));
    }
    state.admin.as_ref().ok_or_else(|| {
        Failure::new(
            StatusCode::CONFLICT,
            ApiError::general("rules come from a file: change the file, it is reloaded"),
        )
    })
}

/// Compares without stopping at the first difference.
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    let mut difference = a.len() ^ b.len();
    for (i, byte) in b.iter().enumerate() {
        difference |= usize::from(a.get(i).copied().unwrap_or(0) ^ byte);
    }
    difference == 0
}

fn store_failure(error: AdminError) -> Failure {
    match error {
        AdminError::Rule(e) => bad_request(ApiError::general(e.to_string())),
        AdminError::Store(StoreError::Rule(e)) => bad_request(ApiError::general(e.to_string())),
        other => {
            tracing::warn!(error = %other, "rule store failed");
            Failure::new(StatusCode::SERVICE_UNAVAILABLE, ApiError::general(other.to_string()))
        }
    }
}

fn json<T: Serialize>(status: StatusCode, value: &T) -> Response {
    (status, Json(value)).into_response()
}

/// Lists the stored rule sets.
#[utoipa::path(
    get,
    path = "/api/rulesets",
    responses(
        (status = 200, description = "Every stored rule set, by id", body = [Object]),
        (status = 401, description = "The bearer token is missing or wrong", body = ApiError),
        (status = 404, description = "The admin endpoints are off (no token configured)", body = ApiError),
        (status = 409, description = "Rules come from a file", body = ApiError),
        (status = 503, description = "The rule store is unavailable", body = ApiError),
    ),
    security(("bearer" = [])),
    tag = "rules"
)]
pub(crate) async fn list_rule_sets(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
) -> Result<Response, Failure> {
    let specs = admin(&state, &headers)?.list().await.map_err(store_failure)?;
    Ok(json(StatusCode::OK, &specs))
}

/// Reads one stored rule set.
#[utoipa::path(
    get,
    path = "/api/rulesets/{id}",
    params(("id" = String, Path, description = "The rule set id")),
    responses(
        (status = 200, description = "The rule set, as in a rule file (JSON)", body = Object),
        (status = 401, description = "The bearer token is missing or wrong", body = ApiError),
        (status = 404, description = "No such rule set, or the admin endpoints are off", body = ApiError),
        (status = 409, description = "Rules come from a file", body = ApiError),
        (status = 503, description = "The rule store is unavailable", body = ApiError),
    ),
    security(("bearer" = [])),
    tag = "rules"
)]
pub(crate) async fn get_rule_set(
    State(state): State<Arc<AppState>>,
    Path(id): Path<String>,
    headers: HeaderMap,
) -> Result<Response, Failure> {
    let specs = admin(&state, &headers)?.list().await.map_err(store_failure)?;
    let spec = specs
        .iter()
        .find(|spec| spec.id == id)
        .ok_or_else(|| no_rule_set(&id))?;
    Ok(json(StatusCode::OK, spec))
}

fn no_rule_set(id: &str) -> Failure {
    Failure::new(
        StatusCode::NOT_FOUND,
        ApiError::general(format!("no rule set `{}`", Shown(id))),
    )
}

/// The outline of a rule set in a request body, for the OpenAPI document: an id and its
/// rules, each as in a rule file (the service validates them in full).
#[derive(utoipa::ToSchema)]
#[allow(dead_code)]
pub(crate) struct RuleSetBody {
    /// The rule set's id, the same as the path's.
    #[schema(pattern = "^[A-Za-z0-9_.-]{1,64}$")]
    id: String,
    /// Its rules; none when absent.
    rules: Option<Vec<serde_json::Value>>,
}

/// Validates, stores and announces a rule set.
#[utoipa::path(
    put,
    path = "/api/rulesets/{id}",
    params(("id" = String, Path, description = "The rule set id; the body's `id` must be the same")),
    request_body(content = RuleSetBody, description = "The rule set, as in a rule file (JSON; see docs/configuration.md)"),
    responses(
        (status = 200, description = "Stored, and the change published", body = Object),
        (status = 400, description = "Not a valid rule set (nothing stored)", body = ApiError),
        (status = 401, description = "The bearer token is missing or wrong", body = ApiError),
        (status = 404, description = "The admin endpoints are off", body = ApiError),
        (status = 409, description = "Rules come from a file", body = ApiError),
        (status = 408, description = "The body did not arrive in time", body = ApiError),
        (status = 413, description = "The body is larger than the limit"),
        (status = 503, description = "The rule store is unavailable", body = ApiError),
    ),
    security(("bearer" = [])),
    tag = "rules"
)]
pub(crate) async fn put_rule_set(
    State(state): State<Arc<AppState>>,
    Path(id): Path<String>,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Response, Failure> {
    let admin = admin(&state, &headers)?;
    let spec: RuleSetSpec = parse(&body)?;
    if spec.id != id {
        let error = ApiError::field(
            "id",
            format!("`{}` differs from the path's `{}`", Shown(&spec.id), Shown(&id)),
        );
        return Err(bad_request(error));
    }
    let change = admin.put(&spec).await.map_err(store_failure)?;
    Ok(json(
        StatusCode::OK,
        &serde_json::json!({"ruleSetId": id, "eventId": change.event_id}),
    ))
}

/// Deletes a rule set and announces it.
#[utoipa::path(
    delete,
    path = "/api/rulesets/{id}",
    params(("id" = String, Path, description = "The rule set id")),
    responses(
        (status = 204, description = "Deleted, and the change published"),
        (status = 401, description = "The bearer token is missing or wrong", body = ApiError),
        (status = 404, description = "No such rule set, or the admin endpoints are off", body = ApiError),
        (status = 409, description = "Rules come from a file", body = ApiError),
        (status = 503, description = "The rule store is unavailable", body = ApiError),
    ),
    security(("bearer" = [])),
    tag = "rules"
)]
pub(crate) async fn delete_rule_set(
    State(state): State<Arc<AppState>>,
    Path(id): Path<String>,
    headers: HeaderMap,
) -> Result<Response, Failure> {
    match admin(&state, &headers)?.delete(&id).await.map_err(store_failure)? {
        Some(_) => Ok(StatusCode::NO_CONTENT.into_response()),
        None => Err(no_rule_set(&id)),
    }
}

/// The backend's health.
#[derive(Debug, Serialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase")]
pub(crate) struct HealthReport {
    /// `up` or `down`.
    status: &'static str,
    /// `memory` or `redis`.
    backend: &'static str,
    /// How long a `PING` took, in milliseconds (Redis).
    #[serde(skip_serializing_if = "Option::is_none")]
    latency_ms: Option<f64>,
    /// `cluster_state` of a Redis Cluster.
    #[serde(skip_serializing_if = "Option::is_none")]
    cluster_state: Option<String>,
    /// Why the backend is down.
    #[serde(skip_serializing_if = "Option::is_none")]
    error: Option<String>,
}

/// Whether the backend answers: 200 when up, 503 when down.
#[utoipa::path(
    get,
    path = "/health",
    responses(
        (status = 200, description = "The backend is up", body = HealthReport),
        (status = 503, description = "The backend is down (or a cluster is not ok)", body = HealthReport),
    ),
    tag = "operations"
)]
pub(crate) async fn health(State(state): State<Arc<AppState>>) -> Response {
    let Some(redis) = &state.redis else {
        let report = HealthReport {
            status: "up",
            backend: "memory",
            latency_ms: None,
            cluster_state: None,
            error: None,
        };
        return json(StatusCode::OK, &report);
    };
    let (status, report) = match redis.health().await {
        Ok(health) => {
            let ok = health.cluster_state.as_deref().is_none_or(|state| state == "ok");
            let report = HealthReport {
                status: if ok { "up" } else { "down" },
                backend: "redis",
                latency_ms: Some(health.latency.as_secs_f64() * 1e3),
                cluster_state: health.cluster_state,
                error: None,
            };
            let status = if ok {
                StatusCode::OK
            } else {
                StatusCode::SERVICE_UNAVAILABLE
            };
            (status, report)
        }
        Err(error) => (
            StatusCode::SERVICE_UNAVAILABLE,
            HealthReport {
                status: "down",
                backend: "redis",
                latency_ms: None,
                cluster_state: None,
                error: Some(error.to_string()),
            },
        ),
    };
    json(status, &report)
}

/// The metrics, as Prometheus text.
#[utoipa::path(
    get,
    path = "/metrics",
    responses(
        (status = 200, description = "Prometheus text format", body = String, content_type = "text/plain"),
        (status = 404, description = "Metrics are off", body = ApiError),
    ),
    tag = "operations"
)]
pub(crate) async fn metrics(State(state): State<Arc<AppState>>) -> Response {
    match &state.metrics {
        Some(render) => (
            [(header::CONTENT_TYPE, "text/plain; version=0.0.4; charset=utf-8")],
            render(),
        )
            .into_response(),
        None => Failure::new(StatusCode::NOT_FOUND, ApiError::general("metrics are off")).into_response(),
    }
}

/// This API's OpenAPI document.
#[utoipa::path(
    get,
    path = "/openapi.json",
    responses((status = 200, description = "The OpenAPI 3.1 document of this API", body = Object)),
    tag = "operations"
)]
pub(crate) async fn openapi_document() -> Response {
    ([(header::CONTENT_TYPE, "application/json")], openapi::json()).into_response()
}

async fn not_found() -> Response {
    Failure::new(StatusCode::NOT_FOUND, ApiError::general("not found")).into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The bounded reader [`Batch`] reads `requests` alone, and builds the rest of a
    /// [`BatchCheckRequest`] from its default: a field added to it must be read there too,
    /// or a batch would lose it.
    #[test]
    fn the_bounded_batch_reader_reads_every_field_of_a_batch() {
        let fields = serde_json::to_value(BatchCheckRequest::default()).expect("JSON");
        let names: Vec<&str> = fields
            .as_object()
            .expect("an object")
            .keys()
            .map(String::as_str)
            .collect();
        assert_eq!(names, ["requests"], "read each new field in `Batch::visit_map`");
        let batch = parse_with(br#"{"requests": [{}, {}]}"#, Batch { max: 2 });
        assert_eq!(batch.ok().map(|batch| batch.requests.len()), Some(2));
    }
}

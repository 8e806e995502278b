//! The HTTP side: routes, the API key check, request limits, turning a request into a
//! scheduler job, and streaming its events back as server-sent events or one JSON body.

use std::convert::Infallible;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use axum::body::{Body, Bytes};
use axum::extract::{DefaultBodyLimit, Path, Request, State};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use futures_util::StreamExt;
use serde_json::{json, Value};
use sieve_model::chat::{render_chat, ChatMessage};
use sieve_model::generate::GenerateOptions;
use sieve_model::sampling::SamplingParams;
use sieve_model::tokenizer::Tokenizer;
use tokio::sync::mpsc;

use crate::api::{self, ApiError, Endpoint, GenerationRequest, PromptInput, ResponseMeta};
use crate::metrics::Metrics;
use crate::scheduler::{Event, Job, Queue, Rejected};

/// The chat page, compiled in.
const INDEX_HTML: &str = include_str!("../static/index.html");

/// What every handler shares.
pub struct AppState {
    pub queue: Arc<Queue>,
    pub metrics: Arc<Metrics>,
    pub tokenizer: Arc<Tokenizer>,
    pub model_name: String,
    pub api_key: Option<String>,
    /// Positions per cache slot: prompt and generated tokens together.
    pub context: usize,
    pub max_tokens_cap: usize,
    /// Largest request body, bytes.
    pub body_limit: usize,
    /// Time to receive a request's whole body.
    pub body_timeout: Duration,
    pub created: u64,
    next_id: AtomicU64,
}

impl AppState {
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        queue: Arc<Queue>,
        metrics: Arc<Metrics>,
        tokenizer: Arc<Tokenizer>,
        model_name: String,
        api_key: Option<String>,
        context: usize,
        max_tokens_cap: usize,
        body_limit: usize,
        body_timeout: Duration,
    ) -> Self {
        Self {
            queue,
            metrics,
            tokenizer,
            model_name,
            api_key,
            context,
            max_tokens_cap,
            body_limit,
            body_timeout,
            created: unix_now(),
            next_id: AtomicU64::new(1),
        }
    }
}

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut response = (self.status, Json(self.body())).into_response();
        if let Some(seconds) = self.retry_after {
            if let Ok(v) = HeaderValue::from_str(&seconds.to_string()) {
                response.headers_mut().insert(header::RETRY_AFTER, v);
            }
        }
        response
    }
}

/// The router with every route, the body limit and the request counter.
pub fn router(state: Arc<AppState>, body_limit: usize) -> Router {
    let v1 = Router::new()
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/models", get(models))
        .route("/v1/models/{id}", get(model))
        .route_layer(middleware::from_fn_with_state(
            state.clone(),
            require_api_key,
        ));
    Router::new()
        .route("/", get(index))
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .merge(v1)
        .fallback(not_found)
        .layer(DefaultBodyLimit::max(body_limit))
        .layer(middleware::from_fn_with_state(
            state.clone(),
            refuse_oversize_bodies,
        ))
        .layer(middleware::from_fn_with_state(
            state.clone(),
            count_requests,
        ))
        .with_state(state)
}

async fn count_requests(
    State(state): State<Arc<AppState>>,
    request: Request,
    next: Next,
) -> Response {
    let path = request.uri().path().to_owned();
    let response = next.run(request).await;
    // Only known paths get their own series, so random URLs cannot grow the metrics.
    let known = [
        "/",
        "/health",
        "/metrics",
        "/v1/completions",
        "/v1/chat/completions",
        "/v1/models",
    ];
    let label = if known.contains(&path.as_str()) {
        path.as_str()
    } else if path.starts_with("/v1/models/") {
        "/v1/models/{id}"
    } else {
        "other"
    };
    state
        .metrics
        .count_request(label, response.status().as_u16());
    response
}

/// A body the request itself declares too large (`Content-Length`) is refused before any of
/// it is read: at once, and without the `100 Continue` that reading would send to a client
/// that asked with `Expect: 100-continue`.
async fn refuse_oversize_bodies(
    State(state): State<Arc<AppState>>,
    request: Request,
    next: Next,
) -> Response {
    let declared = request
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<u64>().ok());
    if let Some(length) = declared {
        if length > state.body_limit as u64 {
            return too_large(length, state.body_limit);
        }
    }
    next.run(request).await
}

fn too_large(length: u64, limit: usize) -> Response {
    let mut response = ApiError::invalid(
        format!("the request body is {length} bytes; this server accepts at most {limit}"),
        None,
    )
    .with_status(StatusCode::PAYLOAD_TOO_LARGE)
    .with_code("request_too_large")
    .into_response();
    // The body was not read: the connection cannot carry another request.
    response
        .headers_mut()
        .insert(header::CONNECTION, HeaderValue::from_static("close"));
    response
}

/// The credentials of an `Authorization: Bearer KEY` header: the scheme is matched without
/// regard to case (RFC 7235), the key is what follows the spaces after it.
fn bearer_credentials(value: &str) -> Option<&str> {
    let value = value.trim_start();
    let (scheme, rest) = value.split_at_checked(6)?;
    if !scheme.eq_ignore_ascii_case("bearer") || !rest.starts_with([' ', '\t']) {
        return None;
    }
    Some(rest.trim())
}

async fn require_api_key(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    request: Request,
    next: Next,
) -> Response {
    if let Some(key) = &state.api_key {
        let given = headers
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(bearer_credentials);
        match given {
            None => {
                return ApiError::unauthorized("missing API key: send 'Authorization: Bearer KEY'")
                    .into_response()
            }
            Some(k) if !constant_time_eq(k.as_bytes(), key.as_bytes()) => {
                return ApiError::unauthorized("incorrect API key").into_response()
            }
            Some(_) => {}
        }
    }
    next.run(request).await
}

/// Compares without an early exit on the first differing byte.
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

async fn index() -> Response {
    (
        [(header::CONTENT_TYPE, "text/html; charset=utf-8")],
        INDEX_HTML,
    )
        .into_response()
}

async fn health(State(state): State<Arc<AppState>>) -> Response {
    if !state.queue.scheduler_alive() {
        (
            StatusCode::SERVICE_UNAVAILABLE,
            Json(json!({"status": "scheduler stopped"})),
        )
            .into_response()
    } else if state.queue.is_closed() {
        (
            StatusCode::SERVICE_UNAVAILABLE,
            Json(json!({"status": "draining"})),
        )
            .into_response()
    } else {
        Json(json!({"status": "ok"})).into_response()
    }
}

async fn metrics(State(state): State<Arc<AppState>>) -> Response {
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        state.metrics.render(),
    )
        .into_response()
}

fn model_card(state: &AppState) -> Value {
    json!({
        "id": state.model_name,
        "object": "model",
        "created": state.created,
        "owned_by": "sieve",
    })
}

async fn models(State(state): State<Arc<AppState>>) -> Response {
    Json(json!({"object": "list", "data": [model_card(&state)]})).into_response()
}

async fn model(State(state): State<Arc<AppState>>, Path(id): Path<String>) -> Response {
    if id == state.model_name {
        Json(model_card(&state)).into_response()
    } else {
        unknown_model(&state, &id).into_response()
    }
}

fn unknown_model(state: &AppState, name: &str) -> ApiError {
    ApiError::not_found(format!(
        "the model '{name}' does not exist; this server serves '{}'",
        state.model_name
    ))
    .with_code("model_not_found")
}

async fn not_found(request: Request) -> Response {
    ApiError::not_found(format!(
        "no route for {} {}",
        request.method(),
        request.uri().path()
    ))
    .into_response()
}

async fn completions(State(state): State<Arc<AppState>>, request: Request) -> Response {
    match read_body(&state, request.into_body()).await {
        Ok(body) => generate(state, Endpoint::Completions, &body).await,
        Err(response) => response,
    }
}

async fn chat_completions(State(state): State<Arc<AppState>>, request: Request) -> Response {
    match read_body(&state, request.into_body()).await {
        Ok(body) => generate(state, Endpoint::ChatCompletions, &body).await,
        Err(response) => response,
    }
}

/// Reads a request body of at most `body_limit` bytes within `body_timeout`: 413 beyond the
/// size (chunked bodies, whose size is not declared), 408 when it does not arrive in time, 400
/// when the framing is broken or the client goes away.
async fn read_body(state: &AppState, body: Body) -> Result<Bytes, Response> {
    let limit = state.body_limit;
    let read = async {
        let mut chunks = body.into_data_stream();
        let mut bytes: Vec<u8> = Vec::new();
        while let Some(chunk) = chunks.next().await {
            let chunk = chunk.map_err(|e| {
                ApiError::invalid(format!("could not read the request body: {e}"), None)
                    .into_response()
            })?;
            if bytes.len().saturating_add(chunk.len()) > limit {
                let seen = bytes.len().saturating_add(chunk.len()) as u64;
                return Err(too_large(seen, limit));
            }
            bytes.extend_from_slice(&chunk);
        }
        Ok(Bytes::from(bytes))
    };
    match tokio::time::timeout(state.body_timeout, read).await {
        Ok(result) => result,
        Err(_) => {
            state.metrics.timeouts.fetch_add(1, Ordering::Relaxed);
            let mut response = ApiError::invalid(
                format!(
                    "the request body did not arrive within {} s",
                    state.body_timeout.as_secs_f64()
                ),
                None,
            )
            .with_status(StatusCode::REQUEST_TIMEOUT)
            .with_code("request_timeout")
            .into_response();
            response
                .headers_mut()
                .insert(header::CONNECTION, HeaderValue::from_static("close"));
            Err(response)
        }
    }
}

/// A request checked and turned into prompt tokens and generation options.
struct Prepared {
    prompt: Vec<u32>,
    options: GenerateOptions,
    stream: bool,
    include_usage: bool,
}

fn prepare(state: &AppState, endpoint: Endpoint, bytes: &[u8]) -> Result<Prepared, ApiError> {
    let request: GenerationRequest = api::parse_request(endpoint, bytes)?;
    if let Some(name) = &request.model {
        if name != &state.model_name {
            return Err(unknown_model(state, name));
        }
    }
    let tokenizer = &state.tokenizer;
    let prompt = match &request.input {
        PromptInput::Text(text) => tokenizer.encode(text, tokenizer.add_bos_by_default()),
        PromptInput::Chat(messages) => {
            let messages: Vec<ChatMessage> = messages
                .iter()
                .map(|(role, content)| ChatMessage::new(role.clone(), content.clone()))
                .collect();
            // Message content is text: a "<|im_start|>" a user writes stays characters, so
            // only the template's own markers are special tokens (no forged turns).
            render_chat(tokenizer.chat_template(), &messages, true)
                .and_then(|rendered| rendered.encode(tokenizer))
        }
    }
    .map_err(|e| ApiError::invalid(format!("could not tokenize the prompt: {e}"), None))?;
    let param = match endpoint {
        Endpoint::Completions => "prompt",
        Endpoint::ChatCompletions => "messages",
    };
    if prompt.is_empty() {
        return Err(ApiError::invalid("the prompt has no tokens", Some(param)));
    }
    if prompt.len() >= state.context {
        return Err(ApiError::invalid(
            format!(
                "the prompt has {} tokens but this server's context holds {} (prompt and \
                 completion together); shorten the prompt",
                prompt.len(),
                state.context
            ),
            Some(param),
        )
        .with_code("context_length_exceeded"));
    }
    let max_tokens = match request.max_tokens {
        Some(n) if n > state.max_tokens_cap => {
            return Err(ApiError::invalid(
                format!(
                    "max_tokens is {n} but this server allows at most {}",
                    state.max_tokens_cap
                ),
                Some("max_tokens"),
            ))
        }
        Some(n) => n,
        // OpenAI's defaults: 16 for completions, as much as fits for chat.
        None => match endpoint {
            Endpoint::Completions => 16.min(state.max_tokens_cap),
            Endpoint::ChatCompletions => state.max_tokens_cap,
        },
    };
    let seed = request.seed.unwrap_or_else(|| {
        // No seed asked for: a different draw per request.
        let nanos = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64);
        nanos
            ^ state
                .next_id
                .load(Ordering::Relaxed)
                .wrapping_mul(0x9E37_79B9_7F4A_7C15)
    });
    let options = GenerateOptions {
        max_tokens,
        sampling: SamplingParams {
            temperature: request.temperature,
            top_k: 0,
            top_p: request.top_p,
            repetition_penalty: 1.0,
            seed,
        },
        stop_strings: request.stop.clone(),
        extra_eos_ids: Vec::new(),
    };
    options
        .sampling
        .validate()
        .map_err(|e| ApiError::invalid(e.to_string(), None))?;
    Ok(Prepared {
        prompt,
        options,
        stream: request.stream,
        include_usage: request.include_usage,
    })
}

async fn generate(state: Arc<AppState>, endpoint: Endpoint, body: &[u8]) -> Response {
    let prepared = match prepare(&state, endpoint, body) {
        Ok(p) => p,
        Err(e) => return e.into_response(),
    };
    let (tx, rx) = mpsc::unbounded_channel();
    let job = Job {
        prompt: prepared.prompt,
        options: prepared.options,
        events: tx,
        enqueued: Instant::now(),
    };
    match state.queue.submit(job) {
        Ok(()) => {}
        Err(Rejected::Full) => {
            state
                .metrics
                .rejected_queue_full
                .fetch_add(1, Ordering::Relaxed);
            return ApiError::overloaded("the server is at capacity; retry shortly", 1)
                .into_response();
        }
        Err(Rejected::ShuttingDown) if !state.queue.scheduler_alive() => {
            state
                .metrics
                .rejected_shutdown
                .fetch_add(1, Ordering::Relaxed);
            return ApiError::overloaded(
                "the server's model scheduler has stopped; the server is shutting down",
                5,
            )
            .into_response();
        }
        Err(Rejected::ShuttingDown) => {
            state
                .metrics
                .rejected_shutdown
                .fetch_add(1, Ordering::Relaxed);
            return ApiError::overloaded("the server is shutting down", 5).into_response();
        }
    }
    let id = state.next_id.fetch_add(1, Ordering::Relaxed);
    let meta = ResponseMeta {
        endpoint,
        id: match endpoint {
            Endpoint::Completions => format!("cmpl-{:x}-{id}", state.created),
            Endpoint::ChatCompletions => format!("chatcmpl-{:x}-{id}", state.created),
        },
        created: unix_now(),
        model: state.model_name.clone(),
    };
    if prepared.stream {
        stream_response(meta, rx, prepared.include_usage)
    } else {
        whole_response(meta, rx).await
    }
}

/// Waits for the whole generation. If the client goes away, this future is dropped with its
/// receiver, and the scheduler stops the sequence at its next step.
async fn whole_response(meta: ResponseMeta, mut rx: mpsc::UnboundedReceiver<Event>) -> Response {
    let mut text = String::new();
    while let Some(event) = rx.recv().await {
        match event {
            Event::Text(t) => text.push_str(&t),
            Event::Done {
                reason,
                prompt_tokens,
                completion_tokens,
            } => {
                let usage = api::usage(prompt_tokens, completion_tokens);
                return Json(meta.response(&text, api::finish_reason(reason), usage))
                    .into_response();
            }
            Event::Failed(message) => return ApiError::internal(message).into_response(),
        }
    }
    ApiError::internal("generation ended without a result").into_response()
}

struct StreamState {
    meta: ResponseMeta,
    rx: mpsc::UnboundedReceiver<Event>,
    include_usage: bool,
    first: bool,
    done: bool,
}

fn sse(value: &Value) -> String {
    format!("data: {value}\n\n")
}

/// Server-sent events in OpenAI's chunk format, ending with `data: [DONE]`. When the client
/// disconnects, hyper drops this body and the receiver with it; the scheduler sees the closed
/// channel and frees the sequence's slot.
fn stream_response(
    meta: ResponseMeta,
    rx: mpsc::UnboundedReceiver<Event>,
    include_usage: bool,
) -> Response {
    let state = StreamState {
        meta,
        rx,
        include_usage,
        first: true,
        done: false,
    };
    let frames = futures_util::stream::unfold(state, |mut st| async move {
        if st.done {
            return None;
        }
        if st.first && st.meta.endpoint == Endpoint::ChatCompletions {
            // The role chunk goes out at once, before the first token.
            st.first = false;
            let frame = sse(&st.meta.chunk("", true, None));
            return Some((Ok::<Bytes, Infallible>(Bytes::from(frame)), st));
        }
        let frame = match st.rx.recv().await {
            Some(Event::Text(t)) => {
                let first = std::mem::replace(&mut st.first, false);
                sse(&st.meta.chunk(&t, first, None))
            }
            Some(Event::Done {
                reason,
                prompt_tokens,
                completion_tokens,
            }) => {
                st.done = true;
                let mut out = sse(&st.meta.chunk("", false, Some(api::finish_reason(reason))));
                if st.include_usage {
                    out.push_str(&sse(&st
                        .meta
                        .usage_chunk(api::usage(prompt_tokens, completion_tokens))));
                }
                out.push_str("data: [DONE]\n\n");
                out
            }
            Some(Event::Failed(message)) => {
                st.done = true;
                format!(
                    "{}data: [DONE]\n\n",
                    sse(&ApiError::internal(message).body())
                )
            }
            None => {
                st.done = true;
                format!(
                    "{}data: [DONE]\n\n",
                    sse(&ApiError::internal("generation ended without a result").body())
                )
            }
        };
        Some((Ok(Bytes::from(frame)), st))
    });
    Response::builder()
        .status(StatusCode::OK)
        .header(header::CONTENT_TYPE, "text/event-stream")
        .header(header::CACHE_CONTROL, "no-cache")
        .header("x-accel-buffering", "no")
        .body(Body::from_stream(frames))
        .unwrap_or_else(|e| ApiError::internal(format!("building the stream: {e}")).into_response())
}

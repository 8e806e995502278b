//! The OpenAI wire format: request bodies read field by field (so a wrong type names its
//! field), the JSON errors, and the response and stream-chunk bodies.

use axum::http::StatusCode;
use serde_json::{json, Map, Value};

/// An error in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`.
#[derive(Clone, Debug, PartialEq)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    /// `invalid_request_error`, `authentication_error`, `server_error`, ...
    pub kind: &'static str,
    pub param: Option<String>,
    pub code: Option<&'static str>,
    /// Seconds for a `Retry-After` header (503 when the queue is full).
    pub retry_after: Option<u64>,
}

impl ApiError {
    pub fn invalid(message: impl Into<String>, param: Option<&str>) -> Self {
        Self {
            status: StatusCode::BAD_REQUEST,
            message: message.into(),
            kind: "invalid_request_error",
            param: param.map(str::to_owned),
            code: None,
            retry_after: None,
        }
    }

    pub fn with_code(mut self, code: &'static str) -> Self {
        self.code = Some(code);
        self
    }

    pub fn with_status(mut self, status: StatusCode) -> Self {
        self.status = status;
        self
    }

    pub fn unauthorized(message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::UNAUTHORIZED,
            kind: "authentication_error",
            code: Some("invalid_api_key"),
            ..Self::invalid(message, None)
        }
    }

    pub fn not_found(message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::NOT_FOUND,
            ..Self::invalid(message, None)
        }
    }

    pub fn overloaded(message: impl Into<String>, retry_after: u64) -> Self {
        Self {
            status: StatusCode::SERVICE_UNAVAILABLE,
            kind: "server_error",
            code: Some("server_overloaded"),
            retry_after: Some(retry_after),
            ..Self::invalid(message, None)
        }
    }

    pub fn internal(message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::INTERNAL_SERVER_ERROR,
            kind: "server_error",
            ..Self::invalid(message, None)
        }
    }

    pub fn body(&self) -> Value {
        json!({
            "error": {
                "message": self.message,
                "type": self.kind,
                "param": self.param,
                "code": self.code,
            }
        })
    }
}

impl std::fmt::Display for ApiError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} ({})", self.message, self.status)
    }
}

/// The two generation endpoints.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Endpoint {
    Completions,
    ChatCompletions,
}

impl Endpoint {
    pub fn path(self) -> &'static str {
        match self {
            Endpoint::Completions => "/v1/completions",
            Endpoint::ChatCompletions => "/v1/chat/completions",
        }
    }
}

/// What the request asks to be generated from.
#[derive(Clone, Debug, PartialEq)]
pub enum PromptInput {
    Text(String),
    Chat(Vec<(String, String)>),
}

/// A parsed `/v1/completions` or `/v1/chat/completions` body.
#[derive(Clone, Debug, PartialEq)]
pub struct GenerationRequest {
    pub model: Option<String>,
    pub input: PromptInput,
    pub max_tokens: Option<usize>,
    pub temperature: f32,
    pub top_p: f32,
    pub stop: Vec<String>,
    pub seed: Option<u64>,
    pub stream: bool,
    /// `stream_options.include_usage`: a last chunk with the usage counts.
    pub include_usage: bool,
}

/// OpenAI's limit on stop sequences.
pub const MAX_STOP_STRINGS: usize = 4;

fn wrong_type(field: &str, expected: &str, got: &Value) -> ApiError {
    let got = match got {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    };
    ApiError::invalid(
        format!("'{field}' must be {expected}, got {got}"),
        Some(field),
    )
}

/// A field that is absent or `null` reads as `None`.
fn field<'a>(body: &'a Map<String, Value>, name: &str) -> Option<&'a Value> {
    body.get(name).filter(|v| !v.is_null())
}

fn opt_string(body: &Map<String, Value>, name: &str) -> Result<Option<String>, ApiError> {
    match field(body, name) {
        None => Ok(None),
        Some(Value::String(s)) => Ok(Some(s.clone())),
        Some(v) => Err(wrong_type(name, "a string", v)),
    }
}

fn opt_bool(body: &Map<String, Value>, name: &str) -> Result<Option<bool>, ApiError> {
    match field(body, name) {
        None => Ok(None),
        Some(Value::Bool(b)) => Ok(Some(*b)),
        Some(v) => Err(wrong_type(name, "a boolean", v)),
    }
}

fn opt_number(body: &Map<String, Value>, name: &str) -> Result<Option<f64>, ApiError> {
    match field(body, name) {
        None => Ok(None),
        Some(Value::Number(n)) => Ok(n.as_f64()),
        Some(v) => Err(wrong_type(name, "a number", v)),
    }
}

fn opt_unsigned(body: &Map<String, Value>, name: &str) -> Result<Option<u64>, ApiError> {
    match field(body, name) {
        None => Ok(None),
        Some(Value::Number(n)) => match n.as_u64() {
            Some(v) => Ok(Some(v)),
            None => Err(ApiError::invalid(
                format!("'{name}' must be a non-negative integer, got {n}"),
                Some(name),
            )),
        },
        Some(v) => Err(wrong_type(name, "a non-negative integer", v)),
    }
}

fn stop_strings(body: &Map<String, Value>) -> Result<Vec<String>, ApiError> {
    let stops = match field(body, "stop") {
        None => Vec::new(),
        Some(Value::String(s)) => vec![s.clone()],
        Some(Value::Array(items)) => items
            .iter()
            .map(|v| match v {
                Value::String(s) => Ok(s.clone()),
                other => Err(wrong_type("stop", "a string or an array of strings", other)),
            })
            .collect::<Result<_, _>>()?,
        Some(v) => return Err(wrong_type("stop", "a string or an array of strings", v)),
    };
    if stops.len() > MAX_STOP_STRINGS {
        return Err(ApiError::invalid(
            format!(
                "'stop' has {} sequences; at most {MAX_STOP_STRINGS} are allowed",
                stops.len()
            ),
            Some("stop"),
        ));
    }
    if stops.iter().any(String::is_empty) {
        return Err(ApiError::invalid(
            "'stop' sequences must not be empty",
            Some("stop"),
        ));
    }
    Ok(stops)
}

fn completion_prompt(body: &Map<String, Value>) -> Result<String, ApiError> {
    match field(body, "prompt") {
        None => Err(ApiError::invalid("'prompt' is required", Some("prompt"))),
        Some(Value::String(s)) => Ok(s.clone()),
        // One prompt in an array is the same request; several would need `n` answers.
        Some(Value::Array(items)) => match items.as_slice() {
            [Value::String(s)] => Ok(s.clone()),
            _ => Err(ApiError::invalid(
                "'prompt' must be a string or an array of exactly one string",
                Some("prompt"),
            )),
        },
        Some(v) => Err(wrong_type("prompt", "a string", v)),
    }
}

/// A message's `content`: a string, or an array of `{"type": "text", "text": ...}` parts.
fn message_content(index: usize, value: Option<&Value>) -> Result<String, ApiError> {
    let param = format!("messages[{index}].content");
    match value {
        None | Some(Value::Null) => Ok(String::new()),
        Some(Value::String(s)) => Ok(s.clone()),
        Some(Value::Array(parts)) => {
            let mut text = String::new();
            for part in parts {
                let kind = part.get("type").and_then(Value::as_str);
                match (kind, part.get("text")) {
                    (Some("text"), Some(Value::String(t))) => text.push_str(t),
                    _ => {
                        return Err(ApiError::invalid(
                            format!("{param}: only text parts ({{\"type\": \"text\", \"text\": ...}}) are supported"),
                            Some(&param),
                        ))
                    }
                }
            }
            Ok(text)
        }
        Some(v) => Err(wrong_type(&param, "a string or an array of text parts", v)),
    }
}

fn chat_messages(body: &Map<String, Value>) -> Result<Vec<(String, String)>, ApiError> {
    let items = match field(body, "messages") {
        None => {
            return Err(ApiError::invalid(
                "'messages' is required",
                Some("messages"),
            ))
        }
        Some(Value::Array(items)) => items,
        Some(v) => return Err(wrong_type("messages", "an array of messages", v)),
    };
    if items.is_empty() {
        return Err(ApiError::invalid(
            "'messages' must hold at least one message",
            Some("messages"),
        ));
    }
    items
        .iter()
        .enumerate()
        .map(|(i, m)| {
            let Value::Object(m) = m else {
                return Err(wrong_type(&format!("messages[{i}]"), "an object", m));
            };
            let role = match m.get("role") {
                Some(Value::String(r)) if !r.trim().is_empty() => r.clone(),
                Some(Value::String(_)) | None | Some(Value::Null) => {
                    return Err(ApiError::invalid(
                        format!("messages[{i}].role is required"),
                        Some(&format!("messages[{i}].role")),
                    ))
                }
                Some(v) => return Err(wrong_type(&format!("messages[{i}].role"), "a string", v)),
            };
            Ok((role, message_content(i, m.get("content"))?))
        })
        .collect()
}

/// OpenAI request fields this server does not implement, each with the values that ask for
/// nothing (absent and `null` always do). A request giving any other value is refused with a
/// 400 naming the field, rather than answered as if the field had been honoured.
pub const UNSUPPORTED_FIELDS: &[(&str, &str)] = &[
    ("logprobs", "null or false"),
    ("top_logprobs", "null or 0"),
    ("echo", "null or false"),
    ("best_of", "null or 1"),
    ("suffix", "null or \"\""),
    ("logit_bias", "null or {}"),
    ("presence_penalty", "null or 0"),
    ("frequency_penalty", "null or 0"),
    ("tools", "null or []"),
    ("tool_choice", "null or \"none\""),
    ("functions", "null or []"),
    ("function_call", "null or \"none\""),
    ("response_format", "null or {\"type\": \"text\"}"),
    ("modalities", "null or [\"text\"]"),
    ("audio", "null"),
    ("prediction", "null"),
];

/// Whether `value` of the unsupported field `name` asks for nothing.
fn asks_for_nothing(name: &str, value: &Value) -> bool {
    let zero = || value.as_f64() == Some(0.0);
    match (name, value) {
        (_, Value::Null) => true,
        ("logprobs" | "echo", Value::Bool(false)) => true,
        ("top_logprobs" | "presence_penalty" | "frequency_penalty", Value::Number(_)) => zero(),
        ("best_of", Value::Number(n)) => n.as_f64() == Some(1.0),
        ("suffix", Value::String(s)) => s.is_empty(),
        ("logit_bias", Value::Object(o)) => o.is_empty(),
        ("tools" | "functions", Value::Array(a)) => a.is_empty(),
        ("tool_choice" | "function_call", Value::String(s)) => s == "none",
        ("response_format", Value::Object(o)) => {
            o.get("type").and_then(Value::as_str) == Some("text") && o.len() == 1
        }
        ("modalities", Value::Array(a)) => a.iter().all(|m| m.as_str() == Some("text")),
        _ => false,
    }
}

fn refuse_unsupported(body: &Map<String, Value>) -> Result<(), ApiError> {
    for &(name, neutral) in UNSUPPORTED_FIELDS {
        if let Some(value) = body.get(name) {
            if !asks_for_nothing(name, value) {
                return Err(ApiError::invalid(
                    format!(
                        "'{name}' is not supported by this server (accepted only as {neutral}), \
                         got {value}"
                    ),
                    Some(name),
                )
                .with_code("unsupported_parameter"));
            }
        }
    }
    Ok(())
}

/// Reads a request body. Unknown fields are ignored (clients send many optional ones, e.g.
/// `user`); the OpenAI fields the server does not implement ([`UNSUPPORTED_FIELDS`]) are
/// refused unless they ask for nothing; a known field of the wrong type or out of range is an
/// error naming it.
pub fn parse_request(endpoint: Endpoint, bytes: &[u8]) -> Result<GenerationRequest, ApiError> {
    let value: Value = serde_json::from_slice(bytes)
        .map_err(|e| ApiError::invalid(format!("the request body is not valid JSON: {e}"), None))?;
    let Value::Object(body) = value else {
        return Err(ApiError::invalid(
            "the request body must be a JSON object",
            None,
        ));
    };
    refuse_unsupported(&body)?;
    let input = match endpoint {
        Endpoint::Completions => PromptInput::Text(completion_prompt(&body)?),
        Endpoint::ChatCompletions => PromptInput::Chat(chat_messages(&body)?),
    };
    let max_tokens = match endpoint {
        // Newer clients send max_completion_tokens for chat.
        Endpoint::ChatCompletions => match opt_unsigned(&body, "max_completion_tokens")? {
            Some(v) => Some(v),
            None => opt_unsigned(&body, "max_tokens")?,
        },
        Endpoint::Completions => opt_unsigned(&body, "max_tokens")?,
    };
    let temperature = opt_number(&body, "temperature")?.unwrap_or(1.0);
    if !(0.0..=2.0).contains(&temperature) {
        return Err(ApiError::invalid(
            format!("'temperature' must be between 0 and 2, got {temperature}"),
            Some("temperature"),
        ));
    }
    let top_p = opt_number(&body, "top_p")?.unwrap_or(1.0);
    if !(top_p > 0.0 && top_p <= 1.0) {
        return Err(ApiError::invalid(
            format!("'top_p' must be in (0, 1], got {top_p}"),
            Some("top_p"),
        ));
    }
    if let Some(n) = opt_unsigned(&body, "n")? {
        if n != 1 {
            return Err(ApiError::invalid(
                format!("only n = 1 is supported, got {n}"),
                Some("n"),
            ));
        }
    }
    let include_usage = match field(&body, "stream_options") {
        None => false,
        Some(Value::Object(o)) => opt_bool(o, "include_usage")
            .map_err(|mut e| {
                e.param = Some("stream_options.include_usage".into());
                e
            })?
            .unwrap_or(false),
        Some(v) => return Err(wrong_type("stream_options", "an object", v)),
    };
    Ok(GenerationRequest {
        model: opt_string(&body, "model")?,
        input,
        max_tokens: max_tokens.map(|v| usize::try_from(v).unwrap_or(usize::MAX)),
        temperature: temperature as f32,
        top_p: sieve_model::sampling::top_p_from_f64(top_p),
        stop: stop_strings(&body)?,
        seed: opt_unsigned(&body, "seed")?,
        stream: opt_bool(&body, "stream")?.unwrap_or(false),
        include_usage,
    })
}

/// OpenAI's `finish_reason` for why generation ended.
pub fn finish_reason(reason: sieve_model::generate::StopReason) -> &'static str {
    use sieve_model::generate::StopReason;
    match reason {
        StopReason::Eos | StopReason::StopString => "stop",
        StopReason::MaxTokens | StopReason::ContextFull => "length",
    }
}

/// `{"prompt_tokens", "completion_tokens", "total_tokens"}`.
pub fn usage(prompt_tokens: usize, completion_tokens: usize) -> Value {
    json!({
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    })
}

/// What identifies one response in its body and every chunk of its stream.
#[derive(Clone, Debug)]
pub struct ResponseMeta {
    pub endpoint: Endpoint,
    pub id: String,
    pub created: u64,
    pub model: String,
}

impl ResponseMeta {
    fn object(&self, chunk: bool) -> &'static str {
        match (self.endpoint, chunk) {
            (Endpoint::Completions, _) => "text_completion",
            (Endpoint::ChatCompletions, false) => "chat.completion",
            (Endpoint::ChatCompletions, true) => "chat.completion.chunk",
        }
    }

    /// The whole (non-streamed) response.
    pub fn response(&self, text: &str, finish: &str, usage: Value) -> Value {
        let choice = match self.endpoint {
            Endpoint::Completions => json!({
                "index": 0, "text": text, "logprobs": null, "finish_reason": finish,
            }),
            Endpoint::ChatCompletions => json!({
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "logprobs": null,
                "finish_reason": finish,
            }),
        };
        json!({
            "id": self.id,
            "object": self.object(false),
            "created": self.created,
            "model": self.model,
            "choices": [choice],
            "usage": usage,
        })
    }

    /// One stream chunk: `text` (with the assistant role on the chat stream's first chunk),
    /// or the closing chunk with `finish`.
    pub fn chunk(&self, text: &str, first: bool, finish: Option<&str>) -> Value {
        let choice = match self.endpoint {
            Endpoint::Completions => json!({
                "index": 0, "text": text, "logprobs": null, "finish_reason": finish,
            }),
            Endpoint::ChatCompletions => {
                let delta = match (first, finish) {
                    (true, _) => json!({"role": "assistant", "content": text}),
                    (false, Some(_)) if text.is_empty() => json!({}),
                    _ => json!({"content": text}),
                };
                json!({"index": 0, "delta": delta, "logprobs": null, "finish_reason": finish})
            }
        };
        json!({
            "id": self.id,
            "object": self.object(true),
            "created": self.created,
            "model": self.model,
            "choices": [choice],
        })
    }

    /// The usage chunk of `stream_options.include_usage`: no choices.
    pub fn usage_chunk(&self, usage: Value) -> Value {
        json!({
            "id": self.id,
            "object": self.object(true),
            "created": self.created,
            "model": self.model,
            "choices": [],
            "usage": usage,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(endpoint: Endpoint, body: &str) -> Result<GenerationRequest, ApiError> {
        parse_request(endpoint, body.as_bytes())
    }

    #[test]
    fn completion_fields_are_read_with_openai_defaults() {
        let r = parse(
            Endpoint::Completions,
            r#"{"prompt": "hi", "unknown": [1, 2]}"#,
        )
        .unwrap();
        assert_eq!(r.input, PromptInput::Text("hi".into()));
        assert_eq!(
            (r.temperature, r.top_p, r.max_tokens, r.stream),
            (1.0, 1.0, None, false)
        );
        let r = parse(
            Endpoint::Completions,
            r#"{"model": "m", "prompt": ["x"], "max_tokens": 5, "temperature": 0, "top_p": 0.5,
                "stop": "\n", "seed": 7, "n": 1, "stream": true, "stream_options": {"include_usage": true}}"#,
        )
        .unwrap();
        assert_eq!(r.model.as_deref(), Some("m"));
        assert_eq!(r.max_tokens, Some(5));
        assert_eq!((r.temperature, r.top_p, r.seed), (0.0, 0.5, Some(7)));
        assert_eq!(r.stop, vec!["\n".to_string()]);
        assert!(r.stream && r.include_usage);
    }

    #[test]
    fn chat_messages_accept_strings_and_text_parts() {
        let r = parse(
            Endpoint::ChatCompletions,
            r#"{"messages": [{"role": "system", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}],
                "max_completion_tokens": 3}"#,
        )
        .unwrap();
        assert_eq!(
            r.input,
            PromptInput::Chat(vec![
                ("system".into(), "be brief".into()),
                ("user".into(), "ab".into())
            ])
        );
        assert_eq!(r.max_tokens, Some(3));
    }

    #[test]
    fn bad_bodies_name_the_problem() {
        let cases: &[(Endpoint, &str, Option<&str>, &str)] = &[
            (Endpoint::Completions, "{", None, "not valid JSON"),
            (Endpoint::Completions, "[1]", None, "JSON object"),
            (Endpoint::Completions, "{}", Some("prompt"), "required"),
            (
                Endpoint::Completions,
                r#"{"prompt": 3}"#,
                Some("prompt"),
                "a number",
            ),
            (
                Endpoint::Completions,
                r#"{"prompt": ["a", "b"]}"#,
                Some("prompt"),
                "exactly one",
            ),
            (
                Endpoint::Completions,
                r#"{"prompt": "a", "max_tokens": "9"}"#,
                Some("max_tokens"),
                "a string",
            ),
            (
                Endpoint::Completions,
                r#"{"prompt": "a", "max_tokens": -1}"#,
                Some("max_tokens"),
                "non-negative",
            ),
            (
                Endpoint::Completions,
                r#"{"prompt": "a", "temperature": 3}"#,
                Some("temperature"),
                "between",
            ),
            (
                Endpoint::Completions,
                r#"{"prompt": "a", "top_p": 0}"#,
                Some("top_p"),
                "(0, 1]",
            ),
            (
                Endpoint::Completions,
                r#"{"prompt": "a", "n": 2}"#,
                Some("n"),
                "n = 1",
            ),
            (
                Endpoint::Completions,
                r#"{"prompt": "a", "stream": "yes"}"#,
                Some("stream"),
                "boolean",
            ),
            (
                Endpoint::Completions,
                r#"{"prompt": "a", "stop": ["a","b","c","d","e"]}"#,
                Some("stop"),
                "at most",
            ),
            (
                Endpoint::Completions,
                r#"{"prompt": "a", "stop": [""]}"#,
                Some("stop"),
                "empty",
            ),
            (
                Endpoint::Completions,
                r#"{"prompt": "a", "stop": [1]}"#,
                Some("stop"),
                "a number",
            ),
            (
                Endpoint::ChatCompletions,
                r#"{"messages": []}"#,
                Some("messages"),
                "at least one",
            ),
            (
                Endpoint::ChatCompletions,
                r#"{"messages": "hi"}"#,
                Some("messages"),
                "array",
            ),
            (
                Endpoint::ChatCompletions,
                r#"{"messages": [{"content": "x"}]}"#,
                Some("messages[0].role"),
                "required",
            ),
            (
                Endpoint::ChatCompletions,
                r#"{"messages": [{"role": "user", "content": 5}]}"#,
                Some("messages[0].content"),
                "a number",
            ),
            (
                Endpoint::ChatCompletions,
                r#"{"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}"#,
                Some("messages[0].content"),
                "text parts",
            ),
        ];
        for (endpoint, body, param, needle) in cases {
            let e = parse(*endpoint, body).unwrap_err();
            assert_eq!(e.status, StatusCode::BAD_REQUEST, "{body}");
            assert_eq!(e.param.as_deref(), *param, "{body}: {e}");
            assert!(e.message.contains(needle), "{body}: {}", e.message);
            assert_eq!(e.body()["error"]["type"], "invalid_request_error");
        }
    }

    #[test]
    fn unsupported_openai_fields_are_refused_by_name_unless_neutral() {
        let refused = [
            ("logprobs", "true"),
            ("logprobs", "5"),
            ("top_logprobs", "2"),
            ("echo", "true"),
            ("best_of", "3"),
            ("suffix", "\"end\""),
            ("logit_bias", "{\"50256\": -100}"),
            ("presence_penalty", "0.5"),
            ("frequency_penalty", "-1"),
            ("tools", "[{\"type\": \"function\"}]"),
            ("tool_choice", "\"auto\""),
            ("functions", "[{}]"),
            ("function_call", "\"auto\""),
            ("response_format", "{\"type\": \"json_object\"}"),
            ("modalities", "[\"audio\"]"),
            ("audio", "{}"),
        ];
        for endpoint in [Endpoint::Completions, Endpoint::ChatCompletions] {
            let base = match endpoint {
                Endpoint::Completions => r#""prompt": "a""#,
                Endpoint::ChatCompletions => r#""messages": [{"role": "user", "content": "a"}]"#,
            };
            for (field, value) in refused {
                let body = format!("{{{base}, \"{field}\": {value}}}");
                let e = parse(endpoint, &body).unwrap_err();
                assert_eq!(e.status, StatusCode::BAD_REQUEST, "{body}");
                assert_eq!(e.param.as_deref(), Some(field), "{body}");
                assert!(e.message.contains(field), "{}", e.message);
            }
            let neutral = format!(
                "{{{base}, \"logprobs\": null, \"echo\": false, \"best_of\": 1, \
                 \"suffix\": null, \"logit_bias\": {{}}, \"presence_penalty\": 0, \
                 \"frequency_penalty\": 0.0, \"tools\": [], \"tool_choice\": \"none\", \
                 \"response_format\": {{\"type\": \"text\"}}, \"top_logprobs\": 0, \
                 \"user\": \"someone\"}}"
            );
            assert!(parse(endpoint, &neutral).is_ok(), "{neutral}");
        }
    }

    #[test]
    fn a_tiny_top_p_is_not_reported_as_zero() {
        let r = parse(Endpoint::Completions, r#"{"prompt": "a", "top_p": 1e-300}"#).unwrap();
        assert!(r.top_p > 0.0);
    }

    #[test]
    fn chunks_follow_the_openai_shapes() {
        let meta = ResponseMeta {
            endpoint: Endpoint::ChatCompletions,
            id: "chatcmpl-1".into(),
            created: 5,
            model: "m".into(),
        };
        let first = meta.chunk("", true, None);
        assert_eq!(first["object"], "chat.completion.chunk");
        assert_eq!(first["choices"][0]["delta"]["role"], "assistant");
        let last = meta.chunk("", false, Some("stop"));
        assert_eq!(last["choices"][0]["delta"], json!({}));
        assert_eq!(last["choices"][0]["finish_reason"], "stop");
        let full = meta.response("hi", "length", usage(3, 2));
        assert_eq!(full["choices"][0]["message"]["content"], "hi");
        assert_eq!(full["usage"]["total_tokens"], 5);
        let meta = ResponseMeta {
            endpoint: Endpoint::Completions,
            ..meta
        };
        assert_eq!(meta.chunk("x", true, None)["choices"][0]["text"], "x");
        assert_eq!(meta.usage_chunk(usage(1, 1))["choices"], json!([]));
    }
}

//! Load on a running OpenAI-compatible server (`sieve serve`, llama.cpp's `llama-server`, ...):
//! what `sieve bench serve` runs.
//!
//! `clients` tasks each send `requests` requests to `/v1/completions` one after another, every
//! prompt distinct (`prompt_words` words), temperature 0, `max_tokens`, streamed or not. The same
//! request mix goes to every server it is pointed at, so two servers are compared by one client.
//! Streamed, a token is a content chunk (both sieve and llama-server send one per token); TTFT is
//! request sent -> first chunk, TPOT the mean gap between a request's later chunks. Not streamed,
//! the tokens are the answer's `usage.completion_tokens` and only the latency is timed.
//!
//! One HTTP/1.1 connection per request (hyper's client): the server sees `clients` concurrent
//! connections, as from that many independent users.

use std::time::{Duration, Instant};

use http_body_util::{BodyExt, Full};
use hyper::body::Bytes;
use hyper_util::rt::TokioIo;
use serde::Serialize;
use serde_json::{json, Value};

/// Most concurrent clients (each holds one connection).
pub const MAX_CLIENTS: usize = 4096;
/// Most requests per client.
pub const MAX_REQUESTS: usize = 1_000_000;
/// Longest server-sent event line kept while it arrives.
const MAX_EVENT_BYTES: usize = 1 << 20;

/// What to send.
#[derive(Clone, Debug, PartialEq)]
pub struct LoadOptions {
    pub clients: usize,
    /// Requests per client, sent one after another.
    pub requests: usize,
    pub max_tokens: usize,
    /// Words per prompt (each prompt distinct: its number and a rotation of a word list).
    pub prompt_words: usize,
    pub stream: bool,
    /// Sent as `Authorization: Bearer KEY`.
    pub api_key: Option<String>,
    /// The request's `model` field (servers of one model ignore it).
    pub model: Option<String>,
    /// Per request, from sending it to its last byte.
    pub timeout: Duration,
}

impl LoadOptions {
    /// Refuses counts of 0, and more clients or requests than the limits.
    pub fn check(&self) -> Result<(), LoadError> {
        if self.clients == 0 || self.requests == 0 || self.max_tokens == 0 {
            return Err(LoadError::Options(
                "clients, requests and max tokens must each be at least 1".into(),
            ));
        }
        if self.clients > MAX_CLIENTS || self.requests > MAX_REQUESTS {
            return Err(LoadError::Options(format!(
                "{} clients x {} requests: at most {MAX_CLIENTS} clients (one connection each; \
                 the open-file limit may allow fewer) and {MAX_REQUESTS} requests per client",
                self.clients, self.requests
            )));
        }
        Ok(())
    }
}

impl Default for LoadOptions {
    fn default() -> Self {
        Self {
            clients: 8,
            requests: 4,
            max_tokens: 128,
            prompt_words: 40,
            stream: true,
            api_key: None,
            model: None,
            timeout: Duration::from_secs(600),
        }
    }
}

/// What one run measured (times in ms; `None` where not measured: TTFT and TPOT without
/// streaming, TPOT of one-token answers).
#[derive(Clone, Debug, Serialize)]
pub struct LoadReport {
    pub url: String,
    pub clients: usize,
    pub stream: bool,
    /// Requests that completed.
    pub requests: usize,
    pub errors: usize,
    /// The first few errors, as text.
    pub first_errors: Vec<String>,
    pub generated_tokens: usize,
    pub wall_s: f64,
    pub tokens_per_s: f64,
    pub ttft_ms_p50: Option<f64>,
    pub ttft_ms_p99: Option<f64>,
    pub tpot_ms_p50: Option<f64>,
    pub tpot_ms_p99: Option<f64>,
    pub latency_ms_p50: Option<f64>,
    pub latency_ms_p99: Option<f64>,
    pub tokens_per_request_mean: f64,
    /// Prompt tokens per request as the server counted them (`usage.prompt_tokens`; streams
    /// ask for it with `stream_options.include_usage`), over the requests that reported it:
    /// the same words are different token counts under different tokenizers.
    pub prompt_tokens_per_request_mean: Option<f64>,
}

impl LoadReport {
    /// A run that could not start (`why`): every request counted as failed.
    pub fn failed(url: &str, o: &LoadOptions, why: String) -> Self {
        Self {
            url: url.to_string(),
            clients: o.clients,
            stream: o.stream,
            requests: 0,
            errors: o.clients * o.requests,
            first_errors: vec![why],
            generated_tokens: 0,
            wall_s: 0.0,
            tokens_per_s: 0.0,
            ttft_ms_p50: None,
            ttft_ms_p99: None,
            tpot_ms_p50: None,
            tpot_ms_p99: None,
            latency_ms_p50: None,
            latency_ms_p99: None,
            tokens_per_request_mean: 0.0,
            prompt_tokens_per_request_mean: None,
        }
    }

    /// One line: throughput, TTFT, TPOT, latency, errors.
    pub fn summary(&self) -> String {
        let ms = |v: Option<f64>| v.map_or("-".to_string(), |v| format!("{v:.2}"));
        format!(
            "{}: {} clients, {} requests{}: {} tokens in {:.2} s = {:.1} tok/s | TTFT p50 {} p99 {} ms | TPOT p50 {} p99 {} ms | latency p50 {} p99 {} ms | {:.1} tokens/request | prompt {} tokens/request | {} errors",
            self.url,
            self.clients,
            self.requests,
            if self.stream { " streamed" } else { "" },
            self.generated_tokens,
            self.wall_s,
            self.tokens_per_s,
            ms(self.ttft_ms_p50),
            ms(self.ttft_ms_p99),
            ms(self.tpot_ms_p50),
            ms(self.tpot_ms_p99),
            ms(self.latency_ms_p50),
            ms(self.latency_ms_p99),
            self.tokens_per_request_mean,
            self.prompt_tokens_per_request_mean
                .map_or("-".to_string(), |v| format!("{v:.1}")),
            self.errors
        )
    }
}

#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    #[error("{0}")]
    Options(String),
    #[error("server URL '{url}': {why}")]
    BadUrl { url: String, why: String },
    #[error("no OpenAI-compatible server answers at {url}: {why}")]
    NoServer { url: String, why: String },
}

/// Where requests go: `http://host:port[/prefix]`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ServerUrl {
    host: String,
    port: u16,
    /// Path before `/v1/...` (empty, or starting with `/`, no trailing `/`).
    prefix: String,
}

impl ServerUrl {
    pub fn parse(url: &str) -> Result<Self, LoadError> {
        let bad = |why: &str| LoadError::BadUrl {
            url: url.to_string(),
            why: why.to_string(),
        };
        let rest = url.strip_prefix("http://").ok_or_else(|| {
            bad("only plain http:// servers (a local or tunnelled port) are supported")
        })?;
        let (authority, path) = match rest.find('/') {
            Some(i) => (&rest[..i], &rest[i..]),
            None => (rest, ""),
        };
        // `[v6 address]:port` keeps its colons inside the brackets.
        let (host, port) = if let Some(inner) = authority.strip_prefix('[') {
            let (h, rest) = inner
                .split_once(']')
                .ok_or_else(|| bad("an IPv6 address needs its closing ']'"))?;
            match rest.strip_prefix(':') {
                Some(p) => (h, p),
                None if rest.is_empty() => (h, "80"),
                None => return Err(bad("text after the IPv6 address")),
            }
        } else {
            match authority.rsplit_once(':') {
                Some((h, p)) => (h, p),
                None => (authority, "80"),
            }
        };
        let port = port
            .parse::<u16>()
            .map_err(|_| bad("the port is not a number in 1..=65535"))?;
        if host.is_empty() || port == 0 {
            return Err(bad("no host or port"));
        }
        let prefix = path.trim_end_matches('/');
        let prefix = prefix.strip_suffix("/v1").unwrap_or(prefix).to_string();
        Ok(Self {
            host: host.to_string(),
            port,
            prefix,
        })
    }

    /// The `Host` header: an IPv6 address in brackets.
    fn authority(&self) -> String {
        if self.host.contains(':') {
            format!("[{}]:{}", self.host, self.port)
        } else {
            format!("{}:{}", self.host, self.port)
        }
    }

    fn path(&self, endpoint: &str) -> String {
        format!("{}{endpoint}", self.prefix)
    }
}

/// A distinct prompt per request: its number and a rotation of the word list.
pub fn prompt(i: usize, words: usize) -> String {
    const WORDS: [&str; 20] = [
        "river", "star", "bread", "music", "tree", "number", "boat", "rain", "stone", "cloud",
        "field", "lamp", "road", "glass", "winter", "garden", "letter", "mountain", "window",
        "candle",
    ];
    let body: Vec<&str> = (0..words).map(|k| WORDS[(i + k) % WORDS.len()]).collect();
    format!("Story {i}: {}. Continue the story:", body.join(" "))
}

/// One request's times: sent, and each token's arrival (streamed); or sent, done and the token
/// count (not streamed).
struct Timing {
    sent: Instant,
    stamps: Vec<Instant>,
    done: Instant,
    tokens: usize,
    /// `usage.prompt_tokens`, when the server sent it.
    prompt_tokens: Option<usize>,
}

/// Runs the load against `url` and reports it. Options and the server are checked before the
/// load starts (`GET /v1/models` must answer); failed requests are counted, not fatal.
pub async fn run_load(url: &str, o: &LoadOptions) -> Result<LoadReport, LoadError> {
    o.check()?;
    let server = ServerUrl::parse(url)?;
    let models = request(
        &server,
        "GET",
        "/v1/models",
        None,
        o,
        Duration::from_secs(30),
    )
    .await;
    match models {
        Ok((200, _)) => {}
        Ok((status, body)) => {
            return Err(LoadError::NoServer {
                url: url.to_string(),
                why: format!("GET /v1/models answered {status}: {}", snippet(&body)),
            })
        }
        Err(why) => {
            return Err(LoadError::NoServer {
                url: url.to_string(),
                why,
            })
        }
    }

    let start = Instant::now();
    let mut tasks = Vec::with_capacity(o.clients);
    for c in 0..o.clients {
        let (server, o) = (server.clone(), o.clone());
        tasks.push(tokio::spawn(async move {
            let mut out = Vec::with_capacity(o.requests);
            for r in 0..o.requests {
                out.push(completion(&server, &o, c * o.requests + r).await);
            }
            out
        }));
    }
    let mut timings = Vec::new();
    let mut errors = Vec::new();
    for t in tasks {
        match t.await {
            Ok(results) => {
                for r in results {
                    match r {
                        Ok(t) => timings.push(t),
                        Err(e) => errors.push(e),
                    }
                }
            }
            Err(e) => errors.push(format!("a client task failed: {e}")),
        }
    }
    let wall = start.elapsed().as_secs_f64();
    Ok(report(url, o, &timings, errors, wall))
}

/// [`run_load`] on a runtime of its own (for callers without one, as the CLI).
pub fn run_load_blocking(url: &str, o: &LoadOptions) -> Result<LoadReport, LoadError> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .map_err(|e| LoadError::Options(format!("starting the async runtime: {e}")))?;
    runtime.block_on(run_load(url, o))
}

fn report(
    url: &str,
    o: &LoadOptions,
    timings: &[Timing],
    errors: Vec<String>,
    wall: f64,
) -> LoadReport {
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    let tokens: usize = timings.iter().map(|t| t.tokens).sum();
    let ttft: Vec<f64> = timings
        .iter()
        .filter_map(|t| t.stamps.first().map(|s| ms(*s - t.sent)))
        .collect();
    // Per token after the first: a chunk may carry several tokens (or a token no text), so
    // the count is the server's when it sent one, not the number of chunks.
    let tpot: Vec<f64> = timings
        .iter()
        .filter(|t| t.stamps.len() > 1 && t.tokens > 1)
        .map(|t| ms(t.stamps[t.stamps.len() - 1] - t.stamps[0]) / (t.tokens - 1) as f64)
        .collect();
    let latency: Vec<f64> = timings.iter().map(|t| ms(t.done - t.sent)).collect();
    LoadReport {
        url: url.to_string(),
        clients: o.clients,
        stream: o.stream,
        requests: timings.len(),
        errors: errors.len(),
        first_errors: errors.into_iter().take(5).collect(),
        generated_tokens: tokens,
        wall_s: wall,
        tokens_per_s: if wall > 0.0 {
            tokens as f64 / wall
        } else {
            0.0
        },
        ttft_ms_p50: percentile(&ttft, 0.5),
        ttft_ms_p99: percentile(&ttft, 0.99),
        tpot_ms_p50: percentile(&tpot, 0.5),
        tpot_ms_p99: percentile(&tpot, 0.99),
        latency_ms_p50: percentile(&latency, 0.5),
        latency_ms_p99: percentile(&latency, 0.99),
        tokens_per_request_mean: if timings.is_empty() {
            0.0
        } else {
            tokens as f64 / timings.len() as f64
        },
        prompt_tokens_per_request_mean: {
            let counted: Vec<usize> = timings.iter().filter_map(|t| t.prompt_tokens).collect();
            (!counted.is_empty())
                .then(|| counted.iter().sum::<usize>() as f64 / counted.len() as f64)
        },
    }
}

/// The `q` quantile: the value at rank `floor(q · n)` (0-based) of the sorted values, so p99 of
/// fewer than 100 values is the largest; `None` for no values.
fn percentile(values: &[f64], q: f64) -> Option<f64> {
    if values.is_empty() {
        return None;
    }
    let mut v = values.to_vec();
    v.sort_by(f64::total_cmp);
    Some(v[((q * v.len() as f64) as usize).min(v.len() - 1)])
}

/// `usage.<field>` of an answer or a stream chunk, when present.
fn usage_count(v: &Value, field: &str) -> Option<usize> {
    v["usage"][field]
        .as_u64()
        .and_then(|n| usize::try_from(n).ok())
}

/// `usage.prompt_tokens` of an answer or a stream chunk, when present.
fn prompt_tokens(v: &Value) -> Option<usize> {
    usage_count(v, "prompt_tokens")
}

/// `usage.completion_tokens` of an answer or a stream chunk, when present.
fn completion_tokens(v: &Value) -> Option<usize> {
    usage_count(v, "completion_tokens")
}

/// One `/v1/completions` request, timed.
async fn completion(server: &ServerUrl, o: &LoadOptions, i: usize) -> Result<Timing, String> {
    let mut body = json!({
        "prompt": prompt(i, o.prompt_words),
        "max_tokens": o.max_tokens,
        "temperature": 0,
        "stream": o.stream,
    });
    if o.stream {
        // The last chunk then carries the usage counts (the prompt's tokens).
        body["stream_options"] = json!({ "include_usage": true });
    }
    if let Some(m) = &o.model {
        body["model"] = json!(m);
    }
    let sent = Instant::now();
    let work = async {
        let mut response = send(server, "POST", "/v1/completions", Some(body.to_string()), o)
            .await
            .map_err(|e| format!("request {i}: {e}"))?;
        let status = response.status().as_u16();
        if status != 200 {
            let bytes = read_all(response.body_mut()).await.unwrap_or_default();
            return Err(format!("request {i}: HTTP {status}: {}", snippet(&bytes)));
        }
        if !o.stream {
            let bytes = read_all(response.body_mut())
                .await
                .map_err(|e| format!("request {i}: {e}"))?;
            let v: Value = serde_json::from_slice(&bytes)
                .map_err(|e| format!("request {i}: the answer is not JSON: {e}"))?;
            let tokens = completion_tokens(&v)
                .ok_or_else(|| format!("request {i}: the answer has no usage.completion_tokens"))?;
            return Ok(Timing {
                sent,
                stamps: Vec::new(),
                done: Instant::now(),
                tokens,
                prompt_tokens: prompt_tokens(&v),
            });
        }
        // Server-sent events: `data: {json}` lines, `data: [DONE]` last.
        let mut stamps = Vec::new();
        let mut pending: Vec<u8> = Vec::new();
        // A stream counts only when it ends as the protocol says: `[DONE]`, or a chunk with a
        // finish reason (then the connection closing ends it).
        let (mut finished, mut reason) = (false, false);
        let (mut prompt_count, mut completion_count) = (None, None);
        while !finished {
            let Some(frame) = response.body_mut().frame().await else {
                break;
            };
            let frame = frame.map_err(|e| format!("request {i}: reading the stream: {e}"))?;
            let Some(data) = frame.data_ref() else {
                continue;
            };
            pending.extend_from_slice(data);
            if pending.len() > MAX_EVENT_BYTES {
                return Err(format!("request {i}: a stream line longer than 1 MiB"));
            }
            while let Some(end) = pending.iter().position(|&b| b == b'\n') {
                let line: Vec<u8> = pending.drain(..=end).collect();
                let line = String::from_utf8_lossy(&line);
                let Some(data) = line.trim().strip_prefix("data:") else {
                    continue;
                };
                let data = data.trim();
                if data == "[DONE]" {
                    finished = true;
                    break;
                }
                let chunk: Value = serde_json::from_str(data)
                    .map_err(|e| format!("request {i}: a stream event is not JSON: {e}"))?;
                if !chunk["error"].is_null() {
                    return Err(format!(
                        "request {i}: the stream reports {}",
                        chunk["error"]
                    ));
                }
                // The usage chunk (no choices) of `stream_options.include_usage`.
                prompt_count = prompt_tokens(&chunk).or(prompt_count);
                completion_count = completion_tokens(&chunk).or(completion_count);
                let choice = &chunk["choices"][0];
                let text = choice["text"].as_str().unwrap_or("");
                let finish = !choice["finish_reason"].is_null();
                // A token's chunk: text, or a choice without text that does not finish the
                // stream (llama-server holds back partial UTF-8 so). A closing chunk without
                // text, and the usage chunk (no choices), are no tokens.
                if !text.is_empty() || (choice.is_object() && !finish) {
                    stamps.push(Instant::now());
                }
                reason |= finish;
            }
        }
        if !finished && !reason {
            return Err(format!(
                "request {i}: the stream ended without [DONE] or a finish reason after {} tokens",
                stamps.len()
            ));
        }
        // The server's count when it sent usage (never below the token chunks seen: a chunk
        // carries at least one token): a chunk may also carry several tokens.
        Ok(Timing {
            sent,
            tokens: completion_count.map_or(stamps.len(), |c| c.max(stamps.len())),
            stamps,
            done: Instant::now(),
            prompt_tokens: prompt_count,
        })
    };
    tokio::time::timeout(o.timeout, work)
        .await
        .map_err(|_| format!("request {i}: no complete answer within {:?}", o.timeout))?
}

/// A request on a new connection; the response with its body still to read.
async fn send(
    server: &ServerUrl,
    method: &str,
    endpoint: &str,
    body: Option<String>,
    o: &LoadOptions,
) -> Result<hyper::Response<hyper::body::Incoming>, String> {
    let stream = tokio::net::TcpStream::connect((server.host.as_str(), server.port))
        .await
        .map_err(|e| format!("connecting to {}:{}: {e}", server.host, server.port))?;
    let _ = stream.set_nodelay(true);
    let (mut sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .map_err(|e| format!("HTTP handshake: {e}"))?;
    tokio::spawn(async move {
        // Ends with the response (or the server closing); its error is the request's.
        let _ = connection.await;
    });
    let host = server.authority();
    let mut builder = hyper::Request::builder()
        .method(method)
        .uri(server.path(endpoint))
        .header("host", host)
        .header("connection", "close");
    if body.is_some() {
        builder = builder.header("content-type", "application/json");
    }
    if let Some(key) = &o.api_key {
        builder = builder.header("authorization", format!("Bearer {key}"));
    }
    let request = builder
        .body(Full::new(Bytes::from(body.unwrap_or_default())))
        .map_err(|e| format!("building the request: {e}"))?;
    sender
        .send_request(request)
        .await
        .map_err(|e| format!("sending the request: {e}"))
}

/// A whole request (status and body), within `limit`.
async fn request(
    server: &ServerUrl,
    method: &str,
    endpoint: &str,
    body: Option<String>,
    o: &LoadOptions,
    limit: Duration,
) -> Result<(u16, Vec<u8>), String> {
    let work = async {
        let mut response = send(server, method, endpoint, body, o).await?;
        let status = response.status().as_u16();
        let bytes = read_all(response.body_mut()).await?;
        Ok((status, bytes))
    };
    tokio::time::timeout(limit, work)
        .await
        .map_err(|_| format!("no answer within {limit:?}"))?
}

/// A body's bytes, at most 64 MiB.
async fn read_all(body: &mut hyper::body::Incoming) -> Result<Vec<u8>, String> {
    const LIMIT: usize = 64 << 20;
    let mut out = Vec::new();
    while let Some(frame) = body.frame().await {
        let frame = frame.map_err(|e| format!("reading the answer: {e}"))?;
        if let Some(data) = frame.data_ref() {
            if out.len() + data.len() > LIMIT {
                return Err("the answer is larger than 64 MiB".into());
            }
            out.extend_from_slice(data);
        }
    }
    Ok(out)
}

/// The start of a body, for error messages.
fn snippet(bytes: &[u8]) -> String {
    let text = String::from_utf8_lossy(&bytes[..bytes.len().min(200)]);
    text.trim().to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_parse_or_say_why_not() {
        let u = ServerUrl::parse("http://127.0.0.1:8080").unwrap();
        assert_eq!(
            (u.host.as_str(), u.port, u.prefix.as_str()),
            ("127.0.0.1", 8080, "")
        );
        let u = ServerUrl::parse("http://localhost:9000/v1/").unwrap();
        assert_eq!((u.port, u.prefix.as_str()), (9000, ""));
        assert_eq!(u.path("/v1/models"), "/v1/models");
        let u = ServerUrl::parse("http://gpu-box/api/v1").unwrap();
        assert_eq!(
            (u.port, u.path("/v1/completions").as_str()),
            (80, "/api/v1/completions")
        );
        let u = ServerUrl::parse("http://[::1]:8081/").unwrap();
        assert_eq!((u.host.as_str(), u.port), ("::1", 8081));
        assert_eq!(u.authority(), "[::1]:8081");
        assert_eq!(ServerUrl::parse("http://[::1]").unwrap().port, 80);
        for bad in [
            "https://x:1",
            "127.0.0.1:80",
            "http://:80",
            "http://x:0",
            "http://x:99999",
            "http://x:y",
            "http://[::1:80",
            "http://[::1]x",
        ] {
            let e = ServerUrl::parse(bad).unwrap_err().to_string();
            assert!(e.contains(bad), "{bad}: {e}");
        }
    }

    #[test]
    fn prompts_are_distinct_and_sized() {
        let a = prompt(3, 40);
        assert_eq!(a.split(' ').count(), 2 + 40 + 3);
        let all: std::collections::HashSet<String> = (0..500).map(|i| prompt(i, 10)).collect();
        assert_eq!(all.len(), 500);
    }

    #[test]
    fn percentiles_take_the_nearest_rank() {
        assert_eq!(percentile(&[], 0.5), None);
        let v: Vec<f64> = (1..=100).map(f64::from).rev().collect();
        assert_eq!(percentile(&v, 0.5), Some(51.0));
        assert_eq!(percentile(&v, 0.99), Some(100.0));
        assert_eq!(percentile(&[7.0], 0.99), Some(7.0));
    }
}

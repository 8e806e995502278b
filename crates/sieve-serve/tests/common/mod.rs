//! Shared pieces of the server tests: the default model, a server on a free loopback port,
//! single-request reference answers from the library's `generate`, and HTTP helpers.

#![allow(dead_code)]

use std::path::PathBuf;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use sieve_model::chat::{render_chat, ChatMessage};
use sieve_model::generate::{generate, GenerateOptions};
use sieve_model::llama::Model;
use sieve_model::tokenizer::Tokenizer;
pub use sieve_serve::ServeConfig;
use sieve_serve::{load_cpu_engine, load_gpu_engine, model_name_for, Server};

/// The tests load several models and run them; one at a time keeps them quick on 2 cores.
pub static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

pub fn model_path() -> Option<PathBuf> {
    let home = std::env::var_os("SIEVE_HOME")
        .filter(|h| !h.is_empty())
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache/sieve")))?;
    let path = home.join("models/SmolLM2-135M-Instruct.Q4_1.gguf");
    if path.is_file() {
        Some(path)
    } else {
        eprintln!(
            "SKIPPED: {} not found; run `bash scripts/fetch-model.sh` to fetch it",
            path.display()
        );
        None
    }
}

/// The model and tokenizer the reference answers come from (loaded once per test binary).
pub fn reference() -> &'static (Model, Tokenizer) {
    static REFERENCE: OnceLock<(Model, Tokenizer)> = OnceLock::new();
    REFERENCE.get_or_init(|| {
        let path = model_path().expect("checked by the caller");
        sieve_model::packed::load_model_and_tokenizer(&path).expect("the default model loads")
    })
}

/// What a prompt is: plain text for /v1/completions, or one user turn for chat.
#[derive(Clone, Debug)]
pub enum Prompt {
    Text(String),
    Chat(String),
}

/// The single-request greedy answer: `sieve generate`'s code path (the library's `generate`):
/// text, prompt tokens, generated tokens and OpenAI's finish reason.
pub fn greedy_answer(prompt: &Prompt, max_tokens: usize) -> (String, usize, usize, &'static str) {
    let (model, tokenizer) = reference();
    let ids = match prompt {
        Prompt::Text(t) => tokenizer.encode(t, tokenizer.add_bos_by_default()),
        Prompt::Chat(t) => {
            let rendered = render_chat(
                tokenizer.chat_template(),
                &[ChatMessage::user(t.clone())],
                true,
            )
            .expect("renders");
            tokenizer.encode(&rendered.text, false)
        }
    }
    .expect("tokenizes");
    let options = GenerateOptions {
        max_tokens,
        ..GenerateOptions::default()
    };
    if on_gpu() {
        // The GPU engine's single-request answer is the GPU runner's `generate` (its products
        // round differently from the CPU's 8-bit-activation block kernels, so greedy text may
        // part from the CPU's after some tokens; each device must agree with itself).
        static GPU_REFERENCE: OnceLock<std::sync::Mutex<sieve_gpu::GpuModel>> = OnceLock::new();
        let gpu_model = GPU_REFERENCE.get_or_init(|| {
            let gpu = sieve_cuda::Gpu::new(0).expect("SIEVE_SERVE_TEST_DEVICE=cuda needs a GPU");
            std::sync::Mutex::new(
                sieve_gpu::GpuModel::from_model(gpu, model, 2048).expect("the model uploads"),
            )
        });
        let mut gpu_model = gpu_model.lock().expect("the reference GPU model");
        let g =
            sieve_gpu::generate::generate(&mut gpu_model, tokenizer, &ids, &options, |_| Ok(()))
                .expect("generates on the GPU");
        let finish = sieve_serve::api::finish_reason(g.stop_reason);
        return (g.text, ids.len(), g.tokens.len(), finish);
    }
    let g = sieve_model::generate::run_in_pool(None, || {
        generate(model, tokenizer, &ids, &options, |_| Ok(()))
    })
    .expect("pool")
    .expect("generates");
    let finish = sieve_serve::api::finish_reason(g.stats.stop_reason);
    (g.text, ids.len(), g.tokens.len(), finish)
}

pub fn config() -> ServeConfig {
    ServeConfig {
        port: 0,
        model_name: model_name_for(&model_path().expect("checked")),
        drain_timeout: Duration::from_secs(30),
        ..ServeConfig::default()
    }
}

/// True when the tests run against the GPU engine (`SIEVE_SERVE_TEST_DEVICE=cuda`).
pub fn on_gpu() -> bool {
    std::env::var("SIEVE_SERVE_TEST_DEVICE").as_deref() == Ok("cuda")
}

/// A server on the CPU engine, or with `SIEVE_SERVE_TEST_DEVICE=cuda` (the GPU machine) on the
/// GPU engine, so that every server test also runs against `sieve serve --device cuda`.
pub fn start(config: &ServeConfig) -> Server {
    let path = model_path().expect("checked by the caller");
    if on_gpu() {
        let gpu = sieve_cuda::Gpu::new(0).expect("SIEVE_SERVE_TEST_DEVICE=cuda needs a GPU");
        let (engine, tokenizer) = load_gpu_engine(&path, config, gpu).expect("GPU engine");
        return Server::start(Box::new(engine), tokenizer, config).expect("server starts");
    }
    let (engine, tokenizer) = load_cpu_engine(&path, config).expect("engine");
    Server::start(Box::new(engine), tokenizer, config).expect("server starts")
}

pub fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .no_proxy()
        .timeout(Duration::from_secs(120))
        .build()
        .expect("client")
}

/// The request body for `prompt`, greedy.
pub fn body(prompt: &Prompt, max_tokens: usize, stream: bool) -> Value {
    match prompt {
        Prompt::Text(t) => json!({
            "prompt": t, "max_tokens": max_tokens, "temperature": 0, "stream": stream,
        }),
        Prompt::Chat(t) => json!({
            "messages": [{"role": "user", "content": t}],
            "max_tokens": max_tokens, "temperature": 0, "stream": stream,
            "stream_options": {"include_usage": true},
        }),
    }
}

pub fn path_for(prompt: &Prompt) -> &'static str {
    match prompt {
        Prompt::Text(_) => "/v1/completions",
        Prompt::Chat(_) => "/v1/chat/completions",
    }
}

/// One answer as the client saw it.
#[derive(Clone, Debug, PartialEq)]
pub struct Answer {
    pub text: String,
    pub finish_reason: String,
    pub prompt_tokens: u64,
    pub completion_tokens: u64,
    /// Every response id seen (one per stream chunk), to check nothing was mixed up.
    pub ids: Vec<String>,
}

fn choice_text(choice: &Value) -> Option<&str> {
    choice["text"]
        .as_str()
        .or_else(|| choice["message"]["content"].as_str())
        .or_else(|| choice["delta"]["content"].as_str())
}

/// Sends `prompt` and reads the whole answer (streamed or not), checking its shape.
pub async fn ask(
    client: &reqwest::Client,
    base: &str,
    prompt: &Prompt,
    max_tokens: usize,
    stream: bool,
) -> Result<Answer, String> {
    let response = client
        .post(format!("{base}{}", path_for(prompt)))
        .json(&body(prompt, max_tokens, stream))
        .send()
        .await
        .map_err(|e| format!("send: {e}"))?;
    let status = response.status();
    if !status.is_success() {
        let text = response.text().await.unwrap_or_default();
        return Err(format!("{status}: {text}"));
    }
    if !stream {
        let v: Value = response.json().await.map_err(|e| format!("json: {e}"))?;
        let choice = &v["choices"][0];
        return Ok(Answer {
            text: choice_text(choice).ok_or("no text")?.to_owned(),
            finish_reason: choice["finish_reason"].as_str().ok_or("no finish")?.into(),
            prompt_tokens: v["usage"]["prompt_tokens"].as_u64().ok_or("no usage")?,
            completion_tokens: v["usage"]["completion_tokens"].as_u64().ok_or("no usage")?,
            ids: vec![v["id"].as_str().ok_or("no id")?.into()],
        });
    }
    let content_type = response
        .headers()
        .get("content-type")
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_owned();
    if content_type != "text/event-stream" {
        return Err(format!("content-type {content_type}"));
    }
    let raw = response.text().await.map_err(|e| format!("body: {e}"))?;
    parse_stream(&raw)
}

/// Reads a complete SSE body: chunks, the closing chunk, an optional usage chunk, `[DONE]`.
pub fn parse_stream(raw: &str) -> Result<Answer, String> {
    let mut answer = Answer {
        text: String::new(),
        finish_reason: String::new(),
        prompt_tokens: 0,
        completion_tokens: 0,
        ids: Vec::new(),
    };
    let mut done = false;
    for event in raw.split("\n\n").filter(|e| !e.is_empty()) {
        let data = event
            .strip_prefix("data: ")
            .ok_or_else(|| format!("not an SSE data event: {event:?}"))?;
        if done {
            return Err(format!("data after [DONE]: {data}"));
        }
        if data == "[DONE]" {
            done = true;
            continue;
        }
        let v: Value = serde_json::from_str(data).map_err(|e| format!("chunk {data}: {e}"))?;
        if v.get("error").is_some() {
            return Err(format!("error event: {data}"));
        }
        answer
            .ids
            .push(v["id"].as_str().ok_or("chunk without id")?.into());
        if let Some(usage) = v.get("usage").filter(|u| !u.is_null()) {
            answer.prompt_tokens = usage["prompt_tokens"].as_u64().ok_or("usage")?;
            answer.completion_tokens = usage["completion_tokens"].as_u64().ok_or("usage")?;
        }
        if let Some(choice) = v["choices"].get(0) {
            if let Some(t) = choice_text(choice) {
                answer.text.push_str(t);
            }
            if let Some(f) = choice["finish_reason"].as_str() {
                answer.finish_reason = f.into();
            }
        }
    }
    if !done {
        return Err("the stream did not end with [DONE]".into());
    }
    if answer.finish_reason.is_empty() {
        return Err("no finish_reason".into());
    }
    Ok(answer)
}

/// The value of an unlabelled metric line `name value`.
pub fn metric(text: &str, name: &str) -> Option<f64> {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.trim().parse().ok())
}

pub async fn metrics(client: &reqwest::Client, base: &str) -> String {
    client
        .get(format!("{base}/metrics"))
        .send()
        .await
        .expect("metrics")
        .text()
        .await
        .expect("metrics text")
}

/// Polls `/metrics` until no cache slot is in use and nothing is queued or running
/// (bounded: fails after `limit`).
pub async fn wait_for_idle_pool(client: &reqwest::Client, base: &str, limit: Duration) -> String {
    let started = Instant::now();
    loop {
        let text = metrics(client, base).await;
        let idle = metric(&text, "sieve_kv_slots_in_use") == Some(0.0)
            && metric(&text, "sieve_running_sequences") == Some(0.0)
            && metric(&text, "sieve_queue_depth") == Some(0.0);
        if idle {
            return text;
        }
        assert!(
            started.elapsed() < limit,
            "the pool did not drain within {limit:?}:\n{text}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

//! End-to-end and fault tests of the server on a loopback port with the default model.

mod common;

use std::time::Duration;

use common::*;
use futures_util::StreamExt;
use serde_json::{json, Value};

fn prompts() -> Vec<Prompt> {
    vec![
        Prompt::Text("The capital of France is".into()),
        Prompt::Text("def fibonacci(n):".into()),
        Prompt::Chat("What is 2 + 2?".into()),
        Prompt::Chat("Name three colors.".into()),
    ]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn greedy_answers_equal_the_library_generate_streamed_or_not() {
    if model_path().is_none() {
        return;
    }
    let _serial = SERIAL.lock().await;
    let server = start(&ServeConfig {
        max_batch: 4,
        ..config()
    });
    let base = format!("http://{}", server.addr());
    let client = client();
    let max_tokens = 12;
    for prompt in prompts() {
        let (want, prompt_tokens, generated, want_finish) = greedy_answer(&prompt, max_tokens);
        for stream in [false, true] {
            let got = ask(&client, &base, &prompt, max_tokens, stream)
                .await
                .unwrap_or_else(|e| panic!("{prompt:?} stream={stream}: {e}"));
            assert_eq!(got.text, want, "{prompt:?} stream={stream}");
            assert_eq!(got.finish_reason, want_finish, "{prompt:?}");
            // The completions stream has no usage chunk unless asked; chat asks.
            if !stream || matches!(prompt, Prompt::Chat(_)) {
                assert_eq!(got.prompt_tokens, prompt_tokens as u64, "{prompt:?}");
                assert_eq!(got.completion_tokens, generated as u64, "{prompt:?}");
            }
            assert!(got.ids.iter().all(|id| id == &got.ids[0]), "{:?}", got.ids);
        }
    }

    // The other endpoints.
    let models: Value = client
        .get(format!("{base}/v1/models"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(models["data"][0]["id"], "SmolLM2-135M-Instruct.Q4_1");
    let health = client.get(format!("{base}/health")).send().await.unwrap();
    assert_eq!(health.status(), 200);
    let page = client.get(format!("{base}/")).send().await.unwrap();
    assert_eq!(page.status(), 200);
    let html = page.text().await.unwrap();
    assert!(
        html.contains("/v1/chat/completions")
            && !html.contains("http://")
            && !html.contains("https://")
    );
    let text = metrics(&client, &base).await;
    for line in [
        "sieve_requests_total{endpoint=\"/v1/completions\",status=\"200\"} 4",
        "sieve_requests_total{endpoint=\"/v1/chat/completions\",status=\"200\"} 4",
        "sieve_kv_slots_total 4",
        "# TYPE sieve_time_to_first_token_seconds histogram",
        "sieve_time_to_first_token_seconds_count 8",
    ] {
        assert!(text.contains(line), "missing {line:?} in\n{text}");
    }
    // The pool's bytes, and the greedy decode steps whose tokens the engine chose.
    let value = |name: &str| -> u64 {
        text.lines()
            .find_map(|l| l.strip_prefix(&format!("{name} ")))
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("no {name} in\n{text}"))
    };
    assert!(value("sieve_kv_cache_bytes") > 0, "{text}");
    assert!(value("sieve_engine_chosen_steps_total") > 0, "{text}");
    server.shutdown().unwrap();
}

/// Sends `body` (raw bytes) and returns the status, the Retry-After header and the JSON body.
async fn raw_post(
    client: &reqwest::Client,
    url: &str,
    key: Option<&str>,
    body: impl Into<reqwest::Body>,
) -> (u16, Value) {
    let mut request = client
        .post(url)
        .header("content-type", "application/json")
        .body(body);
    if let Some(key) = key {
        request = request.bearer_auth(key);
    }
    let response = request.send().await.expect("sent");
    let status = response.status().as_u16();
    let value: Value = response.json().await.expect("a JSON error body");
    (status, value)
}

/// What is wrong, the URL, the API key sent, the body, the status and `param` expected.
type BadCase<'a> = (
    &'a str,
    &'a str,
    Option<&'a str>,
    String,
    u16,
    Option<&'a str>,
);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_requests_get_openai_errors_and_the_server_serves_on() {
    if model_path().is_none() {
        return;
    }
    let _serial = SERIAL.lock().await;
    let server = start(&ServeConfig {
        api_key: Some("sekret".into()),
        body_limit: 4096,
        context: 64,
        max_tokens_cap: 32,
        max_batch: 2,
        ..config()
    });
    let base = format!("http://{}", server.addr());
    let client = client();
    let url = format!("{base}/v1/completions");
    let chat = format!("{base}/v1/chat/completions");
    let ok = json!({"prompt": "Hello", "max_tokens": 4, "temperature": 0}).to_string();
    let long_prompt = "word ".repeat(200);
    let cases: Vec<BadCase> = vec![
        ("no key", &url, None, ok.clone(), 401, None),
        ("wrong key", &url, Some("nope"), ok.clone(), 401, None),
        (
            "malformed JSON",
            &url,
            Some("sekret"),
            "{\"prompt\": ".into(),
            400,
            None,
        ),
        (
            "not an object",
            &url,
            Some("sekret"),
            "[]".into(),
            400,
            None,
        ),
        (
            "wrong type",
            &url,
            Some("sekret"),
            json!({"prompt": "a", "temperature": "hot"}).to_string(),
            400,
            Some("temperature"),
        ),
        (
            "wrong type in chat",
            &chat,
            Some("sekret"),
            json!({"messages": [{"role": "user", "content": 1}]}).to_string(),
            400,
            Some("messages[0].content"),
        ),
        (
            "unknown model",
            &url,
            Some("sekret"),
            json!({"model": "gpt-9", "prompt": "a"}).to_string(),
            404,
            None,
        ),
        (
            "prompt over the context",
            &url,
            Some("sekret"),
            json!({"prompt": long_prompt}).to_string(),
            400,
            Some("prompt"),
        ),
        (
            "max_tokens over the cap",
            &url,
            Some("sekret"),
            json!({"prompt": "a", "max_tokens": 33}).to_string(),
            400,
            Some("max_tokens"),
        ),
        (
            "body over the limit",
            &url,
            Some("sekret"),
            json!({"prompt": "x".repeat(5000)}).to_string(),
            413,
            None,
        ),
    ];
    for (what, url, key, body, status, param) in cases {
        let (got, value) = raw_post(&client, url, key, body).await;
        assert_eq!(got, status, "{what}: {value}");
        let error = &value["error"];
        assert!(
            error["message"].as_str().is_some_and(|m| !m.is_empty()),
            "{what}: {value}"
        );
        assert!(error["type"].is_string(), "{what}: {value}");
        if let Some(param) = param {
            assert_eq!(error["param"], param, "{what}: {value}");
        }
    }
    let (_, value) = raw_post(
        &client,
        &url,
        Some("sekret"),
        json!({"prompt": "word ".repeat(200)}).to_string(),
    )
    .await;
    assert_eq!(value["error"]["code"], "context_length_exceeded");

    // Unknown routes and the open endpoints.
    let missing = client
        .get(format!("{base}/v2/nothing"))
        .send()
        .await
        .unwrap();
    assert_eq!(missing.status(), 404);
    let missing: Value = missing.json().await.unwrap();
    assert!(missing["error"]["message"]
        .as_str()
        .unwrap()
        .contains("/v2/nothing"));
    let models = client
        .get(format!("{base}/v1/models"))
        .send()
        .await
        .unwrap();
    assert_eq!(models.status(), 401);
    let health = client.get(format!("{base}/health")).send().await.unwrap();
    assert_eq!(health.status(), 200);

    // Still serving, with the right answer.
    let (status, value) = raw_post(&client, &url, Some("sekret"), ok).await;
    assert_eq!(status, 200, "{value}");
    let (want, ..) = greedy_answer(&Prompt::Text("Hello".into()), 4);
    assert_eq!(value["choices"][0]["text"], want.as_str());
    let text = wait_for_idle_pool(&client, &base, Duration::from_secs(20)).await;
    assert!(
        text.contains("sieve_requests_total{endpoint=\"/v1/completions\",status=\"401\"} 2"),
        "{text}"
    );
    server.shutdown().unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn disconnected_clients_stop_their_generation_and_free_their_slot() {
    if model_path().is_none() {
        return;
    }
    let _serial = SERIAL.lock().await;
    let server = start(&ServeConfig {
        max_batch: 2,
        ..config()
    });
    let base = format!("http://{}", server.addr());
    let client = client();
    let long = |stream: bool| {
        json!({"prompt": "Once upon a time", "max_tokens": 400, "temperature": 0,
               "stream": stream, "stop": ["never appears in the text 12345"]})
    };

    // A stream read for a few chunks, then dropped mid-generation.
    let response = client
        .post(format!("{base}/v1/completions"))
        .json(&long(true))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    let mut chunks = response.bytes_stream();
    for _ in 0..3 {
        chunks.next().await.expect("a chunk").expect("readable");
    }
    drop(chunks);

    // A non-streamed request whose client gives up before the answer: 400 tokens take the
    // CPU engine seconds and the GPU engine (~1 ms a token) over 300 ms.
    let patience = Duration::from_millis(if on_gpu() { 100 } else { 400 });
    let impatient = reqwest::Client::builder()
        .no_proxy()
        .timeout(patience)
        .build()
        .unwrap();
    let gave_up = impatient
        .post(format!("{base}/v1/completions"))
        .json(&long(false))
        .send()
        .await;
    assert!(
        gave_up.is_err(),
        "400 tokens cannot come back in {patience:?}"
    );

    let text = wait_for_idle_pool(&client, &base, Duration::from_secs(30)).await;
    assert_eq!(metric(&text, "sieve_cancelled_total"), Some(2.0), "{text}");
    // Far fewer than the 800 tokens asked for were generated.
    let generated = metric(&text, "sieve_completion_tokens_total").unwrap();
    assert!(
        generated < 400.0,
        "{generated} tokens generated for cancelled requests"
    );

    // The freed slots serve new requests with the right answers.
    let prompt = Prompt::Chat("Say hello.".into());
    let (want, ..) = greedy_answer(&prompt, 8);
    let got = ask(&client, &base, &prompt, 8, true).await.unwrap();
    assert_eq!(got.text, want);
    server.shutdown().unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_queue_answers_503_with_retry_after() {
    if model_path().is_none() {
        return;
    }
    let _serial = SERIAL.lock().await;
    let server = start(&ServeConfig {
        max_batch: 1,
        queue_capacity: 1,
        ..config()
    });
    let base = format!("http://{}", server.addr());
    let client = client();
    let prompts: Vec<Prompt> = (0..6)
        .map(|i| Prompt::Text(format!("Count from {i} to {}:", i + 20)))
        .collect();
    let max_tokens = 24;
    let tasks: Vec<_> = prompts
        .iter()
        .cloned()
        .map(|prompt| {
            let (client, url) = (client.clone(), format!("{base}{}", path_for(&prompt)));
            tokio::spawn(async move {
                let response = client
                    .post(url)
                    .json(&body(&prompt, max_tokens, false))
                    .send()
                    .await
                    .expect("sent");
                let status = response.status().as_u16();
                let retry = response
                    .headers()
                    .get("retry-after")
                    .map(|v| v.to_str().unwrap_or_default().to_owned());
                let value: Value = response.json().await.expect("JSON");
                (prompt, status, retry, value)
            })
        })
        .collect();
    let (mut served, mut refused) = (0, Vec::new());
    for task in tasks {
        let (prompt, status, retry, value) = task.await.unwrap();
        match status {
            200 => {
                served += 1;
                let (want, ..) = greedy_answer(&prompt, max_tokens);
                assert_eq!(value["choices"][0]["text"], want.as_str(), "{prompt:?}");
            }
            503 => {
                assert_eq!(retry.as_deref(), Some("1"));
                assert_eq!(value["error"]["code"], "server_overloaded", "{value}");
                refused.push(prompt);
            }
            other => panic!("unexpected status {other}: {value}"),
        }
    }
    // At most one running and one queued fit; six at once cannot all.
    assert!(
        served >= 1 && !refused.is_empty(),
        "served {served}, refused {}",
        refused.len()
    );
    let text = wait_for_idle_pool(&client, &base, Duration::from_secs(20)).await;
    assert_eq!(
        metric(&text, "sieve_rejected_total{reason=\"queue_full\"}"),
        Some(refused.len() as f64),
        "{text}"
    );
    // Retried after the pool drained, the refused requests get their own answers.
    for prompt in &refused {
        let got = ask(&client, &base, prompt, max_tokens, false)
            .await
            .unwrap();
        let (want, ..) = greedy_answer(prompt, max_tokens);
        assert_eq!(got.text, want, "{prompt:?}");
    }
    server.shutdown().unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_finishes_requests_in_flight_and_refuses_new_ones() {
    if model_path().is_none() {
        return;
    }
    let _serial = SERIAL.lock().await;
    let server = start(&ServeConfig {
        max_batch: 2,
        ..config()
    });
    let base = format!("http://{}", server.addr());
    let client = client();
    let prompts: Vec<Prompt> = (0..3)
        .map(|i| Prompt::Chat(format!("Tell me fact number {i} about the sea.")))
        .collect();
    let max_tokens = 32;
    let tasks: Vec<_> = prompts
        .iter()
        .cloned()
        .map(|prompt| {
            let (client, base) = (client.clone(), base.clone());
            tokio::spawn(async move { ask(&client, &base, &prompt, max_tokens, true).await })
        })
        .collect();
    // Wait until two are generating and one is queued, then shut down with all three in flight.
    let started = std::time::Instant::now();
    loop {
        let text = metrics(&client, &base).await;
        let running = metric(&text, "sieve_running_sequences").unwrap_or(0.0);
        let queued = metric(&text, "sieve_queue_depth").unwrap_or(0.0);
        if running == 2.0 && queued == 1.0 {
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "nothing started"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let stopping = tokio::task::spawn_blocking(move || server.shutdown());
    for (prompt, task) in prompts.iter().zip(tasks) {
        let got = task.await.unwrap().expect("in-flight request finishes");
        let (want, ..) = greedy_answer(prompt, max_tokens);
        assert_eq!(got.text, want, "{prompt:?}");
    }
    stopping.await.unwrap().expect("clean shutdown");
    // Stopped: nothing listens any more.
    let after = client.get(format!("{base}/health")).send().await;
    assert!(after.is_err(), "still answering after shutdown");
}

/// Prompts prefilled in chunks (here at most 20 tokens a step, so the longer prompts take
/// several steps and their chunks interleave with the others' decode steps) give the same
/// greedy answers as the library's generate, which runs each prompt whole.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prompts_prefilled_in_chunks_answer_as_whole_ones() {
    if model_path().is_none() {
        return;
    }
    let _serial = SERIAL.lock().await;
    let server = start(&ServeConfig {
        max_batch: 3,
        prefill_chunk: 20,
        ..config()
    });
    let base = format!("http://{}", server.addr());
    let client = client();
    let max_tokens = 10;
    let mut prompts = prompts();
    prompts.push(Prompt::Text(
        "A long prompt, cut into many chunks: one, two, three, four, five, six, seven, \
         eight, nine, ten, eleven, twelve, and then"
            .into(),
    ));
    let tasks: Vec<_> = prompts
        .iter()
        .cloned()
        .enumerate()
        .map(|(i, prompt)| {
            let (client, base) = (client.clone(), base.clone());
            tokio::spawn(async move { ask(&client, &base, &prompt, max_tokens, i % 2 == 0).await })
        })
        .collect();
    for (prompt, task) in prompts.iter().zip(tasks) {
        let got = task
            .await
            .unwrap()
            .unwrap_or_else(|e| panic!("{prompt:?}: {e}"));
        let (want, ..) = greedy_answer(prompt, max_tokens);
        assert_eq!(got.text, want, "{prompt:?}");
    }
    let text = metrics(&client, &base).await;
    assert_eq!(metric(&text, "sieve_kv_slots_in_use"), Some(0.0), "{text}");
    // The chat prompts and the long one went in more than one chunk each.
    let chunks = metric(&text, "sieve_prefill_chunks_total").unwrap_or(0.0);
    assert!(
        chunks >= prompts.len() as f64 + 3.0,
        "{chunks} chunks\n{text}"
    );
    server.shutdown().unwrap();
}

/// `--kv-cache int8`: the pool's slots hold 8-bit rows and their scales (the bytes `/metrics`
/// reports are exactly that), and every greedy answer equals the library's `generate` over an
/// 8-bit cache on the same device (with `SIEVE_SERVE_TEST_DEVICE=cuda`: the GPU engine against
/// the GPU runner's `generate`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn int8_kv_cache_slots_answer_as_the_library_does() {
    let Some(path) = model_path() else { return };
    let _serial = SERIAL.lock().await;
    let config = ServeConfig {
        max_batch: 2,
        context: 512,
        kv_cache: sieve_model::llama::KvPrecision::Int8,
        ..config()
    };
    let server = start(&config);
    let base = format!("http://{}", server.addr());
    let client = client();
    let (mut model, tokenizer) =
        sieve_model::packed::load_model_and_tokenizer(&path).expect("the model loads");
    model.set_kv_precision(sieve_model::llama::KvPrecision::Int8);
    let max_tokens = 12;
    for text in ["The capital of France is", "def fibonacci(n):"] {
        let ids = tokenizer
            .encode(text, tokenizer.add_bos_by_default())
            .unwrap();
        let options = sieve_model::generate::GenerateOptions {
            max_tokens,
            ..Default::default()
        };
        let want = if on_gpu() {
            let gpu = sieve_cuda::Gpu::new(0).expect("SIEVE_SERVE_TEST_DEVICE=cuda needs a GPU");
            let mut gpu_model =
                sieve_gpu::GpuModel::from_model(gpu, &model, 512).expect("the model uploads");
            assert_eq!(
                gpu_model.report().kv_precision,
                sieve_model::llama::KvPrecision::Int8
            );
            let g =
                sieve_gpu::generate::generate(&mut gpu_model, &tokenizer, &ids, &options, |_| {
                    Ok(())
                })
                .expect("generates on the GPU");
            g.text
        } else {
            sieve_model::generate::run_in_pool(None, || {
                sieve_model::generate::generate(&model, &tokenizer, &ids, &options, |_| Ok(()))
            })
            .expect("pool")
            .expect("generates")
            .text
        };
        let got = ask(
            &client,
            &base,
            &Prompt::Text(text.into()),
            max_tokens,
            false,
        )
        .await
        .expect("answers");
        assert_eq!(got.text, want, "{text}");
    }
    let text = metrics(&client, &base).await;
    let c = model.config();
    let want_bytes = 2 * 2 * c.num_layers * 512 * c.num_kv_heads * (c.head_dim + 4);
    assert!(
        text.contains(&format!("sieve_kv_cache_bytes {want_bytes}")),
        "want {want_bytes} in\n{text}"
    );
    server.shutdown().unwrap();
}

//! `sieve_serve::load` (what `sieve bench serve` runs) against a real server: every request
//! counted, streamed token counts equal to the servers' own usage counts, the timings ordered,
//! and what is not a usable server refused before any load.

mod common;

use std::time::Duration;

use common::*;
use sieve_serve::load::{run_load, LoadError, LoadOptions};

fn options(clients: usize, requests: usize, stream: bool) -> LoadOptions {
    LoadOptions {
        clients,
        requests,
        max_tokens: 8,
        prompt_words: 6,
        stream,
        api_key: None,
        model: None,
        timeout: Duration::from_secs(300),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn load_counts_every_request_and_token() {
    if model_path().is_none() {
        return;
    }
    let _serial = SERIAL.lock().await;
    let server = start(&ServeConfig {
        max_batch: 4,
        ..config()
    });
    let base = format!("http://{}", server.addr());
    let streamed = run_load(&base, &options(3, 2, true)).await.unwrap();
    assert_eq!((streamed.requests, streamed.errors), (6, 0), "{streamed:?}");
    assert!(streamed.generated_tokens >= 6 && streamed.generated_tokens <= 6 * 8);
    let (ttft, latency) = (
        streamed.ttft_ms_p50.unwrap(),
        streamed.latency_ms_p50.unwrap(),
    );
    assert!(ttft > 0.0 && ttft <= streamed.latency_ms_p99.unwrap() && latency > 0.0);
    assert!(streamed.tpot_ms_p50.unwrap() > 0.0);
    assert!(streamed.tokens_per_s > 0.0 && streamed.wall_s > 0.0);
    // The same requests whole: greedy, so the server's usage counts the same tokens the stream
    // delivered one chunk each.
    let whole = run_load(&base, &options(3, 2, false)).await.unwrap();
    assert_eq!((whole.requests, whole.errors), (6, 0), "{whole:?}");
    assert_eq!(whole.generated_tokens, streamed.generated_tokens);
    assert_eq!((whole.ttft_ms_p50, whole.tpot_ms_p50), (None, None));
    // The prompts' tokens as the server counted them: from the usage chunk the stream asked
    // for, and from the whole answers' usage; the same prompts, so the same mean.
    let prompt = streamed.prompt_tokens_per_request_mean.unwrap();
    assert!(prompt >= 6.0, "{streamed:?}");
    assert_eq!(whole.prompt_tokens_per_request_mean, Some(prompt));
    assert!(
        streamed
            .summary()
            .contains(&format!("prompt {prompt:.1} tokens/request")),
        "{}",
        streamed.summary()
    );
    assert!(
        whole.summary().contains("6 requests"),
        "{}",
        whole.summary()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn what_is_not_a_usable_server_is_refused_before_the_load() {
    for (url, want) in [
        ("https://127.0.0.1:8080", "http://"),
        ("http://127.0.0.1:notaport", "port"),
    ] {
        let e = run_load(url, &options(1, 1, true)).await.unwrap_err();
        assert!(
            matches!(e, LoadError::BadUrl { .. }) && e.to_string().contains(want),
            "{e}"
        );
    }
    let e = run_load("http://127.0.0.1:9", &options(0, 1, true))
        .await
        .unwrap_err();
    assert!(matches!(e, LoadError::Options(_)), "{e}");
    // Nothing listens on port 9 (discard) on a test machine: refused at the first request.
    let e = run_load("http://127.0.0.1:9", &options(1, 1, true))
        .await
        .unwrap_err();
    assert!(matches!(e, LoadError::NoServer { .. }), "{e}");

    if model_path().is_none() {
        return;
    }
    let _serial = SERIAL.lock().await;
    let server = start(&ServeConfig {
        api_key: Some("secret".into()),
        ..config()
    });
    let base = format!("http://{}", server.addr());
    let e = run_load(&base, &options(1, 1, true)).await.unwrap_err();
    assert!(e.to_string().contains("401"), "{e}");
    let with_key = LoadOptions {
        api_key: Some("secret".into()),
        ..options(1, 1, true)
    };
    let r = run_load(&base, &with_key).await.unwrap();
    assert_eq!((r.requests, r.errors), (1, 0), "{r:?}");
}

/// A stand-in server: `/v1/models` answers 200; `/v1/completions` answers 200 with `stream` as
/// its whole body (no chunking, then the connection closes).
async fn fake_server(stream: &'static str) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((mut socket, _)) = listener.accept().await {
            tokio::spawn(async move {
                let mut request = Vec::new();
                let mut buf = [0u8; 4096];
                // The head, then as many body bytes as Content-Length says.
                let (head_end, length) = loop {
                    let Ok(n) = socket.read(&mut buf).await else {
                        return;
                    };
                    if n == 0 {
                        return;
                    }
                    request.extend_from_slice(&buf[..n]);
                    let text = String::from_utf8_lossy(&request).to_lowercase();
                    if let Some(end) = text.find("\r\n\r\n") {
                        let length = text
                            .lines()
                            .find_map(|l| l.strip_prefix("content-length:"))
                            .and_then(|v| v.trim().parse::<usize>().ok())
                            .unwrap_or(0);
                        break (end + 4, length);
                    }
                };
                while request.len() < head_end + length {
                    let Ok(n) = socket.read(&mut buf).await else {
                        return;
                    };
                    if n == 0 {
                        break;
                    }
                    request.extend_from_slice(&buf[..n]);
                }
                let body = if request.starts_with(b"GET /v1/models") {
                    "{\"data\": []}"
                } else {
                    stream
                };
                let response = format!(
                    "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: close\r\n\r\n{body}"
                );
                let _ = socket.write_all(response.as_bytes()).await;
            });
        }
    });
    format!("http://{addr}")
}

/// A stream cut before `[DONE]` and without a finish reason, or one reporting an error, is a
/// failed request, not a short success; a stream that ends properly counts its chunks.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cut_or_failed_streams_count_as_errors() {
    let chunk = |text: &str, reason: &str| {
        format!(
            "data: {{\"choices\": [{{\"text\": \"{text}\", \"finish_reason\": {reason}}}]}}\n\n"
        )
    };
    let whole: &'static str = Box::leak(
        format!(
            "{}{}data: [DONE]\n\n",
            chunk("a", "null"),
            chunk("b", "\"length\"")
        )
        .into_boxed_str(),
    );
    let r = run_load(&fake_server(whole).await, &options(2, 2, true))
        .await
        .unwrap();
    assert_eq!(
        (r.requests, r.errors, r.generated_tokens),
        (4, 0, 8),
        "{r:?}"
    );
    // No usage chunk: no prompt count, said as such.
    assert_eq!(r.prompt_tokens_per_request_mean, None);
    assert!(
        r.summary().contains("prompt - tokens/request"),
        "{}",
        r.summary()
    );
    let with_usage: &'static str = Box::leak(
        format!(
            "{}{}data: {{\"choices\": [], \"usage\": {{\"prompt_tokens\": 12, \"completion_tokens\": 2}}}}\n\ndata: [DONE]\n\n",
            chunk("a", "null"),
            chunk("b", "\"length\"")
        )
        .into_boxed_str(),
    );
    let r = run_load(&fake_server(with_usage).await, &options(1, 2, true))
        .await
        .unwrap();
    assert_eq!(
        (
            r.requests,
            r.generated_tokens,
            r.prompt_tokens_per_request_mean
        ),
        (2, 4, Some(12.0)),
        "{r:?}"
    );
    // A token streamed without text (llama-server holds back partial UTF-8 and sends the
    // chunk empty), and a chunk of two tokens: the server's usage count (4) is the count.
    let textless: &'static str = Box::leak(
        format!(
            "{}{}{}data: {{\"choices\": [], \"usage\": {{\"prompt_tokens\": 5, \"completion_tokens\": 4}}}}\n\ndata: [DONE]\n\n",
            chunk("a", "null"),
            chunk("", "null"),
            chunk("b", "\"length\"")
        )
        .into_boxed_str(),
    );
    let r = run_load(&fake_server(textless).await, &options(1, 2, true))
        .await
        .unwrap();
    assert_eq!(
        (r.requests, r.errors, r.generated_tokens),
        (2, 0, 8),
        "{r:?}"
    );
    // The same stream with a usage count below the token chunks seen (0): the three chunks
    // count, the textless one too (the closing chunk here carries text, so it is a token).
    let low: &'static str = Box::leak(
        format!(
            "{}{}{}data: {{\"choices\": [], \"usage\": {{\"completion_tokens\": 0}}}}\n\ndata: [DONE]\n\n",
            chunk("a", "null"),
            chunk("", "null"),
            chunk("b", "\"length\"")
        )
        .into_boxed_str(),
    );
    let r = run_load(&fake_server(low).await, &options(1, 2, true))
        .await
        .unwrap();
    assert_eq!(
        (r.requests, r.errors, r.generated_tokens),
        (2, 0, 6),
        "{r:?}"
    );

    let cut: &'static str =
        Box::leak(format!("{}{}", chunk("a", "null"), chunk("b", "null")).into_boxed_str());
    let r = run_load(&fake_server(cut).await, &options(1, 2, true))
        .await
        .unwrap();
    assert_eq!((r.requests, r.errors), (0, 2), "{r:?}");
    assert!(
        r.first_errors[0].contains("without [DONE]"),
        "{:?}",
        r.first_errors
    );

    let failed = "data: {\"error\": {\"message\": \"out of memory\"}}\n\n";
    let r = run_load(&fake_server(failed).await, &options(1, 1, true))
        .await
        .unwrap();
    assert_eq!((r.requests, r.errors), (0, 1), "{r:?}");
    assert!(
        r.first_errors[0].contains("out of memory"),
        "{:?}",
        r.first_errors
    );
}

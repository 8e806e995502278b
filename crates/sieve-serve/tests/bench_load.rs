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

//! Load: 16 concurrent clients x 8 requests each, distinct prompts, streamed and not; every
//! answer must be complete, well formed and the single-request answer to its own prompt.

mod common;

use std::collections::HashSet;
use std::time::Duration;

use common::*;

const CLIENTS: usize = 16;
const REQUESTS_PER_CLIENT: usize = 8;
const MAX_TOKENS: usize = 6;

fn prompt(client: usize, request: usize) -> Prompt {
    let i = client * REQUESTS_PER_CLIENT + request;
    let topics = [
        "rivers", "stars", "bread", "music", "trees", "numbers", "boats", "rain",
    ];
    let topic = topics[i % topics.len()];
    if i.is_multiple_of(2) {
        Prompt::Text(format!("Fact {i} about {topic}:"))
    } else {
        Prompt::Chat(format!("Tell me one thing about {topic} (question {i})."))
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sixteen_clients_get_their_own_single_request_answers() {
    if model_path().is_none() {
        return;
    }
    let _serial = SERIAL.lock().await;
    let server = start(&ServeConfig {
        max_batch: 8,
        queue_capacity: CLIENTS * REQUESTS_PER_CLIENT,
        ..config()
    });
    let base = format!("http://{}", server.addr());
    let http = client();
    let tasks: Vec<_> = (0..CLIENTS)
        .map(|c| {
            let (http, base) = (http.clone(), base.clone());
            tokio::spawn(async move {
                let mut answers = Vec::new();
                for r in 0..REQUESTS_PER_CLIENT {
                    let p = prompt(c, r);
                    let stream = (c + r).is_multiple_of(2);
                    let answer = ask(&http, &base, &p, MAX_TOKENS, stream).await;
                    answers.push((p, stream, answer));
                }
                answers
            })
        })
        .collect();
    let mut results = Vec::new();
    for task in tasks {
        results.extend(task.await.expect("client task"));
    }
    assert_eq!(results.len(), CLIENTS * REQUESTS_PER_CLIENT);
    let mut ids = HashSet::new();
    for (p, stream, answer) in &results {
        let answer = answer
            .as_ref()
            .unwrap_or_else(|e| panic!("{p:?} stream={stream}: {e}"));
        let (want, prompt_tokens, generated, want_finish) = greedy_answer(p, MAX_TOKENS);
        assert_eq!(answer.text, want, "{p:?} stream={stream}");
        assert_eq!(answer.finish_reason, want_finish, "{p:?} stream={stream}");
        if !stream || matches!(p, Prompt::Chat(_)) {
            assert_eq!(answer.prompt_tokens, prompt_tokens as u64, "{p:?}");
            assert_eq!(answer.completion_tokens, generated as u64, "{p:?}");
        }
        // One id per response, never shared with another response.
        assert!(answer.ids.iter().all(|id| id == &answer.ids[0]), "{p:?}");
        assert!(
            ids.insert(answer.ids[0].clone()),
            "id {} seen twice",
            answer.ids[0]
        );
    }
    let text = wait_for_idle_pool(&http, &base, Duration::from_secs(30)).await;
    let largest = metric(&text, "sieve_batch_size_max").unwrap_or(0.0);
    assert!(
        largest >= 2.0,
        "requests never shared a decode step:\n{text}"
    );
    assert_eq!(metric(&text, "sieve_cancelled_total"), Some(0.0));
    eprintln!("largest decode batch: {largest}");
    server.shutdown().unwrap();
}

//! Load benchmark for `sieve serve`: starts the server in this process on a free loopback port
//! with the default model, then serves CLIENTS x REQUESTS streamed, greedy requests with
//! distinct prompts twice: all clients at once (continuous batching), and the same requests
//! one at a time. Prints throughput, TTFT and latency percentiles and the decode batch sizes.
//!
//! cargo run --release -p sieve-serve --example load -- [--clients 16] [--requests 8]
//!     [--max-tokens 32] [--max-batch 8] [--threads N] [--model PATH]

use std::path::PathBuf;
use std::time::{Duration, Instant};

use futures_util::StreamExt;
use serde_json::{json, Value};
use sieve_serve::{load_cpu_engine, model_name_for, ServeConfig, Server};

struct Options {
    clients: usize,
    requests: usize,
    max_tokens: usize,
    max_batch: usize,
    threads: Option<usize>,
    model: PathBuf,
}

fn parse_options() -> Result<Options, String> {
    let home = std::env::var_os("SIEVE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache/sieve")))
        .ok_or("neither SIEVE_HOME nor HOME is set")?;
    let mut o = Options {
        clients: 16,
        requests: 8,
        max_tokens: 32,
        max_batch: 8,
        threads: None,
        model: home.join("models/SmolLM2-135M-Instruct.Q4_1.gguf"),
    };
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mut it = args.iter();
    while let Some(flag) = it.next() {
        let value = it.next().ok_or_else(|| format!("{flag} needs a value"))?;
        let number = || {
            value
                .parse::<usize>()
                .map_err(|e| format!("{flag} {value}: {e}"))
        };
        match flag.as_str() {
            "--clients" => o.clients = number()?,
            "--requests" => o.requests = number()?,
            "--max-tokens" => o.max_tokens = number()?,
            "--max-batch" => o.max_batch = number()?,
            "--threads" => o.threads = Some(number()?),
            "--model" => o.model = PathBuf::from(value),
            other => return Err(format!("unknown flag {other}")),
        }
    }
    if o.clients == 0 || o.requests == 0 || o.max_tokens == 0 {
        return Err("--clients, --requests and --max-tokens must be at least 1".into());
    }
    Ok(o)
}

/// One request as measured by its client.
#[derive(Clone, Debug)]
struct Sample {
    ttft: f64,
    latency: f64,
    tokens: u64,
    text: String,
}

fn prompt(i: usize) -> String {
    let topics = [
        "rivers", "stars", "bread", "music", "trees", "numbers", "boats", "rain",
    ];
    format!(
        "Tell me one thing about {} (question {i}).",
        topics[i % topics.len()]
    )
}

async fn one(
    client: &reqwest::Client,
    base: &str,
    i: usize,
    max_tokens: usize,
) -> Result<Sample, String> {
    let started = Instant::now();
    let response = client
        .post(format!("{base}/v1/chat/completions"))
        .json(&json!({
            "messages": [{"role": "user", "content": prompt(i)}],
            "max_tokens": max_tokens, "temperature": 0, "stream": true,
            "stream_options": {"include_usage": true},
        }))
        .send()
        .await
        .map_err(|e| e.to_string())?;
    if !response.status().is_success() {
        return Err(format!("status {}", response.status()));
    }
    let mut body = response.bytes_stream();
    let (mut buffer, mut text, mut ttft, mut tokens) = (String::new(), String::new(), None, 0);
    while let Some(chunk) = body.next().await {
        buffer.push_str(&String::from_utf8_lossy(&chunk.map_err(|e| e.to_string())?));
        while let Some(end) = buffer.find("\n\n") {
            let event: String = buffer.drain(..end + 2).collect();
            let data = event
                .trim()
                .strip_prefix("data: ")
                .unwrap_or_default()
                .to_owned();
            if data == "[DONE]" || data.is_empty() {
                continue;
            }
            let v: Value = serde_json::from_str(&data).map_err(|e| e.to_string())?;
            if let Some(u) = v.get("usage").filter(|u| !u.is_null()) {
                tokens = u["completion_tokens"].as_u64().unwrap_or(0);
            }
            if let Some(piece) = v["choices"][0]["delta"]["content"].as_str() {
                if !piece.is_empty() {
                    ttft.get_or_insert_with(|| started.elapsed().as_secs_f64());
                    text.push_str(piece);
                }
            }
        }
    }
    let latency = started.elapsed().as_secs_f64();
    Ok(Sample {
        ttft: ttft.unwrap_or(latency),
        latency,
        tokens,
        text,
    })
}

fn percentile(values: &mut [f64], p: f64) -> f64 {
    values.sort_by(f64::total_cmp);
    let rank = ((p / 100.0) * values.len() as f64).ceil() as usize;
    values[rank.clamp(1, values.len()) - 1]
}

struct Summary {
    wall: f64,
    tokens: u64,
    ttft: (f64, f64),
    latency: (f64, f64),
}

fn summarize(samples: &[Sample], wall: f64) -> Summary {
    let mut ttft: Vec<f64> = samples.iter().map(|s| s.ttft).collect();
    let mut latency: Vec<f64> = samples.iter().map(|s| s.latency).collect();
    Summary {
        wall,
        tokens: samples.iter().map(|s| s.tokens).sum(),
        ttft: (percentile(&mut ttft, 50.0), percentile(&mut ttft, 99.0)),
        latency: (
            percentile(&mut latency, 50.0),
            percentile(&mut latency, 99.0),
        ),
    }
}

fn print_row(name: &str, s: &Summary) {
    println!(
        "| {name} | {} | {:.1} | {:.1} | {:.3} / {:.3} | {:.3} / {:.3} |",
        s.tokens,
        s.wall,
        s.tokens as f64 / s.wall,
        s.ttft.0,
        s.ttft.1,
        s.latency.0,
        s.latency.1
    );
}

/// `sieve_batch_size` bucket counts (not cumulative) and the largest batch, from /metrics.
async fn batch_sizes(client: &reqwest::Client, base: &str) -> (String, String) {
    let text = client
        .get(format!("{base}/metrics"))
        .send()
        .await
        .and_then(|r| r.error_for_status())
        .map_err(|e| e.to_string());
    let Ok(response) = text else {
        return ("?".into(), "?".into());
    };
    let text = response.text().await.unwrap_or_default();
    let mut out = Vec::new();
    let mut previous = 0.0;
    for line in text
        .lines()
        .filter(|l| l.starts_with("sieve_batch_size_bucket"))
    {
        let (Some(le), Some(count)) = (
            line.split('"').nth(1),
            line.rsplit(' ').next().and_then(|c| c.parse::<f64>().ok()),
        ) else {
            continue;
        };
        if count > previous {
            out.push(format!("<={le}: {}", count - previous));
        }
        previous = count;
    }
    let max = text
        .lines()
        .find_map(|l| l.strip_prefix("sieve_batch_size_max "))
        .unwrap_or("?")
        .to_owned();
    (out.join(", "), max)
}

fn main() -> Result<(), String> {
    let o = parse_options()?;
    let config = ServeConfig {
        port: 0,
        model_name: model_name_for(&o.model),
        max_batch: o.max_batch,
        queue_capacity: o.clients * o.requests,
        max_tokens_cap: o.max_tokens.max(1),
        threads: o.threads,
        ..ServeConfig::default()
    };
    let (engine, tokenizer) = load_cpu_engine(&o.model, &config).map_err(|e| e.to_string())?;
    let server = Server::start(Box::new(engine), tokenizer, &config).map_err(|e| e.to_string())?;
    let base = format!("http://{}", server.addr());
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(|e| e.to_string())?;
    let client = reqwest::Client::builder()
        .no_proxy()
        .timeout(Duration::from_secs(600))
        .build()
        .map_err(|e| e.to_string())?;
    let total = o.clients * o.requests;
    runtime.block_on(async {
        // Warm-up (page faults of the weights and caches), not counted.
        one(&client, &base, total, o.max_tokens).await?;

        let started = Instant::now();
        let tasks: Vec<_> = (0..o.clients)
            .map(|c| {
                let (client, base) = (client.clone(), base.clone());
                let (requests, max_tokens) = (o.requests, o.max_tokens);
                tokio::spawn(async move {
                    let mut out = Vec::new();
                    for r in 0..requests {
                        let i = c * requests + r;
                        out.push((i, one(&client, &base, i, max_tokens).await?));
                    }
                    Ok::<_, String>(out)
                })
            })
            .collect();
        let mut concurrent = vec![None; total];
        for task in tasks {
            for (i, s) in task.await.map_err(|e| e.to_string())?? {
                concurrent[i] = Some(s);
            }
        }
        let concurrent_wall = started.elapsed().as_secs_f64();
        let concurrent: Vec<Sample> = concurrent.into_iter().flatten().collect();
        let (buckets, largest) = batch_sizes(&client, &base).await;

        let started = Instant::now();
        let mut sequential = Vec::new();
        for i in 0..total {
            sequential.push(one(&client, &base, i, o.max_tokens).await?);
        }
        let sequential_wall = started.elapsed().as_secs_f64();
        let same = concurrent
            .iter()
            .zip(&sequential)
            .filter(|(a, b)| a.text == b.text)
            .count();

        println!(
            "{} clients x {} requests, max_tokens {}, max_batch {}, threads {:?}",
            o.clients, o.requests, o.max_tokens, o.max_batch, o.threads
        );
        println!("| mode | tokens | wall s | tokens/s | TTFT p50 / p99 s | latency p50 / p99 s |");
        println!("|---|---|---|---|---|---|");
        let c = summarize(&concurrent, concurrent_wall);
        let s = summarize(&sequential, sequential_wall);
        print_row(&format!("{} concurrent clients", o.clients), &c);
        print_row("one at a time", &s);
        println!(
            "throughput ratio {:.2}x; decode batch sizes of the concurrent run (steps per bucket): {buckets}; largest {largest}",
            (c.tokens as f64 / c.wall) / (s.tokens as f64 / s.wall)
        );
        println!("answers identical between the two runs: {same} of {total}");
        Ok::<(), String>(())
    })?;
    server.shutdown().map_err(|e| e.to_string())
}

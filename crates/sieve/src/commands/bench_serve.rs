//! `sieve bench serve`: load on running OpenAI-compatible servers (`sieve_serve::load`), the same
//! request mix for each URL and client count; prints one line per run and, for several servers,
//! a comparison table.

use anyhow::Result;
use clap::Args;
use sieve_serve::load::{run_load_blocking, LoadOptions, LoadReport, ServerUrl};
use std::path::PathBuf;
use std::time::Duration;

#[derive(Args, Debug)]
pub struct ServeBenchArgs {
    /// Server base URL (`http://127.0.0.1:8080`); repeat it to compare servers under the same
    /// requests (`--url http://127.0.0.1:8080 --url http://127.0.0.1:8081` for sieve and
    /// llama-server).
    #[arg(long, required = true)]
    url: Vec<String>,
    /// Concurrent clients, one run per value.
    #[arg(long, value_delimiter = ',', default_value = "1,8")]
    clients: Vec<usize>,
    /// Requests per client, sent one after another.
    #[arg(long, default_value_t = 4)]
    requests: usize,
    #[arg(long, default_value_t = 128)]
    max_tokens: usize,
    /// Words per prompt (every prompt distinct).
    #[arg(long, default_value_t = 40)]
    prompt_words: usize,
    /// Ask for whole answers instead of streams (then only latency is timed).
    #[arg(long)]
    no_stream: bool,
    /// Sent as `Authorization: Bearer KEY` (default: $SIEVE_API_KEY when set).
    #[arg(long, env = "SIEVE_API_KEY", hide_env_values = true)]
    api_key: Option<String>,
    /// The requests' `model` field.
    #[arg(long)]
    model: Option<String>,
    /// Seconds one request may take.
    #[arg(long, default_value_t = 600)]
    timeout: u64,
    /// Also write every run's figures as JSON.
    #[arg(long)]
    json: Option<PathBuf>,
}

pub fn run(a: ServeBenchArgs) -> Result<()> {
    if a.clients.is_empty() {
        anyhow::bail!("--clients needs at least one count");
    }
    let options = |clients: usize| LoadOptions {
        clients,
        requests: a.requests,
        max_tokens: a.max_tokens,
        prompt_words: a.prompt_words,
        stream: !a.no_stream,
        api_key: a.api_key.clone().filter(|k| !k.is_empty()),
        model: a.model.clone(),
        timeout: Duration::from_secs(a.timeout.max(1)),
    };
    // Every URL and count is checked, and the JSON file created, before any load runs.
    for url in &a.url {
        ServerUrl::parse(url)?;
    }
    for &clients in &a.clients {
        options(clients).check()?;
    }
    let mut files = super::report_files::ReportFiles::open(a.json.as_deref(), None, &[])?;
    // A run that fails to start (a server gone at 32 clients, say) is reported as failed and
    // the others still run.
    let mut reports: Vec<LoadReport> = Vec::new();
    for &clients in &a.clients {
        for url in &a.url {
            let o = options(clients);
            let r = run_load_blocking(url, &o)
                .unwrap_or_else(|e| LoadReport::failed(url, &o, format!("load on {url}: {e}")));
            println!("{}", r.summary());
            for e in &r.first_errors {
                eprintln!("  error: {e}");
            }
            reports.push(r);
        }
    }
    if a.url.len() > 1 {
        println!("\n{}", comparison(&a.url, &reports));
    }
    files.write_json(|| Ok(serde_json::to_string_pretty(&reports)?))?;
    let failed: usize = reports.iter().map(|r| r.errors).sum();
    if failed > 0 {
        anyhow::bail!("{failed} requests failed (first errors above)");
    }
    Ok(())
}

/// Throughput and TPOT per client count, one column pair per server, each against the first.
fn comparison(urls: &[String], reports: &[LoadReport]) -> String {
    let mut s = String::from("| clients |");
    for u in urls {
        s += &format!(" {u} tok/s | TPOT p50 ms |");
    }
    for u in &urls[1..] {
        s += &format!(" {} / {u} |", urls[0]);
    }
    s += "\n|---|";
    s += &"---|---|".repeat(urls.len());
    s += &"---|".repeat(urls.len() - 1);
    for row in reports.chunks(urls.len()) {
        s += &format!("\n| {} |", row[0].clients);
        // A run with failed requests has no comparable throughput: "-" (its line says why).
        let complete = |r: &LoadReport| r.errors == 0 && r.tokens_per_s > 0.0;
        for r in row {
            let tpot = r.tpot_ms_p50.map_or("-".into(), |v| format!("{v:.2}"));
            let rate = if complete(r) {
                format!("{:.1}", r.tokens_per_s)
            } else {
                format!("- ({} errors)", r.errors)
            };
            s += &format!(" {rate} | {tpot} |");
        }
        for r in &row[1..] {
            let ratio = if complete(r) && complete(&row[0]) {
                format!("{:.2}x", row[0].tokens_per_s / r.tokens_per_s)
            } else {
                "-".into()
            };
            s += &format!(" {ratio} |");
        }
    }
    s
}

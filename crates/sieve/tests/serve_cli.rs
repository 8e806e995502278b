//! `sieve serve` as a process: its greedy answers equal `sieve generate`'s, and SIGTERM lets
//! the requests in flight finish before it exits.

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use serde_json::{json, Value};

fn model_present() -> bool {
    let home = std::env::var_os("SIEVE_HOME")
        .filter(|h| !h.is_empty())
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache/sieve")));
    let present = home.is_some_and(|h| h.join("models/SmolLM2-135M-Instruct.Q4_1.gguf").is_file());
    if !present {
        eprintln!("SKIPPED: the default model is absent; run `bash scripts/fetch-model.sh`");
    }
    present
}

fn sieve() -> Command {
    Command::new(env!("CARGO_BIN_EXE_sieve"))
}

/// `sieve generate` greedy output (stdout without the newline it ends with).
fn cli_generate(prompt: &str, max_tokens: usize, chat: bool) -> String {
    let mut cmd = sieve();
    cmd.args(["generate", "--max-tokens", &max_tokens.to_string()]);
    if chat {
        cmd.arg("--chat");
    }
    let out = cmd.arg(prompt).output().expect("sieve generate runs");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8(out.stdout).expect("UTF-8");
    text.strip_suffix('\n').unwrap_or(&text).to_owned()
}

/// A `sieve serve` child on a free port, its address, and its stderr lines as they come.
struct ServeProcess {
    child: Child,
    base: String,
    lines: mpsc::Receiver<String>,
}

impl ServeProcess {
    fn start(extra: &[&str]) -> Self {
        let mut cmd = sieve();
        cmd.args(["serve", "--port", "0", "--max-batch", "2"])
            .args(extra);
        Self::spawn(cmd)
    }

    /// `sieve serve ARGS` under `ulimit -n FILES` (soft and hard).
    fn start_with_file_limit(files: u32, extra: &[&str]) -> Self {
        let mut cmd = Command::new("sh");
        cmd.arg("-c")
            .arg(format!(
                "ulimit -n {files} && exec \"$0\" serve --port 0 --max-batch 2 \"$@\""
            ))
            .arg(env!("CARGO_BIN_EXE_sieve"))
            .args(extra);
        Self::spawn(cmd)
    }

    fn spawn(mut cmd: Command) -> Self {
        let mut child = cmd
            .env_remove("SIEVE_API_KEY")
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("sieve serve starts");
        let stderr = child.stderr.take().expect("piped");
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        let deadline = Instant::now() + Duration::from_secs(60);
        let base = loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match lines.recv_timeout(left) {
                Ok(line) => {
                    if let Some(at) = line.find("listening on ") {
                        break line[at + "listening on ".len()..].trim().to_owned();
                    }
                }
                Err(e) => {
                    let _ = child.kill();
                    panic!("sieve serve did not start: {e}");
                }
            }
        };
        Self { child, base, lines }
    }

    fn signal(&self, name: &str) {
        let status = Command::new("kill")
            .args([&format!("-{name}"), &self.child.id().to_string()])
            .status()
            .expect("kill runs");
        assert!(status.success());
    }

    /// Waits (bounded) for the process to exit and returns its status and remaining stderr.
    fn wait(mut self, limit: Duration) -> (std::process::ExitStatus, Vec<String>) {
        let deadline = Instant::now() + limit;
        loop {
            if let Some(status) = self.child.try_wait().expect("try_wait") {
                // The reader thread ends at EOF; what it has not passed on yet is still coming.
                let mut rest = Vec::new();
                while let Ok(line) = self.lines.recv_timeout(Duration::from_secs(5)) {
                    rest.push(line);
                }
                return (status, rest);
            }
            if Instant::now() > deadline {
                let _ = self.child.kill();
                panic!("sieve serve did not exit within {limit:?}");
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Drop for ServeProcess {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime")
}

fn http() -> reqwest::Client {
    reqwest::Client::builder()
        .no_proxy()
        .timeout(Duration::from_secs(120))
        .build()
        .expect("client")
}

/// The text of a complete SSE body, checking it ends with `[DONE]`.
fn stream_text(raw: &str) -> String {
    let mut text = String::new();
    let events: Vec<&str> = raw.split("\n\n").filter(|e| !e.is_empty()).collect();
    assert_eq!(events.last(), Some(&"data: [DONE]"), "{raw}");
    for event in &events[..events.len() - 1] {
        let v: Value =
            serde_json::from_str(event.strip_prefix("data: ").expect("data")).expect("chunk JSON");
        let choice = &v["choices"][0];
        if let Some(t) = choice["text"]
            .as_str()
            .or(choice["delta"]["content"].as_str())
        {
            text.push_str(t);
        }
    }
    text
}

#[test]
fn serve_answers_equal_sieve_generate() {
    if !model_present() {
        return;
    }
    let max_tokens = 16;
    let plain = "The capital of France is";
    let chat = "What is the tallest mountain?";
    let want_plain = cli_generate(plain, max_tokens, false);
    let want_chat = cli_generate(chat, max_tokens, true);
    let server = ServeProcess::start(&[]);
    let client = http();
    runtime().block_on(async {
        let got: Value = client
            .post(format!("{}/v1/completions", server.base))
            .json(&json!({"prompt": plain, "max_tokens": max_tokens, "temperature": 0}))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        assert_eq!(got["choices"][0]["text"], want_plain.as_str(), "{got}");
        let raw = client
            .post(format!("{}/v1/chat/completions", server.base))
            .json(&json!({"messages": [{"role": "user", "content": chat}],
                          "max_tokens": max_tokens, "temperature": 0, "stream": true}))
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        assert_eq!(stream_text(&raw), want_chat);
    });
    server.signal("TERM");
    let (status, _) = server.wait(Duration::from_secs(30));
    assert!(status.success(), "{status}");
}

#[test]
fn sigterm_lets_requests_in_flight_finish_then_exits() {
    if !model_present() {
        return;
    }
    let prompt = "Write a short poem about the sea.";
    let max_tokens = 48;
    let want = cli_generate(prompt, max_tokens, true);
    let server = ServeProcess::start(&[]);
    let client = http();
    let (raw, refused) = runtime().block_on(async {
        let response = client
            .post(format!("{}/v1/chat/completions", server.base))
            .json(&json!({"messages": [{"role": "user", "content": prompt}],
                          "max_tokens": max_tokens, "temperature": 0, "stream": true}))
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), 200);
        let mut response = response;
        // The role chunk, then the first token: generation is under way.
        let mut raw = String::new();
        while raw.matches("data: ").count() < 2 {
            let chunk = response.chunk().await.unwrap().expect("more chunks");
            raw.push_str(&String::from_utf8_lossy(&chunk));
        }
        server.signal("TERM");
        // New work is refused while the stream finishes (or the listener is already gone).
        tokio::time::sleep(Duration::from_millis(200)).await;
        let late = client
            .post(format!("{}/v1/completions", server.base))
            .json(&json!({"prompt": "late", "max_tokens": 2}))
            .send()
            .await;
        let refused = match late {
            Ok(r) => r.status() == 503,
            Err(_) => true,
        };
        while let Some(chunk) = response.chunk().await.unwrap() {
            raw.push_str(&String::from_utf8_lossy(&chunk));
        }
        (raw, refused)
    });
    assert!(refused, "a request after SIGTERM was served");
    assert_eq!(stream_text(&raw), want);
    let (status, rest) = server.wait(Duration::from_secs(30));
    assert!(status.success(), "{status}: {rest:?}");
    assert!(rest.iter().any(|l| l.contains("stopped")), "{rest:?}");
}

#[test]
fn serve_refuses_bad_settings_before_loading() {
    // Without a usable GPU, `--device cuda` is refused before the model loads (with one,
    // the server would start: the GPU engine's tests are sieve-serve's, on the GPU machine).
    if sieve_cuda::Gpu::new(0).is_err() {
        let out = sieve()
            .args(["serve", "--device", "cuda", "--port", "0"])
            .output()
            .expect("runs");
        assert!(!out.status.success());
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            err.contains("--device cuda") && err.contains("no usable GPU"),
            "{err}"
        );
        assert!(err.contains("--device cpu"), "{err}");
    }
    let out = sieve()
        .args(["serve", "--max-batch", "0", "--port", "0"])
        .output()
        .expect("runs");
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("--max-batch"));
    // A synthetic model's settings are checked before any device work: the shape's name, the
    // sparsities, the values a format's kernels take; without a GPU it is refused by name.
    for (args, says) in [
        (
            &["--prefill-chunk", "0"][..],
            "--prefill-chunk must be at least 1",
        ),
        (
            &["--synthetic", "llama9-1b"][..],
            "unknown synthetic model 'llama9-1b'",
        ),
        (
            &["--prompt-precision", "int8"][..],
            "takes f16 or f16-resident",
        ),
        (
            &["--prompt-precision", "f16-resident", "--device", "cpu"][..],
            "needs --device cuda",
        ),
        (
            &["--tensor-parallel", "2", "--device", "cpu"][..],
            "splits the model over GPUs",
        ),
        (
            &["--synthetic", "llama2-7b", "--sp", "1"][..],
            "--sp 1 is outside [0, 1)",
        ),
        (
            &[
                "--synthetic",
                "llama2-7b",
                "--sp",
                "0.5",
                "--format",
                "ie-bme",
            ][..],
            "ie-bme has no f16 GPU kernel",
        ),
    ] {
        let out = sieve()
            .arg("serve")
            .args(args)
            .args(["--port", "0"])
            .output()
            .expect("runs");
        assert!(!out.status.success(), "{args:?} accepted");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(says), "{args:?}: {err}");
    }
    if sieve_cuda::Gpu::new(0).is_err() {
        let out = sieve()
            .args(["serve", "--synthetic", "llama2-7b", "--port", "0"])
            .output()
            .expect("runs");
        assert!(!out.status.success());
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains("built on the GPU"), "{err}");
    }
}

/// A start-up failure is `sieve serve`'s exit with the message, before it listens (issue 30:
/// `--threads 257` listened, answered `/health` 200, and hung every POST).
#[test]
fn start_up_failures_stop_start_up_with_the_message() {
    for threads in ["257", "100000", "18446744073709551615"] {
        let started = Instant::now();
        let out = sieve()
            .args(["serve", "--port", "0", "--threads", threads])
            .env_remove("SIEVE_API_KEY")
            .output()
            .expect("runs");
        assert!(!out.status.success(), "--threads {threads} started");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains("outside 1..=256"), "{threads}: {err}");
        assert!(!err.contains("listening"), "{err}");
        assert!(started.elapsed() < Duration::from_secs(20));
    }
}

/// An empty or blank API key is an error, however it is given (issue 30: `--api-key ''` and
/// `SIEVE_API_KEY=` served /v1/* without a key).
#[test]
fn an_empty_api_key_fails_closed() {
    let cases: [(&[&str], Option<&str>); 4] = [
        (&["--api-key", ""], None),
        (&["--api-key", "   "], None),
        (&[], Some("")),
        (&[], Some(" \t")),
    ];
    for (args, env) in cases {
        let mut cmd = sieve();
        cmd.args(["serve", "--port", "0"]).args(args);
        match env {
            Some(v) => cmd.env("SIEVE_API_KEY", v),
            None => cmd.env_remove("SIEVE_API_KEY"),
        };
        let out = cmd.output().expect("runs");
        assert!(!out.status.success(), "{args:?} {env:?} started");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            err.contains("API key") && err.contains("empty"),
            "{args:?} {env:?}: {err}"
        );
    }
}

/// Issue 30: with the open-file limit at 256, 300 silent connections made `/health` and every
/// POST time out for as long as they stayed open. Now connections beyond the cap (kept below
/// the file limit) get an immediate 503, and the silent ones are closed by the header timeout.
#[test]
fn silent_connections_cannot_starve_the_server() {
    if !model_present() {
        return;
    }
    let server = ServeProcess::start_with_file_limit(256, &["--header-timeout", "2"]);
    let addr = server.base.trim_start_matches("http://").to_owned();
    let silent: Vec<std::net::TcpStream> = (0..300)
        .filter_map(|_| std::net::TcpStream::connect(&addr).ok())
        .collect();
    assert!(silent.len() >= 250, "{} connected", silent.len());
    let client = http();
    runtime().block_on(async {
        // Over the cap: an answer at once, not a hang.
        let started = Instant::now();
        let health = client.get(format!("{}/health", server.base)).send().await;
        if let Ok(r) = health {
            assert!(matches!(r.status().as_u16(), 200 | 503), "{}", r.status());
        }
        assert!(
            started.elapsed() < Duration::from_secs(2),
            "{:?}",
            started.elapsed()
        );
        // After the header timeout the silent connections are gone and the server serves.
        tokio::time::sleep(Duration::from_secs(3)).await;
        let health = client
            .get(format!("{}/health", server.base))
            .send()
            .await
            .expect("health answers");
        assert_eq!(health.status(), 200);
        let got: Value = client
            .post(format!("{}/v1/completions", server.base))
            .json(&json!({"prompt": "The capital of France is", "max_tokens": 4, "temperature": 0}))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        assert!(got["choices"][0]["text"].is_string(), "{got}");
    });
    // Every silent connection was closed by the server (EOF) or refused.
    for mut s in silent {
        use std::io::Read;
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let mut buf = Vec::new();
        if let Err(e) = s.read_to_end(&mut buf) {
            assert!(
                !matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ),
                "a silent connection was left open: {e}"
            );
        }
        let text = String::from_utf8_lossy(&buf);
        assert!(
            buf.is_empty() || text.starts_with("HTTP/1.1 503") || text.starts_with("HTTP/1.1 408"),
            "{text}"
        );
    }
    server.signal("TERM");
    let (status, rest) = server.wait(Duration::from_secs(30));
    assert!(status.success(), "{status}: {rest:?}");
}

/// `sieve bench serve` against a `sieve serve` process: one line per server and client count, the
/// comparison table for two URLs, the JSON file with every run; a bad URL refused by name.
#[test]
fn bench_serve_loads_a_running_server() {
    let bad = sieve()
        .args(["bench", "serve", "--url", "https://example.com"])
        .output()
        .expect("sieve bench serve runs");
    assert!(!bad.status.success());
    let err = String::from_utf8_lossy(&bad.stderr);
    assert!(
        err.contains("https://example.com") && err.contains("http://"),
        "{err}"
    );
    if !model_present() {
        return;
    }
    let server = ServeProcess::start(&[]);
    let dir = std::env::temp_dir().join(format!("sieve-bench-serve-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let json = dir.join("load.json");
    let out = sieve()
        .args([
            "bench",
            "serve",
            "--url",
            &server.base,
            "--url",
            &server.base,
        ])
        .args(["--clients", "1,2", "--requests", "1", "--max-tokens", "4"])
        .arg("--json")
        .arg(&json)
        .env_remove("SIEVE_API_KEY")
        .output()
        .expect("sieve bench serve runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(stdout.matches(" tok/s | TTFT p50 ").count(), 4, "{stdout}");
    assert!(
        stdout.contains("| 1 |") && stdout.contains("| 2 |"),
        "{stdout}"
    );
    let runs: Vec<Value> = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    let requests: Vec<u64> = runs
        .iter()
        .map(|r| r["requests"].as_u64().unwrap())
        .collect();
    assert_eq!(requests, [1, 1, 2, 2]);
    assert!(runs
        .iter()
        .all(|r| r["errors"] == 0 && r["generated_tokens"].as_u64() > Some(0)));
    let _ = std::fs::remove_dir_all(&dir);
}

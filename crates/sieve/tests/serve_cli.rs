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
        let mut child = sieve()
            .args(["serve", "--port", "0", "--max-batch", "2"])
            .args(extra)
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
    let out = sieve()
        .args(["serve", "--device", "cuda", "--port", "0"])
        .output()
        .expect("runs");
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("--device cuda") && err.contains("--device cpu"),
        "{err}"
    );
    let out = sieve()
        .args(["serve", "--max-batch", "0", "--port", "0"])
        .output()
        .expect("runs");
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("--max-batch"));
}

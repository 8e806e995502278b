//! Bad arguments and hostile inputs through the `sieve` binary: each must fail fast with a message
//! naming the problem and leave every input as it was (issue 13). Tests that need the default
//! model skip, saying so, when it is absent.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::{Duration, Instant};

fn sieve() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_sieve"));
    c.env("RUST_BACKTRACE", "0").env("RUST_LIB_BACKTRACE", "0");
    c
}

fn run(args: &[&str]) -> Output {
    sieve().args(args).output().expect("the sieve binary runs")
}

/// Runs and expects failure; returns stderr.
fn fails(args: &[&str]) -> String {
    let out = run(args);
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(!out.status.success(), "{args:?} succeeded: {stderr}");
    assert!(!stderr.contains("panicked"), "{args:?} panicked: {stderr}");
    stderr
}

fn default_model() -> Option<PathBuf> {
    let home = std::env::var_os("SIEVE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache/sieve")))?;
    let p = home.join("models/SmolLM2-135M-Instruct.Q4_1.gguf");
    if p.is_file() {
        Some(p)
    } else {
        eprintln!("skipped: {} is absent", p.display());
        None
    }
}

struct TempDir(PathBuf);
impl TempDir {
    fn new(tag: &str) -> Self {
        let d = std::env::temp_dir().join(format!("sieve-cli-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        TempDir(d)
    }
    fn path(&self, name: &str) -> String {
        self.0.join(name).display().to_string()
    }
}
impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn digest(path: &Path) -> (u64, u64) {
    let bytes = std::fs::read(path).unwrap();
    (bytes.len() as u64, sieve_formats::blob::fnv1a64(&bytes))
}

#[test]
fn formats_stats_sizes_are_checked() {
    let err = fails(&["formats", "stats", "--rows", "100000", "--cols", "100000"]);
    assert!(err.contains("limit of 268435456"), "{err}");
    let err = fails(&[
        "formats",
        "stats",
        "--rows",
        "9223372036854775808",
        "--cols",
        "2",
    ]);
    assert!(err.contains("overflows"), "{err}");
}

#[test]
fn thread_counts_are_capped_before_any_work() {
    for cmd in [
        &["generate", "--threads", "65535", "hi"][..],
        &["eval", "ppl", "--threads", "2000"][..],
        &["pack", "--threads", "0", "--out", "/nonexistent/x.sieve"][..],
    ] {
        let started = Instant::now();
        let err = fails(cmd);
        assert!(err.contains("1..=256"), "{err}");
        assert!(started.elapsed() < Duration::from_secs(20));
    }
}

#[test]
fn a_fifo_or_an_empty_directory_as_model_is_refused() {
    let d = TempDir::new("fifo");
    let fifo = d.path("model.gguf");
    if !Command::new("mkfifo")
        .arg(&fifo)
        .status()
        .is_ok_and(|s| s.success())
    {
        eprintln!("skipped: mkfifo unavailable");
        return;
    }
    let started = Instant::now();
    let err = fails(&["generate", "--model", &fifo, "hi"]);
    assert!(err.contains("FIFO"), "{err}");
    let err = fails(&["eval", "ppl", "--model", &fifo, "--data", &fifo]);
    assert!(err.contains("FIFO"), "{err}");
    assert!(started.elapsed() < Duration::from_secs(20));
    let empty = d.path("empty");
    std::fs::create_dir(&empty).unwrap();
    let err = fails(&["generate", "--model", &empty, "hi"]);
    assert!(
        err.contains("is not a model") && !err.contains("not found"),
        "{err}"
    );
}

#[test]
fn io_causes_are_printed_once() {
    let err = fails(&["generate", "--model", "/nonexistent/model.gguf", "hi"]);
    assert_eq!(err.matches("No such file or directory").count(), 1, "{err}");
}

#[test]
fn an_unreadable_default_model_is_not_called_missing() {
    let d = TempDir::new("home");
    // `models` is a file, so the default model path cannot be looked at (ENOTDIR).
    std::fs::write(d.0.join("models"), b"x").unwrap();
    let out = sieve()
        .env("SIEVE_HOME", &d.0)
        .args(["generate", "hi"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        err.contains("cannot be read") && !err.contains("missing"),
        "{err}"
    );
}

#[test]
fn pack_refuses_outputs_that_would_destroy_inputs_before_any_work() {
    let Some(model) = default_model() else { return };
    let model = model.display().to_string();
    let d = TempDir::new("pack");
    let calib = d.path("calib.txt");
    std::fs::write(&calib, "The quick brown fox. ".repeat(50)).unwrap();
    let link = d.path("link.sieve");
    std::os::unix::fs::symlink(&model, &link).unwrap();
    let before = (digest(Path::new(&model)), digest(Path::new(&calib)));
    let cases = [
        (model.clone(), "is the input"),
        (calib.clone(), "is the input"),
        (link.clone(), "is the input"),
        ("/dev/null".to_string(), "character device"),
        (d.path("missing/out.sieve"), "cannot be used"),
        (format!("{}/", d.path("dir")), "ends in '/'"),
        (d.0.display().to_string(), "directory"),
    ];
    for (out, want) in cases {
        let started = Instant::now();
        let err = fails(&["pack", "--model", &model, "--calib", &calib, "--out", &out]);
        assert!(err.contains(want), "--out {out}: {err}");
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "--out {out} was checked late"
        );
    }
    assert_eq!(
        before,
        (digest(Path::new(&model)), digest(Path::new(&calib)))
    );
    // A pack as the source: refused as a pack, and the temporary output is gone.
    let pack = d.path("in.sieve");
    std::fs::write(&pack, b"SIEVEPAK").unwrap();
    let err = fails(&[
        "pack",
        "--model",
        &pack,
        "--calib",
        &calib,
        "--out",
        &d.path("o.sieve"),
    ]);
    assert!(err.contains("packs cannot be re-packed"), "{err}");
    // Calibration windows longer than the context, and a format list that names auto.
    let out = d.path("o.sieve");
    let err = fails(&[
        "pack",
        "--model",
        &model,
        "--calib",
        &calib,
        "--out",
        &out,
        "--calib-len",
        "10000",
    ]);
    assert!(err.contains("context of 8192"), "{err}");
    let err = fails(&[
        "pack", "--model", &model, "--calib", &calib, "--out", &out, "--format", "x",
    ]);
    assert!(err.contains("known: auto, dense"), "{err}");
    let mut left: Vec<_> = std::fs::read_dir(&d.0)
        .unwrap()
        .flatten()
        .map(|e| e.file_name())
        .collect();
    left.sort();
    assert_eq!(
        left,
        ["calib.txt", "in.sieve", "link.sieve"],
        "temporary files were left behind"
    );
}

#[test]
fn pack_interrupted_by_sigterm_leaves_no_temporary_file() {
    let Some(model) = default_model() else { return };
    let d = TempDir::new("sigterm");
    let calib = d.path("calib.txt");
    std::fs::write(
        &calib,
        "The quick brown fox jumps over the lazy dog. ".repeat(400),
    )
    .unwrap();
    let out = d.path("out.sieve");
    let mut child = sieve()
        .args(["pack", "--model"])
        .arg(&model)
        .args([
            "--calib",
            &calib,
            "--out",
            &out,
            "--calib-samples",
            "2",
            "--calib-len",
            "64",
        ])
        .stderr(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .spawn()
        .unwrap();
    // The temporary file appears as soon as the output is checked, before the model loads.
    let started = Instant::now();
    let tmp = loop {
        let found = std::fs::read_dir(&d.0)
            .unwrap()
            .flatten()
            .find(|e| e.file_name().to_string_lossy().ends_with(".part"));
        if let Some(e) = found {
            break e.path();
        }
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "no temporary file appeared"
        );
        assert!(
            child.try_wait().unwrap().is_none(),
            "pack ended before it was interrupted"
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    let killed = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(killed.success());
    let status = child.wait().unwrap();
    assert!(!status.success());
    assert!(!tmp.exists(), "{} survived SIGTERM", tmp.display());
    assert!(!Path::new(&out).exists());
}

#[test]
fn eval_checks_the_window_before_reading_and_reads_only_what_max_tokens_needs() {
    let Some(model) = default_model() else { return };
    let model = model.display().to_string();
    let d = TempDir::new("eval");
    let data = d.path("big.txt");
    // 64 MiB of text: tokenized whole this took minutes and gigabytes; with --max-tokens 100 only
    // the first chunk is read.
    let line = "The tower is 324 metres tall, about the same height as an 81-storey building.\n";
    let mut text = String::with_capacity(64 << 20);
    while text.len() < 64 << 20 {
        text.push_str(line);
    }
    std::fs::write(&data, &text).unwrap();
    drop(text);
    let err = fails(&[
        "eval",
        "ppl",
        "--model",
        &model,
        "--data",
        &data,
        "--ctx",
        "1000000000",
    ]);
    assert!(
        err.contains("window length (ctx) 1000000000") && !err.contains("prompt"),
        "{err}"
    );
    let err = fails(&[
        "eval",
        "ppl",
        "--model",
        &model,
        "--data",
        &data,
        "--ctx",
        "4611686018427387904",
    ]);
    assert!(err.contains("context of 8192"), "{err}");
    let started = Instant::now();
    let out = run(&[
        "eval",
        "ppl",
        "--model",
        &model,
        "--data",
        &data,
        "--ctx",
        "50",
        "--max-tokens",
        "100",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let line: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(line["tokens"], 98, "two windows of 50 tokens score 49 each");
    assert!(
        started.elapsed() < Duration::from_secs(60),
        "{:?}",
        started.elapsed()
    );
}

/// The report files and the options of the long benchmarks are checked before the GPU is
/// looked for: on this CPU-only machine each error must name the bad argument, not the
/// missing GPU, and no file may appear.
#[test]
fn bench_and_sim_outputs_and_options_are_checked_before_any_work() {
    let dir = TempDir::new("bench-outputs");
    let missing = dir.path("no/such/dir/r.json");
    let e = fails(&["bench", "kernels", "--json", &missing]);
    assert!(
        e.contains("no/such/dir") && e.contains("cannot be used"),
        "{e}"
    );
    let e = fails(&["bench", "kernels", "--plot", &dir.path("r.png")]);
    assert!(e.contains("must name an .svg file"), "{e}");
    let same = dir.path("r.svg");
    let e = fails(&[
        "bench",
        "decode",
        "--synthetic",
        "llama2-7b",
        "--json",
        &same,
        "--plot",
        &same,
    ]);
    assert!(e.contains("both name"), "{e}");
    let e = fails(&["bench", "decode", "--synthetic", "llama-9000"]);
    assert!(e.contains("unknown synthetic model 'llama-9000'"), "{e}");
    // Tensor-parallel splits the model cannot take are refused before any GPU is looked for.
    let tp = |world: &str, dp: &str| {
        fails(&[
            "bench",
            "decode",
            "--synthetic",
            "llama2-7b",
            "--tensor-parallel",
            world,
            "--sp",
            "0",
            "--dp",
            dp,
        ])
    };
    let e = tp("3", "0");
    assert!(
        e.contains("--tensor-parallel 3") && e.contains("multiples"),
        "{e}"
    );
    let e = tp("0", "0");
    assert!(e.contains("at least one rank"), "{e}");
    let e = tp("2", "0.5");
    assert!(e.contains("--dp 0 only"), "{e}");
    let e = fails(&[
        "bench",
        "decode",
        "--synthetic",
        "llama2-7b",
        "--prompt",
        "40000",
    ]);
    assert!(
        e.contains("positions") && e.contains("context of 32768"),
        "{e}"
    );
    // Slide takes its N from a (2N-2):2N pattern: refused before any GPU work without one.
    let e = fails(&[
        "bench",
        "decode",
        "--synthetic",
        "llama2-7b",
        "--format",
        "slide",
    ]);
    assert!(e.contains("slide needs a (2N-2):2N pattern"), "{e}");
    let e = fails(&[
        "bench",
        "cpu",
        "--model",
        &dir.path("absent.gguf"),
        "--json",
        &dir.0.display().to_string(),
    ]);
    assert!(
        e.contains("does not exist") || e.contains("directory"),
        "{e}"
    );
    let e = fails(&[
        "sim", "celty", "--shape", "64x64", "--sp", "0.5", "--dp", "0.5", "--json", &missing,
    ]);
    assert!(e.contains("cannot be used"), "{e}");
    if let Some(model) = default_model() {
        let m = model.display().to_string();
        let e = fails(&["bench", "decode", "--model", &m, "--prompt", "9000"]);
        assert!(
            e.contains("positions") && e.contains("context of 8192"),
            "{e}"
        );
    }
    let left: Vec<_> = std::fs::read_dir(&dir.0)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert!(left.is_empty(), "files left behind: {left:?}");
}

/// A user's mistake prints one `error:` line with its causes, never a stack trace, even when
/// `RUST_BACKTRACE` is set in the environment (issue 24); `SIEVE_DEBUG=1` asks for the trace.
#[test]
fn user_errors_print_a_message_not_a_backtrace() {
    let dir = std::env::temp_dir().join(format!("sieve-cli-bt-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let missing = dir.join("no-such-model.gguf");
    let missing = missing.to_str().expect("utf-8 temp path");
    for backtrace in ["0", "1", "full"] {
        let out = Command::new(env!("CARGO_BIN_EXE_sieve"))
            .env("RUST_BACKTRACE", backtrace)
            .env("RUST_LIB_BACKTRACE", backtrace)
            .env_remove("SIEVE_DEBUG")
            .args(["generate", "--device", "cpu", "--model", missing, "hi"])
            .output()
            .expect("the sieve binary runs");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            !out.status.success(),
            "RUST_BACKTRACE={backtrace}: {stderr}"
        );
        assert!(
            stderr.starts_with("error: ") && stderr.contains("no-such-model.gguf"),
            "RUST_BACKTRACE={backtrace}: {stderr}"
        );
        assert!(
            !stderr.contains("backtrace") && !stderr.contains("Backtrace"),
            "RUST_BACKTRACE={backtrace} printed a trace: {stderr}"
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// `--cpu-kernel` is checked before any work: an unknown key or value names the choices, a
/// switch without `=` shows the form; a good switch runs the command (issue 25: kernel switches
/// passed from the top).
#[test]
fn cpu_kernel_switches_are_checked_before_any_work() {
    // A small command that builds products, behind the switches given.
    fn with<'a>(switches: &[&'a str]) -> Vec<&'a str> {
        let mut args = switches.to_vec();
        args.extend(["formats", "stats", "--rows", "16", "--cols", "16"]);
        args
    }
    let e = fails(&with(&["--cpu-kernel", "simd=sse2"]));
    assert!(
        e.contains("simd is one of best, avx512, avx2, portable"),
        "{e}"
    );
    // The flag is global: after the subcommand too.
    let mut after = with(&[]);
    after.extend(["--cpu-kernel", "tcbc=rows"]);
    let e = fails(&after);
    assert!(
        e.contains("the keys are simd, tiled-cbc, balanced-cbc, ie-bme"),
        "{e}"
    );
    let e = fails(&with(&["--cpu-kernel", "portable"]));
    assert!(e.contains("expected KEY=VALUE"), "{e}");
    let out = run(&with(&[
        "--cpu-kernel",
        "simd=portable",
        "--cpu-kernel",
        "tiled-cbc=columns",
    ]));
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(!out.stdout.is_empty());
}

/// `--kv-cache int8` on the CPU: perplexity within a few percent of the f16 cache's on the same
/// tokens, the JSON line saying which cache ran; an unknown precision is refused by name.
#[test]
fn eval_runs_the_int8_kv_cache_close_to_the_f16_one() {
    let Some(model) = default_model() else { return };
    let model = model.display().to_string();
    let d = TempDir::new("kv8");
    let data = d.path("text.txt");
    let line = "The tower is 324 metres tall, about the same height as an 81-storey building. \
                It was the tallest structure in the world for 41 years.\n";
    std::fs::write(&data, line.repeat(20)).unwrap();
    let ppl = |kv: &str| {
        let out = run(&[
            "eval",
            "ppl",
            "--model",
            &model,
            "--data",
            &data,
            "--ctx",
            "128",
            "--max-tokens",
            "256",
            "--device",
            "cpu",
            "--kv-cache",
            kv,
        ]);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let line: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(line["kv_cache"], kv);
        line["ppl"].as_f64().unwrap()
    };
    let (f16, int8) = (ppl("f16"), ppl("int8"));
    assert!(f16.is_finite() && int8.is_finite(), "{f16} {int8}");
    assert!((int8 / f16 - 1.0).abs() < 0.05, "f16 {f16} vs int8 {int8}");
    let err = fails(&["eval", "ppl", "--kv-cache", "int4"]);
    assert!(err.contains("int4") && err.contains("int8"), "{err}");
}

/// `--tensor-parallel 3` on the CPU (SmolLM2: 9 query heads, 3 KV heads, one KV head per rank)
/// writes the greedy text of the unsplit model, and says how it split; a split that would cut a
/// head group, or the persistent step with a split, is refused before the model loads.
#[test]
fn generate_split_over_three_ranks_writes_the_same_text() {
    let Some(model) = default_model() else { return };
    let model = model.display().to_string();
    let text = |ranks: &str| {
        let out = run(&[
            "generate",
            "--model",
            &model,
            "--device",
            "cpu",
            "--f16-weights",
            "--max-tokens",
            "16",
            "--tensor-parallel",
            ranks,
            "The capital of France is",
        ]);
        let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
        assert!(out.status.success(), "{stderr}");
        (String::from_utf8_lossy(&out.stdout).into_owned(), stderr)
    };
    let (whole, _) = text("1");
    let (split, stderr) = text("3");
    assert!(whole.len() > 20, "{whole}");
    assert_eq!(split, whole);
    assert!(
        stderr.contains("3 ranks") && stderr.contains("3 query heads and 1 KV heads each"),
        "{stderr}"
    );
    let err = fails(&[
        "generate",
        "--model",
        &model,
        "--device",
        "cpu",
        "--tensor-parallel",
        "2",
        "hi",
    ]);
    assert!(
        err.contains("--tensor-parallel 2") && err.contains("multiples"),
        "{err}"
    );
    // The split runs the graph step on GPUs; asking for the persistent one is refused first.
    let err = fails(&[
        "generate",
        "--tensor-parallel",
        "3",
        "--step",
        "persistent",
        "hi",
    ]);
    assert!(err.contains("no all-reduce"), "{err}");
}

/// A GPU-only prompt setting with `--device cpu` is refused by name before anything loads,
/// not ignored.
#[test]
fn gpu_prompt_settings_on_the_cpu_are_refused() {
    for p in ["f16-resident", "int8", "fp8"] {
        let err = fails(&["generate", "--device", "cpu", "--prompt-precision", p, "hi"]);
        assert!(
            err.contains(&format!("--prompt-precision {p}")) && err.contains("--device cpu"),
            "{err}"
        );
    }
}

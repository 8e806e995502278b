//! `sieve-fuzz seeds [DIR]` writes the seed corpus (default: this crate's `corpus/`).
//! `sieve-fuzz run [--targets gguf,pack,...] [--seconds S] [--cpu-seconds S] [--seed N] [--corpus DIR]
//! [--crashes DIR] [--hang-seconds H]` fuzzes each target for S seconds and prints one JSON
//! line per target (see `runner::Stats`). Exit status 1 when any target panicked.

use sieve_fuzz::{alloc, runner, seeds, targets};

#[global_allocator]
static GLOBAL: alloc::CountingAlloc = alloc::CountingAlloc;

fn arg(args: &[String], flag: &str) -> Option<String> {
    args.iter()
        .position(|a| a == flag)
        .and_then(|i| args.get(i + 1).cloned())
}

fn default_model() -> Option<std::path::PathBuf> {
    let home = std::env::var_os("SIEVE_HOME")
        .map(std::path::PathBuf::from)
        .or_else(|| {
            std::env::var_os("HOME").map(|h| std::path::PathBuf::from(h).join(".cache/sieve"))
        })?;
    Some(home.join("models/SmolLM2-135M-Instruct.Q4_1.gguf"))
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args.first().map(String::as_str) {
        Some("seeds") => {
            let dir = args
                .get(1)
                .map(std::path::PathBuf::from)
                .unwrap_or_else(sieve_fuzz::corpus_dir);
            let real = default_model();
            for (target, name, bytes) in seeds::all(real.as_deref().filter(|p| p.is_file())) {
                let d = dir.join(target);
                if let Err(e) = std::fs::create_dir_all(&d)
                    .and_then(|_| std::fs::write(d.join(format!("{name}.bin")), &bytes))
                {
                    eprintln!("writing {}: {e}", d.display());
                    std::process::exit(2);
                }
                println!("{target}/{name}.bin {} bytes", bytes.len());
            }
        }
        Some("run") => {
            let seconds: f64 = arg(&args, "--seconds")
                .and_then(|s| s.parse().ok())
                .unwrap_or(60.0);
            let cpu_seconds: Option<f64> = arg(&args, "--cpu-seconds").and_then(|s| s.parse().ok());
            let seed: u64 = arg(&args, "--seed")
                .and_then(|s| s.parse().ok())
                .unwrap_or(1);
            let hang: u64 = arg(&args, "--hang-seconds")
                .and_then(|s| s.parse().ok())
                .unwrap_or(10);
            let corpus = arg(&args, "--corpus")
                .map(std::path::PathBuf::from)
                .unwrap_or_else(sieve_fuzz::corpus_dir);
            let names: Vec<String> = arg(&args, "--targets")
                .map(|t| t.split(',').map(str::to_owned).collect())
                .unwrap_or_else(|| {
                    targets::TARGETS
                        .iter()
                        .map(|t| t.name.to_string())
                        .collect()
                });
            alloc::set_cap(1 << 30);
            let mut failed = false;
            for name in names {
                let Some(target) = targets::by_name(&name) else {
                    eprintln!("unknown target {name}");
                    std::process::exit(2);
                };
                let mut inputs: Vec<Vec<u8>> = sieve_fuzz::load_corpus(&corpus, &name)
                    .into_iter()
                    .map(|(_, b)| b)
                    .collect();
                if name == targets::GGUF_REAL.name {
                    let real = default_model();
                    match real.as_deref().and_then(targets::real_header_input) {
                        Some(input) => inputs.push(input),
                        None => {
                            eprintln!("gguf-real needs the default model ({real:?})");
                            std::process::exit(2);
                        }
                    }
                }
                let opts = runner::Options {
                    seconds,
                    cpu_seconds,
                    max_inputs: u64::MAX,
                    seed,
                    hang_seconds: hang,
                    crash_dir: arg(&args, "--crashes").map(std::path::PathBuf::from),
                };
                let stats = runner::fuzz(target, &inputs, &opts);
                failed |= !stats.panics.is_empty();
                let mut line = stats.json();
                line["seeds"] = inputs.len().into();
                line["refused_allocations_total"] = alloc::refused().into();
                println!("{line}");
            }
            targets::cleanup();
            std::process::exit(i32::from(failed));
        }
        _ => {
            eprintln!("usage: sieve-fuzz seeds [DIR] | sieve-fuzz run [--targets a,b] [--seconds S] [--cpu-seconds S] [--seed N] [--corpus DIR] [--crashes DIR] [--hang-seconds H]");
            std::process::exit(2);
        }
    }
}

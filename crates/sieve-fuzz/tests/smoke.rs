//! The CI fuzz run: every target over the committed seed corpus and its mutations, time-boxed
//! (`SIEVE_FUZZ_SECONDS` per target, default 6 s), with zero panics required, every seed
//! accepted (so mutations start deep), and memory held to the stated bound. A long run is
//! `cargo run --release -p sieve-fuzz -- run --seconds 1800` (docs/RELIABILITY.md).

use sieve_fuzz::{alloc, runner, targets};

#[global_allocator]
static GLOBAL: alloc::CountingAlloc = alloc::CountingAlloc;

/// Stated memory bound: peak heap per input at most 16 MiB + 64 x the input size.
const HEAP_MULTIPLE: f64 = 64.0;

#[test]
fn every_target_survives_a_short_fuzz_run() {
    let seconds: f64 = std::env::var("SIEVE_FUZZ_SECONDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(6.0);
    alloc::set_cap(1 << 30);
    let mut report = Vec::new();
    for target in &targets::TARGETS {
        let corpus = sieve_fuzz::load_corpus(&sieve_fuzz::corpus_dir(), target.name);
        assert!(!corpus.is_empty(), "no seed corpus for {}", target.name);
        for (name, bytes) in &corpus {
            let r = (target.run)(bytes);
            assert!(r.is_ok(), "seed {}/{name} is refused: {r:?}", target.name);
        }
        let inputs: Vec<Vec<u8>> = corpus.into_iter().map(|(_, b)| b).collect();
        let opts = runner::Options {
            cpu_seconds: None,
            seconds,
            max_inputs: u64::MAX,
            seed: 0x5eed,
            hang_seconds: 60,
            crash_dir: None,
        };
        let stats = runner::fuzz(target, &inputs, &opts);
        eprintln!("{}", stats.json());
        assert!(
            stats.inputs > inputs.len() as u64,
            "{}: no mutated inputs ran",
            target.name
        );
        assert!(
            stats.refused > 0,
            "{}: mutations never refused",
            target.name
        );
        report.push(stats);
    }
    // Header mutations of the default model itself, when it is present (CI fetches it).
    let real = std::env::var_os("SIEVE_HOME")
        .map(std::path::PathBuf::from)
        .or_else(|| {
            std::env::var_os("HOME").map(|h| std::path::PathBuf::from(h).join(".cache/sieve"))
        })
        .map(|h| h.join("models/SmolLM2-135M-Instruct.Q4_1.gguf"));
    match real.as_deref().and_then(targets::real_header_input) {
        Some(input) => {
            let target = &targets::GGUF_REAL;
            assert!(
                (target.run)(&input).is_ok(),
                "the default model's header is refused"
            );
            let opts = runner::Options {
                cpu_seconds: None,
                seconds: seconds / 2.0,
                max_inputs: u64::MAX,
                seed: 0x5eed,
                hang_seconds: 60,
                crash_dir: None,
            };
            let stats = runner::fuzz(target, &[input], &opts);
            eprintln!("{}", stats.json());
            assert!(
                stats.panics.is_empty(),
                "gguf-real: panics {:?}",
                stats.panics
            );
        }
        None => eprintln!("skipped gguf-real: the default model is absent"),
    }
    targets::cleanup();
    for s in &report {
        assert!(s.panics.is_empty(), "{}: panics {:?}", s.target, s.panics);
        assert!(
            s.worst_ratio <= HEAP_MULTIPLE,
            "{}: peak heap {} bytes on a {}-byte input exceeds 16 MiB + {HEAP_MULTIPLE} x",
            s.target,
            s.peak_bytes,
            s.peak_input_len
        );
    }
}

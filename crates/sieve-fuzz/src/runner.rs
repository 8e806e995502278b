//! The fuzz loop. Each iteration takes a corpus input, stacks 1-4 mutations (half of them aimed
//! at located fields), re-seals checksums (4 times in 5, so checksum refusals stay covered),
//! and runs the target under `catch_unwind`, timing it and measuring its peak heap. Inputs the
//! target accepts whole join the pool (up to 256), so later mutations start from valid variants.
//!
//! Findings: a panic (recorded with its message), a hang (an input running longer than
//! `hang_seconds`: a watchdog saves it and aborts), an abort (the process dies; with a
//! `crash_dir` each input is saved to `<target>.current` before it runs, so the file left
//! behind is the one that did it), and memory: the largest peak heap above the input's own
//! size, reported as bytes and as a multiple of the input size.

use crate::mutate::Mutator;
use crate::targets::Target;
use std::panic::AssertUnwindSafe;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

#[derive(Clone, Debug)]
pub struct Options {
    pub seconds: f64,
    pub max_inputs: u64,
    pub seed: u64,
    pub hang_seconds: u64,
    /// Where findings (and the input in flight) are saved; `None` keeps them in memory only.
    pub crash_dir: Option<PathBuf>,
}

#[derive(Clone, Debug, Default)]
pub struct Stats {
    pub target: String,
    pub inputs: u64,
    /// Inputs the target accepted whole / refused with an error.
    pub accepted: u64,
    pub refused: u64,
    pub panics: Vec<String>,
    pub seconds: f64,
    pub slowest_ms: f64,
    /// Largest peak heap of one input above the heap before it, and that input's size.
    pub peak_bytes: usize,
    pub peak_input_len: usize,
    /// Largest (peak heap - 16 MiB) / input size over inputs, i.e. the multiple of the file size
    /// beyond a fixed 16 MiB allowance.
    pub worst_ratio: f64,
    /// Largest peak heap / input size over inputs of at least 4 KiB (smaller ones are dominated
    /// by fixed costs), the plain multiple of the file size.
    pub worst_plain_ratio: f64,
}

impl Stats {
    pub fn json(&self) -> serde_json::Value {
        serde_json::json!({
            "target": self.target,
            "inputs": self.inputs,
            "accepted": self.accepted,
            "refused": self.refused,
            "panics": self.panics.len(),
            "panic_messages": self.panics.iter().take(5).collect::<Vec<_>>(),
            "seconds": (self.seconds * 10.0).round() / 10.0,
            "inputs_per_second": (self.inputs as f64 / self.seconds.max(1e-9)).round(),
            "slowest_ms": (self.slowest_ms * 10.0).round() / 10.0,
            "peak_heap_bytes": self.peak_bytes,
            "peak_input_len": self.peak_input_len,
            "worst_heap_multiple_beyond_16mib": (self.worst_ratio * 100.0).round() / 100.0,
            "worst_heap_multiple_4kib_plus": (self.worst_plain_ratio * 100.0).round() / 100.0,
        })
    }
}

/// Fixed allowance per input before the heap is compared with the input size: tokenizer
/// regexes, rayon, the tokenizer's tables for even an empty vocabulary.
pub const HEAP_ALLOWANCE: usize = 16 << 20;

static PANIC_MESSAGE: Mutex<String> = Mutex::new(String::new());

fn quiet_panics() {
    std::panic::set_hook(Box::new(|info| {
        let msg = match info.payload().downcast_ref::<&str>() {
            Some(s) => s.to_string(),
            None => info
                .payload()
                .downcast_ref::<String>()
                .cloned()
                .unwrap_or_default(),
        };
        let at = info
            .location()
            .map(|l| format!(" at {}:{}", l.file(), l.line()))
            .unwrap_or_default();
        if let Ok(mut m) = PANIC_MESSAGE.lock() {
            *m = format!("{msg}{at}");
        }
    }));
}

fn save(dir: &Option<PathBuf>, name: &str, bytes: &[u8]) {
    if let Some(d) = dir {
        let _ = std::fs::create_dir_all(d);
        let _ = std::fs::write(d.join(name), bytes);
    }
}

/// Runs `target` over `corpus` until the time or input budget is spent.
pub fn fuzz(target: &Target, corpus: &[Vec<u8>], opts: &Options) -> Stats {
    quiet_panics();
    let mut stats = Stats {
        target: target.name.to_string(),
        ..Stats::default()
    };
    let mut pool: Vec<Vec<u8>> = corpus.to_vec();
    if pool.is_empty() {
        pool.push(Vec::new());
    }
    let seeds = pool.len();
    let mut m = Mutator::new(opts.seed ^ fnv(target.name.as_bytes()));

    // Watchdog: an input running past `hang_seconds` is saved and the process aborted.
    let started_ms = Arc::new(AtomicU64::new(0));
    let running = Arc::new(AtomicBool::new(true));
    let in_flight: Arc<Mutex<Vec<u8>>> = Arc::new(Mutex::new(Vec::new()));
    let clock = Instant::now();
    let watchdog = {
        let (started_ms, running, in_flight) =
            (started_ms.clone(), running.clone(), in_flight.clone());
        let (dir, name, hang) = (opts.crash_dir.clone(), target.name, opts.hang_seconds);
        std::thread::spawn(move || {
            while running.load(Ordering::Relaxed) {
                std::thread::sleep(Duration::from_millis(200));
                let s = started_ms.load(Ordering::Relaxed);
                let now = clock.elapsed().as_millis() as u64;
                if s != 0 && now.saturating_sub(s) > hang * 1000 {
                    let input = in_flight.lock().map(|v| v.clone()).unwrap_or_default();
                    save(&dir, &format!("hang-{name}.bin"), &input);
                    eprintln!(
                        "sieve-fuzz: {name}: an input ({} bytes) ran over {hang} s; aborting",
                        input.len()
                    );
                    std::process::abort();
                }
            }
        })
    };

    let begin = Instant::now();
    let mut i: u64 = 0;
    while i < opts.max_inputs && begin.elapsed().as_secs_f64() < opts.seconds {
        // The seeds run unmutated first.
        let mut input = if (i as usize) < seeds {
            pool[i as usize].clone()
        } else {
            let base = pool[m.below(pool.len())].clone();
            let other = pool[m.below(pool.len())].clone();
            let mut data = base;
            if let Some(special) = target.special.filter(|_| m.below(3) == 0) {
                special(&mut m, &mut data);
            }
            m.stack(&mut data, &other, &target.fields);
            data
        };
        if i as usize >= seeds {
            if let Some(reseal) = target.reseal.filter(|_| m.below(5) != 0) {
                reseal(&mut input);
            }
        }
        if let Ok(mut f) = in_flight.lock() {
            f.clone_from(&input);
        }
        save(&opts.crash_dir, &format!("{}.current", target.name), &input);
        let base_heap = crate::alloc::current();
        crate::alloc::reset_peak();
        let t = Instant::now();
        started_ms.store(clock.elapsed().as_millis().max(1) as u64, Ordering::Relaxed);
        let result = std::panic::catch_unwind(AssertUnwindSafe(|| (target.run)(&input)));
        started_ms.store(0, Ordering::Relaxed);
        let ms = t.elapsed().as_secs_f64() * 1e3;
        let extra = crate::alloc::peak().saturating_sub(base_heap);
        stats.inputs += 1;
        stats.slowest_ms = stats.slowest_ms.max(ms);
        if extra > stats.peak_bytes {
            stats.peak_bytes = extra;
            stats.peak_input_len = input.len();
        }
        let ratio = extra.saturating_sub(HEAP_ALLOWANCE) as f64 / input.len().max(1) as f64;
        stats.worst_ratio = stats.worst_ratio.max(ratio);
        if input.len() >= 4096 {
            stats.worst_plain_ratio = stats
                .worst_plain_ratio
                .max(extra as f64 / input.len() as f64);
        }
        match result {
            Ok(Ok(())) => {
                stats.accepted += 1;
                if i as usize >= seeds && pool.len() < 256 {
                    pool.push(input);
                }
            }
            Ok(Err(_)) => stats.refused += 1,
            Err(_) => {
                let msg = PANIC_MESSAGE.lock().map(|m| m.clone()).unwrap_or_default();
                save(
                    &opts.crash_dir,
                    &format!("panic-{}-{:016x}.bin", target.name, fnv(&input)),
                    &input,
                );
                stats.panics.push(msg);
            }
        }
        i += 1;
    }
    stats.seconds = begin.elapsed().as_secs_f64();
    running.store(false, Ordering::Relaxed);
    let _ = watchdog.join();
    if let Some(d) = &opts.crash_dir {
        let _ = std::fs::remove_file(d.join(format!("{}.current", target.name)));
    }
    let _ = std::panic::take_hook();
    stats
}

fn fnv(b: &[u8]) -> u64 {
    sieve_formats::blob::fnv1a64(b)
}

//! The fuzz loop. Each iteration takes a corpus input, stacks 1-4 mutations (half of them aimed
//! at located fields), re-seals checksums (4 times in 5, so checksum refusals stay covered),
//! and runs the target under `catch_unwind`, timing it and measuring its peak heap. Inputs the
//! target accepts whole join the pool (up to 256), so later mutations start from valid variants.
//!
//! Findings: a panic (recorded with its message), a hang (an input that has used more than
//! `hang_seconds` of the fuzzing thread's CPU time, or [`WALL_HANG_FACTOR`] times that in wall
//! time, e.g. blocked in a read: a watchdog saves it and aborts), an abort (the process dies; with a
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

/// An input blocked for this many times `hang_seconds` of wall time is a hang even when it used
/// no CPU. The main test is CPU time: at the lowest priority on a loaded machine a fuzzer gets
/// a few percent of a core, and a 0.1 s input then takes over 10 s of wall time (a run of
/// 2026-12-02 lost its gguf-real process to that false hang).
pub const WALL_HANG_FACTOR: u64 = 30;

/// CPU time (user + system) of one thread, read from `/proc` on Linux.
struct ThreadClock {
    stat: PathBuf,
    ticks_per_second: f64,
}

impl ThreadClock {
    /// The calling thread's clock; `None` where `/proc/thread-self` is missing.
    fn of_current_thread() -> Option<Self> {
        let task = std::fs::read_link("/proc/thread-self").ok()?;
        let clock = Self {
            stat: PathBuf::from("/proc")
                .join(task.strip_prefix("/proc").unwrap_or(&task))
                .join("stat"),
            // USER_HZ: 100 on every Linux architecture this runs on (sysconf is not in std).
            ticks_per_second: 100.0,
        };
        clock.seconds().map(|_| clock)
    }

    fn seconds(&self) -> Option<f64> {
        let text = std::fs::read_to_string(&self.stat).ok()?;
        // Fields after the command name (which may hold spaces) in parentheses: state is the
        // first, utime and stime are the 12th and 13th.
        let rest = &text[text.rfind(')')? + 1..];
        let mut fields = rest.split_whitespace().skip(11);
        let user: f64 = fields.next()?.parse().ok()?;
        let system: f64 = fields.next()?.parse().ok()?;
        Some((user + system) / self.ticks_per_second)
    }
}

#[derive(Clone, Debug)]
pub struct Options {
    /// Wall-time budget.
    pub seconds: f64,
    /// CPU-time budget of the fuzzing thread (the run stops at whichever budget ends first):
    /// on a shared machine a run of "30 CPU minutes" cannot be sized in wall time.
    pub cpu_seconds: Option<f64>,
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
    /// CPU time (user + system) of the fuzzing thread, where `/proc/thread-self` exists.
    pub cpu_seconds: Option<f64>,
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
            "thread_cpu_seconds": self.cpu_seconds.map(|s| (s * 10.0).round() / 10.0),
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

    // Watchdog: an input that has used `hang_seconds` of this thread's CPU time (or
    // WALL_HANG_FACTOR times that in wall time) is saved and the process aborted. The loop
    // only stores the start time of each input; the watchdog notes the thread's CPU clock the
    // first time it sees an input running and measures from there (a coarse start, never late
    // by more than one 200 ms tick).
    let started_ms = Arc::new(AtomicU64::new(0));
    let running = Arc::new(AtomicBool::new(true));
    let in_flight: Arc<Mutex<Vec<u8>>> = Arc::new(Mutex::new(Vec::new()));
    let clock = Instant::now();
    let cpu_clock = ThreadClock::of_current_thread();
    // A second clock of this thread for the CPU budget (the first moves into the watchdog).
    let own_clock = ThreadClock::of_current_thread();
    let cpu_at_start = own_clock.as_ref().and_then(ThreadClock::seconds);
    let cpu_used = || match (&own_clock, cpu_at_start) {
        (Some(c), Some(start)) => c.seconds().map(|now| now - start),
        _ => None,
    };
    let mut cpu_budget_left = true;
    let watchdog = {
        let (started_ms, running, in_flight) =
            (started_ms.clone(), running.clone(), in_flight.clone());
        let (dir, name, hang) = (opts.crash_dir.clone(), target.name, opts.hang_seconds);
        std::thread::spawn(move || {
            // (start of the input in flight, the fuzzing thread's CPU seconds when first seen)
            let mut seen: Option<(u64, f64)> = None;
            while running.load(Ordering::Relaxed) {
                std::thread::sleep(Duration::from_millis(200));
                let s = started_ms.load(Ordering::Relaxed);
                if s == 0 {
                    seen = None;
                    continue;
                }
                let wall_ms = (clock.elapsed().as_millis() as u64).saturating_sub(s);
                let cpu_now = cpu_clock.as_ref().and_then(ThreadClock::seconds);
                let cpu_used = match (seen, cpu_now) {
                    (Some((first, cpu0)), Some(now)) if first == s => now - cpu0,
                    (_, now) => {
                        seen = now.map(|now| (s, now));
                        0.0
                    }
                };
                let over_cpu = match cpu_now {
                    Some(_) => cpu_used > hang as f64,
                    // No CPU clock here: wall time is all there is.
                    None => wall_ms > hang * 1000,
                };
                if over_cpu || wall_ms > WALL_HANG_FACTOR * hang * 1000 {
                    let input = in_flight.lock().map(|v| v.clone()).unwrap_or_default();
                    save(&dir, &format!("hang-{name}.bin"), &input);
                    eprintln!(
                        "sieve-fuzz: {name}: an input ({} bytes) ran over {hang} s of CPU time \
                         ({:.1} s) or {} s of wall time ({:.1} s); aborting",
                        input.len(),
                        cpu_used,
                        WALL_HANG_FACTOR * hang,
                        wall_ms as f64 / 1e3
                    );
                    std::process::abort();
                }
            }
        })
    };

    let begin = Instant::now();
    let mut i: u64 = 0;
    while i < opts.max_inputs && begin.elapsed().as_secs_f64() < opts.seconds && cpu_budget_left {
        // Reading /proc costs a system call and a parse: every 64 inputs is often enough.
        if let (Some(limit), 0) = (opts.cpu_seconds, i % 64) {
            cpu_budget_left = cpu_used().is_none_or(|used| used < limit);
        }
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
    stats.cpu_seconds = cpu_used();
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

#[cfg(test)]
mod tests {
    use super::ThreadClock;

    #[test]
    fn the_thread_clock_counts_this_threads_cpu_time_only() {
        let Some(clock) = ThreadClock::of_current_thread() else {
            eprintln!("skipped: no /proc/thread-self here (the watchdog falls back to wall time)");
            return;
        };
        let before = clock.seconds().unwrap();
        // Sleeping uses no CPU time; spinning does.
        std::thread::sleep(std::time::Duration::from_millis(300));
        let slept = clock.seconds().unwrap() - before;
        let t = std::time::Instant::now();
        let mut x = 0u64;
        while t.elapsed().as_millis() < 400 {
            x = x.wrapping_mul(6364136223846793005).wrapping_add(1);
        }
        std::hint::black_box(x);
        let spun = clock.seconds().unwrap() - before - slept;
        assert!(slept < 0.1, "sleeping counted {slept} s of CPU");
        // At least part of the 0.4 s spin ran on a CPU even on a loaded machine.
        assert!(spun > 0.0, "spinning counted {spun} s of CPU");
    }
}

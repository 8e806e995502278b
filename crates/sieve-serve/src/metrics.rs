//! Server counters, gauges and histograms, rendered in the Prometheus text format.

use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

/// A cumulative histogram with fixed upper bounds.
#[derive(Debug)]
pub struct Histogram {
    bounds: &'static [f64],
    state: Mutex<HistogramState>,
}

#[derive(Debug, Default)]
struct HistogramState {
    /// One count per bound (not cumulative), then the +Inf overflow.
    counts: Vec<u64>,
    sum: f64,
    count: u64,
}

impl Histogram {
    pub fn new(bounds: &'static [f64]) -> Self {
        Self {
            bounds,
            state: Mutex::new(HistogramState {
                counts: vec![0; bounds.len() + 1],
                ..HistogramState::default()
            }),
        }
    }

    pub fn observe(&self, value: f64) {
        let slot = self
            .bounds
            .iter()
            .position(|&b| value <= b)
            .unwrap_or(self.bounds.len());
        let mut s = self.state.lock().unwrap_or_else(|p| p.into_inner());
        s.counts[slot] += 1;
        s.sum += value;
        s.count += 1;
    }

    /// Observations so far.
    pub fn count(&self) -> u64 {
        self.state.lock().unwrap_or_else(|p| p.into_inner()).count
    }

    fn render(&self, out: &mut String, name: &str, help: &str) {
        let s = self.state.lock().unwrap_or_else(|p| p.into_inner());
        let _ = writeln!(out, "# HELP {name} {help}");
        let _ = writeln!(out, "# TYPE {name} histogram");
        let mut cumulative = 0;
        for (bound, count) in self.bounds.iter().zip(&s.counts) {
            cumulative += count;
            let _ = writeln!(out, "{name}_bucket{{le=\"{bound}\"}} {cumulative}");
        }
        let _ = writeln!(out, "{name}_bucket{{le=\"+Inf\"}} {}", s.count);
        let _ = writeln!(out, "{name}_sum {}", s.sum);
        let _ = writeln!(out, "{name}_count {}", s.count);
    }
}

const SECONDS: &[f64] = &[
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
];
const BATCH: &[f64] = &[1.0, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0, 16.0, 24.0, 32.0, 64.0];

/// Everything `/metrics` shows. Gauges the scheduler owns (queue, slots) are read live.
#[derive(Debug)]
pub struct Metrics {
    /// `(endpoint, status) -> count`.
    requests: Mutex<BTreeMap<(String, u16), u64>>,
    pub prompt_tokens: AtomicU64,
    pub completion_tokens: AtomicU64,
    /// Generations stopped because their client went away.
    pub cancelled: AtomicU64,
    /// Requests refused with 503: queue full.
    pub rejected_queue_full: AtomicU64,
    /// Requests refused with 503: shutting down.
    pub rejected_shutdown: AtomicU64,
    pub running: AtomicU64,
    pub slots_in_use: AtomicU64,
    pub slots_total: AtomicU64,
    /// Bytes of the KV cache pool.
    pub kv_cache_bytes: AtomicU64,
    /// Decode steps whose tokens the engine chose itself (on its device).
    pub engine_chosen_steps: AtomicU64,
    /// Prompt chunks prefilled (one per prompt unless it is longer than `--prefill-chunk`).
    pub prefill_chunks: AtomicU64,
    /// Admitted requests whose prompt is still being prefilled.
    pub prefilling: AtomicU64,
    pub queue_depth: AtomicU64,
    pub decode_steps: AtomicU64,
    /// Nanoseconds the engine spent in prefill calls (every chunk).
    pub prefill_nanos: AtomicU64,
    /// Nanoseconds the engine spent in decode steps (the step and its tokens or logits).
    pub decode_nanos: AtomicU64,
    /// Nanoseconds of scheduler iterations that had work (prefill or decode): with the two
    /// above, what the scheduler's own host work costs (sampling on the host, text, events).
    pub busy_nanos: AtomicU64,
    /// Largest decode batch seen.
    pub max_batch: AtomicU64,
    /// 1 while the scheduler thread runs, 0 before it started and after it stopped.
    pub scheduler_up: AtomicU64,
    /// TCP connections being served.
    pub connections_open: AtomicU64,
    /// Connections answered 503 and closed because `max_connections` were open.
    pub connections_rejected: AtomicU64,
    /// Connections ended by the header/idle or body timeout.
    pub timeouts: AtomicU64,
    pub ttft: Histogram,
    pub tpot: Histogram,
    pub latency: Histogram,
    pub batch_size: Histogram,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    pub fn new() -> Self {
        Self {
            requests: Mutex::new(BTreeMap::new()),
            prompt_tokens: AtomicU64::new(0),
            completion_tokens: AtomicU64::new(0),
            cancelled: AtomicU64::new(0),
            rejected_queue_full: AtomicU64::new(0),
            rejected_shutdown: AtomicU64::new(0),
            running: AtomicU64::new(0),
            slots_in_use: AtomicU64::new(0),
            slots_total: AtomicU64::new(0),
            kv_cache_bytes: AtomicU64::new(0),
            engine_chosen_steps: AtomicU64::new(0),
            prefill_chunks: AtomicU64::new(0),
            prefilling: AtomicU64::new(0),
            queue_depth: AtomicU64::new(0),
            decode_steps: AtomicU64::new(0),
            prefill_nanos: AtomicU64::new(0),
            decode_nanos: AtomicU64::new(0),
            busy_nanos: AtomicU64::new(0),
            max_batch: AtomicU64::new(0),
            scheduler_up: AtomicU64::new(0),
            connections_open: AtomicU64::new(0),
            connections_rejected: AtomicU64::new(0),
            timeouts: AtomicU64::new(0),
            ttft: Histogram::new(SECONDS),
            tpot: Histogram::new(SECONDS),
            latency: Histogram::new(SECONDS),
            batch_size: Histogram::new(BATCH),
        }
    }

    pub fn count_request(&self, endpoint: &str, status: u16) {
        let mut map = self.requests.lock().unwrap_or_else(|p| p.into_inner());
        *map.entry((endpoint.to_owned(), status)).or_insert(0) += 1;
    }

    pub fn observe_batch(&self, size: usize) {
        self.batch_size.observe(size as f64);
        self.decode_steps.fetch_add(1, Ordering::Relaxed);
        self.max_batch.fetch_max(size as u64, Ordering::Relaxed);
    }

    /// Adds `elapsed` to one of the nanosecond counters.
    pub fn add_time(counter: &AtomicU64, elapsed: std::time::Duration) {
        let nanos = u64::try_from(elapsed.as_nanos()).unwrap_or(u64::MAX);
        counter.fetch_add(nanos, Ordering::Relaxed);
    }

    /// The Prometheus text exposition.
    pub fn render(&self) -> String {
        let mut out = String::new();
        let _ = writeln!(
            out,
            "# HELP sieve_requests_total HTTP requests by endpoint and status."
        );
        let _ = writeln!(out, "# TYPE sieve_requests_total counter");
        for ((endpoint, status), count) in self
            .requests
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
        {
            let _ = writeln!(
                out,
                "sieve_requests_total{{endpoint=\"{endpoint}\",status=\"{status}\"}} {count}"
            );
        }
        let counter = |out: &mut String, name: &str, help: &str, v: &AtomicU64| {
            let _ = writeln!(out, "# HELP {name} {help}");
            let _ = writeln!(out, "# TYPE {name} counter");
            let _ = writeln!(out, "{name} {}", v.load(Ordering::Relaxed));
        };
        let gauge = |out: &mut String, name: &str, help: &str, v: &AtomicU64| {
            let _ = writeln!(out, "# HELP {name} {help}");
            let _ = writeln!(out, "# TYPE {name} gauge");
            let _ = writeln!(out, "{name} {}", v.load(Ordering::Relaxed));
        };
        counter(
            &mut out,
            "sieve_prompt_tokens_total",
            "Prompt tokens prefilled.",
            &self.prompt_tokens,
        );
        counter(
            &mut out,
            "sieve_completion_tokens_total",
            "Tokens generated.",
            &self.completion_tokens,
        );
        counter(
            &mut out,
            "sieve_cancelled_total",
            "Generations stopped because the client disconnected.",
            &self.cancelled,
        );
        let _ = writeln!(
            out,
            "# HELP sieve_rejected_total Requests refused with 503."
        );
        let _ = writeln!(out, "# TYPE sieve_rejected_total counter");
        let _ = writeln!(
            out,
            "sieve_rejected_total{{reason=\"queue_full\"}} {}",
            self.rejected_queue_full.load(Ordering::Relaxed)
        );
        let _ = writeln!(
            out,
            "sieve_rejected_total{{reason=\"shutting_down\"}} {}",
            self.rejected_shutdown.load(Ordering::Relaxed)
        );
        counter(
            &mut out,
            "sieve_decode_steps_total",
            "Batched decode steps run.",
            &self.decode_steps,
        );
        gauge(
            &mut out,
            "sieve_queue_depth",
            "Requests waiting for a cache slot.",
            &self.queue_depth,
        );
        gauge(
            &mut out,
            "sieve_running_sequences",
            "Sequences in the running batch.",
            &self.running,
        );
        gauge(
            &mut out,
            "sieve_kv_slots_in_use",
            "KV cache slots held by live sequences.",
            &self.slots_in_use,
        );
        gauge(
            &mut out,
            "sieve_kv_slots_total",
            "KV cache slots in the pool.",
            &self.slots_total,
        );
        gauge(
            &mut out,
            "sieve_kv_cache_bytes",
            "Bytes of the KV cache pool (device memory for a GPU engine).",
            &self.kv_cache_bytes,
        );
        counter(
            &mut out,
            "sieve_engine_chosen_steps_total",
            "Decode steps whose tokens the engine chose or drew itself (no logits copied to the host).",
            &self.engine_chosen_steps,
        );
        gauge(
            &mut out,
            "sieve_prefilling_sequences",
            "Admitted requests whose prompt is still being prefilled (in chunks).",
            &self.prefilling,
        );
        counter(
            &mut out,
            "sieve_prefill_chunks_total",
            "Prompt chunks prefilled (a prompt longer than --prefill-chunk goes in several).",
            &self.prefill_chunks,
        );
        gauge(
            &mut out,
            "sieve_scheduler_up",
            "1 while the scheduler (the model loop) runs.",
            &self.scheduler_up,
        );
        gauge(
            &mut out,
            "sieve_connections_open",
            "TCP connections being served.",
            &self.connections_open,
        );
        counter(
            &mut out,
            "sieve_connections_rejected_total",
            "Connections answered 503 because the connection limit was reached.",
            &self.connections_rejected,
        );
        counter(
            &mut out,
            "sieve_timeouts_total",
            "Requests or connections ended by the header, idle or body timeout.",
            &self.timeouts,
        );
        let seconds = |out: &mut String, name: &str, help: &str, v: &AtomicU64| {
            let _ = writeln!(out, "# HELP {name} {help}");
            let _ = writeln!(out, "# TYPE {name} counter");
            let _ = writeln!(out, "{name} {:.6}", v.load(Ordering::Relaxed) as f64 * 1e-9);
        };
        seconds(
            &mut out,
            "sieve_engine_prefill_seconds_total",
            "Time in the engine's prefill calls.",
            &self.prefill_nanos,
        );
        seconds(
            &mut out,
            "sieve_engine_decode_seconds_total",
            "Time in the engine's decode steps.",
            &self.decode_nanos,
        );
        seconds(
            &mut out,
            "sieve_scheduler_busy_seconds_total",
            "Time of scheduler iterations with work; minus the two engine counters, the host's own share.",
            &self.busy_nanos,
        );
        gauge(
            &mut out,
            "sieve_batch_size_max",
            "Largest decode batch so far.",
            &self.max_batch,
        );
        self.ttft.render(
            &mut out,
            "sieve_time_to_first_token_seconds",
            "Queue wait plus prefill until the first token.",
        );
        self.tpot.render(
            &mut out,
            "sieve_time_per_output_token_seconds",
            "Time between consecutive tokens of one sequence.",
        );
        self.latency.render(
            &mut out,
            "sieve_request_duration_seconds",
            "From admission to the last token.",
        );
        self.batch_size
            .render(&mut out, "sieve_batch_size", "Sequences per decode step.");
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histogram_buckets_are_cumulative() {
        let h = Histogram::new(&[1.0, 2.0]);
        for v in [0.5, 1.5, 1.7, 9.0] {
            h.observe(v);
        }
        let mut out = String::new();
        h.render(&mut out, "x", "help");
        assert!(out.contains("x_bucket{le=\"1\"} 1\n"), "{out}");
        assert!(out.contains("x_bucket{le=\"2\"} 3\n"), "{out}");
        assert!(out.contains("x_bucket{le=\"+Inf\"} 4\n"), "{out}");
        assert!(out.contains("x_sum 12.7\n"), "{out}");
        assert_eq!(h.count(), 4);
    }

    #[test]
    fn render_lists_requests_and_gauges() {
        let m = Metrics::new();
        m.count_request("/v1/completions", 200);
        m.count_request("/v1/completions", 200);
        m.slots_total.store(4, Ordering::Relaxed);
        m.observe_batch(3);
        let text = m.render();
        assert!(
            text.contains("sieve_requests_total{endpoint=\"/v1/completions\",status=\"200\"} 2")
        );
        assert!(text.contains("sieve_kv_slots_total 4"));
        assert!(text.contains("sieve_batch_size_max 3"));
        assert!(text.contains("# TYPE sieve_batch_size histogram"));
        assert!(text.contains("sieve_engine_decode_seconds_total 0.000000\n"));
    }

    #[test]
    fn engine_times_render_in_seconds() {
        let m = Metrics::new();
        Metrics::add_time(&m.prefill_nanos, std::time::Duration::from_micros(1500));
        Metrics::add_time(&m.prefill_nanos, std::time::Duration::from_micros(500));
        Metrics::add_time(&m.decode_nanos, std::time::Duration::from_millis(7));
        Metrics::add_time(&m.busy_nanos, std::time::Duration::from_millis(10));
        let text = m.render();
        assert!(
            text.contains("sieve_engine_prefill_seconds_total 0.002000\n"),
            "{text}"
        );
        assert!(
            text.contains("sieve_engine_decode_seconds_total 0.007000\n"),
            "{text}"
        );
        assert!(
            text.contains("sieve_scheduler_busy_seconds_total 0.010000\n"),
            "{text}"
        );
    }
}

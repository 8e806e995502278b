//! `sieve bench cpu`: prefill and decode tokens/s of several models in one run.
//!
//! Every model is loaded first; then each of `repeats` rounds measures every model in turn
//! (interleaved, so a burst of load from another process falls on all of them rather than on
//! one), and the median of the rounds is reported. A round is one prefill of a fixed English
//! prompt of `prompt_tokens` tokens (the first call of a round; its logits pick the first
//! token) and `decode_tokens` greedy single-token steps after it, timed separately. The prompt
//! is real text, not random ids, because the TEAL thresholds of a pack were calibrated on text
//! and how many columns a product skips depends on the activations.
//!
//! Bytes per token: what one decode step reads of the weights in the worst case (every layer's
//! bytes as the CPU holds them, `WeightFormat::cpu_bytes`, plus the LM head); column formats
//! under a threshold read less.

use std::path::PathBuf;
use std::time::Instant;

use serde::Serialize;

use crate::error::{ModelError, Result};
use crate::llama::{KvPrecision, Logits, Model};
use crate::packed::load_model_and_tokenizer_with as load;
use crate::tokenizer::Tokenizer;

/// Text the benchmark prompt is cut from (repeated when the prompt is longer).
const PROMPT_TEXT: &str = "The history of the city begins with a small settlement on the \
northern bank of the river, where fishermen and traders built wooden houses along the water. \
Over the following centuries the town grew into a market centre for the surrounding farms, and \
a stone bridge replaced the old ferry. In the nineteenth century the arrival of the railway \
brought factories, new streets and thousands of workers from the countryside. Today the old \
quarter is known for its narrow lanes, its cathedral and the museum that tells the story of the \
people who lived and worked there.";

#[derive(Clone, Debug)]
pub struct CpuBenchOptions {
    pub prompt_tokens: usize,
    pub decode_tokens: usize,
    pub repeats: usize,
    /// Every model is measured once per cache precision given (`--kv-cache f16,int8`).
    pub kv_caches: Vec<KvPrecision>,
}

impl Default for CpuBenchOptions {
    fn default() -> Self {
        Self {
            prompt_tokens: 64,
            decode_tokens: 128,
            repeats: 3,
            kv_caches: vec![KvPrecision::F16],
        }
    }
}

/// One model's result.
#[derive(Clone, Debug, Serialize)]
pub struct CpuBenchRow {
    pub model: String,
    /// The formats of the layer products, e.g. `tiled-cbc x210, dense x1`.
    pub formats: String,
    /// Bytes of every linear (layers and LM head) as the CPU holds them (`cpu_bytes`: the
    /// 8-bit and 4-bit records, not the f16 blob they were built from): one decode step reads
    /// at most this.
    pub weight_bytes: usize,
    /// What the KV cache stores, and its bytes at the run's last position (prompt + decode).
    pub kv_cache: KvPrecision,
    pub kv_cache_bytes: usize,
    /// Median prefill tokens/s over the rounds, and every round's value.
    pub prefill_tok_s: f64,
    pub prefill_runs: Vec<f64>,
    /// Median decode tokens/s over the rounds, and every round's value.
    pub decode_tok_s: f64,
    pub decode_runs: Vec<f64>,
}

/// The whole run, as `--json` writes it.
#[derive(Clone, Debug, Serialize)]
pub struct CpuBenchReport {
    pub threads: usize,
    pub simd: &'static str,
    pub prompt_tokens: usize,
    pub decode_tokens: usize,
    pub repeats: usize,
    /// `/proc/loadavg` before and after the run (empty where unavailable).
    pub load_before: String,
    pub load_after: String,
    pub rows: Vec<CpuBenchRow>,
}

fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_default()
}

fn median(v: &[f64]) -> f64 {
    let mut s = v.to_vec();
    s.sort_by(|a, b| a.total_cmp(b));
    match s.len() {
        0 => 0.0,
        n if n % 2 == 1 => s[n / 2],
        n => 0.5 * (s[n / 2 - 1] + s[n / 2]),
    }
}

/// The prompt: [`PROMPT_TEXT`] encoded (repeated as needed), cut to `len` tokens.
pub fn bench_prompt(tokenizer: &Tokenizer, len: usize) -> Result<Vec<u32>> {
    let one = tokenizer.encode(PROMPT_TEXT, tokenizer.add_bos_by_default())?;
    let more = tokenizer.encode(&format!(" {PROMPT_TEXT}"), false)?;
    if one.is_empty() || more.is_empty() {
        return Err(ModelError::Tokenizer(
            "the benchmark prompt encodes to no tokens".into(),
        ));
    }
    let mut tokens = one;
    while tokens.len() < len {
        tokens.extend_from_slice(&more);
    }
    tokens.truncate(len);
    Ok(tokens)
}

fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0;
    for (i, v) in logits.iter().enumerate() {
        if *v > logits[best] {
            best = i;
        }
    }
    best as u32
}

/// One round on one model: (prefill tok/s, decode tok/s), with the pool's workers kept hot as
/// `generate` keeps them.
pub fn measure(
    model: &Model,
    prompt: &[u32],
    decode_tokens: usize,
    kv: KvPrecision,
) -> Result<(f64, f64)> {
    crate::generate::with_hot_workers(|| measure_on_this_thread(model, prompt, decode_tokens, kv))
}

fn measure_on_this_thread(
    model: &Model,
    prompt: &[u32],
    decode_tokens: usize,
    kv: KvPrecision,
) -> Result<(f64, f64)> {
    let mut cache = model.try_new_cache_as(
        prompt.len().saturating_add(decode_tokens).saturating_add(1),
        kv,
    )?;
    if cache.capacity() < prompt.len() + decode_tokens {
        return Err(ModelError::ContextOverflow {
            tokens: prompt.len() + decode_tokens,
            context: cache.capacity(),
        });
    }
    let start = Instant::now();
    let logits = model.forward(prompt, &mut cache, Logits::Last)?;
    let prefill = start.elapsed().as_secs_f64();
    let mut next = argmax(&logits);
    let start = Instant::now();
    for _ in 0..decode_tokens {
        let logits = model.forward(&[next], &mut cache, Logits::Last)?;
        next = argmax(&logits);
    }
    let decode = start.elapsed().as_secs_f64();
    Ok((
        prompt.len() as f64 / prefill.max(1e-9),
        decode_tokens as f64 / decode.max(1e-9),
    ))
}

fn describe(model: &Model) -> (String, usize) {
    let mut counts: std::collections::BTreeMap<String, usize> = Default::default();
    let mut bytes = 0;
    let heads = std::iter::once(model.lm_head());
    for lin in model
        .layers()
        .iter()
        .flat_map(|l| l.linears().map(|(_, lin)| lin))
        .chain(heads)
    {
        let f = lin.format();
        let balanced = f
            .as_any()
            .and_then(|a| a.downcast_ref::<sieve_cpu::balanced_cbc::FastBalancedCbc>());
        let name = match (lin.block_type(), balanced, f.kind()) {
            (Some(ty), _, _) => format!("gguf-blocks {ty:?}"),
            // Which records the loader built (the blob is the same f16 for all of them).
            (None, Some(b), kind) => format!("{} {}", kind.name(), b.values()),
            (None, None, kind) => kind.name().to_string(),
        };
        *counts.entry(name).or_default() += 1;
        bytes += f.cpu_bytes();
    }
    let formats = counts
        .iter()
        .map(|(k, n)| format!("{k} x{n}"))
        .collect::<Vec<_>>()
        .join(", ");
    (formats, bytes)
}

/// A model to measure: its file, and whether GGUF blocks are dequantized to f16 first.
#[derive(Clone, Debug)]
pub struct BenchTarget {
    pub path: PathBuf,
    pub f16_weights: bool,
}

impl BenchTarget {
    /// The name in the report: the path, with ` (f16)` for dequantized runs.
    pub fn label(&self) -> String {
        if self.f16_weights {
            format!("{} (f16)", self.path.display())
        } else {
            self.path.display().to_string()
        }
    }
}

/// Refuses a model given twice (the same file, by path, symlink or hard link, with the same
/// `f16_weights`): each copy would be loaded and held in memory for nothing.
fn check_distinct(targets: &[BenchTarget]) -> Result<()> {
    use std::os::unix::fs::MetadataExt;
    let mut seen: Vec<((u64, u64), bool, &BenchTarget)> = Vec::with_capacity(targets.len());
    for t in targets {
        let meta = std::fs::metadata(&t.path).map_err(|source| ModelError::Io {
            path: t.path.display().to_string(),
            source,
        })?;
        let id = (meta.dev(), meta.ino());
        if let Some((_, _, first)) = seen
            .iter()
            .find(|(other, f16, _)| *other == id && *f16 == t.f16_weights)
        {
            return Err(ModelError::InvalidArgument(format!(
                "the model {} is given twice (also as {}); each model is measured once, give it \
                 once",
                t.path.display(),
                first.path.display()
            )));
        }
        seen.push((id, t.f16_weights, t));
    }
    Ok(())
}

/// Loads every target, then measures them in interleaved rounds on the current rayon pool.
/// `progress` is called after each measurement.
pub fn run(
    targets: &[BenchTarget],
    options: &CpuBenchOptions,
    mut progress: impl FnMut(&str, f64, f64),
) -> Result<CpuBenchReport> {
    if targets.is_empty() {
        return Err(ModelError::InvalidArgument("no models to benchmark".into()));
    }
    if options.prompt_tokens == 0
        || options.decode_tokens == 0
        || options.repeats == 0
        || options.kv_caches.is_empty()
    {
        return Err(ModelError::InvalidArgument(
            "prompt tokens, decode tokens, repeats and KV cache precisions must all be at least 1"
                .into(),
        ));
    }
    // Every size is checked before anything is loaded or built: the positions against the
    // largest context any model may have, then (below) against each model's own.
    let positions = options
        .prompt_tokens
        .checked_add(options.decode_tokens)
        .filter(|&n| n <= crate::config::limits::MAX_CONTEXT)
        .ok_or_else(|| {
            ModelError::InvalidArgument(format!(
                "--prompt-tokens {} + --decode-tokens {} is more than any model's context \
                 (at most {} positions)",
                options.prompt_tokens,
                options.decode_tokens,
                crate::config::limits::MAX_CONTEXT
            ))
        })?;
    check_distinct(targets)?;
    let mut models = Vec::with_capacity(targets.len());
    for t in targets {
        let (model, tokenizer) = load(&t.path, t.f16_weights)?;
        let context = model.config().max_position_embeddings;
        if positions > context {
            return Err(ModelError::InvalidArgument(format!(
                "{}: --prompt-tokens {} + --decode-tokens {} = {positions} positions, more than \
                 the model's context of {context}",
                t.path.display(),
                options.prompt_tokens,
                options.decode_tokens
            )));
        }
        let prompt = bench_prompt(&tokenizer, options.prompt_tokens)?;
        models.push((t.label(), model, prompt));
    }
    // One measured configuration per (model, cache precision), the model loaded once.
    let labelled = |name: &str, kv: KvPrecision| {
        if options.kv_caches.len() > 1 {
            format!("{name} (kv {kv})")
        } else {
            name.to_string()
        }
    };
    let configs: Vec<(usize, KvPrecision)> = (0..models.len())
        .flat_map(|m| options.kv_caches.iter().map(move |&kv| (m, kv)))
        .collect();
    let load_before = load_average();
    let mut runs = vec![(Vec::new(), Vec::new()); configs.len()];
    for _ in 0..options.repeats {
        for (&(m, kv), (pre, dec)) in configs.iter().zip(runs.iter_mut()) {
            let (name, model, prompt) = &models[m];
            let (p, d) = measure(model, prompt, options.decode_tokens, kv)?;
            progress(&labelled(name, kv), p, d);
            pre.push(p);
            dec.push(d);
        }
    }
    let rows = configs
        .iter()
        .zip(runs)
        .map(|(&(m, kv), (pre, dec))| {
            let (name, model, _) = &models[m];
            let (formats, weight_bytes) = describe(model);
            let c = model.config();
            let rows = c.num_layers * positions * c.num_kv_heads;
            CpuBenchRow {
                model: labelled(name, kv),
                formats,
                weight_bytes,
                kv_cache: kv,
                kv_cache_bytes: 2 * rows * kv.row_bytes(c.head_dim),
                prefill_tok_s: median(&pre),
                prefill_runs: pre,
                decode_tok_s: median(&dec),
                decode_runs: dec,
            }
        })
        .collect();
    Ok(CpuBenchReport {
        threads: rayon::current_num_threads(),
        simd: sieve_cpu::simd::SimdLevel::detect().name(),
        prompt_tokens: options.prompt_tokens,
        decode_tokens: options.decode_tokens,
        repeats: options.repeats,
        load_before,
        load_after: load_average(),
        rows,
    })
}

impl CpuBenchReport {
    /// A Markdown table, decode ratios against the first model.
    pub fn markdown(&self) -> String {
        let mut s = format!(
            "threads {}, simd {}, prompt {} tokens, decode {} tokens, median of {} rounds, \
             load {} -> {}\n\n| model | formats | weight MB | KV cache | prefill tok/s | \
             decode tok/s | decode vs first |\n|---|---|---|---|---|---|---|\n",
            self.threads,
            self.simd,
            self.prompt_tokens,
            self.decode_tokens,
            self.repeats,
            self.load_before,
            self.load_after
        );
        let base = self.rows.first().map(|r| r.decode_tok_s).unwrap_or(0.0);
        for r in &self.rows {
            let runs = |v: &[f64]| {
                v.iter()
                    .map(|x| format!("{x:.1}"))
                    .collect::<Vec<_>>()
                    .join(", ")
            };
            s.push_str(&format!(
                "| {} | {} | {:.1} | {} {:.1} MB | {:.1} ({}) | {:.1} ({}) | {:.2}x |\n",
                r.model,
                r.formats,
                r.weight_bytes as f64 / 1e6,
                r.kv_cache,
                r.kv_cache_bytes as f64 / 1e6,
                r.prefill_tok_s,
                runs(&r.prefill_runs),
                r.decode_tok_s,
                runs(&r.decode_runs),
                if base > 0.0 {
                    r.decode_tok_s / base
                } else {
                    0.0
                }
            ));
        }
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn median_of_odd_even_and_empty() {
        assert_eq!(median(&[3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&[4.0, 1.0, 2.0, 3.0]), 2.5);
        assert_eq!(median(&[]), 0.0);
    }

    #[test]
    fn measure_runs_prefill_and_decode_on_a_tiny_model() {
        use crate::llama::tests::{random_source, tiny_config};
        let model = Model::from_source(&random_source(tiny_config(), 3)).unwrap();
        for kv in [KvPrecision::F16, KvPrecision::Int8] {
            let (p, d) = measure(&model, &[1, 2, 3, 4], 5, kv).unwrap();
            assert!(p > 0.0 && d > 0.0 && p.is_finite() && d.is_finite());
        }
        let no_caches = CpuBenchOptions {
            kv_caches: Vec::new(),
            ..CpuBenchOptions::default()
        };
        let err = run(
            &[BenchTarget {
                path: "m.gguf".into(),
                f16_weights: false,
            }],
            &no_caches,
            |_, _, _| {},
        )
        .unwrap_err();
        assert!(err.to_string().contains("KV cache"), "{err}");
        let err = run(&[], &CpuBenchOptions::default(), |_, _, _| {});
        assert!(err.is_err());
    }

    #[test]
    fn sizes_and_duplicates_are_refused_before_any_model_loads() {
        // Not a model: reaching the loader would fail differently.
        let dir = std::env::temp_dir().join(format!("sieve-cpu-bench-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("m.gguf");
        std::fs::write(&file, b"not a model").unwrap();
        let link = dir.join("link.gguf");
        let _ = std::fs::remove_file(&link);
        std::fs::hard_link(&file, &link).unwrap();
        let target = |path: &std::path::Path, f16_weights| BenchTarget {
            path: path.to_path_buf(),
            f16_weights,
        };
        // Issue 30: --prompt-tokens 18446744073709551615 built a 6.9 GB prompt first.
        let huge = CpuBenchOptions {
            prompt_tokens: usize::MAX,
            decode_tokens: 4,
            repeats: 1,
            kv_caches: vec![KvPrecision::F16],
        };
        let err = run(&[target(&file, false)], &huge, |_, _, _| {})
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("context") && err.contains("--prompt-tokens"),
            "{err}"
        );
        // Issue 30: 100 copies of --model M loaded 100 models.
        let copies: Vec<BenchTarget> = (0..100).map(|_| target(&file, false)).collect();
        let err = run(&copies, &CpuBenchOptions::default(), |_, _, _| {})
            .unwrap_err()
            .to_string();
        assert!(err.contains("given twice"), "{err}");
        let err = run(
            &[target(&file, false), target(&link, false)],
            &CpuBenchOptions::default(),
            |_, _, _| {},
        )
        .unwrap_err()
        .to_string();
        assert!(err.contains("given twice"), "{err}");
        // The same file as f16 and as itself is two measurements: it reaches the loader.
        let err = run(
            &[target(&file, false), target(&file, true)],
            &CpuBenchOptions::default(),
            |_, _, _| {},
        )
        .unwrap_err()
        .to_string();
        assert!(!err.contains("given twice"), "{err}");
        let _ = std::fs::remove_dir_all(&dir);
    }
}

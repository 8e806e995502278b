//! The GPU runner against the CPU: each step kernel (sieve-cuda's `step`, `rope`, `attention`,
//! `sampling`) against its CPU reference on random inputs (odd sizes included), and whole tiny
//! models (dense, Tiled-CBC and RLC-CSC at sp 0.5 / dp 0.5) decoding the same greedy tokens as
//! the CPU forward pass with logits within a stated tolerance. Without a GPU every test prints a skip reason and passes, unless
//! `SIEVE_REQUIRE_GPU=1`.

use half::f16;
use sieve_cuda::attention::{self, AttentionShape};
use sieve_cuda::sampling::{self, SampleArgs};
use sieve_cuda::{dev_ptr, gpu_or_skip, rope, step, Gpu, KvCache, L2Span};
use sieve_formats::balanced_cbc::{slots_for_sparsity, BalancedCbc};
use sieve_formats::random::{balanced_matrix, sparse_matrix, Pattern};
use sieve_formats::rlc_csc::{RlcCsc, RlcCscOptions};
use sieve_formats::tiled_cbc::TiledCbc;
use sieve_formats::{DenseMatrix, FormatKind, WeightFormat};
use sieve_gpu::runner::sample_args;
use sieve_gpu::GpuModel;
use sieve_model::config::ModelConfig;
use sieve_model::linear::Linear;
use sieve_model::llama::{KvPrecision, Layer, Logits, Model};

use sieve_formats::random::Lcg as Rng;

/// Runs the GPU tests of this file one at a time. They share the device's primary context,
/// and in parallel a graph capture failed ("operation failed due to a previous error during
/// capture", then eager launches) in a different test on each run (Q8_0 blocks, then the dense
/// model; H200, 2026-12-05): most likely another test's device-wide synchronization (a cuBLAS
/// handle's destruction synchronizes the device) landing inside the capture. `sieve` runs one
/// engine per process.
fn serial_gpu() -> std::sync::MutexGuard<'static, ()> {
    static GPU: std::sync::Mutex<()> = std::sync::Mutex::new(());
    GPU.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

#[test]
fn rmsnorm_and_silu_match_reference() {
    let _serial = serial_gpu();
    let Some(gpu) = gpu_or_skip("rmsnorm_and_silu_match_reference") else {
        return;
    };
    let mut rng = Rng(3);
    for d in [1usize, 7, 576, 4097, 8192] {
        let x = rng.vec(d, 3.0);
        let w = rng.vec(d, 1.0);
        let (xd, wd) = (gpu.upload(&x).unwrap(), gpu.upload(&w).unwrap());
        let out = gpu.poisoned_f32(d).unwrap();
        let zero = gpu.poisoned_f32(d * 3 + 5).unwrap();
        step::rmsnorm_zero(
            &gpu,
            dev_ptr(&gpu, &xd),
            dev_ptr(&gpu, &wd),
            dev_ptr(&gpu, &out),
            d,
            1e-5,
            dev_ptr(&gpu, &zero),
            d * 3 + 5,
            // The prefetch is a hint: asking L2 for an input must change nothing.
            L2Span::of(&gpu, &wd),
        )
        .unwrap();
        let got = gpu.download(&out).unwrap();
        let want = step::reference::rmsnorm(&x, &w, 1e-5);
        let err = max_abs_diff(&got, &want);
        assert!(err < 1e-4, "rmsnorm d={d}: max error {err}");
        assert!(
            gpu.download(&zero).unwrap().iter().all(|v| *v == 0.0),
            "d={d}: zeroed buffer"
        );
        let gu = rng.vec(2 * d, 4.0);
        let gud = gpu.upload(&gu).unwrap();
        let h = gpu.poisoned_f32(d).unwrap();
        step::silu_mul(
            &gpu,
            dev_ptr(&gpu, &gud),
            dev_ptr(&gpu, &h),
            d,
            L2Span::of(&gpu, &gud).capped(40),
        )
        .unwrap();
        let err = max_abs_diff(&gpu.download(&h).unwrap(), &step::reference::silu_mul(&gu));
        assert!(err < 1e-4, "silu d={d}: {err}");
    }
}

/// RoPE + the cache write, then attention over a cache filled with random rows, for several
/// head layouts (GQA groups 1, 2, 3, 8; head dims 16, 64, 96, 128, 256) and sequence lengths that leave
/// splits empty, partial and spanning several 128-position tiles.
#[test]
fn rope_and_attention_match_reference() {
    let _serial = serial_gpu();
    let Some(gpu) = gpu_or_skip("rope_and_attention_match_reference") else {
        return;
    };
    let mut rng = Rng(11);
    for &(heads, kv_heads, hd) in &[
        (4usize, 4usize, 16usize),
        (9, 3, 64),
        (32, 4, 128),
        (8, 1, 64),
        (8, 4, 256),
        (6, 2, 96),
    ] {
        for &(capacity, len) in &[(64usize, 1usize), (64, 37), (700, 300), (2000, 1999)] {
            let shape = AttentionShape::new(&gpu, heads, kv_heads, hd, capacity).unwrap();
            let row = kv_heads * hd;
            let half = hd / 2;
            // Cache positions < len - 1 random (rounded through f16), the last written by rope_kv.
            let kc: Vec<f32> = rng
                .vec(capacity * row, 1.0)
                .into_iter()
                .map(rope::reference::round_f16)
                .collect();
            let vc: Vec<f32> = rng
                .vec(capacity * row, 1.0)
                .into_iter()
                .map(rope::reference::round_f16)
                .collect();
            let k16: Vec<f16> = kc.iter().map(|&v| f16::from_f32(v)).collect();
            let v16: Vec<f16> = vc.iter().map(|&v| f16::from_f32(v)).collect();
            let qkv = rng.vec((heads + 2 * kv_heads) * hd, 2.0);
            let bias = rng.vec(qkv.len(), 0.5);
            let p = len - 1;
            let cos: Vec<f32> = (0..capacity * half)
                .map(|i| ((i % 97) as f32 * 0.1).cos())
                .collect();
            let sin: Vec<f32> = (0..capacity * half)
                .map(|i| ((i % 97) as f32 * 0.1).sin())
                .collect();
            let (kd, vd) = (gpu.upload(&k16).unwrap(), gpu.upload(&v16).unwrap());
            let qkvd = gpu.upload(&qkv).unwrap();
            let biasd = gpu.upload(&bias).unwrap();
            let (cd, sd) = (gpu.upload(&cos).unwrap(), gpu.upload(&sin).unwrap());
            let state = gpu.upload(&[p as i32, 0]).unwrap();
            let part = gpu.poisoned_f32(shape.partials_len()).unwrap();
            let att = gpu.poisoned_f32(heads * hd).unwrap();
            let pp = |s: &cudarc::driver::CudaSlice<f32>| dev_ptr(&gpu, s);
            rope::rope_kv(
                &gpu,
                pp(&qkvd),
                pp(&biasd),
                pp(&cd),
                pp(&sd),
                dev_ptr(&gpu, &state),
                KvCache::F16 {
                    k: dev_ptr(&gpu, &kd),
                    v: dev_ptr(&gpu, &vd),
                },
                heads,
                kv_heads,
                hd,
                L2Span::of(&gpu, &cd),
            )
            .unwrap();
            attention::attention(
                &gpu,
                &shape,
                pp(&qkvd),
                KvCache::F16 {
                    k: dev_ptr(&gpu, &kd),
                    v: dev_ptr(&gpu, &vd),
                },
                dev_ptr(&gpu, &state),
                pp(&part),
                pp(&att),
                L2Span::of(&gpu, &sd),
            )
            .unwrap();
            // Reference: bias, rotation, cache write at p, attention over 0..len.
            let mut q = qkv.clone();
            for (a, b) in q.iter_mut().zip(&bias) {
                *a += b;
            }
            let (c, s) = (
                &cos[p * half..(p + 1) * half],
                &sin[p * half..(p + 1) * half],
            );
            for h in 0..heads + kv_heads {
                rope::reference::rope(&mut q[h * hd..(h + 1) * hd], c, s);
            }
            let (mut kc, mut vc) = (kc, vc);
            for i in 0..row {
                kc[p * row + i] = rope::reference::round_f16(q[heads * hd + i]);
                vc[p * row + i] = rope::reference::round_f16(q[(heads + kv_heads) * hd + i]);
            }
            let got_q = gpu.download(&qkvd).unwrap();
            let err_q = max_abs_diff(&got_q[..heads * hd], &q[..heads * hd]);
            assert!(err_q < 1e-4, "rope q: {err_q}");
            let got_k: Vec<f32> = gpu.download(&kd).unwrap()[p * row..(p + 1) * row]
                .iter()
                .map(|v| v.to_f32())
                .collect();
            assert!(
                max_abs_diff(&got_k, &kc[p * row..(p + 1) * row]) < 2e-3,
                "rope k cache write"
            );
            let want = attention::reference::attention(
                &q[..heads * hd],
                &kc,
                &vc,
                len,
                heads,
                kv_heads,
                hd,
            );
            let got = gpu.download(&att).unwrap();
            let err = max_abs_diff(&got, &want);
            assert!(
                err < 2e-4,
                "attention {heads}/{kv_heads}/{hd} len {len} (splits {}): max error {err}",
                shape.splits
            );
            // The warp split kernel over the same cache and q (attention writes neither).
            let warp = AttentionShape {
                kernel: attention::SplitKernel::Warp,
                ..shape
            };
            let att_w = gpu.poisoned_f32(heads * hd).unwrap();
            attention::attention(
                &gpu,
                &warp,
                pp(&qkvd),
                KvCache::F16 {
                    k: dev_ptr(&gpu, &kd),
                    v: dev_ptr(&gpu, &vd),
                },
                dev_ptr(&gpu, &state),
                pp(&part),
                pp(&att_w),
                L2Span::NONE,
            )
            .unwrap();
            let err = max_abs_diff(&gpu.download(&att_w).unwrap(), &want);
            assert!(
                err < 2e-4,
                "warp attention {heads}/{kv_heads}/{hd} len {len} (splits {}): max error {err}",
                shape.splits
            );
        }
    }
}

/// The runner's default sampling (greedy) as the kernel takes it.
fn greedy() -> SampleArgs {
    sample_args(&sieve_model::sampling::SamplingParams::greedy())
}

fn run_sampler(gpu: &Gpu, logits: &[f32], args: &SampleArgs, history: &[i32]) -> (i32, i32) {
    let l = gpu.upload(logits).unwrap();
    let p = history.len() - 1;
    let mut h = history.to_vec();
    h.push(-1);
    let hd = gpu.upload(&h).unwrap();
    let state = gpu.upload(&[p as i32, history[p]]).unwrap();
    sampling::sample_token(
        gpu,
        dev_ptr(gpu, &l),
        logits.len(),
        args,
        dev_ptr(gpu, &state),
        dev_ptr(gpu, &hd),
        h.len(),
    )
    .unwrap();
    let s = gpu.download(&state).unwrap();
    let h = gpu.download(&hd).unwrap();
    assert_eq!(s[0] as usize, p + 1, "position advances");
    assert_eq!(h[p + 1], s[1], "history holds the chosen token");
    (s[1], s[0])
}

#[test]
fn sampler_matches_cpu_rules() {
    let _serial = serial_gpu();
    let Some(gpu) = gpu_or_skip("sampler_matches_cpu_rules") else {
        return;
    };
    let mut rng = Rng(5);
    // Under compute-sanitizer (SIEVE_SANITIZE_SMALL=1) a launch takes seconds (racecheck tracks
    // every shared access of the 48-step bisections): the rules are the same at a vocabulary of
    // 1000 with fewer draws; the real vocabularies and 200 draws are left to the plain run.
    let small = std::env::var("SIEVE_SANITIZE_SMALL").as_deref() == Ok("1");
    let vocabs: &[usize] = if small {
        &[37, 1000]
    } else {
        &[1, 37, 1000, 49152, 128256]
    };
    let (top_k_draws, top_p_draws) = if small { (40u64, 5u64) } else { (200, 50) };
    for &vocab in vocabs {
        let logits = rng.vec(vocab, 8.0);
        let mut cpu =
            sieve_model::sampling::Sampler::new(sieve_model::sampling::SamplingParams::greedy())
                .unwrap();
        let want = cpu.sample(&logits, &[]).unwrap() as i32;
        let (got, _) = run_sampler(&gpu, &logits, &greedy(), &[0]);
        assert_eq!(got, want, "greedy over {vocab}");
        // Ties: the lowest id wins.
        let mut tied = logits.clone();
        tied[vocab - 1] = 100.0;
        tied[vocab / 2] = 100.0;
        let (got, _) = run_sampler(&gpu, &tied, &greedy(), &[0]);
        assert_eq!(got as usize, vocab / 2, "ties over {vocab}");
        if vocab < 1000 {
            continue;
        }
        // Repetition penalty: the best token, penalized hard, loses to the second best.
        let mut args = greedy();
        args.repetition_penalty = 1e6;
        let (got, _) = run_sampler(&gpu, &logits, &args, &[want, 3, want]);
        let mut cpu = sieve_model::sampling::Sampler::new(sieve_model::sampling::SamplingParams {
            repetition_penalty: 1e6,
            ..sieve_model::sampling::SamplingParams::greedy()
        })
        .unwrap();
        assert_eq!(
            got,
            cpu.sample(&logits, &[want as u32, 3, want as u32]).unwrap() as i32,
            "penalty over {vocab}"
        );
        // top-k 5 at temperature 1: only the 5 largest, and over many draws every one of them.
        let mut order: Vec<usize> = (0..vocab).collect();
        order.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]));
        let flat: Vec<f32> = logits
            .iter()
            .enumerate()
            .map(|(i, &v)| {
                if order[..5].contains(&i) {
                    10.0
                } else {
                    v - 40.0
                }
            })
            .collect();
        let mut seen = std::collections::HashSet::new();
        for seed in 0..top_k_draws {
            let args = SampleArgs {
                temperature: 1.0,
                top_k: 5,
                top_p: 1.0,
                repetition_penalty: 1.0,
                window: 64,
                seed,
            };
            let (got, _) = run_sampler(&gpu, &flat, &args, &[0]);
            assert!(order[..5].contains(&(got as usize)), "top-k 5 drew {got}");
            seen.insert(got);
        }
        assert_eq!(
            seen.len(),
            5,
            "{top_k_draws} draws over 5 equal tokens hit them all"
        );
        // top-p 0.5 over two dominant tokens of masses ~0.6 / ~0.4: only the first.
        let mut two = vec![-30.0f32; vocab];
        two[order[0]] = 1.0 + (0.6f32 / 0.4).ln();
        two[order[1]] = 1.0;
        for seed in 0..top_p_draws {
            let args = SampleArgs {
                temperature: 1.0,
                top_k: 0,
                top_p: 0.5,
                repetition_penalty: 1.0,
                window: 64,
                seed,
            };
            let (got, _) = run_sampler(&gpu, &two, &args, &[0]);
            assert_eq!(got as usize, order[0], "top-p 0.5");
        }
    }
}

fn config(
    vocab: usize,
    d: usize,
    inter: usize,
    layers: usize,
    heads: usize,
    kv: usize,
    hd: usize,
) -> ModelConfig {
    ModelConfig {
        architecture: "llama".into(),
        vocab_size: vocab,
        hidden_size: d,
        intermediate_size: inter,
        num_layers: layers,
        num_heads: heads,
        num_kv_heads: kv,
        head_dim: hd,
        max_position_embeddings: 256,
        rms_norm_eps: 1e-5,
        rope_theta: 10000.0,
        rope_scaling: None,
        attention_bias: false,
        tie_word_embeddings: false,
        bos_token_id: Some(1),
        eos_token_ids: vec![],
    }
}

/// A random model whose projections are pruned to `sp`, stored in `kind`, with thresholds
/// from the CPU activations of a short run at the `dp` quantile.
fn tiny_model(kind: FormatKind, sp: f64, dp: f64, seed: u64) -> Model {
    tiny_model_of(config(301, 96, 200, 2, 6, 2, 16), kind, sp, dp, seed)
}

/// [`tiny_model`] of configuration `c`.
fn tiny_model_of(c: ModelConfig, kind: FormatKind, sp: f64, dp: f64, seed: u64) -> Model {
    let (d, inter) = (c.hidden_size, c.intermediate_size);
    let (qr, kvr) = (c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim);
    let mut rng = Rng(seed);
    let mut s = seed;
    let mut lin = |rows: usize, cols: usize, scale: f32| -> Linear {
        s += 1;
        let m = if kind == FormatKind::BalancedCbc {
            let slots = slots_for_sparsity(sp).unwrap();
            balanced_matrix(rows, cols, slots, s).unwrap()
        } else {
            sparse_matrix(rows, cols, sp, Pattern::Unstructured, s).unwrap()
        };
        // sparse_matrix values are ~N(0, 0.02); scale to unit-variance outputs.
        let data: Vec<f16> = m
            .data()
            .iter()
            .map(|v| f16::from_f32(v.to_f32() * scale / (cols as f32).sqrt() / 0.02))
            .collect();
        let m = DenseMatrix::new(rows, cols, data).unwrap();
        let f: Box<dyn WeightFormat> = match kind {
            FormatKind::TiledCbc => Box::new(TiledCbc::encode(&m).unwrap()),
            FormatKind::RlcCsc => Box::new(
                RlcCsc::encode(
                    &m,
                    &RlcCscOptions {
                        index_bits: 4,
                        block_rows: 256,
                    },
                )
                .unwrap(),
            ),
            FormatKind::BalancedCbc => Box::new(sieve_cpu::balanced_cbc::FastBalancedCbc::new(
                &BalancedCbc::encode(&m).unwrap(),
            )),
            _ => Box::new(sieve_cpu::dense::FastDense::new(m)),
        };
        Linear::from_format(f)
    };
    let mut layers = Vec::new();
    for _ in 0..c.num_layers {
        layers.push(Layer {
            input_norm: rng.vec(d, 0.5).into_iter().map(|v| 1.0 + v).collect(),
            post_attention_norm: rng.vec(d, 0.5).into_iter().map(|v| 1.0 + v).collect(),
            q_proj: lin(qr, d, 1.0),
            k_proj: lin(kvr, d, 1.0),
            v_proj: lin(kvr, d, 1.0),
            o_proj: lin(d, qr, 0.5),
            gate_proj: lin(inter, d, 1.0),
            up_proj: lin(inter, d, 1.0),
            down_proj: lin(d, inter, 0.5),
        });
    }
    // A head with a wide logit spread: greedy choices far from ties.
    let head = lin(c.vocab_size, d, 6.0);
    let embed: Vec<f16> = rng
        .vec(c.vocab_size * d, 1.0)
        .into_iter()
        .map(f16::from_f32)
        .collect();
    let mut model = Model::from_parts(c, embed, layers, vec![1.0; d], head).unwrap();
    if dp > 0.0 {
        // Thresholds at the dp quantile of each site's inputs over 8 tokens (CPU observer).
        let vocab = model.config().vocab_size as u32;
        let tokens: Vec<u32> = (0..8).map(|i| (i * 37 + 5) % vocab).collect();
        let mut x = model.embed(&tokens).unwrap();
        let mut sites: Vec<[Vec<f32>; 4]> = (0..model.layers().len())
            .map(|_| Default::default())
            .collect();
        for l in 0..model.layers().len() {
            model
                .forward_layer(l, &mut x, tokens.len(), &mut |site, v, _| {
                    let i = sieve_model::llama::Site::ALL
                        .iter()
                        .position(|s| *s == site)
                        .unwrap();
                    sites[l][i].extend_from_slice(v);
                })
                .unwrap();
        }
        for (l, layer) in model.layers_mut().iter_mut().enumerate() {
            let t: Vec<_> = sites[l]
                .iter()
                .map(|v| sieve_formats::random::threshold_for_sparsity(v, dp).unwrap())
                .collect();
            for (name, lin) in layer.linears_mut() {
                let site = sieve_model::llama::Site::of_linear(name).unwrap();
                let i = sieve_model::llama::Site::ALL
                    .iter()
                    .position(|s| *s == site)
                    .unwrap();
                lin.set_threshold(t[i]).unwrap();
            }
        }
    }
    model
}

/// GPU greedy decode equals the CPU's over 64 tokens, and the GPU logits after every token of
/// the sequence are within `tol` of the CPU's. Tolerance: the GPU stores the KV cache in f16
/// (relative rounding 2^-11 per value, the CPU keeps f32) and sums in a different order;
/// logits here have a spread of ~10, and the measured error is printed.
/// Logit error per position (largest absolute difference over the vocabulary), sorted.
fn position_errors(got: &[f32], want: &[f32], vocab: usize) -> Vec<f32> {
    let mut errors: Vec<f32> = got
        .chunks(vocab)
        .zip(want.chunks(vocab))
        .map(|(g, w)| max_abs_diff(g, w))
        .collect();
    errors.sort_by(f32::total_cmp);
    errors
}

/// Relative nudge of every TEAL threshold for the CPU's own sensitivity check: the order of
/// the bounds by which two correct implementations' activations differ here (f32 sums in a
/// different order, and an f16 rounding of a K/V element that lands the other way moves it
/// by up to 2^-11 relative).
const THRESHOLD_NUDGE: f32 = 1e-4;

/// Relative rounding of an f16 (2^-11): the nudge for products that round their activations
/// to f16 before multiplying (the low-bit kernels).
const F16_ROUNDING: f32 = 1.0 / 2048.0;

/// The CPU's teacher-forced logits of `seq` with every threshold scaled by `1 + nudge`.
fn logits_with_nudged_thresholds(model: &mut Model, seq: &[u32], nudge: f32) -> Vec<f32> {
    let originals: Vec<_> = model
        .linears_mut()
        .iter()
        .map(|(_, l)| l.threshold())
        .collect();
    for ((_, lin), t) in model.linears_mut().into_iter().zip(&originals) {
        lin.set_threshold(t.map(|t| t * (1.0 + nudge))).unwrap();
    }
    let mut cache = model.new_cache(seq.len());
    let logits = model.forward(seq, &mut cache, Logits::All).unwrap();
    for ((_, lin), t) in model.linears_mut().into_iter().zip(originals) {
        lin.set_threshold(t).unwrap();
    }
    logits
}

fn check_model_against_cpu(name: &str, model: &mut Model, tol: f32) {
    check_gpu_model_against_cpu(name, None, model, tol, 0.0, THRESHOLD_NUDGE);
}

/// As [`check_model_against_cpu`], with the GPU model built from `gpu_source` (when given)
/// and `model` the CPU reference: for GGUF blocks, whose CPU kernels multiply with 8-bit
/// activations as llama.cpp does while the GPU's use f16 ones, the reference is the same
/// weights dequantized (exact) and multiplied in f32. Greedy tokens must agree up to the first
/// CPU step whose top-2 logit margin is below `near_tie` (0: every step); the teacher-forced
/// logits are checked at every position regardless, within the larger of `tol` and 1.5 x how
/// far the CPU moves from itself with every TEAL threshold scaled by 1 ± `nudge`.
fn check_gpu_model_against_cpu(
    name: &str,
    gpu_source: Option<&Model>,
    model: &mut Model,
    tol: f32,
    near_tie: f32,
    nudge: f32,
) {
    check_gpu_model_against_cpu_with_max(name, gpu_source, model, tol, tol, near_tie, nudge);
}

/// [`check_gpu_model_against_cpu`] (logit tolerance 0.05) for models whose GPU kernels round
/// their masked activations to f16 (the low-bit and SlideSparse kernels). With TEAL (`dp > 0`)
/// an input within that rounding of its threshold is active on one side only, so the logits are
/// allowed the CPU's own sensitivity to thresholds moved by 2^-11 (large on these tiny models:
/// p90 1.5-2.4 logits for the GGUF block models, measured 2026-12-04; the CPU's 8-bit-activation
/// block kernels differ from the same reference by p90 2.7), and greedy paths may then part at
/// any step, so tokens are not compared. Without thresholds every token is.
fn check_f16_input_model_against_cpu(
    name: &str,
    gpu_source: Option<&Model>,
    model: &mut Model,
    dp: f64,
) {
    let (near_tie, nudge) = if dp > 0.0 {
        (f32::INFINITY, F16_ROUNDING)
    } else {
        (0.0, THRESHOLD_NUDGE)
    };
    check_gpu_model_against_cpu(name, gpu_source, model, 0.05, near_tie, nudge);
}

/// The CPU's greedy tokens after `prompt`: (tokens, the steps before the first whose top two
/// logits are within `near_tie` (where a GPU may rightly part), the smallest top-2 margin).
fn cpu_greedy(
    model: &mut Model,
    prompt: &[u32],
    steps: usize,
    near_tie: f32,
) -> (Vec<u32>, usize, f32) {
    let mut cache = model.new_cache(prompt.len() + steps + 1);
    let mut logits = model.forward(prompt, &mut cache, Logits::Last).unwrap();
    let (mut tokens, mut compared, mut margin) = (Vec::new(), steps, f32::INFINITY);
    for step in 0..steps {
        let mut order: Vec<usize> = (0..logits.len()).collect();
        order.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]));
        let step_margin = logits[order[0]] - logits[order[1]];
        margin = margin.min(step_margin);
        if step_margin < near_tie {
            compared = compared.min(step);
        }
        let id = order[0] as u32;
        tokens.push(id);
        logits = model.forward(&[id], &mut cache, Logits::Last).unwrap();
    }
    (tokens, compared, margin)
}

/// The GPU's first `steps` tokens after `prompt` (its sampling: greedy unless set).
fn gpu_tokens_after(g: &mut GpuModel, prompt: &[u32], steps: usize) -> Vec<u32> {
    let mut tokens = vec![g.prefill(prompt).unwrap()];
    while tokens.len() < steps {
        tokens.push(g.next_token().unwrap());
    }
    tokens
}

/// [`check_gpu_model_against_cpu`] with its own allowance for the worst position (`max_tol`;
/// `tol` bounds the p90).
fn check_gpu_model_against_cpu_with_max(
    name: &str,
    gpu_source: Option<&Model>,
    model: &mut Model,
    tol: f32,
    max_tol: f32,
    near_tie: f32,
    nudge: f32,
) {
    let Some(gpu) = gpu_or_skip(name) else { return };
    let prompt: Vec<u32> = vec![1, 17, 42, 99, 250];
    let steps = 64;
    let (cpu_tokens, compared, margin) = cpu_greedy(model, &prompt, steps, near_tie);
    // The GPU's KV cache stores what the CPU reference's does.
    let mut g = GpuModel::from_model_with(
        gpu,
        gpu_source.unwrap_or(model),
        prompt.len() + steps + 1,
        model.kv_precision(),
    )
    .unwrap();
    assert_eq!(g.kv_precision(), model.kv_precision(), "{name}");
    let gpu_tokens = gpu_tokens_after(&mut g, &prompt, steps);
    if compared < steps {
        eprintln!(
            "{name}: greedy tokens compared up to step {compared} (CPU margin below {near_tie})"
        );
    }
    assert_eq!(
        gpu_tokens[..compared],
        cpu_tokens[..compared],
        "{name}: greedy tokens (smallest CPU top-2 margin {margin})"
    );
    // Logits of the whole sequence, teacher-forced, against the CPU's.
    let mut seq = prompt.clone();
    seq.extend(&cpu_tokens);
    let mut cache = model.new_cache(seq.len());
    let want = model.forward(&seq, &mut cache, Logits::All).unwrap();
    let v = model.config().vocab_size;
    let mut got = Vec::with_capacity(want.len());
    g.logits_all(&seq, |_, l| {
        got.extend_from_slice(l);
        Ok(())
    })
    .unwrap();
    let errors = position_errors(&got, &want, v);
    let quantiles = |e: &[f32]| (e[e.len() / 2], e[e.len() * 9 / 10], e[e.len() - 1]);
    let (median, p90, worst) = quantiles(&errors);
    eprintln!(
        "{name}: logit error per position over {} positions: median {median}, p90 {p90}, max {worst} (tolerance {tol}); smallest greedy margin {margin}",
        seq.len()
    );
    // With TEAL thresholds an input that lands within rounding of its threshold is active on
    // one side and not on the other: one weight column's contribution (|x| ~ t), which the KV
    // cache then carries to every later position. How far that moves the logits depends on the
    // model (a heavily pruned 2-layer cut of SmolLM2 moves by ~1 with *any* nudge, 1e-7
    // included), so the allowance is measured, not guessed: the CPU against itself with every
    // threshold nudged by THRESHOLD_NUDGE. A wrong kernel moves every position by more, and
    // the greedy tokens above must match exactly in any case.
    let (p90_cap, max_cap) = if model.layers()[0].q_proj.threshold().is_some() {
        let (mut n_p90, mut n_max) = (0f32, 0f32);
        for signed in [nudge, -nudge] {
            let nudged = logits_with_nudged_thresholds(model, &seq, signed);
            let (n_median, n_p90_s, n_max_s) = quantiles(&position_errors(&nudged, &want, v));
            eprintln!(
                "{name}: the CPU against itself with thresholds x (1 + {signed}): median {n_median}, p90 {n_p90_s}, max {n_max_s}"
            );
            n_p90 = n_p90.max(n_p90_s);
            n_max = n_max.max(n_max_s);
        }
        (tol.max(1.5 * n_p90), max_tol.max(1.5 * n_max))
    } else {
        (tol, max_tol)
    };
    assert!(
        p90 < p90_cap,
        "{name}: p90 logit error {p90} (allowed {p90_cap})"
    );
    assert!(
        worst < max_cap,
        "{name}: max logit error {worst} (allowed {max_cap})"
    );
    // The prompt token by token through the decode step fills the same cache as the batch.
    if g.prefill_is_batched() {
        g.set_batched_prefill(false);
        // Up to the CPU's first near tie, as above: an 8-bit cache may store a key one grid
        // step apart when the two paths round the activations differently.
        let n = compared.min(16);
        let stepwise = gpu_tokens_after(&mut g, &prompt, n);
        assert_eq!(
            stepwise[..n],
            gpu_tokens[..n],
            "{name}: stepwise vs batched prefill"
        );
        g.set_batched_prefill(true);
    }
    assert!(
        !g.report()
            .notes
            .iter()
            .any(|n| n.contains("capture failed")),
        "{name}: {:?}",
        g.report().notes
    );
    // Graphs without programmatic dependent launch give the same tokens.
    g.set_pdl(false);
    let plain = gpu_tokens_after(&mut g, &prompt, 8);
    assert_eq!(
        plain[..],
        gpu_tokens[..8],
        "{name}: graph without PDL vs with"
    );
    g.set_pdl(true);
    // Eager launches give the same tokens as graph replays.
    g.set_use_graphs(false);
    let eager = gpu_tokens_after(&mut g, &prompt, 8);
    assert_eq!(eager[..], gpu_tokens[..8], "{name}: eager vs graph");
}

#[test]
fn tiny_dense_model_matches_cpu() {
    let _serial = serial_gpu();
    check_model_against_cpu(
        "tiny_dense_model_matches_cpu",
        &mut tiny_model(FormatKind::Dense, 0.0, 0.0, 1),
        0.05,
    );
}

/// The prefill profile runs the same prefill: its first token is the plain prefill's, every
/// kind of work of the layer appears once with a time, and a prompt past one chunk is refused.
#[test]
fn prefill_profile_runs_the_same_prefill() {
    let _serial = serial_gpu();
    let name = "prefill_profile_runs_the_same_prefill";
    let Some(gpu) = gpu_or_skip(name) else {
        return;
    };
    let model = tiny_model(FormatKind::Dense, 0.0, 0.0, 5);
    let mut g = GpuModel::from_model(gpu, &model, 512).unwrap();
    let v = model.config().vocab_size;
    let prompt: Vec<u32> = (0..40).map(|i| ((i * 13 + 1) % v) as u32).collect();
    let want = g.prefill(&prompt).unwrap();
    let profile = g.profile_prefill(&prompt).unwrap();
    g.next_token().unwrap();
    let again = g.prefill(&prompt).unwrap();
    assert_eq!(want, again, "{name}: prefill after the profile");
    assert_eq!(profile.batched_tokens, prompt.len());
    let kinds: Vec<&str> = profile.by_op.iter().map(|(k, _)| *k).collect();
    let mut expected = vec!["embed"];
    expected.extend(sieve_model::plan::LAYER.iter().map(|op| op.name()));
    assert_eq!(kinds, expected, "{name}");
    assert!(
        profile.by_op.iter().all(|(_, us)| *us > 0.0) && profile.head_us > 0.0,
        "{name}: {profile:?}"
    );
    let long: Vec<u32> = (0..400).map(|i| (i % v) as u32).collect();
    assert!(
        g.profile_prefill(&long).is_err(),
        "{name}: a prompt past one chunk"
    );
}

/// The 8-bit KV cache: the GPU's cache writes (decode, batched prefill) and attention against
/// the CPU model with the same cache rule (`Model::set_kv_precision`), the tokens and logits
/// checked as for the f16 cache. The two quantize keys computed in different orders (and the
/// batched prefill's from f16-rounded activations), so a value near a half step of its row's
/// grid may land one step apart: the logits get a wider allowance than the f16 cache's 0.05,
/// and greedy tokens are compared up to the first near tie.
#[test]
fn tiny_dense_model_with_int8_kv_cache_matches_cpu() {
    let _serial = serial_gpu();
    let name = "tiny_dense_model_with_int8_kv_cache_matches_cpu";
    for (what, config) in [
        ("groups of 3", config(301, 96, 200, 2, 6, 2, 16)),
        ("groups of 8, hd 64", config(301, 512, 256, 2, 8, 1, 64)),
    ] {
        let mut model = tiny_model_of(config, FormatKind::Dense, 0.0, 0.0, 41);
        model.set_kv_precision(KvPrecision::Int8);
        let label = format!("{name} ({what})");
        check_gpu_model_against_cpu_with_max(&label, None, &mut model, 0.1, 0.2, 0.1, 0.0);
        if gpu_or_skip(name).is_none() {
            return;
        }
        // The report counts the scales: (hd + 4) bytes per row of K and of V.
        let c = model.config().clone();
        let capacity = 64;
        let g =
            GpuModel::from_model_with(Gpu::new(0).unwrap(), &model, capacity, KvPrecision::Int8)
                .unwrap();
        assert_eq!(
            g.report().kv_cache_bytes,
            2 * c.num_layers * capacity * c.num_kv_heads * (c.head_dim + 4),
            "{label}: KV cache bytes"
        );
        assert_eq!(g.report().kv_precision, KvPrecision::Int8);
        let pool = g.with_slots(3).unwrap();
        assert_eq!(
            pool.report().kv_cache_bytes,
            3 * 2 * c.num_layers * capacity * c.num_kv_heads * (c.head_dim + 4),
            "{label}: KV cache bytes of 3 slots"
        );
        assert_eq!(
            pool.kv_precision(),
            KvPrecision::Int8,
            "{label}: the pool keeps the precision"
        );
    }
}

#[test]
fn tiny_dense_teal_model_matches_cpu() {
    let _serial = serial_gpu();
    check_model_against_cpu(
        "tiny_dense_teal_model_matches_cpu",
        &mut tiny_model(FormatKind::Dense, 0.0, 0.5, 2),
        0.05,
    );
}

#[test]
fn tiny_tiled_cbc_model_matches_cpu() {
    let _serial = serial_gpu();
    check_model_against_cpu(
        "tiny_tiled_cbc_model_matches_cpu",
        &mut tiny_model(FormatKind::TiledCbc, 0.5, 0.5, 3),
        0.05,
    );
}

#[test]
fn tiny_rlc_csc_model_matches_cpu() {
    let _serial = serial_gpu();
    check_model_against_cpu(
        "tiny_rlc_csc_model_matches_cpu",
        &mut tiny_model(FormatKind::RlcCsc, 0.5, 0.5, 4),
        0.05,
    );
}

/// Balanced-CBC layers at 8:16 (the index-layout kernel) and 11:16 (the mask-chain kernel),
/// with thresholds.
#[test]
fn tiny_balanced_cbc_model_matches_cpu() {
    let _serial = serial_gpu();
    for (sp, seed) in [(0.5, 5), (0.3, 6)] {
        // The prompt runs through cuBLAS on the f16 copy with f16-rounded activations, the
        // steps through the f32 spMspV: under TEAL an input within that rounding of its
        // threshold is active on one side only, so, as for the other f16-input paths, the
        // logits are checked and greedy paths may part (they did at step 10 of this model,
        // H100, 2026-12-05, teacher-forced logits 5.7e-6 apart).
        check_f16_input_model_against_cpu(
            "tiny_balanced_cbc_model_matches_cpu",
            None,
            &mut tiny_model(FormatKind::BalancedCbc, sp, 0.5, seed),
            0.5,
        );
    }
}

/// [`tiny_model`] with every projection and the head pruned to (2N-2):2N by magnitude and
/// stored as SlideSparse at that N, as a pack loads them (`format_from_blob`: the format's own
/// type, whose encoding the GPU upload takes). Thresholds (dp > 0) are the dense model's.
fn tiny_slide_model(n: usize, dp: f64, seed: u64) -> Model {
    use sieve_formats::slide::{prune_to_pattern, Slide, SlideOptions};
    let mut model = tiny_model(FormatKind::Dense, 0.0, dp, seed);
    for (_, lin) in model.linears_mut() {
        let pruned = prune_to_pattern(&lin.format().decode(), n).unwrap();
        let s = Slide::encode(&pruned, &SlideOptions { n }).unwrap();
        lin.replace_format(sieve_cpu::format_from_blob(&s.to_bytes()).unwrap())
            .unwrap();
    }
    model
}

/// A slide pack's layers reach the GPU upload as their encoding, with their N (no GPU needed).
#[test]
fn slide_layers_reach_the_gpu_upload_encoded() {
    use sieve_gpu::runner::slide_source;
    for (n, seed) in [(4, 61), (2, 62)] {
        let model = tiny_slide_model(n, 0.0, seed);
        for (name, lin) in model.layers()[0].linears() {
            let s = slide_source(lin.format()).unwrap_or_else(|| panic!("{name}: not slide"));
            assert_eq!(s.n(), n, "{name}");
            assert_eq!(s.decode(), lin.format().decode(), "{name}");
        }
        assert!(slide_source(model.lm_head().format()).is_some());
    }
    let dense = tiny_model(FormatKind::Dense, 0.0, 0.0, 63);
    assert!(slide_source(dense.lm_head().format()).is_none());
}

/// SlideSparse models at 6:8 and 2:4 (every projection and the head): the decode step (the
/// lift into the matrix's scratch, then `mma.sp` with one token, split K adding with atomics)
/// and the batched prefill (the prompt's tokens lifted and multiplied in one product) decode
/// the CPU's greedy tokens, with the teacher-forced logits within the other formats' 0.05.
/// The GPU rounds the masked activations to f16 (as the low-bit kernels do), the CPU's slide
/// product keeps them f32. With TEAL thresholds, an input within that rounding of its
/// threshold is active on one side only, so the allowance is the CPU's own sensitivity to
/// thresholds moved by 2^-11 and, as for the low-bit kernels, greedy paths may then part: the
/// thresholded model's tokens are not compared.
#[test]
fn tiny_slide_models_match_cpu() {
    let _serial = serial_gpu();
    let name = "tiny_slide_models_match_cpu";
    if gpu_or_skip(name).is_none() {
        return;
    }
    for (n, label, dp, seed) in [
        (4, "slide/6:8", 0.0, 51),
        (2, "slide/2:4", 0.0, 52),
        (4, "slide/6:8", 0.5, 53),
    ] {
        let mut model = tiny_slide_model(n, dp, seed);
        let g = GpuModel::from_model(Gpu::new(0).unwrap(), &model, 64).unwrap();
        let kernels = &g.report().kernels;
        assert!(
            kernels.iter().all(|k| k.ends_with(label)),
            "{label}: {kernels:?}"
        );
        assert!(g.prefill_is_batched(), "{label}: batched prefill");
        assert!(g.decode_is_batched(), "{label}: batched decode");
        drop(g);
        check_f16_input_model_against_cpu(&format!("{name} {label} dp {dp}"), None, &mut model, dp);
    }
}

/// Every projection and the head of `model` replaced by GGUF blocks of `ty` (ggml's reference
/// quantizers), thresholds kept.
fn to_gguf_blocks(model: &mut Model, ty: sieve_cpu::gguf_blocks::BlockType) {
    use sieve_cpu::gguf_blocks::{BlockType, QuantMatrix};
    for (_, lin) in model.linears_mut() {
        let m = lin.format().decode();
        let blocks = match ty {
            BlockType::Q4_0 => sieve_cuda::lowbit::quantize_q4_0(&m).unwrap(),
            BlockType::Q8_0 => sieve_cuda::lowbit::quantize_q8_0(&m).unwrap(),
            other => panic!("no quantizer for {other:?} here"),
        };
        let q = QuantMatrix::new(ty, m.rows(), m.cols(), blocks).unwrap();
        let mut blocks = Linear::from_quantized(q);
        blocks.set_threshold(lin.threshold()).unwrap();
        *lin = blocks;
    }
}

/// GGUF Q4_0 and Q8_0 models (K a multiple of 32) decode on the GPU from their blocks (the
/// upload report names the low-bit kernels; nothing is dequantized) with the CPU's tokens,
/// with and without TEAL thresholds, against the CPU running the dequantized weights.
#[test]
fn tiny_gguf_block_models_match_cpu() {
    let _serial = serial_gpu();
    use sieve_cpu::gguf_blocks::BlockType;
    if gpu_or_skip("tiny_gguf_block_models_match_cpu").is_none() {
        return;
    }
    for (ty, label, dp, seed) in [
        (BlockType::Q8_0, "lowbit/q8_0", 0.0, 21),
        (BlockType::Q4_0, "lowbit/q4_0", 0.0, 22),
        (BlockType::Q4_0, "lowbit/q4_0", 0.5, 23),
    ] {
        let mut model = tiny_model_of(
            config(301, 96, 224, 2, 6, 2, 16),
            FormatKind::Dense,
            0.0,
            dp,
            seed,
        );
        to_gguf_blocks(&mut model, ty);
        let g = GpuModel::from_model(Gpu::new(0).unwrap(), &model, 64).unwrap();
        let kernels = g.report().kernels.join("; ");
        // Under TEAL thresholds the Q4_0 projections go column-major (inactive columns never
        // read); the head has no threshold and keeps the tensor-core layout.
        let cols_label = label.replace("lowbit/", "lowbit-cols/");
        assert!(
            g.report()
                .kernels
                .iter()
                .all(|k| k.ends_with(label) || (dp > 0.0 && k.ends_with(&cols_label))),
            "{ty:?}: {kernels}"
        );
        assert_eq!(
            g.report().kernels.iter().any(|k| k.ends_with(&cols_label)),
            dp > 0.0,
            "{ty:?} dp {dp}: {kernels}"
        );
        assert!(
            !g.report().notes.iter().any(|n| n.contains("dequantized")),
            "{:?}",
            g.report().notes
        );
        drop(g);
        // The CPU reference: the same model with every block matrix dequantized (exactly).
        let mut reference = tiny_model_of(
            config(301, 96, 224, 2, 6, 2, 16),
            FormatKind::Dense,
            0.0,
            dp,
            seed,
        );
        for ((_, blocks), (_, dense)) in
            model.linears_mut().into_iter().zip(reference.linears_mut())
        {
            let values = blocks.format().decode();
            dense
                .replace_format(Box::new(sieve_cpu::dense::FastDense::new(values)))
                .unwrap();
        }
        check_f16_input_model_against_cpu(
            &format!("tiny_gguf_block_models_match_cpu {ty:?} dp {dp}"),
            Some(&model),
            &mut reference,
            dp,
        );
    }
}

/// Prompts longer than `LOWBIT_DECODE_MIN_TOKENS` (SlideSparse: `slide::DECODE_MIN_TOKENS`):
/// the batched prefill multiplies the low-bit matrices (tensor-core layout), IE-BME and
/// SlideSparse ones through an f16 copy and cuBLAS instead of their kernels. The tokens after
/// such a prompt equal the CPU's (greedy, up to the first step where the CPU's top two logits
/// are within 0.1), for GGUF Q4_0, Q8_0, a Q4_K_M mix (Q4_K, Q6_K), IE-BME int4 and slide 6:8,
/// the CPU running the decoded weights as f16 (what the copy holds).
#[test]
fn long_prompts_of_low_bit_models_match_cpu() {
    let _serial = serial_gpu();
    use sieve_cpu::gguf_blocks::BlockType;
    let name = "long_prompts_of_low_bit_models_match_cpu";
    if gpu_or_skip(name).is_none() {
        return;
    }
    let mut compared_total = 0;
    for (what, seed) in [
        ("Q4_0", 51u64),
        ("Q8_0", 52),
        ("Q4_K_M", 53),
        ("IE-BME int4", 54),
        ("slide 6:8", 55),
    ] {
        let mut cfg = if what == "Q4_K_M" {
            config(301, 256, 512, 2, 8, 2, 32)
        } else {
            config(301, 96, 224, 2, 6, 2, 16)
        };
        // The slide model's prompts start past slide::DECODE_MIN_TOKENS (256), beyond the tiny
        // config's 256 positions (window K1: ContextOverflow { tokens: 266, context: 256 }).
        cfg.max_position_embeddings = 1024;
        let mut model = tiny_model_of(cfg.clone(), FormatKind::Dense, 0.0, 0.0, seed);
        match what {
            "Q4_0" => to_gguf_blocks(&mut model, BlockType::Q4_0),
            "Q8_0" => to_gguf_blocks(&mut model, BlockType::Q8_0),
            "Q4_K_M" => to_random_gguf_blocks(&mut model, q4_k_m_type, 7 * seed),
            "slide 6:8" => {
                use sieve_formats::slide::{prune_to_pattern, Slide, SlideOptions};
                for (_, lin) in model.linears_mut() {
                    let pruned = prune_to_pattern(&lin.format().decode(), 4).unwrap();
                    let s = Slide::encode(&pruned, &SlideOptions { n: 4 }).unwrap();
                    lin.replace_format(sieve_cpu::format_from_blob(&s.to_bytes()).unwrap())
                        .unwrap();
                }
            }
            _ => {
                // IE-BME int4 at 50%: its prompts past 32 tokens take the f16 copy.
                use sieve_formats::ie_bme::{IeBme, IeBmeOptions, Payload};
                let opts = IeBmeOptions {
                    payload: Payload::Int4 { group_size: 64 },
                    ..IeBmeOptions::default()
                };
                model = tiny_model_of(cfg.clone(), FormatKind::Dense, 0.5, 0.0, seed);
                for (_, lin) in model.linears_mut() {
                    let e = IeBme::encode(&lin.format().decode(), &opts).unwrap();
                    lin.replace_format(sieve_cpu::format_from_blob(&e.to_bytes()).unwrap())
                        .unwrap();
                }
            }
        }
        let mut reference = tiny_model_of(cfg, FormatKind::Dense, 0.0, 0.0, seed);
        for ((_, blocks), (_, dense)) in
            model.linears_mut().into_iter().zip(reference.linears_mut())
        {
            let values = blocks.format().decode();
            dense
                .replace_format(Box::new(sieve_cpu::dense::FastDense::new(values)))
                .unwrap();
        }
        let v = model.config().vocab_size;
        let steps = 6;
        for p in 0..3usize {
            let copy_from = if what.starts_with("slide") {
                sieve_cuda::slide::DECODE_MIN_TOKENS
            } else {
                sieve_gpu::prefill::LOWBIT_DECODE_MIN_TOKENS
            };
            let len = copy_from + 10 + 40 * p;
            let prompt: Vec<u32> = (0..len)
                .map(|i| ((i * (29 + 2 * p) + 3 + p) % v) as u32)
                .collect();
            let (cpu, compared, _) = cpu_greedy(&mut reference, &prompt, steps, 0.1);
            let mut g =
                GpuModel::from_model(Gpu::new(0).unwrap(), &model, len + steps + 1).unwrap();
            assert!(g.prefill_is_batched(), "{name} {what}");
            let gpu = gpu_tokens_after(&mut g, &prompt, steps);
            assert_eq!(
                gpu[..compared],
                cpu[..compared],
                "{name} {what}: tokens after a {len}-token prompt"
            );
            compared_total += compared;
        }
    }
    assert!(
        compared_total > 0,
        "{name}: every first step was a near tie"
    );
}

/// A prompt longer than the batched pass runs in chunks: passes of 128 tokens (four for a
/// 400-token prompt), 256 (two) and 512 (one) give the CPU's greedy tokens, and the pass's size
/// is refused out of bounds or once the scratch exists.
#[test]
fn prompts_in_chunks_of_any_size_match_cpu() {
    let _serial = serial_gpu();
    let name = "prompts_in_chunks_of_any_size_match_cpu";
    if gpu_or_skip(name).is_none() {
        return;
    }
    let mut cfg = config(301, 96, 224, 2, 6, 2, 16);
    cfg.max_position_embeddings = 512;
    let mut model = tiny_model_of(cfg, FormatKind::Dense, 0.0, 0.0, 61);
    let v = model.config().vocab_size;
    // 400 tokens: passes of 128 end at 384 (the last row is row 15 of the fourth pass), of
    // 256 at 256 (row 143 of the second), of 512 in one pass (row 399).
    let (len, steps) = (400usize, 6usize);
    let prompt: Vec<u32> = (0..len).map(|i| ((i * 37 + 5) % v) as u32).collect();
    let (cpu, compared, _) = cpu_greedy(&mut model, &prompt, steps, 0.1);
    for chunk in [128usize, 256, 512] {
        let mut g = GpuModel::from_model(Gpu::new(0).unwrap(), &model, len + steps + 1).unwrap();
        g.set_prefill_chunk_tokens(chunk).unwrap();
        assert_eq!(g.prefill_chunk_tokens(), chunk);
        let gpu = gpu_tokens_after(&mut g, &prompt, steps);
        assert_eq!(
            gpu[..compared],
            cpu[..compared],
            "{name}: passes of {chunk} tokens"
        );
        let e = g
            .set_prefill_chunk_tokens(chunk * 2)
            .unwrap_err()
            .to_string();
        assert!(e.contains("before its first pass"), "{e}");
    }
    assert!(compared > 0, "{name}: the first step was a near tie");
    let mut g = GpuModel::from_model(Gpu::new(0).unwrap(), &model, 64).unwrap();
    for bad in [0usize, 64, 4097] {
        let e = g.set_prefill_chunk_tokens(bad).unwrap_err().to_string();
        assert!(e.contains("batched pass of"), "{bad}: {e}");
    }
}

/// llama.cpp's Q4_K_M mix on a tiny model: Q6_K for v_proj, down_proj and the head, Q4_K
/// elsewhere.
fn q4_k_m_type(name: &str) -> sieve_cpu::gguf_blocks::BlockType {
    use sieve_cpu::gguf_blocks::BlockType;
    if name.contains("v_proj") || name.contains("down_proj") || name.contains("lm_head") {
        BlockType::Q6_K
    } else {
        BlockType::Q4_K
    }
}

/// Every projection and the head of `model` replaced by random GGUF blocks (sieve-cpu's
/// generator: real-model scale magnitudes, random codes) of the type `pick` gives its name.
fn to_random_gguf_blocks(
    model: &mut Model,
    pick: impl Fn(&str) -> sieve_cpu::gguf_blocks::BlockType,
    seed: u64,
) {
    use sieve_cpu::gguf_blocks::test_blocks::random_blocks;
    use sieve_cpu::gguf_blocks::QuantMatrix;
    for (i, (name, lin)) in model.linears_mut().into_iter().enumerate() {
        let ty = pick(&name);
        let (rows, cols) = (lin.rows(), lin.cols());
        let blocks = random_blocks(ty, rows, cols, seed + i as u64);
        let q = QuantMatrix::new(ty, rows, cols, blocks).unwrap();
        let mut blocks = Linear::from_quantized(q);
        blocks.set_threshold(lin.threshold()).unwrap();
        *lin = blocks;
    }
}

/// GGUF K-quant and Q4_1 / Q5_0 / Q5_1 models (K a multiple of 256) decode on the GPU from their
/// blocks with the CPU's tokens: the mix `llama-quantize Q4_K_M` writes (Q4_K, Q6_K for v, down
/// and the head), and one of the other five types. The reference is the CPU on the same blocks
/// dequantized (to f16 weights). The GPU keeps the K-quants' two levels (`d · sc` formed in f32,
/// exact), so the weights it multiplies round to the reference's (checked first: before the two
/// levels, the f16 rounding of `d · sc` and `dmin · m` alone moved these logits by up to 0.72,
/// as a min's rounding is relative to the min, not to the weight). What remains is the f16
/// rounding of the weights and of the activations the low-bit kernels read (2^-11 relative) on
/// logits up to ~45.
#[test]
fn tiny_k_quant_models_match_cpu() {
    let _serial = serial_gpu();
    use sieve_cpu::gguf_blocks::BlockType;
    if gpu_or_skip("tiny_k_quant_models_match_cpu").is_none() {
        return;
    }
    let others = |name: &str| {
        if name.contains("v_proj") {
            BlockType::Q5_0
        } else if name.contains("down_proj") {
            BlockType::Q4_1
        } else if name.contains("lm_head") {
            BlockType::Q5_1
        } else {
            BlockType::Q5_K
        }
    };
    type Pick<'a> = &'a dyn Fn(&str) -> BlockType;
    let mixes: [(&str, Pick); 2] = [("Q4_K_M", &q4_k_m_type), ("Q5 mix", &others)];
    for (mi, (mix, pick)) in mixes.into_iter().enumerate() {
        let cfg = config(301, 256, 512, 2, 8, 2, 32);
        let seed = 31 + mi as u64;
        let mut model = tiny_model_of(cfg.clone(), FormatKind::Dense, 0.0, 0.0, seed);
        to_random_gguf_blocks(&mut model, pick, 100 * seed);
        let g = GpuModel::from_model(Gpu::new(0).unwrap(), &model, 64).unwrap();
        let kernels = g.report().kernels.join("; ");
        assert!(
            g.report().kernels.iter().all(|k| k.contains("lowbit/")),
            "{mix}: {kernels}"
        );
        assert!(
            !g.report().notes.iter().any(|n| n.contains("dequantized")),
            "{mix}: {:?}",
            g.report().notes
        );
        drop(g);
        // The reference (exact dequantization), and the weights the GPU multiplies against it.
        let mut reference = tiny_model_of(cfg, FormatKind::Dense, 0.0, 0.0, seed);
        for ((name, blocks), (_, exact)) in
            model.linears_mut().into_iter().zip(reference.linears_mut())
        {
            let values = blocks.format().decode();
            let q = blocks.quant_blocks().unwrap();
            let gpu_weights = sieve_gpu::runner::low_bit_of_blocks(q)
                .unwrap()
                .dequantize();
            // The reference holds f16 weights: each GPU weight rounds to its reference weight
            // (half an f16 step; 2^-25 absolute among the subnormals).
            for (i, (r, g)) in values.data().iter().zip(&gpu_weights).enumerate() {
                let off = (r.to_f32() - g).abs();
                assert!(
                    off <= g.abs() / 2048.0 + 3e-8,
                    "{mix} {name} weight {i}: the GPU multiplies {g}, the reference holds {r}"
                );
            }
            exact
                .replace_format(Box::new(sieve_cpu::dense::FastDense::new(values)))
                .unwrap();
        }
        // Measured with exact weights (H200, 2026-12-04, Q4_K_M mix): p90 0.107, max 0.72 at one
        // of 69 positions. With the f16-rounded scales of before: p90 0.118, max 0.38. The p90
        // stays with the f16 rounding of the reference's weights and of the GPU's activations;
        // the worst position moves with the rounding pattern (these random-block models have
        // near-ties down to 0.003). A wrong scale or code moves every position by whole logits.
        let allowance = 0.15;
        check_gpu_model_against_cpu_with_max(
            &format!("tiny_k_quant_models_match_cpu {mix}"),
            Some(&model),
            &mut reference,
            allowance,
            1.0,
            // Greedy tokens are compared up to the first step whose CPU top-2 margin is within
            // the logit allowance (these random-block models reach 0.003 at step 7 of the
            // Q4_K_M mix).
            allowance,
            THRESHOLD_NUDGE,
        );
    }
}

/// Balanced-CBC models whose values lie on int8 / int4 grids (as `sieve pack --values` makes
/// them) run the low-bit kernels (named in the upload report) with the CPU's tokens.
#[test]
fn tiny_balanced_low_bit_models_match_cpu() {
    let _serial = serial_gpu();
    use sieve_cuda::balanced_lowbit::LowBitValues;
    if gpu_or_skip("tiny_balanced_low_bit_models_match_cpu").is_none() {
        return;
    }
    for (values, label, seed) in [
        (LowBitValues::Int8, "balanced-cbc/int8", 31),
        (LowBitValues::Int4 { group: 32 }, "balanced-cbc/int4", 32),
    ] {
        let mut model = tiny_model(FormatKind::BalancedCbc, 0.5, 0.5, seed);
        for (_, lin) in model.linears_mut() {
            let m = lin.format().decode();
            let snapped = sieve_gpu::synthetic::snap_dense(&m, values).unwrap();
            let f = sieve_cpu::balanced_cbc::FastBalancedCbc::new(
                &BalancedCbc::encode(&snapped).unwrap(),
            );
            lin.replace_format(Box::new(f)).unwrap();
        }
        let g = GpuModel::from_model(Gpu::new(0).unwrap(), &model, 64).unwrap();
        let layer_kernels = &g.report().kernels[..4];
        assert!(
            layer_kernels.iter().all(|k| k.ends_with(label)),
            "{layer_kernels:?}"
        );
        drop(g);
        check_model_against_cpu(
            &format!("tiny_balanced_low_bit_models_match_cpu {}", values.name()),
            &mut model,
            0.05,
        );
    }
}

/// Dense packs whose values lie on int4 grids per row and 128 columns (`sieve pack --format
/// dense --values int4:128`) are found on their grids at upload and multiplied from their
/// 4-bit integers: the tensor-core W4A16 kernel without thresholds, the column-major kernel
/// with them (named in the upload report), with the CPU's tokens and logits (the CPU
/// multiplies the same values as f16).
/// Every layer matrix of `model` snapped onto `values`' grids and stored dense, as a `sieve
/// pack --format dense --values int4:G` pack stores them (the GPU finds the grids at upload).
fn snap_to_int4(model: &mut Model, values: sieve_cuda::balanced_lowbit::LowBitValues) {
    for (_, lin) in model.linears_mut() {
        let m = lin.format().decode();
        let snapped = sieve_gpu::synthetic::snap_dense(&m, values).unwrap();
        lin.replace_format(Box::new(sieve_cpu::dense::FastDense::new(snapped)))
            .unwrap();
    }
}

/// `--activations int8` (`Layouts::int8_activations`): an int4 g128 model's products go
/// through the W4A8 kernels (each token's input quantized to INT8 on the device), its
/// teacher-forced logits stay within the activations' rounding of the W4A16 model's, and its
/// batched prompt pass (32 tokens a W4A8 launch) picks the token its single steps pick.
#[test]
fn tiny_int4_models_with_int8_activations_run_w4a8() {
    let _serial = serial_gpu();
    use sieve_cuda::balanced_lowbit::LowBitValues;
    if gpu_or_skip("tiny_int4_models_with_int8_activations_run_w4a8").is_none() {
        return;
    }
    let mut model = tiny_model(FormatKind::Dense, 0.5, 0.0, 41);
    snap_to_int4(&mut model, LowBitValues::Int4 { group: 128 });
    let layouts = sieve_gpu::matrix::Layouts {
        int8_activations: true,
        ..Default::default()
    };
    let context = 128;
    let mut a8 = GpuModel::from_model_with_layouts(
        Gpu::new(0).unwrap(),
        &model,
        context,
        KvPrecision::F16,
        layouts,
    )
    .unwrap();
    let kernels = &a8.report().kernels[..4];
    assert!(
        kernels.iter().all(|k| k.ends_with("lowbit/w4a8-g128")),
        "{kernels:?}"
    );
    let mut a16 = GpuModel::from_model(Gpu::new(0).unwrap(), &model, context).unwrap();
    let v = model.config().vocab_size;
    let seq: Vec<u32> = (0..40).map(|i| ((i * 13 + 5) % v) as u32).collect();
    let mut l8: Vec<Vec<f32>> = Vec::new();
    let mut l16: Vec<Vec<f32>> = Vec::new();
    a8.logits_all(&seq, |_, l| {
        l8.push(l[..v].to_vec());
        Ok(())
    })
    .unwrap();
    a16.logits_all(&seq, |_, l| {
        l16.push(l[..v].to_vec());
        Ok(())
    })
    .unwrap();
    let mut errors: Vec<f32> = l8
        .iter()
        .zip(&l16)
        .map(|(a, b)| {
            let scale = b.iter().fold(0f32, |m, x| m.max(x.abs())).max(1e-3);
            let d = a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs()));
            assert!(d.is_finite(), "a non-finite logit");
            d / scale
        })
        .collect();
    errors.sort_by(f32::total_cmp);
    let (median, max) = (errors[errors.len() / 2], errors[errors.len() - 1]);
    eprintln!("W4A8 against W4A16 logits, relative to the largest: median {median}, max {max}");
    // INT8 inputs round each input by up to half of max|x| / 127: a few tenths of a percent
    // per product, compounding over the layers.
    assert!(median < 0.03 && max < 0.1, "median {median}, max {max}");
    // The batched prompt pass against the single steps of the same W4A8 model.
    let prompt = &seq[..36];
    let last = &l8[prompt.len() - 1];
    let mut sorted = last.clone();
    sorted.sort_by(|a, b| b.total_cmp(a));
    let token = a8.prefill(prompt).unwrap();
    if sorted[0] - sorted[1] > 0.05 * sorted[0].abs().max(1.0) {
        let best = (0..v).max_by(|&a, &b| last[a].total_cmp(&last[b])).unwrap();
        assert_eq!(token as usize, best, "prompt pass against single steps");
    }
}

#[test]
fn tiny_dense_int4_packs_run_four_bit() {
    let _serial = serial_gpu();
    use sieve_cuda::balanced_lowbit::LowBitValues;
    if gpu_or_skip("tiny_dense_int4_packs_run_four_bit").is_none() {
        return;
    }
    for (dp, label, seed) in [
        (0.0, "lowbit/w4a16-g128", 41),
        (0.5, "lowbit-cols/w4a16-g128", 42),
    ] {
        let mut model = tiny_model(FormatKind::Dense, 0.5, dp, seed);
        snap_to_int4(&mut model, LowBitValues::Int4 { group: 128 });
        let g = GpuModel::from_model(Gpu::new(0).unwrap(), &model, 64).unwrap();
        let layer_kernels = &g.report().kernels[..4];
        assert!(
            layer_kernels.iter().all(|k| k.ends_with(label)),
            "dp {dp}: {layer_kernels:?}"
        );
        drop(g);
        let name = format!("tiny_dense_int4_packs_run_four_bit dp {dp}");
        if dp > 0.0 {
            // The column-major kernel rounds each input to f16 and sums at most 16 products
            // in f16 before f32: two roundings of 2^-11 where the other f16-input kernels
            // have one, so the CPU's own sensitivity is measured at twice the nudge (at one:
            // GPU p90 0.40 against 0.33 allowed, H100 and H200, 2026-12-05).
            check_gpu_model_against_cpu(
                &name,
                None,
                &mut model,
                0.05,
                f32::INFINITY,
                2.0 * F16_ROUNDING,
            );
        } else {
            check_f16_input_model_against_cpu(&name, None, &mut model, dp);
        }
    }
}

/// Values without a GPU kernel in a format are refused before anything is built.
#[test]
fn synthetic_values_are_checked_against_the_format() {
    let _serial = serial_gpu();
    use sieve_gpu::synthetic::SyntheticValues;
    let parse = |s: &str| s.parse::<SyntheticValues>();
    assert_eq!(
        parse("int4:64").unwrap(),
        SyntheticValues::Int4 { group: 64 }
    );
    assert_eq!(
        parse("w4a16").unwrap(),
        SyntheticValues::Int4 { group: 128 }
    );
    assert!(parse("int4:48")
        .unwrap_err()
        .to_string()
        .contains("int4:48"));
    assert!(parse("q4_0").unwrap().check(FormatKind::Dense).is_ok());
    assert!(parse("int4:64").unwrap().check(FormatKind::IeBme).is_ok());
    assert!(parse("int8").unwrap().check(FormatKind::IeBme).is_ok());
    for v in ["f16", "int4:32", "q4_0"] {
        let err = parse(v).unwrap().check(FormatKind::IeBme).unwrap_err();
        assert!(err.to_string().contains("in ie-bme"), "{err}");
    }
    assert!(parse("int4:32")
        .unwrap()
        .check(FormatKind::BalancedCbc)
        .is_ok());
    let err = parse("int4:32")
        .unwrap()
        .check(FormatKind::Dense)
        .unwrap_err();
    assert!(err.to_string().contains("int4:32 values in dense"), "{err}");
    let err = parse("int8")
        .unwrap()
        .check(FormatKind::TiledCbc)
        .unwrap_err();
    assert!(err.to_string().contains("tiled-cbc"), "{err}");
    let err = parse("q8_0")
        .unwrap()
        .check(FormatKind::BalancedCbc)
        .unwrap_err();
    assert!(err.to_string().contains("balanced-cbc"), "{err}");
}

#[test]
fn unsupported_formats_are_refused_by_name() {
    let _serial = serial_gpu();
    let Some(gpu) = gpu_or_skip("unsupported_formats_are_refused_by_name") else {
        return;
    };
    let m = sparse_matrix(64, 64, 0.5, Pattern::Unstructured, 1).unwrap();
    // Slide goes to the GPU encoded (HostMatrix::Slide, with its N), never as values.
    let err = sieve_gpu::matrix::DeviceMatrix::upload(
        &gpu,
        FormatKind::Slide,
        &m,
        None,
        Default::default(),
    )
    .err()
    .unwrap();
    assert!(err.to_string().contains("slide"), "{err}");
    // IE-BME runs from int4 / int8 values only: f16 values are refused by name.
    let err = sieve_gpu::matrix::DeviceMatrix::upload(
        &gpu,
        FormatKind::IeBme,
        &m,
        None,
        Default::default(),
    )
    .err()
    .unwrap();
    assert!(
        err.to_string().contains("ie-bme") && err.to_string().contains("f16"),
        "{err}"
    );
}

/// IE-BME models with int4 and int8 values decode on the GPU from their union bitmaps (named in
/// the upload report) with the CPU's tokens, prompts batched. The GPU
/// model is loaded as a pack loads it (int4: the CPU's integer kernel, whose 8-bit activations
/// are an approximation of their own); the CPU reference runs the same encoded matrices with
/// the f16 column kernel on exact activations.
#[test]
fn tiny_ie_bme_models_match_cpu() {
    let _serial = serial_gpu();
    use sieve_formats::ie_bme::{IeBme, IeBmeOptions, Payload, Reorder};
    if gpu_or_skip("tiny_ie_bme_models_match_cpu").is_none() {
        return;
    }
    for (payload, label, seed) in [
        (Payload::Int4 { group_size: 64 }, "ie-bme/int4", 41),
        (Payload::Int4 { group_size: 128 }, "ie-bme/int4", 42),
        (Payload::Int8 { group_size: 64 }, "ie-bme/int8", 43),
        (Payload::Int8 { group_size: 128 }, "ie-bme/int8", 44),
    ] {
        let opts = IeBmeOptions {
            payload,
            reorder: Reorder::Greedy,
            ..IeBmeOptions::default()
        };
        // No TEAL thresholds here: an input within rounding of its threshold flips between the
        // two sides and the KV cache carries that column to every later position (up to ~0.45
        // on these logits, seed-dependent); the kernel tests hold the thresholded products
        // exact (tests/ie_bme.rs in sieve-cuda).
        let mut packed = tiny_model(FormatKind::Dense, 0.5, 0.0, seed);
        let mut reference = tiny_model(FormatKind::Dense, 0.5, 0.0, seed);
        for ((_, lin), (_, exact)) in packed
            .linears_mut()
            .into_iter()
            .zip(reference.linears_mut())
        {
            let e = IeBme::encode(&lin.format().decode(), &opts).unwrap();
            // As a pack loads it: the CPU's kernel layer over the encoded matrix.
            lin.replace_format(sieve_cpu::format_from_blob(&e.to_bytes()).unwrap())
                .unwrap();
            exact
                .replace_format(Box::new(sieve_cpu::ie_bme::F16IeBme::new(e).unwrap()))
                .unwrap();
        }
        let g = GpuModel::from_model(Gpu::new(0).unwrap(), &packed, 64).unwrap();
        let layer_kernels = &g.report().kernels[..4];
        assert!(
            layer_kernels.iter().all(|k| k.ends_with(label)),
            "{layer_kernels:?}"
        );
        drop(g);
        check_gpu_model_against_cpu(
            &format!("tiny_ie_bme_models_match_cpu {label}"),
            Some(&packed),
            &mut reference,
            0.05,
            0.0,
            THRESHOLD_NUDGE,
        );
    }
}

/// A synthetic model of a real shape builds, calibrates its thresholds to the asked activation
/// sparsity, and decodes (a cut to the smallest shape keeps the test short: the bench runs the
/// full ones).
#[test]
fn synthetic_thresholds_hit_the_activation_sparsity() {
    let _serial = serial_gpu();
    let Some(gpu) = gpu_or_skip("synthetic_thresholds_hit_the_activation_sparsity") else {
        return;
    };
    let opts = sieve_gpu::synthetic::SyntheticOptions {
        sp: 0.5,
        pattern: Pattern::Unstructured,
        dp: 0.5,
        format: FormatKind::TiledCbc,
        values: sieve_gpu::synthetic::SyntheticValues::F16,
        seed: 9,
        calib_tokens: 8,
        layouts: Default::default(),
    };
    let mut m = sieve_gpu::synthetic::build(gpu, "llama2-7b", &opts, 64).unwrap();
    m.prefill(&[1, 2, 3]).unwrap();
    let p = m.profile_step().unwrap();
    let dense_bytes = sieve_gpu::synthetic::dense_weight_bytes(m.config()) as f64;
    let ratio = p.weight_bytes as f64 / dense_bytes;
    eprintln!(
        "synthetic 7B sp 0.5 dp 0.5: {:.3} of the dense bytes per token, profile {p:?}",
        ratio
    );
    // Layers read ~1.125 x 0.5 (values + metadata of half the columns); the dense head ~4%.
    assert!(
        ratio > 0.2 && ratio < 0.45,
        "bytes per token {ratio} of dense"
    );
}

/// Real model files named in `SIEVE_GPU_CHECK_MODELS` (colon-separated: GGUF, safetensors
/// directory or `.sieve` pack, e.g. the cut SmolLM2 of `scripts/cut-gguf.py` and a Tiled-CBC
/// pack of it) through the same check as the tiny models. GGUF blocks are dequantized to f16
/// on the CPU too, so both sides multiply the same weights. Tolerance 0.25 on logits of a
/// ~20-wide spread (f16 KV cache and summation order; the measured error is printed).
#[test]
fn models_from_env_match_cpu() {
    let _serial = serial_gpu();
    let Ok(list) = std::env::var("SIEVE_GPU_CHECK_MODELS") else {
        eprintln!("models_from_env_match_cpu: skipped, SIEVE_GPU_CHECK_MODELS is not set");
        return;
    };
    for path in list.split(':').filter(|p| !p.is_empty()) {
        let (mut model, _tok) =
            sieve_model::packed::load_model_and_tokenizer_with(std::path::Path::new(path), true)
                .unwrap_or_else(|e| panic!("loading {path}: {e}"));
        // Low-bit packs (`sieve pack --values int4:128`, values snapped to a 4-bit grid) run
        // the GPU's 4-bit kernels, which round their masked inputs to f16: the tiny models'
        // allowances for those kernels apply (issue 26: "the decode runner's tokens equal the
        // CPU's on a low-bit pack of the cut default model").
        let g = GpuModel::from_model(Gpu::new(0).unwrap(), &model, 64)
            .unwrap_or_else(|e| panic!("uploading {path}: {e}"));
        let kernels = g.report().kernels.clone();
        drop(g);
        let teal = model
            .linears_mut()
            .iter()
            .any(|(_, l)| l.threshold().is_some());
        let f16_inputs = kernels
            .iter()
            .any(|k| k.contains("lowbit") || k.contains("slide") || k.contains("ie-bme"));
        eprintln!("{path}: kernels {kernels:?}, TEAL {teal}");
        if kernels.iter().any(|k| k.contains("lowbit-cols")) {
            // Two f16 roundings per product (tiny_dense_int4_packs_run_four_bit).
            check_gpu_model_against_cpu(
                path,
                None,
                &mut model,
                0.25,
                f32::INFINITY,
                2.0 * F16_ROUNDING,
            );
        } else if f16_inputs {
            let (near_tie, nudge) = if teal {
                (f32::INFINITY, F16_ROUNDING)
            } else {
                (0.0, THRESHOLD_NUDGE)
            };
            check_gpu_model_against_cpu(path, None, &mut model, 0.25, near_tie, nudge);
        } else {
            check_model_against_cpu(path, &mut model, 0.25);
        }
    }
}

/// What the runner cannot execute is refused by the plan check before any upload (no GPU
/// needed), naming the layer, the op, the projection and the format.
#[test]
fn the_plan_check_refuses_what_the_runner_cannot_execute() {
    let _serial = serial_gpu();
    use sieve_gpu::runner::GPU_CAPABILITIES;
    use sieve_model::plan::Plan;

    let mut model = tiny_model(FormatKind::Dense, 0.0, 0.0, 11);
    assert!(Plan::of(&model).check(&GPU_CAPABILITIES).is_ok());

    // One layer's down_proj in another GPU format: one format per layer on the GPU.
    let down = model.layers()[1].down_proj.format().decode();
    model.layers_mut()[1]
        .down_proj
        .replace_format(Box::new(TiledCbc::encode(&down).unwrap()))
        .unwrap();
    let err = Plan::of(&model)
        .check(&GPU_CAPABILITIES)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("layer 1") && err.contains("mlp.down_proj is TiledCbc"),
        "{err}"
    );

    // Slide in one projection of a dense layer: a GPU format, but one format per layer.
    let mut model = tiny_model(FormatKind::Dense, 0.0, 0.0, 12);
    let gate = model.layers()[0].gate_proj.format().decode();
    let (slide, _) = sieve_formats::slide::encode_or_prune(&gate, Pattern::Unstructured).unwrap();
    model.layers_mut()[0]
        .gate_proj
        .replace_format(Box::new(slide))
        .unwrap();
    let err = Plan::of(&model)
        .check(&GPU_CAPABILITIES)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("layer 0") && err.contains("mlp.gate_proj is Slide"),
        "{err}"
    );
    // The CPU runs both.
    assert!(Plan::of(&model)
        .check(&sieve_model::plan::Capabilities::CPU)
        .is_ok());
    // A model slide throughout (as `sieve pack --format slide` makes it) passes.
    assert!(Plan::of(&tiny_slide_model(4, 0.0, 13))
        .check(&GPU_CAPABILITIES)
        .is_ok());
}

/// The serving path: a pool of KV cache slots, prompts of different lengths prefilled into
/// them out of order, then decode steps interleaving the slots in changing orders. Every
/// slot's logits must equal the CPU's for its own sequence (one CPU cache per sequence), so a
/// slot's cache is never read or written by another's step; a slot prefilled again starts
/// over; bad slots, positions and tokens are refused.
#[test]
fn slot_pool_matches_cpu_per_sequence() {
    let _serial = serial_gpu();
    let name = "slot_pool_matches_cpu_per_sequence";
    let Some(gpu) = gpu_or_skip(name) else { return };
    let model = tiny_model(FormatKind::Dense, 0.0, 0.0, 11);
    let v = model.config().vocab_size;
    let context = 40;
    let mut g = GpuModel::from_model(gpu, &model, context)
        .unwrap()
        .with_slots(3)
        .unwrap();
    assert_eq!(g.slots(), 3);
    // Every slot's graph captured ahead of its first step; a second call captures nothing.
    assert_eq!(g.capture_slots().unwrap(), 3);
    assert_eq!(g.capture_slots().unwrap(), 0, "already captured");
    let prompts: [Vec<u32>; 3] = [vec![5, 17, 42, 99, 250, 7, 8], vec![3], vec![200, 1, 64]];
    let mut caches: Vec<_> = (0..3).map(|_| model.new_cache(context)).collect();
    let mut lens = [0usize; 3];
    let mut next = [0u32; 3];
    let argmax = |l: &[f32]| (0..l.len()).max_by(|&a, &b| l[a].total_cmp(&l[b])).unwrap() as u32;
    let mut worst = 0f32;
    let mut check = |slot: usize, got: &[f32], want: &[f32], what: &str| {
        assert_eq!(got.len(), v, "{what}: logits length");
        let err = max_abs_diff(got, want);
        worst = worst.max(err);
        assert!(err < 0.05, "{what}: slot {slot} logit error {err}");
    };
    for slot in [2usize, 0, 1] {
        let got = g.prefill_slot(slot, &prompts[slot]).unwrap();
        let want = model
            .forward(&prompts[slot], &mut caches[slot], Logits::Last)
            .unwrap();
        check(slot, &got, &want, "prefill");
        lens[slot] = prompts[slot].len();
        next[slot] = argmax(&want);
    }
    let orders = [[0usize, 1, 2], [2, 1, 0], [1, 0, 2], [0, 2, 1]];
    for step in 0..12 {
        for &slot in &orders[step % orders.len()] {
            let got = g.step_slot(slot, lens[slot], next[slot]).unwrap();
            let want = model
                .forward(&[next[slot]], &mut caches[slot], Logits::Last)
                .unwrap();
            check(slot, &got, &want, "decode");
            lens[slot] += 1;
            next[slot] = argmax(&want);
        }
    }
    // Slot 1 starts a new sequence; the others go on untouched.
    let fresh: Vec<u32> = vec![9, 10, 11, 12];
    let mut fresh_cache = model.new_cache(context);
    let got = g.prefill_slot(1, &fresh).unwrap();
    let want = model
        .forward(&fresh, &mut fresh_cache, Logits::Last)
        .unwrap();
    check(1, &got, &want, "prefill again");
    for slot in [0usize, 2] {
        let got = g.step_slot(slot, lens[slot], next[slot]).unwrap();
        let want = model
            .forward(&[next[slot]], &mut caches[slot], Logits::Last)
            .unwrap();
        check(slot, &got, &want, "after another slot's prefill");
    }
    eprintln!("{name}: max logit error {worst}");
    // Refusals, before anything runs.
    assert!(g.step_slot(3, 0, 1).is_err(), "slot outside the pool");
    assert!(
        g.step_slot(0, context, 1).is_err(),
        "position past the context"
    );
    assert!(
        g.step_slot(0, 0, v as u32).is_err(),
        "token outside the vocabulary"
    );
    assert!(g.prefill_slot(0, &[]).is_err(), "empty prompt");
    assert!(
        g.prefill_slot(0, &vec![1; context + 1]).is_err(),
        "prompt longer than the context"
    );
    assert!(
        GpuModel::from_model(Gpu::new(0).unwrap(), &model, context)
            .unwrap()
            .with_slots(0)
            .is_err(),
        "a pool of 0 slots"
    );
}

/// The serving path's batched decode: one step of several sequences in one pass through the
/// layers (`step_slots`) gives each sequence the logits its own single-sequence step gives
/// (a second device model, stepped slot by slot, is the reference; the dense model is checked
/// against the CPU too). Sequences of different lengths, batches of changing membership and
/// order, a batch wider than one launch sequence takes, formats with and without a token-batch
/// path; bad batches are refused before anything runs.
#[test]
fn batched_slot_steps_match_single_steps() {
    let _serial = serial_gpu();
    use sieve_cpu::gguf_blocks::BlockType;
    let name = "batched_slot_steps_match_single_steps";
    if gpu_or_skip(name).is_none() {
        return;
    }
    let context = 48;
    let argmax = |l: &[f32]| (0..l.len()).max_by(|&a, &b| l[a].total_cmp(&l[b])).unwrap() as u32;
    // The greedy token must agree when it leads by more than the two paths' logit tolerance
    // (activations are rounded to f16 on the batched path only).
    let clear_top_by = |l: &[f32], margin: f32| {
        let mut v = l.to_vec();
        v.sort_by(|a, b| b.total_cmp(a));
        v.len() < 2 || v[0] - v[1] > margin
    };
    let dense = tiny_model(FormatKind::Dense, 0.0, 0.0, 31);
    let tiled = tiny_model(FormatKind::TiledCbc, 0.5, 0.0, 32);
    let balanced = tiny_model(FormatKind::BalancedCbc, 0.5, 0.0, 33);
    let slide = tiny_slide_model(4, 0.0, 36);
    let mut q4 = tiny_model_of(
        config(301, 96, 224, 2, 6, 2, 16),
        FormatKind::Dense,
        0.0,
        0.0,
        34,
    );
    to_gguf_blocks(&mut q4, BlockType::Q4_0);
    // IE-BME int4 (its split-K zeroing must hold under graph replays of one bucket).
    let mut ie_bme = tiny_model(FormatKind::Dense, 0.5, 0.0, 35);
    {
        use sieve_formats::ie_bme::{IeBme, IeBmeOptions, Payload, Reorder};
        let opts = IeBmeOptions {
            payload: Payload::Int4 { group_size: 64 },
            reorder: Reorder::Greedy,
            ..IeBmeOptions::default()
        };
        for (_, lin) in ie_bme.linears_mut() {
            let e = IeBme::encode(&lin.format().decode(), &opts).unwrap();
            lin.replace_format(sieve_cpu::format_from_blob(&e.to_bytes()).unwrap())
                .unwrap();
        }
    }
    // A 4-bit pack under TEAL thresholds: its matrices go column-major for single steps, and
    // the batched model keeps their tensor-core layout too (`Layouts::batch`), which its
    // batches take instead of an f16 copy per step. The thresholds are 0 (every nonzero input
    // active): the two layouts' kernels round and sum differently, and under real thresholds
    // an input that lands on the other side of its threshold in one of them changes that
    // step's logits and, through the cache, every later one (measured: 0.28 by the fourth
    // step, H100). That the batch masks each token by its own threshold is a kernel test's
    // (`gpu_activations_to_f16_mask_each_token`, crates/sieve-cuda/tests/lowbit.rs).
    let mut int4_teal = tiny_model(FormatKind::Dense, 0.5, 0.5, 37);
    snap_to_int4(
        &mut int4_teal,
        sieve_cuda::balanced_lowbit::LowBitValues::Int4 { group: 128 },
    );
    for layer in int4_teal.layers_mut() {
        for (_, lin) in layer.linears_mut() {
            lin.set_threshold(Some(0.0)).unwrap();
        }
    }
    // Graphs on: batches rounded up to a bucket with padding rows, a bucket's first step
    // eager and its later ones replayed; off: exactly the batch, eagerly.
    use KvPrecision::{Int8, F16};
    for (label, model, batched, slots, graphs, kv) in [
        ("dense", &dense, true, 5usize, true, F16),
        ("dense, eager", &dense, true, 5, false, F16),
        // 14 slots: batches of ~9 or more, where a Tiled-CBC step runs as one pass.
        ("tiled-cbc", &tiled, true, 14, true, F16),
        ("gguf q4_0", &q4, true, 5, true, F16),
        ("ie-bme int4", &ie_bme, true, 5, true, F16),
        ("slide 6:8", &slide, true, 5, true, F16),
        // Balanced-CBC: batches of 9 or more run as one pass through its f16 copy.
        ("balanced-cbc", &balanced, true, 14, true, F16),
        // A few sequences: one pass through the column formats' union products (Tiled-CBC up
        // to 4 tokens, Balanced-CBC up to 8 in launches of 4; batches of 2 to 4, 4 to 7).
        ("tiled-cbc, union", &tiled, true, 4, true, F16),
        ("balanced-cbc, union", &balanced, true, 7, true, F16),
        ("dense, 70 sequences", &dense, true, 70, true, F16),
        // The 8-bit cache: the many-sequences cache write and attention (slot offsets of the
        // values and of the scales) against each slot's own single step.
        ("dense, int8 KV cache", &dense, true, 5, true, Int8),
        ("int4 teal, batch layout", &int4_teal, true, 5, true, F16),
        // 14 slots: batches of ~9 and more, which run as one pass even if the twin were not
        // counted as multiplied where it lies.
        (
            "int4 teal, batch layout, 14 slots",
            &int4_teal,
            true,
            14,
            true,
            F16,
        ),
    ] {
        let v = model.config().vocab_size;
        let batch_layout = label.starts_with("int4 teal");
        let layouts = sieve_gpu::matrix::Layouts {
            batch: batch_layout,
            ..Default::default()
        };
        let mut many =
            GpuModel::from_model_with_layouts(Gpu::new(0).unwrap(), model, context, kv, layouts)
                .unwrap()
                .with_slots(slots)
                .unwrap();
        if batch_layout {
            // Single steps still take the column-major kernel; the batch layout is extra.
            assert!(
                many.report().kernels[..4]
                    .iter()
                    .all(|k| k.ends_with("lowbit-cols/w4a16-g128")),
                "{label}: {:?}",
                many.report().kernels
            );
        }
        let mut one = GpuModel::from_model_with(Gpu::new(0).unwrap(), model, context, kv)
            .unwrap()
            .with_slots(slots)
            .unwrap();
        if batch_layout {
            // The twin is uploaded (its bytes counted), and the batch of two already runs as
            // one pass: nothing in the step is decoded to f16.
            assert!(
                many.report().weight_bytes > one.report().weight_bytes,
                "{label}: {} against {} bytes",
                many.report().weight_bytes,
                one.report().weight_bytes
            );
            assert_eq!(many.min_batched_sequences(), 2, "{label}");
            assert!(one.min_batched_sequences() > 2, "{label}");
        }
        // The batched pass rounds activations to f16 where single steps do not; with the 8-bit
        // cache a key near a half step of its grid may then be stored one step apart, and under
        // TEAL an activation near its threshold may then fall on the other side (the
        // column-major kernel also sums 16 products in f16).
        let single_tol = if kv == Int8 || batch_layout {
            0.1
        } else {
            0.03
        };
        let clear_top = |l: &[f32]| clear_top_by(l, 2.0 * single_tol);
        many.set_use_graphs(graphs);
        assert_eq!(many.decode_is_batched(), batched, "{label}");
        if label.ends_with("union") {
            // Their batches run as one pass (not one single step per sequence).
            let most = if label.starts_with("tiled") { 4 } else { 8 };
            assert!((2..=most).all(|n| many.batch_pays(n)), "{label}");
        }
        let mut cpu: Vec<_> = (0..slots).map(|_| model.new_cache(context)).collect();
        let mut lens = vec![0usize; slots];
        let mut next = vec![0u32; slots];
        let mut worst = (0f32, 0f32);
        for slot in 0..slots {
            let prompt: Vec<u32> = (0..1 + (slot * 7) % 11)
                .map(|i| ((slot * 37 + i * 11) % v) as u32)
                .collect();
            let a = many.prefill_slot(slot, &prompt).unwrap();
            let b = one.prefill_slot(slot, &prompt).unwrap();
            // Two runs of the same prefill: equal, but for the split-K kernels (IE-BME,
            // SlideSparse, and Tiled-CBC's decode step for the last prompt token), whose blocks
            // add their partial sums with atomics in whatever order they finish (Tiled-CBC:
            // 1.3e-5 apart, H200).
            let split_k_atomics = label.starts_with("ie-bme")
                || label.starts_with("tiled-cbc")
                || label.starts_with("balanced-cbc")
                || label.starts_with("slide");
            // With the batch layout the two prefills take different kernels (the low-bit
            // kernel through the twin against the column-major matrix's f16 copy).
            let prefill_tol = if batch_layout {
                single_tol
            } else if split_k_atomics {
                0.2 * single_tol
            } else {
                1e-5
            };
            let diff = max_abs_diff(&a, &b);
            assert!(
                diff < prefill_tol,
                "{label}: prefill slot {slot} differs by {diff} between two runs"
            );
            if label == "dense" {
                model
                    .forward(&prompt, &mut cpu[slot], Logits::Last)
                    .unwrap();
            }
            lens[slot] = prompt.len();
            next[slot] = argmax(&b);
        }
        for step in 0..12 {
            // Members and order change from step to step (a slot sits out one step in three),
            // except steps 4..8, where every slot runs: the same bucket four times, so its
            // graph is captured and replayed.
            let mut members: Vec<usize> = (0..slots).filter(|s| (s + step) % 3 != 0).collect();
            if (4..8).contains(&step) {
                members = (0..slots).collect();
            }
            if step % 2 == 1 {
                members.reverse();
            }
            let batch: Vec<(usize, usize, u32)> =
                members.iter().map(|&s| (s, lens[s], next[s])).collect();
            // Every third step chooses the tokens on the device instead: by argmax, or (steps
            // 5 and 11) through the batched sampler with greedy settings.
            if step % 3 == 2 {
                let got: Vec<u32> = if step % 6 == 5 {
                    let recent: Vec<Vec<u32>> = batch.iter().map(|&(_, _, t)| vec![t]).collect();
                    let sampling: Vec<(SampleArgs, &[u32])> =
                        recent.iter().map(|r| (greedy(), &r[..])).collect();
                    many.step_slots_sampled(&batch, &sampling).unwrap()
                } else {
                    many.step_slots_argmax(&batch).unwrap()
                }
                .into_iter()
                .map(|t| t.unwrap())
                .collect();
                assert_eq!(got.len(), batch.len(), "{label}: one token per sequence");
                for (i, &(slot, position, token)) in batch.iter().enumerate() {
                    let want = one.step_slot(slot, position, token).unwrap();
                    assert!(
                        got[i] == argmax(&want) || !clear_top(&want),
                        "{label}: step {step}, slot {slot}: token {} against {}",
                        got[i],
                        argmax(&want)
                    );
                    if label == "dense" {
                        model
                            .forward(&[token], &mut cpu[slot], Logits::Last)
                            .unwrap();
                    }
                    lens[slot] += 1;
                    next[slot] = got[i];
                }
                continue;
            }
            let got = many.step_slots(&batch).unwrap();
            assert_eq!(got.len(), batch.len() * v, "{label}: logits rows");
            for (i, &(slot, position, token)) in batch.iter().enumerate() {
                let row = &got[i * v..(i + 1) * v];
                let want = one.step_slot(slot, position, token).unwrap();
                let err = max_abs_diff(row, &want);
                worst.0 = worst.0.max(err);
                assert!(
                    err < single_tol,
                    "{label}: step {step}, slot {slot} at {position}: error {err} against its single step"
                );
                assert!(
                    argmax(row) == argmax(&want) || !clear_top(&want),
                    "{label}: greedy token"
                );
                if label == "dense" {
                    let cpu_row = model
                        .forward(&[token], &mut cpu[slot], Logits::Last)
                        .unwrap();
                    let err = max_abs_diff(row, &cpu_row);
                    worst.1 = worst.1.max(err);
                    assert!(err < 0.05, "{label}: slot {slot} against the CPU: {err}");
                }
                lens[slot] += 1;
                next[slot] = argmax(&want);
            }
        }
        eprintln!(
            "{name}: {label}: max error {} against single steps, {} against the CPU",
            worst.0, worst.1
        );
        // Refusals before anything runs: the state of every slot is unchanged after them.
        let (s0, s1) = (0usize, 1usize);
        let bad = [
            ("slot twice", vec![(s0, lens[s0], 1), (s0, lens[s0], 2)]),
            (
                "slot outside the pool",
                vec![(s0, lens[s0], 1), (slots, 0, 1)],
            ),
            (
                "position past the context",
                vec![(s0, lens[s0], 1), (s1, context, 1)],
            ),
            (
                "token outside the vocabulary",
                vec![(s0, lens[s0], 1), (s1, lens[s1], v as u32)],
            ),
        ];
        for (what, batch) in bad {
            assert!(many.step_slots(&batch).is_err(), "{label}: {what} accepted");
            assert!(
                many.step_slots_argmax(&batch).is_err(),
                "{label}: {what} accepted (argmax)"
            );
        }
        assert!(
            many.step_slots(&[]).unwrap().is_empty(),
            "{label}: empty batch"
        );
    }
}

/// Several sequences' prompt chunks in shared passes (`extend_slots`, the serving engine's
/// prefill of a step's admitted prompts) against each chunk alone (`extend_slot` / `fill_slot`
/// on a second upload of the same model): the logits of every chunk that asks for them, and
/// then one decode step of every slot (what each chunk left in its slot's cache). The chunks
/// cover the cases a pass treats differently: fresh prompts and a continuation (start > 0),
/// chunks with and without logits, one token with logits (run alone, as the decode step), and
/// more rows than one pass holds (two passes at a 128-row pass). Bad chunks are refused before
/// anything runs.
#[test]
fn prompt_chunks_of_several_slots_match_each_alone() {
    let _serial = serial_gpu();
    use sieve_cpu::gguf_blocks::BlockType;
    use sieve_gpu::runner::SlotChunk;
    let name = "prompt_chunks_of_several_slots_match_each_alone";
    if gpu_or_skip(name).is_none() {
        return;
    }
    let dense = tiny_model(FormatKind::Dense, 0.0, 0.0, 41);
    // Head dim 64: spans of 16 rows or more take the tensor-core prompt attention (at rows
    // past the pass's first too), and a continuation after 520 positions its key splits.
    let mut c64 = config(301, 256, 512, 2, 4, 2, 64);
    c64.max_position_embeddings = 1024;
    let dense64 = tiny_model_of(c64, FormatKind::Dense, 0.0, 0.0, 44);
    let tiled = tiny_model(FormatKind::TiledCbc, 0.5, 0.0, 42);
    let mut q4 = tiny_model_of(
        config(301, 96, 224, 2, 6, 2, 16),
        FormatKind::Dense,
        0.0,
        0.0,
        43,
    );
    to_gguf_blocks(&mut q4, BlockType::Q4_0);
    use KvPrecision::{Int8, F16};
    // (label, model, cache, context, positions slot 4 holds before its chunk)
    for (label, model, kv, context, held) in [
        ("dense", &dense, F16, 200, 7),
        ("dense, int8 KV cache", &dense, Int8, 200, 7),
        ("tiled-cbc", &tiled, F16, 200, 7),
        ("gguf q4_0", &q4, F16, 200, 7),
        ("dense, head dim 64", &dense64, F16, 700, 520),
        (
            "dense, head dim 64, int8 KV cache",
            &dense64,
            Int8,
            700,
            520,
        ),
    ] {
        let v = model.config().vocab_size;
        let upload = || {
            let mut g = GpuModel::from_model_with(Gpu::new(0).unwrap(), model, context, kv)
                .unwrap()
                .with_slots(6)
                .unwrap();
            g.set_prefill_chunk_tokens(128).unwrap();
            g
        };
        let (mut many, mut one) = (upload(), upload());
        let tokens = |slot: usize, n: usize| -> Vec<u32> {
            (0..n)
                .map(|i| ((slot * 53 + i * 17 + 3) % v) as u32)
                .collect()
        };
        // Slot 4 continues a prompt already in its cache.
        let head = tokens(40, held);
        many.prefill_slot(4, &head).unwrap();
        one.prefill_slot(4, &head).unwrap();
        // (slot, start, tokens, logits): 20 + 5 + 1 + 90 + 17 + 2 rows, the 1-token chunk
        // alone. Dense: two passes of at most 128 rows (slot 3's 90 rows from row 25 of the
        // first); Tiled-CBC and Q4_0, whose products change kernel at 65 rows: the chunks
        // under 65 rows in one pass of 44, slot 3 in its own.
        let plan: Vec<(usize, usize, Vec<u32>, bool)> = vec![
            (0, 0, tokens(0, 20), true),
            (1, 0, tokens(1, 5), true),
            (2, 0, tokens(2, 1), true),
            (3, 0, tokens(3, 90), false),
            (4, head.len(), tokens(4, 17), true),
            (5, 0, tokens(5, 2), true),
        ];
        let chunks: Vec<SlotChunk<'_>> = plan
            .iter()
            .map(|(slot, start, t, logits)| SlotChunk {
                slot: *slot,
                start: *start,
                tokens: t,
                logits: *logits,
            })
            .collect();
        // Refused before anything runs (the model's state is checked below, by the steps).
        let mut twice = chunks.clone();
        twice[1].slot = 0;
        let mut empty = chunks.clone();
        empty[1].tokens = &[];
        let mut past = chunks.clone();
        past[3].start = context - 10;
        let outside = [v as u32];
        let mut bad_token = chunks.clone();
        bad_token[5].tokens = &outside;
        for (what, bad) in [
            ("a slot twice", twice),
            ("an empty chunk", empty),
            ("a chunk past the context", past),
            ("a token outside the vocabulary", bad_token),
        ] {
            assert!(many.extend_slots(&bad).is_err(), "{label}: {what} accepted");
        }
        let got = many.extend_slots(&chunks).unwrap();
        assert_eq!(got.len(), chunks.len(), "{label}");
        // Only the products see more rows in a shared pass, on the kernels each chunk takes
        // alone: cuBLAS may sum a GEMM of another token count in another order, which can
        // move an activation's f16 rounding by one step (a cached key's 8-bit one too), as in
        // the batched decode test. A chunk in the wrong slot or at the wrong positions would
        // be off by the logits' own size (about 1).
        let tol = if kv == Int8 { 0.1 } else { 0.03 };
        let mut worst = 0f32;
        let mut lens = [0usize; 6];
        let mut next = [0u32; 6];
        for (c, g) in chunks.iter().zip(&got) {
            lens[c.slot] = c.start + c.tokens.len();
            if !c.logits {
                assert!(g.is_none(), "{label}: slot {} got logits unasked", c.slot);
                one.fill_slot(c.slot, c.start, c.tokens).unwrap();
                next[c.slot] = 1;
                continue;
            }
            let want = one.extend_slot(c.slot, c.start, c.tokens).unwrap();
            let g = g.as_ref().expect("logits asked");
            let err = max_abs_diff(g, &want);
            worst = worst.max(err);
            assert!(
                err < tol,
                "{label}: slot {} ({} tokens from {}): error {err} against the chunk alone",
                c.slot,
                c.tokens.len(),
                c.start
            );
            next[c.slot] = (0..v).max_by(|&a, &b| want[a].total_cmp(&want[b])).unwrap() as u32;
        }
        // What the chunks left in each slot's cache: one step of every slot, both models.
        for slot in 0..6 {
            let a = many.step_slot(slot, lens[slot], next[slot]).unwrap();
            let b = one.step_slot(slot, lens[slot], next[slot]).unwrap();
            let err = max_abs_diff(&a, &b);
            worst = worst.max(err);
            assert!(err < tol, "{label}: slot {slot}'s next step: error {err}");
        }
        eprintln!("{name}: {label}: max error {worst}");
    }
}

/// The batched greedy choice (`argmax_rows`) equals the CPU sampler's greedy rule on every
/// row: random rows, ties at the top (lowest id wins, in any thread's stripe), -inf entries,
/// a row of -inf only, rows with NaN or +inf; vocabularies around the block size.
#[test]
fn argmax_rows_match_the_cpu_greedy_rule() {
    let _serial = serial_gpu();
    let Some(gpu) = gpu_or_skip("argmax_rows_match_the_cpu_greedy_rule") else {
        return;
    };
    let mut rng = Rng(77);
    for &v in &[1usize, 31, 1023, 1024, 1025, 32000, 49152] {
        let mut rows: Vec<Vec<f32>> = (0..6).map(|_| rng.vec(v, 8.0)).collect();
        // A tie at the top between a late and an early id (different threads and warps).
        let top = 100.0;
        rows[1][v - 1] = top;
        rows[1][v / 2] = top;
        // -inf entries, the top among them.
        for i in (0..v).step_by(3) {
            rows[2][i] = f32::NEG_INFINITY;
        }
        rows[3] = vec![f32::NEG_INFINITY; v];
        rows[4][v / 3] = f32::NAN;
        rows[5][v - 1] = f32::INFINITY;
        let flat: Vec<f32> = rows.concat();
        let logits = gpu.upload(&flat).unwrap();
        let out = gpu.upload(&vec![i32::MIN; rows.len()]).unwrap();
        sampling::argmax_rows(
            &gpu,
            dev_ptr(&gpu, &logits),
            v,
            rows.len(),
            dev_ptr(&gpu, &out),
        )
        .unwrap();
        let got = gpu.download(&out).unwrap();
        let want: Vec<i32> = rows
            .iter()
            .map(|r| sampling::reference::argmax_row(r))
            .collect();
        assert_eq!(got, want, "vocabulary {v}");
        // The reference itself: what the CPU sampler picks for the rows it can answer (row 2
        // of a one-word vocabulary is all -inf: the sampler refuses it, as it should).
        for (r, &w) in rows.iter().zip(&want).take(3).filter(|(_, &w)| w >= 0) {
            let mut s = sieve_model::sampling::Sampler::new(
                sieve_model::sampling::SamplingParams::greedy(),
            )
            .unwrap();
            assert_eq!(s.sample(r, &[]).unwrap() as i32, w, "vocabulary {v}");
        }
        assert_eq!(want[3], sampling::ARGMAX_ALL_NEG_INF);
        assert_eq!(want[4], sampling::ARGMAX_NOT_FINITE);
        assert_eq!(want[5], sampling::ARGMAX_NOT_FINITE);
        if v > 1 {
            assert_eq!(want[1], (v / 2) as i32, "the lowest tied id");
        }
    }
}

/// The batched sampler (`sample_rows`: one row per sequence, each with its own settings and
/// penalty window) draws what `sample_token` draws for each row alone: greedy, temperature,
/// top-k, top-p, a penalty over a window (histories longer than it too), different seeds and
/// positions; a row of -inf only comes back as -1, one with a NaN as -2.
#[test]
fn sample_rows_draw_what_sample_token_draws() {
    let _serial = serial_gpu();
    let Some(gpu) = gpu_or_skip("sample_rows_draw_what_sample_token_draws") else {
        return;
    };
    use sieve_cuda::sampling::{SampleRowArgs, SAMPLE_ALL_NEG_INF, SAMPLE_NOT_FINITE};
    let mut rng = Rng(5);
    let v = 3001;
    let window = 64;
    let settings = [
        greedy(),
        SampleArgs {
            temperature: 0.7,
            top_k: 0,
            top_p: 1.0,
            repetition_penalty: 1.0,
            window,
            seed: 1,
        },
        SampleArgs {
            temperature: 1.0,
            top_k: 40,
            top_p: 1.0,
            repetition_penalty: 1.3,
            window,
            seed: 2,
        },
        SampleArgs {
            temperature: 0.9,
            top_k: 0,
            top_p: 0.8,
            repetition_penalty: 1.1,
            window,
            seed: 3,
        },
        SampleArgs {
            temperature: 1.2,
            top_k: 5,
            top_p: 0.5,
            repetition_penalty: 0.9,
            window,
            seed: u64::MAX,
        },
    ];
    for round in 0..4 {
        let n = settings.len() + 2;
        let mut rows: Vec<Vec<f32>> = (0..n).map(|_| rng.vec(v, 6.0)).collect();
        rows[n - 2] = vec![f32::NEG_INFINITY; v];
        rows[n - 1][v / 2] = f32::NAN;
        // Each row's history: a few tokens, some repeated, the last at its position.
        let histories: Vec<Vec<i32>> = (0..n)
            .map(|r| {
                (0..10 + 29 * r + round)
                    .map(|i| ((i * 37 + r * 11) % 50) as i32)
                    .collect()
            })
            .collect();
        let mut want = Vec::new();
        for (r, args) in settings.iter().enumerate() {
            want.push(run_sampler(&gpu, &rows[r], args, &histories[r]).0);
        }
        let mut args = Vec::new();
        let mut recent = vec![0i32; n * window];
        for r in 0..n {
            let a = settings.get(r).copied().unwrap_or_else(greedy);
            let h = &histories[r];
            let tail = &h[h.len().saturating_sub(window)..];
            recent[r * window..r * window + tail.len()].copy_from_slice(tail);
            args.push(SampleRowArgs::new(&a, h.len() - 1, tail.len()).unwrap());
        }
        let l = gpu.upload(&rows.concat()).unwrap();
        let a = gpu.upload(&args).unwrap();
        let rc = gpu.upload(&recent).unwrap();
        let out = gpu.upload(&vec![i32::MIN; n]).unwrap();
        sampling::sample_rows(
            &gpu,
            dev_ptr(&gpu, &l),
            v,
            dev_ptr(&gpu, &a),
            dev_ptr(&gpu, &rc),
            window,
            n,
            dev_ptr(&gpu, &out),
        )
        .unwrap();
        let got = gpu.download(&out).unwrap();
        assert_eq!(&got[..n - 2], &want[..], "round {round}");
        assert_eq!(got[n - 2], SAMPLE_ALL_NEG_INF, "a row of -inf only");
        assert_eq!(got[n - 1], SAMPLE_NOT_FINITE, "a row with a NaN");
    }
}

/// The persistent step (one kernel for the whole step) against the graph step of the same
/// upload: the same greedy tokens, teacher-forced logits within a small tolerance (the two sum
/// in different orders), at head dims 64 and 128, grouped and plain attention, with the
/// prompt's positions from the batched prefill and the decode's from the persistent kernel;
/// its trace covers every stage; formats it does not run are refused by name.
#[test]
fn persistent_step_matches_the_graph_step() {
    let _serial = serial_gpu();
    let name = "persistent_step_matches_the_graph_step";
    if gpu_or_skip(name).is_none() {
        return;
    }
    for (c, seed) in [
        (config(301, 256, 512, 2, 4, 2, 64), 11),
        (config(257, 320, 704, 3, 4, 1, 128), 12),
        (config(300, 192, 384, 2, 3, 3, 64), 13),
    ] {
        let model = tiny_model_of(c.clone(), FormatKind::Dense, 0.0, 0.0, seed);
        let prompt: Vec<u32> = vec![1, 17, 42, 99, 250];
        let steps = 40;
        let mut g =
            GpuModel::from_model(Gpu::new(0).unwrap(), &model, prompt.len() + steps + 1).unwrap();
        let want_tokens = gpu_tokens_after(&mut g, &prompt, steps);
        let mut seq = prompt.clone();
        seq.extend(&want_tokens);
        let v = c.vocab_size;
        let mut want = Vec::new();
        g.logits_all(&seq, |_, l| {
            want.extend_from_slice(l);
            Ok(())
        })
        .unwrap();

        assert!(g.persistent_unsupported().is_none(), "{name}");
        g.set_step_mode(sieve_gpu::runner::StepMode::Persistent)
            .unwrap();
        assert_eq!(g.report().launches_per_step, 2);
        let tokens = gpu_tokens_after(&mut g, &prompt, steps);
        assert_eq!(
            tokens, want_tokens,
            "{name}: greedy tokens, hd {}",
            c.head_dim
        );
        let mut got = Vec::new();
        g.logits_all(&seq, |_, l| {
            got.extend_from_slice(l);
            Ok(())
        })
        .unwrap();
        let errors = position_errors(&got, &want, v);
        let worst = errors[errors.len() - 1];
        let spread = want.iter().fold(0f32, |m, x| m.max(x.abs()));
        eprintln!(
            "{name}: hd {} g {}: max logit difference {worst} over {} positions (logits up to {spread})",
            c.head_dim,
            c.num_heads / c.num_kv_heads,
            seq.len()
        );
        assert!(worst < 2e-3 * spread.max(1.0), "{name}: {worst}");

        // One traced step: every stage of every block stamped, in order.
        g.set_persistent_trace(true);
        g.prefill(&prompt).unwrap();
        g.next_token().unwrap();
        let trace = g.last_trace().unwrap().expect("a traced step");
        assert_eq!(trace.stages.len(), 5 * c.num_layers + 1);
        assert!(trace.stamps.chunks(2).all(|s| s[0] > 0 && s[1] >= s[0]));
        // The step after the prompt's first token attends over the prompt and that token.
        assert_eq!(
            trace.positions,
            prompt.len() + 1,
            "{name}: positions the step read"
        );
        let summary = trace.summary();
        assert!(summary.step_us > 0.0, "{summary:?}");
        assert_eq!(summary.work_us.len(), 6, "{summary:?}");
        eprintln!("{name}: {summary:?}");
        g.set_persistent_trace(false);

        // Back to the graph step: the same tokens again.
        g.set_step_mode(sieve_gpu::runner::StepMode::Graph).unwrap();
        let again = gpu_tokens_after(&mut g, &prompt, 8);
        assert_eq!(
            again[..],
            want_tokens[..8],
            "{name}: graph after persistent"
        );
    }

    // A format the persistent kernel does not run, and a head dim it does not take.
    let sparse = tiny_model_of(
        config(301, 256, 512, 2, 4, 2, 64),
        FormatKind::RlcCsc,
        0.5,
        0.5,
        3,
    );
    let mut g = GpuModel::from_model(Gpu::new(0).unwrap(), &sparse, 32).unwrap();
    let err = g
        .set_step_mode(sieve_gpu::runner::StepMode::Persistent)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("rlc-csc") && err.contains("takes dense f16 rows, Tiled-CBC and Balanced-CBC"),
        "{err}"
    );
    assert_eq!(g.step_mode(), sieve_gpu::runner::StepMode::Graph);
    let odd = tiny_model(FormatKind::Dense, 0.0, 0.0, 4);
    let mut g = GpuModel::from_model(Gpu::new(0).unwrap(), &odd, 32).unwrap();
    let err = g
        .set_step_mode(sieve_gpu::runner::StepMode::Persistent)
        .unwrap_err()
        .to_string();
    assert!(err.contains("head dim 16"), "{err}");
}

/// `--step auto`: `choose_step` times both steps on a model the persistent one can run, keeps
/// the faster, and leaves a clean sequence (the tokens after it equal the graph step's); on a
/// model it cannot run (an 8-bit KV cache) it keeps the graph step and says why.
#[test]
fn persistent_or_graph_auto_times_both_and_keeps_the_faster() {
    use sieve_gpu::runner::StepMode;
    let _serial = serial_gpu();
    let name = "persistent_or_graph_auto_times_both_and_keeps_the_faster";
    if gpu_or_skip(name).is_none() {
        return;
    }
    let c = config(301, 256, 512, 2, 4, 2, 64);
    let model = tiny_model_of(c, FormatKind::Dense, 0.0, 0.0, 11);
    let prompt: Vec<u32> = vec![1, 17, 42, 99, 250];
    let steps = 24;
    let mut g = GpuModel::from_model(Gpu::new(0).unwrap(), &model, 64).unwrap();
    let want = gpu_tokens_after(&mut g, &prompt, steps);
    let choice = g.choose_step(16).unwrap();
    eprintln!("{name}: {}", choice.describe());
    let (graph, persistent) = (choice.graph_us.unwrap(), choice.persistent_us.unwrap());
    assert!(graph > 0.0 && persistent > 0.0, "{name}: {choice:?}");
    let faster = if persistent < graph {
        StepMode::Persistent
    } else {
        StepMode::Graph
    };
    assert_eq!((choice.mode, g.step_mode()), (faster, faster), "{name}");
    assert_eq!(gpu_tokens_after(&mut g, &prompt, steps), want, "{name}");

    let mut int8 = tiny_model_of(
        config(301, 256, 512, 2, 4, 2, 64),
        FormatKind::Dense,
        0.0,
        0.0,
        11,
    );
    int8.set_kv_precision(sieve_model::llama::KvPrecision::Int8);
    let mut g = GpuModel::from_model(Gpu::new(0).unwrap(), &int8, 64).unwrap();
    let choice = g.choose_step(16).unwrap();
    assert_eq!(
        (choice.mode, choice.graph_us),
        (StepMode::Graph, None),
        "{name}"
    );
    assert!(
        choice
            .why_graph
            .as_deref()
            .is_some_and(|w| w.contains("8-bit")),
        "{name}: {choice:?}"
    );
}

/// The persistent step of Tiled-CBC models with TEAL thresholds (every product, the head
/// included, split-K with atomics; attention rotating and caching the raw q|k|v sums)
/// against the graph step of the same upload: greedy tokens equal, teacher-forced logits
/// within the dense test's tolerance (both sum in orders the atomics choose); the trace
/// counts the bytes the sparse stages read, fewer than their dense f16 weights.
/// The persistent step of `g` against its graph step: the same greedy tokens for `steps`
/// steps after `prompt`, and teacher-forced logits of that sequence within 2e-3 of the logit
/// spread. Leaves `g` in persistent mode; returns the greedy tokens.
fn persistent_step_agrees(
    name: &str,
    label: &str,
    g: &mut GpuModel,
    prompt: &[u32],
    steps: usize,
) -> Vec<u32> {
    let want_tokens = gpu_tokens_after(g, prompt, steps);
    let mut seq = prompt.to_vec();
    seq.extend(&want_tokens);
    let teacher_forced = |g: &mut GpuModel| {
        let mut all = Vec::new();
        g.logits_all(&seq, |_, l| {
            all.extend_from_slice(l);
            Ok(())
        })
        .unwrap();
        all
    };
    let want = teacher_forced(g);
    assert_eq!(g.persistent_unsupported(), None, "{name}");
    g.set_step_mode(sieve_gpu::runner::StepMode::Persistent)
        .unwrap();
    let tokens = gpu_tokens_after(g, prompt, steps);
    assert_eq!(tokens, want_tokens, "{name}: greedy tokens, {label}");
    let got = teacher_forced(g);
    let errors = position_errors(&got, &want, g.config().vocab_size);
    let worst = errors[errors.len() - 1];
    let spread = want.iter().fold(0f32, |m, x| m.max(x.abs()));
    eprintln!(
        "{name}: {label}: max logit difference {worst} over {} positions (logits up to {spread})",
        seq.len()
    );
    assert!(worst < 2e-3 * spread.max(1.0), "{name}: {label}: {worst}");
    want_tokens
}

/// One traced persistent step of a sparse model after `prompt`: checks its stages (five a
/// layer: attention rotates and caches the raw q|k|v sums; and the head) and stamps, and
/// returns the bytes each task class read (by class name).
fn traced_sparse_step_bytes(
    name: &str,
    g: &mut GpuModel,
    prompt: &[u32],
    layers: usize,
) -> impl Fn(&str) -> u64 {
    g.set_persistent_trace(true);
    g.prefill(prompt).unwrap();
    g.next_token().unwrap();
    let trace = g.last_trace().unwrap().expect("a traced step");
    assert_eq!(trace.stages.len(), 5 * layers + 1);
    assert!(trace.stamps.chunks(2).all(|s| s[0] > 0 && s[1] >= s[0]));
    let summary = trace.summary();
    eprintln!("{name}: {summary:?}");
    move |class: &str| {
        summary
            .read_bytes
            .iter()
            .find(|(k, _)| *k == class)
            .map(|&(_, b)| b)
            .unwrap()
    }
}

#[test]
fn persistent_tiled_cbc_step_matches_the_graph_step() {
    let _serial = serial_gpu();
    let name = "persistent_tiled_cbc_step_matches_the_graph_step";
    if gpu_or_skip(name).is_none() {
        return;
    }
    // Under compute-sanitizer (SIEVE_SANITIZE_SMALL=1): the first model, 6 steps.
    let small = std::env::var("SIEVE_SANITIZE_SMALL").as_deref() == Ok("1");
    let models = [
        (config(301, 256, 512, 2, 4, 2, 64), 0.5, 0.5, 21),
        (config(257, 320, 704, 3, 4, 1, 128), 0.7, 0.7, 22),
        (config(300, 192, 1104, 2, 3, 3, 64), 0.5, 0.0, 23),
    ];
    for (c, sp, dp, seed) in models.into_iter().take(if small { 1 } else { 3 }) {
        let model = tiny_model_of(c.clone(), FormatKind::TiledCbc, sp, dp, seed);
        let prompt: Vec<u32> = vec![1, 17, 42, 99, 250];
        let steps = if small { 6 } else { 32 };
        let mut g =
            GpuModel::from_model(Gpu::new(0).unwrap(), &model, prompt.len() + steps + 1).unwrap();
        let label = format!("sp {sp} dp {dp} hd {}", c.head_dim);
        let want_tokens = persistent_step_agrees(name, &label, &mut g, &prompt, steps);

        let bytes = traced_sparse_step_bytes(name, &mut g, &prompt, c.num_layers);
        // Every sparse product read something, and less than its dense f16 weights (at sp
        // 0.5 the values alone are half; the bitmaps add 1/16 of the dense bytes). A class
        // sums its stages over the layers.
        let (d, i, layers) = (
            c.hidden_size as u64,
            c.intermediate_size as u64,
            c.num_layers as u64,
        );
        for (class, dense) in [
            ("o", 2 * d * d * layers),
            ("down", 2 * d * i * layers),
            ("norm+gate|up+swiglu", 4 * d * i * layers),
        ] {
            let b = bytes(class);
            assert!(
                b > 0 && b < dense * 7 / 10,
                "{name}: {class} read {b} of {dense} dense bytes"
            );
        }
        g.set_persistent_trace(false);
        g.set_step_mode(sieve_gpu::runner::StepMode::Graph).unwrap();
        // Six tokens: the sanitizer's run makes only six.
        let again = gpu_tokens_after(&mut g, &prompt, 6);
        assert_eq!(
            again[..],
            want_tokens[..6],
            "{name}: graph after persistent"
        );
    }
}

/// The persistent step of Balanced-CBC models (every product, the head included, split-K with
/// atomics like Tiled-CBC's; attention rotating and caching the raw q|k|v sums) against the
/// graph step of the same upload: greedy tokens equal, teacher-forced logits within the dense
/// test's tolerance. The models cover both device layouts at odd and even N (8 and 5: the index
/// layout; 11 and 16: the mask chain), partial last row tiles, TEAL thresholds and none; the
/// trace counts the blocks of the active columns, at most every column's.
#[test]
fn persistent_balanced_cbc_step_matches_the_graph_step() {
    let _serial = serial_gpu();
    let name = "persistent_balanced_cbc_step_matches_the_graph_step";
    if gpu_or_skip(name).is_none() {
        return;
    }
    // The stage is behind a switch until this test has passed on a GPU
    // (src/runner/persistent.rs, BCBC_SWITCH): without it the step is refused, by name.
    if std::env::var("SIEVE_PERSISTENT_BCBC").as_deref() != Ok("1") {
        let c = config(301, 256, 512, 2, 4, 2, 64);
        let model = tiny_model_of(c, FormatKind::BalancedCbc, 0.5, 0.5, 41);
        let g = GpuModel::from_model(Gpu::new(0).unwrap(), &model, 16).unwrap();
        let why = g.persistent_unsupported().unwrap_or_default();
        assert!(why.contains("SIEVE_PERSISTENT_BCBC=1"), "{name}: {why}");
        eprintln!("{name}: the stage is switched off ({why}); SIEVE_PERSISTENT_BCBC=1 runs it");
        return;
    }
    // Under compute-sanitizer (SIEVE_SANITIZE_SMALL=1): the first model, 6 steps.
    let small = std::env::var("SIEVE_SANITIZE_SMALL").as_deref() == Ok("1");
    let models = [
        (config(301, 256, 512, 2, 4, 2, 64), 0.5, 0.5, 41),
        (config(257, 320, 704, 3, 4, 1, 128), 0.3, 0.5, 42),
        (config(300, 192, 1104, 2, 3, 3, 64), 0.7, 0.0, 43),
        (config(301, 256, 512, 2, 4, 2, 64), 0.0, 0.5, 44),
    ];
    for (c, sp, dp, seed) in models.into_iter().take(if small { 1 } else { 4 }) {
        let model = tiny_model_of(c.clone(), FormatKind::BalancedCbc, sp, dp, seed);
        let n = slots_for_sparsity(sp).unwrap();
        let layout = match sieve_cuda::balanced_cbc::BcbcKernel::for_slots(n) {
            sieve_cuda::balanced_cbc::BcbcKernel::Idx => "idx",
            sieve_cuda::balanced_cbc::BcbcKernel::Chain => "chain",
        };
        let prompt: Vec<u32> = vec![1, 17, 42, 99, 250];
        let steps = if small { 6 } else { 32 };
        let mut g =
            GpuModel::from_model(Gpu::new(0).unwrap(), &model, prompt.len() + steps + 1).unwrap();
        // Every group and the head are Balanced-CBC (f16 values, not the low-bit kind; the
        // upload's layout for N is `layout`).
        let kernels = g.report().kernels.join("; ");
        assert!(
            g.report()
                .kernels
                .iter()
                .all(|k| k.ends_with(": balanced-cbc")),
            "{name}: sp {sp}: {kernels}"
        );
        let label = format!("sp {sp} (N {n}, {layout}) dp {dp} hd {}", c.head_dim);
        let want_tokens = persistent_step_agrees(name, &label, &mut g, &prompt, steps);

        let bytes = traced_sparse_step_bytes(name, &mut g, &prompt, c.num_layers);
        // A column's blocks over every row tile (the layout of GpuBalancedCbc's upload): full
        // tiles, then the last tile's stored lanes, rounded up to 16 bytes.
        let column_bytes = |rows: usize| -> u64 {
            let tiles = rows.div_ceil(512);
            let last = (rows - 512 * (tiles - 1)).div_ceil(16);
            let block = |lanes: usize| {
                if layout == "idx" {
                    let at = (2 * n * lanes).div_ceil(4) * 4;
                    (at + 4 * n.div_ceil(8) * lanes).div_ceil(16) * 16
                } else {
                    (lanes * (2 * n + 2)).div_ceil(16) * 16
                }
            };
            ((tiles - 1) * block(32) + block(last)) as u64
        };
        // Every sparse product read something, at most every column's blocks, and with a
        // threshold fewer. A class sums its stages over the layers.
        let (d, i, q, layers) = (
            c.hidden_size,
            c.intermediate_size,
            c.num_heads * c.head_dim,
            c.num_layers as u64,
        );
        for (class, all) in [
            ("o", q as u64 * column_bytes(d) * layers),
            ("down", i as u64 * column_bytes(d) * layers),
            (
                "norm+gate|up+swiglu",
                d as u64 * column_bytes(2 * i) * layers,
            ),
        ] {
            let b = bytes(class);
            assert!(
                b > 0 && b <= all && (dp == 0.0 || b < all),
                "{name}: {class} read {b} of {all} bytes (every column)"
            );
        }
        g.set_persistent_trace(false);
        g.set_step_mode(sieve_gpu::runner::StepMode::Graph).unwrap();
        // Six tokens: the sanitizer's run makes only six.
        let again = gpu_tokens_after(&mut g, &prompt, 6);
        assert_eq!(
            again[..],
            want_tokens[..6],
            "{name}: graph after persistent"
        );
    }
}

/// `Layouts::slide_library` (`SIEVE_SLIDE_PROMPT=cusparselt`): a slide 6:8 model's prompt
/// passes of 512 tokens or more multiply on cuSPARSELt (its plans made at the first pass of
/// each padded size) and give the CPU's greedy tokens, as the f16 copy does.
#[test]
fn slide_prompts_on_cusparselt_match_cpu() {
    let _serial = serial_gpu();
    let name = "slide_prompts_on_cusparselt_match_cpu";
    let Some(gpu) = gpu_or_skip(name) else {
        return;
    };
    if let Err(e) = sieve_cuda::cusparselt::CusparseLt::load(&gpu) {
        if std::env::var("SIEVE_REQUIRE_GPU").as_deref() == Ok("1") {
            panic!("{name}: SIEVE_REQUIRE_GPU=1 but cuSPARSELt did not load: {e}");
        }
        eprintln!("{name}: skipped, no cuSPARSELt: {e}");
        return;
    }
    drop(gpu);
    use sieve_formats::slide::{prune_to_pattern, Slide, SlideOptions};
    let mut cfg = config(301, 96, 224, 2, 6, 2, 16);
    cfg.max_position_embeddings = 1024;
    let seed = 71;
    let mut model = tiny_model_of(cfg.clone(), FormatKind::Dense, 0.0, 0.0, seed);
    for (_, lin) in model.linears_mut() {
        let pruned = prune_to_pattern(&lin.format().decode(), 4).unwrap();
        let s = Slide::encode(&pruned, &SlideOptions { n: 4 }).unwrap();
        lin.replace_format(sieve_cpu::format_from_blob(&s.to_bytes()).unwrap())
            .unwrap();
    }
    let mut reference = tiny_model_of(cfg, FormatKind::Dense, 0.0, 0.0, seed);
    for ((_, slide), (_, dense)) in model.linears_mut().into_iter().zip(reference.linears_mut()) {
        let values = slide.format().decode();
        dense
            .replace_format(Box::new(sieve_cpu::dense::FastDense::new(values)))
            .unwrap();
    }
    let layouts = sieve_gpu::matrix::Layouts {
        slide_library: true,
        ..Default::default()
    };
    let v = model.config().vocab_size;
    let steps = 6;
    let mut compared_total = 0;
    for (p, len) in [(0usize, 520usize), (1, 700)] {
        let prompt: Vec<u32> = (0..len)
            .map(|i| ((i * (31 + 2 * p) + 7 + p) % v) as u32)
            .collect();
        let (cpu, compared, _) = cpu_greedy(&mut reference, &prompt, steps, 0.1);
        let mut g = GpuModel::from_model_with_layouts(
            Gpu::new(0).unwrap(),
            &model,
            len + steps + 1,
            KvPrecision::F16,
            layouts,
        )
        .unwrap();
        assert!(g.prefill_is_batched(), "{name}");
        let gpu = gpu_tokens_after(&mut g, &prompt, steps);
        assert_eq!(
            gpu[..compared],
            cpu[..compared],
            "{name}: tokens after a {len}-token prompt"
        );
        compared_total += compared;
    }
    assert!(
        compared_total > 0,
        "{name}: every first step was a near tie"
    );
}

/// `Layouts::prompt8` (`--prompt-precision int8|fp8`): a dense model's and a slide 6:8 model's
/// prompt passes of 512 tokens or more multiply 8-bit copies (cuBLASLt for dense, cuSPARSELt
/// for slide) with each token's input quantized. Their logits after the prompt must differ from
/// the f16 pass's (the 8-bit path ran) and stay within a stated relative RMS error of the
/// CPU's f32 logits (what 8-bit weights and inputs cost on a random model: INT8 `max / 127`
/// per row and token, e4m3 three mantissa bits).
#[test]
fn eight_bit_prompts_stay_near_the_cpu() {
    let _serial = serial_gpu();
    let name = "eight_bit_prompts_stay_near_the_cpu";
    let Some(gpu) = gpu_or_skip(name) else {
        return;
    };
    let library = sieve_cuda::cusparselt::CusparseLt::load(&gpu).is_ok();
    if !library && std::env::var("SIEVE_REQUIRE_GPU").as_deref() == Ok("1") {
        panic!("{name}: SIEVE_REQUIRE_GPU=1 but cuSPARSELt did not load");
    }
    drop(gpu);
    use sieve_cuda::cusparselt::LtPrecision;
    use sieve_formats::slide::{prune_to_pattern, Slide, SlideOptions};
    let mut cfg = config(301, 96, 224, 2, 6, 2, 16);
    cfg.max_position_embeddings = 1024;
    let seed = 83;
    let dense = tiny_model_of(cfg.clone(), FormatKind::Dense, 0.0, 0.0, seed);
    let mut slide = tiny_model_of(cfg.clone(), FormatKind::Dense, 0.0, 0.0, seed);
    for (_, lin) in slide.linears_mut() {
        let pruned = prune_to_pattern(&lin.format().decode(), 4).unwrap();
        let s = Slide::encode(&pruned, &SlideOptions { n: 4 }).unwrap();
        lin.replace_format(sieve_cpu::format_from_blob(&s.to_bytes()).unwrap())
            .unwrap();
    }
    // The slide model's CPU reference: its decoded values, dense.
    let mut slide_reference = tiny_model_of(cfg, FormatKind::Dense, 0.0, 0.0, seed);
    for ((_, s), (_, d)) in slide
        .linears_mut()
        .into_iter()
        .zip(slide_reference.linears_mut())
    {
        let values = s.format().decode();
        d.replace_format(Box::new(sieve_cpu::dense::FastDense::new(values)))
            .unwrap();
    }
    let mut dense_reference =
        tiny_model_of(dense.config().clone(), FormatKind::Dense, 0.0, 0.0, seed);
    let v = dense.config().vocab_size;
    let prompt: Vec<u32> = (0..600).map(|i| ((i * 37 + 11) % v) as u32).collect();
    let cases: [(&str, &Model, &mut Model); 2] = [
        ("dense", &dense, &mut dense_reference),
        ("slide 6:8", &slide, &mut slide_reference),
    ];
    for (what, model, reference) in cases {
        if what.starts_with("slide") && !library {
            eprintln!("{name}: {what} skipped, no cuSPARSELt");
            continue;
        }
        let mut cache = reference.new_cache(prompt.len() + 1);
        let cpu = reference
            .forward(&prompt, &mut cache, Logits::Last)
            .unwrap();
        let upload = |prompt8: Option<LtPrecision>| {
            let layouts = sieve_gpu::matrix::Layouts {
                prompt8,
                ..Default::default()
            };
            GpuModel::from_model_with_layouts(
                Gpu::new(0).unwrap(),
                model,
                prompt.len() + 1,
                KvPrecision::F16,
                layouts,
            )
            .unwrap()
        };
        let f16_logits = upload(None).prefill_slot(0, &prompt).unwrap();
        let f16_err = rel_rms(&f16_logits, &cpu);
        for (precision, bound) in [(LtPrecision::Int8, 0.05), (LtPrecision::E4m3, 0.15)] {
            let mut g = upload(Some(precision));
            assert!(g.report().weight_bytes > 0, "{name}");
            let got = g.prefill_slot(0, &prompt).unwrap();
            let err = rel_rms(&got, &cpu);
            let moved = rel_rms(&got, &f16_logits);
            eprintln!(
                "{name}: {what} {precision:?}: relative RMS error {err:.4} against the CPU \
                 (f16 pass {f16_err:.2e}), {moved:.4} from the f16 pass"
            );
            assert!(
                got.iter().all(|x| x.is_finite()),
                "{name}: {what} {precision:?}"
            );
            assert!(
                moved > 2.0 * f16_err.max(1e-6),
                "{name}: {what} {precision:?}: logits {moved:e} from the f16 pass's: the 8-bit \
                 path did not run"
            );
            assert!(
                err <= bound,
                "{name}: {what} {precision:?}: relative RMS error {err} > {bound}"
            );
            // A short prompt (under 512 tokens) keeps the f16 path: the f16 pass's logits.
            let short = &prompt[..100];
            let a = g.prefill_slot(0, short).unwrap();
            let b = upload(None).prefill_slot(0, short).unwrap();
            assert!(
                rel_rms(&a, &b) < 1e-5,
                "{name}: {what} {precision:?}: a 100-token prompt left the f16 path"
            );
        }
    }
}

/// Asking L2 for the next product's weights (`set_l2_prefetch`) is a hint: with the whole
/// weights, with an odd cap (a piece shorter than the instruction's 16-byte unit is dropped)
/// and the default, against none, a dense, a Balanced-CBC TEAL, a 4-bit and a 4-bit TEAL model
/// give the same greedy tokens and the same logits up to the products' own run-to-run rounding
/// (atomics).
#[test]
fn l2_prefetch_changes_no_result() {
    let _serial = serial_gpu();
    use sieve_cuda::balanced_lowbit::LowBitValues;
    let name = "l2_prefetch_changes_no_result";
    if gpu_or_skip(name).is_none() {
        return;
    }
    for (label, kind, sp, dp, int4, seed) in [
        ("dense", FormatKind::Dense, 0.0, 0.0, false, 61),
        ("balanced-cbc", FormatKind::BalancedCbc, 0.5, 0.5, false, 62),
        ("int4", FormatKind::Dense, 0.0, 0.0, true, 63),
        ("int4 teal", FormatKind::Dense, 0.5, 0.5, true, 64),
    ] {
        let mut model = tiny_model(kind, sp, dp, seed);
        if int4 {
            snap_to_int4(&mut model, LowBitValues::Int4 { group: 128 });
        }
        let prompt: Vec<u32> = vec![3, 17, 42, 99, 250];
        let steps = 24;
        let mut g =
            GpuModel::from_model(Gpu::new(0).unwrap(), &model, prompt.len() + steps + 1).unwrap();
        assert_eq!(
            g.l2_prefetch(),
            g.default_l2_prefetch(),
            "{name}: on by default"
        );
        g.set_l2_prefetch(0);
        let want_tokens = gpu_tokens_after(&mut g, &prompt, steps);
        let mut seq = prompt.clone();
        seq.extend(&want_tokens);
        let logits = |g: &mut GpuModel| {
            let mut all = Vec::new();
            g.logits_all(&seq, |_, l| {
                all.extend_from_slice(l);
                Ok(())
            })
            .unwrap();
            all
        };
        let want = logits(&mut g);
        let spread = want.iter().fold(0f32, |m, x| m.max(x.abs()));
        for cap in [usize::MAX, 100, g.default_l2_prefetch()] {
            g.set_l2_prefetch(cap);
            let tokens = gpu_tokens_after(&mut g, &prompt, steps);
            assert_eq!(tokens, want_tokens, "{name} {label} cap {cap}: tokens");
            let got = logits(&mut g);
            let worst = max_abs_diff(&got, &want);
            assert!(
                worst <= 1e-4 * spread.max(1.0),
                "{name} {label} cap {cap}: logits differ by {worst}"
            );
        }
        eprintln!("{name} {label}: same tokens and logits with and without the prefetch");
    }
}

/// `--prompt-precision f16-resident` (`Layouts::prompt16`): the f16 copies a prompt pass
/// multiplies, decoded once at upload, give the per-pass copies' logits (the same decode, the
/// same GEMM), and each sparse or low-bit format holds them. Prompts of 100 tokens reach every
/// copy (the low-bit kernels hand over at 65, IE-BME at 33, Tiled-CBC's SpMM stops at 64); one
/// of 40 tokens takes cuBLAS on the resident copy where the per-pass model takes Tiled-CBC's SpMM.
#[test]
fn resident_f16_prompt_copies_give_the_per_pass_logits() {
    let _serial = serial_gpu();
    let name = "resident_f16_prompt_copies_give_the_per_pass_logits";
    if gpu_or_skip(name).is_none() {
        return;
    }
    use sieve_cuda::balanced_lowbit::LowBitValues;
    use sieve_formats::ie_bme::{IeBme, IeBmeOptions, Payload};
    let cfg = config(301, 96, 200, 2, 6, 2, 16);
    let mut cases: Vec<(&str, Model)> = vec![
        ("tiled-cbc", tiny_model(FormatKind::TiledCbc, 0.5, 0.5, 81)),
        (
            "balanced-cbc",
            tiny_model(FormatKind::BalancedCbc, 0.5, 0.5, 82),
        ),
        ("rlc-csc", tiny_model(FormatKind::RlcCsc, 0.5, 0.5, 83)),
    ];
    for (label, dp, seed) in [("int4", 0.0, 84), ("int4 teal", 0.5, 85)] {
        let mut m = tiny_model(FormatKind::Dense, 0.5, dp, seed);
        snap_to_int4(&mut m, LowBitValues::Int4 { group: 128 });
        cases.push((label, m));
    }
    let mut ie = tiny_model_of(cfg, FormatKind::Dense, 0.5, 0.0, 86);
    let opts = IeBmeOptions {
        payload: Payload::Int4 { group_size: 64 },
        ..IeBmeOptions::default()
    };
    for (_, lin) in ie.linears_mut() {
        let e = IeBme::encode(&lin.format().decode(), &opts).unwrap();
        lin.replace_format(sieve_cpu::format_from_blob(&e.to_bytes()).unwrap())
            .unwrap();
    }
    cases.push(("ie-bme int4", ie));
    let prompt: Vec<u32> = (0..100).map(|i| (i * 37 + 5) % 301).collect();
    for (label, model) in &cases {
        let upload = |prompt16: bool| {
            let layouts = sieve_gpu::matrix::Layouts {
                prompt16,
                ..Default::default()
            };
            GpuModel::from_model_with_layouts(
                Gpu::new(0).unwrap(),
                model,
                prompt.len() + 1,
                KvPrecision::F16,
                layouts,
            )
            .unwrap()
        };
        let mut per_pass = upload(false);
        let mut resident = upload(true);
        let (a, b) = (
            per_pass.report().weight_bytes,
            resident.report().weight_bytes,
        );
        assert!(
            b > a,
            "{name} {label}: {b} bytes with the resident copies, {a} without"
        );
        for n in [100usize, 40] {
            let want = per_pass.prefill_slot(0, &prompt[..n]).unwrap();
            let got = resident.prefill_slot(0, &prompt[..n]).unwrap();
            let err = rel_rms(&got, &want);
            // The same copy and GEMM: equal up to the GEMM's own order of sums; the SpMM
            // against cuBLAS (Tiled-CBC at 40 tokens) sums in another order.
            let bound = if *label == "tiled-cbc" && n <= 64 {
                1e-3
            } else {
                1e-5
            };
            assert!(
                got.iter().all(|x| x.is_finite()) && err <= bound,
                "{name} {label}, {n} tokens: relative RMS {err:e} from the per-pass copies"
            );
            eprintln!("{name} {label}, {n} tokens: relative RMS {err:.2e}");
        }
    }
}

/// Root-mean-square of `got - want` over that of `want`.
fn rel_rms(got: &[f32], want: &[f32]) -> f64 {
    let (mut num, mut den) = (0f64, 0f64);
    for (g, w) in got.iter().zip(want) {
        num += f64::from(g - w).powi(2);
        den += f64::from(*w).powi(2);
    }
    (num / den.max(1e-30)).sqrt()
}

/// Issue 31: a model split over `SIEVE_TP_WORLD` GPUs (default: every GPU, at most 2)
/// (`sieve_gpu::tensor_parallel`) gives the one-GPU model's greedy tokens and teacher-forced
/// logits: dense, Tiled-CBC + TEAL, and 4-bit shards (int4 g128 values: the W4A16 kernel, and
/// with TEAL the column-major 4-bit one), with GQA groups kept whole on each rank and MLP
/// halves of odd width (195). At world size 1 (a machine of one GPU) the single rank is the
/// one-GPU model with no communicator and must give exactly its tokens, and its logits bit for
/// bit where two runs of the one-GPU model agree bit for bit (else within their spread); the
/// all-reduce time is then None. Above it, every rank's logits (each rank holds the
/// whole LM head) are within [`split_logit_tolerance`] of the one-GPU model's.
#[test]
fn tensor_parallel_decode_matches_one_gpu() {
    use sieve_cuda::balanced_lowbit::LowBitValues;
    let _serial = serial_gpu();
    let name = "tensor_parallel_decode_matches_one_gpu";
    if gpu_or_skip(name).is_none() {
        return;
    }
    let world = tensor_parallel_world(name);
    for (c, kind, sp, dp, int4, seed) in [
        (
            config(301, 256, 512, 2, 4, 2, 64),
            FormatKind::Dense,
            0.0,
            0.0,
            false,
            21,
        ),
        (
            config(257, 192, 390, 2, 4, 2, 48),
            FormatKind::TiledCbc,
            0.5,
            0.4,
            false,
            22,
        ),
        // Every rank's slices stay on the 4-bit grid of 128 columns: o's columns split at
        // 2 heads x 64, down's at 256.
        (
            config(263, 256, 512, 2, 4, 2, 64),
            FormatKind::Dense,
            0.5,
            0.0,
            true,
            24,
        ),
        (
            config(263, 256, 512, 2, 4, 2, 64),
            FormatKind::Dense,
            0.5,
            0.5,
            true,
            25,
        ),
    ] {
        let mut model = tiny_model_of(c.clone(), kind, sp, dp, seed);
        if int4 {
            snap_to_int4(&mut model, LowBitValues::Int4 { group: 128 });
        }
        let label = format!(
            "{kind:?} sp {sp} dp {dp}{}",
            if int4 { " int4 g128" } else { "" }
        );
        let prompt: Vec<u32> = vec![1, 17, 42, 99, 250, 3, 8];
        check_split_against_one_gpu(name, &label, &model, &prompt, 24, world);
    }
}

/// `SIEVE_TP_WORLD` (default 2), at most the GPUs there are.
fn tensor_parallel_world(name: &str) -> usize {
    let count = sieve_cuda::gpu::device_count().unwrap();
    let world = std::env::var("SIEVE_TP_WORLD")
        .ok()
        .and_then(|v| v.parse::<usize>().ok())
        .unwrap_or(2)
        .clamp(1, count);
    eprintln!("{name}: world {world} of {count} GPU(s)");
    world
}

/// How far a split's logits may be from the one-GPU model's, besides the one-GPU model's own
/// spread between two runs (atomics): none at world size 1.
/// Above it the o and down products are sums of per-rank partial sums (f32, in another
/// order), which moves a logit by a few f32 roundings of the residual, far below 1e-3 of the
/// logits' spread for dense inputs; with TEAL thresholds an input at a threshold's edge may
/// flip and move the logits by far more, so models with thresholds get a stated allowance of
/// relative RMS 5e-2 (not yet measured at world size 2), those without 1e-3.
fn split_logit_tolerance(world: usize, teal: bool) -> f64 {
    match (world, teal) {
        (1, _) => 0.0,
        (_, false) => 1e-3,
        (_, true) => 5e-2,
    }
}

/// The split of `model` over `world` GPUs against the one-GPU model: greedy tokens after
/// `prompt` equal, then teacher-forced logits over `prompt` and those tokens on every rank
/// within [`split_logit_tolerance`].
fn check_split_against_one_gpu(
    name: &str,
    label: &str,
    model: &Model,
    prompt: &[u32],
    steps: usize,
    world: usize,
) {
    let capacity = prompt.len() + steps + 1;
    let mut one = GpuModel::from_model(Gpu::new(0).unwrap(), model, capacity).unwrap();
    let want = gpu_tokens_after(&mut one, prompt, steps);
    let forced: Vec<u32> = prompt.iter().chain(&want).copied().collect();
    let forced = forced[..capacity - 1].to_vec();
    let mut runs = [Vec::new(), Vec::new()];
    for run in &mut runs {
        one.logits_all(&forced, |_, l| {
            run.extend_from_slice(l);
            Ok(())
        })
        .unwrap();
    }
    drop(one);
    // The one-GPU model against itself: split-K products add with atomics, so a run may sum
    // in another order than the last; 0 where every kernel is deterministic.
    let own = rel_rms(&runs[1], &runs[0]);
    let [want_logits, _] = runs;
    let mut tp = sieve_gpu::tensor_parallel::TensorParallelGpu::new(
        model,
        world,
        capacity,
        KvPrecision::F16,
        Default::default(),
    )
    .unwrap();
    assert_eq!(tp.report().world, world);
    assert_eq!(tp.report().rank_weight_bytes.len(), world);
    let mut got = vec![tp.prefill(prompt).unwrap()];
    while got.len() < steps {
        got.push(tp.next_token().unwrap());
    }
    assert_eq!(got, want, "{name}: {label} over {world} rank(s)");
    let teal = model
        .layers()
        .iter()
        .any(|layer| layer.linears().iter().any(|(_, l)| l.threshold().is_some()));
    let bound = split_logit_tolerance(world, teal).max(own);
    let rank_logits = tp
        .on_every_rank(move |m| {
            let mut all = Vec::new();
            m.logits_all(&forced, |_, l| {
                all.extend_from_slice(l);
                Ok(())
            })?;
            Ok(all)
        })
        .unwrap();
    for (r, logits) in rank_logits.iter().enumerate() {
        assert_eq!(logits.len(), want_logits.len(), "{name}: {label} rank {r}");
        assert!(
            logits.iter().all(|x| x.is_finite()),
            "{name}: {label} rank {r}: logits not finite"
        );
        let err = rel_rms(logits, &want_logits);
        if world == 1 && own == 0.0 {
            assert!(
                logits == &want_logits,
                "{name}: {label}: world size 1 must equal the one-GPU model bit for bit (relative RMS {err:e})"
            );
        }
        assert!(
            err <= bound,
            "{name}: {label} rank {r} of {world}: logits at relative RMS {err:e} from the one-GPU model's (bound {bound:e})"
        );
        eprintln!(
            "{name}: {label} rank {r} of {world}: logits at relative RMS {err:.2e} (one GPU against itself {own:.2e})"
        );
    }
    let all_reduce = tp.all_reduce_us_per_step(5).unwrap();
    assert_eq!(all_reduce.is_some(), world > 1, "{name}: {all_reduce:?}");
    eprintln!(
        "{name}: {label}: tokens equal over {world} rank(s); all-reduces {all_reduce:?} us a step"
    );
}

/// Issue 31 on real weights: each pack in `SIEVE_TP_MODELS` (paths joined by ':', e.g. the cut
/// default model and its packs) split over `SIEVE_TP_WORLD` GPUs against the one-GPU model,
/// as [`tensor_parallel_decode_matches_one_gpu`] does the tiny ones. Skipped without the
/// variable.
#[test]
fn tensor_parallel_models_from_env_match_one_gpu() {
    let _serial = serial_gpu();
    let name = "tensor_parallel_models_from_env_match_one_gpu";
    let Ok(list) = std::env::var("SIEVE_TP_MODELS") else {
        eprintln!("{name}: skipped, SIEVE_TP_MODELS is not set");
        return;
    };
    if gpu_or_skip(name).is_none() {
        return;
    }
    let world = tensor_parallel_world(name);
    for path in list.split(':').filter(|p| !p.is_empty()) {
        let (model, tokenizer) =
            sieve_model::packed::load_model_and_tokenizer_with(std::path::Path::new(path), true)
                .unwrap_or_else(|e| panic!("loading {path}: {e}"));
        let prompt = tokenizer
            .encode("The capital of France is", true)
            .unwrap_or_else(|e| panic!("{path}: {e}"));
        check_split_against_one_gpu(name, path, &model, &prompt, 16, world);
    }
}

/// A split the heads do not allow is refused by name before any GPU is touched (so this runs
/// on machines without one too).
#[test]
fn tensor_parallel_refuses_a_split_of_heads_before_the_gpu() {
    let model = tiny_model_of(
        config(301, 256, 512, 2, 4, 2, 64),
        FormatKind::Dense,
        0.0,
        0.0,
        23,
    );
    for world in [0, 3] {
        let e = sieve_gpu::tensor_parallel::TensorParallelGpu::new(
            &model,
            world,
            16,
            KvPrecision::F16,
            Default::default(),
        )
        .err()
        .expect("the split must be refused");
        let text = e.to_string();
        assert!(
            text.contains(&format!("--tensor-parallel {world}")),
            "{text}"
        );
    }
    // Unequal MLP slices would give the ranks different kernel choices: refused too.
    let odd = tiny_model_of(
        config(301, 256, 513, 2, 4, 2, 64),
        FormatKind::Dense,
        0.0,
        0.0,
        24,
    );
    let e = sieve_gpu::tensor_parallel::TensorParallelGpu::new(
        &odd,
        2,
        16,
        KvPrecision::F16,
        Default::default(),
    )
    .err()
    .expect("513 columns over 2 ranks must be refused");
    assert!(e.to_string().contains("split evenly"), "{e}");
}

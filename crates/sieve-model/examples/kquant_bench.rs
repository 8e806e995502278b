//! Decode speed of a Q4_K_M-like model when no Q4_K_M file is at hand (this machine has none,
//! and making one needs llama.cpp): the linears of a GGUF model are requantized in memory with
//! the type mix llama.cpp's Q4_K_M recipe gives SmolLM2-135M, then the model decodes with its
//! blocks, and again with them dequantized to f16 (the path Q4_K_M files took before).
//!
//! The recipe: `ffn_down` (1536 columns, whole super-blocks) Q6_K in the layers llama.cpp gives
//! more bits (the first and last eighth, every third between) and Q4_K elsewhere; `attn_v` Q8_0
//! there and Q5_0 elsewhere; every other linear Q5_0 (llama.cpp's fallback for Q4_K when the 576
//! columns are not whole super-blocks); the tied head Q8_0 (the fallback for Q6_K).
//!
//! The quantizers here are plain round-to-nearest with min/max scales, not llama.cpp's searched
//! scales: the bytes and block types (what the speed depends on) are those of the real file,
//! the rounding is a little worse. The source file's Q4_1 quants are requantized, so the weights
//! are not the original model's either: use this for speed, not perplexity.
//!
//! `cargo run --release -p sieve-model --example kquant_bench -- MODEL.gguf THREADS [ROUNDS
//! [PROMPT [DECODE]]]`

use half::f16;
use sieve_cpu::gguf_blocks::dequant::dequantize;
use sieve_cpu::gguf_blocks::{BlockType, QuantMatrix};
use sieve_formats::WeightFormat;
use sieve_model::config::ModelConfig;
use sieve_model::cpu_bench::measure;
use sieve_model::generate::run_in_pool;
use sieve_model::llama::Model;
use sieve_model::weights::{open_model, Tensor, TensorSource};
use std::collections::HashMap;

fn put_f16(out: &mut Vec<u8>, v: f32) {
    out.extend_from_slice(&f16::from_f32(v).to_bits().to_le_bytes());
}

fn f16_round(v: f32) -> f32 {
    f16::from_f32(v).to_f32()
}

/// Q5_0: `d = -max / 16` for the value of largest magnitude, `q = round(w / d) + 16`.
fn q5_0(w: &[f32], out: &mut Vec<u8>) {
    for b in w.chunks_exact(32) {
        let max = b
            .iter()
            .fold(0f32, |m, &v| if v.abs() > m.abs() { v } else { m });
        let d = f16_round(max / -16.0);
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        let q: Vec<u8> = b
            .iter()
            .map(|&v| ((v * id).round() + 16.0).clamp(0.0, 31.0) as u8)
            .collect();
        put_f16(out, d);
        let mut qh = 0u32;
        for (j, &v) in q.iter().enumerate() {
            qh |= ((v >> 4) as u32 & 1) << j;
        }
        out.extend_from_slice(&qh.to_le_bytes());
        for j in 0..16 {
            out.push((q[j] & 0x0F) | ((q[j + 16] & 0x0F) << 4));
        }
    }
}

/// Q8_0: `d = max|w| / 127`.
fn q8_0(w: &[f32], out: &mut Vec<u8>) {
    for b in w.chunks_exact(32) {
        let d = f16_round(b.iter().fold(0f32, |m, v| m.max(v.abs())) / 127.0);
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        put_f16(out, d);
        out.extend(
            b.iter()
                .map(|&v| (v * id).round().clamp(-127.0, 127.0) as i8 as u8),
        );
    }
}

/// Packs 8 (scale, min) 6-bit pairs as Q4_K/Q5_K store them.
fn pack_scales(pairs: [(u8, u8); 8]) -> [u8; 12] {
    let mut p = [0u8; 12];
    for j in 0..4 {
        p[j] = pairs[j].0 | ((pairs[j + 4].0 >> 4) << 6);
        p[j + 4] = pairs[j].1 | ((pairs[j + 4].1 >> 4) << 6);
        p[j + 8] = (pairs[j + 4].0 & 0x0F) | ((pairs[j + 4].1 & 0x0F) << 4);
    }
    p
}

/// Q4_K: per 32 `w ≈ scale · q - min` from the sub-block's range, the 8 scales and mins then
/// quantized to 6 bits against the super-block's `d` and `dmin`.
fn q4_k(w: &[f32], out: &mut Vec<u8>) {
    for sb in w.chunks_exact(256) {
        let mut scale = [0f32; 8];
        let mut min = [0f32; 8];
        for (j, b) in sb.chunks_exact(32).enumerate() {
            let lo = b.iter().fold(f32::MAX, |m, &v| m.min(v)).min(0.0);
            let hi = b.iter().fold(f32::MIN, |m, &v| m.max(v));
            scale[j] = (hi - lo) / 15.0;
            min[j] = -lo;
        }
        let d = f16_round(scale.iter().fold(0f32, |m, &v| m.max(v)) / 63.0);
        let dmin = f16_round(min.iter().fold(0f32, |m, &v| m.max(v)) / 63.0);
        let mut pairs = [(0u8, 0u8); 8];
        for j in 0..8 {
            let sc = if d > 0.0 {
                (scale[j] / d).round().clamp(0.0, 63.0)
            } else {
                0.0
            };
            let m = if dmin > 0.0 {
                (min[j] / dmin).round().clamp(0.0, 63.0)
            } else {
                0.0
            };
            pairs[j] = (sc as u8, m as u8);
        }
        put_f16(out, d);
        put_f16(out, dmin);
        out.extend_from_slice(&pack_scales(pairs));
        let mut q = [0u8; 256];
        for (j, b) in sb.chunks_exact(32).enumerate() {
            let step = d * pairs[j].0 as f32;
            let offset = dmin * pairs[j].1 as f32;
            for (i, &v) in b.iter().enumerate() {
                q[32 * j + i] = if step > 0.0 {
                    ((v + offset) / step).round().clamp(0.0, 15.0) as u8
                } else {
                    0
                };
            }
        }
        for chunk in 0..4 {
            for l in 0..32 {
                out.push(q[64 * chunk + l] | (q[64 * chunk + 32 + l] << 4));
            }
        }
    }
}

/// Q6_K: per 16 `sc = -max / 32` (largest magnitude), the 16 scales as i8 against `d`.
fn q6_k(w: &[f32], out: &mut Vec<u8>) {
    for sb in w.chunks_exact(256) {
        let mut scale = [0f32; 16];
        for (g, b) in sb.chunks_exact(16).enumerate() {
            let max = b
                .iter()
                .fold(0f32, |m, &v| if v.abs() > m.abs() { v } else { m });
            scale[g] = max / -32.0;
        }
        let amax = scale.iter().fold(0f32, |m, v| m.max(v.abs()));
        let d = f16_round(amax / 127.0);
        let sc: Vec<i8> = scale
            .iter()
            .map(|&s| {
                if d > 0.0 {
                    (s / d).round().clamp(-127.0, 127.0) as i8
                } else {
                    0
                }
            })
            .collect();
        let mut q = [0u8; 256];
        for (i, &v) in sb.iter().enumerate() {
            let step = d * sc[i / 16] as f32;
            q[i] = if step != 0.0 {
                ((v / step).round() + 32.0).clamp(0.0, 63.0) as u8
            } else {
                32
            };
        }
        let (mut ql, mut qh) = ([0u8; 128], [0u8; 64]);
        for half in 0..2 {
            let q = &q[128 * half..128 * half + 128];
            for l in 0..32 {
                ql[64 * half + l] = (q[l] & 0x0F) | ((q[l + 64] & 0x0F) << 4);
                ql[64 * half + l + 32] = (q[l + 32] & 0x0F) | ((q[l + 96] & 0x0F) << 4);
                qh[32 * half + l] = (q[l] >> 4)
                    | ((q[l + 32] >> 4) << 2)
                    | ((q[l + 64] >> 4) << 4)
                    | ((q[l + 96] >> 4) << 6);
            }
        }
        out.extend_from_slice(&ql);
        out.extend_from_slice(&qh);
        out.extend(sc.iter().map(|&s| s as u8));
        put_f16(out, d);
    }
}

fn quantize(ty: BlockType, rows: usize, cols: usize, w: &[f32]) -> QuantMatrix {
    let mut out = Vec::new();
    for row in w.chunks_exact(cols) {
        match ty {
            BlockType::Q5_0 => q5_0(row, &mut out),
            BlockType::Q8_0 => q8_0(row, &mut out),
            BlockType::Q4_K => q4_k(row, &mut out),
            BlockType::Q6_K => q6_k(row, &mut out),
            _ => unreachable!("the recipe uses Q5_0, Q8_0, Q4_K and Q6_K"),
        }
    }
    QuantMatrix::new(ty, rows, cols, out).expect("requantized blocks are valid")
}

/// llama.cpp's `use_more_bits`.
fn more_bits(layer: usize, layers: usize) -> bool {
    layer < layers / 8 || layer >= 7 * layers / 8 || (layer - layers / 8) % 3 == 2
}

fn recipe(name: &str, layers: usize) -> BlockType {
    let layer = name
        .strip_prefix("model.layers.")
        .and_then(|r| r.split('.').next())
        .and_then(|n| n.parse::<usize>().ok());
    match layer {
        Some(l) if name.ends_with("mlp.down_proj.weight") => {
            if more_bits(l, layers) {
                BlockType::Q6_K
            } else {
                BlockType::Q4_K
            }
        }
        Some(l) if name.ends_with("self_attn.v_proj.weight") && more_bits(l, layers) => {
            BlockType::Q8_0
        }
        Some(_) => BlockType::Q5_0,
        None => BlockType::Q8_0,
    }
}

/// The source model with every 2-D linear weight requantized by [`recipe`].
struct Requantized {
    inner: Box<dyn TensorSource>,
    blocks: HashMap<String, QuantMatrix>,
}

impl Requantized {
    fn new(inner: Box<dyn TensorSource>) -> Result<Self, Box<dyn std::error::Error>> {
        let layers = inner.config().num_layers;
        let mut blocks = HashMap::new();
        for name in inner.tensor_names() {
            let linear = name.ends_with("_proj.weight") || name == "model.embed_tokens.weight";
            if !linear {
                continue;
            }
            let t = inner.tensor(&name)?;
            if let [rows, cols] = t.shape[..] {
                blocks.insert(
                    name.clone(),
                    quantize(recipe(&name, layers), rows, cols, &t.data),
                );
            }
        }
        Ok(Self { inner, blocks })
    }
}

impl TensorSource for Requantized {
    fn config(&self) -> &ModelConfig {
        self.inner.config()
    }
    fn tensor_names(&self) -> Vec<String> {
        self.inner.tensor_names()
    }
    fn contains(&self, name: &str) -> bool {
        self.inner.contains(name)
    }
    fn tensor(&self, name: &str) -> sieve_model::Result<Tensor> {
        match self.blocks.get(name) {
            Some(q) => Ok(Tensor {
                shape: vec![q.rows(), q.cols()],
                data: dequantize(q.block_type().ggml(), q.blocks(), q.rows() * q.cols())?,
            }),
            None => self.inner.tensor(name),
        }
    }
    fn quantized_matrix(&self, name: &str) -> sieve_model::Result<Option<QuantMatrix>> {
        Ok(self.blocks.get(name).cloned())
    }
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    let threads: usize = args[2].parse()?;
    let num = |i: usize, default: usize| -> Result<usize, std::num::ParseIntError> {
        args.get(i)
            .map(|s| s.parse())
            .transpose()
            .map(|v| v.unwrap_or(default))
    };
    let (rounds, prompt_len, decode) = (num(3, 5)?, num(4, 64)?, num(5, 128)?);
    let original = Model::from_source(open_model(&args[1])?.as_ref())?;
    let source = Requantized::new(open_model(&args[1])?)?;
    let mut mix: std::collections::BTreeMap<String, usize> = Default::default();
    let mut bytes = 0;
    for q in source.blocks.values() {
        *mix.entry(format!("{:?}", q.block_type())).or_default() += 1;
        bytes += q.storage().total_bytes();
    }
    println!(
        "requantized: {mix:?}, {:.1} MB of blocks",
        bytes as f64 / 1e6
    );
    let models = [
        ("source file (as loaded)", original),
        ("Q4_K_M-like blocks", Model::from_source(&source)?),
        ("Q4_K_M-like as f16", Model::from_source_f16(&source)?),
    ];
    let prompt: Vec<u32> = (0..prompt_len as u32)
        .map(|i| 100 + (i * 37) % 4000)
        .collect();
    // A check that the requantization is sane: next-token logits of the prompt against the
    // source model's.
    let logits = |m: &Model| -> sieve_model::Result<Vec<f32>> {
        let mut cache = m.new_cache(prompt.len());
        m.forward(&prompt, &mut cache, sieve_model::llama::Logits::Last)
    };
    let argmax = |v: &[f32]| (0..v.len()).fold(0, |b, i| if v[i] > v[b] { i } else { b });
    let (a, b) = (logits(&models[0].1)?, logits(&models[1].1)?);
    let spread = a.iter().fold(0f32, |m, v| m.max(v.abs()));
    let diff = a
        .iter()
        .zip(&b)
        .fold(0f32, |m, (x, y)| m.max((x - y).abs()));
    println!(
        "next-token logits vs the source: max |diff| {diff:.3} (max |logit| {spread:.3}), \
         argmax {} vs {}",
        argmax(&a),
        argmax(&b)
    );
    let mut runs = vec![(Vec::new(), Vec::new()); models.len()];
    run_in_pool(Some(threads), || {
        for _ in 0..rounds {
            for ((_, m), (pre, dec)) in models.iter().zip(runs.iter_mut()) {
                let (p, d) = measure(m, &prompt, decode, m.kv_precision())?;
                pre.push(p);
                dec.push(d);
            }
        }
        Ok::<(), sieve_model::ModelError>(())
    })??;
    for ((label, _), (mut pre, mut dec)) in models.iter().zip(runs) {
        println!(
            "{label}: prefill {:.1} tok/s, decode {:.1} tok/s (median of {rounds}; decode runs {:?})",
            median(&mut pre),
            median(&mut dec),
            dec.iter().map(|v| (v * 10.0).round() / 10.0).collect::<Vec<_>>()
        );
    }
    Ok(())
}

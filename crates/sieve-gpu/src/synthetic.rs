//! Synthetic models: random weights of exactly the Llama-2/3 shapes, pruned at random to a
//! weight sparsity, packed in a format, uploaded one layer at a time (host memory holds one
//! layer), then TEAL thresholds set from the activations of a short random-token run on the
//! GPU. For speed at real scale without weight files; the numbers they produce are not text.
//!
//! Weights are uniform in `±sqrt(3 / K)` (unit-variance outputs for unit-variance inputs), so
//! the residual stream and the activations keep realistic magnitudes through 80 layers.
//! Unstructured pruning keeps each weight with probability `1 - sp` (the expected sparsity);
//! an N:M pattern keeps N random weights of every M along a row. SlideSparse needs an N:M
//! pattern of the form (2N-2):2N (`--pattern 6:8`), which sets its N.

use crate::error::{GpuError, Result};
use crate::matrix::HostMatrix;
use crate::runner::{GpuModel, HostLayer};
use half::f16;
use rayon::prelude::*;
use sieve_cuda::balanced_lowbit::{snap_row, LowBitValues, INT4_GROUPS};
use sieve_cuda::lowbit::{quantize_q4_0, quantize_q8_0, LowBitKind, LowBitMatrix};
use sieve_cuda::{Gpu, KvPrecision};
use sieve_formats::ie_bme::{IeBme, IeBmeOptions, Payload, Reorder};
use sieve_formats::random::Pattern;
use sieve_formats::slide::{Slide, SlideOptions};
use sieve_formats::{DenseMatrix, FormatKind, Threshold};
use sieve_model::config::ModelConfig;
use sieve_model::llama::tensor_parallel::ShardLayout;

/// The shapes `--synthetic` knows. smollm2-135m is the default model's shape (random weights of
/// it decode as fast as the real ones and need no 100 MB file on the GPU machine).
pub const NAMES: [&str; 5] = [
    "llama2-7b",
    "llama2-13b",
    "llama3-8b",
    "llama2-70b",
    "smollm2-135m",
];

/// The configuration of a named shape (context 32768 so that long-context runs fit).
pub fn config(name: &str) -> Result<ModelConfig> {
    let (d, inter, layers, heads, kv, vocab, theta) = match name {
        "llama2-7b" => (4096, 11008, 32, 32, 32, 32000, 10000.0),
        "llama2-13b" => (5120, 13824, 40, 40, 40, 32000, 10000.0),
        "llama3-8b" => (4096, 14336, 32, 32, 8, 128256, 500000.0),
        "llama2-70b" => (8192, 28672, 80, 64, 8, 32000, 10000.0),
        "smollm2-135m" => (576, 1536, 30, 9, 3, 49152, 100000.0),
        other => {
            return Err(GpuError::InvalidArgument(format!(
                "unknown synthetic model '{other}' (known: {})",
                NAMES.join(", ")
            )))
        }
    };
    Ok(ModelConfig {
        architecture: "llama".into(),
        vocab_size: vocab,
        hidden_size: d,
        intermediate_size: inter,
        num_layers: layers,
        num_heads: heads,
        num_kv_heads: kv,
        head_dim: d / heads,
        max_position_embeddings: 32768,
        rms_norm_eps: 1e-5,
        rope_theta: theta,
        rope_scaling: None,
        attention_bias: false,
        tie_word_embeddings: false,
        bos_token_id: Some(1),
        eos_token_ids: vec![2],
    })
}

/// f16 weights of every projection of `config`'s layers plus head and embeddings.
pub fn dense_weight_bytes(c: &ModelConfig) -> usize {
    let (d, kv) = (c.hidden_size, c.num_kv_heads * c.head_dim);
    let per_layer = d * (c.num_heads * c.head_dim) * 2 + 2 * d * kv + 3 * d * c.intermediate_size;
    2 * (c.num_layers * per_layer + 2 * c.vocab_size * d)
}

/// What a synthetic model's kept weights are stored as.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SyntheticValues {
    F16,
    /// Dense: W8A16 (one scale per row); Balanced-CBC: int8 values, one scale per row.
    Int8,
    /// Dense: W4A16 with groups of 128 (the only dense 4-bit group); Balanced-CBC: int4
    /// values with one scale per row and `group` columns (32, 64, 128).
    Int4 {
        group: usize,
    },
    /// Dense only: GGUF Q4_0 blocks (4-bit, an f16 scale per 32).
    Q4_0,
    /// Dense only: GGUF Q8_0 blocks (8-bit, an f16 scale per 32).
    Q8_0,
}

impl std::str::FromStr for SyntheticValues {
    type Err = GpuError;
    fn from_str(s: &str) -> Result<Self> {
        Ok(match s {
            "f16" => Self::F16,
            "int8" | "w8a16" => Self::Int8,
            "int4" | "w4a16" => Self::Int4 { group: 128 },
            "q4_0" => Self::Q4_0,
            "q8_0" => Self::Q8_0,
            other => match other.strip_prefix("int4:").map(str::parse::<usize>) {
                Some(Ok(group)) if INT4_GROUPS.contains(&group) => Self::Int4 { group },
                _ => {
                    return Err(GpuError::InvalidArgument(format!(
                        "values '{other}': expected f16, int8, int4, int4:32, int4:64, int4:128, \
                         q4_0 or q8_0"
                    )))
                }
            },
        })
    }
}

impl SyntheticValues {
    pub fn name(self) -> String {
        match self {
            Self::F16 => "f16".into(),
            Self::Int8 => "int8".into(),
            Self::Int4 { group } => format!("int4:{group}"),
            Self::Q4_0 => "q4_0".into(),
            Self::Q8_0 => "q8_0".into(),
        }
    }

    /// Refuses, before anything is built, values the GPU has no kernel for in `format`.
    pub fn check(self, format: FormatKind) -> Result<()> {
        let ok = match (self, format) {
            (Self::Int8 | Self::Int4 { group: 64 | 128 }, FormatKind::IeBme) => true,
            (_, FormatKind::IeBme) => false,
            (Self::F16, _) => true,
            (Self::Int4 { group }, FormatKind::Dense) => group == 128,
            (_, FormatKind::Dense) => true,
            (Self::Int8 | Self::Int4 { .. }, FormatKind::BalancedCbc) => true,
            _ => false,
        };
        if ok {
            return Ok(());
        }
        Err(GpuError::Unsupported(format!(
            "{} values in {}: the GPU multiplies low-bit values in dense (int8, int4 with \
             groups of 128, q4_0, q8_0), balanced-cbc (int8, int4:32/64/128) and ie-bme (int8, \
             int4:64/128; ie-bme has no f16 GPU kernel)",
            self.name(),
            format.name()
        )))
    }

    /// The dense low-bit kind of a dense matrix with these values (`None`: f16).
    fn dense_kind(self) -> Option<LowBitKind> {
        match self {
            Self::F16 => None,
            Self::Int8 => Some(LowBitKind::W8Row),
            Self::Int4 { .. } => Some(LowBitKind::W4G128),
            Self::Q4_0 => Some(LowBitKind::W4G32),
            Self::Q8_0 => Some(LowBitKind::W8G32),
        }
    }
}

/// `m` quantized to `kind` (the GGUF kinds through ggml's reference quantizers), in parallel
/// over bands of rows.
pub fn quantize_dense(m: &DenseMatrix, kind: LowBitKind) -> Result<LowBitMatrix> {
    const BAND: usize = 256;
    let (rows, cols) = (m.rows(), m.cols());
    let bands: Vec<LowBitMatrix> = (0..rows.div_ceil(BAND))
        .into_par_iter()
        .map(|b| -> Result<LowBitMatrix> {
            let r0 = b * BAND;
            let r1 = (r0 + BAND).min(rows);
            let band = DenseMatrix::new(r1 - r0, cols, m.data()[r0 * cols..r1 * cols].to_vec())?;
            Ok(match kind {
                LowBitKind::W4G32 => {
                    LowBitMatrix::from_q4_0(r1 - r0, cols, &quantize_q4_0(&band)?)?
                }
                LowBitKind::W8G32 => {
                    LowBitMatrix::from_q8_0(r1 - r0, cols, &quantize_q8_0(&band)?)?
                }
                other => LowBitMatrix::quantize(&band, other),
            })
        })
        .collect::<Result<_>>()?;
    let refs: Vec<&LowBitMatrix> = bands.iter().collect();
    Ok(LowBitMatrix::concat_rows(&refs)?)
}

/// `m`'s values snapped onto the int8 / int4 grids (as `sieve pack --values` makes them), in
/// parallel over rows.
pub fn snap_dense(m: &DenseMatrix, values: LowBitValues) -> Result<DenseMatrix> {
    let cols = m.cols();
    let mut data = m.data().to_vec();
    data.par_chunks_mut(cols.max(1))
        .map(|row| -> Result<()> {
            let mut f: Vec<f32> = row.iter().map(|v| v.to_f32()).collect();
            snap_row(values, &mut f)?;
            for (o, v) in row.iter_mut().zip(f) {
                *o = f16::from_f32(v);
            }
            Ok(())
        })
        .collect::<Result<()>>()?;
    Ok(DenseMatrix::new(m.rows(), cols, data)?)
}

/// Refuses, before anything is built, a pattern `format` cannot hold: SlideSparse stores
/// (2N-2):2N (2:4, 6:8, ...) and takes its N from the pattern.
pub fn check_pattern(format: FormatKind, pattern: Pattern) -> Result<()> {
    if format == FormatKind::Slide {
        SlideOptions::from_pattern(pattern).map_err(|e| {
            GpuError::InvalidArgument(format!(
                "slide needs a (2N-2):2N pattern (e.g. --pattern 6:8 or 2:4): {e}"
            ))
        })?;
    }
    Ok(())
}

#[derive(Clone, Copy, Debug)]
pub struct SyntheticOptions {
    /// Weight sparsity of the layers' projections (the head stays dense, as `sieve pack` leaves it).
    pub sp: f64,
    pub pattern: Pattern,
    /// Activation sparsity: per-site TEAL thresholds at this quantile of |x|.
    pub dp: f64,
    pub format: FormatKind,
    /// What the kept weights are stored as; the LM head follows in dense form (f16, or the
    /// 8-bit kind for q4_0 / q8_0 / int8, W4A16 for int4).
    pub values: SyntheticValues,
    pub seed: u64,
    /// Random tokens of the calibration run.
    pub calib_tokens: usize,
    /// What the upload keeps beside each matrix ([`crate::matrix::Layouts`]; a server asks
    /// for the batch layout).
    pub layouts: crate::matrix::Layouts,
}

fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// 24 random bits of `z` to a uniform value in (-scale, scale), never exactly 0 before f16
/// rounding.
fn random_weight(z: u64, scale: f32) -> f16 {
    let u = ((z & 0xff_ffff) as f32 + 0.5) / (1u32 << 23) as f32 - 1.0;
    f16::from_f32(u * scale)
}

/// A random `rows x cols` matrix (in parallel over rows), pruned as `opts` says.
pub fn random_matrix(
    rows: usize,
    cols: usize,
    sp: f64,
    pattern: Pattern,
    seed: u64,
) -> Result<DenseMatrix> {
    if !(0.0..1.0).contains(&sp) {
        return Err(GpuError::InvalidArgument(format!(
            "weight sparsity {sp} is outside [0, 1)"
        )));
    }
    let scale = (3.0 / cols as f64).sqrt() as f32;
    let keep = ((1.0 - sp) * (1u64 << 32) as f64) as u64;
    let mut data = vec![f16::ZERO; rows * cols];
    data.par_chunks_mut(cols).enumerate().for_each(|(r, row)| {
        let mut state = mix(seed ^ mix(r as u64 + 1));
        let mut next = || {
            state = mix(state);
            state
        };
        match pattern {
            Pattern::Unstructured => {
                for v in row.iter_mut() {
                    let z = next();
                    if (z >> 32) < keep {
                        *v = random_weight(z, scale);
                    }
                }
            }
            Pattern::NM { n, m } => {
                for group in row.chunks_mut(m) {
                    let mut idx: Vec<usize> = (0..group.len()).collect();
                    for i in (1..idx.len()).rev() {
                        idx.swap(i, (next() % (i as u64 + 1)) as usize);
                    }
                    for &i in idx.iter().take(n) {
                        let z = next();
                        group[i] = random_weight(z, scale);
                    }
                }
            }
        }
        // f16 rounding can flush a tiny value to zero; that is pruning by chance, harmless.
    });
    Ok(DenseMatrix::new(rows, cols, data)?)
}

/// Kept weights per 16 rows of a column at weight sparsity `sp` (`sieve pack`'s rule:
/// round(16 (1 - sp)), at least 1).
pub fn balanced_slots(sp: f64) -> usize {
    ((16.0 * (1.0 - sp)).round() as usize).clamp(1, 16)
}

/// A random `rows x cols` matrix pruned balanced N:16 down the outputs: in every column, each
/// group of 16 consecutive rows keeps [`balanced_slots`]`(sp)` weights at random (in parallel
/// over the groups of rows).
pub fn balanced_matrix(rows: usize, cols: usize, sp: f64, seed: u64) -> Result<DenseMatrix> {
    if !(0.0..1.0).contains(&sp) {
        return Err(GpuError::InvalidArgument(format!(
            "weight sparsity {sp} is outside [0, 1)"
        )));
    }
    let n = balanced_slots(sp);
    let scale = (3.0 / cols as f64).sqrt() as f32;
    let mut data = vec![f16::ZERO; rows * cols];
    data.par_chunks_mut(16 * cols.max(1))
        .enumerate()
        .for_each(|(g, band)| {
            let band_rows = band.len() / cols.max(1);
            let mut state = mix(seed ^ mix(g as u64 + 1));
            let mut next = || {
                state = mix(state);
                state
            };
            let mut idx: Vec<usize> = Vec::with_capacity(16);
            for c in 0..cols {
                idx.clear();
                idx.extend(0..band_rows);
                for i in (1..idx.len()).rev() {
                    idx.swap(i, (next() % (i as u64 + 1)) as usize);
                }
                for &r in idx.iter().take(n) {
                    let z = next();
                    band[r * cols + c] = random_weight(z, scale);
                }
            }
        });
    Ok(DenseMatrix::new(rows, cols, data)?)
}

/// Builds the synthetic model `name` on the GPU (f16 KV cache) and calibrates its thresholds.
pub fn build(gpu: Gpu, name: &str, opts: &SyntheticOptions, capacity: usize) -> Result<GpuModel> {
    build_with(gpu, name, opts, capacity, KvPrecision::F16)
}

/// [`build`] with the KV cache stored as `kv` says.
pub fn build_with(
    gpu: Gpu,
    name: &str,
    opts: &SyntheticOptions,
    capacity: usize,
    kv: KvPrecision,
) -> Result<GpuModel> {
    build_rank(gpu, name, opts, capacity, kv, None)
}

/// Rank `rank` of the synthetic model `name` split over `layout.world` ranks
/// (`sieve_model::llama::tensor_parallel`), for [`crate::tensor_parallel`]: its slices are
/// generated directly (random weights of the slice's shape, seeded by rank), never the whole
/// matrices, so a model larger than host memory splits too. The thresholds stay off (`dp`
/// must be 0: calibrating a rank alone would see partial sums).
pub fn build_shard(
    gpu: Gpu,
    name: &str,
    opts: &SyntheticOptions,
    capacity: usize,
    kv: KvPrecision,
    layout: &ShardLayout,
    rank: usize,
) -> Result<GpuModel> {
    if opts.dp != 0.0 {
        return Err(GpuError::Unsupported(format!(
            "--tensor-parallel {}: synthetic models split with --dp 0 only (TEAL thresholds \
             are calibrated on one GPU's whole model)",
            layout.world
        )));
    }
    build_rank(gpu, name, opts, capacity, kv, Some((layout, rank)))
}

fn build_rank(
    gpu: Gpu,
    name: &str,
    opts: &SyntheticOptions,
    capacity: usize,
    kv: KvPrecision,
    shard: Option<(&ShardLayout, usize)>,
) -> Result<GpuModel> {
    let whole = config(name)?;
    if !(0.0..1.0).contains(&opts.dp) {
        return Err(GpuError::InvalidArgument(format!(
            "activation sparsity {} is outside [0, 1)",
            opts.dp
        )));
    }
    // A rank's model: its heads and MLP slice; its weights drawn with seeds of its own.
    let (c, rank_salt) = match shard {
        Some((layout, r)) if layout.world > 1 => {
            let inter = layout.intermediate.get(r).ok_or_else(|| {
                GpuError::InvalidArgument(format!("rank {r} of {} ranks", layout.world))
            })?;
            let c = ModelConfig {
                num_heads: layout.heads,
                num_kv_heads: layout.kv_heads,
                intermediate_size: inter.len(),
                ..whole.clone()
            };
            (c, mix(0x7a11 + r as u64))
        }
        _ => (whole.clone(), 0),
    };
    let (d, hd, inter) = (c.hidden_size, c.head_dim, c.intermediate_size);
    let (q_rows, kv_rows) = (c.num_heads * hd, c.num_kv_heads * hd);
    // Dense weights under a threshold go column-major; Some(0) keeps every nonzero input
    // active until the calibrated thresholds replace it.
    let upload_t: Threshold = if opts.dp > 0.0 { Some(0.0) } else { None };
    let seed = opts.seed;
    opts.values.check(opts.format)?;
    check_pattern(opts.format, opts.pattern)?;
    let values = opts.values;
    let stored = move |w: DenseMatrix| -> Result<HostMatrix> {
        Ok(match (opts.format, values) {
            // IE-BME as a pack holds it: UnionSparse's quantizer, 2 x 2 areas, greedy row
            // reordering (the DP of `sieve pack` takes minutes on a 7B model).
            (FormatKind::IeBme, v) => {
                let payload = match v {
                    SyntheticValues::Int4 { group } => Payload::Int4 { group_size: group },
                    _ => Payload::Int8 { group_size: 128 },
                };
                let opts = IeBmeOptions {
                    payload,
                    reorder: Reorder::Greedy,
                    ..IeBmeOptions::default()
                };
                HostMatrix::IeBme(IeBme::encode(&w, &opts)?)
            }
            // SlideSparse as a pack holds it, with the pattern's N.
            (FormatKind::Slide, SyntheticValues::F16) => HostMatrix::Slide(Slide::encode(
                &w,
                &SlideOptions::from_pattern(opts.pattern)?,
            )?),
            (_, SyntheticValues::F16) => HostMatrix::Values(w),
            (FormatKind::Dense, v) => match v.dense_kind() {
                Some(kind) => HostMatrix::LowBit(quantize_dense(&w, kind)?),
                None => HostMatrix::Values(w),
            },
            (_, SyntheticValues::Int8) => HostMatrix::Values(snap_dense(&w, LowBitValues::Int8)?),
            (_, SyntheticValues::Int4 { group }) => {
                HostMatrix::Values(snap_dense(&w, LowBitValues::Int4 { group })?)
            }
            (format, v) => {
                return Err(GpuError::Unsupported(format!(
                    "{} values in {}",
                    v.name(),
                    format.name()
                )))
            }
        })
    };
    // Balanced-CBC holds as many slots per 16 rows of a column as its fullest group needs, so
    // its synthetic weights are balanced N:16 (as `sieve pack --pattern balanced` makes them):
    // unstructured weights at sp 0.5 fill 14-16 slots and measure a denser matrix.
    let balanced = opts.format == FormatKind::BalancedCbc && opts.pattern == Pattern::Unstructured;
    let m = |id: u64, rows: usize, cols: usize| {
        let seed = seed ^ rank_salt;
        let w = if balanced {
            balanced_matrix(rows, cols, opts.sp, mix(seed ^ mix(id)))?
        } else {
            random_matrix(rows, cols, opts.sp, opts.pattern, mix(seed ^ mix(id)))?
        };
        stored(w)
    };
    let mut embed = vec![f16::ZERO; c.vocab_size * d];
    embed.par_chunks_mut(d).enumerate().for_each(|(r, row)| {
        let mut s = mix(seed ^ 0xe3be ^ mix(r as u64));
        for v in row.iter_mut() {
            s = mix(s);
            *v = f16::from_f32(((s & 0xffff) as f32 / 65536.0 - 0.5) * 2.0);
        }
    });
    let head = random_matrix(
        c.vocab_size,
        d,
        0.0,
        Pattern::Unstructured,
        mix(seed ^ 0x4ead),
    )?;
    let head_kind = match values {
        SyntheticValues::F16 => None,
        SyntheticValues::Int4 { .. } => Some(LowBitKind::W4G128),
        SyntheticValues::Int8 => Some(LowBitKind::W8Row),
        SyntheticValues::Q4_0 | SyntheticValues::Q8_0 => Some(LowBitKind::W8G32),
    };
    let head = match head_kind {
        Some(kind) => HostMatrix::LowBit(quantize_dense(&head, kind)?),
        None => HostMatrix::Values(head),
    };
    let notes = vec![format!(
        "synthetic {name}: random weights, sp {} ({}), dp {}, format {}, values {}, head {}",
        opts.sp,
        match opts.pattern {
            Pattern::Unstructured if balanced => format!("balanced:{}:16", balanced_slots(opts.sp)),
            Pattern::Unstructured => "unstructured".to_string(),
            Pattern::NM { n, m } => format!("{n}:{m}"),
        },
        opts.dp,
        opts.format.name(),
        values.name(),
        head_kind.map(|k| k.name()).unwrap_or("f16")
    )];
    let mut model = GpuModel::build(
        gpu,
        c.clone(),
        capacity,
        kv,
        embed,
        vec![1.0; d],
        (head, None, FormatKind::Dense),
        notes,
        opts.layouts,
        |l| {
            let base = 16 * (l as u64 + 1);
            Ok(HostLayer {
                input_norm: vec![1.0; d],
                post_norm: vec![1.0; d],
                qkv: vec![
                    (m(base, q_rows, d)?, upload_t),
                    (m(base + 1, kv_rows, d)?, upload_t),
                    (m(base + 2, kv_rows, d)?, upload_t),
                ],
                qkv_bias: None,
                o: (m(base + 3, d, q_rows)?, upload_t),
                gate_up: vec![
                    (m(base + 4, inter, d)?, upload_t),
                    (m(base + 5, inter, d)?, upload_t),
                ],
                down: (m(base + 6, d, inter)?, upload_t),
                kind: opts.format,
            })
        },
    )?;
    calibrate(&mut model, opts.dp, opts.calib_tokens.max(2), seed)?;
    Ok(model)
}

/// Sets every site's TEAL threshold to the `dp` quantile of |x| over a run of random tokens
/// (thresholds off during the run).
pub fn calibrate(model: &mut GpuModel, dp: f64, tokens: usize, seed: u64) -> Result<()> {
    let layers = model.config().num_layers;
    if dp == 0.0 {
        return model.set_thresholds(&vec![[None; 4]; layers]);
    }
    let vocab = model.config().vocab_size as u64;
    let ids: Vec<u32> = (0..tokens as u64)
        .map(|i| (mix(seed ^ mix(i + 77)) % vocab) as u32)
        .collect();
    let off: Vec<[Threshold; 4]> = vec![[Some(0.0); 4]; layers];
    model.set_thresholds(&off)?;
    model.start(&ids)?;
    let mut seen: Vec<[Vec<f32>; 4]> = (0..layers).map(|_| Default::default()).collect();
    for _ in 0..tokens {
        model.observe_step(&mut |l, s, x| seen[l][s].extend_from_slice(x))?;
    }
    let mut thresholds = Vec::with_capacity(layers);
    for sites in &seen {
        let mut row = [None; 4];
        for (s, x) in sites.iter().enumerate() {
            row[s] = sieve_formats::random::threshold_for_sparsity(x, dp)?;
        }
        thresholds.push(row);
    }
    model.set_thresholds(&thresholds)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slide_takes_its_n_from_a_2n_minus_2_of_2n_pattern() {
        for (n, m) in [(6, 8), (2, 4), (14, 16)] {
            assert!(check_pattern(FormatKind::Slide, Pattern::NM { n, m }).is_ok());
        }
        for p in [
            Pattern::Unstructured,
            Pattern::NM { n: 4, m: 8 },
            Pattern::NM { n: 1, m: 2 },
        ] {
            let err = check_pattern(FormatKind::Slide, p).unwrap_err().to_string();
            assert!(err.contains("slide") && err.contains("6:8"), "{err}");
        }
        // Other formats take any pattern.
        assert!(check_pattern(FormatKind::TiledCbc, Pattern::Unstructured).is_ok());
        // Slide holds f16 values only.
        assert!(SyntheticValues::F16.check(FormatKind::Slide).is_ok());
        assert!(SyntheticValues::Int8.check(FormatKind::Slide).is_err());
    }

    #[test]
    fn every_named_shape_has_a_config_and_smollm2_is_the_default_models() {
        for name in NAMES {
            let c = config(name).unwrap();
            assert_eq!(c.hidden_size, c.num_heads * c.head_dim, "{name}");
            assert!(c.num_heads.is_multiple_of(c.num_kv_heads), "{name}");
        }
        // SmolLM2-135M's config.json: 576 hidden, 1536 intermediate, 30 layers, 9 heads of 64,
        // 3 KV heads, 49152 tokens.
        let s = config("smollm2-135m").unwrap();
        assert_eq!(
            (s.hidden_size, s.intermediate_size, s.num_layers, s.head_dim),
            (576, 1536, 30, 64)
        );
        assert_eq!((s.num_kv_heads, s.vocab_size), (3, 49152));
        let e = config("smollm2").unwrap_err().to_string();
        assert!(e.contains("smollm2-135m"), "{e}");
    }

    #[test]
    fn balanced_matrices_keep_n_of_every_16_rows_of_a_column() {
        for (rows, cols, sp) in [(48, 7, 0.5), (37, 5, 0.7), (16, 3, 0.0), (5, 4, 0.5)] {
            let w = balanced_matrix(rows, cols, sp, 9).unwrap();
            let n = balanced_slots(sp);
            for c in 0..cols {
                for g in (0..rows).step_by(16) {
                    let group = g..(g + 16).min(rows);
                    let kept = group
                        .clone()
                        .filter(|&r| w.get(r, c).to_f32() != 0.0)
                        .count();
                    // A partial last group keeps min(n, its rows); f16 may flush a tiny value.
                    let want = n.min(group.len());
                    assert!(
                        kept <= want && kept + 1 >= want,
                        "{rows}x{cols} sp {sp}: column {c} rows {group:?} keep {kept}, want {want}"
                    );
                }
            }
        }
        assert_eq!(balanced_slots(0.5), 8);
        assert_eq!(balanced_slots(0.7), 5);
    }
}

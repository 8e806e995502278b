//! The persistent step ([`sieve_cuda::persistent`]) as the runner builds it: stages from the
//! model's plan, the layer table from the uploaded weights and the current slot's KV cache.

use super::{DeviceLayer, GpuModel, Op};
use crate::error::{GpuError, Result};
use crate::matrix::{DeviceLinear, DeviceMatrix};
use sieve_cuda::kv_cache::KvCache;
use sieve_cuda::persistent::{
    PersistentBcbc, PersistentIo, PersistentLayer, PersistentShape, PersistentStep, PersistentTcbc,
    Stage, StageKind,
};
use sieve_cuda::product::{dev_ptr, threshold_arg, DevPtr};
use sieve_cuda::timing::EventPair;
use sieve_model::plan::{Group, LayerOp, Norm, StepOp};

/// How a decode step runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum StepMode {
    /// A CUDA graph of the plan's kernels (every format; the reference).
    Graph,
    /// One persistent kernel for the whole step, then the sampler (dense f16, Tiled-CBC and
    /// Balanced-CBC models).
    Persistent,
}

/// What [`GpuModel::choose_step`] measured and kept.
#[derive(Clone, Debug, PartialEq)]
pub struct StepChoice {
    pub mode: StepMode,
    /// Microseconds per decode step of each mode (None: not timed).
    pub graph_us: Option<f64>,
    pub persistent_us: Option<f64>,
    /// Why only the graph step was considered.
    pub why_graph: Option<String>,
}

impl StepChoice {
    /// The graph step, kept because the persistent one cannot run (`why`).
    fn graph_only(graph_us: Option<f64>, why: String) -> Self {
        StepChoice {
            mode: StepMode::Graph,
            graph_us,
            persistent_us: None,
            why_graph: Some(why),
        }
    }

    /// One line for stderr: the mode kept and why.
    pub fn describe(&self) -> String {
        match (self.graph_us, self.persistent_us, &self.why_graph) {
            (Some(g), Some(p), Some(why)) => format!(
                "step: graph (persistent timed {:.3} ms a step against {:.3} ms graph, but {why})",
                p / 1000.0,
                g / 1000.0
            ),
            (Some(g), Some(p), None) => format!(
                "step: {} ({:.3} ms a step against {:.3} ms {})",
                self.mode.name(),
                if self.mode == StepMode::Graph { g } else { p } / 1000.0,
                if self.mode == StepMode::Graph { p } else { g } / 1000.0,
                if self.mode == StepMode::Graph {
                    "persistent"
                } else {
                    "graph"
                }
            ),
            (_, _, Some(why)) => format!("step: graph (persistent cannot run here: {why})"),
            _ => format!("step: {}", self.mode.name()),
        }
    }
}

impl StepMode {
    pub fn name(self) -> &'static str {
        match self {
            StepMode::Graph => "graph",
            StepMode::Persistent => "persistent",
        }
    }
}

/// The persistent stages of a decode step's plan ops (without [`StepOp::Next`]): each norm
/// fused into the product after it, RoPE and the cache write into q|k|v, SwiGLU into gate|up,
/// the embedding into the first q|k|v stage. An op order this does not know is an error.
pub fn stages_of(ops: &[StepOp]) -> std::result::Result<Vec<Stage>, String> {
    use LayerOp as L;
    use StepOp::Layer;
    let mut stages = Vec::new();
    let mut embed = false;
    let mut i = 0;
    while i < ops.len() {
        let (kind, layer, used) = match ops[i..] {
            [StepOp::Embed, ..] => {
                embed = true;
                i += 1;
                continue;
            }
            [Layer(a, L::Norm(Norm::Attention)), Layer(b, L::Product(Group::Qkv)), Layer(c, L::RopeKv), ..]
                if a == b && b == c =>
            {
                let kind = if std::mem::take(&mut embed) {
                    StageKind::QkvFromEmbedding
                } else {
                    StageKind::Qkv
                };
                (kind, a, 3)
            }
            [Layer(a, L::Attention), ..] => (StageKind::Attention, a, 1),
            [Layer(a, L::Product(Group::O)), ..] => (StageKind::O, a, 1),
            [Layer(a, L::Norm(Norm::Mlp)), Layer(b, L::Product(Group::GateUp)), Layer(c, L::SwiGlu), ..]
                if a == b && b == c =>
            {
                (StageKind::GateUp, a, 3)
            }
            [Layer(a, L::Product(Group::Down)), ..] => (StageKind::Down, a, 1),
            [StepOp::FinalNorm, StepOp::LmHead, ..] => (StageKind::Head, 0, 2),
            _ => {
                return Err(format!(
                    "the plan's op {:?} has no persistent stage",
                    ops[i]
                ))
            }
        };
        if embed {
            return Err("the embedding is not followed by a q|k|v stage".into());
        }
        stages.push(Stage { kind, layer });
        i += used;
    }
    Ok(stages)
}

/// A group's weights as the persistent step reads them: dense f16 rows (the address),
/// Tiled-CBC or Balanced-CBC (the arrays; the others' fields zero), and its threshold.
struct GroupWeights {
    dense: DevPtr,
    tiled: PersistentTcbc,
    balanced: PersistentBcbc,
    threshold: f32,
}

/// The formats the persistent step multiplies, for its refusals.
const PERSISTENT_FORMATS: &str = "dense f16 rows, Tiled-CBC and Balanced-CBC";

/// A group's [`GroupWeights`], or why the group cannot run persistent.
fn group_weights(
    gpu: &sieve_cuda::gpu::Gpu,
    what: &str,
    lin: &DeviceLinear,
) -> std::result::Result<GroupWeights, String> {
    match lin.parts.as_slice() {
        [p] => {
            let mut w = GroupWeights {
                dense: 0,
                tiled: PersistentTcbc::default(),
                balanced: PersistentBcbc::default(),
                threshold: threshold_arg(p.threshold),
            };
            match &p.matrix {
                DeviceMatrix::DenseRows(m) => w.dense = dev_ptr(gpu, m.weights()),
                DeviceMatrix::TiledCbc(m) => {
                    w.tiled = m
                        .persistent_arrays(gpu)
                        .map_err(|e| format!("{what}: {e}"))?
                }
                DeviceMatrix::BalancedCbc(_) if !balanced_cbc_enabled() => {
                    return Err(format!(
                        "{what} is Balanced-CBC, whose persistent stage has not yet run on a \
                         GPU ({BCBC_SWITCH}=1 enables it for testing)"
                    ))
                }
                DeviceMatrix::BalancedCbc(m) => {
                    w.balanced = m
                        .persistent_arrays(gpu)
                        .map_err(|e| format!("{what}: {e}"))?
                }
                other => {
                    return Err(format!(
                        "{what} is {} (the persistent step takes {PERSISTENT_FORMATS})",
                        other.label()
                    ))
                }
            }
            Ok(w)
        }
        parts => Err(format!(
            "{what} has {} parts under different thresholds (the persistent step takes one)",
            parts.len()
        )),
    }
}

/// The switch that lets Balanced-CBC products into the persistent step. Its stage was written
/// and checked against an emulation of its addressing (2026-12-07), but no device window was
/// left to run it: until its GPU test has passed, a memory fault in it could poison the CUDA
/// context of a user whose `--step auto` only meant to time it, so it stays off by default.
const BCBC_SWITCH: &str = "SIEVE_PERSISTENT_BCBC";

fn balanced_cbc_enabled() -> bool {
    std::env::var(BCBC_SWITCH).as_deref() == Ok("1")
}

/// Where two runs' logits differ by more than `rel` of the reference row's spread (max - min,
/// at least 1), as a sentence naming the position; None when every position agrees.
fn logits_disagree(got: &[Vec<f32>], want: &[Vec<f32>], rel: f32) -> Option<String> {
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let (lo, hi) = w
            .iter()
            .fold((f32::INFINITY, f32::NEG_INFINITY), |(lo, hi), &v| {
                (lo.min(v), hi.max(v))
            });
        let bound = rel * (hi - lo).max(1.0);
        let worst = g
            .iter()
            .zip(w)
            .map(|(a, b)| (a - b).abs())
            .fold(
                0.0f32,
                |m, d| if d.is_nan() { f32::INFINITY } else { m.max(d) },
            );
        if g.len() != w.len() || worst > bound {
            return Some(format!(
                "its logits differ from the graph step's by {worst:.3e} at position {i} \
                 (allowed {bound:.3e}): a fault in the persistent step, kept out"
            ));
        }
    }
    None
}

impl GpuModel {
    fn persistent_shape(&self) -> PersistentShape {
        let c = &self.config;
        PersistentShape {
            hidden: c.hidden_size,
            heads: c.num_heads,
            kv_heads: c.num_kv_heads,
            head_dim: c.head_dim,
            intermediate: c.intermediate_size,
            vocab: c.vocab_size,
            capacity: self.capacity,
            eps: c.rms_norm_eps,
        }
    }

    /// Why this model's step cannot run persistent (None: it can).
    pub fn persistent_unsupported(&self) -> Option<String> {
        self.persistent_layers().err()
    }

    fn persistent_layers(&self) -> std::result::Result<Vec<PersistentLayer>, String> {
        if let Some(why) = sieve_cuda::persistent::unsupported_shape(&self.persistent_shape()) {
            return Err(why);
        }
        group_weights(&self.gpu, "the LM head", &self.lm_head)?;
        let g = &self.gpu;
        let p = |s: &cudarc::driver::CudaSlice<f32>| dev_ptr(g, s);
        let mut out = Vec::with_capacity(self.layers.len());
        for (l, dl) in self.layers.iter().enumerate() {
            let DeviceLayer {
                input_norm,
                post_norm,
                qkv,
                qkv_bias,
                o,
                gate_up,
                down,
            } = dl;
            let named = |g: &str| format!("layer {l}'s {g}");
            let wqkv = group_weights(g, &named("q|k|v"), qkv)?;
            let wo = group_weights(g, &named("o"), o)?;
            let wgu = group_weights(g, &named("gate|up"), gate_up)?;
            let wd = group_weights(g, &named("down"), down)?;
            let (k_cache, v_cache) = match self.cache_view(l).map_err(|e| e.to_string())? {
                KvCache::F16 { k, v } => (k, v),
                KvCache::Int8 { .. } => {
                    return Err("the 8-bit KV cache (the persistent step reads f16)".into())
                }
            };
            out.push(PersistentLayer {
                attn_norm: p(input_norm),
                qkv: wqkv.dense,
                qkv_bias: qkv_bias.as_ref().map(p).unwrap_or(0),
                k_cache,
                v_cache,
                o: wo.dense,
                mlp_norm: p(post_norm),
                gate_up: wgu.dense,
                down: wd.dense,
                t_qkv: wqkv.threshold,
                t_o: wo.threshold,
                t_gate_up: wgu.threshold,
                t_down: wd.threshold,
                s_qkv: wqkv.tiled,
                s_o: wo.tiled,
                s_gate_up: wgu.tiled,
                s_down: wd.tiled,
                b_qkv: wqkv.balanced,
                b_o: wo.balanced,
                b_gate_up: wgu.balanced,
                b_down: wd.balanced,
            });
        }
        Ok(out)
    }

    /// Times the graph and the persistent step on this model and keeps the faster one: the
    /// `--step auto` choice, measured rather than guessed, because which wins depends on the
    /// model's size, its formats and the GPU (docs/BENCHMARKS.md, issue 27). Each mode runs a
    /// few warm-up steps (graph capture, kernel compile) and then `steps` decode steps between
    /// two events, from the middle of the context ([`Self::seek`]: the cache there holds
    /// whatever it held); the sequence is reset afterwards, so the next prefill starts clean. A model the persistent step cannot run keeps the
    /// graph step without timing anything.
    /// Why the persistent step's logits cannot be trusted on this model (None: they agree with
    /// the graph step's). Both modes run the same few tokens teacher-forced from position 0;
    /// the bound, 1% of the graph step's logit spread at each position, is five times the one
    /// the GPU tests hold both steps to (rounding and a TEAL activation at its threshold
    /// differ between them), while a wrong stage moves logits by the spread itself.
    fn persistent_disagrees(&mut self) -> Result<Option<String>> {
        let vocab = self.config.vocab_size.max(1);
        let n = self.capacity.min(4);
        let tokens: Vec<u32> = (1..=n as u32).map(|t| t % vocab as u32).collect();
        let run = |m: &mut Self, mode: StepMode| -> Result<Vec<Vec<f32>>> {
            m.set_step_mode(mode)?;
            let mut rows = Vec::with_capacity(n);
            m.logits_all(&tokens, |_, l| {
                rows.push(l.to_vec());
                Ok(())
            })?;
            Ok(rows)
        };
        let want = run(self, StepMode::Graph)?;
        let got = run(self, StepMode::Persistent)?;
        Ok(logits_disagree(&got, &want, 1e-2))
    }

    pub fn choose_step(&mut self, steps: usize) -> Result<StepChoice> {
        const WARM_UP: usize = 3;
        let steps = steps.min(self.capacity.saturating_sub(WARM_UP + 1));
        let refused = if self.tp.is_some() {
            Some("tensor parallelism (the persistent step has no all-reduce)".to_string())
        } else if steps == 0 {
            Some(format!(
                "a context of {} positions is too short to time",
                self.capacity
            ))
        } else {
            self.persistent_unsupported()
        };
        if let Some(why) = refused {
            self.set_step_mode(StepMode::Graph)?;
            return Ok(StepChoice::graph_only(None, why));
        }
        // Midway through the context: attention's share of the step grows with the position,
        // and the two steps' attention differ most there.
        let at = (self.capacity - 1 - WARM_UP - steps) / 2;
        let time = |m: &mut Self, mode: StepMode| -> Result<f64> {
            m.set_step_mode(mode)?;
            m.reset(&[0])?;
            m.seek(at, 0)?;
            m.enqueue_decode_steps(WARM_UP)?;
            let events = EventPair::new(&m.gpu)?;
            events.start(&m.gpu)?;
            m.enqueue_decode_steps(steps)?;
            events.end(&m.gpu)?;
            m.gpu.synchronize()?;
            m.check_step()?;
            Ok(events.elapsed_us()? / steps as f64)
        };
        let graph_us = time(self, StepMode::Graph)?;
        // A persistent step that cannot be built here (its shared memory, GPU memory) or that
        // fails its run leaves the graph step, which just ran, in charge: said, not fatal.
        let persistent_us = match time(self, StepMode::Persistent) {
            Ok(us) => us,
            Err(e) => {
                self.set_step_mode(StepMode::Graph)?;
                self.reset(&[0])?;
                let why = format!("timing it failed: {e}");
                return Ok(StepChoice::graph_only(Some(graph_us), why));
            }
        };
        // Faster is not enough: before it takes over, the persistent step's teacher-forced
        // logits of a few tokens must agree with the graph step's.
        if persistent_us < graph_us {
            if let Some(why) = self.persistent_disagrees()? {
                self.set_step_mode(StepMode::Graph)?;
                self.reset(&[0])?;
                let mut choice = StepChoice::graph_only(Some(graph_us), why);
                choice.persistent_us = Some(persistent_us);
                return Ok(choice);
            }
        }
        let mode = if persistent_us < graph_us {
            StepMode::Persistent
        } else {
            StepMode::Graph
        };
        self.set_step_mode(mode)?;
        self.reset(&[0])?;
        Ok(StepChoice {
            mode,
            graph_us: Some(graph_us),
            persistent_us: Some(persistent_us),
            why_graph: None,
        })
    }

    /// Builds the persistent step for the current slot (the caller drops the captured graphs).
    pub(super) fn build_persistent(&self) -> Result<PersistentStep> {
        let layers = self.persistent_layers().map_err(|why| {
            GpuError::Unsupported(format!("the persistent step cannot run this model: {why}"))
        })?;
        let ops: Vec<StepOp> = self
            .ops()
            .into_iter()
            .filter_map(|op| match op {
                Op::Plan(op) => Some(op),
                Op::Next(_) => None,
            })
            .collect();
        let stages = stages_of(&ops).map_err(GpuError::Unsupported)?;
        let g = &self.gpu;
        let b = &self.bufs;
        let p = |s: &cudarc::driver::CudaSlice<f32>| dev_ptr(g, s);
        let head = group_weights(g, "the LM head", &self.lm_head).map_err(GpuError::Unsupported)?;
        let io = PersistentIo {
            embed: dev_ptr(g, &self.embed),
            final_norm: p(&self.final_norm),
            lm_head: head.dense,
            s_head: head.tiled,
            b_head: head.balanced,
            t_head: head.threshold,
            x: p(&b.x),
            qkv: p(&b.qkv),
            att: p(&b.att),
            h: p(&b.h),
            logits: p(&b.logits),
            state: dev_ptr(g, &b.state),
            rope_cos: p(&b.rope_cos),
            rope_sin: p(&b.rope_sin),
        };
        let mut step = PersistentStep::new(g, self.persistent_shape(), &layers, &stages, io)?;
        step.set_trace(g, self.persistent_trace)?;
        Ok(step)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_plan_of_a_step_maps_to_five_stages_a_layer_and_the_head() {
        let ops: Vec<StepOp> = sieve_model::plan::step_ops(2)
            .into_iter()
            .filter(|op| *op != StepOp::Next)
            .collect();
        let stages = stages_of(&ops).unwrap();
        let kinds: Vec<StageKind> = stages.iter().map(|s| s.kind).collect();
        use StageKind::*;
        assert_eq!(
            kinds,
            vec![
                QkvFromEmbedding,
                Attention,
                O,
                GateUp,
                Down,
                Qkv,
                Attention,
                O,
                GateUp,
                Down,
                Head
            ]
        );
        assert_eq!(stages[6].layer, 1);
        assert_eq!(stages[10].layer, 0);
    }

    #[test]
    fn a_planned_step_reads_each_weight_once_and_the_cache_of_every_layer() {
        use sieve_cuda::persistent::Trace;
        let ops: Vec<StepOp> = sieve_model::plan::step_ops(2)
            .into_iter()
            .filter(|op| *op != StepOp::Next)
            .collect();
        let stages = stages_of(&ops).unwrap();
        let (d, heads, kv_heads, hd, inter, vocab, positions) = (64, 4, 2, 16, 128, 50, 7);
        let shape = PersistentShape {
            hidden: d,
            heads,
            kv_heads,
            head_dim: hd,
            intermediate: inter,
            vocab,
            capacity: 16,
            eps: 1e-5,
        };
        // The stamps do not enter the bytes: one block, every stage 0..1 us.
        let trace = Trace {
            stamps: stages.iter().flat_map(|_| [0, 1_000]).collect(),
            stages,
            blocks: 1,
            shape,
            positions,
            counted: Vec::new(),
        };
        let bytes = trace.summary().read_bytes;
        let layer_weights = ((heads + 2 * kv_heads) * hd * d // q|k|v
            + d * heads * hd // o
            + 2 * inter * d // gate|up
            + d * inter) as u64; // down
        let want = [
            ("norm+qkv+rope", 2 * (heads + 2 * kv_heads) * hd * d + d),
            ("attention", 2 * 2 * kv_heads * hd * positions),
            ("o", 2 * d * heads * hd),
            ("norm+gate|up+swiglu", 2 * 2 * inter * d),
            ("down", 2 * d * inter),
            ("norm+head", vocab * d),
        ]
        .map(|(class, elements)| (class, 2 * elements as u64));
        assert_eq!(bytes, want);
        let total: u64 = bytes.iter().map(|&(_, b)| b).sum();
        // 2 layers of weights, the head, one embedding row, and K and V of every layer: f16.
        let kv = 2 * 2 * kv_heads * hd * positions;
        assert_eq!(total, 2 * (2 * layer_weights + (vocab * d + d + kv) as u64));
    }

    #[test]
    fn a_step_choice_says_what_it_kept_and_why() {
        let timed = |mode, g, p| StepChoice {
            mode,
            graph_us: Some(g),
            persistent_us: Some(p),
            why_graph: None,
        };
        assert_eq!(
            timed(StepMode::Graph, 843.0, 902.0).describe(),
            "step: graph (0.843 ms a step against 0.902 ms persistent)"
        );
        assert_eq!(
            timed(StepMode::Persistent, 900.0, 800.0).describe(),
            "step: persistent (0.800 ms a step against 0.900 ms graph)"
        );
        let refused = StepChoice {
            mode: StepMode::Graph,
            graph_us: Some(843.0),
            persistent_us: None,
            why_graph: Some("the 8-bit KV cache".into()),
        };
        assert_eq!(
            refused.describe(),
            "step: graph (persistent cannot run here: the 8-bit KV cache)"
        );
    }

    #[test]
    fn a_faster_persistent_step_is_kept_out_when_its_logits_disagree() {
        let want = vec![vec![0.0, 4.0, -6.0], vec![1.0, 2.0, 3.0]];
        // Spread 10 and 2 (at least 1): 1% is 0.1 and 0.02.
        let close = vec![vec![0.05, 3.95, -6.0], vec![1.0, 2.01, 3.0]];
        assert_eq!(logits_disagree(&close, &want, 1e-2), None);
        let off = vec![vec![0.05, 3.95, -6.0], vec![1.0, 2.05, 3.0]];
        let why = logits_disagree(&off, &want, 1e-2).unwrap();
        assert!(why.contains("at position 1"), "{why}");
        let nan = vec![vec![f32::NAN, 4.0, -6.0], want[1].clone()];
        assert!(logits_disagree(&nan, &want, 1e-2)
            .unwrap()
            .contains("position 0"));
        let short = vec![vec![0.0, 4.0], want[1].clone()];
        assert!(logits_disagree(&short, &want, 1e-2).is_some());
        let choice = StepChoice {
            mode: StepMode::Graph,
            graph_us: Some(900.0),
            persistent_us: Some(800.0),
            why_graph: Some(why),
        };
        assert!(
            choice.describe().starts_with(
                "step: graph (persistent timed 0.800 ms a step against 0.900 ms graph, but its logits differ"
            ),
            "{}",
            choice.describe()
        );
    }

    #[test]
    fn an_op_order_it_does_not_know_is_refused_by_name() {
        let ops = [StepOp::Embed, StepOp::Layer(0, LayerOp::Attention)];
        let err = stages_of(&ops).unwrap_err();
        assert!(err.contains("q|k|v"), "{err}");
        let ops = [StepOp::Layer(0, LayerOp::SwiGlu)];
        let err = stages_of(&ops).unwrap_err();
        assert!(err.contains("SwiGlu"), "{err}");
    }
}

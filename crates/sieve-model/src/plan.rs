//! The model described once: the ops of a decode step (or a prefill chunk) in order, and what
//! each product multiplies, built from a loaded [`Model`]. Every backend executes this
//! description instead of writing the Llama layer out again:
//!
//! ```text
//!   Embed
//!   per layer l:  Norm(attention) -> Product(q|k|v) -> RopeKv -> Attention -> Product(o) (+= x)
//!                 Norm(mlp)       -> Product(gate|up) -> SwiGlu -> Product(down) (+= x)
//!   FinalNorm -> LmHead -> Next (sample, or take the forced token)
//! ```
//!
//! Buffers (shapes in `llama.rs`'s header): `x` residual stream, `xn` normed input, `q|k|v`,
//! `att` attention output, `gate|up`, `h = silu(gate) * up`. A product group is what one launch
//! (GPU) or one parallel region (CPU) computes: q|k|v and gate|up share their input and run
//! together; o and down add into the residual stream.
//!
//! The CPU forward passes (`Model::forward`, `Model::decode_batch`), calibration's cacheless
//! layer walk (`LayerWalk`: `Model::forward_layer` and `sieve-prune`'s pipeline) and the GPU
//! runner (`sieve-gpu`'s `GpuModel`) walk [`LAYER`] and [`step_ops`]. Before a backend takes a model it
//! checks the [`Plan`] against its [`Capabilities`]: what it cannot run is refused there, before
//! any upload, with the layer, the op and the format named.

use crate::error::{ModelError, Result};
use crate::llama::{Model, Site};
use sieve_formats::FormatKind;

/// A group of projections that read the same input and run as one product.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Group {
    /// q, k and v: input `xn` (after the attention norm), output `q|k|v`.
    Qkv,
    /// o: input `att`, added into `x`.
    O,
    /// gate and up: input `xn` (after the MLP norm), output `gate|up`.
    GateUp,
    /// down: input `h`, added into `x`.
    Down,
}

impl Group {
    /// The four groups of a layer, in the order the step runs them.
    pub const ALL: [Group; 4] = [Group::Qkv, Group::O, Group::GateUp, Group::Down];

    /// The members' Hugging Face names inside a layer.
    pub const fn members(self) -> &'static [&'static str] {
        match self {
            Group::Qkv => &["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"],
            Group::O => &["self_attn.o_proj"],
            Group::GateUp => &["mlp.gate_proj", "mlp.up_proj"],
            Group::Down => &["mlp.down_proj"],
        }
    }

    /// The input site: where TEAL thresholds and calibration statistics of the group's input
    /// belong.
    pub const fn site(self) -> Site {
        match self {
            Group::Qkv => Site::AttnIn,
            Group::O => Site::OProjIn,
            Group::GateUp => Site::MlpIn,
            Group::Down => Site::DownProjIn,
        }
    }

    /// Whether the product is added into the residual stream (o, down) rather than written.
    pub const fn adds_to_residual(self) -> bool {
        matches!(self, Group::O | Group::Down)
    }

    pub const fn name(self) -> &'static str {
        match self {
            Group::Qkv => "q|k|v",
            Group::O => "o_proj",
            Group::GateUp => "gate|up",
            Group::Down => "down_proj",
        }
    }
}

/// Which RMSNorm of a layer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Norm {
    /// Before attention (`input_layernorm`).
    Attention,
    /// Before the MLP (`post_attention_layernorm`).
    Mlp,
}

/// One op of a decoder layer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LayerOp {
    /// `xn = RMSNorm(x) * weight`.
    Norm(Norm),
    /// The group's product (plus its biases, after its activation threshold).
    Product(Group),
    /// RoPE on q and k, then k and v written into the KV cache at the step's position.
    RopeKv,
    /// Causal attention of q over the cache: `att`.
    Attention,
    /// `h = silu(gate) * up`.
    SwiGlu,
}

impl LayerOp {
    pub fn name(self) -> &'static str {
        match self {
            LayerOp::Norm(Norm::Attention) => "attention norm",
            LayerOp::Norm(Norm::Mlp) => "mlp norm",
            LayerOp::Product(g) => g.name(),
            LayerOp::RopeKv => "rope + kv write",
            LayerOp::Attention => "attention",
            LayerOp::SwiGlu => "swiglu",
        }
    }
}

/// A decoder layer, the one place its order is written.
pub const LAYER: [LayerOp; 9] = [
    LayerOp::Norm(Norm::Attention),
    LayerOp::Product(Group::Qkv),
    LayerOp::RopeKv,
    LayerOp::Attention,
    LayerOp::Product(Group::O),
    LayerOp::Norm(Norm::Mlp),
    LayerOp::Product(Group::GateUp),
    LayerOp::SwiGlu,
    LayerOp::Product(Group::Down),
];

/// One op of a whole decode step.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StepOp {
    /// The token's embedding row into `x`.
    Embed,
    /// Op `1` of layer `0`.
    Layer(usize, LayerOp),
    /// The final RMSNorm.
    FinalNorm,
    /// The LM head: logits.
    LmHead,
    /// The next token: sampled from the logits, or (teacher forcing) read from the history.
    Next,
}

/// The ops of a decode step of a model with `num_layers` layers, in order.
pub fn step_ops(num_layers: usize) -> Vec<StepOp> {
    let mut ops = Vec::with_capacity(num_layers * LAYER.len() + 4);
    ops.push(StepOp::Embed);
    for l in 0..num_layers {
        ops.extend(LAYER.iter().map(|&op| StepOp::Layer(l, op)));
    }
    ops.extend([StepOp::FinalNorm, StepOp::LmHead, StepOp::Next]);
    ops
}

/// What one projection of a product stores.
#[derive(Clone, Debug, PartialEq)]
pub struct Member {
    /// Hugging Face name inside the layer (`self_attn.q_proj`), or `lm_head`.
    pub name: &'static str,
    pub rows: usize,
    pub cols: usize,
    pub format: FormatKind,
    /// The GGUF block type (`Q4_K`, ...) when the weights are kept in their blocks.
    pub blocks: Option<String>,
    pub bias: bool,
    /// A TEAL threshold is set (activation sparsity at run time).
    pub thresholded: bool,
}

/// One product of the plan: a layer's group, or the LM head (`layer` and `group` `None`).
#[derive(Clone, Debug, PartialEq)]
pub struct Product {
    pub layer: Option<usize>,
    pub group: Option<Group>,
    pub members: Vec<Member>,
}

impl Product {
    /// `layer 3 q|k|v` or `lm_head`, for messages.
    pub fn label(&self) -> String {
        match (self.layer, self.group) {
            (Some(l), Some(g)) => format!("layer {l} {}", g.name()),
            _ => "lm_head".to_string(),
        }
    }
}

/// How a backend treats GGUF quantized blocks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BlockSupport {
    /// Multiplied from the blocks.
    Native,
    /// Dequantized to f16 when the model is loaded onto the backend (a note, not an error).
    DequantizedToF16,
    /// The named block types (`"Q4_0"`) multiplied from their blocks, every other type
    /// dequantized to f16 on load (a note).
    NativeFor(&'static [&'static str]),
}

impl BlockSupport {
    /// Whether a matrix in blocks of type `ty` is dequantized to f16 on this backend.
    pub fn dequantizes(self, ty: &str) -> bool {
        match self {
            BlockSupport::Native => false,
            BlockSupport::DequantizedToF16 => true,
            BlockSupport::NativeFor(types) => !types.contains(&ty),
        }
    }
}

/// What a backend can execute; [`Plan::check`] compares the plan with it.
#[derive(Clone, Debug)]
pub struct Capabilities {
    /// The backend's name for messages (`cpu`, `cuda`).
    pub backend: &'static str,
    /// Weight formats its products multiply.
    pub formats: &'static [FormatKind],
    pub blocks: BlockSupport,
    /// Groups whose members may carry biases.
    pub bias_groups: &'static [Group],
    /// Whether the projections of one layer may be stored in different formats.
    pub mixed_formats_in_layer: bool,
}

impl Capabilities {
    /// The CPU executor runs everything a model can hold.
    pub const CPU: Capabilities = Capabilities {
        backend: "cpu",
        formats: &FormatKind::ALL,
        blocks: BlockSupport::Native,
        bias_groups: &Group::ALL,
        mixed_formats_in_layer: true,
    };
}

/// A loaded model, described as the ops of its step and the products they multiply.
#[derive(Clone, Debug)]
pub struct Plan {
    pub num_layers: usize,
    /// Every layer's four products in [`Group::ALL`] order, then the LM head.
    pub products: Vec<Product>,
}

fn member(name: &'static str, lin: &crate::linear::Linear) -> Member {
    Member {
        name,
        rows: lin.rows(),
        cols: lin.cols(),
        format: lin.format().kind(),
        blocks: lin.block_type().map(|b| format!("{b:?}")),
        bias: lin.bias().is_some(),
        thresholded: lin.threshold().is_some(),
    }
}

impl Plan {
    /// The plan of `model`: nothing is copied but shapes, formats and flags.
    pub fn of(model: &Model) -> Plan {
        let mut products = Vec::with_capacity(model.layers().len() * 4 + 1);
        for (l, layer) in model.layers().iter().enumerate() {
            let linears = layer.linears();
            for group in Group::ALL {
                let members = group
                    .members()
                    .iter()
                    .map(|&name| {
                        let lin = linears
                            .iter()
                            .find(|(n, _)| *n == name)
                            .map(|(_, lin)| *lin)
                            .expect("every group member is one of the layer's seven linears");
                        member(name, lin)
                    })
                    .collect();
                products.push(Product {
                    layer: Some(l),
                    group: Some(group),
                    members,
                });
            }
        }
        products.push(Product {
            layer: None,
            group: None,
            members: vec![member("lm_head", model.lm_head())],
        });
        Plan {
            num_layers: model.layers().len(),
            products,
        }
    }

    /// The ops of one decode step.
    pub fn step_ops(&self) -> Vec<StepOp> {
        step_ops(self.num_layers)
    }

    /// Checks that `caps`' backend can run every op of the plan. Returns the notes of what it
    /// will convert (GGUF blocks dequantized), or an [`ModelError::Unsupported`] naming the first
    /// product it cannot run: its layer, op, projection and format.
    pub fn check(&self, caps: &Capabilities) -> Result<Vec<String>> {
        let mut notes = Vec::new();
        let mut dequantized = 0usize;
        let mut dequantized_types: Vec<String> = Vec::new();
        for product in &self.products {
            for m in &product.members {
                if !caps.formats.contains(&m.format) {
                    return Err(ModelError::Unsupported(format!(
                        "{}: {} is stored as {:?}, which the {} backend has no kernel for \
                         (it runs {:?})",
                        product.label(),
                        m.name,
                        m.format,
                        caps.backend,
                        caps.formats
                    )));
                }
                if let Some(ty) = m.blocks.as_deref().filter(|ty| caps.blocks.dequantizes(ty)) {
                    dequantized += 1;
                    if !dequantized_types.iter().any(|t| t == ty) {
                        dequantized_types.push(ty.to_string());
                    }
                }
                let bias_ok = product.group.is_some_and(|g| caps.bias_groups.contains(&g));
                if m.bias && !bias_ok {
                    return Err(ModelError::Unsupported(format!(
                        "{}: {} has a bias, which the {} backend adds only in {:?}",
                        product.label(),
                        m.name,
                        caps.backend,
                        caps.bias_groups
                            .iter()
                            .map(|g| g.name())
                            .collect::<Vec<_>>()
                    )));
                }
            }
        }
        if !caps.mixed_formats_in_layer {
            for l in 0..self.num_layers {
                let mut formats = self
                    .products
                    .iter()
                    .filter(|p| p.layer == Some(l))
                    .flat_map(|p| p.members.iter().map(|m| (m.name, m.format)));
                if let Some((first_name, first)) = formats.next() {
                    if let Some((name, other)) = formats.find(|(_, f)| *f != first) {
                        return Err(ModelError::Unsupported(format!(
                            "layer {l}: {first_name} is {first:?} but {name} is {other:?}; the {} \
                             backend runs one format per layer",
                            caps.backend
                        )));
                    }
                }
            }
        }
        if dequantized > 0 {
            notes.push(format!(
                "{dequantized} matrices in GGUF quantized blocks ({}) are dequantized to f16 on the \
                 {} backend (no block kernels there for these types yet)",
                dequantized_types.join(", "),
                caps.backend
            ));
        }
        Ok(notes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_layer_runs_each_group_once_after_its_input_exists() {
        let products: Vec<Group> = LAYER
            .iter()
            .filter_map(|op| match op {
                LayerOp::Product(g) => Some(*g),
                _ => None,
            })
            .collect();
        assert_eq!(products, Group::ALL);
        let at = |op: LayerOp| LAYER.iter().position(|&o| o == op).unwrap();
        assert!(at(LayerOp::Norm(Norm::Attention)) < at(LayerOp::Product(Group::Qkv)));
        assert!(at(LayerOp::Product(Group::Qkv)) < at(LayerOp::RopeKv));
        assert!(at(LayerOp::RopeKv) < at(LayerOp::Attention));
        assert!(at(LayerOp::Attention) < at(LayerOp::Product(Group::O)));
        assert!(at(LayerOp::Product(Group::O)) < at(LayerOp::Norm(Norm::Mlp)));
        assert!(at(LayerOp::Norm(Norm::Mlp)) < at(LayerOp::Product(Group::GateUp)));
        assert!(at(LayerOp::SwiGlu) < at(LayerOp::Product(Group::Down)));
        let ops = step_ops(3);
        assert_eq!(ops.len(), 3 * LAYER.len() + 4);
        assert_eq!(ops[0], StepOp::Embed);
        assert_eq!(ops[1], StepOp::Layer(0, LayerOp::Norm(Norm::Attention)));
        assert_eq!(ops[ops.len() - 1], StepOp::Next);
    }

    #[test]
    fn every_linear_of_a_layer_belongs_to_exactly_one_group() {
        let mut names: Vec<&str> = Group::ALL
            .iter()
            .flat_map(|g| g.members())
            .copied()
            .collect();
        names.sort_unstable();
        let mut layer = crate::llama::LAYER_LINEARS.to_vec();
        layer.sort_unstable();
        assert_eq!(names, layer);
    }

    fn plan(formats: [FormatKind; 7], bias_on: Option<&'static str>) -> Plan {
        let mut products = Vec::new();
        let mut i = 0;
        for group in Group::ALL {
            let members = group
                .members()
                .iter()
                .map(|&name| {
                    let m = Member {
                        name,
                        rows: 8,
                        cols: 8,
                        format: formats[i],
                        blocks: None,
                        bias: bias_on == Some(name),
                        thresholded: false,
                    };
                    i += 1;
                    m
                })
                .collect();
            products.push(Product {
                layer: Some(0),
                group: Some(group),
                members,
            });
        }
        Plan {
            num_layers: 1,
            products,
        }
    }

    const ONE_FORMAT: Capabilities = Capabilities {
        backend: "test",
        formats: &[FormatKind::Dense, FormatKind::TiledCbc],
        blocks: BlockSupport::DequantizedToF16,
        bias_groups: &[Group::Qkv],
        mixed_formats_in_layer: false,
    };

    #[test]
    fn check_names_the_layer_op_projection_and_format_it_refuses() {
        let dense = [FormatKind::Dense; 7];
        assert!(plan(dense, None).check(&ONE_FORMAT).unwrap().is_empty());
        assert!(plan(dense, Some("self_attn.k_proj"))
            .check(&ONE_FORMAT)
            .is_ok());

        let mut slide = dense;
        slide[4] = FormatKind::Slide;
        let e = plan(slide, None)
            .check(&ONE_FORMAT)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("layer 0 gate|up") && e.contains("mlp.gate_proj"),
            "{e}"
        );
        assert!(e.contains("Slide") && e.contains("test backend"), "{e}");
        assert!(plan(slide, None).check(&Capabilities::CPU).is_ok());

        let e = plan(dense, Some("mlp.down_proj"))
            .check(&ONE_FORMAT)
            .unwrap_err()
            .to_string();
        assert!(e.contains("layer 0 down_proj") && e.contains("bias"), "{e}");

        let mut mixed = dense;
        mixed[6] = FormatKind::TiledCbc;
        let e = plan(mixed, None)
            .check(&ONE_FORMAT)
            .unwrap_err()
            .to_string();
        assert!(e.contains("mlp.down_proj is TiledCbc"), "{e}");
        assert!(plan(mixed, None).check(&Capabilities::CPU).is_ok());
    }
}

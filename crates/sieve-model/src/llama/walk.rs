//! The calibration executor of [`plan::LAYER`]: one window of `n` tokens through one decoder
//! layer, at positions `0..n` with causal attention inside the window and no cache, pausing
//! before each product with the product's input in hand.
//!
//! A paused walk lets its caller read that input (a [`Site`](super::Site)'s activations), change the
//! layer's weights (prune the product about to run) and go on: every op reads the layer's
//! weights when it runs. [`Model::forward_layer`] is the walk through all four pauses with an
//! observer at each; `sieve-prune`'s pipeline keeps one walk per calibration window and
//! prunes each group of the layer between two pauses.
//!
//! Buffers an op has consumed are freed, so a paused walk holds the borrowed residual stream
//! `x` and one product's input: `xn` (`[n][d]`) before q|k|v and gate|up, `att`
//! (`[n][H*hd]`) before o, `h = silu(gate) * up` (`[n][I]`) before down.
//!
//! The kernels are those the calibration statistics have always been taken with, which differ
//! from [`Model::forward`]'s in the last bits: each member of a group is its own product
//! ([`Linear::forward`], not [`Linear::forward_group`]), the window's keys and values are
//! rounded to f16 (as the cache stores them) and read as f32, and SwiGLU is
//! [`kernels::silu_mul`].
//!
//! [`Linear::forward`]: crate::linear::Linear::forward
//! [`Linear::forward_group`]: crate::linear::Linear::forward_group

use super::{add_into, apply_rope, rms_norm, Model};
use crate::error::{ModelError, Result};
use crate::plan::{self, Group, LayerOp};
use half::f16;
use sieve_cpu::kernels;
use std::mem::take;

/// One window walking one decoder layer ([`Model::walk_layer`]); see the module docs.
#[derive(Debug)]
pub struct LayerWalk<'x> {
    layer: usize,
    n: usize,
    /// The residual stream, `[n][d]`, updated in place by o and down.
    x: &'x mut [f32],
    /// Index in [`plan::LAYER`] of the next op; `None` once an op has failed.
    next: Option<usize>,
    xn: Vec<f32>,
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    att: Vec<f32>,
    /// `gate`, then `h = silu(gate) * up` in place.
    gate: Vec<f32>,
    up: Vec<f32>,
}

/// The position of `group`'s product in [`plan::LAYER`].
fn product_at(group: Group) -> usize {
    plan::LAYER
        .iter()
        .position(|&op| op == LayerOp::Product(group))
        .expect("every group has a product in the layer")
}

impl Model {
    /// Starts a walk of decoder layer `layer` over the residual stream `x` of one window of `n`
    /// tokens (`[n][d]`), positions `0..n` (see [`LayerWalk`]). Nothing runs until the walk is
    /// asked for an input or finished.
    pub fn walk_layer<'x>(
        &self,
        layer: usize,
        x: &'x mut [f32],
        n: usize,
    ) -> Result<LayerWalk<'x>> {
        self.checked_layer(layer, x, n)?;
        Ok(LayerWalk {
            layer,
            n,
            x,
            next: Some(0),
            xn: Vec::new(),
            q: Vec::new(),
            k: Vec::new(),
            v: Vec::new(),
            att: Vec::new(),
            gate: Vec::new(),
            up: Vec::new(),
        })
    }
}

impl LayerWalk<'_> {
    /// Tokens (rows) of the window.
    pub fn rows(&self) -> usize {
        self.n
    }

    /// Runs the layer's ops up to `group`'s product (not included) and returns its input,
    /// `[n][K]` rows of the group's [`Group::site`]. Asking again for the same group runs
    /// nothing; a group the walk has already multiplied is an error.
    pub fn input(&mut self, model: &Model, group: Group) -> Result<&[f32]> {
        self.run_to(model, product_at(group))?;
        Ok(match group {
            Group::Qkv | Group::GateUp => &self.xn,
            Group::O => &self.att,
            Group::Down => &self.gate,
        })
    }

    /// Runs the rest of the layer: `x` then holds the layer's output.
    pub fn finish(mut self, model: &Model) -> Result<()> {
        self.run_to(model, plan::LAYER.len())
    }

    /// Runs ops `next..end` of [`plan::LAYER`]. A failed op leaves the walk unusable.
    fn run_to(&mut self, model: &Model, end: usize) -> Result<()> {
        let Some(next) = self.next else {
            return Err(ModelError::InvalidArgument(format!(
                "layer {}: the walk stopped at an error",
                self.layer
            )));
        };
        if next > end {
            return Err(ModelError::InvalidArgument(format!(
                "layer {}: the walk is already past {}",
                self.layer,
                plan::LAYER[end].name()
            )));
        }
        self.next = None;
        for at in next..end {
            self.run(model, plan::LAYER[at])?;
        }
        self.next = Some(end);
        Ok(())
    }

    /// One op of the plan, with this executor's kernel for it.
    fn run(&mut self, model: &Model, op: LayerOp) -> Result<()> {
        let layer = model.checked_layer(self.layer, self.x, self.n)?;
        let c = model.config();
        let n = self.n;
        let (d, hd, inter) = (c.hidden_size, c.head_dim, c.intermediate_size);
        let (nh, nkv) = (c.num_heads, c.num_kv_heads);
        match op {
            LayerOp::Norm(which) => {
                self.xn = vec![0f32; n * d];
                rms_norm(self.x, layer.norm(which), c.rms_norm_eps, &mut self.xn);
            }
            LayerOp::Product(Group::Qkv) => {
                let xn = take(&mut self.xn);
                self.q = vec![0f32; n * nh * hd];
                self.k = vec![0f32; n * nkv * hd];
                self.v = vec![0f32; n * nkv * hd];
                layer.q_proj.forward(&xn, n, &mut self.q)?;
                layer.k_proj.forward(&xn, n, &mut self.k)?;
                layer.v_proj.forward(&xn, n, &mut self.v)?;
            }
            LayerOp::RopeKv => {
                let (cos, sin) = model.rope_tables(0, n);
                apply_rope(&mut self.q, nh, hd, &cos, &sin);
                apply_rope(&mut self.k, nkv, hd, &cos, &sin);
                // Without a cache the window's own keys and values are every visible position;
                // they are rounded to f16 as the cache would store them, so calibration sees the
                // attention inference computes.
                for x in self.k.iter_mut().chain(self.v.iter_mut()) {
                    *x = f16::from_f32(*x).to_f32();
                }
            }
            LayerOp::Attention => {
                let (q, k, v) = (take(&mut self.q), take(&mut self.k), take(&mut self.v));
                self.att = vec![0f32; n * nh * hd];
                model.attention(&q, &k, &v, 0, n, &mut self.att);
            }
            LayerOp::Product(Group::O) => {
                let att = take(&mut self.att);
                let mut proj = vec![0f32; n * d];
                layer.o_proj.forward(&att, n, &mut proj)?;
                add_into(self.x, &proj);
            }
            LayerOp::Product(Group::GateUp) => {
                let xn = take(&mut self.xn);
                self.gate = vec![0f32; n * inter];
                self.up = vec![0f32; n * inter];
                layer.gate_proj.forward(&xn, n, &mut self.gate)?;
                layer.up_proj.forward(&xn, n, &mut self.up)?;
            }
            LayerOp::SwiGlu => kernels::silu_mul(&mut self.gate, &take(&mut self.up)),
            LayerOp::Product(Group::Down) => {
                let h = take(&mut self.gate);
                let mut proj = vec![0f32; n * d];
                layer.down_proj.forward(&h, n, &mut proj)?;
                add_into(self.x, &proj);
            }
        }
        Ok(())
    }
}

//! `Linear`: the seam where any weight format plugs into the model.
//!
//! A `Linear` is `y = W · x (+ b)` with `W` (M outputs x K inputs) held as a
//! `Box<dyn WeightFormat>`, so a dense layer, a pruned layer in any sparse format, or a layer
//! loaded from a packed blob all look the same to the forward pass. An optional TEAL threshold
//! `t` makes the format skip inputs with `|x| <= t`.
//!
//! Dense layers built here use `sieve_cpu::dense::FastDense` (f16 rows, AVX2/F16C kernels); the
//! kernels of every format are in the `sieve-cpu` crate.

use crate::error::{ModelError, Result};
use crate::weights::Tensor;
use sieve_cpu::dense::FastDense;
use sieve_cpu::gguf_blocks::{self, QuantMatrix};
use sieve_cpu::{balanced_cbc, ie_bme};
use sieve_formats::format::{check_product_args, check_threshold};
use sieve_formats::{DenseMatrix, Threshold, WeightFormat};

/// One linear layer: a packed weight matrix, an optional bias and an optional activation threshold.
#[derive(Debug)]
pub struct Linear {
    weight: Weight,
    bias: Option<Vec<f32>>,
    threshold: Threshold,
    /// Round each token's (masked) input to INT8 with one scale before the product, as the
    /// GPU's W4A8 kernels do (`--activations int8`): the CPU's measure of what that costs.
    int8_inputs: bool,
}

/// GGUF blocks are held by type so that [`Linear::forward_group`] can fuse their products;
/// every other format behind the trait.
#[derive(Debug)]
enum Weight {
    Blocks(QuantMatrix),
    Format(Box<dyn WeightFormat>),
}

impl Weight {
    fn format(&self) -> &dyn WeightFormat {
        match self {
            Weight::Blocks(q) => q,
            Weight::Format(f) => f.as_ref(),
        }
    }
}

impl Linear {
    /// Wraps any packed weight matrix (M x K).
    pub fn from_format(weight: Box<dyn WeightFormat>) -> Self {
        Self {
            weight: Weight::Format(weight),
            bias: None,
            threshold: None,
            int8_inputs: false,
        }
    }

    /// Wraps a matrix of GGUF quantized blocks.
    pub fn from_quantized(weight: QuantMatrix) -> Self {
        Self {
            weight: Weight::Blocks(weight),
            bias: None,
            threshold: None,
            int8_inputs: false,
        }
    }

    /// Builds a dense f16 layer from a row-major f32 matrix of `rows` x `cols`.
    pub fn from_dense_f32(rows: usize, cols: usize, data: &[f32]) -> Result<Self> {
        let matrix = DenseMatrix::from_f32(rows, cols, data)?;
        Ok(Self::from_format(Box::new(FastDense::new(matrix))))
    }

    /// Builds a dense f16 layer from a 2-D tensor of shape `[out_features, in_features]`.
    pub fn from_tensor(name: &str, tensor: &Tensor) -> Result<Self> {
        match tensor.shape.as_slice() {
            [rows, cols] => Self::from_dense_f32(*rows, *cols, &tensor.data),
            _ => Err(ModelError::InvalidArgument(format!(
                "tensor '{name}' has shape {:?}, a linear layer needs 2 dimensions",
                tensor.shape
            ))),
        }
    }

    /// Adds (or replaces) the bias; its length must be M.
    pub fn with_bias(mut self, bias: Vec<f32>) -> Result<Self> {
        if bias.len() != self.rows() {
            return Err(ModelError::InvalidArgument(format!(
                "bias has {} elements, the layer has {} outputs",
                bias.len(),
                self.rows()
            )));
        }
        if bias.iter().any(|b| !b.is_finite()) {
            return Err(ModelError::InvalidArgument(
                "bias has a non-finite value".into(),
            ));
        }
        self.bias = Some(bias);
        Ok(self)
    }

    /// Sets the TEAL activation threshold (`None` uses every input).
    pub fn set_threshold(&mut self, threshold: Threshold) -> Result<()> {
        check_threshold(threshold)?;
        self.threshold = threshold;
        Ok(())
    }

    pub fn threshold(&self) -> Threshold {
        self.threshold
    }
    pub fn bias(&self) -> Option<&[f32]> {
        self.bias.as_deref()
    }
    pub fn format(&self) -> &dyn WeightFormat {
        self.weight.format()
    }
    /// Whether the weights are GGUF quantized blocks (whose `format().kind()` reads as dense,
    /// the format they serialize to).
    pub fn is_quantized_blocks(&self) -> bool {
        matches!(self.weight, Weight::Blocks(_))
    }
    /// The GGUF block type, when the weights are quantized blocks.
    pub fn block_type(&self) -> Option<gguf_blocks::BlockType> {
        match &self.weight {
            Weight::Blocks(q) => Some(q.block_type()),
            _ => None,
        }
    }
    /// The GGUF blocks themselves, when the weights are quantized blocks (for backends that
    /// multiply them as they are).
    pub fn quant_blocks(&self) -> Option<&QuantMatrix> {
        match &self.weight {
            Weight::Blocks(q) => Some(q),
            _ => None,
        }
    }
    /// Replaces the weight matrix, keeping bias and threshold; the shape must not change.
    pub fn replace_format(&mut self, weight: Box<dyn WeightFormat>) -> Result<()> {
        if weight.rows() != self.rows() || weight.cols() != self.cols() {
            return Err(ModelError::InvalidArgument(format!(
                "replacement weight is {}x{}, the layer is {}x{}",
                weight.rows(),
                weight.cols(),
                self.rows(),
                self.cols()
            )));
        }
        self.weight = Weight::Format(weight);
        Ok(())
    }
    /// M, the number of outputs.
    pub fn rows(&self) -> usize {
        self.format().rows()
    }
    /// K, the number of inputs.
    pub fn cols(&self) -> usize {
        self.format().cols()
    }

    /// Rounds each token's input to INT8 (one scale per 128 columns, after the threshold's mask)
    /// before the product from now on, or stops: the GPU's W4A8 path
    /// (`sieve_cuda::w4a8`) on the CPU, for measuring its quality.
    pub fn set_int8_inputs(&mut self, on: bool) {
        self.int8_inputs = on;
    }
    pub fn int8_inputs(&self) -> bool {
        self.int8_inputs
    }

    /// `Y = X · Wᵀ + b` for `n` rows of activations: `x` is n x K, `y` is n x M (row-major).
    /// One row goes through the format's `matvec`, several through its `matmul`.
    pub fn forward(&self, x: &[f32], n: usize, y: &mut [f32]) -> Result<()> {
        let rounded;
        let (x, threshold) = if self.int8_inputs {
            check_product_args(self.rows(), self.cols(), x, n, self.threshold, y)?;
            rounded = int8_round_trip(x, self.cols(), self.threshold);
            (&rounded[..], None)
        } else {
            (x, self.threshold)
        };
        if n == 1 {
            self.format().matvec(x, threshold, y)?;
        } else {
            self.format().matmul(x, n, threshold, y)?;
        }
        self.add_bias(y);
        Ok(())
    }

    fn add_bias(&self, y: &mut [f32]) {
        if let Some(bias) = &self.bias {
            for row in y.chunks_exact_mut(bias.len()) {
                for (o, b) in row.iter_mut().zip(bias) {
                    *o += b;
                }
            }
        }
    }

    /// `ys[i] = linears[i].forward(x)` for layers that share their input (q/k/v, gate/up).
    /// Through GGUF blocks under one threshold, `x` is quantized once for all of them (and for
    /// one token a single parallel pass covers all their rows); otherwise each runs on its own.
    pub fn forward_group(
        linears: &[&Linear],
        x: &[f32],
        n: usize,
        ys: &mut [&mut [f32]],
    ) -> Result<()> {
        if linears.len() != ys.len() {
            return Err(ModelError::InvalidArgument(format!(
                "{} linears but {} outputs",
                linears.len(),
                ys.len()
            )));
        }
        if linears.iter().any(|l| l.int8_inputs) {
            // Each rounds its own input (the same rows for a shared threshold).
            for (l, y) in linears.iter().zip(ys.iter_mut()) {
                l.forward(x, n, y)?;
            }
            return Ok(());
        }
        let blocks: Option<Vec<&QuantMatrix>> = linears
            .iter()
            .map(|l| match &l.weight {
                Weight::Blocks(q) if l.threshold == linears[0].threshold => Some(q),
                _ => None,
            })
            .collect();
        if n == 1 {
            if let Some(mats) = int4_ie_bme_group(linears) {
                ie_bme::matvec_group(&mats, x, linears[0].threshold, ys)?;
                for (l, y) in linears.iter().zip(ys.iter_mut()) {
                    l.add_bias(y);
                }
                return Ok(());
            }
            if let Some(mats) = format_group::<balanced_cbc::FastBalancedCbc>(linears) {
                balanced_cbc::matvec_group(&mats, x, linears[0].threshold, ys)?;
                for (l, y) in linears.iter().zip(ys.iter_mut()) {
                    l.add_bias(y);
                }
                return Ok(());
            }
        }
        match blocks {
            Some(mats) => {
                let threshold = linears[0].threshold;
                for (m, y) in mats.iter().zip(ys.iter()) {
                    check_product_args(m.rows(), m.cols(), x, n, threshold, y)?;
                }
                if n == 1 {
                    gguf_blocks::matvec_group(&mats, x, threshold, ys);
                } else {
                    gguf_blocks::matmul_group(&mats, x, n, threshold, ys)?;
                }
                for (l, y) in linears.iter().zip(ys.iter_mut()) {
                    l.add_bias(y);
                }
            }
            _ => {
                for (l, y) in linears.iter().zip(ys.iter_mut()) {
                    l.forward(x, n, y)?;
                }
            }
        }
        Ok(())
    }
}

/// `x` (rows of `k`) with each row masked by `threshold`, quantized in groups of 128 columns by
/// [`sieve_formats::eight_bit::int8_groups`] and dequantized: the values a W4A8 product multiplies.
fn int8_round_trip(x: &[f32], k: usize, threshold: Threshold) -> Vec<f32> {
    x.chunks(k.max(1))
        .flat_map(|row| {
            let masked: Vec<f32> = row
                .iter()
                .map(|&v| match threshold {
                    Some(t) if v.abs() <= t => 0.0,
                    _ => v,
                })
                .collect();
            use sieve_formats::eight_bit::{int8_groups, INT8_ACTIVATION_GROUP};
            int8_groups(&masked, INT8_ACTIVATION_GROUP).dequantize()
        })
        .collect()
}

/// The IE-BME INT4 matrices of `linears` when every one of them is one and they share a
/// threshold (what [`ie_bme::matvec_group`] needs).
fn int4_ie_bme_group<'a>(linears: &[&'a Linear]) -> Option<Vec<&'a ie_bme::Int4IeBme>> {
    format_group(linears)
}

/// The weights of `linears` as `F` when every one of them is an `F` and they share a
/// threshold (what the group products of the fast formats need).
fn format_group<'a, F: 'static>(linears: &[&'a Linear]) -> Option<Vec<&'a F>> {
    linears
        .iter()
        .map(|l| match &l.weight {
            Weight::Format(f) if l.threshold == linears[0].threshold => {
                f.as_any()?.downcast_ref::<F>()
            }
            _ => None,
        })
        .collect()
}

/// Products over the rows of several independent sequences (one decode token each), where
/// every output row must equal a one-row [`Linear::forward`] of that row bit for bit: a
/// batched server's greedy answer is then the single-request answer. GGUF blocks run the
/// small-batch integer kernel (each weight row read once for up to
/// [`gguf_blocks::SMALL_BATCH`] tokens); any other format runs one `matvec` per row.
impl Linear {
    /// `Y = X · Wᵀ + b` for `n` independent rows, each bit-identical to `forward(row, 1)`.
    pub fn forward_rows(&self, x: &[f32], n: usize, y: &mut [f32]) -> Result<()> {
        Self::forward_rows_group(&[self], x, n, &mut [y])
    }

    /// [`Linear::forward_group`] with the guarantee of [`Linear::forward_rows`].
    pub fn forward_rows_group(
        linears: &[&Linear],
        x: &[f32],
        n: usize,
        ys: &mut [&mut [f32]],
    ) -> Result<()> {
        if linears.len() != ys.len() {
            return Err(ModelError::InvalidArgument(format!(
                "{} linears but {} outputs",
                linears.len(),
                ys.len()
            )));
        }
        let Some(first) = linears.first() else {
            return Ok(());
        };
        let k = first.cols();
        for (l, y) in linears.iter().zip(ys.iter()) {
            check_product_args(l.rows(), l.cols(), x, n, l.threshold, y)?;
        }
        let blocks: Option<Vec<&QuantMatrix>> = linears
            .iter()
            .map(|l| match &l.weight {
                Weight::Blocks(q) if l.threshold == first.threshold => Some(q),
                _ => None,
            })
            .collect();
        match blocks {
            Some(mats) => {
                // Chunks of at most SMALL_BATCH rows take the per-token decode kernel.
                let step = gguf_blocks::SMALL_BATCH;
                for r0 in (0..n).step_by(step) {
                    let rows = step.min(n - r0);
                    let mut chunk: Vec<&mut [f32]> = ys
                        .iter_mut()
                        .zip(&mats)
                        .map(|(y, m)| &mut y[r0 * m.rows()..(r0 + rows) * m.rows()])
                        .collect();
                    gguf_blocks::matmul_group(
                        &mats,
                        &x[r0 * k..(r0 + rows) * k],
                        rows,
                        first.threshold,
                        &mut chunk,
                    )?;
                }
                for (l, y) in linears.iter().zip(ys.iter_mut()) {
                    l.add_bias(y);
                }
            }
            None => {
                for (l, y) in linears.iter().zip(ys.iter_mut()) {
                    let m = l.rows();
                    for r in 0..n {
                        l.forward(&x[r * k..(r + 1) * k], 1, &mut y[r * m..(r + 1) * m])?;
                    }
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lcg(seed: &mut u64) -> f32 {
        *seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((*seed >> 33) as f32 / (1u64 << 31) as f32) - 0.5
    }

    fn random(len: usize, seed: u64) -> Vec<f32> {
        let mut s = seed;
        (0..len).map(|_| lcg(&mut s)).collect()
    }

    #[test]
    fn linear_adds_bias_and_routes_one_row_to_matvec() {
        let w = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0];
        let lin = Linear::from_dense_f32(2, 3, &w)
            .unwrap()
            .with_bias(vec![0.5, -1.0])
            .unwrap();
        let mut y = [0f32; 2];
        lin.forward(&[1.0, 0.0, -1.0], 1, &mut y).unwrap();
        assert_eq!(y, [1.0 - 3.0 + 0.5, 4.0 - 6.0 - 1.0]);
        let mut y2 = [0f32; 4];
        lin.forward(&[1.0, 0.0, -1.0, 0.0, 1.0, 0.0], 2, &mut y2)
            .unwrap();
        assert_eq!(y2, [-1.5, -3.0, 2.5, 4.0]);
    }

    #[test]
    fn int8_inputs_round_each_token_after_the_mask() {
        // Row 0 of x: max 1.27, so the scale is 0.01 and 0.123 becomes 0.12; 0.004 is under
        // the threshold and dropped before the scale is taken. Row 1 scales on its own.
        let mut lin = Linear::from_dense_f32(1, 3, &[1.0, 10.0, 100.0]).unwrap();
        lin.set_threshold(Some(0.005)).unwrap();
        lin.set_int8_inputs(true);
        assert!(lin.int8_inputs());
        let x = [1.27, 0.123, 0.004, 0.0, 2.54, -0.2];
        let mut y = [0f32; 2];
        lin.forward(&x, 2, &mut y).unwrap();
        let want0 = 1.27 * 1.0 + 0.12 * 10.0;
        let want1 = 2.54 * 10.0 + -0.2 * 100.0;
        assert!((y[0] - want0).abs() < 1e-4, "{} vs {want0}", y[0]);
        assert!((y[1] - want1).abs() < 1e-3, "{} vs {want1}", y[1]);
        // The group path rounds the same way.
        let other = Linear::from_dense_f32(1, 3, &[1.0, 10.0, 100.0]).unwrap();
        let mut other = other;
        other.set_threshold(Some(0.005)).unwrap();
        other.set_int8_inputs(true);
        let (mut a, mut b) = ([0f32; 2], [0f32; 2]);
        Linear::forward_group(&[&lin, &other], &x, 2, &mut [&mut a[..], &mut b[..]]).unwrap();
        assert_eq!(a, y);
        assert_eq!(b, y);
        // Off again: the unrounded product.
        lin.set_int8_inputs(false);
        lin.forward(&x[..3], 1, &mut y[..1]).unwrap();
        assert!((y[0] - (1.27 + 1.23)).abs() < 1e-5);
        // Shapes are still checked.
        lin.set_int8_inputs(true);
        assert!(lin.forward(&x[..2], 1, &mut y[..1]).is_err());
    }

    #[test]
    fn linear_threshold_skips_small_inputs() {
        let mut lin = Linear::from_dense_f32(1, 3, &[1.0, 10.0, 100.0]).unwrap();
        lin.set_threshold(Some(0.5)).unwrap();
        let mut y = [0f32; 1];
        lin.forward(&[1.0, 0.25, -0.75], 1, &mut y).unwrap();
        assert_eq!(y, [1.0 - 75.0]);
        assert!(lin.set_threshold(Some(f32::NAN)).is_err());
        assert!(lin.set_threshold(Some(-1.0)).is_err());
    }

    /// Q8_0 blocks with scale 0.01 and pseudo-random quants.
    fn q8_0_linear(rows: usize, cols: usize, seed: u64) -> Linear {
        let mut s = seed;
        let mut bytes = Vec::new();
        for _ in 0..rows * cols / 32 {
            bytes.extend_from_slice(&half::f16::from_f32(0.01).to_bits().to_le_bytes());
            bytes.extend((0..32).map(|_| (lcg(&mut s) * 255.0) as i8 as u8));
        }
        Linear::from_quantized(
            QuantMatrix::new(gguf_blocks::BlockType::Q8_0, rows, cols, bytes).unwrap(),
        )
    }

    #[test]
    fn grouped_forward_equals_one_forward_each() {
        let (q, k, v) = (
            q8_0_linear(96, 64, 1).with_bias(random(96, 2)).unwrap(),
            q8_0_linear(32, 64, 3),
            q8_0_linear(40, 64, 4),
        );
        let dense = Linear::from_dense_f32(32, 64, &random(32 * 64, 5)).unwrap();
        let x = random(2 * 64, 6);
        for n in [1, 2] {
            for group in [[&q, &k, &v], [&q, &dense, &v]] {
                let mut want: Vec<Vec<f32>> =
                    group.iter().map(|l| vec![0f32; n * l.rows()]).collect();
                for (l, y) in group.iter().zip(&mut want) {
                    l.forward(&x[..n * 64], n, y).unwrap();
                }
                let mut got: Vec<Vec<f32>> =
                    group.iter().map(|l| vec![f32::NAN; n * l.rows()]).collect();
                let mut outs: Vec<&mut [f32]> = got.iter_mut().map(|y| &mut y[..]).collect();
                Linear::forward_group(&group, &x[..n * 64], n, &mut outs).unwrap();
                assert_eq!(got, want);
            }
        }
        let mut short = vec![0f32; 95];
        let mut ok = vec![0f32; 32];
        assert!(Linear::forward_group(&[&q, &k], &x[..64], 1, &mut [&mut short, &mut ok]).is_err());
        assert!(Linear::forward_group(&[&q, &k], &x[..64], 1, &mut [&mut ok]).is_err());
    }

    #[test]
    fn row_products_equal_one_row_forward_bit_for_bit() {
        let (q, k) = (
            q8_0_linear(96, 64, 11).with_bias(random(96, 12)).unwrap(),
            q8_0_linear(40, 64, 13),
        );
        let dense = Linear::from_dense_f32(32, 64, &random(32 * 64, 14)).unwrap();
        // More rows than one small batch, so the chunking is exercised too.
        let n = gguf_blocks::SMALL_BATCH + 3;
        let x = random(n * 64, 15);
        for group in [vec![&q, &k], vec![&q, &dense], vec![&dense]] {
            let mut got: Vec<Vec<f32>> =
                group.iter().map(|l| vec![f32::NAN; n * l.rows()]).collect();
            let mut outs: Vec<&mut [f32]> = got.iter_mut().map(|y| &mut y[..]).collect();
            Linear::forward_rows_group(&group, &x, n, &mut outs).unwrap();
            for (l, y) in group.iter().zip(&got) {
                let m = l.rows();
                for r in 0..n {
                    let mut one = vec![0f32; m];
                    l.forward(&x[r * 64..(r + 1) * 64], 1, &mut one).unwrap();
                    assert_eq!(&y[r * m..(r + 1) * m], &one[..], "row {r}");
                }
            }
        }
        let mut short = vec![0f32; 95];
        assert!(q.forward_rows(&x[..64], 1, &mut short).is_err());
        let mut ok = vec![0f32; 96];
        assert!(Linear::forward_rows_group(&[&q, &k], &x[..64], 1, &mut [&mut ok]).is_err());
    }

    #[test]
    fn linear_refuses_bad_shapes() {
        let lin = Linear::from_dense_f32(2, 3, &[0.0; 6]).unwrap();
        let mut y = [0f32; 2];
        assert!(lin.forward(&[0.0; 4], 1, &mut y).is_err());
        assert!(lin.forward(&[0.0; 6], 2, &mut y).is_err());
        assert!(Linear::from_dense_f32(2, 3, &[0.0; 5]).is_err());
        assert!(Linear::from_dense_f32(1, 1, &[f32::NAN]).is_err());
        assert!(Linear::from_dense_f32(2, 3, &[0.0; 6])
            .unwrap()
            .with_bias(vec![0.0; 3])
            .is_err());
        let t = Tensor {
            shape: vec![6],
            data: vec![0.0; 6],
        };
        assert!(Linear::from_tensor("x", &t).is_err());
        let mut lin = lin;
        let other = FastDense::new(DenseMatrix::zeros(3, 2).unwrap());
        assert!(lin.replace_format(Box::new(other)).is_err());
    }

    #[test]
    fn linear_groups_of_balanced_cbc_run_as_one_group() {
        let t = Some(0.3);
        let lin = |rows: usize, seed: u64| {
            let w = sieve_formats::random::balanced_matrix(rows, 130, 8, seed).unwrap();
            let mut l =
                Linear::from_format(Box::new(sieve_cpu::balanced_cbc::FastBalancedCbc::new(
                    &sieve_formats::balanced_cbc::BalancedCbc::encode_with_slots(&w, 8).unwrap(),
                )));
            l.set_threshold(t).unwrap();
            l
        };
        let (a, b) = (lin(20, 50), lin(9, 51));
        let x = sieve_formats::random::activations(130, 52);
        let (mut ya, mut yb) = (vec![0f32; 20], vec![0f32; 9]);
        Linear::forward_group(&[&a, &b], &x, 1, &mut [&mut ya, &mut yb]).unwrap();
        let (mut wa, mut wb) = (vec![0f32; 20], vec![0f32; 9]);
        a.forward(&x, 1, &mut wa).unwrap();
        b.forward(&x, 1, &mut wb).unwrap();
        assert_eq!((ya, yb), (wa, wb));
    }

    /// An IE-BME INT4 matrix of random unstructured weights (as `sieve_cpu::ie_bme`'s tests build them).
    fn ie_bme_int4(
        rows: usize,
        cols: usize,
        sp: f64,
        group_size: usize,
        seed: u64,
    ) -> sieve_formats::ie_bme::IeBme {
        use sieve_formats::ie_bme::{IeBme, IeBmeOptions, Payload, Reorder};
        use sieve_formats::random::{sparse_matrix, Pattern};
        let w = sparse_matrix(rows, cols, sp, Pattern::Unstructured, seed).unwrap();
        let opts = IeBmeOptions {
            payload: Payload::Int4 { group_size },
            reorder: if seed.is_multiple_of(2) {
                Reorder::Greedy
            } else {
                Reorder::Off
            },
            ..IeBmeOptions::default()
        };
        IeBme::encode(&w, &opts).unwrap()
    }

    #[test]
    fn linear_groups_of_int4_ie_bme_run_as_one_group() {
        let t = Some(0.3);
        let lin = |rows: usize, seed: u64| {
            let mut l = Linear::from_format(Box::new(
                sieve_cpu::ie_bme::Int4IeBme::new(ie_bme_int4(rows, 130, 0.5, 64, seed)).unwrap(),
            ));
            l.set_threshold(t).unwrap();
            l
        };
        let (a, b) = (lin(20, 50), lin(9, 51));
        let x = sieve_formats::random::activations(130, 52);
        let (mut ya, mut yb) = (vec![0f32; 20], vec![0f32; 9]);
        Linear::forward_group(&[&a, &b], &x, 1, &mut [&mut ya, &mut yb]).unwrap();
        let (mut wa, mut wb) = (vec![0f32; 20], vec![0f32; 9]);
        a.forward(&x, 1, &mut wa).unwrap();
        b.forward(&x, 1, &mut wb).unwrap();
        assert_eq!((ya, yb), (wa, wb));
    }
}

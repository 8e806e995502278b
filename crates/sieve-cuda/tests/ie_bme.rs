//! The IE-BME kernels against the format's own CPU product (`WeightFormat::matvec`) on the same
//! activations rounded to f16: odd shapes (partial tiles in both directions), every area split
//! the kernels take, int4 and int8, reordered and plain rows, N = 1..32, TEAL thresholds, every
//! K chunk, accumulation. NaN-poisoned outputs. Without a GPU each test prints a skip reason
//! and passes, unless `SIEVE_REQUIRE_GPU=1`.

use half::f16;
use sieve_cuda::gpu_or_skip;
use sieve_cuda::ie_bme::{GpuIeBme, IeBmeDevice};
use sieve_cuda::{matvec_host, GpuAccumulate, GpuMatVec};
use sieve_formats::ie_bme::{IeBme, IeBmeOptions, Payload, Reorder};
use sieve_formats::random::{activations, sparse_matrix, threshold_for_sparsity, Pattern};
use sieve_formats::reference::max_rel_error;
use sieve_formats::{Threshold, WeightFormat};

const TOL: f64 = 1e-4;

/// `n` tokens of `k` activations, rounded to f16 (what the kernel multiplies).
fn x16(n: usize, k: usize, seed: u64) -> Vec<f32> {
    activations(n * k, seed)
        .into_iter()
        .map(|v| f16::from_f32(v).to_f32())
        .collect()
}

fn reference(enc: &IeBme, x: &[f32], n: usize, t: Threshold) -> Vec<f64> {
    let (m, k) = (enc.rows(), enc.cols());
    let mut out = Vec::with_capacity(n * m);
    let mut y = vec![0f32; m];
    for tok in 0..n {
        enc.matvec(&x[tok * k..(tok + 1) * k], t, &mut y).unwrap();
        out.extend(y.iter().map(|&v| v as f64));
    }
    out
}

fn encode(
    m: usize,
    k: usize,
    sp: f64,
    areas: (usize, usize),
    bits: usize,
    reorder: Reorder,
    seed: u64,
) -> IeBme {
    let w = sparse_matrix(m, k, sp, Pattern::Unstructured, seed).unwrap();
    let group_size = if seed.is_multiple_of(2) { 128 } else { 64 };
    let payload = if bits == 4 {
        Payload::Int4 { group_size }
    } else {
        Payload::Int8 { group_size }
    };
    let opts = IeBmeOptions {
        area_rows: areas.0,
        area_cols: areas.1,
        payload,
        reorder,
        stream_align: 1,
    };
    IeBme::encode(&w, &opts).unwrap()
}

#[test]
fn gpu_ie_bme_matches_the_format() {
    let Some(gpu) = gpu_or_skip("gpu_ie_bme_matches_the_format") else {
        return;
    };
    let shapes: &[(usize, usize)] = &[
        (1, 1),
        (7, 5),
        (17, 130),
        (33, 200),
        (300, 1000),
        (257, 4104),
    ];
    // Under compute-sanitizer (SIEVE_SANITIZE_SMALL=1) each launch is 10-100x slower: the small
    // shapes, and token counts that cover one tile, a partial one and the most a chunk takes.
    let small_only = std::env::var("SIEVE_SANITIZE_SMALL").as_deref() == Ok("1");
    let mut seed = 0u64;
    for &(m, k) in shapes {
        if small_only && m * k > 100_000 {
            continue;
        }
        for areas in [(2, 2), (1, 2), (2, 1), (1, 1)] {
            for bits in [4, 8] {
                for (sp, reorder) in [(0.5, Reorder::Greedy), (0.8, Reorder::Off)] {
                    seed += 1;
                    let enc = encode(m, k, sp, areas, bits, reorder, seed);
                    let dev = GpuIeBme::upload(&gpu, &IeBmeDevice::new(&enc).unwrap()).unwrap();
                    let what = format!("{m}x{k} sp {sp} {areas:?} int{bits} {reorder:?}");
                    let mut dev = dev;
                    for n in [1, 2, 3, 8, 9, 16, 17, 32] {
                        if small_only && ![1, 9, 32].contains(&n) {
                            continue;
                        }
                        let x = x16(n, k, seed ^ n as u64);
                        let want = reference(&enc, &x, n, None);
                        let xd = gpu.upload(&x).unwrap();
                        // The launcher's chunk, and chunks of 3 tiles and of the most the
                        // staging holds (multi-tile pipelines, odd lengths).
                        let most = if n <= 8 {
                            32
                        } else if n <= 16 {
                            16
                        } else {
                            8
                        };
                        for chunk in [0, 3, most] {
                            dev.chunk = chunk;
                            let mut y = gpu.poisoned_f32(n * m).unwrap();
                            dev.launch_tokens(&gpu, &xd, n, None, &mut y).unwrap();
                            gpu.synchronize().unwrap();
                            let e = max_rel_error(&gpu.download(&y).unwrap(), &want);
                            assert!(e < TOL, "{what} n={n} chunk {chunk}: rel error {e}");
                        }
                    }
                }
            }
        }
    }
}

#[test]
fn gpu_ie_bme_teal_chunks_and_accumulation() {
    let Some(gpu) = gpu_or_skip("gpu_ie_bme_teal_chunks_and_accumulation") else {
        return;
    };
    // Under compute-sanitizer (SIEVE_SANITIZE_SMALL=1): the small shape only.
    let small_only = std::env::var("SIEVE_SANITIZE_SMALL").as_deref() == Ok("1");
    for (i, &(m, k)) in [(33usize, 200usize), (4096, 4096), (1000, 11008)]
        .iter()
        .enumerate()
    {
        if small_only && m * k > 100_000 {
            continue;
        }
        let enc = encode(m, k, 0.5, (2, 2), 4, Reorder::Greedy, 100 + i as u64);
        let mut dev = GpuIeBme::upload(&gpu, &IeBmeDevice::new(&enc).unwrap()).unwrap();
        let x = x16(1, k, 7 + i as u64);
        for dp in [0.0, 0.5, 0.9] {
            let t = threshold_for_sparsity(&x, dp).unwrap();
            let want = reference(&enc, &x, 1, t);
            for chunk in [0, 1, 3, 8, 32] {
                dev.chunk = chunk;
                let got = matvec_host(&gpu, &dev, &x, t).unwrap();
                let e = max_rel_error(&got, &want);
                assert!(e < TOL, "{m}x{k} dp {dp} chunk {chunk}: rel error {e}");
            }
            // The decode step's form: y += W x on top of what y holds.
            dev.chunk = 0;
            let xd = gpu.upload(&x).unwrap();
            let y = gpu.upload(&vec![1.0f32; m]).unwrap();
            dev.launch_add(
                &gpu,
                sieve_cuda::dev_ptr(&gpu, &xd),
                t,
                sieve_cuda::dev_ptr(&gpu, &y),
            )
            .unwrap();
            gpu.synchronize().unwrap();
            let plus_one: Vec<f64> = want.iter().map(|v| v + 1.0).collect();
            let e = max_rel_error(&gpu.download(&y).unwrap(), &plus_one);
            assert!(e < TOL, "{m}x{k} dp {dp} launch_add: rel error {e}");
        }
        assert_eq!(dev.rows(), m);
    }
}

/// The prefill's form: rows of X and Y with strides, written (fused zeroing) or added, under a
/// threshold, for the runner tests' tiny shapes too.
#[test]
fn gpu_ie_bme_strided_rows() {
    let Some(gpu) = gpu_or_skip("gpu_ie_bme_strided_rows") else {
        return;
    };
    let mut seed = 70;
    for (m, k) in [
        (70usize, 300usize),
        (96, 96),
        (200, 96),
        (301, 96),
        (96, 200),
    ] {
        for bits in [4, 8] {
            for n in [5usize, 19, 32] {
                seed += 1;
                let (ldx, ldy) = (k + 20, m + 30);
                let enc = encode(m, k, 0.5, (2, 2), bits, Reorder::Greedy, seed);
                let dev = GpuIeBme::upload(&gpu, &IeBmeDevice::new(&enc).unwrap()).unwrap();
                let x = x16(n, k, seed);
                let t = threshold_for_sparsity(&x[..k], 0.5).unwrap();
                let want = reference(&enc, &x, n, t);
                let mut xs = vec![f32::NAN; n * ldx];
                for r in 0..n {
                    xs[r * ldx..r * ldx + k].copy_from_slice(&x[r * k..(r + 1) * k]);
                }
                let xd = gpu.upload(&xs).unwrap();
                let yd = gpu.upload(&vec![f32::NAN; n * ldy]).unwrap();
                let (xp, yp) = (
                    sieve_cuda::dev_ptr(&gpu, &xd),
                    sieve_cuda::dev_ptr(&gpu, &yd),
                );
                for accumulate in [false, true] {
                    dev.launch_rows(&gpu, xp, ldx, n, t, yp, ldy, accumulate)
                        .unwrap();
                }
                gpu.synchronize().unwrap();
                let y = gpu.download(&yd).unwrap();
                let got: Vec<f32> = (0..n)
                    .flat_map(|r| y[r * ldy..r * ldy + m].to_vec())
                    .collect();
                let twice: Vec<f64> = want.iter().map(|v| 2.0 * v).collect();
                let e = max_rel_error(&got, &twice);
                assert!(e < TOL, "{m}x{k} int{bits} n={n}: rel error {e}");
                // Past M in each row of Y nothing is written.
                assert!((0..n).all(|r| y[r * ldy + m..(r + 1) * ldy].iter().all(|v| v.is_nan())));
            }
        }
    }
}

#[test]
fn gpu_ie_bme_rejects_bad_launches() {
    let Some(gpu) = gpu_or_skip("gpu_ie_bme_rejects_bad_launches") else {
        return;
    };
    let enc = encode(40, 100, 0.5, (2, 2), 4, Reorder::Off, 3);
    let mut dev = GpuIeBme::upload(&gpu, &IeBmeDevice::new(&enc).unwrap()).unwrap();
    let x = gpu.upload(&vec![0f32; 33 * 100]).unwrap();
    let mut y = gpu.poisoned_f32(33 * 40).unwrap();
    let e = dev
        .launch_tokens(&gpu, &x, 33, None, &mut y)
        .unwrap_err()
        .to_string();
    assert!(e.contains("1..=32 tokens"), "{e}");
    let mut short = gpu.poisoned_f32(39).unwrap();
    assert!(dev
        .launch(
            &gpu,
            &gpu.upload(&vec![0f32; 100]).unwrap(),
            None,
            &mut short
        )
        .is_err());
    dev.chunk = 33;
    let e = matvec_host(&gpu, &dev, &vec![0f32; 100], None)
        .unwrap_err()
        .to_string();
    assert!(e.contains("chunk"), "{e}");
}

/// The batched prefill's f16 copy (`decode_rows_f16`): row-major, padded, every value the
/// kernel's reading of the layout (`IeBmeDevice::read_back`, the format's matrix) rounded to
/// f16, zeros in the padding; the output starts as NaN, so nothing may be left unwritten. Every
/// area split, int4 and int8, reordered and plain rows, partial tiles.
#[test]
fn gpu_ie_bme_decode_rows_f16_is_the_matrix() {
    let Some(gpu) = gpu_or_skip("gpu_ie_bme_decode_rows_f16_is_the_matrix") else {
        return;
    };
    let small_only = std::env::var("SIEVE_SANITIZE_SMALL").as_deref() == Ok("1");
    for (si, &(m, k)) in [(1usize, 1usize), (17, 130), (300, 1000), (1024, 4096)]
        .iter()
        .enumerate()
    {
        if small_only && m * k > 100_000 {
            continue;
        }
        for (ra, ca) in [(2, 2), (1, 2), (2, 1), (1, 1)] {
            for bits in [4, 8] {
                let reorder = if (si + bits) % 2 == 0 {
                    Reorder::Greedy
                } else {
                    Reorder::Off
                };
                let enc = encode(m, k, 0.5, (ra, ca), bits, reorder, 5 + si as u64);
                let dev = IeBmeDevice::new(&enc).unwrap();
                let want = dev.read_back();
                let g = GpuIeBme::upload(&gpu, &dev).unwrap();
                let (mp, kp) = (g.padded_rows(), g.padded_cols());
                let got = gpu
                    .f16_written_by(mp * kp, |out| g.decode_rows_f16(&gpu, out))
                    .unwrap();
                for r in 0..mp {
                    for c in 0..kp {
                        let w = if r < m && c < k { want[r * k + c] } else { 0.0 };
                        assert_eq!(
                            got[r * kp + c].to_bits(),
                            f16::from_f32(w).to_bits(),
                            "{m}x{k} {ra}x{ca} int{bits} {reorder:?}: ({r}, {c})"
                        );
                    }
                }
            }
        }
    }
}

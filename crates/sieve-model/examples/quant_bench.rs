//! Times the decode-step products of a GGUF model's layers: every layer's linears on one token
//! (q/k/v and gate/up grouped as in `Model::forward`), then the LM head, with the model loaded
//! as quantized blocks and as f16. Prints the best of `REPS` passes (ms per token-step).
//! `cargo run --release -p sieve-model --example quant_bench -- MODEL.gguf THREADS [REPS [blocks]]`
//! (`blocks`: skip the f16 model). A `.sieve` pack is timed as loaded (its formats' kernels).

use sieve_model::generate::run_in_pool;
use sieve_model::linear::Linear;
use sieve_model::llama::Model;
use sieve_model::weights::open_model;
use std::time::Instant;

fn step(
    model: &Model,
    x: &[f32],
    bufs: &mut [Vec<f32>; 6],
) -> Result<(), Box<dyn std::error::Error>> {
    let [q, k, v, o, g, u] = bufs;
    let mut d = vec![0f32; x.len()];
    for l in model.layers() {
        Linear::forward_group(&[&l.q_proj, &l.k_proj, &l.v_proj], x, 1, &mut [q, k, v])?;
        l.o_proj.forward(&q[..l.o_proj.cols()], 1, o)?;
        Linear::forward_group(&[&l.gate_proj, &l.up_proj], x, 1, &mut [g, u])?;
        l.down_proj.forward(g, 1, &mut d)?;
    }
    Ok(())
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    let threads: usize = args[2].parse()?;
    let reps: usize = args.get(3).map(|s| s.parse()).transpose()?.unwrap_or(30);
    let mut models = Vec::new();
    if args[1].ends_with(".sieve") {
        let (pack, _) =
            sieve_model::packed::load_model_and_tokenizer_with(args[1].as_ref(), false)?;
        models.push(("pack", pack));
    } else {
        let source = open_model(&args[1])?;
        models.push(("blocks", Model::from_source(source.as_ref())?));
        if args.get(4).map(String::as_str) != Some("blocks") {
            models.push(("f16", Model::from_source_f16(source.as_ref())?));
        }
    }
    for (label, model) in models {
        let c = model.config().clone();
        let x: Vec<f32> = (0..c.hidden_size)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) / 25.0)
            .collect();
        let l0 = &model.layers()[0];
        let mut bufs = [
            vec![0f32; l0.q_proj.rows()],
            vec![0f32; l0.k_proj.rows()],
            vec![0f32; l0.v_proj.rows()],
            vec![0f32; l0.o_proj.rows()],
            vec![0f32; l0.gate_proj.rows()],
            vec![0f32; l0.up_proj.rows()],
        ];
        let mut logits = vec![0f32; c.vocab_size];
        let (mut best_layers, mut best_head) = (f64::MAX, f64::MAX);
        run_in_pool(Some(threads), || {
            for _ in 0..reps {
                let t = Instant::now();
                step(&model, &x, &mut bufs).map_err(|e| e.to_string())?;
                best_layers = best_layers.min(t.elapsed().as_secs_f64() * 1e3);
                let t = Instant::now();
                model
                    .lm_head()
                    .forward(&x, 1, &mut logits)
                    .map_err(|e| e.to_string())?;
                best_head = best_head.min(t.elapsed().as_secs_f64() * 1e3);
            }
            Ok::<(), String>(())
        })??;
        // Batched products (prefill) of `n` tokens through every layer's linears.
        let n: usize = std::env::var("QB_PREFILL")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(0);
        if n > 0 {
            let xs: Vec<f32> = (0..n).flat_map(|_| x.iter().copied()).collect();
            let mut best = f64::MAX;
            run_in_pool(Some(threads), || {
                for _ in 0..3 {
                    let t = Instant::now();
                    for l in model.layers() {
                        let mut ys: Vec<Vec<f32>> = [&l.q_proj, &l.k_proj, &l.v_proj]
                            .iter()
                            .map(|lin| vec![0f32; n * lin.rows()])
                            .collect();
                        let mut outs: Vec<&mut [f32]> = ys.iter_mut().map(|y| &mut y[..]).collect();
                        Linear::forward_group(
                            &[&l.q_proj, &l.k_proj, &l.v_proj],
                            &xs,
                            n,
                            &mut outs,
                        )
                        .map_err(|e| e.to_string())?;
                        let mut g = vec![0f32; n * l.gate_proj.rows()];
                        let mut u = vec![0f32; n * l.up_proj.rows()];
                        Linear::forward_group(
                            &[&l.gate_proj, &l.up_proj],
                            &xs,
                            n,
                            &mut [&mut g, &mut u],
                        )
                        .map_err(|e| e.to_string())?;
                    }
                    best = best.min(t.elapsed().as_secs_f64() * 1e3);
                }
                Ok::<(), String>(())
            })??;
            println!("{label}: q/k/v/gate/up products of {n} tokens {best:.1} ms");
        }
        println!(
            "{label}: layer products {best_layers:.3} ms, head {best_head:.3} ms (best of {reps})"
        );
    }
    Ok(())
}

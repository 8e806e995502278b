//! Prints the spread (max - min) and standard deviation of a model's logits along a greedy
//! decode from a fixed prompt: the scale against which GPU-vs-CPU logit errors are judged.
//!   cargo run --release -p sieve-model --example logit_spread -- MODEL [--f16-weights]
use sieve_model::llama::Logits;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let path = args
        .first()
        .ok_or("usage: logit_spread MODEL [--f16-weights]")?;
    let f16 = args.iter().any(|a| a == "--f16-weights");
    let (model, _) = sieve_model::packed::load_model_and_tokenizer_with(path.as_ref(), f16)?;
    let prompt: Vec<u32> = vec![1, 17, 42, 99, 250];
    let mut cache = model.new_cache(prompt.len() + 65);
    let mut logits = model.forward(&prompt, &mut cache, Logits::Last)?;
    let (mut spreads, mut sds) = (Vec::new(), Vec::new());
    for _ in 0..64 {
        let (mut lo, mut hi, mut arg) = (f32::INFINITY, f32::NEG_INFINITY, 0usize);
        for (i, &v) in logits.iter().enumerate() {
            lo = lo.min(v);
            if v > hi {
                hi = v;
                arg = i;
            }
        }
        let mean = logits.iter().map(|&v| v as f64).sum::<f64>() / logits.len() as f64;
        let var = logits
            .iter()
            .map(|&v| (v as f64 - mean).powi(2))
            .sum::<f64>()
            / logits.len() as f64;
        spreads.push(hi - lo);
        sds.push(var.sqrt());
        logits = model.forward(&[arg as u32], &mut cache, Logits::Last)?;
    }
    spreads.sort_by(f32::total_cmp);
    sds.sort_by(f64::total_cmp);
    println!(
        "{path}: logit spread (max - min) median {:.2} (min {:.2}, max {:.2}); std dev median {:.3}",
        spreads[32], spreads[0], spreads[63], sds[32]
    );
    Ok(())
}

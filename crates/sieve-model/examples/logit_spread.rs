//! Prints the spread (max - min) and standard deviation of a model's logits along a greedy
//! decode from a fixed prompt: the scale against which GPU-vs-CPU logit errors are judged.
//! With `--vs-dense`, also the largest logit difference between the model as loaded and the
//! same model with every linear decoded to dense f16 (same thresholds): how far the CPU's
//! format kernels are from a plain dense product on this model.
//! With `--dump FILE`, writes the teacher-forced logits of a fixed 69-token sequence as raw f32
//! (to compare two builds or two machines).
//! With `--nudge F`, the largest logit difference between the model as loaded and the same
//! model with every TEAL threshold scaled by (1 + F): how far inputs that sit within rounding of
//! a threshold (active on one side, not on the other) move this model's logits. That is the
//! scale of the difference two correct implementations may show on a thresholded model.
//!   cargo run --release -p sieve-model --example logit_spread -- MODEL [--f16-weights] [--vs-dense] [--dump FILE] [--nudge F]
use sieve_model::llama::Logits;

/// Median, p90 and max over positions of the largest absolute difference between two
/// teacher-forced logit arrays (`vocab` logits per position).
fn position_errors(a: &[f32], b: &[f32], vocab: usize) -> (f32, f32, f32) {
    let mut errs: Vec<f32> = a
        .chunks(vocab)
        .zip(b.chunks(vocab))
        .map(|(x, y)| {
            x.iter()
                .zip(y)
                .map(|(p, q)| (p - q).abs())
                .fold(0.0, f32::max)
        })
        .collect();
    errs.sort_by(f32::total_cmp);
    (
        errs[errs.len() / 2],
        errs[errs.len() * 9 / 10],
        errs[errs.len() - 1],
    )
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let path = args
        .first()
        .ok_or("usage: logit_spread MODEL [--f16-weights]")?;
    let f16 = args.iter().any(|a| a == "--f16-weights");
    let (model, _) = sieve_model::packed::load_model_and_tokenizer_with(path.as_ref(), f16)?;
    let prompt: Vec<u32> = vec![1, 17, 42, 99, 250];
    if let Some(i) = args.iter().position(|a| a == "--dump") {
        let file = args.get(i + 1).ok_or("--dump needs a file")?;
        let mut seq = prompt.clone();
        seq.extend((0..64u32).map(|i| (i * 7919 + 13) % 1000));
        let mut cache = model.new_cache(seq.len());
        let all = model.forward(&seq, &mut cache, Logits::All)?;
        let bytes: Vec<u8> = all.iter().flat_map(|v| v.to_le_bytes()).collect();
        std::fs::write(file, bytes)?;
    }
    if args.iter().any(|a| a == "--vs-dense") {
        let (mut dense, _) =
            sieve_model::packed::load_model_and_tokenizer_with(path.as_ref(), f16)?;
        for (_, lin) in dense.linears_mut() {
            let m = lin.format().decode();
            lin.replace_format(Box::new(sieve_formats::dense::Dense::encode(&m)?))?;
        }
        let mut seq = prompt.clone();
        seq.extend((0..64u32).map(|i| (i * 7919 + 13) % 1000));
        let mut c1 = model.new_cache(seq.len());
        let mut c2 = dense.new_cache(seq.len());
        let a = model.forward(&seq, &mut c1, Logits::All)?;
        let b = dense.forward(&seq, &mut c2, Logits::All)?;
        let (median, p90, max) = position_errors(&a, &b, model.config().vocab_size);
        println!(
            "{path}: as loaded vs every linear dense: max logit difference per position median {median}, p90 {p90}, max {max}"
        );
    }
    if let Some(i) = args.iter().position(|a| a == "--nudge") {
        let factor: f32 = args.get(i + 1).ok_or("--nudge needs a factor")?.parse()?;
        let (mut nudged, _) =
            sieve_model::packed::load_model_and_tokenizer_with(path.as_ref(), f16)?;
        for (_, lin) in nudged.linears_mut() {
            if let Some(t) = lin.threshold() {
                lin.set_threshold(Some(t * (1.0 + factor)))?;
            }
        }
        let mut seq = prompt.clone();
        seq.extend((0..64u32).map(|i| (i * 7919 + 13) % 1000));
        let a = model.forward(&seq, &mut model.new_cache(seq.len()), Logits::All)?;
        let b = nudged.forward(&seq, &mut nudged.new_cache(seq.len()), Logits::All)?;
        let (median, p90, max) = position_errors(&a, &b, model.config().vocab_size);
        println!(
            "{path}: thresholds x (1 + {factor}): max logit difference per position median {median}, p90 {p90}, max {max}"
        );
    }
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

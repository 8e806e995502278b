//! Greedy generation and perplexity on the CPU without the CLI, for timing the forward pass:
//! `cargo run --release -p sieve-model --example cpu_generate -- MODEL.gguf THREADS "prompt" MAX_TOKENS [PPL_TEXT PPL_TOKENS]`

use sieve_model::generate::{generate, init_threads, load_tokenizer, perplexity, GenerateOptions};
use sieve_model::llama::Model;
use sieve_model::weights::open_model;
use std::io::Write;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    if args.len() < 5 {
        return Err("usage: cpu_generate MODEL THREADS PROMPT MAX_TOKENS [TEXT TOKENS]".into());
    }
    init_threads(args[2].parse()?)?;
    let source = open_model(&args[1])?;
    let tokenizer = load_tokenizer(source.as_ref())?;
    let model = Model::from_source(source.as_ref())?;
    let prompt = tokenizer.encode(&args[3], tokenizer.add_bos_by_default())?;
    let options = GenerateOptions {
        max_tokens: args[4].parse()?,
        ..GenerateOptions::default()
    };
    let out = generate(&model, &tokenizer, &prompt, &options, |piece| {
        print!("{piece}");
        let _ = std::io::stdout().flush();
        Ok(())
    })?;
    println!();
    eprintln!("{}", out.stats.summary());
    if args.len() >= 7 {
        let text = std::fs::read_to_string(&args[5])?;
        let mut tokens = tokenizer.encode(&text, tokenizer.add_bos_by_default())?;
        tokens.truncate(args[6].parse()?);
        let started = std::time::Instant::now();
        let r = perplexity(&model, &tokens, 1024, |done, ppl| {
            eprintln!("{done} tokens, ppl {ppl:.3}")
        })?;
        eprintln!(
            "{{\"tokens\": {}, \"ctx\": 1024, \"ppl\": {:.4}, \"nll\": {:.5}, \"seconds\": {:.1}}}",
            r.scored_tokens,
            r.perplexity(),
            r.mean_nll(),
            started.elapsed().as_secs_f64()
        );
    }
    Ok(())
}

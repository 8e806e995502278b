//! `sieve formats ...`: storage statistics of every format on a random matrix.

use anyhow::{Context, Result};
use clap::Subcommand;
use serde::Serialize;
use sieve_formats::random::{self, Pattern};
use sieve_formats::{registry, FormatKind};

#[derive(Subcommand)]
pub enum FormatsCommand {
    /// Encode a random M x K matrix in every format and print one JSON line per format.
    Stats {
        #[arg(long)]
        rows: usize,
        #[arg(long)]
        cols: usize,
        /// Fraction of zero weights, in [0, 1). Ignored for N:M patterns (fixed by N/M).
        #[arg(long, default_value_t = 0.5)]
        sparsity: f64,
        /// `unstructured` or N:M such as 2:4 or 6:8.
        #[arg(long, default_value = "unstructured")]
        pattern: String,
        #[arg(long, default_value_t = 0)]
        seed: u64,
    },
}

#[derive(Serialize)]
struct StatsLine {
    format: &'static str,
    rows: usize,
    cols: usize,
    sparsity: f64,
    payload_bytes: usize,
    metadata_bytes: usize,
    total_bytes: usize,
    dense_bytes: usize,
    /// Total bytes as a fraction of dense f16 (Celty's "compression efficiency").
    ratio_to_dense: f64,
    pmr: Option<f64>,
}

pub fn run(cmd: FormatsCommand) -> Result<()> {
    match cmd {
        FormatsCommand::Stats {
            rows,
            cols,
            sparsity,
            pattern,
            seed,
        } => {
            let pattern: Pattern = pattern.parse()?;
            let w = random::sparse_matrix(rows, cols, sparsity, pattern, seed)
                .context("generating the random matrix")?;
            for kind in FormatKind::ALL {
                let packed = match registry::encode_default(kind, &w) {
                    Ok(p) => p,
                    Err(e) => {
                        eprintln!("{}: skipped: {e}", kind.name());
                        continue;
                    }
                };
                let s = packed.storage();
                let pmr = s.pmr();
                let line = StatsLine {
                    format: kind.name(),
                    rows,
                    cols,
                    sparsity: w.sparsity(),
                    payload_bytes: s.payload_bytes,
                    metadata_bytes: s.metadata_bytes,
                    total_bytes: s.total_bytes(),
                    dense_bytes: w.dense_bytes(),
                    ratio_to_dense: s.total_bytes() as f64 / w.dense_bytes() as f64,
                    pmr: pmr.is_finite().then_some(pmr),
                };
                println!("{}", serde_json::to_string(&line)?);
            }
            Ok(())
        }
    }
}

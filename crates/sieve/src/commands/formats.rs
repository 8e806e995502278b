//! `sieve formats ...`: storage statistics of every format on a random matrix.

use anyhow::{Context, Result};
use clap::Subcommand;
use serde::Serialize;
use sieve_formats::random::{self, Pattern};
use sieve_formats::{registry, slide, FormatKind, WeightFormat};

/// Largest matrix `formats stats` builds (rows x cols): 2^28 elements, a 512 MiB f16 matrix,
/// which every format then holds another encoding of.
pub const MAX_STATS_ELEMENTS: usize = 1 << 28;

#[derive(Subcommand)]
pub enum FormatsCommand {
    /// Encode a random M x K matrix in every format and print one JSON line per format
    /// (rows x cols at most 2^28).
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
    /// Set when this format was measured on a different matrix than the others.
    #[serde(skip_serializing_if = "Option::is_none")]
    note: Option<String>,
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
            let elements = sieve_formats::size::product("--rows x --cols", &[rows, cols])?;
            sieve_formats::size::at_most("--rows x --cols", elements, MAX_STATS_ELEMENTS)?;
            let w = random::sparse_matrix(rows, cols, sparsity, pattern, seed)
                .context("generating the random matrix")?;
            for kind in FormatKind::ALL {
                // Slide takes only (2N-2):2N matrices: it uses the N a (2N-2):2N pattern implies,
                // and any other input is first pruned to 6:8 by magnitude (said in `note`).
                let encoded = if kind == FormatKind::Slide {
                    slide::encode_or_prune(&w, pattern).map(|(s, pruned)| {
                        let note = pruned.as_ref().map(|p| {
                            format!(
                                "input is not {}:{}; measured on it pruned to that pattern by \
                                 magnitude (sparsity {:.4})",
                                2 * s.n() - 2,
                                2 * s.n(),
                                p.sparsity()
                            )
                        });
                        let sparsity = pruned.map_or(w.sparsity(), |p| p.sparsity());
                        (Box::new(s) as Box<dyn WeightFormat>, sparsity, note)
                    })
                } else {
                    registry::encode_default(kind, &w).map(|p| (p, w.sparsity(), None))
                };
                let (packed, sparsity, note) = match encoded {
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
                    sparsity,
                    payload_bytes: s.payload_bytes,
                    metadata_bytes: s.metadata_bytes,
                    total_bytes: s.total_bytes(),
                    dense_bytes: w.dense_bytes(),
                    ratio_to_dense: s.total_bytes() as f64 / w.dense_bytes() as f64,
                    pmr: pmr.is_finite().then_some(pmr),
                    note,
                };
                println!("{}", serde_json::to_string(&line)?);
            }
            Ok(())
        }
    }
}

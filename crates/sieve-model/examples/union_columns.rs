//! How large is the union of several rows' TEAL-active input columns? Measured on real
//! activations: S windows of L tokens from different places of the WikiText-2 test text, run
//! through the model one layer at a time with `Model::forward_layer`, which shows each
//! projection site's input rows (attn_in = q|k|v, o_proj_in, mlp_in = gate|up, down_proj_in).
//!
//! Per site and layer, the TEAL threshold for dp is the dp-quantile of |x| over every observed
//! row of that site and layer (all windows and positions; computed exactly here, because
//! sieve-prune's `ActivationHistogram` depends on this crate); column k of a row is active when
//! |x_k| > t. For N = 1, 2, 4, 8, 16 it reports the mean fraction of the K columns active in at
//! least one of N rows, where the N rows are
//!   (a) the same position of N different windows (a server batch of N sequences, one decode step),
//!   (b) N consecutive positions of one window (a prompt chunk),
//!
//! next to the independence prediction 1 - dp^N. Positions 0..4 (attention sinks) are left out
//! of (a) and (b) and reported apart as "(a) pos<4". Cells are means over layers; the lines
//! under each table give the min-max over layers.
//!   cargo run --release -p sieve-model --example union_columns -- MODEL [--windows S] [--len L] [--text FILE]
use sieve_model::llama::Site;

const NS: [usize; 5] = [1, 2, 4, 8, 16];
const DPS: [f64; 2] = [0.5, 0.7];
const SINKS: usize = 4;
/// (a), (b), (a) at the sink positions.
const MODES: [&str; 3] = ["(a) seqs", "(b) chunk", "(a) pos<4"];

/// One row's active columns as a bitset.
fn active_bits(row: &[f32], t: f32) -> Vec<u64> {
    let mut bits = vec![0u64; row.len().div_ceil(64)];
    for (k, v) in row.iter().enumerate() {
        if v.abs() > t {
            bits[k / 64] |= 1 << (k % 64);
        }
    }
    bits
}

/// Fraction of `k` columns set in the union of `rows`.
fn union_fraction(rows: &[&Vec<u64>], k: usize) -> f64 {
    let ones: u32 = (0..rows[0].len())
        .map(|w| rows.iter().fold(0u64, |acc, r| acc | r[w]).count_ones())
        .sum();
    ones as f64 / k as f64
}

/// Mean union fraction per N for one mode. `bits[w][p]` = window `w`, position `p`.
fn mode_fractions(mode: usize, bits: &[Vec<Vec<u64>>], k: usize, len: usize) -> [f64; 5] {
    let mut out = [0.0; 5];
    for (slot, &n) in NS.iter().enumerate() {
        let (mut sum, mut count) = (0.0, 0usize);
        if mode == 1 {
            // N consecutive positions of one window, in disjoint chunks after the sinks.
            for win in bits {
                for chunk in win[SINKS..].chunks_exact(n) {
                    sum += union_fraction(&chunk.iter().collect::<Vec<_>>(), k);
                    count += 1;
                }
            }
        } else {
            // The same position of N different windows, in disjoint groups of windows.
            let positions = if mode == 0 { SINKS..len } else { 0..SINKS };
            for p in positions {
                for group in bits.chunks_exact(n) {
                    sum += union_fraction(&group.iter().map(|w| &w[p]).collect::<Vec<_>>(), k);
                    count += 1;
                }
            }
        }
        out[slot] = sum / count.max(1) as f64;
    }
    out
}

fn flag(args: &[String], name: &str) -> Option<String> {
    let i = args.iter().position(|a| a == name)?;
    args.get(i + 1).cloned()
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let usage = "usage: union_columns MODEL [--windows S] [--len L] [--text FILE]";
    let path = args.first().ok_or(usage)?;
    let s: usize = flag(&args, "--windows").unwrap_or("16".into()).parse()?;
    let len: usize = flag(&args, "--len").unwrap_or("64".into()).parse()?;
    let default_text = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../data/wikitext-2/test.txt"
    );
    let text_path = flag(&args, "--text").unwrap_or(default_text.into());
    if s < NS[4] || len < SINKS + NS[4] {
        return Err(format!("need --windows >= {} and --len >= {}", NS[4], SINKS + NS[4]).into());
    }

    let (model, tok) = sieve_model::packed::load_model_and_tokenizer(path.as_ref())?;
    let text =
        std::fs::read_to_string(&text_path).map_err(|e| format!("reading {text_path}: {e}"))?;
    let tokens = tok.encode(&text, false)?;
    if tokens.len() < s * len {
        return Err(format!("{text_path}: {} tokens, need {}", tokens.len(), s * len).into());
    }
    // S windows spread evenly over the text; each is one sequence at positions 0..L (no BOS).
    let mut xs = (0..s)
        .map(|w| {
            let start = w * (tokens.len() - len) / (s - 1);
            model.embed(&tokens[start..start + len])
        })
        .collect::<Result<Vec<_>, _>>()?;

    // stats[dp][site][mode][layer] = mean union fraction per N.
    let layers = model.config().num_layers;
    let mut stats = vec![vec![vec![Vec::<[f64; 5]>::new(); MODES.len()]; 4]; DPS.len()];
    for l in 0..layers {
        // inputs[site][window] = that window's `[L][K]` input rows of the site.
        let mut inputs: Vec<Vec<Vec<f32>>> = vec![Vec::new(); 4];
        for x in xs.iter_mut() {
            model.forward_layer(l, x, len, &mut |site, rows, _| {
                let i = Site::ALL.iter().position(|&a| a == site).unwrap_or(0);
                inputs[i].push(rows.to_vec());
            })?;
        }
        for (si, windows) in inputs.iter().enumerate() {
            let k = windows[0].len() / len;
            let mut abs: Vec<f32> = windows.iter().flatten().map(|v| v.abs()).collect();
            for (di, &dp) in DPS.iter().enumerate() {
                let at = ((dp * abs.len() as f64).ceil() as usize).clamp(1, abs.len()) - 1;
                let t = *abs.select_nth_unstable_by(at, f32::total_cmp).1;
                let bits: Vec<Vec<Vec<u64>>> = windows
                    .iter()
                    .map(|w| w.chunks(k).map(|row| active_bits(row, t)).collect())
                    .collect();
                for (mode, per_layer) in stats[di][si].iter_mut().enumerate() {
                    per_layer.push(mode_fractions(mode, &bits, k, len));
                }
            }
        }
    }

    println!(
        "{path}: {s} windows x {len} tokens of {text_path}, {layers} layers; \
         fraction of K columns active in >= 1 of N rows (mean over layers)\n"
    );
    let header: String = NS.iter().map(|n| format!(" N={n} |")).collect();
    for (di, &dp) in DPS.iter().enumerate() {
        println!(
            "dp = {dp}\n\n| site | rows |{header}\n|---|---|{}",
            "---|".repeat(NS.len())
        );
        let indep: String = NS
            .iter()
            .map(|&n| format!(" {:.3} |", 1.0 - dp.powi(n as i32)))
            .collect();
        println!("| all | 1 - dp^N |{indep}");
        let mut spread = String::new();
        for (si, site) in Site::ALL.iter().enumerate() {
            for (mode, per_layer) in stats[di][si].iter().enumerate() {
                let mean: String = (0..NS.len())
                    .map(|j| {
                        let m = per_layer.iter().map(|f| f[j]).sum::<f64>() / layers as f64;
                        format!(" {m:.3} |")
                    })
                    .collect();
                println!("| {} | {} |{mean}", site.name(), MODES[mode]);
                if mode < 2 {
                    let range: Vec<String> = (0..NS.len())
                        .map(|j| {
                            let (lo, hi) = per_layer
                                .iter()
                                .fold((1f64, 0f64), |(lo, hi), f| (lo.min(f[j]), hi.max(f[j])));
                            format!("N={} {lo:.2}-{hi:.2}", NS[j])
                        })
                        .collect();
                    spread += &format!("  {} {}: {}\n", site.name(), MODES[mode], range.join(", "));
                }
            }
        }
        println!("\nmin-max over layers:\n{spread}");
    }
    Ok(())
}

//! `sieve pack --values`: what the kept weights are snapped to before they are stored
//! ([`ValueGrid`]: the f16 of the pruning method, an int8 grid per row or an int4 grid per group
//! of columns), the check that the format can use them ([`check_values_for_format`]), and the
//! snapping itself. The layer pass (`mod.rs`) snaps the rows magnitude and Wanda pruned with
//! [`snap_runs`], and gives SparseGPT the int8 row scales ([`int8_scales`]) to round in its sweep.

use super::{FormatChoice, BALANCED_FORMAT_NAME};
use crate::error::{PruneError, Result};
use serde::Serialize;
use sieve_formats::value_grid::{Grid, INT4, INT8};
use sieve_formats::FormatKind;
use std::fmt;
use std::str::FromStr;

/// What each kept weight is snapped to before it is stored (`sieve pack --values`).
/// Serialized (in reports) as its `Display` string: `f16`, `int8`, `int4:G`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum ValueGrid {
    /// The f16 the pruning method produced.
    #[default]
    F16,
    /// Each output row on a symmetric int8 grid (`sieve_formats::value_grid::INT8`; SparseGPT
    /// rounds in its sweep and compensates each rounding error, magnitude and Wanda snap the
    /// pruned rows), still stored as f16: the CPU product of Balanced-CBC then keeps 8-bit
    /// records (`sieve_cpu::balanced_cbc`). Only with `--format balanced-cbc`.
    Int8,
    /// Each row's groups of `group` consecutive input columns (`0..G`, `G..2G`, ...; GPTQ's
    /// groups) on a symmetric 4-bit grid with an f16 scale (`sieve_formats::value_grid::INT4`;
    /// SparseGPT picks each group's scale when its sweep reaches the group and compensates
    /// each rounding error, magnitude and Wanda snap the pruned groups), still stored as f16
    /// for a CPU product with 4-bit records. `group` is one of [`INT4_GROUPS`]. With
    /// `--format balanced-cbc`, or `--format dense` at `int4:128` (the GPU multiplies it 4-bit).
    Int4 { group: usize },
}

/// The int4 group widths `--values int4:G` takes: they divide SparseGPT's default block of 128
/// columns (a group must not straddle two blocks of its sweep).
pub const INT4_GROUPS: [usize; 3] = [32, 64, 128];

/// The int4 group width of a plain `--values int4`.
pub const DEFAULT_INT4_GROUP: usize = 64;

const KNOWN_VALUES: &str = "f16, int8, int4, int4:32, int4:64, int4:128";

impl ValueGrid {
    /// The grid and the width of the runs that share one scale (a whole row of `cols` for
    /// int8, a group for int4); `None` for f16.
    pub(super) fn runs(self, cols: usize) -> Option<(Grid, usize)> {
        match self {
            Self::F16 => None,
            Self::Int8 => Some((INT8, cols.max(1))),
            Self::Int4 { group } => Some((INT4, group.max(1))),
        }
    }
}

impl FromStr for ValueGrid {
    type Err = PruneError;
    fn from_str(s: &str) -> Result<Self> {
        let name = s.trim().to_ascii_lowercase();
        match name.as_str() {
            "f16" => return Ok(Self::F16),
            "int8" => return Ok(Self::Int8),
            "int4" => {
                return Ok(Self::Int4 {
                    group: DEFAULT_INT4_GROUP,
                })
            }
            _ => {}
        }
        let group = name
            .strip_prefix("int4:")
            .and_then(|g| g.parse::<usize>().ok())
            .filter(|g| INT4_GROUPS.contains(g));
        match group {
            Some(group) => Ok(Self::Int4 { group }),
            None => Err(PruneError::Option(format!(
                "unknown --values '{name}' (known: {KNOWN_VALUES})"
            ))),
        }
    }
}

impl fmt::Display for ValueGrid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::F16 => f.write_str("f16"),
            Self::Int8 => f.write_str("int8"),
            // The group always shows, also for the default: reports say which one was used.
            Self::Int4 { group } => write!(f, "int4:{group}"),
        }
    }
}

impl Serialize for ValueGrid {
    fn serialize<S: serde::Serializer>(
        &self,
        serializer: S,
    ) -> std::result::Result<S::Ok, S::Error> {
        serializer.collect_str(self)
    }
}

/// Refuses a value grid the format cannot use: int8 and int4 grids pay only with the 8-bit and
/// 4-bit records of Balanced-CBC on the CPU, so `--values int8|int4` needs `--format
/// balanced-cbc` (not `auto`, whose candidates would carry the rounding error without the
/// narrow product). An int4 group outside [`INT4_GROUPS`] (set in code, not parsed) is refused
/// too.
pub fn check_values_for_format(values: ValueGrid, format: FormatChoice) -> Result<()> {
    if let ValueGrid::Int4 { group } = values {
        if !INT4_GROUPS.contains(&group) {
            return Err(PruneError::Option(format!(
                "--values int4:{group}: unknown group width (known: {KNOWN_VALUES})"
            )));
        }
    }
    match (values, format) {
        (ValueGrid::F16, _) | (_, FormatChoice::Fixed(FormatKind::BalancedCbc)) => Ok(()),
        // Dense packs store the snapped values as f16 (the CPU multiplies f16); the GPU finds
        // them on their grids (`LowBitMatrix::from_int4_grid`, groups of 128 only) and
        // multiplies 4-bit: W4A16, column-major under TEAL thresholds.
        (ValueGrid::Int4 { group: 128 }, FormatChoice::Fixed(FormatKind::Dense)) => Ok(()),
        (ValueGrid::Int8 | ValueGrid::Int4 { .. }, other) => {
            let (name, bits) = match values {
                ValueGrid::Int4 { .. } => ("int4", 4),
                _ => ("int8", 8),
            };
            Err(PruneError::Option(format!(
                "--values {name} needs --format {BALANCED_FORMAT_NAME} (got --format {other}): \
                 only its CPU product keeps {bits}-bit values (--format dense takes int4:128, \
                 which the GPU multiplies at 4 bits)"
            )))
        }
    }
}

/// Snaps the `rows x cols` row-major `weights` onto `grid`, one scale per run of `run`
/// consecutive columns of a row (the last run of a row may be shorter; `run >= cols` puts
/// each whole row on one scale); a weight that is not finite is refused (it is on no grid),
/// with its index in `weights`.
pub(super) fn snap_runs(weights: &mut [f32], cols: usize, grid: Grid, run: usize) -> Result<()> {
    for (r, row) in weights.chunks_mut(cols.max(1)).enumerate() {
        for (g, chunk) in row.chunks_mut(run.max(1)).enumerate() {
            if grid.snap_row(chunk).is_none() {
                let (c, value) = chunk
                    .iter()
                    .copied()
                    .enumerate()
                    .find(|(_, v)| !v.is_finite())
                    .unwrap_or((0, f32::NAN));
                return Err(PruneError::NonFinite {
                    what: "pruned weights snapped to value grids",
                    index: r * cols + g * run + c,
                    value,
                });
            }
        }
    }
    Ok(())
}

/// The int8 grid scale of every row of `weights` (`sieve_formats::value_grid::snap_scale` of
/// its largest magnitude); a weight that is not finite is refused, with its index.
pub(super) fn int8_scales(weights: &[f32], cols: usize) -> Result<Vec<f32>> {
    weights
        .chunks(cols.max(1))
        .enumerate()
        .map(|(r, row)| {
            let max = row.iter().fold(0f32, |a, v| a.max(v.abs()));
            match row.iter().position(|v| !v.is_finite()) {
                Some(c) => Err(PruneError::NonFinite {
                    what: "weights to put on int8 grids",
                    index: r * cols + c,
                    value: row[c],
                }),
                None => sieve_formats::value_grid::snap_scale(max).ok_or(PruneError::NonFinite {
                    what: "weights to put on int8 grids",
                    index: r * cols,
                    value: max,
                }),
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::super::test_model::{options, source, windows};
    use super::super::{prune_model, PipelineOptions};
    use super::*;
    use crate::methods::Method;
    use half::f16;
    use sieve_formats::DenseMatrix;
    use sieve_model::llama::Model;

    /// `--values int8`: every stored row of every packed linear lies on an int8 grid, so the CPU
    /// product of the loaded pack keeps 8-bit records; the weights move by at most half a grid
    /// step from the f16 pack's (magnitude pruning: the same kept weights).
    #[test]
    fn int8_values_put_every_row_on_its_grid() {
        use sieve_cpu::balanced_cbc::{FastBalancedCbc, Values};
        use sieve_formats::balanced_cbc::BalancedCbc;
        let src = source();
        for method in [Method::Magnitude, Method::SparseGpt] {
            let base = options(method, "balanced:8:16", 0.5, 0.0, "balanced-cbc");
            let mut f16_model = Model::from_source(&src).unwrap();
            prune_model(&mut f16_model, &windows(), &base, &mut |_| {}).unwrap();
            let mut model = Model::from_source(&src).unwrap();
            let opts = PipelineOptions {
                values: ValueGrid::Int8,
                ..base
            };
            prune_model(&mut model, &windows(), &opts, &mut |_| {}).unwrap();
            let mut moved = 0;
            for (layer, f16_layer) in model.layers().iter().zip(f16_model.layers()) {
                for ((name, lin), (_, f16_lin)) in
                    layer.linears().into_iter().zip(f16_layer.linears())
                {
                    assert_eq!(lin.format().kind(), FormatKind::BalancedCbc, "{name}");
                    let m = lin.format().decode();
                    let balanced = BalancedCbc::encode_with_slots(&m, 8).unwrap();
                    let fast = FastBalancedCbc::with_int8(&balanced)
                        .unwrap_or_else(|| panic!("{method} {name}: a row off its int8 grid"));
                    assert_eq!(fast.values(), Values::Int8);
                    if method != Method::Magnitude {
                        continue;
                    }
                    let f = f16_lin.format().decode();
                    for r in 0..m.rows() {
                        let max = f.row(r).iter().fold(0f32, |a, v| a.max(v.to_f32().abs()));
                        for (a, b) in m.row(r).iter().zip(f.row(r)) {
                            let d = (a.to_f32() - b.to_f32()).abs();
                            // Half a step of at most max / 113, and f16 rounding.
                            assert!(d <= max / 220.0, "{name} row {r}: {a} vs {b}");
                            moved += usize::from(d > 0.0);
                        }
                    }
                }
            }
            if method == Method::Magnitude {
                assert!(moved > 0, "int8 snapping changed no weight");
            }
        }
    }

    #[test]
    fn int8_values_are_refused_for_other_formats() {
        let src = source();
        let mut model = Model::from_source(&src).unwrap();
        for format in ["dense", "tiled-cbc", "auto"] {
            let opts = PipelineOptions {
                values: ValueGrid::Int8,
                ..options(Method::Magnitude, "unstructured", 0.5, 0.0, format)
            };
            let err = prune_model(&mut model, &windows(), &opts, &mut |_| {})
                .err()
                .unwrap_or_else(|| panic!("--values int8 with --format {format} was accepted"))
                .to_string();
            assert!(err.contains("balanced-cbc"), "{format}: {err}");
        }
        assert_eq!("INT8".parse::<ValueGrid>().unwrap(), ValueGrid::Int8);
        assert_eq!("f16".parse::<ValueGrid>().unwrap(), ValueGrid::F16);
    }

    /// `--values int4[:G]`: the stored values of every (row, group of 64 columns) of every
    /// packed Balanced-CBC linear lie on one INT4 grid (detected from the f16 values alone, as
    /// the CPU loader does, and rebuilt exactly as `q · s`), for the three methods. The
    /// magnitude pack keeps the f16 pack's weights up to half a step of their group's grid;
    /// the f16 pack itself is off INT4 grids (the check has teeth). The linears have 32 or 64
    /// input columns: one group per row, partial for 32.
    #[test]
    fn int4_values_put_every_group_on_its_grid() {
        use sieve_formats::value_grid::INT4;
        const G: usize = 64;
        // The stored (nonzero) f16 values of row r, columns c0..c1, and whether they lie on one
        // INT4 grid; panics when an index does not rebuild its value.
        fn on_grid(m: &DenseMatrix, r: usize, c0: usize, c1: usize) -> bool {
            let stored: Vec<f16> = m.row(r)[c0..c1]
                .iter()
                .copied()
                .filter(|v| !sieve_formats::matrix::is_zero(*v))
                .collect();
            let mut q = vec![0i8; stored.len()];
            let Some(s) = INT4.detect(&stored, &mut q) else {
                return false;
            };
            for (v, &i) in stored.iter().zip(&q) {
                assert!(i.unsigned_abs() <= 7);
                assert_eq!(i as f64 * s as f64, v.to_f64());
            }
            true
        }
        let src = source();
        for method in [Method::Magnitude, Method::Wanda, Method::SparseGpt] {
            let base = options(method, "balanced:8:16", 0.5, 0.0, "balanced-cbc");
            let mut f16_model = Model::from_source(&src).unwrap();
            prune_model(&mut f16_model, &windows(), &base, &mut |_| {}).unwrap();
            let mut model = Model::from_source(&src).unwrap();
            let opts = PipelineOptions {
                values: ValueGrid::Int4 { group: G },
                ..base
            };
            prune_model(&mut model, &windows(), &opts, &mut |_| {}).unwrap();
            let (mut moved, mut f16_off_grid, mut groups) = (0, 0, 0);
            for (layer, f16_layer) in model.layers().iter().zip(f16_model.layers()) {
                for ((name, lin), (_, f16_lin)) in
                    layer.linears().into_iter().zip(f16_layer.linears())
                {
                    assert_eq!(lin.format().kind(), FormatKind::BalancedCbc, "{name}");
                    let m = lin.format().decode();
                    let f = f16_lin.format().decode();
                    for r in 0..m.rows() {
                        for c0 in (0..m.cols()).step_by(G) {
                            let c1 = (c0 + G).min(m.cols());
                            groups += 1;
                            assert!(
                                on_grid(&m, r, c0, c1),
                                "{method} {name} row {r} columns {c0}..{c1}: off INT4 grids"
                            );
                            f16_off_grid += usize::from(!on_grid(&f, r, c0, c1));
                            if method != Method::Magnitude {
                                continue;
                            }
                            // Same mask: each weight within half a step of its group's grid.
                            let run = &f.row(r)[c0..c1];
                            let max = run.iter().fold(0f32, |a, v| a.max(v.to_f32().abs()));
                            let half_step = INT4.snap_scale(max).unwrap() as f64 / 2.0;
                            for (a, b) in m.row(r)[c0..c1].iter().zip(run) {
                                let d = (a.to_f64() - b.to_f64()).abs();
                                assert!(
                                    d <= half_step * (1.0 + 1e-6),
                                    "{name} row {r}: {a} vs {b}"
                                );
                                moved += usize::from(d > 0.0);
                            }
                        }
                    }
                }
            }
            assert!(groups > 0);
            assert!(
                f16_off_grid > groups / 2,
                "{method}: f16 pack on INT4 grids"
            );
            if method == Method::Magnitude {
                assert!(moved > 0, "int4 snapping changed no weight");
            }
        }
    }

    /// `--values` names: parsing, display (what the pack report and its JSON show) and
    /// refusals of unknown names, unknown groups and formats other than Balanced-CBC.
    #[test]
    fn int4_values_parse_display_and_refusals() {
        for (text, want, shown) in [
            ("int4", ValueGrid::Int4 { group: 64 }, "int4:64"),
            ("INT4:32", ValueGrid::Int4 { group: 32 }, "int4:32"),
            (" int4:64", ValueGrid::Int4 { group: 64 }, "int4:64"),
            ("int4:128", ValueGrid::Int4 { group: 128 }, "int4:128"),
            ("int8", ValueGrid::Int8, "int8"),
            ("f16", ValueGrid::F16, "f16"),
        ] {
            let v: ValueGrid = text.parse().unwrap();
            assert_eq!(v, want, "{text}");
            assert_eq!(v.to_string(), shown);
            assert_eq!(shown.parse::<ValueGrid>().unwrap(), v);
            assert_eq!(serde_json::to_string(&v).unwrap(), format!("\"{shown}\""));
        }
        for bad in [
            "int4:48",
            "int4:",
            "int4:x",
            "int4:256",
            "int2",
            "int4:64:1",
        ] {
            let err = bad.parse::<ValueGrid>().unwrap_err().to_string();
            assert!(err.contains("int4:32, int4:64, int4:128"), "{bad}: {err}");
        }
        let balanced = FormatChoice::Fixed(FormatKind::BalancedCbc);
        check_values_for_format(ValueGrid::Int4 { group: 32 }, balanced).unwrap();
        let dense = FormatChoice::Fixed(FormatKind::Dense);
        check_values_for_format(ValueGrid::Int4 { group: 128 }, dense).unwrap();
        for (format, values) in [
            ("dense", ValueGrid::Int4 { group: 64 }),
            ("dense", ValueGrid::Int8),
            ("tiled-cbc", ValueGrid::Int4 { group: 128 }),
            ("auto", ValueGrid::Int4 { group: 64 }),
        ] {
            let err = check_values_for_format(values, format.parse().unwrap())
                .unwrap_err()
                .to_string();
            assert!(
                err.contains("int4") && err.contains("balanced-cbc"),
                "{format}: {err}"
            );
        }
        // A group set in code rather than parsed is checked too.
        let err = check_values_for_format(ValueGrid::Int4 { group: 48 }, balanced)
            .unwrap_err()
            .to_string();
        assert!(err.contains("int4:48"), "{err}");
    }
}

//! The benchmark's outputs: progress lines, the markdown table, the JSON report and the SVG
//! plot.

use super::{svg, worst_error, Report, Row, MAX_REL_ERROR};
use crate::error::{CudaError, Result};
use std::fmt::Write;
use std::path::Path;

/// One line per measured row, for progress output while the run goes.
pub fn progress_line(r: &Row) -> String {
    let mut l = format!(
        "{:<28} {:>6}x{:<6} sp={:.2} dp={:.2} {:>9.2} us {:>6.2}x {:>7.0} GB/s {:>5.1}%{}",
        r.format,
        r.m,
        r.k,
        r.sp,
        r.dp,
        r.us,
        r.speedup_vs_cublas,
        r.gbs,
        r.pct_copy_bw,
        r.rel_error
            .map(|e| format!("  err {e:.1e}"))
            .unwrap_or_default()
    );
    if let Some(g) = &r.graph {
        l += &format!(
            " | graph {:>9.2} us {:>6.2}x {:>5.1}%{}",
            g.us,
            g.speedup_vs_cublas,
            g.pct_copy_bw,
            g.rel_error
                .map(|e| format!("  err {e:.1e}"))
                .unwrap_or_default()
        );
    }
    l
}

fn rel_error_cell(e: Option<f64>) -> String {
    e.map(|e| format!("{e:.1e}")).unwrap_or_else(|| "-".into())
}

fn opt_cell(v: Option<f64>, f: impl Fn(f64) -> String) -> String {
    v.map(f).unwrap_or_else(|| "-".into())
}

fn median(mut v: Vec<f64>) -> Option<f64> {
    if v.is_empty() {
        return None;
    }
    v.sort_by(f64::total_cmp);
    let n = v.len();
    Some(if n % 2 == 1 {
        v[n / 2]
    } else {
        0.5 * (v[n / 2 - 1] + v[n / 2])
    })
}

/// The summary key of a row's kernel: its label, or `auto` for the per-layer choice (whose
/// label names the kernel it picked).
fn kernel_key(format: &str) -> &str {
    if format.starts_with("auto:") {
        "auto"
    } else {
        format
    }
}

/// Kernels that store the matrix dense: measured at sp = 0, their time holds at every sp.
fn is_dense_storage(format: &str) -> bool {
    format.starts_with("dense-gemv") || format.starts_with("dense-colmajor")
}

/// Median over shapes of the speedup over cuBLAS, per kernel and weight sparsity (one column
/// per activation sparsity), and for the best kernel per shape; `graph` picks the graph-mode
/// figures. Only checked kernels count (not cuBLAS, not the stage-skipping variants). The
/// best kernel at sp > 0 also considers the dense-storage kernels at the same dp: the pruned
/// matrix stored with its zeros costs them the same. `None` when there is nothing to
/// summarize in that mode.
pub fn summary_table(rows: &[Row], graph: bool) -> Option<String> {
    let speedup = |r: &Row| -> Option<f64> {
        if graph {
            r.graph.as_ref().map(|g| g.speedup_vs_cublas)
        } else {
            Some(r.speedup_vs_cublas)
        }
    };
    let kernels: Vec<(&Row, f64)> = rows
        .iter()
        .filter(|r| r.rel_error.is_some() && r.format != "cublas")
        .filter_map(|r| speedup(r).map(|v| (r, v)))
        .collect();
    if kernels.is_empty() {
        return None;
    }
    let mut dps: Vec<f64> = Vec::new();
    let mut sps: Vec<f64> = Vec::new();
    let mut keys: Vec<(&str, f64)> = Vec::new();
    for (r, _) in &kernels {
        if !dps.contains(&r.dp) {
            dps.push(r.dp);
        }
        if !sps.contains(&r.sp) {
            sps.push(r.sp);
        }
        let key = (kernel_key(&r.format), r.sp);
        if !keys.contains(&key) {
            keys.push(key);
        }
    }
    dps.sort_by(f64::total_cmp);
    sps.sort_by(f64::total_cmp);
    let mut s = String::new();
    let mode = if graph { "graph mode" } else { "event mode" };
    let _ = writeln!(
        s,
        "median speedup over cuBLAS over shapes ({mode}; best kernel per shape, dense-storage kernels counted at every sp)"
    );
    let _ = write!(s, "| kernel | sp |");
    for dp in &dps {
        let _ = write!(s, " dp {dp:.2} |");
    }
    let _ = writeln!(s, "\n|---|---|{}", "---|".repeat(dps.len()));
    let shape = |r: &Row| (r.model.clone(), r.m, r.k);
    for &sp in &sps {
        let _ = write!(s, "| **best kernel** | {sp:.2} |");
        for &dp in &dps {
            let mut best: Vec<((String, usize, usize), f64)> = Vec::new();
            for (r, v) in &kernels {
                let counts =
                    r.dp == dp && (r.sp == sp || (sp > 0.0 && is_dense_storage(&r.format)));
                if !counts {
                    continue;
                }
                match best.iter_mut().find(|(k, _)| *k == shape(r)) {
                    Some((_, b)) => *b = b.max(*v),
                    None => best.push((shape(r), *v)),
                }
            }
            let cell = median(best.into_iter().map(|(_, v)| v).collect());
            let _ = write!(s, " {} |", opt_cell(cell, |v| format!("{v:.2}x")));
        }
        s.push('\n');
    }
    for &(key, sp) in &keys {
        let _ = write!(s, "| {key} | {sp:.2} |");
        for &dp in &dps {
            let v: Vec<f64> = kernels
                .iter()
                .filter(|(r, _)| kernel_key(&r.format) == key && r.sp == sp && r.dp == dp)
                .map(|(_, v)| *v)
                .collect();
            let _ = write!(s, " {} |", opt_cell(median(v), |v| format!("{v:.2}x")));
        }
        s.push('\n');
    }
    Some(s)
}

impl Report {
    /// Everything in markdown: the per-shape table, the summaries of median speedup over
    /// cuBLAS (event mode, and graph mode when measured) and the multi-matrix table.
    pub fn markdown(&self) -> String {
        let mut s = String::new();
        let _ = writeln!(s, "copy bandwidth {:.0} GB/s", self.copy_gbs);
        if !self.rows.is_empty() {
            s += &self.rows_table();
            for graph in [false, true] {
                if let Some(t) = summary_table(&self.rows, graph) {
                    s.push('\n');
                    s += &t;
                }
            }
        }
        if !self.fused.is_empty() {
            s.push('\n');
            s += &self.fused_table();
        }
        s
    }

    /// One line per row; graph columns beside the event ones when graph mode ran.
    pub fn rows_table(&self) -> String {
        let graph = self.rows.iter().any(|r| r.graph.is_some());
        let mut s = String::new();
        if graph {
            let _ = writeln!(
                s,
                "| format | M x K | sp | dp | µs | vs cuBLAS | graph µs | graph vs cuBLAS | MB read | GB/s | % copy | graph % copy | rel err (event / graph) |"
            );
            let _ = writeln!(s, "|---|---|---|---|---|---|---|---|---|---|---|---|---|");
        } else {
            let _ = writeln!(
                s,
                "| format | M x K | sp | dp | µs | vs cuBLAS | MB read | GB/s | % copy | rel err |"
            );
            let _ = writeln!(s, "|---|---|---|---|---|---|---|---|---|---|");
        }
        for r in &self.rows {
            let _ = write!(
                s,
                "| {} | {}x{} | {:.2} | {:.2} | {:.2} | {:.2}x |",
                r.format, r.m, r.k, r.sp, r.dp, r.us, r.speedup_vs_cublas
            );
            let g = r.graph.as_ref();
            if graph {
                let _ = write!(
                    s,
                    " {} | {} |",
                    opt_cell(g.map(|g| g.us), |v| format!("{v:.2}")),
                    opt_cell(g.map(|g| g.speedup_vs_cublas), |v| format!("{v:.2}x"))
                );
            }
            let _ = write!(
                s,
                " {:.1} | {:.0} | {:.0}% |",
                r.bytes as f64 / 1e6,
                r.gbs,
                r.pct_copy_bw
            );
            if graph {
                let _ = writeln!(
                    s,
                    " {} | {} / {} |",
                    opt_cell(g.map(|g| g.pct_copy_bw), |v| format!("{v:.0}%")),
                    rel_error_cell(r.rel_error),
                    rel_error_cell(g.and_then(|g| g.rel_error))
                );
            } else {
                let _ = writeln!(s, " {} |", rel_error_cell(r.rel_error));
            }
        }
        s
    }

    /// The multi-matrix comparison: separate launches against one packed matrix.
    pub fn fused_table(&self) -> String {
        let mut s = String::new();
        let _ = writeln!(
            s,
            "| model | group | rows x K | format | sp | dp | separate µs | packed µs | separate / packed | graph separate µs | graph packed µs | graph separate / packed | rel err |"
        );
        let _ = writeln!(s, "|---|---|---|---|---|---|---|---|---|---|---|---|---|");
        for f in &self.fused {
            let parts: Vec<String> = f.parts.iter().map(|p| p.to_string()).collect();
            let _ = writeln!(
                s,
                "| {} | {} | {} x {} | {} | {:.2} | {:.2} | {:.2} | {:.2} | {:.2}x | {} | {} | {} | {} |",
                f.model,
                f.group,
                parts.join("+"),
                f.k,
                f.format,
                f.sp,
                f.dp,
                f.separate_us,
                f.packed_us,
                f.separate_over_packed,
                opt_cell(f.graph_separate_us, |v| format!("{v:.2}")),
                opt_cell(f.graph_packed_us, |v| format!("{v:.2}")),
                opt_cell(f.graph_separate_over_packed, |v| format!("{v:.2}x")),
                rel_error_cell(Some(f.rel_error))
            );
        }
        s
    }

    /// The largest relative error of any check (event and graph mode, fused rows included);
    /// NaN when any is NaN.
    pub fn worst_rel_error(&self) -> f64 {
        let rows = self.rows.iter().flat_map(|r| {
            let graph = r.graph.as_ref().and_then(|g| g.rel_error);
            r.rel_error.into_iter().chain(graph)
        });
        worst_error(rows.chain(self.fused.iter().map(|f| f.rel_error)))
    }

    /// Fails when a kernel disagreed with the reference (after the report was printed and
    /// saved, so that the numbers of a bad run can still be looked at).
    pub fn check_correct(&self) -> Result<()> {
        let worst = self.worst_rel_error();
        if worst >= MAX_REL_ERROR || worst.is_nan() {
            return Err(CudaError::Option(format!(
                "a kernel disagreed with the reference: max rel error {worst:.2e}"
            )));
        }
        Ok(())
    }

    pub fn to_json(&self) -> Result<String> {
        serde_json::to_string_pretty(self)
            .map_err(|e| CudaError::Option(format!("serializing the report: {e}")))
    }

    /// The SVG plot of [`svg_plot`] for this run.
    pub fn plot(&self) -> String {
        svg_plot(&self.rows, &self.device.name)
    }

    /// Writes the JSON report and the SVG plot where asked.
    pub fn write_outputs(&self, json: Option<&Path>, plot: Option<&Path>) -> Result<()> {
        if let Some(p) = json {
            write_file(p, &self.to_json()?)?;
        }
        if let Some(p) = plot {
            write_file(p, &self.plot())?;
        }
        Ok(())
    }
}

fn write_file(path: &Path, text: &str) -> Result<()> {
    std::fs::write(path, text).map_err(|source| CudaError::Io {
        path: path.display().to_string(),
        source,
    })
}

/// Speedup over cuBLAS against total sparsity 1 - (1 - sp)(1 - dp), one colour per format
/// (kernel family), points averaged over shapes. Plain SVG written by hand.
pub fn svg_plot(rows: &[Row], device: &str) -> String {
    use std::collections::BTreeMap;
    let family = |f: &str| f.split('/').next().unwrap_or(f).to_string();
    let mut series: BTreeMap<String, BTreeMap<i64, (f64, usize)>> = BTreeMap::new();
    for r in rows
        .iter()
        .filter(|r| r.rel_error.is_some() || r.format == "cublas")
    {
        let key = (r.total_sparsity * 1000.0).round() as i64;
        let e = series
            .entry(family(&r.format))
            .or_default()
            .entry(key)
            .or_insert((0.0, 0));
        e.0 += r.speedup_vs_cublas;
        e.1 += 1;
    }
    let (w, h, pad) = (760.0, 480.0, 60.0);
    let ymax = svg::speedup_max(
        series
            .values()
            .flat_map(|s| s.values().map(|(v, n)| v / *n as f64)),
    );
    let px = |x: f64| pad + x * (w - 2.0 * pad);
    let py = |y: f64| h - pad - y / ymax * (h - 2.0 * pad);
    let mut s = String::new();
    svg::open(
        &mut s,
        w,
        h,
        &format!("Speedup over cuBLAS vs total sparsity ({device}), mean over shapes"),
    );
    for i in 0..=10 {
        let x = i as f64 / 10.0;
        svg::x_tick(
            &mut s,
            px(x),
            py(0.0),
            py(ymax),
            h - pad + 16.0,
            &format!("{x:.1}"),
        );
    }
    svg::speedup_grid(&mut s, ymax, px(0.0), px(1.0), py);
    svg::centred_text(&mut s, w / 2.0, h - 14.0, "total sparsity 1-(1-sp)(1-dp)");
    for (i, (name, pts)) in series.iter().enumerate() {
        let pts: Vec<(f64, f64)> = pts
            .iter()
            .map(|(k, (v, n))| (px(*k as f64 / 1000.0), py(v / *n as f64)))
            .collect();
        let legend = (px(0.0) + 10.0, pad + 16.0 * i as f64);
        svg::series(
            &mut s,
            svg::COLORS[i % svg::COLORS.len()],
            "",
            &pts,
            name,
            legend,
        );
    }
    svg::close(&mut s);
    s
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::gpu::DeviceInfo;

    pub(crate) fn row(format: &str, m: usize, sp: f64, dp: f64, speedup: f64) -> Row {
        Row {
            format: format.into(),
            model: "m".into(),
            m,
            k: 64,
            sp,
            dp,
            total_sparsity: 1.0 - (1.0 - sp) * (1.0 - dp),
            us: 10.0 / speedup,
            us_min: 9.0 / speedup,
            speedup_vs_cublas: speedup,
            bytes: 2_000_000,
            gbs: 1.0,
            pct_copy_bw: 1.0,
            rel_error: (format != "cublas").then_some(1e-5),
            graph: None,
        }
    }

    pub(crate) fn report(rows: Vec<Row>) -> Report {
        Report {
            device: DeviceInfo {
                name: "Test <GPU>".into(),
                compute_capability: (9, 0),
                multiprocessors: 132,
                l2_bytes: 50 << 20,
                total_memory_bytes: 1 << 30,
                max_shared_per_block_optin: 227 << 10,
            },
            copy_gbs: 4000.0,
            empty_launch_us: 3.5,
            reps: 100,
            cublas: vec![("m".into(), 128, 64, 10.0)],
            rows,
            graph: None,
            fused: Vec::new(),
        }
    }

    #[test]
    fn svg_is_well_formed_enough() {
        let s = svg_plot(
            &[row("rlc-csc/b1024/c64/w8", 128, 0.5, 0.5, 2.0)],
            "gpu <&>",
        );
        assert!(s.starts_with("<svg") && s.trim_end().ends_with("</svg>"));
        assert!(s.contains("rlc-csc"));
        assert!(s.contains("gpu &lt;&amp;&gt;"));
        assert_eq!(s.matches("<circle").count(), 1);
    }

    #[test]
    fn table_has_one_line_per_row_and_megabytes() {
        let r = report(vec![
            row("cublas", 128, 0.0, 0.0, 1.0),
            row("tiled-cbc/lane8", 128, 0.5, 0.5, 2.0),
        ]);
        let t = r.rows_table();
        let lines: Vec<&str> = t.lines().filter(|l| l.starts_with("| ")).collect();
        assert_eq!(lines.len(), 3, "{t}");
        assert!(
            lines[2].contains("| tiled-cbc/lane8 | 128x64 | 0.50 | 0.50 | 5.00 | 2.00x | 2.0 |")
        );
        assert!(lines[2].ends_with("| 1.0e-5 |"));
        assert!(lines[1].ends_with("| - |"));
    }

    fn with_graph(mut r: Row, us: f64, speedup: f64, err: Option<f64>) -> Row {
        r.graph = Some(crate::bench::GraphFigures {
            us,
            us_min: us,
            speedup_vs_cublas: speedup,
            gbs: 1.0,
            pct_copy_bw: 50.0,
            rel_error: err,
            launches: 64,
            replays: 20,
        });
        r
    }

    #[test]
    fn graph_columns_sit_beside_the_event_ones() {
        let r = report(vec![
            with_graph(row("cublas", 128, 0.0, 0.0, 1.0), 8.0, 1.0, Some(1e-6)),
            with_graph(
                row("tiled-cbc/lane8", 128, 0.5, 0.5, 2.0),
                2.0,
                4.0,
                Some(2e-5),
            ),
        ]);
        let t = r.rows_table();
        assert!(t
            .lines()
            .next()
            .unwrap()
            .contains("| µs | vs cuBLAS | graph µs | graph vs cuBLAS |"));
        let last = t.lines().last().unwrap();
        assert!(
            last.starts_with(
                "| tiled-cbc/lane8 | 128x64 | 0.50 | 0.50 | 5.00 | 2.00x | 2.00 | 4.00x | 2.0 |"
            ),
            "{last}"
        );
        assert!(last.ends_with("| 50% | 1.0e-5 / 2.0e-5 |"), "{last}");
        // Both summaries, the graph one from the graph figures.
        let md = r.markdown();
        assert!(md.contains("(event mode;") && md.contains("(graph mode;"));
        let g = summary_table(&r.rows, true).unwrap();
        assert!(g.contains("| tiled-cbc/lane8 | 0.50 | 4.00x |"), "{g}");
        // A graph error counts in the verdict.
        let mut bad = r.clone();
        if let Some(g) = bad.rows[1].graph.as_mut() {
            g.rel_error = Some(f64::NAN);
        }
        assert!(bad.check_correct().is_err());
        assert!(r.check_correct().is_ok());
        let p = progress_line(&r.rows[1]);
        assert!(p.contains("| graph") && p.contains("4.00x"), "{p}");
        assert!(!progress_line(&row("dense-gemv", 1, 0.0, 0.0, 1.0)).contains("graph"));
    }

    #[test]
    fn summary_takes_medians_over_shapes_and_the_best_kernel_per_shape() {
        let rows = vec![
            row("cublas", 100, 0.0, 0.0, 1.0),
            row("dense-colmajor", 100, 0.0, 0.5, 1.6),
            row("dense-colmajor", 200, 0.0, 0.5, 1.2),
            row("dense-colmajor", 300, 0.0, 0.5, 1.0),
            row("tiled-cbc/lane8", 100, 0.5, 0.5, 1.5),
            row("tiled-cbc/lane8", 200, 0.5, 0.5, 2.0),
            row("tiled-cbc/lane8", 300, 0.5, 0.5, 3.0),
            row("auto:tiled-cbc/lane8", 100, 0.5, 0.5, 1.5),
            row("auto:dense-colmajor", 200, 0.5, 0.5, 1.2),
            row("rlc-csc/no-accumulation", 100, 0.5, 0.5, 9.0),
        ];
        let mut rows = rows;
        rows[9].rel_error = None; // a stage variant: not a product, never summarized
        let t = summary_table(&rows, false).unwrap();
        // Per kernel: medians over the three shapes.
        assert!(t.contains("| dense-colmajor | 0.00 | 1.20x |"), "{t}");
        assert!(t.contains("| tiled-cbc/lane8 | 0.50 | 2.00x |"), "{t}");
        assert!(t.contains("| auto | 0.50 | 1.35x |"), "{t}");
        // Best per shape at sp 0.5: max(1.6, 1.5) = 1.6, 2.0, 3.0 -> 2.0; at sp 0: 1.2.
        assert!(t.contains("| **best kernel** | 0.50 | 2.00x |"), "{t}");
        assert!(t.contains("| **best kernel** | 0.00 | 1.20x |"), "{t}");
        assert!(!t.contains("no-accumulation") && !t.contains("9.00x"));
        // No graph figures: no graph summary.
        assert!(summary_table(&rows, true).is_none());
    }

    #[test]
    fn fused_table_shows_both_sides_and_the_ratio() {
        let mut r = report(Vec::new());
        r.fused.push(crate::bench::FusedRow {
            model: "llama3-8b".into(),
            group: "qkv".into(),
            parts: vec![4096, 1024, 1024],
            k: 4096,
            format: "tiled-cbc/lane8".into(),
            sp: 0.5,
            dp: 0.5,
            separate_us: 30.0,
            packed_us: 20.0,
            separate_over_packed: 1.5,
            graph_separate_us: Some(24.0),
            graph_packed_us: Some(16.0),
            graph_separate_over_packed: Some(1.5),
            separate_bytes: 10,
            packed_bytes: 9,
            rel_error: 1e-5,
        });
        let md = r.markdown();
        assert!(
            md.contains("| llama3-8b | qkv | 4096+1024+1024 x 4096 | tiled-cbc/lane8 | 0.50 | 0.50 | 30.00 | 20.00 | 1.50x | 24.00 | 16.00 | 1.50x | 1.0e-5 |"),
            "{md}"
        );
        assert!(r.check_correct().is_ok());
        r.fused[0].rel_error = 0.5;
        assert!(r.check_correct().is_err());
        let v: serde_json::Value = serde_json::from_str(&r.to_json().unwrap()).unwrap();
        assert_eq!(v["fused"][0]["graph_packed_us"], 16.0);
    }

    #[test]
    fn correctness_check_catches_bad_and_nan_errors() {
        let mut r = report(vec![row("dense-gemv", 128, 0.0, 0.0, 1.0)]);
        assert!(r.check_correct().is_ok());
        r.rows[0].rel_error = Some(2e-3);
        assert!(r.check_correct().is_err());
        r.rows[0].rel_error = Some(f64::NAN);
        assert!(r.check_correct().is_err());
        // A NaN stays the verdict whatever follows it.
        r.rows.push(row("dense-gemv", 128, 0.0, 0.3, 1.0));
        assert!(r.worst_rel_error().is_nan());
    }

    #[test]
    fn json_round_trips_the_fields_scripts_read() {
        let r = report(vec![row("dense-colmajor", 128, 0.0, 0.3, 1.5)]);
        let v: serde_json::Value = serde_json::from_str(&r.to_json().unwrap()).unwrap();
        let row = &v["rows"][0];
        for key in [
            "format",
            "m",
            "k",
            "sp",
            "dp",
            "us",
            "bytes",
            "speedup_vs_cublas",
        ] {
            assert!(!row[key].is_null(), "{key}");
        }
        assert_eq!(v["cublas"][0][3], 10.0);
    }

    #[test]
    fn outputs_are_written_or_fail_with_the_path() {
        let dir = std::env::temp_dir().join(format!("sieve-bench-report-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let r = report(vec![row("dense-gemv", 128, 0.0, 0.0, 1.0)]);
        let (j, p) = (dir.join("r.json"), dir.join("r.svg"));
        r.write_outputs(Some(&j), Some(&p)).unwrap();
        assert!(std::fs::read_to_string(&j).unwrap().contains("dense-gemv"));
        assert!(std::fs::read_to_string(&p).unwrap().starts_with("<svg"));
        let bad = dir.join("missing-dir").join("r.json");
        let e = r.write_outputs(Some(&bad), None).unwrap_err().to_string();
        assert!(e.contains("missing-dir"), "{e}");
        let _ = std::fs::remove_dir_all(&dir);
    }
}

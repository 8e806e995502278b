//! The benchmark's outputs: progress lines, the markdown table, the JSON report and the SVG
//! plot.

use super::{Report, Row, MAX_REL_ERROR};
use crate::error::{CudaError, Result};
use std::fmt::Write;
use std::path::Path;

/// One line per measured row, for progress output while the run goes.
pub fn progress_line(r: &Row) -> String {
    format!(
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
    )
}

fn rel_error_cell(e: Option<f64>) -> String {
    e.map(|e| format!("{e:.1e}")).unwrap_or_else(|| "-".into())
}

impl Report {
    /// The table of every row, in markdown.
    pub fn markdown(&self) -> String {
        let mut s = String::new();
        let _ = writeln!(s, "copy bandwidth {:.0} GB/s", self.copy_gbs);
        let _ = writeln!(
            s,
            "| format | M x K | sp | dp | µs | vs cuBLAS | MB read | GB/s | % copy | rel err |"
        );
        let _ = writeln!(s, "|---|---|---|---|---|---|---|---|---|---|");
        for r in &self.rows {
            let _ = writeln!(
                s,
                "| {} | {}x{} | {:.2} | {:.2} | {:.2} | {:.2}x | {:.1} | {:.0} | {:.0}% | {} |",
                r.format,
                r.m,
                r.k,
                r.sp,
                r.dp,
                r.us,
                r.speedup_vs_cublas,
                r.bytes as f64 / 1e6,
                r.gbs,
                r.pct_copy_bw,
                rel_error_cell(r.rel_error)
            );
        }
        s
    }

    /// The largest relative error of any checked row; NaN when any is NaN (an output the
    /// kernel left unwritten), which `f64::max` alone would drop.
    pub fn worst_rel_error(&self) -> f64 {
        self.rows
            .iter()
            .filter_map(|r| r.rel_error)
            .fold(0.0f64, |a, e| {
                if a.is_nan() || e.is_nan() {
                    f64::NAN
                } else {
                    a.max(e)
                }
            })
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

    /// Writes the JSON report and the SVG plot where asked.
    pub fn write_outputs(&self, json: Option<&Path>, plot: Option<&Path>) -> Result<()> {
        if let Some(p) = json {
            write_file(p, &self.to_json()?)?;
        }
        if let Some(p) = plot {
            write_file(p, &svg_plot(&self.rows, &self.device.name))?;
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
    let ymax = series
        .values()
        .flat_map(|s| s.values().map(|(v, n)| v / *n as f64))
        .fold(1.0f64, f64::max)
        .ceil()
        .max(2.0);
    let px = |x: f64| pad + x * (w - 2.0 * pad);
    let py = |y: f64| h - pad - y / ymax * (h - 2.0 * pad);
    let colors = [
        "#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#17becf",
    ];
    let mut s = String::new();
    let _ = writeln!(
        s,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-family="sans-serif" font-size="12">"#
    );
    let _ = writeln!(s, r#"<rect width="100%" height="100%" fill="white"/>"#);
    let _ = writeln!(
        s,
        r#"<text x="{}" y="20" text-anchor="middle" font-size="14">Speedup over cuBLAS vs total sparsity ({}), mean over shapes</text>"#,
        w / 2.0,
        xml_escape(device)
    );
    for i in 0..=10 {
        let x = i as f64 / 10.0;
        let _ = writeln!(
            s,
            r##"<line x1="{0}" y1="{1}" x2="{0}" y2="{2}" stroke="#eee"/><text x="{0}" y="{3}" text-anchor="middle">{x:.1}</text>"##,
            px(x),
            py(0.0),
            py(ymax),
            h - pad + 16.0
        );
    }
    let ysteps = ymax as usize;
    for i in 0..=ysteps {
        let y = i as f64;
        let _ = writeln!(
            s,
            r##"<line x1="{0}" y1="{1}" x2="{2}" y2="{1}" stroke="{3}"/><text x="{4}" y="{5}" text-anchor="end">{y:.0}x</text>"##,
            px(0.0),
            py(y),
            px(1.0),
            if i == 1 { "#999" } else { "#eee" },
            pad - 6.0,
            py(y) + 4.0
        );
    }
    let _ = writeln!(
        s,
        r#"<text x="{}" y="{}" text-anchor="middle">total sparsity 1-(1-sp)(1-dp)</text>"#,
        w / 2.0,
        h - 14.0
    );
    for (i, (name, pts)) in series.iter().enumerate() {
        let c = colors[i % colors.len()];
        let pts: Vec<(f64, f64)> = pts
            .iter()
            .map(|(k, (v, n))| (px(*k as f64 / 1000.0), py(v / *n as f64)))
            .collect();
        let path: Vec<String> = pts.iter().map(|(x, y)| format!("{x:.1},{y:.1}")).collect();
        let _ = writeln!(
            s,
            r#"<polyline fill="none" stroke="{c}" stroke-width="2" points="{}"/>"#,
            path.join(" ")
        );
        for (x, y) in &pts {
            let _ = writeln!(s, r#"<circle cx="{x:.1}" cy="{y:.1}" r="3" fill="{c}"/>"#);
        }
        let ly = pad + 16.0 * i as f64;
        let _ = writeln!(
            s,
            r#"<rect x="{}" y="{}" width="12" height="12" fill="{c}"/><text x="{}" y="{}">{}</text>"#,
            px(0.0) + 10.0,
            ly,
            px(0.0) + 28.0,
            ly + 10.0,
            xml_escape(name)
        );
    }
    s.push_str("</svg>\n");
    s
}

fn xml_escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
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
        let t = r.markdown();
        let lines: Vec<&str> = t.lines().filter(|l| l.starts_with("| ")).collect();
        assert_eq!(lines.len(), 3, "{t}");
        assert!(
            lines[2].contains("| tiled-cbc/lane8 | 128x64 | 0.50 | 0.50 | 5.00 | 2.00x | 2.0 |")
        );
        assert!(lines[2].ends_with("| 1.0e-5 |"));
        assert!(lines[1].ends_with("| - |"));
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

//! The comparison plot, written as plain SVG: left, speedup over cuBLAS against dual sparsity
//! (model variants as lines, the paper's averages as markers); right, Figure 12's register
//! fraction sweep (model lines, paper markers).

use crate::paper::{Comparison, PAPER_CORE_VS_CUBLAS, PAPER_SMEM_VS_CUBLAS, SPARSITIES};
use std::fmt::Write;

const COLORS: [&str; 6] = [
    "#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b",
];

struct Panel {
    x0: f64,
    y0: f64,
    w: f64,
    h: f64,
    xmin: f64,
    xmax: f64,
    ymax: f64,
}

impl Panel {
    fn x(&self, v: f64) -> f64 {
        self.x0 + (v - self.xmin) / (self.xmax - self.xmin) * self.w
    }
    fn y(&self, v: f64) -> f64 {
        self.y0 + self.h - v / self.ymax * self.h
    }
    fn axes(
        &self,
        s: &mut String,
        xlabel: &str,
        ylabel: &str,
        xticks: &[f64],
        fmt_x: &dyn Fn(f64) -> String,
    ) {
        let _ = writeln!(
            s,
            r##"<rect x="{}" y="{}" width="{}" height="{}" fill="none" stroke="#333"/>"##,
            self.x0, self.y0, self.w, self.h
        );
        let step = if self.ymax > 4.0 { 1.0 } else { 0.5 };
        let mut v = 0.0;
        while v <= self.ymax + 1e-9 {
            let y = self.y(v);
            let _ = writeln!(
                s,
                r##"<line x1="{}" y1="{y:.1}" x2="{}" y2="{y:.1}" stroke="#ddd"/><text x="{}" y="{:.1}" font-size="11" text-anchor="end">{v:.1}</text>"##,
                self.x0,
                self.x0 + self.w,
                self.x0 - 4.0,
                y + 4.0
            );
            v += step;
        }
        for &t in xticks {
            let x = self.x(t);
            let _ = writeln!(
                s,
                r#"<text x="{x:.1}" y="{}" font-size="11" text-anchor="middle">{}</text>"#,
                self.y0 + self.h + 15.0,
                fmt_x(t)
            );
        }
        let _ = writeln!(
            s,
            r#"<text x="{}" y="{}" font-size="12" text-anchor="middle">{xlabel}</text>"#,
            self.x0 + self.w / 2.0,
            self.y0 + self.h + 32.0
        );
        let _ = writeln!(
            s,
            r#"<text x="{}" y="{}" font-size="12" text-anchor="middle" transform="rotate(-90 {} {})">{ylabel}</text>"#,
            self.x0 - 34.0,
            self.y0 + self.h / 2.0,
            self.x0 - 34.0,
            self.y0 + self.h / 2.0
        );
        // 1x reference.
        let y1 = self.y(1.0);
        let _ = writeln!(
            s,
            r##"<line x1="{}" y1="{y1:.1}" x2="{}" y2="{y1:.1}" stroke="#999" stroke-dasharray="4 3"/>"##,
            self.x0,
            self.x0 + self.w
        );
    }
    fn line(&self, s: &mut String, pts: &[(f64, f64)], color: &str, dash: bool) {
        let d: Vec<String> = pts
            .iter()
            .map(|&(x, y)| format!("{:.1},{:.1}", self.x(x), self.y(y.min(self.ymax))))
            .collect();
        let _ = writeln!(
            s,
            r#"<polyline points="{}" fill="none" stroke="{color}" stroke-width="2"{}/>"#,
            d.join(" "),
            if dash {
                r#" stroke-dasharray="6 3""#
            } else {
                ""
            }
        );
        for &(x, y) in pts {
            let _ = writeln!(
                s,
                r#"<circle cx="{:.1}" cy="{:.1}" r="3" fill="{color}"/>"#,
                self.x(x),
                self.y(y.min(self.ymax))
            );
        }
    }
    fn marker(&self, s: &mut String, x: f64, y: f64, color: &str) {
        let (cx, cy) = (self.x(x), self.y(y.min(self.ymax)));
        let _ = writeln!(
            s,
            r#"<path d="M{:.1},{:.1} l6,6 l-6,6 l-6,-6 z" fill="white" stroke="{color}" stroke-width="2"/>"#,
            cx,
            cy - 6.0
        );
    }
}

/// Renders `c` (shapes given for the title).
pub fn render(c: &Comparison, shapes_label: &str, calibration_error: Option<f64>) -> String {
    let mut s = String::new();
    let (width, height) = (1100.0, 580.0);
    let _ = writeln!(
        s,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif">"#
    );
    let _ = writeln!(s, r#"<rect width="100%" height="100%" fill="white"/>"#);
    let cal = calibration_error
        .map(|e| format!(", calibration mean |error| {:.1}%", 100.0 * e))
        .unwrap_or_default();
    let _ = writeln!(
        s,
        r#"<text x="20" y="24" font-size="15">Celty sparse SIMT core on the H200, simulated (sieve sim celty) vs the paper's averages — {shapes_label}{cal}</text>"#
    );
    let ymax = c
        .rows
        .iter()
        .map(|r| r.mean_speedup)
        .chain(PAPER_CORE_VS_CUBLAS)
        .fold(1.0, f64::max)
        .ceil()
        .max(2.0);
    let left = Panel {
        x0: 70.0,
        y0: 50.0,
        w: 520.0,
        h: 330.0,
        xmin: 0.25,
        xmax: 0.75,
        ymax,
    };
    left.axes(
        &mut s,
        "dual sparsity (weights = activations)",
        "mean speedup over cuBLAS (H200)",
        &SPARSITIES,
        &|v| format!("{:.0}%", 100.0 * v),
    );
    let mut names: Vec<String> = Vec::new();
    for r in &c.rows {
        if !names.contains(&r.variant) {
            names.push(r.variant.clone());
        }
    }
    let mut legend_y = 440.0;
    for (i, name) in names.iter().enumerate() {
        let pts: Vec<(f64, f64)> = c
            .rows
            .iter()
            .filter(|r| &r.variant == name)
            .map(|r| (r.sparsity, r.mean_speedup))
            .collect();
        let col = COLORS[i % COLORS.len()];
        left.line(&mut s, &pts, col, false);
        let _ = writeln!(
            s,
            r#"<line x1="70" y1="{legend_y}" x2="95" y2="{legend_y}" stroke="{col}" stroke-width="2"/><text x="100" y="{}" font-size="11">model: {name}</text>"#,
            legend_y + 4.0
        );
        legend_y += 15.0;
    }
    // Paper markers: SMEM kernel (Fig. 6) and sparse SIMT core.
    let smem_col = COLORS[2];
    let core_col = COLORS[4];
    for (i, v) in PAPER_SMEM_VS_CUBLAS.iter().enumerate() {
        if let Some(v) = v {
            left.marker(&mut s, SPARSITIES[i], *v, smem_col);
        }
    }
    for (i, v) in PAPER_CORE_VS_CUBLAS.iter().enumerate() {
        left.marker(&mut s, SPARSITIES[i], *v, core_col);
    }
    for (col, label) in [
        (smem_col, "paper: SMEM kernel (Fig. 6 average)"),
        (core_col, "paper: sparse SIMT core (average)"),
    ] {
        let _ = writeln!(
            s,
            r#"<path d="M82,{:.0} l5,5 l-5,5 l-5,-5 z" fill="white" stroke="{col}" stroke-width="2"/><text x="100" y="{:.0}" font-size="11">{label}</text>"#,
            legend_y - 5.0,
            legend_y + 4.0
        );
        legend_y += 15.0;
    }

    // Right panel: Figure 12.
    let ymax12 = c
        .fig12
        .iter()
        .map(|p| p.speedup)
        .chain([2.4])
        .fold(1.0, f64::max)
        .ceil()
        .max(2.0);
    let right = Panel {
        x0: 690.0,
        y0: 50.0,
        w: 370.0,
        h: 330.0,
        xmin: 0.0,
        xmax: 1.0,
        ymax: ymax12,
    };
    right.axes(
        &mut s,
        "register-accumulation fraction (5120x5120)",
        "speedup over pure SMEM",
        &[0.0, 0.25, 0.5, 0.75, 1.0],
        &|v| format!("{:.0}%", 100.0 * v),
    );
    for (i, sp) in [0.3, 0.7].into_iter().enumerate() {
        let col = COLORS[i];
        let pts: Vec<(f64, f64)> = c
            .fig12
            .iter()
            .filter(|p| p.sparsity == sp)
            .map(|p| (p.reg_fraction, p.speedup))
            .collect();
        right.line(&mut s, &pts, col, false);
        for p in c.fig12.iter().filter(|p| p.sparsity == sp) {
            if let Some(v) = p.paper {
                right.marker(&mut s, p.reg_fraction, v, col);
            }
        }
        let ly = 440.0 + 15.0 * i as f64;
        let _ = writeln!(
            s,
            r#"<line x1="690" y1="{ly}" x2="715" y2="{ly}" stroke="{col}" stroke-width="2"/><text x="720" y="{}" font-size="11">model {:.0}% dual sparsity (diamonds: paper Fig. 12)</text>"#,
            ly + 4.0,
            100.0 * sp
        );
    }
    let _ = writeln!(s, "</svg>");
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::paper::{Fig12Point, VariantRow};

    #[test]
    fn renders_one_line_per_variant_and_the_paper_markers() {
        let row = |name: &str, sp: f64, v: f64| VariantRow {
            variant: name.into(),
            sparsity: sp,
            per_shape: Vec::new(),
            mean_speedup: v,
            max_speedup: v,
            mean_vs_macko_bound: v,
        };
        let mut rows = Vec::new();
        for (i, sp) in SPARSITIES.into_iter().enumerate() {
            rows.push(row("a", sp, 1.0 + i as f64));
            rows.push(row("b", sp, 0.5));
        }
        let fig12 = [0.3, 0.7]
            .into_iter()
            .flat_map(|sp| {
                [0.0, 0.5, 1.0].into_iter().map(move |f| Fig12Point {
                    sparsity: sp,
                    reg_fraction: f,
                    us: 1.0,
                    speedup: 1.0 + f,
                    fallback_share: 1.0 - f,
                    paper: crate::paper::PAPER_FIG12
                        .iter()
                        .find(|p| p.0 == sp && p.1 == f)
                        .map(|p| p.2),
                })
            })
            .collect();
        let c = Comparison {
            rows,
            fig12,
            fig5: Vec::new(),
            tpot: Vec::new(),
        };
        let svg = render(&c, "test", Some(0.081));
        assert!(svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"));
        // Two variant lines + two Fig. 12 lines.
        assert_eq!(svg.matches("<polyline").count(), 4);
        // Paper diamonds: 2 (SMEM) + 3 (core) + 4 (Fig. 12) + 2 legend keys.
        assert_eq!(svg.matches("<path").count(), 11);
        assert!(svg.contains("calibration mean |error| 8.1%"));
    }
}

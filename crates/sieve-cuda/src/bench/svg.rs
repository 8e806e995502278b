//! The pieces of the hand-written SVG plots (`sieve bench kernels`' speedup against total
//! sparsity, [`super::report::svg_plot`]; `sieve bench gemm`'s speedup against tokens,
//! [`super::gemm::GemmReport::plot`]): plain text, no dependency.

use std::fmt::Write;

/// The series colours, in order (repeating past the last).
pub const COLORS: [&str; 7] = [
    "#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#17becf",
];

/// The opening tag of a `w` x `h` plot, its white background and its `title` (escaped),
/// centred at the top.
pub fn open(s: &mut String, w: f64, h: f64, title: &str) {
    let _ = writeln!(
        s,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-family="sans-serif" font-size="12">"#
    );
    let _ = writeln!(s, r#"<rect width="100%" height="100%" fill="white"/>"#);
    let _ = writeln!(
        s,
        r#"<text x="{}" y="20" text-anchor="middle" font-size="14">{}</text>"#,
        w / 2.0,
        xml_escape(title)
    );
}

/// The closing tag.
pub fn close(s: &mut String) {
    s.push_str("</svg>\n");
}

/// A vertical grid line at `x` from `y0` down to `y1` (`y0` the bottom), labelled `label`
/// (escaped) at height `label_y`.
pub fn x_tick(s: &mut String, x: f64, y0: f64, y1: f64, label_y: f64, label: &str) {
    let _ = writeln!(
        s,
        r##"<line x1="{x}" y1="{y0}" x2="{x}" y2="{y1}" stroke="#eee"/><text x="{x}" y="{label_y}" text-anchor="middle">{}</text>"##,
        xml_escape(label)
    );
}

/// Horizontal grid lines at 0x, 1x, ... `ymax`x (`py` maps a speedup to its height) from
/// `x0` to `x1`, labelled left of `x0`; the 1x line (the baseline's) darker than the others.
pub fn speedup_grid(s: &mut String, ymax: f64, x0: f64, x1: f64, py: impl Fn(f64) -> f64) {
    let ysteps = ymax as usize;
    for i in 0..=ysteps {
        let y = i as f64;
        let _ = writeln!(
            s,
            r##"<line x1="{0}" y1="{1}" x2="{2}" y2="{1}" stroke="{3}"/><text x="{4}" y="{5}" text-anchor="end">{y:.0}x</text>"##,
            x0,
            py(y),
            x1,
            if i == 1 { "#999" } else { "#eee" },
            x0 - 6.0,
            py(y) + 4.0
        );
    }
}

/// The top of the speedup axis: the largest speedup (at least 1) rounded up, at least 2x.
pub fn speedup_max(values: impl Iterator<Item = f64>) -> f64 {
    values.fold(1.0f64, f64::max).ceil().max(2.0)
}

/// A text label (escaped) centred at (`x`, `y`).
pub fn centred_text(s: &mut String, x: f64, y: f64, text: &str) {
    let _ = writeln!(
        s,
        r#"<text x="{x}" y="{y}" text-anchor="middle">{}</text>"#,
        xml_escape(text)
    );
}

/// One series: a polyline through `pts` (plot coordinates), a dot at each point, and its legend
/// entry (a swatch and `name`, escaped) at (`legend_x`, `legend_y`). `extra` goes into the
/// polyline's tag as is (e.g. a dash pattern), empty for none; with one, the swatch is a short
/// stretch of the line instead of a square.
pub fn series(
    s: &mut String,
    color: &str,
    extra: &str,
    pts: &[(f64, f64)],
    name: &str,
    (legend_x, legend_y): (f64, f64),
) {
    let path: Vec<String> = pts.iter().map(|(x, y)| format!("{x:.1},{y:.1}")).collect();
    let _ = writeln!(
        s,
        r#"<polyline fill="none" stroke="{color}" stroke-width="2"{extra} points="{}"/>"#,
        path.join(" ")
    );
    for (x, y) in pts {
        let _ = writeln!(
            s,
            r#"<circle cx="{x:.1}" cy="{y:.1}" r="3" fill="{color}"/>"#
        );
    }
    if extra.is_empty() {
        let _ = write!(
            s,
            r#"<rect x="{legend_x}" y="{legend_y}" width="12" height="12" fill="{color}"/>"#
        );
    } else {
        let _ = write!(
            s,
            r#"<line x1="{legend_x}" y1="{0}" x2="{1}" y2="{0}" stroke="{color}" stroke-width="2"{extra}/>"#,
            legend_y + 6.0,
            legend_x + 12.0
        );
    }
    let _ = writeln!(
        s,
        r#"<text x="{}" y="{}">{}</text>"#,
        legend_x + 18.0,
        legend_y + 10.0,
        xml_escape(name)
    );
}

pub fn xml_escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

//! A small SVG line chart (no plotting dependency): mean accuracy per round per series.

use std::fmt::Write;

/// One line: a name, a colour and y values for rounds 1..=n.
#[derive(Debug, Clone)]
pub struct Series {
    /// Legend name.
    pub name: String,
    /// CSS colour.
    pub colour: String,
    /// Values per round (0..1).
    pub values: Vec<f64>,
    /// Optional +/- band per round (std over seeds).
    pub band: Vec<f64>,
}

/// Renders the series as an SVG document with axes, grid and legend.
pub fn line_chart(title: &str, y_label: &str, series: &[Series]) -> String {
    let (w, h, l, r, t, b) = (720.0, 420.0, 60.0, 170.0, 40.0, 50.0);
    let n = series
        .iter()
        .map(|s| s.values.len())
        .max()
        .unwrap_or(1)
        .max(2);
    let all: Vec<f64> = series
        .iter()
        .flat_map(|s| {
            s.values
                .iter()
                .zip(s.band.iter().chain(std::iter::repeat(&0.0)))
                .flat_map(|(v, d)| [v - d, v + d])
        })
        .collect();
    let lo = (all.iter().cloned().fold(1.0, f64::min) * 10.0).floor() / 10.0;
    let hi = ((all.iter().cloned().fold(0.0, f64::max) * 10.0).ceil() / 10.0).max(lo + 0.1);
    let x = |i: usize| l + (w - l - r) * i as f64 / (n - 1) as f64;
    let y = |v: f64| t + (h - t - b) * (1.0 - (v - lo) / (hi - lo));
    let mut s = String::new();
    let _ = write!(
        s,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-family="sans-serif" font-size="12"><rect width="100%" height="100%" fill="white"/>"#
    );
    let _ = write!(
        s,
        r#"<text x="{}" y="22" font-size="15" text-anchor="middle">{title}</text>"#,
        (w - r + l) / 2.0
    );
    for k in 0..=5 {
        let v = lo + (hi - lo) * k as f64 / 5.0;
        let _ = write!(
            s,
            r##"<line x1="{l}" x2="{}" y1="{y0}" y2="{y0}" stroke="#ddd"/><text x="{}" y="{}" text-anchor="end">{:.0}%</text>"##,
            w - r,
            l - 6.0,
            y(v) + 4.0,
            v * 100.0,
            y0 = y(v)
        );
    }
    for i in 0..n {
        if n <= 12 || i % (n / 10).max(1) == 0 || i == n - 1 {
            let _ = write!(
                s,
                r#"<text x="{}" y="{}" text-anchor="middle">{}</text>"#,
                x(i),
                h - b + 18.0,
                i + 1
            );
        }
    }
    let _ = write!(
        s,
        r#"<text x="{}" y="{}" text-anchor="middle">round</text>"#,
        (w - r + l) / 2.0,
        h - 10.0
    );
    let _ = write!(
        s,
        r#"<text x="16" y="{}" transform="rotate(-90 16 {})" text-anchor="middle">{y_label}</text>"#,
        (h - b + t) / 2.0,
        (h - b + t) / 2.0
    );
    for (k, se) in series.iter().enumerate() {
        if !se.band.is_empty() {
            let up: Vec<String> = se
                .values
                .iter()
                .enumerate()
                .map(|(i, v)| format!("{:.1},{:.1}", x(i), y(v + se.band.get(i).unwrap_or(&0.0))))
                .collect();
            let down: Vec<String> = se
                .values
                .iter()
                .enumerate()
                .rev()
                .map(|(i, v)| format!("{:.1},{:.1}", x(i), y(v - se.band.get(i).unwrap_or(&0.0))))
                .collect();
            let _ = write!(
                s,
                r#"<polygon points="{} {}" fill="{}" opacity="0.15"/>"#,
                up.join(" "),
                down.join(" "),
                se.colour
            );
        }
        let pts: Vec<String> = se
            .values
            .iter()
            .enumerate()
            .map(|(i, v)| format!("{:.1},{:.1}", x(i), y(*v)))
            .collect();
        let _ = write!(
            s,
            r#"<polyline points="{}" fill="none" stroke="{}" stroke-width="2"/>"#,
            pts.join(" "),
            se.colour
        );
        let ly = t + 20.0 * k as f64;
        let _ = write!(
            s,
            r#"<line x1="{}" x2="{}" y1="{ly}" y2="{ly}" stroke="{}" stroke-width="3"/><text x="{}" y="{}">{}</text>"#,
            w - r + 12.0,
            w - r + 32.0,
            se.colour,
            w - r + 38.0,
            ly + 4.0,
            se.name
        );
    }
    s.push_str("</svg>\n");
    s
}

//! A small SVG line chart (no plotting dependency): a value per round per series (accuracy in
//! percent, or a plain value such as a loss).

use std::fmt::Write;

/// One line: a name, a colour and y values for rounds 1..=n.
#[derive(Debug, Clone)]
pub struct Series {
    /// Legend name.
    pub name: String,
    /// CSS colour.
    pub colour: String,
    /// Values per round (0..1 on a percent scale); a NaN leaves a gap in the line.
    pub values: Vec<f64>,
    /// Optional +/- band per round (std over seeds).
    pub band: Vec<f64>,
}

/// How the y axis is labelled.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scale {
    /// Values in [0, 1] shown as percent.
    Percent,
    /// Values as they are (a loss).
    Plain,
}

/// Renders the series as an SVG document with axes, grid and legend, the y axis in percent.
pub fn line_chart(title: &str, y_label: &str, series: &[Series]) -> String {
    chart(title, y_label, series, Scale::Percent)
}

/// [`line_chart`] with the y axis on `scale`.
pub fn chart(title: &str, y_label: &str, series: &[Series], scale: Scale) -> String {
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
        .filter(|v| v.is_finite())
        .collect();
    let (min, max) = match scale {
        Scale::Percent => (1.0, 0.0),
        Scale::Plain => (f64::INFINITY, f64::NEG_INFINITY),
    };
    let lo = (all.iter().cloned().fold(min, f64::min) * 10.0).floor() / 10.0;
    let lo = if lo.is_finite() { lo } else { 0.0 };
    let hi = ((all.iter().cloned().fold(max, f64::max) * 10.0).ceil() / 10.0).max(lo + 0.1);
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
            r##"<line x1="{l}" x2="{}" y1="{y0}" y2="{y0}" stroke="#ddd"/><text x="{}" y="{}" text-anchor="end">{}</text>"##,
            w - r,
            l - 6.0,
            y(v) + 4.0,
            match scale {
                Scale::Percent => format!("{:.0}%", v * 100.0),
                Scale::Plain => format!("{v:.2}"),
            },
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
        // A NaN (no value that round) breaks the line into pieces.
        let mut piece: Vec<String> = Vec::new();
        for (i, v) in se
            .values
            .iter()
            .enumerate()
            .chain([(usize::MAX, &f64::NAN)])
        {
            if v.is_finite() {
                piece.push(format!("{:.1},{:.1}", x(i), y(*v)));
            } else if !piece.is_empty() {
                let _ = write!(
                    s,
                    r#"<polyline points="{}" fill="none" stroke="{}" stroke-width="2"/>"#,
                    piece.join(" "),
                    se.colour
                );
                piece.clear();
            }
        }
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

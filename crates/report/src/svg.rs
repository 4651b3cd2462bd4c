//! Hand-written SVG charts: lines over steps, grouped bars, a heatmap. Each returns one
//! `<figure class="chart">` holding exactly one `<svg>`, with a `<title>` for screen readers and
//! hover text on the marks, so the page needs no script.

use std::fmt::Write;

const W: f64 = 640.0;
const H: f64 = 300.0;
const LEFT: f64 = 70.0;
const RIGHT: f64 = 20.0;
const TOP: f64 = 20.0;
const BOTTOM: f64 = 45.0;
const PALETTE: [&str; 8] = [
    "#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf",
];

/// Text safe inside HTML/SVG elements and attributes.
pub fn escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

/// A number in at most four significant digits, with SI-ish suffixes for large values.
pub fn num(x: f64) -> String {
    let a = x.abs();
    if x == 0.0 {
        "0".into()
    } else if a >= 1e9 {
        format!("{:.3}G", x / 1e9)
    } else if a >= 1e6 {
        format!("{:.3}M", x / 1e6)
    } else if a >= 1e4 {
        format!("{:.1}k", x / 1e3)
    } else if a >= 1.0 {
        format!("{}", (x * 1000.0).round() / 1000.0)
    } else if a >= 1e-3 {
        format!("{:.4}", x)
    } else {
        format!("{x:.3e}")
    }
}

/// Five round tick values covering [lo, hi].
fn ticks(lo: f64, hi: f64) -> Vec<f64> {
    let span = (hi - lo).max(f64::MIN_POSITIVE);
    let raw = span / 4.0;
    let mag = 10f64.powf(raw.log10().floor());
    let step = [1.0, 2.0, 2.5, 5.0, 10.0]
        .iter()
        .map(|m| m * mag)
        .find(|s| *s >= raw)
        .unwrap_or(10.0 * mag);
    let first = (lo / step).ceil() * step;
    (0..=8)
        .map(|i| first + i as f64 * step)
        .take_while(|t| *t <= hi + step * 1e-9)
        .collect()
}

/// [lo, hi] widened to whole multiples of the tick step, so the axis starts and ends on a tick.
fn nice(lo: f64, hi: f64) -> (f64, f64) {
    let t = ticks(lo, hi);
    let step = if t.len() > 1 { t[1] - t[0] } else { hi - lo };
    let (a, b) = ((lo / step).floor() * step, (hi / step).ceil() * step);
    if a < b {
        (a, b)
    } else {
        (lo, hi)
    }
}

fn range(vals: impl Iterator<Item = f64>) -> Option<(f64, f64)> {
    let (lo, hi) = vals
        .filter(|v| v.is_finite())
        .fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), v| {
            (a.min(v), b.max(v))
        });
    if lo > hi {
        return None;
    }
    Some(if lo == hi {
        let pad = if lo == 0.0 { 1.0 } else { lo.abs() * 0.1 };
        (lo - pad, hi + pad)
    } else {
        (lo, hi)
    })
}

fn open(s: &mut String, id: &str, title: &str, height: f64) {
    let _ = write!(
        s,
        r#"<figure class="chart" id="{id}"><figcaption>{t}</figcaption><svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {W} {height}" width="{W}" height="{height}" role="img"><title>{t}</title>"#,
        t = escape(title)
    );
}

fn close(s: &mut String) {
    s.push_str("</svg></figure>\n");
}

/// One named series of (x, y) points.
pub struct Series {
    pub name: String,
    pub points: Vec<(f64, f64)>,
}

/// Lines over a shared x axis (steps), with axes, ticks and a legend.
pub fn line_chart(id: &str, title: &str, x_label: &str, series: &[Series]) -> String {
    let mut s = String::new();
    open(&mut s, id, title, H);
    let all = || {
        series
            .iter()
            .flat_map(|x| x.points.iter())
            .filter(|p| p.0.is_finite() && p.1.is_finite())
    };
    let (Some((x0, x1)), Some((y0, y1))) = (range(all().map(|p| p.0)), range(all().map(|p| p.1)))
    else {
        s.push_str(r#"<text x="20" y="40">no data</text>"#);
        close(&mut s);
        return s;
    };
    let (y0, y1) = nice(y0, y1);
    let px = |x: f64| LEFT + (x - x0) / (x1 - x0) * (W - LEFT - RIGHT);
    let py = |y: f64| TOP + (y1 - y) / (y1 - y0) * (H - TOP - BOTTOM);
    // Axes and grid.
    let _ = write!(
        s,
        r##"<g font-size="11" fill="#333"><line x1="{LEFT}" y1="{b}" x2="{r}" y2="{b}" stroke="#333"/><line x1="{LEFT}" y1="{TOP}" x2="{LEFT}" y2="{b}" stroke="#333"/>"##,
        b = H - BOTTOM,
        r = W - RIGHT
    );
    for t in ticks(y0, y1) {
        let y = py(t);
        let _ = write!(
            s,
            r##"<line x1="{LEFT}" y1="{y:.1}" x2="{r}" y2="{y:.1}" stroke="#ddd"/><text x="{tx}" y="{ty:.1}" text-anchor="end">{v}</text>"##,
            r = W - RIGHT,
            tx = LEFT - 4.0,
            ty = y + 4.0,
            v = num(t)
        );
    }
    for t in ticks(x0, x1) {
        let x = px(t);
        let _ = write!(
            s,
            r#"<text x="{x:.1}" y="{ty}" text-anchor="middle">{v}</text>"#,
            ty = H - BOTTOM + 15.0,
            v = num(t)
        );
    }
    let _ = write!(
        s,
        r#"<text x="{cx}" y="{ty}" text-anchor="middle">{l}</text></g>"#,
        cx = (LEFT + W - RIGHT) / 2.0,
        ty = H - 8.0,
        l = escape(x_label)
    );
    for (i, ser) in series.iter().enumerate() {
        let c = PALETTE[i % PALETTE.len()];
        let pts: Vec<String> = ser
            .points
            .iter()
            .filter(|p| p.1.is_finite())
            .map(|&(x, y)| format!("{:.1},{:.1}", px(x), py(y)))
            .collect();
        let _ = write!(
            s,
            r#"<polyline class="series" data-name="{n}" data-points="{k}" fill="none" stroke="{c}" stroke-width="1.5" points="{p}"><title>{n}</title></polyline>"#,
            n = escape(&ser.name),
            k = pts.len(),
            p = pts.join(" ")
        );
        // A few points (all of them when sparse, e.g. validation) get markers with values.
        if ser.points.len() <= 40 {
            for &(x, y) in ser.points.iter().filter(|p| p.1.is_finite()) {
                let _ = write!(
                    s,
                    r#"<circle cx="{:.1}" cy="{:.1}" r="2.5" fill="{c}"><title>{} at {}: {}</title></circle>"#,
                    px(x),
                    py(y),
                    escape(&ser.name),
                    num(x),
                    num(y)
                );
            }
        }
        let (lx, ly) = (W - RIGHT - 150.0, TOP + 14.0 * (i as f64 + 1.0));
        let _ = write!(
            s,
            r#"<rect x="{lx}" y="{:.1}" width="10" height="3" fill="{c}"/><text x="{:.1}" y="{ly:.1}" font-size="11">{}</text>"#,
            ly - 4.0,
            lx + 14.0,
            escape(&ser.name)
        );
    }
    close(&mut s);
    s
}

/// Grouped bars: for each category, one bar per group (e.g. measured and predicted).
pub fn bar_chart(
    id: &str,
    title: &str,
    categories: &[String],
    groups: &[(String, Vec<f64>)],
    fmt: fn(f64) -> String,
) -> String {
    let mut s = String::new();
    open(&mut s, id, title, H);
    let top = groups
        .iter()
        .flat_map(|g| g.1.iter().copied())
        .fold(0.0f64, f64::max);
    // Headroom above the tallest bar for the legend.
    let max = top * 1.25;
    if categories.is_empty() || top <= 0.0 {
        s.push_str(r#"<text x="20" y="40">no data</text>"#);
        close(&mut s);
        return s;
    }
    let plot_w = W - LEFT - RIGHT;
    let slot = plot_w / categories.len() as f64;
    let bar = (slot * 0.8) / groups.len().max(1) as f64;
    let base = H - BOTTOM;
    let py = |v: f64| base - v / max * (H - TOP - BOTTOM);
    let _ = write!(
        s,
        r##"<g font-size="11" fill="#333"><line x1="{LEFT}" y1="{base}" x2="{r}" y2="{base}" stroke="#333"/>"##,
        r = W - RIGHT
    );
    for t in ticks(0.0, max) {
        let _ = write!(
            s,
            r##"<line x1="{LEFT}" y1="{y:.1}" x2="{r}" y2="{y:.1}" stroke="#ddd"/><text x="{tx}" y="{ty:.1}" text-anchor="end">{v}</text>"##,
            y = py(t),
            r = W - RIGHT,
            tx = LEFT - 4.0,
            ty = py(t) + 4.0,
            v = fmt(t)
        );
    }
    for (ci, cat) in categories.iter().enumerate() {
        let x = LEFT + ci as f64 * slot;
        let _ = write!(
            s,
            r#"<text x="{:.1}" y="{}" text-anchor="middle">{}</text>"#,
            x + slot / 2.0,
            base + 15.0,
            escape(cat)
        );
        for (gi, (name, vals)) in groups.iter().enumerate() {
            let v = vals.get(ci).copied().unwrap_or(0.0);
            let bx = x + slot * 0.1 + gi as f64 * bar;
            let _ = write!(
                s,
                r#"<rect class="bar" x="{bx:.1}" y="{:.1}" width="{:.1}" height="{:.1}" fill="{}"><title>{}, {}: {}</title></rect>"#,
                py(v),
                bar.max(1.0),
                base - py(v),
                PALETTE[gi % PALETTE.len()],
                escape(cat),
                escape(name),
                fmt(v)
            );
        }
    }
    s.push_str("</g>");
    for (gi, (name, _)) in groups.iter().enumerate() {
        let (lx, ly) = (W - RIGHT - 170.0, TOP + 14.0 * (gi as f64 + 1.0));
        let _ = write!(
            s,
            r#"<rect x="{lx}" y="{:.1}" width="10" height="10" fill="{}"/><text x="{:.1}" y="{ly:.1}" font-size="11">{}</text>"#,
            ly - 9.0,
            PALETTE[gi % PALETTE.len()],
            lx + 14.0,
            escape(name)
        );
    }
    close(&mut s);
    s
}

/// Rows (layers) by columns (experts), white at the row mean's share and blue/red for below/
/// above it, each cell titled with its value.
pub fn heatmap(id: &str, title: &str, rows: &[Vec<f64>]) -> String {
    let cols = rows.iter().map(Vec::len).max().unwrap_or(0);
    let height = (TOP + BOTTOM + 18.0 * rows.len() as f64).max(120.0);
    let mut s = String::new();
    open(&mut s, id, title, height);
    if cols == 0 {
        s.push_str(r#"<text x="20" y="40">no data</text>"#);
        close(&mut s);
        return s;
    }
    let cw = (W - LEFT - RIGHT) / cols as f64;
    for (r, row) in rows.iter().enumerate() {
        let mean = row.iter().sum::<f64>() / row.len().max(1) as f64;
        let y = TOP + 18.0 * r as f64;
        let _ = write!(
            s,
            r#"<text x="{}" y="{:.1}" font-size="11" text-anchor="end">layer {r}</text>"#,
            LEFT - 4.0,
            y + 13.0
        );
        for (c, &v) in row.iter().enumerate() {
            // Relative load: 1 = the layer's mean; saturate at 0 and 2.
            let rel = if mean > 0.0 { v / mean } else { 1.0 };
            let t = (rel - 1.0).clamp(-1.0, 1.0);
            let (rr, gg, bb) = if t >= 0.0 {
                (255.0, 255.0 * (1.0 - t), 255.0 * (1.0 - t))
            } else {
                (255.0 * (1.0 + t), 255.0 * (1.0 + t), 255.0)
            };
            let _ = write!(
                s,
                r#"<rect class="cell" x="{:.1}" y="{y:.1}" width="{:.1}" height="17" fill="rgb({:.0},{:.0},{:.0})"><title>layer {r}, expert {c}: {} ({:.2}x mean)</title></rect>"#,
                LEFT + c as f64 * cw,
                cw.max(0.5),
                rr,
                gg,
                bb,
                num(v),
                rel
            );
        }
    }
    let _ = write!(
        s,
        r#"<text x="{}" y="{:.1}" font-size="11" text-anchor="middle">expert (blue: below the layer's mean load, red: above; saturates at 0 and 2x)</text>"#,
        (LEFT + W - RIGHT) / 2.0,
        height - 10.0
    );
    close(&mut s);
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ticks_are_round_and_cover_the_range() {
        assert_eq!(ticks(0.0, 10.0), vec![0.0, 2.5, 5.0, 7.5, 10.0]);
        let t = ticks(2.3, 7.9);
        assert!(t[0] >= 2.3 && *t.last().unwrap() <= 7.9, "{t:?}");
        // The axis range is widened to ticks at both ends.
        assert_eq!(nice(2.3, 7.9), (2.0, 8.0));
        assert_eq!(ticks(2.0, 8.0), vec![2.0, 4.0, 6.0, 8.0]);
    }

    #[test]
    fn a_line_chart_maps_every_point() {
        let s = line_chart(
            "c",
            "t <x>",
            "step",
            &[Series {
                name: "a".into(),
                points: vec![(1.0, 2.0), (2.0, 4.0), (3.0, f64::NAN)],
            }],
        );
        assert_eq!(s.matches("<svg").count(), 1);
        assert!(s.contains(r#"data-points="2""#), "{s}");
        assert!(s.contains("t &lt;x&gt;"));
        // First point at the left edge, bottom; second at the right edge, top.
        assert!(s.contains(&format!("{LEFT:.1},{:.1}", H - BOTTOM)), "{s}");
        assert!(s.contains(&format!("{:.1},{TOP:.1}", W - RIGHT)), "{s}");
    }
}

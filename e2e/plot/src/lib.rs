//! SVG pictures of what the scenarios and benchmarks measured: a time chart (series over
//! seconds, a second axis for a rate, vertical markers for events such as a decision) and a
//! grouped bar chart (ratios per load level and peer). Drawn with `plotters`' SVG backend, which
//! needs no font files: text stays text in the SVG.

use std::path::Path;

use anyhow::Context as _;
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};

/// One line of a time chart.
#[derive(Clone, Debug)]
pub struct Series {
    /// Legend text.
    pub name: String,
    /// (seconds, value) points, in order.
    pub points: Vec<(f64, f64)>,
}

/// A vertical line at `x` with a label (a decision, a phase change).
#[derive(Clone, Debug)]
pub struct Marker {
    /// Where, in seconds.
    pub x: f64,
    /// What happened.
    pub label: String,
}

/// A chart of values over time: `left` series on the left axis, `right` ones (a rate, a
/// percentage) on the right axis.
#[derive(Clone, Debug, Default)]
pub struct TimeChart {
    /// Caption.
    pub title: String,
    /// Left axis label.
    pub left_label: String,
    /// Series on the left axis.
    pub left: Vec<Series>,
    /// Right axis label (empty: no right axis).
    pub right_label: String,
    /// Series on the right axis.
    pub right: Vec<Series>,
    /// Events drawn as vertical lines.
    pub markers: Vec<Marker>,
}

/// Colours of successive series, chosen to stay apart on white and in grey print.
const PALETTE: [RGBColor; 6] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
];

const SIZE: (u32, u32) = (960, 480);

/// The upper bound of an axis holding `values`: 10% above the largest, at least `floor`.
fn axis_top(values: impl Iterator<Item = f64>, floor: f64) -> f64 {
    let max = values.filter(|v| v.is_finite()).fold(floor, f64::max);
    (max * 1.1).max(floor)
}

/// Draws a chart's legend at `position`, on a light background.
fn legend<'a, 'b, DB, CT>(
    mut labels: plotters::chart::SeriesLabelStyle<'a, 'b, DB, CT>,
    position: SeriesLabelPosition,
) -> anyhow::Result<()>
where
    DB: DrawingBackend + 'a,
    CT: CoordTranslate,
{
    labels
        .position(position)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK.mix(0.3))
        .draw()
        .map_err(|e| anyhow::anyhow!("legend: {e}"))
}

/// Writes `chart` as an SVG file at `path`.
pub fn time_chart(path: &Path, chart: &TimeChart) -> anyhow::Result<()> {
    let all = chart.left.iter().chain(&chart.right);
    // A little room after the last point.
    let x_end = axis_top(
        all.flat_map(|s| s.points.iter().map(|p| p.0))
            .chain(chart.markers.iter().map(|m| m.x)),
        1.0,
    ) / 1.1
        * 1.04;
    let left_top = axis_top(
        chart.left.iter().flat_map(|s| s.points.iter().map(|p| p.1)),
        1.0,
    );
    let right_top = axis_top(
        chart
            .right
            .iter()
            .flat_map(|s| s.points.iter().map(|p| p.1)),
        1.0,
    );

    let root = SVGBackend::new(path, SIZE).into_drawing_area();
    root.fill(&WHITE).context("draw")?;
    let mut ctx = ChartBuilder::on(&root)
        .caption(&chart.title, ("sans-serif", 20))
        .margin(12)
        .x_label_area_size(36)
        .y_label_area_size(56)
        .right_y_label_area_size(if chart.right.is_empty() { 0 } else { 56 })
        .build_cartesian_2d(0f64..x_end, 0f64..left_top)
        .context("chart")?
        .set_secondary_coord(0f64..x_end, 0f64..right_top);
    ctx.configure_mesh()
        .x_desc("seconds")
        .y_desc(&chart.left_label)
        .light_line_style(WHITE.mix(0.0))
        .draw()
        .context("mesh")?;
    if !chart.right.is_empty() {
        ctx.configure_secondary_axes()
            .y_desc(&chart.right_label)
            .draw()
            .context("right axis")?;
    }
    for m in &chart.markers {
        ctx.draw_series(std::iter::once(PathElement::new(
            vec![(m.x, 0.0), (m.x, left_top)],
            BLACK.mix(0.5).stroke_width(1),
        )))
        .context("marker")?;
        // Labels of markers in the right half end at their line, the others start there, so
        // that none runs off the picture; below the legend's height.
        let anchor = if m.x > x_end / 2.0 {
            HPos::Right
        } else {
            HPos::Left
        };
        let style =
            TextStyle::from(("sans-serif", 13).into_font()).pos(Pos::new(anchor, VPos::Top));
        ctx.draw_series(std::iter::once(Text::new(
            format!(" {} ", m.label),
            (m.x, left_top * 0.80),
            style,
        )))
        .context("marker label")?;
    }
    for (i, s) in chart.left.iter().enumerate() {
        let colour = PALETTE[i % PALETTE.len()];
        ctx.draw_series(LineSeries::new(
            s.points.iter().copied(),
            colour.stroke_width(2),
        ))
        .context("series")?
        .label(&s.name)
        .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], colour.stroke_width(2)));
    }
    for (i, s) in chart.right.iter().enumerate() {
        let colour = PALETTE[(chart.left.len() + i) % PALETTE.len()];
        ctx.draw_secondary_series(LineSeries::new(
            s.points.iter().copied(),
            colour.stroke_width(1),
        ))
        .context("series")?
        .label(format!("{} (right axis)", s.name))
        .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], colour.stroke_width(1)));
    }
    legend(
        ctx.configure_series_labels(),
        SeriesLabelPosition::UpperLeft,
    )?;
    root.present()
        .with_context(|| format!("write {}", path.display()))
}

/// Values per category (a load level) and group (a peer), drawn as grouped bars.
#[derive(Clone, Debug, Default)]
pub struct BarChart {
    /// Caption.
    pub title: String,
    /// What the categories are ("concurrency").
    pub category_label: String,
    /// What the values are ("ratio to HAProxy").
    pub value_label: String,
    /// Category names, left to right.
    pub categories: Vec<String>,
    /// (group name, one value per category); a NaN draws no bar.
    pub groups: Vec<(String, Vec<f64>)>,
    /// A dashed horizontal line (a ratio of 1).
    pub reference: Option<f64>,
}

/// Writes `chart` as an SVG file at `path`.
pub fn grouped_bars(path: &Path, chart: &BarChart) -> anyhow::Result<()> {
    let BarChart {
        title,
        category_label,
        value_label,
        categories,
        groups,
        reference,
    } = chart;
    let reference = *reference;
    anyhow::ensure!(!categories.is_empty(), "no categories to draw");
    let top = axis_top(
        groups
            .iter()
            .flat_map(|(_, v)| v.iter().copied())
            .chain(reference),
        0.1,
    );
    let root = SVGBackend::new(path, SIZE).into_drawing_area();
    root.fill(&WHITE).context("draw")?;
    let n = categories.len();
    let mut ctx = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 20))
        .margin(12)
        .x_label_area_size(36)
        .y_label_area_size(56)
        .build_cartesian_2d(0f64..n as f64, 0f64..top)
        .context("chart")?;
    ctx.configure_mesh()
        .disable_x_mesh()
        .x_labels(0)
        .light_line_style(WHITE.mix(0.0))
        .x_desc(category_label)
        .y_desc(value_label)
        .draw()
        .context("mesh")?;
    // Each category's name under the middle of its group of bars.
    let centred =
        TextStyle::from(("sans-serif", 14).into_font()).pos(Pos::new(HPos::Center, VPos::Top));
    for (c, name) in categories.iter().enumerate() {
        let (x, y) = ctx.backend_coord(&(c as f64 + 0.5, 0.0));
        root.draw(&Text::new(name.clone(), (x, y + 8), centred.clone()))
            .context("category label")?;
    }
    let width = 0.8 / groups.len().max(1) as f64;
    for (g, (name, values)) in groups.iter().enumerate() {
        let colour = PALETTE[g % PALETTE.len()];
        ctx.draw_series(
            values
                .iter()
                .enumerate()
                .filter(|(_, v)| v.is_finite())
                .map(|(c, v)| {
                    let x0 = c as f64 + 0.1 + g as f64 * width;
                    Rectangle::new([(x0, 0.0), (x0 + width * 0.9, *v)], colour.filled())
                }),
        )
        .context("bars")?
        .label(name)
        .legend(move |(x, y)| Rectangle::new([(x, y - 5), (x + 12, y + 5)], colour.filled()));
    }
    if let Some(r) = reference {
        ctx.draw_series(DashedLineSeries::new(
            vec![(0.0, r), (n as f64, r)],
            6,
            4,
            BLACK.mix(0.6).stroke_width(1),
        ))
        .context("reference")?;
    }
    legend(
        ctx.configure_series_labels(),
        SeriesLabelPosition::UpperRight,
    )?;
    root.present()
        .with_context(|| format!("write {}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn series(name: &str, points: &[(f64, f64)]) -> Series {
        Series {
            name: name.into(),
            points: points.to_vec(),
        }
    }

    #[test]
    fn a_time_chart_has_its_series_markers_and_both_axes() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("crowd.svg");
        time_chart(
            &path,
            &TimeChart {
                title: "flash crowd".into(),
                left_label: "connections".into(),
                left: vec![
                    series("target", &[(0.0, 16.0), (10.0, 16.0), (11.0, 30.0)]),
                    series("leased", &[(0.0, 16.0), (11.0, 24.0)]),
                ],
                right_label: "errors %".into(),
                right: vec![series("errors", &[(0.0, 50.0), (12.0, 0.0)])],
                markers: vec![Marker {
                    x: 10.5,
                    label: "8 → 15".into(),
                }],
            },
        )
        .unwrap();
        let svg = std::fs::read_to_string(&path).unwrap();
        assert!(svg.starts_with("<svg"), "{}", &svg[..80.min(svg.len())]);
        for text in [
            "flash crowd",
            "connections",
            "errors %",
            "target",
            "leased",
            "8 → 15",
        ] {
            assert!(svg.contains(text), "no {text:?} in the SVG");
        }
        assert!(svg.contains("errors (right axis)"));
        assert!(svg.matches("<polyline").count() >= 3, "one line per series");
    }

    #[test]
    fn grouped_bars_draw_one_bar_per_finite_value_and_the_reference() {
        let dir = tempfile::tempdir().unwrap();
        let draw = |name: &str, reference: Option<f64>| {
            let path = dir.path().join(name);
            grouped_bars(
                &path,
                &BarChart {
                    title: "throughput vs HAProxy".into(),
                    category_label: "concurrency".into(),
                    value_label: "ratio".into(),
                    categories: vec!["1".into(), "16".into(), "64".into()],
                    groups: vec![
                        ("gateway".into(), vec![0.86, 0.7, f64::NAN]),
                        ("nginx".into(), vec![1.0, 1.1, 1.05]),
                    ],
                    reference,
                },
            )
            .unwrap();
            std::fs::read_to_string(&path).unwrap()
        };
        let svg = draw("ratios.svg", Some(1.0));
        let lines = |svg: &str| svg.matches("<polyline").count() + svg.matches("<line").count();
        assert!(
            lines(&svg) > lines(&draw("plain.svg", None)),
            "the reference line adds dashes"
        );
        for text in [
            "throughput vs HAProxy",
            "concurrency",
            "gateway",
            "nginx",
            "16",
            "64",
        ] {
            assert!(svg.contains(text), "no {text:?} in the SVG");
        }
        // One bar per finite value, plus each group's legend swatch: gateway 2 + 1, nginx 3 + 1.
        assert_eq!(svg.matches("fill=\"#1F77B4\"").count(), 3, "{svg}");
        assert_eq!(svg.matches("fill=\"#FF7F0E\"").count(), 4, "{svg}");
    }

    #[test]
    fn an_empty_bar_chart_is_an_error_not_a_blank_picture() {
        let dir = tempfile::tempdir().unwrap();
        assert!(grouped_bars(&dir.path().join("x.svg"), &BarChart::default()).is_err());
    }
}

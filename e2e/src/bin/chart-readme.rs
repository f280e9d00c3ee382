//! Prints charts/poolpilot/README.md with its values table generated from the chart's
//! values.yaml and values.schema.json (`make crds` writes it; a unit test of
//! `poolpilot_e2e::chart_readme` fails when the committed README drifts).

fn main() -> anyhow::Result<()> {
    let chart = poolpilot_e2e::paths::workspace_root().join("charts/poolpilot");
    let readme = std::fs::read_to_string(chart.join("README.md"))?;
    print!("{}", poolpilot_e2e::chart_readme::render(&chart, &readme)?);
    Ok(())
}

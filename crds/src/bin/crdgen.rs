//! Prints the `ConnectionPolicy` CustomResourceDefinition as YAML, or with `--reference` its
//! Markdown reference (`make crds` writes both: `crds/connectionpolicy.yaml` and
//! `docs/connectionpolicy-reference.md`).

use std::process::ExitCode;

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args
        .iter()
        .map(String::as_str)
        .collect::<Vec<_>>()
        .as_slice()
    {
        [] => print!("{}", poolpilot_api::crd_yaml()),
        ["--reference"] => print!("{}", poolpilot_api::reference_markdown()),
        ["--version"] => println!("crdgen {}", env!("CARGO_PKG_VERSION")),
        _ => {
            eprintln!("usage: crdgen [--reference | --version]");
            return ExitCode::from(2);
        }
    }
    ExitCode::SUCCESS
}

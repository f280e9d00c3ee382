//! Prints the `ConnectionPolicy` CustomResourceDefinition as YAML
//! (`cargo run -p poolpilot-api --bin crdgen > crds/connectionpolicy.yaml`).

fn main() {
    print!("{}", poolpilot_api::crd_yaml());
}

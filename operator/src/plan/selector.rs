//! Which gateway pods each policy selects: Kubernetes label-selector semantics (`matchLabels`
//! and `matchExpressions` with `In`, `NotIn`, `Exists`, `DoesNotExist`), evaluated in memory.

use std::collections::BTreeMap;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;

use super::input::{GatewayPod, PolicyInput};

/// For each policy (same order), the sorted names of the pods it selects.
pub fn select(policies: &[PolicyInput], pods: &[GatewayPod]) -> Vec<Vec<String>> {
    policies
        .iter()
        .map(|p| {
            let mut names: Vec<String> = pods
                .iter()
                .filter(|pod| matches(p.selector(), &pod.labels))
                .map(|pod| pod.name.clone())
                .collect();
            names.sort();
            names
        })
        .collect()
}

/// Whether `labels` satisfy `selector`. An empty selector matches everything; an operator this
/// code does not know matches nothing (fail closed).
pub fn matches(selector: &LabelSelector, labels: &BTreeMap<String, String>) -> bool {
    let labels_ok = selector
        .match_labels
        .iter()
        .flatten()
        .all(|(k, v)| labels.get(k) == Some(v));
    let exprs_ok = selector.match_expressions.iter().flatten().all(|e| {
        let values = e.values.as_deref().unwrap_or_default();
        match (e.operator.as_str(), labels.get(&e.key)) {
            ("In", Some(v)) => values.contains(v),
            ("In", None) => false,
            ("NotIn", Some(v)) => !values.contains(v),
            ("NotIn", None) => true,
            ("Exists", found) => found.is_some(),
            ("DoesNotExist", found) => found.is_none(),
            _ => false,
        }
    });
    labels_ok && exprs_ok
}

#[cfg(test)]
mod tests {
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelectorRequirement;

    use super::*;

    fn labels(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect()
    }

    fn expr(key: &str, op: &str, values: &[&str]) -> LabelSelectorRequirement {
        LabelSelectorRequirement {
            key: key.into(),
            operator: op.into(),
            values: (!values.is_empty()).then(|| values.iter().map(|v| (*v).to_owned()).collect()),
        }
    }

    #[test]
    fn match_labels_need_every_pair() {
        let sel = LabelSelector {
            match_labels: Some(labels(&[("app", "gw"), ("tier", "a")])),
            ..Default::default()
        };
        assert!(matches(
            &sel,
            &labels(&[("app", "gw"), ("tier", "a"), ("x", "y")])
        ));
        assert!(!matches(&sel, &labels(&[("app", "gw")])));
        assert!(!matches(&sel, &labels(&[("app", "gw"), ("tier", "b")])));
    }

    #[test]
    fn empty_selector_matches_everything() {
        assert!(matches(&LabelSelector::default(), &labels(&[])));
    }

    #[test]
    fn match_expressions_follow_kubernetes_semantics() {
        let sel = |e| LabelSelector {
            match_expressions: Some(vec![e]),
            ..Default::default()
        };
        let gw_a = labels(&[("app", "gw"), ("tier", "a")]);
        let none = labels(&[]);
        assert!(matches(&sel(expr("tier", "In", &["a", "b"])), &gw_a));
        assert!(!matches(&sel(expr("tier", "In", &["b"])), &gw_a));
        assert!(!matches(&sel(expr("tier", "In", &["a"])), &none));
        assert!(!matches(&sel(expr("tier", "NotIn", &["a"])), &gw_a));
        assert!(matches(&sel(expr("tier", "NotIn", &["a"])), &none));
        assert!(matches(&sel(expr("app", "Exists", &[])), &gw_a));
        assert!(!matches(&sel(expr("app", "DoesNotExist", &[])), &gw_a));
        assert!(
            !matches(&sel(expr("app", "Gt", &["1"])), &gw_a),
            "unknown operators fail closed"
        );
    }
}

//! Which gateway pods each policy selects: Kubernetes label-selector semantics (`matchLabels`
//! and `matchExpressions` with `In`, `NotIn`, `Exists`, `DoesNotExist`), evaluated in memory.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;

use super::input::{GatewayPod, PolicyInput};

/// The pods of one namespace each distinct selector selects, kept while the namespace's pods
/// (their names and labels, in order) stay the same: a reconcile asks which pods each policy
/// of its namespace selects, and with P policies over N pods, matching every selector against
/// every pod in every reconcile is P × N label comparisons per reconcile. Policies share
/// selectors (a fleet's policies name its gateways' labels), so the memo matches each distinct
/// selector once per change of the pods.
#[derive(Debug, Default)]
pub struct SelectionMemo {
    /// The pods the selections index: name and labels.
    pods: Vec<(String, BTreeMap<String, String>)>,
    /// By selector (its JSON, which names every term): the indexes of the pods it selects.
    by_selector: HashMap<String, Arc<[usize]>>,
}

impl SelectionMemo {
    /// The indexes into `pods` (name, labels) of the pods each of `selectors` selects, in
    /// order. Computed once per distinct selector while `pods` are those the memo last saw;
    /// any change of a pod's name or labels (or of their order) starts it over.
    pub fn select(
        &mut self,
        pods: &[(&str, &BTreeMap<String, String>)],
        selectors: &[&LabelSelector],
    ) -> Vec<Arc<[usize]>> {
        let same = self.pods.len() == pods.len()
            && self
                .pods
                .iter()
                .zip(pods)
                .all(|((n, l), (name, labels))| n == name && l == *labels);
        if !same {
            self.pods = pods
                .iter()
                .map(|(n, l)| ((*n).to_owned(), (*l).clone()))
                .collect();
            self.by_selector.clear();
        }
        selectors
            .iter()
            .map(|selector| {
                let key = serde_json::to_string(selector).unwrap_or_default();
                self.by_selector
                    .entry(key)
                    .or_insert_with(|| {
                        pods.iter()
                            .enumerate()
                            .filter(|(_, (_, labels))| matches(selector, labels))
                            .map(|(i, _)| i)
                            .collect()
                    })
                    .clone()
            })
            .collect()
    }

    /// Distinct selectors remembered.
    #[cfg(test)]
    fn remembered(&self) -> usize {
        self.by_selector.len()
    }
}

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
    fn the_memo_matches_each_distinct_selector_once_until_a_pod_changes() {
        let a = labels(&[("app", "gw"), ("tier", "a")]);
        let b = labels(&[("app", "gw"), ("tier", "b")]);
        let tier = |t: &str| LabelSelector {
            match_labels: Some(labels(&[("tier", t)])),
            ..LabelSelector::default()
        };
        let (sel_a, sel_b, all) = (tier("a"), tier("b"), LabelSelector::default());
        let mut memo = SelectionMemo::default();
        let pods = [("gw-0", &a), ("gw-1", &b), ("gw-2", &a)];
        let got = memo.select(&pods, &[&sel_a, &sel_b, &sel_a, &all]);
        let got: Vec<Vec<usize>> = got.iter().map(|s| s.to_vec()).collect();
        assert_eq!(got, [vec![0, 2], vec![1], vec![0, 2], vec![0, 1, 2]]);
        assert_eq!(memo.remembered(), 3, "three distinct selectors");
        // The same pods: the selections come from the memo (the same allocation).
        let first = memo.select(&pods, &[&sel_a]);
        let again = memo.select(&pods, &[&sel_a]);
        assert!(Arc::ptr_eq(&first[0], &again[0]));
        // A pod relabelled: matched anew.
        let pods = [("gw-0", &a), ("gw-1", &a), ("gw-2", &a)];
        assert_eq!(memo.select(&pods, &[&sel_a])[0].to_vec(), [0, 1, 2]);
        assert_eq!(memo.remembered(), 1, "started over");
        // Agrees with `matches` pod by pod.
        for selector in [&sel_a, &sel_b, &all] {
            let via_memo = memo.select(&pods, &[selector])[0].to_vec();
            let direct: Vec<usize> = (0..pods.len())
                .filter(|i| matches(selector, pods[*i].1))
                .collect();
            assert_eq!(via_memo, direct);
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

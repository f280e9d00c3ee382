//! Plan-level tests of priority classes: the rendered rules and classes, the per-class demand
//! in status beside a target sized from the total, and the split's all-or-nothing rule.

use poolpilot_api::limits::PriorityClass;
use proptest::prelude::*;

use super::*;
use crate::plan::status::{RolloutReport, compute};
use crate::plan::tests::{at, pods, policy};
use crate::plan::{BackendSample, FleetInput, Memory, PolicyKey, plan};

const SPEC: &str = "\
gatewaySelector: {matchLabels: {app: gw}}
backends:
- name: model-a
  endpoints: {service: {name: model-a, port: 8000}}
  capacity: {maxConnectionsPerEndpoint: 100, headroom: 0.2}
clients:
  identity: {header: authorization}
  maxConcurrency: 9
  overrides:
  - name: nightly
    match: {keySha256: 9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08}
    maxConcurrency: 6
    class: Batch
  - name: frontend
    match: {keySha256: 60303ae22b998861bce3b28f33eec1be758a213c86c93c076dbe9f558c11c752}
    maxConcurrency: 3
    weight: 4
  priority:
    header: x-poolpilot-priority
    agingAfter: 100ms
    batchMaxPercent: 40
";

fn key() -> (PolicyKey, String) {
    (
        PolicyKey {
            namespace: "ns".into(),
            name: "p".into(),
        },
        "model-a".into(),
    )
}

fn sample(leased: f64, pending: f64, classes: [ClassSample; 2]) -> BackendSample {
    BackendSample {
        leased: Some(leased),
        pending: Some(pending),
        completed: Some(100.0),
        bytes: Some(10_000.0),
        classes,
        ..BackendSample::default()
    }
}

fn class(leased: f64, pending: f64) -> ClassSample {
    ClassSample {
        leased: Some(leased),
        pending: Some(pending),
    }
}

#[test]
fn every_pods_document_carries_the_priority_rules_and_the_overrides_classes_undivided() {
    let input = FleetInput {
        policies: vec![policy("p", 0, SPEC, 2)],
        pods: pods(3),
        ..FleetInput::default()
    };
    let fleet = plan(&input, &mut Memory::default(), at(0));
    for pod in ["gw-0", "gw-1", "gw-2"] {
        let doc = &fleet.documents[pod];
        doc.validate().expect("the rendered document is valid");
        let cp = &doc.client_policies[0];
        let prio = cp.priority.as_ref().expect("priority rendered");
        assert_eq!(prio.header.as_deref(), Some("x-poolpilot-priority"));
        assert!(
            !prio.trust_header,
            "the header is not trusted unless said so"
        );
        assert_eq!(prio.default_class, PriorityClass::Interactive);
        assert_eq!(
            prio.aging_after.map(poolpilot_api::Duration::get),
            Some(std::time::Duration::from_millis(100))
        );
        assert_eq!(
            prio.batch_max_percent,
            Some(40),
            "a share, not divided over pods"
        );
        let classes: Vec<_> = cp.overrides.iter().map(|o| o.class).collect();
        assert_eq!(classes, [Some(PriorityClass::Batch), None]);
        let weights: Vec<_> = cp.overrides.iter().map(|o| o.weight).collect();
        assert_eq!(weights, [None, Some(4)], "a weight, not divided over pods");
    }
    // The limits are divided as before (9 over 3 pods).
    assert_eq!(
        fleet.documents["gw-0"].client_policies[0].max_concurrency,
        3
    );
}

#[test]
fn a_policy_without_priority_renders_none_and_its_overrides_no_class() {
    let spec = SPEC
        .split("  priority:")
        .next()
        .unwrap()
        .replace("    class: Batch\n", "");
    let input = FleetInput {
        policies: vec![policy("p", 0, &spec, 1)],
        pods: pods(1),
        ..FleetInput::default()
    };
    let fleet = plan(&input, &mut Memory::default(), at(0));
    let cp = &fleet.documents["gw-0"].client_policies[0];
    assert_eq!(cp.priority, None);
    assert!(cp.overrides.iter().all(|o| o.class.is_none()));
}

#[test]
fn the_target_is_sized_from_the_total_demand_and_the_status_splits_it_by_class() {
    let run = |classes: [ClassSample; 2]| {
        let mut input = FleetInput {
            policies: vec![policy("p", 0, SPEC, 2)],
            pods: pods(2),
            ..FleetInput::default()
        };
        std::sync::Arc::make_mut(&mut input.samples)
            .backends
            .insert(key(), sample(40.0, 20.0, classes));
        let mut memory = Memory::default();
        let fleet = plan(&input, &mut memory, at(400));
        let pp = &fleet.policies[0];
        let status = compute(
            &input.policies[0],
            pp,
            &memory,
            &RolloutReport::default(),
            at(400),
        );
        (pp.backends[0].target, status.backends[0].clone())
    };
    let (mostly_batch, s1) = run([class(10.0, 0.0), class(30.0, 20.0)]);
    let (mostly_interactive, s2) = run([class(35.0, 15.0), class(5.0, 5.0)]);
    let (unsplit, s3) = run([ClassSample::default(), ClassSample::default()]);
    assert_eq!(
        (mostly_batch, mostly_interactive),
        (unsplit, unsplit),
        "the split changes no target"
    );
    assert_eq!(
        s1.demand_by_class,
        Some(ClassDemand {
            interactive: 10.0,
            batch: 50.0
        })
    );
    assert_eq!(
        s2.demand_by_class,
        Some(ClassDemand {
            interactive: 50.0,
            batch: 10.0
        })
    );
    assert_eq!(
        s3.demand_by_class, None,
        "no class samples: absent, not zero"
    );
    assert_eq!(s3.leased, Some(40.0), "the totals are still reported");
}

#[test]
fn one_missing_class_sample_makes_the_split_missing_never_a_zero() {
    let partial = [
        class(10.0, 1.0),
        ClassSample {
            leased: Some(3.0),
            pending: None,
        },
    ];
    assert_eq!(demand_by_class(&partial), None);
    let nan = [class(f64::NAN, 1.0), class(1.0, 1.0)];
    assert_eq!(demand_by_class(&nan), None);
    assert_eq!(
        demand_by_class(&[class(2.0, 1.0), class(0.0, 0.0)]),
        Some([3.0, 0.0]),
        "a class with no calls is a real zero"
    );
}

proptest! {
    /// Whatever the split, the per-class demands add up to what the class samples hold,
    /// each is non-negative, and both are reported or neither.
    #[test]
    fn the_split_adds_up_and_is_all_or_nothing(
        il in proptest::option::of(0.0f64..1e4),
        ip in proptest::option::of(0.0f64..1e4),
        bl in proptest::option::of(0.0f64..1e4),
        bp in proptest::option::of(0.0f64..1e4),
    ) {
        let samples = [
            ClassSample { leased: il, pending: ip },
            ClassSample { leased: bl, pending: bp },
        ];
        let all = il.is_some() && ip.is_some() && bl.is_some() && bp.is_some();
        match demand_by_class(&samples) {
            Some([i, b]) => {
                prop_assert!(all);
                prop_assert!(i >= 0.0 && b >= 0.0);
                let total = il.unwrap() + ip.unwrap() + bl.unwrap() + bp.unwrap();
                prop_assert!((i + b - total).abs() < 1e-6);
            }
            None => prop_assert!(!all),
        }
    }
}

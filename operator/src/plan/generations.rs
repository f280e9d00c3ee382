//! Generations of the limits documents: handed out so that they only ever increase, across
//! operator restarts (from what was published, acknowledged or recorded), and never above
//! [`MAX_GENERATION`]; values read back that the operator cannot have issued are ignored and
//! reported.

use std::collections::BTreeMap;

use poolpilot_api::limits::MAX_GENERATION;

use super::input::{Acked, FleetInput, GatewayPod, PolicyInput};

/// Whether a generation read back (from a ConfigMap, a pod, a status or a 409 answer) can be one
/// the operator issued: below [`MAX_GENERATION`], so that one more still fits. Anything else
/// is a corrupted or forged value: going above it would wrap or leave the range every JSON
/// reader keeps exactly, and then every PUT would be refused as older.
pub fn plausible_generation(generation: u64) -> bool {
    generation < MAX_GENERATION
}

/// Every generation in `input` that is not [plausible](plausible_generation), saying where it
/// was read: the planner ignores them, the reconcile reports them. Every reconcile asks, over
/// every pod and policy of the namespace, so where a value was read is worded only for the
/// values reported (wording it for each of 3,000 values took 13% of the operator's profiled CPU
/// at 2,000 policies × 1,000 pods).
pub fn implausible_generations(input: &FleetInput) -> Vec<String> {
    let mut out = Vec::new();
    let mut note = |g: u64, place: &dyn Fn() -> String| {
        if !plausible_generation(g) {
            out.push(format!(
                "{} generation {g}, above the largest the operator issues ({MAX_GENERATION}): ignored",
                place()
            ));
        }
    };
    for a in &input.published {
        note(a.generation, &|| {
            format!(
                "a published limits ConfigMap (revision {}) says",
                a.revision
            )
        });
    }
    for pod in &input.pods {
        if let Some(a) = &pod.acked {
            note(a.generation, &|| format!("pod {} reports", pod.name));
        }
    }
    for p in &input.policies {
        if let Some(g) = p.status.as_ref().and_then(|s| s.limits_generation) {
            note(g, &|| format!("the status of policy {} records", p.key));
        }
    }
    note(input.generation_floor, &|| {
        "a pod's answer (409) names".to_owned()
    });
    out
}

/// Hands out generations: an existing one for a revision already known (if above the floor),
/// otherwise one above everything known. Implausible values (see [`plausible_generation`])
/// are left out of what is known.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Generations {
    known: BTreeMap<String, u64>,
    floor: u64,
    next: u64,
}

impl Generations {
    /// What is known: `published` documents (ConfigMaps), what the pods acknowledged, what the
    /// policies' statuses recorded, and the floor every new generation must go above.
    pub fn new(
        policies: &[PolicyInput],
        pods: &[GatewayPod],
        published: &[Acked],
        floor: u64,
    ) -> Self {
        let floor = if plausible_generation(floor) {
            floor
        } else {
            0
        };
        let mut known = BTreeMap::new();
        let mut max = floor;
        let acked = pods.iter().filter_map(|p| p.acked.clone());
        let statuses = policies.iter().filter_map(|p| {
            let s = p.status.as_ref()?;
            Some(Acked {
                revision: s.revision.clone()?,
                generation: s.limits_generation?,
            })
        });
        for a in published
            .iter()
            .cloned()
            .chain(acked)
            .chain(statuses)
            .filter(|a| plausible_generation(a.generation))
        {
            max = max.max(a.generation);
            let g = known.entry(a.revision).or_insert(a.generation);
            *g = (*g).max(a.generation);
        }
        Self {
            known,
            floor,
            // `max` is plausible: below MAX_GENERATION, so this fits.
            next: max + 1,
        }
    }

    /// The generation of a document of `revision`.
    pub fn of(&mut self, revision: &str) -> u64 {
        if let Some(g) = self.known.get(revision).filter(|g| **g > self.floor) {
            return *g;
        }
        // Never above MAX_GENERATION, however many new revisions one plan hands out.
        let g = self.next.min(MAX_GENERATION);
        self.next = g + 1;
        self.known.insert(revision.to_owned(), g);
        g
    }
}

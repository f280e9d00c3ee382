//! Priority classes in the plan: the limits document's rendering of `clients.priority` and of
//! the overrides' classes, and the per-class demand the status reports (the pools are sized
//! from the total; the split says who the demand is).

use poolpilot_api::limits::{Priority, PriorityClass};
use poolpilot_api::policy::{ClassDemand, ClientsSpec, PriorityClassSpec};

pub use super::input::ClassSample;

/// The limits document's class of a CRD class.
pub fn class(spec: PriorityClassSpec) -> PriorityClass {
    match spec {
        PriorityClassSpec::Interactive => PriorityClass::Interactive,
        PriorityClassSpec::Batch => PriorityClass::Batch,
    }
}

/// The limits document's `priority` of a client policy: none when the spec has none (the
/// gateway's defaults then apply: overrides' classes, everything else interactive).
pub fn render(clients: &ClientsSpec) -> Option<Priority> {
    let p = clients.priority.as_ref()?;
    Some(Priority {
        default_class: class(p.default_class),
        header: p.header.clone(),
        trust_header: p.trust_header,
        aging_after: p.aging_after,
        batch_max_percent: p.batch_max_percent,
    })
}

/// The status's per-class demand of a backend, rounded to a thousandth (see
/// [`demand_by_class`]).
pub fn status(samples: &[ClassSample; 2]) -> Option<ClassDemand> {
    let round = |v: f64| (v * 1000.0).round() / 1000.0;
    demand_by_class(samples).map(|[i, b]| ClassDemand {
        interactive: round(i),
        batch: round(b),
    })
}

/// The per-class demand of a backend as its status reports it: `[interactive, batch]`, both
/// present or neither (a class without samples makes the split missing, never a zero).
pub fn demand_by_class(samples: &[ClassSample; 2]) -> Option<[f64; 2]> {
    let [i, b] = samples;
    let (i, b) = i.demand().zip(b.demand())?;
    (i.is_finite() && b.is_finite()).then_some([i.max(0.0), b.max(0.0)])
}

#[cfg(test)]
mod tests;

//! The loop benchmark's plan: its parts, how long and how big each runs (quick or full), and
//! the median its tables report.

use std::time::Duration;

/// One part of the run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Part {
    /// The flash crowd three ways.
    Control,
    /// Rollout time of a limit edit.
    Rollout,
    /// The operator at many policies.
    Scale,
}

impl Part {
    const ALL: [Part; 3] = [Part::Control, Part::Rollout, Part::Scale];

    /// Parses `control,rollout,scale` (all when empty).
    pub fn parse_list(list: &str) -> anyhow::Result<Vec<Part>> {
        if list.trim().is_empty() {
            return Ok(Self::ALL.to_vec());
        }
        list.split(',')
            .map(|p| match p.trim() {
                "control" => Ok(Part::Control),
                "rollout" => Ok(Part::Rollout),
                "scale" => Ok(Part::Scale),
                other => anyhow::bail!("unknown part {other:?} (control, rollout, scale)"),
            })
            .collect()
    }
}

/// How long and how big each part runs.
#[derive(Clone, Debug)]
pub struct Plan {
    /// Short runs that validate the harness.
    pub quick: bool,
    /// How long each flash crowd lasts (a whole number of 15 s buckets).
    pub crowd: Duration,
    /// Gateway counts of the rollout part.
    pub rollout_pods: Vec<u32>,
    /// Edits per gateway count.
    pub rollout_reps: usize,
    /// Edits under the default rollout (each takes at least its 30 s verification).
    pub default_rollout_reps: usize,
    /// Policy counts of the scale part.
    pub policy_levels: Vec<usize>,
    /// How long the operator is measured at each policy count.
    pub scale_window: Duration,
    /// The build profile of the images the node runs (`debug` or `release`), for the report.
    pub image_profile: String,
}

impl Plan {
    /// The quick or the full plan, its pods running images of `image_profile`'s build.
    pub fn new(quick: bool, image_profile: String) -> Self {
        if quick {
            Self {
                quick,
                crowd: Duration::from_secs(30),
                rollout_pods: vec![3, 10],
                rollout_reps: 2,
                default_rollout_reps: 1,
                policy_levels: vec![1, 20],
                scale_window: Duration::from_secs(15),
                image_profile,
            }
        } else {
            Self {
                quick,
                crowd: Duration::from_secs(60),
                rollout_pods: vec![3, 10, 30],
                rollout_reps: 5,
                default_rollout_reps: 3,
                policy_levels: vec![1, 20, 50, 200],
                scale_window: Duration::from_secs(30),
                image_profile,
            }
        }
    }
}

/// The median of `values` (0 when empty).
pub fn median(values: &[f64]) -> f64 {
    let mut v = values.to_vec();
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => 0.0,
        n if n % 2 == 1 => v[n / 2],
        n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parts_parse_and_default_to_all() {
        assert_eq!(Part::parse_list("").unwrap(), Part::ALL.to_vec());
        assert_eq!(
            Part::parse_list("scale, control").unwrap(),
            vec![Part::Scale, Part::Control]
        );
        assert!(Part::parse_list("proxy").is_err());
    }

    #[test]
    fn median_of_odd_even_and_empty() {
        assert_eq!(median(&[3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&[4.0, 1.0, 2.0, 3.0]), 2.5);
        assert_eq!(median(&[]), 0.0);
    }
}

//! The words of the gateway's admin API that its server (the gateway) and its one client (the
//! operator) share: how `GET /v1/clients` ranks a client policy's busiest clients.

/// How `GET /v1/clients` ranks each client policy's clients (`?by=`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Ranking {
    /// By demand (calls in flight + queued, averaged over 10 s): what the operator divides the
    /// client limits by. The default, without `?by=`.
    #[default]
    Demand,
    /// By tokens a second (input and output, over the same 10 s): what the operator divides the
    /// token budgets of the clients without an override by.
    Tokens,
}

impl Ranking {
    /// Every ranking.
    pub const ALL: [Ranking; 2] = [Ranking::Demand, Ranking::Tokens];

    /// Its `by` value.
    pub fn as_str(self) -> &'static str {
        match self {
            Ranking::Demand => "demand",
            Ranking::Tokens => "tokens",
        }
    }

    /// The ranking a `by` value names.
    pub fn parse(by: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|r| r.as_str() == by)
    }

    /// The path and query that ask for it (the default without a query).
    pub fn path(self) -> &'static str {
        match self {
            Ranking::Demand => "/v1/clients",
            Ranking::Tokens => "/v1/clients?by=tokens",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_ranking_is_named_by_its_by_value_and_asked_by_its_path() {
        for r in Ranking::ALL {
            assert_eq!(Ranking::parse(r.as_str()), Some(r));
            let query = r
                .path()
                .strip_prefix("/v1/clients")
                .expect("the clients path");
            match query.strip_prefix("?by=") {
                Some(by) => assert_eq!(Ranking::parse(by), Some(r)),
                None => assert_eq!((query, r), ("", Ranking::default())),
            }
        }
        assert_eq!(Ranking::parse("Tokens"), None, "values are lower case");
    }
}

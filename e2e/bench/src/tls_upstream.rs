//! Part 4b, TLS to the upstream: what each proxy's connection reuse and session resumption
//! save when the upstream speaks TLS and closes every connection after a number of requests
//! (as providers' front ends do), counted by the upstream itself (its `/v1/tls-stats`): new
//! connections, full and resumed handshakes per 1,000 calls, and the proxy's CPU per call.

use anyhow::Context as _;

use crate::load::{self, LoadResult};
use crate::parts::{Bench, order};
use crate::peers::{self, PeerSettings, Target};
use crate::upstream::TlsStats;

/// Requests the TLS upstream serves on one connection before it closes it: every proxy then
/// opens at least 1,000 ÷ this many connections per 1,000 calls, and what each one costs
/// (a full handshake, or a resumed one) shows.
pub const TLS_REQUESTS_PER_CONNECTION: u64 = 100;

/// One run of part 4b.
#[derive(Clone, Debug)]
pub struct TlsRun {
    /// Which proxy.
    pub target: Target,
    /// Client connections (`wrk -c`).
    pub conns: u32,
    /// The load generator's figures.
    pub load: LoadResult,
    /// What the upstream saw during the measured run.
    pub seen: TlsStats,
    /// The proxy's CPU time per call, µs (user + system).
    pub cpu_us_per_call: f64,
}

impl TlsRun {
    /// `count` per 1,000 calls the upstream answered.
    pub fn per_1000(&self, count: u64) -> f64 {
        count as f64 * 1000.0 / self.seen.requests.max(1) as f64
    }

    /// Calls served on a connection that had served one before: `1 − new connections ÷ calls`.
    pub fn reuse_rate(&self) -> f64 {
        1.0 - self.seen.connections as f64 / self.seen.requests.max(1) as f64
    }

    /// Handshakes that resumed a session: `resumed ÷ (full + resumed)`.
    pub fn resumption_rate(&self) -> f64 {
        let handshakes = self.seen.full + self.seen.resumed;
        if handshakes == 0 {
            f64::NAN
        } else {
            self.seen.resumed as f64 / handshakes as f64
        }
    }
}

impl Bench {
    /// The settings of part 4b: part 1's (cap 256), towards the upstream's TLS address.
    pub fn tls_settings(&self) -> PeerSettings {
        PeerSettings {
            upstream: self.upstream_tls.addr,
            upstream_tls: Some(self.upstream_tls.clone()),
            ..self.part1_settings()
        }
    }

    /// Part 4b: every proxy × the TLS concurrency levels × rounds; each run after a warm-up
    /// (its pool and session cache filled), measured by the upstream's counters around it.
    pub async fn part4b(&self) -> anyhow::Result<Vec<TlsRun>> {
        let targets = [Target::Poolpilot, Target::Haproxy, Target::Nginx];
        let s = self.tls_settings();
        let url = format!("http://{}/v1/fast", self.listen);
        let mut runs = Vec::new();
        for round in 0..self.plan.tls_rounds {
            for &conns in &self.plan.tls_concurrency {
                for target in order(&targets, round) {
                    let proc = self.start(target, &s).await?.context("a proxy is needed")?;
                    let wrk = |secs| load::wrk_args(&self.wrk_script, conns, secs, &url);
                    load::wrk(&self.load_cpu, &wrk(self.plan.warmup_secs)).await?;
                    let before = self.tls_stats().await?;
                    let ticks = proc.cpu_ticks()?;
                    let result = load::wrk(&self.load_cpu, &wrk(self.plan.tls_secs)).await?;
                    let ticks = proc.cpu_ticks()?.since(ticks);
                    let seen = self.tls_stats().await?.since(before);
                    proc.stop().await;
                    let run = TlsRun {
                        target,
                        conns,
                        cpu_us_per_call: ticks.total() as f64 * 1e6
                            / self.ticks_per_sec as f64
                            / seen.requests.max(1) as f64,
                        load: result,
                        seen,
                    };
                    eprintln!(
                        "part4b round {round} c={conns} {:>9}: {:.0} req/s; per 1,000 calls {:.1} \
                         new connections, {:.1} full and {:.1} resumed handshakes ({} failed); \
                         {:.1} µs CPU per call",
                        target.name(),
                        run.load.rps,
                        run.per_1000(seen.connections),
                        run.per_1000(seen.full),
                        run.per_1000(seen.resumed),
                        seen.failed,
                        run.cpu_us_per_call,
                    );
                    runs.push(run);
                }
            }
        }
        Ok(runs)
    }

    /// The TLS upstream's counters, from its plain address.
    async fn tls_stats(&self) -> anyhow::Result<TlsStats> {
        let body = peers::get_body(self.upstream, "/v1/tls-stats").await?;
        serde_json::from_str(&body).with_context(|| format!("the upstream's TLS stats {body:?}"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(seen: TlsStats) -> TlsRun {
        TlsRun {
            target: Target::Poolpilot,
            conns: 16,
            load: LoadResult::default(),
            seen,
            cpu_us_per_call: 0.0,
        }
    }

    #[test]
    fn rates_are_counted_per_call_the_upstream_answered() {
        let before = TlsStats {
            connections: 5,
            full: 5,
            resumed: 0,
            failed: 1,
            requests: 300,
        };
        let after = TlsStats {
            connections: 25,
            full: 10,
            resumed: 15,
            failed: 1,
            requests: 2_300,
        };
        let r = run(after.since(before));
        assert_eq!(r.seen.connections, 20);
        assert_eq!(r.seen.failed, 0);
        assert_eq!(r.per_1000(r.seen.connections), 10.0);
        assert_eq!(r.per_1000(r.seen.full), 2.5);
        assert_eq!(r.reuse_rate(), 0.99);
        assert_eq!(r.resumption_rate(), 0.75);
    }

    #[test]
    fn a_run_without_handshakes_has_no_resumption_rate() {
        let r = run(TlsStats {
            requests: 1_000,
            ..TlsStats::default()
        });
        assert!(r.resumption_rate().is_nan());
        assert_eq!(r.reuse_rate(), 1.0);
    }
}

//! How much each client of a policy asked for lately: the time-weighted average of its calls in
//! flight plus queued over the last [`WINDOW`] (10 s), and the tokens its calls used over the
//! same window (input and output, counted as each call ends), for `GET /v1/clients` and the
//! top clients by tokens (`poolpilot_client_top_tokens_per_second`). The operator
//! polls it once per interval and divides a client's fleet-wide limits over the pods by where
//! its calls arrive; an average over the window, not the level at the poll, so that a client
//! of short calls is seen as busy as it is between them.
//!
//! Each client's level (in flight + queued) is integrated over time in one-second buckets (a
//! ring of eleven, by bucket number since the table's start); the average at `now` sums the
//! buckets of `[now − 10 s, now]`, the oldest one in part (its share of the window, as if its
//! area were spread evenly over its second), and divides by 10 s. A client present for less
//! than the window counts as idle before it came. Tokens go in the same buckets, by the second
//! their call ended, and their rate is the same sum (the oldest bucket in part) over 10 s.
//!
//! Memory is bounded like the client table's: a record lives while its client has calls in
//! flight or queued, and after its last call ends only until the window has forgotten it (or
//! sooner, evicted oldest-quiet first, when the table holds `bound` records).

use std::collections::{HashMap, VecDeque};
use std::time::Duration;

use tokio::time::Instant;

/// The span the average is taken over.
pub const WINDOW: Duration = Duration::from_secs(10);

const BUCKET: Duration = Duration::from_secs(1);
/// Buckets in the ring: the window's ten, and the one the window starts in.
const BUCKETS: usize = 11;

/// The recent demand of the clients of one policy, keyed by `K`.
#[derive(Debug)]
pub struct DemandTable<K> {
    epoch: Instant,
    records: HashMap<K, Demand>,
    /// Records whose level went to 0, with when it did: the eviction order (a record busy
    /// since is stale here and skipped).
    quiet: VecDeque<(K, Instant)>,
}

/// One client's level and its recent area, in level × seconds per bucket, and its tokens per
/// bucket.
#[derive(Debug)]
struct Demand {
    level: u32,
    /// Integrated up to here.
    since: Instant,
    /// The bucket number of `since`.
    bucket: u64,
    area: [f64; BUCKETS],
    /// Input (prompt) tokens of the calls that ended in each bucket.
    input: [u64; BUCKETS],
    /// Output (completion) tokens of the same.
    output: [u64; BUCKETS],
}

/// What a client did over the window ending now.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Recent {
    /// Calls in flight plus queued, time-weighted average.
    pub demand: f64,
    /// Input tokens a second.
    pub input: f64,
    /// Output tokens a second.
    pub output: f64,
}

impl Recent {
    /// Input and output tokens a second.
    pub fn tokens(&self) -> f64 {
        self.input + self.output
    }
}

impl<K: Copy + Eq + std::hash::Hash> DemandTable<K> {
    /// An empty table whose buckets start at `now`.
    pub fn new(now: Instant) -> Self {
        Self {
            epoch: now,
            records: HashMap::new(),
            quiet: VecDeque::new(),
        }
    }

    /// `key` has `level` calls in flight and queued from `now` on. A new record is made only
    /// for a level above 0, evicting the longest-quiet record when `bound` are held.
    pub fn record(&mut self, key: K, level: u32, now: Instant, bound: usize) {
        if !self.records.contains_key(&key) {
            if level == 0 {
                return;
            }
            self.make_room(bound);
        }
        let epoch = self.epoch;
        let demand = self
            .records
            .entry(key)
            .or_insert_with(|| Demand::new(epoch, now));
        if demand.level == level {
            return;
        }
        demand.advance(epoch, now);
        demand.level = level;
        if level == 0 {
            self.quiet.push_back((key, now));
            if self.quiet.len() > 2 * self.records.len() + 64 {
                self.compact();
            }
        }
    }

    /// The average demand of `key` over the window ending at `now`, 0 when it has no record.
    /// `now` is never before the last change or read of the record.
    #[cfg(test)]
    pub fn average(&mut self, key: &K, now: Instant) -> f64 {
        let epoch = self.epoch;
        self.records
            .get_mut(key)
            .map_or(0.0, |d| d.recent(epoch, now).demand)
    }

    /// The calls of `key` that ended at `now` used `input` and `output` tokens. Counted only
    /// in a record it has (a client with a call has one: it was not quiet).
    pub fn used(&mut self, key: &K, input: u64, output: u64, now: Instant) {
        let epoch = self.epoch;
        if let Some(d) = self.records.get_mut(key) {
            d.advance(epoch, now);
            // The bucket `now` is in (`advance` stops short of one that starts at `now`).
            d.move_to(bucket_of(epoch, now).max(d.bucket));
            let b = ring(d.bucket);
            d.input[b] += input;
            d.output[b] += output;
        }
    }

    /// Every client with demand or tokens in the window (or calls now), with what it did over
    /// the window ending at `now`.
    pub fn all(&mut self, now: Instant) -> Vec<(K, Recent)> {
        let epoch = self.epoch;
        self.records
            .iter_mut()
            .filter_map(|(key, d)| {
                let recent = d.recent(epoch, now);
                (recent.demand > 0.0 || recent.tokens() > 0.0 || d.level > 0)
                    .then_some((*key, recent))
            })
            .collect()
    }

    /// Forgets the records the window no longer sees.
    pub fn purge(&mut self, now: Instant) {
        self.records
            .retain(|_, d| d.level > 0 || now.duration_since(d.since) <= WINDOW + BUCKET);
        self.compact();
    }

    /// Records held.
    #[cfg(test)]
    pub fn len(&self) -> usize {
        self.records.len()
    }

    fn make_room(&mut self, bound: usize) {
        while self.records.len() >= bound.max(1) {
            let Some((key, went_quiet)) = self.quiet.pop_front() else {
                return;
            };
            let evictable = self
                .records
                .get(&key)
                .is_some_and(|d| d.level == 0 && d.since == went_quiet);
            if evictable {
                self.records.remove(&key);
            }
        }
    }

    fn compact(&mut self) {
        let records = &self.records;
        self.quiet.retain(|(key, went_quiet)| {
            records
                .get(key)
                .is_some_and(|d| d.level == 0 && d.since == *went_quiet)
        });
    }
}

impl Demand {
    fn new(epoch: Instant, now: Instant) -> Self {
        Self {
            level: 0,
            since: now,
            bucket: bucket_of(epoch, now),
            area: [0.0; BUCKETS],
            input: [0; BUCKETS],
            output: [0; BUCKETS],
        }
    }

    /// Moves to bucket `b`, clearing the buckets it enters.
    fn move_to(&mut self, b: u64) {
        while self.bucket < b {
            self.bucket += 1;
            let r = ring(self.bucket);
            self.area[r] = 0.0;
            self.input[r] = 0;
            self.output[r] = 0;
        }
    }

    /// Integrates the level from `since` to `now`, clearing the buckets it moves into.
    fn advance(&mut self, epoch: Instant, now: Instant) {
        if now <= self.since {
            return;
        }
        let last = bucket_of(epoch, now);
        let mut t = self.since;
        if last >= self.bucket + BUCKETS as u64 {
            // Longer than the ring since the last change: only its last buckets matter.
            self.area = [0.0; BUCKETS];
            self.input = [0; BUCKETS];
            self.output = [0; BUCKETS];
            self.bucket = last + 1 - BUCKETS as u64;
            t = t.max(start_of(epoch, self.bucket));
        }
        let level = f64::from(self.level);
        loop {
            let b = bucket_of(epoch, t).max(self.bucket);
            self.move_to(b);
            let end = now.min(start_of(epoch, b + 1));
            self.area[ring(b)] += level * end.duration_since(t).as_secs_f64();
            if end >= now {
                break;
            }
            t = end;
        }
        self.since = now;
    }

    fn recent(&mut self, epoch: Instant, now: Instant) -> Recent {
        self.advance(epoch, now);
        let b = bucket_of(epoch, now).max(self.bucket);
        self.move_to(b);
        let into = now.duration_since(start_of(epoch, b)).as_secs_f64() / BUCKET.as_secs_f64();
        let mut sum = Recent::default();
        for k in 0..BUCKETS as u64 {
            let Some(bucket) = b.checked_sub(k) else {
                break;
            };
            let weight = if k == BUCKETS as u64 - 1 {
                1.0 - into
            } else {
                1.0
            };
            let r = ring(bucket);
            sum.demand += weight * self.area[r];
            sum.input += weight * self.input[r] as f64;
            sum.output += weight * self.output[r] as f64;
        }
        let window = WINDOW.as_secs_f64();
        Recent {
            demand: sum.demand / window,
            input: sum.input / window,
            output: sum.output / window,
        }
    }
}

fn bucket_of(epoch: Instant, t: Instant) -> u64 {
    (t.duration_since(epoch).as_nanos() / BUCKET.as_nanos()) as u64
}

fn start_of(epoch: Instant, bucket: u64) -> Instant {
    epoch + BUCKET * bucket as u32
}

fn ring(bucket: u64) -> usize {
    (bucket % BUCKETS as u64) as usize
}

#[cfg(test)]
mod tests {
    use super::*;

    fn secs(s: f64) -> Duration {
        Duration::from_secs_f64(s)
    }

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() < 1e-9
    }

    #[tokio::test(start_paused = true)]
    async fn the_average_weighs_each_level_by_its_time_in_the_last_ten_seconds() {
        let t0 = Instant::now();
        let mut table = DemandTable::new(t0);
        // 2 calls for 5 s, then none (read as time goes on: reads move the record forward).
        table.record(1, 2, t0, 100);
        let got = table.average(&1, t0 + secs(2.5));
        assert!(close(got, 0.5), "2 × 2.5 s over 10 s: {got}");
        table.record(1, 0, t0 + secs(5.0), 100);
        for (at, want) in [
            (5.0, 1.0),  // 2 × 5 s
            (10.0, 1.0), // all of it still in the window
            (12.0, 0.6), // [2 s, 5 s] left: 2 × 3 s
            (14.5, 0.1), // [4.5 s, 5 s] left: 2 × 0.5 s (the oldest bucket in part)
            (15.0, 0.0),
            (40.0, 0.0),
        ] {
            let got = table.average(&1, t0 + secs(at));
            assert!(close(got, want), "at {at} s: {got}, not {want}");
        }
    }

    #[tokio::test(start_paused = true)]
    async fn short_calls_count_for_the_time_they_ran_and_steady_load_for_its_level() {
        let t0 = Instant::now();
        let mut table = DemandTable::new(t0);
        // A call of 100 ms every second, and a client holding 3 calls all along.
        for s in 0..20 {
            let at = t0 + secs(f64::from(s));
            table.record(1, 1, at, 100);
            table.record(1, 0, at + secs(0.1), 100);
        }
        table.record(2, 3, t0, 100);
        let now = t0 + secs(20.0);
        assert!(
            close(table.average(&1, now), 0.1),
            "{}",
            table.average(&1, now)
        );
        assert!(close(table.average(&2, now), 3.0));
        // A long quiet spell, and an update long after: only the window counts.
        table.record(2, 1, t0 + secs(3600.0), 100);
        assert!(
            close(table.average(&2, t0 + secs(3605.0)), 2.0),
            "3 × 5 s + 1 × 5 s"
        );
        let mut all = table.all(t0 + secs(3605.0));
        all.sort_by_key(|(k, _)| *k);
        assert_eq!(all.len(), 1, "client 1 is out of the window: {all:?}");
    }

    #[tokio::test(start_paused = true)]
    async fn tokens_are_a_rate_over_the_same_window_by_the_second_their_call_ended() {
        let t0 = Instant::now();
        let mut table = DemandTable::new(t0);
        table.record(1, 1, t0, 100);
        // 500 in and 100 out at 2.5 s, 300 and 50 at 4 s.
        table.used(&1, 500, 100, t0 + secs(2.5));
        table.used(&1, 300, 50, t0 + secs(4.0));
        table.record(1, 0, t0 + secs(4.0), 100);
        let at = |table: &mut DemandTable<i32>, s: f64| {
            let all = table.all(t0 + secs(s));
            all.first().map_or(Recent::default(), |(_, r)| *r)
        };
        let r = at(&mut table, 5.0);
        assert!(close(r.input, 80.0) && close(r.output, 15.0), "{r:?}");
        assert!(close(r.demand, 0.4), "1 call for 4 s over 10 s: {r:?}");
        // At 12.5 s the window starts at 2.5 s, inside the bucket [2 s, 3 s) of the first
        // call's end: half of it counts, as half of that second's demand does.
        let r = at(&mut table, 12.5);
        assert!(close(r.input, 55.0) && close(r.output, 10.0), "{r:?}");
        let r = at(&mut table, 14.5);
        assert!(close(r.input, 15.0), "only the second call, half: {r:?}");
        assert!(table.all(t0 + secs(15.0)).is_empty(), "out of the window");
        // No record, nothing counted: tokens never make one.
        table.used(&7, 10, 10, t0 + secs(15.0));
        assert_eq!(table.len(), 1);
    }

    #[tokio::test(start_paused = true)]
    async fn records_are_forgotten_once_the_window_has_passed_and_bounded_meanwhile() {
        let t0 = Instant::now();
        let mut table = DemandTable::new(t0);
        table.record(1, 1, t0, 2);
        table.record(1, 0, t0 + secs(1.0), 2);
        table.record(2, 1, t0, 2);
        assert_eq!(table.len(), 2);
        // A third client at the bound evicts the quiet one, never a busy one.
        table.record(3, 1, t0 + secs(2.0), 2);
        assert_eq!(table.len(), 2);
        assert_eq!(table.average(&1, t0 + secs(2.0)), 0.0, "evicted");
        table.record(4, 0, t0 + secs(2.0), 2);
        assert_eq!(table.len(), 2, "an idle newcomer makes no record");
        table.record(2, 0, t0 + secs(3.0), 2);
        table.purge(t0 + secs(10.0));
        assert_eq!(table.len(), 2, "still in the window");
        table.purge(t0 + secs(20.0));
        assert_eq!(table.len(), 1, "only the client with calls is kept");
    }
}

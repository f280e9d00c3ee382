//! State-machine tests of the client limiter with paused time.

use poolpilot_api::Duration as ApiDuration;
use poolpilot_api::limits::{ClientOverride, ClientShare, ClientTokenShare, SlowCalls};

use super::*;

fn policy(max: u32, queue: u32) -> ClientPolicy {
    ClientPolicy {
        name: "default".into(),
        identity: ClientIdentity::Header("x-api-key".into()),
        max_concurrency: max,
        max_queue: queue,
        queue_timeout: ApiDuration::from_secs(2),
        overrides: vec![ClientOverride {
            name: "batch-team".into(),
            key_sha256: hex::encode(Sha256::digest(b"batch-key")),
            max_concurrency: 5,
            class: None,
            tokens: None,
            weight: None,
        }],
        slow_calls: None,
        max_clients: ClientPolicy::DEFAULT_MAX_CLIENTS,
        priority: None,
        client_shares: Vec::new(),
        tokens: None,
        client_token_shares: Vec::new(),
    }
}

fn limiter(max: u32, queue: u32) -> ClientLimiter {
    ClientLimiter::new(policy(max, queue), Metrics::new())
}

/// Starts a call of `key` and lets it reach its place in the queue; the task ends when the call
/// is admitted (`Ok`) or refused.
async fn queued_call(
    l: &ClientLimiter,
    key: ClientKey,
) -> tokio::task::JoinHandle<Result<(), ClientRejection>> {
    let l = l.clone();
    let call = tokio::spawn(async move { l.acquire(key).await.map(|_| ()) });
    tokio::task::yield_now().await;
    call
}

#[tokio::test(start_paused = true)]
async fn over_the_limit_queues_then_refuses_while_others_pass() {
    let l = limiter(2, 1);
    let alice = ClientKey::of(b"alice");
    let _a1 = l.acquire(alice).await.unwrap();
    let _a2 = l.acquire(alice).await.unwrap();
    let queued = queued_call(&l, alice).await;
    match l.acquire(alice).await {
        Err(ClientRejection::Concurrency {
            client,
            limit,
            retry_after,
        }) => {
            assert_eq!((&*client, limit), ("other", 2));
            // Nothing finished yet: the queue timeout is the estimate.
            assert_eq!(retry_after, Duration::from_secs(2));
        }
        other => panic!("expected a concurrency rejection, got {other:?}"),
    }
    let bob = ClientKey::of(b"bob");
    l.acquire(bob).await.expect("another client is unaffected");
    drop(queued);
}

#[tokio::test(start_paused = true)]
async fn a_queued_call_is_admitted_when_a_slot_frees() {
    let l = limiter(1, 4);
    let key = ClientKey::of(b"alice");
    let first = l.acquire(key).await.unwrap();
    let queued = {
        let l = l.clone();
        tokio::spawn(async move { l.acquire(key).await.map(|p| p.started()) })
    };
    tokio::time::sleep(Duration::from_millis(500)).await;
    drop(first);
    let started = queued
        .await
        .unwrap()
        .expect("admitted when the first call ended");
    assert_eq!(started.elapsed(), Duration::ZERO);
}

#[tokio::test(start_paused = true)]
async fn the_queue_times_out() {
    let l = limiter(1, 4);
    let key = ClientKey::of(b"alice");
    let _first = l.acquire(key).await.unwrap();
    let start = Instant::now();
    match l.acquire(key).await {
        Err(ClientRejection::QueueTimeout { waited, .. }) => {
            assert_eq!(waited, Duration::from_secs(2));
            assert_eq!(start.elapsed(), Duration::from_secs(2));
        }
        other => panic!("expected a queue timeout, got {other:?}"),
    }
    assert_eq!(
        l.top_clients(10)[0].queued,
        0,
        "the timed-out call left the queue"
    );
}

#[tokio::test(start_paused = true)]
async fn an_allowlisted_client_gets_its_own_limit() {
    let l = limiter(1, 0);
    let batch = ClientKey::of(b"batch-key");
    let mut permits = Vec::new();
    for _ in 0..5 {
        let p = l.acquire(batch).await.expect("the override allows 5");
        assert_eq!(&**p.label(), "batch-team");
        permits.push(p);
    }
    assert!(matches!(
        l.acquire(batch).await,
        Err(ClientRejection::Concurrency { limit: 5, .. })
    ));
    let top = l.top_clients(1);
    assert_eq!((top[0].client.as_str(), top[0].inflight), ("batch-team", 5));
    assert_eq!(l.inflight_by_label()["batch-team"], 5);
}

#[tokio::test(start_paused = true)]
async fn retry_after_follows_the_clients_pace() {
    let l = limiter(2, 1);
    let key = ClientKey::of(b"alice");
    // Calls of 3s each, while a long call keeps the client active (and remembered).
    let _p1 = l.acquire(key).await.unwrap();
    for _ in 0..3 {
        let p = l.acquire(key).await.unwrap();
        tokio::time::sleep(Duration::from_secs(3)).await;
        drop(p);
    }
    let _p2 = l.acquire(key).await.unwrap();
    let _queued = queued_call(&l, key).await;
    match l.acquire(key).await {
        // Two calls to drain (the queued one and this one) at 2 per 3s: 3s.
        Err(ClientRejection::Concurrency { retry_after, .. }) => {
            assert_eq!(retry_after, Duration::from_secs(3))
        }
        other => panic!("expected a rejection, got {other:?}"),
    }
}

#[tokio::test(start_paused = true)]
async fn slow_clients_are_demoted_then_restored() {
    let mut p = policy(4, 0);
    p.slow_calls = Some(slow_calls(4));
    let l = ClientLimiter::new(p, Metrics::new());
    let key = ClientKey::of(b"slowpoke");
    for _ in 0..4 {
        let permit = l.acquire(key).await.unwrap();
        tokio::time::sleep(Duration::from_secs(2)).await;
        drop(permit);
    }
    let held = l.acquire(key).await.unwrap();
    match l.acquire(key).await {
        Err(ClientRejection::Concurrency {
            limit, retry_after, ..
        }) => {
            assert_eq!(limit, 1, "demoted to demotedConcurrency");
            assert_eq!(
                retry_after,
                Duration::from_secs(30),
                "the rest of the cooldown"
            );
        }
        other => panic!("expected a demoted rejection, got {other:?}"),
    }
    assert!(l.top_clients(1)[0].demoted);
    let other = ClientKey::of(b"quick");
    let _q: Vec<_> = [
        l.acquire(other).await.unwrap(),
        l.acquire(other).await.unwrap(),
    ]
    .into();
    drop(held);

    tokio::time::sleep(Duration::from_secs(31)).await;
    let _a = l.acquire(key).await.unwrap();
    let _b = l
        .acquire(key)
        .await
        .expect("restored to its full limit after the cooldown");
}

#[tokio::test(start_paused = true)]
async fn raising_the_limit_admits_queued_calls() {
    let l = limiter(1, 4);
    let key = ClientKey::of(b"alice");
    let _first = l.acquire(key).await.unwrap();
    let queued = queued_call(&l, key).await;
    l.set_policy(policy(2, 4));
    queued
        .await
        .unwrap()
        .expect("admitted by the raise, before the queue timeout");
}

/// Slow-call detection: a call over 1 s is slow; once a client made `min_calls` calls, more than
/// half of them slow demotes it to one call at a time for 30 s.
fn slow_calls(min_calls: u32) -> SlowCalls {
    SlowCalls {
        threshold: ApiDuration::from_secs(1),
        max_ratio: 0.5,
        demoted_concurrency: 1,
        cooldown: ApiDuration::from_secs(30),
        min_calls,
    }
}

fn slow_policy(max_clients: u32) -> ClientPolicy {
    let mut p = policy(1, 1);
    p.max_clients = max_clients;
    p.slow_calls = Some(slow_calls(4));
    p
}

#[tokio::test(start_paused = true)]
async fn a_client_with_nothing_to_remember_is_forgotten_when_its_call_ends() {
    let l = limiter(1, 1);
    for i in 0..1000u32 {
        drop(l.acquire(ClientKey::of(&i.to_be_bytes())).await.unwrap());
    }
    assert_eq!(
        l.tracked_clients(),
        0,
        "1000 rotated keys leave nothing behind"
    );
}

#[tokio::test(start_paused = true)]
async fn a_client_with_slow_calls_is_remembered_until_purged() {
    let l = ClientLimiter::new(slow_policy(100), Metrics::new());
    let slow = ClientKey::of(b"slow");
    let permit = l.acquire(slow).await.unwrap();
    tokio::time::sleep(Duration::from_secs(2)).await;
    drop(permit);
    drop(l.acquire(ClientKey::of(b"quick")).await.unwrap());
    assert_eq!(
        l.tracked_clients(),
        1,
        "the slow call is history; the quick one is not"
    );
    tokio::time::sleep(Duration::from_secs(61)).await;
    l.purge();
    assert_eq!(l.tracked_clients(), 0);
}

#[tokio::test(start_paused = true)]
async fn a_full_table_evicts_the_longest_idle_client_and_refuses_only_when_all_are_busy() {
    let metrics = Metrics::new();
    let l = ClientLimiter::new(slow_policy(3), metrics.clone());
    // Three clients with history, idle one after the other.
    for name in [b"a", b"b", b"c"] {
        let p = l.acquire(ClientKey::of(name)).await.unwrap();
        tokio::time::sleep(Duration::from_secs(2)).await;
        drop(p);
    }
    assert_eq!(l.tracked_clients(), 3);
    // A fourth evicts `a`, the longest idle.
    let d = l.acquire(ClientKey::of(b"d")).await.unwrap();
    assert_eq!(l.tracked_clients(), 3);
    assert!(
        metrics
            .encode()
            .contains("poolpilot_client_evictions_total 1")
    );
    // `b` busy again: its old idle record is stale; `c` goes next.
    let b = l.acquire(ClientKey::of(b"b")).await.unwrap();
    let e = l.acquire(ClientKey::of(b"e")).await.unwrap();
    assert_eq!(l.tracked_clients(), 3);
    // Now b, d and e all have calls in flight: no room for a new client.
    match l.acquire(ClientKey::of(b"f")).await {
        Err(ClientRejection::TableFull { max: 3 }) => {}
        other => panic!("expected a full table, got {other:?}"),
    }
    // A known client is still served within its own limit.
    drop(b);
    let _b = l.acquire(ClientKey::of(b"b")).await.unwrap();
    drop((d, e));
    assert!(l.acquire(ClientKey::of(b"f")).await.is_ok());
}

#[test]
fn keys_are_never_shown_raw() {
    let key = ClientKey::of(b"sk-secret-api-key");
    let shown = format!("{key:?} {}", key.short());
    assert!(!shown.contains("secret"));
    assert!(shown.starts_with("sha256:"));
}

#[tokio::test(start_paused = true)]
async fn a_long_stream_that_flows_is_not_slow_but_a_late_first_byte_or_a_stall_is() {
    let mut p = policy(4, 0);
    p.slow_calls = Some(slow_calls(2));
    let l = ClientLimiter::new(p, Metrics::new());
    // A 10 s stream with a chunk every 500 ms: its first byte and every gap are quick.
    let streamer = ClientKey::of(b"streamer");
    for _ in 0..4 {
        let mut permit = l.acquire(streamer).await.unwrap();
        for _ in 0..20 {
            tokio::time::sleep(Duration::from_millis(500)).await;
            permit.frame();
        }
        assert_eq!(
            permit.longest_wait(Instant::now()),
            Duration::from_millis(500)
        );
        drop(permit);
    }
    assert!(
        !l.top_clients(1).first().is_some_and(|c| c.demoted),
        "40 s of streams, never a slow wait"
    );
    let _a = l.acquire(streamer).await.unwrap();
    let _b = l
        .acquire(streamer)
        .await
        .expect("a streaming client keeps its full limit");

    // The same calls with a 3 s first byte, or a 3 s stall mid-stream, are slow.
    let late = ClientKey::of(b"late");
    let stalled = ClientKey::of(b"stalled");
    for (key, stall_at) in [(late, 0), (stalled, 10)] {
        for _ in 0..2 {
            let mut permit = l.acquire(key).await.unwrap();
            for i in 0..20 {
                let gap = if i == stall_at { 3000 } else { 100 };
                tokio::time::sleep(Duration::from_millis(gap)).await;
                permit.frame();
            }
            assert_eq!(permit.longest_wait(Instant::now()), Duration::from_secs(3));
            drop(permit);
        }
        let _held = l.acquire(key).await.unwrap();
        assert!(
            matches!(
                l.acquire(key).await,
                Err(ClientRejection::Concurrency { limit: 1, .. })
            ),
            "demoted"
        );
    }
}

// === priority classes ===

fn prioritized(trust_header: bool) -> ClientLimiter {
    let mut p = policy(1, 8);
    p.overrides[0].class = Some(PriorityClass::Batch);
    p.overrides.push(ClientOverride {
        name: "frontend".into(),
        key_sha256: hex::encode(Sha256::digest(b"frontend-key")),
        max_concurrency: 5,
        class: Some(PriorityClass::Interactive),
        tokens: None,
        weight: None,
    });
    p.priority = Some(poolpilot_api::limits::Priority {
        header: Some("x-poolpilot-priority".into()),
        trust_header,
        aging_after: Some(ApiDuration::from_millis(500)),
        ..Default::default()
    });
    ClientLimiter::new(p, Metrics::new())
}

fn with_header(value: &str) -> HeaderMap {
    let mut headers = HeaderMap::new();
    headers.insert("x-poolpilot-priority", value.parse().unwrap());
    headers
}

#[test]
fn a_client_may_lower_itself_to_batch_but_not_raise_itself_unless_the_header_is_trusted() {
    let untrusted = prioritized(false);
    let anyone = ClientKey::of(b"anyone");
    let none = HeaderMap::new();
    assert_eq!(
        untrusted.classify(anyone, &none),
        PriorityClass::Interactive
    );
    assert_eq!(
        untrusted.classify(anyone, &with_header("BATCH")),
        PriorityClass::Batch
    );
    assert_eq!(
        untrusted.classify(anyone, &with_header("nonsense")),
        PriorityClass::Interactive
    );
    // A batch override cannot raise itself with the header, trusted or not: overrides win.
    let batch_key = ClientKey::of(b"batch-key");
    for limiter in [prioritized(false), prioritized(true)] {
        assert_eq!(
            limiter.classify(batch_key, &with_header("interactive")),
            PriorityClass::Batch
        );
    }
    // An interactive override stays interactive when it sends `batch`: the override pins it.
    assert_eq!(
        untrusted.classify(ClientKey::of(b"frontend-key"), &with_header("batch")),
        PriorityClass::Interactive
    );

    // With a batch default, the header raises a call only when the policy trusts it.
    let mut p = policy(1, 8);
    p.priority = Some(poolpilot_api::limits::Priority {
        default_class: PriorityClass::Batch,
        header: Some("x-poolpilot-priority".into()),
        ..Default::default()
    });
    let l = ClientLimiter::new(p.clone(), Metrics::new());
    assert_eq!(
        l.classify(anyone, &with_header("interactive")),
        PriorityClass::Batch
    );
    p.priority.as_mut().unwrap().trust_header = true;
    l.set_policy(p);
    assert_eq!(
        l.classify(anyone, &with_header("Interactive")),
        PriorityClass::Interactive
    );
}

#[tokio::test(start_paused = true)]
async fn a_clients_queued_interactive_calls_go_before_its_batch_calls_until_batch_ages() {
    let l = prioritized(false);
    let key = ClientKey::of(b"alice");
    let first = l.acquire(key).await.unwrap();
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    let queue = |class: PriorityClass, tag: usize| {
        let (l, tx) = (l.clone(), tx.clone());
        tokio::spawn(async move {
            let permit = l.acquire_as(key, class).await.expect("admitted in time");
            tx.send(tag).unwrap();
            tokio::time::sleep(Duration::from_millis(100)).await;
            drop(permit);
        });
    };
    queue(PriorityClass::Batch, 0);
    tokio::time::sleep(Duration::from_millis(100)).await;
    queue(PriorityClass::Interactive, 1);
    // After the batch call's aging deadline (500ms): ranked after it.
    tokio::time::sleep(Duration::from_millis(450)).await;
    queue(PriorityClass::Interactive, 2);
    tokio::task::yield_now().await;
    assert_eq!(l.queued_by_class(), [2, 1]);
    drop(first);
    let mut order = Vec::new();
    for _ in 0..3 {
        order.push(rx.recv().await.unwrap());
    }
    assert_eq!(order, [1, 0, 2]);
    assert_eq!(l.queued_by_class(), [0, 0]);
}

// === client shares ===

fn share(key: &[u8], max_concurrency: u32, max_queue: u32) -> ClientShare {
    ClientShare {
        key_sha256: hex::encode(Sha256::digest(key)),
        max_concurrency,
        max_queue,
    }
}

fn shared_policy(shares: Vec<ClientShare>) -> ClientPolicy {
    ClientPolicy {
        client_shares: shares,
        ..policy(2, 1)
    }
}

#[tokio::test(start_paused = true)]
async fn a_client_with_a_share_gets_its_share_and_others_the_policys_limits() {
    let l = ClientLimiter::new(shared_policy(vec![share(b"pinned", 4, 2)]), Metrics::new());
    let pinned = ClientKey::of(b"pinned");
    let mut permits = Vec::new();
    for _ in 0..4 {
        permits.push(l.acquire(pinned).await.expect("its share allows 4"));
    }
    let queued = [queued_call(&l, pinned).await, queued_call(&l, pinned).await];
    match l.acquire(pinned).await {
        Err(ClientRejection::Concurrency { limit: 4, .. }) => {}
        other => panic!("expected a refusal past its share's queue of 2, got {other:?}"),
    }
    assert_eq!(l.top_clients(1)[0].limit, 4);
    // A client without a share: the policy's 2 and a queue of 1.
    let other = ClientKey::of(b"elsewhere");
    let _o = [
        l.acquire(other).await.unwrap(),
        l.acquire(other).await.unwrap(),
    ];
    let _q = queued_call(&l, other).await;
    assert!(matches!(
        l.acquire(other).await,
        Err(ClientRejection::Concurrency { limit: 2, .. })
    ));
    drop(permits);
    for call in queued {
        call.await.unwrap().expect("admitted as the share frees");
    }
}

#[tokio::test(start_paused = true)]
async fn an_override_wins_over_a_share() {
    // `batch-key` is the override `batch-team` (5 calls); a share of 1 for it is ignored.
    let l = ClientLimiter::new(
        shared_policy(vec![share(b"batch-key", 1, 0)]),
        Metrics::new(),
    );
    let batch = ClientKey::of(b"batch-key");
    let mut permits = Vec::new();
    for _ in 0..5 {
        permits.push(l.acquire(batch).await.expect("the override's 5"));
    }
    // The policy's queue of 1, not the share's 0.
    let _queued = queued_call(&l, batch).await;
    assert_eq!(l.top_clients(1)[0].queued, 1);
}

#[tokio::test(start_paused = true)]
async fn a_demoted_client_gets_the_lower_of_demoted_concurrency_and_its_share() {
    let mut p = shared_policy(vec![share(b"slowpoke", 6, 0)]);
    p.slow_calls = Some(SlowCalls {
        demoted_concurrency: 3,
        ..slow_calls(4)
    });
    let l = ClientLimiter::new(p.clone(), Metrics::new());
    let key = ClientKey::of(b"slowpoke");
    for _ in 0..4 {
        let permit = l.acquire(key).await.unwrap();
        tokio::time::sleep(Duration::from_secs(2)).await;
        drop(permit);
    }
    assert!(l.top_clients(1).is_empty(), "no call in flight");
    let held = l.acquire(key).await.unwrap();
    let top = l.top_clients(1);
    assert!(top[0].demoted);
    assert_eq!(top[0].limit, 3, "demotedConcurrency under a share of 6");
    // A share below demotedConcurrency is the limit then.
    p.client_shares = vec![share(b"slowpoke", 2, 0)];
    l.set_policy(p);
    assert_eq!(l.top_clients(1)[0].limit, 2);
    drop(held);
}

#[tokio::test(start_paused = true)]
async fn a_new_document_changes_live_clients_shares_without_cutting_a_call() {
    let l = ClientLimiter::new(shared_policy(vec![share(b"pinned", 3, 4)]), Metrics::new());
    let key = ClientKey::of(b"pinned");
    let mut permits = Vec::new();
    for _ in 0..3 {
        permits.push(l.acquire(key).await.unwrap());
    }
    // Lowered to 1: the three calls go on; a new one waits until the client is under 1.
    l.set_policy(shared_policy(vec![share(b"pinned", 1, 4)]));
    let waiting = queued_call(&l, key).await;
    assert_eq!(l.top_clients(1)[0].inflight, 3, "nothing cut");
    assert_eq!(l.top_clients(1)[0].queued, 1);
    drop(permits.pop());
    drop(permits.pop());
    tokio::task::yield_now().await;
    assert_eq!(
        l.top_clients(1)[0].queued,
        1,
        "still over the new limit of 1"
    );
    drop(permits.pop());
    waiting
        .await
        .unwrap()
        .expect("admitted under the new share");
    // Raised to 3, then the share removed: back to the policy's 2 (and its queue of 1).
    let held: Vec<_> = [l.acquire(key).await.unwrap()].into();
    let queued = [queued_call(&l, key).await, queued_call(&l, key).await];
    l.set_policy(shared_policy(vec![share(b"pinned", 3, 4)]));
    for call in queued {
        call.await
            .unwrap()
            .expect("a raised share admits queued calls at once");
    }
    l.set_policy(shared_policy(Vec::new()));
    assert_eq!(l.top_clients(1)[0].limit, 2);
    drop(held);
}

#[tokio::test(start_paused = true)]
async fn the_busiest_clients_are_ranked_by_their_demand_over_the_last_ten_seconds() {
    let l = limiter(8, 8);
    let steady = ClientKey::of(b"steady");
    let spiky = ClientKey::of(b"spiky");
    // `steady` holds 2 calls all along; `spiky` held 6 for the first 2 s only.
    let _steady = [
        l.acquire(steady).await.unwrap(),
        l.acquire(steady).await.unwrap(),
    ];
    let mut spikes = Vec::new();
    for _ in 0..6 {
        spikes.push(l.acquire(spiky).await.unwrap());
    }
    tokio::time::sleep(Duration::from_secs(2)).await;
    drop(spikes);
    tokio::time::sleep(Duration::from_secs(3)).await;
    let busiest = l.busiest(32, Ranking::Demand);
    let by_key = |k: ClientKey| busiest.iter().find(|c| c.key_sha256 == k.hex()).cloned();
    let s = by_key(steady).expect("listed");
    let p = by_key(spiky).expect("listed while the window remembers it");
    assert_eq!((s.in_flight, s.queued), (2, 0));
    assert_eq!((p.in_flight, p.queued), (0, 0));
    // Over [−5 s, 5 s]: steady 2 × 5 s, spiky 6 × 2 s, over 10 s.
    assert_eq!((s.demand, p.demand), (1.0, 1.2));
    assert_eq!(busiest[0].key_sha256, spiky.hex(), "most demand first");
    assert_eq!(
        l.tracked_clients(),
        1,
        "the demand is kept apart from the client table"
    );
    tokio::time::sleep(Duration::from_secs(10)).await;
    let busiest = l.busiest(32, Ranking::Demand);
    assert_eq!(busiest.len(), 1, "spiky has left the window: {busiest:?}");
    assert_eq!(busiest[0].demand, 2.0);
    assert_eq!(l.busiest(0, Ranking::Demand).len(), 0);
}

#[tokio::test(start_paused = true)]
async fn clients_rank_by_tokens_and_the_top_by_tokens_sums_the_rest() {
    let l = limiter(8, 8);
    let batch = ClientKey::of(b"batch-key");
    let chatty = ClientKey::of(b"chatty");
    let quiet = ClientKey::of(b"quiet");
    // chatty holds 3 calls of few tokens, batch one call of many, quiet one of fewer.
    let chatty_calls = [
        l.acquire(chatty).await.unwrap(),
        l.acquire(chatty).await.unwrap(),
        l.acquire(chatty).await.unwrap(),
    ];
    let batch_call = l.acquire(batch).await.unwrap();
    let quiet_call = l.acquire(quiet).await.unwrap();
    tokio::time::sleep(Duration::from_secs(1)).await;
    for c in &chatty_calls {
        c.used_tokens(10, 5);
    }
    batch_call.used_tokens(2000, 500);
    quiet_call.used_tokens(40, 10);
    drop((chatty_calls, batch_call, quiet_call));
    tokio::time::sleep(Duration::from_secs(1)).await;

    let order = |by| {
        l.busiest(32, by)
            .into_iter()
            .map(|c| c.key_sha256)
            .collect::<Vec<_>>()
    };
    // By demand: chatty's 3 calls for 1 s (0.3) before the others' one (0.1).
    assert_eq!(order(Ranking::Demand)[0], chatty.hex());
    assert_eq!(
        order(Ranking::Tokens),
        [batch.hex(), quiet.hex(), chatty.hex()]
    );
    let by_tokens = l.busiest(32, Ranking::Tokens);
    assert_eq!(
        (
            by_tokens[0].input_tokens_per_second,
            by_tokens[0].output_tokens_per_second
        ),
        (200.0, 50.0),
        "over 10 s"
    );
    assert_eq!(by_tokens[2].input_tokens_per_second, 3.0);

    let (top, rest) = l.top_by_tokens(1);
    assert_eq!(
        top,
        [TokenUser {
            client: "batch-team".into(),
            input: 200.0,
            output: 50.0,
        }],
        "an override is named by its name"
    );
    assert!((rest.input - 7.0).abs() < 1e-9 && (rest.output - 2.5).abs() < 1e-9);
    let (top, rest) = l.top_by_tokens(10);
    assert_eq!(top.len(), 3);
    assert_eq!(top[1].client, quiet.short(), "else by its key's short hash");
    assert_eq!(rest, Recent::default());
    // Clients identified by their address are named by rank: the digest of an address is
    // undone by hashing them all, and the metrics endpoint is open.
    let mut by_address = l.inner.state.lock().policy.clone();
    by_address.identity = ClientIdentity::SourceIp;
    l.set_policy(by_address);
    let (top, _) = l.top_by_tokens(10);
    let names: Vec<&str> = top.iter().map(|t| t.client.as_str()).collect();
    assert_eq!(names, ["batch-team", "rank:2", "rank:3"]);
    // Past the window, nothing is left to rank.
    tokio::time::sleep(Duration::from_secs(10)).await;
    assert_eq!(l.top_by_tokens(10).0.len(), 0);
    assert!(l.busiest(32, Ranking::Tokens).is_empty());
}

#[test]
fn a_key_is_shown_whole_in_hex_as_client_shares_name_it() {
    let key = ClientKey::of(b"k1");
    assert_eq!(key.hex(), hex::encode(Sha256::digest(b"k1")));
    assert_eq!(key.hex().len(), 64);
}

#[tokio::test(start_paused = true)]
async fn a_token_reservation_rides_in_the_permit_and_a_refusal_is_counted() {
    let mut p = policy(4, 0);
    p.tokens = Some(serde_json::from_value(serde_json::json!({"perMinute": 100})).unwrap());
    p.overrides[0].tokens = Some(
        serde_json::from_value(serde_json::json!({"perMinute": 1000, "defaultMaxTokens": 7}))
            .unwrap(),
    );
    let metrics = Metrics::new();
    let l = ClientLimiter::new(p.clone(), metrics.clone());
    let key = ClientKey::of(b"someone");
    let batch = ClientKey::of(b"batch-key");
    assert_eq!(l.default_max_tokens(&key), TokenBudget::DEFAULT_MAX_TOKENS);
    assert_eq!(l.default_max_tokens(&batch), 7);
    let estimate = Estimate {
        prompt: 10,
        output: 80,
    };
    let reservation = l.reserve_tokens(key, estimate).unwrap();
    let mut permit = l.acquire(key).await.unwrap();
    permit.hold_tokens(reservation);
    let err = l.reserve_tokens(key, estimate).unwrap_err();
    assert_eq!(&*err.client, OTHER);
    assert!(l.reserve_tokens(batch, estimate).unwrap().is_some());
    assert!(
        metrics.encode().contains(
            "poolpilot_client_rejected_total{client=\"other\",reason=\"client_tokens\"} 1"
        ),
        "{}",
        metrics.encode()
    );
    // The permit dropped unsettled: its reservation is given back.
    drop(permit);
    assert!(l.reserve_tokens(key, estimate).unwrap().is_some());
    p.tokens = None;
    p.overrides[0].tokens = None;
    l.set_policy(p);
    assert!(l.reserve_tokens(key, estimate).unwrap().is_none());
}

#[tokio::test(start_paused = true)]
async fn settled_tokens_are_counted_by_policy_and_client_and_a_call_never_sent_is_not() {
    let mut p = policy(4, 0);
    p.tokens = Some(serde_json::from_value(serde_json::json!({"perMinute": 1000})).unwrap());
    let metrics = Metrics::new();
    let l = ClientLimiter::new(p, metrics.clone());
    let estimate = Estimate {
        prompt: 10,
        output: 80,
    };
    let series = |client: &str| {
        let text = metrics.encode();
        let name = format!(
            "poolpilot_client_tokens_total{{client_policy=\"{}\",client=\"{client}\"}} ",
            l.inner.state.lock().policy.name
        );
        text.lines()
            .find_map(|line| line.strip_prefix(name.as_str()))
            .map(|v| v.parse::<f64>().expect("a number"))
    };
    let other = ClientKey::of(b"someone");
    let batch = ClientKey::of(b"batch-key");
    l.reserve_tokens(other, estimate)
        .unwrap()
        .expect("a budget")
        .settle(7, 30);
    l.reserve_tokens(batch, estimate)
        .unwrap()
        .expect("a budget")
        .settle(1, 2);
    // Dropped unsettled: the call never reached a backend and used nothing.
    drop(l.reserve_tokens(other, estimate).unwrap());
    assert_eq!(series("other"), Some(37.0), "{}", metrics.encode());
    assert_eq!(series("batch-team"), Some(3.0), "{}", metrics.encode());
}

#[tokio::test(start_paused = true)]
async fn a_clients_token_share_is_its_budget_here_and_an_override_never_takes_one() {
    let mut p = policy(4, 0);
    // The even part of a fleet-wide 300 tokens a minute over three pods.
    p.tokens = Some(serde_json::from_value(serde_json::json!({"perMinute": 100})).unwrap());
    let pinned = ClientKey::of(b"pinned");
    let someone = ClientKey::of(b"someone");
    let batch = ClientKey::of(b"batch-key");
    let share = |key: &ClientKey, per_minute| ClientTokenShare {
        key_sha256: key.hex(),
        per_minute,
        per_day: None,
        requests_per_minute: None,
    };
    // Its calls all arrive here: the operator gives it most of the budget.
    p.client_token_shares = vec![share(&pinned, 280), share(&batch, 280)];
    let l = ClientLimiter::new(p.clone(), Metrics::new());
    let call = Estimate {
        prompt: 20,
        output: 70,
    };
    // 90 a call, each held open (a reservation dropped unsettled is given back): three fit in
    // 280, one in 100.
    let mut open = Vec::new();
    for i in 0..3 {
        let r = l.reserve_tokens(pinned, call).unwrap();
        open.push(r.unwrap_or_else(|| panic!("call {i} of the pinned client has a budget")));
    }
    assert!(
        l.reserve_tokens(pinned, call).is_err(),
        "270 of 280 reserved"
    );
    open.extend(l.reserve_tokens(someone, call).unwrap());
    assert!(
        l.reserve_tokens(someone, call).is_err(),
        "the even part, 100"
    );
    // The override has no budget of its own: the policy's, not the share listed for its key.
    open.extend(l.reserve_tokens(batch, call).unwrap());
    assert!(l.reserve_tokens(batch, call).is_err());
    // The share moves to another pod: here the client is back to the even part, and what it
    // used of its bucket is kept (270 of 280 reserved: over 100, refused until it refills);
    // `someone` now has 280, of which 90 are reserved.
    p.client_token_shares = vec![share(&someone, 280)];
    l.set_policy(p);
    assert!(l.reserve_tokens(pinned, call).is_err());
    open.extend(l.reserve_tokens(someone, call).unwrap());
    open.extend(l.reserve_tokens(someone, call).unwrap());
    assert!(
        l.reserve_tokens(someone, call).is_err(),
        "270 of 280 reserved"
    );
    assert_eq!(open.len(), 7);
}

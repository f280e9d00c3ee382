//! Scenario provider cooldown: model-a stands for a hosted provider whose account allows 4 calls
//! per 2 s (modelsim `--rate-limit-requests=4 --rate-limit-window-ms=2000`: beyond them 429
//! `rate_limit_exceeded` with `Retry-After` until the window ends), called with the provider's
//! key from a Secret the gateways mount (`credentials`). Callers ask for far more. Each gateway
//! pod that gets the provider's 429 cools model-a down for the `Retry-After` and sends nothing
//! into that known refusal: first its calls go to the fallback, model-b (`fallback: [model-b]`,
//! with model-b's own key), so the callers see only the provider's own refusals that started
//! each cooldown; then, with the fallback removed from the policy, the calls meanwhile get the
//! gateway's 429 `backend_cooling_down` with what is left of the wait. The operator shows the
//! refusals in `status.backends[].cooldown` and tells them once in a `ProviderCoolingDown` Event.
//!
//! ```text
//!  model-a: 1 instance, 4 calls / 2 s window, key provider-a; model-b: 1 instance, key provider-b
//!  6 callers, no pause, 2 gateways, 20 s       (demand ~100 calls/s against 2/s allowed)
//!    provider's 429 + Retry-After ─► that pod: model-a cooling, its calls → model-b
//!    client sees: 200s, and the provider's refusals as they came (Retry-After 1–2)
//!  fallback removed, 10 s
//!    client sees: 429 backend_cooling_down, Retry-After 1–2; model-a gets ≤ one refusal per
//!    window and caller
//! ```

use std::collections::BTreeMap;
use std::time::Duration;

use anyhow::Context as _;
use poolpilot_e2e::eventually;
use poolpilot_e2e::load::{Load, LoadSpec, Tally};
use poolpilot_e2e::scenario::{figure, serial};
use poolpilot_e2e::stack::{
    BackendSpec, GatewayPod, POLICY, Stack, StackSpec, TestSecret, WAIT, metric_sum, quick_policy,
    set, with_stack,
};
use poolpilot_modelsim::Stats;
use serde_json::json;
use tokio::time::Instant;

const SCENARIO: &str = "provider-cooldown";
/// The provider's allowance: calls per window.
const ALLOWED: u32 = 4;
const WINDOW: Duration = Duration::from_secs(2);
const WORKERS: usize = 6;
const GATEWAYS: u32 = 2;
/// How long each part's load runs.
const WITH_FALLBACK: Duration = Duration::from_secs(20);
const WITHOUT_FALLBACK: Duration = Duration::from_secs(10);

fn secret(name: &str, key: &str) -> TestSecret {
    TestSecret {
        name: name.to_owned(),
        mount_path: format!("/etc/poolpilot/secrets/{name}"),
        data: BTreeMap::from([("api-key".to_owned(), key.to_owned())]),
    }
}

/// model-a's one instance's counters.
async fn provider(stack: &Stack<'_>) -> anyhow::Result<Stats> {
    let remotes = stack.backends("model-a").await?;
    let one = remotes.first().context("model-a's instance")?;
    one.stats().await
}

/// Σ over the gateways of a counter of model-a.
async fn counted(gateways: &[GatewayPod], name: &str, labels: &[&str]) -> anyhow::Result<f64> {
    let mut total = 0.0;
    for g in gateways {
        total += metric_sum(&g.metrics().await?, name, labels);
    }
    Ok(total)
}

/// The Retry-After values (seconds) the callers got with `reason`.
fn waits(t: &Tally, reason: &str) -> Vec<u64> {
    t.retry_after_secs
        .iter()
        .filter(|((r, _), _)| r == reason)
        .map(|((_, secs), _)| *secs)
        .collect()
}

/// Whether every `Retry-After` the callers got with `reason` is within the provider's window
/// (1 or 2 s: the rest of a 2 s window, rounded up).
fn within_the_window(t: &Tally, reason: &str) -> bool {
    waits(t, reason)
        .iter()
        .all(|s| (1..=WINDOW.as_secs()).contains(s))
}

/// Waits until every gateway runs model-a with `fallback`.
async fn runs_fallback(gateways: &[GatewayPod], fallback: &[&str]) -> anyhow::Result<()> {
    for g in gateways {
        g.wait_applied(Instant::now(), Duration::from_millis(250), WAIT, |l| {
            l.backends
                .iter()
                .any(|b| b.name == "model-a" && b.fallback == fallback)
        })
        .await
        .with_context(|| format!("{} runs model-a with fallback {fallback:?}", g.name))?;
    }
    Ok(())
}

/// Runs the load for `period`; the callers' tally and the provider's counters over it.
async fn run(
    stack: &Stack<'_>,
    gateways: &[GatewayPod],
    period: Duration,
) -> anyhow::Result<(Tally, Stats, Stats)> {
    let before = provider(stack).await?;
    let proxies = gateways.iter().map(|g| g.proxy()).collect();
    let load = Load::start(
        LoadSpec::one_client_per_worker(proxies, "model-a", 8, WORKERS, Duration::from_secs(10)),
        WORKERS,
    )?;
    let from = load.now();
    tokio::time::sleep(period).await;
    let tally = load.window(from, load.now());
    load.stop().await;
    let after = provider(stack).await?;
    Ok((tally, before, after))
}

#[tokio::test]
async fn a_providers_429_cools_its_backend_down_and_the_calls_meanwhile_go_to_the_fallback_or_wait()
-> anyhow::Result<()> {
    let _serial = serial().await?;
    let spec = StackSpec {
        gateways: GATEWAYS,
        backends: vec![
            BackendSpec::new("model-a", 1, 16)
                .service_ms(50)
                .arg(format!("--rate-limit-requests={ALLOWED}"))
                .arg(format!("--rate-limit-window-ms={}", WINDOW.as_millis())),
            // The same model, on another account.
            BackendSpec::new("model-b", 1, 16)
                .service_ms(50)
                .arg("--model=model-b,model-a"),
        ],
        gateway_secrets: vec![
            secret("provider-a", "sk-provider-a"),
            secret("provider-b", "sk-provider-b"),
        ],
        ..StackSpec::default()
    };
    with_stack("cooldown", spec, async |stack| {
        let mut policy = quick_policy()?;
        for (i, name) in ["provider-a", "provider-b"].into_iter().enumerate() {
            set(
                &mut policy,
                &format!("/spec/backends/{i}/credentials"),
                json!({"secretRef": {"name": name, "key": "api-key"}, "scheme": "Bearer"}),
            )?;
        }
        set(
            &mut policy,
            "/spec/backends/0/fallback",
            json!(["model-b"]),
        )?;
        stack.apply(&policy).await?;
        let gateways = stack.wait_gateways(GATEWAYS as usize).await?;
        runs_fallback(&gateways, &["model-b"]).await?;

        // 1. With the fallback: the callers see the provider's refusals as they came, and
        //    otherwise answers (model-b's while model-a cools down).
        let (t, before, after) = run(stack, &gateways, WITH_FALLBACK).await?;
        let refused = after.rate_limited - before.rate_limited;
        let served_a = after.served - before.served;
        let fallbacks = counted(
            &gateways,
            "poolpilot_upstream_fallbacks_total",
            &["backend=\"model-a\"", "to=\"model-b\""],
        )
        .await?;
        let windows = WITH_FALLBACK.as_secs_f64() / WINDOW.as_secs_f64();
        figure(
            SCENARIO,
            "with the fallback: calls, ok, the provider's 429s, model-a served, to model-b",
            format!(
                "{}, {}, {refused}, {served_a}, {fallbacks} over {}s ({:?}, Retry-After {:?})",
                t.calls,
                t.ok,
                WITH_FALLBACK.as_secs(),
                t.errors,
                waits(&t, "rate_limit_exceeded"),
            ),
        );
        anyhow::ensure!(t.calls > 200, "the callers asked far more than 2/s: {t}");
        assert_eq!(
            t.failed(),
            t.errors_of("rate_limit_exceeded"),
            "no failure but the provider's own refusals: {t}"
        );
        assert_eq!(
            t.errors_of("rate_limit_exceeded"),
            refused,
            "each of the provider's refusals reached its caller as it came"
        );
        assert!(
            within_the_window(&t, "rate_limit_exceeded"),
            "the provider's Retry-After: {:?}",
            t.retry_after_secs
        );
        // Without the cooldown every call beyond the allowance would have been refused (over
        // 90% of them); with it, at most the calls in flight when a pod heard of the refusal.
        let bound = ((windows + 1.0) * WORKERS as f64) as u64;
        assert!(
            refused <= bound,
            "{refused} calls sent into the provider's refusal, more than {WORKERS} callers × {} windows",
            windows + 1.0
        );
        assert!(
            served_a <= u64::from(ALLOWED) * (windows as u64 + 1),
            "{served_a}"
        );
        assert!(
            fallbacks >= (t.ok - served_a) as f64 * 0.9,
            "the calls model-a did not serve went to model-b: {fallbacks} of {}",
            t.ok - served_a
        );
        // The operator tells it: the counts in status, a Warning once.
        let cooldown = eventually("model-a's cooldown in status", WAIT, || async {
            let s = stack.backend_status("model-a").await?;
            let c = s.cooldown.context("no cooldown in status yet")?;
            anyhow::ensure!(c.fallback_calls > 0, "{c:?}");
            Ok(c)
        })
        .await?;
        let event = stack
            .wait_event(POLICY, "ProviderCoolingDown", "model-a: the provider refused ")
            .await?;
        figure(
            SCENARIO,
            "status.backends[model-a].cooldown",
            format!("{cooldown:?}; Event: {}", event.message.unwrap_or_default()),
        );

        // 2. Without the fallback: the calls meanwhile get the gateway's 429 with what is left
        //    of the provider's wait, and still none goes into the refusal.
        let mut edited = policy.clone();
        edited["spec"]["backends"][0]
            .as_object_mut()
            .context("model-a")?
            .remove("fallback");
        stack.apply(&edited).await?;
        runs_fallback(&gateways, &[]).await?;
        let fallbacks_before = counted(&gateways, "poolpilot_upstream_fallbacks_total", &[]).await?;
        let (t, before, after) = run(stack, &gateways, WITHOUT_FALLBACK).await?;
        let refused = after.rate_limited - before.rate_limited;
        let served_a = after.served - before.served;
        let cooling = t.errors_of("backend_cooling_down");
        figure(
            SCENARIO,
            "without the fallback: calls, ok, the provider's 429s, the gateway's 429s",
            format!(
                "{}, {}, {refused}, {cooling} over {}s (Retry-After of the gateway's {:?})",
                t.calls,
                t.ok,
                WITHOUT_FALLBACK.as_secs(),
                waits(&t, "backend_cooling_down"),
            ),
        );
        assert_eq!(
            t.failed(),
            cooling + refused,
            "the gateway's and the provider's refusals only: {t}"
        );
        assert!(cooling > t.calls / 2, "most calls waited out a cooldown: {t}");
        assert!(
            within_the_window(&t, "backend_cooling_down"),
            "the gateway's Retry-After is what is left of the provider's: {:?}",
            t.retry_after_secs
        );
        // The tally's window closes before the callers stop: a call the provider answered
        // meanwhile (at most one per caller) counts at the provider and not in the window.
        assert!(
            (t.ok..=t.ok + WORKERS as u64).contains(&served_a),
            "every answer was model-a's: {} ok, {served_a} served by it",
            t.ok
        );
        let windows = WITHOUT_FALLBACK.as_secs_f64() / WINDOW.as_secs_f64();
        assert!(refused <= ((windows + 1.0) * WORKERS as f64) as u64, "{refused}");
        assert_eq!(
            counted(&gateways, "poolpilot_upstream_fallbacks_total", &[]).await?,
            fallbacks_before,
            "no fallback without one"
        );
        Ok(())
    })
    .await
}

//! The pipeline of one reconcile: observe → validate → plan → roll out → status, each step
//! timed and its failure counted; the finalizer's cleanup; what follows a failed reconcile.
//! A reconcile that ends well plans the policy's next one in the reconcile queue (`queue.rs`),
//! not with the Controller's own requeue.

use std::sync::Arc;
use std::time::Duration;

use json_patch::jsonptr::PointerBuf;
use json_patch::{AddOperation, PatchOperation, TestOperation};
use kube::api::{Api, Patch, PatchParams};
use kube::core::DeserializeGuard;
use kube::core::error_boundary::InvalidObject;
use kube::runtime::controller::Action;
use kube::runtime::events::{Event, EventType};
use kube::runtime::finalizer::{Event as Finalizer, finalizer};
use kube::{Resource as _, ResourceExt};
use poolpilot_api::ConnectionPolicy;
use poolpilot_api::policy::Mode;
use tokio::time::Instant;
use tracing::{info, instrument, warn};

use super::context::Context;
use super::error::{Error, Result};
use super::events::{event_note, implausible_generation_event, unreadable_event};
use super::observed::Observed;
use super::queue::policy_ref;
use super::{clients, cpu_bound, observe, pass, rollout, status, validate};
use crate::gateway::Gateways;
use crate::metrics::{Metrics, StepLabel};
use crate::plan::{self, Memory};

/// The finalizer that removes a deleted policy's backends from its gateways.
pub const FINALIZER: &str = "poolpilot.io/cleanup";
/// How soon to try again when a starting pod (it has an IP) could not take its document yet.
const RETRY_STARTING_PODS: Duration = Duration::from_secs(1);

/// Reconciles one policy as the Controller hands it over: read ([`reconcile`]), or not readable
/// by this operator ([`skip_unreadable`]).
pub async fn reconcile_object<G: Gateways>(
    object: Arc<DeserializeGuard<ConnectionPolicy>>,
    ctx: Arc<Context<G>>,
) -> Result<Action> {
    let result = match &object.0 {
        Ok(policy) => reconcile(Arc::new(policy.clone()), ctx.clone()).await,
        Err(invalid) => {
            ctx.queue.forget(&policy_ref(&*object));
            skip_unreadable(&object, invalid, &ctx).await
        }
    };
    if result.is_ok() {
        ctx.retries.succeeded(&retry_key(&object));
    }
    result
}

/// Plans `policy`'s next periodic reconcile `after` from now, in the reconcile queue.
fn requeue<G: Gateways>(ctx: &Context<G>, policy: &ConnectionPolicy, after: Duration) -> Action {
    ctx.queue.schedule(policy_ref(policy), after);
    Action::await_change()
}

/// A policy's key in [`Context::retries`].
fn retry_key(object: &DeserializeGuard<ConnectionPolicy>) -> String {
    format!(
        "{}/{}",
        object.namespace().unwrap_or_default(),
        object.name_any()
    )
}

/// A policy that does not deserialize: a Warning Event `InvalidPolicy` on it with the error, a
/// warning in the log, and nothing else (it is left out of every plan, and its backends out of
/// every document). Being deleted, it loses the finalizer, whose cleanup only needs the other
/// policies. Looked at again when it changes.
pub async fn skip_unreadable<G: Gateways>(
    object: &DeserializeGuard<ConnectionPolicy>,
    invalid: &InvalidObject,
    ctx: &Context<G>,
) -> Result<Action> {
    let name = object.name_any();
    warn!(policy = %name, error = %invalid.error, "cannot read the policy; skipped");
    let event = unreadable_event(&invalid.error);
    if let Err(err) = ctx.recorder.publish(&event, &object.object_ref(&())).await {
        warn!(reason = %event.reason, error = %crate::report(&err), "failed to publish an Event");
    }
    let meta = &invalid.metadata;
    let finalizers = meta.finalizers.as_deref().unwrap_or_default();
    if meta.deletion_timestamp.is_some() && finalizers.iter().any(|f| f == FINALIZER) {
        let api: Api<DeserializeGuard<ConnectionPolicy>> =
            Api::namespaced(ctx.client.clone(), &object.namespace().unwrap_or_default());
        let rest: Vec<&String> = finalizers.iter().filter(|f| *f != FINALIZER).collect();
        // The resource version makes a concurrent change of the list fail instead of being lost.
        let patch = serde_json::json!({
            "metadata": {"finalizers": rest, "resourceVersion": meta.resource_version},
        });
        api.patch(&name, &PatchParams::default(), &Patch::Merge(&patch))
            .await
            .map_err(|e| {
                Error::Finalizer(Box::new(kube::runtime::finalizer::Error::RemoveFinalizer(
                    e,
                )))
            })?;
    }
    Ok(Action::await_change())
}

/// Reconciles one policy (behind the finalizer). A policy without the finalizer gets it and is
/// applied in the same reconcile ([`with_finalizer`]).
#[instrument(skip_all, fields(policy = %policy.name_any(), namespace = policy.namespace().unwrap_or_default()))]
pub async fn reconcile<G: Gateways>(
    policy: Arc<ConnectionPolicy>,
    ctx: Arc<Context<G>>,
) -> Result<Action> {
    ctx.metrics.reconciles.inc();
    let ns = policy.namespace().unwrap_or_default();
    let api: Api<ConnectionPolicy> = Api::namespaced(ctx.client.clone(), &ns);
    let policy = with_finalizer(&api, policy).await?;
    finalizer(&api, FINALIZER, policy, |event| async {
        match event {
            Finalizer::Apply(p) => apply(&p, &ctx).await,
            Finalizer::Cleanup(p) => cleanup(&p, &ctx).await,
        }
    })
    .await
    .map_err(|e| Error::Finalizer(Box::new(e)))
}

/// `policy` with the operator's finalizer: as handed over when it has it (or is being deleted),
/// else as the API server answers the patch that adds it.
///
/// kube's finalizer helper adds a missing finalizer and ends the reconcile, waiting for the watch
/// to bring the patched policy back: every new policy took two reconciles, and at 2,000 new
/// policies the first 2,000 did nothing but that patch. The patch is the helper's own (a JSON
/// patch whose test fails, rather than adding the finalizer twice, when someone changed the list
/// meanwhile; the failed reconcile is retried); the reconcile then goes on with the answer.
async fn with_finalizer(
    api: &Api<ConnectionPolicy>,
    policy: Arc<ConnectionPolicy>,
) -> Result<Arc<ConnectionPolicy>> {
    let finalizers = policy.finalizers();
    if policy.metadata.deletion_timestamp.is_some() || finalizers.iter().any(|f| f == FINALIZER) {
        return Ok(policy);
    }
    let list = PointerBuf::from_tokens(["metadata", "finalizers"]);
    let (tested, added) = if finalizers.is_empty() {
        (
            (list.clone(), serde_json::Value::Null),
            (list, serde_json::json!([FINALIZER])),
        )
    } else {
        let end = list.with_trailing_token("-");
        (
            (list, serde_json::json!(finalizers)),
            (end, serde_json::json!(FINALIZER)),
        )
    };
    let patch = json_patch::Patch(vec![
        PatchOperation::Test(TestOperation {
            path: tested.0,
            value: tested.1,
        }),
        PatchOperation::Add(AddOperation {
            path: added.0,
            value: added.1,
        }),
    ]);
    let patched = api
        .patch(
            &policy.name_any(),
            &PatchParams::default(),
            &Patch::Json::<()>(patch),
        )
        .await
        .map_err(|e| {
            Error::Finalizer(Box::new(kube::runtime::finalizer::Error::AddFinalizer(e)))
        })?;
    Ok(Arc::new(patched))
}

/// Times a step and counts its failure.
async fn step<T, E, F>(metrics: &Metrics, name: &'static str, f: F) -> std::result::Result<T, E>
where
    F: Future<Output = std::result::Result<T, E>>,
{
    let start = Instant::now();
    let out = f.await;
    let label = StepLabel { step: name };
    metrics
        .step_duration
        .get_or_create(&label)
        .observe(start.elapsed().as_secs_f64());
    if out.is_err() {
        metrics.errors.get_or_create(&label).inc();
    }
    out
}

async fn apply<G: Gateways>(policy: &ConnectionPolicy, ctx: &Context<G>) -> Result<Action> {
    let refused = observe::refused_namespaces(&ctx.config.backend_namespaces, policy);
    if !refused.is_empty() {
        return refuse(policy, ctx, refused).await;
    }
    let key = observe::key(policy)?;
    let m = &ctx.metrics;
    // 1. the busiest clients of its pods, for fleet-wide client limits (gateways, read-only;
    //    never fails), when a decision is due: the plan below divides by them then
    step(m, "clients", async {
        if pass::decisions_due(ctx, policy, &key) {
            clients::poll(ctx, policy, &key).await;
        }
        Ok::<_, Error>(())
    })
    .await?;
    // 2. observe, validate and plan: the namespace's pass, shared with every reconcile of the
    //    namespace waiting meanwhile, or the last one while nothing it was made from changed
    //    (caches and the latest Prometheus snapshot, no API calls; CPU off the async workers)
    let planned = step(m, "plan", pass::plan_for(ctx, policy, &key)).await?;
    let pass = &planned.pass;
    let now = (ctx.clock)();
    report_implausible_generations(ctx, policy, &pass.observed).await;
    // The poller runs this policy's saturation queries from its next round on.
    ctx.saturation.set(
        &key,
        policy
            .spec
            .backends
            .iter()
            .filter_map(|b| Some((b.name.clone(), b.saturation.as_ref()?.query.clone()))),
    );
    let Some(this) = pass.policy(&key) else {
        return Err(Error::Plan(format!("no plan for {key}")));
    };
    let verdict = validate::check(Some(this.verdict));
    let policy_plan = this.plan;
    // 3. roll out (client and gateways required), only for an accepted policy (rendering may
    //    still reject one whose document does not validate)
    let report = match &verdict {
        // Shadow mode: the same plan, published instead of rolled out.
        Ok(()) if policy_plan.acceptance.is_accepted() && policy.spec.mode == Mode::Recommend => {
            step(
                m,
                "rollout",
                rollout::recommend(ctx, policy, &key, &pass.observed, &pass.fleet),
            )
            .await?
        }
        Ok(()) if policy_plan.acceptance.is_accepted() => {
            step(
                m,
                "rollout",
                rollout::roll_out(ctx, policy, &key, &pass.observed, &pass.fleet, now),
            )
            .await?
        }
        Ok(()) => {
            info!(acceptance = ?policy_plan.acceptance, "rendered document refused; nothing rolled out");
            rollout::not_rolled_out(&key, &pass.observed, &pass.fleet)
        }
        Err(rejected) => {
            info!(%rejected, "policy not accepted; nothing rolled out");
            rollout::not_rolled_out(&key, &pass.observed, &pass.fleet)
        }
    };
    // 4. status (client required), from this policy's autoscale memory.
    // The lock may be held by another reconcile's plan: wait for it off the async workers too.
    let memory = cpu_bound(|| {
        let all = ctx.memory.lock();
        let namespace = all.get(&key.namespace);
        plan::Memory {
            backends: policy_plan
                .backends
                .iter()
                .filter_map(|b| {
                    let at = (key.clone(), b.name.clone());
                    let mem = namespace?.backends.get(&at)?.clone();
                    Some((at, mem))
                })
                .collect(),
            ..plan::Memory::default()
        }
    });
    // The status as handed over (the pass may be older than this policy's last status write):
    // conditions keep their transition times from it.
    let input = plan::PolicyInput {
        status: policy.status.clone(),
        ..this.input.clone()
    };
    let status = plan::status::compute(&input, policy_plan, &memory, &report, now);
    // Its Events tell the decisions and re-divisions made for it since its last reconcile (in
    // whichever pass made them), each once.
    let told = plan::PolicyPlan {
        backends: planned.news.clone(),
        ..policy_plan.clone()
    };
    step(m, "status", status::apply(ctx, policy, &told, status)).await?;

    // A pod that runs a newer generation than this reconcile's pass (another reconcile of the
    // namespace pushed a later pass meanwhile) is not updated for this policy yet, and the next
    // pass numbers its document above it: that reconcile comes as a change, ahead of the
    // periodic ones, so that the policy does not wait its interval (or, with thousands of new
    // policies at once, much longer) to settle.
    // Once a second at most (`RolloutMemory::ahead_requeued`); sooner, it is tried again in a
    // second like a starting pod.
    let mut paced = false;
    if !report.older.is_empty() {
        let key = (key.namespace.clone(), key.name.clone());
        let last = ctx.rollouts.lock().ahead_requeued.insert(key, now);
        if last.is_none_or(|t| plan::time::elapsed(t, now) >= RETRY_STARTING_PODS) {
            ctx.queue.changed(policy_ref(policy));
        } else {
            paced = true;
        }
    }
    // A pod that has an IP but did not take its document is most likely still starting (its
    // admin port not yet listening) and stays unready until it does: try again soon. Pods
    // without an IP bring their own reconcile when they get one. A pod that did not answer in
    // time is tried again at the next reconcile, as usual.
    let starting = report.unreachable.keys().any(|pod| {
        pass.observed.admin.contains_key(pod)
            && !report.slow.contains(pod)
            && !report.older.contains(pod)
    });
    let interval = if starting || paced {
        RETRY_STARTING_PODS
    } else {
        policy.spec.autoscale.interval.get()
    };
    // The canaries' verification ends before the next interval: judged (and the rest sent)
    // then. It is measured from this reconcile's clock reading, so the next one finds it over.
    let interval = report
        .verified_in
        .map_or(interval, |left| interval.min(left));
    let interval = interval.min(ctx.config.max_requeue);
    Ok(requeue(ctx, policy, interval.max(Duration::from_secs(1))))
}

async fn cleanup<G: Gateways>(policy: &ConnectionPolicy, ctx: &Context<G>) -> Result<Action> {
    let key = observe::key(policy)?;
    let (observed, fleet) =
        step(&ctx.metrics, "plan", async { without(ctx, policy, &key) }).await?;
    step(
        &ctx.metrics,
        "cleanup",
        rollout::remove(ctx, policy, &observed, &fleet),
    )
    .await?;
    if observed.input.policies.is_empty() {
        ctx.passes.forget(&key.namespace);
        ctx.samples.lock().remove(&key.namespace);
    }
    ctx.status_refresh
        .forget(&format!("{}/{}", key.namespace, key.name));
    let mut rollouts = ctx.rollouts.lock();
    let policy_key = (key.namespace.clone(), key.name.clone());
    rollouts.rolled_out_generation.remove(&policy_key);
    rollouts.ahead_requeued.remove(&policy_key);
    drop(rollouts);
    ctx.queue.forget(&policy_ref(policy));
    Ok(Action::await_change())
}

/// Observes and plans `policy`'s namespace without it (deleted, or not in force), forgetting
/// what the planner remembered of it; its pods stay in the fleet, so that their documents lose
/// its backends.
fn without<G: Gateways>(
    ctx: &Context<G>,
    policy: &ConnectionPolicy,
    key: &plan::PolicyKey,
) -> Result<(Observed, plan::FleetPlan)> {
    ctx.saturation.set(key, []);
    cpu_bound(|| {
        let now = (ctx.clock)();
        let observed = observe::observe(ctx, policy, true, now)?;
        let verdicts = plan::validate::accept(&observed.input.policies, &observed.selected);
        let mut memory = ctx.memory.lock();
        let mem = memory.entry(key.namespace.clone()).or_default();
        mem.forget(key);
        let fleet = plan::plan_with(&observed.input, &observed.selected, &verdicts, mem, now);
        Ok((observed, fleet))
    })
}

/// A policy with a backend in a namespace this operator may not read backends from
/// (`--backend-namespaces`) is not in force: its pods get documents without its backends (as
/// for a deleted policy), and its status says `Accepted=False`, reason `NamespaceNotAllowed`,
/// naming each such backend.
async fn refuse<G: Gateways>(
    policy: &ConnectionPolicy,
    ctx: &Context<G>,
    why: Vec<String>,
) -> Result<Action> {
    let key = observe::key(policy)?;
    let (observed, fleet) =
        step(&ctx.metrics, "plan", async { without(ctx, policy, &key) }).await?;
    let now = (ctx.clock)();
    step(
        &ctx.metrics,
        "rollout",
        rollout::remove(ctx, policy, &observed, &fleet),
    )
    .await?;
    info!(refused = ?why, "policy not accepted: a backend namespace is not allowed");
    let selected: Vec<String> = observed
        .input
        .pods
        .iter()
        .filter(|p| plan::selector::matches(&policy.spec.gateway_selector, &p.labels))
        .map(|p| p.name.clone())
        .collect();
    let policy_plan = plan::PolicyPlan {
        key: key.clone(),
        acceptance: plan::validate::Acceptance::Invalid(why),
        selected,
        holders: Vec::new(),
        live: Vec::new(),
        ready: Vec::new(),
        backends: Vec::new(),
        fds: plan::budget::FdReport::default(),
        metrics_available: None,
        client_shares: Default::default(),
        token_shares: Default::default(),
        client_token_shares: Default::default(),
        token_use: None,
        document: None,
    };
    let input = observe::policy_input(&key.namespace, policy, &[]);
    let computed = plan::status::compute(
        &input,
        &policy_plan,
        &Memory::default(),
        &plan::status::RolloutReport::default(),
        now,
    );
    step(
        &ctx.metrics,
        "status",
        status::apply(ctx, policy, &policy_plan, computed),
    )
    .await?;
    Ok(requeue(ctx, policy, ctx.config.max_requeue))
}

/// Tells about generations read back that are too large to be real (the planner ignores them):
/// a warning in the log, `poolpilot_operator_generations_ignored_total`, and a Warning Event
/// `ImplausibleGeneration` on the policy (repeats become one Event series).
async fn report_implausible_generations<G: Gateways>(
    ctx: &Context<G>,
    policy: &ConnectionPolicy,
    observed: &Observed,
) {
    let reference = policy.object_ref(&());
    for note in plan::implausible_generations(&observed.input) {
        warn!(%note, "implausible generation ignored");
        ctx.metrics.generations_ignored.inc();
        let event = implausible_generation_event(&note);
        if let Err(err) = ctx.recorder.publish(&event, &reference).await {
            warn!(reason = %event.reason, error = %crate::report(&err), "failed to publish an Event");
        }
    }
}

/// What to do after a failed reconcile: log, tell the user with a `ReconcileFailed` Warning
/// Event on the policy (naming the step and the error), and retry soon. Repeats of the same
/// failure become one Event series: the recorder patches the Event's count instead of creating
/// another one.
pub fn error_policy<G: Gateways>(
    policy: Arc<DeserializeGuard<ConnectionPolicy>>,
    error: &Error,
    ctx: Arc<Context<G>>,
) -> Action {
    let retry = ctx.retries.failed(&retry_key(&policy));
    warn!(
        policy = %policy.name_any(),
        step = error.step(),
        error = %crate::report(error),
        retry_in = ?retry,
        "reconcile failed"
    );
    let event = failure_event(error);
    let reference = policy.object_ref(&());
    let recorder = ctx.recorder.clone();
    // The Controller calls this synchronously; the Event must not hold up the other policies.
    tokio::spawn(async move {
        if let Err(err) = recorder.publish(&event, &reference).await {
            warn!(reason = %event.reason, error = %crate::report(&err), "failed to publish an Event");
        }
    });
    Action::requeue(retry)
}

/// The Warning Event of a failed reconcile. Its action names the step, so that the recorder
/// (which keys a series by type, reason and action, not by note) keeps failures of different
/// steps apart.
pub fn failure_event(error: &Error) -> Event {
    let action = match error.step() {
        "observe" => "Observe",
        "plan" => "Plan",
        "rollout" => "RollOut",
        "status" => "UpdateStatus",
        "finalizer" => "Finalize",
        _ => "Reconcile",
    };
    Event {
        type_: EventType::Warning,
        reason: "ReconcileFailed".into(),
        note: Some(event_note(&error.describe())),
        action: action.into(),
        secondary: None,
    }
}

//! The status conditions and Events of a `ConnectionPolicy`, as part of its API: every condition
//! type, the reasons the operator reports with each status, and the Event reasons it publishes on
//! a policy. Types and reasons are stable identifiers that tools may match on; messages and Event
//! notes are for people and may change. The reference doc (`docs/connectionpolicy-reference.md`)
//! renders these tables, and the operator's tests check that it reports nothing undocumented.

/// One condition type of `status.conditions`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ConditionDoc {
    /// The condition `type`.
    pub type_: &'static str,
    /// What `True` says.
    pub meaning: &'static str,
    /// Every reason the operator reports with it.
    pub reasons: &'static [ReasonDoc],
}

/// One `(status, reason)` pair of a condition.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ReasonDoc {
    /// `True`, `False` or `Unknown`.
    pub status: &'static str,
    /// The CamelCase reason.
    pub reason: &'static str,
    /// What it means.
    pub meaning: &'static str,
}

/// One Event reason the operator publishes on a policy.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EventDoc {
    /// `Normal` or `Warning`.
    pub type_: &'static str,
    /// The CamelCase reason.
    pub reason: &'static str,
    /// When it is published, and what its note says.
    pub meaning: &'static str,
}

const fn reason(status: &'static str, reason: &'static str, meaning: &'static str) -> ReasonDoc {
    ReasonDoc {
        status,
        reason,
        meaning,
    }
}

const NOT_ACCEPTED: &str = "the policy is not accepted (see `Accepted`): nothing is observed or \
                            rolled out for it";

/// Every condition a policy reports, in the order `status.conditions` lists them.
pub const CONDITIONS: &[ConditionDoc] = &[
    ConditionDoc {
        type_: "Accepted",
        meaning: "The spec is valid and none of its backends clashes with an older policy; the \
                  operator acts on it.",
        reasons: &[
            reason("True", "Accepted", "valid, no conflicts"),
            reason(
                "False",
                "Invalid",
                "a rule the schema cannot express failed (the message lists every broken rule); \
                 nothing is rolled out",
            ),
            reason(
                "False",
                "NamespaceNotAllowed",
                "a backend's `endpoints.service.namespace` is not one the operator may read \
                 backends from (`--backend-namespaces`; the message names it); nothing is \
                 rolled out",
            ),
            reason(
                "False",
                "Conflicted",
                "a backend name is already defined by an older policy that selects the same \
                 gateway pods (the oldest policy wins); nothing is rolled out",
            ),
        ],
    },
    ConditionDoc {
        type_: "MetricsAvailable",
        meaning: "Prometheus answers with fresh samples for every backend, so the targets \
                  follow demand.",
        reasons: &[
            reason("True", "SamplesFresh", "usable samples for every backend"),
            reason(
                "False",
                "SamplesMissing",
                "some backend had no usable samples for three decisions in a row (query error, \
                 empty result, NaN, or older than two scrape intervals; throughput and the \
                 saturation query count only when growth is wanted): the message names each \
                 such backend and the input it lacks; their targets are held, never read as \
                 zero, until two fresh samples in a row. A backend the operator has only just \
                 seen (a new policy, an operator start) is given the samples' freshness bound \
                 (two metrics intervals and two scrape intervals) for its first samples to \
                 arrive before its misses count",
            ),
            reason(
                "Unknown",
                "AutoscaleDisabled",
                "`autoscale.enabled` is false: no metrics are needed",
            ),
            reason("Unknown", "NotAccepted", NOT_ACCEPTED),
        ],
    },
    ConditionDoc {
        type_: "FdBudget",
        meaning: "The pools, client connections and reserve fit in half the smallest \
                  `process_max_fds` of the selected pods.",
        reasons: &[
            reason(
                "True",
                "WithinBudget",
                "they fit, at the shares the targets call for",
            ),
            reason(
                "False",
                "OverBudget",
                "they do not: the per-pod shares were scaled down proportionally (never below \
                 `autoscale.min`); the message has the numbers",
            ),
            reason(
                "Unknown",
                "FdLimitUnknown",
                "no `process_max_fds` sample for some selected pod yet",
            ),
            reason("Unknown", "NotAccepted", NOT_ACCEPTED),
        ],
    },
    ConditionDoc {
        type_: "RolledOut",
        meaning: "Every selected gateway pod that is not terminating acknowledged its current \
                  limits document.",
        reasons: &[
            reason(
                "True",
                "RolledOut",
                "every selected pod not terminating runs its current document",
            ),
            reason(
                "False",
                "Progressing",
                "a rollout is under way (canary pods, their verify period, then the rest), or a \
                 pod could not be reached yet (a starting pod stays unready until it has its \
                 share)",
            ),
            reason(
                "False",
                "Halted",
                "a pod refused the limits, or a canary regressed against the other pods (lease \
                 timeouts per call, upstream 5xx per call or p90 latency; the message names the \
                 signal and both numbers) and was rolled back to its previous document: the \
                 rollout stopped and the other pods keep their previous limits",
            ),
            reason(
                "False",
                "NoReadyPods",
                "`gatewaySelector` selects no ready gateway pod",
            ),
            reason(
                "False",
                "Recommending",
                "`mode: Recommend`: nothing is sent to the pods; the message says how many run \
                 the recommended documents and names the recommended revision and the \
                 `<name>-recommended` ConfigMap that holds it",
            ),
            reason("False", "NotAccepted", NOT_ACCEPTED),
        ],
    },
    ConditionDoc {
        type_: "Saturated",
        meaning: "Some backend wants more connections than it can safely get: requests queue, \
                  then fail fast with 503 and Retry-After.",
        reasons: &[
            reason(
                "False",
                "WithinCapacity",
                "demand fits; the message has each backend's utilization",
            ),
            reason(
                "True",
                "Saturated",
                "a backend's demand exceeds its upper bound (capacity × (1 − headroom), or \
                 `autoscale.max`), or its growth is held or stepped back because it is past its \
                 knee: its own saturation query says so, or a level with more calls in flight \
                 gave significantly no more throughput (or only a slower first byte) than the \
                 best level measured; the message names the backend with the numbers (and any \
                 overcommit, below)",
            ),
            reason(
                "True",
                "Overcommitted",
                "every gateway pod keeps at least 1 connection per endpoint, so more gateway \
                 pods than a backend's budget (its target per endpoint) open more connections \
                 than the budget: the message names the backend with the pods, the total and \
                 the budget (10 pods, 10 in all, budget 8). Run fewer gateway pods or raise the \
                 budget",
            ),
            reason("Unknown", "NotAccepted", NOT_ACCEPTED),
        ],
    },
    ConditionDoc {
        type_: "Ready",
        meaning: "The policy is accepted and rolled out: what `kubectl wait --for=condition=Ready` \
                  waits for.",
        reasons: &[
            reason("True", "Ready", "accepted and rolled out"),
            reason(
                "True",
                "Recommending",
                "`mode: Recommend`: accepted, and its recommendation is published (the message \
                 is that of `RolledOut`)",
            ),
            reason(
                "False",
                "Progressing",
                "not yet: the reason and message are those of `RolledOut`",
            ),
            reason("False", "Halted", "as `RolledOut`"),
            reason("False", "NoReadyPods", "as `RolledOut`"),
            reason("False", "NotAccepted", NOT_ACCEPTED),
        ],
    },
];

/// Every Event reason the operator publishes on a policy.
pub const EVENTS: &[EventDoc] = &[
    EventDoc {
        type_: "Normal",
        reason: "ScaledUp",
        meaning: "a backend's target grew; the note has the numbers (`model-a: target 120 → \
                  150: demand 143 …`)",
    },
    EventDoc {
        type_: "Normal",
        reason: "ScaledDown",
        meaning: "a backend's target shrank, with the numbers",
    },
    EventDoc {
        type_: "Warning",
        reason: "SteppedBack",
        meaning: "the knee guard lowered a backend's target: growth was followed by \
                  significantly less throughput (or a slower first byte) at the same demand, so \
                  it returns toward the level that gave the most, or probes below it; the note \
                  has both levels with their throughput, noise and calls. The calls beyond wait \
                  in the gateways' queues",
    },
    EventDoc {
        type_: "Normal",
        reason: "WouldScaleUp",
        meaning: "`mode: Recommend`: a backend's recommended target grew; nothing was sent to \
                  the pods (`would scale model-a 8 → 17: demand …`)",
    },
    EventDoc {
        type_: "Normal",
        reason: "WouldScaleDown",
        meaning: "`mode: Recommend`: a backend's recommended target shrank, with the numbers",
    },
    EventDoc {
        type_: "Normal",
        reason: "IdleTimeoutLowered",
        meaning: "the gateways found connections closed by a backend after less idle time than \
                  its `pool.idleTimeout`: the idle timeout the pods run is lowered under it, so \
                  that the gateway closes first and no call meets a connection the backend is \
                  closing; the note has both times (`model-a: idleTimeout 30s → 1230ms: …`), \
                  `status.backends[].idleTimeout` keeps them",
    },
    EventDoc {
        type_: "Normal",
        reason: "WouldLowerIdleTimeout",
        meaning: "`mode: Recommend`: the recommended documents carry a lowered idle timeout for \
                  a backend (as `IdleTimeoutLowered`); nothing was sent to the pods",
    },
    EventDoc {
        type_: "Warning",
        reason: "ProviderCoolingDown",
        meaning: "a backend's provider refused calls with `Retry-After` (`429`/`503`, a backend \
                  with `credentials`): the note has how many over the last ten metric windows \
                  and what became of the calls meanwhile (sent to a fallback, or answered `429` \
                  `backend_cooling_down`); `status.backends[].cooldown` keeps the counts. Once \
                  until a window passes without a refusal",
    },
    EventDoc {
        type_: "Warning",
        reason: "UpstreamTlsVerificationFailed",
        meaning: "calls to a backend failed verification of its TLS certificate (`502` \
                  `upstream_tls_verification_failed`): the note has how many over the last ten \
                  metric windows; check `tls.serverName` and the CA (`tls.caBundleSecret`). \
                  `status.backends[].tlsVerificationFailures` keeps the count. Once until a \
                  window passes without one",
    },
    EventDoc {
        type_: "Normal",
        reason: "IdleTimeoutRestored",
        meaning: "a lowered idle timeout went without closes found for an hour × 2^tries (at \
                  most a day): the spec's `pool.idleTimeout` is in force again, since a backend \
                  restarted in place or given a longer keep-alive would otherwise keep the \
                  short value for good; if the backend's closes come back, each gateway pod \
                  protects itself from the first and the operator lowers it again (the next \
                  wait doubles)",
    },
    EventDoc {
        type_: "Normal",
        reason: "WouldRestoreIdleTimeout",
        meaning: "`mode: Recommend`: the recommended documents carry a backend's spec \
                  `pool.idleTimeout` again (as `IdleTimeoutRestored`); nothing was sent to the \
                  pods",
    },
    EventDoc {
        type_: "Warning",
        reason: "GrowthHeld",
        meaning: "a backend's growth has been held for 3 decisions in a row (past its knee, \
                  judging a step, or at its upper bound); the note names the backend and the \
                  last decision's reason with its numbers. Once per hold",
    },
    EventDoc {
        type_: "Normal",
        reason: "RolledOut",
        meaning: "every selected pod not terminating acknowledged its new document",
    },
    EventDoc {
        type_: "Warning",
        reason: "Invalid",
        meaning: "the policy turned `Accepted=False` with reason `Invalid`; the note lists the \
                  broken rules",
    },
    EventDoc {
        type_: "Warning",
        reason: "NamespaceNotAllowed",
        meaning: "the policy turned `Accepted=False` with reason `NamespaceNotAllowed`; the note \
                  names the backend and its namespace",
    },
    EventDoc {
        type_: "Warning",
        reason: "Conflicted",
        meaning: "the policy turned `Accepted=False` with reason `Conflicted`; the note names \
                  the older policy",
    },
    EventDoc {
        type_: "Warning",
        reason: "MetricsMissing",
        meaning: "`MetricsAvailable` turned False: targets are held",
    },
    EventDoc {
        type_: "Warning",
        reason: "FdBudgetExceeded",
        meaning: "`FdBudget` turned False; the note has the numbers (`needs 1342 fds, pods allow \
                  1024`)",
    },
    EventDoc {
        type_: "Warning",
        reason: "RolloutHalted",
        meaning: "a pod refused the limits (the note names the pod), or a canary regressed and \
                  was rolled back (the note names the signal and both numbers)",
    },
    EventDoc {
        type_: "Warning",
        reason: "ReconcileFailed",
        meaning: "a reconcile failed at some step (`observe`, `plan`, `rollout`, `status` or \
                  `finalizer`; the Event's action names it); the note names the step and the \
                  error, an RBAC denial included. The operator retries every few seconds; \
                  repeats are counted in the same Event series",
    },
    EventDoc {
        type_: "Warning",
        reason: "InvalidPolicy",
        meaning: "this operator cannot read the policy (a field or value it does not know, \
                  written under a newer CRD): it is skipped, its backends are in no document, \
                  and every other policy reconciles; the note has the error. Upgrade the \
                  operator to the CRD's release, or fix the policy",
    },
    EventDoc {
        type_: "Warning",
        reason: "ImplausibleGeneration",
        meaning: "a generation read back (a limits ConfigMap's annotation or document, a pod's \
                  answer, a status) is 2^53 − 1 or more: ignored, never stepped over; the note \
                  says where it was read. A pod running one is named in `RolledOut` and needs a \
                  restart",
    },
];

/// Whether `(type_, status, reason)` is a documented condition state.
pub fn is_documented(type_: &str, status: &str, reason: &str) -> bool {
    CONDITIONS.iter().any(|c| {
        c.type_ == type_
            && c.reasons
                .iter()
                .any(|r| r.status == status && r.reason == reason)
    })
}

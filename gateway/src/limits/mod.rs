//! Who may use what, beyond the pool's own cap and queue: each client policy's limiter (per
//! client concurrency, queue, overrides, slow-call demotion, the priority class of a call:
//! [`limiter`]; its clients' recent demand for `GET /v1/clients`: [`demand`]), the two-class waiter queue it shares with the pool ([`queue`]), the pool's token-fair
//! order between clients within a class ([`fair`]), the pod-wide
//! cap on upstream connections divided across the backends ([`share`]), and the memory of
//! refusals that tells whether clients honour `Retry-After` ([`refusals`]), and a provider's
//! own refusals that cool its backend down ([`cooldown`]). (The limits
//! *document* these enforce is `poolpilot_api::limits`.)

pub mod cooldown;
pub mod demand;
pub mod fair;
pub mod limiter;
pub mod queue;
pub mod refusals;
pub mod share;

//! The request path of one proxied call, as the phases of [`pipeline`]:
//!
//! ```text
//! 0. drain      a gateway shutting down takes no new call                          503
//! 1. head       head limits; RFC 9110/9112 MUSTs                         431 413 400 501
//! 2. own answer GET /v1/models from the routes in force
//! 3. route      path prefix, headers, the body's JSON `model` (bounded buffer,
//!               body pace, pod-wide budget)                                  404 408 503
//!    cooldown   a backend whose provider asked to wait hands the call to its first
//!               fallback that did not; none                                          429
//! 4. identity   the client's hashed identity; back early after a refusal?
//! 5. class      interactive or batch, by the client's policy
//! 6. tokens     the call's estimate reserved in its client's token budget
//!               (`crate::tokens`)                                                     429
//! 7. admission  the client's limiter: concurrency, queue                          429 503
//! 8. headers    hop-by-hop dropped, X-Forwarded-For and Via added; the client's credentials
//!               replaced by the provider's key (a backend with `credentials`)
//! 9. forward    soft throttle, pool lease, send (again on another connection only
//!               when a *reused* one failed it before any byte of a response:
//!               unsent, or replayable), the response head within firstByte
//!               (from the end of the body) and total                         503 504 502
//!    respond    the body streams back frame by frame under its deadlines (`deadline`),
//!               its usage read as it passes; its end settles the token reservation
//! ```
//!
//! Every failure is a typed [`error::ProxyError`] and becomes a response in one place. The lease
//! and the client permit live in the response body until its last frame: a connection returns to
//! the pool only after a complete exchange, and a client's call counts against its concurrency
//! for as long as it streams. When a deadline cuts the response, the task serving it drops the
//! body, which releases both at once. What the client causes is never held against the backend.
//!
//! | file | owns |
//! |---|---|
//! | `pipeline.rs` | the phases above, in order; a failure becomes the response, a refusal is remembered |
//! | `head.rs` | head limits and the RFC 9110/9112 checks hyper leaves to the server |
//! | `models.rs` | `GET /v1/models` from the routes in force |
//! | `route.rs` | route matching, the JSON `model` read from a bounded buffer |
//! | `route_budget.rs` | the pod-wide byte budget of routing buffers |
//! | `fallback.rs` | a backend cooling down: its first fallback that is not, or 429 |
//! | `identity.rs` | the client's hashed identity as its policy counts it |
//! | `headers.rs` | hop-by-hop headers, `Via`, `X-Forwarded-For`, the upstream request line |
//! | `credentials.rs` | the provider's key in place of the client's credentials, re-read on rotation |
//! | `forward.rs` | lease, send, retry on a stale connection, the wait for the response head |
//! | `replay.rs` | which requests are safe to send twice, and the copy kept to send one again |
//! | `call.rs` | a call's context, and what its end settles: metrics, tokens, the connection, outlier reports, the permit |
//! | `response.rs` | the response body on its way back, reporting to its deadlines |
//! | `deadline.rs` | the deadlines of a response in flight, fired whether or not the client reads |
//! | `body.rs` | body types; the client's request body with its size limit and pace |
//! | `error.rs` | typed failures → status, `Retry-After`, an OpenAI-shaped body (the only place) |

mod call;
pub(crate) mod credentials;
mod fallback;
mod forward;
mod head;
mod headers;
mod identity;
mod models;
mod replay;
mod response;
mod route;

pub(crate) mod body;
pub(crate) mod deadline;
pub(crate) mod error;
pub(crate) mod pipeline;
pub(crate) mod route_budget;

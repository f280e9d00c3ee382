//! The rollout's pushes against real admin servers on loopback addresses (plain HTTP, the
//! operator's own HTTP client): never more than the bound in flight, and a hung pod abandoned
//! at its timeout while the rest of the wave goes on. Paused tokio time: the servers' latencies
//! and the timeout are virtual, the sockets are real.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use http_body_util::{BodyExt as _, Full};
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use parking_lot::Mutex;
use poolpilot_api::GatewayLimits;
use tokio::net::TcpListener;
use tokio::time::Instant;

use super::{Delivery, send_all};
use crate::gateway::HttpGateways;
use crate::reconcile::PushBound;

/// How a simulated pod answers a PUT.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Answer {
    /// Acknowledges the document after this long.
    After(Duration),
    /// Accepts the connection, reads the request and never answers.
    Never,
}

/// What the servers saw, over all of them.
#[derive(Debug, Default)]
pub(crate) struct Seen {
    /// PUTs being answered now.
    in_flight: AtomicUsize,
    /// The most at once.
    pub(crate) most: AtomicUsize,
    /// When each acknowledgement went out, by server address.
    pub(crate) acked: Mutex<Vec<(SocketAddr, Instant)>>,
}

/// A pod's admin port on `127.0.0.<host>` (a port of its own) answering every PUT as `answer`
/// says, with `{revision, generation}` of the document it was sent.
pub(crate) async fn admin_server(host: u8, answer: Answer, seen: Arc<Seen>) -> SocketAddr {
    let ip = IpAddr::V4(Ipv4Addr::new(127, 0, 0, host));
    let listener = TcpListener::bind((ip, 0)).await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((stream, _)) = listener.accept().await {
            if let Answer::Never = answer {
                held.push(stream);
                continue;
            }
            let seen = seen.clone();
            tokio::spawn(async move {
                let service = service_fn(move |req: http::Request<hyper::body::Incoming>| {
                    let seen = seen.clone();
                    async move {
                        let now = seen.in_flight.fetch_add(1, Ordering::SeqCst) + 1;
                        seen.most.fetch_max(now, Ordering::SeqCst);
                        let body = req.into_body().collect().await?.to_bytes();
                        let doc: GatewayLimits = serde_json::from_slice(&body).unwrap();
                        if let Answer::After(latency) = answer {
                            tokio::time::sleep(latency).await;
                        }
                        seen.in_flight.fetch_sub(1, Ordering::SeqCst);
                        seen.acked.lock().push((addr, Instant::now()));
                        let ack = serde_json::json!({"revision": doc.revision, "generation": doc.generation});
                        Ok::<_, hyper::Error>(http::Response::new(Full::new(bytes::Bytes::from(
                            ack.to_string(),
                        ))))
                    }
                });
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), service)
                    .await;
            });
        }
    });
    addr
}

/// A document at `generation`.
fn doc(generation: u64) -> Arc<GatewayLimits> {
    let mut doc: GatewayLimits =
        serde_json::from_value(serde_json::json!({"generation": generation, "backends": []}))
            .unwrap();
    doc = doc.with_content_revision();
    Arc::new(doc)
}

#[tokio::test(start_paused = true)]
async fn a_hung_pod_holds_one_slot_for_its_timeout_and_never_the_wave() {
    // 12 pods: gw-3 hangs, every fourth one answers in 400 ms, the others in 50 ms.
    let seen = Arc::new(Seen::default());
    let mut pods = Vec::new();
    for i in 0..12u8 {
        let answer = match i {
            3 => Answer::Never,
            i if i % 4 == 0 => Answer::After(Duration::from_millis(400)),
            _ => Answer::After(Duration::from_millis(50)),
        };
        let addr = admin_server(20 + i, answer, seen.clone()).await;
        pods.push((format!("gw-{i}"), addr, doc(7)));
    }
    // The client's own timeout is far off: the per-pod one decides.
    let gateways = HttpGateways::new(Duration::from_secs(600)).unwrap();
    let bound = PushBound {
        concurrency: 4,
        timeout: Duration::from_secs(2),
    };
    let start = Instant::now();
    let outcomes = send_all(&gateways, "ns", ("token", None), pods, bound).await;
    let took = start.elapsed();

    let mut timed_out = Vec::new();
    let mut acked = 0;
    for (name, doc, delivery) in &outcomes {
        match delivery {
            Delivery::TimedOut(after) => {
                assert_eq!(*after, bound.timeout);
                timed_out.push(name.clone());
            }
            Delivery::Answered(Ok(ack)) => {
                assert_eq!(ack.revision, doc.revision, "{name}");
                acked += 1;
            }
            Delivery::Answered(Err(e)) => panic!("{name}: {e:?}"),
        }
    }
    assert_eq!(timed_out, ["gw-3"]);
    assert_eq!(acked, 11);
    assert_eq!(
        seen.most.load(Ordering::SeqCst),
        3,
        "4 in flight at most, the hung pod holding one slot"
    );
    // The other 11 took 3 × 400 + 8 × 50 = 1.6 s of answers over the 3 free slots: done long
    // before the hung pod's timeout, which alone decides when the push ends.
    let last = seen.acked.lock().iter().map(|(_, at)| *at).max().unwrap();
    assert!(
        last - start < Duration::from_secs(1),
        "the others were held: done after {:?}",
        last - start
    );
    assert!(
        took >= bound.timeout && took < bound.timeout + Duration::from_millis(500),
        "the push ended after {took:?}"
    );
}

#[tokio::test(start_paused = true)]
async fn pushes_never_exceed_the_bound_and_one_at_a_time_is_sequential() {
    for (concurrency, pods, expected) in [(1, 6, 6 * 100), (3, 6, 2 * 100), (32, 6, 100)] {
        let seen = Arc::new(Seen::default());
        let mut sends = Vec::new();
        for i in 0..pods {
            let answer = Answer::After(Duration::from_millis(100));
            let addr = admin_server(60 + i, answer, seen.clone()).await;
            sends.push((format!("gw-{i}"), addr, doc(1)));
        }
        let gateways = HttpGateways::new(Duration::from_secs(600)).unwrap();
        let bound = PushBound {
            concurrency,
            timeout: Duration::from_secs(5),
        };
        let start = Instant::now();
        let outcomes = send_all(&gateways, "ns", ("token", None), sends, bound).await;
        let took = start.elapsed();
        assert!(
            outcomes
                .iter()
                .all(|(_, _, d)| matches!(d, Delivery::Answered(Ok(_)))),
            "{outcomes:?}"
        );
        assert_eq!(
            seen.most.load(Ordering::SeqCst),
            concurrency.min(usize::from(pods)),
            "concurrency {concurrency}"
        );
        let expected = Duration::from_millis(expected);
        assert!(
            took >= expected && took < expected + Duration::from_millis(50),
            "concurrency {concurrency}: {took:?}, expected {expected:?}"
        );
    }
}

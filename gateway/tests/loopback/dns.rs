//! DNS-named endpoints against a real DNS server (dnsmasq on 127.0.0.1, answering from a hosts
//! file the test rewrites): the gateway pools the name's address, follows the answer when it
//! changes mid-load (the old address's pool drains, no call fails), and keeps serving the last
//! good answer when the server goes away (counted, and the name marked stale).

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use crate::support::*;

const HOST: &str = "model.poolpilot.test";

/// Two backends on one port, at 127.0.0.21 and 127.0.0.22.
async fn two_backends() -> (Backend, Backend, u16) {
    loop {
        let a = Backend::start_at("127.0.0.21:0".parse().unwrap()).await;
        let port = a.addr.port();
        let b: SocketAddr = ([127, 0, 0, 22], port).into();
        if std::net::TcpListener::bind(b).is_ok() {
            return (a, Backend::start_at(b).await, port);
        }
    }
}

#[tokio::test]
#[ignore = "needs dnsmasq (make upstream-peers)"]
async fn a_named_endpoint_follows_its_answer_and_outlives_its_dns_server() {
    let (a, b, port) = two_backends().await;
    let mut dns = crate::peers::dnsmasq(1, &format!("127.0.0.21 {HOST}\n")).await;
    let server = dns.addr;
    let gw = Gw::start_edited(None, Duration::from_secs(5), Duration::ZERO, |config, _| {
        config.dns.servers = vec![server];
        config.dns.ttl_floor = poolpilot_api::Duration::from_millis(100);
        config.dns.ttl_ceiling = poolpilot_api::Duration::from_millis(500);
        config.dns.timeout = poolpilot_api::Duration::from_millis(300);
    })
    .await;
    let mut doc = serde_json::to_value(limits("model-a", &[a.addr], 4)).unwrap();
    doc["backends"][0]["endpoints"] =
        serde_json::json!([{"name": "model-a-0", "address": format!("{HOST}:{port}")}]);
    gw.apply(from_json(doc));
    assert_eventually!(
        try_get(gw.proxy, "/v1/x").await == Some(200),
        Duration::from_secs(5),
        "the name resolves and its address serves"
    );

    // Load throughout: 4 callers, one call after another.
    let stop = Arc::new(AtomicBool::new(false));
    let (sent, failed) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
    let callers: Vec<_> = (0..4)
        .map(|_| {
            let (stop, sent, failed, proxy) =
                (stop.clone(), sent.clone(), failed.clone(), gw.proxy);
            tokio::spawn(async move {
                let mut conn = connect(proxy).await;
                while !stop.load(Ordering::SeqCst) {
                    let (status, _, _) = conn.call(request("GET", "/v1/x", &[], "")).await;
                    sent.fetch_add(1, Ordering::SeqCst);
                    if status != 200 {
                        failed.fetch_add(1, Ordering::SeqCst);
                    }
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
            })
        })
        .collect();
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(a.requests() > 0 && b.requests() == 0);

    // The answer changes: calls move to the new address, the old one's pool drains.
    dns.rewrite("hosts/answer", &format!("127.0.0.22 {HOST}\n"));
    assert_eventually!(
        b.requests() > 0,
        Duration::from_secs(5),
        "the new address gets calls"
    );
    let old = r#"endpoint="model-a-0/127.0.0.21""#;
    assert_eventually!(
        {
            let text = gw.metrics().await;
            !text
                .lines()
                .any(|l| l.starts_with("poolpilot_pool_connections{") && l.contains(old))
        },
        Duration::from_secs(5),
        "the old address's pool is gone"
    );
    let moved_at = a.requests();
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(a.requests(), moved_at, "the old address gets no more calls");
    let text = gw.metrics().await;
    assert!(
        metric(
            &text,
            r#"poolpilot_pool_connections_closed_total{backend="model-a",endpoint="model-a-0/127.0.0.21",reason="removed"}"#
        )
        .unwrap_or(0.0)
            > 0.0,
        "{text}"
    );

    // The DNS server goes away: the last answer stays in force, the name is stale.
    dns.stop();
    let stale = format!(r#"poolpilot_dns_stale{{host="{HOST}"}}"#);
    assert_eventually!(
        metric(&gw.metrics().await, &stale) == Some(1.0),
        Duration::from_secs(5),
        "the failed lookups mark the name stale"
    );
    let served = b.requests();
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(b.requests() > served, "calls go on to the last good answer");
    stop.store(true, Ordering::SeqCst);
    for caller in callers {
        caller.await.unwrap();
    }
    let text = gw.metrics().await;
    let failed_lookups = metric(
        &text,
        &format!(r#"poolpilot_dns_lookups_total{{host="{HOST}",outcome="failed"}}"#),
    )
    .unwrap_or(0.0);
    eprintln!(
        "{} calls through an answer change and a DNS outage, {} failed; {failed_lookups} failed lookups",
        sent.load(Ordering::SeqCst),
        failed.load(Ordering::SeqCst)
    );
    assert!(failed_lookups > 0.0);
    assert_eq!(failed.load(Ordering::SeqCst), 0, "no call failed");
}

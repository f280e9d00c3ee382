//! Micro-benchmark of the pool's hot path: an uncontended lease of an idle connection and its
//! release back to the pool (one lock round trip each way, no IO).

use std::hint::black_box;
use std::io;
use std::net::SocketAddr;

use criterion::{Criterion, criterion_group, criterion_main};
use poolpilot_api::limits::PoolLimits;
use poolpilot_gateway::Metrics;
use poolpilot_gateway::pool::{Connect, Endpoint, Pool, Poolable};

/// A connection that is always open: measures the pool, not a socket.
#[derive(Debug)]
struct Conn;

impl Poolable for Conn {
    fn is_open(&mut self) -> bool {
        true
    }
}

#[derive(Debug)]
struct Connector;

impl Connect for Connector {
    type Conn = Conn;

    async fn connect(&self, _addr: SocketAddr) -> io::Result<Conn> {
        Ok(Conn)
    }
}

/// The pool limits of the example limits document's first backend (the numbers people start
/// from: 64 per endpoint, queue 128, 300 ms lease timeout).
fn limits() -> PoolLimits {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/examples/limits.yaml");
    let text = std::fs::read(path).expect("read the example limits document");
    let doc = poolpilot_gateway::reload::parse(std::path::Path::new(path), &text)
        .expect("the example limits document parses");
    doc.backends[0].pool.clone()
}

fn endpoints(n: u16) -> Vec<Endpoint> {
    (0..n)
        .map(|i| Endpoint {
            name: format!("ep-{i}"),
            address: SocketAddr::from(([127, 0, 0, 1], 8000 + i)),
        })
        .collect()
}

fn lease_release(c: &mut Criterion) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    for n in [1, 8] {
        let pool = rt.block_on(async {
            Pool::new("bench", limits(), &endpoints(n), Connector, Metrics::new())
        });
        // Warm: one idle connection per endpoint.
        rt.block_on(async {
            let mut lease = pool.lease().await.unwrap();
            lease.keep();
        });
        c.bench_function(
            &format!("lease+release, {n} endpoint(s), uncontended"),
            |b| {
                b.to_async(&rt).iter(|| async {
                    let mut lease = pool.lease().await.unwrap();
                    black_box(lease.reused());
                    lease.keep();
                })
            },
        );
    }
}

criterion_group!(benches, lease_release);
criterion_main!(benches);

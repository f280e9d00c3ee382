//! The kubelet API, as far as `kubectl logs` needs it: HTTPS on the address the Node reports,
//! open only to clients with a certificate of the kubelet-client CA (`cluster up` gives its one
//! certificate to the apiserver, which checks who may read which pod's logs), serving
//! `GET /containerLogs/{namespace}/{pod}/{container}` with the query the apiserver forwards
//! ([`Query`]); `follow` streams new lines until the container's instance ends.

use std::collections::HashMap;
use std::convert::Infallible;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{Method, Request, Response, StatusCode};
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt as _, Full, StreamBody};
use hyper::body::Frame;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo};
use k8s_openapi::jiff::Timestamp;
use parking_lot::Mutex;
use rustls::pki_types::pem::PemObject as _;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use tokio::io::AsyncReadExt as _;
use tokio::net::TcpListener;
use tokio::sync::{mpsc, watch};
use tokio_rustls::TlsAcceptor;

use super::logs::{self, Query};

/// How often a followed log is looked at for new lines.
const FOLLOW_POLL: Duration = Duration::from_millis(100);
/// Longest TLS handshake.
const HANDSHAKE: Duration = Duration::from_secs(10);

type Body = BoxBody<Bytes, Infallible>;

/// The files of the kubelet API's TLS.
#[derive(Clone, Debug)]
pub struct ApiTls {
    /// Serving certificate (PEM), for the Node's address.
    pub cert: PathBuf,
    /// Its private key (PEM).
    pub key: PathBuf,
    /// The CA whose certificates are the only clients let in (PEM).
    pub client_ca: PathBuf,
}

impl ApiTls {
    /// The rustls server configuration: this certificate, client certificates required and
    /// checked against the client CA; HTTP/2 and HTTP/1.1.
    pub fn server_config(&self) -> anyhow::Result<Arc<rustls::ServerConfig>> {
        let certs = CertificateDer::pem_file_iter(&self.cert)?.collect::<Result<Vec<_>, _>>()?;
        let key = PrivateKeyDer::from_pem_file(&self.key)?;
        let mut roots = rustls::RootCertStore::empty();
        for ca in CertificateDer::pem_file_iter(&self.client_ca)? {
            roots.add(ca?)?;
        }
        let clients = rustls::server::WebPkiClientVerifier::builder(Arc::new(roots)).build()?;
        let mut config = rustls::ServerConfig::builder()
            .with_client_cert_verifier(clients)
            .with_single_cert(certs, key)?;
        config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
        Ok(Arc::new(config))
    }
}

/// The running container instances' "has ended" signals, by (namespace, pod, container): what
/// tells a follower that no more lines will come.
pub type Instances = Mutex<HashMap<(String, String, String), watch::Receiver<bool>>>;

/// What the API reads: where pod folders are and which instances run.
#[derive(Debug)]
pub struct Logs<'a> {
    /// `<state-dir>/pods`.
    pub pods_dir: &'a Path,
    /// See [`Instances`].
    pub instances: &'a Instances,
}

/// Serves the API on `listener` until the task is dropped.
pub async fn serve(
    listener: TcpListener,
    tls: Arc<rustls::ServerConfig>,
    pods_dir: PathBuf,
    instances: Arc<Instances>,
) {
    let acceptor = TlsAcceptor::from(tls);
    loop {
        let (tcp, peer) = match listener.accept().await {
            Ok(accepted) => accepted,
            Err(e) => {
                tracing::warn!(error = %e, "kubelet API: accept failed");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let (acceptor, pods_dir, instances) =
            (acceptor.clone(), pods_dir.clone(), Arc::clone(&instances));
        tokio::spawn(async move {
            let stream = match tokio::time::timeout(HANDSHAKE, acceptor.accept(tcp)).await {
                Ok(Ok(stream)) => stream,
                Ok(Err(e)) => {
                    tracing::info!(%peer, error = %e, "kubelet API: TLS handshake refused");
                    return;
                }
                Err(_) => return,
            };
            let service = service_fn(move |req| {
                let (pods_dir, instances) = (pods_dir.clone(), Arc::clone(&instances));
                async move {
                    let logs = Logs {
                        pods_dir: &pods_dir,
                        instances: &instances,
                    };
                    Ok::<_, Infallible>(logs.respond(&req, Timestamp::now()))
                }
            });
            let served = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new())
                .serve_connection(TokioIo::new(stream), service)
                .await;
            if let Err(e) = served {
                tracing::debug!(%peer, error = %e, "kubelet API connection ended");
            }
        });
    }
}

fn text(status: StatusCode, message: impl Into<String>) -> Response<Body> {
    let mut body = message.into();
    body.push('\n');
    Response::builder()
        .status(status)
        .header(http::header::CONTENT_TYPE, "text/plain; charset=utf-8")
        .body(Full::new(Bytes::from(body)).boxed())
        .unwrap_or_else(|_| Response::new(Full::new(Bytes::new()).boxed()))
}

/// A namespace, pod or container name from a URL: a plain path segment, never a way out of the
/// pod folders.
fn plain_name(s: &str) -> bool {
    !s.is_empty() && s != "." && s != ".." && !s.contains(['/', '\\', '\0'])
}

impl Logs<'_> {
    /// The answer to one request at `now`.
    pub fn respond<B>(&self, req: &Request<B>, now: Timestamp) -> Response<Body> {
        if req.method() != Method::GET {
            return text(StatusCode::METHOD_NOT_ALLOWED, "only GET is served");
        }
        let segments: Vec<&str> = req.uri().path().split('/').skip(1).collect();
        let ["containerLogs", ns, pod, container] = segments[..] else {
            return text(
                StatusCode::NOT_FOUND,
                format!("no such endpoint: {}", req.uri().path()),
            );
        };
        if ![ns, pod, container].into_iter().all(plain_name) {
            return text(
                StatusCode::BAD_REQUEST,
                "invalid namespace, pod or container name",
            );
        }
        let query = match Query::parse(req.uri().query().unwrap_or_default(), now) {
            Ok(q) => q,
            Err(e) => return text(StatusCode::BAD_REQUEST, e),
        };
        let dir = self.pods_dir.join(ns).join(pod);
        if !dir.is_dir() {
            return text(
                StatusCode::NOT_FOUND,
                format!("pod {ns}/{pod} has never run on this node"),
            );
        }
        let path = if query.previous {
            logs::previous(&dir, container)
        } else {
            logs::current(&dir, container)
        };
        if !path.is_file() {
            let why = if query.previous {
                format!("previous terminated container \"{container}\" in pod \"{pod}\" not found")
            } else {
                format!(
                    "container \"{container}\" in pod \"{pod}\" is waiting to start: no log yet"
                )
            };
            return text(StatusCode::BAD_REQUEST, why);
        }
        let ended = if query.previous {
            None
        } else {
            self.instances
                .lock()
                .get(&(ns.to_owned(), pod.to_owned(), container.to_owned()))
                .cloned()
        };
        let body = match (query.follow, ended) {
            (true, Some(ended)) if !*ended.borrow() => follow(path, query, ended),
            _ => {
                let now = std::fs::read_to_string(&path).unwrap_or_default();
                Full::new(Bytes::from(query.render_all(&now))).boxed()
            }
        };
        Response::builder()
            .header(http::header::CONTENT_TYPE, "text/plain; charset=utf-8")
            .body(body)
            .unwrap_or_else(|_| text(StatusCode::INTERNAL_SERVER_ERROR, "response"))
    }
}

/// A body with the log as it is (as `query` asks), then every line written to it until the
/// instance has ended (or the client went away, or `limitBytes` were sent).
fn follow(path: PathBuf, query: Query, mut ended: watch::Receiver<bool>) -> Body {
    let (tx, rx) = mpsc::channel::<Bytes>(16);
    tokio::spawn(async move {
        let Ok(mut file) = tokio::fs::File::open(&path).await else {
            return;
        };
        // limitBytes counts over the whole response, tailLines over what is there at first.
        let mut budget = query.limit_bytes.unwrap_or(u64::MAX);
        let mut q = query;
        q.limit_bytes = None;
        let mut pending = Vec::new();
        loop {
            let was_ended = *ended.borrow();
            let mut read = Vec::new();
            if file.read_to_end(&mut read).await.is_err() {
                return;
            }
            pending.extend_from_slice(&read);
            // Whole lines only: a line being written waits for its end.
            let whole = pending
                .iter()
                .rposition(|b| *b == b'\n')
                .map_or(0, |i| i + 1);
            let mut chunk = q.render_all(&String::from_utf8_lossy(&pending[..whole]));
            pending.drain(..whole);
            q.tail_lines = None;
            if !chunk.is_empty() {
                logs::truncate_at_char(&mut chunk, usize::try_from(budget).unwrap_or(usize::MAX));
                budget -= chunk.len() as u64;
                if tx.send(Bytes::from(chunk)).await.is_err() || budget == 0 {
                    return;
                }
            }
            if was_ended && read.is_empty() {
                return;
            }
            tokio::select! {
                () = tokio::time::sleep(FOLLOW_POLL) => {}
                _ = ended.changed() => {}
                () = tx.closed() => return,
            }
        }
    });
    let stream = futures::stream::unfold(rx, |mut rx| async move {
        rx.recv()
            .await
            .map(|chunk| (Ok::<_, Infallible>(Frame::data(chunk)), rx))
    });
    StreamBody::new(stream).boxed()
}

#[cfg(test)]
mod tests {
    use super::*;

    const LOG: &str = "\
2027-01-15T08:00:00Z stdout F one
2027-01-15T08:00:01Z stdout F two
";

    async fn get(logs: &Logs<'_>, method: Method, uri: &str) -> (StatusCode, String) {
        let req = Request::builder().method(method).uri(uri).body(()).unwrap();
        let resp = logs.respond(&req, Timestamp::now());
        let status = resp.status();
        let body = resp.into_body().collect().await.unwrap().to_bytes();
        (status, String::from_utf8(body.to_vec()).unwrap())
    }

    #[tokio::test]
    async fn container_logs_are_served_as_kubectl_asks_and_everything_else_refused() {
        let dir = tempfile::tempdir().unwrap();
        let pod = dir.path().join("ns").join("web");
        std::fs::create_dir_all(&pod).unwrap();
        std::fs::write(logs::current(&pod, "app"), LOG).unwrap();
        let instances = Instances::default();
        let logs = Logs {
            pods_dir: dir.path(),
            instances: &instances,
        };
        let ok = |body: &str| (StatusCode::OK, body.to_owned());
        assert_eq!(
            get(&logs, Method::GET, "/containerLogs/ns/web/app").await,
            ok("one\ntwo\n")
        );
        assert_eq!(
            get(&logs, Method::GET, "/containerLogs/ns/web/app?tailLines=1").await,
            ok("two\n")
        );
        // No instance registered: the container is not running, so following ends at once.
        assert_eq!(
            get(&logs, Method::GET, "/containerLogs/ns/web/app?follow=true").await,
            ok("one\ntwo\n")
        );
        for (method, uri, status, needle) in [
            (
                Method::GET,
                "/containerLogs/ns/web/app?previous=true",
                StatusCode::BAD_REQUEST,
                "previous terminated container \"app\"",
            ),
            (
                Method::GET,
                "/containerLogs/ns/web/other",
                StatusCode::BAD_REQUEST,
                "waiting to start",
            ),
            (
                Method::GET,
                "/containerLogs/ns/gone/app",
                StatusCode::NOT_FOUND,
                "never run on this node",
            ),
            (
                Method::GET,
                "/containerLogs/ns/../app",
                StatusCode::BAD_REQUEST,
                "invalid",
            ),
            (
                Method::GET,
                "/containerLogs/ns/web/app?tailLines=x",
                StatusCode::BAD_REQUEST,
                "tailLines",
            ),
            (
                Method::GET,
                "/exec/ns/web/app",
                StatusCode::NOT_FOUND,
                "no such endpoint",
            ),
            (
                Method::POST,
                "/containerLogs/ns/web/app",
                StatusCode::METHOD_NOT_ALLOWED,
                "only GET",
            ),
        ] {
            let (got, body) = get(&logs, method, uri).await;
            assert_eq!(got, status, "{uri}: {body}");
            assert!(body.contains(needle), "{uri}: {body}");
        }
    }

    #[tokio::test]
    async fn following_a_running_instance_streams_its_new_lines_until_it_ends() {
        let dir = tempfile::tempdir().unwrap();
        let pod = dir.path().join("ns").join("web");
        std::fs::create_dir_all(&pod).unwrap();
        let (mut out, out_r) = tokio::io::duplex(1024);
        let (_err, err_r) = tokio::io::duplex(1024);
        let log = logs::LogFile::open(&pod, "app").unwrap();
        let instances = Instances::default();
        instances.lock().insert(
            ("ns".into(), "web".into(), "app".into()),
            log.record(out_r, err_r),
        );
        let logs = Logs {
            pods_dir: dir.path(),
            instances: &instances,
        };
        use tokio::io::AsyncWriteExt as _;
        out.write_all(b"before\n").await.unwrap();
        tokio::time::sleep(Duration::from_millis(50)).await;
        let req = Request::builder()
            .uri("/containerLogs/ns/web/app?follow=true")
            .body(())
            .unwrap();
        let mut body = logs.respond(&req, Timestamp::now()).into_body();
        let next = async |body: &mut Body| {
            let frame = body.frame().await?.ok()?;
            Some(String::from_utf8(frame.into_data().ok()?.to_vec()).unwrap())
        };
        assert_eq!(next(&mut body).await.as_deref(), Some("before\n"));
        out.write_all(b"after\n").await.unwrap();
        assert_eq!(next(&mut body).await.as_deref(), Some("after\n"));
        drop(out);
        drop(_err);
        assert_eq!(
            next(&mut body).await,
            None,
            "the instance ended, and so the stream"
        );
    }
}

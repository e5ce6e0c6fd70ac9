//! Serving a router over HTTP/1 with the limits that keep one client from slowing the service
//! for everyone else ([`HttpSettings`]):
//! - a request head must arrive whole within `header_timeout` (10 s), on a new connection and
//!   between two requests of a kept-alive one (hyper's header read timeout, with a timer), or
//!   the connection is closed;
//! - a request body must arrive whole within `body_timeout` (30 s) of its head ([`DeadlineBody`]:
//!   a deadline for the whole body, where tower-http's body timeout restarts at every chunk and
//!   would let a sender trickle a byte every 29 s), or the request is refused (408) and its
//!   connection closed;
//! - a request whose answer is not ready within `answer_timeout` (60 s, or more where the
//!   payment links' timeout needs it: [`HttpSettings::covering`]) is answered 503
//!   `answer_timeout` and its handler dropped: a client waiting on a lock a partitioned worker
//!   holds, or on a database that stopped answering, is answered then. The statement it was
//!   waiting on is not cancelled: its pool connection comes back once the lock is granted,
//!   which the database's five-minute end of idle transactions bounds (migration 0085; without
//!   it, PostgreSQL notices a vanished client after its TCP keepalive, two hours by default);
//! - a response the client stops reading (its socket's buffers full, nothing taken for
//!   `write_timeout`, 30 s) ends its connection ([`StallGuard`]): hyper has no timer while it
//!   writes, and a client that sends a request and never reads the answer would otherwise hold
//!   a connection slot for ever, with no traffic of its own;
//! - at most `max_connections` connections are served at once; one over that is closed as it
//!   arrives, before anything is read from it;
//! - at most `max_connections_per_client` of them come from one client (an IPv4 address, an
//!   IPv6 /64), so one host holding connections open cannot take every slot; behind a proxy
//!   (`client_address_header` set) every connection is the proxy's, and the proxy limits its
//!   own clients.
//!
//! Each request carries its peer's address (`ConnectInfo`), from which `callers` takes the
//! client's address.

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::ConnectInfo;
use axum::extract::rejection::BytesRejection;
use hyper::body::{Frame, Incoming};
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::net::TcpListener;
use tokio::sync::Semaphore;
use tokio::time::Sleep;

/// The HTTP server's limits, so that no single client can slow it for others, and where the
/// client's address comes from.
#[derive(Debug, Clone)]
pub struct HttpSettings {
    /// A connection that has not sent a complete request head within this is closed (also
    /// between two requests on a kept-alive connection).
    pub header_timeout: std::time::Duration,
    /// A request body not received whole within this is refused and its connection closed.
    pub body_timeout: std::time::Duration,
    /// A connection whose client takes nothing of a response for this long is closed.
    pub write_timeout: std::time::Duration,
    /// A request whose handler has not answered within this (from its head) is answered 503
    /// and the handler dropped. Above every handler's own bound ([`HttpSettings::covering`]).
    pub answer_timeout: std::time::Duration,
    /// Connections served at once; more are closed as they arrive.
    pub max_connections: usize,
    /// Connections served at once from one client (an IPv4 address, an IPv6 /64), when no
    /// proxy stands in front (`client_address_header` unset).
    pub max_connections_per_client: usize,
    /// Behind a proxy: the header it sets to the client's address (its last value is taken).
    /// Unset, the client is the connection's peer: no header can claim another address.
    pub client_address_header: Option<axum::http::HeaderName>,
}

impl HttpSettings {
    /// `PAYFLEET_MAX_CONNECTIONS` (4096), `PAYFLEET_MAX_CONNECTIONS_PER_CLIENT` (256),
    /// `PAYFLEET_CLIENT_ADDRESS_HEADER` (unset); the
    /// timeouts are fixed: 10 s for a request's head, 30 s for its body, 60 s for its answer,
    /// 30 s for a response the client reads nothing of.
    pub fn from_env(env: &dyn crate::env::Env) -> Result<Self, crate::env::Invalid> {
        use crate::env::{invalid, parsed, var};
        let max_connections = parsed(env, "PAYFLEET_MAX_CONNECTIONS", 4096usize)?;
        if !(1..=1_000_000).contains(&max_connections) {
            return Err(invalid("PAYFLEET_MAX_CONNECTIONS", "must be 1 to 1000000"));
        }
        // Unset, a share no larger than the whole: a small PAYFLEET_MAX_CONNECTIONS set before
        // the share existed still starts.
        let max_connections_per_client = parsed(
            env,
            "PAYFLEET_MAX_CONNECTIONS_PER_CLIENT",
            256usize.min(max_connections),
        )?;
        if !(1..=max_connections).contains(&max_connections_per_client) {
            return Err(invalid(
                "PAYFLEET_MAX_CONNECTIONS_PER_CLIENT",
                "must be 1 to PAYFLEET_MAX_CONNECTIONS",
            ));
        }
        let client_address_header = var(env, "PAYFLEET_CLIENT_ADDRESS_HEADER")
            .map(|v| {
                axum::http::HeaderName::try_from(v.to_ascii_lowercase()).map_err(|_| {
                    invalid(
                        "PAYFLEET_CLIENT_ADDRESS_HEADER",
                        format!("{v:?} is not a header name"),
                    )
                })
            })
            .transpose()?;
        Ok(Self {
            header_timeout: std::time::Duration::from_secs(10),
            body_timeout: std::time::Duration::from_secs(30),
            write_timeout: std::time::Duration::from_secs(30),
            answer_timeout: std::time::Duration::from_secs(60),
            max_connections,
            max_connections_per_client,
            client_address_header,
        })
    }
}

impl HttpSettings {
    /// These settings with an answer timeout that covers the longest request a handler may
    /// still answer on its own: its body's whole time, then a checkout's or a coin payment's
    /// wait for the payment side (`rpc_timeout`, up to two minutes) and the writes around it
    /// (ten seconds), and a margin. 60 s at the least.
    pub fn covering(mut self, rpc_timeout: Duration) -> Self {
        let longest = self.body_timeout + rpc_timeout + Duration::from_secs(20);
        self.answer_timeout = self.answer_timeout.max(longest);
        self
    }
}

/// How long a graceful stop waits for requests in flight before it drops their connections.
const DRAIN: Duration = Duration::from_secs(10);

/// Serves `router` on `listener` until `shutdown` resolves, then lets requests in flight finish
/// (up to [`DRAIN`]).
pub async fn serve(
    listener: TcpListener,
    router: Router,
    limits: HttpSettings,
    shutdown: impl Future<Output = ()> + Send,
) -> std::io::Result<()> {
    let permits = Arc::new(Semaphore::new(limits.max_connections));
    let graceful = hyper_util::server::graceful::GracefulShutdown::new();
    let mut http = hyper::server::conn::http1::Builder::new();
    http.timer(TokioTimer::new())
        .header_read_timeout(limits.header_timeout);
    let mut shutdown = std::pin::pin!(shutdown);
    let mut at_cap = Refusals::new(
        "the server is at its connection limit",
        limits.max_connections,
    );
    // Behind a proxy every peer is the proxy: it limits its clients, not us.
    let per_client = limits
        .client_address_header
        .is_none()
        .then(|| PerClient::new(limits.max_connections_per_client));
    let mut over_share = Refusals::new(
        "its client holds as many connections as one may",
        limits.max_connections_per_client,
    );
    let mut connections = tokio::task::JoinSet::new();
    loop {
        // Connections that ended are reaped as others arrive (the set holds only live ones).
        while connections.try_join_next().is_some() {}
        let (stream, peer) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(a) => a,
                Err(e) => {
                    // Out of file descriptors and the like: wait rather than spin.
                    tracing::error!(error = %e, "cannot accept a connection");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            },
            _ = &mut shutdown => break,
        };
        let Ok(permit) = permits.clone().try_acquire_owned() else {
            at_cap.refused(peer);
            drop(stream);
            continue;
        };
        let client_slot = match per_client.as_ref().map(|p| p.take(peer.ip())) {
            Some(None) => {
                over_share.refused(peer);
                drop(stream);
                continue;
            }
            Some(slot) => slot,
            None => None,
        };
        let _ = stream.set_nodelay(true);
        let router = router.clone();
        let body_timeout = limits.body_timeout;
        let answer_timeout = limits.answer_timeout;
        let service = hyper::service::service_fn(move |req: hyper::Request<Incoming>| {
            let mut router = router.clone();
            let mut req = req.map(|b| Body::new(DeadlineBody::new(b, body_timeout)));
            req.extensions_mut().insert(ConnectInfo(peer));
            // The request's id, given here so that an answer the handler never gave (the
            // answer timeout's) carries the same id as its logs. Kept beside the request, never
            // written over its headers: a gateway signs its own (Mercado Pago's
            // `x-request-id`, up to 256 bytes).
            let id = super::request_id(req.headers());
            req.extensions_mut().insert(super::RequestId(id.clone()));
            req.extensions_mut()
                .insert(super::AnswerBy(std::time::Instant::now() + answer_timeout));
            let (method, path) = (req.method().clone(), req.uri().path().to_owned());
            async move {
                let answer = tokio::time::timeout(
                    answer_timeout,
                    tower_service::Service::call(&mut router, req),
                )
                .await;
                Ok::<_, Infallible>(match answer {
                    Ok(Ok(resp)) => resp,
                    Ok(Err(never)) => match never {},
                    Err(_) => too_slow(&method, &path, answer_timeout, id),
                })
            }
        });
        let stream = StallGuard::new(stream, limits.write_timeout);
        let connection = graceful.watch(http.serve_connection(TokioIo::new(stream), service));
        connections.spawn(async move {
            if let Err(e) = connection.await {
                tracing::debug!(%peer, error = %e, "connection ended with an error");
            }
            drop(permit);
            drop(client_slot);
        });
    }
    drop(listener);
    tokio::select! {
        _ = graceful.shutdown() => {}
        _ = tokio::time::sleep(DRAIN) => {
            tracing::warn!(
                connections = connections.len(),
                "requests still running after {DRAIN:?}: their connections are dropped"
            );
        }
    }
    connections.abort_all();
    Ok(())
}

/// The answer to a request whose handler did not answer within `within`, with the request's
/// id as every 5xx has it. Its path is logged up to its first segment: the rest may be a
/// capability (a payment page's session).
fn too_slow(
    method: &axum::http::Method,
    path: &str,
    within: Duration,
    id: String,
) -> axum::response::Response {
    let head = path
        .trim_start_matches('/')
        .split('/')
        .next()
        .unwrap_or_default();
    let path = format!(
        "/{head}{}",
        if path.len() > head.len() + 1 {
            "/…"
        } else {
            ""
        }
    );
    let mut resp = super::error::REQUEST_ID.sync_scope(id.clone(), || {
        tracing::warn!(%method, path, request_id = %id, ?within, "a request did not finish within its answer timeout: answered 503, its handler dropped");
        axum::response::IntoResponse::into_response(super::error::ApiError::DependencyDown {
            code: "answer_timeout",
            message: format!(
                "the request did not finish within {} s and was stopped (a lock or the database held it); ask again, with the same Idempotency-Key where the endpoint takes one",
                within.as_secs()
            ),
            detail: format!("{method} {path}"),
        })
    });
    if let Ok(v) = axum::http::HeaderValue::from_str(&id) {
        resp.headers_mut().insert("x-request-id", v);
    }
    resp
}

/// Connections refused for one reason, logged once per thousand, not once per connection: a
/// flood must not flood the log too.
struct Refusals {
    why: &'static str,
    limit: usize,
    count: u64,
}

impl Refusals {
    fn new(why: &'static str, limit: usize) -> Self {
        Self {
            why,
            limit,
            count: 0,
        }
    }

    fn refused(&mut self, peer: std::net::SocketAddr) {
        self.count += 1;
        if self.count % 1000 == 1 {
            tracing::warn!(%peer, limit = self.limit, refused = self.count, "connection refused: {}", self.why);
        }
    }
}

/// The connections each client holds (by [`crate::auth::limiter::unit`]).
#[derive(Clone)]
struct PerClient {
    max: usize,
    held: Arc<std::sync::Mutex<std::collections::HashMap<std::net::IpAddr, usize>>>,
}

impl PerClient {
    fn new(max: usize) -> Self {
        Self {
            max,
            held: Arc::default(),
        }
    }

    /// A slot for a connection of `addr`'s client, none if it holds its share already.
    fn take(&self, addr: std::net::IpAddr) -> Option<ClientSlot> {
        let client = crate::auth::limiter::unit(addr);
        let mut held = self.held.lock().unwrap_or_else(|p| p.into_inner());
        let n = held.entry(client).or_default();
        if *n >= self.max {
            return None;
        }
        *n += 1;
        Some(ClientSlot {
            of: self.clone(),
            client,
        })
    }
}

/// One connection's place in its client's share, given back when dropped.
struct ClientSlot {
    of: PerClient,
    client: std::net::IpAddr,
}

impl Drop for ClientSlot {
    fn drop(&mut self) {
        let mut held = self.of.held.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(n) = held.get_mut(&self.client) {
            *n -= 1;
            if *n == 0 {
                held.remove(&self.client);
            }
        }
    }
}

/// A connection whose writes may not stall: once a write (or flush) cannot go on, the client
/// has `stall` to take some of it, or the connection fails (and hyper closes it). Any progress
/// starts the wait again, so a slow reader is served, and a client that reads nothing is not.
pub struct StallGuard<T> {
    inner: T,
    stall: Duration,
    waiting: Option<Pin<Box<Sleep>>>,
}

impl<T> StallGuard<T> {
    pub fn new(inner: T, stall: Duration) -> Self {
        Self {
            inner,
            stall,
            waiting: None,
        }
    }

    /// What a write that could not go on returns: pending, until the stall's deadline.
    fn stalled<R>(&mut self, cx: &mut Context<'_>) -> Poll<std::io::Result<R>> {
        let stall = self.stall;
        let deadline = self
            .waiting
            .get_or_insert_with(|| Box::pin(tokio::time::sleep(stall)));
        match deadline.as_mut().poll(cx) {
            Poll::Ready(()) => Poll::Ready(Err(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                format!("the client took nothing of its response for {stall:?}"),
            ))),
            Poll::Pending => Poll::Pending,
        }
    }

    fn went_on<R>(
        &mut self,
        done: Poll<std::io::Result<R>>,
        cx: &mut Context<'_>,
    ) -> Poll<std::io::Result<R>> {
        match done {
            Poll::Ready(r) => {
                self.waiting = None;
                Poll::Ready(r)
            }
            Poll::Pending => self.stalled(cx),
        }
    }
}

impl<T: tokio::io::AsyncRead + Unpin> tokio::io::AsyncRead for StallGuard<T> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_read(cx, buf)
    }
}

impl<T: tokio::io::AsyncWrite + Unpin> tokio::io::AsyncWrite for StallGuard<T> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        let this = self.get_mut();
        let done = Pin::new(&mut this.inner).poll_write(cx, buf);
        this.went_on(done, cx)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        let this = self.get_mut();
        let done = Pin::new(&mut this.inner).poll_write_vectored(cx, bufs);
        this.went_on(done, cx)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        let this = self.get_mut();
        let done = Pin::new(&mut this.inner).poll_flush(cx);
        this.went_on(done, cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_shutdown(cx)
    }
}

/// A request body with a deadline for the whole of it.
pub struct DeadlineBody {
    inner: Incoming,
    deadline: Pin<Box<Sleep>>,
    ended: bool,
}

impl DeadlineBody {
    pub fn new(inner: Incoming, within: Duration) -> Self {
        Self {
            inner,
            deadline: Box::pin(tokio::time::sleep(within)),
            ended: false,
        }
    }
}

/// The body did not arrive within its deadline.
#[derive(Debug, thiserror::Error)]
#[error("the request body did not arrive within its deadline")]
pub struct BodyDeadline;

impl hyper::body::Body for DeadlineBody {
    type Data = Bytes;
    type Error = axum::BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        let this = self.get_mut();
        if this.ended {
            return Poll::Ready(None);
        }
        if let Poll::Ready(frame) = Pin::new(&mut this.inner).poll_frame(cx) {
            this.ended = frame.is_none();
            return Poll::Ready(frame.map(|f| f.map_err(Into::into)));
        }
        match this.deadline.as_mut().poll(cx) {
            Poll::Ready(()) => {
                this.ended = true;
                Poll::Ready(Some(Err(Box::new(BodyDeadline))))
            }
            Poll::Pending => Poll::Pending,
        }
    }

    fn is_end_stream(&self) -> bool {
        self.ended || self.inner.is_end_stream()
    }

    fn size_hint(&self) -> hyper::body::SizeHint {
        self.inner.size_hint()
    }
}

/// Whether a body could not be read because it missed its deadline.
pub(crate) fn is_body_timeout(r: &BytesRejection) -> bool {
    let mut source: Option<&(dyn std::error::Error + 'static)> = Some(r);
    while let Some(e) = source {
        if e.is::<BodyDeadline>() {
            return true;
        }
        source = e.source();
    }
    false
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::SocketAddr;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    fn limits(max_connections: usize) -> HttpSettings {
        HttpSettings {
            header_timeout: Duration::from_millis(300),
            body_timeout: Duration::from_millis(300),
            write_timeout: Duration::from_millis(300),
            answer_timeout: Duration::from_millis(300),
            max_connections,
            max_connections_per_client: max_connections,
            client_address_header: None,
        }
    }

    async fn start(limits: HttpSettings) -> SocketAddr {
        let router = Router::new()
            .route(
                "/",
                axum::routing::post(|body: Result<Bytes, BytesRejection>| async move {
                    match body {
                        Ok(b) => (axum::http::StatusCode::OK, format!("{}", b.len())),
                        Err(r) if is_body_timeout(&r) => {
                            (axum::http::StatusCode::REQUEST_TIMEOUT, "late".into())
                        }
                        Err(_) => (axum::http::StatusCode::BAD_REQUEST, "broken".into()),
                    }
                }),
            )
            // A handler held for ever (a lock never granted).
            .route("/held", axum::routing::get(std::future::pending::<()>))
            // The request's `x-request-id` as the handler sees it.
            .route(
                "/id",
                axum::routing::get(|headers: axum::http::HeaderMap| async move {
                    headers
                        .get("x-request-id")
                        .and_then(|v| v.to_str().ok())
                        .unwrap_or("none")
                        .to_owned()
                }),
            )
            // An answer larger than what the sockets between us buffer.
            .route(
                "/large",
                axum::routing::get(|| async { vec![b'a'; 32 << 20] }),
            );
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(serve(listener, router, limits, std::future::pending()));
        addr
    }

    /// Reads what the server sends until it closes the connection (or 5 s pass).
    async fn until_closed(s: &mut tokio::net::TcpStream) -> (String, Duration) {
        let start = std::time::Instant::now();
        let mut out = Vec::new();
        let _ = tokio::time::timeout(Duration::from_secs(5), s.read_to_end(&mut out)).await;
        (String::from_utf8_lossy(&out).into_owned(), start.elapsed())
    }

    #[test]
    fn the_answer_timeout_covers_a_checkouts_own_deadline() {
        let settings = HttpSettings {
            answer_timeout: Duration::from_secs(60),
            body_timeout: Duration::from_secs(30),
            ..limits(1)
        };
        let with = |rpc_ms| {
            settings
                .clone()
                .covering(Duration::from_millis(rpc_ms))
                .answer_timeout
        };
        assert_eq!(with(5_000), Duration::from_secs(60));
        // The longest payment-link wait allowed, after a body that took all its time.
        assert_eq!(with(120_000), Duration::from_secs(170));
    }

    /// A handler that never answers (a lock a partitioned worker holds) is answered 503 in the
    /// one error shape at the answer timeout, and the connection serves the next request.
    /// The id the server gives a request is kept beside it: the request's own `x-request-id`,
    /// which a gateway may sign (Mercado Pago's, up to 256 bytes), reaches the handler as sent,
    /// however long, and a request without one gets none written in.
    #[tokio::test]
    async fn the_callers_request_id_header_reaches_the_handler_untouched() {
        let addr = start(limits(100)).await;
        let long = "a".repeat(200);
        for (sent, seen) in [(Some(long.as_str()), long.as_str()), (None, "none")] {
            let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
            let header = sent.map_or(String::new(), |v| format!("x-request-id: {v}\r\n"));
            s.write_all(
                format!("GET /id HTTP/1.1\r\nHost: x\r\n{header}Connection: close\r\n\r\n")
                    .as_bytes(),
            )
            .await
            .unwrap();
            let (answer, _) = until_closed(&mut s).await;
            assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
            assert!(answer.ends_with(seen), "{answer}");
        }
    }

    #[tokio::test]
    async fn a_handler_that_never_answers_is_answered_503_at_the_answer_timeout() {
        let addr = start(limits(100)).await;
        let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
        let started = std::time::Instant::now();
        s.write_all(b"GET /held HTTP/1.1\r\nHost: x\r\n\r\n")
            .await
            .unwrap();
        let mut answer = vec![0u8; 4096];
        let n = tokio::time::timeout(Duration::from_secs(5), s.read(&mut answer))
            .await
            .expect("answered")
            .unwrap();
        let answer = String::from_utf8_lossy(&answer[..n]).into_owned();
        assert!(answer.starts_with("HTTP/1.1 503"), "{answer}");
        assert!(answer.contains(r#""code":"answer_timeout""#), "{answer}");
        assert!(started.elapsed() < Duration::from_secs(3));
        // Its id, as every 5xx carries it: in the body and the header, one and the same.
        let id = answer
            .lines()
            .find_map(|l| l.strip_prefix("x-request-id: "))
            .expect("an x-request-id header")
            .trim()
            .to_owned();
        assert!(
            answer.contains(&format!(r#""request_id":"{id}""#)),
            "{answer}"
        );
        s.write_all(
            b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\nConnection: close\r\n\r\nab",
        )
        .await
        .unwrap();
        let (answer, _) = until_closed(&mut s).await;
        assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    }

    #[tokio::test]
    async fn half_a_request_head_is_cut_off_at_the_header_timeout() {
        let addr = start(limits(100)).await;
        let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
        s.write_all(b"POST / HTTP/1.1\r\nHost: x\r\n")
            .await
            .unwrap();
        let (_, took) = until_closed(&mut s).await;
        assert!(took < Duration::from_secs(3), "open for {took:?}");
        // An idle kept-alive connection too.
        let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
        s.write_all(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\nab")
            .await
            .unwrap();
        let (answer, took) = until_closed(&mut s).await;
        assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
        assert!(took < Duration::from_secs(3), "open for {took:?}");
    }

    #[tokio::test]
    async fn a_body_that_trickles_past_its_deadline_is_refused() {
        let addr = start(limits(100)).await;
        let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
        s.write_all(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n")
            .await
            .unwrap();
        for _ in 0..3 {
            s.write_all(b"a").await.unwrap();
            tokio::time::sleep(Duration::from_millis(150)).await;
        }
        let (answer, took) = until_closed(&mut s).await;
        assert!(answer.starts_with("HTTP/1.1 408"), "{answer}");
        assert!(took < Duration::from_secs(3));
    }

    #[tokio::test]
    async fn a_client_that_reads_nothing_of_its_answer_gives_its_connection_up() {
        let addr = start(limits(1)).await;
        // Asks for a large answer and reads nothing of it, through a small receive buffer.
        let socket = tokio::net::TcpSocket::new_v4().unwrap();
        socket.set_recv_buffer_size(4096).unwrap();
        let mut stalled = socket.connect(addr).await.unwrap();
        stalled
            .write_all(b"GET /large HTTP/1.1\r\nHost: x\r\n\r\n")
            .await
            .unwrap();
        tokio::time::sleep(Duration::from_millis(100)).await;
        // The only slot is held while the answer waits; once its wait has passed, the slot is
        // free for the next client.
        let started = std::time::Instant::now();
        let answer = loop {
            let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
            let _ = s
                .write_all(
                    b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\nConnection: close\r\n\r\n",
                )
                .await;
            let (answer, _) = until_closed(&mut s).await;
            if !answer.is_empty() || started.elapsed() > Duration::from_secs(4) {
                break answer;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        };
        assert!(answer.starts_with("HTTP/1.1 200"), "{answer:?}");
        assert!(
            started.elapsed() < Duration::from_secs(3),
            "{:?}",
            started.elapsed()
        );
        drop(stalled);
    }

    #[tokio::test]
    async fn connections_over_the_cap_are_closed_at_once() {
        let addr = start(limits(2)).await;
        let mut held = Vec::new();
        for _ in 0..2 {
            let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
            s.write_all(b"POST / HTTP/1.1\r\n").await.unwrap();
            held.push(s);
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
        let mut third = tokio::net::TcpStream::connect(addr).await.unwrap();
        let _ = third
            .write_all(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n")
            .await;
        let (answer, took) = until_closed(&mut third).await;
        assert_eq!(answer, "", "closed without an answer");
        assert!(took < Duration::from_millis(250), "{took:?}");
        // Once the held ones time out, a new connection is served.
        drop(held);
        tokio::time::sleep(Duration::from_millis(100)).await;
        let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
        s.write_all(
            b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\nConnection: close\r\n\r\n",
        )
        .await
        .unwrap();
        let (answer, _) = until_closed(&mut s).await;
        assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    }

    #[test]
    fn a_clients_share_defaults_to_no_more_than_the_whole_and_refuses_more() {
        let share = |s: Result<HttpSettings, _>| s.map(|s| s.max_connections_per_client);
        let small = HttpSettings::from_env(&[("PAYFLEET_MAX_CONNECTIONS", "100")]);
        assert_eq!(share(small).ok(), Some(100));
        let large = HttpSettings::from_env(&[("PAYFLEET_MAX_CONNECTIONS", "5000")]);
        assert_eq!(share(large).ok(), Some(256));
        for refused in ["0", "101"] {
            let e = HttpSettings::from_env(&[
                ("PAYFLEET_MAX_CONNECTIONS", "100"),
                ("PAYFLEET_MAX_CONNECTIONS_PER_CLIENT", refused),
            ])
            .unwrap_err();
            assert!(
                e.to_string()
                    .contains("PAYFLEET_MAX_CONNECTIONS_PER_CLIENT"),
                "{e}"
            );
        }
    }

    /// A connection from `from` (a loopback address of its own) asking for `/`: whether it was
    /// answered before it was closed.
    async fn answered_from(addr: SocketAddr, from: &str) -> bool {
        let socket = tokio::net::TcpSocket::new_v4().unwrap();
        socket.bind(format!("{from}:0").parse().unwrap()).unwrap();
        let mut s = socket.connect(addr).await.unwrap();
        let _ = s
            .write_all(
                b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\nConnection: close\r\n\r\n",
            )
            .await;
        until_closed(&mut s).await.0.starts_with("HTTP/1.1 200")
    }

    /// Two connections held open by one client (a host holding them, as one would hold them
    /// all): its next connection is closed at once, another client's is served; behind a
    /// proxy, where every connection is the proxy's, no client share applies.
    #[tokio::test]
    async fn one_client_holds_at_most_its_share_of_the_connections() {
        let mut settings = limits(100);
        settings.header_timeout = Duration::from_secs(5);
        settings.max_connections_per_client = 2;
        let addr = start(settings.clone()).await;
        let mut held = Vec::new();
        for _ in 0..2 {
            let socket = tokio::net::TcpSocket::new_v4().unwrap();
            socket.bind("127.0.0.7:0".parse().unwrap()).unwrap();
            let mut s = socket.connect(addr).await.unwrap();
            s.write_all(b"POST / HTTP/1.1\r\n").await.unwrap();
            held.push(s);
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(!answered_from(addr, "127.0.0.7").await, "over its share");
        assert!(answered_from(addr, "127.0.0.8").await, "another client");
        drop(held);
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert!(
            answered_from(addr, "127.0.0.7").await,
            "its share given back"
        );

        settings.client_address_header =
            Some(axum::http::HeaderName::from_static("x-forwarded-for"));
        let behind_proxy = start(settings).await;
        let mut held = Vec::new();
        for _ in 0..2 {
            let socket = tokio::net::TcpSocket::new_v4().unwrap();
            socket.bind("127.0.0.7:0".parse().unwrap()).unwrap();
            let mut s = socket.connect(behind_proxy).await.unwrap();
            s.write_all(b"POST / HTTP/1.1\r\n").await.unwrap();
            held.push(s);
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(
            answered_from(behind_proxy, "127.0.0.7").await,
            "the proxy's connections"
        );
    }
}

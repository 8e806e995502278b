//! Connections: the accept loop and the limits that keep hostile or careless clients from
//! holding the server (issue 30).
//!
//! - At most `max_connections` connections are served at once, and that many stay
//!   [`RESERVED_FILES`] below the process's open-file limit (raised at start-up to the hard
//!   limit where allowed, [`raise_open_file_limit`]), so the listener never runs out of file
//!   descriptors; a connection beyond the limit gets one `503` with `Retry-After: 1` and is
//!   closed, without reading its request.
//! - A request's headers must arrive within `header_timeout` of the connection opening or of
//!   the previous response on a keep-alive connection: so the same timer closes idle
//!   keep-alive connections (hyper's header-read timeout, which runs while a connection waits
//!   for a request head). Headers are at most [`MAX_HEADER_BYTES`] (431 beyond).
//! - A response write that makes no progress for `write_timeout` (a client that stopped
//!   reading) ends the connection ([`StallTimeout`]).
//! - The request body's own deadline (`body_timeout`) and size are checked where it is read,
//!   in `server.rs`.
//!
//! Shutdown: [`Connections::shutdown`] tells every connection to finish the request in flight
//! and close (idle ones close at once); [`Connections::closed`] resolves when none is left.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::Router;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{watch, OwnedSemaphorePermit, Semaphore};

use crate::metrics::Metrics;

/// File descriptors kept free below the open-file limit for everything that is not a served
/// connection: the listener, the model files, the runtime, and the short-lived connections
/// being refused (at most [`REFUSING_AT_ONCE`]).
pub const RESERVED_FILES: u64 = 96;

/// Refused connections that may be waiting at once for their 503 to be written and their
/// request drained (each at most 2 s); beyond it an over-limit connection is closed at once.
pub const REFUSING_AT_ONCE: usize = 32;

/// Largest request head (request line and headers): hyper's read buffer. Beyond it hyper
/// answers 431.
pub const MAX_HEADER_BYTES: usize = 64 * 1024;

/// Largest `max_connections` accepted (the wait for every connection to close counts permits
/// in a `u32`).
pub const MAX_CONNECTIONS: usize = 1 << 20;

/// The connection limits of a running server.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ConnectionLimits {
    /// Connections served at once (already below the open-file limit).
    pub max_connections: usize,
    /// Time to receive a request's headers, and the longest a keep-alive connection stays idle.
    pub header_timeout: Duration,
    /// Longest a response write may make no progress.
    pub write_timeout: Duration,
}

/// Raises the soft `RLIMIT_NOFILE` to the hard limit (at most 2^20, Linux's default
/// `fs.nr_open`) where the process may, and returns the soft limit in force afterwards
/// (`None` where it cannot be read).
#[cfg(unix)]
pub fn raise_open_file_limit() -> Option<u64> {
    let read = || {
        let mut limit = libc::rlimit {
            rlim_cur: 0,
            rlim_max: 0,
        };
        // SAFETY: getrlimit writes one rlimit struct, which `limit` is.
        let rc = unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) };
        (rc == 0).then_some(limit)
    };
    let limit = read()?;
    let target = limit.rlim_max.min(1 << 20);
    if limit.rlim_cur < target {
        let raised = libc::rlimit {
            rlim_cur: target,
            rlim_max: limit.rlim_max,
        };
        // SAFETY: setrlimit reads one rlimit struct; failure leaves the limit as it was.
        let _ = unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &raised) };
    }
    read().map(|l| l.rlim_cur)
}

#[cfg(not(unix))]
pub fn raise_open_file_limit() -> Option<u64> {
    None
}

/// The connection limit the server uses: `requested`, lowered to [`RESERVED_FILES`] below the
/// open-file limit `open_files` (when known). An error when that limit leaves no room.
pub fn connection_cap(requested: usize, open_files: Option<u64>) -> Result<usize, String> {
    if requested == 0 {
        return Err("--max-connections must be at least 1".into());
    }
    if requested > MAX_CONNECTIONS {
        return Err(format!(
            "--max-connections {requested} is above the largest accepted, {MAX_CONNECTIONS}"
        ));
    }
    let Some(files) = open_files else {
        return Ok(requested);
    };
    let room = files.saturating_sub(RESERVED_FILES);
    if room == 0 {
        return Err(format!(
            "the open-file limit ({files}) leaves no room for connections: the server keeps \
             {RESERVED_FILES} descriptors for itself; raise it (ulimit -n)"
        ));
    }
    Ok(requested.min(usize::try_from(room).unwrap_or(usize::MAX)))
}

/// The live connections of one server.
pub struct Connections {
    limits: ConnectionLimits,
    permits: Arc<Semaphore>,
    refusing: Arc<Semaphore>,
    stop: watch::Sender<bool>,
    metrics: Arc<Metrics>,
}

impl Connections {
    pub fn new(limits: ConnectionLimits, metrics: Arc<Metrics>) -> Self {
        let max = limits.max_connections.clamp(1, MAX_CONNECTIONS);
        Self {
            limits: ConnectionLimits {
                max_connections: max,
                ..limits
            },
            permits: Arc::new(Semaphore::new(max)),
            refusing: Arc::new(Semaphore::new(REFUSING_AT_ONCE)),
            stop: watch::channel(false).0,
            metrics,
        }
    }

    /// Accepts connections until dropped (the caller selects it against its shutdown).
    pub async fn accept_loop(&self, listener: &TcpListener, app: &Router) {
        loop {
            let stream = match listener.accept().await {
                Ok((stream, _)) => stream,
                Err(e) => {
                    // Out of descriptors (EMFILE/ENFILE) or a connection reset before accept:
                    // wait a little rather than spin; the ones in flight free descriptors.
                    if !matches!(
                        e.kind(),
                        io::ErrorKind::ConnectionAborted | io::ErrorKind::ConnectionReset
                    ) {
                        tokio::time::sleep(Duration::from_millis(50)).await;
                    }
                    continue;
                }
            };
            match self.permits.clone().try_acquire_owned() {
                Ok(permit) => {
                    self.metrics
                        .connections_open
                        .fetch_add(1, Ordering::Relaxed);
                    tokio::spawn(serve_connection(
                        stream,
                        app.clone(),
                        self.limits,
                        self.stop.subscribe(),
                        self.metrics.clone(),
                        permit,
                    ));
                }
                Err(_) => {
                    self.metrics
                        .connections_rejected
                        .fetch_add(1, Ordering::Relaxed);
                    let response = over_limit_response(self.limits.max_connections);
                    match self.refusing.clone().try_acquire_owned() {
                        Ok(permit) => {
                            tokio::spawn(refuse(stream, response, permit));
                        }
                        Err(_) => {
                            // Too many being refused already: best effort, then close.
                            let _ = stream.try_write(response.as_bytes());
                        }
                    }
                }
            }
        }
    }

    /// Asks every connection to finish its request in flight and close.
    pub fn shutdown(&self) {
        self.stop.send_replace(true);
    }

    /// Resolves when no connection is open.
    pub async fn closed(&self) {
        let all = u32::try_from(self.limits.max_connections).unwrap_or(u32::MAX);
        if let Ok(permits) = self.permits.acquire_many(all).await {
            drop(permits);
        }
    }

    pub fn limits(&self) -> ConnectionLimits {
        self.limits
    }
}

/// The 503 a connection over the limit gets, in OpenAI's error shape.
fn over_limit_response(max: usize) -> String {
    let body = serde_json::json!({
        "error": {
            "message": format!(
                "the server is serving its limit of {max} connections; retry shortly"
            ),
            "type": "server_error",
            "param": null,
            "code": "server_overloaded",
        }
    })
    .to_string();
    format!(
        "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nretry-after: \
         1\r\nconnection: close\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    )
}

/// Writes the 503, then reads and discards what the client sends for up to 2 s so that closing
/// does not reset the connection before the client has read the answer.
async fn refuse(mut stream: TcpStream, response: String, permit: OwnedSemaphorePermit) {
    let _ = tokio::time::timeout(Duration::from_secs(2), async {
        if stream.write_all(response.as_bytes()).await.is_err() {
            return;
        }
        let _ = stream.shutdown().await;
        let mut sink = [0u8; 4096];
        let mut left = 1 << 20;
        while left > 0 {
            match stream.read(&mut sink).await {
                Ok(0) | Err(_) => break,
                Ok(n) => left -= n.min(left),
            }
        }
    })
    .await;
    drop(permit);
}

async fn serve_connection(
    stream: TcpStream,
    app: Router,
    limits: ConnectionLimits,
    mut stop: watch::Receiver<bool>,
    metrics: Arc<Metrics>,
    permit: OwnedSemaphorePermit,
) {
    let _ = stream.set_nodelay(true);
    let io = TokioIo::new(StallTimeout::new(stream, limits.write_timeout));
    let mut builder = hyper::server::conn::http1::Builder::new();
    builder
        .timer(TokioTimer::new())
        .header_read_timeout(limits.header_timeout)
        .max_buf_size(MAX_HEADER_BYTES)
        .keep_alive(true);
    let conn = builder.serve_connection(io, TowerToHyperService::new(app));
    tokio::pin!(conn);
    let stopping = async move {
        // Drops the watch guard before resolving (it must not live across an await).
        let _ = stop.wait_for(|stopping| *stopping).await.map(|_| ());
    };
    let result = tokio::select! {
        result = conn.as_mut() => result,
        () = stopping => {
            conn.as_mut().graceful_shutdown();
            conn.await
        }
    };
    if let Err(e) = result {
        let timed_out = e.is_timeout()
            || std::error::Error::source(&e)
                .and_then(|s| s.downcast_ref::<io::Error>())
                .is_some_and(|io| io.kind() == io::ErrorKind::TimedOut);
        if timed_out {
            metrics.timeouts.fetch_add(1, Ordering::Relaxed);
        }
    }
    metrics.connections_open.fetch_sub(1, Ordering::Relaxed);
    drop(permit);
}

/// A TCP stream whose writes fail with `TimedOut` once one has made no progress for `limit`
/// (a client that stopped reading its response).
pub struct StallTimeout {
    inner: TcpStream,
    limit: Duration,
    stalled: Option<Pin<Box<tokio::time::Sleep>>>,
}

impl StallTimeout {
    pub fn new(inner: TcpStream, limit: Duration) -> Self {
        Self {
            inner,
            limit,
            stalled: None,
        }
    }

    /// Called when a write is pending: starts the stall timer, or fails once it has run out.
    fn poll_stall<T>(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<T>> {
        let limit = self.limit;
        let sleep = self
            .stalled
            .get_or_insert_with(|| Box::pin(tokio::time::sleep(limit)));
        match sleep.as_mut().poll(cx) {
            Poll::Ready(()) => Poll::Ready(Err(io::Error::new(
                io::ErrorKind::TimedOut,
                format!("the client read nothing for {limit:?}"),
            ))),
            Poll::Pending => Poll::Pending,
        }
    }

    fn progress<T>(
        &mut self,
        poll: Poll<io::Result<T>>,
        cx: &mut Context<'_>,
    ) -> Poll<io::Result<T>> {
        match poll {
            Poll::Ready(result) => {
                self.stalled = None;
                Poll::Ready(result)
            }
            Poll::Pending => self.poll_stall(cx),
        }
    }
}

impl AsyncRead for StallTimeout {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl AsyncWrite for StallTimeout {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let poll = Pin::new(&mut self.inner).poll_write(cx, buf);
        self.progress(poll, cx)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let poll = Pin::new(&mut self.inner).poll_write_vectored(cx, bufs);
        self.progress(poll, cx)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let poll = Pin::new(&mut self.inner).poll_flush(cx);
        self.progress(poll, cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let poll = Pin::new(&mut self.inner).poll_shutdown(cx);
        self.progress(poll, cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_cap_stays_below_the_file_limit() {
        assert_eq!(connection_cap(512, None), Ok(512));
        assert_eq!(
            connection_cap(512, Some(256)),
            Ok(256 - RESERVED_FILES as usize)
        );
        assert_eq!(connection_cap(100, Some(1 << 20)), Ok(100));
        assert!(connection_cap(0, Some(1024)).is_err());
        assert!(connection_cap(MAX_CONNECTIONS + 1, None).is_err());
        let err = connection_cap(10, Some(RESERVED_FILES)).unwrap_err();
        assert!(err.contains("open-file limit"), "{err}");
    }

    #[test]
    fn the_soft_file_limit_is_raised_not_lowered() {
        let read = || {
            let mut limit = libc::rlimit {
                rlim_cur: 0,
                rlim_max: 0,
            };
            // SAFETY: one rlimit struct.
            assert_eq!(
                unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) },
                0
            );
            limit
        };
        let before = read();
        let Some(after) = raise_open_file_limit() else {
            panic!("RLIMIT_NOFILE unreadable");
        };
        let now = read();
        assert_eq!(after, now.rlim_cur);
        assert!(now.rlim_cur >= before.rlim_cur && now.rlim_cur <= now.rlim_max);
    }
}

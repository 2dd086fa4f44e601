//! The HTTP server: connections accepted from a listener and served with time limits, so
//! that a client that opens connections and sends nothing, part of a request head or part
//! of a body, or that does not read its answers, cannot hold them (and the process's file
//! descriptors) for good.

use std::future::Future;
use std::io;
use std::pin::{pin, Pin};
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::StatusCode;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::Router;
use fluxgate_core::api::ApiError;
use http_body_util::{BodyExt, LengthLimitError, Limited};
use hyper::server::conn::http1;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio::time::Sleep;

use crate::app::Failure;

/// The time limits of the server's connections.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Timeouts {
    /// The longest a connection may take to send a request head, counted from when the
    /// server is ready to read one: from the connection's start, or from the previous
    /// answer on a kept-alive connection (which is closed when idle that long).
    pub(crate) header: Duration,
    /// The longest a request's body may take to arrive, counted from its head.
    pub(crate) body: Duration,
    /// The longest a write of an answer may wait for the client to read, counted from
    /// when the socket stopped taking bytes; past it, the connection is closed.
    pub(crate) write: Duration,
}

/// What the body middleware needs.
#[derive(Debug, Clone, Copy)]
struct BodyLimits {
    timeout: Duration,
    max_bytes: usize,
}

/// Reads the whole body within its time limit before the handlers see it: a body that
/// does not arrive in time is answered `408`, one larger than the limit `413`.
async fn read_body(State(limits): State<BodyLimits>, request: Request, next: Next) -> Response {
    let (parts, body) = request.into_parts();
    let read = Limited::new(body, limits.max_bytes).collect();
    let bytes = match tokio::time::timeout(limits.timeout, read).await {
        Ok(Ok(collected)) => collected.to_bytes(),
        Ok(Err(error)) if error.is::<LengthLimitError>() => {
            return StatusCode::PAYLOAD_TOO_LARGE.into_response();
        }
        Ok(Err(error)) => {
            let error = ApiError::general(format!("the body could not be read: {error}"));
            return Failure::new(StatusCode::BAD_REQUEST, error).into_response();
        }
        Err(_) => {
            let error = ApiError::general(format!("the body did not arrive within {:?}", limits.timeout));
            return Failure::new(StatusCode::REQUEST_TIMEOUT, error).into_response();
        }
    };
    next.run(Request::from_parts(parts, Body::from(bytes))).await
}

/// Serves `app` on `listener` until `shutdown` completes, each connection within
/// `timeouts`; then stops accepting and lets the requests in flight finish.
pub(crate) async fn serve(
    listener: tokio::net::TcpListener,
    app: Router,
    max_body_bytes: usize,
    timeouts: Timeouts,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let limits = BodyLimits {
        timeout: timeouts.body,
        max_bytes: max_body_bytes,
    };
    let app = app.layer(axum::middleware::from_fn_with_state(limits, read_body));
    let graceful = GracefulShutdown::new();
    let mut shutdown = pin!(shutdown);
    // Whether the last `accept` failed: a run of failures is logged once.
    let mut failing = false;
    loop {
        let stream = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => {
                    failing = false;
                    stream
                }
                Err(error) => {
                    accept_failed(&error, &mut failing).await;
                    continue;
                }
            },
            () = &mut shutdown => break,
        };
        let _ = stream.set_nodelay(true);
        let mut builder = http1::Builder::new();
        builder.timer(TokioTimer::new()).header_read_timeout(timeouts.header);
        let stream = WriteTimeout::new(stream, timeouts.write);
        let connection = builder.serve_connection(TokioIo::new(stream), TowerToHyperService::new(app.clone()));
        let connection = graceful.watch(connection);
        tokio::spawn(async move {
            if let Err(error) = connection.await {
                tracing::trace!(%error, "connection ended");
            }
        });
    }
    drop(listener);
    graceful.shutdown().await;
    Ok(())
}

/// After a failed `accept`: a connection that failed before it was accepted is the
/// client's business; anything else (out of file descriptors) is waited out a little,
/// rather than retried in a busy loop, and logged once for a run of such failures.
async fn accept_failed(error: &std::io::Error, failing: &mut bool) {
    use std::io::ErrorKind;
    if matches!(
        error.kind(),
        ErrorKind::ConnectionRefused | ErrorKind::ConnectionAborted | ErrorKind::ConnectionReset
    ) {
        return;
    }
    if *failing {
        tracing::debug!(%error, "accepting a connection failed again");
    } else {
        tracing::warn!(%error, "accepting connections fails; trying again every 100 ms");
        *failing = true;
    }
    tokio::time::sleep(Duration::from_millis(100)).await;
}

/// A connection's socket whose writes fail with [`io::ErrorKind::TimedOut`] once the socket
/// has taken no byte for `timeout`: the time runs while a write waits and starts again at
/// each byte taken. hyper has no such limit: a client that sent whole requests (several,
/// pipelined) and then read nothing held its connection for good, the server waiting to
/// write an answer with no request head to time (as many such clients as the process's file
/// descriptors, 64 under `prlimit --nofile=64`, and a gateway's checks timed out for as long
/// as they stayed, decided by its failure policy). A client that reads, however slowly, is
/// not cut off.
struct WriteTimeout {
    stream: TcpStream,
    timeout: Duration,
    /// Armed while a write waits.
    waiting: Option<Pin<Box<Sleep>>>,
}

impl WriteTimeout {
    fn new(stream: TcpStream, timeout: Duration) -> Self {
        Self {
            stream,
            timeout,
            waiting: None,
        }
    }

    /// What a write (or flush, or shutdown) gave: ready, the timer disarmed; pending, the
    /// timer armed if it was not, and past it an error.
    fn timed<T>(&mut self, cx: &mut Context<'_>, polled: Poll<io::Result<T>>) -> Poll<io::Result<T>> {
        if polled.is_ready() {
            self.waiting = None;
            return polled;
        }
        let timeout = self.timeout;
        let waiting = self
            .waiting
            .get_or_insert_with(|| Box::pin(tokio::time::sleep(timeout)));
        match waiting.as_mut().poll(cx) {
            Poll::Ready(()) => {
                self.waiting = None;
                Poll::Ready(Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    format!("the client read nothing for {timeout:?}"),
                )))
            }
            Poll::Pending => Poll::Pending,
        }
    }
}

impl AsyncRead for WriteTimeout {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_read(cx, buf)
    }
}

impl AsyncWrite for WriteTimeout {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        let polled = Pin::new(&mut self.stream).poll_write(cx, buf);
        self.timed(cx, polled)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let polled = Pin::new(&mut self.stream).poll_write_vectored(cx, bufs);
        self.timed(cx, polled)
    }

    fn is_write_vectored(&self) -> bool {
        self.stream.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let polled = Pin::new(&mut self.stream).poll_flush(cx);
        self.timed(cx, polled)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let polled = Pin::new(&mut self.stream).poll_shutdown(cx);
        self.timed(cx, polled)
    }
}

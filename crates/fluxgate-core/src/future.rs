//! [`MaybeReady`]: a future that is either already complete or a boxed async step.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

/// A boxed, sendable future.
pub type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send + 'static>>;

/// A future that is either complete already (no allocation) or a boxed future.
///
/// The in-memory limiter and the static rule provider answer synchronously; the Redis
/// backend and remote rule sources need a real future. Every asynchronous trait of this
/// crate returns `MaybeReady` so that the synchronous path costs nothing while the traits
/// stay object safe.
///
/// ```
/// use fluxgate_core::MaybeReady;
/// let ready = MaybeReady::ready(2).map(|n| n * 21);
/// assert_eq!(ready.into_ready().ok(), Some(42));
/// ```
#[must_use = "futures do nothing unless polled"]
pub struct MaybeReady<T> {
    inner: Inner<T>,
}

enum Inner<T> {
    Ready(Option<T>),
    Boxed(BoxFuture<T>),
}

// `T` is only ever moved out of the `Option`, never pinned.
impl<T> Unpin for MaybeReady<T> {}

impl<T: Send + 'static> MaybeReady<T> {
    /// A future that is complete already.
    pub fn ready(value: T) -> Self {
        Self {
            inner: Inner::Ready(Some(value)),
        }
    }

    /// Boxes an asynchronous computation.
    pub fn boxed(future: impl Future<Output = T> + Send + 'static) -> Self {
        Self {
            inner: Inner::Boxed(Box::pin(future)),
        }
    }

    /// The value if the future is complete already, or the future itself.
    ///
    /// # Panics
    ///
    /// Panics if a ready future was already polled to completion.
    pub fn into_ready(self) -> Result<T, Self> {
        match self.inner {
            Inner::Ready(Some(value)) => Ok(value),
            Inner::Ready(None) => panic!("MaybeReady polled after completion"),
            inner @ Inner::Boxed(_) => Err(Self { inner }),
        }
    }

    /// Maps the output, without boxing when the value is ready.
    pub fn map<U: Send + 'static>(self, f: impl FnOnce(T) -> U + Send + 'static) -> MaybeReady<U> {
        match self.into_ready() {
            Ok(value) => MaybeReady::ready(f(value)),
            Err(pending) => MaybeReady::boxed(async move { f(pending.await) }),
        }
    }

    /// Chains another `MaybeReady` step, without boxing when both are ready.
    pub fn and_then<U: Send + 'static>(self, f: impl FnOnce(T) -> MaybeReady<U> + Send + 'static) -> MaybeReady<U> {
        match self.into_ready() {
            Ok(value) => f(value),
            Err(pending) => MaybeReady::boxed(async move { f(pending.await).await }),
        }
    }
}

impl<T> Future for MaybeReady<T> {
    type Output = T;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<T> {
        match &mut self.inner {
            Inner::Ready(value) => Poll::Ready(value.take().expect("MaybeReady polled after completion")),
            Inner::Boxed(future) => future.as_mut().poll(cx),
        }
    }
}

impl<T> fmt::Debug for MaybeReady<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.inner {
            Inner::Ready(_) => f.write_str("MaybeReady::Ready"),
            Inner::Boxed(_) => f.write_str("MaybeReady::Boxed"),
        }
    }
}

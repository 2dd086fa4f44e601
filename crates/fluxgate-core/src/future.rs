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

/// A backend's answer that is settled whether or not its caller is still there: awaited, it
/// answers with `state` and the output; dropped once polled (its call may be out), it runs
/// to its end on the runtime and `abandoned` settles `state` with the output; dropped
/// before (nothing went out) or without a runtime, `abandoned` settles `state` with `None`.
///
/// What a request takes with its call (owed permits, a waiting place, a circuit's probe)
/// is given back, or kept, by what the backend answered, not by whether the client waited
/// for the answer.
pub(crate) struct Settled<T: Send + 'static, S: Send + 'static> {
    future: Option<MaybeReady<T>>,
    state: Option<S>,
    started: bool,
    abandoned: fn(S, Option<T>),
}

impl<T: Send + 'static, S: Send + 'static> Settled<T, S> {
    pub(crate) fn new(future: MaybeReady<T>, state: S, abandoned: fn(S, Option<T>)) -> Self {
        Self {
            future: Some(future),
            state: Some(state),
            started: false,
            abandoned,
        }
    }
}

// Nothing of it is ever pinned: `MaybeReady` is `Unpin`, `S` only moved.
impl<T: Send + 'static, S: Send + 'static> Unpin for Settled<T, S> {}

impl<T: Send + 'static, S: Send + 'static> Future for Settled<T, S> {
    type Output = (S, T);

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<(S, T)> {
        let this = &mut *self;
        this.started = true;
        let future = this.future.as_mut().expect("Settled polled after completion");
        let output = std::task::ready!(Pin::new(future).poll(cx));
        this.future = None;
        let state = this.state.take().expect("Settled polled after completion");
        Poll::Ready((state, output))
    }
}

impl<T: Send + 'static, S: Send + 'static> Drop for Settled<T, S> {
    fn drop(&mut self) {
        let (Some(future), Some(state)) = (self.future.take(), self.state.take()) else {
            return;
        };
        let abandoned = self.abandoned;
        if !self.started {
            return abandoned(state, None);
        }
        match tokio::runtime::Handle::try_current() {
            Ok(runtime) => {
                runtime.spawn(async move {
                    let output = future.await;
                    abandoned(state, Some(output));
                });
            }
            Err(_) => abandoned(state, None),
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

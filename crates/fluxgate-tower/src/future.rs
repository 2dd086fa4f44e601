//! [`ResponseFuture`].

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{ready, Context, Poll};

use bytes::Bytes;
use fluxgate_core::{Decision, Error, MaybeReady};
use http::{Request, Response};
use pin_project_lite::pin_project;
use tower_service::Service;

use crate::config::Config;
use crate::config::Verdict;
use crate::response::Figures;

pin_project! {
    /// The response future of [`RateLimit`](crate::RateLimit): waits for the decision
    /// (when the backend is asynchronous), then calls the inner service or answers `429`.
    pub struct ResponseFuture<S, ReqBody>
    where
        S: Service<Request<ReqBody>>,
    {
        #[pin]
        state: State<S, ReqBody>,
    }
}

pin_project! {
    #[project = StateProj]
    enum State<S, ReqBody>
    where
        S: Service<Request<ReqBody>>,
    {
        Checking {
            checking: Box<Checking<S, ReqBody>>,
        },
        Calling {
            #[pin]
            future: S::Future,
            figures: Option<Figures>,
        },
        Rejected {
            response: Option<Box<Response<Bytes>>>,
        },
    }
}

/// The state while an asynchronous handler decides (boxed: the synchronous path, the
/// common one, keeps the future small), then while the inner service is polled ready.
pub(crate) struct Checking<S, ReqBody> {
    check: MaybeReady<Result<Decision, Error>>,
    /// The headers of an admitted request, once it is admitted.
    admitted: Option<Option<Figures>>,
    /// A clone of the inner service, not polled ready yet.
    inner: Option<S>,
    req: Option<Request<ReqBody>>,
    config: Arc<Config>,
    /// Whether the request's rule set is the layer's own (see `Config::own_rule_set`).
    own_rule_set: bool,
}

impl<S, ReqBody> ResponseFuture<S, ReqBody>
where
    S: Service<Request<ReqBody>>,
{
    /// Calls the inner service and adds these headers (if any) to its response.
    pub(crate) fn calling(future: S::Future, figures: Option<Figures>) -> Self {
        Self {
            state: State::Calling { future, figures },
        }
    }

    pub(crate) fn rejected(response: Response<Bytes>) -> Self {
        Self {
            state: State::Rejected {
                response: Some(Box::new(response)),
            },
        }
    }

    pub(crate) fn checking(
        check: MaybeReady<Result<Decision, Error>>,
        inner: S,
        req: Request<ReqBody>,
        config: Arc<Config>,
        own_rule_set: bool,
    ) -> Self {
        Self {
            state: State::Checking {
                checking: Box::new(Checking {
                    check,
                    admitted: None,
                    inner: Some(inner),
                    req: Some(req),
                    config,
                    own_rule_set,
                }),
            },
        }
    }
}

impl<S, ReqBody, ResBody> Future for ResponseFuture<S, ReqBody>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>>,
    ResBody: From<Bytes>,
{
    type Output = Result<Response<ResBody>, S::Error>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        loop {
            let mut this = self.as_mut().project();
            let next = match this.state.as_mut().project() {
                StateProj::Checking { checking } => {
                    if checking.admitted.is_none() {
                        let result = ready!(Pin::new(&mut checking.check).poll(cx));
                        match checking.config.verdict(result, checking.own_rule_set) {
                            Verdict::Pass(figures) => checking.admitted = Some(figures),
                            Verdict::Reject(response) => {
                                this.state.set(State::Rejected {
                                    response: Some(Box::new(response)),
                                });
                                continue;
                            }
                        }
                    }
                    // Admitted: the service is called once it is ready.
                    let inner = checking.inner.as_mut().expect("ResponseFuture polled after completion");
                    ready!(inner.poll_ready(cx))?;
                    let (Some(mut inner), Some(req), Some(figures)) =
                        (checking.inner.take(), checking.req.take(), checking.admitted.take())
                    else {
                        unreachable!("ResponseFuture polled after completion")
                    };
                    State::Calling {
                        future: inner.call(req),
                        figures,
                    }
                }
                StateProj::Calling { future, figures } => {
                    let mut response = ready!(future.poll(cx))?;
                    if let Some(figures) = figures.take() {
                        // A refusal from further in (another rate limiter's `429`) keeps
                        // the figures that explain it: ours, of rules that admitted the
                        // request, would tell its client that it may go on.
                        let refused = response.status() == http::StatusCode::TOO_MANY_REQUESTS;
                        figures.apply(response.headers_mut(), refused);
                    }
                    return Poll::Ready(Ok(response));
                }
                StateProj::Rejected { response } => {
                    let response = response.take().expect("ResponseFuture polled after completion");
                    return Poll::Ready(Ok((*response).map(ResBody::from)));
                }
            };
            this.state.set(next);
        }
    }
}

impl<S, ReqBody> std::fmt::Debug for ResponseFuture<S, ReqBody>
where
    S: Service<Request<ReqBody>>,
{
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ResponseFuture").finish_non_exhaustive()
    }
}

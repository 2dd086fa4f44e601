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

use crate::body::ResponseBody;
use crate::layer::Config;
use crate::service::Verdict;

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
            check: MaybeReady<Result<Decision, Error>>,
            inner: Option<S>,
            req: Option<Request<ReqBody>>,
            config: Arc<Config>,
        },
        Calling {
            #[pin]
            future: S::Future,
            decision: Option<Decision>,
            config: Option<Arc<Config>>,
        },
        Rejected {
            response: Option<Response<Bytes>>,
        },
    }
}

impl<S, ReqBody> ResponseFuture<S, ReqBody>
where
    S: Service<Request<ReqBody>>,
{
    /// Calls the inner service and adds nothing to its response.
    pub(crate) fn calling(future: S::Future) -> Self {
        Self {
            state: State::Calling {
                future,
                decision: None,
                config: None,
            },
        }
    }

    /// Calls the inner service and adds the decision's headers to its response.
    pub(crate) fn calling_with(future: S::Future, decision: Option<Decision>, config: &Arc<Config>) -> Self {
        let config = decision.as_ref().map(|_| config.clone());
        Self {
            state: State::Calling {
                future,
                decision,
                config,
            },
        }
    }

    pub(crate) fn rejected(response: Response<Bytes>) -> Self {
        Self {
            state: State::Rejected {
                response: Some(response),
            },
        }
    }

    pub(crate) fn checking(
        check: MaybeReady<Result<Decision, Error>>,
        inner: S,
        req: Request<ReqBody>,
        config: Arc<Config>,
    ) -> Self {
        Self {
            state: State::Checking {
                check,
                inner: Some(inner),
                req: Some(req),
                config,
            },
        }
    }
}

impl<S, ReqBody, ResBody> Future for ResponseFuture<S, ReqBody>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>>,
{
    type Output = Result<Response<ResponseBody<ResBody>>, S::Error>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        loop {
            let mut this = self.as_mut().project();
            let next = match this.state.as_mut().project() {
                StateProj::Checking {
                    check,
                    inner,
                    req,
                    config,
                } => {
                    let result = ready!(Pin::new(check).poll(cx));
                    match config.verdict(result) {
                        Verdict::Pass(decision) => {
                            let (Some(mut inner), Some(req)) = (inner.take(), req.take()) else {
                                unreachable!("ResponseFuture polled after completion")
                            };
                            State::Calling {
                                future: inner.call(req),
                                decision,
                                config: Some(config.clone()),
                            }
                        }
                        Verdict::Reject(response) => State::Rejected {
                            response: Some(response),
                        },
                    }
                }
                StateProj::Calling {
                    future,
                    decision,
                    config,
                } => {
                    let mut response = ready!(future.poll(cx))?;
                    if let (Some(decision), Some(config)) = (decision.take(), config.as_ref()) {
                        crate::response::apply_headers(config, &decision, response.headers_mut(), false);
                    }
                    return Poll::Ready(Ok(response.map(ResponseBody::inner)));
                }
                StateProj::Rejected { response } => {
                    let response = response.take().expect("ResponseFuture polled after completion");
                    return Poll::Ready(Ok(response.map(ResponseBody::full)));
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

//! The request context: what the engine knows about a request.

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::sync::Arc;
use std::time::Duration;

use http::Method;

use crate::name::Name;
use crate::path::normalized_and_routed;
use crate::text::Text;

/// The rule set id used when nothing else is configured.
pub const DEFAULT_RULE_SET: &str = "default";

/// The user id or API key of a request that names several different ones, such as a
/// header sent more than once with different values: `\0` alone, which no single value
/// gives (the layer writes `\0` only before the bytes of a value that is not UTF-8).
///
/// Neither value can be trusted to be the one the application reads (an application reads
/// the first instance of a header, a proxy that appends writes the last), so an enforced
/// rule whose key reads such a field refuses the request ([`Error::Refused`]; the layer
/// answers `400`) rather than counting it under either value, or under a counter such
/// requests would share. A shadow rule counts it under that shared counter.
///
/// The engine knows it by this value alone: a customizer that rewrites the user id or API
/// key the layer read (`format!("acme:{id}")`), or copies it into an attribute, should
/// pass this value on unchanged (or refuse the request itself), since `acme:\0` is a value
/// like any other, one counter that all such requests would share.
///
/// [`Error::Refused`]: crate::Error::Refused
pub const AMBIGUOUS_IDENTITY: &str = "\0";

/// What the engine knows about one request. Immutable once built; build it with
/// [`RequestContext::builder`].
///
/// ```
/// use fluxgate_core::RequestContext;
/// let ctx = RequestContext::builder()
///     .path("/api//users/./7")
///     .method(http::Method::POST)
///     .client_ip("203.0.113.9".parse().unwrap())
///     .user_id("alice")
///     .attribute("tenant", "acme")
///     .build();
/// assert_eq!(ctx.path(), "/api/users/7");
/// assert_eq!(ctx.attribute("tenant"), Some("acme"));
/// assert_eq!(ctx.rule_set_id(), "default");
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RequestContext {
    path: Text,
    /// The path as given, when it differs from the normalized one.
    routed: Option<Text>,
    method: Method,
    client_ip: Option<IpAddr>,
    user_id: Option<String>,
    api_key: Option<String>,
    rule_set_id: Name,
    attributes: BTreeMap<String, String>,
    /// The longest the caller waits for the decision, when it says.
    max_wait: Option<Duration>,
}

impl RequestContext {
    /// A builder with the path `/`, method `GET` and the rule set `default`.
    pub fn builder() -> RequestContextBuilder {
        RequestContextBuilder::default()
    }

    /// The normalized path.
    pub fn path(&self) -> &str {
        &self.path
    }
    /// The path as a router sees it: the raw path given to
    /// [`RequestContextBuilder::path`], without its query. Rules match it as well as the
    /// normalized path (see [`routed_segments`](crate::path::routed_segments)).
    ///
    /// ```
    /// use fluxgate_core::RequestContext;
    /// let ctx = RequestContext::builder().path("/api/../login?x=1").build();
    /// assert_eq!(ctx.path(), "/login");
    /// assert_eq!(ctx.routed_path(), "/api/../login");
    /// ```
    pub fn routed_path(&self) -> &str {
        self.routed.as_deref().unwrap_or(&self.path)
    }
    /// The length in bytes of the longer of the normalized and the routed path, read
    /// without the UTF-8 check that borrowing either as a `str` makes.
    pub(crate) fn longest_path_len(&self) -> usize {
        self.path.len().max(self.routed.as_ref().map_or(0, Text::len))
    }
    /// The routed path, when it differs from the normalized one.
    pub(crate) fn distinct_routed_path(&self) -> Option<&str> {
        self.routed.as_deref()
    }
    /// The method.
    pub fn method(&self) -> &Method {
        &self.method
    }
    /// The client IP, when known.
    pub fn client_ip(&self) -> Option<IpAddr> {
        self.client_ip
    }
    /// The user id, when known.
    pub fn user_id(&self) -> Option<&str> {
        self.user_id.as_deref()
    }
    /// The API key, when known.
    pub fn api_key(&self) -> Option<&str> {
        self.api_key.as_deref()
    }
    /// The rule set that decides this request.
    pub fn rule_set_id(&self) -> &str {
        &self.rule_set_id
    }
    /// The rule set id, shared.
    pub(crate) fn shared_rule_set_id(&self) -> &Name {
        &self.rule_set_id
    }
    /// An attribute.
    pub fn attribute(&self, name: &str) -> Option<&str> {
        self.attributes.get(name).map(String::as_str)
    }
    /// All attributes.
    pub fn attributes(&self) -> &BTreeMap<String, String> {
        &self.attributes
    }
    /// The longest the caller waits for the decision, when it said
    /// ([`RequestContextBuilder::max_wait`]): no rule makes the request wait for the
    /// refill longer.
    pub fn max_wait(&self) -> Option<Duration> {
        self.max_wait
    }
    /// A builder holding this context's values, to derive a changed context.
    pub fn to_builder(&self) -> RequestContextBuilder {
        RequestContextBuilder { ctx: self.clone() }
    }
}

/// Builds a [`RequestContext`]. The layer fills one from each request and hands it to
/// the customizer closure, which may change any field.
#[derive(Debug, Clone)]
pub struct RequestContextBuilder {
    ctx: RequestContext,
}

impl Default for RequestContextBuilder {
    fn default() -> Self {
        static DEFAULT: std::sync::OnceLock<Name> = std::sync::OnceLock::new();
        Self::with_rule_set(DEFAULT.get_or_init(|| Name::new(DEFAULT_RULE_SET)).clone())
    }
}

impl RequestContextBuilder {
    /// A builder for a request of the given rule set, with the path `/` and method `GET`.
    /// A configured id is best given as a [`Name`] made once (its clones then cost no
    /// reference count); an id taken from a request as an `Arc<str>`, which is not
    /// interned.
    pub fn with_rule_set(rule_set_id: impl Into<Name>) -> Self {
        let rule_set_id = rule_set_id.into();
        Self {
            ctx: RequestContext {
                path: Text::new(),
                routed: None,
                method: Method::GET,
                client_ip: None,
                user_id: None,
                api_key: None,
                rule_set_id,
                attributes: BTreeMap::new(),
                max_wait: None,
            },
        }
    }

    /// The longest the caller waits for the decision: a rule that waits for the refill
    /// (`on_limit.wait`) makes the request wait at most this long, and refuses it at once
    /// when it would have to wait longer. A caller with a deadline (a gateway asking the
    /// rate-limit service) sets it, so that a wait never outlasts its deadline.
    pub fn max_wait(mut self, max_wait: Duration) -> Self {
        self.ctx.max_wait = Some(max_wait);
        self
    }

    /// Sets or clears [`max_wait`](Self::max_wait) in place.
    pub fn set_max_wait(&mut self, max_wait: Option<Duration>) -> &mut Self {
        self.ctx.max_wait = max_wait;
        self
    }

    /// Sets the path: the request's raw path, as the router sees it. Rules match it and
    /// its normalized form (see [`normalize_path`](crate::path::normalize_path)).
    pub fn path(mut self, path: &str) -> Self {
        self.set_path(path);
        self
    }
    /// Sets the method.
    pub fn method(mut self, method: Method) -> Self {
        self.ctx.method = method;
        self
    }
    /// Sets the client IP.
    pub fn client_ip(mut self, ip: IpAddr) -> Self {
        self.ctx.client_ip = Some(ip);
        self
    }
    /// Sets the user id.
    pub fn user_id(mut self, user: impl Into<String>) -> Self {
        self.ctx.user_id = Some(user.into());
        self
    }
    /// Sets the API key.
    pub fn api_key(mut self, key: impl Into<String>) -> Self {
        self.ctx.api_key = Some(key.into());
        self
    }
    /// Sets the rule set id.
    pub fn rule_set_id(mut self, id: impl Into<Arc<str>>) -> Self {
        self.ctx.rule_set_id = Name::from(id.into());
        self
    }
    /// Sets an attribute.
    pub fn attribute(mut self, name: impl Into<String>, value: impl Into<String>) -> Self {
        self.set_attribute(name, value);
        self
    }

    /// Sets the path in place: the raw path, kept as routed, and its normalized form.
    pub fn set_path(&mut self, path: &str) -> &mut Self {
        (self.ctx.path, self.ctx.routed) = normalized_and_routed(path);
        self
    }
    /// Sets the method in place.
    pub fn set_method(&mut self, method: Method) -> &mut Self {
        self.ctx.method = method;
        self
    }
    /// Sets or clears the client IP in place.
    pub fn set_client_ip(&mut self, ip: Option<IpAddr>) -> &mut Self {
        self.ctx.client_ip = ip;
        self
    }
    /// Sets or clears the user id in place.
    pub fn set_user_id(&mut self, user: Option<String>) -> &mut Self {
        self.ctx.user_id = user;
        self
    }
    /// Sets or clears the API key in place.
    pub fn set_api_key(&mut self, key: Option<String>) -> &mut Self {
        self.ctx.api_key = key;
        self
    }
    /// Sets the rule set id in place.
    pub fn set_rule_set_id(&mut self, id: impl Into<Arc<str>>) -> &mut Self {
        self.ctx.rule_set_id = Name::from(id.into());
        self
    }
    /// Sets an attribute in place.
    pub fn set_attribute(&mut self, name: impl Into<String>, value: impl Into<String>) -> &mut Self {
        self.ctx.attributes.insert(name.into(), value.into());
        self
    }
    /// Removes an attribute in place.
    pub fn remove_attribute(&mut self, name: &str) -> &mut Self {
        self.ctx.attributes.remove(name);
        self
    }

    /// The context as built so far.
    pub fn peek(&self) -> &RequestContext {
        &self.ctx
    }

    /// Builds the context.
    pub fn build(mut self) -> RequestContext {
        if self.ctx.path.is_empty() {
            self.ctx.path.push('/');
        }
        self.ctx
    }
}

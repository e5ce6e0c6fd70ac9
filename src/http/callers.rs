//! Who may call each route: one extractor per kind of caller, so a handler's signature says who
//! may call it (docs/security.md has the table).
//! - [`Anyone`]: health, the pages buyers are sent back to, the dashboard's sign-in.
//! - [`Buyer`]: the payment page, reached through the unguessable URL the checkout returned.
//! - [`Gateway`]: `POST /webhooks/*`, trusted by the signature over the raw body alone (the
//!   handler checks it: the signature covers the body, which an extractor of the head cannot
//!   see).
//! - [`Backend`]: the marketplace backend, with an API key (an operator's admin token may do
//!   what any key may).
//! - [`Operator`]: the admin token.
//! - [`MetricsReader`]: the admin token or `PAYFLEET_METRICS_TOKEN`.
//!
//! The dashboard's pages take an operator's session cookie instead (`dashboard`), made from the
//! admin token at sign-in. Every credential check starts with the address's failure count
//! ([`FailureLimiter`]): a locked address gets 429 before anything is looked up.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::Arc;
use std::time::Instant;

use axum::extract::{ConnectInfo, FromRef, FromRequestParts, MatchedPath};
use axum::http::request::Parts;
use axum::http::{HeaderMap, HeaderName};

use super::ApiError;
use crate::auth::{ApiKeys, FailureLimiter, KeyHolder, Lookup, Token};
use crate::catalogue::SellerId;

/// The credentials this receiver trusts and its record of failed ones, shared by every
/// extractor.
#[derive(Clone)]
pub struct Callers(Arc<Inner>);

struct Inner {
    admin: Option<Token>,
    metrics: Option<Token>,
    keys: Option<ApiKeys>,
    limiter: FailureLimiter,
    client_address_header: Option<HeaderName>,
}

impl Callers {
    /// `keys`: the API keys in force (none in a worker process, whose only guarded route is
    /// `/metrics`).
    pub fn new(
        admin: Option<Token>,
        metrics: Option<Token>,
        keys: Option<ApiKeys>,
        client_address_header: Option<HeaderName>,
    ) -> Self {
        Self(Arc::new(Inner {
            admin,
            metrics,
            keys,
            limiter: FailureLimiter::default(),
            client_address_header,
        }))
    }

    pub fn admin(&self) -> Option<&Token> {
        self.0.admin.as_ref()
    }

    /// The client's address: the configured proxy header's last value (what the proxy itself
    /// saw), else the connection's peer.
    pub fn client(&self, parts: &Parts) -> IpAddr {
        client_address(
            &parts.headers,
            self.0.client_address_header.as_ref(),
            parts
                .extensions
                .get::<ConnectInfo<SocketAddr>>()
                .map(|c| c.0),
        )
    }

    /// Refuses an address that failed too often (429), before a credential is looked at: even
    /// the right admin token, or guessing it would go on. Only an API key this process has seen
    /// in force passes (a 256-bit key is no guess), so a neighbour guessing behind the same NAT
    /// or proxy address cannot lock the marketplace's backend out.
    pub fn gate(&self, client: IpAddr) -> Result<(), ApiError> {
        self.0
            .limiter
            .check(client, Instant::now())
            .map_err(|l| ApiError::TooManyRequests(l.retry_after))
    }

    /// Counts and logs a failed credential of `client` (never the credential itself).
    pub fn failed(&self, client: IpAddr, route: &str, what: &str) {
        let failures = self.0.limiter.failed(client, Instant::now());
        tracing::warn!(%client, route, failures, "refused: {what}");
    }

    /// The first steps of every credential check: the client, and the bearer credential (401
    /// `unauthenticated`, saying `missing`, without one). The gate is each check's to ask.
    fn presented<'p>(
        &self,
        parts: &'p Parts,
        missing: &str,
    ) -> Result<(IpAddr, &'p str), ApiError> {
        let client = self.client(parts);
        let given = bearer(&parts.headers).ok_or_else(|| {
            ApiError::Unauthenticated(format!("send Authorization: Bearer <{missing}>"))
        })?;
        Ok((client, given))
    }

    /// What an API key is: this process's cached answer, or the database's, asked as an
    /// attempt in flight (hold the [`Attempt`] until a failure is counted).
    async fn key(
        &self,
        client: IpAddr,
        given: &str,
    ) -> Result<(Lookup, Option<Attempt>), ApiError> {
        let Some(keys) = &self.0.keys else {
            self.gate(client)?;
            return Ok((Lookup::Unknown, None));
        };
        let known = keys.seen_in_force(given);
        if !known {
            self.gate(client)?;
        }
        if let Some(answer) = keys.cached(given) {
            return Ok((answer, None));
        }
        let attempt = if known {
            None
        } else {
            Some(Attempt::begin(self, client, given)?)
        };
        Ok((keys.lookup(given).await?, attempt))
    }
}

/// A credential being looked up for a client: it counts against the client's limit until it
/// ends (when dropped, however the request ends).
struct Attempt {
    callers: Callers,
    client: IpAddr,
    credential: [u8; 32],
}

impl Attempt {
    fn begin(callers: &Callers, client: IpAddr, given: &str) -> Result<Self, ApiError> {
        let credential = crate::auth::digest(given.as_bytes());
        callers
            .0
            .limiter
            .begin(client, credential, Instant::now())
            .map_err(|l| ApiError::TooManyRequests(l.retry_after))?;
        Ok(Self {
            callers: callers.clone(),
            client,
            credential,
        })
    }
}

impl Drop for Attempt {
    fn drop(&mut self) {
        self.callers.0.limiter.end(self.client, self.credential);
    }
}

pub(crate) fn client_address(
    headers: &HeaderMap,
    header: Option<&HeaderName>,
    peer: Option<SocketAddr>,
) -> IpAddr {
    let claimed = header.and_then(|h| {
        let last = headers.get_all(h).iter().next_back()?.to_str().ok()?;
        let value = last.rsplit(',').next()?.trim();
        value
            .parse::<IpAddr>()
            .ok()
            .or_else(|| value.parse::<SocketAddr>().ok().map(|s| s.ip()))
    });
    claimed
        .or(peer.map(|p| p.ip()))
        .unwrap_or(IpAddr::V4(Ipv4Addr::UNSPECIFIED))
}

/// The bearer credential of a request, if it sends one.
fn bearer(headers: &HeaderMap) -> Option<&str> {
    let value = headers.get("authorization")?.to_str().ok()?;
    let (scheme, credential) = value.trim().split_once(' ')?;
    scheme
        .eq_ignore_ascii_case("bearer")
        .then(|| credential.trim())
        .filter(|c| !c.is_empty())
}

fn route(parts: &Parts) -> String {
    let path = parts
        .extensions
        .get::<MatchedPath>()
        .map_or("unmatched", |p| p.as_str());
    format!("{} {path}", parts.method)
}

/// A kind of caller that presents no credential of its own to the extractor: its type in a
/// handler's signature says who calls, and what trusts it is said beside it.
macro_rules! uncredentialed_caller {
    ($(#[$doc:meta])* $name:ident) => {
        $(#[$doc])*
        pub struct $name;

        impl<S: Send + Sync> FromRequestParts<S> for $name {
            type Rejection = std::convert::Infallible;

            async fn from_request_parts(_: &mut Parts, _: &S) -> Result<Self, Self::Rejection> {
                Ok($name)
            }
        }
    };
}

uncredentialed_caller!(
    /// Anyone at all: no credential is asked.
    Anyone
);
uncredentialed_caller!(
    /// A buyer's browser on the payment page: the session id in its URL (96 random bits) is
    /// what it holds, and the page's form token what it posts back.
    Buyer
);
uncredentialed_caller!(
    /// A gateway delivering a webhook: trusted only once the handler has checked its signature
    /// over the raw body.
    Gateway
);

/// An operator, by the admin token. 401 without a credential, 403 with any other (counted as a
/// failure unless it is one of our API keys, which is not a guess).
pub struct Operator;

impl<S> FromRequestParts<S> for Operator
where
    S: Send + Sync,
    Callers: FromRef<S>,
{
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, ApiError> {
        let callers = Callers::from_ref(state);
        let (client, given) = callers.presented(parts, "admin token")?;
        callers.gate(client)?;
        let Some(admin) = callers.admin() else {
            return Err(ApiError::Forbidden(
                "the admin API is off: set PAYFLEET_ADMIN_TOKEN to turn it on".into(),
            ));
        };
        if admin.matches(given) {
            return Ok(Operator);
        }
        let (lookup, _attempt) = callers.key(client, given).await?;
        if lookup == Lookup::Unknown {
            callers.failed(client, &route(parts), "wrong admin token");
            return Err(ApiError::Forbidden("wrong admin token".into()));
        }
        Err(ApiError::Forbidden(
            "an API key cannot call the admin API: it takes the admin token".into(),
        ))
    }
}

/// The marketplace backend (an API key), or an operator (the admin token).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    Operator,
    Key(KeyHolder),
}

impl<S> FromRequestParts<S> for Backend
where
    S: Send + Sync,
    Callers: FromRef<S>,
{
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, ApiError> {
        let callers = Callers::from_ref(state);
        let (client, given) = callers.presented(parts, "API key")?;
        if callers.admin().is_some_and(|a| a.matches(given)) {
            callers.gate(client)?;
            return Ok(Backend::Operator);
        }
        let (lookup, _attempt) = callers.key(client, given).await?;
        match lookup {
            Lookup::InForce(holder) => Ok(Backend::Key(holder)),
            Lookup::Revoked => Err(ApiError::Unauthenticated("this API key was revoked".into())),
            Lookup::Development => Err(ApiError::Unauthenticated(
                "this is `payfleet up`'s development API key: only `payfleet up` takes it; ask an operator for a key (POST /admin/api-keys)".into(),
            )),
            Lookup::Unknown => {
                callers.failed(client, &route(parts), "unknown API key");
                Err(ApiError::Unauthenticated("unknown API key".into()))
            }
        }
    }
}

impl Backend {
    /// The seller a key is bound to.
    pub fn seller(&self) -> Option<SellerId> {
        match self {
            Self::Key(k) => k.seller,
            Self::Operator => None,
        }
    }

    /// A seller's data is read only by keys not bound to another seller.
    pub fn may_read(&self, seller: SellerId) -> Result<(), ApiError> {
        match self.seller() {
            Some(own) if own != seller => Err(ApiError::Forbidden(format!(
                "this API key reads only seller {own}'s data"
            ))),
            _ => Ok(()),
        }
    }

    /// What a buyer does through the backend (check out, pay, read a wallet): not with a key
    /// bound to a seller.
    pub fn acts_for_buyers(&self) -> Result<(), ApiError> {
        match self.seller() {
            Some(own) => Err(ApiError::Forbidden(format!(
                "this API key is bound to seller {own}: it reads that seller's data and cannot check out or act for buyers"
            ))),
            None => Ok(()),
        }
    }

    /// Whose idempotency keys a request's key is among: each API key has its own, so one
    /// caller's key can neither replay nor block another's.
    pub fn idempotency_owner(&self) -> String {
        match self {
            Self::Operator => "admin".into(),
            Self::Key(k) => format!("key:{}", k.id),
        }
    }
}

/// A metrics scraper: the admin token or the metrics token.
pub struct MetricsReader;

impl<S> FromRequestParts<S> for MetricsReader
where
    S: Send + Sync,
    Callers: FromRef<S>,
{
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, ApiError> {
        let callers = Callers::from_ref(state);
        let (client, given) =
            callers.presented(parts, "PAYFLEET_METRICS_TOKEN or the admin token")?;
        callers.gate(client)?;
        let tokens = [callers.admin(), callers.0.metrics.as_ref()];
        if tokens.iter().all(Option::is_none) {
            return Err(ApiError::Forbidden(
                "metrics are off: set PAYFLEET_METRICS_TOKEN (or PAYFLEET_ADMIN_TOKEN)".into(),
            ));
        }
        if tokens.iter().flatten().any(|t| t.matches(given)) {
            return Ok(MetricsReader);
        }
        // One of our own API keys (a scraper set up with the wrong credential) is no guess: as
        // for the admin API, it is refused without locking its address out.
        let (lookup, _attempt) = callers.key(client, given).await?;
        if lookup != Lookup::Unknown {
            return Err(ApiError::Forbidden(
                "an API key cannot read metrics: they take PAYFLEET_METRICS_TOKEN or the admin token".into(),
            ));
        }
        callers.failed(client, &route(parts), "wrong metrics token");
        Err(ApiError::Forbidden("wrong metrics token".into()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_client_is_the_peer_unless_a_trusted_header_is_configured() {
        let mut h = HeaderMap::new();
        h.insert(
            "x-forwarded-for",
            "203.0.113.9, 198.51.100.2".parse().unwrap(),
        );
        let peer: SocketAddr = "10.0.0.1:5000".parse().unwrap();
        // Without the setting, a sender cannot claim an address by a header.
        assert_eq!(client_address(&h, None, Some(peer)), peer.ip());
        let xff = HeaderName::from_static("x-forwarded-for");
        assert_eq!(
            client_address(&h, Some(&xff), Some(peer)),
            "198.51.100.2".parse::<IpAddr>().unwrap(),
            "the proxy appends what it saw: the last value"
        );
        h.insert("x-forwarded-for", "not an address".parse().unwrap());
        assert_eq!(client_address(&h, Some(&xff), Some(peer)), peer.ip());
        h.insert("x-forwarded-for", "[2001:db8::1]:443".parse().unwrap());
        assert_eq!(
            client_address(&h, Some(&xff), Some(peer)),
            "2001:db8::1".parse::<IpAddr>().unwrap()
        );
    }

    #[test]
    fn a_bearer_credential_is_read_in_any_case_of_its_scheme() {
        let mut h = HeaderMap::new();
        assert_eq!(bearer(&h), None);
        h.insert("authorization", "Bearer abc".parse().unwrap());
        assert_eq!(bearer(&h), Some("abc"));
        h.insert("authorization", "bearer   abc ".parse().unwrap());
        assert_eq!(bearer(&h), Some("abc"));
        h.insert("authorization", "Basic abc".parse().unwrap());
        assert_eq!(bearer(&h), None);
        h.insert("authorization", "Bearer ".parse().unwrap());
        assert_eq!(bearer(&h), None);
    }
}

//! The payment side of the payment-link RPC: one gateway session per order and payment attempt,
//! created once. Asking again (a retry after a timeout) returns the same session; the gateway is
//! asked with an idempotency key per order and attempt (unique across installations), so even
//! two requests racing create one session where the gateway honours it, and the first stored
//! wins.

use std::collections::BTreeMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use sqlx::PgPool;

use rust_decimal::Decimal;

use crate::gateways::api::{Session, SessionRequest};
use crate::gateways::{GatewayName, GatewayRegistry};
use crate::messaging::Broker;
use crate::messaging::rpc::{
    self, Handler, PaymentLink, PaymentLinkBatch, PaymentLinkReply, PaymentLinkRequest,
};

pub struct LinkService {
    pub pool: PgPool,
    pub gateways: GatewayRegistry,
    /// The links each outside gateway is making at once in this process.
    pub in_flight: InFlight,
}

/// What the link RPC's consumer takes at once in a worker process (its prefetch).
pub const LINK_SLOTS: u16 = 16;

/// Links an outside gateway may be making at once in one process: half of [`LINK_SLOTS`], so a
/// gateway that hangs leaves the other half to the others.
pub const GATEWAY_SHARE: usize = LINK_SLOTS as usize / 2;

/// The links each outside gateway's API is making at once in this process ([`GATEWAY_SHARE`]):
/// a link waits for a place until its caller stops waiting. The internal gateway collecting
/// through an acquirer counts as that acquirer: its sessions are that API's calls, and a share
/// each would let one API's outage take every slot.
#[derive(Debug, Default)]
pub struct InFlight {
    places: std::sync::Mutex<std::collections::HashMap<GatewayName, Arc<tokio::sync::Semaphore>>>,
    acquirer: Option<GatewayName>,
}

/// What became of a session asked of an outside gateway: its answer, or the reply when it was
/// not asked or not answered in time.
type Outcome = Result<Result<Session, crate::gateways::GatewayError>, PaymentLinkReply>;

/// How long a link asked without its caller's patience (a receiver of an earlier release, the
/// renewals' biller) waits for a place: the RPC's default timeout.
const PLACE_WAIT_DEFAULT: std::time::Duration = std::time::Duration::from_secs(5);

impl InFlight {
    /// Counting the internal gateway's links as `acquirer`'s, where it collects through one.
    pub fn new(acquirer: Option<GatewayName>) -> Self {
        Self {
            places: Default::default(),
            acquirer,
        }
    }

    fn of(&self, gateway: GatewayName) -> Arc<tokio::sync::Semaphore> {
        let gateway = match (gateway, self.acquirer) {
            (GatewayName::Internal, Some(acquirer)) => acquirer,
            (g, _) => g,
        };
        self.places
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .entry(gateway)
            .or_insert_with(|| Arc::new(tokio::sync::Semaphore::new(GATEWAY_SHARE)))
            .clone()
    }

    /// `n` places for `gateway`'s API (its whole share at most), waited for until `by`; given
    /// back when dropped (a call given up included). None: none came in time.
    async fn take(
        &self,
        gateway: GatewayName,
        n: usize,
        by: tokio::time::Instant,
    ) -> Option<tokio::sync::OwnedSemaphorePermit> {
        let n = u32::try_from(n.min(GATEWAY_SHARE)).ok()?;
        tokio::time::timeout_at(by, self.of(gateway).acquire_many_owned(n))
            .await
            .ok()?
            .ok()
    }
}

fn failed(code: &str, message: impl Into<String>, retryable: bool) -> PaymentLinkReply {
    PaymentLinkReply::Failed {
        code: code.to_owned(),
        message: message.into(),
        retryable,
    }
}

impl LinkService {
    pub async fn link(&self, r: PaymentLinkRequest) -> PaymentLinkReply {
        self.links(vec![r])
            .await
            .pop()
            .unwrap_or_else(|| failed("unavailable", "no answer", true))
    }

    /// Each request's link, in the order asked: the sessions stored already read in one
    /// statement, the missing ones made by their gateways (each gateway asked about all of its
    /// own at once), and those made stored in one statement. A gateway whose sessions are ours
    /// ([`crate::gateways::api::PaymentGateway::sessions_are_ours`]: the internal and mock
    /// gateways) is asked without looking first: it gives the session it made before, and a
    /// link asked twice is stored once either way.
    pub async fn links(&self, requests: Vec<PaymentLinkRequest>) -> Vec<PaymentLinkReply> {
        // The callers' patience counts from here (the request just read off the queue).
        let received = tokio::time::Instant::now();
        let mut replies: Vec<Option<PaymentLinkReply>> = vec![None; requests.len()];
        let looked_for: Vec<usize> = (0..requests.len())
            .filter(|i| {
                self.gateways
                    .get(requests[*i].gateway)
                    .is_some_and(|g| !g.sessions_are_ours())
            })
            .collect();
        if !looked_for.is_empty() {
            let asked: Vec<PaymentLinkRequest> =
                looked_for.iter().map(|i| requests[*i].clone()).collect();
            match self.stored(&asked).await {
                Ok(found) => {
                    for (k, session_id, url) in found {
                        if let Some(i) = looked_for.get(k) {
                            replies[*i] = Some(PaymentLinkReply::Created { session_id, url });
                        }
                    }
                }
                Err(e) => {
                    let reply = failed("unavailable", e.to_string(), true);
                    return vec![reply; requests.len()];
                }
            }
        }
        // The missing ones, by gateway.
        let mut asking: Vec<(GatewayName, Vec<usize>)> = Vec::new();
        for (i, r) in requests.iter().enumerate() {
            if replies[i].is_some() {
                continue;
            }
            if self.gateways.get(r.gateway).is_none() {
                replies[i] = Some(failed(
                    "gateway_unavailable",
                    format!("gateway {} is not enabled on the payment side", r.gateway),
                    false,
                ));
            } else if let Some((_, of)) = asking.iter_mut().find(|(g, _)| *g == r.gateway) {
                of.push(i);
            } else {
                asking.push((r.gateway, vec![i]));
            }
        }
        // An outside gateway's sessions are asked for with the time of their first asking
        // (a retry asks the same: `SessionRequest::first_asked_at`).
        let outside: Vec<usize> = asking
            .iter()
            .filter(|(g, _)| {
                self.gateways
                    .get(*g)
                    .is_some_and(|g| !g.sessions_are_ours())
            })
            .flat_map(|(_, of)| of.iter().copied())
            .collect();
        let first_asked = match self.first_asked(&requests, &outside).await {
            Ok(at) => at,
            Err(e) => {
                for i in outside {
                    replies[i] = Some(failed("unavailable", e.to_string(), true));
                }
                asking
                    .retain(|(g, _)| self.gateways.get(*g).is_some_and(|g| g.sessions_are_ours()));
                Vec::new()
            }
        };
        let now = chrono::Utc::now();
        let all: &[PaymentLinkRequest] = &requests;
        let made = futures_util::future::join_all(asking.into_iter().filter_map(|(g, of)| {
            let gateway = self.gateways.get(g)?;
            // The callers stop waiting then: the earliest of theirs.
            let answer_by = of
                .iter()
                .filter_map(|i| requests[*i].answer_within_ms)
                .min()
                .map(|ms| received + std::time::Duration::from_millis(ms));
            let mut sessions: Vec<SessionRequest> = of
                .iter()
                .map(|i| {
                    let r = &requests[*i];
                    let asked = first_asked
                        .iter()
                        .find(|(k, _, _)| k == i)
                        .map_or((now, r.expires_at), |(_, at, expires)| (*at, *expires));
                    session_request(r, asked)
                })
                .collect();
            Some(async move {
                let made = if gateway.sessions_are_ours() {
                    gateway
                        .create_sessions(&sessions)
                        .await
                        .into_iter()
                        .map(Ok)
                        .collect()
                } else {
                    let made = self
                        .ask_outside(g, gateway.as_ref(), &sessions, answer_by)
                        .await;
                    self.asked_afresh(
                        g,
                        gateway.as_ref(),
                        (all, &of),
                        &mut sessions,
                        made,
                        answer_by,
                    )
                    .await
                };
                (of, sessions, made)
            })
        }))
        .await;
        let mut to_store: Vec<(usize, SessionRequest, Session)> = Vec::new();
        for (of, sessions, made) in made {
            for ((i, request), made) in of.into_iter().zip(sessions).zip(made) {
                let made = match made {
                    Ok(made) => made,
                    Err(reply) => {
                        replies[i] = Some(reply);
                        continue;
                    }
                };
                match made {
                    Ok(session) => to_store.push((i, request, session)),
                    Err(e) => {
                        let r = &requests[i];
                        tracing::warn!(order = r.order_number, gateway = %r.gateway, error = %e, "the gateway did not create a session");
                        replies[i] = Some(if e.is_ours() {
                            // Ours, not the gateway's words: the database's stay in the log.
                            // Asking again mends an outage, not a refusal (422, not 503).
                            failed(
                                "session_not_kept",
                                "the payment side's database did not keep the session (its log has why)",
                                e.is_transient(),
                            )
                        } else if e.is_the_platforms() {
                            // Our credentials, or an answer we cannot read: the platform's to
                            // mend, so the caller is told to ask again (503), never that its
                            // order was refused, and the gateway's words stay in the log.
                            failed(
                                "gateway_unavailable",
                                format!(
                                    "{} did not take the platform's request for a payment session (the payment side's log has why)",
                                    r.gateway
                                ),
                                true,
                            )
                        } else {
                            failed(e.code(), e.to_string(), e.is_transient())
                        });
                    }
                }
            }
        }
        // Each session stored, or why not (the reply's message).
        let stored: Vec<Result<Option<(String, String)>, String>> = match self
            .store(&requests, &to_store)
            .await
        {
            Ok(stored) => stored.into_iter().map(Ok).collect(),
            // Only a refusal of some row is worth storing the rest alone; an outage fails all.
            Err(e) if to_store.len() == 1 || !crate::db::is_about_the_row(&e) => {
                vec![Err(e.to_string()); to_store.len()]
            }
            // A batch refused as a whole is stored again one by one, where each session's own
            // error shows and holds up no other.
            Err(e) => {
                tracing::warn!(sessions = to_store.len(), error = %e, "a batch of sessions could not be stored; each is stored alone");
                let mut each = Vec::with_capacity(to_store.len());
                for one in to_store.chunks(1) {
                    each.push(match self.store(&requests, one).await {
                        Ok(mut stored) => Ok(stored.pop().flatten()),
                        Err(e) => Err(e.to_string()),
                    });
                }
                each
            }
        };
        for ((i, _, _), stored) in to_store.iter().zip(stored) {
            replies[*i] = Some(match stored {
                Ok(Some((session_id, url))) => PaymentLinkReply::Created { session_id, url },
                Ok(None) => failed("unavailable", "the session was not stored", true),
                Err(e) => failed("unavailable", e, true),
            });
        }
        replies
            .into_iter()
            .map(|r| r.unwrap_or_else(|| failed("unavailable", "no answer", true)))
            .collect()
    }

    /// Keeps the sessions made, each (in `made`'s order) the one stored: the first stored wins
    /// when two requests raced (the gateway was asked with the same idempotency key, so it is
    /// normally the same session anyway).
    async fn store(
        &self,
        requests: &[PaymentLinkRequest],
        made: &[(usize, SessionRequest, Session)],
    ) -> Result<Vec<Option<(String, String)>>, sqlx::Error> {
        if made.is_empty() {
            return Ok(Vec::new());
        }
        let of = |i: &usize| &requests[*i];
        let numbers: Vec<i64> = made.iter().map(|(i, _, _)| of(i).order_number).collect();
        let attempts: Vec<i32> = made.iter().map(|(i, _, _)| of(i).attempt).collect();
        let gateways: Vec<String> = made
            .iter()
            .map(|(i, _, _)| of(i).gateway.to_string())
            .collect();
        let sessions: Vec<&str> = made.iter().map(|(_, _, s)| s.session_id.as_str()).collect();
        let urls: Vec<&str> = made.iter().map(|(_, _, s)| s.url.as_str()).collect();
        let amounts: Vec<Decimal> = made.iter().map(|(i, _, _)| of(i).amount.amount()).collect();
        let currencies: Vec<String> = made
            .iter()
            .map(|(i, _, _)| of(i).amount.currency().as_str().to_owned())
            .collect();
        let fees: Vec<Decimal> = made
            .iter()
            .map(|(i, _, _)| of(i).platform_fee.amount())
            .collect();
        let metadata: Vec<serde_json::Value> = made
            .iter()
            .map(|(_, r, _)| serde_json::to_value(&r.metadata).unwrap_or_default())
            .collect();
        // Committed without waiting for its flush: the link reaches a buyer only once the order
        // side has stored it with a synchronous commit, which flushes this one too (the log is
        // one sequence). Lost in a crash before that, the link is asked again, and the gateway,
        // asked with the same idempotency key, gives the same session.
        let inserted: Vec<(i64, i32, String, String)> = sqlx::query_as(
            "INSERT INTO payment_sessions (order_number, attempt, gateway, session_id, url, amount, currency, platform_fee, metadata)
             SELECT x.order_number, x.attempt, x.gateway, x.session_id, x.url, x.amount, x.currency, x.platform_fee, x.metadata
             FROM (SELECT set_config('synchronous_commit', 'off', true)) c,
                  unnest($1::bigint[], $2::int[], $3::text[], $4::text[], $5::text[], $6::numeric[], $7::text[], $8::numeric[], $9::jsonb[])
                    AS x(order_number, attempt, gateway, session_id, url, amount, currency, platform_fee, metadata)
             ON CONFLICT (order_number, attempt) DO NOTHING
             RETURNING order_number, attempt, session_id, url",
        )
        .bind(&numbers)
        .bind(&attempts)
        .bind(&gateways)
        .bind(&sessions)
        .bind(&urls)
        .bind(&amounts)
        .bind(&currencies)
        .bind(&fees)
        .bind(&metadata)
        .fetch_all(&self.pool)
        .await?;
        let mut stored: Vec<Option<(String, String)>> = made
            .iter()
            .map(|(i, _, _)| {
                let r = of(i);
                inserted
                    .iter()
                    .find(|(n, a, _, _)| *n == r.order_number && *a == r.attempt)
                    .map(|(_, _, s, u)| (s.clone(), u.clone()))
            })
            .collect();
        if stored.iter().all(Option::is_some) {
            return Ok(stored);
        }
        // Another request stored some first: a statement of its own sees their rows.
        let lost: Vec<PaymentLinkRequest> = made
            .iter()
            .zip(&stored)
            .filter(|(_, s)| s.is_none())
            .map(|((i, _, _), _)| of(i).clone())
            .collect();
        let places: Vec<usize> = (0..stored.len()).filter(|k| stored[*k].is_none()).collect();
        let found = self.stored(&lost).await?;
        for (j, session_id, url) in found {
            if let Some(k) = places.get(j) {
                stored[*k] = Some((session_id, url));
            }
        }
        Ok(stored)
    }

    /// `made` (the outcomes of `sessions`, asked for `requests` at the places `of`), with each
    /// session the gateway refused outright that was first asked for a while ago asked afresh:
    /// its first asking recorded again as now, with the order's expiry now (`sessions` gets the
    /// new request). A refusal outright saves nothing under the idempotency key (Stripe keeps no
    /// result for a request refused on its parameters), so the key is free for other
    /// parameters. Without it, a link whose first asking never reached Stripe (an outage, a
    /// rate limit) is refused for good a minute later: its expiry, counted from that first
    /// asking, is then less than the 30 minutes Stripe asks of a new session.
    async fn asked_afresh(
        &self,
        name: GatewayName,
        gateway: &dyn crate::gateways::api::PaymentGateway,
        (requests, of): (&[PaymentLinkRequest], &[usize]),
        sessions: &mut [SessionRequest],
        mut made: Vec<Outcome>,
        answer_by: Option<tokio::time::Instant>,
    ) -> Vec<Outcome> {
        let refused: Vec<usize> = (0..made.len())
            .filter(|k| matches!(&made[*k], Ok(Err(e)) if e.refused_outright()))
            .collect();
        if refused.is_empty() {
            return made;
        }
        let keys: Vec<&str> = refused
            .iter()
            .map(|k| requests[of[*k]].link_key.as_str())
            .collect();
        let expiries: Vec<chrono::DateTime<chrono::Utc>> = refused
            .iter()
            .map(|k| requests[of[*k]].expires_at)
            .collect();
        let was: Vec<chrono::DateTime<chrono::Utc>> = refused
            .iter()
            .map(|k| sessions[*k].first_asked_at)
            .collect();
        // Only an asking older than half a minute: a fresh one refused is refused for what it
        // asks, and asking again would change nothing. Guarded by the time read, so two
        // refusals racing make it afresh once.
        type At = chrono::DateTime<chrono::Utc>;
        let renewed: Result<Vec<(String, At, At)>, sqlx::Error> =
            sqlx::query_as(
                "UPDATE payment_link_asks a SET first_asked_at = now(), expires_at = x.expires_at
                 FROM unnest($2::text[], $3::timestamptz[], $4::timestamptz[]) AS x(link_key, expires_at, was)
                 WHERE a.gateway = $1 AND a.link_key = x.link_key AND a.first_asked_at = x.was
                   AND a.first_asked_at < now() - interval '30 seconds'
                 RETURNING a.link_key, a.first_asked_at, a.expires_at",
            )
            .bind(name.as_str())
            .bind(&keys)
            .bind(&expiries)
            .bind(&was)
            .fetch_all(&self.pool)
            .await;
        let renewed = match renewed {
            Ok(renewed) => renewed,
            Err(e) => {
                tracing::warn!(gateway = %name, error = %e, "the refused links' first askings could not be made afresh");
                return made;
            }
        };
        let again: Vec<usize> = refused
            .into_iter()
            .filter(|k| {
                let r = &requests[of[*k]];
                if let Some((_, at, expires)) =
                    renewed.iter().find(|(key, _, _)| *key == r.link_key)
                {
                    sessions[*k] = session_request(r, (*at, *expires));
                    true
                } else {
                    false
                }
            })
            .collect();
        if again.is_empty() {
            return made;
        }
        for k in &again {
            if let Ok(Err(e)) = &made[*k] {
                tracing::warn!(gateway = %name, order = sessions[*k].order_number, error = %e,
                    "a link first asked a while ago was refused: asked afresh, its expiry counted from now");
            }
        }
        let asked: Vec<SessionRequest> = again.iter().map(|k| sessions[*k].clone()).collect();
        let outcomes = self.ask_outside(name, gateway, &asked, answer_by).await;
        for (k, outcome) in again.into_iter().zip(outcomes) {
            made[k] = outcome;
        }
        made
    }

    /// An outside gateway's sessions: asked once its API has places for them in this process
    /// ([`GATEWAY_SHARE`], waited for until the callers stop waiting), and waited for until
    /// then, not for the gateway's own longer timeout. A gateway that hangs thus holds at most
    /// its share of the consumer's slots, each for a caller's patience at most, and the others'
    /// links go on. A session the gateway made after we stopped waiting is found by the next
    /// asking (the same idempotency key). Each link's outcome: the gateway's answer, or the
    /// reply when it was not asked or not answered in time.
    async fn ask_outside(
        &self,
        name: GatewayName,
        gateway: &dyn crate::gateways::api::PaymentGateway,
        sessions: &[SessionRequest],
        answer_by: Option<tokio::time::Instant>,
    ) -> Vec<Outcome> {
        let not_in_time = |why: String, n: usize| -> Vec<Outcome> {
            tracing::warn!(gateway = %name, links = n, "{why}");
            (0..n)
                .map(|_| Err(failed("unavailable", why.clone(), true)))
                .collect()
        };
        let wait = answer_by.unwrap_or_else(|| tokio::time::Instant::now() + PLACE_WAIT_DEFAULT);
        // A batch larger than the share (only a receiver of an earlier release sends one) is
        // asked a share at a time.
        let mut outcomes = Vec::with_capacity(sessions.len());
        for part in sessions.chunks(GATEWAY_SHARE) {
            let Some(places) = self.in_flight.take(name, part.len(), wait).await else {
                outcomes.extend(not_in_time(
                    format!(
                        "{name} is answering slowly: {GATEWAY_SHARE} links were waiting for it here until the caller stopped waiting"
                    ),
                    part.len(),
                ));
                continue;
            };
            let calls = gateway.create_sessions(part);
            let made = match answer_by {
                Some(at) => tokio::time::timeout_at(at, calls).await.ok(),
                None => Some(calls.await),
            };
            drop(places);
            match made {
                Some(made) => outcomes.extend(made.into_iter().map(Ok)),
                None => outcomes.extend(not_in_time(
                    format!("{name} did not answer in time"),
                    part.len(),
                )),
            }
        }
        outcomes
    }

    /// When each of `requests` at the places `of` was first asked of its gateway, and the
    /// order's expiry it was asked with: recorded now if this is the first time (an order
    /// reopened since has another expiry, which its retry must not send). Returns (place,
    /// time, expiry) triples.
    #[allow(clippy::type_complexity)]
    async fn first_asked(
        &self,
        requests: &[PaymentLinkRequest],
        of: &[usize],
    ) -> Result<
        Vec<(
            usize,
            chrono::DateTime<chrono::Utc>,
            chrono::DateTime<chrono::Utc>,
        )>,
        sqlx::Error,
    > {
        if of.is_empty() {
            return Ok(Vec::new());
        }
        let gateways: Vec<String> = of
            .iter()
            .map(|i| requests[*i].gateway.to_string())
            .collect();
        let keys: Vec<&str> = of.iter().map(|i| requests[*i].link_key.as_str()).collect();
        let expiries: Vec<chrono::DateTime<chrono::Utc>> =
            of.iter().map(|i| requests[*i].expires_at).collect();
        // The update of a row already there changes nothing but returns it: a request racing
        // the first one waits for it and gets its time and expiry. The same link asked twice
        // in one batch is one row (an upsert may not touch a row twice).
        #[allow(clippy::type_complexity)]
        let asked: Vec<(
            String,
            String,
            chrono::DateTime<chrono::Utc>,
            Option<chrono::DateTime<chrono::Utc>>,
        )> = sqlx::query_as(
            "INSERT INTO payment_link_asks (gateway, link_key, expires_at)
             SELECT DISTINCT ON (gateway, link_key) *
             FROM unnest($1::text[], $2::text[], $3::timestamptz[]) AS a(gateway, link_key, expires_at)
             ON CONFLICT (gateway, link_key) DO UPDATE SET link_key = EXCLUDED.link_key
             RETURNING gateway, link_key, first_asked_at, expires_at",
        )
        .bind(&gateways)
        .bind(&keys)
        .bind(&expiries)
        .fetch_all(&self.pool)
        .await?;
        Ok(of
            .iter()
            .filter_map(|i| {
                let r = &requests[*i];
                asked
                    .iter()
                    .find(|(g, k, _, _)| *g == r.gateway.as_str() && *k == r.link_key)
                    .map(|(_, _, at, expires)| (*i, *at, expires.unwrap_or(r.expires_at)))
            })
            .collect())
    }

    /// The sessions stored for `requests`' orders and attempts: each with its request's place.
    async fn stored(
        &self,
        requests: &[PaymentLinkRequest],
    ) -> Result<Vec<(usize, String, String)>, sqlx::Error> {
        let numbers: Vec<i64> = requests.iter().map(|r| r.order_number).collect();
        let attempts: Vec<i32> = requests.iter().map(|r| r.attempt).collect();
        // Each key through the primary key's index, whatever the planner knows of the table;
        // the arrays as sub-selects' values, so it is not planned again at every call
        // (README, "Plans made once").
        let found: Vec<(i64, String, String)> = sqlx::query_as(
            "SELECT k.i, s.session_id, s.url
             FROM unnest((SELECT $1::bigint[]), (SELECT $2::int[])) WITH ORDINALITY AS k(order_number, attempt, i)
             CROSS JOIN LATERAL (
                 SELECT session_id, url FROM payment_sessions s
                 WHERE s.order_number = k.order_number AND s.attempt = k.attempt
             ) s",
        )
        .bind(&numbers)
        .bind(&attempts)
        .fetch_all(&self.pool)
        .await?;
        Ok(found
            .into_iter()
            .filter_map(|(i, s, u)| Some((usize::try_from(i - 1).ok()?, s, u)))
            .collect())
    }
}

/// What the gateway is asked for an order's link: its amount, the split in its metadata, and
/// keys made of the link's key (the same for the same order and attempt).
fn session_request(
    r: &PaymentLinkRequest,
    (first_asked_at, expires_at): (chrono::DateTime<chrono::Utc>, chrono::DateTime<chrono::Utc>),
) -> SessionRequest {
    let mut metadata = BTreeMap::new();
    metadata.insert("order_number".to_owned(), r.order_number.to_string());
    metadata.insert("attempt".to_owned(), r.attempt.to_string());
    metadata.insert("seller_id".to_owned(), r.seller_id.clone());
    metadata.insert(
        "platform_fee".to_owned(),
        r.platform_fee.amount().to_string(),
    );
    if let Some(net) = r.amount.checked_sub(&r.platform_fee) {
        metadata.insert("seller_net".to_owned(), net.amount().to_string());
    }
    if let Some(account) = &r.seller_account {
        metadata.insert("seller_account".to_owned(), account.clone());
    }
    SessionRequest {
        order_number: r.order_number,
        attempt: r.attempt,
        amount: r.amount,
        platform_fee: r.platform_fee,
        seller_account: r.seller_account.clone(),
        description: r.description.clone(),
        recurring_interval: r.recurring_interval.clone(),
        recurring_amount: r.renews_at,
        recurring_fee: r.renews_fee,
        metadata,
        idempotency_key: format!("payfleet-{}", r.link_key),
        reference: format!("pf-{}", r.link_key),
        expires_at,
        first_asked_at,
    }
}

/// Forgets the first askings older than two days: no gateway keeps an idempotency key longer.
pub async fn prune_asks(pool: &PgPool) -> Result<u64, sqlx::Error> {
    Ok(sqlx::query(
        "DELETE FROM payment_link_asks WHERE first_asked_at < now() - interval '2 days'",
    )
    .execute(pool)
    .await?
    .rows_affected())
}

impl Handler<PaymentLink> for LinkService {
    fn handle(
        &self,
        request: PaymentLinkRequest,
    ) -> Pin<Box<dyn Future<Output = PaymentLinkReply> + Send + '_>> {
        Box::pin(self.link(request))
    }
}

impl Handler<PaymentLinkBatch> for LinkService {
    fn handle(
        &self,
        requests: Vec<PaymentLinkRequest>,
    ) -> Pin<Box<dyn Future<Output = Vec<PaymentLinkReply>> + Send + '_>> {
        Box::pin(self.links(requests))
    }
}

/// Answers the payment-link RPCs (one link a request, and many) until the process stops.
/// Starts the payment side's consumers of both link RPCs; returns how many it started.
pub fn serve(broker: &Broker, service: Arc<LinkService>, prefetch: u16) -> usize {
    tokio::spawn(rpc::serve::<PaymentLink>(
        broker.clone(),
        service.clone(),
        prefetch,
    ));
    tokio::spawn(rpc::serve::<PaymentLinkBatch>(
        broker.clone(),
        service,
        prefetch,
    ));
    2
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::db::{one_connection, plan_counts};
    use crate::money::Money;

    fn request(order_number: i64) -> PaymentLinkRequest {
        let amount = Money::parse("10.00", "BRL").unwrap();
        PaymentLinkRequest {
            order_number,
            gateway: GatewayName::Internal,
            platform_fee: Money::parse("1.00", "BRL").unwrap(),
            amount,
            seller_id: "seller".to_owned(),
            seller_account: None,
            buyer_id: "buyer".to_owned(),
            description: "an order".to_owned(),
            recurring_interval: None,
            attempt: 1,
            link_key: format!("link-{order_number}"),
            expires_at: chrono::Utc::now(),
            renews_at: None,
            renews_fee: None,
            answer_within_ms: None,
        }
    }

    /// A gateway that makes no session, failing with its error.
    struct Failing(fn() -> crate::gateways::GatewayError);

    /// A gateway whose sessions are ours, whose store refuses the row (a constraint of ours).
    fn ours_refused() -> crate::gateways::GatewayError {
        crate::gateways::GatewayError::Database(sqlx::Error::InvalidArgument(
            "violates check constraint internal_payments_secret_rule".into(),
        ))
    }

    impl crate::gateways::api::PaymentGateway for Failing {
        fn name(&self) -> GatewayName {
            GatewayName::Internal
        }
        fn sessions_are_ours(&self) -> bool {
            true
        }
        fn create_session<'a>(
            &'a self,
            _: &'a SessionRequest,
        ) -> crate::gateways::api::GatewayFuture<'a, Session> {
            let error = self.0;
            Box::pin(async move { Err(error()) })
        }
        fn status<'a>(
            &'a self,
            _: &'a str,
            _: Option<&'a str>,
        ) -> crate::gateways::api::GatewayFuture<'a, crate::gateways::api::PaymentState> {
            Box::pin(async { Err(crate::gateways::GatewayError::Refused("none".into())) })
        }
        fn refund<'a>(
            &'a self,
            _: &'a crate::gateways::api::RefundRequest,
        ) -> crate::gateways::api::GatewayFuture<'a, crate::gateways::api::RefundReceipt> {
            Box::pin(async { Err(crate::gateways::GatewayError::Refused("none".into())) })
        }
        fn refund_status<'a>(
            &'a self,
            _: &'a crate::gateways::api::RefundQuery,
        ) -> crate::gateways::api::GatewayFuture<'a, crate::gateways::api::RefundOutcome> {
            Box::pin(async { Err(crate::gateways::GatewayError::Refused("none".into())) })
        }
        fn dispute_status<'a>(
            &'a self,
            _: &'a crate::gateways::api::DisputeQuery,
        ) -> crate::gateways::api::GatewayFuture<'a, Option<crate::gateways::DisputeStatus>>
        {
            Box::pin(async { Ok(None) })
        }
        fn map_status(&self, raw: &str) -> crate::gateways::PaymentStatus {
            crate::gateways::api::unknown_status(GatewayName::Internal, raw)
        }
    }

    /// Our own database's error while a session is made is not the gateway's refusal, and the
    /// database's words (a constraint's name, the server's message) stay in the log.
    #[sqlx::test(migrator = "crate::db::MIGRATOR")]
    async fn our_database_refusing_a_session_is_not_shown_as_the_gateways_refusal(pool: PgPool) {
        let (code, message, retryable) = failed_with(&pool, ours_refused).await;
        assert_eq!(code, "session_not_kept");
        assert!(!retryable, "a refusal, not an outage: {message}");
        assert!(!message.contains("constraint"), "{message}");
    }

    /// The payment side's reply to a link the gateway fails with `error`: (code, message,
    /// retryable).
    async fn failed_with(
        pool: &PgPool,
        error: fn() -> crate::gateways::GatewayError,
    ) -> (String, String, bool) {
        let mut gateways = GatewayRegistry::default();
        gateways.register(Arc::new(Failing(error))).unwrap();
        let service = LinkService {
            pool: pool.clone(),
            gateways,
            in_flight: Default::default(),
        };
        match service.link(request(7)).await {
            PaymentLinkReply::Failed {
                code,
                message,
                retryable,
            } => (code, message, retryable),
            other => panic!("{other:?}"),
        }
    }

    /// The gateway refusing the platform's credentials (a key revoked or rotated) or answering
    /// what cannot be read is not the caller's order refused: the checkout is told to ask again
    /// (a 503), and the gateway's words (a key's tail) stay in the log.
    #[sqlx::test(migrator = "crate::db::MIGRATOR")]
    async fn the_gateway_refusing_our_credentials_is_not_the_orders_refusal(pool: PgPool) {
        fn key_refused() -> crate::gateways::GatewayError {
            crate::gateways::GatewayError::Api {
                gateway: GatewayName::Internal,
                status: 401,
                code: None,
                message: "Invalid API Key provided: sk_live_********1234".into(),
            }
        }
        fn unreadable() -> crate::gateways::GatewayError {
            crate::gateways::GatewayError::Decode {
                gateway: GatewayName::Internal,
                source: serde_json::from_str::<u8>("acct_1Secret").unwrap_err(),
            }
        }
        fn amount_refused() -> crate::gateways::GatewayError {
            crate::gateways::GatewayError::Api {
                gateway: GatewayName::Internal,
                status: 400,
                code: Some("amount_too_small".into()),
                message: "Amount must be at least 0.50".into(),
            }
        }
        for (error, expected) in [
            (key_refused as fn() -> _, ("gateway_unavailable", true)),
            (unreadable, ("gateway_unavailable", true)),
            (amount_refused, ("amount_too_small", false)),
        ] {
            let (code, message, retryable) = failed_with(&pool, error).await;
            assert_eq!((code.as_str(), retryable), expected, "{message}");
            assert!(
                !message.contains("sk_live") && !message.contains("acct_"),
                "{message}"
            );
        }
    }

    #[sqlx::test(migrator = "crate::db::MIGRATOR")]
    async fn reading_the_stored_sessions_keeps_its_plan(pool: PgPool) {
        // A table of some size: over an empty one every plan costs next to nothing.
        sqlx::query(
            "INSERT INTO payment_sessions (order_number, attempt, gateway, session_id, url, amount,
                                           currency, platform_fee)
             SELECT n, 1, 'internal', 'cs_' || n, 'https://pay/' || n, 10, 'BRL', 1
             FROM generate_series(1, 20000) AS n",
        )
        .execute(&pool)
        .await
        .unwrap();
        sqlx::query("ANALYZE payment_sessions")
            .execute(&pool)
            .await
            .unwrap();
        let service = LinkService {
            pool: one_connection(&pool).await,
            gateways: GatewayRegistry::default(),
            in_flight: Default::default(),
        };
        for n in [1, 3, 1, 2, 5, 1, 4, 2] {
            // Each found in its place: order 1000·i + n's session.
            let requests: Vec<PaymentLinkRequest> = (0..n).map(|i| request(1000 * i + n)).collect();
            let found = service.stored(&requests).await.unwrap();
            let expected: Vec<(usize, String, String)> = (0..n)
                .map(|i| {
                    let number = 1000 * i + n;
                    (
                        i as usize,
                        format!("cs_{number}"),
                        format!("https://pay/{number}"),
                    )
                })
                .collect();
            assert_eq!(found, expected);
        }
        let (generic, custom) = plan_counts(&service.pool, "s.session_id, s.url").await;
        assert_eq!(
            (generic, custom),
            (3, 5),
            "planned for its values five times, then once for all"
        );
    }
}

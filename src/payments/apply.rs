//! Applying an event's facts to its payment, inside the event's transaction.
//!
//! Refunds and disputes only apply to a payment known to have succeeded, with its amount: only
//! then can they be checked (same currency, never more than was paid). One that arrives first
//! waits: its event is kept as `waiting` for `session:<id>` or `payment:<id>`, and the event that
//! makes the payment known enqueues it again in the same transaction. Both sides take the same
//! advisory locks on the payment's keys first, so a waiter cannot slip in between a payment's
//! commit and its check for waiters.

use std::sync::LazyLock;

use rust_decimal::Decimal;
use sqlx::PgConnection;

use super::{ProcessError, ProcessPaymentEvent, RefundPayment};
use crate::gateways::{DisputeStatus, Fact, GatewayName, PaymentRef, PaymentStatus};
use crate::ledger::poster::Due;
use crate::ledger::sales::{self, Sale};
use crate::money::Money;
use crate::orders::{self, PaymentEffect};
use crate::payment_status::{Facts, derive_status};
use payfleet_queue::{self as queue, NewJob};

/// A fact that can never apply as it stands.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Rejection {
    #[error("{what} {id} is in {got} but the payment is in {payment}")]
    Currency {
        what: &'static str,
        id: String,
        got: String,
        payment: String,
    },
    #[error(
        "refund {refund_id} of {amount} would bring the refunds to {total}, more than the {paid} paid"
    )]
    RefundExceedsPayment {
        refund_id: String,
        amount: Money,
        total: Money,
        paid: Money,
    },
    #[error("dispute {dispute_id} of {amount} is more than the {paid} paid")]
    DisputeExceedsPayment {
        dispute_id: String,
        amount: Money,
        paid: Money,
    },
    #[error("the payment was recorded as {recorded}; this event says {got}")]
    PaymentAmountChanged { recorded: String, got: String },
    #[error("paid {paid} for an order of {order}: the order is not confirmed")]
    AmountMismatch { order: Money, paid: Money },
    #[error("payment {payment_id} belongs to session {recorded}; this event names session {got}")]
    PaymentOfAnotherSession {
        payment_id: String,
        recorded: String,
        got: String,
    },
}

/// What applying an event did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Applied {
    Changed,
    Unchanged,
    /// Kept until this payment key is known to have succeeded.
    Waiting(String),
}

#[derive(sqlx::FromRow)]
struct PaymentRow {
    id: i64,
    session_id: String,
    payment_id: Option<String>,
    succeeded: bool,
    amount: Option<Decimal>,
    currency: Option<String>,
}

impl PaymentRow {
    /// What was paid, for a payment known to have succeeded with its amount.
    fn captured(&self) -> Option<Money> {
        if !self.succeeded {
            return None;
        }
        let (amount, currency) = self.amount.zip(self.currency.as_deref())?;
        Money::new(amount, currency.parse().ok()?).ok()
    }
}

const PAYMENT_COLUMNS: &str = "id, session_id, payment_id, succeeded_at IS NOT NULL AS succeeded, amount, currency::text AS currency";

fn session_key(session: &str) -> String {
    format!("session:{session}")
}

fn payment_key(payment: &str) -> String {
    format!("payment:{payment}")
}

/// The key a gateway subscription's events wait on until its first payment is known.
pub(super) fn subscription_key(subscription: &str) -> String {
    format!("subscription:{subscription}")
}

/// The gateway subscriptions the facts say the payment started.
fn subscriptions_started(facts: &[Fact]) -> impl Iterator<Item = String> + '_ {
    facts.iter().filter_map(|f| match f {
        Fact::Subscribed { subscription } => Some(subscription_key(subscription)),
        _ => None,
    })
}

/// The keys an event about `payment` waits on and wakes: the gateway's payment id when known
/// (refunds and disputes often name only that), else the session.
fn wait_key(payment: &PaymentRef) -> String {
    match (&payment.payment_id, &payment.session_id) {
        (Some(p), _) => payment_key(p),
        (None, Some(s)) => session_key(s),
        // ref_of() guarantees one of them.
        (None, None) => session_key(""),
    }
}

/// Serialises every event of one payment on its keys, for the rest of the transaction.
pub(super) async fn lock_keys(
    tx: &mut PgConnection,
    gateway: GatewayName,
    keys: &[String],
) -> Result<(), sqlx::Error> {
    lock_key_names(tx, keys.iter().map(|k| key_name(gateway, k)).collect()).await
}

/// A payment key's lock, among every gateway's.
pub(super) fn key_name(gateway: GatewayName, key: &str) -> String {
    format!("{gateway}:{key}")
}

/// Takes the locks of payment keys (named by [`key_name`]) for the rest of the transaction.
pub(super) async fn lock_key_names(
    tx: &mut PgConnection,
    mut names: Vec<String>,
) -> Result<(), sqlx::Error> {
    names.sort();
    names.dedup();
    // Taken in sorted order (unnest keeps the array's): no two events can deadlock on them.
    sqlx::query(
        "SELECT pg_advisory_xact_lock(hashtextextended(k, 0)) FROM unnest($1::text[]) AS k",
    )
    .bind(&names)
    .execute(&mut *tx)
    .await?;
    Ok(())
}

pub(super) fn keys_of(payment: &PaymentRef) -> Vec<String> {
    let mut keys = Vec::new();
    if let Some(s) = &payment.session_id {
        keys.push(session_key(s));
    }
    if let Some(p) = &payment.payment_id {
        keys.push(payment_key(p));
    }
    keys
}

async fn find(
    tx: &mut PgConnection,
    gateway: GatewayName,
    payment: &PaymentRef,
) -> Result<Option<PaymentRow>, sqlx::Error> {
    // The session's payment if there is one, else the first with the payment id: one statement.
    sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT {PAYMENT_COLUMNS} FROM payment_orders
         WHERE gateway = $1 AND (session_id = $2 OR payment_id = $3)
         ORDER BY session_id IS NOT DISTINCT FROM $2 DESC, id LIMIT 1 FOR UPDATE"
    )))
    .bind(gateway.as_str())
    .bind(&payment.session_id)
    .bind(&payment.payment_id)
    .fetch_optional(&mut *tx)
    .await
}

/// What applying did, and the sale it left due (to post once the transaction has committed).
#[derive(Debug)]
pub(crate) struct Outcome {
    pub applied: Applied,
    pub due: Option<Due>,
}

impl From<Applied> for Outcome {
    fn from(applied: Applied) -> Self {
        Self { applied, due: None }
    }
}

/// Records the facts, derives the payment's status, brings the order in line and wakes the
/// events that waited for this payment.
pub(crate) async fn apply(
    tx: &mut PgConnection,
    gateway: GatewayName,
    payment: &PaymentRef,
    facts: &[Fact],
    event_id: Option<i64>,
) -> Result<Outcome, ProcessError> {
    let g = gateway.as_str();
    let started: Vec<String> = subscriptions_started(facts).collect();
    let mut locked = keys_of(payment);
    locked.extend(started.iter().cloned());
    lock_keys(tx, gateway, &locked).await?;
    let has_payment_fact = facts.iter().any(|f| matches!(f, Fact::Payment { .. }));
    let found = find(tx, gateway, payment).await?;
    // Only an event naming a payment other than the session's own can be about a second one:
    // the events of the payment itself (nearly all) ask nothing more, nor does the first event
    // of a session no payment is known for (a second payment is one on a session that has its
    // payment).
    let unknown_session = found.is_none() && payment.session_id.is_some();
    if payment.payment_id.is_some()
        && !unknown_session
        && found.as_ref().and_then(|p| p.payment_id.as_ref()) != payment.payment_id.as_ref()
        && let Some(applied) = second_payment_facts(tx, gateway, payment, facts).await?
    {
        return Ok(applied.into());
    }
    if let (Some(po), Some(session), Some(pid)) = (&found, &payment.session_id, &payment.payment_id)
        && &po.session_id != session
    {
        return Err(Rejection::PaymentOfAnotherSession {
            payment_id: pid.clone(),
            recorded: po.session_id.clone(),
            got: session.clone(),
        }
        .into());
    }
    let mut po = match found {
        Some(po) => po,
        // Only a payment event can make a payment known, and only with its session (our key).
        None => match (&payment.session_id, has_payment_fact) {
            (Some(session), true) => {
                sqlx::query_as(sqlx::AssertSqlSafe(format!(
                "INSERT INTO payment_orders (gateway, session_id, payment_id) VALUES ($1, $2, $3)
                     RETURNING {PAYMENT_COLUMNS}"
            )))
                .bind(g)
                .bind(session)
                .bind(&payment.payment_id)
                .fetch_one(&mut *tx)
                .await?
            }
            _ => return Ok(Applied::Waiting(wait_key(payment)).into()),
        },
    };

    let mut changed = false;
    let mut waiting = None;
    // Money taken back from a payment other than the session's own (a second payment this
    // event just made known, or one never known: authorised, then voided), kept for that
    // payment below: never the order's.
    let mut of_another: Vec<Fact> = Vec::new();
    // Payment facts first: an event that carries a payment and its refunds (a Mercado Pago
    // lookup) makes the payment known before its refunds are checked against it.
    let mut ordered: Vec<&Fact> = facts.iter().collect();
    ordered.sort_by_key(|f| !matches!(f, Fact::Payment { .. }));
    for fact in ordered {
        let another_payment = matches!(
            (&po.payment_id, &payment.payment_id),
            (Some(ours), Some(named)) if ours != named
        );
        if another_payment && matches!(fact, Fact::Refund { .. } | Fact::Dispute { .. }) {
            of_another.push(fact.clone());
            continue;
        }
        match fact {
            Fact::Payment {
                status: PaymentStatus::Succeeded,
                amount,
            } => {
                if let (true, Some(first), Some(other)) =
                    (po.succeeded, &po.payment_id, &payment.payment_id)
                    && first != other
                {
                    changed |=
                        second_payment(tx, gateway, &po.session_id, other, *amount, event_id)
                            .await?;
                    continue;
                }
                if let (Some(m), Some(paid)) = (amount, po.captured())
                    && *m != paid
                {
                    return Err(Rejection::PaymentAmountChanged {
                        recorded: paid.to_string(),
                        got: m.to_string(),
                    }
                    .into());
                }
                let rows = sqlx::query(
                    "UPDATE payment_orders SET
                         succeeded_at = COALESCE(succeeded_at, now()),
                         amount = COALESCE(amount, $2), currency = COALESCE(currency, $3),
                         payment_id = COALESCE($4, payment_id), updated_at = now()
                     WHERE id = $1 AND (succeeded_at IS NULL OR (amount IS NULL AND $2::numeric IS NOT NULL)
                                        OR payment_id IS DISTINCT FROM COALESCE($4, payment_id))",
                )
                .bind(po.id)
                .bind(amount.map(|m| m.amount()))
                .bind(amount.map(|m| m.currency().to_string()))
                .bind(&payment.payment_id)
                .execute(&mut *tx)
                .await?;
                if rows.rows_affected() > 0 {
                    changed = true;
                    po.succeeded = true;
                    if po.amount.is_none()
                        && let Some(m) = amount
                    {
                        po.amount = Some(m.amount());
                        po.currency = Some(m.currency().to_string());
                    }
                    if payment.payment_id.is_some() {
                        po.payment_id = payment.payment_id.clone();
                    }
                }
            }
            Fact::Payment {
                status: PaymentStatus::Failed,
                ..
            } => {
                let rows = sqlx::query(
                    "UPDATE payment_orders SET failed_at = now(), updated_at = now() WHERE id = $1 AND failed_at IS NULL",
                )
                .bind(po.id)
                .execute(&mut *tx)
                .await?;
                changed |= rows.rows_affected() > 0;
            }
            Fact::Payment {
                status: PaymentStatus::Pending,
                ..
            } => {}
            Fact::Refund { refund_id, amount } => {
                let Some(paid) = po.captured() else {
                    waiting = Some(wait_key(payment));
                    break;
                };
                changed |=
                    record_refund(tx, gateway, po.id, paid, refund_id, amount, event_id).await?;
            }
            Fact::Dispute {
                dispute_id,
                amount,
                status,
            } => {
                let Some(paid) = po.captured() else {
                    waiting = Some(wait_key(payment));
                    break;
                };
                changed |= record_dispute(
                    tx,
                    gateway,
                    DisputeOf::Order(po.id),
                    Some(paid),
                    dispute_id,
                    amount,
                    *status,
                )
                .await?;
            }
            Fact::RefundEnded {
                refund_id,
                canceled,
            } => {
                changed |= end_refund(tx, gateway, refund_id, *canceled).await?;
            }
            Fact::Subscribed { subscription } => {
                let rows = sqlx::query(
                    "UPDATE payment_orders SET subscription_ref = $2, updated_at = now()
                     WHERE id = $1 AND subscription_ref IS NULL",
                )
                .bind(po.id)
                .bind(subscription)
                .execute(&mut *tx)
                .await?;
                changed |= rows.rows_affected() > 0;
            }
            Fact::DisputeDecided { dispute_id, status } => {
                changed |=
                    decide_dispute(tx, gateway, DisputeOf::Order(po.id), dispute_id, *status)
                        .await?;
            }
        }
    }

    if !of_another.is_empty() && waiting.is_none() {
        // Its refunds and disputes are a second payment's (recorded against it, moving no
        // seller's money: `second_payment_facts`); a payment not known as one waits until it is.
        match second_payment_facts(tx, gateway, payment, &of_another).await? {
            Some(applied) => changed |= matches!(applied, Applied::Changed),
            None => waiting = Some(wait_key(payment)),
        }
    }
    // The facts recorded so far are kept (and derived from) even when a later one must wait.
    let (order_changed, due) = derive_and_apply(tx, gateway, po.id, event_id).await?;
    // The payment is known now: whatever waited for it looks again (if it is still not captured,
    // a refund simply waits again).
    let mut keys = vec![session_key(&po.session_id)];
    if let Some(p) = &po.payment_id {
        keys.push(payment_key(p));
    }
    if let Some(p) = &payment.payment_id {
        keys.push(payment_key(p));
    }
    // A subscription's renewals and changes that came before its first payment's event.
    keys.extend(started);
    // Nothing new is known of the payment this event waits for: the events waiting with it
    // would only wait again, and wake this one, without end.
    keys.retain(|k| Some(k) != waiting.as_ref());
    wake_waiting(tx, gateway, &keys, event_id).await?;
    let applied = match waiting {
        Some(key) => Applied::Waiting(key),
        None if changed || order_changed => Applied::Changed,
        None => Applied::Unchanged,
    };
    Ok(Outcome { applied, due })
}

/// A second, different payment on a session that has its payment (Mercado Pago preferences and
/// Razorpay orders take several): recorded on its own, never absorbed into the session's, and
/// given back once, as an extra payment of the order. Returns whether it was new.
async fn second_payment(
    tx: &mut PgConnection,
    gateway: GatewayName,
    session_id: &str,
    payment_id: &str,
    amount: Option<Money>,
    event_id: Option<i64>,
) -> Result<bool, ProcessError> {
    let new: Option<i64> = sqlx::query_scalar(
        "INSERT INTO second_payments (gateway, session_id, payment_id, amount, currency, event_id)
         VALUES ($1, $2, $3, $4, $5, $6) ON CONFLICT (gateway, payment_id) DO NOTHING RETURNING id",
    )
    .bind(gateway)
    .bind(session_id)
    .bind(payment_id)
    .bind(amount.map(|m| m.amount()))
    .bind(amount.map(|m| m.currency().to_string()))
    .bind(event_id)
    .fetch_optional(&mut *tx)
    .await?;
    if new.is_none() {
        return Ok(false);
    }
    let session: Option<(i64, serde_json::Value)> = sqlx::query_as(
        "SELECT order_number, metadata FROM payment_sessions WHERE gateway = $1 AND session_id = $2",
    )
    .bind(gateway)
    .bind(session_id)
    .fetch_optional(&mut *tx)
    .await?;
    let number = session.as_ref().map(|(n, _)| *n);
    if let Some(n) = number {
        orders::record_extra_payment(tx, n, session_id, payment_id).await?;
    }
    let refund = RefundPayment {
        gateway,
        order_number: number,
        session_id: session_id.to_owned(),
        payment_id: Some(payment_id.to_owned()),
        amount,
        seller_account: session.as_ref().and_then(|(_, m)| super::seller_account(m)),
        reason: format!("a second payment ({payment_id}) on session {session_id}"),
        of_payment: true,
    };
    queue::enqueue(&mut *tx, refund.job()?).await?;
    tracing::warn!(%gateway, order = ?number, session = session_id, payment = payment_id, "a second payment on a paid session: giving it back");
    Ok(true)
}

/// The facts of an event about a second payment ([`second_payment`]): its refunds are recorded
/// against it (once each, never beyond it), and its disputes (for its give-back to wait on, and
/// for an operator to see); nothing about it moves a seller's money. `None`: the event is not
/// about a second payment.
async fn second_payment_facts(
    tx: &mut PgConnection,
    gateway: GatewayName,
    payment: &PaymentRef,
    facts: &[Fact],
) -> Result<Option<Applied>, ProcessError> {
    let Some(pid) = &payment.payment_id else {
        return Ok(None);
    };
    let known: Option<(i64, Option<Decimal>, Option<String>)> = sqlx::query_as(
        "SELECT id, amount, currency::text FROM second_payments WHERE gateway = $1 AND payment_id = $2 FOR UPDATE",
    )
    .bind(gateway)
    .bind(pid)
    .fetch_optional(&mut *tx)
    .await?;
    let Some((id, amount, currency)) = known else {
        return Ok(None);
    };
    let paid = currency
        .as_deref()
        .and_then(|c| c.parse().ok())
        .zip(amount)
        .and_then(|(c, a)| Money::new(a, c).ok());
    let mut changed = false;
    for fact in facts {
        let (refund_id, refunded) = match fact {
            Fact::Refund { refund_id, amount } => (refund_id, amount),
            Fact::Dispute {
                dispute_id,
                amount,
                status,
            } => {
                changed |= record_dispute(
                    tx,
                    gateway,
                    DisputeOf::Second(id),
                    paid,
                    dispute_id,
                    amount,
                    *status,
                )
                .await?;
                continue;
            }
            Fact::DisputeDecided { dispute_id, status } => {
                changed |=
                    decide_dispute(tx, gateway, DisputeOf::Second(id), dispute_id, *status).await?;
                continue;
            }
            // Its give-back failed or was canceled: ended for good, as an order's refund is.
            Fact::RefundEnded {
                refund_id,
                canceled,
            } => {
                changed |= end_refund(tx, gateway, refund_id, *canceled).await?;
                continue;
            }
            _ => continue,
        };
        if currency.as_deref() != Some(refunded.currency().as_str()) && currency.is_some() {
            return Err(Rejection::Currency {
                what: "refund",
                id: refund_id.clone(),
                got: refunded.currency().to_string(),
                payment: currency.clone().unwrap_or_default(),
            }
            .into());
        }
        if refund_ended(tx, gateway, refund_id).await? {
            continue;
        }
        let recorded = sqlx::query(
            "INSERT INTO second_payment_refunds (second_payment_id, refund_id, amount) VALUES ($1, $2, $3)
             ON CONFLICT DO NOTHING",
        )
        .bind(id)
        .bind(refund_id)
        .bind(refunded.amount())
        .execute(&mut *tx)
        .await?;
        if recorded.rows_affected() == 0 {
            continue;
        }
        let total: Decimal = sqlx::query_scalar(
            "UPDATE second_payments SET amount_refunded = amount_refunded + $2, updated_at = now()
             WHERE id = $1 RETURNING amount_refunded",
        )
        .bind(id)
        .bind(refunded.amount())
        .fetch_one(&mut *tx)
        .await?;
        if let Some(paid) = amount
            && total > paid
        {
            return Err(Rejection::RefundExceedsPayment {
                refund_id: refund_id.clone(),
                amount: *refunded,
                total: Money::new(total, refunded.currency()).unwrap_or(*refunded),
                paid: Money::new(paid, refunded.currency()).unwrap_or(*refunded),
            }
            .into());
        }
        changed = true;
    }
    Ok(Some(if changed {
        Applied::Changed
    } else {
        Applied::Unchanged
    }))
}

async fn record_refund(
    tx: &mut PgConnection,
    gateway: GatewayName,
    payment_order: i64,
    paid: Money,
    refund_id: &str,
    amount: &Money,
    event_id: Option<i64>,
) -> Result<bool, ProcessError> {
    let known: Option<i64> =
        sqlx::query_scalar("SELECT id FROM payment_refunds WHERE gateway = $1 AND refund_id = $2")
            .bind(gateway.as_str())
            .bind(refund_id)
            .fetch_optional(&mut *tx)
            .await?;
    if refund_ended(tx, gateway, refund_id).await? {
        return Ok(false);
    }
    if known.is_some() {
        // Recorded already, by an event whose transaction ran beside the one that stored the
        // gateway's `pending` answer on the request: neither saw the other's row, and the
        // request was left `accepted` with its refund done. Asking about it again ends here.
        request_done(tx, gateway, refund_id).await?;
        return Ok(false);
    }
    same_currency("refund", refund_id, amount, &paid)?;
    let refunded: Decimal = sqlx::query_scalar(
        "SELECT COALESCE(sum(amount), 0) FROM payment_refunds WHERE payment_order_id = $1",
    )
    .bind(payment_order)
    .fetch_one(&mut *tx)
    .await?;
    let total = Money::new(refunded, paid.currency())
        .ok()
        .and_then(|r| r.checked_add(amount));
    match total {
        Some(total) if total.amount() <= paid.amount() => {}
        total => {
            return Err(Rejection::RefundExceedsPayment {
                refund_id: refund_id.to_owned(),
                amount: *amount,
                total: total.unwrap_or(*amount),
                paid,
            }
            .into());
        }
    }
    sqlx::query(
        "INSERT INTO payment_refunds (payment_order_id, gateway, refund_id, amount, currency, event_id)
         VALUES ($1, $2, $3, $4, $5, $6)",
    )
    .bind(payment_order)
    .bind(gateway.as_str())
    .bind(refund_id)
    .bind(amount.amount())
    .bind(amount.currency().to_string())
    .bind(event_id)
    .execute(&mut *tx)
    .await?;
    request_done(tx, gateway, refund_id).await?;
    Ok(true)
}

/// An operator's refund the gateway had only accepted is done now.
async fn request_done(
    tx: &mut PgConnection,
    gateway: GatewayName,
    refund_id: &str,
) -> Result<(), sqlx::Error> {
    sqlx::query(
        "UPDATE refund_requests SET state = 'succeeded', updated_at = now()
         WHERE gateway = $1 AND refund_id = $2 AND state = 'accepted'",
    )
    .bind(gateway.as_str())
    .bind(refund_id)
    .execute(&mut *tx)
    .await?;
    Ok(())
}

/// A refund the gateway took ends without moving money: its request ends `failed` or
/// `canceled`, and its amount is free again. One already recorded as done is not undone here:
/// it is logged for an operator (the ledger has debited it).
async fn end_refund(
    tx: &mut PgConnection,
    gateway: GatewayName,
    refund_id: &str,
    canceled: bool,
) -> Result<bool, ProcessError> {
    let (state, why) = if canceled {
        ("canceled", "the gateway canceled the refund")
    } else {
        ("failed", "the gateway reported the refund failed")
    };
    let ended = sqlx::query(
        "UPDATE refund_requests SET state = $3, failure = $4, updated_at = now()
         WHERE gateway = $1 AND refund_id = $2 AND state IN ('requested', 'accepted')",
    )
    .bind(gateway)
    .bind(refund_id)
    .bind(state)
    .bind(why)
    .execute(&mut *tx)
    .await?;
    // Kept whether or not we asked for it (a refund made in the gateway's dashboard has no
    // request here), so a late report of its success finds it ended.
    let first = sqlx::query(
        "INSERT INTO refunds_ended (gateway, refund_id, state) VALUES ($1, $2, $3)
         ON CONFLICT DO NOTHING",
    )
    .bind(gateway)
    .bind(refund_id)
    .bind(state)
    .execute(&mut *tx)
    .await?;
    let done: bool = sqlx::query_scalar(
        "SELECT EXISTS (SELECT 1 FROM payment_refunds WHERE gateway = $1 AND refund_id = $2)
             OR EXISTS (SELECT 1 FROM second_payment_refunds r JOIN second_payments p ON p.id = r.second_payment_id
                        WHERE p.gateway = $1 AND r.refund_id = $2)",
    )
    .bind(gateway)
    .bind(refund_id)
    .fetch_one(&mut *tx)
    .await?;
    if done && first.rows_affected() > 0 {
        tracing::error!(%gateway, refund = refund_id, state, "a refund recorded as done was later reported {state}: the buyer may not have the money back; an operator must look (consistency check refund_failed_after_done)");
    }
    Ok(ended.rows_affected() + first.rows_affected() > 0)
}

/// How the gateway reported `refund_id` ended (`failed`, `canceled`), if it did: an answer
/// saying it succeeded that comes after (replayed under the same idempotency key after a
/// timeout) does not make it so.
pub(super) async fn ended_as(
    tx: &mut PgConnection,
    gateway: GatewayName,
    refund_id: &str,
) -> Result<Option<String>, sqlx::Error> {
    sqlx::query_scalar("SELECT state FROM refunds_ended WHERE gateway = $1 AND refund_id = $2")
        .bind(gateway)
        .bind(refund_id)
        .fetch_optional(&mut *tx)
        .await
}

/// Whether the gateway reported `refund_id` failed or canceled: such a refund never moves money,
/// whatever report of its success arrives after (gateways keep no order among deliveries).
async fn refund_ended(
    tx: &mut PgConnection,
    gateway: GatewayName,
    refund_id: &str,
) -> Result<bool, sqlx::Error> {
    let ended = ended_as(tx, gateway, refund_id).await?.is_some();
    if ended {
        tracing::warn!(%gateway, refund = refund_id, "a success reported of a refund the gateway had reported ended: not recorded");
    }
    Ok(ended)
}

/// A refund or dispute moves money in the payment's currency, never another.
fn same_currency(
    what: &'static str,
    id: &str,
    amount: &Money,
    paid: &Money,
) -> Result<(), Rejection> {
    if amount.currency() == paid.currency() {
        return Ok(());
    }
    Err(Rejection::Currency {
        what,
        id: id.to_owned(),
        got: amount.currency().to_string(),
        payment: paid.currency().to_string(),
    })
}

/// A dispute moves once, from open to decided. A decided dispute stays decided whatever
/// arrives later (a late "created", another decision, a status we do not know).
/// Whose dispute it is: the order's payment (`payment_disputes`, which the ledger takes back
/// from the seller), or a second payment on its session (`second_payment_disputes`, which moves
/// no seller's money: that payment is given back, never the seller's sale).
#[derive(Debug, Clone, Copy)]
enum DisputeOf {
    Order(i64),
    Second(i64),
}

impl DisputeOf {
    /// Its table, and the column naming the payment.
    fn table(self) -> (&'static str, &'static str, i64) {
        match self {
            Self::Order(id) => ("payment_disputes", "payment_order_id", id),
            Self::Second(id) => ("second_payment_disputes", "second_payment_id", id),
        }
    }
}

/// Records a dispute of a payment of `paid` (when known) or its new status: a new dispute
/// starts open unless reported decided, an open one is decided once, a decided one stays so.
async fn record_dispute(
    tx: &mut PgConnection,
    gateway: GatewayName,
    of: DisputeOf,
    paid: Option<Money>,
    dispute_id: &str,
    amount: &Money,
    status: Option<DisputeStatus>,
) -> Result<bool, ProcessError> {
    let (table, payment_column, payment) = of.table();
    let known: Option<DisputeStatus> = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT status FROM {table} WHERE gateway = $1 AND dispute_id = $2 FOR UPDATE"
    )))
    .bind(gateway.as_str())
    .bind(dispute_id)
    .fetch_optional(&mut *tx)
    .await?;
    match (known, status) {
        (None, status) => {
            if let Some(paid) = paid {
                same_currency("dispute", dispute_id, amount, &paid)?;
                if amount.amount() > paid.amount() {
                    return Err(Rejection::DisputeExceedsPayment {
                        dispute_id: dispute_id.to_owned(),
                        amount: *amount,
                        paid,
                    }
                    .into());
                }
            }
            // An order's dispute keeps what its payment's recorded refunds had given back when
            // it was first recorded: ended as a refund, the part of it those earlier refunds
            // would cover is held back from the seller's payouts until refunds recorded after
            // it cover it (`ledger::payouts`). First heard of as ended by a refund (its
            // opening never came, or came later), its refund may be among those recorded
            // already: a recorded refund of exactly its amount counts as its own.
            let status = status.unwrap_or(DisputeStatus::Open);
            let (before_column, before_value) = match of {
                DisputeOf::Order(_) => (
                    ", refunded_before",
                    ", (SELECT CASE WHEN $4 = 'refunded' AND bool_or(r.amount = $5)
                                    THEN sum(r.amount) - $5
                                    ELSE COALESCE(sum(r.amount), 0) END
                        FROM payment_refunds r WHERE r.payment_order_id = $1)",
                ),
                DisputeOf::Second(_) => ("", ""),
            };
            sqlx::query(sqlx::AssertSqlSafe(format!(
                "INSERT INTO {table} ({payment_column}, gateway, dispute_id, status, amount, currency{before_column})
                 VALUES ($1, $2, $3, $4, $5, $6{before_value})"
            )))
            .bind(payment)
            .bind(gateway.as_str())
            .bind(dispute_id)
            .bind(status)
            .bind(amount.amount())
            .bind(amount.currency().to_string())
            .execute(&mut *tx)
            .await?;
            Ok(true)
        }
        (Some(DisputeStatus::Open), Some(next)) if next.is_decided() => {
            decide_dispute(tx, gateway, of, dispute_id, next).await
        }
        (Some(current), Some(next)) if current.is_decided() && next != current => {
            tracing::warn!(%gateway, dispute = dispute_id, %current, reported = %next, "a decided dispute stays decided; ignoring the later status");
            Ok(false)
        }
        _ => Ok(false),
    }
}

/// Decides a dispute in `of`'s table, if it is open there (a decision of a dispute never
/// opened, or decided already, changes nothing).
async fn decide_dispute(
    tx: &mut PgConnection,
    gateway: GatewayName,
    of: DisputeOf,
    dispute_id: &str,
    status: DisputeStatus,
) -> Result<bool, ProcessError> {
    let (table, _, _) = of.table();
    let rows = sqlx::query(sqlx::AssertSqlSafe(format!(
        "UPDATE {table} SET status = $3, updated_at = now()
         WHERE gateway = $1 AND dispute_id = $2 AND status = 'open'"
    )))
    .bind(gateway.as_str())
    .bind(dispute_id)
    .bind(status)
    .execute(&mut *tx)
    .await?;
    Ok(rows.rows_affected() > 0)
}

/// Everything recorded about a payment.
#[derive(sqlx::FromRow)]
struct Known {
    session_id: String,
    payment_id: Option<String>,
    succeeded: bool,
    failed: bool,
    amount: Option<Decimal>,
    currency: Option<String>,
    refunded: Decimal,
    disputes: Vec<DisputeStatus>,
    /// The payment side's record of the session, when a checkout asked for it.
    order_number: Option<i64>,
    url: Option<String>,
    metadata: Option<serde_json::Value>,
    attempt: Option<i32>,
    /// The gateway's subscription its first payment started there (`Fact::Subscribed`).
    subscription_ref: Option<String>,
}

/// Derives the payment's status from its facts and brings the payment row and its order in
/// line. The order is found through the payment side's own record of the session
/// (`payment_sessions`): a payment that no checkout asked for is recorded as an unmatched payment
/// for an operator, never turned into an order. Returns whether the order (or the unmatched
/// record) changed, and the seller whose sale is due.
async fn derive_and_apply(
    tx: &mut PgConnection,
    gateway: GatewayName,
    po_id: i64,
    event_id: Option<i64>,
) -> Result<(bool, Option<Due>), ProcessError> {
    let known: Known = sqlx::query_as(
        "SELECT po.session_id, po.payment_id, po.succeeded_at IS NOT NULL AS succeeded,
                po.failed_at IS NOT NULL AS failed, po.amount, po.currency::text AS currency,
                COALESCE((SELECT sum(amount) FROM payment_refunds r WHERE r.payment_order_id = po.id), 0) AS refunded,
                ARRAY(SELECT status FROM payment_disputes d WHERE d.payment_order_id = po.id) AS disputes,
                ps.order_number, ps.url, ps.metadata, ps.attempt, po.subscription_ref
         FROM payment_orders po
         LEFT JOIN payment_sessions ps ON ps.gateway = $2 AND ps.session_id = po.session_id
         WHERE po.id = $1",
    )
    .bind(po_id)
    .bind(gateway)
    .fetch_one(&mut *tx)
    .await?;
    let Known {
        session_id,
        payment_id,
        succeeded,
        failed,
        amount,
        currency,
        refunded,
        disputes,
        order_number,
        url,
        metadata,
        attempt,
        subscription_ref,
    } = known;
    let facts = Facts {
        succeeded,
        failed,
        amount,
        refunded,
        disputes,
    };
    let status = derive_status(&facts);
    sqlx::query(
        "UPDATE payment_orders SET status = $2, amount_refunded = $3, updated_at = now()
         WHERE id = $1 AND (status <> $2 OR amount_refunded <> $3)",
    )
    .bind(po_id)
    .bind(status)
    .bind(refunded)
    .execute(&mut *tx)
    .await?;
    let paid: Option<Money> = amount
        .zip(currency.as_deref())
        .and_then(|(a, c)| Money::new(a, c.parse().ok()?).ok());
    let session: Option<(i64, String, serde_json::Value, i32)> =
        match (order_number, url, metadata, attempt) {
            (Some(n), Some(url), Some(metadata), Some(attempt)) => {
                Some((n, url, metadata, attempt))
            }
            _ => None,
        };
    let effect = match &session {
        Some((number, url, _, attempt)) => {
            let through = orders::PaidThrough {
                session_id: &session_id,
                url,
                attempt: *attempt,
                payment_id: payment_id.as_deref(),
            };
            orders::apply_payment(tx, *number, gateway, through, status, paid, refunded).await?
        }
        None => None,
    };
    let seller_account = session
        .as_ref()
        .and_then(|(_, _, m, _)| super::seller_account(m));
    let give_back = |number: Option<i64>, reason: &str| RefundPayment {
        gateway,
        order_number: number,
        session_id: session_id.clone(),
        payment_id: payment_id.clone(),
        amount: paid,
        seller_account: seller_account.clone(),
        reason: reason.to_owned(),
        of_payment: false,
    };
    // A subscription's first payment given back starts no subscription here: the gateway
    // that started one must stop billing it.
    let stop_subscription = |reason: &str| {
        subscription_ref.as_ref().map(|subscription| {
            super::subscriptions::StopUnstartedSubscription {
                gateway,
                subscription: subscription.clone(),
                seller_account: seller_account.clone(),
                reason: reason.to_owned(),
            }
        })
    };
    let mut due = None;
    let changed = match effect {
        None => {
            record_unmatched(
                tx,
                gateway,
                &session_id,
                payment_id.as_deref(),
                status,
                paid,
                event_id,
            )
            .await
        }
        Some(effect @ (PaymentEffect::Changed | PaymentEffect::Unchanged)) => {
            if let Some((number, _, _, _)) = &session {
                let taken_back = !refunded.is_zero() || !facts.disputes.is_empty();
                due = sync_ledger(tx, gateway, po_id, *number, taken_back).await?;
            }
            Ok(effect == PaymentEffect::Changed)
        }
        // Money that cannot confirm its order goes back to the buyer, automatically and once
        // (the refund job is keyed by the session, the gateway asked with an idempotency key),
        // and stays visible: an order event, or an unmatched payment for a wrong amount.
        Some(PaymentEffect::AmountMismatch { order, paid: got }) => {
            let number = session.as_ref().map(|(n, _, _, _)| *n);
            record_unmatched(
                tx,
                gateway,
                &session_id,
                payment_id.as_deref(),
                status,
                Some(got),
                event_id,
            )
            .await?;
            let reason = format!("paid {got} for an order of {order}");
            let first = give_back_unmatched(tx, &give_back(number, &reason)).await?;
            if first {
                if let Some(stop) = stop_subscription(&reason) {
                    queue::enqueue(&mut *tx, stop.job()?).await?;
                }
                tracing::warn!(%gateway, order = ?number, %got, %order, "a payment of the wrong amount: refunding it");
            }
            Ok(first)
        }
        Some(PaymentEffect::Refund { reason, first }) => {
            if first {
                let number = session.as_ref().map(|(n, _, _, _)| *n);
                queue::enqueue(&mut *tx, give_back(number, reason.as_str()).job()?).await?;
                if let Some(stop) = stop_subscription(reason.as_str()) {
                    queue::enqueue(&mut *tx, stop.job()?).await?;
                }
                // A renewal's charge its order cannot take because the subscription has ended
                // here (a period after the end, one the end left unpaid, as a halted Razorpay
                // subscription the buyer takes up again): the gateway still bills it, and is
                // asked to stop, once for this charge, by whatever path its success came (the
                // gateway's event, reconciliation).
                let renewal_of = session.as_ref().and_then(|(_, _, m, _)| {
                    m.get("subscription").and_then(serde_json::Value::as_str)
                });
                if let (Some(subscription), Some(number)) = (renewal_of, number)
                    && orders::subscriptions::billed_after_end(tx, number).await?
                {
                    let stop = super::subscriptions::StopUnstartedSubscription {
                        gateway,
                        subscription: subscription.to_owned(),
                        seller_account: seller_account.clone(),
                        reason: format!(
                            "charged {session_id} (order {number}) after subscription {subscription} ended here"
                        ),
                    };
                    queue::enqueue(&mut *tx, stop.job_after(&session_id)?).await?;
                    tracing::warn!(%gateway, %subscription, session = %session_id, order = number, "a charge after the subscription ended here: giving it back and asking the gateway to stop billing");
                }
                tracing::warn!(%gateway, order = ?number, %reason, "a payment the order cannot take: refunding it");
            }
            Ok(true)
        }
    }?;
    Ok((changed, due))
}

/// Brings the seller's ledger in line with a confirmed order's payment: the sale, each refund,
/// each dispute in its current status. Every posting is keyed by its source, so running this
/// again (a duplicate, a reprocessed event) posts nothing twice, and facts that arrived in any
/// order end in the same ledger.
///
/// A sale with nothing taken back (nearly every payment) is posted here when no poster has its
/// seller's turn, else recorded as due and returned, for the poster to post once this
/// transaction has committed (`ledger::poster`): a seller's flash sale never queues its
/// payments on the seller's accounts. A sale with refunds or disputes is posted here, under the
/// seller's accounts, before what is taken back from it. `taken_back`: whether the payment has
/// refunds or disputes (when it has none, they are not looked for).
async fn sync_ledger(
    tx: &mut PgConnection,
    gateway: GatewayName,
    po_id: i64,
    number: i64,
    taken_back: bool,
) -> Result<Option<Due>, ProcessError> {
    let channel = sales::Channel::Gateway(gateway);
    if !taken_back {
        return Ok(crate::ledger::poster::post_or_defer(tx, number, channel).await?);
    }
    // Refunds, then disputes, each in the order recorded: the first key not posted carries what
    // is left to take (`settle_take_backs`).
    let taken: Vec<TakenBackRow> = sqlx::query_as(
        "SELECT id, amount, status FROM (
             SELECT 0 AS source, id AS seq, refund_id AS id, amount, NULL::text AS status
             FROM payment_refunds WHERE payment_order_id = $1
             UNION ALL
             SELECT 1, id, dispute_id, amount, status FROM payment_disputes WHERE payment_order_id = $1
         ) t ORDER BY source, seq",
    )
    .bind(po_id)
    .fetch_all(&mut *tx)
    .await?;
    if taken.is_empty() {
        return Ok(crate::ledger::poster::post_or_defer(tx, number, channel).await?);
    }
    let Some(sale) = Sale::of_order(tx, number, channel).await? else {
        return Ok(None);
    };
    let money = |d: Decimal| {
        Money::new(d, sale.total.currency())
            .map_err(|_| crate::ledger::LedgerError::Mismatch(format!("order {number}")))
    };
    sales::record_sale(tx, &sale).await?;
    let mut facts = Vec::with_capacity(taken.len());
    for t in taken {
        facts.push(match t.status {
            None => sales::TakeBack::Refund {
                refund_id: t.id,
                amount: money(t.amount)?,
            },
            Some(status) => sales::TakeBack::Dispute {
                dispute_id: t.id,
                amount: money(t.amount)?,
                status,
            },
        });
    }
    sales::settle_take_backs(tx, &sale, &facts).await?;
    Ok(None)
}

/// A refund or a dispute of a payment, as [`sync_ledger`] reads them.
#[derive(sqlx::FromRow)]
struct TakenBackRow {
    id: String,
    amount: Decimal,
    /// `None`: a refund.
    status: Option<DisputeStatus>,
}

/// A payment no checkout asked for: kept for an operator, with its latest state.
#[allow(clippy::too_many_arguments)]
/// Gives an unmatched payment (recorded by [`record_unmatched`]) back to its buyer, once: the
/// session's later events (the refund's own, a resend) find it asked for. Returns whether this
/// asked.
pub(super) async fn give_back_unmatched(
    tx: &mut PgConnection,
    refund: &RefundPayment,
) -> Result<bool, ProcessError> {
    let first = sqlx::query(
        "UPDATE unmatched_payments SET given_back_at = now()
         WHERE gateway = $1 AND session_id = $2 AND given_back_at IS NULL",
    )
    .bind(refund.gateway)
    .bind(&refund.session_id)
    .execute(&mut *tx)
    .await?
    .rows_affected()
        > 0;
    if first {
        queue::enqueue(&mut *tx, refund.job()?).await?;
    }
    Ok(first)
}

async fn record_unmatched(
    tx: &mut PgConnection,
    gateway: GatewayName,
    session_id: &str,
    payment_id: Option<&str>,
    status: crate::payment_status::PaymentOrderStatus,
    paid: Option<Money>,
    event_id: Option<i64>,
) -> Result<bool, ProcessError> {
    let changed = sqlx::query(
        "INSERT INTO unmatched_payments (gateway, session_id, payment_id, status, amount, currency, event_id)
         VALUES ($1, $2, $3, $4, $5, $6, $7)
         ON CONFLICT (gateway, session_id) DO UPDATE SET
             payment_id = COALESCE(EXCLUDED.payment_id, unmatched_payments.payment_id),
             status = EXCLUDED.status,
             amount = COALESCE(EXCLUDED.amount, unmatched_payments.amount),
             currency = COALESCE(EXCLUDED.currency, unmatched_payments.currency),
             updated_at = now()
         WHERE unmatched_payments.status IS DISTINCT FROM EXCLUDED.status
            OR unmatched_payments.payment_id IS DISTINCT FROM COALESCE(EXCLUDED.payment_id, unmatched_payments.payment_id)
            OR unmatched_payments.amount IS DISTINCT FROM COALESCE(EXCLUDED.amount, unmatched_payments.amount)",
    )
    .bind(gateway)
    .bind(session_id)
    .bind(payment_id)
    .bind(status)
    .bind(paid.map(|m| m.amount()))
    .bind(paid.map(|m| m.currency().to_string()))
    .bind(event_id)
    .execute(&mut *tx)
    .await?;
    if changed.rows_affected() > 0 {
        tracing::warn!(%gateway, session = session_id, %status, "a payment no checkout asked for: recorded as unmatched");
    }
    Ok(changed.rows_affected() > 0)
}

/// The gateways whose stored events may hold facts about `gateway`'s payments
/// (`EventFormat::event_sources`: its own, and an acquirer's, whose events arrive through its
/// own webhook). Waking an event that turns out to be about another payment only makes it wait
/// again.
fn event_sources(gateway: GatewayName) -> &'static [GatewayName] {
    crate::gateways::format(gateway).event_sources()
}

/// Enqueues, in this transaction, the processing of every event that waited for one of these
/// payment keys. An event whose job is still unfinished keeps that job (the key is taken).
pub(super) async fn wake_waiting(
    tx: &mut PgConnection,
    gateway: GatewayName,
    keys: &[String],
    current_event: Option<i64>,
) -> Result<(), ProcessError> {
    let keys: Vec<(GatewayName, &str)> = keys.iter().map(|k| (gateway, k.as_str())).collect();
    wake_waiting_many(tx, &keys, current_event.as_slice()).await
}

/// [`wake_waiting`] for the payments of many events at once (`keys`: each payment's gateway and
/// key), in one statement; `current`: the events being processed, which never wake themselves.
pub(super) async fn wake_waiting_many(
    tx: &mut PgConnection,
    keys: &[(GatewayName, &str)],
    current: &[i64],
) -> Result<(), ProcessError> {
    let (sources, names) = waiting_keys(keys);
    let waiting: Vec<Waiting> = sqlx::query_as(WAITING_FOR_KEYS.as_str())
        .bind(&sources)
        .bind(&names)
        .bind(current)
        .fetch_all(&mut *tx)
        .await?;
    enqueue_woken(tx, &waiting).await
}

/// An event that waits for a payment key: its gateway, id and body.
pub(super) type Waiting = (GatewayName, String, Vec<u8>);

/// The keys as the read of their waiting events takes them: each key under every gateway whose
/// events may wait for it (the event sources of its gateway).
pub(super) fn waiting_keys(keys: &[(GatewayName, &str)]) -> (Vec<GatewayName>, Vec<String>) {
    let (mut sources, mut names) = (Vec::new(), Vec::new());
    for (gateway, key) in keys {
        for source in event_sources(*gateway) {
            sources.push(*source);
            names.push((*key).to_owned());
        }
    }
    (sources, names)
}

/// The events waiting for some of the keys `sources` and `names` (parallel text arrays) name,
/// but none of `current` (a bigint array: the events being processed): SQL over those three
/// parameters, which a statement may place as a `WITH` of its own.
pub(super) fn waiting_for_keys_sql(sources: &str, names: &str, current: &str) -> String {
    // Through the index of waiting events, whatever the plan makes of the arrays.
    format!(
        "SELECT e.gateway, e.event_id, e.raw_body FROM payment_events e
         WHERE e.outcome = 'waiting' AND e.waiting_for = ANY({names}) AND NOT (e.id = ANY({current}))
           AND (e.gateway, e.waiting_for) IN (SELECT * FROM unnest({sources}::text[], {names}::text[]))"
    )
}

static WAITING_FOR_KEYS: LazyLock<String> =
    LazyLock::new(|| waiting_for_keys_sql("$1", "$2", "$3"));

/// Enqueues again, in this transaction, the processing of events found waiting for a payment
/// that is now known.
pub(super) async fn enqueue_woken(
    tx: &mut PgConnection,
    waiting: &[Waiting],
) -> Result<(), ProcessError> {
    if waiting.is_empty() {
        return Ok(());
    }
    let jobs: Vec<NewJob> = waiting
        .iter()
        .map(|(source, id, body)| ProcessPaymentEvent::job_for_body(*source, id, body))
        .collect::<Result<_, _>>()?;
    // A waiter whose own run is still being recorded (it decided to wait moments ago) runs
    // again after it: it must not miss its payment.
    let woken = queue::enqueue_or_rerun(&mut *tx, &jobs).await?;
    tracing::info!(
        waiting = waiting.len(),
        woken,
        "payment known: waiting events enqueued again"
    );
    Ok(())
}

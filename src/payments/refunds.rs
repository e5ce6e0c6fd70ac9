//! Giving back a payment its order cannot take: it arrived after the order expired (the stated
//! rule: the order stays expired and the buyer gets the money back, automatically, once), the
//! order was already paid through another session, or the amount was not the order's. The job
//! is keyed by the session and the gateway is asked with an idempotency key of its own, so the
//! refund happens once however often the job runs. A refund the gateway answers as done is
//! recorded at once, through the same path as its refund event (which then finds it known): a
//! lost webhook cannot leave the buyer refunded and the payment shown as kept.

use serde::{Deserialize, Serialize};

use rust_decimal::Decimal;
use sqlx::PgPool;

use crate::gateways::api::{GatewayError, RefundOutcome, RefundQuery, RefundRequest};
use crate::gateways::{Fact, GatewayName, GatewayRegistry, PaymentRef};
use crate::money::Money;
use payfleet_queue::{self as queue, Job, JobContext, JobError, NewJob, QueueError, Worker};

use super::order_refunds::CarryOutRefund;

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RefundPayment {
    pub gateway: GatewayName,
    pub order_number: Option<i64>,
    pub session_id: String,
    pub payment_id: Option<String>,
    pub amount: Option<Money>,
    pub seller_account: Option<String>,
    pub reason: String,
    /// One payment among several on its session (a second payment): keyed, at the gateway too,
    /// by the payment rather than the session, which has its own payment.
    #[serde(default)]
    pub of_payment: bool,
}

impl Job for RefundPayment {
    const KIND: &'static str = "refund_payment";
    const QUEUE: &'static str = "payments";
}

impl RefundPayment {
    /// What the refund is keyed by: the session, or the session and its payment.
    fn subject(&self) -> String {
        match (&self.payment_id, self.of_payment) {
            (Some(p), true) => format!("{}:{p}", self.session_id),
            _ => self.session_id.clone(),
        }
    }

    pub fn job(&self) -> Result<NewJob, QueueError> {
        Ok(NewJob::of(self)?.key(Self::key_of(self.gateway, &self.subject())))
    }

    /// The key of the give-back of `subject` (a session, or `<session>:<payment>` for a second
    /// payment on it).
    pub fn key_of(gateway: GatewayName, subject: &str) -> String {
        format!("refund_payment:{gateway}:{subject}")
    }

    /// What the payment side knows of the payment now, which may be more than when the job
    /// was asked for: a payment can be given back before the gateway named it (a Stripe
    /// subscription's first payment is named by its invoice's event, which may come later),
    /// and refunds made since (at the gateway's dashboard, or reported with the payment, as a
    /// Mercado Pago lookup does) may have given some or all of it back already.
    async fn known_now(&self, pool: &PgPool) -> Result<Option<KnownPayment>, sqlx::Error> {
        match (&self.payment_id, self.of_payment) {
            (Some(payment_id), true) => {
                sqlx::query_as(
                    "SELECT payment_id, amount, currency::text AS currency, amount_refunded
                     FROM second_payments WHERE gateway = $1 AND payment_id = $2",
                )
                .bind(self.gateway)
                .bind(payment_id)
                .fetch_optional(pool)
                .await
            }
            _ => {
                sqlx::query_as(
                    "SELECT payment_id, amount, currency::text AS currency, amount_refunded
                     FROM payment_orders WHERE gateway = $1 AND session_id = $2",
                )
                .bind(self.gateway)
                .bind(&self.session_id)
                .fetch_optional(pool)
                .await
            }
        }
    }

    pub async fn run(&self, pool: &PgPool, gateways: &GatewayRegistry) -> Result<(), JobError> {
        let known = self.known_now(pool).await?;
        let refunded = known.as_ref().map_or(Decimal::ZERO, |k| k.amount_refunded);
        let payment_id = self
            .payment_id
            .clone()
            .or_else(|| known.as_ref().and_then(|k| k.payment_id.clone()));
        let amount = self
            .amount
            .or_else(|| known.as_ref().and_then(KnownPayment::paid));
        // Without these the gateway cannot be asked. The gateway's event naming them may still
        // come: the job retries with the queue's backoff and, when its attempts run out, ends
        // dead, listed for an operator to refund by hand (`payfleet jobs dead`), never silently.
        let (Some(payment_id), Some(amount)) = (payment_id, amount) else {
            return Err(JobError::retry(format!(
                "{} session {} ({}): no payment id or amount to refund with yet; waiting for the gateway's event naming them (refund it at the gateway by hand if it never comes)",
                self.gateway, self.session_id, self.reason
            )));
        };
        let left = Money::new(amount.amount() - refunded, amount.currency())
            .ok()
            .filter(|m| !m.is_zero());
        let Some(amount) = left else {
            tracing::info!(gateway = %self.gateway, order = ?self.order_number, payment = %payment_id, %amount, reason = %self.reason, "a payment to give back is refunded already");
            return Ok(());
        };
        // The buyer may have disputed the payment meanwhile (the give-back retried through a
        // gateway outage, or waited for the event naming the payment; a payment taken twice is
        // what buyers dispute): while a dispute is open the gateway is not asked, and what a
        // chargeback took back is not given again.
        let (open, taken) = self.disputes(pool).await?;
        if open {
            return Err(JobError::Snooze(super::order_refunds::DISPUTE_HOLD));
        }
        let Some(amount) = Money::new(amount.amount() - taken, amount.currency())
            .ok()
            .filter(|m| m.amount() > Decimal::ZERO)
        else {
            tracing::warn!(gateway = %self.gateway, order = ?self.order_number, payment = %payment_id, %amount, %taken, reason = %self.reason, "a payment to give back was taken back by its disputes: nothing is given");
            return Ok(());
        };
        let gateway = gateways.get(self.gateway).ok_or_else(|| {
            JobError::retry(format!(
                "gateway {} is not enabled in this worker; the refund waits for one that has it",
                self.gateway
            ))
        })?;
        let request = RefundRequest {
            session_id: self.session_id.clone(),
            payment_id: payment_id.clone(),
            amount,
            seller_account: self.seller_account.clone(),
            idempotency_key: self.idempotency_key(pool).await?,
        };
        match gateway.refund(&request).await {
            Ok(receipt) => {
                tracing::info!(gateway = %self.gateway, order = ?self.order_number, refund = %receipt.refund_id, reason = %self.reason, "payment given back");
                let settle = SettleRefund {
                    gateway: self.gateway,
                    session_id: self.session_id.clone(),
                    payment_id: payment_id.clone(),
                    refund_id: receipt.refund_id,
                    amount,
                    seller_account: self.seller_account.clone(),
                };
                let mut tx = pool.begin().await?;
                if receipt.succeeded
                    && let Some(state) =
                        super::apply::ended_as(&mut tx, self.gateway, &settle.refund_id).await?
                {
                    // Reported ended before this answer (replayed under the same key) came:
                    // the buyer has nothing back. Dead, for an operator to see.
                    return Err(JobError::fail(format!(
                        "refund {} was reported {state} by the gateway: the payment was not given back",
                        settle.refund_id
                    )));
                }
                if receipt.succeeded {
                    settle.record(&mut tx, RefundOutcome::Succeeded).await?;
                } else {
                    queue::enqueue(&mut *tx, settle.job()?).await?;
                }
                tx.commit().await?;
                Ok(())
            }
            Err(e) if e.is_transient() => {
                self.pin_key(pool).await?;
                Err(JobError::retry(e))
            }
            Err(e) => {
                if !e.refused_outright() {
                    self.pin_key(pool).await?;
                } else if self.refused(pool, &e).await? {
                    // Its key kept after an ask without a clear answer: asked again under it,
                    // the gateway may answer this refusal for as long as it keeps the key.
                    return Err(JobError::fail(format!(
                        "{e}; the give-back's idempotency key {} is kept since an earlier ask got no clear answer, so the gateway may have refunded under it: look at the gateway for a refund of payment {payment_id} of session {}, and if there is none, refund it there by hand",
                        request.idempotency_key, self.session_id
                    )));
                }
                Err(JobError::fail(e))
            }
        }
    }

    /// The gateway's idempotency key for this give-back (migration 0089): one per payment,
    /// so that a retry after a timeout never refunds twice, and a new one after each refusal
    /// the gateway gave outright, which it would otherwise answer again to an operator's
    /// re-drive for as long as it keeps the key.
    async fn idempotency_key(&self, pool: &PgPool) -> Result<String, sqlx::Error> {
        let refusals: Option<i32> = sqlx::query_scalar(
            "SELECT refusals FROM give_back_keys WHERE gateway = $1 AND subject = $2",
        )
        .bind(self.gateway)
        .bind(self.subject())
        .fetch_optional(pool)
        .await?;
        let key = format!("payfleet-refund-{}-{}", self.gateway, self.subject());
        Ok(match refusals {
            Some(n) if n > 0 => format!("{key}-{n}"),
            _ => key,
        })
    }

    /// Keeps the current key for good: an ask under it ended without a clear answer, so the
    /// gateway may have made the refund under it.
    async fn pin_key(&self, pool: &PgPool) -> Result<(), sqlx::Error> {
        sqlx::query(
            "INSERT INTO give_back_keys (gateway, subject, pinned) VALUES ($1, $2, true)
             ON CONFLICT (gateway, subject) DO UPDATE SET pinned = true, updated_at = now()
             WHERE NOT give_back_keys.pinned",
        )
        .bind(self.gateway)
        .bind(self.subject())
        .execute(pool)
        .await?;
        Ok(())
    }

    /// Counts a refusal the gateway gave outright: nothing was refunded under its key, unless
    /// the key is pinned (an earlier ask under it may have refunded; the refusal may only say
    /// that this request differs from that one). Returns whether it is pinned.
    async fn refused(&self, pool: &PgPool, e: &GatewayError) -> Result<bool, sqlx::Error> {
        sqlx::query_scalar(
            "INSERT INTO give_back_keys (gateway, subject, refusals, last_refusal) VALUES ($1, $2, 1, $3)
             ON CONFLICT (gateway, subject) DO UPDATE
             SET refusals = give_back_keys.refusals + CASE WHEN give_back_keys.pinned THEN 0 ELSE 1 END,
                 last_refusal = EXCLUDED.last_refusal, updated_at = now()
             RETURNING pinned",
        )
        .bind(self.gateway)
        .bind(self.subject())
        .bind(e.to_string())
        .fetch_one(pool)
        .await
    }
}

impl RefundPayment {
    /// Whether a dispute of the payment is open, and what its lost disputes (and those closed
    /// by a refund, counted whole beside the recorded refunds: when in doubt the buyer is not
    /// paid twice) took back.
    async fn disputes(&self, pool: &PgPool) -> Result<(bool, Decimal), sqlx::Error> {
        let disputes: Vec<(String, Decimal)> = match (&self.payment_id, self.of_payment) {
            (Some(payment_id), true) => {
                sqlx::query_as(
                    "SELECT d.status, d.amount FROM second_payment_disputes d
                     JOIN second_payments p ON p.id = d.second_payment_id
                     WHERE p.gateway = $1 AND p.payment_id = $2",
                )
                .bind(self.gateway)
                .bind(payment_id)
                .fetch_all(pool)
                .await?
            }
            _ => {
                sqlx::query_as(
                    "SELECT d.status, d.amount FROM payment_disputes d
                     JOIN payment_orders po ON po.id = d.payment_order_id
                     WHERE po.gateway = $1 AND po.session_id = $2",
                )
                .bind(self.gateway)
                .bind(&self.session_id)
                .fetch_all(pool)
                .await?
            }
        };
        let open = disputes.iter().any(|(s, _)| s == "open");
        let taken = disputes
            .iter()
            .filter(|(s, _)| matches!(s.as_str(), "lost" | "refunded"))
            .map(|(_, a)| *a)
            .sum();
        Ok((open, taken))
    }
}

/// Why a payment was not asked to be given back again.
#[derive(Debug, thiserror::Error)]
pub enum GiveBackError {
    #[error(
        "no payment of {gateway} session {session} is one its order could not take (late, or extra: the order paid already; or of the wrong amount, or for a subscription that never started here){}: only those are given back by this; an order's own payment is refunded by POST /admin/orders/{{number}}/refunds",
        .payment.as_deref().map(|p| format!(" as payment {p}")).unwrap_or_default()
    )]
    NotToGiveBack {
        gateway: GatewayName,
        session: String,
        payment: Option<String>,
    },
    #[error(
        "payment {payment} is not one of {gateway} session {session}'s ({why}): a give-back refunds only a payment of the session it names, and the gateway would refund whichever payment it is told; find the session's own payment at the gateway"
    )]
    NotTheSessions {
        gateway: GatewayName,
        session: String,
        payment: String,
        why: String,
    },
    #[error(
        "a give-back of it is under way already: asked, retried, or accepted by the gateway and settling (payfleet jobs counts)"
    )]
    UnderWay,
    #[error(transparent)]
    Queue(#[from] QueueError),
    #[error(transparent)]
    Database(#[from] sqlx::Error),
}

/// Asks again to give back a payment its order could not take (a late or extra payment, as its
/// order's `late_payment` or `extra_payment` message recorded it; or one no order took, of the
/// wrong amount or for a subscription that never started, given back once as it came), for an
/// operator once its give-back job ended dead (`payment_not_given_back`,
/// `captured_payment_unconfirmed`): a job keyed as the first, which asks the
/// gateway under the give-back's idempotency key (the same one, unless the gateway refused it
/// outright: [`RefundPayment::idempotency_key`]), so what was given already is not given twice, and
/// which looks at the payment as recorded when it runs (refunds and disputes since). Returns the
/// job's id.
pub async fn give_back_again(
    pool: &PgPool,
    gateway: GatewayName,
    session: &str,
    payment: Option<&str>,
) -> Result<payfleet_queue::JobId, GiveBackError> {
    let session_of: Option<(i64, serde_json::Value)> = sqlx::query_as(
        "SELECT order_number, metadata FROM payment_sessions WHERE gateway = $1 AND session_id = $2",
    )
    .bind(gateway)
    .bind(session)
    .fetch_optional(pool)
    .await?;
    let found = match &session_of {
        Some((number, _)) => {
            crate::orders::payment_not_taken(pool, *number, session, payment).await?
        }
        None => None,
    };
    // Or a payment no order could take at all (of the wrong amount, or a charge for a
    // subscription that never started here), given back once when it came (`given_back_at`):
    // once its job ended dead and was deleted, nothing else asks the gateway again.
    let unmatched: Option<Option<String>> = if found.is_none() {
        sqlx::query_scalar(
            "SELECT payment_id FROM unmatched_payments
             WHERE gateway = $1 AND session_id = $2 AND given_back_at IS NOT NULL
               AND status IN ('succeeded', 'partially_refunded')
               AND ($3::text IS NULL OR payment_id = $3)",
        )
        .bind(gateway)
        .bind(session)
        .bind(payment)
        .fetch_optional(pool)
        .await?
    } else {
        None
    };
    let (kind, number, metadata, payment_id) = match (session_of, found, unmatched) {
        (Some((number, metadata)), Some(not_taken), _) => (
            not_taken.kind.to_string(),
            Some(number),
            metadata,
            payment.map(str::to_owned).or(not_taken.payment_id),
        ),
        (session_of, None, Some(unmatched)) => {
            let (number, metadata) = session_of.unzip();
            (
                "a payment no order took".to_owned(),
                number,
                metadata.unwrap_or_default(),
                payment.map(str::to_owned).or(unmatched),
            )
        }
        _ => {
            return Err(GiveBackError::NotToGiveBack {
                gateway,
                session: session.to_owned(),
                payment: payment.map(str::to_owned),
            });
        }
    };
    // A payment the operator names (its event may have named none: a Stripe subscription-mode
    // session's PaymentIntent comes later) goes to the gateway as it is: it must not be a payment
    // recorded for another session (the order's own, another order's), nor other than the ones
    // this session has recorded. A mistyped id would refund someone else's money.
    if let Some(named) = payment {
        let (elsewhere, here, this_one): (Option<String>, bool, bool) = sqlx::query_as(
            "WITH recorded AS (
                 SELECT session_id, payment_id FROM payment_orders WHERE gateway = $1 AND (payment_id = $2 OR session_id = $3)
                 UNION ALL SELECT session_id, payment_id FROM second_payments WHERE gateway = $1 AND (payment_id = $2 OR session_id = $3)
                 UNION ALL SELECT session_id, payment_id FROM unmatched_payments WHERE gateway = $1 AND (payment_id = $2 OR session_id = $3))
             SELECT (SELECT min(session_id) FROM recorded WHERE payment_id = $2 AND session_id <> $3),
                    EXISTS (SELECT 1 FROM recorded WHERE session_id = $3 AND payment_id IS NOT NULL),
                    EXISTS (SELECT 1 FROM recorded WHERE session_id = $3 AND payment_id = $2)",
        )
        .bind(gateway)
        .bind(named)
        .bind(session)
        .fetch_one(pool)
        .await?;
        let why = match elsewhere {
            Some(other) => Some(format!("it is session {other}'s")),
            None if here && !this_one => {
                Some("the session's payments recorded here are others".to_owned())
            }
            None => None,
        };
        if let Some(why) = why {
            return Err(GiveBackError::NotTheSessions {
                gateway,
                session: session.to_owned(),
                payment: named.to_owned(),
                why,
            });
        }
    }
    // A refund of it the gateway accepted and has not settled: asking again now would be a
    // second refund once the gateway's idempotency window has passed.
    let settling =
        payfleet_queue::admin::unfinished_payloads(pool, SettleRefund::QUEUE, SettleRefund::KIND)
            .await?
            .iter()
            .any(|p| p["gateway"] == gateway.as_str() && p["session_id"] == session);
    if settling {
        return Err(GiveBackError::UnderWay);
    }
    // A second payment on its session is keyed by itself; any other by its session.
    let second: bool = match &payment_id {
        Some(p) => sqlx::query_scalar(
            "SELECT EXISTS (SELECT 1 FROM second_payments WHERE gateway = $1 AND payment_id = $2 AND session_id = $3)",
        )
        .bind(gateway)
        .bind(p)
        .bind(session)
        .fetch_one(pool)
        .await?,
        None => false,
    };
    let refund = RefundPayment {
        gateway,
        order_number: number,
        session_id: session.to_owned(),
        payment_id,
        amount: None,
        seller_account: super::seller_account(&metadata),
        reason: format!("asked again by an operator ({kind} on session {session})"),
        of_payment: second,
    };
    queue::enqueue(pool, refund.job()?)
        .await?
        .ok_or(GiveBackError::UnderWay)
}

/// A payment as the payment side records it ([`RefundPayment::known_now`]).
#[derive(sqlx::FromRow)]
struct KnownPayment {
    payment_id: Option<String>,
    amount: Option<Decimal>,
    currency: Option<String>,
    amount_refunded: Decimal,
}

impl KnownPayment {
    fn paid(&self) -> Option<Money> {
        let currency = self.currency.as_deref()?.parse().ok()?;
        Money::new(self.amount?, currency).ok()
    }
}

/// A refund the gateway took without saying it was done (Stripe's `pending`, Razorpay's and
/// Mercado Pago's refunds under way): its outcome comes by the gateway's refund event, and when
/// that event never comes (a webhook lost for good), by this job, which asks the gateway after
/// [`SETTLE_AFTER`] and again with the queue's backoff until the refund has ended. The outcome
/// is recorded through the same path as the event (which then finds it known). A refund still
/// under way when the job's attempts run out leaves the job dead, for an operator.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SettleRefund {
    pub gateway: GatewayName,
    pub session_id: String,
    pub payment_id: String,
    pub refund_id: String,
    pub amount: Money,
    pub seller_account: Option<String>,
}

impl Job for SettleRefund {
    const KIND: &'static str = "settle_refund";
    const QUEUE: &'static str = "payments";
}

/// How long a refund's own event is waited for before the gateway is asked.
pub const SETTLE_AFTER: chrono::Duration = chrono::Duration::minutes(5);

impl SettleRefund {
    pub fn job(&self) -> Result<NewJob, QueueError> {
        Ok(NewJob::of(self)?
            .key(format!("settle_refund:{}:{}", self.gateway, self.refund_id))
            .run_at(chrono::Utc::now() + SETTLE_AFTER))
    }

    /// Records the refund's outcome as its event would.
    pub(super) async fn record(
        &self,
        tx: &mut sqlx::PgConnection,
        outcome: RefundOutcome,
    ) -> Result<(), super::ProcessError> {
        let fact = match outcome {
            RefundOutcome::Succeeded => Fact::Refund {
                refund_id: self.refund_id.clone(),
                amount: self.amount,
            },
            RefundOutcome::Failed | RefundOutcome::Canceled => Fact::RefundEnded {
                refund_id: self.refund_id.clone(),
                canceled: outcome == RefundOutcome::Canceled,
            },
            RefundOutcome::Pending => return Ok(()),
        };
        let payment = PaymentRef {
            session_id: Some(self.session_id.clone()),
            payment_id: Some(self.payment_id.clone()),
        };
        // A refund's fact posts its sale with it (under the seller's accounts) and leaves none
        // due; a refund that ended moves no money (a sale it found due is the sweep's).
        super::apply::apply(tx, self.gateway, &payment, &[fact], None).await?;
        Ok(())
    }

    pub async fn run(&self, pool: &PgPool, gateways: &GatewayRegistry) -> Result<(), JobError> {
        let gateway = gateways.get(self.gateway).ok_or_else(|| {
            JobError::retry(format!(
                "gateway {} is not enabled in this worker; the refund waits for one that has it",
                self.gateway
            ))
        })?;
        let outcome = gateway
            .refund_status(&RefundQuery {
                session_id: self.session_id.clone(),
                payment_id: self.payment_id.clone(),
                refund_id: self.refund_id.clone(),
                seller_account: self.seller_account.clone(),
            })
            .await
            .map_err(|e| match e.is_transient() {
                true => JobError::retry(e),
                false => JobError::fail(e),
            })?;
        if outcome == RefundOutcome::Pending {
            return Err(JobError::retry(format!(
                "{} refund {} is still under way",
                self.gateway, self.refund_id
            )));
        }
        let mut tx = pool.begin().await?;
        self.record(&mut tx, outcome).await?;
        // A refund someone asked for has its request, which now says it ended (its amount
        // free to ask again). A payment given back has none: ended, nothing would say so.
        let requested: bool = sqlx::query_scalar(
            "SELECT EXISTS (SELECT 1 FROM refund_requests WHERE gateway = $1 AND refund_id = $2)",
        )
        .bind(self.gateway)
        .bind(&self.refund_id)
        .fetch_one(&mut *tx)
        .await?;
        tx.commit().await?;
        tracing::info!(gateway = %self.gateway, refund = %self.refund_id, ?outcome, "a refund's outcome, asked of its gateway, is recorded");
        if outcome != RefundOutcome::Succeeded && !requested {
            // The job ends dead, listed for an operator (`payfleet jobs dead`, the dashboard):
            // the buyer still waits for the money, and the refund's idempotency key would only
            // fetch this ended refund again.
            return Err(JobError::fail(format!(
                "{} refund {} giving back {} of session {} (payment {}) ended {outcome:?} at the gateway: the buyer does not have it back; give it back at the gateway by hand, then discard this job",
                self.gateway, self.refund_id, self.amount, self.session_id, self.payment_id
            )));
        }
        Ok(())
    }
}

/// Runs the refund jobs (a late payment's, a refund's settlement, an operator's or seller's
/// refund request) with the gateways they ask.
#[derive(Clone)]
pub struct Refunder(pub GatewayRegistry);

impl Worker<RefundPayment> for Refunder {
    async fn work(&self, ctx: JobContext, job: RefundPayment) -> Result<(), JobError> {
        job.run(&ctx.pool, &self.0).await
    }
}

impl Worker<SettleRefund> for Refunder {
    async fn work(&self, ctx: JobContext, job: SettleRefund) -> Result<(), JobError> {
        job.run(&ctx.pool, &self.0).await
    }
}

impl Worker<CarryOutRefund> for Refunder {
    async fn work(&self, ctx: JobContext, job: CarryOutRefund) -> Result<(), JobError> {
        job.run(&ctx.pool, &self.0).await
    }
}

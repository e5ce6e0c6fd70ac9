//! Event processing: turns a stored gateway event into the provider's truth (`payment_orders`
//! and its refund and dispute facts) and the order's state, exactly once, in one transaction
//! with the event's outcome.
//!
//! An event ends one of four ways (`payment_events.outcome`):
//! - `applied` or `ignored`: final.
//! - `waiting`: it is about a payment not known to have succeeded yet (a refund or dispute that
//!   overtook its payment; gateways keep no order and retry for days). It is kept, and processed
//!   again when that payment's event is, however late ([`apply`]).
//! - `rejected`: it can never apply as it is (a refund larger than its payment, another
//!   currency, an unreadable body). Kept with its reason, at once, not retried; an operator
//!   replays it after a fix ([`events`]).
//!
//! Only outages (a database or gateway that does not answer) are retried by the job.

mod apply;
pub mod batch;
pub mod delivery;
pub mod events;
pub mod links;
pub mod order_refunds;
pub mod reconcile;
mod refunds;
pub mod renewals;
pub mod subscriptions;

use serde::{Deserialize, Serialize};
use sqlx::PgPool;

use crate::gateways::{
    self, EventError, GatewayName, Interpretation, MercadoPagoClient, MercadoPagoError, PaymentRef,
};
use payfleet_queue::{Job, JobError, NewJob, QueueError, Registry, RegistryError};

pub use apply::Rejection;
pub use refunds::{GiveBackError, RefundPayment, SettleRefund, give_back_again};

payfleet_queue::text_enum! {
    /// `payment_events.outcome`.
    pub enum EventOutcome {
        Applied = "applied",
        Ignored = "ignored",
        Waiting = "waiting",
        Rejected = "rejected",
    }
}

/// Processes one row of `payment_events`, named by its (gateway, event id).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ProcessPaymentEvent {
    pub gateway: GatewayName,
    pub event_id: String,
    /// The trace of the request that stored (or replayed) the event, when traces are on: the
    /// processing continues it (`traces`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub traceparent: Option<String>,
}

impl Job for ProcessPaymentEvent {
    const KIND: &'static str = "process_payment_event";
    const QUEUE: &'static str = "events";
    // Only outages are retried (a rejected or waiting event completes its job). With the stored
    // backoff (about 2^attempt s, capped at an hour) 25 attempts span about 14 hours; an event
    // whose job runs out of them stays unprocessed, listed by `payfleet events unprocessed`,
    // counted by the metrics, and is re-driven by the gateway's next delivery or a replay.
    const MAX_ATTEMPTS: i32 = 25;
}

impl ProcessPaymentEvent {
    pub fn key(gateway: GatewayName, event_id: &str) -> String {
        format!("payment_event:{gateway}:{event_id}")
    }

    /// The keyed job that processes the event: one unfinished job per event at most. Its
    /// fairness key is the event's seller (`EventFormat::seller_hint`), when the body names one.
    pub fn job(
        gateway: GatewayName,
        event_id: &str,
        seller: Option<&str>,
    ) -> Result<NewJob, QueueError> {
        let job = NewJob::of(&Self {
            gateway,
            event_id: event_id.to_owned(),
            traceparent: crate::traces::traceparent(),
        })?
        .key(Self::key(gateway, event_id));
        Ok(match seller {
            Some(seller) => job.fairness_key(seller),
            None => job,
        })
    }

    /// The job for a stored event body (an event found by reconciliation, or one woken again).
    pub fn job_for_body(
        gateway: GatewayName,
        event_id: &str,
        body: &[u8],
    ) -> Result<NewJob, QueueError> {
        let seller = serde_json::from_slice(body)
            .ok()
            .and_then(|v| crate::gateways::format(gateway).seller_hint(&v));
        Self::job(gateway, event_id, seller.as_deref())
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ProcessError {
    #[error("payment event {0}:{1} does not exist")]
    NoSuchEvent(GatewayName, String),
    #[error("payment event {id} ({gateway}) cannot be read")]
    Unreadable {
        id: i64,
        gateway: GatewayName,
        #[source]
        source: EventError,
    },
    #[error(transparent)]
    Rejected(#[from] Rejection),
    #[error(
        "Mercado Pago events need MERCADOPAGO_ACCESS_TOKEN to fetch the payment; configure it, then replay the event"
    )]
    NoMercadoPagoClient,
    #[error("could not fetch the payment from Mercado Pago")]
    MercadoPago(#[from] MercadoPagoError),
    #[error("could not enqueue the events that waited for this payment")]
    Queue(#[from] QueueError),
    #[error("the ledger refused the posting")]
    Ledger(#[from] crate::ledger::LedgerError),
    /// A success without its amount, which the gateway could not be asked for.
    #[error("the event reports a success of session {session} without its amount, and {why}")]
    NoAmount { session: String, why: String },
    #[error("could not ask the gateway for the payment's amount")]
    Gateway(#[from] gateways::GatewayError),
    #[error("the renewal cannot be recorded")]
    Renewal(#[from] crate::orders::subscriptions::ReportError),
    #[error(transparent)]
    Database(#[from] sqlx::Error),
}

impl ProcessError {
    /// An outage: the same event may process later. Anything else is a property of the event
    /// (or of the configuration) and would fail the same way again.
    pub fn is_transient(&self) -> bool {
        match self {
            Self::Database(e) | Self::Queue(QueueError::Database(e)) => crate::db::is_transient(e),
            Self::MercadoPago(e) => e.is_transient(),
            Self::Gateway(e) => e.is_transient(),
            Self::Ledger(e) => e.is_transient(),
            Self::Renewal(crate::orders::subscriptions::ReportError::Queue(
                QueueError::Database(e),
            )) => crate::db::is_transient(e),
            _ => false,
        }
    }
}

impl From<ProcessError> for JobError {
    fn from(e: ProcessError) -> Self {
        JobError::retry_if(e.is_transient(), e)
    }
}

/// What processing concluded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Processed {
    Applied,
    Ignored(String),
    /// Kept until the payment it refers to is known: `session:<id>` or `payment:<id>`.
    Waiting(String),
    /// Kept with its reason; processing it again needs a fix first.
    Rejected(String),
    AlreadyProcessed,
}

/// What processing needs beyond the database.
#[derive(Clone, Default)]
pub struct Processor {
    pub mercadopago: Option<MercadoPagoClient>,
    /// Who collects the internal gateway's payments on the platform's account, if not the
    /// simulator (`PAYFLEET_INTERNAL_ACQUIRER=stripe`): that gateway's events on that account
    /// are the internal gateway's facts.
    pub internal_acquirer: Option<GatewayName>,
    /// Asked for the amount of a success whose event does not carry it.
    pub gateways: gateways::GatewayRegistry,
    /// The platform's commission on a gateway-billed renewal whose gateway reports none, in
    /// percent (as at checkout).
    pub fee_percent: rust_decimal::Decimal,
    /// Each event's time from receipt to its effect is one of its histograms.
    pub telemetry: crate::telemetry::Telemetry,
}

#[derive(sqlx::FromRow)]
struct EventRow {
    id: i64,
    raw_body: Vec<u8>,
    source: String,
    event_type: Option<String>,
    processed_at: Option<chrono::DateTime<chrono::Utc>>,
    received_at: chrono::DateTime<chrono::Utc>,
}

impl EventRow {
    /// The connected account a Stripe event names (its `account`): `Some(None)` for an event
    /// on the platform's own account, `None` for a body that does not read as an event.
    fn account(&self) -> Option<Option<String>> {
        #[derive(serde::Deserialize)]
        struct Account {
            account: Option<String>,
        }
        serde_json::from_slice::<Account>(&self.raw_body)
            .ok()
            .map(|a| a.account)
    }
}

impl Processor {
    /// Processes a stored event. Safe to run any number of times, concurrently too: the event row
    /// is locked, and the effects commit with its outcome or not at all. Returns an error only
    /// for an outage (retry later) or an event that does not exist.
    pub async fn process(
        &self,
        pool: &PgPool,
        gateway: GatewayName,
        event: &str,
    ) -> Result<Processed, ProcessError> {
        let row: EventRow = sqlx::query_as(
            "SELECT id, raw_body, source, event_type, processed_at, received_at FROM payment_events WHERE gateway = $1 AND event_id = $2",
        )
        .bind(gateway.as_str())
        .bind(event)
        .fetch_optional(pool)
        .await?
        .ok_or_else(|| ProcessError::NoSuchEvent(gateway, event.to_owned()))?;
        if row.processed_at.is_some() {
            return Ok(Processed::AlreadyProcessed);
        }
        match self.try_process(pool, gateway, &row).await {
            Ok(p) => Ok(p),
            Err(e) if e.is_transient() => Err(e),
            Err(e) => {
                let reason = payfleet_queue::error_chain(&e);
                tracing::warn!(%gateway, event, event_row = row.id, %reason, "payment event rejected; replay it after a fix");
                events::mark_rejected(pool, row.id, &reason).await?;
                Ok(Processed::Rejected(reason))
            }
        }
    }

    /// Whose payments an event's facts are about: its gateway's, except, when the internal
    /// gateway collects through Stripe, a Stripe event about a payment the internal gateway made
    /// (its session, or its payment id, is the internal gateway's), or about one not known yet
    /// that Stripe sent for the platform's own account (no `account` field; reconciliation's own
    /// answers for Stripe Connect have none either, and stay Stripe's).
    async fn facts_gateway(
        &self,
        pool: &PgPool,
        gateway: GatewayName,
        row: &EventRow,
        payment: &PaymentRef,
    ) -> Result<GatewayName, sqlx::Error> {
        if Some(gateway) != self.internal_acquirer {
            return Ok(gateway);
        }
        let internal: bool = sqlx::query_scalar(
            "SELECT EXISTS (SELECT 1 FROM payment_sessions WHERE gateway = 'internal' AND session_id = $1)
                 OR EXISTS (SELECT 1 FROM payment_orders WHERE gateway = 'internal' AND payment_id = $2)",
        )
        .bind(&payment.session_id)
        .bind(&payment.payment_id)
        .fetch_one(pool)
        .await?;
        if internal {
            return Ok(GatewayName::Internal);
        }
        Ok(self.subscription_gateway(gateway, row))
    }

    /// Whose subscription an event about a gateway-billed subscription is: its gateway's,
    /// except, when the internal gateway collects through Stripe, a Stripe event on the
    /// platform's own account (no `account` field): the internal gateway's subscriptions are
    /// billed there. Reconciliation's own answers (`reconcile::EVENT_TYPE`) name no account
    /// either, and stay the gateway's; the gateway's events it stores (a subscription's
    /// charges listed) name it as their webhooks would.
    fn subscription_gateway(&self, gateway: GatewayName, row: &EventRow) -> GatewayName {
        let platform = Some(gateway) == self.internal_acquirer
            && row.event_type.as_deref() != Some(reconcile::EVENT_TYPE)
            && matches!(row.account(), Some(None));
        if platform {
            GatewayName::Internal
        } else {
            gateway
        }
    }

    /// A success confirms an order only with its amount, checked against the order's: one whose
    /// event does not carry it (and whose payment has none recorded yet) is asked of its gateway
    /// first, outside the transaction. The gateway's answer stands for the event's; a gateway
    /// that does not say it succeeded, or says no amount, leaves the event rejected (replayable),
    /// never a confirmation unchecked.
    async fn with_amounts(
        &self,
        pool: &PgPool,
        gateway: GatewayName,
        payment: &PaymentRef,
        mut facts: Vec<gateways::Fact>,
    ) -> Result<Vec<gateways::Fact>, ProcessError> {
        use gateways::{Fact, PaymentStatus};
        let amountless = |f: &Fact| {
            matches!(
                f,
                Fact::Payment {
                    status: PaymentStatus::Succeeded,
                    amount: None
                }
            )
        };
        if !facts.iter().any(amountless) {
            return Ok(facts);
        }
        let session = payment.session_id.clone().unwrap_or_default();
        let known: Option<(bool, Option<serde_json::Value>)> = sqlx::query_as(
            "SELECT EXISTS (SELECT 1 FROM payment_orders WHERE gateway = $1 AND session_id = $2 AND amount IS NOT NULL),
                    (SELECT metadata FROM payment_sessions WHERE gateway = $1 AND session_id = $2)",
        )
        .bind(gateway)
        .bind(&session)
        .fetch_optional(pool)
        .await?;
        let (captured, metadata) = known.unwrap_or((false, None));
        if captured {
            return Ok(facts);
        }
        let no_amount = |why: String| ProcessError::NoAmount {
            session: session.clone(),
            why,
        };
        let g = self.gateways.get(gateway).ok_or_else(|| {
            no_amount(format!(
                "gateway {gateway} is not enabled in this worker to ask"
            ))
        })?;
        let seller_account = metadata.as_ref().and_then(seller_account);
        let state = g
            .status(&session, seller_account.as_deref())
            .await
            .map_err(|e| match e.is_transient() {
                true => ProcessError::Gateway(e),
                false => no_amount(format!("the gateway does not tell it ({e})")),
            })?;
        let amount = match (state.status, state.amount) {
            (PaymentStatus::Succeeded, Some(amount)) => amount,
            (status, amount) => {
                return Err(no_amount(format!(
                    "the gateway says {status:?} with {}",
                    amount.map_or("no amount".to_owned(), |a| a.to_string())
                )));
            }
        };
        for f in facts.iter_mut().filter(|f| amountless(f)) {
            *f = Fact::Payment {
                status: PaymentStatus::Succeeded,
                amount: Some(amount),
            };
        }
        Ok(facts)
    }

    /// A paid invoice whose event does not name its payment (Stripe's API versions since
    /// 2025-03-31) is asked of its gateway first, outside the transaction: the period's refunds
    /// and disputes name only that payment, and would otherwise find no sale to take back
    /// from; and the fee the gateway took on it is the commission recorded. A gateway that
    /// cannot be asked now is asked again on the job's retry; one that refuses our credentials
    /// leaves the event rejected, to replay once they are mended; one that names no payment, or
    /// refuses the question, leaves the renewal recorded without it, as before, and logged.
    async fn invoice_payment(
        &self,
        of: GatewayName,
        row: &EventRow,
        renewal: &mut gateways::Renewal,
        payment: &mut PaymentRef,
        facts: &[gateways::Fact],
    ) -> Result<(), ProcessError> {
        let paid = facts.iter().any(|f| {
            matches!(
                f,
                gateways::Fact::Payment {
                    status: gateways::PaymentStatus::Succeeded,
                    ..
                }
            )
        });
        let (Some(invoice), None, true) =
            (payment.session_id.as_deref(), &payment.payment_id, paid)
        else {
            return Ok(());
        };
        let Some(g) = self.gateways.get(of) else {
            tracing::warn!(gateway = %of, invoice, "the gateway is not enabled in this worker to ask for the invoice's payment: its renewal is recorded without one");
            return Ok(());
        };
        let account = row.account().flatten();
        match g.invoice_payment(invoice, account.as_deref()).await {
            Ok(Some(found)) => {
                payment.payment_id = Some(found.payment_id);
                if renewal.fee.is_none() {
                    renewal.fee = found.fee;
                }
                Ok(())
            }
            Ok(None) => {
                tracing::warn!(gateway = %of, invoice, "the gateway names no paid payment of this invoice: its renewal is recorded without one");
                Ok(())
            }
            // Our credentials refused, or an answer we cannot read, is ours to mend: the event is
            // rejected (listed, replayable once mended), not recorded without the payment its
            // refunds will name. An outage is retried.
            Err(e) if e.is_transient() || e.is_the_platforms() => Err(ProcessError::Gateway(e)),
            Err(e) => {
                tracing::warn!(gateway = %of, invoice, error = %e, "the invoice's payment could not be asked for: its renewal is recorded without one");
                Ok(())
            }
        }
    }

    async fn try_process(
        &self,
        pool: &PgPool,
        gateway: GatewayName,
        row: &EventRow,
    ) -> Result<Processed, ProcessError> {
        let unreadable = |source: EventError| ProcessError::Unreadable {
            id: row.id,
            gateway,
            source,
        };
        // Network calls happen before the transaction, never while it holds locks.
        // Reconciliation's own answers have their shape; an undelivered event it fetched from
        // the gateway's list is the gateway's event, read as its webhook would be.
        let read = if row.source == "reconciliation"
            && row.event_type.as_deref() == Some(reconcile::EVENT_TYPE)
        {
            reconcile::interpret(gateway, &row.raw_body)
        } else {
            gateways::interpret(gateway, &row.raw_body)
        };
        let interpretation = match read.map_err(unreadable)? {
            Interpretation::Lookup {
                resource,
                resource_id,
            } => {
                let client = self
                    .mercadopago
                    .as_ref()
                    .ok_or(ProcessError::NoMercadoPagoClient)?;
                client.look_up(resource, &resource_id).await?
            }
            other => other,
        };

        let (of, interpretation) = match interpretation {
            Interpretation::Update { payment, facts } => {
                let of = self.facts_gateway(pool, gateway, row, &payment).await?;
                let facts = self.with_amounts(pool, of, &payment, facts).await?;
                (of, Interpretation::Update { payment, facts })
            }
            Interpretation::Renewal {
                mut renewal,
                mut payment,
                facts,
            } => {
                let of = self.subscription_gateway(gateway, row);
                self.invoice_payment(of, row, &mut renewal, &mut payment, &facts)
                    .await?;
                (
                    of,
                    Interpretation::Renewal {
                        renewal,
                        payment,
                        facts,
                    },
                )
            }
            other @ Interpretation::Subscription { .. } => {
                (self.subscription_gateway(gateway, row), other)
            }
            other => (gateway, other),
        };
        let changed = |applied: apply::Applied| match applied {
            apply::Applied::Changed => Processed::Applied,
            apply::Applied::Unchanged => Processed::Ignored("every fact was already known".into()),
            apply::Applied::Waiting(target) => Processed::Waiting(target),
        };
        let mut tx = pool.begin().await?;
        // The order messages this processing writes continue its trace (their column's
        // default reads the setting): a round trip only when traces are on.
        if let Some(tp) = crate::traces::traceparent() {
            sqlx::query("SELECT set_config('payfleet.traceparent', $1, true)")
                .bind(tp)
                .execute(&mut *tx)
                .await?;
        }
        let processed: Option<Option<chrono::DateTime<chrono::Utc>>> =
            sqlx::query_scalar("SELECT processed_at FROM payment_events WHERE id = $1 FOR UPDATE")
                .bind(row.id)
                .fetch_optional(&mut *tx)
                .await?;
        if processed.flatten().is_some() {
            return Ok(Processed::AlreadyProcessed);
        }
        let mut due = None;
        let result = match interpretation {
            Interpretation::Ignore(reason) => Processed::Ignored(reason),
            Interpretation::Update { payment, facts } => {
                let outcome = apply::apply(&mut tx, of, &payment, &facts, Some(row.id)).await?;
                due = outcome.due;
                changed(outcome.applied)
            }
            Interpretation::Renewal {
                renewal,
                payment,
                facts,
            } => {
                let outcome = subscriptions::renewal(
                    &mut tx,
                    of,
                    &renewal,
                    &payment,
                    &facts,
                    Some(row.id),
                    self.fee_percent,
                )
                .await?;
                due = outcome.due;
                changed(outcome.applied)
            }
            Interpretation::Subscription {
                subscription,
                first_session,
                change,
            } => changed(
                subscriptions::change(&mut tx, of, &subscription, first_session.as_deref(), change)
                    .await?,
            ),
            Interpretation::Lookup { .. } => Processed::Ignored("nothing to look up".into()),
        };
        events::mark(&mut tx, row.id, &result).await?;
        tx.commit().await?;
        if matches!(result, Processed::Applied | Processed::Ignored(_)) {
            let since = chrono::Utc::now() - row.received_at;
            self.telemetry
                .event_processed(gateway, since.to_std().unwrap_or_default());
        }
        // The effect has committed; its sale is posted with the seller's others due. A failure
        // here loses nothing (the sale stays due, for the next poster or the sweep), so it does
        // not fail the event.
        if let Some(due) = due {
            let seller = due.seller.clone();
            if let Err(e) = due.post(pool).await {
                tracing::warn!(seller, error = %e, "cannot post the seller's sales now; the sweep will");
            }
        }
        Ok(result)
    }
}

/// The payment side's job kinds, each with its worker: event processing (through the
/// batcher), the hosted gateway's deliveries, refunds, and stopping at their gateway the
/// subscriptions no order took (both through the gateways).
pub fn register(
    registry: &mut Registry,
    batcher: batch::Batcher,
    deliverer: delivery::Deliverer,
    gateways: gateways::GatewayRegistry,
) -> Result<(), RegistryError> {
    let stopper = subscriptions::Stopper(gateways.clone());
    let refunder = refunds::Refunder(gateways);
    registry
        .add::<ProcessPaymentEvent, _>(batcher)?
        .add::<delivery::DeliverHostedEvent, _>(deliverer)?
        .add::<refunds::RefundPayment, _>(refunder.clone())?
        .add::<refunds::SettleRefund, _>(refunder.clone())?
        .add::<order_refunds::CarryOutRefund, _>(refunder)?
        .add::<subscriptions::StopUnstartedSubscription, _>(stopper)?;
    Ok(())
}

/// The seller's account at the gateway (a Stripe connected account), as the payment side
/// recorded it in a session's metadata at checkout.
pub(crate) fn seller_account(metadata: &serde_json::Value) -> Option<String> {
    metadata
        .get("seller_account")
        .and_then(serde_json::Value::as_str)
        .map(str::to_owned)
}

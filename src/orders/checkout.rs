//! `POST /checkout`: from a cart to orders with payment links, idempotent by `Idempotency-Key`.
//!
//! 1. The key is claimed (a row in `idempotency_keys`): a repeat with the same body gets the
//!    first answer; with another body, 422; while the first request still runs, 409. The
//!    request that holds the key is named in it, so only it can store the answer or let go; one
//!    that crashed lets go by itself after its lock (twice the payment side's timeout and then
//!    some: the links are asked for all at once, under one timeout). A new plain cart's key is
//!    claimed by the statement that writes its orders ([`Writer`]); any other's, or a key that
//!    exists already, in a statement of its own, committed at once.
//! 2. One transaction prices the cart from the server's own catalogue, takes the coupon's
//!    redemptions under its row lock, numbers the orders from the counter row (sequential, no
//!    gaps), writes orders, items, redemptions and their `created` events, schedules each
//!    order's expiry, and ties the checkout to the key.
//! 3. For each order without a link, the payment side is asked over RabbitMQ. If it does not
//!    answer, the buyer gets 503 and the orders are kept: the same request again (or
//!    `POST /orders/{number}/payment`) asks again. Once every order has its link, the answer is
//!    stored with the key and returned to every repeat.

use std::sync::{Arc, LazyLock};
use std::time::Duration;

use chrono::Utc;
use rust_decimal::Decimal;
use serde::Deserialize;
use sha2::{Digest, Sha256};
use sqlx::{PgConnection, PgPool};
use tokio::sync::{mpsc, oneshot};

use super::expiry::ExpireOrder;
use super::pricing::{self, PricingError};
use super::{OrderView, PaymentLinkView, of_checkout};
use crate::batches::in_batches;
use crate::catalogue::{self, ProductId, ProductKind};
use crate::gateways::{self, GatewayName};
use crate::messaging::rpc::{PaymentLinkReply, PaymentLinkRequest, PaymentLinks};
use payfleet_queue::Job;
use payfleet_queue::QueueError;

/// How long a request holds its key beyond the payment side's timeout, before another may take
/// over (it crashed).
const KEY_LOCK_MARGIN: Duration = Duration::from_secs(20);

/// The most lines a cart may have: a checkout prices, numbers and writes them all in one
/// transaction while it holds the order-number counter, so its size is bounded.
pub const MAX_LINES: usize = 100;
/// The largest checkout body taken (413 beyond).
pub const MAX_BODY_BYTES: usize = 64 * 1024;

#[derive(Debug, Clone, Deserialize, utoipa::ToSchema)]
pub struct CheckoutRequest {
    pub buyer_id: String,
    pub items: Vec<CheckoutItem>,
    pub coupon: Option<String>,
    pub gateway: String,
}

/// A line of the cart. Anything else the client sends (a price, say) is not read.
#[derive(Debug, Clone, Deserialize, utoipa::ToSchema)]
pub struct CheckoutItem {
    pub product_id: String,
    pub quantity: i64,
}

#[derive(Debug, thiserror::Error)]
pub enum CheckoutError {
    #[error("the Idempotency-Key header is missing")]
    MissingKey,
    #[error("the Idempotency-Key must be 1 to 255 visible characters")]
    BadKey,
    #[error("the request body is not a checkout: {0}")]
    BadRequest(String),
    #[error("this Idempotency-Key was used with a different request")]
    KeyReused,
    #[error("a request with this Idempotency-Key is still running")]
    KeyInUse,
    #[error("{0}")]
    UnknownProduct(String),
    #[error("{0}")]
    InvalidItems(String),
    #[error("{0}")]
    CouponUnavailable(String),
    #[error("{0}")]
    GatewayUnavailable(String),
    #[error("{0}")]
    InvalidBuyer(String),
    #[error(
        "orders {orders:?} are kept, but the payment side did not give their payment links ({reason}); send the same request again, or POST /orders/{{number}}/payment, to get them"
    )]
    LinksUnavailable { orders: Vec<i64>, reason: String },
    #[error(
        "the gateway refused the payment links of orders {orders:?}, which end unpaid: {reason}"
    )]
    LinksRefused { orders: Vec<i64>, reason: String },
    #[error("the checkout did not finish within {0:?} (the database did not answer in time)")]
    Deadline(Duration),
    #[error(transparent)]
    Queue(#[from] QueueError),
    #[error(transparent)]
    Database(#[from] sqlx::Error),
}

impl From<PricingError> for CheckoutError {
    fn from(e: PricingError) -> Self {
        match e {
            PricingError::InvalidItems(m) => Self::InvalidItems(m),
            PricingError::CouponUnavailable(m) => Self::CouponUnavailable(m),
        }
    }
}

impl CheckoutError {
    /// A refusal of the input: nothing was stored, and the key is free again.
    fn is_refusal(&self) -> bool {
        matches!(
            self,
            Self::UnknownProduct(_)
                | Self::InvalidItems(_)
                | Self::CouponUnavailable(_)
                | Self::GatewayUnavailable(_)
                | Self::InvalidBuyer(_)
        )
    }
}

/// What checkout needs.
#[derive(Clone)]
pub struct Checkout {
    pub pool: PgPool,
    pub links: Arc<dyn PaymentLinks>,
    /// The platform's commission, in percent of each order's total.
    pub fee_percent: Decimal,
    /// How long an order waits for its payment.
    pub expiry: Duration,
    /// The gateways buyers can pay through.
    pub gateways: Vec<GatewayName>,
    /// How long the payment side is given to answer (all links are asked at once).
    pub rpc_timeout: Duration,
    /// Writes the orders of concurrent checkouts in one transaction.
    pub writer: Writer,
}

/// The answer: the checkout's orders.
#[derive(Debug, Clone, serde::Serialize, utoipa::ToSchema)]
pub struct CheckoutAnswer {
    pub orders: Vec<OrderView>,
}

enum Claim {
    /// The first complete answer, stored.
    Answered(serde_json::Value),
    /// Ours to work on; the checkout, if its orders exist already.
    Owned(Option<i64>),
    /// Ours, claimed with the orders just written: the checkout and its orders as written.
    Written(i64, Vec<OrderView>),
}

/// A key as a claim finds it taken.
#[derive(sqlx::FromRow)]
struct StoredKey {
    request_hash: Vec<u8>,
    /// Its first complete answer, once stored.
    response: Option<serde_json::Value>,
    /// Its request's lock has not run out.
    locked: bool,
    /// Held by the request looking at it.
    mine: bool,
    checkout_id: Option<i64>,
}

/// How many times a claim looks again at a key that changed hands while it looked.
const CLAIM_TURNS: usize = 3;

fn request_hash(body: &serde_json::Value) -> Vec<u8> {
    // serde_json keeps object keys sorted: the same request hashes the same however it was
    // spaced or ordered.
    Sha256::digest(body.to_string().as_bytes()).to_vec()
}

/// An `Idempotency-Key` header's value, as every endpoint that takes one reads it: present, 1 to
/// 255 bytes once trimmed, no control characters.
pub fn idempotency_key(raw: Option<&str>) -> Result<&str, CheckoutError> {
    let key = raw.ok_or(CheckoutError::MissingKey)?.trim();
    if key.is_empty() || key.len() > 255 || key.chars().any(|c| c.is_control()) {
        return Err(CheckoutError::BadKey);
    }
    Ok(key)
}

impl Checkout {
    /// Runs a checkout for `owner` (the caller whose idempotency keys `key` is among); returns
    /// the answer's JSON (stored with the key once complete).
    pub async fn run(
        &self,
        owner: &str,
        key: Option<&str>,
        body: serde_json::Value,
    ) -> Result<serde_json::Value, CheckoutError> {
        // A statement that never returns (a lock waited on, a connection half-open after a
        // failover) must not hold its caller for ever: past the deadline the request ends,
        // 503, and its key is let go as for a caller that went away (`KeyGuard`).
        let deadline = self.deadline();
        match tokio::time::timeout(deadline, self.run_within(owner, key, body)).await {
            Ok(answer) => answer,
            Err(_) => {
                tracing::warn!(?deadline, "a checkout did not finish within its deadline");
                Err(CheckoutError::Deadline(deadline))
            }
        }
    }

    /// The longest a checkout runs: its payment links' wait and the writes around it.
    pub fn deadline(&self) -> Duration {
        self.rpc_timeout + WRITE_DEADLINE
    }

    async fn run_within(
        &self,
        owner: &str,
        key: Option<&str>,
        body: serde_json::Value,
    ) -> Result<serde_json::Value, CheckoutError> {
        let key = idempotency_key(key)?;
        let request: CheckoutRequest = serde_json::from_value(body.clone())
            .map_err(|e| CheckoutError::BadRequest(e.to_string()))?;
        // Refused before anything is stored or locked.
        if request.items.len() > MAX_LINES {
            return Err(CheckoutError::InvalidItems(format!(
                "a checkout takes at most {MAX_LINES} lines, not {}",
                request.items.len()
            )));
        }
        let key = IdempotencyKey { owner, key };
        let me = format!("{:032x}", rand::random::<u128>());
        // A plain cart claims its key in its orders' batch (no statement nor commit of its own);
        // any other goes through the key's claim first, as a repeat does.
        let plain = self.cart(&request).ok().filter(|c| self.writes_together(c));
        let checkout = match self
            .claim(key, &request_hash(&body), &me, plain.as_ref())
            .await?
        {
            Claim::Answered(answer) => return Ok(answer),
            Claim::Owned(existing) => existing.map(|c| (c, None)),
            Claim::Written(checkout, orders) => Some((checkout, Some(orders))),
        };
        // If this request is dropped half-way (the client went away), the key is let go at once
        // rather than when its lock runs out.
        let mut guard = KeyGuard {
            pool: self.pool.clone(),
            owner: owner.to_owned(),
            key: key.key.to_owned(),
            me: me.clone(),
            armed: true,
        };
        let result = async {
            let (checkout, written) = match checkout {
                Some(c) => c,
                None => self.create(key, &me, &request).await?,
            };
            self.complete(key, &me, checkout, written).await
        }
        .await;
        guard.armed = false;
        if let Err(e) = &result {
            let_go(&self.pool, key, &me, e.is_refusal()).await;
        }
        result
    }

    fn key_lock(&self) -> Duration {
        self.rpc_timeout * 2 + KEY_LOCK_MARGIN
    }

    /// Claims the key: a new key is ours (and, for a `plain` cart, written with its orders in
    /// the writer's batch, whose synchronous commit stores both); a known one gives its stored
    /// answer, 422 for another body, 409 while its request runs, or ours to take over when
    /// that request ended without an answer.
    async fn claim(
        &self,
        key: IdempotencyKey<'_>,
        hash: &[u8],
        me: &str,
        plain: Option<&Cart>,
    ) -> Result<Claim, CheckoutError> {
        let lock_secs = self.key_lock().as_secs_f64();
        if let Some(cart) = plain {
            let claiming = Claiming {
                hash: hash.to_vec(),
                lock_secs,
            };
            match self.writer.write(key, me, cart, claiming).await {
                Written::Created(checkout, orders) => return Ok(Claim::Written(checkout, orders)),
                // Refused before anything was stored: the key was never claimed.
                Written::Refused(e) => return Err(e),
                // The key exists (a repeat, or another request holds it), or the batch failed:
                // the claim on its own below says which, and what to do.
                Written::Taken | Written::Alone => {}
            }
        }
        // Committed without waiting for its flush: no order is written, nor any answer stored,
        // on the strength of the claim alone, and the checkout's own transaction and the stored
        // answer are synchronous commits after it, which flush it too (the log is one
        // sequence). A claim lost in a crash before them is a claim never made (at most, a
        // concurrent repeat was told 409 or 422 on its strength meanwhile: it sends again).
        //
        // A refused request deletes its key at once, so the key found taken may be gone by the
        // time it is read, and one found free to take over may be taken or gone again: each
        // turn starts over, and a key that keeps changing hands is "in use" (send again).
        for _ in 0..CLAIM_TURNS {
            let inserted: Option<String> = sqlx::query_scalar(
                "INSERT INTO idempotency_keys (owner, key, request_hash, locked_until, locked_by)
                 SELECT $5, $1, $2, now() + $3 * interval '1 second', $4
                 FROM (SELECT set_config('synchronous_commit', 'off', true)) c
                 ON CONFLICT (owner, key) DO NOTHING RETURNING key",
            )
            .bind(key.key)
            .bind(hash)
            .bind(lock_secs)
            .bind(me)
            .bind(key.owner)
            .fetch_optional(&self.pool)
            .await?;
            if inserted.is_some() {
                return Ok(Claim::Owned(None));
            }
            let stored: Option<StoredKey> = sqlx::query_as(
                "SELECT request_hash, response, COALESCE(locked_until > now(), false) AS locked,
                        locked_by IS NOT DISTINCT FROM $3 AS mine, checkout_id
                 FROM idempotency_keys WHERE owner = $2 AND key = $1",
            )
            .bind(key.key)
            .bind(key.owner)
            .bind(me)
            .fetch_optional(&self.pool)
            .await?;
            let Some(stored) = stored else {
                continue;
            };
            if stored.request_hash != hash {
                return Err(CheckoutError::KeyReused);
            }
            if let Some(answer) = stored.response {
                return Ok(Claim::Answered(answer));
            }
            // Claimed by this very request: its writer's batch committed and then failed to say
            // so (its deadline passed during the commit, or the connection dropped after it).
            // The checkout is this request's to finish, not a 409 for the ~30 s of its lock.
            if stored.mine {
                return Ok(Claim::Owned(stored.checkout_id));
            }
            if stored.locked {
                return Err(CheckoutError::KeyInUse);
            }
            // The first request ended without a complete answer (503, or it crashed): take over.
            let taken: Option<Option<i64>> = sqlx::query_scalar(
                "UPDATE idempotency_keys SET locked_until = now() + $2 * interval '1 second', locked_by = $3
                 WHERE owner = $4 AND key = $1 AND response IS NULL AND (locked_until IS NULL OR locked_until <= now())
                 RETURNING checkout_id",
            )
            .bind(key.key)
            .bind(lock_secs)
            .bind(me)
            .bind(key.owner)
            .fetch_optional(&self.pool)
            .await?;
            if let Some(checkout) = taken {
                return Ok(Claim::Owned(checkout));
            }
        }
        Err(CheckoutError::KeyInUse)
    }

    /// The cart, checked before anything is locked: who buys, through which gateway, which
    /// products in which quantities, with which coupon.
    fn cart(&self, r: &CheckoutRequest) -> Result<Cart, CheckoutError> {
        let buyer = r.buyer_id.trim();
        if buyer.is_empty() || buyer.chars().count() > 200 || buyer.chars().any(char::is_control) {
            return Err(CheckoutError::InvalidBuyer(
                "buyer_id must be 1 to 200 printable characters".into(),
            ));
        }
        if let Some(code) = &r.coupon
            && (code.chars().count() > 64 || code.chars().any(char::is_control))
        {
            return Err(CheckoutError::CouponUnavailable(
                "a coupon code is at most 64 printable characters".into(),
            ));
        }
        let gateway: GatewayName = r.gateway.parse().map_err(|_| {
            CheckoutError::GatewayUnavailable(format!("unknown gateway {:?}", r.gateway))
        })?;
        if !self.gateways.contains(&gateway) {
            return Err(CheckoutError::GatewayUnavailable(format!(
                "gateway {gateway} is not enabled here"
            )));
        }
        let mut wanted: Vec<(ProductId, u32)> = Vec::with_capacity(r.items.len());
        for item in &r.items {
            let id: ProductId = item.product_id.parse().map_err(|_| {
                CheckoutError::UnknownProduct(format!("no product {:?}", item.product_id))
            })?;
            let quantity = u32::try_from(item.quantity)
                .ok()
                .filter(|q| (1..=i32::MAX as u32).contains(q))
                .ok_or_else(|| {
                    CheckoutError::InvalidItems(format!(
                        "quantity {} of product {id} must be at least 1",
                        item.quantity
                    ))
                })?;
            wanted.push((id, quantity));
        }
        if wanted.is_empty() {
            return Err(CheckoutError::InvalidItems("the cart is empty".into()));
        }
        let coupon = r.coupon.as_ref().filter(|c| !c.trim().is_empty()).cloned();
        Ok(Cart {
            buyer: buyer.to_owned(),
            gateway,
            coupon,
            wanted,
        })
    }

    /// Whether the writer writes this cart with others: not with a coupon (its row lock and
    /// redemptions), nor through a gateway that charges on the sellers' accounts (each seller's
    /// account is checked).
    fn writes_together(&self, cart: &Cart) -> bool {
        cart.coupon.is_none() && !gateways::format(cart.gateway).charges_on_seller_account()
    }

    /// The checkout's orders, for a request that holds its key but has no checkout yet: one that
    /// took over a key whose request ended without orders, a repeat whose first request was
    /// refused, a cart the writer does not write (a coupon's redemptions, a Stripe seller's
    /// account), or one whose writer's batch failed. New plain carts are written by the
    /// [`Writer`] as their keys are claimed.
    async fn create(
        &self,
        key: IdempotencyKey<'_>,
        me: &str,
        r: &CheckoutRequest,
    ) -> Result<(i64, Option<Vec<OrderView>>), CheckoutError> {
        let cart = self.cart(r)?;
        self.create_alone(key, me, &cart).await
    }

    /// The checkout's transaction: orders, items, redemptions, numbers, expiry jobs, key.
    /// Returns the checkout, and its orders as written (none if they existed already).
    async fn create_alone(
        &self,
        key: IdempotencyKey<'_>,
        me: &str,
        cart: &Cart,
    ) -> Result<(i64, Option<Vec<OrderView>>), CheckoutError> {
        let Cart {
            buyer,
            gateway,
            coupon,
            wanted,
        } = cart;
        let (buyer, gateway) = (buyer.as_str(), *gateway);
        let mut tx = self.pool.begin().await?;
        // Only the request holding the key writes (a crashed one may have been taken over), and
        // the row lock makes the tie between key and checkout exact.
        let row: Option<(Option<i64>, Option<String>)> = sqlx::query_as(
            "SELECT checkout_id, locked_by FROM idempotency_keys WHERE owner = $2 AND key = $1 FOR UPDATE",
        )
        .bind(key.key)
        .bind(key.owner)
        .fetch_optional(&mut *tx)
        .await?;
        match row {
            Some((Some(checkout), _)) => return Ok((checkout, None)),
            Some((None, Some(owner))) if owner == me => {}
            _ => return Err(CheckoutError::KeyInUse),
        }
        let ids: Vec<ProductId> = wanted.iter().map(|(id, _)| *id).collect();
        let products = catalogue::products(&mut *tx, &ids).await?;
        let items = cart_items(wanted, &products)?;
        let coupon =
            match coupon {
                Some(code) => Some(catalogue::lock_coupon(&mut tx, code).await?.ok_or_else(
                    || CheckoutError::CouponUnavailable(format!("no coupon {code:?}")),
                )?),
                None => None,
            };
        let now = Utc::now();
        let priced = pricing::price(&items, coupon.as_ref(), self.fee_percent, now)?;
        if gateways::format(gateway).charges_on_seller_account() {
            self.check_stripe_accounts(&mut tx, &priced).await?;
        }
        let redemptions = priced.iter().filter(|o| o.uses_coupon()).count() as i32;
        if let Some(c) = &coupon
            && redemptions > 0
            && !catalogue::redeem(&mut tx, c.id, redemptions).await?
        {
            return Err(CheckoutError::CouponUnavailable(format!(
                "coupon {} is used up",
                c.code
            )));
        }
        let checkout: i64 = sqlx::query_scalar(
            "INSERT INTO checkouts (buyer_id, gateway, coupon_id) VALUES ($1, $2, $3) RETURNING id",
        )
        .bind(buyer)
        .bind(gateway)
        .bind(coupon.as_ref().map(|c| c.id))
        .fetch_one(&mut *tx)
        .await?;
        let expires_at =
            now + chrono::Duration::from_std(self.expiry).unwrap_or(chrono::Duration::minutes(30));
        sqlx::query("UPDATE idempotency_keys SET checkout_id = $2 WHERE owner = $3 AND key = $1")
            .bind(key.key)
            .bind(checkout)
            .bind(key.owner)
            .execute(&mut *tx)
            .await?;
        let trace = crate::traces::traceparent();
        let mut orders = NewOrders::default();
        for o in &priced {
            let coupon = o
                .uses_coupon()
                .then(|| coupon.as_ref().map(|c| c.id))
                .flatten();
            orders.push(o, coupon, checkout, buyer, gateway, trace.as_deref());
        }
        // Numbers last: the counter row stays locked until commit, so everything numbered is
        // written by the one statement that takes the row, and only the commit follows it.
        let numbered = orders.insert(&mut tx, expires_at).await?;
        if numbered.len() != priced.len() {
            // Only a missing counter row does this (migration 0011 writes it): nothing is kept.
            return Err(CheckoutError::Database(sqlx::Error::RowNotFound));
        }
        tx.commit().await?;
        Ok((checkout, Some(numbered)))
    }

    /// Direct charges need each seller's Stripe account.
    async fn check_stripe_accounts(
        &self,
        tx: &mut PgConnection,
        priced: &[pricing::PricedOrder],
    ) -> Result<(), CheckoutError> {
        for o in priced {
            let seller = catalogue::seller(&mut *tx, o.seller_id).await?;
            if seller.and_then(|s| s.stripe_account).is_none() {
                return Err(CheckoutError::GatewayUnavailable(format!(
                    "seller {} has no Stripe account to be paid through Stripe",
                    o.seller_id
                )));
            }
        }
        Ok(())
    }

    /// Asks for the links the checkout's payable orders lack, all at once under one timeout;
    /// stores the answer once complete (only the request holding the key does).
    async fn complete(
        &self,
        key: IdempotencyKey<'_>,
        me: &str,
        checkout: i64,
        written: Option<Vec<OrderView>>,
    ) -> Result<serde_json::Value, CheckoutError> {
        // The orders as this request wrote them, else as they are.
        let mut orders = match written {
            Some(orders) => orders,
            None => of_checkout(&self.pool, checkout).await?,
        };
        let missing: Vec<&OrderView> = orders
            .iter()
            .filter(|o| o.payment.is_none() && o.status.is_payable())
            .collect();
        let results = futures_util::future::join_all(
            missing
                .iter()
                .map(|o| ask_link(&self.pool, self.links.as_ref(), o, self.fee_percent)),
        )
        .await;
        let mut unavailable = (Vec::new(), None);
        let mut refused = (Vec::new(), None);
        let mut asked = Vec::with_capacity(missing.len());
        for (o, r) in missing.iter().zip(results) {
            match r {
                Ok(view) => asked.push((o.number, o.payment_attempt, view)),
                Err((reason, true)) => {
                    unavailable.0.push(o.number);
                    unavailable.1 = Some(reason);
                }
                Err((reason, false)) => {
                    refused.0.push(o.number);
                    refused.1 = Some(reason);
                }
            }
        }
        if let (orders, Some(reason)) = refused {
            end_refused(&self.pool, key, me, checkout, &orders).await?;
            return Err(CheckoutError::LinksRefused { orders, reason });
        }
        if let (orders, Some(reason)) = unavailable {
            return Err(CheckoutError::LinksUnavailable { orders, reason });
        }
        for (number, _, view) in &asked {
            if let Some(o) = orders.iter_mut().find(|o| o.number == *number) {
                o.payment = Some(view.clone());
            }
        }
        // The links and the answer in one statement (one commit), with those of the checkouts
        // completing beside it: the answer is stored only if every link was, else another
        // request stored one of them meanwhile, and the answer says what the orders hold.
        let answer = serde_json::to_value(CheckoutAnswer { orders }).unwrap_or_default();
        let completion = Completion {
            owner: key.owner.to_owned(),
            key: key.key.to_owned(),
            me: me.to_owned(),
            answer,
            links: asked
                .into_iter()
                .map(|(number, attempt, view)| (number, attempt, view.session_id, view.url))
                .collect(),
        };
        let (answered, completion) = self.writer.complete(&self.pool, completion).await?;
        let answer = completion.answer;
        if answered {
            return Ok(answer);
        }
        let orders = of_checkout(&self.pool, checkout).await?;
        let answer = serde_json::to_value(CheckoutAnswer { orders }).unwrap_or_default();
        sqlx::query(
            "UPDATE idempotency_keys SET response = $2, locked_until = NULL, locked_by = NULL
             WHERE owner = $4 AND key = $1 AND locked_by = $3",
        )
        .bind(key.key)
        .bind(&answer)
        .bind(me)
        .bind(key.owner)
        .execute(&self.pool)
        .await?;
        Ok(answer)
    }
}

/// The orders whose payment link the gateway refused (their amount, their currency, the
/// seller's account) end at once, their coupons and coins given back (as an expiry does): none
/// of them can be paid, and a refused request changes nothing that stays. Their checkout's
/// other orders are left as they are (one may have its link already, and a buyer paying it).
/// When none of the checkout's orders is left to be paid, its key is free again, so the same
/// request asked again is a new checkout; else it is only let go, as after any failure. Nothing
/// is done if another request took the key over meanwhile: that one decides.
async fn end_refused(
    pool: &PgPool,
    key: IdempotencyKey<'_>,
    me: &str,
    checkout: i64,
    refused: &[i64],
) -> Result<(), CheckoutError> {
    let mut tx = pool.begin().await?;
    let held: Option<i32> = sqlx::query_scalar(
        "SELECT 1 FROM idempotency_keys WHERE owner = $3 AND key = $1 AND locked_by = $2 FOR UPDATE",
    )
    .bind(key.key)
    .bind(me)
    .bind(key.owner)
    .fetch_optional(&mut *tx)
    .await?;
    if held.is_none() {
        return Ok(());
    }
    let ending: Vec<(i64, i64)> = sqlx::query_as(
        "SELECT id, number FROM orders
         WHERE checkout_id = $1 AND number = ANY($2) AND session_id IS NULL
           AND status IN ('awaiting_payment', 'payment_failed')
         ORDER BY id FOR UPDATE",
    )
    .bind(checkout)
    .bind(refused)
    .fetch_all(&mut *tx)
    .await?;
    for (id, number) in ending {
        super::expiry::expire_locked(&mut tx, id, number).await?;
    }
    let left: bool = sqlx::query_scalar(
        "SELECT EXISTS (SELECT 1 FROM orders WHERE checkout_id = $1 AND renews IS NULL
                          AND status IN ('awaiting_payment', 'payment_failed'))",
    )
    .bind(checkout)
    .fetch_one(&mut *tx)
    .await?;
    if !left {
        sqlx::query(
            "DELETE FROM idempotency_keys WHERE owner = $3 AND key = $1 AND locked_by = $2",
        )
        .bind(key.key)
        .bind(me)
        .bind(key.owner)
        .execute(&mut *tx)
        .await?;
    }
    tx.commit().await?;
    Ok(())
}

/// Gives the key up: removed after a refusal (nothing was stored, the client may fix the
/// request and send it with the same key), unlocked otherwise. Only by the request holding it.
async fn let_go(pool: &PgPool, key: IdempotencyKey<'_>, me: &str, refused: bool) {
    let sql = if refused {
        "DELETE FROM idempotency_keys WHERE owner = $3 AND key = $1 AND checkout_id IS NULL AND locked_by = $2"
    } else {
        "UPDATE idempotency_keys SET locked_until = NULL, locked_by = NULL WHERE owner = $3 AND key = $1 AND locked_by = $2"
    };
    if let Err(e) = sqlx::query(sql)
        .bind(key.key)
        .bind(me)
        .bind(key.owner)
        .execute(pool)
        .await
    {
        // It lets go by itself when its lock runs out.
        tracing::warn!(error = %e, "could not release an idempotency key");
    }
}

/// Lets go of a key whose request was dropped half-way.
struct KeyGuard {
    pool: PgPool,
    owner: String,
    key: String,
    me: String,
    armed: bool,
}

impl Drop for KeyGuard {
    fn drop(&mut self) {
        if self.armed {
            let (pool, owner, key, me) = (
                self.pool.clone(),
                self.owner.clone(),
                self.key.clone(),
                self.me.clone(),
            );
            tokio::spawn(async move {
                let key = IdempotencyKey {
                    owner: &owner,
                    key: &key,
                };
                let_go(&pool, key, &me, false).await
            });
        }
    }
}

/// An `Idempotency-Key` among its owner's (each API key has its own: one caller's key can
/// neither replay nor block another caller's request).
#[derive(Clone, Copy)]
struct IdempotencyKey<'a> {
    owner: &'a str,
    key: &'a str,
}

/// A cart as checked before anything is locked.
struct Cart {
    buyer: String,
    gateway: GatewayName,
    coupon: Option<String>,
    wanted: Vec<(ProductId, u32)>,
}

/// The cart's lines with their products, in cart order.
fn cart_items(
    wanted: &[(ProductId, u32)],
    products: &[catalogue::Product],
) -> Result<Vec<(catalogue::Product, u32)>, CheckoutError> {
    wanted
        .iter()
        .map(|(id, quantity)| {
            products
                .iter()
                .find(|p| p.id == *id)
                .map(|p| (p.clone(), *quantity))
                .ok_or_else(|| CheckoutError::UnknownProduct(format!("no product {id}")))
        })
        .collect()
}

/// What the writer did with one checkout.
enum Written {
    /// Its key claimed, its checkout and its orders written (as written).
    Created(i64, Vec<OrderView>),
    /// Refused for what it asks (an unknown product, a cart that cannot be priced): nothing was
    /// written for it, its key not claimed.
    Refused(CheckoutError),
    /// Not written (the batch failed as a whole): to write alone, where its own error shows.
    Alone,
    /// Not written: the key it was to claim exists already.
    Taken,
}

/// The key the writer claims in its batch, for a request that has not claimed it yet.
struct Claiming {
    hash: Vec<u8>,
    /// How long the request holds the key.
    lock_secs: f64,
}

struct Pending {
    owner: String,
    key: String,
    me: String,
    buyer: String,
    gateway: GatewayName,
    wanted: Vec<(ProductId, u32)>,
    /// The checkout request's trace, for its orders' `created` messages.
    traceparent: Option<String>,
    /// Its key, to claim.
    claim: Claiming,
    reply: oneshot::Sender<Written>,
}

/// Writes the new checkouts that arrive while it writes others, many to one statement: the
/// order-number counter is held, for the numbering and the commit, once per batch instead of
/// once per checkout, which under sixteen concurrent clients was the checkouts' pace (each
/// holding it through its own commit's flush). A batch reads the products of its carts and
/// prices each cart (a refused one is answered at once, its key never claimed), then one
/// statement, its own transaction, claims the keys, writes the checkouts of the keys it
/// claimed, numbers and writes their orders, and commits; each checkout is answered. A key
/// that exists already (a repeat, or a request running) is answered [`Written::Taken`]. Only
/// new plain carts come here: a cart with a coupon, or paid through Stripe, and a request that
/// holds its key already, are written alone ([`Checkout::create_alone`]: a coupon's row lock and
/// redemptions, the sellers' accounts, the key's row lock). Cheap to clone.
#[derive(Clone)]
pub struct Writer {
    queue: mpsc::Sender<Pending>,
    completions: mpsc::Sender<(Completion, oneshot::Sender<Completed>)>,
}

/// Most checkouts in one transaction.
const WRITER_BATCH: usize = 64;

impl Writer {
    /// Starts the writer's task on the current runtime; it ends when every handle is dropped.
    pub fn start(pool: PgPool, fee_percent: Decimal, expiry: Duration) -> Self {
        let (queue, pending) = mpsc::channel(4 * WRITER_BATCH);
        let writing = pool.clone();
        tokio::spawn(in_batches(
            pending,
            WRITER_BATCH,
            WRITERS_IN_FLIGHT,
            move |batch| write_checkouts(writing.clone(), fee_percent, expiry, batch),
        ));
        let (completions, completing) = mpsc::channel(4 * WRITER_BATCH);
        tokio::spawn(in_batches(
            completing,
            WRITER_BATCH,
            WRITERS_IN_FLIGHT,
            move |batch| complete_batch(pool.clone(), batch),
        ));
        Self { queue, completions }
    }

    /// Stores a checkout's links and, once every one of them is stored, its answer, with those
    /// of the checkouts completing beside it. Returns whether every link was stored (the answer
    /// then stands), and the completion back. A batch that failed as a whole is written again
    /// alone, where its own error shows.
    async fn complete(
        &self,
        pool: &PgPool,
        completion: Completion,
    ) -> Result<(bool, Completion), CheckoutError> {
        let (reply, answer) = oneshot::channel();
        let completion = match self.completions.send((completion, reply)).await {
            Ok(()) => match answer.await {
                Ok(Completed::Done(answered, completion)) => return Ok((answered, completion)),
                Ok(Completed::Alone(completion)) => completion,
                // The batch's task panicked: its completions are lost with it. The request
                // fails and lets its key go; whether or not the statement had committed, the
                // same request again gets the stored answer or asks for the links again.
                Err(_) => {
                    return Err(CheckoutError::Database(sqlx::Error::WorkerCrashed));
                }
            },
            Err(mpsc::error::SendError((completion, _))) => completion,
        };
        let answered = store_completions(pool, std::slice::from_ref(&completion)).await?;
        Ok((answered.first().copied().unwrap_or(false), completion))
    }

    async fn write(
        &self,
        key: IdempotencyKey<'_>,
        me: &str,
        cart: &Cart,
        claim: Claiming,
    ) -> Written {
        let (reply, answer) = oneshot::channel();
        let pending = Pending {
            owner: key.owner.to_owned(),
            key: key.key.to_owned(),
            me: me.to_owned(),
            buyer: cart.buyer.clone(),
            gateway: cart.gateway,
            wanted: cart.wanted.clone(),
            traceparent: crate::traces::traceparent(),
            claim,
            reply,
        };
        if self.queue.send(pending).await.is_err() {
            return Written::Alone;
        }
        answer.await.unwrap_or(Written::Alone)
    }
}

/// A checkout's links, as the payment side gave them, and its answer, to store together.
struct Completion {
    owner: String,
    key: String,
    me: String,
    answer: serde_json::Value,
    /// Each link asked for: order number, payment attempt, session id, URL.
    links: Vec<(i64, i32, String, String)>,
}

enum Completed {
    /// Stored in a batch: whether every link was.
    Done(bool, Completion),
    /// The batch failed as a whole: to store alone.
    Alone(Completion),
}

/// Completes the checkouts that finish while others are stored, many to one statement and one
/// commit: at sixteen clients each checkout's own synchronous commit of its links and answer
/// was most of what its backends waited for (`WALWrite`, `WALSync`).
async fn complete_batch(pool: PgPool, batch: Vec<(Completion, oneshot::Sender<Completed>)>) {
    let (completions, replies): (Vec<Completion>, Vec<_>) = batch.into_iter().unzip();
    let stored = within_deadline(
        &pool,
        || {
            sqlx::Error::Io(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                format!("the batch did not finish within {WRITE_DEADLINE:?}"),
            ))
        },
        async |conn| store_completions(conn, &completions).await,
    )
    .await;
    if let Err(e) = &stored {
        tracing::warn!(checkouts = completions.len(), error = %e, "a batch of checkout answers failed; each is stored alone");
    }
    for (i, (completion, reply)) in completions.into_iter().zip(replies).enumerate() {
        let _ = reply.send(match &stored {
            Ok(answered) => Completed::Done(answered[i], completion),
            Err(_) => Completed::Alone(completion),
        });
    }
}

/// The links of a batch of completions, as columns: each by its completion's place.
#[derive(Default)]
struct LinkColumns<'a> {
    checkout: Vec<i32>,
    number: Vec<i64>,
    attempt: Vec<i32>,
    session: Vec<&'a str>,
    url: Vec<&'a str>,
}

/// The keys and answers of a batch of completions, as columns, with how many links each asked.
#[derive(Default)]
struct AnswerColumns<'a> {
    checkout: Vec<i32>,
    owner: Vec<&'a str>,
    key: Vec<&'a str>,
    me: Vec<&'a str>,
    answer: Vec<&'a serde_json::Value>,
    links: Vec<i32>,
}

/// [`store_completions`]' statement: the links on their orders, then the answers of the
/// checkouts whose links all landed, in one call of the database's `checkout_store_answers`
/// (migration 0063), whose plan reaches every order and key by its key however few the orders
/// were when it was made.
const STORE_COMPLETIONS: &str =
    "SELECT c FROM checkout_store_answers($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11) AS c";

/// Stores each completion's links (only on orders still without one, at the attempt asked
/// for) and, where every one of its links was stored, its answer with its key (only while its
/// request holds the key): one statement, one commit. Returns, for each, whether every link
/// was stored.
async fn store_completions<'c>(
    db: impl sqlx::PgExecutor<'c>,
    completions: &[Completion],
) -> Result<Vec<bool>, sqlx::Error> {
    let mut links = LinkColumns::default();
    let mut keys = AnswerColumns::default();
    for (c, completion) in completions.iter().enumerate() {
        let c = c as i32;
        for (number, attempt, session, url) in &completion.links {
            links.checkout.push(c);
            links.number.push(*number);
            links.attempt.push(*attempt);
            links.session.push(session);
            links.url.push(url);
        }
        keys.checkout.push(c);
        keys.owner.push(&completion.owner);
        keys.key.push(&completion.key);
        keys.me.push(&completion.me);
        keys.answer.push(&completion.answer);
        keys.links.push(completion.links.len() as i32);
    }
    let whole: Vec<i32> = sqlx::query_scalar(STORE_COMPLETIONS)
        .bind(&links.checkout)
        .bind(&links.number)
        .bind(&links.attempt)
        .bind(&links.session)
        .bind(&links.url)
        .bind(&keys.checkout)
        .bind(&keys.owner)
        .bind(&keys.key)
        .bind(&keys.me)
        .bind(&keys.answer)
        .bind(&keys.links)
        .fetch_all(db)
        .await?;
    let mut answered = vec![false; completions.len()];
    for c in whole {
        if let Some(a) = usize::try_from(c).ok().and_then(|c| answered.get_mut(c)) {
            *a = true;
        }
    }
    Ok(answered)
}

/// Batches in flight at once: one. With two (one writing its checkouts while the other held
/// the counter for its commit), sixteen clients' checkouts went two or three to a batch and
/// each batch's fixed cost (its statements' planning, the constraints' set-up, the commit)
/// was most of a checkout's CPU; with one, the checkouts that arrive meanwhile wait a batch
/// and go together. Alternating runs (README, design notes, "Batches one at a time"): 3.1 ms
/// of the machine's CPU a checkout against 4.2 ms, 487 checkouts a second against 410.
const WRITERS_IN_FLIGHT: usize = 1;

/// The longest a writer's batch may take (its statement takes milliseconds): one that never
/// returns (a lock waited on, a connection half-open after a failover) would hold the one
/// batch in flight, and every checkout behind it, for ever. Past it, the batch's connection is
/// closed (not pooled: the pool's check of a connection on its way back would wait on the same
/// lock or socket, its place in the pool held meanwhile) and each of its checkouts goes on
/// alone (or reaches its own deadline).
const WRITE_DEADLINE: Duration = Duration::from_secs(10);

/// Writes a batch of checkouts and answers each; the counter serialises the batches'
/// statements and commits.
async fn write_checkouts(
    pool: PgPool,
    fee_percent: Decimal,
    expiry: Duration,
    batch: Vec<Pending>,
) {
    let written = match write_batch(&pool, fee_percent, expiry, &batch).await {
        Ok(w) => w,
        Err(e) => {
            tracing::warn!(checkouts = batch.len(), error = %e, "a batch of checkouts failed; each is written alone");
            batch.iter().map(|_| Written::Alone).collect()
        }
    };
    for (p, w) in batch.into_iter().zip(written) {
        let _ = p.reply.send(w);
    }
}

/// [`write_on`] within [`WRITE_DEADLINE`], on one connection: each statement on a connection
/// of its own cost the pool's check of it on its way back, a round trip.
async fn write_batch(
    pool: &PgPool,
    fee_percent: Decimal,
    expiry: Duration,
    batch: &[Pending],
) -> Result<Vec<Written>, CheckoutError> {
    within_deadline(
        pool,
        || CheckoutError::Deadline(WRITE_DEADLINE),
        async |conn| write_on(conn, fee_percent, expiry, batch).await,
    )
    .await
}

/// `work` on one connection of `pool`, within [`WRITE_DEADLINE`] from now (its `late` error
/// past it). A connection whose work is cut off by the deadline is closed, not pooled: the
/// pool's check of a connection on its way back waits for whatever its statement waits on (a
/// lock, a socket half-open after a failover), holding its place in the pool meanwhile.
async fn within_deadline<T, E: From<sqlx::Error>>(
    pool: &PgPool,
    late: impl Fn() -> E,
    work: impl AsyncFnOnce(&mut PgConnection) -> Result<T, E>,
) -> Result<T, E> {
    let deadline = tokio::time::Instant::now() + WRITE_DEADLINE;
    let mut conn = tokio::time::timeout_at(deadline, pool.acquire())
        .await
        .map_err(|_| late())??;
    match tokio::time::timeout_at(deadline, work(&mut conn)).await {
        Ok(done) => done,
        Err(_) => {
            conn.close_on_drop();
            Err(late())
        }
    }
}

/// The products of `batch`'s carts read, each cart priced, then one statement: the keys
/// claimed, the checkouts of those claimed written, their orders numbered and written, and the
/// commit. Two round trips, where a transaction of its own took six or seven (README,
/// "Checkouts in one statement").
async fn write_on(
    conn: &mut PgConnection,
    fee_percent: Decimal,
    expiry: Duration,
    batch: &[Pending],
) -> Result<Vec<Written>, CheckoutError> {
    let mut out: Vec<Option<Written>> = batch.iter().map(|_| None).collect();
    // Read before the statement, outside any transaction: inside one, at READ COMMITTED, the
    // read would see the same committed rows (the products are not locked either way).
    let mut ids: Vec<ProductId> = batch
        .iter()
        .flat_map(|p| p.wanted.iter().map(|(id, _)| *id))
        .collect();
    ids.sort_unstable_by_key(|id| id.0);
    ids.dedup();
    let products = catalogue::products(&mut *conn, &ids).await?;
    let now = Utc::now();
    let expires_at =
        now + chrono::Duration::from_std(expiry).unwrap_or(chrono::Duration::minutes(30));
    let mut claims = ClaimColumns::default();
    let mut orders = NewOrders::default();
    // Each order's checkout, by its place among the orders pushed.
    let mut checkout_of: Vec<usize> = Vec::new();
    for (i, p) in batch.iter().enumerate() {
        let priced = cart_items(&p.wanted, &products)
            .and_then(|items| Ok(pricing::price(&items, None, fee_percent, now)?));
        let priced = match priced {
            Ok(priced) => priced,
            Err(e) => {
                out[i] = Some(Written::Refused(e));
                continue;
            }
        };
        claims.push(p);
        // The checkout's place among those claimed, which the statement maps to its id.
        let place = claims.owner.len() as i64;
        for o in &priced {
            orders.push(
                o,
                None,
                place,
                &p.buyer,
                p.gateway,
                p.traceparent.as_deref(),
            );
            checkout_of.push(i);
        }
    }
    // A refused cart whose key exists already is its key's business first (the first answer, a
    // reused key's 422, a running request's 409), as when keys were claimed before pricing: it
    // goes to the claim on its own. Looked up only when a cart is refused.
    let (owners, keys): (Vec<&str>, Vec<&str>) = batch
        .iter()
        .zip(&out)
        .filter(|(_, w)| w.is_some())
        .map(|(p, _)| (p.owner.as_str(), p.key.as_str()))
        .unzip();
    if !owners.is_empty() {
        let existing: Vec<(String, String)> = sqlx::query_as(
            "SELECT owner, key FROM idempotency_keys
             WHERE owner = ANY($1) AND key = ANY($2)
               AND (owner, key) IN (SELECT * FROM unnest($1::text[], $2::text[]))",
        )
        .bind(&owners)
        .bind(&keys)
        .fetch_all(&mut *conn)
        .await?;
        for (p, w) in batch.iter().zip(out.iter_mut()) {
            if w.is_some() && existing.iter().any(|(o, k)| *o == p.owner && *k == p.key) {
                *w = Some(Written::Taken);
            }
        }
    }
    if !claims.owner.is_empty() {
        for (place, checkout, order) in orders.claim_and_insert(conn, &claims, expires_at).await? {
            let Some(i) = usize::try_from(place - 1)
                .ok()
                .and_then(|k| checkout_of.get(k))
            else {
                continue;
            };
            match &mut out[*i] {
                Some(Written::Created(_, orders)) => orders.push(order),
                slot => *slot = Some(Written::Created(checkout, vec![order])),
            }
        }
    }
    // A cart priced whose checkout was not written: its key was there already.
    Ok(out
        .into_iter()
        .map(|w| w.unwrap_or(Written::Taken))
        .collect())
}

/// The keys a batch claims and their checkouts, as columns.
#[derive(Default)]
struct ClaimColumns<'a> {
    owner: Vec<&'a str>,
    key: Vec<&'a str>,
    hash: Vec<&'a [u8]>,
    lock_secs: Vec<f64>,
    me: Vec<&'a str>,
    buyer: Vec<&'a str>,
    gateway: Vec<GatewayName>,
}

impl<'a> ClaimColumns<'a> {
    fn push(&mut self, p: &'a Pending) {
        self.owner.push(&p.owner);
        self.key.push(&p.key);
        self.hash.push(&p.claim.hash);
        self.lock_secs.push(p.claim.lock_secs);
        self.me.push(&p.me);
        self.buyer.push(&p.buyer);
        self.gateway.push(p.gateway);
    }
}

/// A checkout's orders and their lines, as columns, for the one statement that numbers and
/// writes them.
#[derive(Default)]
struct NewOrders {
    /// The trace each order's `created` message continues: its checkout request's (`traces`).
    traceparent: Vec<Option<String>>,
    /// Each order's checkout: its id ([`NewOrders::insert`]), or its place among the checkouts
    /// the statement claims keys for ([`NewOrders::claim_and_insert`]).
    checkout: Vec<i64>,
    buyer_id: Vec<String>,
    gateway: Vec<GatewayName>,
    seller_id: Vec<uuid::Uuid>,
    kind: Vec<ProductKind>,
    interval: Vec<Option<String>>,
    currency: Vec<String>,
    subtotal: Vec<Decimal>,
    discount: Vec<Decimal>,
    total: Vec<Decimal>,
    platform_fee: Vec<Decimal>,
    seller_net: Vec<Decimal>,
    coupon_id: Vec<Option<uuid::Uuid>>,
    /// Each line's order, by its place (1-based) among the checkout's orders.
    line_order: Vec<i64>,
    line: Vec<i32>,
    product_id: Vec<uuid::Uuid>,
    name: Vec<String>,
    unit_price: Vec<Decimal>,
    quantity: Vec<i32>,
    line_subtotal: Vec<Decimal>,
    line_discount: Vec<Decimal>,
}

/// The statement that numbers and writes orders (`$1` to `$27`, [`NewOrders::bind`]) with their
/// items, redemptions, first messages and expiry jobs, after `checkouts`: CTEs ending in one
/// named `w` with a row `(place, checkout_id)` for each order to write (its place among the
/// orders pushed, 1-based, and its checkout's id). The orders not in `w` are not written, nor
/// numbered. Every array reaches the planner as a sub-select's value (README, "Plans made
/// once").
fn write_orders_sql(checkouts: &str) -> String {
    [
        "WITH ",
        checkouts,
        ", t AS MATERIALIZED (
                 SELECT w.place, w.checkout_id, row_number() OVER (ORDER BY w.place) AS wplace FROM w
             ), n AS (
                 -- Its condition reads the orders to write, so the keys are claimed (and a key
                 -- that another transaction is claiming waited for) before the counter is held.
                 UPDATE order_numbers SET last = last + (SELECT count(*) FROM t)
                 WHERE singleton AND EXISTS (SELECT FROM t) RETURNING last
             ), o AS (
                 -- No counter row: no number, and the orders' NOT NULL refuses the statement.
                 INSERT INTO orders (number, checkout_id, seller_id, buyer_id, kind, \"interval\", currency,
                                     subtotal, discount, total, platform_fee, seller_net, gateway, coupon_id, expires_at)
                 SELECT (SELECT last FROM n) - (SELECT count(*) FROM t) + t.wplace, t.checkout_id, u.seller_id,
                        u.buyer_id, u.kind, u.interval, u.currency, u.subtotal, u.discount, u.total,
                        u.platform_fee, u.seller_net, u.gateway, u.coupon_id, $14
                 FROM t JOIN unnest((SELECT $1::uuid[]), (SELECT $2::text[]), (SELECT $3::text[]),
                                    (SELECT $4::bpchar[]), (SELECT $5::numeric[]), (SELECT $6::numeric[]),
                                    (SELECT $7::numeric[]), (SELECT $8::numeric[]), (SELECT $9::numeric[]),
                                    (SELECT $10::uuid[]), (SELECT $12::text[]), (SELECT $13::text[]))
                      WITH ORDINALITY AS u(seller_id, kind, interval, currency, subtotal, discount, total,
                                           platform_fee, seller_net, coupon_id, buyer_id, gateway, place)
                      ON u.place = t.place
                 RETURNING id, number, checkout_id, coupon_id,
                           number - (SELECT last FROM n) + (SELECT count(*) FROM t) AS wplace,
                           seller_id, buyer_id, kind, \"interval\", currency::text AS currency, subtotal, discount,
                           total, platform_fee, seller_net, amount_refunded, status, payment_status, gateway,
                           payment_attempt, payment_token, session_id, payment_url, expires_at, paid_at, created_at
             ), placed AS MATERIALIZED (
                 SELECT o.*, t.place FROM o JOIN t ON t.wplace = o.wplace
             ), items AS (
                 INSERT INTO order_items (order_id, line, product_id, name, unit_price, quantity, subtotal, discount)
                 SELECT p.id, l.line, l.product_id, l.name, l.unit_price, l.quantity, l.subtotal, l.discount
                 FROM unnest((SELECT $15::bigint[]), (SELECT $16::int[]), (SELECT $17::uuid[]),
                             (SELECT $18::text[]), (SELECT $19::numeric[]), (SELECT $20::int[]),
                             (SELECT $21::numeric[]), (SELECT $22::numeric[]))
                      AS l(place, line, product_id, name, unit_price, quantity, subtotal, discount)
                 JOIN placed p ON p.place = l.place
             ), redemptions AS (
                 INSERT INTO coupon_redemptions (order_id, coupon_id) SELECT id, coupon_id FROM o WHERE coupon_id IS NOT NULL
             ), events AS (
                 INSERT INTO order_events (order_id, kind, payload, traceparent)
                 SELECT p.id, 'created', jsonb_build_object('number', p.number), tp.traceparent
                 FROM placed p LEFT JOIN unnest((SELECT $27::text[])) WITH ORDINALITY AS tp(traceparent, place)
                     ON tp.place = p.place
             ), expiries AS (",
        &payfleet_queue::insert_jobs_from("(SELECT $23::text AS job_queue, $24::text AS job_kind, $25 || number AS job_key,
                         jsonb_build_object('number', number) AS job_payload, $14::timestamptz AS job_run_at,
                         $26::int AS job_max_attempts, NULL::text AS job_fairness_key FROM o) AS t"),
        ")
             -- The orders as written, for the checkouts' answers (a new order starts no
             -- subscription yet), with their places and checkouts.
             SELECT place, checkout_id, id, number, seller_id, buyer_id, kind, \"interval\", currency, subtotal,
                    discount, total, platform_fee, seller_net, amount_refunded, status, payment_status, gateway,
                    payment_attempt, payment_token, session_id, payment_url, expires_at, paid_at, created_at,
                    NULL::uuid AS subscription_id
             FROM placed ORDER BY number",
    ]
    .concat()
}

/// The orders of one checkout whose id `$11` gives for each order.
static WRITE_ORDERS: LazyLock<String> = LazyLock::new(|| {
    write_orders_sql(
        "w AS (SELECT u.place, u.checkout_id
               FROM unnest((SELECT $11::bigint[])) WITH ORDINALITY AS u(checkout_id, place))",
    )
});

/// The keys of a batch of new checkouts (`$28` to `$34`, [`ClaimColumns`]) claimed, the
/// checkouts of those claimed written, and their orders (`$11`: each order's checkout by its
/// place among the keys) numbered and written. A key that exists already (a repeat, another
/// request's, or twice in the batch) claims nothing: its checkout and orders are not written.
static CLAIM_AND_WRITE_ORDERS: LazyLock<String> = LazyLock::new(|| {
    write_orders_sql(
        "x AS MATERIALIZED (
             SELECT nextval('checkouts_id_seq'::regclass) AS id, c.*
             FROM unnest((SELECT $28::text[]), (SELECT $29::text[]), (SELECT $30::bytea[]),
                         (SELECT $31::float8[]), (SELECT $32::text[]), (SELECT $33::text[]),
                         (SELECT $34::text[]))
                  WITH ORDINALITY AS c(owner, key, hash, secs, me, buyer, gateway, place)
         ), k AS (
             INSERT INTO idempotency_keys (owner, key, request_hash, locked_until, locked_by, checkout_id)
             SELECT owner, key, hash, now() + secs * interval '1 second', me, id FROM x
             ON CONFLICT (owner, key) DO NOTHING
             RETURNING checkout_id
         ), claimed AS MATERIALIZED (
             SELECT x.id, x.place, x.buyer, x.gateway FROM x JOIN k ON k.checkout_id = x.id
         ), c AS (
             INSERT INTO checkouts (id, buyer_id, gateway) SELECT id, buyer, gateway FROM claimed
         ), w AS (
             SELECT u.place, claimed.id AS checkout_id
             FROM unnest((SELECT $11::bigint[])) WITH ORDINALITY AS u(checkout, place)
             JOIN claimed ON claimed.place = u.checkout
         )",
    )
});

/// An order as the statement wrote it, with its place among the orders pushed and its checkout.
#[derive(sqlx::FromRow)]
struct PlacedRow {
    place: i64,
    checkout_id: i64,
    #[sqlx(flatten)]
    order: super::OrderRow,
}

impl NewOrders {
    fn push(
        &mut self,
        o: &pricing::PricedOrder,
        coupon: Option<catalogue::CouponId>,
        checkout: i64,
        buyer: &str,
        gateway: GatewayName,
        traceparent: Option<&str>,
    ) {
        self.traceparent.push(traceparent.map(str::to_owned));
        self.checkout.push(checkout);
        self.buyer_id.push(buyer.to_owned());
        self.gateway.push(gateway);
        self.seller_id.push(o.seller_id.0);
        self.kind.push(o.kind);
        self.interval.push(o.interval.map(|i| i.to_string()));
        self.currency.push(o.currency.as_str().to_owned());
        self.subtotal.push(o.subtotal.amount());
        self.discount.push(o.discount.amount());
        self.total.push(o.total.amount());
        self.platform_fee.push(o.platform_fee.amount());
        self.seller_net.push(o.seller_net.amount());
        self.coupon_id.push(coupon.map(|c| c.0));
        let place = self.seller_id.len() as i64;
        for (line, l) in o.lines.iter().enumerate() {
            self.line_order.push(place);
            self.line.push(line as i32 + 1);
            self.product_id.push(l.product.id.0);
            self.name.push(l.product.name.clone());
            self.unit_price.push(l.unit_price.amount());
            self.quantity.push(l.quantity as i32);
            self.line_subtotal.push(l.subtotal.amount());
            self.line_discount.push(l.discount.amount());
        }
    }

    /// Takes the next numbers from the counter row (sequential, no gaps: a rolled-back checkout
    /// gives them back) and writes the orders of one checkout, their lines, their coupon
    /// redemptions, their `created` events and their expiry jobs (`expiry::ExpireOrder`, its
    /// payload and key made here from each number, which a test of that module pins), in one
    /// statement of `tx`. Returns the orders as written, with their lines, in the orders' order.
    async fn insert(
        &self,
        tx: &mut PgConnection,
        expires_at: chrono::DateTime<Utc>,
    ) -> Result<Vec<OrderView>, sqlx::Error> {
        let rows = self
            .bind(sqlx::query_as(WRITE_ORDERS.as_str()), expires_at)
            .fetch_all(&mut *tx)
            .await?;
        Ok(self.views(rows).into_iter().map(|(_, _, o)| o).collect())
    }

    /// As [`Self::insert`], for a batch of new checkouts whose keys `claims` claims, in one
    /// statement that is its own transaction. Returns the orders written, each with its place
    /// among those pushed and its checkout's id; a checkout whose key was there already has
    /// none.
    async fn claim_and_insert(
        &self,
        conn: &mut PgConnection,
        claims: &ClaimColumns<'_>,
        expires_at: chrono::DateTime<Utc>,
    ) -> Result<Vec<(i64, i64, OrderView)>, sqlx::Error> {
        let rows = self
            .bind(sqlx::query_as(CLAIM_AND_WRITE_ORDERS.as_str()), expires_at)
            .bind(&claims.owner)
            .bind(&claims.key)
            .bind(&claims.hash)
            .bind(&claims.lock_secs)
            .bind(&claims.me)
            .bind(&claims.buyer)
            .bind(&claims.gateway)
            .fetch_all(conn)
            .await?;
        Ok(self.views(rows))
    }

    /// Binds `$1` to `$27`.
    fn bind<'q>(
        &'q self,
        query: sqlx::query::QueryAs<'q, sqlx::Postgres, PlacedRow, sqlx::postgres::PgArguments>,
        expires_at: chrono::DateTime<Utc>,
    ) -> sqlx::query::QueryAs<'q, sqlx::Postgres, PlacedRow, sqlx::postgres::PgArguments> {
        let kinds: Vec<&str> = self.kind.iter().map(|k| k.as_str()).collect();
        query
            .bind(&self.seller_id)
            .bind(kinds)
            .bind(&self.interval)
            .bind(&self.currency)
            .bind(&self.subtotal)
            .bind(&self.discount)
            .bind(&self.total)
            .bind(&self.platform_fee)
            .bind(&self.seller_net)
            .bind(&self.coupon_id)
            .bind(&self.checkout)
            .bind(&self.buyer_id)
            .bind(&self.gateway)
            .bind(expires_at)
            .bind(&self.line_order)
            .bind(&self.line)
            .bind(&self.product_id)
            .bind(&self.name)
            .bind(&self.unit_price)
            .bind(&self.quantity)
            .bind(&self.line_subtotal)
            .bind(&self.line_discount)
            .bind(ExpireOrder::QUEUE)
            .bind(ExpireOrder::KIND)
            .bind(ExpireOrder::KEY_PREFIX)
            .bind(ExpireOrder::MAX_ATTEMPTS)
            .bind(&self.traceparent)
    }

    /// The orders written, with the lines pushed for each: (place, checkout, order).
    fn views(&self, rows: Vec<PlacedRow>) -> Vec<(i64, i64, OrderView)> {
        rows.into_iter()
            .map(|row| {
                let items = (0..self.line_order.len())
                    .filter(|l| self.line_order[*l] == row.place)
                    .map(|l| super::ItemView {
                        product_id: ProductId(self.product_id[l]),
                        name: self.name[l].clone(),
                        unit_price: self.unit_price[l],
                        quantity: self.quantity[l],
                        subtotal: self.line_subtotal[l],
                        discount: self.line_discount[l],
                    })
                    .collect();
                (row.place, row.checkout_id, super::view_of(row.order, items))
            })
            .collect()
    }
}

/// Asks the payment side for an order's link and stores it on the order. Returns the link
/// stored (none: the order had one stored meanwhile, by another request), or why not and
/// whether asking again later may work.
pub async fn link(
    pool: &PgPool,
    links: &dyn PaymentLinks,
    o: &OrderView,
    fee_percent: Decimal,
) -> Result<Option<PaymentLinkView>, (String, bool)> {
    let view = ask_link(pool, links, o, fee_percent).await?;
    let stored = sqlx::query(
        "UPDATE orders SET session_id = $2, payment_url = $3, updated_at = now()
         WHERE number = $1 AND session_id IS NULL AND payment_attempt = $4",
    )
    .bind(o.number)
    .bind(&view.session_id)
    .bind(&view.url)
    .bind(o.payment_attempt)
    .execute(pool)
    .await
    .map_err(|e| (e.to_string(), true))?;
    Ok((stored.rows_affected() == 1).then_some(view))
}

/// Asks the payment side for an order's link (not stored yet), or says why not and whether
/// asking again later may work.
async fn ask_link(
    pool: &PgPool,
    links: &dyn PaymentLinks,
    o: &OrderView,
    fee_percent: Decimal,
) -> Result<PaymentLinkView, (String, bool)> {
    // Only a gateway that charges on the seller's own account (Stripe's) needs it.
    let seller_account = if gateways::format(o.gateway).charges_on_seller_account() {
        catalogue::seller(pool, o.seller_id)
            .await
            .map_err(|e| (e.to_string(), true))?
            .and_then(|s| s.stripe_account)
    } else {
        None
    };
    let money =
        |v: &str| crate::money::Money::parse(v, &o.currency).map_err(|e| (e.to_string(), false));
    // A coupon discounts a subscription's first period only: the later ones cost the
    // subtotal, as the subscription records (and the fleet's own billing charges), and the
    // platform's commission on them is priced on that.
    let renews_at = if o.kind == ProductKind::Subscription && o.subtotal != o.total {
        Some(money(&o.subtotal)?)
    } else {
        None
    };
    let renews_fee = match &renews_at {
        Some(later) => Some(later.percent(fee_percent).ok_or_else(|| {
            (
                format!(
                    "the commission on order {}'s later periods is too large",
                    o.number
                ),
                false,
            )
        })?),
        None => None,
    };
    let request = PaymentLinkRequest {
        order_number: o.number,
        gateway: o.gateway,
        amount: money(&o.total)?,
        platform_fee: money(&o.platform_fee)?,
        seller_id: o.seller_id.to_string(),
        seller_account,
        buyer_id: o.buyer_id.clone(),
        description: format!(
            "Order {}{}",
            o.number,
            if o.kind == ProductKind::Subscription {
                " (subscription)"
            } else {
                ""
            }
        ),
        recurring_interval: o.interval.map(|i| i.as_str().to_owned()),
        attempt: o.payment_attempt,
        link_key: format!("{}-{}", o.payment_token.simple(), o.payment_attempt),
        expires_at: o.expires_at,
        renews_at,
        renews_fee,
        // Set by the RPC's client, which knows its timeout (`messaging::rpc::BatchedLinks`).
        answer_within_ms: None,
    };
    match links.create(&request).await {
        Ok(PaymentLinkReply::Created { session_id, url }) => Ok(PaymentLinkView {
            gateway: o.gateway,
            session_id,
            url,
        }),
        Ok(PaymentLinkReply::Failed {
            code,
            message,
            retryable,
        }) => {
            tracing::warn!(order = o.number, %code, %message, "the payment side could not make a link");
            Err((format!("{code}: {message}"), retryable))
        }
        Err(e) if e.is_transient() => {
            tracing::warn!(order = o.number, error = %e, "no payment link");
            Err((e.to_string(), true))
        }
        Err(e) => Err((e.to_string(), false)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::db::{one_connection, plan_counts};

    /// Sequential scans of `orders` by one call of [`STORE_COMPLETIONS`] (a batch of none) on a
    /// connection of its own, whose plans are made afresh while there are no orders: read from
    /// the transaction's own counters.
    async fn order_scans_storing_answers(pool: &PgPool) -> i64 {
        use sqlx::Connection;
        let mut conn = PgConnection::connect_with(&pool.connect_options())
            .await
            .unwrap();
        let mut tx = conn.begin().await.unwrap();
        let none: (Vec<i32>, Vec<i64>, Vec<String>, Vec<serde_json::Value>) = Default::default();
        let _: Vec<i32> = sqlx::query_scalar(STORE_COMPLETIONS)
            .bind(&none.0)
            .bind(&none.1)
            .bind(&none.0)
            .bind(&none.2)
            .bind(&none.2)
            .bind(&none.0)
            .bind(&none.2)
            .bind(&none.2)
            .bind(&none.2)
            .bind(&none.3)
            .bind(&none.0)
            .fetch_all(&mut *tx)
            .await
            .unwrap();
        let scans: i64 = sqlx::query_scalar(
            "SELECT coalesce(sum(seq_scan), 0)::int8 FROM pg_stat_xact_user_tables WHERE relname = 'orders'",
        )
        .fetch_one(&mut *tx)
        .await
        .unwrap();
        tx.rollback().await.unwrap();
        scans
    }

    /// The answers' statement is planned once per connection and the plan kept while the
    /// orders grow: made while there were none, it scanned every order to store a batch's
    /// links. In its function (sequential scans off for the call) it finds each by its key.
    #[sqlx::test(migrator = "crate::db::MIGRATOR")]
    async fn storing_answers_planned_on_few_orders_finds_each_by_key(pool: PgPool) {
        assert_eq!(order_scans_storing_answers(&pool).await, 0);
        // The hazard, with the function's setting taken away.
        sqlx::query(
            "ALTER FUNCTION checkout_store_answers(int[], bigint[], int[], text[], text[], int[], text[],
                                                  text[], text[], jsonb[], int[]) RESET enable_seqscan",
        )
        .execute(&pool)
        .await
        .unwrap();
        assert!(order_scans_storing_answers(&pool).await > 0);
    }

    async fn product(pool: &PgPool) -> ProductId {
        let seller = catalogue::create_seller(
            pool,
            catalogue::NewSeller {
                name: "A".into(),
                payout_frequency: "weekly".parse().unwrap(),
                payout_minimum: "0".into(),
                holding_days: Some(0),
                stripe_account: None,
                payout_minimums: Default::default(),
            },
        )
        .await
        .unwrap();
        catalogue::create_product(
            pool,
            catalogue::NewProduct {
                seller_id: seller.id.to_string(),
                name: "P".into(),
                kind: ProductKind::OneOff,
                price: "5.00".into(),
                currency: "BRL".into(),
                interval: None,
            },
        )
        .await
        .unwrap()
        .id
    }

    /// A new plain checkout of one unit of `product`, for the writer to claim `key` for.
    fn new_checkout(key: &str, product: ProductId) -> (Pending, oneshot::Receiver<Written>) {
        let (reply, answer) = oneshot::channel();
        let pending = Pending {
            owner: "api-key".into(),
            key: key.into(),
            me: format!("me-{key}"),
            buyer: format!("buyer-{key}"),
            gateway: GatewayName::Internal,
            wanted: vec![(product, 1)],
            traceparent: None,
            claim: Claiming {
                hash: vec![1],
                lock_secs: 30.0,
            },
            reply,
        };
        (pending, answer)
    }

    async fn write(pool: &PgPool, batch: &[Pending]) -> Vec<Written> {
        write_batch(pool, Decimal::TEN, Duration::from_secs(600), batch)
            .await
            .unwrap()
    }

    #[sqlx::test(migrator = "crate::db::MIGRATOR")]
    async fn a_batch_of_new_checkouts_is_claimed_and_written_on_one_plan(pool: PgPool) {
        let product = product(&pool).await;
        let pool = one_connection(&pool).await;
        let mut number = 0;
        for call in 0..8 {
            // Batches of one to four checkouts, as sixteen clients send them.
            let batch: Vec<Pending> = (0..=call % 4)
                .map(|i| new_checkout(&format!("key-{call}-{i}"), product).0)
                .collect();
            for written in write(&pool, &batch).await {
                let Written::Created(_, orders) = written else {
                    panic!("not written")
                };
                number += 1;
                assert_eq!(orders[0].number, number, "numbered in the batch's order");
            }
        }
        let (generic, custom) =
            plan_counts(&pool, "INSERT INTO idempotency_keys (owner, key").await;
        assert_eq!(
            (generic, custom),
            (3, 5),
            "planned for its values five times, then once for all"
        );
    }

    /// Storing a checkout's link changes no indexed column of its order (migration 0059): the
    /// update stays on the order's page, with no new index entry.
    #[sqlx::test(migrator = "crate::db::MIGRATOR")]
    async fn storing_a_link_updates_its_order_in_place(pool: PgPool) {
        let product = product(&pool).await;
        let one = one_connection(&pool).await;
        let written = write(&one, &[new_checkout("key-1", product).0]).await;
        let Written::Created(_, orders) = &written[0] else {
            panic!("written")
        };
        let counts = || async {
            sqlx::query("SELECT pg_stat_force_next_flush()")
                .execute(&one)
                .await
                .unwrap();
            sqlx::query_as::<_, (i64, i64)>(
                "SELECT n_tup_upd, n_tup_hot_upd FROM pg_stat_user_tables WHERE relname = 'orders'",
            )
            .fetch_one(&one)
            .await
            .unwrap()
        };
        let before = counts().await;
        let completion = Completion {
            owner: "api-key".into(),
            key: "key-1".into(),
            me: "me-key-1".into(),
            answer: serde_json::json!({"orders": []}),
            links: vec![(
                orders[0].number,
                1,
                "ips_1".into(),
                "https://pay/ips_1".into(),
            )],
        };
        assert_eq!(
            store_completions(&one, &[completion]).await.unwrap(),
            [true]
        );
        let after = counts().await;
        assert_eq!(
            (after.0 - before.0, after.1 - before.1),
            (1, 1),
            "one update of the order, on its own page"
        );
    }

    /// The keys are claimed before the counter is held: a key another transaction is claiming
    /// holds up its batch, but not the numbering of other checkouts meanwhile (nor could two
    /// batches deadlock, each holding what the other waits for), and once that transaction
    /// commits, the key is answered as taken and the rest of the batch is written.
    #[sqlx::test(migrator = "crate::db::MIGRATOR")]
    async fn a_key_claimed_elsewhere_holds_up_its_batch_not_the_counter(pool: PgPool) {
        let product = product(&pool).await;
        let mut elsewhere = pool.begin().await.unwrap();
        sqlx::query(
            "INSERT INTO idempotency_keys (owner, key, request_hash, locked_until, locked_by)
             VALUES ('api-key', 'key-1', '\\x01', now() + interval '30 seconds', 'another')",
        )
        .execute(&mut *elsewhere)
        .await
        .unwrap();
        let batch = pool.clone();
        let writing = tokio::spawn(async move {
            let batch_of = [
                new_checkout("key-1", product).0,
                new_checkout("key-2", product).0,
            ];
            write(&batch, &batch_of).await
        });
        // The batch waits for the key's transaction...
        let mut waited = false;
        for _ in 0..100 {
            waited = sqlx::query_scalar(
                "SELECT EXISTS (SELECT FROM pg_stat_activity
                                WHERE wait_event_type = 'Lock' AND query LIKE '%INSERT INTO idempotency_keys (owner, key%')",
            )
            .fetch_one(&pool)
            .await
            .unwrap();
            if waited {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert!(waited, "the batch waits for the key being claimed");
        // ... without holding the counter.
        let mut other = pool.begin().await.unwrap();
        let counter: Option<i64> =
            sqlx::query_scalar("SELECT last FROM order_numbers WHERE singleton FOR UPDATE NOWAIT")
                .fetch_optional(&mut *other)
                .await
                .expect("the counter is free while the batch waits for a key");
        assert_eq!(counter, Some(0));
        other.rollback().await.unwrap();
        elsewhere.commit().await.unwrap();
        let written = writing.await.unwrap();
        assert!(matches!(written[0], Written::Taken), "key-1 is the other's");
        let Written::Created(checkout, orders) = &written[1] else {
            panic!("key-2 is written")
        };
        assert_eq!(orders.iter().map(|o| o.number).collect::<Vec<_>>(), [1]);
        let keys: Vec<(String, Option<i64>, Option<String>)> =
            sqlx::query_as("SELECT key, checkout_id, locked_by FROM idempotency_keys ORDER BY key")
                .fetch_all(&pool)
                .await
                .unwrap();
        assert_eq!(
            keys,
            [
                ("key-1".to_owned(), None, Some("another".to_owned())),
                (
                    "key-2".to_owned(),
                    Some(*checkout),
                    Some("me-key-2".to_owned())
                ),
            ]
        );
    }

    /// A request whose writer's batch committed and then failed to say so (its deadline passed
    /// during the commit, its connection dropped after it) claims its key again and finds it
    /// claimed, by itself: the checkout is its own to finish, not a 409 `idempotency_key_in_use`
    /// for it and every retry while its own lock lasts. Another request's lock is still 409.
    #[sqlx::test(migrator = "crate::db::MIGRATOR")]
    async fn a_request_that_finds_its_key_claimed_by_itself_goes_on_with_its_checkout(
        pool: PgPool,
    ) {
        /// Never asked: the claim asks no link.
        struct NoLinks;
        impl PaymentLinks for NoLinks {
            fn create<'a>(
                &'a self,
                _: &'a PaymentLinkRequest,
            ) -> std::pin::Pin<
                Box<
                    dyn std::future::Future<
                            Output = Result<PaymentLinkReply, crate::messaging::rpc::RpcError>,
                        > + Send
                        + 'a,
                >,
            > {
                Box::pin(async { Err(crate::messaging::rpc::RpcError::NotConnected) })
            }
        }
        let product = product(&pool).await;
        let written = write(&pool, &[new_checkout("key-1", product).0]).await;
        let Written::Created(checkout_id, _) = &written[0] else {
            panic!("written")
        };
        let checkout = Checkout {
            pool: pool.clone(),
            links: Arc::new(NoLinks),
            fee_percent: Decimal::from(10),
            expiry: Duration::from_secs(900),
            gateways: vec![GatewayName::Internal],
            rpc_timeout: Duration::from_secs(5),
            writer: Writer::start(pool.clone(), Decimal::from(10), Duration::from_secs(900)),
        };
        let hash: Vec<u8> =
            sqlx::query_scalar("SELECT request_hash FROM idempotency_keys WHERE key = 'key-1'")
                .fetch_one(&pool)
                .await
                .unwrap();
        let key = IdempotencyKey {
            owner: "api-key",
            key: "key-1",
        };
        match checkout.claim(key, &hash, "me-key-1", None).await {
            Ok(Claim::Owned(Some(id))) => assert_eq!(id, *checkout_id),
            Ok(_) => panic!("not its own checkout"),
            Err(e) => panic!("{e}"),
        }
        match checkout.claim(key, &hash, "another", None).await {
            Err(CheckoutError::KeyInUse) => {}
            Ok(_) => panic!("another request took a key in use"),
            Err(e) => panic!("{e}"),
        }
    }

    #[sqlx::test(migrator = "crate::db::MIGRATOR")]
    async fn storing_links_and_answers_keeps_its_plan(pool: PgPool) {
        let pool = one_connection(&pool).await;
        for call in 0..8_i64 {
            // Batches of one to four checkouts, as sixteen clients send them.
            let completions: Vec<Completion> = (0..=call % 4)
                .map(|i| Completion {
                    owner: "seller".to_owned(),
                    key: format!("key-{call}-{i}"),
                    me: "me".to_owned(),
                    answer: serde_json::json!({"orders": []}),
                    links: vec![(
                        1000 * call + i,
                        1,
                        format!("cs_{call}_{i}"),
                        "https://pay".to_owned(),
                    )],
                })
                .collect();
            let answered = store_completions(&pool, &completions).await.unwrap();
            assert_eq!(answered, vec![false; completions.len()], "no such orders");
        }
        let (generic, custom) = plan_counts(&pool, "FROM checkout_store_answers(").await;
        assert_eq!(
            (generic, custom),
            (3, 5),
            "planned for its values five times, then once for all"
        );
    }
}

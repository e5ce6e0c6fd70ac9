//! What the soak's buyers, backend, operator and gateway do: each buyer's journey is drawn from
//! the seed and its number, and everything it does that moves money is written in the model as
//! it is done.
//!
//! Money enters only through the payment simulator's page (the internal gateway then knows every
//! payment it must give back); the soak adds what a real gateway does beyond it: disputes, refunds
//! made in its own dashboard (`refund.succeeded` the fleet did not ask for), events held back so
//! that a later one overtakes them, and, through the relay, lost, failed, slow and repeated
//! deliveries.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{Context, bail};
use chrono::{DateTime, Utc};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use rust_decimal::Decimal;
use serde_json::{Value, json};
use sqlx::PgPool;
use tokio::time::Instant;

use super::api::{Api, Who};
use super::model::{self, Coupon, DisputeEnd, Fate, Model, Order};
use super::relay::Relay;

/// A product the soak sells.
#[derive(Debug, Clone)]
pub struct Product {
    pub id: String,
    pub seller: String,
    pub price: Decimal,
}

/// What the soak set up before the run.
#[derive(Debug, Default)]
pub struct Catalogue {
    /// Per seller, its one-off products.
    pub one_off: Vec<Vec<Product>>,
    pub subscriptions: Vec<Product>,
}

pub struct Shared {
    pub api: Api,
    pub relay: Relay,
    pub pool: PgPool,
    pub catalogue: Catalogue,
    pub fee_percent: Decimal,
    pub seed: u64,
    /// How long before its expiry a payment must be made to be certainly in time (delivery
    /// faults plus reconciliation's grace and schedule).
    pub in_time_margin: chrono::Duration,
    pub model: Mutex<Model>,
    /// Subscriptions started, to cancel at the end and count their renewals.
    pub subscriptions: Mutex<Vec<String>>,
    /// What a journey could not do (an answer the API does not state): each is a finding.
    pub failures: Mutex<Vec<String>>,
    pub journeys: Mutex<std::collections::BTreeMap<&'static str, usize>>,
}

/// An order as its checkout answered.
#[derive(Debug, Clone)]
struct Placed {
    number: i64,
    url: String,
    expires_at: DateTime<Utc>,
}

const PERCENT_COUPON: &str = "SOAK15";
const AMOUNT_COUPON: &str = "SOAK3";

pub fn coupons() -> [(&'static str, Value); 2] {
    [
        (
            PERCENT_COUPON,
            json!({"code": PERCENT_COUPON, "percent_off": "15"}),
        ),
        (
            AMOUNT_COUPON,
            json!({"code": AMOUNT_COUPON, "amount_off": "3.00", "currency": "BRL"}),
        ),
    ]
}

fn decimal(v: &Value) -> Decimal {
    v.as_str()
        .and_then(|s| s.parse().ok())
        .unwrap_or(Decimal::MIN)
}

impl Shared {
    fn note(&self, failure: String) {
        if let Ok(mut f) = self.failures.lock() {
            f.push(failure);
        }
    }

    fn with_model<T>(&self, f: impl FnOnce(&mut Model) -> T) -> anyhow::Result<T> {
        let mut m = self
            .model
            .lock()
            .map_err(|_| anyhow::anyhow!("the model's lock is poisoned"))?;
        Ok(f(&mut m))
    }

    fn fate_of_payment_now(&self, expires_at: DateTime<Utc>) -> Fate {
        if Utc::now() + self.in_time_margin < expires_at {
            Fate::Paid
        } else {
            Fate::InDoubt
        }
    }

    /// Changes the model's order `number`.
    fn order_mut(&self, number: i64, f: impl FnOnce(&mut Order)) -> anyhow::Result<()> {
        self.with_model(|m| m.orders.get_mut(&number).map(f))?;
        Ok(())
    }

    /// The model's total of order `number`.
    fn total(&self, number: i64) -> anyhow::Result<Decimal> {
        self.with_model(|m| m.orders.get(&number).map(|o| o.priced.total))?
            .with_context(|| format!("order {number} is not in the model"))
    }

    /// One order of a one-seller cart, if the checkout made one.
    async fn one(
        &self,
        rng: &mut StdRng,
        key: &str,
        buyer: &str,
    ) -> anyhow::Result<Option<Placed>> {
        Ok(self.shop(rng, key, buyer, 1).await?.into_iter().next())
    }

    /// The gateway reports payment `payment` of `amount` on `session`, as event `event`.
    async fn report_payment(
        &self,
        event: &str,
        session: &str,
        payment: &str,
        amount: Decimal,
    ) -> anyhow::Result<Value> {
        let body = self.event(
            "payment.succeeded",
            session,
            payment,
            json!({"amount": amount.to_string()}),
        );
        self.api.webhook(event, &body).await?;
        Ok(body)
    }

    fn set_fate(&self, number: i64, fate: Fate) -> anyhow::Result<()> {
        self.with_model(|m| {
            if let Some(o) = m.orders.get_mut(&number) {
                o.fate = fate;
            }
        })
    }

    /// Checks out `lines` (product, quantity) for `buyer`, sometimes twice with the same key;
    /// each order's amounts are compared with the model's and written in it.
    async fn checkout(
        &self,
        rng: &mut StdRng,
        key: &str,
        buyer: &str,
        lines: &[(Product, u32)],
        subscription: bool,
    ) -> anyhow::Result<Vec<Placed>> {
        let coupon = if subscription {
            None
        } else {
            match rng.random_range(0..10) {
                0..=1 => Some((PERCENT_COUPON, Coupon::PercentOff(Decimal::from(15)))),
                2 => Some((AMOUNT_COUPON, Coupon::AmountOff(Decimal::new(300, 2)))),
                _ => None,
            }
        };
        let mut body = json!({
            "buyer_id": buyer,
            "gateway": "internal",
            "items": lines.iter().map(|(p, q)| json!({"product_id": p.id, "quantity": q})).collect::<Vec<_>>(),
        });
        if let Some((code, _)) = coupon {
            body["coupon"] = json!(code);
        }
        let repeat = rng.random_bool(0.3);
        let (first, second) = if repeat && rng.random_bool(0.5) {
            // The backend's retry racing its own first request.
            let (a, b) = tokio::join!(
                self.api.post("/checkout", Who::Backend, Some(key), &body),
                self.api.post("/checkout", Who::Backend, Some(key), &body)
            );
            (a?, Some(b?))
        } else {
            let a = self
                .api
                .post("/checkout", Who::Backend, Some(key), &body)
                .await?;
            let b = if repeat {
                Some(
                    self.api
                        .post("/checkout", Who::Backend, Some(key), &body)
                        .await?,
                )
            } else {
                None
            };
            (a, b)
        };
        // One order per seller, in the cart's order (the soak's carts never mix kinds), each
        // priced by the model.
        let mut sellers: Vec<&str> = Vec::new();
        for (p, _) in lines {
            if !sellers.contains(&p.seller.as_str()) {
                sellers.push(&p.seller);
            }
        }
        let priced: Vec<model::Priced> = sellers
            .iter()
            .enumerate()
            .map(|(i, seller)| {
                let mine: Vec<(Decimal, u32)> = lines
                    .iter()
                    .filter(|(p, _)| p.seller == *seller)
                    .map(|(p, q)| (p.price, *q))
                    .collect();
                model::price(&mine, coupon.map(|(_, c)| c), i == 0, self.fee_percent)
            })
            .collect();
        if priced.iter().any(|p| p.total.is_zero()) {
            // A coupon that takes the whole price: no payment link can ask for nothing.
            if first.status != 422 || first.code() != "invalid_items" {
                self.with_model(|m| {
                    m.surprises.push(format!(
                        "checkout {key}: an order of nothing answered {} {}",
                        first.status, first.body
                    ))
                })?;
            }
            return Ok(Vec::new());
        }
        if first.status != 201 {
            bail!("checkout {key}: {} {}", first.status, first.body);
        }
        let orders = first.body["orders"].as_array().cloned().unwrap_or_default();
        let numbers = |v: &Value| -> Vec<i64> {
            v["orders"]
                .as_array()
                .map(|a| a.iter().filter_map(|o| o["number"].as_i64()).collect())
                .unwrap_or_default()
        };
        if let Some(second) = &second {
            let same = second.status == 201 && numbers(&second.body) == numbers(&first.body);
            self.with_model(|m| {
                m.repeats += 1;
                if !same {
                    m.repeats_differing.push(format!(
                        "{key}: {} {} then {} {}",
                        first.status, first.body, second.status, second.body
                    ));
                }
            })?;
        }
        if orders.len() != sellers.len() {
            bail!(
                "checkout {key}: {} orders for {} sellers: {}",
                orders.len(),
                sellers.len(),
                first.body
            );
        }
        let mut placed = Vec::new();
        for ((o, seller), priced) in orders.iter().zip(&sellers).zip(priced) {
            let number = o["number"].as_i64().context("an order without a number")?;
            let answered = (
                decimal(&o["total"]),
                decimal(&o["platform_fee"]),
                decimal(&o["seller_net"]),
            );
            if answered != (priced.total, priced.fee, priced.net) || o["seller_id"] != **seller {
                self.with_model(|m| m.surprises.push(format!("order {number}: answered total/fee/net {answered:?} for seller {}, the rules make {:?} for {seller}", o["seller_id"], (priced.total, priced.fee, priced.net))))?;
            }
            let expires_at: DateTime<Utc> = o["expires_at"]
                .as_str()
                .and_then(|s| s.parse().ok())
                .context("an order without expires_at")?;
            self.with_model(|m| {
                m.orders.insert(
                    number,
                    Order {
                        number,
                        seller: seller.to_string(),
                        buyer: buyer.to_owned(),
                        priced,
                        fate: Fate::Unpaid,
                        with_coins: false,
                        refunds: Vec::new(),
                        disputes: Vec::new(),
                        given_back: Vec::new(),
                    },
                );
            })?;
            placed.push(Placed {
                number,
                url: o["payment"]["url"].as_str().unwrap_or_default().to_owned(),
                expires_at,
            });
        }
        Ok(placed)
    }

    /// A cart of one-off products of one seller, or of two (at most `max_sellers`), checked out.
    async fn shop(
        &self,
        rng: &mut StdRng,
        key: &str,
        buyer: &str,
        max_sellers: usize,
    ) -> anyhow::Result<Vec<Placed>> {
        let sellers = self.catalogue.one_off.len();
        let first = rng.random_range(0..sellers);
        let count = if max_sellers > 1 && rng.random_bool(0.3) {
            2
        } else {
            1
        };
        let mut lines: Vec<(Product, u32)> = Vec::new();
        for k in 0..count {
            let products = &self.catalogue.one_off[(first + k) % sellers];
            for _ in 0..rng.random_range(1..=2) {
                let p = products[rng.random_range(0..products.len())].clone();
                if !lines.iter().any(|(q, _)| q.id == p.id) {
                    lines.push((p, rng.random_range(1..=3)));
                }
            }
        }
        self.checkout(rng, key, buyer, &lines, false).await
    }

    /// The buyer pays `o` on the page; the model learns whether it was surely in time.
    async fn pay(&self, o: &Placed) -> anyhow::Result<bool> {
        let fate = self.fate_of_payment_now(o.expires_at);
        match self.api.pay_page(&o.url, "succeeded").await? {
            200 => {
                self.set_fate(o.number, fate)?;
                Ok(true)
            }
            // Not payable any more: only possible this late if the fleet was slow to answer.
            _ => {
                self.set_fate(o.number, Fate::InDoubt)?;
                Ok(false)
            }
        }
    }

    /// Waits until `number` is paid; false (and a finding) if it is not within `within`.
    async fn until_paid(&self, number: i64, within: Duration) -> anyhow::Result<bool> {
        let status = self.api.until_decided(number, within).await?;
        if status != "paid" {
            let fate = self.with_model(|m| m.orders.get(&number).map(|o| o.fate.clone()))?;
            if fate == Some(Fate::Paid) {
                self.note(format!(
                    "order {number} was paid in time but is {status} after {} s",
                    within.as_secs()
                ));
            }
            return Ok(false);
        }
        Ok(true)
    }

    /// The internal gateway's payment id of the order's paid session (the gateway's own record).
    /// The soak's own read rides out the faults it injects (a terminated connection, the
    /// restart): they are the fleet's to survive, not a finding about the journey.
    async fn payment_of(&self, number: i64) -> anyhow::Result<(String, String)> {
        let deadline = Instant::now() + Duration::from_secs(60);
        let row: Option<(String, Option<String>)> = loop {
            let read = sqlx::query_as(
                "SELECT session_id, payment_id FROM internal_payments WHERE order_number = $1 AND status = 'succeeded' ORDER BY attempt DESC LIMIT 1",
            )
            .bind(number)
            .fetch_optional(&self.pool)
            .await;
            match read {
                Err(e)
                    if (payfleet::db::is_connection_lost(&e)
                        || matches!(e, sqlx::Error::PoolTimedOut))
                        && Instant::now() < deadline =>
                {
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
                other => break other?,
            }
        };
        match row {
            Some((session, Some(payment))) => Ok((session, payment)),
            _ => bail!("order {number} has no succeeded payment at the internal gateway"),
        }
    }

    fn event(&self, kind: &str, session: &str, payment: &str, extra: Value) -> Value {
        let mut data = json!({"session_id": session, "payment_id": payment, "currency": "BRL"});
        if let (Some(d), Some(e)) = (data.as_object_mut(), extra.as_object()) {
            d.extend(e.clone());
        }
        json!({"type": kind, "data": data})
    }
}

/// One buyer's journey (`n`), drawn from the seed.
pub async fn journey(shared: Arc<Shared>, n: usize) {
    let mut rng = StdRng::seed_from_u64(shared.seed.wrapping_mul(1_000_003).wrapping_add(n as u64));
    let roll = rng.random_range(0..100);
    let name = match roll {
        0..=11 => "pay",
        12..=14 => "wrong amount",
        15..=21 => "pay by webhook",
        22..=25 => "late webhook",
        26..=29 => "second payment",
        30..=41 => "pay, refunds",
        42..=49 => "gateway refund before payment",
        50..=59 => "dispute",
        60..=67 => "fail, reopen, pay",
        68..=75 => "never paid",
        76..=81 => "paid at expiry",
        82..=91 => "coins",
        _ => "subscription",
    };
    if let Ok(mut j) = shared.journeys.lock() {
        *j.entry(name).or_default() += 1;
    }
    if let Err(e) = run_journey(&shared, &mut rng, n, name).await {
        shared.note(format!("journey {n} ({name}): {e:#}"));
    }
}

async fn run_journey(s: &Shared, rng: &mut StdRng, n: usize, name: &str) -> anyhow::Result<()> {
    let buyer = format!("buyer-{}", n % 40);
    let key = format!("soak-{}-{n}", s.seed);
    match name {
        "pay" => {
            for o in s.shop(rng, &key, &buyer, 2).await? {
                s.pay(&o).await?;
            }
        }
        "pay, refunds" => {
            let Some(o) = s.one(rng, &key, &buyer).await? else {
                return Ok(());
            };
            if s.pay(&o).await? && s.until_paid(o.number, Duration::from_secs(90)).await? {
                refund_by_operator(s, rng, o.number, &key).await?;
                // A chargeback after the refund, for what is left, lost.
                let (total, refunded) = s.with_model(|m| {
                    let x = &m.orders[&o.number];
                    (x.priced.total, x.refunds.iter().sum::<Decimal>())
                })?;
                if refunded < total && rng.random_bool(0.3) {
                    let (session, payment) = s.payment_of(o.number).await?;
                    let body = s.event("dispute.lost", &session, &payment, json!({"dispute_id": format!("soak_dp_{n}"), "amount": (total - refunded).to_string()}));
                    s.api
                        .webhook(&format!("soak_ev_dp_{n}_after_refund"), &body)
                        .await?;
                    s.order_mut(o.number, |x| {
                        x.disputes.push((total - refunded, DisputeEnd::Lost))
                    })?;
                }
            }
        }
        "pay by webhook" => {
            // The gateway's own events, as a client integrating by webhook sends them: at once
            // twice (a concurrent duplicate), sometimes again under a new id.
            let Some(o) = s.one(rng, &key, &buyer).await? else {
                return Ok(());
            };
            let session = order_session(s, o.number).await?;
            let total = s.total(o.number)?;
            let fate = s.fate_of_payment_now(o.expires_at);
            let id = format!("soak_ev_pay_{n}");
            let payment = format!("soak_pay_{n}");
            let body = if rng.random_bool(0.3) {
                let (a, b) = tokio::join!(
                    s.report_payment(&id, &session, &payment, total),
                    s.report_payment(&id, &session, &payment, total)
                );
                b?;
                a?
            } else {
                s.report_payment(&id, &session, &payment, total).await?
            };
            s.set_fate(o.number, fate)?;
            if rng.random_bool(0.2) {
                s.api.webhook(&format!("{id}_again"), &body).await?;
            }
            if rng.random_bool(0.3) && s.until_paid(o.number, Duration::from_secs(90)).await? {
                refund_by_operator(s, rng, o.number, &key).await?;
            }
        }
        "wrong amount" => {
            // The gateway reports a payment of another amount (or currency) than the order's:
            // no order takes it, it is given back whole, and the order still waits (then expires).
            let Some(o) = s.one(rng, &key, &buyer).await? else {
                return Ok(());
            };
            let session = order_session(s, o.number).await?;
            let total = s.total(o.number)?;
            let (amount, currency) = if rng.random_bool(0.5) {
                (total + Decimal::ONE, "BRL")
            } else {
                (total, "USD")
            };
            let mut body = s.event(
                "payment.succeeded",
                &session,
                &format!("soak_pay_{n}"),
                json!({"amount": amount.to_string()}),
            );
            body["data"]["currency"] = json!(currency);
            s.api.webhook(&format!("soak_ev_wrong_{n}"), &body).await?;
            s.order_mut(o.number, |x| x.given_back.push((session.clone(), amount)))?;
        }
        "late webhook" => {
            // Expired by the operator, then the gateway reports its payment: given back whole.
            let Some(o) = s.one(rng, &key, &buyer).await? else {
                return Ok(());
            };
            expire_by_operator(s, o.number).await?;
            let status = s
                .api
                .until_decided(o.number, Duration::from_secs(90))
                .await?;
            if status != "expired" {
                bail!("order {} expired by the operator is {status}", o.number);
            }
            let session = order_session(s, o.number).await?;
            let total = s.total(o.number)?;
            s.report_payment(
                &format!("soak_ev_late_{n}"),
                &session,
                &format!("soak_pay_{n}"),
                total,
            )
            .await?;
            s.order_mut(o.number, |x| x.given_back.push((session.clone(), total)))?;
        }
        "second payment" => {
            // The gateway reports a second payment of a paid session (a buyer who paid twice):
            // it must be given back, the order keeping its one sale.
            let Some(o) = s.one(rng, &key, &buyer).await? else {
                return Ok(());
            };
            if s.pay(&o).await? && s.until_paid(o.number, Duration::from_secs(90)).await? {
                let (session, _) = s.payment_of(o.number).await?;
                let total = s.total(o.number)?;
                s.report_payment(
                    &format!("soak_ev_pay2_{n}"),
                    &session,
                    &format!("soak_pay2_{n}"),
                    total,
                )
                .await?;
            }
        }
        "gateway refund before payment" => {
            let Some(o) = s.one(rng, &key, &buyer).await? else {
                return Ok(());
            };
            let session = order_session(s, o.number).await?;
            s.relay.hold(&session);
            let paid = s.pay(&o).await;
            let sent = async {
                if paid? {
                    let (session, payment) = s.payment_of(o.number).await?;
                    let total = s.total(o.number)?;
                    let amount = model::cents(total * Decimal::new(rng.random_range(5..60), 2));
                    if amount > Decimal::ZERO {
                        let body = s.event("refund.succeeded", &session, &payment, json!({"refund_id": format!("soak_rf_{n}"), "amount": amount.to_string()}));
                        s.api.webhook(&format!("soak_ev_rf_{n}"), &body).await?;
                        s.order_mut(o.number, |x| x.refunds.push(amount))?;
                    }
                }
                anyhow::Ok(())
            }
            .await;
            s.relay.release(&session).await?;
            sent?;
        }
        "dispute" => {
            let Some(o) = s.one(rng, &key, &buyer).await? else {
                return Ok(());
            };
            if s.pay(&o).await? && s.until_paid(o.number, Duration::from_secs(90)).await? {
                dispute(s, rng, o.number, n).await?;
            }
        }
        "fail, reopen, pay" => {
            let Some(o) = s.one(rng, &key, &buyer).await? else {
                return Ok(());
            };
            if s.api.pay_page(&o.url, "failed").await? != 200 {
                return Ok(());
            }
            let status = s
                .api
                .until_decided(o.number, Duration::from_secs(60))
                .await?;
            if status != "payment_failed" {
                bail!("order {}: a failed payment left it {status}", o.number);
            }
            let reopened = s
                .api
                .post(
                    &format!("/orders/{}/payment", o.number),
                    Who::Backend,
                    None,
                    &json!({}),
                )
                .await?;
            if reopened.status != 200 {
                bail!(
                    "reopening order {}: {} {}",
                    o.number,
                    reopened.status,
                    reopened.body
                );
            }
            let again = Placed {
                number: o.number,
                url: reopened.body["payment"]["url"]
                    .as_str()
                    .unwrap_or_default()
                    .to_owned(),
                expires_at: reopened.body["expires_at"]
                    .as_str()
                    .and_then(|t| t.parse().ok())
                    .context("no expires_at")?,
            };
            s.pay(&again).await?;
        }
        "never paid" => {
            let Some(o) = s.shop(rng, &key, &buyer, 2).await?.into_iter().next() else {
                return Ok(());
            };
            if rng.random_bool(0.5) {
                // An operator expires it now rather than at its time.
                expire_by_operator(s, o.number).await?;
            }
        }
        "paid at expiry" => {
            // Paid a moment before its expiry, its event held back until after it: a late
            // payment, given back, or (if reconciliation got there first) a payment in time.
            let Some(o) = s.one(rng, &key, &buyer).await? else {
                return Ok(());
            };
            let session = order_session(s, o.number).await?;
            let until = (o.expires_at - Utc::now() - chrono::Duration::milliseconds(1500))
                .to_std()
                .unwrap_or_default();
            tokio::time::sleep(until).await;
            s.relay.hold(&session);
            let paid = s.api.pay_page(&o.url, "succeeded").await;
            if matches!(paid, Ok(200)) {
                s.set_fate(o.number, Fate::InDoubt)?;
                let amount = s.total(o.number)?;
                s.order_mut(o.number, |x| x.given_back.push((session.clone(), amount)))?;
                let _ = s.api.until_decided(o.number, Duration::from_secs(20)).await;
            }
            s.relay.release(&session).await?;
            paid?;
        }
        "coins" => {
            let grant = Decimal::new(20_000, 2);
            let grant_key = format!("soak-grant-{}-{n}", s.seed);
            for _ in 0..rng.random_range(1..=2) {
                let a = s
                    .api
                    .post(
                        &format!("/admin/wallets/{buyer}/grants"),
                        Who::Operator,
                        Some(&grant_key),
                        &json!({"amount": grant.to_string(), "currency": "BRL"}),
                    )
                    .await?;
                if a.status != 201 {
                    bail!("granting coins to {buyer}: {} {}", a.status, a.body);
                }
            }
            s.with_model(|m| *m.granted.entry(buyer.clone()).or_default() += grant)?;
            let Some(o) = s.one(rng, &key, &buyer).await? else {
                return Ok(());
            };
            s.with_model(|m| m.orders.get_mut(&o.number).map(|x| x.with_coins = true))?;
            let fate = s.fate_of_payment_now(o.expires_at);
            let a = s
                .api
                .post(
                    &format!("/orders/{}/coins", o.number),
                    Who::Backend,
                    None,
                    &json!({}),
                )
                .await?;
            match (a.status, a.code()) {
                (200, _) => s.set_fate(o.number, fate)?,
                // Other journeys of the same buyer spent the wallet first: nothing taken.
                (422, "coins_insufficient") => return Ok(()),
                _ => bail!(
                    "paying order {} with coins: {} {}",
                    o.number,
                    a.status,
                    a.body
                ),
            }
            if rng.random_bool(0.3) && s.until_paid(o.number, Duration::from_secs(90)).await? {
                refund_by_operator(s, rng, o.number, &key).await?;
            }
        }
        _ => {
            let products = &s.catalogue.subscriptions;
            let p = products[rng.random_range(0..products.len())].clone();
            let Some(o) = s
                .checkout(rng, &key, &buyer, &[(p, 1)], true)
                .await?
                .into_iter()
                .next()
            else {
                return Ok(());
            };
            if s.pay(&o).await? && s.until_paid(o.number, Duration::from_secs(90)).await? {
                let order = s.api.order(o.number).await?;
                let id = order["subscription_id"]
                    .as_str()
                    .context("a paid subscription order without subscription_id")?
                    .to_owned();
                if rng.random_bool(0.3) {
                    let a = s
                        .api
                        .post(
                            &format!("/admin/subscriptions/{id}/simulate"),
                            Who::Operator,
                            None,
                            &json!({"renewals": "fail"}),
                        )
                        .await?;
                    if a.status != 200 {
                        bail!(
                            "making subscription {id}'s renewals fail: {} {}",
                            a.status,
                            a.body
                        );
                    }
                }
                if let Ok(mut subs) = s.subscriptions.lock() {
                    subs.push(id);
                }
            }
        }
    }
    Ok(())
}

/// The operator expires order `number` now; an order that expired by itself meanwhile (the
/// fleet was slow under the faults) is answered 409 `order_not_payable`, which is as good.
async fn expire_by_operator(s: &Shared, number: i64) -> anyhow::Result<()> {
    let a = s
        .api
        .post(
            &format!("/admin/orders/{number}/expire"),
            Who::Operator,
            None,
            &json!({}),
        )
        .await?;
    let expired_already = a.status == 409
        && a.code() == "order_not_payable"
        && s.api.order(number).await?["status"] == "expired";
    if a.status != 202 && !expired_already {
        bail!("expiring order {number}: {} {}", a.status, a.body);
    }
    Ok(())
}

/// The order's current payment session.
async fn order_session(s: &Shared, number: i64) -> anyhow::Result<String> {
    let o = s.api.order(number).await?;
    o["payment"]["session_id"]
        .as_str()
        .map(str::to_owned)
        .context("an order without its payment session")
}

/// A partial refund by the operator, sometimes asked twice with its key, sometimes followed by
/// a refund of all that is left.
async fn refund_by_operator(
    s: &Shared,
    rng: &mut StdRng,
    number: i64,
    key: &str,
) -> anyhow::Result<()> {
    let total = s.total(number)?;
    let amount = model::cents(total * Decimal::new(rng.random_range(10..70), 2));
    if amount <= Decimal::ZERO {
        return Ok(());
    }
    let path = format!("/admin/orders/{number}/refunds");
    let body = json!({"amount": amount.to_string(), "reason": "soak"});
    for _ in 0..rng.random_range(1..=2) {
        let a = s
            .api
            .post(&path, Who::Operator, Some(&format!("{key}-rf1")), &body)
            .await?;
        // 202: the gateway has not answered yet; a job asks again until it does.
        if a.status != 201 && a.status != 202 {
            bail!(
                "refunding {amount} of order {number}: {} {}",
                a.status,
                a.body
            );
        }
    }
    s.with_model(|m| m.orders.get_mut(&number).map(|o| o.refunds.push(amount)))?;
    if rng.random_bool(0.4) {
        let a = s
            .api
            .post(
                &path,
                Who::Operator,
                Some(&format!("{key}-rf2")),
                &json!({"reason": "soak, the rest"}),
            )
            .await?;
        if a.status != 201 && a.status != 202 {
            bail!(
                "refunding the rest of order {number}: {} {}",
                a.status,
                a.body
            );
        }
        s.with_model(|m| {
            m.orders
                .get_mut(&number)
                .map(|o| o.refunds.push(total - amount))
        })?;
    }
    Ok(())
}

/// A chargeback of the whole payment, its events in the gateway's order or not.
async fn dispute(s: &Shared, rng: &mut StdRng, number: i64, n: usize) -> anyhow::Result<()> {
    let (session, payment) = s.payment_of(number).await?;
    let total = s.total(number)?;
    let dispute_id = format!("soak_dp_{n}");
    let ev = |kind: &str| {
        s.event(
            kind,
            &session,
            &payment,
            json!({"dispute_id": dispute_id, "amount": total.to_string()}),
        )
    };
    let (steps, end): (Vec<&str>, DisputeEnd) = match rng.random_range(0..4) {
        0 => (vec!["dispute.created", "dispute.won"], DisputeEnd::Won),
        1 => (vec!["dispute.created", "dispute.lost"], DisputeEnd::Lost),
        // The decision overtakes the opening.
        2 => (vec!["dispute.lost", "dispute.created"], DisputeEnd::Lost),
        _ => (vec!["dispute.created"], DisputeEnd::Open),
    };
    for (k, step) in steps.iter().enumerate() {
        s.api
            .webhook(&format!("soak_ev_dp_{n}_{k}"), &ev(step))
            .await?;
    }
    // The gateway sends the last one again under a new id (its retry of a changed event).
    if rng.random_bool(0.3)
        && let Some(last) = steps.last()
    {
        s.api
            .webhook(&format!("soak_ev_dp_{n}_again"), &ev(last))
            .await?;
    }
    s.with_model(|m| {
        m.orders
            .get_mut(&number)
            .map(|o| o.disputes.push((total, end)))
    })?;
    Ok(())
}

//! The seller's money: the ledger's invariants under concurrency, refunds and disputes debited
//! once whatever the order and repetition of their facts, the holding period, payouts once per
//! period, gapless commission invoices, coins that never go negative, the read API; and one
//! proof that drives a few hundred orders end to end and checks every seller to the cent.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use chrono::{Datelike, Utc};
use payfleet::ledger::{self, AccountKind, AccountRef, Posted, Transfer, TransferKind};
use payfleet::ledger::{coins, invoices, payouts, sales};
use payfleet::money::{Currency, Money};
use rust_decimal::{Decimal, RoundingStrategy};
use serde_json::{Value, json};
use sqlx::{Connection, PgPool};

use crate::checkout::{Shop, payment_side, shop};
use crate::helpers::*;

fn d(s: &str) -> Decimal {
    s.parse().unwrap()
}

fn brl() -> Currency {
    "BRL".parse().unwrap()
}

/// Rounded half-even to cents: the ledger's stated rule.
fn cents(x: Decimal) -> Decimal {
    x.round_dp_with_strategy(2, RoundingStrategy::MidpointNearestEven)
}

async fn invariants_hold(pool: &PgPool) {
    let (accounts, currencies) = ledger::check(pool).await.unwrap();
    assert!(
        accounts.is_empty() && currencies.is_empty(),
        "accounts {accounts:?} differ from their entries; currencies {currencies:?} do not sum to zero"
    );
}

impl Shop {
    /// An admin POST with an Idempotency-Key.
    async fn keyed(&self, path: &str, key: &str, body: Value) -> (u16, Value) {
        let resp = self
            .app
            .http
            .post(format!("http://{}{path}", self.app.addr))
            .bearer_auth(ADMIN_TOKEN)
            .header("Idempotency-Key", key)
            .json(&body)
            .send()
            .await
            .unwrap();
        let (status, text) = checked(reqwest::Method::POST, path, resp).await;
        (status, serde_json::from_str(&text).unwrap_or(Value::Null))
    }

    async fn json(&self, path: &str) -> (u16, Value) {
        let (status, body) = self.app.get(path).await;
        (status, serde_json::from_str(&body).unwrap_or(Value::Null))
    }

    async fn seller_with(
        &self,
        name: &str,
        frequency: &str,
        minimum: &str,
        holding: i32,
    ) -> String {
        let s = self
            .admin(
                "/admin/sellers",
                json!({"name": name, "payout_frequency": frequency, "payout_minimum": minimum, "holding_days": holding}),
            )
            .await;
        s["id"].as_str().unwrap().to_owned()
    }

    /// The seller's balance in BRL: (pending, available).
    async fn balance(&self, seller: &str) -> (Decimal, Decimal) {
        let (status, b) = self.json(&format!("/sellers/{seller}/balances")).await;
        assert_eq!(status, 200, "{b}");
        b["balances"]
            .as_array()
            .unwrap()
            .iter()
            .find(|x| x["currency"] == "BRL")
            .map(|x| {
                (
                    d(x["pending"].as_str().unwrap()),
                    d(x["available"].as_str().unwrap()),
                )
            })
            .unwrap_or_default()
    }

    async fn checkout_one(&self, key: &str, buyer: &str, product: &str, quantity: i64) -> Value {
        let body = json!({"buyer_id": buyer, "gateway": "internal", "items": [{"product_id": product, "quantity": quantity}]});
        let (mut status, mut answer) = self.checkout(Some(key), body.clone()).await;
        // A payment side just started may not answer yet: the same request again, as the 503
        // says (and as a client does); the order is kept and gets its link.
        for _ in 0..50 {
            if status != 503 || answer["error"]["code"] != "payment_link_unavailable" {
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
            (status, answer) = self.checkout(Some(key), body.clone()).await;
        }
        assert_eq!(status, 201, "{answer}");
        answer["orders"][0].clone()
    }
}

/// A receiver and the payment side, with the workers stepped by hand.
async fn stepped(pool: &PgPool) -> Shop {
    let shop = Shop {
        app: Arc::new(spawn_app(pool.clone()).await),
    };
    payment_side(pool, &shop.app.config);
    tokio::time::sleep(Duration::from_millis(300)).await;
    shop
}

fn event(kind: &str, session: &str, extra: Value) -> String {
    let mut data =
        json!({"session_id": session, "payment_id": format!("pay_{session}"), "currency": "BRL"});
    for (k, v) in extra.as_object().unwrap() {
        data[k] = v.clone();
    }
    json!({"type": kind, "data": data}).to_string()
}

async fn send(shop: &Shop, id: &str, body: &str) {
    let (status, answer) = shop.app.deliver(&internal(id, body)).await;
    assert_eq!(status, 200, "{answer}");
}

/// The gateway reports `session` paid `amount`, as delivery `id`.
async fn send_paid(shop: &Shop, id: &str, session: &str, amount: &str) {
    send(
        shop,
        id,
        &event("payment.succeeded", session, json!({"amount": amount})),
    )
    .await;
}

/// The gateway reports `session` paid `amount` of `currency`, as delivery `id`.
async fn send_paid_in(shop: &Shop, id: &str, session: &str, amount: &str, currency: &str) {
    send(
        shop,
        id,
        &event(
            "payment.succeeded",
            session,
            json!({"amount": amount, "currency": currency}),
        ),
    )
    .await;
}

/// The gateway reports refund `refund_id` of `amount` on `session`, as delivery `id`.
async fn send_refund(shop: &Shop, id: &str, session: &str, refund_id: &str, amount: &str) {
    send(
        shop,
        id,
        &event(
            "refund.succeeded",
            session,
            json!({"refund_id": refund_id, "amount": amount}),
        ),
    )
    .await;
}

async fn process_all(pool: &PgPool, shop: &Shop) {
    while process_events_with(pool, &shop.app.config).await > 0 {}
}

#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn concurrent_postings_keep_every_balance_equal_to_its_entries(pool: PgPool) {
    let c = brl();
    let accounts = [
        AccountRef::new(AccountKind::GatewayClearing, "internal:s1", c),
        AccountRef::new(AccountKind::SellerPending, "s1", c),
        AccountRef::new(AccountKind::SellerAvailable, "s1", c),
        AccountRef::new(AccountKind::PlatformRevenue, "s1", c),
    ];
    // 16 tasks post 40 transfers each around four accounts; 140 of the 640 reuse a source key
    // another task also posts, which must post once.
    let tasks: Vec<_> = (0..16)
        .map(|t| {
            let (pool, accounts) = (pool.clone(), accounts.clone());
            tokio::spawn(async move {
                let mut posted = Vec::new();
                for i in 0..40 {
                    let n = t * 40 + i;
                    let (from, to) = (&accounts[n % 4], &accounts[(n + 1 + t % 3) % 4]);
                    if from == to {
                        continue;
                    }
                    let amount = Money::new(Decimal::new((n % 997 + 1) as i64, 2), c).unwrap();
                    let transfer = Transfer {
                        source_key: format!("k{}", n % 500),
                        kind: TransferKind::Adjustment,
                        from: from.clone(),
                        to: to.clone(),
                        amount,
                        available_at: None,
                        order_number: None,
                        reference: None,
                    };
                    let mut tx = pool.begin().await.unwrap();
                    let result = ledger::post(&mut tx, &transfer).await.unwrap();
                    tx.commit().await.unwrap();
                    if let Posted::Posted(_) = result {
                        posted.push((from.kind, to.kind, amount.amount()));
                    }
                }
                posted
            })
        })
        .collect();
    let mut expected: HashMap<AccountKind, Decimal> = HashMap::new();
    let mut count = 0;
    for t in tasks {
        for (from, to, amount) in t.await.unwrap() {
            *expected.entry(from).or_default() -= amount;
            *expected.entry(to).or_default() += amount;
            count += 1;
        }
    }
    let transfers: i64 = sqlx::query_scalar("SELECT count(*) FROM ledger_transfers")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(
        transfers, count,
        "one transfer per posting that said it posted"
    );
    // Every one of the 500 keys was asked for (no pair of accounts is one account twice).
    assert_eq!(count, 500, "a source key posts once, and each posts");
    let balances: Vec<(String, Decimal)> =
        sqlx::query_as("SELECT kind, balance FROM ledger_accounts")
            .fetch_all(&pool)
            .await
            .unwrap();
    for (kind, balance) in balances {
        let kind: AccountKind = kind.parse().unwrap();
        assert_eq!(balance, expected[&kind], "{kind}");
    }
    invariants_hold(&pool).await;
    // Every entry starts where the account's previous one ended.
    let broken: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM (
             SELECT balance_before, lag(balance_after) OVER (PARTITION BY account_id ORDER BY id) AS previous
             FROM ledger_entries) e
         WHERE e.balance_before <> COALESCE(e.previous, 0)",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(broken, 0);
    // A posted movement cannot be changed.
    let changed = sqlx::query("UPDATE ledger_transfers SET amount = amount + 1")
        .execute(&pool)
        .await;
    assert!(changed.is_err());
}

/// One paid-for order of 100.00 BRL (fee 10.00, net 90.00) for a seller holding 14 days.
async fn one_sale(pool: &PgPool) -> (Shop, String, i64, String) {
    let shop = stepped(pool).await;
    let seller = shop.seller_with("S", "weekly", "1.00", 14).await;
    let product = shop.product(&seller, "100.00", "BRL").await;
    let order = shop.checkout_one("k1", "buyer", &product, 1).await;
    let session = order["payment"]["session_id"].as_str().unwrap().to_owned();
    (shop, seller, order["number"].as_i64().unwrap(), session)
}

/// [`one_sale`], paid 100.00 and released to the seller's available balance (90.00).
async fn released_sale(pool: &PgPool) -> (Shop, String, i64, String) {
    let (shop, seller, n, session) = one_sale(pool).await;
    send_paid(&shop, "msg_paid", &session, "100.00").await;
    process_all(pool, &shop).await;
    sales::release_matured(pool, Utc::now() + chrono::Duration::days(15))
        .await
        .unwrap();
    (shop, seller, n, session)
}

/// The payout run `days` from now, which makes the seller's one payout: its amount.
async fn paid_out(pool: &PgPool, shop: &Shop, seller: &str, days: i64) -> String {
    let made = payouts::run(
        pool,
        (Utc::now() + chrono::Duration::days(days)).date_naive(),
    )
    .await
    .unwrap();
    assert_eq!(made.len(), 1, "{made:?}");
    let (_, list) = shop.json(&format!("/sellers/{seller}/payouts")).await;
    list["payouts"][0]["amount"].as_str().unwrap().to_owned()
}

#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn a_refund_debits_once_whether_it_comes_first_twice_or_re_emitted(pool: PgPool) {
    let (shop, seller, n, session) = one_sale(&pool).await;
    let refund = event(
        "refund.succeeded",
        &session,
        json!({"refund_id": "rf_1", "amount": "30.00"}),
    );
    // The refund overtakes its payment: it waits, nothing is posted.
    send(&shop, "msg_refund", &refund).await;
    process_all(&pool, &shop).await;
    assert_eq!(shop.balance(&seller).await, (d("0"), d("0")));
    send_paid(&shop, "msg_paid", &session, "100.00").await;
    // The same refund again, and re-emitted under a new id.
    send(&shop, "msg_refund", &refund).await;
    send(&shop, "msg_refund_again", &refund).await;
    process_all(&pool, &shop).await;
    // 30.00 back: the seller bears 30 × 90/100 = 27.00, the fee 3.00.
    assert_eq!(shop.balance(&seller).await, (d("63.00"), d("0")));
    // A second partial refund: 33.33 × 0.9 = 29.997, half-even to 30.00; the fee 3.33.
    send_refund(&shop, "msg_refund_2", &session, "rf_2", "33.33").await;
    process_all(&pool, &shop).await;
    assert_eq!(shop.balance(&seller).await, (d("33.00"), d("0")));
    let revenue: Decimal = sqlx::query_scalar(
        "SELECT balance FROM ledger_accounts WHERE kind = 'platform_revenue' AND owner = $1",
    )
    .bind(&seller)
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(revenue, d("3.67"));
    let o = shop.order(n).await;
    assert_eq!(o["status"], "partially_refunded");
    // The seller's ledger: the sale, two refunds; every entry with its balance before and after
    // and the sale's date of availability.
    let (_, page) = shop.json(&format!("/sellers/{seller}/ledger")).await;
    let lines: Vec<(String, String, String, String)> = page["entries"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| {
            (
                e["kind"].as_str().unwrap().to_owned(),
                e["amount"].as_str().unwrap().to_owned(),
                e["balance_before"].as_str().unwrap().to_owned(),
                e["balance_after"].as_str().unwrap().to_owned(),
            )
        })
        .collect();
    let line = |k: &str, a: &str, b: &str, c: &str| (k.into(), a.into(), b.into(), c.into());
    assert_eq!(
        lines,
        vec![
            line("sale_credit", "90.00", "0.00", "90.00"),
            line("refund_debit", "-27.00", "90.00", "63.00"),
            line("refund_debit", "-30.00", "63.00", "33.00"),
        ]
    );
    let available_at: chrono::DateTime<Utc> =
        serde_json::from_value(page["entries"][0]["available_at"].clone()).unwrap();
    let paid_at: chrono::DateTime<Utc> = serde_json::from_value(o["paid_at"].clone()).unwrap();
    assert_eq!(available_at - paid_at, chrono::Duration::days(14));
    invariants_hold(&pool).await;
}

#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn a_dispute_debits_once_and_is_reversed_once_when_won(pool: PgPool) {
    let (shop, seller, _, session) = one_sale(&pool).await;
    send_paid(&shop, "msg_paid", &session, "100.00").await;
    let opened = event(
        "dispute.created",
        &session,
        json!({"dispute_id": "dp_1", "amount": "100.00"}),
    );
    send(&shop, "msg_dispute", &opened).await;
    send(&shop, "msg_dispute_again", &opened).await;
    process_all(&pool, &shop).await;
    assert_eq!(shop.balance(&seller).await, (d("0.00"), d("0")));
    // The holding period passes while the dispute is open: nothing is left to release.
    sales::release_matured(&pool, Utc::now() + chrono::Duration::days(15))
        .await
        .unwrap();
    assert_eq!(shop.balance(&seller).await, (d("0.00"), d("0.00")));
    let won = event(
        "dispute.won",
        &session,
        json!({"dispute_id": "dp_1", "amount": "100.00"}),
    );
    send(&shop, "msg_won", &won).await;
    send(&shop, "msg_won_again", &won).await;
    process_all(&pool, &shop).await;
    // Won after the holding period: the money is back where the seller's money is now,
    // available (not in pending, which nothing releases any more).
    assert_eq!(shop.balance(&seller).await, (d("0.00"), d("90.00")));
    // A late "created" after the decision changes nothing.
    send(&shop, "msg_dispute_late", &opened).await;
    process_all(&pool, &shop).await;
    assert_eq!(shop.balance(&seller).await, (d("0.00"), d("90.00")));
    let kinds: Vec<String> = sqlx::query_scalar(
        "SELECT kind FROM ledger_transfers WHERE kind LIKE 'dispute%' ORDER BY id",
    )
    .fetch_all(&pool)
    .await
    .unwrap();
    assert_eq!(
        kinds,
        vec![
            "dispute_debit",
            "dispute_fee_debit",
            "dispute_reversal",
            "dispute_fee_reversal"
        ]
    );
    invariants_hold(&pool).await;
}

/// A dispute that ends as a refund ("the charge was refunded") gave the buyer the money
/// through that refund, whose own event may come later, or never. Until it is recorded the
/// dispute keeps the money taken: giving it back first would let a payout pay the seller what the
/// buyer already has. Once the refund is recorded, the seller has borne it once.
#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn a_dispute_ended_as_a_refund_keeps_the_money_taken_until_that_refund_is_recorded(
    pool: PgPool,
) {
    let (shop, seller, _, session) = released_sale(&pool).await;
    assert_eq!(shop.balance(&seller).await, (d("0.00"), d("90.00")));
    let dispute = |kind: &str| {
        event(
            kind,
            &session,
            json!({"dispute_id": "dp_1", "amount": "100.00"}),
        )
    };
    send(&shop, "msg_dispute", &dispute("dispute.created")).await;
    process_all(&pool, &shop).await;
    assert_eq!(shop.balance(&seller).await, (d("0.00"), d("0.00")));
    send(&shop, "msg_ended", &dispute("dispute.refunded")).await;
    process_all(&pool, &shop).await;
    assert_eq!(
        shop.balance(&seller).await,
        (d("0.00"), d("0.00")),
        "nothing given back before the refund is recorded"
    );
    let paid_out = payouts::run(
        &pool,
        (Utc::now() + chrono::Duration::days(40)).date_naive(),
    )
    .await
    .unwrap();
    assert!(
        paid_out.is_empty(),
        "no payout of money the buyer has: {paid_out:?}"
    );
    // The refund's own event: the seller bears it once, not twice.
    send_refund(&shop, "msg_refund", &session, "rf_1", "100.00").await;
    process_all(&pool, &shop).await;
    assert_eq!(shop.balance(&seller).await, (d("0.00"), d("0.00")));
    invariants_hold(&pool).await;
}

/// A partial refund made before a dispute opened gave the buyer other money. The ledger counts
/// every recorded refund as covering a dispute ended as a refund (which came first at the
/// gateway is not ours to know for sure), but the payouts hold back the part only that earlier
/// refund covers until the dispute's own refund is recorded: none of it is paid out meanwhile.
#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn a_partial_refund_before_a_dispute_does_not_pay_out_the_disputes_money(pool: PgPool) {
    let (shop, seller, _, session) = released_sale(&pool).await;
    send_refund(&shop, "msg_refund_0", &session, "rf_0", "30.00").await;
    process_all(&pool, &shop).await;
    assert_eq!(shop.balance(&seller).await, (d("0.00"), d("63.00")));
    let dispute = |kind: &str| {
        event(
            kind,
            &session,
            json!({"dispute_id": "dp_1", "amount": "40.00"}),
        )
    };
    send(&shop, "msg_dp1", &dispute("dispute.created")).await;
    process_all(&pool, &shop).await;
    assert_eq!(shop.balance(&seller).await, (d("0.00"), d("27.00")));
    send(&shop, "msg_dp1_end", &dispute("dispute.refunded")).await;
    process_all(&pool, &shop).await;
    assert_eq!(shop.balance(&seller).await, (d("0.00"), d("54.00")));
    // 30.00 of the dispute is covered only by the refund made before it: held back.
    assert_eq!(paid_out(&pool, &shop, &seller, 40).await, "24.00");
    // A week on, its refund still not recorded: shown to an operator.
    sqlx::query("UPDATE payment_disputes SET updated_at = now() - interval '8 days'")
        .execute(&pool)
        .await
        .unwrap();
    let found = findings_of(&pool, "dispute_refund_unrecorded").await;
    assert_eq!(found.len(), 1, "{found:?}");
    assert!(found[0].1.starts_with("30.0000 BRL"), "{found:?}");
    sqlx::query("UPDATE payment_disputes SET updated_at = now()")
        .execute(&pool)
        .await
        .unwrap();
    // The dispute's own refund: the seller bears it from what was held back, and nothing is
    // held any longer.
    send_refund(&shop, "msg_refund_1", &session, "rf_1", "40.00").await;
    process_all(&pool, &shop).await;
    assert_eq!(shop.balance(&seller).await, (d("0.00"), d("3.00")));
    assert!(
        findings_of(&pool, "dispute_refund_unrecorded")
            .await
            .is_empty()
    );
    assert_eq!(paid_out(&pool, &shop, &seller, 80).await, "3.00");
    invariants_hold(&pool).await;
}

/// The payouts hold back only what the sale could still give back: a dispute ended as a refund
/// of a payment refunded whole holds nothing back (the ledger took all it can); and a dispute
/// first heard of as ended by a refund, after a partial refund smaller than it, holds back what
/// that earlier refund covers (the refund that ended it cannot be among those recorded).
#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn a_dispute_ended_as_a_refund_holds_back_only_what_the_sale_can_still_give_back(
    pool: PgPool,
) {
    let (shop, seller, _, whole) = one_sale(&pool).await;
    let product = shop.product(&seller, "100.00", "BRL").await;
    let other = shop.checkout_one("k2", "buyer", &product, 1).await;
    let partial = other["payment"]["session_id"].as_str().unwrap().to_owned();
    send_paid(&shop, "msg_paid", &whole, "100.00").await;
    send_paid(&shop, "msg_paid_2", &partial, "100.00").await;
    process_all(&pool, &shop).await;
    sales::release_matured(&pool, Utc::now() + chrono::Duration::days(15))
        .await
        .unwrap();
    // Refunded whole, then disputed and the dispute ended as a refund.
    send_refund(&shop, "msg_whole", &whole, "rf_whole", "100.00").await;
    process_all(&pool, &shop).await;
    for kind in ["dispute.created", "dispute.refunded"] {
        let body = event(
            kind,
            &whole,
            json!({"dispute_id": "dp_whole", "amount": "100.00"}),
        );
        send(&shop, &format!("msg_whole_{kind}"), &body).await;
        process_all(&pool, &shop).await;
    }
    // Refunded in part, then a dispute of 40.00 first heard of as ended by a refund.
    send_refund(&shop, "msg_part", &partial, "rf_part", "30.00").await;
    process_all(&pool, &shop).await;
    let body = event(
        "dispute.refunded",
        &partial,
        json!({"dispute_id": "dp_part", "amount": "40.00"}),
    );
    send(&shop, "msg_part_end", &body).await;
    process_all(&pool, &shop).await;
    assert_eq!(shop.balance(&seller).await, (d("0.00"), d("54.00")));
    assert_eq!(paid_out(&pool, &shop, &seller, 40).await, "24.00");
    invariants_hold(&pool).await;
}

/// A dispute first heard of as already ended by a refund (its opening lost) counts a recorded
/// refund as its own only if one is of its amount: an earlier refund of 50.00 is not a dispute's
/// of 40.00, and the dispute's money is held back from payouts until its own refund comes.
#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn a_dispute_first_heard_of_as_ended_is_not_covered_by_a_larger_earlier_refund(pool: PgPool) {
    let (shop, seller, _, session) = released_sale(&pool).await;
    send_refund(&shop, "msg_refund_0", &session, "rf_0", "50.00").await;
    process_all(&pool, &shop).await;
    let ended = event(
        "dispute.refunded",
        &session,
        json!({"dispute_id": "dp_1", "amount": "40.00"}),
    );
    send(&shop, "msg_ended", &ended).await;
    process_all(&pool, &shop).await;
    assert_eq!(shop.balance(&seller).await, (d("0.00"), d("45.00")));
    assert_eq!(paid_out(&pool, &shop, &seller, 40).await, "5.00");
}

/// A dispute opened before a refund ending as a refund after another one opened after it does
/// not release the later one's hold: only refunds recorded after the latest of them count as
/// theirs.
#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn a_later_dispute_ending_does_not_release_an_earlier_holds(pool: PgPool) {
    let (shop, seller, _, session) = released_sale(&pool).await;
    let dispute = |kind: &str, id: &str, amount: &str| {
        event(kind, &session, json!({"dispute_id": id, "amount": amount}))
    };
    send(
        &shop,
        "a_open",
        &dispute("dispute.created", "dp_a", "20.00"),
    )
    .await;
    process_all(&pool, &shop).await;
    send_refund(&shop, "msg_refund", &session, "rf_1", "30.00").await;
    process_all(&pool, &shop).await;
    send(
        &shop,
        "b_open",
        &dispute("dispute.created", "dp_b", "40.00"),
    )
    .await;
    process_all(&pool, &shop).await;
    send(
        &shop,
        "b_end",
        &dispute("dispute.refunded", "dp_b", "40.00"),
    )
    .await;
    process_all(&pool, &shop).await;
    send(
        &shop,
        "a_end",
        &dispute("dispute.refunded", "dp_a", "20.00"),
    )
    .await;
    process_all(&pool, &shop).await;
    assert_eq!(shop.balance(&seller).await, (d("0.00"), d("36.00")));
    assert_eq!(paid_out(&pool, &shop, &seller, 40).await, "6.00");
}

/// Of two disputes ended as refunds, one recorded refund covers one of them, not both: the
/// other stays taken from the seller until its own refund is recorded.
#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn one_refund_covers_one_dispute_ended_as_a_refund(pool: PgPool) {
    let (shop, seller, _, session) = released_sale(&pool).await;
    for id in ["dp_1", "dp_2"] {
        for kind in ["dispute.created", "dispute.refunded"] {
            let body = event(kind, &session, json!({"dispute_id": id, "amount": "30.00"}));
            send(&shop, &format!("msg_{id}_{kind}"), &body).await;
            process_all(&pool, &shop).await;
        }
    }
    assert_eq!(shop.balance(&seller).await, (d("0.00"), d("36.00")));
    send_refund(&shop, "msg_refund_1", &session, "rf_1", "30.00").await;
    process_all(&pool, &shop).await;
    assert_eq!(
        shop.balance(&seller).await,
        (d("0.00"), d("36.00")),
        "one refund covers one dispute"
    );
    send_refund(&shop, "msg_refund_2", &session, "rf_2", "30.00").await;
    process_all(&pool, &shop).await;
    assert_eq!(shop.balance(&seller).await, (d("0.00"), d("36.00")));
    invariants_hold(&pool).await;
}

/// A payout holds back the seller's refunds under way, read under its lock of the seller's
/// available account. A refund request committed between that read and the payout's commit
/// would not be held back, and its refund would take from money paid out: a request waits for a
/// payout being made, so it is either seen by the payout or written after it.
#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn a_refund_request_waits_for_a_payout_being_made_of_its_sellers_money(pool: PgPool) {
    let (shop, seller, n, _) = released_sale(&pool).await;
    assert_eq!(shop.balance(&seller).await, (d("0.00"), d("90.00")));
    // A payout being made: it holds the seller's available account until it commits.
    let mut payout = pool.begin().await.unwrap();
    sqlx::query(
        "SELECT 1 FROM ledger_accounts WHERE kind = 'seller_available' AND owner = $1 FOR UPDATE",
    )
    .bind(&seller)
    .execute(&mut *payout)
    .await
    .unwrap();
    let request = tokio::spawn({
        let pool = pool.clone();
        async move {
            let new = payfleet::payments::order_refunds::NewRefund {
                amount: Some("10.00".into()),
                reason: String::new(),
            };
            payfleet::payments::order_refunds::request(&pool, n, "rf-beside-payout", &new).await
        }
    });
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(!request.is_finished(), "the request waits for the payout");
    payout.commit().await.unwrap();
    let (view, written) = tokio::time::timeout(Duration::from_secs(10), request)
        .await
        .expect("written once the payout committed")
        .unwrap()
        .unwrap();
    assert!(written);
    assert_eq!(view.state.as_str(), "requested");
}

/// A refund request held by its payment's open dispute (the gateway is not asked while it is
/// open) is still held back from the seller's payouts: whichever way the dispute ends, the
/// refund may still take the seller's share of it. Here the dispute is of 20.00 of a 100.00
/// payment and the refund of 80.00: lost, the dispute keeps its 18.00 and the refund (80.00 of
/// the 80.00 left) takes 72.00 more; won, the dispute gives its 18.00 back and the refund takes
/// 72.00. Paid out meanwhile, that money would have left the seller in debt.
#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn a_refund_held_by_an_open_dispute_is_still_held_back_from_payouts(pool: PgPool) {
    let (shop, seller, n, session) = one_sale(&pool).await;
    let product = shop.product(&seller, "100.00", "BRL").await;
    let other = shop.checkout_one("k2", "buyer", &product, 1).await;
    let other_session = other["payment"]["session_id"].as_str().unwrap().to_owned();
    send_paid(&shop, "msg_paid", &session, "100.00").await;
    send_paid(&shop, "msg_paid_2", &other_session, "100.00").await;
    process_all(&pool, &shop).await;
    sales::release_matured(&pool, Utc::now() + chrono::Duration::days(15))
        .await
        .unwrap();
    assert_eq!(shop.balance(&seller).await, (d("0.00"), d("180.00")));
    // A refund of the first sale asked for (its job not run yet), then its payment disputed.
    let new = payfleet::payments::order_refunds::NewRefund {
        amount: Some("80.00".into()),
        reason: String::new(),
    };
    payfleet::payments::order_refunds::request(&pool, n, "rf-held", &new)
        .await
        .unwrap();
    send(
        &shop,
        "msg_dispute",
        &event(
            "dispute.created",
            &session,
            json!({"dispute_id": "dp_1", "amount": "20.00"}),
        ),
    )
    .await;
    process_all(&pool, &shop).await;
    assert_eq!(shop.balance(&seller).await, (d("0.00"), d("162.00")));
    assert_eq!(paid_out(&pool, &shop, &seller, 40).await, "82.00");
}

/// A refund request whose gateway answer never came, ended unanswered past the gateway's
/// idempotency window, may still have been made: it is held back from the seller's payouts as a
/// refund under way is, so the refund's late event takes its share from money not paid out.
#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn a_refund_ended_unanswered_is_still_held_back_from_payouts(pool: PgPool) {
    let (shop, seller, n, session) = released_sale(&pool).await;
    assert_eq!(shop.balance(&seller).await, (d("0.00"), d("90.00")));
    let new = payfleet::payments::order_refunds::NewRefund {
        amount: Some("50.00".into()),
        reason: String::new(),
    };
    let (request, _) = payfleet::payments::order_refunds::request(&pool, n, "rf-lost", &new)
        .await
        .unwrap();
    // Asked 21 hours ago, its answer lost: asked now, it ends unanswered, the gateway not asked.
    sqlx::query(
        "UPDATE refund_requests SET first_asked_at = now() - interval '21 hours' WHERE id = $1",
    )
    .bind(request.id)
    .execute(&pool)
    .await
    .unwrap();
    let (gateways, _) = payfleet::startup::gateways(&shop.app.config, &pool).unwrap();
    payfleet::payments::order_refunds::carry_out(&pool, &gateways, request.id)
        .await
        .unwrap();
    let state: String = sqlx::query_scalar("SELECT state FROM refund_requests WHERE id = $1")
        .bind(request.id)
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(state, "failed");
    assert_eq!(paid_out(&pool, &shop, &seller, 40).await, "40.00");
    // The gateway had made it: its event takes the seller's share from what was held back.
    send_refund(&shop, "msg_refund", &session, "rf_late", "50.00").await;
    process_all(&pool, &shop).await;
    assert_eq!(shop.balance(&seller).await, (d("0.00"), d("5.00")));
    // Recorded, it is no longer held: the next period pays what is left.
    assert_eq!(paid_out(&pool, &shop, &seller, 80).await, "5.00");
    invariants_hold(&pool).await;
}

#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn the_holding_period_releases_once_however_many_run_it_and_later_refunds_take_from_available(
    pool: PgPool,
) {
    let (shop, seller, _, session) = one_sale(&pool).await;
    send_paid(&shop, "msg_paid", &session, "100.00").await;
    send_refund(&shop, "msg_refund", &session, "rf_1", "10.00").await;
    process_all(&pool, &shop).await;
    assert_eq!(shop.balance(&seller).await, (d("81.00"), d("0")));
    // Not yet matured: nothing moves.
    assert_eq!(
        sales::release_matured(&pool, Utc::now() + chrono::Duration::days(13))
            .await
            .unwrap(),
        0
    );
    let later = Utc::now() + chrono::Duration::days(15);
    let runs: Vec<_> = (0..4)
        .map(|_| {
            let pool = pool.clone();
            tokio::spawn(async move { sales::release_matured(&pool, later).await.unwrap() })
        })
        .collect();
    let mut released = 0;
    for r in runs {
        released += r.await.unwrap();
    }
    assert_eq!(released, 1, "one sale, released once");
    assert_eq!(shop.balance(&seller).await, (d("0.00"), d("81.00")));
    // A refund after the holding period takes from available.
    send_refund(&shop, "msg_refund_2", &session, "rf_2", "20.00").await;
    process_all(&pool, &shop).await;
    assert_eq!(shop.balance(&seller).await, (d("0.00"), d("63.00")));
    invariants_hold(&pool).await;
}

/// `n` paid orders of 100.00 BRL (fee 10.00, net 90.00) of `seller`, processed; their sessions.
async fn paid_sales(pool: &PgPool, shop: &Shop, seller: &str, n: usize) -> Vec<String> {
    let product = shop.product(seller, "100.00", "BRL").await;
    let mut sessions = Vec::new();
    for i in 0..n {
        let order = shop
            .checkout_one(&format!("{seller}-{i}"), "buyer", &product, 1)
            .await;
        let session = order["payment"]["session_id"].as_str().unwrap().to_owned();
        send_paid(shop, &format!("msg_{seller}_{i}"), &session, "100.00").await;
        sessions.push(session);
    }
    process_all(pool, shop).await;
    sessions
}

#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn matured_sales_are_released_many_to_a_transaction_one_seller_at_a_time(pool: PgPool) {
    let shop = stepped(&pool).await;
    let a = shop.seller_with("A", "weekly", "1.00", 14).await;
    let b = shop.seller_with("B", "weekly", "1.00", 14).await;
    let sessions = paid_sales(&pool, &shop, &a, 12).await;
    paid_sales(&pool, &shop, &b, 5).await;
    // One of A's sales partly refunded while pending: 30.00, the seller bearing 27.00.
    send_refund(&shop, "msg_refund", &sessions[0], "rf_1", "30.00").await;
    process_all(&pool, &shop).await;
    assert_eq!(shop.balance(&a).await, (d("1053.00"), d("0")));
    assert_eq!(shop.balance(&b).await, (d("450.00"), d("0")));
    let later = Utc::now() + chrono::Duration::days(15);
    // Runs at once: every sale released once.
    let runs: Vec<_> = (0..3)
        .map(|_| {
            let pool = pool.clone();
            tokio::spawn(async move { sales::release_matured(&pool, later).await.unwrap() })
        })
        .collect();
    let mut released = 0;
    for r in runs {
        released += r.await.unwrap();
    }
    assert_eq!(released, 17, "each sale released once");
    assert_eq!(shop.balance(&a).await, (d("0.00"), d("1053.00")));
    assert_eq!(shop.balance(&b).await, (d("0.00"), d("450.00")));
    // A transaction per seller (rows of one transaction share xmin), never one per sale, and
    // never two sellers' accounts in one.
    let (releases, transactions, widest): (i64, i64, i64) = sqlx::query_as(
        "SELECT sum(n)::int8, count(*), max(sellers) FROM (
             SELECT count(*) AS n, count(DISTINCT a.owner) AS sellers
             FROM ledger_transfers t JOIN ledger_accounts a ON a.id = t.to_account
             WHERE t.kind = 'release' GROUP BY t.xmin::text) x",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(releases, 17);
    // At most a transaction per run and seller (a run that starts while another holds part
    // of a seller's sales takes the rest), where one per sale would be 17.
    assert!(
        (2..=6).contains(&transactions),
        "{transactions} transactions for two sellers' releases by three runs"
    );
    assert_eq!(widest, 1, "one seller per release transaction");
    assert_eq!(sales::release_matured(&pool, later).await.unwrap(), 0);
    invariants_hold(&pool).await;
}

#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn payouts_are_made_once_per_period_and_a_failure_credits_back_once(pool: PgPool) {
    let (shop, seller, _, _) = released_sale(&pool).await;
    // Two workers run the same period's payouts at once: one payout.
    let monday = chrono::NaiveDate::from_isoywd_opt(2027, 10, chrono::Weekday::Mon).unwrap();
    let runs: Vec<_> = (0..3)
        .map(|i| {
            let pool = pool.clone();
            let day = monday + chrono::Duration::days(i);
            tokio::spawn(async move { payouts::run(&pool, day).await.unwrap() })
        })
        .collect();
    let mut made = Vec::new();
    for r in runs {
        made.extend(r.await.unwrap());
    }
    assert_eq!(made.len(), 1, "{made:?}");
    assert_eq!(shop.balance(&seller).await, (d("0.00"), d("0.00")));
    let (_, list) = shop.json(&format!("/sellers/{seller}/payouts")).await;
    assert_eq!(list["payouts"][0]["amount"], "90.00");
    assert_eq!(list["payouts"][0]["state"], "pending");
    assert_eq!(list["payouts"][0]["period_start"], monday.to_string());

    // The bank refuses it: the money is back, once, however often that is said.
    let id = made[0];
    let failed = |reason: &'static str| {
        let shop = &shop;
        async move {
            shop.post(
                &format!("/admin/payouts/{id}/failed"),
                Some(ADMIN_TOKEN),
                json!({ "reason": reason }),
            )
            .await
        }
    };
    let (status, p) = failed("account closed").await;
    assert_eq!((status, p["state"].as_str()), (200, Some("failed")), "{p}");
    let (status, _) = failed("account closed").await;
    assert_eq!(status, 200);
    assert_eq!(shop.balance(&seller).await, (d("0.00"), d("90.00")));
    let (status, p) = shop
        .post(
            &format!("/admin/payouts/{id}/paid"),
            Some(ADMIN_TOKEN),
            json!({}),
        )
        .await;
    assert_eq!(
        (status, p["error"]["code"].as_str()),
        (409, Some("payout_decided"))
    );
    // The same week gets no second payout; the next week pays the balance again, and the bank
    // confirms it.
    assert!(
        payouts::run(&pool, monday + chrono::Duration::days(6))
            .await
            .unwrap()
            .is_empty()
    );
    let next = payouts::run(&pool, monday + chrono::Duration::days(7))
        .await
        .unwrap();
    assert_eq!(next.len(), 1);
    // A payout the bank has not answered for over a week is a finding, until it is answered.
    let undecided = async || -> Vec<String> {
        payfleet::consistency::check(&pool, std::time::Duration::from_secs(900))
            .await
            .unwrap()
            .into_iter()
            .filter(|v| v.check == "payout_undecided")
            .map(|v| v.subject)
            .collect()
    };
    assert_eq!(
        undecided().await,
        Vec::<String>::new(),
        "a day-old payout waits"
    );
    sqlx::query("UPDATE payouts SET created_at = now() - interval '8 days' WHERE id = $1")
        .bind(next[0])
        .execute(&pool)
        .await
        .unwrap();
    assert_eq!(undecided().await, vec![format!("payout {}", next[0])]);
    let (status, p) = shop
        .post(
            &format!("/admin/payouts/{}/paid", next[0]),
            Some(ADMIN_TOKEN),
            json!({}),
        )
        .await;
    assert_eq!((status, p["state"].as_str()), (200, Some("paid")));
    assert_eq!(undecided().await, Vec::<String>::new(), "answered");
    assert_eq!(shop.balance(&seller).await, (d("0.00"), d("0.00")));
    let (status, _) = shop
        .post("/admin/payouts/abc/paid", Some(ADMIN_TOKEN), json!({}))
        .await;
    assert_eq!(status, 404);
    invariants_hold(&pool).await;
}

/// A refund an operator asked for, not yet answered or recorded, will take the seller's share
/// back from what is available: a payout run meanwhile pays only what it cannot take, and the
/// refund, once recorded, leaves the seller owing nothing.
#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn a_payout_holds_back_what_refunds_under_way_may_take(pool: PgPool) {
    let (shop, seller, number, session) = one_sale(&pool).await;
    send_paid(&shop, "msg_paid", &session, "100.00").await;
    process_all(&pool, &shop).await;
    sales::release_matured(&pool, Utc::now() + chrono::Duration::days(15))
        .await
        .unwrap();
    assert_eq!(shop.balance(&seller).await, (d("0.00"), d("90.00")));
    // Asked, and taken by the gateway, which will say by its event when it is done (as
    // Stripe's pending refunds are).
    sqlx::query(
        "INSERT INTO refund_requests (idempotency_key, order_number, gateway, session_id, payment_id, amount, currency, state, refund_id)
         VALUES ('r1', $1, 'internal', $2, 'pay_' || $2, 30, 'BRL', 'accepted', 'rf_1')",
    )
    .bind(number)
    .bind(&session)
    .execute(&pool)
    .await
    .unwrap();
    // A refund under way of a sale paid to the seller directly (Stripe Connect) takes from
    // the seller's connected money, never from what the platform pays out: not held back.
    let other = shop
        .checkout_one(
            "k-direct",
            "b",
            &shop.product(&seller, "80.00", "BRL").await,
            1,
        )
        .await;
    sqlx::query(
        "INSERT INTO payment_orders (gateway, session_id, payment_id, status, amount, currency, succeeded_at)
         VALUES ('stripe', 'cs_direct', 'pi_direct', 'succeeded', 80, 'BRL', now())",
    )
    .execute(&pool)
    .await
    .unwrap();
    sqlx::query(
        "INSERT INTO refund_requests (idempotency_key, order_number, gateway, session_id, payment_id, amount, currency, state, refund_id)
         VALUES ('r2', $1, 'stripe', 'cs_direct', 'pi_direct', 50, 'BRL', 'accepted', 're_direct')",
    )
    .bind(other["number"].as_i64().unwrap())
    .execute(&pool)
    .await
    .unwrap();
    let monday = chrono::NaiveDate::from_isoywd_opt(2027, 10, chrono::Weekday::Mon).unwrap();
    let made = payouts::run(&pool, monday).await.unwrap();
    assert_eq!(made.len(), 1);
    let (_, list) = shop.json(&format!("/sellers/{seller}/payouts")).await;
    assert_eq!(list["payouts"][0]["amount"], "60.00", "{list}");
    assert_eq!(shop.balance(&seller).await, (d("0.00"), d("30.00")));
    // The refund done at the gateway: the seller's 27.00 share comes out of what was held.
    send_refund(&shop, "msg_refund", &session, "rf_1", "30.00").await;
    process_all(&pool, &shop).await;
    assert_eq!(shop.balance(&seller).await, (d("0.00"), d("3.00")));
    invariants_hold(&pool).await;
}

/// A seller whose payout fails (here a balance of 1.2 trillion, more than one payout carries)
/// holds up no seller after it: before, the run stopped at the first error, and every seller
/// after it in the run's order went unpaid that day and every day after. The run pays the others,
/// then fails naming the seller, so it is seen and retried; retried, it pays no one twice.
#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn one_sellers_failing_payout_holds_up_no_other(pool: PgPool) {
    let shop = stepped(&pool).await;
    let mut sellers = [
        shop.seller_with("One", "daily", "0", 0).await,
        shop.seller_with("Two", "daily", "0", 0).await,
    ];
    // A run goes by seller id: the first one's payout is the one that fails.
    sellers.sort();
    let (huge, other) = (sellers[0].clone(), sellers[1].clone());
    let product = shop.product(&other, "50.00", "BRL").await;
    let order = shop.checkout_one("k", "b", &product, 1).await;
    let session = order["payment"]["session_id"].as_str().unwrap();
    send_paid(&shop, "m1", session, "50.00").await;
    process_all(&pool, &shop).await;
    sales::release_matured(&pool, Utc::now()).await.unwrap();
    let c = brl();
    let clearing = AccountRef::new(AccountKind::GatewayClearing, "internal:shared", c);
    let available = AccountRef::new(AccountKind::SellerAvailable, huge.as_str(), c);
    for n in 0..2 {
        let mut tx = pool.begin().await.unwrap();
        ledger::post(
            &mut tx,
            &Transfer {
                source_key: format!("huge-{n}"),
                kind: TransferKind::Adjustment,
                from: clearing.clone(),
                to: available.clone(),
                amount: Money::new(d("600000000000.00"), c).unwrap(),
                available_at: None,
                order_number: None,
                reference: None,
            },
        )
        .await
        .unwrap();
        tx.commit().await.unwrap();
    }
    let today = Utc::now().date_naive();
    for run in 0..2 {
        let failed = payouts::run(&pool, today).await.unwrap_err();
        let payouts::PayoutError::Sellers { made, failed } = &failed else {
            panic!("{failed}");
        };
        assert_eq!(failed.len(), 1, "{failed:?}");
        assert_eq!(failed[0].seller, huge);
        assert_eq!(made.len(), 1 - run, "paid once, not again: {made:?}");
        let (_, list) = shop.json(&format!("/sellers/{other}/payouts")).await;
        assert_eq!(list["payouts"].as_array().unwrap().len(), 1, "{list}");
        assert_eq!(list["payouts"][0]["amount"], "45.00", "{list}");
    }
    assert_eq!(shop.balance(&other).await, (d("0.00"), d("0.00")));
}

#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn a_seller_below_the_minimum_is_not_paid(pool: PgPool) {
    let shop = stepped(&pool).await;
    let seller = shop.seller_with("Small", "daily", "100.00", 0).await;
    let product = shop.product(&seller, "50.00", "BRL").await;
    let order = shop.checkout_one("k", "b", &product, 1).await;
    let session = order["payment"]["session_id"].as_str().unwrap();
    send_paid(&shop, "m1", session, "50.00").await;
    process_all(&pool, &shop).await;
    sales::release_matured(&pool, Utc::now()).await.unwrap();
    assert_eq!(shop.balance(&seller).await, (d("0.00"), d("45.00")));
    assert!(
        payouts::run(&pool, Utc::now().date_naive())
            .await
            .unwrap()
            .is_empty()
    );
}

/// 45.00 BRL and 45.00 JPY are not the same sum: a seller's minimum is per currency.
#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn the_payout_minimum_is_per_currency(pool: PgPool) {
    let shop = stepped(&pool).await;
    let seller = shop
        .admin(
            "/admin/sellers",
            json!({"name": "Two currencies", "payout_frequency": "daily", "payout_minimum": "100.00",
                   "holding_days": 0, "payout_minimums": {"JPY": "40"}}),
        )
        .await;
    assert_eq!(seller["payout_minimums"], json!({"JPY": "40"}), "{seller}");
    let seller = seller["id"].as_str().unwrap().to_owned();
    for (i, currency) in ["BRL", "JPY"].iter().enumerate() {
        let price = if *currency == "JPY" { "50" } else { "50.00" };
        let product = shop.product(&seller, price, currency).await;
        let order = shop.checkout_one(&format!("k{i}"), "b", &product, 1).await;
        let session = order["payment"]["session_id"].as_str().unwrap();
        send_paid_in(&shop, &format!("m{i}"), session, price, currency).await;
    }
    process_all(&pool, &shop).await;
    sales::release_matured(&pool, Utc::now()).await.unwrap();
    let made = payouts::run(&pool, Utc::now().date_naive()).await.unwrap();
    let (status, list) = shop.json(&format!("/sellers/{seller}/payouts")).await;
    assert_eq!(status, 200);
    assert_eq!(made.len(), 1, "{list}");
    assert_eq!(
        list["payouts"][0]["currency"], "JPY",
        "45 JPY is above its own minimum of 40; 45.00 BRL below the seller's 100.00"
    );
    let (status, bad) = shop
        .post(
            "/admin/sellers",
            Some(ADMIN_TOKEN),
            json!({"name": "Bad", "payout_frequency": "daily", "payout_minimum": "1", "payout_minimums": {"JPY": "0.5"}}),
        )
        .await;
    assert_eq!(
        (status, bad["error"]["code"].as_str()),
        (422, Some("invalid_request")),
        "{bad}"
    );
}

#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn invoices_are_numbered_without_gaps_once_per_seller_and_period(pool: PgPool) {
    let shop = stepped(&pool).await;
    let mut sellers = Vec::new();
    for (i, price) in ["10.00", "25.50", "7.99"].iter().enumerate() {
        let s = shop
            .seller_with(&format!("S{i}"), "monthly", "1.00", 0)
            .await;
        let p = shop.product(&s, price, "BRL").await;
        for j in 0..2 {
            let o = shop.checkout_one(&format!("k{i}{j}"), "b", &p, j + 1).await;
            let session = o["payment"]["session_id"].as_str().unwrap();
            send(
                &shop,
                &format!("m{i}{j}"),
                &event(
                    "payment.succeeded",
                    session,
                    json!({"amount": o["total"].as_str().unwrap()}),
                ),
            )
            .await;
        }
        sellers.push(s);
    }
    process_all(&pool, &shop).await;
    // A period around now (two months: the test may cross a month's end).
    let this_month = Utc::now().date_naive().with_day(1).unwrap();
    let start = this_month
        .checked_sub_months(chrono::Months::new(1))
        .unwrap();
    let end = this_month
        .checked_add_months(chrono::Months::new(1))
        .unwrap();
    // Two runs at once, then a rerun: the same three invoices, numbered 1, 2, 3.
    let (a, b) = tokio::join!(
        invoices::run(&pool, start, end, chrono_tz::UTC),
        invoices::run(&pool, start, end, chrono_tz::UTC)
    );
    let (mut a, mut b) = (a.unwrap(), b.unwrap());
    a.sort();
    b.sort();
    assert_eq!(a, vec![1, 2, 3]);
    assert_eq!(a, b);
    assert_eq!(
        invoices::run(&pool, start, end, chrono_tz::UTC)
            .await
            .unwrap(),
        a
    );
    // Seller 1: two orders of 25.50 and 51.00: commission 2.55 (2.550) and 5.10.
    let (status, list) = shop
        .json(&format!("/sellers/{}/invoices", sellers[1]))
        .await;
    assert_eq!(status, 200);
    let inv = &list["invoices"][0];
    let number = inv["number"].as_i64().unwrap();
    let lines: Vec<&str> = inv["lines"]
        .as_array()
        .unwrap()
        .iter()
        .map(|l| l["commission"].as_str().unwrap())
        .collect();
    assert_eq!(lines, vec!["2.55", "5.10"]);
    assert_eq!(
        inv["totals"],
        json!([{"currency": "BRL", "commission": "7.65"}])
    );
    let (status, one) = shop
        .json(&format!("/sellers/{}/invoices/{number}", sellers[1]))
        .await;
    assert_eq!((status, &one["number"]), (200, &json!(number)));
    let (status, page) = shop
        .app
        .get(&format!("/sellers/{}/invoices/{number}/print", sellers[1]))
        .await;
    assert_eq!(status, 200);
    assert!(
        page.contains(&format!("Commission invoice {number}")),
        "{page}"
    );
    assert!(page.contains("7.65"), "{page}");
    // Another seller's number is not this seller's invoice.
    let (status, _) = shop
        .json(&format!("/sellers/{}/invoices/{number}", sellers[0]))
        .await;
    assert_eq!(status, 404);
    // Nothing earned in a period: no invoice, no number used.
    let (past_start, past_end) = invoices::previous_month(start - chrono::Duration::days(40));
    assert!(
        invoices::run(&pool, past_start, past_end, chrono_tz::UTC)
            .await
            .unwrap()
            .is_empty()
    );
    let last: i64 = sqlx::query_scalar("SELECT last FROM invoice_numbers")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(last, 3);
}

/// The invoice run's schedule is in one time zone (01:00 in Tokyo) and the invoice periods in
/// another (UTC): a run whose date there is already the 1st must not invoice a month that has
/// not ended where it is invoiced, or its last hours would never be.
#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn a_month_is_invoiced_only_once_it_has_ended_in_the_invoices_time_zone(pool: PgPool) {
    let shop = stepped(&pool).await;
    let s = shop.seller_with("S", "monthly", "1.00", 0).await;
    let p = shop.product(&s, "10.00", "BRL").await;
    let o = shop.checkout_one("k", "b", &p, 1).await;
    let session = o["payment"]["session_id"].as_str().unwrap();
    send(
        &shop,
        "m1",
        &event("payment.succeeded", session, json!({"amount": "10.00"})),
    )
    .await;
    process_all(&pool, &shop).await;
    let utc = chrono_tz::UTC;
    let next_month = Utc::now()
        .date_naive()
        .with_day(1)
        .unwrap()
        .checked_add_months(chrono::Months::new(1))
        .unwrap();
    let month_ends = invoices::day_start(next_month, utc);
    // 01:00 on the 1st in Tokyo: eight hours of the UTC month are still to come.
    let tokyo: chrono_tz::Tz = "Asia/Tokyo".parse().unwrap();
    let early = (month_ends - chrono::Duration::hours(8)).with_timezone(&tokyo);
    assert_eq!(
        early.date_naive(),
        next_month,
        "the run's own date is the 1st"
    );
    ledger::jobs::invoices(pool.clone(), early, utc)
        .await
        .unwrap();
    let invoiced: i64 = sqlx::query_scalar("SELECT count(*) FROM invoices")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(invoiced, 0, "the month has not ended in UTC");
    // Just after the month's end, a fee stamped in its last moments may still be committing:
    // not yet.
    ledger::jobs::invoices(
        pool.clone(),
        (month_ends + chrono::Duration::minutes(30)).with_timezone(&tokyo),
        utc,
    )
    .await
    .unwrap();
    let invoiced: i64 = sqlx::query_scalar("SELECT count(*) FROM invoices")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(invoiced, 0, "the month ended less than an hour ago");
    // The next day's run, after the month's end: its invoice, with the sale.
    let later = (month_ends + chrono::Duration::hours(16)).with_timezone(&tokyo);
    ledger::jobs::invoices(pool.clone(), later, utc)
        .await
        .unwrap();
    let (status, list) = shop.json(&format!("/sellers/{s}/invoices")).await;
    assert_eq!(status, 200);
    assert_eq!(
        list["invoices"][0]["totals"][0]["commission"], "1.00",
        "{list}"
    );
    assert_eq!(
        list["invoices"][0]["period_end"],
        json!(next_month.to_string())
    );
}

/// The months invoiced are one zone's: a run in another zone (an operator's shell without the
/// fleet's `PAYFLEET_INVOICE_TIMEZONE`, a changed setting) would invoice a month overlapping
/// the ones made, its fees twice, or leave hours between them never invoiced. It is refused,
/// and makes nothing.
#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn invoices_are_made_in_the_time_zone_of_the_first(pool: PgPool) {
    let shop = stepped(&pool).await;
    let mut sellers = Vec::new();
    for (i, key) in ["k1", "k2"].iter().enumerate() {
        let s = shop
            .seller_with(&format!("S{i}"), "monthly", "1.00", 0)
            .await;
        let p = shop.product(&s, "10.00", "BRL").await;
        let o = shop.checkout_one(key, "b", &p, 1).await;
        let session = o["payment"]["session_id"].as_str().unwrap();
        send(
            &shop,
            &format!("m{i}"),
            &event("payment.succeeded", session, json!({"amount": "10.00"})),
        )
        .await;
        sellers.push(s);
    }
    process_all(&pool, &shop).await;
    let sao_paulo: chrono_tz::Tz = "America/Sao_Paulo".parse().unwrap();
    // Two months around now (the test may cross a month's end).
    let this_month = Utc::now().date_naive().with_day(1).unwrap();
    let start = this_month
        .checked_sub_months(chrono::Months::new(1))
        .unwrap();
    let end = this_month
        .checked_add_months(chrono::Months::new(1))
        .unwrap();
    let first = invoices::create(&pool, &sellers[0], start, end, sao_paulo)
        .await
        .unwrap();
    assert_eq!(first, Some(1));
    // The other seller's invoice in UTC: refused, saying which zone to run in; nothing made,
    // no number used. The same in the recurring job's run, which ends dead (a configuration
    // no retry mends).
    let refused = invoices::run(&pool, start, end, chrono_tz::UTC)
        .await
        .unwrap_err();
    assert!(
        matches!(&refused, invoices::InvoiceError::OtherZone { recorded, configured }
            if recorded == "America/Sao_Paulo" && configured == "UTC"),
        "{refused:?}"
    );
    assert!(
        refused
            .to_string()
            .contains("PAYFLEET_INVOICE_TIMEZONE=America/Sao_Paulo"),
        "{refused}"
    );
    let months_on = Utc::now() + chrono::Duration::days(62);
    let job = ledger::jobs::invoices(
        pool.clone(),
        months_on.with_timezone(&chrono_tz::UTC),
        chrono_tz::UTC,
    )
    .await;
    assert!(
        matches!(&job, Err(payfleet_queue::JobError::Fail(_))),
        "a run in another zone ends dead: {job:?}"
    );
    let made: Vec<(i64, String)> =
        sqlx::query_as("SELECT number, seller_id::text FROM invoices ORDER BY number")
            .fetch_all(&pool)
            .await
            .unwrap();
    assert_eq!(made, vec![(1, sellers[0].clone())]);
    let last: i64 = sqlx::query_scalar("SELECT last FROM invoice_numbers")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(last, 1);
    // In the recorded zone: made, numbered next.
    let mut numbers = invoices::run(&pool, start, end, sao_paulo).await.unwrap();
    numbers.sort();
    assert_eq!(numbers, vec![1, 2]);
    // A deployment upgraded with invoices made before the zone was recorded: a run by hand is
    // refused (its shell's zone may not be theirs); the fleet's own job records its zone.
    sqlx::query("DELETE FROM invoice_calendar")
        .execute(&pool)
        .await
        .unwrap();
    let refused = invoices::run(&pool, start, end, chrono_tz::UTC)
        .await
        .unwrap_err();
    assert!(
        matches!(&refused, invoices::InvoiceError::ZoneUnrecorded { .. }),
        "{refused:?}"
    );
    ledger::jobs::invoices(
        pool.clone(),
        Utc::now().with_timezone(&sao_paulo),
        sao_paulo,
    )
    .await
    .unwrap();
    let recorded: String = sqlx::query_scalar("SELECT timezone FROM invoice_calendar")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(recorded, "America/Sao_Paulo");
    // A worker of another zone is told the recorded one (which it logs as an error at start),
    // and the record stays.
    assert_eq!(
        invoices::record_zone(&pool, chrono_tz::UTC).await.unwrap(),
        "America/Sao_Paulo"
    );
    assert_eq!(
        invoices::record_zone(&pool, sao_paulo).await.unwrap(),
        "America/Sao_Paulo"
    );
}

#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn concurrent_reservations_beyond_the_balance_fail_cleanly(pool: PgPool) {
    let hundred = Money::parse("100.00", "BRL").unwrap();
    coins::grant(&pool, "buyer", hundred, "welcome")
        .await
        .unwrap();
    // The same grant key again grants nothing; with another amount it is refused.
    coins::grant(&pool, "buyer", hundred, "welcome")
        .await
        .unwrap();
    assert!(matches!(
        coins::grant(&pool, "buyer", Money::parse("5", "BRL").unwrap(), "welcome").await,
        Err(coins::CoinError::Conflict(_))
    ));
    let fifteen = Money::parse("15.00", "BRL").unwrap();
    let tasks: Vec<_> = (0..20)
        .map(|i| {
            let pool = pool.clone();
            tokio::spawn(async move {
                coins::reserve(&pool, &format!("r{i}"), "buyer", fifteen, None).await
            })
        })
        .collect();
    let (mut ok, mut refused) = (0, 0);
    for t in tasks {
        match t.await.unwrap() {
            Ok(coins::ReservationState::Reserved) => ok += 1,
            Err(coins::CoinError::Insufficient { .. }) => refused += 1,
            other => panic!("{other:?}"),
        }
    }
    assert_eq!((ok, refused), (6, 14));
    let wallet = coins::wallet_of(&pool, "buyer", brl()).await.unwrap();
    assert_eq!(
        (wallet.balance.as_str(), wallet.reserved.as_str()),
        ("10.00", "90.00")
    );
    // The CHECK is the last barrier even for a caller that skips the checks.
    let below = sqlx::query(
        "UPDATE ledger_accounts SET balance = balance - 11 WHERE kind = 'buyer_wallet' AND owner = 'buyer'",
    )
    .execute(&pool)
    .await;
    assert!(below.is_err());

    // Each step is idempotent by the reservation's id; the other step after one is refused.
    let reserved: Vec<String> =
        sqlx::query_scalar("SELECT id FROM coin_reservations WHERE state = 'reserved' ORDER BY id")
            .fetch_all(&pool)
            .await
            .unwrap();
    let (first, second) = (&reserved[0], &reserved[1]);
    assert_eq!(
        coins::reserve(&pool, first, "buyer", fifteen, None)
            .await
            .unwrap(),
        coins::ReservationState::Reserved
    );
    assert!(matches!(
        coins::reserve(&pool, first, "buyer", hundred, None).await,
        Err(coins::CoinError::Conflict(_))
    ));
    for _ in 0..2 {
        assert_eq!(
            coins::decide(&pool, first, true).await.unwrap(),
            coins::ReservationState::Approved
        );
        assert_eq!(
            coins::decide(&pool, second, false).await.unwrap(),
            coins::ReservationState::Released
        );
    }
    assert!(matches!(
        coins::decide(&pool, first, false).await,
        Err(coins::CoinError::Decided { .. })
    ));
    let wallet = coins::wallet_of(&pool, "buyer", brl()).await.unwrap();
    assert_eq!(
        (wallet.balance.as_str(), wallet.reserved.as_str()),
        ("25.00", "60.00")
    );
    // A release that overtakes its reserve: the late reserve holds nothing.
    assert_eq!(
        coins::decide(&pool, "lost", false).await.unwrap(),
        coins::ReservationState::Released
    );
    assert_eq!(
        coins::reserve(&pool, "lost", "buyer", fifteen, None)
            .await
            .unwrap(),
        coins::ReservationState::Released
    );
    let wallet = coins::wallet_of(&pool, "buyer", brl()).await.unwrap();
    assert_eq!(wallet.balance, "25.00");
    invariants_hold(&pool).await;
}

#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn an_order_paid_with_coins_spends_them_once_and_an_expired_one_gives_them_back(
    pool: PgPool,
) {
    let shop = shop(pool.clone()).await;
    let seller = shop.seller_with("S", "weekly", "1.00", 0).await;
    let product = shop.product(&seller, "19.90", "BRL").await;
    let (status, wallet) = shop
        .keyed(
            "/admin/wallets/rich/grants",
            "grant-1",
            json!({"amount": "50.00", "currency": "BRL"}),
        )
        .await;
    assert_eq!(
        (status, wallet["balance"].as_str()),
        (201, Some("50.00")),
        "{wallet}"
    );
    let (status, _) = shop
        .keyed(
            "/admin/wallets/poor/grants",
            "grant-2",
            json!({"amount": "5.00", "currency": "BRL"}),
        )
        .await;
    assert_eq!(status, 201);

    // Paid with coins over the RPC; asking again changes nothing.
    let order = shop.checkout_one("k1", "rich", &product, 1).await;
    let n = order["number"].as_i64().unwrap();
    // A second tab has the payment page open meanwhile, with its form.
    let url = order["payment"]["url"].as_str().unwrap();
    let open_page = shop
        .app
        .anon
        .get(url)
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    for _ in 0..2 {
        let (status, o) = shop
            .post(&format!("/orders/{n}/coins"), None, json!({}))
            .await;
        assert_eq!((status, o["status"].as_str()), (200, Some("paid")), "{o}");
    }
    wait_for(
        "the coins to be spent",
        Duration::from_secs(20),
        async || {
            let (_, w) = shop.json("/wallets/rich").await;
            w["wallets"][0]["balance"] == "30.10" && w["wallets"][0]["reserved"] == "0.00"
        },
    )
    .await;
    // The seller is credited like any sale through the platform.
    assert_eq!(shop.balance(&seller).await, (d("17.91"), d("0")));
    // Its gateway session is paid as well (a second tab that was open): that payment is an
    // extra one, given back, never a second sale.
    let page = shop
        .app
        .anon
        .post(url)
        .form(&[("outcome", "succeeded"), ("token", &form_token(&open_page))])
        .send()
        .await
        .unwrap();
    assert_eq!(page.status(), 409, "the page itself refuses a paid order");
    let session = order["payment"]["session_id"].as_str().unwrap();
    send_paid(&shop, "second-tab", session, "19.90").await;
    wait_for("the extra payment to be seen", Duration::from_secs(20), async || {
        let kinds: Vec<String> = sqlx::query_scalar(
            "SELECT e.kind FROM order_events e JOIN orders o ON o.id = e.order_id WHERE o.number = $1",
        )
        .bind(n)
        .fetch_all(&pool)
        .await
        .unwrap();
        kinds.iter().any(|k| k == "extra_payment")
    })
    .await;
    assert_eq!(shop.order(n).await["status"], "paid");
    assert_eq!(shop.balance(&seller).await, (d("17.91"), d("0")));

    // Not enough coins: refused, the order still waits.
    let poor = shop.checkout_one("k2", "poor", &product, 1).await;
    let m = poor["number"].as_i64().unwrap();
    let (status, answer) = shop
        .post(&format!("/orders/{m}/coins"), None, json!({}))
        .await;
    assert_eq!(
        (status, answer["error"]["code"].as_str()),
        (422, Some("coins_insufficient")),
        "{answer}"
    );
    assert_eq!(shop.order(m).await["status"], "awaiting_payment");
    // Its reservation was made after all (an answer lost on the way, say) once the buyer got
    // more coins; the order expires, and the coins come back.
    coins::grant(
        &pool,
        "poor",
        Money::parse("20.00", "BRL").unwrap(),
        "top-up",
    )
    .await
    .unwrap();
    let reservation: String =
        sqlx::query_scalar("SELECT coin_reservation FROM orders WHERE number = $1")
            .bind(m)
            .fetch_one(&pool)
            .await
            .unwrap();
    coins::reserve(
        &pool,
        &reservation,
        "poor",
        Money::parse("19.90", "BRL").unwrap(),
        Some(m),
    )
    .await
    .unwrap();
    let (_, w) = shop.json("/wallets/poor").await;
    assert_eq!(w["wallets"][0]["balance"], "5.10");
    let (status, _) = shop
        .post(
            &format!("/admin/orders/{m}/expire"),
            Some(ADMIN_TOKEN),
            json!({}),
        )
        .await;
    assert_eq!(status, 202);
    wait_for(
        "the reservation to come back",
        Duration::from_secs(20),
        async || {
            let (_, w) = shop.json("/wallets/poor").await;
            w["wallets"][0]["balance"] == "25.00" && w["wallets"][0]["reserved"] == "0.00"
        },
    )
    .await;
    assert_eq!(shop.order(m).await["status"], "expired");
    let (status, _) = shop
        .post(&format!("/orders/{m}/coins"), None, json!({}))
        .await;
    assert_eq!(status, 409);
    invariants_hold(&pool).await;
}

#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn a_coin_paid_order_is_refunded_in_coins_once_per_key_and_never_beyond_its_total(
    pool: PgPool,
) {
    let shop = shop(pool.clone()).await;
    let seller = shop.seller_with("S", "weekly", "1.00", 14).await;
    let product = shop.product(&seller, "100.00", "BRL").await;
    let (status, _) = shop
        .keyed(
            "/admin/wallets/rich/grants",
            "grant",
            json!({"amount": "150.00", "currency": "BRL"}),
        )
        .await;
    assert_eq!(status, 201);
    let order = shop.checkout_one("k1", "rich", &product, 1).await;
    let n = order["number"].as_i64().unwrap();
    let (status, o) = shop
        .post(&format!("/orders/{n}/coins"), None, json!({}))
        .await;
    assert_eq!((status, o["status"].as_str()), (200, Some("paid")), "{o}");
    let path = format!("/admin/orders/{n}/refunds");
    let wallet = async || {
        let (_, w) = shop.json("/wallets/rich").await;
        (
            w["wallets"][0]["balance"].as_str().unwrap().to_owned(),
            w["wallets"][0]["reserved"].as_str().unwrap().to_owned(),
        )
    };

    // At once, perhaps before the coins' approval has run: the refund approves them first.
    let (status, first) = shop
        .keyed(&path, "r1", json!({"amount": "30.00", "reason": "damaged"}))
        .await;
    assert_eq!(status, 201, "{first}");
    assert_eq!(first["paid_with"], "coins");
    assert_eq!(first["gateway"], Value::Null);
    assert_eq!(first["state"], "succeeded");
    assert_eq!(first["amount"], "30.00");
    let o = shop.order(n).await;
    assert_eq!(
        (o["status"].as_str(), o["amount_refunded"].as_str()),
        (Some("partially_refunded"), Some("30.00")),
        "{o}"
    );
    // Whenever the approval job runs, it finds the coins spent: nothing comes back twice.
    wait_for(
        "the reservation to be settled",
        Duration::from_secs(20),
        async || {
            sqlx::query_scalar::<_, i64>(
                "SELECT count(*) FROM jobs WHERE kind = 'settle_coins' AND state NOT IN ('completed')",
            )
            .fetch_one(&pool)
            .await
            .unwrap()
                == 0
        },
    )
    .await;
    assert_eq!(wallet().await, ("80.00".into(), "0.00".into()));
    // The seller bears its share (90 of each 100), the fee the rest.
    assert_eq!(shop.balance(&seller).await, (d("63.00"), d("0")));

    // The same key is the same refund: nothing moves again.
    let (status, again) = shop
        .keyed(&path, "r1", json!({"amount": "30.00", "reason": "damaged"}))
        .await;
    assert_eq!((status, &again["id"]), (201, &first["id"]), "{again}");
    let (status, reused) = shop.keyed(&path, "r1", json!({"amount": "10.00"})).await;
    assert_eq!(
        (status, reused["error"]["code"].as_str()),
        (422, Some("idempotency_key_reused"))
    );
    // Beyond what is left: refused, nothing written.
    let (status, beyond) = shop.keyed(&path, "r2", json!({"amount": "70.01"})).await;
    assert_eq!(
        (status, beyond["error"]["code"].as_str()),
        (422, Some("refund_exceeds_payment")),
        "{beyond}"
    );
    assert_eq!(wallet().await, ("80.00".into(), "0.00".into()));

    // The rest (no amount: all that is left).
    let (status, rest) = shop.keyed(&path, "r3", json!({})).await;
    assert_eq!(
        (status, rest["amount"].as_str()),
        (201, Some("70.00")),
        "{rest}"
    );
    let o = shop.order(n).await;
    assert_eq!(
        (o["status"].as_str(), o["amount_refunded"].as_str()),
        (Some("refunded"), Some("100.00"))
    );
    // All of it back, in coins: one `refunded` message (the partial refund before wrote none).
    let messages: Vec<String> = sqlx::query_scalar(
        "SELECT e.kind FROM order_events e JOIN orders o ON o.id = e.order_id
         WHERE o.number = $1 AND e.kind IN ('paid', 'refunded') ORDER BY e.id",
    )
    .bind(n)
    .fetch_all(&pool)
    .await
    .unwrap();
    assert_eq!(messages, ["paid", "refunded"]);
    assert_eq!(wallet().await, ("150.00".into(), "0.00".into()));
    assert_eq!(shop.balance(&seller).await, (d("0.00"), d("0")));
    let revenue: Decimal = sqlx::query_scalar(
        "SELECT balance FROM ledger_accounts WHERE kind = 'platform_revenue' AND owner = $1",
    )
    .bind(&seller)
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(revenue, d("0"), "the whole fee is given back, once");
    let (status, none_left) = shop.keyed(&path, "r4", json!({"amount": "0.01"})).await;
    assert_eq!(
        (status, none_left["error"]["code"].as_str()),
        (409, Some("order_not_refundable"))
    );
    let list: Value = shop
        .app
        .http
        .get(format!("http://{}{path}", shop.app.addr))
        .bearer_auth(ADMIN_TOKEN)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(list["refunds"].as_array().unwrap().len(), 2, "{list}");

    // The schema refuses a coin refund beyond the order's total, written straight in SQL.
    let beyond = sqlx::query(
        "INSERT INTO refund_requests (idempotency_key, order_number, paid_with, amount, currency, state, refund_id)
         VALUES ('sql', $1, 'coins', 0.01, 'BRL', 'succeeded', 'coins-sql')",
    )
    .bind(n)
    .execute(&pool)
    .await
    .unwrap_err();
    assert_eq!(
        payfleet::db::constraint(&beyond),
        Some("refund_requests_within_capture"),
        "{beyond}"
    );
    let findings = payfleet::consistency::check(&pool, Duration::from_secs(0))
        .await
        .unwrap();
    assert!(findings.is_empty(), "{findings:?}");
    invariants_hold(&pool).await;
}

#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn an_operator_refund_calls_the_gateway_and_debits_once_with_its_webhook(pool: PgPool) {
    let shop = shop(pool.clone()).await;
    let seller = shop.seller_with("S", "weekly", "1.00", 14).await;
    let product = shop.product(&seller, "19.90", "BRL").await;
    let order = shop.checkout_one("k1", "b", &product, 1).await;
    let n = order["number"].as_i64().unwrap();
    let path = format!("/admin/orders/{n}/refunds");
    // Not paid yet: nothing to refund.
    let (status, answer) = shop.keyed(&path, "r0", json!({"amount": "5.00"})).await;
    assert_eq!(
        (status, answer["error"]["code"].as_str()),
        (409, Some("order_not_refundable"))
    );
    let url = order["payment"]["url"].as_str().unwrap();
    let (paid, _) = shop.app.pay(url, "succeeded").await;
    assert_eq!(paid, 200);
    wait_for(
        "the order to be paid",
        Duration::from_secs(20),
        async || shop.order(n).await["status"] == "paid",
    )
    .await;
    assert_eq!(shop.balance(&seller).await, (d("17.91"), d("0")));

    // 5.00 back: the seller bears 5 × 17.91/19.90 = 4.50.
    let (status, r) = shop
        .keyed(&path, "r1", json!({"amount": "5.00", "reason": "damaged"}))
        .await;
    assert_eq!(
        (status, r["state"].as_str()),
        (201, Some("succeeded")),
        "{r}"
    );
    let (status, again) = shop.keyed(&path, "r1", json!({"amount": "5.00"})).await;
    assert_eq!((status, &again["id"]), (201, &r["id"]));
    let (status, reused) = shop.keyed(&path, "r1", json!({"amount": "6.00"})).await;
    assert_eq!(
        (status, reused["error"]["code"].as_str()),
        (422, Some("idempotency_key_reused"))
    );
    // The gateway's own refund event arrives and is processed: nothing more is debited.
    wait_for("the refund event to be processed", Duration::from_secs(20), async || {
        let n: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM payment_events WHERE event_type = 'refund.succeeded' AND processed_at IS NOT NULL",
        )
        .fetch_one(&pool)
        .await
        .unwrap();
        n == 1
    })
    .await;
    assert_eq!(shop.balance(&seller).await, (d("13.41"), d("0")));
    assert_eq!(shop.order(n).await["status"], "partially_refunded");

    // More than is left: refused, nothing asked of the gateway.
    let (status, answer) = shop.keyed(&path, "r2", json!({"amount": "15.00"})).await;
    assert_eq!(
        (status, answer["error"]["code"].as_str()),
        (422, Some("refund_exceeds_payment")),
        "{answer}"
    );
    let (status, answer) = shop.keyed(&path, "r3", json!({"amount": "abc"})).await;
    assert_eq!(
        (status, answer["error"]["code"].as_str()),
        (422, Some("invalid_request"))
    );
    let (status, answer) = shop
        .post(&path, Some(ADMIN_TOKEN), json!({"amount": "1.00"}))
        .await;
    assert_eq!(
        (status, answer["error"]["code"].as_str()),
        (400, Some("missing_idempotency_key"))
    );
    // The rest, with no amount: the whole 14.90 left.
    let (status, r) = shop.keyed(&path, "r4", json!({})).await;
    assert_eq!((status, r["amount"].as_str()), (201, Some("14.90")), "{r}");
    wait_for(
        "the order to be refunded",
        Duration::from_secs(20),
        async || shop.order(n).await["status"] == "refunded",
    )
    .await;
    assert_eq!(shop.balance(&seller).await, (d("0.00"), d("0")));
    let (status, list) = shop.json(&path).await;
    assert_eq!(
        (status, list["error"]["code"].as_str()),
        (403, Some("forbidden")),
        "the listing is an admin endpoint, which an API key may not call: {list}"
    );
    let listed = shop
        .app
        .http
        .get(format!("http://{}{path}", shop.app.addr))
        .bearer_auth(ADMIN_TOKEN)
        .send()
        .await
        .unwrap()
        .json::<Value>()
        .await
        .unwrap();
    assert_eq!(listed["refunds"].as_array().unwrap().len(), 2);
    invariants_hold(&pool).await;
}

#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn the_read_api_pages_the_ledger_and_refuses_what_is_not_a_seller(pool: PgPool) {
    let shop = stepped(&pool).await;
    let seller = shop.seller_with("S", "weekly", "1.00", 0).await;
    let product = shop.product(&seller, "10.00", "BRL").await;
    for i in 0..3 {
        let o = shop.checkout_one(&format!("k{i}"), "b", &product, 1).await;
        let session = o["payment"]["session_id"].as_str().unwrap();
        send(
            &shop,
            &format!("m{i}"),
            &event("payment.succeeded", session, json!({"amount": "10.00"})),
        )
        .await;
    }
    process_all(&pool, &shop).await;
    let mut after = 0;
    let mut seen = Vec::new();
    loop {
        let (status, page) = shop
            .json(&format!("/sellers/{seller}/ledger?limit=2&after={after}"))
            .await;
        assert_eq!(status, 200, "{page}");
        for e in page["entries"].as_array().unwrap() {
            seen.push(e["balance_after"].as_str().unwrap().to_owned());
        }
        match page["next_after"].as_i64() {
            Some(next) => after = next,
            None => break,
        }
    }
    assert_eq!(seen, vec!["9.00", "18.00", "27.00"]);
    for (path, status) in [
        ("/sellers/not-a-uuid/balances".to_owned(), 404),
        (
            "/sellers/00000000-0000-0000-0000-000000000000/balances".to_owned(),
            404,
        ),
        (format!("/sellers/{seller}/ledger?limit=0"), 400),
        (format!("/sellers/{seller}/ledger?limit=x"), 400),
        (format!("/sellers/{seller}/invoices/abc"), 404),
    ] {
        let (got, body) = shop.json(&path).await;
        assert_eq!(got, status, "{path}: {body}");
        assert!(body["error"]["code"].is_string(), "{path}: {body}");
    }
    let (status, w) = shop.json("/wallets/nobody").await;
    assert_eq!((status, &w["wallets"]), (200, &json!([])));
}

/// What the test expects of one seller, computed from the amounts it sent.
#[derive(Default, Debug)]
struct Expected {
    net: Decimal,
    commission: Decimal,
    orders: usize,
}

#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn proof_a_few_hundred_orders_end_to_end_to_the_cent(pool: PgPool) {
    let shop = stepped(&pool).await;
    // Four sellers: holding 0 and 7 days (released by the run below), 14 and 30 (still pending).
    let mut sellers = Vec::new();
    for (i, holding) in [0, 7, 14, 30].into_iter().enumerate() {
        let s = shop
            .seller_with(&format!("Seller {i}"), "weekly", "0.01", holding)
            .await;
        let mut products = Vec::new();
        for price in ["19.90", "7.33", "120.05"] {
            products.push(shop.product(&s, price, "BRL").await);
        }
        sellers.push((s, holding, products));
    }
    // 240 orders, one per checkout.
    let mut orders = Vec::new();
    for i in 0..240usize {
        let (seller, _, products) = &sellers[i % 4];
        let (product, quantity) = (&products[(i / 4) % 3], ((i / 12) % 3 + 1) as i64);
        let o = shop
            .checkout_one(
                &format!("proof-{i}"),
                &format!("buyer-{}", i % 9),
                product,
                quantity,
            )
            .await;
        assert_eq!(o["seller_id"].as_str(), Some(seller.as_str()));
        orders.push(o);
    }
    let mut expected: HashMap<String, Expected> = HashMap::new();
    let fee_rate = d("0.10");
    // Every order but every tenth is paid; every sixth paid order is refunded in part (a third,
    // in cents), some of those refunds delivered before their payment; events are duplicated
    // and re-emitted; one dispute is lost, one won.
    let mut deliveries: Vec<(String, String)> = Vec::new();
    let mut late: Vec<(String, String)> = Vec::new();
    for (i, o) in orders.iter().enumerate() {
        if i % 10 == 9 {
            continue;
        }
        let seller = o["seller_id"].as_str().unwrap().to_owned();
        let session = o["payment"]["session_id"].as_str().unwrap();
        let total = d(o["total"].as_str().unwrap());
        let fee = cents(total * fee_rate);
        let net = total - fee;
        assert_eq!(o["platform_fee"].as_str().unwrap(), fee.to_string());
        let e = expected.entry(seller).or_default();
        e.net += net;
        e.commission += fee;
        e.orders += 1;
        let paid = (
            format!("pay-{i}"),
            event(
                "payment.succeeded",
                session,
                json!({"amount": total.to_string()}),
            ),
        );
        if i % 6 == 0 {
            // A third back; for every fourth of these, the rest too (the whole order refunded).
            let refund = cents(total / d("3"));
            let seller_part = cents(refund * net / total);
            e.net -= seller_part;
            e.commission -= refund - seller_part;
            if i % 24 == 0 {
                let rest = total - refund;
                // On the running total: the whole refund returns exactly the net.
                e.net -= net - seller_part;
                e.commission -= rest - (net - seller_part);
                deliveries.push((
                    format!("refund-rest-{i}"),
                    event(
                        "refund.succeeded",
                        session,
                        json!({"refund_id": format!("rf_rest_{i}"), "amount": rest.to_string()}),
                    ),
                ));
            }
            let r = (
                format!("refund-{i}"),
                event(
                    "refund.succeeded",
                    session,
                    json!({"refund_id": format!("rf_{i}"), "amount": refund.to_string()}),
                ),
            );
            if i % 12 == 0 {
                deliveries.push(r.clone());
                deliveries.push(paid.clone());
            } else {
                deliveries.push(paid.clone());
                deliveries.push(r.clone());
            }
            // Re-emitted under a new id.
            late.push((format!("{}-again", r.0), r.1));
        } else if i == 7 || i == 11 {
            let won = i == 11;
            deliveries.push(paid.clone());
            let dispute = |kind: &str| {
                event(
                    kind,
                    session,
                    json!({"dispute_id": format!("dp_{i}"), "amount": total.to_string()}),
                )
            };
            deliveries.push((format!("dispute-{i}"), dispute("dispute.created")));
            late.push((
                format!("dispute-{i}-end"),
                dispute(if won { "dispute.won" } else { "dispute.lost" }),
            ));
            if !won {
                e.net -= net;
                e.commission -= fee;
            }
        } else {
            deliveries.push(paid.clone());
        }
        if i % 5 == 0 {
            deliveries.push(paid.clone()); // the same delivery again
        }
        if i % 7 == 0 {
            late.push((format!("{}-reemitted", paid.0), paid.1)); // the same facts, a new id
        }
    }
    for (id, body) in deliveries.iter().chain(late.iter()) {
        send(&shop, id, body).await;
    }
    process_all(&pool, &shop).await;
    // Unpaid orders stay out of the ledger; every event is processed.
    let unprocessed: i64 =
        sqlx::query_scalar("SELECT count(*) FROM payment_events WHERE processed_at IS NULL")
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!(unprocessed, 0);
    let paid_orders: i64 =
        sqlx::query_scalar("SELECT count(*) FROM orders WHERE paid_at IS NOT NULL")
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!(paid_orders, 216);

    // Balances before the holding period: all pending.
    for (seller, _, _) in &sellers {
        let e = &expected[seller];
        assert_eq!(
            shop.balance(seller).await,
            (e.net, d("0")),
            "seller {seller}"
        );
    }
    // Ten days on: sellers holding 0 and 7 days are available; a payout run pays them.
    let later = Utc::now() + chrono::Duration::days(10);
    sales::release_matured(&pool, later).await.unwrap();
    let made = payouts::run(&pool, later.date_naive()).await.unwrap();
    assert_eq!(made.len(), 2);
    for (seller, holding, _) in &sellers {
        let e = &expected[seller];
        let (pending, available) = shop.balance(seller).await;
        let (_, list) = shop.json(&format!("/sellers/{seller}/payouts")).await;
        if *holding <= 7 {
            assert_eq!((pending, available), (d("0"), d("0")), "seller {seller}");
            assert_eq!(list["payouts"].as_array().unwrap().len(), 1);
            assert_eq!(d(list["payouts"][0]["amount"].as_str().unwrap()), e.net);
        } else {
            assert_eq!((pending, available), (e.net, d("0")), "seller {seller}");
            assert_eq!(list["payouts"], json!([]));
        }
    }
    // The period's invoices (two months around now: the test may cross a month's end): one per
    // seller, gapless, the commission to the cent.
    let this_month = Utc::now().date_naive().with_day(1).unwrap();
    let start = this_month
        .checked_sub_months(chrono::Months::new(1))
        .unwrap();
    let end = this_month
        .checked_add_months(chrono::Months::new(1))
        .unwrap();
    let mut numbers = invoices::run(&pool, start, end, chrono_tz::UTC)
        .await
        .unwrap();
    numbers.sort();
    assert_eq!(numbers, vec![1, 2, 3, 4]);
    for (seller, _, _) in &sellers {
        let e = &expected[seller];
        let (_, list) = shop.json(&format!("/sellers/{seller}/invoices")).await;
        let inv = &list["invoices"][0];
        assert_eq!(
            d(inv["totals"][0]["commission"].as_str().unwrap()),
            e.commission,
            "seller {seller}"
        );
        let lines: Decimal = inv["lines"]
            .as_array()
            .unwrap()
            .iter()
            .map(|l| d(l["commission"].as_str().unwrap()))
            .sum();
        assert_eq!(lines, e.commission);
        assert_eq!(inv["lines"].as_array().unwrap().len(), e.orders);
    }
    invariants_hold(&pool).await;
    // And the consistency checks, with no grace at all, find nothing to report.
    assert_eq!(
        payfleet::consistency::check(&pool, Duration::ZERO)
            .await
            .unwrap(),
        vec![]
    );
}

#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn without_the_coins_side_paying_with_coins_is_a_503_that_spends_nothing(pool: PgPool) {
    // A receiver with no worker: nobody answers the coins RPC.
    let shop = stepped(&pool).await;
    let seller = shop.seller_with("S", "weekly", "1.00", 0).await;
    let product = shop.product(&seller, "10.00", "BRL").await;
    coins::grant(&pool, "b", Money::parse("50.00", "BRL").unwrap(), "g")
        .await
        .unwrap();
    let order = shop.checkout_one("k", "b", &product, 1).await;
    let n = order["number"].as_i64().unwrap();
    let (status, answer) = shop
        .post(&format!("/orders/{n}/coins"), None, json!({}))
        .await;
    assert_eq!(
        (status, answer["error"]["code"].as_str()),
        (503, Some("coins_unavailable")),
        "{answer}"
    );
    assert_eq!(shop.order(n).await["status"], "awaiting_payment");
    let wallet = coins::wallet_of(&pool, "b", brl()).await.unwrap();
    assert_eq!(
        (wallet.balance.as_str(), wallet.reserved.as_str()),
        ("50.00", "0.00")
    );
}

#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn partial_refunds_round_half_even_on_the_running_total(pool: PgPool) {
    let shop = stepped(&pool).await;
    let seller = shop.seller_with("S", "weekly", "1.00", 14).await;
    let product = shop.product(&seller, "10.00", "BRL").await;
    let order = shop.checkout_one("k", "b", &product, 1).await;
    let session = order["payment"]["session_id"].as_str().unwrap();
    send_paid(&shop, "paid", session, "10.00").await;
    process_all(&pool, &shop).await;
    assert_eq!(shop.balance(&seller).await, (d("9.00"), d("0")));
    // The seller bears 90 %: 0.05 → 0.045, a tie, half-even to 0.04 (half-up would say 0.05).
    // Then 0.10 in all → 0.09, so 0.05 more; then the rest: 10.00 in all → exactly the 9.00.
    let mut expected = d("9.00");
    for (i, (amount, seller_part)) in [("0.05", "0.04"), ("0.05", "0.05"), ("9.90", "8.91")]
        .iter()
        .enumerate()
    {
        send(
            &shop,
            &format!("refund-{i}"),
            &event(
                "refund.succeeded",
                session,
                json!({"refund_id": format!("rf_{i}"), "amount": amount}),
            ),
        )
        .await;
        process_all(&pool, &shop).await;
        expected -= d(seller_part);
        assert_eq!(
            shop.balance(&seller).await,
            (expected, d("0")),
            "after refund {i}"
        );
    }
    assert_eq!(expected, d("0"));
    let revenue: Decimal = sqlx::query_scalar(
        "SELECT balance FROM ledger_accounts WHERE kind = 'platform_revenue' AND owner = $1",
    )
    .bind(&seller)
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(
        revenue,
        d("0"),
        "the whole fee is given back, not a cent more"
    );
    assert_eq!(
        shop.order(order["number"].as_i64().unwrap()).await["status"],
        "refunded"
    );
    invariants_hold(&pool).await;
}

#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn refunds_and_chargebacks_never_take_back_more_than_was_paid(pool: PgPool) {
    let (shop, seller, _, session) = one_sale(&pool).await;
    send_paid(&shop, "paid", &session, "100.00").await;
    send_refund(&shop, "refund", &session, "rf_1", "30.00").await;
    // A chargeback of the whole amount after a partial refund: the gateway claims 130.00 of a
    // payment of 100.00.
    send(
        &shop,
        "dispute",
        &event(
            "dispute.lost",
            &session,
            json!({"dispute_id": "dp_1", "amount": "100.00"}),
        ),
    )
    .await;
    process_all(&pool, &shop).await;
    // The seller bears the net once (90.00 of the 100.00), the platform gives back its whole
    // fee once: nothing beyond the payment.
    assert_eq!(shop.balance(&seller).await, (d("0.00"), d("0")));
    let revenue: Decimal = sqlx::query_scalar(
        "SELECT COALESCE(sum(balance), 0) FROM ledger_accounts WHERE kind = 'platform_revenue'",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(
        revenue,
        d("0"),
        "the commission is returned once, not twice"
    );
    // The overage is for an operator to take up with the gateway.
    let findings = payfleet::consistency::check(&pool, Duration::from_secs(3600))
        .await
        .unwrap();
    assert!(
        findings
            .iter()
            .any(|f| f.check == "taken_back_beyond_payment"
                && f.detail.contains("disputes 100.0000")),
        "{findings:?}"
    );
    sales::release_matured(&pool, Utc::now() + chrono::Duration::days(15))
        .await
        .unwrap();
    assert_eq!(shop.balance(&seller).await, (d("0.00"), d("0")));
    invariants_hold(&pool).await;
}

/// What can be taken back from a payment of 100.00 (10.00 fee, 90.00 net): a refund, or a
/// dispute left open or ended (won, lost, or as a refund).
#[derive(Debug, Clone)]
enum TakenBack {
    Refund {
        cents: i64,
    },
    Dispute {
        cents: i64,
        end: Option<&'static str>,
    },
}

/// One scenario: the facts, and the events that carry them as the gateway sends them (some
/// twice, in any order), each followed by a processing step or not.
#[derive(Debug, Clone)]
struct Scenario {
    facts: Vec<TakenBack>,
    sent: Vec<(usize, &'static str)>,
    process_after: Vec<bool>,
}

fn scenarios() -> impl proptest::strategy::Strategy<Value = Scenario> {
    use proptest::collection::vec;
    use proptest::prelude::*;
    let refunds = vec(1..=10_000i64, 0..4);
    let ends = prop_oneof![
        Just(None),
        Just(Some("dispute.won")),
        Just(Some("dispute.lost")),
        Just(Some("dispute.refunded")),
    ];
    let disputes = vec((1..=10_000i64, ends), 0..3);
    (refunds, disputes).prop_flat_map(|(refunds, disputes)| {
        // Refunds within the payment (a gateway refuses more); disputes of any amount.
        let mut left = 10_000;
        let mut facts = Vec::new();
        for cents in refunds {
            if cents <= left {
                left -= cents;
                facts.push(TakenBack::Refund { cents });
            }
        }
        facts.extend(
            disputes
                .into_iter()
                .map(|(cents, end)| TakenBack::Dispute { cents, end }),
        );
        let mut events = Vec::new();
        for (i, f) in facts.iter().enumerate() {
            match f {
                TakenBack::Refund { .. } => events.push((i, "refund.succeeded")),
                TakenBack::Dispute { end, .. } => {
                    events.push((i, "dispute.created"));
                    events.extend(end.map(|e| (i, e)));
                }
            }
        }
        let n = events.len();
        (Just(facts), Just(events), vec(any::<bool>(), n))
            .prop_flat_map(|(facts, events, twice)| {
                let mut sent = events.clone();
                sent.extend(
                    events
                        .iter()
                        .zip(&twice)
                        .filter(|(_, t)| **t)
                        .map(|(e, _)| *e),
                );
                let n = sent.len();
                (
                    Just(facts),
                    Just(sent).prop_shuffle(),
                    vec(any::<bool>(), n),
                )
            })
            .prop_map(|(facts, sent, process_after)| Scenario {
                facts,
                sent,
                process_after,
            })
    })
}

/// The balances a scenario must end in, worked out apart from the ledger: taken back is
/// `min(paid, refunds + disputes open or lost + the part of each dispute ended as a refund that
/// the refunds do not cover)`, a refund covering one dispute (the disputes, in the order they
/// were recorded, taking what is left of them in turn), the seller bears 90% of it rounded
/// half-even to the cent, the fee the rest. (pending, platform revenue) `disputes`: the
/// disputes' facts in the order recorded, which is the processing's, left to the workers.
fn model(facts: &[TakenBack], disputes: &[usize]) -> (Decimal, Decimal) {
    let refunds: i64 = facts
        .iter()
        .map(|f| match f {
            TakenBack::Refund { cents } => *cents,
            TakenBack::Dispute { .. } => 0,
        })
        .sum();
    let mut covering_taken = 0;
    let claimed: i64 = refunds
        + disputes
            .iter()
            .map(|&fact| match &facts[fact] {
                TakenBack::Dispute {
                    cents,
                    end: None | Some("dispute.lost"),
                } => *cents,
                TakenBack::Dispute {
                    cents,
                    end: Some("dispute.refunded"),
                } => {
                    let covered = (refunds - covering_taken).max(0).min(*cents);
                    covering_taken += covered;
                    *cents - covered
                }
                _ => 0,
            })
            .sum::<i64>();
    let taken = Decimal::new(claimed.min(10_000), 2);
    let seller = cents(taken * d("0.9"));
    (d("90.00") - seller, d("10.00") - (taken - seller))
}

/// Plays one scenario on a new order of its own and compares the seller's balances with the
/// model's, to the cent.
async fn play(
    pool: &PgPool,
    shop: &Shop,
    case: usize,
    scenario: &Scenario,
) -> Result<(), proptest::test_runner::TestCaseError> {
    let seller = shop
        .seller_with(&format!("P{case}"), "weekly", "1.00", 14)
        .await;
    let product = shop.product(&seller, "100.00", "BRL").await;
    let order = shop
        .checkout_one(&format!("k{case}"), "buyer", &product, 1)
        .await;
    let session = order["payment"]["session_id"].as_str().unwrap().to_owned();
    send_paid(shop, &format!("p{case}"), &session, "100.00").await;
    for (i, ((fact, kind), process)) in scenario
        .sent
        .iter()
        .zip(&scenario.process_after)
        .enumerate()
    {
        let (cents, id) = match &scenario.facts[*fact] {
            TakenBack::Refund { cents } => {
                (*cents, json!({"refund_id": format!("rf_{case}_{fact}")}))
            }
            TakenBack::Dispute { cents, .. } => {
                (*cents, json!({"dispute_id": format!("dp_{case}_{fact}")}))
            }
        };
        let mut extra = id;
        extra["amount"] = json!(format!("{}.{:02}", cents / 100, cents % 100));
        send(shop, &format!("e{case}-{i}"), &event(kind, &session, extra)).await;
        if *process {
            process_all(pool, shop).await;
        }
    }
    process_all(pool, shop).await;
    let (pending, available) = shop.balance(&seller).await;
    let revenue: Decimal = sqlx::query_scalar(
        "SELECT balance FROM ledger_accounts WHERE kind = 'platform_revenue' AND owner = $1",
    )
    .bind(&seller)
    .fetch_one(pool)
    .await
    .unwrap();
    let recorded: Vec<String> = sqlx::query_scalar(
        "SELECT d.dispute_id FROM payment_disputes d WHERE d.dispute_id LIKE $1 ORDER BY d.id",
    )
    .bind(format!("dp\\_{case}\\_%"))
    .fetch_all(pool)
    .await
    .unwrap();
    let disputes: Vec<usize> = recorded
        .iter()
        .map(|id| id.rsplit('_').next().unwrap().parse().unwrap())
        .collect();
    let dispute_facts = scenario
        .facts
        .iter()
        .filter(|f| matches!(f, TakenBack::Dispute { .. }))
        .count();
    proptest::prop_assert_eq!(disputes.len(), dispute_facts, "every dispute recorded");
    proptest::prop_assert_eq!((pending, revenue), model(&scenario.facts, &disputes));
    proptest::prop_assert_eq!(available, d("0"));
    Ok(())
}

/// Property: random refunds and disputes of one payment (refunds within it, disputes open, won,
/// lost or ended by a refund, together often beyond it), sent in any order with duplicates and
/// processed at any point, end in the model's balances to the cent. proptest shrinks a failure
/// to its smallest scenario; `PROPTEST_CASES` runs more (64 by default).
#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn refunds_and_disputes_end_in_the_models_balances_whatever_their_order(pool: PgPool) {
    use proptest::test_runner::{Config, TestRunner};
    let shop = Arc::new(stepped(&pool).await);
    let cases: u32 = std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|c| c.parse().ok())
        .unwrap_or(64);
    // The runner is synchronous: it runs on a blocking thread and drives each case on this
    // test's runtime, which keeps serving the receiver meanwhile.
    let runtime = tokio::runtime::Handle::current();
    let (p, s) = (pool.clone(), shop.clone());
    let outcome = tokio::task::spawn_blocking(move || {
        let played = std::sync::atomic::AtomicUsize::new(0);
        let mut runner = TestRunner::new(Config {
            cases,
            failure_persistence: None,
            ..Config::default()
        });
        runner.run(&scenarios(), |scenario| {
            let case = played.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            runtime.block_on(play(&p, &s, case, &scenario))
        })
    })
    .await
    .unwrap();
    if let Err(e) = outcome {
        panic!("{e}");
    }
    invariants_hold(&pool).await;
}

#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn a_late_success_of_an_earlier_attempt_makes_the_new_attempts_payment_the_extra_one(
    pool: PgPool,
) {
    let shop = stepped(&pool).await;
    let seller = shop.seller_with("S", "weekly", "1.00", 14).await;
    let product = shop.product(&seller, "10.00", "BRL").await;
    let order = shop.checkout_one("k", "b", &product, 1).await;
    let n = order["number"].as_i64().unwrap();
    let first = order["payment"]["session_id"].as_str().unwrap().to_owned();
    send(&shop, "failed", &event("payment.failed", &first, json!({}))).await;
    process_all(&pool, &shop).await;
    assert_eq!(shop.order(n).await["status"], "payment_failed");
    let (status, reopened) = shop
        .post(&format!("/orders/{n}/payment"), None, json!({}))
        .await;
    assert_eq!(status, 200, "{reopened}");
    let second = reopened["payment"]["session_id"]
        .as_str()
        .unwrap()
        .to_owned();
    assert_ne!(first, second);
    // The first attempt succeeds late, then the buyer pays the second as well.
    send_paid(&shop, "late", &first, "10.00").await;
    process_all(&pool, &shop).await;
    send_paid(&shop, "second", &second, "10.00").await;
    process_all(&pool, &shop).await;
    let o = shop.order(n).await;
    assert_eq!(o["status"], "paid");
    assert_eq!(o["payment"]["session_id"].as_str(), Some(first.as_str()));
    let refunds: Vec<String> =
        sqlx::query_scalar("SELECT key FROM jobs WHERE kind = 'refund_payment'")
            .fetch_all(&pool)
            .await
            .unwrap();
    assert_eq!(refunds, vec![format!("refund_payment:internal:{second}")]);
    assert_eq!(shop.balance(&seller).await, (d("9.00"), d("0")));
}

#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn the_money_command_checks_the_ledger_and_refuses_periods_to_come(pool: PgPool) {
    let out = payfleet(&pool, &["money", "check"]).output().await.unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(String::from_utf8_lossy(&out.stdout).contains("the ledger holds"));
    let month = Utc::now().format("%Y-%m").to_string();
    refused_saying(
        &pool,
        &["money", "invoices", "--month", &month],
        "has not ended",
    )
    .await;
    refused_saying(
        &pool,
        &["money", "invoices", "--month", "2026-13"],
        "YYYY-MM",
    )
    .await;
    // A payout date to come would use up its period before its sales are made: refused, and
    // nothing paid.
    let (shop, seller, _, session) = one_sale(&pool).await;
    send_paid(&shop, "msg_paid", &session, "100.00").await;
    process_all(&pool, &shop).await;
    sales::release_matured(&pool, Utc::now() + chrono::Duration::days(15))
        .await
        .unwrap();
    // Tomorrow, in the payouts schedule's zone (UTC by default), is to come too.
    for ahead in [1, 31] {
        let date = (Utc::now() + chrono::Duration::days(ahead))
            .date_naive()
            .to_string();
        refused_saying(
            &pool,
            &["money", "payouts", "--date", &date],
            "has not come yet",
        )
        .await;
    }
    assert!(payouts::list(&pool, &seller).await.unwrap().is_empty());
}

/// `payfleet args` fails, saying `text` on its standard error.
async fn refused_saying(pool: &PgPool, args: &[&str], text: &str) {
    let out = payfleet(pool, args).output().await.unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{args:?} succeeded: {stderr}");
    assert!(stderr.contains(text), "{args:?}: {stderr}");
}

/// `payfleet money invoices` with no month invoices what the recurring job would: every ended
/// month not invoiced yet, a year back (here a sale two months ago, missed by its month's run),
/// never the month still running.
#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn the_money_command_invoices_every_ended_month_not_invoiced_yet(pool: PgPool) {
    let (shop, _, _, session) = one_sale(&pool).await;
    send_paid(&shop, "msg_paid", &session, "100.00").await;
    process_all(&pool, &shop).await;
    // The sale two months back (the ledger's rows cannot be changed but by skipping its guards).
    let mut tx = pool.begin().await.unwrap();
    sqlx::query("SET LOCAL session_replication_role = replica")
        .execute(&mut *tx)
        .await
        .unwrap();
    sqlx::query("UPDATE ledger_transfers SET created_at = created_at - interval '2 months'")
        .execute(&mut *tx)
        .await
        .unwrap();
    tx.commit().await.unwrap();
    let out = payfleet(&pool, &["money", "invoices"])
        .output()
        .await
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let invoiced: Vec<chrono::NaiveDate> =
        sqlx::query_scalar("SELECT period_start FROM invoices ORDER BY period_start")
            .fetch_all(&pool)
            .await
            .unwrap();
    let two_back: chrono::NaiveDate = sqlx::query_scalar(
        "SELECT date_trunc('month', (now() - interval '2 months') AT TIME ZONE 'UTC')::date",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(invoiced, vec![two_back]);
    // Run again: nothing more.
    let out = payfleet(&pool, &["money", "invoices"])
        .output()
        .await
        .unwrap();
    assert!(out.status.success());
    let count: i64 = sqlx::query_scalar("SELECT count(*) FROM invoices")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(count, 1);
}

// The seller's poster (ledger::poster): a payment's sale is due in the payment's transaction
// and posted in batches per seller right after.

/// `n` orders of one seller at 100.00 BRL (fee 10.00), each marked paid by hand as a payment's
/// transaction would, with its sale left due: as if every job stopped between its payment's
/// commit and its posting.
async fn sales_left_due(shop: &Shop, pool: &PgPool, seller: &str, n: usize) -> Vec<i64> {
    let product = shop.product(seller, "100.00", "BRL").await;
    let mut numbers = Vec::new();
    for i in 0..n {
        let order = shop
            .checkout_one(&format!("due-{seller}-{i}"), "buyer", &product, 1)
            .await;
        numbers.push(order["number"].as_i64().unwrap());
    }
    let mut tx = pool.begin().await.unwrap();
    sqlx::query(
        "UPDATE orders SET status = 'paid', payment_status = 'succeeded', paid_at = now() WHERE number = ANY($1)",
    )
    .bind(&numbers)
    .execute(&mut *tx)
    .await
    .unwrap();
    // The due rows a payment's transaction writes when another poster has the seller's turn.
    sqlx::query(
        "INSERT INTO ledger_sales_due (order_number, seller_id, channel)
         SELECT number, seller_id, 'internal' FROM orders WHERE number = ANY($1)",
    )
    .bind(&numbers)
    .execute(&mut *tx)
    .await
    .unwrap();
    tx.commit().await.unwrap();
    numbers
}

/// How many transactions wrote the seller's sale credits (rows of one transaction share xmin).
async fn posting_transactions(pool: &PgPool, numbers: &[i64]) -> (i64, i64) {
    sqlx::query_as(
        "SELECT count(*), count(DISTINCT xmin::text) FROM ledger_transfers
         WHERE kind = 'sale_credit' AND order_number = ANY($1)",
    )
    .bind(numbers)
    .fetch_one(pool)
    .await
    .unwrap()
}

async fn still_due(pool: &PgPool) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM ledger_sales_due")
        .fetch_one(pool)
        .await
        .unwrap()
}

#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn a_flash_sale_posts_every_sale_once_and_nothing_is_left_due(pool: PgPool) {
    let shop = stepped(&pool).await;
    let seller = shop.seller_with("Flash", "weekly", "1.00", 14).await;
    let product = shop.product(&seller, "100.00", "BRL").await;
    let mut numbers = Vec::new();
    for i in 0..30 {
        let order = shop
            .checkout_one(&format!("flash-{i}"), &format!("b{i}"), &product, 1)
            .await;
        let session = order["payment"]["session_id"].as_str().unwrap().to_owned();
        send_paid(&shop, &format!("msg_{i}"), &session, "100.00").await;
        // The same payment twice, concurrently processed with the others.
        send_paid(&shop, &format!("msg_again_{i}"), &session, "100.00").await;
        numbers.push(order["number"].as_i64().unwrap());
    }
    // Ten at once, as the workers run them: each posts its seller's sales due after its commit.
    process_all(&pool, &shop).await;
    assert_eq!(still_due(&pool).await, 0, "the jobs posted their sales");
    let (credits, _) = posting_transactions(&pool, &numbers).await;
    assert_eq!(credits, 30, "one sale credit per order");
    let fees: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM ledger_transfers WHERE kind = 'fee' AND order_number = ANY($1)",
    )
    .bind(&numbers)
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(fees, 30, "one fee per order");
    assert_eq!(shop.balance(&seller).await, (d("2700.00"), d("0")));
    invariants_hold(&pool).await;
}

#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn sales_left_due_are_posted_in_one_batch_before_a_balance_is_read(pool: PgPool) {
    let shop = stepped(&pool).await;
    let seller = shop.seller_with("Batch", "weekly", "1.00", 14).await;
    let numbers = sales_left_due(&shop, &pool, &seller, 12).await;
    assert_eq!(posting_transactions(&pool, &numbers).await, (0, 0));
    // A reader never sees a balance behind a confirmed order: it posts what is due first.
    assert_eq!(shop.balance(&seller).await, (d("1080.00"), d("0")));
    assert_eq!(
        posting_transactions(&pool, &numbers).await,
        (12, 1),
        "twelve sales, one transaction"
    );
    assert_eq!(still_due(&pool).await, 0);
    // The seller's pending entries run on from one another, in order.
    let chain: Vec<(Decimal, Decimal)> = sqlx::query_as(
        "SELECT e.balance_before, e.balance_after FROM ledger_entries e
         JOIN ledger_accounts a ON a.id = e.account_id
         WHERE a.kind = 'seller_pending' AND a.owner = $1 ORDER BY e.id",
    )
    .bind(&seller)
    .fetch_all(&pool)
    .await
    .unwrap();
    assert_eq!(chain.len(), 12, "{chain:?}");
    for (i, (before, after)) in chain.iter().enumerate() {
        assert_eq!(*before, Decimal::from(90 * i as i64));
        assert_eq!(*after, Decimal::from(90 * (i as i64 + 1)));
    }
    invariants_hold(&pool).await;
}

#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn the_sweep_posts_what_a_stopped_job_left_due(pool: PgPool) {
    let shop = stepped(&pool).await;
    let seller = shop.seller_with("Swept", "weekly", "1.00", 14).await;
    let numbers = sales_left_due(&shop, &pool, &seller, 3).await;
    let sweep = tokio::spawn(ledger::poster::sweep(
        pool.clone(),
        Duration::from_millis(50),
        Duration::ZERO,
    ));
    wait_for("the sweep to post", Duration::from_secs(30), async || {
        still_due(&pool).await == 0
    })
    .await;
    sweep.abort();
    assert_eq!(posting_transactions(&pool, &numbers).await.0, 3);
    invariants_hold(&pool).await;
}

#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn a_due_row_for_a_sale_already_posted_posts_nothing_more(pool: PgPool) {
    let (shop, seller, n, session) = one_sale(&pool).await;
    send_paid(&shop, "msg_paid", &session, "100.00").await;
    process_all(&pool, &shop).await;
    assert_eq!(shop.balance(&seller).await, (d("90.00"), d("0")));
    // A row left by a transaction that also had the sale posted another way (a refund's posts
    // its sale first): the poster finds the postings' keys taken.
    sqlx::query("INSERT INTO ledger_sales_due (order_number, seller_id, channel) VALUES ($1, $2::uuid, 'internal')")
        .bind(n)
        .bind(&seller)
        .execute(&pool)
        .await
        .unwrap();
    assert_eq!(
        ledger::poster::post_due(&pool, &seller, None)
            .await
            .unwrap(),
        1
    );
    assert_eq!(still_due(&pool).await, 0);
    assert_eq!(shop.balance(&seller).await, (d("90.00"), d("0")));
    assert_eq!(posting_transactions(&pool, &[n]).await.0, 1);
    invariants_hold(&pool).await;
}

/// A sale paid to the seller directly (Stripe Connect, Mercado Pago) is posted too (its
/// connected credit and the platform's commission, which the invoices bill): one the ledger
/// refused is reported as any other, or its commission would be missing from every invoice
/// with nothing naming the order.
#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn a_refused_sale_paid_to_the_seller_directly_is_reported(pool: PgPool) {
    let shop = stepped(&pool).await;
    let seller = shop.seller_with("Direct", "weekly", "1.00", 14).await;
    let numbers = sales_left_due(&shop, &pool, &seller, 2).await;
    for (number, gateway) in numbers.iter().zip(["stripe", "mercadopago"]) {
        sqlx::query("UPDATE orders SET gateway = $2 WHERE number = $1")
            .bind(number)
            .bind(gateway)
            .execute(&pool)
            .await
            .unwrap();
        sqlx::query("UPDATE ledger_sales_due SET channel = 'nowhere' WHERE order_number = $1")
            .bind(number)
            .execute(&pool)
            .await
            .unwrap();
    }
    ledger::poster::post_due(&pool, &seller, None)
        .await
        .unwrap();
    assert_eq!(ledger::poster::due(&pool).await.unwrap().1, 2);
    payfleet::consistency::run(&pool, Duration::ZERO)
        .await
        .unwrap();
    let mut reported: Vec<(String, bool)> = payfleet::consistency::open(&pool, 50)
        .await
        .unwrap()
        .into_iter()
        .filter(|f| f.check_name == "sale_without_credit")
        .map(|f| (f.subject, f.detail.contains("the ledger refused it")))
        .collect();
    reported.sort();
    assert_eq!(
        reported,
        numbers
            .iter()
            .map(|n| (format!("order {n}"), true))
            .collect::<Vec<_>>()
    );
}

#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn a_sale_the_ledger_refuses_is_kept_with_its_reason_and_holds_up_no_other(pool: PgPool) {
    let shop = stepped(&pool).await;
    let seller = shop.seller_with("Refused", "weekly", "1.00", 14).await;
    let numbers = sales_left_due(&shop, &pool, &seller, 3).await;
    // A row no valid order makes: a channel the ledger does not know.
    sqlx::query("UPDATE ledger_sales_due SET channel = 'nowhere' WHERE order_number = $1")
        .bind(numbers[1])
        .execute(&pool)
        .await
        .unwrap();
    ledger::poster::post_due(&pool, &seller, None)
        .await
        .unwrap();
    assert_eq!(shop.balance(&seller).await, (d("180.00"), d("0")));
    let (due, refused, _) = ledger::poster::due(&pool).await.unwrap();
    assert_eq!((due, refused), (0, 1));
    let failure: String =
        sqlx::query_scalar("SELECT failure FROM ledger_sales_due WHERE order_number = $1")
            .bind(numbers[1])
            .fetch_one(&pool)
            .await
            .unwrap();
    assert!(failure.contains("nowhere"), "{failure}");
    // Visible to an operator: the consistency check names the order and why.
    payfleet::consistency::run(&pool, Duration::ZERO)
        .await
        .unwrap();
    let findings = payfleet::consistency::open(&pool, 50).await.unwrap();
    let f = findings
        .iter()
        .find(|f| f.check_name == "sale_without_credit")
        .expect("a finding");
    assert_eq!(f.subject, format!("order {}", numbers[1]));
    assert!(f.detail.contains("refused"), "{}", f.detail);
    // Posted again by an operator (`payfleet money repost`; its event is applied already, so a
    // replay would not): before the fix it is refused again, with its reason; after it, posted.
    match ledger::poster::repost(&pool, numbers[1]).await.unwrap() {
        ledger::poster::Reposted::RefusedAgain(reason) => {
            assert!(reason.contains("nowhere"), "{reason}")
        }
        other => panic!("refused again before the fix: {other:?}"),
    }
    assert_eq!(ledger::poster::due(&pool).await.unwrap().1, 1);
    sqlx::query("UPDATE ledger_sales_due SET channel = 'internal' WHERE order_number = $1")
        .bind(numbers[1])
        .execute(&pool)
        .await
        .unwrap();
    assert_eq!(
        ledger::poster::repost(&pool, numbers[1]).await.unwrap(),
        ledger::poster::Reposted::Posted
    );
    assert_eq!(
        ledger::poster::repost(&pool, numbers[0]).await.unwrap(),
        ledger::poster::Reposted::NotRefused,
        "a sale posted is not posted again"
    );
    assert_eq!(ledger::poster::due(&pool).await.unwrap().0, 0);
    assert_eq!(
        ledger::poster::due(&pool).await.unwrap().1,
        0,
        "nothing refused is left"
    );
    assert_eq!(shop.balance(&seller).await, (d("270.00"), d("0")));
    invariants_hold(&pool).await;
}

/// Postings find (and create) their accounts in the database's posting call: transactions that
/// create the same new accounts at once, naming them in opposite orders, each find all of them
/// (created once, in one order whoever creates them, so none deadlocks on the unique index) and
/// each moves its money.
#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn postings_that_create_the_same_accounts_at_once_each_find_them(pool: PgPool) {
    let c = brl();
    let clearing = AccountRef::new(AccountKind::GatewayClearing, "internal:shared", c);
    let sellers: Vec<AccountRef> = (0..6)
        .map(|i| AccountRef::new(AccountKind::SellerPending, format!("seller-{i}"), c))
        .collect();
    let postings = 4; // below the test pool's five connections: each holds one at the barrier
    let start = Arc::new(tokio::sync::Barrier::new(postings));
    let mut tasks = Vec::new();
    for p in 0..postings {
        let (pool, start, clearing) = (pool.clone(), start.clone(), clearing.clone());
        let mut targets = sellers.clone();
        if p % 2 == 1 {
            targets.reverse();
        }
        tasks.push(tokio::spawn(async move {
            let transfers: Vec<Transfer> = targets
                .iter()
                .map(|to| Transfer {
                    source_key: format!("posting-{p}:{}", to.owner),
                    kind: TransferKind::Adjustment,
                    from: clearing.clone(),
                    to: to.clone(),
                    amount: Money::new(d("2.50"), c).unwrap(),
                    available_at: None,
                    order_number: None,
                    reference: None,
                })
                .collect();
            let mut tx = pool.begin().await.unwrap();
            start.wait().await;
            let posted = ledger::post_many(&mut tx, &transfers).await?;
            tx.commit().await?;
            Ok::<_, ledger::LedgerError>(posted)
        }));
    }
    for task in tasks {
        let posted = task.await.unwrap().unwrap();
        assert!(
            posted.iter().all(|p| matches!(p, Posted::Posted(_))),
            "{posted:?}"
        );
    }
    let accounts: i64 = sqlx::query_scalar("SELECT count(*) FROM ledger_accounts")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(
        accounts, 7,
        "one clearing account and six sellers', each once"
    );
    for seller in &sellers {
        let balance: Decimal = sqlx::query_scalar(
            "SELECT balance FROM ledger_accounts WHERE kind = 'seller_pending' AND owner = $1",
        )
        .bind(&seller.owner)
        .fetch_one(&pool)
        .await
        .unwrap();
        assert_eq!(balance, d("10.00"), "{}", seller.owner);
    }
    invariants_hold(&pool).await;
}

/// A process of the previous release, still running while the fleet is replaced, posts through
/// 0045's call with account ids, and its refusals name the account by id, as it reads them.
#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn the_previous_releases_posting_call_still_posts_and_refuses_by_id(pool: PgPool) {
    let c = brl();
    let clearing = AccountRef::new(AccountKind::GatewayClearing, "internal:old", c);
    let wallet = AccountRef::new(AccountKind::BuyerWallet, "buyer-old", c);
    let mut tx = pool.begin().await.unwrap();
    let ids = ledger::accounts(&mut tx, &[clearing, wallet])
        .await
        .unwrap();
    tx.commit().await.unwrap();
    let old_call = |key: &str, from: i64, to: i64, amount: &str| {
        sqlx::query_as::<_, (i64, String)>(
            "SELECT posted_id, posted_key FROM ledger_post($1::text[], $2::text[], $3::bigint[],
                 $4::bigint[], $5::numeric[], $6::text[], $7::timestamptz[], $8::bigint[], $9::text[], $10::bigint[])",
        )
        .bind(vec![key.to_owned()])
        .bind(vec!["adjustment"])
        .bind(vec![from])
        .bind(vec![to])
        .bind(vec![d(amount)])
        .bind(vec!["BRL"])
        .bind(vec![None::<chrono::DateTime<Utc>>])
        .bind(vec![None::<i64>])
        .bind(vec![None::<String>])
        .bind(vec![ids[1]])
    };
    let posted = old_call("old:grant", ids[0], ids[1], "5.00")
        .fetch_all(&pool)
        .await
        .unwrap();
    assert_eq!(posted.len(), 1);
    assert_eq!(posted[0].1, "old:grant");
    let refused = old_call("old:spend", ids[1], ids[0], "9.00")
        .fetch_all(&pool)
        .await
        .unwrap_err();
    let detail = match &refused {
        sqlx::Error::Database(e) => e
            .try_downcast_ref::<sqlx::postgres::PgDatabaseError>()
            .and_then(|e| e.detail())
            .map(str::to_owned),
        _ => None,
    };
    assert_eq!(detail, Some(ids[1].to_string()), "{refused:?}");
    let balance: Decimal = sqlx::query_scalar("SELECT balance FROM ledger_accounts WHERE id = $1")
        .bind(ids[1])
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(balance, d("5.00"));
    invariants_hold(&pool).await;
}

#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn a_batch_never_takes_a_wallet_below_zero_even_if_it_ends_above(pool: PgPool) {
    let c = brl();
    let issued = AccountRef::new(AccountKind::CoinsIssued, "platform", c);
    let wallet = AccountRef::new(AccountKind::BuyerWallet, "buyer-1", c);
    let spent = AccountRef::new(AccountKind::CoinsSpent, "platform", c);
    let transfer = |key: &str, from: &AccountRef, to: &AccountRef, amount: &str| Transfer {
        source_key: key.into(),
        kind: TransferKind::Adjustment,
        from: from.clone(),
        to: to.clone(),
        amount: Money::new(d(amount), c).unwrap(),
        available_at: None,
        order_number: None,
        reference: None,
    };
    let mut tx = pool.begin().await.unwrap();
    ledger::post(&mut tx, &transfer("grant", &issued, &wallet, "10.00"))
        .await
        .unwrap();
    tx.commit().await.unwrap();
    // 15 spent before 10 more arrive: the wallet would stand at -5 between the two entries.
    let mut tx = pool.begin().await.unwrap();
    let refused = ledger::post_many(
        &mut tx,
        &[
            transfer("spend", &wallet, &spent, "15.00"),
            transfer("grant-2", &issued, &wallet, "10.00"),
        ],
    )
    .await;
    assert!(
        matches!(
            refused,
            Err(ledger::LedgerError::Insufficient {
                kind: AccountKind::BuyerWallet,
                ..
            })
        ),
        "{refused:?}"
    );
    drop(tx);
    // In the other order the same batch holds.
    let mut tx = pool.begin().await.unwrap();
    ledger::post_many(
        &mut tx,
        &[
            transfer("grant-2", &issued, &wallet, "10.00"),
            transfer("spend", &wallet, &spent, "15.00"),
        ],
    )
    .await
    .unwrap();
    tx.commit().await.unwrap();
    let balance: Decimal = sqlx::query_scalar(
        "SELECT balance FROM ledger_accounts WHERE kind = 'buyer_wallet' AND owner = 'buyer-1'",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(balance, d("5.00"));
    invariants_hold(&pool).await;
}

/// The posting runs on the plan made once per connection (migration 0060), whatever the
/// number of transfers: eight calls of 1 to 30 transfers on one connection (the first five
/// would have been planned for their values, the rest on the generic plan) each post every
/// transfer with entries starting where the account's last one ended, a floor still refuses,
/// and a repeat posts nothing.
#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn a_posting_is_planned_once_and_posts_the_same_whatever_its_size(pool: PgPool) {
    let settings: Vec<(String, String)> = sqlx::query_as(
        "SELECT proname::text, array_to_string(proconfig, ',') FROM pg_proc
         WHERE proname IN ('ledger_post', 'ledger_post_ids', 'ledger_accounts_of') AND prolang <> 14
         ORDER BY proname",
    )
    .fetch_all(&pool)
    .await
    .unwrap();
    // Planned once (migration 0060), through keys whatever the tables' sizes then (0062), never
    // compiled (0065).
    let generic = "plan_cache_mode=force_generic_plan,enable_seqscan=off,jit=off".to_owned();
    assert_eq!(
        settings,
        vec![
            ("ledger_accounts_of".to_owned(), generic.clone()),
            ("ledger_post".to_owned(), generic.clone()),
            ("ledger_post_ids".to_owned(), generic),
        ],
        "the PL/pgSQL posting functions (the previous release's SQL one is left inlinable)"
    );
    let c = brl();
    let clearing = AccountRef::new(AccountKind::GatewayClearing, "internal:plans", c);
    let one = sqlx::pool::PoolOptions::<sqlx::Postgres>::new()
        .max_connections(1)
        .connect_with(pool.connect_options().as_ref().clone())
        .await
        .unwrap();
    let mut expected: HashMap<String, Decimal> = HashMap::new();
    for (call, size) in [1_usize, 2, 30, 1, 7, 30, 3, 1].into_iter().enumerate() {
        let transfers: Vec<Transfer> = (0..size)
            .map(|i| {
                let seller = format!("plans-{}", i % 7);
                *expected.entry(seller.clone()).or_default() += d("1.25");
                Transfer {
                    source_key: format!("plans:{call}:{i}"),
                    kind: TransferKind::Adjustment,
                    from: clearing.clone(),
                    to: AccountRef::new(AccountKind::SellerPending, seller, c),
                    amount: Money::new(d("1.25"), c).unwrap(),
                    available_at: None,
                    order_number: None,
                    reference: None,
                }
            })
            .collect();
        let mut tx = one.begin().await.unwrap();
        let posted = ledger::post_many(&mut tx, &transfers).await.unwrap();
        tx.commit().await.unwrap();
        assert!(
            posted.iter().all(|p| matches!(p, Posted::Posted(_))),
            "call {call}: {posted:?}"
        );
        let mut tx = one.begin().await.unwrap();
        let again = ledger::post_many(&mut tx, &transfers).await.unwrap();
        tx.commit().await.unwrap();
        assert!(
            again.iter().all(|p| *p == Posted::AlreadyPosted),
            "call {call} again: {again:?}"
        );
    }
    for (seller, balance) in &expected {
        let stored: Decimal = sqlx::query_scalar(
            "SELECT balance FROM ledger_accounts WHERE kind = 'seller_pending' AND owner = $1",
        )
        .bind(seller)
        .fetch_one(&pool)
        .await
        .unwrap();
        assert_eq!(&stored, balance, "{seller}");
    }
    // A wallet's floor, on the same connection's plans: refused, named, nothing written.
    let wallet = AccountRef::new(AccountKind::BuyerWallet, "plans-buyer", c);
    let mut tx = one.begin().await.unwrap();
    let refused = ledger::post_many(
        &mut tx,
        &[Transfer {
            source_key: "plans:overdraw".to_owned(),
            kind: TransferKind::Adjustment,
            from: wallet,
            to: clearing.clone(),
            amount: Money::new(d("0.01"), c).unwrap(),
            available_at: None,
            order_number: None,
            reference: None,
        }],
    )
    .await
    .unwrap_err();
    assert!(
        matches!(&refused, ledger::LedgerError::Insufficient { owner, .. } if owner == "plans-buyer"),
        "{refused:?}"
    );
    drop(tx);
    invariants_hold(&pool).await;
}

/// Seller `n`'s sale of 5.00 from the internal gateway's clearing, keyed `key`.
fn a_sale(key: &str, n: usize) -> Transfer {
    Transfer {
        source_key: key.into(),
        kind: TransferKind::Adjustment,
        from: AccountRef::new(AccountKind::GatewayClearing, "internal:x", brl()),
        to: AccountRef::new(AccountKind::SellerPending, format!("s{n}"), brl()),
        amount: Money::parse("5.00", "BRL").unwrap(),
        available_at: None,
        order_number: None,
        reference: None,
    }
}

/// The entries' barrier runs at the end of a posting's statement, while the posting holds its
/// accounts and every other batch of the same sellers waits: it looks at each account's entries
/// once, at the entry just below the statement's own (migration 0064). It took two looks (the
/// entry before the statement's first, then a count from it), and the balances' barrier takes
/// its own one.
#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn a_postings_barriers_look_at_each_accounts_entries_once(pool: PgPool) {
    let sales = |round: &str| -> Vec<Transfer> {
        (0..4).map(|n| a_sale(&format!("{round}-{n}"), n)).collect()
    };
    // One connection throughout, which has just reported its statistics: PostgreSQL then keeps
    // a backend's counters pending for up to a second, across transactions, so the "xact"
    // counter read after the posting can still hold the previous posting's looks. The looks
    // are the counter's growth inside the posting's own transaction, where nothing is reported.
    let mut conn = pool.acquire().await.unwrap();
    sqlx::query("SELECT 1").execute(&mut *conn).await.unwrap();
    // Entries before, for the next posting's to follow.
    let mut tx = conn.begin().await.unwrap();
    ledger::post_many(&mut tx, &sales("before")).await.unwrap();
    tx.commit().await.unwrap();
    let counted = "SELECT pg_stat_get_xact_numscans('ledger_entries_account'::regclass)";
    let mut tx = conn.begin().await.unwrap();
    let already: i64 = sqlx::query_scalar::<_, i64>(counted)
        .fetch_one(&mut *tx)
        .await
        .unwrap();
    ledger::post_many(&mut tx, &sales("looked")).await.unwrap();
    let looks: i64 = sqlx::query_scalar::<_, i64>(counted)
        .fetch_one(&mut *tx)
        .await
        .unwrap()
        - already;
    tx.rollback().await.unwrap();
    drop(conn);
    // Five accounts (the clearing account and four sellers'): one look each by the entries'
    // barrier and one by the balances'.
    assert_eq!(looks, 2 * 5);
    // The barrier still holds: the posting after them follows them.
    let mut tx = pool.begin().await.unwrap();
    ledger::post_many(&mut tx, &sales("after")).await.unwrap();
    tx.commit().await.unwrap();
    let (clearing, entries): (Decimal, i64) = sqlx::query_as(
        "SELECT (SELECT balance FROM ledger_accounts WHERE kind = 'gateway_clearing'),
                (SELECT count(*) FROM ledger_entries)",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!((clearing, entries), (d("-40.00"), 16));
}

/// Sequential scans of the ledger's tables by a few postings on a connection of their own
/// (whose statements are planned afresh, as on a new database), read from the transaction's own
/// counters before it is rolled back.
async fn ledger_scans_while_posting(pool: &PgPool, round: &str) -> i64 {
    let mut tx = pool.begin().await.unwrap();
    for i in 0..3 {
        let sales: Vec<Transfer> = (0..4)
            .map(|n| a_sale(&format!("{round}-{i}-{n}"), n))
            .collect();
        ledger::post_many(&mut tx, &sales).await.unwrap();
    }
    let scans: i64 = sqlx::query_scalar(
        "SELECT coalesce(sum(seq_scan), 0)::int8 FROM pg_stat_xact_user_tables WHERE relname LIKE 'ledger%'",
    )
    .fetch_one(&mut *tx)
    .await
    .unwrap();
    tx.rollback().await.unwrap();
    scans
}

/// A posting's statements and the ledger's barriers are planned once per connection and the
/// plans kept while the tables grow: planned on a new database's few accounts, they scanned
/// `ledger_accounts` whole, page after page of the versions every posting leaves behind. With
/// sequential scans off in their functions (migration 0062), they reach every row by key.
#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn postings_planned_on_a_new_ledger_reach_their_rows_by_key(pool: PgPool) {
    let fresh = || async {
        sqlx::postgres::PgPoolOptions::new()
            .max_connections(1)
            .connect_with((*pool.connect_options()).clone())
            .await
            .unwrap()
    };
    assert_eq!(ledger_scans_while_posting(&fresh().await, "keyed").await, 0);
    // The hazard, with the functions' setting taken away.
    sqlx::raw_sql(
        "ALTER FUNCTION ledger_post(text[], text[], bpchar[], int[], text[], text[], int[], int[], numeric[],
                                    text[], timestamptz[], bigint[], text[]) RESET enable_seqscan;
         ALTER FUNCTION ledger_post_ids(text[], text[], bigint[], bigint[], numeric[], text[], timestamptz[],
                                        bigint[], text[], bigint[], bigint[]) RESET enable_seqscan;
         ALTER FUNCTION ledger_accounts_of(text[], text[], bpchar[]) RESET enable_seqscan;
         ALTER FUNCTION ledger_entries_hold() RESET enable_seqscan;
         ALTER FUNCTION ledger_transfers_have_entries() RESET enable_seqscan;
         ALTER FUNCTION ledger_accounts_hold() RESET enable_seqscan;",
    )
    .execute(&pool)
    .await
    .unwrap();
    assert!(ledger_scans_while_posting(&fresh().await, "scanning").await > 0);
}

/// Coins still reserved for an order that no longer waits for them, their `settle_coins` job
/// having ended dead (and deleted a week later): each is the `coin_reservation_unsettled`
/// finding, saying which step it needs, and `payfleet money settle-coins` takes that step, read
/// from the order (spent when it was paid with them, else given back). One whose order still
/// waits for it is left alone.
#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn coins_left_reserved_by_a_dead_job_are_found_and_settled_by_an_operator(pool: PgPool) {
    use payfleet::orders::coin_payment::{SettleAgainError, settle_again};
    let app = spawn_app(pool.clone()).await;
    orders_for(
        &pool,
        "internal",
        &["s_paid", "s_expired", "s_waiting"],
        "10.00",
        "BRL",
    )
    .await;
    coins::grant(&pool, "buyer", Money::parse("50.00", "BRL").unwrap(), "g1")
        .await
        .unwrap();
    for (id, number) in [("res_paid", 1), ("res_expired", 2), ("res_waiting", 3)] {
        coins::reserve(
            &pool,
            id,
            "buyer",
            Money::parse("10.00", "BRL").unwrap(),
            Some(number),
        )
        .await
        .unwrap();
    }
    sqlx::raw_sql(
        "UPDATE orders SET coin_reservation = 'res_paid', status = 'paid', payment_status = 'succeeded',
                paid_at = now(), paid_with_coins = true WHERE number = 1;
         UPDATE orders SET coin_reservation = 'res_expired', status = 'expired', expired_at = now() WHERE number = 2;
         UPDATE orders SET coin_reservation = 'res_waiting' WHERE number = 3",
    )
    .execute(&pool)
    .await
    .unwrap();
    let found = findings_of(&pool, "coin_reservation_unsettled").await;
    assert_eq!(found.len(), 2, "{found:?}");
    assert!(found.iter().any(|(s, d)| s.contains("res_paid")
        && d.contains("payfleet money settle-coins res_paid spends")));
    assert!(found.iter().any(|(s, d)| s.contains("res_expired")
        && d.contains("payfleet money settle-coins res_expired gives back")));
    match settle_again(&pool, "res_waiting").await {
        Err(SettleAgainError::StillWaiting { number: 3, .. }) => {}
        other => panic!("its order still waits for it: {other:?}"),
    }
    match settle_again(&pool, "res_none").await {
        Err(SettleAgainError::NotReserved(_)) => {}
        other => panic!("{other:?}"),
    }
    assert!(settle_again(&pool, "res_paid").await.unwrap(), "spent");
    assert!(
        !settle_again(&pool, "res_expired").await.unwrap(),
        "given back"
    );
    match settle_again(&pool, "res_expired").await {
        Err(SettleAgainError::UnderWay(_)) => {}
        other => panic!("asked twice: {other:?}"),
    }
    assert!(
        findings_of(&pool, "coin_reservation_unsettled")
            .await
            .is_empty(),
        "while their settling is under way, no finding"
    );
    step(&pool, &app.config, "orders").await;
    let states: Vec<(String, String)> =
        sqlx::query_as("SELECT id, state FROM coin_reservations ORDER BY id")
            .fetch_all(&pool)
            .await
            .unwrap();
    assert_eq!(
        states,
        vec![
            ("res_expired".to_owned(), "released".to_owned()),
            ("res_paid".to_owned(), "approved".to_owned()),
            ("res_waiting".to_owned(), "reserved".to_owned()),
        ]
    );
    assert!(
        findings_of(&pool, "coin_reservation_unsettled")
            .await
            .is_empty()
    );
    let wallet = coins::wallet_of(&pool, "buyer", brl()).await.unwrap();
    assert_eq!(
        (wallet.balance.as_str(), wallet.reserved.as_str()),
        ("30.00", "10.00"),
        "{wallet:?}"
    );
}

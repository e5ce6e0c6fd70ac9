//! Subscriptions: a paid subscription order starts one, once, whichever way it is paid.

use std::time::Duration;

use serde_json::{Value, json};
use sqlx::PgPool;

use crate::checkout::shop;
use crate::helpers::*;

/// A subscription product of `seller` at 19.90 BRL a month, bought with a 10 % coupon on the
/// internal gateway; returns the subscription order.
async fn subscription_order(shop: &crate::checkout::Shop, seller: &str) -> Value {
    let club = shop
        .admin(
            "/admin/products",
            json!({"seller_id": seller, "name": "club", "kind": "subscription", "price": "19.90", "currency": "BRL", "interval": "month"}),
        )
        .await;
    shop.admin(
        "/admin/coupons",
        json!({"code": "FIRSTMONTH", "percent_off": "10", "seller_id": seller}),
    )
    .await;
    let (status, answer) = shop
        .checkout(
            Some("sub-1"),
            json!({"buyer_id": "buyer-9", "gateway": "internal", "coupon": "firstmonth",
                   "items": [{"product_id": club["id"], "quantity": 1}]}),
        )
        .await;
    assert_eq!(status, 201, "{answer}");
    let order = answer["orders"][0].clone();
    assert_eq!(order["kind"], "subscription");
    assert_eq!(
        order["subscription_id"],
        Value::Null,
        "not paid yet: {order}"
    );
    order
}

/// A subscription order of `seller`'s paid on the internal gateway's page: its subscription's id.
async fn paid_subscription(shop: &crate::checkout::Shop, seller: &str) -> String {
    let order = subscription_order(shop, seller).await;
    subscription_paid(shop, &order).await
}

/// Subscription order `order` paid on the internal gateway's page: its subscription's id.
async fn subscription_paid(shop: &crate::checkout::Shop, order: &Value) -> String {
    let number = order["number"].as_i64().unwrap();
    assert_eq!(
        shop.app
            .pay(order["payment"]["url"].as_str().unwrap(), "succeeded")
            .await
            .0,
        200
    );
    wait_for("the subscription", Duration::from_secs(30), async || {
        shop.order(number).await["subscription_id"].is_string()
    })
    .await;
    shop.order(number).await["subscription_id"]
        .as_str()
        .unwrap()
        .to_owned()
}

async fn subscriptions(pool: &PgPool) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM subscriptions")
        .fetch_one(pool)
        .await
        .unwrap()
}

#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn a_paid_subscription_order_starts_one_subscription_for_its_period(pool: PgPool) {
    let shop = shop(pool.clone()).await;
    let seller = shop.seller("Club House").await;
    let order = subscription_order(&shop, &seller).await;
    let number = order["number"].as_i64().unwrap();
    let url = order["payment"]["url"].as_str().unwrap();
    let (paid, page) = shop.app.pay(url, "succeeded").await;
    assert_eq!(paid, 200, "{page}");
    wait_for("the order paid", Duration::from_secs(30), async || {
        shop.order(number).await["status"] == "paid"
    })
    .await;
    let order = shop.order(number).await;
    let id = order["subscription_id"]
        .as_str()
        .expect("the order names its subscription");
    let (status, body) = shop.app.get(&format!("/subscriptions/{id}")).await;
    assert_eq!(status, 200, "{body}");
    let sub: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(sub["order_number"], number);
    assert_eq!(sub["seller_id"], seller);
    assert_eq!(sub["buyer_id"], "buyer-9");
    assert_eq!(sub["product_id"], order["items"][0]["product_id"]);
    assert_eq!(sub["status"], "active");
    assert_eq!(sub["interval"], "month");
    assert_eq!(sub["gateway"], "internal");
    // The coupon took 10 % off the first period only: each renewal charges the list price.
    assert_eq!(order["total"], "17.91");
    assert_eq!(
        (sub["amount"].as_str(), sub["currency"].as_str()),
        (Some("19.90"), Some("BRL"))
    );
    assert_eq!(sub["cancel_at_period_end"], false);
    assert_eq!(sub["canceled_at"], Value::Null);
    // Its first period starts when the order was paid and lasts its interval.
    let at = |v: &Value| chrono::DateTime::parse_from_rfc3339(v.as_str().unwrap()).unwrap();
    let start = at(&sub["current_period_start"]);
    assert_eq!(start, at(&order["paid_at"]));
    assert_eq!(
        at(&sub["current_period_end"]),
        start.checked_add_months(chrono::Months::new(1)).unwrap()
    );

    // The same payment reported again, as a resend under another event id, starts nothing
    // more.
    let body: Value = sqlx::query_scalar(
        "SELECT body FROM internal_events WHERE body->>'type' = 'payment.succeeded'",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    let (status, _) = shop
        .app
        .deliver(&internal("resent-1", &body.to_string()))
        .await;
    assert_eq!(status, 200);
    process_events(&pool).await;
    assert_eq!(subscriptions(&pool).await, 1);
    assert_eq!(shop.order(number).await["subscription_id"], id);
}

#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn one_off_orders_and_unpaid_ones_start_none(pool: PgPool) {
    let shop = shop(pool.clone()).await;
    let seller = shop.seller("A").await;
    let one_off = shop.product(&seller, "10.00", "BRL").await;
    let (status, answer) = shop
        .checkout(
            Some("one-off"),
            json!({"buyer_id": "b", "gateway": "internal", "items": [{"product_id": one_off, "quantity": 1}]}),
        )
        .await;
    assert_eq!(status, 201, "{answer}");
    let number = answer["orders"][0]["number"].as_i64().unwrap();
    let url = answer["orders"][0]["payment"]["url"].as_str().unwrap();
    assert_eq!(shop.app.pay(url, "succeeded").await.0, 200);
    // A subscription order whose payment fails starts nothing either.
    let failing = subscription_order(&shop, &seller).await;
    let failing_number = failing["number"].as_i64().unwrap();
    let failing_url = failing["payment"]["url"].as_str().unwrap();
    assert_eq!(shop.app.pay(failing_url, "failed").await.0, 200);
    wait_for("both settled", Duration::from_secs(30), async || {
        shop.order(number).await["status"] == "paid"
            && shop.order(failing_number).await["status"] == "payment_failed"
    })
    .await;
    assert_eq!(shop.order(number).await["subscription_id"], Value::Null);
    assert_eq!(
        shop.order(failing_number).await["subscription_id"],
        Value::Null
    );
    assert_eq!(subscriptions(&pool).await, 0);
}

#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn a_subscription_is_read_by_its_sellers_keys_and_the_backend_only(pool: PgPool) {
    let shop = shop(pool.clone()).await;
    let seller = shop.seller("Mine").await;
    let other = shop.seller("Theirs").await;
    let id = paid_subscription(&shop, &seller).await;
    let path = format!("http://{}/subscriptions/{id}", shop.app.addr);
    let status = |c: reqwest::Client, path: String| async move {
        c.get(path).send().await.unwrap().status().as_u16()
    };
    let own = backend_client(&api_key(&pool, Some(&seller)).await);
    let theirs = backend_client(&api_key(&pool, Some(&other)).await);
    assert_eq!(status(own, path.clone()).await, 200);
    // Another seller's key, an unknown id and a malformed one cannot be told apart.
    assert_eq!(status(theirs, path.clone()).await, 404);
    let unknown = format!(
        "http://{}/subscriptions/{}",
        shop.app.addr,
        uuid::Uuid::from_u128(rand::random())
    );
    assert_eq!(status(shop.app.http.clone(), unknown).await, 404);
    let malformed = format!("http://{}/subscriptions/1%27%20OR%201=1", shop.app.addr);
    let resp = shop.app.http.get(malformed).send().await.unwrap();
    assert_eq!(resp.status(), 404);
    let body: Value = resp.json().await.unwrap();
    assert_eq!(body["error"]["code"], "not_found", "{body}");
    // No credential at all: 401.
    assert_eq!(status(shop.app.anon.clone(), path).await, 401);
}

/// A fleet whose internal-gateway subscriptions renew every `period`, a paid subscription on
/// it, and that subscription's id. Its first period is moved `back` into the past, as if that
/// much time had passed.
async fn renewing(
    pool: &PgPool,
    period: Duration,
    back: Duration,
) -> (
    crate::checkout::Shop,
    payfleet::payments::renewals::Biller,
    String,
    String,
) {
    let mut config = test_config();
    config.orders.subscription_period = Some(period);
    let shop = crate::checkout::Shop {
        app: std::sync::Arc::new(spawn_fleet(pool.clone(), config.clone()).await),
    };
    let seller = shop.seller("Club House").await;
    let id = paid_subscription(&shop, &seller).await;
    sqlx::query(
        "UPDATE subscriptions SET current_period_start = current_period_start - make_interval(secs => $1),
             current_period_end = current_period_end - make_interval(secs => $1)",
    )
    .bind(back.as_secs_f64())
    .execute(pool)
    .await
    .unwrap();
    let (gateways, hosted) = payfleet::startup::gateways(&config, pool).unwrap();
    let biller = payfleet::startup::biller(&config, pool, &gateways, &hosted);
    (shop, biller, seller, id)
}

/// Monthly periods are counted from the first one's start, not each from the last end: one
/// started on the 31st ends on the last day of each shorter month and on the 31st of the others,
/// never drifting to the 28th for good.
#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn monthly_periods_started_on_the_31st_end_on_the_31st_or_the_months_last_day(pool: PgPool) {
    use chrono::{Datelike, TimeZone, Utc};
    let config = test_config();
    let shop = crate::checkout::Shop {
        app: std::sync::Arc::new(spawn_fleet(pool.clone(), config.clone()).await),
    };
    let seller = shop.seller("Club House").await;
    paid_subscription(&shop, &seller).await;
    // As if paid on 31 January of last year, its first period ending on 28 February.
    let start = Utc
        .with_ymd_and_hms(Utc::now().year() - 1, 1, 31, 12, 0, 0)
        .unwrap();
    sqlx::query(
        "UPDATE orders SET paid_at = $1 WHERE number = (SELECT order_number FROM subscriptions)",
    )
    .bind(start)
    .execute(&pool)
    .await
    .unwrap();
    sqlx::query(
        "UPDATE subscriptions SET current_period_start = $1, current_period_end = $1 + interval '1 month'",
    )
    .bind(start)
    .execute(&pool)
    .await
    .unwrap();
    let (gateways, hosted) = payfleet::startup::gateways(&config, &pool).unwrap();
    let billing = payfleet::startup::biller(&config, &pool, &gateways, &hosted).billing;
    let open_due = |limit: i64| {
        payfleet::orders::subscriptions::open_due(
            &pool,
            payfleet::gateways::GatewayName::Internal,
            &billing,
            limit,
        )
    };
    // Every missed period opened (the fleet's own billing passes may open some of them).
    wait_for("caught up", Duration::from_secs(60), async || {
        open_due(5).await.unwrap();
        sqlx::query_scalar::<_, bool>("SELECT current_period_end > now() FROM subscriptions")
            .fetch_one(&pool)
            .await
            .unwrap()
    })
    .await;
    let periods: Vec<(chrono::DateTime<Utc>, chrono::DateTime<Utc>)> = sqlx::query_as(
        "SELECT period_start, period_end FROM orders WHERE renews IS NOT NULL ORDER BY period_start",
    )
    .fetch_all(&pool)
    .await
    .unwrap();
    // From 28 February of last year to the period that holds now.
    assert!(periods.len() >= 11, "{} renewals", periods.len());
    assert_eq!(periods[0].0, start + chrono::Months::new(1));
    for (i, (begins, ends)) in periods.iter().enumerate() {
        let months = i as u32 + 2;
        let expected = start + chrono::Months::new(months);
        assert_eq!(*ends, expected, "period {i} ends on its month's day");
        let last_day = (expected + chrono::Days::new(1)).month() != expected.month();
        assert!(
            expected.day() == 31 || last_day,
            "{expected} is the 31st or its month's last day"
        );
        if i > 0 {
            assert_eq!(*begins, periods[i - 1].1);
        }
    }
    // A period off that calendar (moved by hand, or by the arithmetic before it) goes on one
    // interval from its end: never a short period at the full price.
    let off = chrono::SubsecRound::trunc_subsecs(
        Utc::now() - chrono::Duration::days(2) - chrono::Duration::seconds(17),
        6,
    );
    sqlx::query(
        "UPDATE subscriptions SET current_period_start = $1 - interval '1 month', current_period_end = $1",
    )
    .bind(off)
    .execute(&pool)
    .await
    .unwrap();
    open_due(1).await.unwrap();
    let (start, end): (chrono::DateTime<Utc>, chrono::DateTime<Utc>) =
        sqlx::query_as("SELECT current_period_start, current_period_end FROM subscriptions")
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!((start, end), (off, off + chrono::Months::new(1)));
}

/// The internal gateway's `subscription.canceled` ends the subscription it names (by the
/// fleet's own id), as a cancellation here does: nothing is billed after it.
#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn the_internal_gateways_cancellation_event_ends_its_subscription(pool: PgPool) {
    let shop = shop(pool.clone()).await;
    let seller = shop.seller("Club House").await;
    let id = paid_subscription(&shop, &seller).await;
    // A second subscription to the same product, which stays.
    let club: String = sqlx::query_scalar("SELECT id::text FROM products WHERE name = 'club'")
        .fetch_one(&pool)
        .await
        .unwrap();
    let (status, answer) = shop
        .checkout(
            Some("sub-2"),
            json!({"buyer_id": "buyer-10", "gateway": "internal",
                   "items": [{"product_id": club, "quantity": 1}]}),
        )
        .await;
    assert_eq!(status, 201, "{answer}");
    let other = subscription_paid(&shop, &answer["orders"][0]).await;
    let body =
        json!({"type": "subscription.canceled", "data": {"subscription_id": id}}).to_string();
    let (status, answer) = shop.app.deliver(&internal("cancel-1", &body)).await;
    assert_eq!(status, 200, "{answer}");
    wait_for("canceled", Duration::from_secs(30), async || {
        subscription(&shop, &id).await["status"] == "canceled"
    })
    .await;
    assert!(subscription(&shop, &id).await["canceled_at"].is_string());
    assert_eq!(
        subscription(&shop, &other).await["status"],
        "active",
        "only the one it names"
    );
    // A second delivery of it (another event id) changes nothing; one naming no subscription
    // here is recorded and ignored.
    let unknown = json!({"type": "subscription.canceled",
                         "data": {"subscription_id": "00000000-0000-0000-0000-000000000000"}})
    .to_string();
    for (event, body) in [("cancel-2", &body), ("cancel-3", &unknown)] {
        assert_eq!(shop.app.deliver(&internal(event, body)).await.0, 200);
    }
    wait_for("processed", Duration::from_secs(30), async || {
        sqlx::query_scalar::<_, i64>(
            "SELECT count(*) FROM payment_events WHERE event_id IN ('cancel-1', 'cancel-2', 'cancel-3') AND outcome IS NOT NULL",
        )
        .fetch_one(&pool)
        .await
        .unwrap()
            == 3
    })
    .await;
    let outcomes: Vec<(String, String)> = sqlx::query_as(
        "SELECT event_id, outcome FROM payment_events WHERE event_id LIKE 'cancel-%' ORDER BY event_id",
    )
    .fetch_all(&pool)
    .await
    .unwrap();
    assert_eq!(
        outcomes,
        [
            ("cancel-1", "applied"),
            ("cancel-2", "ignored"),
            ("cancel-3", "ignored")
        ]
        .map(|(e, o)| (e.to_owned(), o.to_owned()))
    );
    assert_eq!(subscription(&shop, &other).await["status"], "active");
}

/// How the simulator answers the subscription's renewals, set as an operator does: the status.
async fn simulate(shop: &crate::checkout::Shop, id: &str, renewals: &str) -> u16 {
    let (status, _) = shop
        .post(
            &format!("/admin/subscriptions/{id}/simulate"),
            Some(ADMIN_TOKEN),
            json!({"renewals": renewals}),
        )
        .await;
    status
}

async fn subscription(shop: &crate::checkout::Shop, id: &str) -> Value {
    let (status, body) = shop.app.get(&format!("/subscriptions/{id}")).await;
    assert_eq!(status, 200, "{body}");
    serde_json::from_str(&body).unwrap()
}

/// The sales the ledger posted for the subscription's renewals, by order number.
async fn renewal_sales(pool: &PgPool) -> Vec<(i64, i64)> {
    sqlx::query_as(
        "SELECT o.number, (SELECT count(*) FROM ledger_transfers t WHERE t.source_key = 'sale:' || o.number)
         FROM orders o WHERE o.renews IS NOT NULL ORDER BY o.number",
    )
    .fetch_all(pool)
    .await
    .unwrap()
}

#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn each_period_is_billed_once_and_is_one_sale_whatever_runs_it(pool: PgPool) {
    // Three periods of 30 s missed (the fleet was down): one more each pass.
    let (shop, biller, seller, id) =
        renewing(&pool, Duration::from_secs(30), Duration::from_secs(95)).await;
    let bill = || payfleet::payments::renewals::bill(&pool, &biller);
    // Three workers' passes at once, then more until nothing is due: each missed period is
    // opened once (a pass opens one period per subscription; the passes serialise on it).
    let (a, b, c) = tokio::join!(bill(), bill(), bill());
    let mut opened: usize = [a, b, c].into_iter().map(|r| r.unwrap().opened).sum();
    for _ in 0..5 {
        opened += bill().await.unwrap().opened;
    }
    assert_eq!(opened, 3);
    wait_for("three renewals paid", Duration::from_secs(60), async || {
        let sub = subscription(&shop, &id).await;
        sub["renewals"].as_array().unwrap().len() == 3
            && sub["renewals"]
                .as_array()
                .unwrap()
                .iter()
                .all(|r| r["state"] == "paid")
    })
    .await;
    let sub = subscription(&shop, &id).await;
    assert_eq!(sub["status"], "active");
    let renewals = sub["renewals"].as_array().unwrap();
    // Consecutive periods of 30 s, the last one the subscription's current period.
    for pair in renewals.windows(2) {
        assert_eq!(pair[0]["period_end"], pair[1]["period_start"]);
    }
    assert_eq!(renewals[2]["period_start"], sub["current_period_start"]);
    assert_eq!(renewals[2]["period_end"], sub["current_period_end"]);
    for r in renewals {
        // The list price: the first period's coupon does not renew.
        assert_eq!(
            (r["amount"].as_str(), r["currency"].as_str()),
            (Some("19.90"), Some("BRL"))
        );
        let order = shop.order(r["order_number"].as_i64().unwrap()).await;
        assert_eq!(order["status"], "paid");
        assert_eq!(order["seller_id"], seller);
        assert_eq!(
            (order["platform_fee"].as_str(), order["seller_net"].as_str()),
            (Some("1.99"), Some("17.91"))
        );
        assert_eq!(
            order["subscription_id"],
            Value::Null,
            "a renewal starts no subscription"
        );
    }
    // Every renewal's event delivered again (a gateway's resend) moves no more money.
    let bodies: Vec<Value> = sqlx::query_scalar(
        "SELECT body FROM internal_events WHERE body->>'type' = 'subscription.renewed'",
    )
    .fetch_all(&pool)
    .await
    .unwrap();
    assert_eq!(bodies.len(), 3);
    for (i, body) in bodies.iter().enumerate() {
        assert_eq!(body["data"]["subscription_id"], id.as_str());
        let (status, _) = shop
            .app
            .deliver(&internal(&format!("resend-{i}"), &body.to_string()))
            .await;
        assert_eq!(status, 200);
    }
    process_events(&pool).await;
    let sales = renewal_sales(&pool).await;
    assert_eq!(sales.len(), 3);
    assert!(
        sales.iter().all(|(_, n)| *n == 1),
        "one sale per renewal: {sales:?}"
    );
    assert_eq!(subscriptions(&pool).await, 1);
    // The month's commission invoice has a line per renewal, at its fee.
    let month = chrono::Datelike::with_day(&chrono::Utc::now().date_naive(), 1).unwrap();
    let next = month.checked_add_months(chrono::Months::new(1)).unwrap();
    let numbers = payfleet::ledger::invoices::run(&pool, month, next, chrono_tz::UTC)
        .await
        .unwrap();
    let lines: Vec<(i64, String)> = sqlx::query_as(
        "SELECT l.order_number, l.commission::text FROM invoice_lines l
         JOIN invoices i ON i.id = l.invoice_id WHERE i.number = ANY($1) AND l.order_number = ANY($2)
         ORDER BY l.order_number",
    )
    .bind(&numbers)
    .bind(sales.iter().map(|(n, _)| *n).collect::<Vec<_>>())
    .fetch_all(&pool)
    .await
    .unwrap();
    assert_eq!(
        lines,
        sales
            .iter()
            .map(|(n, _)| (*n, "1.9900".to_owned()))
            .collect::<Vec<_>>()
    );
    // The checkout's answer, asked again with its key, is still its one order.
    let first = shop.order(sub["order_number"].as_i64().unwrap()).await;
    let (status, answer) = shop
        .checkout(
            Some("sub-1"),
            json!({"buyer_id": "buyer-9", "gateway": "internal", "coupon": "firstmonth",
                   "items": [{"product_id": first["items"][0]["product_id"], "quantity": 1}]}),
        )
        .await;
    assert_eq!(status, 201, "{answer}");
    assert_eq!(answer["orders"].as_array().unwrap().len(), 1, "{answer}");
    assert_eq!(answer["orders"][0]["number"], sub["order_number"]);
}

#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn a_failed_renewal_is_past_due_and_moves_no_money_until_a_retry_succeeds(pool: PgPool) {
    let (shop, biller, _seller, id) =
        renewing(&pool, Duration::from_secs(600), Duration::from_secs(601)).await;
    assert_eq!(simulate(&shop, &id, "fail").await, 200);
    assert_eq!(simulate(&shop, &id, "maybe").await, 422);
    let report = payfleet::payments::renewals::bill(&pool, &biller)
        .await
        .unwrap();
    assert_eq!((report.opened, report.charged), (1, 1));
    wait_for("past due", Duration::from_secs(30), async || {
        subscription(&shop, &id).await["status"] == "past_due"
    })
    .await;
    let sub = subscription(&shop, &id).await;
    assert_eq!(sub["renewals"][0]["state"], "failed");
    assert!(
        renewal_sales(&pool).await.iter().all(|(_, n)| *n == 0),
        "a failed renewal moves no money"
    );
    // The buyer cannot open a second way to pay it: the billing's retry is its one payment.
    let failed = sub["renewals"][0]["order_number"].as_i64().unwrap();
    let (status, body) = shop
        .post(&format!("/orders/{failed}/payment"), None, json!({}))
        .await;
    assert_eq!(
        (status, body["error"]["code"].as_str()),
        (409, Some("renewal_not_reopenable")),
        "{body}"
    );
    // A past-due subscription is not renewed further; its renewal is retried, on a new session.
    assert_eq!(simulate(&shop, &id, "succeed").await, 200);
    let report = payfleet::payments::renewals::bill(&pool, &biller)
        .await
        .unwrap();
    assert_eq!((report.opened, report.charged), (0, 1));
    wait_for("active again", Duration::from_secs(30), async || {
        subscription(&shop, &id).await["status"] == "active"
    })
    .await;
    let sub = subscription(&shop, &id).await;
    assert_eq!(sub["renewals"].as_array().unwrap().len(), 1);
    assert_eq!(sub["renewals"][0]["state"], "paid");
    let number = sub["renewals"][0]["order_number"].as_i64().unwrap();
    assert_eq!(shop.order(number).await["payment_attempt"], 2);
    assert_eq!(renewal_sales(&pool).await, vec![(number, 1)]);
}

#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn a_renewal_that_keeps_failing_cancels_the_subscription(pool: PgPool) {
    let (shop, biller, _seller, id) =
        renewing(&pool, Duration::from_secs(600), Duration::from_secs(601)).await;
    assert_eq!(simulate(&shop, &id, "fail").await, 200);
    let attempts = payfleet::orders::subscriptions::MAX_RENEWAL_ATTEMPTS;
    for attempt in 1..=attempts {
        payfleet::payments::renewals::bill(&pool, &biller)
            .await
            .unwrap();
        wait_for("the attempt failed", Duration::from_secs(30), async || {
            let sub = subscription(&shop, &id).await;
            let renewal = &sub["renewals"][0];
            renewal["state"] == "failed"
                && shop.order(renewal["order_number"].as_i64().unwrap()).await["payment_attempt"]
                    == attempt
        })
        .await;
    }
    // The expiry jobs held: the renewal must end in the cancellation's own transaction, so a
    // charge landing after it is a late payment, not a sale of a canceled subscription.
    payfleet_queue::admin::pause(&pool, "orders").await.unwrap();
    // The workers read the pauses twice a second.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let report = payfleet::payments::renewals::bill(&pool, &biller)
        .await
        .unwrap();
    assert_eq!((report.canceled, report.charged, report.opened), (1, 0, 0));
    let sub = subscription(&shop, &id).await;
    assert_eq!(sub["status"], "canceled");
    assert!(sub["canceled_at"].is_string());
    let renewal = sub["renewals"][0]["order_number"].as_i64().unwrap();
    assert_eq!(shop.order(renewal).await["status"], "expired");
    payfleet_queue::admin::resume(&pool, "orders")
        .await
        .unwrap();
    // Nothing is charged after it.
    let report = payfleet::payments::renewals::bill(&pool, &biller)
        .await
        .unwrap();
    assert_eq!(report, Default::default());
    assert!(renewal_sales(&pool).await.iter().all(|(_, n)| *n == 0));
}

pub async fn cancel(shop: &crate::checkout::Shop, id: &str, body: Value) -> (u16, Value) {
    let resp = shop
        .app
        .http
        .post(format!(
            "http://{}/subscriptions/{id}/cancel",
            shop.app.addr
        ))
        .json(&body)
        .send()
        .await
        .unwrap();
    let status = resp.status().as_u16();
    (status, resp.json().await.unwrap_or(Value::Null))
}

/// The order messages of the subscription's first order, by kind, in order.
pub async fn steps(pool: &PgPool, order_number: i64) -> Vec<String> {
    sqlx::query_scalar(
        "SELECT e.kind FROM order_events e JOIN orders o ON o.id = e.order_id
         WHERE o.number = $1 AND e.kind IN ('past_due', 'reactivated', 'canceled') ORDER BY e.id",
    )
    .bind(order_number)
    .fetch_all(pool)
    .await
    .unwrap()
}

#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn cancelled_at_its_periods_end_a_subscription_is_charged_no_more(pool: PgPool) {
    // Its period ends in 2 s.
    let (shop, biller, seller, id) =
        renewing(&pool, Duration::from_secs(60), Duration::from_secs(58)).await;
    // A key bound to the seller acts for no buyer.
    let sellers = backend_client(&api_key(&pool, Some(&seller)).await);
    let resp = sellers
        .post(format!(
            "http://{}/subscriptions/{id}/cancel",
            shop.app.addr
        ))
        .json(&json!({"at_period_end": true}))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 403);
    let (status, sub) = cancel(&shop, &id, json!({"at_period_end": true})).await;
    assert_eq!(status, 200, "{sub}");
    assert_eq!(
        (
            sub["status"].as_str(),
            sub["cancel_at_period_end"].as_bool()
        ),
        (Some("active"), Some(true))
    );
    // Asked again: the same.
    assert_eq!(
        cancel(&shop, &id, json!({"at_period_end": true})).await,
        (200, sub.clone())
    );
    let (status, body) = cancel(&shop, &id, json!({"at_period_end": "yes"})).await;
    assert_eq!(
        (status, body["error"]["code"].as_str()),
        (422, Some("invalid_request")),
        "{body}"
    );
    // Until its period ends, nothing happens; then it ends instead of renewing.
    let report = payfleet::payments::renewals::bill(&pool, &biller)
        .await
        .unwrap();
    assert_eq!(report, Default::default());
    tokio::time::sleep(Duration::from_millis(2100)).await;
    let report = payfleet::payments::renewals::bill(&pool, &biller)
        .await
        .unwrap();
    assert_eq!((report.canceled, report.opened, report.charged), (1, 0, 0));
    let sub = subscription(&shop, &id).await;
    assert_eq!(sub["status"], "canceled");
    assert_eq!(sub["canceled_at"], sub["current_period_end"]);
    assert_eq!(sub["renewals"], json!([]));
    let first = sub["order_number"].as_i64().unwrap();
    assert_eq!(steps(&pool, first).await, ["canceled"]);
    // Nothing is charged after it, whatever runs.
    assert_eq!(
        payfleet::payments::renewals::bill(&pool, &biller)
            .await
            .unwrap(),
        Default::default()
    );
}

#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn cancelled_now_a_past_due_subscription_ends_and_its_unpaid_renewal_expires(pool: PgPool) {
    let (shop, biller, _seller, id) =
        renewing(&pool, Duration::from_secs(600), Duration::from_secs(601)).await;
    assert_eq!(simulate(&shop, &id, "fail").await, 200);
    payfleet::payments::renewals::bill(&pool, &biller)
        .await
        .unwrap();
    wait_for("past due", Duration::from_secs(30), async || {
        subscription(&shop, &id).await["status"] == "past_due"
    })
    .await;
    let (status, sub) = cancel(&shop, &id, json!({})).await;
    assert_eq!(status, 200, "{sub}");
    assert_eq!(sub["status"], "canceled");
    assert!(sub["canceled_at"].is_string());
    let renewal = sub["renewals"][0]["order_number"].as_i64().unwrap();
    wait_for("the renewal expired", Duration::from_secs(30), async || {
        shop.order(renewal).await["status"] == "expired"
    })
    .await;
    // Its steps went out as order messages of its first order, once each.
    let first = sub["order_number"].as_i64().unwrap();
    assert_eq!(steps(&pool, first).await, ["past_due", "canceled"]);
    assert_eq!(
        payfleet::payments::renewals::bill(&pool, &biller)
            .await
            .unwrap(),
        Default::default()
    );
    // A subscription a gateway bills is not cancelled here behind its back.
    sqlx::query(
        "UPDATE subscriptions SET gateway = 'stripe', status = 'active', canceled_at = NULL",
    )
    .execute(&pool)
    .await
    .unwrap();
    let (status, body) = cancel(&shop, &id, json!({})).await;
    assert_eq!(
        (status, body["error"]["code"].as_str()),
        (409, Some("cancel_not_supported")),
        "{body}"
    );
}

/// A live subscription a day past its period's end, with nothing reported since (a gateway's
/// invoice or cancellation event lost, or the fleet's billing stuck), is a consistency
/// finding; a canceled one, or one within its period, is not.
#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn a_subscription_a_day_past_its_period_with_nothing_reported_is_a_finding(pool: PgPool) {
    let shop = shop(pool.clone()).await;
    let seller = shop.seller("Club House").await;
    let id = paid_subscription(&shop, &seller).await;
    let overdue = async || -> Vec<String> {
        findings_of(&pool, "subscription_period_overdue")
            .await
            .into_iter()
            .map(|(subject, _)| subject)
            .collect()
    };
    assert!(overdue().await.is_empty(), "within its period");
    // Billed by its gateway from now on (the fleet's billing, running every ten seconds, leaves
    // it alone), whose invoice events are lost.
    sqlx::query("UPDATE subscriptions SET gateway = 'stripe'")
        .execute(&pool)
        .await
        .unwrap();
    let shift = |by: &'static str| {
        let pool = pool.clone();
        async move {
            sqlx::query(
                "UPDATE subscriptions SET current_period_start = current_period_start - $1::interval,
                                          current_period_end = current_period_end - $1::interval",
            )
            .bind(by)
            .execute(&pool)
            .await
            .unwrap();
        }
    };
    // Its period ended an hour ago: its renewal may still be on its way.
    shift("1 month 1 hour").await;
    assert!(overdue().await.is_empty(), "an hour past its end");
    shift("1 day").await;
    let found = overdue().await;
    assert_eq!(found.len(), 1, "{found:?}");
    assert!(
        found[0].starts_with(&format!("subscription {id} ")),
        "{found:?}"
    );
    // Its cancellation's event comes after all.
    sqlx::query("UPDATE subscriptions SET status = 'canceled', canceled_at = now()")
        .execute(&pool)
        .await
        .unwrap();
    assert!(overdue().await.is_empty(), "a canceled one");
}

/// Coins pay once; a subscription's gateway charges every later period on what paid the first.
/// A subscription order paid with coins would start a subscription nothing could renew, so it is
/// refused before anything is reserved, and it stays payable through its link.
#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn a_subscription_order_is_not_paid_with_coins(pool: PgPool) {
    let shop = shop(pool.clone()).await;
    let seller = shop.seller("Club House").await;
    let order = subscription_order(&shop, &seller).await;
    let number = order["number"].as_i64().unwrap();
    let buyer = order["buyer_id"].as_str().unwrap().to_owned();
    payfleet::ledger::coins::grant(
        &pool,
        &buyer,
        payfleet::money::Money::parse("100.00", "BRL").unwrap(),
        "grant-sub",
    )
    .await
    .unwrap();
    let (status, answer) = shop
        .post(&format!("/orders/{number}/coins"), None, json!({}))
        .await;
    assert_eq!(
        (status, answer["error"]["code"].as_str()),
        (409, Some("order_not_payable")),
        "{answer}"
    );
    assert!(
        answer["error"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("subscription")),
        "{answer}"
    );
    // Nothing reserved, nothing noted, nothing started.
    let (_, wallet) = shop.app.get(&format!("/wallets/{buyer}")).await;
    let wallet: Value = serde_json::from_str(&wallet).unwrap();
    assert_eq!(
        (
            wallet["wallets"][0]["balance"].as_str(),
            wallet["wallets"][0]["reserved"].as_str()
        ),
        (Some("100.00"), Some("0.00")),
        "{wallet}"
    );
    let reservation: Option<String> =
        sqlx::query_scalar("SELECT coin_reservation FROM orders WHERE number = $1")
            .bind(number)
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!(reservation, None);
    assert_eq!(subscriptions(&pool).await, 0);
    assert_eq!(shop.order(number).await["status"], "awaiting_payment");
    // Its link still pays it, and starts its subscription.
    let (paid, page) = shop
        .app
        .pay(order["payment"]["url"].as_str().unwrap(), "succeeded")
        .await;
    assert_eq!(paid, 200, "{page}");
    wait_for("the subscription", Duration::from_secs(30), async || {
        shop.order(number).await["subscription_id"].is_string()
    })
    .await;
    assert_eq!(subscriptions(&pool).await, 1);
}

/// Cancelled now while a charge of its current renewal is in flight (a billing pass that listed
/// the renewal before the cancellation, the simulator's or a gateway's retry): the renewal ends
/// with the cancellation itself, so the charge, when it lands, is a late payment given back,
/// never a sale of a canceled subscription.
#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn a_renewal_charged_after_its_subscription_was_cancelled_now_is_given_back(pool: PgPool) {
    let (shop, biller, _seller, id) =
        renewing(&pool, Duration::from_secs(600), Duration::from_secs(601)).await;
    assert_eq!(simulate(&shop, &id, "fail").await, 200);
    payfleet::payments::renewals::bill(&pool, &biller)
        .await
        .unwrap();
    wait_for("past due", Duration::from_secs(30), async || {
        subscription(&shop, &id).await["status"] == "past_due"
    })
    .await;
    let (status, sub) = cancel(&shop, &id, json!({})).await;
    assert_eq!(status, 200, "{sub}");
    let renewal = sub["renewals"][0]["order_number"].as_i64().unwrap();
    // Ended by the cancellation's own transaction, not later by a job.
    let ended: String = sqlx::query_scalar("SELECT status FROM orders WHERE number = $1")
        .bind(renewal)
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(ended, "expired");
    // The charge in flight lands: its session's renewal reported paid.
    let failed: Value = sqlx::query_scalar(
        "SELECT body FROM internal_events WHERE body->>'type' = 'subscription.renewal_failed'",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    let mut charged = failed.clone();
    charged["type"] = json!("subscription.renewed");
    charged["data"]["payment_id"] = json!("pay_in_flight");
    let (status, answer) = shop
        .app
        .deliver(&internal("in-flight", &charged.to_string()))
        .await;
    assert_eq!(status, 200, "{answer}");
    wait_for(
        "the charge given back",
        Duration::from_secs(30),
        async || {
            sqlx::query_scalar::<_, i64>(
                "SELECT count(*) FROM internal_refunds WHERE payment_id = 'pay_in_flight'",
            )
            .fetch_one(&pool)
            .await
            .unwrap()
                == 1
        },
    )
    .await;
    assert_eq!(shop.order(renewal).await["status"], "expired");
    assert_eq!(
        renewal_sales(&pool).await,
        vec![(renewal, 0)],
        "no sale of a canceled subscription's renewal"
    );
}

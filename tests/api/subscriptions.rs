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
    let order = subscription_order(&shop, &seller).await;
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
    let id = shop.order(number).await["subscription_id"]
        .as_str()
        .unwrap()
        .to_owned();
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

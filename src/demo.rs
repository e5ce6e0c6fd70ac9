//! The first five minutes: `payfleet up` keeps its development secrets (and an admin token) in
//! the database, so a restart and `payfleet demo` use the same ones. `payfleet demo` drives the
//! fleet `up` started through its HTTP API as a marketplace would: a small catalogue, a handful
//! of checkouts, payments through the internal gateway's page (with a duplicate and a late
//! webhook), a failed payment, an order left to expire, then each order's journey as a table.

use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use serde_json::{Value, json};
use sqlx::PgPool;

use crate::config::Config;
use crate::secret::Secret;
use crate::webhooks::signature::StandardSecret;

const INTERNAL: &str = "INTERNAL_WEBHOOK_SECRET";
const MOCK: &str = "MOCK_WEBHOOK_SECRET";
const ADMIN: &str = "PAYFLEET_ADMIN_TOKEN";

async fn stored(pool: &PgPool, name: &str) -> anyhow::Result<Option<String>> {
    Ok(
        sqlx::query_scalar("SELECT value FROM development_settings WHERE name = $1")
            .bind(name)
            .fetch_optional(pool)
            .await?,
    )
}

async fn keep(pool: &PgPool, name: &str, value: &str) -> anyhow::Result<String> {
    Ok(sqlx::query_scalar(
        "INSERT INTO development_settings (name, value) VALUES ($1, $2)
         ON CONFLICT (name) DO UPDATE SET name = EXCLUDED.name RETURNING value",
    )
    .bind(name)
    .bind(value)
    .fetch_one(pool)
    .await?)
}

/// For `up` with nothing configured: the internal and mock gateways' secrets and the admin
/// token, from the environment if set, else the ones an earlier `up` kept, else new ones (kept).
/// Returns the configuration and what to print.
pub async fn development_config(
    pool: &PgPool,
    mut config: Config,
) -> anyhow::Result<(Config, Vec<(&'static str, String)>)> {
    let mut shown = Vec::new();
    for name in [INTERNAL, MOCK] {
        let configured = match name {
            INTERNAL => config.webhooks.internal.is_some(),
            _ => config.webhooks.mock.is_some(),
        };
        if configured {
            continue;
        }
        let value = match stored(pool, name).await? {
            Some(v) => v,
            None => keep(pool, name, &StandardSecret::generate().1).await?,
        };
        let secret = StandardSecret::parse(&value)
            .map_err(|problem| anyhow::anyhow!("the kept {name} is not valid: {problem}"))?;
        match name {
            INTERNAL => config.webhooks.internal = Some(secret),
            _ => config.webhooks.mock = Some(secret),
        }
        shown.push((name, value));
    }
    if config.admin_token.is_none() {
        let value = match stored(pool, ADMIN).await? {
            Some(v) => v,
            None => keep(pool, ADMIN, &format!("dev-{:032x}", rand::random::<u128>())).await?,
        };
        config.admin_token = Some(Secret::new(value.clone()));
        shown.push((ADMIN, value));
    }
    Ok((config, shown))
}

#[derive(clap::Args, Debug)]
pub struct DemoArgs {
    /// The fleet's address (default: PAYFLEET_PUBLIC_URL, which defaults to PAYFLEET_BIND).
    #[arg(long)]
    pub url: Option<String>,
}

struct Client {
    http: reqwest::Client,
    base: String,
    admin: String,
}

impl Client {
    async fn send(&self, req: reqwest::RequestBuilder, what: &str) -> anyhow::Result<Value> {
        let resp = req
            .send()
            .await
            .with_context(|| format!("{what}: is `payfleet up` running?"))?;
        let status = resp.status();
        let body: Value = resp.json().await.unwrap_or(Value::Null);
        if !status.is_success() {
            bail!("{what}: {status} {body}");
        }
        Ok(body)
    }

    async fn admin(&self, path: &str, body: Value) -> anyhow::Result<Value> {
        let req = self
            .http
            .post(format!("{}{path}", self.base))
            .bearer_auth(&self.admin)
            .json(&body);
        self.send(req, path).await
    }

    async fn checkout(&self, key: &str, body: Value) -> anyhow::Result<Vec<Value>> {
        let req = self
            .http
            .post(format!("{}/checkout", self.base))
            .header("Idempotency-Key", key)
            .json(&body);
        let answer = self.send(req, "checkout").await?;
        Ok(answer["orders"].as_array().cloned().unwrap_or_default())
    }

    async fn order(&self, number: i64) -> anyhow::Result<Value> {
        self.send(
            self.http.get(format!("{}/orders/{number}", self.base)),
            "order",
        )
        .await
    }

    async fn pay(&self, order: &Value, outcome: &str) -> anyhow::Result<()> {
        let url = order["payment"]["url"]
            .as_str()
            .context("the order has no payment link")?;
        let resp = self
            .http
            .post(url)
            .form(&[("outcome", outcome)])
            .send()
            .await?;
        if !resp.status().is_success() {
            bail!("the payment page answered {}", resp.status());
        }
        Ok(())
    }

    /// Waits until the order's status is `want`.
    async fn until(&self, number: i64, want: &str) -> anyhow::Result<Value> {
        let start = Instant::now();
        loop {
            let o = self.order(number).await?;
            if o["status"] == want {
                return Ok(o);
            }
            if start.elapsed() > Duration::from_secs(60) {
                bail!(
                    "order {number} is {} after a minute, not {want}",
                    o["status"]
                );
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
}

fn number(o: &Value) -> i64 {
    o["number"].as_i64().unwrap_or_default()
}

pub async fn run(config: &Config, args: DemoArgs) -> anyhow::Result<()> {
    crate::tls::install_provider();
    let pool = crate::db::connect(&config.database_url, 2).await?;
    let (config, _) = development_config(&pool, config.clone()).await?;
    let base = args
        .url
        .unwrap_or_else(|| config.public_url.clone())
        .trim_end_matches('/')
        .to_owned();
    let admin = config
        .admin_token
        .as_ref()
        .map(|t| t.expose().to_owned())
        .context("no admin token")?;
    let internal = config
        .webhooks
        .internal
        .clone()
        .context("the internal gateway has no secret")?;
    let c = Client {
        http: reqwest::Client::builder()
            .timeout(Duration::from_secs(30))
            .build()?,
        base,
        admin,
    };
    let run = format!("{:06x}", rand::random::<u32>() & 0xffffff);
    println!("catalogue");
    let chips_shop = c
        .admin("/admin/sellers", json!({"name": "Chips & Co", "payout_frequency": "weekly", "payout_minimum": "50.00", "holding_days": 7}))
        .await?;
    let deck_shop = c
        .admin(
            "/admin/sellers",
            json!({"name": "Deck House", "payout_frequency": "monthly", "payout_minimum": "20.00"}),
        )
        .await?;
    let chips = c
        .admin("/admin/products", json!({"seller_id": chips_shop["id"], "name": "Clay chip set", "kind": "one_off", "price": "49.90", "currency": "BRL"}))
        .await?;
    let coaching = c
        .admin("/admin/products", json!({"seller_id": chips_shop["id"], "name": "Coaching plan", "kind": "subscription", "price": "19.90", "currency": "BRL", "interval": "month"}))
        .await?;
    let deck = c
        .admin("/admin/products", json!({"seller_id": deck_shop["id"], "name": "Card deck", "kind": "one_off", "price": "12.50", "currency": "BRL"}))
        .await?;
    let code = format!("DEMO10-{run}").to_uppercase();
    c.admin(
        "/admin/coupons",
        json!({"code": code, "percent_off": "10", "max_redemptions": 100}),
    )
    .await?;
    println!("  2 sellers, 3 products (one a subscription), coupon {code} (10 % off)");

    println!("checkouts");
    let cart = json!({"buyer_id": "ana", "gateway": "internal", "coupon": code,
        "items": [{"product_id": chips["id"], "quantity": 2, "price": "0.01"}, {"product_id": deck["id"], "quantity": 1}]});
    let first = c.checkout(&format!("demo-{run}-1"), cart.clone()).await?;
    // The same request again (a client retry): the same orders, no new ones.
    let again = c.checkout(&format!("demo-{run}-1"), cart).await?;
    if again.iter().map(number).collect::<Vec<_>>() != first.iter().map(number).collect::<Vec<_>>()
    {
        bail!("a repeated checkout made new orders");
    }
    let second = c
        .checkout(&format!("demo-{run}-2"), json!({"buyer_id": "bruno", "gateway": "internal", "items": [{"product_id": coaching["id"], "quantity": 1}]}))
        .await?;
    let third = c
        .checkout(&format!("demo-{run}-3"), json!({"buyer_id": "carla", "gateway": "internal", "items": [{"product_id": deck["id"], "quantity": 3}]}))
        .await?;
    let fourth = c
        .checkout(&format!("demo-{run}-4"), json!({"buyer_id": "davi", "gateway": "internal", "items": [{"product_id": chips["id"], "quantity": 1}]}))
        .await?;
    let all: Vec<Value> = first
        .iter()
        .chain(&second)
        .chain(&third)
        .chain(&fourth)
        .cloned()
        .collect();
    println!(
        "  {} checkouts (one repeated with its Idempotency-Key), {} orders",
        4,
        all.len()
    );

    println!("payments");
    let (paid_a, paid_b, sub, expiring, failing) =
        (&first[0], &first[1], &second[0], &third[0], &fourth[0]);
    for o in [paid_a, paid_b, sub] {
        c.pay(o, "succeeded").await?;
    }
    c.pay(failing, "failed").await?;
    // The gateway's event for the first payment, delivered again now (a duplicate) and as a
    // retry hours later would be (re-signed): neither changes anything.
    let session = paid_a["payment"]["session_id"].as_str().unwrap_or_default();
    let events: Vec<(String, Value)> = sqlx::query_as(
        "SELECT id, body FROM internal_events WHERE body -> 'data' ->> 'session_id' = $1 ORDER BY created_at",
    )
    .bind(session)
    .fetch_all(&pool)
    .await?;
    let resend = |id: &str, body: &Value| {
        let ts = chrono::Utc::now().timestamp();
        let text = body.to_string();
        c.http
            .post(format!("{}/webhooks/internal", c.base))
            .header("webhook-id", id)
            .header("webhook-timestamp", ts.to_string())
            .header("webhook-signature", internal.sign(id, ts, text.as_bytes()))
            .body(text)
    };
    let mut resent = Vec::new();
    for (id, body) in &events {
        // At once, as a gateway that did not see our answer in time...
        let answer = c.send(resend(id, body), "webhook").await?;
        resent.push(answer["status"].as_str().unwrap_or("?").to_owned());
    }
    c.until(number(paid_a), "paid").await?;
    for (id, body) in &events {
        // ...and late, after the order was confirmed, as a retry hours later would come.
        let answer = c.send(resend(id, body), "webhook").await?;
        resent.push(answer["status"].as_str().unwrap_or("?").to_owned());
    }
    println!(
        "  4 orders paid or failed on the payment page; order {}'s event sent again twice: {}",
        number(paid_a),
        resent.join(", ")
    );
    c.admin(
        &format!("/admin/orders/{}/expire", number(expiring)),
        json!({}),
    )
    .await?;
    println!("  order {} left to expire", number(expiring));
    for (o, want) in [
        (paid_b, "paid"),
        (sub, "paid"),
        (expiring, "expired"),
        (failing, "payment_failed"),
    ] {
        c.until(number(o), want).await?;
    }

    println!();
    println!(
        "{:<7} {:<11} {:<12} {:>9} {:>8} {:>8} {:<38} {:<15} PAYMENT",
        "ORDER", "SELLER", "KIND", "TOTAL", "FEE", "NET", "JOURNEY", "STATUS"
    );
    for o in &all {
        let n = number(o);
        let view = c.order(n).await?;
        let journey: Vec<String> = sqlx::query_scalar(
            "SELECT e.kind FROM order_events e JOIN orders o ON o.id = e.order_id WHERE o.number = $1 ORDER BY e.id",
        )
        .bind(n)
        .fetch_all(&pool)
        .await?;
        let seller = if view["seller_id"] == chips_shop["id"] {
            "Chips & Co"
        } else {
            "Deck House"
        };
        println!(
            "{:<7} {:<11} {:<12} {:>9} {:>8} {:>8} {:<38} {:<15} {}",
            n,
            seller,
            view["kind"].as_str().unwrap_or_default(),
            format!(
                "{} {}",
                view["total"].as_str().unwrap_or_default(),
                view["currency"].as_str().unwrap_or_default()
            ),
            view["platform_fee"].as_str().unwrap_or_default(),
            view["seller_net"].as_str().unwrap_or_default(),
            journey.join(" > "),
            view["status"].as_str().unwrap_or_default(),
            view["payment_status"].as_str().unwrap_or_default(),
        );
    }
    pool.close().await;
    Ok(())
}

//! The first five minutes: `payfleet up` keeps its development webhook secrets and a
//! development API key in the database, so a restart and `payfleet demo` use the same ones. Its
//! admin token is new at every start and never stored: it is printed, and only its digest is
//! held, in the process's memory. `payfleet demo` drives the fleet `up` started as a
//! marketplace would: as its operator (with the database, as the other operator commands do) a
//! small catalogue and an expiry; as its backend, over the HTTP API with the development API
//! key, a handful of checkouts and order reads; as buyers, payments on the internal gateway's
//! page (with a duplicate and a late webhook) and a failed payment; then each order's journey
//! as a table.

use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use serde_json::{Value, json};
use sqlx::PgPool;

use payfleet::auth::{self, ApiKeys, Lookup, Token};
use payfleet::config::Config;
use payfleet::secret::StandardSecret;
use payfleet::{catalogue, orders};

const INTERNAL: &str = "INTERNAL_WEBHOOK_SECRET";
const MOCK: &str = "MOCK_WEBHOOK_SECRET";
const ADMIN: &str = "PAYFLEET_ADMIN_TOKEN";
const API_KEY: &str = "PAYFLEET_DEV_API_KEY";

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

/// For `up` with nothing configured: the internal and mock gateways' secrets, from the
/// environment if set, else the ones an earlier `up` kept, else new ones (kept); an admin token
/// from the environment, else a new one (printed, never kept); the payment simulator on; and the
/// development API key. Returns the configuration and what to print.
pub async fn development_config(
    pool: &PgPool,
    mut config: Config,
) -> anyhow::Result<(Config, Vec<(&'static str, String)>)> {
    let mut shown = Vec::new();
    for name in [INTERNAL, MOCK] {
        let configured = match name {
            INTERNAL => config.gateways.hosted.internal.is_some(),
            _ => config.gateways.hosted.mock.is_some(),
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
            INTERNAL => config.gateways.hosted.internal = Some(secret),
            _ => config.gateways.hosted.mock = Some(secret),
        }
        shown.push((name, value));
    }
    if config.admin_token.is_none() {
        let (token, value) = Token::generate();
        config.admin_token = Some(token);
        shown.push((ADMIN, value));
    }
    config.gateways.hosted.simulator = true;
    config.development = true;
    shown.push((API_KEY, development_api_key(pool).await?));
    Ok((config, shown))
}

/// The development API key (of no seller): the one an earlier `up` kept while it is in force,
/// else a new one, kept. Development only: marked as such, so only `up`'s process takes it
/// (`serve` answers 401 to it).
pub async fn development_api_key(pool: &PgPool) -> anyhow::Result<String> {
    if let Some(key) = stored(pool, API_KEY).await?
        && let Lookup::InForce(_) = ApiKeys::new(pool.clone())
            .with_development_keys()
            .lookup(&key)
            .await?
    {
        return Ok(key);
    }
    let (_, key) = auth::api_keys::create_development(
        pool,
        auth::NewApiKey {
            name: "development (payfleet up)".into(),
            seller_id: None,
        },
    )
    .await?;
    sqlx::query(
        "INSERT INTO development_settings (name, value) VALUES ($1, $2)
         ON CONFLICT (name) DO UPDATE SET value = EXCLUDED.value",
    )
    .bind(API_KEY)
    .bind(&key)
    .execute(pool)
    .await?;
    Ok(key)
}

#[derive(clap::Args, Debug)]
pub struct DemoArgs {
    /// The fleet's address (default: PAYFLEET_PUBLIC_URL, which defaults to PAYFLEET_BIND).
    #[arg(long)]
    pub url: Option<String>,
}

struct Client {
    /// The operator's way in (the catalogue, an expiry), as the other operator commands.
    pool: PgPool,
    /// Buyers' browsers and the backend share it; only the backend's requests carry its key.
    http: reqwest::Client,
    base: String,
    api_key: String,
}

/// A seller, a product or a coupon as the admin API reads it from its body.
fn parsed<T: serde::de::DeserializeOwned>(new: Value) -> anyhow::Result<T> {
    serde_json::from_value(new).context("the demo's catalogue")
}

/// The form token the payment page renders (`name="token" value="..."`).
fn form_token(page: &str) -> Option<&str> {
    let rest = &page[page.find("name=\"token\" value=\"")? + 20..];
    Some(&rest[..rest.find('"')?])
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

    async fn seller(&self, new: Value) -> anyhow::Result<catalogue::Seller> {
        Ok(catalogue::create_seller(&self.pool, parsed(new)?).await?)
    }

    async fn product(
        &self,
        seller: &catalogue::Seller,
        mut new: Value,
    ) -> anyhow::Result<catalogue::Product> {
        new["seller_id"] = json!(seller.id);
        Ok(catalogue::create_product(&self.pool, parsed(new)?).await?)
    }

    async fn checkout(&self, key: &str, body: Value) -> anyhow::Result<Vec<Value>> {
        let req = self
            .http
            .post(format!("{}/checkout", self.base))
            .bearer_auth(&self.api_key)
            .header("Idempotency-Key", key)
            .json(&body);
        let answer = self.send(req, "checkout").await?;
        Ok(answer["orders"].as_array().cloned().unwrap_or_default())
    }

    async fn order(&self, number: i64) -> anyhow::Result<Value> {
        self.send(
            self.http
                .get(format!("{}/orders/{number}", self.base))
                .bearer_auth(&self.api_key),
            "order",
        )
        .await
    }

    async fn subscription(&self, id: &str) -> anyhow::Result<Value> {
        self.send(
            self.http
                .get(format!("{}/subscriptions/{id}", self.base))
                .bearer_auth(&self.api_key),
            "subscription",
        )
        .await
    }

    /// Waits (up to two billing runs' worth) until the subscription satisfies `done`.
    async fn until_subscription(
        &self,
        id: &str,
        what: &str,
        done: impl Fn(&Value) -> bool,
    ) -> anyhow::Result<Value> {
        let start = Instant::now();
        loop {
            let s = self.subscription(id).await?;
            if done(&s) {
                return Ok(s);
            }
            if start.elapsed() > Duration::from_secs(60) {
                bail!(
                    "subscription {id}: not {what} after a minute (is subscription_billing scheduled?): {s}"
                );
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    }

    /// As if the subscription's period had ended now: the next billing run renews it.
    async fn end_period(&self, id: &str) -> anyhow::Result<()> {
        sqlx::query(
            "UPDATE subscriptions SET current_period_start = now() - (current_period_end - current_period_start),
                 current_period_end = now() WHERE id = $1::uuid",
        )
        .bind(id)
        .execute(&self.pool)
        .await?;
        Ok(())
    }

    /// A buyer on the payment page: opens it, then posts its form with the page's token.
    async fn pay(&self, order: &Value, outcome: &str) -> anyhow::Result<()> {
        let url = order["payment"]["url"]
            .as_str()
            .context("the order has no payment link")?;
        let page = self.http.get(url).send().await?.text().await?;
        let token = form_token(&page).context("the payment page has no form")?;
        let resp = self
            .http
            .post(url)
            .form(&[("outcome", outcome), ("token", token)])
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
    payfleet::tls::install_provider();
    let pool = payfleet::db::connect(&config.database_url, 2, "demo").await?;
    let (config, _) = development_config(&pool, config.clone()).await?;
    let base = args
        .url
        .unwrap_or_else(|| config.public_url.clone())
        .trim_end_matches('/')
        .to_owned();
    let api_key = development_api_key(&pool).await?;
    let internal = config
        .gateways
        .hosted
        .internal
        .clone()
        .context("the internal gateway has no secret")?;
    let c = Client {
        pool: pool.clone(),
        http: reqwest::Client::builder()
            .timeout(Duration::from_secs(30))
            .build()?,
        base,
        api_key,
    };
    let run = format!("{:06x}", rand::random::<u32>() & 0xffffff);
    println!("catalogue");
    let chips_shop = c
        .seller(json!({"name": "Chips & Co", "payout_frequency": "weekly", "payout_minimum": "50.00", "holding_days": 7}))
        .await?;
    let deck_shop = c
        .seller(
            json!({"name": "Deck House", "payout_frequency": "monthly", "payout_minimum": "20.00"}),
        )
        .await?;
    let chips = c
        .product(&chips_shop, json!({"name": "Clay chip set", "kind": "one_off", "price": "49.90", "currency": "BRL"}))
        .await?;
    let coaching = c
        .product(&chips_shop, json!({"name": "Coaching plan", "kind": "subscription", "price": "19.90", "currency": "BRL", "interval": "month"}))
        .await?;
    let deck = c
        .product(
            &deck_shop,
            json!({"name": "Card deck", "kind": "one_off", "price": "12.50", "currency": "BRL"}),
        )
        .await?;
    let code = format!("DEMO10-{run}").to_uppercase();
    catalogue::create_coupon(
        &c.pool,
        parsed(json!({"code": code, "percent_off": "10", "max_redemptions": 100}))?,
    )
    .await?;
    println!("  2 sellers, 3 products (one a subscription), coupon {code} (10 % off)");

    println!("checkouts");
    let cart = json!({"buyer_id": "ana", "gateway": "internal", "coupon": code,
        "items": [{"product_id": chips.id, "quantity": 2, "price": "0.01"}, {"product_id": deck.id, "quantity": 1}]});
    let first = c.checkout(&format!("demo-{run}-1"), cart.clone()).await?;
    // The same request again (a client retry): the same orders, no new ones.
    let again = c.checkout(&format!("demo-{run}-1"), cart).await?;
    if again.iter().map(number).collect::<Vec<_>>() != first.iter().map(number).collect::<Vec<_>>()
    {
        bail!("a repeated checkout made new orders");
    }
    let second = c
        .checkout(&format!("demo-{run}-2"), json!({"buyer_id": "bruno", "gateway": "internal", "items": [{"product_id": coaching.id, "quantity": 1}]}))
        .await?;
    let third = c
        .checkout(&format!("demo-{run}-3"), json!({"buyer_id": "carla", "gateway": "internal", "items": [{"product_id": deck.id, "quantity": 3}]}))
        .await?;
    let fourth = c
        .checkout(&format!("demo-{run}-4"), json!({"buyer_id": "davi", "gateway": "internal", "items": [{"product_id": chips.id, "quantity": 1}]}))
        .await?;
    let fifth = c
        .checkout(&format!("demo-{run}-5"), json!({"buyer_id": "elena", "gateway": "internal", "items": [{"product_id": coaching.id, "quantity": 1}]}))
        .await?;
    let all: Vec<Value> = first
        .iter()
        .chain(&second)
        .chain(&third)
        .chain(&fourth)
        .chain(&fifth)
        .cloned()
        .collect();
    println!(
        "  {} checkouts (one repeated with its Idempotency-Key), {} orders",
        5,
        all.len()
    );

    println!("payments");
    let (paid_a, paid_b, sub, expiring, failing, sub_b) = (
        &first[0], &first[1], &second[0], &third[0], &fourth[0], &fifth[0],
    );
    for o in [paid_a, paid_b, sub, sub_b] {
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
    orders::expire_now(&c.pool, number(expiring)).await?;
    println!("  order {} left to expire", number(expiring));
    for (o, want) in [
        (paid_b, "paid"),
        (sub, "paid"),
        (sub_b, "paid"),
        (expiring, "expired"),
        (failing, "payment_failed"),
    ] {
        c.until(number(o), want).await?;
    }

    println!("subscriptions (each month passed at once; subscription_billing renews every 10 s)");
    let id_of = |o: Value| o["subscription_id"].as_str().map(str::to_owned);
    let bruno =
        id_of(c.order(number(sub)).await?).context("order paid without its subscription")?;
    let elena =
        id_of(c.order(number(sub_b)).await?).context("order paid without its subscription")?;
    let renewals = |s: &Value| s["renewals"].as_array().cloned().unwrap_or_default();
    for month in 1..=2 {
        c.end_period(&bruno).await?;
        c.until_subscription(&bruno, "renewed", |s| {
            renewals(s).len() == month && renewals(s).iter().all(|r| r["state"] == "paid")
        })
        .await?;
    }
    let s = c.subscription(&bruno).await?;
    println!(
        "  bruno's: {} renewals paid ({}), {}",
        renewals(&s).len(),
        renewals(&s)
            .iter()
            .map(|r| format!("order {}", r["order_number"]))
            .collect::<Vec<_>>()
            .join(", "),
        s["status"].as_str().unwrap_or_default()
    );
    orders::subscriptions::simulate(&c.pool, elena.parse()?, false).await?;
    c.end_period(&elena).await?;
    c.until_subscription(&elena, "past due", |s| s["status"] == "past_due")
        .await?;
    println!("  elena's: renewal failed, past due (no money moved)");
    orders::subscriptions::simulate(&c.pool, elena.parse()?, true).await?;
    let s = c
        .until_subscription(&elena, "active again", |s| s["status"] == "active")
        .await?;
    let renewal = &renewals(&s)[0];
    println!(
        "  elena's: the retry was paid (order {}, attempt {}): active again",
        renewal["order_number"],
        c.order(renewal["order_number"].as_i64().unwrap_or_default())
            .await?["payment_attempt"]
    );

    println!();
    println!(
        "{:<7} {:<11} {:<12} {:>9} {:>8} {:>8} {:<38} {:<15} PAYMENT",
        "ORDER", "SELLER", "KIND", "TOTAL", "FEE", "NET", "JOURNEY", "STATUS"
    );
    let mut numbers: Vec<i64> = all.iter().map(number).collect();
    let renewal_orders: Vec<i64> = sqlx::query_scalar(
        "SELECT number FROM orders WHERE renews IN ($1::uuid, $2::uuid) ORDER BY number",
    )
    .bind(&bruno)
    .bind(&elena)
    .fetch_all(&pool)
    .await?;
    numbers.extend(renewal_orders);
    for n in numbers {
        let view = c.order(n).await?;
        let journey: Vec<String> = sqlx::query_scalar(
            "SELECT e.kind FROM order_events e JOIN orders o ON o.id = e.order_id WHERE o.number = $1 ORDER BY e.id",
        )
        .bind(n)
        .fetch_all(&pool)
        .await?;
        let seller = if view["seller_id"] == json!(chips_shop.id) {
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

//! The soak's clients of the fleet, as the outside world is: the marketplace backend (API key),
//! an operator (admin token), buyers on the payment page, and the gateway's signed webhooks.
//! Each retries what its real counterpart retries (a connection refused while the receiver
//! restarts, a 503 while the database is away, 409 `idempotency_key_in_use`), with the same
//! Idempotency-Key, until a deadline.

use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use reqwest::Method;
use serde_json::Value;

use payfleet::secret::StandardSecret;

/// How long a request is retried before the soak calls it a failure.
const PATIENCE: Duration = Duration::from_secs(180);

#[derive(Clone, Copy)]
pub enum Who {
    Backend,
    Operator,
}

#[derive(Clone)]
pub struct Api {
    pub http: reqwest::Client,
    pub base: String,
    pub api_key: String,
    pub admin_token: String,
    pub secret: StandardSecret,
}

/// An answer: its status and its JSON body (`Null` when it has none).
pub struct Answer {
    pub status: u16,
    pub body: Value,
}

impl Answer {
    pub fn ok(&self) -> bool {
        (200..300).contains(&self.status)
    }

    pub fn code(&self) -> &str {
        self.body["error"]["code"].as_str().unwrap_or("")
    }
}

/// Whether an answer says "the same request again later".
fn again(status: u16, body: &Value) -> bool {
    matches!(status, 502..=504)
        || (status == 409 && body["error"]["code"] == "idempotency_key_in_use")
}

impl Api {
    pub fn new(
        base: String,
        api_key: String,
        admin_token: String,
        secret: StandardSecret,
    ) -> anyhow::Result<Self> {
        Ok(Self {
            http: reqwest::Client::builder()
                .timeout(Duration::from_secs(30))
                .redirect(reqwest::redirect::Policy::none())
                .build()?,
            base,
            api_key,
            admin_token,
            secret,
        })
    }

    /// `method path` as `who`, with `idempotency` and `body`, retried while it should be.
    pub async fn call(
        &self,
        method: Method,
        path: &str,
        who: Who,
        idempotency: Option<&str>,
        body: Option<&Value>,
    ) -> anyhow::Result<Answer> {
        let started = Instant::now();
        let mut wait = Duration::from_millis(100);
        loop {
            let token = match who {
                Who::Backend => &self.api_key,
                Who::Operator => &self.admin_token,
            };
            let mut req = self
                .http
                .request(method.clone(), format!("{}{path}", self.base))
                .bearer_auth(token);
            if let Some(key) = idempotency {
                req = req.header("idempotency-key", key);
            }
            if let Some(b) = body {
                req = req.json(b);
            }
            let answer = match req.send().await {
                Ok(resp) => {
                    let status = resp.status().as_u16();
                    let body = resp.json::<Value>().await.unwrap_or(Value::Null);
                    Some(Answer { status, body })
                }
                Err(_) => None,
            };
            match answer {
                Some(a) if !again(a.status, &a.body) => return Ok(a),
                last => {
                    if started.elapsed() > PATIENCE {
                        let what = last.map_or("no answer".to_owned(), |a| {
                            format!("{} {}", a.status, a.body)
                        });
                        bail!(
                            "{method} {path}: still {what} after {} s",
                            PATIENCE.as_secs()
                        );
                    }
                }
            }
            tokio::time::sleep(wait).await;
            wait = (wait * 2).min(Duration::from_secs(2));
        }
    }

    pub async fn get(&self, path: &str, who: Who) -> anyhow::Result<Answer> {
        self.call(Method::GET, path, who, None, None).await
    }

    pub async fn post(
        &self,
        path: &str,
        who: Who,
        idempotency: Option<&str>,
        body: &Value,
    ) -> anyhow::Result<Answer> {
        self.call(Method::POST, path, who, idempotency, Some(body))
            .await
    }

    /// A signed webhook of the internal gateway, sent until the receiver takes it (200), as a
    /// gateway's delivery would be. Signed anew at each attempt, as Standard Webhooks senders do.
    pub async fn webhook(&self, id: &str, body: &Value) -> anyhow::Result<()> {
        let bytes = serde_json::to_vec(body)?;
        let started = Instant::now();
        loop {
            let ts = chrono::Utc::now().timestamp();
            let sent = self
                .http
                .post(format!("{}/webhooks/internal", self.base))
                .header("webhook-id", id)
                .header("webhook-timestamp", ts.to_string())
                .header("webhook-signature", self.secret.sign(id, ts, &bytes))
                .header("content-type", "application/json")
                .body(bytes.clone())
                .send()
                .await;
            match sent {
                Ok(r) if r.status().is_success() => return Ok(()),
                Ok(r) if r.status().is_client_error() => {
                    bail!(
                        "webhook {id} refused: {} {}",
                        r.status(),
                        r.text().await.unwrap_or_default()
                    )
                }
                _ if started.elapsed() > PATIENCE => {
                    bail!("webhook {id} not taken in {} s", PATIENCE.as_secs())
                }
                _ => tokio::time::sleep(Duration::from_millis(250)).await,
            }
        }
    }

    /// A buyer on the payment page at `url`: opens it and posts `outcome` with the page's token.
    /// Returns the page's status: 200 decided, 409 the order cannot be paid any more.
    pub async fn pay_page(&self, url: &str, outcome: &str) -> anyhow::Result<u16> {
        let started = Instant::now();
        loop {
            let attempt = async {
                let page = self.http.get(url).send().await?;
                if !page.status().is_success() {
                    return Ok::<_, reqwest::Error>(Some(page.status().as_u16()));
                }
                let page = page.text().await?;
                let Some(token) = form_token(&page) else {
                    // Decided already (a retried POST that did land), or not payable.
                    return Ok(Some(if page.contains("cannot be paid") {
                        409
                    } else {
                        200
                    }));
                };
                let resp = self
                    .http
                    .post(url)
                    .header("origin", &self.base)
                    .form(&[("outcome", outcome), ("token", token)])
                    .send()
                    .await?;
                Ok(Some(resp.status().as_u16()))
            };
            match attempt.await {
                Ok(Some(s)) if s == 200 || s == 409 => return Ok(s),
                Ok(Some(s)) if (400..500).contains(&s) => {
                    bail!("the payment page at {url} answered {s}")
                }
                _ if started.elapsed() > PATIENCE => bail!(
                    "the payment page at {url} did not answer in {} s",
                    PATIENCE.as_secs()
                ),
                _ => tokio::time::sleep(Duration::from_millis(250)).await,
            }
        }
    }

    /// The order's answer.
    pub async fn order(&self, number: i64) -> anyhow::Result<Value> {
        let a = self.get(&format!("/orders/{number}"), Who::Backend).await?;
        if !a.ok() {
            bail!("GET /orders/{number}: {} {}", a.status, a.body);
        }
        Ok(a.body)
    }

    /// Waits until the order is no longer awaiting payment (or `within` passes); its status.
    pub async fn until_decided(&self, number: i64, within: Duration) -> anyhow::Result<String> {
        let started = Instant::now();
        loop {
            let o = self.order(number).await?;
            let status = o["status"]
                .as_str()
                .context("an order without status")?
                .to_owned();
            if status != "awaiting_payment" || started.elapsed() > within {
                return Ok(status);
            }
            tokio::time::sleep(Duration::from_millis(300)).await;
        }
    }
}

/// The form token the payment page renders (`name="token" value="..."`).
fn form_token(page: &str) -> Option<&str> {
    let rest = &page[page.find("name=\"token\" value=\"")? + 20..];
    Some(&rest[..rest.find('"')?])
}

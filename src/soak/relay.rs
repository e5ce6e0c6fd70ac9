//! The network between the internal gateway and the receiver, as the soak makes it: the
//! gateway's deliverer posts its signed events here (`PAYFLEET_INTERNAL_WEBHOOK_URL`), and the
//! relay passes them on, or not. Each event's fate is drawn from the seed and its id, so a run
//! replays: withheld for good (answered 200, never passed on: reconciliation must find the
//! payment), answered 500 or held until the deliverer's timeout on the first attempt (it must
//! retry), passed on twice at once (a concurrent duplicate), or passed on. The soak can also hold
//! a session's events for a while (to send another event first: reordering) and sends a sample of
//! what went through again later, re-signed, as gateways retry for days.

use std::collections::HashMap;
use std::hash::{Hash, Hasher};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::routing::post;
use rand::Rng;
use tokio::net::TcpListener;

use payfleet::secret::StandardSecret;

/// One delivery as the gateway made it.
#[derive(Clone)]
pub struct Delivery {
    pub id: String,
    pub body: Bytes,
    pub session: Option<String>,
}

/// What the relay did, for the report.
#[derive(Debug, Default, Clone)]
pub struct Tally {
    pub passed: usize,
    pub withheld: usize,
    pub failed_500: usize,
    pub timed_out: usize,
    pub doubled: usize,
    pub held: usize,
    pub resent: usize,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum FateOf {
    Withhold,
    Fail500,
    Hang,
    Double,
    Pass,
}

struct Inner {
    target: String,
    http: reqwest::Client,
    secret: StandardSecret,
    seed: u64,
    /// Deliveries of held sessions, passed on at release.
    held: Mutex<HashMap<String, Vec<Delivery>>>,
    /// Event ids whose first-attempt fault was served.
    faulted: Mutex<std::collections::HashSet<String>>,
    passed: Mutex<Vec<Delivery>>,
    tally: Mutex<Tally>,
    /// Withholding on or off (off while the soak settles: what is withheld stays withheld).
    faults_on: std::sync::atomic::AtomicBool,
}

#[derive(Clone)]
pub struct Relay(Arc<Inner>);

impl Relay {
    /// Starts the relay on a free port, passing events on to `target`; returns it and its port.
    pub async fn start(
        target: String,
        secret: StandardSecret,
        seed: u64,
    ) -> anyhow::Result<(Self, u16)> {
        let relay = Self(Arc::new(Inner {
            target,
            http: reqwest::Client::builder()
                .timeout(Duration::from_secs(30))
                .build()?,
            secret,
            seed,
            held: Mutex::default(),
            faulted: Mutex::default(),
            passed: Mutex::default(),
            tally: Mutex::default(),
            faults_on: true.into(),
        }));
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let port = listener.local_addr()?.port();
        let app = axum::Router::new()
            .route("/webhooks/internal", post(deliver))
            .with_state(relay.clone());
        tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        Ok((relay, port))
    }

    pub fn tally(&self) -> Tally {
        self.0.tally.lock().map(|t| t.clone()).unwrap_or_default()
    }

    /// New events go through untouched from now on (the soak settles).
    pub fn calm(&self) {
        self.0
            .faults_on
            .store(false, std::sync::atomic::Ordering::SeqCst);
    }

    /// Holds `session`'s events until [`Relay::release`].
    pub fn hold(&self, session: &str) {
        if let Ok(mut h) = self.0.held.lock() {
            h.entry(session.to_owned()).or_default();
        }
    }

    /// Passes on what was held for `session` (each until the receiver takes it).
    pub async fn release(&self, session: &str) -> anyhow::Result<()> {
        let held = self
            .0
            .held
            .lock()
            .ok()
            .and_then(|mut h| h.remove(session))
            .unwrap_or_default();
        for d in held {
            self.send_until_taken(&d).await?;
        }
        Ok(())
    }

    /// Sends `count` deliveries that went through again, picked by `rng`, re-signed: duplicates
    /// a gateway's retry makes minutes later.
    pub async fn resend_some(&self, rng: &mut impl Rng, count: usize) -> anyhow::Result<usize> {
        let picked: Vec<Delivery> = {
            let passed = self
                .0
                .passed
                .lock()
                .map_err(|_| anyhow::anyhow!("relay state poisoned"))?;
            if passed.is_empty() {
                return Ok(0);
            }
            (0..count)
                .map(|_| passed[rng.random_range(0..passed.len())].clone())
                .collect()
        };
        for d in &picked {
            self.send_until_taken(d).await?;
        }
        if let Ok(mut t) = self.0.tally.lock() {
            t.resent += picked.len();
        }
        Ok(picked.len())
    }

    fn fate(&self, id: &str) -> FateOf {
        if !self.0.faults_on.load(std::sync::atomic::Ordering::SeqCst) {
            return FateOf::Pass;
        }
        let mut h = std::collections::hash_map::DefaultHasher::new();
        (self.0.seed, id).hash(&mut h);
        match h.finish() % 100 {
            0..=7 => FateOf::Withhold,
            8..=15 => FateOf::Fail500,
            16..=18 => FateOf::Hang,
            19..=29 => FateOf::Double,
            _ => FateOf::Pass,
        }
    }

    /// Posts `d` to the receiver, signed now; its status (None: no answer).
    async fn send(&self, d: &Delivery) -> Option<u16> {
        let ts = chrono::Utc::now().timestamp();
        self.0
            .http
            .post(&self.0.target)
            .header("webhook-id", &d.id)
            .header("webhook-timestamp", ts.to_string())
            .header("webhook-signature", self.0.secret.sign(&d.id, ts, &d.body))
            .header("content-type", "application/json")
            .body(d.body.clone())
            .send()
            .await
            .ok()
            .map(|r| r.status().as_u16())
    }

    async fn send_until_taken(&self, d: &Delivery) -> anyhow::Result<()> {
        let started = std::time::Instant::now();
        loop {
            if self.send(d).await == Some(200) {
                return Ok(());
            }
            if started.elapsed() > Duration::from_secs(180) {
                anyhow::bail!("the receiver did not take event {} in 180 s", d.id);
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    }

    fn count(&self, f: impl FnOnce(&mut Tally)) {
        if let Ok(mut t) = self.0.tally.lock() {
            f(&mut t);
        }
    }
}

async fn deliver(State(relay): State<Relay>, headers: HeaderMap, body: Bytes) -> StatusCode {
    let Some(id) = headers.get("webhook-id").and_then(|v| v.to_str().ok()) else {
        return StatusCode::BAD_REQUEST;
    };
    let parsed: serde_json::Value = serde_json::from_slice(&body).unwrap_or_default();
    let d = Delivery {
        id: id.to_owned(),
        session: parsed["data"]["session_id"].as_str().map(str::to_owned),
        body,
    };
    if let Some(session) = &d.session
        && let Ok(mut held) = relay.0.held.lock()
        && let Some(list) = held.get_mut(session)
    {
        list.push(d);
        relay.count(|t| t.held += 1);
        return StatusCode::OK;
    }
    let first = relay
        .0
        .faulted
        .lock()
        .is_ok_and(|mut f| f.insert(d.id.clone()));
    match relay.fate(&d.id) {
        FateOf::Withhold => {
            if first {
                relay.count(|t| t.withheld += 1);
            }
            return StatusCode::OK;
        }
        FateOf::Fail500 if first => {
            relay.count(|t| t.failed_500 += 1);
            return StatusCode::INTERNAL_SERVER_ERROR;
        }
        FateOf::Hang if first => {
            relay.count(|t| t.timed_out += 1);
            // Longer than the deliverer waits: it gives up on this attempt and retries.
            tokio::time::sleep(Duration::from_secs(12)).await;
            return StatusCode::GATEWAY_TIMEOUT;
        }
        FateOf::Double if first => {
            relay.count(|t| t.doubled += 1);
            let (a, b) = tokio::join!(relay.send(&d), relay.send(&d));
            return pass_status(&relay, d, a.into_iter().chain(b).min());
        }
        _ => {}
    }
    let status = relay.send(&d).await;
    pass_status(&relay, d, status)
}

/// The receiver's answer passed back to the deliverer; what it took is kept for later resends.
fn pass_status(relay: &Relay, d: Delivery, status: Option<u16>) -> StatusCode {
    match status {
        Some(200) => {
            relay.count(|t| t.passed += 1);
            if let Ok(mut p) = relay.0.passed.lock() {
                p.push(d);
            }
            StatusCode::OK
        }
        Some(s) => StatusCode::from_u16(s).unwrap_or(StatusCode::BAD_GATEWAY),
        None => StatusCode::BAD_GATEWAY,
    }
}

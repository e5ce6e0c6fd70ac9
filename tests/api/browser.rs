//! A real headless Chromium (Debian's `chromium` package), driven over the DevTools protocol:
//! enough to load pages, fill and submit forms, read the page and take a screenshot.

use std::process::Stdio;
use std::time::Duration;

use futures_util::{SinkExt, StreamExt};
use serde_json::{Value, json};
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::net::TcpStream;
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::{MaybeTlsStream, WebSocketStream};

pub struct Browser {
    _chromium: tokio::process::Child,
    ws: WebSocketStream<MaybeTlsStream<TcpStream>>,
    session: String,
    next_id: u64,
    profile: std::path::PathBuf,
}

impl Drop for Browser {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.profile);
    }
}

impl Browser {
    pub async fn start() -> Browser {
        let profile =
            std::env::temp_dir().join(format!("payfleet-chromium-{:016x}", rand::random::<u64>()));
        let mut chromium = tokio::process::Command::new("chromium")
            .args([
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--disable-dev-shm-usage",
                "--no-first-run",
                "--remote-debugging-port=0",
                "--window-size=1400,1000",
            ])
            .arg(format!("--user-data-dir={}", profile.display()))
            .arg("about:blank")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .unwrap_or_else(|e| {
                panic!("cannot start chromium ({e}): install it with `apt-get install chromium` (.ci/run does)")
            });
        let mut lines = BufReader::new(chromium.stderr.take().unwrap()).lines();
        // Generous: under the whole suite's load on two cores, its start has taken over 30 s.
        let url = tokio::time::timeout(Duration::from_secs(120), async {
            while let Some(line) = lines.next_line().await.unwrap() {
                if let Some(url) = line.strip_prefix("DevTools listening on ") {
                    return url.trim().to_owned();
                }
            }
            panic!("chromium ended without its DevTools address");
        })
        .await
        .expect("chromium did not start within 120 s");
        // Keep reading its stderr so it never blocks on a full pipe.
        tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
        let (ws, _) = tokio_tungstenite::connect_async(url.as_str())
            .await
            .unwrap();
        let mut browser = Browser {
            _chromium: chromium,
            ws,
            session: String::new(),
            next_id: 0,
            profile,
        };
        let target = browser
            .call("Target.createTarget", json!({"url": "about:blank"}))
            .await;
        let attached = browser
            .call(
                "Target.attachToTarget",
                json!({"targetId": target["targetId"], "flatten": true}),
            )
            .await;
        browser.session = attached["sessionId"].as_str().unwrap().to_owned();
        browser.call("Page.enable", json!({})).await;
        browser
    }

    async fn send(&mut self, method: &str, params: Value) -> u64 {
        self.next_id += 1;
        let mut message = json!({"id": self.next_id, "method": method, "params": params});
        if !self.session.is_empty() {
            message["sessionId"] = json!(self.session);
        }
        self.ws
            .send(Message::text(message.to_string()))
            .await
            .unwrap();
        self.next_id
    }

    async fn next_message(&mut self) -> Value {
        loop {
            let message = tokio::time::timeout(Duration::from_secs(20), self.ws.next())
                .await
                .expect("chromium did not answer within 20 s")
                .expect("chromium closed the connection")
                .unwrap();
            if let Message::Text(text) = message {
                return serde_json::from_str(&text).unwrap();
            }
        }
    }

    /// One DevTools command, its result.
    pub async fn call(&mut self, method: &str, params: Value) -> Value {
        let id = self.send(method, params).await;
        loop {
            let message = self.next_message().await;
            if message["id"] == json!(id) {
                assert!(message.get("error").is_none(), "{method}: {message}");
                return message["result"].clone();
            }
        }
    }

    /// Runs `action` and waits for the page it leads to to finish loading.
    async fn and_wait_for_load(&mut self, method: &str, params: Value) {
        let id = self.send(method, params).await;
        let (mut answered, mut loaded) = (false, false);
        while !(answered && loaded) {
            let message = self.next_message().await;
            if message["id"] == json!(id) {
                assert!(message.get("error").is_none(), "{method}: {message}");
                answered = true;
            }
            if message["method"] == "Page.loadEventFired" {
                loaded = true;
            }
        }
    }

    pub async fn open(&mut self, url: &str) {
        self.and_wait_for_load("Page.navigate", json!({"url": url}))
            .await;
    }

    /// The value of a JavaScript expression in the page.
    pub async fn eval(&mut self, expression: &str) -> Value {
        let r = self
            .call(
                "Runtime.evaluate",
                json!({"expression": expression, "returnByValue": true}),
            )
            .await;
        assert!(r.get("exceptionDetails").is_none(), "{expression}: {r}");
        r["result"]["value"].clone()
    }

    /// The page's visible text.
    pub async fn text(&mut self) -> String {
        self.eval("document.body.innerText")
            .await
            .as_str()
            .unwrap_or("")
            .to_owned()
    }

    /// Types into a form field.
    pub async fn fill(&mut self, selector: &str, value: &str) {
        let found = self
            .eval(&format!(
                "(() => {{ const e = document.querySelector({}); if (!e) return false; e.value = {}; return true; }})()",
                json!(selector),
                json!(value)
            ))
            .await;
        assert_eq!(found, json!(true), "no {selector} on the page");
    }

    /// Clicks what `selector` names and waits for the page the click leads to.
    pub async fn click(&mut self, selector: &str) {
        let found = self
            .eval(&format!("!!document.querySelector({})", json!(selector)))
            .await;
        assert_eq!(found, json!(true), "no {selector} on the page");
        self.and_wait_for_load(
            "Runtime.evaluate",
            json!({"expression": format!("setTimeout(() => document.querySelector({}).click(), 0)", json!(selector))}),
        )
        .await;
    }

    /// A PNG of the whole page.
    pub async fn screenshot(&mut self) -> Vec<u8> {
        use base64::Engine;
        let shot = self
            .call(
                "Page.captureScreenshot",
                json!({"format": "png", "captureBeyondViewport": true}),
            )
            .await;
        base64::engine::general_purpose::STANDARD
            .decode(shot["data"].as_str().unwrap())
            .unwrap()
    }
}

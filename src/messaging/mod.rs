//! RabbitMQ. One shared connection per process, kept up by a supervisor that reconnects with
//! backoff; its state feeds `/readyz`. (The payment-link RPC and the per-service order messages
//! build on this connection.)

use std::sync::{Arc, RwLock};
use std::time::Duration;

use lapin::{Connection, ConnectionProperties};

use crate::secret::SecretUrl;

#[derive(Clone, Default)]
pub struct Broker {
    connection: Arc<RwLock<Option<Arc<Connection>>>>,
}

impl std::fmt::Debug for Broker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Broker")
            .field("connected", &self.is_connected())
            .finish()
    }
}

impl Broker {
    /// Starts the supervisor; the broker may be down now and come up later.
    pub fn start(url: SecretUrl) -> (Self, tokio::task::JoinHandle<()>) {
        crate::tls::install_provider();
        let broker = Self::default();
        let task = tokio::spawn(broker.clone().supervise(url));
        (broker, task)
    }

    pub fn is_connected(&self) -> bool {
        self.connection
            .read()
            .map(|c| c.as_ref().is_some_and(|c| c.status().connected()))
            .unwrap_or(false)
    }

    /// The shared connection, when it is up.
    pub fn connection(&self) -> Option<Arc<Connection>> {
        self.connection.read().ok().and_then(|c| c.clone())
    }

    fn set(&self, c: Option<Arc<Connection>>) {
        if let Ok(mut slot) = self.connection.write() {
            *slot = c;
        }
    }

    async fn supervise(self, url: SecretUrl) {
        let url = with_heartbeat(url.expose());
        let mut failures: u32 = 0;
        loop {
            let props = ConnectionProperties::default().with_connection_name("payfleet".into());
            match Connection::connect(&url, props).await {
                Ok(c) => {
                    if failures > 0 {
                        tracing::info!("connected to RabbitMQ");
                    }
                    failures = 0;
                    self.set(Some(Arc::new(c)));
                    // Watch the connection; lapin reports a lost one through its status.
                    loop {
                        tokio::time::sleep(Duration::from_millis(500)).await;
                        let alive = self
                            .connection()
                            .is_some_and(|c| c.status().connected() || c.status().connecting());
                        if !alive {
                            tracing::warn!("RabbitMQ connection lost; reconnecting");
                            break;
                        }
                    }
                    self.set(None);
                }
                Err(e) => {
                    failures += 1;
                    if failures == 1 || failures.is_multiple_of(30) {
                        tracing::warn!(error = %e, "cannot connect to RabbitMQ; retrying");
                    }
                    tokio::time::sleep(Duration::from_millis(
                        (250u64 << failures.min(4)).min(5_000),
                    ))
                    .await;
                }
            }
        }
    }
}

/// Adds a 30 s heartbeat unless the URL sets one, so a dead peer is noticed.
fn with_heartbeat(url: &str) -> String {
    if url.contains("heartbeat=") {
        url.to_owned()
    } else if url.contains('?') {
        format!("{url}&heartbeat=30")
    } else {
        format!("{url}?heartbeat=30")
    }
}

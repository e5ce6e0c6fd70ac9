//! A fleet of its own for the benchmarks and the soak: a scratch database (recreated every run,
//! so real data is never touched), the internal gateway under a new secret with the simulator
//! on, broker queues of its own, and payfleet's roles run as child processes of this binary.

use std::str::FromStr;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use sqlx::PgPool;
use sqlx::postgres::PgConnectOptions;

use payfleet::config::Config;
use payfleet::db;
use payfleet::secret::{SecretUrl, StandardSecret};

/// The database `<configured name>_<purpose>`, dropped and made again, migrated; and a pool of
/// at most `connections` on it.
pub async fn database(
    config: &Config,
    purpose: &str,
    connections: u32,
) -> anyhow::Result<(PgPool, SecretUrl)> {
    let options = PgConnectOptions::from_str(config.database_url.expose())?;
    let name = format!("{}_{purpose}", options.get_database().unwrap_or("payfleet"));
    let drop = format!(
        "DROP DATABASE IF EXISTS {} WITH (FORCE)",
        db::quote_ident(&name)
    );
    db::on_maintenance_database(&options, drop)
        .await
        .context("cannot drop the scratch database")?;
    let url = SecretUrl::new(with_database(config.database_url.expose(), &name)?);
    let pool = db::connect(&url, connections, purpose).await?;
    db::migrate(&pool).await?;
    Ok((pool, url))
}

/// The configuration with the internal gateway under a new secret (returned, to sign with) and
/// the simulator on, and broker queues of its own (`<purpose>-<random>`): a scratch database of
/// its own, whose payments are the run's, no money.
/// (The secret's text too, for a child process's environment.)
pub fn simulated(config: &Config, purpose: &str) -> (Config, StandardSecret, String) {
    let (secret, text) = StandardSecret::generate();
    let mut app = config.clone();
    let gateways = &mut app.gateways;
    gateways.stripe = Default::default();
    gateways.mercadopago = Default::default();
    gateways.razorpay = Default::default();
    gateways.hosted.internal = Some(secret.clone());
    gateways.hosted.mock = None;
    gateways.hosted.internal_acquirer = payfleet::gateways::hosted::InternalAcquirer::Simulator;
    gateways.hosted.simulator = true;
    // Broker queues of its own, as it has a database of its own: the default namespace may be
    // another fleet's (whose queues, declared otherwise, would be used as they are).
    app.messaging.namespace = format!("{purpose}-{:08x}", rand::random::<u32>());
    app.messaging.queue_ttl_ms = Some(600_000);
    (app, secret, text)
}

/// `url` naming database `name` instead of its own.
pub fn with_database(url: &str, name: &str) -> anyhow::Result<String> {
    let (base, query) = match url.split_once('?') {
        Some((b, q)) => (b, Some(q)),
        None => (url, None),
    };
    let scheme_end = base
        .find("://")
        .map(|i| i + 3)
        .context("DATABASE_URL has no scheme")?;
    let path_start = base[scheme_end..]
        .find('/')
        .map(|i| i + scheme_end)
        .unwrap_or(base.len());
    let mut out = format!("{}/{name}", &base[..path_start]);
    if let Some(q) = query {
        out.push('?');
        out.push_str(q);
    }
    Ok(out)
}

/// A free port on the loopback interface, for a child process to listen on, and never one this
/// process handed out before: the listener that found it is closed at once, so the system may
/// give the same port to the next bind, and two children (the soak's receiver and a worker's
/// health server) were once given one port: the second to start could not listen, and the first
/// answered the other's requests.
pub fn free_port() -> anyhow::Result<u16> {
    static GIVEN: std::sync::Mutex<std::collections::BTreeSet<u16>> =
        std::sync::Mutex::new(std::collections::BTreeSet::new());
    for _ in 0..100 {
        let port = std::net::TcpListener::bind("127.0.0.1:0")?
            .local_addr()?
            .port();
        let mut given = GIVEN
            .lock()
            .map_err(|_| anyhow::anyhow!("the ports handed out are poisoned"))?;
        if given.insert(port) {
            return Ok(port);
        }
    }
    anyhow::bail!("the system gave back only ports handed out already")
}

/// `payfleet <role>` with `env`; its log appended to `log` (else discarded).
pub fn spawn(
    env: &[(String, String)],
    role: &str,
    log: Option<&std::path::Path>,
) -> anyhow::Result<tokio::process::Child> {
    let exe = std::env::current_exe().context("cannot find this binary to run the fleet")?;
    let stderr = match log {
        Some(path) => std::process::Stdio::from(
            std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(path)
                .with_context(|| format!("cannot open {}", path.display()))?,
        ),
        None => std::process::Stdio::null(),
    };
    tokio::process::Command::new(exe)
        .arg(role)
        .envs(env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
        .env("RUST_LOG", "warn")
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(stderr)
        .kill_on_drop(true)
        .spawn()
        .with_context(|| format!("cannot start payfleet {role}"))
}

/// Sends `signal` (`TERM`, `KILL`) to a child.
pub async fn signal(child: &tokio::process::Child, signal: &str) -> anyhow::Result<()> {
    if let Some(pid) = child.id() {
        tokio::process::Command::new("kill")
            .args([&format!("-{signal}"), &pid.to_string()])
            .status()
            .await
            .context("cannot run kill")?;
    }
    Ok(())
}

/// Asks a child to stop as an operator would (SIGTERM), and waits for it.
pub async fn stop(child: &mut tokio::process::Child) -> anyhow::Result<()> {
    signal(child, "TERM").await?;
    match tokio::time::timeout(Duration::from_secs(30), child.wait()).await {
        Ok(status) => {
            status?;
        }
        Err(_) => child.kill().await?,
    }
    Ok(())
}

/// Waits until the process listening on `port` says it is ready.
pub async fn wait_ready(port: u16) -> anyhow::Result<()> {
    let http = reqwest::Client::new();
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let ready = http
            .get(format!("http://127.0.0.1:{port}/readyz"))
            .send()
            .await
            .is_ok_and(|r| r.status().is_success());
        if ready {
            return Ok(());
        }
        if Instant::now() > deadline {
            bail!("the process on port {port} was not ready within 60 s");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[cfg(test)]
mod tests {
    /// Every port handed out is one no child was given before, whatever the system's binds
    /// give back.
    #[test]
    fn free_ports_are_never_handed_out_twice() {
        let ports: Vec<u16> = (0..200).map(|_| super::free_port().unwrap()).collect();
        let distinct: std::collections::BTreeSet<u16> = ports.iter().copied().collect();
        assert_eq!(distinct.len(), ports.len());
    }
}

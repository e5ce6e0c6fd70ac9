//! The fleet under fire: one receiver and several workers, child processes of this binary, which
//! the soak kills (`kill -9`) and starts again; and the TCP path to RabbitMQ, through a proxy of
//! the soak's own so that it can cut the fleet's broker connections without touching anyone
//! else's.

use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::Context;
use tokio::net::{TcpListener, TcpStream};
use tokio::process::Child;
use tokio::task::AbortHandle;

use crate::scratch;

/// A process of the fleet: its role, its port, and the child while it runs.
struct Member {
    role: &'static str,
    port: u16,
    child: Option<Child>,
}

pub struct Fleet {
    env: Vec<(String, String)>,
    log: PathBuf,
    receiver: Member,
    workers: Vec<Member>,
    /// Processes that ended without being told to: a crash is a finding.
    pub crashes: Vec<String>,
}

impl Fleet {
    /// Starts the receiver on `receiver_port` and `workers` workers, and waits until each is ready.
    pub async fn start(
        env: Vec<(String, String)>,
        receiver_port: u16,
        workers: usize,
        log: PathBuf,
    ) -> anyhow::Result<Self> {
        let mut fleet = Self {
            env,
            log,
            receiver: Member {
                role: "serve",
                port: receiver_port,
                child: None,
            },
            workers: Vec::new(),
            crashes: Vec::new(),
        };
        for _ in 0..workers {
            fleet.workers.push(Member {
                role: "work",
                port: scratch::free_port()?,
                child: None,
            });
        }
        fleet.run(None)?;
        for i in 0..workers {
            fleet.run(Some(i))?;
        }
        fleet.ready().await?;
        Ok(fleet)
    }

    pub fn workers(&self) -> usize {
        self.workers.len()
    }

    fn member(&mut self, worker: Option<usize>) -> &mut Member {
        match worker {
            None => &mut self.receiver,
            Some(i) => &mut self.workers[i],
        }
    }

    /// Starts the member (`None`: the receiver) if it is not running.
    fn run(&mut self, worker: Option<usize>) -> anyhow::Result<()> {
        let mut env = self.env.clone();
        let log = self.log.clone();
        let m = self.member(worker);
        if m.child.is_some() {
            return Ok(());
        }
        let bind = if m.role == "serve" {
            "PAYFLEET_BIND"
        } else {
            "PAYFLEET_WORKER_BIND"
        };
        env.push((bind.into(), format!("127.0.0.1:{}", m.port)));
        m.child = Some(scratch::spawn(&env, m.role, Some(&log))?);
        Ok(())
    }

    /// `kill -9` of the member; it stays down until [`Fleet::revive`].
    pub async fn kill(&mut self, worker: Option<usize>) -> anyhow::Result<()> {
        self.notice_crashes();
        let m = self.member(worker);
        if let Some(mut child) = m.child.take() {
            scratch::signal(&child, "KILL").await?;
            let _ = child.wait().await;
        }
        Ok(())
    }

    /// Starts every member that is down.
    pub fn revive(&mut self) -> anyhow::Result<()> {
        self.notice_crashes();
        self.run(None)?;
        for i in 0..self.workers.len() {
            self.run(Some(i))?;
        }
        Ok(())
    }

    /// Waits until every member answers ready.
    pub async fn ready(&self) -> anyhow::Result<()> {
        scratch::wait_ready(self.receiver.port).await?;
        for w in &self.workers {
            scratch::wait_ready(w.port).await?;
        }
        Ok(())
    }

    /// Records the members that ended on their own, and clears them so `revive` starts them.
    pub fn notice_crashes(&mut self) {
        let mut crashed = Vec::new();
        for m in std::iter::once(&mut self.receiver).chain(self.workers.iter_mut()) {
            if let Some(child) = &mut m.child
                && let Ok(Some(status)) = child.try_wait()
            {
                crashed.push(format!(
                    "payfleet {} (port {}) ended on its own: {status}",
                    m.role, m.port
                ));
                m.child = None;
            }
        }
        self.crashes.extend(crashed);
    }

    /// Stops every member as an operator would (SIGTERM).
    pub async fn stop(&mut self) -> anyhow::Result<()> {
        self.notice_crashes();
        for m in std::iter::once(&mut self.receiver).chain(self.workers.iter_mut()) {
            if let Some(mut child) = m.child.take() {
                scratch::stop(&mut child).await?;
            }
        }
        Ok(())
    }
}

/// A TCP proxy to one address; [`TcpProxy::cut`] closes every connection through it (the fleet
/// sees its broker connection drop, as in a network fault or a broker restart).
#[derive(Clone)]
pub struct TcpProxy {
    pub port: u16,
    open: Arc<Mutex<Vec<AbortHandle>>>,
}

impl TcpProxy {
    pub async fn start(upstream: String) -> anyhow::Result<Self> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let port = listener.local_addr()?.port();
        let open: Arc<Mutex<Vec<AbortHandle>>> = Arc::default();
        let registry = open.clone();
        tokio::spawn(async move {
            while let Ok((mut inbound, _)) = listener.accept().await {
                let upstream = upstream.clone();
                let task = tokio::spawn(async move {
                    if let Ok(mut outbound) = TcpStream::connect(&upstream).await {
                        let _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound).await;
                    }
                });
                if let Ok(mut r) = registry.lock() {
                    r.retain(|h| !h.is_finished());
                    r.push(task.abort_handle());
                }
            }
        });
        Ok(Self { port, open })
    }

    /// Closes every connection through the proxy; returns how many.
    pub fn cut(&self) -> usize {
        let Ok(mut open) = self.open.lock() else {
            return 0;
        };
        let n = open.iter().filter(|h| !h.is_finished()).count();
        for h in open.drain(..) {
            h.abort();
        }
        n
    }
}

/// Restarts the PostgreSQL cluster the soak runs on (`pg_ctlcluster ... restart`), when this
/// machine has one the soak may restart.
pub async fn restart_postgres() -> anyhow::Result<()> {
    let version = std::fs::read_dir("/etc/postgresql")
        .context("no /etc/postgresql: not a Debian PostgreSQL cluster the soak can restart")?
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .next()
        .context("no cluster under /etc/postgresql")?;
    let status = tokio::process::Command::new("pg_ctlcluster")
        .args([
            "--skip-systemctl-redirect",
            &version,
            "main",
            "restart",
            "-m",
            "fast",
        ])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .status()
        .await
        .context("cannot run pg_ctlcluster")?;
    if !status.success() {
        anyhow::bail!("pg_ctlcluster restart failed: {status}");
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    Ok(())
}

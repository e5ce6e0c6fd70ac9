//! The one way to assemble a process: [`start`] runs the parts of its [`Roles`] (the HTTP
//! receiver, the worker fleet, or both) from a configuration, a pool and a listener. The CLI's
//! `serve`, `work` and `up`, the benchmarks and the tests' `spawn_app` all go through it, the
//! tests with a listener on port 0 and a database of their own.

use std::future::Future;
use std::net::SocketAddr;
use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use sqlx::PgPool;
use sqlx::postgres::PgConnectOptions;
use tokio::net::TcpListener;
use tokio::sync::oneshot;

use crate::auth::ApiKeys;
use crate::config::{Config, ListenTo};
use crate::gateways::GatewayRegistry;
use crate::gateways::hosted::HostedGateway;
use crate::http::{self, AppState, Callers, Readiness};
use crate::ledger::coins::CoinService;
use crate::ledger::jobs as ledger_jobs;
use crate::messaging::Broker;
use crate::messaging::orders as order_messages;
use crate::messaging::rpc::{self, RpcClient};
use crate::orders;
use crate::orders::checkout::{self, Checkout};
use crate::payments::batch::{BatchSettings, Batcher};
use crate::payments::delivery::{Deliverer, QueueSink};
use crate::payments::links::LinkService;
use crate::payments::{self, Processor};
use crate::recurring::{self, Tasks};
use crate::telemetry::Telemetry;
use crate::webhooks::{EventWriter, Verifier};
use payfleet_queue::{Census, Fleet, FleetHandle, JobError, Listen, Notifier, Registry};

/// What a process runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Roles {
    /// The HTTP receiver: webhooks, health, metrics.
    pub serve: bool,
    /// The worker fleet (and, given a listener, its health and metrics).
    pub work: bool,
}

impl Roles {
    pub const SERVE: Roles = Roles {
        serve: true,
        work: false,
    };
    pub const WORK: Roles = Roles {
        serve: false,
        work: true,
    };
    pub const UP: Roles = Roles {
        serve: true,
        work: true,
    };

    /// The subcommand that runs these roles, as its connections are named (`payfleet work`).
    pub fn name(self) -> &'static str {
        match (self.serve, self.work) {
            (true, true) => "up",
            (false, true) => "work",
            _ => "serve",
        }
    }
}

/// The processor as configured: Mercado Pago events need API access to read the payment, and a
/// success that carries no amount is asked of its gateway (`gateways`).
pub fn processor(
    config: &Config,
    gateways: GatewayRegistry,
    telemetry: Telemetry,
) -> anyhow::Result<Processor> {
    let mercadopago = config
        .gateways
        .mercadopago
        .reader()
        .context("cannot build the Mercado Pago client")?;
    Ok(Processor {
        mercadopago,
        internal_acquirer: config.gateways.internal_acquirer(),
        gateways,
        fee_percent: config.orders.platform_fee_percent,
        telemetry,
    })
}

/// The gateways buyers can pay through, and the hosted ones by themselves for their payment
/// pages (`gateways::Settings::clients`); the hosted ones' events are delivered by the queue.
pub fn gateways(
    config: &Config,
    pool: &PgPool,
) -> anyhow::Result<(GatewayRegistry, Vec<HostedGateway>)> {
    Ok(config
        .gateways
        .clients(pool, &config.public_url, Arc::new(QueueSink))?)
}

/// Every job kind this fleet runs: each context registers its own kinds with their workers.
pub fn registry(config: &Config, pool: &PgPool) -> anyhow::Result<Registry> {
    registry_with(config, pool, Telemetry::default(), None)
}

/// [`registry`], its workers measured in `telemetry`, and sized by `census` where they share
/// with the fleet's other workers (the fleet that runs them keeps it: [`Fleet::census`]).
pub fn registry_with(
    config: &Config,
    pool: &PgPool,
    telemetry: Telemetry,
    census: Option<&Census>,
) -> anyhow::Result<Registry> {
    let (gateways, hosted) = gateways(config, pool)?;
    let processor = Arc::new(processor(config, gateways.clone(), telemetry)?);
    let batches = BatchSettings::for_process(config.event_batches);
    let batcher = Batcher::start(pool.clone(), processor, batches, census);
    let deliverer = Deliverer::new(pool.clone(), config.gateways.hosted.targets())
        .context("cannot build the event deliverer")?;
    let mut registry = Registry::new();
    orders::register(&mut registry)?;
    payments::register(&mut registry, batcher, deliverer, gateways.clone())?;
    recurring::register(
        &mut registry,
        recurring::Runner {
            tasks: recurring_tasks(config, pool, &gateways, &hosted),
            schedules: config.recurring.clone(),
        },
    )?;
    // A catalogue without one of the fleet's queues (a file of an older release, or one
    // written by hand) would start, and that queue's jobs (payment events, say) would wait
    // for ever with no worker to claim them: refused here instead, naming what is missing.
    let missing = registry.undefined_queues(&config.queues);
    if !missing.is_empty() {
        let mut by_queue: std::collections::BTreeMap<&str, Vec<&str>> = Default::default();
        for (kind, queue) in &missing {
            by_queue.entry(queue).or_default().push(kind);
        }
        let list: Vec<String> = by_queue
            .iter()
            .map(|(queue, kinds)| format!("[queues.{queue}] (for {})", kinds.join(", ")))
            .collect();
        anyhow::bail!(
            "the queue catalogue (PAYFLEET_QUEUES, else jobs/queues.toml) does not define {}: no worker would ever run those jobs; add them (the repository's jobs/queues.toml defines every queue)",
            list.join(", ")
        );
    }
    Ok(registry)
}

/// The internal gateway's subscription billing: its links made here (a worker is the payment
/// side), charged by the internal gateway where the simulator runs it.
pub fn biller(
    config: &Config,
    pool: &PgPool,
    gateways: &GatewayRegistry,
    hosted: &[HostedGateway],
) -> payments::renewals::Biller {
    payments::renewals::Biller {
        links: LinkService {
            pool: pool.clone(),
            gateways: gateways.clone(),
            in_flight: Default::default(),
        },
        internal: hosted
            .iter()
            .find(|g| g.name() == crate::gateways::GatewayName::Internal)
            .cloned(),
        billing: crate::orders::subscriptions::Billing {
            fee_percent: config.orders.platform_fee_percent,
            period: config.orders.subscription_period,
            expiry: config.orders.expiry,
        },
    }
}

/// What each recurring job of `jobs/recurring.toml` does: the ledger's runs, reconciliation,
/// the consistency checks and the housekeeping.
pub fn recurring_tasks(
    config: &Config,
    pool: &PgPool,
    gateways: &GatewayRegistry,
    hosted: &[HostedGateway],
) -> Tasks {
    let fleet = config.queues.fleet.clone();
    let invoice_zone = config.ledger.invoice_timezone;
    let mut tasks = Tasks::default();
    tasks
        .add("payouts", ledger_jobs::payouts)
        .add("invoices", move |pool, period| {
            ledger_jobs::invoices(pool, period, invoice_zone)
        })
        .add("holding_release", ledger_jobs::release)
        .add("prune", move |pool, _period| {
            prune(
                pool,
                fleet.completed_retention_secs,
                fleet.discarded_retention_secs,
            )
        });
    payments::reconcile::add_task(&mut tasks, gateways.clone(), config.reconcile.clone());
    crate::consistency::add_task(&mut tasks, config.consistency.grace);
    payments::renewals::add_task(&mut tasks, biller(config, pool, gateways, hosted));
    tasks
}

/// The housekeeping: finished jobs past their retention, the consumers' records of the order
/// messages they handled, the first askings of payment links, and the askings about overdue
/// subscription periods.
async fn prune(pool: PgPool, completed_secs: u64, discarded_secs: u64) -> Result<(), JobError> {
    let n = payfleet_queue::prune(&pool, completed_secs, discarded_secs).await?;
    if n > 0 {
        tracing::info!(jobs = n, "pruned finished jobs");
    }
    let n = order_messages::prune_consumed(&pool, order_messages::CONSUMED_RETENTION).await?;
    if n > 0 {
        tracing::info!(messages = n, "pruned consumed order message records");
    }
    let n = payments::links::prune_asks(&pool).await?;
    if n > 0 {
        tracing::info!(links = n, "pruned the first askings of payment links");
    }
    let n = payments::reconcile::prune_period_checks(&pool).await?;
    if n > 0 {
        tracing::info!(
            periods = n,
            "pruned the askings about overdue subscription periods"
        );
    }
    Ok(())
}

/// A started process. [`Running::stop`] stops it gracefully: the server first (no new
/// requests), then the workers.
pub struct Running {
    addr: Option<SocketAddr>,
    /// The receiver's route paths (none for a worker).
    paths: Vec<&'static str>,
    server: Option<(
        oneshot::Sender<()>,
        tokio::task::JoinHandle<std::io::Result<()>>,
    )>,
    fleet: Option<FleetHandle>,
    scheduler: Option<(oneshot::Sender<()>, tokio::task::JoinHandle<()>)>,
    broker: Broker,
    /// The receiver's RPC client (none for a worker).
    rpc: Option<RpcClient>,
    /// The RPC consumers a worker starts (none for a receiver).
    rpc_servers: usize,
}

impl Running {
    /// Where the HTTP server listens, if this process serves.
    pub fn addr(&self) -> Option<SocketAddr> {
        self.addr
    }

    /// Every route path the receiver serves: what a test walks to find a route without a
    /// caller.
    pub fn paths(&self) -> &[&'static str] {
        &self.paths
    }

    pub fn fleet(&self) -> Option<&FleetHandle> {
        self.fleet.as_ref()
    }

    pub fn broker(&self) -> &Broker {
        &self.broker
    }

    /// Whether this process's RPC calls could be sent now (a worker has none to send): its
    /// channel to the broker is set up, with the consumer its answers come back to; and
    /// whether a worker's RPC consumers take requests (a request sent before would be lost).
    pub fn rpc_ready(&self) -> bool {
        self.rpc.as_ref().is_none_or(RpcClient::is_ready)
            && self.broker.answering() >= self.rpc_servers
    }

    /// Runs until `shutdown` resolves (or the server fails), then stops.
    pub async fn until(mut self, shutdown: impl Future<Output = ()>) -> anyhow::Result<()> {
        let served = match self.server.as_mut() {
            Some((_, task)) => {
                tokio::select! {
                    r = task => Some(r),
                    _ = shutdown => None,
                }
            }
            None => {
                shutdown.await;
                None
            }
        };
        if let Some(r) = served {
            self.server = None;
            self.stop().await;
            r.context("the HTTP server task failed")?
                .context("the HTTP server stopped")?;
            anyhow::bail!("the HTTP server stopped by itself");
        }
        self.stop().await;
        Ok(())
    }

    pub async fn stop(mut self) {
        if let Some((stop, task)) = self.server.take() {
            let _ = stop.send(());
            match task.await {
                Ok(Ok(())) => {}
                Ok(Err(e)) => tracing::error!(error = %e, "the HTTP server failed while stopping"),
                Err(e) => tracing::error!(error = %e, "the HTTP server task failed"),
            }
        }
        if let Some((stop, task)) = self.scheduler.take() {
            let _ = stop.send(());
            let _ = task.await;
        }
        // No more payment-link requests taken; the connection closes.
        self.broker.stop();
        if let Some(fleet) = self.fleet.take() {
            fleet.shutdown().await;
        }
    }
}

/// Starts the parts of `roles` on the current runtime. `listener` is where HTTP is served: the
/// receiver for `serve`, only health and metrics for a `work` process (none: no HTTP).
/// Refuses a public URL made up from `PAYFLEET_BIND` where it cannot be right: listening on
/// every address (`http://0.0.0.0:8080` reaches no buyer), or a worker bound to a routable
/// address whose gateways put the public URL in their links (Stripe's return pages, Razorpay's
/// callback: the workers make the links, and a worker's own address is not its receiver's). A
/// worker on the loopback default beside its receiver (the Procfile on one machine) needs
/// nothing set; `up` checks this before it migrates.
pub fn check_public_url(config: &Config, roles: Roles) -> anyhow::Result<()> {
    if config.public_url_given {
        return Ok(());
    }
    if config.bind.ip().is_unspecified() {
        anyhow::bail!(
            "PAYFLEET_PUBLIC_URL is not set and PAYFLEET_BIND={} listens on every address: {} is no address a buyer can reach; set PAYFLEET_PUBLIC_URL to where buyers reach the receiver",
            config.bind,
            config.public_url
        );
    }
    let linking = config.gateways.links_with_public_url();
    if !roles.work || roles.serve || linking.is_empty() {
        return Ok(());
    }
    let names = crate::gateways::joined(&linking, ", ");
    if config.bind.ip().is_loopback() {
        // Right for the Procfile on one machine, wrong on a host of workers alone: said, not
        // refused.
        tracing::warn!(
            public_url = %config.public_url,
            gateways = %names,
            "PAYFLEET_PUBLIC_URL is not set on this worker, which makes the payment links with it: right only where the receiver listens on this machine at PAYFLEET_BIND"
        );
        return Ok(());
    }
    anyhow::bail!(
        "PAYFLEET_PUBLIC_URL is not set on this worker: workers make the payment links, with the pages {names} sends buyers back to, and {} (from PAYFLEET_BIND) is not where buyers reach the receiver; set it as on `payfleet serve`",
        config.public_url
    )
}

pub fn start(
    config: &Config,
    pool: PgPool,
    roles: Roles,
    listener: Option<TcpListener>,
) -> anyhow::Result<Running> {
    config.gateways.check()?;
    check_public_url(config, roles)?;
    let simulated = config.gateways.hosted.simulated();
    if !simulated.is_empty() {
        tracing::warn!(
            gateways = ?simulated,
            "PAYFLEET_PAYMENT_SIMULATOR is on: these gateways' payments are simulated and move no money; never run this where money is real"
        );
    }
    let telemetry = Telemetry::default();
    let broker = Broker::start_with(
        config.amqp_url.clone(),
        &config.messaging.namespace,
        config.messaging.queue_ttl_ms,
        config.messaging.queues,
    )
    .observed(telemetry.clone());
    let (gateways, hosted) = gateways(config, &pool)?;
    let mut rpc_servers = 0;
    let fleet = if roles.work {
        let listen = match &config.listen {
            ListenTo::Database => Listen::Database,
            ListenTo::Direct(url) => Listen::Direct(Box::new(
                PgConnectOptions::from_str(url.expose())
                    .context("PAYFLEET_LISTEN_URL is not a valid PostgreSQL URL")?,
            )),
            ListenTo::Off => Listen::Off,
        };
        let census = Census::default();
        let fleet = Fleet::new(
            pool.clone(),
            registry_with(config, &pool, telemetry.clone(), Some(&census))?,
            config.queues.clone(),
            &config.host_name,
        )
        .census(census)
        .listen(listen)
        .observe(Arc::new(telemetry.clone()))
        .start();
        // The invoices' time zone is the fleet's: recorded as a worker starts (once; a database
        // not reachable yet is left to the `invoices` job, which records it too).
        let (recording, zone) = (pool.clone(), config.ledger.invoice_timezone);
        tokio::spawn(async move {
            match crate::ledger::invoices::record_zone(&recording, zone).await {
                Ok(recorded) if recorded != zone.name() => {
                    // Said at start, not first at the month's run: this worker's invoice runs
                    // are refused until its zone is the one the invoices are made in.
                    tracing::error!(
                        recorded,
                        configured = zone.name(),
                        "PAYFLEET_INVOICE_TIMEZONE differs from the zone this database's invoices are made in: this worker's invoice runs will be refused; set it to the recorded zone"
                    );
                }
                Ok(_) => {}
                Err(e) => {
                    tracing::warn!(error = %e, "the invoices' time zone was not recorded at start; the invoices job records it");
                }
            }
        });
        // The payment side of the payment-link RPC lives in the workers.
        let links = Arc::new(LinkService {
            pool: pool.clone(),
            gateways: gateways.clone(),
            in_flight: payments::links::InFlight::new(config.gateways.internal_acquirer()),
        });
        rpc_servers = payments::links::serve(&broker, links, payments::links::LINK_SLOTS);
        let coins = Arc::new(CoinService { pool: pool.clone() });
        tokio::spawn(rpc::serve::<rpc::Coins>(broker.clone(), coins, 16));
        rpc_servers += 1;
        // Order messages leave through the outbox; every worker relays (they share the rows).
        tokio::spawn(order_messages::relay(
            broker.clone(),
            pool.clone(),
            config.messaging.order_routes.clone(),
            Duration::from_millis(200),
            orders::outbox::OrderOutbox,
        ));
        tokio::spawn(order_messages::keep_unrouted(
            broker.clone(),
            pool.clone(),
            config.messaging.order_routes.clone(),
            orders::outbox::OrderOutbox,
        ));
        tokio::spawn(order_messages::keep_dead_lettered(
            broker.clone(),
            pool.clone(),
        ));
        // Sales whose job stopped before posting them (ledger::poster): every worker sweeps.
        tokio::spawn(crate::ledger::poster::sweep(
            pool.clone(),
            Duration::from_secs(1),
            Duration::from_secs(1),
        ));
        Some(fleet)
    } else {
        None
    };
    // Each worker process ticks the schedules; the database decides who runs each period.
    let scheduler = roles.work.then(|| {
        let (stop, stopped) = oneshot::channel::<()>();
        let task = tokio::spawn(recurring::schedule(
            pool.clone(),
            config.recurring.clone(),
            async {
                let _ = stopped.await;
            },
        ));
        (stop, task)
    });
    let readiness = Readiness {
        pool: pool.clone(),
        events: None,
        fleet: fleet.as_ref().map(FleetHandle::probe),
        broker: roles.work.then(|| broker.clone()),
        database: Default::default(),
    };
    let mut rpc_client = None;
    let router = if roles.serve {
        let events = EventWriter::start(
            payfleet_queue::pg::part_of(&pool.connect_options(), "webhook writer"),
            Some(Notifier::start(pool.clone())),
            config.webhooks.queue_capacity,
        );
        let readiness = Readiness {
            events: Some(events.clone()),
            ..readiness
        };
        let rpc = RpcClient::start(broker.clone(), config.messaging.rpc_timeout);
        rpc_client = Some(rpc.clone());
        let checkout = Checkout {
            pool: pool.clone(),
            links: Arc::new(rpc::BatchedLinks::start(
                rpc.clone(),
                rpc::BatchedLinks::together(config.gateways.internal_acquirer()),
            )),
            fee_percent: config.orders.platform_fee_percent,
            expiry: config.orders.expiry,
            gateways: gateways.names(),
            rpc_timeout: config.messaging.rpc_timeout,
            writer: checkout::Writer::start(
                pool.clone(),
                config.orders.platform_fee_percent,
                config.orders.expiry,
            ),
        };
        let callers = Callers::new(
            config.admin_token.clone(),
            config.metrics_token.clone(),
            Some(if config.development {
                ApiKeys::new(pool.clone()).with_development_keys()
            } else {
                ApiKeys::new(pool.clone())
            }),
            config.http.client_address_header.clone(),
        );
        Some(http::router(AppState {
            pool: pool.clone(),
            verifier: Verifier::new(
                config.gateways.signature_checks(),
                config.webhooks.tolerance_secs,
            ),
            events,
            webhook_body_limit: config.webhooks.body_limit,
            readiness,
            counters: Arc::default(),
            checkout,
            hosted,
            public_url: config.public_url.clone(),
            callers,
            metrics_refresh: config.metrics_refresh,
            razorpay_key_id: config.gateways.razorpay.key_id(),
            gateways: gateways.clone(),
            rpc,
            recurring: config.recurring.clone(),
            secure_cookies: config.public_url.starts_with("https://"),
            telemetry,
        }))
    } else {
        listener.as_ref().map(|_| {
            let callers = Callers::new(
                config.admin_token.clone(),
                config.metrics_token.clone(),
                None,
                config.http.client_address_header.clone(),
            );
            (
                http::worker_router(
                    pool.clone(),
                    readiness,
                    callers,
                    config.metrics_refresh,
                    telemetry,
                ),
                Vec::new(),
            )
        })
    };
    let mut addr = None;
    let mut paths = Vec::new();
    let server = match (router, listener) {
        (Some((router, routes)), Some(listener)) => {
            addr = Some(
                listener
                    .local_addr()
                    .context("the listener has no address")?,
            );
            paths = routes;
            let (stop, stopped) = oneshot::channel::<()>();
            let limits = config.http.clone();
            let task = tokio::spawn(http::server::serve(listener, router, limits, async {
                let _ = stopped.await;
            }));
            Some((stop, task))
        }
        _ => None,
    };
    Ok(Running {
        addr,
        paths,
        server,
        fleet,
        scheduler,
        broker,
        rpc: rpc_client,
        rpc_servers,
    })
}

/// Resolves on SIGTERM or Ctrl-C.
pub async fn shutdown_signal() {
    let ctrl_c = async {
        if let Err(e) = tokio::signal::ctrl_c().await {
            tracing::error!(error = %e, "cannot listen for Ctrl-C");
            std::future::pending::<()>().await;
        }
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(e) => {
                tracing::error!(error = %e, "cannot listen for SIGTERM");
                std::future::pending::<()>().await;
            }
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => {},
        _ = term => {},
    }
    tracing::info!("shutting down");
}

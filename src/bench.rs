//! `payfleet bench ingest`, `payfleet bench queue` and `payfleet bench e2e` (its own module):
//! benchmarks anyone can run against the configured PostgreSQL server. Each works in a scratch
//! database (`<name>_bench`, `crate::scratch`), measures the machine's own limit in the same run,
//! and prints its figures last as `name=value` lines.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::{Context, bail};
use serde::{Deserialize, Serialize};
use sqlx::PgPool;
use tokio::net::TcpListener;

use payfleet::config::Config;
use payfleet::secret::StandardSecret;
use payfleet::startup::Roles;
use payfleet::{db, startup};
use payfleet_queue::{self as queue, Fleet, Job, JobContext, NewJob, QueuesConfig, Registry};

mod cpu;
mod e2e;
mod load;
pub use e2e::{E2eArgs, e2e};
pub use load::{LoadArgs, load};

#[derive(clap::Args, Debug)]
pub struct IngestArgs {
    /// Requests sent at each concurrency level.
    #[arg(long, default_value_t = 10_000)]
    pub requests: usize,
    /// Concurrent senders, comma separated.
    #[arg(long, value_delimiter = ',', default_value = "1,8,32")]
    pub concurrency: Vec<usize>,
}

#[derive(clap::Args, Debug)]
pub struct QueueArgs {
    /// Jobs enqueued, then drained.
    #[arg(long, default_value_t = 100_000)]
    pub jobs: usize,
    /// Jobs enqueued one at a time into a running fleet to measure enqueue-to-start latency.
    #[arg(long, default_value_t = 2000)]
    pub latency_samples: usize,
    /// Jobs left in the table while the drain is measured: this many scheduled a day ahead on
    /// the drained queue (a marketplace's open orders' expiry jobs) and as many due now on a
    /// queue no worker serves (an outage's leftovers).
    #[arg(long, default_value_t = 0)]
    pub backlog: usize,
    /// Drain with this many worker processes (`payfleet bench drain-worker`, each with the
    /// default settings) instead of a fleet inside the bench; the latency phase is skipped.
    #[arg(long, default_value_t = 0)]
    pub workers: usize,
    /// One seller's flood for the fairness phase: this many jobs of seller A, while single
    /// jobs of seller B arrive one at a time (0 skips the phase).
    #[arg(long, default_value_t = 100_000)]
    pub fair_flood: usize,
    /// The drained queue's concurrency in each worker process (default: jobs/queues.toml's). A
    /// claim takes at most what the free slots can run, so this also bounds a claim's size.
    #[arg(long)]
    pub concurrency: Option<u32>,
}

/// `payfleet bench drain-worker`'s flags (set by `bench queue`).
#[derive(clap::Args, Debug)]
pub struct DrainWorkerArgs {
    #[arg(long)]
    pub concurrency: Option<u32>,
}

/// The catalogue with the drained queue's concurrency set, if asked.
fn drained_queues(config: &Config, concurrency: Option<u32>) -> anyhow::Result<QueuesConfig> {
    let mut queues = config.queues.clone();
    if let Some(n) = concurrency {
        queues.set_concurrency(&format!("{}={n}", Noop::QUEUE))?;
    }
    Ok(queues)
}

/// What the no-op jobs' handler saw: how many ran, and the enqueue-to-start wait of each one
/// that carries its enqueue time. Counted in the handler: polling the table would load the
/// machine being measured.
#[derive(Clone, Default)]
struct NoopRuns {
    ran: Arc<AtomicUsize>,
    waits_us: Arc<Mutex<Vec<i64>>>,
}

impl NoopRuns {
    fn registry(&self) -> anyhow::Result<Registry> {
        let runs = self.clone();
        let mut registry = Registry::new();
        registry.register::<Noop, _, _>(move |_ctx: JobContext, job: Noop| {
            let runs = runs.clone();
            async move {
                runs.ran.fetch_add(1, Ordering::Relaxed);
                if job.t > 0
                    && let Ok(mut s) = runs.waits_us.lock()
                {
                    s.push(now_micros() - job.t);
                }
                Ok(())
            }
        })?;
        Ok(registry)
    }

    fn ran(&self) -> usize {
        self.ran.load(Ordering::Relaxed)
    }

    fn timed(&self) -> usize {
        self.waits_us.lock().map(|s| s.len()).unwrap_or(0)
    }

    /// Waits until `count` (`ran` or `timed`) reaches `want`, looking every `every`: the fleet
    /// inside the bench reports to it, so waiting costs PostgreSQL nothing.
    async fn reach(&self, count: fn(&Self) -> usize, want: usize, every: Duration) {
        while count(self) < want {
            tokio::time::sleep(every).await;
        }
    }

    /// The waits seen, shortest first.
    fn sorted_waits(&self) -> Vec<Duration> {
        let mut waits: Vec<Duration> = self
            .waits_us
            .lock()
            .map(|s| {
                s.iter()
                    .map(|us| Duration::from_micros((*us).max(0) as u64))
                    .collect()
            })
            .unwrap_or_default();
        waits.sort();
        waits
    }
}

/// `payfleet bench drain-worker`: a worker process for `bench queue --workers N`, draining the
/// no-op jobs of the scratch database (`DATABASE_URL`) until SIGTERM.
pub async fn drain_worker(config: &Config, args: DrainWorkerArgs) -> anyhow::Result<()> {
    let pool = db::connect(&config.database_url, config.db_pool_size, "bench").await?;
    let fleet = Fleet::new(
        pool,
        NoopRuns::default().registry()?,
        drained_queues(config, args.concurrency)?,
        &config.host_name,
    )
    .start();
    startup::shutdown_signal().await;
    fleet.shutdown().await;
    Ok(())
}

/// The queue the backlog's due jobs wait on: no worker of the bench serves it.
const UNSERVED_QUEUE: &str = "bench_unserved";

/// Peak resident memory of this process since the last [`reset_peak_rss`], in MiB (Linux).
fn peak_rss_mib() -> Option<f64> {
    status_mib("self", "VmHWM:")
}

/// A memory field (`VmRSS:`, `VmHWM:`) of process `pid` (or `self`), in MiB (Linux).
fn status_mib(pid: &str, field: &str) -> Option<f64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let kib: f64 = status
        .lines()
        .find_map(|l| l.strip_prefix(field))?
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()
        .ok()?;
    Some(kib / 1024.0)
}

/// Starts a new peak-memory measurement (Linux: writing 5 to clear_refs resets VmHWM).
fn reset_peak_rss() {
    let _ = std::fs::write("/proc/self/clear_refs", "5");
}

/// Drops and recreates `<database>_bench` and migrates it.
fn percentile(sorted: &[Duration], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i].as_secs_f64() * 1000.0
}

fn body(i: usize) -> String {
    format!(
        r#"{{"type":"payment.succeeded","data":{{"session_id":"bench_sess_{i}","payment_id":"bench_pay_{i}","amount":"19.90","currency":"BRL"}}}}"#
    )
}

pub async fn ingest(config: &Config, args: IngestArgs) -> anyhow::Result<()> {
    if args.concurrency.is_empty() || args.concurrency.contains(&0) || args.requests == 0 {
        bail!("--requests and every --concurrency level must be positive");
    }
    let pgbench = which_pgbench().context("pgbench is needed for the PostgreSQL baseline (Debian: apt-get install postgresql-15 or postgresql-contrib)")?;
    let (pool, url) =
        crate::scratch::database(config, "bench", config.db_pool_size.max(40)).await?;
    let (app_config, secret, _) = crate::scratch::simulated(config, "bench");
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let server = startup::start(&app_config, pool.clone(), Roles::SERVE, Some(listener))?;
    let mut lines = Vec::new();
    let mut results = Vec::new();
    let mut next_id = 0usize;
    for &c in &args.concurrency {
        let per = args.requests.div_ceil(c);
        // Signed before the clock starts, so the figures are the receiver's, not the sender's.
        let mut senders = Vec::with_capacity(c);
        for _ in 0..c {
            let mut requests = Vec::with_capacity(per);
            for _ in 0..per {
                let i = next_id;
                next_id += 1;
                let body = body(i);
                let id = format!("msg_bench_{i}");
                let ts = chrono::Utc::now().timestamp();
                let sig = secret.sign(&id, ts, body.as_bytes());
                requests.push(
                    hyper::Request::post("/webhooks/internal")
                        .header("host", addr.to_string())
                        .header("webhook-id", id)
                        .header("webhook-timestamp", ts.to_string())
                        .header("webhook-signature", sig)
                        .header("content-type", "application/json")
                        .body(http_body_util::Full::new(axum::body::Bytes::from(body)))?,
                );
            }
            senders.push(requests);
        }
        reset_peak_rss();
        let started = Instant::now();
        let mut tasks = Vec::new();
        for requests in senders {
            tasks.push(tokio::spawn(send_all(addr, requests)));
        }
        let mut lat = Vec::new();
        for t in tasks {
            lat.extend(t.await??);
        }
        let secs = started.elapsed().as_secs_f64();
        lat.sort();
        let rps = lat.len() as f64 / secs;
        let (p50, p99) = (percentile(&lat, 0.50), percentile(&lat, 0.99));
        eprintln!("ingest: {c} senders: {rps:.0} webhooks/s, p50 {p50:.2} ms, p99 {p99:.2} ms");
        results.push((c, rps));
        lines.push(format!("ingest_c{c}_per_s={rps:.0}"));
        lines.push(format!("ingest_c{c}_p50_ms={p50:.2}"));
        lines.push(format!("ingest_c{c}_p99_ms={p99:.2}"));
        if let Some(mib) = peak_rss_mib() {
            eprintln!(
                "ingest: {c} senders: peak resident memory {mib:.1} MiB (receiver and senders in one process)"
            );
            lines.push(format!("ingest_c{c}_peak_rss_mib={mib:.1}"));
        }
    }
    let stored: i64 = sqlx::query_scalar("SELECT count(*) FROM payment_events")
        .fetch_one(&pool)
        .await?;
    if stored as usize != next_id {
        bail!("sent {next_id} distinct webhooks but {stored} events are stored");
    }
    lines.extend(refusals(addr, &secret).await?);
    server.stop().await;

    // The baseline: one durable insert per transaction into a table of the same shape.
    let script = events_insert_script(&pool).await?;
    for (c, rps) in results {
        let tx_per_client = (args.requests / c).max(1);
        let script_path = script.to_string_lossy();
        let tps = pgbench_tps(
            &pgbench,
            &[
                "-n",
                "-c",
                &c.to_string(),
                "-j",
                &c.min(2).to_string(),
                "-t",
                &tx_per_client.to_string(),
                "-f",
                &script_path,
            ],
            url.expose(),
        )
        .await?;
        eprintln!(
            "pgbench: {c} clients: {tps:.0} inserts/s; payfleet reaches {:.0}% of it",
            100.0 * rps / tps
        );
        lines.push(format!("pgbench_c{c}_per_s={tps:.0}"));
        lines.push(format!("ingest_c{c}_vs_pgbench={:.2}", rps / tps));
    }
    std::fs::remove_file(&script).ok();
    pool.close().await;
    for l in lines {
        println!("{l}");
    }
    Ok(())
}

/// pgbench's script for the receiver's baseline: one durable insert per transaction of a
/// webhook's row into a table of `payment_events`' shape (`bench_events`, made here).
async fn events_insert_script(pool: &PgPool) -> anyhow::Result<std::path::PathBuf> {
    sqlx::query("CREATE TABLE bench_events (LIKE payment_events INCLUDING DEFAULTS INCLUDING CONSTRAINTS INCLUDING INDEXES)")
        .execute(pool)
        .await?;
    sqlx::query("CREATE SEQUENCE bench_events_seq")
        .execute(pool)
        .await?;
    let script = std::env::temp_dir().join(format!("payfleet-pgbench-{}.sql", std::process::id()));
    let sample = body(0).replace('\'', "''");
    std::fs::write(
        &script,
        format!(
            "INSERT INTO bench_events (gateway, event_id, event_type, raw_body, headers) VALUES ('internal', 'pgb_' || nextval('bench_events_seq'), 'payment.succeeded', convert_to('{sample}', 'UTF8'), '{{\"webhook-id\":\"x\"}}');\n"
        ),
    )?;
    Ok(script)
}

/// The cost of refusing the worst requests a sender can make, beside the machine's own cost
/// of the one HMAC such a request needs: CPU time of this process per refused request, with
/// a 1 MiB body and (a) 8,000 signatures in the header (about 380 KB, under hyper's limit),
/// (b) the most signatures accepted with a fresh timestamp, (c) a stale timestamp.
async fn refusals(
    addr: std::net::SocketAddr,
    secret: &StandardSecret,
) -> anyhow::Result<Vec<String>> {
    const N: usize = 200;
    let body = axum::body::Bytes::from(vec![b'{'; 1024 * 1024 - 4096]);
    let ts = chrono::Utc::now().timestamp();
    let fake = secret.sign("msg_other", ts, b"{}");
    let header = |n: usize| vec![fake.as_str(); n].join(" ");
    let cases = [
        ("refused_8000_signatures", header(8000), ts),
        (
            "refused_max_signatures",
            header(payfleet::gateways::signature::MAX_CANDIDATES),
            ts,
        ),
        ("refused_stale", header(1), ts - 3600),
    ];
    let mut lines = Vec::new();
    for (name, sig, ts) in cases {
        let requests = (0..N)
            .map(|i| {
                hyper::Request::post("/webhooks/internal")
                    .header("host", addr.to_string())
                    .header("webhook-id", format!("msg_refused_{i}"))
                    .header("webhook-timestamp", ts.to_string())
                    .header("webhook-signature", sig.clone())
                    .header("content-type", "application/json")
                    .body(http_body_util::Full::new(body.clone()))
            })
            .collect::<Result<Vec<_>, _>>()?;
        let cpu = process_cpu();
        let started = Instant::now();
        let mut lat = send_expecting(addr, requests, 401).await?;
        let wall = started.elapsed();
        let per_request_ms = process_cpu()
            .zip(cpu)
            .map(|(after, before)| (after - before).as_secs_f64() * 1000.0 / N as f64);
        lat.sort();
        let p99 = percentile(&lat, 0.99);
        match per_request_ms {
            Some(ms) => {
                eprintln!(
                    "ingest: {name}: {ms:.2} ms of CPU per refusal (sender included), p99 {p99:.2} ms, {N} in {wall:?}"
                );
                lines.push(format!("ingest_{name}_cpu_ms={ms:.2}"));
            }
            None => eprintln!("ingest: {name}: p99 {p99:.2} ms (no CPU clock on this system)"),
        }
        lines.push(format!("ingest_{name}_p99_ms={p99:.2}"));
    }
    // The machine's own cost of the one HMAC a refusal with a fresh timestamp must compute.
    let started = Instant::now();
    for i in 0..N {
        std::hint::black_box(secret.sign(&format!("m{i}"), ts, &body));
    }
    let hmac_ms = started.elapsed().as_secs_f64() * 1000.0 / N as f64;
    eprintln!("machine: one HMAC-SHA256 over 1 MiB: {hmac_ms:.2} ms");
    lines.push(format!("hmac_1mib_ms={hmac_ms:.2}"));
    Ok(lines)
}

/// CPU time (user and system) this process has used, where the system tells it (Linux).
fn process_cpu() -> Option<Duration> {
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    // The fields after the command name, which is in parentheses and may hold spaces.
    let fields: Vec<&str> = stat.rsplit_once(')')?.1.split_whitespace().collect();
    let utime: u64 = fields.get(11)?.parse().ok()?;
    let stime: u64 = fields.get(12)?.parse().ok()?;
    // Linux reports clock ticks of 1/100 s (USER_HZ) to user space.
    Some(Duration::from_millis((utime + stime) * 10))
}

/// One sender: its own HTTP/1 connection, one request at a time, as a gateway's delivery worker.
async fn send_all(
    addr: std::net::SocketAddr,
    requests: Vec<hyper::Request<http_body_util::Full<axum::body::Bytes>>>,
) -> anyhow::Result<Vec<Duration>> {
    send_expecting(addr, requests, 200).await
}

/// Sends the requests one after the other on one connection; each must answer `expected`.
async fn send_expecting(
    addr: std::net::SocketAddr,
    requests: Vec<hyper::Request<http_body_util::Full<axum::body::Bytes>>>,
    expected: u16,
) -> anyhow::Result<Vec<Duration>> {
    let mut connection = Connection::open(addr).await?;
    let mut lat = Vec::with_capacity(requests.len());
    for req in requests {
        let t = Instant::now();
        connection.send(req, expected).await?;
        lat.push(t.elapsed());
    }
    connection.close().await;
    Ok(lat)
}

/// A sender's HTTP/1 connection, kept between its requests.
struct Connection {
    sender: hyper::client::conn::http1::SendRequest<http_body_util::Full<axum::body::Bytes>>,
    driver: tokio::task::JoinHandle<Result<(), hyper::Error>>,
}

impl Connection {
    async fn open(addr: std::net::SocketAddr) -> anyhow::Result<Self> {
        let stream = tokio::net::TcpStream::connect(addr).await?;
        stream.set_nodelay(true)?;
        let (sender, conn) =
            hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream)).await?;
        Ok(Self {
            sender,
            driver: tokio::spawn(conn),
        })
    }

    /// Sends one request and reads its answer, which must be `expected`.
    async fn send(
        &mut self,
        req: hyper::Request<http_body_util::Full<axum::body::Bytes>>,
        expected: u16,
    ) -> anyhow::Result<()> {
        use http_body_util::BodyExt;
        self.sender
            .ready()
            .await
            .context("the receiver closed the connection")?;
        let resp = self.sender.send_request(req).await?;
        let status = resp.status();
        let body = resp.into_body().collect().await?.to_bytes();
        if status.as_u16() != expected {
            bail!(
                "webhook answered {status} (expected {expected}): {}",
                String::from_utf8_lossy(&body)
            );
        }
        Ok(())
    }

    async fn close(self) {
        drop(self.sender);
        let _ = self.driver.await;
    }
}

/// Runs pgbench with `args` against `url` and reads its `tps = ` line.
async fn pgbench_tps(pgbench: &std::path::Path, args: &[&str], url: &str) -> anyhow::Result<f64> {
    let out = tokio::process::Command::new(pgbench)
        // The same transport as payfleet's own connections (no TLS).
        .env("PGSSLMODE", "disable")
        .args(args)
        .arg(url)
        .output()
        .await
        .context("cannot run pgbench")?;
    if !out.status.success() {
        bail!("pgbench failed: {}", String::from_utf8_lossy(&out.stderr));
    }
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .find(|l| l.starts_with("tps = "))
        .and_then(|l| l.trim_start_matches("tps = ").split_whitespace().next())
        .and_then(|v| v.parse::<f64>().ok())
        .context("pgbench printed no tps")
}

fn which_pgbench() -> Option<std::path::PathBuf> {
    let mut candidates: Vec<std::path::PathBuf> = std::env::var_os("PATH")
        .map(|p| {
            std::env::split_paths(&p)
                .map(|d| d.join("pgbench"))
                .collect()
        })
        .unwrap_or_default();
    if let Ok(dirs) = std::fs::read_dir("/usr/lib/postgresql") {
        candidates.extend(dirs.flatten().map(|d| d.path().join("bin/pgbench")));
    }
    candidates.into_iter().find(|p| p.is_file())
}

/// A job that does nothing but note when it started.
#[derive(Serialize, Deserialize)]
struct Noop {
    /// Enqueue time, microseconds since the epoch.
    t: i64,
}

impl Job for Noop {
    const KIND: &'static str = "bench_noop";
    const QUEUE: &'static str = "default";
}

fn now_micros() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_micros() as i64)
        .unwrap_or(0)
}

pub async fn queue(config: &Config, args: QueueArgs) -> anyhow::Result<()> {
    if args.jobs == 0 {
        bail!("--jobs must be positive");
    }
    let queues = drained_queues(config, args.concurrency)?;
    let concurrency = queues
        .queue(Noop::QUEUE)
        .map(|q| q.concurrency)
        .with_context(|| format!("jobs/queues.toml has no [queues.{}]", Noop::QUEUE))?;
    let (pool, url) =
        crate::scratch::database(config, "bench", config.db_pool_size.max(40)).await?;
    let mut lines = vec![format!("queue_drain_concurrency={concurrency}")];

    // Enqueue, 1000 jobs a statement.
    let started = Instant::now();
    for chunk in (0..args.jobs).collect::<Vec<_>>().chunks(1000) {
        let jobs: Vec<NewJob> = chunk
            .iter()
            .map(|_| NewJob::of(&Noop { t: 0 }))
            .collect::<Result<_, _>>()?;
        queue::enqueue_many(&pool, &jobs).await?;
    }
    let enqueue_rate = args.jobs as f64 / started.elapsed().as_secs_f64();
    eprintln!(
        "queue: enqueued {} jobs at {enqueue_rate:.0} jobs/s (batches of 1000)",
        args.jobs
    );
    lines.push(format!("queue_enqueue_batch_per_s={enqueue_rate:.0}"));

    // Single-job enqueue, one transaction each, as a web request would do it.
    let singles = (args.jobs / 20).clamp(100, 5000);
    let started = Instant::now();
    for _ in 0..singles {
        queue::enqueue(
            &pool,
            NewJob::of(&Noop { t: 0 })?.run_at(chrono::Utc::now() + chrono::Duration::days(365)),
        )
        .await?;
    }
    let single_rate = singles as f64 / started.elapsed().as_secs_f64();
    eprintln!("queue: single enqueue {single_rate:.0} jobs/s");
    lines.push(format!("queue_enqueue_single_per_s={single_rate:.0}"));
    sqlx::query("DELETE FROM jobs WHERE run_at > now() + interval '1 day'")
        .execute(&pool)
        .await?;

    if args.backlog > 0 {
        let started = Instant::now();
        sqlx::query(
            "INSERT INTO jobs (queue, kind, payload, run_at)
             SELECT $1, $2, '{\"t\": 0}', now() + interval '1 day' + i * interval '1 millisecond'
             FROM generate_series(1, $3) AS i",
        )
        .bind(Noop::QUEUE)
        .bind(Noop::KIND)
        .bind(args.backlog as i64)
        .execute(&pool)
        .await?;
        sqlx::query(
            "INSERT INTO jobs (queue, kind, payload) SELECT $1, $2, '{\"t\": 0}' FROM generate_series(1, $3)",
        )
        .bind(UNSERVED_QUEUE)
        .bind(Noop::KIND)
        .bind(args.backlog as i64)
        .execute(&pool)
        .await?;
        sqlx::query("VACUUM ANALYZE jobs").execute(&pool).await?;
        eprintln!(
            "queue: backlog of {} scheduled jobs on {} and {} due on {UNSERVED_QUEUE} written in {:.1} s",
            args.backlog,
            Noop::QUEUE,
            args.backlog,
            started.elapsed().as_secs_f64()
        );
        lines.push(format!("queue_backlog_jobs={}", args.backlog));
        eprintln!(
            "queue: a claim of 16 due jobs with the backlog in place (rolled back):\n  {}",
            queue::admin::explain_claim(&pool, Noop::QUEUE, 16)
                .await?
                .join("\n  ")
        );
    }

    let peak = compact_size(&pool).await?;
    let runs = NoopRuns::default();
    let registry = runs.registry()?;

    // Drain with the fleet's default settings: inside the bench, or in worker processes.
    reset_peak_rss();
    let started = Instant::now();
    let mut children = Vec::with_capacity(args.workers);
    for _ in 0..args.workers {
        children.push(
            tokio::process::Command::new(std::env::current_exe()?)
                .args([
                    "bench",
                    "drain-worker",
                    "--concurrency",
                    &concurrency.to_string(),
                ])
                .env("DATABASE_URL", url.expose())
                .env("PAYFLEET_RECURRING", "off")
                .stdin(std::process::Stdio::null())
                .stdout(std::process::Stdio::null())
                .stderr(std::process::Stdio::null())
                .kill_on_drop(true)
                .spawn()
                .context("cannot start a drain worker")?,
        );
    }
    let fleet = (args.workers == 0)
        .then(|| Fleet::new(pool.clone(), registry, queues.clone(), &config.host_name).start());
    if fleet.is_some() {
        // The fleet inside the bench counts its runs: no query loads PostgreSQL until they are
        // all done (the check below probes the claim index, which mid-drain costs as much as a
        // claim's probe).
        runs.reach(NoopRuns::ran, args.jobs, Duration::from_millis(5))
            .await;
    }
    let pool2 = pool.clone();
    wait_until(
        || {
            let pool = pool2.clone();
            async move {
                // Drained: nothing due on the queue (the workers' own question, through the
                // claim indexes) and nothing running (through the index of running jobs).
                if queue::admin::next_due_in(&pool, Noop::QUEUE).await? == Some(Duration::ZERO) {
                    return Ok(false);
                }
                let running: bool = sqlx::query_scalar(
                    "SELECT EXISTS (SELECT 1 FROM jobs WHERE state = 'running')",
                )
                .fetch_one(&pool)
                .await?;
                Ok(!running)
            }
        },
        Duration::from_millis(20),
    )
    .await?;
    let drain_rate = args.jobs as f64 / started.elapsed().as_secs_f64();
    eprintln!(
        "queue: drained {} jobs at {drain_rate:.0} jobs/s",
        args.jobs
    );
    lines.push(format!("queue_drain_per_s={drain_rate:.0}"));
    if args.workers > 0 {
        lines.push(format!("queue_drain_workers={}", args.workers));
        for mut child in children {
            let _ = child.start_kill();
            let _ = child.wait().await;
        }
    }
    if let (Some(mib), true) = (peak_rss_mib(), fleet.is_some()) {
        eprintln!(
            "queue: peak resident memory while draining {mib:.1} MiB (the whole bench process)"
        );
        lines.push(format!("queue_drain_peak_rss_mib={mib:.1}"));
    }
    if args.backlog > 0 {
        eprintln!(
            "queue: the claim with the backlog in place, after the drain (nothing due):\n  {}",
            queue::admin::explain_claim(&pool, Noop::QUEUE, 16)
                .await?
                .join("\n  ")
        );
    }

    // Enqueue-to-start latency on an idle fleet, one job at a time (the fleet inside the
    // bench: worker processes cannot report their start times to it).
    if let Some(fleet) = fleet {
        for _ in 0..args.latency_samples {
            queue::enqueue(&pool, NewJob::of(&Noop { t: now_micros() })?).await?;
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        runs.reach(
            NoopRuns::timed,
            args.latency_samples,
            Duration::from_millis(10),
        )
        .await;
        fleet.shutdown().await;
        let waits = runs.sorted_waits();
        // No samples asked for (`--latency-samples 0`): no figure, rather than a zero.
        if !waits.is_empty() {
            let (p50, p99) = (percentile(&waits, 0.5), percentile(&waits, 0.99));
            eprintln!("queue: enqueue-to-start p50 {p50:.2} ms, p99 {p99:.2} ms");
            lines.push(format!("queue_start_latency_p50_ms={p50:.2}"));
            lines.push(format!("queue_start_latency_p99_ms={p99:.2}"));
        }
    } else {
        eprintln!("queue: enqueue-to-start latency is measured without --workers");
    }

    let total: i64 = sqlx::query_scalar("SELECT pg_total_relation_size('jobs')")
        .fetch_one(&pool)
        .await?;
    table_size(peak, total, &mut lines);

    if args.workers == 0 && args.fair_flood > 0 {
        fairness(
            config,
            &queues,
            &pool,
            args.fair_flood,
            drain_rate,
            &mut lines,
        )
        .await?;
    }

    // The machine's limit for the same row writes: a drained job is written twice (claim and
    // end); here PostgreSQL updates rows of the same shape in bulk with no queue logic at all.
    // (The drained jobs themselves are gone: a completed job's row is deleted.)
    sqlx::query("CREATE TABLE bench_jobs (LIKE jobs INCLUDING DEFAULTS)")
        .execute(&pool)
        .await?;
    sqlx::query(
        "INSERT INTO bench_jobs (queue, kind, payload) SELECT $1, $2, '{\"t\": 0}' FROM generate_series(1, $3)",
    )
    .bind(Noop::QUEUE)
    .bind(Noop::KIND)
    .bind(args.jobs as i64)
    .execute(&pool)
    .await?;
    sqlx::query("CREATE INDEX ON bench_jobs (id)")
        .execute(&pool)
        .await?;
    let started = Instant::now();
    let rows = sqlx::query(
        "UPDATE bench_jobs SET state = 'running', attempt = attempt + 1, lease_token = id",
    )
    .execute(&pool)
    .await?
    .rows_affected();
    sqlx::query(
        "UPDATE bench_jobs SET state = 'completed', finished_at = now(), lease_token = NULL",
    )
    .execute(&pool)
    .await?;
    let pg_rate = rows as f64 / started.elapsed().as_secs_f64();
    eprintln!("postgres: two bulk updates of {rows} job rows: {pg_rate:.0} rows/s each way");
    lines.push(format!("pg_two_updates_per_s={pg_rate:.0}"));
    lines.push(format!("queue_drain_vs_pg={:.2}", drain_rate / pg_rate));
    pool.close().await;
    for l in lines {
        println!("{l}");
    }
    Ok(())
}

/// The live jobs as a compact copy with the same indexes would hold them: rows, bytes.
async fn compact_size(pool: &PgPool) -> anyhow::Result<(i64, i64)> {
    sqlx::query("CREATE TABLE jobs_compact (LIKE jobs INCLUDING INDEXES)")
        .execute(pool)
        .await?;
    let rows = sqlx::query("INSERT INTO jobs_compact SELECT * FROM jobs")
        .execute(pool)
        .await?
        .rows_affected();
    let bytes: i64 = sqlx::query_scalar("SELECT pg_total_relation_size('jobs_compact')")
        .fetch_one(pool)
        .await?;
    sqlx::query("DROP TABLE jobs_compact").execute(pool).await?;
    Ok((i64::try_from(rows)?, bytes))
}

/// The jobs table and its indexes after the drain, beside what its most jobs at once (all
/// enqueued, before the drain) take as a compact copy: what the turnover (a claim's update, a
/// completion's delete, the fleet's vacuums) left beyond what the rows ever needed.
fn table_size(peak: (i64, i64), total: i64, lines: &mut Vec<String>) {
    let (peak_rows, compact) = peak;
    let mib = |b: i64| b as f64 / (1024.0 * 1024.0);
    let ratio = total as f64 / compact.max(1) as f64;
    eprintln!(
        "queue: jobs table with its indexes {:.1} MiB after the drain; its {peak_rows} jobs before it, compact, {:.1} MiB ({ratio:.2}x)",
        mib(total),
        mib(compact)
    );
    lines.push(format!("jobs_table_peak_rows={peak_rows}"));
    lines.push(format!("jobs_table_mib={:.1}", mib(total)));
    lines.push(format!("jobs_table_peak_compact_mib={:.1}", mib(compact)));
    lines.push(format!("jobs_table_vs_peak_compact={ratio:.2}"));
}

/// Fairness between sellers: seller A's flood of `flood` jobs is drained while seller B's jobs
/// arrive one at a time. Prints how long B's jobs waited to start, and A's drain beside the
/// drain of as many jobs without a key (`unkeyed_rate`, measured before).
async fn fairness(
    config: &Config,
    queues: &QueuesConfig,
    pool: &PgPool,
    flood: usize,
    unkeyed_rate: f64,
    lines: &mut Vec<String>,
) -> anyhow::Result<()> {
    sqlx::query(
        "INSERT INTO jobs (queue, kind, payload, fairness_key)
         SELECT $1, $2, '{\"t\": 0}', 'seller-a' FROM generate_series(1, $3)",
    )
    .bind(Noop::QUEUE)
    .bind(Noop::KIND)
    .bind(flood as i64)
    .execute(pool)
    .await?;
    sqlx::query("ANALYZE jobs").execute(pool).await?;
    let runs = NoopRuns::default();
    let fleet = Fleet::new(
        pool.clone(),
        runs.registry()?,
        queues.clone(),
        &config.host_name,
    )
    .start();
    let started = Instant::now();
    // B's jobs arrive one at a time while at least a fifth of the flood still waits.
    let mut sent = 0usize;
    while runs.ran() < flood * 4 / 5 && sent < 50 {
        queue::enqueue(
            pool,
            NewJob::of(&Noop { t: now_micros() })?.fairness_key("seller-b"),
        )
        .await?;
        sent += 1;
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    runs.reach(NoopRuns::ran, flood + sent, Duration::from_millis(5))
        .await;
    let rate = flood as f64 / started.elapsed().as_secs_f64();
    fleet.shutdown().await;
    let waits = runs.sorted_waits();
    if waits.len() != sent {
        bail!("{sent} jobs of seller B were sent but {} ran", waits.len());
    }
    let (p50, max) = (
        percentile(&waits, 0.5),
        waits.last().map_or(0.0, |d| d.as_secs_f64() * 1000.0),
    );
    eprintln!(
        "queue: fairness: {sent} jobs of seller B behind seller A's {flood}: start p50 {p50:.2} ms, max {max:.2} ms; A drained at {rate:.0} jobs/s ({:.2}x the unkeyed drain)",
        rate / unkeyed_rate
    );
    lines.push(format!("queue_fair_other_seller_start_p50_ms={p50:.2}"));
    lines.push(format!("queue_fair_other_seller_start_max_ms={max:.2}"));
    lines.push(format!("queue_fair_flood_drain_per_s={rate:.0}"));
    lines.push(format!(
        "queue_fair_flood_vs_unkeyed={:.2}",
        rate / unkeyed_rate
    ));
    Ok(())
}

/// Waits for a condition, polling.
async fn wait_until<F, Fut>(mut check: F, every: Duration) -> anyhow::Result<()>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = anyhow::Result<bool>>,
{
    while !check().await? {
        tokio::time::sleep(every).await;
    }
    Ok(())
}

//! `payfleet bench load`: the receiver under a sustained load, deployed as in production (one
//! `serve` and `--workers` `work` processes of this binary, each on its default pool), while
//! the workers process what it takes.
//!
//! `--senders` gateways' delivery workers each keep one connection and send signed
//! `payment.succeeded` webhooks on a schedule (`--rate` in all, open loop: a slow answer does
//! not slow the schedule's later sends, it shows in their latency), a `--duplicates` share of
//! them a delivery sent before (same id and body, signed anew, as a gateway's retry). The
//! payments name sessions no checkout made, so each is processed into an unmatched payment for
//! an operator: the path every event takes (store, claim, interpret, look up, record) without
//! a checkout per event. Printed: throughput taken and processed, answer latency p50 / p99 /
//! p99.9, each process's resident memory after the warm-up and at the end, the tables' and
//! indexes' sizes after the fleet's pruning, and the same run's pgbench baseline (a durable
//! insert of a webhook's row per transaction at as many clients).

use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use axum::body::Bytes;
use http_body_util::{BodyExt, Full};
use rand::{Rng, SeedableRng};

use super::{events_insert_script, percentile, pgbench_tps, which_pgbench};
use crate::scratch;
use payfleet::config::Config;
use payfleet::secret::StandardSecret;

#[derive(clap::Args, Debug)]
pub struct LoadArgs {
    /// How long the load runs.
    #[arg(long, default_value_t = 10.0)]
    pub minutes: f64,
    /// Webhooks per second offered, over all senders.
    #[arg(long, default_value_t = 400.0)]
    pub rate: f64,
    /// The share of deliveries that repeat an earlier one.
    #[arg(long, default_value_t = 0.1)]
    pub duplicates: f64,
    /// Concurrent senders (connections), and pgbench's clients.
    #[arg(long, default_value_t = 16)]
    pub senders: usize,
    /// Worker processes.
    #[arg(long, default_value_t = 2)]
    pub workers: usize,
}

/// What one sender saw.
struct Sent {
    latencies: Vec<Duration>,
    unique: usize,
    failed: usize,
}

/// The resident memory of process `pid` (VmRSS), MiB.
fn rss_mib(pid: u32) -> Option<f64> {
    super::status_mib(&pid.to_string(), "VmRSS:")
}

fn request(
    addr: &str,
    secret: &StandardSecret,
    id: &str,
    body: &str,
) -> anyhow::Result<hyper::Request<Full<Bytes>>> {
    let ts = chrono::Utc::now().timestamp();
    Ok(hyper::Request::post("/webhooks/internal")
        .header("host", addr)
        .header("webhook-id", id)
        .header("webhook-timestamp", ts.to_string())
        .header("webhook-signature", secret.sign(id, ts, body.as_bytes()))
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body.to_owned())))?)
}

/// One sender: its schedule of `per_s` deliveries a second until `until`, on one connection
/// (opened again if the receiver closes it).
async fn sender(
    n: usize,
    addr: String,
    secret: StandardSecret,
    per_s: f64,
    duplicates: f64,
    until: Instant,
) -> anyhow::Result<Sent> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(n as u64);
    let mut out = Sent {
        latencies: Vec::new(),
        unique: 0,
        failed: 0,
    };
    let mut sent_ids: Vec<usize> = Vec::new();
    let gap = Duration::from_secs_f64(1.0 / per_s);
    let mut next = Instant::now() + gap.mul_f64(rng.random::<f64>());
    let mut conn = None;
    while next < until {
        tokio::time::sleep_until(next.into()).await;
        let scheduled = next;
        next += gap;
        let i = if !sent_ids.is_empty() && rng.random_bool(duplicates) {
            sent_ids[rng.random_range(0..sent_ids.len())]
        } else {
            let i = n * 100_000_000 + sent_ids.len();
            sent_ids.push(i);
            out.unique += 1;
            i
        };
        let body = super::body(i);
        let req = request(&addr, &secret, &format!("msg_load_{i}"), &body)?;
        if conn.is_none() {
            let stream = tokio::net::TcpStream::connect(&addr).await?;
            stream.set_nodelay(true)?;
            let (s, c) =
                hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream)).await?;
            tokio::spawn(c);
            conn = Some(s);
        }
        let Some(s) = conn.as_mut() else { continue };
        let answered = async {
            s.ready().await?;
            let resp = s.send_request(req).await?;
            let status = resp.status();
            resp.into_body().collect().await?;
            anyhow::Ok(status)
        }
        .await;
        match answered {
            Ok(status) if status.is_success() => out.latencies.push(scheduled.elapsed()),
            Ok(_) => out.failed += 1,
            Err(_) => {
                out.failed += 1;
                conn = None;
            }
        }
    }
    Ok(out)
}

pub async fn load(config: &Config, args: LoadArgs) -> anyhow::Result<()> {
    if !(args.minutes > 0.0 && args.rate > 0.0 && (0.0..1.0).contains(&args.duplicates))
        || args.senders == 0
        || args.workers == 0
    {
        bail!(
            "--minutes, --rate, --senders and --workers must be positive and --duplicates in [0, 1)"
        );
    }
    let pgbench = which_pgbench().context("pgbench is needed for the PostgreSQL baseline (Debian: apt-get install postgresql-15 or postgresql-contrib)")?;
    let (pool, url) = scratch::database(config, "bench", 4).await?;
    let (app, secret, secret_text) = scratch::simulated(config, "bench");
    let recurring = std::env::temp_dir().join(format!("payfleet-load-{}.toml", std::process::id()));
    // The fleet's pruning on a short schedule, so the sizes printed are those it keeps.
    std::fs::write(&recurring, "[prune]\ncron = \"*/20 * * * * *\"\n")?;
    let env: Vec<(String, String)> = [
        ("DATABASE_URL", url.expose().to_owned()),
        ("INTERNAL_WEBHOOK_SECRET", secret_text),
        ("PAYFLEET_PAYMENT_SIMULATOR", "on".into()),
        ("PAYFLEET_AMQP_NAMESPACE", app.messaging.namespace.clone()),
        ("PAYFLEET_AMQP_QUEUE_TTL_MS", "600000".into()),
        ("AMQP_URL", app.amqp_url.expose().to_owned()),
        ("PAYFLEET_RECURRING", recurring.display().to_string()),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_owned(), v))
    .collect();
    let port = scratch::free_port()?;
    let mut serve_env = env.clone();
    serve_env.push(("PAYFLEET_BIND".into(), format!("127.0.0.1:{port}")));
    let mut children = vec![(
        "serve".to_owned(),
        scratch::spawn(&serve_env, "serve", None)?,
    )];
    scratch::wait_ready(port).await?;
    for w in 0..args.workers {
        let wport = scratch::free_port()?;
        let mut e = env.clone();
        e.push(("PAYFLEET_WORKER_BIND".into(), format!("127.0.0.1:{wport}")));
        children.push((format!("work {w}"), scratch::spawn(&e, "work", None)?));
        scratch::wait_ready(wport).await?;
    }
    let sizes = |pool: sqlx::PgPool| async move {
        sqlx::query_as::<_, (String, i64, i64)>(
            "SELECT t, pg_table_size(t::regclass), pg_indexes_size(t::regclass)
             FROM unnest(ARRAY['payment_events', 'jobs', 'unmatched_payments']) AS t",
        )
        .fetch_all(&pool)
        .await
    };

    let addr = format!("127.0.0.1:{port}");
    let phase = crate::progress::spinner(format!(
        "{:.0} signed webhooks a second for {} min",
        args.rate, args.minutes
    ));
    let started = Instant::now();
    let until = started + Duration::from_secs_f64(args.minutes * 60.0);
    let per_sender = args.rate / args.senders as f64;
    let tasks: Vec<_> = (0..args.senders)
        .map(|n| {
            tokio::spawn(sender(
                n,
                addr.clone(),
                secret.clone(),
                per_sender,
                args.duplicates,
                until,
            ))
        })
        .collect();
    // Memory after the warm-up (a tenth of the run, at most 30 s) and at the end.
    tokio::time::sleep(Duration::from_secs_f64((args.minutes * 6.0).min(30.0))).await;
    let memory_start: Vec<Option<f64>> = children
        .iter()
        .map(|(_, c)| c.id().and_then(rss_mib))
        .collect();
    let mut latencies = Vec::new();
    let (mut unique, mut failed) = (0usize, 0usize);
    for t in tasks {
        let s = t.await??;
        latencies.extend(s.latencies);
        unique += s.unique;
        failed += s.failed;
    }
    let secs = started.elapsed().as_secs_f64();
    let processed_by_end: i64 =
        sqlx::query_scalar("SELECT count(*) FROM payment_events WHERE processed_at IS NOT NULL")
            .fetch_one(&pool)
            .await?;
    let memory_end: Vec<Option<f64>> = children
        .iter()
        .map(|(_, c)| c.id().and_then(rss_mib))
        .collect();
    // The backlog drains, then the fleet prunes.
    let drain = Instant::now();
    loop {
        let left: i64 =
            sqlx::query_scalar("SELECT count(*) FROM payment_events WHERE processed_at IS NULL")
                .fetch_one(&pool)
                .await?;
        if left == 0 {
            break;
        }
        if drain.elapsed() > Duration::from_secs(600) {
            bail!("{left} events still unprocessed 10 minutes after the load ended");
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    let drained = drain.elapsed().as_secs_f64();
    phase.finish_and_clear();
    tokio::time::sleep(Duration::from_secs(25)).await;
    let stored: i64 = sqlx::query_scalar("SELECT count(*) FROM payment_events")
        .fetch_one(&pool)
        .await?;
    // Each distinct webhook taken is stored once (one whose every sending failed may not be).
    if stored as usize > unique || (stored as usize) + failed < unique {
        bail!(
            "sent {unique} distinct webhooks ({failed} sends failed) but {stored} events are stored"
        );
    }
    let sizes_end = sizes(pool.clone()).await?;
    for (_, mut c) in children {
        scratch::stop(&mut c).await?;
    }
    std::fs::remove_file(&recurring).ok();

    latencies.sort();
    let taken = latencies.len() as f64 / secs;
    let processed = processed_by_end as f64 / secs;
    let mut lines = vec![
        format!("load_secs={secs:.0}"),
        format!("load_offered_per_s={:.0}", args.rate),
        format!("load_taken_per_s={taken:.0}"),
        format!("load_processed_per_s={processed:.0}"),
        format!("load_backlog_drained_secs={drained:.1}"),
        format!("load_refused_or_failed={failed}"),
        format!("load_p50_ms={:.2}", percentile(&latencies, 0.5)),
        format!("load_p99_ms={:.2}", percentile(&latencies, 0.99)),
        format!("load_p999_ms={:.2}", percentile(&latencies, 0.999)),
    ];
    let names =
        std::iter::once("serve".to_owned()).chain((0..args.workers).map(|w| format!("work{w}")));
    for ((name, start), end) in names.zip(memory_start).zip(memory_end) {
        lines.push(format!(
            "load_rss_{name}_mib={:.1}->{:.1}",
            start.unwrap_or(0.0),
            end.unwrap_or(0.0)
        ));
    }
    for (table, data, indexes) in &sizes_end {
        lines.push(format!(
            "load_size_{table}_mib={:.1}+{:.1}",
            *data as f64 / 1048576.0,
            *indexes as f64 / 1048576.0
        ));
    }
    let script = events_insert_script(&pool).await?;
    let tps = pgbench_tps(
        &pgbench,
        &[
            "-n",
            "-c",
            &args.senders.to_string(),
            "-j",
            "2",
            "-T",
            "20",
            "-f",
            &script.to_string_lossy(),
        ],
        url.expose(),
    )
    .await?;
    std::fs::remove_file(&script).ok();
    lines.push(format!("pgbench_insert_c{}_per_s={tps:.0}", args.senders));
    lines.push(format!("load_taken_vs_pgbench={:.2}", taken / tps));
    pool.close().await;
    eprintln!(
        "load: {taken:.0} webhooks/s taken for {secs:.0} s ({} distinct, {:.0} % repeats), {processed:.0}/s processed, p50 {:.2} ms, p99 {:.2} ms, p99.9 {:.2} ms",
        unique,
        100.0 * (1.0 - unique as f64 / latencies.len().max(1) as f64),
        percentile(&latencies, 0.5),
        percentile(&latencies, 0.99),
        percentile(&latencies, 0.999)
    );
    for l in lines {
        println!("{l}");
    }
    Ok(())
}

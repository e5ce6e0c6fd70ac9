//! The one binary: a subcommand per process role (the Procfile maps them), the operator's
//! commands, the demo and the benchmarks. The library (`payfleet`) builds everything they run.

mod bench;
mod cli;
mod demo;
mod progress;
mod scratch;
mod soak;

use std::io::IsTerminal;

use clap::Parser;
use payfleet::config::LogFormat;
use tracing_subscriber::EnvFilter;
use tracing_subscriber::Layer as _;

fn main() -> std::process::ExitCode {
    let cli = cli::Cli::parse();
    // The runtime is built for the process's role (`config::runtime_threads`), so after the
    // command line is read.
    let mut runtime = tokio::runtime::Builder::new_multi_thread();
    match payfleet::config::runtime_threads(&payfleet::config::ProcessEnv, cli.runtime_role()) {
        Ok(Some(threads)) => {
            runtime.worker_threads(threads);
        }
        Ok(None) => {}
        Err(e) => {
            eprintln!("payfleet: {e}");
            return std::process::ExitCode::FAILURE;
        }
    }
    match runtime.enable_all().build() {
        Ok(runtime) => runtime.block_on(run(cli)),
        Err(e) => {
            eprintln!("payfleet: cannot start the async runtime: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}

async fn run(cli: cli::Cli) -> std::process::ExitCode {
    payfleet::tls::install_provider();
    let format = match payfleet::config::log_format() {
        Ok(f) => f,
        Err(e) => {
            eprintln!("payfleet: {e}");
            return std::process::ExitCode::FAILURE;
        }
    };
    // Colours only for a person at a terminal: a log file or a collector gets plain text (and
    // each job's span costs less to record).
    use tracing_subscriber::layer::SubscriberExt as _;
    use tracing_subscriber::util::SubscriberInitExt as _;
    let logs = tracing_subscriber::fmt::layer()
        .with_ansi(std::io::stderr().is_terminal())
        .with_writer(std::io::stderr);
    let logs = match format {
        LogFormat::Json => logs
            .json()
            .with_current_span(true)
            .with_span_list(false)
            .boxed(),
        LogFormat::Text => logs.boxed(),
    };
    // Spans over OTLP when OTEL_EXPORTER_OTLP_ENDPOINT is set; the exporter flushes when
    // `_exporter` drops, at the end of main.
    let (traces, _exporter) = match payfleet::traces::layer(cli.role()) {
        Ok(Some((layer, exporter))) => (Some(layer), Some(exporter)),
        Ok(None) => (None, None),
        Err(e) => {
            eprintln!("payfleet: {e}");
            return std::process::ExitCode::FAILURE;
        }
    };
    // The log's level (RUST_LOG) filters the log alone: the traces take every span of INFO and
    // above whatever is logged.
    tracing_subscriber::registry()
        .with(logs.with_filter(EnvFilter::new(payfleet::config::log_filter())))
        .with(traces.with_filter(tracing_subscriber::filter::LevelFilter::INFO))
        .init();
    match cli::run(cli).await {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("payfleet: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

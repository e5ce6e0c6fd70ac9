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

#[tokio::main]
async fn main() -> std::process::ExitCode {
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
    let logs = tracing_subscriber::fmt()
        .with_env_filter(EnvFilter::new(payfleet::config::log_filter()))
        .with_ansi(std::io::stderr().is_terminal())
        .with_writer(std::io::stderr);
    match format {
        LogFormat::Json => logs
            .json()
            .with_current_span(true)
            .with_span_list(false)
            .init(),
        LogFormat::Text => logs.init(),
    }
    match cli::run(cli::Cli::parse()).await {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("payfleet: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

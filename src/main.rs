use clap::Parser;
use tracing_subscriber::EnvFilter;

#[tokio::main]
async fn main() -> std::process::ExitCode {
    payfleet::tls::install_provider();
    tracing_subscriber::fmt()
        .with_env_filter(EnvFilter::new(payfleet::config::log_filter()))
        .with_writer(std::io::stderr)
        .init();
    match payfleet::cli::run(payfleet::cli::Cli::parse()).await {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("payfleet: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

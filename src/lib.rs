//! payfleet: the background job worker fleet behind a marketplace's payments.
//!
//! Layout (one module per bounded context; the root only assembles):
//! - `webhooks`  the receiver: signature schemes, the verified [`webhooks::Webhook`], `payment_events`
//! - `gateways`  each gateway's events and status mappers (safe defaults), the Mercado Pago client
//! - `payments`  event processing: `payment_orders`, refund and dispute facts, the derived status
//! - `orders`    the business truth an event leads to
//! - `queue`     the PostgreSQL job queue and the worker fleet
//! - `messaging` the shared RabbitMQ connection
//! - `money`     [`money::Money`]: decimal plus currency
//! - `http`      router assembly, the one API error type, health and metrics
//! - `db`        the pool, migrations, and which database errors are outages
//! - `config`, `startup`, `cli`: environment, wiring, subcommands; `bench`: the benchmarks

pub mod bench;
pub mod cli;
pub mod config;
pub mod db;
pub mod gateways;
pub mod http;
pub mod messaging;
pub mod money;
pub mod orders;
pub mod payments;
pub mod queue;
pub mod startup;
pub mod webhooks;

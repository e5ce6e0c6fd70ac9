//! The integration tests: each one gets its own database on the real PostgreSQL server
//! (#[sqlx::test]) and, where it needs HTTP, its own server on port 0.

mod bad_input;
mod barriers;
mod browser;
mod checkout;
mod cluster;
mod consistency;
mod dashboard;
mod edges;
mod gateway_subscriptions;
mod gateways;
mod health;
mod helpers;
mod layout;
mod messaging;
mod migrations;
mod money;
mod openapi;
mod orders;
mod outage;
mod pgbouncer;
mod process;
mod processing;
mod reconcile;
mod recurring;
mod security;
mod subscriptions;
mod traces;
mod webhooks;

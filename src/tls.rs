//! The process's one TLS provider (ring) for every client it opens: the gateways' HTTP clients
//! and the RabbitMQ connection. Installing it twice is harmless.

pub fn install_provider() {
    let _ = rustls::crypto::ring::default_provider().install_default();
}

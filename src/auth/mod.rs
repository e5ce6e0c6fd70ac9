//! Who may call: the credentials payfleet trusts, without HTTP (the receiver's extractors in
//! `http::callers` put them to work).
//! - [`Token`]: an operator's bearer token (the admin token, the metrics token), kept only as
//!   its SHA-256 digest and compared digest to digest in constant time, so neither its value nor
//!   its length leaks through timing; keys for what it signs (the dashboard's cookie, its CSRF
//!   tokens) are derived from it with HKDF, never the token itself.
//! - [`api_keys`]: the marketplace backend's keys, made by an operator, stored as hashes, read
//!   through a cache short enough that a revocation holds in every process within a second.
//! - [`limiter`]: failed sign-ins and wrong credentials per client address; past the limit an
//!   address is refused (429) until its window passes.

pub mod api_keys;
pub mod limiter;

use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;

use crate::secret::derive_key;

pub use api_keys::{ApiKey, ApiKeyId, ApiKeys, KeyHolder, Lookup, NewApiKey};
pub use limiter::{FailureLimiter, Locked};

/// The fewest characters an operator's token may have.
pub const MIN_TOKEN_LEN: usize = 32;

/// A bearer token an operator holds. Only its digest is kept: the process (and a development
/// database) never holds the token itself after start-up.
#[derive(Clone, PartialEq, Eq)]
pub struct Token {
    digest: [u8; 32],
}

impl std::fmt::Debug for Token {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Token([redacted])")
    }
}

/// The SHA-256 of a credential: what is kept, looked up and compared instead of it.
pub fn digest(value: &[u8]) -> [u8; 32] {
    Sha256::digest(value).into()
}

/// A new random credential: `prefix` and 43 URL-safe characters (256 bits).
pub fn random_credential(prefix: &str) -> String {
    use base64::Engine;
    format!(
        "{prefix}{}",
        base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(rand::random::<[u8; 32]>())
    )
}

impl Token {
    /// A token as configured: at least [`MIN_TOKEN_LEN`] visible ASCII characters (no spaces:
    /// it travels in a header). The reason when not.
    pub fn parse(value: &str) -> Result<Self, String> {
        if value.len() < MIN_TOKEN_LEN {
            return Err(format!("must be at least {MIN_TOKEN_LEN} characters"));
        }
        if !value.bytes().all(|b| b.is_ascii_graphic()) {
            return Err("must be visible ASCII characters without spaces".into());
        }
        Ok(Self {
            digest: digest(value.as_bytes()),
        })
    }

    /// Whether `given` is this token. Both sides are digests of 32 bytes, compared in constant
    /// time: the answer takes as long whatever `given` is, even of another length.
    pub fn matches(&self, given: &str) -> bool {
        bool::from(digest(given.as_bytes()).ct_eq(&self.digest))
    }

    /// A key for one purpose, derived from the token ([`derive_key`]).
    pub fn derive_key(&self, purpose: &str) -> [u8; 32] {
        derive_key(&self.digest, purpose)
    }

    /// A new random token, for development.
    pub fn generate() -> (Self, String) {
        let value = random_credential("pfa_");
        let token = Self {
            digest: digest(value.as_bytes()),
        };
        (token, value)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_token_is_long_and_matches_only_itself() {
        assert!(Token::parse("short-token-of-sixteen").is_err());
        assert!(Token::parse(&format!("{} spaced", "x".repeat(32))).is_err());
        let t = Token::parse("an-admin-token-of-32-characters!").unwrap();
        assert!(t.matches("an-admin-token-of-32-characters!"));
        assert!(!t.matches("an-admin-token-of-32-characters"));
        assert!(!t.matches(""));
        assert!(!t.matches(&"x".repeat(10_000)));
        assert_eq!(format!("{t:?}"), "Token([redacted])");
    }

    #[test]
    fn derived_keys_differ_by_purpose_and_by_token() {
        let a = Token::parse(&"a".repeat(32)).unwrap();
        let b = Token::parse(&"b".repeat(32)).unwrap();
        assert_ne!(a.derive_key("cookie"), a.derive_key("csrf"));
        assert_ne!(a.derive_key("cookie"), b.derive_key("cookie"));
        assert_eq!(a.derive_key("cookie"), a.derive_key("cookie"));
        assert_ne!(&a.derive_key("cookie")[..], &a.digest[..]);
    }

    #[test]
    fn a_generated_token_is_valid_and_new_each_time() {
        let (t, v) = Token::generate();
        assert!(Token::parse(&v).is_ok());
        assert!(t.matches(&v));
        assert_ne!(Token::generate().1, v);
    }
}

//! Values that must never reach a log line or a `Debug` dump: webhook secrets, API tokens and
//! connection URLs that may carry a password. The wrappers print a redacted form; code that
//! needs the value asks for it by name (`expose`), which makes every use easy to find. And what
//! the secrets sign with: HMAC-SHA256, keys derived for one purpose (HKDF), and the Standard
//! Webhooks secret ([`StandardSecret`]) the internal and mock gateways sign with.

use std::fmt;

use base64::Engine;
use base64::engine::general_purpose::STANDARD as B64;
use hkdf::Hkdf;
use hmac::Mac;
use sha2::Sha256;

/// A secret string. `Debug` and `Display` print `[redacted]`.
#[derive(Clone, PartialEq, Eq)]
pub struct Secret(String);

impl Secret {
    pub fn new(value: impl Into<String>) -> Self {
        Self(value.into())
    }

    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Secret([redacted])")
    }
}

impl fmt::Display for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("[redacted]")
    }
}

/// A connection URL (`postgres://`, `amqp://`). `Debug` and `Display` show it with the
/// password replaced, so it can be logged to say where the process connects.
#[derive(Clone, PartialEq, Eq)]
pub struct SecretUrl(String);

impl SecretUrl {
    pub fn new(value: impl Into<String>) -> Self {
        Self(value.into())
    }

    pub fn expose(&self) -> &str {
        &self.0
    }

    /// The URL with any password replaced by `***`.
    pub fn redacted(&self) -> String {
        redact_password(&self.0)
    }
}

impl fmt::Debug for SecretUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "SecretUrl({:?})", self.redacted())
    }
}

impl fmt::Display for SecretUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.redacted())
    }
}

/// `scheme://user:password@host/...` -> `scheme://user:***@host/...`. A URL without a password
/// is returned as it is; a query parameter named `password` is redacted too.
pub fn redact_password(url: &str) -> String {
    let mut out = url.to_owned();
    if let Some(scheme_end) = out.find("://").map(|i| i + 3) {
        let authority_end = out[scheme_end..]
            .find(['/', '?', '#'])
            .map(|i| i + scheme_end)
            .unwrap_or(out.len());
        if let Some(at) = out[scheme_end..authority_end].rfind('@') {
            let userinfo = &out[scheme_end..scheme_end + at];
            if let Some(colon) = userinfo.find(':') {
                let start = scheme_end + colon + 1;
                out.replace_range(start..scheme_end + at, "***");
            }
        }
    }
    if let Some(q) = out.find('?') {
        let (base, query) = out.split_at(q + 1);
        let redacted: Vec<String> = query
            .split('&')
            .map(|pair| match pair.split_once('=') {
                Some((k, _)) if k.eq_ignore_ascii_case("password") => format!("{k}=***"),
                _ => pair.to_owned(),
            })
            .collect();
        out = format!("{base}{}", redacted.join("&"));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn secrets_never_print() {
        let s = Secret::new("sk_live_very_secret");
        assert!(!format!("{s:?} {s}").contains("very_secret"));
        assert_eq!(s.expose(), "sk_live_very_secret");
    }

    #[test]
    fn urls_print_without_their_password() {
        let u = SecretUrl::new("postgres://app:hunter2@db.internal:5432/payfleet?sslmode=require");
        assert_eq!(
            u.to_string(),
            "postgres://app:***@db.internal:5432/payfleet?sslmode=require"
        );
        assert!(!format!("{u:?}").contains("hunter2"));
        assert_eq!(
            redact_password("amqp://guest:guest@127.0.0.1:5672/%2f"),
            "amqp://guest:***@127.0.0.1:5672/%2f"
        );
        assert_eq!(
            redact_password("postgres://postgres@127.0.0.1/x?password=pw&a=b"),
            "postgres://postgres@127.0.0.1/x?password=***&a=b"
        );
        assert_eq!(
            redact_password("postgres://127.0.0.1/x"),
            "postgres://127.0.0.1/x"
        );
    }
}

// ---- keys: what the secrets sign with ---------------------------------------------------------

type HmacSha256 = hmac::Hmac<Sha256>;

/// HMAC-SHA256 of the concatenated `parts` (the expected tag of a message, computed once).
pub fn hmac_sha256(key: &[u8], parts: &[&[u8]]) -> [u8; 32] {
    // HMAC takes keys of any length; new_from_slice cannot fail for it.
    let mut m = <HmacSha256 as Mac>::new_from_slice(key)
        .unwrap_or_else(|_| unreachable!("HMAC accepts any key length"));
    for p in parts {
        m.update(p);
    }
    m.finalize().into_bytes().into()
}

/// A key for one purpose (`purpose` names it), derived from a secret with HKDF-SHA256: what it
/// signs changes when the secret changes, and the key never reveals the secret.
pub fn derive_key(secret: &[u8], purpose: &str) -> [u8; 32] {
    let mut key = [0u8; 32];
    // 32 bytes is far below HKDF-SHA256's limit of 255 blocks: expand cannot fail.
    let _ = Hkdf::<Sha256>::new(Some(b"payfleet"), secret).expand(purpose.as_bytes(), &mut key);
    key
}

/// A Standard Webhooks secret: `whsec_` followed by the base64 of the key.
#[derive(Clone, PartialEq, Eq)]
pub struct StandardSecret(Vec<u8>);

impl std::fmt::Debug for StandardSecret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("StandardSecret(..)")
    }
}

impl StandardSecret {
    pub fn parse(secret: &str) -> Result<Self, &'static str> {
        let b64 = secret.strip_prefix("whsec_").unwrap_or(secret);
        let key = B64
            .decode(b64)
            .map_err(|_| "not whsec_ followed by base64")?;
        if key.len() < 16 {
            return Err("the key must be at least 16 bytes");
        }
        Ok(Self(key))
    }

    /// A fresh random secret, for development set-ups.
    pub fn generate() -> (Self, String) {
        let key: [u8; 24] = rand::random();
        (Self(key.to_vec()), format!("whsec_{}", B64.encode(key)))
    }

    /// A key for another purpose (`purpose` names it), derived from this secret with
    /// HKDF-SHA256: every process holding the secret derives the same key, and the key never
    /// signs a webhook.
    pub fn derive_key(&self, purpose: &str) -> [u8; 32] {
        derive_key(&self.0, purpose)
    }

    /// The `webhook-signature` value for a message: what a sender (and a test) puts on it.
    pub fn sign(&self, id: &str, ts: i64, body: &[u8]) -> String {
        format!("v1,{}", B64.encode(self.tag(id, &ts.to_string(), body)))
    }

    /// The HMAC tag of a message (`ts` as its header spells it): what [`Self::sign`] encodes
    /// and a receiver compares.
    pub(crate) fn tag(&self, id: &str, ts: &str, body: &[u8]) -> [u8; 32] {
        hmac_sha256(&self.0, &[id.as_bytes(), b".", ts.as_bytes(), b".", body])
    }
}

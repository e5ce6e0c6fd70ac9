//! Values that must never reach a log line or a `Debug` dump: webhook secrets, API tokens and
//! connection URLs that may carry a password. The wrappers print a redacted form; code that
//! needs the value asks for it by name (`expose`), which makes every use easy to find.

use std::fmt;

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

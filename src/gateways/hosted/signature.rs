//! Standard Webhooks, the scheme the hosted gateways (internal, mock) sign with.

use base64::Engine;
use base64::engine::general_purpose::STANDARD as B64;

use crate::gateways::signature::{
    MAX_CANDIDATES, SignatureError, any_matches, bounded, malformed, within,
};
use crate::secret::StandardSecret;

/// Standard Webhooks: `webhook-signature` holds space-separated `v1,<base64>` entries over
/// `"{webhook-id}.{webhook-timestamp}.{body}"`.
pub fn standard(
    secret: &StandardSecret,
    id: Option<&str>,
    timestamp: Option<&str>,
    signature: Option<&str>,
    body: &[u8],
    now: i64,
    tolerance: i64,
) -> Result<(), SignatureError> {
    const H: &str = "webhook-signature";
    let id = id.ok_or(SignatureError::MissingHeader("webhook-id"))?;
    let ts_text = timestamp.ok_or(SignatureError::MissingHeader("webhook-timestamp"))?;
    let signature = signature.ok_or(SignatureError::MissingHeader(H))?;
    bounded(H, signature)?;
    if id.len() > 256 {
        return Err(malformed("webhook-id", "longer than 256 bytes"));
    }
    let ts: i64 = ts_text
        .parse()
        .map_err(|_| malformed("webhook-timestamp", "not an integer"))?;
    let entries: Vec<&str> = signature.split(' ').filter(|e| !e.is_empty()).collect();
    if entries.len() > MAX_CANDIDATES {
        return Err(malformed(H, "more than 8 signatures"));
    }
    if !within(ts, now, tolerance) {
        return Err(SignatureError::Timestamp(tolerance));
    }
    let candidates: Vec<Vec<u8>> = entries
        .iter()
        .filter_map(|entry| entry.strip_prefix("v1,"))
        .filter_map(|b64| B64.decode(b64).ok())
        .collect();
    if candidates.is_empty() {
        return Err(SignatureError::Mismatch(H));
    }
    let want = secret.tag(id, ts_text, body);
    if !any_matches(&want, candidates.iter().map(Vec::as_slice)) {
        return Err(SignatureError::Mismatch(H));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    #[test]
    fn standard_webhooks_vectors() {
        let s1 = StandardSecret::parse("whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw").unwrap();
        let body1 = br#"{"test": 2432232314}"#;
        let sig1 = "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE=";
        assert_eq!(
            s1.sign("msg_p5jXN8AQM9LWM0D4loKWxJek", 1614265330, body1),
            sig1
        );
        assert_eq!(
            standard(
                &s1,
                Some("msg_p5jXN8AQM9LWM0D4loKWxJek"),
                Some("1614265330"),
                Some(sig1),
                body1,
                1614265330,
                300
            ),
            Ok(())
        );
        let s2 = StandardSecret::parse("whsec_C2FVsBQIhrscChlQIMV+b5sSYspob7oD").unwrap();
        let body2 = br#"{"email":"test@example.com","username":"test_user"}"#;
        // Other versions and non-matching v1 entries beside the right one are ignored.
        let sig2 = format!(
            "v2,abc v1,{} v1,tZ1I4/hDygAJgO5TYxiSd6Sd0kDW6hPenDe+bTa3Kkw=",
            "A".repeat(44)
        );
        let at = |now: i64| {
            let (id, ts) = (Some("msg_27UH4WbU6Z5A5EzD8u03UvzRbpk"), Some("1649367553"));
            standard(&s2, id, ts, Some(&sig2), body2, now, 300)
        };
        assert_eq!(at(1649367553 - 200), Ok(()));
        assert_eq!(at(1649367553 + 301), Err(SignatureError::Timestamp(300)));
        assert_eq!(at(1649367553 - 301), Err(SignatureError::Timestamp(300)));
    }

    #[test]
    fn an_empty_standard_signature_never_matches() {
        let s = StandardSecret::parse("whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw").unwrap();
        for sig in ["v1,", "v1, v1,", "", "v1,AAAA"] {
            assert_eq!(
                standard(
                    &s,
                    Some("msg_1"),
                    Some("1614265330"),
                    Some(sig),
                    b"{}",
                    1614265330,
                    300
                ),
                Err(SignatureError::Mismatch("webhook-signature")),
                "{sig:?}"
            );
        }
    }
}

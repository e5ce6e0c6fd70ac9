//! Stripe's signing scheme, verified over the raw bytes.

use crate::gateways::signature::{
    MAX_CANDIDATES, SignatureError, any_matches, malformed, pairs, within,
};
use crate::secret::hmac_sha256;

/// `Stripe-Signature: t=<unix>,v1=<hex>[,v1=<hex>...][,v0=<hex>]` over `"{t}.{body}"`, keyed
/// with the whole secret (`whsec_` included). Only v1 counts.
pub fn stripe(
    secret: &str,
    header: Option<&str>,
    body: &[u8],
    now: i64,
    tolerance: i64,
) -> Result<(), SignatureError> {
    const H: &str = "Stripe-Signature";
    let header = header.ok_or(SignatureError::MissingHeader(H))?;
    let mut t: Option<&str> = None;
    let mut v1: Vec<&str> = Vec::new();
    for (k, v) in pairs(header, H)? {
        match k {
            "t" if t.is_none() => t = Some(v),
            "t" => return Err(malformed(H, "more than one timestamp")),
            "v1" => v1.push(v),
            _ => {} // v0 and unknown schemes are ignored
        }
    }
    let t = t.ok_or(malformed(H, "no timestamp"))?;
    let ts: i64 = t
        .parse()
        .map_err(|_| malformed(H, "timestamp is not an integer"))?;
    if v1.is_empty() {
        return Err(malformed(H, "no v1 signature"));
    }
    if v1.len() > MAX_CANDIDATES {
        return Err(malformed(H, "more than 8 v1 signatures"));
    }
    if !within(ts, now, tolerance) {
        return Err(SignatureError::Timestamp(tolerance));
    }
    let want = hmac_sha256(secret.as_bytes(), &[t.as_bytes(), b".", body]);
    let decoded: Vec<Vec<u8>> = v1.iter().filter_map(|s| hex::decode(s).ok()).collect();
    if !any_matches(&want, decoded.iter().map(Vec::as_slice)) {
        return Err(SignatureError::Mismatch(H));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gateways::signature::hex_hmac;
    #[test]
    fn stripe_vector_verifies_at_its_time_and_is_stale_today() {
        let header =
            "t=1492774577,v1=88a022085c6bdb887b02cb26ff76dd681234d9675c0f22844059f55552a8883a";
        let body = br#"{"id":"evt_test_webhook","object":"event"}"#;
        assert_eq!(
            stripe("whsec_test_secret", Some(header), body, 1492774577, 300),
            Ok(())
        );
        assert_eq!(
            stripe(
                "whsec_test_secret",
                Some(header),
                body,
                1492774577 + 301,
                300
            ),
            Err(SignatureError::Timestamp(300))
        );
        assert_eq!(
            stripe(
                "whsec_test_secret",
                Some(header),
                body,
                1492774577 - 301,
                300
            ),
            Err(SignatureError::Timestamp(300))
        );
        assert_eq!(
            stripe("whsec_other", Some(header), body, 1492774577, 300),
            Err(SignatureError::Mismatch("Stripe-Signature"))
        );
    }

    #[test]
    fn stripe_accepts_any_v1_while_a_secret_rolls_and_ignores_v0() {
        let body = br#"{"id":"evt_1"}"#;
        let good = hex_hmac(b"whsec_new", &[b"1700000000", b".", body]);
        let header = format!("t=1700000000,v1={},v1={good},v0=abcd", "00".repeat(32));
        assert_eq!(
            stripe("whsec_new", Some(&header), body, 1700000000, 300),
            Ok(())
        );
        let v0_only = format!("t=1700000000,v0={good}");
        assert!(matches!(
            stripe("whsec_new", Some(&v0_only), body, 1700000000, 300),
            Err(SignatureError::Malformed { .. })
        ));
        assert_eq!(
            stripe("whsec_new", None, body, 0, 300),
            Err(SignatureError::MissingHeader("Stripe-Signature"))
        );
    }

    #[test]
    fn stripe_rejects_a_reserialised_body() {
        let body = br#"{"id":"evt_1","object":"event"}"#;
        let header = format!(
            "t=1700000000,v1={}",
            hex_hmac(b"whsec_x", &[b"1700000000", b".", body])
        );
        let reserialised = br#"{"id": "evt_1", "object": "event"}"#;
        assert_eq!(
            stripe("whsec_x", Some(&header), reserialised, 1700000000, 300),
            Err(SignatureError::Mismatch("Stripe-Signature"))
        );
    }
}

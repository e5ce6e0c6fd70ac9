//! The gateways' signing schemes, verified over the raw bytes.
//!
//! The sender chooses the headers, so the cost of a refusal is bounded whatever they hold: a
//! signature header longer than [`MAX_HEADER_BYTES`] or carrying more than [`MAX_CANDIDATES`]
//! signatures is refused before any hashing; the signed timestamp is checked before any
//! hashing; and the expected MAC is computed once per request, then compared with each
//! candidate in constant time. The worst refused request costs one HMAC over the body.
//! Test vectors: ../shared/background/webhook-signatures.md.

use base64::Engine;
use base64::engine::general_purpose::STANDARD as B64;
use subtle::ConstantTimeEq;

use crate::secret::StandardSecret;
use crate::secret::hmac_sha256;

/// Longest signature header accepted. Real ones are well under 1 KiB (a timestamp and one or
/// two signatures while a secret rolls).
pub const MAX_HEADER_BYTES: usize = 2048;
/// Most signatures one header may carry.
pub const MAX_CANDIDATES: usize = 8;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SignatureError {
    #[error("missing {0} header")]
    MissingHeader(&'static str),
    #[error("malformed {header} header: {problem}")]
    Malformed {
        header: &'static str,
        problem: &'static str,
    },
    #[error("no signature in {0} matches")]
    Mismatch(&'static str),
    #[error("the signed timestamp is outside the {0} s tolerance")]
    Timestamp(i64),
}

impl SignatureError {
    /// The reason, for metrics: `missing_header`, `malformed`, `mismatch` or `timestamp`.
    pub fn reason(&self) -> &'static str {
        match self {
            Self::MissingHeader(_) => "missing_header",
            Self::Malformed { .. } => "malformed",
            Self::Mismatch(_) => "mismatch",
            Self::Timestamp(_) => "timestamp",
        }
    }
}

/// Whether any candidate equals the expected tag. Every candidate is compared in full, in
/// constant time; one of the wrong length never matches.
fn any_matches<'a>(expected: &[u8; 32], candidates: impl IntoIterator<Item = &'a [u8]>) -> bool {
    let mut found = subtle::Choice::from(0);
    for c in candidates {
        if c.len() == expected.len() {
            found |= c.ct_eq(expected);
        }
    }
    found.into()
}

fn malformed(header: &'static str, problem: &'static str) -> SignatureError {
    SignatureError::Malformed { header, problem }
}

fn bounded(header: &'static str, value: &str) -> Result<(), SignatureError> {
    if value.len() > MAX_HEADER_BYTES {
        return Err(malformed(header, "longer than 2048 bytes"));
    }
    Ok(())
}

/// The `key=value` items of a comma-separated signature header (already bounded in length).
fn pairs<'a>(
    header: &'a str,
    name: &'static str,
) -> Result<Vec<(&'a str, &'a str)>, SignatureError> {
    bounded(name, header)?;
    header
        .split(',')
        .map(|item| {
            let (k, v) = item
                .trim()
                .split_once('=')
                .ok_or(malformed(name, "expected key=value pairs"))?;
            Ok((k.trim(), v.trim()))
        })
        .collect()
}

fn within(ts: i64, now: i64, tolerance: i64) -> bool {
    now.abs_diff(ts) <= tolerance.unsigned_abs()
}

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

/// Mercado Pago: `x-signature: ts=<ts>,v1=<hex>` over the manifest
/// `id:{data.id};request-id:{x-request-id};ts:{ts};`, leaving out the parts that are missing.
/// `ts` is in milliseconds. The body is not signed.
pub fn mercadopago(
    secret: &str,
    x_signature: Option<&str>,
    request_id: Option<&str>,
    data_id: Option<&str>,
    now: i64,
    tolerance: i64,
) -> Result<(), SignatureError> {
    const H: &str = "x-signature";
    let header = x_signature.ok_or(SignatureError::MissingHeader(H))?;
    let mut ts: Option<&str> = None;
    let mut v1: Option<&str> = None;
    for (k, v) in pairs(header, H)? {
        match k {
            "ts" => ts = Some(v),
            "v1" => v1 = Some(v),
            _ => {}
        }
    }
    let ts = ts.ok_or(malformed(H, "no ts"))?;
    let v1 = v1.ok_or(malformed(H, "no v1 signature"))?;
    let ts_ms: i64 = ts
        .parse()
        .map_err(|_| malformed(H, "ts is not an integer"))?;
    if !within(ts_ms / 1000, now, tolerance) {
        return Err(SignatureError::Timestamp(tolerance));
    }
    let data_id = data_id.filter(|s| !s.is_empty());
    let request_id = request_id.filter(|s| !s.is_empty());
    if data_id.is_some_and(|d| d.len() > 256) || request_id.is_some_and(|r| r.len() > 256) {
        return Err(malformed(
            H,
            "data.id or x-request-id longer than 256 bytes",
        ));
    }
    let mut manifest = String::new();
    if let Some(id) = data_id {
        if id.chars().all(|c| c.is_ascii_alphanumeric()) {
            manifest.push_str(&format!("id:{};", id.to_ascii_lowercase()));
        } else {
            manifest.push_str(&format!("id:{id};"));
        }
    }
    if let Some(rid) = request_id {
        manifest.push_str(&format!("request-id:{rid};"));
    }
    manifest.push_str(&format!("ts:{ts};"));
    let sig = hex::decode(v1).map_err(|_| SignatureError::Mismatch(H))?;
    let want = hmac_sha256(secret.as_bytes(), &[manifest.as_bytes()]);
    if !any_matches(&want, [sig.as_slice()]) {
        return Err(SignatureError::Mismatch(H));
    }
    Ok(())
}

/// Razorpay: `X-Razorpay-Signature` is the hex HMAC-SHA256 of the raw body.
pub fn razorpay(secret: &str, header: Option<&str>, body: &[u8]) -> Result<(), SignatureError> {
    const H: &str = "X-Razorpay-Signature";
    let header = header.ok_or(SignatureError::MissingHeader(H))?;
    bounded(H, header)?;
    let sig = hex::decode(header.trim()).map_err(|_| SignatureError::Mismatch(H))?;
    if sig.len() != 32 {
        return Err(SignatureError::Mismatch(H));
    }
    let want = hmac_sha256(secret.as_bytes(), &[body]);
    if !any_matches(&want, [sig.as_slice()]) {
        return Err(SignatureError::Mismatch(H));
    }
    Ok(())
}

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

/// Hex HMAC-SHA256, as Stripe and Razorpay senders compute it; for stand-ins and tests.
pub fn hex_hmac(secret: &[u8], parts: &[&[u8]]) -> String {
    hex::encode(hmac_sha256(secret, parts))
}

#[cfg(test)]
mod tests {
    use super::*;

    const DAY: i64 = 86_400;

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

    #[test]
    fn mercadopago_vector() {
        let ts = 1742505638683i64;
        let header =
            "ts=1742505638683,v1=85aaea44adced84bf23e95db43da124f818caad473052e8d0ecd46c5319c231e";
        let rid = Some("bb56a2f1-6aae-46ac-982e-9dcd3581d08e");
        let now = ts / 1000;
        assert_eq!(
            mercadopago(
                "v1-test-secret-not-a-real-key",
                Some(header),
                rid,
                Some("123456"),
                now,
                300
            ),
            Ok(())
        );
        assert_eq!(
            mercadopago(
                "v1-test-secret-not-a-real-key",
                Some(header),
                rid,
                Some("123457"),
                now,
                300
            ),
            Err(SignatureError::Mismatch("x-signature"))
        );
        assert_eq!(
            mercadopago(
                "v1-test-secret-not-a-real-key",
                Some(header),
                rid,
                Some("123456"),
                now + DAY,
                300
            ),
            Err(SignatureError::Timestamp(300))
        );
    }

    #[test]
    fn mercadopago_lowercases_alphanumeric_ids_and_omits_missing_parts() {
        let manifest = "id:abc123;ts:1700000000000;";
        let header = format!(
            "ts=1700000000000,v1={}",
            hex_hmac(b"s", &[manifest.as_bytes()])
        );
        assert_eq!(
            mercadopago("s", Some(&header), None, Some("ABC123"), 1700000000, 300),
            Ok(())
        );
    }

    #[test]
    fn razorpay_signs_the_raw_body() {
        let body = b"{\"event\":\"payment.captured\"}\n";
        let sig = hex_hmac(b"rzp_secret", &[body]);
        assert_eq!(razorpay("rzp_secret", Some(&sig), body), Ok(()));
        // A trailing newline is part of what was signed.
        assert_eq!(
            razorpay("rzp_secret", Some(&sig), &body[..body.len() - 1]),
            Err(SignatureError::Mismatch("X-Razorpay-Signature"))
        );
        // The checkout payment signature vector uses the same primitive.
        assert_eq!(
            hex_hmac(b"key_secret", &[b"fake_order_id|fake_payment_id"]),
            "b2335e3b0801106b84a7faff035df56ecffde06918c9ddd1f0fafbb37a51cc89"
        );
    }

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
    fn oversized_headers_and_too_many_candidates_are_refused_before_hashing() {
        let s = StandardSecret::parse("whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw").unwrap();
        let body = b"{}";
        let good = s.sign("msg_1", 1614265330, body);
        let nine = std::iter::repeat_n(good.as_str(), 9)
            .collect::<Vec<_>>()
            .join(" ");
        assert!(matches!(
            standard(
                &s,
                Some("msg_1"),
                Some("1614265330"),
                Some(&nine),
                body,
                1614265330,
                300
            ),
            Err(SignatureError::Malformed {
                problem: "more than 8 signatures",
                ..
            })
        ));
        let eight = std::iter::repeat_n(good.as_str(), 8)
            .collect::<Vec<_>>()
            .join(" ");
        assert_eq!(
            standard(
                &s,
                Some("msg_1"),
                Some("1614265330"),
                Some(&eight),
                body,
                1614265330,
                300
            ),
            Ok(())
        );
        let huge = format!("{good} {}", "x".repeat(MAX_HEADER_BYTES));
        assert!(matches!(
            standard(
                &s,
                Some("msg_1"),
                Some("1614265330"),
                Some(&huge),
                body,
                1614265330,
                300
            ),
            Err(SignatureError::Malformed {
                problem: "longer than 2048 bytes",
                ..
            })
        ));
        let many_v1 = format!("t=1700000000,{}", ["v1=00"; 9].join(","));
        assert!(matches!(
            stripe("whsec_x", Some(&many_v1), body, 1700000000, 300),
            Err(SignatureError::Malformed {
                problem: "more than 8 v1 signatures",
                ..
            })
        ));
    }

    #[test]
    fn a_stale_timestamp_is_refused_whatever_the_signature() {
        // Checked first: a stale request costs no hashing at all.
        let s = StandardSecret::parse("whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw").unwrap();
        assert_eq!(
            standard(
                &s,
                Some("m"),
                Some("1000"),
                Some("v1,AAAA"),
                b"{}",
                5000,
                300
            ),
            Err(SignatureError::Timestamp(300))
        );
        assert_eq!(
            stripe("whsec_x", Some("t=1000,v1=00"), b"{}", 5000, 300),
            Err(SignatureError::Timestamp(300))
        );
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

//! What every gateway's signing scheme shares (each scheme lives in its gateway's folder).
//!
//! The sender chooses the headers, so the cost of a refusal is bounded whatever they hold: a
//! signature header longer than [`MAX_HEADER_BYTES`] or carrying more than [`MAX_CANDIDATES`]
//! signatures is refused before any hashing; the signed timestamp is checked before any
//! hashing; and the expected MAC is computed once per request, then compared with each
//! candidate in constant time. The worst refused request costs one HMAC over the body.
//! Test vectors: ../shared/background/webhook-signatures.md.

use subtle::ConstantTimeEq;

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
pub(super) fn any_matches<'a>(
    expected: &[u8; 32],
    candidates: impl IntoIterator<Item = &'a [u8]>,
) -> bool {
    let mut found = subtle::Choice::from(0);
    for c in candidates {
        if c.len() == expected.len() {
            found |= c.ct_eq(expected);
        }
    }
    found.into()
}

pub(super) fn malformed(header: &'static str, problem: &'static str) -> SignatureError {
    SignatureError::Malformed { header, problem }
}

pub(super) fn bounded(header: &'static str, value: &str) -> Result<(), SignatureError> {
    if value.len() > MAX_HEADER_BYTES {
        return Err(malformed(header, "longer than 2048 bytes"));
    }
    Ok(())
}

/// The `key=value` items of a comma-separated signature header (already bounded in length).
pub(super) fn pairs<'a>(
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

pub(super) fn within(ts: i64, now: i64, tolerance: i64) -> bool {
    now.abs_diff(ts) <= tolerance.unsigned_abs()
}

/// Hex HMAC-SHA256, as Stripe and Razorpay senders compute it; for stand-ins and tests.
pub fn hex_hmac(secret: &[u8], parts: &[&[u8]]) -> String {
    hex::encode(hmac_sha256(secret, parts))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gateways::hosted::signature::standard;
    use crate::gateways::stripe::signature::stripe;
    use crate::secret::StandardSecret;
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
}

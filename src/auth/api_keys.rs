//! The marketplace backend's API keys (`api_keys`). An operator makes one (`POST
//! /admin/api-keys`); the key is shown that once and kept only as its SHA-256, so a copy of the
//! database gives no one a key. A key may be bound to a seller: it then reads only that seller's
//! data and cannot check out.
//!
//! Every authenticated request looks its key up: [`ApiKeys`] keeps each answer (a key, or "no
//! such key") for [`CACHE_TTL`], so a busy backend costs one query per key and half-second, and
//! a revocation holds in every process within a second without any message between them.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use sqlx::PgPool;
use uuid::Uuid;

use crate::catalogue::SellerId;

/// How long a looked-up key is believed: a revoked key stops working within this.
pub const CACHE_TTL: Duration = Duration::from_millis(500);
/// Most answers cached per process (a flood of made-up keys cannot grow it without bound).
const CACHE_ENTRIES: usize = 10_000;
const PREFIX: &str = "pfk_";
/// `pfk_` and 43 base64url characters (32 random bytes).
const KEY_LEN: usize = PREFIX.len() + 43;
/// Characters of a key kept in the clear to tell keys apart (`pfk_` and eight more).
const SHOWN: usize = PREFIX.len() + 8;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, sqlx::Type)]
#[serde(transparent)]
#[sqlx(transparent)]
pub struct ApiKeyId(pub Uuid);

impl std::fmt::Display for ApiKeyId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(f)
    }
}

/// A key as an operator sees it: never the key itself.
#[derive(Debug, Clone, Serialize, sqlx::FromRow, utoipa::ToSchema)]
pub struct ApiKey {
    pub id: ApiKeyId,
    pub name: String,
    pub seller_id: Option<SellerId>,
    /// The key's first characters.
    pub prefix: String,
    pub created_at: DateTime<Utc>,
    pub revoked_at: Option<DateTime<Utc>>,
}

#[derive(Debug, Clone, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct NewApiKey {
    pub name: String,
    pub seller_id: Option<String>,
}

/// What a presented key is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Lookup {
    InForce(KeyHolder),
    /// One of ours, revoked: a stale credential, not a guess.
    Revoked,
    /// `payfleet up`'s development key, presented to a process `up` did not start.
    Development,
    /// Not one of ours.
    Unknown,
}

/// Who holds a key that is in force.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KeyHolder {
    pub id: ApiKeyId,
    /// Bound to this seller: reads only its data, cannot check out.
    pub seller: Option<SellerId>,
}

#[derive(Debug, thiserror::Error)]
pub enum ApiKeyError {
    #[error("name must be 1 to 100 printable characters")]
    InvalidName,
    #[error("{0}")]
    InvalidSeller(String),
    #[error("no seller {0}")]
    UnknownSeller(SellerId),
    #[error("no API key {0:?}")]
    NotFound(String),
    #[error(transparent)]
    Database(#[from] sqlx::Error),
}

fn hash(key: &str) -> [u8; 32] {
    super::digest(key.as_bytes())
}

/// Whether `presented` has the shape of one of our keys: anything else is refused without a
/// query.
fn well_formed(presented: &str) -> bool {
    presented.len() == KEY_LEN
        && presented.starts_with(PREFIX)
        && presented[PREFIX.len()..]
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
}

const COLUMNS: &str = "id, name, seller_id, prefix, created_at, revoked_at";

/// Makes a key: returns it as listed and the key itself, to show once.
pub async fn create(pool: &PgPool, new: NewApiKey) -> Result<(ApiKey, String), ApiKeyError> {
    make(pool, new, false).await
}

/// Makes `payfleet up`'s development key: accepted only by a process whose [`ApiKeys`] take
/// development keys (`up`'s), since `up` keeps it in plain text for its restarts and `demo`.
pub async fn create_development(
    pool: &PgPool,
    new: NewApiKey,
) -> Result<(ApiKey, String), ApiKeyError> {
    make(pool, new, true).await
}

async fn make(
    pool: &PgPool,
    new: NewApiKey,
    development: bool,
) -> Result<(ApiKey, String), ApiKeyError> {
    let name = new.name.trim();
    if name.is_empty() || name.chars().count() > 100 || name.chars().any(char::is_control) {
        return Err(ApiKeyError::InvalidName);
    }
    let seller: Option<SellerId> = new
        .seller_id
        .as_deref()
        .map(|s| {
            s.parse().map_err(|e: crate::catalogue::CatalogueError| {
                ApiKeyError::InvalidSeller(e.to_string())
            })
        })
        .transpose()?;
    let key = super::random_credential(PREFIX);
    let made = sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "INSERT INTO api_keys (name, seller_id, key_hash, prefix, development) VALUES ($1, $2, $3, $4, $5)
         RETURNING {COLUMNS}"
    )))
    .bind(name)
    .bind(seller)
    .bind(&hash(&key)[..])
    .bind(&key[..SHOWN])
    .bind(development)
    .fetch_one(pool)
    .await
    .map_err(|e| match &e {
        sqlx::Error::Database(d) if d.constraint() == Some("api_keys_seller_id_fkey") => {
            seller.map_or(ApiKeyError::Database(e), ApiKeyError::UnknownSeller)
        }
        _ => ApiKeyError::Database(e),
    })?;
    Ok((made, key))
}

/// Every key, newest first, revoked ones included (with when).
pub async fn list(pool: &PgPool) -> Result<Vec<ApiKey>, sqlx::Error> {
    sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT {COLUMNS} FROM api_keys ORDER BY created_at DESC, id"
    )))
    .fetch_all(pool)
    .await
}

/// Revokes a key (once: revoking it again changes nothing and answers it as it is).
pub async fn revoke(pool: &PgPool, raw_id: &str) -> Result<ApiKey, ApiKeyError> {
    let id = Uuid::parse_str(raw_id.trim()).map_err(|_| ApiKeyError::NotFound(raw_id.into()))?;
    let row: Option<ApiKey> = sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "UPDATE api_keys SET revoked_at = COALESCE(revoked_at, now()) WHERE id = $1 RETURNING {COLUMNS}"
    )))
    .bind(id)
    .fetch_optional(pool)
    .await?;
    row.ok_or_else(|| ApiKeyError::NotFound(raw_id.into()))
}

/// Answers by key hash, with when each was looked up.
type Cache = HashMap<[u8; 32], (Instant, Lookup)>;

/// The keys in force, as this process knows them.
#[derive(Clone)]
pub struct ApiKeys {
    pool: PgPool,
    cache: Arc<Mutex<Cache>>,
    /// The keys this process has found in force, by hash, until found otherwise: never evicted
    /// with the cache (which a flood of made-up keys may clear), and no larger than the keys
    /// really issued.
    in_force: Arc<Mutex<HashSet<[u8; 32]>>>,
    /// Whether `payfleet up`'s development keys are in force here (only in `up`'s process).
    development: bool,
}

impl ApiKeys {
    pub fn new(pool: PgPool) -> Self {
        Self {
            pool,
            cache: Arc::default(),
            in_force: Arc::default(),
            development: false,
        }
    }

    /// The keys of `payfleet up`'s process: its development key is in force too.
    pub fn with_development_keys(self) -> Self {
        Self {
            development: true,
            ..self
        }
    }

    /// What `presented` is, when this process knows it already (or it is not even of our
    /// shape): no query.
    pub fn cached(&self, presented: &str) -> Option<Lookup> {
        if !well_formed(presented) {
            return Some(Lookup::Unknown);
        }
        match self.lock().get(&hash(presented)) {
            Some((at, answer)) if at.elapsed() < CACHE_TTL => Some(*answer),
            _ => None,
        }
    }

    /// Whether this process has seen `presented` in force, however long ago: not a guess.
    pub fn seen_in_force(&self, presented: &str) -> bool {
        well_formed(presented)
            && self
                .in_force
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .contains(&hash(presented))
    }

    /// What `presented` is, asked of the database unless cached. An error is an outage (the
    /// caller answers 503, not 401).
    pub async fn lookup(&self, presented: &str) -> Result<Lookup, sqlx::Error> {
        if let Some(answer) = self.cached(presented) {
            return Ok(answer);
        }
        let h = hash(presented);
        let row: Option<(ApiKeyId, Option<SellerId>, bool, bool)> = sqlx::query_as(
            "SELECT id, seller_id, revoked_at IS NOT NULL, development FROM api_keys WHERE key_hash = $1",
        )
        .bind(&h[..])
        .fetch_optional(&self.pool)
        .await?;
        let answer = match row {
            Some((_, _, true, _)) => Lookup::Revoked,
            Some((_, _, false, true)) if !self.development => Lookup::Development,
            Some((id, seller, false, _)) => Lookup::InForce(KeyHolder { id, seller }),
            None => Lookup::Unknown,
        };
        {
            let mut in_force = self.in_force.lock().unwrap_or_else(|p| p.into_inner());
            if matches!(answer, Lookup::InForce(_)) {
                in_force.insert(h);
            } else {
                in_force.remove(&h);
            }
        }
        let now = Instant::now();
        let mut cache = self.lock();
        if cache.len() >= CACHE_ENTRIES {
            cache.retain(|_, (at, _)| now.duration_since(*at) < CACHE_TTL);
            if cache.len() >= CACHE_ENTRIES {
                cache.clear();
            }
        }
        cache.insert(h, (now, answer));
        Ok(answer)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<[u8; 32], (Instant, Lookup)>> {
        // A panic while holding it leaves only cached answers behind: still usable.
        self.cache.lock().unwrap_or_else(|p| p.into_inner())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use base64::Engine;

    #[test]
    fn only_our_shape_of_key_is_looked_up() {
        let key = format!(
            "{PREFIX}{}",
            base64::engine::general_purpose::URL_SAFE_NO_PAD.encode([7u8; 32])
        );
        assert!(well_formed(&key));
        assert!(!well_formed(&key[..KEY_LEN - 1]));
        assert!(!well_formed(&format!("{key}x")));
        assert!(!well_formed(&key.replacen("pfk_", "pfx_", 1)));
        assert!(!well_formed(&format!("{PREFIX}{}", "!".repeat(43))));
        assert!(!well_formed(""));
    }
}

//! The handler's key-value store, namespaced per handler by the router.
//!
//! Reads see this invocation's own writes. Writes are buffered by the router and committed all
//! or none, so a crash or a trap never leaves half of an invocation's writes behind.
//!
//! # When writes are committed
//!
//! Whenever [`Handler::handle`](crate::Handler::handle) returns a result of its own choosing:
//! `Ok` (together with the emitted events and the delivery's COMPLETED record),
//! [`HandlerError::retry`](crate::HandlerError::retry) or
//! [`HandlerError::fail`](crate::HandlerError::fail). They are dropped, with any emissions, when
//! the invocation traps (a panic included), times out, runs out of memory, breaches a limit, or
//! returns an emission that is not a valid event. When the commit itself cannot be made (a
//! [`compare_and_set`] precondition no longer holds, the namespace filled up meanwhile, the
//! router is stopping), nothing is committed either and the handler runs again.
//!
//! This matters for marks of work done: a handler that records "done" and then returns `fail`
//! keeps the record, so after the operator fixes the cause and redrives the dead letter, the
//! handler finds the work marked done and skips it. Write such marks only on the path that
//! returns `Ok`. The other way round, writes made before a `retry` are there at the next attempt,
//! which is how a handler counts its attempts or resumes where it stopped.
//!
//! # Idempotency
//!
//! [`compare_and_set`] is the building block: the router re-checks its precondition when it
//! commits, and when another delivery changed the key meanwhile it commits nothing and runs the
//! handler again. A value written by compare-and-set never expires; to keep a claim for a
//! while, follow it with [`set`] of the same value and a TTL. The `set` replaces the buffered
//! value but not the precondition, which the router still checks at commit.
//!
//! ```
//! use router_sdk::kv;
//! use std::time::Duration;
//!
//! // Record an order once, whatever the number of deliveries, and forget it after 30 days.
//! let claim = |key: &str| {
//!     let first = kv::compare_and_set(key, None, Some(b"seen"));
//!     if first {
//!         kv::set(key, b"seen", Some(Duration::from_secs(30 * 24 * 3600)));
//!     }
//!     first
//! };
//! assert!(claim("order:A-17"));
//! assert!(!claim("order:A-17"));
//! # router_sdk::testing::reset();
//! ```
//!
//! # Limits
//!
//! Each of these traps the invocation, so nothing of it is committed:
//!
//! - a key longer than [`MAX_KEY_BYTES`] (1024 bytes), in any call, [`get`] included: a
//!   `handler_limit` failure, permanent (dead-lettered at once, since the same event would
//!   breach it again);
//! - more than 1 MiB of writes in one invocation (keys plus values, summed over every [`set`],
//!   [`delete`] and successful [`compare_and_set`], even of the same key, plus, once per key,
//!   the key and stored value each [`compare_and_set`] depended on, which the router keeps to
//!   re-check at commit): `handler_limit`, permanent;
//! - a write that grows the handler's namespace past `handlers.kv_max_bytes` (default 64 MiB,
//!   keys plus values), or a read the router cannot serve: a `handler_host` failure, retried
//!   under the target's policy (keys may expire meanwhile).
//!
//! On the host target (unit tests) the store is an in-memory map per thread that ignores TTLs;
//! a key over [`MAX_KEY_BYTES`] panics there, so a test fails where the router would trap.

use std::time::Duration;

use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::DataError;

/// The longest key, in bytes. A longer key traps the invocation (`handler_limit`, permanent).
///
/// ```
/// let key = format!("order:{}", "A-17");
/// assert!(key.len() <= router_sdk::kv::MAX_KEY_BYTES);
/// ```
pub const MAX_KEY_BYTES: usize = 1024;

/// The value stored under `key`, if any.
///
/// ```
/// assert_eq!(router_sdk::kv::get("never-set"), None);
/// ```
pub fn get(key: &str) -> Option<Vec<u8>> {
    #[cfg(target_arch = "wasm32")]
    return crate::guest::kv_get(key);
    #[cfg(not(target_arch = "wasm32"))]
    return crate::native::kv_get(key);
}

/// Stores `value` under `key`; with a `ttl` the entry expires that long after the commit,
/// without one it never expires (whatever TTL it had before).
///
/// ```
/// use std::time::Duration;
/// router_sdk::kv::set("session", b"abc", Some(Duration::from_secs(60)));
/// assert_eq!(router_sdk::kv::get("session").as_deref(), Some(&b"abc"[..]));
/// # router_sdk::testing::reset();
/// ```
pub fn set(key: &str, value: &[u8], ttl: Option<Duration>) {
    let ttl_ms = ttl.map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX));
    #[cfg(target_arch = "wasm32")]
    crate::guest::kv_set(key, value, ttl_ms);
    #[cfg(not(target_arch = "wasm32"))]
    crate::native::kv_set(key, value, ttl_ms);
}

/// Removes `key` (nothing happens when it is absent).
///
/// ```
/// router_sdk::kv::set("k", b"v", None);
/// router_sdk::kv::delete("k");
/// assert_eq!(router_sdk::kv::get("k"), None);
/// ```
pub fn delete(key: &str) {
    #[cfg(target_arch = "wasm32")]
    crate::guest::kv_delete(key);
    #[cfg(not(target_arch = "wasm32"))]
    crate::native::kv_delete(key);
}

/// Writes `new` under `key` (`None`: deletes it) only if the current value equals `expected`
/// (`None`: the key is absent). Returns whether the write happened.
///
/// The router checks the precondition again when it commits (see the [module docs](self)).
/// The value written has no TTL, and replaces any TTL the entry had: follow a successful
/// compare-and-set with [`set`] of the same value to give it one.
///
/// ```
/// use router_sdk::kv;
/// use std::time::Duration;
///
/// assert!(kv::compare_and_set("counter", None, Some(b"1")));
/// assert!(!kv::compare_and_set("counter", None, Some(b"1")));
/// assert!(kv::compare_and_set("counter", Some(b"1"), Some(b"2")));
/// // Claimed; now let the claim expire in a day.
/// kv::set("counter", b"2", Some(Duration::from_secs(24 * 3600)));
/// # router_sdk::testing::reset();
/// ```
pub fn compare_and_set(key: &str, expected: Option<&[u8]>, new: Option<&[u8]>) -> bool {
    #[cfg(target_arch = "wasm32")]
    return crate::guest::kv_compare_and_set(key, expected, new);
    #[cfg(not(target_arch = "wasm32"))]
    return crate::native::kv_compare_and_set(key, expected, new);
}

/// The value under `key` decoded from JSON; `Ok(None)` when absent.
///
/// ```
/// router_sdk::kv::set_json("attempts", &3u32, None).unwrap();
/// assert_eq!(router_sdk::kv::get_json::<u32>("attempts").unwrap(), Some(3));
/// # router_sdk::testing::reset();
/// ```
pub fn get_json<T: DeserializeOwned>(key: &str) -> Result<Option<T>, DataError> {
    match get(key) {
        Some(bytes) => Ok(Some(serde_json::from_slice(&bytes)?)),
        None => Ok(None),
    }
}

/// Stores `value` under `key` encoded as JSON.
///
/// ```
/// #[derive(serde::Serialize)]
/// struct Seen { at: String }
/// router_sdk::kv::set_json("seen", &Seen { at: "2024-01-01".into() }, None).unwrap();
/// # router_sdk::testing::reset();
/// ```
pub fn set_json<T: Serialize + ?Sized>(
    key: &str,
    value: &T,
    ttl: Option<Duration>,
) -> Result<(), DataError> {
    let bytes = serde_json::to_vec(value)?;
    set(key, &bytes, ttl);
    Ok(())
}

/// [`compare_and_set`] with JSON-encoded values (no TTL either: follow it with [`set_json`]).
///
/// ```
/// use router_sdk::kv;
/// assert!(kv::compare_and_set_json::<u32>("v", None, Some(&1)).unwrap());
/// assert!(kv::compare_and_set_json("v", Some(&1u32), Some(&2u32)).unwrap());
/// # router_sdk::testing::reset();
/// ```
pub fn compare_and_set_json<T: Serialize + ?Sized>(
    key: &str,
    expected: Option<&T>,
    new: Option<&T>,
) -> Result<bool, DataError> {
    let expected = expected.map(serde_json::to_vec).transpose()?;
    let new = new.map(serde_json::to_vec).transpose()?;
    Ok(compare_and_set(key, expected.as_deref(), new.as_deref()))
}

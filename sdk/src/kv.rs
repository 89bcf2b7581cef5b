//! The handler's key-value store, namespaced per handler by the router.
//!
//! Reads see this invocation's own writes. Writes are buffered by the router and committed
//! together with the delivery's acknowledgement, so a crash or a trap never leaves half of an
//! invocation's writes behind. [`compare_and_set`] is the building block for idempotency: the
//! router re-checks its precondition when it commits.
//!
//! ```
//! use router_sdk::kv;
//!
//! // Record an order once, whatever the number of deliveries.
//! let first = kv::compare_and_set("order:A-17", None, Some(b"seen"));
//! let again = kv::compare_and_set("order:A-17", None, Some(b"seen"));
//! assert!(first && !again);
//! # router_sdk::testing::reset();
//! ```

use std::time::Duration;

use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::DataError;

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

/// Stores `value` under `key`; with a `ttl` the entry expires after that long.
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
/// ```
/// use router_sdk::kv;
/// assert!(kv::compare_and_set("counter", None, Some(b"1")));
/// assert!(!kv::compare_and_set("counter", None, Some(b"1")));
/// assert!(kv::compare_and_set("counter", Some(b"1"), Some(b"2")));
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

/// [`compare_and_set`] with JSON-encoded values.
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

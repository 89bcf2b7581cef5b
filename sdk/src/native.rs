//! Host-target stand-ins for the router's imports, so handlers build and unit-test natively:
//! log lines go to standard error (and a per-thread buffer), the store is a per-thread map.
//!
//! Where the router would stop an invocation for a rule the handler broke (a key too long), the
//! stand-ins panic with the router's reason: a unit test then fails the way the invocation
//! would, instead of passing here and failing after upload. (An emitted extension the router
//! refuses is an error of [`Emit::with_extension`](crate::Emit::with_extension) on every
//! target.)

use std::cell::RefCell;
use std::collections::BTreeMap;

use crate::kv::MAX_KEY_BYTES;
use crate::log::Level;

thread_local! {
    static KV: RefCell<BTreeMap<String, Vec<u8>>> = const { RefCell::new(BTreeMap::new()) };
    static LOGS: RefCell<Vec<(Level, String)>> = const { RefCell::new(Vec::new()) };
}

pub(crate) fn log(level: Level, message: &str) {
    eprintln!("[{level:?}] {message}");
    LOGS.with(|l| l.borrow_mut().push((level, message.to_owned())));
}

/// The router traps the invocation (`handler_limit`) on any call with a longer key.
fn check_key(key: &str) {
    assert!(
        key.len() <= MAX_KEY_BYTES,
        "kv key of {} bytes is longer than the limit of {MAX_KEY_BYTES} (the router traps the invocation: handler_limit)",
        key.len()
    );
}

pub(crate) fn kv_get(key: &str) -> Option<Vec<u8>> {
    check_key(key);
    KV.with(|kv| kv.borrow().get(key).cloned())
}

pub(crate) fn kv_set(key: &str, value: &[u8], _ttl_ms: Option<u64>) {
    check_key(key);
    KV.with(|kv| kv.borrow_mut().insert(key.to_owned(), value.to_vec()));
}

pub(crate) fn kv_delete(key: &str) {
    check_key(key);
    KV.with(|kv| kv.borrow_mut().remove(key));
}

pub(crate) fn kv_compare_and_set(key: &str, expected: Option<&[u8]>, new: Option<&[u8]>) -> bool {
    check_key(key);
    KV.with(|kv| {
        let mut kv = kv.borrow_mut();
        if kv.get(key).map(Vec::as_slice) != expected {
            return false;
        }
        match new {
            Some(v) => kv.insert(key.to_owned(), v.to_vec()),
            None => kv.remove(key),
        };
        true
    })
}

/// Clears this thread's key-value store and captured log lines (call it between tests).
///
/// ```
/// router_sdk::kv::set("k", b"v", None);
/// router_sdk::testing::reset();
/// assert!(router_sdk::kv::get("k").is_none());
/// ```
pub fn reset() {
    KV.with(|kv| kv.borrow_mut().clear());
    LOGS.with(|l| l.borrow_mut().clear());
}

/// Takes the log lines this thread wrote since the last call (or [`reset`]).
///
/// ```
/// router_sdk::log::info!("hello {}", 1);
/// let logs = router_sdk::testing::take_logs();
/// assert_eq!(logs.last().map(|(_, m)| m.as_str()), Some("hello 1"));
/// ```
pub fn take_logs() -> Vec<(Level, String)> {
    LOGS.with(|l| std::mem::take(&mut *l.borrow_mut()))
}

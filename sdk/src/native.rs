//! Host-target stand-ins for the router's imports, so handlers build and unit-test natively:
//! log lines go to standard error (and a per-thread buffer), the store is a per-thread map.

use std::cell::RefCell;
use std::collections::BTreeMap;

use crate::log::Level;

thread_local! {
    static KV: RefCell<BTreeMap<String, Vec<u8>>> = const { RefCell::new(BTreeMap::new()) };
    static LOGS: RefCell<Vec<(Level, String)>> = const { RefCell::new(Vec::new()) };
}

pub(crate) fn log(level: Level, message: &str) {
    eprintln!("[{level:?}] {message}");
    LOGS.with(|l| l.borrow_mut().push((level, message.to_owned())));
}

pub(crate) fn kv_get(key: &str) -> Option<Vec<u8>> {
    KV.with(|kv| kv.borrow().get(key).cloned())
}

pub(crate) fn kv_set(key: &str, value: &[u8], _ttl_ms: Option<u64>) {
    KV.with(|kv| kv.borrow_mut().insert(key.to_owned(), value.to_vec()));
}

pub(crate) fn kv_delete(key: &str) {
    KV.with(|kv| kv.borrow_mut().remove(key));
}

pub(crate) fn kv_compare_and_set(key: &str, expected: Option<&[u8]>, new: Option<&[u8]>) -> bool {
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

//! Crash and delay points for end-to-end tests of the durability promises: with
//! `EVENT_ROUTER_CRASH_AT=<point>:<detail>` in its environment, the process aborts — like a
//! kill -9: no cleanup, no flush, no unwinding — the first time it reaches that point for that
//! detail. A kill from outside cannot hit a window of microseconds (a handler has run, its
//! ack is not committed yet) on purpose; this can.
//!
//! Points: `before_ack:<target id>` — a delivery attempt has finished (for a handler: it ran
//! and its outbox is built) and its result is about to be committed; `compaction:pass_<n>` —
//! the embedded store's compaction has committed its n-th pass and may have more. Delay points
//! (`EVENT_ROUTER_DELAY_AT`, see `delay_point`) stretch a window that is too short to watch.
//!
//! Not a `ROUTER_*` variable (those are configuration keys), and not behind a cargo feature:
//! the tests drive the same binary operators run, and the check is one comparison against a
//! value read once at start.

use std::sync::OnceLock;

/// The variable naming the crash point.
pub const ENV: &str = "EVENT_ROUTER_CRASH_AT";

fn armed() -> Option<&'static str> {
    static AT: OnceLock<Option<String>> = OnceLock::new();
    AT.get_or_init(|| std::env::var(ENV).ok().filter(|v| !v.is_empty()))
        .as_deref()
}

/// The variable naming a delay point: `EVENT_ROUTER_DELAY_AT=<point>:<milliseconds>`.
pub const DELAY_ENV: &str = "EVENT_ROUTER_DELAY_AT";

/// How long to stall at `point`, if the process was started with
/// `EVENT_ROUTER_DELAY_AT=<point>:<ms>`. Points: `compaction` — the store holds the database
/// this much longer while compacting, so a test can watch what traffic sees meanwhile (a
/// compaction of a test-sized file takes milliseconds; one of gigabytes, tens of seconds).
pub fn delay_point(point: &str) -> Option<std::time::Duration> {
    static AT: OnceLock<Option<(String, u64)>> = OnceLock::new();
    let (p, ms) = AT
        .get_or_init(|| {
            let v = std::env::var(DELAY_ENV).ok()?;
            let (p, ms) = v.split_once(':')?;
            Some((p.to_string(), ms.parse().ok()?))
        })
        .as_ref()?;
    (p == point).then(|| std::time::Duration::from_millis(*ms))
}

/// The variable naming a failure point: `EVENT_ROUTER_FAIL_AT=<point>:<detail>`.
pub const FAIL_ENV: &str = "EVENT_ROUTER_FAIL_AT";

/// Whether to fail at `point` for `detail` now: true the first time the process reaches it
/// when started with `EVENT_ROUTER_FAIL_AT=<point>:<detail>`, false ever after. Points:
/// `finish_contended:<target id>` — the first finish of that target is answered as the
/// store's `Contended` (its records kept changing under concurrent finishes), which on one
/// node of a test takes a load no test should need.
pub fn fail_once(point: &str, detail: &str) -> bool {
    static AT: OnceLock<Option<String>> = OnceLock::new();
    static FIRED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
    let Some(at) = AT
        .get_or_init(|| std::env::var(FAIL_ENV).ok().filter(|v| !v.is_empty()))
        .as_deref()
    else {
        return false;
    };
    at.split_once(':') == Some((point, detail))
        && !FIRED.swap(true, std::sync::atomic::Ordering::SeqCst)
}

/// Aborts the process if it was started with `EVENT_ROUTER_CRASH_AT=<point>:<detail>`.
pub fn crash_point(point: &str, detail: &str) {
    let Some(at) = armed() else { return };
    if at.split_once(':') == Some((point, detail)) {
        eprintln!("{ENV}={at}: aborting at this crash point");
        std::process::abort();
    }
}

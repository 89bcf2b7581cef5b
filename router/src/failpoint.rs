//! Crash and delay points for end-to-end tests of the durability promises: with
//! `EVENT_ROUTER_CRASH_AT=<point>:<detail>` in its environment, the process aborts — like a
//! kill -9: no cleanup, no flush, no unwinding — the first time it reaches that point for that
//! detail. A kill from outside cannot hit a window of microseconds (a handler has run, its
//! ack is not committed yet) on purpose; this can.
//!
//! Points: `before_ack:<target id>` — a delivery attempt has finished (for a handler: it ran
//! and its outbox is built) and its result is about to be committed; `compaction:pass_<n>` —
//! the embedded store's compaction has committed its n-th pass and may have more. Delay points
//! (`EVENT_ROUTER_DELAY_AT`, see `delay_point` and `delay_once`) stretch a window that is too
//! short to watch.
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

/// The variable naming a delay point: `EVENT_ROUTER_DELAY_AT=<point>[:<detail>]:<milliseconds>`.
pub const DELAY_ENV: &str = "EVENT_ROUTER_DELAY_AT";

/// The delay point armed by `EVENT_ROUTER_DELAY_AT`: (point, detail, milliseconds).
fn delay_armed() -> Option<&'static (String, Option<String>, u64)> {
    static AT: OnceLock<Option<(String, Option<String>, u64)>> = OnceLock::new();
    AT.get_or_init(|| parse_delay(&std::env::var(DELAY_ENV).ok()?))
        .as_ref()
}

fn parse_delay(v: &str) -> Option<(String, Option<String>, u64)> {
    let (at, ms) = v.rsplit_once(':')?;
    let ms = ms.parse().ok()?;
    Some(match at.split_once(':') {
        Some((p, d)) => (p.to_string(), Some(d.to_string()), ms),
        None => (at.to_string(), None, ms),
    })
}

/// How long to stall at `point`, if the process was started with
/// `EVENT_ROUTER_DELAY_AT=<point>:<ms>`. Points: `compaction` — the store holds the database
/// this much longer while compacting, so a test can watch what traffic sees meanwhile (a
/// compaction of a test-sized file takes milliseconds; one of gigabytes, tens of seconds).
pub fn delay_point(point: &str) -> Option<std::time::Duration> {
    let (p, d, ms) = delay_armed()?;
    (p == point && d.is_none()).then(|| std::time::Duration::from_millis(*ms))
}

/// How long to stall at `point` for `detail`: the first time the process reaches it when
/// started with `EVENT_ROUTER_DELAY_AT=<point>:<detail>:<ms>`, and never after. Points:
/// `before_ack:<target id>` — an attempt has finished and its result waits that long before
/// it is committed: a worker that stalls past its lease, which a live attempt (bounded by its
/// policy timeout, inside the lease) does not otherwise do; `deferred_compile:<handler>` — a
/// start's background compilation of that handler (`HandlerRegistry::load_deferred`) begins
/// that much later; `upload_compile:<handler>` — the validation of an upload of that handler
/// (its compilation) takes that much longer.
pub fn delay_once(point: &str, detail: &str) -> Option<std::time::Duration> {
    static FIRED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
    let (p, d, ms) = delay_armed()?;
    (p == point
        && d.as_deref() == Some(detail)
        && !FIRED.swap(true, std::sync::atomic::Ordering::SeqCst))
    .then(|| std::time::Duration::from_millis(*ms))
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

#[cfg(test)]
mod tests {
    use super::parse_delay;

    #[test]
    fn delay_values_name_a_point_an_optional_detail_and_milliseconds() {
        assert_eq!(
            parse_delay("compaction:3000"),
            Some(("compaction".into(), None, 3000))
        );
        assert_eq!(
            parse_delay("before_ack:hostile:250"),
            Some(("before_ack".into(), Some("hostile".into()), 250))
        );
        assert_eq!(parse_delay("compaction"), None);
        assert_eq!(parse_delay("compaction:soon"), None);
    }
}

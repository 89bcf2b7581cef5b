//! `flaky`: asks for a retry (after 100 ms) the first N times it sees an event id, N being
//! `data.fail_times` (default 2); attempts are counted in the key-value store.

use std::time::Duration;

use router_sdk::{Delivery, Descriptor, Emit, Event, Handler, HandlerError, kv, log};

/// The handler.
pub struct Flaky;

/// How long the handler asks the router to wait before the next attempt.
const RETRY_DELAY: Duration = Duration::from_millis(100);

impl Handler for Flaky {
    fn describe() -> Descriptor {
        Descriptor::new("flaky", env!("CARGO_PKG_VERSION"))
    }

    fn handle(event: &Event, _delivery: &Delivery) -> Result<Vec<Emit>, HandlerError> {
        let data = event.data_value()?;
        let fail_times = data
            .get("fail_times")
            .and_then(serde_json::Value::as_u64)
            .unwrap_or(2);
        let key = format!("flaky:{}", event.id);
        let seen: u64 = kv::get_json(&key)?.unwrap_or(0);
        let attempt = seen + 1;
        kv::set_json(&key, &attempt, Some(Duration::from_secs(24 * 3600)))?;
        if attempt <= fail_times {
            log::warn!(
                "attempt {attempt} of event {}: failing on purpose",
                event.id
            );
            return Err(HandlerError::retry_after(
                RETRY_DELAY,
                format!("flaky: attempt {attempt} of {fail_times} planned failures"),
            ));
        }
        log::info!("attempt {attempt} of event {}: succeeding", event.id);
        Ok(Vec::new())
    }
}

router_sdk::export_handler!(Flaky);

#[cfg(all(test, not(target_arch = "wasm32")))]
mod tests {
    use super::*;

    #[test]
    fn fails_n_times_then_succeeds() {
        router_sdk::testing::reset();
        let event = Event::new("e1", "/s", "t")
            .with_data(&serde_json::json!({"fail_times": 1}))
            .unwrap();
        assert!(
            Flaky::handle(&event, &Delivery::default())
                .unwrap_err()
                .is_retry()
        );
        assert!(Flaky::handle(&event, &Delivery::default()).is_ok());
    }
}

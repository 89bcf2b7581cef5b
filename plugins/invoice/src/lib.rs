//! `invoice`: records `invoice:<order_id>` once per order with compare-and-set, so a second
//! delivery of the same order is a no-op, and keeps the record for 30 days (`RECORD_TTL`). Emits
//! nothing.

use std::time::Duration;

use router_sdk::{Delivery, Descriptor, Emit, Event, Handler, HandlerError, kv, log};
use serde::{Deserialize, Serialize};

/// How long an order's record is kept. Compare-and-set writes without a TTL, so the claim is
/// followed by a `set` of the same record with this one: without it, every order ever paid
/// would stay in the namespace (bounded by `handlers.kv_max_bytes`) for good. A redelivery of
/// the same order after this long is recorded again.
const RECORD_TTL: Duration = Duration::from_secs(30 * 24 * 3600);

/// The handler.
pub struct Invoice;

#[derive(Deserialize)]
struct Order {
    order_id: serde_json::Value,
}

/// What is stored under `invoice:<order_id>`.
#[derive(Serialize)]
struct Record<'a> {
    event_id: &'a str,
    idempotency_key: &'a str,
}

fn order_key(order_id: &serde_json::Value) -> Result<String, HandlerError> {
    match order_id {
        serde_json::Value::String(s) if !s.is_empty() => Ok(format!("invoice:{s}")),
        serde_json::Value::Number(n) => Ok(format!("invoice:{n}")),
        _ => Err(HandlerError::fail(
            "data.order_id must be a non-empty string or a number",
        )),
    }
}

impl Handler for Invoice {
    fn describe() -> Descriptor {
        Descriptor::new("invoice", env!("CARGO_PKG_VERSION")).accepts("order.paid", &[])
    }

    fn handle(event: &Event, delivery: &Delivery) -> Result<Vec<Emit>, HandlerError> {
        let order: Order = event.data_as()?;
        let key = order_key(&order.order_id)?;
        let record = serde_json::to_vec(&Record {
            event_id: &event.id,
            idempotency_key: &delivery.idempotency_key,
        })?;
        if kv::compare_and_set(&key, None, Some(&record)) {
            // Replaces the claim's buffered value only: the router still commits it on the
            // condition that the key was absent, so two racing deliveries record it once.
            kv::set(&key, &record, Some(RECORD_TTL));
            log::info!("recorded {key}");
        } else {
            log::info!("{key} already recorded; nothing to do");
        }
        Ok(Vec::new())
    }
}

router_sdk::export_handler!(Invoice);

#[cfg(all(test, not(target_arch = "wasm32")))]
mod tests {
    use super::*;

    #[test]
    fn records_once() {
        router_sdk::testing::reset();
        let event = Event::new("1", "/shop", "order.paid")
            .with_data(&serde_json::json!({"order_id": "A-1"}))
            .unwrap();
        assert!(
            Invoice::handle(&event, &Delivery::default())
                .unwrap()
                .is_empty()
        );
        assert!(kv::get("invoice:A-1").is_some());
        assert!(
            Invoice::handle(&event, &Delivery::default())
                .unwrap()
                .is_empty()
        );
        let logs = router_sdk::testing::take_logs();
        assert!(logs[1].1.contains("already recorded"));
    }
}

//! `strict`: fails permanently unless `data.valid == true`.

use router_sdk::{Delivery, Descriptor, Emit, Event, Handler, HandlerError};

/// The handler.
pub struct Strict;

impl Handler for Strict {
    fn describe() -> Descriptor {
        Descriptor::new("strict", env!("CARGO_PKG_VERSION"))
    }

    fn handle(event: &Event, _delivery: &Delivery) -> Result<Vec<Emit>, HandlerError> {
        let data = event.data_value()?;
        if data.get("valid") == Some(&serde_json::Value::Bool(true)) {
            Ok(Vec::new())
        } else {
            Err(HandlerError::fail(format!(
                "event {} is invalid: data.valid is not true",
                event.id
            )))
        }
    }
}

router_sdk::export_handler!(Strict);

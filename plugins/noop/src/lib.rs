//! `noop`: accepts anything and emits nothing. The baseline for measuring invocation overhead.

use router_sdk::{Delivery, Descriptor, Emit, Event, Handler, HandlerError};

/// The handler.
pub struct Noop;

impl Handler for Noop {
    fn describe() -> Descriptor {
        Descriptor::new("noop", env!("CARGO_PKG_VERSION"))
    }

    fn handle(_event: &Event, _delivery: &Delivery) -> Result<Vec<Emit>, HandlerError> {
        Ok(Vec::new())
    }
}

router_sdk::export_handler!(Noop);

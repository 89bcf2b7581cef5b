//! `enrich`: emits one derived event `<type>.enriched` whose data is the input data plus
//! `{"enriched": true, "len": <number of keys in the input data>}`.

use router_sdk::{Delivery, Descriptor, Emit, Event, Handler, HandlerError};

/// The handler.
pub struct Enrich;

/// The enrichment itself: a pure function, unit-tested natively.
pub fn enrich(data: serde_json::Value) -> Result<serde_json::Value, HandlerError> {
    let serde_json::Value::Object(mut map) = data else {
        return Err(HandlerError::fail("data must be a JSON object"));
    };
    let len = map.len();
    map.insert("enriched".to_owned(), serde_json::Value::Bool(true));
    map.insert("len".to_owned(), serde_json::Value::from(len));
    Ok(serde_json::Value::Object(map))
}

impl Handler for Enrich {
    fn describe() -> Descriptor {
        Descriptor::new("enrich", env!("CARGO_PKG_VERSION"))
    }

    fn handle(event: &Event, _delivery: &Delivery) -> Result<Vec<Emit>, HandlerError> {
        let data = enrich(event.data_value()?)?;
        let mut out = Emit::json(format!("{}.enriched", event.event_type), &data)?;
        if let Some(subject) = &event.subject {
            out = out.with_subject(subject.clone());
        }
        Ok(vec![out])
    }
}

router_sdk::export_handler!(Enrich);

#[cfg(all(test, not(target_arch = "wasm32")))]
mod tests {
    use super::*;

    #[test]
    fn adds_enriched_and_len() {
        let event = Event::new("1", "/s", "order.created")
            .with_data(&serde_json::json!({"a": 1, "b": "x"}))
            .unwrap();
        let out = Enrich::handle(&event, &Delivery::default()).unwrap();
        assert_eq!(out[0].event_type(), "order.created.enriched");
        let data: serde_json::Value = out[0].data_as().unwrap();
        assert_eq!(
            data,
            serde_json::json!({"a": 1, "b": "x", "enriched": true, "len": 2})
        );
    }

    #[test]
    fn rejects_non_objects() {
        let event = Event::new("1", "/s", "t").with_data(&[1]).unwrap();
        assert!(
            !Enrich::handle(&event, &Delivery::default())
                .unwrap_err()
                .is_retry()
        );
    }
}

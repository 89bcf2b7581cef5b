//! The component side (wasm32 only): the generated bindings for the `router:handler` world and
//! the glue between them and the SDK's own types.

use std::marker::PhantomData;
use std::time::Duration;

use crate::log::Level;
use crate::{Delivery, Event, Handler, HandlerError};

/// Bindings generated from `sdk/wit/handler.wit`.
#[allow(unsafe_code, missing_docs, clippy::all)]
pub mod bindings {
    wit_bindgen::generate!({
        world: "handler",
        path: "wit",
        pub_export_macro: true,
        default_bindings_module: "router_sdk::__private::bindings",
        runtime_path: "router_sdk::__private::wit_bindgen::rt",
    });
}

use bindings::router::handler::{kv, log, types as wit};

/// Adapts a [`Handler`] to the generated `Guest` trait; named by `export_handler!`.
pub struct Export<H>(PhantomData<H>);

impl<H: Handler> bindings::Guest for Export<H> {
    fn describe() -> wit::Descriptor {
        let d = H::describe();
        wit::Descriptor {
            name: d.name,
            version: d.version,
            accepts: d
                .accepts
                .into_iter()
                .map(|a| wit::Accept {
                    type_: a.event_type,
                    versions: a.versions,
                })
                .collect(),
        }
    }

    fn handle(
        event: wit::Event,
        delivery: wit::Delivery,
    ) -> Result<Vec<wit::Emitted>, wit::HandlerError> {
        let event = Event {
            id: event.id,
            source: event.source,
            event_type: event.type_,
            subject: event.subject,
            time: event.time,
            datacontenttype: event.datacontenttype,
            dataversion: event.dataversion,
            data: event.data,
            data_base64: event.data_base64,
            extensions: event.extensions,
            hops: event.hops,
        };
        let delivery = Delivery {
            attempt: delivery.attempt,
            idempotency_key: delivery.idempotency_key,
            rule: delivery.rule,
            target: delivery.target,
        };
        match H::handle(&event, &delivery) {
            Ok(emits) => Ok(emits
                .into_iter()
                .map(|e| wit::Emitted {
                    type_: e.event_type,
                    subject: e.subject,
                    datacontenttype: e.datacontenttype,
                    data: e.data,
                    extensions: e.extensions,
                })
                .collect()),
            Err(HandlerError::Retry { delay, message }) => {
                Err(wit::HandlerError::Retry(wit::RetryInfo {
                    delay_ms: delay.map(duration_ms),
                    message,
                }))
            }
            Err(HandlerError::Fail(message)) => Err(wit::HandlerError::Fail(message)),
        }
    }
}

fn duration_ms(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

pub(crate) fn log(level: Level, message: &str) {
    let level = match level {
        Level::Trace => log::Level::Trace,
        Level::Debug => log::Level::Debug,
        Level::Info => log::Level::Info,
        Level::Warn => log::Level::Warn,
        Level::Error => log::Level::Error,
    };
    log::log(level, message);
}

pub(crate) fn kv_get(key: &str) -> Option<Vec<u8>> {
    kv::get(key)
}

pub(crate) fn kv_set(key: &str, value: &[u8], ttl_ms: Option<u64>) {
    kv::set(key, value, ttl_ms);
}

pub(crate) fn kv_delete(key: &str) {
    kv::delete(key);
}

pub(crate) fn kv_compare_and_set(key: &str, expected: Option<&[u8]>, new: Option<&[u8]>) -> bool {
    kv::compare_and_set(key, expected, new)
}

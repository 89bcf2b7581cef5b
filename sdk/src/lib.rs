//! Guest-side SDK for router handlers: write a WebAssembly component for the router in a few lines.
//!
//! A handler is a type implementing [`Handler`], exported with [`export_handler!`] and built with
//! `cargo build --release --target wasm32-wasip2` as a `cdylib`. The router delivers one
//! CloudEvent per call; the handler answers with events to emit or a [`HandlerError`]. It can log
//! through [`log`] and keep small state in [`kv`], a key-value store the router namespaces per
//! handler.
//!
//! ```
//! use router_sdk::{Delivery, Descriptor, Emit, Event, Handler, HandlerError};
//!
//! #[derive(serde::Deserialize, serde::Serialize)]
//! struct Order {
//!     order_id: String,
//!     total: f64,
//! }
//!
//! struct Invoicing;
//!
//! impl Handler for Invoicing {
//!     fn describe() -> Descriptor {
//!         Descriptor::new("invoicing", "1.0.0").accepts("order.paid", &[1, 2])
//!     }
//!
//!     fn handle(event: &Event, _delivery: &Delivery) -> Result<Vec<Emit>, HandlerError> {
//!         let order: Order = event.data_as()?;
//!         router_sdk::log::info!("invoicing order {}", order.order_id);
//!         Ok(vec![Emit::json("invoice.created", &order)?])
//!     }
//! }
//!
//! router_sdk::export_handler!(Invoicing);
//! # let event = Event::new("1", "/shop", "order.paid")
//! #     .with_data(&serde_json::json!({"order_id": "A1", "total": 3.5})).unwrap();
//! # let out = Invoicing::handle(&event, &Delivery::default()).unwrap();
//! # assert_eq!(out[0].event_type(), "invoice.created");
//! ```
//!
//! # Building
//!
//! ```toml
//! # Cargo.toml
//! [lib]
//! crate-type = ["cdylib"]
//!
//! [dependencies]
//! # A team's own repository: the router's repository as a git dependency (Cargo finds the
//! # `router-sdk` package in its workspace), pinned to the router release the handler targets,
//! # so the SDK and the WIT world it implements change only when the team moves the pin.
//! router-sdk = { git = "https://git.example.com/platform/router.git", tag = "v0.1.0" }
//! # Inside the router's repository (as `plugins/` does): a path dependency.
//! # router-sdk = { path = "../sdk" }
//! serde = { version = "1", features = ["derive"] } # for #[derive(serde::Deserialize)] above
//! ```
//!
//! Use your deployment's clone URL and a tag (or `rev = "<commit>"`) that matches the routers
//! you upload to: an upload is refused unless the component implements the router's world
//! (`sdk/wit/`).
//!
//! ```toml
//! # .cargo/config.toml: a 64 KiB guest stack makes each invocation about twice as cheap
//! [target.wasm32-wasip2]
//! rustflags = ["-C", "link-arg=-zstack-size=65536"]
//! ```
//!
//! The stack is part of the guest's linear memory, below its data: a recursion deeper than it
//! holds (64 KiB is ample for serde_json's 128 levels, not for a recursive walk of a deep tree
//! or one with large local arrays) traps before it can corrupt memory, and the router reports
//! it as `handler_trap: wasm trap: out of bounds memory access`, not as a stack overflow, with a
//! backtrace that repeats the recursive function. Such a trap is retried like any other, and
//! fails again the same way: make the recursion iterative, or raise `-zstack-size` (in
//! multiples of 64 KiB; at the cost of some of the speed above).
//!
//! Then `cargo build --release --target wasm32-wasip2` produces the component
//! (`target/wasm32-wasip2/release/<crate>.wasm`) to upload with `PUT /v1/handlers/{name}`.
//!
//! The same code compiles for the host target: [`log`] then writes to standard error and [`kv`]
//! is an in-memory map per thread, so handlers can be unit-tested with `cargo test` (see
//! [`testing`]).

// Lets the paths that the generated bindings and `export_handler!` use (`router_sdk::…`) resolve
// inside this crate too.
extern crate self as router_sdk;

mod descriptor;
mod emit;
mod error;
mod event;
pub mod kv;
pub mod log;

#[cfg(target_arch = "wasm32")]
mod guest;
#[cfg(not(target_arch = "wasm32"))]
mod native;

pub use descriptor::{Accept, Descriptor};
pub use emit::Emit;
pub use error::{DataError, HandlerError};
pub use event::{Delivery, Event};

/// Helpers for unit-testing handlers on the host target (not available inside a component).
///
/// On the host target [`kv`] is an in-memory map per thread (TTLs are ignored) and [`log`]
/// writes to standard error as well as to a buffer that [`testing::take_logs`] drains. Where
/// the router would stop an invocation for a rule it can check as cheaply, the stand-ins panic
/// with the router's reason, so the test fails as the invocation would: a key longer than
/// [`kv::MAX_KEY_BYTES`]. (An extension the router refuses is already an error of
/// [`Emit::with_extension`], here and inside a component.) The other limits (emissions, output
/// and write sizes) are not checked here.
///
/// ```
/// router_sdk::kv::set("k", b"v", None);
/// assert_eq!(router_sdk::kv::get("k").as_deref(), Some(&b"v"[..]));
/// router_sdk::testing::reset();
/// assert_eq!(router_sdk::kv::get("k"), None);
/// ```
#[cfg(not(target_arch = "wasm32"))]
pub mod testing {
    pub use crate::native::{reset, take_logs};
}

/// A router handler: what it accepts ([`Handler::describe`]) and what it does with one event
/// ([`Handler::handle`]). Export it with [`export_handler!`].
///
/// ```
/// use router_sdk::{Delivery, Descriptor, Emit, Event, Handler, HandlerError};
///
/// struct Noop;
///
/// impl Handler for Noop {
///     fn describe() -> Descriptor {
///         Descriptor::new("noop", "0.1.0")
///     }
///     fn handle(_: &Event, _: &Delivery) -> Result<Vec<Emit>, HandlerError> {
///         Ok(Vec::new())
///     }
/// }
/// # assert!(Noop::handle(&Event::new("1", "/s", "t"), &Delivery::default()).unwrap().is_empty());
/// ```
pub trait Handler {
    /// The handler's name (it must equal the name it is uploaded under), version and accepted
    /// event types. Called once at upload; keep it constant.
    ///
    /// ```
    /// # use router_sdk::Descriptor;
    /// let d = Descriptor::new("billing", "2.1.0").accepts("order.paid", &[2]);
    /// assert_eq!(d.name, "billing");
    /// ```
    fn describe() -> Descriptor;

    /// Handles one delivery of `event`. `Ok` carries the events to emit (possibly none);
    /// [`HandlerError::retry`] asks for another attempt later and [`HandlerError::fail`] sends
    /// the delivery to the dead-letter queue. With any of the three the router commits the
    /// invocation's [`kv`] writes (see [`kv`] for why that matters).
    ///
    /// A panic is reported to the router as a trap (with the panic message) and retried like a
    /// transient failure, with its key-value writes dropped; prefer returning an error. A
    /// recursion deeper than the guest's stack traps too, reported as "out of bounds memory
    /// access" rather than a stack overflow (see "Building" in the crate docs). The limits a
    /// handler can breach are listed with [`Emit`] and [`kv`].
    ///
    /// ```
    /// # use router_sdk::{Delivery, Emit, Event, HandlerError};
    /// fn handle(event: &Event, _: &Delivery) -> Result<Vec<Emit>, HandlerError> {
    ///     match event.subject.as_deref() {
    ///         Some(s) => Ok(vec![Emit::new("seen").with_subject(s)]),
    ///         None => Err(HandlerError::fail("a subject is required")),
    ///     }
    /// }
    /// # assert!(handle(&Event::new("1", "/s", "t"), &Delivery::default()).is_err());
    /// ```
    fn handle(event: &Event, delivery: &Delivery) -> Result<Vec<Emit>, HandlerError>;
}

/// Exports a [`Handler`] as the component's `describe` and `handle` functions.
///
/// Use it once, at the top level of a `cdylib` crate built for `wasm32-wasip2`. On other targets
/// it expands to nothing, so the crate still builds and its unit tests run on the host.
///
/// ```
/// use router_sdk::{Delivery, Descriptor, Emit, Event, Handler, HandlerError};
///
/// struct Echo;
///
/// impl Handler for Echo {
///     fn describe() -> Descriptor {
///         Descriptor::new("echo", "0.1.0").accepts("ping", &[])
///     }
///     fn handle(event: &Event, _: &Delivery) -> Result<Vec<Emit>, HandlerError> {
///         Ok(vec![Emit::new("pong").with_data_json(event.data.clone())])
///     }
/// }
///
/// router_sdk::export_handler!(Echo);
/// ```
#[macro_export]
macro_rules! export_handler {
    ($handler:ty) => {
        #[cfg(target_arch = "wasm32")]
        const _: () = {
            type __RouterSdkExport = $crate::__private::Export<$handler>;
            $crate::__private::bindings::export!(
                __RouterSdkExport with_types_in $crate::__private::bindings
            );
        };
    };
}

/// Implementation details used by [`export_handler!`]; not part of the public API.
#[doc(hidden)]
pub mod __private {
    #[cfg(target_arch = "wasm32")]
    pub use crate::guest::{Export, bindings};
    #[cfg(target_arch = "wasm32")]
    pub use wit_bindgen;
}

#[cfg(test)]
mod tests;

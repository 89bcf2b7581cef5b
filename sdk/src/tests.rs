//! Host-side unit tests of the SDK's serde helpers and its native stand-ins.

use serde::{Deserialize, Serialize};
use serde_json::json;

use crate::{
    DataError, Delivery, Descriptor, Emit, Event, Handler, HandlerError, kv, log, testing,
};

#[derive(Debug, PartialEq, Serialize, Deserialize)]
struct Order {
    order_id: String,
    total: f64,
    #[serde(default)]
    lines: Vec<u32>,
}

#[test]
fn data_as_parses_typed_data_and_reports_what_is_wrong() {
    let event = Event::new("1", "/s", "order.paid")
        .with_data(&json!({"order_id": "A", "total": 2.5}))
        .unwrap();
    assert_eq!(event.datacontenttype.as_deref(), Some("application/json"));
    assert_eq!(
        event.data_as::<Order>().unwrap(),
        Order {
            order_id: "A".into(),
            total: 2.5,
            lines: vec![]
        }
    );
    let wrong = Event::new("1", "/s", "t")
        .with_data(&json!({"order_id": 5}))
        .unwrap();
    let err = wrong.data_as::<Order>().unwrap_err();
    assert!(matches!(err, DataError::Json(_)));
    assert!(err.to_string().starts_with("invalid JSON data"), "{err}");
    let binary = Event {
        data_base64: Some("AAE=".into()),
        ..Event::new("1", "/s", "t")
    };
    assert!(matches!(binary.data_as::<Order>(), Err(DataError::Missing)));
    assert!(binary.data_value().unwrap().is_null());
}

#[test]
fn emit_json_round_trips_and_keeps_key_order() {
    let order = Order {
        order_id: "B".into(),
        total: 1.0,
        lines: vec![1, 2],
    };
    let emit = Emit::json("invoice.created", &order)
        .unwrap()
        .with_subject("order/B")
        .with_extension("partitionkey", "B")
        .unwrap();
    assert_eq!(
        emit.data_json(),
        Some(r#"{"order_id":"B","total":1.0,"lines":[1,2]}"#)
    );
    assert_eq!(emit.data_as::<Order>().unwrap(), order);
    assert_eq!(emit.subject(), Some("order/B"));
    assert_eq!(emit.extensions()[0].1, "\"B\"");
}

#[test]
fn serde_errors_become_permanent_failures() {
    let err: HandlerError = Event::new("1", "/s", "t")
        .data_as::<Order>()
        .unwrap_err()
        .into();
    assert_eq!(err, HandlerError::Fail("the event has no JSON data".into()));
    let json_err = serde_json::from_str::<Order>("{").unwrap_err();
    assert!(!HandlerError::from(json_err).is_retry());
}

#[test]
fn extensions_decode_from_json() {
    let mut event = Event::new("1", "/s", "t");
    event.extensions.push(("dataversion2".into(), "2".into()));
    event.extensions.push(("broken".into(), "{".into()));
    assert_eq!(event.extension("dataversion2"), Some(json!(2)));
    assert_eq!(event.extension("broken"), None);
}

#[test]
fn typed_kv_helpers_round_trip_through_the_native_store() {
    testing::reset();
    kv::set_json("order", &json!({"n": 1}), None).unwrap();
    assert_eq!(
        kv::get_json::<serde_json::Value>("order").unwrap(),
        Some(json!({"n": 1}))
    );
    assert_eq!(kv::get_json::<u32>("missing").unwrap(), None);
    kv::set("raw", b"not json", None);
    assert!(kv::get_json::<u32>("raw").is_err());
    assert!(kv::compare_and_set_json("c", None, Some(&1u8)).unwrap());
    assert!(!kv::compare_and_set_json("c", Some(&2u8), Some(&3u8)).unwrap());
    assert!(kv::compare_and_set_json::<u8>("c", Some(&1), None).unwrap());
    assert_eq!(kv::get("c"), None);
}

#[test]
fn native_kv_accepts_keys_up_to_the_routers_limit() {
    testing::reset();
    let longest = "k".repeat(kv::MAX_KEY_BYTES);
    kv::set(&longest, b"v", None);
    assert_eq!(kv::get(&longest).as_deref(), Some(&b"v"[..]));
    assert!(kv::compare_and_set(&longest, Some(b"v"), None));
    kv::delete(&longest);
}

// The router traps the invocation on a longer key in any call; natively each call panics.
#[test]
#[should_panic(expected = "longer than the limit of 1024")]
fn native_kv_set_panics_on_a_key_the_router_traps_on() {
    kv::set(&"k".repeat(kv::MAX_KEY_BYTES + 1), b"v", None);
}

#[test]
#[should_panic(expected = "longer than the limit of 1024")]
fn native_kv_get_panics_on_a_key_the_router_traps_on() {
    let _ = kv::get(&"k".repeat(kv::MAX_KEY_BYTES + 1));
}

#[test]
#[should_panic(expected = "longer than the limit of 1024")]
fn native_kv_compare_and_set_panics_on_a_key_the_router_traps_on() {
    let _ = kv::compare_and_set(&"k".repeat(kv::MAX_KEY_BYTES + 1), None, Some(b"v"));
}

#[test]
fn extensions_the_router_accepts_pass() {
    let emit = Emit::new("t")
        .with_extension("partitionkey", "p")
        .unwrap()
        .with_extension("tenant42", &7)
        .unwrap()
        .with_extension("a".repeat(64), &true)
        .unwrap()
        .with_extension("low", &i32::MIN)
        .unwrap()
        .with_extension("high", &i32::MAX)
        .unwrap()
        .with_extension("dataversion", &2)
        .unwrap()
        .with_extension("gone", &Option::<u8>::None)
        .unwrap();
    assert_eq!(emit.extensions().len(), 7);
    assert_eq!(
        Emit::new("t")
            .with_extension("dataversion", "3")
            .unwrap()
            .extensions(),
        &[("dataversion".to_owned(), "\"3\"".to_owned())]
    );
}

/// Each is a permanent failure at the router (every delivery of the event): refused here
/// instead, on every target, with the router's reason.
#[test]
fn extensions_the_router_refuses_are_errors() {
    let long = "a".repeat(65);
    for name in [
        "",
        "Tenant",
        "tenant-id",
        "tenant_id",
        &long,
        "id",
        "source",
        "type",
        "dataschema",
        "data_base64",
        "hops",
    ] {
        match Emit::new("t").with_extension(name, "x") {
            Err(DataError::Extension { name: n, .. }) => assert_eq!(n, name),
            other => panic!("extension name {name:?}: {other:?}"),
        }
    }
    let values: [(&str, serde_json::Value, &str); 9] = [
        (
            "ratio",
            serde_json::json!(1.5),
            "send other numbers as strings",
        ),
        (
            "big",
            serde_json::json!(4_294_967_296u64),
            "integer from -2147483648",
        ),
        ("big", serde_json::json!(2_147_483_648u64), "integer from"),
        (
            "small",
            serde_json::json!(-2_147_483_649i64),
            "integer from",
        ),
        ("whole", serde_json::json!(2.0), "integer from"),
        (
            "obj",
            serde_json::json!({"a": 1}),
            "string, integer or boolean",
        ),
        ("list", serde_json::json!([1]), "string, integer or boolean"),
        ("line", serde_json::json!("a\nb"), "control characters"),
        ("dataversion", serde_json::json!(0), "positive integer"),
    ];
    for (name, value, why) in values {
        let err = Emit::new("t").with_extension(name, &value).unwrap_err();
        assert!(
            matches!(&err, DataError::Extension { .. }) && err.to_string().contains(why),
            "{name} = {value}: {err}"
        );
    }
    for bad in [
        serde_json::json!("v2"),
        serde_json::json!(true),
        serde_json::json!(-1),
    ] {
        assert!(
            Emit::new("t").with_extension("dataversion", &bad).is_err(),
            "{bad}"
        );
    }
    // `?` in a handler makes it a permanent failure with the reason.
    let failed: HandlerError = Emit::new("t").with_extension("x", &1.5).unwrap_err().into();
    assert!(
        !failed.is_retry() && failed.to_string().contains("\"x\""),
        "{failed}"
    );
}

#[test]
fn an_extension_set_twice_keeps_the_last_value() {
    let emit = Emit::new("t")
        .with_extension("tenant", "a")
        .unwrap()
        .with_extension("region", "eu")
        .unwrap()
        .with_extension("tenant", "b")
        .unwrap();
    assert_eq!(
        emit.extensions(),
        &[
            ("tenant".to_owned(), "\"b\"".to_owned()),
            ("region".to_owned(), "\"eu\"".to_owned())
        ]
    );
}

struct Greeter;

impl Handler for Greeter {
    fn describe() -> Descriptor {
        Descriptor::new("greeter", "1.0.0").accepts("hello", &[])
    }

    fn handle(event: &Event, delivery: &Delivery) -> Result<Vec<Emit>, HandlerError> {
        log::info!("greeting {} (attempt {})", event.id, delivery.attempt);
        Ok(vec![Emit::json("greeted", &json!({"to": event.subject}))?])
    }
}

crate::export_handler!(Greeter);

#[test]
fn handlers_run_natively_with_captured_logs() {
    testing::reset();
    let mut event = Event::new("e", "/s", "hello");
    event.subject = Some("world".into());
    let delivery = Delivery {
        attempt: 3,
        ..Delivery::default()
    };
    let out = Greeter::handle(&event, &delivery).unwrap();
    assert_eq!(
        out[0].data_as::<serde_json::Value>().unwrap(),
        json!({"to": "world"})
    );
    assert_eq!(
        testing::take_logs(),
        vec![(log::Level::Info, "greeting e (attempt 3)".to_owned())]
    );
    assert_eq!(Greeter::describe().accepts[0].event_type, "hello");
}

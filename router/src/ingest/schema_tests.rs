//! `schemas/cloudevent.schema.json` against the ingest parser: for every event in the table the
//! schema and `parse::event_from_json` give the same verdict, so the published schema says what
//! the router accepts. Left out because a schema cannot say them: whether `data_base64` decodes
//! beyond its alphabet and length (non-canonical trailing bits), and the configured limits
//! (body size, JSON depth; batch size only at its default).

use serde_json::{Value, json};

use super::parse::event_from_json;

fn schema() -> Value {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../schemas/cloudevent.schema.json"
    );
    let text = std::fs::read_to_string(path).expect("schemas/cloudevent.schema.json is readable");
    serde_json::from_str(&text).expect("the envelope schema is JSON")
}

fn validator(schema: &Value) -> jsonschema::Validator {
    jsonschema::options()
        .with_draft(jsonschema::Draft::Draft202012)
        .should_validate_formats(true)
        .build(schema)
        .expect("the envelope schema compiles")
}

fn base() -> serde_json::Map<String, Value> {
    let Value::Object(m) = json!({"specversion": "1.0", "id": "1", "source": "/s", "type": "t"})
    else {
        unreachable!()
    };
    m
}

/// `base()` with `attrs` added (a `null` value adds a null attribute, not a removal).
fn with(attrs: Value) -> Value {
    let mut m = base();
    if let Value::Object(extra) = attrs {
        m.extend(extra);
    }
    Value::Object(m)
}

fn without(name: &str) -> Value {
    let mut m = base();
    m.remove(name);
    Value::Object(m)
}

#[test]
fn the_schema_is_a_valid_2020_12_schema() {
    let s = schema();
    let meta = jsonschema::meta::validate(&s);
    assert!(meta.is_ok(), "{meta:?}");
}

#[test]
fn schema_and_parser_agree_on_every_case() {
    let v = validator(&schema());
    let cases: Vec<(&str, Value, bool)> = vec![
        ("minimal", with(json!({})), true),
        (
            "every optional attribute",
            with(json!({
                "subject": "order-1", "time": "2024-05-01T12:00:00Z",
                "datacontenttype": "application/json", "dataschema": "https://example.com/s",
                "data": {"total": 3}, "dataversion": 2, "partitionkey": "k",
                "traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
            })),
            true,
        ),
        (
            "extensions of each scalar type",
            with(json!({"region": "eu", "n1": -2_147_483_648_i64, "flag": true})),
            true,
        ),
        (
            "fractional extension number",
            with(json!({"n1": 1.5})),
            false,
        ),
        (
            "extension number past the 32-bit Integer",
            with(json!({"n1": 2_147_483_648_u64})),
            false,
        ),
        (
            "control character in an extension",
            with(json!({"region": "e\u{7f}u"})),
            false,
        ),
        ("empty subject", with(json!({"subject": ""})), false),
        (
            "control character in source",
            with(json!({"source": "/s\n"})),
            false,
        ),
        (
            "time with a space for T",
            with(json!({"time": "2024-05-01 12:00:00Z"})),
            false,
        ),
        (
            "relative dataschema",
            with(json!({"dataschema": "schemas/a.json"})),
            false,
        ),
        (
            "dataschema with a space",
            with(json!({"dataschema": "https://example.com/a b"})),
            false,
        ),
        (
            "datacontenttype that is not a media type",
            with(json!({"datacontenttype": "json"})),
            false,
        ),
        (
            "datacontenttype with parameters",
            with(json!({"datacontenttype": "text/plain; charset=utf-8"})),
            true,
        ),
        (
            "null attributes are absent ones",
            with(json!({"subject": null, "data": null, "custom": null, "hops": null})),
            true,
        ),
        ("data_base64", with(json!({"data_base64": "AAEC"})), true),
        (
            "data_base64 unpadded",
            with(json!({"data_base64": "AAE"})),
            true,
        ),
        (
            "data null beside data_base64",
            with(json!({"data": null, "data_base64": "AAEC"})),
            true,
        ),
        (
            "data of any JSON type",
            with(json!({"data": [1, "x", null]})),
            true,
        ),
        (
            "twenty-character extension name",
            with(json!({"abcdefghij0123456789": "x"})),
            true,
        ),
        ("not an object", json!(["specversion", "1.0"]), false),
        ("missing specversion", without("specversion"), false),
        ("missing id", without("id"), false),
        ("missing source", without("source"), false),
        ("missing type", without("type"), false),
        (
            "specversion 0.3",
            with(json!({"specversion": "0.3"})),
            false,
        ),
        ("empty id", with(json!({"id": ""})), false),
        ("numeric id", with(json!({"id": 7})), false),
        (
            "time not RFC 3339",
            with(json!({"time": "yesterday"})),
            false,
        ),
        ("subject a number", with(json!({"subject": 1})), false),
        (
            "upper-case extension name",
            with(json!({"Region": "eu"})),
            false,
        ),
        (
            "extension name with a dash",
            with(json!({"my-ext": "x"})),
            false,
        ),
        (
            "21-character extension name (a SHOULD NOT)",
            with(json!({"abcdefghij0123456789x": "x"})),
            true,
        ),
        (
            "65-character extension name",
            with(json!({"a23456789b123456789c123456789d123456789e123456789f123456789g12345": "x"})),
            false,
        ),
        (
            "object extension value",
            with(json!({"ext": {"a": 1}})),
            false,
        ),
        ("array extension value", with(json!({"ext": [1]})), false),
        ("dataversion 0", with(json!({"dataversion": 0})), false),
        (
            "dataversion as a canonical string",
            with(json!({"dataversion": "2"})),
            true,
        ),
        (
            "dataversion string past the 32-bit Integer",
            with(json!({"dataversion": "2147483648"})),
            false,
        ),
        (
            "dataversion string not digits",
            with(json!({"dataversion": "v2"})),
            false,
        ),
        ("dataversion 1.5", with(json!({"dataversion": 1.5})), false),
        (
            "dataversion past the 32-bit Integer",
            with(json!({"dataversion": 2_147_483_648_u64})),
            false,
        ),
        ("hops from another router", with(json!({"hops": 1})), true),
        (
            "hops in binary's string form",
            with(json!({"hops": "4"})),
            true,
        ),
        ("negative hops", with(json!({"hops": -1})), false),
        ("fractional hops", with(json!({"hops": 1.5})), false),
        (
            "replay marker from another router",
            with(json!({"replay": "job-1"})),
            true,
        ),
        (
            "data and data_base64",
            with(json!({"data": {"a": 1}, "data_base64": "AAEC"})),
            false,
        ),
        (
            "data_base64 outside the alphabet",
            with(json!({"data_base64": "!!!!"})),
            false,
        ),
        (
            "data_base64 of impossible length",
            with(json!({"data_base64": "AAECA"})),
            false,
        ),
        (
            "data_base64 a number",
            with(json!({"data_base64": 5})),
            false,
        ),
    ];
    let mut disagreements = Vec::new();
    for (name, event, valid) in cases {
        let parser = event_from_json(event.clone(), "").is_ok();
        let schema = v.is_valid(&event);
        if parser != valid || schema != valid {
            disagreements.push(format!(
                "{name}: expected valid={valid}, parser says {parser}, schema says {schema}"
            ));
        }
    }
    assert!(disagreements.is_empty(), "{disagreements:#?}");
}

#[test]
fn a_batch_is_an_array_of_events_up_to_the_default_limit() {
    let s = schema();
    let batch =
        json!({"$ref": "https://event-router.dev/schemas/cloudevent.schema.json#/$defs/batch"});
    let registry = jsonschema::Registry::new()
        .add(
            "https://event-router.dev/schemas/cloudevent.schema.json",
            &s,
        )
        .expect("the schema's URI parses")
        .prepare()
        .expect("the registry builds");
    let v = jsonschema::options()
        .with_draft(jsonschema::Draft::Draft202012)
        .with_registry(&registry)
        .build(&batch)
        .expect("the batch schema compiles");
    let ok = with(json!({}));
    assert!(v.is_valid(&json!([ok.clone(), ok.clone()])));
    assert!(!v.is_valid(&json!([ok.clone(), without("id")])));
    assert!(!v.is_valid(&Value::Array(vec![ok; 1001])));
}

//! Tests for the contract stage.

use super::*;
use serde_json::{Map, json};

const ORDER_V1: &str = r#"{
  "$schema": "https://json-schema.org/draft/2020-12/schema",
  "type": "object",
  "required": ["id", "total"],
  "properties": {
    "id": {"type": "string"},
    "total": {"type": "number", "minimum": 0},
    "lines": {"type": "array", "items": {"type": "object", "required": ["sku"], "properties": {"sku": {"type": "string"}}}}
  }
}"#;

const ORDER_V2: &str = r#"{
  "type": "object",
  "required": ["id", "total"],
  "properties": {
    "id": {"type": "string"},
    "total": {"type": "number", "minimum": 0},
    "lines": {"type": "array"},
    "note": {"type": "string"}
  }
}"#;

const DRAFT7: &str = r#"{
  "$schema": "http://json-schema.org/draft-07/schema#",
  "type": "object",
  "required": ["user"],
  "properties": {
    "user": {"type": "string"},
    "tags": {"type": "array", "items": [{"type": "string"}, {"type": "integer"}]}
  }
}"#;

fn ev(ty: &str, data: Option<Value>) -> CloudEvent {
    CloudEvent {
        id: "1".into(),
        source: "/s".into(),
        ty: ty.into(),
        subject: None,
        time: None,
        datacontenttype: None,
        dataschema: None,
        data: data.map(crate::event::Data::from),
        data_base64: None,
        extensions: Map::new(),
    }
}

fn versioned(ty: &str, v: u32, data: Value) -> CloudEvent {
    let mut e = ev(ty, Some(data));
    e.extensions.insert("dataversion".into(), json!(v));
    e
}

fn set(modes: Option<&str>) -> ContractSet {
    ContractSet::from_files(
        &[
            ("order.created/v1.json", ORDER_V1),
            ("order.created/v2.json", ORDER_V2),
            ("user.signup/v1.json", DRAFT7),
            ("README.md", "# contracts"),
        ],
        modes,
    )
    .unwrap()
}

fn errors(outcome: ContractOutcome) -> (ContractMode, ViolationReason, Vec<(String, String)>) {
    match outcome {
        ContractOutcome::Violation {
            mode,
            reason,
            errors,
        } => (
            mode,
            reason,
            errors.into_iter().map(|e| (e.pointer, e.message)).collect(),
        ),
        ContractOutcome::Pass => panic!("expected a violation"),
    }
}

fn pointers(outcome: ContractOutcome) -> Vec<String> {
    let mut p: Vec<String> = errors(outcome).2.into_iter().map(|(p, _)| p).collect();
    p.sort();
    p
}

fn err_at(files: &[(&str, &str)], modes: Option<&str>) -> Vec<ContractDiagnostic> {
    ContractSet::from_files(files, modes).unwrap_err()
}

#[test]
fn is_send_sync() {
    fn assert_send_sync<T: Send + Sync>() {}
    assert_send_sync::<ContractSet>();
}

#[test]
fn valid_data_passes_2020_12() {
    let s = set(None);
    let e = ev(
        "order.created",
        Some(json!({"id": "o1", "total": 5, "lines": [{"sku": "a"}]})),
    );
    assert_eq!(s.check(&e), ContractOutcome::Pass);
}

#[test]
fn all_errors_reported_with_exact_pointers() {
    let s = set(None);
    let e = ev(
        "order.created",
        Some(json!({"id": 7, "total": -1, "lines": [{"sku": "a"}, {"sku": 3}, {}]})),
    );
    let (mode, reason, errs) = errors(s.check(&e));
    assert_eq!(mode, ContractMode::Quarantine);
    assert_eq!(reason, ViolationReason::ContractViolation);
    let mut p: Vec<&str> = errs.iter().map(|(p, _)| p.as_str()).collect();
    p.sort_unstable();
    assert_eq!(
        p,
        [
            "/data/id",
            "/data/lines/1/sku",
            "/data/lines/2",
            "/data/total"
        ]
    );
    assert!(
        errs.iter()
            .any(|(p, m)| p == "/data/lines/2" && m.contains("\"sku\" is a required property")),
        "{errs:?}"
    );
}

#[test]
fn missing_required_at_root() {
    let s = set(None);
    let (_, _, errs) = errors(s.check(&ev("order.created", Some(json!({})))));
    assert_eq!(errs.len(), 2);
    assert!(errs.iter().all(|(p, _)| p == "/data"));
}

#[test]
fn draft7_schema_detected() {
    let s = set(None);
    assert_eq!(
        s.check(&ev(
            "user.signup",
            Some(json!({"user": "u", "tags": ["a", 1]}))
        )),
        ContractOutcome::Pass
    );
    // Tuple-form `items` is draft 7 only: the second element must be an integer.
    let p = pointers(s.check(&ev(
        "user.signup",
        Some(json!({"user": 1, "tags": ["a", "b"]})),
    )));
    assert_eq!(p, ["/data/tags/1", "/data/user"]);
}

#[test]
fn formats_are_asserted() {
    let s = ContractSet::from_files(
        &[(
            "t/v1.json",
            r#"{"properties": {"at": {"type": "string", "format": "date-time"}}}"#,
        )],
        None,
    )
    .unwrap();
    assert_eq!(
        pointers(s.check(&ev("t", Some(json!({"at": "noon"}))))),
        ["/data/at"]
    );
    assert_eq!(
        s.check(&ev("t", Some(json!({"at": "2024-01-01T00:00:00Z"})))),
        ContractOutcome::Pass
    );
}

#[test]
fn dataversion_selects_schema() {
    let s = set(None);
    // v2 makes `lines` a plain array and adds `note`.
    let data = json!({"id": "o", "total": 1, "lines": [{}], "note": "n"});
    assert!(matches!(
        s.check(&ev("order.created", Some(data.clone()))),
        ContractOutcome::Violation { .. }
    ));
    assert_eq!(
        s.check(&versioned("order.created", 2, data)),
        ContractOutcome::Pass
    );
}

#[test]
fn unknown_version() {
    let s = set(None);
    let (mode, reason, errs) = errors(s.check(&versioned("order.created", 3, json!({}))));
    assert_eq!(mode, ContractMode::Quarantine);
    assert_eq!(reason, ViolationReason::UnknownVersion);
    assert_eq!(reason.as_str(), "unknown_version");
    assert_eq!(errs.len(), 1);
    assert_eq!(errs[0].0, "/dataversion");
    assert!(errs[0].1.contains("known versions: 1, 2"), "{}", errs[0].1);
}

#[test]
fn type_without_contract_passes() {
    let s = set(None);
    assert_eq!(s.check(&ev("other", Some(json!(1)))), ContractOutcome::Pass);
    assert_eq!(
        ContractSet::empty().check(&ev("order.created", None)),
        ContractOutcome::Pass
    );
}

#[test]
fn non_json_data_is_a_violation() {
    let s = set(None);
    let mut e = ev("order.created", None);
    e.datacontenttype = Some("application/xml".into());
    e.data_base64 = Some("PGEvPg==".into());
    let (_, reason, errs) = errors(s.check(&e));
    assert_eq!(reason, ViolationReason::ContractViolation);
    assert_eq!(reason.as_str(), "contract_violation");
    assert_eq!(
        errs,
        [(
            "/data".to_owned(),
            "contract requires JSON data, got application/xml".to_owned()
        )]
    );
    // Non-JSON data for a type without contract is not checked.
    e.ty = "other".into();
    assert_eq!(s.check(&e), ContractOutcome::Pass);
}

#[test]
fn json_data_base64_is_decoded_and_validated() {
    let s = set(None);
    let mut e = ev("order.created", None);
    e.datacontenttype = Some("application/json".into());
    e.data_base64 = Some("eyJpZCI6ICJvIiwgInRvdGFsIjogMX0=".into()); // {"id": "o", "total": 1}
    assert_eq!(s.check(&e), ContractOutcome::Pass);
    e.data_base64 = Some("bm90IGpzb24=".into()); // not json
    assert_eq!(pointers(s.check(&e)), ["/data_base64"]);
}

/// Data decoded from `data_base64` that fails its contract is pointed at as such: the event
/// has no `data` member for `/data/...` to name (it used to point there).
#[test]
fn errors_in_decoded_data_base64_point_at_it() {
    let s = set(None);
    let mut e = ev("order.created", None);
    e.datacontenttype = Some("application/json".into());
    e.data_base64 = Some("eyJpZCI6IDEsICJ0b3RhbCI6IDF9".into()); // {"id": 1, "total": 1}
    let (_, reason, errs) = errors(s.check(&e));
    assert_eq!(reason, ViolationReason::ContractViolation);
    assert_eq!(
        errs,
        [(
            "/data_base64/id".to_owned(),
            "decoded data_base64: 1 is not of type \"string\"".to_owned()
        )]
    );
}

/// An event without data is told so, not `null is not of type "object"`, which reads as if
/// the producer had sent `null`.
#[test]
fn missing_data_validates_as_null() {
    let s = set(None);
    let (_, _, errs) = errors(s.check(&ev("order.created", None)));
    assert_eq!(errs.len(), 1);
    assert_eq!(errs[0].0, "/data");
    assert!(
        errs[0]
            .1
            .starts_with("no data: the event has neither `data`"),
        "{errs:?}"
    );
    assert!(!errs[0].1.contains("null is not"), "{errs:?}");
    assert!(
        errs[0].1.contains("'order.created' dataversion 1"),
        "{errs:?}"
    );
    let open =
        ContractSet::from_files(&[("t/v1.json", r#"{"type": ["object", "null"]}"#)], None).unwrap();
    assert_eq!(open.check(&ev("t", None)), ContractOutcome::Pass);
}

#[test]
fn modes() {
    let toml = "\"order.created\" = \"enforce\"\n\"user.signup\" = \"off\"\n";
    let s = set(Some(toml));
    assert_eq!(s.mode("order.created"), ContractMode::Enforce);
    assert_eq!(s.mode("user.signup"), ContractMode::Off);
    assert_eq!(s.mode("anything"), ContractMode::Quarantine);
    let (mode, _, _) = errors(s.check(&ev("order.created", Some(json!({})))));
    assert_eq!(mode, ContractMode::Enforce);
    assert_eq!(
        s.check(&ev("user.signup", Some(json!(42)))),
        ContractOutcome::Pass
    );
    let q = set(Some("\"order.created\" = \"quarantine\""));
    let (mode, _, _) = errors(q.check(&ev("order.created", Some(json!({})))));
    assert_eq!(mode, ContractMode::Quarantine);
}

#[test]
fn contract_mode_serde_and_default() {
    assert_eq!(ContractMode::default(), ContractMode::Quarantine);
    assert_eq!(
        serde_json::to_value(ContractMode::Enforce).unwrap(),
        json!("enforce")
    );
    let m: ContractMode = serde_json::from_value(json!("off")).unwrap();
    assert_eq!(m, ContractMode::Off);
}

#[test]
fn invalid_modes_toml_reports_line() {
    let d = err_at(
        &[("t/v1.json", "{}")],
        Some("\"a\" = \"enforce\"\n\"b\" = \"strict\"\n\"c\" = 3\n"),
    );
    assert_eq!(d.len(), 2, "{d:?}");
    assert_eq!(
        (d[0].file.as_str(), d[0].line, d[0].col),
        ("modes.toml", 2, 7)
    );
    assert!(d[0].message.contains("unknown mode 'strict'"));
    assert_eq!((d[1].line, d[1].col), (3, 7));
    let d = err_at(&[], Some("a = \n"));
    assert_eq!(d[0].line, 1);
    assert!(d[0].message.starts_with("invalid TOML"), "{}", d[0]);
    let d = err_at(&[], Some("order.created = \"enforce\"\n"));
    assert!(d[0].message.contains("quote type names"), "{}", d[0]);
}

#[test]
fn bad_file_names() {
    let d = err_at(
        &[
            ("t/v0.json", "{}"),
            ("t/v01.json", "{}"),
            ("t/version1.json", "{}"),
            ("t/v1.json.bak", "ignored"),
            ("loose.json", "{}"),
            ("a/b/v1.json", "{}"),
            ("t/v2.json", "{}"),
        ],
        None,
    );
    let files: Vec<&str> = d.iter().map(|d| d.file.as_str()).collect();
    assert_eq!(
        files,
        [
            "a/b/v1.json",
            "loose.json",
            "t/v0.json",
            "t/v01.json",
            "t/version1.json"
        ]
    );
    assert!(d.iter().all(|d| (d.line, d.col) == (1, 1)));
}

/// Versions stop at the highest `dataversion` ingest accepts: a contract above it could never
/// apply (its type's events were quarantined as `unknown_version` naming it).
#[test]
fn versions_above_the_highest_dataversion_are_refused() {
    let d = err_at(&[("t/v2147483648.json", "{}")], None);
    assert_eq!(d.len(), 1, "{d:?}");
    assert!(d[0].message.contains("N from 1 to 2147483647"), "{}", d[0]);
    assert!(ContractSet::from_files(&[("t/v2147483647.json", "{}")], None).is_ok());
}

/// An in-place change to the highest version cannot name a next one: it says so, where the
/// `+ 1` overflowed (a panic in a debug build, "publish it as v0" in a release one).
#[test]
fn an_in_place_change_to_the_highest_version_says_no_version_is_left() {
    let base = ContractSet::from_files(&[("t/v2147483647.json", r#"{"type": "object"}"#)], None)
        .expect("loads");
    let new = ContractSet::from_files(&[("t/v2147483647.json", r#"{"type": "array"}"#)], None)
        .expect("loads");
    let d = new.changes_from(&base);
    assert_eq!(d.len(), 1, "{d:?}");
    assert!(
        d[0].message
            .ends_with("no version is left above v2147483647 (the highest dataversion an event can carry): publish it under a new event type"),
        "{}",
        d[0]
    );
    assert_eq!(publish_as(1), "publish it as v2");
}

/// The checker's messages are neutral: a new version's notes do not say it "needs a new
/// version" (it is one), and the in-place diagnostics add what to publish instead.
#[test]
fn notes_for_a_new_version_do_not_ask_for_a_new_version() {
    let v1 = r#"{"type": "object", "additionalProperties": false}"#;
    let v2 = r#"{"type": "object", "additionalProperties": true}"#;
    let s = ContractSet::from_files(&[("t/v1.json", v1), ("t/v2.json", v2)], None).unwrap();
    let report = report_lines(&s);
    assert_eq!(
        report,
        [
            "t/v2.json:1:20: incompatible with v1: property `(root)`: `additionalProperties` changed; the checker cannot prove that compatible"
        ]
    );
    let base = ContractSet::from_files(&[("t/v1.json", v1)], None).unwrap();
    let edited = ContractSet::from_files(&[("t/v1.json", v2)], None).unwrap();
    let d = edited.changes_from(&base);
    assert_eq!(d.len(), 1, "{d:?}");
    assert!(
        d[0].message
            .ends_with("the checker cannot prove that compatible; publish it as v2"),
        "{}",
        d[0]
    );
    assert!(!d[0].message.contains("needs a new version"), "{}", d[0]);
}

#[test]
fn invalid_json_uses_serde_position() {
    let d = err_at(
        &[("t/v1.json", "{\n  \"type\": \"object\",\n  oops\n}")],
        None,
    );
    assert_eq!(d.len(), 1);
    assert_eq!((d[0].line, d[0].col), (3, 3));
    assert!(
        d[0].to_string().starts_with("t/v1.json:3:3: invalid JSON"),
        "{}",
        d[0]
    );
}

#[test]
fn schema_that_does_not_compile_names_the_pointer() {
    let text = "{\n  \"properties\": {\n    \"a\": {\"type\": 12}\n  }\n}";
    let d = err_at(&[("t/v1.json", text)], None);
    assert_eq!(d.len(), 1, "{d:?}");
    assert!(d[0].message.contains("/properties/a/type"), "{}", d[0]);
    assert_eq!((d[0].line, d[0].col), (3, 11));
    assert_eq!(d[0].pointer, "/properties/a/type");
}

/// A misspelt format is refused where it stands, saying that formats are asserted and which
/// ones exist; the library's own message advised a setting ("adjust configuration to ignore
/// unrecognized formats") the router does not have.
#[test]
fn a_misspelt_format_is_refused_not_silently_unchecked() {
    let text = "{\"properties\": {\n  \"mail\": {\"type\": \"string\", \"format\": \"emial\"}}}";
    let d = err_at(&[("t/v1.json", text)], None);
    assert_eq!(d.len(), 1, "{d:?}");
    let m = &d[0].message;
    assert!(
        m.starts_with("unknown format \"emial\": contracts assert `format`"),
        "{m}"
    );
    assert!(m.contains("date-time, ") && m.contains("email, "), "{m}");
    assert!(!m.to_lowercase().contains("configuration"), "{m}");
    assert_eq!(d[0].pointer, "/properties/mail/format");
    assert_eq!((d[0].line, d[0].col), (2, 30));
    // As docs/operations.md lists them.
    assert_eq!(
        known_formats(Draft::Draft202012),
        [
            "date",
            "date-time",
            "duration",
            "email",
            "hostname",
            "ipv4",
            "ipv6",
            "iri",
            "iri-reference",
            "json-pointer",
            "regex",
            "relative-json-pointer",
            "time",
            "uri",
            "uri-reference",
            "uri-template",
            "uuid"
        ]
    );
    // The list is the draft's: draft-07 has no `uuid` or `duration` format.
    let d7 = r#"{"$schema": "http://json-schema.org/draft-07/schema#", "format": "uuid"}"#;
    let d = err_at(&[("t/v1.json", d7)], None);
    assert_eq!(d.len(), 1, "{d:?}");
    assert!(d[0].message.contains("unknown format \"uuid\""), "{}", d[0]);
    assert!(!d[0].message.contains("duration"), "{}", d[0]);
}

#[test]
fn bad_pattern_and_unresolvable_ref_do_not_compile() {
    let d = err_at(
        &[
            ("a/v1.json", r#"{"pattern": "("}"#),
            ("b/v1.json", r##"{"$ref": "#/$defs/missing"}"##),
            ("c/v1.json", r#"{"$ref": "other.json"}"#),
        ],
        None,
    );
    let files: Vec<&str> = d.iter().map(|d| d.file.as_str()).collect();
    assert_eq!(files, ["a/v1.json", "b/v1.json", "c/v1.json"], "{d:?}");
}

/// jsonschema compiles only what validation reaches; a definition nothing refers to yet must
/// still be a valid schema, or the version that starts using it is the one that fails to load.
#[test]
fn unused_definitions_are_compiled_too() {
    let text = "{\n  \"$defs\": {\n    \"used\": {\"type\": \"string\"},\n    \"unused\": {\"pattern\": \"(\"}\n  },\n  \"properties\": {\"a\": {\"$ref\": \"#/$defs/used\"}}\n}";
    let d = err_at(&[("t/v1.json", text)], None);
    assert_eq!(d.len(), 1, "{d:?}");
    assert!(d[0].message.contains("/$defs/unused/pattern"), "{}", d[0]);
    assert_eq!(d[0].line, 4, "{}", d[0]);
    let draft7 = r#"{"$schema": "http://json-schema.org/draft-07/schema#", "definitions": {"x y/~": {"type": 12}}}"#;
    let d = err_at(&[("t/v1.json", draft7)], None);
    assert_eq!(d.len(), 1, "{d:?}");
    assert!(
        d[0].message.contains("/definitions/x y~1~0/type"),
        "{}",
        d[0]
    );
    // Valid definitions, referenced or not, with odd names, change nothing.
    let fine = r##"{"$defs": {"a b%": {"type": "string"}, "c": {"$ref": "#/$defs/c"}}, "allOf": [{"type": "object"}], "properties": {"n": {"type": "integer"}}}"##;
    let s = ContractSet::from_files(&[("t/v1.json", fine)], None).expect("valid");
    assert!(matches!(
        s.check(&versioned("t", 1, json!({"n": 1}))),
        ContractOutcome::Pass
    ));
    assert_eq!(pointers(s.check(&versioned("t", 1, json!(5)))), ["/data"]);
}

#[test]
fn unsupported_schema_dialect() {
    let d = err_at(
        &[(
            "t/v1.json",
            "{\n  \"$schema\": \"http://json-schema.org/draft-04/schema#\"\n}",
        )],
        None,
    );
    assert_eq!((d[0].line, d[0].col), (2, 3));
    assert!(d[0].message.contains("unsupported $schema"));
    let d = err_at(&[("t/v1.json", "[1]")], None);
    assert!(d[0].message.contains("must be a JSON Schema"));
}

#[test]
fn all_problems_reported_not_just_first() {
    let d = err_at(
        &[
            ("a/v1.json", "{"),
            ("b/vX.json", "{}"),
            ("c/v1.json", r#"{"minimum": "x"}"#),
        ],
        Some("\"a\" = \"nope\""),
    );
    assert_eq!(d.len(), 4, "{d:?}");
}

#[test]
fn duplicate_files() {
    let d = err_at(&[("t/v1.json", "{}"), ("t/v1.json", "{}")], None);
    assert_eq!(d.len(), 1);
    assert!(d[0].message.contains("duplicate"));
}

#[test]
fn contracts_listing_and_version_hash() {
    let s = set(None);
    let list = s.contracts();
    let ids: Vec<(&str, u32, &str)> = list
        .iter()
        .map(|c| (c.ty.as_str(), c.version, c.file.as_str()))
        .collect();
    assert_eq!(
        ids,
        [
            ("order.created", 1, "order.created/v1.json"),
            ("order.created", 2, "order.created/v2.json"),
            ("user.signup", 1, "user.signup/v1.json"),
        ]
    );
    assert_eq!(list[2].schema["required"], json!(["user"]));
    let v = s.version();
    assert_eq!(v.len(), 12);
    assert!(v.bytes().all(|b| b.is_ascii_hexdigit()));
    // Same content, different order: same version. Different content or modes: different.
    let reordered = ContractSet::from_files(
        &[
            ("user.signup/v1.json", DRAFT7),
            ("order.created/v2.json", ORDER_V2),
            ("order.created/v1.json", ORDER_V1),
        ],
        None,
    )
    .unwrap();
    assert_eq!(reordered.version(), v);
    assert_ne!(set(Some("\"x\" = \"off\"")).version(), v);
    assert_ne!(ContractSet::empty().version(), v);
}

/// The compatibility report of `s`, a line per problem as `router contracts check` prints it.
fn report_lines(s: &ContractSet) -> Vec<String> {
    s.compatibility_report()
        .iter()
        .map(ToString::to_string)
        .collect()
}

#[test]
fn compatibility_report_flags_consecutive_pairs() {
    let s = set(None);
    let report = s.compatibility_report();
    // v1 -> v2 changed `lines` items (removed `items` constraint: allowed) - nothing else.
    assert!(report.is_empty(), "{report:?}");

    let v2 = "{\n  \"type\": \"object\",\n  \"properties\": {\n    \"id\": {\"type\": \"integer\"}\n  }\n}";
    let v3 = "{\n  \"type\": \"object\",\n  \"required\": [\"id\"],\n  \"properties\": {\n    \"id\": {\"type\": \"integer\"}\n  }\n}";
    let s = ContractSet::from_files(
        &[
            (
                "t/v1.json",
                r#"{"type": "object", "properties": {"id": {"type": "string"}, "x": {}}}"#,
            ),
            ("t/v2.json", v2),
            ("t/v3.json", v3),
        ],
        None,
    )
    .unwrap();
    let report = report_lines(&s);
    assert_eq!(
        report,
        [
            "t/v2.json:4:12: incompatible with v1: property `id`: type changed from \"string\" to \"integer\"",
            "t/v2.json:3:3: incompatible with v1: property `x` was removed",
            "t/v3.json:3:3: incompatible with v2: property `id` became required",
        ]
    );
}

/// A reference by anchor is compared where it is used, and a change of draft at the root; both
/// located in the new file.
#[test]
fn compatibility_report_follows_anchors_and_dialects() {
    let v1 = r##"{"$schema": "http://json-schema.org/draft-07/schema#", "type": "object",
        "properties": {"a": {"$ref": "#addr"}},
        "definitions": {"x": {"$id": "#addr", "type": "string"}}}"##;
    let v2 = "{\n  \"type\": \"object\",\n  \"properties\": {\n    \"a\": {\"$ref\": \"#addr\"}\n  },\n  \"$defs\": {\"x\": {\"$anchor\": \"addr\", \"type\": \"integer\"}}\n}";
    let s = ContractSet::from_files(&[("t/v1.json", v1), ("t/v2.json", v2)], None).unwrap();
    let report = report_lines(&s);
    assert_eq!(
        report,
        [
            "t/v2.json:1:1: incompatible with v1: property `(root)`: `$schema` changed from draft-07 to 2020-12: the drafts validate differently",
            "t/v2.json:4:5: incompatible with v1: property `a`: type changed from \"string\" to \"integer\"",
        ]
    );
}

#[test]
fn load_dir_reads_tree_and_reports_paths() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    fs::create_dir_all(root.join("order.created")).unwrap();
    fs::create_dir_all(root.join(".git")).unwrap();
    fs::write(root.join("order.created/v1.json"), ORDER_V1).unwrap();
    fs::write(root.join("order.created/v2.json"), ORDER_V2).unwrap();
    fs::write(root.join("order.created/notes.txt"), "ignored").unwrap();
    fs::write(root.join("README.md"), "ignored").unwrap();
    fs::write(root.join(".git/v1.json"), "not json").unwrap();
    fs::write(root.join("modes.toml"), "\"order.created\" = \"enforce\"\n").unwrap();
    let s = ContractSet::load_dir(root).unwrap();
    assert_eq!(s.contracts().len(), 2);
    assert_eq!(s.mode("order.created"), ContractMode::Enforce);
    let from_mem = ContractSet::from_files(
        &[
            ("order.created/v1.json", ORDER_V1),
            ("order.created/v2.json", ORDER_V2),
        ],
        Some("\"order.created\" = \"enforce\"\n"),
    )
    .unwrap();
    assert_eq!(s.version(), from_mem.version());

    fs::write(root.join("order.created/v3.json"), "{\n  \"type\": 5\n}").unwrap();
    fs::write(
        root.join("modes.toml"),
        "\"order.created\" = \"enforced\"\n",
    )
    .unwrap();
    let d = ContractSet::load_dir(root).unwrap_err();
    assert_eq!(d.len(), 2, "{d:?}");
    let rendered: Vec<String> = d.iter().map(ToString::to_string).collect();
    assert!(
        rendered[0].starts_with(&format!(
            "{}:1:19: unknown mode",
            root.join("modes.toml").display()
        )),
        "{rendered:?}"
    );
    assert!(
        rendered[1].starts_with(&format!(
            "{}:2:3: schema does not compile",
            root.join("order.created/v3.json").display()
        )),
        "{rendered:?}"
    );
}

#[test]
fn load_dir_missing_directory() {
    let dir = tempfile::tempdir().unwrap();
    let d = ContractSet::load_dir(&dir.path().join("nope")).unwrap_err();
    assert_eq!(d.len(), 1);
    assert!(d[0].message.contains("cannot read directory"));
}

/// The directory as it would be with an upload in it, loaded without writing the upload: a
/// file of the same path is replaced, the rest of the directory (and its problems) counts.
#[test]
fn load_dir_with_loads_the_directory_as_it_would_be() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    fs::create_dir_all(root.join("order.created")).unwrap();
    fs::write(root.join("order.created/v1.json"), ORDER_V1).unwrap();
    let s = ContractSet::load_dir_with(root, &[("order.created/v2.json", ORDER_V2)]).unwrap();
    assert_eq!(s.contracts().len(), 2);
    assert!(
        !root.join("order.created/v2.json").exists(),
        "nothing written"
    );
    let replaced =
        ContractSet::load_dir_with(root, &[("order.created/v1.json", ORDER_V2)]).unwrap();
    assert_eq!(replaced.contracts().len(), 1);
    assert_eq!(
        replaced.get("order.created", 1).unwrap().schema,
        serde_json::from_str::<Value>(ORDER_V2).unwrap()
    );
    // Another file that does not load refuses the whole set, as a reload would.
    fs::write(root.join("order.created/v3.json"), "{\"type\": 5}").unwrap();
    let d = ContractSet::load_dir_with(root, &[("order.created/v2.json", ORDER_V2)]).unwrap_err();
    assert_eq!(d.len(), 1, "{d:?}");
    // A directory not made yet holds only the files given.
    let fresh = ContractSet::load_dir_with(&root.join("nope"), &[("t/v1.json", "{}")]).unwrap();
    assert_eq!(fresh.contracts().len(), 1);
}

#[test]
fn a_type_whose_contracts_all_went_and_an_idle_mode_are_warned_of() {
    let before = ContractSet::from_files(
        &[("a/v1.json", "{}"), ("b/v1.json", "{}")],
        Some("\"a\" = \"enforce\""),
    )
    .unwrap();
    let after =
        ContractSet::from_files(&[("b/v1.json", "{}")], Some("\"a\" = \"enforce\"")).unwrap();
    let w = after.warnings_against(&before);
    assert_eq!(w.len(), 2, "{w:?}");
    assert!(
        w[0].contains("type a was removed") && w[0].contains("no longer checked"),
        "{w:?}"
    );
    assert!(w[1].contains("modes.toml sets a mode for type a"), "{w:?}");
    assert!(before.warnings_against(&before).is_empty());
}

/// A contract file that starts with a byte-order mark loads, as a rule file does (it failed
/// with "expected value at line 1 column 1").
#[test]
fn a_contract_file_with_a_byte_order_mark_loads() {
    let dir = tempfile::tempdir().expect("tempdir");
    let set = ContractSet::load_dir_with(
        dir.path(),
        &[("order.created/v1.json", "\u{feff}{\"type\": \"object\"}")],
    )
    .expect("loads");
    assert!(set.get("order.created", 1).is_some());
    assert_eq!(strip_bom("\u{feff}{}"), "{}");
    assert_eq!(strip_bom("{}"), "{}");
    // Positions are those of the text: the mark does not shift the columns or hide them.
    let d = err_at(&[("t/v1.json", "\u{feff}{\"type\": 12}")], None);
    assert_eq!(d.len(), 1, "{d:?}");
    assert_eq!((d[0].line, d[0].col), (1, 2), "{}", d[0]);
}

fn one(ty: &str, schema: &str) -> ContractSet {
    ContractSet::from_files(&[(&format!("{ty}/v1.json"), schema)], None).unwrap()
}

#[test]
fn errors_are_capped_per_event_with_a_summary() {
    let s = one(
        "big.arr",
        r#"{"type":"object","properties":{"xs":{"type":"array","maxItems":5,"items":{"type":"integer"}}}}"#,
    );
    let xs: Vec<Value> = (0..300).map(|_| json!("s".repeat(80))).collect();
    let (_, _, errs) = errors(s.check(&ev("big.arr", Some(json!({ "xs": xs })))));
    assert_eq!(errs.len(), MAX_ERRORS_PER_EVENT + 1, "{errs:?}");
    let (p, last) = errs.last().unwrap();
    assert_eq!(p, "/data");
    // 300 item errors and the maxItems one, 20 of them kept.
    assert!(
        last.contains("and 281 more errors") && last.contains("first 20"),
        "{last}"
    );
    for (_, m) in &errs {
        assert!(m.chars().count() <= MAX_ERROR_MESSAGE_CHARS, "{m}");
    }
    // The maxItems message quotes an excerpt of the array, not the 25 KB array.
    let max_items = errs
        .iter()
        .find(|(p, m)| p == "/data/xs" && m.contains("more than 5 items"))
        .expect("the maxItems error is among the first");
    assert!(
        max_items.1.starts_with("[\"sss") && max_items.1.len() < 120,
        "{max_items:?}"
    );
}

#[test]
fn small_values_are_still_quoted_whole() {
    let s = set(None);
    let (_, _, errs) = errors(s.check(&ev(
        "order.created",
        Some(json!({"id": "o1", "total": "ten"})),
    )));
    assert_eq!(
        errs,
        [(
            "/data/total".to_owned(),
            "\"ten\" is not of type \"number\"".to_owned()
        )]
    );
}

#[test]
fn long_messages_are_cut_at_a_char_boundary() {
    let cut = truncate_chars("é".repeat(400), 300);
    assert_eq!(cut.chars().count(), 300);
    assert!(cut.ends_with('…'));
    assert_eq!(truncate_chars("abc".into(), 3), "abc");
    let (excerpt, whole) = json_excerpt(&json!("ééééééé"), 6);
    assert!(!whole);
    assert_eq!(excerpt, "\"éé"); // 5 bytes: the third é would straddle the limit.
    assert_eq!(json_excerpt(&json!([1, 2]), 60), ("[1,2]".to_owned(), true));
}

#[test]
fn exponential_schema_fan_out_is_cut_off_by_the_step_budget() {
    // D0 = allOf [D1, D1], … D12 likewise: 2^13 (8,192) errors for each wrong item, under the
    // load-time fan-out bound (10,000 ways), but ten wrong items are 80,000 errors and over
    // 160,000 schema steps: the listing stops at its budget.
    let mut defs = Map::new();
    for i in 0..13 {
        let next = format!("#/$defs/D{}", i + 1);
        defs.insert(
            format!("D{i}"),
            json!({"allOf": [{"$ref": next}, {"$ref": next}]}),
        );
    }
    defs.insert("D13".into(), json!({"type": "object"}));
    let schema = json!({"items": {"$ref": "#/$defs/D0"}, "$defs": defs}).to_string();
    let s = one("expo.t", &schema);
    let started = std::time::Instant::now();
    let (_, reason, errs) = errors(s.check(&ev("expo.t", Some(json!(vec![5; 10])))));
    // Generous for a debug build on a shared machine.
    assert!(started.elapsed() < std::time::Duration::from_secs(5));
    assert_eq!(reason, ViolationReason::ContractViolation);
    assert_eq!(errs.len(), 2, "{errs:?}");
    assert_eq!(errs[0].0, "/data/0");
    assert!(errs[0].1.contains("not of type \"object\""), "{errs:?}");
    assert!(errs[1].1.contains("schema steps"), "{errs:?}");
    // The budget is per check: the next event gets its own, and valid data still passes.
    assert_eq!(
        s.check(&ev("expo.t", Some(json!([{}])))),
        ContractOutcome::Pass
    );
    assert_eq!(
        errors(s.check(&ev("expo.t", Some(json!(vec![6; 10])))))
            .2
            .len(),
        2
    );
}

/// Deciding validity has no step budget, so a schema that fans out level after level is
/// refused at load: the audit's 1.5 KB schema (22 levels of two references each) checked a
/// 70-byte event's data 4 million times.
#[test]
fn a_schema_that_fans_out_exponentially_is_refused_at_load() {
    let mut defs = Map::new();
    for i in 0..22 {
        let next = format!("#/$defs/D{}", i + 1);
        defs.insert(
            format!("D{i}"),
            json!({"allOf": [{"$ref": next}, {"$ref": next}]}),
        );
    }
    defs.insert("D22".into(), json!({"type": "object"}));
    let text =
        serde_json::to_string_pretty(&json!({"$ref": "#/$defs/D0", "$defs": defs})).expect("json");
    let d = err_at(&[("expo.t/v1.json", &text)], None);
    assert_eq!(d.len(), 1, "{d:?}");
    assert!(d[0].pointer.starts_with("/$defs/D"), "{d:?}");
    assert!(d[0].line > 1, "{}", d[0]);
    assert!(d[0].message.contains("fans out"), "{}", d[0]);
}

#[test]
fn step_counters_leave_data_values_alone() {
    let schema = json!({
        "properties": {"a": {"enum": [{"k": 1}]}, "b": {"const": {"x": 1}}},
        "dependencies": {"a": ["b"]},
        "items": [{"type": "string"}],
        "$defs": {"d": {"default": {}}}
    });
    let counted = with_step_counters(&schema);
    assert_eq!(counted["properties"]["a"]["enum"], json!([{"k": 1}]));
    assert_eq!(counted["properties"]["b"]["const"], json!({"x": 1}));
    assert_eq!(counted["properties"]["a"][STEP_KEYWORD], json!(true));
    assert!(counted["properties"].get(STEP_KEYWORD).is_none());
    assert_eq!(counted["dependencies"]["a"], json!(["b"]));
    assert_eq!(counted["items"][0][STEP_KEYWORD], json!(true));
    assert_eq!(counted["$defs"]["d"]["default"], json!({}));
}

#[test]
fn backtracking_patterns_are_refused_at_load_with_their_pointer() {
    // Lookahead made this a ReDoS: 8 s of CPU per 9 KB event on fancy-regex.
    let text = "{\"type\": \"object\",\n \"properties\": {\"s\": {\"type\": \"array\",\n  \"items\": {\"type\": \"string\", \"pattern\": \"^(a|a)*(?!a)b$\"}}}}";
    let d = err_at(&[("redos.p5/v1.json", text)], None);
    assert_eq!(d.len(), 1, "{d:?}");
    assert_eq!(d[0].pointer, "/properties/s/items/pattern", "{d:?}");
    assert_eq!(d[0].line, 3, "{}", d[0]);
    assert!(d[0].message.contains("lookaround"), "{}", d[0]);
    for backtracking in [r"^(\w)\1$", "(?<=a)b", "a(?=b)"] {
        let text = json!({"patternProperties": {backtracking: {}}}).to_string();
        let d = err_at(&[("t/v1.json", &text)], None);
        assert_eq!(d.len(), 1, "{backtracking}: {d:?}");
    }
    // The usual patterns still load and apply, `(a+)+$` included (linear here).
    let s = one(
        "ok.p",
        r#"{"properties": {"s": {"pattern": "^(a+)+$"}, "id": {"pattern": "^[A-Z]{2}-\\d{4}$"}}}"#,
    );
    assert_eq!(
        s.check(&ev("ok.p", Some(json!({"s": "aaaa", "id": "AB-1234"})))),
        ContractOutcome::Pass
    );
    let long = format!("{}!", "a".repeat(50_000));
    let started = std::time::Instant::now();
    assert_eq!(
        pointers(s.check(&ev("ok.p", Some(json!({"s": long, "id": "A-1"}))))),
        ["/data/id", "/data/s"]
    );
    assert!(started.elapsed() < std::time::Duration::from_secs(5));
}

#[test]
fn a_reference_to_another_document_is_located_and_explained() {
    let text = "{\n  \"type\": \"object\",\n  \"properties\": {\n    \"a\": {\"type\": \"string\"},\n    \"b\": {\"$ref\": \"https://example.com/b.json\"}\n  }\n}";
    let d = err_at(&[("rref.t/v1.json", text)], None);
    assert_eq!(d.len(), 1, "{d:?}");
    assert_eq!(d[0].pointer, "/properties/b/$ref", "{d:?}");
    assert_eq!(d[0].line, 5, "{}", d[0]);
    assert!(d[0].message.contains("self-contained"), "{}", d[0]);
    assert!(
        d[0].message.contains("https://example.com/b.json"),
        "{}",
        d[0]
    );
    assert!(!d[0].message.contains("resolve-http"), "{}", d[0]);
    // Sibling files, at any depth, are refused the same way.
    for sibling in ["v1.json", "../order.created/v1.json#/$defs/x"] {
        let text = json!({"allOf": [{"type": "object"}, {"properties": {"c": {"$ref": sibling}}}]})
            .to_string();
        let d = err_at(&[("t/v2.json", &text)], None);
        assert_eq!(d.len(), 1, "{d:?}");
        assert_eq!(
            d[0].pointer, "/allOf/1/properties/c/$ref",
            "{sibling}: {d:?}"
        );
        assert!(d[0].message.contains("self-contained"), "{}", d[0]);
    }
    // A reference through an $id of this file still resolves.
    let by_id = r#"{"$id": "https://example.com/root.json", "$defs": {"n": {"$id": "n.json", "type": "integer"}}, "properties": {"n": {"$ref": "n.json"}}}"#;
    let s =
        ContractSet::from_files(&[("t/v1.json", by_id)], None).expect("resolves within the file");
    assert_eq!(
        pointers(s.check(&versioned("t", 1, json!({"n": "x"})))),
        ["/data/n"]
    );
}

//! `schemas/rules.schema.json` against the loader: the schema is what editors (through
//! yaml-language-server) know about rule files, so it must never flag a file the loader accepts,
//! and should flag everything the loader refuses that a JSON Schema can express.
//!
//! The loader also refuses things no JSON Schema can express; those are not in the agreement
//! table (`loader_only_checks_are_beyond_the_schema` checks that the schema accepts a sample):
//! - references across the rule set: a target's `policy` must be defined (in any file), and
//!   rule names, target ids (explicit or derived `<rule>-<n>`) and policy names must be unique
//!   across all files;
//! - comparisons between values: `retry.base_delay` must not exceed `retry.max_delay`, and a
//!   two-sided `numeric` range must not be empty;
//! - limits of the parsers: duration numbers that overflow, and fractions that do not come out
//!   as whole nanoseconds (`1.0001us`) or, for hours and longer units, whole seconds (`0.1M`);
//!   IPv6 addresses in `cidr` and webhook hosts are only checked for their characters, and so
//!   are webhook hosts whose last label is a number, which URL parsing reads as IPv4 (`.0`,
//!   `1.2.3.999` are refused by the loader's URL parser, not by a pattern); names
//!   are limited to 200 bytes, the schema counts 200 characters;
//! - numbers written with a fraction where an integer is required (`max_attempts: 6.0`): JSON
//!   Schema counts 6.0 as an integer, serde does not;
//! - pattern size: `$or` expanding to more than 256 combinations, more than 4096 field tests in
//!   one rule, the automaton-state cap of the whole set, and the wildcard cap of a field (256
//!   matcher states active at once, over the wildcards of every rule there);
//! - YAML-only content: syntax errors, duplicate keys, several documents in one file, aliases,
//!   non-finite floats (`.inf`, `.nan`), none of which reach a JSON instance.
//!
//! A handler name that is not uploaded is not a loader error (the target waits for the handler
//! at delivery time), and more than 15 worst-case attempts is only a warning; both are valid
//! here.

use std::fs;
use std::path::{Path, PathBuf};
use std::sync::LazyLock;

use proptest::prelude::*;
use serde_json::{Map, Value, json};

use super::RuleSet;
use super::pattern::{Cidr, Wildcard};
use super::source;
use crate::policy::config::{BreakerPolicy, PolicyConfig, RetryPolicy};

fn schema() -> Value {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../schemas/rules.schema.json");
    let text = fs::read_to_string(&path).expect("schemas/rules.schema.json is readable");
    serde_json::from_str(&text).expect("schemas/rules.schema.json is JSON")
}

fn validator() -> jsonschema::Validator {
    jsonschema::draft202012::new(&schema()).expect("the rule-file schema compiles")
}

/// The JSON instance an editor validates: the file read the way the loader reads it. An empty
/// file is a null document.
fn instance(name: &str, text: &str) -> Value {
    let is_json = name.to_ascii_lowercase().ends_with(".json");
    match source::parse(text, is_json) {
        Ok(None) => Value::Null,
        Ok(Some(node)) => node.to_json(),
        Err(errors) => panic!("{name}: does not parse, so it is no schema case: {errors:?}"),
    }
}

fn schema_errors(v: &jsonschema::Validator, instance: &Value) -> Vec<String> {
    v.iter_errors(instance)
        .map(|e| format!("{}: {e}", e.instance_path().as_str()))
        .collect()
}

fn loader_errors(name: &str, text: &str) -> Vec<String> {
    match RuleSet::from_sources(&[(name, text)]) {
        Ok(_) => Vec::new(),
        Err(diags) => diags.iter().map(ToString::to_string).collect(),
    }
}

/// A file with one rule whose pattern is `pattern` (YAML flow syntax).
fn with_pattern(pattern: &str) -> String {
    format!("rules:\n  - name: r\n    pattern: {pattern}\n    targets: [{{ handler: h }}]\n")
}

/// A file with one rule whose only target is `target` (YAML flow syntax).
fn with_target(target: &str) -> String {
    format!("rules:\n  - name: r\n    pattern: {{ type: [t] }}\n    targets:\n      - {target}\n")
}

/// A file defining the policy `p` as `policy` (YAML flow syntax).
fn with_policy(policy: &str) -> String {
    format!("policies:\n  p: {policy}\n")
}

const FULL: &str = r#"
policies:
  payments:
    timeout: 2s
    retry: { max_attempts: 6, base_delay: 200ms, max_delay: 30s, jitter: full, max_age: 24h, retry_after_max: 1h }
    breaker: { failure_rate: 0.5, min_requests: 20, window: 30s, open_for: 30s, half_open_probes: 1, consecutive_failures: 10 }
    throttle: { rate_per_sec: 50, burst: 100, max_concurrency: 8 }
    retry_budget: 0.1
    ordering: $.data.order_id
    on_dead_letter: hold
    max_queue_depth: 1000
  defaults:
rules:
  - name: paid-orders
    description: paid orders go to the ERP, the invoicing handler and NATS
    enabled: true
    pattern:
      detail-type: [order.paid]
      source: [{ prefix: { equals-ignore-case: /Shop } }]
      data:
        total: [{ numeric: [">", 0, "<=", 10000] }]
        country: [{ anything-but: [XX, YY] }]
        coupon: [null, { exists: false }]
        items: { sku: [{ wildcard: "sku-*-\\*" }] }
    targets:
      - webhook: https://erp.internal:8443/hooks/orders?src=router
        id: erp
        policy: payments
        headers: { X-Version: 2, X-Flag: true, X-Team: billing }
        secret_env: ERP_HOOK_SECRET
      - handler: invoicing
        policy: defaults
      - nats: orders.paid
  - name: disabled-one
    enabled: false
    description:
    pattern: { type: [{ suffix: .created }] }
    targets: [{ handler: h }]
"#;

const FULL_JSON: &str = r#"{
  "policies": { "p": { "timeout": "1s", "ordering": "partitionkey" } },
  "rules": [
    {
      "name": "json-rule",
      "pattern": { "$or": [ { "type": ["a"] }, { "data": { "n": [ { "numeric": ["=", 3] } ] } } ] },
      "targets": [ { "webhook": "http://[::1]:9000/x", "policy": "p" } ]
    }
  ]
}"#;

/// Whole files: (what, file name, text, valid).
#[rustfmt::skip]
const FILES: &[(&str, &str, &str, bool)] = &[
    ("full example, all policy sections", "case.yaml", FULL, true),
    ("full example as JSON", "case.json", FULL_JSON, true),
    ("examples/rules example", "case.yaml", include_str!("../../../examples/rules/orders.yaml"), true),
    ("empty file", "case.yaml", "", true),
    ("comment only", "case.yaml", "# nothing yet\n", true),
    ("null document", "case.yaml", "~\n", true),
    ("empty sections", "case.yaml", "policies:\nrules:\n", true),
    ("empty mapping and list", "case.yaml", "policies: {}\nrules: []\n", true),
    ("file is a list", "case.yaml", "- a\n", false),
    ("unknown top-level key", "case.yaml", "version: 1\nrules: []\n", false),
    ("$schema key in a JSON file", "case.json", r#"{"$schema": "https://event-router.dev/schemas/rules.schema.json", "rules": []}"#, true),
    ("$schema key in a YAML file", "case.yaml", "$schema: ../schemas/rules.schema.json\nrules: []\n", true),
    ("$schema not a string", "case.json", r#"{"$schema": 1, "rules": []}"#, false),
    ("rules is a mapping", "case.yaml", "rules: { a: 1 }\n", false),
    ("policies is a list", "case.yaml", "policies: [a]\n", false),
    ("policy name with a space", "case.yaml", "policies:\n  \"a b\": {}\n", false),
    ("unknown rule key", "case.yaml", "rules:\n  - name: r\n    priority: 1\n    pattern: { type: [t] }\n    targets: [{ handler: h }]\n", false),
    ("rule is a string", "case.yaml", "rules: [r]\n", false),
    ("missing name", "case.yaml", "rules:\n  - pattern: { type: [t] }\n    targets: [{ handler: h }]\n", false),
    ("missing pattern", "case.yaml", "rules:\n  - name: r\n    targets: [{ handler: h }]\n", false),
    ("missing targets", "case.yaml", "rules:\n  - name: r\n    pattern: { type: [t] }\n", false),
    ("empty targets", "case.yaml", "rules:\n  - name: r\n    pattern: { type: [t] }\n    targets: []\n", false),
];

/// A rule whose `name: r` line is replaced: (what, replacement, valid).
#[rustfmt::skip]
const RULE_HEADS: &[(&str, &str, bool)] = &[
    ("name with a space", "name: \"a b\"", false),
    ("name with a no-break space", "name: \"a\u{a0}b\"", false),
    ("name with a slash", "name: a/b", false),
    ("name that is a number", "name: 7", false),
    ("non-ASCII name", "name: überweisung", true),
    ("enabled as a string", "name: r\n    enabled: \"yes\"", false),
    ("description as a number", "name: r\n    description: 5", false),
];

/// (what, target in YAML flow syntax, valid).
#[rustfmt::skip]
const TARGETS: &[(&str, &str, bool)] = &[
    ("target with two kinds", "{ handler: h, nats: a.b }", false),
    ("target with no kind", "{ id: x }", false),
    ("target is a string", "h", false),
    ("unknown target key", "{ handler: h, retries: 3 }", false),
    ("id with a space", "{ handler: h, id: \"a b\" }", false),
    ("null id", "{ handler: h, id: }", false),
    ("the id of dead letters without a target", "{ handler: h, id: none }", false),
    ("an id that only starts with none", "{ handler: h, id: none-1 }", true),
    ("policy reference that is null", "{ handler: h, policy: }", false),
    ("handler with a slash", "{ handler: a/b }", false),
    ("handler with a capital and a dot", "{ handler: Billing.v2 }", false),
    ("handler with a dot", "{ handler: billing.v2 }", false),
    ("handler starting with a hyphen", "{ handler: \"-billing\" }", false),
    ("handler of 65 characters", "{ handler: aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa }", false),
    ("handler of 64 characters", "{ handler: aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa }", true),
    ("handler with digits, '_' and '-'", "{ handler: 7up_billing-v2 }", true),
    ("headers on a handler", "{ handler: h, headers: { X-A: b } }", false),
    ("secret_env on NATS", "{ nats: a.b, secret_env: S }", false),
    ("secret_env", "{ webhook: \"http://h/\", secret_env: _S1 }", true),
    ("secret_env starting with a digit", "{ webhook: \"http://h/\", secret_env: 1BAD }", false),
    ("header values of every scalar type", "{ webhook: \"http://h/\", headers: { X-A: b, X-N: 2, X-B: false } }", true),
    ("header value with a fraction", "{ webhook: \"http://h/\", headers: { X-N: 2.5 } }", false),
    ("header value with a fraction, quoted", "{ webhook: \"http://h/\", headers: { X-N: \"2.50\" } }", true),
    ("null header value", "{ webhook: \"http://h/\", headers: { X-A: } }", false),
    ("header value with a line break", "{ webhook: \"http://h/\", headers: { X-A: \"a\\nb\" } }", false),
    ("header value with a vertical tab", "{ webhook: \"http://h/\", headers: { X-A: \"a\\vb\" } }", false),
    ("header value with a NUL", "{ webhook: \"http://h/\", headers: { X-A: \"a\\0b\" } }", false),
    ("header value with a DEL", "{ webhook: \"http://h/\", headers: { X-A: \"a\\x7Fb\" } }", false),
    ("header value with a tab and non-ASCII text", "{ webhook: \"http://h/\", headers: { X-A: \"a\\tb é\" } }", true),
    ("header name with a space", "{ webhook: \"http://h/\", headers: { \"X A\": b } }", false),
    ("a framing header", "{ webhook: \"http://h/\", headers: { Content-Length: \"5\" } }", false),
    ("a header the router sets, any case", "{ webhook: \"http://h/\", headers: { IDEMPOTENCY-KEY: k } }", false),
    ("a header in the Standard Webhooks namespace", "{ webhook: \"http://h/\", headers: { webhook-version: \"2\" } }", false),
    ("a Standard Webhooks header from the environment, any case", "{ webhook: \"http://h/\", headers_env: { Webhook-Signature-Alg: WEBHOOK_SECRET_A } }", false),
    ("a header named like a reserved one", "{ webhook: \"http://h/\", headers: { X-Content-Length: \"5\" } }", true),
    ("headers as a list", "{ webhook: \"http://h/\", headers: [a] }", false),
    ("batch", "{ webhook: \"http://h/\", batch: { max_events: 100, max_bytes: 65536 } }", true),
    ("empty batch (defaults)", "{ webhook: \"http://h/\", batch: {} }", true),
    ("batch on a handler", "{ handler: h, batch: { max_events: 10 } }", false),
    ("batch of zero", "{ webhook: \"http://h/\", batch: { max_events: 0 } }", false),
    ("batch over 1000", "{ webhook: \"http://h/\", batch: { max_events: 1001 } }", false),
    ("batch bytes too small", "{ webhook: \"http://h/\", batch: { max_bytes: 100 } }", false),
    ("batch with an unknown key", "{ webhook: \"http://h/\", batch: { linger: 5 } }", false),
    ("batch as a number", "{ webhook: \"http://h/\", batch: 100 }", false),
    ("NATS wildcard subject", "{ nats: \"orders.*\" }", false),
    ("NATS full-wildcard subject", "{ nats: \"orders.>\" }", false),
    ("NATS empty token", "{ nats: \"orders..x\" }", false),
    ("NATS token starting with >", "{ nats: \"orders.>x\" }", true),
    ("NATS subject with a space", "{ nats: \"a b\" }", false),
];

/// (webhook URL, valid).
#[rustfmt::skip]
const URLS: &[(&str, bool)] = &[
    ("http://127.0.0.1:9000/erp", true),
    ("HTTPS://Example.com/a?b=c#d@e", true),
    ("http://[::1]:8080/x", true),
    ("http://[::ffff:10.0.0.1]", true),
    ("http://host:65535", true),
    ("http://host:00080/", true),
    ("http://host:0", true),
    // Hosts the HTTP client refuses (WHATWG forbidden host code points).
    ("http://a]b?x", false),
    ("https://exa<mple.com/hook", false),
    ("http://bad%host/x", false),
    ("http://a|b/", false),
    ("http://host:65536/", false),
    ("http://host:/", false),
    ("http://host:8:9/", false),
    ("http://host:+80/", false),
    ("ftp://example.com/", false),
    ("example.com/hook", false),
    ("http:///path", false),
    ("http://user:pw@host/", false),
    ("http://[zz]/", false),
    ("http://[::1]x/", false),
    ("http://ho st/", false),
    ("http://host/a\u{3000}b", false),
];

/// (what, pattern in YAML flow syntax, valid).
#[rustfmt::skip]
const PATTERNS: &[(&str, &str, bool)] = &[
    ("pattern leaf that is not an array", "{ type: order.paid }", false),
    ("pattern leaf that is a number", "{ n: 5 }", false),
    ("pattern that is a list", "[a]", false),
    ("empty pattern", "{}", false),
    ("empty nested pattern", "{ data: {} }", false),
    ("empty matcher list", "{ type: [] }", false),
    ("nested array matcher", "{ type: [[a]] }", false),
    ("exact values of every type", "{ a: [x, 1, 2.5, true, null] }", true),
    ("unknown pattern operator", "{ type: [{ prefx: order. }] }", false),
    ("matcher with two operators", "{ type: [{ prefix: a, suffix: b }] }", false),
    ("empty matcher object", "{ type: [{}] }", false),
    ("operator name as a plain field", "{ data: { prefix: [a] } }", true),
    ("$or", "{ $or: [{ type: [a] }, { source: [b] }] }", true),
    ("nested $or", "{ data: { $or: [{ a: [1] }, { b: { $or: [{ c: [1] }, { d: [2] }] } }] } }", true),
    ("$or with one alternative", "{ $or: [{ type: [a] }] }", false),
    ("$or that is a mapping", "{ $or: { type: [a] } }", false),
    ("$or with a scalar alternative", "{ $or: [{ type: [a] }, b] }", false),
    ("operator name as a field in $or", "{ $or: [{ prefix: [a] }, { type: [b] }] }", false),
    ("operator name nested in $or", "{ $or: [{ data: { numeric: [1] } }, { type: [b] }] }", false),
    ("prefix", "{ type: [{ prefix: order. }] }", true),
    ("prefix ignoring case", "{ type: [{ prefix: { equals-ignore-case: ORDER. } }] }", true),
    ("suffix with a wildcard inside", "{ type: [{ suffix: { wildcard: x } }] }", false),
    ("prefix that is a number", "{ type: [{ prefix: 5 }] }", false),
    ("equals-ignore-case", "{ type: [{ equals-ignore-case: Order.Paid }] }", true),
    ("equals-ignore-case with a list", "{ type: [{ equals-ignore-case: [a] }] }", false),
    ("wildcard", "{ type: [{ wildcard: 'a*b*c*d*e*' }] }", true),
    ("wildcard with escapes", r"{ type: [{ wildcard: 'a\**\\' }] }", true),
    ("wildcard with six stars", "{ type: [{ wildcard: '*a*b*c*d*e*' }] }", false),
    ("wildcard with consecutive stars", "{ type: [{ wildcard: 'a**b' }] }", false),
    ("wildcard with a bad escape", r"{ type: [{ wildcard: 'a\b' }] }", false),
    ("wildcard with a trailing backslash", r"{ type: [{ wildcard: 'ab\' }] }", false),
    ("anything-but with a prefix", "{ type: [{ anything-but: { prefix: init } }] }", true),
    ("anything-but with an empty prefix", "{ type: [{ anything-but: { prefix: '' } }] }", false),
    ("anything-but with prefixes", "{ type: [{ anything-but: { prefix: [us-, eu-] } }] }", true),
    ("anything-but with suffixes", "{ type: [{ anything-but: { suffix: [.tmp, .bak] } }] }", true),
    ("anything-but with an empty suffix list", "{ type: [{ anything-but: { suffix: [] } }] }", false),
    ("anything-but with an empty prefix in a list", "{ type: [{ anything-but: { prefix: [a, ''] } }] }", false),
    ("anything-but string", "{ type: [{ anything-but: x }] }", true),
    ("anything-but number", "{ n: [{ anything-but: 3 }] }", true),
    ("anything-but numbers", "{ n: [{ anything-but: [1, 2.5] }] }", true),
    ("anything-but mixed list", "{ n: [{ anything-but: [a, 1] }] }", false),
    ("anything-but empty list", "{ n: [{ anything-but: [] }] }", false),
    ("anything-but null", "{ n: [{ anything-but: null }] }", false),
    ("anything-but wildcards", "{ t: [{ anything-but: { wildcard: ['a*', 'b*'] } }] }", true),
    ("anything-but equals-ignore-case", "{ t: [{ anything-but: { equals-ignore-case: A } }] }", true),
    ("anything-but with numeric", "{ t: [{ anything-but: { numeric: ['>', 1] } }] }", false),
    ("numeric", r#"{ n: [{ numeric: ["<=", 5] }] }"#, true),
    ("numeric range", r#"{ n: [{ numeric: [">", 0, "<=", 5] }] }"#, true),
    ("numeric operand at 2^53 - 1", r#"{ n: [{ numeric: [">=", -9007199254740991, "<", 9007199254740991] }] }"#, true),
    ("numeric operand past 2^53 - 1", r#"{ n: [{ numeric: ["=", 9007199254740993] }] }"#, false),
    ("numeric upper bound past 2^53 - 1", r#"{ n: [{ numeric: [">", 0, "<", 1.0e300] }] }"#, false),
    ("numeric with a bad operator", r#"{ n: [{ numeric: ["=>", 1] }] }"#, false),
    ("numeric range in the wrong order", r#"{ n: [{ numeric: ["<", 5, ">", 0] }] }"#, false),
    ("numeric with three elements", r#"{ n: [{ numeric: [">", 1, "<"] }] }"#, false),
    ("numeric with a string value", r#"{ n: [{ numeric: [">", "1"] }] }"#, false),
    ("numeric that is not a list", r#"{ n: [{ numeric: ">" }] }"#, false),
    ("exists", "{ data: { x: [{ exists: false }] } }", true),
    ("exists that is a string", "{ x: [{ exists: \"yes\" }] }", false),
    ("cidr", "{ ip: [{ cidr: 10.0.0.0/24 }] }", true),
    ("IPv6 cidr", "{ ip: [{ cidr: \"2001:db8::/32\" }, { cidr: \"::/0\" }] }", true),
    ("cidr prefix padded with zeros", "{ ip: [{ cidr: 10.0.0.0/008 }] }", true),
    ("cidr prefix too long", "{ ip: [{ cidr: 10.0.0.0/33 }] }", false),
    ("IPv6 cidr prefix too long", "{ ip: [{ cidr: \"::/129\" }] }", false),
    ("cidr with a signed prefix", "{ ip: [{ cidr: 10.0.0.0/+8 }] }", false),
    ("cidr without a prefix", "{ ip: [{ cidr: 10.0.0.0 }] }", false),
    ("cidr with a zero-padded octet", "{ ip: [{ cidr: 010.0.0.0/8 }] }", false),
    ("cidr with three octets", "{ ip: [{ cidr: 10.0.0/8 }] }", false),
];

/// (what, policy `p` in YAML flow syntax, valid).
#[rustfmt::skip]
const POLICIES: &[(&str, &str, bool)] = &[
    ("null policy (all defaults)", "", true),
    ("empty policy", "{}", true),
    ("policy that is a list", "[a]", false),
    ("unknown policy field", "{ timeot: 1s }", false),
    ("unknown retry field", "{ retry: { max_attempt: 3 } }", false),
    ("unknown breaker field", "{ breaker: { rate: 0.5 } }", false),
    ("duration that is a number", "{ timeout: 2 }", false),
    ("zero timeout", "{ timeout: 0s }", false),
    ("bare zero timeout", "{ timeout: \"0\" }", false),
    ("zero retry_after_max", "{ retry: { retry_after_max: \"0\" } }", true),
    ("zero max_delay", "{ retry: { max_delay: 0ms } }", false),
    ("compound duration", "{ timeout: 1h30m }", true),
    ("spaced duration", "{ timeout: \" 1 h 30 min \" }", true),
    ("long unit names", "{ timeout: 2 seconds }", true),
    ("fractional duration", "{ timeout: 1.5h }", true),
    ("fractional nanoseconds", "{ timeout: 1.5ns }", false),
    ("duration without a unit", "{ timeout: \"5\" }", false),
    ("duration with an unknown unit", "{ timeout: 2x }", false),
    ("duration with a trailing comma", "{ timeout: \"2s,\" }", false),
    ("empty duration", "{ timeout: \"\" }", false),
    ("null timeout", "{ timeout: }", false),
    ("retry max_attempts 0", "{ retry: { max_attempts: 0 } }", false),
    ("retry max_attempts negative", "{ retry: { max_attempts: -1 } }", false),
    ("retry max_attempts as a string", "{ retry: { max_attempts: \"3\" } }", false),
    ("more than 15 worst-case attempts (a warning)", "{ retry: { max_attempts: 20 } }", true),
    ("retry max_attempts 1000", "{ retry: { max_attempts: 1000 } }", true),
    ("retry max_attempts past 1000", "{ retry: { max_attempts: 1001 } }", false),
    ("null retry", "{ retry: }", false),
    ("jitter none", "{ retry: { jitter: none } }", true),
    ("unknown jitter", "{ retry: { jitter: random } }", false),
    ("empty breaker", "{ breaker: {} }", true),
    ("null breaker", "{ breaker: }", true),
    ("breaker failure_rate 1", "{ breaker: { failure_rate: 1 } }", true),
    ("breaker failure_rate 0", "{ breaker: { failure_rate: 0 } }", false),
    ("breaker failure_rate above 1", "{ breaker: { failure_rate: 1.01 } }", false),
    ("breaker consecutive_failures 0", "{ breaker: { consecutive_failures: 0 } }", false),
    ("breaker consecutive_failures null", "{ breaker: { consecutive_failures: } }", true),
    ("breaker window as a number", "{ breaker: { window: 30 } }", false),
    ("throttle concurrency only", "{ throttle: { max_concurrency: 4 } }", true),
    ("throttle rate without burst", "{ throttle: { rate_per_sec: 0.5, burst: } }", true),
    ("null throttle", "{ throttle: }", true),
    ("empty throttle", "{ throttle: {} }", false),
    ("throttle with only nulls", "{ throttle: { rate_per_sec: , max_concurrency: } }", false),
    ("throttle burst without rate", "{ throttle: { burst: 10, max_concurrency: 4 } }", false),
    ("throttle rate 0", "{ throttle: { rate_per_sec: 0 } }", false),
    ("throttle max_concurrency 0", "{ throttle: { max_concurrency: 0 } }", false),
    ("retry_budget 0", "{ retry_budget: 0 }", true),
    ("retry_budget above 1", "{ retry_budget: 1.5 }", false),
    ("null retry_budget", "{ retry_budget: }", true),
    ("ordering partitionkey", "{ ordering: partitionkey }", true),
    ("ordering path", "{ ordering: $.data.order_id }", true),
    ("ordering without $.", "{ ordering: data.x }", false),
    ("ordering with an empty segment", "{ ordering: $..x }", false),
    ("ordering with an index", "{ ordering: \"$.a[0]\" }", false),
    ("null ordering", "{ ordering: }", true),
    ("on_dead_letter hold", "{ on_dead_letter: hold }", true),
    ("unknown on_dead_letter", "{ on_dead_letter: drop }", false),
    ("max_queue_depth 0", "{ max_queue_depth: 0 }", false),
    ("max_queue_depth 1", "{ max_queue_depth: 1 }", true),
];

/// Every table as (what, file name, text, valid).
fn cases() -> Vec<(String, &'static str, String, bool)> {
    let y = "case.yaml";
    let mut c = Vec::new();
    for (what, name, text, valid) in FILES {
        c.push((what.to_string(), *name, text.to_string(), *valid));
    }
    let rule = with_pattern("{ type: [t] }");
    for (what, head, valid) in RULE_HEADS {
        c.push((what.to_string(), y, rule.replace("name: r", head), *valid));
    }
    for (len, valid) in [(200, true), (201, false)] {
        let head = format!("name: {}", "n".repeat(len));
        c.push((
            format!("name of {len} bytes"),
            y,
            rule.replace("name: r", &head),
            valid,
        ));
    }
    for (what, target, valid) in TARGETS {
        c.push((what.to_string(), y, with_target(target), *valid));
    }
    for (url, valid) in URLS {
        let target = format!("{{ webhook: \"{url}\" }}");
        c.push((
            format!("webhook URL {url}"),
            y,
            with_target(&target),
            *valid,
        ));
    }
    for (what, pattern, valid) in PATTERNS {
        c.push((what.to_string(), y, with_pattern(pattern), *valid));
    }
    for (what, policy, valid) in POLICIES {
        c.push((what.to_string(), y, with_policy(policy), *valid));
    }
    c
}

#[test]
fn schema_is_a_valid_2020_12_schema_and_compiles() {
    let s = schema();
    if let Err(e) = jsonschema::draft202012::meta::validate(&s) {
        panic!(
            "not a valid 2020-12 schema: {e} at {}",
            e.instance_path().as_str()
        );
    }
    assert_eq!(s["$schema"], "https://json-schema.org/draft/2020-12/schema");
    assert_eq!(
        s["$id"],
        "https://event-router.dev/schemas/rules.schema.json"
    );
    assert!(s["title"].is_string() && s["description"].is_string());
    let _ = validator();
}

/// Editors show these as hover text; a missing one is a gap in the user-facing docs.
#[test]
fn every_property_and_definition_is_described() {
    fn walk(v: &Value, at: &str, missing: &mut Vec<String>) {
        match v {
            Value::Object(m) => {
                for key in ["properties", "$defs"] {
                    if let Some(Value::Object(children)) = m.get(key) {
                        for (name, child) in children {
                            if child.get("description").is_none() {
                                missing.push(format!("{at}/{key}/{name}"));
                            }
                        }
                    }
                }
                for (k, child) in m {
                    walk(child, &format!("{at}/{k}"), missing);
                }
            }
            Value::Array(items) => {
                for (i, child) in items.iter().enumerate() {
                    walk(child, &format!("{at}/{i}"), missing);
                }
            }
            _ => {}
        }
    }
    let s = schema();
    let mut missing = Vec::new();
    // Properties inside `if`/`then`/`anyOf` only restate types; they need no hover text.
    let mut top = s.clone();
    if let Some(defs) = top.get_mut("$defs").and_then(Value::as_object_mut) {
        for def in defs.values_mut() {
            if let Some(m) = def.as_object_mut() {
                m.remove("then");
                m.remove("if");
            }
        }
    }
    walk(&top, "", &mut missing);
    assert!(missing.is_empty(), "no description: {missing:#?}");
}

fn rule_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in fs::read_dir(dir).expect("examples/rules is readable") {
        let path = entry.expect("directory entry").path();
        let name = path
            .file_name()
            .map(|n| n.to_string_lossy().to_ascii_lowercase())
            .unwrap_or_default();
        if name.starts_with('.') {
            continue;
        }
        if path.is_dir() {
            rule_files(&path, out);
        } else if name.ends_with(".yaml") || name.ends_with(".yml") || name.ends_with(".json") {
            out.push(path);
        }
    }
}

#[test]
fn example_rule_files_validate() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/rules");
    let mut files = Vec::new();
    rule_files(&dir, &mut files);
    assert!(!files.is_empty(), "no rule files in {}", dir.display());
    let v = validator();
    for path in &files {
        let text = fs::read_to_string(path).expect("example is readable");
        let name = path.display().to_string();
        let errors = schema_errors(&v, &instance(&name, &text));
        assert!(errors.is_empty(), "{name}: {errors:#?}");
    }
    if let Err(diags) = RuleSet::load_dir(&dir) {
        panic!("the loader refuses the examples: {diags:#?}");
    }
}

#[test]
fn schema_and_loader_agree() {
    let v = validator();
    let cases = cases();
    assert!(cases.len() >= 12);
    let mut failures = Vec::new();
    for (what, name, text, valid) in &cases {
        let loader = loader_errors(name, text);
        let schema = schema_errors(&v, &instance(name, text));
        if loader.is_empty() != *valid {
            failures.push(format!(
                "{what}: loader says {}, want {}: {loader:#?}\n{text}",
                if loader.is_empty() {
                    "valid"
                } else {
                    "invalid"
                },
                if *valid { "valid" } else { "invalid" },
            ));
        }
        if schema.is_empty() != *valid {
            failures.push(format!(
                "{what}: schema says {}, want {}: {schema:#?}\n{text}",
                if schema.is_empty() {
                    "valid"
                } else {
                    "invalid"
                },
                if *valid { "valid" } else { "invalid" },
            ));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n\n"));
}

/// The documented gaps (see the module comment): the schema accepts these, the loader does not.
#[test]
fn loader_only_checks_are_beyond_the_schema() {
    let big_or: String = {
        let mut p = String::from("{");
        for k in ["k1", "k2", "k3", "k4", "k5", "k6"] {
            p.push_str(&format!(
                " {k}: {{ $or: [{{ a: [1] }}, {{ b: [1] }}, {{ c: [1] }}] }},"
            ));
        }
        p.push_str(" }");
        p
    };
    let gaps: Vec<(&str, String)> = vec![
        ("undefined policy", with_target("{ handler: h, policy: nope }")),
        (
            "duplicate rule names",
            "rules:\n  - { name: r, pattern: { a: [1] }, targets: [{ handler: h }] }\n  - { name: r, pattern: { a: [2] }, targets: [{ handler: h }] }\n".into(),
        ),
        (
            "explicit id equal to a derived one",
            with_target("{ handler: h }\n      - { handler: h2, id: r-0 }"),
        ),
        (
            "empty numeric range",
            with_pattern(r#"{ n: [{ numeric: [">", 5, "<", 1] }] }"#),
        ),
        (
            "base_delay above max_delay",
            with_policy("{ retry: { base_delay: 1m, max_delay: 30s } }"),
        ),
        (
            "duration overflow",
            with_policy("{ timeout: 99999999999999999999s }"),
        ),
        (
            "duration finer than a nanosecond",
            with_policy("{ timeout: 1.0001us }"),
        ),
        (
            "integer written with a fraction",
            with_policy("{ retry: { max_attempts: 6.0 } }"),
        ),
        ("malformed IPv6 cidr", with_pattern("{ ip: [{ cidr: \"1:::2/64\" }] }")),
        (
            "malformed IPv6 webhook host",
            with_target("{ webhook: \"http://[1:::2]/\" }"),
        ),
        (
            "name of 200 characters but 400 bytes",
            with_pattern("{ type: [t] }").replace("name: r", &format!("name: {}", "é".repeat(200))),
        ),
        ("too many $or combinations", with_pattern(&big_or)),
    ];
    let v = validator();
    let mut failures = Vec::new();
    for (what, text) in &gaps {
        let name = "gap.yaml";
        let schema = schema_errors(&v, &instance(name, text));
        if !schema.is_empty() {
            failures.push(format!("{what}: the schema refuses it: {schema:#?}"));
        }
        if loader_errors(name, text).is_empty() {
            failures.push(format!("{what}: the loader accepts it\n{text}"));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n\n"));
}

/// The `default` annotations editors show must be the values the loader fills in.
#[test]
fn schema_defaults_are_the_loader_defaults() {
    let s = schema();
    let defaults = |def: &str| -> Map<String, Value> {
        s["$defs"][def]["properties"]
            .as_object()
            .expect("the definition has properties")
            .iter()
            .filter_map(|(k, p)| p.get("default").map(|d| (k.clone(), d.clone())))
            .collect()
    };
    let retry = defaults("retry");
    let breaker = defaults("breaker");
    assert_eq!(retry.len(), 6, "{retry:?}");
    assert_eq!(breaker.len(), 6, "{breaker:?}");
    let mut policy = defaults("policy");
    assert_eq!(policy.len(), 3, "{policy:?}");
    policy.insert("retry".into(), Value::Object(retry));
    policy.insert("breaker".into(), Value::Object(breaker));
    let got: PolicyConfig =
        serde_json::from_value(Value::Object(policy)).expect("the defaults form a policy");
    let want = PolicyConfig {
        retry: RetryPolicy::default(),
        breaker: Some(BreakerPolicy::default()),
        ..PolicyConfig::default()
    };
    assert_eq!(got, want);
    assert_eq!(
        s["$defs"]["rule"]["properties"]["enabled"]["default"],
        json!(true)
    );
}

/// A validator for one definition of the schema, as if it were the root.
fn def_validator(def: &str) -> jsonschema::Validator {
    let mut s = schema();
    let root = json!({
        "$schema": s["$schema"].take(),
        "$defs": s["$defs"].take(),
        "$ref": format!("#/$defs/{def}"),
    });
    jsonschema::draft202012::new(&root).expect("a definition of the schema compiles")
}

static DURATION: LazyLock<jsonschema::Validator> = LazyLock::new(|| def_validator("duration"));
static NAME: LazyLock<jsonschema::Validator> = LazyLock::new(|| def_validator("name"));
static WILDCARD: LazyLock<jsonschema::Validator> = LazyLock::new(|| def_validator("wildcard"));
static TARGET: LazyLock<jsonschema::Validator> = LazyLock::new(|| def_validator("target"));
static OPERATOR: LazyLock<jsonschema::Validator> = LazyLock::new(|| def_validator("operator"));

/// Whether the loader accepts a one-rule file with this name and target.
fn loader_accepts_rule(name: &str, target: &Value) -> bool {
    let file = json!({ "rules": [{ "name": name, "pattern": { "a": [1] }, "targets": [target] }] });
    RuleSet::from_sources(&[("p.json", &file.to_string())]).is_ok()
}

// The string formats (durations, names, URLs, subjects, wildcards, networks) are regular
// expressions in the schema and hand-written parsers in the loader; random strings over the
// characters that matter find the cases a table forgets.
proptest! {
    // A failure prints its minimal input; a regressions file next to the sources would only
    // replay what the table above should then cover.
    #![proptest_config(ProptestConfig {
        failure_persistence: None,
        ..ProptestConfig::default()
    })]

    #[test]
    fn durations_agree_with_humantime(
        s in prop_oneof![
            "[ \u{3000}]?[0-9]{1,3}( ?\\.[0-9 ]{0,3})?[ ]?(ns|nsec|us|µs|ms|s|sec|secs|m|min|h|hr|M|d|w|wk|y|yrs|x|S|)([ ]{0,2}[0-9]{1,3}(ms|s|h|q|))?[ \t]?",
            "[0-9 .hmsµ]{0,8}",
        ]
    ) {
        let schema = DURATION.is_valid(&json!(s));
        let parsed = humantime::parse_duration(&s).is_ok();
        // A fraction can fail on precision (`0.1M` is not a whole number of seconds), which
        // the schema does not model (see the module comment).
        if s.contains('.') {
            prop_assert!(!parsed || schema, "the schema refuses {:?}", s);
        } else {
            prop_assert_eq!(schema, parsed, "{:?}", s);
        }
    }

    #[test]
    fn names_agree_with_the_loader(s in "[a\\-/ \t\u{a0}\u{85}\u{feff}\u{200b}\u{2028}é\u{7f}]{0,5}") {
        prop_assert_eq!(
            NAME.is_valid(&json!(s)),
            loader_accepts_rule(&s, &json!({ "handler": "h" })),
            "{:?}", s
        );
    }

    #[test]
    fn webhook_urls_agree_with_the_loader(
        s in "(http|HTTPS|hTtP|ftp|https?:)?(://|:/)?[a1:\\[\\]@/?#. 0+\u{a0}]{0,10}"
    ) {
        let target = json!({ "webhook": s });
        let schema = TARGET.is_valid(&target);
        let loader = loader_accepts_rule("r", &target);
        // IPv6 hosts, and hosts that URL parsing reads as IPv4 (a numeric last label), are
        // only checked for their characters (see the module comment).
        let authority = s.split("://").nth(1).unwrap_or("").split(['/', '?', '#']).next().unwrap_or("");
        let host = authority.rsplit_once('@').map_or(authority, |(_, h)| h);
        let host = host.split(':').next().unwrap_or("");
        let ipv4_like = host
            .rsplit('.')
            .find(|l| !l.is_empty())
            .is_some_and(|l| l.chars().all(|c| c.is_ascii_digit()));
        if s.contains('[') || ipv4_like {
            prop_assert!(!loader || schema, "the schema refuses {:?}", s);
        } else {
            prop_assert_eq!(schema, loader, "{:?}", s);
        }
    }

    #[test]
    fn nats_subjects_agree_with_the_loader(s in "[a*>. \u{3000}]{0,7}") {
        let target = json!({ "nats": s });
        prop_assert_eq!(TARGET.is_valid(&target), loader_accepts_rule("r", &target), "{:?}", s);
    }

    #[test]
    fn wildcards_agree_with_the_pattern_parser(s in "[a*\\\\]{0,12}") {
        prop_assert_eq!(WILDCARD.is_valid(&json!(s)), Wildcard::parse(&s).is_ok(), "{:?}", s);
    }

    #[test]
    fn ipv4_networks_agree_with_the_pattern_parser(
        s in "((25[0-6]|0?1|10|2)\\.){0,4}(25[0-6]|0?1|10)?(/(0|8|32|33|\\+8|008|)|/)?"
    ) {
        let m = json!({ "cidr": s });
        prop_assert_eq!(OPERATOR.is_valid(&m), Cidr::parse(&s).is_ok(), "{:?}", s);
    }

    #[test]
    fn ipv6_networks_the_parser_accepts_validate(
        s in "(::)?([0-9a-fA-F]{1,4}:){0,7}(:|[0-9a-f]{1,4})(\\.1\\.2\\.3\\.4)?/(0|64|128|129|0128)"
    ) {
        let m = json!({ "cidr": s });
        prop_assert!(Cidr::parse(&s).is_err() || OPERATOR.is_valid(&m), "the schema refuses {:?}", s);
    }
}

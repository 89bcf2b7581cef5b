//! Loader tests: good sets, every error kind with its `file:line:col`, warnings, versions.

use std::time::Duration;

use serde_json::json;

use crate::policy::{OnDeadLetter, PolicyConfig};
use crate::rules::{Diagnostic, RuleMatch, RuleSet, Severity, TargetKind, WebhookBatch};

fn ok(files: &[(&str, &str)]) -> (RuleSet, Vec<Diagnostic>) {
    match RuleSet::from_sources(files) {
        Ok(r) => r,
        Err(d) => panic!("unexpected errors:\n{}", lines(&d)),
    }
}

fn lines(d: &[Diagnostic]) -> String {
    d.iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join("\n")
}

/// All diagnostics (as displayed) of a set that must fail.
fn errs(files: &[(&str, &str)]) -> Vec<String> {
    match RuleSet::from_sources(files) {
        Ok((_, w)) => panic!("expected errors, loaded fine; warnings:\n{}", lines(&w)),
        Err(d) => d.iter().map(ToString::to_string).collect(),
    }
}

/// Asserts that exactly one error was reported, starting with `prefix` and containing `text`.
fn one_err(files: &[(&str, &str)], prefix: &str, text: &str) {
    let e = errs(files);
    assert_eq!(e.len(), 1, "{e:#?}");
    assert!(
        e[0].starts_with(prefix) && e[0].contains(text),
        "got {:?}, want prefix {prefix:?} and {text:?}",
        e[0]
    );
}

const POLICIES: &str = "\
policies:
  payments:
    timeout: 2s
    retry: { max_attempts: 6, base_delay: 200ms, max_delay: 30s, jitter: full, max_age: 24h, retry_after_max: 1h }
    breaker: { failure_rate: 0.5, min_requests: 20, window: 30s, open_for: 30s, half_open_probes: 1, consecutive_failures: null }
    throttle: { rate_per_sec: 50, burst: 100, max_concurrency: 8 }
    retry_budget: 0.1
    ordering: partitionkey
    on_dead_letter: hold
    max_queue_depth: 1000
";

const ORDERS: &str = "\
rules:
  - name: paid-orders-to-invoicing
    description: paid orders go to the ERP and the invoicing handler
    pattern:
      type: [order.paid]
      data: { total: [{ numeric: ['>', 0] }], country: [{ anything-but: [XX] }] }
    targets:
      - webhook: http://127.0.0.1:9000/erp
        id: erp
        policy: payments
        headers: { X-Team: erp }
        secret_env: ERP_WEBHOOK_SECRET
      - handler: invoicing
      - nats: orders.paid
  - name: all-orders-audit
    pattern: { detail-type: [{ prefix: order. }] }
    targets:
      - nats: audit.orders
  - name: disabled-rule
    enabled: false
    pattern: { type: [order.paid] }
    targets:
      - handler: never
";

const SHIPPING_JSON: &str = r#"{
  "rules": [
    {
      "name": "shipping",
      "pattern": { "type": ["order.paid"], "data": { "country": ["DE", "FR"] } },
      "targets": [ { "handler": "shipping", "policy": "payments" } ]
    }
  ]
}
"#;

fn good() -> (RuleSet, Vec<Diagnostic>) {
    ok(&[
        ("a/policies.yaml", POLICIES),
        ("b/orders.yaml", ORDERS),
        ("c/shipping.json", SHIPPING_JSON),
    ])
}

#[test]
fn good_multi_file_set_loads() {
    let (set, warnings) = good();
    assert!(warnings.is_empty(), "{}", lines(&warnings));
    assert_eq!(
        set.files,
        vec!["a/policies.yaml", "b/orders.yaml", "c/shipping.json"]
    );
    assert_eq!(set.version.len(), 12);
    assert!(set.version.chars().all(|c| c.is_ascii_hexdigit()));
    let names: Vec<&str> = set.rules.iter().map(|r| r.name.as_str()).collect();
    assert_eq!(
        names,
        vec![
            "paid-orders-to-invoicing",
            "all-orders-audit",
            "disabled-rule",
            "shipping"
        ]
    );
    let r0 = &set.rules[0];
    assert_eq!((r0.file.as_str(), r0.line), ("b/orders.yaml", 2));
    assert_eq!(
        r0.description.as_deref(),
        Some("paid orders go to the ERP and the invoicing handler")
    );
    assert_eq!(
        r0.target_ids,
        vec![
            "erp",
            "paid-orders-to-invoicing-1",
            "paid-orders-to-invoicing-2"
        ]
    );
    assert_eq!(r0.pattern_json["type"], json!(["order.paid"]));
    assert!(!set.rules[2].enabled);
    assert_eq!(set.targets.len(), 6);

    let erp = &set.targets["erp"];
    assert_eq!(erp.rule, "paid-orders-to-invoicing");
    assert_eq!(erp.policy_name.as_deref(), Some("payments"));
    assert_eq!(erp.policy.timeout, Duration::from_secs(2));
    assert_eq!(erp.policy.on_dead_letter, OnDeadLetter::Hold);
    match &erp.kind {
        TargetKind::Webhook {
            url,
            headers,
            secret_env,
            batch,
            ..
        } => {
            assert_eq!(batch, &None);
            assert_eq!(url, "http://127.0.0.1:9000/erp");
            assert_eq!(headers.get("X-Team").map(String::as_str), Some("erp"));
            assert_eq!(secret_env.as_deref(), Some("ERP_WEBHOOK_SECRET"));
        }
        other => panic!("{other:?}"),
    }
    let inv = &set.targets["paid-orders-to-invoicing-1"];
    assert_eq!(inv.policy_name, None);
    assert_eq!(inv.policy, PolicyConfig::default());
    assert_eq!(
        set.targets["paid-orders-to-invoicing-2"].kind,
        TargetKind::Nats {
            subject: "orders.paid".into()
        }
    );
    // A policy defined in one file is used from a JSON file loaded later.
    assert_eq!(set.targets["shipping-0"].policy, set.policies["payments"]);
}

#[test]
fn matches_enabled_rules_in_file_order() {
    let (set, _) = good();
    let ev = json!({"specversion": "1.0", "id": "1", "source": "/shop", "type": "order.paid",
                    "data": {"total": 10, "country": "DE"}});
    let m = set.matches(&ev);
    assert_eq!(
        m,
        vec![
            RuleMatch {
                rule: "paid-orders-to-invoicing".into(),
                target_ids: vec![
                    "erp".into(),
                    "paid-orders-to-invoicing-1".into(),
                    "paid-orders-to-invoicing-2".into()
                ],
            },
            RuleMatch {
                rule: "all-orders-audit".into(),
                target_ids: vec!["all-orders-audit-0".into()],
            },
            RuleMatch {
                rule: "shipping".into(),
                target_ids: vec!["shipping-0".into()],
            },
        ]
    );
    let cancelled = json!({"type": "order.cancelled", "data": {"total": 0}});
    let m: Vec<String> = set
        .matches(&cancelled)
        .into_iter()
        .map(|m| m.rule)
        .collect();
    assert_eq!(m, vec!["all-orders-audit"]);
    assert!(RuleSet::empty().matches(&ev).is_empty());
}

#[test]
fn empty_set_and_empty_files() {
    let e = RuleSet::empty();
    assert!(e.rules.is_empty() && e.targets.is_empty() && e.files.is_empty());
    assert_eq!(e.version.len(), 12);
    let (set, w) = ok(&[("empty.yaml", ""), ("comment.yml", "# nothing yet\n")]);
    assert!(set.rules.is_empty() && w.is_empty());
    assert_eq!(set.files.len(), 2);
}

#[test]
fn version_changes_with_content_and_path() {
    let v = |files: &[(&str, &str)]| ok(files).0.version;
    let base = v(&[("a.yaml", ORDERS), ("p.yaml", POLICIES)]);
    assert_eq!(base, v(&[("a.yaml", ORDERS), ("p.yaml", POLICIES)]));
    let edited = ORDERS.replace("all-orders-audit", "all-orders-log");
    assert_ne!(base, v(&[("a.yaml", &edited), ("p.yaml", POLICIES)]));
    assert_ne!(base, v(&[("b.yaml", ORDERS), ("p.yaml", POLICIES)]));
    // Moving bytes between the path and the content changes the hash too.
    assert_ne!(v(&[("ab.yaml", "")]), v(&[("a.yaml", ""), ("b.yaml", "")]));
}

#[test]
fn yaml_syntax_error_has_parser_position() {
    let e = errs(&[("r.yaml", "rules:\n  - name: a\n    pattern: { type: [x }\n")]);
    assert_eq!(e.len(), 1, "{e:?}");
    assert!(e[0].starts_with("r.yaml:3:"), "{e:?}");
    assert!(e[0].contains("YAML syntax error"), "{e:?}");
}

#[test]
fn json_syntax_error_has_position() {
    one_err(
        &[(
            "r.json",
            "{\n  \"rules\": [\n    {\"name\": \"a\",}\n  ]\n}\n",
        )],
        "r.json:3:18: ",
        "JSON syntax error",
    );
}

/// A pattern pasted from EventBridge docs into a JSON rule file reads as serde_json reads it:
/// UTF-16 escapes of characters past U+FFFF and integers past i64 keep their exact value.
#[test]
fn json_rule_files_read_escapes_and_numbers_as_json_does() {
    let src = r#"{"rules": [{"name": "emoji", "targets": [{"webhook": "http://127.0.0.1:9/x"}],
        "pattern": {"data": {"mood": ["\ud83d\ude00"], "n": [18446744073709551615]}}}]}"#;
    let (set, w) = ok(&[("r.json", src)]);
    assert!(w.is_empty(), "{w:?}");
    let ev = |n: serde_json::Value| json!({"type": "t", "data": {"mood": "\u{1F600}", "n": n}});
    assert_eq!(set.matches(&ev(json!(18446744073709551615u64))).len(), 1);
    assert!(set.matches(&ev(json!(18446744073709551614u64))).is_empty());
    one_err(
        &[("r.json", "{\n  \"rules\": [],\n  \"rules\": []\n}")],
        "r.json:3:3: ",
        "duplicated key `rules`",
    );
}

#[test]
fn duplicate_yaml_keys_are_errors() {
    one_err(
        &[("r.yaml", "rules:\n  - name: a\n    name: b\n")],
        "r.yaml:3:5: ",
        "duplicated key",
    );
}

#[test]
fn unknown_keys_everywhere() {
    let src = "\
rulez: []
policies:
  p:
    timeot: 1s
    retry: { max_attempt: 3 }
rules:
  - name: a
    patern: { type: [x] }
    pattern: { type: [x] }
    targets:
      - handler: h
        polcy: p
";
    let e: Vec<String> = errs(&[("r.yaml", src)])
        .into_iter()
        .filter(|l| !l.contains("warning: "))
        .collect();
    assert_eq!(e.len(), 5, "{e:#?}");
    assert!(
        e[0].starts_with("r.yaml:1:1: unknown key `rulez` in rule file"),
        "{e:#?}"
    );
    assert!(
        e[1].starts_with("r.yaml:4:5: policy `p`: unknown field `timeot`"),
        "{e:#?}"
    );
    assert!(
        e[2].starts_with("r.yaml:5:14: policy `p`: retry: unknown field `max_attempt`"),
        "{e:#?}"
    );
    assert!(
        e[3].starts_with("r.yaml:8:5: unknown key `patern` in rule"),
        "{e:#?}"
    );
    assert!(
        e[4].starts_with("r.yaml:12:9: unknown key `polcy` in target"),
        "{e:#?}"
    );
}

#[test]
fn missing_name_pattern_targets() {
    let src = "rules:\n  - description: nothing else\n";
    let e = errs(&[("r.yaml", src)]);
    assert_eq!(
        e,
        vec![
            "r.yaml:2:5: rule is missing `name`",
            "r.yaml:2:5: rule is missing `pattern`",
            "r.yaml:2:5: rule is missing `targets`",
        ]
    );
    one_err(
        &[(
            "r.yaml",
            "rules:\n  - name: a\n    pattern: {type: [x]}\n    targets: []\n",
        )],
        "r.yaml:4:14: ",
        "no targets",
    );
    one_err(
        &[(
            "r.yaml",
            "rules:\n  - name: 5\n    pattern: {type: [x]}\n    targets: [{handler: h}]\n",
        )],
        "r.yaml:2:11: ",
        "`name` must be a string",
    );
}

#[test]
fn duplicate_rule_names_across_files() {
    let a =
        "rules:\n  - name: dup\n    pattern: {type: [x]}\n    targets: [{handler: h, id: t1}]\n";
    let b = "\n\nrules:\n  - name: dup\n    pattern: {type: [y]}\n    targets: [{handler: h, id: t2}]\n";
    one_err(
        &[("a.yaml", a), ("b.yaml", b)],
        "b.yaml:4:11: ",
        "duplicate rule name `dup` (first defined at a.yaml:2:11)",
    );
}

#[test]
fn duplicate_target_ids() {
    let src = "\
rules:
  - name: a
    pattern: {type: [x]}
    targets:
      - handler: h
        id: same
      - nats: s.t
        id: same
  - name: b
    pattern: {type: [x]}
    targets:
      - handler: h
  - name: b-0x
    pattern: {type: [x]}
    targets:
      - handler: h
        id: b-0
";
    let e = errs(&[("r.yaml", src)]);
    assert_eq!(e.len(), 2, "{e:#?}");
    assert_eq!(
        e[0],
        "r.yaml:8:13: duplicate target id `same` (first used at r.yaml:6:13)"
    );
    // A derived id clashing with an explicit one points at the derived target's position.
    assert_eq!(
        e[1],
        "r.yaml:17:13: duplicate target id `b-0` (first used at r.yaml:12:9)"
    );
}

/// Operators' pause and rule records share the target-state key space: a target id that
/// looks like one (explicit, or derived from a rule's name) is refused.
#[test]
fn target_ids_with_an_operator_record_prefix() {
    let src = "\
rules:
  - name: a
    pattern: {type: [x]}
    targets:
      - handler: h
        id: pause:hook
  - name: rule:b
    pattern: {type: [x]}
    targets:
      - handler: h
";
    let e = errs(&[("r.yaml", src)]);
    assert_eq!(e.len(), 2, "{e:#?}");
    assert_eq!(
        e[0],
        "r.yaml:6:13: target id `pause:hook` starts with `pause:`, which is kept for operators' pause and rule records: set an id without it"
    );
    assert_eq!(
        e[1],
        "r.yaml:10:9: target id `rule:b-0` starts with `rule:`, which is kept for operators' pause and rule records: rename the rule or set an id without it"
    );
}

#[test]
fn target_kinds_zero_or_two() {
    let src = "\
rules:
  - name: a
    pattern: {type: [x]}
    targets:
      - id: nothing
      - handler: h
        nats: also.this
";
    let e = errs(&[("r.yaml", src)]);
    assert_eq!(e.len(), 2, "{e:#?}");
    assert!(
        e[0].starts_with("r.yaml:5:9: a target needs exactly one of"),
        "{e:#?}"
    );
    assert!(
        e[1].starts_with(
            "r.yaml:7:9: a target has exactly one kind; this one has both `handler` and `nats`"
        ),
        "{e:#?}"
    );
}

#[test]
fn webhook_urls() {
    let t = |url: &str| {
        format!(
            "rules:\n  - name: a\n    pattern: {{type: [x]}}\n    targets:\n      - webhook: \"{url}\"\n"
        )
    };
    for good in [
        "http://127.0.0.1:9000/erp",
        "https://example.com",
        "HTTPS://example.com/a?b=c#d",
        "http://[::1]:8080/x",
        "http://host:1/",
    ] {
        ok(&[("r.yaml", &t(good))]);
    }
    for (bad, why) in [
        ("ftp://example.com/", "must use http or https"),
        ("example.com/hook", "absolute http"),
        ("http:///path", "no host"),
        ("http://host:99999/", "invalid port"),
        ("http://host:x/", "invalid port"),
        ("http://user:pw@host/", "credentials"),
        ("http://[zz]/", "invalid host"),
        ("http://ho st/", "whitespace"),
        // Refused by the HTTP client: every attempt would fail.
        ("https://exa<mple.com/hook", "not a valid URL"),
        ("http://bad%host/x", "not a valid URL"),
    ] {
        one_err(&[("r.yaml", &t(bad))], "r.yaml:5:18: ", why);
    }
    // The credentials are not echoed (CI logs), and the hint names the header way, not the
    // signing secret.
    let e = errs(&[("r.yaml", &t("https://user:s3cret@host:8443/hook?x=1"))]);
    assert_eq!(e.len(), 1, "{e:#?}");
    assert!(!e[0].contains("s3cret"), "{}", e[0]);
    assert!(e[0].contains("https://…@host:8443/hook?x=1"), "{}", e[0]);
    assert!(e[0].contains("headers_env: { Authorization:"), "{}", e[0]);
}

/// Whatever else is wrong with a URL holding credentials, its message never shows them (they
/// land in CI logs, the router's log and `/v1/status`).
#[test]
fn webhook_url_credentials_are_redacted_in_every_message() {
    let t = |url: &str| {
        format!(
            "rules:\n  - name: a\n    pattern: {{type: [x]}}\n    targets:\n      - webhook: \"{url}\"\n"
        )
    };
    for (bad, why, shown) in [
        (
            "http://erp:Pa55word@127.0.0.1:21301/ok ",
            "contains whitespace",
            "`http://…@127.0.0.1:21301/ok `",
        ),
        (
            "htps://erp:Pa55word@127.0.0.1/ok",
            "must use http or https, not `htps`",
            "`htps://…@127.0.0.1/ok`",
        ),
        (
            "erp:Pa55word@127.0.0.1/ok",
            "absolute http",
            "`…@127.0.0.1/ok`",
        ),
        // The credentials before `://`: the scheme is not echoed.
        (
            "erp:Pa55word@host://x",
            "must use http or https",
            "`…@host://x`",
        ),
        (
            "http://erp:Pa55word@[zz]/",
            "credentials",
            "`http://…@[zz]/`",
        ),
        // An unescaped `/` in the password ends the authority early: host `erp`, port `Pa5`.
        (
            "http://erp:Pa5/5word@host/",
            "invalid port",
            "`http://…@host/`",
        ),
        (
            "http://erp:Pa5#5word@host/",
            "invalid port",
            "`http://…@host/`",
        ),
        (
            "https://erp:Pa55word@exa<mple.com/hook",
            "credentials",
            "`https://…@exa<mple.com/hook`",
        ),
    ] {
        let e = errs(&[("r.yaml", &t(bad))]);
        assert_eq!(e.len(), 1, "{bad}: {e:#?}");
        assert!(e[0].contains(why), "{bad}: {}", e[0]);
        assert!(e[0].contains(shown), "{bad}: {}", e[0]);
        assert!(!e[0].contains("Pa5"), "{bad}: {}", e[0]);
        assert!(!e[0].contains("erp"), "{bad}: {}", e[0]);
    }
}

#[test]
fn webhook_only_fields_and_secrets() {
    let src = "\
rules:
  - name: a
    pattern: {type: [x]}
    targets:
      - handler: h
        headers: {X-A: b}
        secret_env: S
      - webhook: http://h/
        secret_env: 1BAD
      - webhook: http://h/
        secret_env: ROUTER_ERP_SECRET
";
    let e = errs(&[("r.yaml", src)]);
    assert_eq!(e.len(), 4, "{e:#?}");
    assert!(e[0].starts_with("r.yaml:6:9: `headers` applies to webhook targets only"));
    assert!(e[1].starts_with("r.yaml:7:9: `secret_env` applies to webhook targets only"));
    assert!(e[2].starts_with("r.yaml:9:21: `secret_env` must name an environment variable"));
    // Every ROUTER_ variable is a configuration key: a secret there stops the router.
    assert!(
        e[3].starts_with("r.yaml:11:21: `secret_env` must name an environment variable")
            && e[3].contains("not `ROUTER_"),
        "{}",
        e[3]
    );

    let framing = "\
rules:
  - name: a
    pattern: {type: [x]}
    targets:
      - webhook: http://h/
        headers: { Content-Length: '5', transfer-encoding: chunked, X-Ok: y, Idempotency-Key: k }
";
    let e = errs(&[("r.yaml", framing)]);
    assert_eq!(e.len(), 3, "{e:#?}");
    assert!(
        e[0].starts_with("r.yaml:6:20: header `Content-Length` is set by the router"),
        "{e:#?}"
    );
    assert!(e[1].contains("`transfer-encoding`"), "{e:#?}");
    assert!(e[2].contains("`Idempotency-Key`"), "{e:#?}");

    // The whole Standard Webhooks namespace, not only the three names the router sets today,
    // in `headers` and in `headers_env`.
    let standard_webhooks = "\
rules:
  - name: a
    pattern: {type: [x]}
    targets:
      - webhook: http://h/
        headers: { webhook-version: '2', Webhook-Signature-Alg: x, X-Webhook-Ok: y }
        headers_env: { WEBHOOK-KEY: WEBHOOK_SECRET_K }
";
    let e = errs(&[("r.yaml", standard_webhooks)]);
    assert_eq!(e.len(), 3, "{e:#?}");
    assert!(
        e[0].starts_with("r.yaml:6:20: header `webhook-version` is in the Standard Webhooks namespace (`webhook-*`)"),
        "{e:#?}"
    );
    assert!(
        e[1].contains("`Webhook-Signature-Alg` is in the Standard Webhooks namespace"),
        "{e:#?}"
    );
    assert!(
        e[2].starts_with("r.yaml:7:24: header `WEBHOOK-KEY` is in the Standard"),
        "{e:#?}"
    );

    // A credential written in the file is refused, and says where it goes instead.
    let literal = "\
rules:
  - name: a
    pattern: {type: [x]}
    targets:
      - webhook: http://h/
        headers: { Authorization: Bearer abc, X-Version: 2 }
";
    let e = errs(&[("r.yaml", literal)]);
    assert_eq!(e.len(), 1, "{e:#?}");
    assert!(
        e[0].starts_with("r.yaml:6:20: header `Authorization` carries a credential")
            && e[0].contains("headers_env"),
        "{e:#?}"
    );
    let warn = "\
rules:
  - name: a
    pattern: {type: [x]}
    targets:
      - webhook: http://h/
        headers: { X-Api-Key: abc, X-Version: 2 }
        headers_env: { Authorization: ERP_AUTH }
";
    let (set, w) = ok(&[("r.yaml", warn)]);
    assert_eq!(w.len(), 1, "{}", lines(&w));
    assert_eq!(w[0].severity, Severity::Warning);
    assert!(
        w[0].to_string()
            .starts_with("r.yaml:6:20: warning: header `X-Api-Key` looks like a credential"),
        "{}",
        w[0]
    );
    match &set.targets["a-0"].kind {
        TargetKind::Webhook {
            headers,
            headers_env,
            ..
        } => {
            assert_eq!(headers["X-Version"], "2");
            assert_eq!(headers_env["Authorization"], "ERP_AUTH");
        }
        other => panic!("{other:?}"),
    }
    let bad = "\
rules:
  - name: a
    pattern: {type: [x]}
    targets:
      - webhook: http://h/
        headers: { X-Key: a }
        headers_env: { X-Key: K, Content-Length: L, X-Other: 1BAD }
";
    let e = errs(&[("r.yaml", bad)]);
    assert_eq!(e.len(), 3, "{e:#?}");
    assert!(e[0].contains("both `headers` and `headers_env`"), "{e:#?}");
    assert!(
        e[1].contains("`Content-Length` is set by the router"),
        "{e:#?}"
    );
    assert!(
        e[2].contains("`headers_env.X-Other` must name an environment variable"),
        "{e:#?}"
    );
}

#[test]
fn an_empty_policy_reference_says_what_to_write() {
    let src = "\
policies:
  fast: { timeout: 1s }
rules:
  - name: a
    pattern: {type: [x]}
    targets:
      - webhook: http://h/
        policy:
      - webhook: http://h/
        policy: fast
";
    one_err(
        &[("r.yaml", src)],
        "r.yaml:8:",
        "`policy` is empty: name a policy (defined: fast), or remove the key for the default policy",
    );
}

#[test]
fn integer_header_values_not_written_in_decimal_must_be_quoted() {
    // YAML reads these as numbers; sent as text they would not be what the file says.
    let src = "\
rules:
  - name: a
    pattern: {type: [x]}
    targets:
      - webhook: http://h/
        headers: { X-A: 0x10, X-B: 016, X-C: +5, X-D: -3, X-E: 16 }
      - webhook: http://h/
        headers:
          X-F: 0o20   # octal
          X-G: \"0x10\"
";
    let e = errs(&[("r.yaml", src)]);
    assert_eq!(e.len(), 4, "{e:#?}");
    assert!(
        e[0].starts_with(
            "r.yaml:6:25: header `X-A`: quote the value (\"…\"): `0x10` is the number 16"
        ),
        "{}",
        e[0]
    );
    assert!(e[1].starts_with("r.yaml:6:36: header `X-B`"), "{}", e[1]);
    assert!(e[2].contains("`+5` is the number 5"), "{}", e[2]);
    assert!(e[3].starts_with("r.yaml:9:16: header `X-F`"), "{}", e[3]);

    let fine = src
        .replace("0x10, X-B: 016, X-C: +5,", "\"0x10\",")
        .replace("0o20   # octal", "\"0o20\"");
    let (set, _) = ok(&[("r.yaml", &fine)]);
    match &set.targets["a-0"].kind {
        TargetKind::Webhook { headers, .. } => {
            assert_eq!(headers["X-A"], "0x10");
            assert_eq!(headers["X-D"], "-3");
            assert_eq!(headers["X-E"], "16");
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn nats_and_handler_names() {
    let t = |kind: &str, v: &str| {
        format!(
            "rules:\n  - name: a\n    pattern: {{type: [x]}}\n    targets:\n      - {kind}: \"{v}\"\n"
        )
    };
    one_err(
        &[("r.yaml", &t("nats", "orders.*"))],
        "r.yaml:5:15: ",
        "wildcard",
    );
    one_err(
        &[("r.yaml", &t("nats", "orders..x"))],
        "r.yaml:5:15: ",
        "empty token",
    );
    // The server's own namespaces: an event published to `$JS.API.STREAM.DELETE.X` would
    // delete a stream, one to `_INBOX.…` answer another client's request.
    for (subject, why) in [
        ("$JS.API.STREAM.DELETE.ORDERS", "reserved `$` namespace"),
        ("$KV.config.x", "reserved `$` namespace"),
        ("$SYS.REQ.SERVER.PING", "reserved `$` namespace"),
        ("_INBOX.abc", "reply inbox"),
    ] {
        one_err(&[("r.yaml", &t("nats", subject))], "r.yaml:5:15: ", why);
    }
    let (set, _) = ok(&[("r.yaml", &t("nats", "inbox._INBOX.x$"))]);
    assert!(
        set.targets.contains_key("a-0"),
        "only the first token decides"
    );
    one_err(
        &[("r.yaml", &t("handler", "has space"))],
        "r.yaml:5:18: ",
        "invalid handler name",
    );
    one_err(
        &[("r.yaml", &t("handler", ""))],
        "r.yaml:5:18: ",
        "invalid handler name",
    );
    // Names the upload API refuses (`PUT /v1/handlers/Billing.v2` is a 400): a rule naming
    // one would pass the check, and its events wait for an upload that can never happen.
    for name in [
        "Billing.v2",
        "billing.v2",
        "-billing",
        "a".repeat(65).as_str(),
    ] {
        one_err(
            &[("r.yaml", &t("handler", name))],
            "r.yaml:5:18: ",
            "handler names are 1 to 64 characters of a-z, 0-9, '_' and '-'",
        );
    }
    for name in ["billing-v2", "billing_v2", "7up", "a".repeat(64).as_str()] {
        assert!(
            crate::wasm::valid_handler_name(name),
            "{name}: a name the API takes"
        );
        ok(&[("r.yaml", &t("handler", name))]);
    }
}

#[test]
fn unknown_policy_name() {
    let src = "\
policies:
  slow: {timeout: 30s}
rules:
  - name: a
    pattern: {type: [x]}
    targets:
      - handler: h
        policy: fast
      - handler: h2
        policy: slow
";
    one_err(
        &[("r.yaml", src)],
        "r.yaml:8:17: ",
        "unknown policy `fast` (defined: slow)",
    );
}

#[test]
fn duplicate_policy_across_files() {
    let a = "policies:\n  p: {}\n";
    let b = "policies:\n  p: {timeout: 1s}\n";
    let e = errs(&[("a.yaml", a), ("b.yaml", b)]);
    assert!(
        e.iter()
            .any(|l| l == "b.yaml:2:3: duplicate policy `p` (first defined at a.yaml:2:3)"),
        "{e:#?}"
    );
}

#[test]
fn policy_type_errors_are_located() {
    let src = "\
policies:
  p:
    timeout: soon
    retry:
      max_attempts: many
      jitter: sometimes
    retry_budget: lots
    ordering: data.x
";
    let e = errs(&[("r.yaml", src)]);
    let e: Vec<&str> = e
        .iter()
        .map(String::as_str)
        .filter(|l| !l.contains("not used"))
        .collect();
    assert_eq!(e.len(), 5, "{e:#?}");
    assert!(
        e[0].starts_with("r.yaml:3:14: policy `p`: timeout: "),
        "{e:#?}"
    );
    assert!(
        e[1].starts_with("r.yaml:5:21: policy `p`: retry.max_attempts: invalid type"),
        "{e:#?}"
    );
    assert!(
        e[2].starts_with("r.yaml:6:15: policy `p`: retry.jitter: unknown variant"),
        "{e:#?}"
    );
    assert!(
        e[3].starts_with("r.yaml:7:19: policy `p`: retry_budget: invalid type"),
        "{e:#?}"
    );
    assert!(
        e[4].starts_with("r.yaml:8:15: policy `p`: ordering: ordering must be"),
        "{e:#?}"
    );
}

#[test]
fn policy_validation_problems_are_errors_at_the_field() {
    let src = "\
policies:
  p:
    retry:
      max_attempts: 0
      base_delay: 1m
      max_delay: 10s
    breaker: { failure_rate: 1.5 }
    throttle: { rate_per_sec: 0 }
    retry_budget: 2
rules:
  - name: a
    pattern: {type: [x]}
    targets: [{handler: h, policy: p}]
";
    let e = errs(&[("r.yaml", src)]);
    assert_eq!(
        e,
        vec![
            "r.yaml:4:21: policy `p`: retry.max_attempts must be at least 1",
            "r.yaml:5:19: policy `p`: retry.base_delay (1m) is greater than retry.max_delay (10s)",
            "r.yaml:7:30: policy `p`: breaker.failure_rate must be in (0, 1], not 1.5",
            "r.yaml:8:31: policy `p`: throttle.rate_per_sec must be greater than 0, not 0",
            "r.yaml:9:19: policy `p`: retry_budget must be in [0, 1], not 2",
        ]
    );
}

/// `rules check` refuses an absurd duration at its line: `open_for: 99999999999999d` passed
/// and panicked the delivery task when the breaker opened.
#[test]
fn policy_durations_past_ten_years_are_errors_at_the_field() {
    let src = "\
policies:
  p:
    breaker: { open_for: 99999999999999d }
    retry: { max_age: 3651d }
rules:
  - name: a
    pattern: {type: [x]}
    targets: [{handler: h, policy: p}]
";
    let e = errs(&[("r.yaml", src)]);
    assert_eq!(e.len(), 2, "{e:#?}");
    for (at, problem) in [
        ("r.yaml:4:", "retry.max_age must be at most 10 years"),
        ("r.yaml:3:", "breaker.open_for must be at most 10 years"),
    ] {
        assert!(
            e.iter().any(|x| x.starts_with(at) && x.contains(problem)),
            "{problem}: {e:#?}"
        );
    }
}

#[test]
fn worst_case_and_unused_policy_warnings() {
    let src = "\
policies:
  stubborn:
    retry: { max_attempts: 20 }
  spare: {}
rules:
  - name: a
    pattern: {type: [x]}
    targets: [{handler: h, policy: stubborn}]
";
    let (set, w) = ok(&[("r.yaml", src)]);
    let w: Vec<String> = w.iter().map(ToString::to_string).collect();
    assert_eq!(
        w,
        vec![
            "r.yaml:3:28: warning: worst case 20 attempts per event; more than 15 is a smell",
            "r.yaml:4:3: warning: policy `spare` is not used by any target",
        ]
    );
    assert_eq!(set.policies["stubborn"].retry.max_attempts, 20);
}

/// A batching webhook's `window` may hold each attempt back: the target's worst case (what
/// `config explain` and `/v1/targets` show) counts it; the same policy without a window, or
/// on a handler, does not.
#[test]
fn a_batching_webhooks_window_counts_in_its_worst_case() {
    let src = "\
rules:
  - name: a
    pattern: {type: [x]}
    targets:
      - webhook: http://127.0.0.1:9/a
        id: batched
        batch: { window: 1m }
      - webhook: http://127.0.0.1:9/b
        id: plain
      - nats: s
        id: bus
        policy: fast
policies:
  fast: {}
";
    let (set, _) = ok(&[("r.yaml", src)]);
    let batched = set.targets["batched"].worst_case();
    let plain = set.targets["plain"].worst_case();
    assert_eq!(plain.attempts, 5);
    assert_eq!(plain.time, Duration::from_secs(53));
    assert_eq!(batched.attempts, 5);
    assert_eq!(batched.time, Duration::from_secs(53 + 5 * 60));
    assert_eq!(
        batched.with_retry_after,
        plain.with_retry_after + Duration::from_secs(5 * 60)
    );
    // A NATS publish has no Retry-After.
    let bus = set.targets["bus"].worst_case();
    assert_eq!(bus.with_retry_after, bus.time);
}

/// An open breaker or a receiver's Retry-After stops the whole target, and max_age is checked
/// when an entry is leased: an entry that outlives it meanwhile goes to the DLQ when leasing
/// resumes. With `open_for: 30s` and `max_age: 3s` that was 30 s after acceptance while
/// `config explain` said 4 s; the worst case now says so.
#[test]
fn the_worst_case_says_how_long_a_stopped_target_holds_entries_past_max_age() {
    let src = "\
policies:
  tripping:
    timeout: 1s
    retry: { max_age: 3s, retry_after_max: 2s }
    breaker: { consecutive_failures: 1, open_for: 30s }
  short:
    retry: { max_age: 5s, retry_after_max: 30s }
  deaf:
    retry: { retry_after_max: 0s }
rules:
  - name: a
    pattern: {type: [x]}
    targets:
      - { webhook: http://127.0.0.1:9/a, id: tripping, policy: tripping }
      - { webhook: http://127.0.0.1:9/b, id: held, policy: short }
      - { webhook: http://127.0.0.1:9/c, id: deaf, policy: deaf }
      - { handler: h, id: handler, policy: short }
      - { nats: s, id: bus, policy: tripping }
";
    let (set, _) = ok(&[("r.yaml", src)]);
    let blocked = |id: &str| set.targets[id].worst_case().if_blocked;
    assert_eq!(
        set.targets["tripping"].worst_case().time,
        Duration::from_secs(4)
    );
    assert_eq!(blocked("tripping"), Some(Duration::from_secs(33)));
    assert_eq!(blocked("held"), Some(Duration::from_secs(35)));
    // Nothing stops a webhook that honours no Retry-After and has no breaker, nor a handler
    // (its retry delays are its event's own, within max_age).
    assert_eq!(blocked("deaf"), None);
    assert_eq!(blocked("handler"), None);
    assert_eq!(blocked("bus"), Some(Duration::from_secs(33)));
    // A webhook honours Retry-After up to retry_after_max (default 1 h) whatever its breaker.
    assert_eq!(
        ok(&[("r.yaml", &src.replace(", retry_after_max: 2s", ""))])
            .0
            .targets["tripping"]
            .worst_case()
            .if_blocked,
        Some(Duration::from_secs(3603))
    );
}

/// `max_attempts: 4294967295` passed the check (and `config explain` walked every attempt):
/// past 1000 it is an error at the value.
#[test]
fn max_attempts_past_the_cap_is_an_error_at_its_line() {
    let src = "\
policies:
  stubborn:
    retry:
      max_attempts: 4294967295
rules:
  - name: a
    pattern: {type: [x]}
    targets: [{handler: h, policy: stubborn}]
";
    one_err(
        &[("r.yaml", src)],
        "r.yaml:4:21: ",
        "policy `stubborn`: retry.max_attempts must be at most 1000, not 4294967295",
    );
}

/// Loads `files` as `rules check --handlers` does, with `known` the handlers there.
fn check_with_handlers(
    files: &[(&str, &str)],
    known: &[&str],
) -> Result<(RuleSet, Vec<Diagnostic>), Vec<Diagnostic>> {
    let inputs: Vec<super::SourceFile> = files
        .iter()
        .map(|(path, text)| super::SourceFile {
            display: (*path).to_string(),
            rel: (*path).to_string(),
            text: (*text).to_string(),
        })
        .collect();
    let known: std::collections::BTreeSet<String> = known.iter().map(|s| s.to_string()).collect();
    super::load(&inputs, Vec::new(), Some(&known), &[])
}

/// An unknown handler is an error at the target's `handler:` (it pointed at the rule's
/// line), found in the same pass as the set's other errors (the check ran only once
/// everything else loaded, so CI needed two rounds).
#[test]
fn handler_targets_are_checked_against_the_known_handlers() {
    let src = "\
rules:
  - name: a
    pattern: {type: [x]}
    targets: [{handler: enrich}, {webhook: \"http://127.0.0.1:9/h\"}]
  - name: b
    pattern: {type: [y]}
    targets:
      - id: inv
        handler: invocing
      - handler: enrich
        policy: missing
";
    let errors: Vec<String> = check_with_handlers(&[("r.yaml", src)], &["enrich", "invoice"])
        .expect_err("unknown handler and policy")
        .iter()
        .map(ToString::to_string)
        .collect();
    assert_eq!(
        errors,
        vec![
            "r.yaml:9:18: rule `b`, target `inv`: no handler named `invocing` (known: enrich, invoice)",
            "r.yaml:11:17: unknown policy `missing` (no policies are defined)",
        ]
    );
    let src_ok =
        "rules:\n  - name: a\n    pattern: {type: [x]}\n    targets: [{handler: enrich}]\n";
    assert!(check_with_handlers(&[("r.yaml", src_ok)], &["enrich"]).is_ok());
    let none = check_with_handlers(&[("r.yaml", src_ok)], &[]).expect_err("none known");
    assert!(none[0].message.ends_with("(known: none)"), "{none:?}");
    // Without a list of handlers, any name goes (teams upload them over the API).
    assert!(RuleSet::from_sources(&[("r.yaml", src_ok)]).is_ok());
}

/// A policy with a field that does not decode still has its other fields checked: the
/// check stopped at the decoding errors, and their validation problems came a round later.
#[test]
fn a_policy_field_that_does_not_decode_leaves_the_others_checked() {
    let src = "\
policies:
  p:
    timeout: soon
    retry: { max_attempts: 0, jitter: sometimes }
    throttle: { burst: 0, rate_per_sec: 5 }
rules:
  - name: a
    pattern: {type: [x]}
    targets: [{handler: h, policy: p}]
";
    let e = errs(&[("r.yaml", src)]);
    assert_eq!(e.len(), 4, "{e:#?}");
    assert!(
        e[0].starts_with("r.yaml:3:14: policy `p`: timeout: "),
        "{e:#?}"
    );
    assert_eq!(
        e[1],
        "r.yaml:4:28: policy `p`: retry.max_attempts must be at least 1"
    );
    assert!(
        e[2].starts_with("r.yaml:4:39: policy `p`: retry.jitter: unknown variant"),
        "{e:#?}"
    );
    assert_eq!(
        e[3],
        "r.yaml:5:24: policy `p`: throttle.burst must be at least 1"
    );
}

/// Policies and targets share settings through YAML anchors and merge keys, as they are
/// written in other tools' YAML: `<<: *base` was "unknown field `<<`".
#[test]
fn merge_keys_share_settings_between_policies_and_targets() {
    let src = "\
policies:
  base: &base
    timeout: 2s
    retry: { max_attempts: 3 }
  fast:
    <<: *base
    timeout: 1s
rules:
  - name: a
    pattern: {type: [x]}
    targets:
      - &hook { webhook: \"http://127.0.0.1:9/a\", policy: base, id: one }
      - { <<: *hook, id: two, policy: fast }
";
    let (set, _) = ok(&[("r.yaml", src)]);
    assert_eq!(set.policies["fast"].timeout, Duration::from_secs(1));
    assert_eq!(set.policies["fast"].retry.max_attempts, 3);
    assert_eq!(set.targets["two"].policy_name.as_deref(), Some("fast"));
    assert_eq!(set.targets["two"].kind, set.targets["one"].kind);
}

/// A rule without a name still has its targets checked, but gives them no derived ids: two
/// such rules said "duplicate target id `<unnamed>-0`" besides the missing names.
#[test]
fn a_rule_without_a_name_causes_no_duplicate_target_ids() {
    let src = "\
rules:
  - pattern: {type: [x]}
    targets: [{webhook: \"http://127.0.0.1:9/a\"}]
  - pattern: {type: [y]}
    targets: [{webhook: \"http://127.0.0.1:9/b\", policy: nope}]
";
    assert_eq!(
        errs(&[("r.yaml", src)]),
        vec![
            "r.yaml:2:5: rule is missing `name`",
            "r.yaml:4:5: rule is missing `name`",
            "r.yaml:5:57: unknown policy `nope` (no policies are defined)",
        ]
    );
}

#[test]
fn a_duration_in_months_is_valid_but_warned_about() {
    let src = "\
policies:
  slow:
    timeout: 5m
    retry: { max_age: 2M, max_delay: 1min }
rules:
  - name: a
    pattern: {type: [x]}
    targets: [{handler: h, policy: slow}]
";
    let (set, w) = ok(&[("r.yaml", src)]);
    let w: Vec<String> = w.iter().map(ToString::to_string).collect();
    assert_eq!(
        w,
        vec![
            "r.yaml:4:23: warning: `max_age: 2M` counts in months (`M`); minutes are `m` or `min`"
        ]
    );
    assert!(set.policies["slow"].retry.max_age > std::time::Duration::from_secs(50 * 86_400));
    for (text, months) in [
        ("5M", true),
        ("1 M 2d", true),
        ("1.5M", true),
        ("5m", false),
        ("3 min", false),
        ("2Ms", false),
        ("", false),
    ] {
        assert_eq!(super::uses_month_unit(text), months, "{text:?}");
    }
}

#[test]
fn pattern_errors_map_to_yaml_positions() {
    let src = "\
rules:
  - name: a
    pattern:
      type: order.paid
      data:
        total: [{ numerc: ['>', 0] }]
        ip: [{ cidr: 10.0.0.0/33 }]
        tags: []
    targets: [{handler: h}]
";
    let e = errs(&[("r.yaml", src)]);
    assert_eq!(e.len(), 4, "{e:#?}");
    assert!(
        e[0].starts_with("r.yaml:4:13: pattern /type: field `type` must be"),
        "{e:#?}"
    );
    assert!(
        e[1].starts_with("r.yaml:6:27: pattern /data/total/0/numerc: unknown operator `numerc`"),
        "{e:#?}"
    );
    assert!(
        e[2].starts_with("r.yaml:7:22: pattern /data/ip/0/cidr: cidr `10.0.0.0/33`"),
        "{e:#?}"
    );
    assert!(
        e[3].starts_with("r.yaml:8:15: pattern /data/tags: an empty matcher array"),
        "{e:#?}"
    );
}

#[test]
fn pattern_errors_map_to_json_positions() {
    let src = r#"{"rules": [
  {"name": "a",
   "pattern": {"detail": {"n": [{"numeric": [">", "zero"]}]}},
   "targets": [{"handler": "h"}]}
]}
"#;
    one_err(
        &[("r.json", src)],
        "r.json:3:51: ",
        "pattern /detail/n/0/numeric/1: `numeric`: the value after `>` must be a number",
    );
    // Pattern must be an object.
    one_err(
        &[(
            "r.yaml",
            "rules:\n  - name: a\n    pattern: [x]\n    targets: [{handler: h}]\n",
        )],
        "r.yaml:3:14: ",
        "pattern: a pattern must be a JSON object",
    );
}

#[test]
fn all_errors_across_files_are_reported_in_order() {
    let a = "rules:\n  - name: a\n    pattern: {type: x}\n    targets: [{handler: h}]\n";
    let b = "rules: 5\n";
    let c = "- just a list\n";
    let e = errs(&[("a.yaml", a), ("b.yaml", b), ("c.yaml", c)]);
    assert_eq!(e.len(), 3, "{e:#?}");
    assert!(e[0].starts_with("a.yaml:3:21: "));
    assert!(e[1].starts_with("b.yaml:1:8: `rules` must be a list"));
    assert!(e[2].starts_with("c.yaml:1:1: a rule file must be a mapping"));
}

#[test]
fn errors_come_with_warnings() {
    let src = "\
policies:
  stubborn: { retry: { max_attempts: 16 } }
rules:
  - name: a
    pattern: {type: x}
    targets: [{handler: h, policy: stubborn}]
";
    let d = RuleSet::from_sources(&[("r.yaml", src)]).expect_err("has an error");
    assert_eq!(d.len(), 2);
    assert_eq!(d[0].severity, Severity::Warning);
    assert_eq!(d[1].severity, Severity::Error);
}

#[test]
fn enabled_and_description_types() {
    let src = "rules:\n  - name: a\n    enabled: 'yes'\n    description: [x]\n    pattern: {type: [x]}\n    targets: [{handler: h}]\n";
    let e = errs(&[("r.yaml", src)]);
    assert_eq!(
        e,
        vec![
            "r.yaml:3:14: `enabled` must be true or false, not a string",
            "r.yaml:4:18: `description` must be a string, not a list",
        ]
    );
}

#[test]
fn target_spec_serde_shape() {
    let (set, _) = good();
    let v = serde_json::to_value(&set.targets["erp"]).expect("serializes");
    assert_eq!(v["kind"]["kind"], "webhook");
    assert_eq!(v["kind"]["url"], "http://127.0.0.1:9000/erp");
    assert_eq!(v["policy"]["timeout"], "2s");
    let back: crate::rules::TargetSpec = serde_json::from_value(v).expect("round trip");
    assert_eq!(back, set.targets["erp"]);
    let h = serde_json::to_value(&set.targets["paid-orders-to-invoicing-1"].kind).expect("ok");
    assert_eq!(h, json!({"kind": "handler", "name": "invoicing"}));
}

#[test]
fn diagnostic_display() {
    let d = Diagnostic {
        file: "f.yaml".into(),
        line: 3,
        col: 7,
        message: "boom".into(),
        severity: Severity::Error,
    };
    assert_eq!(d.to_string(), "f.yaml:3:7: boom");
    let w = Diagnostic {
        severity: Severity::Warning,
        ..d.clone()
    };
    assert_eq!(w.to_string(), "f.yaml:3:7: warning: boom");
    let nopos = Diagnostic {
        line: 0,
        col: 0,
        ..d
    };
    assert_eq!(nopos.to_string(), "f.yaml: boom");
}

#[test]
fn load_dir_walks_sorted_and_skips_hidden_and_other_files() {
    let dir = tempfile::tempdir().expect("tempdir");
    let root = dir.path();
    let write = |rel: &str, text: &str| {
        let p = root.join(rel);
        if let Some(parent) = p.parent() {
            std::fs::create_dir_all(parent).expect("mkdir");
        }
        std::fs::write(p, text).expect("write");
    };
    write("z/orders.yaml", ORDERS);
    write("policies.yml", POLICIES);
    write("m/shipping.json", SHIPPING_JSON);
    write(".hidden.yaml", "this: is: not: yaml: [");
    write(".git/config.yaml", "broken: [");
    write("README.md", "# not a rule file");
    write("notes.txt", "rules: 5");
    let (set, warnings) = match RuleSet::load_dir(root) {
        Ok(r) => r,
        Err(d) => panic!("{}", lines(&d)),
    };
    assert!(warnings.is_empty(), "{}", lines(&warnings));
    assert_eq!(
        set.files,
        vec!["m/shipping.json", "policies.yml", "z/orders.yaml"]
    );
    assert_eq!(set.rules[0].name, "shipping");
    assert_eq!(set.rules[0].file, "m/shipping.json");
    let v1 = set.version.clone();
    // Same content, same version; any change gives a new one.
    assert_eq!(RuleSet::load_dir(root).map(|r| r.0.version), Ok(v1.clone()));
    write(
        "z/orders.yaml",
        &ORDERS.replace("orders.paid", "orders.settled"),
    );
    let v2 = RuleSet::load_dir(root).map(|r| r.0.version);
    assert!(matches!(&v2, Ok(v) if *v != v1), "{v2:?}");

    // Errors name the file as found under the directory.
    write("z/bad.yaml", "rules:\n  - name: x\n");
    let d = RuleSet::load_dir(root).expect_err("bad file");
    let shown = root.join("z/bad.yaml").display().to_string();
    assert!(d.iter().all(|x| x.file == shown), "{}", lines(&d));
    assert_eq!(d.len(), 2);
    assert_eq!((d[0].line, d[0].col), (2, 5));
}

/// Linked rule files and directories are followed (a team's rules linked in; a Kubernetes
/// ConfigMap mount, whose files are links into a hidden `..data`); a link that leads nowhere is
/// an error for `rules check` and a warning for the router; a loop is left out with a warning.
/// Both used to be skipped without a word, `rules check` reporting fewer rules as ok.
#[cfg(unix)]
#[test]
fn load_dir_follows_symlinks_and_reports_dangling_ones() {
    use std::os::unix::fs::symlink;
    let dir = tempfile::tempdir().expect("tempdir");
    let root = dir.path().join("rules");
    let team = dir.path().join("team");
    std::fs::create_dir_all(&team).expect("mkdir");
    std::fs::write(team.join("orders.yaml"), ORDERS).expect("write");
    // A ConfigMap mount: `..2024_01_01` holds the files, `..data` links to it, and each
    // visible file links through `..data`.
    let stamp = root.join("..2024_01_01_00_00_00.1");
    std::fs::create_dir_all(&stamp).expect("mkdir");
    std::fs::write(stamp.join("policies.yml"), POLICIES).expect("write");
    symlink("..2024_01_01_00_00_00.1", root.join("..data")).expect("link");
    symlink("..data/policies.yml", root.join("policies.yml")).expect("link");
    symlink("../team", root.join("team")).expect("link");
    // A loop back to the root: left out, with a warning.
    symlink("../rules", team.join("up")).expect("link");
    let (set, warnings) = match RuleSet::check_dir(&root, None) {
        Ok(r) => r,
        Err(d) => panic!("{}", lines(&d)),
    };
    assert_eq!(set.files, vec!["policies.yml", "team/orders.yaml"]);
    assert_eq!(warnings.len(), 1, "{}", lines(&warnings));
    assert!(
        warnings[0].message.contains("symlink loop"),
        "{}",
        lines(&warnings)
    );

    symlink("../nowhere/shared.yaml", root.join("shared.yaml")).expect("link");
    symlink("../gone", root.join("gone")).expect("link");
    symlink("../nowhere/README.md", root.join("README.md")).expect("link");
    let d = RuleSet::check_dir(&root, None).expect_err("a dangling link fails the check");
    let dangling: Vec<_> = d
        .iter()
        .filter(|x| x.message.contains("leads nowhere"))
        .collect();
    assert_eq!(dangling.len(), 2, "{}", lines(&d));
    assert!(dangling.iter().all(|x| x.severity == Severity::Error));
    assert!(
        dangling
            .iter()
            .any(|x| x.file.ends_with("shared.yaml") && x.message.contains("nowhere/shared.yaml")),
        "{}",
        lines(&d)
    );
    let (set, warnings) = match RuleSet::load_dir(&root) {
        Ok(r) => r,
        Err(d) => panic!("{}", lines(&d)),
    };
    assert_eq!(set.files, vec!["policies.yml", "team/orders.yaml"]);
    assert_eq!(
        warnings
            .iter()
            .filter(|w| w.message.contains("leads nowhere"))
            .count(),
        2,
        "{}",
        lines(&warnings)
    );
}

#[test]
fn load_dir_missing_or_empty() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (set, w) = match RuleSet::load_dir(dir.path()) {
        Ok(r) => r,
        Err(d) => panic!("{}", lines(&d)),
    };
    assert!(set.rules.is_empty());
    assert_eq!(w.len(), 1);
    assert_eq!(w[0].severity, Severity::Warning);
    let gone = dir.path().join("nope");
    let d = RuleSet::load_dir(&gone).expect_err("missing dir");
    assert_eq!(d.len(), 1);
    assert!(d[0].message.starts_with("cannot read rules directory"));
    std::fs::write(dir.path().join("bin.yaml"), [0xff, 0xfe, 0x00]).expect("write");
    let d = RuleSet::load_dir(dir.path()).expect_err("not utf-8");
    assert!(d[0].message.contains("UTF-8"), "{}", lines(&d));
}

#[test]
fn compiled_matcher_agrees_with_interpreter_on_the_good_set() {
    let (set, _) = good();
    // Two enabled rule files' worth of rules; the disabled rule is not compiled in.
    assert_eq!(set.matcher_stats().rules, 3);
    let events = [
        json!({"type": "order.paid", "data": {"total": 10, "country": "DE"}}),
        json!({"type": "order.paid", "data": {"total": 10, "country": "XX"}}),
        json!({"type": "order.paid", "data": {"total": 0, "country": "FR"}}),
        json!({"type": "order.cancelled", "data": {"total": 3}}),
        json!({"type": "other", "data": [{"total": 1}]}),
        json!({}),
    ];
    for ev in &events {
        let want = set.matches_interpreted(ev);
        assert_eq!(set.matches(ev), want, "{ev}");
        let bytes = serde_json::to_vec(ev).expect("serialize");
        assert_eq!(set.matches_bytes(&bytes), Ok(want), "{ev}");
    }
    assert!(set.matches_bytes(b"{not json").is_err());
    // The disabled rule matches through neither path.
    let paid = json!({"type": "order.paid"});
    assert!(set.matches(&paid).iter().all(|m| m.rule != "disabled-rule"));
    assert!(
        set.matches_interpreted(&paid)
            .iter()
            .all(|m| m.rule != "disabled-rule")
    );
}

#[test]
fn over_cap_patterns_are_errors_at_the_pattern() {
    // 3^6 = 729 `$or` combinations: over the 256 cap.
    let mut src = String::from("rules:\n  - name: big\n    pattern:\n");
    for k in ["k1", "k2", "k3", "k4", "k5", "k6"] {
        src.push_str(&format!(
            "      {k}: {{ $or: [{{a: [1]}}, {{b: [1]}}, {{c: [1]}}] }}\n"
        ));
    }
    src.push_str("    targets: [{handler: h}]\n");
    one_err(
        &[("r.yaml", &src)],
        "r.yaml:4:7: pattern: pattern too complex",
        "more than 256 combinations",
    );
    // A disabled rule is checked too.
    let disabled = src.replace("  - name: big\n", "  - name: big\n    enabled: false\n");
    one_err(&[("r.yaml", &disabled)], "r.yaml:5:7: ", "more than 256");
}

/// Found by the `rules_load` fuzz target (input kept in fuzz/regressions/rules_load/): an
/// implicit null the YAML parser gives no position to was reported at line 0 (with column 1).
/// It now points at its key or parent.
#[test]
fn every_diagnostic_has_a_position() {
    let raw = include_bytes!(
        "../../../../fuzz/regressions/rules_load/crash-5b1b89161121ad7626ecbe6e7ae98cea0837db88"
    );
    let text = String::from_utf8_lossy(raw);
    let diags = crate::rules::RuleSet::from_sources(&[("fuzz.yaml", &text)])
        .expect_err("the input is refused");
    for d in &diags {
        assert!(
            d.line > 0 && d.col > 0,
            "a diagnostic without a position: {d}"
        );
    }
    let text = "rules:\n  - name: r\n    pattern: { type: [t] }\n    targets:\n      - webhook: http://127.0.0.1:9/x\n        id:\n";
    let diags =
        crate::rules::RuleSet::from_sources(&[("r.yaml", text)]).expect_err("a null id is refused");
    assert!(
        diags
            .iter()
            .any(|d| d.line == 6 && d.to_string().contains("`id` must be a string")),
        "{diags:?}"
    );
}

#[test]
fn webhook_batches_take_their_bounds_and_default_the_rest() {
    let src = "\
rules:
  - name: a
    pattern: {type: [x]}
    targets:
      - webhook: http://h/a
        batch: { max_events: 50 }
      - webhook: http://h/b
        batch: { max_bytes: 4096, window: 20ms }
      - webhook: http://h/c
";
    let (set, w) = ok(&[("r.yaml", src)]);
    assert!(w.is_empty(), "{w:#?}");
    let batch = |id: &str| set.targets[id].kind.batch().copied();
    assert_eq!(
        batch("a-0"),
        Some(WebhookBatch {
            max_events: 50,
            max_bytes: WebhookBatch::DEFAULT_MAX_BYTES,
            window: Duration::ZERO,
        })
    );
    assert_eq!(
        batch("a-1"),
        Some(WebhookBatch {
            max_events: WebhookBatch::DEFAULT_MAX_EVENTS,
            max_bytes: 4096,
            window: Duration::from_millis(20),
        })
    );
    assert_eq!(batch("a-2"), None);

    let bad = "\
rules:
  - name: a
    pattern: {type: [x]}
    targets:
      - handler: h
        batch: { max_events: 10 }
      - webhook: http://h/
        batch: { max_events: 0, max_bytes: 10, linger: 5ms }
      - webhook: http://h/
        batch: 100
      - webhook: http://h/
        batch: { window: 2m, max_events: 5 }
      - webhook: http://h/
        batch: { window: soon }
      - webhook: http://h/
        batch: { window: 20 }
";
    let e = errs(&[("r.yaml", bad)]);
    assert_eq!(e.len(), 8, "{e:#?}");
    assert!(
        e[0].starts_with("r.yaml:6:9: `batch` applies to webhook targets only"),
        "{e:#?}"
    );
    assert!(
        e[1].starts_with("r.yaml:8:30: `batch.max_events` must be an integer from 1 to 1000"),
        "{e:#?}"
    );
    assert!(
        e[2].starts_with("r.yaml:8:44: `batch.max_bytes` must be an integer from 1024"),
        "{e:#?}"
    );
    assert!(
        e[3].starts_with("r.yaml:8:48: unknown key `batch.linger`"),
        "{e:#?}"
    );
    assert!(
        e[4].starts_with("r.yaml:10:16: `batch` must be a mapping"),
        "{e:#?}"
    );
    assert!(
        e[5].starts_with(
            "r.yaml:12:26: `batch.window: 2m` is longer than the most a batch may wait, 1m"
        ),
        "{e:#?}"
    );
    assert!(
        e[6].starts_with("r.yaml:14:26: `batch.window: soon` is not a duration"),
        "{e:#?}"
    );
    assert!(
        e[7].starts_with("r.yaml:16:26: `batch.window` must be a duration such as `20ms`"),
        "{e:#?}"
    );
}

/// `rules check` refuses every header value the webhook target's HTTP client refuses at start
/// (it checked only CR and LF: a vertical tab, NUL or DEL passed the check and then kept the
/// target from starting).
#[test]
fn header_values_the_http_client_refuses_are_errors_with_their_position() {
    let src = "\
rules:
  - name: a
    pattern: {type: [x]}
    targets:
      - webhook: http://h/
        headers: { X-A: \"a\\vb\", X-B: \"a\\0b\", X-C: \"a\\x7Fb\", X-D: \"a\\tb é\" }
";
    let e = errs(&[("r.yaml", src)]);
    assert_eq!(e.len(), 3, "{e:#?}");
    assert!(
        e[0].starts_with("r.yaml:6:25: header `X-A` value contains the control character U+000B"),
        "{}",
        e[0]
    );
    assert!(
        e[1].contains("`X-B` value contains the control character U+0000"),
        "{}",
        e[1]
    );
    assert!(
        e[2].contains("`X-C` value contains the control character U+007F"),
        "{}",
        e[2]
    );
    // The same rule as the client's, for every ASCII character.
    for b in 0u8..=127 {
        let c = char::from(b);
        assert_eq!(
            super::not_in_header_value(c),
            http::HeaderValue::from_str(c.encode_utf8(&mut [0; 4])).is_err(),
            "{b:#04x}"
        );
    }
}

/// A rule file cannot name a secret the router's configuration uses (the NATS token and
/// password): its author chooses the URL, and would receive the router's credentials. Only
/// the running router knows its configuration; without one (`rules check`) the names load.
#[test]
fn a_rule_file_cannot_name_the_routers_own_secrets() {
    let src = "\
rules:
  - name: a
    pattern: {type: [x]}
    targets:
      - webhook: https://team.example/hook
        headers_env: { X-Copy: NATS_TOKEN, X-Ok: TEAM_KEY }
      - webhook: https://team.example/other
        secret_env: NATS_PASSWORD
";
    let inputs = [super::SourceFile {
        display: "r.yaml".to_string(),
        rel: "r.yaml".to_string(),
        text: src.to_string(),
    }];
    let operator = [
        ("nats.token_env", "NATS_TOKEN".to_string()),
        ("nats.password_env", "NATS_PASSWORD".to_string()),
    ];
    let e: Vec<String> = match super::load(&inputs, Vec::new(), None, &operator) {
        Ok(_) => panic!("the router's secrets were accepted"),
        Err(d) => d.iter().map(ToString::to_string).collect(),
    };
    assert_eq!(e.len(), 2, "{e:#?}");
    assert!(
        e[0].starts_with("r.yaml:6:32: `headers_env.X-Copy` names `NATS_TOKEN`, which the router's configuration uses (`nats.token_env`)"),
        "{e:#?}"
    );
    assert!(
        e[1].starts_with("r.yaml:8:21: `secret_env` names `NATS_PASSWORD`, which the router's configuration uses (`nats.password_env`)"),
        "{e:#?}"
    );
    ok(&[("r.yaml", src)]);
}

/// One secret name goes to one destination (URL origin): another team's rule file cannot
/// copy a target's signing secret or credential into a header to a URL of its choice. Paths
/// of one origin, however spelled, may share a secret.
#[test]
fn one_secret_goes_to_one_destination() {
    let erp = "\
rules:
  - name: erp
    pattern: {type: [x]}
    targets:
      - webhook: https://erp.example:8443/hook
        id: erp
        secret_env: WEBHOOK_SECRET_ERP
        headers_env: { Authorization: ERP_API_KEY }
      - webhook: HTTPS://ERP.example:8443/other
        id: erp-other
        secret_env: WEBHOOK_SECRET_ERP
        headers_env: { Authorization: WEBHOOK_SECRET_ERP_AUTH }
      - webhook: https://erp.example:8443
        id: erp-root
        headers_env: { Authorization: WEBHOOK_SECRET_ERP_AUTH }
";
    ok(&[("erp.yaml", erp)]);
    let team = "\
rules:
  - name: team
    pattern: {type: [y]}
    targets:
      - webhook: https://team.example/x
        id: team
        headers_env: { X-Copy-Erp: WEBHOOK_SECRET_ERP, X-Copy-File: ERP_API_KEY, X-Own: TEAM_KEY }
      - webhook: https://erp.example/hook
        id: other-port
        secret_env: WEBHOOK_SECRET_ERP
";
    let e = errs(&[("erp.yaml", erp), ("team.yaml", team)]);
    assert_eq!(e.len(), 3, "{e:#?}");
    assert!(
        e[0].starts_with("team.yaml:7:36: `headers_env.X-Copy-Erp` names `WEBHOOK_SECRET_ERP`, which target `erp` already sends to https://erp.example:8443 (`secret_env` at erp.yaml:7:21): a secret goes to one destination only, and target `team` sends to https://team.example"),
        "{e:#?}"
    );
    assert!(
        e[1].starts_with("team.yaml:7:69: `headers_env.X-Copy-File` names `ERP_API_KEY`, which target `erp` already sends to https://erp.example:8443 (`headers_env.Authorization` at erp.yaml:8:39)"),
        "{e:#?}"
    );
    // Another port of the same host is another destination.
    assert!(
        e[2].starts_with("team.yaml:10:21: `secret_env` names `WEBHOOK_SECRET_ERP`")
            && e[2].contains("target `other-port` sends to https://erp.example;"),
        "{e:#?}"
    );
}

/// Worst cases per dependency: targets delivering to one webhook origin (any path), one
/// handler or one subject are summed (attempts) and maxed (time); a dependency of one target
/// is left out (its own row says it all).
#[test]
fn targets_sharing_a_dependency_sum_their_worst_cases() {
    let (set, _) = ok(&[(
        "r.yaml",
        "\
policies:
  ten:
    retry: { max_attempts: 10, base_delay: 1s, max_delay: 1s, jitter: none, max_age: 1h }
rules:
  - name: r
    pattern: { type: [t] }
    targets:
      - { webhook: \"http://ERP.example:80/a\", id: a, policy: ten }
      - { webhook: \"http://erp.example/b?x=1\", id: b, policy: ten }
      - { webhook: \"http://erp.example:8080/a\", id: other-port }
      - { handler: inv, id: h1 }
  - name: r2
    pattern: { type: [u] }
    targets:
      - { webhook: \"http://erp.example/c\", id: c }
      - { handler: inv, id: h2 }
      - { nats: orders.paid, id: n1 }
",
    )]);
    let shared = set.shared_dependencies();
    let deps: Vec<(&str, Vec<&str>, u32)> = shared
        .iter()
        .map(|d| {
            (
                d.dependency.as_str(),
                d.targets.iter().map(String::as_str).collect(),
                d.attempts,
            )
        })
        .collect();
    let default_attempts = PolicyConfig::default().worst_case().0;
    assert_eq!(
        deps,
        [
            ("handler inv", vec!["h1", "h2"], 2 * default_attempts),
            (
                "webhook http://erp.example",
                vec!["a", "b", "c"],
                20 + default_attempts
            ),
        ]
    );
    let erp = &shared[1];
    assert_eq!(
        erp.rules.iter().map(String::as_str).collect::<Vec<_>>(),
        ["r", "r2"]
    );
    let longest = ["a", "b", "c"]
        .iter()
        .map(|id| set.targets[*id].worst_case().time)
        .max();
    assert_eq!(Some(erp.time), longest);
}

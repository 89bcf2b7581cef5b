//! Tests of the compiled matcher: it must give the interpreter's answers (shared case table,
//! property tests over random patterns and events, single and many at once), read raw bytes
//! like serde_json, enforce its caps, and do work independent of the number of rules.

use proptest::prelude::*;
use serde_json::{Value, json};

use super::*;
use crate::rules::cases::CASES;

fn parse(s: &str) -> Value {
    match serde_json::from_str(s) {
        Ok(v) => v,
        Err(e) => panic!("bad JSON in test: {s}: {e}"),
    }
}

fn compile(p: &Value) -> Pattern {
    match Pattern::compile(p) {
        Ok(p) => p,
        Err(e) => panic!("pattern {p} does not compile: {e:?}"),
    }
}

fn build(patterns: &[Pattern]) -> CompiledMatcher {
    let refs: Vec<(usize, &Pattern)> = patterns.iter().enumerate().collect();
    match CompiledMatcher::build(&refs) {
        Ok(m) => m,
        Err(e) => panic!("build failed: {e:?}"),
    }
}

/// What the interpreter says for a set of patterns.
fn oracle(patterns: &[Pattern], event: &Value) -> Vec<usize> {
    patterns
        .iter()
        .enumerate()
        .filter(|(_, p)| p.matches(event))
        .map(|(i, _)| i)
        .collect()
}

#[test]
fn case_table_agrees_with_interpreter() {
    assert!(CASES.len() >= 200, "{} cases", CASES.len());
    let mut failures = Vec::new();
    for (i, (p, e, want)) in CASES.iter().enumerate() {
        let pattern = compile(&parse(p));
        let event = parse(e);
        let interpreted = pattern.matches(&event);
        let m = build(std::slice::from_ref(&pattern));
        let compiled = m.matches(&event) == vec![0];
        if m.matches_bytes_trusted(e.as_bytes()) != Ok(if *want { vec![0] } else { vec![] }) {
            failures.push(format!("#{i} {e}: matches_bytes_trusted differs"));
        }
        let from_bytes = match m.matches_bytes(e.as_bytes()) {
            Ok(r) => r == vec![0],
            Err(err) => {
                failures.push(format!("#{i} {e}: matches_bytes error {err}"));
                continue;
            }
        };
        if interpreted != *want || compiled != *want || from_bytes != *want {
            failures.push(format!(
                "#{i} {p} vs {e}: want {want}, interpreter {interpreted}, automaton {compiled}, bytes {from_bytes}"
            ));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn whole_table_as_one_rule_set() {
    // Every pattern of the table at once, against every event of the table.
    let patterns: Vec<Pattern> = CASES.iter().map(|(p, _, _)| compile(&parse(p))).collect();
    let m = build(&patterns);
    let mut failures = Vec::new();
    for (i, (_, e, _)) in CASES.iter().enumerate() {
        let event = parse(e);
        let want = oracle(&patterns, &event);
        let got = m.matches(&event);
        let got_bytes = m.matches_bytes(e.as_bytes());
        let got_trusted = m.matches_bytes_trusted(e.as_bytes());
        if got != want || got_bytes.as_ref() != Ok(&want) || got_trusted.as_ref() != Ok(&want) {
            failures.push(format!(
                "event #{i} {e}: want {want:?}, got {got:?}, bytes {got_bytes:?}"
            ));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
    let stats = m.stats();
    assert_eq!(stats.rules, patterns.len());
    assert!(stats.sub_patterns >= patterns.len());
    assert!(stats.states > stats.sub_patterns / 2 && stats.fields > 10);
}

/// The case table's events as CloudEvents (core attributes must be strings where present;
/// `id`, `source` and `type` get a value when missing).
fn as_cloud_event(v: &Value) -> Option<crate::event::CloudEvent> {
    let Value::Object(m) = v else { return None };
    let text = |k: &str| -> Result<Option<String>, ()> {
        match m.get(k) {
            None => Ok(None),
            Some(Value::String(s)) => Ok(Some(s.clone())),
            Some(_) => Err(()),
        }
    };
    if m.get("specversion").is_some_and(|s| s != "1.0") {
        return None;
    }
    let extensions = m
        .iter()
        .filter(|(k, _)| !crate::event::CORE_ATTRIBUTES.contains(&k.as_str()))
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    Some(crate::event::CloudEvent {
        id: text("id").ok()?.unwrap_or_else(|| "id-1".into()),
        source: text("source").ok()?.unwrap_or_else(|| "/src".into()),
        ty: text("type").ok()?.unwrap_or_else(|| "t".into()),
        subject: text("subject").ok()?,
        time: text("time").ok()?,
        datacontenttype: text("datacontenttype").ok()?,
        dataschema: text("dataschema").ok()?,
        data: m.get("data").cloned().map(crate::event::Data::from),
        data_base64: text("data_base64").ok()?,
        extensions,
    })
}

#[test]
fn matching_a_cloud_event_in_place_agrees_with_its_structured_json() {
    let patterns: Vec<Pattern> = CASES.iter().map(|(p, _, _)| compile(&parse(p))).collect();
    let m = build(&patterns);
    let mut checked = 0;
    let mut failures = Vec::new();
    for (i, (_, e, _)) in CASES.iter().enumerate() {
        let Some(ev) = as_cloud_event(&parse(e)) else {
            continue;
        };
        checked += 1;
        let want = m.matches(&ev.to_json());
        let got = m.matches_event(&ev);
        if got != want {
            failures.push(format!("event #{i} {e}: want {want:?}, got {got:?}"));
        }
    }
    assert!(checked > 100, "only {checked} case events are CloudEvents");
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn empty_matcher_matches_nothing() {
    let e = CompiledMatcher::empty();
    assert!(e.matches(&json!({"type": "a"})).is_empty());
    assert_eq!(
        e.stats(),
        MatcherStats {
            states: 1,
            ..MatcherStats::default()
        }
    );
    let m = build(&[]);
    assert!(m.matches(&json!({"type": "a"})).is_empty());
    assert_eq!(m.matches_bytes(br#"{"type":"a"}"#), Ok(vec![]));
    assert_eq!(m.stats().states, 1);
}

#[test]
fn rule_indices_are_passed_through_sorted_and_deduplicated() {
    let a = compile(&json!({"$or": [{"type": ["a"]}, {"source": ["s"]}]}));
    let b = compile(&json!({"type": [{"prefix": "a"}]}));
    let m = match CompiledMatcher::build(&[(7, &a), (3, &b), (7, &b)]) {
        Ok(m) => m,
        Err(e) => panic!("{e:?}"),
    };
    assert_eq!(m.matches(&json!({"type": "a", "source": "s"})), vec![3, 7]);
    assert_eq!(m.matches(&json!({"source": "s"})), vec![7]);
}

#[test]
fn shared_prefixes_share_states() {
    let ps: Vec<Pattern> = (0..100)
        .map(|i| compile(&json!({"kind": ["t"], "source": [format!("s{i}")]})))
        .collect();
    let m = build(&ps);
    // Tests are walked in path order: start -(kind=t)-> one state -(source=s_i)-> 100
    // accepting states.
    assert_eq!(m.stats().states, 102);
    assert_eq!(m.stats().transitions, 2);
    assert_eq!(m.stats().fields, 2);
    assert_eq!(m.fields(), vec!["kind".to_string(), "source".to_string()]);
    assert_eq!(m.matches(&json!({"kind": "t", "source": "s42"})), vec![42]);
}

#[test]
fn fields_show_aliases() {
    let p = compile(&json!({"data": {"o": {"a": [1]}, "$or": [{"o": {"b": [2]}}, {"z": [0]}]}}));
    let m = build(&[p]);
    assert_eq!(
        m.fields(),
        vec![
            "data.o.a".to_string(),
            "data.o#1.b".to_string(),
            "data.z".to_string()
        ]
    );
}

#[test]
fn or_expansion_cap_is_enforced() {
    // 3 × 3 × 3 × 3 × 3 × 3 = 729 combinations > 256.
    let alts = json!([{"a": [1]}, {"b": [1]}, {"c": [1]}]);
    let mut p = serde_json::Map::new();
    for k in ["k1", "k2", "k3", "k4", "k5", "k6"] {
        p.insert(k.to_string(), json!({"$or": alts.clone()}));
    }
    let big = compile(&Value::Object(p));
    let ok = compile(&json!({"type": ["a"]}));
    let err = match CompiledMatcher::build(&[(0, &ok), (1, &big)]) {
        Ok(_) => panic!("over-cap rule accepted"),
        Err(e) => e,
    };
    assert_eq!(err.len(), 1);
    assert_eq!(err[0].0, 1);
    assert!(err[0].1.contains("256"), "{}", err[0].1);
    // 3^5 = 243 is fine.
    let mut p = serde_json::Map::new();
    for k in ["k1", "k2", "k3", "k4", "k5"] {
        p.insert(k.to_string(), json!({"$or": alts.clone()}));
    }
    let fine = compile(&Value::Object(p));
    let m = build(&[fine]);
    assert_eq!(m.stats().sub_patterns, 243);
    let ev =
        json!({"k1": {"a": 1}, "k2": {"c": 1}, "k3": {"b": 1}, "k4": {"a": 1}, "k5": {"c": 1}});
    assert_eq!(m.matches(&ev), vec![0]);
}

#[test]
fn tests_per_rule_cap_is_enforced() {
    // 16 fields plus a 256-way `$or`: 256 conjunctions of 17 tests = 4,352 > 4,096.
    let mut p = serde_json::Map::new();
    for i in 0..16 {
        p.insert(format!("f{i}"), json!([i]));
    }
    p.insert(
        "$or".to_string(),
        Value::Array((0..256).map(|i| json!({ format!("g{i}"): [i] })).collect()),
    );
    let heavy = compile(&Value::Object(p));
    let err = match CompiledMatcher::build(&[(5, &heavy)]) {
        Ok(_) => panic!("over-cap rule accepted"),
        Err(e) => e,
    };
    assert_eq!(err[0].0, 5);
    assert!(err[0].1.contains("field tests"), "{}", err[0].1);
}

#[test]
fn total_state_cap_is_enforced() {
    // Long prefixes weigh their length; 9 rules of 250k bytes each exceed 4M.
    let long = "x".repeat(250_000);
    let ps: Vec<Pattern> = (0..9)
        .map(|i| compile(&json!({ format!("k{i}"): [{"prefix": long}] })))
        .collect();
    let refs: Vec<(usize, &Pattern)> = ps.iter().enumerate().collect();
    let err = match CompiledMatcher::build(&refs) {
        Ok(_) => panic!("over-cap set accepted"),
        Err(e) => e,
    };
    assert!(
        err.iter()
            .all(|(i, m)| *i >= 7 && m.contains("rule set too large")),
        "{err:?}"
    );
}

/// The audit's set: 2,000 rules `{"data":{"s":[{"wildcard":"*x*y*z*q"}]}}` with distinct
/// letter triples passed every cap, and a 10 KB string without `q` took 8.6 s to match (the
/// active set held every half-matched star). The set is now refused, naming each rule and the
/// field; a few such rules, and wildcards spread over states an event cannot all reach, pass.
#[test]
fn wildcard_work_cap_is_enforced_per_field() {
    let letters: Vec<char> = ('a'..='p').collect();
    let mut triples = Vec::new();
    for x in &letters {
        for y in &letters {
            for z in &letters {
                triples.push(format!("*{x}*{y}*{z}*q"));
            }
        }
    }
    let rule = |w: &str| compile(&json!({"data": {"s": [{"wildcard": w}]}}));
    let ps: Vec<Pattern> = triples.iter().take(2000).map(|w| rule(w)).collect();
    // A rule without wildcards in the same set is not named.
    let mut with_plain = ps.clone();
    with_plain.push(compile(&json!({"data": {"s": ["plain"]}})));
    let refs: Vec<(usize, &Pattern)> = with_plain.iter().enumerate().collect();
    let err = match CompiledMatcher::build(&refs) {
        Ok(m) => panic!("accepted, {} steps per byte", m.cost_per_byte()),
        Err(e) => e,
    };
    assert_eq!(
        err.iter().map(|(i, _)| *i).collect::<Vec<_>>(),
        (0..2000).collect::<Vec<_>>()
    );
    assert!(
        err[0].1.contains("`data.s`")
            && err[0].1.contains("1999 other rule(s)")
            && err[0]
                .1
                .contains(&format!("limit is {MAX_WILDCARD_ACTIVE_STATES}")),
        "{}",
        err[0].1
    );
    // An `anything-but` wildcard list is run the same way.
    let ab: Vec<Pattern> = triples
        .chunks(8)
        .take(250)
        .map(|ws| compile(&json!({"data": {"s": [{"anything-but": {"wildcard": ws}}]}})))
        .collect();
    let refs: Vec<(usize, &Pattern)> = ab.iter().enumerate().collect();
    assert!(CompiledMatcher::build(&refs).is_err());
    // Twenty of them are fine, and so is each behind its own exact test: an event reaches
    // one `type`, so one small NFA.
    let few: Vec<Pattern> = triples.iter().take(20).map(|w| rule(w)).collect();
    let m = build(&few);
    assert!(m.cost_per_byte() <= MAX_WILDCARD_ACTIVE_STATES + 1);
    let separate: Vec<Pattern> = triples
        .iter()
        .take(2000)
        .enumerate()
        .map(|(i, w)| {
            compile(&json!({"type": [format!("t{i}")], "data": {"s": [{"wildcard": w}]}}))
        })
        .collect();
    let m = build(&separate);
    assert!(m.cost_per_byte() < 16, "{}", m.cost_per_byte());
    // What a value costs is then bounded by its length times the bound.
    let value: String = letters.iter().cycle().take(10_000).collect();
    let mut steps = 0;
    let event = json!({"type": "t5", "data": {"s": value}});
    assert!(m.matches_counting(&event, &mut steps).is_empty());
    assert!(steps <= 10_000 * m.cost_per_byte() + 100, "{steps}");
}

#[test]
fn bytes_duplicate_keys_follow_serde_json() {
    let p = compile(&json!({"type": ["b"]}));
    let m = build(&[p]);
    // serde_json keeps the last occurrence.
    assert_eq!(m.matches_bytes(br#"{"type":"a","type":"b"}"#), Ok(vec![0]));
    assert_eq!(m.matches_bytes(br#"{"type":"b","type":"a"}"#), Ok(vec![]));
    // Duplicates of keys no pattern mentions do not matter.
    assert_eq!(m.matches_bytes(br#"{"x":1,"type":"b","x":2}"#), Ok(vec![0]));
}

#[test]
fn bytes_errors() {
    let p = compile(&json!({"data": {"n": [1]}}));
    let m = build(&[p]);
    for bad in [
        &b""[..],
        b"{",
        b"{\"data\":{\"n\":1}",
        b"{\"data\":{\"n\":01}}",
        b"{\"data\":{\"n\":1.}}",
        b"{\"data\":{\"n\":\"\\ud800\"}}",
        b"{\"data\":{\"n\":\"\x01\"}}",
        b"{\"data\":{\"n\":\"\xff\"}}",
        b"{\"data\":{\"n\":1e400}}",
        b"{\"data\":{\"n\":tru}}",
        b"{\"other\":[1,2}}",
        b"{\"other\":\"unterminated}",
        b"{\"data\":{\"n\":1}} x",
        b"{\"data\" {\"n\":1}}",
        b"[1,]",
    ] {
        let want = serde_json::from_slice::<Value>(bad);
        assert!(
            want.is_err(),
            "{:?} is valid JSON",
            String::from_utf8_lossy(bad)
        );
        assert!(
            m.matches_bytes(bad).is_err(),
            "accepted {:?}",
            String::from_utf8_lossy(bad)
        );
    }
    // Nesting: serde_json accepts 127 levels and refuses 128, in mentioned or skipped parts.
    for depth in [127usize, 128] {
        for prefix in ["{\"data\":", "{\"other\":"] {
            let mut s = prefix.to_string();
            s.push_str(&"[".repeat(depth - 1));
            s.push_str(&"]".repeat(depth - 1));
            s.push('}');
            let want = serde_json::from_str::<Value>(&s).is_ok();
            assert_eq!(
                m.matches_bytes(s.as_bytes()).is_ok(),
                want,
                "{prefix} depth {depth}"
            );
        }
    }
}

#[test]
fn bytes_numbers_have_serde_json_representation() {
    let p = compile(&json!({"n": [{"exists": true}]}));
    let m = build(&[p]);
    for tok in [
        "0",
        "-0",
        "1",
        "-1",
        "18446744073709551615",
        "18446744073709551616",
        "-9223372036854775808",
        "-9223372036854775809",
        "1.5",
        "-0.0",
        "1e2",
        "1E+2",
        "1e-2",
        "123456789012345678901234567890",
        "0.1234567890123456789",
        "-122.40490679163064",
        "2.2250738585072011e-308",
        "1e-400",
        "4.9e-324",
    ] {
        let doc = format!("{{\"n\":{tok}}}");
        let v: Value = parse(&doc);
        let Some(want) = v.get("n").and_then(Value::as_number).map(Num::from_number) else {
            panic!("{tok}");
        };
        let mut flat = Flat::default();
        match flatten_bytes(&m.trie, doc.as_bytes(), &mut flat, false) {
            Ok(()) => {}
            Err(e) => panic!("{tok}: {e:?}"),
        }
        let got = &flat.entries[0].value;
        match (got, want) {
            (value_matchers::Scalar::Num(Num::Float(a)), Num::Float(b)) => {
                assert_eq!(a.to_bits(), b.to_bits(), "{tok}")
            }
            (value_matchers::Scalar::Num(a), b) => assert_eq!(*a, b, "{tok}"),
            (other, _) => panic!("{tok}: {other:?}"),
        }
    }
}

use self::value_matchers::Num;

#[test]
fn matcher_is_send_and_sync() {
    fn check<T: Send + Sync>() {}
    check::<CompiledMatcher>();
}

#[test]
fn array_fanout_does_not_explode() {
    // Three independent arrays of 60 matching elements each: without dropping pins that no
    // later test needs this would be 60^3 partial matches.
    let p = compile(&json!({"a": {"x": [1]}, "b": {"y": [1]}, "c": {"z": [1]}}));
    let m = build(&[p]);
    let many = |k: &str| Value::Array((0..60).map(|_| json!({ k: 1 })).collect());
    let ev = json!({"a": many("x"), "b": many("y"), "c": many("z")});
    let mut steps = 0;
    assert_eq!(m.matches_counting(&ev, &mut steps), vec![0]);
    assert!(steps < 2_000, "{steps} steps");
    // Repeated equal values in leaf arrays collapse too.
    let p = compile(&json!({"a": [1], "b": [1], "c": [1], "d": [1]}));
    let m = build(&[p]);
    let ones = Value::Array(vec![json!(1); 50]);
    let ev = json!({"a": ones.clone(), "b": ones.clone(), "c": ones.clone(), "d": ones});
    let mut steps = 0;
    assert_eq!(m.matches_counting(&ev, &mut steps), vec![0]);
    assert!(steps < 1_000, "{steps} steps");
}

/// `exists: false` on a different field per rule under an array of objects, behind a test
/// that fails for the event: the flattened event and the search must not grow with the rules
/// (the flattener used to emit an absent entry per rule per element lacking its field).
#[test]
fn absence_under_arrays_costs_nothing_per_rule() {
    let items: Vec<Value> = (0..50).map(|i| json!({"sku": i, "f3": 1})).collect();
    let ev = json!({"source": "/s", "data": {"items": items}});
    let bytes = serde_json::to_vec(&ev).expect("serialize");
    let mut work = Vec::new();
    for rules in [10, 1_000] {
        let ps: Vec<Pattern> = (0..rules)
            .map(|i| {
                compile(&json!({
                    "source": [format!("nope-{i}")],
                    "data": {"items": {format!("f{i}"): [{"exists": false}]}}
                }))
            })
            .collect();
        let m = build(&ps);
        let mut steps = 0;
        assert_eq!(m.matches_counting(&ev, &mut steps), Vec::<usize>::new());
        let mut from_value = Flat::default();
        flatten_value(&m.trie, &ev, &mut from_value);
        let mut from_bytes = Flat::default();
        assert!(flatten_bytes(&m.trie, &bytes, &mut from_bytes, false).is_ok());
        work.push((
            steps,
            from_value.entries.len(),
            from_bytes.entries.len(),
            from_value.trails.len(),
        ));
    }
    assert_eq!(
        work[0], work[1],
        "(steps, entries from a value, entries from bytes, trail pairs) at 10 and 1,000 rules"
    );
}

// ---------------------------------------------------------------------------------------
// Property tests: random patterns and events from a small vocabulary, so that matches happen.

const KEYS: &[&str] = &["a", "b", "c"];

fn scalar() -> impl Strategy<Value = Value> {
    prop_oneof![
        Just(json!("x")),
        Just(json!("y")),
        Just(json!("xy")),
        Just(json!("X")),
        Just(json!("")),
        Just(json!("10.1.2.3")),
        Just(json!("::1")),
        Just(json!(0)),
        Just(json!(1)),
        Just(json!(-1)),
        Just(json!(1.5)),
        Just(json!(300)),
        Just(json!(300.0)),
        Just(json!(true)),
        Just(json!(false)),
        Just(Value::Null),
    ]
}

fn event() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        3 => scalar(),
        1 => prop::collection::vec(scalar(), 1..4).prop_map(Value::Array),
    ];
    leaf.prop_recursive(4, 40, 4, |inner| {
        prop_oneof![
            1 => prop::collection::vec(inner.clone(), 0..4).prop_map(Value::Array),
            3 => prop::collection::btree_map(prop::sample::select(KEYS), inner, 1..5).prop_map(|m| {
                Value::Object(m.into_iter().map(|(k, v)| (k.to_string(), v)).collect())
            }),
        ]
    })
}

fn wildcard_text() -> impl Strategy<Value = String> {
    "[xy*]{0,4}".prop_filter("valid wildcard", |w| !w.contains("**"))
}

fn matcher() -> impl Strategy<Value = Value> {
    prop_oneof![
        scalar(),
        "[xyX]{0,2}".prop_map(|s| json!({"prefix": s})),
        "[xyX]{0,2}".prop_map(|s| json!({"prefix": {"equals-ignore-case": s}})),
        "[xyX]{0,2}".prop_map(|s| json!({"suffix": s})),
        "[xyX]{0,2}".prop_map(|s| json!({"suffix": {"equals-ignore-case": s}})),
        "[xyX]{0,2}".prop_map(|s| json!({"equals-ignore-case": s})),
        wildcard_text().prop_map(|w| json!({"wildcard": w})),
        "[xy]{0,2}".prop_map(|s| json!({"anything-but": s})),
        prop::collection::vec("[xy]{0,2}", 1..3).prop_map(|l| json!({"anything-but": l})),
        prop::collection::vec(prop::sample::select(vec![0, 1, 300]), 1..3)
            .prop_map(|l| json!({"anything-but": l})),
        "[xy]{1,2}".prop_map(|s| json!({"anything-but": {"prefix": s}})),
        "[xy]{1,2}".prop_map(|s| json!({"anything-but": {"suffix": s}})),
        "[xyX]{0,2}".prop_map(|s| json!({"anything-but": {"equals-ignore-case": s}})),
        prop::collection::vec(wildcard_text(), 1..3)
            .prop_map(|l| json!({"anything-but": {"wildcard": l}})),
        (
            prop::sample::select(vec!["=", "<", "<=", ">", ">="]),
            -2i32..400
        )
            .prop_map(|(op, n)| json!({"numeric": [op, n]})),
        (-2i32..3, 0i32..400, any::<bool>(), any::<bool>()).prop_map(|(lo, w, li, hi)| {
            let (lo, hi_v) = (f64::from(lo), f64::from(lo) + f64::from(w) + 0.5);
            json!({"numeric": [if li { ">=" } else { ">" }, lo, if hi { "<=" } else { "<" }, hi_v]})
        }),
        any::<bool>().prop_map(|b| json!({ "exists": b })),
        prop::sample::select(vec![
            "10.0.0.0/8",
            "10.1.2.3/32",
            "::/0",
            "::1/128",
            "0.0.0.0/0"
        ])
        .prop_map(|c| json!({ "cidr": c })),
    ]
}

fn pattern() -> impl Strategy<Value = Value> {
    let leaf = prop::collection::vec(matcher(), 1..3)
        .prop_map(Value::Array)
        .boxed();
    let object = |field: BoxedStrategy<Value>| {
        prop::collection::btree_map(prop::sample::select(KEYS), field, 1..3)
            .prop_map(|m| Value::Object(m.into_iter().map(|(k, v)| (k.to_string(), v)).collect()))
    };
    let level1 = object(leaf.clone()).boxed();
    let field2 = prop_oneof![3 => leaf.clone(), 1 => level1.clone()].boxed();
    let level2 = object(field2).boxed();
    let with_or = |base: BoxedStrategy<Value>, alt: BoxedStrategy<Value>| {
        (
            base,
            prop::option::weighted(0.3, prop::collection::vec(alt, 2..4)),
        )
            .prop_map(|(mut b, or)| {
                if let (Value::Object(m), Some(alts)) = (&mut b, or) {
                    m.insert("$or".to_string(), Value::Array(alts));
                }
                b
            })
    };
    let level2_or = with_or(level2.clone(), level1.clone()).boxed();
    let field3 = prop_oneof![3 => leaf, 2 => level2_or].boxed();
    with_or(object(field3).boxed(), level2)
}

fn compiled(p: &Value) -> Option<Pattern> {
    Pattern::compile(p).ok()
}

const SCALARS: &[&str] = &[
    r#""x""#,
    r#""y""#,
    r#""xy""#,
    r#""X""#,
    r#""""#,
    r#""10.1.2.3""#,
    r#""::1""#,
    "0",
    "1",
    "-1",
    "1.5",
    "300",
    "300.0",
    "true",
    "false",
    "null",
];

/// An event shaped after pattern `p` (its keys present, values from the vocabulary, objects
/// sometimes inside arrays with other elements, fields sometimes missing), so that whether
/// it matches depends on the values and on array consistency rather than on luck.
fn guided_event(p: &Value, r: &mut Rng) -> Value {
    let scalar = |r: &mut Rng| parse(SCALARS[r.below(SCALARS.len() as u64) as usize]);
    let Value::Object(m) = p else {
        return scalar(r);
    };
    let mut out = serde_json::Map::new();
    let fill = |m: &serde_json::Map<String, Value>,
                out: &mut serde_json::Map<String, Value>,
                r: &mut Rng| {
        for (k, v) in m {
            if k == "$or" || r.below(8) == 0 {
                continue;
            }
            let val = match v {
                Value::Object(_) => {
                    let inner = guided_event(v, r);
                    match r.below(3) {
                        0 => inner,
                        1 => Value::Array(vec![guided_event(v, r), inner]),
                        _ => Value::Array(vec![inner, scalar(r), guided_event(v, r)]),
                    }
                }
                _ => match r.below(3) {
                    0 => Value::Array(vec![scalar(r), scalar(r)]),
                    _ => scalar(r),
                },
            };
            out.insert(k.clone(), val);
        }
    };
    fill(m, &mut out, r);
    if let Some(Value::Array(alts)) = m.get("$or")
        && let Some(Value::Object(alt)) = alts.get(r.below(alts.len() as u64) as usize)
    {
        fill(alt, &mut out, r);
    }
    Value::Object(out)
}

proptest! {
    // 512 cases by default; PROPTEST_CASES overrides (for longer soak runs).
    #![proptest_config(ProptestConfig {
        cases: std::env::var("PROPTEST_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(512),
        ..ProptestConfig::default()
    })]

    #[test]
    fn single_pattern_agrees_with_interpreter(p in pattern(), mut events in prop::collection::vec(event(), 1..4), seed in any::<u64>()) {
        let mut r = Rng(seed | 1);
        events.extend((0..4).map(|_| guided_event(&p, &mut r)));
        let Some(p) = compiled(&p) else { return Ok(()); };
        let m = build(std::slice::from_ref(&p));
        for e in &events {
            let want = if p.matches(e) { vec![0] } else { vec![] };
            prop_assert_eq!(&m.matches(e), &want, "event {}", e);
            let bytes = serde_json::to_vec(e).expect("serialize");
            prop_assert_eq!(m.matches_bytes_trusted(&bytes), Ok(want.clone()), "trusted bytes {}", e);
            prop_assert_eq!(m.matches_bytes(&bytes), Ok(want), "event bytes {}", e);
        }
    }

    #[test]
    fn pattern_sets_agree_with_interpreter(ps in prop::collection::vec(pattern(), 1..24),
                                           mut events in prop::collection::vec(event(), 1..4),
                                           seed in any::<u64>()) {
        let mut r = Rng(seed | 1);
        for p in ps.iter().take(6) {
            events.push(guided_event(p, &mut r));
        }
        let ps: Vec<Pattern> = ps.iter().filter_map(compiled).collect();
        let m = build(&ps);
        for e in &events {
            let want = oracle(&ps, e);
            prop_assert_eq!(&m.matches(e), &want, "event {}", e);
            let pretty = serde_json::to_string_pretty(e).expect("serialize");
            prop_assert_eq!(m.matches_bytes_trusted(pretty.as_bytes()), Ok(want.clone()), "trusted bytes {}", e);
            prop_assert_eq!(m.matches_bytes(pretty.as_bytes()), Ok(want), "event bytes {}", e);
        }
    }

    #[test]
    fn counting_is_deterministic(ps in prop::collection::vec(pattern(), 1..8), e in event()) {
        let ps: Vec<Pattern> = ps.iter().filter_map(compiled).collect();
        let m = build(&ps);
        let (mut s1, mut s2) = (0, 0);
        let r1 = m.matches_counting(&e, &mut s1);
        let r2 = m.matches_counting(&e, &mut s2);
        prop_assert_eq!(r1, r2);
        prop_assert_eq!(s1, s2);
    }
}

/// Matchers weighted towards absence: `exists: false` alone or beside other tests.
fn absence_matcher() -> impl Strategy<Value = Value> {
    prop_oneof![
        4 => Just(json!([{"exists": false}])),
        1 => Just(json!([{"exists": true}])),
        1 => Just(json!(["x"])),
        1 => Just(json!([{"exists": false}, "x"])),
        1 => Just(json!([{"anything-but": "x"}])),
    ]
}

/// Patterns of up to three object levels with `$or` at any level, mostly testing absence.
fn absence_pattern() -> impl Strategy<Value = Value> {
    let object = |field: BoxedStrategy<Value>| {
        let fields = prop::collection::btree_map(prop::sample::select(KEYS), field, 1..3);
        (
            fields.clone(),
            prop::option::weighted(0.3, prop::collection::vec(fields, 2..3)),
        )
            .prop_map(|(m, or)| {
                let obj = |m: std::collections::BTreeMap<&str, Value>| {
                    Value::Object(m.into_iter().map(|(k, v)| (k.to_string(), v)).collect())
                };
                let mut out = obj(m);
                if let (Value::Object(o), Some(alts)) = (&mut out, or) {
                    o.insert(
                        "$or".to_string(),
                        Value::Array(alts.into_iter().map(obj).collect()),
                    );
                }
                out
            })
            .boxed()
    };
    let level1 = object(absence_matcher().boxed());
    let level2 = object(prop_oneof![2 => absence_matcher(), 1 => level1].boxed());
    object(prop_oneof![1 => absence_matcher(), 2 => level2].boxed())
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: std::env::var("PROPTEST_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(512),
        ..ProptestConfig::default()
    })]

    /// `exists: false` under arrays of objects (nested arrays, scalar and empty elements,
    /// sibling tests, `$or`), many rules at once: every reading of the event gives the
    /// interpreter's answer.
    #[test]
    fn absence_under_arrays_agrees_with_interpreter(
        ps in prop::collection::vec(absence_pattern(), 1..12),
        mut events in prop::collection::vec(event(), 1..4),
        seed in any::<u64>(),
    ) {
        let mut r = Rng(seed | 1);
        for p in ps.iter().take(4) {
            events.push(guided_event(p, &mut r));
        }
        let ps: Vec<Pattern> = ps.iter().filter_map(compiled).collect();
        let m = build(&ps);
        for e in &events {
            let want = oracle(&ps, e);
            prop_assert_eq!(&m.matches(e), &want, "event {}", e);
            let bytes = serde_json::to_vec(e).expect("serialize");
            prop_assert_eq!(m.matches_bytes_trusted(&bytes), Ok(want.clone()), "trusted bytes {}", e);
            prop_assert_eq!(m.matches_bytes(&bytes), Ok(want), "event bytes {}", e);
            if let Some(ce) = as_cloud_event(e) {
                prop_assert_eq!(m.matches_event(&ce), oracle(&ps, &ce.to_json()), "cloud event {}", e);
            }
        }
    }
}

// ---------------------------------------------------------------------------------------
// Cost: the work per event does not grow with the number of rules.

/// Deterministic xorshift, so the test needs no data files.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
    fn unit(&mut self) -> f64 {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64
    }
}

const STREETS: &[&str] = &[
    "CRANLEIGH",
    "17TH",
    "BEACH",
    "FULTON",
    "MASON",
    "JEFFERSON",
    "HYDE",
    "CHESTNUT",
    "TURK",
    "GREENWICH",
    "MISSION",
    "VALENCIA",
    "GEARY",
    "MARKET",
    "FOLSOM",
];

/// A feature shaped like gen_citylots.py's.
fn citylot(r: &mut Rng) -> Value {
    let blk = 1 + r.below(7999);
    let lot = 1 + r.below(200);
    let street = if r.below(4) == 0 {
        STREETS[r.below(STREETS.len() as u64) as usize].to_string()
    } else {
        format!("ST{:03}", r.below(400))
    };
    let st_type = ["ST", "AVE", "BLVD"][r.below(3) as usize];
    let (x0, y0) = (-122.52 + r.unit() * 0.17, 37.70 + r.unit() * 0.13);
    let ring: Vec<Value> = (0..4 + r.below(8))
        .map(|_| json!({"x": x0 + (r.unit() - 0.5) * 6e-4, "y": y0 + (r.unit() - 0.5) * 6e-4, "z": 0}))
        .collect();
    json!({
        "type": "Feature",
        "properties": {
            "MAPBLKLOT": format!("{blk:04}{lot:03}"), "BLKLOT": format!("{blk:04}{lot:03}"),
            "BLOCK_NUM": format!("{blk:04}"), "LOT_NUM": format!("{lot:03}"),
            "FROM_ST": "10", "TO_ST": "12", "STREET": street,
            "ST_TYPE": st_type, "ODD_EVEN": "O",
        },
        "geometry": {"type": "Polygon", "firstCoordinates": ring[0].clone(), "coordinates": [ring]},
    })
}

/// Rule `i` of a varied citylots rule set: exact, prefix, numeric, anything-but and wildcard
/// rules over the features' fields, most of them selective.
fn citylot_rule(i: usize, r: &mut Rng) -> Value {
    match i % 6 {
        0 => json!({"properties": {"STREET": [format!("ST{:03}", r.below(2000))]}}),
        1 => json!({"properties": {"MAPBLKLOT": [{"prefix": format!("{:05}", r.below(80_000))}]}}),
        2 => {
            let lo = -122.52 + r.unit() * 0.17;
            json!({"geometry": {"firstCoordinates": {"x": [{"numeric": [">=", lo, "<", lo + 1e-5]}]}}})
        }
        3 => json!({"properties": {"BLOCK_NUM": [format!("{:04}", r.below(8000))],
                                   "ST_TYPE": [{"anything-but": ["ST", "AVE"]}]}}),
        4 => {
            json!({"properties": {"STREET": [{"wildcard": format!("ST{}*{}", r.below(10), r.below(100))}]}})
        }
        _ => json!({"geometry": {"type": ["Polygon"]},
                    "properties": {"LOT_NUM": [format!("{:03}", 201 + r.below(700))]}}),
    }
}

fn steps_for(rules: usize, events: &[Value]) -> (u64, usize) {
    let mut r = Rng(0x9E37_79B9_7F4A_7C15);
    let ps: Vec<Pattern> = (0..rules)
        .map(|i| compile(&citylot_rule(i, &mut r)))
        .collect();
    let m = build(&ps);
    let mut steps = 0;
    let mut matched = 0;
    for e in events {
        let got = m.matches_counting(e, &mut steps);
        matched += got.len();
        if rules <= 1000 {
            assert_eq!(got, oracle(&ps, e));
        }
    }
    (steps, matched)
}

#[test]
fn steps_do_not_grow_with_rule_count() {
    let mut r = Rng(42);
    let events: Vec<Value> = (0..300).map(|_| citylot(&mut r)).collect();
    let (s10, m10) = steps_for(10, &events);
    let (s1k, _) = steps_for(1_000, &events);
    let (s10k, m10k) = steps_for(10_000, &events);
    eprintln!(
        "steps: 10 rules {s10} ({m10} matches), 1,000 rules {s1k}, 10,000 rules {s10k} ({m10k} matches)"
    );
    assert!(
        s10k <= 2 * s10,
        "10,000 rules: {s10k} steps; 10 rules: {s10}"
    );
}

#[test]
fn compile_time_of_ten_thousand_rules() {
    let mut r = Rng(7);
    let ps: Vec<Pattern> = (0..10_000)
        .map(|i| compile(&citylot_rule(i, &mut r)))
        .collect();
    let t = std::time::Instant::now();
    let m = build(&ps);
    let elapsed = t.elapsed();
    eprintln!("compiled 10,000 rules in {elapsed:?}: {:?}", m.stats());
    // Only a generous sanity bound, and only for optimised builds: timing is the benchmark's job.
    if !cfg!(debug_assertions) {
        assert!(elapsed < std::time::Duration::from_secs(2), "{elapsed:?}");
    }
}

#[test]
fn generators_produce_both_answers() {
    use proptest::strategy::ValueTree;
    use proptest::test_runner::TestRunner;
    let mut runner = TestRunner::deterministic();
    let (mut pairs, mut hits, mut with_arrays_of_objects, mut absent_hits) = (0, 0, 0, 0);
    for _ in 0..2000 {
        let p = pattern().new_tree(&mut runner).expect("tree").current();
        let e = if pairs % 2 == 0 {
            event().new_tree(&mut runner).expect("tree").current()
        } else {
            guided_event(&p, &mut Rng(pairs as u64 + 1))
        };
        let Some(c) = compiled(&p) else { continue };
        pairs += 1;
        if c.matches(&e) {
            hits += 1;
            let text = e.to_string();
            if text.contains("[{") {
                with_arrays_of_objects += 1;
            }
            if p.to_string().contains("\"exists\":false") {
                absent_hits += 1;
            }
        }
    }
    eprintln!(
        "{pairs} pairs, {hits} match, {with_arrays_of_objects} of them with arrays of objects, {absent_hits} with exists:false"
    );
    assert!(pairs > 1500, "{pairs}");
    assert!(
        hits * 20 > pairs && hits * 20 < pairs * 19,
        "{hits} of {pairs}"
    );
    assert!(with_arrays_of_objects > 20 && absent_hits > 20);
}

proptest! {
    #[test]
    fn fast_floats_are_serde_json_floats(int in 0u64..100_000, frac in "[0-9]{1,17}", neg in any::<bool>(),
                                        exp in prop::option::of(-30i32..30)) {
        let mut tok = format!("{}{int}.{frac}", if neg { "-" } else { "" });
        if let Some(e) = exp {
            tok.push_str(&format!("e{e}"));
        }
        let want: Option<f64> = serde_json::from_str(&tok).ok();
        if let Some(got) = flatten::fast_float(tok.as_bytes()) {
            prop_assert_eq!(Some(got.to_bits()), want.map(f64::to_bits), "{}", tok);
        }
    }
}

#[test]
fn trusted_bytes_stop_early_but_agree_on_valid_input() {
    let p = compile(&json!({"properties": {"STREET": ["MASON"]}}));
    let m = build(&[p]);
    let doc = br#"{"type":"Feature","properties":{"STREET":"MASON","X":1},"geometry":{"coordinates":[[1,2]]}}"#;
    assert_eq!(m.matches_bytes(doc), Ok(vec![0]));
    assert_eq!(m.matches_bytes_trusted(doc), Ok(vec![0]));
    // What follows the last mentioned field is not read at all in trusted mode...
    let cut = br#"{"type":"Feature","properties":{"STREET":"MASON","#;
    assert!(m.matches_bytes(cut).is_err());
    assert_eq!(m.matches_bytes_trusted(cut), Ok(vec![0]));
    // ...but a field inside an array of objects may have more elements: no early stop there.
    let p = compile(&json!({"o": {"a": [1], "b": [2]}}));
    let m = build(&[p]);
    assert_eq!(
        m.matches_bytes_trusted(br#"{"o":[{"a":1,"b":3},{"a":1,"b":2}]}"#),
        Ok(vec![0])
    );
    // Absence needs the whole object.
    let p = compile(&json!({"a": [1], "b": [{"exists": false}]}));
    let m = build(&[p]);
    assert_eq!(
        m.matches_bytes_trusted(br#"{"a":1,"c":0,"b":2}"#),
        Ok(vec![])
    );
    assert_eq!(m.matches_bytes_trusted(br#"{"a":1,"c":0}"#), Ok(vec![0]));
}

/// Every cap that refuses a rule set is documented for operators, with its value
/// (docs/configuration.md, "Pattern limits"); before, only the 5-star limit was written down.
#[test]
fn pattern_caps_are_documented() {
    let doc = include_str!("../../../../docs/configuration.md");
    let section = doc
        .split("**Pattern limits.**")
        .nth(1)
        .and_then(|s| s.split("**Ordering.**").next())
        .unwrap_or_default();
    let million = format!("{},{:03},{:03}", MAX_TOTAL_STATES / 1_000_000, 0, 0);
    for (cap, text) in [
        ("MAX_OR_EXPANSION", format!("| {MAX_OR_EXPANSION} |")),
        ("MAX_TESTS_PER_RULE", format!("| {MAX_TESTS_PER_RULE} |")),
        ("MAX_TOTAL_STATES", million),
        ("MAX_WILDCARD_STARS", format!("| {MAX_WILDCARD_STARS} |")),
        (
            "MAX_WILDCARD_ACTIVE_STATES",
            format!("| {MAX_WILDCARD_ACTIVE_STATES} active at once |"),
        ),
        (
            "MAX_NUMERIC_OPERAND",
            format!("±{}", crate::rules::pattern::MAX_NUMERIC_OPERAND as u64),
        ),
    ] {
        assert!(
            section.contains(&text),
            "{cap}: `{text}` not in the section"
        );
    }
    let schema = include_str!("../../../../schemas/rules.schema.json");
    for text in [
        "256 combinations",
        "4096 field tests",
        "5 `*`",
        "4096 wildcard matcher states",
        "±9007199254740991",
    ] {
        assert!(
            schema.contains(text),
            "`{text}` not in the rule-file schema"
        );
    }
}

//! The rule-file loader (`RuleSet::from_sources`, what `load_dir` runs on each file's text):
//! YAML with positions, JSON, policies, targets, patterns and the set's compiled matcher.
//!
//! The input is loaded once as `fuzz.yaml` and once as `fuzz.json`. Checked: a refused file
//! has at least one error and every diagnostic names the file with a 1-based position (or
//! none); an accepted set's warnings are warnings, its version is 12 hex digits, rule names
//! are unique, every rule's targets exist and belong to it, each rule's `pattern_json`
//! compiles back to its pattern, and the set's compiled matcher agrees with the per-rule
//! interpreter (and the byte matcher with the `Value` matcher) on fixed and derived events.
#![no_main]

use std::collections::HashSet;

use libfuzzer_sys::fuzz_target;
use router::rules::{Pattern, RuleSet};
use router_fuzz::{fixed_events, witness};

fuzz_target!(|data: &[u8]| {
    let text = String::from_utf8_lossy(data);
    for name in ["fuzz.yaml", "fuzz.json"] {
        check(name, &text);
    }
});

fn check(name: &str, text: &str) {
    let (set, warnings) = match RuleSet::from_sources(&[(name, text)]) {
        Ok(ok) => ok,
        Err(diags) => {
            assert!(
                diags.iter().any(|d| d.is_error()),
                "refused without an error"
            );
            for d in &diags {
                assert_eq!(d.file, name);
                assert_eq!(d.line == 0, d.col == 0, "half a position: {d}");
                let _ = d.to_string();
            }
            return;
        }
    };
    assert!(
        warnings.iter().all(|w| !w.is_error()),
        "accepted with an error"
    );
    assert_eq!(set.files, [name]);
    assert!(
        set.version.len() == 12 && set.version.bytes().all(|b| b.is_ascii_hexdigit()),
        "version {:?}",
        set.version
    );
    let mut names = HashSet::new();
    let mut events = fixed_events();
    for rule in &set.rules {
        assert!(
            names.insert(&rule.name),
            "duplicate rule name {:?}",
            rule.name
        );
        assert_eq!(rule.file, name);
        assert!(rule.line >= 1);
        for id in &rule.target_ids {
            let t = set.target(id).expect("a rule names a target the set lacks");
            assert_eq!(t.rule, rule.name, "target {id} belongs to another rule");
        }
        assert_eq!(
            Pattern::compile(&rule.pattern_json).as_ref(),
            Ok(&rule.pattern),
            "pattern_json of {:?} does not compile back to its pattern",
            rule.name
        );
        events.push(witness(&rule.pattern_json));
    }
    for t in set.targets.values() {
        assert!(set.rule(&t.rule).is_some(), "target {} of no rule", t.id);
    }
    for event in &events {
        let compiled = set.matches(event);
        assert_eq!(
            compiled,
            set.matches_interpreted(event),
            "compiled matcher disagrees with the interpreter on {event}"
        );
        let bytes = serde_json::to_vec(event).expect("a Value always serialises");
        assert_eq!(
            set.matches_bytes(&bytes).as_ref(),
            Ok(&compiled),
            "byte matcher disagrees on {event}"
        );
    }
}

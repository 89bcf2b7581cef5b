//! The EventBridge pattern compiler and both matchers.
//!
//! The input is a JSON pattern (non-JSON input is skipped). Checked: a rejected pattern
//! reports at least one error, each at a JSON pointer; an accepted one that is within the
//! automaton's caps compiles into a one-rule `CompiledMatcher` that agrees with the pattern
//! interpreter (`Pattern::matches`, the reference semantics) on a few fixed events, on the
//! input itself and on an event derived from the pattern's operands; the streaming byte
//! matcher agrees with the `Value` matcher on the same events.
#![no_main]

use libfuzzer_sys::fuzz_target;
use router::rules::automaton::{CompiledMatcher, check_pattern};
use router::rules::pattern::Pattern;
use router_fuzz::{fixed_events, witness};
use serde_json::Value;

fuzz_target!(|data: &[u8]| {
    let Ok(value) = serde_json::from_slice::<Value>(data) else {
        return;
    };
    let pattern = match Pattern::compile(&value) {
        Ok(p) => p,
        Err(errors) => {
            assert!(!errors.is_empty(), "rejected without an error");
            for e in &errors {
                assert!(
                    e.pointer.is_empty() || e.pointer.starts_with('/'),
                    "pointer {:?} is not a JSON pointer",
                    e.pointer
                );
                let _ = e.to_string();
            }
            return;
        }
    };
    let mut events = fixed_events();
    events.push(witness(&value));
    events.push(value.clone());

    // Over a cap: the rule loader rejects it, so there is no automaton to compare.
    let matcher = check_pattern(&pattern).is_ok().then(|| {
        CompiledMatcher::build(&[(0, &pattern)])
            .expect("check_pattern accepted a pattern that build rejects")
    });
    for event in &events {
        let interpreted = pattern.matches(event);
        let Some(m) = &matcher else { continue };
        let compiled = m.matches(event);
        assert_eq!(
            compiled == [0],
            interpreted,
            "automaton and interpreter disagree on {event}"
        );
        let bytes = serde_json::to_vec(event).expect("a Value always serialises");
        assert_eq!(
            m.matches_bytes(&bytes).as_deref(),
            Ok(compiled.as_slice()),
            "byte matcher disagrees with the Value matcher on {event}"
        );
        assert_eq!(
            m.matches_bytes_trusted(&bytes).as_deref(),
            Ok(compiled.as_slice()),
            "trusted byte matcher disagrees on {event}"
        );
    }
    // The raw input, with its original spelling (escapes, number forms, repeated keys).
    if let Some(m) = &matcher {
        assert_eq!(
            m.matches_bytes(data).as_deref(),
            Ok(m.matches(&value).as_slice()),
            "byte matcher disagrees on the raw input"
        );
    }
});

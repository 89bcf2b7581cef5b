//! Structured mode (`application/cloudevents+json`): the body is one event object.
//!
//! Beyond the shared envelope invariants: an accepted request is exactly one event from a
//! body that is a JSON object with `"specversion": "1.0"`; the lenient `application/json`
//! and no-Content-Type paths give the same answer; this content type never yields 415.
#![no_main]

use libfuzzer_sys::fuzz_target;
use router::ingest::parse::{Mode, STRUCTURED_CONTENT_TYPE};
use router_fuzz::{LIMITS, has_specversion_1_0, json_body, parse_and_check};

fuzz_target!(|body: &[u8]| {
    let strict = parse_and_check(Some(STRUCTURED_CONTENT_TYPE), body);
    match &strict {
        Ok((mode, evs)) => {
            assert_eq!(*mode, Mode::Structured);
            assert_eq!(
                evs.len(),
                1,
                "structured mode accepted {} events",
                evs.len()
            );
            let obj =
                json_body(body).expect("accepted a body that is not JSON within the depth limit");
            assert!(obj.is_object(), "accepted a non-object body");
            assert!(
                has_specversion_1_0(&obj),
                "accepted an object without specversion 1.0"
            );
        }
        Err(e) => {
            assert_ne!(
                e.status.as_u16(),
                415,
                "415 for the structured content type"
            );
            if e.status.as_u16() == 413 {
                assert!(body.len() > LIMITS.max_body_bytes, "413 for a small body");
            }
        }
    }
    // An object body sent as plain JSON (or without a type) takes the same path.
    if json_body(body).is_some_and(|v| v.is_object()) {
        for ct in [Some("application/json"), None] {
            let lenient = parse_and_check(ct, body);
            assert_eq!(
                lenient, strict,
                "Content-Type {ct:?} disagrees with structured mode"
            );
        }
    }
});

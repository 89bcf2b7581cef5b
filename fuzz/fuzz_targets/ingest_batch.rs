//! Batch mode (`application/cloudevents-batch+json`): the body is an array of event objects.
//!
//! Beyond the shared envelope invariants: an accepted batch has as many events as the array
//! has elements (1 to `max_batch`), each equal to what structured mode makes of that element
//! alone; a rejected batch locates each envelope error inside an element (`/<index>/...`);
//! `application/json` gives the same answer for an array body.
#![no_main]

use libfuzzer_sys::fuzz_target;
use router::ingest::parse::{BATCH_CONTENT_TYPE, Mode, STRUCTURED_CONTENT_TYPE};
use router_fuzz::{LIMITS, json_body, parse_and_check};
use serde_json::Value;

fuzz_target!(|body: &[u8]| {
    let strict = parse_and_check(Some(BATCH_CONTENT_TYPE), body);
    let parsed = json_body(body);
    match (&strict, &parsed) {
        (Ok((mode, evs)), Some(Value::Array(items))) => {
            assert_eq!(*mode, Mode::Batch);
            assert_eq!(evs.len(), items.len(), "batch lost or invented events");
            // Each element alone, in structured mode, is the same event.
            for (item, ev) in items.iter().zip(evs) {
                let one = serde_json::to_vec(item).expect("a Value always serialises");
                match parse_and_check(Some(STRUCTURED_CONTENT_TYPE), &one) {
                    Ok((_, alone)) => {
                        assert_eq!(&alone[0], ev, "batch element parsed differently alone")
                    }
                    Err(e) => panic!("batch element accepted in a batch but rejected alone: {e}"),
                }
            }
        }
        (Ok(_), _) => panic!("accepted a batch whose body is not a JSON array"),
        (Err(e), Some(Value::Array(items))) => match e.status.as_u16() {
            413 => assert!(
                items.len() > LIMITS.max_batch || body.len() > LIMITS.max_body_bytes,
                "413 for a batch within the limits"
            ),
            400 if items.is_empty() => {}
            400 => {
                for fe in &e.errors {
                    let index = fe
                        .pointer
                        .strip_prefix('/')
                        .and_then(|p| p.split('/').next());
                    let index: Option<usize> = index.and_then(|i| i.parse().ok());
                    assert!(
                        index.is_some_and(|i| i < items.len()),
                        "batch error at {:?} is not inside an element",
                        fe.pointer
                    );
                }
            }
            other => panic!("status {other} for a JSON array body"),
        },
        (Err(e), _) => assert_ne!(e.status.as_u16(), 415, "415 for the batch content type"),
    }
    if matches!(parsed, Some(Value::Array(_))) {
        let lenient = parse_and_check(Some("application/json"), body);
        assert_eq!(
            lenient, strict,
            "application/json disagrees with batch mode"
        );
    }
});

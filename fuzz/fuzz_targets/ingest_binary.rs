//! Binary mode: attributes in `ce-*` headers, the body is `data`.
//!
//! The input is split at NUL bytes into: Content-Type, ce-specversion, ce-id, ce-source,
//! ce-type, then extra headers (one `name:value` per line), then the body. An empty field
//! means "header absent"; a field that is not a valid header value is dropped.
//!
//! Beyond the shared envelope invariants: an accepted request is one event whose id, source
//! and type are the (percent-decoded) header values, whose `datacontenttype` is the
//! Content-Type, and whose data is the body: parsed JSON for a JSON type (or none), a string
//! for a UTF-8 `text/*` body, base64 of the exact bytes otherwise; an empty body means no data.
#![no_main]

use base64::Engine as _;
use http::{HeaderMap, HeaderName, HeaderValue};
use libfuzzer_sys::fuzz_target;
use router::ingest::parse::{self, Mode};
use router_fuzz::{LIMITS, check_error, check_event, check_round_trip, is_json_content_type};
use serde_json::Value;

const FIXED: [&str; 5] = [
    "content-type",
    "ce-specversion",
    "ce-id",
    "ce-source",
    "ce-type",
];

fuzz_target!(|data: &[u8]| {
    let mut parts = data.splitn(FIXED.len() + 2, |b| *b == 0);
    let mut headers = HeaderMap::new();
    let mut fixed: [Option<&[u8]>; 5] = [None; 5];
    for (i, name) in FIXED.into_iter().enumerate() {
        let Some(raw) = parts.next() else { break };
        if raw.is_empty() {
            continue;
        }
        if let Ok(v) = HeaderValue::from_bytes(raw) {
            headers.append(HeaderName::from_static(name), v);
            fixed[i] = Some(raw);
        }
    }
    for line in parts.next().unwrap_or_default().split(|b| *b == b'\n') {
        let Some(colon) = line.iter().position(|b| *b == b':') else {
            continue;
        };
        if let (Ok(n), Ok(v)) = (
            HeaderName::from_bytes(&line[..colon]),
            HeaderValue::from_bytes(&line[colon + 1..]),
        ) {
            headers.append(n, v);
        }
    }
    let body = parts.next().unwrap_or_default();

    let out = parse::parse_request(&headers, body, &LIMITS);
    let has_ce = headers.keys().any(|k| k.as_str().starts_with("ce-"));
    let (mode, evs) = match out {
        Ok(ok) => ok,
        Err(e) => {
            check_error(&e);
            return;
        }
    };
    if !has_ce {
        // Without ce-* headers this is structured or batch mode; the other targets cover it.
        for ev in &evs {
            check_event(ev);
        }
        return;
    }
    let ct_header = headers
        .get(http::header::CONTENT_TYPE)
        .map(|v| v.to_str().expect("accepted a non-ASCII Content-Type"));
    let essence = ct_header.map(|c| {
        c.split(';')
            .next()
            .unwrap_or("")
            .trim()
            .to_ascii_lowercase()
    });
    if matches!(
        essence.as_deref(),
        Some(parse::STRUCTURED_CONTENT_TYPE | parse::BATCH_CONTENT_TYPE)
    ) {
        // Those content types select structured/batch mode even with ce-* headers.
        assert_ne!(mode, Mode::Binary);
        return;
    }
    assert_eq!(
        mode,
        Mode::Binary,
        "ce-* headers present but mode is {mode:?}"
    );
    assert_eq!(evs.len(), 1);
    let ev = &evs[0];
    check_event(ev);
    check_round_trip(ev);

    // Attribute values without escapes or quotes are taken verbatim.
    for (i, got) in [(2, &ev.id), (3, &ev.source), (4, &ev.ty)] {
        if let Some(raw) = fixed[i].filter(|r| !r.contains(&b'%') && !r.starts_with(b"\""))
            && headers.get_all(FIXED[i]).iter().count() == 1
        {
            assert_eq!(got.as_bytes(), raw, "{} not taken verbatim", FIXED[i]);
        }
    }
    assert_eq!(
        ev.datacontenttype.as_deref(),
        ct_header,
        "datacontenttype is not Content-Type"
    );

    if body.is_empty() {
        assert!(
            ev.data.is_none() && ev.data_base64.is_none(),
            "data from an empty body"
        );
    } else if is_json_content_type(ct_header)
        && (ct_header.is_some() || serde_json::from_slice::<Value>(body).is_ok())
    {
        // An untyped body is JSON data when it parses, carried as data_base64 otherwise.
        let v: Value = serde_json::from_slice(body).expect("accepted malformed JSON data");
        assert_eq!(
            ev.data.as_ref().map(router::event::Data::value),
            Some(&v).filter(|v| !v.is_null()),
            "JSON data changed"
        );
    } else if let Some(s) = &ev.data {
        assert!(
            essence.as_deref().is_some_and(|e| e.starts_with("text/")),
            "string data for a non-text type"
        );
        assert_eq!(
            s.value().as_str().map(str::as_bytes),
            Some(body),
            "text data changed"
        );
    } else {
        let b64 = ev
            .data_base64
            .as_deref()
            .expect("a non-empty body became no data");
        let back = base64::engine::general_purpose::STANDARD
            .decode(b64)
            .expect("data_base64 is valid base64");
        assert_eq!(back, body, "data_base64 does not decode to the body");
    }
});

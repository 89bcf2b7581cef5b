//! The lists that grow with the rules, paged: `/v1/targets`, `/v1/rules` and an event's
//! targets in its fate, at a few thousand targets (one answer of everything ran to megabytes).

use std::time::Duration;

use serde_json::{Value, json};

use crate::harness::*;

/// Rules of a router with `rules` one-target rules (`r0000`…, targets `c0`…) and one rule,
/// `fan`, sending `fan.evt` to `fan` targets (`f0`…), all webhooks to `url`. Target ids are
/// not zero-padded, so the id order (`c10` before `c2`) is not the file order.
fn many_targets(url: &str, rules: usize, fan: usize) -> String {
    let mut s = String::from("rules:\n");
    for i in 0..rules {
        s.push_str(&format!(
            "  - name: r{i:04}\n    pattern: {{ type: [r.{i}] }}\n    targets:\n      - webhook: {url}\n        id: c{i}\n"
        ));
    }
    s.push_str("  - name: fan\n    pattern: { type: [fan.evt] }\n    targets:\n");
    for i in 0..fan {
        s.push_str(&format!("      - webhook: {url}\n        id: f{i}\n"));
    }
    s
}

/// `path` refused with a 400 whose error points at `pointer`.
async fn refused_at(r: &RouterProc, path: &str, pointer: &str) {
    let (status, v) = get_json(r, path).await;
    assert_eq!(status, 400, "{path}: {v}");
    let pointers: Vec<&str> = v["errors"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|e| e["pointer"].as_str())
        .collect();
    assert_eq!(pointers, [pointer], "{path}: {v}");
}

/// At 2,500 targets and 1,201 rules: `/v1/targets` and `/v1/rules` answer 1,000 at a time, and
/// their pages join to every target (by id) and rule (in file order) once; `problems=true`
/// lists the paused targets alone, paged too. An event fanned out to 1,300 targets shows
/// 1,000 of them per page in fan-out order, with totals by state over all of them; bad
/// `limit` and `after` are 400s pointing at them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn targets_rules_and_a_fan_outs_fate_are_paged_by_a_thousand() {
    const RULES: usize = 1_200;
    // The JetStream store accepts an event in one atomic batch of at most 1000 writes (the
    // event, its dedup record and one per target): an event of more than 998 targets is
    // refused there, so on it the fan-out stays below and its fate pages by a smaller limit.
    let fan = if RouterProc::on_jetstream() {
        990
    } else {
        1_300
    };
    let targets_total = RULES + fan;
    let rcv = Receiver::ok().await;
    let r = RouterProc::start(&[("many.yaml", &many_targets(&rcv.url(), RULES, fan))], &[]);

    // Targets: by id, 1000 a page, every one once.
    let (status, first) = get_json(&r, "/v1/targets").await;
    assert_eq!(status, 200, "{first}");
    assert_eq!(first["targets"].as_array().map(Vec::len), Some(1000));
    assert_eq!(
        first["next"], first["targets"][999]["id"],
        "the last id is the cursor"
    );
    let targets = all_pages(&r, "/v1/targets", "targets")
        .await
        .expect("targets");
    let ids: Vec<String> = targets
        .iter()
        .map(|t| t["id"].as_str().expect("id").to_string())
        .collect();
    let mut want: Vec<String> = (0..RULES)
        .map(|i| format!("c{i}"))
        .chain((0..fan).map(|i| format!("f{i}")))
        .collect();
    want.sort();
    assert_eq!(ids.len(), targets_total);
    assert_eq!(ids, want, "pages join to every target once, by id");
    // A page of one after any position: the cursor is a position, not a target.
    let (_, one) = get_json(&r, "/v1/targets?limit=1&after=c1").await;
    assert_eq!(one["targets"][0]["id"], "c10", "{one}");
    assert_eq!(one["next"], "c10", "{one}");
    let (_, last) = get_json(&r, "/v1/targets?after=f999").await;
    assert_eq!(last["targets"], json!([]), "{last}");
    assert_eq!(last["next"], Value::Null, "{last}");

    // Rules: in file order, 1000 a page.
    let (_, rules) = get_json(&r, "/v1/rules").await;
    assert_eq!(rules["rules"].as_array().map(Vec::len), Some(1000));
    assert_eq!(rules["next"], "r0999", "{}", rules["next"]);
    let names: Vec<String> = all_pages(&r, "/v1/rules", "rules")
        .await
        .expect("rules")
        .iter()
        .map(|x| x["name"].as_str().expect("name").to_string())
        .collect();
    let want_names: Vec<String> = (0..RULES)
        .map(|i| format!("r{i:04}"))
        .chain(["fan".to_string()])
        .collect();
    assert_eq!(names, want_names);

    // Two fan targets paused, one early and one late in the fan-out: the problems filter
    // lists them alone, by id, paged.
    let paused = ["f5".to_string(), format!("f{}", fan - 50)];
    for id in &paused {
        let (status, v) = post_json(&r, &format!("/v1/targets/{id}/pause"), json!({})).await;
        assert_eq!(status, 200, "{v}");
    }
    let mut by_id = paused.clone();
    by_id.sort();
    let problems = all_pages(&r, "/v1/targets?problems=true", "targets")
        .await
        .expect("problems");
    let problem_ids: Vec<&str> = problems.iter().filter_map(|t| t["id"].as_str()).collect();
    assert_eq!(problem_ids, by_id);
    let (_, p1) = get_json(&r, "/v1/targets?problems=true&limit=1").await;
    assert_eq!(p1["next"], by_id[0], "{p1}");
    let (_, p2) = get_json(
        &r,
        &format!("/v1/targets?problems=true&limit=1&after={}", by_id[0]),
    )
    .await;
    assert_eq!(p2["targets"][0]["id"], by_id[1], "{p2}");
    assert_eq!(p2["next"], Value::Null, "{p2}");
    let (_, none) = get_json(&r, "/v1/targets?problems=false&limit=3").await;
    assert_eq!(none["targets"].as_array().map(Vec::len), Some(3), "{none}");

    // One event to the fan targets: delivered to all but the two paused.
    let (status, v) = post_event(&r, &event("fan-1", "fan.evt", json!({}))).await;
    assert_eq!(status, 202, "{v}");
    // Generous: 1,300 deliveries to one local receiver take a few seconds in a debug build.
    let delivered = eventually(Duration::from_secs(60), || async {
        let f = fate(&r, "fan-1").await;
        (f["targets_by_state"]["delivered"] == fan - 2).then_some(f)
    })
    .await;
    let Some(whole) = delivered else {
        panic!("not delivered in time: {}", fate_summary(&r).await);
    };
    assert_eq!(whole["targets_total"], fan);
    assert_eq!(
        whole["targets_by_state"],
        json!({"queued": 2, "in_flight": 0, "retrying": 0, "delivered": fan - 2, "dlq": 0, "purged": 0})
    );
    assert_eq!(
        whole["matched_rules"],
        json!(["fan"]),
        "matched rules stay whole"
    );
    // The default page: 1000, with a cursor when there are more.
    let page1 = whole["targets"].as_array().expect("targets");
    assert_eq!(page1.len(), fan.min(1000));
    let more = (fan > 1000).then(|| page1[999]["entry"].clone());
    assert_eq!(whole["targets_next"], more.unwrap_or(Value::Null));
    // Pages of 400 join in fan-out order, once each, with the totals on every page.
    let mut all: Vec<Value> = Vec::new();
    let mut after: Option<String> = None;
    loop {
        let cursor = after
            .as_deref()
            .map(|a| format!("&after={}", urlencoding(a)))
            .unwrap_or_default();
        let (status, page) = get_json(
            &r,
            &format!("/v1/events/fan-1?source=/test&limit=400{cursor}"),
        )
        .await;
        assert_eq!(status, 200, "{page}");
        assert_eq!(page["targets_total"], fan, "totals on every page");
        let items = page["targets"].as_array().expect("targets");
        assert!(items.len() <= 400);
        all.extend(items.iter().cloned());
        match page["targets_next"].as_str() {
            Some(next) => {
                assert_eq!(page["targets_next"], items[items.len() - 1]["entry"]);
                after = Some(next.to_string());
            }
            None => break,
        }
    }
    let fan_ids: Vec<&str> = all.iter().filter_map(|t| t["target"].as_str()).collect();
    let want_fan: Vec<String> = (0..fan).map(|i| format!("f{i}")).collect();
    assert_eq!(
        fan_ids, want_fan,
        "the pages join in fan-out order, once each"
    );
    let queued: Vec<String> = all
        .iter()
        .filter(|t| t["state"] == "queued")
        .filter_map(|t| t["target"].as_str().map(str::to_string))
        .collect();
    assert_eq!(
        queued, paused,
        "the states on the pages add up to the totals"
    );
    // A smaller page, and an event of one target: one page, no cursor.
    let (_, small) = get_json(&r, "/v1/events/fan-1?source=/test&limit=2").await;
    assert_eq!(small["targets"].as_array().map(Vec::len), Some(2));
    assert_eq!(small["targets_next"], small["targets"][1]["entry"]);
    let (status, v) = post_event(&r, &event("one-1", "r.7", json!({}))).await;
    assert_eq!(status, 202, "{v}");
    let one = fate(&r, "one-1").await;
    assert_eq!(one["targets_total"], 1, "{one}");
    assert_eq!(one["targets"].as_array().map(Vec::len), Some(1), "{one}");
    assert_eq!(one["targets_next"], Value::Null, "{one}");

    // Bad limits and cursors, each pointed at.
    for limit in ["0", "1001", "-1", "x"] {
        refused_at(&r, &format!("/v1/targets?limit={limit}"), "/limit").await;
        refused_at(&r, &format!("/v1/rules?limit={limit}"), "/limit").await;
        refused_at(
            &r,
            &format!("/v1/events/fan-1?source=/test&limit={limit}"),
            "/limit",
        )
        .await;
    }
    refused_at(&r, "/v1/targets?after=", "/after").await;
    refused_at(&r, "/v1/targets?problems=maybe", "/problems").await;
    refused_at(&r, "/v1/rules?after=no-such-rule", "/after").await;
    refused_at(&r, "/v1/events/fan-1?source=/test&after=f5", "/after").await;
    // An entry of another event is no cursor of this one.
    let other = one["targets"][0]["entry"].as_str().expect("entry");
    refused_at(
        &r,
        &format!("/v1/events/fan-1?source=/test&after={}", urlencoding(other)),
        "/after",
    )
    .await;
}

/// What the fan-out's fate shows, for a failed wait.
async fn fate_summary(r: &RouterProc) -> String {
    let f = fate(r, "fan-1").await;
    format!("{} {}", f["targets_total"], f["targets_by_state"])
}

/// An event matched by more targets than the JetStream store commits in one atomic batch is
/// refused on its own with a 422 naming it (in a batch, its index), and nothing of the request
/// is stored. Before, the store's refusal was a 503, and its producer retried the event for
/// ever. The embedded store takes the same event (202).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fan_out_over_the_store_s_atomic_limit_is_refused_not_retried() {
    let rcv = Receiver::ok().await;
    let r = RouterProc::start(&[("many.yaml", &many_targets(&rcv.url(), 0, 1_200))], &[]);
    let small = json!({"specversion": "1.0", "id": "ok-1", "source": "/s", "type": "other"});
    let wide = json!({"specversion": "1.0", "id": "wide-1", "source": "/s", "type": "fan.evt"});
    let resp = client()
        .post(r.url("/v1/events"))
        .header("content-type", "application/cloudevents-batch+json")
        .body(json!([small, wide]).to_string())
        .send()
        .await
        .expect("post");
    let status = resp.status().as_u16();
    let body: Value = resp.json().await.expect("json");
    let (fate_status, _) = get_json(&r, "/v1/events/ok-1?source=/s").await;
    if RouterProc::on_jetstream() {
        assert_eq!(status, 422, "{body}");
        assert_eq!(body["errors"][0]["pointer"], "/1", "{body}");
        let msg = body["errors"][0]["message"].as_str().unwrap_or_default();
        assert!(
            msg.contains("atomic") && msg.contains("nothing was stored"),
            "{msg}"
        );
        assert_eq!(fate_status, 404, "nothing of the request is stored");
    } else {
        assert_eq!(status, 202, "{body}");
        assert_eq!(body["results"][1]["status"], "accepted", "{body}");
        assert_eq!(fate_status, 200);
    }
}

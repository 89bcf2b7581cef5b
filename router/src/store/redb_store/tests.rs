use std::sync::Arc;

use serde_json::json;

use super::*;
use crate::store::fault::{LogDisks, SimulatedDisk};
use crate::store::test_events::{job, new_event};

/// Accepts 200 events for target `a`, each with 2 KB of data, ids `{chunk}-{i}`.
async fn accept_padded(s: &RedbStore, chunk: usize) -> Result<Vec<AcceptOutcome>, StoreError> {
    let pad = "x".repeat(2000);
    let batch = (0..200)
        .map(|i| {
            let mut e = new_event("/s", &format!("{chunk}-{i}"), &["a"], 1000);
            e.event.data = Some(crate::event::Data::from(json!({ "pad": pad })));
            e
        })
        .collect();
    s.accept(batch).await
}

/// Leases everything due for target `a` and acks it as delivered.
async fn deliver_all(s: &RedbStore) {
    loop {
        let batch = s.lease("a", 2000, 500, 60_000).await.expect("lease");
        if batch.is_empty() {
            break;
        }
        let finishes = batch.iter().map(|l| ack(s, l, 2001));
        for r in futures::future::join_all(finishes).await {
            r.expect("finish");
        }
    }
}

pub(super) fn delivered(at: Millis) -> AttemptEnd {
    AttemptEnd {
        finished_at: at,
        result: AttemptResult::Delivered,
        status: Some(200),
        error: None,
        outbox: None,
    }
}

/// Acks `l` under its own lease: delivered, the attempt ending at `at`.
fn ack<'a>(
    s: &'a RedbStore,
    l: &Leased,
    at: Millis,
) -> BoxFuture<'a, Result<Finished, FinishError>> {
    s.finish(
        l.entry.id,
        l.lease,
        delivered(at),
        Disposition::Delivered,
        at,
    )
}

/// Opens the file of a store dropped a moment ago with `open`, once its committer thread has
/// let go of it (it does shortly after the store is dropped); fails after 10 s.
pub(super) async fn when_free<T, E: std::fmt::Debug>(mut open: impl FnMut() -> Result<T, E>) -> T {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    loop {
        match open() {
            Ok(x) => return x,
            Err(e) if std::time::Instant::now() > deadline => {
                panic!("still held after 10 s: {e:?}")
            }
            Err(_) => tokio::time::sleep(std::time::Duration::from_millis(20)).await,
        }
    }
}

#[tokio::test]
async fn accept_fans_out_and_lease_records_the_attempt() {
    let s = RedbStore::in_memory().expect("store");
    let r = s
        .accept(vec![new_event("/s", "1", &["a", "b"], 1000)])
        .await
        .expect("accept");
    assert_eq!(r, vec![AcceptOutcome::accepted(1)]);
    assert_eq!(s.next_due("a"), Some(1000));
    let leased = s.lease("a", 1000, 10, 5000).await.expect("lease");
    assert_eq!(leased.len(), 1);
    assert_eq!(leased[0].entry.attempts.len(), 1);
    assert_eq!(leased[0].event.event.id, "1");
    // Nothing else due for a; b still has its own copy.
    assert!(
        s.lease("a", 1000, 10, 5000)
            .await
            .expect("lease")
            .is_empty()
    );
    assert_eq!(s.queue_stats()["b"].queued, 1);
    let l = &leased[0];
    ack(&s, l, 1001).await.expect("finish");
    let fate = s.fate("/s", "1").expect("fate").expect("known");
    assert_eq!(fate.entries.len(), 2);
    assert_eq!(fate.entries[0].state, EntryState::Delivered);
    assert_eq!(fate.entries[1].state, EntryState::Queued);
    assert_eq!(
        fate.entries[0].idempotency_key,
        fate.entries[0].idempotency_key.clone()
    );
    assert_ne!(
        fate.entries[0].idempotency_key,
        fate.entries[1].idempotency_key
    );
}

#[tokio::test]
async fn duplicates_inside_the_window_are_not_stored_again() {
    let s = RedbStore::in_memory().expect("store");
    s.accept(vec![new_event("/s", "1", &["a"], 1000)])
        .await
        .expect("accept");
    let r = s
        .accept(vec![new_event("/s", "1", &["a"], 2000)])
        .await
        .expect("accept");
    assert_eq!(r, vec![AcceptOutcome::Duplicate { seq: 1 }]);
    // Outside the window the key counts as new.
    let mut late = new_event("/s", "1", &["a"], 1000 + 86_400_001);
    late.dedup_window_ms = 86_400_000;
    let r = s.accept(vec![late]).await.expect("accept");
    assert_eq!(r, vec![AcceptOutcome::accepted(2)]);
}

#[tokio::test]
async fn concurrent_same_key_accepts_exactly_once() {
    let s = RedbStore::in_memory().expect("store");
    let mut tasks = Vec::new();
    for _ in 0..64 {
        let s = s.clone();
        tasks.push(tokio::spawn(async move {
            s.accept(vec![new_event("/s", "same", &["a"], 1000)]).await
        }));
    }
    let mut accepted = 0;
    for t in tasks {
        if let AcceptOutcome::Accepted { .. } = t.await.expect("join").expect("accept")[0] {
            accepted += 1;
        }
    }
    assert_eq!(accepted, 1);
    assert_eq!(s.queue_stats()["a"].queued, 1);
}

/// Concurrent requests of different sizes share groups (their accepts are applied together):
/// each still gets one outcome per event, in its own order, naming where its event is stored.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn accepts_sharing_a_group_each_get_their_own_outcomes() {
    let s = RedbStore::in_memory().expect("store");
    let mut tasks = Vec::new();
    for r in 0..40u32 {
        let s = s.clone();
        tasks.push(tokio::spawn(async move {
            let ids: Vec<String> = (0..=r % 4).map(|i| format!("r{r}-{i}")).collect();
            let mut batch: Vec<NewEvent> = ids
                .iter()
                .map(|id| new_event("/s", id, &["a"], 1000))
                .collect();
            // Every fifth request repeats its first event: the repeat is its duplicate.
            if r % 5 == 0 {
                batch.push(new_event("/s", &ids[0], &["a"], 1000));
            }
            let out = s.accept(batch).await.expect("accept");
            (ids, r % 5 == 0, out)
        }));
    }
    let mut seqs = std::collections::HashSet::new();
    for t in tasks {
        let (ids, repeated, out) = t.await.expect("join");
        assert_eq!(out.len(), ids.len() + usize::from(repeated));
        for (id, o) in ids.iter().zip(&out) {
            let AcceptOutcome::Accepted { seq, .. } = *o else {
                panic!("{id}: {o:?}");
            };
            assert!(seqs.insert(seq), "seq {seq} answered twice");
            let fate = s.fate("/s", id).expect("fate").expect("stored");
            assert_eq!(fate.event.seq, seq, "{id}");
        }
        if repeated {
            let AcceptOutcome::Accepted { seq, .. } = out[0] else {
                unreachable!()
            };
            assert_eq!(out[ids.len()], AcceptOutcome::Duplicate { seq });
        }
    }
    assert_eq!(s.queue_stats()["a"].queued, seqs.len() as u64);
}

#[tokio::test]
async fn the_commit_delay_gathers_ops_into_one_commit_but_not_after_a_quiet_spell() {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::time::{Duration, Instant};
    let commits = Arc::new(AtomicUsize::new(0));
    let counted = commits.clone();
    let opts = StoreOptions {
        commit_delay: Duration::from_millis(400),
        on_commit: Some(Arc::new(move |_, _| {
            counted.fetch_add(1, Ordering::SeqCst);
        })),
        ..StoreOptions::default()
    };
    let s = RedbStore::with_backend(redb::backends::InMemoryBackend::new(), opts).expect("open");
    s.accept(vec![new_event("/s", "first", &["a"], 1000)])
        .await
        .expect("accept");
    // Twenty accepts, 5 ms apart, all within the delay after that commit started: one commit
    // (two if the machine stalled the test for a few hundred ms; without the delay, twenty).
    let before = commits.load(Ordering::SeqCst);
    let mut tasks = Vec::new();
    for i in 0..20 {
        let s = s.clone();
        tasks.push(tokio::spawn(async move {
            s.accept(vec![new_event("/s", &format!("e{i}"), &["a"], 1000)])
                .await
        }));
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    for t in tasks {
        t.await.expect("join").expect("accept");
    }
    let gathered = commits.load(Ordering::SeqCst) - before;
    assert!((1..=2).contains(&gathered), "{gathered} commits");
    // After a quiet spell longer than the delay, the next op is committed at once (the bound
    // is generous; waiting for the delay would take 400 ms).
    tokio::time::sleep(Duration::from_millis(500)).await;
    let t = Instant::now();
    s.accept(vec![new_event("/s", "after", &["a"], 1000)])
        .await
        .expect("accept");
    assert!(
        t.elapsed() < Duration::from_millis(300),
        "{:?}",
        t.elapsed()
    );
    assert_eq!(s.queue_stats()["a"].queued, 22);
}

/// Handler acks weigh their key-value writes against the group bound, as accepts weigh their
/// events: four acks of 600 writes each, sent within one commit delay, commit one per group
/// (two would weigh 1,200, past the bound of 1,024), while a plain ack sent with them joins
/// the first group. Without the weight all five shared one commit.
#[tokio::test]
async fn handler_acks_heavy_with_key_value_writes_do_not_share_a_commit() {
    use std::sync::Mutex;
    let groups = Arc::new(Mutex::new(Vec::<usize>::new()));
    let seen = groups.clone();
    let opts = StoreOptions {
        commit_delay: std::time::Duration::from_millis(300),
        on_commit: Some(Arc::new(move |_, n| {
            seen.lock().expect("lock").push(n);
        })),
        ..StoreOptions::default()
    };
    let s = RedbStore::with_backend(redb::backends::InMemoryBackend::new(), opts).expect("open");
    let events = (0..5)
        .map(|i| new_event("/s", &format!("e{i}"), &["h"], 1000))
        .collect();
    s.accept(events).await.expect("accept");
    let mut leased = s.lease("h", 1000, 5, 60_000).await.expect("lease");
    leased.sort_by_key(|l| l.entry.id);
    assert_eq!(leased.len(), 5);
    groups.lock().expect("lock").clear();
    let mut calls = Vec::new();
    for (i, l) in leased.iter().enumerate() {
        let mut end = delivered(1010);
        if i < 4 {
            let kv = (0..600)
                .map(|k| put(&format!("{i}-{k}"), 8, None))
                .collect();
            end.outbox = Some(Box::new(Outbox {
                kv,
                ..Outbox::default()
            }));
        }
        calls.push(s.finish(l.entry.id, l.lease, end, Disposition::Delivered, 1010));
    }
    for r in futures::future::join_all(calls).await {
        r.expect("finish");
    }
    assert_eq!(s.kv_usage_of("h").expect("usage").keys, 2400);
    // Groups of no op (the dedup index's own work, between others) do not count.
    let groups: Vec<usize> = groups
        .lock()
        .expect("lock")
        .iter()
        .copied()
        .filter(|&n| n > 0)
        .collect();
    // The four heavy acks in four commits; the plain one in one of them.
    assert_eq!(groups.iter().sum::<usize>(), 5, "{groups:?}");
    assert_eq!(groups.len(), 4, "{groups:?}");
}

/// Finishes that share a commit each get their own answer and effect, whichever path they
/// take: plain ones (delivered, retry, release) are applied together, dead letters one by
/// one; a stale lease and a second finish of an entry finished in the same group are fenced.
#[tokio::test]
async fn finishes_sharing_a_group_each_get_their_own_answer() {
    use std::sync::atomic::{AtomicUsize, Ordering};
    let commits = Arc::new(AtomicUsize::new(0));
    let counted = commits.clone();
    let opts = StoreOptions {
        commit_delay: std::time::Duration::from_millis(300),
        on_commit: Some(Arc::new(move |_, _| {
            counted.fetch_add(1, Ordering::SeqCst);
        })),
        ..StoreOptions::default()
    };
    let s = RedbStore::with_backend(redb::backends::InMemoryBackend::new(), opts).expect("open");
    let events = (0..40)
        .map(|i| new_event("/s", &format!("e{i}"), &["a"], 1000))
        .collect();
    s.accept(events).await.expect("accept");
    let mut leased = s.lease("a", 1000, 40, 60_000).await.expect("lease");
    leased.sort_by_key(|l| l.entry.id);
    assert_eq!(leased.len(), 40);
    let failed = |at| AttemptEnd {
        finished_at: at,
        result: AttemptResult::Retryable,
        status: Some(503),
        error: Some("HTTP 503".into()),
        outbox: None,
    };
    let before = commits.load(Ordering::SeqCst);
    let mut calls = Vec::new();
    for (i, l) in leased.iter().enumerate() {
        let (end, disposition) = match i % 4 {
            0 => (delivered(1010), Disposition::Delivered),
            1 => (failed(1010), Disposition::Retry { due_at: 9000 }),
            2 => (failed(1010), Disposition::Release { due_at: 8000 }),
            _ => (
                failed(1010),
                Disposition::DeadLetter {
                    reason: DlqReason::PermanentError,
                    hold: false,
                },
            ),
        };
        calls.push(s.finish(l.entry.id, l.lease, end, disposition, 1010));
    }
    // Entry 0 acked a second time in the same group, and entry 4 under a lease it never had.
    calls.push(ack(&s, &leased[0], 1010));
    let mut forged = leased[4].lease;
    forged.token += 1_000_000;
    calls.push(s.finish(
        leased[4].entry.id,
        forged,
        delivered(1010),
        Disposition::Delivered,
        1010,
    ));
    let answers = futures::future::join_all(calls).await;
    let shared = commits.load(Ordering::SeqCst) - before;
    assert!(
        (1..=2).contains(&shared),
        "{shared} commits for 42 finishes"
    );
    let fenced = |r: &Result<Finished, FinishError>| matches!(r, Err(FinishError::Fenced));
    assert_eq!(
        answers.iter().filter(|r| fenced(r)).count(),
        2,
        "{answers:?}"
    );
    assert!(fenced(&answers[40]) != fenced(&answers[0]), "{answers:?}");
    assert!(fenced(&answers[41]) && answers[4].is_ok(), "{answers:?}");
    assert!(answers[1..40].iter().all(Result::is_ok), "{answers:?}");
    for (i, l) in leased.iter().enumerate() {
        let fate = s
            .fate("/s", &l.event.event.id)
            .expect("fate")
            .expect("stored");
        let e = &fate.entries[0];
        assert!(e.lease.is_none(), "entry {i}: {e:?}");
        match i % 4 {
            0 => assert_eq!(
                (e.state, e.attempts.len()),
                (EntryState::Delivered, 1),
                "{i}"
            ),
            1 => {
                assert_eq!(
                    (e.state, e.due_at, e.attempts.len()),
                    (EntryState::Queued, 9000, 1)
                );
                assert_eq!(e.attempts[0].status, Some(503));
            }
            2 => assert_eq!(
                (e.state, e.due_at, e.attempts.len()),
                (EntryState::Queued, 8000, 0)
            ),
            _ => assert_eq!((e.state, fate.dlq.len()), (EntryState::Dead, 1), "{i}"),
        }
    }
    let stats = &s.queue_stats()["a"];
    assert_eq!((stats.queued, stats.dlq), (20, 10), "{stats:?}");
    // The retried and released entries are due again when their due times say.
    assert!(
        s.lease("a", 7999, 40, 1000)
            .await
            .expect("lease")
            .is_empty()
    );
    assert_eq!(s.lease("a", 8000, 40, 1000).await.expect("lease").len(), 10);
    assert_eq!(s.lease("a", 9000, 40, 1000).await.expect("lease").len(), 10);
}

#[tokio::test]
async fn an_expired_lease_cannot_ack_and_the_entry_is_released() {
    let s = RedbStore::in_memory().expect("store");
    s.accept(vec![new_event("/s", "1", &["a"], 1000)])
        .await
        .expect("accept");
    let slow = s.lease("a", 1000, 1, 100).await.expect("lease").remove(0);
    assert_eq!(s.reclaim_expired(1200), 1);
    let fast = s.lease("a", 1200, 1, 100).await.expect("lease").remove(0);
    assert_eq!(fast.entry.attempts.len(), 2);
    // The expired attempt is closed when the entry is leased again, not left open for good.
    let first = &fast.entry.attempts[0];
    assert_eq!(
        (first.result, first.finished_at),
        (Some(AttemptResult::Interrupted), Some(1100)),
        "{first:?}"
    );
    assert!(
        first
            .error
            .as_deref()
            .is_some_and(|e| e.contains("lease expired")),
        "{first:?}"
    );
    assert_eq!(fast.entry.attempts[1].result, None);
    let late = ack(&s, &slow, 1250).await;
    assert!(matches!(late, Err(FinishError::Fenced)), "{late:?}");
    ack(&s, &fast, 1250).await.expect("current lease acks");
    // Slower still: the late worker comes back after the new holder delivered the entry.
    let later = ack(&s, &slow, 1300).await;
    assert!(matches!(later, Err(FinishError::Fenced)), "{later:?}");
}

#[tokio::test]
async fn retries_wait_in_the_queue_and_dead_letters_keep_every_attempt() {
    let s = RedbStore::in_memory().expect("store");
    s.accept(vec![new_event("/s", "1", &["a"], 1000)])
        .await
        .expect("accept");
    let l = s.lease("a", 1000, 1, 100).await.expect("lease").remove(0);
    let fail = |at| AttemptEnd {
        finished_at: at,
        result: AttemptResult::Retryable,
        status: Some(500),
        error: Some("HTTP 500".into()),
        outbox: None,
    };
    s.finish(
        l.entry.id,
        l.lease,
        fail(1010),
        Disposition::Retry { due_at: 5000 },
        1010,
    )
    .await
    .expect("retry");
    assert!(s.lease("a", 4999, 1, 100).await.expect("lease").is_empty());
    let l = s.lease("a", 5000, 1, 100).await.expect("lease").remove(0);
    s.finish(
        l.entry.id,
        l.lease,
        fail(5010),
        Disposition::DeadLetter {
            reason: DlqReason::RetriesExhausted,
            hold: false,
        },
        5010,
    )
    .await
    .expect("dead-letter");
    let list = s.dlq_list(&DlqFilter::default(), None, 10).expect("list");
    assert_eq!(list.len(), 1);
    assert_eq!(list[0].attempt_count, 2);
    assert_eq!(list[0].reason, DlqReason::RetriesExhausted);
    assert_eq!(list[0].first_failure_at, 1010);
    assert_eq!(list[0].last_failure_at, 5010);
    assert_eq!(s.queue_stats()["a"].dlq, 1);
    let filtered = s
        .dlq_list(
            &DlqFilter {
                reason: Some(DlqReason::PermanentError),
                ..Default::default()
            },
            None,
            10,
        )
        .expect("list");
    assert!(filtered.is_empty());
}

/// `new_event` with the entries of `leased` targets asked to be leased at acceptance.
fn leasing(mut ne: NewEvent, leased: &[&str], lease_ms: i64) -> NewEvent {
    for t in &mut ne.targets {
        if leased.contains(&t.target_id.as_str()) {
            t.lease_ms = Some(lease_ms);
        }
    }
    ne
}

#[tokio::test]
async fn an_entry_leased_at_accept_is_in_flight_with_its_attempt_and_acks_under_that_lease() {
    let s = RedbStore::in_memory().expect("store");
    let ne = leasing(new_event("/s", "1", &["a", "b"], 1000), &["a"], 60_000);
    let (out, leased) = s.accept_leased(vec![ne]).await.expect("accept");
    assert_eq!(out, vec![AcceptOutcome::accepted(1)]);
    assert_eq!(leased.len(), 1, "only a asked for a lease");
    let l = &leased[0];
    assert_eq!(l.event, 0);
    assert_eq!(l.leased.entry.id, EntryId { event: 1, idx: 0 });
    assert_eq!(l.leased.entry.target_id, "a");
    assert_eq!(l.leased.lease.until, 61_000);
    assert_eq!(l.leased.entry.lease, Some(l.leased.lease));
    assert_eq!(l.leased.entry.attempts.len(), 1);
    assert_eq!(l.leased.entry.attempts[0].started_at, 1000);
    // The event handed over is the one a worker's lease would have read back.
    let read = s
        .with_events(vec![l.leased.entry.clone()], l.leased.lease)
        .expect("read back");
    assert_eq!(*read.leased[0].event, *l.leased.event);
    // What is durable says the same: leased, attempt started.
    let fate = s.fate("/s", "1").expect("fate").expect("known");
    assert_eq!(fate.entries[0], l.leased.entry);
    assert!(fate.entries[1].lease.is_none() && fate.entries[1].attempts.is_empty());
    // a's copy is in flight, not due; b's waits for its worker.
    assert_eq!(s.due_count("a", 2000, 10), 0);
    assert_eq!(s.due_count("b", 2000, 10), 1);
    assert_eq!(
        (s.queue_stats()["a"].in_flight, s.queue_stats()["a"].queued),
        (1, 0)
    );
    assert!(
        s.lease("a", 2000, 10, 5000)
            .await
            .expect("lease")
            .is_empty()
    );
    // A forged token is fenced; the handed lease acks.
    let forged = Lease {
        token: l.leased.lease.token + 1,
        ..l.leased.lease
    };
    assert!(matches!(
        s.finish(
            l.leased.entry.id,
            forged,
            delivered(1001),
            Disposition::Delivered,
            1001
        )
        .await,
        Err(FinishError::Fenced)
    ));
    ack(&s, &l.leased, 1001).await.expect("finish");
    let fate = s.fate("/s", "1").expect("fate").expect("known");
    assert_eq!(fate.entries[0].state, EntryState::Delivered);
    assert_eq!(fate.entries[0].attempts.len(), 1);
    assert_eq!(s.queue_stats()["a"].in_flight, 0);
}

#[tokio::test]
async fn no_lease_is_handed_for_a_duplicate_or_an_entry_over_its_queue_cap() {
    let s = RedbStore::in_memory().expect("store");
    s.accept(vec![new_event("/s", "1", &["a"], 1000)])
        .await
        .expect("accept");
    let dup = leasing(new_event("/s", "1", &["a"], 1001), &["a"], 60_000);
    let mut capped = leasing(new_event("/s", "2", &["a", "b"], 1001), &["a", "b"], 60_000);
    capped.targets[0].max_depth = Some(1);
    let (out, leased) = s.accept_leased(vec![dup, capped]).await.expect("accept");
    assert_eq!(
        out,
        vec![
            AcceptOutcome::Duplicate { seq: 1 },
            AcceptOutcome::Accepted {
                seq: 2,
                overflowed: vec!["a".to_owned()]
            }
        ]
    );
    // a's queue holds one entry already (its cap): that copy went to the DLQ; b's is leased.
    assert_eq!(leased.len(), 1);
    assert_eq!(
        (leased[0].event, leased[0].leased.entry.target_id.as_str()),
        (1, "b")
    );
    assert_eq!(s.queue_stats()["a"].dlq, 1);
    assert_eq!(s.queue_stats()["a"].in_flight, 0);
    assert_eq!(s.queue_stats()["b"].in_flight, 1);
}

#[tokio::test]
async fn a_lease_taken_at_accept_is_reclaimed_at_restart_with_its_attempt_counted() {
    let dir = tempfile::tempdir().expect("tempdir");
    let id = {
        let s = RedbStore::open_dir(dir.path(), StoreOptions::default()).expect("open");
        let ne = leasing(new_event("/s", "1", &["a"], 1000), &["a"], 60_000);
        let (_, leased) = s.accept_leased(vec![ne]).await.expect("accept");
        leased[0].leased.entry.id
        // dropped without an ack: the process holding the lease "died"
    };
    let s = when_free(|| RedbStore::open_dir(dir.path(), StoreOptions::default())).await;
    assert_eq!(s.next_due("a"), Some(1000));
    let l = s.lease("a", 1000, 10, 1000).await.expect("lease");
    assert_eq!(l.len(), 1);
    assert_eq!(l[0].entry.id, id);
    assert_eq!(l[0].entry.attempts.len(), 2);
    assert_eq!(
        l[0].entry.attempts[0].result,
        Some(AttemptResult::Interrupted)
    );
}

#[tokio::test]
async fn restart_reclaims_leases_and_keeps_due_times() {
    let dir = tempfile::tempdir().expect("tempdir");
    let id = {
        let s = RedbStore::open_dir(dir.path(), StoreOptions::default()).expect("open");
        s.accept(vec![
            new_event("/s", "1", &["a"], 1000),
            new_event("/s", "2", &["a"], 1000),
        ])
        .await
        .expect("accept");
        let l = s
            .lease("a", 1000, 1, 60_000)
            .await
            .expect("lease")
            .remove(0);
        let other = s
            .lease("a", 1000, 1, 60_000)
            .await
            .expect("lease")
            .remove(0);
        s.finish(
            other.entry.id,
            other.lease,
            AttemptEnd {
                finished_at: 1001,
                result: AttemptResult::Retryable,
                status: None,
                error: Some("conn".into()),
                outbox: None,
            },
            Disposition::Retry { due_at: 9000 },
            1001,
        )
        .await
        .expect("retry");
        l.entry.id
        // dropped without finishing: the lease is held by a "dead" process
    };
    // The committer thread of the old store may still hold the file briefly.
    let s = when_free(|| RedbStore::open_dir(dir.path(), StoreOptions::default())).await;
    assert_eq!(s.next_due("a"), Some(1000));
    let l = s.lease("a", 1000, 10, 1000).await.expect("lease");
    assert_eq!(
        l.len(),
        1,
        "only the reclaimed entry is due; the retry waits until 9000"
    );
    assert_eq!(l[0].entry.id, id);
    assert_eq!(l[0].entry.attempts.len(), 2);
    assert_eq!(
        l[0].entry.attempts[0].result,
        Some(AttemptResult::Interrupted)
    );
    assert_eq!(s.lease("a", 9000, 10, 1000).await.expect("lease").len(), 1);
}

/// Rows of `live`, read straight from the file.
fn live_rows(s: &RedbStore) -> Vec<(u64, u32)> {
    let db = s.read_db();
    let r = db.begin_read().expect("read");
    r.open_table(LIVE)
        .expect("live")
        .iter()
        .expect("iter")
        .map(|row| row.expect("row").0.value())
        .collect()
}

/// Accepts events `1..=n` from `/s` for targets `a` and `b`, at 1000.
async fn accept_ab(s: &RedbStore, n: u32) {
    s.accept(
        (1..=n)
            .map(|i| new_event("/s", &i.to_string(), &["a", "b"], 1000))
            .collect(),
    )
    .await
    .expect("accept");
}

/// An entry queued at acceptance is its event's fan-out and nothing more: no row in
/// `entries` or `live` until it changes. A restart finds it in the event's record, and a
/// leased one (which has its row) is reclaimed as before.
#[tokio::test]
async fn queued_entries_are_their_events_fan_out_and_survive_a_restart() {
    let dir = tempfile::tempdir().expect("tempdir");
    let leased = {
        let s = RedbStore::open_dir(dir.path(), StoreOptions::default()).expect("open");
        accept_ab(&s, 3).await;
        assert!(entry_rows(&s).is_empty(), "no entry rows at acceptance");
        assert!(live_rows(&s).is_empty());
        let fate = s.fate("/s", "2").expect("fate").expect("known");
        let states: Vec<(String, EntryState)> = fate
            .entries
            .iter()
            .map(|e| (e.target_id.clone(), e.state))
            .collect();
        assert_eq!(
            states,
            [
                ("a".to_string(), EntryState::Queued),
                ("b".to_string(), EntryState::Queued)
            ]
        );
        // One of `a` delivered, one leased by a process that then dies.
        let l = s.lease("a", 1000, 2, 60_000).await.expect("lease");
        assert_eq!(l.len(), 2);
        ack(&s, &l[0], 1001).await.expect("ack");
        assert_eq!(entry_rows(&s).values().sum::<usize>(), 2);
        assert!(live_rows(&s).is_empty(), "above the floor: no live rows");
        l[1].entry.id
    };
    let s = when_free(|| RedbStore::open_dir(dir.path(), StoreOptions::default())).await;
    let a = s.lease("a", 1000, 10, 60_000).await.expect("lease");
    let ids: Vec<EntryId> = a.iter().map(|l| l.entry.id).collect();
    assert_eq!(
        ids.len(),
        2,
        "the reclaimed one and the never leased one: {ids:?}"
    );
    assert!(ids.contains(&leased));
    let reclaimed = a.iter().find(|l| l.entry.id == leased).expect("reclaimed");
    assert_eq!(
        reclaimed.entry.attempts[0].result,
        Some(AttemptResult::Interrupted)
    );
    let b = s.lease("b", 1000, 10, 60_000).await.expect("lease");
    assert_eq!(b.len(), 3, "every entry of `b` came back from the fan-out");
    assert!(b.iter().all(|l| l.entry.attempts.len() == 1));
}

/// A sweep moves the entry floor past the events it may remove: their live entries get rows
/// in `entries` and `live` (so the sweep keeps those events, and a restart finds them there),
/// finished ones none; once delivered, everything goes.
#[tokio::test]
async fn a_sweep_moves_the_floor_and_live_entries_below_it_are_in_live() {
    let dir = tempfile::tempdir().expect("tempdir");
    {
        let s = RedbStore::open_dir(dir.path(), StoreOptions::default()).expect("open");
        accept_ab(&s, 4).await;
        deliver_all(&s).await;
        let stats = s.sweep(100_000, 5_000, 5_000).await.expect("sweep");
        assert_eq!((stats.events_removed, stats.pending), (0, 4));
        let mut live = live_rows(&s);
        live.sort_unstable();
        assert_eq!(live, [(1, 1), (2, 1), (3, 1), (4, 1)]);
        assert_eq!(entry_rows(&s).values().sum::<usize>(), 8);
        // New events above the floor are fan-out again.
        s.accept(vec![new_event("/s", "5", &["b"], 99_000)])
            .await
            .expect("accept");
        assert_eq!(entry_rows(&s).get(&5), None);
    }
    let s = when_free(|| RedbStore::open_dir(dir.path(), StoreOptions::default())).await;
    let b = s.lease("b", 100_000, 10, 60_000).await.expect("lease");
    assert_eq!(b.len(), 5);
    for l in &b {
        ack(&s, l, 100_001).await.expect("ack");
    }
    assert!(live_rows(&s).is_empty());
    let stats = s.sweep(100_000, 5_000, 5_000).await.expect("sweep");
    assert_eq!(stats.events_removed, 4, "event 5 is inside the retention");
    assert_eq!(s.record_counts().expect("counts").events, 1);
}

/// A backlog that crosses the floor at once is written a batch per group, at event
/// boundaries, and is all there after a restart.
#[tokio::test]
async fn a_backlog_crosses_the_floor_a_batch_per_group() {
    let dir = tempfile::tempdir().expect("tempdir");
    let every = std::time::Duration::from_millis(300);
    let opts = || StoreOptions {
        floor_every: Some(every),
        ..StoreOptions::default()
    };
    {
        let s = RedbStore::open_dir(dir.path(), opts()).expect("open");
        s.accept(
            (0..5000)
                .map(|i| new_event("/s", &i.to_string(), &["a"], 1000))
                .collect(),
        )
        .await
        .expect("accept");
        let above = |s: &RedbStore| s.record_counts().expect("counts").events_above_floor;
        assert_eq!(above(&s), 5000);
        // The first move after the interval sets the goal past the backlog; the next ones
        // write it.
        let mut seen = Vec::new();
        for _ in 0..2 {
            tokio::time::sleep(every + every / 4).await;
            s.put_target_state("t", json!({})).await.expect("op");
            seen.push(live_rows(&s).len());
        }
        for _ in 0..2 {
            s.put_target_state("t", json!({})).await.expect("op");
            seen.push(live_rows(&s).len());
        }
        assert_eq!(seen, [0, FLOOR_BATCH, 2 * FLOOR_BATCH, 5000]);
        assert_eq!(entry_rows(&s).len(), 5000);
        assert_eq!(above(&s), 0);
    }
    let s = when_free(|| RedbStore::open_dir(dir.path(), opts())).await;
    assert_eq!(
        s.lease("a", 2000, 6000, 60_000).await.expect("lease").len(),
        5000
    );
}

/// An event whose copy for one target its queue's cap refused keeps the entries of its other
/// targets in its record's fan-out: not written for the refused one, and kept when a redrive
/// routes the event again (which rewrites the record), the new entry taking the next index.
/// A job is written against the revision it was read at: a runner's step from a copy read
/// before an operator's pause is refused whole (nothing of it applied), and so is a second
/// creation of the same id.
#[tokio::test]
async fn a_job_step_from_a_copy_older_than_a_pause_is_refused_whole() {
    let dir = tempfile::tempdir().expect("tempdir");
    let s = RedbStore::open_dir(dir.path(), StoreOptions::default()).expect("open");
    let mut ne = new_event("/s", "1", &["capped"], 1000);
    ne.targets[0].max_depth = Some(0);
    s.accept(vec![ne]).await.expect("accept");
    let dlq_id = s.fate("/s", "1").expect("fate").expect("known").dlq[0].id;
    let j = job("redrive-1", JobKind::Redrive);
    let rev = s.put_job(j.clone()).await.expect("create");
    assert_eq!(rev, 1);
    let paused = Job {
        state: JobState::Paused,
        rev,
        ..j.clone()
    };
    assert_eq!(s.put_job(paused).await.expect("pause"), 2);
    let step = s
        .redrive_step(
            Job {
                moved: 1,
                cursor: dlq_id,
                rev,
                ..j.clone()
            },
            vec![RedriveAction::Route {
                dlq_id,
                matched_rules: vec!["r".into()],
                targets: new_event("/s", "1", &["c"], 0).targets,
            }],
            2000,
        )
        .await;
    assert!(
        matches!(&step, Err(StoreError::JobChanged(id)) if id == "redrive-1"),
        "{step:?}"
    );
    let fate = s.fate("/s", "1").expect("fate").expect("known");
    assert_eq!(fate.dlq.len(), 1, "the refused step moved nothing");
    assert!(fate.entries.is_empty());
    let stored = s.jobs().expect("jobs");
    assert_eq!(
        stored
            .iter()
            .map(|j| (j.state, j.moved, j.rev))
            .collect::<Vec<_>>(),
        [(JobState::Paused, 0, 2)]
    );
    assert!(matches!(s.put_job(j).await, Err(StoreError::JobChanged(_))));
}

/// A job write that lost its race is that request's refusal alone: the requests committed
/// with it succeed, and the store is not reopened (which gave up the leases in flight: their
/// deliveries were sent again, and could run out of attempts).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_job_write_fails_only_itself() {
    let dir = tempfile::tempdir().expect("tempdir");
    let s = RedbStore::open_dir(dir.path(), StoreOptions::default()).expect("open");
    s.accept(vec![new_event("/s", "1", &["a"], 1000)])
        .await
        .expect("accept");
    let leased = s.lease("a", 1000, 10, 60_000).await.expect("lease");
    assert_eq!(leased.len(), 1);
    let j = job("redrive-1", JobKind::Redrive);
    s.put_job(j.clone()).await.expect("create");
    for n in 2..20 {
        // Another creation of the same job (revision 0), alongside an accept.
        let (stale, other) = tokio::join!(
            s.put_job(j.clone()),
            s.accept(vec![new_event("/s", &n.to_string(), &["b"], 1000)])
        );
        assert!(matches!(stale, Err(StoreError::JobChanged(_))), "{stale:?}");
        other.expect("a request committed with the refused one");
    }
    ack(&s, &leased[0], 1001)
        .await
        .expect("the lease taken before the refusals still holds");
    assert_eq!(s.queue_stats()["b"].queued, 18);
}

#[tokio::test]
async fn a_refused_copy_is_left_out_of_the_fan_out_and_a_routed_redrive_keeps_the_rest() {
    let dir = tempfile::tempdir().expect("tempdir");
    let s = RedbStore::open_dir(dir.path(), StoreOptions::default()).expect("open");
    let mut ne = new_event("/s", "1", &["capped", "b"], 1000);
    ne.targets[0].max_depth = Some(0);
    s.accept(vec![ne]).await.expect("accept");
    let fate = s.fate("/s", "1").expect("fate").expect("known");
    let ids: Vec<String> = fate.entries.iter().map(|e| e.id.to_string()).collect();
    assert_eq!(ids, ["1.1"], "only b's entry; capped's copy is in the DLQ");
    assert_eq!(fate.dlq.len(), 1);
    s.redrive_step(
        job("redrive-1", JobKind::Redrive),
        vec![RedriveAction::Route {
            dlq_id: fate.dlq[0].id,
            matched_rules: vec!["r".into()],
            targets: new_event("/s", "1", &["c"], 0).targets,
        }],
        2000,
    )
    .await
    .expect("redrive");
    let fate = s.fate("/s", "1").expect("fate").expect("known");
    let got: Vec<(String, String)> = fate
        .entries
        .iter()
        .map(|e| (e.id.to_string(), e.target_id.clone()))
        .collect();
    assert_eq!(
        got,
        [
            ("1.1".to_string(), "b".to_string()),
            ("1.2".to_string(), "c".to_string())
        ]
    );
    drop(s);
    let s = when_free(|| RedbStore::open_dir(dir.path(), StoreOptions::default())).await;
    assert_eq!(
        s.lease("b", 2000, 10, 60_000).await.expect("lease").len(),
        1
    );
    assert_eq!(
        s.lease("c", 2000, 10, 60_000).await.expect("lease").len(),
        1
    );
}

/// Leases the next entry of target `a` due at `now` and dead-letters it as a permanent error.
async fn dead_letter_next(s: &RedbStore, now: Millis) {
    let l = s.lease("a", now, 1, 60_000).await.expect("lease").remove(0);
    let end = AttemptEnd {
        finished_at: now + 1,
        result: AttemptResult::Permanent,
        status: Some(400),
        error: Some("HTTP 400".into()),
        outbox: None,
    };
    let dead = Disposition::DeadLetter {
        reason: DlqReason::PermanentError,
        hold: false,
    };
    s.finish(l.entry.id, l.lease, end, dead, now + 1)
        .await
        .expect("dead-letter");
}

/// Groups that change neither counter (leases and acks only) leave `meta` alone: after a
/// restart, event sequence numbers and DLQ ids still continue where they were.
#[tokio::test]
async fn counters_continue_after_a_restart_that_followed_lease_and_ack_groups() {
    let dir = tempfile::tempdir().expect("tempdir");
    {
        let s = RedbStore::open_dir(dir.path(), StoreOptions::default()).expect("open");
        s.accept(vec![
            new_event("/s", "1", &["a"], 1000),
            new_event("/s", "2", &["a"], 1000),
        ])
        .await
        .expect("accept");
        dead_letter_next(&s, 1000).await;
        // The last groups before the restart are a lease and an ack, nothing else.
        deliver_all(&s).await;
    }
    let s = when_free(|| RedbStore::open_dir(dir.path(), StoreOptions::default())).await;
    let r = s
        .accept(vec![new_event("/s", "3", &["a"], 3000)])
        .await
        .expect("accept");
    assert_eq!(r, vec![AcceptOutcome::accepted(3)]);
    dead_letter_next(&s, 3000).await;
    let mut ids: Vec<u64> = s
        .dlq_list(&DlqFilter::default(), None, 10)
        .expect("list")
        .iter()
        .map(|d| d.id)
        .collect();
    ids.sort_unstable();
    assert_eq!(
        ids,
        vec![1, 2],
        "the second DLQ entry did not overwrite the first"
    );
    // Both earlier events keep their fates: nothing was overwritten by the new accept.
    for (id, state) in [("1", EntryState::Dead), ("2", EntryState::Delivered)] {
        let fate = s.fate("/s", id).expect("fate").expect("known");
        assert_eq!(fate.entries[0].state, state, "event {id}");
    }
}

/// Power loss: only what was flushed survives. Every accept that resolved must be there.
#[tokio::test]
async fn accepted_events_survive_a_power_cut() {
    let disk = SimulatedDisk::new();
    let s = RedbStore::with_backend(disk.backend(), StoreOptions::default()).expect("open");
    let mut tasks = Vec::new();
    for i in 0..200 {
        let s = s.clone();
        tasks.push(tokio::spawn(async move {
            s.accept(vec![new_event("/s", &i.to_string(), &["a"], 1000)])
                .await
                .map(|_| i)
        }));
    }
    let mut acked = Vec::new();
    for t in tasks {
        if let Ok(i) = t.await.expect("join") {
            acked.push(i);
        }
    }
    let image = disk.power_cut();
    drop(s);
    let s2 = RedbStore::with_backend(
        SimulatedDisk::from_image(image).backend(),
        StoreOptions::default(),
    )
    .expect("reopen after power cut");
    assert_present(&s2, acked.iter().map(ToString::to_string));
    assert_eq!(s2.queue_stats()["a"].queued, acked.len() as u64);
}

#[tokio::test]
async fn a_failing_disk_fails_the_accept_and_recovers() {
    let disk = SimulatedDisk::new();
    let d2 = disk.clone();
    let s: Arc<RedbStore> =
        RedbStore::with_backend_factory(move || d2.backend(), StoreOptions::default())
            .expect("open");
    s.accept(vec![new_event("/s", "0", &["a"], 1000)])
        .await
        .expect("accept before the failure");
    disk.set_failing(true);
    assert!(
        s.accept(vec![new_event("/s", "1", &["a"], 1000)])
            .await
            .is_err()
    );
    // Still failing: the reopen fails too, and so does the next write.
    assert!(
        s.accept(vec![new_event("/s", "1", &["a"], 1000)])
            .await
            .is_err()
    );
    // Readers fail while the database is closed, and the store says it takes no writes...
    assert!(s.fate("/s", "0").is_err());
    assert!(!s.writable());
    disk.set_failing(false);
    // ...and come back once the disk heals, without waiting for a write to trigger the reopen.
    let mut back = false;
    for _ in 0..100 {
        if s.fate("/s", "0").is_ok_and(|f| f.is_some()) {
            back = true;
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    assert!(back, "readers still fail after the disk healed");
    assert!(s.writable());
    // Healed: the committer reopened the database and the write goes through, as the first
    // copy (nothing of the failed attempts was stored), with the next sequence number.
    let r = s
        .accept(vec![new_event("/s", "1", &["a"], 1000)])
        .await
        .expect("accept after the disk healed");
    assert_eq!(r, vec![AcceptOutcome::accepted(2)]);
    // The index was rebuilt from what is durable: both events are queued for `a`.
    assert_eq!(s.queue_stats()["a"].queued, 2);
    assert!(s.fate("/s", "0").expect("fate").is_some());
}

/// Sweep calls as the router's sweeper makes them (again while `more`); the total removed.
async fn sweep_until_done(s: &RedbStore, now: Millis) -> (u64, u64) {
    let (mut removed, mut calls) = (0, 0);
    loop {
        let stats = s.sweep(now, 5_000, 5_000).await.expect("sweep");
        removed += stats.events_removed;
        calls += 1;
        assert!(calls < 100, "the sweep does not finish");
        if !stats.more {
            return (removed, calls);
        }
    }
}

#[tokio::test]
async fn a_drained_backlog_past_retention_is_swept_in_one_pass_not_a_batch_per_interval() {
    let dir = tempfile::tempdir().expect("tempdir");
    let opts = StoreOptions {
        sweep_batch: Some(4),
        ..StoreOptions::default()
    };
    let s = RedbStore::open_dir(dir.path(), opts).expect("open");
    let events = (0..20)
        .map(|i| new_event("/s", &i.to_string(), &["a"], 1000))
        .collect();
    s.accept(events).await.expect("accept");
    // Past retention while still queued (a target down for longer than the retention): kept.
    assert_eq!(sweep_until_done(&s, 11_000).await.0, 0);
    // Still referenced: the revisit stops after a pass that frees nothing (no busy loop).
    let (removed, calls) = sweep_until_done(&s, 11_500).await;
    assert_eq!((removed, calls), (0, 1));
    // The target comes back and the backlog drains.
    for l in s.lease("a", 12_000, 20, 1000).await.expect("lease") {
        ack(&s, &l, 12_001).await.expect("ack");
    }
    // The next sweep interval removes all of it, not one batch of 4 per interval.
    assert_eq!(sweep_until_done(&s, 13_000).await.0, 20);
    assert_eq!(s.record_counts().expect("counts").events, 0);
}

#[tokio::test]
async fn sweep_removes_unreferenced_events_and_revisits_kept_ones() {
    let s = RedbStore::in_memory().expect("store");
    s.accept(vec![
        new_event("/s", "1", &["a"], 1000),
        new_event("/s", "2", &[], 1000),
    ])
    .await
    .expect("accept");
    let stats = s.sweep(1000 + 10_000, 5_000, 5_000).await.expect("sweep");
    // Event 2 had no targets: gone (its dedup key goes later, with its run). Event 1 still
    // has a live entry.
    assert_eq!(
        (stats.events_removed, stats.dedup_expired, stats.pending),
        (1, 0, 1)
    );
    assert!(s.fate("/s", "2").expect("fate").is_none());
    assert!(
        s.fate("/s", "1").expect("fate").is_some(),
        "a referenced event stays visible"
    );
    // Its key is past the window: the same (source, id) is accepted as new.
    let mut again = new_event("/s", "1", &[], 11_000);
    again.dedup_window_ms = 5_000;
    assert_eq!(
        s.accept(vec![again]).await.expect("accept")[0],
        AcceptOutcome::accepted(3)
    );
    // Once delivered, the next sweep removes event 1 (but not the new key pointing at seq 3).
    let l = s
        .lease("a", 11_000, 1, 1000)
        .await
        .expect("lease")
        .remove(0);
    ack(&s, &l, 11_001).await.expect("finish");
    let stats = s.sweep(12_000, 5_000, 5_000).await.expect("sweep");
    assert_eq!(stats.events_removed, 1);
    assert_eq!(
        stats.dedup_expired, 0,
        "the key now belongs to the newer event"
    );
    assert!(
        s.fate("/s", "1")
            .expect("fate")
            .is_some_and(|f| f.event.seq == 3)
    );
}

#[tokio::test]
async fn a_drained_backlog_gives_its_disk_space_back() {
    let dir = tempfile::tempdir().expect("tempdir");
    let opts = StoreOptions {
        compact_min_bytes: Some(1 << 20),
        ..Default::default()
    };
    let s = RedbStore::open_dir(dir.path(), opts).expect("open");
    for chunk in 0..20 {
        accept_padded(&s, chunk).await.expect("accept");
    }
    let peak = s.disk_bytes();
    deliver_all(&s).await;
    // Past retention: everything is removed (in batches), then the committer compacts.
    for _ in 0..4 {
        s.sweep(1_000_000, 1000, 1000).await.expect("sweep");
    }
    // A sweep starts the check (on a thread of its own); the compaction runs after the
    // committer's next group once the check has found it worthwhile. Bounded: 30 s.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    let mut after = s.disk_bytes();
    while after * 2 >= peak && std::time::Instant::now() < deadline {
        s.sweep(1_000_000, 1000, 1000).await.expect("sweep");
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        after = s.disk_bytes();
    }
    assert!(peak > 4 << 20, "peak {peak}");
    assert!(
        after * 2 < peak,
        "file stayed large after the backlog drained: peak {peak}, after {after}"
    );
}

/// Right after a compaction redb's next write grows the file by about its size, which by the
/// check's measure (file larger than twice its live data) looks worth compacting again: with
/// live data held (nothing to give back) a second compaction must not follow at the next
/// sweeps. Before the floor, one ran after every sweep.
#[tokio::test]
async fn a_compaction_is_not_repeated_when_the_file_only_regrew() {
    let dir = tempfile::tempdir().expect("tempdir");
    let compactions = Arc::new(AtomicU64::new(0));
    let counter = compactions.clone();
    let opts = StoreOptions {
        compact_min_bytes: Some(1 << 20),
        on_compact: Some(Arc::new(move |_| {
            counter.fetch_add(1, Ordering::SeqCst);
        })),
        ..Default::default()
    };
    let s = RedbStore::open_dir(dir.path(), opts).expect("open");
    // A backlog, delivered and swept: the file is mostly free, the first compaction runs.
    for chunk in 0..20 {
        accept_padded(&s, chunk).await.expect("accept");
    }
    deliver_all(&s).await;
    // Sweeps (each followed by a group, after which a compaction found worthwhile runs) until
    // the first compaction has run and, with its passes done, no other follows for 1 s.
    let st = &s;
    let tick = |n: usize| async move {
        st.sweep(1_000_000, 1000, 1000).await.expect("sweep");
        let r = st
            .accept(vec![new_event("/s", &format!("tick{n}"), &[], 1_000_000)])
            .await;
        assert!(matches!(r, Ok(_) | Err(StoreError::Compacting)), "{r:?}");
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    };
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    let (mut seen, mut quiet) = (0, 0);
    for n in 0.. {
        tick(n).await;
        let now = compactions.load(Ordering::SeqCst);
        quiet = if now == seen { quiet + 1 } else { 0 };
        seen = now;
        if (seen > 0 && quiet >= 20) || std::time::Instant::now() > deadline {
            break;
        }
    }
    assert!(seen > 0, "no first compaction");
    // New live data (queued, kept): the file regrows; 2 s of sweeps find nothing to remove.
    for chunk in 100..110 {
        while let Err(e) = accept_padded(&s, chunk).await {
            assert!(matches!(e, StoreError::Compacting), "{e}");
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        }
    }
    for n in 1000..1040 {
        tick(n).await;
    }
    assert_eq!(
        compactions.load(Ordering::SeqCst),
        seen,
        "compacted again though the file only regrew (file {} bytes)",
        s.disk_bytes()
    );
}

#[tokio::test]
async fn while_compacting_new_work_is_refused_at_once_and_resumes_after() {
    let s = RedbStore::in_memory().expect("store");
    s.accept(vec![new_event("/s", "1", &["a"], 1000)])
        .await
        .expect("accept");
    s.compacting.store(true, Ordering::Release);
    // The compaction holds the database: a request must get an answer (503 upstream), not
    // wait. Bounded so a regression fails instead of hanging.
    let bounded = std::time::Duration::from_secs(5);
    let r = tokio::time::timeout(bounded, s.accept(vec![new_event("/s", "2", &["a"], 1000)]))
        .await
        .expect("accept answered at once");
    assert!(matches!(r, Err(StoreError::Compacting)), "{r:?}");
    let r = tokio::time::timeout(bounded, s.lease("a", 1000, 10, 60_000))
        .await
        .expect("lease answered at once");
    assert!(matches!(r, Err(StoreError::Compacting)), "{r:?}");
    // A reader that finds the slot taken by the compaction is refused too.
    let held = s.db.write().unwrap_or_else(|p| p.into_inner());
    assert!(matches!(s.fate("/s", "1"), Err(StoreError::Compacting)));
    drop(held);
    s.compacting.store(false, Ordering::Release);
    s.accept(vec![new_event("/s", "2", &["a"], 1000)])
        .await
        .expect("accepted after the compaction");
    assert_eq!(
        s.lease("a", 1000, 10, 60_000).await.expect("lease").len(),
        2
    );
}

fn keyed(id: &str, key: &str, at: Millis) -> NewEvent {
    let mut e = new_event("/s", id, &["a"], at);
    e.targets[0].ordering_key = Some(key.into());
    e
}

#[tokio::test]
async fn one_entry_per_key_in_flight_and_in_order() {
    let s = RedbStore::in_memory().expect("store");
    s.accept(vec![
        keyed("1", "k1", 1000),
        keyed("2", "k1", 1000),
        keyed("3", "k2", 1000),
        new_event("/s", "4", &["a"], 1000),
    ])
    .await
    .expect("accept");
    assert_eq!(
        s.due_count("a", 1000, 10),
        3,
        "k1's second entry waits behind its first"
    );
    let first = s.lease("a", 1000, 10, 60_000).await.expect("lease");
    let ids: Vec<String> = first.iter().map(|l| l.event.event.id.clone()).collect();
    assert_eq!(ids, vec!["1", "3", "4"]);
    // A retrying head blocks its key only.
    let head = first
        .iter()
        .find(|l| l.event.event.id == "1")
        .expect("head");
    let fail = AttemptEnd {
        finished_at: 1001,
        result: AttemptResult::Retryable,
        status: Some(500),
        error: None,
        outbox: None,
    };
    s.finish(
        head.entry.id,
        head.lease,
        fail,
        Disposition::Retry { due_at: 5000 },
        1001,
    )
    .await
    .expect("retry");
    assert!(
        s.lease("a", 2000, 10, 60_000)
            .await
            .expect("lease")
            .is_empty(),
        "event 2 waits for event 1"
    );
    let again = s.lease("a", 5000, 10, 60_000).await.expect("lease");
    assert_eq!(again.len(), 1);
    assert_eq!(again[0].event.event.id, "1");
    // Dead-lettered with hold: the key stays blocked until released.
    s.finish(
        again[0].entry.id,
        again[0].lease,
        delivered(5001),
        Disposition::DeadLetter {
            reason: DlqReason::PermanentError,
            hold: true,
        },
        5001,
    )
    .await
    .expect("dead-letter");
    assert_eq!(s.held_keys("a"), vec!["k1".to_string()]);
    assert!(
        s.lease("a", 6000, 10, 60_000)
            .await
            .expect("lease")
            .is_empty(),
        "k1 is held"
    );
    assert!(s.release_key("a", "k1").await.expect("release"));
    let next = s.lease("a", 6000, 10, 60_000).await.expect("lease");
    assert_eq!(next.len(), 1);
    assert_eq!(next[0].event.event.id, "2");
}

/// A redriven dead letter goes back at the head of its key, but not while a later entry of
/// the key is in flight (it was leased at once, two entries of the key then being delivered
/// together, the older after the newer); and a redrive releases the key its dead letter
/// held (the job used to say "done" while the key stayed stopped).
#[tokio::test]
async fn a_redriven_keyed_entry_waits_for_its_keys_flight_and_releases_its_hold() {
    let s = RedbStore::in_memory().expect("store");
    s.accept(vec![
        keyed("1", "k", 1000),
        keyed("2", "k", 1000),
        keyed("3", "k", 1000),
    ])
    .await
    .expect("accept");
    let ids =
        |v: &[Leased]| -> Vec<String> { v.iter().map(|l| l.event.event.id.clone()).collect() };
    let dead = |hold| Disposition::DeadLetter {
        reason: DlqReason::PermanentError,
        hold,
    };
    let l1 = s.lease("a", 1000, 10, 60_000).await.expect("lease");
    assert_eq!(ids(&l1), ["1"]);
    s.finish(
        l1[0].entry.id,
        l1[0].lease,
        delivered(1001),
        dead(false),
        1001,
    )
    .await
    .expect("dead letter");
    let l2 = s.lease("a", 2000, 10, 60_000).await.expect("lease");
    assert_eq!(ids(&l2), ["2"]);
    let redrive = |id: &'static str, n: u64| {
        let s = &s;
        async move {
            let dlq_id = s.fate("/s", id).expect("fate").expect("known").dlq[0].id;
            let j = job(&format!("redrive-{n}"), JobKind::Redrive);
            let rev = s.put_job(j.clone()).await.expect("create");
            s.redrive_step(
                Job { rev, ..j },
                vec![RedriveAction::Requeue { dlq_id }],
                2500,
            )
            .await
            .expect("redrive");
        }
    };
    redrive("1", 1).await;
    assert!(
        s.lease("a", 3000, 10, 60_000)
            .await
            .expect("lease")
            .is_empty(),
        "2 is in flight: neither the redriven 1 nor 3 goes"
    );
    ack(&s, &l2[0], 3001).await.expect("ack");
    let next = s.lease("a", 3002, 10, 60_000).await.expect("lease");
    assert_eq!(ids(&next), ["1"], "back at the head of its key");
    ack(&s, &next[0], 3003).await.expect("ack");
    let next = s.lease("a", 3004, 10, 60_000).await.expect("lease");
    assert_eq!(ids(&next), ["3"]);
    ack(&s, &next[0], 3005).await.expect("ack");

    // Held: the redrive releases the key, and its dead letter goes first.
    s.accept(vec![keyed("4", "h", 4000), keyed("5", "h", 4000)])
        .await
        .expect("accept");
    let l4 = s.lease("a", 4000, 10, 60_000).await.expect("lease");
    assert_eq!(ids(&l4), ["4"]);
    s.finish(
        l4[0].entry.id,
        l4[0].lease,
        delivered(4001),
        dead(true),
        4001,
    )
    .await
    .expect("dead letter");
    assert_eq!(s.held_keys("a"), vec!["h".to_string()]);
    redrive("4", 2).await;
    assert!(s.held_keys("a").is_empty(), "released by the redrive");
    let next = s.lease("a", 5000, 10, 60_000).await.expect("lease");
    assert_eq!(ids(&next), ["4"]);
}

/// A held key is released by the redrive of the dead letter that holds it, not of an older
/// dead letter of the key (whose redrive released the later one's hold, and the key's next
/// entries overtook it); a hold whose dead letter has been purged is released by any.
#[tokio::test]
async fn only_the_dead_letter_holding_a_key_releases_it() {
    let s = RedbStore::in_memory().expect("store");
    s.accept(vec![
        keyed("1", "k", 1000),
        keyed("2", "k", 1000),
        keyed("3", "k", 1000),
    ])
    .await
    .expect("accept");
    let ids =
        |v: &[Leased]| -> Vec<String> { v.iter().map(|l| l.event.event.id.clone()).collect() };
    let dead_letter = |l: Leased, hold: bool, at: Millis| {
        let s = &s;
        async move {
            let dead = Disposition::DeadLetter {
                reason: DlqReason::PermanentError,
                hold,
            };
            s.finish(l.entry.id, l.lease, delivered(at), dead, at)
                .await
                .expect("dead letter");
        }
    };
    let redrive = |dlq_id: u64, n: u64, at: Millis| {
        let s = &s;
        async move {
            let j = job(&format!("redrive-{n}"), JobKind::Redrive);
            let rev = s.put_job(j.clone()).await.expect("create");
            s.redrive_step(
                Job { rev, ..j },
                vec![RedriveAction::Requeue { dlq_id }],
                at,
            )
            .await
            .expect("redrive");
        }
    };
    let dlq_of = |id: &str| s.fate("/s", id).expect("fate").expect("known").dlq[0].id;
    let l = s.lease("a", 1000, 10, 60_000).await.expect("lease");
    assert_eq!(ids(&l), ["1"]);
    dead_letter(l.into_iter().next().expect("1"), false, 1001).await;
    let l = s.lease("a", 1100, 10, 60_000).await.expect("lease");
    assert_eq!(ids(&l), ["2"]);
    dead_letter(l.into_iter().next().expect("2"), true, 1101).await;
    redrive(dlq_of("1"), 1, 2000).await;
    assert_eq!(s.held_keys("a"), vec!["k".to_string()], "2 still holds k");
    assert!(
        s.lease("a", 2100, 10, 60_000)
            .await
            .expect("lease")
            .is_empty(),
        "neither the redriven 1 nor 3 goes while 2 is dead"
    );
    redrive(dlq_of("2"), 2, 2200).await;
    assert!(s.held_keys("a").is_empty(), "released with its holder");
    for (want, at) in [("1", 3000), ("2", 3100), ("3", 3200)] {
        let l = s.lease("a", at, 10, 60_000).await.expect("lease");
        assert_eq!(ids(&l), [want]);
        ack(&s, &l[0], at + 1).await.expect("ack");
    }

    // Its holder purged, the hold goes with the redrive of another dead letter of the key.
    s.accept(vec![keyed("4", "h", 4000), keyed("5", "h", 4000)])
        .await
        .expect("accept");
    let l = s.lease("a", 4000, 10, 60_000).await.expect("lease");
    dead_letter(l.into_iter().next().expect("4"), false, 4001).await;
    let l = s.lease("a", 4100, 10, 60_000).await.expect("lease");
    dead_letter(l.into_iter().next().expect("5"), true, 4101).await;
    assert_eq!(s.purge_dlq(vec![dlq_of("5")]).await.expect("purge"), 1);
    redrive(dlq_of("4"), 3, 5000).await;
    assert!(s.held_keys("a").is_empty(), "its holder is gone");
    let l = s.lease("a", 5100, 10, 60_000).await.expect("lease");
    assert_eq!(ids(&l), ["4"]);
}

/// The entry a key's others wait behind (`key_head`), and how many wait so
/// (`queued_behind_keys`), read from the index.
#[tokio::test]
async fn a_keys_head_and_the_entries_behind_it_are_known() {
    let s = RedbStore::in_memory().expect("store");
    s.accept(vec![
        keyed("1", "k", 1000),
        keyed("2", "k", 1000),
        keyed("3", "k", 1000),
        new_event("/s", "4", &["a"], 1000),
    ])
    .await
    .expect("accept");
    let first = s.fate("/s", "1").expect("fate").expect("known").entries[0].id;
    let head = s.key_head("a", "k").expect("a head");
    assert_eq!((head.entry, head.in_flight), (first, false));
    assert_eq!(s.queue_stats()["a"].queued_behind_keys, 2);
    let l = s.lease("a", 1000, 10, 60_000).await.expect("lease");
    assert_eq!(l.len(), 2, "1 and the unkeyed 4");
    assert_eq!(s.key_head("a", "k").map(|h| h.in_flight), Some(true));
    assert!(s.key_head("a", "none").is_none());
}

/// Releasing a held key first moves its waiting entries past max_age to the DLQ together
/// (`dead_letter_expired_of_key`): younger ones, other keys and the hold stay as they are,
/// and what it leaves goes back due as it was.
#[tokio::test]
async fn a_keys_expired_entries_go_to_the_dlq_together() {
    let s = RedbStore::in_memory().expect("store");
    s.accept(vec![
        keyed("1", "k", 1000),
        keyed("2", "k", 1100),
        keyed("3", "k", 1200),
        keyed("4", "k", 5000),
        keyed("5", "other", 1000),
    ])
    .await
    .expect("accept");
    let l = s.lease("a", 1000, 10, 60_000).await.expect("lease");
    let head = l.iter().find(|l| l.event.event.id == "1").expect("head");
    s.finish(
        head.entry.id,
        head.lease,
        delivered(1001),
        Disposition::DeadLetter {
            reason: DlqReason::PermanentError,
            hold: true,
        },
        1001,
    )
    .await
    .expect("dead letter");
    let other = l.iter().find(|l| l.event.event.id == "5").expect("other");
    s.finish(
        other.entry.id,
        other.lease,
        delivered(1001),
        Disposition::Retry { due_at: 1500 },
        1001,
    )
    .await
    .expect("retry");
    assert_eq!(s.held_keys("a"), vec!["k".to_string()]);
    let n = s
        .dead_letter_expired_of_key("a", "k", 4000, "expired", 6000)
        .await
        .expect("dead letter");
    assert_eq!(n, 2, "2 and 3; 4 is younger");
    for id in ["2", "3"] {
        let fate = s.fate("/s", id).expect("fate").expect("known");
        assert_eq!(fate.dlq[0].reason, DlqReason::MaxAgeExceeded, "{id}");
    }
    assert_eq!(s.held_keys("a"), vec!["k".to_string()], "the hold stays");
    assert!(s.release_key("a", "k").await.expect("release"));
    let next = s.lease("a", 6000, 10, 60_000).await.expect("lease");
    let mut ids: Vec<String> = next.iter().map(|l| l.event.event.id.clone()).collect();
    ids.sort();
    assert_eq!(ids, ["4", "5"], "the key goes on with its younger entry");
}

/// Under `on_dead_letter: hold`, a copy the depth cap refused (`target_overflow`) holds its
/// key like any dead letter: the key's entries wait (a later event overtook it before), the
/// hold survives a restart, and its redrive releases the key with the copy back in its
/// event's place, before the events of the key accepted after it.
#[tokio::test]
async fn an_overflowed_copy_holds_its_key_until_redriven() {
    let dir = tempfile::tempdir().expect("tempdir");
    let capped = |id: &str, key: &str, at| {
        let mut ne = keyed(id, key, at);
        ne.targets[0].max_depth = Some(2);
        ne.targets[0].hold_key = true;
        ne
    };
    let ids =
        |v: &[Leased]| -> Vec<String> { v.iter().map(|l| l.event.event.id.clone()).collect() };
    let s = RedbStore::open_dir(dir.path(), StoreOptions::default()).expect("open");
    s.accept(vec![
        capped("x", "X", 1000),
        capped("o1", "K", 1001),
        capped("o2", "K", 1002),
    ])
    .await
    .expect("accept");
    let fate = s.fate("/s", "o2").expect("fate").expect("known");
    assert_eq!(fate.dlq[0].reason, DlqReason::TargetOverflow);
    let dlq_id = fate.dlq[0].id;
    assert_eq!(s.held_keys("a"), vec!["K".to_string()]);
    let first = s.lease("a", 2000, 10, 60_000).await.expect("lease");
    assert_eq!(ids(&first), ["x"], "o1 waits: its key is held");
    ack(&s, &first[0], 2001).await.expect("ack");
    s.accept(vec![capped("o3", "K", 3000)])
        .await
        .expect("accept");
    assert!(
        s.index().target("a").ready.is_empty(),
        "o1, ready before the hold, is parked with the rest of its key"
    );
    drop(s);
    let s = when_free(|| RedbStore::open_dir(dir.path(), StoreOptions::default())).await;
    assert_eq!(s.held_keys("a"), vec!["K".to_string()]);
    assert!(
        s.lease("a", 3100, 10, 60_000)
            .await
            .expect("lease")
            .is_empty()
    );
    let j = job("redrive-overflow", JobKind::Redrive);
    let rev = s.put_job(j.clone()).await.expect("create");
    s.redrive_step(
        Job { rev, ..j },
        vec![RedriveAction::Route {
            dlq_id,
            matched_rules: vec!["r".into()],
            targets: vec![NewEntry {
                max_depth: None,
                ..capped("o2", "K", 0).targets.remove(0)
            }],
        }],
        4000,
    )
    .await
    .expect("redrive");
    assert!(s.held_keys("a").is_empty(), "released by the redrive");
    let mut order = Vec::new();
    for at in [4000, 4100, 4200] {
        let next = s.lease("a", at, 10, 60_000).await.expect("lease");
        assert_eq!(next.len(), 1, "one at a time: {order:?}");
        order.push(next[0].event.event.id.clone());
        ack(&s, &next[0], at + 1).await.expect("ack");
    }
    assert_eq!(order, ["o1", "o2", "o3"]);
}

/// A key with more entries behind its retrying first one than a lease scans: other keys and
/// unkeyed entries still go, and the next due time is the first one's retry, not one of the
/// waiting entries' past due times (which had the worker poll every millisecond). The same
/// after a restart, which rebuilds the index.
#[tokio::test]
async fn a_long_blocked_key_starves_neither_other_keys_nor_the_worker() {
    let dir = tempfile::tempdir().expect("tempdir");
    let blocked = SCAN_LIMIT + 500;
    {
        let s = RedbStore::open_dir(dir.path(), StoreOptions::default()).expect("open");
        for chunk in 0..blocked.div_ceil(1000) {
            let batch = (chunk * 1000..((chunk + 1) * 1000).min(blocked))
                .map(|i| keyed(&format!("a{i}"), "hot", 1000))
                .collect();
            s.accept(batch).await.expect("accept");
        }
        let head = s.lease("a", 1000, 10, 60_000).await.expect("lease");
        assert_eq!(head.len(), 1, "one entry of the key at a time");
        let fail = AttemptEnd {
            finished_at: 1001,
            result: AttemptResult::Retryable,
            status: Some(500),
            error: None,
            outbox: None,
        };
        s.finish(
            head[0].entry.id,
            head[0].lease,
            fail,
            Disposition::Retry { due_at: 9000 },
            1001,
        )
        .await
        .expect("retry");
        assert_eq!(s.next_due("a"), Some(9000));
        assert_eq!(s.due_count("a", 2000, 10), 0);
        s.accept(vec![
            keyed("b", "cold", 2000),
            new_event("/s", "plain", &["a"], 2000),
        ])
        .await
        .expect("accept");
        assert_eq!(s.queue_stats()["a"].queued, blocked as u64 + 2);
    }
    let s = when_free(|| RedbStore::open_dir(dir.path(), StoreOptions::default())).await;
    assert_eq!(s.next_due("a"), Some(2000));
    let mut ids: Vec<String> = s
        .lease("a", 3000, 10, 60_000)
        .await
        .expect("lease")
        .iter()
        .map(|l| l.event.event.id.clone())
        .collect();
    ids.sort();
    assert_eq!(
        ids,
        ["b", "plain"],
        "the other key and the unkeyed entry go"
    );
    assert_eq!(
        s.next_due("a"),
        Some(9000),
        "then nothing is due before the retry"
    );
    let head = s.lease("a", 9000, 10, 60_000).await.expect("lease");
    assert_eq!(head.len(), 1);
    assert_eq!(head[0].event.event.id, "a0");
    ack(&s, &head[0], 9001).await.expect("ack");
    let next = s.lease("a", 9001, 10, 60_000).await.expect("lease");
    assert_eq!(next.len(), 1);
    assert_eq!(
        next[0].event.event.id, "a1",
        "the key's next entry, in order"
    );
}

/// Dead-letters `l` (an entry of target `a`) at `at`, holding its key.
async fn dead_letter_holding(s: &RedbStore, l: &Leased, at: Millis) {
    s.finish(
        l.entry.id,
        l.lease,
        delivered(at),
        Disposition::DeadLetter {
            reason: DlqReason::PermanentError,
            hold: true,
        },
        at,
    )
    .await
    .expect("dead-letter");
}

fn event_ids(l: &[Leased]) -> Vec<String> {
    let mut ids: Vec<String> = l.iter().map(|l| l.event.event.id.clone()).collect();
    ids.sort();
    ids
}

/// A target whose policy lost `ordering` (`set_ordered(.., false)`, which the dispatcher does
/// at a start or reload) delivers the keyed entries it has unordered at once: those behind a
/// retrying head and those of a held key (audit day 2, finding 2: they stayed parked while
/// `/v1/targets` said `ordering: null`). Turned on again, the keys order what still waits.
#[tokio::test]
async fn a_target_without_ordering_lets_its_keyed_entries_go_at_once() {
    let s = RedbStore::in_memory().expect("store");
    s.accept(vec![
        keyed("1", "k", 1000),
        keyed("2", "k", 1000),
        keyed("3", "k", 1000),
        keyed("h1", "held", 1000),
        keyed("h2", "held", 1000),
    ])
    .await
    .expect("accept");
    let first = s.lease("a", 1000, 10, 60_000).await.expect("lease");
    assert_eq!(event_ids(&first), ["1", "h1"], "one per key");
    let head = first.iter().find(|l| l.event.event.id == "1").expect("1");
    let fail = AttemptEnd {
        finished_at: 1001,
        result: AttemptResult::Retryable,
        status: Some(500),
        error: None,
        outbox: None,
    };
    s.finish(
        head.entry.id,
        head.lease,
        fail,
        Disposition::Retry { due_at: 50_000 },
        1001,
    )
    .await
    .expect("retry");
    let h1 = first.iter().find(|l| l.event.event.id == "h1").expect("h1");
    dead_letter_holding(&s, h1, 1001).await;
    assert_eq!(s.queue_stats()["a"].queued_behind_keys, 3);
    assert!(s.key_head("a", "k").is_some());

    s.set_ordered("a", false);
    assert_eq!(s.queue_stats()["a"].queued_behind_keys, 0);
    assert!(
        s.key_head("a", "k").is_none(),
        "nothing waits behind a head"
    );
    assert_eq!(s.due_count("a", 2000, 10), 3);
    let went = s.lease("a", 2000, 10, 60_000).await.expect("lease");
    assert_eq!(
        event_ids(&went),
        ["2", "3", "h2"],
        "behind the retrying head, and of the held key (the hold is released apart)"
    );
    // A keyed entry accepted under the old policy, and one re-queued, go at once too.
    s.accept(vec![keyed("4", "k", 2000)]).await.expect("accept");
    let retry3 = went.iter().find(|l| l.event.event.id == "3").expect("3");
    s.finish(
        retry3.entry.id,
        retry3.lease,
        delivered(2001),
        Disposition::Retry { due_at: 3000 },
        2001,
    )
    .await
    .expect("retry");
    let late = s.lease("a", 3000, 10, 60_000).await.expect("lease");
    assert_eq!(event_ids(&late), ["3", "4"]);

    // Ordering turned on again: what waits goes by its key again, the retrying head first.
    s.set_ordered("a", true);
    for l in &late {
        ack(&s, l, 3001).await.expect("ack");
    }
    let two = went.iter().find(|l| l.event.event.id == "2").expect("2");
    s.finish(
        two.entry.id,
        two.lease,
        delivered(40_001),
        Disposition::Retry { due_at: 40_001 },
        40_001,
    )
    .await
    .expect("retry");
    assert_eq!(s.queue_stats()["a"].queued_behind_keys, 1, "2 waits for 1");
    assert!(
        s.lease("a", 45_000, 10, 60_000)
            .await
            .expect("lease")
            .is_empty()
    );
    assert_eq!(
        event_ids(&s.lease("a", 50_000, 10, 60_000).await.expect("lease")),
        ["1"]
    );
}

/// The live ordering is the dispatcher's, not the tables': a store reopened after a write
/// error rebuilds its index from the tables and keeps each target's ordering as it was set.
#[tokio::test]
async fn a_reopen_after_a_write_error_keeps_a_targets_ordering_off() {
    let disk = SimulatedDisk::new();
    let d2 = disk.clone();
    let s: Arc<RedbStore> =
        RedbStore::with_backend_factory(move || d2.backend(), StoreOptions::default())
            .expect("open");
    s.accept(vec![keyed("1", "k", 1000), keyed("2", "k", 1000)])
        .await
        .expect("accept");
    s.set_ordered("a", false);
    disk.set_failing(true);
    assert!(s.accept(vec![keyed("3", "k", 1000)]).await.is_err());
    disk.set_failing(false);
    let mut back = false;
    for _ in 0..100 {
        if s.writable() && s.fate("/s", "1").is_ok_and(|f| f.is_some()) {
            back = true;
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    assert!(back, "the store did not reopen after the disk healed");
    assert_eq!(
        event_ids(&s.lease("a", 1000, 10, 60_000).await.expect("lease")),
        ["1", "2"],
        "the rebuilt index still lets the key's entries go together"
    );
}

/// A released hold is durable: after a restart the key is free, and the store, ordered again
/// until the dispatcher says otherwise, lets its first waiting entry go.
#[tokio::test]
async fn a_key_released_for_a_target_without_ordering_stays_released_after_a_restart() {
    let dir = tempfile::tempdir().expect("tempdir");
    {
        let s = RedbStore::open_dir(dir.path(), StoreOptions::default()).expect("open");
        s.accept(vec![
            keyed("1", "k", 1000),
            keyed("2", "k", 1000),
            keyed("3", "k", 1000),
        ])
        .await
        .expect("accept");
        let l = s.lease("a", 1000, 1, 60_000).await.expect("lease");
        dead_letter_holding(&s, &l[0], 1001).await;
        s.set_ordered("a", false);
        assert_eq!(s.due_count("a", 2000, 10), 2, "unordered: 2 and 3 go");
        assert!(s.release_key("a", "k").await.expect("release"));
    }
    let s = when_free(|| RedbStore::open_dir(dir.path(), StoreOptions::default())).await;
    assert!(s.held_keys("a").is_empty(), "the release was durable");
    assert_eq!(
        s.due_count("a", 2000, 10),
        1,
        "ordered until told otherwise"
    );
    s.set_ordered("a", false);
    assert_eq!(s.due_count("a", 2000, 10), 2);
}

#[tokio::test]
async fn held_keys_and_target_state_survive_restart() {
    let dir = tempfile::tempdir().expect("tempdir");
    {
        let s = RedbStore::open_dir(dir.path(), StoreOptions::default()).expect("open");
        s.accept(vec![keyed("1", "k", 1000), keyed("2", "k", 1000)])
            .await
            .expect("accept");
        let l = s
            .lease("a", 1000, 1, 60_000)
            .await
            .expect("lease")
            .remove(0);
        s.finish(
            l.entry.id,
            l.lease,
            delivered(1001),
            Disposition::DeadLetter {
                reason: DlqReason::PermanentError,
                hold: true,
            },
            1001,
        )
        .await
        .expect("dlq");
        s.put_target_state("a", json!({"paused": true}))
            .await
            .expect("state");
    }
    let s = when_free(|| RedbStore::open_dir(dir.path(), StoreOptions::default())).await;
    assert_eq!(s.held_keys("a"), vec!["k".to_string()]);
    assert_eq!(s.due_count("a", 2000, 10), 0);
    assert_eq!(
        s.target_states().expect("states"),
        vec![("a".to_string(), json!({"paused": true}))]
    );
}

#[tokio::test]
async fn completed_records_commit_with_the_ack_and_expire() {
    let s = RedbStore::in_memory().expect("store");
    s.accept(vec![new_event("/s", "1", &["h"], 1000)])
        .await
        .expect("accept");
    let l = s.lease("h", 1000, 10, 5000).await.expect("lease").remove(0);
    let key = l.entry.idempotency_key.clone();
    assert_eq!(s.completed_get("h", &key, 1000).expect("read"), None);
    let mut end = delivered(1001);
    end.outbox = Some(Box::new(Outbox {
        completed: Some(CompletedRecord {
            handler: "h".into(),
            key: key.clone(),
            result: b"{\"emitted\":[]}".to_vec(),
            expires_at: 5000,
        }),
        ..Outbox::default()
    }));
    s.finish(l.entry.id, l.lease, end, Disposition::Delivered, 1001)
        .await
        .expect("finish");
    assert_eq!(
        s.completed_get("h", &key, 1002).expect("read").as_deref(),
        Some(&b"{\"emitted\":[]}"[..])
    );
    assert_eq!(s.completed_get("other", &key, 1002).expect("read"), None);
    // Past its expiry it reads as absent at once, and the sweep removes it.
    assert_eq!(s.completed_get("h", &key, 5000).expect("read"), None);
    let stats = s.sweep(6000, 86_400_000, 86_400_000).await.expect("sweep");
    assert_eq!(stats.completed_expired, 1);
    assert_eq!(s.completed_get("h", &key, 0).expect("read"), None);
    let stats = s.sweep(7000, 86_400_000, 86_400_000).await.expect("sweep");
    assert_eq!(stats.completed_expired, 0);
}

/// Freeing a handler's name removes its COMPLETED records (`completed_clear`), and only its
/// (a handler whose name shares its prefix keeps its own): a new team's handler under the
/// name would otherwise get the old one's stored result for a key it completed, and never
/// run. Their expiry index goes with them.
#[tokio::test]
async fn completed_clear_removes_one_handlers_records() {
    let s = RedbStore::in_memory().expect("store");
    s.accept(vec![
        new_event("/s", "1", &["h"], 1000),
        new_event("/s", "2", &["h"], 1000),
        new_event("/s", "3", &["h"], 1000),
    ])
    .await
    .expect("accept");
    let leased = s.lease("h", 1000, 10, 5000).await.expect("lease");
    assert_eq!(leased.len(), 3);
    for (l, handler) in leased.iter().zip(["h", "h", "h2"]) {
        let mut end = delivered(1001);
        end.outbox = Some(Box::new(Outbox {
            completed: Some(CompletedRecord {
                handler: handler.into(),
                key: l.entry.idempotency_key.clone(),
                result: b"{}".to_vec(),
                expires_at: 5000,
            }),
            ..Outbox::default()
        }));
        s.finish(l.entry.id, l.lease, end, Disposition::Delivered, 1001)
            .await
            .expect("finish");
    }
    assert_eq!(s.completed_clear("h").await.expect("clear"), 2);
    for l in &leased[..2] {
        let key = &l.entry.idempotency_key;
        assert_eq!(s.completed_get("h", key, 1002).expect("read"), None);
    }
    let kept = &leased[2].entry.idempotency_key;
    assert_eq!(
        s.completed_get("h2", kept, 1002).expect("read").as_deref(),
        Some(&b"{}"[..]),
        "another handler's record stays"
    );
    assert_eq!(s.completed_clear("h").await.expect("again"), 0);
    // Only h2's expiry row is left for the sweep.
    let stats = s.sweep(6000, 86_400_000, 86_400_000).await.expect("sweep");
    assert_eq!(stats.completed_expired, 1);
}

#[tokio::test]
async fn an_ack_refused_by_its_fence_writes_no_completed_record() {
    let s = RedbStore::in_memory().expect("store");
    s.accept(vec![new_event("/s", "1", &["h"], 1000)])
        .await
        .expect("accept");
    let l = s.lease("h", 1000, 10, 100).await.expect("lease").remove(0);
    let key = l.entry.idempotency_key.clone();
    let mut end = delivered(2000);
    end.outbox = Some(Box::new(Outbox {
        completed: Some(CompletedRecord {
            handler: "h".into(),
            key: key.clone(),
            result: b"{}".to_vec(),
            expires_at: 10_000,
        }),
        ..Outbox::default()
    }));
    // The lease ran out at 1100: a slow handler's late ack is fenced, and nothing of its
    // outbox (here the COMPLETED mark) is written.
    let r = s
        .finish(l.entry.id, l.lease, end, Disposition::Delivered, 2000)
        .await;
    assert!(matches!(r, Err(FinishError::Fenced)), "{r:?}");
    assert_eq!(s.completed_get("h", &key, 2000).expect("read"), None);
}

/// Leases the one entry of `target` and acks it with `kv` writes under a `max` bound.
async fn ack_with_kv(
    s: &RedbStore,
    id: &str,
    kv: Vec<KvOp>,
    max: Option<u64>,
    at: Millis,
) -> Result<(), FinishError> {
    s.accept(vec![new_event("/kv", id, &["h"], at)])
        .await
        .expect("accept");
    let l = s.lease("h", at, 10, 5000).await.expect("lease").remove(0);
    let mut end = delivered(at + 1);
    end.outbox = Some(Box::new(Outbox {
        kv,
        kv_max_bytes: max,
        ..Outbox::default()
    }));
    s.finish(l.entry.id, l.lease, end, Disposition::Delivered, at + 1)
        .await
        .map(|_| ())
}

fn put(key: &str, len: usize, expires_at: Option<Millis>) -> KvOp {
    KvOp {
        namespace: "h".into(),
        key: key.into(),
        value: Some(vec![b'v'; len]),
        expires_at,
    }
}

#[tokio::test]
async fn clearing_a_namespace_removes_its_entries_alone_with_their_expiry_and_size() {
    let s = RedbStore::in_memory().expect("store");
    let other = KvOp {
        namespace: "h2".into(),
        ..put("a", 3, None)
    };
    ack_with_kv(
        &s,
        "1",
        vec![put("a", 9, None), put("b", 19, Some(3000)), other],
        None,
        1000,
    )
    .await
    .expect("written");
    // Namespace "h" sorts before "h2", whose entry shares its prefix.
    assert_eq!(s.kv_clear("h").await.expect("clear"), 2);
    assert_eq!(s.kv_usage_of("h").expect("usage"), KvUsage::default());
    assert_eq!(s.kv_get("h", "a", 1000).expect("read"), None);
    assert_eq!(
        s.kv_get("h2", "a", 1000).expect("read"),
        Some(b"vvv".to_vec())
    );
    assert_eq!(s.kv_usage_of("h2").expect("usage").keys, 1);
    assert_eq!(s.kv_clear("h").await.expect("again"), 0);
    // Nothing left in the expiry index for the sweep to trip on.
    let swept = s.sweep(5000, 1, 1).await.expect("sweep");
    assert_eq!(swept.kv_expired, 0);
}

#[tokio::test]
async fn kv_namespaces_are_sized_bounded_at_commit_and_swept_at_expiry() {
    let s = RedbStore::in_memory().expect("store");
    let usage = |s: &RedbStore| s.kv_usage_of("h").expect("usage");
    // Every entry counts its overhead besides its key and value.
    const O: u64 = KvUsage::ENTRY_OVERHEAD;
    let bound = 40 + 4 * O;
    // Two keys: 1 + 9 and 1 + 19 bytes; "b" expires at 3000.
    ack_with_kv(
        &s,
        "1",
        vec![put("a", 9, None), put("b", 19, Some(3000))],
        Some(bound),
        1000,
    )
    .await
    .expect("fits");
    assert_eq!(
        usage(&s),
        KvUsage {
            bytes: 30 + 2 * O,
            keys: 2
        }
    );
    // Growing past the bound is refused as a whole: nothing of the outbox is written, and
    // the entry's lease still holds (the worker records a retry).
    let r = ack_with_kv(
        &s,
        "2",
        vec![put("c", 4, None), put("d", 9, None)],
        Some(bound),
        1100,
    )
    .await;
    assert!(
        matches!(&r, Err(FinishError::KvQuota { namespace, would_hold, max }) if namespace == "h" && *would_hold == 45 + 4 * O && *max == bound),
        "{r:?}"
    );
    assert_eq!(s.kv_get("h", "c", 1100).expect("read"), None);
    assert_eq!(
        usage(&s),
        KvUsage {
            bytes: 30 + 2 * O,
            keys: 2
        }
    );
    // Replacing and deleting count only the difference, and shrinking always passes even
    // when the bound was lowered below what the namespace holds.
    let del = KvOp {
        value: None,
        ..put("a", 0, None)
    };
    ack_with_kv(&s, "3", vec![put("b", 9, Some(3000)), del], Some(5), 1200)
        .await
        .expect("shrinks");
    assert_eq!(
        usage(&s),
        KvUsage {
            bytes: 10 + O,
            keys: 1
        }
    );
    // The sweep removes "b" once expired (reads already skip it) and gives its bytes back.
    assert_eq!(
        s.sweep(2999, 86_400_000, 86_400_000)
            .await
            .expect("sweep")
            .kv_expired,
        0
    );
    assert_eq!(s.kv_get("h", "b", 3000).expect("read"), None);
    assert_eq!(
        s.sweep(3001, 86_400_000, 86_400_000)
            .await
            .expect("sweep")
            .kv_expired,
        1
    );
    assert_eq!(usage(&s), KvUsage::default());
    assert!(s.kv_usage().expect("usage").is_empty());
    // Rewriting a key without a TTL drops its expiry: the sweep must not remove it.
    ack_with_kv(&s, "4", vec![put("e", 1, Some(4000))], None, 3100)
        .await
        .expect("ttl");
    ack_with_kv(&s, "5", vec![put("e", 2, None)], None, 3200)
        .await
        .expect("no ttl");
    assert_eq!(
        s.sweep(5000, 86_400_000, 86_400_000)
            .await
            .expect("sweep")
            .kv_expired,
        0
    );
    assert_eq!(
        s.kv_get("h", "e", 5000).expect("read").map(|v| v.len()),
        Some(2)
    );
    assert_eq!(
        usage(&s),
        KvUsage {
            bytes: 3 + O,
            keys: 1
        }
    );
}

#[tokio::test]
async fn kv_sizes_are_rebuilt_for_a_store_written_before_they_were_kept() {
    let dir = tempfile::tempdir().expect("tempdir");
    {
        let s = RedbStore::open_dir(dir.path(), StoreOptions::default()).expect("open");
        ack_with_kv(
            &s,
            "1",
            vec![put("a", 9, None), put("b", 4, Some(9000))],
            None,
            1000,
        )
        .await
        .expect("ack");
    }
    // Make the file look like one from before the accounting: no sizes, no expiry index.
    let path = dir.path().join("router.redb");
    let db = when_free(|| redb::Database::create(&path)).await;
    let txn = db.begin_write().expect("txn");
    txn.delete_table(KV_USAGE).expect("drop sizes");
    txn.delete_table(KV_EXP).expect("drop expiry");
    txn.open_table(META)
        .expect("meta")
        .remove("kv_accounting")
        .expect("remove");
    txn.commit().expect("commit");
    drop(db);
    let s = RedbStore::open_dir(dir.path(), StoreOptions::default()).expect("reopen");
    assert_eq!(
        s.kv_usage_of("h").expect("usage"),
        KvUsage::from_counters(15, 2)
    );
    assert_eq!(
        s.sweep(9001, 86_400_000, 86_400_000)
            .await
            .expect("sweep")
            .kv_expired,
        1
    );
    assert_eq!(
        s.kv_usage_of("h").expect("usage"),
        KvUsage::from_counters(10, 1)
    );
}

#[tokio::test]
async fn a_format_1_store_is_read_and_upgraded_in_place() {
    let dir = tempfile::tempdir().expect("tempdir");
    {
        let s = RedbStore::open_dir(dir.path(), StoreOptions::default()).expect("open");
        s.accept(vec![
            new_event("/s", "1", &["a"], 1000),
            new_event("/s", "2", &["a", "b"], 1000),
        ])
        .await
        .expect("accept");
    }
    // Make the file look like format 1: event records are JSON alone, every entry has its
    // row (and every live one its row in `live`), entry records repeat their id, there is no
    // entry floor, and the version says 1.
    let path = dir.path().join("router.redb");
    let db = when_free(|| redb::Database::create(&path)).await;
    let txn = db.begin_write().expect("txn");
    {
        let mut events = txn.open_table(EVENTS).expect("events");
        let records: Vec<(u64, Vec<u8>)> = events
            .iter()
            .expect("iter")
            .map(|r| {
                let (k, v) = r.expect("row");
                (k.value(), v.value().to_vec())
            })
            .collect();
        let mut rows: Vec<((u64, u32), Vec<u8>)> = Vec::new();
        for (seq, raw) in records {
            let rec = EventRecord::split(seq, &raw).expect("record");
            rows.extend(rec.entries().map(|(idx, r)| ((seq, idx), r.to_vec())));
            events.insert(seq, rec.json).expect("insert");
        }
        assert_eq!(rows.len(), 3);
        let mut t = txn.open_table(ENTRIES).expect("entries");
        let mut live = txn.open_table(LIVE).expect("live");
        for ((event, idx), v) in rows {
            live.insert((event, idx), ()).expect("live");
            // Format 1 records are JSON (as through format 3) and repeat their id.
            let e = dec_entry((event, idx), &v).expect("entry");
            let mut j = serde_json::to_value(&e).expect("json");
            assert!(j.get("id").is_none(), "the model skips the id");
            j["id"] = json!({ "event": event, "idx": idx });
            t.insert(
                (event, idx),
                serde_json::to_vec(&j).expect("json").as_slice(),
            )
            .expect("insert");
        }
        let mut meta = txn.open_table(META).expect("meta");
        meta.insert("format_version", 1u64.to_le_bytes().as_slice())
            .expect("version");
        meta.remove("entry_floor").expect("floor");
    }
    txn.commit().expect("commit");
    drop(db);
    let s = RedbStore::open_dir(dir.path(), StoreOptions::default()).expect("reopen");
    let fate = s.fate("/s", "2").expect("fate").expect("known");
    let ids: Vec<String> = fate.entries.iter().map(|e| e.id.to_string()).collect();
    assert_eq!(ids, ["2.0", "2.1"]);
    let leased = s.lease("b", 1000, 10, 5000).await.expect("lease");
    assert_eq!(leased.len(), 1);
    assert_eq!(leased[0].entry.id.to_string(), "2.1");
    ack(&s, &leased[0], 1001).await.expect("finish");
    drop(s);
    let db = when_free(|| redb::Database::create(&path)).await;
    let r = db.begin_read().expect("read");
    let meta = r.open_table(META).expect("meta");
    assert_eq!(
        read_u64(&meta, "format_version").expect("read"),
        Some(u64::from(FORMAT_VERSION))
    );
    // The finished entry was rewritten in the binary layout of format 4; the untouched ones
    // stay JSON until they change.
    let t = r.open_table(ENTRIES).expect("entries");
    let first = |k: (u64, u32)| t.get(k).expect("get").expect("row").value()[0];
    assert_eq!(first((2, 1)), 0xB4);
    assert_eq!((first((1, 0)), first((2, 0))), (b'{', b'{'));
}

#[tokio::test]
async fn a_store_of_an_unknown_format_is_refused() {
    let dir = tempfile::tempdir().expect("tempdir");
    drop(RedbStore::open_dir(dir.path(), StoreOptions::default()).expect("open"));
    let path = dir.path().join("router.redb");
    let db = when_free(|| redb::Database::create(&path)).await;
    let txn = db.begin_write().expect("txn");
    txn.open_table(META)
        .expect("meta")
        .insert("format_version", 99u64.to_le_bytes().as_slice())
        .expect("version");
    txn.commit().expect("commit");
    drop(db);
    match RedbStore::open_dir(dir.path(), StoreOptions::default()) {
        Err(e @ StoreError::FormatVersion { found: 99, .. }) => {
            // Which file, which versions this build reads, and what to do.
            let msg = e.to_string();
            assert!(msg.contains(&path.display().to_string()), "{msg}");
            assert!(
                msg.contains(&format!(
                    "this build reads versions {OLDEST_READABLE_FORMAT} to {FORMAT_VERSION}"
                )),
                "{msg}"
            );
            assert!(msg.contains("a newer build wrote it"), "{msg}");
        }
        other => panic!("expected a format version error, got {:?}", other.err()),
    }
}

/// Version 0 is no build's: said as a damaged file, not as "this build reads 7" (it reads 1
/// to 7).
#[test]
fn a_format_version_no_build_writes_is_said_damaged() {
    let msg = StoreError::FormatVersion {
        found: 0,
        expected: FORMAT_VERSION,
        file: Some("d/router.redb".into()),
    }
    .to_string();
    assert!(
        msg.contains("store format version 0 of d/router.redb"),
        "{msg}"
    );
    assert!(msg.contains("router store check"), "{msg}");
}

/// A data directory that is a file is said so, not "File exists (os error 17)".
#[test]
fn a_data_directory_that_is_a_file_is_said_so() {
    let dir = tempfile::tempdir().expect("tempdir");
    let file = dir.path().join("data");
    std::fs::write(&file, b"x").expect("write");
    let Err(e) = RedbStore::open_dir(&file, StoreOptions::default()) else {
        panic!("opened")
    };
    assert!(e.to_string().contains("is not a directory"), "{e}");
}

/// A store file damaged so that redb refuses it ("File truncated below stored layout"): the
/// refusal says the file is damaged and what to do.
#[tokio::test]
async fn a_damaged_store_file_is_refused_with_what_to_do() {
    let dir = tempfile::tempdir().expect("tempdir");
    {
        let s = RedbStore::open_dir(dir.path(), StoreOptions::default()).expect("open");
        accept_padded(&s, 0).await.expect("accept");
        s.close().await.expect("close");
    }
    let path = dir.path().join("router.redb");
    when_free(|| check::check_dir(dir.path())).await;
    let len = std::fs::metadata(&path).expect("meta").len();
    std::fs::OpenOptions::new()
        .write(true)
        .open(&path)
        .expect("open")
        .set_len(len - 8192)
        .expect("truncate");
    let Err(e) = RedbStore::open_dir(dir.path(), StoreOptions::default()) else {
        panic!("opened")
    };
    let msg = e.to_string();
    assert!(msg.contains("the file is damaged"), "{msg}");
    assert!(msg.contains("router store check --data-dir"), "{msg}");
}

// ---------------------------------------------------------------------------------------------
// The group log

fn logged(every: std::time::Duration) -> StoreOptions {
    StoreOptions {
        group_log: true,
        checkpoint_every: Some(every),
        ..StoreOptions::default()
    }
}

/// A store on simulated disks (the store file and the group log's two files).
fn on_disks(db: &SimulatedDisk, log: &LogDisks, opts: StoreOptions) -> Arc<RedbStore> {
    let d = db.clone();
    RedbStore::with_backends(move || d.backend(), log.backends(), opts).expect("open")
}

/// A store reopened on what a power cut of both disks left.
fn on_images(db_image: Vec<u8>, log_images: [Vec<u8>; 2], opts: StoreOptions) -> Arc<RedbStore> {
    on_disks(
        &SimulatedDisk::from_image(db_image),
        &LogDisks::from_images(log_images),
        opts,
    )
}

/// What a power cut of all three disks leaves. The log first: a checkpoint between the images
/// then puts everything the log images hold into the store file's image as well (taken the
/// other way round, the log might already have gone on over a file the store's image does
/// not cover yet).
fn cut(db: &SimulatedDisk, log: &LogDisks) -> (Vec<u8>, [Vec<u8>; 2]) {
    let log_images = log.power_cut();
    (db.power_cut(), log_images)
}

/// The store file's image alone (without the log) does not hold `/s`/`id`: a test that then
/// finds it after a power cut has shown that the log kept it.
fn assert_not_in_store_file(db_image: &[u8], id: &str) {
    let alone = RedbStore::with_backend(
        SimulatedDisk::from_image(db_image.to_vec()).backend(),
        StoreOptions::default(),
    )
    .expect("store file alone");
    assert!(
        alone.fate("/s", id).expect("fate").is_none(),
        "{id} is durable in the store file: this test would not exercise the log"
    );
}

/// Every event `/s`/`id` of `ids` is in the store.
fn assert_present(s: &RedbStore, ids: impl IntoIterator<Item = String>) {
    for i in ids {
        assert!(s.fate("/s", &i).expect("fate").is_some(), "event {i} lost");
    }
}

async fn accept_concurrently(s: &Arc<RedbStore>, ids: std::ops::Range<u32>) -> Vec<u32> {
    let mut tasks = Vec::new();
    for i in ids {
        let s = s.clone();
        tasks.push(tokio::spawn(async move {
            s.accept(vec![new_event("/s", &i.to_string(), &["a", "b"], 1000)])
                .await
                .map(|_| i)
        }));
    }
    let mut acked = Vec::new();
    for t in tasks {
        if let Ok(i) = t.await.expect("join") {
            acked.push(i);
        }
    }
    acked
}

/// Groups answered from the log alone (no checkpoint since) survive a power cut of both
/// disks; the store file alone does not have them, so this proves the log is what kept them
/// (and would fail if a group were answered before its record was synced).
#[tokio::test]
async fn groups_acknowledged_through_the_log_survive_a_power_cut() {
    let (db, log) = (SimulatedDisk::new(), LogDisks::new());
    let s = on_disks(&db, &log, logged(std::time::Duration::from_secs(3600)));
    let acked = accept_concurrently(&s, 0..200).await;
    assert_eq!(acked.len(), 200);
    // A delivery finished and a retry scheduled: updates and removals are logged too.
    let l = s.lease("a", 1000, 2, 60_000).await.expect("lease");
    ack(&s, &l[0], 1001).await.expect("ack");
    s.finish(
        l[1].entry.id,
        l[1].lease,
        AttemptEnd {
            finished_at: 1001,
            result: AttemptResult::Retryable,
            status: Some(503),
            error: Some("busy".into()),
            outbox: None,
        },
        Disposition::Retry { due_at: 7000 },
        1001,
    )
    .await
    .expect("retry");
    let (db_image, log_image) = cut(&db, &log);
    drop(s);

    assert_not_in_store_file(&db_image, "199");

    let s2 = on_images(
        db_image,
        log_image,
        logged(std::time::Duration::from_secs(3600)),
    );
    assert_present(&s2, acked.iter().map(ToString::to_string));
    let q = s2.queue_stats();
    assert_eq!(q["a"].queued, 199, "one of a's entries was delivered");
    assert_eq!(q["b"].queued, 200);
    // The retry kept its due time and attempt.
    assert_eq!(s2.next_due("a"), Some(1000));
    let due = s2.lease("a", 1000, 500, 60_000).await.expect("lease");
    assert_eq!(due.len(), 198, "the retried entry waits until 7000");
    let later = s2.lease("a", 7000, 10, 60_000).await.expect("lease");
    assert_eq!(later.len(), 1);
    assert_eq!(later[0].entry.attempts.len(), 2);
    // Sequence numbers go on after the replayed groups.
    let r = s2
        .accept(vec![new_event("/s", "new", &["a"], 2000)])
        .await
        .expect("accept");
    assert_eq!(r, vec![AcceptOutcome::accepted(201)]);
}

/// Polls the fate of `/s`/`id` `polls` times, 5 ms apart: a read may fail, but never shows the
/// event as stored.
async fn never_read_as_stored(s: &RedbStore, id: &str, polls: usize) {
    for _ in 0..polls {
        if let Ok(f) = s.fate("/s", id) {
            assert!(
                f.is_none(),
                "a group answered with an error reads as stored"
            );
        }
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    }
}

/// The fate of `/s`/`id` once reads work again; fails after 10 s.
async fn fate_once_readable(s: &RedbStore, id: &str) -> Option<Fate> {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    loop {
        match s.fate("/s", id) {
            Ok(f) => return f,
            Err(e) => {
                assert!(
                    std::time::Instant::now() < deadline,
                    "reads still fail 10 s after the disk healed: {e}"
                );
                tokio::time::sleep(std::time::Duration::from_millis(20)).await;
            }
        }
    }
}

/// A failed synced commit: its group was answered with an error. Readers must not see it as
/// stored, neither before the store has reopened nor after.
#[tokio::test]
async fn after_a_failed_commit_readers_never_see_the_failed_group() {
    let disk = SimulatedDisk::new();
    let d2 = disk.clone();
    let s = RedbStore::with_backend_factory(move || d2.backend(), StoreOptions::default())
        .expect("open");
    s.accept(vec![new_event("/s", "kept", &["a"], 1000)])
        .await
        .expect("accept before the failure");
    disk.set_failing(true);
    let r = s
        .accept(vec![new_event("/s", "failed", &["a"], 1000)])
        .await;
    assert!(r.is_err(), "the commit failed: {r:?}");
    never_read_as_stored(&s, "failed", 100).await;
    disk.set_failing(false);
    fate_once_readable(&s, "kept").await;
    assert!(s.fate("/s", "failed").expect("fate").is_none());
}

/// A full disk under the group log: the group whose log write failed was committed to redb
/// without a sync and answered with an error. Until the store has reopened, readers must not
/// see it (it may never become durable); once the disk heals the store reopens by itself,
/// without waiting for a write, and whatever it then shows is consistent: the failed event
/// complete with its queue entry, or not there at all (and then not a duplicate either).
#[tokio::test]
async fn after_a_failed_log_write_readers_wait_for_the_reopen() {
    let (db, log) = (SimulatedDisk::new(), LogDisks::new());
    let s = on_disks(&db, &log, logged(std::time::Duration::from_secs(3600)));
    s.accept(vec![new_event("/s", "kept", &["a"], 1000)])
        .await
        .expect("accept before the failure");
    db.set_failing(true);
    log.set_failing(true);
    let r = s
        .accept(vec![new_event("/s", "failed", &["a"], 1000)])
        .await;
    assert!(r.is_err(), "the group's log write failed: {r:?}");
    never_read_as_stored(&s, "failed", 20).await;
    db.set_failing(false);
    log.set_failing(false);
    // No write: the log writer woke the committer, which keeps reopening until the disk heals.
    let kept = fate_once_readable(&s, "kept").await;
    assert!(kept.is_some(), "the durable event is there");
    let failed = s.fate("/s", "failed").expect("fate");
    if let Some(f) = &failed {
        assert_eq!(
            f.entries.len(),
            1,
            "the failed event is there whole or not at all"
        );
    }
    let stored = 1 + u64::from(failed.is_some());
    assert_eq!(
        s.queue_stats()["a"].queued,
        stored,
        "the queues agree with the events"
    );
    let r = s
        .accept(vec![new_event("/s", "failed", &["a"], 2000)])
        .await
        .expect("accept after the disk healed");
    assert_eq!(
        matches!(r[0], AcceptOutcome::Duplicate { .. }),
        failed.is_some(),
        "sent again: a duplicate exactly when it was kept ({r:?})"
    );
}

/// Many checkpoints: the log starts again at offset 0 each time, over the previous lap's
/// records, and a power cut at any point still loses nothing acknowledged.
#[tokio::test]
async fn the_log_wraps_at_checkpoints_without_losing_groups() {
    let (db, log) = (SimulatedDisk::new(), LogDisks::new());
    let s = on_disks(&db, &log, logged(std::time::Duration::from_millis(5)));
    let mut acked = Vec::new();
    for round in 0..20u32 {
        acked.extend(accept_concurrently(&s, round * 20..round * 20 + 20).await);
        tokio::time::sleep(std::time::Duration::from_millis(u64::from(round % 7))).await;
    }
    assert_eq!(acked.len(), 400);
    let (db_image, log_image) = cut(&db, &log);
    drop(s);
    let s2 = on_images(
        db_image,
        log_image,
        logged(std::time::Duration::from_millis(5)),
    );
    assert_present(&s2, acked.iter().map(ToString::to_string));
    assert_eq!(s2.queue_stats()["b"].queued, 400);
}

/// A checkpoint does not wait for its sync of the store file: groups after it are answered
/// while that sync has not happened, through the log's other file, and a power cut before the
/// sync loses none of them (the log holds the checkpoint's group and those after it).
#[tokio::test]
async fn groups_after_a_checkpoint_are_answered_before_its_sync_and_survive_without_it() {
    let every = std::time::Duration::from_secs(1);
    let (db, log) = (SimulatedDisk::new(), LogDisks::new());
    let s = on_disks(&db, &log, logged(every));
    let accept = |id: &'static str| {
        let s = s.clone();
        async move {
            tokio::time::timeout(
                std::time::Duration::from_secs(10),
                s.accept(vec![new_event("/s", id, &["a"], 1000)]),
            )
            .await
            .unwrap_or_else(|_| panic!("{id} was not answered within 10 s"))
            .unwrap_or_else(|e| panic!("accept {id}: {e}"))
        }
    };
    accept("before").await;
    // The next group is a checkpoint (the interval has passed); its sync is held.
    tokio::time::sleep(every + std::time::Duration::from_millis(100)).await;
    db.hold_syncs(true);
    let syncs = db.syncs();
    accept("checkpoint").await;
    // Within the interval: groups through the log, answered while the sync still waits.
    accept("after-1").await;
    accept("after-2").await;
    assert_eq!(
        db.syncs(),
        syncs,
        "a sync of the store file completed meanwhile"
    );
    let (db_image, log_image) = cut(&db, &log);
    db.hold_syncs(false);
    // The checkpoint's sync was waiting all along, and now completes.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while db.syncs() == syncs {
        assert!(
            std::time::Instant::now() < deadline,
            "no sync was waiting: the checkpoint came elsewhere"
        );
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    }
    drop(s);

    assert!(
        !log_image[1].iter().all(|&b| b == 0),
        "the groups after the checkpoint went to the log's other file"
    );
    assert_not_in_store_file(&db_image, "checkpoint");

    let s2 = on_images(db_image, log_image, logged(every));
    assert_present(
        &s2,
        ["before", "checkpoint", "after-1", "after-2"].map(String::from),
    );
    assert_eq!(s2.queue_stats()["a"].queued, 4);
}

/// A failing log fails the groups waiting on it (never a false "accepted"), the store reopens
/// from what is durable once the disk heals, and what was acknowledged before is all there.
#[tokio::test]
async fn a_failing_log_fails_the_accept_and_recovers() {
    let (db, log) = (SimulatedDisk::new(), LogDisks::new());
    let s = on_disks(&db, &log, logged(std::time::Duration::from_secs(3600)));
    let before = accept_concurrently(&s, 0..10).await;
    assert_eq!(before.len(), 10);
    log.set_failing(true);
    assert!(
        s.accept(vec![new_event("/s", "x", &["a"], 1000)])
            .await
            .is_err()
    );
    log.set_failing(false);
    let mut ok = None;
    for _ in 0..100 {
        if let Ok(r) = s.accept(vec![new_event("/s", "y", &["a"], 1000)]).await {
            ok = Some(r);
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    assert!(ok.is_some(), "writes did not resume after the log healed");
    // "x" was answered with an error; redb may still have made it durable when the failed
    // handle was closed for the reopen (its close persists unsynced commits). Either way its
    // producer retries and gets `duplicate` or `accepted`: at least once, never a false 202.
    let x = u64::from(s.fate("/s", "x").expect("fate").is_some());
    let (db_image, log_image) = cut(&db, &log);
    drop(s);
    let s2 = on_images(
        db_image,
        log_image,
        logged(std::time::Duration::from_secs(3600)),
    );
    assert_present(
        &s2,
        before.iter().map(ToString::to_string).chain(["y".into()]),
    );
    assert_eq!(s2.queue_stats()["a"].queued, 11 + x);
}

/// A log left by a run with the log on is applied when the next run has it off, then removed.
#[tokio::test]
async fn a_log_left_behind_is_applied_when_the_log_is_turned_off() {
    let dir = tempfile::tempdir().expect("tempdir");
    {
        let s = RedbStore::open_dir(dir.path(), logged(std::time::Duration::from_secs(3600)))
            .expect("open");
        accept_concurrently(&s, 0..5).await;
    }
    assert!(dir.path().join("router.log").exists());
    let s = when_free(|| RedbStore::open_dir(dir.path(), StoreOptions::default())).await;
    for i in 0..5 {
        assert!(s.fate("/s", &i.to_string()).expect("fate").is_some());
    }
    assert!(!dir.path().join("router.log").exists());
}

/// Rows of `entries` per event sequence number, read straight from the file.
fn entry_rows(s: &RedbStore) -> BTreeMap<u64, usize> {
    let db = s.read_db();
    let r = db.begin_read().expect("read");
    let mut rows = BTreeMap::new();
    for row in r
        .open_table(ENTRIES)
        .expect("entries")
        .iter()
        .expect("iter")
    {
        *rows.entry(row.expect("row").0.value().0).or_default() += 1;
    }
    rows
}

/// One sweep batch holding, interleaved, events still queued somewhere, delivered ones and
/// one kept for the DLQ: only the finished ones go, each with all of its entry rows and its
/// dedup key; the kept ones keep every row, and go once released, on a later sweep.
#[tokio::test]
async fn a_sweep_batch_removes_finished_events_among_kept_ones_with_all_their_rows() {
    let s = RedbStore::in_memory().expect("store");
    // Events 0..12 fan out to `a` and `b`; `b` is only delivered for even ones.
    let batch = (0..12)
        .map(|i| new_event("/s", &i.to_string(), &["a", "b"], 1000))
        .collect();
    s.accept(batch).await.expect("accept");
    deliver_all(&s).await;
    for l in s.lease("b", 2000, 100, 60_000).await.expect("lease") {
        let odd = l.event.event.id.parse::<u32>().expect("numeric id") % 2 == 1;
        let disposition = if l.event.event.id == "11" {
            Disposition::DeadLetter {
                reason: DlqReason::PermanentError,
                hold: false,
            }
        } else if odd {
            Disposition::Retry { due_at: 3000 }
        } else {
            Disposition::Delivered
        };
        s.finish(l.entry.id, l.lease, delivered(2001), disposition, 2001)
            .await
            .expect("finish");
    }
    let stats = s.sweep(100_000, 5_000, 5_000).await.expect("sweep");
    // 6 even events go; 5 odd ones wait for their retry, and 11 is in the DLQ. Dedup keys
    // leave with their run, not one by one.
    assert_eq!(
        (stats.events_removed, stats.dedup_expired, stats.pending),
        (6, 0, 6)
    );
    let rows = entry_rows(&s);
    let kept: Vec<u64> = rows.keys().copied().collect();
    assert_eq!(kept.len(), 6, "rows left: {rows:?}");
    assert!(
        rows.values().all(|n| *n == 2),
        "a kept event keeps both rows: {rows:?}"
    );
    for i in 0..12 {
        let fate = s.fate("/s", &i.to_string()).expect("fate");
        assert_eq!(fate.is_some(), i % 2 == 1, "event {i}");
    }
    assert_eq!(s.record_counts().expect("counts").dedup_keys, 12);
    // The retries are delivered: the revisit removes those five; the DLQ one stays.
    tokio::task::yield_now().await;
    for l in s.lease("b", 4000, 100, 60_000).await.expect("lease") {
        ack(&s, &l, 4001).await.expect("finish");
    }
    let stats = s.sweep(100_000, 5_000, 5_000).await.expect("sweep");
    assert_eq!((stats.events_removed, stats.dedup_expired), (5, 0));
    assert_eq!(entry_rows(&s).len(), 1);
    assert!(s.fate("/s", "11").expect("fate").is_some());
    assert_eq!(s.record_counts().expect("counts").events, 1);
}

// ---------------------------------------------------------------------------------------------
// The dedup index (memtable, runs)

/// Store options whose dedup memtable is written as a run every `keys` keys.
fn small_runs(keys: usize) -> StoreOptions {
    StoreOptions {
        dedup_memtable_keys: Some(keys),
        ..StoreOptions::default()
    }
}

/// Waits (at most 10 s) until the committer has written every frozen memtable and removed
/// every orphan run's rows; returns the registered runs' (seq_lo, seq_hi, keys).
async fn runs_settled(s: &RedbStore) -> Vec<(u64, u64, u64)> {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    loop {
        {
            let st = s.dedup_state();
            if st.settled() && st.sealed.is_none() {
                return st
                    .runs
                    .iter()
                    .map(|r| (r.seq_lo, r.seq_hi, r.keys))
                    .collect();
            }
        }
        assert!(
            std::time::Instant::now() < deadline,
            "runs still being written after 10 s"
        );
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
}

#[tokio::test]
async fn large_memtables_are_sorted_on_a_thread_while_lookups_still_see_their_keys() {
    let dir = tempfile::tempdir().expect("tempdir");
    let opts = || StoreOptions {
        dedup_memtable_keys: Some(1_000),
        dedup_freeze_inline_keys: Some(0),
        ..StoreOptions::default()
    };
    let s = RedbStore::open_dir(dir.path(), opts()).expect("open");
    // Each batch re-sends the previous one's keys: whichever state they are in (memtable,
    // sealed and being sorted, frozen, written as a run), they are found.
    let mut prev: Option<std::ops::Range<u32>> = None;
    for k in 0..10u32 {
        let fresh = k * 300..k * 300 + 300;
        let r = accept_ids(&s, fresh.clone(), 1000).await;
        assert!(
            r.iter()
                .all(|o| matches!(o, AcceptOutcome::Accepted { .. }))
        );
        if let Some(p) = prev.replace(fresh) {
            let again = accept_ids(&s, p.clone(), 1000).await;
            for (i, o) in again.iter().enumerate() {
                assert_eq!(
                    *o,
                    AcceptOutcome::Duplicate {
                        seq: u64::from(p.start) + i as u64 + 1
                    },
                    "batch {k}, event {i}"
                );
            }
        }
    }
    // 3,000 keys, cut at 1,000 or more (the next seal waits for the previous run).
    let runs = runs_settled(&s).await;
    assert!(!runs.is_empty(), "{runs:?}");
    assert!(runs.iter().all(|r| r.2 >= 1_000), "{runs:?}");
    assert_eq!(s.record_counts().expect("counts").dedup_keys, 3_000);
    for i in [0u64, 999, 1_500, 2_999] {
        let fate = s.fate("/s", &i.to_string()).expect("fate").expect("known");
        assert_eq!(fate.event.seq, i + 1);
    }
    drop(s);
    let s = when_free(|| RedbStore::open_dir(dir.path(), opts())).await;
    assert_eq!(runs_settled(&s).await, runs);
    let again = accept_ids(&s, 0..3_001, 2000).await;
    assert!(
        again[..3_000]
            .iter()
            .all(|o| matches!(o, AcceptOutcome::Duplicate { .. }))
    );
    assert_eq!(again[3_000], AcceptOutcome::accepted(3_001));
}

/// Rows of a table of the store (read in a transaction of its own).
fn rows_of<K: redb::Key + 'static, V: redb::Value + 'static>(
    s: &RedbStore,
    t: TableDefinition<'static, K, V>,
) -> u64 {
    let db = s.read_db();
    let r = db.begin_read().expect("read");
    r.open_table(t).expect("table").len().expect("len")
}

async fn accept_ids(s: &RedbStore, ids: std::ops::Range<u32>, at: Millis) -> Vec<AcceptOutcome> {
    let batch = ids
        .map(|i| new_event("/s", &i.to_string(), &[], at))
        .collect();
    s.accept(batch).await.expect("accept")
}

#[tokio::test]
async fn duplicates_are_found_in_the_memtable_in_runs_and_after_a_restart() {
    let dir = tempfile::tempdir().expect("tempdir");
    let s = RedbStore::open_dir(dir.path(), small_runs(10)).expect("open");
    for k in 0..7 {
        let r = accept_ids(&s, k * 5..k * 5 + 5, 1000).await;
        assert!(
            r.iter()
                .all(|o| matches!(o, AcceptOutcome::Accepted { .. }))
        );
    }
    // 35 keys with runs cut at 10 keys: three runs, five keys in the memtable.
    let runs = runs_settled(&s).await;
    assert_eq!(runs, vec![(1, 10, 10), (11, 20, 10), (21, 30, 10)]);
    assert_eq!(rows_of(&s, DEDUP_RUN_KEYS), 30);
    // The log keeps only what no run holds.
    assert_eq!(rows_of(&s, DEDUP_LOG), 5);
    assert_eq!(s.record_counts().expect("counts").dedup_keys, 35);
    let again = accept_ids(&s, 0..35, 2000).await;
    for (i, o) in again.iter().enumerate() {
        assert_eq!(
            *o,
            AcceptOutcome::Duplicate { seq: i as u64 + 1 },
            "event {i}"
        );
    }
    for i in [0u64, 14, 34] {
        let fate = s.fate("/s", &i.to_string()).expect("fate").expect("known");
        assert_eq!(fate.event.seq, i + 1);
    }
    assert!(s.fate("/s", "35").expect("fate").is_none());
    drop(s);
    let s = when_free(|| RedbStore::open_dir(dir.path(), small_runs(10))).await;
    assert_eq!(runs_settled(&s).await.len(), 3);
    let again = accept_ids(&s, 0..36, 3000).await;
    assert_eq!(again[34], AcceptOutcome::Duplicate { seq: 35 });
    assert_eq!(again[3], AcceptOutcome::Duplicate { seq: 4 });
    assert_eq!(again[35], AcceptOutcome::accepted(36));
    assert!(
        again[..35]
            .iter()
            .all(|o| matches!(o, AcceptOutcome::Duplicate { .. }))
    );
}

#[tokio::test]
async fn runs_older_than_the_dedup_window_keep_no_filter_yet_fates_and_duplicates_are_found() {
    let dir = tempfile::tempdir().expect("tempdir");
    let s = RedbStore::open_dir(dir.path(), small_runs(10)).expect("open");
    // 30 keys accepted at t = 1 s (long before the window of a store opened today): three runs.
    for k in 0..3 {
        accept_ids(&s, k * 10..k * 10 + 10, 1000).await;
    }
    assert_eq!(runs_settled(&s).await.len(), 3);
    let counts = s.record_counts().expect("counts");
    assert!(counts.dedup_filter_bytes > 0);
    assert_eq!(counts.dedup_cold_runs, 0);
    // A sweep with a one-second window at t = 10 s (retention long: nothing removed) cools them.
    let stats = s.sweep(10_000, 1_000, i64::MAX / 4).await.expect("sweep");
    assert_eq!(stats.events_removed, 0);
    let counts = s.record_counts().expect("counts");
    assert_eq!((counts.dedup_filter_bytes, counts.dedup_cold_runs), (0, 3));
    assert_eq!(counts.dedup_keys, 30);
    for i in [0u64, 15, 29] {
        let fate = s.fate("/s", &i.to_string()).expect("fate").expect("known");
        assert_eq!(fate.event.seq, i + 1);
    }
    assert!(s.fate("/s", "30").expect("fate").is_none());
    drop(s);
    // Opened with a 24 h window today: the runs are opened cold, no filter loaded.
    let opts = || StoreOptions {
        dedup_window: Some(std::time::Duration::from_secs(86_400)),
        ..small_runs(10)
    };
    let s = when_free(|| RedbStore::open_dir(dir.path(), opts())).await;
    let counts = s.record_counts().expect("counts");
    assert_eq!((counts.dedup_filter_bytes, counts.dedup_cold_runs), (0, 3));
    let fate = s.fate("/s", "7").expect("fate").expect("known");
    assert_eq!(fate.event.seq, 8);
    // An accept whose window reaches back to them (as after the clock went back) reads the
    // cold runs directly: still a duplicate.
    let again = accept_ids(&s, 5..6, 2000).await;
    assert_eq!(again, vec![AcceptOutcome::Duplicate { seq: 6 }]);
    // Runs written from now on are inside the window, with their filter.
    let now = crate::clock::Clock::now_ms(&crate::clock::SystemClock);
    accept_ids(&s, 100..110, now).await;
    assert_eq!(runs_settled(&s).await.len(), 4);
    let counts = s.record_counts().expect("counts");
    assert!(counts.dedup_filter_bytes > 0);
    assert_eq!(counts.dedup_cold_runs, 3);
}

#[tokio::test]
async fn a_key_accepted_again_after_the_window_points_its_fate_at_the_newer_event() {
    let s = RedbStore::with_backend(redb::backends::InMemoryBackend::new(), small_runs(2))
        .expect("store");
    let mut old = new_event("/s", "k", &[], 1000);
    old.dedup_window_ms = 5_000;
    accept_ids(&s, 0..1, 1000).await;
    s.accept(vec![old]).await.expect("accept");
    // The old key is in a run now.
    assert_eq!(runs_settled(&s).await.len(), 1);
    let mut new = new_event("/s", "k", &[], 20_000);
    new.dedup_window_ms = 5_000;
    let r = s.accept(vec![new.clone()]).await.expect("accept");
    assert_eq!(r, vec![AcceptOutcome::accepted(3)]);
    assert_eq!(
        s.fate("/s", "k").expect("fate").expect("known").event.seq,
        3
    );
    // Inside the window of the new one: a duplicate of it.
    new.accepted_at = 21_000;
    let r = s.accept(vec![new]).await.expect("accept");
    assert_eq!(r, vec![AcceptOutcome::Duplicate { seq: 3 }]);
}

#[tokio::test]
async fn a_run_is_dropped_once_swept_and_a_kept_events_fate_outlives_it() {
    let s = RedbStore::with_backend(redb::backends::InMemoryBackend::new(), small_runs(4))
        .expect("store");
    // Event 0 has a queue entry; 1..3 have none.
    s.accept(vec![new_event("/s", "0", &["a"], 1000)])
        .await
        .expect("accept");
    accept_ids(&s, 1..4, 1000).await;
    assert_eq!(runs_settled(&s).await, vec![(1, 4, 4)]);
    let stats = s.sweep(100_000, 5_000, 5_000).await.expect("sweep");
    assert_eq!((stats.events_removed, stats.pending), (3, 1));
    // Event 0 is kept (its entry is live), but its run goes: its key alone moved out of it
    // (one kept event used to hold a whole run, up to a million keys).
    assert_eq!(stats.dedup_expired, 4);
    assert!(runs_settled(&s).await.is_empty());
    assert_eq!(rows_of(&s, DEDUP_RUN_KEYS), 0);
    assert_eq!(rows_of(&s, DEDUP_KEPT), 1);
    assert_eq!(s.record_counts().expect("counts").dedup_keys, 0);
    let fate = s
        .fate("/s", "0")
        .expect("fate")
        .expect("its fate is still found");
    assert_eq!(fate.event.seq, 1);
    assert!(s.fate("/s", "1").expect("fate").is_none());
    // Past the window it is not a duplicate.
    let mut again = new_event("/s", "0", &[], 200_000);
    again.dedup_window_ms = 5_000;
    let r = s.accept(vec![again]).await.expect("accept");
    assert_eq!(r, vec![AcceptOutcome::accepted(5)]);
    assert_eq!(
        s.fate("/s", "0").expect("fate").expect("known").event.seq,
        5
    );
    deliver_all(&s).await;
    let stats = s.sweep(100_000, 5_000, 5_000).await.expect("sweep");
    assert_eq!(stats.events_removed, 1);
    assert_eq!(rows_of(&s, DEDUP_KEPT), 0, "the key goes with its event");
    assert_eq!(rows_of(&s, PENDING_GC), 0);
}

#[tokio::test]
async fn a_format_6_store_has_its_kept_events_keys_copied_out_at_open() {
    let dir = tempfile::tempdir().expect("tempdir");
    let s = RedbStore::open_dir(dir.path(), small_runs(4)).expect("open");
    s.accept(vec![new_event("/s", "0", &["a"], 1000)])
        .await
        .expect("accept");
    accept_ids(&s, 1..4, 1000).await;
    assert_eq!(runs_settled(&s).await.len(), 1);
    drop(s);
    // What a format 6 build's sweep leaves: its cursor past the run, event 0 (seq 1) kept in
    // `pending_gc`, its key only in the run, no `dedup_kept`.
    let path = dir.path().join("router.redb");
    let db = when_free(|| redb::Database::create(&path)).await;
    let txn = db.begin_write().expect("txn");
    {
        txn.open_table(PENDING_GC)
            .expect("pending")
            .insert(1u64, ())
            .expect("insert");
        txn.delete_table(DEDUP_KEPT).expect("delete");
        let mut meta = txn.open_table(META).expect("meta");
        meta.insert("format_version", 6u64.to_le_bytes().as_slice())
            .expect("version");
        meta.insert("sweep_cursor", 5u64.to_le_bytes().as_slice())
            .expect("cursor");
    }
    txn.commit().expect("commit");
    drop(db);
    let s = when_free(|| RedbStore::open_dir(dir.path(), small_runs(4))).await;
    assert_eq!(rows_of(&s, DEDUP_KEPT), 1);
    let stats = s.sweep(100_000, 5_000, 5_000).await.expect("sweep");
    assert_eq!(stats.dedup_expired, 4);
    assert!(runs_settled(&s).await.is_empty());
    assert_eq!(
        s.fate("/s", "0").expect("fate").expect("known").event.seq,
        1
    );
}

#[tokio::test]
async fn a_run_left_half_written_is_removed_at_start_and_its_keys_still_count() {
    let dir = tempfile::tempdir().expect("tempdir");
    // A large memtable: nothing is written as a run by the store itself.
    let s = RedbStore::open_dir(dir.path(), small_runs(1000)).expect("open");
    accept_ids(&s, 0..20, 1000).await;
    drop(s);
    // What a crash between two chunks of run 0 leaves: some of its rows, no registration.
    let path = dir.path().join("router.redb");
    let db = when_free(|| redb::Database::create(&path)).await;
    let txn = db.begin_write().expect("txn");
    {
        let mut keys = txn.open_table(DEDUP_RUN_KEYS).expect("keys");
        for i in 0..7u64 {
            let fp = dedup::fingerprint(&crate::event::dedup_key("/s", &i.to_string()));
            keys.insert((0, fp, i + 1), 1000).expect("insert");
        }
    }
    txn.commit().expect("commit");
    drop(db);
    let s = when_free(|| RedbStore::open_dir(dir.path(), small_runs(1000))).await;
    assert!(runs_settled(&s).await.is_empty());
    assert_eq!(
        rows_of(&s, DEDUP_RUN_KEYS),
        0,
        "the orphan rows are removed"
    );
    assert_eq!(s.dedup_state().next_run, 1, "run 0 is not reused");
    let again = accept_ids(&s, 0..20, 2000).await;
    assert!(
        again
            .iter()
            .all(|o| matches!(o, AcceptOutcome::Duplicate { .. }))
    );
}

#[tokio::test]
async fn a_format_2_store_has_its_dedup_table_moved_into_the_log() {
    let dir = tempfile::tempdir().expect("tempdir");
    let s = RedbStore::open_dir(dir.path(), StoreOptions::default()).expect("open");
    accept_ids(&s, 0..10, 1000).await;
    drop(s);
    // Make it a format 2 store: the keys in the one `dedup` table, none in the new ones.
    let path = dir.path().join("router.redb");
    let db = when_free(|| redb::Database::create(&path)).await;
    let txn = db.begin_write().expect("txn");
    {
        let mut old = txn.open_table(OLD_DEDUP).expect("dedup");
        for i in 0..10u64 {
            let key = crate::event::dedup_key("/s", &i.to_string());
            old.insert(key.as_str(), (i + 1, 1000)).expect("insert");
        }
        txn.delete_table(DEDUP_LOG).expect("delete");
        txn.open_table(META)
            .expect("meta")
            .insert("format_version", 2u64.to_le_bytes().as_slice())
            .expect("version");
    }
    txn.commit().expect("commit");
    drop(db);
    let s = when_free(|| RedbStore::open_dir(dir.path(), StoreOptions::default())).await;
    let again = accept_ids(&s, 0..11, 2000).await;
    for (i, o) in again.iter().take(10).enumerate() {
        assert_eq!(*o, AcceptOutcome::Duplicate { seq: i as u64 + 1 });
    }
    assert_eq!(again[10], AcceptOutcome::accepted(11));
    assert_eq!(
        s.fate("/s", "7").expect("fate").expect("known").event.seq,
        8
    );
    drop(s);
    let db = when_free(|| redb::Database::create(&path)).await;
    let r = db.begin_read().expect("read");
    assert!(
        r.list_tables()
            .expect("tables")
            .all(|t| t.name() != OLD_DEDUP.name()),
        "the old table is gone"
    );
    assert_eq!(
        read_u64(&r.open_table(META).expect("meta"), "format_version").expect("read"),
        Some(u64::from(FORMAT_VERSION))
    );
}

#[tokio::test]
async fn dedup_runs_survive_a_power_cut_with_the_group_log() {
    let db = SimulatedDisk::new();
    let log = LogDisks::new();
    let opts = StoreOptions {
        dedup_memtable_keys: Some(50),
        ..logged(std::time::Duration::from_secs(3600))
    };
    let s = on_disks(&db, &log, opts.clone());
    let acked = accept_concurrently(&s, 0..300).await;
    runs_settled(&s).await;
    let (db_image, log_image) = cut(&db, &log);
    drop(s);
    let s = on_images(db_image, log_image, opts);
    assert_present(&s, acked.iter().map(ToString::to_string));
    for i in acked {
        let r = s
            .accept(vec![new_event("/s", &i.to_string(), &["a"], 1000)])
            .await
            .expect("accept");
        assert!(
            matches!(r[0], AcceptOutcome::Duplicate { .. }),
            "event {i} accepted twice"
        );
    }
}

/// A job is deleted only at the revision it was read at: one written since stays.
#[tokio::test]
async fn jobs_are_deleted_only_at_the_revision_read() {
    let dir = tempfile::tempdir().expect("tempdir");
    let s = RedbStore::open_dir(dir.path(), StoreOptions::default()).expect("open");
    let j = job("redrive-1", JobKind::Redrive);
    let rev = s.put_job(j.clone()).await.expect("create");
    let stale = Job {
        rev: rev - 1,
        ..j.clone()
    };
    assert_eq!(s.delete_jobs(vec![stale]).await.expect("delete"), 0);
    assert_eq!(s.jobs().expect("jobs").len(), 1);
    let current = Job { rev, ..j };
    let unknown = job("redrive-9", JobKind::Redrive);
    assert_eq!(
        s.delete_jobs(vec![current, unknown]).await.expect("delete"),
        1
    );
    assert!(s.jobs().expect("jobs").is_empty());
}

/// Listing and summarising one target's dead letters reads them through `DLQ_BY_TARGET`, which
/// follows every addition and removal and is built at open for a store from before it.
#[tokio::test]
async fn the_dlq_is_indexed_by_target_and_the_index_is_built_for_an_older_store() {
    let dir = tempfile::tempdir().expect("tempdir");
    let s = RedbStore::open_dir(dir.path(), StoreOptions::default()).expect("open");
    // Ten events, each overflowing both of its targets' caps: one dead letter per target.
    let events = (0..10)
        .map(|i| {
            let mut ne = new_event("/s", &i.to_string(), &["a", "b"], 1000 + i);
            for t in &mut ne.targets {
                t.max_depth = Some(0);
            }
            ne
        })
        .collect();
    s.accept(events).await.expect("accept");
    let of = |t: &str| DlqFilter {
        target: Some(t.into()),
        ..DlqFilter::default()
    };
    let targets_of = |list: &[DlqEntry]| -> Vec<String> {
        list.iter()
            .map(|d| d.target_id.clone().unwrap_or_default())
            .collect()
    };
    let page = s.dlq_list(&of("a"), None, 4).expect("list");
    assert_eq!(targets_of(&page), ["a"; 4]);
    assert!(page.windows(2).all(|w| w[0].id < w[1].id), "{page:?}");
    let rest = s
        .dlq_list(&of("a"), page.last().map(|d| d.id), 100)
        .expect("list");
    assert_eq!(rest.len(), 6);
    let summary = s.dlq_summary(&of("b"), 3_600_000).expect("summary");
    assert_eq!((summary.len(), summary[0].count), (1, 10));
    // A removal leaves the index with it.
    let purged = s.purge_dlq(vec![page[0].id]).await.expect("purge");
    assert_eq!(purged, 1);
    assert_eq!(s.dlq_list(&of("a"), None, 100).expect("list").len(), 9);
    drop(s);

    // A format 5 store: no index at all.
    let path = dir.path().join("router.redb");
    let db = when_free(|| redb::Database::create(&path)).await;
    let txn = db.begin_write().expect("txn");
    txn.delete_table(DLQ_BY_TARGET).expect("delete");
    txn.open_table(META)
        .expect("meta")
        .insert("format_version", 5u64.to_le_bytes().as_slice())
        .expect("format");
    txn.commit().expect("commit");
    drop(db);
    let s = when_free(|| RedbStore::open_dir(dir.path(), StoreOptions::default())).await;
    assert_eq!(s.dlq_list(&of("a"), None, 100).expect("list").len(), 9);
    assert_eq!(s.dlq_list(&of("b"), None, 100).expect("list").len(), 10);
    assert!(s.dlq_list(&of("c"), None, 100).expect("list").is_empty());
    let all = s.dlq_list(&DlqFilter::default(), None, 100).expect("list");
    assert_eq!(all.len(), 19);
}

/// A replay meets the queue-depth cap as acceptance does: copies past it go to the DLQ as
/// target_overflow.
#[tokio::test]
async fn a_replay_past_a_targets_depth_cap_overflows_to_the_dlq() {
    let s = RedbStore::in_memory().expect("store");
    let mut seqs = Vec::new();
    for i in 0..3 {
        let out = s
            .accept(vec![new_event("/s", &format!("e{i}"), &["a"], 1000)])
            .await
            .expect("accept");
        let AcceptOutcome::Accepted { seq, .. } = out[0] else {
            panic!("{out:?}")
        };
        seqs.push(seq);
    }
    let j = job("replay-1", JobKind::Replay);
    let rev = s.put_job(j.clone()).await.expect("create");
    // The third item's event is gone (swept since the step read it).
    let items = seqs
        .iter()
        .chain(&[seqs[2] + 1000])
        .map(|&seq| ReplayItem {
            seq,
            targets: vec![NewEntry {
                target_id: "a".into(),
                rule: "r".into(),
                ordering_key: None,
                max_depth: Some(4),
                lease_ms: None,
                hold_key: false,
            }],
        })
        .collect();
    // The caller counts every item as moved.
    let stepped = s
        .replay_step(Job { rev, moved: 4, ..j }, items, 2000)
        .await
        .expect("step");
    // Three accepted, one replayed copy fits under the cap of four, two overflow: the job
    // counts their events as failed, not moved too ("4/4 moved, 2 failed"), and the step
    // says which (they are counted and announced). The gone one is neither: the job counts
    // it as expired when it ends.
    assert_eq!(
        stepped.overflowed,
        [(seqs[1], "a".to_owned()), (seqs[2], "a".to_owned())]
    );
    assert_eq!(stepped.gone, [seqs[2] + 1000]);
    let stored = s.job("replay-1").await.expect("job").expect("stored");
    assert_eq!((stored.moved, stored.failed), (1, 2), "{stored:?}");
    let stats = &s.queue_stats()["a"];
    assert_eq!((stats.queued, stats.dlq), (4, 2), "{stats:?}");
    let overflowed = s.fate("/s", "e2").expect("fate").expect("known").dlq;
    assert_eq!(overflowed[0].reason, DlqReason::TargetOverflow);
    assert_eq!(overflowed[0].replay.as_deref(), Some("replay-1"));
    // Redriven, the copy is still the replay's: its marker and key, not the original's
    // (receivers deduplicating on the key dropped it as the original).
    let r = job("redrive-1", JobKind::Redrive);
    let rev = s.put_job(r.clone()).await.expect("create");
    s.redrive_step(
        Job { rev, ..r },
        vec![RedriveAction::Route {
            dlq_id: overflowed[0].id,
            matched_rules: vec!["r".into()],
            targets: vec![NewEntry {
                target_id: "a".into(),
                rule: "r".into(),
                ordering_key: None,
                max_depth: None,
                lease_ms: None,
                hold_key: false,
            }],
        }],
        3000,
    )
    .await
    .expect("redrive");
    let fate = s.fate("/s", "e2").expect("fate").expect("known");
    let copy = fate
        .entries
        .iter()
        .find(|e| e.redrive_count == 1)
        .expect("the redriven copy");
    assert_eq!(copy.replay.as_deref(), Some("replay-1"));
    let original = idempotency_key("/s", "e2", "a");
    assert_eq!(
        copy.idempotency_key,
        idempotency_key(&original, "replay-1", "replay")
    );
}

/// A replay reads the archive from where its range starts: the start is found by bisecting the
/// sequences, not by reading every event before it, and the range (with a clock stepped back
/// inside the slack, and quarantined events left out) reads and counts the same either way.
#[tokio::test]
async fn the_archive_is_read_from_the_start_of_a_replays_range() {
    let s = RedbStore::in_memory().expect("store");
    // One event a second for 20 minutes; the clock steps back 5 s at 600 s; one quarantined.
    let mut evs: Vec<NewEvent> = (0..1200)
        .map(|i| {
            let at = 1_000_000 + i * 1000 - if i >= 600 { 5_000 } else { 0 };
            new_event("/s", &format!("e{i}"), &["a"], at)
        })
        .collect();
    evs[603].quarantine = Some(Quarantine {
        reason: DlqReason::ContractViolation,
        errors: vec![],
        emitted_by: None,
    });
    for chunk in evs.chunks(100) {
        s.accept(chunk.to_vec()).await.expect("accept");
    }
    let (from, to) = (1_000_000 + 598_000, 1_000_000 + 610_000);
    let want: Vec<String> = (0..1200)
        .filter(|&i| {
            let at = 1_000_000 + i * 1000 - if i >= 600 { 5_000 } else { 0 };
            at >= from && at < to && i != 603
        })
        .map(|i| format!("e{i}"))
        .collect();
    let mut got = Vec::new();
    let mut after = 0;
    loop {
        let page = s
            .events_between(from, to, after, 4, usize::MAX)
            .expect("page");
        let Some(last) = page.last() else { break };
        after = last.seq;
        got.extend(page.iter().map(|e| e.event.id.clone()));
    }
    assert_eq!(got, want);
    assert_eq!(
        s.count_events_between(from, to).expect("count"),
        want.len() as u64
    );
    // A page holds no more than its byte budget, and at least one event whatever its size.
    let all = s.events_between(from, to, 0, 100, usize::MAX).expect("all");
    let record = |seq: u64| {
        let db = s.read_db();
        let r = db.begin_read().expect("read");
        let t = r.open_table(EVENTS).expect("events");
        t.get(seq).expect("get").expect("there").value().len()
    };
    let two = record(all[0].seq) + record(all[1].seq);
    let page = s.events_between(from, to, 0, 100, two).expect("page");
    assert_eq!(page.len(), 2, "two events fit in their own bytes");
    let page = s.events_between(from, to, 0, 100, two - 1).expect("page");
    assert_eq!(page.len(), 1, "the second does not fit");
    let page = s.events_between(from, to, 0, 100, 0).expect("page");
    assert_eq!(page.len(), 1, "the first is always taken");
    assert_eq!(page[0].seq, all[0].seq);
    // The bisection lands on the first event at or after its time, wherever that is.
    let db = s.read_db();
    let r = db.begin_read().expect("read");
    let t = r.open_table(EVENTS).expect("events");
    let seq_of = |i: u64| i + 1;
    assert_eq!(first_seq_from(&t, 0).expect("bisect"), seq_of(0));
    assert_eq!(
        first_seq_from(&t, 1_000_000 + 300_000).expect("bisect"),
        seq_of(300)
    );
    assert_eq!(
        first_seq_from(&t, 1_000_000 + 300_001).expect("bisect"),
        seq_of(301)
    );
    assert_eq!(first_seq_from(&t, i64::MAX).expect("bisect"), seq_of(1200));
    assert_eq!(
        s.count_events_between(i64::MAX - 1, i64::MAX)
            .expect("count"),
        0
    );
}

fn poison(id: &str, at: Millis) -> NewEvent {
    let mut ne = new_event("/s", id, &["a"], at);
    ne.targets.clear();
    ne.quarantine = Some(Quarantine {
        reason: DlqReason::ContractViolation,
        errors: vec![],
        emitted_by: None,
    });
    ne
}

/// A producer that fixes a quarantined event's data and sends it again with the same id has
/// it accepted and routed (the quarantined copy never was); a copy that fails again, or a
/// second fixed copy, is a duplicate — also after a restart, and in one accept call.
#[tokio::test]
async fn a_fixed_copy_of_a_quarantined_event_is_accepted_in_its_place() {
    let dir = tempfile::tempdir().expect("tempdir");
    {
        let s = RedbStore::open_dir(dir.path(), StoreOptions::default()).expect("open");
        let bad = s.accept(vec![poison("1", 1000)]).await.expect("accept");
        assert_eq!(bad, vec![AcceptOutcome::accepted(1)]);
        assert_eq!(
            s.accept(vec![poison("1", 1001)]).await.expect("accept"),
            vec![AcceptOutcome::Duplicate { seq: 1 }],
            "failing again: a duplicate"
        );
        let fixed = s
            .accept(vec![new_event("/s", "1", &["a"], 1002)])
            .await
            .expect("accept");
        assert_eq!(fixed, vec![AcceptOutcome::accepted(2)]);
        assert_eq!(s.queue_stats()["a"].queued, 1, "routed");
        let fate = s.fate("/s", "1").expect("fate").expect("known");
        assert!(!fate.event.quarantined);
        assert_eq!(fate.entries.len(), 1);
        // In one call: the fixed copy after the quarantined one.
        let both = s
            .accept(vec![poison("2", 1003), new_event("/s", "2", &["a"], 1003)])
            .await
            .expect("accept");
        assert_eq!(
            both,
            vec![AcceptOutcome::accepted(3), AcceptOutcome::accepted(4)]
        );
    }
    let s = when_free(|| RedbStore::open_dir(dir.path(), StoreOptions::default())).await;
    for again in [poison("1", 1004), new_event("/s", "1", &["a"], 1004)] {
        assert_eq!(
            s.accept(vec![again]).await.expect("accept"),
            vec![AcceptOutcome::Duplicate { seq: 2 }],
            "the fixed copy is the one held"
        );
    }
    let dlq = s.dlq_list(&DlqFilter::default(), None, 10).expect("dlq");
    assert_eq!(dlq.len(), 2, "the quarantined copies stay in the DLQ");
}

/// A redrive does not route a quarantined copy whose producer has since sent the event again
/// (the later copy was routed in its place): routed too, it reached the targets after the
/// later copy, with the older data, under the same idempotency key. It stays in the DLQ saying
/// so, the step counts it failed rather than moved, and the event's fate lists it as a
/// previous copy. A quarantined event sent once is routed, and a copy sent after that is a
/// duplicate.
#[tokio::test]
async fn a_redrive_keeps_a_quarantined_copy_that_a_later_copy_replaced() {
    let dir = tempfile::tempdir().expect("tempdir");
    let s = RedbStore::open_dir(dir.path(), StoreOptions::default()).expect("open");
    s.accept(vec![poison("1", 1000), poison("2", 1000)])
        .await
        .expect("accept");
    let dlq_of = |id| s.fate("/s", id).expect("fate").expect("known").dlq[0].id;
    let (stale, alone) = (dlq_of("1"), dlq_of("2"));
    assert_eq!(
        s.accept(vec![new_event("/s", "1", &["a"], 1001)])
            .await
            .expect("accept"),
        vec![AcceptOutcome::accepted(3)]
    );
    let j = job("redrive-1", JobKind::Redrive);
    s.put_job(j.clone()).await.expect("create");
    let route = |dlq_id| RedriveAction::Route {
        dlq_id,
        matched_rules: vec!["r".into()],
        targets: new_event("/s", "x", &["a"], 0).targets,
    };
    let planned = Job {
        moved: 2,
        cursor: alone,
        rev: 1,
        ..j
    };
    let (_, gone) = s
        .redrive_step(planned, vec![route(stale), route(alone)], 2000)
        .await
        .expect("step");
    assert_eq!(
        gone,
        RedriveGone {
            superseded: 1,
            ..RedriveGone::default()
        }
    );
    let stored = s.jobs().expect("jobs").remove(0);
    assert_eq!((stored.moved, stored.failed, stored.skipped), (1, 1, 0));
    assert_eq!(
        s.queue_stats()["a"].queued,
        2,
        "the later copy of 1, and 2 routed"
    );
    let kept = s.dlq_get(stale).expect("get").expect("kept").0;
    let note = kept.not_redriven.expect("a note").message;
    assert!(
        note.contains("a later copy of this event") && note.contains("routed in its place"),
        "{note}"
    );
    let fate = s.fate("/s", "1").expect("fate").expect("known");
    assert_eq!(fate.event.seq, 3);
    assert_eq!(fate.previous.len(), 1);
    assert_eq!(fate.previous[0].event.seq, 1);
    let ids: Vec<u64> = fate.previous[0].dlq.iter().map(|d| d.id).collect();
    assert_eq!(ids, vec![stale]);
    assert_eq!(
        s.accept(vec![new_event("/s", "2", &["a"], 2001)])
            .await
            .expect("accept"),
        vec![AcceptOutcome::Duplicate { seq: 2 }],
        "routed by the redrive, it is no longer replaced by a copy sent again"
    );
    assert!(
        s.fate("/s", "2")
            .expect("fate")
            .expect("known")
            .previous
            .is_empty()
    );
}

/// Two redrive jobs planned over the same dead letters: the step applied second finds them
/// gone and its stored progress counts them as skipped, not moved (each job reported every
/// entry moved: two jobs over 60 entries said 120).
#[tokio::test]
async fn a_redrive_step_counts_entries_already_gone_as_skipped() {
    let dir = tempfile::tempdir().expect("tempdir");
    let s = RedbStore::open_dir(dir.path(), StoreOptions::default()).expect("open");
    let mut ne = new_event("/s", "1", &["capped"], 1000);
    ne.targets[0].max_depth = Some(0);
    s.accept(vec![ne]).await.expect("accept");
    let dlq_id = s.fate("/s", "1").expect("fate").expect("known").dlq[0].id;
    let route = || RedriveAction::Route {
        dlq_id,
        matched_rules: vec!["r".into()],
        targets: new_event("/s", "1", &["c"], 0).targets,
    };
    let (first, second) = (
        job("redrive-1", JobKind::Redrive),
        job("redrive-2", JobKind::Redrive),
    );
    for j in [&first, &second] {
        s.put_job(j.clone()).await.expect("create");
    }
    let planned = |j: &Job| Job {
        moved: 1,
        cursor: dlq_id,
        rev: 1,
        ..j.clone()
    };
    let (_, gone) = s
        .redrive_step(planned(&first), vec![route()], 2000)
        .await
        .expect("first step");
    assert_eq!(gone, RedriveGone::default());
    let (_, gone) = s
        .redrive_step(planned(&second), vec![route()], 2000)
        .await
        .expect("second step");
    assert_eq!(
        gone,
        RedriveGone {
            moved: 1,
            ..RedriveGone::default()
        }
    );
    let jobs = s.jobs().expect("jobs");
    let progress = |id: &str| {
        let j = jobs.iter().find(|j| j.id == id).expect("job");
        (j.moved, j.failed, j.skipped)
    };
    assert_eq!(progress("redrive-1"), (1, 0, 0));
    assert_eq!(progress("redrive-2"), (0, 0, 1));
    let fate = s.fate("/s", "1").expect("fate").expect("known");
    assert_eq!(fate.entries.len(), 1, "routed once");
}

/// One event whose record does not decode no longer fails every lease of its target: the
/// lease gives the others, and that one apart (leased, with the decoder's error and its
/// sequence number), for the worker to set aside. Its dead letter is written and listed
/// without its event, and its fate answers that the record cannot be read, naming that
/// dead letter, instead of a storage failure.
#[tokio::test]
async fn an_unreadable_event_is_leased_apart_and_its_dead_letter_is_listed() {
    let s = RedbStore::in_memory().expect("store");
    let r = s
        .accept(
            (1..=3)
                .map(|i| new_event("/s", &i.to_string(), &["a"], 1000))
                .collect(),
        )
        .await
        .expect("accept");
    let AcceptOutcome::Accepted { seq: bad, .. } = r[1] else {
        panic!("{r:?}")
    };
    s.damage_event(bad, b"{not json");
    let batch = s.lease_batch("a", 2000, 10, 60_000).await.expect("lease");
    assert_eq!(batch.leased.len(), 2, "{batch:?}");
    assert_eq!(batch.unreadable.len(), 1, "{batch:?}");
    let u = &batch.unreadable[0];
    assert_eq!(u.entry.id.event, bad);
    assert!(u.error.contains("corrupt record in events"), "{}", u.error);
    // Set aside under its lease, as the worker does.
    let end = AttemptEnd {
        finished_at: 2001,
        result: AttemptResult::NotSent,
        status: None,
        error: Some(format!("the stored record of event {bad} cannot be read")),
        outbox: None,
    };
    let dead = Disposition::DeadLetter {
        reason: DlqReason::CorruptRecord,
        hold: false,
    };
    s.finish(u.entry.id, u.lease, end, dead, 2001)
        .await
        .expect("set aside");
    let list = s
        .dlq_list(&DlqFilter::default(), None, 10)
        .expect("listed without its event");
    assert_eq!(list.len(), 1, "{list:?}");
    assert_eq!(list[0].reason, DlqReason::CorruptRecord);
    assert_eq!(list[0].event_seq, bad);
    assert!(list[0].attempts.is_empty(), "nothing was sent: {list:?}");
    assert_eq!(
        s.queue_stats()["a"].in_flight,
        2,
        "the others are in flight"
    );
    match s.fate("/s", "2") {
        Err(StoreError::Corrupt { message, .. }) => {
            assert!(message.contains(&format!("sequence {bad}")), "{message}");
            assert!(
                message.contains(&format!("DLQ entries: {}", list[0].id)),
                "{message}"
            );
        }
        other => panic!("{other:?}"),
    }
    assert!(
        s.fate("/s", "1").expect("fate").is_some(),
        "the others read"
    );
}

/// A sweep passes an event whose record does not decode: kept while an entry refers to it,
/// removed once nothing does. It failed every sweep from the moment it was reached (its
/// acceptance time, then its dedup key, could not be read), and with it every request of the
/// commit group the sweep was in.
#[tokio::test]
async fn a_sweep_passes_an_unreadable_event() {
    let s = RedbStore::in_memory().expect("store");
    s.accept(
        (1..=3)
            .map(|i| new_event("/s", &i.to_string(), &["a"], 1000))
            .collect(),
    )
    .await
    .expect("accept");
    s.damage_event(2, b"{not json");
    let stats = s.sweep(11_000, 5_000, 5_000).await.expect("sweep");
    assert_eq!((stats.events_removed, stats.pending), (0, 3), "{stats:?}");
    let batch = s.lease_batch("a", 11_000, 10, 60_000).await.expect("lease");
    for l in &batch.leased {
        ack(&s, l, 11_001).await.expect("ack");
    }
    let u = &batch.unreadable[0];
    let end = AttemptEnd {
        finished_at: 11_001,
        result: AttemptResult::NotSent,
        status: None,
        error: Some("unreadable".into()),
        outbox: None,
    };
    let dead = Disposition::DeadLetter {
        reason: DlqReason::CorruptRecord,
        hold: false,
    };
    s.finish(u.entry.id, u.lease, end, dead, 11_001)
        .await
        .expect("set aside");
    let stats = s.sweep(12_000, 5_000, 5_000).await.expect("sweep");
    assert_eq!(stats.events_removed, 2, "{stats:?}");
    let dlq = s.dlq_list(&DlqFilter::default(), None, 10).expect("dlq");
    assert_eq!(s.purge_dlq(vec![dlq[0].id]).await.expect("purge"), 1);
    let stats = s.sweep(13_000, 5_000, 5_000).await.expect("sweep");
    assert_eq!(stats.events_removed, 1, "{stats:?}");
    assert_eq!(s.record_counts().expect("counts").events, 0);
}

/// A page of the events table damaged in a cleanly closed file (which redb does not verify
/// at open) makes redb panic reading it. A lease that meets it fails like a failing store,
/// its entries back in their queue: the panic killed the delivery task with them held in
/// flight for good. (`router store check` finds the page.)
#[tokio::test]
async fn a_panic_reading_a_damaged_page_fails_the_lease_and_gives_its_entries_back() {
    let dir = tempfile::tempdir().expect("tempdir");
    let opts = || StoreOptions {
        floor_every: Some(std::time::Duration::ZERO),
        ..StoreOptions::default()
    };
    {
        let s = RedbStore::open_dir(dir.path(), opts()).expect("open");
        accept_padded(&s, 0).await.expect("accept");
        // Two more groups: the floor passes every padded event, so the recovery at open does
        // not read their records (the lease is the first to).
        for id in ["a", "b"] {
            s.accept(vec![new_event("/s", id, &[], 1000)])
                .await
                .expect("accept");
        }
        s.close().await.expect("close");
    }
    let path = dir.path().join("router.redb");
    when_free(|| check::check_dir(dir.path())).await;
    let mut bytes = std::fs::read(&path).expect("read");
    // Every page holding the event (redb writes pages anew: older copies stay in free ones).
    let pages: Vec<usize> = memchr::memmem::find_iter(&bytes, b"\"0-100\"")
        .map(|at| at / 4096 * 4096)
        .collect();
    assert!(!pages.is_empty(), "the event's page");
    // Its entry count: the reads past it index out of the page.
    for page in pages {
        bytes[page + 2] = 0xff;
        bytes[page + 3] = 0xff;
    }
    std::fs::write(&path, &bytes).expect("write");
    let s = RedbStore::open_dir(dir.path(), opts()).expect("a clean file opens unverified");
    let r = s.lease("a", 2000, 500, 60_000).await;
    match r {
        Err(StoreError::Corrupt { message, .. }) => {
            assert!(message.contains("redb panicked"), "{message}");
            assert!(message.contains("router store check"), "{message}");
        }
        other => panic!("{:?}", other.map(|l| l.len())),
    }
    let q = s.queue_stats();
    assert_eq!((q["a"].queued, q["a"].in_flight), (200, 0), "{q:?}");
}

/// The same damage where the recovery at open reads it (events above the entry floor): the
/// open is an error naming the file and the check to run, not a panic (exit 101 with a
/// backtrace).
#[tokio::test]
async fn a_panic_opening_a_damaged_file_is_an_error() {
    let dir = tempfile::tempdir().expect("tempdir");
    {
        let s = RedbStore::open_dir(dir.path(), StoreOptions::default()).expect("open");
        accept_padded(&s, 0).await.expect("accept");
        s.close().await.expect("close");
    }
    let path = dir.path().join("router.redb");
    when_free(|| check::check_dir(dir.path())).await;
    let mut bytes = std::fs::read(&path).expect("read");
    let pages: Vec<usize> = memchr::memmem::find_iter(&bytes, b"\"0-100\"")
        .map(|at| at / 4096 * 4096)
        .collect();
    for page in pages {
        bytes[page + 2] = 0xff;
        bytes[page + 3] = 0xff;
    }
    std::fs::write(&path, &bytes).expect("write");
    let Err(e) = RedbStore::open_dir(dir.path(), StoreOptions::default()) else {
        panic!("opened")
    };
    let msg = e.to_string();
    assert!(
        msg.contains("redb panicked reading the store file"),
        "{msg}"
    );
    assert!(msg.contains("router store check"), "{msg}");
    let r = check::check_dir(dir.path()).expect("checked");
    assert!(matches!(r.verdict, check::Verdict::Damaged(_)), "{r:?}");
}

/// The same damage where the committer reads it (a sweep going through the events in
/// order): the group fails like one on a failing disk and the store is reopened (which, the
/// file failing its check, it refuses: calls answer errors meanwhile). The panic killed the
/// committer, after which every call answered "store is closed" for good.
#[tokio::test]
async fn a_panic_in_a_commit_group_fails_the_group_and_the_store_stays_up() {
    let dir = tempfile::tempdir().expect("tempdir");
    let opts = || StoreOptions {
        floor_every: Some(std::time::Duration::ZERO),
        ..StoreOptions::default()
    };
    {
        let s = RedbStore::open_dir(dir.path(), opts()).expect("open");
        accept_padded(&s, 0).await.expect("accept");
        for id in ["a", "b"] {
            s.accept(vec![new_event("/s", id, &[], 1000)])
                .await
                .expect("accept");
        }
        s.close().await.expect("close");
    }
    let path = dir.path().join("router.redb");
    when_free(|| check::check_dir(dir.path())).await;
    let mut bytes = std::fs::read(&path).expect("read");
    let pages: Vec<usize> = memchr::memmem::find_iter(&bytes, b"\"0-100\"")
        .map(|at| at / 4096 * 4096)
        .collect();
    for page in pages {
        bytes[page + 2] = 0xff;
        bytes[page + 3] = 0xff;
    }
    std::fs::write(&path, &bytes).expect("write");
    let s = RedbStore::open_dir(dir.path(), opts()).expect("a clean file opens unverified");
    let r = s.sweep(10_000_000, 1000, 1000).await;
    assert!(
        matches!(&r, Err(StoreError::Backend(m)) if m.contains("nothing of it was stored")),
        "{r:?}"
    );
    let r = s.accept(vec![new_event("/s", "c", &["a"], 3000)]).await;
    assert!(
        matches!(&r, Err(e) if !matches!(e, StoreError::Closed)),
        "{r:?}"
    );
}

/// The offsets where the records of a log image start (each whole and checked).
fn record_offsets(image: &[u8]) -> Vec<usize> {
    let mut at = 0;
    let mut out = Vec::new();
    for r in crate::store::group_log::records(image) {
        out.push(at);
        at += 24 + r.payload_len();
    }
    out
}

/// A byte changed in the middle of the group log (not its tail): the records past it are
/// groups that were acknowledged, so the store refuses to open, naming the file, the offset
/// and how many groups follow, instead of applying the groups before it and losing the rest
/// without a word. Cut at that offset (what the refusal says to do to accept the loss), it
/// opens with the groups before it; a torn tail alone ends the log quietly.
#[tokio::test]
async fn a_damaged_group_log_is_refused_and_a_torn_tail_is_not() {
    let (db, log) = (SimulatedDisk::new(), LogDisks::new());
    let s = on_disks(&db, &log, logged(std::time::Duration::from_secs(3600)));
    for i in 0..20 {
        s.accept(vec![new_event("/s", &i.to_string(), &["a"], 1000)])
            .await
            .expect("accept");
    }
    let (db_image, log_images) = cut(&db, &log);
    drop(s);
    let offsets = record_offsets(&log_images[0]);
    assert!(offsets.len() >= 20, "{} records", offsets.len());
    let bad = offsets[5];
    let end = offsets[offsets.len() - 1] + 24 + 8;
    let mut damaged = log_images.clone();
    damaged[0][bad + 30] ^= 0x01;
    let opened = RedbStore::with_backends(
        {
            let d = SimulatedDisk::from_image(db_image.clone());
            move || d.backend()
        },
        LogDisks::from_images(damaged.clone()).backends(),
        logged(std::time::Duration::from_secs(3600)),
    );
    let Err(e) = opened else {
        panic!("opened over a damaged log")
    };
    let msg = e.to_string();
    assert!(
        msg.contains(&format!("router.log is damaged at offset {bad}")),
        "{msg}"
    );
    assert!(
        msg.contains(&format!("{} groups written after it", offsets.len() - 6)),
        "{msg}"
    );
    assert!(msg.contains(&format!("truncate -s {bad}")), "{msg}");
    // Cut there: the operator accepts the loss.
    let mut cut_there = damaged;
    cut_there[0].truncate(bad);
    let s = on_images(
        db_image.clone(),
        cut_there,
        logged(std::time::Duration::from_secs(3600)),
    );
    assert!(s.fate("/s", "0").expect("fate").is_some());
    assert!(s.fate("/s", "19").expect("fate").is_none());
    drop(s);
    // A torn last record (its tail not written): quietly the end of the log.
    let mut torn = log_images;
    torn[0].truncate(end);
    let s = on_images(db_image, torn, logged(std::time::Duration::from_secs(3600)));
    assert!(s.fate("/s", "18").expect("fate").is_some());
}

/// The check of every page when the committer reopens the file after a failed write is said
/// as that, not as a crash ("not closed cleanly (a crash or a kill)", which nothing was).
#[test]
fn a_reopen_after_a_write_error_is_not_said_to_be_a_crash() {
    let reopen = repair_notice(true);
    assert!(reopen.contains("after a write error"), "{reopen}");
    assert!(!reopen.contains("crash"), "{reopen}");
    assert!(repair_notice(false).contains("a crash or a kill"));
}

/// `/v1/status` `records.dedup_keys.count` is every key held (for as long as its event is
/// kept, and until its whole run goes), which read as if it were the window's: 60,000 keys
/// beside a 20 s window at 500 events/s. Beside it, the keys that may be inside the window:
/// a run whose every key is older than the window is not among them.
#[tokio::test]
async fn the_dedup_keys_inside_the_window_are_counted_apart() {
    let now = crate::clock::Clock::now_ms(&crate::clock::SystemClock);
    let s = RedbStore::with_backend(
        redb::backends::InMemoryBackend::new(),
        StoreOptions {
            dedup_memtable_keys: Some(10),
            dedup_window: Some(std::time::Duration::from_secs(60)),
            ..StoreOptions::default()
        },
    )
    .expect("store");
    // Ten keys of two hours ago (one run), then five of now (in memory).
    accept_ids(&s, 0..10, now - 7_200_000).await;
    runs_settled(&s).await;
    accept_ids(&s, 10..15, now).await;
    let c = s.record_counts().expect("counts");
    assert_eq!(c.dedup_keys, 15);
    assert_eq!(c.dedup_keys_in_window, Some(5));
}

/// A compaction that a check finds worthwhile starts without waiting for more work. Before, it
/// ran after the committer's next group: a router with nothing to commit (its ingest refused
/// past the disk's high-water mark, its queues drained) compacted only after the next sweep, a
/// `sweep_interval` (60 s by default) later, and refused ingest all that time (a runbook
/// audit measured it).
#[tokio::test]
async fn a_worthwhile_compaction_starts_without_further_work() {
    let dir = tempfile::tempdir().expect("tempdir");
    let compactions = Arc::new(AtomicU64::new(0));
    let counter = compactions.clone();
    let opts = StoreOptions {
        compact_min_bytes: Some(1 << 20),
        // One sweep removes the whole backlog: its group is the last one before the wait.
        sweep_batch: Some(1 << 20),
        on_compact: Some(Arc::new(move |_| {
            counter.fetch_add(1, Ordering::SeqCst);
        })),
        ..Default::default()
    };
    let s = RedbStore::open_dir(dir.path(), opts).expect("open");
    for chunk in 0..20 {
        accept_padded(&s, chunk).await.expect("accept");
    }
    deliver_all(&s).await;
    let stats = s.sweep(1_000_000, 1000, 1000).await.expect("sweep");
    assert!(!stats.more && stats.events_removed == 4000, "{stats:?}");
    // Nothing else is sent to the store from here. The check runs on its own thread (a read of
    // every page: well under a second here); 20 s is far past it.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    while compactions.load(Ordering::SeqCst) == 0 && std::time::Instant::now() < deadline {
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    assert_eq!(
        compactions.load(Ordering::SeqCst),
        1,
        "no compaction without another op (file {} bytes)",
        s.disk_bytes()
    );
}

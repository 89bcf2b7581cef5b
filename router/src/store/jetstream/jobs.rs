//! The JetStream store's redrive and replay steps, archive reads, sweeps and record counts.

use std::collections::{HashMap, HashSet};

use super::records::{Expect, MAX_BATCH, RecordsError, ScanFrom, Versioned, Write};
use super::{
    DedupRecord, EntryRecord, EventRecord, JetStreamStore, KeyLock, MAX_RETRIES, dec,
    dedup_record_key, dlq_key, enc, entry_key, event_key, lock_key, ops,
};
use crate::store::redb_store::delivery_key;
use crate::store::{
    DlqEntry, EntryId, EntryState, Job, Millis, QueueEntry, RecordCounts, RedriveAction,
    RedriveGone, ReplayItem, ReplayStepped, StoreError, StoredEvent, SweepStats, superseded_note,
};

/// Events removed (or examined and kept) per sweep batch, so one call stays short.
const SWEEP_BATCH: usize = 256;

/// Batches of kept events only (nothing removed) one sweep call goes over before it stops.
const KEPT_BATCHES_PER_CALL: usize = 8;

/// What `remove_kv` did.
#[derive(Debug, Default)]
struct KvRemoved {
    /// Entries removed.
    removed: u64,
    /// The batch of entries chosen was full: there may be more.
    full: bool,
    /// A shard's batch was left because its usage record changed meanwhile.
    conflicted: bool,
    /// The last revision the pass examined.
    last: Option<u64>,
}

/// Where a sweep's next pass over a kind of records goes on: after `last` when the batch was
/// full, else (the pass reached the end) from the start.
fn next_pass(last: Option<u64>, full: bool) -> u64 {
    match last {
        Some(rev) if full => rev + 1,
        _ => 0,
    }
}

/// A record that does not decode, as the store reports it.
fn corrupt(table: &'static str, e: &serde_json::Error) -> StoreError {
    StoreError::Corrupt {
        table,
        message: e.to_string(),
    }
}

impl JetStreamStore {
    /// Applies redrive actions and the job's new progress in one transaction (read again and
    /// retried when another node changed one of its records meanwhile).
    pub async fn redrive_step(
        &self,
        job: Job,
        actions: Vec<RedriveAction>,
        now: Millis,
    ) -> Result<(u64, RedriveGone), StoreError> {
        for attempt in 0..MAX_RETRIES {
            // The job first: a step it no longer owns reads nothing more.
            let mut writes = vec![self.job_write(&job, attempt > 0).await?];
            // Events changed by several actions of this step: their latest record.
            let mut events: HashMap<u64, (EventRecord, u64)> = HashMap::new();
            let mut gone = RedriveGone::default();
            // Held keys this step releases (once each).
            let mut released = HashSet::new();
            for action in &actions {
                let dlq_id = action.dlq_id();
                let Some((mut d, drev)) = self
                    .read_existing::<DlqEntry>("dlq", &dlq_key(dlq_id))
                    .await?
                else {
                    gone.add(action);
                    continue;
                };
                match action {
                    RedriveAction::Requeue { .. } | RedriveAction::RequeueTo { .. } => {
                        writes.push(Write::delete(dlq_key(dlq_id), Expect::Revision(drev)));
                        let Some(id) = d.entry else { continue };
                        let Some((mut r, rev)) = self
                            .read_existing::<EntryRecord>("entries", &entry_key(id))
                            .await?
                        else {
                            continue;
                        };
                        r.entry.id = id;
                        if r.entry.ordering_key.is_some() {
                            r.key_at = r.key_at.or(Some(r.entry.accepted_at));
                        }
                        r.entry.requeue_for_redrive(now);
                        r.dlq = None;
                        // The dead letter that held its key goes back at the head of the key:
                        // the hold is released with it, after the entry in the batch (views
                        // apply it in order: the key free while the entry was still dead let
                        // the key's next entry take the lock first).
                        let hold = match &r.entry.ordering_key {
                            Some(key) => {
                                self.redrive_release(&r.entry.target_id, key, dlq_id, &mut released)
                                    .await?
                            }
                            None => None,
                        };
                        // A removed target's dead letter for the live target with its
                        // destination (the hold released above is the old target's).
                        if let RedriveAction::RequeueTo {
                            target,
                            ordering_key,
                            ..
                        } = action
                        {
                            r.entry.target_id.clone_from(target);
                            r.entry.ordering_key.clone_from(ordering_key);
                            r.key_at = ordering_key
                                .as_ref()
                                .map(|_| r.key_at.unwrap_or(r.entry.accepted_at));
                        }
                        let bytes = self.fit_records(&mut r, None)?.0;
                        writes.push(Write::put(entry_key(id), bytes, Expect::Revision(rev)));
                        writes.extend(hold);
                    }
                    RedriveAction::Route {
                        matched_rules,
                        targets,
                        ..
                    } => {
                        let seq = d.event_seq;
                        let Some((ev, _)) = self.event_for(&mut events, seq).await? else {
                            writes.push(Write::delete(dlq_key(dlq_id), Expect::Revision(drev)));
                            continue;
                        };
                        if ev.stored.quarantined {
                            // Its dedup record says whether a later copy of (source, id)
                            // took its place (the producer sent it again): then it stays,
                            // as on redb. Written in the same commit, quarantined no more,
                            // so that a copy accepted meanwhile fails the commit (read
                            // again: kept), and one sent after it is a duplicate.
                            let stored = &ev.stored.event;
                            let dd = dedup_record_key(&stored.source, &stored.id);
                            let read = self.records.get_leader(&dd).await?;
                            let (rec, rev) = match read {
                                Some(Versioned {
                                    value: Some(bytes),
                                    revision,
                                }) => (Some(dec::<DedupRecord>("dedup", &bytes)?), revision),
                                _ => (None, 0),
                            };
                            match rec {
                                Some(r)
                                    if r.seq != seq
                                        && r.source == stored.source
                                        && r.id == stored.id =>
                                {
                                    d.kept_by_redrive(
                                        &job.id,
                                        now,
                                        &superseded_note(r.accepted_at, r.quarantined),
                                        None,
                                    );
                                    // Rewritten, it keeps when it was made.
                                    d.made.get_or_insert(drev);
                                    writes.push(Write::put(
                                        dlq_key(dlq_id),
                                        enc(&d),
                                        Expect::Revision(drev),
                                    ));
                                    gone.superseded += 1;
                                    continue;
                                }
                                Some(mut r) if r.seq == seq => {
                                    r.quarantined = false;
                                    writes.push(Write::put(dd, enc(&r), Expect::Revision(rev)));
                                }
                                // Removed with a later copy the sweep removed (this one,
                                // in the DLQ, is kept): nothing to hold or to update.
                                _ => {}
                            }
                        }
                        writes.push(Write::delete(dlq_key(dlq_id), Expect::Revision(drev)));
                        if ev.stored.quarantined {
                            ev.stored.quarantined = false;
                            ev.stored.matched_rules = matched_rules.clone();
                        }
                        let stored = &ev.stored.event;
                        for t in targets {
                            let id = EntryId {
                                event: seq,
                                idx: ev.entries,
                            };
                            ev.entries += 1;
                            // A replay's copy stays one, with the replay's key.
                            let key = delivery_key(
                                &stored.source,
                                &stored.id,
                                &t.target_id,
                                d.replay.as_deref(),
                            );
                            let entry = QueueEntry {
                                redrive_count: d.redrive_count + 1,
                                replay: d.replay.clone(),
                                // Its max_age counts from the redrive, as for a requeued
                                // entry.
                                ..QueueEntry::queued(id, t.clone(), key, now, now, stored.hops())
                            };
                            // Among its key's entries it goes where its event's acceptance puts
                            // it (redb orders a key by entry id, whose event part is the
                            // same): a copy refused at acceptance goes before the key's later
                            // events.
                            let key_at = entry.ordering_key.as_ref().map(|_| ev.stored.accepted_at);
                            // A copy refused at acceptance held its key like any dead letter:
                            // back in the queue, the hold has done its work (released after
                            // the entry in the batch, as for a requeued one).
                            let release = match &entry.ordering_key {
                                Some(key) => {
                                    self.redrive_release(
                                        &entry.target_id,
                                        key,
                                        dlq_id,
                                        &mut released,
                                    )
                                    .await?
                                }
                                None => None,
                            };
                            let r = EntryRecord {
                                entry,
                                dlq: None,
                                node: None,
                                key_at,
                            };
                            writes.push(Write::put(entry_key(id), enc(&r), Expect::Revision(0)));
                            writes.extend(release);
                        }
                    }
                    RedriveAction::Keep { note, errors, .. } => {
                        // Not a new failure: the time of the last one stays.
                        d.kept_by_redrive(&job.id, now, note, errors.as_ref());
                        // Rewritten, it keeps when it was made: a later redrive
                        // (created before this step) still takes it.
                        d.made.get_or_insert(drev);
                        writes.push(Write::put(dlq_key(dlq_id), enc(&d), Expect::Revision(drev)));
                    }
                }
            }
            if gone != RedriveGone::default() {
                // The stored progress counts them as skipped (read again: the write made
                // first checked the job's revision, which this one checks the same way).
                let mut counted = job.clone();
                gone.apply(&mut counted);
                writes[0] = self.job_write(&counted, attempt > 0).await?;
            }
            if self.commit_step(writes, events).await? {
                return Ok((job.rev + 1, gone));
            }
        }
        Err(StoreError::Backend(
            "redrive step: its records kept changing under it".into(),
        ))
    }

    /// Commits a job step's `writes` with the event records it changed; `false` when another
    /// node changed one of its records first (read again and retry).
    async fn commit_step(
        &self,
        mut writes: Vec<Write>,
        events: HashMap<u64, (EventRecord, u64)>,
    ) -> Result<bool, StoreError> {
        for (seq, (ev, rev)) in events {
            writes.push(Write::put(event_key(seq), enc(&ev), Expect::Revision(rev)));
        }
        match self.commit(writes).await {
            Ok(_) => Ok(true),
            Err(RecordsError::Conflict) => Ok(false),
            Err(e) => Err(e.into()),
        }
    }

    /// The event record `seq` as this step has changed it so far (read on first use).
    async fn event_for<'a>(
        &self,
        events: &'a mut HashMap<u64, (EventRecord, u64)>,
        seq: u64,
    ) -> Result<Option<&'a mut (EventRecord, u64)>, StoreError> {
        if let std::collections::hash_map::Entry::Vacant(slot) = events.entry(seq) {
            let Some((mut ev, rev)) = self
                .read_existing::<EventRecord>("events", &event_key(seq))
                .await?
            else {
                return Ok(None);
            };
            ev.stored.seq = seq;
            slot.insert((ev, rev));
        }
        Ok(events.get_mut(&seq))
    }

    /// Adds replayed deliveries (their own idempotency keys, the job's marker) and the job's
    /// new progress in one transaction.
    pub async fn replay_step(
        &self,
        job: Job,
        items: Vec<ReplayItem>,
        now: Millis,
    ) -> Result<ReplayStepped, StoreError> {
        for attempt in 0..MAX_RETRIES {
            // The job first: a step it no longer owns reads nothing more.
            let mut writes = vec![self.job_write(&job, attempt > 0).await?];
            let mut events: HashMap<u64, (EventRecord, u64)> = HashMap::new();
            // Entries this step adds per capped target, beside those the view holds.
            let mut added: HashMap<String, u64> = HashMap::new();
            // Copies that go to the DLQ instead: the job counts their events as failed.
            let mut overflowed = Vec::new();
            // Events the sweep removed since the step read them: nothing to replay.
            let mut gone = Vec::new();
            for item in &items {
                let Some((ev, _)) = self.event_for(&mut events, item.seq).await? else {
                    gone.push(item.seq);
                    continue;
                };
                let stored = &ev.stored.event;
                for t in &item.targets {
                    // The depth cap holds for replayed entries as for accepted ones.
                    if let Some(cap) = t.max_depth {
                        let n = added.entry(t.target_id.clone()).or_default();
                        if self.view.depth(&t.target_id) + *n >= cap {
                            let id = self.next_number("dlq").await?;
                            let names =
                                (stored.id.clone(), stored.source.clone(), stored.ty.clone());
                            let d = DlqEntry {
                                id,
                                ..DlqEntry::replay_overflow(item.seq, names, t, &job.id, cap, now)
                            };
                            writes.push(Write::put(dlq_key(id), enc(&d), Expect::Revision(0)));
                            writes.extend(Self::overflow_hold(t, id));
                            // The event's record lists its dead letters (its fate reads them).
                            ev.dlq.push(id);
                            overflowed.push((item.seq, t.target_id.clone()));
                            continue;
                        }
                        *n += 1;
                    }
                    let id = EntryId {
                        event: item.seq,
                        idx: ev.entries,
                    };
                    ev.entries += 1;
                    let key = delivery_key(&stored.source, &stored.id, &t.target_id, Some(&job.id));
                    let entry = QueueEntry {
                        replay: Some(job.id.clone()),
                        ..QueueEntry::queued(id, t.clone(), key, now, now, stored.hops())
                    };
                    let r = EntryRecord {
                        entry,
                        dlq: None,
                        node: None,
                        key_at: None,
                    };
                    writes.push(Write::put(entry_key(id), enc(&r), Expect::Revision(0)));
                }
            }
            let stepped = ReplayStepped {
                rev: job.rev + 1,
                overflowed,
                gone,
            };
            if !stepped.overflowed.is_empty() || !stepped.gone.is_empty() {
                let mut counted = job.clone();
                stepped.apply(&mut counted);
                writes[0] = self.job_write(&counted, attempt > 0).await?;
            }
            if self.commit_step(writes, events).await? {
                return Ok(stepped);
            }
        }
        Err(StoreError::Backend(
            "replay step: its records kept changing under it".into(),
        ))
    }

    /// Archived (not quarantined) events accepted in [`from`, `to`), sequence after
    /// `after_seq`, at most `limit`, by sequence. Reads the event records the server stored
    /// since `from` (an event's record is written at its acceptance or later), so a replay of
    /// a recent range does not pass over the whole archive. It reads on to the stream's end:
    /// a job step may have rewritten an event of the range since (moving it there), and
    /// sequences are reserved in blocks per node, so they do not follow acceptance times.
    pub async fn events_between(
        &self,
        from: Millis,
        to: Millis,
        after_seq: u64,
        limit: usize,
        max_bytes: usize,
    ) -> Result<Vec<StoredEvent>, StoreError> {
        // The lowest sequences seen that fit in `limit` and `max_bytes` (at least one): a step
        // holds a page, not the whole range. Sequences arrive out of order, so a lower one
        // seen later pushes the highest kept out.
        let mut found: std::collections::BTreeMap<u64, (StoredEvent, usize)> = Default::default();
        let mut bytes = 0usize;
        self.scan_archived(from, to, |ev, size| {
            if ev.seq > after_seq {
                bytes = bytes.saturating_add(size);
                found.insert(ev.seq, (ev, size));
                while found.len() > limit || (found.len() > 1 && bytes > max_bytes) {
                    if let Some((_, (_, s))) = found.pop_last() {
                        bytes = bytes.saturating_sub(s);
                    }
                }
            }
        })
        .await?;
        Ok(found.into_values().map(|(ev, _)| ev).collect())
    }

    /// See [`crate::store::Store::count_events_between`]: one read of the stream from `from`.
    pub async fn count_events_between(&self, from: Millis, to: Millis) -> Result<u64, StoreError> {
        let mut n = 0;
        self.scan_archived(from, to, |_, _| n += 1).await?;
        Ok(n)
    }

    /// Visits each archived (not quarantined) event accepted in [`from`, `to`), with the size
    /// of its record, reading the event records written from a minute before `from` to the
    /// stream's end.
    async fn scan_archived(
        &self,
        from: Millis,
        to: Millis,
        mut visit: impl FnMut(StoredEvent, usize),
    ) -> Result<(), StoreError> {
        let mut bad = None;
        // Clocks of nodes and server differ a little; a minute of slack costs a few records.
        self.records
            .scan_with(
                "ev",
                ScanFrom::Time(from.saturating_sub(60_000)),
                false,
                |r| {
                    let Some(bytes) = r.value else { return true };
                    let Some(seq) = r
                        .key
                        .strip_prefix("ev.")
                        .and_then(|s| s.parse::<u64>().ok())
                    else {
                        return true;
                    };
                    match dec::<EventRecord>("events", &bytes) {
                        Ok(mut ev) => {
                            ev.stored.seq = seq;
                            let at = ev.stored.accepted_at;
                            if !ev.stored.quarantined && at >= from && at < to {
                                visit(ev.stored, bytes.len());
                            }
                            true
                        }
                        Err(e) => {
                            bad = Some(e);
                            false
                        }
                    }
                },
            )
            .await?;
        match bad {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// One batch of the sweep's pass over events accepted before `cutoff` (records stored
    /// after `wall_cutoff` hold only younger ones): removes those nothing refers to, counting
    /// into `stats`. Returns whether the batch was full (the pass goes on from after it) and
    /// how many it removed.
    async fn sweep_events(
        &self,
        cutoff: Millis,
        wall_cutoff: Millis,
        stats: &mut SweepStats,
    ) -> Result<(bool, u64), StoreError> {
        let mut old: Vec<(u64, u64, EventRecord)> = Vec::new();
        let mut more = false;
        let mut bad = None;
        // Where the last pass stopped: the events it kept (a DLQ entry or a live entry still
        // refers to them) are not read again until the pass has reached the young records.
        // (Every call used to start at the first record: once its first batch was all kept
        // events, it removed nothing, said there was more, and was called again at once,
        // for good, while nothing behind them was ever removed.)
        let start = self.sweep_from.load(std::sync::atomic::Ordering::Relaxed);
        let mut last = None;
        self.records
            .scan_with("ev", ScanFrom::Revision(start), false, |r| {
                if r.published_ms > wall_cutoff.max(cutoff) {
                    return false;
                }
                last = Some(r.revision);
                let (Some(bytes), Some(seq)) = (
                    r.value,
                    r.key
                        .strip_prefix("ev.")
                        .and_then(|s| s.parse::<u64>().ok()),
                ) else {
                    return true;
                };
                match dec::<EventRecord>("events", &bytes) {
                    Ok(ev) if ev.stored.accepted_at <= cutoff => {
                        old.push((seq, r.revision, ev));
                        if old.len() >= SWEEP_BATCH {
                            more = true;
                            return false;
                        }
                        true
                    }
                    Ok(_) => true,
                    Err(e) => {
                        bad = Some(e);
                        false
                    }
                }
            })
            .await?;
        if let Some(e) = bad {
            return Err(e);
        }
        let mut removed = 0;
        for (seq, rev, ev) in old {
            match self.remove_event(seq, rev, &ev).await? {
                true => removed += 1,
                false => stats.pending += 1,
            }
        }
        stats.events_removed += removed;
        // A full batch goes on from after it; otherwise the pass reached the young records
        // (or the end), and the next starts over. Only a batch that removed something asks
        // to be called again at once; batches of kept events only are gone over up to
        // `KEPT_BATCHES_PER_CALL` a call.
        self.sweep_from
            .store(next_pass(last, more), std::sync::atomic::Ordering::Relaxed);
        Ok((more, removed))
    }

    /// Removes events older than `retention_ms` that no live entry or DLQ entry refers to
    /// (with their finished entries and their dedup key), COMPLETED records and key-value
    /// entries past their expiry. Bounded work per call (`more` when there is more to do).
    /// Dedup keys go with their events, as in the embedded store: a key outlives its window
    /// until its event is swept, and a key past its window no longer counts at accept.
    pub async fn sweep(
        &self,
        now: Millis,
        _dedup_window_ms: i64,
        retention_ms: i64,
    ) -> Result<SweepStats, StoreError> {
        let mut stats = SweepStats::default();
        let cutoff = now.saturating_sub(retention_ms);
        // Oldest first; records stored after the cutoff (plus slack for clocks) hold only
        // younger events.
        let wall_cutoff = chrono::Utc::now().timestamp_millis() - retention_ms + 60_000;
        let mut more = false;
        // A batch made only of kept events removes nothing and does not ask to be called
        // again at once, so with one batch a call the pass went over kept events at 256 a
        // sweep interval (a minute by default): behind 100,000 dead-lettered events, the
        // archive waited hours to be trimmed. Such batches are now passed over up to
        // `KEPT_BATCHES_PER_CALL` in one call.
        for _ in 0..KEPT_BATCHES_PER_CALL {
            let (full, removed) = self.sweep_events(cutoff, wall_cutoff, &mut stats).await?;
            more = full;
            if !full || removed > 0 {
                break;
            }
        }
        let (completed, completed_full) = self.expire_completed(now).await?;
        let (kv, kv_full) = self.expire_kv(now).await?;
        // As on the embedded store: a full batch of expired COMPLETED or key-value records
        // asks to be called again at once (only events counted, so each kind was removed at
        // 256 a sweep interval however many had expired).
        stats.more = (more && stats.events_removed > 0) || completed_full || kv_full;
        stats.completed_expired = completed;
        stats.kv_expired = kv;
        stats.dedup_expired = stats.events_removed;
        Ok(stats)
    }

    /// Removes event `seq` with its entries and dedup key, unless a live entry or a DLQ entry
    /// still refers to it. `true` when removed.
    async fn remove_event(&self, seq: u64, rev: u64, ev: &EventRecord) -> Result<bool, StoreError> {
        let mut writes = vec![Write::delete(event_key(seq), Expect::Revision(rev))];
        let mut dlq_ids = ev.dlq.clone();
        let mut keyed = Vec::new();
        for idx in 0..ev.entries {
            let id = EntryId { event: seq, idx };
            if let Some((r, erev)) = self.read::<EntryRecord>("entries", &entry_key(id)).await? {
                if r.entry.state == EntryState::Queued {
                    return Ok(false);
                }
                dlq_ids.extend(r.dlq);
                writes.push(Write::delete(entry_key(id), Expect::Revision(erev)));
                if let Some(k) = r.entry.ordering_key {
                    keyed.push((lock_key(&r.entry.target_id, &k), id));
                }
            }
        }
        for id in dlq_ids {
            if self.read::<DlqEntry>("dlq", &dlq_key(id)).await?.is_some() {
                return Ok(false);
            }
        }
        // A key lock that still names one of these entries goes with it (a missing lock is
        // a free key): one lock record per ordering key ever used stayed in the stream.
        for (lock, id) in keyed {
            if let Some((l, lrev)) = self.read::<KeyLock>("key locks", &lock).await?
                && l.entry == id
            {
                writes.push(Write::delete(lock, Expect::Revision(lrev)));
            }
        }
        let dd = dedup_record_key(&ev.stored.event.source, &ev.stored.event.id);
        if let Some((d, drev)) = self.read::<super::DedupRecord>("dedup", &dd).await?
            && d.seq == seq
        {
            writes.push(Write::delete(dd, Expect::Revision(drev)));
        }
        match self.commit(writes).await {
            Ok(_) => Ok(true),
            // Redriven, replayed or re-accepted meanwhile: kept for the next sweep.
            Err(RecordsError::Conflict) => Ok(false),
            Err(e) => Err(e.into()),
        }
    }

    /// Removes up to `SWEEP_BATCH` expired COMPLETED records; how many, and whether the
    /// batch was full (there may be more). Each call goes on from where the last stopped
    /// (`completed_from`) and decodes only the records' expiry: every call used to read
    /// every record, value and all, into memory, on every node.
    async fn expire_completed(&self, now: Millis) -> Result<(u64, bool), StoreError> {
        use std::sync::atomic::Ordering::Relaxed;
        let start = self.completed_from.load(Relaxed);
        let mut expired = Vec::new();
        let mut last = None;
        let mut bad = None;
        self.records
            .scan_with("cd", ScanFrom::Revision(start), false, |r| {
                last = Some(r.revision);
                let Some(bytes) = r.value else { return true };
                match serde_json::from_slice::<ops::CompletedHead>(&bytes) {
                    Ok(c) if c.expires_at <= now => {
                        expired.push(Write::delete(r.key, Expect::Revision(r.revision)));
                        expired.len() < SWEEP_BATCH
                    }
                    Ok(_) => true,
                    Err(e) => {
                        bad = Some(corrupt("completed", &e));
                        false
                    }
                }
            })
            .await?;
        if let Some(e) = bad {
            return Err(e);
        }
        let full = expired.len() >= SWEEP_BATCH;
        let n = expired.len() as u64;
        if n > 0 {
            match self.commit(expired).await {
                Ok(_) => {}
                // Rewritten meanwhile (a delivery stored a new result): the same records
                // are read again next time.
                Err(RecordsError::Conflict) => return Ok((0, false)),
                Err(e) => return Err(e.into()),
            }
        }
        self.completed_from.store(next_pass(last, full), Relaxed);
        Ok((n, full))
    }

    /// Removes every COMPLETED record of `handler` (see
    /// [`crate::store::Store::completed_clear`]), in batches below the atomic batch limit.
    /// Records written by older builds do not name their handler: those only expire.
    pub async fn completed_clear(&self, handler: &str) -> Result<u64, StoreError> {
        let mut removed = 0;
        // A batch that met a concurrent write (a delivery storing a new result) is read
        // again; a name being freed has no deliveries left, so this settles quickly.
        for _ in 0..8 {
            let mut picked = Vec::new();
            let mut bad = None;
            self.records
                .scan_with("cd", ScanFrom::Revision(0), false, |r| {
                    let Some(bytes) = r.value else { return true };
                    match serde_json::from_slice::<ops::CompletedHead>(&bytes) {
                        Ok(c) if c.handler.as_deref() == Some(handler) => {
                            picked.push(Write::delete(r.key, Expect::Revision(r.revision)));
                            true
                        }
                        Ok(_) => true,
                        Err(e) => {
                            bad = Some(corrupt("completed", &e));
                            false
                        }
                    }
                })
                .await?;
            if let Some(e) = bad {
                return Err(e);
            }
            let mut conflicted = false;
            while !picked.is_empty() {
                let batch: Vec<Write> = picked.drain(..picked.len().min(MAX_BATCH - 1)).collect();
                let n = batch.len() as u64;
                match self.commit(batch).await {
                    Ok(_) => removed += n,
                    Err(RecordsError::Conflict) => conflicted = true,
                    Err(e) => return Err(e.into()),
                }
            }
            if !conflicted {
                return Ok(removed);
            }
        }
        Err(StoreError::Backend(format!(
            "the COMPLETED records of {handler:?} kept changing while they were removed; try again"
        )))
    }

    /// Removes expired key-value entries, each usage shard's with its record in one batch;
    /// how many, and whether the batch was full. Goes on from where the last call stopped
    /// (`kv_from`).
    async fn expire_kv(&self, now: Millis) -> Result<(u64, bool), StoreError> {
        use std::sync::atomic::Ordering::Relaxed;
        let start = self.kv_from.load(Relaxed);
        let picked = self
            .remove_kv(
                |r| r.expires_at.is_some_and(|e| e <= now),
                SWEEP_BATCH,
                start,
                MAX_BATCH - 1,
            )
            .await?;
        // A batch that met a concurrent write is read again next time, from the same place.
        if !picked.conflicted {
            self.kv_from
                .store(next_pass(picked.last, picked.full), Relaxed);
        }
        Ok((picked.removed, picked.full))
    }

    /// Removes every key-value entry of `namespace` (see [`crate::store::Store::kv_clear`]).
    /// A batch that met a concurrent write to its usage shard is tried again.
    pub async fn kv_clear(&self, namespace: &str) -> Result<u64, StoreError> {
        self.kv_clear_in(namespace, MAX_BATCH - 1).await
    }

    /// [`Self::kv_clear`] in transactions of at most `chunk` entries (tests use small ones).
    pub(super) async fn kv_clear_in(
        &self,
        namespace: &str,
        chunk: usize,
    ) -> Result<u64, StoreError> {
        let mut removed = 0;
        for _ in 0..8 {
            let picked = self
                .remove_kv(|r| r.namespace == namespace, usize::MAX, 0, chunk)
                .await?;
            removed += picked.removed;
            if !picked.conflicted {
                return Ok(removed);
            }
        }
        Err(StoreError::Backend(format!(
            "the key-value entries of {namespace:?} kept changing while they were removed; try again"
        )))
    }

    /// Removes the key-value entries `pick` selects (at most `limit`), from revision `from`
    /// on, each usage shard's with its record, at most `chunk` entries a transaction (below
    /// the atomic batch limit). Only the chosen entries are decoded whole and kept.
    async fn remove_kv(
        &self,
        pick: impl Fn(&ops::KvHead) -> bool,
        limit: usize,
        from: u64,
        chunk: usize,
    ) -> Result<KvRemoved, StoreError> {
        type Picked = Vec<(String, u64, ops::KvRecord)>;
        let mut by_shard: HashMap<(String, u8), Picked> = HashMap::new();
        let mut n = 0;
        let mut last = None;
        let mut bad = None;
        self.records
            .scan_with("kv", ScanFrom::Revision(from), false, |r| {
                last = Some(r.revision);
                let Some(bytes) = r.value else { return true };
                let head = match serde_json::from_slice::<ops::KvHead>(&bytes) {
                    Ok(h) => h,
                    Err(e) => {
                        bad = Some(corrupt("kv", &e));
                        return false;
                    }
                };
                if !pick(&head) {
                    return true;
                }
                match dec::<ops::KvRecord>("kv", &bytes) {
                    Ok(record) => {
                        let shard = ops::usage_shard(&head.namespace, &head.key);
                        by_shard
                            .entry((head.namespace, shard))
                            .or_default()
                            .push((r.key, r.revision, record));
                        n += 1;
                        n < limit
                    }
                    Err(e) => {
                        bad = Some(e);
                        false
                    }
                }
            })
            .await?;
        if let Some(e) = bad {
            return Err(e);
        }
        let mut out = KvRemoved {
            full: n >= limit,
            last,
            ..KvRemoved::default()
        };
        for ((ns, shard), items) in by_shard {
            let ukey = ops::usage_key(&ns, shard);
            let Some((mut usage, urev)) = self.read::<ops::UsageRecord>("kv usage", &ukey).await?
            else {
                continue;
            };
            // A shard's entries go in transactions of at most one atomic batch (its usage
            // record's write included): a namespace with more than that in one shard failed
            // to clear at all.
            let mut urev = urev;
            for chunk in items.chunks(chunk.clamp(1, MAX_BATCH - 1)) {
                let mut writes = Vec::with_capacity(chunk.len() + 1);
                let mut left = usage.clone();
                for (key, rev, r) in chunk {
                    left.bytes = left.bytes.saturating_sub(r.usage_bytes()?);
                    left.keys = left.keys.saturating_sub(1);
                    writes.push(Write::delete(key.clone(), Expect::Revision(*rev)));
                }
                writes.push(ops::usage_write(&ukey, &left, Expect::Revision(urev)));
                match self.commit(writes).await {
                    Ok(revs) => {
                        out.removed += chunk.len() as u64;
                        usage = left;
                        urev = revs.last().copied().unwrap_or(urev);
                    }
                    Err(RecordsError::Conflict) => {
                        out.conflicted = true;
                        break;
                    }
                    Err(e) => return Err(e.into()),
                }
            }
        }
        Ok(out)
    }

    /// Counts the records of each bounded kind (a pass over their headers: the caller
    /// caches it).
    pub async fn count_records(&self) -> Result<RecordCounts, StoreError> {
        let mut counts = RecordCounts::default();
        for (kind, slot) in [
            ("ev", &mut counts.events),
            ("dd", &mut counts.dedup_keys),
            ("cd", &mut counts.completed),
            ("kv", &mut counts.kv_keys),
        ] {
            let mut n = 0;
            self.records
                .scan_with(kind, ScanFrom::Start, true, |r| {
                    n += u64::from(r.value.is_some());
                    true
                })
                .await?;
            *slot = n;
        }
        Ok(counts)
    }
}

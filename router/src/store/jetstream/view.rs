//! Each node's view of the live queue entries, followed from the records stream.
//!
//! An ordered consumer on `<prefix>.en.>` delivers every entry record as it is written (and,
//! from the start, the last record of every entry). The view keeps the queued ones per target,
//! ordered by when they may next be leased: their due time, or the end of their lease while
//! one is held. It only proposes candidates: the lease's compare-and-set on the record decides,
//! so a view that lags behind another node's writes costs a conflict, never a double delivery.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use async_nats::jetstream::consumer::DeliverPolicy;
use async_nats::jetstream::consumer::pull::OrderedConfig;
use async_nats::jetstream::stream;
use futures::StreamExt;
use tokio::sync::{Notify, watch};

use super::{EntryRecord, HeldRecord};
use crate::store::{
    DlqEntry, DlqFilter, DlqSummary, EntryId, EntryState, Millis, QueueEntry, QueueStats,
    SummaryRow,
};

/// A live (queued) entry as the view last saw it.
#[derive(Debug, Clone)]
pub(super) struct Live {
    /// The record's revision (what a lease must expect).
    pub revision: u64,
    /// The node holding its lease, if any.
    pub node: Option<String>,
    /// The entry.
    pub entry: QueueEntry,
    /// When it may be leased: its due time, or just after its lease's end.
    pub available_at: Millis,
    /// The record's `key_at` (its place among its key's entries, when not `accepted_at`).
    pub key_at: Option<Millis>,
}

impl Live {
    /// Its place among its ordering key's entries.
    fn key_order(&self) -> (Millis, EntryId) {
        (self.key_at.unwrap_or(self.entry.accepted_at), self.entry.id)
    }
}

/// A queue entry record as the view applies it: the entry, the node leasing it, `key_at`.
pub(super) type Applied = (QueueEntry, Option<String>, Option<Millis>);

#[derive(Default)]
struct State {
    live: HashMap<EntryId, Live>,
    /// Per target: (available at, entry), leased entries included.
    ready: HashMap<String, BTreeSet<(Millis, EntryId)>>,
    /// `ready` without the keyed entries that wait behind their key's first one, or whose
    /// key is held (parked): what leases look through. Passing over them there cost every
    /// lease a walk of a blocked key's whole backlog, under the view's lock.
    leasable: HashMap<String, BTreeSet<(Millis, EntryId)>>,
    /// Live entries per (target, ordering key), in acceptance order: only the first may be
    /// leased.
    keys: HashMap<(String, String), BTreeSet<(Millis, EntryId)>>,
    /// The entry of each key that is in `leasable` (its first, unless the key is held).
    promoted: HashMap<(String, String), EntryId>,
    /// The entry of each key that holds a lease (in flight, or its node gone): the only one
    /// of its key that may be leased (taken over) until it is done. A redriven entry sorts
    /// first while a later one may be in flight; proposing it then only met the key's lock,
    /// again and again.
    leased: HashMap<(String, String), EntryId>,
    /// Keys held after a dead letter, per target; and which record holds each.
    held: HashMap<String, BTreeSet<String>>,
    held_records: HashMap<String, (String, String)>,
    notifiers: HashMap<String, Arc<Notify>>,
    /// Leases that expired before this were reported by `wake_expired` already.
    reaped_until: Millis,
    /// Entries this node is leasing right now, at the revision it saw: not proposed again
    /// until the view moves past that revision (or the lease gives up).
    claimed: HashMap<EntryId, u64>,
    /// Targets whose live policy on this node has no `ordering` (`Store::set_ordered`): their
    /// entries are indexed as if they had no key (in `leasable` at once, absent from `keys`),
    /// whatever key they were accepted with.
    unordered: HashSet<String>,
}

impl State {
    /// Drops `id` from the live set (and this node's claim on it, which the record's newer
    /// revision ends); returns its target if it had an ordering key (whose next entry may be
    /// leasable now).
    fn remove_live(&mut self, id: EntryId) -> Option<String> {
        self.claimed.remove(&id);
        let old = self.live.remove(&id)?;
        let order = old.key_order();
        let key = self.key_of(&old.entry);
        let target = old.entry.target_id;
        if let Some(set) = self.ready.get_mut(&target) {
            set.remove(&(old.available_at, id));
        }
        if let Some(set) = self.leasable.get_mut(&target) {
            set.remove(&(old.available_at, id));
        }
        let slot = (target, key?);
        if let Some(set) = self.keys.get_mut(&slot) {
            set.remove(&order);
            if set.is_empty() {
                self.keys.remove(&slot);
            }
        }
        if self.promoted.get(&slot) == Some(&id) {
            self.promoted.remove(&slot);
        }
        if self.leased.get(&slot) == Some(&id) {
            self.leased.remove(&slot);
        }
        self.promote(&slot);
        Some(slot.0)
    }

    /// The ordering key `e` goes by: the one it was accepted with, unless its target's live
    /// policy has no ordering.
    fn key_of(&self, e: &QueueEntry) -> Option<String> {
        e.ordering_key
            .clone()
            .filter(|_| !self.unordered.contains(&e.target_id))
    }

    /// Puts the entry of key `slot` that may be leased (its first, unless the key is held)
    /// in `leasable`, and takes out the one there before if that changed.
    fn promote(&mut self, slot: &(String, String)) {
        if self.unordered.contains(&slot.0) {
            // Its entries are in `leasable` already, key or not.
            return;
        }
        let held = self.held.get(&slot.0).is_some_and(|h| h.contains(&slot.1));
        let desired = if held {
            None
        } else if let Some(&l) = self.leased.get(slot) {
            Some(l)
        } else {
            self.keys
                .get(slot)
                .and_then(|s| s.first())
                .map(|(_, id)| *id)
        };
        let current = self.promoted.get(slot).copied();
        if current == desired {
            return;
        }
        if let Some(c) = current {
            if let (Some(l), Some(set)) = (self.live.get(&c), self.leasable.get_mut(&slot.0)) {
                set.remove(&(l.available_at, c));
            }
            self.promoted.remove(slot);
        }
        if let Some(d) = desired
            && let Some(l) = self.live.get(&d)
        {
            self.leasable
                .entry(slot.0.clone())
                .or_default()
                .insert((l.available_at, d));
            self.promoted.insert(slot.clone(), d);
        }
    }

    fn apply(&mut self, id: EntryId, revision: u64, record: Option<Applied>) {
        let (entry, node, key_at) = match record {
            Some((e, n, k)) => (Some(e), n, k),
            None => (None, None, None),
        };
        if self
            .live
            .get(&id)
            .is_some_and(|old| old.revision >= revision)
        {
            return;
        }
        let keyed_target = self.remove_live(id);
        let Some(entry) = entry.filter(|e| e.state == EntryState::Queued) else {
            // The key's next entry may be leasable now; the worker, whose next due time
            // passes over entries waiting behind their key, would otherwise sleep until its
            // idle poll (a second per entry of a key that had been retrying).
            if let Some(target) = keyed_target {
                self.notify(&target);
            }
            return;
        };
        let available_at = entry.lease.map_or(entry.due_at, |l| {
            entry.due_at.max(l.until.saturating_add(1))
        });
        let target = entry.target_id.clone();
        self.ready
            .entry(target.clone())
            .or_default()
            .insert((available_at, id));
        let live = Live {
            revision,
            node,
            entry,
            available_at,
            key_at,
        };
        self.live.insert(id, live);
        self.index_ordering(id);
        self.notify(&target);
    }

    /// Puts live entry `id` where its ordering key says: unkeyed (or of an unordered
    /// target) in `leasable`, keyed among its key's entries, where `promote` decides.
    fn index_ordering(&mut self, id: EntryId) {
        let Some(live) = self.live.get(&id) else {
            return;
        };
        let (target, available_at, order) = (
            live.entry.target_id.clone(),
            live.available_at,
            live.key_order(),
        );
        let leased = live.entry.lease.is_some();
        match self.key_of(&live.entry) {
            Some(k) => {
                let slot = (target, k);
                self.keys.entry(slot.clone()).or_default().insert(order);
                if leased {
                    self.leased.insert(slot.clone(), id);
                }
                self.promote(&slot);
            }
            None => {
                self.leasable
                    .entry(target)
                    .or_default()
                    .insert((available_at, id));
            }
        }
    }

    /// `Store::set_ordered`: a change indexes the target's live entries again, as their keys
    /// now count or not.
    fn set_ordered(&mut self, target: &str, ordered: bool) {
        let changed = if ordered {
            self.unordered.remove(target)
        } else {
            self.unordered.insert(target.to_string())
        };
        if !changed {
            return;
        }
        self.leasable.remove(target);
        self.keys.retain(|(t, _), _| t != target);
        self.promoted.retain(|(t, _), _| t != target);
        self.leased.retain(|(t, _), _| t != target);
        let ids: Vec<EntryId> = self
            .ready
            .get(target)
            .map(|set| set.iter().map(|(_, id)| *id).collect())
            .unwrap_or_default();
        for id in ids {
            self.index_ordering(id);
        }
        // Entries let go by the change are due now, maybe before the worker's next wake.
        self.notify(target);
    }

    fn notify(&self, target: &str) {
        if let Some(n) = self.notifiers.get(target) {
            n.notify_one();
        }
    }

    /// Whether ordering lets `live` be leased (unkeyed, or the first live entry of a key that
    /// is not held) and this node is not leasing it already.
    fn ordering_allows(&self, live: &Live) -> bool {
        let e = &live.entry;
        if self.claimed.get(&e.id) == Some(&live.revision) {
            return false;
        }
        let Some(k) = &e.ordering_key else {
            return true;
        };
        if self.unordered.contains(&e.target_id) {
            return true;
        }
        if self.held.get(&e.target_id).is_some_and(|h| h.contains(k)) {
            return false;
        }
        let slot = (e.target_id.clone(), k.clone());
        if let Some(l) = self.leased.get(&slot) {
            return *l == e.id;
        }
        self.keys
            .get(&slot)
            .and_then(|s| s.first())
            .is_some_and(|(_, first)| *first == e.id)
    }

    fn apply_held(&mut self, subject: &str, held: Option<(String, String)>) {
        if let Some((target, key)) = self.held_records.remove(subject)
            && let Some(set) = self.held.get_mut(&target)
        {
            set.remove(&key);
            // The key's next entry may go now.
            let slot = (target, key);
            self.promote(&slot);
            self.notify(&slot.0);
        }
        if let Some((target, key)) = held {
            self.held
                .entry(target.clone())
                .or_default()
                .insert(key.clone());
            let slot = (target, key);
            self.promote(&slot);
            self.held_records.insert(subject.to_string(), slot);
        }
    }
}

/// The DLQ's index: entries by id without their attempts and errors (what listings filter on
/// and summaries count; a listing reads the full entries by id), and how many per target.
#[derive(Default)]
struct DlqIndex {
    entries: BTreeMap<u64, DlqEntry>,
    per_target: HashMap<String, u64>,
    /// Entries of no target (events quarantined at ingest).
    without_target: u64,
}

impl DlqIndex {
    fn remove(&mut self, id: u64) {
        match self.entries.remove(&id).map(|d| d.target_id) {
            Some(Some(t)) => {
                if let Some(n) = self.per_target.get_mut(&t) {
                    *n = n.saturating_sub(1);
                }
            }
            Some(None) => self.without_target = self.without_target.saturating_sub(1),
            None => {}
        }
    }

    fn insert(&mut self, id: u64, mut d: DlqEntry) {
        self.remove(id);
        d.attempts = Vec::new();
        d.errors = Vec::new();
        match &d.target_id {
            Some(t) => *self.per_target.entry(t.clone()).or_default() += 1,
            None => self.without_target += 1,
        }
        self.entries.insert(id, d);
    }
}

/// The view, shared by the store and its follower task.
pub(super) struct View {
    state: Mutex<State>,
    /// Its own lock: a summary over a large DLQ does not hold up leases.
    dlq: Mutex<DlqIndex>,
    /// The highest revision applied (of the records the view follows).
    applied: watch::Sender<u64>,
    /// Whether the follower has read everything there was when it started.
    loaded: watch::Sender<bool>,
    /// Asks the follower to drop its consumer and follow again from the last revision applied
    /// (`resubscribe`).
    resubscribe: Notify,
}

impl View {
    pub fn new() -> Arc<Self> {
        Arc::new(Self {
            state: Mutex::new(State::default()),
            dlq: Mutex::new(DlqIndex::default()),
            applied: watch::channel(0).0,
            loaded: watch::channel(false).0,
            resubscribe: Notify::new(),
        })
    }

    fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn dlq(&self) -> MutexGuard<'_, DlqIndex> {
        self.dlq.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// How many DLQ entries have no target.
    pub(super) fn dlq_without_target(&self) -> u64 {
        self.dlq().without_target
    }

    /// Up to `max` entries of `target` that may be leased at `now`, soonest first.
    ///
    /// They are claimed for this node until the view moves past the revision seen or
    /// `unclaim` is called, so concurrent leases of this node never race for one entry.
    pub fn candidates(&self, target: &str, now: Millis, max: usize) -> Vec<Live> {
        let mut st = self.state();
        let Some(set) = st.leasable.get(target) else {
            return Vec::new();
        };
        let out: Vec<Live> = set
            .iter()
            .take_while(|(at, _)| *at <= now)
            .filter_map(|(_, id)| st.live.get(id))
            .filter(|l| st.ordering_allows(l))
            .take(max)
            .cloned()
            .collect();
        for l in &out {
            st.claimed.insert(l.entry.id, l.revision);
        }
        out
    }

    /// Gives up this node's claim on `id` (its lease lost a race or failed).
    pub fn unclaim(&self, id: EntryId) {
        let mut st = self.state();
        if st.claimed.remove(&id).is_some()
            && let Some(t) = st.live.get(&id).map(|l| l.entry.target_id.clone())
        {
            st.notify(&t);
        }
    }

    /// Every live entry of `target`, leased or not, ignoring ordering (tests stand in for a
    /// lagging view with it).
    #[cfg(test)]
    pub fn candidates_unordered(&self, target: &str) -> Vec<Live> {
        let st = self.state();
        st.live
            .values()
            .filter(|l| l.entry.target_id == target)
            .cloned()
            .collect()
    }

    /// How many entries of `target` may be leased at `now`, up to `max`.
    pub fn due_count(&self, target: &str, now: Millis, max: usize) -> usize {
        let st = self.state();
        st.leasable.get(target).map_or(0, |set| {
            set.iter()
                .take_while(|(at, _)| *at <= now)
                .filter_map(|(_, id)| st.live.get(id))
                .filter(|l| st.ordering_allows(l))
                .take(max)
                .count()
        })
    }

    /// Live entries of `target` (waiting or leased): what its depth cap counts.
    pub fn depth(&self, target: &str) -> u64 {
        self.state().ready.get(target).map_or(0, |s| s.len() as u64)
    }

    /// See `Store::set_ordered`.
    pub fn set_ordered(&self, target: &str, ordered: bool) {
        self.state().set_ordered(target, ordered);
    }

    /// Whether `target`'s entries go in the order of their keys (see `Store::set_ordered`).
    pub fn ordered(&self, target: &str) -> bool {
        !self.state().unordered.contains(target)
    }

    /// Ordering keys of `target` held after a dead letter.
    pub fn held_keys(&self, target: &str) -> Vec<String> {
        self.state()
            .held
            .get(target)
            .map(|h| h.iter().cloned().collect())
            .unwrap_or_default()
    }

    /// The entry of `target`'s key `key` that goes first: the one leased, else the first.
    pub fn key_head(&self, target: &str, key: &str) -> Option<super::super::KeyHead> {
        let st = self.state();
        let slot = (target.to_string(), key.to_string());
        match st.leased.get(&slot) {
            Some(&entry) => Some(super::super::KeyHead {
                entry,
                in_flight: true,
            }),
            None => st
                .keys
                .get(&slot)?
                .first()
                .map(|&(_, entry)| super::super::KeyHead {
                    entry,
                    in_flight: false,
                }),
        }
    }

    /// Per-target numbers: waiting, leased at `now`, oldest acceptance, DLQ entries.
    pub fn stats(&self, now: Millis) -> std::collections::BTreeMap<String, QueueStats> {
        let st = self.state();
        // Every target that ever had an entry here, emptied ones at zero (as the embedded
        // store's index keeps them).
        let mut out: std::collections::BTreeMap<String, QueueStats> = st
            .ready
            .keys()
            .map(|t| (t.clone(), QueueStats::default()))
            .collect();
        for l in st.live.values() {
            let s = out.entry(l.entry.target_id.clone()).or_default();
            if l.entry.lease.is_some_and(|lease| lease.until >= now) {
                s.in_flight += 1;
            } else {
                s.queued += 1;
            }
            s.oldest_accepted_at = Some(
                s.oldest_accepted_at
                    .map_or(l.entry.accepted_at, |o| o.min(l.entry.accepted_at)),
            );
        }
        // Every entry is in `ready`; those ordering holds back are not in `leasable`.
        for (t, s) in &mut out {
            let all = st.ready.get(t).map_or(0, BTreeSet::len);
            let leasable = st.leasable.get(t).map_or(0, BTreeSet::len);
            s.queued_behind_keys = all.saturating_sub(leasable) as u64;
        }
        drop(st);
        for (t, n) in self.dlq().per_target.iter().filter(|(_, n)| **n > 0) {
            out.entry(t.clone()).or_default().dlq += n;
        }
        out
    }

    /// Waiting (not leased at `now`) entries of `target`.
    pub fn waiting(&self, target: &str, now: Millis) -> Vec<Live> {
        let st = self.state();
        st.ready.get(target).map_or_else(Vec::new, |set| {
            set.iter()
                .filter_map(|(_, id)| st.live.get(id))
                .filter(|l| l.entry.lease.is_none_or(|lease| lease.until < now))
                .cloned()
                .collect()
        })
    }

    /// The waiting (not leased) entries of `target` with ordering key `key`.
    pub fn waiting_of_key(&self, target: &str, key: &str, now: Millis) -> Vec<Live> {
        let st = self.state();
        st.keys
            .get(&(target.to_string(), key.to_string()))
            .map_or_else(Vec::new, |set| {
                set.iter()
                    .filter_map(|(_, id)| st.live.get(id))
                    .filter(|l| l.entry.lease.is_none_or(|lease| lease.until < now))
                    .cloned()
                    .collect()
            })
    }

    /// When the next entry of `target` may be leased: the soonest that ordering lets go.
    /// Entries waiting behind their key's first one are passed over: their due times are
    /// past, and returning one had the worker poll every millisecond while a key was blocked.
    pub fn next_due(&self, target: &str) -> Option<Millis> {
        let st = self.state();
        st.leasable.get(target).and_then(|set| {
            set.iter()
                .find(|(_, id)| st.live.get(id).is_some_and(|l| st.ordering_allows(l)))
                .map(|(at, _)| *at)
        })
    }

    /// Woken when an entry of `target` is queued or re-queued.
    pub fn notifier(&self, target: &str) -> Arc<Notify> {
        self.state()
            .notifiers
            .entry(target.to_string())
            .or_insert_with(|| Arc::new(Notify::new()))
            .clone()
    }

    /// Live entries leased by `node` (whatever their expiry).
    pub fn leased_by(&self, node: &str) -> Vec<Live> {
        self.state()
            .live
            .values()
            .filter(|l| l.entry.lease.is_some() && l.node.as_deref() == Some(node))
            .cloned()
            .collect()
    }

    /// Wakes the workers of targets with a lease that expired since the last call, before
    /// `now` (those entries are leasable again); returns how many.
    pub fn wake_expired(&self, now: Millis) -> usize {
        let mut st = self.state();
        let since = std::mem::replace(&mut st.reaped_until, now);
        let mut n = 0;
        let mut targets = std::collections::BTreeSet::new();
        for l in st.live.values() {
            if l.entry
                .lease
                .is_some_and(|lease| lease.until < now && lease.until >= since)
            {
                n += 1;
                targets.insert(l.entry.target_id.as_str());
            }
        }
        for t in targets {
            st.notify(t);
        }
        n
    }

    /// Targets with live entries.
    pub fn targets(&self) -> Vec<String> {
        self.state()
            .ready
            .iter()
            .filter(|(_, s)| !s.is_empty())
            .map(|(t, _)| t.clone())
            .collect()
    }

    /// Ids of the DLQ entries matching `filter` with ids above `after`, ascending, at most
    /// `limit`.
    pub fn dlq_ids(&self, filter: &DlqFilter, after: Option<u64>, limit: usize) -> Vec<u64> {
        let start = after.map_or(0, |a| a.saturating_add(1));
        self.dlq()
            .entries
            .range(start..)
            .filter(|(_, d)| filter.matches(d))
            .take(limit)
            .map(|(id, _)| *id)
            .collect()
    }

    /// DLQ entries matching `filter` grouped by target × reason (see `Store::dlq_summary`).
    pub fn dlq_summary(&self, filter: &DlqFilter, bucket_ms: i64) -> Vec<SummaryRow> {
        let mut summary = DlqSummary::new(bucket_ms);
        for d in self.dlq().entries.values().filter(|d| filter.matches(d)) {
            summary.add(&crate::store::DlqHead::of(d));
        }
        summary.rows()
    }

    /// The highest revision the view has applied: it holds every record of the stream up to
    /// it (the records follow in stream order), and none written after.
    pub fn applied(&self) -> u64 {
        *self.applied.borrow()
    }

    /// The highest DLQ entry id in the view (0 when none).
    pub fn dlq_max_id(&self) -> u64 {
        self.dlq().entries.keys().next_back().copied().unwrap_or(0)
    }

    /// Asks the follower to follow again from the last revision applied, with a new consumer:
    /// what a node does when its view has not caught up with its own writes in time. The
    /// client recreates a consumer that went silent only after two missed heartbeats and then
    /// with a backoff of up to 10 s between tries, and a loaded machine was seen to need more
    /// than a minute after a failover that way (`a_replicated_store_…` test).
    pub fn resubscribe(&self) {
        self.resubscribe.notify_one();
    }

    /// Waits until the view has applied revision `revision` (a write of this node), or
    /// `timeout` passes.
    pub async fn wait_applied(&self, revision: u64, timeout: Duration) -> bool {
        let mut rx = self.applied.subscribe();
        tokio::time::timeout(timeout, rx.wait_for(|&a| a >= revision))
            .await
            .is_ok_and(|r| r.is_ok())
    }

    /// Waits until the follower has read every entry that existed when it started, for as long
    /// as it keeps applying records: false only when a whole `stall` passes without one. A
    /// fixed bound made a restart after a long run fail on a loaded machine ("the queue entries
    /// could not be read within 5s" in a fresh-clone run of the JetStream kill -9 test).
    pub async fn wait_loaded(&self, stall: Duration) -> bool {
        let mut rx = self.loaded.subscribe();
        let mut seen = *self.applied.borrow();
        loop {
            if let Ok(r) = tokio::time::timeout(stall, rx.wait_for(|&l| l)).await {
                return r.is_ok();
            }
            let now = *self.applied.borrow();
            if now == seen {
                return false;
            }
            tracing::info!(
                applied = now,
                "queue view: still reading the stored entries"
            );
            seen = now;
        }
    }

    fn apply_message(
        &self,
        prefix: &str,
        subject: &str,
        revision: u64,
        payload: &[u8],
        tomb: bool,
    ) {
        let Some(rest) = subject
            .strip_prefix(prefix)
            .and_then(|r| r.strip_prefix('.'))
        else {
            return;
        };
        if let Some(id) = rest.strip_prefix("dl.").and_then(|i| i.parse::<u64>().ok()) {
            if tomb {
                self.dlq().remove(id);
            } else {
                match serde_json::from_slice::<DlqEntry>(payload) {
                    Ok(d) => self.dlq().insert(id, d),
                    Err(e) => {
                        tracing::error!(%subject, error = %e, "undecodable DLQ record; left out of the DLQ index");
                    }
                }
            }
            self.note_applied(revision);
            return;
        }
        let mut st = self.state();
        if let Some(id) = entry_id(rest) {
            let entry = if tomb {
                None
            } else {
                match serde_json::from_slice::<EntryRecord>(payload) {
                    Ok(mut r) => {
                        r.entry.id = id;
                        Some((r.entry, r.node, r.key_at))
                    }
                    Err(e) => {
                        tracing::error!(%subject, error = %e, "undecodable queue entry record; left out of the view");
                        None
                    }
                }
            };
            st.apply(id, revision, entry);
        } else if rest.starts_with("hk.") {
            let held = if tomb {
                None
            } else {
                serde_json::from_slice::<HeldRecord>(payload)
                    .ok()
                    .map(|h| (h.target, h.key))
            };
            st.apply_held(subject, held);
        }
        drop(st);
        self.note_applied(revision);
    }

    /// Records that the view has applied `revision`.
    fn note_applied(&self, revision: u64) {
        self.applied.send_if_modified(|a| {
            let newer = revision > *a;
            if newer {
                *a = revision;
            }
            newer
        });
    }
}

/// How long each pull of the view's consumer may wait. The client's idle heartbeat follows it
/// down (half of it), and two missed heartbeats make the client recreate the consumer where it
/// left off: with the default (30 s, heartbeat 15 s) a node whose consumer was on a server
/// that died saw no queue changes, so leased nothing, for 30 to 60 s after a failover
/// (`a_replicated_store_keeps_every_accept_through_the_loss_of_its_leader` showed it); with
/// 2 s it is a few seconds. The cost is one pull request every
/// 2 s while nothing happens.
const FOLLOW_PULL_EXPIRES: Duration = Duration::from_secs(2);

/// The kinds of records the view follows: queue entries, held keys, DLQ entries.
const FOLLOWED: [&str; 3] = ["en", "hk", "dl"];

/// Whether the view follows record `key`.
pub(super) fn follows(key: &str) -> bool {
    key.split_once('.')
        .is_some_and(|(kind, _)| FOLLOWED.contains(&kind))
}

/// The entry id of record key `en.<seq>.<idx>`.
fn entry_id(key: &str) -> Option<EntryId> {
    let rest = key.strip_prefix("en.")?;
    let (event, idx) = rest.split_once('.')?;
    Some(EntryId {
        event: event.parse().ok()?,
        idx: idx.parse().ok()?,
    })
}

/// Follows the entry records into `view` until the task is aborted. The ordered consumer
/// recreates itself over gaps; when the stream itself fails the follower starts over after a
/// pause, re-reading every record (the view ignores what it has already applied).
pub(super) async fn follow(view: Arc<View>, stream: stream::Stream, prefix: String) {
    let filters: Vec<String> = FOLLOWED.iter().map(|k| format!("{prefix}.{k}.>")).collect();
    loop {
        // Nothing to load when none of the followed records exists yet (the consumer would
        // then deliver nothing to say it has caught up).
        let mut any = false;
        for f in &filters {
            match stream
                .direct_get_builder()
                .sequence(1)
                .next_by_subject(f.clone())
                .send()
                .await
            {
                Err(e) if e.kind() == stream::DirectGetErrorKind::NotFound => {}
                _ => any = true,
            }
        }
        if !any {
            view.loaded.send_replace(true);
        }
        // From the start the first time; after that from where the view is (everything up to
        // the last revision applied has been seen: the consumer delivers in stream order).
        let applied = *view.applied.borrow();
        let deliver_policy = if applied == 0 {
            DeliverPolicy::All
        } else {
            DeliverPolicy::ByStartSequence {
                start_sequence: applied + 1,
            }
        };
        let consumer = stream
            .create_consumer(OrderedConfig {
                filter_subjects: filters.clone(),
                deliver_policy,
                max_expires: FOLLOW_PULL_EXPIRES,
                ..Default::default()
            })
            .await;
        let messages = match consumer {
            Ok(c) => c.messages().await.map_err(|e| e.to_string()),
            Err(e) => Err(e.to_string()),
        };
        match messages {
            Ok(mut messages) => loop {
                let next = tokio::select! {
                    m = messages.next() => m,
                    () = view.resubscribe.notified() => {
                        tracing::warn!(applied = *view.applied.borrow(), "queue view: behind this node's writes; following again with a new consumer");
                        break;
                    }
                };
                let Some(m) = next else { break };
                let m = match m {
                    Ok(m) => m,
                    Err(e) => {
                        tracing::warn!(error = %e, "queue view: the record stream failed; following it again");
                        break;
                    }
                };
                let Ok(info) = m.info() else { continue };
                let (revision, pending) = (info.stream_sequence, info.pending);
                let tomb = m
                    .headers
                    .as_ref()
                    .is_some_and(|h| h.get(super::records::TOMBSTONE).is_some());
                view.apply_message(&prefix, m.subject.as_str(), revision, &m.payload, tomb);
                if pending == 0 {
                    view.loaded.send_replace(true);
                }
            },
            Err(e) => {
                tracing::warn!(error = %e, "queue view: cannot follow the records; retrying");
            }
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::{Lease, NewEntry};

    fn entry(target: &str, due: Millis) -> QueueEntry {
        QueueEntry::queued(
            EntryId::default(),
            NewEntry {
                target_id: target.into(),
                rule: "r".into(),
                ordering_key: None,
                max_depth: None,
                lease_ms: None,
                hold_key: false,
            },
            "k".into(),
            0,
            due,
            0,
        )
    }

    /// A view still applying records is waited for past the stall bound; one that applies
    /// nothing for a whole bound is given up on.
    #[tokio::test(start_paused = true)]
    async fn loading_is_waited_for_while_it_makes_progress() {
        let view = View::new();
        let feeder = {
            let view = view.clone();
            tokio::spawn(async move {
                for rev in 1..=10u64 {
                    tokio::time::sleep(Duration::from_millis(600)).await;
                    view.apply_message("P", &format!("P.dl.{rev}"), rev, b"", true);
                }
                view.loaded.send_replace(true);
            })
        };
        let started = tokio::time::Instant::now();
        assert!(view.wait_loaded(Duration::from_secs(1)).await);
        assert!(started.elapsed() >= Duration::from_secs(6));
        feeder.await.unwrap();

        let stalled = View::new();
        stalled.apply_message("P", "P.dl.1", 1, b"", true);
        let started = tokio::time::Instant::now();
        assert!(!stalled.wait_loaded(Duration::from_secs(1)).await);
        assert!(started.elapsed() < Duration::from_secs(2));
    }

    #[test]
    fn the_view_keeps_the_newest_revision_and_drops_finished_entries() {
        let view = View::new();
        let a = EntryId { event: 1, idx: 0 };
        view.state()
            .apply(a, 10, Some((entry("t", 100), None, None)));
        assert_eq!(view.due_count("t", 99, 10), 0);
        assert_eq!(view.due_count("t", 100, 10), 1);
        // An older revision arriving late changes nothing.
        view.state().apply(a, 5, Some((entry("t", 0), None, None)));
        assert_eq!(view.next_due("t"), Some(100));
        // Leased until 500: available again just after the lease ends.
        let mut leased = entry("t", 100);
        leased.lease = Some(Lease {
            token: 11,
            until: 500,
        });
        view.state().apply(a, 11, Some((leased, None, None)));
        assert_eq!(view.next_due("t"), Some(501));
        assert_eq!(view.candidates("t", 501, 10)[0].revision, 11);
        let mut done = entry("t", 100);
        done.state = EntryState::Delivered;
        view.state().apply(a, 12, Some((done, None, None)));
        assert_eq!(view.next_due("t"), None);
        assert!(view.targets().is_empty());
    }

    /// When a key's first entry finishes, the target's worker is woken for the next one:
    /// `next_due` passes over entries waiting behind their key, so without the wake-up the
    /// worker slept until its idle poll for every entry of a key that had been retrying.
    /// The claim this node had on the entry ends with the newer revision (it used to stay in
    /// the map for good, one per lease).
    #[tokio::test]
    async fn finishing_a_keys_first_entry_wakes_the_worker_for_the_next() {
        let view = View::new();
        let (a, b) = (EntryId { event: 1, idx: 0 }, EntryId { event: 2, idx: 0 });
        let keyed = |accepted: Millis| {
            let mut e = entry("t", 0);
            e.id = if accepted == 1 { a } else { b };
            e.ordering_key = Some("k".into());
            e.accepted_at = accepted;
            e
        };
        view.state().apply(a, 1, Some((keyed(1), None, None)));
        view.state().apply(b, 2, Some((keyed(2), None, None)));
        let first = view.candidates("t", 10, 10);
        assert_eq!(
            first.iter().map(|l| l.entry.id).collect::<Vec<_>>(),
            vec![a]
        );
        assert_eq!(view.state().claimed.len(), 1);
        // The worker waits: nothing else may go while `a` is leased.
        assert_eq!(view.next_due("t"), None);
        let notify = view.notifier("t");
        let mut done = keyed(1);
        done.state = EntryState::Delivered;
        view.state().apply(a, 3, Some((done, None, None)));
        tokio::time::timeout(Duration::from_secs(5), notify.notified())
            .await
            .expect("the worker is woken for the key's next entry");
        assert_eq!(view.next_due("t"), Some(0));
        assert!(
            view.state().claimed.is_empty(),
            "the claim ended with the lease"
        );
    }

    /// Entries behind their key's first one, or of a held key, are parked out of what leases
    /// look through; the next one comes in as the first goes, or as the key is released.
    #[test]
    fn a_blocked_keys_backlog_is_parked_out_of_the_leasable_set() {
        let view = View::new();
        let keyed = |n: u64| {
            let mut e = entry("t", 0);
            e.id = EntryId { event: n, idx: 0 };
            e.ordering_key = Some("k".into());
            e.accepted_at = n as Millis;
            e
        };
        for n in 1..=1000 {
            view.state().apply(
                EntryId { event: n, idx: 0 },
                n,
                Some((keyed(n), None, None)),
            );
        }
        let mut free = entry("t", 0);
        free.id = EntryId {
            event: 5000,
            idx: 0,
        };
        view.state()
            .apply(free.id, 5000, Some((free.clone(), None, None)));
        let leasable = |v: &View| v.state().leasable.get("t").map_or(0, BTreeSet::len);
        assert_eq!(leasable(&view), 2, "the key's first and the unkeyed entry");
        assert_eq!(view.depth("t"), 1001, "the depth counts parked entries");
        // Held: none of the key's entries is leasable; released: its first again.
        view.state()
            .apply_held("P.hk.x", Some(("t".into(), "k".into())));
        assert_eq!(leasable(&view), 1);
        assert_eq!(view.due_count("t", 10, 10), 1);
        view.state().apply_held("P.hk.x", None);
        assert_eq!(leasable(&view), 2);
        // The first goes: the second comes in.
        let mut done = keyed(1);
        done.state = EntryState::Delivered;
        view.state()
            .apply(EntryId { event: 1, idx: 0 }, 6000, Some((done, None, None)));
        let ids: Vec<u64> = view
            .candidates("t", 10, 10)
            .iter()
            .map(|l| l.entry.id.event)
            .collect();
        assert_eq!(ids, vec![2, 5000]);
    }

    fn dead(id: u64, target: &str, reason: crate::store::DlqReason, at: Millis) -> Vec<u8> {
        let new = NewEntry {
            target_id: target.into(),
            rule: "r".into(),
            ordering_key: None,
            max_depth: None,
            lease_ms: None,
            hold_key: false,
        };
        let mut d = DlqEntry::at_acceptance(
            1,
            ("e".into(), "/s".into(), "t".into()),
            Some(&new),
            reason,
            vec![crate::event::FieldError::new("", "boom")],
            at,
        );
        d.id = id;
        serde_json::to_vec(&d).expect("encode")
    }

    #[test]
    fn the_dlq_index_lists_counts_and_forgets_removed_entries() {
        use crate::store::DlqReason::{PermanentError, RetriesExhausted};
        let view = View::new();
        for (id, target, reason, at) in [
            (3, "a", PermanentError, 1_000),
            (1, "b", RetriesExhausted, 2_000),
            (7, "a", RetriesExhausted, 3_000),
            (5, "a", PermanentError, 4_000),
        ] {
            let payload = dead(id, target, reason, at);
            view.apply_message("P", &format!("P.dl.{id}"), id, &payload, false);
        }
        // A record written again (a new revision of one entry) is counted once.
        view.apply_message(
            "P",
            "P.dl.5",
            8,
            &dead(5, "a", PermanentError, 4_000),
            false,
        );
        let only_a = DlqFilter {
            target: Some("a".into()),
            ..DlqFilter::default()
        };
        assert_eq!(view.dlq_ids(&only_a, None, 10), vec![3, 5, 7]);
        assert_eq!(view.dlq_ids(&only_a, Some(3), 1), vec![5]);
        assert_eq!(
            view.dlq_ids(&DlqFilter::default(), None, 10),
            vec![1, 3, 5, 7]
        );
        assert_eq!(view.dlq_max_id(), 7);
        assert_eq!(view.stats(0)["a"].dlq, 3);
        assert_eq!(view.stats(0)["b"].dlq, 1);
        let rows = view.dlq_summary(&only_a, 60_000);
        assert_eq!(
            rows.iter().map(|r| (r.reason, r.count)).collect::<Vec<_>>(),
            vec![(PermanentError, 2), (RetriesExhausted, 1)]
        );
        // The index keeps no attempts or errors (listings read the entries themselves).
        assert!(view.dlq().entries.values().all(|d| d.errors.is_empty()));
        view.apply_message("P", "P.dl.7", 9, b"", true);
        view.apply_message("P", "P.dl.1", 10, b"", true);
        assert_eq!(view.dlq_max_id(), 5);
        assert_eq!(view.stats(0)["a"].dlq, 2);
        assert_eq!(view.stats(0).get("b").map_or(0, |s| s.dlq), 0);
    }

    #[test]
    fn entry_subjects_parse_only_under_the_prefix() {
        assert_eq!(entry_id("en.42.3"), Some(EntryId { event: 42, idx: 3 }));
        assert_eq!(entry_id("ev.42"), None);
        assert_eq!(entry_id("en.x.3"), None);
    }
}

//! Each node's view of the live queue entries, followed from the records stream.
//!
//! An ordered consumer on `<prefix>.en.>` delivers every entry record as it is written (and,
//! from the start, the last record of every entry). The view keeps the queued ones per target,
//! ordered by when they may next be leased: their due time, or the end of their lease while
//! one is held. It only proposes candidates: the lease's compare-and-set on the record decides,
//! so a view that lags behind another node's writes costs a conflict, never a double delivery.

use std::collections::{BTreeSet, HashMap};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use async_nats::jetstream::consumer::DeliverPolicy;
use async_nats::jetstream::consumer::pull::OrderedConfig;
use async_nats::jetstream::stream;
use futures::StreamExt;
use tokio::sync::{Notify, watch};

use super::EntryRecord;
use crate::store::{EntryId, EntryState, Millis, QueueEntry};

/// A live (queued) entry as the view last saw it.
#[derive(Debug, Clone)]
pub(super) struct Live {
    /// The record's revision (what a lease must expect).
    pub revision: u64,
    /// The entry.
    pub entry: QueueEntry,
    /// When it may be leased: its due time, or just after its lease's end.
    pub available_at: Millis,
}

#[derive(Default)]
struct State {
    live: HashMap<EntryId, Live>,
    /// Per target: (available at, entry).
    ready: HashMap<String, BTreeSet<(Millis, EntryId)>>,
    notifiers: HashMap<String, Arc<Notify>>,
}

impl State {
    fn apply(&mut self, id: EntryId, revision: u64, entry: Option<QueueEntry>) {
        if let Some(old) = self.live.get(&id) {
            if old.revision >= revision {
                return;
            }
            let target = old.entry.target_id.clone();
            let key = (old.available_at, id);
            if let Some(set) = self.ready.get_mut(&target) {
                set.remove(&key);
            }
            self.live.remove(&id);
        }
        let Some(entry) = entry.filter(|e| e.state == EntryState::Queued) else {
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
        self.live.insert(
            id,
            Live {
                revision,
                entry,
                available_at,
            },
        );
        if let Some(n) = self.notifiers.get(&target) {
            n.notify_one();
        }
    }
}

/// The view, shared by the store and its follower task.
pub(super) struct View {
    state: Mutex<State>,
    /// The highest entry revision applied.
    applied: watch::Sender<u64>,
    /// Whether the follower has read everything there was when it started.
    loaded: watch::Sender<bool>,
}

impl View {
    pub fn new() -> Arc<Self> {
        Arc::new(Self {
            state: Mutex::new(State::default()),
            applied: watch::channel(0).0,
            loaded: watch::channel(false).0,
        })
    }

    fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Up to `max` entries of `target` that may be leased at `now`, soonest first.
    pub fn candidates(&self, target: &str, now: Millis, max: usize) -> Vec<Live> {
        let st = self.state();
        let Some(set) = st.ready.get(target) else {
            return Vec::new();
        };
        set.iter()
            .take_while(|(at, _)| *at <= now)
            .take(max)
            .filter_map(|(_, id)| st.live.get(id).cloned())
            .collect()
    }

    /// How many entries of `target` may be leased at `now`, up to `max`.
    pub fn due_count(&self, target: &str, now: Millis, max: usize) -> usize {
        self.state().ready.get(target).map_or(0, |set| {
            set.iter()
                .take_while(|(at, _)| *at <= now)
                .take(max)
                .count()
        })
    }

    /// When the next entry of `target` may be leased.
    pub fn next_due(&self, target: &str) -> Option<Millis> {
        self.state()
            .ready
            .get(target)
            .and_then(|s| s.first().map(|(at, _)| *at))
    }

    /// Woken when an entry of `target` is queued or re-queued.
    pub fn notifier(&self, target: &str) -> Arc<Notify> {
        self.state()
            .notifiers
            .entry(target.to_string())
            .or_insert_with(|| Arc::new(Notify::new()))
            .clone()
    }

    /// Targets with live entries.
    pub fn targets(&self) -> Vec<String> {
        let st = self.state();
        st.ready
            .iter()
            .filter(|(_, s)| !s.is_empty())
            .map(|(t, _)| t.clone())
            .collect()
    }

    /// Waits until the view has applied revision `revision` (a write of this node), or
    /// `timeout` passes.
    pub async fn wait_applied(&self, revision: u64, timeout: Duration) -> bool {
        let mut rx = self.applied.subscribe();
        tokio::time::timeout(timeout, rx.wait_for(|&a| a >= revision))
            .await
            .is_ok_and(|r| r.is_ok())
    }

    /// Waits until the follower has read every entry that existed when it started.
    pub async fn wait_loaded(&self, timeout: Duration) -> bool {
        let mut rx = self.loaded.subscribe();
        tokio::time::timeout(timeout, rx.wait_for(|&l| l))
            .await
            .is_ok_and(|r| r.is_ok())
    }

    fn apply_message(
        &self,
        prefix: &str,
        subject: &str,
        revision: u64,
        payload: &[u8],
        tomb: bool,
    ) {
        let Some(id) = entry_id(prefix, subject) else {
            return;
        };
        let entry = if tomb {
            None
        } else {
            match serde_json::from_slice::<EntryRecord>(payload) {
                Ok(mut r) => {
                    r.entry.id = id;
                    Some(r.entry)
                }
                Err(e) => {
                    tracing::error!(%subject, error = %e, "undecodable queue entry record; left out of the view");
                    None
                }
            }
        };
        self.state().apply(id, revision, entry);
        self.applied.send_if_modified(|a| {
            let newer = revision > *a;
            if newer {
                *a = revision;
            }
            newer
        });
    }
}

/// The entry id of subject `<prefix>.en.<seq>.<idx>`.
fn entry_id(prefix: &str, subject: &str) -> Option<EntryId> {
    let rest = subject.strip_prefix(prefix)?.strip_prefix(".en.")?;
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
    let filter = format!("{prefix}.en.>");
    loop {
        // Nothing to load when no entry record exists yet.
        match stream
            .direct_get_builder()
            .sequence(1)
            .next_by_subject(filter.clone())
            .send()
            .await
        {
            Err(e) if e.kind() == stream::DirectGetErrorKind::NotFound => {
                view.loaded.send_replace(true);
            }
            _ => {}
        }
        let consumer = stream
            .create_consumer(OrderedConfig {
                filter_subject: filter.clone(),
                deliver_policy: DeliverPolicy::All,
                ..Default::default()
            })
            .await;
        let messages = match consumer {
            Ok(c) => c.messages().await.map_err(|e| e.to_string()),
            Err(e) => Err(e.to_string()),
        };
        match messages {
            Ok(mut messages) => {
                while let Some(m) = messages.next().await {
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
                }
            }
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
            },
            "k".into(),
            0,
            due,
            0,
        )
    }

    #[test]
    fn the_view_keeps_the_newest_revision_and_drops_finished_entries() {
        let view = View::new();
        let a = EntryId { event: 1, idx: 0 };
        view.state().apply(a, 10, Some(entry("t", 100)));
        assert_eq!(view.due_count("t", 99, 10), 0);
        assert_eq!(view.due_count("t", 100, 10), 1);
        // An older revision arriving late changes nothing.
        view.state().apply(a, 5, Some(entry("t", 0)));
        assert_eq!(view.next_due("t"), Some(100));
        // Leased until 500: available again just after the lease ends.
        let mut leased = entry("t", 100);
        leased.lease = Some(Lease {
            token: 11,
            until: 500,
        });
        view.state().apply(a, 11, Some(leased));
        assert_eq!(view.next_due("t"), Some(501));
        assert_eq!(view.candidates("t", 501, 10)[0].revision, 11);
        let mut done = entry("t", 100);
        done.state = EntryState::Delivered;
        view.state().apply(a, 12, Some(done));
        assert_eq!(view.next_due("t"), None);
        assert!(view.targets().is_empty());
    }

    #[test]
    fn entry_subjects_parse_only_under_the_prefix() {
        assert_eq!(
            entry_id("rt", "rt.en.42.3"),
            Some(EntryId { event: 42, idx: 3 })
        );
        assert_eq!(entry_id("rt", "rt.ev.42"), None);
        assert_eq!(entry_id("rt", "other.en.42.3"), None);
        assert_eq!(entry_id("rt", "rt.en.x.3"), None);
    }
}

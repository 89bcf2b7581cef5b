//! The `Store` trait on the JetStream store.
//!
//! The trait's reads that redb answers from a local file are synchronous; here they are a
//! round trip to the server, run to completion on the calling thread (`blocking`): inside the
//! runtime through `block_in_place`, so the worker's other tasks move elsewhere meanwhile, and
//! on plain threads (the WASM host's) on the store's runtime. Each is bounded by the request
//! timeout. Making those reads async in the trait is the cleaner end state.

use std::collections::BTreeMap;
use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::FutureExt;
use futures::future::BoxFuture;
use tokio::sync::Notify;

use super::JetStreamStore;
use crate::store::{
    AcceptOutcome, AcceptedLeased, AttemptEnd, Disposition, DlqEntry, DlqFilter, DlqReason,
    EntryId, Fate, FinishError, Job, KvUsage, Lease, Leased, Millis, NewEvent, QueueStats,
    RecordCounts, RedriveAction, ReplayItem, Store, StoreError, StoredEvent, SummaryRow,
    SweepStats,
};

/// How long record counts (a pass over the records) are reused.
const COUNTS_TTL: Duration = Duration::from_secs(30);

impl JetStreamStore {
    /// Runs `fut` to completion on this thread (see the module docs).
    fn blocking<T>(&self, fut: impl Future<Output = T>) -> T {
        match tokio::runtime::Handle::try_current() {
            Ok(h) => tokio::task::block_in_place(|| h.block_on(fut)),
            Err(_) => self.runtime.block_on(fut),
        }
    }

    fn wall_now() -> Millis {
        chrono::Utc::now().timestamp_millis()
    }
}

impl Store for JetStreamStore {
    fn accept(
        &self,
        events: Vec<NewEvent>,
    ) -> BoxFuture<'_, Result<Vec<AcceptOutcome>, StoreError>> {
        JetStreamStore::accept(self, events).boxed()
    }

    fn accept_leased(
        &self,
        events: Vec<NewEvent>,
    ) -> BoxFuture<'_, Result<AcceptedLeased, StoreError>> {
        JetStreamStore::accept_leased(self, events).boxed()
    }

    fn lease(
        &self,
        target: &str,
        now: Millis,
        max: usize,
        lease_ms: i64,
    ) -> BoxFuture<'_, Result<Vec<Leased>, StoreError>> {
        let target = target.to_string();
        async move { JetStreamStore::lease(self, &target, now, max, lease_ms).await }.boxed()
    }

    fn finish(
        &self,
        id: EntryId,
        lease: Lease,
        end: AttemptEnd,
        disposition: Disposition,
        now: Millis,
    ) -> BoxFuture<'_, Result<(), FinishError>> {
        JetStreamStore::finish(self, id, lease, end, disposition, now).boxed()
    }

    fn due_count(&self, target: &str, now: Millis, max: usize) -> usize {
        JetStreamStore::due_count(self, target, now, max)
    }

    fn put_target_state(
        &self,
        id: &str,
        state: serde_json::Value,
    ) -> BoxFuture<'_, Result<(), StoreError>> {
        let id = id.to_string();
        async move { JetStreamStore::put_target_state(self, &id, state).await }.boxed()
    }

    fn target_states(&self) -> Result<Vec<(String, serde_json::Value)>, StoreError> {
        self.blocking(JetStreamStore::target_states(self))
    }

    fn release_key(&self, target: &str, key: &str) -> BoxFuture<'_, Result<bool, StoreError>> {
        let (target, key) = (target.to_string(), key.to_string());
        async move { JetStreamStore::release_key(self, &target, &key).await }.boxed()
    }

    fn dead_letter_queued(
        &self,
        target: &str,
        reason: DlqReason,
        message: &str,
        now: Millis,
    ) -> BoxFuture<'_, Result<usize, StoreError>> {
        let (target, message) = (target.to_string(), message.to_string());
        async move {
            JetStreamStore::dead_letter_queued(self, &target, reason, &message, now).await
        }
        .boxed()
    }

    fn put_job(&self, job: Job) -> BoxFuture<'_, Result<(), StoreError>> {
        JetStreamStore::put_job(self, job).boxed()
    }

    fn jobs(&self) -> Result<Vec<Job>, StoreError> {
        self.blocking(JetStreamStore::jobs(self))
    }

    fn redrive_step(
        &self,
        job: Job,
        actions: Vec<RedriveAction>,
        now: Millis,
    ) -> BoxFuture<'_, Result<(), StoreError>> {
        JetStreamStore::redrive_step(self, job, actions, now).boxed()
    }

    fn replay_step(
        &self,
        job: Job,
        items: Vec<ReplayItem>,
        now: Millis,
    ) -> BoxFuture<'_, Result<(), StoreError>> {
        JetStreamStore::replay_step(self, job, items, now).boxed()
    }

    fn purge_dlq(&self, ids: Vec<u64>) -> BoxFuture<'_, Result<u64, StoreError>> {
        JetStreamStore::purge_dlq(self, ids).boxed()
    }

    fn dlq_summary(
        &self,
        filter: &DlqFilter,
        bucket_ms: i64,
    ) -> Result<Vec<SummaryRow>, StoreError> {
        self.blocking(JetStreamStore::dlq_summary(self, filter, bucket_ms))
    }

    fn events_between(
        &self,
        from: Millis,
        to: Millis,
        after_seq: u64,
        limit: usize,
    ) -> Result<Vec<StoredEvent>, StoreError> {
        self.blocking(JetStreamStore::events_between(
            self, from, to, after_seq, limit,
        ))
    }

    fn completed_get(
        &self,
        handler: &str,
        key: &str,
        now: Millis,
    ) -> Result<Option<Vec<u8>>, StoreError> {
        self.blocking(JetStreamStore::completed_get(self, handler, key, now))
    }

    fn kv_get(
        &self,
        namespace: &str,
        key: &str,
        now: Millis,
    ) -> Result<Option<Vec<u8>>, StoreError> {
        self.blocking(JetStreamStore::kv_get(self, namespace, key, now))
    }

    fn kv_usage(&self) -> Result<BTreeMap<String, KvUsage>, StoreError> {
        self.blocking(JetStreamStore::kv_usage(self))
    }

    fn kv_usage_of(&self, namespace: &str) -> Result<KvUsage, StoreError> {
        self.blocking(JetStreamStore::kv_usage_of(self, namespace))
    }

    fn held_keys(&self, target: &str) -> Vec<String> {
        JetStreamStore::held_keys(self, target)
    }

    fn next_due(&self, target: &str) -> Option<Millis> {
        JetStreamStore::next_due(self, target)
    }

    fn notifier(&self, target: &str) -> Arc<Notify> {
        JetStreamStore::notifier(self, target)
    }

    fn reclaim_expired(&self, now: Millis) -> usize {
        // Expired leases are already leasable in the view; this only wakes their workers.
        self.view.wake_expired(now)
    }

    fn save_targets(
        &self,
        configs: Vec<(String, serde_json::Value)>,
    ) -> BoxFuture<'_, Result<(), StoreError>> {
        JetStreamStore::save_targets(self, configs).boxed()
    }

    fn saved_targets(&self) -> Result<Vec<(String, serde_json::Value)>, StoreError> {
        self.blocking(JetStreamStore::saved_targets(self))
    }

    fn targets_with_entries(&self) -> Vec<String> {
        JetStreamStore::targets_with_entries(self)
    }

    fn fate(&self, source: &str, id: &str) -> Result<Option<Fate>, StoreError> {
        self.blocking(JetStreamStore::fate(self, source, id))
    }

    fn dlq_list(
        &self,
        filter: &DlqFilter,
        after: Option<u64>,
        limit: usize,
    ) -> Result<Vec<DlqEntry>, StoreError> {
        self.blocking(JetStreamStore::dlq_list(self, filter, after, limit))
    }

    fn dlq_max_id(&self) -> Result<u64, StoreError> {
        self.blocking(JetStreamStore::dlq_max_id(self))
    }

    fn dlq_get(&self, id: u64) -> Result<Option<(DlqEntry, StoredEvent)>, StoreError> {
        self.blocking(JetStreamStore::dlq_get(self, id))
    }

    fn queue_stats(&self) -> BTreeMap<String, QueueStats> {
        JetStreamStore::queue_stats(self, Self::wall_now())
    }

    fn sweep(
        &self,
        now: Millis,
        dedup_window_ms: i64,
        retention_ms: i64,
    ) -> BoxFuture<'_, Result<SweepStats, StoreError>> {
        JetStreamStore::sweep(self, now, dedup_window_ms, retention_ms).boxed()
    }

    fn disk_bytes(&self) -> u64 {
        // What the server holds for this store (its own disk, not this node's).
        self.blocking(self.records.stream_bytes()).unwrap_or(0)
    }

    fn compacting(&self) -> bool {
        false
    }

    fn record_counts(&self) -> Result<RecordCounts, StoreError> {
        let mut cached = self.counts.lock().unwrap_or_else(|p| p.into_inner());
        if let Some((at, c)) = *cached
            && at.elapsed() < COUNTS_TTL
        {
            return Ok(c);
        }
        let c = self.blocking(self.count_records())?;
        *cached = Some((Instant::now(), c));
        Ok(c)
    }
}

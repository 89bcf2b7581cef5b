//! The `Store` trait on the JetStream store.
//!
//! The trait's reads are async here as everywhere, except the two the WASM host makes from
//! inside an invocation (`kv_get`, `kv_usage_of`), on a blocking thread: those are a round trip
//! to the server run to completion on the calling thread (`blocking`), bounded by the request
//! timeout.

use std::collections::BTreeMap;
use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::FutureExt;
use futures::future::BoxFuture;
use tokio::sync::Notify;

use super::JetStreamStore;
use crate::store::{
    AcceptOutcome, AcceptedLeased, AttemptEnd, Disposition, DlqEntry, DlqFilter, DlqMark,
    DlqReason, EntryId, Fate, FinishError, Finished, Job, KvUsage, Lease, LeaseBatch, Millis,
    NewEvent, QueueStats, RecordCounts, RedriveAction, ReplayItem, ReplayStepped, Store,
    StoreError, StoredEvent, SummaryRow, SweepStats,
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
    fn shared(&self) -> bool {
        true
    }

    fn announce_node(&self, now: Millis) -> BoxFuture<'_, Result<usize, StoreError>> {
        JetStreamStore::announce_node(self, now).boxed()
    }

    fn retire_node(&self) -> BoxFuture<'_, Result<(), StoreError>> {
        JetStreamStore::retire_node(self).boxed()
    }

    fn handler_catalog(&self) -> Option<Arc<dyn crate::store::HandlerCatalog>> {
        Some(Arc::new(super::JetStreamCatalog::new(self.records.clone())))
    }

    fn contract_catalog(&self) -> Option<Arc<dyn crate::store::ContractCatalog>> {
        Some(Arc::new(super::JetStreamCatalog::new(self.records.clone())))
    }

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

    fn lease_batch(
        &self,
        target: &str,
        now: Millis,
        max: usize,
        lease_ms: i64,
    ) -> BoxFuture<'_, Result<LeaseBatch, StoreError>> {
        let target = target.to_string();
        async move { JetStreamStore::lease_batch(self, &target, now, max, lease_ms).await }.boxed()
    }

    fn finish(
        &self,
        id: EntryId,
        lease: Lease,
        end: AttemptEnd,
        disposition: Disposition,
        now: Millis,
    ) -> BoxFuture<'_, Result<Finished, FinishError>> {
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

    fn target_states(&self) -> BoxFuture<'_, Result<Vec<(String, serde_json::Value)>, StoreError>> {
        JetStreamStore::target_states(self).boxed()
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

    fn dead_letter_expired_of_key(
        &self,
        target: &str,
        key: &str,
        accepted_before: Millis,
        message: &str,
        now: Millis,
    ) -> BoxFuture<'_, Result<usize, StoreError>> {
        let (target, key, message) = (target.to_string(), key.to_string(), message.to_string());
        async move {
            JetStreamStore::dead_letter_expired_of_key(
                self,
                &target,
                &key,
                accepted_before,
                &message,
                now,
            )
            .await
        }
        .boxed()
    }

    fn put_job(&self, job: Job) -> BoxFuture<'_, Result<u64, StoreError>> {
        JetStreamStore::put_job(self, job).boxed()
    }

    fn jobs(&self) -> BoxFuture<'_, Result<Vec<Job>, StoreError>> {
        JetStreamStore::jobs(self).boxed()
    }

    fn delete_jobs(&self, jobs: Vec<Job>) -> BoxFuture<'_, Result<u64, StoreError>> {
        async move { JetStreamStore::delete_jobs(self, &jobs).await }.boxed()
    }

    fn job(&self, id: &str) -> BoxFuture<'_, Result<Option<Job>, StoreError>> {
        let id = id.to_string();
        async move { JetStreamStore::job(self, &id).await }.boxed()
    }

    fn redrive_step(
        &self,
        job: Job,
        actions: Vec<RedriveAction>,
        now: Millis,
    ) -> BoxFuture<'_, Result<(u64, crate::store::RedriveGone), StoreError>> {
        JetStreamStore::redrive_step(self, job, actions, now).boxed()
    }

    fn max_step_writes(&self) -> usize {
        super::records::MAX_BATCH
    }

    fn replay_step(
        &self,
        job: Job,
        items: Vec<ReplayItem>,
        now: Millis,
    ) -> BoxFuture<'_, Result<ReplayStepped, StoreError>> {
        JetStreamStore::replay_step(self, job, items, now).boxed()
    }

    fn purge_dlq(&self, ids: Vec<u64>) -> BoxFuture<'_, Result<u64, StoreError>> {
        JetStreamStore::purge_dlq(self, ids).boxed()
    }

    fn dlq_summary<'a>(
        &'a self,
        filter: &'a DlqFilter,
        bucket_ms: i64,
    ) -> BoxFuture<'a, Result<Vec<SummaryRow>, StoreError>> {
        JetStreamStore::dlq_summary(self, filter, bucket_ms).boxed()
    }

    fn events_between(
        &self,
        from: Millis,
        to: Millis,
        after_seq: u64,
        limit: usize,
        max_bytes: usize,
    ) -> BoxFuture<'_, Result<Vec<StoredEvent>, StoreError>> {
        JetStreamStore::events_between(self, from, to, after_seq, limit, max_bytes).boxed()
    }

    fn count_events_between(
        &self,
        from: Millis,
        to: Millis,
    ) -> BoxFuture<'_, Result<u64, StoreError>> {
        JetStreamStore::count_events_between(self, from, to).boxed()
    }

    fn completed_get<'a>(
        &'a self,
        handler: &'a str,
        key: &'a str,
        now: Millis,
    ) -> BoxFuture<'a, Result<Option<Vec<u8>>, StoreError>> {
        JetStreamStore::completed_get(self, handler, key, now).boxed()
    }

    fn kv_get(
        &self,
        namespace: &str,
        key: &str,
        now: Millis,
    ) -> Result<Option<Vec<u8>>, StoreError> {
        self.blocking(JetStreamStore::kv_get(self, namespace, key, now))
    }

    fn kv_usage(&self) -> BoxFuture<'_, Result<BTreeMap<String, KvUsage>, StoreError>> {
        JetStreamStore::kv_usage(self).boxed()
    }

    fn kv_usage_of(&self, namespace: &str) -> Result<KvUsage, StoreError> {
        self.blocking(JetStreamStore::kv_usage_of(self, namespace))
    }

    fn kv_clear<'a>(&'a self, namespace: &'a str) -> BoxFuture<'a, Result<u64, StoreError>> {
        JetStreamStore::kv_clear(self, namespace).boxed()
    }

    fn completed_clear<'a>(&'a self, handler: &'a str) -> BoxFuture<'a, Result<u64, StoreError>> {
        async move {
            let n = JetStreamStore::completed_clear(self, handler).await?;
            // The counts /v1/status shows are cached: a freed name's records must not seem
            // to linger for the cache's lifetime.
            *self.counts.lock().unwrap_or_else(|p| p.into_inner()) = None;
            Ok(n)
        }
        .boxed()
    }

    fn held_keys(&self, target: &str) -> Vec<String> {
        JetStreamStore::held_keys(self, target)
    }

    fn key_head(&self, target: &str, key: &str) -> Option<crate::store::KeyHead> {
        self.view.key_head(target, key)
    }

    fn set_ordered(&self, target: &str, ordered: bool) {
        self.view.set_ordered(target, ordered);
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

    fn saved_targets(&self) -> BoxFuture<'_, Result<Vec<(String, serde_json::Value)>, StoreError>> {
        JetStreamStore::saved_targets(self).boxed()
    }

    fn targets_with_entries(&self) -> Vec<String> {
        JetStreamStore::targets_with_entries(self)
    }

    fn fate<'a>(
        &'a self,
        source: &'a str,
        id: &'a str,
    ) -> BoxFuture<'a, Result<Option<Fate>, StoreError>> {
        JetStreamStore::fate(self, source, id).boxed()
    }

    fn dlq_list<'a>(
        &'a self,
        filter: &'a DlqFilter,
        after: Option<u64>,
        limit: usize,
    ) -> BoxFuture<'a, Result<Vec<DlqEntry>, StoreError>> {
        JetStreamStore::dlq_list(self, filter, after, limit).boxed()
    }

    fn dlq_mark(&self) -> BoxFuture<'_, Result<DlqMark, StoreError>> {
        JetStreamStore::dlq_mark(self).boxed()
    }

    fn dlq_get(
        &self,
        id: u64,
    ) -> BoxFuture<'_, Result<Option<(DlqEntry, StoredEvent)>, StoreError>> {
        JetStreamStore::dlq_get(self, id).boxed()
    }

    fn queue_stats(&self) -> BTreeMap<String, QueueStats> {
        JetStreamStore::queue_stats(self, Self::wall_now())
    }

    fn dlq_without_target(&self) -> u64 {
        self.view.dlq_without_target()
    }

    fn sweep(
        &self,
        now: Millis,
        dedup_window_ms: i64,
        retention_ms: i64,
    ) -> BoxFuture<'_, Result<SweepStats, StoreError>> {
        JetStreamStore::sweep(self, now, dedup_window_ms, retention_ms).boxed()
    }

    fn disk_bytes(&self) -> BoxFuture<'_, Option<u64>> {
        // What the server holds for this store (its own disk, not this node's); unknown, not
        // 0, while the server cannot say.
        async move { self.records.stream_bytes().await.ok() }.boxed()
    }

    fn node_id(&self) -> Option<String> {
        Some(self.node.clone())
    }

    fn writable(&self) -> bool {
        // Connected, and the last commit did not fail for want of the server: during an
        // outage every write answers 503, so `/readyz` must say not ready.
        self.records.writable()
    }

    fn compacting(&self) -> bool {
        false
    }

    fn record_counts(&self) -> BoxFuture<'_, Result<RecordCounts, StoreError>> {
        async move {
            let cached = *self.counts.lock().unwrap_or_else(|p| p.into_inner());
            if let Some((at, c)) = cached
                && at.elapsed() < COUNTS_TTL
            {
                return Ok(c);
            }
            // Not under the lock: two scrapes at once may both count, which costs a pass and
            // nothing else.
            let c = self.count_records().await?;
            *self.counts.lock().unwrap_or_else(|p| p.into_inner()) = Some((Instant::now(), c));
            Ok(c)
        }
        .boxed()
    }
}

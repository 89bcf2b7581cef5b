//! The JetStream store's operations outside the delivery path: targets' runtime state and
//! saved configurations, background jobs, DLQ listing and purging, handler key-value reads.
//!
//! Listings of target states and jobs scan their kind of record (`Records::scan`), which the
//! admin API and the job runner do rarely and which stay few. The DLQ, which an outage can
//! fill with millions of entries, is listed from the view's index instead: ids chosen in
//! memory, then only the entries of the page read.

use std::collections::BTreeMap;

use base64::Engine;
use base64::engine::general_purpose::STANDARD as B64;
use serde::{Deserialize, Serialize};

use super::records::{Expect, Versioned, Write};
use super::{JetStreamStore, dec, dlq_key, enc};
use futures::{StreamExt, TryStreamExt};

use crate::store::{DlqEntry, DlqFilter, DlqMark, Job, KvUsage, Millis, StoreError, SummaryRow};

/// The record key of job `id`.
pub(super) fn job_key(id: &str) -> String {
    format!("job.{}", fp(&[id]))
}

/// A job record's value.
fn decode_job(bytes: &[u8]) -> Result<Job, StoreError> {
    job_from_value(dec::<Named>("job", bytes)?.value)
}

fn job_from_value(value: serde_json::Value) -> Result<Job, StoreError> {
    serde_json::from_value(value).map_err(|e| StoreError::Corrupt {
        table: "jobs",
        message: e.to_string(),
    })
}

/// The job revision (`Job::rev`) a read of a job record found (0: none).
fn stored_rev(read: Option<&Versioned>) -> Result<u64, StoreError> {
    match read.and_then(|v| v.value.as_ref()) {
        Some(bytes) => Ok(decode_job(bytes)?.rev),
        None => Ok(0),
    }
}

/// DLQ entries a listing reads at once.
const DLQ_READS_IN_FLIGHT: usize = 128;

/// A record named by an id (target, job): the id itself, since keys hold fingerprints.
#[derive(Debug, Serialize, Deserialize)]
struct Named {
    id: String,
    value: serde_json::Value,
}

/// A handler's key-value entry (`kv.<fingerprint>`).
#[derive(Debug, Serialize, Deserialize)]
pub(super) struct KvRecord {
    pub namespace: String,
    pub key: String,
    /// Base64 of the value.
    pub value: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expires_at: Option<Millis>,
}

impl KvRecord {
    /// The value as the handler wrote it.
    pub fn decoded(&self) -> Result<Vec<u8>, StoreError> {
        unb64("kv", &self.value)
    }

    /// What the entry adds to its namespace's usage record (key and value bytes; the
    /// per-entry overhead is added from the key count when the usage is read).
    pub fn usage_bytes(&self) -> Result<u64, StoreError> {
        Ok(KvUsage::data_bytes(&self.key, &self.decoded()?))
    }
}

/// What the sweep and `kv_clear` need of a key-value entry to choose it: the value, the
/// bulk of the record, is skipped, not decoded (a pass over every entry decoded and kept
/// them all).
#[derive(Debug, Deserialize)]
pub(super) struct KvHead {
    pub namespace: String,
    pub key: String,
    #[serde(default)]
    pub expires_at: Option<Millis>,
}

/// What the sweep needs of a COMPLETED record: its expiry (the stored result is skipped).
#[derive(Debug, Deserialize)]
pub(super) struct CompletedHead {
    pub expires_at: Millis,
    #[serde(default)]
    pub handler: Option<String>,
}

/// What a handler's namespace holds (`ku.<fingerprint>`), changed in the same batch as its
/// key-value writes: the bytes of its keys and values, and its keys.
#[derive(Debug, Default, Clone, Serialize, Deserialize)]
pub(super) struct UsageRecord {
    pub namespace: String,
    pub bytes: u64,
    pub keys: u64,
}

/// A handler's COMPLETED mark (`cd.<fingerprint>`).
#[derive(Debug, Serialize, Deserialize)]
pub(super) struct CompletedRecord {
    /// Base64 of the stored result.
    pub result: String,
    pub expires_at: Millis,
    /// The handler whose delivery completed, so that freeing its name can find its records
    /// (`completed_clear`). None in records of older builds, which only expire.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub handler: Option<String>,
}

/// A fingerprint of `parts` for record keys (subjects cannot hold arbitrary text).
pub(super) fn fp(parts: &[&str]) -> String {
    use sha2::{Digest, Sha256};
    let mut h = Sha256::new();
    for part in parts {
        h.update((part.len() as u64).to_le_bytes());
        h.update(part.as_bytes());
    }
    hex::encode(&h.finalize()[..16])
}

pub(super) fn kv_key(namespace: &str, key: &str) -> String {
    format!("kv.{}", fp(&[namespace, key]))
}

/// Shards of a namespace's usage record: writes of keys in different shards never conflict
/// (one record per namespace made every handler's commits race for it).
pub(super) const USAGE_SHARDS: u8 = 16;

/// The usage shard of `key` in `namespace`.
pub(super) fn usage_shard(namespace: &str, key: &str) -> u8 {
    use sha2::{Digest, Sha256};
    let h = Sha256::digest(format!("{}:{namespace}{key}", namespace.len()).as_bytes());
    h[0] % USAGE_SHARDS
}

/// The record of one usage shard of `namespace`.
pub(super) fn usage_key(namespace: &str, shard: u8) -> String {
    format!("ku.{}.{shard}", fp(&[namespace]))
}

/// The write of a usage shard as `usage` leaves it: a shard left without keys is deleted, so
/// a namespace emptied (its keys deleted or expired, or its handler's name released) is no
/// longer listed in `kv_usage` (`/v1/status` `handler_kv`), as in the embedded store. Kept
/// at 0 keys, every released or renamed handler stayed listed for good.
pub(super) fn usage_write(ukey: &str, usage: &UsageRecord, expect: Expect) -> Write {
    if usage.keys == 0 {
        Write::delete(ukey, expect)
    } else {
        Write::put(ukey, enc(usage), expect)
    }
}

pub(super) fn completed_key(handler: &str, key: &str) -> String {
    format!("cd.{}", fp(&[handler, key]))
}

pub(super) fn b64(bytes: &[u8]) -> String {
    B64.encode(bytes)
}

fn unb64(table: &'static str, text: &str) -> Result<Vec<u8>, StoreError> {
    B64.decode(text).map_err(|e| StoreError::Corrupt {
        table,
        message: e.to_string(),
    })
}

impl JetStreamStore {
    /// The value at `key`, decoded, or `None` when absent or deleted.
    pub(super) async fn read<T: for<'de> Deserialize<'de>>(
        &self,
        table: &'static str,
        key: &str,
    ) -> Result<Option<(T, u64)>, StoreError> {
        match self.records.get(key).await? {
            Some(Versioned {
                value: Some(bytes),
                revision,
            }) => Ok(Some((dec(table, &bytes)?, revision))),
            _ => Ok(None),
        }
    }

    /// `read` of a record the caller knows exists (a job's DLQ entry, its entry, its event):
    /// a replica that does not have it yet is not believed, and the leader is asked. A
    /// redrive step that took such a read's "absent" skipped the entry and moved its cursor
    /// past it.
    pub(super) async fn read_existing<T: for<'de> Deserialize<'de>>(
        &self,
        table: &'static str,
        key: &str,
    ) -> Result<Option<(T, u64)>, StoreError> {
        match self.records.get_at_least(key, 1).await? {
            Some(Versioned {
                value: Some(bytes),
                revision,
            }) => Ok(Some((dec(table, &bytes)?, revision))),
            _ => Ok(None),
        }
    }

    /// Every `(id, value)` of a kind of named records.
    async fn named(
        &self,
        kind: &'static str,
    ) -> Result<Vec<(String, serde_json::Value)>, StoreError> {
        let mut out: Vec<(String, serde_json::Value)> = self
            .records
            .scan(kind)
            .await?
            .into_iter()
            .map(|(_, _, bytes)| dec::<Named>(kind, &bytes).map(|n| (n.id, n.value)))
            .collect::<Result<_, _>>()?;
        out.sort_by(|a, b| a.0.cmp(&b.0));
        Ok(out)
    }

    async fn put_named(
        &self,
        kind: &'static str,
        items: Vec<(String, serde_json::Value)>,
    ) -> Result<(), StoreError> {
        let writes: Vec<Write> = items
            .into_iter()
            .map(|(id, value)| {
                Write::put(
                    format!("{kind}.{}", fp(&[&id])),
                    enc(&Named { id, value }),
                    Expect::Any,
                )
            })
            .collect();
        for chunk in writes.chunks(super::records::MAX_BATCH) {
            self.commit(chunk.to_vec()).await?;
        }
        Ok(())
    }

    /// Persists a target's runtime state (breaker, pause) as opaque JSON.
    pub async fn put_target_state(
        &self,
        id: &str,
        state: serde_json::Value,
    ) -> Result<(), StoreError> {
        self.put_named("ts", vec![(id.to_string(), state)]).await
    }

    /// Every persisted target state.
    pub async fn target_states(&self) -> Result<Vec<(String, serde_json::Value)>, StoreError> {
        self.named("ts").await
    }

    /// Saves the last configuration of targets (opaque JSON).
    pub async fn save_targets(
        &self,
        configs: Vec<(String, serde_json::Value)>,
    ) -> Result<(), StoreError> {
        self.put_named("tc", configs).await
    }

    /// Every saved target configuration.
    pub async fn saved_targets(&self) -> Result<Vec<(String, serde_json::Value)>, StoreError> {
        self.named("tc").await
    }

    /// The write that stores `job` at its next revision: refused now
    /// ([`StoreError::JobChanged`]) when the stored job is not at `job.rev`, and at commit
    /// ([`RecordsError::Conflict`](super::RecordsError::Conflict)) when it is written after
    /// this read. With `leader` (a try after a conflict) the job is read from the stream's
    /// leader.
    pub(super) async fn job_write(&self, job: &Job, leader: bool) -> Result<Write, StoreError> {
        let key = job_key(&job.id);
        let mut read = self.records.get_from(&key, leader).await?;
        let mut stored = stored_rev(read.as_ref())?;
        if stored < job.rev && !leader {
            // Someone wrote `job.rev` (the caller read it): a replica that has not applied
            // that write yet is not a change of the job. Deciding on it refused the write
            // as `JobChanged`, and the runner of a job stopped.
            read = self.records.get_leader(&key).await?;
            stored = stored_rev(read.as_ref())?;
        }
        if stored != job.rev {
            return Err(StoreError::JobChanged(job.id.clone()));
        }
        let next = Job {
            rev: job.rev + 1,
            ..job.clone()
        };
        let value = serde_json::to_value(&next).map_err(|e| StoreError::Backend(e.to_string()))?;
        Ok(Write::put(
            job_key(&job.id),
            enc(&Named {
                id: job.id.clone(),
                value,
            }),
            Expect::unchanged(read.as_ref()),
        ))
    }

    /// Creates or updates a background job if it is still at `job.rev`; its new revision.
    pub async fn put_job(&self, job: Job) -> Result<u64, StoreError> {
        for attempt in 0..super::MAX_RETRIES {
            // A conflict means the record moved since the read: the next read (from the
            // leader) says how.
            match self
                .commit(vec![self.job_write(&job, attempt > 0).await?])
                .await
            {
                Ok(_) => return Ok(job.rev + 1),
                Err(super::RecordsError::Conflict) => {}
                Err(e) => return Err(e.into()),
            }
        }
        Err(StoreError::Backend(
            "job write: its record kept changing under it".into(),
        ))
    }

    /// Records that this node is alive at `now` and counts the live nodes: this one, and
    /// each other whose announcement changed within `NODE_LIVE_MS` of this node's clock.
    /// Another node's `at` is compared with `now` only when first seen (a node whose clock
    /// is ahead then counts as just announced); after that, only whether it changes counts,
    /// so a node whose clock runs ahead is not kept alive by it once it stops.
    pub async fn announce_node(&self, now: Millis) -> Result<usize, StoreError> {
        let key = format!("nd.{}", fp(&[&self.node]));
        let record = serde_json::json!({ "node": self.node, "at": now });
        self.records
            .commit(vec![Write::put(key.clone(), enc(&record), Expect::Any)])
            .await?;
        let records = self.records.scan("nd").await?;
        let mut announced = self.announced.lock().unwrap_or_else(|p| p.into_inner());
        let before = std::mem::take(&mut *announced);
        for (k, _, bytes) in records {
            let Some(at) = serde_json::from_slice::<serde_json::Value>(&bytes)
                .ok()
                .and_then(|v| v["at"].as_i64())
            else {
                continue;
            };
            if k == key {
                continue;
            }
            let changed = match before.get(&k) {
                Some(&(seen, changed)) if seen == at => changed,
                Some(_) => now,
                None => at.min(now),
            };
            announced.insert(k, (at, changed));
        }
        let others = announced
            .values()
            .filter(|(_, changed)| now - changed < crate::store::NODE_LIVE_MS)
            .count();
        Ok(others + 1)
    }

    /// Removes this node's announcement (at shutdown): the others stop counting it at once
    /// instead of after `NODE_LIVE_MS`.
    pub async fn retire_node(&self) -> Result<(), StoreError> {
        let key = format!("nd.{}", fp(&[&self.node]));
        self.records
            .commit(vec![Write::delete(key, Expect::Any)])
            .await?;
        Ok(())
    }

    /// One job.
    pub async fn job(&self, id: &str) -> Result<Option<Job>, StoreError> {
        match self.records.get(&job_key(id)).await? {
            Some(Versioned {
                value: Some(bytes), ..
            }) => decode_job(&bytes).map(Some),
            _ => Ok(None),
        }
    }

    /// Removes each of `jobs` still at its revision (read again here: the revision a job
    /// record is expected at is the stream's, not the job's own `rev`); returns how many went.
    pub async fn delete_jobs(&self, jobs: &[Job]) -> Result<u64, StoreError> {
        let mut removed = 0;
        for job in jobs {
            // From the leader: a replica behind the job's last write kept a job meant to go.
            let Some(Versioned {
                value: Some(bytes),
                revision,
            }) = self.records.get_leader(&job_key(&job.id)).await?
            else {
                continue;
            };
            if decode_job(&bytes)?.rev != job.rev {
                continue;
            }
            let delete = Write::delete(job_key(&job.id), Expect::Revision(revision));
            match self.commit(vec![delete]).await {
                Ok(_) => removed += 1,
                // Written since it was read: kept, as a job that changed is.
                Err(super::RecordsError::Conflict) => {}
                Err(e) => return Err(e.into()),
            }
        }
        Ok(removed)
    }

    /// Every job.
    pub async fn jobs(&self) -> Result<Vec<Job>, StoreError> {
        self.named("job")
            .await?
            .into_iter()
            .map(|(_, v)| job_from_value(v))
            .collect()
    }

    /// DLQ entries matching `filter`, ids greater than `after`, at most `limit`: ids from
    /// the view's index, each entry read by id (an entry purged or redriven in between is
    /// skipped, and the next ids make up for it, so a short page still means the end).
    pub async fn dlq_list(
        &self,
        filter: &DlqFilter,
        after: Option<u64>,
        limit: usize,
    ) -> Result<Vec<DlqEntry>, StoreError> {
        self.caught_up().await?;
        let mut out = Vec::new();
        let mut cursor = after;
        while out.len() < limit {
            let ids = self.view.dlq_ids(filter, cursor, limit - out.len());
            let Some(&last) = ids.last() else { break };
            cursor = Some(last);
            let entries: Vec<Option<DlqEntry>> = futures::stream::iter(ids)
                .map(|id| self.dlq_entry(id))
                .buffered(DLQ_READS_IN_FLIGHT)
                .try_collect()
                .await?;
            out.extend(entries.into_iter().flatten().filter(|d| filter.matches(d)));
        }
        Ok(out)
    }

    /// DLQ entries grouped by target × reason, with a histogram over `bucket_ms` buckets
    /// (from the view's index: no reads).
    pub async fn dlq_summary(
        &self,
        filter: &DlqFilter,
        bucket_ms: i64,
    ) -> Result<Vec<SummaryRow>, StoreError> {
        self.caught_up().await?;
        Ok(self.view.dlq_summary(filter, bucket_ms))
    }

    /// See [`Store::dlq_mark`](crate::store::Store::dlq_mark): the view's revision, read
    /// before its highest id. A dead letter's first record is in the view when its sequence is
    /// at most that revision, and every later one comes after it; the DLQ entry ids, taken
    /// from each node's block of numbers, follow no such order across nodes.
    pub async fn dlq_mark(&self) -> Result<DlqMark, StoreError> {
        self.caught_up().await?;
        let made = self.view.applied();
        Ok(DlqMark {
            max_id: self.view.dlq_max_id(),
            made,
        })
    }

    /// Deletes DLQ entries. Returns how many existed.
    pub async fn purge_dlq(&self, ids: Vec<u64>) -> Result<u64, StoreError> {
        let mut n = 0;
        for id in ids {
            let key = dlq_key(id);
            // From the leader: an operator's purge has no compare-and-set to catch a stale
            // read, and a replica that did not have the entry yet (or had an older revision
            // of it) left it in the DLQ, reported as not there.
            if let Some(Versioned {
                value: Some(_),
                revision,
            }) = self.records.get_leader(&key).await?
            {
                match self
                    .commit(vec![Write::delete(key, Expect::Revision(revision))])
                    .await
                {
                    Ok(_) => n += 1,
                    // Changed meanwhile (redriven, purged by another node): not ours to count.
                    Err(super::RecordsError::Conflict) => {}
                    Err(e) => return Err(e.into()),
                }
            }
        }
        Ok(n)
    }

    /// A handler's key-value entry (expired entries read as absent).
    pub async fn kv_get(
        &self,
        namespace: &str,
        key: &str,
        now: Millis,
    ) -> Result<Option<Vec<u8>>, StoreError> {
        match self.read::<KvRecord>("kv", &kv_key(namespace, key)).await? {
            Some((r, _)) if r.expires_at.is_none_or(|e| e > now) => Ok(Some(r.decoded()?)),
            _ => Ok(None),
        }
    }

    /// What one handler's key-value namespace holds (the sum of its usage shards).
    pub async fn kv_usage_of(&self, namespace: &str) -> Result<KvUsage, StoreError> {
        let shards = futures::future::try_join_all((0..USAGE_SHARDS).map(|i| {
            let key = usage_key(namespace, i);
            async move { self.read::<UsageRecord>("kv usage", &key).await }
        }))
        .await?;
        let (bytes, keys) = shards
            .into_iter()
            .flatten()
            .fold((0u64, 0u64), |(b, k), (u, _)| (b + u.bytes, k + u.keys));
        Ok(KvUsage::from_counters(bytes, keys))
    }

    /// What each handler's key-value namespace holds (namespaces never written are absent).
    pub async fn kv_usage(&self) -> Result<BTreeMap<String, KvUsage>, StoreError> {
        let counters = self.records.scan("ku").await?.into_iter().try_fold(
            BTreeMap::<String, (u64, u64)>::new(),
            |mut all, (_, _, bytes)| {
                let u = dec::<UsageRecord>("kv usage", &bytes)?;
                let slot = all.entry(u.namespace).or_default();
                slot.0 += u.bytes;
                slot.1 += u.keys;
                Ok::<_, StoreError>(all)
            },
        )?;
        Ok(counters
            .into_iter()
            .map(|(ns, (bytes, keys))| (ns, KvUsage::from_counters(bytes, keys)))
            .collect())
    }

    /// The stored result of a handler's completed delivery `key`, unless expired.
    pub async fn completed_get(
        &self,
        handler: &str,
        key: &str,
        now: Millis,
    ) -> Result<Option<Vec<u8>>, StoreError> {
        match self
            .read::<CompletedRecord>("completed", &completed_key(handler, key))
            .await?
        {
            Some((r, _)) if r.expires_at > now => Ok(Some(unb64("completed", &r.result)?)),
            _ => Ok(None),
        }
    }
}

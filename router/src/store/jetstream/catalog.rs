//! The uploaded handlers and contracts of a JetStream deployment ([`HandlerCatalog`],
//! [`ContractCatalog`]), in the records stream beside everything else the nodes share:
//! `hx.<name>` holds a handler's index, changed by compare-and-set; `hc.<name>.<sha256>.<n>`
//! holds the `n`th chunk of a component, since a component (tens of MB for an interpreted
//! language) is larger than a message may be; `ct.<fingerprint of type and version>` holds the
//! last upload of a contract.
//!
//! Chunks are content-addressed and written before the index that names them, so a reader that
//! finds a version in an index finds its bytes; a reader still checks the length here and the
//! hash in the registry.

use std::collections::HashSet;
use std::sync::{Arc, Mutex, PoisonError};

use bytes::Bytes;
use futures::future::BoxFuture;
use futures::{FutureExt, StreamExt, TryStreamExt};

use super::records::{Expect, Records, RecordsError, ScanFrom, Write};
use crate::store::{
    CatalogRecord, ContractCatalog, HandlerCatalog, SharedContract, StoreError, StoredComponent,
};

/// Bytes per component chunk, at most: a server whose `max_payload` is smaller gets smaller
/// chunks ([`chunk_size`]). Readers learn the size from the first chunk, so nodes on servers
/// with different limits read each other's components.
const CHUNK: usize = 512 << 10;

/// What a chunk's message needs beside the chunk (subject, batch and tombstone headers).
const HEADROOM: usize = 8 << 10;

/// The chunk size for a server that takes messages of `max_payload` bytes.
fn chunk_size(max_payload: usize) -> usize {
    CHUNK.min(max_payload.saturating_sub(HEADROOM)).max(1)
}

/// Chunks written or read at once.
const PARALLEL: usize = 8;

/// The handler catalog on a records stream (see the module docs).
#[derive(Debug, Clone)]
pub struct JetStreamCatalog {
    records: Arc<Records>,
    /// Contract records (key, revision) found undecodable, each warned about once.
    undecodable: Arc<Mutex<HashSet<(String, u64)>>>,
}

impl JetStreamCatalog {
    /// The catalog kept in `records`.
    pub fn new(records: Arc<Records>) -> Self {
        Self {
            records,
            undecodable: Arc::default(),
        }
    }
}

impl JetStreamCatalog {
    /// Commits each write on its own (chunks are independent: content-addressed, and named
    /// by an index only once all are written), `PARALLEL` at a time.
    async fn commit_each(&self, writes: Vec<Write>) -> Result<(), StoreError> {
        futures::stream::iter(writes)
            .map(|w| self.records.commit(vec![w]))
            .buffer_unordered(PARALLEL)
            .try_for_each(|_| async { Ok(()) })
            .await?;
        Ok(())
    }
}

/// Event types may hold any character but `/`: the key is a fingerprint, and the record keeps
/// the type itself.
fn contract_key(ty: &str, version: u32) -> String {
    use sha2::{Digest, Sha256};
    let h = Sha256::digest(format!("{ty}\0v{version}").as_bytes());
    format!("ct.{}", hex::encode(&h[..16]))
}

/// The contract records that decode, each with its revision. One that does not (written by a
/// newer or broken node) is left out with a warning, once per revision, instead of failing
/// every read: the other uploads still reach every node.
fn decode_contracts(
    scanned: Vec<(String, u64, Bytes)>,
    warned: &Mutex<HashSet<(String, u64)>>,
) -> Vec<SharedContract> {
    scanned
        .into_iter()
        .filter_map(|(key, revision, bytes)| {
            match serde_json::from_slice::<SharedContract>(&bytes) {
                Ok(mut c) => {
                    c.revision = revision;
                    Some(c)
                }
                Err(e) => {
                    let first = warned
                        .lock()
                        .unwrap_or_else(PoisonError::into_inner)
                        .insert((key.clone(), revision));
                    if first {
                        tracing::warn!(record = %key, revision, error = %e, "a shared contract record does not decode; it is skipped until it is replaced");
                    }
                    None
                }
            }
        })
        .collect()
}

impl ContractCatalog for JetStreamCatalog {
    fn contracts(&self) -> BoxFuture<'_, Result<Vec<SharedContract>, StoreError>> {
        async move {
            let scanned = self.records.scan("ct").await?;
            Ok(decode_contracts(scanned, &self.undecodable))
        }
        .boxed()
    }

    fn put_contract(&self, contract: SharedContract) -> BoxFuture<'_, Result<u64, StoreError>> {
        async move {
            let key = contract_key(&contract.ty, contract.version);
            let bytes = serde_json::to_vec(&contract).map_err(|e| StoreError::Corrupt {
                table: "contract catalog",
                message: e.to_string(),
            })?;
            let revs = self
                .records
                .commit(vec![Write::put(key, bytes, Expect::Any)])
                .await?;
            Ok(revs.first().copied().unwrap_or_default())
        }
        .boxed()
    }
}

fn index_key(name: &str) -> String {
    format!("hx.{name}")
}

fn chunk_key(name: &str, sha256: &str, n: usize) -> String {
    format!("hc.{name}.{sha256}.{n}")
}

/// How many chunks of `chunk` bytes hold `size` bytes.
fn chunks(size: u64, chunk: usize) -> usize {
    usize::try_from(size).map_or(usize::MAX, |s| s.div_ceil(chunk.max(1)))
}

/// Names and hashes become subject tokens: anything that is not a plain token is refused
/// rather than allowed to reach into another record's subject.
fn check_token(what: &str, token: &str) -> Result<(), StoreError> {
    let ok = !token.is_empty()
        && token
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-');
    if ok {
        Ok(())
    } else {
        Err(StoreError::Backend(format!(
            "{what} {token:?} cannot be a record key"
        )))
    }
}

impl HandlerCatalog for JetStreamCatalog {
    fn indexes(&self) -> BoxFuture<'_, Result<Vec<CatalogRecord>, StoreError>> {
        async move {
            let scanned = self.records.scan("hx").await?;
            Ok(scanned
                .into_iter()
                .filter_map(|(key, revision, index)| {
                    Some(CatalogRecord {
                        name: key.strip_prefix("hx.")?.to_string(),
                        revision,
                        index,
                    })
                })
                .collect())
        }
        .boxed()
    }

    fn index(&self, name: &str) -> BoxFuture<'_, Result<Option<CatalogRecord>, StoreError>> {
        let name = name.to_string();
        async move {
            check_token("handler name", &name)?;
            let read = self.records.get(&index_key(&name)).await?;
            Ok(read.and_then(|v| {
                Some(CatalogRecord {
                    revision: v.revision,
                    index: v.value?,
                    name,
                })
            }))
        }
        .boxed()
    }

    fn put_index(
        &self,
        name: &str,
        index: Bytes,
        expect: u64,
    ) -> BoxFuture<'_, Result<Option<u64>, StoreError>> {
        let key = index_key(name);
        let name = name.to_string();
        async move {
            check_token("handler name", &name)?;
            let write = Write::put(key, index, Expect::Revision(expect));
            match self.records.commit(vec![write]).await {
                Ok(revs) => Ok(revs.first().copied()),
                Err(RecordsError::Conflict) => Ok(None),
                Err(e) => Err(e.into()),
            }
        }
        .boxed()
    }

    fn put_component(
        &self,
        name: &str,
        sha256: &str,
        bytes: Bytes,
    ) -> BoxFuture<'_, Result<(), StoreError>> {
        let (name, sha256) = (name.to_string(), sha256.to_string());
        async move {
            check_token("handler name", &name)?;
            check_token("component hash", &sha256)?;
            let chunk = chunk_size(self.records.max_payload());
            let writes: Vec<Write> = (0..chunks(bytes.len() as u64, chunk))
                .map(|n| {
                    let end = ((n + 1) * chunk).min(bytes.len());
                    Write::put(
                        chunk_key(&name, &sha256, n),
                        bytes.slice(n * chunk..end),
                        Expect::Any,
                    )
                })
                .collect();
            self.commit_each(writes).await
        }
        .boxed()
    }

    fn component(
        &self,
        name: &str,
        sha256: &str,
        size: u64,
    ) -> BoxFuture<'_, Result<Option<Vec<u8>>, StoreError>> {
        let (name, sha256) = (name.to_string(), sha256.to_string());
        async move {
            check_token("handler name", &name)?;
            check_token("component hash", &sha256)?;
            if size == 0 {
                return Ok(Some(Vec::new()));
            }
            // The first chunk gives the writer's chunk size (every chunk but the last has it).
            let first = self
                .records
                .get(&chunk_key(&name, &sha256, 0))
                .await?
                .and_then(|v| v.value);
            let Some(first) = first else {
                return Ok(None);
            };
            if first.is_empty() || first.len() as u64 >= size {
                return Ok((first.len() as u64 == size).then(|| first.to_vec()));
            }
            let parts: Vec<Option<Bytes>> = futures::stream::iter(1..chunks(size, first.len()))
                .map(|n| {
                    self.records
                        .get_owned(chunk_key(&name, &sha256, n))
                        .map(|r| r.map(|v| v.and_then(|v| v.value)))
                })
                .buffered(PARALLEL)
                .try_collect()
                .await?;
            let mut bytes = Vec::with_capacity(usize::try_from(size).unwrap_or(0));
            bytes.extend_from_slice(&first);
            for part in parts {
                let Some(part) = part else { return Ok(None) };
                bytes.extend_from_slice(&part);
            }
            Ok((bytes.len() as u64 == size).then_some(bytes))
        }
        .boxed()
    }

    fn stored_components(&self) -> BoxFuture<'_, Result<Vec<StoredComponent>, StoreError>> {
        async move {
            let mut found: std::collections::BTreeMap<(String, String), StoredComponent> =
                std::collections::BTreeMap::new();
            // Headers only: a sweep does not read the components' bytes.
            self.records
                .scan_with("hc", ScanFrom::Start, true, |r| {
                    let mut parts = r.key.splitn(4, '.');
                    if let (Some("hc"), Some(name), Some(sha), Some(_), true) = (
                        parts.next(),
                        parts.next(),
                        parts.next(),
                        parts.next(),
                        r.value.is_some(),
                    ) {
                        let c = found
                            .entry((name.to_owned(), sha.to_owned()))
                            .or_insert_with(|| StoredComponent {
                                name: name.to_owned(),
                                sha256: sha.to_owned(),
                                records: Vec::new(),
                                written_ms: 0,
                            });
                        c.records.push((r.key.clone(), r.revision));
                        c.written_ms = c.written_ms.max(r.published_ms);
                    }
                    true
                })
                .await?;
            Ok(found.into_values().collect())
        }
        .boxed()
    }

    fn remove_components(
        &self,
        components: Vec<StoredComponent>,
    ) -> BoxFuture<'_, Result<usize, StoreError>> {
        async move {
            let deletes = components
                .into_iter()
                .flat_map(|c| c.records)
                .filter(|(key, _)| key.starts_with("hc."))
                .map(|(key, revision)| Write::delete(key, Expect::Revision(revision)));
            // Each on its own: a chunk written again since its listing is kept, the rest go.
            futures::stream::iter(deletes)
                .map(|w| async move {
                    match self.records.commit(vec![w]).await {
                        Ok(_) => Ok(1),
                        Err(RecordsError::Conflict) => Ok(0),
                        Err(e) => Err(StoreError::from(e)),
                    }
                })
                .buffer_unordered(PARALLEL)
                .try_fold(0usize, |n, removed| async move { Ok(n + removed) })
                .await
        }
        .boxed()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunks_fit_the_servers_messages() {
        assert_eq!(chunk_size(8 << 20), CHUNK);
        assert_eq!(chunk_size(CHUNK + HEADROOM), CHUNK);
        assert_eq!(chunk_size(256 << 10), (256 << 10) - HEADROOM);
        assert_eq!(chunk_size(0), 1);
        assert_eq!(chunks(1_300_000, CHUNK), 3);
        assert_eq!(chunks(0, CHUNK), 0);
    }

    #[test]
    fn an_undecodable_contract_record_is_skipped_not_fatal() {
        let good = serde_json::to_vec(&SharedContract {
            ty: "t".into(),
            version: 2,
            text: "{}".into(),
            revision: 0,
        })
        .expect("json");
        let scanned = vec![
            ("ct.a".to_owned(), 3, Bytes::from_static(b"not a record")),
            ("ct.b".to_owned(), 7, Bytes::from(good)),
            (
                "ct.c".to_owned(),
                9,
                Bytes::from_static(b"{\"type\": \"t\"}"),
            ),
        ];
        let warned = Mutex::new(HashSet::new());
        let got = decode_contracts(scanned.clone(), &warned);
        assert_eq!(got.len(), 1, "{got:?}");
        assert_eq!(
            (got[0].ty.as_str(), got[0].version, got[0].revision),
            ("t", 2, 7)
        );
        assert_eq!(warned.lock().expect("lock").len(), 2);
        // The next read skips them again (warned about once).
        assert_eq!(decode_contracts(scanned, &warned).len(), 1);
        assert_eq!(warned.lock().expect("lock").len(), 2);
    }
}

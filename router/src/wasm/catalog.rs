//! Where every change to the uploaded handlers goes (upload, rollback, delete), and how the
//! nodes of a deployment that share one store keep the same handlers.
//!
//! On the embedded store a node is alone: its registry directory is the truth and changes go
//! straight to it. On a shared store ([`Store::handler_catalog`](crate::store::Store)), the
//! store's catalog is the truth: a change is validated here, written to the catalog by
//! compare-and-set (the component's bytes first, then the handler's index), and then applied
//! to this node's registry, so the API answers with the change in force here. Every node
//! follows the catalog ([`HandlerChanges::follow`]) and applies what changed, fetching the
//! active version's component when it does not have it; the others see a change within
//! [`SYNC_INTERVAL`] plus the time to compile it.
//!
//! Without this, an upload reached one node only: the others kept leasing that handler's
//! deliveries and spending their attempts on "not uploaded" until the entries went to the DLQ.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use bytes::Bytes;
use futures::future::BoxFuture;
use serde::Serialize;
use tokio_util::sync::CancellationToken;

use super::registry::{
    DeleteStep, Deletion, HandlerIndex, HandlerRegistry, RegistryError, UploadError, Uploader,
    Validated, VersionInfo, after_free, after_keep,
};
use crate::store::{HandlerCatalog, StoreError};
use crate::telemetry::Labels;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;

/// How often each node reads the catalog's indexes for changes made on other nodes.
pub const SYNC_INTERVAL: Duration = Duration::from_secs(2);

/// How often each node sweeps the catalog for components no handler's index names.
pub const SWEEP_INTERVAL: Duration = Duration::from_secs(600);

/// How long a component stays in the catalog after no index names it (a deleted handler's or
/// version's, or an upload's whose index write never landed): far longer than an upload takes
/// between writing its component and its index, and than the nodes' clocks differ.
pub const ORPHAN_GRACE_MS: i64 = 3_600_000;

/// Compare-and-set rounds a change tries before it gives up (other nodes changing the same
/// handler each time).
const MAX_ROUNDS: u32 = 8;

/// What `/v1/status` shows of the catalog: whether this node follows one, and how that goes.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct CatalogStatus {
    /// True when the handlers are shared through the store's catalog.
    pub shared: bool,
    /// The last complete read of the catalog, and failures since.
    #[serde(flatten)]
    pub health: crate::store::SyncHealth,
    /// Handlers whose catalog version could not be installed here, and why.
    pub handler_errors: std::collections::BTreeMap<String, String>,
}

/// What one sync did.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct SyncReport {
    /// Handlers installed or changed from the catalog.
    pub applied: Vec<String>,
    /// Handlers removed because the catalog says they were deleted.
    pub removed: Vec<String>,
    /// Handlers this node had that the catalog did not, published to it.
    pub published: Vec<String>,
}

/// See the module docs.
pub struct HandlerChanges {
    registry: Arc<HandlerRegistry>,
    catalog: Option<Arc<dyn HandlerCatalog>>,
    /// Serialises this node's changes (API calls and syncs), and holds the catalog revision
    /// each handler's record was last applied at here.
    applied: tokio::sync::Mutex<HashMap<String, u64>>,
    status: Mutex<CatalogStatus>,
    /// `router_handler_catalog_syncs`, by result.
    syncs: Family<Labels, Counter>,
    /// Where a handler's key-value entries and logs are, removed when its name is freed
    /// (`None`: the registry alone, in tests).
    data: Option<HandlerData>,
    /// Dead-letters the deliveries queued for a handler whose name is released (set once the
    /// delivery runtime exists, which is built after the handlers).
    released_queues: std::sync::OnceLock<Arc<dyn ReleasedQueues>>,
}

/// What a release does to the deliveries queued for the handler: moves them to the DLQ
/// (reason `handler_released`), so that none of them runs on the code of whichever team
/// claims the name next. Implemented by the delivery runtime (`app`), which knows the
/// handler's targets, counts the dead letters and announces them.
pub trait ReleasedQueues: Send + Sync {
    /// Moves every delivery queued for handler `name` to the DLQ, those leased now once they
    /// are back in their queue (at most `wait` for them). Returns how many moved, or why it
    /// failed (the release then stops with the name held, to be released again).
    fn dead_letter(&self, name: &str, wait: Duration) -> BoxFuture<'_, Result<u64, String>>;
}

/// What a handler leaves besides its versions: its key-value namespace on the store and this
/// node's logs of it.
pub struct HandlerData {
    /// The store holding the key-value entries.
    pub store: Arc<dyn crate::store::Store>,
    /// This node's handler logs.
    pub logs: Arc<super::HandlerLogs>,
    /// The longest an invocation runs (`handlers.timeout`, and a margin): how long freeing a
    /// name waits for those still running.
    pub drain: Duration,
}

impl std::fmt::Debug for HandlerChanges {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HandlerChanges")
            .field("shared", &self.catalog.is_some())
            .finish_non_exhaustive()
    }
}

fn now_rfc3339() -> String {
    chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Millis, true)
}

/// Runs blocking registry work (file I/O, compilation) off the reactor.
async fn blocking<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
    match tokio::task::spawn_blocking(f).await {
        Ok(v) => v,
        Err(e) => std::panic::resume_unwind(e.into_panic()),
    }
}

fn catalog_upload_error(e: StoreError) -> UploadError {
    UploadError::Catalog(e.to_string())
}

fn catalog_registry_error(e: StoreError) -> RegistryError {
    RegistryError::Catalog(e.to_string())
}

/// Why a catalog record could not be installed on this node.
#[derive(Debug)]
enum InstallError {
    /// The store or this node's disk failed: worth trying again next round.
    Unavailable(String),
    /// The record or its component is not usable: kept until the record changes.
    Invalid(String),
}

fn corrupt(name: &str, e: &serde_json::Error) -> StoreError {
    StoreError::Corrupt {
        table: "handler catalog",
        message: format!("index of {name:?}: {e}"),
    }
}

/// A short random wait before another compare-and-set round, growing with the round.
async fn back_off(round: u32) {
    let ms = rand::random_range(1..=(4u64 << round.min(6)));
    tokio::time::sleep(Duration::from_millis(ms)).await;
}

impl HandlerChanges {
    /// Changes go to `registry` alone (`catalog` `None`), or through `catalog` first.
    /// `syncs` counts the catalog reads and what they applied (`router_handler_catalog_syncs`).
    pub fn new(
        registry: Arc<HandlerRegistry>,
        catalog: Option<Arc<dyn HandlerCatalog>>,
        syncs: Family<Labels, Counter>,
    ) -> Self {
        let status = CatalogStatus {
            shared: catalog.is_some(),
            ..CatalogStatus::default()
        };
        Self {
            registry,
            catalog,
            applied: tokio::sync::Mutex::new(HashMap::new()),
            status: Mutex::new(status),
            syncs,
            data: None,
            released_queues: std::sync::OnceLock::new(),
        }
    }

    /// Wires what a release does to the handler's queued deliveries (once; later calls are
    /// ignored). Until it is wired, a release of a name with data is refused as busy.
    pub fn set_released_queues(&self, queues: Arc<dyn ReleasedQueues>) {
        let _ = self.released_queues.set(queues);
    }

    /// Changes that remove a handler's key-value entries and logs when its name is freed.
    #[must_use]
    pub fn with_data(mut self, data: HandlerData) -> Self {
        self.data = Some(data);
        self
    }

    /// The registry changes are applied to.
    pub fn registry(&self) -> &Arc<HandlerRegistry> {
        &self.registry
    }

    /// How following the catalog goes.
    pub fn status(&self) -> CatalogStatus {
        self.status
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// The catalog record of `name` as an index, with its revision (0 and an empty index when
    /// there is none).
    async fn read(
        catalog: &dyn HandlerCatalog,
        name: &str,
    ) -> Result<(u64, HandlerIndex), StoreError> {
        match catalog.index(name).await? {
            Some(rec) => Ok((
                rec.revision,
                HandlerIndex::from_bytes(&rec.index).map_err(|e| corrupt(name, &e))?,
            )),
            None => Ok((0, HandlerIndex::empty(name))),
        }
    }

    /// Validates `bytes` as handler `name` and, only if it passes, stores it as a new version
    /// (or re-activates the stored version with the same bytes) and activates it: everywhere
    /// when the handlers are shared.
    pub async fn upload(
        &self,
        name: &str,
        bytes: Bytes,
        uploader: impl Into<Uploader>,
    ) -> Result<VersionInfo, UploadError> {
        self.upload_holding(name, bytes, uploader, None).await
    }

    /// [`Self::upload`] holding `slot` (one of the API's upload slots) until the component's
    /// compilation has ended, whether or not this future is still awaited. A client that
    /// gives up drops the future, but not the compilation running on a blocking thread (nor,
    /// on this node alone, the commit after it): released with the future, the slot let any
    /// number of such compilations run at once, each holding its component and its compiler's
    /// memory (six 18 MB components took 1 GB).
    pub async fn upload_holding(
        &self,
        name: &str,
        bytes: Bytes,
        uploader: impl Into<Uploader>,
        slot: Option<tokio::sync::OwnedSemaphorePermit>,
    ) -> Result<VersionInfo, UploadError> {
        let uploader = uploader.into();
        let registry = self.registry.clone();
        let Some(catalog) = self.catalog.clone() else {
            let name = name.to_owned();
            return blocking(move || {
                let _slot = slot;
                registry.upload(&name, &bytes, uploader)
            })
            .await;
        };
        let (n, b) = (name.to_owned(), bytes.clone());
        let validated = blocking(move || {
            let _slot = slot;
            registry.validate(&n, &b)
        })
        .await?;
        catalog
            .put_component(name, validated.sha256(), bytes.clone())
            .await
            .map_err(catalog_upload_error)?;
        let mut applied = self.applied.lock().await;
        for round in 0..MAX_ROUNDS {
            let (revision, index) = Self::read(catalog.as_ref(), name)
                .await
                .map_err(catalog_upload_error)?;
            let (index, info) =
                index.with_upload(&validated, &uploader, self.registry.keep_versions())?;
            // A shutdown started while it compiled: it is not made live anywhere.
            if self.registry.is_closed() {
                return Err(UploadError::ShuttingDown);
            }
            let written = catalog
                .put_index(name, index.to_bytes().into(), revision)
                .await
                .map_err(catalog_upload_error)?;
            let Some(revision) = written else {
                back_off(round).await;
                continue;
            };
            let local = self
                .install_here(name, &info.sha256, bytes, index, validated)
                .await;
            self.applied_here(&mut applied, name, revision, local);
            tracing::info!(
                handler = name,
                version = info.version,
                revision,
                "handler upload written to the shared catalog"
            );
            return Ok(info);
        }
        Err(UploadError::Catalog(format!(
            "other nodes kept changing handler {name:?}; try again"
        )))
    }

    /// Activates an earlier version of `name` (a number, `v3`, or a hash prefix): everywhere
    /// when the handlers are shared. The version is loaded here before the change is written,
    /// so a version that no longer loads is refused rather than spread.
    pub async fn rollback(&self, name: &str, version: &str) -> Result<VersionInfo, RegistryError> {
        self.rollback_as(name, version, &Uploader::from("operator"))
            .await
    }

    /// [`Self::rollback`] by `who`: refused when another team owns the handler (checked on the
    /// catalog's record when shared, in the same round as the write).
    pub async fn rollback_as(
        &self,
        name: &str,
        version: &str,
        who: &Uploader,
    ) -> Result<VersionInfo, RegistryError> {
        let registry = self.registry.clone();
        let Some(catalog) = self.catalog.clone() else {
            let (name, version, who) = (name.to_owned(), version.to_owned(), who.clone());
            return blocking(move || registry.rollback_as(&name, &version, &who)).await;
        };
        if !super::valid_handler_name(name) {
            return Err(RegistryError::UnknownHandler(name.to_owned()));
        }
        let mut applied = self.applied.lock().await;
        for round in 0..MAX_ROUNDS {
            let (revision, index) = Self::read(catalog.as_ref(), name)
                .await
                .map_err(catalog_registry_error)?;
            if revision == 0 {
                return Err(RegistryError::UnknownHandler(name.to_owned()));
            }
            let (index, info) = index.with_active(version, who)?;
            let bytes = self.component(catalog.as_ref(), name, &info).await?;
            let (registry, n) = (self.registry.clone(), name.to_owned());
            let (validated, bytes) = blocking(move || {
                let validated = registry.validate(&n, &bytes);
                (validated, bytes)
            })
            .await;
            let validated = validated.map_err(|e| match e {
                // The version is fine; the router had no instance to check it with.
                UploadError::Busy(m) => RegistryError::Busy(m),
                e => RegistryError::Load {
                    name: name.to_owned(),
                    version: info.version,
                    message: e.to_string(),
                },
            })?;
            let written = catalog
                .put_index(name, index.to_bytes().into(), revision)
                .await
                .map_err(catalog_registry_error)?;
            let Some(revision) = written else {
                back_off(round).await;
                continue;
            };
            // This node may have fetched the version from the catalog just now: it keeps its
            // own copy, or a restart would find the active version's component missing.
            let local = self
                .install_here(name, &info.sha256, bytes, index, validated)
                .await;
            self.applied_here(&mut applied, name, revision, local);
            tracing::info!(
                handler = name,
                version = info.version,
                revision,
                "handler rollback written to the shared catalog"
            );
            return Ok(info);
        }
        Err(RegistryError::Catalog(format!(
            "other nodes kept changing handler {name:?}; try again"
        )))
    }

    /// Removes `name` and all its versions (everywhere when shared), as an operator. Returns
    /// whether it existed.
    pub async fn delete(&self, name: &str) -> Result<bool, RegistryError> {
        let deletion = self
            .delete_as(name, &Uploader::from("operator"), false)
            .await?;
        Ok(deletion != Deletion::Unknown)
    }

    /// [`HandlerRegistry::delete_as`] everywhere when shared (ownership checked on the
    /// catalog's record, in the same round as the write). Before a name is freed, the
    /// deliveries queued for the handler go to the DLQ as `handler_released`, and its
    /// key-value entries and this node's logs of it are removed (other nodes remove theirs
    /// when they apply the freed record), so the next team to claim the name starts with
    /// nothing of the last one's and never runs a delivery queued for it. All of that happens
    /// while the name is held (`DeleteStep::Hold`): a crash or failure half-way leaves it held,
    /// and releasing again finishes it.
    pub async fn delete_as(
        &self,
        name: &str,
        who: &Uploader,
        release: bool,
    ) -> Result<Deletion, RegistryError> {
        if !super::valid_handler_name(name) {
            return Ok(Deletion::Unknown);
        }
        if release && self.data.is_some() && self.released_queues.get().is_none() {
            return Err(RegistryError::Busy(
                "the delivery runtime is still starting; release the name again in a moment".into(),
            ));
        }
        // Invocations already running keep their handle; the entries are removed once they
        // are done.
        let running = self.registry.active(name).map(|h| Arc::downgrade(&h));
        let (before, changed) = self
            .delete_step(name, who, DeleteStep::first(release))
            .await?;
        // Whether this delete removed a live handler (a `Hold` on a deleted one's kept name
        // changes the record too).
        let deleted = changed && before.as_ref().is_some_and(|b| !b.deleted);
        match after_keep(before.as_ref(), deleted, release) {
            Ok(done) => Ok(done),
            Err(owner) => {
                self.forget_data(name, running).await?;
                let (_, freed) = self.delete_step(name, who, DeleteStep::Free).await?;
                Ok(after_free(deleted, freed, owner))
            }
        }
    }

    /// Removes what a handler named `name` left: the deliveries queued for it (to the DLQ),
    /// its key-value entries (on the store, shared or not) and this node's logs of it, once
    /// the invocations `running` here when it was deleted are done (at most
    /// `HandlerData::drain`) and their acks, which carry their key-value writes, committed.
    async fn forget_data(
        &self,
        name: &str,
        running: Option<std::sync::Weak<super::LoadedHandler>>,
    ) -> Result<(), RegistryError> {
        let Some(data) = &self.data else {
            return Ok(());
        };
        if let Some(running) = running {
            let deadline = tokio::time::Instant::now() + data.drain;
            while running.strong_count() > 0 && tokio::time::Instant::now() < deadline {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            // An invocation's ack is committed just after it lets go of the handle.
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        if let Some(queues) = self.released_queues.get() {
            let moved =
                queues
                    .dead_letter(name, data.drain)
                    .await
                    .map_err(|e| RegistryError::Store {
                        name: name.to_owned(),
                        message: format!("moving its queued deliveries to the DLQ failed: {e}"),
                    })?;
            if moved > 0 {
                tracing::warn!(
                    handler = name,
                    deliveries = moved,
                    "a released handler's queued deliveries moved to the DLQ as handler_released"
                );
            }
        }
        let removed = data
            .store
            .kv_clear(name)
            .await
            .map_err(|e| RegistryError::Store {
                name: name.to_owned(),
                message: format!("removing its key-value entries failed: {e}"),
            })?;
        let completed =
            data.store
                .completed_clear(name)
                .await
                .map_err(|e| RegistryError::Store {
                    name: name.to_owned(),
                    message: format!("removing its COMPLETED records failed: {e}"),
                })?;
        data.logs.forget(name)?;
        tracing::info!(
            handler = name,
            kv_entries = removed,
            completed_records = completed,
            "a freed handler name's key-value entries, COMPLETED records and logs removed"
        );
        Ok(())
    }

    /// One step of a delete: on the catalog's record when shared, else on this node's registry.
    /// Returns the record before it and whether the step changed it.
    async fn delete_step(
        &self,
        name: &str,
        who: &Uploader,
        step: DeleteStep,
    ) -> Result<(Option<HandlerIndex>, bool), RegistryError> {
        let registry = self.registry.clone();
        let Some(catalog) = self.catalog.clone() else {
            let (name, who) = (name.to_owned(), who.clone());
            return blocking(move || registry.delete_step(&name, &who, step)).await;
        };
        let mut applied = self.applied.lock().await;
        for round in 0..MAX_ROUNDS {
            let (revision, index) = Self::read(catalog.as_ref(), name)
                .await
                .map_err(catalog_registry_error)?;
            if revision == 0 {
                // Not shared yet (the next sync publishes it): this node's copy is the record.
                let (n, who) = (name.to_owned(), who.clone());
                return blocking(move || registry.delete_step(&n, &who, step)).await;
            }
            let Some(tombstone) = index.deleted_by(who, step)? else {
                // Already done on the catalog: this node's copy follows now rather than at
                // its next sync.
                if index.deleted && registry.index(name).is_some_and(|l| l != index) {
                    let local = index.clone();
                    let applied_local =
                        blocking(move || registry.apply(local, None).map(|_| ())).await;
                    self.applied_here(
                        &mut applied,
                        name,
                        revision,
                        applied_local.map_err(|e| e.to_string()),
                    );
                }
                return Ok((Some(index), false));
            };
            let written = catalog
                .put_index(name, tombstone.to_bytes().into(), revision)
                .await
                .map_err(catalog_registry_error)?;
            let Some(revision) = written else {
                back_off(round).await;
                continue;
            };
            // Its components stay in the catalog until a sweep finds them unnamed for
            // `ORPHAN_GRACE_MS` (`sweep_components`): removed now, they could take the chunks
            // of the same bytes uploaded again on another node meanwhile.
            let local = blocking(move || registry.apply(tombstone, None).map(|_| ())).await;
            self.applied_here(
                &mut applied,
                name,
                revision,
                local.map_err(|e| e.to_string()),
            );
            tracing::info!(
                handler = name,
                revision,
                ?step,
                "handler deletion written to the shared catalog"
            );
            return Ok((Some(index), true));
        }
        Err(RegistryError::Catalog(format!(
            "other nodes kept changing handler {name:?}; try again"
        )))
    }

    /// The bytes of `info`'s component: this node's copy, or the catalog's.
    /// The local half of an upload or rollback written to the catalog: keeps component `sha`
    /// of `name` on this node's disk (unless it has it) and makes `index` live here.
    async fn install_here(
        &self,
        name: &str,
        sha: &str,
        bytes: impl AsRef<[u8]> + Send + 'static,
        index: HandlerIndex,
        validated: Validated,
    ) -> Result<(), String> {
        let (registry, n, sha) = (self.registry.clone(), name.to_owned(), sha.to_owned());
        blocking(move || {
            // Kept when intact, else written again (a damaged copy would fail the version at
            // the next start).
            registry
                .store_component(&n, &sha, bytes.as_ref())
                .map_err(|e| e.to_string())?;
            registry
                .apply(index, Some(validated))
                .map(|_| ())
                .map_err(|e| e.to_string())
        })
        .await
    }

    async fn component(
        &self,
        catalog: &dyn HandlerCatalog,
        name: &str,
        info: &VersionInfo,
    ) -> Result<Vec<u8>, RegistryError> {
        let (registry, n, sha) = (self.registry.clone(), name.to_owned(), info.sha256.clone());
        if let Ok(bytes) = blocking(move || registry.component_bytes(&n, &sha)).await {
            return Ok(bytes);
        }
        catalog
            .component(name, &info.sha256, info.size)
            .await
            .map_err(catalog_registry_error)?
            .ok_or_else(|| RegistryError::Load {
                name: name.to_owned(),
                version: info.version,
                message: format!("the shared catalog has no component {}", info.sha256),
            })
    }

    /// Reads the catalog once and makes this node match it: handlers changed elsewhere are
    /// installed (their active component fetched when missing), deleted ones removed, and
    /// handlers only this node has (kept from before it shared a store) published. Does
    /// nothing when the handlers are not shared.
    pub async fn sync(&self) -> Result<SyncReport, StoreError> {
        let Some(catalog) = self.catalog.clone() else {
            return Ok(SyncReport::default());
        };
        let result = self.sync_with(catalog.as_ref()).await;
        let count = |result: &'static str, n: usize| {
            self.syncs
                .get_or_create(&vec![("result", result.to_string())])
                .inc_by(n as u64);
        };
        match &result {
            Ok(r) => {
                count("ok", 1);
                count("installed", r.applied.len());
                count("removed", r.removed.len());
                count("published", r.published.len());
            }
            Err(_) => count("error", 1),
        }
        let first_failure = self
            .status
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .health
            .record(&result, now_rfc3339());
        if let (true, Err(e)) = (first_failure, &result) {
            tracing::warn!(error = %e, "cannot read the shared handler catalog; handlers changed on other nodes are not applied here until it can");
        }
        result
    }

    async fn sync_with(&self, catalog: &dyn HandlerCatalog) -> Result<SyncReport, StoreError> {
        // The lock is taken before the read: a change this node writes meanwhile (it holds
        // the lock) would otherwise be undone by the older record read here, until the next
        // round.
        let mut applied = self.applied.lock().await;
        let records = catalog.indexes().await?;
        let mut report = SyncReport::default();
        let mut in_catalog = std::collections::HashSet::new();
        for rec in records {
            in_catalog.insert(rec.name.clone());
            if applied.get(&rec.name) == Some(&rec.revision) {
                continue;
            }
            let name = rec.name.clone();
            match self.install(catalog, &rec.name, &rec.index).await {
                Ok(Some(change)) => {
                    tracing::info!(handler = %name, revision = rec.revision, change, "handler change from the shared catalog applied");
                    if change == "removed" {
                        report.removed.push(name.clone());
                    } else {
                        report.applied.push(name.clone());
                    }
                    self.handler_error(&name, None);
                }
                Ok(None) => {
                    self.handler_error(&name, None);
                }
                Err(InstallError::Unavailable(e)) => {
                    // The store or this node's disk failed: nothing is marked, the next round
                    // tries again (fetching costs no compilation). Logged when it changes.
                    if self.handler_error(&name, Some(e.clone())) {
                        tracing::error!(handler = %name, revision = rec.revision, error = %e, "cannot install a handler from the shared catalog yet; retrying every round");
                    }
                    continue;
                }
                Err(InstallError::Invalid(e)) => {
                    tracing::error!(handler = %name, revision = rec.revision, error = %e, "cannot install a handler from the shared catalog");
                    self.handler_error(&name, Some(e));
                }
            }
            // Marked even when it failed to load: the failure is kept as the handler's
            // `load_error` and retried on the next change, not recompiled every interval.
            applied.insert(rec.name, rec.revision);
        }
        for local in self.registry.indexes() {
            if in_catalog.contains(&local.name) {
                continue;
            }
            if self.publish(catalog, local.clone()).await? {
                tracing::warn!(handler = %local.name, "a handler only this node had was published to the shared catalog");
                report.published.push(local.name);
            }
        }
        Ok(report)
    }

    /// Makes this node's copy of `name` match its catalog index. Returns what changed, if
    /// anything.
    async fn install(
        &self,
        catalog: &dyn HandlerCatalog,
        name: &str,
        bytes: &[u8],
    ) -> Result<Option<&'static str>, InstallError> {
        let invalid = |e: String| InstallError::Invalid(e);
        let unavailable = |e: String| InstallError::Unavailable(e);
        let index =
            HandlerIndex::from_bytes(bytes).map_err(|e| invalid(corrupt(name, &e).to_string()))?;
        if index.name != name {
            return Err(invalid(format!("its index names {:?}", index.name)));
        }
        let local = self.registry.index(name);
        if index.deleted {
            // A node that never had the handler needs no copy of the record: changes are
            // checked against the catalog's.
            if local.is_none() || local.as_ref() == Some(&index) {
                return Ok(None);
            }
            let freed = index.is_free();
            let registry = self.registry.clone();
            blocking(move || registry.apply(index, None))
                .await
                .map_err(|e| unavailable(e.to_string()))?;
            // The node that freed the name removed the key-value entries; the logs are each
            // node's own.
            if let (true, Some(data)) = (freed, &self.data) {
                data.logs
                    .forget(name)
                    .map_err(|e| unavailable(e.to_string()))?;
            }
            return Ok(Some("removed"));
        }
        if local.as_ref() == Some(&index) {
            return Ok(None);
        }
        let intact = |info: &VersionInfo| {
            let (registry, n, sha) = (self.registry.clone(), name.to_owned(), info.sha256.clone());
            // Reads and hashes the file: off the reactor.
            blocking(move || registry.has_component(&n, &sha))
        };
        if let Some(info) = index.active_version().cloned()
            && !intact(&info).await
        {
            // A missing component is retried too: its upload may still be writing it.
            let bytes = catalog
                .component(name, &info.sha256, info.size)
                .await
                .map_err(|e| unavailable(e.to_string()))?
                .ok_or_else(|| {
                    unavailable(format!(
                        "the shared catalog has no component {}",
                        info.sha256
                    ))
                })?;
            let (registry, n) = (self.registry.clone(), name.to_owned());
            blocking(move || registry.store_component(&n, &info.sha256, &bytes))
                .await
                .map_err(|e| match e.kind() {
                    // Bytes that do not match their hash do not get better by fetching again.
                    std::io::ErrorKind::InvalidData => invalid(e.to_string()),
                    _ => unavailable(e.to_string()),
                })?;
        }
        let registry = self.registry.clone();
        blocking(move || registry.apply(index, None))
            .await
            .map_err(|e| match e {
                RegistryError::Io(e) => unavailable(e.to_string()),
                e => invalid(e.to_string()),
            })?;
        Ok(Some(if local.is_some() {
            "changed"
        } else {
            "installed"
        }))
    }

    /// Publishes a handler this node has and the catalog has no record of: the components
    /// it still has, then its index, if no other node created one meanwhile.
    async fn publish(
        &self,
        catalog: &dyn HandlerCatalog,
        mut index: HandlerIndex,
    ) -> Result<bool, StoreError> {
        let mut kept = Vec::new();
        for v in std::mem::take(&mut index.versions) {
            let (registry, n, sha) = (self.registry.clone(), index.name.clone(), v.sha256.clone());
            match blocking(move || registry.component_bytes(&n, &sha)).await {
                Ok(bytes) => {
                    catalog
                        .put_component(&index.name, &v.sha256, bytes.into())
                        .await?;
                    kept.push(v);
                }
                Err(e) => {
                    tracing::warn!(handler = %index.name, version = v.version, error = %e, "a version without its component is left out of the shared catalog");
                }
            }
        }
        index.versions = kept;
        if index.active_version().is_none() {
            index.active = None;
        }
        Ok(catalog
            .put_index(&index.name, index.to_bytes().into(), 0)
            .await?
            .is_some())
    }

    /// Sets or clears `name`'s error in the status; returns whether it changed.
    fn handler_error(&self, name: &str, error: Option<String>) -> bool {
        let mut status = self.status.lock().unwrap_or_else(PoisonError::into_inner);
        match error {
            Some(e) => status.handler_errors.insert(name.to_owned(), e.clone()) != Some(e),
            None => status.handler_errors.remove(name).is_some(),
        }
    }

    /// After this node wrote a change to the catalog: marks it applied when this node's own
    /// copy took it too. When that failed (its disk), the change is still live everywhere
    /// else, so the API answers for it; the failure is shown per handler and the next sync
    /// applies it here.
    fn applied_here(
        &self,
        applied: &mut HashMap<String, u64>,
        name: &str,
        revision: u64,
        local: Result<(), String>,
    ) {
        match local {
            Ok(()) => {
                applied.insert(name.to_owned(), revision);
                self.handler_error(name, None);
            }
            Err(e) => {
                tracing::error!(handler = name, revision, error = %e, "a handler change written to the shared catalog could not be applied on this node; the next sync retries it");
                self.handler_error(name, Some(e));
            }
        }
    }

    /// Removes from the catalog the components that no handler's index names and that were
    /// written at least [`ORPHAN_GRACE_MS`] before `now_ms`: those of deleted handlers and
    /// versions, and of uploads whose index write never landed. A component written again
    /// since it was listed (the same bytes uploaded again) is kept. Returns how many records
    /// went.
    pub async fn sweep_components(&self, now_ms: i64) -> Result<usize, StoreError> {
        let Some(catalog) = &self.catalog else {
            return Ok(0);
        };
        // The indexes before the components: a component whose index is written after this
        // read was written after it too, well inside the grace.
        let mut named = std::collections::HashSet::new();
        let mut unreadable = std::collections::HashSet::new();
        for rec in catalog.indexes().await? {
            match HandlerIndex::from_bytes(&rec.index) {
                Ok(index) => named.extend(
                    index
                        .versions
                        .into_iter()
                        .map(|v| (rec.name.clone(), v.sha256)),
                ),
                // Not judged: what it names is unknown.
                Err(_) => {
                    unreadable.insert(rec.name);
                }
            }
        }
        let orphans: Vec<_> = catalog
            .stored_components()
            .await?
            .into_iter()
            .filter(|c| {
                !unreadable.contains(&c.name)
                    && !named.contains(&(c.name.clone(), c.sha256.clone()))
                    && now_ms.saturating_sub(c.written_ms) >= ORPHAN_GRACE_MS
            })
            .collect();
        if orphans.is_empty() {
            return Ok(0);
        }
        let which: Vec<String> = orphans
            .iter()
            .map(|c| format!("{}@{}", c.name, c.sha256))
            .collect();
        let removed = catalog.remove_components(orphans).await?;
        self.syncs
            .get_or_create(&vec![("result", "component_records_swept".to_string())])
            .inc_by(removed as u64);
        tracing::info!(components = ?which, records = removed, "components no handler names any more removed from the shared catalog");
        Ok(removed)
    }

    /// Syncs every [`SYNC_INTERVAL`], and sweeps every [`SWEEP_INTERVAL`], until `cancel`.
    pub async fn follow(self: Arc<Self>, cancel: CancellationToken) {
        if self.catalog.is_none() {
            return;
        }
        let mut last_sweep = tokio::time::Instant::now();
        loop {
            tokio::select! {
                () = cancel.cancelled() => return,
                () = tokio::time::sleep(SYNC_INTERVAL) => {}
            }
            // A failure is logged and shown in the status by `sync`; the next round retries.
            let _ = self.sync().await;
            if last_sweep.elapsed() >= SWEEP_INTERVAL {
                last_sweep = tokio::time::Instant::now();
                let now_ms = chrono::Utc::now().timestamp_millis();
                if let Err(e) = self.sweep_components(now_ms).await {
                    tracing::warn!(error = %e, "cannot sweep the shared handler catalog; the next sweep tries again");
                }
            }
        }
    }
}

//! Contract management API: list and show the live contracts, and put a contract version into
//! the contracts directory over HTTP. An upload is compiled, checked against the version it
//! replaces (an incompatible change to a version in use is refused: it needs a new version) and
//! compared with the version before it, then written into the watched directory and reloaded
//! like a change from git. Reading needs `read`; uploading needs `admin`.
//!
//! On a store several nodes share ([`Store::contract_catalog`](crate::store::Store)), an upload
//! is also recorded in the store once this node has reloaded with it, and every other node
//! writes it into its own contracts directory and reloads ([`SharedContracts`]), within
//! [`SYNC_INTERVAL`]. Each node remembers which upload its directory holds (in
//! `<data_dir>/contract-catalog.json`), so a restart does not write an upload again over a file
//! changed in git since; only a newer upload does.

use std::collections::{BTreeMap, HashMap};
use std::io::Write as _;
use std::path::{Path as FsPath, PathBuf};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};

use crate::app::App;
use crate::contract::{CompatIssue, ContractSet, compat_issues, parse_version};
use crate::event::FieldError;
use crate::ingest::error_response;
use crate::store::{ContractCatalog, SharedContract, StoreError};

/// Uploads run one at a time: each writes, reloads and, if the reload refuses the set, puts
/// the directory back as it was.
static UPLOADS: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// Longest event type accepted as a directory name.
const MAX_TYPE_LEN: usize = 200;

/// Why a type cannot name a contracts subdirectory, if it cannot.
fn type_problem(ty: &str) -> Option<&'static str> {
    if ty.is_empty() || ty.len() > MAX_TYPE_LEN {
        return Some("the type must be 1 to 200 bytes");
    }
    if ty.starts_with('.') {
        return Some("the type must not start with '.' (hidden names are not loaded)");
    }
    if ty.chars().any(|c| c == '/' || c == '\\' || c.is_control()) {
        return Some("the type must not contain '/', '\\' or control characters");
    }
    None
}

/// The type and version of a contract path, or the 400 saying what is wrong with them.
fn contract_path(ty: &str, version: &str) -> Result<u32, Box<Response>> {
    let mut errors = Vec::new();
    if let Some(why) = type_problem(ty) {
        errors.push(FieldError::new("/type", why));
    }
    let v = parse_version(version);
    if v.is_none() {
        errors.push(FieldError::new(
            "/version",
            "the version must be v<N> with N >= 1 and no leading zeros (e.g. v2)",
        ));
    }
    match v {
        Some(v) if errors.is_empty() => Ok(v),
        _ => Err(Box::new(error_response(
            StatusCode::BAD_REQUEST,
            "invalid contract path",
            errors,
        ))),
    }
}

/// Each incompatibility as an error located by its pointer into the new schema.
fn field_errors(issues: Vec<CompatIssue>) -> Vec<FieldError> {
    issues
        .into_iter()
        .map(|i| FieldError::new(i.pointer, i.message))
        .collect()
}

/// `GET /v1/contracts`: every live contract (without its schema) and its type's mode.
pub async fn list(State(app): State<Arc<App>>) -> Response {
    let set = app.contracts.load();
    let contracts: Vec<Value> = set
        .contracts()
        .into_iter()
        .map(|c| {
            json!({
                "type": c.ty,
                "version": c.version,
                "file": c.file,
                "mode": set.mode(&c.ty).as_str(),
            })
        })
        .collect();
    axum::Json(json!({
        "version": set.version(),
        "dir": app.cfg.contracts_dir.display().to_string(),
        "contracts": contracts,
    }))
    .into_response()
}

/// `GET /v1/contracts/{type}/{version}`: one live contract with its schema.
pub async fn show(
    State(app): State<Arc<App>>,
    Path((ty, version)): Path<(String, String)>,
) -> Response {
    let v = match contract_path(&ty, &version) {
        Ok(v) => v,
        Err(r) => return *r,
    };
    let set = app.contracts.load();
    match set.get(&ty, v) {
        Some(c) => axum::Json(json!({
            "type": c.ty,
            "version": c.version,
            "file": c.file,
            "mode": set.mode(&ty).as_str(),
            "schema": c.schema,
        }))
        .into_response(),
        None => error_response(
            StatusCode::NOT_FOUND,
            "no such contract",
            vec![FieldError::new(
                "/version",
                format!("no contract for type {ty:?} at v{v}"),
            )],
        ),
    }
}

/// `PUT /v1/contracts/{type}/{version}`: puts a JSON Schema for the `data` of that type and
/// version. 201 for a new version, 200 for a compatible change to a live one; 400 for a bad
/// path or body, 422 for a schema that does not compile, 409 for an incompatible change to a
/// live version or a directory that would not reload with the file (nothing changed then).
pub async fn upload(
    State(app): State<Arc<App>>,
    Path((ty, version)): Path<(String, String)>,
    body: axum::body::Bytes,
) -> Response {
    let v = match contract_path(&ty, &version) {
        Ok(v) => v,
        Err(r) => return *r,
    };
    let text = match std::str::from_utf8(&body) {
        Ok(t) => t,
        Err(e) => {
            return error_response(
                StatusCode::BAD_REQUEST,
                "the schema is not UTF-8",
                vec![FieldError::new("", e.to_string())],
            );
        }
    };
    let schema: Value = match serde_json::from_str(text) {
        Ok(s) => s,
        Err(e) => {
            return error_response(
                StatusCode::BAD_REQUEST,
                "the schema is not JSON",
                vec![FieldError::new("", e.to_string())],
            );
        }
    };
    let rel = format!("{ty}/v{v}.json");
    if let Err(diags) = ContractSet::from_files(&[(rel.as_str(), text)], None) {
        return error_response(
            StatusCode::UNPROCESSABLE_ENTITY,
            "the schema is not a valid contract",
            diags
                .iter()
                .map(|d| FieldError::new("", format!("line {}:{}: {}", d.line, d.col, d.message)))
                .collect(),
        );
    }

    let _one = UPLOADS.lock().await;
    let live = app.contracts.load_full();
    let replaced = live.get(&ty, v);
    if let Some(old) = &replaced {
        let issues = compat_issues(&old.schema, &schema);
        if !issues.is_empty() {
            let next = live.latest_version(&ty).unwrap_or(v).saturating_add(1);
            return error_response(
                StatusCode::CONFLICT,
                &format!("incompatible change to v{v}, which is live: publish it as v{next}"),
                field_errors(issues),
            );
        }
    }
    let (compared_with, breaking) = match live.previous(&ty, v) {
        Some((pv, prev)) => (
            Some(format!("v{pv}")),
            field_errors(compat_issues(&prev, &schema)),
        ),
        None => (None, Vec::new()),
    };

    let dir = app.cfg.contracts_dir.clone();
    let path = dir.join(&ty).join(format!("v{v}.json"));
    let contents = text.to_owned();
    let written = {
        let path = path.clone();
        tokio::task::spawn_blocking(move || write_contract(&path, &contents)).await
    };
    let before = match written {
        Ok(Ok(before)) => before,
        Ok(Err(e)) => return write_failed(&path, &e),
        Err(e) => return write_failed(&path, &std::io::Error::other(e.to_string())),
    };
    if let Err(e) = crate::app::reload(&app, "contract upload").await {
        let restored = {
            let path = path.clone();
            tokio::task::spawn_blocking(move || restore(&path, before)).await
        };
        if !matches!(restored, Ok(Ok(()))) {
            tracing::error!(file = %path.display(), "could not put the contracts directory back after a refused upload");
        }
        return error_response(
            StatusCode::CONFLICT,
            "the contracts directory did not reload with this file; nothing changed",
            e.to_string()
                .lines()
                .map(|l| FieldError::new("", l))
                .collect(),
        );
    }
    if let Some(shared) = &app.shared_contracts {
        let contract = SharedContract {
            ty: ty.clone(),
            version: v,
            text: text.to_owned(),
            revision: 0,
        };
        match shared.catalog.put_contract(contract).await {
            Ok(revision) => shared.mark(&rel, revision),
            Err(e) => {
                // The other nodes cannot have it: take it back here too.
                let restored = {
                    let path = path.clone();
                    tokio::task::spawn_blocking(move || restore(&path, before)).await
                };
                let reloaded = crate::app::reload(&app, "contract upload undone").await;
                if !matches!(restored, Ok(Ok(()))) || reloaded.is_err() {
                    tracing::error!(file = %path.display(), "could not put the contracts directory back after the shared catalog refused an upload");
                }
                tracing::error!(contract = %rel, error = %e, "contract upload refused: the shared catalog is unavailable");
                return crate::ingest::catalog_unavailable_response(
                    "the shared contract catalog is unavailable; nothing was changed",
                    e.to_string(),
                );
            }
        }
    }
    tracing::info!(contract = %rel, replaced = replaced.is_some(), "contract uploaded");
    let set = app.contracts.load();
    let status = if replaced.is_some() {
        StatusCode::OK
    } else {
        StatusCode::CREATED
    };
    (
        status,
        axum::Json(json!({
            "type": ty,
            "version": v,
            "file": rel,
            "mode": set.mode(&ty).as_str(),
            "replaced": replaced.is_some(),
            "contracts_version": set.version(),
            "compared_with": compared_with,
            "breaking_changes": breaking,
        })),
    )
        .into_response()
}

/// How often each node reads the shared contracts for uploads made on other nodes.
pub const SYNC_INTERVAL: Duration = Duration::from_secs(2);

/// How long a shared contract that this node's directory refused waits before it is tried
/// again (the refusal may come from something else in the directory, fixed meanwhile).
const RETRY_REFUSED: Duration = Duration::from_secs(60);

/// What `/v1/status` shows of the shared contracts.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct ContractCatalogStatus {
    /// The last complete read of the shared contracts, and failures since.
    #[serde(flatten)]
    pub health: crate::store::SyncHealth,
    /// Uploads this node's directory could not take (`<type>/v<N>.json`), and why.
    pub contract_errors: BTreeMap<String, String>,
}

/// Contracts put over the API on a store several nodes share (see the module docs).
pub struct SharedContracts {
    catalog: Arc<dyn ContractCatalog>,
    /// Per `<type>/v<N>.json`: the revision of the upload this node's directory holds.
    applied: Mutex<BTreeMap<String, u64>>,
    /// Where `applied` is kept across restarts.
    path: PathBuf,
    /// Refused uploads and when to try them again.
    retry_at: Mutex<HashMap<String, Instant>>,
    status: Mutex<ContractCatalogStatus>,
}

impl std::fmt::Debug for SharedContracts {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SharedContracts")
            .field("path", &self.path)
            .finish_non_exhaustive()
    }
}

impl SharedContracts {
    /// Follows `catalog`, remembering what was applied in `<data_dir>/contract-catalog.json`
    /// (a missing or unreadable file means nothing applied yet: every upload is compared with
    /// the directory again, and written where it differs).
    pub fn open(catalog: Arc<dyn ContractCatalog>, data_dir: &FsPath) -> Self {
        let path = data_dir.join("contract-catalog.json");
        let applied = std::fs::read(&path)
            .ok()
            .and_then(|b| serde_json::from_slice(&b).ok())
            .unwrap_or_default();
        Self {
            catalog,
            applied: Mutex::new(applied),
            path,
            retry_at: Mutex::new(HashMap::new()),
            status: Mutex::new(ContractCatalogStatus::default()),
        }
    }

    /// How following the shared contracts goes.
    pub fn status(&self) -> ContractCatalogStatus {
        self.status
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    fn applied(&self, rel: &str) -> u64 {
        self.applied
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get(rel)
            .copied()
            .unwrap_or(0)
    }

    /// Records that this node's directory holds upload `revision` of `rel`, and keeps that
    /// on disk (a failure to keep it only means the upload is compared again after a restart).
    fn mark(&self, rel: &str, revision: u64) {
        let json = {
            let mut applied = self.applied.lock().unwrap_or_else(PoisonError::into_inner);
            applied.insert(rel.to_owned(), revision);
            serde_json::to_vec_pretty(&*applied).unwrap_or_default()
        };
        if let Err(e) = replace_file(&self.path, &json) {
            tracing::warn!(file = %self.path.display(), error = %e, "cannot keep which shared contracts this node applied");
        }
        self.contract_error(rel, None);
    }

    fn contract_error(&self, rel: &str, error: Option<String>) {
        let mut status = self.status.lock().unwrap_or_else(PoisonError::into_inner);
        match error {
            Some(e) => {
                status.contract_errors.insert(rel.to_owned(), e);
            }
            None => {
                status.contract_errors.remove(rel);
            }
        }
    }

    /// Reads the shared contracts once and writes the uploads this node does not have yet into
    /// its contracts directory, then reloads. If the directory does not reload with them, they
    /// are taken out again (the live set never changed) and tried again after
    /// [`RETRY_REFUSED`]; `/v1/status` says why meanwhile. Returns the files written.
    pub async fn sync(&self, app: &Arc<App>) -> Result<Vec<String>, StoreError> {
        let result = self.sync_with(app).await;
        let first_failure = self
            .status
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .health
            .record(&result, crate::clock::rfc3339(app.clock.now_ms()));
        if let (true, Err(e)) = (first_failure, &result) {
            tracing::warn!(error = %e, "cannot read the shared contracts; uploads made on other nodes are not applied here until it can");
        }
        result
    }

    async fn sync_with(&self, app: &Arc<App>) -> Result<Vec<String>, StoreError> {
        let uploads = self.catalog.contracts().await?;
        let _one = UPLOADS.lock().await;
        let now = Instant::now();
        let mut written = Vec::new();
        for c in uploads {
            let rel = format!("{}/v{}.json", c.ty, c.version);
            if self.applied(&rel) >= c.revision
                || self
                    .retry_at
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .get(&rel)
                    .is_some_and(|at| *at > now)
            {
                continue;
            }
            if let Some(why) = type_problem(&c.ty) {
                self.contract_error(&rel, Some(why.to_owned()));
                continue;
            }
            let path = app
                .cfg
                .contracts_dir
                .join(&c.ty)
                .join(format!("v{}.json", c.version));
            let text = c.text.clone();
            let p = path.clone();
            let outcome = tokio::task::spawn_blocking(move || {
                if std::fs::read(&p).is_ok_and(|b| b == text.as_bytes()) {
                    return Ok(None);
                }
                write_contract(&p, &text).map(Some)
            })
            .await
            .unwrap_or_else(|e| Err(std::io::Error::other(e.to_string())));
            match outcome {
                Ok(None) => self.mark(&rel, c.revision),
                Ok(Some(before)) => written.push((rel, path, before, c.revision)),
                Err(e) => {
                    tracing::error!(file = %path.display(), error = %e, "cannot write a shared contract");
                    self.contract_error(&rel, Some(format!("cannot write it: {e}")));
                }
            }
        }
        if written.is_empty() {
            return Ok(Vec::new());
        }
        match crate::app::reload(app, "shared contract").await {
            Ok(_) => {
                let mut files = Vec::new();
                for (rel, _, _, revision) in written {
                    tracing::info!(contract = %rel, revision, "contract uploaded on another node applied");
                    self.mark(&rel, revision);
                    files.push(rel);
                }
                Ok(files)
            }
            Err(e) => {
                for (rel, path, before, _) in written.into_iter().rev() {
                    let p = path.clone();
                    let restored = tokio::task::spawn_blocking(move || restore(&p, before)).await;
                    if !matches!(restored, Ok(Ok(()))) {
                        tracing::error!(file = %path.display(), "could not take a refused shared contract out of the directory");
                    }
                    tracing::error!(contract = %rel, error = %e, "this node's contracts directory does not reload with a contract uploaded on another node");
                    self.contract_error(
                        &rel,
                        Some(format!(
                            "this node's directory does not reload with it: {e}"
                        )),
                    );
                    self.retry_at
                        .lock()
                        .unwrap_or_else(PoisonError::into_inner)
                        .insert(rel, now + RETRY_REFUSED);
                }
                Ok(Vec::new())
            }
        }
    }
}

/// Applies the shared contracts at once and then every [`SYNC_INTERVAL`], until `cancel`.
pub async fn follow(app: Arc<App>, cancel: tokio_util::sync::CancellationToken) {
    let Some(shared) = app.shared_contracts.clone() else {
        return;
    };
    loop {
        // A failure is logged and shown in the status by `sync`; the next round retries.
        let _ = shared.sync(&app).await;
        tokio::select! {
            () = cancel.cancelled() => return,
            () = tokio::time::sleep(SYNC_INTERVAL) => {}
        }
    }
}

fn write_failed(path: &FsPath, e: &std::io::Error) -> Response {
    tracing::error!(file = %path.display(), error = %e, "writing an uploaded contract failed");
    error_response(
        StatusCode::INTERNAL_SERVER_ERROR,
        "the contract could not be written (details are in the router's log)",
        Vec::new(),
    )
}

/// Writes `contents` to `path` by a synced temporary file renamed over it (hidden, so a reload
/// in between never reads half a file). Returns what was there before, to restore.
fn write_contract(path: &FsPath, contents: &str) -> std::io::Result<Option<Vec<u8>>> {
    let dir = path.parent().map(FsPath::to_path_buf).unwrap_or_default();
    std::fs::create_dir_all(&dir)?;
    let before = match std::fs::read(path) {
        Ok(b) => Some(b),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
        Err(e) => return Err(e),
    };
    replace_file(path, contents.as_bytes())?;
    Ok(before)
}

/// Puts back what `write_contract` replaced (or removes the new file).
fn restore(path: &FsPath, before: Option<Vec<u8>>) -> std::io::Result<()> {
    match before {
        Some(b) => replace_file(path, &b),
        None => std::fs::remove_file(path),
    }
}

fn replace_file(path: &FsPath, bytes: &[u8]) -> std::io::Result<()> {
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let tmp: PathBuf = path.with_file_name(format!(".{name}.upload"));
    let mut f = std::fs::File::create(&tmp)?;
    f.write_all(bytes)?;
    f.sync_all()?;
    drop(f);
    std::fs::rename(&tmp, path)?;
    if let Some(dir) = path.parent() {
        std::fs::File::open(dir)?.sync_all()?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn types_are_single_visible_path_segments() {
        assert_eq!(type_problem("order.created"), None);
        assert_eq!(type_problem("com.example:order-paid_v2"), None);
        for bad in ["", ".", "..", ".hidden", "a/b", "a\\b", "a\nb"] {
            assert!(type_problem(bad).is_some(), "{bad:?}");
        }
        assert!(type_problem(&"t".repeat(201)).is_some());
    }

    #[test]
    fn versions_are_named_as_the_files() {
        assert_eq!(parse_version("v1"), Some(1));
        assert_eq!(parse_version("v12"), Some(12));
        for bad in ["1", "v0", "v01", "v", "v1.json", "v-1", "v99999999999"] {
            assert_eq!(parse_version(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn a_refused_upload_puts_the_directory_back() {
        let dir = tempfile::tempdir().expect("tempdir");
        let fresh = dir.path().join("t").join("v1.json");
        assert_eq!(write_contract(&fresh, "{}").expect("write"), None);
        restore(&fresh, None).expect("restore");
        assert!(!fresh.exists(), "a new file is removed again");

        std::fs::write(&fresh, "{\"type\": \"object\"}").expect("seed");
        let before = write_contract(&fresh, "{}").expect("write");
        assert_eq!(std::fs::read_to_string(&fresh).expect("read"), "{}");
        restore(&fresh, before).expect("restore");
        assert_eq!(
            std::fs::read_to_string(&fresh).expect("read"),
            "{\"type\": \"object\"}"
        );
        let left: Vec<_> = std::fs::read_dir(fresh.parent().expect("dir"))
            .expect("list")
            .filter_map(Result::ok)
            .map(|e| e.file_name())
            .collect();
        assert_eq!(left.len(), 1, "no temporary file is left: {left:?}");
    }
}

//! Contract management API: list and show the live contracts, and put a contract version into
//! the contracts directory over HTTP. An upload is compiled, checked against the version it
//! replaces (an incompatible change to a version in use is refused: it needs a new version) and
//! compared with the version before it, then written into the watched directory and reloaded
//! like a change from git. Reading needs `read`; uploading needs `admin`.
//!
//! On a store several nodes share ([`Store::contract_catalog`](crate::store::Store)), the
//! store's catalog is the truth: an upload is first checked against this node's directory
//! without making it live (the directory as it would be with the file must load), then
//! recorded in the store, and only then written into this node's directory and reloaded. So a
//! refusal (the store cannot take it) changes nothing anywhere, and once the store took it,
//! the upload stands: a failure to apply it here is shown per contract and made good by the
//! next sync. Every other node writes it into its own directory and reloads
//! ([`SharedContracts`]), within [`SYNC_INTERVAL`]. Each node remembers which upload its
//! directory holds (in `<data_dir>/contract-catalog.json`), so a restart does not write an
//! upload again over a file changed in git since; only a newer upload does.

use std::collections::{BTreeMap, HashMap};
use std::io::Write as _;
use std::path::{Path as FsPath, PathBuf};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};

use crate::app::{App, ReloadError};
use crate::contract::{
    CompatIssue, ContractSet, MAX_VERSION, compat_issues, in_place_issues, parse_version,
    publish_as, strip_bom,
};
use crate::event::FieldError;
use crate::ingest::error_response;
use crate::store::{ContractCatalog, SharedContract, StoreError};

/// Uploads and syncs run one at a time: each changes the directory and reloads, and takes its
/// files back out when the reload refuses them.
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
            format!(
                "the version must be v<N> with N from 1 to {MAX_VERSION} (the dataversions an event can carry) and no leading zeros (e.g. v2)"
            ),
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
/// An upload compared with the live versions of its type.
struct Comparison {
    /// The live version it replaces, if any.
    replaced: Option<crate::contract::ContractInfo>,
    /// What it breaks of the version it replaces (409 when not empty).
    in_place: Vec<FieldError>,
    /// The version before it (`v<N>`), which `breaking` is against.
    compared_with: Option<String>,
    /// What it breaks for producers moving up from the version before.
    breaking: Vec<FieldError>,
    /// The version after it, and what that one breaks against it.
    next: Option<(u32, Vec<FieldError>)>,
}

impl Comparison {
    fn against(live: &ContractSet, ty: &str, v: u32, schema: &Value) -> Self {
        let replaced = live.get(ty, v);
        let in_place = replaced
            .as_ref()
            .map(|old| field_errors(in_place_issues(&old.schema, schema)))
            .unwrap_or_default();
        if !in_place.is_empty() {
            // Refused: the rest would not be answered.
            return Comparison {
                replaced,
                in_place,
                compared_with: None,
                breaking: Vec::new(),
                next: None,
            };
        }
        let (compared_with, breaking) = match live.previous(ty, v) {
            Some((pv, prev)) => (
                Some(format!("v{pv}")),
                field_errors(compat_issues(&prev, schema)),
            ),
            None => (None, Vec::new()),
        };
        // An upload between two versions is also the version the next one now follows; the
        // chain stays compatible only if the next one accepts what this one does.
        let next = live
            .next(ty, v)
            .map(|(nv, next_schema)| (nv, field_errors(compat_issues(schema, &next_schema))));
        Comparison {
            replaced,
            in_place,
            compared_with,
            breaking,
            next,
        }
    }
}

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
/// live version or a directory that would not reload with the file, 503 when the store fails
/// (nothing changed after any of these).
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
    // Kept as sent (the directory's file is then the committed one, byte for byte); parsed
    // without a byte-order mark, as the directory loads it.
    let schema: Value = match serde_json::from_str(strip_bom(text)) {
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
    // Compiling a schema is CPU work (a large one takes a while): off the async workers.
    let (check_rel, check_text) = (rel.clone(), text.to_owned());
    let compiled = tokio::task::spawn_blocking(move || {
        ContractSet::from_files(&[(check_rel.as_str(), check_text.as_str())], None).map(drop)
    })
    .await;
    let compiled = match compiled {
        Ok(r) => r,
        Err(e) => {
            tracing::error!(contract = %rel, error = %e, "compiling an uploaded contract failed");
            return error_response(
                StatusCode::INTERNAL_SERVER_ERROR,
                "the contract could not be checked (details are in the router's log)",
                Vec::new(),
            );
        }
    };
    if let Err(diags) = compiled {
        return error_response(
            StatusCode::UNPROCESSABLE_ENTITY,
            "the schema is not a valid contract",
            diags
                .iter()
                .map(|d| {
                    FieldError::new(
                        d.pointer.clone(),
                        format!("line {}:{}: {}", d.line, d.col, d.message),
                    )
                })
                .collect(),
        );
    }

    let _one = UPLOADS.lock().await;
    let live = app.contracts.load_full();
    // Comparing schemas is CPU work too (seconds for a schema of thousands of properties):
    // off the async workers, like the compile.
    let compared = {
        let (live, ty) = (Arc::clone(&live), ty.clone());
        tokio::task::spawn_blocking(move || Comparison::against(&live, &ty, v, &schema)).await
    };
    let Comparison {
        replaced,
        in_place,
        compared_with,
        breaking,
        next,
    } = match compared {
        Ok(c) => c,
        Err(e) => {
            tracing::error!(contract = %rel, error = %e, "comparing an uploaded contract failed");
            return error_response(
                StatusCode::INTERNAL_SERVER_ERROR,
                "the contract could not be checked (details are in the router's log)",
                Vec::new(),
            );
        }
    };
    if !in_place.is_empty() {
        let publish = publish_as(live.latest_version(&ty).unwrap_or(v));
        return error_response(
            StatusCode::CONFLICT,
            &format!("incompatible change to v{v}, which is live: {publish}"),
            in_place,
        );
    }

    let path = app.cfg.contracts_dir.join(&ty).join(format!("v{v}.json"));
    let placed = match &app.shared_contracts {
        None => place_here(&app, &path, text)
            .await
            .map(|rules_error| (None, rules_error)),
        Some(shared) => {
            let contract = SharedContract {
                ty: ty.clone(),
                version: v,
                text: text.to_owned(),
                revision: 0,
            };
            place_shared(&app, shared, &rel, &path, contract).await
        }
    };
    let (local_error, rules_error) = match placed {
        Ok(placed) => placed,
        Err(refused) => return *refused,
    };
    tracing::info!(contract = %rel, replaced = replaced.is_some(), applied_here = local_error.is_none(), "contract uploaded");
    let set = app.contracts.load();
    let status = if replaced.is_some() {
        StatusCode::OK
    } else {
        StatusCode::CREATED
    };
    let mut answer = json!({
        "type": ty,
        "version": v,
        "file": rel,
        "mode": set.mode(&ty).as_str(),
        "replaced": replaced.is_some(),
        "contracts_version": set.version(),
        "compared_with": compared_with,
        "breaking_changes": breaking,
    });
    if let Some((nv, issues)) = next {
        answer["next_version"] = json!(format!("v{nv}"));
        answer["next_breaking_changes"] = json!(issues);
    }
    if let Some(e) = local_error {
        answer["local_error"] = json!(e);
    }
    if let Some(e) = rules_error {
        answer["rules_error"] = json!(e);
    }
    (status, axum::Json(answer)).into_response()
}

/// The embedded store: this node's directory is the truth. Writes the file and reloads,
/// putting the directory back when the reload refuses it.
/// `Ok(Some(why))`: the contract is live, but the rules did not reload with it (a broken rule
/// file, which no longer holds contract changes back).
async fn place_here(
    app: &Arc<App>,
    path: &FsPath,
    text: &str,
) -> Result<Option<String>, Box<Response>> {
    let before = write_blocking(path, text)
        .await
        .map_err(|e| Box::new(write_failed(path, &e)))?;
    match crate::app::reload(app, "contract upload").await {
        Ok(_) => Ok(None),
        Err(ReloadError::RulesRefused(why)) => Ok(Some(why.join("; "))),
        Err(e) => {
            if restore_blocking(path, before).await.is_err() {
                tracing::error!(file = %path.display(), "could not put the contracts directory back after a refused upload");
            }
            Err(Box::new(reload_refused(&e)))
        }
    }
}

/// A store several nodes share: checks that this node would reload with the upload (its rules
/// and its contracts directory with the file, loaded without making them live), records it in
/// the store, then writes and reloads it here.
/// `Err` is the answer when nothing changed anywhere; `Ok((Some(why), _))` when the store took
/// the upload but this node's directory did not (the next sync applies it here); `Ok((_,
/// Some(why)))` when it is live here but the rules did not reload with it.
async fn place_shared(
    app: &Arc<App>,
    shared: &SharedContracts,
    rel: &str,
    path: &FsPath,
    contract: SharedContract,
) -> Result<(Option<String>, Option<String>), Box<Response>> {
    // A dry run of the contracts' reload (the rules reload apart: a broken rule file does
    // not hold a contract back).
    let text = contract.text.clone();
    let (cfg, r, t) = (app.cfg.clone(), rel.to_owned(), text.clone());
    let checked = tokio::task::spawn_blocking(move || {
        crate::app::load_contracts_with(&cfg, &[(r.as_str(), t.as_str())]).map(|_| ())
    })
    .await;
    match checked {
        Ok(Ok(())) => {}
        Ok(Err(e)) => {
            return Err(Box::new(reload_refused(&ReloadError::Invalid(
                e.problems(),
            ))));
        }
        Err(e) => {
            tracing::error!(contract = %rel, error = %e, "checking an uploaded contract failed");
            return Err(Box::new(error_response(
                StatusCode::INTERNAL_SERVER_ERROR,
                "the contract could not be checked (details are in the router's log)",
                Vec::new(),
            )));
        }
    }
    let revision = match shared.catalog.put_contract(contract).await {
        Ok(revision) => revision,
        Err(e) => {
            // Not in force anywhere yet; but a write that timed out may still reach the store
            // once it is back, and then applies everywhere (the client is told to send it
            // again, which is harmless either way).
            tracing::error!(contract = %rel, error = %e, "contract upload refused: the shared catalog is unavailable");
            return Err(Box::new(crate::ingest::catalog_unavailable_response(
                "the shared contract catalog is unavailable; the upload is not in force (send it again)",
                e.to_string(),
            )));
        }
    };
    // The upload stands from here on: what fails now is this node's copy only, and is not
    // undone in the store.
    let local = match write_blocking(path, &text).await {
        Err(e) => Err(format!("cannot write it: {e}")),
        Ok(before) => match crate::app::reload(app, "contract upload").await {
            Ok(_) => Ok(None),
            Err(ReloadError::RulesRefused(why)) => Ok(Some(why.join("; "))),
            Err(e) => {
                // Taken back out, so the directory keeps matching the live set; the next
                // sync writes it again and reloads.
                if restore_blocking(path, before).await.is_err() {
                    tracing::error!(file = %path.display(), "could not take a contract this node did not reload with out of the directory");
                }
                Err(format!("this node's directory did not reload with it: {e}"))
            }
        },
    };
    match local {
        Ok(rules_error) => {
            shared.mark(rel, revision);
            shared.keep_applied().await;
            Ok((None, rules_error))
        }
        Err(why) => {
            tracing::error!(contract = %rel, revision, error = %why, "a contract upload written to the shared catalog could not be applied on this node; the next sync retries it");
            shared.contract_error(rel, Some(why.clone()));
            Ok((Some(why), None))
        }
    }
}

/// The answer to an upload whose reload was refused (the file was put back, the live
/// contracts are unchanged; the rules reload apart, and went live if they loaded): 409 when
/// the directory does not load with it, 503 with `Retry-After` when the store failed (the file
/// is not at fault; trying again later may work).
fn reload_refused(e: &ReloadError) -> Response {
    match e {
        ReloadError::Invalid(msg)
        | ReloadError::RulesRefused(msg)
        | ReloadError::ContractsRefused(msg) => error_response(
            StatusCode::CONFLICT,
            "the contracts directory did not reload with this file; it was taken out and the live contracts are unchanged",
            super::problems_as_errors(msg),
        ),
        ReloadError::Store(e) => {
            tracing::error!(error = %e, "contract upload refused: the store failed during the reload");
            crate::ingest::catalog_unavailable_response(
                "the store could not take the reload; nothing was changed",
                e.to_string(),
            )
        }
    }
}

/// How often each node reads the shared contracts for uploads made on other nodes.
pub const SYNC_INTERVAL: Duration = Duration::from_secs(2);

/// How long a shared contract that this node's directory refused waits before it is tried
/// again (the refusal may come from something else in the directory, fixed meanwhile).
const RETRY_REFUSED: Duration = Duration::from_secs(60);

/// How long a starting node waits for its first sync of the shared contracts before it serves
/// (the store's requests are bounded by `store.jetstream.timeout`, 5 s by default, so this
/// only cuts short a store that hangs).
pub const FIRST_SYNC_WAIT: Duration = Duration::from_secs(10);

/// An upload this node does not try again until a newer one replaces it (`revision`), or
/// until `until`.
#[derive(Debug, Clone, Copy)]
struct Hold {
    revision: u64,
    until: Option<Instant>,
}

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
    /// Per `<type>/v<N>.json`: a refused upload, held back until a newer one or a set time.
    held: Mutex<HashMap<String, Hold>>,
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
            held: Mutex::new(HashMap::new()),
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

    /// Records that this node's directory holds upload `revision` of `rel` (kept on disk by
    /// the next [`Self::keep_applied`]).
    fn mark(&self, rel: &str, revision: u64) {
        self.applied
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(rel.to_owned(), revision);
        self.contract_error(rel, None);
    }

    /// Writes which uploads this node's directory holds to disk, off the reactor (a failure
    /// only means the uploads are compared again after a restart). Called under `UPLOADS`, so
    /// a later snapshot is never overwritten by an earlier one.
    async fn keep_applied(&self) {
        let json = serde_json::to_vec_pretty(
            &*self.applied.lock().unwrap_or_else(PoisonError::into_inner),
        )
        .unwrap_or_default();
        let path = self.path.clone();
        let kept = tokio::task::spawn_blocking(move || replace_file(&path, &json))
            .await
            .unwrap_or_else(|e| Err(std::io::Error::other(e.to_string())));
        if let Err(e) = kept {
            tracing::warn!(file = %self.path.display(), error = %e, "cannot keep which shared contracts this node applied");
        }
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

    /// Whether upload `revision` of `rel` is held back at `now`.
    fn held(&self, rel: &str, revision: u64, now: Instant) -> bool {
        self.held
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get(rel)
            .is_some_and(|h| h.revision == revision && h.until.is_none_or(|at| at > now))
    }

    /// Holds upload `revision` of `rel` back (see [`Hold`]). Returns false when it already
    /// was held back for good (so its refusal was logged already).
    fn hold(&self, rel: &str, revision: u64, until: Option<Instant>) -> bool {
        let before = self
            .held
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(rel.to_owned(), Hold { revision, until });
        !before.is_some_and(|h| h.revision == revision && h.until.is_none())
    }

    /// Reads the shared contracts once and writes the uploads this node does not have yet into
    /// its contracts directory, then reloads. If the directory does not load with them, they
    /// are taken out again (the live set never changed) and tried again after
    /// [`RETRY_REFUSED`], or sooner when a newer upload replaces them; `/v1/status` says why
    /// meanwhile. If the store fails during the reload, they are taken out too and the error is
    /// returned: the files are not at fault, and the next round tries again. Returns the files
    /// applied.
    pub async fn sync(&self, app: &Arc<App>) -> Result<Vec<String>, StoreError> {
        let result = self.sync_with(app).await;
        let first_failure = self
            .status
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .health
            .record(&result, crate::clock::rfc3339(app.clock.now_ms()));
        if let (true, Err(e)) = (first_failure, &result) {
            tracing::warn!(error = %e, "cannot follow the shared contracts (the store failed); uploads made on other nodes are not applied here until it can");
        }
        result
    }

    async fn sync_with(&self, app: &Arc<App>) -> Result<Vec<String>, StoreError> {
        let uploads = self.catalog.contracts().await?;
        let _one = UPLOADS.lock().await;
        let now = Instant::now();
        let live = app.contracts.load_full();
        let mut written = Vec::new();
        let mut marked = false;
        for c in uploads {
            let rel = format!("{}/v{}.json", c.ty, c.version);
            if self.applied(&rel) >= c.revision || self.held(&rel, c.revision, now) {
                continue;
            }
            if let Some(why) = record_problem(&c) {
                // No node can load it: held back until a newer upload replaces it.
                if self.hold(&rel, c.revision, None) {
                    tracing::error!(contract = %rel, revision = c.revision, problem = why, "a shared contract record is refused");
                }
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
                Ok(None) if live_holds(&live, &c) => {
                    self.mark(&rel, c.revision);
                    marked = true;
                }
                // In the directory but not live (a reload refused or failed since it was
                // written): reloaded with the others; taking it back out rewrites it as is.
                Ok(None) => written.push((rel, path, Some(c.text.into_bytes()), c.revision)),
                Ok(Some(before)) => written.push((rel, path, before, c.revision)),
                Err(e) => {
                    tracing::error!(file = %path.display(), error = %e, "cannot write a shared contract");
                    self.contract_error(&rel, Some(format!("cannot write it: {e}")));
                }
            }
        }
        if marked {
            self.keep_applied().await;
        }
        if written.is_empty() {
            return Ok(Vec::new());
        }
        let refused = match crate::app::reload(app, "shared contract").await {
            // The contracts went live; the rules' refusal is theirs, shown in the status.
            Ok(_) | Err(ReloadError::RulesRefused(_)) => {
                let mut files = Vec::new();
                for (rel, _, _, revision) in written {
                    tracing::info!(contract = %rel, revision, "contract uploaded on another node applied");
                    self.mark(&rel, revision);
                    files.push(rel);
                }
                self.keep_applied().await;
                return Ok(files);
            }
            Err(e) => e,
        };
        // The live set never changed: the directory is made to match it again.
        for (_, path, before, _) in written.iter().rev() {
            if restore_blocking(path, before.clone()).await.is_err() {
                tracing::error!(file = %path.display(), "could not take a shared contract this node did not reload with out of the directory");
            }
        }
        match refused {
            // Not the files' fault: no lock-out, and the round's failure is the store's.
            ReloadError::Store(e) => Err(e),
            // (Answered above: the contracts went live.)
            e @ (ReloadError::Invalid(_)
            | ReloadError::RulesRefused(_)
            | ReloadError::ContractsRefused(_)) => {
                for (rel, _, _, revision) in written {
                    tracing::error!(contract = %rel, revision, error = %e, "this node's contracts directory does not reload with a contract uploaded on another node");
                    self.contract_error(
                        &rel,
                        Some(format!(
                            "this node's directory does not reload with it: {e}"
                        )),
                    );
                    self.hold(&rel, revision, Some(now + RETRY_REFUSED));
                }
                Ok(Vec::new())
            }
        }
    }
}

/// Why a shared contract record cannot be a file of any node's contracts directory, if it
/// cannot (a record written by another program or a newer node; an upload is checked).
fn record_problem(c: &SharedContract) -> Option<&'static str> {
    if c.version == 0 || c.version > MAX_VERSION {
        return Some(
            "the version must be from 1 to 2147483647 (the dataversions an event can carry)",
        );
    }
    type_problem(&c.ty)
}

/// Whether `set` holds `c` as uploaded (the same schema at its type and version).
fn live_holds(set: &ContractSet, c: &SharedContract) -> bool {
    set.get(&c.ty, c.version).is_some_and(|live| {
        serde_json::from_str::<Value>(strip_bom(&c.text))
            .is_ok_and(|uploaded| uploaded == live.schema)
    })
}

/// Applies the shared contracts at once and then every [`SYNC_INTERVAL`], until `cancel`.
/// `first_sync` is told once the first round has ended (whatever its outcome): a starting
/// node waits for it before it serves.
pub async fn follow(
    app: Arc<App>,
    cancel: tokio_util::sync::CancellationToken,
    first_sync: tokio::sync::oneshot::Sender<()>,
) {
    let Some(shared) = app.shared_contracts.clone() else {
        return;
    };
    let mut first_sync = Some(first_sync);
    loop {
        // A failure is logged and shown in the status by `sync`; the next round retries.
        let _ = shared.sync(&app).await;
        if let Some(tx) = first_sync.take() {
            let _ = tx.send(());
        }
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

/// [`write_contract`] off the reactor.
async fn write_blocking(path: &FsPath, contents: &str) -> std::io::Result<Option<Vec<u8>>> {
    let (path, contents) = (path.to_path_buf(), contents.to_owned());
    tokio::task::spawn_blocking(move || write_contract(&path, &contents))
        .await
        .unwrap_or_else(|e| Err(std::io::Error::other(e.to_string())))
}

/// [`restore`] off the reactor.
async fn restore_blocking(path: &FsPath, before: Option<Vec<u8>>) -> std::io::Result<()> {
    let path = path.to_path_buf();
    tokio::task::spawn_blocking(move || restore(&path, before))
        .await
        .unwrap_or_else(|e| Err(std::io::Error::other(e.to_string())))
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
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

    use futures::future::BoxFuture;

    use crate::store::fault::SimulatedDisk;
    use crate::store::{RedbStore, StoreOptions};

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
        // Bounded to the dataversions ingest accepts (a CloudEvents Integer): a contract
        // above them could never apply.
        assert_eq!(parse_version("v2147483647"), Some(2_147_483_647));
        for too_high in ["v2147483648", "v4294967295", "v4294967296"] {
            assert_eq!(parse_version(too_high), None, "{too_high:?}");
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

    /// The contracts the nodes share, in memory: a put can fail (the store is down), and can
    /// take the store under the node down with it (an outage that reaches both).
    #[derive(Default)]
    struct FakeCatalog {
        records: Mutex<Vec<SharedContract>>,
        revisions: AtomicU64,
        down: AtomicBool,
        /// Made failing by a put refused while `down`.
        disk_of_failed_put: Mutex<Option<SimulatedDisk>>,
    }

    impl FakeCatalog {
        /// Records `text` as type `t` version `version`, as an upload on another node would.
        fn put(&self, version: u32, text: &str) -> u64 {
            let revision = self.revisions.fetch_add(1, Ordering::SeqCst) + 1;
            let mut records = self.records.lock().expect("records");
            records.retain(|c| c.version != version);
            records.push(SharedContract {
                ty: "t".into(),
                version,
                text: text.into(),
                revision,
            });
            revision
        }
    }

    impl ContractCatalog for FakeCatalog {
        fn contracts(&self) -> BoxFuture<'_, Result<Vec<SharedContract>, StoreError>> {
            Box::pin(async move {
                if self.down.load(Ordering::SeqCst) {
                    return Err(StoreError::Backend("the catalog is down".into()));
                }
                Ok(self.records.lock().expect("records").clone())
            })
        }

        fn put_contract(&self, c: SharedContract) -> BoxFuture<'_, Result<u64, StoreError>> {
            Box::pin(async move {
                if self.down.load(Ordering::SeqCst) {
                    if let Some(disk) = &*self.disk_of_failed_put.lock().expect("disk") {
                        disk.set_failing(true);
                    }
                    return Err(StoreError::Backend("the catalog is down".into()));
                }
                assert_eq!(c.ty, "t", "the tests upload type t only");
                Ok(self.put(c.version, &c.text))
            })
        }
    }

    const V1: &str = r#"{"type": "object", "required": ["y"]}"#;
    const V2: &str = r#"{"type": "object", "required": ["z"]}"#;

    /// A node with one rule (so a reload saves a target configuration in the store), contract
    /// `t/v1.json`, its store on a disk that can be made to fail, and the shared catalog when
    /// `shared`.
    struct Node {
        dir: tempfile::TempDir,
        app: Arc<App>,
        disk: SimulatedDisk,
        catalog: Arc<FakeCatalog>,
    }

    impl Node {
        fn start(shared: bool) -> Self {
            let dir = tempfile::tempdir().expect("tempdir");
            let cfg = crate::app::test_config(dir.path());
            std::fs::create_dir_all(cfg.contracts_dir.join("t")).expect("contracts dir");
            std::fs::write(cfg.contracts_dir.join("t/v1.json"), V1).expect("v1");
            let disk = SimulatedDisk::new();
            let d = disk.clone();
            let store =
                RedbStore::with_backend_factory(move || d.backend(), StoreOptions::default())
                    .expect("store");
            let catalog = Arc::new(FakeCatalog::default());
            let shared = shared.then(|| {
                Arc::new(SharedContracts::open(
                    catalog.clone() as Arc<dyn ContractCatalog>,
                    &cfg.data_dir,
                ))
            });
            let app = crate::app::test_app(cfg, store, shared);
            Self {
                dir,
                app,
                disk,
                catalog,
            }
        }

        fn shared(&self) -> &SharedContracts {
            self.app.shared_contracts.as_deref().expect("shared")
        }

        fn file(&self, version: u32) -> PathBuf {
            self.dir.path().join(format!("contracts/t/v{version}.json"))
        }

        fn live(&self, version: u32) -> bool {
            self.app.contracts.load().get("t", version).is_some()
        }

        /// `PUT /v1/contracts/t/v{version}`: the status, `Retry-After` and body.
        async fn put(&self, version: u32, text: &str) -> (StatusCode, Option<String>, Value) {
            let resp = upload(
                State(self.app.clone()),
                Path(("t".to_owned(), format!("v{version}"))),
                axum::body::Bytes::from(text.to_owned()),
            )
            .await;
            let status = resp.status();
            let retry_after = resp
                .headers()
                .get("retry-after")
                .and_then(|v| v.to_str().ok())
                .map(str::to_owned);
            let body = axum::body::to_bytes(resp.into_body(), usize::MAX)
                .await
                .expect("body");
            (
                status,
                retry_after,
                serde_json::from_slice(&body).unwrap_or(Value::Null),
            )
        }

        /// Syncs until a round applies something (the store reopens its file after the failed
        /// commits of a test's outage, within a few rounds; 10 s is generous).
        async fn sync_until_applied(&self) -> Vec<String> {
            let deadline = Instant::now() + Duration::from_secs(10);
            loop {
                match self.shared().sync(&self.app).await {
                    Ok(files) if !files.is_empty() => return files,
                    other => assert!(Instant::now() < deadline, "never applied: {other:?}"),
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }

    /// The store goes down as the upload reaches it: the answer is 503 and, as it says,
    /// nothing changed here either (before, the file was already live here, and taking it
    /// back failed on the store too: the node kept a contract no other node had).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_upload_the_shared_store_refuses_changes_nothing_here() {
        let node = Node::start(true);
        node.catalog.down.store(true, Ordering::SeqCst);
        *node.catalog.disk_of_failed_put.lock().expect("disk") = Some(node.disk.clone());
        let (status, retry_after, body) = node.put(2, V2).await;
        assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{body}");
        assert!(retry_after.is_some(), "503 carries Retry-After");
        assert!(!node.live(2), "a refused upload went live here");
        assert!(
            !node.file(2).exists(),
            "a refused upload stayed in the directory"
        );
        assert!(node.catalog.records.lock().expect("records").is_empty());
    }

    /// A node whose contracts would not reload with the upload (another contract is broken)
    /// refuses it before the store hears of it: no other node gets a contract this one cannot
    /// hold. A broken rule file does not: rules reload apart, and the contract goes live
    /// (shared, and here), the answer saying the rules were refused.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_upload_this_node_cannot_reload_with_is_not_shared() {
        let broken = "contracts/t/v3.json";
        let node = Node::start(true);
        std::fs::write(node.dir.path().join(broken), r#"{"type": 5"#).expect("from git");
        let (status, _, body) = node.put(2, V2).await;
        assert_eq!(status, StatusCode::CONFLICT, "{broken}: {body}");
        assert!(
            body["errors"].to_string().contains(broken),
            "{broken}: {body}"
        );
        assert!(node.catalog.records.lock().expect("records").is_empty());
        assert!(!node.file(2).exists());
        assert!(!node.live(2));

        let node = Node::start(true);
        std::fs::write(node.dir.path().join("rules/broken.yaml"), r#"{"type": 5"#)
            .expect("from git");
        let (status, _, body) = node.put(2, V2).await;
        assert_eq!(status, StatusCode::CREATED, "{body}");
        assert!(
            body["rules_error"]
                .as_str()
                .is_some_and(|e| e.contains("broken.yaml")),
            "{body}"
        );
        assert_eq!(node.catalog.records.lock().expect("records").len(), 1);
        assert!(node.live(2));
    }

    /// A store that fails during the upload's reload is the store's fault, not the file's: 503
    /// with `Retry-After`, not 409 (on the embedded store the file is put back; on a shared
    /// one the catalog refuses first).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_store_failing_during_an_upload_answers_503() {
        for shared in [false, true] {
            let node = Node::start(shared);
            node.disk.set_failing(true);
            node.catalog.down.store(true, Ordering::SeqCst);
            let (status, retry_after, body) = node.put(2, V2).await;
            assert_eq!(
                status,
                StatusCode::SERVICE_UNAVAILABLE,
                "shared: {shared}: {body}"
            );
            assert!(retry_after.is_some(), "shared: {shared}: no Retry-After");
            assert!(!node.live(2), "shared: {shared}");
            assert!(!node.file(2).exists(), "shared: {shared}");
        }
        // The embedded store as before otherwise: written and live at once.
        let node = Node::start(false);
        let (status, _, body) = node.put(2, V2).await;
        assert_eq!(status, StatusCode::CREATED, "{body}");
        assert!(node.live(2) && node.file(2).exists());
        assert!(body.get("local_error").is_none(), "{body}");
    }

    /// Once the shared store took an upload it stands: when only this node's reload fails,
    /// the answer is a success that says so, `/v1/status` shows it, and the next sync applies
    /// it here.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_upload_the_store_took_stands_when_only_this_node_fails() {
        let node = Node::start(true);
        node.disk.set_failing(true);
        let (status, _, body) = node.put(2, V2).await;
        assert_eq!(status, StatusCode::CREATED, "{body}");
        assert!(body["local_error"].is_string(), "{body}");
        assert_eq!(node.catalog.records.lock().expect("records").len(), 1);
        assert!(!node.live(2));
        assert!(
            !node.file(2).exists(),
            "the directory keeps matching the live set"
        );
        assert!(
            node.shared()
                .status()
                .contract_errors
                .contains_key("t/v2.json"),
            "{:?}",
            node.shared().status()
        );
        node.disk.set_failing(false);
        assert_eq!(node.sync_until_applied().await, vec!["t/v2.json"]);
        assert!(node.live(2) && node.file(2).exists());
        assert!(node.shared().status().contract_errors.is_empty());
    }

    /// A store failing during a sync's reload fails the round (shown as the catalog's health)
    /// without blaming the files: they are taken out, not held back, and applied as soon as
    /// the store works again.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_store_failing_during_a_sync_is_not_blamed_on_the_files() {
        let node = Node::start(true);
        node.catalog.put(2, V2);
        node.disk.set_failing(true);
        let e = node.shared().sync(&node.app).await;
        assert!(e.is_err(), "{e:?}");
        let status = node.shared().status();
        assert!(status.health.error.is_some(), "{status:?}");
        assert!(status.contract_errors.is_empty(), "{status:?}");
        assert!(!node.file(2).exists() && !node.live(2));
        node.disk.set_failing(false);
        assert_eq!(node.sync_until_applied().await, vec!["t/v2.json"]);
        assert!(node.live(2));
        assert!(node.shared().status().health.error.is_none());
    }

    /// An upload this node's directory refused is held back for a while, but a newer upload
    /// of the same file (the fix) is not.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_corrected_upload_is_not_held_back_by_the_refused_one() {
        let node = Node::start(true);
        node.catalog.put(2, r#"{"type": 5}"#);
        assert_eq!(
            node.shared().sync(&node.app).await.expect("sync"),
            Vec::<String>::new()
        );
        assert!(!node.file(2).exists());
        assert!(
            node.shared()
                .status()
                .contract_errors
                .contains_key("t/v2.json")
        );
        node.catalog.put(2, V2);
        assert_eq!(
            node.shared().sync(&node.app).await.expect("sync"),
            vec!["t/v2.json"]
        );
        assert!(node.live(2));
        assert!(node.shared().status().contract_errors.is_empty());
    }

    /// A record no node could load (version 0) is refused once, not written and reloaded
    /// every minute.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_record_of_version_zero_is_refused_without_a_reload() {
        let node = Node::start(true);
        assert_eq!(node.catalog.put(0, V2), 1);
        for _ in 0..2 {
            assert!(
                node.shared()
                    .sync(&node.app)
                    .await
                    .expect("sync")
                    .is_empty()
            );
        }
        assert!(!node.file(0).exists());
        let reloads = node.app.reload_status.lock().expect("status").clone();
        assert_eq!((reloads.reloads, reloads.failed_reloads), (0, 0));
        assert!(
            node.shared()
                .status()
                .contract_errors
                .contains_key("t/v0.json")
        );
        assert!(node.shared().held("t/v0.json", 1, Instant::now()));
    }
}

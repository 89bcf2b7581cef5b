//! Handler management API: upload (validated before it activates), list, show, rollback,
//! delete, logs. Every route needs `handlers:<name>` for that handler (or `admin`; reading one
//! also `read`), checked by the auth layer before the body is read (`auth::Need::Handler`);
//! listing all handlers needs `read`. Changes and logs are the owning team's (or an
//! administrator's) besides: a `handlers:` glob covering another team's handler opens neither.

use std::sync::Arc;

use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use serde_json::json;

use crate::app::App;
use crate::auth::Principal;
use crate::event::FieldError;
use crate::ingest::error_response;
use crate::wasm::{Deletion, RegistryError, UploadError};

/// `Retry-After` of an upload refused past the disk high-water mark (as ingest's).
const DISK_FULL_RETRY_AFTER_S: u64 = crate::ingest::DISK_FULL_RETRY_AFTER_S;
/// `Retry-After` of an upload whose component or index could not be written.
const STORE_RETRY_AFTER_S: u64 = crate::ingest::STORE_RETRY_AFTER_S;

fn runtime(app: &App) -> Result<&Arc<crate::target::handler::HandlerRuntime>, Box<Response>> {
    app.handlers.as_ref().ok_or_else(|| {
        Box::new(error_response(
            StatusCode::SERVICE_UNAVAILABLE,
            "the WASM handler runtime is not available",
            Vec::new(),
        ))
    })
}

/// `Retry-After` of an upload or rollback refused while every instance that checks uploads
/// is in use (each check is bounded by the handler timeout).
const UPLOAD_BUSY_RETRY_AFTER_S: u64 = 5;

fn registry_error(who: &Principal, name: &str, e: RegistryError) -> Response {
    if matches!(e, RegistryError::Catalog(_)) {
        return catalog_unavailable(name, &e);
    }
    if matches!(e, RegistryError::Store { .. }) {
        tracing::error!(handler = %name, error = %e, "freeing a handler name failed; the name stays kept");
        return crate::ingest::catalog_unavailable_response(
            "the handler's queued deliveries or key-value entries could not be removed, so its name stays kept; try again",
            e.to_string(),
        );
    }
    if let RegistryError::OwnedByAnotherTeam(e) = &e {
        return owned_elsewhere(who, e);
    }
    if matches!(e, RegistryError::ShuttingDown) {
        return shutting_down(&e);
    }
    if let RegistryError::Busy(why) = &e {
        return crate::ingest::with_retry_after(
            error_response(
                StatusCode::SERVICE_UNAVAILABLE,
                "the router is busy checking other uploads; nothing was changed",
                vec![FieldError::new("", why.clone())],
            ),
            UPLOAD_BUSY_RETRY_AFTER_S,
        );
    }
    let status = match &e {
        RegistryError::UnknownHandler(_) | RegistryError::UnknownVersion { .. } => {
            StatusCode::NOT_FOUND
        }
        RegistryError::AmbiguousVersion(_) | RegistryError::InvalidVersion(_) => {
            StatusCode::BAD_REQUEST
        }
        RegistryError::CorruptIndex { .. } => StatusCode::CONFLICT,
        _ => StatusCode::INTERNAL_SERVER_ERROR,
    };
    if status == StatusCode::INTERNAL_SERVER_ERROR {
        tracing::error!(error = %e, "handler registry failure");
    }
    // The version asked for is the request body's `version`.
    let pointer = match &e {
        RegistryError::AmbiguousVersion(_)
        | RegistryError::InvalidVersion(_)
        | RegistryError::UnknownVersion { .. } => "/version",
        _ => "",
    };
    error_response(
        status,
        "handler operation failed",
        vec![FieldError::new(pointer, e.to_string())],
    )
}

/// `PUT /v1/handlers/{name}`: the body is the component. Compiled and validated (world,
/// `describe`, name) before it becomes active; 400 with why otherwise.
pub async fn upload(
    State(app): State<Arc<App>>,
    axum::Extension(who): axum::Extension<Principal>,
    Path(name): Path<String>,
    crate::admin::ApiQuery(q): crate::admin::ApiQuery<UploadQuery>,
    slot: Option<axum::Extension<crate::app::UploadSlot>>,
    body: axum::body::Bytes,
) -> Response {
    // Checked before the body was read too (`refuse_upload_early`); again here, with the
    // index as it is now.
    if let Some(refused) = upload_refused(&app, &who, &name, q.team.as_deref(), None) {
        return refused;
    }
    let rt = match runtime(&app) {
        Ok(rt) => rt.clone(),
        Err(r) => return *r,
    };
    let mut uploader = who.uploader();
    uploader.for_team = q.team;
    // Bytes of a version already stored create nothing: they re-activate it (or leave it
    // active), answered 200 rather than 201.
    let stored: Vec<String> = rt
        .registry
        .get(&name)
        .map(|info| info.versions.into_iter().map(|v| v.sha256).collect())
        .unwrap_or_default();
    // The upload slot goes with the compilation, which outlives this request when the client
    // gives up (`HandlerChanges::upload_holding`).
    let slot = slot.and_then(|s| s.take());
    match rt.changes.upload_holding(&name, body, uploader, slot).await {
        Ok(v) if stored.contains(&v.sha256) => {
            tracing::warn!(handler = %name, version = v.version, sha256 = %v.sha256, uploader = %who.name, "handler upload matched a stored version, which is active");
            (StatusCode::OK, axum::Json(json!(v))).into_response()
        }
        Ok(v) => {
            tracing::warn!(handler = %name, version = v.version, sha256 = %v.sha256, uploader = %who.name, "handler uploaded and activated");
            (StatusCode::CREATED, axum::Json(json!(v))).into_response()
        }
        Err(UploadError::InvalidName(_)) => invalid_name(&name),
        Err(UploadError::Io(e)) => {
            // Nothing was activated: a full or failing disk, which may pass.
            tracing::error!(handler = %name, error = %e, "storing a handler failed");
            crate::ingest::with_retry_after(
                error_response(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "cannot store the handler; nothing was changed",
                    Vec::new(),
                ),
                STORE_RETRY_AFTER_S,
            )
        }
        Err(e @ UploadError::Catalog(_)) => catalog_unavailable(&name, &e),
        Err(e @ UploadError::ShuttingDown) => shutting_down(&e),
        Err(UploadError::OwnedByAnotherTeam(e)) => owned_elsewhere(&who, &e),
        // Every instance that checks uploads was in use: the component was not judged.
        Err(UploadError::Busy(why)) => {
            tracing::warn!(handler = %name, reason = %why, "handler upload refused: no instance free to check it");
            crate::ingest::with_retry_after(
                error_response(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "the router is busy checking other uploads; nothing was changed",
                    vec![FieldError::new("", why)],
                ),
                UPLOAD_BUSY_RETRY_AFTER_S,
            )
        }
        // This node cannot read the handler's index (written by a newer router, or damaged):
        // writing over it would lose what it holds.
        Err(e @ UploadError::UnreadableIndex(_)) => error_response(
            StatusCode::CONFLICT,
            "this node cannot read the handler's index; nothing was changed",
            vec![FieldError::new("", e.to_string())],
        ),
        Err(e) => error_response(
            StatusCode::BAD_REQUEST,
            "invalid handler",
            vec![FieldError::new("", e.to_string())],
        ),
    }
}

/// Why an upload of `name` by `who` (for `team`, declaring a body of `declared_len` bytes) is
/// refused, from its path, token, query and headers alone: `None` when it may go on.
///
/// `app::bounded_body` asks before the upload waits for one of the upload slots or its body is
/// read ([`refuse_upload_early`]): a token that the owner check refuses, or a body declared
/// past `handlers.max_upload_bytes`, was otherwise answered only once its body had arrived,
/// so any `handlers:` token could hold both slots for a request timeout, and a declared 70 MB
/// body waited out that timeout for a 408 instead of an immediate 413. The route asks again
/// once it has the body (the index may have changed meanwhile; the index write checks once
/// more).
pub(crate) fn upload_refused(
    app: &App,
    who: &Principal,
    name: &str,
    team: Option<&str>,
    declared_len: Option<u64>,
) -> Option<Response> {
    if !crate::wasm::valid_handler_name(name) {
        return Some(invalid_name(name));
    }
    if let Some(team) = team {
        // Only an administrator uploads a handler for a team; a team token's handlers are its
        // own.
        if !who.allows(&crate::auth::Scope::Admin) {
            return Some(error_response(
                StatusCode::FORBIDDEN,
                "only an administrator uploads a handler for a team",
                vec![FieldError::new(
                    "/team",
                    format!(
                        "token {:?} uploads for its own team {:?}",
                        who.name, who.team
                    ),
                )],
            ));
        }
        if team.is_empty() {
            return Some(error_response(
                StatusCode::BAD_REQUEST,
                "invalid team",
                vec![FieldError::new("/team", "must not be empty")],
            ));
        }
    }
    let rt = match runtime(app) {
        Ok(rt) => rt,
        Err(r) => return Some(*r),
    };
    if let Err(r) = owner_check(rt, who, name) {
        return Some(*r);
    }
    let limit = app.cfg.handlers.max_upload_bytes;
    if declared_len.is_some_and(|n| n > limit as u64) {
        return Some(upload_too_large(limit));
    }
    if app.disk_full.load(std::sync::atomic::Ordering::Relaxed) {
        // The disk the store needs to drain its queues is not spent on new components.
        return Some(crate::ingest::with_retry_after(
            error_response(
                StatusCode::SERVICE_UNAVAILABLE,
                "the store is past its disk high-water mark; handler uploads resume below its low-water mark",
                Vec::new(),
            ),
            DISK_FULL_RETRY_AFTER_S,
        ));
    }
    None
}

/// The 413 for a component past `handlers.max_upload_bytes` (`limit`): it names the key, so
/// the team knows what to ask its operator to raise (ingest's text named neither).
pub(crate) fn upload_too_large(limit: usize) -> Response {
    error_response(
        StatusCode::PAYLOAD_TOO_LARGE,
        "handler component too large",
        vec![FieldError::new(
            "",
            format!(
                "the component exceeds the upload limit of {limit} bytes (handlers.max_upload_bytes); a smaller build (release profile, opt-level \"s\", strip = true) or a higher limit lets it in"
            ),
        )],
    )
}

/// The 400 for a handler name that is not one, in the shape the auth layer gives a
/// percent-encoded one (`invalid handler name`, pointer `/name`).
fn invalid_name(name: &str) -> Response {
    error_response(
        StatusCode::BAD_REQUEST,
        "invalid handler name",
        vec![FieldError::new(
            "/name",
            UploadError::InvalidName(name.to_owned()).to_string(),
        )],
    )
}

/// [`upload_refused`] for an upload request whose body is not read yet (the auth layer has
/// put its principal in the request).
pub(crate) fn refuse_upload_early(app: &App, req: &axum::extract::Request) -> Option<Response> {
    let who = req.extensions().get::<Principal>()?;
    // `/v1/handlers/{name}`, as the auth layer reads it.
    let name = req.uri().path().split('/').nth(3).unwrap_or_default();
    let team = req.uri().query().and_then(|q| {
        form_urlencoded::parse(q.as_bytes())
            .find(|(k, _)| k == "team")
            .map(|(_, v)| v.into_owned())
    });
    let declared_len = crate::ingest::declared_length(req.headers());
    upload_refused(app, who, name, team.as_deref(), declared_len)
}

/// The 403 for a change to a handler another team owns: the API's 403 shape (the token, and
/// what it would need: to be of the owner's team, or an administrator).
fn owned_elsewhere(who: &Principal, e: &crate::wasm::OwnedByAnotherTeam) -> Response {
    tracing::warn!(token = %who.name, team = %who.team, error = %e, "handler change refused: another team owns it");
    error_response(
        StatusCode::FORBIDDEN,
        "out of scope",
        vec![FieldError::new(
            "/authorization",
            format!("token {:?} (team {:?}): {e}", who.name, who.team),
        )],
    )
}

/// Checks before compiling an upload that `who` may change handler `name` (its team owns it,
/// or `who` is an administrator), from this node's copy of its index; the index write checks
/// again, on the catalog's record when shared.
fn owner_check(
    rt: &crate::target::handler::HandlerRuntime,
    who: &Principal,
    name: &str,
) -> Result<(), Box<Response>> {
    let Some(index) = rt.registry.index(name) else {
        return Ok(());
    };
    index
        .check_owner(&who.uploader())
        .map_err(|e| Box::new(owned_elsewhere(who, &e)))
}

/// `Retry-After` of a change refused because the router is stopping: another node (or this
/// one, restarted) takes it.
const SHUTTING_DOWN_RETRY_AFTER_S: u64 = 5;

/// 503 with a `Retry-After`: the router is stopping, nothing changed.
fn shutting_down(e: &dyn std::fmt::Display) -> Response {
    crate::ingest::with_retry_after(
        error_response(
            StatusCode::SERVICE_UNAVAILABLE,
            "the router is shutting down; nothing was changed",
            vec![FieldError::new("", e.to_string())],
        ),
        SHUTTING_DOWN_RETRY_AFTER_S,
    )
}

/// 503 with a `Retry-After`: the shared catalog is out of reach, nothing changed.
fn catalog_unavailable(name: &str, e: &dyn std::fmt::Display) -> Response {
    tracing::error!(handler = %name, error = %e, "handler change refused: the shared catalog is unavailable");
    crate::ingest::catalog_unavailable_response(
        "the shared handler catalog is unavailable; nothing was changed",
        e.to_string(),
    )
}

/// `GET /v1/handlers`.
///
/// `read` lists every handler; a token with `handlers:` scopes only those they cover (a team
/// checks its own uploads with `router handlers list`, which `push` points it to).
pub async fn list(
    State(app): State<Arc<App>>,
    axum::Extension(who): axum::Extension<Principal>,
) -> Response {
    let everything = who.allows(&crate::auth::Scope::Read);
    if !everything && !who.has_handler_scopes() {
        return crate::auth::forbidden(&who, "read");
    }
    match runtime(&app) {
        Ok(rt) => {
            let handlers: Vec<_> = rt
                .registry
                .list()
                .into_iter()
                .filter(|h| everything || who.allows(&crate::auth::Scope::Handlers(h.name.clone())))
                .collect();
            axum::Json(json!({ "handlers": handlers, "compilations": rt.registry.compilations() }))
                .into_response()
        }
        Err(r) => *r,
    }
}

/// `GET /v1/handlers/{name}`: versions and the active one.
pub async fn show(State(app): State<Arc<App>>, Path(name): Path<String>) -> Response {
    match runtime(&app) {
        Ok(rt) => match rt.registry.get(&name) {
            Some(info) => axum::Json(json!(info)).into_response(),
            None => error_response(
                StatusCode::NOT_FOUND,
                "unknown handler",
                vec![FieldError::new("/name", format!("no handler {name:?}"))],
            ),
        },
        Err(r) => *r,
    }
}

/// Body of a rollback.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RollbackRequest {
    /// Version number (`3`, `v3`) or sha256 prefix.
    version: String,
}

/// A rollback's body. With none at all the JSON parser's "EOF while parsing a value at line 1
/// column 0" told the caller nothing of what to send: it is named instead.
fn rollback_request(body: &[u8]) -> Result<RollbackRequest, Box<Response>> {
    if body.trim_ascii().is_empty() {
        return Err(Box::new(error_response(
            StatusCode::BAD_REQUEST,
            "invalid request body",
            vec![FieldError::new(
                "",
                r#"a body {"version": "<n>"} is required: the version to switch back to, its number (e.g. "2") or a prefix of its sha256 (GET /v1/handlers/{name} lists them)"#,
            )],
        )));
    }
    crate::admin::request::parse_body(body)
}

/// `POST /v1/handlers/{name}/rollback {"version"}`.
pub async fn rollback(
    State(app): State<Arc<App>>,
    axum::Extension(who): axum::Extension<Principal>,
    Path(name): Path<String>,
    body: axum::body::Bytes,
) -> Response {
    let req = match rollback_request(&body) {
        Ok(r) => r,
        Err(resp) => return *resp,
    };
    let rt = match runtime(&app) {
        Ok(rt) => rt.clone(),
        Err(r) => return *r,
    };
    match rt
        .changes
        .rollback_as(&name, &req.version, &who.uploader())
        .await
    {
        Ok(v) => {
            tracing::warn!(handler = %name, version = v.version, by = %who.name, "handler rolled back");
            axum::Json(json!(v)).into_response()
        }
        Err(e) => registry_error(&who, &name, e),
    }
}

/// Query of the delete route.
/// `PUT /v1/handlers/{name}[?team=…]`.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct UploadQuery {
    /// An administrator's upload for a team: the handler becomes that team's.
    team: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DeleteQuery {
    /// Also give up the name, so any team may upload a handler with it (and receive the
    /// deliveries queued for it). On a handler already deleted, frees its name.
    #[serde(default)]
    release: bool,
}

/// `DELETE /v1/handlers/{name}[?release=true]`: its queued deliveries wait (retryable) until
/// one is uploaded, which only its team (or an administrator) can do unless the name is
/// released. A release moves them to the DLQ (`handler_released`) and removes the handler's
/// key-value entries and logs before the name is free.
pub async fn delete(
    State(app): State<Arc<App>>,
    axum::Extension(who): axum::Extension<Principal>,
    Path(name): Path<String>,
    crate::admin::ApiQuery(q): crate::admin::ApiQuery<DeleteQuery>,
) -> Response {
    let rt = match runtime(&app) {
        Ok(rt) => rt.clone(),
        Err(r) => return *r,
    };
    match rt
        .changes
        .delete_as(&name, &who.uploader(), q.release)
        .await
    {
        Ok(Deletion::Deleted { kept_by }) => {
            tracing::warn!(handler = %name, by = %who.name, kept_by = ?kept_by, "handler deleted");
            axum::Json(json!({ "deleted": name, "name_kept_by": kept_by })).into_response()
        }
        Ok(Deletion::Released) => {
            tracing::warn!(handler = %name, by = %who.name, "handler name released");
            axum::Json(json!({ "released": name })).into_response()
        }
        Ok(Deletion::Unknown) => {
            let detail = match rt.registry.index(&name) {
                Some(kept) if kept.deleted => match kept.owner {
                    Some(team) => format!(
                        "handler {name:?} is deleted; its name stays with team {team:?} (?release=true frees it)"
                    ),
                    None => format!(
                        "handler {name:?} is deleted; its key-value entries and logs are kept (?release=true removes them and frees the name)"
                    ),
                },
                _ => format!("no handler {name:?}"),
            };
            error_response(
                StatusCode::NOT_FOUND,
                "unknown handler",
                vec![FieldError::new("/name", detail)],
            )
        }
        Err(e) => registry_error(&who, &name, e),
    }
}

/// Query of the logs route.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LogsQuery {
    limit: Option<usize>,
    event_id: Option<String>,
    /// With `event_id`: only the lines of the event from this source.
    source: Option<String>,
    level: Option<LogLevelParam>,
    /// Only lines older than this `seq` (the `next_before` of the page before).
    before: Option<u64>,
    attempt: Option<u32>,
}

/// Most lines one logs request returns.
const MAX_LOG_LINES: usize = 5000;

/// `level=`: the lowest level returned.
#[derive(Debug, Clone, Copy, Deserialize)]
#[serde(rename_all = "lowercase")]
enum LogLevelParam {
    Trace,
    Debug,
    Info,
    Warn,
    Error,
}

/// `GET /v1/handlers/{name}/logs?limit=&event_id=&source=&attempt=&level=&before=`: recent
/// captured lines (size-capped), with event id and source, attempt and level; traps keep their message. Each line
/// has its position (`seq`); `before=<seq>` reads the page before, back to the oldest line
/// kept (`next_before` says where the next page starts, null when there is none). They are the owning team's (and an
/// administrator's): what a handler logs is its team's data (event contents, its own state),
/// which another team's `handlers:` glob covering the name does not open.
pub async fn logs(
    State(app): State<Arc<App>>,
    axum::Extension(who): axum::Extension<Principal>,
    Path(name): Path<String>,
    crate::admin::ApiQuery(q): crate::admin::ApiQuery<LogsQuery>,
) -> Response {
    let rt = match runtime(&app) {
        Ok(rt) => rt,
        Err(r) => return *r,
    };
    let index = rt.registry.index(&name);
    // A name with no record here (never uploaded, or released) has no logs to read: a 200
    // with no lines would pass for a handler that ran and logged nothing (a typo'd name, a
    // dashboard on the wrong one). A deleted handler's kept name keeps its logs; a handler
    // whose index cannot be read is still listed, and so are its logs.
    if index.is_none() && rt.registry.get(&name).is_none() {
        return error_response(
            StatusCode::NOT_FOUND,
            "unknown handler",
            vec![FieldError::new("/name", format!("no handler {name:?}"))],
        );
    }
    if let Some(Err(e)) = index.map(|i| i.check_owner(&who.uploader())) {
        tracing::warn!(token = %who.name, team = %who.team, handler = %name, owner = %e.owner, "handler logs refused: another team owns the handler");
        return error_response(
            StatusCode::FORBIDDEN,
            "out of scope",
            vec![FieldError::new(
                "/authorization",
                format!(
                    "token {:?} (team {:?}): handler {name:?} belongs to team {:?}; only its team or an administrator reads its logs",
                    who.name, who.team, e.owner
                ),
            )],
        );
    }
    if q.event_id.as_deref() == Some("") {
        // Read as "lines of no event" it matched nothing, which looks like a quiet handler.
        return error_response(
            StatusCode::BAD_REQUEST,
            "invalid query",
            vec![FieldError::new(
                "/event_id",
                "must not be empty: name an event id, or leave event_id out for every event's lines",
            )],
        );
    }
    if q.source.as_deref() == Some("") {
        return error_response(
            StatusCode::BAD_REQUEST,
            "invalid query",
            vec![FieldError::new(
                "/source",
                "must not be empty: name an event source, or leave source out for every source's lines",
            )],
        );
    }
    let limit = q.limit.unwrap_or(200).min(MAX_LOG_LINES);
    let query = crate::wasm::LogQuery {
        limit,
        event_id: q.event_id,
        source: q.source,
        min_level: q.level.map(|l| format!("{l:?}").to_ascii_lowercase()),
        before: q.before,
        attempt: q.attempt,
    };
    let (rt, read_name) = (rt.clone(), name.clone());
    let read = tokio::task::spawn_blocking(move || rt.logs.recent(&read_name, &query))
        .await
        .map_err(std::io::Error::other)
        .and_then(|r| r);
    match read {
        Ok(lines) => {
            // A full page may have older lines before it; fewer than asked for means none.
            // Lines written before positions were kept (seq 0) cannot be paged past.
            let next_before = lines
                .first()
                .filter(|l| lines.len() == limit && l.seq > 1)
                .map(|l| l.seq);
            axum::Json(json!({ "handler": name, "lines": lines, "next_before": next_before }))
                .into_response()
        }
        Err(e) => {
            tracing::error!(handler = %name, error = %e, "reading handler logs failed");
            error_response(
                StatusCode::INTERNAL_SERVER_ERROR,
                "could not read the handler's logs",
                Vec::new(),
            )
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    async fn error_of(r: Box<Response>) -> (StatusCode, serde_json::Value) {
        let status = r.status();
        let body = axum::body::to_bytes(r.into_body(), 1 << 16)
            .await
            .expect("body");
        (status, serde_json::from_slice(&body).expect("json"))
    }

    /// A rollback without a body says what to send, where it answered with the JSON parser's
    /// "EOF while parsing a value at line 1 column 0".
    #[tokio::test]
    async fn a_rollback_without_a_body_says_which_body_it_needs() {
        for body in [&b""[..], b"  \n"] {
            let (status, v) = error_of(rollback_request(body).expect_err("no body")).await;
            assert_eq!(status, StatusCode::BAD_REQUEST);
            let message = v["errors"][0]["message"].as_str().unwrap_or_default();
            assert!(message.contains(r#"{"version": "<n>"} is required"#), "{v}");
        }
        assert_eq!(
            rollback_request(br#"{"version": "2"}"#)
                .expect("valid")
                .version,
            "2"
        );
        let (_, v) = error_of(rollback_request(b"{}").expect_err("missing")).await;
        assert_eq!(v["errors"][0]["pointer"], "/version", "{v}");
    }
}

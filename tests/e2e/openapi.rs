//! The OpenAPI document (`schemas/openapi.yaml`) is true of the server: it describes every route
//! the router registers and nothing else, its `x-scope` of each operation is what the auth
//! middleware and the handlers enforce, and every response of a realistic scenario (successes
//! and errors) validates against the document's schema for that operation and status.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::http::HeaderMap;
use serde_json::{Value, json};

use crate::harness::*;

const METHODS: [&str; 7] = ["get", "post", "put", "patch", "delete", "head", "options"];
const SCOPES: [&str; 4] = ["none", "token", "read", "admin"];

// ---------------------------------------------------------------------------------------------
// The document
// ---------------------------------------------------------------------------------------------

fn repo_file(rel: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("..")
        .join(rel)
}

/// YAML (as saphyr loads it) to JSON. Mapping keys become strings (`200:` → `"200"`).
fn yaml_to_json(y: &saphyr::YamlOwned) -> Value {
    use saphyr::{ScalarOwned as S, YamlOwned as Y};
    match y {
        Y::Value(S::Null) => Value::Null,
        Y::Value(S::Boolean(b)) => Value::Bool(*b),
        Y::Value(S::Integer(i)) => Value::from(*i),
        Y::Value(S::FloatingPoint(f)) => serde_json::Number::from_f64(f.0)
            .map(Value::Number)
            .expect("finite number in the OpenAPI document"),
        Y::Value(S::String(s)) | Y::Representation(s, _, _) => Value::String(s.clone()),
        Y::Sequence(items) => Value::Array(items.iter().map(yaml_to_json).collect()),
        Y::Mapping(m) => Value::Object(
            m.iter()
                .map(|(k, v)| {
                    let key = match yaml_to_json(k) {
                        Value::String(s) => s,
                        other => other.to_string(),
                    };
                    (key, yaml_to_json(v))
                })
                .collect(),
        ),
        Y::Tagged(_, inner) => yaml_to_json(inner),
        Y::Alias(_) | Y::BadValue => panic!("unsupported YAML node in the OpenAPI document: {y:?}"),
    }
}

/// Media type without parameters, lower-cased.
fn essence(ct: &str) -> String {
    ct.split(';')
        .next()
        .unwrap_or("")
        .trim()
        .to_ascii_lowercase()
}

fn is_json_media(ct: &str) -> bool {
    ct == "application/json" || ct.ends_with("+json")
}

/// One operation of the document.
#[derive(Debug, Clone)]
struct Op {
    method: String,
    path: String,
    id: String,
    scope: String,
    tags: Vec<String>,
}

/// The parsed document and compiled validators of its schemas.
struct Doc {
    root: Value,
    validators: Mutex<HashMap<String, Arc<jsonschema::Validator>>>,
}

impl Doc {
    fn load() -> Self {
        let path = repo_file("schemas/openapi.yaml");
        let text = std::fs::read_to_string(&path)
            .unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()));
        use saphyr::LoadableYamlNode as _;
        let docs = saphyr::YamlOwned::load_from_str(&text)
            .unwrap_or_else(|e| panic!("{} is not valid YAML: {e}", path.display()));
        assert_eq!(docs.len(), 1, "one YAML document expected");
        let root = yaml_to_json(&docs[0]);
        assert!(
            root["openapi"]
                .as_str()
                .is_some_and(|v| v.starts_with("3.1")),
            "OpenAPI 3.1 expected"
        );
        Self {
            root,
            validators: Mutex::new(HashMap::new()),
        }
    }

    fn operations(&self) -> Vec<Op> {
        let mut ops = Vec::new();
        for (path, item) in self.root["paths"].as_object().expect("paths") {
            for (method, op) in item.as_object().expect("path item") {
                if !METHODS.contains(&method.as_str()) {
                    continue;
                }
                ops.push(Op {
                    method: method.clone(),
                    path: path.clone(),
                    id: op["operationId"].as_str().unwrap_or_default().to_string(),
                    scope: op["x-scope"].as_str().unwrap_or_default().to_string(),
                    tags: op["tags"]
                        .as_array()
                        .into_iter()
                        .flatten()
                        .filter_map(|t| t.as_str().map(str::to_string))
                        .collect(),
                });
            }
        }
        ops
    }

    fn op(&self, method: &str, path: &str) -> &Value {
        let op = &self.root["paths"][path][method.to_ascii_lowercase()];
        assert!(op.is_object(), "{method} {path} is not in the document");
        op
    }

    /// Follows local `$ref`s (`#/components/...`).
    fn deref<'a>(&'a self, mut v: &'a Value) -> &'a Value {
        while let Some(r) = v.get("$ref").and_then(Value::as_str) {
            let pointer = r
                .strip_prefix('#')
                .unwrap_or_else(|| panic!("only local $refs are supported: {r}"));
            v = self
                .root
                .pointer(pointer)
                .unwrap_or_else(|| panic!("dangling $ref {r}"));
        }
        v
    }

    /// The path template of the document that a concrete path (without query) matches; literal
    /// segments win over parameters, as in the server's router.
    fn template_of(&self, path: &str) -> Option<String> {
        let segs: Vec<&str> = path.split('/').collect();
        self.root["paths"]
            .as_object()
            .expect("paths")
            .keys()
            .filter_map(|t| {
                let tsegs: Vec<&str> = t.split('/').collect();
                if tsegs.len() != segs.len() {
                    return None;
                }
                let mut literal = 0;
                for (a, b) in tsegs.iter().zip(&segs) {
                    if a.starts_with('{') && a.ends_with('}') {
                        if b.is_empty() {
                            return None;
                        }
                    } else if a == b {
                        literal += 1;
                    } else {
                        return None;
                    }
                }
                Some((literal, t.clone()))
            })
            .max()
            .map(|(_, t)| t)
    }

    /// A validator for `schema` (a schema object of the document), resolving `$ref`s against
    /// the document's components.
    fn validator(&self, key: &str, schema: &Value) -> Arc<jsonschema::Validator> {
        let mut cache = self.validators.lock().expect("validators");
        if let Some(v) = cache.get(key) {
            return v.clone();
        }
        let wrapped = json!({
            "components": self.root["components"],
            "allOf": [schema],
        });
        let v = jsonschema::options()
            .with_draft(jsonschema::Draft::Draft202012)
            .should_validate_formats(true)
            .build(&wrapped)
            .unwrap_or_else(|e| panic!("schema of {key} does not compile: {e}"));
        let v = Arc::new(v);
        cache.insert(key.to_string(), v.clone());
        v
    }

    fn validate(&self, key: &str, schema: &Value, instance: &Value) -> Result<(), String> {
        let v = self.validator(key, schema);
        let errors: Vec<String> = v
            .iter_errors(instance)
            .map(|e| format!("at {:?}: {e}", e.instance_path().as_str()))
            .collect();
        if errors.is_empty() {
            Ok(())
        } else {
            Err(errors.join("; "))
        }
    }

    /// Checks one response against the document: the status is documented, documented headers
    /// are present, the content type is documented and a JSON body validates.
    fn check_response(
        &self,
        method: &str,
        template: &str,
        status: u16,
        headers: &HeaderMap,
        body: &[u8],
    ) -> Result<(), String> {
        let op = self.op(method, template);
        let key = status.to_string();
        let Some(resp) = op["responses"].get(&key).or(op["responses"].get("default")) else {
            return Err(format!("status {status} is not documented"));
        };
        let resp = self.deref(resp);
        if let Some(hs) = resp["headers"].as_object() {
            for (name, h) in hs {
                let h = self.deref(h);
                let Some(value) = headers.get(name.as_str()).and_then(|v| v.to_str().ok()) else {
                    return Err(format!("documented header {name} is missing"));
                };
                let schema = &h["schema"];
                let instance = if schema["type"] == "integer" {
                    value
                        .parse::<i64>()
                        .map(Value::from)
                        .map_err(|_| format!("header {name}: {value:?} is not an integer"))?
                } else {
                    Value::String(value.to_string())
                };
                self.validate(
                    &format!("{method} {template} {status} header {name}"),
                    schema,
                    &instance,
                )
                .map_err(|e| format!("header {name}: {e}"))?;
            }
        }
        let Some(content) = resp["content"].as_object() else {
            return if body.is_empty() {
                Ok(())
            } else {
                Err(format!(
                    "no content documented, got {}",
                    String::from_utf8_lossy(body)
                ))
            };
        };
        let ct = headers
            .get("content-type")
            .and_then(|v| v.to_str().ok())
            .map(essence)
            .unwrap_or_default();
        let Some(media) = content.get(&ct) else {
            return Err(format!(
                "content type {ct:?} is not documented (documented: {:?}); body: {}",
                content.keys().collect::<Vec<_>>(),
                String::from_utf8_lossy(body)
            ));
        };
        if is_json_media(&ct) {
            let v: Value = serde_json::from_slice(body).map_err(|e| {
                format!("body is not JSON ({e}): {}", String::from_utf8_lossy(body))
            })?;
            self.validate(
                &format!("{method} {template} {status} {ct}"),
                &media["schema"],
                &v,
            )
            .map_err(|e| format!("{e}\nbody: {v}"))
        } else {
            std::str::from_utf8(body)
                .map(|_| ())
                .map_err(|_| "text body is not UTF-8".to_string())
        }
    }

    /// Checks that a request body the server accepted is accepted by the document too.
    fn check_request(
        &self,
        method: &str,
        template: &str,
        ct: &str,
        body: &[u8],
    ) -> Result<(), String> {
        let op = self.op(method, template);
        let Some(rb) = op.get("requestBody").map(|r| self.deref(r)) else {
            return Err("the server accepted a body the document does not describe".into());
        };
        let ct = essence(ct);
        let Some(media) = rb["content"].get(&ct) else {
            return Err(format!("request content type {ct:?} is not documented"));
        };
        if !is_json_media(&ct) {
            return Ok(());
        }
        let v: Value =
            serde_json::from_slice(body).map_err(|e| format!("request is not JSON: {e}"))?;
        self.validate(
            &format!("{method} {template} request {ct}"),
            &media["schema"],
            &v,
        )
        .map_err(|e| format!("request body rejected by the document: {e}\nbody: {v}"))
    }
}

// ---------------------------------------------------------------------------------------------
// Talking to the server, checking every answer
// ---------------------------------------------------------------------------------------------

/// A request to send.
#[derive(Default, Clone)]
struct Req {
    token: Option<String>,
    content_type: Option<String>,
    body: Option<Vec<u8>>,
    headers: Vec<(String, String)>,
}

impl Req {
    fn token(t: &str) -> Self {
        Self {
            token: Some(t.to_string()),
            ..Self::default()
        }
    }
    fn json(mut self, body: &Value) -> Self {
        self.content_type = Some("application/json".into());
        self.body = Some(body.to_string().into_bytes());
        self
    }
    fn raw(mut self, content_type: &str, body: impl Into<Vec<u8>>) -> Self {
        self.content_type = Some(content_type.into());
        self.body = Some(body.into());
        self
    }
    fn header(mut self, name: &str, value: &str) -> Self {
        self.headers.push((name.into(), value.into()));
        self
    }
}

/// An answer.
struct Resp {
    status: u16,
    json: Value,
}

/// Sends requests, checks each answer against the document and records what was covered.
struct Api<'a> {
    r: &'a RouterProc,
    doc: &'a Doc,
    client: reqwest::Client,
    failures: Mutex<Vec<String>>,
    /// (operationId, status) of every checked answer.
    covered: Mutex<BTreeSet<(String, u16)>>,
}

impl<'a> Api<'a> {
    fn new(r: &'a RouterProc, doc: &'a Doc) -> Self {
        Self {
            r,
            doc,
            client: client(),
            failures: Mutex::new(Vec::new()),
            covered: Mutex::new(BTreeSet::new()),
        }
    }

    async fn send(&self, method: &str, path_and_query: &str, req: Req) -> Resp {
        let path = path_and_query.split('?').next().unwrap_or("");
        let template = self
            .doc
            .template_of(path)
            .unwrap_or_else(|| panic!("{path} matches no path of the document"));
        let mut rb = self
            .client
            .request(method.parse().expect("method"), self.r.url(path_and_query));
        if let Some(t) = &req.token {
            rb = rb.bearer_auth(t);
        }
        for (k, v) in &req.headers {
            rb = rb.header(k.as_str(), v.as_str());
        }
        if let Some(ct) = &req.content_type {
            rb = rb.header("content-type", ct.as_str());
        }
        if let Some(b) = &req.body {
            rb = rb.body(b.clone());
        }
        let resp = rb.send().await.expect("send");
        let status = resp.status().as_u16();
        let headers = resp.headers().clone();
        let body = resp.bytes().await.expect("body").to_vec();
        let what = format!("{method} {path_and_query} → {status}");
        let mut problems = Vec::new();
        if let Err(e) = self
            .doc
            .check_response(method, &template, status, &headers, &body)
        {
            problems.push(e);
        }
        let binary_mode = req.headers.iter().any(|(k, _)| k.starts_with("ce-"));
        if (200..300).contains(&status)
            && !binary_mode
            && let (Some(ct), Some(b)) = (&req.content_type, &req.body)
            && let Err(e) = self.doc.check_request(method, &template, ct, b)
        {
            problems.push(e);
        }
        for p in problems {
            self.failures
                .lock()
                .expect("failures")
                .push(format!("{what}: {p}"));
        }
        let op_id = self.doc.op(method, &template)["operationId"]
            .as_str()
            .unwrap_or_default()
            .to_string();
        self.covered
            .lock()
            .expect("covered")
            .insert((op_id, status));
        Resp {
            status,
            json: serde_json::from_slice(&body).unwrap_or(Value::Null),
        }
    }

    /// Sends and asserts the status.
    async fn expect(&self, status: u16, method: &str, path: &str, req: Req) -> Value {
        let r = self.send(method, path, req).await;
        assert_eq!(r.status, status, "{method} {path}: {}", r.json);
        r.json
    }

    fn assert_no_failures(&self) {
        let f = self.failures.lock().expect("failures");
        assert!(
            f.is_empty(),
            "{} answer(s) disagree with schemas/openapi.yaml:\n{}",
            f.len(),
            f.join("\n\n")
        );
    }
}

// ---------------------------------------------------------------------------------------------
// a) Every route is documented, and nothing else; every operation is complete
// ---------------------------------------------------------------------------------------------

/// `(method, path)` of every `.route("…", get(…).post(…))` in router/src/app.rs.
fn routes_in_app_rs() -> BTreeSet<(String, String)> {
    let path = repo_file("router/src/app.rs");
    let text = std::fs::read_to_string(&path).expect("read app.rs");
    for other in [".nest(", ".merge(", ".route_service(", ".nest_service("] {
        assert!(
            !text.contains(other),
            "app.rs uses {other}: teach routes_in_app_rs (tests/e2e/openapi.rs) to follow it"
        );
    }
    let mut routes = BTreeSet::new();
    let mut rest = text.as_str();
    while let Some(i) = rest.find(".route(") {
        let after = &rest[i + ".route(".len()..];
        let mut depth = 1usize;
        let mut end = after.len();
        for (j, c) in after.char_indices() {
            match c {
                '(' => depth += 1,
                ')' => {
                    depth -= 1;
                    if depth == 0 {
                        end = j;
                        break;
                    }
                }
                _ => {}
            }
        }
        let args = &after[..end];
        let q1 = args.find('"').expect("route path literal");
        let q2 = q1 + 1 + args[q1 + 1..].find('"').expect("end of route path literal");
        let route = &args[q1 + 1..q2];
        let handlers = &args[q2 + 1..];
        let mut methods = 0;
        for m in METHODS {
            let needle = format!("{m}(");
            let mut from = 0;
            while let Some(k) = handlers[from..].find(&needle) {
                let at = from + k;
                let before = handlers[..at].chars().next_back();
                if before.is_none_or(|c| !(c.is_alphanumeric() || c == '_' || c == ':')) {
                    routes.insert((m.to_string(), route.to_string()));
                    methods += 1;
                }
                from = at + needle.len();
            }
        }
        assert!(methods > 0, "no method found for route {route} in app.rs");
        rest = &after[end..];
    }
    assert!(!routes.is_empty(), "no routes found in app.rs");
    routes
}

#[test]
fn every_route_is_documented_and_every_operation_is_complete() {
    let doc = Doc::load();
    let server = routes_in_app_rs();
    let documented: BTreeSet<(String, String)> = doc
        .operations()
        .into_iter()
        .map(|o| (o.method, o.path))
        .collect();
    let missing: Vec<_> = server.difference(&documented).collect();
    let extra: Vec<_> = documented.difference(&server).collect();
    assert!(
        missing.is_empty() && extra.is_empty(),
        "routes in router/src/app.rs but not in schemas/openapi.yaml: {missing:?}\n\
         operations in schemas/openapi.yaml that the server does not register: {extra:?}"
    );

    let mut problems = Vec::new();
    let mut ids = BTreeSet::new();
    for op in doc.operations() {
        let o = doc.op(&op.method, &op.path);
        let name = format!("{} {}", op.method.to_uppercase(), op.path);
        if op.id.is_empty() {
            problems.push(format!("{name}: no operationId"));
        } else if !ids.insert(op.id.clone()) {
            problems.push(format!("{name}: duplicate operationId {}", op.id));
        }
        if o["summary"].as_str().is_none_or(str::is_empty) {
            problems.push(format!("{name}: no summary"));
        }
        if !SCOPES.contains(&op.scope.as_str()) {
            problems.push(format!(
                "{name}: x-scope must be one of {SCOPES:?}, got {:?}",
                o.get("x-scope")
            ));
        }
        let security = o["security"].as_array();
        let bearer = security.is_some_and(|s| s.iter().any(|r| r.get("bearerAuth").is_some()));
        match (op.scope.as_str(), security) {
            (_, None) => problems.push(format!("{name}: no security")),
            ("none", Some(s)) if !s.is_empty() => {
                problems.push(format!("{name}: x-scope none but security {s:?}"))
            }
            ("none", _) => {}
            _ if !bearer => problems.push(format!("{name}: security must name bearerAuth")),
            _ => {}
        }
        // Path parameters: each {param} declared, nothing else.
        let declared: BTreeSet<String> = o["parameters"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|p| doc.deref(p))
            .filter(|p| p["in"] == "path")
            .filter_map(|p| p["name"].as_str().map(str::to_string))
            .collect();
        let in_path: BTreeSet<String> = op
            .path
            .split('/')
            .filter_map(|s| s.strip_prefix('{').and_then(|s| s.strip_suffix('}')))
            .map(str::to_string)
            .collect();
        if declared != in_path {
            problems.push(format!(
                "{name}: path parameters declared {declared:?}, in the path {in_path:?}"
            ));
        }
        // Responses: a success, and the auth answers the scope implies, with the error shape.
        let responses = o["responses"].as_object().cloned().unwrap_or_default();
        if !responses.keys().any(|k| k.starts_with('2')) {
            problems.push(format!("{name}: no success response"));
        }
        if op.scope != "none" {
            for s in ["401", "403"] {
                if !responses.contains_key(s) {
                    problems.push(format!("{name}: x-scope {} but no {s} response", op.scope));
                }
            }
        }
        for (status, r) in &responses {
            let r = doc.deref(r);
            let is_error = status.starts_with('4') || status.starts_with('5');
            if is_error && op.id != "readyz" {
                let schema = &r["content"]["application/json"]["schema"]["$ref"];
                if schema != "#/components/schemas/ErrorBody" {
                    problems.push(format!("{name}: {status} is not an ErrorBody"));
                }
            }
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

/// Each job route serves its own kind (`/v1/dlq/redrive/{job}` redrives, `/v1/replay/{job}`
/// replays) and answers 404 for the other, and the document says so: it said each job's id was
/// found on the other kind's routes too (getRedriveJob, getReplayJob, controlRedriveJob), and
/// a client that followed it got 404.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_job_route_serves_its_own_kind_as_the_document_says() {
    let doc = Doc::load();
    let r = RouterProc::start(&[], &[]);
    let now = chrono::Utc::now();
    let (s, redrive) = post_json(
        &r,
        "/v1/dlq/redrive",
        // Slow enough to be running throughout (its first step comes in 1000 s).
        json!({"all": true, "rate_per_sec": 0.001}),
    )
    .await;
    assert_eq!(s, 201, "{redrive}");
    let (s, replay) = post_json(
        &r,
        "/v1/replay",
        json!({"from": (now - chrono::Duration::hours(1)).to_rfc3339(), "to": now.to_rfc3339(), "rate_per_sec": 0.001}),
    )
    .await;
    assert_eq!(s, 201, "{replay}");
    let (redrive, replay) = (
        redrive["id"].as_str().expect("id"),
        replay["id"].as_str().expect("id"),
    );
    for (op, method, path, own, other) in [
        (
            "getRedriveJob",
            "GET",
            "/v1/dlq/redrive/{job}",
            redrive,
            replay,
        ),
        ("getReplayJob", "GET", "/v1/replay/{job}", replay, redrive),
        (
            "controlRedriveJob",
            "POST",
            "/v1/dlq/redrive/{job}/{action}",
            redrive,
            replay,
        ),
        (
            "controlReplayJob",
            "POST",
            "/v1/replay/{job}/{action}",
            replay,
            redrive,
        ),
    ] {
        let at = |job: &str| r.url(&path.replace("{job}", job).replace("{action}", "pause"));
        let status = |job: &str| {
            let url = at(job);
            async move {
                client()
                    .request(method.parse().expect("method"), url)
                    .send()
                    .await
                    .expect("send")
                    .status()
                    .as_u16()
            }
        };
        assert_eq!(status(other).await, 404, "{op} with the other kind's id");
        assert_eq!(status(own).await, 200, "{op} with its own kind's id");
        let described = doc.op(method, path)["description"]
            .as_str()
            .unwrap_or_default()
            .replace('\n', " ");
        assert!(
            described.contains("is 404 here"),
            "{op} does not say the other kind's id is 404: {described}"
        );
        assert!(
            !described.contains("found here too") && !described.contains("also reachable here"),
            "{op} says the other kind's id is served: {described}"
        );
    }
}

// ---------------------------------------------------------------------------------------------
// Fixtures shared by b) and c)
// ---------------------------------------------------------------------------------------------

const ADMIN: &str = "ops-token";
const READER: &str = "viewer-token";
const PRODUCER: &str = "producer-token";
const TEAM: &str = "erp-team-token";
/// Owns the handler `nope` (`handlers:nope`).
const HANDLER_TEAM: &str = "handler-team-token";
const WRONG: &str = "not-a-token";

/// admin, read-only, ingest-only, and a DLQ team token (`dlq:broken`) that holds no `read`.
fn config() -> String {
    let mut c = String::from("[ingest]\nmax_batch = 5\n\n");
    for (name, token, scopes) in [
        ("ops", ADMIN, r#"["admin"]"#),
        ("viewer", READER, r#"["read"]"#),
        ("producer", PRODUCER, r#"["ingest:order.*"]"#),
        ("erp-team", TEAM, r#"["dlq:broken"]"#),
        ("handler-team", HANDLER_TEAM, r#"["handlers:nope"]"#),
    ] {
        c.push_str(&format!(
            "[[auth.tokens]]\nname = \"{name}\"\nsha256 = \"{}\"\nscopes = {scopes}\n\n",
            token_sha256(token)
        ));
    }
    c
}

/// Rules: `order.*` to a healthy webhook `erp` under a policy with every knob (so targets show
/// a breaker, budget and throttle); `bad.thing` to a webhook `broken` that answers 400
/// (permanent: straight to the DLQ, holding its ordering key); `h.thing` to the WASM handler
/// `noop`.
fn rules(ok: &Receiver, broken: &Receiver) -> String {
    format!(
        r#"policies:
  careful:
    timeout: 2s
    retry: {{ max_attempts: 3, base_delay: 10ms, max_delay: 20ms }}
    breaker: {{ failure_rate: 0.5, min_requests: 50, window: 30s, open_for: 30s, half_open_probes: 1 }}
    throttle: {{ rate_per_sec: 1000, max_concurrency: 4 }}
    retry_budget: 0.5
    ordering: partitionkey
  held:
    ordering: partitionkey
    on_dead_letter: hold
rules:
  - name: orders
    pattern:
      type: [{{ prefix: order. }}]
    targets:
      - webhook: {}
        id: erp
        policy: careful
  - name: failing
    pattern:
      type: [bad.thing]
    targets:
      - webhook: {}
        id: broken
        policy: held
  - name: handled
    pattern:
      type: [h.thing]
    targets:
      - handler: noop
        id: h
  - name: bulk
    pattern:
      type: [bulk.thing]
    targets:
      - webhook: {}
        id: bulk
        batch: {{ max_events: 10 }}
"#,
        ok.url(),
        broken.url(),
        ok.url()
    )
}

const ORDER_CREATED_V1: &str = r#"{
  "$schema": "https://json-schema.org/draft/2020-12/schema",
  "type": "object",
  "required": ["order_id"],
  "properties": { "order_id": { "type": "string" } }
}"#;

const ORDER_STRICT_V1: &str = r#"{
  "$schema": "http://json-schema.org/draft-07/schema#",
  "type": "object",
  "required": ["n"],
  "properties": { "n": { "type": "integer" } }
}"#;

fn start(ok: &Receiver, broken: &Receiver) -> RouterProc {
    let rules = rules(ok, broken);
    RouterProc::start_full(
        &[("r.yaml", &rules)],
        &[
            ("order.created/v1.json", ORDER_CREATED_V1),
            ("order.strict/v1.json", ORDER_STRICT_V1),
            ("modes.toml", "\"order.strict\" = \"enforce\"\n"),
        ],
        &[],
        Some(&config()),
    )
}

fn ce(id: &str, ty: &str, data: Value) -> Value {
    json!({"specversion": "1.0", "id": id, "source": "/test", "type": ty, "data": data})
}

/// Posts one event as the admin and returns the result status.
async fn ingest(api: &Api<'_>, ev: &Value) -> String {
    let b = api
        .expect(
            202,
            "POST",
            "/v1/events",
            Req::token(ADMIN).raw("application/cloudevents+json", ev.to_string()),
        )
        .await;
    b["results"][0]["status"]
        .as_str()
        .unwrap_or_default()
        .to_string()
}

/// Waits for a DLQ entry of `target` and returns its id.
async fn dlq_entry_of(api: &Api<'_>, target: &str) -> String {
    eventually(Duration::from_secs(20), || async {
        let r = api
            .send(
                "GET",
                &format!("/v1/dlq?target={target}"),
                Req::token(ADMIN),
            )
            .await;
        r.json["entries"][0]["id"].as_str().map(str::to_string)
    })
    .await
    .unwrap_or_else(|| panic!("no DLQ entry for {target}"))
}

async fn job_state(api: &Api<'_>, id: &str) -> String {
    let j = api
        .expect(
            200,
            "GET",
            &format!("/v1/dlq/redrive/{id}"),
            Req::token(ADMIN),
        )
        .await;
    j["state"].as_str().unwrap_or_default().to_string()
}

/// A handler's emission dead-lettered before any target (outside its owner's ingest scope),
/// as its team lists it (`emitted_by=`) and shows it, validates against the document, and so
/// does the 403 that points a team's `target=none` at it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handlers_dead_lettered_emissions_validate_against_the_document() {
    let doc = Doc::load();
    let rules = "rules:\n  - name: orders\n    pattern: { type: [order.created] }\n    targets:\n      - handler: enrich\n";
    let config = tokens_config(&[
        (ADMIN, None, "admin"),
        (HANDLER_TEAM, None, "handlers:enrich"),
    ]);
    let r = RouterProc::start_full(&[("r.yaml", rules)], &[], &[], Some(&config));
    let api = Api::new(&r, &doc);
    let team = || Req::token(HANDLER_TEAM);
    api.expect(
        201,
        "PUT",
        "/v1/handlers/enrich",
        team().raw("application/wasm", crate::handlers::plugin("enrich")),
    )
    .await;
    let ev = ce("emit-1", "order.created", json!({"order_id": "1"}));
    assert_eq!(ingest(&api, &ev).await, "accepted");
    let id = eventually(Duration::from_secs(20), || async {
        let r = api.send("GET", "/v1/dlq?emitted_by=enrich", team()).await;
        r.json["entries"][0]["id"].as_str().map(str::to_string)
    })
    .await
    .expect("the team lists its handler's dead-lettered emission");
    let shown = api
        .expect(200, "GET", &format!("/v1/dlq/{id}"), team())
        .await;
    assert_eq!(shown["emitted_by"]["handler"], "enrich", "{shown}");
    api.expect(403, "GET", "/v1/dlq?target=none", team()).await;
    api.assert_no_failures();
}

// ---------------------------------------------------------------------------------------------
// b) x-scope agrees with the server
// ---------------------------------------------------------------------------------------------

/// A concrete request for an operation, and for `x-scope: token` operations the tokens the
/// handler lets through and refuses.
struct Example {
    path: String,
    body: Option<(&'static str, Vec<u8>)>,
    /// For `token` operations: (in scope, out of scope).
    tokens: Option<(&'static str, &'static str)>,
}

fn example(op_id: &str, dlq_id: &str, redrive_job: &str, replay_job: &str) -> Option<Example> {
    let plain = |path: &str| Example {
        path: path.to_string(),
        body: None,
        tokens: None,
    };
    let with = |path: &str, ct: &'static str, body: Value, tokens| Example {
        path: path.to_string(),
        body: Some((ct, body.to_string().into_bytes())),
        tokens,
    };
    let now = chrono::Utc::now();
    Some(match op_id {
        // Ingest needs ingest:<type> (the producer has order.*; read is not enough).
        "postEvents" => with(
            "/v1/events",
            "application/cloudevents+json",
            ce("scope-1", "order.paid", json!({})),
            Some((PRODUCER, READER)),
        ),
        "getEventFate" => plain("/v1/events/seed-1?source=/test"),
        // DLQ reads need read, or dlq:<target> naming the target.
        "listDlq" => Example {
            tokens: Some((TEAM, PRODUCER)),
            ..plain("/v1/dlq?target=broken")
        },
        "getDlqSummary" => Example {
            tokens: Some((TEAM, PRODUCER)),
            ..plain("/v1/dlq/summary?target=broken")
        },
        "getDlqEntry" => Example {
            tokens: Some((TEAM, PRODUCER)),
            ..plain(&format!("/v1/dlq/{dlq_id}"))
        },
        // DLQ changes need admin, or dlq:<target> naming the target (read is not enough).
        "purgeDlq" => with(
            "/v1/dlq/purge",
            "application/json",
            json!({"filter": {"target": "broken"}, "dry_run": true}),
            Some((TEAM, READER)),
        ),
        "createRedrive" => with(
            "/v1/dlq/redrive",
            "application/json",
            // Names the target (what scopes check) but matches no entry, so the entry the
            // getDlqEntry example reads stays where it is.
            json!({"filter": {"target": "broken", "reason": "loop_detected"}, "rate_per_sec": 5}),
            Some((TEAM, READER)),
        ),
        "controlRedriveJob" => Example {
            tokens: Some((TEAM, READER)),
            ..plain(&format!("/v1/dlq/redrive/{redrive_job}/cancel"))
        },
        // A team reads its own targets' redrive jobs (and the list of them).
        "listRedriveJobs" => Example {
            tokens: Some((TEAM, PRODUCER)),
            ..plain("/v1/dlq/redrive")
        },
        "getRedriveJob" => Example {
            tokens: Some((TEAM, PRODUCER)),
            ..plain(&format!("/v1/dlq/redrive/{redrive_job}"))
        },
        "createReplay" => with(
            "/v1/replay",
            "application/json",
            json!({
                "from": (now - chrono::Duration::hours(1)).to_rfc3339(),
                "to": (now + chrono::Duration::minutes(1)).to_rfc3339(),
                "rate_per_sec": 1,
            }),
            None,
        ),
        "listReplayJobs" => plain("/v1/replay"),
        "getReplayJob" => plain(&format!("/v1/replay/{replay_job}")),
        "controlReplayJob" => plain(&format!("/v1/replay/{replay_job}/pause")),
        "listTargets" => plain("/v1/targets"),
        "getTarget" => plain("/v1/targets/erp"),
        "pauseTarget" => plain("/v1/targets/erp/pause"),
        "resumeTarget" => plain("/v1/targets/erp/resume"),
        "releaseOrderingKey" => plain("/v1/targets/erp/keys/k1/release"),
        "getRules" => plain("/v1/rules"),
        "testRules" => with(
            "/v1/rules/test",
            "application/json",
            ce("t", "order.paid", json!({})),
            None,
        ),
        "controlRule" => plain("/v1/rules/orders/enable"),
        "listContracts" => plain("/v1/contracts"),
        "getContract" => plain("/v1/contracts/order.created/v1"),
        "putContract" => with(
            "/v1/contracts/scope.example/v1",
            "application/json",
            json!({"type": "object"}),
            None,
        ),
        "reload" => plain("/v1/admin/reload"),
        "getStatus" => plain("/v1/status"),
        "getMetrics" => plain("/metrics"),
        // `read` lists them all, a team's `handlers:` token those it covers.
        "listHandlers" => Example {
            tokens: Some((HANDLER_TEAM, PRODUCER)),
            ..plain("/v1/handlers")
        },
        // A team's handlers need handlers:<name>; reading one is also open to `read`.
        "getHandler" => Example {
            tokens: Some((HANDLER_TEAM, PRODUCER)),
            ..plain("/v1/handlers/nope")
        },
        "uploadHandler" => Example {
            path: "/v1/handlers/nope".into(),
            body: Some(("application/wasm", b"not a component".to_vec())),
            tokens: Some((HANDLER_TEAM, READER)),
        },
        "deleteHandler" => Example {
            tokens: Some((HANDLER_TEAM, READER)),
            ..plain("/v1/handlers/nope")
        },
        "rollbackHandler" => with(
            "/v1/handlers/nope/rollback",
            "application/json",
            json!({"version": "1"}),
            Some((HANDLER_TEAM, READER)),
        ),
        "getHandlerLogs" => Example {
            tokens: Some((HANDLER_TEAM, READER)),
            ..plain("/v1/handlers/nope/logs")
        },
        "healthz" => plain("/healthz"),
        "readyz" => plain("/readyz"),
        _ => return None,
    })
}

/// For every operation × {no token, wrong token, out-of-scope token, in-scope token}: 401, 401,
/// 403, and neither 401 nor 403; health probes answer without a token. Every answer is also
/// checked against the document.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn x_scope_agrees_with_the_server() {
    let doc = Doc::load();
    let ok = Receiver::ok().await;
    let broken = Receiver::status(400).await;
    let r = start(&ok, &broken);
    let api = Api::new(&r, &doc);

    // Objects the examples refer to: an event, a DLQ entry of `broken`, a redrive job over
    // `broken` (paused, so that control answers stay 200/409) and a replay job.
    assert_eq!(
        ingest(
            &api,
            &ce("seed-1", "order.created", json!({"order_id": "1"}))
        )
        .await,
        "accepted"
    );
    assert_eq!(
        ingest(&api, &ce("seed-2", "bad.thing", json!({}))).await,
        "accepted"
    );
    let dlq_id = dlq_entry_of(&api, "broken").await;
    let job = api
        .expect(
            201,
            "POST",
            "/v1/dlq/redrive",
            // Over entries that do not exist (no webhook dead-letters as loop_detected): the
            // job exists for the control examples, and the `broken` entry the other examples
            // read is not moved away by it mid-test.
            Req::token(ADMIN).json(&json!({"filter": {"target": "broken", "reason": "loop_detected"}, "rate_per_sec": 0.001})),
        )
        .await;
    let redrive_job = job["id"].as_str().expect("job id").to_string();
    let now = chrono::Utc::now();
    let job = api
        .expect(
            201,
            "POST",
            "/v1/replay",
            Req::token(ADMIN).json(&json!({
                "from": (now - chrono::Duration::hours(1)).to_rfc3339(),
                "to": (now + chrono::Duration::hours(1)).to_rfc3339(),
                "rate_per_sec": 0.001,
            })),
        )
        .await;
    let replay_job = job["id"].as_str().expect("job id").to_string();

    let mut problems = Vec::new();
    for op in doc.operations() {
        let Some(ex) = example(&op.id, &dlq_id, &redrive_job, &replay_job) else {
            problems.push(format!(
                "operation {} has no example request in tests/e2e/openapi.rs (fn example)",
                op.id
            ));
            continue;
        };
        let method = op.method.to_uppercase();
        let req = |token: Option<&str>| {
            let mut q = Req {
                token: token.map(str::to_string),
                ..Req::default()
            };
            if let Some((ct, b)) = &ex.body {
                q = q.raw(ct, b.clone());
            }
            q
        };
        // Out of scope: every weaker token. `read` and `admin` also refuse the narrow
        // `ingest:`/`dlq:` tokens, which is what tells them apart from `token`.
        let (in_scope, out_of_scope): (Option<&str>, Vec<&str>) =
            match (op.scope.as_str(), ex.tokens) {
                ("none", _) => (None, Vec::new()),
                ("read", _) => (Some(READER), vec![PRODUCER, TEAM]),
                ("admin", _) => (Some(ADMIN), vec![READER, PRODUCER, TEAM]),
                ("token", Some((i, o))) => (Some(i), vec![o]),
                (s, _) => {
                    problems.push(format!("{}: x-scope {s:?} without example tokens", op.id));
                    continue;
                }
            };
        let name = format!("{} ({method} {})", op.id, ex.path);
        let auth = |s: u16| s == 401 || s == 403;
        if op.scope == "none" {
            for t in [None, Some(WRONG), Some(READER)] {
                let s = api.send(&method, &ex.path, req(t)).await.status;
                if auth(s) || !(200..300).contains(&s) {
                    problems.push(format!("{name} with token {t:?}: {s}, want 2xx"));
                }
            }
            continue;
        }
        for (t, want) in [(None, 401), (Some(WRONG), 401)] {
            let s = api.send(&method, &ex.path, req(t)).await.status;
            if s != want {
                problems.push(format!("{name} with token {t:?}: {s}, want {want}"));
            }
        }
        for t in out_of_scope {
            let got = api.send(&method, &ex.path, req(Some(t))).await;
            if got.status != 403 {
                problems.push(format!(
                    "{name} out of scope ({t}): {}, want 403 ({})",
                    got.status, got.json
                ));
            }
        }
        if let Some(t) = in_scope {
            let got = api.send(&method, &ex.path, req(Some(t))).await;
            if auth(got.status) || got.status >= 500 {
                problems.push(format!(
                    "{name} in scope ({t}): {} ({}), want neither 401/403 nor 5xx",
                    got.status, got.json
                ));
            }
        }
    }
    assert!(
        problems.is_empty(),
        "x-scope disagrees with the server:\n{}",
        problems.join("\n")
    );
    api.assert_no_failures();
}

// ---------------------------------------------------------------------------------------------
// c) Responses of a realistic scenario validate against the document
// ---------------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn responses_validate_against_the_document() {
    let doc = Doc::load();
    let ok = Receiver::ok().await;
    let broken = Receiver::status(400).await;
    let r = start(&ok, &broken);
    let api = Api::new(&r, &doc);
    let admin = || Req::token(ADMIN);
    let now = chrono::Utc::now();

    api.expect(200, "GET", "/healthz", Req::default()).await;
    api.expect(200, "GET", "/readyz", Req::default()).await;
    // A web page's request (here: a probe from another origin) is refused in the error shape.
    let from_a_page = || Req::default().header("origin", "http://evil.example");
    api.expect(403, "GET", "/healthz", from_a_page()).await;
    api.expect(403, "GET", "/readyz", from_a_page()).await;

    // --- Ingest, all three modes ---
    let mut first = ce("o-1", "order.created", json!({"order_id": "1"}));
    first["partitionkey"] = json!("k1");
    first["time"] = json!("2024-05-01T12:00:00Z");
    first["subject"] = json!("orders/1");
    first["traceparent"] = json!("00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01");
    first["tenant"] = json!("acme");
    first["dataversion"] = json!(1);
    let structured = |ev: &Value| admin().raw("application/cloudevents+json", ev.to_string());
    let b = api
        .expect(202, "POST", "/v1/events", structured(&first))
        .await;
    assert_eq!(b["results"][0]["status"], "accepted", "{b}");
    let b = api
        .expect(202, "POST", "/v1/events", structured(&first))
        .await;
    assert_eq!(b["results"][0]["status"], "duplicate", "{b}");

    let mut unknown_version = ce("o-4", "order.created", json!({"order_id": "4"}));
    unknown_version["dataversion"] = json!(7);
    let mut held = ce("b-1", "bad.thing", json!({"x": 1}));
    held["partitionkey"] = json!("pk1");
    let batch = json!([
        ce("o-2", "order.created", json!({"order_id": "2"})),
        ce("o-3", "order.created", json!({"order_id": 3})),
        unknown_version,
        held,
    ]);
    let b = api
        .expect(
            202,
            "POST",
            "/v1/events",
            admin().raw("application/cloudevents-batch+json", batch.to_string()),
        )
        .await;
    let statuses: Vec<&str> = b["results"]
        .as_array()
        .expect("results")
        .iter()
        .map(|x| x["status"].as_str().unwrap_or(""))
        .collect();
    assert_eq!(
        statuses,
        ["accepted", "quarantined", "quarantined", "accepted"],
        "{b}"
    );
    assert_eq!(b["results"][1]["reason"], "contract_violation");
    assert_eq!(b["results"][2]["reason"], "unknown_version");

    // application/json, leniently: an object, then an array.
    api.expect(
        202,
        "POST",
        "/v1/events",
        admin().json(&ce("p-1", "order.paid", json!({"total": 3}))),
    )
    .await;
    api.expect(
        202,
        "POST",
        "/v1/events",
        admin().json(&json!([ce("p-2", "order.paid", json!({}))])),
    )
    .await;
    // Binary mode: JSON data, text data, bytes.
    let binary = |id: &str, ty: &str| {
        admin()
            .header("ce-specversion", "1.0")
            .header("ce-id", id)
            .header("ce-source", "/test")
            .header("ce-type", ty)
    };
    api.expect(
        202,
        "POST",
        "/v1/events",
        binary("bin-1", "order.created")
            .header("ce-dataversion", "1")
            .header("ce-partitionkey", "k2")
            .raw("application/json", r#"{"order_id":"b1"}"#),
    )
    .await;
    api.expect(
        202,
        "POST",
        "/v1/events",
        binary("bin-2", "order.note").raw("text/plain", "hello"),
    )
    .await;
    api.expect(
        202,
        "POST",
        "/v1/events",
        binary("bin-3", "order.blob").raw("application/octet-stream", vec![0u8, 159, 146, 150]),
    )
    .await;

    // Ingest errors.
    api.expect(
        400,
        "POST",
        "/v1/events",
        admin().raw("application/cloudevents+json", "{nope"),
    )
    .await;
    let bad_batch = json!([ce("e-1", "order.x", json!({})), {"specversion": "1.0", "type": "x"}]);
    let b = api
        .expect(
            400,
            "POST",
            "/v1/events",
            admin().raw("application/cloudevents-batch+json", bad_batch.to_string()),
        )
        .await;
    assert!(
        b["errors"][0]["pointer"]
            .as_str()
            .unwrap_or("")
            .starts_with("/1/"),
        "{b}"
    );
    // 413 for a batch over `max_batch`. (An oversized body is answered 413 from its
    // Content-Length before the body is read, and the connection is then closed under a client
    // still sending: clients that send the whole body first may see a reset instead of the 413,
    // so that case is not asserted here.)
    let too_many: Vec<Value> = (0..6)
        .map(|i| ce(&format!("many-{i}"), "order.x", json!({})))
        .collect();
    api.expect(
        413,
        "POST",
        "/v1/events",
        admin().raw(
            "application/cloudevents-batch+json",
            serde_json::to_vec(&too_many).expect("json"),
        ),
    )
    .await;
    api.expect(
        415,
        "POST",
        "/v1/events",
        admin().raw("text/plain", "hello"),
    )
    .await;
    api.expect(
        422,
        "POST",
        "/v1/events",
        structured(&ce("s-1", "order.strict", json!({"n": "one"}))),
    )
    .await;
    api.expect(
        403,
        "POST",
        "/v1/events",
        Req::token(PRODUCER).raw(
            "application/cloudevents+json",
            ce("x-1", "bad.thing", json!({})).to_string(),
        ),
    )
    .await;
    api.expect(
        401,
        "POST",
        "/v1/events",
        Req::default().raw("application/cloudevents+json", first.to_string()),
    )
    .await;

    // --- Delivery, DLQ and fates ---
    assert!(
        ok.wait_for(Duration::from_secs(20), |s| s.len() >= 7).await,
        "the healthy webhook did not get the order events"
    );
    let broken_entry = dlq_entry_of(&api, "broken").await;
    let page = api.expect(200, "GET", "/v1/dlq", admin()).await;
    let quarantined_entry = page["entries"]
        .as_array()
        .expect("entries")
        .iter()
        .find(|e| e["reason"] == "contract_violation")
        .and_then(|e| e["id"].as_str())
        .expect("a quarantined entry")
        .to_string();
    let page = api.expect(200, "GET", "/v1/dlq?limit=1", admin()).await;
    assert!(page["next"].is_string(), "{page}");
    let next = page["next"].as_str().unwrap_or_default().to_string();
    api.expect(
        200,
        "GET",
        &format!("/v1/dlq?after={next}&limit=1000"),
        admin(),
    )
    .await;
    api.expect(
        200,
        "GET",
        "/v1/dlq?reason=contract_violation&type=order.created&since=2020-01-01T00:00:00Z",
        admin(),
    )
    .await;
    api.expect(200, "GET", "/v1/dlq?target=broken", Req::token(TEAM))
        .await;
    api.expect(
        400,
        "GET",
        "/v1/dlq?limit=0&reason=nope&since=yesterday",
        admin(),
    )
    .await;
    api.expect(200, "GET", &format!("/v1/dlq/{broken_entry}"), admin())
        .await;
    api.expect(200, "GET", &format!("/v1/dlq/{quarantined_entry}"), admin())
        .await;
    api.expect(400, "GET", "/v1/dlq/abc", admin()).await;
    api.expect(404, "GET", "/v1/dlq/987654321", admin()).await;
    api.expect(200, "GET", "/v1/dlq/summary", admin()).await;
    api.expect(
        200,
        "GET",
        "/v1/dlq/summary?bucket=5m&reason=permanent_error",
        admin(),
    )
    .await;
    api.expect(400, "GET", "/v1/dlq/summary?bucket=10ms", admin())
        .await;
    // Whole seconds only: the answer's `bucket_seconds` is the width.
    api.expect(400, "GET", "/v1/dlq/summary?bucket=1500ms", admin())
        .await;
    api.expect(400, "GET", "/v1/dlq/summary?colour=red", admin())
        .await;
    api.expect(403, "GET", "/v1/dlq/summary", Req::token(TEAM))
        .await;

    for id in ["o-1", "o-3", "b-1", "bin-1", "bin-2", "bin-3"] {
        api.expect(
            200,
            "GET",
            &format!("/v1/events/{id}?source=/test"),
            admin(),
        )
        .await;
    }
    api.expect(400, "GET", "/v1/events/o-1", admin()).await;
    // Paged: one target a page, with the totals; a cursor that is no entry of it is refused.
    let f = api
        .expect(200, "GET", "/v1/events/o-1?source=/test&limit=1", admin())
        .await;
    assert_eq!(f["targets"].as_array().map(Vec::len), Some(1), "{f}");
    api.expect(400, "GET", "/v1/events/o-1?source=/test&after=x", admin())
        .await;
    api.expect(404, "GET", "/v1/events/none?source=/test", admin())
        .await;

    // --- Targets: pause (an event waits in the queue), fate while queued, resume ---
    let t = api
        .expect(200, "POST", "/v1/targets/erp/pause", admin())
        .await;
    assert_eq!(t["paused"], true, "{t}");
    assert_eq!(
        ingest(&api, &ce("q-1", "order.created", json!({"order_id": "q"}))).await,
        "accepted"
    );
    let f = api
        .expect(200, "GET", "/v1/events/q-1?source=/test", admin())
        .await;
    assert_eq!(f["targets"][0]["state"], "queued", "{f}");
    api.expect(200, "GET", "/v1/targets", admin()).await;
    let p = api
        .expect(200, "GET", "/v1/targets?problems=true&limit=1", admin())
        .await;
    assert_eq!(p["targets"].as_array().map(Vec::len), Some(1), "{p}");
    api.expect(400, "GET", "/v1/targets?limit=0", admin()).await;
    api.expect(200, "GET", "/v1/targets/erp", admin()).await;
    api.expect(200, "GET", "/v1/targets/broken", admin()).await;
    api.expect(404, "GET", "/v1/targets/nope", admin()).await;
    api.expect(200, "POST", "/v1/targets/erp/resume", admin())
        .await;
    api.expect(404, "POST", "/v1/targets/nope/pause", admin())
        .await;
    let t = api.expect(200, "GET", "/v1/targets/broken", admin()).await;
    assert_eq!(t["held_keys"], json!(["pk1"]), "{t}");
    api.expect(200, "POST", "/v1/targets/broken/keys/pk1/release", admin())
        .await;
    api.expect(404, "POST", "/v1/targets/erp/keys/k1/release", admin())
        .await;

    // --- Rules ---
    api.expect(200, "GET", "/v1/rules", admin()).await;
    let page = api.expect(200, "GET", "/v1/rules?limit=1", admin()).await;
    let after = page["next"].as_str().expect("more than one rule");
    api.expect(200, "GET", &format!("/v1/rules?after={after}"), admin())
        .await;
    api.expect(400, "GET", "/v1/rules?after=no-such-rule", admin())
        .await;
    let m = api
        .expect(
            200,
            "POST",
            "/v1/rules/test",
            admin().json(&ce("t-1", "order.paid", json!({}))),
        )
        .await;
    assert_eq!(m["matches"][0]["rule"], "orders", "{m}");
    api.expect(
        400,
        "POST",
        "/v1/rules/test",
        admin().raw("application/json", "{"),
    )
    .await;
    // Not a CloudEvent: refused with its pointers, not matched as it is.
    let bad = api
        .expect(
            400,
            "POST",
            "/v1/rules/test",
            admin().json(&json!({"id": "x"})),
        )
        .await;
    assert!(bad.to_string().contains("/specversion"), "{bad}");
    api.expect(200, "POST", "/v1/rules/failing/disable", admin())
        .await;
    api.expect(200, "POST", "/v1/rules/failing/enable", admin())
        .await;
    api.expect(404, "POST", "/v1/rules/nope/disable", admin())
        .await;
    api.expect(404, "POST", "/v1/rules/orders/frobnicate", admin())
        .await;
    api.expect(200, "POST", "/v1/admin/reload", admin()).await;
    api.expect(403, "POST", "/v1/admin/reload", Req::token(READER))
        .await;

    // --- Contracts ---
    let list = api
        .expect(200, "GET", "/v1/contracts", Req::token(READER))
        .await;
    assert_eq!(list["contracts"][0]["type"], "order.created", "{list}");
    let one = api
        .expect(
            200,
            "GET",
            "/v1/contracts/order.created/v1",
            Req::token(READER),
        )
        .await;
    assert_eq!(one["schema"]["required"], json!(["order_id"]), "{one}");
    api.expect(
        404,
        "GET",
        "/v1/contracts/order.created/v9",
        Req::token(READER),
    )
    .await;
    api.expect(
        400,
        "GET",
        "/v1/contracts/order.created/1",
        Req::token(READER),
    )
    .await;
    // A new version may break the one before it; the answer lists how.
    let v2 = json!({
        "type": "object",
        "required": ["order_id", "total"],
        "properties": {"order_id": {"type": "integer"}, "total": {"type": "number"}},
    });
    let up = api
        .expect(
            201,
            "PUT",
            "/v1/contracts/order.created/v2",
            admin().json(&v2),
        )
        .await;
    assert_eq!(up["compared_with"], "v1", "{up}");
    assert_eq!(up["replaced"], false, "{up}");
    assert!(
        up["breaking_changes"]
            .as_array()
            .is_some_and(|b| b.len() >= 2),
        "retyped order_id and the new required total: {up}"
    );
    // A live version may only change compatibly: a property documented, not constrained (any
    // value passed the open object before).
    let mut v2_more = v2.clone();
    v2_more["properties"]["note"] = json!({"description": "free text"});
    let up = api
        .expect(
            200,
            "PUT",
            "/v1/contracts/order.created/v2",
            admin().json(&v2_more),
        )
        .await;
    assert_eq!(up["replaced"], true, "{up}");
    let refused = api
        .expect(
            409,
            "PUT",
            "/v1/contracts/order.created/v2",
            admin()
                .json(&json!({"type": "object", "properties": {"order_id": {"type": "string"}}})),
        )
        .await;
    assert!(
        refused["error"].as_str().is_some_and(|e| e.contains("v3")),
        "{refused}"
    );
    api.expect(
        422,
        "PUT",
        "/v1/contracts/order.created/v3",
        admin().json(&json!({"type": 5})),
    )
    .await;
    api.expect(
        400,
        "PUT",
        "/v1/contracts/order.created/v3",
        admin().raw("application/json", "{"),
    )
    .await;
    api.expect(
        404,
        "GET",
        "/v1/contracts/order.created/v3",
        Req::token(READER),
    )
    .await;
    api.expect(200, "GET", "/v1/status", admin()).await;
    api.expect(200, "GET", "/metrics", Req::token(READER)).await;
    api.expect(401, "GET", "/v1/status", Req::token(WRONG))
        .await;

    // --- Redrive: a job over the broken target's entries held at a crawl (so that it can be
    // paused, resumed and cancelled), and one over the quarantined events (still invalid
    // against the current contract: they stay, counted as failed) that runs to the end ---
    let job = api
        .expect(
            201,
            "POST",
            "/v1/dlq/redrive",
            admin().json(&json!({"filter": {"target": "broken"}, "rate_per_sec": 0.001})),
        )
        .await;
    let crawl = job["id"].as_str().expect("id").to_string();
    for action in ["pause", "resume", "cancel"] {
        api.expect(
            200,
            "POST",
            &format!("/v1/dlq/redrive/{crawl}/{action}"),
            admin(),
        )
        .await;
    }
    api.expect(
        409,
        "POST",
        &format!("/v1/dlq/redrive/{crawl}/resume"),
        admin(),
    )
    .await;
    let job = api
        .expect(
            201,
            "POST",
            "/v1/dlq/redrive",
            admin().json(&json!({
                "filter": {"reason": "contract_violation", "since": "2020-01-01T00:00:00Z"},
                "rate_per_sec": 100,
            })),
        )
        .await;
    let quarantine_redrive = job["id"].as_str().expect("id").to_string();
    let done = eventually(Duration::from_secs(20), || async {
        (job_state(&api, &quarantine_redrive).await == "done").then_some(())
    })
    .await;
    assert!(done.is_some(), "redrive job did not finish");
    api.expect(
        409,
        "POST",
        &format!("/v1/dlq/redrive/{quarantine_redrive}/pause"),
        admin(),
    )
    .await;
    api.expect(200, "GET", "/v1/dlq/redrive", admin()).await;
    api.expect(404, "GET", "/v1/dlq/redrive/redrive-999", admin())
        .await;
    api.expect(404, "POST", "/v1/dlq/redrive/redrive-999/cancel", admin())
        .await;
    api.expect(
        400,
        "POST",
        "/v1/dlq/redrive",
        admin().json(&json!({"rate_per_sec": 0})),
    )
    .await;
    api.expect(
        400,
        "POST",
        "/v1/dlq/redrive",
        admin().json(&json!({"filter": {"colour": 1}})),
    )
    .await;
    // The whole DLQ only when asked for; a target id that is nobody's is a 404 naming the
    // closest one.
    let b = api
        .expect(400, "POST", "/v1/dlq/redrive", admin().json(&json!({})))
        .await;
    assert_eq!(b["errors"][0]["pointer"], "/filter", "{b}");
    let b = api
        .expect(
            404,
            "POST",
            "/v1/dlq/redrive",
            admin().json(&json!({"filter": {"target": "brokne"}})),
        )
        .await;
    assert_eq!(b["errors"][0]["pointer"], "/filter/target", "{b}");
    assert!(
        b["errors"][0]["message"]
            .as_str()
            .is_some_and(|m| m.contains("did you mean \"broken\"")),
        "{b}"
    );
    // DLQ reads and purges refuse the same typo the same way (they answered "no dead
    // letters", 200, while the redrive refused it).
    for (method, path, body) in [
        ("GET", "/v1/dlq?target=brokne", None),
        ("GET", "/v1/dlq/summary?target=brokne", None),
        (
            "POST",
            "/v1/dlq/purge",
            Some(json!({"filter": {"target": "brokne"}, "dry_run": true})),
        ),
    ] {
        let req = match body {
            Some(b) => admin().json(&b),
            None => admin(),
        };
        let b = api.expect(404, method, path, req).await;
        let pointer = if method == "POST" {
            "/filter/target"
        } else {
            "/target"
        };
        assert_eq!(b["errors"][0]["pointer"], pointer, "{path}: {b}");
        assert!(
            b["errors"][0]["message"]
                .as_str()
                .is_some_and(|m| m.contains("did you mean \"broken\"")),
            "{path}: {b}"
        );
    }
    api.expect(200, "GET", "/v1/dlq?target=none", admin()).await;
    api.expect(200, "GET", "/v1/events/o-3?source=/test", admin())
        .await;

    // --- Replay: create, pause, resume, cancel ---
    let job = api
        .expect(
            201,
            "POST",
            "/v1/replay",
            admin().json(&json!({
                "from": (now - chrono::Duration::hours(1)).to_rfc3339(),
                "to": (now + chrono::Duration::hours(1)).to_rfc3339(),
                "filter": {"type": ["order.created"]},
                "rate_per_sec": 0.5,
            })),
        )
        .await;
    let replay = job["id"].as_str().expect("id").to_string();
    api.expect(200, "GET", &format!("/v1/replay/{replay}"), admin())
        .await;
    api.expect(200, "POST", &format!("/v1/replay/{replay}/pause"), admin())
        .await;
    api.expect(200, "POST", &format!("/v1/replay/{replay}/resume"), admin())
        .await;
    api.expect(200, "POST", &format!("/v1/replay/{replay}/cancel"), admin())
        .await;
    api.expect(409, "POST", &format!("/v1/replay/{replay}/cancel"), admin())
        .await;
    api.expect(404, "POST", &format!("/v1/replay/{replay}/rewind"), admin())
        .await;
    api.expect(404, "GET", "/v1/replay/replay-999", admin())
        .await;
    api.expect(200, "GET", "/v1/replay", admin()).await;
    api.expect(
        400,
        "POST",
        "/v1/replay",
        admin().json(&json!({"from": "2024-01-02T00:00:00Z", "to": "2024-01-01T00:00:00Z"})),
    )
    .await;
    api.expect(
        403,
        "POST",
        "/v1/replay",
        Req::token(TEAM).json(&json!({"from": "a", "to": "b"})),
    )
    .await;

    // --- Purge ---
    let p = api
        .expect(
            200,
            "POST",
            "/v1/dlq/purge",
            Req::token(TEAM).json(&json!({"filter": {"target": "broken"}, "dry_run": true})),
        )
        .await;
    assert_eq!(p["purged"], 0, "{p}");
    api.expect(
        200,
        "POST",
        "/v1/dlq/purge",
        admin().json(&json!({"filter": {"target": "broken"}})),
    )
    .await;
    api.expect(
        400,
        "POST",
        "/v1/dlq/purge",
        admin().json(&json!({"filter": {"since": "soon"}})),
    )
    .await;
    api.expect(
        400,
        "POST",
        "/v1/dlq/purge",
        admin().raw("application/json", ""),
    )
    .await;
    // A change's body is JSON: what a web form can post (text/plain) is not taken as such.
    api.expect(
        415,
        "POST",
        "/v1/dlq/purge",
        admin().raw("text/plain", r#"{"filter": {}, "all": true}"#),
    )
    .await;
    api.expect(
        403,
        "POST",
        "/v1/dlq/purge",
        Req::token(TEAM).json(&json!({})),
    )
    .await;
    // An empty filter purges only with "all": true (a dry run may count everything).
    let refused = api
        .expect(400, "POST", "/v1/dlq/purge", admin().json(&json!({})))
        .await;
    assert_eq!(refused["errors"][0]["pointer"], "/filter", "{refused}");
    let counted = api
        .expect(
            200,
            "POST",
            "/v1/dlq/purge",
            admin().json(&json!({"dry_run": true})),
        )
        .await;
    let all = api
        .expect(
            200,
            "POST",
            "/v1/dlq/purge",
            admin().json(&json!({"all": true})),
        )
        .await;
    assert_eq!(all["purged"], counted["matched"], "{all} {counted}");

    api.assert_no_failures();

    // Every operation answered with a success at least once, and the error statuses the
    // scenario exercises were checked.
    let covered = api.covered.lock().expect("covered").clone();
    let mut missing = Vec::new();
    for op in doc.operations() {
        if op.tags.iter().any(|t| t == "handlers") {
            continue; // handler_responses_validate_against_the_document
        }
        if !covered
            .iter()
            .any(|(id, s)| id == &op.id && (200..300).contains(s))
        {
            missing.push(format!("{}: no 2xx answer checked", op.id));
        }
    }
    let wanted: BTreeMap<&str, &[u16]> = BTreeMap::from([
        ("postEvents", &[400, 401, 403, 413, 415, 422][..]),
        ("getEventFate", &[400, 404][..]),
        ("listDlq", &[400][..]),
        ("listTargets", &[400][..]),
        ("getRules", &[400][..]),
        ("getDlqEntry", &[400, 404][..]),
        ("getDlqSummary", &[400, 403][..]),
        ("controlRedriveJob", &[404, 409][..]),
        ("controlReplayJob", &[404, 409][..]),
        ("createReplay", &[400, 403][..]),
        ("purgeDlq", &[400, 403, 415][..]),
        ("healthz", &[403][..]),
        ("readyz", &[403][..]),
        ("getContract", &[400, 404][..]),
        ("putContract", &[400, 409, 422][..]),
    ]);
    for (id, statuses) in wanted {
        for s in statuses {
            if !covered.contains(&(id.to_string(), *s)) {
                missing.push(format!("{id}: {s} not checked"));
            }
        }
    }
    assert!(
        missing.is_empty(),
        "scenario coverage:\n{}",
        missing.join("\n")
    );
}

// ---------------------------------------------------------------------------------------------
// c) continued: the handler routes, with a real component
// ---------------------------------------------------------------------------------------------

/// The `noop` example handler, built for wasm32-wasip2 in the build directory plugins/build.sh
/// uses (cargo's lock makes concurrent builds there safe).
fn noop_component() -> Vec<u8> {
    let root = repo_file("");
    let build_dir = root.join("target/plugins-build");
    let status =
        std::process::Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()))
            .current_dir(root.join("plugins"))
            .env_remove("RUSTFLAGS")
            .env_remove("CARGO_ENCODED_RUSTFLAGS")
            // scripts/test.sh lints the workspace through this wrapper; not this one.
            .env_remove("RUSTC_WORKSPACE_WRAPPER")
            .env_remove("CLIPPY_ARGS")
            .env("CARGO_TARGET_DIR", &build_dir)
            .args([
                "build",
                "--release",
                "--quiet",
                "--target",
                "wasm32-wasip2",
                "-p",
                "noop",
            ])
            .status()
            .expect("run cargo for the noop plugin");
    assert!(
        status.success(),
        "building plugins/noop failed: install the wasm32-wasip2 target (see plugins/build.sh)"
    );
    let wasm = build_dir.join("wasm32-wasip2/release/noop.wasm");
    std::fs::read(&wasm).unwrap_or_else(|e| panic!("{}: {e}", wasm.display()))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn handler_responses_validate_against_the_document() {
    let doc = Doc::load();
    let component = tokio::task::spawn_blocking(noop_component)
        .await
        .expect("build task");
    let ok = Receiver::ok().await;
    let broken = Receiver::status(400).await;
    let r = start(&ok, &broken);
    let api = Api::new(&r, &doc);
    let admin = || Req::token(ADMIN);

    api.expect(200, "GET", "/v1/handlers", admin()).await;
    api.expect(
        400,
        "PUT",
        "/v1/handlers/noop",
        admin().raw("application/wasm", "junk"),
    )
    .await;
    api.expect(
        400,
        "PUT",
        "/v1/handlers/Not%20A%20Name",
        admin().raw("application/wasm", component.clone()),
    )
    .await;
    api.expect(
        400,
        "PUT",
        "/v1/handlers/other",
        admin().raw("application/wasm", component.clone()),
    )
    .await;
    let v = api
        .expect(
            201,
            "PUT",
            "/v1/handlers/noop",
            admin().raw("application/wasm", component.clone()),
        )
        .await;
    assert_eq!(v["version"], 1, "{v}");
    // The same bytes again create nothing.
    api.expect(
        200,
        "PUT",
        "/v1/handlers/noop",
        admin().raw("application/octet-stream", component.clone()),
    )
    .await;
    api.expect(200, "GET", "/v1/handlers", admin()).await;
    api.expect(200, "GET", "/v1/handlers/noop", admin()).await;
    api.expect(
        200,
        "POST",
        "/v1/handlers/noop/rollback",
        admin().json(&json!({"version": "v1"})),
    )
    .await;
    api.expect(
        404,
        "POST",
        "/v1/handlers/noop/rollback",
        admin().json(&json!({"version": "9"})),
    )
    .await;
    api.expect(
        400,
        "POST",
        "/v1/handlers/noop/rollback",
        admin().json(&json!({})),
    )
    .await;
    api.expect(
        400,
        "POST",
        "/v1/handlers/noop/rollback",
        admin().json(&json!({"version": "abcdef1"})),
    )
    .await;

    // A handler target delivers.
    assert_eq!(
        ingest(&api, &ce("h-1", "h.thing", json!({}))).await,
        "accepted"
    );
    let delivered = eventually(Duration::from_secs(20), || async {
        let f = api
            .send("GET", "/v1/events/h-1?source=/test", admin())
            .await;
        (f.json["targets"][0]["state"] == "delivered").then_some(())
    })
    .await;
    assert!(
        delivered.is_some(),
        "the noop handler did not take the event"
    );
    api.expect(200, "GET", "/v1/targets/h", admin()).await;
    api.expect(200, "GET", "/v1/handlers/noop/logs?limit=5", admin())
        .await;
    api.expect(403, "GET", "/v1/handlers/noop/logs", Req::token(READER))
        .await;

    // A name no handler ever had has no logs (not an empty list that looks like a quiet
    // handler); a deleted handler's kept name keeps them until it is released.
    api.expect(404, "GET", "/v1/handlers/never-uploaded/logs", admin())
        .await;
    api.expect(200, "DELETE", "/v1/handlers/noop", admin())
        .await;
    api.expect(404, "DELETE", "/v1/handlers/noop", admin())
        .await;
    api.expect(404, "GET", "/v1/handlers/noop", admin()).await;
    api.expect(200, "GET", "/v1/handlers/noop/logs", admin())
        .await;
    api.expect(200, "DELETE", "/v1/handlers/noop?release=true", admin())
        .await;
    api.expect(404, "GET", "/v1/handlers/noop/logs", admin())
        .await;
    api.expect(
        404,
        "POST",
        "/v1/handlers/noop/rollback",
        admin().json(&json!({"version": "1"})),
    )
    .await;

    api.assert_no_failures();
    let covered = api.covered.lock().expect("covered").clone();
    let missing: Vec<String> = doc
        .operations()
        .into_iter()
        .filter(|op| op.tags.iter().any(|t| t == "handlers"))
        .filter(|op| {
            !covered
                .iter()
                .any(|(id, s)| id == &op.id && (200..300).contains(s))
        })
        .map(|op| op.id)
        .collect();
    assert!(
        missing.is_empty(),
        "handler operations without a checked 2xx: {missing:?}"
    );
}

/// The DLQ routes' descriptions say what the server does about the two rules a client cannot
/// guess (the behaviour itself is pinned by security.rs,
/// `a_dead_letter_without_a_target_is_not_a_teams_to_show` and
/// `a_redrive_over_the_dead_letters_without_a_target_is_no_teams`): quarantined entries are
/// no `dlq:` scope's, and a token without `read` gets 403, not 404, for a job that does not
/// exist. The document promised `dlq:*` the quarantined entries, and a 404 for an unknown job
/// "for any valid token".
#[test]
fn the_dlq_scope_descriptions_say_what_the_server_does() {
    let doc = Doc::load();
    let text = |path: &str, method: &str| {
        let t = doc.root["paths"][path][method]["description"]
            .as_str()
            .unwrap_or_else(|| panic!("{method} {path} description"));
        // Line breaks and indentation are the YAML's.
        t.split_whitespace().collect::<Vec<_>>().join(" ")
    };
    let show = text("/v1/dlq/{id}", "get");
    assert!(!show.contains("matching the empty string"), "{show}");
    assert!(
        show.contains("no `dlq:` scope covers them, not even `dlq:*`"),
        "{show}"
    );
    let control = text("/v1/dlq/redrive/{job}/{action}", "post");
    assert!(!control.contains("404 for any valid token"), "{control}");
    assert!(
        control.contains(
            "A token without `read` gets the same 403 for another team's job and for a job that does not exist"
        ),
        "{control}"
    );
}

/// What the document says of two ingest edge cases is what the server does. Before, the
/// operation called a batch "a non-empty JSON array" while `CloudEventBatchInput` (and the
/// server) take an empty one, and said a binary-mode body without `Content-Type` becomes "the
/// parsed JSON" while the server keeps a body that is not JSON as `data_base64`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_ingest_description_says_what_the_server_does() {
    let doc = Doc::load();
    let text = doc.root["paths"]["/v1/events"]["post"]["description"]
        .as_str()
        .expect("postEvents description");
    // Line breaks and indentation are the YAML's.
    let text = text.split_whitespace().collect::<Vec<_>>().join(" ");
    assert!(!text.contains("non-empty"), "{text}");
    for says in [
        "an empty array is answered 202 with no results",
        "no `Content-Type` → `data` is the body's JSON when the body is JSON, else the body is `data_base64`",
    ] {
        assert!(text.contains(says), "{text}");
    }
    let rcv = Receiver::ok().await;
    let r = RouterProc::start(
        &[("r.yaml", &webhook_rule("r", "t", &rcv.url(), "hook"))],
        &[],
    );
    let (s, b) = post_raw(&r, "application/cloudevents-batch+json", b"[]".to_vec()).await;
    assert_eq!((s, b), (202, json!({"results": []})));
    let send = |id: &'static str, body: &'static [u8]| {
        let url = r.url("/v1/events");
        async move {
            let resp = client()
                .post(url)
                .header("ce-specversion", "1.0")
                .header("ce-id", id)
                .header("ce-source", "/test")
                .header("ce-type", "t")
                .body(body)
                .send()
                .await
                .expect("send");
            resp.status().as_u16()
        }
    };
    assert_eq!(send("json", br#"{"a": 1}"#).await, 202);
    assert_eq!(send("bytes", b"\xff\x00not json").await, 202);
    assert!(
        rcv.wait_for(Duration::from_secs(20), |got| got.len() >= 2)
            .await,
        "{:?}",
        rcv.received()
    );
    let got = rcv.received();
    let by_id = |id: &str| {
        got.iter()
            .find(|g| g.body["id"] == id)
            .map(|g| g.body.clone())
            .unwrap_or_default()
    };
    assert_eq!(by_id("json")["data"], json!({"a": 1}));
    assert_eq!(by_id("bytes")["data_base64"], json!("/wBub3QganNvbg=="));
    assert_eq!(by_id("bytes")["data"], Value::Null);
}

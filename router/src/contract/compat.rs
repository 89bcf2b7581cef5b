//! Contract stage, authoring time: compares a new version of a type's `data` schema with the
//! previous one (`router contracts check`, and on upload). Only adding optional properties is
//! compatible; a change the checker cannot prove compatible is reported as breaking.

use std::collections::{BTreeMap, BTreeSet};

use jsonschema::{Draft, Registry, Uri};
use serde_json::{Map, Value};

use crate::event::pointer_token;

/// One incompatibility, with where it shows in the new schema (a JSON pointer into it).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Issue {
    pub pointer: String,
    pub message: String,
}

/// Compares schema `new` against the previous version `old` and returns one message per
/// incompatible change, each naming the property path (`customer.address.zip`, `lines[].sku`;
/// `(root)` for the top level). An empty list means compatible.
///
/// The two must be written for the same draft (`$schema`; absent means 2020-12): the drafts
/// validate differently, so a change of draft is reported. Local `$ref`s (JSON pointers,
/// `$anchor`s, `$id`s, resolved as the validator resolves them) are expanded first, so a change
/// inside a definition counts where it is used; a reference that cannot be followed (a
/// `$dynamicRef`, …) freezes every `$defs`/`definitions` entry instead. Then `type`,
/// `properties`, `required`, `items` (also tuple `items` arrays and `prefixItems`) are walked
/// recursively. Incompatible: a property removed, a `type` changed (any change of the set of
/// types, including adding or dropping the keyword), an optional property made required, a new
/// property that is required, a new property the old schema already constrained some other way
/// (`additionalProperties`, `unevaluatedProperties`, `patternProperties`, `required`, a schema
/// applied beside it such as an `allOf` member), `items` switching between its tuple and single
/// forms, a schema that became `false`. Every other keyword that constrains values (`enum`,
/// `const`, bounds, lengths, `pattern`, `format`, `additionalProperties`,
/// `allOf`/`anyOf`/`oneOf`/`not`, conditionals, …) may be dropped when dropping it can only
/// loosen (every old value still passes, as when a required property becomes optional, or an
/// array's `items` goes) but not added or changed: the checker does not prove such changes safe,
/// so they need a new version. Annotations (`title`, `description`, `examples`, `default`, …)
/// may change freely.
pub fn check_compatibility(old: &Value, new: &Value) -> Vec<String> {
    compat_issues(old, new)
        .into_iter()
        .map(|i| i.message)
        .collect()
}

/// Keywords that only annotate: changing them changes no validation result. `$id` and
/// `$anchor` only name places for `$ref`s, which are expanded before anything is compared.
/// (`contentMediaType` and `contentEncoding` are not here: draft 7 asserts them.)
const ANNOTATIONS: &[&str] = &[
    "title",
    "description",
    "examples",
    "default",
    "$comment",
    "deprecated",
    "readOnly",
    "writeOnly",
    "$id",
    "$anchor",
    "$defs",
    "definitions",
];

/// Keywords the walk compares itself.
const WALKED: &[&str] = &["type", "properties", "required", "items", "prefixItems"];

/// Keywords whose removal can only let more values through (every old value still passes).
/// An allow-list: a keyword not named here (a tightening one such as `minContains`, which
/// defaults to 1, an unknown one, an unresolved `$ref`) counts as breaking when dropped.
const LOOSEN_WHEN_DROPPED: &[&str] = &[
    "enum",
    "const",
    "multipleOf",
    "maximum",
    "exclusiveMaximum",
    "minimum",
    "exclusiveMinimum",
    "maxLength",
    "minLength",
    "pattern",
    "format",
    "contentMediaType",
    "contentEncoding",
    "contentSchema",
    "maxItems",
    "minItems",
    "uniqueItems",
    "contains",
    "maxContains",
    "additionalItems",
    "unevaluatedItems",
    "maxProperties",
    "minProperties",
    "dependentRequired",
    "dependentSchemas",
    "dependencies",
    "propertyNames",
    "additionalProperties",
    "unevaluatedProperties",
    "allOf",
    "anyOf",
    "oneOf",
    "not",
    "if",
    "then",
    "else",
];

/// Keywords whose results `unevaluatedProperties`/`unevaluatedItems` read: dropping one of
/// them hands what it evaluated over to those, which may refuse it.
const EVALUATING: &[&str] = &[
    "patternProperties",
    "additionalProperties",
    "dependentSchemas",
    "dependencies",
    "allOf",
    "anyOf",
    "oneOf",
    "if",
    "then",
    "else",
    "contains",
    "additionalItems",
];

/// Keywords that constrain values only together (one reads what the others evaluated or
/// say): a `$ref` target and its siblings that split one of these groups are not one schema.
const INTERACTING: &[&[&str]] = &[
    &["properties", "patternProperties", "additionalProperties"],
    &["prefixItems", "items", "additionalItems"],
    &["contains", "minContains", "maxContains"],
    &["if", "then", "else"],
];

/// References the checker does not follow to their target.
const REFERENCES: &[&str] = &["$ref", "$dynamicRef", "$recursiveRef"];

/// Most schema nodes expanding `$ref`s may produce per side: a schema whose references
/// multiply past this is reported as too large to check rather than expanded without bound.
const MAX_EXPANDED_NODES: usize = 200_000;

/// What the validator takes as the base URI of a document without `$id`.
const DEFAULT_BASE_URI: &str = "json-schema:///";

/// The draft a contract is written for, read from `$schema` as `contract::compile` reads it
/// (absent: 2020-12).
#[derive(Debug, PartialEq)]
enum Dialect<'a> {
    Known(Draft),
    /// Not a draft the checker knows: only the very same value is the same dialect.
    Other(&'a Value),
}

impl Dialect<'_> {
    fn of(schema: &Value) -> Dialect<'_> {
        match schema.get("$schema") {
            None => Dialect::Known(Draft::Draft202012),
            Some(v @ Value::String(uri)) => match Draft::from_schema_uri(uri) {
                Draft::Unknown => Dialect::Other(v),
                draft => Dialect::Known(draft),
            },
            Some(other) => Dialect::Other(other),
        }
    }

    /// The draft the references and `$ref` siblings are read with.
    fn draft(&self) -> Draft {
        match self {
            Dialect::Known(draft) => *draft,
            Dialect::Other(_) => Draft::Draft202012,
        }
    }

    fn name(&self) -> String {
        match self {
            Dialect::Known(Draft::Draft202012) => "2020-12".to_owned(),
            Dialect::Known(Draft::Draft201909) => "2019-09".to_owned(),
            Dialect::Known(Draft::Draft7) => "draft-07".to_owned(),
            Dialect::Known(Draft::Draft6) => "draft-06".to_owned(),
            Dialect::Known(Draft::Draft4) => "draft-04".to_owned(),
            Dialect::Known(other) => format!("{other:?}"),
            Dialect::Other(value) => value.to_string(),
        }
    }
}

/// A schema with its references expanded.
struct Expanded {
    schema: Value,
    /// The references left as they are: what they point at was not compared.
    unresolved: Vec<String>,
}

/// `schema` with its `$ref`s replaced by what they point at (resolved as the validator does:
/// JSON pointers, `$anchor`s, `$id`s, each against the base URI where it stands). In 2020-12
/// the reference's sibling keywords are kept beside the target's, or beside it under an
/// `allOf` where the two could not be read as one schema; drafts before 2019-09 ignore the
/// siblings, and so does this. A reference already being expanded on the way down (a recursive
/// schema) becomes a marker naming where that expansion sits, so two schemas recursing to
/// different places differ. `None` past [`MAX_EXPANDED_NODES`].
fn expand(schema: &Value, draft: Draft) -> Option<Expanded> {
    let resource = draft.create_resource_ref(schema);
    let base = jsonschema::uri::from_str(resource.id().unwrap_or(DEFAULT_BASE_URI)).ok();
    // A document whose references the library cannot index (one pointing outside it, …):
    // nothing is followed, and every reference counts as unresolved.
    let registry = base.as_ref().and_then(|base| {
        Registry::new()
            .draft(draft)
            .retrieve_known_draft_meta_schemas(false)
            .add(base.as_str(), resource)
            .ok()?
            .prepare()
            .ok()
    });
    let mut expander = Expander {
        registry: registry.as_ref(),
        draft,
        budget: MAX_EXPANDED_NODES,
        stack: vec![(schema, String::new())],
        unresolved: Vec::new(),
    };
    let expanded = expander.schema(schema, base.as_ref(), "")?;
    Some(Expanded {
        schema: expanded,
        unresolved: expander.unresolved,
    })
}

/// The state of one [`expand`]: the document's resolver, the node budget, the way down.
struct Expander<'s> {
    registry: Option<&'s Registry<'s>>,
    draft: Draft,
    budget: usize,
    /// The reference targets being expanded on the way down, each with where its expansion
    /// sits in the output (a JSON pointer).
    stack: Vec<(&'s Value, String)>,
    unresolved: Vec<String>,
}

impl<'s> Expander<'s> {
    /// One schema standing at `at` in the output, with `base` the URI its references resolve
    /// against (`None`: unknown, so none is followed).
    fn schema(&mut self, node: &'s Value, base: Option<&Uri<String>>, at: &str) -> Option<Value> {
        self.budget = self.budget.checked_sub(1)?;
        let Value::Object(map) = node else {
            return self.verbatim(node);
        };
        let base = base.and_then(|base| self.enter(node, base));
        let base = base.as_ref();
        for key in ["$dynamicRef", "$recursiveRef"] {
            if let Some(r) = map.get(key) {
                self.unresolved.push(display_ref(r));
            }
        }
        let reference = map.get("$ref");
        // Drafts 4 to 7 ignore every sibling of `$ref`.
        let siblings_apply = reference.is_none()
            || !matches!(self.draft, Draft::Draft4 | Draft::Draft6 | Draft::Draft7);
        let mut out = Map::new();
        if let Some(r) = reference {
            match r.as_str().and_then(|r| self.lookup(r, base)) {
                None => {
                    self.unresolved.push(display_ref(r));
                    out.insert("$ref".to_owned(), r.clone());
                }
                Some((target, _)) if let Some(to) = self.recursion(target) => {
                    out.insert(
                        "$ref".to_owned(),
                        Value::String(format!("(recursion to #{to})")),
                    );
                }
                Some((target, target_base)) => {
                    let apart = siblings_apply && must_stay_apart(target, map);
                    let target_at = if apart {
                        format!("{at}/allOf/0")
                    } else {
                        at.to_owned()
                    };
                    self.stack.push((target, target_at.clone()));
                    let expanded = self.schema(target, target_base.as_ref(), &target_at);
                    self.stack.pop();
                    match expanded? {
                        // `false` stays decisive whatever the siblings say.
                        Value::Bool(false) => return Some(Value::Bool(false)),
                        Value::Bool(_) => {}
                        Value::Object(t) if apart => {
                            let siblings = self.keywords(map, base, &format!("{at}/allOf/1"))?;
                            out.insert(
                                "allOf".to_owned(),
                                Value::Array(vec![Value::Object(t), Value::Object(siblings)]),
                            );
                            return Some(Value::Object(out));
                        }
                        Value::Object(t) => out.extend(t),
                        // Not a schema: the validator refuses it; keep the reference as written.
                        _ => {
                            self.unresolved.push(display_ref(r));
                            out.insert("$ref".to_owned(), r.clone());
                        }
                    }
                }
            }
        }
        if siblings_apply {
            out.extend(self.keywords(map, base, at)?);
        }
        Some(Value::Object(out))
    }

    /// Where the expansion of `target` sits, when it is under way on the way down.
    fn recursion(&self, target: &Value) -> Option<String> {
        self.stack
            .iter()
            .find(|(t, _)| std::ptr::eq(*t, target))
            .map(|(_, at)| at.clone())
    }

    /// The keywords of a schema object other than `$ref` and the definitions (compared where
    /// they are used), each expanded as what it holds.
    fn keywords(
        &mut self,
        map: &'s Map<String, Value>,
        base: Option<&Uri<String>>,
        at: &str,
    ) -> Option<Map<String, Value>> {
        let mut out = Map::new();
        for (k, v) in map {
            if k == "$ref" || k == "$defs" || k == "definitions" {
                continue;
            }
            let at = format!("{at}/{}", pointer_token(k));
            out.insert(k.clone(), self.keyword(k, v, base, &at)?);
        }
        Some(out)
    }

    /// The value of keyword `key`: schemas are expanded, anything else (`const`, `enum`, an
    /// unknown keyword, …) is data and kept as written, whatever `$ref` it may spell.
    fn keyword(
        &mut self,
        key: &str,
        value: &'s Value,
        base: Option<&Uri<String>>,
        at: &str,
    ) -> Option<Value> {
        match (key, value) {
            (
                "additionalProperties"
                | "unevaluatedProperties"
                | "unevaluatedItems"
                | "propertyNames"
                | "contains"
                | "not"
                | "if"
                | "then"
                | "else"
                | "additionalItems"
                | "contentSchema"
                | "items",
                Value::Object(_) | Value::Bool(_),
            ) => self.schema(value, base, at),
            (
                "properties" | "patternProperties" | "dependentSchemas" | "dependencies",
                Value::Object(m),
            ) => {
                let mut out = Map::new();
                for (k, v) in m {
                    let at = format!("{at}/{}", pointer_token(k));
                    // `dependencies` also holds arrays of names (draft 7).
                    let v = if v.is_object() || v.is_boolean() {
                        self.schema(v, base, &at)?
                    } else {
                        self.verbatim(v)?
                    };
                    out.insert(k.clone(), v);
                }
                Some(Value::Object(out))
            }
            ("allOf" | "anyOf" | "oneOf" | "prefixItems" | "items", Value::Array(a)) => a
                .iter()
                .enumerate()
                .map(|(i, v)| self.schema(v, base, &format!("{at}/{i}")))
                .collect::<Option<Vec<_>>>()
                .map(Value::Array),
            _ => self.verbatim(value),
        }
    }

    /// `value` as written, its nodes charged to the budget like expanded ones.
    fn verbatim(&mut self, value: &Value) -> Option<Value> {
        fn count(v: &Value) -> usize {
            match v {
                Value::Array(a) => 1 + a.iter().map(count).sum::<usize>(),
                Value::Object(m) => 1 + m.values().map(count).sum::<usize>(),
                _ => 1,
            }
        }
        self.budget = self.budget.checked_sub(count(value))?;
        Some(value.clone())
    }

    /// The base URI inside `node`, which may set its own with `$id`.
    fn enter(&self, node: &Value, base: &Uri<String>) -> Option<Uri<String>> {
        let registry = self.registry?;
        let inside = registry
            .resolver(base.clone())
            .in_subresource(self.draft.create_resource_ref(node))
            .ok()?;
        Some((*inside.base_uri()).clone())
    }

    /// The target of reference `r` standing where the base URI is `base`, with the base URI
    /// inside it. `None` when it does not resolve, or resolves into another draft's schema
    /// (a meta-schema), which the expansion would read with the wrong rules.
    fn lookup(
        &self,
        r: &str,
        base: Option<&Uri<String>>,
    ) -> Option<(&'s Value, Option<Uri<String>>)> {
        let (registry, base) = (self.registry?, base?);
        let (target, resolver, draft) =
            registry.resolver(base.clone()).lookup(r).ok()?.into_inner();
        (draft == self.draft).then(|| (target, Some((*resolver.base_uri()).clone())))
    }
}

/// A reference as written, for messages (a malformed one as its JSON).
fn display_ref(r: &Value) -> String {
    r.as_str().map_or_else(|| r.to_string(), str::to_owned)
}

/// Whether a `$ref` target and the reference's siblings cannot be merged into one object
/// without changing what they accept together: a keyword on both sides, a group of
/// interacting keywords split between them, an `unevaluated*` keyword (it reads what all the
/// others evaluated), or a target that is itself a reference.
fn must_stay_apart(target: &Value, node: &Map<String, Value>) -> bool {
    let Value::Object(target) = target else {
        // A boolean target merges trivially (`true` adds nothing, `false` wins).
        return false;
    };
    let constraining = |m: &Map<String, Value>| -> BTreeSet<String> {
        m.keys()
            .filter(|k| {
                !ANNOTATIONS.contains(&k.as_str())
                    && k.as_str() != "$schema"
                    && k.as_str() != "$ref"
            })
            .cloned()
            .collect()
    };
    let (t, s) = (constraining(target), constraining(node));
    let target_refers = REFERENCES.iter().any(|r| target.contains_key(*r));
    if s.is_empty() || (t.is_empty() && !target_refers) {
        return false;
    }
    let touches = |keys: &BTreeSet<String>, group: &[&str]| group.iter().any(|g| keys.contains(*g));
    target_refers
        || !t.is_disjoint(&s)
        || INTERACTING
            .iter()
            .any(|group| touches(&t, group) && touches(&s, group))
        || touches(&t, &["unevaluatedProperties", "unevaluatedItems"])
        || touches(&s, &["unevaluatedProperties", "unevaluatedItems"])
}

pub(crate) fn compat_issues(old: &Value, new: &Value) -> Vec<Issue> {
    let _patterns = PatternScope::enter();
    let mut out = Vec::new();
    let (old_dialect, new_dialect) = (Dialect::of(old), Dialect::of(new));
    if old_dialect != new_dialect {
        out.push(Issue {
            pointer: if new.get("$schema").is_some() {
                "/$schema".to_owned()
            } else {
                String::new()
            },
            message: format!(
                "property `(root)`: `$schema` changed from {} to {}: the drafts validate \
                 differently",
                old_dialect.name(),
                new_dialect.name()
            ),
        });
    }
    let (Some(old_x), Some(new_x)) = (
        expand(old, old_dialect.draft()),
        expand(new, new_dialect.draft()),
    ) else {
        out.push(Issue {
            pointer: String::new(),
            message: format!(
                "the schema's `$ref`s expand past {MAX_EXPANDED_NODES} nodes: too large to check \
                 for compatibility"
            ),
        });
        return out;
    };
    walk(&old_x.schema, &new_x.schema, "", "", false, &mut out);
    if let Some(r) = old_x.unresolved.first().or(new_x.unresolved.first()) {
        definitions_unchanged(old, new, r, &mut out);
    }
    // An issue found in an expanded `$ref` target is placed where the target is used.
    for issue in &mut out {
        issue.pointer = within(new, &issue.pointer).to_owned();
    }
    out
}

/// [`compat_issues`] for an edit in place of a live version, which must accept every value
/// the version accepted: also a new property named where the old object was open (no
/// `additionalProperties: false` or `unevaluatedProperties: false` beside it), with a schema
/// that does not accept everything. Between versions that is an optional field added, which the
/// SPEC calls compatible (producers of the new version send it as documented); in place it
/// narrows what was valid: `extra: "x"` passed the open v1 and is quarantined once v1 names
/// `extra` an integer.
pub(crate) fn in_place_issues(old: &Value, new: &Value) -> Vec<Issue> {
    let mut out = compat_issues(old, new);
    let (Some(old_x), Some(new_x)) = (
        expand(old, Dialect::of(old).draft()),
        expand(new, Dialect::of(new).draft()),
    ) else {
        return out;
    };
    let mut named = Vec::new();
    newly_named(&old_x.schema, &new_x.schema, "", "", &mut named);
    for mut issue in named {
        issue.pointer = within(new, &issue.pointer).to_owned();
        if !out.iter().any(|o| o.pointer == issue.pointer) {
            out.push(issue);
        }
    }
    out
}

/// Whether `schema` is an object of annotations only (`description`, `title`, …): it accepts
/// every value.
fn annotates_only(schema: &Value) -> bool {
    schema
        .as_object()
        .is_some_and(|m| m.keys().all(|k| ANNOTATIONS.contains(&k.as_str())))
}

/// The walk of [`in_place_issues`]: properties (and single-schema `items`) present in both,
/// and the new properties of objects the old schema left open.
///
/// Boolean schemas are read as what they are wherever the walk descends: `true` is `{}` (any
/// value passed, so what the new side names there narrows it), and `false` accepted nothing
/// (so nothing named under it can refuse an event that passed). Without this an `items: true`
/// edited into `items: {"properties": …}` was let through, though `true` is exactly `{}`.
fn newly_named(old: &Value, new: &Value, path: &str, ptr: &str, out: &mut Vec<Issue>) {
    let (Some(old), Some(new)) = (as_object_schema(old), as_object_schema(new)) else {
        return;
    };
    let (old, new) = (&old, &new);
    if let Some(new_props) = properties(new) {
        let closed = ["additionalProperties", "unevaluatedProperties"]
            .iter()
            .any(|k| old.get(*k).is_some_and(rejects_all));
        let none = Map::new();
        let old_props = properties(old).unwrap_or(&none);
        for (name, new_schema) in new_props {
            let at = format!("{ptr}/properties/{}", pointer_token(name));
            match old_props.get(name) {
                Some(old_schema) => {
                    newly_named(old_schema, new_schema, &child(path, name), &at, out)
                }
                None if !closed && !accepts_all(new_schema) && !annotates_only(new_schema) => {
                    out.push(Issue {
                        pointer: at,
                        message: format!(
                            "new property `{}` in a live version whose object was open: any value \
                         was valid there, so naming it may quarantine events that passed",
                            child(path, name)
                        ),
                    });
                }
                None => {}
            }
        }
    }
    // Items: an array the old schema left without `items` (or without a position of a tuple)
    // held any value there, so a property named under it now narrows that as much as one
    // named in an open object. A changed form (tuple against one schema) is [`items`]'s.
    let open = Value::Object(Map::new());
    match (old.get("items"), new.get("items")) {
        (Some(Value::Array(o)), Some(Value::Array(n))) => {
            tuple_named(o, n, path, ptr, "items", out)
        }
        (None, Some(Value::Array(n))) => tuple_named(&[], n, path, ptr, "items", out),
        (Some(o), Some(n)) if is_schema(o) && is_schema(n) => {
            newly_named(o, n, &format!("{path}[]"), &format!("{ptr}/items"), out);
        }
        (None, Some(n)) if is_schema(n) => {
            newly_named(&open, n, &format!("{path}[]"), &format!("{ptr}/items"), out);
        }
        _ => {}
    }
    match (old.get("prefixItems"), new.get("prefixItems")) {
        (Some(Value::Array(o)), Some(Value::Array(n))) => {
            tuple_named(o, n, path, ptr, "prefixItems", out);
        }
        (None, Some(Value::Array(n))) => tuple_named(&[], n, path, ptr, "prefixItems", out),
        _ => {}
    }
}

/// [`newly_named`] position by position of a tuple (`items` in draft-07, `prefixItems`); a
/// position the old tuple did not have held any value.
fn tuple_named(
    old: &[Value],
    new: &[Value],
    path: &str,
    ptr: &str,
    key: &str,
    out: &mut Vec<Issue>,
) {
    let open = Value::Object(Map::new());
    for (i, n) in new.iter().enumerate() {
        let o = old.get(i).unwrap_or(&open);
        if is_schema(o) && is_schema(n) {
            newly_named(
                o,
                n,
                &format!("{path}[{i}]"),
                &format!("{ptr}/{key}/{i}"),
                out,
            );
        }
    }
}

/// The longest prefix of `pointer` that exists in `doc`.
fn within<'p>(doc: &Value, mut pointer: &'p str) -> &'p str {
    while !pointer.is_empty() && doc.pointer(pointer).is_none() {
        pointer = &pointer[..pointer.rfind('/').unwrap_or(0)];
    }
    pointer
}

/// With a reference left unresolved (`r`), what it points at was never compared: any change
/// to a definition could reach where it is used, so each changed one is an issue.
fn definitions_unchanged(old: &Value, new: &Value, r: &str, out: &mut Vec<Issue>) {
    fn collect<'v>(v: &'v Value, at: &str, defs: &mut BTreeMap<String, &'v Value>) {
        match v {
            Value::Object(m) => {
                for (k, v) in m {
                    let at = format!("{at}/{}", pointer_token(k));
                    match v {
                        Value::Object(entries) if k == "$defs" || k == "definitions" => {
                            for (name, entry) in entries {
                                defs.insert(format!("{at}/{}", pointer_token(name)), entry);
                            }
                        }
                        _ => collect(v, &at, defs),
                    }
                }
            }
            Value::Array(a) => {
                for (i, v) in a.iter().enumerate() {
                    collect(v, &format!("{at}/{i}"), defs);
                }
            }
            _ => {}
        }
    }
    let (mut o, mut n) = (BTreeMap::new(), BTreeMap::new());
    collect(old, "", &mut o);
    collect(new, "", &mut n);
    let places: BTreeSet<&String> = o.keys().chain(n.keys()).collect();
    for at in places {
        if !same_value(None, o.get(at).copied(), n.get(at).copied()) {
            out.push(Issue {
                pointer: at.clone(),
                message: format!(
                    "definition `{at}` changed while the reference `{r}` is not one the checker \
                     can follow, so the change may reach where it is used; the checker cannot \
                     prove that compatible"
                ),
            });
        }
    }
}

/// A boolean schema as the object it stands for (`true` is `{}`); `None` for a schema no
/// value satisfies (`false`, or its object spelling `{"not": {}}`).
fn as_object_schema(schema: &Value) -> Option<Value> {
    match schema {
        Value::Bool(true) => Some(Value::Object(Map::new())),
        s if rejects_all(s) => None,
        other => Some(other.clone()),
    }
}

/// A subschema no value satisfies: `false`, or `{"not": {}}` / `{"not": true}` (with
/// annotations only beside it), which JSON Schema defines `false` to be.
fn rejects_all(schema: &Value) -> bool {
    match schema {
        Value::Bool(b) => !*b,
        Value::Object(m) => {
            m.get("not").is_some_and(accepts_all)
                && m.keys()
                    .all(|k| k == "not" || ANNOTATIONS.contains(&k.as_str()))
        }
        _ => false,
    }
}

/// Keywords whose value is data (instances compared with JSON Schema's equality), not schemas.
const DATA_KEYWORDS: &[&str] = &["const", "enum", "default", "examples"];

/// Keywords whose array value is a set: its order and repeats change nothing.
const SET_KEYWORDS: &[&str] = &["enum", "required", "type"];

/// Whether two values of keyword `key` (`None`: two schemas) say the same thing: equal once
/// written the same way. A formatter or schema generator that rewrites `10` as `10.0`, or
/// sorts an `enum`, changes no validation result, and was refused in place as an incompatible
/// change.
fn same_value(key: Option<&str>, a: Option<&Value>, b: Option<&Value>) -> bool {
    match (a, b) {
        // The common case, and the cheap one: written the same.
        (a, b) if a == b => true,
        (Some(a), Some(b)) => canonical_keyword(key, a, false) == canonical_keyword(key, b, false),
        _ => false,
    }
}

/// The value `v` of keyword `key` (`None`: a schema) written one way, `data` when it stands
/// in data: numbers by their value (JSON Schema holds `1` and `1.0` equal), object members in
/// name order, and in a schema (not in data: a `const` holding `{"enum": [...]}`) the arrays
/// of [`SET_KEYWORDS`] sorted without repeats.
fn canonical_keyword(key: Option<&str>, v: &Value, data: bool) -> Value {
    let is_set = !data && key.is_some_and(|k| SET_KEYWORDS.contains(&k));
    let mut c = canonical(v, data || key.is_some_and(|k| DATA_KEYWORDS.contains(&k)));
    if is_set && let Value::Array(items) = &mut c {
        items.sort_by_cached_key(Value::to_string);
        items.dedup();
    }
    c
}

/// `v` written one way (see [`canonical_keyword`]); `data` when it stands in data.
fn canonical(v: &Value, data: bool) -> Value {
    match v {
        Value::Number(n) => Value::Number(canonical_number(n)),
        Value::Array(a) => Value::Array(a.iter().map(|x| canonical(x, data)).collect()),
        Value::Object(m) => {
            let mut keys: Vec<&String> = m.keys().collect();
            keys.sort();
            let mut out = Map::new();
            for k in keys {
                if let Some(x) = m.get(k) {
                    out.insert(k.clone(), canonical_keyword(Some(k), x, data));
                }
            }
            Value::Object(out)
        }
        other => other.clone(),
    }
}

/// A number with an integral value written as an integer (`10.0` → `10`), when it fits one.
fn canonical_number(n: &serde_json::Number) -> serde_json::Number {
    const I64_RANGE: f64 = 9_223_372_036_854_775_808.0; // 2^63
    match n.as_f64() {
        Some(f) if !n.is_i64() && !n.is_u64() && f.fract() == 0.0 && f.abs() < I64_RANGE => {
            // Integral and within range (checked above): the cast is exact.
            serde_json::Number::from(f as i64)
        }
        _ => n.clone(),
    }
}

/// Whether `value` is a schema (an object or a boolean), as a subschema position holds.
fn is_schema(value: &Value) -> bool {
    value.is_object() || value.is_boolean()
}

/// A subschema that accepts everything (`true`, `{}`), so its presence constrains nothing.
fn accepts_all(schema: &Value) -> bool {
    match schema {
        Value::Bool(b) => *b,
        Value::Object(m) => m.is_empty(),
        _ => false,
    }
}

fn display(path: &str) -> &str {
    if path.is_empty() { "(root)" } else { path }
}

fn child(path: &str, name: &str) -> String {
    if path.is_empty() {
        name.to_owned()
    } else {
        format!("{path}.{name}")
    }
}

fn type_set(schema: &Value) -> Option<BTreeSet<String>> {
    match schema.get("type")? {
        Value::String(s) => Some(BTreeSet::from([s.clone()])),
        Value::Array(a) => Some(
            a.iter()
                .filter_map(Value::as_str)
                .map(str::to_owned)
                .collect(),
        ),
        _ => None,
    }
}

fn fmt_types(t: Option<&BTreeSet<String>>) -> String {
    match t {
        None => "(any)".to_owned(),
        Some(set) if set.len() == 1 => set.iter().map(|s| format!("\"{s}\"")).collect(),
        Some(set) => {
            let items: Vec<String> = set.iter().map(|s| format!("\"{s}\"")).collect();
            format!("[{}]", items.join(", "))
        }
    }
}

fn required(schema: &Value) -> BTreeSet<&str> {
    schema
        .get("required")
        .and_then(Value::as_array)
        .map(|a| a.iter().filter_map(Value::as_str).collect())
        .unwrap_or_default()
}

fn properties(schema: &Value) -> Option<&Map<String, Value>> {
    schema.get("properties").and_then(Value::as_object)
}

/// The subschemas applied to the same value as `schema` itself (in place), each with its
/// keyword: the walk compares them only as a whole.
fn in_place(schema: &Value) -> Vec<(&'static str, &Value)> {
    let mut out = Vec::new();
    for key in ["allOf", "anyOf", "oneOf"] {
        if let Some(a) = schema.get(key).and_then(Value::as_array) {
            out.extend(a.iter().map(|s| (key, s)));
        }
    }
    for key in ["not", "if", "then", "else"] {
        if let Some(s) = schema.get(key) {
            out.push((key, s));
        }
    }
    for key in ["dependentSchemas", "dependencies"] {
        if let Some(m) = schema.get(key).and_then(Value::as_object) {
            out.extend(m.values().filter(|s| !s.is_array()).map(|s| (key, s)));
        }
    }
    out
}

fn has_reference(schema: &Value) -> bool {
    REFERENCES.iter().any(|r| schema.get(*r).is_some())
}

thread_local! {
    /// The `patternProperties` regexes compiled by the comparison running on this thread
    /// (`None`: does not compile, taken to match every name). [`walk`] asks for every property
    /// of every schema, so compiling each time made 10,000 properties beside 20 patterns cost
    /// 90 s; a comparison compiles each pattern once.
    static PATTERNS: std::cell::RefCell<std::collections::HashMap<String, Option<regex::Regex>>> =
        std::cell::RefCell::new(std::collections::HashMap::new());
}

/// Empties [`PATTERNS`] when a comparison ends, so the cache holds only the patterns of the
/// comparison running (a nested one would only clear it early: compiled again, not wrong).
struct PatternScope;

impl PatternScope {
    fn enter() -> Self {
        PatternScope
    }
}

impl Drop for PatternScope {
    fn drop(&mut self) {
        PATTERNS.with(|p| p.borrow_mut().clear());
    }
}

fn matches_pattern(schema: &Value, name: &str) -> bool {
    let Some(patterns) = schema.get("patternProperties").and_then(Value::as_object) else {
        return false;
    };
    PATTERNS.with(|cache| {
        let mut cache = cache.borrow_mut();
        patterns.keys().any(|pat| {
            if !cache.contains_key(pat) {
                #[cfg(test)]
                tests::PATTERNS_COMPILED.with(|n| n.set(n.get() + 1));
                cache.insert(pat.clone(), regex::Regex::new(pat).ok());
            }
            cache
                .get(pat)
                .is_none_or(|re| re.as_ref().is_none_or(|re| re.is_match(name)))
        })
    })
}

/// What in `schema` other than its own `properties` says something about a property `name`
/// (the keyword, for the message), so that naming it now may change what it accepts.
/// `own` is the schema the walk stands on, where `additionalProperties: false` (and the like)
/// forbade the property, so that allowing it now is an addition; in a subschema applied
/// beside it, that and `properties` count too.
fn constrains_property(schema: &Value, name: &str, own: bool) -> Option<&'static str> {
    if !schema.is_object() {
        return None;
    }
    if !own && properties(schema).is_some_and(|p| p.contains_key(name)) {
        return Some("properties");
    }
    for key in ["additionalProperties", "unevaluatedProperties"] {
        if schema
            .get(key)
            .is_some_and(|s| !accepts_all(s) && (!own || !rejects_all(s)))
        {
            return Some(key);
        }
    }
    if matches_pattern(schema, name) {
        return Some("patternProperties");
    }
    if required(schema).contains(name) {
        return Some("required");
    }
    for key in ["dependentRequired", "dependencies"] {
        let mentions = schema.get(key).and_then(Value::as_object).is_some_and(|m| {
            m.iter().any(|(k, v)| {
                k == name || v.as_array().is_some_and(|a| a.iter().any(|n| n == name))
            })
        });
        if mentions {
            return Some(key);
        }
    }
    if let Some(r) = REFERENCES.iter().find(|r| schema.get(**r).is_some()) {
        return Some(r);
    }
    in_place(schema)
        .into_iter()
        .find(|(_, s)| constrains_property(s, name, false).is_some())
        .map(|(key, _)| key)
}

/// Like [`constrains_property`], for the items of an array that had no `items`.
fn constrains_items(schema: &Value, own: bool) -> Option<&'static str> {
    if !schema.is_object() {
        return None;
    }
    if !own
        && let Some(key) = ["items", "prefixItems", "additionalItems"]
            .into_iter()
            .find(|k| schema.get(*k).is_some())
    {
        return Some(key);
    }
    if schema
        .get("unevaluatedItems")
        .is_some_and(|s| !accepts_all(s) && (!own || !rejects_all(s)))
    {
        return Some("unevaluatedItems");
    }
    if schema.get("contains").is_some() {
        return Some("contains");
    }
    if let Some(r) = REFERENCES.iter().find(|r| schema.get(**r).is_some()) {
        return Some(r);
    }
    in_place(schema)
        .into_iter()
        .find(|(_, s)| constrains_items(s, false).is_some())
        .map(|(key, _)| key)
}

/// What already constrained a place the new schema now names, for the message.
fn constrained_by(enclosed: bool, keyword: Option<&str>) -> Option<String> {
    if enclosed {
        Some("a schema applied around it".to_owned())
    } else {
        keyword.map(|k| format!("`{k}`"))
    }
}

/// `old` compared with `new` at property path `path` (`ptr` in the schema). `enclosed`: a part
/// of the old schema the walk does not follow (a subschema applied beside an ancestor, a
/// matching `patternProperties`, an unresolved reference) may also constrain this place, so
/// the properties it did not name are not free to be named.
fn walk(old: &Value, new: &Value, path: &str, ptr: &str, enclosed: bool, out: &mut Vec<Issue>) {
    let (old, new) = match (as_object_schema(old), as_object_schema(new)) {
        (_, None) if !rejects_all(old) => {
            out.push(Issue {
                pointer: ptr.to_owned(),
                message: format!(
                    "property `{}`: the schema became `false`, which no value satisfies",
                    display(path)
                ),
            });
            return;
        }
        // Forbidden before (`false`): nothing was sent, so anything now is an addition.
        (None, _) | (_, None) => return,
        (Some(o), Some(n)) => (o, n),
    };
    let (old, new) = (&old, &new);
    if !old.is_object() || !new.is_object() {
        // Not a schema where one belongs (the validator refuses it): only no change at all is
        // provably compatible.
        if !same_value(None, Some(old), Some(new)) {
            out.push(Issue {
                pointer: ptr.to_owned(),
                message: format!(
                    "property `{}`: the schema changed; the checker cannot prove that \
                     compatible",
                    display(path)
                ),
            });
        }
        return;
    }
    other_keywords(old, new, path, ptr, out);
    let (ot, nt) = (type_set(old), type_set(new));
    if ot != nt {
        let pointer = if new.get("type").is_some() {
            format!("{ptr}/type")
        } else {
            ptr.to_owned()
        };
        out.push(Issue {
            pointer,
            message: format!(
                "property `{}`: type changed from {} to {}",
                display(path),
                fmt_types(ot.as_ref()),
                fmt_types(nt.as_ref())
            ),
        });
    }

    let empty = Map::new();
    let old_props = properties(old).unwrap_or(&empty);
    let new_props = properties(new).unwrap_or(&empty);
    let (old_req, new_req) = (required(old), required(new));

    for (name, old_sub) in old_props {
        let path = child(path, name);
        match new_props.get(name) {
            None => out.push(Issue {
                pointer: if properties(new).is_some() {
                    format!("{ptr}/properties")
                } else {
                    ptr.to_owned()
                },
                message: format!("property `{path}` was removed"),
            }),
            Some(new_sub) => {
                let enclosed = enclosed
                    || matches_pattern(old, name)
                    || has_reference(old)
                    || in_place(old)
                        .iter()
                        .any(|(_, s)| constrains_property(s, name, false).is_some());
                walk(
                    old_sub,
                    new_sub,
                    &path,
                    &format!("{ptr}/properties/{}", pointer_token(name)),
                    enclosed,
                    out,
                );
            }
        }
    }
    // A property the old schema did not name but still constrained (an open content model
    // with a schema, a matching pattern, a requirement, a subschema applied beside it):
    // naming it now may change what it accepts.
    for name in new_props.keys().filter(|n| !old_props.contains_key(*n)) {
        if let Some(by) = constrained_by(enclosed, constrains_property(old, name, true)) {
            out.push(Issue {
                pointer: format!("{ptr}/properties/{}", pointer_token(name)),
                message: format!(
                    "new property `{}` was already constrained by {by}: naming it may change \
                     what it accepts",
                    child(path, name)
                ),
            });
        }
    }
    for name in new_req.difference(&old_req) {
        let path = child(path, name);
        let message = if old_props.contains_key(*name) {
            format!("property `{path}` became required")
        } else {
            format!("new property `{path}` is required (only optional properties may be added)")
        };
        out.push(Issue {
            pointer: format!("{ptr}/required"),
            message,
        });
    }

    items(old, new, path, ptr, enclosed, out);
}

/// `items` and `prefixItems` of the schemas [`walk`] compares.
fn items(old: &Value, new: &Value, path: &str, ptr: &str, enclosed: bool, out: &mut Vec<Issue>) {
    let items_path = format!("{path}[]");
    let items_ptr = format!("{ptr}/items");
    let any = Value::Object(Map::new());
    let enclosed_items = enclosed
        || has_reference(old)
        || in_place(old)
            .iter()
            .any(|(_, s)| constrains_items(s, false).is_some());
    match (old.get("items"), new.get("items")) {
        (Some(Value::Array(o)), Some(Value::Array(n))) => {
            tuple(o, n, path, &items_ptr, enclosed_items, out);
        }
        (Some(o), Some(n)) if o.is_array() || n.is_array() => out.push(Issue {
            pointer: items_ptr,
            message: format!(
                "property `{}`: `items` changed between a tuple (an array of schemas) and one \
                 schema for every item; the checker cannot prove that compatible",
                display(path)
            ),
        }),
        (Some(o), Some(n)) => walk(o, n, &items_path, &items_ptr, enclosed_items, out),
        (None, Some(n)) => {
            if let Some(by) = constrained_by(enclosed, constrains_items(old, true)) {
                out.push(Issue {
                    pointer: items_ptr,
                    message: format!(
                        "property `{}`: new `items` where the items were already constrained by \
                         {by}: it may change what they accept",
                        display(path)
                    ),
                });
            } else if let Value::Array(n) = n {
                let o = vec![any; n.len()];
                tuple(&o, n, path, &items_ptr, false, out);
            } else {
                walk(&any, n, &items_path, &items_ptr, false, out);
            }
        }
        // The constraint dropped: every old array still passes, unless what `items`
        // evaluated now falls to `unevaluatedItems`.
        (Some(_), None) => {
            if new.get("unevaluatedItems").is_some_and(|s| !accepts_all(s)) {
                out.push(Issue {
                    pointer: ptr.to_owned(),
                    message: format!(
                        "property `{}`: `items` was removed, so the items fall to \
                         `unevaluatedItems`; the checker cannot prove that compatible",
                        display(path)
                    ),
                });
            }
        }
        (None, None) => {}
    }
    match (old.get("prefixItems"), new.get("prefixItems")) {
        (Some(Value::Array(o)), Some(Value::Array(n))) => {
            tuple(
                o,
                n,
                path,
                &format!("{ptr}/prefixItems"),
                enclosed_items,
                out,
            );
        }
        (None, None) => {}
        _ => out.push(Issue {
            pointer: ptr.to_owned(),
            message: format!("property `{}`: `prefixItems` changed", display(path)),
        }),
    }
}

fn tuple(
    old: &[Value],
    new: &[Value],
    path: &str,
    ptr: &str,
    enclosed: bool,
    out: &mut Vec<Issue>,
) {
    if old.len() != new.len() {
        out.push(Issue {
            pointer: ptr.to_owned(),
            message: format!(
                "property `{}`: the tuple went from {} to {} positions",
                display(path),
                old.len(),
                new.len()
            ),
        });
    }
    for (i, (o, n)) in old.iter().zip(new).enumerate() {
        walk(
            o,
            n,
            &format!("{path}[{i}]"),
            &format!("{ptr}/{i}"),
            enclosed,
            out,
        );
    }
}

/// Why dropping keyword `key` (which held `was`) from a schema that becomes `new` may refuse
/// an old value; `None` when it can only loosen.
fn dropped(key: &str, was: &Value, new: &Map<String, Value>) -> Option<&'static str> {
    let evaluated_later = ["unevaluatedProperties", "unevaluatedItems"]
        .iter()
        .any(|k| new.get(*k).is_some_and(|s| !accepts_all(s)));
    if evaluated_later && EVALUATING.contains(&key) {
        return Some(
            "was removed, so what it evaluated falls to `unevaluatedProperties`/\
             `unevaluatedItems`",
        );
    }
    match key {
        // Without it, `contains` asks for at least one match.
        "minContains" => {
            let loosens = !new.contains_key("contains") || was.as_f64().is_some_and(|n| n >= 1.0);
            (!loosens).then_some("was removed, which makes it 1 where `contains` applies")
        }
        // Its properties fall to `additionalProperties`/`unevaluatedProperties`, if any.
        "patternProperties" => {
            let loosens = ["additionalProperties", "unevaluatedProperties"]
                .iter()
                .all(|k| new.get(*k).is_none_or(accepts_all));
            (!loosens).then_some(
                "was removed, so its properties fall to `additionalProperties`/\
                 `unevaluatedProperties`",
            )
        }
        _ if LOOSEN_WHEN_DROPPED.contains(&key) => None,
        _ => Some("was removed"),
    }
}

/// Every keyword other than those the walk compares and the annotations must be unchanged
/// (compared after `$ref`s are expanded, so a change in a definition they use counts), or
/// dropped where that can only loosen.
fn other_keywords(old: &Value, new: &Value, path: &str, ptr: &str, out: &mut Vec<Issue>) {
    let (Some(o), Some(n)) = (old.as_object(), new.as_object()) else {
        return;
    };
    let keys: BTreeSet<&String> = o.keys().chain(n.keys()).collect();
    for key in keys {
        if WALKED.contains(&key.as_str()) || ANNOTATIONS.contains(&key.as_str()) {
            continue;
        }
        // The document's dialect, compared once by `compat_issues`.
        if key == "$schema" && ptr.is_empty() {
            continue;
        }
        if same_value(Some(key), o.get(key), n.get(key)) {
            continue;
        }
        let what = match (o.get(key), n.get(key)) {
            (None, _) => "was added",
            (Some(was), None) => match dropped(key, was, n) {
                None => continue,
                Some(why) => why,
            },
            _ => "changed",
        };
        out.push(Issue {
            pointer: if n.contains_key(key) {
                format!("{ptr}/{}", pointer_token(key))
            } else {
                ptr.to_owned()
            },
            message: format!(
                "property `{}`: `{key}` {what}; the checker cannot prove that compatible",
                display(path)
            ),
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn v1() -> Value {
        json!({
            "type": "object",
            "required": ["id"],
            "properties": {
                "id": {"type": "string"},
                "total": {"type": "number"},
                "customer": {
                    "type": "object",
                    "properties": {"email": {"type": "string"}, "zip": {"type": "string"}}
                },
                "lines": {
                    "type": "array",
                    "items": {"type": "object", "properties": {"sku": {"type": "string"}}}
                }
            }
        })
    }

    #[test]
    fn identical_is_compatible() {
        assert!(check_compatibility(&v1(), &v1()).is_empty());
    }

    #[test]
    fn adding_optional_property_is_compatible() {
        let mut v2 = v1();
        v2["properties"]["note"] = json!({"type": "string"});
        v2["properties"]["customer"]["properties"]["phone"] = json!({"type": "string"});
        assert_eq!(check_compatibility(&v1(), &v2), Vec::<String>::new());
    }

    #[test]
    fn removing_a_property_is_flagged() {
        let mut v2 = v1();
        v2["properties"].as_object_mut().unwrap().remove("total");
        assert_eq!(
            check_compatibility(&v1(), &v2),
            ["property `total` was removed"]
        );
    }

    #[test]
    fn retyping_is_flagged() {
        let mut v2 = v1();
        v2["properties"]["total"]["type"] = json!("string");
        assert_eq!(
            check_compatibility(&v1(), &v2),
            ["property `total`: type changed from \"number\" to \"string\""]
        );
    }

    #[test]
    fn type_array_order_does_not_matter() {
        let old = json!({"type": ["string", "null"]});
        let new = json!({"type": ["null", "string"]});
        assert!(check_compatibility(&old, &new).is_empty());
        let issues = check_compatibility(&json!({"type": "object"}), &json!({"type": "array"}));
        assert_eq!(
            issues,
            ["property `(root)`: type changed from \"object\" to \"array\""]
        );
    }

    #[test]
    fn optional_becoming_required_is_flagged() {
        let mut v2 = v1();
        v2["required"] = json!(["id", "total"]);
        assert_eq!(
            check_compatibility(&v1(), &v2),
            ["property `total` became required"]
        );
    }

    #[test]
    fn new_required_property_is_flagged() {
        let mut v2 = v1();
        v2["properties"]["currency"] = json!({"type": "string"});
        v2["required"] = json!(["id", "currency"]);
        let issues = check_compatibility(&v1(), &v2);
        assert_eq!(issues.len(), 1);
        assert!(
            issues[0].starts_with("new property `currency` is required"),
            "{issues:?}"
        );
    }

    #[test]
    fn required_becoming_optional_is_allowed() {
        let mut v2 = v1();
        v2["required"] = json!([]);
        assert!(check_compatibility(&v1(), &v2).is_empty());
    }

    #[test]
    fn nested_and_items_changes_are_flagged_with_paths() {
        let mut v2 = v1();
        let cust = &mut v2["properties"]["customer"];
        cust["properties"].as_object_mut().unwrap().remove("email");
        cust["properties"]["zip"]["type"] = json!("integer");
        cust["required"] = json!(["zip"]);
        v2["properties"]["lines"]["items"]["properties"]["sku"]["type"] = json!("number");
        let issues = compat_issues(&v1(), &v2);
        let messages: Vec<&str> = issues.iter().map(|i| i.message.as_str()).collect();
        assert_eq!(
            messages,
            [
                "property `customer.email` was removed",
                "property `customer.zip`: type changed from \"string\" to \"integer\"",
                "property `customer.zip` became required",
                "property `lines[].sku`: type changed from \"string\" to \"number\"",
            ]
        );
        assert_eq!(
            issues[1].pointer,
            "/properties/customer/properties/zip/type"
        );
        assert_eq!(
            issues[3].pointer,
            "/properties/lines/items/properties/sku/type"
        );
    }

    #[test]
    fn tuple_items() {
        let old = json!({"prefixItems": [{"type": "string"}, {"type": "number"}]});
        let new = json!({"prefixItems": [{"type": "string"}, {"type": "string"}]});
        assert_eq!(
            check_compatibility(&old, &new),
            ["property `[1]`: type changed from \"number\" to \"string\""]
        );
    }

    fn flagged(old: Value, new: Value) -> Vec<String> {
        check_compatibility(&old, &new)
    }

    #[test]
    fn changes_inside_referenced_definitions_count_where_they_are_used() {
        let with_zip = |t: &str| {
            json!({"type": "object", "properties": {"c": {"$ref": "#/$defs/C"}},
                   "$defs": {"C": {"type": "object", "properties": {"zip": {"type": t}}}}})
        };
        let issues = flagged(with_zip("string"), with_zip("integer"));
        assert_eq!(issues.len(), 1, "{issues:?}");
        assert!(issues[0].contains("c.zip"), "{issues:?}");
        // A root reference, draft 7 `definitions`.
        let root = |t: &str| {
            json!({"$ref": "#/definitions/O",
                   "definitions": {"O": {"type": "object", "properties": {"id": {"type": t}}}}})
        };
        assert_eq!(flagged(root("string"), root("integer")).len(), 1);
        // The same schema written inline or through a reference: nothing changed.
        let inline = json!({"properties": {"c": {"type": "string"}}});
        let by_ref =
            json!({"properties": {"c": {"$ref": "#/$defs/S"}}, "$defs": {"S": {"type": "string"}}});
        assert!(flagged(inline, by_ref).is_empty());
    }

    #[test]
    fn recursive_references_are_compared_without_looping() {
        let tree = |t: &str| {
            json!({"$ref": "#/$defs/node", "$defs": {"node": {"type": "object",
                "properties": {"v": {"type": t}, "kids": {"type": "array", "items": {"$ref": "#/$defs/node"}}}}}})
        };
        assert!(flagged(tree("string"), tree("string")).is_empty());
        assert!(!flagged(tree("string"), tree("integer")).is_empty());
    }

    #[test]
    fn constraints_may_be_dropped_but_not_added_or_changed() {
        let s = |extra: Value| {
            let mut base = json!({"type": "object", "properties": {"a": {"type": "string"}}});
            base["properties"]["a"]
                .as_object_mut()
                .unwrap()
                .extend(extra.as_object().unwrap().clone());
            base
        };
        for (old, new) in [
            (json!({"enum": ["a", "b"]}), json!({"enum": ["a"]})),
            (
                json!({"enum": ["a", "b"]}),
                json!({"enum": ["a", "b", "c"]}),
            ),
            (json!({"maxLength": 255}), json!({"maxLength": 8})),
            (json!({}), json!({"format": "email"})),
            (json!({}), json!({"pattern": "^[A-Z]+$"})),
            (json!({"const": "x"}), json!({"const": "y"})),
            (json!({}), json!({"not": {"const": ""}})),
        ] {
            assert!(
                !flagged(s(old.clone()), s(new.clone())).is_empty(),
                "{old} -> {new}"
            );
        }
        for (old, new) in [
            (json!({"maxLength": 255}), json!({})),
            (
                json!({"title": "A"}),
                json!({"title": "B", "description": "d"}),
            ),
        ] {
            assert!(
                flagged(s(old.clone()), s(new.clone())).is_empty(),
                "{old} -> {new}"
            );
        }
        // At the object level: closing it, or a conditional requirement.
        let open = json!({"type": "object", "properties": {"a": {"type": "string"}}});
        let mut closed = open.clone();
        closed["additionalProperties"] = json!(false);
        assert!(!flagged(open.clone(), closed.clone()).is_empty());
        assert!(flagged(closed, open.clone()).is_empty());
        let mut conditional = open.clone();
        conditional["dependentRequired"] = json!({"a": ["b"]});
        assert!(!flagged(open.clone(), conditional).is_empty());
        let mut wrapped = open.clone();
        wrapped["allOf"] = json!([{"properties": {"a": {"type": "string", "minLength": 1}}}]);
        assert!(!flagged(open, wrapped).is_empty());
    }

    thread_local! {
        /// `patternProperties` regexes compiled on this thread (see `matches_pattern`).
        pub(super) static PATTERNS_COMPILED: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
    }

    /// Each pattern is compiled once per comparison, not once per property it is tried on
    /// (10,000 properties beside 20 patterns took 90 s).
    #[test]
    fn pattern_properties_compile_once_per_comparison() {
        let mut props = Map::new();
        for i in 0..500 {
            props.insert(format!("p{i}"), json!({"type": "string"}));
        }
        let patterns: Map<String, Value> = (0..20)
            .map(|i| (format!("^x{i}_"), json!({"type": "integer"})))
            .collect();
        let schema = json!({"properties": props, "patternProperties": patterns});
        PATTERNS_COMPILED.with(|n| n.set(0));
        assert!(compat_issues(&schema, &schema).is_empty());
        assert_eq!(PATTERNS_COMPILED.with(std::cell::Cell::get), 20);
        // The next comparison starts afresh: its patterns may be others.
        assert!(in_place_issues(&schema, &schema).is_empty());
        assert_eq!(PATTERNS_COMPILED.with(std::cell::Cell::get), 40);
        PATTERNS.with(|p| assert!(p.borrow().is_empty()));
    }

    /// The audit's four in-place edits that quarantined events the live version accepted:
    /// a property named under items that were unconstrained, or under a tuple position.
    #[test]
    fn in_place_a_new_property_under_items_or_a_tuple_is_flagged() {
        let x = json!({"properties": {"x": {"type": "integer"}}});
        let obj_x = json!({"type": "object", "properties": {"x": {"type": "integer"}}});
        let cases = [
            // `items` added where the array had none.
            (
                json!({"type": "object", "properties": {"l": {"type": "array"}}}),
                json!({"type": "object", "properties": {"l": {"type": "array", "items": x}}}),
                "/properties/l/items/properties/x",
            ),
            // The same at the root, with no `type` beside it.
            (
                json!({"type": "array"}),
                json!({"type": "array", "items": x}),
                "/items/properties/x",
            ),
            // A `prefixItems` position.
            (
                json!({"type": "object", "properties": {"l": {"type": "array",
                       "prefixItems": [{"type": "object"}]}}}),
                json!({"type": "object", "properties": {"l": {"type": "array",
                       "prefixItems": [obj_x]}}}),
                "/properties/l/prefixItems/0/properties/x",
            ),
            // A draft-07 tuple (`items` as an array).
            (
                json!({"$schema": "http://json-schema.org/draft-07/schema#", "type": "object",
                       "properties": {"l": {"type": "array", "items": [{"type": "object"}]}}}),
                json!({"$schema": "http://json-schema.org/draft-07/schema#", "type": "object",
                       "properties": {"l": {"type": "array", "items": [obj_x]}}}),
                "/properties/l/items/0/properties/x",
            ),
        ];
        for (old, new, at) in cases {
            assert!(
                compat_issues(&old, &new).is_empty(),
                "a new version may: {new}"
            );
            let issues = in_place_issues(&old, &new);
            assert_eq!(issues.len(), 1, "{new}: {issues:?}");
            assert_eq!(issues[0].pointer, at);
            // Annotating only, or naming it in a closed item object, narrows nothing.
            let annotated = new
                .to_string()
                .replace(r#"{"type":"integer"}"#, r#"{"title":"x"}"#);
            let annotated: Value = serde_json::from_str(&annotated).unwrap();
            assert!(in_place_issues(&old, &annotated).is_empty(), "{annotated}");
        }
    }

    /// Boolean schemas are what they are wherever the in-place walk descends: `true` is `{}`,
    /// so a property named under `items: true`, a `prefixItems: [true]` position or a draft-07
    /// `items: [true]` position narrows what passed (the audit's three edits that a check and
    /// the API let through, quarantining `{"l": [{"sku": 1}]}` the version had accepted);
    /// under `false` nothing passed, so nothing named there can refuse an old event.
    #[test]
    fn in_place_boolean_schemas_are_read_as_what_they_are() {
        let d7 = "http://json-schema.org/draft-07/schema#";
        let sku = json!({"properties": {"sku": {"type": "string"}}});
        let obj = |l: Value| json!({"type": "object", "properties": {"l": l}});
        let with = |mut s: Value, k: &str, v: Value| {
            s[k] = v;
            s
        };
        for (any, old, new, at) in [
            (
                "items_true_to_props",
                obj(json!({"type": "array", "items": true})),
                obj(json!({"type": "array", "items": sku})),
                "/properties/l/items/properties/sku",
            ),
            (
                "items_empty_to_props",
                obj(json!({"type": "array", "items": {}})),
                obj(json!({"type": "array", "items": sku})),
                "/properties/l/items/properties/sku",
            ),
            (
                "prefix_true_to_props",
                obj(json!({"type": "array", "prefixItems": [true]})),
                obj(json!({"type": "array", "prefixItems": [sku]})),
                "/properties/l/prefixItems/0/properties/sku",
            ),
            (
                "d7_tuple_true_to_props",
                with(
                    obj(json!({"type": "array", "items": [true]})),
                    "$schema",
                    json!(d7),
                ),
                with(
                    obj(json!({"type": "array", "items": [sku]})),
                    "$schema",
                    json!(d7),
                ),
                "/properties/l/items/0/properties/sku",
            ),
            (
                "prop_true_to_props",
                obj(json!(true)),
                obj(sku.clone()),
                "/properties/l/properties/sku",
            ),
            (
                "root_true_to_props",
                json!(true),
                sku.clone(),
                "/properties/sku",
            ),
            (
                "additional_items_true",
                with(
                    obj(json!({"type": "array", "items": [{}], "additionalItems": true})),
                    "$schema",
                    json!(d7),
                ),
                with(
                    obj(json!({"type": "array", "items": [sku], "additionalItems": true})),
                    "$schema",
                    json!(d7),
                ),
                "/properties/l/items/0/properties/sku",
            ),
        ] {
            assert!(
                compat_issues(&old, &new).is_empty(),
                "{any}: a new version may"
            );
            let issues = in_place_issues(&old, &new);
            assert_eq!(issues.len(), 1, "{any}: {issues:?}");
            assert_eq!(issues[0].pointer, at, "{any}");
            assert!(
                issues[0].message.contains("new property") && issues[0].message.contains("sku"),
                "{any}: {issues:?}"
            );
        }
        // Under `false` (or its spelling `{"not": {}}`) nothing was valid: naming anything
        // there only allows more.
        for nothing in [json!(false), json!({"not": {}}), json!({"not": true})] {
            for (old, new) in [
                (
                    obj(json!({"type": "array", "items": nothing})),
                    obj(json!({"type": "array", "items": sku})),
                ),
                (
                    obj(json!({"type": "array", "prefixItems": [nothing]})),
                    obj(json!({"type": "array", "prefixItems": [sku]})),
                ),
                (obj(nothing.clone()), obj(sku.clone())),
            ] {
                assert!(in_place_issues(&old, &new).is_empty(), "{old} -> {new}");
            }
            // An object closed by such an `additionalProperties` forbade the new property.
            let closed =
                json!({"type": "object", "properties": {}, "additionalProperties": nothing});
            let mut opened = closed.clone();
            opened["properties"]["n"] = json!({"type": "integer"});
            assert!(in_place_issues(&closed, &opened).is_empty(), "{closed}");
            assert!(flagged(closed.clone(), opened).is_empty(), "{closed}");
        }
        // A schema become `{"not": {}}` is one become `false`.
        let a = |s: Value| json!({"properties": {"a": s}});
        assert_eq!(
            flagged(a(json!({})), a(json!({"not": {}}))),
            ["property `a`: the schema became `false`, which no value satisfies"]
        );
    }

    /// Edits that change no validation result are not changes: a number written another way
    /// (`10` → `10.0`), an `enum` (or `required`, `type`) reordered. A formatter or schema
    /// generator doing either was refused in place with "publish it as v2".
    #[test]
    fn rewriting_a_schema_without_changing_it_is_no_change() {
        let s = |extra: Value| {
            let mut base = json!({"type": "object", "properties": {"a": {}}});
            base["properties"]["a"] = extra;
            base
        };
        for (old, new) in [
            (json!({"maximum": 10}), json!({"maximum": 10.0})),
            (json!({"minimum": -0.0}), json!({"minimum": 0})),
            (
                json!({"enum": ["a", "b", 1]}),
                json!({"enum": [1, "b", "a"]}),
            ),
            (json!({"enum": [1, 2]}), json!({"enum": [2.0, 1.0]})),
            (
                json!({"const": {"x": 1, "y": [1, 2]}}),
                json!({"const": {"y": [1.0, 2], "x": 1.0}}),
            ),
            (
                json!({"allOf": [{"type": ["string", "null"], "enum": ["x", null]}]}),
                json!({"allOf": [{"type": ["null", "string"], "enum": [null, "x"]}]}),
            ),
            (
                json!({"type": "object", "required": ["p", "q"], "dependentRequired": {"p": ["q"]}}),
                json!({"type": "object", "required": ["q", "p"], "dependentRequired": {"p": ["q"]}}),
            ),
        ] {
            assert!(
                flagged(s(old.clone()), s(new.clone())).is_empty(),
                "{old} -> {new}"
            );
            assert!(
                in_place_issues(&s(old.clone()), &s(new.clone())).is_empty(),
                "{old} -> {new}"
            );
        }
        // Still changes: another value, and the order of data (an array in a `const`, or in an
        // `enum` member, is a value whose order counts).
        for (old, new) in [
            (json!({"maximum": 10}), json!({"maximum": 10.5})),
            (json!({"enum": ["a", "b"]}), json!({"enum": ["a", "c"]})),
            (json!({"const": [1, 2]}), json!({"const": [2, 1]})),
            (json!({"enum": [[1, 2]]}), json!({"enum": [[2, 1]]})),
            (
                json!({"const": {"enum": [1, 2]}}),
                json!({"const": {"enum": [2, 1]}}),
            ),
            (
                json!({"prefixItems": [{"type": "string"}, {}]}),
                json!({"prefixItems": [{}, {"type": "string"}]}),
            ),
        ] {
            assert!(
                !flagged(s(old.clone()), s(new.clone())).is_empty(),
                "{old} -> {new}"
            );
        }
    }

    /// In place, a property named where the object was open narrows what the live version
    /// accepted; between versions it is the optional field the SPEC calls compatible.
    #[test]
    fn in_place_a_new_property_of_an_open_object_is_flagged() {
        let open = json!({"type": "object", "properties": {"a": {"type": "string"},
                          "o": {"type": "object", "properties": {}}}});
        let mut typed = open.clone();
        typed["properties"]["extra"] = json!({"type": "integer"});
        assert!(
            compat_issues(&open, &typed).is_empty(),
            "a new version may add it"
        );
        let issues = in_place_issues(&open, &typed);
        assert_eq!(issues.len(), 1, "{issues:?}");
        assert_eq!(issues[0].pointer, "/properties/extra");
        // Nested, and under `items`.
        let mut nested = open.clone();
        nested["properties"]["o"]["properties"]["n"] = json!({"enum": [1]});
        assert_eq!(
            in_place_issues(&open, &nested)[0].pointer,
            "/properties/o/properties/n"
        );
        let list = json!({"type": "array", "items": {"type": "object", "properties": {}}});
        let mut listed = list.clone();
        listed["items"]["properties"]["sku"] = json!({"type": "string"});
        assert_eq!(in_place_issues(&list, &listed).len(), 1);
        // Named with a schema that accepts anything: nothing narrows.
        let mut annotated = open.clone();
        annotated["properties"]["extra"] = json!({"description": "documented"});
        assert!(in_place_issues(&open, &annotated).is_empty());
        // A closed object forbade it: allowing it in place only loosens.
        let mut closed = open.clone();
        closed["additionalProperties"] = json!(false);
        let mut opened = closed.clone();
        opened["properties"]["extra"] = json!({"type": "integer"});
        assert!(in_place_issues(&closed, &opened).is_empty());
        assert!(in_place_issues(&open, &open).is_empty());
    }

    #[test]
    fn false_schemas_and_covered_new_properties_are_flagged() {
        let a = |s: Value| json!({"properties": {"a": s}});
        assert!(!flagged(a(json!({})), a(json!(false))).is_empty());
        assert!(!flagged(json!(true), json!(false)).is_empty());
        assert!(flagged(a(json!(false)), a(json!({"type": "string"}))).is_empty());
        // `n` was allowed as a string through additionalProperties; naming it may change that.
        let old = json!({"type": "object", "additionalProperties": {"type": "string"}});
        let mut new = old.clone();
        new["properties"] = json!({"n": {"type": "integer"}});
        assert!(!flagged(old, new).is_empty());
        let old = json!({"type": "object", "patternProperties": {"^x_": {"type": "string"}}});
        let mut covered = old.clone();
        covered["properties"] = json!({"x_n": {"type": "integer"}});
        assert!(!flagged(old.clone(), covered).is_empty());
        let mut not_covered = old.clone();
        not_covered["properties"] = json!({"n": {"type": "integer"}});
        assert!(flagged(old, not_covered).is_empty());
        // A closed model: the property was forbidden, so adding it optional is an addition.
        let closed =
            json!({"type": "object", "properties": {"a": {}}, "additionalProperties": false});
        let mut added = closed.clone();
        added["properties"]["b"] = json!({"type": "integer"});
        assert!(flagged(closed, added).is_empty());
    }

    #[test]
    fn tuples_that_change_length_are_flagged() {
        let t = |items: Value| json!({"type": "array", "prefixItems": items});
        assert!(
            !flagged(
                t(json!([{"type": "string"}])),
                t(json!([{"type": "string"}, {"type": "boolean"}]))
            )
            .is_empty()
        );
        assert!(!flagged(t(json!([{"type": "string"}])), json!({"type": "array"})).is_empty());
    }

    const DRAFT7: &str = "http://json-schema.org/draft-07/schema#";

    /// The issues as (pointer, message) pairs, for asserting both.
    fn located(old: &Value, new: &Value) -> Vec<(String, String)> {
        compat_issues(old, new)
            .into_iter()
            .map(|i| (i.pointer, i.message))
            .collect()
    }

    #[test]
    fn anchor_references_are_followed_into_definitions() {
        let anchored = |t: &str| {
            json!({"type": "object", "properties": {"a": {"$ref": "#addr"}},
                   "$defs": {"x": {"$anchor": "addr", "type": t}}})
        };
        assert_eq!(
            located(&anchored("string"), &anchored("integer")),
            [(
                "/properties/a".to_owned(),
                "property `a`: type changed from \"string\" to \"integer\"".to_owned()
            )]
        );
        assert!(flagged(anchored("string"), anchored("string")).is_empty());
        // The anchor moved to another definition, the schema it names unchanged.
        let moved = json!({"type": "object", "properties": {"a": {"$ref": "#addr"}},
                           "$defs": {"y": {"$anchor": "addr", "type": "string"}}});
        assert!(flagged(anchored("string"), moved).is_empty());
        // Draft 7 spells an anchor as a fragment-only `$id`.
        let draft7 = |t: &str| {
            json!({"$schema": DRAFT7, "properties": {"a": {"$ref": "#addr"}},
                   "definitions": {"x": {"$id": "#addr", "type": t}}})
        };
        assert_eq!(flagged(draft7("string"), draft7("integer")).len(), 1);
        assert!(flagged(draft7("string"), draft7("string")).is_empty());
    }

    #[test]
    fn id_references_are_followed_into_definitions() {
        let by_id = |t: &str| {
            json!({"type": "object", "properties": {"a": {"$ref": "addr"}},
                   "$defs": {"x": {"$id": "addr", "type": t}}})
        };
        assert_eq!(
            located(&by_id("string"), &by_id("integer")),
            [(
                "/properties/a".to_owned(),
                "property `a`: type changed from \"string\" to \"integer\"".to_owned()
            )]
        );
        assert!(flagged(by_id("string"), by_id("string")).is_empty());
        // A pointer resolves against the `$id` it stands under, not the document root.
        let nested = |t: &str| {
            json!({"properties": {"a": {"$ref": "addr"}},
                   "$defs": {"x": {"$id": "addr", "properties": {"z": {"$ref": "#/$defs/z"}},
                                   "$defs": {"z": {"type": t}}},
                             "z": {"type": "string"}}})
        };
        let issues = flagged(nested("boolean"), nested("integer"));
        assert_eq!(
            issues,
            ["property `a.z`: type changed from \"boolean\" to \"integer\""]
        );
    }

    #[test]
    fn definitions_are_frozen_while_a_reference_stays_unresolved() {
        let dynamic = |t: &str| {
            json!({"type": "object", "properties": {"a": {"$dynamicRef": "#addr"}},
                   "$defs": {"x": {"$dynamicAnchor": "addr", "type": t}}})
        };
        let issues = located(&dynamic("string"), &dynamic("integer"));
        assert_eq!(issues.len(), 1, "{issues:?}");
        assert_eq!(issues[0].0, "/$defs/x");
        assert!(issues[0].1.contains("`#addr`"), "{issues:?}");
        // Definitions unchanged: an optional property may still be added.
        let mut added = dynamic("string");
        added["properties"]["b"] = json!({"type": "string"});
        assert!(flagged(dynamic("string"), added).is_empty());
        // Changing or dropping the reference itself is reported too.
        let mut dropped = dynamic("string");
        dropped["properties"]["a"] = json!({});
        assert!(!flagged(dynamic("string"), dropped).is_empty());
    }

    #[test]
    fn a_change_of_draft_is_flagged_at_the_root() {
        let schema = |dialect: Option<&str>| {
            let mut s = json!({"type": "object", "properties": {"a": {"type": "string"}}});
            if let Some(d) = dialect {
                s["$schema"] = json!(d);
            }
            s
        };
        assert_eq!(
            located(&schema(Some(DRAFT7)), &schema(None)),
            [(
                String::new(),
                "property `(root)`: `$schema` changed from draft-07 to 2020-12: the drafts \
                 validate differently"
                    .to_owned()
            )]
        );
        let issues = located(&schema(None), &schema(Some(DRAFT7)));
        assert_eq!(issues.len(), 1, "{issues:?}");
        assert_eq!(issues[0].0, "/$schema");
        let v2020 = "https://json-schema.org/draft/2020-12/schema";
        assert_eq!(flagged(schema(Some(v2020)), schema(Some(DRAFT7))).len(), 1);
        // The same draft, however spelt (absent is 2020-12), is no change.
        assert!(flagged(schema(Some(v2020)), schema(None)).is_empty());
        assert!(flagged(schema(None), schema(Some(v2020))).is_empty());
        assert!(
            flagged(
                schema(Some(DRAFT7)),
                schema(Some("http://json-schema.org/draft-07/schema"))
            )
            .is_empty()
        );
        assert!(flagged(schema(Some(DRAFT7)), schema(Some(DRAFT7))).is_empty());
    }

    #[test]
    fn ref_siblings_are_read_as_the_draft_reads_them() {
        // Draft 7 ignores `type` beside `$ref`: `a` was a string, and is an integer now.
        let old = json!({"$schema": DRAFT7,
            "properties": {"a": {"$ref": "#/definitions/s", "type": "integer"}},
            "definitions": {"s": {"type": "string"}}});
        let new = json!({"$schema": DRAFT7, "properties": {"a": {"type": "integer"}}});
        assert_eq!(
            flagged(old, new),
            ["property `a`: type changed from \"string\" to \"integer\""]
        );
        // In 2020-12 both apply: the reference's `minLength` 5 is not overridden by the
        // sibling's 1.
        let old = json!({"properties": {"a": {"type": "string", "minLength": 1}}});
        let new = json!({"properties": {"a": {"$ref": "#/$defs/s", "minLength": 1}},
                         "$defs": {"s": {"type": "string", "minLength": 5}}});
        assert!(!flagged(old, new).is_empty());
        // A target's `additionalProperties` does not see the sibling's `properties`.
        let old = json!({"properties": {"a": {}}, "additionalProperties": false});
        let new = json!({"$ref": "#/$defs/closed", "properties": {"a": {}},
                         "$defs": {"closed": {"additionalProperties": false}}});
        assert!(!flagged(old, new).is_empty());
        // Siblings that merge cleanly compare like the schema written out.
        let inline = json!({"properties": {"a": {"type": "string", "maxLength": 9}}});
        let by_ref = json!({"properties": {"a": {"$ref": "#/$defs/s", "maxLength": 9}},
                            "$defs": {"s": {"type": "string"}}});
        assert!(flagged(inline, by_ref).is_empty());
    }

    #[test]
    fn items_changing_between_tuple_and_single_schema_is_flagged() {
        let items = |items: Value| json!({"$schema": DRAFT7, "type": "array", "items": items});
        let tuple = items(json!([{"type": "string"}]));
        let single = items(json!({"type": "string"}));
        for (old, new) in [(&tuple, &single), (&single, &tuple)] {
            let issues = located(old, new);
            assert_eq!(issues.len(), 1, "{issues:?}");
            assert_eq!(issues[0].0, "/items");
            assert!(issues[0].1.contains("tuple"), "{issues:?}");
        }
        assert!(flagged(tuple.clone(), tuple.clone()).is_empty());
        let mut with_rest = tuple.clone();
        with_rest["additionalItems"] = json!({"type": "integer"});
        assert!(flagged(with_rest, tuple).is_empty());
    }

    #[test]
    fn unevaluated_keywords_count_as_constraining() {
        // `n` was allowed as a string through unevaluatedProperties; naming it may change that.
        let old = json!({"type": "object", "unevaluatedProperties": {"type": "string"}});
        let mut new = old.clone();
        new["properties"] = json!({"n": {"type": "integer"}});
        let issues = located(&old, &new);
        assert_eq!(issues.len(), 1, "{issues:?}");
        assert_eq!(issues[0].0, "/properties/n");
        assert!(
            issues[0].1.contains("`unevaluatedProperties`"),
            "{issues:?}"
        );
        // Forbidden before: allowing it is an addition.
        let closed = json!({"type": "object", "unevaluatedProperties": false});
        let mut opened = closed.clone();
        opened["properties"] = json!({"n": {"type": "integer"}});
        assert!(flagged(closed, opened).is_empty());
        // The items were constrained by unevaluatedItems; `items` now takes them over.
        let old = json!({"type": "array", "unevaluatedItems":
            {"type": "object", "properties": {"x": {"type": "string"}}}});
        let mut new = old.clone();
        new["items"] = json!({"properties": {"x": {"type": "integer"}}});
        let issues = located(&old, &new);
        assert_eq!(issues.len(), 1, "{issues:?}");
        assert_eq!(issues[0].0, "/items");
        assert!(issues[0].1.contains("`unevaluatedItems`"), "{issues:?}");
        // What an evaluating keyword took falls to them when it goes.
        let old = json!({"type": "object", "additionalProperties": true,
                         "unevaluatedProperties": false});
        let new = json!({"type": "object", "unevaluatedProperties": false});
        assert!(!flagged(old, new).is_empty());
        let old = json!({"type": "array", "items": {}, "unevaluatedItems": false});
        let new = json!({"type": "array", "unevaluatedItems": false});
        assert!(!flagged(old, new).is_empty());
    }

    #[test]
    fn properties_named_elsewhere_in_the_old_schema_count_as_constrained() {
        let add_n = |old: &Value| {
            let mut new = old.clone();
            new["properties"]["n"] = json!({"type": "integer"});
            new
        };
        for old in [
            json!({"type": "object", "properties": {}, "required": ["n"]}),
            json!({"type": "object", "properties": {},
                   "allOf": [{"properties": {"n": {"type": "string"}}}]}),
            json!({"type": "object", "properties": {},
                   "dependentRequired": {"a": ["n"]}}),
        ] {
            assert!(!flagged(old.clone(), add_n(&old)).is_empty(), "{old}");
        }
        // Below a property an `allOf` member also describes.
        let old = json!({"type": "object", "properties": {"a": {"type": "object"}},
            "allOf": [{"properties": {"a": {"properties": {"z": {"type": "string"}}}}}]});
        let mut new = old.clone();
        new["properties"]["a"]["properties"] = json!({"z": {"type": "integer"}});
        assert!(!flagged(old, new).is_empty());
        // An `allOf` that says nothing about `n` leaves it free to be added.
        let old = json!({"type": "object", "properties": {"a": {}},
                         "allOf": [{"properties": {"a": {"type": "string"}}}]});
        assert!(flagged(old.clone(), add_n(&old)).is_empty());
    }

    #[test]
    fn only_keywords_whose_removal_loosens_may_be_dropped() {
        let contains = |extra: Value| {
            let mut s = json!({"type": "array", "contains": {"type": "string"}});
            s.as_object_mut()
                .unwrap()
                .extend(extra.as_object().unwrap().clone());
            s
        };
        // minContains 0 accepted arrays without a match; without it, one is needed.
        let issues = located(&contains(json!({"minContains": 0})), &contains(json!({})));
        assert_eq!(issues.len(), 1, "{issues:?}");
        assert_eq!(issues[0].0, "");
        assert!(issues[0].1.contains("`minContains`"), "{issues:?}");
        assert!(flagged(contains(json!({"minContains": 2})), contains(json!({}))).is_empty());
        assert!(flagged(contains(json!({"maxContains": 2})), contains(json!({}))).is_empty());
        // Dropped together with `contains`, nothing is asked of the items any more.
        assert!(
            flagged(
                contains(json!({"minContains": 0})),
                json!({"type": "array"})
            )
            .is_empty()
        );
        // An unknown keyword may be one the validator is told to enforce.
        let s = |extra: Value| {
            let mut s = json!({"type": "string"});
            s.as_object_mut()
                .unwrap()
                .extend(extra.as_object().unwrap().clone());
            s
        };
        assert!(!flagged(s(json!({"x-check": 1})), s(json!({}))).is_empty());
        assert!(flagged(s(json!({"$comment": "c"})), s(json!({}))).is_empty());
        assert!(flagged(s(json!({"not": {"const": ""}})), s(json!({}))).is_empty());
        // Draft 7 asserts contentEncoding: adding it is not an annotation change.
        assert!(!flagged(s(json!({})), s(json!({"contentEncoding": "base64"}))).is_empty());
    }

    #[test]
    fn only_schema_positions_are_expanded() {
        // A property may be called `$defs`; it is compared like any other.
        let named = |t: &str| json!({"properties": {"$defs": {"type": t}}});
        assert_eq!(flagged(named("string"), named("integer")).len(), 1);
        // A `$ref` spelt inside `const` is data, not a reference.
        let constant = |r: &str| {
            json!({"properties": {"a": {"const": {"$ref": r}}},
                   "$defs": {"p": {"type": "string"}, "q": {"type": "string"}}})
        };
        assert!(!flagged(constant("#/$defs/p"), constant("#/$defs/q")).is_empty());
        assert!(flagged(constant("#/$defs/p"), constant("#/$defs/p")).is_empty());
    }

    #[test]
    fn recursion_to_different_places_differs() {
        // `kids` recursing to the root, then to `a` only.
        let to_root = json!({"type": "object", "properties": {
            "a": {"type": "object", "properties": {"kids": {"type": "array", "items": {"$ref": "#"}}}}}});
        let to_a = json!({"type": "object", "properties": {
            "a": {"$ref": "#/$defs/a"}},
            "$defs": {"a": {"type": "object", "properties": {
                "kids": {"type": "array", "items": {"$ref": "#/$defs/a"}}}}}});
        assert!(!flagged(to_root.clone(), to_a).is_empty());
        assert!(flagged(to_root.clone(), to_root).is_empty());
    }
}

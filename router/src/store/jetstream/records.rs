//! Versioned records on one JetStream stream, changed in atomic multi-record transactions.
//!
//! This is the JetStream backend's equivalent of a redb write transaction. Every record is the
//! last message on its own subject (`<prefix>.<key>`) of a stream that keeps one message per
//! subject; the message's stream sequence is the record's *revision*. A transaction is an
//! atomic batch publish (nats-server 2.12+, ADR-50): either every message of it is stored or
//! none is, and each message may carry `Nats-Expected-Last-Subject-Sequence`, so a write can
//! require that its record is still at the revision the writer read (or absent). Two router
//! nodes that race for the same records cannot both win: the loser's whole batch is refused
//! with a conflict, and it reads again. With the server's `sync_interval: always` (or a
//! replicated stream) the commit's acknowledgement means the batch is on disk, which is what
//! lets the backend keep "202 means on disk".
//!
//! Deleting a record writes a tombstone (an empty message with a header) with a per-message
//! TTL, so the server drops it later by itself; until then its revision is what a re-create
//! must expect.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use async_nats::jetstream::{self, stream};
use async_nats::{HeaderMap, Request};
use bytes::Bytes;

/// The oldest server this layer runs on: atomic batch publish came in 2.12.
pub const MIN_SERVER: (u64, u64) = (2, 12);

/// The most messages one atomic batch may hold (the server's own limit).
pub const MAX_BATCH: usize = 1000;

/// Atomic batches one node keeps open at once. The server allows 50 per stream (and refuses
/// more); this leaves room for a few nodes' worth of concurrent commits.
const MAX_OPEN_BATCHES: usize = 16;

/// Header that marks a tombstone (a deleted record).
pub(super) const TOMBSTONE: &str = "Router-Tombstone";

/// How long a tombstone stays before the server removes it. Long enough that every node's
/// cached revision of the deleted record is stale by then (a stale expectation only costs a
/// conflict and a re-read, never a wrong write).
const TOMBSTONE_TTL: &str = "1h";

/// How many record revisions a node remembers of its own commits (`Records::written`) before
/// it forgets them all and starts again: the memory only saves doomed commits, so losing it
/// costs time, never correctness.
const WRITTEN_MEMORY: usize = 65_536;

/// Transactions the group committer holds out of its channel at once.
const GROUP_QUEUE: usize = 4096;

/// What a record's message may need beside its value, for the headers this layer sets (batch
/// id and sequence, expected revision, commit, tombstone and TTL: under 200 bytes). The
/// server's `max_payload` counts headers and value together.
const HEADER_ALLOWANCE: usize = 512;

/// First wait before a commit refused because the stream's atomic batches were all in use is
/// sent again; it doubles up to `BUSY_BACKOFF_MAX`, and the retries end at the request timeout.
const BUSY_BACKOFF_START: Duration = Duration::from_millis(20);

/// Longest wait between two tries of a commit refused as busy.
const BUSY_BACKOFF_MAX: Duration = Duration::from_millis(500);

/// Where the records live and how to reach them.
#[derive(Debug, Clone)]
pub struct RecordsConfig {
    /// Server URL (`nats://host:port`).
    pub url: String,
    /// Stream name; one stream holds every record of one router deployment.
    pub stream: String,
    /// Subject prefix of the records (`<prefix>.<key>`).
    pub prefix: String,
    /// Stream replicas (1 needs a server with `sync_interval: always` to be durable; 3 is
    /// durable through a quorum).
    pub replicas: usize,
    /// Bound on every request to the server.
    pub timeout: Duration,
    /// The largest record this store will write (an event as accepted, with its envelope):
    /// a server whose `max_payload` is smaller is refused at open, not at the first big event.
    pub max_record_bytes: usize,
    /// Credentials and TLS settings (`store.jetstream.user`, `tls_ca_file`, …), resolved
    /// before the open (a variable not set stops the start there) and read again at each
    /// reconnect. Default: none.
    pub auth: crate::nats_auth::NatsCredentials,
}

/// Why a records operation failed.
#[derive(Debug, Clone, thiserror::Error)]
pub enum RecordsError {
    /// An expectation of the transaction did not hold (another writer got there first):
    /// nothing was written. Read again and retry.
    #[error("a record changed since it was read (nothing written)")]
    Conflict,
    /// The server cannot hold these records as this layer needs them.
    #[error("unsupported NATS server: {0}")]
    Unsupported(String),
    /// The transaction has more messages than one atomic batch may.
    #[error("transaction of {0} writes is over the atomic batch limit of {MAX_BATCH}")]
    TooLarge(usize),
    /// The two writes of one transaction touch the same record.
    #[error("record {0:?} is written twice in one transaction")]
    SameRecordTwice(String),
    /// A write's message would be larger than the server takes (its `max_payload`, or the
    /// stream's `max_msg_size`): refused before anything of the transaction was sent.
    #[error(
        "record {key:?} would be a message of {bytes} bytes, over the {max} the NATS server takes \
         (its max_payload or the stream's max_msg_size)"
    )]
    RecordTooLarge {
        /// The record's key.
        key: String,
        /// Its value's size plus what its headers may need.
        bytes: usize,
        /// The largest message the server takes.
        max: usize,
    },
    /// The server refused the transaction for its content, not for a changed record (an
    /// answer with an error code): nothing was written.
    #[error("commit refused ({code}): {description}")]
    Refused {
        /// The server's `err_code`.
        code: u64,
        /// The server's description.
        description: String,
    },
    /// The stream's atomic batches stayed all in use (abandoned batches of a failed writer
    /// hold their place until the server's batch timeout) for as long as a request may take:
    /// nothing was written. Transient.
    #[error("the stream's atomic batches stayed busy: {0}")]
    Busy(String),
    /// The server timed out, could not be reached or found no one to answer (no stream
    /// leader, a server stopping): nothing was applied (a read, or a commit that was not
    /// taken; one whose fate is unknown is `Unanswered`). Transient: the store counts it as
    /// unavailable.
    #[error("NATS JetStream: {0}")]
    Server(String),
    /// The connection could not be made as configured: the server refused the credentials,
    /// TLS failed, a credentials file does not parse. The text names the `store.jetstream`
    /// key to check.
    #[error("{0}")]
    Connect(String),
    /// The client is not connected to the server (it lost the connection and is trying to
    /// reconnect): nothing was sent. Refused at once rather than handed to the client, which
    /// would buffer the message and send it once it reconnects, long after its caller gave up
    /// on it (a lease recorded 40 s after the worker saw it fail, a pause applied after the
    /// operator was told 503).
    #[error("NATS JetStream unreachable, nothing sent: {0}")]
    Unavailable(String),
    /// A commit was sent but its answer never came (a timeout, a connection lost after the
    /// send): it may or may not have been applied. Read the records again to know.
    #[error("NATS JetStream did not answer, the write may or may not have been applied: {0}")]
    Unanswered(String),
}

impl RecordsError {
    /// Whether the server answered this commit with a refusal of its content (a changed
    /// record, an error code), as opposed to failing or not answering at all. A group of
    /// transactions refused so is split until the refused one is alone, so it fails on its
    /// own; a group that met an unreachable server or busy batches fails as a whole, since
    /// every part sent again would meet the same (each costing up to a request timeout).
    fn refuses_content(&self) -> bool {
        match self {
            Self::Conflict
            | Self::Refused { .. }
            | Self::RecordTooLarge { .. }
            | Self::TooLarge(_)
            | Self::SameRecordTwice(_) => true,
            Self::Unsupported(_)
            | Self::Connect(_)
            | Self::Busy(_)
            | Self::Server(_)
            | Self::Unavailable(_)
            | Self::Unanswered(_) => false,
        }
    }

    /// Whether this says the server is out of reach or not answering (as opposed to an answer
    /// refusing the request): what `Records::writable` goes by.
    fn is_outage(&self) -> bool {
        matches!(
            self,
            Self::Server(_) | Self::Unavailable(_) | Self::Unanswered(_)
        )
    }
}

/// Whether a commit refused by the server with `code` can be sent again as it is: a batch
/// the stream had no room for (too many open batches, 10210), or one whose messages it
/// dropped for that reason and then found incomplete at its commit (10176). Nothing of it
/// was applied either way.
fn busy_code(code: u64) -> bool {
    matches!(code, 10176 | 10210)
}

/// The wait before try `n` (from 0) of a commit refused as busy: doubling from
/// `BUSY_BACKOFF_START` up to `BUSY_BACKOFF_MAX`, with up to half of it random so nodes that
/// were refused together do not come back together.
fn busy_backoff(n: u32) -> Duration {
    let base = BUSY_BACKOFF_START
        .saturating_mul(1u32 << n.min(16))
        .min(BUSY_BACKOFF_MAX);
    base / 2 + base.mul_f64(rand::random::<f64>() / 2.0)
}

/// A record as read: its value (`None` for a tombstone) and its revision.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Versioned {
    /// The value; `None` when the record was deleted (a tombstone is still there).
    pub value: Option<Bytes>,
    /// The stream sequence of the record's message.
    pub revision: u64,
}

/// Where a scan starts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ScanFrom {
    /// The first record.
    Start,
    /// The first record written at or after this wall-clock time (ms).
    Time(i64),
    /// The first record at or after this revision (stream sequence).
    Revision(u64),
}

/// A record met by a scan.
#[derive(Debug, Clone)]
pub struct Scanned {
    /// Record key.
    pub key: String,
    /// Its revision.
    pub revision: u64,
    /// Its value; `None` for a tombstone.
    pub value: Option<Bytes>,
    /// When the server stored it (wall clock, ms).
    pub published_ms: i64,
}

/// What a write requires of its record at commit time.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Expect {
    /// Nothing: the write wins whatever is there.
    Any,
    /// The record's last message is at this revision; 0 means it has no message at all.
    Revision(u64),
}

impl Expect {
    /// The expectation that the record is where `read` found it (absent when `read` is
    /// `None`, or at the read revision, tombstone included).
    pub fn unchanged(read: Option<&Versioned>) -> Self {
        Self::Revision(read.map_or(0, |v| v.revision))
    }
}

/// One write of a transaction.
#[derive(Debug, Clone)]
pub struct Write {
    /// Record key (the subject under the prefix; dot-separated tokens).
    pub key: String,
    /// New value; `None` deletes (writes a tombstone).
    pub value: Option<Bytes>,
    /// What must hold at commit.
    pub expect: Expect,
}

impl Write {
    /// Writes `value` at `key` if `expect` holds.
    pub fn put(key: impl Into<String>, value: impl Into<Bytes>, expect: Expect) -> Self {
        Self {
            key: key.into(),
            value: Some(value.into()),
            expect,
        }
    }

    /// Deletes `key` if `expect` holds.
    pub fn delete(key: impl Into<String>, expect: Expect) -> Self {
        Self {
            key: key.into(),
            value: None,
            expect,
        }
    }
}

/// The records of one deployment: a connection, the stream, and the batch id source.
pub struct Records {
    client: async_nats::Client,
    stream: stream::Stream,
    config: RecordsConfig,
    /// Unique per process; batch ids are `<node>-<counter>`.
    node: String,
    batches: AtomicU64,
    /// Bounds this node's open batches (`MAX_OPEN_BATCHES`).
    open: tokio::sync::Semaphore,
    /// Transactions of several writes, for the group committer (`group_commits`).
    group: tokio::sync::mpsc::Sender<Grouped>,
    /// The revision of each record as this node last committed it (bounded by
    /// `WRITTEN_MEMORY`). A transaction that expects an older revision of one of them cannot
    /// commit; the group committer answers it at once instead of letting it fail a whole
    /// group (`Records::known_stale`).
    written: Mutex<HashMap<String, u64>>,
    /// The stream's `max_msg_size` (`usize::MAX`: none), as read at open and again when a
    /// commit is refused as busy (`Records::commit_now`).
    stream_max_msg: AtomicUsize,
    /// For tests: what a replica that stopped applying writes still answers, by key (`None`:
    /// it does not have the record). A direct get of such a key answers this; the leader is
    /// still asked for real (`Records::lag_behind`).
    #[cfg(test)]
    lagging: Mutex<HashMap<String, Option<Versioned>>>,
    /// Whether the last commit failed for want of the server (unreachable, no answer): then
    /// the store does not take writes, whatever the connection's state says, until a commit
    /// succeeds again (`Records::writable`).
    commits_failing: AtomicBool,
    /// For tests: how many commits the server refused as busy (`Records::commit_now`).
    #[cfg(test)]
    busy_refusals: AtomicU64,
    /// For tests: how many of the next commits have their answer lost after the server
    /// applied them, as when the connection drops between the send and the answer.
    #[cfg(test)]
    lose_answers: AtomicUsize,
}

/// A transaction waiting for the group committer, and where its answer goes.
struct Grouped {
    writes: Vec<Write>,
    reply: tokio::sync::oneshot::Sender<Result<Vec<u64>, RecordsError>>,
}

/// Commits the waiting transactions of several writes together, as one atomic batch of up to
/// `MAX_BATCH` writes, while the previous batch is with the server.
///
/// nats-server 2.15.1 takes about 5 ms per atomic batch and applies a stream's batches one at
/// a time, so a batch per transaction capped a stream at ~170 transactions a second (single
/// events' accepts; docs/BENCHMARKS.md). Batched together they share those 5 ms. The price: a
/// conflict in one fails the whole batch (then halved until each part commits or is the
/// stale transaction alone, `commit_group`). Two defences keep that rare: a transaction that
/// expects an older revision of a record this node has itself committed since is answered
/// `Conflict` without a round trip (`Records::known_stale`), and transactions that touch a
/// record already in the batch wait for the next one (a batch may expect a record's revision
/// only once) while later ones on other records go ahead.
async fn group_commits(records: Weak<Records>, mut rx: tokio::sync::mpsc::Receiver<Grouped>) {
    // Transactions left out of the last group because they touch a record already in it:
    // first in line for the next one. Taken from the channel only up to its own capacity,
    // so the channel's bound still pushes back on committers.
    let mut waiting: VecDeque<Grouped> = VecDeque::new();
    loop {
        if waiting.is_empty() {
            match rx.recv().await {
                Some(g) => waiting.push_back(g),
                None => return,
            }
        }
        while waiting.len() < GROUP_QUEUE {
            match rx.try_recv() {
                Ok(g) => waiting.push_back(g),
                Err(_) => break,
            }
        }
        let Some(records) = records.upgrade() else {
            return;
        };
        let mut keys: HashSet<String> = HashSet::new();
        let mut total = 0;
        let mut group = Vec::new();
        for g in std::mem::take(&mut waiting) {
            if records.known_stale(&g.writes) {
                let _ = g.reply.send(Err(RecordsError::Conflict));
            } else if total + g.writes.len() > MAX_BATCH
                || g.writes.iter().any(|w| keys.contains(&w.key))
            {
                waiting.push_back(g);
            } else {
                keys.extend(g.writes.iter().map(|w| w.key.clone()));
                total += g.writes.len();
                group.push(g);
            }
        }
        commit_group(&records, group).await;
    }
}

/// Commits a group of transactions (on distinct records) as one atomic batch. When the
/// server refuses it for its content (a conflict, or another error it answers with), the
/// group is halved and each half committed the same way, so one bad transaction costs about
/// two batches per halving instead of a batch per transaction of the group, and fails alone.
async fn commit_group(records: &Records, group: Vec<Grouped>) {
    // The group as built was checked for staleness (`group_commits`); halves after a
    // conflict are checked again, since a commit of an earlier half may have made one of
    // them stale.
    let mut parts = vec![group];
    let mut checked = true;
    while let Some(mut part) = parts.pop() {
        if !checked {
            let stale;
            (stale, part) = part
                .into_iter()
                .partition(|g| records.known_stale(&g.writes));
            for g in stale {
                let _ = g.reply.send(Err(RecordsError::Conflict));
            }
        }
        checked = false;
        if part.len() <= 1 {
            if let Some(g) = part.pop() {
                let _ = g.reply.send(records.commit_now(g.writes).await);
            }
            continue;
        }
        let all: Vec<Write> = part.iter().flat_map(|g| g.writes.iter().cloned()).collect();
        match records.commit_now(all).await {
            Ok(revs) => {
                let mut at = 0;
                for g in part {
                    let n = g.writes.len();
                    let _ = g.reply.send(Ok(revs[at..at + n].to_vec()));
                    at += n;
                }
            }
            // Conflicts, and any other refusal of the batch's content: each half goes on
            // its own, so one transaction the server will not take (a conflict, a message
            // over the stream's size limit) fails alone instead of failing every one it was
            // grouped with.
            Err(e) if e.refuses_content() => {
                let second = part.split_off(part.len() / 2);
                parts.push(second);
                parts.push(part);
            }
            Err(e) => {
                for g in part {
                    let _ = g.reply.send(Err(e.clone()));
                }
            }
        }
    }
}

impl std::fmt::Debug for Records {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Records")
            .field("stream", &self.config.stream)
            .field("node", &self.node)
            .finish()
    }
}

/// How often the client pings the server. A server that stops answering without closing the
/// connection (hung, or a network dropping packets) is given up after three unanswered pings,
/// and only then does the store refuse at once (`RecordsError::Unavailable`) and `/readyz`
/// say so: with async-nats' default of 60 s that took three minutes, every write meanwhile
/// waiting out its timeout.
const PING_INTERVAL: Duration = Duration::from_secs(5);

impl Records {
    /// Connects, checks the server, and creates the stream (or checks an existing one has
    /// the settings this layer relies on).
    pub async fn open(config: RecordsConfig) -> Result<Arc<Self>, RecordsError> {
        let servers = crate::config::server_addrs("store.jetstream.url", &config.url)
            .map_err(RecordsError::Server)?;
        let options = config
            .auth
            .options()
            .connection_timeout(config.timeout)
            .request_timeout(Some(config.timeout))
            .ping_interval(PING_INTERVAL)
            .name("router-store");
        let client = options.connect(servers.as_slice()).await.map_err(|e| {
            use async_nats::ConnectErrorKind as Kind;
            let hint = match e.kind() {
                Kind::Authentication | Kind::AuthorizationViolation => {
                    format!(" ({})", config.auth.refusal_hint())
                }
                Kind::Tls => {
                    " (check store.jetstream.url and the store.jetstream.tls_* files)".to_string()
                }
                _ => String::new(),
            };
            RecordsError::Connect(format!(
                "store.jetstream: connect to {}: {e}{hint}",
                config.url
            ))
        })?;
        let info = client.server_info();
        check_server_version(&info.version)?;
        if info.max_payload < config.max_record_bytes {
            return Err(RecordsError::Unsupported(format!(
                "nats-server max_payload is {} bytes, under the {} a stored event may need \
                 (ingest.max_body_bytes plus its envelope): set max_payload in the server's \
                 config (e.g. 8MB)",
                info.max_payload, config.max_record_bytes
            )));
        }
        let js = jetstream::new(client.clone());
        let wanted = stream_config(&config);
        let stream = match js.get_stream(&config.stream).await {
            Ok(mut s) => {
                let info = s
                    .info()
                    .await
                    .map_err(|e| RecordsError::Server(e.to_string()))?;
                check_stream(&info.config, &wanted)?;
                s
            }
            Err(e)
                if matches!(e.kind(), jetstream::context::GetStreamErrorKind::JetStream(ref j)
                    if j.error_code() == jetstream::ErrorCode::STREAM_NOT_FOUND) =>
            {
                js.create_stream(wanted)
                    .await
                    .map_err(|e| RecordsError::Server(format!("create stream: {e}")))?
            }
            Err(e) => return Err(RecordsError::Server(format!("stream lookup: {e}"))),
        };
        let stream_max_msg = AtomicUsize::new(max_msg_size(&stream.cached_info().config));
        let (tx, rx) = tokio::sync::mpsc::channel(4096);
        let records = Arc::new(Self {
            client,
            stream,
            config,
            node: format!("{:016x}", rand::random::<u64>()),
            batches: AtomicU64::new(0),
            open: tokio::sync::Semaphore::new(MAX_OPEN_BATCHES),
            group: tx,
            written: Mutex::new(HashMap::new()),
            stream_max_msg,
            commits_failing: AtomicBool::new(false),
            #[cfg(test)]
            lagging: Mutex::default(),
            #[cfg(test)]
            busy_refusals: AtomicU64::new(0),
            #[cfg(test)]
            lose_answers: AtomicUsize::new(0),
        });
        tokio::spawn(group_commits(Arc::downgrade(&records), rx));
        Ok(records)
    }

    /// The records' stream (for followers of it).
    pub fn stream(&self) -> stream::Stream {
        self.stream.clone()
    }

    /// The records' subject prefix.
    pub fn prefix(&self) -> &str {
        &self.config.prefix
    }

    /// The bound on each request to the server.
    pub fn timeout(&self) -> Duration {
        self.config.timeout
    }

    /// Whether the client is connected to a server now.
    pub fn connected(&self) -> bool {
        self.client.connection_state() == async_nats::connection::State::Connected
    }

    /// Whether writes can be expected to succeed now: the client is connected and the last
    /// commit did not fail for want of the server (a connected server whose stream has no
    /// leader answers no write either).
    pub fn writable(&self) -> bool {
        self.connected() && !self.commits_failing.load(Ordering::Relaxed)
    }

    /// `Unavailable` unless the client is connected: every request checks this first, so a
    /// request made during an outage fails at once and is never sent later (see
    /// `RecordsError::Unavailable`). A connection lost between this check and the send can
    /// still hold a message back until it reconnects: that is a commit `Unanswered`.
    fn ensure_connected(&self, what: &str) -> Result<(), RecordsError> {
        if self.connected() {
            Ok(())
        } else {
            Err(RecordsError::Unavailable(format!(
                "{what}: not connected to {}",
                self.config.url
            )))
        }
    }

    /// For tests: the answers of the next `n` commits are lost after the server applied
    /// them (`lose_answers`).
    #[cfg(test)]
    pub fn lose_next_answers(&self, n: usize) {
        self.lose_answers.store(n, Ordering::Relaxed);
    }

    /// The subject of record `key`.
    fn subject(&self, key: &str) -> String {
        format!("{}.{key}", self.config.prefix)
    }

    /// The record at `key` (`None`: no message at all, or its tombstone expired), read the
    /// fast way: a direct get, which any replica of the stream may answer.
    ///
    /// A replica applies a write some time after the stream's leader acknowledged it (a
    /// follower learns that an entry is committed from the leader's next message), so its
    /// answer can be older than a write already acknowledged. A read older than this node's
    /// own last commit of the record (`written`) is therefore read again from the leader
    /// (`get_leader`): a node always sees its own writes. Another node's recent write may
    /// still be missing, which is harmless wherever the decision ends in a compare-and-set
    /// of the record read (the commit is refused and the caller reads again). Decisions with
    /// no such check, or that know a revision they must see, use `get_at_least` or
    /// `get_leader`.
    pub async fn get(&self, key: &str) -> Result<Option<Versioned>, RecordsError> {
        self.get_at_least(key, 0).await
    }

    /// `get`, read again from the leader when the answer is older than `revision` (a
    /// revision the caller knows the record reached, such as a lease's token) or than this
    /// node's own last commit of it. With `revision` 1, a record known to exist that a
    /// lagging replica does not have yet is read from the leader instead of reported absent.
    pub async fn get_at_least(
        &self,
        key: &str,
        revision: u64,
    ) -> Result<Option<Versioned>, RecordsError> {
        let known = revision.max(self.own_revision(key));
        let read = self.direct_get(key).await?;
        if read.as_ref().map_or(0, |v| v.revision) < known {
            return self.get_leader(key).await;
        }
        Ok(read)
    }

    /// The record at `key` as whichever replica answers has it.
    async fn direct_get(&self, key: &str) -> Result<Option<Versioned>, RecordsError> {
        #[cfg(test)]
        if let Some(read) = self
            .lagging
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(key)
        {
            return Ok(read.clone());
        }
        self.ensure_connected(&format!("read {key}"))?;
        match self
            .stream
            .direct_get_last_for_subject(self.subject(key))
            .await
        {
            Ok(m) => Ok(Some(versioned(m))),
            Err(e) if e.kind() == stream::DirectGetErrorKind::NotFound => Ok(None),
            Err(e) => Err(RecordsError::Server(format!("read {key}: {e}"))),
        }
    }

    /// For tests: from now on, direct gets of `key` answer that it has no record, as a
    /// replica that has not applied its first write yet would (`lagging`).
    #[cfg(test)]
    pub fn lag_without(&self, key: &str) {
        self.lagging
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(key.to_string(), None);
    }

    /// For tests: from now on, direct gets of `keys` answer what they answer now, as a
    /// replica that stops applying writes to them would (`lagging`).
    #[cfg(test)]
    pub async fn lag_behind(&self, keys: &[String]) {
        for key in keys {
            let read = self.direct_get(key).await.expect("read before lagging");
            self.lagging
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .insert(key.clone(), read);
        }
    }

    /// The record at `key` as the stream's leader has it (the leader acknowledges a write
    /// once it has applied it, so this read sees every acknowledged write). A request through
    /// the JetStream API to one server, where `get` may be answered by any: for decisions that
    /// cannot be checked by a compare-and-set (an operator's purge or release, a fate), or a
    /// read again after a conflict.
    pub async fn get_leader(&self, key: &str) -> Result<Option<Versioned>, RecordsError> {
        self.ensure_connected(&format!("read {key} from the leader"))?;
        match self
            .stream
            .get_last_raw_message_by_subject(&self.subject(key))
            .await
        {
            Ok(m) => Ok(Some(versioned(m))),
            Err(e) if e.kind() == stream::LastRawMessageErrorKind::NoMessageFound => Ok(None),
            Err(e) => Err(RecordsError::Server(format!(
                "read {key} from the leader: {e}"
            ))),
        }
    }

    /// `get` (`leader`: false) or `get_leader`.
    pub async fn get_from(
        &self,
        key: &str,
        leader: bool,
    ) -> Result<Option<Versioned>, RecordsError> {
        if leader {
            self.get_leader(key).await
        } else {
            self.get(key).await
        }
    }

    /// The revision this node last committed `key` at, as far as it remembers (0: none).
    fn own_revision(&self, key: &str) -> u64 {
        let written = self.written.lock().unwrap_or_else(|p| p.into_inner());
        written.get(key).copied().unwrap_or(0)
    }

    /// The largest value a record may hold: what the server takes in one message (its
    /// `max_payload`, and the stream's `max_msg_size` if set) less the headers' allowance.
    pub fn record_limit(&self) -> usize {
        self.max_payload()
            .min(self.stream_max_msg.load(Ordering::Relaxed))
            .saturating_sub(HEADER_ALLOWANCE)
    }

    /// The first of `writes` whose value is over `record_limit`, with its size.
    pub fn oversized<'a>(&self, writes: &'a [Write]) -> Option<(&'a str, usize)> {
        let limit = self.record_limit();
        writes.iter().find_map(|w| {
            let n = w.value.as_ref().map_or(0, Bytes::len);
            (n > limit).then_some((w.key.as_str(), n))
        })
    }

    /// `RecordTooLarge` for the first of `writes` over `record_limit`.
    fn check_sizes(&self, writes: &[Write]) -> Result<(), RecordsError> {
        match self.oversized(writes) {
            Some((key, n)) => Err(RecordsError::RecordTooLarge {
                key: key.to_string(),
                bytes: n + HEADER_ALLOWANCE,
                max: self.record_limit() + HEADER_ALLOWANCE,
            }),
            None => Ok(()),
        }
    }

    /// Reads the stream's `max_msg_size` again (an operator may have lowered it since open).
    async fn refresh_limits(&self) -> Result<(), RecordsError> {
        self.ensure_connected("stream info")?;
        let info = self
            .stream
            .get_info()
            .await
            .map_err(|e| RecordsError::Server(format!("stream info: {e}")))?;
        self.stream_max_msg
            .store(max_msg_size(&info.config), Ordering::Relaxed);
        Ok(())
    }

    /// Whether a value of `len` bytes fits in a record (`record_limit`).
    pub fn fits(&self, len: usize) -> bool {
        len <= self.record_limit()
    }

    /// The largest message the server takes (headers and payload), as it last said.
    pub fn max_payload(&self) -> usize {
        self.client.max_payload()
    }

    /// Every live record under `kind.` (tombstones left out), as (key, revision, value),
    /// read from an ordered consumer until it has caught up. Costs a pass over those
    /// records: for listings that are rare or small (target states, jobs, the DLQ).
    pub async fn scan(&self, kind: &str) -> Result<Vec<(String, u64, Bytes)>, RecordsError> {
        let mut out = Vec::new();
        self.scan_with(kind, ScanFrom::Start, false, |r| {
            if let Some(v) = r.value {
                out.push((r.key, r.revision, v));
            }
            true
        })
        .await?;
        Ok(out)
    }

    /// Visits the records under `kind.` in stream order (tombstones included), from `from`,
    /// until `visit` answers false or the consumer has caught up. With `headers_only` the
    /// values are not sent (a live record's value is then empty, a tombstone's still
    /// `None`): for counting.
    pub async fn scan_with(
        &self,
        kind: &str,
        from: ScanFrom,
        headers_only: bool,
        mut visit: impl FnMut(Scanned) -> bool,
    ) -> Result<(), RecordsError> {
        use futures::StreamExt;
        let err = |e: &dyn std::fmt::Display| RecordsError::Server(format!("scan {kind}: {e}"));
        self.ensure_connected(&format!("scan {kind}"))?;
        let deliver_policy = match from {
            ScanFrom::Start | ScanFrom::Revision(0) => jetstream::consumer::DeliverPolicy::All,
            ScanFrom::Revision(start_sequence) => {
                jetstream::consumer::DeliverPolicy::ByStartSequence { start_sequence }
            }
            ScanFrom::Time(ms) => jetstream::consumer::DeliverPolicy::ByStartTime {
                start_time: time::OffsetDateTime::from_unix_timestamp_nanos(
                    i128::from(ms.max(0)) * 1_000_000,
                )
                .map_err(|e| err(&e))?,
            },
        };
        let mut consumer = self
            .stream
            .create_consumer(jetstream::consumer::pull::OrderedConfig {
                filter_subject: self.subject(&format!("{kind}.>")),
                deliver_policy,
                headers_only,
                ..Default::default()
            })
            .await
            .map_err(|e| err(&e))?;
        // Nothing to read: the consumer would wait for new messages instead of ending.
        if consumer.info().await.map_err(|e| err(&e))?.num_pending == 0 {
            return Ok(());
        }
        let mut messages = consumer.messages().await.map_err(|e| err(&e))?;
        let strip = self.config.prefix.len() + 1;
        loop {
            let next = tokio::time::timeout(self.config.timeout, messages.next())
                .await
                .map_err(|_| err(&"timed out"))?;
            let Some(m) = next else { break };
            let m = m.map_err(|e| err(&e))?;
            let info = m.info().map_err(|e| err(&e))?;
            let (revision, pending) = (info.stream_sequence, info.pending);
            let published_ms =
                i64::try_from(info.published.unix_timestamp_nanos() / 1_000_000).unwrap_or(0);
            let tomb = m
                .headers
                .as_ref()
                .is_some_and(|h| h.get(TOMBSTONE).is_some());
            let record = Scanned {
                key: m
                    .subject
                    .as_str()
                    .get(strip..)
                    .unwrap_or_default()
                    .to_string(),
                revision,
                value: (!tomb).then(|| m.payload.clone()),
                published_ms,
            };
            if !visit(record) || pending == 0 {
                break;
            }
        }
        Ok(())
    }

    /// Bytes the records' stream holds on the server.
    pub async fn stream_bytes(&self) -> Result<u64, RecordsError> {
        self.ensure_connected("stream info")?;
        self.stream
            .get_info()
            .await
            .map(|i| i.state.bytes)
            .map_err(|e| RecordsError::Server(format!("stream info: {e}")))
    }

    /// `get` for an owned key (for futures that outlive the caller's borrow of it).
    pub async fn get_owned(&self, key: String) -> Result<Option<Versioned>, RecordsError> {
        self.get(&key).await
    }

    /// Commits `writes` atomically: all of them or, when an expectation fails, none (a
    /// `Conflict`). Returns each write's new revision, in order. A single write goes to the
    /// server at once; several go through the group committer (`group_commits`).
    pub async fn commit(&self, writes: Vec<Write>) -> Result<Vec<u64>, RecordsError> {
        if writes.is_empty() {
            return Ok(Vec::new());
        }
        if writes.len() > MAX_BATCH {
            return Err(RecordsError::TooLarge(writes.len()));
        }
        let mut keys = HashSet::with_capacity(writes.len());
        for w in &writes {
            if !keys.insert(w.key.as_str()) {
                return Err(RecordsError::SameRecordTwice(w.key.clone()));
            }
        }
        // Before anything is sent: a message the server refuses in the middle of a batch
        // left the batch open on the server (holding one of the stream's few batch places
        // until the server's batch timeout) and, in a group, failed every transaction of it.
        self.check_sizes(&writes)?;
        self.ensure_connected("commit")?;
        if writes.len() == 1 {
            return self.commit_now(writes).await;
        }
        let (reply, answer) = tokio::sync::oneshot::channel();
        self.group
            .send(Grouped { writes, reply })
            .await
            .map_err(|_| RecordsError::Server("the record store is closed".into()))?;
        answer
            .await
            // It may have sent the transaction before it stopped.
            .map_err(|_| RecordsError::Unanswered("the group committer stopped".into()))?
    }

    /// Whether `writes` expects an older revision of a record than one this node has
    /// committed since: then it cannot commit, whatever other nodes did. Only expectations of
    /// an existing record count: a record this node deleted may be gone altogether once its
    /// tombstone expires, and then "absent" is right again.
    fn known_stale(&self, writes: &[Write]) -> bool {
        let written = self.written.lock().unwrap_or_else(|p| p.into_inner());
        writes.iter().any(|w| match w.expect {
            Expect::Revision(r) if r > 0 => written.get(&w.key).is_some_and(|&k| k > r),
            _ => false,
        })
    }

    /// How many commits the server refused as busy (for tests).
    #[cfg(test)]
    pub fn busy_refusals(&self) -> u64 {
        self.busy_refusals.load(Ordering::Relaxed)
    }

    /// How many commits this node has sent to the server (for tests).
    #[cfg(test)]
    pub fn commits_sent(&self) -> u64 {
        self.batches.load(Ordering::Relaxed)
    }

    /// Remembers the revisions this node's commit gave `keys` (`written`).
    fn remember(&self, keys: Vec<String>, revisions: &[u64]) {
        let mut written = self.written.lock().unwrap_or_else(|p| p.into_inner());
        if written.len() + keys.len() > WRITTEN_MEMORY {
            written.clear();
        }
        for (k, &r) in keys.into_iter().zip(revisions) {
            let at = written.entry(k).or_insert(0);
            *at = (*at).max(r);
        }
    }

    /// Commits `writes` (checked by `commit`) as one publish or atomic batch, now. A batch
    /// the stream had no room for is sent again after a backoff (`busy_backoff`) until the
    /// request timeout has passed.
    ///
    /// A batch the server found incomplete at its commit is either one whose messages it
    /// dropped for want of room, or one of whose messages it refused (the answer does not
    /// say which). The only refusal of a message this layer does not check before sending
    /// is the stream's `max_msg_size` lowered since it was read: it is read again, and a
    /// write now over it fails the transaction as `RecordTooLarge` (which the group
    /// committer isolates) instead of being sent again until the timeout.
    async fn commit_now(&self, writes: Vec<Write>) -> Result<Vec<u64>, RecordsError> {
        // The group committer's halves come here without `commit`'s check.
        self.check_sizes(&writes)?;
        let keys: Vec<String> = writes.iter().map(|w| w.key.clone()).collect();
        let started = tokio::time::Instant::now();
        let mut tries = 0;
        let revisions = loop {
            match self.send_commit(&writes).await {
                Err(RecordsError::Busy(why)) => {
                    #[cfg(test)]
                    self.busy_refusals.fetch_add(1, Ordering::Relaxed);
                    if tries == 0 {
                        self.refresh_limits().await?;
                        self.check_sizes(&writes)?;
                    }
                    let wait = busy_backoff(tries);
                    if started.elapsed() + wait > self.config.timeout {
                        return Err(RecordsError::Busy(why));
                    }
                    tracing::debug!(tries, error = %why, "atomic batch refused as busy; sending it again");
                    tokio::time::sleep(wait).await;
                    tries += 1;
                }
                Err(e) => {
                    if e.is_outage() {
                        self.commits_failing.store(true, Ordering::Relaxed);
                    }
                    return Err(e);
                }
                Ok(revisions) => break revisions,
            }
        };
        self.commits_failing.store(false, Ordering::Relaxed);
        self.remember(keys, &revisions);
        Ok(revisions)
    }

    /// Sends `writes` as one publish or atomic batch and reads the server's answer.
    async fn send_commit(&self, writes: &[Write]) -> Result<Vec<u64>, RecordsError> {
        // Only batches count against the server's cap on open batches; a single write is a
        // plain publish.
        let _open = match writes.len() {
            1 => None,
            _ => Some(
                self.open
                    .acquire()
                    .await
                    .map_err(|_| RecordsError::Server("the record store is closed".into()))?,
            ),
        };
        // Checked here, after the wait for a batch place, which can be long.
        self.ensure_connected("commit")?;
        let batch = format!(
            "{}-{}",
            self.node,
            self.batches.fetch_add(1, Ordering::Relaxed)
        );
        let n = writes.len();
        let mut reply = None;
        for (i, w) in writes.iter().enumerate() {
            let mut headers = HeaderMap::new();
            // One write needs no batch: a plain publish with its expectation is as atomic,
            // and the server answers it without a batch's staging (5 ms against 0.3 here).
            if n > 1 {
                headers.insert("Nats-Batch-Id", batch.as_str());
                headers.insert("Nats-Batch-Sequence", (i + 1).to_string().as_str());
            }
            if let Expect::Revision(r) = w.expect {
                headers.insert(
                    "Nats-Expected-Last-Subject-Sequence",
                    r.to_string().as_str(),
                );
            }
            let payload = match &w.value {
                Some(v) => v.clone(),
                None => {
                    headers.insert(TOMBSTONE, "1");
                    headers.insert("Nats-TTL", TOMBSTONE_TTL);
                    Bytes::new()
                }
            };
            let subject = self.subject(&w.key);
            if i + 1 < n {
                // The server answers only the commit; a message lost on the way makes the
                // commit fail as incomplete, never half-applied.
                self.client
                    .publish_with_headers(subject, headers, payload)
                    .await
                    .map_err(|e| RecordsError::Server(format!("publish: {e}")))?;
            } else {
                if n > 1 {
                    headers.insert("Nats-Batch-Commit", "1");
                }
                let request = Request::new()
                    .headers(headers)
                    .payload(payload)
                    .timeout(Some(self.config.timeout));
                reply = Some(
                    self.client
                        .send_request(subject, request)
                        .await
                        .map_err(|e| match e.kind() {
                            // Sent, or held by the client to be sent once it reconnects: the
                            // server may apply it still.
                            async_nats::RequestErrorKind::TimedOut
                            | async_nats::RequestErrorKind::Other => {
                                RecordsError::Unanswered(format!("commit: {e}"))
                            }
                            // Refused before it was sent, or nobody took it (no stream leader
                            // listens on the subject now).
                            _ => RecordsError::Server(format!("commit: {e}")),
                        })?,
                );
            }
        }
        let reply = reply.ok_or_else(|| RecordsError::Server("no commit reply".into()))?;
        #[cfg(test)]
        if self
            .lose_answers
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| n.checked_sub(1))
            .is_ok()
        {
            return Err(RecordsError::Unanswered(
                "commit: the answer was lost (test)".into(),
            ));
        }
        let ack: BatchAck = serde_json::from_slice(&reply.payload)
            // An answer that cannot be read says nothing of what was applied.
            .map_err(|e| RecordsError::Unanswered(format!("commit reply: {e}")))?;
        if let Some(err) = ack.error {
            return Err(match err.err_code {
                // JSStreamWrongLastSequenceErr, and its batch form (two expectations on
                // one subject cannot both hold).
                10071 | 10164 => RecordsError::Conflict,
                code if busy_code(code) => {
                    RecordsError::Busy(format!("{} ({code})", err.description))
                }
                code => RecordsError::Refused {
                    code,
                    description: err.description,
                },
            });
        }
        // A plain publish's ack has no count.
        let count = if n == 1 { ack.count.max(1) } else { ack.count };
        if count != n as u64 || ack.seq < n as u64 {
            return Err(RecordsError::Unanswered(format!(
                "commit acknowledged {count} of {n} writes"
            )));
        }
        // A batch's messages get consecutive sequences, ending at the acknowledged one.
        let first = ack.seq + 1 - n as u64;
        Ok((first..=ack.seq).collect())
    }
}

/// A stream's `max_msg_size` as a bound (`usize::MAX`: none).
fn max_msg_size(config: &stream::Config) -> usize {
    usize::try_from(config.max_message_size)
        .ok()
        .filter(|&n| n > 0)
        .unwrap_or(usize::MAX)
}

/// A record as a read returned its message.
fn versioned(m: async_nats::jetstream::message::StreamMessage) -> Versioned {
    Versioned {
        value: if m.headers.get(TOMBSTONE).is_some() {
            None
        } else {
            Some(m.payload)
        },
        revision: m.sequence,
    }
}

/// The server's answer to a batch commit.
#[derive(serde::Deserialize)]
struct BatchAck {
    #[serde(default)]
    seq: u64,
    #[serde(default)]
    count: u64,
    #[serde(default)]
    error: Option<ApiError>,
}

#[derive(serde::Deserialize)]
struct ApiError {
    #[serde(default)]
    err_code: u64,
    #[serde(default)]
    description: String,
}

/// The stream this layer needs: one message per subject (the record), atomic batches, direct
/// reads, per-message TTLs (tombstones), on disk.
fn stream_config(config: &RecordsConfig) -> stream::Config {
    stream::Config {
        name: config.stream.clone(),
        subjects: vec![format!("{}.>", config.prefix)],
        storage: stream::StorageType::File,
        num_replicas: config.replicas,
        max_messages_per_subject: 1,
        allow_direct: true,
        allow_atomic_publish: true,
        allow_message_ttl: true,
        description: Some("router store records (one message per record)".into()),
        ..Default::default()
    }
}

/// Refuses an existing stream that would break the layer's guarantees.
fn check_stream(have: &stream::Config, want: &stream::Config) -> Result<(), RecordsError> {
    let mut wrong = Vec::new();
    if have.max_messages_per_subject != 1 {
        wrong.push("max_msgs_per_subject must be 1");
    }
    if !have.allow_atomic_publish {
        wrong.push("allow_atomic must be true");
    }
    if !have.allow_direct {
        wrong.push("allow_direct must be true");
    }
    if !have.allow_message_ttl {
        wrong.push("allow_msg_ttl must be true");
    }
    if have.storage != stream::StorageType::File {
        wrong.push("storage must be file");
    }
    if have.max_age != Duration::ZERO || have.max_messages > 0 || have.max_bytes > 0 {
        wrong.push("no age, count or size limit may drop records");
    }
    if have.subjects != want.subjects {
        wrong.push("subjects differ from the configured prefix");
    }
    // A node configured for a replicated stream must not run on a single copy without
    // knowing (nor the other way round): the durability promised differs. Changing the
    // stream's replicas is the operator's decision, so it is refused, not updated.
    let replicas = (have.num_replicas.max(1) != want.num_replicas.max(1)).then(|| {
        format!(
            "it has {} replica(s) but store.jetstream.replicas is {} (change the stream's \
             replicas, e.g. `nats stream edit {} --replicas {}`, or the setting)",
            have.num_replicas.max(1),
            want.num_replicas.max(1),
            have.name,
            want.num_replicas.max(1)
        )
    });
    let mut wrong: Vec<String> = wrong.into_iter().map(str::to_string).collect();
    wrong.extend(replicas);
    if wrong.is_empty() {
        Ok(())
    } else {
        Err(RecordsError::Unsupported(format!(
            "stream {:?} exists with other settings: {}",
            have.name,
            wrong.join("; ")
        )))
    }
}

/// Refuses servers older than `MIN_SERVER`.
fn check_server_version(version: &str) -> Result<(), RecordsError> {
    let mut parts = version
        .trim_start_matches('v')
        .split(['.', '-'])
        .map(|p| p.parse::<u64>().ok());
    let major = parts.next().flatten();
    let minor = parts.next().flatten();
    match (major, minor) {
        (Some(a), Some(b)) if (a, b) >= MIN_SERVER => Ok(()),
        _ => Err(RecordsError::Unsupported(format!(
            "nats-server {version}: the JetStream store needs {}.{} or newer (atomic batch publish)",
            MIN_SERVER.0, MIN_SERVER.1
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn server_versions_below_2_12_are_refused() {
        assert!(check_server_version("2.9.10").is_err());
        assert!(check_server_version("2.11.9").is_err());
        assert!(check_server_version("garbage").is_err());
        assert!(check_server_version("2.12.0").is_ok());
        assert!(check_server_version("2.15.1").is_ok());
        assert!(check_server_version("3.0.0-beta.1").is_ok());
    }
}

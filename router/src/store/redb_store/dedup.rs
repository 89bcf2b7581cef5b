//! The ingest dedup index: which (`source`, `id`) pairs the store holds, for the dedup check at
//! accept and the fate lookup. A small log-structured index inside redb (docs/dedup-index.md):
//!
//! - keys are 128-bit fingerprints of the dedup key (SHA-256, truncated): random, so a B-tree
//!   keyed by them would copy one leaf per insert (measured: random event ids cut batched
//!   ingest to 0.38 of sequential ones). Two different keys share a fingerprint with
//!   probability about n²/2¹²⁹ — 10¹² keys give 10⁻¹⁵ — which is taken as never;
//! - the keys accepted since the last run was written live in memory (the memtable), made
//!   durable by `dedup_log` (`seq → (fingerprint, accepted_at)`), whose keys grow with each
//!   event, so a group's appends share a leaf;
//! - at each hour, or when the memtable reaches its bound, it is frozen and written, sorted,
//!   as a run into `dedup_run_keys` (`(run, fingerprint, seq) → accepted_at`), whose run
//!   number grows, so the run fills leaves one after another. It is written a chunk per
//!   commit (a run is up to a million keys; one commit for all of it would stall ingest) and
//!   registered in `dedup_runs` with its Bloom filter by the commit of its last chunk;
//! - a run is dropped whole once the sweep has passed its range: no random deletes either.
//!   The keys of events the sweep keeps (a dead letter, a stuck target's entry) move to a
//!   small table of their own (`dedup_kept`) first, for their fate.
//!
//! This module holds the in-memory side (memtable, frozen memtable, runs with their filters)
//! and its encodings; the committer (`redb_store.rs`) does the table work.

use std::sync::Arc;

use rustc_hash::FxHashMap;
use sha2::{Digest, Sha256};
use smallvec::SmallVec;

/// A dedup key's fingerprint.
pub(super) type Fp = u128;

/// Rows written to, or removed from, the run table per commit. A chunk of sorted appends is
/// about 60 leaves: a millisecond or two added to the group that carries it.
pub(super) const CHUNK: usize = 4096;

/// Default bound of the memtable, in keys: a run is cut early when it is reached. At about
/// 60 bytes a key (the map entry and its share of the frozen copy) that is ~60 MB.
pub(super) const MEMTABLE_KEYS: usize = 1 << 20;

/// Memtables of fewer keys are sorted on the committer (a few milliseconds); larger ones on
/// a thread of their own.
pub(super) const FREEZE_INLINE_KEYS: usize = 65_536;

/// A run is cut at least this often, so the runs inside the dedup window, which every
/// accept consults, stay few (24 at the default window) whatever the rate.
pub(super) const RUN_SPAN_MS: i64 = 3_600_000;

/// Bits of Bloom filter per key: about 1 % false positives with `BLOOM_HASHES`.
const BLOOM_BITS_PER_KEY: usize = 10;
const BLOOM_HASHES: u32 = 7;
/// Words per block of a blocked filter: 512 bits, one cache line.
const BLOCK_WORDS: usize = 8;

/// The fingerprint of a dedup key (`crate::event::dedup_key`).
pub(super) fn fingerprint(dedup_key: &str) -> Fp {
    let digest = Sha256::digest(dedup_key.as_bytes());
    let mut b = [0u8; 16];
    b.copy_from_slice(&digest[..16]);
    u128::from_le_bytes(b)
}

/// A Bloom filter over fingerprints. Written here rather than taken from a crate: its input
/// is already a uniform hash (no hashing to choose), and its bytes are part of the store's
/// on-disk format, which must not change with a dependency's version.
///
/// Blocked (Putze, Sanders and Singler, "Cache-, hash- and space-efficient Bloom filters"):
/// all of a key's bits lie in one 512-bit block, so a probe costs one cache miss instead of
/// one per hash. Accept probes every run inside the dedup window, and the filters of many runs
/// do not fit in the CPU's caches. The price is a slightly higher false-positive rate (about
/// 1 % instead of 0.8 % at 10 bits per key); a false positive costs one B-tree read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Bloom {
    words: Vec<u64>,
    /// Run records written before blocked filters (layout 1) spread a key's bits over the
    /// whole filter.
    blocked: bool,
}

impl Bloom {
    /// An empty filter sized for `keys` keys.
    pub(super) fn for_keys(keys: usize) -> Self {
        let blocks = (keys.max(1) * BLOOM_BITS_PER_KEY).div_ceil(64 * BLOCK_WORDS);
        Self {
            words: vec![0; blocks * BLOCK_WORDS],
            blocked: true,
        }
    }

    /// The bit positions of `fp`. Blocked: the block from the low half (multiply-shift, no
    /// division), and 9 bits of the high half per hash for the bit inside it. Layout 1: double
    /// hashing over the two halves.
    fn positions(&self, fp: Fp) -> impl Iterator<Item = usize> + use<> {
        let h1 = fp as u64;
        let h2 = (fp >> 64) as u64;
        let blocked = self.blocked;
        let blocks = (self.words.len() / BLOCK_WORDS) as u128;
        let base = ((u128::from(h1) * blocks) >> 64) as usize * BLOCK_WORDS * 64;
        let m = (self.words.len() * 64) as u64;
        (0..u64::from(BLOOM_HASHES)).map(move |i| {
            if blocked {
                base + ((h2 >> (9 * i)) & 511) as usize
            } else {
                (h1.wrapping_add(i.wrapping_mul(h2 | 1)) % m) as usize
            }
        })
    }

    pub(super) fn insert(&mut self, fp: Fp) {
        for p in self.positions(fp) {
            self.words[p / 64] |= 1 << (p % 64);
        }
    }

    /// False: `fp` was never inserted. True: it may have been.
    pub(super) fn may_contain(&self, fp: Fp) -> bool {
        self.positions(fp)
            .all(|p| self.words[p / 64] & (1 << (p % 64)) != 0)
    }

    /// Heap bytes.
    pub(super) fn bytes(&self) -> usize {
        self.words.len() * 8
    }
}

/// A run written to `dedup_run_keys` and registered in `dedup_runs`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Run {
    pub(super) id: u64,
    /// The sequence numbers of the events it covers (every event accepted in between).
    pub(super) seq_lo: u64,
    pub(super) seq_hi: u64,
    pub(super) keys: u64,
    /// The latest acceptance time among its keys: a run older than the dedup window is not
    /// consulted by accept.
    pub(super) max_at: i64,
    /// Its filter, while the run is inside the dedup window. `None` once it is older (a cold
    /// run, `DedupState::cool`): accept no longer consults it, and the rare fate lookup reads
    /// its rows directly instead. Filters are about 1.25 bytes a key; kept for every run of
    /// the event retention (7 days by default) they would grow with it.
    pub(super) bloom: Option<Bloom>,
}

/// Layout versions of a `dedup_runs` record: 1 with a classic filter, 2 with a blocked one.
const RUN_RECORD_V1: u8 = 1;
const RUN_RECORD_V2: u8 = 2;
const RUN_HEADER: usize = 1 + 8 * 4;

impl Run {
    /// The `dedup_runs` record (its key is the run id): version, seq range, key count, latest
    /// acceptance time, then the filter's words, all little-endian. Only a run with its filter
    /// is ever written (a frozen memtable's).
    pub(super) fn encode(&self) -> Vec<u8> {
        let words = self.bloom.as_ref().map_or(&[][..], |f| &f.words);
        let mut b = Vec::with_capacity(RUN_HEADER + words.len() * 8);
        b.push(if self.bloom.as_ref().is_none_or(|f| f.blocked) {
            RUN_RECORD_V2
        } else {
            RUN_RECORD_V1
        });
        b.extend_from_slice(&self.seq_lo.to_le_bytes());
        b.extend_from_slice(&self.seq_hi.to_le_bytes());
        b.extend_from_slice(&self.keys.to_le_bytes());
        b.extend_from_slice(&self.max_at.to_le_bytes());
        for w in words {
            b.extend_from_slice(&w.to_le_bytes());
        }
        b
    }

    /// Decodes a `dedup_runs` record. A run whose every key was accepted before `cold_before`
    /// (the start of the dedup window) is cold: its filter's words are checked but not read.
    pub(super) fn decode(id: u64, b: &[u8], cold_before: Option<i64>) -> Result<Self, String> {
        if b.len() < RUN_HEADER
            || !matches!(b[0], RUN_RECORD_V1 | RUN_RECORD_V2)
            || !(b.len() - RUN_HEADER).is_multiple_of(8)
        {
            return Err(format!(
                "dedup run {id}: malformed record ({} bytes)",
                b.len()
            ));
        }
        let word = |i: usize| {
            let mut w = [0u8; 8];
            w.copy_from_slice(&b[i..i + 8]);
            w
        };
        if b.len() == RUN_HEADER {
            return Err(format!("dedup run {id}: empty filter"));
        }
        let max_at = i64::from_le_bytes(word(25));
        let bloom = cold_before.is_none_or(|at| max_at >= at).then(|| Bloom {
            words: b[RUN_HEADER..]
                .chunks_exact(8)
                .map(|c| u64::from_le_bytes(c.try_into().unwrap_or([0; 8])))
                .collect(),
            blocked: b[0] == RUN_RECORD_V2,
        });
        Ok(Self {
            id,
            seq_lo: u64::from_le_bytes(word(1)),
            seq_hi: u64::from_le_bytes(word(9)),
            keys: u64::from_le_bytes(word(17)),
            max_at,
            bloom,
        })
    }
}

/// One key of the index: (fingerprint, seq, accepted_at).
pub(super) type Row = (Fp, u64, i64);

/// A memtable frozen for writing as run `id`: its rows sorted by (fingerprint, seq).
#[derive(Debug)]
pub(super) struct Frozen {
    pub(super) run: Run,
    pub(super) rows: Vec<Row>,
}

impl Frozen {
    /// The newest row of `fp`.
    fn newest(&self, fp: Fp) -> Option<(u64, i64)> {
        let end = self.rows.partition_point(|r| r.0 <= fp);
        (end > 0 && self.rows[end - 1].0 == fp)
            .then(|| (self.rows[end - 1].1, self.rows[end - 1].2))
    }

    /// Every row of `fp`, newest first.
    fn all(&self, fp: Fp) -> impl Iterator<Item = u64> + '_ {
        let start = self.rows.partition_point(|r| r.0 < fp);
        self.rows[start..]
            .iter()
            .take_while(move |r| r.0 == fp)
            .map(|r| r.1)
            .collect::<SmallVec<[u64; 2]>>()
            .into_iter()
            .rev()
    }
}

/// The (seq, accepted_at) of each event accepted with one fingerprint.
type Seqs = SmallVec<[(u64, i64); 1]>;

/// Shards of the memtable's map, chosen by a fingerprint's top bits.
const MEM_SHARDS: usize = 256;

/// The memtable's map: fingerprint → (seq, accepted_at) of each key accepted with it.
///
/// Split into `MEM_SHARDS` maps: a hash map doubles its table when it fills, moving every key
/// at once, and this one is grown on the committer thread, so every request waiting behind
/// that commit waited for it. Measured with one map: 25, 37 and 77 ms at 229,376, 458,752 and
/// 917,504 keys in a plain loop, and 187–280 ms stalls of `router bench store` at 917,504
/// events. Each shard grows by a 256th of that, and (the fingerprints being uniform) the
/// shards grow at different commits.
#[derive(Debug)]
pub(super) struct MemMap {
    shards: Vec<FxHashMap<Fp, Seqs>>,
}

impl Default for MemMap {
    fn default() -> Self {
        Self {
            shards: (0..MEM_SHARDS).map(|_| FxHashMap::default()).collect(),
        }
    }
}

impl MemMap {
    fn shard(fp: Fp) -> usize {
        (fp >> 120) as usize % MEM_SHARDS
    }

    fn get(&self, fp: &Fp) -> Option<&Seqs> {
        self.shards[Self::shard(*fp)].get(fp)
    }

    fn push(&mut self, fp: Fp, seq: u64, at: i64) {
        self.shards[Self::shard(fp)]
            .entry(fp)
            .or_default()
            .push((seq, at));
    }

    fn iter(&self) -> impl Iterator<Item = (&Fp, &Seqs)> {
        self.shards.iter().flatten()
    }
}

/// A memtable sealed as run `id`: no longer written to, still answering lookups while a
/// background thread sorts it into a `Frozen` (about 0.2 s for a million keys, which would
/// otherwise stall every commit waiting behind the committer).
#[derive(Debug)]
pub(super) struct Sealed {
    id: u64,
    mem: MemMap,
    keys: usize,
}

impl Sealed {
    /// Keys it holds.
    pub(super) fn keys(&self) -> usize {
        self.keys
    }

    /// The memtable's rows sorted, with the run's filter and ranges.
    pub(super) fn freeze(&self) -> Frozen {
        let mut rows: Vec<Row> = Vec::with_capacity(self.keys);
        for (fp, seqs) in self.mem.iter() {
            rows.extend(seqs.iter().map(|&(seq, at)| (*fp, seq, at)));
        }
        rows.sort_unstable();
        let mut bloom = Bloom::for_keys(rows.len());
        let (mut seq_lo, mut seq_hi, mut max_at) = (u64::MAX, 0, i64::MIN);
        for r in &rows {
            bloom.insert(r.0);
            seq_lo = seq_lo.min(r.1);
            seq_hi = seq_hi.max(r.1);
            max_at = max_at.max(r.2);
        }
        let run = Run {
            id: self.id,
            seq_lo,
            seq_hi,
            keys: rows.len() as u64,
            max_at,
            bloom: Some(bloom),
        };
        Frozen { run, rows }
    }
}

/// The in-memory side of the index, shared by the committer (which changes it after each
/// commit) and readers (fate lookups).
#[derive(Debug, Default)]
pub(super) struct DedupState {
    /// Keys accepted since the frozen memtable (or the newest run) was cut.
    mem: MemMap,
    mem_keys: usize,
    /// The earliest acceptance time in `mem`.
    mem_lo: Option<i64>,
    /// Being sorted into the frozen memtable (`seal`, `install`).
    pub(super) sealed: Option<Arc<Sealed>>,
    /// Being written as a run (not registered yet).
    pub(super) frozen: Option<Arc<Frozen>>,
    /// Registered runs, oldest first.
    pub(super) runs: Vec<Run>,
    /// The next run's id.
    pub(super) next_run: u64,
    /// Run ids whose rows are still in `dedup_run_keys` but which are not registered (dropped
    /// by the sweep, or left half-written by a crash): removed a chunk per commit.
    pub(super) orphans: Vec<u64>,
    /// `dedup_log` rows up to this sequence number are covered by registered runs and are
    /// removed a chunk per commit (recovery ignores them meanwhile).
    pub(super) log_floor: u64,
    /// `dedup_log` holds no row up to this sequence number.
    pub(super) log_cleaned: u64,
}

impl DedupState {
    /// A state from what recovery read: the registered runs, the orphan run ids, the
    /// `dedup_log` rows above the newest run (in sequence order), and the first free run id.
    pub(super) fn rebuilt(
        mut runs: Vec<Run>,
        orphans: Vec<u64>,
        log: impl IntoIterator<Item = Row>,
        next_run: u64,
    ) -> Self {
        runs.sort_by_key(|r| r.id);
        let log_floor = runs.iter().map(|r| r.seq_hi).max().unwrap_or(0);
        let mut s = Self {
            runs,
            orphans,
            next_run,
            log_floor,
            ..Self::default()
        };
        for (fp, seq, at) in log {
            s.insert(fp, seq, at);
        }
        s
    }

    /// Adds an accepted key (after its commit).
    pub(super) fn insert(&mut self, fp: Fp, seq: u64, at: i64) {
        self.mem.push(fp, seq, at);
        self.mem_keys += 1;
        self.mem_lo = Some(self.mem_lo.map_or(at, |lo| lo.min(at)));
    }

    /// Nothing left for the committer's background work: no run to write, no rows to remove.
    pub(super) fn settled(&self) -> bool {
        self.frozen.is_none() && self.orphans.is_empty() && self.log_cleaned >= self.log_floor
    }

    /// Keys in memory and in runs (`router_store_records{kind="dedup_key"}`).
    pub(super) fn keys(&self) -> u64 {
        let frozen = self.frozen.as_ref().map_or(0, |f| f.run.keys);
        let sealed = self.sealed.as_ref().map_or(0, |s| s.keys as u64);
        self.mem_keys as u64 + sealed + frozen + self.runs.iter().map(|r| r.keys).sum::<u64>()
    }

    /// Keys that may have been accepted at or after `at` (the start of the dedup window): those
    /// in memory and in the runs whose latest key is that recent. A run that straddles `at`
    /// counts whole, so this is an upper bound, off by at most one run's keys.
    pub(super) fn keys_since(&self, at: i64) -> u64 {
        let frozen = self.frozen.as_ref().map_or(0, |f| f.run.keys);
        let sealed = self.sealed.as_ref().map_or(0, |s| s.keys as u64);
        self.mem_keys as u64
            + sealed
            + frozen
            + self
                .runs
                .iter()
                .filter(|r| r.max_at >= at)
                .map(|r| r.keys)
                .sum::<u64>()
    }

    /// Heap bytes of the filters (what every run inside the dedup window keeps in memory).
    pub(super) fn filter_bytes(&self) -> usize {
        self.runs
            .iter()
            .filter_map(|r| r.bloom.as_ref())
            .map(Bloom::bytes)
            .sum()
    }

    /// Runs without their filter (older than the dedup window).
    pub(super) fn cold_runs(&self) -> usize {
        self.runs.iter().filter(|r| r.bloom.is_none()).count()
    }

    /// Drops the filters of runs whose every key was accepted before `before_at` (the start of
    /// the dedup window): accept does not consult them any more. Returns the bytes freed.
    pub(super) fn cool(&mut self, before_at: i64) -> usize {
        let mut freed = 0;
        for run in self.runs.iter_mut().filter(|r| r.max_at < before_at) {
            freed += run.bloom.take().map_or(0, |f| f.bytes());
        }
        freed
    }

    /// Whether the memtable should be frozen now: it reached `max_keys`, or its oldest key is
    /// from an earlier hour than `now`. Never while the previous one is still being sorted or
    /// written.
    pub(super) fn should_freeze(&self, now: i64, max_keys: usize) -> bool {
        self.frozen.is_none()
            && self.sealed.is_none()
            && self.mem_lo.is_some_and(|at| {
                self.mem_keys >= max_keys
                    || at.div_euclid(RUN_SPAN_MS) != now.div_euclid(RUN_SPAN_MS)
            })
    }

    /// Freezes the memtable as the next run (sorting it and building its filter) on the
    /// calling thread; the memtable starts empty.
    #[cfg(test)]
    pub(super) fn freeze(&mut self) {
        if let Some(sealed) = self.seal() {
            let frozen = sealed.freeze();
            self.install(&sealed, frozen);
        }
    }

    /// Seals the memtable as the next run: lookups still see it, and `Sealed::freeze` (on any
    /// thread) makes the frozen memtable that `install` puts in its place. The memtable starts
    /// empty. `None` when it is empty or a sealed one is pending.
    pub(super) fn seal(&mut self) -> Option<Arc<Sealed>> {
        if self.sealed.is_some() || self.frozen.is_some() || self.mem_lo.take().is_none() {
            return None;
        }
        let sealed = Arc::new(Sealed {
            id: self.next_run,
            mem: std::mem::take(&mut self.mem),
            keys: std::mem::take(&mut self.mem_keys),
        });
        self.next_run += 1;
        self.sealed = Some(sealed.clone());
        Some(sealed)
    }

    /// Puts the frozen form of `sealed` in its place. Refused (false) when `sealed` is not
    /// the pending one: recovery rebuilt the state meanwhile, from `dedup_log`, which still
    /// holds those keys.
    pub(super) fn install(&mut self, sealed: &Arc<Sealed>, frozen: Frozen) -> bool {
        if !self.sealed.as_ref().is_some_and(|s| Arc::ptr_eq(s, sealed)) {
            return false;
        }
        self.sealed = None;
        self.frozen = Some(Arc::new(frozen));
        true
    }

    /// The frozen memtable's run is registered: it is now a run like the others.
    pub(super) fn registered(&mut self) {
        if let Some(f) = self.frozen.take() {
            self.log_floor = self.log_floor.max(f.run.seq_hi);
            self.runs.push(f.run.clone());
        }
    }

    /// Runs the sweep dropped: their rows are to be removed.
    pub(super) fn dropped(&mut self, ids: &[u64]) {
        self.runs.retain(|r| !ids.contains(&r.id));
        self.orphans.extend_from_slice(ids);
    }

    /// The newest key `fp` accepted at or after `min_at`. `probe(run, fp)` reads a run's
    /// newest row of `fp` from `dedup_run_keys`; only runs that can hold such a key (young
    /// enough, and admitted by their filter) are probed.
    pub(super) fn newest<E>(
        &self,
        fp: Fp,
        min_at: i64,
        mut probe: impl FnMut(u64, Fp) -> Result<Option<(u64, i64)>, E>,
    ) -> Result<Option<(u64, i64)>, E> {
        let young = |hit: Option<(u64, i64)>| hit.filter(|(_, at)| *at >= min_at);
        if let Some(seqs) = self.mem.get(&fp) {
            return Ok(young(seqs.iter().copied().max()));
        }
        if let Some(seqs) = self.sealed.as_ref().and_then(|s| s.mem.get(&fp)) {
            return Ok(young(seqs.iter().copied().max()));
        }
        if let Some(f) = &self.frozen
            && let Some(hit) = f.newest(fp)
        {
            return Ok(young(Some(hit)));
        }
        for run in self.runs.iter().rev() {
            if run.max_at < min_at {
                // Every key of this run is older than the window. (Not `break`: acceptance
                // times are only roughly in sequence order, by the milliseconds that ingest
                // threads race to the committer.)
                continue;
            }
            // A cold run inside the window (the clock went back since it was cooled) is read
            // directly: slower, never wrong.
            if run.bloom.as_ref().is_none_or(|f| f.may_contain(fp))
                && let Some(hit) = probe(run.id, fp)?
            {
                return Ok(young(Some(hit)));
            }
        }
        Ok(None)
    }

    /// Every event `fp` was accepted as that memory knows of (memtable, frozen memtable),
    /// newest first, and the runs whose filter admits `fp` or that have none (cold), newest
    /// first: the fate lookup reads those and confirms each candidate against the event.
    pub(super) fn candidates(&self, fp: Fp) -> (Vec<u64>, Vec<u64>) {
        let mut seqs: Vec<u64> = self
            .mem
            .get(&fp)
            .map(|s| s.iter().map(|r| r.0).collect())
            .unwrap_or_default();
        seqs.sort_unstable_by(|a, b| b.cmp(a));
        if let Some(sealed) = self.sealed.as_ref().and_then(|s| s.mem.get(&fp)) {
            let at = seqs.len();
            seqs.extend(sealed.iter().map(|r| r.0));
            seqs[at..].sort_unstable_by(|a, b| b.cmp(a));
        }
        if let Some(f) = &self.frozen {
            seqs.extend(f.all(fp));
        }
        let runs = self
            .runs
            .iter()
            .rev()
            .filter(|r| r.bloom.as_ref().is_none_or(|f| f.may_contain(fp)))
            .map(|r| r.id)
            .collect();
        (seqs, runs)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fp(i: u64) -> Fp {
        fingerprint(&crate::event::dedup_key("s", &i.to_string()))
    }

    #[test]
    fn fingerprints_differ_and_are_stable() {
        assert_ne!(fp(1), fp(2));
        assert_eq!(fp(7), fp(7));
        // The value is part of the on-disk format: it must never change.
        assert_eq!(
            fingerprint("1:s\u{0}1"),
            u128::from_le_bytes(Sha256::digest(b"1:s\x001")[..16].try_into().unwrap())
        );
    }

    #[test]
    fn the_filter_has_no_false_negatives_and_about_one_percent_false_positives() {
        let mut b = Bloom::for_keys(10_000);
        for i in 0..10_000 {
            b.insert(fp(i));
        }
        assert!((0..10_000).all(|i| b.may_contain(fp(i))));
        let false_positives = (10_000..110_000).filter(|i| b.may_contain(fp(*i))).count();
        // 10 bits and 7 hashes per key in 512-bit blocks: about 1 % expected (0.8 % unblocked).
        assert!(false_positives < 2_000, "{false_positives} of 100,000");
        // Every key's bits lie in one block.
        for i in [1, 77, 9_999] {
            let p: Vec<usize> = b.positions(fp(i)).collect();
            assert!(p.iter().all(|x| x / 512 == p[0] / 512), "{p:?}");
        }
    }

    /// What a lookup's filter probes cost when there are many runs (their filters far larger
    /// than the CPU's caches), blocked against classic. A measurement, not a check:
    /// `cargo test --release -p router --lib bloom_probe_cost -- --ignored --nocapture`.
    #[test]
    #[ignore = "a measurement, not a check"]
    fn bloom_probe_cost() {
        const RUNS: u64 = 48;
        const KEYS: u64 = 1 << 20;
        // Uniform fingerprints without SHA-256's cost (splitmix64 on both halves).
        let mix = |mut z: u64| {
            z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            z ^ (z >> 31)
        };
        let fp = |i: u64| (u128::from(mix(i)) << 64) | u128::from(mix(!i));
        for blocked in [true, false] {
            let filters: Vec<Bloom> = (0..RUNS)
                .map(|r| {
                    let mut b = Bloom::for_keys(KEYS as usize);
                    b.blocked = blocked;
                    for i in 0..KEYS {
                        b.insert(fp(r * KEYS + i));
                    }
                    b
                })
                .collect();
            let probes = 200_000u64;
            let started = std::time::Instant::now();
            let mut hits = 0u64;
            for i in 0..probes {
                let absent = fp(RUNS * KEYS + i);
                hits += filters.iter().filter(|b| b.may_contain(absent)).count() as u64;
            }
            let ns = started.elapsed().as_nanos() as f64 / (probes * RUNS) as f64;
            println!(
                "{} filters of {KEYS} keys ({} MB in all), {}: {ns:.1} ns per filter probed, \
                 {:.2} % false positives",
                RUNS,
                filters.iter().map(Bloom::bytes).sum::<usize>() >> 20,
                if blocked { "blocked" } else { "classic" },
                hits as f64 * 100.0 / (probes * RUNS) as f64
            );
        }
    }

    #[test]
    fn the_sharded_memtable_finds_every_key_and_lists_each_once() {
        let mut m = MemMap::default();
        for i in 0..2_000u64 {
            m.push(fp(i), i, 7);
        }
        m.push(fp(5), 9_000, 8);
        assert_eq!(
            m.get(&fp(5)).map(|s| s.to_vec()),
            Some(vec![(5, 7), (9_000, 8)])
        );
        assert!(m.get(&fp(2_000)).is_none());
        assert_eq!(m.iter().count(), 2_000);
        assert_eq!(m.iter().map(|(_, s)| s.len()).sum::<usize>(), 2_001);
        // Uniform fingerprints use every shard.
        assert!(m.shards.iter().all(|s| !s.is_empty()));
    }

    /// The longest single insert into the memtable while it grows past a million keys, sharded
    /// against one map. A measurement, not a check: `cargo test --release -p router --lib
    /// memtable_growth_stall -- --ignored --nocapture`.
    #[test]
    #[ignore = "a measurement, not a check"]
    fn memtable_growth_stall() {
        const KEYS: u64 = 1_100_000;
        let fps: Vec<Fp> = (0..KEYS).map(fp).collect();
        let worst = |mut insert: Box<dyn FnMut(Fp, u64)>| {
            let mut worst = (std::time::Duration::ZERO, 0);
            for (i, f) in fps.iter().enumerate() {
                let started = std::time::Instant::now();
                insert(*f, i as u64);
                let took = started.elapsed();
                if took > worst.0 {
                    worst = (took, i);
                }
            }
            worst
        };
        let mut one: FxHashMap<Fp, Seqs> = FxHashMap::default();
        let (took, at) = worst(Box::new(move |f, i| {
            one.entry(f).or_default().push((i, 0));
        }));
        println!("one map: longest insert {took:?} at key {at}");
        let mut sharded = MemMap::default();
        let (took, at) = worst(Box::new(move |f, i| sharded.push(f, i, 0)));
        println!("{MEM_SHARDS} shards: longest insert {took:?} at key {at}");
    }

    #[test]
    fn a_run_record_of_layout_1_still_reads_with_its_classic_filter() {
        let mut bloom = Bloom {
            words: vec![0; 157],
            blocked: false,
        };
        for i in 0..100 {
            bloom.insert(fp(i));
        }
        let run = Run {
            id: 4,
            seq_lo: 1,
            seq_hi: 100,
            keys: 100,
            max_at: 5,
            bloom: Some(bloom),
        };
        let b = run.encode();
        assert_eq!(b[0], RUN_RECORD_V1);
        let back = Run::decode(4, &b, None).unwrap();
        assert_eq!(back, run);
        let filter = back.bloom.unwrap();
        assert!((0..100).all(|i| filter.may_contain(fp(i))));
        assert!(Run::decode(4, &[[3u8].as_slice(), &b[1..]].concat(), None).is_err());
    }

    #[test]
    fn a_run_record_round_trips() {
        let mut bloom = Bloom::for_keys(100);
        bloom.insert(fp(3));
        let run = Run {
            id: 9,
            seq_lo: 10,
            seq_hi: 250,
            keys: 200,
            max_at: -5,
            bloom: Some(bloom),
        };
        assert_eq!(Run::decode(9, &run.encode(), None).unwrap(), run);
        // Cold (every key older than the window's start): the same record without its filter.
        assert_eq!(Run::decode(9, &run.encode(), Some(-5)).unwrap(), run);
        let cold = Run::decode(9, &run.encode(), Some(-4)).unwrap();
        assert_eq!(
            cold,
            Run {
                bloom: None,
                ..run.clone()
            }
        );
        assert!(Run::decode(9, &run.encode()[..20], None).is_err());
        assert!(Run::decode(9, &run.encode()[..RUN_HEADER], Some(i64::MAX)).is_err());
        assert!(Run::decode(9, &[9; 41], Some(i64::MAX)).is_err());
    }

    #[test]
    fn lookups_go_newest_first_through_memtable_frozen_and_runs() {
        let mut s = DedupState::default();
        s.insert(fp(1), 1, 100);
        s.insert(fp(2), 2, 100);
        s.freeze();
        let frozen = s.frozen.clone().unwrap();
        assert_eq!(
            (frozen.run.seq_lo, frozen.run.seq_hi, frozen.run.keys),
            (1, 2, 2)
        );
        s.insert(fp(1), 3, 200);
        let no_runs = |_, _| Ok::<_, ()>(None);
        // The memtable's newer key wins over the frozen one.
        assert_eq!(s.newest(fp(1), 0, no_runs), Ok(Some((3, 200))));
        assert_eq!(s.newest(fp(2), 0, no_runs), Ok(Some((2, 100))));
        // Older than the window: not a duplicate.
        assert_eq!(s.newest(fp(2), 101, no_runs), Ok(None));
        s.registered();
        assert_eq!(s.log_floor, 2);
        assert_eq!(s.runs.len(), 1);
        // Now in a run: found through the probe, which the filter lets through.
        let mut probed = Vec::new();
        let r = s.newest(fp(2), 0, |run, f| {
            probed.push(run);
            Ok::<_, ()>((f == fp(2)).then_some((2, 100)))
        });
        assert_eq!(r, Ok(Some((2, 100))));
        assert_eq!(probed, vec![0]);
        // A run whose keys are all older than the window is not probed.
        let r = s.newest(fp(2), 150, |_, _| -> Result<_, ()> { panic!("probed") });
        assert_eq!(r, Ok(None));
        assert_eq!(s.candidates(fp(1)), (vec![3], vec![0]));
        assert_eq!(s.keys(), 3);
        s.dropped(&[0]);
        assert!(s.runs.is_empty());
        assert_eq!(s.orphans, vec![0]);
    }

    #[test]
    fn runs_older_than_the_window_lose_their_filter_and_are_read_directly() {
        let mut s = DedupState::default();
        s.insert(fp(1), 1, 100);
        s.freeze();
        s.registered();
        s.insert(fp(2), 2, 5_000);
        s.freeze();
        s.registered();
        let hot = s.filter_bytes();
        assert!(hot > 0);
        // The window starts at 1,000: the first run (keys at 100) goes cold.
        let freed = s.cool(1_000);
        assert!(freed > 0);
        assert_eq!(s.filter_bytes(), hot - freed);
        assert_eq!(s.cold_runs(), 1);
        assert_eq!(s.cool(1_000), 0, "cooling twice frees nothing");
        // Accept, inside the window, never reads the cold run.
        let r = s.newest(fp(1), 1_000, |run, _| -> Result<_, ()> {
            panic!("run {run} probed")
        });
        assert_eq!(r, Ok(None));
        // A lookup reaching back past the window (the clock went back) reads it directly,
        // whatever the key: there is no filter to say no.
        let mut probed = Vec::new();
        let r = s.newest(fp(1), 0, |run, f| {
            probed.push(run);
            Ok::<_, ()>((run == 0 && f == fp(1)).then_some((1, 100)))
        });
        assert_eq!(r, Ok(Some((1, 100))));
        assert_eq!(probed, vec![0], "the hot run's filter said no");
        // The fate lookup reads every cold run, and the hot ones whose filter admits the key.
        assert_eq!(s.candidates(fp(1)).1, vec![0]);
        assert_eq!(s.candidates(fp(2)).1, vec![1, 0]);
    }

    #[test]
    fn a_sealed_memtable_answers_lookups_until_its_frozen_form_is_installed() {
        let mut s = DedupState::default();
        s.insert(fp(1), 1, 100);
        s.insert(fp(2), 2, 100);
        let sealed = s.seal().unwrap();
        assert!(s.seal().is_none(), "one sealed memtable at a time");
        assert!(!s.should_freeze(i64::MAX, 1));
        s.insert(fp(1), 3, 200);
        let none = |_: u64, _: Fp| Ok::<_, ()>(None);
        assert_eq!(s.newest(fp(2), 0, none), Ok(Some((2, 100))));
        assert_eq!(s.newest(fp(1), 0, none), Ok(Some((3, 200))));
        assert_eq!(s.candidates(fp(1)).0, vec![3, 1]);
        assert_eq!(s.keys(), 3);
        // A state rebuilt meanwhile (recovery) refuses another state's run.
        let mut other = DedupState::default();
        assert!(!other.install(&sealed, sealed.freeze()));
        assert!(other.frozen.is_none());
        assert!(s.install(&sealed, sealed.freeze()));
        assert!(s.sealed.is_none());
        assert_eq!(s.frozen.as_ref().unwrap().run.id, 0);
        assert_eq!(s.newest(fp(2), 0, none), Ok(Some((2, 100))));
        assert_eq!(s.candidates(fp(1)).0, vec![3, 1]);
        assert_eq!(s.keys(), 3);
    }

    #[test]
    fn a_memtable_freezes_at_its_bound_or_at_the_hour() {
        let mut s = DedupState::default();
        assert!(!s.should_freeze(0, 2));
        s.insert(fp(1), 1, 10);
        assert!(!s.should_freeze(20, 2));
        assert!(s.should_freeze(RUN_SPAN_MS + 1, 2));
        s.insert(fp(2), 2, 20);
        assert!(s.should_freeze(30, 2));
        s.freeze();
        s.insert(fp(3), 3, 30);
        s.insert(fp(4), 4, 30);
        // Not while the previous run is being written.
        assert!(!s.should_freeze(40, 2));
    }

    #[test]
    fn recovery_rebuilds_the_memtable_above_the_newest_run() {
        let mut bloom = Bloom::for_keys(1);
        bloom.insert(fp(1));
        let run = Run {
            id: 4,
            seq_lo: 1,
            seq_hi: 1,
            keys: 1,
            max_at: 10,
            bloom: Some(bloom),
        };
        let s = DedupState::rebuilt(vec![run], vec![5], [(fp(2), 2, 20)], 6);
        assert_eq!(s.log_floor, 1);
        assert_eq!(s.next_run, 6);
        assert_eq!(s.orphans, vec![5]);
        assert_eq!(
            s.newest(fp(2), 0, |_, _| Ok::<_, ()>(None)),
            Ok(Some((2, 20)))
        );
        assert_eq!(s.keys(), 2);
    }
}

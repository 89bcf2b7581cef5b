//! The group log: append-only files in front of redb that make a commit group durable with
//! one sequential write and one `fdatasync`.
//!
//! Without it, every group is a redb commit with `Durability::Immediate`: pages scattered over
//! the file written and synced while the committer waits. With it, the committer commits each
//! group to redb without a sync (`Durability::None`: readers see it at once, a crash forgets
//! it), records the group's physical writes (table, key, value or removal) here, and answers
//! the group's callers only once this log has synced them. The log writer is its own thread,
//! so the sync of one group overlaps the building of the next. Every so often the committer
//! makes a group durable in redb itself (a checkpoint), whose sync runs behind it
//! (`store::sync_behind`): everything logged up to it is then in redb once that sync is done.
//!
//! The log is two files used in turn: at a checkpoint the writer goes on at offset 0 of the
//! other file, over that file's older records, which the checkpoint before covers (its sync
//! completed before the writer switched, see `LogMsg::Switch`). So a checkpoint never waits
//! for its own sync: until the next switch, the file it leaves keeps the records it covers.
//!
//! At open, redb holds the state as of its last durable commit, which stores the sequence number
//! of the last group it contains; the records after it are read from both files and their
//! writes applied again in order (a record is the group's writes in order, so applying it
//! again is idempotent). In a file, a record is valid when its checksum matches and its
//! sequence number follows the previous one's: a torn write at the tail, or the older records
//! of an earlier lap behind the newest one, end that file's records. Records the store already
//! holds (those of an earlier lap, the other file's) are skipped by their sequence number.

use std::io;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc as std_mpsc;

use redb::StorageBackend;

use super::StoreError;

/// `GLG1`: marks the start of a record.
const MAGIC: u32 = 0x4747_4c31;
/// magic, checksum (u32 each), payload length, sequence number (u64 each).
const HEADER: usize = 24;
/// The log file grows by this much at a time (fewer size changes for the sync to record).
const GROW: u64 = 4 << 20;

/// What kind of write a mutation is.
const PUT: u8 = 1;
const DEL: u8 = 2;

/// The writes of one group, encoded as they happen.
#[derive(Default)]
pub(super) struct Mutations {
    buf: Vec<u8>,
    count: u32,
}

impl Mutations {
    /// Records `table[key] = value`.
    pub(super) fn put(&mut self, table: u8, key: &[u8], value: &[u8]) {
        self.push(table, PUT, key);
        self.buf
            .extend_from_slice(&u32::try_from(value.len()).unwrap_or(u32::MAX).to_le_bytes());
        self.buf.extend_from_slice(value);
    }

    /// Records the removal of `table[key]`.
    pub(super) fn del(&mut self, table: u8, key: &[u8]) {
        self.push(table, DEL, key);
    }

    fn push(&mut self, table: u8, kind: u8, key: &[u8]) {
        self.buf.push(table);
        self.buf.push(kind);
        self.buf
            .extend_from_slice(&u32::try_from(key.len()).unwrap_or(u32::MAX).to_le_bytes());
        self.buf.extend_from_slice(key);
        self.count += 1;
    }

    pub(super) fn clear(&mut self) {
        self.buf.clear();
        self.count = 0;
    }

    /// The group's record: header, then the mutations.
    pub(super) fn record(&self, seq: u64) -> Vec<u8> {
        let payload_len = 4 + self.buf.len();
        let mut out = Vec::with_capacity(HEADER + payload_len);
        out.extend_from_slice(&MAGIC.to_le_bytes());
        out.extend_from_slice(&[0; 4]);
        out.extend_from_slice(&(payload_len as u64).to_le_bytes());
        out.extend_from_slice(&seq.to_le_bytes());
        out.extend_from_slice(&self.count.to_le_bytes());
        out.extend_from_slice(&self.buf);
        let crc = checksum(seq, &out[HEADER..]);
        out[4..8].copy_from_slice(&crc.to_le_bytes());
        out
    }
}

fn checksum(seq: u64, payload: &[u8]) -> u32 {
    let mut h = crc32fast::Hasher::new();
    h.update(&seq.to_le_bytes());
    h.update(payload);
    h.finalize()
}

/// One write read back from the log.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Mutation<'a> {
    Put {
        table: u8,
        key: &'a [u8],
        value: &'a [u8],
    },
    Del {
        table: u8,
        key: &'a [u8],
    },
}

/// A valid record read back from the log.
pub(super) struct Record<'a> {
    pub seq: u64,
    payload: &'a [u8],
}

impl<'a> Record<'a> {
    /// The length of its payload (the record is the header and the payload).
    #[cfg(test)]
    pub(super) fn payload_len(&self) -> usize {
        self.payload.len()
    }

    /// The record's writes, in the order they were made.
    pub(super) fn mutations(&self) -> Result<Vec<Mutation<'a>>, StoreError> {
        let corrupt = || StoreError::Corrupt {
            table: "group log",
            message: format!("record {} is malformed", self.seq),
        };
        let mut r = Reader(self.payload);
        let count = r.u32().ok_or_else(corrupt)?;
        let mut out = Vec::with_capacity(count.min(1 << 16) as usize);
        for _ in 0..count {
            let table = r.u8().ok_or_else(corrupt)?;
            let kind = r.u8().ok_or_else(corrupt)?;
            let key = r.bytes().ok_or_else(corrupt)?;
            out.push(match kind {
                PUT => Mutation::Put {
                    table,
                    key,
                    value: r.bytes().ok_or_else(corrupt)?,
                },
                DEL => Mutation::Del { table, key },
                _ => return Err(corrupt()),
            });
        }
        if !r.0.is_empty() {
            return Err(corrupt());
        }
        Ok(out)
    }
}

struct Reader<'a>(&'a [u8]);

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        if self.0.len() < n {
            return None;
        }
        let (a, b) = self.0.split_at(n);
        self.0 = b;
        Some(a)
    }
    fn u8(&mut self) -> Option<u8> {
        self.take(1).map(|b| b[0])
    }
    fn u32(&mut self) -> Option<u32> {
        self.take(4)
            .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }
    fn bytes(&mut self) -> Option<&'a [u8]> {
        let n = self.u32()? as usize;
        self.take(n)
    }
}

/// The valid records of a log image, from offset 0: each with a matching checksum and the
/// sequence number following the previous one's. What follows the first invalid one is a
/// torn tail or an earlier lap's leftovers.
pub(super) fn records(image: &[u8]) -> Vec<Record<'_>> {
    records_to(image).0
}

/// `records`, and the offset where they end (where the first invalid record, if any, starts).
fn records_to(image: &[u8]) -> (Vec<Record<'_>>, usize) {
    let mut out: Vec<Record<'_>> = Vec::new();
    let mut at = 0usize;
    while let Some((seq, payload, end)) = record_at(image, at) {
        if let Some(prev) = out.last()
            && prev.seq.checked_add(1) != Some(seq)
        {
            break;
        }
        out.push(Record { seq, payload });
        at = end;
    }
    (out, at)
}

/// The record at `at` when it is whole and its checksum matches: its sequence number,
/// payload and where it ends.
fn record_at(image: &[u8], at: usize) -> Option<(u64, &[u8], usize)> {
    let h = image.get(at..at.checked_add(HEADER)?)?;
    let word = |i: usize| u32::from_le_bytes([h[i], h[i + 1], h[i + 2], h[i + 3]]);
    let long = |i: usize| {
        let mut b = [0u8; 8];
        b.copy_from_slice(&h[i..i + 8]);
        u64::from_le_bytes(b)
    };
    if word(0) != MAGIC {
        return None;
    }
    let end = usize::try_from(long(8))
        .ok()
        .and_then(|len| (at + HEADER).checked_add(len))?;
    let seq = long(16);
    let payload = image.get(at + HEADER..end)?;
    (checksum(seq, payload) == crc_of(h)).then_some((seq, payload, end))
}

fn crc_of(header: &[u8]) -> u32 {
    u32::from_le_bytes([header[4], header[5], header[6], header[7]])
}

/// Where a log file's records stop at a record that does not check, with valid records of
/// later groups past it: damage in the middle of the file, not a torn tail. A write torn by
/// a crash is the last one made, so what lies past it is an earlier lap's leftovers, of
/// lower sequence numbers; a later group past a bad record was written after it, and was
/// acknowledged once synced. (One exception: the groups the writer queued together share a
/// write and a sync, and a power cut before that sync may keep a later page of the write and
/// not an earlier one. Those groups were never acknowledged; the refusal says so, and cutting
/// the file at the damage, what it says to do to go on, loses nothing acknowledged then.)
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct LogDamage {
    /// Which file (index into the log's files).
    pub file: usize,
    /// Where the record that does not check starts.
    pub offset: usize,
    /// How many valid records of groups the store does not hold lie past it.
    pub later_groups: usize,
    /// The first and last of their sequence numbers.
    pub seqs: (u64, u64),
}

/// The damage of each log file whose records stop before records of groups past `held` (the
/// last group the store file holds), if any: applying what comes before it and dropping the
/// rest would lose acknowledged groups without a word.
pub(super) fn damage(images: &Images, held: u64) -> Option<LogDamage> {
    images.iter().enumerate().find_map(|(file, image)| {
        let (good, offset) = records_to(image);
        let above = good.last().map_or(held, |r| r.seq.max(held));
        // Records are not aligned: every place the magic number appears is looked at.
        let magic = MAGIC.to_le_bytes();
        let later: Vec<u64> = memchr::memmem::find_iter(image.get(offset + 1..)?, &magic)
            .filter_map(|i| record_at(image, offset + 1 + i))
            .map(|(seq, _, _)| seq)
            .filter(|&seq| seq > above)
            .collect();
        let (first, last) = (*later.iter().min()?, *later.iter().max()?);
        Some(LogDamage {
            file,
            offset,
            later_groups: later.len(),
            seqs: (first, last),
        })
    })
}

/// The log on a file of the data directory. (The directory is already locked by redb's
/// file, so this one takes no lock of its own.)
#[derive(Debug)]
pub(super) struct FileLog(std::fs::File);

impl FileLog {
    pub(super) fn open(path: &std::path::Path) -> io::Result<Self> {
        std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(path)
            .map(Self)
    }
}

impl StorageBackend for FileLog {
    fn len(&self) -> io::Result<u64> {
        Ok(self.0.metadata()?.len())
    }
    fn read(&self, offset: u64, out: &mut [u8]) -> io::Result<()> {
        std::os::unix::fs::FileExt::read_exact_at(&self.0, out, offset)
    }
    fn set_len(&self, len: u64) -> io::Result<()> {
        self.0.set_len(len)
    }
    fn sync_data(&self) -> io::Result<()> {
        self.0.sync_data()
    }
    fn write(&self, offset: u64, data: &[u8]) -> io::Result<()> {
        std::os::unix::fs::FileExt::write_all_at(&self.0, data, offset)
    }
}

/// Reads a whole log file.
pub(super) fn read_image(file: &dyn StorageBackend) -> io::Result<Vec<u8>> {
    let len = usize::try_from(file.len()?)
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidData, "log file too large"))?;
    let mut buf = vec![0; len];
    if len > 0 {
        file.read(0, &mut buf)?;
    }
    Ok(buf)
}

/// A reply (or several) to run once the fate of a record is known.
pub(super) type Done = Box<dyn FnOnce(Option<&StoreError>) + Send>;

/// What the committer sends the log writer, in commit order.
pub(super) enum LogMsg {
    /// A group committed to redb (without a sync, or as a checkpoint whose sync runs behind):
    /// write and sync its record, then answer.
    Group { record: Vec<u8>, dones: Vec<Done> },
    /// The last group sent was a checkpoint: the records so far are written and synced in the
    /// current file, and the next one goes to offset 0 of the other file. The committer sends
    /// this only once the checkpoint before has completed its sync, so the other file's
    /// records are all in redb's durable state.
    Switch,
    /// Everything sent so far is durable in redb (the store was reopened and its sync
    /// awaited): the next record goes to offset 0 of the first file, and a failure is cleared.
    Restart,
    /// Read both files (after a failure, to reopen): the answer comes once every earlier
    /// message is handled, so nothing writes the files meanwhile.
    Read(std_mpsc::SyncSender<io::Result<Images>>),
}

/// The contents of the two log files.
pub(super) type Images = [Vec<u8>; 2];

/// The two log files, in the order the writer starts with.
pub(super) type LogFiles = [Box<dyn StorageBackend>; 2];

/// The log files' names in the data directory.
pub(super) const FILE_NAMES: [&str; 2] = ["router.log", "router.log2"];

/// Reads both log files.
pub(super) fn read_images(files: &LogFiles) -> io::Result<Images> {
    Ok([read_image(&*files[0])?, read_image(&*files[1])?])
}

/// The valid records of both files, in sequence order (see the module docs).
pub(super) fn records_of(images: &Images) -> Vec<Record<'_>> {
    let mut out: Vec<Record<'_>> = images.iter().flat_map(|i| records(i)).collect();
    out.sort_by_key(|r| r.seq);
    out
}

/// Called after a failed write or sync (see `LogWriter::start`, `SyncHandle::set_wake`), to
/// have the committer reopen the store.
pub(super) type Wake = Box<dyn Fn() + Send>;

/// The log writer's handle, kept by the committer.
pub(super) struct LogWriter {
    tx: std_mpsc::SyncSender<LogMsg>,
    failed: Arc<AtomicBool>,
}

impl LogWriter {
    /// Starts the writer thread on `files`, which must already have been replayed and the
    /// replay made durable (their records are all in redb): the first record goes to offset 0
    /// of the first file. `wake` is called after a write fails (the failure flag already
    /// set), to have the committer reopen the store.
    pub(super) fn start(files: LogFiles, wake: Wake) -> Result<Self, StoreError> {
        // A bounded queue: a committer running ahead of the disk waits here instead of piling
        // up unsynced groups in memory.
        let (tx, rx) = std_mpsc::sync_channel(64);
        let failed = Arc::new(AtomicBool::new(false));
        let w = Writer {
            files,
            active: 0,
            offset: 0,
            len: [None, None],
            failed: failed.clone(),
            wake,
        };
        std::thread::Builder::new()
            .name("store-log".into())
            .spawn(move || w.run(rx))
            .map_err(|e| StoreError::Backend(format!("spawn log writer: {e}")))?;
        Ok(Self { tx, failed })
    }

    /// Hands a message to the writer. If the writer is gone, a group's callers are told so.
    pub(super) fn send(&self, msg: LogMsg) {
        if let Err(std_mpsc::SendError(msg)) = self.tx.send(msg) {
            let e = StoreError::Backend("the group log writer stopped".into());
            if let LogMsg::Group { dones, .. } = msg {
                for d in dones {
                    d(Some(&e));
                }
            }
            self.failed.store(true, Ordering::SeqCst);
        }
    }

    /// Whether a write or sync failed since the last restart: the committer must reopen the
    /// store (the groups committed to redb after the failure were not made durable).
    pub(super) fn failed(&self) -> bool {
        self.failed.load(Ordering::SeqCst)
    }

    /// The flag `failed` reads, for readers that must not see groups that were not made
    /// durable.
    pub(super) fn failed_flag(&self) -> Arc<AtomicBool> {
        self.failed.clone()
    }

    /// Both files' contents, once every message sent before has been handled.
    pub(super) fn read(&self) -> Result<Images, StoreError> {
        let (tx, rx) = std_mpsc::sync_channel(1);
        self.send(LogMsg::Read(tx));
        rx.recv()
            .map_err(|_| StoreError::Backend("the group log writer stopped".into()))?
            .map_err(|e| StoreError::Backend(format!("read the group log: {e}")))
    }
}

struct Writer {
    files: LogFiles,
    /// The file being written.
    active: usize,
    offset: u64,
    /// Each file's length as last seen (`None`: ask the file).
    len: [Option<u64>; 2],
    failed: Arc<AtomicBool>,
    wake: Wake,
}

impl Writer {
    fn run(mut self, rx: std_mpsc::Receiver<LogMsg>) {
        let mut buf: Vec<u8> = Vec::new();
        let mut dones: Vec<Done> = Vec::new();
        while let Ok(first) = rx.recv() {
            // Everything queued meanwhile shares this write and sync.
            let mut next = Some(first);
            while let Some(msg) = next.take().or_else(|| rx.try_recv().ok()) {
                match msg {
                    LogMsg::Group { record, dones: ds } => {
                        buf.extend_from_slice(&record);
                        dones.extend(ds);
                    }
                    LogMsg::Switch => {
                        // Synced where they are first: a record in the other file must never
                        // be durable while one before it is not.
                        self.flush(&mut buf, &mut dones);
                        self.active ^= 1;
                        self.offset = 0;
                    }
                    LogMsg::Restart => {
                        self.flush(&mut buf, &mut dones);
                        self.active = 0;
                        self.offset = 0;
                        self.failed.store(false, Ordering::SeqCst);
                    }
                    LogMsg::Read(reply) => {
                        self.flush(&mut buf, &mut dones);
                        let _ = reply.send(read_images(&self.files));
                    }
                }
            }
            self.flush(&mut buf, &mut dones);
        }
        self.flush(&mut buf, &mut dones);
    }

    /// Writes and syncs `buf`, then answers `dones`; after a failure every group fails until
    /// the committer has reopened the store and restarted the log.
    fn flush(&mut self, buf: &mut Vec<u8>, dones: &mut Vec<Done>) {
        if buf.is_empty() && dones.is_empty() {
            return;
        }
        let result = if self.failed.load(Ordering::SeqCst) {
            Err(StoreError::Backend(
                "an earlier group log write failed; the store is being reopened".into(),
            ))
        } else {
            self.write(buf).map_err(|e| {
                tracing::error!(error = %e, "group log write failed; the groups waiting on it get the error and the store is reopened");
                self.failed.store(true, Ordering::SeqCst);
                (self.wake)();
                StoreError::Backend(format!("group log write: {e}"))
            })
        };
        buf.clear();
        for d in dones.drain(..) {
            d(result.as_ref().err());
        }
    }

    fn write(&mut self, buf: &[u8]) -> io::Result<()> {
        let file = &self.files[self.active];
        let end = self.offset + buf.len() as u64;
        let len = match self.len[self.active] {
            Some(l) => l,
            None => file.len()?,
        };
        self.len[self.active] = Some(len);
        if end > len {
            let grown = end.div_ceil(GROW) * GROW;
            file.set_len(grown)?;
            self.len[self.active] = Some(grown);
        }
        file.write(self.offset, buf)?;
        file.sync_data()?;
        self.offset = end;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn group(seq: u64, puts: &[(&[u8], &[u8])]) -> Vec<u8> {
        let mut m = Mutations::default();
        for (k, v) in puts {
            m.put(3, k, v);
        }
        m.del(4, b"gone");
        m.record(seq)
    }

    #[test]
    fn records_round_trip_in_order() {
        let mut image = group(7, &[(b"a", b"1"), (b"b", b"")]);
        image.extend(group(8, &[(b"c", b"33")]));
        let rs = records(&image);
        assert_eq!(rs.iter().map(|r| r.seq).collect::<Vec<_>>(), vec![7, 8]);
        assert_eq!(
            rs[0].mutations().expect("decode"),
            vec![
                Mutation::Put {
                    table: 3,
                    key: b"a",
                    value: b"1"
                },
                Mutation::Put {
                    table: 3,
                    key: b"b",
                    value: b""
                },
                Mutation::Del {
                    table: 4,
                    key: b"gone"
                },
            ]
        );
    }

    #[test]
    fn a_torn_tail_ends_the_log() {
        let mut image = group(1, &[(b"a", b"1")]);
        let second = group(2, &[(b"b", b"2222")]);
        image.extend_from_slice(&second[..second.len() - 2]);
        assert_eq!(records(&image).len(), 1);
        // A flipped byte inside a record fails its checksum.
        let mut image = group(1, &[(b"a", b"1")]);
        image.extend(group(2, &[(b"b", b"2222")]));
        let last = image.len() - 1;
        image[last] ^= 0xff;
        assert_eq!(records(&image).len(), 1);
    }

    #[test]
    fn an_earlier_laps_records_behind_the_newest_are_not_read() {
        // Lap 1 wrote 1, 2, 3; after a checkpoint lap 2 wrote 4 over the start of 1.
        let mut old = group(1, &[(b"a", b"1")]);
        old.extend(group(2, &[(b"b", b"2")]));
        old.extend(group(3, &[(b"c", b"3")]));
        let new = group(4, &[(b"a", b"1")]);
        assert_eq!(new.len(), group(1, &[(b"a", b"1")]).len());
        let mut image = old.clone();
        image[..new.len()].copy_from_slice(&new);
        let rs = records(&image);
        assert_eq!(rs.iter().map(|r| r.seq).collect::<Vec<_>>(), vec![4]);
    }

    /// Sends `msgs` and waits until the writer has answered every group in them.
    fn send_all(w: &LogWriter, msgs: Vec<LogMsg>) {
        let (tx, rx) = std_mpsc::channel();
        let mut waiting = 0;
        for m in msgs {
            let m = match m {
                LogMsg::Group { record, .. } => {
                    let tx = tx.clone();
                    waiting += 1;
                    let done: Done = Box::new(move |e| {
                        let _ = tx.send(e.is_none());
                    });
                    LogMsg::Group {
                        record,
                        dones: vec![done],
                    }
                }
                m => m,
            };
            w.send(m);
        }
        for _ in 0..waiting {
            assert!(rx.recv().expect("answered"), "the group's write failed");
        }
    }

    fn g(seq: u64) -> LogMsg {
        LogMsg::Group {
            record: group(seq, &[(b"k", b"v")]),
            dones: Vec::new(),
        }
    }

    fn seqs(images: &Images) -> Vec<u64> {
        records_of(images).iter().map(|r| r.seq).collect()
    }

    #[test]
    fn the_writer_takes_the_files_in_turn_at_each_switch() {
        let disks = crate::store::fault::LogDisks::new();
        let files: LogFiles = disks
            .backends()
            .map(|b| Box::new(b) as Box<dyn StorageBackend>);
        let w = LogWriter::start(files, Box::new(|| {})).expect("start");
        send_all(&w, vec![g(1), g(2), LogMsg::Switch, g(3)]);
        let images = disks.power_cut();
        assert_eq!(records(&images[0]).len(), 2, "1 and 2 in the first file");
        assert_eq!(records(&images[1]).len(), 1, "3 in the second");
        assert_eq!(seqs(&images), vec![1, 2, 3]);
        // Back to the first file, over its older records; the second keeps its own.
        send_all(&w, vec![LogMsg::Switch, g(4)]);
        assert_eq!(seqs(&disks.power_cut()), vec![3, 4]);
        // A restart goes to the first file whichever was in use.
        send_all(&w, vec![LogMsg::Switch, g(5), LogMsg::Restart, g(9)]);
        assert_eq!(seqs(&w.read().expect("read")), vec![5, 9]);
    }

    #[test]
    fn zeros_and_garbage_are_no_records() {
        assert!(records(&[0; 100]).is_empty());
        assert!(records(b"not a log at all, just bytes").is_empty());
        assert!(records(&[]).is_empty());
    }
}

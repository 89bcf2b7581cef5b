//! The store file's syncs run behind the committer, when the group log is what makes a group
//! durable (see `store::group_log`).
//!
//! Under the group log a checkpoint is a redb commit with `Durability::Immediate`: it writes
//! the pages that the unsynced commits since the last one left in redb's buffer, then syncs
//! the file. No caller waits for that sync (every group, the checkpoint's too, is answered once
//! its log record is synced); only the log's reuse of its older file does. Yet redb's commit
//! holds the committer until the sync returns, and the sync is the slow, erratic part (a
//! checkpoint pause of tens of milliseconds stalled every group behind it).
//!
//! `SyncBehind` wraps the store file's backend so that a sync asked for returns at once and
//! runs on a thread of its own. Order is kept: a write or a length change first waits until
//! every sync asked for before it has completed. So the file never holds a write from after a
//! sync without everything from before it, and a crash while a sync is still running is a
//! crash during that commit's sync, which redb survives by falling back to the previous
//! commit: the pages that commit still uses are only overwritten by later writes, which wait.
//! A failed sync is kept and returned by every later write and sync, so redb fails its next
//! commit and the committer reopens the store.
//!
//! The committer sees the syncs through a `SyncHandle`: how many were asked for, and waiting
//! until a given one has completed (the log may overwrite a file only once the checkpoint
//! that covers its records is durable).

use std::fmt;
use std::io;
use std::ops::Bound;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};

use redb::{BackendError, StorageBackend};

use super::group_log::Wake;

/// A sync that failed: kept, because the file's state since is unknown.
#[derive(Clone, Debug)]
struct Failure {
    kind: io::ErrorKind,
    message: String,
}

impl Failure {
    fn error(&self) -> io::Error {
        io::Error::new(
            self.kind,
            format!("an earlier sync of the store file failed: {}", self.message),
        )
    }
}

#[derive(Default)]
struct State {
    /// Syncs asked for since the backend was made.
    asked: u64,
    /// Syncs completed (the worker syncs once for every request made before it started).
    done: u64,
    failed: Option<Failure>,
    /// The backend is closing: the worker stops once every sync asked for is done.
    stop: bool,
}

struct Shared {
    inner: Box<dyn StorageBackend>,
    state: Mutex<State>,
    changed: Condvar,
    /// Called after a sync fails (the failure already kept), to have the committer reopen
    /// the store at once rather than at its next checkpoint.
    wake: WakeSlot,
}

/// The committer's wake-up, called by the sync worker after a failed sync (see
/// `SyncHandle::set_wake`).
type WakeSlot = Arc<Mutex<Option<Wake>>>;

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Waits until sync number `n` has completed; the kept failure if one did not.
    fn wait_done(&self, n: u64) -> io::Result<()> {
        let mut s = self.lock();
        while s.done < n && s.failed.is_none() {
            s = self.changed.wait(s).unwrap_or_else(|p| p.into_inner());
        }
        match &s.failed {
            Some(f) => Err(f.error()),
            None => Ok(()),
        }
    }

    /// Waits until every sync asked for has completed (the order a write must keep).
    fn wait_all(&self) -> io::Result<()> {
        let asked = self.lock().asked;
        self.wait_done(asked)
    }

    fn run(&self) {
        let mut s = self.lock();
        loop {
            while s.done == s.asked && !s.stop {
                s = self.changed.wait(s).unwrap_or_else(|p| p.into_inner());
            }
            if s.done == s.asked {
                return;
            }
            let upto = s.asked;
            drop(s);
            // One sync covers every request made before it started.
            let result = self.inner.sync_data();
            s = self.lock();
            s.done = upto;
            let newly_failed = match result {
                Err(e) if s.failed.is_none() => {
                    tracing::error!(error = %e, "syncing the store file failed; the store is reopened");
                    s.failed = Some(Failure {
                        kind: e.kind(),
                        message: e.to_string(),
                    });
                    true
                }
                _ => false,
            };
            self.changed.notify_all();
            if newly_failed {
                drop(s);
                if let Some(wake) = &*self.wake.lock().unwrap_or_else(|p| p.into_inner()) {
                    wake();
                }
                s = self.lock();
            }
        }
    }
}

/// The committer's view of the syncs of the store file's current backend (a reopen makes a
/// new backend, which takes the handle over).
#[derive(Clone, Default)]
pub(crate) struct SyncHandle {
    current: Arc<Mutex<Option<Arc<Shared>>>>,
    wake: WakeSlot,
}

impl SyncHandle {
    fn current(&self) -> Option<Arc<Shared>> {
        self.current
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// What to call after a sync fails, for this backend and those a reopen makes.
    pub(crate) fn set_wake(&self, wake: Wake) {
        *self.wake.lock().unwrap_or_else(|p| p.into_inner()) = Some(wake);
    }

    /// Whether a sync of the current backend failed: its state on disk is unknown until the
    /// store is reopened (the group log still holds every group since the last good one).
    pub(crate) fn failed(&self) -> bool {
        self.current().is_some_and(|s| s.lock().failed.is_some())
    }

    /// How many syncs have been asked for so far: a ticket for `wait`.
    pub(crate) fn asked(&self) -> u64 {
        self.current().map_or(0, |s| s.lock().asked)
    }

    /// Waits until sync number `ticket` (and every one before it) has completed.
    pub(crate) fn wait(&self, ticket: u64) -> io::Result<()> {
        match self.current() {
            Some(s) => s.wait_done(ticket),
            None => Ok(()),
        }
    }

    /// Waits until every sync asked for so far has completed.
    pub(crate) fn wait_all(&self) -> io::Result<()> {
        match self.current() {
            Some(s) => s.wait_all(),
            None => Ok(()),
        }
    }
}

/// A redb backend whose syncs run behind its caller (see the module docs).
pub(crate) struct SyncBehind {
    shared: Arc<Shared>,
    worker: Mutex<Option<std::thread::JoinHandle<()>>>,
}

impl SyncBehind {
    /// Wraps `inner`; `handle` now refers to this backend.
    pub(crate) fn new(inner: impl StorageBackend, handle: &SyncHandle) -> io::Result<Self> {
        let shared = Arc::new(Shared {
            inner: Box::new(inner),
            state: Mutex::new(State::default()),
            changed: Condvar::new(),
            wake: handle.wake.clone(),
        });
        let s = shared.clone();
        let worker = std::thread::Builder::new()
            .name("store-sync".into())
            .spawn(move || s.run())?;
        *handle.current.lock().unwrap_or_else(|p| p.into_inner()) = Some(shared.clone());
        Ok(Self {
            shared,
            worker: Mutex::new(Some(worker)),
        })
    }

    /// Waits for the syncs asked for, then stops the worker (once: `close` and `drop` both
    /// call it).
    fn stop(&self) -> io::Result<()> {
        let Some(worker) = self.worker.lock().unwrap_or_else(|p| p.into_inner()).take() else {
            return Ok(());
        };
        let result = self.shared.wait_all();
        self.shared.lock().stop = true;
        self.shared.changed.notify_all();
        let _ = worker.join();
        result
    }
}

impl fmt::Debug for SyncBehind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let s = self.shared.lock();
        f.debug_struct("SyncBehind")
            .field("inner", &self.shared.inner)
            .field("asked", &s.asked)
            .field("done", &s.done)
            .finish()
    }
}

impl Drop for SyncBehind {
    fn drop(&mut self) {
        let _ = self.stop();
    }
}

impl StorageBackend for SyncBehind {
    fn len(&self) -> io::Result<u64> {
        self.shared.inner.len()
    }

    fn read(&self, offset: u64, out: &mut [u8]) -> io::Result<()> {
        self.shared.inner.read(offset, out)
    }

    fn set_len(&self, len: u64) -> io::Result<()> {
        // Growing adds zeros past everything a commit refers to, so it need not wait (redb
        // grows the file inside unsynced commits: waiting there would hold the committer
        // after all). Shrinking may cut pages the last synced commit still uses.
        if len < self.shared.inner.len()? {
            self.shared.wait_all()?;
        } else if let Some(f) = &self.shared.lock().failed {
            return Err(f.error());
        }
        self.shared.inner.set_len(len)
    }

    fn sync_data(&self) -> io::Result<()> {
        let mut s = self.shared.lock();
        if let Some(f) = &s.failed {
            return Err(f.error());
        }
        s.asked += 1;
        drop(s);
        self.shared.changed.notify_all();
        Ok(())
    }

    fn write(&self, offset: u64, data: &[u8]) -> io::Result<()> {
        self.shared.wait_all()?;
        self.shared.inner.write(offset, data)
    }

    fn close(&self) -> io::Result<()> {
        let synced = self.stop();
        let closed = self.shared.inner.close();
        synced.and(closed)
    }

    fn try_lock_range(&self, start: Bound<u64>, end: Bound<u64>) -> Result<bool, BackendError> {
        self.shared.inner.try_lock_range(start, end)
    }

    fn try_lock_shared_range(
        &self,
        start: Bound<u64>,
        end: Bound<u64>,
    ) -> Result<bool, BackendError> {
        self.shared.inner.try_lock_shared_range(start, end)
    }

    fn lock_range(&self, start: Bound<u64>, end: Bound<u64>) -> Result<(), BackendError> {
        self.shared.inner.lock_range(start, end)
    }

    fn lock_shared_range(&self, start: Bound<u64>, end: Bound<u64>) -> Result<(), BackendError> {
        self.shared.inner.lock_shared_range(start, end)
    }

    fn unlock_range(&self, start: Bound<u64>, end: Bound<u64>) -> Result<(), BackendError> {
        self.shared.inner.unlock_range(start, end)
    }

    fn query_lock_range(&self, start: Bound<u64>, end: Bound<u64>) -> Result<bool, BackendError> {
        self.shared.inner.query_lock_range(start, end)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::fault::SimulatedDisk;

    #[test]
    fn a_sync_returns_at_once_and_a_later_write_waits_for_it() {
        let disk = SimulatedDisk::new();
        disk.hold_syncs(true);
        let handle = SyncHandle::default();
        let b = Arc::new(SyncBehind::new(disk.backend(), &handle).expect("backend"));
        b.set_len(8).expect("len");
        b.write(0, b"first!!!").expect("write");
        b.sync_data().expect("the sync is only asked for");
        assert_eq!(handle.asked(), 1);
        assert!(disk.power_cut().is_empty(), "nothing synced yet");

        // A write after the sync must not land before it completes.
        let b2 = b.clone();
        let writer = std::thread::spawn(move || b2.write(0, b"second!!"));
        std::thread::sleep(std::time::Duration::from_millis(50));
        assert!(!writer.is_finished(), "the write went ahead of the sync");
        let mut buf = [0u8; 8];
        b.read(0, &mut buf).expect("read");
        assert_eq!(&buf, b"first!!!");

        disk.hold_syncs(false);
        writer.join().expect("join").expect("write");
        handle.wait(1).expect("synced");
        assert_eq!(
            disk.power_cut(),
            b"first!!!",
            "the sync had the first write only"
        );
        b.read(0, &mut buf).expect("read");
        assert_eq!(&buf, b"second!!");
    }

    #[test]
    fn growing_the_file_does_not_wait_for_a_sync_and_shrinking_does() {
        let disk = SimulatedDisk::new();
        disk.hold_syncs(true);
        let handle = SyncHandle::default();
        let b = Arc::new(SyncBehind::new(disk.backend(), &handle).expect("backend"));
        b.set_len(8).expect("len");
        b.sync_data().expect("asked");
        b.set_len(16).expect("grown while the sync waits");
        let b2 = b.clone();
        let shrink = std::thread::spawn(move || b2.set_len(4));
        std::thread::sleep(std::time::Duration::from_millis(50));
        assert!(!shrink.is_finished(), "shrunk ahead of the sync");
        disk.hold_syncs(false);
        shrink.join().expect("join").expect("shrink");
        assert_eq!(b.len().expect("len"), 4);
    }

    #[test]
    fn a_failed_sync_fails_every_later_write_and_sync() {
        let disk = SimulatedDisk::new();
        let handle = SyncHandle::default();
        let (woken_tx, woken) = std::sync::mpsc::channel();
        handle.set_wake(Box::new(move || {
            let _ = woken_tx.send(());
        }));
        let b = SyncBehind::new(disk.backend(), &handle).expect("backend");
        b.set_len(4).expect("len");
        disk.set_failing(true);
        b.sync_data().expect("asked");
        assert!(handle.wait_all().is_err(), "the sync failed");
        assert!(handle.failed());
        woken
            .recv_timeout(std::time::Duration::from_secs(10))
            .expect("the committer is woken");
        disk.set_failing(false);
        assert!(b.write(0, b"late").is_err(), "a write after a failed sync");
        assert!(b.sync_data().is_err());
        assert!(b.close().is_err());
    }

    #[test]
    fn closing_waits_for_the_syncs_asked_for() {
        let disk = SimulatedDisk::new();
        disk.hold_syncs(true);
        let handle = SyncHandle::default();
        let b = SyncBehind::new(disk.backend(), &handle).expect("backend");
        b.set_len(4).expect("len");
        b.write(0, b"data").expect("write");
        b.sync_data().expect("asked");
        let closer = std::thread::spawn(move || b.close());
        std::thread::sleep(std::time::Duration::from_millis(50));
        assert!(!closer.is_finished(), "closed before its sync completed");
        disk.hold_syncs(false);
        closer.join().expect("join").expect("close");
        assert_eq!(disk.power_cut(), b"data");
    }

    #[test]
    fn a_reopen_hands_the_handle_to_the_new_backend() {
        let handle = SyncHandle::default();
        let first = SyncBehind::new(SimulatedDisk::new().backend(), &handle).expect("first");
        first.sync_data().expect("asked");
        handle.wait_all().expect("synced");
        assert_eq!(handle.asked(), 1);
        drop(first);
        let second = SyncBehind::new(SimulatedDisk::new().backend(), &handle).expect("second");
        assert_eq!(handle.asked(), 0, "counts are the new backend's");
        drop(second);
    }
}

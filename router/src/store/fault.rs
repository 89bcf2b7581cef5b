//! A redb storage backend that simulates a power cut, for durability tests that kill -9
//! cannot fake (after kill -9 the page cache still holds every write).
//!
//! Writes land in a volatile image; `sync_data` (the fsync redb issues on a durable commit)
//! copies it to the durable image. `SimulatedDisk::power_cut` returns only the durable image,
//! so a store reopened on it sees exactly what had been flushed, and nothing written after the
//! last completed flush. It can also be told to fail writes, to test a full or broken disk.

use std::io;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};

use redb::StorageBackend;

#[derive(Debug, Default)]
struct Images {
    volatile: Vec<u8>,
    durable: Vec<u8>,
}

/// A simulated disk shared between a backend and the test that owns it.
#[derive(Debug, Clone, Default)]
pub struct SimulatedDisk {
    images: Arc<Mutex<Images>>,
    fail_writes: Arc<AtomicBool>,
    syncs: Arc<AtomicU64>,
    /// While true, syncs wait (a slow disk, to see who waits for them).
    held: Arc<(Mutex<bool>, Condvar)>,
}

impl SimulatedDisk {
    /// An empty disk.
    pub fn new() -> Self {
        Self::default()
    }

    /// A disk whose contents are `durable` (e.g. what survived an earlier power cut).
    pub fn from_image(durable: Vec<u8>) -> Self {
        let d = Self::default();
        {
            let mut g = d.lock();
            g.volatile = durable.clone();
            g.durable = durable;
        }
        d
    }

    /// A backend for redb that writes to this disk.
    pub fn backend(&self) -> FaultBackend {
        FaultBackend { disk: self.clone() }
    }

    /// What a power cut leaves: the image as of the last completed `sync_data`.
    pub fn power_cut(&self) -> Vec<u8> {
        self.lock().durable.clone()
    }

    /// Makes every later write and sync fail (a full or broken disk), or heals it.
    pub fn set_failing(&self, failing: bool) {
        self.fail_writes.store(failing, Ordering::SeqCst);
    }

    /// Makes every later sync wait until released (`false`), as a disk slow to sync would.
    pub fn hold_syncs(&self, hold: bool) {
        let (m, c) = &*self.held;
        *m.lock().unwrap_or_else(|p| p.into_inner()) = hold;
        c.notify_all();
    }

    fn wait_unheld(&self) {
        let (m, c) = &*self.held;
        let mut held = m.lock().unwrap_or_else(|p| p.into_inner());
        while *held {
            held = c.wait(held).unwrap_or_else(|p| p.into_inner());
        }
    }

    /// Number of completed syncs.
    pub fn syncs(&self) -> u64 {
        self.syncs.load(Ordering::SeqCst)
    }

    fn lock(&self) -> MutexGuard<'_, Images> {
        self.images.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn check(&self) -> io::Result<()> {
        if self.fail_writes.load(Ordering::SeqCst) {
            Err(io::Error::new(
                io::ErrorKind::StorageFull,
                "simulated disk failure",
            ))
        } else {
            Ok(())
        }
    }
}

/// The redb backend over a `SimulatedDisk`.
#[derive(Debug)]
pub struct FaultBackend {
    disk: SimulatedDisk,
}

fn out_of_range() -> io::Error {
    io::Error::new(io::ErrorKind::InvalidInput, "offset out of range")
}

impl StorageBackend for FaultBackend {
    fn len(&self) -> io::Result<u64> {
        Ok(self.disk.lock().volatile.len() as u64)
    }

    fn read(&self, offset: u64, out: &mut [u8]) -> io::Result<()> {
        let g = self.disk.lock();
        let start = usize::try_from(offset).map_err(|_| out_of_range())?;
        let src = g
            .volatile
            .get(start..start + out.len())
            .ok_or_else(out_of_range)?;
        out.copy_from_slice(src);
        Ok(())
    }

    fn set_len(&self, len: u64) -> io::Result<()> {
        self.disk.check()?;
        let len = usize::try_from(len).map_err(|_| out_of_range())?;
        self.disk.lock().volatile.resize(len, 0);
        Ok(())
    }

    fn sync_data(&self) -> io::Result<()> {
        self.disk.wait_unheld();
        self.disk.check()?;
        let mut g = self.disk.lock();
        let Images { volatile, durable } = &mut *g;
        durable.clone_from(volatile);
        self.disk.syncs.fetch_add(1, Ordering::SeqCst);
        Ok(())
    }

    fn write(&self, offset: u64, data: &[u8]) -> io::Result<()> {
        self.disk.check()?;
        let mut g = self.disk.lock();
        let start = usize::try_from(offset).map_err(|_| out_of_range())?;
        let dst = g
            .volatile
            .get_mut(start..start + data.len())
            .ok_or_else(out_of_range)?;
        dst.copy_from_slice(data);
        Ok(())
    }
}

/// The group log's two files, each on a simulated disk of its own.
#[derive(Debug, Clone, Default)]
pub struct LogDisks(pub [SimulatedDisk; 2]);

impl LogDisks {
    /// Two empty disks.
    pub fn new() -> Self {
        Self::default()
    }

    /// Disks whose contents are `images` (what an earlier power cut left).
    pub fn from_images(images: [Vec<u8>; 2]) -> Self {
        Self(images.map(SimulatedDisk::from_image))
    }

    /// A backend on each disk, for `RedbStore::with_backends`.
    pub fn backends(&self) -> [FaultBackend; 2] {
        [self.0[0].backend(), self.0[1].backend()]
    }

    /// What a power cut leaves of each, the first file's first.
    pub fn power_cut(&self) -> [Vec<u8>; 2] {
        [self.0[0].power_cut(), self.0[1].power_cut()]
    }

    /// Makes every later write and sync of both fail, or heals them.
    pub fn set_failing(&self, failing: bool) {
        for d in &self.0 {
            d.set_failing(failing);
        }
    }
}

//! An in-process exchange of the ranks' blobs (a unique id, each rank's GPU) before they join
//! a world of another engine as threads of one process.

use std::sync::{Condvar, Mutex};
use std::time::Duration;

/// What a rank gave the exchange: its blob, or why it could not join.
type Given = Option<Result<Vec<u8>, String>>;

/// The blobs of rank threads of one process, handed to every rank once all have given theirs
/// (the `exchange` that NCCL's `NcclWorld::group` takes, where ranks are threads); a rank that
/// fails before giving its blob ends every wait at once, naming itself.
pub struct BlobExchange {
    blobs: Mutex<Vec<Given>>,
    changed: Condvar,
}

impl BlobExchange {
    /// An exchange for ranks `0..size`.
    pub fn new(size: usize) -> Self {
        BlobExchange {
            blobs: Mutex::new(vec![None; size]),
            changed: Condvar::new(),
        }
    }

    /// Gives rank `rank`'s blob (or its failure) and, for a blob, waits at most `timeout` for
    /// every other rank's.
    pub fn all_gather(
        &self,
        rank: usize,
        blob: Result<&[u8], String>,
        timeout: Duration,
    ) -> Result<Vec<Vec<u8>>, String> {
        let mut blobs = self.blobs.lock().unwrap_or_else(|p| p.into_inner());
        let failed = blob.is_err();
        blobs[rank] = Some(blob.map(<[u8]>::to_vec));
        self.changed.notify_all();
        if failed {
            return Err("this rank could not join".into());
        }
        let waiting = |b: &mut Vec<Given>| {
            b.iter().any(Option::is_none) && !b.iter().flatten().any(Result::is_err)
        };
        let (blobs, waited) = self
            .changed
            .wait_timeout_while(blobs, timeout, waiting)
            .unwrap_or_else(|p| p.into_inner());
        if let Some((r, Some(Err(why)))) = blobs
            .iter()
            .enumerate()
            .find(|(_, b)| matches!(b, Some(Err(_))))
        {
            return Err(format!("rank {r} could not join the world: {why}"));
        }
        if waited.timed_out() {
            let missing: Vec<usize> = (0..blobs.len()).filter(|&r| blobs[r].is_none()).collect();
            return Err(format!(
                "ranks {missing:?} did not join the world within {timeout:?}"
            ));
        }
        Ok(blobs.iter().flatten().flatten().cloned().collect())
    }
}

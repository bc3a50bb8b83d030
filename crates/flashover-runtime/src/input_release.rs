//! Large host buffers that a collective has consumed (a staged input), freed on a background
//! thread.
//!
//! glibc serves every allocation of 32 MiB or more with a mapping of its own and unmaps it
//! when it is freed; smaller blocks it learns to keep in its heap and reuses. Unmapping a
//! 64 MiB input (page tables, TLB shoot-downs to the other ranks' threads) cost the calling
//! rank about as long as the collective itself (docs/benchmarks.md, "bench comm"). Nothing
//! waits for that memory, so one thread per process frees such buffers instead, as a caching
//! allocator's background purge does. Smaller buffers are freed by the caller: handed to
//! another thread, they missed glibc's reuse and 16 MiB collectives ran half as fast. At most
//! [`IN_FLIGHT`] buffers wait: past that the caller frees its own, so the memory held for
//! release stays bounded.

use std::sync::OnceLock;
use std::sync::mpsc::{SyncSender, sync_channel};

/// Buffers smaller than this are freed by the caller, whose allocator keeps them for reuse
/// (glibc's largest mmap threshold).
const RELEASED_FROM: usize = 32 << 20;

/// The most buffers waiting to be freed at once.
const IN_FLIGHT: usize = 4;

/// Something holding a buffer, to be dropped.
type Held = Box<dyn Send>;

/// The release thread's queue; `None` where the thread could not be started.
static RELEASER: OnceLock<Option<SyncSender<Held>>> = OnceLock::new();

fn releaser() -> Option<&'static SyncSender<Held>> {
    RELEASER
        .get_or_init(|| {
            let (send, receive) = sync_channel::<Held>(IN_FLIGHT);
            std::thread::Builder::new()
                .name("flashover-release".into())
                .spawn(move || receive.into_iter().for_each(drop))
                .ok()
                .map(|_| send)
        })
        .as_ref()
}

/// Drops `held`, which frees a buffer of `bytes` nothing reads any more: on the release
/// thread when the buffer is large and the queue has room, else here.
pub(crate) fn release(held: impl Send + 'static, bytes: usize) {
    if bytes < RELEASED_FROM {
        return;
    }
    if let Some(releaser) = releaser() {
        // A full queue hands the buffer back inside the error, which frees it here.
        let _ = releaser.try_send(Box::new(held));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::tensor::{AllocationProperty, Bytes};
    use burn_std::{AccessError, AccessPolicy, AllocationController};
    use std::mem::MaybeUninit;
    use std::sync::mpsc::{Sender, channel};
    use std::thread::ThreadId;

    /// A buffer of `len` bytes that reports the thread it is freed on.
    struct Reporting {
        memory: Vec<MaybeUninit<u8>>,
        freed_on: Sender<ThreadId>,
    }

    impl Drop for Reporting {
        fn drop(&mut self) {
            let _ = self.freed_on.send(std::thread::current().id());
        }
    }

    impl AllocationController for Reporting {
        fn alloc_align(&self) -> usize {
            1
        }

        fn property(&self) -> AllocationProperty {
            AllocationProperty::Other
        }

        fn memory(&self, _: AccessPolicy) -> Result<&[MaybeUninit<u8>], AccessError> {
            Ok(&self.memory)
        }

        unsafe fn memory_mut(
            &mut self,
            _: AccessPolicy,
        ) -> Result<&mut [MaybeUninit<u8>], AccessError> {
            Ok(&mut self.memory)
        }
    }

    fn reporting(len: usize, freed_on: &Sender<ThreadId>) -> Bytes {
        let controller = Reporting {
            memory: vec![MaybeUninit::new(0); len],
            freed_on: freed_on.clone(),
        };
        // SAFETY: all `len` bytes are initialized.
        unsafe { Bytes::from_controller(Box::new(controller), len) }
    }

    #[test]
    fn a_large_consumed_buffer_is_freed_off_the_callers_thread_and_a_small_one_on_it() {
        let (freed_on, freed) = channel();
        let here = std::thread::current().id();
        release(reporting(RELEASED_FROM - 1, &freed_on), RELEASED_FROM - 1);
        assert_eq!(
            freed.recv().unwrap(),
            here,
            "a small buffer is freed by the caller"
        );
        release(reporting(RELEASED_FROM, &freed_on), RELEASED_FROM);
        let there = freed
            .recv_timeout(std::time::Duration::from_secs(10))
            .expect("the release thread frees the buffer");
        assert_ne!(there, here, "a large buffer is freed on the release thread");
    }
}

//! What a rank thread's panic prints. Rust's default hook prints every panicking thread's
//! message and, with `RUST_BACKTRACE` set, its backtrace: with ranks as threads, one failure
//! printed a backtrace for every rank before the launcher's one-line reason. Here the first
//! rank of a launch to panic prints Rust's report (with its backtrace, when asked for); the
//! ranks after it print one line each. Threads that are not ranks keep the default hook.

use std::cell::RefCell;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Once};

thread_local! {
    /// On a rank thread: its rank, and whether a rank of its launch has reported a panic.
    static RANK: RefCell<Option<(usize, Arc<AtomicBool>)>> = const { RefCell::new(None) };
}

/// Marks the calling thread as `rank` of the launch whose ranks share `reported` (installing
/// the hook, once per process).
pub(crate) fn mark_rank_thread(rank: usize, reported: Arc<AtomicBool>) {
    static INSTALL: Once = Once::new();
    INSTALL.call_once(|| {
        let default = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            let rank = RANK.with(|r| r.borrow().clone());
            match rank {
                Some((rank, reported)) if reported.swap(true, Ordering::SeqCst) => {
                    let at = info
                        .location()
                        .map(|l| format!(" at {l}"))
                        .unwrap_or_default();
                    let message = flashover_comm::panic_message(info.payload());
                    eprintln!("rank {rank} panicked{at}: {message}");
                }
                _ => default(info),
            }
        }));
    });
    RANK.with(|r| *r.borrow_mut() = Some((rank, reported)));
}

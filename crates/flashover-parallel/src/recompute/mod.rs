//! The recompute scope: whether this thread runs inside a checkpointed forward (its first run,
//! or its rerun in backward), and what the mechanisms that act inside one leave with it.
//!
//! Activation checkpointing opens a frame around each run of a checkpointed forward
//! ([`recomputing`]). Mechanisms that behave differently there read the scope instead of
//! owning one of their own: fully sharded units gather from the frame's stored parameter
//! values and register what to forget when the frame ends ([`on_leave`]); hot-expert copies
//! claim the gradients a recomputation's backward gives them ([`claim_gradients`]); a rerun
//! counts nothing twice ([`replaying`]).
//!
//! The frame's forward is recomputed by a custom autodiff op whose backward reruns it on the
//! device ([`checkpoint`]; module `op`).

mod checkpoint;
mod op;

pub use checkpoint::checkpoint;
pub(crate) use checkpoint::{Replays, checkpoint_part};

use burn::module::ParamId;
use burn::tensor::{Gradients, Tensor};
use std::cell::{Cell, RefCell};
use std::collections::HashMap;

/// What a frame's end runs, given the frame's depth (1 for the outermost).
pub(crate) type OnLeave = Box<dyn FnOnce(usize)>;

/// What takes its part of a recomputation's gradients out of them.
pub(crate) type GradientClaim = Box<dyn FnOnce(&mut Gradients)>;

/// One checkpointed forward this thread is inside.
struct Frame {
    /// The recomputed module's parameters, by id: their stored values, flattened.
    stored: HashMap<ParamId, Tensor<1>>,
    /// Registered by mechanisms acting inside the frame, run in order when it ends.
    on_leave: Vec<OnLeave>,
}

thread_local! {
    /// How many checkpointed forwards this thread is inside, and of those, how many are
    /// reruns in backward.
    static DEPTH: Cell<(usize, usize)> = const { Cell::new((0, 0)) };
    /// Per checkpointed forward this thread is inside, innermost last.
    static FRAMES: RefCell<Vec<Frame>> = const { RefCell::new(Vec::new()) };
    /// Claims on the gradients of the next recomputation's backward on this thread.
    static CLAIMS: RefCell<Vec<GradientClaim>> = const { RefCell::new(Vec::new()) };
}

/// How many checkpointed forwards this thread is inside (0: none).
pub(crate) fn depth() -> usize {
    DEPTH.with(|d| d.get().0)
}

/// Whether this thread reruns a checkpointed forward in backward (see [`recomputing`]).
pub(crate) fn replaying() -> bool {
    DEPTH.with(|d| d.get().1 > 0)
}

/// Runs `f`, a checkpointed forward (`replay`: its rerun in backward) of a module whose
/// parameters' stored values `stored` holds by id (flattened), in a frame of its own. What
/// mechanisms register inside it with [`on_leave`] runs when `f` returns or panics.
pub(crate) fn recomputing<T>(
    stored: HashMap<ParamId, Tensor<1>>,
    replay: bool,
    f: impl FnOnce() -> T,
) -> T {
    let step = (1, replay as usize);
    struct Leave((usize, usize));
    impl Drop for Leave {
        fn drop(&mut self) {
            let depth = depth();
            if let Some(frame) = FRAMES.with(|f| f.borrow_mut().pop()) {
                for leave in frame.on_leave {
                    leave(depth);
                }
            }
            DEPTH.with(|d| d.set((d.get().0 - self.0.0, d.get().1 - self.0.1)));
        }
    }
    DEPTH.with(|d| d.set((d.get().0 + step.0, d.get().1 + step.1)));
    FRAMES.with(|f| {
        f.borrow_mut().push(Frame {
            stored,
            on_leave: vec![],
        })
    });
    let _leave = Leave(step);
    f()
}

/// `read` of the innermost frame's stored parameter values; `None` outside any frame.
pub(crate) fn with_stored<T>(read: impl FnOnce(&HashMap<ParamId, Tensor<1>>) -> T) -> Option<T> {
    FRAMES.with(|frames| frames.borrow().last().map(|frame| read(&frame.stored)))
}

/// Registers `leave` to run when the innermost frame ends. Outside any frame it is handed
/// back, for the caller to run now or never.
pub(crate) fn on_leave(leave: OnLeave) -> Result<(), OnLeave> {
    FRAMES.with(|frames| match frames.borrow_mut().last_mut() {
        Some(frame) => {
            frame.on_leave.push(leave);
            Ok(())
        }
        None => Err(leave),
    })
}

/// Claims part of the gradients of the next recomputation's backward on this thread: what a
/// rerun made that is not the recomputed module's parameters (hot-expert copies).
pub(crate) fn claim_gradients(claim: GradientClaim) {
    CLAIMS.with(|c| c.borrow_mut().push(claim));
}

/// Runs the claims on a recomputation's gradients, each taking its part out.
pub(crate) fn settle_claims(grads: &mut Gradients) {
    for claim in CLAIMS.take() {
        claim(grads);
    }
}

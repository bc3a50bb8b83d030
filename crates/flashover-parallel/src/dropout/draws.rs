//! A rank's dropout draws: what a Burn forward does not carry and counter-based masks need.
//!
//! The seed, the step and the global indices of the samples a forward computes live in the
//! rank's thread (a rank is a thread, one per process under MPI), set by the plan's
//! `batch_share` and `pipeline()?.step` or by one call on one device; sites are numbered in call
//! order within a scope (before the layer stack, layer `i`, after it), which the stacks and the
//! pipeline enter. `crate::nn`'s dropout reads them ([`next_site`]).

use flashover_comm::Group;
use std::cell::RefCell;
use std::ops::Range;

/// What one rank's masks are drawn from: the run's seed, the step, and the global indices of
/// the samples of the batch the forward computes; and the ranks that compute the batch's other
/// samples, for layers whose statistics span the batch ([`crate::nn::BatchNorm`]).
#[derive(Debug, Clone)]
pub(crate) struct Draws {
    pub(crate) seed: u64,
    pub(crate) step: u64,
    pub(crate) samples: Range<usize>,
    /// The data-parallel ranks whose samples make up the batch with this rank's (absent on one
    /// device), and whether the forward computes one micro-batch of a pipeline's.
    pub(crate) batch: Option<(Group, bool)>,
    /// Why the layers cannot draw one-device masks under this layout, if they cannot.
    pub(crate) refusal: Option<&'static str>,
    /// Why a sequence's positions outside a splitting stack are not known, if they are not
    /// (sequence parallelism from a vocabulary-parallel embedding on).
    pub(crate) outside_split: Option<&'static str>,
}

impl Draws {
    /// Draws for `samples` of step `step` of a run seeded `seed`, with everything placed.
    pub(crate) fn new(seed: u64, step: usize, samples: Range<usize>) -> Self {
        Draws {
            seed,
            step: step as u64,
            samples,
            batch: None,
            refusal: None,
            outside_split: None,
        }
    }

    /// These draws on a rank whose batch's other samples the ranks of `data` compute.
    pub(crate) fn with_data_ranks(self, data: Group) -> Self {
        Draws {
            batch: Some((data, false)),
            ..self
        }
    }

    /// These draws under a layout that cannot draw one-device masks, for reason `why` (a
    /// dropout in training then refuses).
    pub(crate) fn refused(self, why: Option<&'static str>) -> Self {
        Draws {
            refusal: why,
            ..self
        }
    }

    /// These draws under a layout whose activations are split by sequence outside splitting
    /// stacks, where the positions are not known (dropout there refuses, saying `why`).
    pub(crate) fn split_outside_stacks(self, why: Option<&'static str>) -> Self {
        Draws {
            outside_split: why,
            ..self
        }
    }

    /// The same draws for `samples` of step `step`.
    pub(crate) fn at(&self, step: usize, samples: Range<usize>) -> Self {
        Draws {
            step: step as u64,
            samples,
            ..self.clone()
        }
    }

    /// The same draws for `samples` (a pipeline's micro-batch of the step).
    pub(crate) fn for_samples(&self, samples: Range<usize>) -> Self {
        // Part of the share: one micro-batch of several.
        let part = samples != self.samples;
        let batch = self.batch.clone().map(|(data, _)| (data, part));
        Draws {
            samples,
            batch,
            ..self.clone()
        }
    }
}

/// Where in a forward a mask is drawn: sites are numbered within one of these.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) enum Scope {
    /// Before the layer stack (embeddings).
    Before,
    /// Layer `i` of the stack.
    Layer(usize),
    /// After the layer stack (the head).
    After,
}

/// A rank's draws and where its forward is.
#[derive(Debug, Clone)]
struct State {
    draws: Draws,
    scope: Scope,
    /// What kind of layer the scope is ([`mark_layer_kind`]): an encoder's layer `i` and a
    /// decoder's layer `i` draw different masks.
    kind: u64,
    /// Sites drawn in the scope so far.
    drawn: u64,
}

thread_local! {
    /// This rank's draws: a rank is a thread (one per process under MPI), and its forward
    /// runs on it.
    static STATE: RefCell<Option<State>> = const { RefCell::new(None) };
}

/// Sets this thread's draws, its forward before the layer stack.
pub(crate) fn set_draws(draws: Option<Draws>) {
    STATE.with(|s| *s.borrow_mut() = draws.map(fresh(Scope::Before)));
}

fn fresh(scope: Scope) -> impl FnOnce(Draws) -> State {
    move |draws| State {
        draws,
        scope,
        kind: 0,
        drawn: 0,
    }
}

/// The data-parallel ranks whose samples make up this rank's batch, and whether the forward
/// computes a pipeline's micro-batch, when a plan set this thread's draws.
pub(crate) fn batch_ranks() -> Option<(Group, bool)> {
    STATE.with(|s| s.borrow().as_ref().and_then(|s| s.draws.batch.clone()))
}

/// This thread's draws, if set.
pub(crate) fn current_draws() -> Option<Draws> {
    STATE.with(|s| s.borrow().as_ref().map(|s| s.draws.clone()))
}

/// `f()` with `draws` (none: the device's generator) at the start of `scope`, then the
/// state before: a pipeline stage's part of a micro-batch's forward, whichever rank runs it,
/// and its recomputation in backward.
pub(crate) fn in_scope<R>(draws: Option<&Draws>, scope: Scope, f: impl FnOnce() -> R) -> R {
    let state = draws.cloned().map(fresh(scope));
    let before = STATE.with(|s| std::mem::replace(&mut *s.borrow_mut(), state));
    let out = f();
    STATE.with(|s| *s.borrow_mut() = before);
    out
}

/// `f()` as layer `index` of the stack, with the draws already set: the encoder's and
/// decoder's forward around each layer. Afterwards the forward is after the stack.
pub(crate) fn in_layer<R>(index: usize, f: impl FnOnce() -> R) -> R {
    let after = STATE.with(|s| {
        let mut s = s.borrow_mut();
        let state = s.as_mut()?;
        let after = match state.scope {
            Scope::After => state.drawn,
            _ => 0,
        };
        (state.scope, state.kind, state.drawn) = (Scope::Layer(index), 0, 0);
        Some(after)
    });
    let out = f();
    STATE.with(|s| {
        if let (Some(state), Some(drawn)) = (s.borrow_mut().as_mut(), after) {
            (state.scope, state.kind, state.drawn) = (Scope::After, 0, drawn);
        }
    });
    out
}

/// Marks the current layer scope as a layer of kind `kind` (its sites draw apart from those
/// of another kind of layer at the same index).
pub(crate) fn mark_layer_kind(kind: u64) {
    STATE.with(|s| {
        if let Some(state) = s.borrow_mut().as_mut() {
            state.kind = kind;
        }
    });
}

/// Layer kinds for [`mark_layer_kind`].
pub(crate) const ENCODER_LAYER: u64 = 1;
/// See [`ENCODER_LAYER`].
pub(crate) const DECODER_LAYER: u64 = 2;

/// The site number of the next mask drawn in `state`'s scope: the scope, its layer kind and
/// how many it drew before, packed apart.
fn site_number(state: &State) -> u64 {
    let scope = match state.scope {
        Scope::Before => 0,
        Scope::Layer(i) => 1 + i as u64,
        Scope::After => u32::MAX as u64,
    };
    (scope << 24) | (state.kind << 16) | state.drawn
}

/// The draws and the site number of the next mask this thread draws (counting it), when draws
/// are set.
pub(crate) fn next_site() -> Option<(Draws, u64)> {
    STATE.with(|s| {
        let mut s = s.borrow_mut();
        let state = s.as_mut()?;
        let site = site_number(state);
        state.drawn += 1;
        Some((state.draws.clone(), site))
    })
}

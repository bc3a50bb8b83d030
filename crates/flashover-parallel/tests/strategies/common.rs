//! What the strategy tests share: a tiny two-layer model with deterministic weights, the
//! check that a failed run names the rank that caused it, and a plain loop's step and check
//! under a plan ([`crate::plan_loops`]).

use crate::plan_loops::{GLOBAL_BATCH, MAX_NORM, Run, Step, differences};
use burn::module::{Module, Param};
use burn::nn::Linear;
use burn::tensor::{Device, Tensor, TensorData};
use flashover_parallel::parallelize::Parallelized;
use flashover_runtime::RankContext;
use flashover_runtime::transfers::{self, Cause};

/// `b(tanh(a(x)))`: 6 -> 16 -> 2, 128 weights, no biases.
#[derive(Module, Debug)]
pub struct Net {
    pub a: Linear,
    pub b: Linear,
}

fn linear(d_in: usize, d_out: usize, salt: f32, device: &Device) -> Linear {
    let w: Vec<f32> = (0..d_in * d_out)
        .map(|i| ((i as f32 * 0.37 + salt).sin()) * 0.3)
        .collect();
    Linear {
        weight: Param::from_data(TensorData::new(w, [d_in, d_out]), device),
        bias: None,
    }
}

impl Net {
    /// The same weights on every call.
    pub fn new(device: &Device) -> Self {
        Net {
            a: linear(6, 16, 0.1, device),
            b: linear(16, 2, 0.7, device),
        }
    }

    /// Forward pass.
    pub fn forward(&self, x: Tensor<2>) -> Tensor<2> {
        self.b.forward(self.a.forward(x).tanh())
    }
}

/// `err` names rank `rank` as the cause, its message holds every one of `fragments`, all
/// `world` ranks failed, and rank 0 (a peer left waiting) says rank `rank` left its group.
pub fn assert_caused_by(
    err: &flashover_runtime::LaunchError,
    rank: usize,
    fragments: &[&str],
    world: usize,
) {
    match err {
        flashover_runtime::LaunchError::Rank { cause, all } => {
            assert_eq!(cause.rank, rank, "{err}");
            for fragment in fragments {
                assert!(cause.message.contains(fragment), "{fragment}: {err}");
            }
            assert_eq!(all.len(), world, "{err}");
            let peer = err.failure_of(0).unwrap();
            assert!(
                peer.message
                    .contains(&format!("rank {rank} left the group")),
                "{err}"
            );
        }
        other => panic!("{other}"),
    }
}

pub(crate) use crate::plan_loops::max_scaled;

/// Asserts that `run` (losses, final weights) matches `reference` within 1e-5 ([`max_scaled`]),
/// printing both differences for `what` (shown with `--nocapture`).
pub fn assert_matches(what: &str, run: &(Vec<f32>, Vec<f32>), reference: &(Vec<f32>, Vec<f32>)) {
    let losses = max_scaled(&run.0, &reference.0);
    let weights = max_scaled(&run.1, &reference.1);
    println!("{what}: losses {losses:.1e}, weights {weights:.1e}");
    assert!(
        losses < 1e-5 && weights < 1e-5,
        "{what}: losses {losses:e}, weights {weights:e}"
    );
}

/// One step of a plain loop under a plan: `loss(model, samples)` of this rank's share of step
/// `step`, its whole-batch mean, and the gradients reduced and clipped to [`MAX_NORM`]. The
/// loss and the norm stay on the device until one read ([`Parallelized::step_scalars`]); from
/// the backward on, nothing else reads the host but the set-up checks of the first step and
/// the engine's staging (asserted).
pub(crate) fn plain_step<M: Module>(
    model: &M,
    par: &Parallelized,
    step: usize,
    ctx: &RankContext,
    loss: impl FnOnce(&M, std::ops::Range<usize>) -> Tensor<1>,
) -> Step {
    let loss = loss(model, par.data().batch_share(GLOBAL_BATCH, step)?);
    let before = transfers::thread_reads();
    let (grads, norm) = par.gradients(model, loss.backward(), Some(MAX_NORM), ctx)?;
    let values = par.step_scalars(&loss, &norm)?.read();
    let after = transfers::thread_reads();
    let reads: Vec<(Cause, u64)> = (Cause::ALL.into_iter())
        .zip(after.iter().zip(before).map(|(a, b)| a - b))
        .filter(|(cause, n)| *n > 0 && !matches!(cause, Cause::Collective | Cause::SetUp))
        .collect();
    let total: u64 = reads.iter().map(|(_, n)| n).sum();
    assert_eq!(
        total, 1,
        "host reads in a step's reduction and report: {reads:?}"
    );
    Ok((grads, values.loss, values.norm))
}

/// [`assert_matches`] for a [`Run`] of [`crate::plan_loops`]: losses, gradient norms and
/// weights (see [`differences`]) within 1e-5.
pub(crate) fn assert_run_matches(layout: &str, run: &Run, reference: &Run) {
    let (loss, norm, weights) = differences(run, reference);
    assert!(
        loss < 1e-5 && norm < 1e-5 && weights < 1e-5,
        "{layout}: losses {loss:e}, norms {norm:e}, weights {weights:e}"
    );
}

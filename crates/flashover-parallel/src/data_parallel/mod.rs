//! Data parallel gradient reduction: a plan's gradients summed over the ranks that read
//! different samples, in buckets, on a communication thread per set of reduction axes.
//!
//! **What is replicated:** under data parallelism alone (`parallelize` with a plan that splits
//! nothing), parameters, gradients and optimizer state, on every `dp` rank. **What is split:**
//! the batch ([`crate::parallelize::DataSplit::batch_share`]). **Communication per step:**
//! one broadcast per parameter at `parallelize` (rank 0's values win), then an all-reduce (sum)
//! of every gradient in buckets of about [`GradientBuckets::bucket_mb`], i.e.
//! `2 (n-1)/n x 4 bytes x params` of bus traffic (half in bf16 under a `mixed_precision` that
//! reduces in it).
//!
//! Buckets follow reverse parameter order (backward produces the last layers first), are
//! re-planned in the order gradients arrived after the first hooked step, and are reduced
//! strictly in bucket order, so every rank issues the same collectives in the same order.
//! Where the device has the gradient hook op (Flex, CubeCL), a hook on each parameter hands its
//! gradient to its bucket the moment backward finalises it, and during the step's last
//! micro-batch a full bucket is reduced while backward still runs: a pipeline step always, a
//! loop of one's own from its second step when its forwards run through
//! [`crate::parallelize::Parallelized::forward`]. Elsewhere gradients are added after backward,
//! with the same sums.
//!
//! ```
//! use burn::optim::AdamWConfig;
//! use burn::tensor::{Device, Tensor};
//! use flashover_parallel::nn::LinearConfig;
//! use flashover_parallel::parallelize::{ParallelizePlan, parallelize};
//! use flashover_runtime::launch;
//!
//! let weights = launch(2, |ctx| {
//!     let device = Device::flex().autodiff();
//!     let model = LinearConfig::new(4, 1).init(&device); // different init per rank...
//!     let (model, par) = parallelize(model, &ParallelizePlan::new(), &ctx)?; // ...made equal
//!     let mut optim = AdamWConfig::new().init();
//!     let x = Tensor::<2>::ones([2, 4], &device).mul_scalar(ctx.rank() as f32 + 1.0);
//!     let loss = par.forward(&model, |m| m.forward(x).powi_scalar(2).mean())?;
//!     let (grads, _norm) = par.gradients(&model, loss.backward(), Some(1.0), &ctx)?;
//!     let model = optim.step(1e-2, model, grads);
//!     Ok::<_, flashover_parallel::ParallelError>(model.weight.val().into_data())
//! })
//! .unwrap();
//! assert_eq!(weights[0], weights[1]); // replicas stay identical
//! ```

mod buckets;
mod reducer;

pub use crate::plan::{GradientBuckets, GradientRows};
pub(crate) use buckets::BucketedReduction;
pub use buckets::{GradientRowLayout, ReductionReport, ReductionTiming};
pub(crate) use reducer::{LaterGrad, LaterHandle};

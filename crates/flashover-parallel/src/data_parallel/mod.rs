//! Data parallel (DDP).
//!
//! **What is replicated:** parameters, gradients and optimizer state, on every rank of the `dp`
//! group. **What is split:** the batch (see `flashover_data::BatchPlan`).
//! **Communication per step:** one broadcast per parameter at start-up (rank 0's values win), then
//! per step an all-reduce (sum) of every gradient, in buckets of about
//! [`DataParallelConfig::bucket_bytes`], i.e. `2 (n-1)/n x 4 bytes x params` of bus traffic.
//!
//! Buckets follow reverse parameter order (backward produces the last layers first) and are
//! reduced strictly in bucket order by a per-rank communication thread, so every rank issues
//! the same collectives in the same order. On Flex, a gradient hook on each parameter reports its
//! gradient the moment backward finalises it, and a full bucket is reduced while backward still
//! runs; elsewhere gradients are read right after backward. With gradient accumulation, only the
//! last micro-batch launches reductions; earlier ones accumulate locally.
//!
//! ```
//! use burn::module::Module;
//! use burn::nn::LinearConfig;
//! use burn::optim::{AdamWConfig, GradientsParams, Optimizer};
//! use burn::tensor::{Device, Tensor};
//! use flashover_parallel::data_parallel::DataParallelConfig;
//! use flashover_runtime::{Axis, launch};
//!
//! let losses = launch(2, |ctx| {
//!     let device = Device::flex().autodiff();
//!     let model = LinearConfig::new(4, 1).init(&device); // different init per rank...
//!     let (model, mut ddp) = DataParallelConfig::new().init(model, ctx.group(Axis::Dp))?; // ...made equal
//!     let mut optim = AdamWConfig::new().init();
//!     let x = Tensor::<2>::ones([2, 4], &device).mul_scalar(ctx.rank() as f32 + 1.0);
//!     ddp.begin_step(1);
//!     let loss = ddp.prepare(&model).forward(x).powi_scalar(2).mean();
//!     ddp.backward_done(&model, GradientsParams::from_grads(loss.backward(), &model))?;
//!     let step = ddp.finish(&model, Some(1.0))?;
//!     let model = optim.step(1e-2, model, step.grads);
//!     Ok::<_, flashover_parallel::ParallelError>(model.weight.val().into_data())
//! })
//! .unwrap();
//! assert_eq!(losses[0], losses[1]); // replicas stay identical
//! ```

mod buckets;
mod reducer;

pub(crate) use buckets::BucketedReduction;
pub use buckets::{
    GradientBuckets, GradientRowLayout, GradientRows, ReductionReport, ReductionTiming,
};

use crate::error::ParallelError;
use crate::grad_clip::clip_global_norm_parts;
use crate::hook::{grad_hook, hooks_supported};
use crate::params::{ParamLayout, accumulate_grads, broadcast_module, grads_from_parts};
use crate::precision::Precision;
use burn::config::Config;
use burn::module::{Module, ModuleMapper, Param};
use burn::optim::GradientsParams;
use burn::tensor::Tensor;
use flashover_comm::{CommunicatorExt, Group};
use reducer::Reducer;
use std::time::{Duration, Instant};

/// Options of data parallel training.
#[derive(Config, Debug)]
pub struct DataParallelConfig {
    /// Target size of one gradient bucket in bytes (f32 gradients; a parameter larger than
    /// this gets a bucket of its own).
    #[config(default = 4194304)]
    pub bucket_bytes: usize,
    /// Reduce buckets during backward through gradient hooks where the device supports them
    /// (Flex); otherwise, and when `false`, right after backward.
    #[config(default = true)]
    pub overlap: bool,
    /// Average gradients over ranks and micro-batches, for losses that are per-sample means
    /// (the usual case). `false` sums them, for losses that are sums over samples.
    #[config(default = true)]
    pub average: bool,
    /// The dtype gradient buckets are summed in: f32, or bf16/f16 at half the bytes (the
    /// buckets are rounded before the collective and widened after it).
    #[config(default = "Precision::F32")]
    pub reduce_dtype: Precision,
}

impl DataParallelConfig {
    /// Wraps `model` for data parallel training over `group`: broadcasts rank 0's parameters
    /// (collective) and plans the buckets. Returns the synchronised model and the DDP state.
    pub fn init<M: Module>(
        &self,
        model: M,
        group: &Group,
    ) -> Result<(M, DataParallel), ParallelError> {
        if self.bucket_bytes < 4 {
            return Err(ParallelError::Invalid(format!(
                "bucket_bytes = {} must hold at least one f32",
                self.bucket_bytes
            )));
        }
        let model = broadcast_module(model, group, 0)?;
        let layout = ParamLayout::of(&model);
        let numels: Vec<usize> = layout.slots.iter().map(|s| s.numel).collect();
        let reverse_layout: Vec<usize> = (0..numels.len()).rev().collect();
        let bucket_elems = self.bucket_bytes / 4;
        let reducer = Reducer::all_reduce(
            group.clone(),
            &numels,
            &reverse_layout,
            bucket_elems,
            self.reduce_dtype,
        );
        let device_ok = model_device(&model).is_some_and(|d| hooks_supported(&d));
        Ok((
            model,
            DataParallel {
                group: group.clone(),
                layout,
                reducer,
                hooks: self.overlap && device_ok,
                average: self.average,
                reduce_dtype: self.reduce_dtype,
                loss_scale: 1.0,
                micro_batches: 0,
                micro: 0,
                backward_end: None,
                exposed_between: Duration::ZERO,
                rebuilt: false,
                peak_elsewhere: 0,
                bucket_elems,
            },
        ))
    }
}

fn model_device<M: Module>(model: &M) -> Option<burn::tensor::Device> {
    model.devices().into_iter().next()
}

/// The per-micro-batch protocol of replicated training, shared by DDP and ZeRO-1/2: start a
/// step, run each micro-batch's forward on the model [`MicroBatches::prepare`] returns, and hand
/// its gradients to [`MicroBatches::backward_done`].
pub trait MicroBatches {
    /// Starts a step of `micro_batches` micro-batches.
    fn begin_step(&mut self, micro_batches: usize);
    /// The model to run the next micro-batch's forward with.
    fn prepare<M: Module>(&mut self, model: &M) -> M;
    /// After a micro-batch's backward.
    fn backward_done<M: Module>(
        &mut self,
        model: &M,
        grads: GradientsParams,
    ) -> Result<(), ParallelError>;
}

impl MicroBatches for DataParallel {
    fn begin_step(&mut self, micro_batches: usize) {
        DataParallel::begin_step(self, micro_batches)
    }
    fn prepare<M: Module>(&mut self, model: &M) -> M {
        DataParallel::prepare(self, model)
    }
    fn backward_done<M: Module>(
        &mut self,
        model: &M,
        grads: GradientsParams,
    ) -> Result<(), ParallelError> {
        DataParallel::backward_done(self, model, grads)
    }
}

/// What one step's gradient reduction did and cost.
#[derive(Debug, Clone, Default)]
pub struct ReduceReport {
    /// Global gradient norm before clipping.
    pub grad_norm: f32,
    /// Time the communication thread spent in all-reduces.
    pub comm: Duration,
    /// Part of `comm` that ran before the last backward finished (hidden behind compute).
    pub overlapped: Duration,
    /// Time the training thread waited for reductions after backward.
    pub exposed: Duration,
    /// Buckets reduced.
    pub buckets: usize,
}

/// A step's averaged gradients and its report.
pub struct StepGradients {
    /// Gradients averaged (or summed) over every rank and micro-batch, clipped, ready for the
    /// optimizer.
    pub grads: GradientsParams,
    /// What the reduction measured.
    pub report: ReduceReport,
}

/// The per-rank state of data parallel training; see the module docs for the step protocol:
/// `begin_step`, then per micro-batch `prepare` + backward + `backward_done`, then `finish`.
pub struct DataParallel {
    group: Group,
    layout: ParamLayout,
    reducer: Reducer,
    hooks: bool,
    average: bool,
    reduce_dtype: Precision,
    /// The factor the losses were multiplied by before backward (loss scaling); divided out
    /// with the average.
    loss_scale: f32,
    micro_batches: usize,
    micro: usize,
    backward_end: Option<Instant>,
    /// Time spent waiting for reductions between micro-batches (reduce-scatter mode).
    exposed_between: Duration,
    /// Whether buckets have been re-planned from the first step's gradient order.
    rebuilt: bool,
    /// Gradient bytes this step held outside the current reducer: Burn gradients that
    /// [`DataParallel::finish`] returned, or the peak of a reducer replaced by a rebuild.
    peak_elsewhere: usize,
    /// Target elements per bucket.
    bucket_elems: usize,
}

struct HookMapper<'a> {
    reducer: &'a Reducer,
    index: usize,
}

impl ModuleMapper for HookMapper<'_> {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
        let callback = self.reducer.callback(self.index);
        self.index += 1;
        param.map(|t| grad_hook(t, callback))
    }
}

impl DataParallel {
    /// The parameter layout (names, shapes, offsets) DDP reduces.
    pub fn layout(&self) -> &ParamLayout {
        &self.layout
    }

    /// Number of gradient buckets.
    pub fn num_buckets(&self) -> usize {
        self.reducer.buckets().len()
    }

    /// Whether gradients are reported by hooks during backward (overlap) on this device.
    pub fn overlaps(&self) -> bool {
        self.hooks
    }

    /// Starts a step of `micro_batches` micro-batches.
    pub fn begin_step(&mut self, micro_batches: usize) {
        assert!(micro_batches > 0, "a step needs at least one micro-batch");
        self.micro_batches = micro_batches;
        self.micro = 0;
        self.backward_end = None;
        self.exposed_between = Duration::ZERO;
        self.peak_elsewhere = 0;
        self.reducer.begin_step();
    }

    /// The model to run the next micro-batch's forward with: `model` itself, with gradient
    /// hooks on its parameters where the device supports them.
    pub fn prepare<M: Module>(&mut self, model: &M) -> M {
        assert!(
            self.micro < self.micro_batches,
            "prepare called after the step's last micro-batch"
        );
        self.reducer
            .begin_micro(self.micro + 1 == self.micro_batches);
        if self.hooks {
            model.clone().map(&mut HookMapper {
                reducer: &self.reducer,
                index: 0,
            })
        } else {
            model.clone()
        }
    }

    /// After a micro-batch's backward: gradients that hooks did not report are read from `grads`
    /// (parameters that got no gradient count as zero).
    ///
    /// When gradients are reduce-scattered (ZeRO-2), every micro-batch's buckets are reduced;
    /// before the next micro-batch this waits for them (the wait is reported as exposed).
    pub fn backward_done<M: Module>(
        &mut self,
        model: &M,
        grads: GradientsParams,
    ) -> Result<(), ParallelError> {
        let arrived = self.reducer.arrived();
        // With hooks every parameter has usually reported already: nothing to read.
        if !arrived.iter().all(|&a| a) {
            // Scratch only: the buckets hold the gradient once it is added.
            let mut flat = vec![0.0; self.layout.numel];
            accumulate_grads(model, &grads, &mut flat, &arrived);
            self.reducer.add_remaining(&flat);
        }
        drop(grads);
        self.micro += 1;
        if self.micro == self.micro_batches {
            self.backward_end = Some(Instant::now());
        }
        Ok(())
    }

    /// After the last micro-batch: waits for the reductions, averages over ranks and
    /// micro-batches, clips to `max_norm`, and returns the gradients for the optimizer.
    pub fn finish<M: Module>(
        &mut self,
        model: &M,
        max_norm: Option<f32>,
    ) -> Result<StepGradients, ParallelError> {
        self.check_finished();
        let t0 = Instant::now();
        let spans = self.reducer.wait_reduced()?;
        // Per parameter, each bucket freed once copied out: about one gradient is held.
        let mut parts = self.reducer.drain();
        self.rebuild_buckets_after_first_step()?;
        let denom = self.denominator();
        parts.iter_mut().flatten().for_each(|g| *g /= denom);
        let mut views: Vec<&mut [f32]> = parts.iter_mut().map(|p| p.as_mut_slice()).collect();
        let grad_norm = clip_global_norm_parts(&mut views, max_norm, None)?;
        let grads = grads_from_parts(model, parts);
        // Burn's gradients, handed to its optimizer, are gradient bytes this step held too.
        self.peak_elsewhere = self.peak_elsewhere.max(self.layout.numel * 4);
        Ok(StepGradients {
            grads,
            report: self.report(t0, spans, grad_norm),
        })
    }

    /// Bytes of gradient this rank holds now: bucket buffers.
    pub fn grad_bytes(&self) -> usize {
        self.reducer.held_bytes().0
    }

    /// The most gradient bytes held at once since the step began: bucket buffers and copies
    /// on their way out, and the gradients [`DataParallel::finish`] handed over.
    pub fn peak_grad_bytes(&self) -> usize {
        self.reducer
            .held_bytes()
            .1
            .max(self.grad_bytes())
            .max(self.peak_elsewhere)
    }

    /// After the first step: every rank re-plans its buckets in the order rank 0's gradients
    /// arrived (collective; see the reducer's docs). Parameters that never got a gradient go
    /// last.
    fn rebuild_buckets_after_first_step(&mut self) -> Result<(), ParallelError> {
        if self.rebuilt {
            return Ok(());
        }
        self.rebuilt = true;
        let n = self.layout.slots.len();
        let mut seen = vec![false; n];
        let mut order: Vec<u64> = vec![];
        for p in self.reducer.arrival_order().into_iter().chain((0..n).rev()) {
            if !std::mem::replace(&mut seen[p], true) {
                order.push(p as u64);
            }
        }
        self.group.broadcast(&mut order, 0)?;
        let order: Vec<usize> = order.into_iter().map(|p| p as usize).collect();
        let numels: Vec<usize> = self.layout.slots.iter().map(|s| s.numel).collect();
        self.peak_elsewhere = self.peak_elsewhere.max(self.reducer.held_bytes().1);
        self.reducer = Reducer::all_reduce(
            self.group.clone(),
            &numels,
            &order,
            self.bucket_elems,
            self.reduce_dtype,
        );
        Ok(())
    }

    fn check_finished(&self) {
        assert_eq!(
            self.micro, self.micro_batches,
            "finish called before every micro-batch's backward_done"
        );
    }

    /// Sets the factor this step's losses are multiplied by before backward (loss scaling);
    /// the reduced gradients are divided by it. 1 by default.
    pub fn set_loss_scale(&mut self, scale: f32) {
        self.loss_scale = scale;
    }

    /// What gradient sums are divided by: ranks x micro-batches when averaging, times the
    /// loss scale.
    fn denominator(&self) -> f32 {
        let ranks = if self.average {
            (self.group.size() * self.micro_batches) as f32
        } else {
            1.0
        };
        ranks * self.loss_scale
    }

    fn report(&self, t0: Instant, spans: reducer::Spans, grad_norm: f32) -> ReduceReport {
        let exposed = t0.elapsed() + self.exposed_between;
        let end = self.backward_end.unwrap_or(t0);
        let comm = spans.spans.iter().map(|(a, b)| *b - *a).sum();
        let overlapped = spans
            .spans
            .iter()
            .map(|&(a, b)| {
                if a < end {
                    b.min(end) - a
                } else {
                    Duration::ZERO
                }
            })
            .sum();
        ReduceReport {
            grad_norm,
            comm,
            overlapped,
            exposed,
            buckets: spans.spans.len(),
        }
    }
}

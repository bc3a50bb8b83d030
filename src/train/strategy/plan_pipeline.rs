//! Pipelines and mixtures of experts through the reference model's plan, as a user's model
//! runs them (a mixture of experts without `pp` as one stage, its micro-batches in turn): the
//! job's plan (`TrainConfig::model_plan`: the tensor- and sequence-parallel split, under ZeRO-3
//! every layer a fully sharded unit) with a pipeline rule cut from `[parallel]`, its
//! recomputation and precision, applied by `flashover_parallel::parallelize`. Each step is
//! `PipelineRunner::step` over the job's micro-batches: every rank keeps the model's
//! whole structure with its stages' parameters (placeholders for the rest), the schedule runs
//! the stages through the model's `PipelineModel` forward, and the gradients come back reduced
//! (tied embedding copies summed over their two stages) and clipped. AdamW then steps what the
//! rank holds.
//!
//! With a `cp` axis the plan splits every sequence as the job says (`cp_attention`,
//! `cp_load_balance`): the job's micro-batches hold this rank's positions already, and each
//! runs in the plan's attention across the ranks (`transformer::MicroBatchContexts`, worked
//! out once for the run).
//!
//! A mixture-of-experts model's experts are spread over `ep` by the model's own
//! `expert_parallel` rules, the hottest copied to every ep rank as `moe.replicate_hot` says
//! (the plan's `replicate_hot_experts`); each step's routing (counted by every layer into one
//! hook) is summed over the ranks and the stages, moves the routing biases and makes the
//! step's record.
//!
//! ZeRO-1/2, and ZeRO-3 under zb-h1 (whose deferred weight gradients a plan's units cannot
//! wait for) or with hot-expert copies (which copy whole experts), step this rank's rows of
//! what it holds with the library's `RowAdamW`: the plan reduces the gradients to those rows
//! (`gradient_buckets.rows`: all-reduced buckets under ZeRO-1, reduce-scattered ones under
//! ZeRO-2 and ZeRO-3 by rows), clipped by the global norm. ZeRO-1/2 all-gather the updated
//! rows after the step; ZeRO-3 by rows keeps only the rows between steps and gathers what the
//! rank holds at the start of each.
use super::routing::{PendingMoeRecord, RoutingSums};
use super::{
    Batches, PendingScalars, SHARING, SharedState, StepOutcome, borrowed, named_params,
    replica_index, restore_flat, with_moments,
};
use crate::train::checkpoint::{LocalState, placed_segments};
use crate::train::config::{GradientReduction, TrainConfig};
use burn::module::Module;
use burn::tensor::{Int, Tensor};
use flashover_models::transformer::{self, LmBatch, MicroBatchContexts};
use flashover_models::{ForwardContext, MoeHook, Transformer, TransformerConfig};
use flashover_parallel::activation_checkpointing::CheckpointPolicy;
use flashover_parallel::data_parallel::{GradientBuckets, GradientRows, ReductionTiming};
use flashover_parallel::parallelize::{
    ContextParallelRule, ParallelizePlan, Parallelized, PipelineStep, parallelize,
};
use flashover_parallel::params::{accumulate_grads, flatten_params, zero_grads};
use flashover_parallel::pipeline::{Schedule, ScheduleKind};
use flashover_parallel::placement::PlacementTable;
use flashover_parallel::precision::LossScaler;
use flashover_parallel::zero::{MemoryReport, RowAdamW};
use flashover_parallel::{FlatAdamWConfig, GradNorm, ModuleAdamW};
use flashover_runtime::{Axis, CommStats, Group, RankContext, RankError};
use std::ops::Range;
use std::time::Duration;

/// Whether the job's ZeRO stage steps rows of what a rank holds ([`RowAdamW`]): ZeRO-1/2, and
/// ZeRO-3 where a plan's units cannot serve it (ZeRO-3 is the plan's units otherwise): under
/// a schedule that defers weight gradients past the units' reduce-scatter, or with hot-expert
/// copies, which copy whole experts.
pub(crate) fn steps_rows(config: &TrainConfig) -> bool {
    let p = &config.parallel;
    let rows_for_zero3 =
        p.pp_schedule == ScheduleKind::ZeroBubbleH1 || config.moe.replicate_hot > 0;
    matches!(p.zero, 1 | 2) || (p.zero == 3 && rows_for_zero3)
}

/// Whether ZeRO-3's units free their gathered parameters after forward and gather them again
/// in backward: on a device with Burn's balanced checkpointing, whose backward states do not
/// keep the units' gathered reads (`Rank::new` makes the device so).
pub(crate) fn reshards(config: &TrainConfig) -> bool {
    let p = &config.parallel;
    p.zero == 3 && p.reshard_after_forward && !steps_rows(config)
}

/// A rank's model under the plan, its AdamW and what a step reads.
pub(crate) struct PlanPipeline {
    model: Transformer,
    /// The autodiff device the model computes on.
    device: burn::tensor::Device,
    /// With `parallel.gradient_reduction = sum`: the ranks whose gradients are summed (the
    /// plan averages over them and the micro-batches).
    summed_over: Option<usize>,
    par: Parallelized,
    optim: Optimizer,
    /// What every micro-batch's forward context shares (the plan's attention across `cp`,
    /// this rank's part of the dropout masks), worked out once.
    contexts: MicroBatchContexts,
    /// A mixture-of-experts model's routing: what the step's counts are summed over.
    moe: Option<Routing>,
}

/// How a rank steps what it holds.
enum Optimizer {
    /// AdamW on the whole of it (`held` elements: its stages' parameters, its shards under
    /// ZeRO-3), the gradients reduced and clipped by the plan. With
    /// `parallel.gradient_reduction = sum`, `summed_over`: the ranks whose gradients are
    /// summed (the plan averages over them and the micro-batches).
    Whole { adam: Box<ModuleAdamW>, held: usize },
    /// ZeRO-1/2 (and ZeRO-3 by rows): AdamW on its rows of what it holds, the plan reducing
    /// the gradients to those rows.
    Rows(Box<RowAdamW>),
}

/// What a mixture-of-experts model's step needs to sum its routing.
struct Routing {
    /// The ranks routing different tokens (`dp x fsdp x ep x cp`).
    batch: Group,
    /// `[layers, experts]`.
    shape: [usize; 2],
    d_model: usize,
}

/// `model` (this rank's seeded initialisation) parallelized by the job's plan with its
/// pipeline (collective).
pub(crate) fn build(
    ctx: &RankContext,
    config: &TrainConfig,
    model_config: &TransformerConfig,
    model: Transformer,
    grad_group: &Group,
) -> Result<Box<PlanPipeline>, RankError> {
    let p = &config.parallel;
    let micro = config.run.micro_batches;
    let schedule = Schedule::build(
        p.pp_schedule,
        ctx.group(Axis::Pp).size(),
        micro,
        p.pp_chunks,
    )
    .map_err(RankError::from)?;
    let counts = config.pipeline_blocks(model_config, schedule.stages())?;
    let rule = transformer::pipeline(model_config, p.pp_schedule, micro)
        .chunks(p.pp_chunks)
        .layers_per_stage(&counts);
    // Burn's balanced checkpointing is the device's (`Rank::new` made it; with it ZeRO-3's
    // units reshard after forward, see `reshards`); the plan recomputes the layers a
    // block-level policy names.
    let recompute = match &p.activation_checkpointing {
        policy if policy.is_selective() => CheckpointPolicy::None,
        policy => policy.clone(),
    };
    let mut buckets = GradientBuckets::default()
        .bucket_mb(p.bucket_mb)
        .overlap(p.overlap);
    if steps_rows(config) {
        // ZeRO-1 keeps DDP's all-reduce (the same sums), ZeRO-2 and up hand each rank only
        // the sum of its rows.
        buckets = buckets.rows(match p.zero {
            1 => GradientRows::AllReduce,
            _ => GradientRows::ReduceScatter,
        });
    }
    let mut plan = config
        .model_plan(model_config)?
        .pipeline(rule)
        .activation_checkpointing(recompute)
        .mixed_precision(config.precision.policy()?)
        .gradient_buckets(buckets);
    // The model's own experts rules (the job's plan leaves them to the job).
    plan.expert_parallel = ParallelizePlan::from_toml(&model_config.plan_toml())?.expert_parallel;
    plan = plan.replicate_hot_experts(config.moe.replicate_hot);
    if ctx.group(Axis::Cp).size() > 1 {
        // The reference model's attention runs through its forward context: no cores to name.
        plan = plan.context_parallel(ContextParallelRule {
            attention: vec![],
            algorithm: p.cp_attention,
            load_balance: p.cp_load_balance,
        });
    }
    let (mut model, par) = parallelize(model, &plan, ctx)?;
    let adamw = FlatAdamWConfig::new().with_weight_decay(config.optim.weight_decay as f32);
    let optim = match steps_rows(config) {
        true => {
            let rows = RowAdamW::new(&par, &model, &adamw, p.zero != 3, ctx)?;
            model = rows.between_steps(model);
            Optimizer::Rows(Box::new(rows))
        }
        false => {
            let held = par
                .sharded()
                .held_entries(&model)?
                .iter()
                .map(|(s, _)| s.numel)
                .sum();
            Optimizer::Whole {
                adam: Box::new(ModuleAdamW::new(&adamw, &model)),
                held,
            }
        }
    };
    let device = model
        .devices()
        .into_iter()
        .next()
        .unwrap_or_else(|| ctx.device().clone().autodiff());
    let sum = p.gradient_reduction == GradientReduction::Sum;
    Ok(Box::new(PlanPipeline {
        optim,
        device,
        summed_over: sum.then(|| grad_group.size()),
        contexts: {
            let seq = config.data.seq_len;
            let local_seq = par.sequences().positions(seq)?.len();
            MicroBatchContexts::new(&par, &model, seq, local_seq)?
        },
        model,
        par,
        moe: model_config.moe.as_ref().map(|moe| Routing {
            batch: grad_group.clone(),
            shape: [model_config.n_layers, moe.n_experts],
            d_model: model_config.d_model,
        }),
    }))
}

impl PlanPipeline {
    /// Elements this rank keeps between steps: (parameters, gradients and each moment).
    fn held(&self) -> (usize, usize) {
        match &self.optim {
            Optimizer::Rows(rows) => rows.held_elements(),
            Optimizer::Whole { held, .. } => (*held, *held),
        }
    }

    /// What the model's stages read of a micro-batch the job made (this rank's positions of
    /// its sequences under cp): the tokens, and the plan's layer hooks with the job's dropout
    /// drawn as on one device and, under cp, the plan's attention across the ranks.
    fn micro_batch(
        &self,
        (inputs, targets, fwd): (Tensor<2, Int>, Tensor<2, Int>, ForwardContext),
    ) -> LmBatch {
        LmBatch {
            inputs,
            targets,
            ctx: self.contexts.of(fwd.dropout, fwd.sample_offset),
        }
    }
}

impl PlanPipeline {
    /// One optimizer step over `micro_batches` micro-batches from `batches`, at learning rate
    /// `lr`, clipping the global gradient norm to `clip`.
    pub(crate) fn step(
        self: Box<Self>,
        ctx: &RankContext,
        clip: Option<f32>,
        batches: Batches<'_>,
        micro_batches: usize,
        lr: f64,
        scaler: &mut LossScaler,
    ) -> Result<(Box<Self>, StepOutcome), RankError> {
        if scaler.is_active() {
            // The job's scale (a resumed checkpoint's) is the one the plan scales by.
            self.par.precision().restore_loss_scale(scaler.state())?;
        }
        // Every layer of every micro-batch counts its routing into the step's one hook.
        let routing = self.moe.is_some().then(MoeHook::new);
        let a2a_before = ctx.group(Axis::Ep).stats();
        let attention_before = self.par.sequences().attention_work();
        let data = (0..micro_batches)
            .map(|k| {
                let mut batch = self.micro_batch(batches(k));
                if let Some(hook) = &routing {
                    batch.ctx.moe = Some(hook.clone());
                }
                Ok(batch)
            })
            .collect::<Result<Vec<_>, RankError>>()?;
        let (this, out) = self.run_schedule(&data, clip, ctx)?;
        if let Some(state) = this.par.precision().loss_scale_state() {
            scaler.restore(state);
        }
        let (mut this, norm_scale) = this.apply_gradients(&out, clip, micro_batches, lr)?;
        let (moe, a2a) = match (&this.moe, routing) {
            (Some(_), Some(hook)) => this.update_routing(hook, ctx, &a2a_before)?,
            _ => (None, Duration::ZERO),
        };
        let attention = (this.par.sequences().attention_work())
            .zip(attention_before)
            .map(|(now, before)| now.since(&before));
        let scheduled = ctx.group(Axis::Pp).size() > 1;
        let mut outcome = StepOutcome {
            attention,
            a2a,
            ..this.outcome(out, norm_scale, scheduled)
        };
        outcome.scalars.moe = moe;
        Ok((this, outcome))
    }

    /// The plan's schedule over the step's micro-batches `data` (this rank's share), with
    /// the plan clipping unless the job sums the gradients and clips them itself.
    fn run_schedule(
        mut self: Box<Self>,
        data: &[LmBatch],
        clip: Option<f32>,
        ctx: &RankContext,
    ) -> Result<(Box<Self>, PipelineStep), RankError> {
        let rows = data[0].inputs.dims()[0];
        let micro_batches = data.len();
        // Pipeline steps count samples from the data rank's first (step 0 of a batch of this
        // step's size): all a micro-batch's place in `data` needs.
        let data_ranks = self.par.data().ranks();
        let first = data_ranks.rank() * rows * micro_batches;
        let global_batch = data_ranks.size() * rows * micro_batches;
        let micro_batch = |samples: Range<usize>| {
            let batch = &data[(samples.start - first) / rows];
            LmBatch {
                inputs: batch.inputs.clone(),
                targets: batch.targets.clone(),
                ctx: batch.ctx.clone(),
            }
        };
        // Summed gradients are the plan's means times the samples' groups, clipped here.
        let plan_clip = clip.filter(|_| self.summed_over.is_none());
        if let Optimizer::Rows(rows) = &self.optim {
            // ZeRO-3 by rows gathers what the rank holds for the step.
            self.model = rows.for_step(self.model)?;
        }
        let out = (self.par.pipeline()?).step(
            &self.model,
            global_batch,
            0,
            &micro_batch,
            plan_clip,
            ctx,
        )?;
        Ok((self, out))
    }

    /// The optimizer step with the schedule's gradients `out` (none on a skipped step), at
    /// learning rate `lr`, queued on the device; with what the plan's norm is multiplied by to
    /// make the step's. Where the job sums the gradients, they are the plan's means times the
    /// summed groups, clipped here to `clip` (on the device: nothing is read).
    fn apply_gradients(
        mut self: Box<Self>,
        out: &PipelineStep,
        clip: Option<f32>,
        micro_batches: usize,
        lr: f64,
    ) -> Result<(Box<Self>, f32), RankError> {
        // What the gradients are multiplied by: the summed groups, times the clip factor (a
        // tensor on the device) where the job clips.
        let (norm_scale, factor) = match self.summed_over {
            Some(ranks) => {
                let sums = (ranks * micro_batches) as f32;
                let norm = out.scalars.norm().into_tensor().mul_scalar(sums);
                let factor = match clip {
                    Some(max) => Some(
                        GradNorm::from_tensor(norm)
                            .clip_factor(max)?
                            .mul_scalar(sums),
                    ),
                    None => None,
                };
                (sums, factor)
            }
            None => (1.0, None),
        };
        let scaled = |grads: Tensor<1>| match &factor {
            Some(factor) => {
                let n = grads.dims()[0];
                grads * factor.clone().expand([n])
            }
            None if norm_scale == 1.0 => grads,
            None => grads.mul_scalar(norm_scale),
        };
        match &mut self.optim {
            Optimizer::Whole { adam, .. } if !out.skipped => {
                let zeros = zero_grads(&self.model, &self.device.clone().inner());
                let (grads, _) = accumulate_grads(&self.model, &out.grads, zeros, &[]);
                self.model = adam.step_flat(lr, self.model, scaled(grads))?;
            }
            Optimizer::Whole { .. } => {}
            Optimizer::Rows(rows) => {
                let grads = scaled(out.rows.clone());
                self.model = rows.step(lr, self.model, grads, !out.skipped)?;
            }
        }
        Ok((self, norm_scale))
    }

    /// The step's routing counted by `hook`, summed over the ranks that routed different
    /// tokens, moves the layers' routing biases; with its record and the step's expert
    /// all-to-all time (since `a2a_before`).
    fn update_routing(
        &mut self,
        hook: MoeHook,
        ctx: &RankContext,
        a2a_before: &CommStats,
    ) -> Result<(Option<PendingMoeRecord>, Duration), RankError> {
        let Some(moe) = &self.moe else {
            return Ok((None, Duration::ZERO));
        };
        let pp = ctx.group(Axis::Pp);
        let remote = self.par.experts().rows_sent();
        let groups = [&moe.batch, pp];
        let device = self.device.clone().inner();
        let sums = RoutingSums::over(hook.take_stats(), remote, moe.shape, &groups, &device)?;
        transformer::update_routing_biases(&mut self.model, &sums.routed);
        let record = sums.record(moe.d_model);
        let a2a = ctx.group(Axis::Ep).stats().since(a2a_before).total();
        Ok((Some(record), a2a.wait + a2a.transfer))
    }

    /// What the step measured of memory, overlap and recomputation, with its loss and norm
    /// (the plan's times `norm_scale`) still on the device; `scheduled`: a schedule over
    /// several stages ran, whose report it carries.
    fn outcome(&self, out: PipelineStep, norm_scale: f32, scheduled: bool) -> StepOutcome {
        let (params, held) = self.held();
        // Under rows the buckets' peak is what the rank held of gradients (a whole one under
        // ZeRO-1's all-reduce; its rows and the buckets in flight under ZeRO-2).
        let grads = match &self.optim {
            Optimizer::Rows(_) => (out.reduction.peak_bytes).max(held * 4),
            Optimizer::Whole { .. } => held * 4,
        };
        let gathered_peak = match &self.optim {
            Optimizer::Rows(rows) => rows.gathered_bytes(),
            Optimizer::Whole { .. } => {
                (self.par.sharded().unit_stats()).map_or(0, |s| s.snapshot().peak_bytes)
            }
        };
        let outcome = StepOutcome {
            memory: MemoryReport {
                params: params * 4,
                grads,
                optimizer: held * 8,
                gathered_peak,
            },
            recomputed: out.recomputed,
            loss_scale: out.loss_scale,
            skipped: out.skipped,
            // The whole batch's mean loss and the norm, read when the job reports them.
            ..StepOutcome::new(PendingScalars {
                scalars: out.scalars.clone(),
                norm_scale,
                moe: None,
            })
        };
        // One stage (a mixture of experts without `pp`) runs no schedule worth reporting.
        match scheduled {
            true => outcome.scheduled(out.report),
            false => outcome,
        }
    }

    /// Gradient buckets per step and when they are reduced (during backward, or after it and
    /// why).
    pub(crate) fn buckets(&self) -> (usize, ReductionTiming) {
        self.par.reducer().buckets(&self.device)
    }

    /// This rank's parameters and optimizer state with where each part belongs in the whole
    /// model, and which ranks hold the same data (they share the writing).
    pub(crate) fn local_state(
        &self,
        ctx: &RankContext,
        _grad_group: &Group,
    ) -> Result<SharedState, RankError> {
        let adam = match &self.optim {
            Optimizer::Rows(rows) => return rows_state(rows, ctx, self.par.sharded().placements()),
            Optimizer::Whole { adam, .. } => adam,
        };
        let entries = self.par.sharded().held_entries(&self.model)?;
        let segments = placed_segments(&entries, 0, &|a| ctx.coord(a), &SHARING);
        let state = with_moments(flatten_params(&self.model), segments, adam.flat());
        let replicas = replica_index(ctx, &SHARING);
        Ok((state, replicas, replicas))
    }

    /// Puts a loaded [`LocalState`] (from `local_state`, filled by a checkpoint) back.
    pub(crate) fn restore(&mut self, state: LocalState) -> Result<(), RankError> {
        let model = self.model.clone();
        self.model = match &mut self.optim {
            Optimizer::Rows(rows) => {
                let LocalState {
                    params,
                    moments,
                    steps_taken,
                    ..
                } = state;
                rows.restore(model, params, steps_taken, moments)?
            }
            Optimizer::Whole { adam, .. } => restore_flat(model, state, adam.flat_mut())?,
        };
        Ok(())
    }

    /// Mixture of experts: every layer's routing bias (`None` for dense models).
    pub(crate) fn moe_bias(&self) -> Option<Vec<Vec<f32>>> {
        self.moe.as_ref()?;
        let bias = |b: &flashover_models::Block| b.moe.as_ref().map(|m| m.expert_bias.clone());
        Some(
            self.model
                .blocks
                .iter()
                .map(|b| bias(b).unwrap_or_default())
                .collect(),
        )
    }

    /// Restores `moe_bias`'s output.
    pub(crate) fn set_moe_bias(&mut self, bias: &[Vec<f32>]) -> Result<(), RankError> {
        if self.moe.is_none() {
            return Ok(());
        }
        super::routing_bias_layers(bias.len(), self.model.blocks.len())?;
        for (block, bias) in self.model.blocks.iter_mut().zip(bias) {
            if let Some(moe) = block.moe.as_mut() {
                moe.expert_bias = bias.clone();
            }
        }
        Ok(())
    }

    /// The whole model's parameters by name, on world rank 0 (collective where the model is
    /// split; empty elsewhere).
    pub(crate) fn full_params(
        &self,
        ctx: &RankContext,
    ) -> Result<Vec<(String, Vec<f32>)>, RankError> {
        let model = match &self.optim {
            Optimizer::Rows(rows) => rows.for_step(self.model.clone())?,
            Optimizer::Whole { .. } => self.model.clone(),
        };
        let whole = self.par.sharded().whole(model)?;
        Ok(match ctx.rank() {
            0 => named_params(&whole),
            _ => vec![],
        })
    }
}

/// This rank's rows and their moments for a checkpoint, written by the ranks that hold the
/// same rows (not those along the rows' axis).
fn rows_state(
    rows: &RowAdamW,
    ctx: &RankContext,
    placements: &PlacementTable,
) -> Result<SharedState, RankError> {
    let sharing: Vec<Axis> = SHARING.into_iter().filter(|&a| a != rows.axis()).collect();
    let replicas = replica_index(ctx, &sharing);
    let entries = rows.placed(placements)?;
    let segments = placed_segments(&borrowed(&entries), 0, &|a| ctx.coord(a), &sharing);
    let state = with_moments(rows.rows(), segments, rows.adam());
    Ok((state, replicas, replicas))
}

//! Pipeline parallelism: this rank's stages (virtual stages under interleaving) of the
//! reference transformer run a schedule over the micro-batches; with a tp axis each stage holds
//! its tensor-parallel shares, with a cp axis each rank a share of every sequence, and under
//! ZeRO each rank its rows of every parameter. Gradients are reduced once per step through the
//! placements (over the data axes, and the tied embedding's copies over their two stages).
//!
//! Only pipelines with hot-expert copies (`moe.replicate_hot`), which a plan does not make,
//! come here; [`super::plan_pipeline`] runs the rest.

use super::moe::RoutingSums;
use super::rows::FlatOptimizer;
use super::{Batches, Precisions, RankStrategy, SharedState, StepOutcome, borrowed, clip_placed};
use crate::train::checkpoint::LocalState;
use crate::train::config::{GradientReduction, TrainConfig};
use crate::train::parallelize::Shares;
use crate::train::pp_model::TransformerStage;
use crate::train::report::MoeRecord;
use burn::tensor::Gradients;
use flashover_models::moe::update_expert_bias;
use flashover_models::{Block, LinearHook, MoeConfig, MoeHook, Transformer, TransformerConfig};
use flashover_parallel::FlatAdamWConfig;
use flashover_parallel::expert_parallel::ExpertParallel;
use flashover_parallel::parallelize::transformer::layer_hooks;
use flashover_parallel::params::{ParamLayout, ParamSlot, accumulate_grads, flatten_params};
use flashover_parallel::pipeline::{
    ActionKind, PipelineExecutor, Schedule, StageOutput, WeightGradStore, deferral_supported,
};
use flashover_parallel::placement::{GradientReducer, ParamPlacement, PlacementTable, Tie};
use flashover_parallel::zero::MemoryReport;
use flashover_runtime::{Axis, CommunicatorExt, Group, RankContext, RankError, ReduceOp};
use std::sync::Arc;
use std::time::Duration;

/// This rank's stages of `shares` (the whole model or its tp shares; with `experts`, this
/// rank's experts of a mixture-of-experts model) as the schedule says, sharded as the job
/// says (collective).
pub(super) fn build(
    ctx: &RankContext,
    config: &TrainConfig,
    model_config: &TransformerConfig,
    shares: Shares,
    experts: Option<ExpertParallel>,
    grad_group: &Group,
    adamw: &FlatAdamWConfig,
) -> Result<Box<dyn RankStrategy>, RankError> {
    let pp = ctx.group(Axis::Pp);
    let kind = config.parallel.pp_schedule;
    let micro = config.run.micro_batches;
    let schedule = Schedule::build(kind, pp.size(), micro, config.parallel.pp_chunks)
        .map_err(RankError::from)?;
    let counts = config.pipeline_blocks(model_config, schedule.stages())?;
    // Context-parallel ranks read the same samples: rows split over the others; each holds a
    // share of every sequence, and with sequence parallelism a tp rank a share of that.
    let batch_ranks = grad_group.size() / ctx.group(Axis::Cp).size();
    let rows = config.run.global_batch / batch_ranks / micro;
    let local_seq = config.data.seq_len / ctx.group(Axis::Cp).size();
    let d = model_config.d_model;
    let (local, split, seq, mut placements) = match shares {
        Shares::Split(shares) => {
            let seq = match shares.plan().sequence_parallel {
                true => local_seq / ctx.group(Axis::Tp).size(),
                false => local_seq,
            };
            let (local, tp, parts, placements) = shares.into_parts();
            (local, Some((tp, parts)), seq, placements)
        }
        Shares::Whole(model, placements) => (*model, None, local_seq, placements),
    };
    let tied = local.head.is_none();
    // What rank 0 names the gathered model by: the whole model's structure (every expert,
    // when this rank holds only its own; collective over ep).
    let skeleton = match &experts {
        Some(experts) => experts.gather_experts(local.clone())?,
        None => local.clone(),
    };
    let order = ParamLayout::of(&skeleton)
        .slots
        .into_iter()
        .map(|s| s.name)
        .collect();
    let stage_params = stage_names(&skeleton, &placements, schedule.stages(), &counts)?;
    drop(skeleton);
    let chunks = (0..schedule.chunks)
        .map(|c| {
            let stage = schedule.stage_of(pp.rank(), c);
            TransformerStage::cut_split(&local, stage, &counts, split.clone())
        })
        .collect::<Result<Vec<_>, _>>()?;
    for chunk in &chunks {
        place_stage(&mut placements, chunk, &local)?;
    }
    // Tied embeddings: the first and the last stage's ranks keep their copies in step.
    let (first, last) = (0, pp.size() - 1);
    let holds = pp.rank() == first || pp.rank() == last;
    let tie_group = pp.split((!holds) as usize, pp.rank(), "embedding-tie")?;
    let tie = (tied && holds).then_some(tie_group);
    let splits_backward = schedule
        .ranks
        .iter()
        .flatten()
        .any(|a| a.kind == ActionKind::BackwardWeight);
    // On a device the deferral op is not built for, refuse rather than run 1F1B silently.
    let device = ctx.device().clone().autodiff();
    if splits_backward && !deferral_supported(&device) {
        return Err(RankError::from(format!(
            "parallel.pp_schedule = {}: zero-bubble schedules defer the blocks' weight \
                 gradients through an op built for Flex only, not for {device:?}; use 1f1b \
                 or interleaved there",
            config.parallel.pp_schedule
        )));
    }
    let deferral = splits_backward.then(|| {
        let store = WeightGradStore::default();
        // The plan's layer hooks (Megatron's operators around split layers), whose linear
        // layers defer their weight gradients inside the executor's zero-bubble forwards.
        let (hook, _) = layer_hooks();
        (store, hook)
    });
    let optim = FlatOptimizer::new(ctx, &chunks, config.parallel.zero, adamw);
    let layouts = chunks.iter().map(ParamLayout::of).collect();
    // ZeRO-3 keeps only its rows between steps.
    let chunks = optim.between_steps(chunks);
    let moe = match (experts, &model_config.moe) {
        (Some(experts), Some(moe)) => Some(StageExperts {
            hook: MoeHook::new(Arc::new(experts.clone())),
            experts,
            bias: vec![vec![]; model_config.n_layers],
            config: moe.clone(),
            replicate_hot: config.moe.replicate_hot,
            batch: grad_group.clone(),
        }),
        _ => None,
    };
    Ok(Box::new(PipelineState {
        tie,
        deferral,
        moe,
        placements,
        reducer: GradientReducer::new(ctx, config.precision.reduce_dtype)?,
        schedule,
        optim,
        layouts,
        chunks,
        stage_params,
        order,
        shape: [rows, seq, d],
        average: config.parallel.gradient_reduction == GradientReduction::Mean,
        data_ranks: grad_group.size(),
    }))
}

/// A pipeline rank's chunks, schedule, optimizer and how to name its parameters.
struct PipelineState {
    chunks: Vec<TransformerStage>,
    schedule: Schedule,
    optim: FlatOptimizer,
    /// The parameter layout of each of this rank's chunks (fixed for the run).
    layouts: Vec<ParamLayout>,
    /// Per virtual stage, its whole (unsplit) parameters in layout order: the name they have
    /// in the whole model (`None` for the tied head's copy, reported as `embed.weight`) and
    /// their length. With `order`, the whole model's names, this is all rank 0 needs to name
    /// gathered parameters: no rank keeps a copy of the whole model.
    stage_params: Vec<StageNames>,
    order: Vec<String>,
    shape: [usize; 3],
    average: bool,
    /// Ranks whose gradients are summed (`dp x fsdp x cp`): means divide by it.
    data_ranks: usize,
    /// Where each parameter of this rank's chunks lives.
    placements: PlacementTable,
    reducer: GradientReducer,
    /// Tied embeddings: the group of the ranks holding the first and the last stage, which sum
    /// the two copies' gradients (`None` for other ranks and untied models).
    tie: Option<Group>,
    /// Zero-bubble schedules on Flex without tensor parallelism: the blocks' weight gradients
    /// are deferred to this store and computed at the weight-gradient actions.
    deferral: Option<(WeightGradStore, LinearHook)>,
    /// Mixture-of-experts stages: experts over ep.
    moe: Option<StageExperts>,
}

/// A pipeline rank's experts: how tokens reach them, and every layer's routing bias (all
/// stages' layers, updated from the loads summed over the pipeline, so any rank can save
/// them).
struct StageExperts {
    experts: ExpertParallel,
    hook: MoeHook,
    bias: Vec<Vec<f32>>,
    config: MoeConfig,
    /// Experts copied to every ep rank each step (`moe.replicate_hot`).
    replicate_hot: usize,
    /// The ranks reading different samples (`dp x fsdp x ep`): routing is summed over them.
    batch: Group,
}

impl StageExperts {
    /// The step's routing (summed over the samples and the stages) and the routing biases it
    /// moves, set on this rank's `chunks`.
    fn after_step(
        &mut self,
        pp: &Group,
        chunks: &mut [TransformerStage],
        d_model: usize,
    ) -> Result<MoeRecord, RankError> {
        let stats = self.hook.take_stats();
        let remote = self.experts.traffic().take();
        let shape = [self.bias.len(), self.config.n_experts];
        let routing = RoutingSums::over(stats, remote, shape, &[&self.batch, pp])?;
        for (bias, counts) in self.bias.iter_mut().zip(&routing.routed) {
            update_expert_bias(bias, counts, &self.config);
        }
        for chunk in chunks.iter() {
            let layers = chunk.first_block..chunk.first_block + chunk.blocks.len();
            self.experts
                .record_loads(&chunk.blocks, &routing.routed[layers]);
        }
        self.set_bias(chunks);
        Ok(routing.record(d_model))
    }

    /// Every MoE layer of `chunks` gets its routing bias from the table.
    fn set_bias(&self, chunks: &mut [TransformerStage]) {
        for chunk in chunks {
            let first = chunk.first_block;
            for (i, block) in chunk.blocks.iter_mut().enumerate() {
                if let Some(moe) = block.moe.as_mut() {
                    moe.expert_bias = self.bias[first + i].clone();
                }
            }
        }
    }
}

impl PipelineState {
    /// The parameters this rank steps with their placements, laid out as its gradient.
    fn stepped_entries(&self) -> Result<Vec<(ParamSlot, ParamPlacement)>, RankError> {
        self.optim.entries(&self.placements, &self.chunks)
    }
}

/// Every block of this rank's chunks (the hot-expert copies are keyed by their layer's router).
fn stage_blocks(chunks: &[TransformerStage]) -> Vec<Block> {
    chunks
        .iter()
        .flat_map(|c| c.blocks.iter().cloned())
        .collect()
}

/// A virtual stage's parameters in layout order: whole-model name (`None` for a tied copy)
/// and length.
type StageNames = Vec<(Option<String>, usize)>;

/// Per virtual stage, its parameters' whole-model names and whole lengths. Stages are cut from
/// `skeleton`, the model in its whole structure (tp shares, every expert): its structure names
/// the parameters, and `placements` (by the ids the cut keeps) gives the whole length of a
/// tensor-parallel share. The tied head's copy is a new parameter (`None`: reported once, as
/// the embedding, whose length it has).
fn stage_names(
    skeleton: &Transformer,
    placements: &PlacementTable,
    stages: usize,
    counts: &[usize],
) -> Result<Vec<StageNames>, RankError> {
    let names = PlacementTable::whole(skeleton);
    let whole_len = |id, numel| {
        placements
            .get(id)
            .map_or(numel, |e| e.global_shape.iter().product::<usize>())
    };
    let embed = &skeleton.embed.weight;
    let embed_len = whole_len(embed.id, embed.val().dims().iter().product());
    (0..stages)
        .map(|stage| {
            let cut = TransformerStage::cut(skeleton, stage, counts)?;
            Ok(ParamLayout::of(&cut)
                .slots
                .into_iter()
                .map(|s| match names.get(s.id) {
                    Some(e) => (Some(e.name.clone()), whole_len(s.id, s.numel)),
                    None => (None, embed_len),
                })
                .collect())
        })
        .collect()
}

/// Records that `chunk`'s parameters are this pipeline rank's own (other stages hold other
/// blocks), and that a tied head is a copy of `local`'s embedding, which the first stage holds.
fn place_stage(
    placements: &mut PlacementTable,
    chunk: &TransformerStage,
    local: &Transformer,
) -> Result<(), RankError> {
    let embed = local.embed.weight.id;
    if let Some(copy) = &chunk.tied_head {
        let mut entry = placements
            .get(embed)
            .cloned()
            .ok_or("the embedding has no placement")?;
        entry.tie = Tie::Copy;
        placements.insert(copy.id, entry);
    }
    for slot in ParamLayout::of(chunk).slots {
        placements.own(slot.id, Axis::Pp)?;
    }
    if chunk.embed.is_some() && local.head.is_none() {
        placements.tie(embed, Tie::Original)?;
    }
    Ok(())
}

impl RankStrategy for PipelineState {
    fn step(
        mut self: Box<Self>,
        ctx: &RankContext,
        clip: Option<f32>,
        batches: Batches<'_>,
        micro_batches: usize,
        lr: f64,
        precision: &mut Precisions,
    ) -> Result<(Box<dyn RankStrategy>, StepOutcome), RankError> {
        let outcome = pipeline_step(ctx, &mut self, clip, batches, micro_batches, lr, precision)?;
        Ok((self, outcome))
    }

    fn local_state(
        &self,
        ctx: &RankContext,
        _grad_group: &Group,
    ) -> Result<SharedState, RankError> {
        self.optim.local_state(ctx, &self.chunks, &self.placements)
    }

    fn restore(&mut self, state: LocalState) -> Result<(), RankError> {
        let chunks = std::mem::take(&mut self.chunks);
        self.chunks = self.optim.restore(state, chunks)?;
        Ok(())
    }

    fn moe_bias(&self) -> Option<Vec<Vec<f32>>> {
        self.moe.as_ref().map(|moe| moe.bias.clone())
    }

    fn set_moe_bias(&mut self, bias: &[Vec<f32>]) -> Result<(), RankError> {
        let Some(moe) = self.moe.as_mut() else {
            return Ok(());
        };
        super::routing_bias_layers(bias.len(), moe.bias.len())?;
        moe.bias = bias.to_vec();
        moe.set_bias(&mut self.chunks);
        Ok(())
    }

    fn full_params(&self, ctx: &RankContext) -> Result<Vec<(String, Vec<f32>)>, RankError> {
        gather_pipeline_params(ctx, self)
    }
}

/// One pipeline step: the schedule over every micro-batch, gradients averaged over `dp`
/// replicas, clipped by the global norm over every stage, then AdamW on this rank's chunks.
fn pipeline_step(
    ctx: &RankContext,
    state: &mut PipelineState,
    clip: Option<f32>,
    batches: Batches<'_>,
    micro_batches: usize,
    lr: f64,
    precision: &mut Precisions,
) -> Result<StepOutcome, RankError> {
    let pp = ctx.group(Axis::Pp);
    let before = ctx.comm_stats();
    let data: Vec<_> = (0..micro_batches).map(&mut *batches).collect();
    let device = data[0].0.device();
    let policy = precision.policy;
    state.chunks = state.optim.for_step(std::mem::take(&mut state.chunks))?;
    let mut executor = PipelineExecutor::new(&state.schedule, pp)?
        .with_activation_dtype(policy.param_dtype.float_dtype().into())
        .with_loss_scale(precision.scaler.scale());
    let mut hook = None;
    if let Some((store, linear)) = &state.deferral {
        executor = executor.deferring_weight_grads(store.clone());
        hook = Some(linear.clone());
    }
    let moe = state.moe.as_ref().map(|m| m.hook.clone());
    let a2a_before = state.moe.as_ref().map(|m| m.experts.group().stats());
    // Hot experts copied to every ep rank for this step; their copies' gradients are taken
    // from each backward and folded into the owners' below.
    let hot = state.moe.as_ref().filter(|m| m.replicate_hot > 0);
    // The step's blocks (the chunks stay as they are until the optimizer step).
    let hot_blocks = hot.map(|_| stage_blocks(&state.chunks));
    if let (Some(moe), Some(blocks)) = (hot, &hot_blocks) {
        moe.experts.replicate_hot(blocks, moe.replicate_hot)?;
    }
    let take = |grads: &mut Gradients| {
        if let Some(moe) = hot {
            moe.experts.take_replica_grads(grads);
        }
    };
    executor = executor.taking_gradients(&take);
    let (grads, report) = executor.step(
        &state.chunks,
        state.shape,
        &device,
        |_, stage: &TransformerStage, input, micro| {
            let (tokens, targets, mut fwd) = data[micro].clone();
            fwd.linear = hook.clone();
            fwd.moe = moe.clone();
            let out = policy
                .compute_view(stage.clone())
                .forward(input, tokens, targets, &fwd);
            // The routers' auxiliary losses of this forward stay with this stage's backward.
            StageOutput::with_aux_loss(out, moe.as_ref().and_then(MoeHook::take_aux_loss))
        },
    )?;
    // A zero-bubble schedule whose weight gradients were not deferred would silently be 1F1B.
    if state.deferral.is_some() && report.deferred_weight_grads == 0 {
        return Err(RankError::from(
            "zero-bubble schedule: no weight gradient was deferred to the weight-gradient \
             actions (the stages' linear layers bypassed the deferral hook)",
        ));
    }
    // One flat gradient over this rank's chunks, averaged over replicas.
    let mut flat = vec![0.0f32; state.layouts.iter().map(|l| l.numel).sum()];
    let mut at = 0;
    for ((chunk, g), layout) in state.chunks.iter().zip(&grads).zip(&state.layouts) {
        accumulate_grads(chunk, g, &mut flat[at..at + layout.numel], &[]);
        at += layout.numel;
    }
    drop(grads);
    let numel = flat.len();
    if let (Some(moe), Some(blocks)) = (hot, &hot_blocks) {
        // The copies' gradients are loss-scaled sums over micro-batches; the executor's are
        // averaged and unscaled.
        let mut replicas = vec![0.0f32; numel];
        moe.experts
            .fold_replica_grads(&state.chunks, blocks, &mut replicas)?;
        let k = 1.0 / (micro_batches as f32 * precision.scaler.scale());
        flat.iter_mut()
            .zip(&replicas)
            .for_each(|(g, r)| *g += r * k);
    }
    // Under ZeRO each rank keeps the sum of its own rows over the shard axis.
    let mut flat = state.optim.own_grads(flat, state.reducer.reduce_dtype())?;
    // Sum over the (other) data-parallel ranks and the tied copies over their stages; the
    // executor averaged over micro-batches already.
    let entries = state.stepped_entries()?;
    let entries = borrowed(&entries);
    let scale = match state.average {
        true => 1.0 / state.data_ranks as f32,
        false => micro_batches as f32,
    };
    state
        .reducer
        .reduce(&entries, &mut flat, scale, state.tie.as_ref())?;
    let grad_norm = clip_placed(&entries, &mut flat, clip, ctx)?;
    drop(entries);
    let (update, loss_scale) = precision.decide(grad_norm);
    let chunks = std::mem::take(&mut state.chunks);
    state.chunks = state.optim.step(lr, chunks, &flat, update)?;
    let (routing, a2a) = match (&mut state.moe, a2a_before) {
        (Some(moe), Some(before)) => {
            let record = moe.after_step(pp, &mut state.chunks, state.shape[2])?;
            let a2a = moe.experts.group().stats().since(&before).total();
            (Some(record), a2a.wait + a2a.transfer)
        }
        _ => (None, Duration::ZERO),
    };
    // Only the last stage computed losses: share them along the pipeline.
    let mut loss = [report.loss_sum];
    pp.all_reduce(&mut loss, ReduceOp::Sum)?;
    let comm = ctx.comm_stats().since(&before).total();
    let comm = comm.wait + comm.transfer;
    let (params, held) = state.optim.held(numel);
    Ok(StepOutcome {
        loss_sum: loss[0],
        grad_norm,
        comm,
        overlapped: Duration::ZERO,
        memory: MemoryReport {
            params: params * 4,
            grads: held * 4,
            optimizer: held * 8,
            // Under ZeRO-3 the chunks are gathered for the whole step.
            gathered_peak: if params < numel { numel * 4 } else { 0 },
        },
        moe: routing,
        a2a,
        loss_scale,
        skipped: !update,
        ..StepOutcome::new(0.0, 0.0)
    }
    .scheduled(report))
}

/// Every stage's parameters, named as in the whole model, gathered to world rank 0.
fn gather_pipeline_params(
    ctx: &RankContext,
    state: &PipelineState,
) -> Result<Vec<(String, Vec<f32>)>, RankError> {
    let pp = ctx.group(Axis::Pp);
    // Whole weights first (collective over tp when the stages are split, and over the shard
    // axis under ZeRO-3).
    let mut whole = state
        .optim
        .whole(&state.chunks)?
        .iter()
        .map(|c| c.unshard())
        .collect::<Result<Vec<_>, _>>()?;
    // Every expert (collective over ep).
    if let Some(moe) = &state.moe {
        for stage in &mut whole {
            moe.experts.gather_block_experts(&mut stage.blocks)?;
        }
    }
    let mine: Vec<f32> = whole.iter().flat_map(flatten_params).collect();
    let mut longest = [mine.len() as u64];
    pp.all_reduce(&mut longest, ReduceOp::Max)?;
    let mut padded = mine;
    padded.resize(longest[0] as usize, 0.0);
    let all = pp.all_gather_vec(&padded)?;
    if ctx.rank() != 0 {
        return Ok(vec![]);
    }
    let s = &state.schedule;
    let mut named = vec![];
    for (rank, values) in all.chunks(longest[0] as usize).enumerate() {
        let mut at = 0;
        for chunk in 0..s.chunks {
            for (name, numel) in &state.stage_params[s.stage_of(rank, chunk)] {
                // The tied head's copy is the embedding: reported once, as `embed.weight`.
                if let Some(name) = name {
                    named.push((name.clone(), values[at..at + numel].to_vec()));
                }
                at += numel;
            }
        }
    }
    // In the whole model's order, so reports compare name by name.
    let order = &state.order;
    named.sort_by_key(|(name, _)| order.iter().position(|n| n == name).unwrap_or(usize::MAX));
    Ok(named)
}

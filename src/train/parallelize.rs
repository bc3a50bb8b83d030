//! From one rank's seeded copy of the reference transformer to what the rank holds and runs:
//! every model transform in one place, applied in one fixed order.
//!
//! Each transform reads the mesh and the job, changes the model or installs a hook at one of
//! the forward's dispatch points (`flashover_models::ForwardContext`), and records in the
//! placement table where each parameter it splits or owns now lives. None asks which others
//! ran: the later ones read the table and the (possibly split) model they are handed.
//!
//! | # | transform | here | what it records or installs |
//! |---|---|---|---|
//! | 1 | tensor (+ sequence) parallel; under ZeRO-3 in units, fully shard in the same pass | [`tensor_parallel`] | `Shard` over tp, rows over fsdp |
//! | 2 | expert parallel | the model's plan (`expert_parallel`), `strategy::plan_pipeline` | `Own` over ep |
//! | 3 | pipeline split | the model's plan with a pipeline rule, `strategy::plan_pipeline` | `Own` over pp, the tied head's copy |
//! | 4 | context parallel | [`context_parallel`] | attention hook, sequence positions |
//! | 5 | activation checkpointing | [`activation_checkpointing`] | block hook, or Burn's balanced checkpointing on the device |
//! | 6 | mixed precision | `strategy::Precisions` | compute view of the parameters, loss scale |
//! | 7 | fully sharded units (cut in 1) or replicated data parallel | `strategy::{fsdp, replicated, zero, rows}` | ZeRO by rows: `Shard` over fsdp or dp |
//! | 8 | optimizer | with 7 | AdamW moments where their parameters' rows are |
//!
//! A job with a `pp` axis or a mixture of experts takes none of this module's steps: the
//! reference model's plan, with a pipeline rule cut from `[parallel]` (one stage without
//! `pp`), applies them all at once (`strategy::plan_pipeline`), as a user's own model gets
//! them. Steps 7-8 are how a step executes (unit gathers, bucket
//! hooks), so they live with the `RankStrategy` that executes it.

use super::config::TrainConfig;
use super::tp_model::TpTransformer;
use burn::tensor::Device;
use flashover_models::{CheckpointHook, Transformer, TransformerConfig};
use flashover_parallel::activation_checkpointing::BlockRecompute;
use flashover_parallel::context_parallel::ContextParallel;
use flashover_parallel::placement::PlacementTable;
use flashover_parallel::tensor_parallel::TensorParallel;
use flashover_parallel::zero::ShardGroup;
use flashover_runtime::{Axis, RankContext, RankError};
use std::sync::Arc;

/// What a rank holds of the model after the parameter transforms (1 and 2), with the table
/// of where each parameter lives.
pub(crate) enum Shares {
    /// The whole model (no tp axis).
    Whole(Box<Transformer>, PlacementTable),
    /// This rank's tensor-parallel shares (they carry their table).
    Split(Box<TpTransformer>),
}

impl Shares {}

/// A rank's model after the parameter transforms.
pub(crate) struct RankModel {
    pub shares: Shares,
}

/// Transform 1 on `model` (this rank's seeded initialisation) of a dense model without
/// pipeline stages: tensor parallelism (the plan does the rest,
/// `strategy::plan_pipeline`).
pub(crate) fn parallelize(
    ctx: &RankContext,
    config: &TrainConfig,
    model_config: &TransformerConfig,
    model: Transformer,
) -> Result<RankModel, RankError> {
    let placements = PlacementTable::whole(&model);
    let shares = tensor_parallel(ctx, config, model_config, model, placements)?;
    Ok(RankModel { shares })
}

/// 1. Megatron's tensor parallelism over `tp` (attention by heads, the MLP by its hidden
///    dimension, embedding and head by vocabulary), with sequence parallelism when the job
///    asks, through the model's plan; under ZeRO-3 in units
///    (`TrainConfig::zero3_in_units`) the same pass cuts every part by rows over `fsdp`
///    (`fully_shard("")`: one unit per block and one for the rest). The job's
///    `[parallelize]` table replaces the model's own plan (`TrainConfig::model_plan`). The
///    model as it is without either.
pub(crate) fn tensor_parallel(
    ctx: &RankContext,
    config: &TrainConfig,
    model_config: &TransformerConfig,
    model: Transformer,
    placements: PlacementTable,
) -> Result<Shares, RankError> {
    let tp = ctx.group(Axis::Tp);
    // ZeRO-3 in units (step 7) cuts rows in the same pass, through the model's plan.
    let units = config.zero3_in_units(ctx.mesh()).then(|| {
        let precision = &config.precision;
        ShardGroup::with_precision(
            ctx.group(Axis::Fsdp),
            precision.param_dtype,
            precision.reduce_dtype,
        )
    });
    if tp.size() == 1 && units.is_none() {
        return Ok(Shares::Whole(Box::new(model), placements));
    }
    let plan = config.model_plan(model_config, ctx.mesh())?;
    let tp = TensorParallel::new(tp).with_sequence_parallel(config.parallel.sequence_parallel);
    let shares = TpTransformer::shard_plan(model, &plan, &tp, placements, units.as_ref())?;
    Ok(Shares::Split(Box::new(shares)))
}

/// 4. Context parallelism over `cp`: which positions of every sequence this rank keeps and the
///    attention that reaches the others' keys and values (installed per micro-batch in the
///    forward context). `None` without a cp axis.
pub(crate) fn context_parallel(
    ctx: &RankContext,
    config: &TrainConfig,
    model_config: &TransformerConfig,
) -> Result<Option<ContextParallel>, RankError> {
    let cp = ctx.group(Axis::Cp);
    if cp.size() == 1 {
        return Ok(None);
    }
    let local_heads = model_config.n_heads / ctx.group(Axis::Tp).size();
    Ok(Some(ContextParallel::new(
        cp,
        config.data.seq_len,
        config.parallel.cp_attention,
        config.parallel.cp_load_balance,
        local_heads,
    )?))
}

/// Block-level recomputation and the forward-context hook that runs it.
pub(crate) type Recompute = (Arc<BlockRecompute>, CheckpointHook);

/// 5. Activation checkpointing as the job's policy says: the autodiff device (with Burn's
///    balanced checkpointing under `selective`) and, for block-level policies, the hook that
///    recomputes the blocks it names.
pub(crate) fn activation_checkpointing(
    ctx: &RankContext,
    config: &TrainConfig,
) -> (Device, Option<Recompute>) {
    let policy = &config.parallel.activation_checkpointing;
    let device = match policy.is_selective() {
        true => ctx.device().clone().autodiff().gradient_checkpointing(),
        false => ctx.device().clone().autodiff(),
    };
    let recompute = policy.block_recompute().map(|r| {
        let hook = r.hook();
        (r, hook)
    });
    (device, recompute)
}

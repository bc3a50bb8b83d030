//! ZeRO by rows for the reference model a plan parallelized: this rank's rows of the
//! parameters it holds (its stages', its tensor-parallel parts) over one data axis, stepped
//! with AdamW. The plan reduces the gradients to those rows itself (`gradient_buckets.rows`:
//! all-reduced buckets under ZeRO-1, reduce-scattered ones under ZeRO-2 and ZeRO-3 by rows,
//! overlapped with backward where the schedule allows), clipped by the global norm. ZeRO-1/2
//! all-gather the updated rows after the step; ZeRO-3 (under zb-h1, whose deferred weight
//! gradients a plan's units cannot wait for, or with hot-expert copies) keeps only the rows
//! between steps and gathers what the rank holds at the start of each.

use super::SharedState;
use super::rows::RowSharding;
use crate::train::checkpoint::LocalState;
use crate::train::config::TrainConfig;
use flashover_models::Transformer;
use flashover_parallel::FlatAdamWConfig;
use flashover_parallel::parallelize::Parallelized;
use flashover_parallel::params::{
    ParamLayout, ParamSlot, flatten_params, load_shaped, placeholders,
};
use flashover_parallel::placement::PlacementTable;
use flashover_runtime::{RankContext, RankError};

/// See the module docs.
pub(super) struct HeldRows {
    rows: RowSharding,
    /// Per parameter this rank holds (layout order): where it sits in the model's flat values,
    /// and its length.
    held: Vec<(usize, usize)>,
    /// The model's parameters as the plan left them (other stages' as placeholders): what a
    /// ZeRO-3 step gathers the rows back into.
    shaped: ParamLayout,
    /// ZeRO-1/2: the model keeps what the rank holds between steps (ZeRO-3 only the rows).
    keep: bool,
}

impl HeldRows {
    /// The rows of what `model` (parallelized as `par` says, its gradients reduced to rows)
    /// holds on this rank, for ZeRO stage `config.parallel.zero`.
    pub(super) fn new(
        ctx: &RankContext,
        config: &TrainConfig,
        par: &Parallelized,
        model: &Transformer,
    ) -> Result<Self, RankError> {
        let shaped = ParamLayout::of(model);
        let flat = flatten_params(model);
        let mut layout = ParamLayout {
            slots: vec![],
            numel: 0,
        };
        let (mut held, mut values) = (vec![], vec![]);
        for (slot, _) in par.held_entries(model)? {
            held.push((slot.offset, slot.numel));
            values.extend_from_slice(&flat[slot.offset..slot.offset + slot.numel]);
            let offset = layout.numel;
            layout.numel += slot.numel;
            layout.slots.push(ParamSlot { offset, ..slot });
        }
        let adamw = FlatAdamWConfig::new().with_weight_decay(config.optim.weight_decay as f32);
        let rows = RowSharding::over(ctx, layout, &values, config.parallel.zero, &adamw);
        // The plan hands this rank its rows of the reduced gradients in the same cut.
        let plan_rows = par
            .gradient_rows()
            .map_or(values.len(), |r| r.shards.shard_len());
        if plan_rows != rows.held().1 {
            return Err(RankError::from(format!(
                "ZeRO rows: the plan reduces {plan_rows} gradient elements to this rank, its \
                 optimizer steps {}",
                rows.held().1
            )));
        }
        Ok(HeldRows {
            rows,
            held,
            shaped,
            keep: config.parallel.zero != 3,
        })
    }

    /// AdamW on this rank's rows from `grads`, its rows of the reduced and clipped gradients
    /// (when `update`: the step did not overflow), then `model` as it is kept between steps:
    /// the updated rows gathered back into it (ZeRO-1/2, collective) or its structure only.
    pub(super) fn step(
        &mut self,
        model: Transformer,
        grads: &[f32],
        lr: f64,
        update: bool,
    ) -> Result<Transformer, RankError> {
        self.rows.step_rows(lr, grads, update);
        match self.keep {
            true => self.gathered(model),
            false => Ok(self.between_steps(model)),
        }
    }

    /// `model` as it is kept between steps: as it is (ZeRO-1/2), or its structure only.
    pub(super) fn between_steps(&self, model: Transformer) -> Transformer {
        match self.keep {
            true => model,
            false => placeholders(model),
        }
    }

    /// `model` for a step: gathered from the rows under ZeRO-3 (collective), as it is
    /// otherwise.
    pub(super) fn for_step(&self, model: Transformer) -> Result<Transformer, RankError> {
        match self.keep {
            true => Ok(model),
            false => self.gathered(model),
        }
    }

    /// `model` with the parameters this rank holds gathered from every rank's rows, the others
    /// the plan's placeholders (collective).
    fn gathered(&self, model: Transformer) -> Result<Transformer, RankError> {
        let values = self.rows.gather_values()?;
        let mut flat = vec![0.0; self.shaped.numel];
        let mut at = 0;
        for &(offset, len) in &self.held {
            flat[offset..offset + len].copy_from_slice(&values[at..at + len]);
            at += len;
        }
        Ok(load_shaped(model, &self.shaped, &flat))
    }

    /// Bytes gathered for a step beyond what is kept between steps (ZeRO-3's whole stages).
    pub(super) fn gathered_bytes(&self) -> usize {
        match self.keep {
            true => 0,
            false => self.held.iter().map(|(_, len)| len).sum::<usize>() * 4,
        }
    }

    /// This rank's rows and moments for a checkpoint.
    pub(super) fn local_state(
        &self,
        ctx: &RankContext,
        placements: &PlacementTable,
    ) -> Result<SharedState, RankError> {
        self.rows.local_state(ctx, placements)
    }

    /// Puts checkpointed rows back; `model` with them, as kept between steps (collective
    /// under ZeRO-1/2).
    pub(super) fn restore(
        &mut self,
        state: LocalState,
        model: Transformer,
    ) -> Result<Transformer, RankError> {
        self.rows.restore_rows(state)?;
        match self.keep {
            true => self.gathered(model),
            false => Ok(model),
        }
    }

    /// Elements held between steps: (parameters, gradients and moments).
    pub(super) fn held(&self) -> (usize, usize) {
        self.rows.held()
    }
}

//! ZeRO by rows for the reference model a plan parallelized: this rank's rows of the
//! parameters it holds (its stages', its tensor-parallel parts) over one data axis, stepped
//! with AdamW. ZeRO-1/2 all-gather the updated rows after the step; ZeRO-3 (under zb-h1,
//! whose deferred weight gradients a plan's units cannot wait for) keeps only the rows between
//! steps and gathers what the rank holds at the start of each. The job reduces the plan's unreduced gradients itself, as the
//! trainer's own stages do (the communication of data parallelism, not more): reduce-scattered
//! over the rows' axis, summed over the other axes the placements name (and the tied
//! embedding's copies over their two stages), clipped by the global norm. Under loss scaling
//! the plan scaled each micro-batch's loss by the job's running scale and unscaled the
//! gradients; the job decides an overflow from the reduced norm.

use super::rows::RowSharding;
use super::{Precisions, SharedState, borrowed, clip_placed};
use crate::train::checkpoint::LocalState;
use crate::train::config::{GradientReduction, TrainConfig};
use flashover_models::Transformer;
use flashover_parallel::FlatAdamWConfig;
use flashover_parallel::parallelize::Parallelized;
use flashover_parallel::params::{
    ParamLayout, ParamSlot, flatten_params, load_shaped, placeholders,
};
use flashover_parallel::placement::{GradientReducer, PlacementTable};
use flashover_runtime::{Group, RankContext, RankError};

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
    reducer: GradientReducer,
    /// Gradients are means over the ranks reading different samples (sums otherwise).
    average: bool,
    /// Those ranks (`dp x fsdp x ep x cp`).
    data_ranks: usize,
}

impl HeldRows {
    /// The rows of what `model` (parallelized as `par` says) holds on this rank, for ZeRO
    /// stage `config.parallel.zero`; `grad_group`: the ranks reading different samples.
    pub(super) fn new(
        ctx: &RankContext,
        config: &TrainConfig,
        par: &Parallelized,
        model: &Transformer,
        grad_group: &Group,
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
        Ok(HeldRows {
            rows,
            held,
            shaped,
            keep: config.parallel.zero != 3,
            reducer: GradientReducer::new(ctx, config.precision.reduce_dtype)?,
            average: config.parallel.gradient_reduction == GradientReduction::Mean,
            data_ranks: grad_group.size(),
        })
    }

    /// One optimizer step of `model` from `grads`, this rank's gradients in the model's flat
    /// layout (averaged over its `micro_batches`, not yet reduced): reduced, clipped to `clip`,
    /// AdamW on the rows unless the loss scale overflowed, the rows gathered back into the
    /// model (collective). Returns the model, the global norm before clipping, whether the
    /// step applied and its loss scale.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn step(
        &mut self,
        ctx: &RankContext,
        par: &Parallelized,
        model: Transformer,
        grads: &[f32],
        micro_batches: usize,
        (clip, lr): (Option<f32>, f64),
        precision: &mut Precisions,
    ) -> Result<(Transformer, f32, bool, Option<f32>), RankError> {
        let held: Vec<f32> = self
            .held
            .iter()
            .flat_map(|&(offset, len)| grads[offset..offset + len].iter().copied())
            .collect();
        let mut own = self
            .rows
            .reduce_scatter(&held, self.reducer.reduce_dtype())?;
        let entries = self.rows.entries(par.placements())?;
        let entries = borrowed(&entries);
        let scale = match self.average {
            true => 1.0 / self.data_ranks as f32,
            false => micro_batches as f32,
        };
        // The tied embedding's copies summed over the two stages holding them, as the plan does.
        self.reducer
            .reduce(&entries, &mut own, scale, par.tied_copies())?;
        let norm = clip_placed(&entries, &mut own, clip, ctx)?;
        let (update, loss_scale) = precision.decide(norm);
        self.rows.step_rows(lr, &own, update);
        let model = match self.keep {
            true => self.gathered(model)?,
            false => self.between_steps(model),
        };
        Ok((model, norm, update, loss_scale))
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

//! The plan's side of ZeRO-1/2: [`RowAdamW`] built from what a [`Parallelized`] knows (its
//! gradient rows, the parameters this rank holds), so the optimizer itself needs only a row
//! layout.

use super::{Parallelized, grad_device};
use crate::error::ParallelError;
use crate::flat_adamw::FlatAdamWConfig;
use crate::zero::RowAdamW;
use burn::module::Module;
use flashover_runtime::RankContext;

impl RowAdamW {
    /// AdamW (`config`) on this rank's rows of `model`'s parameters, as `par` (a plan with
    /// `gradient_buckets.rows`) cuts them; `keep_params`: ZeRO-1/2 (the model keeps its
    /// parameters), or ZeRO-3 by rows (only the rows stay between steps:
    /// [`Self::between_steps`], [`Self::for_step`]). Fails when the plan keeps no rows.
    pub fn new<M: Module>(
        par: &Parallelized,
        model: &M,
        config: &FlatAdamWConfig,
        keep_params: bool,
        ctx: &RankContext,
    ) -> Result<Self, ParallelError> {
        let rows = par.reducer().rows().ok_or_else(|| {
            ParallelError::Invalid(
                "RowAdamW steps the rows of the gradients a plan reduces to rows: set the plan's \
                 gradient_buckets.rows"
                    .into(),
            )
        })?;
        let held = (par.sharded().held_entries(model)?.iter())
            .map(|(slot, _)| (slot.offset, slot.numel))
            .collect();
        let group = ctx.group(rows.axis).clone();
        let device = grad_device(model, ctx);
        Ok(RowAdamW::from_rows(
            rows,
            held,
            model,
            config,
            keep_params,
            group,
            &device,
        ))
    }
}

//! ZeRO-1/2 over the data axes: replicas whose AdamW state (and with stage 2, gradients) is cut
//! over the gradient buckets; after the step one all-gather refreshes the replicas.

use super::{
    Batches, Precisions, RankStrategy, SharedState, StepOutcome, named_params, restore_flat,
    run_micro_batches, with_moments,
};
use crate::train::checkpoint::{LocalState, run_segments, whole_segments};
use crate::train::config::TrainConfig;
use burn::module::Module;
use flashover_models::Transformer;
use flashover_parallel::FlatAdamWConfig;
use flashover_parallel::data_parallel::DataParallelConfig;
use flashover_parallel::params::{ParamLayout, flatten_params};
use flashover_parallel::zero::{ShardedDataParallel, ZeroConfig};
use flashover_runtime::{Group, RankContext, RankError};

/// A replica and its sharded optimizer; see the module docs.
struct Zero {
    model: Box<Transformer>,
    sharded: ShardedDataParallel,
}

/// ZeRO stage `config.parallel.zero` (1 or 2) over `grad_group`.
pub(super) fn build(
    config: &TrainConfig,
    model: Transformer,
    grad_group: &Group,
    ddp: DataParallelConfig,
    adamw: FlatAdamWConfig,
) -> Result<Box<dyn RankStrategy>, RankError> {
    let mut zero = ZeroConfig::stage(config.parallel.zero as usize, adamw)?;
    zero.data_parallel = ddp;
    let (model, sharded) = zero.init(model, grad_group)?;
    Ok(Box::new(Zero {
        model: Box::new(model),
        sharded,
    }))
}

impl RankStrategy for Zero {
    fn step(
        self: Box<Self>,
        _ctx: &RankContext,
        clip: Option<f32>,
        batches: Batches<'_>,
        micro_batches: usize,
        lr: f64,
        precision: &mut Precisions,
    ) -> Result<(Box<dyn RankStrategy>, StepOutcome), RankError> {
        let Zero { model, mut sharded } = *self;
        sharded
            .data_parallel_mut()
            .set_loss_scale(precision.scaler.scale());
        let loss_sum = run_micro_batches(&mut sharded, &*model, batches, micro_batches, precision)?;
        let report = sharded.reduce(clip)?;
        let mut outcome = StepOutcome::reduced(loss_sum, &report, Default::default());
        let update = precision.apply(&mut outcome);
        let model = Box::new(sharded.apply(lr, *model, update)?);
        outcome.memory = sharded.memory();
        Ok((Box::new(Zero { model, sharded }), outcome))
    }

    fn buckets(&self) -> (usize, bool) {
        let ddp = self.sharded.data_parallel();
        (ddp.num_buckets(), ddp.overlaps())
    }

    fn local_state(
        &self,
        _ctx: &RankContext,
        grad_group: &Group,
    ) -> Result<SharedState, RankError> {
        let same = |name: &str| name.to_string();
        let everyone = (grad_group.rank(), grad_group.size());
        let layout = ParamLayout::of(&*self.model);
        let segments = whole_segments(&layout, same);
        let optim = self.sharded.optimizer();
        let mut state = with_moments(flatten_params(&*self.model), segments, optim.flat());
        let runs = optim.shard_map().runs(grad_group.rank());
        state.moment_segments =
            run_segments(&layout, runs.iter().map(|r| (r.flat, r.len)), 0, same);
        // Parameters are replicated; moments are this rank's own shard.
        Ok((state, everyone, (0, 1)))
    }

    fn restore(&mut self, state: LocalState) -> Result<(), RankError> {
        *self.model = restore_flat(
            (*self.model).clone(),
            state,
            self.sharded.optimizer_mut().flat_mut(),
        )?;
        Ok(())
    }

    fn full_params(&self, _ctx: &RankContext) -> Result<Vec<(String, Vec<f32>)>, RankError> {
        Ok(named_params(&self.model.clone().valid()))
    }
}

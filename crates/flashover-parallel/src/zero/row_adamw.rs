//! ZeRO-1/2 on a plan: AdamW on this rank's rows of the parameters it holds, each cut along its
//! first dimension over `fsdp` (or `dp` without it) as [`UnitShards`] cuts it, stepped with the
//! rows of the reduced gradients the plan hands this rank under `gradient_buckets.rows`
//! ([`crate::parallelize::Parallelized::row_gradients`], or a pipeline step's rows). After the
//! step the updated rows are all-gathered back into the model (ZeRO-1/2), or the model keeps
//! only its structure between steps and is gathered at the start of the next (ZeRO-3 by rows:
//! what a pipeline does when its schedule or its expert copies rule the plan's units out).

use crate::data_parallel::GradientRowLayout;
use crate::error::ParallelError;
use crate::flat_adamw::{FlatAdamW, FlatAdamWConfig};
use crate::params::{
    ParamLayout, ParamSlot, load_shaped, params_on_device, part, placeholders, to_f32, upload,
};
use crate::placement::{ParamPlacement, PlacementTable};
use crate::unit_shards::UnitShards;
use burn::module::Module;
use burn::tensor::{Device, Tensor};
use flashover_comm::Group;
use flashover_runtime::{Axis, TensorCollectives};

/// AdamW on this rank's rows; see the module docs.
///
/// ```text
/// let buckets = GradientBuckets::default().rows(GradientRows::ReduceScatter); // ZeRO-2
/// let (model, par) = parallelize(model, &plan.gradient_buckets(buckets), &ctx)?;
/// let mut optim = RowAdamW::new(&par, &model, &FlatAdamWConfig::new(), true, &ctx)?;
/// let mut model = optim.between_steps(model);
/// // each step: the plan reduces the gradients to this rank's rows, AdamW steps them
/// model = optim.for_step(model)?;
/// let loss = par.forward(&model, |m| loss_of(m, &batch))?;
/// let (rows, norm) = par.row_gradients(&model, par.backward(loss), Some(1.0), &ctx)?;
/// let update = rows.dims()[0] > 0; // empty on a step whose scaled gradients overflowed
/// model = optim.step(lr, model, rows, update)?;
/// // a pipelined plan: `par.pipeline()?.step(..)?`, its rows in `PipelineStep::rows`
/// ```
pub struct RowAdamW {
    axis: Axis,
    group: Group,
    /// The parameters this rank holds, laid end to end.
    layout: ParamLayout,
    /// Their cut over the axis.
    shards: UnitShards,
    /// Per held parameter: its offset and length in the model's flat layout.
    held: Vec<(usize, usize)>,
    /// The model's whole layout (other ranks' parameters as placeholders): what the gathered
    /// rows are loaded back into.
    shaped: ParamLayout,
    /// This rank's rows of every held parameter, on the parameters' device.
    own: Tensor<1>,
    adam: FlatAdamW,
    /// The model keeps its parameters between steps (ZeRO-1/2); otherwise only its rows.
    keep_params: bool,
}

impl RowAdamW {
    /// AdamW (`config`) on this rank's rows (over `group`, the rows' axis) of the parameters
    /// of `model` it holds, cut as `rows` lays them out; `held`: each held parameter's offset
    /// and length in `model`'s flat layout; `keep_params` as [`Self::new`] says (which builds
    /// it from a plan).
    pub(crate) fn from_rows<M: Module>(
        rows: &GradientRowLayout,
        held: Vec<(usize, usize)>,
        model: &M,
        config: &FlatAdamWConfig,
        keep_params: bool,
        group: Group,
        device: &Device,
    ) -> Self {
        let GradientRowLayout {
            axis,
            layout,
            shards,
            ..
        } = rows;
        let shaped = ParamLayout::of(model);
        let flat = params_on_device(model).unwrap_or_else(|| Tensor::zeros([0], device));
        let values = match held.is_empty() {
            true => Tensor::zeros([0], device),
            false => Tensor::cat(held.iter().map(|&(o, n)| part(&flat, o, n)).collect(), 0),
        };
        let own = shards.take(group.rank(), &values);
        RowAdamW {
            axis: *axis,
            adam: FlatAdamW::new(config, shards.shard_len()),
            group,
            layout: layout.clone(),
            shards: shards.clone(),
            held,
            shaped,
            own,
            keep_params,
        }
    }

    /// AdamW on this rank's rows from `grads` (its rows of the reduced gradients on the
    /// device, as the plan lays them out; stepped on host copies, read here) when `update`
    /// (not on a step whose scaled gradients overflowed: its `grads` are then empty and left
    /// unread), then
    /// `model` as it is kept between steps: the updated rows gathered back into it
    /// (collective), or its structure only.
    pub fn step<M: Module>(
        &mut self,
        lr: f64,
        model: M,
        grads: Tensor<1>,
        update: bool,
    ) -> Result<M, ParallelError> {
        if update && grads.dims()[0] != self.own.dims()[0] {
            return Err(ParallelError::Invalid(format!(
                "RowAdamW: {} gradient rows for {} parameter rows (the plan's gradient_rows and \
                 this optimizer must come from the same parallelize)",
                grads.dims()[0],
                self.own.dims()[0]
            )));
        }
        if update {
            let own = std::mem::replace(&mut self.own, Tensor::zeros([0], &grads.device()));
            self.own = self.adam.step_tensor(lr, own, grads);
        }
        match self.keep_params {
            true => self.gathered(model),
            false => Ok(placeholders(model)),
        }
    }

    /// `model` as it is kept between steps: as it is (ZeRO-1/2), or its structure only.
    pub fn between_steps<M: Module>(&self, model: M) -> M {
        match self.keep_params {
            true => model,
            false => placeholders(model),
        }
    }

    /// `model` for a step: gathered from every rank's rows when only the rows are kept
    /// between steps (collective), as it is otherwise.
    pub fn for_step<M: Module>(&self, model: M) -> Result<M, ParallelError> {
        match self.keep_params {
            true => Ok(model),
            false => self.gathered(model),
        }
    }

    /// `model` with the parameters this rank holds gathered from every rank's rows
    /// (collective), the others left as the plan left them.
    fn gathered<M: Module>(&self, model: M) -> Result<M, ParallelError> {
        let gathered = self.group.all_gather_tensor(self.own.clone(), 0)?;
        let values = self.shards.assemble(gathered);
        // The model's layout: the held parameters' values, zeros for the placeholders between.
        let device = values.device();
        let zeros = |n: usize| Tensor::zeros([n], &device);
        let (mut pieces, mut end, mut at) = (vec![], 0, 0);
        for &(offset, len) in &self.held {
            if offset > end {
                pieces.push(zeros(offset - end));
            }
            pieces.push(part(&values, at, len));
            (at, end) = (at + len, offset + len);
        }
        if self.shaped.numel > end {
            pieces.push(zeros(self.shaped.numel - end));
        }
        let flat = match pieces.is_empty() {
            true => zeros(0),
            false => Tensor::cat(pieces, 0),
        };
        Ok(load_shaped(model, &self.shaped, &flat))
    }

    /// The axis the rows are cut over.
    pub fn axis(&self) -> Axis {
        self.axis
    }

    /// This rank's rows (padding included), laid out as the plan's gradient rows, read to the
    /// host (a checkpoint's).
    pub fn rows(&self) -> Vec<f32> {
        to_f32(self.own.clone())
    }

    /// The AdamW state of the rows.
    pub fn adam(&self) -> &FlatAdamW {
        &self.adam
    }

    /// This rank's rows as pieces of the parameters `placements` describes (each with its
    /// rows split over the axis): where each part belongs in the whole model.
    pub fn placed(
        &self,
        placements: &PlacementTable,
    ) -> Result<Vec<(ParamSlot, ParamPlacement)>, ParallelError> {
        self.shards.placed(&self.layout, placements, self.axis, 0)
    }

    /// Puts saved rows and their AdamW state back (as [`Self::rows`] and [`Self::adam`] gave
    /// them), then `model` as it is kept between steps (collective when it keeps its
    /// parameters).
    pub fn restore<M: Module>(
        &mut self,
        model: M,
        rows: Vec<f32>,
        steps_taken: i32,
        moments: [Vec<f32>; 2],
    ) -> Result<M, ParallelError> {
        let [m1, m2] = moments;
        self.adam
            .restore(steps_taken, m1, m2)
            .map_err(ParallelError::Invalid)?;
        let device: Device = self.own.device();
        self.own = upload(&rows, &device);
        match self.keep_params {
            true => self.gathered(model),
            false => Ok(model),
        }
    }

    /// Elements this rank keeps between steps: (parameters, gradients and each moment).
    pub fn held_elements(&self) -> (usize, usize) {
        match self.keep_params {
            true => (self.layout.numel, self.own.dims()[0]),
            false => (self.own.dims()[0], self.own.dims()[0]),
        }
    }

    /// Bytes gathered for a step beyond what is kept between steps (ZeRO-3 by rows: the
    /// parameters the rank holds).
    pub fn gathered_bytes(&self) -> usize {
        match self.keep_params {
            true => 0,
            false => self.layout.numel * 4,
        }
    }
}

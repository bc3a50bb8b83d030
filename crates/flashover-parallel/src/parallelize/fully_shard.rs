//! Fully sharded parameters on an unchanged model, through Burn's parameter
//! reparameterization: the stored parameter (its *base*) is this rank's rows of the whole
//! tensor, and [`Param::val`], which every Burn layer calls in its forward, all-gathers them.
//!
//! The gather is differentiable: its backward reduce-scatters (sums) the whole gradient over
//! `fsdp`, so each rank's base receives the gradient of its own rows, summed over the ranks
//! that computed with it, and any optimizer steps the shard (its state is shard-sized).
//!
//! Burn's autodiff keeps a gathered weight until its backward has used it (as FSDP's
//! `reshard_after_forward = false`): between steps a rank holds `1/fsdp` of the parameters,
//! gradients and optimizer state, during forward and backward also the gathered parameters.

use crate::error::ParallelError;
use crate::placement::PlacementTable;
use crate::tensor_parallel::comm::gather_from_sp;
use burn::module::{Module, Param, Reparameterization, Reparameterizer};
use burn::tensor::Tensor;
use flashover_comm::Group;
use flashover_runtime::Axis;

/// The reparameterization of one fully sharded parameter: all-gather the rows of `group` and
/// drop the padding past `rows`.
#[derive(Module, Debug)]
pub struct GatherRows {
    #[module(skip)]
    group: Group,
    /// Rows of the whole parameter (the gathered tensor may have padding past them).
    #[module(skip)]
    rows: usize,
}

impl Reparameterization for GatherRows {
    const NAME: &'static str = "fully_shard";

    fn apply<const D: usize>(&self, base: Tensor<D>) -> Tensor<D> {
        let whole = gather_from_sp(base, 0, &self.group);
        if whole.dims()[0] == self.rows {
            whole
        } else {
            whole.narrow(0, 0, self.rows)
        }
    }
}

/// Rows `rank * chunk .. (rank + 1) * chunk` of `t`'s first dimension, `chunk = ceil(rows /
/// n)`, zero rows past the end (so every rank's shard has the same shape).
fn own_rows<const D: usize>(t: Tensor<D>, rank: usize, n: usize) -> Tensor<D> {
    let rows = t.dims()[0];
    let chunk = rows.div_ceil(n);
    let start = (rank * chunk).min(rows);
    let end = ((rank + 1) * chunk).min(rows);
    let mut dims = t.dims();
    let mut parts = vec![];
    if end > start {
        parts.push(t.clone().narrow(0, start, end - start));
    }
    if end - start < chunk {
        dims[0] = chunk - (end - start);
        parts.push(Tensor::zeros(dims, &t.device()));
    }
    Tensor::cat(parts, 0)
}

/// Shards the parameters under the plan's `fully_shard` paths over `group` and records each in
/// `placements` (rows of dimension 0 over `fsdp`).
pub(super) struct ShardRows<'a> {
    pub(super) paths: &'a super::ParallelizePlan,
    pub(super) group: Group,
    pub(super) placements: &'a mut PlacementTable,
    pub(super) error: &'a mut Option<ParallelError>,
}

impl Reparameterizer for ShardRows<'_> {
    type Reparam = GatherRows;

    fn reparameterize<const D: usize>(
        &mut self,
        path: &str,
        param: Param<Tensor<D>>,
    ) -> (Param<Tensor<D>>, Option<GatherRows>) {
        let path = path
            .split('.')
            .filter(|s| !s.is_empty())
            .collect::<Vec<_>>()
            .join(".");
        if self.error.is_some() || self.paths.shard_path(&path).is_none() {
            return (param, None);
        }
        let (rank, n) = (self.group.rank(), self.group.size());
        let id = param.id;
        let mut rows = 0;
        let param = param.map(|t| {
            rows = t.dims()[0];
            let require_grad = t.is_require_grad();
            own_rows(t.detach(), rank, n)
                .detach()
                .set_require_grad(require_grad)
        });
        let local: Vec<usize> = param.val().dims().to_vec();
        if let Err(e) = self.placements.shard(id, id, Axis::Fsdp, 0, &local) {
            *self.error = Some(e);
        }
        let gather = GatherRows {
            group: self.group.clone(),
            rows,
        };
        (param, Some(gather))
    }
}

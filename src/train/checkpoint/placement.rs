//! Where each part of a rank's flat state belongs in the whole model ([`Segment`]), which
//! pieces a rank writes, and reading its regions back.

use flashover_checkpoint::{Checkpoint, CheckpointError, PieceData, Region, TensorSource};
use flashover_parallel::params::{ParamLayout, ParamSlot};
use flashover_parallel::placement::{ParamPlacement, Placement, Tie};
use flashover_runtime::Axis;
use std::ops::Range;

/// Part of a local flat vector holding a region of a whole-model tensor.
#[derive(Debug, Clone, PartialEq)]
pub struct Segment {
    /// Whole-model tensor name.
    pub tensor: String,
    /// Its whole shape.
    pub shape: Vec<usize>,
    /// The elements held.
    pub region: Region,
    /// Offset of the local tensor in the flat vector.
    pub local: usize,
    /// Shape of the local tensor (padding included).
    pub local_shape: Vec<usize>,
    /// Where the region's elements sit in the local tensor (the rest is padding).
    pub local_region: Region,
    /// Whether this rank writes it (one replica of each element does).
    pub write: bool,
}

impl Segment {
    /// A whole tensor held whole at `local`.
    pub fn whole(tensor: &str, shape: &[usize], local: usize) -> Self {
        Segment {
            tensor: tensor.into(),
            shape: shape.to_vec(),
            region: Region::whole(shape),
            local,
            local_shape: shape.to_vec(),
            local_region: Region::whole(shape),
            write: true,
        }
    }

    /// Elements `start..start + len` of the tensor's flattening, held contiguously at `local`.
    pub fn flat(tensor: &str, shape: &[usize], start: usize, len: usize, local: usize) -> Self {
        let flat = |start: usize| Region::Flat {
            start: start as u64,
            len: len as u64,
        };
        Segment {
            tensor: tensor.into(),
            shape: shape.to_vec(),
            region: flat(start),
            local,
            local_shape: vec![len],
            local_region: flat(0),
            write: true,
        }
    }

    /// The same placement for another tensor of the same shape (an optimizer moment).
    fn renamed(&self, tensor: String) -> Self {
        Segment {
            tensor,
            ..self.clone()
        }
    }

    /// The region's values out of `flat`, in region order.
    fn gather(&self, flat: &[f32]) -> Vec<f32> {
        let mut out = vec![];
        for run in self.local_region.runs(&self.local_shape) {
            let at = self.local + run.global;
            out.extend_from_slice(&flat[at..at + run.len]);
        }
        out
    }

    /// Puts the region's `values` (region order) into `flat`.
    pub(crate) fn scatter(&self, values: &[f32], flat: &mut [f32]) {
        for run in self.local_region.runs(&self.local_shape) {
            let at = self.local + run.global;
            flat[at..at + run.len].copy_from_slice(&values[run.local..run.local + run.len]);
        }
    }

    /// `(first global element, first local element, len)` when the region and its local
    /// placement are both one contiguous stretch (so replicas can split its writing).
    fn contiguous(&self) -> Option<(usize, usize, usize)> {
        match (&self.region, &self.local_region) {
            (Region::Flat { start, len }, Region::Flat { start: local, .. }) => {
                Some((*start as usize, self.local + *local as usize, *len as usize))
            }
            _ => None,
        }
    }
}

/// One rank's training state for a checkpoint: flat vectors and where their parts belong.
#[derive(Debug, Clone, Default)]
pub struct LocalState {
    /// Parameters, flat.
    pub params: Vec<f32>,
    /// Where each part of `params` belongs.
    pub param_segments: Vec<Segment>,
    /// AdamW first and second moments, flat (their own order: ZeRO keeps shard order).
    pub moments: [Vec<f32>; 2],
    /// Where each part of the moments belongs (the same tensors' regions).
    pub moment_segments: Vec<Segment>,
    /// AdamW steps taken.
    pub steps_taken: i32,
}

/// Segments for a module's whole parameters laid out by `layout`, named by `name(slot name)`.
pub fn whole_segments(layout: &ParamLayout, name: impl Fn(&str) -> String) -> Vec<Segment> {
    layout
        .slots
        .iter()
        .map(|s| Segment::whole(&name(&s.name), &s.shape, s.offset))
        .collect()
}

/// The segment of a parameter placed as `entry`, its local tensor at `local` of the flat
/// vector, on the rank at coordinates `coord`. Ranks along the `sharing` axes split the writing
/// of the elements they all hold ([`LocalState::pieces_for`]); along any other axis that
/// replicates the parameter the first rank writes it, and a tied copy is never written.
pub(crate) fn placed_segment(
    entry: &ParamPlacement,
    local: usize,
    coord: &dyn Fn(Axis) -> usize,
    sharing: &[Axis],
) -> Segment {
    let held = entry.held(coord);
    let region = if held.is_whole(&entry.global_shape) {
        Region::whole(&entry.global_shape)
    } else {
        Region::Block {
            offsets: held.offsets.iter().map(|&o| o as u64).collect(),
            shape: held.extents.iter().map(|&e| e as u64).collect(),
        }
    };
    // The real rows sit at the local tensor's start; the rest is padding.
    let local_region = if held.extents == entry.local_shape {
        Region::whole(&entry.local_shape)
    } else {
        Region::Block {
            offsets: vec![0; held.extents.len()],
            shape: held.extents.iter().map(|&e| e as u64).collect(),
        }
    };
    let first_replica = Axis::ALL
        .iter()
        .all(|&a| sharing.contains(&a) || entry.on(a) != Placement::Replicate || coord(a) == 0);
    Segment {
        tensor: entry.name.clone(),
        shape: entry.global_shape.clone(),
        region,
        local,
        local_shape: entry.local_shape.clone(),
        local_region,
        write: first_replica && entry.tie != Tie::Copy,
    }
}

/// [`placed_segment`] for every parameter of `entries` (a module's, from
/// `PlacementTable::entries_of`), the module's flat vector starting at `base`.
pub(crate) fn placed_segments(
    entries: &[(ParamSlot, &ParamPlacement)],
    base: usize,
    coord: &dyn Fn(Axis) -> usize,
    sharing: &[Axis],
) -> Vec<Segment> {
    entries
        .iter()
        .map(|(slot, entry)| placed_segment(entry, base + slot.offset, coord, sharing))
        .collect()
}

/// The pieces this rank writes of `segments` over `flat`: the segments it is responsible for,
/// contiguous ones split evenly between `replicas = (index, count)` ranks holding the same data,
/// others written whole by replica 0.
pub(crate) fn pieces_to_write(
    segments: &[Segment],
    flat: &[f32],
    replicas: (usize, usize),
) -> Vec<PieceData> {
    let (index, count) = replicas;
    let splittable: usize = segments
        .iter()
        .filter(|s| s.write)
        .filter_map(|s| s.contiguous().map(|(_, _, len)| len))
        .sum();
    let part = splittable.div_ceil(count.max(1));
    let mine: Range<usize> = (index * part).min(splittable)..((index + 1) * part).min(splittable);
    let mut seen = 0;
    let mut out = vec![];
    for s in segments.iter().filter(|s| s.write) {
        // A parameter with no elements (an attention core's) is written too, empty, so a
        // resume or an export finds every parameter of the model.
        if s.shape.contains(&0) {
            if index == 0 {
                out.push(PieceData {
                    tensor: s.tensor.clone(),
                    shape: s.shape.clone(),
                    region: s.region.clone(),
                    values: vec![],
                });
            }
            continue;
        }
        match s.contiguous() {
            Some((start, local, len)) => {
                // This segment is positions seen..seen + len of the splittable data.
                let from = mine.start.max(seen);
                let to = mine.end.min(seen + len);
                if from < to {
                    let (skip, n) = (from - seen, to - from);
                    out.push(PieceData {
                        tensor: s.tensor.clone(),
                        shape: s.shape.clone(),
                        region: Region::Flat {
                            start: (start + skip) as u64,
                            len: n as u64,
                        },
                        values: flat[local + skip..local + skip + n].to_vec(),
                    });
                }
                seen += len;
            }
            None if index == 0 => {
                let values = s.gather(flat);
                if !values.is_empty() {
                    out.push(PieceData {
                        tensor: s.tensor.clone(),
                        shape: s.shape.clone(),
                        region: s.region.clone(),
                        values,
                    });
                }
            }
            None => {}
        }
    }
    out
}

/// Moment tensor names.
fn moment_name(which: usize, tensor: &str) -> String {
    format!(
        "optim.{}.{tensor}",
        if which == 0 { "exp_avg" } else { "exp_avg_sq" }
    )
}

impl LocalState {
    /// Reads every parameter segment's region from `source` (a checkpoint or a consolidated
    /// model file), leaving the optimizer state as it is.
    pub fn load_params(&mut self, source: &dyn TensorSource) -> Result<(), CheckpointError> {
        for s in &self.param_segments {
            source.expect_shape(&s.tensor, &s.shape)?;
            let values = source.read(&s.tensor, &s.region)?;
            s.scatter(&values, &mut self.params);
        }
        Ok(())
    }

    /// Every piece this rank writes: parameters and both moments, each shared with the ranks
    /// holding the same data (`(index, count)`).
    pub fn pieces_for(
        &self,
        param_replicas: (usize, usize),
        moment_replicas: (usize, usize),
    ) -> Vec<PieceData> {
        let replicas = moment_replicas;
        let mut out = pieces_to_write(&self.param_segments, &self.params, param_replicas);
        for (which, moment) in self.moments.iter().enumerate() {
            let named: Vec<Segment> = self
                .moment_segments
                .iter()
                .map(|s| s.renamed(moment_name(which, &s.tensor)))
                .collect();
            out.extend(pieces_to_write(&named, moment, replicas));
        }
        out
    }

    /// Reads every segment's region from `ckpt` into the flat vectors (which keep their
    /// lengths: padding stays as it is). Fails naming the tensor when the checkpoint lacks it
    /// or has another shape (a checkpoint of another model).
    pub fn load(&mut self, ckpt: &Checkpoint) -> Result<(), CheckpointError> {
        self.load_params(ckpt)?;
        for (which, moment) in self.moments.iter_mut().enumerate() {
            for s in &self.moment_segments {
                let name = moment_name(which, &s.tensor);
                ckpt.expect_shape(&name, &s.shape)?;
                let values = ckpt.read(&name, &s.region)?;
                s.scatter(&values, moment);
            }
        }
        let steps = ckpt
            .index()
            .run
            .get("adamw_steps")
            .and_then(|v| v.as_i64())
            .ok_or_else(|| {
                CheckpointError::Mismatch(format!(
                    "{}: the run state has no `adamw_steps`",
                    ckpt.dir().display()
                ))
            })?;
        self.steps_taken = i32::try_from(steps).map_err(|_| {
            CheckpointError::Mismatch(format!("adamw_steps = {steps} is out of range"))
        })?;
        Ok(())
    }
}

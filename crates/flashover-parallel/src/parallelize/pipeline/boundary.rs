//! What crosses a stage boundary: the tensors' specs (learned from the first stage's
//! `embed`, sent as numbers), the tensors packed into one flat tensor and back, and the
//! forward alone through every stage (validation, inference).

use super::step::{Ahead, UnitRun, run_layer};
use super::{PipelineModel, Stages};
use crate::dropout::draws::{self, Scope};
use crate::error::ParallelError;
use crate::pipeline::{
    BoundaryTensor, PartSpec, boundary_tensors, from_boundary_tensors, specs_of,
};
use burn::tensor::{DType, Tensor};
use flashover_comm::{CommunicatorExt, control};
use flashover_runtime::TensorCollectives;
use std::ops::Range;

/// The dtypes a stage boundary's tensors may have, by their code in [`encode_specs`].
const BOUNDARY_DTYPES: [DType; 4] = [DType::F32, DType::BF16, DType::F16, DType::F64];

/// `specs` as numbers, for a broadcast or a send: their count, then per tensor its dtype's
/// code, whether it carries a gradient, its rank and its dimensions.
pub(super) fn encode_specs(specs: &[PartSpec]) -> Result<Vec<u64>, ParallelError> {
    let mut code = vec![specs.len() as u64];
    for spec in specs {
        let dtype = BOUNDARY_DTYPES.iter().position(|d| *d == spec.dtype);
        let dtype = dtype.ok_or_else(|| {
            ParallelError::Invalid(format!(
                "a stage boundary's tensor of dtype {:?}: stages pass float tensors (f32, bf16, \
                 f16, f64); build integer inputs from the micro-batch on every stage \
                 (PipelineModel::layer_for)",
                spec.dtype
            ))
        })?;
        code.extend([dtype as u64, u64::from(spec.grad), spec.shape.len() as u64]);
        code.extend(spec.shape.iter().map(|&d| d as u64));
    }
    Ok(code)
}

/// The specs [`encode_specs`] wrote.
pub(super) fn decode_specs(code: &[u64]) -> Result<Vec<PartSpec>, ParallelError> {
    let malformed = || ParallelError::Invalid("a malformed stage boundary description".into());
    let mut numbers = code.iter().map(|&n| n as usize);
    let mut next = || numbers.next().ok_or_else(malformed);
    let count = next()?;
    let mut specs = Vec::with_capacity(count);
    for _ in 0..count {
        let dtype = *BOUNDARY_DTYPES.get(next()?).ok_or_else(malformed)?;
        let grad = next()? == 1;
        let rank = next()?;
        let shape = (0..rank).map(|_| next()).collect::<Result<_, _>>()?;
        specs.push(PartSpec { shape, dtype, grad });
    }
    Ok(specs)
}

/// A boundary's tensors as one flat tensor, for a recomputed layer (whose function takes and
/// returns one tensor): concatenated in order, in their common dtype (f32 when they differ,
/// which every float dtype converts to and back exactly).
#[derive(Clone)]
pub(super) struct Packing {
    specs: Vec<PartSpec>,
    dtype: DType,
}

impl Packing {
    /// How `parts` pack, and them packed.
    pub(super) fn of(parts: Vec<BoundaryTensor>) -> (Self, Tensor<1>) {
        let specs = specs_of(&parts);
        let dtype = match specs.iter().all(|s| s.dtype == specs[0].dtype) {
            true => specs[0].dtype,
            false => DType::F32,
        };
        let packing = Packing { specs, dtype };
        let packed = packing.pack(parts);
        (packing, packed)
    }

    /// Elements of the packed tensor.
    pub(super) fn numel(&self) -> usize {
        self.specs.iter().map(PartSpec::numel).sum()
    }

    /// `parts` (shaped as this packing's) as one tensor.
    pub(super) fn pack(&self, parts: Vec<BoundaryTensor>) -> Tensor<1> {
        let shapes: Vec<&[usize]> = parts.iter().map(|p| &p.shape[..]).collect();
        let expected: Vec<&[usize]> = self.specs.iter().map(|s| &s.shape[..]).collect();
        assert_eq!(
            shapes, expected,
            "a recomputed pipeline layer returned other shapes than it was given"
        );
        let mut flats: Vec<Tensor<1>> = parts
            .into_iter()
            .map(|p| match p.flat.dtype() == self.dtype {
                true => p.flat,
                false => p.flat.cast(self.dtype),
            })
            .collect();
        match flats.len() {
            1 => flats.pop().expect("one"),
            _ => Tensor::cat(flats, 0),
        }
    }

    /// The tensors `packed` holds, in their dtypes (those without a gradient detached).
    pub(super) fn unpack(&self, packed: Tensor<1>) -> Vec<BoundaryTensor> {
        let mut start = 0;
        let mut parts = vec![];
        for spec in &self.specs {
            let mut flat = packed.clone().narrow(0, start, spec.numel());
            start += spec.numel();
            if flat.dtype() != spec.dtype {
                flat = flat.cast(spec.dtype);
            }
            if !spec.grad {
                flat = flat.detach();
            }
            parts.push(BoundaryTensor::new(flat, spec.clone()));
        }
        parts
    }
}

impl Stages {
    /// What crosses every stage boundary for one micro-batch: the tensors of the first
    /// stage's `embed` of `first`'s samples (their shapes, dtypes and which carry gradients),
    /// broadcast over `pp` on the first step and kept while micro-batches keep that many
    /// samples (the micro-batches of a run have one shape). Collective over `pp`.
    pub(super) fn boundary<M>(
        &self,
        model: &M,
        first: Range<usize>,
        micro_batch: &(dyn Fn(Range<usize>) -> M::Batch + Sync),
    ) -> Result<Vec<PartSpec>, ParallelError>
    where
        M: PipelineModel,
    {
        let mut known = self.boundary.lock().unwrap_or_else(|p| p.into_inner());
        let samples = first.len();
        if let Some((_, specs)) = known.as_ref().filter(|(n, _)| *n == samples) {
            return Ok(specs.clone());
        }
        let root = self.schedule.place(0).0;
        let mut code = vec![];
        if self.pp.rank() == root {
            let view = self.compute_view_of(model, &self.outside);
            let model = view.as_ref().unwrap_or(model);
            // Only its shapes are kept: no draws (they are the first micro-batch's forward's).
            let x = draws::in_scope(None, Scope::Before, || model.embed(&micro_batch(first)));
            code = encode_specs(&specs_of(&boundary_tensors(x)))?;
        }
        if self.pp.size() > 1 {
            let mut len = [code.len() as u64];
            control(|| self.pp.broadcast(&mut len, root))?;
            code.resize(len[0] as usize, 0);
            control(|| self.pp.broadcast(&mut code, root))?;
        }
        let specs = decode_specs(&code)?;
        *known = Some((samples, specs.clone()));
        Ok(specs)
    }

    /// `batch` forward through every stage, without gradients (validation, inference): the
    /// layers' output on the rank that runs the last stage, `None` on the others. Each stage's
    /// output travels to the next stage's rank in f32, its tensors' shapes first. Collective
    /// over `pp`.
    pub(in crate::parallelize) fn forward<M>(
        &self,
        model: &M,
        batch: &M::Batch,
    ) -> Result<Option<M::Activation>, ParallelError>
    where
        M: PipelineModel,
    {
        let (rank, last) = (self.pp.rank(), self.schedule.stages() - 1);
        let mut carried: Option<M::Activation> = None;
        for stage in 0..=last {
            if self.schedule.place(stage).0 != rank {
                continue;
            }
            let mut x = match (stage, carried.take()) {
                (0, _) => model.embed(batch),
                (_, Some(x)) => x, // the previous stage ran here too
                (_, None) => {
                    let src = self.schedule.place(stage - 1).0;
                    let mut len = [0u64];
                    control(|| self.pp.recv(&mut len, src))?;
                    let mut code = vec![0u64; len[0] as usize];
                    control(|| self.pp.recv(&mut code, src))?;
                    let device = model.devices().into_iter().next().ok_or_else(|| {
                        ParallelError::Invalid("a pipeline stage with no parameters".into())
                    })?;
                    let mut parts = vec![];
                    for spec in decode_specs(&code)? {
                        let flat = self
                            .pp
                            .recv_tensor([spec.numel()], DType::F32, src, &device)?;
                        parts.push(BoundaryTensor::new(flat.cast(spec.dtype), spec));
                    }
                    from_boundary_tensors(parts)
                }
            };
            for i in self.layers[stage].clone() {
                let units = self.units.as_deref().map(|units| UnitRun {
                    units,
                    ahead: Ahead::default(),
                    input: None,
                });
                x = run_layer(units, model, model, i, x, batch, None).0;
            }
            if stage == last {
                return Ok(Some(x));
            }
            let dst = self.schedule.place(stage + 1).0;
            if dst == rank {
                carried = Some(x);
            } else {
                let parts = boundary_tensors(x);
                let code = encode_specs(&specs_of(&parts))?;
                control(|| self.pp.send(&[code.len() as u64], dst))?;
                control(|| self.pp.send(&code, dst))?;
                for part in parts {
                    self.pp.send_tensor(&part.flat.cast(DType::F32), dst)?;
                }
            }
        }
        Ok(None)
    }
}

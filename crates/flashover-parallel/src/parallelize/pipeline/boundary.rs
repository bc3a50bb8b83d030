//! What crosses a stage boundary: the tensors' specs as numbers for a send, and the tensors
//! packed into one flat tensor and back.

use crate::error::ParallelError;
use crate::pipeline::{BoundaryTensor, PartSpec, specs_of};
use burn::tensor::{DType, Tensor};

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

//! What crosses a pipeline stage boundary: one tensor, or a structure of several (an
//! encoder's output next to a decoder's stream), each sent with its own shape and dtype and,
//! unless marked [`NoGrad`], given its own gradient in backward.
//!
//! A model names its boundary as `PipelineModel::Activation`: `Tensor<3>`, a tuple of up to
//! four boundaries (`(Tensor<3>, Tensor<3>)`), [`NoGrad`] around a tensor that rides along
//! without a gradient (a float mask), or a struct of its own that implements
//! [`StageBoundary`] by handing each field to its field's implementation, in a fixed order.
//! Integer side inputs (token or position ids) are not carried: every stage builds its
//! micro-batch and reads them there (`PipelineModel::layer_for`).

use burn::tensor::{DType, Tensor};

/// One tensor of a stage boundary: its elements in one dimension, its shape, and whether its
/// gradient travels back in backward.
#[derive(Clone, Debug)]
pub struct BoundaryTensor {
    pub(crate) flat: Tensor<1>,
    pub(crate) shape: Vec<usize>,
    pub(crate) grad: bool,
}

impl BoundaryTensor {
    /// `flat` as the tensor `spec` describes.
    pub(crate) fn new(flat: Tensor<1>, spec: PartSpec) -> Self {
        BoundaryTensor {
            flat,
            shape: spec.shape,
            grad: spec.grad,
        }
    }

    /// What the receiving side needs to know of it before it arrives.
    pub(crate) fn spec(&self) -> PartSpec {
        PartSpec {
            shape: self.shape.clone(),
            dtype: self.flat.dtype(),
            grad: self.grad,
        }
    }
}

/// The shape, dtype and differentiability of one tensor of a stage boundary, learned at the
/// first step from the first stage's `embed` and the same at every boundary of the pipeline.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct PartSpec {
    pub(crate) shape: Vec<usize>,
    pub(crate) dtype: DType,
    pub(crate) grad: bool,
}

impl PartSpec {
    /// Elements of the tensor.
    pub(crate) fn numel(&self) -> usize {
        self.shape.iter().product()
    }
}

/// A structure of tensors that crosses pipeline stage boundaries (see the module docs).
///
/// Implemented for `Tensor<D>`, [`NoGrad`] and tuples of up to four boundaries; a struct of
/// the model's own writes both methods by calling its fields' in one order:
///
/// ```
/// use burn::tensor::Tensor;
/// use flashover_parallel::pipeline::{BoundaryTensor, StageBoundary};
///
/// struct EncoderDecoder {
///     memory: Tensor<3>,
///     target: Tensor<3>,
/// }
///
/// impl StageBoundary for EncoderDecoder {
///     fn into_tensors(self, out: &mut Vec<BoundaryTensor>) {
///         self.memory.into_tensors(out);
///         self.target.into_tensors(out);
///     }
///     fn from_tensors(parts: &mut std::vec::IntoIter<BoundaryTensor>) -> Self {
///         EncoderDecoder {
///             memory: StageBoundary::from_tensors(parts),
///             target: StageBoundary::from_tensors(parts),
///         }
///     }
/// }
/// ```
pub trait StageBoundary: Sized + 'static {
    /// Appends this value's tensors to `out`, in a fixed order.
    fn into_tensors(self, out: &mut Vec<BoundaryTensor>);

    /// The value back from tensors in the order [`Self::into_tensors`] gives them (taking
    /// as many as it gave). The pipeline hands it tensors of the shapes the first stage's
    /// `embed` produced, so a mismatch is a bug, and panics.
    fn from_tensors(parts: &mut std::vec::IntoIter<BoundaryTensor>) -> Self;
}

/// A tensor of a stage boundary that carries no gradient back (a float attention mask that
/// the first stage builds and later stages read).
#[derive(Clone, Debug)]
pub struct NoGrad<T>(pub T);

/// What the receiving side needs to know of `parts`, in their order.
pub(crate) fn specs_of(parts: &[BoundaryTensor]) -> Vec<PartSpec> {
    parts.iter().map(BoundaryTensor::spec).collect()
}

/// `value`'s tensors, in its order.
pub(crate) fn boundary_tensors<A: StageBoundary>(value: A) -> Vec<BoundaryTensor> {
    let mut out = vec![];
    value.into_tensors(&mut out);
    out
}

/// The boundary value made of `parts` (all of them).
pub(crate) fn from_boundary_tensors<A: StageBoundary>(parts: Vec<BoundaryTensor>) -> A {
    let count = parts.len();
    let mut parts = parts.into_iter();
    let value = A::from_tensors(&mut parts);
    assert!(
        parts.next().is_none(),
        "a stage boundary of {count} tensors was rebuilt from fewer"
    );
    value
}

impl<const D: usize> StageBoundary for Tensor<D> {
    fn into_tensors(self, out: &mut Vec<BoundaryTensor>) {
        let shape = self.dims().to_vec();
        let numel: usize = shape.iter().product();
        out.push(BoundaryTensor {
            flat: self.reshape([numel]),
            shape,
            grad: true,
        });
    }

    fn from_tensors(parts: &mut std::vec::IntoIter<BoundaryTensor>) -> Self {
        let part = parts.next().expect("a stage boundary short of tensors");
        let dims = <[usize; D]>::try_from(&part.shape[..]).unwrap_or_else(|_| {
            panic!(
                "a stage boundary's tensor of shape {:?} read as one of {D} dimensions",
                part.shape
            )
        });
        part.flat.reshape(dims)
    }
}

impl<T: StageBoundary> StageBoundary for NoGrad<T> {
    fn into_tensors(self, out: &mut Vec<BoundaryTensor>) {
        let start = out.len();
        self.0.into_tensors(out);
        for part in &mut out[start..] {
            part.flat = part.flat.clone().detach();
            part.grad = false;
        }
    }

    fn from_tensors(parts: &mut std::vec::IntoIter<BoundaryTensor>) -> Self {
        NoGrad(T::from_tensors(parts))
    }
}

macro_rules! tuple_boundary {
    ($($name:ident),+) => {
        impl<$($name: StageBoundary),+> StageBoundary for ($($name,)+) {
            #[allow(non_snake_case)]
            fn into_tensors(self, out: &mut Vec<BoundaryTensor>) {
                let ($($name,)+) = self;
                $($name.into_tensors(out);)+
            }

            fn from_tensors(parts: &mut std::vec::IntoIter<BoundaryTensor>) -> Self {
                ($($name::from_tensors(parts),)+)
            }
        }
    };
}

tuple_boundary!(A, B);
tuple_boundary!(A, B, C);
tuple_boundary!(A, B, C, E);

#[cfg(test)]
mod tests {
    use super::*;
    use burn::tensor::{Device, TensorData};

    #[test]
    fn a_tuple_with_a_no_grad_part_round_trips_in_order() {
        let device = Device::flex();
        let a = Tensor::<3>::from_data(
            TensorData::new((0..24).map(|v| v as f32).collect(), [2, 3, 4]),
            &device,
        );
        let b = Tensor::<2>::from_data(TensorData::new(vec![1.0f32; 6], [2, 3]), &device);
        let parts = boundary_tensors((a.clone(), NoGrad(b.clone())));
        let specs = specs_of(&parts);
        assert_eq!(specs[0].shape, vec![2, 3, 4]);
        assert!(specs[0].grad && !specs[1].grad);
        assert_eq!(specs[1].numel(), 6);
        let (a2, NoGrad(b2)): (Tensor<3>, NoGrad<Tensor<2>>) = from_boundary_tensors(parts);
        assert_eq!(a2.into_data(), a.into_data());
        assert_eq!(b2.into_data(), b.into_data());
    }
}

//! Walking a Burn module's float parameters: their layout in one flat buffer, reading gradients
//! into it, writing gradients back out of it, and broadcasting parameters over a group.

use crate::error::ParallelError;
use burn::module::{Module, ModuleMapper, ModuleVisitor, Param, ParamId};
use burn::optim::GradientsParams;
use burn::tensor::{DType, Device, GradientCheckpointingStrategy, Tensor, TensorData};
use flashover_comm::{CommError, Group};
use flashover_kernels::{pack_scaled, unpack_scaled, uses_kernels};
use flashover_runtime::TensorCollectives;
use flashover_runtime::transfers::{self, Cause};

/// One float parameter's place in the flat layout.
#[derive(Debug, Clone, PartialEq)]
pub struct ParamSlot {
    /// Burn's id of the parameter.
    pub id: ParamId,
    /// Dotted path, e.g. `blocks.0.attn.wq.weight`.
    pub name: String,
    /// Shape.
    pub shape: Vec<usize>,
    /// Offset of its first element in the flat buffer.
    pub offset: usize,
    /// Number of elements.
    pub numel: usize,
}

/// Every float parameter of a module, in visiting order, laid end to end.
#[derive(Debug, Clone, PartialEq)]
pub struct ParamLayout {
    /// The parameters, in the module's visiting order.
    pub slots: Vec<ParamSlot>,
    /// Total number of elements.
    pub numel: usize,
}

#[derive(Default)]
struct LayoutVisitor {
    path: Vec<String>,
    slots: Vec<ParamSlot>,
    numel: usize,
}

impl ModuleVisitor for LayoutVisitor {
    fn enter_module(&mut self, name: &str, _container_type: &str) {
        self.path.push(name.to_string());
    }
    fn exit_module(&mut self, _name: &str, _container_type: &str) {
        self.path.pop();
    }
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        let shape = param.val().dims().to_vec();
        let numel = shape.iter().product();
        let name = self
            .path
            .iter()
            .filter(|p| !p.is_empty())
            .cloned()
            .collect::<Vec<_>>()
            .join(".");
        self.slots.push(ParamSlot {
            id: param.id,
            name,
            shape,
            offset: self.numel,
            numel,
        });
        self.numel += numel;
    }
}

impl ParamLayout {
    /// The layout of `module`'s float parameters.
    pub fn of<M: Module>(module: &M) -> Self {
        let mut v = LayoutVisitor::default();
        module.visit(&mut v);
        ParamLayout {
            slots: v.slots,
            numel: v.numel,
        }
    }
}

/// Host copy of a tensor's values as f32.
pub fn to_f32<const D: usize>(t: Tensor<D>) -> Vec<f32> {
    read_f32(t, Cause::Flat)
}

/// Host copy of a tensor's values as f32 for a check of the first step (the replicas', the
/// split's): counted as set-up, not as a step's reads.
pub(crate) fn checked_f32<const D: usize>(t: Tensor<D>) -> Vec<f32> {
    read_f32(t, Cause::SetUp)
}

/// Host copy of a tensor's values as f32, counted as `cause`.
fn read_f32<const D: usize>(t: Tensor<D>, cause: Cause) -> Vec<f32> {
    let data = transfers::read(t, cause);
    match data.as_slice::<f32>() {
        Ok(s) => s.to_vec(),
        Err(_) => data
            .convert::<f32>()
            .as_slice::<f32>()
            .expect("converted to f32")
            .to_vec(),
    }
}

/// `tensors` (outside any graph) read to the host as one f32 vector. On a CubeCL device they
/// are packed into one device buffer first (`flashover_kernels::pack_scaled`): one transfer
/// and one synchronisation instead of one per tensor. Elsewhere each is read in turn.
fn read_concatenated(tensors: Vec<Tensor<1>>) -> Vec<f32> {
    let Some(first) = tensors.first() else {
        return vec![];
    };
    let device = first.device();
    if uses_kernels(&device) && tensors.iter().all(|t| t.device() == device) {
        return to_f32(pack_scaled(tensors, 1.0));
    }
    tensors.into_iter().flat_map(to_f32).collect()
}

/// Every float parameter of `module` packed into one flat tensor on their device by the pack
/// kernel (outside any graph), where the strategies use the kernels
/// (`flashover_kernels::uses_kernels`). `None` elsewhere, for a module without parameters, or
/// whose parameters are not all f32 on one device.
pub fn pack_params<M: Module>(module: &M) -> Option<Tensor<1>> {
    let parts = flat_params(module);
    for_kernels(&parts).then(|| pack_scaled(parts, 1.0))
}

/// Every float parameter's values as a flat tensor outside any graph, in layout order.
fn flat_params<M: Module>(module: &M) -> Vec<Tensor<1>> {
    struct V(Vec<Tensor<1>>);
    impl ModuleVisitor for V {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            let value = param.val().inner();
            let numel = value.shape().num_elements();
            self.0.push(value.reshape([numel]));
        }
    }
    let mut v = V(vec![]);
    module.visit(&mut v);
    v.0
}

/// Every float parameter's gradient in `grads`, packed into one flat tensor in layout order
/// on their device, as [`pack_params`] packs the parameters. `None` as there, and if a
/// parameter has no gradient.
pub fn pack_grads<M: Module>(module: &M, grads: &GradientsParams) -> Option<Tensor<1>> {
    struct V<'a> {
        grads: &'a GradientsParams,
        parts: Option<Vec<Tensor<1>>>,
    }
    impl ModuleVisitor for V<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            let grad = self.grads.get::<D>(param.id);
            match (grad, self.parts.as_mut()) {
                (Some(g), Some(parts)) => {
                    let numel = g.shape().num_elements();
                    parts.push(g.reshape([numel]));
                }
                _ => self.parts = None,
            }
        }
    }
    let mut v = V {
        grads,
        parts: Some(vec![]),
    };
    module.visit(&mut v);
    let parts = v.parts?;
    for_kernels(&parts).then(|| pack_scaled(parts, 1.0))
}

/// Whether `parts` are f32 tensors on one device where the strategies use the kernels.
fn for_kernels(parts: &[Tensor<1>]) -> bool {
    let Some(first) = parts.first() else {
        return false;
    };
    let device = first.device();
    uses_kernels(&device)
        && parts
            .iter()
            .all(|t| t.device() == device && t.dtype() == burn::tensor::DType::F32)
}

/// `value` (outside autodiff) in `reference`'s autodiff context: with autodiff and the same
/// gradient-checkpointing strategy where `reference` has autodiff (combining tensors of two
/// strategies panics), as it is where `reference` has none.
pub(crate) fn in_context_of<const D: usize, const E: usize>(
    value: Tensor<D>,
    reference: &Tensor<E>,
) -> Tensor<D> {
    with_autodiff(value, reference.gradient_checkpointing_strategy())
}

/// `value` (outside autodiff) with autodiff and `strategy` where there is one (an autodiff
/// context's), as it is where there is none.
pub(crate) fn with_autodiff<const D: usize>(
    value: Tensor<D>,
    strategy: Option<GradientCheckpointingStrategy>,
) -> Tensor<D> {
    match strategy {
        Some(strategy) => value
            .autodiff()
            .with_gradient_checkpointing_strategy(strategy),
        None => value,
    }
}

/// `data` as a tensor on `device`, counted as a flat-vector transfer.
fn uploaded<const D: usize>(data: TensorData, device: &Device) -> Tensor<D> {
    transfers::to_device(Cause::Flat, data.as_bytes().len());
    Tensor::from_data(data, device)
}

/// `values` as a flat tensor on `device`.
pub fn upload(values: &[f32], device: &Device) -> Tensor<1> {
    uploaded(TensorData::new(values.to_vec(), [values.len()]), device)
}

/// `module` with its float parameters replaced by the pieces of `flat` (layout order, on their
/// device: cut there, no host copy), keeping ids, autodiff context and `require_grad`.
pub fn load_packed<M: Module>(module: M, flat: Tensor<1>) -> M {
    let lens: Vec<usize> = ParamLayout::of(&module)
        .slots
        .iter()
        .map(|s| s.numel)
        .collect();
    struct Mapper {
        pieces: std::vec::IntoIter<Tensor<1>>,
    }
    impl ModuleMapper for Mapper {
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
            let piece = self.pieces.next().expect("one piece per parameter");
            param.map(|t| {
                let require_grad = t.is_require_grad();
                in_context_of(piece.reshape(t.dims()), &t).set_require_grad(require_grad)
            })
        }
    }
    let pieces = unpack_scaled(flat, &lens, 1.0);
    module.map(&mut Mapper {
        pieces: pieces.into_iter(),
    })
}

/// Every float parameter's values laid end to end in layout order, as one f32 tensor on their
/// device outside any graph (no host copy); `None` for a module without parameters.
pub fn params_on_device<M: Module>(module: &M) -> Option<Tensor<1>> {
    let parts: Vec<Tensor<1>> = (flat_params(module).into_iter())
        .map(|p| p.cast(DType::F32))
        .collect();
    (!parts.is_empty()).then(|| Tensor::cat(parts, 0))
}

/// Every float parameter's values, concatenated in layout order.
pub fn flatten_params<M: Module>(module: &M) -> Vec<f32> {
    read_concatenated(flat_params(module))
}

/// Elements `offset..offset + len` of `flat` (Burn refuses to narrow to nothing: an empty
/// range gives an empty tensor on the same device).
pub fn part(flat: &Tensor<1>, offset: usize, len: usize) -> Tensor<1> {
    match len {
        0 => Tensor::zeros([0], &flat.device()),
        _ => flat.clone().narrow(0, offset, len),
    }
}

/// A zero gradient for every float parameter of `module`, laid end to end in layout order
/// (f32, on `device`: not an autodiff device), what [`accumulate_grads`] adds into.
pub fn zero_grads<M: Module>(module: &M, device: &Device) -> Tensor<1> {
    Tensor::zeros([ParamLayout::of(module).numel], device)
}

/// `flat` (a gradient of every float parameter of `module`, laid end to end in layout order,
/// f32, outside any graph) plus each parameter's gradient in `grads`, on the device; with
/// which parameters had one. Parameters without a gradient (unused in forward), and those
/// `skip` marks, add nothing.
pub fn accumulate_grads<M: Module>(
    module: &M,
    grads: &GradientsParams,
    flat: Tensor<1>,
    skip: &[bool],
) -> (Tensor<1>, Vec<bool>) {
    struct V<'a> {
        grads: &'a GradientsParams,
        skip: &'a [bool],
        index: usize,
        found: Vec<bool>,
        /// Per parameter: its gradient, or its length where it has none.
        pieces: Vec<Result<Tensor<1>, usize>>,
    }
    impl ModuleVisitor for V<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            let numel: usize = param.val().dims().iter().product();
            let skip = self.skip.get(self.index).copied().unwrap_or(false);
            let grad = match skip {
                true => None,
                false => self.grads.get::<D>(param.id),
            };
            self.found.push(grad.is_some());
            self.pieces.push(match grad {
                Some(g) => Ok(g.reshape([numel]).cast(DType::F32)),
                None => Err(numel),
            });
            self.index += 1;
        }
    }
    let mut v = V {
        grads,
        skip,
        index: 0,
        found: vec![],
        pieces: vec![],
    };
    module.visit(&mut v);
    if !v.found.contains(&true) {
        return (flat, v.found);
    }
    let device = flat.device();
    let pieces = (v.pieces.into_iter())
        .map(|piece| piece.unwrap_or_else(|numel| Tensor::zeros([numel], &device)))
        .collect();
    (flat + Tensor::cat(pieces, 0), v.found)
}

/// Gradients for every float parameter of `module`, cut from `flat` (layout order, on the
/// device: no copy to the host), outside any autodiff graph, as optimizers expect.
pub fn grads_from_flat<M: Module>(module: &M, flat: &Tensor<1>) -> GradientsParams {
    struct V<'a> {
        flat: &'a Tensor<1>,
        offset: usize,
        grads: GradientsParams,
    }
    impl ModuleVisitor for V<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            let dims: [usize; D] = param.val().dims();
            let numel = dims.iter().product();
            let piece = part(self.flat, self.offset, numel);
            self.offset += numel;
            self.grads.register::<D>(param.id, piece.reshape(dims));
        }
    }
    let mut v = V {
        flat,
        offset: 0,
        grads: GradientsParams::new(),
    };
    module.visit(&mut v);
    v.grads
}

/// Replaces every float parameter of `module` with `root`'s copy (same ids, same
/// `require_grad`), so replicas start identical whatever their initialisation.
pub fn broadcast_module<M: Module>(
    module: M,
    group: &Group,
    root: usize,
) -> Result<M, ParallelError> {
    struct Mapper<'a> {
        group: &'a Group,
        root: usize,
        error: Option<CommError>,
    }
    impl ModuleMapper for Mapper<'_> {
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
            if self.error.is_some() {
                return param;
            }
            let (group, root) = (self.group, self.root);
            let mut error = None;
            let param = param.map(|t| {
                let require_grad = t.is_require_grad();
                match group.broadcast_tensor(t.clone().detach(), root) {
                    Ok(b) => b.set_require_grad(require_grad),
                    Err(e) => {
                        error = Some(e);
                        t
                    }
                }
            });
            self.error = error;
            param
        }
    }
    if group.size() == 1 {
        return Ok(module);
    }
    let mut mapper = Mapper {
        group,
        root,
        error: None,
    };
    let module = module.map(&mut mapper);
    match mapper.error {
        Some(e) => Err(e.into()),
        None => Ok(module),
    }
}

/// `module`'s structure without its memory: every float parameter replaced by a one-element
/// placeholder of the same rank (ids, devices and `require_grad` kept), to be filled again by
/// [`load_shaped`].
pub fn placeholders<M: Module>(module: M) -> M {
    struct Placeholders;
    impl ModuleMapper for Placeholders {
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
            param.map(|t| {
                let require_grad = t.is_require_grad();
                Tensor::zeros([1; D], &t.device()).set_require_grad(require_grad)
            })
        }
    }
    module.map(&mut Placeholders)
}

/// `model` with the parameters `held` does not mark (layout order) replaced by one-element
/// placeholders.
pub fn placeholders_except<M: Module>(model: M, held: &[bool]) -> M {
    struct Cut<'a> {
        held: &'a [bool],
        index: usize,
    }
    impl ModuleMapper for Cut<'_> {
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
            let holds = self.held[self.index];
            self.index += 1;
            if holds { param } else { placeholders(param) }
        }
    }
    model.map(&mut Cut { held, index: 0 })
}

/// `module` (for example from [`placeholders`]) with every float parameter set to its values in
/// `flat` (on the parameters' device, f32), shaped as `layout` (the full module's) says; ids,
/// autodiff context and `require_grad` kept.
pub fn load_shaped<M: Module>(module: M, layout: &ParamLayout, flat: &Tensor<1>) -> M {
    struct Mapper<'a> {
        flat: &'a Tensor<1>,
        layout: &'a ParamLayout,
        index: usize,
    }
    impl ModuleMapper for Mapper<'_> {
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
            let slot = &self.layout.slots[self.index];
            self.index += 1;
            let dims: [usize; D] = slot.shape.clone().try_into().expect("the layout's rank");
            let piece = part(self.flat, slot.offset, slot.numel).reshape(dims);
            param.map(|t| {
                let require_grad = t.is_require_grad();
                in_context_of(piece, &t).set_require_grad(require_grad)
            })
        }
    }
    module.map(&mut Mapper {
        flat,
        layout,
        index: 0,
    })
}

/// `module` with every float parameter replaced by its values in `flat` (layout order), keeping
/// ids, devices and `require_grad`.
pub fn load_flat<M: Module>(module: M, flat: &[f32]) -> M {
    struct Mapper<'a> {
        flat: &'a [f32],
        offset: usize,
    }
    impl ModuleMapper for Mapper<'_> {
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
            let (flat, offset) = (self.flat, &mut self.offset);
            param.map(|t| {
                let dims = t.dims();
                let numel: usize = dims.iter().product();
                let require_grad = t.is_require_grad();
                let data = TensorData::new(flat[*offset..*offset + numel].to_vec(), dims);
                *offset += numel;
                uploaded(data, &t.device()).set_require_grad(require_grad)
            })
        }
    }
    module.map(&mut Mapper { flat, offset: 0 })
}

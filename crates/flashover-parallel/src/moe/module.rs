//! [`Moe`]'s `Module` implementation, written out instead of derived so that each of its fields
//! is entered with a label naming its role (Burn's `container_type`). Burn's module visitors see
//! only names and labels, never types; a derived module labels its fields `Struct:<type>` or
//! `Enum:<type>`, so these labels come from no module but a [`Moe`]. That is how a plan finds
//! mixture-of-experts layers, their routers and their experts by type, whatever the model calls
//! them and whatever else in it is called `Moe`, `router` or `experts`.

use super::Moe;
use burn::module::{
    Content, Devices, Module, ModuleDisplay, ModuleDisplayDefault, ModuleMapper, ModuleVisitor,
    Param, ParamId,
};
use burn::tensor::{Device, Tensor};

/// The part a field plays in a [`Moe`] layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Role {
    /// The router (`[d_model, n_experts]` linear layer).
    Router,
    /// The routed experts this module holds (a `Vec`: the entry below is the expert's index).
    Experts,
    /// The shared expert, if the layer has one.
    Shared,
}

impl Role {
    const ALL: [Role; 3] = [Role::Router, Role::Experts, Role::Shared];

    /// The label of the field's entry.
    const fn label(self) -> &'static str {
        match self {
            Role::Router => "flashover:Moe.router",
            Role::Experts => "flashover:Moe.experts",
            Role::Shared => "flashover:Moe.shared",
        }
    }

    /// The field's name, which is its part of a parameter's path.
    const fn field(self) -> &'static str {
        match self {
            Role::Router => "router",
            Role::Experts => "experts",
            Role::Shared => "shared",
        }
    }

    /// The role of a module entry labelled `container_type`, when a [`Moe`] entered it.
    fn of_entry(container_type: &str) -> Option<Role> {
        Role::ALL.into_iter().find(|r| r.label() == container_type)
    }
}

/// A float parameter of a model, and where it sits among the model's [`Moe`] layers.
#[derive(Debug, Clone)]
pub(crate) struct MoeParam {
    /// The parameter's id.
    pub id: ParamId,
    /// Its path's parts (`blocks`, `1`, `moe`, `experts`, `0`, ...), empty parts left out.
    pub parts: Vec<String>,
    /// Its shape.
    pub dims: Vec<usize>,
    /// When it belongs to a [`Moe`] layer: how many leading `parts` name the layer, and the
    /// role of the layer's field it is in.
    pub in_layer: Option<(usize, Role)>,
}

impl MoeParam {
    /// Its dotted path.
    pub fn path(&self) -> String {
        self.parts.join(".")
    }

    /// The dotted path of the [`Moe`] layer it belongs to, if any.
    pub fn layer_path(&self) -> Option<String> {
        self.in_layer
            .map(|(depth, _)| self.parts[..depth].join("."))
    }

    /// For a routed expert's parameter, the expert's index in its layer's list (the part
    /// after `experts`).
    pub fn expert(&self) -> Option<usize> {
        match self.in_layer {
            Some((depth, Role::Experts)) => self.parts.get(depth + 1)?.parse().ok(),
            _ => None,
        }
    }

    /// For a routed expert's parameter, its path with the expert's index shifted by `first`:
    /// its name in the whole model when this module holds experts `first..`.
    pub fn global_path(&self, first: usize) -> Option<String> {
        let (depth, _) = self.in_layer?;
        let local = self.expert()?;
        let mut parts = self.parts.clone();
        parts[depth + 1] = (first + local).to_string();
        Some(parts.join("."))
    }
}

/// Every float parameter of `model`, in visiting order, with where it sits among the model's
/// [`Moe`] layers: the one walk by which a plan and [`crate::expert_parallel::place_experts`]
/// find those layers, by the labels a `Moe` gives its fields' entries ([`Role`]).
pub(crate) fn moe_params<M: Module>(model: &M) -> Vec<MoeParam> {
    #[derive(Default)]
    struct Walk {
        /// Per entered module, its name when it is not empty.
        path: Vec<Option<String>>,
        /// The innermost `Moe` field being visited: its depth in `path` and its role.
        field: Option<(usize, Role)>,
        params: Vec<MoeParam>,
    }
    impl ModuleVisitor for Walk {
        fn enter_module(&mut self, name: &str, container_type: &str) {
            if let Some(role) = Role::of_entry(container_type) {
                self.field = Some((self.path.len(), role));
            }
            self.path
                .push(Some(name.to_string()).filter(|n| !n.is_empty()));
        }
        fn exit_module(&mut self, _: &str, _: &str) {
            self.path.pop();
            if self
                .field
                .is_some_and(|(depth, _)| self.path.len() <= depth)
            {
                self.field = None;
            }
        }
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            let named = |entries: &[Option<String>]| entries.iter().flatten().count();
            self.params.push(MoeParam {
                id: param.id,
                parts: self.path.iter().flatten().cloned().collect(),
                dims: param.lazy_shape().to_vec(),
                in_layer: self
                    .field
                    .map(|(depth, role)| (named(&self.path[..depth]), role)),
            });
        }
    }
    let mut walk = Walk::default();
    model.visit(&mut walk);
    walk.params
}

fn visit_field<M: Module, V: ModuleVisitor>(visitor: &mut V, role: Role, field: &M) {
    visitor.enter_module(role.field(), role.label());
    field.visit(visitor);
    visitor.exit_module(role.field(), role.label());
}

fn map_field<M: Module, P: ModuleMapper>(mapper: &mut P, role: Role, field: M) -> M {
    mapper.enter_module(role.field(), role.label());
    let field = field.map(mapper);
    mapper.exit_module(role.field(), role.label());
    field
}

impl Moe {
    /// `self` with its modules (router, experts, shared expert) replaced by `f`'s results.
    fn with_modules(
        self,
        f: impl FnOnce(
            burn::nn::Linear,
            Vec<super::SwiGlu>,
            Option<super::SwiGlu>,
        ) -> (burn::nn::Linear, Vec<super::SwiGlu>, Option<super::SwiGlu>),
    ) -> Self {
        let (router, experts, shared) = f(self.router, self.experts, self.shared);
        Moe {
            router,
            experts,
            shared,
            ..self
        }
    }
}

impl Module for Moe {
    fn collect_devices(&self, devices: Devices) -> Devices {
        let devices = self.router.collect_devices(devices);
        let devices = self.experts.collect_devices(devices);
        self.shared.collect_devices(devices)
    }

    fn fork(self, device: &Device) -> Self {
        self.with_modules(|r, e, s| (r.fork(device), e.fork(device), s.fork(device)))
    }

    fn to_device(self, device: &Device) -> Self {
        self.with_modules(|r, e, s| {
            (
                r.to_device(device),
                e.to_device(device),
                s.to_device(device),
            )
        })
    }

    fn train(self) -> Self {
        self.with_modules(|r, e, s| (r.train(), e.train(), s.train()))
    }

    fn valid(&self) -> Self {
        Moe {
            router: self.router.valid(),
            experts: self.experts.valid(),
            shared: self.shared.valid(),
            ..self.clone()
        }
    }

    fn materialize(self) -> Self {
        self.with_modules(|r, e, s| (r.materialize(), e.materialize(), s.materialize()))
    }

    fn visit<V: ModuleVisitor>(&self, visitor: &mut V) {
        visit_field(visitor, Role::Router, &self.router);
        visit_field(visitor, Role::Experts, &self.experts);
        visit_field(visitor, Role::Shared, &self.shared);
    }

    fn map<P: ModuleMapper>(self, mapper: &mut P) -> Self {
        self.with_modules(|r, e, s| {
            let r = map_field(mapper, Role::Router, r);
            let e = map_field(mapper, Role::Experts, e);
            (r, e, map_field(mapper, Role::Shared, s))
        })
    }
}

impl ModuleDisplayDefault for Moe {
    fn content(&self, content: Content) -> Option<Content> {
        content
            .set_top_level_type("Moe")
            .add(Role::Router.field(), &self.router)
            .add(Role::Experts.field(), &self.experts)
            .add(Role::Shared.field(), &self.shared)
            .add_debug_attribute("first_expert", &self.first_expert)
            .optional()
    }

    fn num_params(&self) -> usize {
        Module::num_params(self)
    }
}

impl ModuleDisplay for Moe {}

impl std::fmt::Display for Moe {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", ModuleDisplay::format(self, Default::default()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::moe::MoeConfig;

    /// Every parameter path is what the derived implementation gave (checkpoints written before
    /// still load), and the walk finds each one's layer, role and expert.
    #[test]
    fn paths_are_unchanged_and_entries_carry_roles() {
        let config = MoeConfig {
            shared_expert: true,
            ..MoeConfig::new(2, 1, 4)
        };
        let moe = config.init(8, &Device::flex());
        let found: Vec<(String, Option<Role>)> = moe_params(&moe)
            .into_iter()
            .map(|p| (p.path(), p.in_layer.map(|(_, role)| role)))
            .collect();
        let expected = [
            ("router.weight", Role::Router),
            ("experts.0.w_gate.weight", Role::Experts),
            ("experts.0.w_up.weight", Role::Experts),
            ("experts.0.w_down.weight", Role::Experts),
            ("experts.1.w_gate.weight", Role::Experts),
            ("experts.1.w_up.weight", Role::Experts),
            ("experts.1.w_down.weight", Role::Experts),
            ("shared.w_gate.weight", Role::Shared),
            ("shared.w_up.weight", Role::Shared),
            ("shared.w_down.weight", Role::Shared),
        ];
        let expected: Vec<_> = expected
            .into_iter()
            .map(|(p, r)| (p.to_string(), Some(r)))
            .collect();
        assert_eq!(found, expected);
        assert_eq!(Module::num_params(&moe), 8 * 2 + 3 * 3 * 8 * 4);
        // Inside a model: the layer's path, the expert's index and its global name.
        #[derive(Module, Debug)]
        struct Block {
            moe: Moe,
        }
        #[derive(Module, Debug)]
        struct Model {
            blocks: Vec<Block>,
        }
        let model = Model {
            blocks: vec![Block { moe: moe.clone() }, Block { moe }],
        };
        let expert = &moe_params(&model)[14];
        assert_eq!(expert.path(), "blocks.1.moe.experts.1.w_gate.weight");
        assert_eq!(expert.layer_path().as_deref(), Some("blocks.1.moe"));
        assert_eq!(expert.expert(), Some(1));
        assert_eq!(
            expert.global_path(4).as_deref(),
            Some("blocks.1.moe.experts.5.w_gate.weight")
        );
        assert_eq!(moe_params(&model)[10].global_path(4), None);
    }
}

//! [`Moe`]'s `Module` implementation, written out instead of derived so that each of its fields
//! is entered with a label naming its role (Burn's `container_type`). Burn's module visitors see
//! only names and labels, never types; a derived module labels its fields `Struct:<type>` or
//! `Enum:<type>`, so these labels come from no module but a [`Moe`]. That is how a plan finds
//! mixture-of-experts layers, their routers and their experts by type, whatever the model calls
//! them and whatever else in it is called `Moe`, `router` or `experts`.

use super::Moe;
use burn::module::{
    Content, Devices, Module, ModuleDisplay, ModuleDisplayDefault, ModuleMapper, ModuleVisitor,
};
use burn::tensor::Device;

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
    pub(crate) fn of_entry(container_type: &str) -> Option<Role> {
        Role::ALL.into_iter().find(|r| r.label() == container_type)
    }
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
    /// still load), and each is entered under its role's label.
    #[test]
    fn paths_are_unchanged_and_entries_carry_roles() {
        #[derive(Default)]
        struct Paths {
            path: Vec<String>,
            roles: Vec<Option<Role>>,
            found: Vec<(String, Option<Role>)>,
        }
        impl ModuleVisitor for Paths {
            fn enter_module(&mut self, name: &str, container_type: &str) {
                self.path.push(name.to_string());
                let outer = self.roles.last().copied().flatten();
                self.roles.push(Role::of_entry(container_type).or(outer));
            }
            fn exit_module(&mut self, _: &str, _: &str) {
                self.path.pop();
                self.roles.pop();
            }
            fn visit_float<const D: usize>(&mut self, _: &burn::module::Param<burn::Tensor<D>>) {
                let role = self.roles.last().copied().flatten();
                self.found.push((self.path.join("."), role));
            }
        }
        let config = MoeConfig {
            shared_expert: true,
            ..MoeConfig::new(2, 1, 4)
        };
        let moe = config.init(8, &Device::flex());
        let mut paths = Paths::default();
        moe.visit(&mut paths);
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
        assert_eq!(paths.found, expected);
        assert_eq!(Module::num_params(&moe), 8 * 2 + 3 * 3 * 8 * 4);
    }
}

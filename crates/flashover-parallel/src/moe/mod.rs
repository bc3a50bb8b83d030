//! Mixture-of-experts feed-forward: a router picks `top_k` of `n_experts` SwiGLU experts per
//! token; the chosen experts' outputs are weighted by the router and summed.
//!
//! Routing is decided on the host from the router's logits ([`route`]): which experts each token
//! goes to, which assignments are dropped when an expert is over capacity, and the order in which
//! the kept assignments are laid out (grouped by expert, so every expert runs once on all of its
//! tokens). Running the experts is delegated to an [`ExpertDispatch`]: [`LocalExperts`] when this
//! module holds every expert; the expert-parallel dispatcher (in `flashover-parallel`) when the
//! experts are spread over ranks and tokens travel by all-to-all.
//!
//! **Capacity groups are sequences.** An expert may take at most
//! `ceil(capacity_factor * seq_len * top_k / n_experts)` assignments from each sequence. A group
//! that never spans two samples makes dropping independent of how the batch is split over ranks
//! and micro-batches: every layout drops exactly the tokens one rank drops, and a rank decides
//! its drops before sending anything. The load-balancing loss is computed per sequence too and
//! averaged (as DeepSeek-V3's sequence-wise balance loss), for the same reason.

use crate::forward_context::{ForwardContext, SequenceHook, SequenceShare};
pub use crate::forward_context::{MoeHook, MoeStats};
use burn::module::Module;
use burn::nn::Linear;
use burn::tensor::activation::{sigmoid, silu, softmax};
use burn::tensor::{Device, FloatDType, Tensor, TensorData};
use flashover_runtime::transfers::{Cause, read};

mod module;
mod routing;
pub use crate::tensor_util::index_tensor;
pub(crate) use module::{Role, moe_params};
pub use routing::{Routing, route};
use serde::{Deserialize, Serialize};
use std::sync::Arc;

/// SwiGLU feed-forward: `(silu(x W_gate) * (x W_up)) W_down`.
#[derive(Module, Debug)]
pub struct SwiGlu {
    /// Gate projection `[d_model, d_ff]`.
    pub w_gate: crate::nn::Linear,
    /// Up projection `[d_model, d_ff]`.
    pub w_up: crate::nn::Linear,
    /// Down projection `[d_ff, d_model]`.
    pub w_down: crate::nn::Linear,
}

impl SwiGlu {
    /// `x: [batch, seq, d_model]` -> same shape; split as a plan placed its layers (gate and
    /// up entering the tensor-parallel region once).
    pub fn forward(&self, x: Tensor<3>) -> Tensor<3> {
        let [gate, up] = crate::nn::Linear::forward_shared([&self.w_gate, &self.w_up], x);
        self.w_down.forward(silu(gate) * up)
    }

    /// [`Self::forward`] as an expert computes it: as Burn's `Linear` does, each weight read
    /// whole (gathered where a plan sharded it over `fsdp`; a plan never splits experts over
    /// `tp`) and its gradient produced in backward at once (a zero-bubble step does not defer
    /// it: a hot expert's copy is no parameter of the stage).
    pub(crate) fn forward_expert(&self, x: Tensor<3>) -> Tensor<3> {
        let whole = |l: &crate::nn::Linear, x| {
            burn::tensor::module::linear(x, l.weight.val(), l.bias.as_ref().map(|b| b.val()))
        };
        let (gate, up) = (whole(&self.w_gate, x.clone()), whole(&self.w_up, x));
        whole(&self.w_down, silu(gate) * up)
    }
}

/// How router logits become expert scores.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum RouterKind {
    /// Softmax over the experts (Switch, GShard, Mixtral).
    #[default]
    Softmax,
    /// An independent sigmoid per expert (DeepSeek-V3).
    Sigmoid,
}

/// Which assignments an expert over capacity keeps.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum DropPolicy {
    /// Earlier choices first (every token's first choice before any second choice), then
    /// earlier positions (GShard).
    #[default]
    Position,
    /// Higher router weight first (ties: earlier position).
    Probability,
}

/// Configuration of a mixture-of-experts feed-forward layer.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MoeConfig {
    /// Number of experts.
    pub n_experts: usize,
    /// Experts per token.
    pub top_k: usize,
    /// Hidden width of each expert's SwiGLU.
    pub d_expert: usize,
    /// Softmax or sigmoid scores.
    pub router: RouterKind,
    /// Divide the chosen experts' weights by their sum.
    pub renormalize: bool,
    /// `None`: dropless (an expert takes every token routed to it). `Some(f)`: at most
    /// `ceil(f * seq_len * top_k / n_experts)` assignments per expert and sequence.
    pub capacity_factor: Option<f64>,
    /// Which assignments are kept when an expert is over capacity.
    pub drop_policy: DropPolicy,
    /// One dense SwiGLU expert every token goes through, added to the routed output.
    pub shared_expert: bool,
    /// Weight of the load-balancing loss (Switch/GShard `E * sum_e f_e P_e`, per sequence).
    pub aux_loss_coef: f64,
    /// Weight of the router z-loss (`mean logsumexp(logits)^2`, ST-MoE).
    pub z_loss_coef: f64,
    /// Auxiliary-loss-free balancing (DeepSeek-V3): after each step every expert's routing
    /// bias moves by this much towards the mean load (0: off). The bias only chooses experts;
    /// it never weights their outputs.
    pub bias_update_rate: f64,
    /// Balanced routing: choose experts from the Sinkhorn-balanced plan of each sequence's
    /// scores after this many iterations (0: plain top-k). Weights stay the router's scores.
    pub sinkhorn_iters: usize,
}

impl MoeConfig {
    /// `n_experts` experts of width `d_expert`, `top_k` per token, softmax router, dropless,
    /// load-balancing loss weight 0.01.
    pub fn new(n_experts: usize, top_k: usize, d_expert: usize) -> Self {
        MoeConfig {
            n_experts,
            top_k,
            d_expert,
            router: RouterKind::Softmax,
            renormalize: true,
            capacity_factor: None,
            drop_policy: DropPolicy::Position,
            shared_expert: false,
            aux_loss_coef: 0.01,
            z_loss_coef: 0.0,
            bias_update_rate: 0.0,
            sinkhorn_iters: 0,
        }
    }

    /// Checks the fields; the message names them.
    pub fn validate(&self) -> Result<(), String> {
        let mut errors = vec![];
        if self.n_experts == 0 || self.d_expert == 0 {
            errors.push("moe.experts and moe.d_expert must be at least 1".to_string());
        }
        if self.top_k == 0 || self.top_k > self.n_experts {
            errors.push(format!(
                "moe.top_k = {} must be between 1 and moe.experts = {}",
                self.top_k, self.n_experts
            ));
        }
        if let Some(f) = self.capacity_factor
            && (f.is_nan() || f <= 0.0)
        {
            errors.push(format!(
                "moe.capacity_factor = {f} must be positive (or absent: dropless)"
            ));
        }
        for (name, v) in [
            ("moe.aux_loss_coef", self.aux_loss_coef),
            ("moe.z_loss_coef", self.z_loss_coef),
            ("moe.bias_update_rate", self.bias_update_rate),
        ] {
            if v.is_nan() || v < 0.0 {
                errors.push(format!("{name} = {v} must be zero or positive"));
            }
        }
        if errors.is_empty() {
            Ok(())
        } else {
            Err(errors.join("; "))
        }
    }

    /// A new layer for `d_model`-wide tokens holding every expert, its weights drawn by Burn's
    /// default initialiser for linear layers (without biases, as the reference model's). Every
    /// field after construction is public: replace the weights with your own (deterministic
    /// ones, to compare with a single-device run) as for any Burn module. Panics, naming the
    /// fields, when the configuration is invalid.
    ///
    /// ```
    /// use flashover_parallel::moe::MoeConfig;
    /// let moe = MoeConfig::new(4, 2, 16).init(8, &burn::tensor::Device::flex());
    /// assert_eq!((moe.experts.len(), moe.first_expert), (4, 0));
    /// assert_eq!(moe.router.weight.val().dims(), [8, 4]);
    /// ```
    pub fn init(&self, d_model: usize, device: &Device) -> Moe {
        if let Err(e) = self.validate() {
            panic!("invalid mixture-of-experts config: {e}");
        }
        let linear = |d_in, d_out| {
            burn::nn::LinearConfig::new(d_in, d_out)
                .with_bias(false)
                .init(device)
        };
        let swiglu = || SwiGlu {
            w_gate: linear(d_model, self.d_expert).into(),
            w_up: linear(d_model, self.d_expert).into(),
            w_down: linear(self.d_expert, d_model).into(),
        };
        Moe {
            router: linear(d_model, self.n_experts),
            experts: (0..self.n_experts).map(|_| swiglu()).collect(),
            shared: self.shared_expert.then(swiglu),
            first_expert: 0,
            config: self.clone(),
            expert_bias: vec![],
        }
    }

    /// Most assignments an expert takes from one sequence of `seq_len` tokens (`None`: no limit).
    pub fn capacity(&self, seq_len: usize) -> Option<usize> {
        self.capacity_factor.map(|f| {
            ((f * (seq_len * self.top_k) as f64 / self.n_experts as f64).ceil() as usize).max(1)
        })
    }

    /// Parameters of one layer: router, experts, shared expert.
    pub fn num_params(&self, d_model: usize) -> usize {
        let shared = self.shared_expert as usize * 3 * d_model * self.d_expert;
        d_model * self.n_experts + self.routed_params(d_model) + shared
    }

    /// Parameters of one layer's routed experts (what expert parallelism splits).
    pub fn routed_params(&self, d_model: usize) -> usize {
        self.n_experts * 3 * d_model * self.d_expert
    }
}

/// A mixture-of-experts feed-forward layer holding experts `first_expert ..
/// first_expert + experts.len()` of `config.n_experts` (all of them on one rank).
///
/// Its `Module` implementation (in `module.rs`) labels its fields by role, so that a plan finds
/// the layer, its router and its experts by type wherever they are in a model.
#[derive(Debug, Clone)]
pub struct Moe {
    /// Router `[d_model, n_experts]`.
    pub router: Linear,
    /// The experts this module holds, in global order from `first_expert`.
    pub experts: Vec<SwiGlu>,
    /// The shared expert, if configured.
    pub shared: Option<SwiGlu>,
    /// Global index of `experts[0]`.
    pub first_expert: usize,
    /// The layer's configuration.
    pub config: MoeConfig,
    /// Per expert, added to the router scores when choosing (auxiliary-loss-free balancing);
    /// empty when off. Not a parameter: [`Moe::update_bias`] moves it, checkpoints keep it in
    /// their run record.
    pub expert_bias: Vec<f32>,
}

/// Runs a layer's experts on tokens grouped by expert.
pub trait ExpertDispatch: Send + Sync {
    /// `tokens: [rows, d_model]`, `counts[e]` rows for global expert `e` in expert order;
    /// returns each row's expert output in the same order. `moe` holds this rank's experts.
    fn dispatch(&self, moe: &Moe, tokens: Tensor<2>, counts: &[usize]) -> Tensor<2>;

    /// The rows of `x: [tokens, d]` that go to the experts, `rows[i]` for row `i` (tokens may
    /// repeat, one row per kept choice). The default is a `select`; a dispatcher may fuse it.
    fn gather(&self, x: Tensor<2>, rows: &[usize]) -> Tensor<2> {
        let index = index_tensor(rows, [rows.len()], &x.device());
        x.select(0, index)
    }

    /// The expert outputs back per token: `outputs: [rows, d]` (in `routing`'s kept order)
    /// weighted by `weights: [tokens, top_k]` and summed over each token's kept choices, as
    /// `[tokens, d]`. The default is plain tensor operations ([`combine`]); a dispatcher may
    /// fuse it.
    fn combine(&self, outputs: Tensor<2>, weights: Tensor<2>, routing: &Routing) -> Tensor<2> {
        combine(outputs, weights, routing)
    }
}

/// [`ExpertDispatch::combine`] in tensor operations: each kept row times its weight, rows put
/// back in `[tokens, top_k]` slots (dropped slots read a zero row), summed over the slots.
pub fn combine(outputs: Tensor<2>, weights: Tensor<2>, routing: &Routing) -> Tensor<2> {
    let [rows, d] = outputs.dims();
    let [n, k] = weights.dims();
    let device = outputs.device();
    let dtype = outputs.dtype();
    let index = |v: &[usize]| index_tensor(v, [v.len()], &device);
    let w = weights
        .reshape([n * k])
        .select(0, index(&routing.choice))
        .reshape([rows, 1])
        .cast(dtype);
    let zero_row = Tensor::<2>::zeros([1, d], &device).cast(dtype);
    let padded = Tensor::cat(vec![outputs * w, zero_row], 0);
    padded
        .select(0, index(&routing.slots(n * k)))
        .reshape([n, k, d])
        .sum_dim(1)
        .reshape([n, d])
}

/// Every expert is local: each runs once on its rows.
#[derive(Debug, Clone, Copy, Default)]
pub struct LocalExperts;

impl ExpertDispatch for LocalExperts {
    fn dispatch(&self, moe: &Moe, tokens: Tensor<2>, counts: &[usize]) -> Tensor<2> {
        run_experts(&moe.experts, tokens, counts)
    }
}

/// Runs `experts[i]` on the next `counts[i]` rows of `tokens: [rows, d]`.
pub fn run_experts(experts: &[SwiGlu], tokens: Tensor<2>, counts: &[usize]) -> Tensor<2> {
    let [rows, d] = tokens.dims();
    if rows == 0 {
        return tokens;
    }
    let mut outputs = Vec::with_capacity(experts.len());
    let mut start = 0;
    for (expert, &n) in experts.iter().zip(counts) {
        if n > 0 {
            let x = tokens.clone().narrow(0, start, n).reshape([1, n, d]);
            outputs.push(expert.forward_expert(x).reshape([n, d]));
        }
        start += n;
    }
    Tensor::cat(outputs, 0)
}

/// The routing of whole sequences split across ranks, their length, and the split.
type WholeSequences = (Routing, usize, Arc<dyn SequenceShare>);

/// [`Moe::update_bias`] on a layer's routing bias `bias` held apart from its layer (a pipeline
/// rank keeps every layer's, so that any rank can save them).
pub fn update_expert_bias(bias: &mut Vec<f32>, routed: &[u64], config: &MoeConfig) {
    let rate = config.bias_update_rate as f32;
    if rate == 0.0 || routed.len() != config.n_experts {
        return;
    }
    bias.resize(routed.len(), 0.0);
    let mean = routed.iter().sum::<u64>() as f64 / routed.len() as f64;
    for (b, &load) in bias.iter_mut().zip(routed) {
        let gap = mean - load as f64;
        if gap != 0.0 {
            *b += rate * gap.signum() as f32;
        }
    }
}

impl Moe {
    /// Auxiliary-loss-free balancing after a step: `routed[e]` assignments went to expert `e`
    /// over the whole global batch; each bias moves by `bias_update_rate` towards the mean
    /// load (up for under-loaded experts, down for over-loaded ones). Every rank sees the same
    /// counts, so every rank's bias stays the same.
    pub fn update_bias(&mut self, routed: &[u64]) {
        update_expert_bias(&mut self.expert_bias, routed, &self.config);
    }

    /// `x: [batch, seq, d_model]` -> same shape, as layer `layer`, every expert run here
    /// ([`LocalExperts`]). Without an [`MoeHook`] in `ctx` the auxiliary losses and routing
    /// statistics are not collected.
    pub fn forward_with(&self, x: Tensor<3>, ctx: &ForwardContext, layer: usize) -> Tensor<3> {
        self.forward_dispatched(x, ctx, layer, &LocalExperts)
    }

    /// [`Self::forward_with`], the experts run through `dispatch` (the expert-parallel
    /// dispatcher when this layer holds only its rank's experts).
    pub fn forward_dispatched(
        &self,
        x: Tensor<3>,
        ctx: &ForwardContext,
        layer: usize,
        dispatch: &dyn ExpertDispatch,
    ) -> Tensor<3> {
        let [b, t, d] = x.dims();
        let n = b * t;
        let k = self.config.top_k;
        let xf = x.reshape([n, d]);
        // Routing runs in f32 under any precision policy (scores, weights, auxiliary losses).
        let logits = self.router.forward(xf.clone()).cast(FloatDType::F32); // [n, e]
        // The logits are f32 (cast above), as read.
        let host = |logits: Tensor<2>| -> Vec<f32> {
            let data = read(logits, Cause::Routing);
            data.try_into_vec::<f32>().expect("router logits are f32")
        };
        let bias = (!self.expert_bias.is_empty()).then_some(self.expert_bias.as_slice());
        // Under context parallelism, the whole sequences are routed (on every rank alike).
        let (routing, whole) = match (&ctx.sequence, &ctx.positions) {
            (Some(SequenceHook(sequence)), Some(positions)) if sequence.ranks() > 1 => {
                let e = self.config.n_experts;
                let all = sequence.gather(logits.clone().reshape([b, t, e]));
                let seq_len = all.dims()[1];
                let all = host(all.reshape([b * seq_len, e]));
                let whole = route(&all, seq_len, &self.config, bias);
                let mine = whole.restrict(b, seq_len, &positions[ctx.seq_offset..][..t]);
                (mine, Some((whole, seq_len, sequence.clone())))
            }
            _ => (route(&host(logits.clone()), t, &self.config, bias), None),
        };
        let device = xf.device();
        let scores = match self.config.router {
            RouterKind::Softmax => softmax(logits.clone(), 1),
            RouterKind::Sigmoid => sigmoid(logits.clone()),
        };
        let chosen = index_tensor(&routing.chosen, [n, k], &device);
        let mut weights = scores.clone().gather(1, chosen); // [n, k]
        if self.config.renormalize {
            weights = weights.clone() / weights.sum_dim(1);
        }
        if let Some(hook) = &ctx.moe {
            let (aux, values) = self.aux_losses(logits, scores, &routing, [b, t], whole);
            hook.record(layer, [&routing.routed, &routing.kept], values);
            if let Some(aux) = aux {
                hook.push_aux_loss(aux);
            }
        }
        let rows = routing.token.len();
        let dtype = xf.dtype();
        let routed = if rows == 0 {
            Tensor::<2>::zeros([n, d], &device).cast(dtype)
        } else {
            let tokens = dispatch.gather(xf.clone(), &routing.token);
            let out = dispatch.dispatch(self, tokens, &routing.kept);
            dispatch.combine(out, weights, &routing)
        };
        let out = match &self.shared {
            Some(shared) => routed + shared.forward_expert(xf.reshape([1, n, d])).reshape([n, d]),
            None => routed,
        };
        out.reshape([b, t, d])
    }

    /// The weighted sum of the load-balancing and z-losses of one forward (`None` if both
    /// weights are 0) and their unweighted values `[aux, z]` on the device, untracked (0 where
    /// a weight is 0; `None` if both are). With `whole` (the routing of the whole sequences,
    /// their length, and the ranks sharing them), the balancing loss counts the whole
    /// sequences' choices and this rank's part of their mean scores; it is weighted by the
    /// number of sharing ranks, whose gradients are averaged, and so is its value: summed over
    /// those ranks (as the step's routing sums are), the values are that many whole ones, as
    /// the forwards counted are that many.
    fn aux_losses(
        &self,
        logits: Tensor<2>,
        scores: Tensor<2>,
        routing: &Routing,
        [b, t]: [usize; 2],
        whole: Option<WholeSequences>,
    ) -> (Option<Tensor<1>>, Option<Tensor<1>>) {
        let (e, k) = (self.config.n_experts, self.config.top_k);
        let mut total: Option<Tensor<1>> = None;
        let device = logits.device().inner();
        let mut values = [None, None];
        if self.config.aux_loss_coef > 0.0 {
            let (chosen, seq_len) = match &whole {
                Some((whole, seq_len, _)) => (&whole.chosen, *seq_len),
                None => (&routing.chosen, t),
            };
            // f[s, x]: the share of sequence s's choices that picked expert x (before drops).
            let mut f = vec![0f32; b * e];
            for (c, &x) in chosen.iter().enumerate() {
                f[(c / k / seq_len) * e + x] += 1.0 / (seq_len * k) as f32;
            }
            let f = Tensor::<2>::from_data(TensorData::new(f, [b, e]), &logits.device());
            // P[s, x]: the mean normalised score of expert x over sequence s (this rank's
            // positions' part of it when the sequence is split).
            let p = (scores.clone() / scores.sum_dim(1)).reshape([b, t, e]);
            let p = match &whole {
                Some(_) => p.sum_dim(1).div_scalar(seq_len as f64),
                None => p.mean_dim(1),
            };
            let aux = (f * p.reshape([b, e]))
                .sum()
                .mul_scalar(e as f64 / b as f64);
            let weight = whole
                .as_ref()
                .map_or(1, |(_, _, sequence)| sequence.ranks()) as f64;
            let aux = aux.mul_scalar(weight);
            values[0] = Some(aux.clone().inner());
            total = Some(aux.mul_scalar(self.config.aux_loss_coef));
        }
        if self.config.z_loss_coef > 0.0 {
            let max = logits.clone().max_dim(1).detach();
            let lse = (logits - max.clone()).exp().sum_dim(1).log() + max;
            let z = lse.powi_scalar(2).mean();
            values[1] = Some(z.clone().inner());
            let z = z.mul_scalar(self.config.z_loss_coef);
            total = Some(match total {
                Some(a) => a + z,
                None => z,
            });
        }
        let values = match values {
            [None, None] => None,
            pair => Some(Tensor::cat(
                pair.map(|v| v.unwrap_or_else(|| Tensor::zeros([1], &device)))
                    .to_vec(),
                0,
            )),
        };
        (total, values)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(top_k: usize, capacity: Option<f64>, policy: DropPolicy) -> MoeConfig {
        MoeConfig {
            capacity_factor: capacity,
            drop_policy: policy,
            ..MoeConfig::new(2, top_k, 4)
        }
    }

    #[test]
    fn routing_picks_the_best_experts_ties_to_the_lowest_index_grouped_by_expert() {
        // Four tokens, two experts.
        let logits = [0.0, 1.0, 2.0, 0.0, 0.5, 0.5, 3.0, -1.0];
        let r = route(&logits, 4, &config(1, None, DropPolicy::Position), None);
        assert_eq!(r.chosen, vec![1, 0, 0, 0]);
        assert_eq!(
            r.token,
            vec![1, 2, 3, 0],
            "expert 0's rows, then expert 1's"
        );
        assert_eq!((r.kept.clone(), r.routed.clone()), (vec![3, 1], vec![3, 1]));
        // A bias changes the choice, not the order within an expert.
        let r = route(
            &logits,
            4,
            &config(1, None, DropPolicy::Position),
            Some(&[0.0, 2.0]),
        );
        assert_eq!(
            r.chosen,
            vec![1, 0, 1, 0],
            "token 1 ties (2 + 0 = 0 + 2): expert 0"
        );
    }

    #[test]
    fn capacity_is_per_sequence_and_the_policy_decides_who_stays() {
        // Two sequences of two tokens, top-2 of 2 experts: capacity ceil(0.5 * 2 * 2 / 2) = 1.
        let logits = [0.0, 1.0, 3.0, 0.0, 0.0, 1.0, 0.0, 2.0];
        let by_position = route(
            &logits,
            2,
            &config(2, Some(0.5), DropPolicy::Position),
            None,
        );
        // First choices first: in sequence 0, token 0 keeps expert 1, token 1 keeps expert 0.
        assert_eq!(by_position.kept, vec![2, 2]);
        assert_eq!(by_position.dropped(), 4);
        assert_eq!(
            by_position.choice[..2],
            [2, 5],
            "expert 0 keeps token 1's first choice, then token 2's second"
        );
        let by_probability = route(
            &logits,
            2,
            &config(2, Some(0.5), DropPolicy::Probability),
            None,
        );
        assert_eq!(by_probability.dropped(), 4);
        // Sequence 1: expert 0's two candidates weigh 0.27 (token 2) and 0.12 (token 3).
        assert!(by_probability.choice.contains(&5) && !by_probability.choice.contains(&7));
    }

    #[test]
    fn sinkhorn_routing_spreads_tokens_that_all_prefer_one_expert() {
        // Sixteen tokens of one sequence, four experts, every token leaning to expert 0.
        let logits: Vec<f32> = (0..16 * 4)
            .map(|i| (i as f32 * 1.7).sin() + if i % 4 == 0 { 1.5 } else { 0.0 })
            .collect();
        let max_load = |iters| {
            let config = MoeConfig {
                sinkhorn_iters: iters,
                ..MoeConfig::new(4, 1, 4)
            };
            let r = route(&logits, 16, &config, None);
            assert_eq!(r.routed.iter().sum::<usize>(), 16);
            *r.routed.iter().max().unwrap()
        };
        let (plain, balanced) = (max_load(0), max_load(20));
        assert!(plain >= 10, "the skew must show without balancing: {plain}");
        assert!(
            balanced <= 6,
            "balanced: most tokens on one expert {balanced} (plain {plain})"
        );
    }

    #[test]
    fn the_routing_bias_moves_towards_the_mean_load() {
        let mut moe = Moe {
            router: burn::nn::LinearConfig::new(2, 3)
                .with_bias(false)
                .init(&burn::tensor::Device::flex()),
            experts: vec![],
            shared: None,
            first_expert: 0,
            config: MoeConfig {
                bias_update_rate: 0.5,
                ..MoeConfig::new(3, 1, 4)
            },
            expert_bias: vec![],
        };
        moe.update_bias(&[6, 3, 0]);
        assert_eq!(moe.expert_bias, vec![-0.5, 0.0, 0.5]);
    }
}

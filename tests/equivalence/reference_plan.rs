//! The reference transformer parallelized by its own plan (`flashover_models::transformer`), as a
//! user's model is, against its plain single-rank Burn loop: losses, gradient norms (clipping
//! active) and every weight within 1e-5, under tensor (and sequence) parallelism, fully
//! sharded parameters over it, pipelines (1F1B and zero-bubble) and all of them with
//! recomputation.

use super::plan_loops::{
    GLOBAL_BATCH, MAX_NORM, Run, STEPS, differences, plan_loop, reference_loop,
};
use burn::tensor::{Device, Int, Tensor, TensorData};
use flashover_models::transformer::{self, LmBatch};
use flashover_models::{
    Block, Dropout, ForwardContext, MoeConfig, MoeHook, Transformer, TransformerConfig,
};
use flashover_parallel::ParallelError;
use flashover_parallel::activation_checkpointing::CheckpointPolicy;
use flashover_parallel::parallelize::{ContextParallelRule, ParallelizePlan, parallelize};
use flashover_parallel::pipeline::ScheduleKind;
use flashover_runtime::{Axis, Launch, OpKind};

const VOCAB: usize = 32;
/// Divisible by 2 (sequence parallelism over tp = 2).
const SEQ: usize = 8;
const SEED: u64 = 5;

/// Four heads of 8 over two blocks.
fn config(tied: bool) -> TransformerConfig {
    TransformerConfig {
        tie_embeddings: tied,
        ..TransformerConfig::new(VOCAB, 32, 2, 4, 48)
    }
}

/// Samples `range` of an endless deterministic token stream: `(inputs, targets)`, each
/// `[samples, SEQ]`, the targets the inputs shifted by one.
fn batch(range: std::ops::Range<usize>, device: &Device) -> (Tensor<2, Int>, Tensor<2, Int>) {
    let n = range.len();
    let token = |s: usize, j: usize| ((s * 7 + j * 3 + (s * j) % 5) % VOCAB) as i64;
    let rows = |shift: usize| -> Vec<i64> {
        range
            .clone()
            .flat_map(|s| (0..SEQ).map(move |j| token(s, j + shift)))
            .collect()
    };
    let tensor = |data| Tensor::from_data(TensorData::new(data, [n, SEQ]), device);
    (tensor(rows(0)), tensor(rows(1)))
}

/// Dropout (probability `p`) of step `step`, the same on one device and in every layout.
fn dropout(p: f64, step: usize) -> Dropout {
    Dropout {
        p,
        seed: 11,
        step: step as u64,
    }
}

/// The model's plain loop on one device: the next-token loss and, with experts, their
/// auxiliary losses (collected by a hook whose experts run locally).
fn single_rank(config: &TransformerConfig) -> Run {
    single_rank_with(config, 0.0)
}

/// [`single_rank`] with dropout of probability `p` (none at 0).
fn single_rank_with(config: &TransformerConfig, p: f64) -> Run {
    let device = Device::flex().autodiff();
    reference_loop(config.init(SEED, &device), |model, samples| {
        let step = samples.start / GLOBAL_BATCH;
        let sample_offset = samples.start;
        let (x, y) = batch(samples, &device);
        let hook = MoeHook::new();
        let ctx = ForwardContext {
            moe: Some(hook.clone()),
            dropout: (p > 0.0).then(|| dropout(p, step)),
            sample_offset,
            ..ForwardContext::default()
        };
        let loss = model.forward_loss(x, y, &ctx);
        // Routing biases that move (auxiliary-loss-free balancing) move by this batch's loads.
        transformer::update_routing_biases(model, &hook.take_stats().routed);
        match hook.take_aux_loss() {
            Some(aux) => loss + aux,
            None => loss,
        }
    })
}

/// The same loop under `plan` on `mesh` (through the pipeline when the plan has one): rank
/// 0's run, and every rank's stored parameter elements.
fn parallel(mesh: &str, config: &TransformerConfig, plan: &ParallelizePlan) -> (Run, Vec<usize>) {
    parallel_with(mesh, config, plan, 0.0)
}

/// [`parallel`] with dropout of probability `p` (none at 0).
fn parallel_with(
    mesh: &str,
    config: &TransformerConfig,
    plan: &ParallelizePlan,
    p: f64,
) -> (Run, Vec<usize>) {
    let new = |device: &Device| config.init(SEED, device);
    let experts = config.moe.as_ref().map_or(0, |moe| moe.n_experts);
    plan_loop(mesh, plan, new, |model, par, step, ctx, device| {
        // One hook counts the step's routing, over its layers and micro-batches.
        let counted = transformer::forward_context().moe;
        let (grads, loss, norm) = if par.pipeline().is_ok() {
            // Each micro-batch runs in its samples' context: the masks of its sample indices.
            let micro_batch = |samples: std::ops::Range<usize>| {
                let start = samples.start;
                let (x, y) = batch(samples, device);
                // Under context parallelism, this rank's positions of every sequence.
                let share = |t| {
                    par.sequences()
                        .share(t, 1)
                        .expect("the sequence splits over cp")
                };
                let mut batch = LmBatch::from((share(x), share(y)));
                if p > 0.0 {
                    batch.ctx = transformer::dropout_context(model, dropout(p, step), start, SEQ);
                }
                batch.ctx = transformer::split_sequences(par, model, batch.ctx, SEQ)
                    .expect("the sequence splits over cp");
                batch.ctx.moe = counted.clone();
                batch
            };
            let clip = Some(MAX_NORM);
            let out = par
                .pipeline()?
                .step(model, GLOBAL_BATCH, step, &micro_batch, clip, ctx)?;
            let values = out.scalars.read();
            (out.grads, values.loss + values.aux_loss, values.norm)
        } else {
            let samples = par.data().batch_share(GLOBAL_BATCH, step)?;
            let mut fwd = match p > 0.0 {
                true => transformer::dropout_context(model, dropout(p, step), samples.start, SEQ),
                false => transformer::forward_context(),
            };
            fwd.moe = counted.clone();
            let fwd = transformer::split_sequences(par, model, fwd, SEQ)?;
            let (x, y) = batch(samples, device);
            let (x, y) = (par.sequences().share(x, 1)?, par.sequences().share(y, 1)?);
            // Fully sharded units gathered one collective each (a no-op without any).
            let loss = par.forward(model, |m| transformer::objective_in(m, x, y, &fwd))?;
            let mean = par.data().mean_loss(loss.clone().into_scalar::<f32>())?;
            let (grads, norm) = par.gradients(model, loss.backward(), Some(MAX_NORM), ctx)?;
            (grads, mean, norm.value())
        };
        if let Some(hook) = counted.filter(|_| experts > 0) {
            let loads = par
                .experts()
                .loads(&hook.take_stats(), config.n_layers, experts)?;
            transformer::update_routing_biases(model, &loads);
        }
        Ok((grads, loss, norm))
    })
}

#[test]
fn the_reference_transformer_under_its_own_plan_trains_as_one_rank() {
    let one_f_one_b = |config: &TransformerConfig, micro| {
        transformer::pipeline(config, ScheduleKind::OneFOneB, micro)
    };
    for tied in [true, false] {
        let config = config(tied);
        let reference = single_rank(&config);
        assert!(
            reference.1.iter().filter(|n| **n > MAX_NORM).count() >= STEPS / 2,
            "clipping must be active: {:?}",
            reference.1
        );
        let whole = reference.2.len();
        let split = transformer::plan(&config).unwrap();
        let whole_sequences = ParallelizePlan {
            sequence_parallel: vec![],
            ..split.clone()
        };
        let cases = [
            ("tp=2", split.clone()),
            ("tp=2", whole_sequences.clone()),
            ("dp=2,tp=2", whole_sequences.clone()),
            (
                "dp=2,fsdp=2,tp=2",
                whole_sequences.clone().fully_shard("blocks"),
            ),
            ("fsdp=2,tp=2", split.clone().fully_shard("")),
            (
                "dp=2,pp=2",
                ParallelizePlan::new().pipeline(one_f_one_b(&config, 4)),
            ),
            (
                "fsdp=2,tp=2,pp=2",
                split
                    .clone()
                    .fully_shard("")
                    .pipeline(one_f_one_b(&config, 2))
                    .activation_checkpointing(CheckpointPolicy::Full),
            ),
            // Zero-bubble: the weight gradients of its linear layers (split or not) deferred.
            (
                "pp=2",
                ParallelizePlan::new().pipeline(transformer::pipeline(
                    &config,
                    ScheduleKind::ZeroBubbleH1,
                    4,
                )),
            ),
            (
                "dp=2,tp=2,pp=2",
                split.clone().pipeline(transformer::pipeline(
                    &config,
                    ScheduleKind::ZeroBubbleH1,
                    2,
                )),
            ),
        ];
        for (mesh, plan) in cases {
            let (run, held) = parallel(mesh, &config, &plan);
            let (loss, norm, weights) = differences(&run, &reference);
            let what = format!(
                "{mesh} tied={tied} sp={} fsdp={} pp={:?}",
                !plan.sequence_parallel.is_empty(),
                !plan.fully_shard.is_empty(),
                plan.pipeline.as_ref().map(|p| p.schedule.to_string())
            );
            println!("{what}: losses {loss:.1e}, norms {norm:.1e}, weights {weights:.1e}");
            assert!(
                loss < 1e-5 && norm < 1e-5 && weights < 1e-5,
                "{what}: losses {loss:e}, norms {norm:e}, weights {weights:e}"
            );
            // Every rank of a split layout holds less than the whole model.
            assert!(
                held.iter().all(|h| *h < whole),
                "{what}: held {held:?} of {whole}"
            );
        }
    }
}

#[test]
fn the_reference_plan_refuses_what_it_cannot_split_with_the_reason() {
    // Three heads do not split over two ranks: the rule's unit (a head) names the cause.
    let three_heads = TransformerConfig::new(VOCAB, 24, 1, 3, 32);
    let plan = transformer::plan(&three_heads).unwrap();
    let err = Launch::new("tp=2")
        .unwrap()
        .run(|ctx| {
            let device = Device::flex().autodiff();
            parallelize(three_heads.init(SEED, &device), &plan, &ctx).map(|_| ())
        })
        .unwrap_err()
        .to_string();
    assert!(err.contains("blocks.0.attn.wq"), "{err}");
}

#[test]
fn the_reference_transformer_under_its_own_plan_with_dropout_trains_as_one_rank() {
    let config = config(true);
    let reference = single_rank_with(&config, 0.1);
    // Dropout changes the run: the comparison below sees the masks.
    let without = single_rank(&config);
    assert!(differences(&reference, &without).0 > 1e-3);
    let split = transformer::plan(&config).unwrap();
    let whole_sequences = ParallelizePlan {
        sequence_parallel: vec![],
        ..split.clone()
    };
    let pipeline = transformer::pipeline(&config, ScheduleKind::OneFOneB, 2);
    let cases = [
        ("dp=2", ParallelizePlan::new()),
        ("tp=2", split.clone()),
        ("tp=2", whole_sequences.clone()),
        ("dp=2,tp=2", whole_sequences.clone()),
        ("fsdp=2,tp=2", split.clone().fully_shard("")),
        // Pipelines: every stage's layers read their micro-batch's context (its sample
        // offset), and a recomputed layer keeps it for its rerun in backward.
        ("pp=2", ParallelizePlan::new().pipeline(pipeline.clone())),
        (
            "dp=2,pp=2",
            ParallelizePlan::new().pipeline(pipeline.clone()),
        ),
        ("tp=2,pp=2", split.clone().pipeline(pipeline.clone())),
        (
            "fsdp=2,pp=2",
            ParallelizePlan::new()
                .fully_shard("")
                .pipeline(pipeline.clone())
                .activation_checkpointing(CheckpointPolicy::Full),
        ),
        (
            "tp=2,pp=2",
            whole_sequences
                .pipeline(pipeline.clone())
                .activation_checkpointing(CheckpointPolicy::Full),
        ),
    ];
    assert_layouts_match(&config, &reference, cases, 0.1);
}

/// Each `(mesh, plan)` of `cases` trains `config` (dropout `p`) as `reference` does, within
/// 1e-5: losses, gradient norms and weights.
fn assert_layouts_match<const N: usize>(
    config: &TransformerConfig,
    reference: &Run,
    cases: [(&str, ParallelizePlan); N],
    p: f64,
) {
    for (mesh, plan) in cases {
        let (run, _) = parallel_with(mesh, config, &plan, p);
        let (loss, norm, weights) = differences(&run, reference);
        let what = format!(
            "{mesh} sp={} dropout={p}",
            !plan.sequence_parallel.is_empty()
        );
        println!("{what}: losses {loss:.1e}, norms {norm:.1e}, weights {weights:.1e}");
        assert!(
            loss < 1e-5 && norm < 1e-5 && weights < 1e-5,
            "{what}: losses {loss:e}, norms {norm:e}, weights {weights:e}"
        );
    }
}

#[test]
fn the_reference_mixture_of_experts_model_under_its_own_plan_trains_as_one_rank() {
    let config = TransformerConfig {
        moe: Some(MoeConfig::new(4, 2, 16)),
        ..config(true)
    };
    let reference = single_rank(&config);
    assert_layouts_match(&config, &reference, moe_layouts(&config, false), 0.0);
}

/// The layouts the mixture-of-experts model is checked in: ep, dp x ep, fsdp x ep in units,
/// tp with sp, ep x tp, pp x ep and pp x fsdp (its layers recomputed if `recompute`).
fn moe_layouts(
    config: &TransformerConfig,
    recompute: bool,
) -> [(&'static str, ParallelizePlan); 7] {
    let experts = transformer::plan(config).unwrap();
    let whole_sequences = ParallelizePlan {
        sequence_parallel: vec![],
        ..experts.clone()
    };
    let pipeline = transformer::pipeline(config, ScheduleKind::OneFOneB, 2);
    let policy = match recompute {
        true => CheckpointPolicy::Full,
        false => CheckpointPolicy::None,
    };
    [
        ("ep=2", experts.clone()),
        ("dp=2,ep=2", experts.clone()),
        ("fsdp=2,ep=2", experts.clone().fully_shard("")),
        ("tp=2", experts.clone()),
        ("ep=2,tp=2", whole_sequences),
        ("pp=2,ep=2", experts.clone().pipeline(pipeline.clone())),
        (
            "pp=2,fsdp=2",
            experts
                .fully_shard("")
                .pipeline(pipeline)
                .activation_checkpointing(policy),
        ),
    ]
}

#[test]
fn routing_biases_move_by_the_whole_batchs_loads_under_the_reference_plan() {
    // Auxiliary-loss-free balancing: every rank moves every layer's routing bias by the whole
    // batch's expert loads (summed over the data and pipeline ranks), as one device does.
    let moving = |rate| TransformerConfig {
        moe: Some(MoeConfig {
            bias_update_rate: rate,
            ..MoeConfig::new(4, 2, 16)
        }),
        ..config(true)
    };
    let config = moving(1e-2);
    let reference = single_rank(&config);
    // The biases change the routing: the comparison below sees them.
    assert!(differences(&reference, &single_rank(&moving(0.0))).0 > 1e-4);
    assert_layouts_match(&config, &reference, moe_layouts(&config, true), 0.0);
    let experts = transformer::plan(&config).unwrap();
    let pipeline = transformer::pipeline(&config, ScheduleKind::OneFOneB, 2);
    // A stage reads only its own layers' biases, so the runs above cannot see the others'.
    // Every rank moves them all by the same loads: after a step each holds the same biases,
    // not all zero.
    let plan = experts.pipeline(pipeline);
    let biases = Launch::new("pp=2,ep=2")
        .unwrap()
        .run(|ctx| {
            let device = Device::flex().autodiff();
            let (mut model, par) = parallelize(config.init(SEED, &device), &plan, &ctx)?;
            let counted = transformer::forward_context().moe;
            let micro_batch = |samples| {
                let mut batch = LmBatch::from(batch(samples, &device));
                batch.ctx.moe = counted.clone();
                batch
            };
            par.pipeline()?
                .step(&model, GLOBAL_BATCH, 0, &micro_batch, None, &ctx)?;
            let stats = counted.expect("a hook").take_stats();
            let loads = par.experts().loads(&stats, config.n_layers, 4)?;
            transformer::update_routing_biases(&mut model, &loads);
            let bias = |b: &Block| b.moe.as_ref().map(|moe| moe.expert_bias.clone());
            Ok::<_, ParallelError>(model.blocks.iter().map(bias).collect::<Vec<_>>())
        })
        .unwrap();
    assert!(biases.iter().all(|b| *b == biases[0]), "{biases:?}");
    let moved = |layer: &Option<Vec<f32>>| layer.iter().flatten().any(|b| *b != 0.0);
    assert!(biases[0].iter().all(moved), "{biases:?}");
}

#[test]
fn the_reference_transformer_splits_sequences_under_a_plan() {
    // A context_parallel rule naming no attention cores: the reference model's attention
    // reaches the other cp ranks' positions through the forward context
    // (`transformer::split_sequences`), each rank computing its positions of every sequence.
    let config = config(true);
    let reference = single_rank(&config);
    let split = transformer::plan(&config).unwrap();
    let ring = ContextParallelRule::ring(&[]);
    let pipeline = transformer::pipeline(&config, ScheduleKind::OneFOneB, 2);
    let cases = [
        (
            "cp=2",
            ParallelizePlan::new().context_parallel(ring.clone()),
        ),
        (
            "dp=2,cp=2",
            ParallelizePlan::new().context_parallel(ContextParallelRule::all_to_all(&[])),
        ),
        ("tp=2,cp=2", split.clone().context_parallel(ring.clone())),
        (
            "fsdp=2,cp=2",
            ParallelizePlan::new()
                .fully_shard("")
                .context_parallel(ring.clone().contiguous()),
        ),
        (
            "pp=2,cp=2",
            ParallelizePlan::new()
                .pipeline(pipeline.clone())
                .context_parallel(ring.clone()),
        ),
        (
            "tp=2,pp=2,cp=2",
            split
                .clone()
                .pipeline(pipeline)
                .context_parallel(ring.clone())
                .activation_checkpointing(CheckpointPolicy::Full),
        ),
    ];
    assert_layouts_match(&config, &reference, cases, 0.0);
    // With dropout: each rank draws the one-device masks at its positions.
    let dropped = single_rank_with(&config, 0.1);
    let cases = [(
        "cp=2",
        ParallelizePlan::new().context_parallel(ring.clone()),
    )];
    assert_layouts_match(&config, &dropped, cases, 0.1);
    // A mixture of experts routes whole sequences.
    let moe = TransformerConfig {
        moe: Some(MoeConfig::new(4, 2, 16)),
        ..config.clone()
    };
    let experts = transformer::plan(&moe)
        .unwrap()
        .context_parallel(ring.clone());
    let cases = [("ep=2,cp=2", experts)];
    assert_layouts_match(&moe, &single_rank(&moe), cases, 0.0);
    // Without the context's attention, each rank's positions would see only each other: the
    // step is refused, naming the way.
    let plan = ParallelizePlan::new().context_parallel(ring);
    let err = Launch::new("cp=2")
        .unwrap()
        .run(|ctx| {
            let device = Device::flex().autodiff();
            let (model, par) = parallelize(config.init(SEED, &device), &plan, &ctx)?;
            let (x, y) = batch(0..2, &device);
            let (x, y) = (par.sequences().share(x, 1)?, par.sequences().share(y, 1)?);
            let loss = transformer::objective(&model, x, y);
            par.gradients(&model, loss.backward(), None, &ctx)
                .map(|_| ())
        })
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("no attention attended") && err.contains("sequences().forward_context"),
        "{err}"
    );
}

/// Without the plan's forward context a split layer is read whole, which panics naming the
/// parameter rather than computing an unsplit model.
/// The reference transformer's layers are the library's (`nn::Linear`, `nn::Embedding`,
/// `nn::OutputHead`): split by a plan, a dense model computes the same loss in a context of
/// its own as in the plan's forward context, which only its mixture-of-experts layers need.
#[test]
fn the_reference_transformer_split_by_a_plan_computes_in_any_forward_context() {
    let config = config(true);
    let plan = transformer::plan(&config).unwrap();
    let losses = Launch::new("tp=2")
        .unwrap()
        .run(|ctx| {
            let device = Device::flex().autodiff();
            let (model, _par): (Transformer, _) =
                parallelize(config.init(SEED, &device), &plan, &ctx)?;
            let (x, y) = batch(0..2, &device);
            let own = model.forward_loss(x.clone(), y.clone(), &ForwardContext::default());
            let plans = model.forward_loss(x, y, &transformer::forward_context());
            Ok::<_, ParallelError>((own.into_scalar::<f32>(), plans.into_scalar::<f32>()))
        })
        .unwrap();
    for (rank, (own, plans)) in losses.iter().enumerate() {
        assert_eq!(
            own.to_bits(),
            plans.to_bits(),
            "rank {rank}: {own} vs {plans}"
        );
    }
}

/// Under `fsdp` a split layer's weight is gathered where the forward reads it, once: reading
/// how a layer is split (to share q, k and v's entry into the tensor-parallel region) gathers
/// nothing.
#[test]
fn each_fully_sharded_weight_is_gathered_once_per_read() {
    let config = config(true);
    let plan = transformer::plan(&config).unwrap().fully_shard("");
    let gathers = Launch::new("fsdp=2,tp=2")
        .unwrap()
        .run(|ctx| {
            let device = Device::flex().autodiff();
            let (model, par) = parallelize(config.init(SEED, &device), &plan, &ctx)?;
            let fsdp = ctx.group(Axis::Fsdp);
            let all_gathers = |forward: &dyn Fn()| {
                let before = fsdp.stats();
                forward();
                let ops = fsdp.stats().since(&before).ops;
                ops.get(&OpKind::AllGather).map_or(0, |s| s.calls)
            };
            let forward = |m: &Transformer| {
                let (x, y) = batch(0..2, &device);
                m.forward_loss(x, y, &transformer::forward_context())
            };
            let one_by_one = all_gathers(&|| drop(forward(&model)));
            let in_units = all_gathers(&|| drop(par.forward(&model, |m| forward(m)).unwrap()));
            Ok::<_, ParallelError>((one_by_one, in_units, par.sharded().units().to_vec()))
        })
        .unwrap();
    // Read one by one: nine parameters per block (seven weights, two norms), the final norm,
    // and the tied table as embedding and as head. In units: one per block and one for the
    // rest.
    let blocks = config.n_layers as u64;
    for (one_by_one, in_units, units) in gathers {
        assert_eq!(one_by_one, 9 * blocks + 3);
        assert_eq!(in_units, blocks + 1, "{units:?}");
    }
}

//! One rank's training loop: set up what the job asks (groups, context parallelism, the batch
//! plan, the model parallelized by the job's plan, the precision policy), then for each step
//! its batches, the plan's step, the step record and the checkpoints.

use super::checkpoint::Saver;
use super::config::TrainConfig;
use super::metrics::{RankMetrics, StepFacts, step_record};
use super::report::{DeviceMemory, StepRecord, axis_comm, host_buffer_calls};
use super::run::make_batch;
use super::strategy::{self, PendingScalars, PlanPipeline, StepOutcome};
use super::trace::Trace;
use burn::tensor::{Device, Int, Tensor};
use flashover_data::{BatchPlan, TokenSource};
use flashover_models::{Dropout, ForwardContext, Transformer, TransformerConfig};
use flashover_parallel::context_parallel::{AttentionWork, ContextParallel};
use flashover_parallel::data_parallel::ReductionTiming;
use flashover_parallel::parallelize::StepScalars;
use flashover_parallel::precision::LossScaler;
use flashover_runtime::transfers::{self, Cause};
use flashover_runtime::{Axis, CommunicatorExt, Group, RankContext, RankError, control};
use std::time::Instant;

/// What rank 0 hands back: its step records, the final parameters by name, buckets per step,
/// and when they were reduced.
pub(crate) type RankOutput = Option<(
    Vec<StepRecord>,
    Vec<(String, Vec<f32>)>,
    usize,
    ReductionTiming,
)>;

/// Everything a rank's steps read, set up once.
struct Rank<'a> {
    ctx: &'a RankContext,
    config: &'a TrainConfig,
    source: &'a dyn TokenSource,
    /// The autodiff device (with Burn's balanced checkpointing under `selective`).
    device: Device,
    /// Which samples each micro-batch of each step holds on this rank.
    plan: BatchPlan,
    /// Context parallelism: this rank's share of every sequence.
    context: Option<ContextParallel>,
    /// The ranks whose gradients are averaged (`dp x fsdp x ep x cp`).
    grad_group: Group,
}

impl<'a> Rank<'a> {
    fn new(
        ctx: &'a RankContext,
        config: &'a TrainConfig,
        model_config: &TransformerConfig,
        source: &'a dyn TokenSource,
    ) -> Result<Self, RankError> {
        // Burn's balanced checkpointing is the autodiff device's (selective recomputation, and
        // ZeRO-3's units resharding after forward); block-level recomputation is the plan's
        // (its pipeline rule's layers).
        let balanced = config.parallel.activation_checkpointing.is_selective()
            || strategy::plan_pipeline::reshards(config);
        let device = match balanced {
            true => ctx.device().clone().autodiff().gradient_checkpointing(),
            false => ctx.device().clone().autodiff(),
        };
        // Every data-parallel rank (replica or shard) reads its own slice of the batch.
        let batch_group = ctx.subgroup(&[Axis::Dp, Axis::Fsdp, Axis::Ep])?;
        let context = context_split(ctx, config, model_config)?;
        // Context-parallel ranks read the same samples and keep different positions of them;
        // their gradients are averaged together with the data-parallel ranks'.
        let grad_group = match context {
            Some(_) => ctx.subgroup(&[Axis::Dp, Axis::Fsdp, Axis::Ep, Axis::Cp])?,
            None => batch_group.clone(),
        };
        let plan = BatchPlan::new(
            config.run.global_batch,
            batch_group.size(),
            batch_group.rank(),
            config.run.micro_batches,
        )?;
        Ok(Rank {
            ctx,
            config,
            source,
            device,
            plan,
            context,
            grad_group,
        })
    }

    /// The seeded model, the same on every rank.
    fn model(&self, model_config: &TransformerConfig) -> Transformer {
        model_config.init(self.config.run.seed, &self.device)
    }

    /// Micro-batch `micro` of step `step` on this rank: inputs, targets and the forward
    /// context (dropout keyed by global sample index, so the same in every layout).
    fn batch(&self, step: usize, micro: usize) -> (Tensor<2, Int>, Tensor<2, Int>, ForwardContext) {
        let config = self.config;
        let samples = self.plan.indices(step as u64, micro);
        let fwd = ForwardContext {
            dropout: (config.model.dropout > 0.0).then_some(Dropout {
                p: config.model.dropout,
                seed: config.run.seed,
                step: step as u64,
            }),
            sample_offset: samples.start as usize,
            ..ForwardContext::default()
        };
        let seq_len = config.data.seq_len;
        let (inputs, targets) = make_batch(self.source, samples, seq_len, &self.device);
        match &self.context {
            Some(cp) => (
                cp.local_tokens(inputs),
                cp.local_tokens(targets),
                cp.forward_context(fwd),
            ),
            None => (inputs, targets, fwd),
        }
    }

    /// One step of `strategy`, and what this rank measured of it.
    fn step(
        &self,
        strategy: Box<PlanPipeline>,
        step: usize,
        scaler: &mut LossScaler,
    ) -> Result<(Box<PlanPipeline>, StepOutcome, RankMetrics, Instant), RankError> {
        let ctx = self.ctx;
        let stats_before = ctx.comm_stats();
        let traffic_before = ctx.traffic_by_axis();
        let buffers_before = ctx.host_buffers().unwrap_or_default();
        let reads_before = transfers::thread_reads();
        let t0 = Instant::now();
        let attention_before = self
            .context
            .as_ref()
            .map(|cp| cp.work())
            .unwrap_or_default();
        let clip = self.config.optim.clip.filter(|&c| c > 0.0);
        let micro_batches = self.plan.micro_batches();
        let mut batches = |micro| self.batch(step, micro);
        let lr = self.config.lr_at(step);
        let (strategy, outcome) =
            strategy.step(ctx, clip, &mut batches, micro_batches, lr, scaler)?;
        let attention = outcome.attention.unwrap_or_else(|| {
            self.context
                .as_ref()
                .map_or(AttentionWork::default(), |cp| {
                    cp.work().since(&attention_before)
                })
        });
        let idle = ctx.comm_stats().since(&stats_before).total().wait;
        // From the device's allocator where the backend reports it (not Flex).
        let device_usage = ctx.device().memory_pool_usage();
        let metrics = RankMetrics {
            // Filled in when the job reads the step's scalars (`run.log_every`).
            loss: f64::NAN,
            step_s: t0.elapsed().as_secs_f64(),
            bubble_s: outcome.bubble.as_secs_f64(),
            idle_s: idle.as_secs_f64(),
            grad_norm: f64::NAN,
            memory: outcome.memory,
            in_flight: outcome.in_flight,
            pipeline_s: outcome.pipeline.as_secs_f64(),
            a2a_s: outcome.a2a.as_secs_f64(),
            attention_s: attention.compute.as_secs_f64(),
            attention_scores: attention.score_elements,
            recomputed_blocks: outcome.recomputed as u64,
            device_memory: device_usage.map(|u| DeviceMemory {
                in_use: u.bytes_in_use,
                reserved: u.bytes_reserved,
            }),
            axes: axis_comm(&ctx.traffic_by_axis(), &traffic_before),
            host_buffers: host_buffer_calls(
                &ctx.host_buffers().unwrap_or_default(),
                &buffers_before,
            ),
            host_reads: reads_since(&reads_before),
        };
        Ok((strategy, outcome, metrics, t0))
    }

    /// Saves the state after `done` steps (collective).
    fn save(
        &self,
        saver: &mut Saver,
        strategy: &PlanPipeline,
        scaler: &LossScaler,
        done: usize,
    ) -> Result<(), RankError> {
        let config = self.config;
        let (state, param_replicas, moment_replicas) =
            strategy.local_state(self.ctx, &self.grad_group)?;
        let pieces = state.pieces_for(param_replicas, moment_replicas);
        let run = serde_json::json!({
            "step": done,
            "adamw_steps": state.steps_taken,
            "seed": config.run.seed,
            "mesh": config.parallel.mesh,
            "zero": config.parallel.zero,
            "config": config,
            "moe_bias": strategy.moe_bias(),
            "loss_scale": scaler.is_active().then(|| scaler.state()),
        });
        saver
            .save(self.ctx.world(), done as u64, run, pieces)
            .map_err(RankError::from)
    }

    /// Where training starts: a resumed checkpoint's step, or 0 (after loading
    /// `checkpoint.init_from`'s weights if set).
    fn load_initial(
        &self,
        strategy: &mut PlanPipeline,
        scaler: &mut LossScaler,
    ) -> Result<usize, RankError> {
        let ckpt = &self.config.checkpoint;
        if let Some(path) = &ckpt.resume {
            return resume(
                self.ctx,
                self.config,
                strategy,
                scaler,
                &self.grad_group,
                path,
            );
        }
        if let Some(path) = &ckpt.init_from {
            let file = flashover_checkpoint::ModelFile::open(path)
                .map_err(|e| RankError::from(format!("checkpoint.init_from: {e}")))?;
            let (mut state, _, _) = strategy.local_state(self.ctx, &self.grad_group)?;
            state
                .load_params(&file)
                .map_err(|e| RankError::from(format!("checkpoint.init_from: {e}")))?;
            strategy.restore(state)?;
        }
        Ok(0)
    }

    /// The checkpoint writer the job asks for, if any.
    fn saver(&self) -> Option<Saver> {
        let ckpt = &self.config.checkpoint;
        match (&ckpt.dir, ckpt.save_every) {
            (Some(dir), every) if every > 0 => Some(Saver::new(
                dir,
                ckpt.keep,
                ckpt.async_save,
                ckpt.fail_after_write
                    .filter(|(rank, _)| *rank == self.ctx.rank())
                    .map(|(_, step)| step as u64),
            )),
            _ => None,
        }
    }
}

/// Rank `ctx`'s whole job: `emit` sees every step's record on rank 0.
pub(crate) fn train_rank(
    ctx: &RankContext,
    config: &TrainConfig,
    model_config: &TransformerConfig,
    source: &dyn TokenSource,
    emit: &dyn Fn(&StepRecord),
    origin: Instant,
) -> Result<RankOutput, RankError> {
    let rank = Rank::new(ctx, config, model_config, source)?;
    // The plan cuts the stages and spreads the experts itself, from the whole model.
    let model = rank.model(model_config);
    let mut strategy =
        strategy::plan_pipeline::build(ctx, config, model_config, model, &rank.grad_group)?;
    let policy = config.precision.policy()?;
    policy.check(&rank.device)?;
    // The job's running loss scale (a resumed checkpoint's), which the plan scales by.
    let mut scaler = policy.scaler();
    let first_step = rank.load_initial(&mut strategy, &mut scaler)?;
    let mut saver = rank.saver();
    let last_step = config
        .run
        .exit_after
        .map_or(config.run.steps, |e| e.min(config.run.steps));
    // A resumed run with nothing left to train (offline resharding) saves what it loaded.
    if first_step >= last_step
        && let Some(saver) = saver.as_mut()
    {
        rank.save(saver, &strategy, &scaler, first_step)?;
    }
    let tokens_per_step = (config.run.global_batch * config.data.seq_len) as f64;
    let mut records = vec![];
    let mut trace = Trace::new(origin);
    // Steps whose loss and norm are still on the device, read together every `log_every`.
    let mut unread: Vec<(StepFacts, RankMetrics, PendingScalars)> = vec![];
    for step in first_step..last_step {
        fire_drills(ctx, config, step);
        let (next, mut outcome, mine, t0) = rank.step(strategy, step, &mut scaler)?;
        strategy = next;
        if config.run.trace.is_some() {
            trace.record_step(
                step,
                t0,
                Instant::now(),
                std::mem::take(&mut outcome.events),
            );
        }
        let facts = StepFacts {
            step,
            lr: config.lr_at(step),
            tokens_per_step,
            // Filled when the step's scalars are read.
            moe: None,
            loss_scale: outcome.loss_scale,
            skipped: outcome.skipped,
        };
        unread.push((facts, mine, outcome.scalars));
        let done = step + 1;
        let saving = saver.is_some()
            && (done.is_multiple_of(config.checkpoint.save_every) || done == last_step);
        if done.is_multiple_of(config.run.log_every) || done == last_step || saving {
            for (facts, mine) in read_scalars(std::mem::take(&mut unread)) {
                if let Some(record) = gather_record(ctx, facts, &mine)? {
                    emit(&record);
                    records.push(record);
                }
            }
        }
        if let Some(saver) = saver.as_mut()
            && saving
        {
            rank.save(saver, &strategy, &scaler, done)?;
        }
    }
    if let Some(saver) = saver.as_mut() {
        saver.finish(ctx.world()).map_err(RankError::from)?;
    }
    if let Some(path) = &config.run.trace {
        trace.write(ctx, path)?;
    }
    let params = strategy.full_params(ctx)?;
    if ctx.rank() != 0 {
        return Ok(None);
    }
    let (buckets, overlap) = strategy.buckets();
    Ok(Some((records, params, buckets, overlap)))
}

/// The reads of tensor values to the host this thread made since `before`
/// ([`transfers::thread_reads`]), every cause but collective staging.
fn reads_since(before: &[u64; Cause::ALL.len()]) -> u64 {
    let now = transfers::thread_reads();
    (Cause::ALL.iter().zip(now.iter().zip(before)))
        .filter(|(cause, _)| **cause != Cause::Collective)
        .map(|(_, (now, before))| now - before)
        .sum()
}

/// The steps' metrics with their losses and norms, read from the device in one go; the read
/// counts as the last step's.
fn read_scalars(
    unread: Vec<(StepFacts, RankMetrics, PendingScalars)>,
) -> Vec<(StepFacts, RankMetrics)> {
    let scalars: Vec<StepScalars> = unread.iter().map(|(_, _, p)| p.scalars.clone()).collect();
    // The routing records' auxiliary losses, read in the same go.
    let moe_losses: Vec<Tensor<1>> = (unread.iter())
        .filter_map(|(_, _, p)| p.moe.as_ref().map(|m| m.losses()))
        .collect();
    let before = transfers::thread_reads();
    let (values, moe_values) = StepScalars::read_all_with(&scalars, &moe_losses);
    let reads = reads_since(&before);
    let last = unread.len().saturating_sub(1);
    let mut moe_values = moe_values.into_iter();
    (unread.into_iter().zip(values).enumerate())
        .map(|(i, ((mut facts, mut mine, pending), values))| {
            mine.loss = values.loss as f64;
            mine.grad_norm = (values.norm * pending.norm_scale) as f64;
            if let Some(moe) = pending.moe {
                let read = moe_values.next().expect("one read per routing record");
                facts.moe = Some(moe.finish([read[0], read[1]]));
            }
            if i == last {
                mine.host_reads += reads;
            }
            (facts, mine)
        })
        .collect()
}

/// Runs the job's fault drills that fire on this rank at the start of `step`: a stall
/// sleeps, a kill panics (the launcher reports it as the rank's failure).
fn fire_drills(ctx: &RankContext, config: &TrainConfig, step: usize) {
    let drills = config
        .run
        .kills
        .iter()
        .filter(|k| k.fires(ctx.rank(), step));
    for drill in drills {
        match drill.stall {
            Some(time) => std::thread::sleep(time),
            None => panic!(
                "fault drill: rank {} killed at the start of step {step}",
                ctx.rank()
            ),
        }
    }
}

/// The step's record on rank 0, from every rank's metrics (`mine` on this one) and the step's
/// `facts`; `None` on the other ranks. Collective over the world.
fn gather_record(
    ctx: &RankContext,
    facts: StepFacts,
    mine: &RankMetrics,
) -> Result<Option<StepRecord>, RankError> {
    let all = control(|| ctx.world().all_gather_vec(&mine.to_wire()))?;
    if ctx.rank() != 0 {
        return Ok(None);
    }
    let ranks: Vec<RankMetrics> = all
        .chunks(RankMetrics::WIRE_LEN)
        .map(RankMetrics::from_wire)
        .collect();
    Ok(Some(step_record(facts, &ranks)))
}

/// Loads the checkpoint at `path` into `strategy` (every rank reads the regions it holds, so
/// any mesh can resume any checkpoint of the same model); returns the step to continue from.
fn resume(
    ctx: &RankContext,
    config: &TrainConfig,
    strategy: &mut PlanPipeline,
    scaler: &mut LossScaler,
    grad_group: &Group,
    path: &std::path::Path,
) -> Result<usize, RankError> {
    let ckpt = super::checkpoint::open(path)?;
    let run = &ckpt.index().run;
    let seed = run.get("seed").and_then(|v| v.as_u64());
    if seed != Some(config.run.seed) {
        return Err(RankError::from(format!(
            "{}: saved with seed {seed:?}, this job has run.seed = {}; batches and dropout follow the seed, so resume with --seed {}",
            ckpt.dir().display(),
            config.run.seed,
            seed.map_or("?".into(), |s| s.to_string())
        )));
    }
    let step = ckpt.step() as usize;
    if step > config.run.steps {
        return Err(RankError::from(format!(
            "{}: the checkpoint is at step {step}, past run.steps = {}",
            ckpt.dir().display(),
            config.run.steps
        )));
    }
    let (mut state, _, _) = strategy.local_state(ctx, grad_group)?;
    state
        .load(&ckpt)
        .map_err(|e| RankError::from(format!("resuming: {e}")))?;
    strategy.restore(state)?;
    if let Some(bias) = run.get("moe_bias").filter(|v| !v.is_null()) {
        let bias: Vec<Vec<f32>> = serde_json::from_value(bias.clone())
            .map_err(|e| RankError::from(format!("{}: run.moe_bias: {e}", ckpt.dir().display())))?;
        strategy.set_moe_bias(&bias)?;
    }
    // A run saved without loss scaling resumes at the policy's initial scale.
    if let Some(state) = run.get("loss_scale").filter(|v| !v.is_null()) {
        let state: (f32, usize) = serde_json::from_value(state.clone()).map_err(|e| {
            RankError::from(format!("{}: run.loss_scale: {e}", ckpt.dir().display()))
        })?;
        if scaler.is_active() {
            scaler.restore(state);
        }
    }
    Ok(step)
}

/// Context parallelism over `cp`: which positions of every sequence this rank keeps (its
/// share of each micro-batch's tokens); the plan's attention reaches the others' keys and
/// values. `None` without a cp axis.
fn context_split(
    ctx: &RankContext,
    config: &TrainConfig,
    model_config: &TransformerConfig,
) -> Result<Option<ContextParallel>, RankError> {
    let cp = ctx.group(Axis::Cp);
    if cp.size() == 1 {
        return Ok(None);
    }
    let local_heads = model_config.n_heads / ctx.group(Axis::Tp).size();
    Ok(Some(ContextParallel::new(
        cp,
        config.data.seq_len,
        config.parallel.cp_attention,
        config.parallel.cp_load_balance,
        local_heads,
    )?))
}

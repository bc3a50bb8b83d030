//! The training job: one closure per rank under the launcher, data parallel over the `dp` axis.

use super::checkpoint::{
    LocalState, Saver, Segment, placed_segments, run_segments, whole_segments,
};
use super::config::{GradientReduction, TrainConfig};
use super::metrics::{RankMetrics, StepFacts, step_record};
use super::pp_model::{DeferWeightGrads, TransformerStage};
use super::report::{DeviceMemory, MoeRecord, StepRecord, TrainReport};
use super::sharded_model::ShardedTransformer;
use super::tp_model::TpTransformer;
use super::trace::Trace;
use burn::module::Module;
use burn::optim::GradientsParams;
use burn::tensor::{Device, Int, Tensor, TensorData};
use flashover_data::{BatchPlan, MarkovSource, TextSource, TokenSource};
use flashover_models::{
    Block, Dropout, ForwardContext, LinearHook, MoeHook, Transformer, next_token_loss,
};
use flashover_parallel::FlatAdamW;
use flashover_parallel::context_parallel::{AttentionWork, ContextParallel};
use flashover_parallel::data_parallel::{
    DataParallel, DataParallelConfig, MicroBatches, ReduceReport,
};
use flashover_parallel::expert_parallel::{ExpertParallel, place_experts};
use flashover_parallel::params::{
    ParamLayout, ParamSlot, accumulate_grads, flatten_params, load_flat, load_shaped, placeholders,
};
use flashover_parallel::pipeline::{
    Action, ActionKind, PipelineExecutor, Schedule, WeightGradStore, deferral_supported,
};
use flashover_parallel::placement::{
    GradientReducer, ParamPlacement, PlacementTable, Tie, global_grad_norm,
};
use flashover_parallel::precision::{LossScaler, MixedPrecision};
use flashover_parallel::tensor_parallel::TensorParallel;
use flashover_parallel::zero::{
    FullyShardConfig, FullyShardedOptimizer, MemoryReport, ShardGroup, ShardedDataParallel,
    UnitShards, ZeroConfig,
};
use flashover_parallel::{FlatAdamWConfig, ModuleAdamW};
use flashover_parallel::{clip_module_grads, clip_scale};
use flashover_runtime::ReduceOp;
use flashover_runtime::{Axis, CommunicatorExt, Group, Launch, RankContext, RankError};
use std::io::Write;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The token source the configuration names.
pub fn token_source(config: &TrainConfig) -> Result<Arc<dyn TokenSource>, String> {
    let d = &config.data;
    Ok(match d.source.as_str() {
        "markov" => Arc::new(MarkovSource::new(d.vocab, d.branching, config.run.seed)),
        "text" => {
            let path = d
                .path
                .as_ref()
                .ok_or("data.path is required when data.source = \"text\"")?;
            Arc::new(
                TextSource::open(path, d.seq_len + 1, config.run.seed)
                    .map_err(|e| e.to_string())?,
            )
        }
        other => return Err(format!("data.source = `{other}`: expected markov or text")),
    })
}

/// Inputs and next-token targets for samples `indices`, each `seq_len + 1` tokens.
pub fn make_batch(
    source: &dyn TokenSource,
    indices: std::ops::Range<u64>,
    seq_len: usize,
    device: &Device,
) -> (Tensor<2, Int>, Tensor<2, Int>) {
    let b = (indices.end - indices.start) as usize;
    let mut inputs = Vec::with_capacity(b * seq_len);
    let mut targets = Vec::with_capacity(b * seq_len);
    for i in indices {
        let s = source.sample(i, seq_len + 1);
        inputs.extend(s[..seq_len].iter().map(|&t| t as i64));
        targets.extend(s[1..].iter().map(|&t| t as i64));
    }
    (
        Tensor::from_data(TensorData::new(inputs, [b, seq_len]), device),
        Tensor::from_data(TensorData::new(targets, [b, seq_len]), device),
    )
}

/// Runs the job, every rank a thread of this process. `on_step` sees every step's record as it
/// completes (rank 0's thread).
///
/// ```
/// use flashover::train::{TrainConfig, train};
///
/// // The reference transformer, data parallel over two rank threads, three steps.
/// let config = TrainConfig::from_toml(
///     "[parallel]\nmesh = \"dp=2\"\n[run]\nsteps = 3\nglobal_batch = 4\n",
/// )
/// .unwrap();
/// let report = train(&config, &|step| assert!(step.loss.is_finite())).unwrap();
/// assert_eq!(report.steps.len(), 3);
/// assert_eq!(report.steps[0].ranks.len(), 2);
/// ```
pub fn train(
    config: &TrainConfig,
    on_step: &(dyn Fn(&StepRecord) + Sync),
) -> Result<TrainReport, String> {
    run_job(config, on_step, None)?.ok_or_else(|| "rank 0 gave no report".into())
}

/// Runs the job as rank `world.rank()` of a job whose ranks are processes (under `mpirun`,
/// with the MPI engine's world group), on device `local_rank` of `run.device`. The same code
/// as [`train`] runs on each rank, so the results are the thread launcher's. Rank 0 gets the
/// report (and calls `on_step`, writes the log); the others get `None`.
///
/// ```
/// use flashover::comm::{Group, ThreadWorld};
/// use flashover::train::{TrainConfig, train_process};
///
/// // Two ranks, each with its own world communicator, as two processes would have (here
/// // threads of the thread engine stand in for MPI).
/// let mut config = TrainConfig::default();
/// config.run.steps = 2;
/// config.run.global_batch = 4;
/// let reports: Vec<_> = std::thread::scope(|s| {
///     let ranks: Vec<_> = ThreadWorld::new(2)
///         .build()
///         .into_iter()
///         .map(|comm| {
///             let config = &config;
///             let world = Group::new(std::sync::Arc::new(comm));
///             s.spawn(move || train_process(config, &|_| {}, world, 0))
///         })
///         .collect();
///     ranks.into_iter().map(|r| r.join().unwrap().unwrap()).collect()
/// });
/// assert!(reports[0].is_some() && reports[1].is_none(), "rank 0 reports");
/// ```
pub fn train_process(
    config: &TrainConfig,
    on_step: &(dyn Fn(&StepRecord) + Sync),
    world: Group,
    local_rank: usize,
) -> Result<Option<TrainReport>, String> {
    run_job(config, on_step, Some((world, local_rank)))
}

fn run_job(
    config: &TrainConfig,
    on_step: &(dyn Fn(&StepRecord) + Sync),
    process: Option<(Group, usize)>,
) -> Result<Option<TrainReport>, String> {
    let errors = config.validate();
    if !errors.is_empty() {
        return Err(format!("invalid configuration:\n  {}", errors.join("\n  ")));
    }
    let mesh = config.mesh()?;
    let source = token_source(config)?;
    let model_config = config.transformer(source.vocab_size())?;
    let local_rank = process.as_ref().map_or(0, |(_, local)| *local);
    let device = config
        .run
        .device
        .device(local_rank)
        .map_err(|e| e.to_string())?;
    let leader = process.as_ref().is_none_or(|(w, _)| w.rank() == 0);
    let log = match &config.run.log_jsonl {
        Some(path) if leader => Some(
            std::fs::File::create(path)
                .map_err(|e| format!("run.log_jsonl {}: {e}", path.display()))?,
        ),
        _ => None,
    };
    let log_error = std::sync::Mutex::new(None::<String>);
    let started = Instant::now();
    let launch = Launch::new(&mesh)
        .map_err(|e| e.to_string())?
        .device(device)
        .timeout(Duration::from_secs_f64(config.parallel.timeout_s));
    let body = |ctx: RankContext| {
        let emit = |record: &StepRecord| {
            on_step(record);
            if let Some(file) = log.as_ref() {
                let mut file = file;
                if let Err(e) = writeln!(
                    file,
                    "{}",
                    serde_json::to_string(record).expect("records serialise")
                ) {
                    *log_error.lock().unwrap_or_else(|p| p.into_inner()) = Some(e.to_string());
                }
            }
        };
        train_rank(&ctx, config, &model_config, source.as_ref(), &emit, started)
    };
    let output = match process {
        None => launch
            .run(body)
            .map_err(|e| e.to_string())?
            .into_iter()
            .next()
            .flatten(),
        Some((world, _)) => launch.run_process(world, body).map_err(|e| e.to_string())?,
    };
    if let Some(e) = log_error.into_inner().unwrap_or_else(|p| p.into_inner()) {
        return Err(format!("writing run.log_jsonl: {e}"));
    }
    let Some((steps, params, buckets, overlap)) = output else {
        return Ok(None);
    };
    let memory = steps
        .last()
        .map(|s| s.ranks.iter().map(|r| r.memory).collect())
        .unwrap_or_default();
    Ok(Some(TrainReport {
        tokens: steps.len() * config.run.global_batch * config.data.seq_len,
        steps,
        params,
        loss_floor: source.loss_floor(),
        num_params: model_config.num_params(),
        mesh: mesh.to_spec(),
        buckets,
        overlap,
        memory,
        zero: config.parallel.zero,
        shard_degree: match config.parallel.zero {
            0 => 1,
            3 => mesh.degree(Axis::Fsdp),
            _ => mesh.degree(Axis::Dp) * mesh.degree(Axis::Fsdp),
        },
        expert_params: model_config.moe.as_ref().map_or(0, |m| {
            model_config.n_layers * m.routed_params(model_config.d_model)
        }),
        expert_degree: mesh.degree(Axis::Ep),
        wall_s: started.elapsed().as_secs_f64(),
    }))
}

/// A rank's [`LocalState`] and, for its parameters and then its moments, `(index, count)` of
/// the ranks holding the same data, which share writing it.
type SharedState = (LocalState, (usize, usize), (usize, usize));

/// What rank 0 hands back: its step records, the final parameters by name, buckets per step,
/// and whether reduction overlapped backward.
type RankOutput = Option<(Vec<StepRecord>, Vec<(String, Vec<f32>)>, usize, bool)>;

/// How one rank holds and updates the model, as `parallel.zero` and the mesh say.
enum Strategy {
    /// Replicas, Burn's AdamW on whole averaged gradients.
    Ddp(Box<Transformer>, DataParallel, ModuleAdamW),
    /// Replicas, AdamW state (and with stage 2 gradients) sharded.
    Zero(Box<Transformer>, ShardedDataParallel),
    /// Layers split into pipeline stages over `pp` (this rank's chunks), replicas over `dp`.
    Pp(Box<PipelineState>),
    /// Weights split over `tp` (Megatron), replicas over `dp`.
    Tp(Box<TpTransformer>, DataParallel, ModuleAdamW),
    /// Parameters sharded in units over `fsdp` (replicated over `dp`: HSDP).
    Fsdp(
        Box<ShardedTransformer>,
        FullyShardedOptimizer,
        Arc<ShardGroup>,
    ),
    /// A mixture-of-experts model: experts split over `ep`, the rest replicated over `dp x ep`.
    Moe(Box<MoeState<Transformer>>),
    /// The same with attention, embedding and head split over `tp` (experts whole on every tp
    /// rank of their ep rank).
    TpMoe(Box<MoeState<TpTransformer>>),
}

/// An expert-parallel rank: its experts and the rest, how tokens reach the experts, how
/// gradients are reduced.
struct MoeState<M> {
    model: M,
    experts: ExpertParallel,
    hook: MoeHook,
    reduction: PlacedReduction,
    optim: ModuleAdamW,
    layout: ParamLayout,
    d_model: usize,
    /// Hot experts copied to every ep rank each step (`moe.replicate_hot`).
    replicate_hot: usize,
}

/// How an expert-parallel rank reduces its gradients: as its parameters' placements say.
struct PlacedReduction {
    /// Where each parameter lives (experts owned over ep, with tp its shares).
    placements: PlacementTable,
    reducer: GradientReducer,
    /// Every rank reading its own samples (`dp x ep`): routing statistics are summed here.
    batch: Group,
    /// Gradients are means over the batch (sums otherwise).
    average: bool,
}

/// A model a training step takes the next-token loss of (the whole model, or this rank's
/// tensor-parallel part of it).
trait NextTokenLoss: Module {
    fn loss(
        &self,
        inputs: Tensor<2, Int>,
        targets: Tensor<2, Int>,
        fwd: &ForwardContext,
    ) -> Tensor<1>;
}

impl NextTokenLoss for Transformer {
    fn loss(
        &self,
        inputs: Tensor<2, Int>,
        targets: Tensor<2, Int>,
        fwd: &ForwardContext,
    ) -> Tensor<1> {
        next_token_loss(self.forward_with(inputs, fwd), targets)
    }
}

impl NextTokenLoss for TpTransformer {
    fn loss(
        &self,
        inputs: Tensor<2, Int>,
        targets: Tensor<2, Int>,
        fwd: &ForwardContext,
    ) -> Tensor<1> {
        self.forward_loss(inputs, targets, fwd)
    }
}

/// A model whose blocks an expert-parallel step reaches between steps (routing biases).
trait MoeBlocks {
    fn moe_blocks(&self) -> &[Block];
    fn moe_blocks_mut(&mut self) -> &mut [Block];
}

impl MoeBlocks for Transformer {
    fn moe_blocks(&self) -> &[Block] {
        &self.blocks
    }
    fn moe_blocks_mut(&mut self) -> &mut [Block] {
        &mut self.blocks
    }
}

impl MoeBlocks for TpTransformer {
    fn moe_blocks(&self) -> &[Block] {
        &self.local.blocks
    }
    fn moe_blocks_mut(&mut self) -> &mut [Block] {
        &mut self.local.blocks
    }
}

impl<M: MoeBlocks> MoeState<M> {
    /// Every MoE layer's routing bias (empty vectors where balancing by bias is off).
    fn bias(&self) -> Vec<Vec<f32>> {
        self.model
            .moe_blocks()
            .iter()
            .map(|b| b.moe.as_ref().map_or(vec![], |m| m.expert_bias.clone()))
            .collect()
    }

    /// Sets the routing biases from [`MoeState::bias`]'s output (a checkpoint's).
    fn set_bias(&mut self, bias: &[Vec<f32>]) -> Result<(), RankError> {
        let blocks = self.model.moe_blocks_mut();
        if bias.len() != blocks.len() {
            return Err(RankError::from(format!(
                "the checkpoint has routing biases for {} layers, the model has {}",
                bias.len(),
                blocks.len()
            )));
        }
        for (block, b) in blocks.iter_mut().zip(bias) {
            if let Some(moe) = block.moe.as_mut() {
                moe.expert_bias = b.clone();
            }
        }
        Ok(())
    }
}

impl<M: Module> MoeState<M> {
    /// `model` (this rank's experts, and with tp its shares) placed as `placements` says.
    fn new(
        model: M,
        experts: ExpertParallel,
        reduction: PlacedReduction,
        adamw: &FlatAdamWConfig,
        d_model: usize,
    ) -> Self {
        let layout = ParamLayout::of(&model);
        MoeState {
            reduction,
            optim: ModuleAdamW::new(adamw, &model),
            hook: MoeHook::new(Arc::new(experts.clone())),
            experts,
            layout,
            model,
            d_model,
            replicate_hot: 0,
        }
    }
}

/// One step's outcome on one rank.
struct StepOutcome {
    loss_sum: f64,
    grad_norm: f32,
    comm: Duration,
    overlapped: Duration,
    exposed: Duration,
    memory: MemoryReport,
    /// Pipeline actions and receive waits (pipeline strategy only).
    events: Vec<(Action, Instant, Instant)>,
    /// Pipeline: most micro-batches held at once.
    in_flight: usize,
    /// Pipeline: wall time of the schedule.
    pipeline: Duration,
    /// Mixture of experts: the step's routing over the global batch.
    moe: Option<MoeRecord>,
    /// Mixture of experts: this rank's time in all-to-alls.
    a2a: Duration,
    /// Loss scaling: the scale of this step (none without scaling).
    loss_scale: Option<f32>,
    /// The optimizer step was skipped (a scaled gradient overflowed).
    skipped: bool,
}

/// A pipeline rank's chunks, schedule, optimizer and how to name its parameters.
struct PipelineState {
    chunks: Vec<TransformerStage>,
    schedule: Schedule,
    optim: StageOptimizer,
    /// The parameter layout of each of this rank's chunks (fixed for the run).
    layouts: Vec<ParamLayout>,
    /// Per virtual stage, its whole (unsplit) parameters in layout order: the name they have
    /// in the whole model (`None` for the tied head's copy, reported as `embed.weight`) and
    /// their length. With `order`, the whole model's names, this is all rank 0 needs to name
    /// gathered parameters: no rank keeps a copy of the whole model.
    stage_params: Vec<Vec<(Option<String>, usize)>>,
    order: Vec<String>,
    shape: [usize; 3],
    average: bool,
    /// Ranks whose gradients are summed (`dp x fsdp x cp`): means divide by it.
    data_ranks: usize,
    /// The dtype gradients are summed in.
    reduce_dtype: flashover_parallel::precision::Precision,
    /// Where each parameter of this rank's chunks lives.
    placements: PlacementTable,
    reducer: GradientReducer,
    /// Tied embeddings: the group of the ranks holding the first and the last stage, which sum
    /// the two copies' gradients (`None` for other ranks and untied models).
    tie: Option<Group>,
    /// Zero-bubble schedules on Flex without tensor parallelism: the blocks' weight gradients
    /// are deferred to this store and computed at the weight-gradient actions.
    deferral: Option<(WeightGradStore, LinearHook)>,
}

/// How a pipeline rank steps its chunks' parameters.
enum StageOptimizer {
    /// Whole parameters, replicated over the data-parallel ranks, Burn's AdamW (flat).
    Replicated(Box<ModuleAdamW>),
    /// Rows of every parameter sharded over one data-parallel axis (ZeRO).
    Sharded(Box<StageSharding>),
}

/// A pipeline rank's parameters cut by rows over `axis` (per parameter, as fully sharded units
/// cut theirs), each rank stepping AdamW on its own rows. ZeRO-3 (`keep_params` false) keeps
/// only the rows between steps and gathers the chunks at the start of each step, keeping them
/// through every micro-batch (TorchTitan's default under pipelines); ZeRO-1/2 keep the chunks
/// and all-gather the updated rows after the step. Either way gradients are reduce-scattered
/// once per step.
struct StageSharding {
    axis: Axis,
    group: Group,
    /// The chunks' parameter layout (all chunks end to end).
    layout: ParamLayout,
    shards: UnitShards,
    /// This rank's rows of every parameter.
    own: Vec<f32>,
    adam: FlatAdamW,
    keep_params: bool,
}

impl StageSharding {
    /// `chunks` cut over the fsdp axis (ZeRO-3, or any stage with an fsdp axis) or else `dp`.
    fn new(
        ctx: &RankContext,
        chunks: &[TransformerStage],
        zero: u8,
        adamw: &FlatAdamWConfig,
    ) -> Self {
        let axis = match zero == 3 || ctx.group(Axis::Fsdp).size() > 1 {
            true => Axis::Fsdp,
            false => Axis::Dp,
        };
        let group = ctx.group(axis).clone();
        let layout = ParamLayout::of(&chunks.to_vec());
        let shards = UnitShards::new(&layout, group.size());
        let own = shards.take(group.rank(), &flatten_params(&chunks.to_vec()));
        StageSharding {
            axis,
            adam: FlatAdamW::new(adamw, shards.shard_len()),
            group,
            layout,
            shards,
            own,
            keep_params: zero != 3,
        }
    }

    /// The chunks with their whole parameters, from every rank's rows (collective).
    fn gather(&self, skeleton: Vec<TransformerStage>) -> Result<Vec<TransformerStage>, RankError> {
        let flat = self.shards.all_gather(&self.group, &self.own)?;
        Ok(load_shaped(skeleton, &self.layout, &flat))
    }
}

impl PipelineState {
    /// The parameters this rank steps with their placements, laid end to end: every chunk's
    /// whole parameters, or under ZeRO this rank's rows of each.
    fn stepped_entries(&self) -> Result<Vec<(ParamSlot, ParamPlacement)>, RankError> {
        match &self.optim {
            StageOptimizer::Sharded(sh) => {
                Ok(sh.shards.placed(&sh.layout, &self.placements, sh.axis, 0)?)
            }
            StageOptimizer::Replicated(_) => Ok(self
                .entries()?
                .into_iter()
                .map(|(slot, entry)| (slot, entry.clone()))
                .collect()),
        }
    }

    /// The chunks with their parameters in place (gathered under ZeRO-3; collective there).
    fn whole_chunks(&self) -> Result<Vec<TransformerStage>, RankError> {
        match &self.optim {
            StageOptimizer::Sharded(sh) if !sh.keep_params => sh.gather(self.chunks.clone()),
            _ => Ok(self.chunks.clone()),
        }
    }

    /// Every chunk's parameters with their placements, laid end to end as in the step's flat
    /// gradient.
    fn entries(&self) -> Result<Vec<(ParamSlot, &ParamPlacement)>, RankError> {
        let mut out = vec![];
        let mut base = 0;
        for (chunk, layout) in self.chunks.iter().zip(&self.layouts) {
            for (mut slot, entry) in self.placements.entries_of(chunk)? {
                slot.offset += base;
                out.push((slot, entry));
            }
            base += layout.numel;
        }
        Ok(out)
    }
}

/// Records that `chunk`'s parameters are this pipeline rank's own (other stages hold other
/// blocks), and that a tied head is a copy of `local`'s embedding, which the first stage holds.
fn place_stage(
    placements: &mut PlacementTable,
    chunk: &TransformerStage,
    local: &Transformer,
) -> Result<(), RankError> {
    let embed = local.embed.weight.id;
    if let Some(copy) = &chunk.tied_head {
        let mut entry = placements
            .get(embed)
            .cloned()
            .ok_or("the embedding has no placement")?;
        entry.tie = Tie::Copy;
        placements.insert(copy.id, entry);
    }
    for slot in ParamLayout::of(chunk).slots {
        placements.own(slot.id, Axis::Pp)?;
    }
    if chunk.embed.is_some() && local.head.is_none() {
        placements.tie(embed, Tie::Original)?;
    }
    Ok(())
}

impl StepOutcome {
    fn reduced(loss_sum: f64, report: &ReduceReport, memory: MemoryReport) -> Self {
        StepOutcome {
            loss_sum,
            grad_norm: report.grad_norm,
            comm: report.comm,
            overlapped: report.overlapped,
            exposed: report.exposed,
            memory,
            events: vec![],
            in_flight: 0,
            pipeline: Duration::ZERO,
            moe: None,
            a2a: Duration::ZERO,
            loss_scale: None,
            skipped: false,
        }
    }
}

impl Strategy {
    fn new(
        ctx: &RankContext,
        config: &TrainConfig,
        model_config: &flashover_models::TransformerConfig,
        model: Transformer,
        grad_group: &Group,
    ) -> Result<Self, RankError> {
        let adamw = FlatAdamWConfig::new().with_weight_decay(config.optim.weight_decay as f32);
        let ddp_config = DataParallelConfig::new()
            .with_bucket_bytes((config.parallel.bucket_mb * (1 << 20) as f64) as usize)
            .with_overlap(config.parallel.overlap)
            .with_average(config.parallel.gradient_reduction == GradientReduction::Mean)
            .with_reduce_dtype(config.precision.reduce_dtype);
        if let Some(moe) = &model_config.moe {
            // Replicas start equal: the seeded initialisation is the same on every rank.
            let ep = ctx.group(Axis::Ep);
            let experts = ExpertParallel::new(ep, moe.n_experts)?;
            let mut placements = PlacementTable::whole(&model);
            place_experts(&mut placements, &model, experts.experts_of(ep.rank()).start)?;
            let mut reduction = PlacedReduction {
                placements,
                reducer: GradientReducer::new(ctx, config.precision.reduce_dtype)?,
                batch: grad_group.clone(),
                average: config.parallel.gradient_reduction == GradientReduction::Mean,
            };
            let d = model_config.d_model;
            let hot = config.moe.replicate_hot;
            let tp = ctx.group(Axis::Tp);
            if tp.size() > 1 {
                let placements = std::mem::take(&mut reduction.placements);
                let model =
                    TpTransformer::shard_placed(model, &TensorParallel::new(tp), placements)?;
                reduction.placements = model.placements().clone();
                let mut state = MoeState::new(model, experts, reduction, &adamw, d);
                state.replicate_hot = hot;
                return Ok(Strategy::TpMoe(Box::new(state)));
            }
            let mut state = MoeState::new(model, experts, reduction, &adamw, d);
            state.replicate_hot = hot;
            return Ok(Strategy::Moe(Box::new(state)));
        }
        let pp = ctx.group(Axis::Pp);
        if pp.size() > 1 {
            let kind = config.parallel.pp_schedule;
            let micro = config.run.micro_batches;
            let schedule = Schedule::build(kind, pp.size(), micro, config.parallel.pp_chunks)
                .map_err(RankError::from)?;
            let counts = config.pipeline_blocks(model_config, schedule.stages())?;
            // Context-parallel ranks read the same samples: rows split over the others.
            let batch_ranks = grad_group.size() / ctx.group(Axis::Cp).size();
            let rows = config.run.global_batch / batch_ranks / micro;
            let d = model.embed.weight.val().dims()[1];
            let tied = model.head.is_none();
            let whole = PlacementTable::whole(&model);
            let order = ParamLayout::of(&model)
                .slots
                .into_iter()
                .map(|s| s.name)
                .collect();
            // Stages cut from the whole model keep its parameters' ids, so the whole model's
            // table names them; the tied head's copy is a new parameter (reported once, as the
            // embedding).
            let stage_params = (0..schedule.stages())
                .map(|stage| {
                    let cut = TransformerStage::cut(&model, stage, &counts)?;
                    Ok(ParamLayout::of(&cut)
                        .slots
                        .into_iter()
                        .map(|s| (whole.get(s.id).map(|e| e.name.clone()), s.numel))
                        .collect())
                })
                .collect::<Result<Vec<_>, flashover_parallel::ParallelError>>()?;
            // With a tp axis each stage holds its tensor-parallel shares (dp x tp x pp).
            let tp = ctx.group(Axis::Tp);
            let (local, split, seq, mut placements) = if tp.size() > 1 {
                let plan = TensorParallel::new(tp)
                    .with_sequence_parallel(config.parallel.sequence_parallel);
                let sharded = TpTransformer::shard(model, &plan)?;
                // Context parallelism hands each rank a share of every sequence, sequence
                // parallelism a share of that.
                let local_seq = config.data.seq_len / ctx.group(Axis::Cp).size();
                let seq = if plan.sequence_parallel {
                    local_seq / tp.size()
                } else {
                    local_seq
                };
                let split = Some((plan, sharded.vocab()));
                let placements = sharded.placements().clone();
                (sharded.local, split, seq, placements)
            } else {
                let local_seq = config.data.seq_len / ctx.group(Axis::Cp).size();
                (model, None, local_seq, whole)
            };
            let chunks = (0..schedule.chunks)
                .map(|c| {
                    let stage = schedule.stage_of(pp.rank(), c);
                    TransformerStage::cut_split(&local, stage, &counts, split.clone())
                })
                .collect::<Result<Vec<_>, _>>()?;
            for chunk in &chunks {
                place_stage(&mut placements, chunk, &local)?;
            }
            // Tied embeddings: the first and the last stage's ranks keep their copies in step.
            let (first, last) = (0, pp.size() - 1);
            let holds = pp.rank() == first || pp.rank() == last;
            let tie_group = pp.split((!holds) as usize, pp.rank(), "embedding-tie")?;
            let tie = (tied && holds).then_some(tie_group);
            let splits_backward = schedule
                .ranks
                .iter()
                .flatten()
                .any(|a| a.kind == ActionKind::BackwardWeight);
            // The rule table refuses zero-bubble schedules under tensor parallelism; on a device
            // the deferral op is not built for, refuse too rather than run 1F1B silently.
            let device = ctx.device().clone().autodiff();
            if splits_backward && !deferral_supported(&device) {
                return Err(RankError::from(format!(
                    "parallel.pp_schedule = {}: zero-bubble schedules defer the blocks' weight \
                     gradients through an op built for Flex only, not for {device:?}; use 1f1b \
                     or interleaved there",
                    config.parallel.pp_schedule
                )));
            }
            let deferral = (splits_backward && split.is_none()).then(|| {
                let store = WeightGradStore::default();
                let hook = LinearHook(Arc::new(DeferWeightGrads(store.clone())));
                (store, hook)
            });
            let optim = match config.parallel.zero {
                0 => StageOptimizer::Replicated(Box::new(ModuleAdamW::new(&adamw, &chunks))),
                zero => {
                    let sharding = StageSharding::new(ctx, &chunks, zero, &adamw);
                    StageOptimizer::Sharded(Box::new(sharding))
                }
            };
            let layouts = chunks.iter().map(ParamLayout::of).collect();
            // ZeRO-3 keeps only its rows between steps.
            let chunks = match &optim {
                StageOptimizer::Sharded(sh) if !sh.keep_params => placeholders(chunks),
                _ => chunks,
            };
            return Ok(Strategy::Pp(Box::new(PipelineState {
                tie,
                deferral,
                placements,
                reducer: GradientReducer::new(ctx, config.precision.reduce_dtype)?,
                schedule,
                optim,
                layouts,
                chunks,
                stage_params,
                order,
                shape: [rows, seq, d],
                average: config.parallel.gradient_reduction == GradientReduction::Mean,
                data_ranks: grad_group.size(),
                reduce_dtype: config.precision.reduce_dtype,
            })));
        }
        let tp = ctx.group(Axis::Tp);
        if tp.size() > 1 {
            let plan =
                TensorParallel::new(tp).with_sequence_parallel(config.parallel.sequence_parallel);
            let model = TpTransformer::shard(model, &plan)?;
            let (model, ddp) = ddp_config.init(model, grad_group)?;
            let optim = ModuleAdamW::new(&adamw, &model);
            return Ok(Strategy::Tp(Box::new(model), ddp, optim));
        }
        Ok(match config.parallel.zero {
            0 => {
                let (model, ddp) = ddp_config.init(model, grad_group)?;
                let optim = ModuleAdamW::new(&adamw, &model);
                Strategy::Ddp(Box::new(model), ddp, optim)
            }
            1 | 2 => {
                let mut zero = ZeroConfig::stage(config.parallel.zero as usize, adamw)?;
                zero.data_parallel = ddp_config;
                let (model, sharded) = zero.init(model, grad_group)?;
                Strategy::Zero(Box::new(model), sharded)
            }
            _ => {
                let fsdp = FullyShardConfig::new()
                    .with_reshard_after_forward(config.parallel.reshard_after_forward);
                let shard_group = ctx.group(Axis::Fsdp);
                // Replicas of a shard: the dp ranks (HSDP), and the cp ranks, which hold the
                // same parameters and see other positions of the same samples.
                let replicas = match ctx.group(Axis::Cp).size() {
                    1 => ctx.group(Axis::Dp).clone(),
                    _ => ctx.subgroup(&[Axis::Dp, Axis::Cp])?,
                };
                // Replicas must start equal: rank 0 of each shard group broadcasts within its
                // group, and those ranks hold the same seeded initialisation.
                let units = ShardGroup::with_precision(
                    shard_group,
                    config.precision.param_dtype,
                    config.precision.reduce_dtype,
                );
                // Under tensor parallelism each rank's units hold its shares (FSDP over TP).
                let tp = ctx.group(Axis::Tp);
                let model = if tp.size() > 1 {
                    let plan = TensorParallel::new(tp)
                        .with_sequence_parallel(config.parallel.sequence_parallel);
                    let shares = TpTransformer::shard(model, &plan)?;
                    ShardedTransformer::tensor_parallel(shares, &fsdp, &units)?
                } else {
                    ShardedTransformer::new(model, &fsdp, &units)?
                };
                let mut optim = FullyShardedOptimizer::new(
                    &model,
                    shard_group,
                    (replicas.size() > 1).then_some(&replicas),
                    &adamw,
                    config.parallel.gradient_reduction == GradientReduction::Mean,
                );
                optim.set_reduce_dtype(config.precision.reduce_dtype);
                Strategy::Fsdp(Box::new(model), optim, units)
            }
        })
    }

    /// One optimizer step over `micro_batches` micro-batches from `batches`.
    fn step(
        self,
        ctx: &RankContext,
        clip: Option<f32>,
        batches: &mut dyn FnMut(usize) -> (Tensor<2, Int>, Tensor<2, Int>, ForwardContext),
        micro_batches: usize,
        lr: f64,
        precision: &mut Precisions,
    ) -> Result<(Self, StepOutcome), RankError> {
        let mut loss_sum = 0.0f64;
        let mut add_loss = |loss: &Tensor<1>| loss_sum += loss.clone().into_scalar::<f32>() as f64;
        match self {
            Strategy::Ddp(model, mut ddp, mut optim) => {
                ddp.set_loss_scale(precision.scaler.scale());
                let loss_sum =
                    run_micro_batches(&mut ddp, &*model, batches, micro_batches, precision)?;
                let reduced = ddp.finish(&*model, clip)?;
                let memory = replicated_memory(&ddp);
                let mut outcome = StepOutcome::reduced(loss_sum, &reduced.report, memory);
                let model = match precision.apply(&mut outcome) {
                    true => Box::new(optim.step(lr, *model, &reduced.grads)?),
                    false => model,
                };
                Ok((Strategy::Ddp(model, ddp, optim), outcome))
            }
            Strategy::Pp(mut state) => {
                let outcome =
                    pipeline_step(ctx, &mut state, clip, batches, micro_batches, lr, precision)?;
                Ok((Strategy::Pp(state), outcome))
            }
            Strategy::Moe(mut state) => {
                let outcome =
                    moe_step(ctx, &mut state, clip, batches, micro_batches, lr, precision)?;
                Ok((Strategy::Moe(state), outcome))
            }
            Strategy::TpMoe(mut state) => {
                let outcome =
                    moe_step(ctx, &mut state, clip, batches, micro_batches, lr, precision)?;
                Ok((Strategy::TpMoe(state), outcome))
            }
            Strategy::Tp(model, mut ddp, mut optim) => {
                ddp.set_loss_scale(precision.scaler.scale());
                let loss_sum =
                    run_micro_batches(&mut ddp, &*model, batches, micro_batches, precision)?;
                // The norm spans every tp rank's split weights; norms count once.
                let reduced = ddp.finish(&*model, None)?;
                let (grads, grad_norm) =
                    clip_module_grads(&*model, reduced.grads, clip, model.placements(), ctx)?;
                let memory = replicated_memory(&ddp);
                let mut outcome = StepOutcome::reduced(loss_sum, &reduced.report, memory);
                outcome.grad_norm = grad_norm;
                let model = match precision.apply(&mut outcome) {
                    true => Box::new(optim.step(lr, *model, &grads)?),
                    false => model,
                };
                Ok((Strategy::Tp(model, ddp, optim), outcome))
            }
            Strategy::Zero(model, mut zero) => {
                zero.data_parallel_mut()
                    .set_loss_scale(precision.scaler.scale());
                let loss_sum =
                    run_micro_batches(&mut zero, &*model, batches, micro_batches, precision)?;
                let report = zero.reduce(clip)?;
                let mut outcome = StepOutcome::reduced(loss_sum, &report, Default::default());
                let update = precision.apply(&mut outcome);
                let model = zero.apply(lr, *model, update)?;
                outcome.memory = zero.memory();
                Ok((Strategy::Zero(Box::new(model), zero), outcome))
            }
            Strategy::Fsdp(model, mut optim, units) => {
                units.stats().reset_peak();
                optim.set_loss_scale(precision.scaler.scale());
                let before = ctx.comm_stats();
                let waited_before = units.stats().snapshot().waited;
                for micro in 0..micro_batches {
                    let (inputs, targets, fwd) = batches(micro);
                    let loss = model.forward_loss(inputs, targets, &fwd, precision.policy)?;
                    add_loss(&loss);
                    let loss = precision.scaler.scale_loss(loss);
                    let grads = GradientsParams::from_grads(loss.backward(), &*model);
                    optim.accumulate(&*model, &grads);
                }
                let shard_bytes = ParamLayout::of(&*model).numel * 4;
                let entries = model.shard_entries()?;
                let grads = optim.reduce_replicas()?;
                let grad_norm = clip_placed(&borrowed(&entries), grads, clip, ctx)?;
                let (update, loss_scale) = precision.decide(grad_norm);
                let model = optim.apply(lr, *model, update);
                // Collectives run on the shard group's thread; the training thread's waits for
                // them are the exposed part, the rest overlapped compute (prefetches).
                let comm = ctx.comm_stats().since(&before).total();
                let comm = comm.wait + comm.transfer;
                let exposed = units.stats().snapshot().waited - waited_before;
                let outcome = StepOutcome {
                    loss_sum,
                    grad_norm,
                    comm,
                    overlapped: comm.saturating_sub(exposed),
                    exposed,
                    events: vec![],
                    in_flight: 0,
                    pipeline: Duration::ZERO,
                    memory: MemoryReport {
                        params: shard_bytes,
                        grads: optim.grad_bytes(),
                        optimizer: optim.state_bytes(),
                        gathered_peak: units.stats().snapshot().peak_bytes,
                    },
                    moe: None,
                    a2a: Duration::ZERO,
                    loss_scale,
                    skipped: !update,
                };
                Ok((Strategy::Fsdp(Box::new(model), optim, units), outcome))
            }
        }
    }

    /// Gradient buckets per step and whether reduction overlaps backward (none for FSDP, whose
    /// reduce-scatters run inside backward).
    fn buckets(&self) -> (usize, bool) {
        match self {
            Strategy::Ddp(_, ddp, _) | Strategy::Tp(_, ddp, _) => {
                (ddp.num_buckets(), ddp.overlaps())
            }
            Strategy::Zero(_, zero) => (
                zero.data_parallel().num_buckets(),
                zero.data_parallel().overlaps(),
            ),
            Strategy::Fsdp(..) | Strategy::Pp(..) | Strategy::Moe(..) | Strategy::TpMoe(..) => {
                (0, false)
            }
        }
    }

    /// This rank's parameters and optimizer state with where each part belongs in the whole
    /// model, and which ranks hold the same data: `(state, param replicas, moment replicas)`
    /// as `(index, count)` for sharing the writing.
    fn local_state(&self, ctx: &RankContext, grad_group: &Group) -> Result<SharedState, RankError> {
        let same = |name: &str| name.to_string();
        let everyone = (grad_group.rank(), grad_group.size());
        // Replicas of a split model: the dp ranks, and the cp ranks (which hold it whole).
        let sharing = [Axis::Dp, Axis::Cp];
        let replicas = replica_index(ctx, &sharing);
        let coord = |a| ctx.coord(a);
        let with_moments = |params: Vec<f32>, segments: Vec<Segment>, adam: &FlatAdamW| {
            let (m1, m2) = adam.moments();
            LocalState {
                params,
                moment_segments: segments.clone(),
                param_segments: segments,
                moments: [m1.to_vec(), m2.to_vec()],
                steps_taken: adam.steps_taken(),
            }
        };
        match self {
            Strategy::Ddp(model, _, optim) => {
                let segments = whole_segments(&ParamLayout::of(&**model), same);
                let state = with_moments(flatten_params(&**model), segments, optim.flat());
                Ok((state, everyone, everyone))
            }
            Strategy::Zero(model, zero) => {
                let layout = ParamLayout::of(&**model);
                let segments = whole_segments(&layout, same);
                let optim = zero.optimizer();
                let mut state = with_moments(flatten_params(&**model), segments, optim.flat());
                let runs = optim.shard_map().runs(grad_group.rank());
                state.moment_segments =
                    run_segments(&layout, runs.iter().map(|r| (r.flat, r.len)), 0, same);
                // Parameters are replicated; moments are this rank's own shard.
                Ok((state, everyone, (0, 1)))
            }
            Strategy::Fsdp(model, optim, _) => {
                let entries = model.shard_entries()?;
                let segments = placed_segments(&borrowed(&entries), 0, &coord, &sharing);
                let state = with_moments(flatten_params(&**model), segments, optim.flat());
                Ok((state, replicas, replicas))
            }
            Strategy::Tp(model, _, optim) => {
                let entries = model.placements().entries_of(&**model)?;
                let segments = placed_segments(&entries, 0, &coord, &sharing);
                let state = with_moments(flatten_params(&**model), segments, optim.flat());
                Ok((state, replicas, replicas))
            }
            Strategy::Moe(state) => {
                let entries = state.reduction.placements.entries_of(&state.model)?;
                let segments = placed_segments(&entries, 0, &coord, &sharing);
                let local =
                    with_moments(flatten_params(&state.model), segments, state.optim.flat());
                Ok((local, replicas, replicas))
            }
            Strategy::TpMoe(state) => {
                let entries = state.reduction.placements.entries_of(&state.model)?;
                let segments = placed_segments(&entries, 0, &coord, &sharing);
                let local =
                    with_moments(flatten_params(&state.model), segments, state.optim.flat());
                Ok((local, replicas, replicas))
            }
            Strategy::Pp(state) => {
                // Ranks along a ZeRO axis hold different rows: only the others share writing.
                let sharing: Vec<Axis> = match &state.optim {
                    StageOptimizer::Sharded(sh) => {
                        sharing.into_iter().filter(|&a| a != sh.axis).collect()
                    }
                    StageOptimizer::Replicated(_) => sharing.to_vec(),
                };
                let replicas = replica_index(ctx, &sharing);
                let entries = state.stepped_entries()?;
                let segments = placed_segments(&borrowed(&entries), 0, &coord, &sharing);
                let local = match &state.optim {
                    StageOptimizer::Replicated(optim) => {
                        with_moments(flatten_params(&state.chunks), segments, optim.flat())
                    }
                    StageOptimizer::Sharded(sh) => with_moments(sh.own.clone(), segments, &sh.adam),
                };
                Ok((local, replicas, replicas))
            }
        }
    }

    /// Puts a loaded [`LocalState`] (from [`Strategy::local_state`], filled by a checkpoint)
    /// back into the model and optimizer.
    fn restore(&mut self, state: LocalState) -> Result<(), RankError> {
        let LocalState {
            params,
            moments: [m1, m2],
            steps_taken,
            ..
        } = state;
        let adam = match self {
            Strategy::Ddp(model, _, optim) => {
                **model = load_flat((**model).clone(), &params);
                optim.flat_mut()
            }
            Strategy::Zero(model, zero) => {
                **model = load_flat((**model).clone(), &params);
                zero.optimizer_mut().flat_mut()
            }
            Strategy::Fsdp(model, optim, _) => {
                **model = load_flat((**model).clone(), &params);
                optim.flat_mut()
            }
            Strategy::Tp(model, _, optim) => {
                **model = load_flat((**model).clone(), &params);
                optim.flat_mut()
            }
            Strategy::Pp(state) => match &mut state.optim {
                StageOptimizer::Replicated(optim) => {
                    state.chunks = load_flat(std::mem::take(&mut state.chunks), &params);
                    optim.flat_mut()
                }
                StageOptimizer::Sharded(sh) => {
                    sh.own = params;
                    if sh.keep_params {
                        state.chunks = sh.gather(std::mem::take(&mut state.chunks))?;
                    }
                    &mut sh.adam
                }
            },
            Strategy::Moe(state) => {
                state.model = load_flat(state.model.clone(), &params);
                state.optim.flat_mut()
            }
            Strategy::TpMoe(state) => {
                state.model = load_flat(state.model.clone(), &params);
                state.optim.flat_mut()
            }
        };
        adam.restore(steps_taken, m1, m2).map_err(RankError::from)
    }

    /// Mixture of experts: every layer's routing bias (`None` for other strategies).
    fn moe_bias(&self) -> Option<Vec<Vec<f32>>> {
        match self {
            Strategy::Moe(state) => Some(state.bias()),
            Strategy::TpMoe(state) => Some(state.bias()),
            _ => None,
        }
    }

    /// Restores [`Strategy::moe_bias`]'s output.
    fn set_moe_bias(&mut self, bias: &[Vec<f32>]) -> Result<(), RankError> {
        match self {
            Strategy::Moe(state) => state.set_bias(bias),
            Strategy::TpMoe(state) => state.set_bias(bias),
            _ => Ok(()),
        }
    }

    /// The whole model's parameters by name, on world rank 0 (collective for every strategy
    /// but DDP and ZeRO-1/2; empty elsewhere).
    fn full_params(&self, ctx: &RankContext) -> Result<Vec<(String, Vec<f32>)>, RankError> {
        let full = match self {
            Strategy::Ddp(model, ..) | Strategy::Zero(model, ..) => model.valid(),
            Strategy::Fsdp(model, ..) => model.gather_full()?,
            Strategy::Tp(model, ..) => model.unshard()?,
            Strategy::Pp(state) => return gather_pipeline_params(ctx, state),
            Strategy::Moe(state) => state.experts.gather_experts(state.model.valid())?,
            Strategy::TpMoe(state) => state.experts.gather_experts(state.model.unshard()?)?,
        };
        let layout = ParamLayout::of(&full);
        let flat = flatten_params(&full);
        Ok(layout
            .slots
            .iter()
            .map(|s| (s.name.clone(), flat[s.offset..s.offset + s.numel].to_vec()))
            .collect())
    }
}

fn train_rank(
    ctx: &RankContext,
    config: &TrainConfig,
    model_config: &flashover_models::TransformerConfig,
    source: &dyn TokenSource,
    emit: &dyn Fn(&StepRecord),
    origin: Instant,
) -> Result<RankOutput, RankError> {
    let recompute = config.parallel.activation_checkpointing.clone();
    let device = if recompute.is_selective() {
        ctx.device().clone().autodiff().gradient_checkpointing()
    } else {
        ctx.device().clone().autodiff()
    };
    let block_recompute = recompute.block_recompute();
    let checkpointing = block_recompute.as_ref().map(|r| r.hook());
    // Every data-parallel rank (replica or shard) reads its own slice of the batch.
    let batch_group = ctx.subgroup(&[Axis::Dp, Axis::Fsdp, Axis::Ep])?;
    // Context-parallel ranks read the same samples and keep different positions of them; their
    // gradients are averaged together with the data-parallel ranks'.
    let cp = ctx.group(Axis::Cp);
    let grad_group = if cp.size() > 1 {
        ctx.subgroup(&[Axis::Dp, Axis::Fsdp, Axis::Ep, Axis::Cp])?
    } else {
        batch_group.clone()
    };
    let context = if cp.size() > 1 {
        let algorithm = config.parallel.cp_attention;
        let local_heads = model_config.n_heads / ctx.group(Axis::Tp).size();
        Some(ContextParallel::new(
            cp,
            config.data.seq_len,
            algorithm,
            config.parallel.cp_load_balance,
            local_heads,
        )?)
    } else {
        None
    };
    let plan = BatchPlan::new(
        config.run.global_batch,
        batch_group.size(),
        batch_group.rank(),
        config.run.micro_batches,
    )?;
    // Expert-parallel ranks build only their own experts.
    let model: Transformer = match &model_config.moe {
        Some(moe) => {
            let ep = ctx.group(Axis::Ep);
            let per = moe.n_experts / ep.size();
            let experts = ep.rank() * per..(ep.rank() + 1) * per;
            model_config.init_experts(config.run.seed, &device, experts)
        }
        None => model_config.init(config.run.seed, &device),
    };
    let mut strategy = Strategy::new(ctx, config, model_config, model, &grad_group)?;
    let policy = config.precision.policy()?;
    policy.check(&device)?;
    let mut precision = Precisions {
        scaler: policy.scaler(),
        policy,
    };
    let clip = config.optim.clip.filter(|&c| c > 0.0);
    let tokens_per_step = (config.run.global_batch * config.data.seq_len) as f64;
    let mut records = vec![];
    let world = ctx.world();
    let mut trace = Trace::new(origin);
    let first_step = match &config.checkpoint.resume {
        Some(path) => resume(
            ctx,
            config,
            &mut strategy,
            &mut precision.scaler,
            &grad_group,
            path,
        )?,
        None => 0,
    };
    if let Some(path) = &config.checkpoint.init_from {
        let file = flashover_checkpoint::ModelFile::open(path)
            .map_err(|e| RankError::from(format!("checkpoint.init_from: {e}")))?;
        let (mut state, _, _) = strategy.local_state(ctx, &grad_group)?;
        state
            .load_params(&file)
            .map_err(|e| RankError::from(format!("checkpoint.init_from: {e}")))?;
        strategy.restore(state)?;
    }
    let ckpt = &config.checkpoint;
    let mut saver = match (&ckpt.dir, ckpt.save_every) {
        (Some(dir), every) if every > 0 => Some(Saver::new(
            dir,
            ckpt.keep,
            ckpt.async_save,
            ckpt.fail_after_write
                .filter(|(rank, _)| *rank == ctx.rank())
                .map(|(_, step)| step as u64),
        )),
        _ => None,
    };
    let save = |saver: &mut Saver,
                strategy: &Strategy,
                scaler: &LossScaler,
                done: usize|
     -> Result<(), RankError> {
        let (state, param_replicas, moment_replicas) = strategy.local_state(ctx, &grad_group)?;
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
            .save(world, done as u64, run, pieces)
            .map_err(RankError::from)
    };
    let last_step = config
        .run
        .exit_after
        .map_or(config.run.steps, |e| e.min(config.run.steps));
    // A resumed run with nothing left to train (offline resharding) saves what it loaded.
    if first_step >= last_step
        && let Some(saver) = saver.as_mut()
    {
        save(saver, &strategy, &precision.scaler, first_step)?;
    }
    for step in first_step..last_step {
        let stats_before = ctx.comm_stats();
        let t0 = Instant::now();
        let lr = config.lr_at(step);
        let mut batches = |micro: usize| {
            let samples = plan.indices(step as u64, micro);
            // Dropout masks are keyed by global sample index: the same in every layout.
            let fwd = ForwardContext {
                dropout: (config.model.dropout > 0.0).then_some(Dropout {
                    p: config.model.dropout,
                    seed: config.run.seed,
                    step: step as u64,
                }),
                sample_offset: samples.start as usize,
                checkpointing: checkpointing.clone(),
                ..ForwardContext::default()
            };
            let (inputs, targets) = make_batch(source, samples, config.data.seq_len, &device);
            match &context {
                Some(cp) => (
                    cp.local_tokens(inputs),
                    cp.local_tokens(targets),
                    cp.forward_context(fwd),
                ),
                None => (inputs, targets, fwd),
            }
        };
        let attention_before = context.as_ref().map(|cp| cp.work()).unwrap_or_default();
        let recomputed_before = block_recompute.as_ref().map_or(0, |r| r.recomputed());
        let (next, mut outcome) = strategy.step(
            ctx,
            clip,
            &mut batches,
            plan.micro_batches(),
            lr,
            &mut precision,
        )?;
        strategy = next;
        if config.run.trace.is_some() {
            trace.record_step(
                step,
                t0,
                Instant::now(),
                std::mem::take(&mut outcome.events),
            );
        }
        let step_s = t0.elapsed().as_secs_f64();
        // From the device's allocator where the backend reports it (not Flex).
        let device_usage = ctx.device().memory_pool_usage();
        let attention = context.as_ref().map_or(AttentionWork::default(), |cp| {
            let now = cp.work();
            AttentionWork {
                score_elements: now.score_elements - attention_before.score_elements,
                compute: now.compute - attention_before.compute,
            }
        });
        let idle = ctx
            .comm_stats()
            .since(&stats_before)
            .total()
            .wait
            .as_secs_f64();
        let mine = RankMetrics {
            loss: outcome.loss_sum / plan.micro_batches() as f64,
            step_s,
            comm_s: outcome.comm.as_secs_f64(),
            overlapped_s: outcome.overlapped.as_secs_f64(),
            exposed_s: outcome.exposed.as_secs_f64(),
            idle_s: idle,
            grad_norm: outcome.grad_norm as f64,
            memory: outcome.memory,
            in_flight: outcome.in_flight,
            pipeline_s: outcome.pipeline.as_secs_f64(),
            a2a_s: outcome.a2a.as_secs_f64(),
            attention_s: attention.compute.as_secs_f64(),
            attention_scores: attention.score_elements,
            recomputed_blocks: (block_recompute.as_ref().map_or(0, |r| r.recomputed())
                - recomputed_before) as u64,
            device_memory: device_usage.map(|u| DeviceMemory {
                in_use: u.bytes_in_use,
                reserved: u.bytes_reserved,
            }),
        };
        let all = world.all_gather_vec(&mine.to_wire())?;
        if ctx.rank() == 0 {
            let ranks: Vec<RankMetrics> = all
                .chunks(RankMetrics::WIRE_LEN)
                .map(RankMetrics::from_wire)
                .collect();
            let facts = StepFacts {
                step,
                lr,
                tokens_per_step,
                moe: outcome.moe.take(),
                loss_scale: outcome.loss_scale,
                skipped: outcome.skipped,
            };
            let record = step_record(facts, &ranks);
            emit(&record);
            records.push(record);
        }
        let done = step + 1;
        if let Some(saver) = saver.as_mut()
            && (done.is_multiple_of(config.checkpoint.save_every) || done == last_step)
        {
            save(saver, &strategy, &precision.scaler, done)?;
        }
    }
    if let Some(saver) = saver.as_mut() {
        saver.finish(world).map_err(RankError::from)?;
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

/// Loads the checkpoint at `path` into `strategy` (every rank reads the regions it holds, so
/// any mesh can resume any checkpoint of the same model); returns the step to continue from.
fn resume(
    ctx: &RankContext,
    config: &TrainConfig,
    strategy: &mut Strategy,
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

/// What a replica holds under DDP: whole parameters, the gradient's peak, and Burn's AdamW
/// with two f32 moments per parameter.
fn replicated_memory(ddp: &DataParallel) -> MemoryReport {
    let numel = ddp.layout().numel;
    MemoryReport {
        params: numel * 4,
        grads: ddp.peak_grad_bytes(),
        optimizer: numel * 8,
        gathered_peak: 0,
    }
}

/// A job's precision policy and its running loss scale (equal on every rank).
struct Precisions {
    policy: MixedPrecision,
    scaler: LossScaler,
}

impl Precisions {
    /// After a step's gradients were reduced: records the loss scale and whether the step is
    /// skipped (a scaled gradient overflowed: the global norm is not finite, the same on
    /// every rank); returns whether to apply it.
    fn apply(&mut self, outcome: &mut StepOutcome) -> bool {
        let (apply, scale) = self.decide(outcome.grad_norm);
        outcome.loss_scale = scale;
        outcome.skipped = !apply;
        apply
    }

    /// [`Precisions::apply`] from the step's global gradient norm: whether to apply the step,
    /// and the loss scale it ran with (none without scaling).
    fn decide(&mut self, grad_norm: f32) -> (bool, Option<f32>) {
        if !self.scaler.is_active() {
            return (true, None);
        }
        let scale = self.scaler.scale();
        (self.scaler.update(grad_norm.is_finite()), Some(scale))
    }
}

/// Every micro-batch of a step under a replicated strategy (DDP, ZeRO-1/2, TP + DDP): forward
/// through `loss`, backward, gradients handed over. Returns the sum of the micro-batch losses.
fn run_micro_batches<S: MicroBatches, M: NextTokenLoss>(
    sync: &mut S,
    model: &M,
    batches: &mut dyn FnMut(usize) -> (Tensor<2, Int>, Tensor<2, Int>, ForwardContext),
    micro_batches: usize,
    precision: &Precisions,
) -> Result<f64, RankError> {
    sync.begin_step(micro_batches);
    let mut loss_sum = 0.0;
    for micro in 0..micro_batches {
        let (inputs, targets, fwd) = batches(micro);
        // Under a reduced-precision policy the forward runs on a cast view of the f32
        // parameters; backward brings their gradients back in f32.
        let compute = precision.policy.compute_view(sync.prepare(model));
        let l = compute.loss(inputs, targets, &fwd);
        loss_sum += l.clone().into_scalar::<f32>() as f64;
        let l = precision.scaler.scale_loss(l);
        let grads = GradientsParams::from_grads(l.backward(), model);
        sync.backward_done(model, grads)?;
    }
    Ok(loss_sum)
}

/// One expert-parallel step: every micro-batch's forward (tokens to their experts' ranks and
/// back) and backward with the auxiliary losses, gradients reduced over the ranks that share
/// each parameter, AdamW on this rank's parameters; routing statistics over the batch group.
fn moe_step<M: NextTokenLoss + MoeBlocks>(
    ctx: &RankContext,
    state: &mut MoeState<M>,
    clip: Option<f32>,
    batches: &mut dyn FnMut(usize) -> (Tensor<2, Int>, Tensor<2, Int>, ForwardContext),
    micro_batches: usize,
    lr: f64,
    precision: &mut Precisions,
) -> Result<StepOutcome, RankError> {
    let before = ctx.comm_stats();
    let a2a_before = state.experts.group().stats();
    state.experts.traffic().take();
    state
        .experts
        .replicate_hot(state.model.moe_blocks(), state.replicate_hot)?;
    let mut grads = vec![0.0f32; state.layout.numel];
    let mut loss_sum = 0.0f64;
    for micro in 0..micro_batches {
        let (inputs, targets, mut fwd) = batches(micro);
        fwd.moe = Some(state.hook.clone());
        let compute = precision.policy.compute_view(state.model.clone());
        let lm = compute.loss(inputs, targets, &fwd);
        loss_sum += lm.clone().into_scalar::<f32>() as f64;
        let total = match state.hook.take_aux_loss() {
            Some(aux) => lm + aux,
            None => lm,
        };
        let mut raw = precision.scaler.scale_loss(total).backward();
        state.experts.take_replica_grads(&mut raw);
        let g = GradientsParams::from_grads(raw, &state.model);
        accumulate_grads(&state.model, &g, &mut grads, &[]);
    }
    state
        .experts
        .fold_replica_grads(&state.model, state.model.moe_blocks(), &mut grads)?;
    if precision.scaler.is_active() {
        let scale = precision.scaler.scale();
        grads.iter_mut().for_each(|g| *g /= scale);
    }
    let r = &state.reduction;
    let entries = r.placements.entries_of(&state.model)?;
    let scale = match r.average {
        true => 1.0 / (r.batch.size() * micro_batches) as f32,
        false => 1.0,
    };
    r.reducer.reduce(&entries, &mut grads, scale, None)?;
    let grad_norm = clip_placed(&entries, &mut grads, clip, ctx)?;
    let (update, loss_scale) = precision.decide(grad_norm);
    if update {
        state.model = state.optim.step_flat(lr, state.model.clone(), &grads)?;
    }
    // Routing statistics and traffic over the whole batch group.
    let stats = state.hook.take_stats();
    let remote = state.experts.traffic().take();
    let batch = &state.reduction.batch;
    let mut sums: Vec<f64> = stats
        .routed
        .iter()
        .chain(&stats.kept)
        .flatten()
        .map(|&c| c as f64)
        .collect();
    sums.extend([
        stats.aux_loss,
        stats.z_loss,
        stats.forwards as f64,
        remote as f64,
    ]);
    batch.all_reduce(&mut sums, ReduceOp::Sum)?;
    let layers = stats.routed.len();
    let experts = stats.routed.first().map_or(0, Vec::len);
    let per_layer = |block: usize| -> Vec<Vec<u64>> {
        sums[block * layers * experts..(block + 1) * layers * experts]
            .chunks(experts.max(1))
            .map(|c| c.iter().map(|&v| v as u64).collect())
            .collect()
    };
    let (routed, kept) = (per_layer(0), per_layer(1));
    state
        .experts
        .record_loads(state.model.moe_blocks(), &routed);
    // Auxiliary-loss-free balancing: the global loads move every rank's biases alike.
    for (block, counts) in state.model.moe_blocks_mut().iter_mut().zip(&routed) {
        if let Some(moe) = block.moe.as_mut() {
            moe.update_bias(counts);
        }
    }
    let tail = &sums[2 * layers * experts..];
    let total_routed: u64 = routed.iter().flatten().sum();
    let total_kept: u64 = kept.iter().flatten().sum();
    let imbalance = kept
        .iter()
        .map(|l| {
            let mean = l.iter().sum::<u64>() as f64 / l.len().max(1) as f64;
            l.iter().copied().max().unwrap_or(0) as f64 / mean.max(f64::MIN_POSITIVE)
        })
        .fold(0.0, f64::max);
    let d = state.d_model;
    let comm = ctx.comm_stats().since(&before).total();
    let a2a = state.experts.group().stats().since(&a2a_before).total();
    let numel = state.layout.numel;
    Ok(StepOutcome {
        loss_sum,
        grad_norm,
        comm: comm.wait + comm.transfer,
        overlapped: Duration::ZERO,
        exposed: comm.wait + comm.transfer,
        memory: MemoryReport {
            params: numel * 4,
            grads: numel * 4,
            optimizer: numel * 8,
            gathered_peak: 0,
        },
        events: vec![],
        in_flight: 0,
        pipeline: Duration::ZERO,
        moe: Some(MoeRecord {
            tokens_per_expert: kept,
            imbalance,
            drop_rate: 1.0 - total_kept as f64 / (total_routed as f64).max(1.0),
            aux_loss: tail[0] / tail[2].max(1.0),
            z_loss: tail[1] / tail[2].max(1.0),
            a2a_remote_bytes: tail[3] as u64 * d as u64 * 4,
            a2a_s: 0.0,
        }),
        a2a: a2a.wait + a2a.transfer,
        loss_scale,
        skipped: !update,
    })
}

/// This rank's index among the ranks that differ from it only along `axes` (row-major over
/// `axes`), and their number: the ranks that hold the same data and share writing it.
fn replica_index(ctx: &RankContext, axes: &[Axis]) -> (usize, usize) {
    axes.iter().fold((0, 1), |(index, count), &axis| {
        let group = ctx.group(axis);
        (index * group.size() + group.rank(), count * group.size())
    })
}

/// `entries` held by value, seen as `clip_placed` and `placed_segments` take them.
fn borrowed(entries: &[(ParamSlot, ParamPlacement)]) -> Vec<(ParamSlot, &ParamPlacement)> {
    entries.iter().map(|(s, e)| (s.clone(), e)).collect()
}

/// The global norm of a flat gradient laid out as `entries` say, clipped to `clip` in place;
/// returns the norm before clipping.
fn clip_placed(
    entries: &[(ParamSlot, &ParamPlacement)],
    flat: &mut [f32],
    clip: Option<f32>,
    ctx: &RankContext,
) -> Result<f32, RankError> {
    let parts = entries
        .iter()
        .map(|(slot, entry)| (*entry, &flat[slot.offset..slot.offset + slot.numel]));
    let norm = global_grad_norm(parts, ctx)?;
    if let Some(scale) = clip_scale(norm, clip)? {
        flat.iter_mut().for_each(|g| *g *= scale);
    }
    Ok(norm)
}

/// One pipeline step: the schedule over every micro-batch, gradients averaged over `dp`
/// replicas, clipped by the global norm over every stage, then AdamW on this rank's chunks.
fn pipeline_step(
    ctx: &RankContext,
    state: &mut PipelineState,
    clip: Option<f32>,
    batches: &mut dyn FnMut(usize) -> (Tensor<2, Int>, Tensor<2, Int>, ForwardContext),
    micro_batches: usize,
    lr: f64,
    precision: &mut Precisions,
) -> Result<StepOutcome, RankError> {
    let pp = ctx.group(Axis::Pp);
    let before = ctx.comm_stats();
    let data: Vec<_> = (0..micro_batches).map(&mut *batches).collect();
    let device = data[0].0.device();
    let policy = precision.policy;
    if let StageOptimizer::Sharded(sh) = &state.optim
        && !sh.keep_params
    {
        state.chunks = sh.gather(std::mem::take(&mut state.chunks))?;
    }
    let mut executor = PipelineExecutor::new(&state.schedule, pp)?
        .with_activation_dtype(policy.param_dtype.float_dtype().into())
        .with_loss_scale(precision.scaler.scale());
    let mut hook = None;
    if let Some((store, linear)) = &state.deferral {
        executor = executor.deferring_weight_grads(store.clone());
        hook = Some(linear.clone());
    }
    let (grads, report) = executor.step(
        &state.chunks,
        state.shape,
        &device,
        |_, stage: &TransformerStage, input, micro| {
            let (tokens, targets, mut fwd) = data[micro].clone();
            fwd.linear = hook.clone();
            policy
                .compute_view(stage.clone())
                .forward(input, tokens, targets, &fwd)
        },
    )?;
    // One flat gradient over this rank's chunks, averaged over replicas.
    let mut flat = vec![0.0f32; state.layouts.iter().map(|l| l.numel).sum()];
    let mut at = 0;
    for ((chunk, g), layout) in state.chunks.iter().zip(&grads).zip(&state.layouts) {
        accumulate_grads(chunk, g, &mut flat[at..at + layout.numel], &[]);
        at += layout.numel;
    }
    drop(grads);
    let numel = flat.len();
    // Under ZeRO each rank keeps the sum of its own rows over the shard axis.
    if let StageOptimizer::Sharded(sh) = &state.optim {
        flat = sh
            .shards
            .reduce_scatter(&sh.group, &flat, state.reduce_dtype)?;
    }
    // Sum over the (other) data-parallel ranks and the tied copies over their stages; the
    // executor averaged over micro-batches already.
    let entries = state.stepped_entries()?;
    let entries = borrowed(&entries);
    let scale = match state.average {
        true => 1.0 / state.data_ranks as f32,
        false => micro_batches as f32,
    };
    state
        .reducer
        .reduce(&entries, &mut flat, scale, state.tie.as_ref())?;
    let grad_norm = clip_placed(&entries, &mut flat, clip, ctx)?;
    drop(entries);
    let (update, loss_scale) = precision.decide(grad_norm);
    let chunks = std::mem::take(&mut state.chunks);
    state.chunks = match &mut state.optim {
        StageOptimizer::Replicated(optim) if update => optim.step_flat(lr, chunks, &flat)?,
        StageOptimizer::Replicated(_) => chunks,
        StageOptimizer::Sharded(sh) => {
            if update {
                sh.adam.step(lr, &mut sh.own, &flat);
            }
            match sh.keep_params {
                true => sh.gather(chunks)?,
                false => placeholders(chunks),
            }
        }
    };
    // Only the last stage computed losses: share them along the pipeline.
    let mut loss = [report.loss_sum];
    pp.all_reduce(&mut loss, ReduceOp::Sum)?;
    let comm = ctx.comm_stats().since(&before).total();
    let comm = comm.wait + comm.transfer;
    let (params, held) = match &state.optim {
        StageOptimizer::Sharded(sh) if !sh.keep_params => (sh.own.len(), sh.own.len()),
        StageOptimizer::Sharded(sh) => (numel, sh.own.len()),
        StageOptimizer::Replicated(_) => (numel, numel),
    };
    Ok(StepOutcome {
        loss_sum: loss[0],
        grad_norm,
        comm,
        overlapped: Duration::ZERO,
        // The schedule's idle time: its bubble (receive waits and hand-offs).
        exposed: report.wall.saturating_sub(report.forward + report.backward),
        pipeline: report.wall,
        in_flight: report.peak_in_flight,
        events: report.events,
        memory: MemoryReport {
            params: params * 4,
            grads: held * 4,
            optimizer: held * 8,
            // Under ZeRO-3 the chunks are gathered for the whole step.
            gathered_peak: if params < numel { numel * 4 } else { 0 },
        },
        moe: None,
        a2a: Duration::ZERO,
        loss_scale,
        skipped: !update,
    })
}

/// Every stage's parameters, named as in the whole model, gathered to world rank 0.
fn gather_pipeline_params(
    ctx: &RankContext,
    state: &PipelineState,
) -> Result<Vec<(String, Vec<f32>)>, RankError> {
    let pp = ctx.group(Axis::Pp);
    // Whole weights first (collective over tp when the stages are split, and over the shard
    // axis under ZeRO-3).
    let whole = state
        .whole_chunks()?
        .iter()
        .map(|c| c.unshard())
        .collect::<Result<Vec<_>, _>>()?;
    let mine: Vec<f32> = whole.iter().flat_map(flatten_params).collect();
    let mut longest = [mine.len() as u64];
    pp.all_reduce(&mut longest, ReduceOp::Max)?;
    let mut padded = mine;
    padded.resize(longest[0] as usize, 0.0);
    let all = pp.all_gather_vec(&padded)?;
    if ctx.rank() != 0 {
        return Ok(vec![]);
    }
    let s = &state.schedule;
    let mut named = vec![];
    for (rank, values) in all.chunks(longest[0] as usize).enumerate() {
        let mut at = 0;
        for chunk in 0..s.chunks {
            for (name, numel) in &state.stage_params[s.stage_of(rank, chunk)] {
                // The tied head's copy is the embedding: reported once, as `embed.weight`.
                if let Some(name) = name {
                    named.push((name.clone(), values[at..at + numel].to_vec()));
                }
                at += numel;
            }
        }
    }
    // In the whole model's order, so reports compare name by name.
    let order = &state.order;
    named.sort_by_key(|(name, _)| order.iter().position(|n| n == name).unwrap_or(usize::MAX));
    Ok(named)
}

//! The planner ([`flashover_plan`]) fed from a training job: the reference model and batch of a
//! [`TrainConfig`] as the planner's model and workload.

use crate::train::TrainConfig;
use flashover_parallel::activation_checkpointing::CheckpointPolicy;
use flashover_parallel::pipeline::ScheduleKind;
pub use flashover_plan::*;

/// The job's model (the reference transformer with its `[model]` and `[moe]` fields) as the
/// planner describes models.
///
/// ```
/// use flashover::plan::{Hardware, PlanRequest, Precision, Fixed, model_spec, plan, workload};
/// use flashover::train::TrainConfig;
///
/// let job = TrainConfig::default();
/// let request = PlanRequest {
///     world: 4,
///     hardware: Hardware::preset("cpu").unwrap(),
///     model: model_spec(&job).unwrap(),
///     workload: workload(&job).unwrap(),
///     precision: Precision::Fp32,
///     fixed: Fixed::default(),
///     include_unsupported: false,
/// };
/// let best = &plan(&request).unwrap().plans[0];
/// assert_eq!(best.layout.world(), 4);
/// // The job's own mesh as the planner sees it (what `bench plan` predicts).
/// assert_eq!(flashover::plan::layout_of(&job).unwrap().mesh_spec(), "dp=2");
/// ```
pub fn model_spec(config: &TrainConfig) -> Result<ModelSpec, String> {
    let t = config.transformer(config.vocab_size())?;
    let moe = t.moe.as_ref();
    Ok(ModelSpec {
        name: format!("reference ({})", config.model.preset),
        layers: t.n_layers,
        hidden: t.d_model,
        heads: t.n_heads,
        kv_heads: t.n_heads,
        ffn: moe.map_or(t.d_ff, |m| m.d_expert),
        vocab: t.vocab_size,
        tied_embeddings: t.tie_embeddings,
        experts: moe.map_or(0, |m| m.n_experts),
        top_k: moe.map_or(0, |m| m.top_k),
    })
}

/// The job's batch: sequence length and global batch.
pub fn workload(config: &TrainConfig) -> Result<Workload, String> {
    Ok(Workload {
        seq_len: config.data.seq_len,
        global_batch: config.run.global_batch,
    })
}

/// The planner's layout for the job's own mesh and options (what `train` would run).
pub fn layout_of(config: &TrainConfig) -> Result<Layout, String> {
    use flashover_mesh::Axis;
    let mesh = config.mesh()?;
    let p = &config.parallel;
    let schedule = match p.pp_schedule {
        ScheduleKind::GPipe => PipelineSchedule::Gpipe,
        ScheduleKind::Interleaved1F1B => PipelineSchedule::Interleaved {
            chunks: p.pp_chunks.max(1),
        },
        ScheduleKind::ZeroBubbleH1 => PipelineSchedule::ZbH1,
        ScheduleKind::OneFOneB => PipelineSchedule::OneFOneB,
    };
    let recompute = match &p.activation_checkpointing {
        CheckpointPolicy::None => Recompute::None,
        CheckpointPolicy::Selective => Recompute::Selective,
        _ => Recompute::Full,
    };
    let mut layout = Layout {
        pp: mesh.degree(Axis::Pp),
        dp: mesh.degree(Axis::Dp),
        fsdp: mesh.degree(Axis::Fsdp),
        ep: mesh.degree(Axis::Ep),
        cp: mesh.degree(Axis::Cp),
        tp: mesh.degree(Axis::Tp),
        zero: p.zero,
        sequence_parallel: p.sequence_parallel,
        schedule,
        recompute,
        micro_batch: 1,
        stage_blocks: None,
    };
    // The samples `run.micro_batches` makes of each data-parallel rank's share.
    layout.micro_batch =
        (config.run.global_batch / layout.batch_ranks().max(1) / config.run.micro_batches.max(1))
            .max(1);
    // The job's own cut; `None` (the planner's cost cut) when the job asks for that one. A
    // cut the job cannot make is `validate`'s error to report; the estimate then uses the cost
    // cut.
    let own_cut = p.pp_split != "cost" || p.pp_blocks.is_some();
    if layout.pp > 1 && own_cut {
        layout.stage_blocks = config
            .transformer(config.vocab_size())
            .and_then(|model| config.pipeline_blocks(&model, layout.pp * layout.chunks()))
            .ok();
    }
    Ok(layout)
}

/// `config` set to train `layout`: its mesh, ZeRO stage, sequence parallelism, pipeline
/// schedule and stage cut, recomputation and micro-batches (the inverse of [`layout_of`]).
/// Pipelines are cut as the layout says: its `stage_blocks`, or by cost (`pp_split = "cost"`),
/// as the planner's search assumes.
///
/// ```
/// use flashover::plan::{apply_layout, layout_of};
/// use flashover::train::TrainConfig;
///
/// let mut planned = layout_of(&TrainConfig::default()).unwrap();
/// (planned.dp, planned.tp, planned.sequence_parallel) = (1, 2, true);
/// let mut job = TrainConfig::default();
/// apply_layout(&mut job, &planned);
/// assert_eq!(job.parallel.mesh, "tp=2");
/// assert_eq!(layout_of(&job).unwrap(), planned);
/// ```
pub fn apply_layout(config: &mut TrainConfig, layout: &Layout) {
    let p = &mut config.parallel;
    p.mesh = layout.mesh_spec();
    p.zero = layout.zero;
    p.sequence_parallel = layout.sequence_parallel;
    (p.pp_schedule, p.pp_chunks) = match layout.schedule {
        PipelineSchedule::Gpipe => (ScheduleKind::GPipe, 1),
        PipelineSchedule::OneFOneB => (ScheduleKind::OneFOneB, 1),
        PipelineSchedule::Interleaved { chunks } => (ScheduleKind::Interleaved1F1B, chunks),
        PipelineSchedule::ZbH1 => (ScheduleKind::ZeroBubbleH1, 1),
    };
    p.activation_checkpointing = match layout.recompute {
        Recompute::None => CheckpointPolicy::None,
        Recompute::Selective => CheckpointPolicy::Selective,
        Recompute::Full => CheckpointPolicy::Full,
    };
    if layout.pp > 1 {
        p.pp_split = "cost".into();
        p.pp_blocks = layout.stage_blocks.clone();
    }
    let batch = Workload {
        seq_len: config.data.seq_len,
        global_batch: config.run.global_batch,
    };
    config.run.micro_batches = layout.micro_batches(&batch).max(1);
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A job's pipeline is estimated with the blocks its stages hold: its own list, its even
    /// cut, or the cost cut (the planner's default); `apply_layout` writes the cut back.
    #[test]
    fn a_jobs_own_stage_cut_is_what_the_planner_estimates() {
        let mut job = TrainConfig::default();
        job.parallel.mesh = "pp=2".into();
        job.model.n_layers = Some(4);
        job.parallel.pp_blocks = Some(vec![3, 1]);
        let layout = layout_of(&job).unwrap();
        assert_eq!(layout.stage_blocks, Some(vec![3, 1]));
        let (model, work) = (model_spec(&job).unwrap(), workload(&job).unwrap());
        let held = flashover_plan::cost::stage_blocks(&model, &work, &layout);
        assert_eq!(held, vec![3, 1]);
        let mut written = TrainConfig::default();
        apply_layout(&mut written, &layout);
        assert_eq!(written.parallel.pp_blocks, Some(vec![3, 1]));
        job.parallel.pp_blocks = None;
        job.parallel.pp_split = "even".into();
        assert_eq!(layout_of(&job).unwrap().stage_blocks, Some(vec![2, 2]));
        job.parallel.pp_split = "cost".into();
        assert_eq!(layout_of(&job).unwrap().stage_blocks, None);
    }

    /// Whatever `plan` ranks, `train` accepts: both ask the one rule table, and this checks
    /// the planner's layouts through the training job's own validation.
    #[test]
    fn plan_never_proposes_a_layout_that_train_refuses() {
        for (world, experts) in [(8, 0), (16, 0), (8, 4), (16, 8)] {
            let mut job = TrainConfig::default();
            job.run.global_batch = 64;
            job.run.micro_batches = 32; // one sample per micro-batch on the default dp=2
            job.data.seq_len = 64;
            job.moe.experts = experts;
            let request = PlanRequest {
                world,
                hardware: Hardware::preset("cpu").unwrap(),
                model: model_spec(&job).unwrap(),
                workload: workload(&job).unwrap(),
                precision: Precision::Fp32,
                fixed: Fixed::default(),
                include_unsupported: false,
            };
            let result = plan(&request).unwrap();
            assert!(!result.plans.is_empty(), "world {world}, experts {experts}");
            for proposed in &result.plans {
                let mut candidate = job.clone();
                apply_layout(&mut candidate, &proposed.layout);
                let refused: Vec<_> = candidate
                    .validate()
                    .into_iter()
                    .filter(|e| e.contains("(rule `"))
                    .collect();
                assert!(refused.is_empty(), "{}: {refused:?}", proposed.layout);
            }
        }
    }
}

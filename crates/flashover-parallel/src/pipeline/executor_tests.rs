//! The pipeline executor against one rank: an 8-layer stack split into p x v virtual stages,
//! every built-in schedule at p = 2, 3, 4 and m = 1, p, 2p + 1 micro-batches, and dp x pp;
//! the loss and every layer's gradient must match the unsplit model on the whole batch.

use burn::module::{Module, Param};
use burn::nn::Linear;

use crate::ParallelError;
use crate::pipeline::{
    ActionKind, PartSpec, PipelineExecutor, Schedule, ScheduleKind, StageOutput, WeightGradStore,
    boundary_tensors, deferred_linear, from_boundary_tensors,
};
use burn::tensor::{Device, Tensor, TensorData};
use flashover_comm::{CommResult, CommunicatorExt, DType, ReduceOp, Transfer};
use flashover_runtime::{Axis, Launch, launch};

const LAYERS: usize = 8;
const ROWS_PER_MICRO: usize = 2;
/// Tolerance against one rank computing the whole batch at once, relative to the largest
/// gradient element (fp32; the pipeline also matches one rank accumulating the same
/// micro-batches to 1e-6).
const WHOLE_BATCH: f32 = 1e-5;

#[derive(Module, Debug)]
struct Stack {
    layers: Vec<Linear>,
}

fn layer(i: usize, device: &Device) -> Linear {
    // Near identity plus a perturbation: the signal and its gradient survive eight layers.
    let w: Vec<f32> = (0..36)
        .map(|k| (k % 7 == 0) as u8 as f32 + (k as f32 * 0.41 + i as f32).sin() * 0.3)
        .collect();
    Linear {
        weight: Param::from_data(TensorData::new(w, [6, 6]), device),
        bias: None,
    }
}

impl Stack {
    fn new(range: std::ops::Range<usize>, device: &Device) -> Self {
        Stack {
            layers: range.map(|i| layer(i, device)).collect(),
        }
    }

    /// With `store`, the layers defer their weight gradients to it (zero-bubble's split).
    fn forward(&self, mut x: Tensor<2>, store: Option<&WeightGradStore>) -> Tensor<2> {
        for l in &self.layers {
            x = match store {
                Some(store) => deferred_linear(l, x, store),
                None => l.forward(x),
            }
            .tanh();
        }
        x
    }
}

fn rows(first: usize, n: usize, device: &Device) -> Tensor<2> {
    let v: Vec<f32> = (first * 6..(first + n) * 6)
        .map(|i| (i as f32 * 0.23).cos())
        .collect();
    Tensor::from_data(TensorData::new(v, [n, 6]), device)
}

/// What crosses every boundary: one micro-batch's rows, f32, with a gradient.
fn boundary() -> Vec<PartSpec> {
    vec![PartSpec {
        shape: vec![ROWS_PER_MICRO, 6],
        dtype: burn::tensor::DType::F32,
        grad: true,
    }]
}

fn loss(y: Tensor<2>) -> Tensor<1> {
    (y - 1.5).powi_scalar(2).mean()
}

/// Layers of virtual stage `k` of `stages`.
fn stage_layers(k: usize, stages: usize) -> std::ops::Range<usize> {
    k * LAYERS / stages..(k + 1) * LAYERS / stages
}

/// Loss and per-layer weight gradients of the whole stack on `n` rows.
fn reference(n: usize) -> (f32, Vec<Vec<f32>>) {
    let device = Device::flex().autodiff();
    let stack = Stack::new(0..LAYERS, &device);
    let l = loss(stack.forward(rows(0, n, &device), None));
    let value = l.clone().into_scalar::<f32>();
    let grads = l.backward();
    let g = stack
        .layers
        .iter()
        .map(|layer| {
            layer
                .weight
                .grad(&grads)
                .unwrap()
                .into_data()
                .try_to_vec::<f32>()
                .unwrap()
        })
        .collect();
    (value, g)
}

/// The same on one rank, accumulating `m` micro-batches of `ROWS_PER_MICRO` rows (gradients
/// averaged): the order of sums the pipeline uses.
fn reference_accumulated(m: usize) -> (f32, Vec<Vec<f32>>) {
    let device = Device::flex().autodiff();
    let stack = Stack::new(0..LAYERS, &device);
    let mut total = 0.0;
    let mut sums = vec![vec![0.0f32; 36]; LAYERS];
    for micro in 0..m {
        let l = loss(stack.forward(rows(micro * ROWS_PER_MICRO, ROWS_PER_MICRO, &device), None));
        total += l.clone().into_scalar::<f32>();
        let grads = l.backward();
        for (acc, layer) in sums.iter_mut().zip(&stack.layers) {
            let g = layer
                .weight
                .grad(&grads)
                .unwrap()
                .into_data()
                .try_to_vec::<f32>()
                .unwrap();
            acc.iter_mut().zip(g).for_each(|(a, x)| *a += x);
        }
    }
    for acc in &mut sums {
        acc.iter_mut().for_each(|a| *a /= m as f32);
    }
    (total / m as f32, sums)
}

/// Runs `kind` on `mesh` (pp and optional dp) with `m` micro-batches per replica: the mean loss
/// and every layer's gradient (averaged over dp), gathered by layer index.
/// Loss and every layer's gradient from one pipelined step; with `defer`, weight gradients
/// are deferred to the weight-gradient actions (which must then have done work).
fn pipelined(
    mesh: &str,
    kind: ScheduleKind,
    m: usize,
    v: usize,
    defer: bool,
) -> Result<(f32, Vec<Vec<f32>>), String> {
    pipelined_on(mesh, kind, m, v, defer, false)
}

/// [`pipelined`], with `rendezvous`, on a pipeline group whose sends wait for their receives
/// ([`RendezvousSends`]; a deadlock then fails within seconds).
fn pipelined_on(
    mesh: &str,
    kind: ScheduleKind,
    m: usize,
    v: usize,
    defer: bool,
    rendezvous: bool,
) -> Result<(f32, Vec<Vec<f32>>), String> {
    let launcher = Launch::new(mesh).map_err(|e| e.to_string())?;
    let launcher = match rendezvous {
        true => launcher.timeout(std::time::Duration::from_secs(10)),
        false => launcher,
    };
    let out = launcher
        .run(|ctx| {
            let device = Device::flex().autodiff();
            let pp = &match rendezvous {
                true => RendezvousSends::wrap(ctx.group(Axis::Pp))?,
                false => ctx.group(Axis::Pp).clone(),
            };
            let dp = ctx.group(Axis::Dp);
            let schedule =
                Schedule::build(kind, pp.size(), m, v).map_err(ParallelError::Invalid)?;
            let stages = schedule.stages();
            let chunks: Vec<Stack> = (0..schedule.chunks)
                .map(|c| {
                    Stack::new(
                        stage_layers(schedule.stage_of(pp.rank(), c), stages),
                        &device,
                    )
                })
                .collect();
            let first_row = dp.rank() * m * ROWS_PER_MICRO;
            let last = stages - 1;
            let store = defer.then(WeightGradStore::default);
            let mut executor = PipelineExecutor::new(&schedule, pp)?;
            if let Some(store) = &store {
                executor = executor.deferring_weight_grads(store.clone());
            }
            let (flats, loss_sums, report) = executor.step_flat(
                &chunks,
                &boundary(),
                &device,
                |chunk, module: &Stack, input, micro| {
                    let stage = schedule.stage_of(pp.rank(), chunk);
                    let x = input.map(from_boundary_tensors).unwrap_or_else(|| {
                        rows(first_row + micro * ROWS_PER_MICRO, ROWS_PER_MICRO, &device)
                    });
                    let y = module.forward(x, store.as_ref());
                    if stage == last {
                        StageOutput::Loss(loss(y))
                    } else {
                        StageOutput::Activation(boundary_tensors(y))
                    }
                },
            )?;
            let splits = schedule.ranks[pp.rank()]
                .iter()
                .any(|a| a.kind == ActionKind::BackwardWeight);
            assert_eq!(
                report.deferred_weight_grads > 0,
                defer && splits,
                "weight-gradient actions computed something exactly when deferring"
            );
            // Every layer's gradient, averaged over data-parallel replicas.
            let mut per_layer = vec![];
            for (c, flat) in flats.into_iter().enumerate() {
                let mut flat = crate::params::to_f32(flat);
                dp.all_reduce(&mut flat, ReduceOp::Avg)?;
                let first = stage_layers(schedule.stage_of(pp.rank(), c), stages).start;
                for (i, w) in flat.chunks(36).enumerate() {
                    per_layer.push((first + i, w.to_vec()));
                }
            }
            let mut l = [crate::params::to_f32(loss_sums)[0] as f64 / m as f64];
            ctx.world().all_reduce(&mut l, ReduceOp::Sum)?;
            // Only the dp replicas' last stages contributed a loss.
            Ok::<_, ParallelError>((l[0] as f32 / dp.size() as f32, per_layer))
        })
        .map_err(|e| e.to_string())?;
    let mut layers = vec![vec![]; LAYERS];
    for (_, per_layer) in &out {
        for (i, w) in per_layer {
            layers[*i] = w.clone();
        }
    }
    Ok((out[0].0, layers))
}

/// Loss, and every layer's gradient within `tol` of the largest gradient element of the model
/// (as the layout tests compare parameters).
fn assert_close(got: &(f32, Vec<Vec<f32>>), want: &(f32, Vec<Vec<f32>>), tol: f32, what: &str) {
    assert!(
        (got.0 - want.0).abs() <= 1e-5 * want.0.abs(),
        "{what}: loss {} vs {}",
        got.0,
        want.0
    );
    let scale = want
        .1
        .iter()
        .flatten()
        .fold(0f32, |m, x| m.max(x.abs()))
        .max(1e-12);
    for (i, (g, w)) in got.1.iter().zip(&want.1).enumerate() {
        let diff = g.iter().zip(w).fold(0f32, |m, (a, b)| m.max((a - b).abs())) / scale;
        assert!(
            diff <= tol,
            "{what}: layer {i} gradient differs by {diff:e}"
        );
    }
}

#[test]
fn every_schedule_matches_one_rank_at_p_2_3_4() {
    for p in [2, 3, 4] {
        for m in [1, p, 2 * p + 1] {
            let want = reference(m * ROWS_PER_MICRO);
            let acc = reference_accumulated(m);
            for kind in [
                ScheduleKind::GPipe,
                ScheduleKind::OneFOneB,
                ScheduleKind::ZeroBubbleH1,
            ] {
                // Zero-bubble also with its backward split for real (deferred weight
                // gradients); the other schedules compute them at once when deferring.
                for defer in [false, true] {
                    let got = pipelined(&format!("pp={p}"), kind, m, 1, defer).unwrap();
                    let what = format!("{kind:?} p={p} m={m} defer={defer}");
                    // Same sums in the same order as one rank accumulating micro-batches.
                    assert_close(&got, &acc, 1e-6, &format!("{what} vs accumulated"));
                    assert_close(&got, &want, WHOLE_BATCH, &format!("{what} vs whole batch"));
                }
            }
        }
        // Interleaved: two chunks per rank, micro-batches a multiple of p.
        let m = 2 * p;
        let got = pipelined(
            &format!("pp={p}"),
            ScheduleKind::Interleaved1F1B,
            m,
            2,
            false,
        )
        .unwrap();
        let what = format!("interleaved p={p}");
        assert_close(&got, &reference_accumulated(m), 1e-6, &what);
        assert_close(&got, &reference(m * ROWS_PER_MICRO), WHOLE_BATCH, &what);
    }
}

#[test]
fn data_parallel_times_pipeline_matches_one_rank() {
    let want = reference(2 * 3 * ROWS_PER_MICRO);
    for (kind, defer) in [
        (ScheduleKind::OneFOneB, false),
        (ScheduleKind::ZeroBubbleH1, true),
    ] {
        let got = pipelined("pp=2,dp=2", kind, 3, 1, defer).unwrap();
        assert_close(&got, &want, WHOLE_BATCH, &format!("dp=2 x pp=2 {kind:?}"));
    }
}

#[test]
fn an_invalid_schedule_is_refused_before_anything_runs() {
    let err = launch("pp=2", |ctx| {
        let mut schedule = Schedule::build(ScheduleKind::OneFOneB, 2, 2, 1).unwrap();
        schedule.ranks[1].retain(|a| a.kind != ActionKind::RecvActivation);
        PipelineExecutor::new(&schedule, ctx.group(Axis::Pp)).map(|_| ())
    })
    .unwrap_err()
    .to_string();
    assert!(err.contains("invalid pipeline schedule"), "{err}");
    assert!(
        err.contains("before its input activation was received"),
        "{err}"
    );
}

/// A thread group whose sends wait for their receives, as NCCL's do: a receiver acknowledges
/// each message on a second group, and a send returns with the acknowledgement. A batch posts
/// its sends, takes its receives, then waits for its sends' acknowledgements, so its transfers
/// progress together as an NCCL group's do.
struct RendezvousSends {
    data: flashover_comm::Group,
    acks: flashover_comm::Group,
}

impl RendezvousSends {
    /// `group` with rendezvous sends (collective: every rank of `group` calls it).
    fn wrap(group: &flashover_comm::Group) -> CommResult<flashover_comm::Group> {
        let acks = group.split(0, group.rank(), "acks")?;
        let data = group.clone();
        Ok(flashover_comm::Group::new(std::sync::Arc::new(
            RendezvousSends { data, acks },
        )))
    }

    fn acknowledged(&self, dst: usize) -> CommResult<()> {
        self.acks.recv_bytes(&mut [0u8], DType::U8, dst)
    }

    fn acknowledge(&self, src: usize) -> CommResult<()> {
        self.acks.send_bytes(&[1u8], DType::U8, src)
    }
}

impl flashover_comm::Communicator for RendezvousSends {
    fn rank(&self) -> usize {
        self.data.rank()
    }
    fn size(&self) -> usize {
        self.data.size()
    }
    fn name(&self) -> &str {
        self.data.name()
    }
    fn members(&self) -> &[usize] {
        self.data.members()
    }
    fn all_reduce_bytes(&self, buf: &mut [u8], dtype: DType, op: ReduceOp) -> CommResult<()> {
        self.data.all_reduce_bytes(buf, dtype, op)
    }
    fn reduce_scatter_bytes(
        &self,
        send: &[u8],
        recv: &mut [u8],
        dtype: DType,
        op: ReduceOp,
    ) -> CommResult<()> {
        self.data.reduce_scatter_bytes(send, recv, dtype, op)
    }
    fn all_gather_bytes(&self, send: &[u8], recv: &mut [u8], dtype: DType) -> CommResult<()> {
        self.data.all_gather_bytes(send, recv, dtype)
    }
    fn broadcast_bytes(&self, buf: &mut [u8], dtype: DType, root: usize) -> CommResult<()> {
        self.data.broadcast_bytes(buf, dtype, root)
    }
    fn all_to_all_v_bytes(
        &self,
        send: &[u8],
        send_counts: &[usize],
        recv: &mut [u8],
        recv_counts: &[usize],
        dtype: DType,
    ) -> CommResult<()> {
        (self.data).all_to_all_v_bytes(send, send_counts, recv, recv_counts, dtype)
    }
    fn send_bytes(&self, buf: &[u8], dtype: DType, dst: usize) -> CommResult<()> {
        self.data.send_bytes(buf, dtype, dst)?;
        self.acknowledged(dst)
    }
    fn recv_bytes(&self, buf: &mut [u8], dtype: DType, src: usize) -> CommResult<()> {
        self.data.recv_bytes(buf, dtype, src)?;
        self.acknowledge(src)
    }
    fn exchange_bytes(&self, transfers: &mut [Transfer<'_>]) -> CommResult<()> {
        for t in transfers.iter() {
            if let Transfer::Send { buf, dtype, dst } = t {
                self.data.send_bytes(buf, *dtype, *dst)?;
            }
        }
        for t in transfers.iter_mut() {
            if let Transfer::Recv { buf, dtype, src } = t {
                self.recv_bytes(buf, *dtype, *src)?;
            }
        }
        for t in transfers.iter() {
            if let Transfer::Send { dst, .. } = t {
                self.acknowledged(*dst)?;
            }
        }
        Ok(())
    }
    fn barrier(&self) -> CommResult<()> {
        self.data.barrier()
    }
    fn split(&self, color: usize, key: usize, label: &str) -> CommResult<flashover_comm::Group> {
        self.data.split(color, key, label)
    }
    fn stats(&self) -> flashover_comm::CommStats {
        self.data.stats()
    }
    fn sends_are_buffered(&self) -> bool {
        false
    }
}

#[test]
fn with_sends_that_wait_for_their_receives_every_schedule_runs_exactly() {
    // Each rank's consecutive transfers go as one batch; 1F1B's steady state (a stage sends its
    // activation while the next sends a gradient back) deadlocks without that. Interleaved
    // 1F1B with more micro-batches than stages also needs Megatron's placement of the steady
    // state's transfers, which the executor takes when the schedule as built would deadlock.
    let mut placed_again = 0;
    for p in [2, 3, 4] {
        let mut runs = vec![];
        for m in [1, p, 2 * p + 1] {
            for (kind, defer) in [
                (ScheduleKind::GPipe, false),
                (ScheduleKind::OneFOneB, false),
                (ScheduleKind::ZeroBubbleH1, true),
            ] {
                runs.push((kind, m, 1, defer));
            }
        }
        // Two chunks per rank: the stack's 8 layers fill at most 8 virtual stages.
        for (m, v) in [(p, 2), (2 * p, 2), (3 * p, 2)] {
            runs.push((ScheduleKind::Interleaved1F1B, m, v, false));
        }
        for (kind, m, v, defer) in runs {
            let what = format!("{kind:?} p={p} m={m} v={v}, rendezvous sends");
            let schedule = Schedule::build(kind, p, m, v).unwrap();
            if super::unbuffered_deadlock(&schedule).is_some() {
                assert_eq!(kind, ScheduleKind::Interleaved1F1B, "{what} as built");
                placed_again += 1;
            }
            let got = pipelined_on(&format!("pp={p}"), kind, m, v, defer, true).unwrap();
            assert_close(&got, &reference_accumulated(m), 1e-6, &what);
        }
    }
    assert!(placed_again > 0, "no schedule needed Megatron's placement");
}

/// One step of `kind` with `m` micro-batches on a 3-stage split (one chunk per rank) of the
/// stack, run on this rank of `ctx`'s pipeline group.
fn three_stage_step(
    ctx: &flashover_runtime::RankContext,
    kind: ScheduleKind,
    m: usize,
) -> Result<crate::pipeline::PipelineStepReport, ParallelError> {
    let device = Device::flex().autodiff();
    let pp = ctx.group(Axis::Pp);
    let schedule = Schedule::build(kind, 3, m, 1).map_err(ParallelError::Invalid)?;
    let chunks = vec![Stack::new(stage_layers(pp.rank(), 3), &device)];
    let (_, _, report) = PipelineExecutor::new(&schedule, pp)?.step_flat(
        &chunks,
        &boundary(),
        &device,
        |_, module: &Stack, input, micro| {
            let x = (input.map(from_boundary_tensors))
                .unwrap_or_else(|| rows(micro * ROWS_PER_MICRO, ROWS_PER_MICRO, &device));
            let y = module.forward(x, None);
            if pp.rank() == 2 {
                StageOutput::Loss(loss(y))
            } else {
                StageOutput::Activation(boundary_tensors(y))
            }
        },
    )?;
    Ok(report)
}

#[test]
fn one_f_one_b_holds_at_most_p_minus_r_micro_batches_where_gpipe_holds_all() {
    for (kind, m) in [(ScheduleKind::GPipe, 6), (ScheduleKind::OneFOneB, 6)] {
        let peaks = launch("pp=3", |ctx| {
            three_stage_step(&ctx, kind, m).map(|report| report.peak_in_flight)
        })
        .unwrap();
        let expected: Vec<usize> = match kind {
            ScheduleKind::GPipe => vec![m; 3],
            _ => (0..3).map(|r| 3 - r).collect(),
        };
        assert_eq!(peaks, expected, "{kind:?}");
    }
}

#[test]
fn a_stage_dying_mid_schedule_fails_its_neighbours_fast_naming_it() {
    use flashover_runtime::{FaultPlan, Launch, LaunchError, OpKind};
    let start = std::time::Instant::now();
    let err = Launch::new("pp=3")
        .unwrap()
        .timeout(std::time::Duration::from_secs(30))
        .faults(FaultPlan::new().panic_at(1, OpKind::Recv, 3))
        .run(|ctx| three_stage_step(&ctx, ScheduleKind::OneFOneB, 4).map(|_| ()))
        .unwrap_err();
    assert!(
        start.elapsed() < std::time::Duration::from_secs(20),
        "must not wait for the timeout"
    );
    // Rank 1 failed with the fault; its neighbours failed fast, naming it.
    let LaunchError::Rank { cause, all } = &err else {
        panic!("{err}")
    };
    assert!(
        cause.rank == 1 && cause.message.contains("injected fault"),
        "{err}"
    );
    assert_eq!(all.len(), 3, "{err}");
    let first = err.failure_of(0).unwrap();
    assert!(first.message.contains("rank 1 left the group"), "{err}");
}

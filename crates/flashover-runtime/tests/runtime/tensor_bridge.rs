//! Collectives on Burn tensors (Flex), against values computed by hand.

use burn::tensor::{DType, Tensor};
use flashover_runtime::{CommError, RankContext, ReduceOp, TensorCollectives, launch};

fn values<const D: usize>(t: Tensor<D>) -> Vec<f32> {
    t.into_data().try_to_vec::<f32>().unwrap()
}

/// `t` (a `[2, 2]` f32 tensor) sent by world rank 0 and received by rank 1: its values there.
fn rank_0_to_rank_1(ctx: &RankContext, t: &Tensor<2>) -> Result<Option<Vec<f32>>, CommError> {
    let w = ctx.world();
    if ctx.rank() == 0 {
        w.send_tensor(t, 1)?;
        return Ok(None);
    }
    let got = w.recv_tensor::<2>([2, 2], DType::F32, 0, ctx.device())?;
    Ok(Some(values(got)))
}

#[test]
fn tensor_collectives_match_hand_computed_values() {
    let got = launch(2, |ctx| {
        let dev = ctx.device().clone();
        let r = ctx.rank() as f32;
        let w = ctx.world();
        // [[r, r+1], [r+2, r+3]]
        let x = Tensor::<2>::from_floats([[r, r + 1.0], [r + 2.0, r + 3.0]], &dev);
        let sum = w.all_reduce_tensor(x.clone(), ReduceOp::Sum)?;
        let gathered0 = w.all_gather_tensor(x.clone(), 0)?;
        let gathered1 = w.all_gather_tensor(x.clone(), 1)?;
        let scattered = w.reduce_scatter_tensor(x.clone(), 1, ReduceOp::Sum)?;
        let bcast = w.broadcast_tensor(x.clone(), 1)?;
        let passed = rank_0_to_rank_1(&ctx, &x)?;
        Ok::<_, CommError>((
            values(sum),
            (gathered0.dims(), values(gathered0)),
            (gathered1.dims(), values(gathered1)),
            (scattered.dims(), values(scattered)),
            values(bcast),
            passed,
        ))
    })
    .unwrap();
    for (rank, (sum, g0, g1, rs, b, p)) in got.into_iter().enumerate() {
        assert_eq!(sum, vec![1.0, 3.0, 5.0, 7.0]);
        assert_eq!(g0, ([4, 2], vec![0.0, 1.0, 2.0, 3.0, 1.0, 2.0, 3.0, 4.0]));
        assert_eq!(g1, ([2, 4], vec![0.0, 1.0, 1.0, 2.0, 2.0, 3.0, 3.0, 4.0]));
        // Column `rank` of the sum.
        let col = if rank == 0 {
            vec![1.0, 5.0]
        } else {
            vec![3.0, 7.0]
        };
        assert_eq!(rs, ([2, 1], col));
        assert_eq!(b, vec![1.0, 2.0, 3.0, 4.0]);
        if rank == 1 {
            assert_eq!(p, Some(vec![0.0, 1.0, 2.0, 3.0]));
        }
    }
}

/// Engines that only read a tensor read a Flex tensor where it lies: a view into a larger
/// buffer (rows 1..3 of 4, at an offset) and a transposed (not contiguous) tensor must give
/// the same values as a fresh tensor, and the tensors they were read from stay as they were.
#[test]
fn collectives_that_read_views_and_transposes_see_their_values() {
    let got = launch(2, |ctx| {
        let dev = ctx.device().clone();
        let w = ctx.world();
        let r = ctx.rank() as f32 * 10.0;
        // [[r, r+1], [r+2, r+3], [r+4, r+5], [r+6, r+7]]
        let whole =
            Tensor::<2>::from_floats([[0.0, 1.0], [2.0, 3.0], [4.0, 5.0], [6.0, 7.0]], &dev) + r;
        let view = whole.clone().narrow(0, 1, 2); // rows 1 and 2
        let transposed = whole.clone().narrow(0, 0, 2).transpose(); // [[r, r+2], [r+1, r+3]]
        let gathered = w.all_gather_tensor(view.clone(), 0)?;
        let gathered_t = w.all_gather_tensor(transposed.clone(), 0)?;
        let scattered = w.reduce_scatter_tensor(view.clone(), 0, ReduceOp::Sum)?;
        let moved = w.all_to_all_tensor(view.clone(), &[1, 1], &[1, 1])?;
        let passed = rank_0_to_rank_1(&ctx, &view)?;
        Ok::<_, CommError>((
            values(gathered),
            values(gathered_t),
            (scattered.dims(), values(scattered)),
            values(moved),
            passed,
            values(whole),
        ))
    })
    .unwrap();
    for (rank, (gathered, gathered_t, scattered, moved, passed, whole)) in
        got.into_iter().enumerate()
    {
        assert_eq!(gathered, [2.0, 3.0, 4.0, 5.0, 12.0, 13.0, 14.0, 15.0]);
        assert_eq!(gathered_t, [0.0, 2.0, 1.0, 3.0, 10.0, 12.0, 11.0, 13.0]);
        // Row `rank` of the sum of the views.
        let row = [14.0 + 4.0 * rank as f32, 16.0 + 4.0 * rank as f32];
        assert_eq!(scattered, ([1, 2], row.to_vec()));
        // Row `rank` of each rank's view, in rank order.
        let r = 2.0 * rank as f32;
        assert_eq!(moved, [2.0 + r, 3.0 + r, 12.0 + r, 13.0 + r]);
        if rank == 1 {
            assert_eq!(passed, Some(vec![2.0, 3.0, 4.0, 5.0]));
        }
        let base = 10.0 * rank as f32;
        assert_eq!(whole, (0..8).map(|i| i as f32 + base).collect::<Vec<_>>());
    }
}

#[test]
fn reduce_scatter_of_an_indivisible_dim_is_refused() {
    let err = launch(2, |ctx| {
        let x = Tensor::<1>::from_floats([1.0, 2.0, 3.0], ctx.device());
        ctx.world()
            .reduce_scatter_tensor(x, 0, ReduceOp::Sum)
            .map(|_| ())
    })
    .unwrap_err();
    assert!(
        err.to_string()
            .contains("does not divide by the group size 2"),
        "{err}"
    );
}

#[test]
fn all_to_all_moves_uneven_blocks_of_rows_and_keeps_bf16() {
    // Rank 0 sends its row 0 to itself and rows 1..3 to rank 1; rank 1 sends its row 0 to
    // rank 0 and keeps none. Rows are pairs, so a row is everything after dim 0.
    let got = launch(2, |ctx| {
        let r = ctx.rank() as f32 * 10.0;
        let x = Tensor::<2>::from_floats(
            [[r, r + 1.0], [r + 2.0, r + 3.0], [r + 4.0, r + 5.0]],
            ctx.device(),
        );
        let (send, recv) = if ctx.rank() == 0 {
            ([1, 2], [1, 3])
        } else {
            ([3, 0], [2, 0])
        };
        let moved = ctx.world().all_to_all_tensor(x.clone(), &send, &recv)?;
        let half = ctx
            .world()
            .all_to_all_tensor(x.cast(DType::BF16), &send, &recv)?;
        Ok::<_, CommError>((moved.dims(), values(moved), half.dtype()))
    })
    .unwrap();
    assert_eq!(got[0].0, [4, 2]);
    assert_eq!(got[0].1, [0.0, 1.0, 10.0, 11.0, 12.0, 13.0, 14.0, 15.0]);
    assert_eq!(got[1].0, [2, 2]);
    assert_eq!(got[1].1, [2.0, 3.0, 4.0, 5.0]);
    assert_eq!(got[0].2, DType::BF16);
}

#[test]
fn a_stream_runs_collectives_in_submission_order_while_the_caller_goes_on() {
    use flashover_runtime::{CommStream, TensorCollectives};
    let got = launch(2, |ctx| {
        let stream = CommStream::new(ctx.world(), "test-stream");
        let r = ctx.rank() as f32;
        let x = Tensor::<1>::from_floats([r, r + 1.0], ctx.device());
        // Two collectives in flight at once, answered in order.
        let y = x.clone();
        let gathered = stream.submit(move |g| g.all_gather_tensor(y, 0));
        let summed = stream.submit(move |g| g.all_reduce_tensor(x, ReduceOp::Sum));
        let (summed, gathered) = (summed.wait()?, gathered.wait()?);
        // A panic carrying a collective's error comes back as that error.
        let failed = stream
            .submit(|g| -> Result<(), CommError> {
                std::panic::panic_any(CommError::Engine {
                    engine: "test",
                    detail: format!("injected on {}", g.name()),
                })
            })
            .wait();
        Ok::<_, CommError>((values(gathered), values(summed), failed.unwrap_err()))
    })
    .unwrap();
    for (gathered, summed, failed) in got {
        assert_eq!(gathered, [0.0, 1.0, 1.0, 2.0]);
        assert_eq!(summed, [1.0, 3.0]);
        assert!(failed.to_string().contains("injected on"), "{failed}");
    }
}

/// A tensor another value still holds, whole or a view into a larger buffer, is reduced from a
/// copy of its own values: the result is the sum, and the holders keep their values.
#[test]
fn shared_tensors_and_views_are_reduced_without_touching_their_holders() {
    let got = launch(2, |ctx| {
        let r = ctx.rank() as f32;
        let w = ctx.world();
        let whole = Tensor::<1>::from_floats([r, r + 1.0, r + 2.0, r + 3.0], ctx.device());
        // A view of the last two elements (its buffer starts before it).
        let view = whole.clone().narrow(0, 2, 2);
        let sum = w.all_reduce_tensor(whole.clone(), ReduceOp::Sum)?;
        let view_sum = w.all_reduce_tensor(view.clone(), ReduceOp::Sum)?;
        let from_1 = w.broadcast_tensor(view.clone(), 1)?;
        Ok::<_, CommError>((
            values(sum),
            values(view_sum),
            values(from_1),
            values(whole),
            values(view),
        ))
    })
    .unwrap();
    for (rank, (sum, view_sum, from_1, whole, view)) in got.into_iter().enumerate() {
        let r = rank as f32;
        assert_eq!(sum, vec![1.0, 3.0, 5.0, 7.0]);
        assert_eq!(view_sum, vec![5.0, 7.0]);
        assert_eq!(from_1, vec![3.0, 4.0]);
        assert_eq!(
            whole,
            vec![r, r + 1.0, r + 2.0, r + 3.0],
            "rank {rank}'s tensor"
        );
        assert_eq!(view, vec![r + 2.0, r + 3.0], "rank {rank}'s view");
    }
}

#[test]
fn traffic_is_counted_per_axis_and_split_into_exposed_and_overlapped() {
    use flashover_runtime::{Axis, CommStream};
    use std::time::Duration;
    let got = launch("dp=2,tp=2", |ctx| {
        let x = Tensor::<1>::from_floats([1.0, 2.0], ctx.device());
        // On the training thread: all of it exposed.
        let tp = ctx.group(Axis::Tp);
        tp.all_reduce_tensor(x.clone(), ReduceOp::Sum)?;
        // On a stream, waited for only after the caller slept: mostly overlapped (the barrier
        // lines the ranks up, so no peer arrives late at it).
        let stream = CommStream::new(ctx.group(Axis::Dp), "test-stream");
        ctx.world().barrier()?;
        let work = stream.submit(move |g| g.all_reduce_tensor(x, ReduceOp::Sum));
        std::thread::sleep(Duration::from_millis(50));
        work.wait()?;
        Ok::<_, CommError>(ctx.traffic_by_axis())
    })
    .unwrap();
    for traffic in got {
        let axis = |label: &str| traffic.iter().find(|t| t.label == label).cloned().unwrap();
        let (tp, dp) = (axis("tp"), axis("dp"));
        assert_eq!((tp.calls, tp.bytes), (1, 8));
        assert_eq!(tp.background, Duration::ZERO);
        assert_eq!(tp.exposed(), tp.time);
        assert_eq!(dp.calls, 1);
        assert_eq!(dp.background, dp.time, "the stream's call is background");
        assert!(dp.waited < Duration::from_millis(50), "{dp:?}");
        // How a wait splits into exposed and overlapped is flashover_comm::traffic's unit
        // test; a wait may exceed the collective's own time by the stream's staging (it did
        // by microseconds under load), so exposed is not asserted equal to it here.
    }
}

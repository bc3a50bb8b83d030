//! The schedule simulator's tests: bubbles, deadlocks and validation of every schedule.

use super::*;
use crate::pipeline::ScheduleKind;

fn bubble(kind: ScheduleKind, p: usize, m: usize, v: usize) -> (Timeline, Vec<f64>) {
    let s = Schedule::build(kind, p, m, v).unwrap();
    let t = simulate(&s, &Costs::default()).unwrap();
    let b = t.bubbles();
    (t, b)
}

#[test]
fn every_built_in_schedule_is_valid() {
    for p in 1..=4 {
        for m in [1, p, 2 * p + 1] {
            for kind in [
                ScheduleKind::GPipe,
                ScheduleKind::OneFOneB,
                ScheduleKind::ZeroBubbleH1,
            ] {
                let s = Schedule::build(kind, p, m, 1).unwrap();
                validate(&s).unwrap_or_else(|e| panic!("{kind:?} p={p} m={m}: {e}"));
            }
            let s = Schedule::build(ScheduleKind::Interleaved1F1B, p, 2 * p, 2).unwrap();
            validate(&s).unwrap_or_else(|e| panic!("interleaved p={p}: {e}"));
        }
    }
}

#[test]
fn gpipe_and_1f1b_bubbles_are_the_formula_and_1f1b_holds_at_most_p_micro_batches() {
    for p in [2, 4] {
        for m in [1, 4, 8] {
            let formula = (p - 1) as f64 / (m + p - 1) as f64;
            let (gpipe, g) = bubble(ScheduleKind::GPipe, p, m, 1);
            let (one, o) = bubble(ScheduleKind::OneFOneB, p, m, 1);
            for r in 0..p {
                assert!(
                    (g[r] - formula).abs() < 1e-12,
                    "GPipe p={p} m={m} rank {r}: {}",
                    g[r]
                );
                assert!(
                    (o[r] - formula).abs() < 1e-12,
                    "1F1B p={p} m={m} rank {r}: {}",
                    o[r]
                );
                assert_eq!(gpipe.peak_in_flight[r], m);
                assert_eq!(one.peak_in_flight[r], (p - r).min(m));
            }
        }
    }
}

#[test]
fn interleaving_divides_the_bubble_by_the_chunks() {
    for (p, m, v) in [(2, 4, 2), (4, 8, 2), (4, 8, 4)] {
        let (t, _) = bubble(ScheduleKind::Interleaved1F1B, p, m, v);
        for slots in &t.ranks {
            let busy: f64 = slots.iter().map(|s| s.end - s.start).sum();
            let ratio = (t.makespan - busy) / busy;
            let formula = (p - 1) as f64 / (v * m) as f64;
            assert!(
                (ratio - formula).abs() < 1e-9,
                "p={p} m={m} v={v}: {ratio} vs {formula}"
            );
        }
    }
}

#[test]
fn zero_bubble_h1_beats_1f1b_with_the_same_activation_memory() {
    for (p, m) in [(2, 4), (4, 8), (4, 16)] {
        let (one, o) = bubble(ScheduleKind::OneFOneB, p, m, 1);
        let (zb, z) = bubble(ScheduleKind::ZeroBubbleH1, p, m, 1);
        assert!(
            zb.makespan < one.makespan,
            "p={p} m={m}: {} vs {}",
            zb.makespan,
            one.makespan
        );
        let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len() as f64;
        assert!(mean(&z) < mean(&o));
        for r in 0..p {
            assert!(
                zb.peak_in_flight[r] <= p - r,
                "rank {r}: {}",
                zb.peak_in_flight[r]
            );
        }
    }
}

fn one_f_one_b(p: usize, m: usize) -> Schedule {
    Schedule::build(ScheduleKind::OneFOneB, p, m, 1).unwrap()
}

#[test]
fn invalid_schedules_are_refused_before_running_with_the_reason() {
    // A backward moved before its forward.
    let mut s = one_f_one_b(2, 2);
    let last = s.ranks[1].clone();
    let b = last
        .iter()
        .position(|a| a.kind == ActionKind::Backward)
        .unwrap();
    let f = last
        .iter()
        .position(|a| a.kind == ActionKind::Forward)
        .unwrap();
    s.ranks[1].swap(b, f);
    let e = validate(&s).unwrap_err().to_string();
    assert!(e.contains("backward before its forward"), "{e}");
    // A send whose receive was dropped.
    let mut s = one_f_one_b(2, 2);
    let recv = s.ranks[1]
        .iter()
        .rposition(|a| a.kind == ActionKind::RecvActivation)
        .unwrap();
    s.ranks[1].remove(recv);
    let e = validate(&s).unwrap_err().to_string();
    assert!(
        e.contains("before its input activation was received"),
        "{e}"
    );
    // Receives in another order than the sends.
    let mut s = one_f_one_b(2, 3);
    let recvs: Vec<usize> = s.ranks[1]
        .iter()
        .enumerate()
        .filter(|(_, a)| a.kind == ActionKind::RecvActivation)
        .map(|(i, _)| i)
        .collect();
    let (a, b) = (s.ranks[1][recvs[0]], s.ranks[1][recvs[1]]);
    s.ranks[1][recvs[0]] = b;
    s.ranks[1][recvs[1]] = a;
    let e = validate(&s).unwrap_err().to_string();
    assert!(e.contains("but the next message from rank 0"), "{e}");
    // Every rank waiting for the other: rank 0 receives a gradient before sending anything.
    let mut s = one_f_one_b(2, 1);
    s.ranks[0].retain(|a| a.kind != ActionKind::SendActivation);
    let e = validate(&s).unwrap_err().to_string();
    assert!(e.contains("deadlock"), "{e}");
    // A micro-batch left without its backward.
    let mut s = one_f_one_b(1, 2);
    s.ranks[0].pop();
    let e = validate(&s).unwrap_err().to_string();
    assert!(e.contains("never finishes its backward"), "{e}");
}

#[test]
fn the_table_shows_the_fill_and_drain() {
    let s = one_f_one_b(2, 2);
    let t = simulate(&s, &Costs::default()).unwrap();
    let table = render_table(&t, 1.0);
    let rows: Vec<&str> = table.lines().collect();
    // (m + p - 1) x (forward + backward) = 3 x 3 time units.
    assert_eq!(rows.len(), 1 + 9, "{table}");
    assert!(rows[1].ends_with("F0      -"), "{table}");
}

#[test]
fn sends_that_wait_for_their_receives_deadlock_where_buffered_ones_do_not() {
    use ActionKind::*;
    let act = |kind, micro| Action::new(kind, micro, 0);
    // Each rank sends, computes, then receives what the other sent: buffered sends pass,
    // sends that wait for their receives each wait on a receive the other has not reached.
    let cycle = Schedule {
        pp: 2,
        chunks: 1,
        micro_batches: 1,
        ranks: vec![
            vec![
                act(Forward, 0),
                act(SendActivation, 0),
                act(Forward, 1),
                act(RecvGrad, 0),
            ],
            vec![
                act(Backward, 0),
                act(SendGrad, 0),
                act(Forward, 1),
                act(RecvActivation, 0),
            ],
        ],
    };
    assert_eq!(
        unbuffered_deadlock(&cycle).as_deref(),
        Some("rank 0 at [sa0], rank 1 at [sg0]")
    );
    // Both ends of each transfer in one batch on each side: no wait.
    let batched = Schedule {
        ranks: vec![
            vec![act(Forward, 0), act(SendActivation, 0), act(RecvGrad, 0)],
            vec![act(Backward, 0), act(SendGrad, 0), act(RecvActivation, 0)],
        ],
        ..cycle
    };
    assert_eq!(unbuffered_deadlock(&batched), None);
    // Interleaved 1F1B with more micro-batches than stages: as built it stops; with
    // Megatron's steady-state placement it runs, and stays valid.
    let built = Schedule::build(ScheduleKind::Interleaved1F1B, 2, 4, 2).unwrap();
    assert!(unbuffered_deadlock(&built).is_some());
    let paired = built.with_steady_pairs();
    assert!(validate(&paired).is_ok());
    assert_eq!(unbuffered_deadlock(&paired), None);
}

//! Helpers shared by the collective tests.
#![allow(dead_code)]

use flashover_comm::{ThreadComm, ThreadWorld};

/// Runs `f` on every rank of `world`, one thread each; returns results in rank order.
pub fn run<T: Send>(world: ThreadWorld, f: impl Fn(ThreadComm) -> T + Sync) -> Vec<T> {
    let comms = world.build();
    std::thread::scope(|s| {
        let f = &f;
        let handles: Vec<_> = comms.into_iter().map(|c| s.spawn(move || f(c))).collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("rank panicked"))
            .collect()
    })
}

/// Deterministic pseudo-random floats in [-1, 1) (splitmix64), different per `seed`.
pub fn floats(seed: u64, n: usize) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ 0xD1B5_4A32_D192_ED03;
    (0..n)
        .map(|_| {
            s = s.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = s;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^= z >> 31;
            ((z >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect()
}

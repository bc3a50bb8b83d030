//! Data parallel training on the wgpu device (Mesa lavapipe in CI) against the same layout on
//! Flex: loss every step within 1e-4 relative in f32. On wgpu the gradient hooks are not
//! available, so this also covers the post-backward reduction path.
#![cfg(feature = "wgpu")]

use flashover::DeviceChoice;
use flashover::train::{TrainConfig, compare, train};

#[test]
fn ddp_on_wgpu_matches_ddp_on_flex() {
    let mut c = TrainConfig::default();
    c.model.preset = "tiny".into();
    c.model.d_model = Some(32);
    c.model.n_layers = Some(1);
    c.model.d_ff = Some(64);
    c.data.vocab = 16;
    c.data.seq_len = 8;
    c.run.steps = 3;
    c.run.global_batch = 4;
    c.parallel.mesh = "dp=2".into();
    c.parallel.timeout_s = 120.0;
    let flex = train(&c, &|_| {}).unwrap();
    c.run.device = DeviceChoice::Wgpu;
    let wgpu = train(&c, &|_| {}).unwrap();
    assert!(
        !wgpu.overlap,
        "hooks are Flex-only; wgpu reduces after backward"
    );
    let cmp = compare(&flex, &wgpu, 1e-4);
    assert!(cmp.max_rel_loss_diff <= 1e-4, "{cmp}");
    assert!(cmp.max_rel_param_diff <= 1e-4, "{cmp}");
}

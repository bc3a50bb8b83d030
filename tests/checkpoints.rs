//! Training checkpoints through the training job: resuming is bitwise on the same mesh for
//! every strategy; resuming on another mesh continues as an uninterrupted run on that mesh
//! would (fp32, 1e-5 relative); failed, corrupt and foreign checkpoints are refused by name;
//! the exported model is the trained one, ordinary Burn code (burn-store) loads it, and a new
//! run on another layout starts from it.

use burn_store::ModuleSnapshot;
use flashover::train::checkpoint::{export, reshard};
use flashover::train::{TrainConfig, TrainReport, compare, train};
use flashover_checkpoint::Checkpoint;
use flashover_parallel::params::{ParamLayout, flatten_params};
use std::path::{Path, PathBuf};

#[path = "checkpoints/elastic.rs"]
mod elastic;
#[path = "checkpoints/plan.rs"]
mod plan;
#[path = "checkpoints/plan_experts.rs"]
mod plan_experts;

const TOLERANCE: f64 = 1e-5;
const STEPS: usize = 8;
const HALF: usize = 4;

/// A scratch directory removed on drop.
struct Scratch(PathBuf);

impl Scratch {
    fn new(tag: &str) -> Self {
        let p = std::env::temp_dir().join(format!("flashover-ckpt-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&p);
        Scratch(p)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A small job: 4 blocks (so pp=4 works), 8 steps, warmup and active clipping.
fn job(mesh: &str, zero: u8, micro_batches: usize) -> TrainConfig {
    let mut c = TrainConfig::default();
    c.model.preset = "tiny".into();
    c.model.d_model = Some(32);
    c.model.n_layers = Some(4);
    c.model.n_heads = Some(4);
    c.model.d_ff = Some(64);
    c.model.tie_embeddings = false;
    c.data.vocab = 30;
    c.data.seq_len = 16;
    c.parallel.mesh = mesh.into();
    c.parallel.zero = zero;
    c.parallel.bucket_mb = 0.01;
    c.parallel.timeout_s = 60.0;
    c.run.steps = STEPS;
    c.run.global_batch = 12;
    c.run.micro_batches = micro_batches;
    c.optim.clip = Some(0.5);
    c.optim.warmup_steps = 2;
    c
}

fn run(c: &TrainConfig) -> TrainReport {
    train(c, &|_| {}).unwrap_or_else(|e| panic!("{}: {e}", c.parallel.mesh))
}

/// Trains `first` for HALF steps saving into `dir`, then resumes with `second` to the end.
fn interrupted(first: &TrainConfig, second: &TrainConfig, dir: &Path) -> TrainReport {
    let mut a = first.clone();
    a.run.exit_after = Some(HALF);
    a.checkpoint.dir = Some(dir.to_path_buf());
    a.checkpoint.save_every = 100; // only the save at exit
    run(&a);
    let mut b = second.clone();
    b.checkpoint.resume = Some(dir.to_path_buf());
    run(&b)
}

/// The last STEPS - HALF steps of an uninterrupted run.
fn second_half(mut straight: TrainReport) -> TrainReport {
    straight.steps.drain(..HALF);
    straight
}

fn losses(r: &TrainReport) -> Vec<f64> {
    r.steps.iter().map(|s| s.loss).collect()
}

#[test]
fn resuming_on_the_same_mesh_is_bitwise_for_every_strategy() {
    for (mesh, zero, micro, async_save) in [
        ("dp=2", 0, 2, false),
        ("dp=2", 2, 1, true),
        ("dp=2,fsdp=2", 3, 1, false),
        ("dp=2,tp=2", 0, 1, true),
        ("tp=2,pp=2", 0, 2, false),
    ] {
        let s = Scratch::new(&format!("resume-{}-{zero}", mesh.replace([',', '='], "")));
        let mut c = job(mesh, zero, micro);
        c.checkpoint.async_save = async_save;
        let straight = second_half(run(&c));
        let resumed = interrupted(&c, &c, &s.0);
        assert_eq!(resumed.steps.len(), STEPS - HALF, "{mesh}");
        assert_eq!(
            losses(&resumed),
            losses(&straight),
            "{mesh} zero {zero}: losses"
        );
        assert_eq!(
            resumed.params, straight.params,
            "{mesh} zero {zero}: parameters"
        );
    }
}

#[test]
fn a_mixture_of_experts_resumes_bitwise_and_on_other_expert_layouts() {
    let moe = |mesh: &str| {
        let mut c = job(mesh, 0, 1);
        c.moe.experts = 4;
        c.moe.d_expert = Some(24);
        c.moe.capacity_factor = Some(1.0);
        // The routing biases are state outside the parameters: resuming must restore them.
        c.moe.bias_update_rate = 0.05;
        c
    };
    let s = Scratch::new("moe-resume");
    let c = moe("ep=2");
    let straight = second_half(run(&c));
    let resumed = interrupted(&c, &c, &s.0);
    assert_eq!(losses(&resumed), losses(&straight), "ep=2: losses");
    assert_eq!(resumed.params, straight.params, "ep=2: parameters");
    // Sharded experts (each rank its rows of every parameter) resume bitwise too.
    let s = Scratch::new("moe-zero3-resume");
    let mut c = moe("fsdp=2,ep=2");
    c.parallel.zero = 3;
    let straight = second_half(run(&c));
    let resumed = interrupted(&c, &c, &s.0);
    assert_eq!(
        losses(&resumed),
        losses(&straight),
        "fsdp=2,ep=2 zero 3: losses"
    );
    assert_eq!(
        resumed.params, straight.params,
        "fsdp=2,ep=2 zero 3: parameters"
    );
    // Experts in pipeline stages: every rank keeps every layer's routing bias.
    let s = Scratch::new("moe-pp-resume");
    let mut c = moe("fsdp=2,ep=2,pp=2");
    c.parallel.zero = 3;
    c.run.micro_batches = 2;
    c.run.global_batch = 8;
    let straight = second_half(run(&c));
    let resumed = interrupted(&c, &c, &s.0);
    assert_eq!(losses(&resumed), losses(&straight), "MoE pp: losses");
    assert_eq!(resumed.params, straight.params, "MoE pp: parameters");
    // Experts are saved by global index: any ep (and tp, and pp) layout reads them.
    for (from, to) in [
        ("dp=2,ep=2", "ep=4"),
        ("ep=2,tp=2", "dp=1"),
        ("ep=2,pp=2", "dp=2,ep=2"),
    ] {
        let s = Scratch::new(&format!("moe-reshard-{}", from.replace([',', '='], "")));
        let straight = second_half(run(&moe(to)));
        let resumed = interrupted(&moe(from), &moe(to), &s.0);
        let cmp = compare(&straight, &resumed, TOLERANCE);
        assert!(cmp.pass, "{from} -> {to}: {cmp}");
    }
}

#[test]
fn a_context_parallel_run_resumes_bitwise_and_on_layouts_without_cp() {
    // Context-parallel ranks hold whole replicas: they share the writing as dp replicas do.
    for mesh in ["dp=2,cp=2", "tp=2,cp=2"] {
        let s = Scratch::new(&format!("cp-resume-{}", mesh.replace([',', '='], "")));
        let c = job(mesh, 0, 1);
        let straight = second_half(run(&c));
        let resumed = interrupted(&c, &c, &s.0);
        assert_eq!(losses(&resumed), losses(&straight), "{mesh}: losses");
        assert_eq!(resumed.params, straight.params, "{mesh}: parameters");
    }
    for (from, to) in [("cp=2", "dp=2"), ("dp=2", "tp=2,cp=2")] {
        let s = Scratch::new(&format!("cp-reshard-{}", from.replace([',', '='], "")));
        let straight = second_half(run(&job(to, 0, 1)));
        let resumed = interrupted(&job(from, 0, 1), &job(to, 0, 1), &s.0);
        let cmp = compare(&straight, &resumed, TOLERANCE);
        assert!(cmp.pass, "{from} -> {to}: {cmp}");
    }
}

#[test]
fn a_checkpoint_loads_on_another_mesh_and_training_continues_as_there() {
    // The pairs users of other frameworks report as impossible, and ZeRO-3 to plain DDP.
    for (from, to) in [
        (("fsdp=4", 3, 1), ("fsdp=2", 3, 1)),
        (("dp=2,fsdp=2", 3, 1), ("fsdp=3", 3, 1)),
        (("tp=2", 0, 1), ("tp=1", 0, 1)),
        (("pp=2", 0, 4), ("pp=4", 0, 4)),
        (("fsdp=2", 3, 1), ("dp=2", 0, 1)),
        (("dp=3", 1, 1), ("dp=2,tp=2", 0, 1)),
    ] {
        let s = Scratch::new(&format!("reshard-{}", from.0.replace([',', '='], "")));
        let (a, b) = (job(from.0, from.1, from.2), job(to.0, to.1, to.2));
        let straight = second_half(run(&b));
        let resumed = interrupted(&a, &b, &s.0);
        let cmp = compare(&straight, &resumed, TOLERANCE);
        assert!(cmp.pass, "{} -> {}: {cmp}", from.0, to.0);
    }
}

#[test]
fn offline_resharding_writes_a_checkpoint_of_the_new_layout() {
    let s = Scratch::new("offline");
    let (src, out) = (s.0.join("src"), s.0.join("out"));
    let mut a = job("fsdp=4", 3, 1);
    a.run.exit_after = Some(HALF);
    a.checkpoint.dir = Some(src.clone());
    a.checkpoint.save_every = 100;
    run(&a);
    // ZeRO-3 over 4 ranks -> tensor parallel over 2: every file now holds tp shares.
    let dir = reshard(&src, "tp=2", Some(0), &out).unwrap();
    let before = Checkpoint::open(&src).unwrap();
    let after = Checkpoint::open(&dir).unwrap();
    assert_eq!(after.step(), HALF as u64);
    assert_eq!(after.index().files.len(), 2);
    assert_eq!(after.index().run["mesh"], "tp=2");
    for name in before.index().tensors.keys() {
        assert_eq!(
            before.read_whole(name).unwrap(),
            after.read_whole(name).unwrap(),
            "{name} changed"
        );
    }
    // And the resharded checkpoint resumes like the original.
    let b = job("tp=2", 0, 1);
    let mut from_src = b.clone();
    from_src.checkpoint.resume = Some(src);
    let mut from_out = b;
    from_out.checkpoint.resume = Some(out);
    assert_eq!(run(&from_src).params, run(&from_out).params);
}

#[test]
fn failed_corrupt_and_foreign_checkpoints_are_refused_by_name() {
    let s = Scratch::new("faults");
    let mut c = job("dp=2", 2, 1);
    c.checkpoint.dir = Some(s.0.clone());
    c.checkpoint.save_every = HALF;
    // Rank 1 fails right after writing its shard of the second checkpoint: nothing of it is
    // committed and the first stays loadable.
    c.checkpoint.fail_after_write = Some((1, STEPS));
    let err = train(&c, &|_| {}).unwrap_err();
    assert!(
        err.contains("checkpoint of step 8 not committed") && err.contains("[1]"),
        "{err}"
    );
    assert_eq!(Checkpoint::open(&s.0).unwrap().step(), HALF as u64);
    assert!(s.0.join(".step-00000008.partial").exists());
    let mut resume = job("dp=2", 2, 1);
    resume.checkpoint.resume = Some(s.0.clone());
    assert_eq!(run(&resume).steps.len(), STEPS - HALF);

    // A checkpoint of another model: the first mismatching tensor is named.
    let mut other = job("dp=2", 0, 1);
    other.model.d_model = Some(16);
    other.checkpoint.resume = Some(s.0.clone());
    let err = train(&other, &|_| {}).unwrap_err();
    assert!(err.contains("has shape") && err.contains("weight"), "{err}");

    // A flipped byte in a shard: the file is named.
    let dir = s.0.join("step-00000004");
    let shard = dir.join("rank-00000.safetensors");
    let mut bytes = std::fs::read(&shard).unwrap();
    let at = bytes.len() - 5;
    bytes[at] ^= 0x10;
    std::fs::write(&shard, &bytes).unwrap();
    let err = train(&resume, &|_| {}).unwrap_err();
    assert!(
        err.contains("rank-00000.safetensors") && err.contains("checksum"),
        "{err}"
    );
    // Truncated: named too.
    std::fs::write(&shard, &bytes[..bytes.len() / 2]).unwrap();
    let err = train(&resume, &|_| {}).unwrap_err();
    assert!(
        err.contains("rank-00000.safetensors") && err.contains("truncated"),
        "{err}"
    );
}

#[test]
fn the_exported_model_is_the_trained_one_in_a_standard_safetensors_file() {
    let s = Scratch::new("export");
    let mut c = job("dp=2,tp=2", 0, 1);
    c.checkpoint.dir = Some(s.0.clone());
    c.checkpoint.save_every = STEPS;
    let report = run(&c);
    let out = s.0.join("model.safetensors");
    let n = export(&Checkpoint::open(&s.0).unwrap(), &out).unwrap();
    assert_eq!(n, report.params.len());
    let bytes = std::fs::read(&out).unwrap();
    let file = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    for (name, values) in &report.params {
        let t = file.tensor(name).unwrap();
        let got: Vec<f32> = t
            .data()
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
            .collect();
        assert_eq!(&got, values, "{name}");
    }
    // Ordinary Burn code loads it with burn-store into a freshly built model.
    let device = burn::tensor::Device::flex();
    let mut model = c.transformer(30).unwrap().init(99, &device);
    let mut store = burn_store::SafetensorsStore::from_file(&out);
    let result = model.load_from(&mut store).unwrap();
    assert!(
        result.errors.is_empty() && result.missing.is_empty(),
        "{result:?}"
    );
    let layout = ParamLayout::of(&model);
    let flat = flatten_params(&model);
    for (slot, (name, values)) in layout.slots.iter().zip(&report.params) {
        assert_eq!(&slot.name, name);
        assert_eq!(
            &flat[slot.offset..slot.offset + slot.numel],
            &values[..],
            "{name}"
        );
    }
    // A new run on another layout starts from the file: before any step, its parameters are
    // the file's.
    let mut start = job("fsdp=2", 3, 1);
    start.checkpoint.init_from = Some(out.clone());
    start.run.exit_after = Some(0);
    assert_eq!(run(&start).params, report.params);
    // A file of another model is refused, naming the tensor.
    let mut other = start.clone();
    other.model.d_ff = Some(32);
    let err = train(&other, &|_| {}).unwrap_err();
    assert!(
        err.contains("w_gate.weight") && err.contains("has shape"),
        "{err}"
    );
}

#[test]
fn composed_layouts_resume_bitwise_and_continue_on_other_layouts() {
    // Sharded tensor-parallel shares, sharded pipeline stages, ZeRO-1 across tp x pp, and
    // pipelines over context-parallel ranks: their checkpoints come from the placements.
    for (mesh, zero, micro) in [
        ("fsdp=2,tp=2", 3, 1),
        ("fsdp=2,pp=2", 3, 2),
        ("dp=2,tp=2,pp=2", 1, 2),
        ("pp=2,cp=2", 0, 2),
        ("dp=2,tp=2", 2, 1),
    ] {
        let s = Scratch::new(&format!("composed-{}-{zero}", mesh.replace([',', '='], "")));
        let c = job(mesh, zero, micro);
        let straight = second_half(run(&c));
        let resumed = interrupted(&c, &c, &s.0);
        assert_eq!(losses(&resumed), losses(&straight), "{mesh}: losses");
        assert_eq!(resumed.params, straight.params, "{mesh}: parameters");
    }
    for (from, to) in [
        (("fsdp=2,tp=2", 3, 1), ("dp=2", 0, 1)),
        (("dp=2", 0, 2), ("fsdp=2,pp=2", 3, 2)),
        (("fsdp=2,pp=2", 3, 2), ("dp=2,tp=2,pp=2", 1, 2)),
        (("dp=2,tp=2,pp=2", 1, 2), ("fsdp=2,tp=2", 3, 1)),
        (("dp=2,tp=2", 1, 1), ("fsdp=2,tp=2", 3, 1)),
    ] {
        let s = Scratch::new(&format!(
            "composed-reshard-{}",
            from.0.replace([',', '='], "")
        ));
        let (a, b) = (job(from.0, from.1, from.2), job(to.0, to.1, to.2));
        let straight = second_half(run(&b));
        let resumed = interrupted(&a, &b, &s.0);
        let cmp = compare(&straight, &resumed, TOLERANCE);
        assert!(cmp.pass, "{} -> {}: {cmp}", from.0, to.0);
    }
}

#[test]
fn four_and_five_axis_layouts_resume_bitwise_and_reshard_to_and_from_one_rank() {
    // Data x tensor x pipeline x context (the seed's topology), the same fully sharded, HSDP x
    // TP x PP, and all five dense axes at once (32 ranks): 4 layers, 2 micro-batches.
    let layout = |mesh: &str, zero| {
        let mut c = job(mesh, zero, 2);
        c.run.global_batch = 8;
        c
    };
    for (mesh, zero) in [
        ("dp=2,tp=2,pp=2,cp=2", 0),
        ("fsdp=2,tp=2,pp=2,cp=2", 3),
        ("dp=2,fsdp=2,tp=2,pp=2", 3),
        ("dp=2,fsdp=2,tp=2,pp=2,cp=2", 3),
    ] {
        let s = Scratch::new(&format!("axes-{}-{zero}", mesh.replace([',', '='], "")));
        let c = layout(mesh, zero);
        let straight = second_half(run(&c));
        let resumed = interrupted(&c, &c, &s.0);
        assert_eq!(losses(&resumed), losses(&straight), "{mesh}: losses");
        assert_eq!(resumed.params, straight.params, "{mesh}: parameters");
    }
    let five = ("dp=2,fsdp=2,tp=2,pp=2,cp=2", 3);
    for (from, to) in [
        (five, ("dp=1", 0)),
        (("dp=1", 0), five),
        (("fsdp=2,tp=2,pp=2,cp=2", 3), ("dp=2,tp=2,pp=2,cp=2", 1)),
        (five, ("dp=2,tp=2,pp=2,cp=2", 0)),
    ] {
        let s = Scratch::new(&format!(
            "axes-reshard-{}-{}",
            from.0.replace([',', '='], ""),
            to.0.replace([',', '='], "")
        ));
        let (a, b) = (layout(from.0, from.1), layout(to.0, to.1));
        let straight = second_half(run(&b));
        let resumed = interrupted(&a, &b, &s.0);
        let cmp = compare(&straight, &resumed, TOLERANCE);
        assert!(cmp.pass, "{} -> {}: {cmp}", from.0, to.0);
    }
}

#[test]
fn five_axis_mixtures_of_experts_resume_bitwise_and_reshard_between_five_axis_layouts() {
    // A mixture of experts over all of dp/fsdp, ep, tp, pp and cp (32 ranks each): resume on
    // the same layout, then continue on another five-axis layout.
    let layout = |mesh: &str, zero| {
        let mut c = job(mesh, zero, 2);
        c.run.global_batch = 8;
        c.moe.experts = 4;
        c.moe.d_expert = Some(24);
        c.moe.capacity_factor = Some(1.0);
        c.moe.bias_update_rate = 0.05;
        c
    };
    let from = ("fsdp=2,ep=2,tp=2,pp=2,cp=2", 3);
    let to = ("dp=2,ep=2,tp=2,pp=2,cp=2", 1);
    let s = Scratch::new("moe-five-resume");
    let c = layout(from.0, from.1);
    let straight = second_half(run(&c));
    let resumed = interrupted(&c, &c, &s.0);
    assert_eq!(losses(&resumed), losses(&straight), "{}: losses", from.0);
    assert_eq!(resumed.params, straight.params, "{}: parameters", from.0);
    let s = Scratch::new("moe-five-reshard");
    let (a, b) = (layout(from.0, from.1), layout(to.0, to.1));
    let straight = second_half(run(&b));
    let resumed = interrupted(&a, &b, &s.0);
    let cmp = compare(&straight, &resumed, TOLERANCE);
    assert!(cmp.pass, "{} -> {}: {cmp}", from.0, to.0);
}

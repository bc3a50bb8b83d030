//! Whole-checkpoint operations: opening one to resume, exporting the model, resharding offline.

use flashover_checkpoint::Checkpoint;
use std::path::Path;

/// Opens the checkpoint to resume from, with the error naming the directory.
pub fn open(path: &Path) -> Result<Checkpoint, String> {
    Checkpoint::open(path).map_err(|e| format!("resuming: {e}"))
}

/// Writes the model's parameters from `ckpt` as one safetensors file at `out`, named as the
/// model's parameters (`blocks.0.attn.wq.weight`, ...), whole: what ordinary Burn code loads
/// (burn-store) or starts a new run from. Returns the number of tensors written.
pub fn export(ckpt: &Checkpoint, out: &Path) -> Result<usize, String> {
    let mut tensors = vec![];
    for (name, entry) in &ckpt.index().tensors {
        if !name.starts_with("optim.") {
            let values = ckpt.read_whole(name).map_err(|e| e.to_string())?;
            tensors.push((name.clone(), entry.dims(), values));
        }
    }
    let metadata =
        std::collections::HashMap::from([("flashover_step".to_string(), ckpt.step().to_string())]);
    flashover_checkpoint::ModelFile::write(out, &tensors, metadata).map_err(|e| e.to_string())?;
    Ok(tensors.len())
}

/// Rewrites the checkpoint at `src` as the job saved in it would save it on `mesh` (and ZeRO
/// stage `zero`, default the saved one) into the checkpoint root `out`: the ranks of the new
/// mesh load it (each reading its regions) and save at once, training nothing. Returns the
/// new checkpoint's directory.
pub fn reshard(
    src: &Path,
    mesh: &str,
    zero: Option<u8>,
    out: &Path,
) -> Result<std::path::PathBuf, String> {
    let ckpt = open(src)?;
    let saved = ckpt.index().run.get("config").cloned().ok_or_else(|| {
        if serde_json::from_value::<crate::plan_checkpoint::RunState>(ckpt.index().run.clone())
            .is_ok_and(|run| !run.is_empty())
        {
            // Offline resharding would need the model; resuming reads any layout's regions.
            format!(
                "{}: a checkpoint of your own model under a parallelize plan reshards when \
                 it is resumed: Checkpoints::resume on the new mesh and plan reads its parts \
                 (`ckpt export` writes it whole)",
                ckpt.dir().display()
            )
        } else {
            format!(
                "{}: the run state has no job configuration",
                ckpt.dir().display()
            )
        }
    })?;
    let mut config: crate::train::TrainConfig = serde_json::from_value(saved)
        .map_err(|e| format!("{}: the saved configuration: {e}", ckpt.dir().display()))?;
    config.parallel.mesh = mesh.to_string();
    if let Some(stage) = zero {
        config.parallel.zero = stage;
    }
    config.run.steps = ckpt.step() as usize;
    config.run.log_jsonl = None;
    config.run.trace = None;
    config.checkpoint = crate::train::CheckpointSection {
        dir: Some(out.to_path_buf()),
        save_every: 1,
        resume: Some(ckpt.dir().to_path_buf()),
        ..crate::train::CheckpointSection::default()
    };
    let errors = config.validate();
    if !errors.is_empty() {
        return Err(format!(
            "resharding onto `{mesh}`:\n  {}",
            errors.join("\n  ")
        ));
    }
    crate::train::train(&config, &|_| {})?;
    Ok(out.join(flashover_checkpoint::step_dir_name(ckpt.step())))
}

//! How many of the reference transformer's blocks each pipeline stage runs: the job's
//! `parallel.pp_blocks` list, an even split, or one balancing an estimate of each stage's
//! compute (`parallel.pp_split = "cost"`). The plan's pipeline rule takes the counts
//! (`PipelineRule::layers_per_stage`).

/// Blocks per virtual stage: `n_layers` spread evenly over `stages` (earlier stages take the
/// remainder), or an explicit list that must sum to `n_layers`.
pub fn split_blocks(
    n_layers: usize,
    stages: usize,
    explicit: Option<&[usize]>,
) -> Result<Vec<usize>, String> {
    if let Some(list) = explicit {
        if list.len() != stages || list.iter().sum::<usize>() != n_layers {
            return Err(format!(
                "parallel.pp_blocks = {list:?} must give {stages} stages whose blocks sum to model.n_layers = {n_layers}"
            ));
        }
        return Ok(list.to_vec());
    }
    if n_layers < stages {
        return Err(format!(
            "model.n_layers = {n_layers} cannot fill {stages} pipeline stages: every stage needs a block"
        ));
    }
    Ok((0..stages)
        .map(|k| n_layers / stages + (k < n_layers % stages) as usize)
        .collect())
}

/// Blocks per virtual stage balancing an estimate of each stage's compute: a block costs its
/// matrix products per token (`2 (4 d^2 + 3 d f)`) plus attention (`4 t d`), and the last stage
/// also pays the LM head (`2 d V`). The contiguous split minimising the most expensive stage,
/// every stage holding at least one block.
pub fn split_blocks_by_cost(
    config: &flashover_models::TransformerConfig,
    seq_len: usize,
    stages: usize,
) -> Result<Vec<usize>, String> {
    let (d, f, v, t) = (
        config.d_model as f64,
        config.d_ff as f64,
        config.vocab_size as f64,
        seq_len as f64,
    );
    let n = config.n_layers;
    if n < stages {
        return Err(format!(
            "model.n_layers = {n} cannot fill {stages} pipeline stages: every stage needs a block"
        ));
    }
    let block = 2.0 * (4.0 * d * d + 3.0 * d * f) + 4.0 * t * d;
    let head = 2.0 * d * v;
    let (counts, _) = flashover_plan::stages::balanced_stages(n, stages, block, head)
        .ok_or_else(|| format!("model.n_layers = {n} cannot fill {stages} pipeline stages"))?;
    Ok(counts)
}

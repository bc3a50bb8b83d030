//! `flashover plan` (propose meshes) and `flashover config check` (validate a job file).

use clap::Args;
use flashover::plan::{
    Fixed, Hardware, ModelSpec, PlanRequest, Precision, Recompute, Workload, cost, explain,
    model_spec, plan,
};
use flashover::train::TrainConfig;
use std::path::PathBuf;

/// Options of `flashover plan`.
#[derive(Debug, Args)]
pub struct PlanArgs {
    /// Devices in the job.
    #[arg(long)]
    world: usize,
    /// Device preset: h100, h200, a100 or cpu.
    #[arg(long, default_value = "h100")]
    gpu: String,
    /// Devices per node (overrides the preset).
    #[arg(long)]
    gpus_per_node: Option<usize>,
    /// Memory per device in GB (overrides the preset).
    #[arg(long)]
    memory_gb: Option<f64>,
    /// Dense peak TFLOP/s per device (overrides the preset).
    #[arg(long)]
    peak_tflops: Option<f64>,
    /// Inter-node bus bandwidth per device in GB/s (overrides the preset).
    #[arg(long)]
    inter_node_gbps: Option<f64>,
    /// Model preset: llama-1b, llama-8b, llama-70b, llama-405b (default llama-8b; with
    /// --config, the job's reference model).
    #[arg(long)]
    model: Option<String>,
    /// Overrides: blocks.
    #[arg(long)]
    layers: Option<usize>,
    /// Overrides: width.
    #[arg(long)]
    hidden: Option<usize>,
    /// Overrides: attention heads.
    #[arg(long)]
    heads: Option<usize>,
    /// Overrides: MLP width.
    #[arg(long)]
    ffn: Option<usize>,
    /// Tokens per sequence (default 4096, or the job's).
    #[arg(long)]
    seq_len: Option<usize>,
    /// Sequences per step (default 256, or the job's).
    #[arg(long)]
    global_batch: Option<usize>,
    /// Fix the sequences per micro-batch (default: search powers of two dividing each rank's
    /// share of the global batch).
    #[arg(long)]
    micro_batch: Option<usize>,
    /// mixed (bf16 with fp32 master weights) or fp32 (default: mixed; with --config, what the
    /// job's `[precision] param_dtype` says; fp32 with --gpu cpu).
    #[arg(long)]
    precision: Option<String>,
    /// Fix the tensor-parallel degree.
    #[arg(long)]
    tp: Option<usize>,
    /// Fix the pipeline degree.
    #[arg(long)]
    pp: Option<usize>,
    /// Fix the context-parallel degree.
    #[arg(long)]
    cp: Option<usize>,
    /// Fix the expert-parallel degree.
    #[arg(long)]
    ep: Option<usize>,
    /// Fix the replica degree.
    #[arg(long)]
    dp: Option<usize>,
    /// Fix the ZeRO-3 shard group.
    #[arg(long)]
    fsdp: Option<usize>,
    /// Fix the ZeRO stage.
    #[arg(long)]
    zero: Option<u8>,
    /// Fix recomputation: none, selective or full.
    #[arg(long)]
    recompute: Option<String>,
    /// Also list layouts Flashover's training job cannot run yet.
    #[arg(long)]
    include_unsupported: bool,
    /// How many plans to print.
    #[arg(long, default_value_t = 5)]
    top: usize,
    /// Print the result as JSON.
    #[arg(long)]
    json: bool,
    /// Draw the best plan's placement: ranks by node, groups, state per rank.
    #[arg(long)]
    explain: bool,
    /// Write the best plan's placement as an SVG file.
    #[arg(long)]
    svg: Option<PathBuf>,
    /// A job file (the one `train` takes): its model, sequence length and batch.
    #[arg(long)]
    config: Option<PathBuf>,
}

fn read_config(path: &PathBuf) -> Result<TrainConfig, String> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
    TrainConfig::from_toml(&text).map_err(|e| format!("{}: {e}", path.display()))
}

fn request(args: &PlanArgs) -> Result<PlanRequest, String> {
    let mut hardware = Hardware::preset(&args.gpu).ok_or_else(|| {
        format!(
            "--gpu {}: expected one of {}",
            args.gpu,
            Hardware::PRESETS.join(", ")
        )
    })?;
    if let Some(n) = args.gpus_per_node {
        hardware.devices_per_node = n;
    }
    if let Some(gb) = args.memory_gb {
        hardware.memory_bytes = gb * 1e9;
    }
    if let Some(t) = args.peak_tflops {
        hardware.peak_flops = t * 1e12;
    }
    if let Some(g) = args.inter_node_gbps {
        hardware.inter_node_bandwidth = g * 1e9;
    }
    let job = args.config.as_ref().map(read_config).transpose()?;
    let mut model = match (&args.model, &job) {
        (Some(name), _) => ModelSpec::preset(name).ok_or_else(|| {
            format!(
                "--model {name}: expected one of {}",
                ModelSpec::PRESETS.join(", ")
            )
        })?,
        (None, Some(job)) => model_spec(job)?,
        (None, None) => ModelSpec::preset("llama-8b").expect("a preset"),
    };
    if let Some(v) = args.layers {
        model.layers = v;
    }
    if let Some(v) = args.hidden {
        model.hidden = v;
    }
    if let Some(v) = args.heads {
        model.heads = v;
        model.kv_heads = model.kv_heads.min(v);
    }
    if let Some(v) = args.ffn {
        model.ffn = v;
    }
    let workload = Workload {
        seq_len: args
            .seq_len
            .or(job.as_ref().map(|j| j.data.seq_len))
            .unwrap_or(4096),
        global_batch: args
            .global_batch
            .or(job.as_ref().map(|j| j.run.global_batch))
            .unwrap_or(256),
    };
    let precision = match args.precision.as_deref() {
        Some("mixed") => Precision::Mixed,
        Some("fp32") => Precision::Fp32,
        Some(other) => return Err(format!("--precision {other}: expected mixed or fp32")),
        // A job file says what it computes in (`[precision] param_dtype`).
        None => match &job {
            Some(j) if j.precision.param_dtype != flashover_parallel::precision::Precision::F32 => {
                Precision::Mixed
            }
            Some(_) => Precision::Fp32,
            None if args.gpu == "cpu" => Precision::Fp32,
            None => Precision::Mixed,
        },
    };
    let recompute = match args.recompute.as_deref() {
        None => None,
        Some("none") => Some(Recompute::None),
        Some("selective") => Some(Recompute::Selective),
        Some("full") => Some(Recompute::Full),
        Some(other) => {
            return Err(format!(
                "--recompute {other}: expected none, selective or full"
            ));
        }
    };
    Ok(PlanRequest {
        world: args.world,
        hardware,
        model,
        workload,
        precision,
        fixed: Fixed {
            tp: args.tp,
            pp: args.pp,
            cp: args.cp,
            ep: args.ep,
            dp: args.dp,
            fsdp: args.fsdp,
            zero: args.zero,
            recompute,
            micro_batch: args.micro_batch,
        },
        include_unsupported: args.include_unsupported,
    })
}

const GB: f64 = 1e9;

/// `flashover plan`.
pub fn run(args: &PlanArgs) -> Result<(), String> {
    let req = request(args)?;
    let result = plan(&req)?;
    if args.json {
        let shown: Vec<_> = result.plans.iter().take(args.top).collect();
        let out = serde_json::json!({
            "world": req.world,
            "hardware": req.hardware,
            "model": req.model,
            "params": req.model.params(),
            "workload": req.workload,
            "precision": req.precision,
            "considered": result.considered,
            "too_big": result.too_big,
            "unsupported": result.unsupported,
            "plans": shown,
            "choices": result.choices,
            "assumptions": cost::ASSUMPTIONS,
        });
        println!(
            "{}",
            serde_json::to_string_pretty(&out).map_err(|e| e.to_string())?
        );
    } else {
        let m = &req.model;
        println!(
            "{} devices ({}, {} per node, {:.0} GB, {:.0} TFLOP/s); {} ({:.2}B parameters, {} layers, hidden {}, {} heads); {} x {} tokens per step; {:?} precision",
            req.world,
            req.hardware.name,
            req.hardware.devices_per_node,
            req.hardware.memory_bytes / GB,
            req.hardware.peak_flops / 1e12,
            m.name,
            m.params() / 1e9,
            m.layers,
            m.hidden,
            m.heads,
            req.workload.global_batch,
            req.workload.seq_len,
            req.precision
        );
        println!(
            "{} valid layouts considered; {} do not fit in {:.0} GB usable; {} not runnable by Flashover yet{}",
            result.considered,
            result.too_big,
            req.hardware.usable_bytes() / GB,
            result.unsupported,
            if req.include_unsupported {
                " (included)"
            } else {
                " (left out; --include-unsupported lists them)"
            }
        );
        if result.plans.is_empty() {
            println!(
                "no layout fits: the smallest needs {:.1} GB per device; add devices, recompute (--recompute full), or shard more",
                result.smallest_memory / GB
            );
        }
        println!(
            "| # | layout | micro-batch | GB/device (state + act) | step s | tokens/s | MFU | why |"
        );
        println!("|---:|---|---:|---|---:|---:|---:|---|");
        for (i, p) in result.plans.iter().take(args.top).enumerate() {
            println!(
                "| {} | {}{} | {} | {:.1} ({:.1} + {:.1}) | {:.3} | {:.0} | {:.2} | {} |",
                i + 1,
                p.layout,
                if p.unsupported.is_empty() {
                    String::new()
                } else {
                    format!(" (not runnable yet: {})", p.unsupported.join("; "))
                },
                p.layout.micro_batch,
                p.memory.total() / GB,
                (p.memory.model_state() + p.memory.gathered) / GB,
                p.memory.activations / GB,
                p.time.step(),
                p.tokens_per_s,
                p.mfu,
                p.why
            );
        }
        if !result.choices.is_empty() {
            println!("why #1 chose what it did (the best plan with each other value):");
            for choice in &result.choices {
                let others: Vec<String> = choice.alternatives.iter().map(|a| a.summary()).collect();
                println!(
                    "  {} = {}: {}",
                    choice.knob,
                    choice.chosen,
                    others.join("; ")
                );
            }
        }
        println!("assumptions:");
        for a in cost::ASSUMPTIONS {
            println!("  - {a}");
        }
    }
    if let Some(best) = result.plans.first() {
        if args.explain {
            print!(
                "{}",
                explain::placement(&best.layout, &req.model, &req.workload, &req.hardware)
            );
        }
        if let Some(path) = &args.svg {
            std::fs::write(path, explain::svg(&best.layout, &req.hardware))
                .map_err(|e| format!("--svg {}: {e}", path.display()))?;
            println!("placement of #1 written to {}", path.display());
        }
    }
    Ok(())
}

/// `flashover config check FILE`: every problem at once, each with its path.
pub fn check(path: &PathBuf) -> Result<bool, String> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let (config, mut errors) =
        TrainConfig::from_toml_lenient(&text).map_err(|e| format!("{}: {e}", path.display()))?;
    errors.extend(config.validate());
    if errors.is_empty() {
        let mesh = config.mesh()?;
        let model = model_spec(&config)?;
        println!(
            "{}: valid; mesh {} ({} ranks), {} with {:.3}M parameters, {} x {} tokens per step",
            path.display(),
            config.parallel.mesh,
            mesh.world_size(),
            model.name,
            model.params() / 1e6,
            config.run.global_batch,
            config.data.seq_len
        );
        Ok(true)
    } else {
        println!("{}: {} problem(s)", path.display(), errors.len());
        for e in &errors {
            println!("  {e}");
        }
        Ok(false)
    }
}

//! Where a layout puts things: which ranks form each group, on which nodes, and what state
//! each rank holds; in the terminal, or as an SVG for documents.

use crate::hardware::Hardware;
use crate::layout::Layout;
use crate::model::{ModelSpec, Workload};
use flashover_mesh::{Axis, DeviceMesh};
use std::fmt::Write;

fn mesh_of(layout: &Layout) -> DeviceMesh {
    DeviceMesh::new(&layout.degrees()).expect("a layout's degrees are at least 1")
}

/// A rank's coordinates on the axes in use, e.g. `p1 d0 t3`.
fn coords(mesh: &DeviceMesh, layout: &Layout, rank: usize) -> String {
    let c = mesh.coords(rank);
    layout
        .degrees()
        .iter()
        .enumerate()
        .filter(|(_, (_, d))| *d > 1)
        .map(|(i, (axis, _))| format!("{}{}", &axis.name()[..1], c[i]))
        .collect::<Vec<_>>()
        .join(" ")
}

/// The terminal picture: ranks by node with their coordinates, the groups of every axis in
/// use (and whether they stay inside a node), and what each rank holds.
pub fn placement(layout: &Layout, model: &ModelSpec, work: &Workload, hw: &Hardware) -> String {
    let mesh = mesh_of(layout);
    let world = layout.world();
    let per_node = hw.devices_per_node.min(world).max(1);
    let nodes = world.div_ceil(per_node);
    let mut out = String::new();
    let _ = writeln!(
        out,
        "mesh {} on {nodes} node(s) of {} devices; coordinates: p = pp stage, d = dp, f = fsdp, e = ep, c = cp, t = tp",
        layout.mesh_spec(),
        hw.devices_per_node
    );
    for node in 0..nodes.min(16) {
        let ranks: Vec<String> = (node * per_node..((node + 1) * per_node).min(world))
            .map(|r| format!("r{r}[{}]", coords(&mesh, layout, r)))
            .collect();
        let _ = writeln!(out, "  node {node:>2}: {}", ranks.join(" "));
    }
    if nodes > 16 {
        let _ = writeln!(out, "  ... {} more nodes", nodes - 16);
    }
    let _ = writeln!(out, "groups:");
    for (axis, degree) in layout.degrees() {
        if degree < 2 {
            continue;
        }
        let groups = mesh.groups(&[axis]);
        let shown: Vec<String> = groups.iter().take(4).map(|g| format!("{g:?}")).collect();
        let more = if groups.len() > 4 {
            format!(" ... ({} groups)", groups.len())
        } else {
            String::new()
        };
        let place = if layout.within_node(&[axis], hw) {
            "inside a node"
        } else {
            "across nodes"
        };
        let _ = writeln!(
            out,
            "  {:<4} {degree} ranks, {place}: {}{more}",
            axis.name(),
            shown.join(" ")
        );
    }
    let _ = writeln!(out, "state on each rank:");
    let blocks = crate::cost::stage_blocks(model, work, layout);
    let (fewest, most) = (
        blocks.iter().min().copied().unwrap_or(0),
        blocks.iter().max().copied().unwrap_or(0),
    );
    let split = if layout.tp > 1 {
        format!(", 1/{} of each matrix (tp)", layout.tp)
    } else {
        String::new()
    };
    let experts = if model.experts > 0 {
        format!(
            ", {} of {} experts (ep)",
            model.experts / layout.ep,
            model.experts
        )
    } else {
        String::new()
    };
    let stage = if layout.pp > 1 && fewest == most {
        format!("{most} of {} blocks (its pp stage)", model.layers)
    } else if layout.pp > 1 {
        format!(
            "{fewest} to {most} of {} blocks (its pp stage; stages cut to balance compute, the LM head's included)",
            model.layers
        )
    } else {
        format!("all {} blocks", model.layers)
    };
    let n = layout.shard_ranks();
    let same = "as the parameters".to_string();
    let shard = |stage: u8| format!("a 1/{n} shard of that (ZeRO-{stage})");
    let (params, grads, optim) = match layout.zero {
        0 => (String::new(), same.clone(), format!("{same} (DDP)")),
        1 => (String::new(), same, shard(1)),
        2 => (String::new(), shard(2), shard(2)),
        _ => (
            format!("; stored as a 1/{n} shard, gathered block by block (ZeRO-3)"),
            shard(3),
            shard(3),
        ),
    };
    let _ = writeln!(out, "  parameters: {stage}{split}{experts}{params}");
    let _ = writeln!(out, "  gradients:  {grads}");
    let _ = writeln!(out, "  optimizer:  {optim}");
    let replicas = layout.dp * if layout.zero == 3 { 1 } else { layout.fsdp } * layout.cp;
    if replicas > 1 {
        let _ = writeln!(
            out,
            "  replicated over {replicas} ranks (dp{}); batch split over dp x fsdp x ep = {}{}",
            if layout.cp > 1 { " x cp" } else { "" },
            layout.batch_ranks(),
            if layout.cp > 1 {
                format!(", each sequence over cp = {}", layout.cp)
            } else {
                String::new()
            }
        );
    }
    out
}

/// An SVG of the ranks by node: one box per rank, coloured by pipeline stage, labelled with
/// its rank and coordinates.
pub fn svg(layout: &Layout, hw: &Hardware) -> String {
    let mesh = mesh_of(layout);
    let world = layout.world();
    let per_node = hw.devices_per_node.min(world).max(1);
    let nodes = world.div_ceil(per_node);
    let (w, h, left, top) = (96, 44, 70, 30);
    let width = left + per_node * w + 10;
    let height = top + nodes * (h + 10) + 10;
    let mut out = format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{width}\" height=\"{height}\" font-family=\"monospace\" font-size=\"11\">\n"
    );
    let _ = writeln!(
        out,
        "<text x=\"4\" y=\"18\">{} (colour: pp stage)</text>",
        layout.mesh_spec()
    );
    for node in 0..nodes {
        let y = top + node * (h + 10);
        let _ = writeln!(
            out,
            "<text x=\"4\" y=\"{}\">node {node}</text>",
            y + h / 2 + 4
        );
        for slot in 0..per_node {
            let rank = node * per_node + slot;
            if rank >= world {
                break;
            }
            let x = left + slot * w;
            let stage = mesh.coord(rank, Axis::Pp);
            let hue = 360 * stage / layout.pp.max(1);
            let _ = writeln!(
                out,
                "<rect x=\"{x}\" y=\"{y}\" width=\"{}\" height=\"{h}\" rx=\"4\" fill=\"hsl({hue},60%,80%)\" stroke=\"#333\"/>",
                w - 6
            );
            let _ = writeln!(
                out,
                "<text x=\"{}\" y=\"{}\">r{rank}</text><text x=\"{}\" y=\"{}\">{}</text>",
                x + 4,
                y + 16,
                x + 4,
                y + 32,
                coords(&mesh, layout, rank)
            );
        }
    }
    out.push_str("</svg>\n");
    out
}

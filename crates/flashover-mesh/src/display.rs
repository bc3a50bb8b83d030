//! Drawing a mesh: which ranks form each group, so a user can see the layout.

use crate::axis::Axis;
use crate::mesh::DeviceMesh;
use std::fmt;

impl fmt::Display for DeviceMesh {
    /// ```text
    /// mesh dp=2,tp=2: 4 ranks (rank order pp, dp, fsdp, ep, cp, tp; tp varies fastest)
    ///   rank  dp tp
    ///      0   0  0
    ///      ...
    ///   dp groups: [0 2] [1 3]
    ///   tp groups: [0 1] [2 3]
    /// ```
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let axes: Vec<Axis> = self.axes().to_vec();
        writeln!(
            f,
            "mesh {}: {} ranks (rank order pp, dp, fsdp, ep, cp, tp; tp varies fastest)",
            self.to_spec(),
            self.world_size()
        )?;
        write!(f, "  rank")?;
        for a in &axes {
            write!(f, " {:>4}", a.name())?;
        }
        writeln!(f)?;
        for r in 0..self.world_size() {
            write!(f, "  {r:>4}")?;
            for a in &axes {
                write!(f, " {:>4}", self.coord(r, *a))?;
            }
            writeln!(f)?;
        }
        for a in &axes {
            let groups: Vec<String> = self
                .groups(&[*a])
                .iter()
                .map(|g| {
                    format!(
                        "[{}]",
                        g.iter()
                            .map(|r| r.to_string())
                            .collect::<Vec<_>>()
                            .join(" ")
                    )
                })
                .collect();
            writeln!(f, "  {:>4} groups: {}", a.name(), groups.join(" "))?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use crate::DeviceMesh;

    #[test]
    fn display_lists_every_rank_and_group() {
        let m: DeviceMesh = "dp=2,tp=2".parse().unwrap();
        let s = m.to_string();
        assert!(s.starts_with("mesh dp=2,tp=2: 4 ranks"));
        assert!(s.contains("dp groups: [0 2] [1 3]"), "{s}");
        assert!(s.contains("tp groups: [0 1] [2 3]"), "{s}");
        assert!(s.contains("     3    1    1"), "{s}");
    }
}

//! The mesh: degrees per axis, rank <-> coordinates, groups.

use crate::axis::Axis;
use serde::{Deserialize, Serialize};
use std::str::FromStr;

/// Why a mesh description is invalid. Each message says what to change.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum MeshError {
    /// The string is empty.
    #[error("empty mesh: give axis=degree pairs such as `dp=2,tp=2`")]
    Empty,
    /// An entry is not of the form `axis=degree`.
    #[error("malformed mesh entry `{entry}`: expected axis=degree, e.g. `tp=2`")]
    Malformed {
        /// The offending entry.
        entry: String,
    },
    /// The axis name is not known.
    #[error("unknown mesh axis `{name}`: known axes are pp, dp, fsdp, ep, cp, tp")]
    UnknownAxis {
        /// The name given.
        name: String,
    },
    /// An axis appears twice.
    #[error("mesh axis `{axis}` is given twice")]
    DuplicateAxis {
        /// The repeated axis.
        axis: Axis,
    },
    /// A degree is zero or not a number.
    #[error("mesh axis `{axis}` has degree `{degree}`: degrees must be whole numbers >= 1")]
    BadDegree {
        /// The axis.
        axis: Axis,
        /// The degree as written.
        degree: String,
    },
    /// The product of the degrees differs from the number of ranks launched.
    #[error("mesh {mesh} needs {product} ranks ({factors}) but the world has {world}")]
    WorldMismatch {
        /// The mesh as written.
        mesh: String,
        /// Product of the degrees.
        product: usize,
        /// The degrees multiplied out, e.g. `dp=2 x tp=4 = 8`.
        factors: String,
        /// Ranks available.
        world: usize,
    },
}

/// A validated N-D mesh of ranks over named axes.
///
/// Axes not given have degree 1. See the crate docs for the rank order.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeviceMesh {
    /// Degree of each axis in [`Axis::ALL`] order (1 where not given).
    degrees: [usize; 6],
    /// Axes the user named (kept for display even at degree 1).
    named: Vec<Axis>,
}

impl DeviceMesh {
    /// A mesh from (axis, degree) pairs in any order.
    pub fn new(axes: &[(Axis, usize)]) -> Result<Self, MeshError> {
        if axes.is_empty() {
            return Err(MeshError::Empty);
        }
        let mut degrees = [1; 6];
        let mut named = vec![];
        for &(axis, degree) in axes {
            if named.contains(&axis) {
                return Err(MeshError::DuplicateAxis { axis });
            }
            if degree == 0 {
                return Err(MeshError::BadDegree {
                    axis,
                    degree: "0".into(),
                });
            }
            degrees[Self::slot(axis)] = degree;
            named.push(axis);
        }
        named.sort();
        Ok(DeviceMesh { degrees, named })
    }

    /// A plain data-parallel mesh of `world` ranks.
    pub fn data_parallel(world: usize) -> Result<Self, MeshError> {
        Self::new(&[(Axis::Dp, world)])
    }

    /// Checks that the mesh uses exactly `world` ranks.
    pub fn check_world(&self, world: usize) -> Result<(), MeshError> {
        if self.world_size() == world {
            return Ok(());
        }
        let factors = self
            .named
            .iter()
            .map(|a| format!("{a}={}", self.degree(*a)))
            .collect::<Vec<_>>()
            .join(" x ");
        Err(MeshError::WorldMismatch {
            mesh: self.to_spec(),
            product: self.world_size(),
            factors: format!("{factors} = {}", self.world_size()),
            world,
        })
    }

    fn slot(axis: Axis) -> usize {
        Axis::ALL
            .iter()
            .position(|&a| a == axis)
            .expect("every axis is in ALL")
    }

    /// Number of ranks: the product of the degrees.
    pub fn world_size(&self) -> usize {
        self.degrees.iter().product()
    }

    /// Degree of `axis` (1 if absent).
    pub fn degree(&self, axis: Axis) -> usize {
        self.degrees[Self::slot(axis)]
    }

    /// The axes the user named, in rank order.
    pub fn axes(&self) -> &[Axis] {
        &self.named
    }

    /// The canonical string form, e.g. `dp=2,tp=2` (named axes, rank order).
    pub fn to_spec(&self) -> String {
        self.named
            .iter()
            .map(|a| format!("{a}={}", self.degree(*a)))
            .collect::<Vec<_>>()
            .join(",")
    }

    /// Coordinates of `rank`, one per axis in [`Axis::ALL`] order.
    pub fn coords(&self, rank: usize) -> [usize; 6] {
        assert!(
            rank < self.world_size(),
            "rank {rank} outside a world of {}",
            self.world_size()
        );
        let mut coords = [0; 6];
        let mut rest = rank;
        for i in (0..6).rev() {
            coords[i] = rest % self.degrees[i];
            rest /= self.degrees[i];
        }
        coords
    }

    /// Coordinate of `rank` along `axis`.
    pub fn coord(&self, rank: usize, axis: Axis) -> usize {
        self.coords(rank)[Self::slot(axis)]
    }

    /// The rank at `coords` ([`Axis::ALL`] order).
    pub fn rank_of(&self, coords: [usize; 6]) -> usize {
        coords.iter().zip(&self.degrees).fold(0, |acc, (&c, &d)| {
            assert!(c < d, "coordinate {c} outside degree {d}");
            acc * d + c
        })
    }

    /// Global ranks of the group of `rank` along `axes`: the ranks that share every other
    /// coordinate, ordered by their index within the group (row-major over `axes` in rank order).
    pub fn group_ranks(&self, rank: usize, axes: &[Axis]) -> Vec<usize> {
        let base = self.coords(rank);
        let varying: Vec<usize> = (0..6).filter(|&i| axes.contains(&Axis::ALL[i])).collect();
        let size: usize = varying.iter().map(|&i| self.degrees[i]).product();
        (0..size)
            .map(|mut index| {
                let mut c = base;
                for &i in varying.iter().rev() {
                    c[i] = index % self.degrees[i];
                    index /= self.degrees[i];
                }
                self.rank_of(c)
            })
            .collect()
    }

    /// Which group along `axes` `rank` belongs to, numbered 0.. in order of the groups' first ranks.
    pub fn group_index(&self, rank: usize, axes: &[Axis]) -> usize {
        let first = self.group_ranks(rank, axes)[0];
        self.groups(axes)
            .iter()
            .position(|g| g[0] == first)
            .expect("rank is in a group")
    }

    /// Every group along `axes`, ordered by first rank.
    pub fn groups(&self, axes: &[Axis]) -> Vec<Vec<usize>> {
        let mut seen = vec![false; self.world_size()];
        let mut out = vec![];
        for r in 0..self.world_size() {
            if !seen[r] {
                let g = self.group_ranks(r, axes);
                for &m in &g {
                    seen[m] = true;
                }
                out.push(g);
            }
        }
        out
    }
}

impl FromStr for DeviceMesh {
    type Err = MeshError;

    /// Parses `axis=degree` pairs separated by commas, e.g. `dp=2,fsdp=2,tp=2`.
    fn from_str(s: &str) -> Result<Self, MeshError> {
        let s = s.trim();
        if s.is_empty() {
            return Err(MeshError::Empty);
        }
        let mut axes = vec![];
        for entry in s.split(',') {
            let (name, degree) = entry.split_once('=').ok_or_else(|| MeshError::Malformed {
                entry: entry.trim().into(),
            })?;
            let axis: Axis = name
                .parse()
                .map_err(|name| MeshError::UnknownAxis { name })?;
            let d: usize = degree.trim().parse().map_err(|_| MeshError::BadDegree {
                axis,
                degree: degree.trim().into(),
            })?;
            axes.push((axis, d));
        }
        DeviceMesh::new(&axes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mesh(s: &str) -> DeviceMesh {
        s.parse().unwrap()
    }

    #[test]
    fn tp_ranks_are_adjacent_and_pp_is_outermost() {
        let m = mesh("tp=2,pp=2,dp=2");
        assert_eq!(m.to_spec(), "pp=2,dp=2,tp=2");
        assert_eq!(
            m.groups(&[Axis::Tp]),
            vec![vec![0, 1], vec![2, 3], vec![4, 5], vec![6, 7]]
        );
        assert_eq!(
            m.groups(&[Axis::Dp]),
            vec![vec![0, 2], vec![1, 3], vec![4, 6], vec![5, 7]]
        );
        assert_eq!(
            m.groups(&[Axis::Pp]),
            vec![vec![0, 4], vec![1, 5], vec![2, 6], vec![3, 7]]
        );
    }

    #[test]
    fn coords_and_rank_round_trip_on_a_4d_mesh() {
        let m = mesh("pp=2,dp=3,cp=2,tp=2");
        for r in 0..m.world_size() {
            assert_eq!(m.rank_of(m.coords(r)), r);
        }
        assert_eq!(m.coord(13, Axis::Pp), 1);
    }

    #[test]
    fn groups_over_several_axes_partition_the_world() {
        let m = mesh("dp=2,fsdp=3,tp=2");
        let g = m.groups(&[Axis::Dp, Axis::Fsdp]);
        assert_eq!(g.len(), 2);
        assert_eq!(g[0], vec![0, 2, 4, 6, 8, 10]);
        let mut all: Vec<usize> = g.concat();
        all.sort();
        assert_eq!(all, (0..12).collect::<Vec<_>>());
        assert_eq!(m.group_index(3, &[Axis::Tp]), 1);
    }

    #[test]
    fn absent_axes_have_degree_one_and_singleton_groups() {
        let m = mesh("dp=4");
        assert_eq!(m.degree(Axis::Tp), 1);
        assert_eq!(m.group_ranks(3, &[Axis::Tp]), vec![3]);
        assert_eq!(m.group_ranks(3, &[Axis::Dp]), vec![0, 1, 2, 3]);
    }

    #[test]
    fn invalid_meshes_fail_with_actionable_errors() {
        let err = |s: &str| s.parse::<DeviceMesh>().unwrap_err().to_string();
        assert!(err("").contains("empty mesh"));
        assert!(err("dp=2,xp=2").contains("unknown mesh axis `xp`"));
        assert!(err("dp=2,dp=2").contains("given twice"));
        assert!(err("tp=0").contains("degree `0`"));
        assert!(err("tp=two").contains("degree `two`"));
        assert!(err("tp").contains("expected axis=degree"));
        let e = mesh("dp=2,tp=4").check_world(6).unwrap_err().to_string();
        assert_eq!(
            e,
            "mesh dp=2,tp=4 needs 8 ranks (dp=2 x tp=4 = 8) but the world has 6"
        );
    }
}

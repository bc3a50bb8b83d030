//! Where this process sits in a multi-process job, read from the variables its launcher set:
//! `mpirun` (Open MPI's `OMPI_COMM_WORLD_*`), Slurm's `srun` (`SLURM_PROCID`, `SLURM_NTASKS`,
//! `SLURM_LOCALID`) or torchrun-style launchers (`RANK`, `WORLD_SIZE`, `LOCAL_RANK`,
//! `MASTER_ADDR`, `MASTER_PORT`). The local rank picks the device (`--device cuda` uses GPU
//! `local_rank`); the master address and the job token (`FLASHOVER_RDZV_TOKEN`) make the TCP
//! rendezvous where there is no MPI.

use flashover_comm::Rendezvous;
use std::net::ToSocketAddrs;
use std::time::Duration;

/// Which launcher's variables were found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Launcher {
    /// Open MPI's `mpirun`.
    Mpirun,
    /// Slurm's `srun`.
    Slurm,
    /// torchrun-style variables (also what `flashover launch` sets without MPI).
    Torchrun,
}

/// This process's place in the job.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProcessEnv {
    /// Who started the process.
    pub launcher: Launcher,
    /// Global rank.
    pub rank: usize,
    /// Number of processes.
    pub world: usize,
    /// Rank among the processes of this machine (the device index).
    pub local_rank: usize,
    /// Rank 0's rendezvous address (`MASTER_ADDR:MASTER_PORT`), where given.
    pub master: Option<(String, u16)>,
    /// The job's rendezvous token (`FLASHOVER_RDZV_TOKEN`), where given.
    pub token: Option<String>,
}

impl ProcessEnv {
    /// From this process's environment; `None` when no launcher's variables are set (ranks are
    /// threads of this process).
    pub fn detect() -> Result<Option<Self>, String> {
        Self::from_vars(|name| std::env::var(name).ok())
    }

    /// From variables `get` returns (testable without touching the environment). The first
    /// launcher whose rank and size variables are both present wins: mpirun, Slurm, torchrun.
    /// Every malformed or inconsistent value is an error naming the variable.
    pub fn from_vars(get: impl Fn(&str) -> Option<String>) -> Result<Option<Self>, String> {
        let layouts = [
            (
                Launcher::Mpirun,
                "OMPI_COMM_WORLD_RANK",
                "OMPI_COMM_WORLD_SIZE",
                "OMPI_COMM_WORLD_LOCAL_RANK",
            ),
            (
                Launcher::Slurm,
                "SLURM_PROCID",
                "SLURM_NTASKS",
                "SLURM_LOCALID",
            ),
            (Launcher::Torchrun, "RANK", "WORLD_SIZE", "LOCAL_RANK"),
        ];
        let number = |name: &str| -> Result<Option<usize>, String> {
            match get(name) {
                None => Ok(None),
                Some(v) => v
                    .trim()
                    .parse::<usize>()
                    .map(Some)
                    .map_err(|_| format!("{name}={v:?} is not a non-negative integer")),
            }
        };
        for (launcher, rank_var, size_var, local_var) in layouts {
            let (Some(rank), Some(world)) = (number(rank_var)?, number(size_var)?) else {
                continue;
            };
            if world == 0 || rank >= world {
                return Err(format!(
                    "{rank_var}={rank} with {size_var}={world}: the rank must be below the size"
                ));
            }
            let local_rank = number(local_var)?.unwrap_or(0);
            if local_rank > rank {
                return Err(format!(
                    "{local_var}={local_rank} exceeds {rank_var}={rank}"
                ));
            }
            let master = match (get("MASTER_ADDR"), number("MASTER_PORT")?) {
                (Some(host), Some(port)) => Some((
                    host,
                    u16::try_from(port)
                        .map_err(|_| format!("MASTER_PORT={port} is not a port number"))?,
                )),
                (None, None) => None,
                _ => {
                    return Err("MASTER_ADDR and MASTER_PORT must be set together".to_string());
                }
            };
            return Ok(Some(ProcessEnv {
                launcher,
                rank,
                world,
                local_rank,
                master,
                token: get("FLASHOVER_RDZV_TOKEN"),
            }));
        }
        Ok(None)
    }

    /// The TCP rendezvous of this job (needs `MASTER_ADDR`, `MASTER_PORT` and
    /// `FLASHOVER_RDZV_TOKEN`), waiting at most `timeout`.
    pub fn rendezvous(&self, timeout: Duration) -> Result<Rendezvous, String> {
        let (host, port) = self
            .master
            .clone()
            .ok_or("the TCP rendezvous needs MASTER_ADDR and MASTER_PORT")?;
        let token = self
            .token
            .clone()
            .ok_or("the TCP rendezvous needs FLASHOVER_RDZV_TOKEN (the job's secret)")?;
        let addr = (host.as_str(), port)
            .to_socket_addrs()
            .map_err(|e| format!("MASTER_ADDR={host}: {e}"))?
            .next()
            .ok_or_else(|| format!("MASTER_ADDR={host} resolves to no address"))?;
        Ok(Rendezvous {
            addr,
            token,
            world: self.world,
            timeout,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn env(pairs: &[(&str, &str)]) -> Result<Option<ProcessEnv>, String> {
        let map: HashMap<String, String> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        ProcessEnv::from_vars(|k| map.get(k).cloned())
    }

    #[test]
    fn each_launchers_variables_are_read_and_checked() {
        assert_eq!(env(&[]).unwrap(), None);
        let mpi = env(&[
            ("OMPI_COMM_WORLD_RANK", "3"),
            ("OMPI_COMM_WORLD_SIZE", "4"),
            ("OMPI_COMM_WORLD_LOCAL_RANK", "1"),
        ])
        .unwrap()
        .unwrap();
        assert_eq!(
            (mpi.launcher, mpi.rank, mpi.world, mpi.local_rank),
            (Launcher::Mpirun, 3, 4, 1)
        );
        let slurm = env(&[
            ("SLURM_PROCID", "5"),
            ("SLURM_NTASKS", "8"),
            ("SLURM_LOCALID", "1"),
        ])
        .unwrap()
        .unwrap();
        assert_eq!((slurm.launcher, slurm.local_rank), (Launcher::Slurm, 1));
        let torch = env(&[
            ("RANK", "1"),
            ("WORLD_SIZE", "2"),
            ("LOCAL_RANK", "1"),
            ("MASTER_ADDR", "127.0.0.1"),
            ("MASTER_PORT", "29500"),
            ("FLASHOVER_RDZV_TOKEN", "0123456789abcdef0123"),
        ])
        .unwrap()
        .unwrap();
        assert_eq!(torch.master, Some(("127.0.0.1".into(), 29500)));
        let rdzv = torch.rendezvous(Duration::from_secs(1)).unwrap();
        assert_eq!((rdzv.world, rdzv.addr.port()), (2, 29500));
        for (bad, says) in [
            (vec![("RANK", "2"), ("WORLD_SIZE", "2")], "must be below"),
            (vec![("RANK", "x"), ("WORLD_SIZE", "2")], "RANK=\"x\""),
            (
                vec![
                    ("RANK", "0"),
                    ("WORLD_SIZE", "2"),
                    ("MASTER_PORT", "70000"),
                    ("MASTER_ADDR", "h"),
                ],
                "not a port",
            ),
            (
                vec![("RANK", "0"), ("WORLD_SIZE", "2"), ("MASTER_ADDR", "h")],
                "set together",
            ),
        ] {
            let err = env(&bad).unwrap_err();
            assert!(err.contains(says), "{err}");
        }
        let no_token = env(&[
            ("RANK", "0"),
            ("WORLD_SIZE", "2"),
            ("MASTER_ADDR", "127.0.0.1"),
            ("MASTER_PORT", "1"),
        ])
        .unwrap()
        .unwrap();
        assert!(
            no_token
                .rendezvous(Duration::from_secs(1))
                .unwrap_err()
                .contains("FLASHOVER_RDZV_TOKEN")
        );
    }
}

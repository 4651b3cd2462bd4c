//! Which process group `ganymede train` uses: threads of one process, MPI, or NCCL (one process
//! per GPU). A small pure function of the device and the launcher, so the choice is tested
//! without launching anything.

use anyhow::{bail, Result};
use ganymede_config::DeviceKind;
use ganymede_dist::rendezvous::LaunchEnv;

/// How the processes of an NCCL job share NCCL's unique id.
#[derive(Clone, Debug, PartialEq)]
pub enum Bootstrap {
    /// Broadcast over MPI (`mpirun`, or `srun` with PMIx, in a binary built with `mpi`).
    Mpi,
    /// Rank 0's TCP store, at the launcher's variables (torchrun-style or Slurm's).
    Store(LaunchEnv),
}

/// The process group of a training job.
#[derive(Clone, Debug, PartialEq)]
pub enum Comm {
    /// Ranks as threads of this process (`--ranks N`, or one rank).
    Threads,
    /// One MPI process per rank, host collectives.
    Mpi,
    /// One process per GPU, NCCL collectives on device memory.
    Nccl(Bootstrap),
}

/// The group for `device` when MPI reports `mpi_size` processes, the launcher's variables give
/// `launch`, and `--ranks` was `ranks_flag`. CUDA with more than one process is NCCL (the host
/// groups cannot move device memory); CUDA with `--ranks N > 1` is refused, since NCCL puts one
/// rank on each GPU and thread ranks would share one.
pub fn choose(
    device: DeviceKind,
    mpi_size: Option<usize>,
    launch: Option<&LaunchEnv>,
    ranks_flag: Option<usize>,
) -> Result<Comm> {
    if device != DeviceKind::Cuda {
        return Ok(if mpi_size.is_some() {
            Comm::Mpi
        } else {
            Comm::Threads
        });
    }
    if mpi_size.is_some_and(|n| n > 1) {
        return Ok(Comm::Nccl(Bootstrap::Mpi));
    }
    if let Some(env) = launch.filter(|e| e.world_size > 1) {
        return Ok(Comm::Nccl(Bootstrap::Store(env.clone())));
    }
    if let Some(n) = ranks_flag.filter(|&n| n > 1) {
        bail!(
            "device.kind = \"cuda\" trains one process per GPU over NCCL, not {n} thread ranks: \
             start {n} processes (srun, mpirun, or with RANK, WORLD_SIZE, MASTER_ADDR set) \
             without --ranks"
        );
    }
    Ok(if mpi_size.is_some() {
        Comm::Mpi
    } else {
        Comm::Threads
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(world: usize) -> LaunchEnv {
        LaunchEnv {
            rank: 0,
            world_size: world,
            local_rank: 0,
            master_addr: "node1".into(),
            master_port: 29500,
            launcher: "slurm",
        }
    }

    #[test]
    fn cuda_on_several_processes_is_nccl() {
        let c = DeviceKind::Cuda;
        assert_eq!(
            choose(c, Some(8), None, None).unwrap(),
            Comm::Nccl(Bootstrap::Mpi)
        );
        // MPI wins over the launcher's variables (srun with PMIx sets both).
        assert_eq!(
            choose(c, Some(8), Some(&env(8)), None).unwrap(),
            Comm::Nccl(Bootstrap::Mpi)
        );
        assert_eq!(
            choose(c, None, Some(&env(4)), None).unwrap(),
            Comm::Nccl(Bootstrap::Store(env(4)))
        );
        // One process: no group to speak of.
        assert_eq!(choose(c, None, Some(&env(1)), None).unwrap(), Comm::Threads);
        assert_eq!(choose(c, Some(1), None, None).unwrap(), Comm::Mpi);
        assert_eq!(choose(c, None, None, Some(1)).unwrap(), Comm::Threads);
    }

    #[test]
    fn cuda_thread_ranks_are_refused_in_one_line() {
        let e = choose(DeviceKind::Cuda, None, None, Some(4))
            .unwrap_err()
            .to_string();
        assert!(!e.contains('\n'));
        assert!(
            e.contains("one process per GPU") && e.contains("--ranks"),
            "{e}"
        );
    }

    #[test]
    fn the_cpu_keeps_threads_and_mpi() {
        for d in [DeviceKind::Cpu, DeviceKind::CpuTwoMemory] {
            assert_eq!(
                choose(d, None, Some(&env(4)), Some(4)).unwrap(),
                Comm::Threads
            );
            assert_eq!(choose(d, Some(4), None, None).unwrap(), Comm::Mpi);
        }
    }
}

/// The GPU of this process under MPI: the launcher's local rank (`LOCAL_RANK`, Open MPI's
/// `OMPI_COMM_WORLD_LOCAL_RANK`, Slurm's `SLURM_LOCALID`, MPICH's `MPI_LOCALRANKID`), else 0.
pub fn local_rank_from(get: impl Fn(&str) -> Option<String>) -> usize {
    [
        "LOCAL_RANK",
        "OMPI_COMM_WORLD_LOCAL_RANK",
        "SLURM_LOCALID",
        "MPI_LOCALRANKID",
    ]
    .iter()
    .find_map(|k| get(k).and_then(|v| v.trim().parse().ok()))
    .unwrap_or(0)
}

#[cfg(test)]
mod local_rank_tests {
    #[test]
    fn local_rank_takes_the_first_launcher_variable_set() {
        let f = |kv: &'static [(&'static str, &'static str)]| {
            super::local_rank_from(move |k| {
                kv.iter().find(|(a, _)| *a == k).map(|(_, v)| v.to_string())
            })
        };
        assert_eq!(f(&[]), 0);
        assert_eq!(f(&[("SLURM_LOCALID", "3")]), 3);
        assert_eq!(
            f(&[("OMPI_COMM_WORLD_LOCAL_RANK", "2"), ("SLURM_LOCALID", "3")]),
            2
        );
        assert_eq!(f(&[("LOCAL_RANK", "1"), ("SLURM_LOCALID", "3")]), 1);
    }
}

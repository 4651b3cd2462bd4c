//! How `ganymede train` was started and how it runs, in one place: the launcher (mpirun's
//! processes, a launcher's variables such as srun's or torchrun's, or `--ranks` threads), the
//! job's world size and process group, the refusal of a CUDA job this binary or machine cannot
//! run, and each rank's backend, made here because the binary is the one crate that links every
//! backend.

use anyhow::Result;
use ganymede_config::{DeviceKind, JobConfig};
use ganymede_train::comm::Comm;
use ganymede_train::trainer::{self, MakeBackend, TrainOptions, TrainSummary};
use std::path::PathBuf;

/// The build command that gives a binary able to use a GPU.
#[cfg(not(feature = "cuda"))]
pub const BUILD_WITH_CUDA: &str = "cargo build --release -p ganymede --features cuda";

/// What started this process, as far as the world size goes.
pub struct Launcher {
    /// mpirun's processes (binaries built with `mpi`).
    mpi_size: Option<usize>,
    /// `--ranks`.
    ranks_flag: Option<usize>,
}

/// A job ready to train: its configuration resolved for its world, and how its ranks talk.
pub struct Job {
    pub cfg: JobConfig,
    pub ckpt: Option<PathBuf>,
    /// The world size: processes or thread ranks.
    pub ranks: usize,
    comm: Comm,
}

impl Launcher {
    /// This process's launcher; refuses `--ranks` under mpirun (the processes are the ranks)
    /// and `--ranks 0`.
    pub fn detect(ranks_flag: Option<usize>) -> Result<Self> {
        #[cfg(feature = "mpi")]
        let mpi_size: Option<usize> = std::env::var("OMPI_COMM_WORLD_SIZE")
            .ok()
            .and_then(|v| v.parse().ok());
        #[cfg(not(feature = "mpi"))]
        let mpi_size: Option<usize> = None;
        anyhow::ensure!(
            mpi_size.is_none() || ranks_flag.is_none(),
            "under mpirun the processes are the ranks: drop --ranks"
        );
        let l = Launcher {
            mpi_size,
            ranks_flag,
        };
        anyhow::ensure!(l.ranks() >= 1, "--ranks 0: give at least one rank");
        Ok(l)
    }

    /// The world size before the configuration is read: mpirun's processes, else `--ranks`
    /// threads (default one process).
    fn ranks(&self) -> usize {
        self.mpi_size.or(self.ranks_flag).unwrap_or(1)
    }

    /// The job whose configuration `resolve(world size)` gives, on its process group.
    pub fn job(
        &self,
        resolve: impl Fn(usize) -> Result<(JobConfig, Option<PathBuf>)>,
    ) -> Result<Job> {
        let (mpi_size, ranks) = (self.mpi_size, self.ranks());
        // Processes started by a launcher without MPI (srun, torchrun-style) are the ranks of a
        // CUDA job (one per GPU, over NCCL): fit the mesh to their number. Other jobs keep
        // --ranks (a CPU job under srun is one process's, as before).
        let launch_world = (mpi_size.is_none() && self.ranks_flag.is_none())
            .then(|| {
                ganymede_dist::rendezvous::LaunchEnv::from_env()
                    .ok()
                    .flatten()
            })
            .flatten()
            .map(|e| e.world_size)
            .filter(|&n| n > 1);
        let (cfg, ckpt, ranks) = match launch_world.map(|n| (n, resolve(n))) {
            Some((n, Ok((cfg, ckpt)))) if cfg.device.kind == DeviceKind::Cuda => (cfg, ckpt, n),
            _ => {
                let (cfg, ckpt) = resolve(ranks)?;
                (cfg, ckpt, ranks)
            }
        };
        // CUDA on several processes is NCCL's; the launcher's variables say how many.
        let launch = if cfg.device.kind == DeviceKind::Cuda {
            ganymede_dist::rendezvous::LaunchEnv::from_env()?
        } else {
            None
        };
        let comm = ganymede_train::comm::choose(
            cfg.device.kind,
            mpi_size,
            launch.as_ref(),
            self.ranks_flag,
        )?;
        if cfg.device.kind == DeviceKind::Cuda {
            if let Some(e) = cuda_training_refusal(matches!(comm, Comm::Nccl(_))) {
                return Err(e);
            }
        }
        Ok(Job {
            cfg,
            ckpt,
            ranks,
            comm,
        })
    }
}

/// Train `job` on its launch path: NCCL processes, MPI processes, or threads of this process.
pub fn train(job: Job, opts: &TrainOptions) -> Result<TrainSummary> {
    let (cfg, ckpt) = (&job.cfg, job.ckpt.as_deref());
    match job.comm {
        #[cfg(feature = "cuda")]
        Comm::Nccl(boot) => trainer::train_nccl(cfg, ckpt, opts, boot),
        #[cfg(feature = "mpi")]
        Comm::Mpi => trainer::train_mpi(cfg, ckpt, opts, backends(cfg)),
        _ => trainer::train_on(cfg, ckpt, opts, backends(cfg)),
    }
}

/// How each rank of this process gets its backend for `cfg.device` (an NCCL job's ranks get
/// theirs from the NCCL launch, which also gives the group its GPU).
fn backends(cfg: &JobConfig) -> MakeBackend {
    #[cfg(feature = "cuda")]
    if cfg.device.kind == DeviceKind::Cuda {
        use std::sync::Arc;
        // `LOCAL_RANK`'s GPU under a launcher that starts one process per GPU, else GPU 0
        // (thread ranks share it).
        let ordinal = std::env::var("LOCAL_RANK")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or(0);
        return Arc::new(move || {
            let ledger = Arc::new(ganymede_core::Ledger::new());
            let be = ganymede_cuda::device::kernel_backend(ordinal, ledger)
                .map_err(|e| anyhow::anyhow!("device.kind = \"cuda\": {e}"))?;
            Ok(Arc::new(be) as Arc<dyn ganymede_core::Backend>)
        });
    }
    trainer::cpu_backends(cfg)
}

/// Why `train` with `device.kind = "cuda"` cannot run, as one line, before anything is built:
/// no CUDA in this binary, or none on this machine, or (`nccl`: several processes) no NCCL.
/// Never a silent run on the CPU instead.
fn cuda_training_refusal(nccl: bool) -> Option<anyhow::Error> {
    #[cfg(not(feature = "cuda"))]
    return {
        let _ = nccl;
        Some(anyhow::anyhow!(
            "device.kind = \"cuda\", but this binary was built without CUDA: build it with `{BUILD_WITH_CUDA}`"
        ))
    };
    #[cfg(feature = "cuda")]
    if nccl {
        // May start this program again with NCCL's folder on the loader's path (nothing has
        // been built yet, and MPI is not initialised).
        ganymede_dist::nccl_lib::prepare();
        if let Err(m) = ganymede_dist::nccl_lib::check() {
            return Some(anyhow::anyhow!(
                "device.kind = \"cuda\" on several processes needs NCCL: {m}"
            ));
        }
    }
    #[cfg(feature = "cuda")]
    ganymede_cuda::device::probe()
        .err()
        .map(|e| anyhow::anyhow!("device.kind = \"cuda\": {e}"))
}

//! Training as one process of a multi-GPU job over NCCL (`device.kind = "cuda"`, one process
//! per GPU under `srun`, `mpirun` or torchrun-style variables): rank 0 makes NCCL's unique id,
//! every rank gets it (over MPI, or rank 0's TCP store), joins the communicator on its local
//! rank's GPU, then trains as an MPI rank does. The GPU is set up here, once: the group's
//! backend, and beside it (on the same streams, so collectives are ordered against the
//! training's compute) the training state's, handed to the loop. A failing rank prints its error and ends
//! (aborting the MPI job when MPI is there); a stalled or failed collective aborts the
//! communicator within `parallelism.timeout_s` on the ranks that wait for it.
//!
//! Not yet run on GPUs.

use super::*;
use crate::comm::{local_rank_from, Bootstrap};
use ganymede_cuda::device::{kernel_backend_on, CudaBackend};
use ganymede_dist::nccl::{self, NcclGroup};
use ganymede_dist::RankCtx;

/// Train `cfg` as this process's rank of an NCCL job bootstrapped by `boot`.
pub fn train_nccl(
    cfg: &JobConfig,
    ckpt: Option<&Path>,
    opts: &TrainOptions,
    boot: Bootstrap,
) -> Result<TrainSummary> {
    let timeout = Duration::from_secs_f64(cfg.parallelism.timeout_s);
    let local = match &boot {
        Bootstrap::Store(env) => env.local_rank,
        Bootstrap::Mpi => local_rank_from(|k| std::env::var(k).ok()),
    };
    let zero = [0u8; nccl::UNIQUE_ID_BYTES];
    let (rank, n, id, mpi_world) = match &boot {
        Bootstrap::Store(env) => {
            let id = if env.rank == 0 {
                nccl::unique_id()?
            } else {
                zero
            };
            let got = ganymede_dist::rendezvous::exchange(env, &id, timeout)
                .context("NCCL rendezvous")?;
            (env.rank, env.world_size, got, None)
        }
        Bootstrap::Mpi => mpi_bootstrap(timeout)?,
    };
    let id: [u8; nccl::UNIQUE_ID_BYTES] = id
        .as_slice()
        .try_into()
        .map_err(|_| anyhow::anyhow!("NCCL rendezvous: {} bytes, not an NCCL id", id.len()))?;
    let cuda = |e| anyhow::anyhow!("device.kind = \"cuda\": {e}");
    let ledger = || Arc::new(ganymede_core::Ledger::new());
    let be = CudaBackend::new(local, ledger()).map_err(cuda)?;
    let world = NcclGroup::world(
        &be,
        &id,
        rank,
        n,
        RankCtx::new(rank, opts.trace.is_some()),
        timeout,
    )?;
    let run = process_run(cfg, ckpt, opts, rank, n, "with several processes")?;
    // The training state's backend: beside the group's, on its streams.
    let rank_be = || -> Result<Arc<dyn ganymede_core::Backend>> {
        Ok(Arc::new(
            kernel_backend_on(be.beside(ledger()).map_err(cuda)?).map_err(cuda)?,
        ))
    };
    let out = process_loop(world, rank_be, &run).unwrap_or_else(|failure| {
        eprintln!("error: {failure}; ending the job");
        #[cfg(feature = "mpi")]
        if let Some((_, g)) = &mpi_world {
            g.abort(1)
        }
        #[cfg(not(feature = "mpi"))]
        let _ = &mpi_world;
        std::process::exit(1)
    });
    process_summary(rank, out, run)
}

/// MPI's world, kept alive while training (and used to abort the job).
#[cfg(feature = "mpi")]
type MpiKeep = (
    ganymede_dist::mpi::MpiWorld,
    Arc<ganymede_dist::mpi::MpiGroup>,
);
#[cfg(not(feature = "mpi"))]
type MpiKeep = ();

/// Rank, world size and NCCL's id from rank 0, over MPI.
#[cfg(feature = "mpi")]
fn mpi_bootstrap(timeout: Duration) -> Result<(usize, usize, Vec<u8>, Option<MpiKeep>)> {
    let mcfg = ganymede_dist::mpi::MpiConfig {
        timeout,
        trace: false,
    };
    let (w, g) = ganymede_dist::mpi::init(&mcfg)?;
    let (rank, n) = (g.rank(), g.size());
    let id = if rank == 0 {
        nccl::unique_id().unwrap_or_else(|e| {
            eprintln!("error: rank 0: {e}; aborting the MPI job");
            g.abort(1)
        })
    } else {
        [0u8; nccl::UNIQUE_ID_BYTES]
    };
    let got = ganymede_dist::rendezvous::broadcast_bytes(&*g, &id)?;
    Ok((rank, n, got, Some((w, g))))
}

#[cfg(not(feature = "mpi"))]
fn mpi_bootstrap(_timeout: Duration) -> Result<(usize, usize, Vec<u8>, Option<MpiKeep>)> {
    bail!(
        "NCCL under mpirun needs a binary built with `--features cuda,mpi`; or launch with srun \
         or torchrun-style variables"
    )
}

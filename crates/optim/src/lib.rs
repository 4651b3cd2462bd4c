//! Optimizers of ganymede.
//!
//! - [`Optimizer`]: Muon (Nesterov momentum, Newton–Schulz orthogonalisation, RMS-matched scale,
//!   decoupled weight decay) for hidden weight matrices, each expert's matrix on its own; AdamW
//!   for embeddings, the LM head, the router and vectors; `optimizer.name = adamw` puts every
//!   trainable parameter on AdamW. Buffers are never updated. Weight decay (decoupled) applies to
//!   every matrix, embeddings and the LM head included; norm gains and other vectors get none.
//!   Checkpoint state: `<param>.muon_momentum`, `<param>.adam_m`, `<param>.adam_v` and the step
//!   count.
//! - [`Step::update`]: the one update rule, one parameter at a time, that both [`Optimizer`]
//!   (whole parameters) and the sharded optimizer (`ganymede_parallel::optim`) iterate, with
//!   state resident or staged from host memory ([`StateView`]); each optimizer only chooses what
//!   to iterate and how Muon's whole matrices meet for Newton–Schulz.
//! - [`newton_schulz`]: the orthogonalisation alone, GEMMs on the backend.
//! - [`lr_at`]: warmup then constant, cosine or warmup-stable-decay.
//! - [`clip_grad_norm`]: global gradient-norm clipping.
//!
//! All arithmetic goes through the backend ([`ganymede_core::Blas`] for GEMMs,
//! [`ganymede_core::OptimOps`] for the fused elementwise updates), so a device backend runs the
//! whole step where the parameters live.

mod clip;
mod ns;
mod ns_timing;
mod offload;
mod optimizer;
mod schedule;
mod state;
mod update;

pub use clip::{clip_coef, clip_grad_norm, global_norm};
pub use ns::{
    minimax_quintic, newton_schulz, newton_schulz_batch, newton_schulz_strided, ns_bf16, ns_flops,
    ns_lanes, ns_shifted, ns_shifted_of, polar_express, NsScratch, NsSteps, Quintic, NS_COEFFS,
    NS_EPS, POLAR_EXPRESS_LOW,
};
pub use ns_timing::{ns_timings, ns_timings_markdown, NsTiming};
pub use offload::{SkipWait, Staging};
pub use optimizer::{muon_scale, update_rule, Optimizer, UpdateRule, PAR_MATRIX_MAX_FLOPS};
pub use schedule::lr_at;
pub use state::{indexed_state_mut, stream_states, ParamState};
pub use update::{Grad, MuonParam, RateBuffer, StateView, Step, UpdateOf};

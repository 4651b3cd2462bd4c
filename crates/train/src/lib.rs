//! The training side of ganymede:
//! - [`trainer`]: the training loop (one process, ranks as threads, MPI), the run directory
//!   and `--resume`;
//! - [`checkpoint`]: safetensors checkpoints with a manifest, written atomically;
//! - [`metrics`]: `metrics.jsonl`, expert-load statistics, progress, the memory report;
//! - [`tensorboard`]: TensorBoard event files of the metrics' scalars;
//! - [`eval`]: loading a checkpoint, windowed cross-entropy, sampling;
//! - [`export`]: the Hugging Face Qwen3 / Qwen3-MoE export (sharded, tensor by tensor);
//! - [`hf_import`]: starting a run from a Hugging Face Qwen3 / Qwen3-MoE folder;
//! - [`st_file`]: safetensors files read by range and written tensor by tensor;
//! - [`guard`]: the run directory's writer lock, and the no-overwrite checks of outputs;
//! - [`stop`]: graceful stop on SIGINT, SIGTERM or a chosen signal.

/// Checkpoints live in their own crate (the parallel crate saves and loads a rank's state too).
pub use ganymede_checkpoint as checkpoint;
pub mod comm;
pub mod eval;
pub mod export;
pub mod guard;
pub mod hf_import;
pub mod metrics;
pub mod scratch;
pub mod st_file;
pub mod stop;
pub mod tensorboard;
pub mod trainer;

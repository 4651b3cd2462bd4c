//! The training side of ganymede:
//! - [`trainer`]: the step loop, the run directory and `--resume`;
//! - [`checkpoint`]: safetensors checkpoints with a manifest, written atomically;
//! - [`metrics`]: `metrics.jsonl`, expert-load statistics, progress, the memory report;
//! - [`tensorboard`]: TensorBoard event files of the metrics' scalars;
//! - [`eval`]: loading a checkpoint, windowed cross-entropy, sampling;
//! - [`export`]: the Hugging Face Qwen3-MoE export.

pub mod checkpoint;
pub mod eval;
pub mod export;
pub mod metrics;
pub mod tensorboard;
pub mod trainer;

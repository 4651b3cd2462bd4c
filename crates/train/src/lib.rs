//! The training side of ganymede: the step loop ([`train`]), run directories and metrics,
//! checkpoints with bit-identical resume ([`checkpoint`]), windowed evaluation ([`eval`]) and the
//! Hugging Face Qwen3-MoE export ([`export`]).

pub mod checkpoint;

//! Autoregressive sampling with a KV cache.

use crate::Model;
use ganymede_core::{Backend, ParamStore};

/// Autoregressive sampling with a KV cache (temperature, top-k; temperature 0 = greedy);
/// returns the generated ids (not the prompt).
#[allow(clippy::too_many_arguments)]
pub fn generate(
    be: &dyn Backend,
    model: &Model,
    params: &ParamStore,
    prompt: &[u32],
    max_new_tokens: usize,
    temperature: f32,
    top_k: usize,
    seed: u64,
) -> Vec<u32> {
    let _ = (
        be,
        model,
        params,
        prompt,
        max_new_tokens,
        temperature,
        top_k,
        seed,
    );
    todo!()
}

//! The start-up check that every rank runs the same configuration.

use crate::error::{CommError, Result};
use crate::group::ProcessGroup;
use crate::stats::Phase;
use ganymede_core::{View, ViewMut};

/// The seam's content hash (the CUDA backend's kernel cache uses it too).
pub use ganymede_core::fnv1a64;

/// Hash of any serialisable configuration (its JSON form).
pub fn config_hash<C: serde::Serialize>(cfg: &C) -> u64 {
    fnv1a64(&serde_json::to_vec(cfg).expect("config serialises"))
}

/// Collective: all-gather every rank's hash and fail on any rank that differs from rank 0
/// (the lowest such rank is named). Returns the agreed hash.
pub fn check_config_hash(pg: &dyn ProcessGroup, hash: u64) -> Result<u64> {
    // Four 16-bit pieces, exact in f32.
    let mine: Vec<f32> = (0..4)
        .map(|i| ((hash >> (16 * i)) & 0xffff) as f32)
        .collect();
    let mut all = vec![0f32; 4 * pg.size()];
    pg.all_gather(View::Host(&mine), ViewMut::Host(&mut all), Phase::Other)?;
    let hashes: Vec<u64> = all
        .chunks(4)
        .map(|c| {
            c.iter()
                .enumerate()
                .fold(0u64, |h, (i, &x)| h | ((x as u64) << (16 * i)))
        })
        .collect();
    if let Some(j) = (1..hashes.len()).find(|&j| hashes[j] != hashes[0]) {
        return Err(CommError::ConfigMismatch {
            rank: pg.world_ranks()[j],
            hash: hashes[j],
            expected: hashes[0],
        });
    }
    Ok(hashes[0])
}

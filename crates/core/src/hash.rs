//! A content hash for keys that must agree across processes, builds and machines.

/// FNV-1a, 64 bit: stable across processes, builds and machines (std's hasher is not promised
/// to be).
pub fn fnv1a64(bytes: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &b in bytes {
        h ^= b as u64;
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

//! Small deterministic random numbers: SplitMix64 for streams and a keyed hash for stateless
//! draws (a batch at step `s` must depend only on `(seed, s)`, never on what was drawn before).

/// SplitMix64 (Steele, Lea, Flood 2014): tiny, fast, and good enough for sampling text and
/// offsets. Written out here so the corpus is identical whatever crate versions resolve.
#[derive(Clone, Debug)]
pub struct SplitMix64(u64);

impl SplitMix64 {
    pub fn new(seed: u64) -> Self {
        Self(seed)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        mix(self.0)
    }

    /// Uniform in [0, 1) with 53 random bits.
    pub fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }
}

/// SplitMix64's finaliser: a bijective avalanche mix of 64 bits.
pub fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// A random 64-bit value that depends only on its three keys.
pub fn keyed(seed: u64, a: u64, b: u64) -> u64 {
    let h = mix(seed ^ 0x6761_6E79_6D65_6465); // "ganymede"
    let h = mix(h.wrapping_add(a).wrapping_add(0x9E37_79B9_7F4A_7C15));
    mix(h.wrapping_add(b).wrapping_add(0xD1B5_4A32_D192_ED03))
}

/// Map a uniform 64-bit value to `0..n` (Lemire's multiply-shift; the bias is below n / 2^64).
pub fn below(x: u64, n: u64) -> u64 {
    ((x as u128 * n as u128) >> 64) as u64
}

//! Seeded sample inputs for tests, benchmarks and device checks, and the median of measured
//! samples.
//!
//! The generator is Knuth's MMIX linear congruential generator (multiplier
//! 6364136223846793005, increment 1442695040888963407) started from the seed times the
//! golden-ratio constant (made odd), so nearby seeds give unrelated streams. It is for inputs that
//! must be the same on every run and machine, not for statistics: each value takes the state's
//! high bits, whose period is long enough for that.

/// A seeded stream of values; [`values`] and [`tokens`] are its one-call forms.
#[derive(Clone, Debug)]
pub struct Lcg(u64);

impl Lcg {
    pub fn new(seed: u64) -> Self {
        Lcg(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1)
    }

    /// The next state.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        self.0
    }

    /// Uniform in [-1, 1): the state's top 24 bits, so a multiple of 2⁻²³, exact in f32.
    pub fn uniform(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }

    /// `n` values of [`Lcg::uniform`] times `scale`: uniform in [-scale, scale).
    pub fn values(&mut self, n: usize, scale: f32) -> Vec<f32> {
        (0..n).map(|_| self.uniform() * scale).collect()
    }

    /// An integer in `0..n` (`n` > 0), from the state's top 31 bits.
    pub fn below(&mut self, n: usize) -> u32 {
        assert!(n > 0, "Lcg::below(0)");
        ((self.next_u64() >> 33) % n as u64) as u32
    }
}

/// `n` values uniform in [-1, 1) from `seed` (scale them at the call for another range).
pub fn values(n: usize, seed: u64) -> Vec<f32> {
    Lcg::new(seed).values(n, 1.0)
}

/// `n` token ids in `0..vocab` from `seed`.
pub fn tokens(n: usize, vocab: usize, seed: u64) -> Vec<u32> {
    let mut g = Lcg::new(seed);
    (0..n).map(|_| g.below(vocab)).collect()
}

/// The median of `v` (the mean of the middle two for an even count); `None` for none. Values
/// are ordered by [`f64::total_cmp`]: a NaN counts as above every number (below, if its sign
/// bit is set), so a NaN among many timings moves the median by one place instead of poisoning
/// it. Medians, not means, for timings: a shared machine has the odd slow repetition.
pub fn median(v: &[f64]) -> Option<f64> {
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    let n = s.len();
    match n {
        0 => None,
        _ if n % 2 == 1 => Some(s[n / 2]),
        _ => Some((s[n / 2 - 1] + s[n / 2]) / 2.0),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn median_of_odd_even_unsorted_and_empty() {
        assert_eq!(median(&[3.0, 1.0, 2.0]), Some(2.0));
        assert_eq!(median(&[4.0, 1.0, 3.0, 2.0]), Some(2.5));
        assert_eq!(median(&[5.0, 100.0, 4.0, 6.0, 5.5]), Some(5.5));
        assert_eq!(median(&[7.0]), Some(7.0));
        assert_eq!(median(&[]), None);
        // A NaN sorts last: the median of [1, 2, NaN] is 2.
        assert_eq!(median(&[f64::NAN, 2.0, 1.0]), Some(2.0));
    }

    #[test]
    fn values_are_deterministic_per_seed_and_differ_across_seeds() {
        assert_eq!(values(1000, 7), values(1000, 7));
        assert_ne!(values(1000, 7), values(1000, 8));
        assert_ne!(values(1000, 0), values(1000, 1));
        // A longer run starts with the shorter one.
        assert_eq!(values(10, 3)[..], values(20, 3)[..10]);
        assert_eq!(tokens(100, 50, 4), tokens(100, 50, 4));
        assert_ne!(tokens(100, 50, 4), tokens(100, 50, 5));
    }

    #[test]
    fn values_are_in_range_and_centred() {
        let n = 100_000;
        let v = values(n, 11);
        assert!(v.iter().all(|x| (-1.0..1.0).contains(x)));
        let mean = v.iter().map(|&x| x as f64).sum::<f64>() / n as f64;
        // Uniform on [-1, 1): variance 1/3, so the mean's standard deviation is about 0.0018.
        assert!(mean.abs() < 0.01, "mean {mean}");
        let (lo, hi) = v
            .iter()
            .fold((1f32, -1f32), |(l, h), &x| (l.min(x), h.max(x)));
        assert!(lo < -0.999 && hi > 0.999, "range [{lo}, {hi}]");
        let s = Lcg::new(11).values(1000, 0.25);
        assert!(s.iter().all(|x| (-0.25..0.25).contains(x)));
        let t = tokens(10_000, 13, 2);
        assert!(t.iter().all(|&x| x < 13));
        assert!((0..13).all(|k| t.contains(&k)));
    }
}

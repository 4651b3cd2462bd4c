//! bfloat16 conversions. bf16 is the top half of an f32's bits; converting rounds the dropped
//! half to nearest, ties to even (as CUDA's `__float2bfloat16_rn` and PyTorch do), so host and
//! device agree bit for bit.

/// f32 to bf16 bits, rounding to nearest even. NaN stays NaN (quieted, sign kept); values past
/// the largest bf16 round to infinity.
pub fn from_f32(x: f32) -> u16 {
    let b = x.to_bits();
    if x.is_nan() {
        // Truncation alone could clear every mantissa bit of a NaN and leave an infinity.
        return ((b >> 16) | 0x0040) as u16;
    }
    // Adding 0x7fff rounds up past the halfway point; the extra 1 when the kept part is odd
    // makes an exact tie round up only to an even result.
    let bias = 0x7fff + ((b >> 16) & 1);
    (b.wrapping_add(bias) >> 16) as u16
}

/// bf16 bits to f32 (exact).
pub fn to_f32(h: u16) -> f32 {
    f32::from_bits((h as u32) << 16)
}

/// Convert a slice (see [`from_f32`]).
pub fn from_f32_slice(data: &[f32]) -> Vec<u16> {
    data.iter().map(|&x| from_f32(x)).collect()
}

/// Convert a slice (see [`to_f32`]).
pub fn to_f32_slice(data: &[u16]) -> Vec<f32> {
    data.iter().map(|&h| to_f32(h)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bf16_known_bit_patterns() {
        let cases: &[(u32, u16)] = &[
            (0x3f80_0000, 0x3f80), // 1.0
            (0x3f80_7fff, 0x3f80), // just below half: down
            (0x3f80_8000, 0x3f80), // tie, kept part even: stays
            (0x3f80_8001, 0x3f81), // just above half: up
            (0x3f81_8000, 0x3f82), // tie, kept part odd: up to even
            (0x3dcc_cccd, 0x3dcd), // 0.1
            (0x4049_0fdb, 0x4049), // pi
            (0xc049_0fdb, 0xc049), // -pi
            (0x8000_0000, 0x8000), // -0.0
            (0x7f80_0000, 0x7f80), // inf
            (0xff80_0000, 0xff80), // -inf
            (0x7f7f_ffff, 0x7f80), // f32::MAX rounds to inf
            (0x7f7f_0000, 0x7f7f), // largest bf16 is exact
            (0x0001_0000, 0x0001), // subnormal, exact
            (0x0000_8000, 0x0000), // subnormal tie to even (zero)
            (0x0001_8000, 0x0002), // subnormal tie to even (up)
            (0x7fc0_0000, 0x7fc0), // quiet NaN
            (0x7f80_0001, 0x7fc0), // signalling NaN whose payload truncation would lose
            (0xff80_0001, 0xffc0), // negative NaN keeps its sign
        ];
        for &(f, h) in cases {
            let got = from_f32(f32::from_bits(f));
            assert_eq!(got, h, "{f:#010x} -> {got:#06x}, want {h:#06x}");
        }
        // Back to f32 is exact, and every non-NaN bf16 survives a round trip.
        assert_eq!(to_f32(0x3f81).to_bits(), 0x3f81_0000);
        for h in 0..=u16::MAX {
            let x = to_f32(h);
            if !x.is_nan() {
                assert_eq!(from_f32(x), h);
            }
        }
    }

    #[test]
    fn bf16_rounding_matches_f64_nearest() {
        // Against an independent rule: pick the nearer of the two neighbouring bf16 values in
        // f64 arithmetic, ties to the even one.
        let mut x = 0x1234_5678u32;
        for _ in 0..100_000 {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            let f = f32::from_bits(x & 0x7f7f_ffff); // finite and positive
            let lo = (f.to_bits() >> 16) as u16;
            // Above the largest bf16 the next step is 2^128, which rounds to infinity.
            let up = to_f32(lo + 1) as f64;
            let (a, b) = (
                to_f32(lo) as f64,
                if up.is_finite() { up } else { 2f64.powi(128) },
            );
            let d = (f as f64 - a) - (b - f as f64);
            let want = if d < 0.0 || (d == 0.0 && lo.is_multiple_of(2)) {
                lo
            } else {
                lo + 1
            };
            assert_eq!(from_f32(f), want, "{:#010x}", f.to_bits());
        }
    }

    #[test]
    fn round_trips_round_to_nearest_even() {
        assert_eq!(to_f32(from_f32(1.0)), 1.0);
        assert_eq!(to_f32(from_f32(-2.5)), -2.5);
        // 1 + 2^-8 is halfway between 1 and 1 + 2^-7: ties to even (1.0).
        assert_eq!(to_f32(from_f32(1.0 + 1.0 / 256.0)), 1.0);
        assert_eq!(to_f32(from_f32(1.0 + 3.0 / 256.0)), 1.0 + 4.0 / 256.0);
        assert!(to_f32(from_f32(f32::NAN)).is_nan());
        let x = 0.1f32;
        assert!((to_f32(from_f32(x)) - x).abs() <= x / 256.0);
    }
}

//! SplitMix64: the deterministic generator of every workload, trace expansion and simulation
//! tie-break; tiny, portable, and stable across crate versions (unlike `StdRng`).

/// The generator.
#[derive(Debug, Clone)]
pub struct SplitMix64(u64);

impl SplitMix64 {
    /// A generator seeded with `seed`.
    pub fn new(seed: u64) -> Self {
        Self(seed)
    }

    /// A generator for a named sub-stream of `seed` (independent of call order elsewhere).
    pub fn derive(seed: u64, stream: &str, index: u64) -> Self {
        let mut h = seed ^ 0x5851_F42D_4C95_7F2D;
        for b in stream.bytes() {
            h = splitmix64(h ^ u64::from(b));
        }
        Self(splitmix64(h ^ index.wrapping_mul(0x9E37_79B9_7F4A_7C15)))
    }

    /// Next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform float in `[0, 1)` (53 bits).
    pub fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Uniform integer in `lo..=hi`.
    pub fn range(&mut self, lo: usize, hi: usize) -> usize {
        debug_assert!(lo <= hi);
        lo + (self.next_u64() % (hi - lo + 1) as u64) as usize
    }
}

fn splitmix64(x: u64) -> u64 {
    SplitMix64::new(x).next_u64()
}

/// `rand` adapter: the simulation's picker tie-breaks draw from this stream.
impl rand::RngCore for SplitMix64 {
    fn next_u32(&mut self) -> u32 {
        (self.next_u64() >> 32) as u32
    }

    fn next_u64(&mut self) -> u64 {
        SplitMix64::next_u64(self)
    }

    fn fill_bytes(&mut self, dst: &mut [u8]) {
        for chunk in dst.chunks_mut(8) {
            let b = SplitMix64::next_u64(self).to_le_bytes();
            chunk.copy_from_slice(&b[..chunk.len()]);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn splitmix_matches_reference_value() {
        // workloads.md §2.1: splitmix64(0) = 16294208416658607535.
        assert_eq!(splitmix64(0), 16_294_208_416_658_607_535);
    }
}

//! A small seeded generator (xorshift64*) for the tests that draw many inputs: the same
//! sequence on every run and every machine, so a failure names an input that can be drawn
//! again.

// Each test binary uses the part it needs.
#![allow(dead_code)]

/// xorshift64*: small, fast, and the same sequence everywhere. Seed it with a non-zero
/// value.
pub(crate) struct Rng(pub(crate) u64);

impl Rng {
    pub(crate) fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    /// A number below `n`.
    pub(crate) fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }

    /// A number below `n`, as a `u64`.
    pub(crate) fn below_u64(&mut self, n: u64) -> u64 {
        self.next() % n
    }

    /// True once in `one_in` draws.
    pub(crate) fn chance(&mut self, one_in: usize) -> bool {
        self.below(one_in) == 0
    }

    /// True in `percent` of the draws.
    pub(crate) fn percent(&mut self, percent: u64) -> bool {
        self.next() % 100 < percent
    }

    pub(crate) fn pick<T: Copy>(&mut self, items: &[T]) -> T {
        items[self.below(items.len())]
    }

    pub(crate) fn byte(&mut self) -> u8 {
        self.next() as u8
    }
}

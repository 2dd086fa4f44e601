//! Hashing key values: SipHash-1-3 with a 128-bit output, keyed at random per limiter,
//! and the hashes of typed key values; a band's bucket identity folded from them.

use super::*;

/// The hashes of key values known by their typed value ([`TypedKey`]), under a key of their
/// own, random per limiter: the text of such a key is never hashed, and no typed value
/// shares a hash with a text but by the chance of two random 128-bit values meeting.
pub(super) struct TypedHashes {
    pub(super) key: (u64, u64),
    pub(super) global: KeyHash,
    pub(super) no_ip: KeyHash,
}

/// The first byte of the message hashed for each typed value, so that none meets another.
pub(super) const TYPED_GLOBAL: u8 = 1;
pub(super) const TYPED_NO_IP: u8 = 2;
pub(super) const TYPED_IPV6: u8 = 3;

impl TypedHashes {
    pub(super) fn new(key: (u64, u64)) -> Self {
        let hash = |message: &[u8]| {
            let (low, high) = siphash128::<1, 3>(key, message);
            KeyHash { low, high }
        };
        Self {
            global: hash(&[TYPED_GLOBAL]),
            no_ip: hash(&[TYPED_NO_IP]),
            key,
        }
    }

    pub(super) fn of(&self, typed: TypedKey) -> Option<KeyHash> {
        Some(match typed {
            TypedKey::Text => return None,
            TypedKey::Global => self.global,
            TypedKey::NoIp => self.no_ip,
            TypedKey::Ipv4(address) => self.ipv4(address),
            TypedKey::Ipv6 { bits, prefix } => {
                let mut message = [0u8; 18];
                message[0] = TYPED_IPV6;
                message[1] = prefix;
                message[2..].copy_from_slice(&bits.to_be_bytes());
                let (low, high) = siphash128::<1, 3>(self.key, &message);
                KeyHash { low, high }
            }
        })
    }

    /// An IPv4 address's hash: its low 32 bits a keyed bijection of the address, so that
    /// two addresses never share a bucket (a band's identity keeps the low 57 bits of the
    /// low half, see [`KeyHash::band`]), and the other 96 spread by the keyed multiply-fold.
    #[inline]
    pub(super) fn ipv4(&self, address: u32) -> KeyHash {
        let (k0, k1) = self.key;
        // Each step is invertible on 32 bits: an xor, a multiplication by an odd number,
        // xor-shifts.
        let mut x = address ^ (k0 as u32);
        x = x.wrapping_mul((k1 as u32) | 1);
        x ^= x >> 16;
        x = x.wrapping_mul(0x7feb_352d);
        x ^= x >> 15;
        let a = u64::from(address);
        KeyHash {
            low: u64::from(x) | (fold(a ^ k1, MIX_P0) << 32),
            high: fold(a ^ k0, MIX_P1) ^ TYPED_V4_HIGH,
        }
    }
}

/// Mixed into the high half of every IPv4 address's hash.
pub(super) const TYPED_V4_HIGH: u64 = 0x5bd1_e995_0000_0004;

pub(super) const MIX_P0: u64 = 0xa076_1d64_78bd_642f;
pub(super) const MIX_P1: u64 = 0xe703_7ed1_a0b4_28db;

/// The multiply-fold step of the typed hashes and of [`KeyHash::band`].
pub(super) fn fold(a: u64, b: u64) -> u64 {
    let m = u128::from(a) * u128::from(b);
    (m as u64) ^ ((m >> 64) as u64)
}

/// One SipHash round.
pub(super) fn sip_round(v: &mut [u64; 4]) {
    v[0] = v[0].wrapping_add(v[1]);
    v[1] = v[1].rotate_left(13) ^ v[0];
    v[0] = v[0].rotate_left(32);
    v[2] = v[2].wrapping_add(v[3]);
    v[3] = v[3].rotate_left(16) ^ v[2];
    v[0] = v[0].wrapping_add(v[3]);
    v[3] = v[3].rotate_left(21) ^ v[0];
    v[2] = v[2].wrapping_add(v[1]);
    v[1] = v[1].rotate_left(17) ^ v[2];
    v[2] = v[2].rotate_left(32);
}

/// SipHash-`C`-`D` of `bytes` under the key `(k0, k1)`, its 128-bit output as two words
/// (the first eight bytes of the tag, then the last eight): a keyed pseudorandom function,
/// so that without the key no one can choose two inputs whose outputs meet.
pub(super) fn siphash128<const C: usize, const D: usize>((k0, k1): (u64, u64), bytes: &[u8]) -> (u64, u64) {
    let mut v = [
        k0 ^ 0x736f_6d65_7073_6575,
        k1 ^ 0x646f_7261_6e64_6f6d ^ 0xee,
        k0 ^ 0x6c79_6765_6e65_7261,
        k1 ^ 0x7465_6462_7974_6573,
    ];
    let mut compress = |m: u64| {
        v[3] ^= m;
        for _ in 0..C {
            sip_round(&mut v);
        }
        v[0] ^= m;
    };
    let mut words = bytes.chunks_exact(8);
    for word in &mut words {
        let mut m = [0u8; 8];
        m.copy_from_slice(word);
        compress(u64::from_le_bytes(m));
    }
    let mut last = [0u8; 8];
    last[..words.remainder().len()].copy_from_slice(words.remainder());
    last[7] = bytes.len() as u8; // the length modulo 256, as SipHash defines it
    compress(u64::from_le_bytes(last));
    let finish = |v: &mut [u64; 4]| {
        for _ in 0..D {
            sip_round(v);
        }
        v[0] ^ v[1] ^ v[2] ^ v[3]
    };
    v[2] ^= 0xee;
    let first = finish(&mut v);
    v[1] ^= 0xdd;
    let second = finish(&mut v);
    (first, second)
}

/// The hash of one key value (see [`MemoryLimiter::key_hash`]): SipHash-1-3 with a 128-bit
/// output, keyed at random per limiter, or the hash of a typed value ([`TypedHashes`]).
#[derive(Clone, Copy)]
pub(super) struct KeyHash {
    pub(super) low: u64,
    pub(super) high: u64,
}

impl KeyHash {
    /// A band's bucket identity, 128 bits: the key's keyed hash with the band's identity
    /// folded into its high half and into the top 7 bits of its low half. The hash is
    /// keyed at random per limiter, so a client cannot choose a key value whose hash meets
    /// another's; two buckets share state only if all 128 bits meet (two bands of one key
    /// differ in 71 bits folded from their identities).
    ///
    /// The low half is where the shard's table looks first (its low bits; the top 7 are
    /// the tag it compares): every band of a key starts at the same place, so a rule's
    /// bands sit next to each other, in one or two cache lines, instead of each at a random
    /// place that leaves the caches between two visits of the key.
    pub(super) fn band(&self, band: &Band) -> u128 {
        const TAG: u64 = !0 >> 7;
        let ident = band.ident();
        let low = (self.low & TAG) | (fold(self.low ^ ident, MIX_P0) & !TAG);
        let high = fold(self.high ^ ident, MIX_P1) ^ self.high;
        (u128::from(high) << 64) | u128::from(low)
    }
}

/// The map keys are already uniformly distributed hashes.
#[derive(Default)]
pub(super) struct PreHashed(pub(super) u64);

impl Hasher for PreHashed {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for b in bytes {
            self.0 = self.0.rotate_left(8) ^ u64::from(*b);
        }
    }
    fn write_u128(&mut self, n: u128) {
        self.0 = n as u64;
    }
}

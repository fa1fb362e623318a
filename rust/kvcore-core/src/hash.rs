//! Block hashes and prefix-cache keys.
//!
//! A [`BlockHash`] is the digest of one block's hash input (32 bytes for SHA-256, 16 bytes for
//! XXH3-128). A [`BlockKey`] pairs a hash with a KV-cache group id (SPEC KEY-1); its byte form is
//! `hash ‖ group_id as u32 big-endian`.

use std::fmt;
use std::hash::{Hash, Hasher};

/// Longest digest kvcore stores (SHA-256).
pub const MAX_HASH_LEN: usize = 32;

/// A block hash: up to 32 digest bytes, stored inline (no heap allocation).
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct BlockHash {
    len: u8,
    bytes: [u8; MAX_HASH_LEN],
}

impl BlockHash {
    /// Builds a hash from its digest bytes; `None` if longer than [`MAX_HASH_LEN`].
    pub fn from_slice(data: &[u8]) -> Option<Self> {
        if data.len() > MAX_HASH_LEN {
            return None;
        }
        let mut bytes = [0u8; MAX_HASH_LEN];
        bytes[..data.len()].copy_from_slice(data);
        Some(Self {
            len: data.len() as u8,
            bytes,
        })
    }

    /// The digest bytes.
    #[inline]
    pub fn as_bytes(&self) -> &[u8] {
        &self.bytes[..self.len as usize]
    }

    /// Number of digest bytes.
    #[inline]
    #[allow(clippy::len_without_is_empty)]
    pub fn len(&self) -> usize {
        self.len as usize
    }

    /// The digest as four little-endian words, zero-padded past its length (for mixing).
    #[inline]
    pub fn words(&self) -> [u64; 4] {
        let mut out = [0u64; 4];
        for (w, chunk) in out.iter_mut().zip(self.bytes.chunks_exact(8)) {
            let mut b = [0u8; 8];
            b.copy_from_slice(chunk);
            *w = u64::from_le_bytes(b);
        }
        out
    }

    /// The integer form used in KV events (SPEC EVT-2): the last 8 bytes read big-endian.
    pub fn event_int(&self) -> u64 {
        let b = self.as_bytes();
        let start = b.len().saturating_sub(8);
        b[start..]
            .iter()
            .fold(0u64, |acc, &x| (acc << 8) | u64::from(x))
    }
}

impl Hash for BlockHash {
    #[inline]
    fn hash<H: Hasher>(&self, state: &mut H) {
        // The digest is already uniformly distributed: feeding its tail word is enough.
        state.write_u64(self.event_int());
    }
}

impl fmt::Debug for BlockHash {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "BlockHash(")?;
        for b in self.as_bytes() {
            write!(f, "{b:02x}")?;
        }
        write!(f, ")")
    }
}

/// A prefix-cache key: a block hash and the KV-cache group it belongs to (SPEC KEY-1).
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub struct BlockKey {
    /// The block hash.
    pub hash: BlockHash,
    /// The KV-cache group id.
    pub group_id: u32,
}

impl BlockKey {
    /// Builds a key.
    pub fn new(hash: BlockHash, group_id: u32) -> Self {
        Self { hash, group_id }
    }

    /// The wire form: `hash ‖ group_id` (u32 big-endian).
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(self.hash.len() + 4);
        out.extend_from_slice(self.hash.as_bytes());
        out.extend_from_slice(&self.group_id.to_be_bytes());
        out
    }

    /// Parses the wire form; `None` when shorter than 5 bytes or longer than 36.
    pub fn from_bytes(data: &[u8]) -> Option<Self> {
        if data.len() < 5 {
            return None;
        }
        let (h, g) = data.split_at(data.len() - 4);
        let hash = BlockHash::from_slice(h)?;
        let group_id = u32::from_be_bytes([g[0], g[1], g[2], g[3]]);
        Some(Self { hash, group_id })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn key_round_trip() {
        let h = BlockHash::from_slice(&[7u8; 32]).unwrap();
        let k = BlockKey::new(h, 3);
        let b = k.to_bytes();
        assert_eq!(b.len(), 36);
        assert_eq!(&b[32..], &[0, 0, 0, 3]);
        assert_eq!(BlockKey::from_bytes(&b), Some(k));
    }

    #[test]
    fn event_int_reads_last_eight_bytes() {
        let mut d = [0u8; 16];
        d[15] = 1;
        d[8] = 0x80;
        let h = BlockHash::from_slice(&d).unwrap();
        assert_eq!(h.event_int(), 0x8000_0000_0000_0001);
    }
}

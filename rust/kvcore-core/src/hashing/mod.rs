//! Block hashing (SPEC §5), byte-identical to the reference implementation.
//!
//! A block's hash is the digest of the serialised triple `(parent, tokens, extra)` (SPEC
//! HASH-2): `parent` is the previous block's hash (or the process-wide `NONE_HASH` for the
//! first block), `tokens` the block's token ids as a tuple and `extra` either `None` or a tuple
//! of extra keys. Four functions are supported ([`HashFn`]): CPython pickle protocol 5
//! ([`pickle`]) or canonical CBOR ([`cbor`]), digested with SHA-256 or XXH3-128.
//!
//! ## Examples
//! ```
//! use kvcore_core::hashing::{BlockHasher, HashFn};
//! use kvcore_core::value::Value;
//! let f = HashFn::from_name("sha256_cbor").unwrap();
//! let none_hash = f.hash_value(&Value::Str("0".into())).unwrap();
//! let mut hasher = BlockHasher::new(f, none_hash.as_bytes());
//! let tokens: Vec<i64> = (1..=32).collect();
//! let hashes = hasher.hash_blocks(None, &tokens, 16, None).unwrap();
//! assert_eq!(hashes.len(), 2);
//! assert_eq!(hashes[1], hasher.hash_block(Some(hashes[0].as_bytes()), &tokens[16..], None).unwrap());
//! ```
//!
//! ## Implementation
//! The serialisers write into one reused buffer and never build an intermediate tree for the
//! token ids. Shapes CPython or cbor2 would encode differently from what is implemented here
//! (ints beyond 64 bits, payloads that need more than one pickle frame) are refused with
//! [`HashError::Unsupported`] so that the caller can fall back to the Python serialisers.

pub mod cbor;
pub mod pickle;

use std::fmt;

use sha2::{Digest, Sha256};
use xxhash_rust::xxh3::xxh3_128;

use crate::hash::BlockHash;
use crate::value::Value;

/// A block-hash function (SPEC §5.1).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum HashFn {
    /// Pickle protocol 5, SHA-256 (the default).
    Sha256,
    /// Canonical CBOR, SHA-256.
    Sha256Cbor,
    /// Pickle protocol 5, XXH3-128 (big-endian digest).
    Xxhash,
    /// Canonical CBOR, XXH3-128 (big-endian digest).
    XxhashCbor,
}

/// Why a hash could not be computed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HashError {
    /// The function name is not one of the four supported ones (Python: ValueError).
    UnknownFunction(String),
    /// The input has a shape whose exact serialisation is not reproduced natively; the caller
    /// should serialise it with the Python library instead.
    Unsupported(&'static str),
    /// The per-block extras do not match the number of blocks.
    ExtrasLength {
        /// Number of full blocks in the token slice.
        blocks: usize,
        /// Number of extras given.
        extras: usize,
    },
    /// A block size of zero.
    ZeroBlockSize,
}

impl fmt::Display for HashError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::UnknownFunction(name) => write!(f, "Unsupported hash function: {name}"),
            Self::Unsupported(what) => write!(f, "not serialisable natively: {what}"),
            Self::ExtrasLength { blocks, extras } => {
                write!(f, "{extras} extra keys given for {blocks} blocks")
            }
            Self::ZeroBlockSize => write!(f, "block size must be positive"),
        }
    }
}

impl std::error::Error for HashError {}

impl HashFn {
    /// Every function, in the order of SPEC §5.1.
    pub const ALL: [Self; 4] = [
        Self::Sha256,
        Self::Sha256Cbor,
        Self::Xxhash,
        Self::XxhashCbor,
    ];

    /// Looks a function up by its configuration name.
    ///
    /// # Errors
    /// [`HashError::UnknownFunction`] for any other name.
    pub fn from_name(name: &str) -> Result<Self, HashError> {
        match name {
            "sha256" => Ok(Self::Sha256),
            "sha256_cbor" => Ok(Self::Sha256Cbor),
            "xxhash" => Ok(Self::Xxhash),
            "xxhash_cbor" => Ok(Self::XxhashCbor),
            _ => Err(HashError::UnknownFunction(name.to_owned())),
        }
    }

    /// The configuration name.
    pub fn name(self) -> &'static str {
        match self {
            Self::Sha256 => "sha256",
            Self::Sha256Cbor => "sha256_cbor",
            Self::Xxhash => "xxhash",
            Self::XxhashCbor => "xxhash_cbor",
        }
    }

    /// Whether the function serialises with CBOR (otherwise pickle).
    pub fn is_cbor(self) -> bool {
        matches!(self, Self::Sha256Cbor | Self::XxhashCbor)
    }

    /// Digest length in bytes: 32 for SHA-256, 16 for XXH3-128.
    pub fn digest_len(self) -> usize {
        match self {
            Self::Sha256 | Self::Sha256Cbor => 32,
            Self::Xxhash | Self::XxhashCbor => 16,
        }
    }

    /// Digests already serialised bytes (SPEC HASH-1 for the XXH3 byte order).
    pub fn digest(self, data: &[u8]) -> BlockHash {
        let hash = match self {
            Self::Sha256 | Self::Sha256Cbor => BlockHash::from_slice(&Sha256::digest(data)),
            Self::Xxhash | Self::XxhashCbor => BlockHash::from_slice(&xxh3_128(data).to_be_bytes()),
        };
        // Both digests are at most 32 bytes, the capacity of BlockHash.
        hash.unwrap_or_else(|| unreachable!("digest longer than 32 bytes"))
    }

    /// Serialises any [`Value`] the way the function does (pickle protocol 5 or canonical
    /// CBOR) into `out`, which is cleared first.
    ///
    /// # Errors
    /// [`HashError::Unsupported`] for a pickle that would need more than one frame.
    pub fn serialize_value(self, value: &Value, out: &mut Vec<u8>) -> Result<(), HashError> {
        if self.is_cbor() {
            out.clear();
            cbor::write_value(out, value);
            Ok(())
        } else {
            pickle::begin(out);
            pickle::write_value(out, value)?;
            pickle::end(out)
        }
    }

    /// Serialises and digests any [`Value`].
    ///
    /// # Errors
    /// As [`HashFn::serialize_value`].
    pub fn hash_value(self, value: &Value) -> Result<BlockHash, HashError> {
        let mut buf = Vec::with_capacity(64);
        self.serialize_value(value, &mut buf)?;
        Ok(self.digest(&buf))
    }

    /// Serialises the block triple `(parent, tuple(tokens), extra)` (SPEC HASH-2) into `out`,
    /// which is cleared first. `extra` is `None` or the items of the extra-keys tuple.
    ///
    /// # Errors
    /// [`HashError::Unsupported`] for a pickle that would need more than one frame.
    pub fn serialize_block(
        self,
        parent: &[u8],
        tokens: &[i64],
        extra: Option<&[Value]>,
        out: &mut Vec<u8>,
    ) -> Result<(), HashError> {
        if self.is_cbor() {
            out.clear();
            out.push(0x83);
            cbor::write_bytes(out, parent);
            cbor::write_int_array(out, tokens);
            match extra {
                None => out.push(0xf6),
                Some(items) => {
                    cbor::write_head(out, 4, items.len() as u64);
                    for item in items {
                        cbor::write_value(out, item);
                    }
                }
            }
            Ok(())
        } else {
            pickle::begin(out);
            pickle::write_bytes(out, parent)?;
            pickle::write_int_tuple(out, tokens);
            match extra {
                None => pickle::write_value(out, &Value::None)?,
                Some(items) => pickle::write_tuple(out, items)?,
            }
            out.extend_from_slice(&[0x87, 0x94]);
            pickle::end(out)
        }
    }
}

/// SPEC RH-1: the token range `[start, end)` of a request's full hash windows after the first
/// `done` (those it has hashes for), or `None` when no new window is full.
pub fn new_full_windows(
    done: usize,
    num_tokens: usize,
    hash_block_size: usize,
) -> Option<(usize, usize)> {
    let start = done.checked_mul(hash_block_size)?;
    (start.checked_add(hash_block_size)? <= num_tokens).then(|| {
        (
            start,
            start + (num_tokens - start) / hash_block_size * hash_block_size,
        )
    })
}

/// Hashes blocks with one function and one `NONE_HASH`, reusing a serialisation buffer.
#[derive(Debug, Clone)]
pub struct BlockHasher {
    hash_fn: HashFn,
    none_hash: Vec<u8>,
    buf: Vec<u8>,
}

impl BlockHasher {
    /// A hasher for `hash_fn` whose first block chains from `none_hash` (SPEC HASH-10).
    pub fn new(hash_fn: HashFn, none_hash: &[u8]) -> Self {
        Self {
            hash_fn,
            none_hash: none_hash.to_vec(),
            buf: Vec::with_capacity(256),
        }
    }

    /// The function this hasher uses.
    pub fn hash_fn(&self) -> HashFn {
        self.hash_fn
    }

    /// The hash of one block (SPEC HASH-11): a missing or empty `parent` means `NONE_HASH`.
    ///
    /// # Errors
    /// [`HashError::Unsupported`] for a pickle that would need more than one frame.
    pub fn hash_block(
        &mut self,
        parent: Option<&[u8]>,
        tokens: &[i64],
        extra: Option<&[Value]>,
    ) -> Result<BlockHash, HashError> {
        let parent = match parent {
            Some(p) if !p.is_empty() => p,
            _ => &self.none_hash,
        };
        self.hash_fn
            .serialize_block(parent, tokens, extra, &mut self.buf)?;
        Ok(self.hash_fn.digest(&self.buf))
    }

    /// Hashes every full `block_size` window of `tokens` as a chain starting from `parent`
    /// (SPEC RH-1); a trailing partial window is ignored. `extras`, when given, holds one
    /// entry per full window (`None` for a window without extra keys); windows may share one
    /// slice of keys.
    ///
    /// # Errors
    /// [`HashError::ZeroBlockSize`], [`HashError::ExtrasLength`] when `extras` has the wrong
    /// length, [`HashError::Unsupported`] as in [`BlockHasher::hash_block`].
    pub fn hash_blocks(
        &mut self,
        parent: Option<&[u8]>,
        tokens: &[i64],
        block_size: usize,
        extras: Option<&[Option<&[Value]>]>,
    ) -> Result<Vec<BlockHash>, HashError> {
        if block_size == 0 {
            return Err(HashError::ZeroBlockSize);
        }
        let n = tokens.len() / block_size;
        if let Some(e) = extras {
            if e.len() != n {
                return Err(HashError::ExtrasLength {
                    blocks: n,
                    extras: e.len(),
                });
            }
        }
        let mut out: Vec<BlockHash> = Vec::with_capacity(n);
        for (i, window) in tokens.chunks_exact(block_size).enumerate() {
            let extra = extras.and_then(|e| e[i]);
            let h = match out.last() {
                Some(prev) => {
                    let prev = *prev;
                    self.hash_block(Some(prev.as_bytes()), window, extra)?
                }
                None => self.hash_block(parent, window, extra)?,
            };
            out.push(h);
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests;

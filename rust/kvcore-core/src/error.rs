//! The core's one error type.

use std::fmt;

/// Every way a pool operation can be misused. Each maps onto a Python exception class in the
/// bindings (see `kvcore-py/src/errors.rs`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PoolError {
    /// `num_gpu_blocks` was not positive (SPEC POOL-1), or above 2^31 (block ids stay below
    /// `u32::MAX` with room for alias records).
    InvalidPoolSize(i64),
    /// A block id outside `0..num_blocks`.
    BlockOutOfRange {
        /// The id given.
        block_id: i64,
        /// The pool size.
        num_blocks: usize,
    },
    /// Asked for more blocks than are free (SPEC POOL-5).
    NotEnoughFreeBlocks {
        /// Blocks requested.
        requested: usize,
        /// Blocks free.
        free: usize,
    },
    /// A negative count (SPEC FQ-3: kvcore rejects what the reference mishandles).
    NegativeCount(i64),
    /// Freeing a non-null block whose reference count is already 0.
    DoubleFree(u32),
    /// Touching a block with reference count 0 that is not in the free queue (SPEC POOL-9).
    NotFreeNorReferenced(u32),
    /// A `block_mask` whose length differs from the number of new blocks (SPEC POOL-14).
    MaskLength {
        /// Expected length.
        expected: usize,
        /// Length given.
        got: usize,
    },
    /// The hash view is shorter than the number of full blocks (SPEC POOL-15).
    NotEnoughHashes {
        /// Hashes needed.
        needed: usize,
        /// Hashes available.
        available: usize,
    },
    /// `block_size` is not a multiple of `hash_block_size` (SPEC POOL-15, POOL-30, RH-3).
    BlockSizeNotMultiple {
        /// The block size.
        block_size: usize,
        /// The hash block size.
        hash_block_size: usize,
    },
    /// Caching a block whose existing primary key already covers as many tokens (SPEC POOL-16).
    NotAPromotion {
        /// The block.
        block_id: u32,
        /// Tokens covered by its current key.
        have: usize,
        /// Tokens the new key would cover.
        covered: usize,
    },
    /// A precondition of `cache_partial_block` failed (SPEC POOL-30).
    InvalidPartial(String),
    /// A hash longer than 32 bytes or otherwise malformed.
    InvalidHash(usize),
    /// A pin beyond the manager's bound on pinned blocks (kvcore extension).
    PinLimit {
        /// Blocks pinned now.
        pinned: usize,
        /// Blocks the call would newly pin.
        requested: usize,
        /// The bound.
        max: usize,
    },
    /// A call that breaks a manager invariant (SPEC COORD-5: hits for a running request).
    Invariant(String),
    /// A request holds fewer blocks than the call needs (the reference fails indexing them).
    MissingBlocks(String),
    /// Any other violated precondition.
    Invalid(String),
    /// An inconsistent configuration (block sizes, groups, specs).
    Config(String),
    /// An operation the configuration does not support (cross-attention lookups).
    Unsupported(String),
}

impl fmt::Display for PoolError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::InvalidPoolSize(n) => {
                write!(f, "num_gpu_blocks must be between 1 and 2**31, got {n}")
            }
            Self::BlockOutOfRange {
                block_id,
                num_blocks,
            } => write!(
                f,
                "block id {block_id} is out of range for a pool of {num_blocks} blocks"
            ),
            Self::NotEnoughFreeBlocks { requested, free } => {
                write!(f, "cannot get {requested} free blocks from the pool ({free} free)")
            }
            Self::NegativeCount(n) => write!(f, "count must be non-negative, got {n}"),
            Self::DoubleFree(b) => {
                write!(f, "block {b} has reference count 0 and cannot be freed again")
            }
            Self::NotFreeNorReferenced(b) => write!(
                f,
                "block {b} has reference count 0 but is not in the free queue"
            ),
            Self::MaskLength { expected, got } => {
                write!(f, "block_mask has length {got}, expected {expected}")
            }
            Self::NotEnoughHashes { needed, available } => write!(
                f,
                "request has {available} block hashes, {needed} needed to cache its full blocks"
            ),
            Self::BlockSizeNotMultiple {
                block_size,
                hash_block_size,
            } => write!(
                f,
                "block_size {block_size} is not a multiple of hash_block_size {hash_block_size}"
            ),
            Self::NotAPromotion {
                block_id,
                have,
                covered,
            } => write!(
                f,
                "block {block_id} is already cached for {have} tokens; caching it for {covered} is not a promotion"
            ),
            Self::InvalidPartial(msg) => write!(f, "invalid partial block: {msg}"),
            Self::InvalidHash(n) => write!(f, "block hash of {n} bytes is longer than 32 bytes"),
            Self::PinLimit {
                pinned,
                requested,
                max,
            } => write!(
                f,
                "pinning {requested} more blocks would exceed the bound of {max} pinned blocks \
                 ({pinned} pinned now); nothing was pinned"
            ),
            Self::Invalid(msg)
            | Self::Invariant(msg)
            | Self::MissingBlocks(msg)
            | Self::Config(msg)
            | Self::Unsupported(msg) => {
                f.write_str(msg)
            }
        }
    }
}

impl std::error::Error for PoolError {}

//! # kvcore-core
//!
//! The pure-Rust heart of kvcore: the KV-cache [`pool::BlockPool`] (free list in eviction
//! order, reference counts, the null block, the prefix-cache index, eviction, KV events) and
//! block hashing ([`hashing`]) byte-identical to the reference implementation.
//!
//! This crate knows nothing about Python, requests or attention types; the PyO3 bindings in
//! `kvcore-py` convert arguments and call into it.
//!
//! ## Examples
//! ```
//! use kvcore_core::pool::BlockPool;
//! let mut pool = BlockPool::new(8, true, 16, false).unwrap();
//! let blocks = pool.get_new_blocks(3).unwrap();
//! assert_eq!(blocks, vec![1, 2, 3]);
//! pool.free_blocks(&blocks).unwrap();
//! assert_eq!(pool.get_num_free_blocks(), 7);
//! ```
//!
//! ## Invariants
//! See [`pool::BlockPool::check_invariants`].

pub mod error;
pub mod events;
pub mod full_attention;
pub mod hash;
pub mod hashing;
pub mod huge;
pub mod msgpack;
pub mod pool;
pub mod prefetch;
pub mod value;

pub use error::PoolError;

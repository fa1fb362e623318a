//! # kvcore-core
//!
//! The pure-Rust heart of kvcore, with the behaviour specified in the repository's
//! `docs/behaviour.md` (cited as "SPEC" with its rule ids):
//!
//! - the KV-cache [`pool::BlockPool`]: free list in eviction order, reference counts, the null
//!   block, the prefix-cache index, eviction, KV events ([`events`]), the per-block scans of
//!   every attention type's hit search (full attention, sliding window, chunked local, Mamba),
//!   and cache control beyond LRU ([`pool::retention`]: retention priorities and times to live,
//!   pins, invalidation, router-exact events);
//! - block hashing ([`hashing`]): pickle and canonical CBOR written natively, SHA-256 and XXH3,
//!   byte-identical to the reference implementation; the msgpack event encoder ([`msgpack`]);
//! - the request-level manager of a model whose only KV-cache group is full attention
//!   ([`full_attention`]): per-request block tables, hit search, `allocate_slots`, caching and
//!   free, keyed by request id and driven by the token counts the caller passes.
//!
//! It has no Python dependency (no pyo3): `cargo test` alone tests it. The per-request state
//! of the other attention types (sliding window, chunked local, Mamba, cross-attention, sink)
//! and the hybrid coordinators are Python (`python/kvcore`), calling the pool. The PyO3
//! bindings in `kvcore-py` convert arguments and errors and also hold some glue of their own:
//! reading a Python request's fields, the request block hasher's window and parent handling, the
//! Python fallback for hash inputs the native encoders do not cover, and event conversion.
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

pub mod coordinator;
pub mod error;
pub mod events;
pub mod full_attention;
pub mod hash;
pub mod hashing;
pub mod huge;
pub mod msgpack;
pub mod pool;
pub mod single_type;
pub mod prefetch;
pub mod value;

pub use error::PoolError;

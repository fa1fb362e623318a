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
//! - the request-level manager of every KV-cache configuration: [`coordinator`] (the
//!   no-prefix-cache, unitary and hybrid coordinators' rules: hit search over all groups with
//!   the hybrid fixed point, caching lengths, `allocate_slots`, free), over one
//!   [`single_type::SingleTypeManager`] per group (full attention, RSWA, sink, sliding window,
//!   chunked local, Mamba in its three modes, cross-attention: each type's hit search, blocks to
//!   allocate, allocation, caching masks, skipping and freeing), whose per-request state is a
//!   [`tables::BlockTables`]; keyed by request id and driven by the token counts the caller
//!   passes.
//!
//! It has no Python dependency (no pyo3): `cargo test` alone tests it. The caller chooses the
//! configuration's policy (which coordinator, each group's type, which groups are looked up
//! together); the Python package (`python/kvcore`) does, from the reference's spec objects. The
//! PyO3 bindings in `kvcore-py` convert arguments, results and errors; they also read a Python
//! request's fields and fall back to Python serialisation for hash inputs the native encoders
//! do not cover.
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
pub mod hash;
pub mod hashing;
pub mod huge;
pub mod msgpack;
pub mod pool;
pub mod prefetch;
pub mod single_type;
pub mod tables;
pub mod value;

pub use error::PoolError;

//! PyO3 bindings of `kvcore-core`, compiled as the private module `kvcore._native`.
//!
//! The `#[pymethods]` bodies convert arguments, call the core and convert results, and
//! `errors.rs` is the one place core errors become Python exceptions. What is not plain
//! conversion: reading the fields of a Python request object (`request.rs` for kvcore's own,
//! `plain.rs` for any other, by attribute or from the instance dict of a registered plain class
//! such as vLLM's: a request is read before the core's state is held, so that its Python
//! attributes cannot re-enter a call), the choice between native and Python serialisation of
//! hash inputs (`hashing.rs`: an input the native encoders cannot reproduce byte-identically
//! goes to the Python hasher), the conversion of core events into Python event objects
//! (`events.rs`) and the msgpack walk over Python event objects (`msgpack.rs`). `sync.rs`
//! serialises calls from many threads on one pool or manager. The bindings never import the
//! Python package (`kvcore.hashing` registers the one Python function events need). The
//! module's whole Python surface is the declarative `#[pymodule]` below and its stub
//! `python/kvcore/_native.pyi`.

use pyo3::prelude::*;

/// The extension's Rust allocations (token buffers, block tables, hash copies) come from
/// mimalloc, with its segments on transparent huge pages: a step walks thousands of requests
/// whose buffers would otherwise sit on as many 4 KiB pages (TLB misses), and small buffers
/// are allocated and freed on every admission. Interleaved A/B in one process against the
/// system allocator: decode steps and admissions 4-10% faster.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// `mi_option_purge_delay` (the option's index in mimalloc 2's `mi_option_t`; the bindings
/// crate names no constant for it).
const MI_OPTION_PURGE_DELAY: libmimalloc_sys::mi_option_t = 15;

mod args;
mod blocks;
mod errors;
mod events;
mod hashing;
mod manager;
mod msgpack;
mod plain;
mod pool;
mod request;
mod sync;

/// The extension module.
#[pymodule]
mod _native {
    use pyo3::prelude::*;

    #[pymodule_export]
    use super::pool::{
        register_extra_keys_fn, BlockList, KVCacheBlockView, PyBlockPool, PyRetention,
    };

    #[pymodule_export]
    use super::manager::PyManagerCore;

    #[pymodule_export]
    use super::plain::PlainState;

    #[pymodule_export]
    use super::blocks::PyKVCacheBlocks;
    #[pymodule_export]
    use super::request::{append_output_token_ids_batch, PyRequestCore, PyTokenIds};

    #[pymodule_export]
    use super::events::{AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent};

    #[pymodule_export]
    use super::msgpack::encode_event_batch;
    #[pymodule_export]
    use super::msgpack::msgpack_encode;

    #[pymodule_export]
    use super::hashing::{
        digest, hash_block_tokens, hash_object, hash_request_blocks, PyRequestBlockHasher,
    };

    #[pymodule_init]
    fn init(m: &Bound<'_, PyModule>) -> PyResult<()> {
        #[allow(unsafe_code)]
        // SAFETY: `mi_option_set` only stores an option value (mimalloc reads options with
        // atomic loads); both options exist in the linked mimalloc and take these values.
        // Huge pages for new segments; freed memory goes back to the system at once (so that
        // a pool's temporary buffers do not stay resident).
        unsafe {
            libmimalloc_sys::mi_option_set(libmimalloc_sys::mi_option_large_os_pages, 1);
            libmimalloc_sys::mi_option_set(super::MI_OPTION_PURGE_DELAY, 0);
        }
        m.add("__version__", env!("CARGO_PKG_VERSION"))?;
        super::args::probe_ints(m.py())?;
        super::manager::install_allocate_slots(m.py())?;
        super::errors::register(m)
    }
}

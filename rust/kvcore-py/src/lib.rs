//! PyO3 bindings of `kvcore-core`, compiled as the private module `kvcore._native`.
//!
//! Every `#[pymethods]` body here converts arguments, calls the core and converts results; the
//! algorithms live in `kvcore-core`. The module's whole Python surface is the declarative
//! `#[pymodule]` below and its stub `python/kvcore/_native.pyi`.

use pyo3::prelude::*;

mod blocks;
mod errors;
mod events;
mod hashing;
mod manager;
mod msgpack;
mod pool;
mod request;

/// The extension module.
#[pymodule]
mod _native {
    use pyo3::prelude::*;

    #[pymodule_export]
    use super::pool::{BlockList, KVCacheBlockView, PyBlockPool};

    #[pymodule_export]
    use super::manager::PyUnitaryFullAttention;

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
        m.add("__version__", env!("CARGO_PKG_VERSION"))?;
        super::errors::register(m)
    }
}

//! KV cache events as the pool emits them (SPEC §6).
//!
//! These are the raw events: hashes are full digests and group ids are separate fields. The
//! bindings turn them into the reference's Python event classes (applying EVT-2's integer form)
//! and the manager fills in the spec kind and sliding window (MGR-24).

use std::any::Any;
use std::fmt;
use std::sync::Arc;

use crate::hash::BlockHash;
use crate::value::Value;

/// The token ids of a `BlockStored` event.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TokenIds {
    /// The ids themselves.
    Ids(Vec<i64>),
    /// An object the caller made of them, which the core carries to the event unread (the
    /// Python bindings keep the slice of a request's own token list, as the reference does).
    Carried(Carried),
}

impl Default for TokenIds {
    fn default() -> Self {
        Self::Ids(Vec::new())
    }
}

impl From<Vec<i64>> for TokenIds {
    fn from(ids: Vec<i64>) -> Self {
        Self::Ids(ids)
    }
}

/// A caller's object carried by the core without being read; equal only to itself.
#[derive(Clone)]
pub struct Carried(Arc<dyn Any + Send + Sync>);

impl Carried {
    /// Wraps `value`.
    pub fn new<T: Any + Send + Sync>(value: T) -> Self {
        Self(Arc::new(value))
    }

    /// The value, when it is a `T`.
    #[must_use]
    pub fn get<T: Any>(&self) -> Option<&T> {
        self.0.downcast_ref()
    }

    /// The value itself, when it is a `T` that no clone of this shares; else `self` back.
    pub fn try_take<T: Any + Send + Sync>(self) -> Result<T, Self> {
        match self.0.downcast::<T>() {
            Ok(value) => Arc::try_unwrap(value).map_err(|v| Self(v)),
            Err(other) => Err(Self(other)),
        }
    }
}

impl PartialEq for Carried {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }
}

impl Eq for Carried {}

impl fmt::Debug for Carried {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Carried(..)")
    }
}

/// Per-call metadata of a `BlockStored` event that comes from the request.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct StoredMeta {
    /// Token ids covered by the stored blocks (skipped blocks included, SPEC POOL-17).
    pub token_ids: TokenIds,
    /// `lora_request.adapter_id`, if any.
    pub lora_id: Option<i64>,
    /// `lora_request.name`, if any.
    pub lora_name: Option<String>,
    /// Extra keys per non-skipped block; `None` when the list would be empty.
    pub extra_keys: Option<Vec<Option<Value>>>,
}

/// The request ranges a `BlockStored` event describes; the pool hands this to the caller's
/// metadata callback so that request fields are read only when events are on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MetaRequest<'a> {
    /// Token range `[start, end)` whose ids the event carries.
    pub token_range: (usize, usize),
    /// Token range of each stored block, for its extra keys (SPEC XK-1).
    pub block_ranges: &'a [(usize, usize)],
    /// Multimodal feature index to start the extra-key scan from (SPEC XK-2).
    pub first_mm_idx: i64,
}

/// One KV cache event.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KvEvent {
    /// Blocks were stored in the prefix cache.
    BlockStored {
        /// Hashes of the stored (non-skipped) blocks, in order.
        block_hashes: Vec<BlockHash>,
        /// Hash of the block before the first stored one, if any.
        parent_block_hash: Option<BlockHash>,
        /// Tokens per block (or, for a partial entry, the tokens it covers).
        block_size: u32,
        /// KV-cache group id.
        group_idx: u32,
        /// Request-derived fields.
        meta: StoredMeta,
    },
    /// One key was removed from the prefix cache.
    BlockRemoved {
        /// The removed hash.
        block_hash: BlockHash,
        /// KV-cache group id.
        group_idx: u32,
    },
    /// The whole prefix cache was cleared.
    AllBlocksCleared,
}

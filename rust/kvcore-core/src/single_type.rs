//! The per-group block managers of every attention type (SPEC §10–15): one
//! [`SingleTypeManager`] per KV-cache group, holding each request's block table in that group
//! ([`BlockTables`]) and the type's rules for hit search, allocation, caching, skipping
//! and freeing. The request-level coordinator ([`crate::coordinator`]) drives them; nothing
//! here knows about Python.
//!
//! Counts follow the reference: token counts are `usize`, and a rule that subtracts may go
//! below zero where the reference's Python ints do (Mamba's align-mode block count); those
//! results are `i64`.

use hashbrown::{HashMap, HashSet};

use crate::error::PoolError;
use crate::events::{MetaRequest, StoredMeta};
use crate::hash::BlockHash;
use crate::pool::retention::Retention;
use crate::pool::{BlockId, BlockPool, HashSource, PreparedCache};
use crate::tables::BlockTables;

#[inline]
fn cdiv(a: usize, b: usize) -> usize {
    a.div_ceil(b)
}

const NULL: BlockId = 0;

/// The longest block table a request may have, whatever `max_model_len` says: 2^24 blocks (of
/// 16 tokens, 268 M tokens), far beyond any model, so that a huge token count is refused
/// instead of sizing a table of nulls the memory cannot hold.
pub const MAX_TABLE_BLOCKS: usize = 1 << 24;

/// A count as the reference's exact int would compare: saturated at `i64::MAX`, far above
/// any pool.
#[inline]
fn exact(v: usize) -> i64 {
    i64::try_from(v).unwrap_or(i64::MAX)
}

/// How a Mamba group keeps its state blocks (SPEC §14).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MambaMode {
    /// One state block per request, never cached.
    None,
    /// A state block per block of tokens.
    All,
    /// State blocks at scheduler-block boundaries, recycled two steps later.
    Align,
}

/// The attention type of a group, with its parameters: which manager rules apply (SPEC-1).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// Full attention (also TQ, MLA and hidden-state caches).
    Full,
    /// Full attention that frees decode blocks between the prompt and a window (RSWA-1).
    ReferenceSlidingWindow {
        /// The decode window in tokens.
        window: usize,
    },
    /// Full attention with `sink_len` tokens of reserved blocks (SINK-1).
    Sink {
        /// Sink tokens (a positive multiple of the block size).
        sink_len: usize,
    },
    /// Sliding-window attention (§12).
    SlidingWindow {
        /// The window in tokens.
        window: usize,
    },
    /// Chunked local attention (§13).
    ChunkedLocal {
        /// Tokens per chunk.
        chunk: usize,
    },
    /// Mamba state (§14).
    Mamba {
        /// The cache mode.
        mode: MambaMode,
        /// Extra blocks for speculative decoding.
        num_speculative_blocks: usize,
    },
    /// Cross-attention of encoder-decoder models (XATTN-1).
    CrossAttention,
}

impl Kind {
    /// Whether the type's hits are the full-attention prefix scan (FA-1).
    pub fn is_full(self) -> bool {
        matches!(
            self,
            Self::Full | Self::ReferenceSlidingWindow { .. } | Self::Sink { .. }
        )
    }

    /// Whether `remove_skipped_blocks` can free anything for this type (STM-7, RSWA-1,
    /// MAMBA-3).
    pub fn skips(self) -> bool {
        !matches!(self, Self::Full | Self::Sink { .. } | Self::CrossAttention)
    }

    /// Whether the type's `remove_skipped_blocks` reads the request's prompt length (RSWA-1:
    /// the decode blocks it frees start after the prompt).
    pub fn skips_after_prompt(self) -> bool {
        matches!(self, Self::ReferenceSlidingWindow { .. })
    }

    /// Whether the type keeps the base rules for counting, allocating and caching (STM-2,
    /// STM-3, STM-6): every type but Mamba and cross-attention.
    pub fn base_allocation(self) -> bool {
        !matches!(self, Self::Mamba { .. } | Self::CrossAttention)
    }
}

/// How one group is built.
#[derive(Debug, Clone, Copy)]
pub struct GroupConfig {
    /// The attention type.
    pub kind: Kind,
    /// The spec's block size.
    pub spec_block_size: usize,
    /// The decode and prefill context-parallel world sizes (the group's block size is
    /// `spec_block_size * dcp * pcp`, STM-1).
    pub dcp_world_size: usize,
    /// See `dcp_world_size`.
    pub pcp_world_size: usize,
    /// The group id.
    pub group_id: u32,
    /// Whether new block ids are recorded (MGR-29's exact-type test).
    pub record_new_ids: bool,
    /// The admission cap in blocks (SWA-1, CLA-1), if any.
    pub admission_cap: Option<usize>,
    /// Whether prefix caching is on.
    pub enable_caching: bool,
    /// The scheduling granularity in tokens (a multiple of the block size).
    pub scheduler_block_size: usize,
    /// Longest sequence: a request's table holds at most `cdiv(max_model_len, block_size)`
    /// entries, plus a Mamba group's speculative blocks and one, and at most
    /// [`MAX_TABLE_BLOCKS`] (null padding beyond that is refused rather than built).
    pub max_model_len: usize,
}

/// Mamba's per-step and align-mode state (MAMBA-4..8).
/// One align-mode allocation, decided ([`SingleTypeManager::align_step`]).
#[derive(Debug, Clone, Copy)]
struct AlignStep {
    /// The table's length, and whether the request allocated here before.
    prev: usize,
    seen: bool,
    /// The length padded with nulls, the state blocks moved behind, and the new blocks.
    skipped: usize,
    moves: usize,
    new: usize,
}

#[derive(Debug, Clone, Default)]
struct MambaState {
    /// Hashes of the blocks cached during the current step (MAMBA-6).
    cached_this_step: HashSet<BlockHash>,
    /// Align mode: per request, the index of the state block of two steps ago.
    last_state_block_idx: HashMap<String, usize>,
    /// Align mode: requests that have been allocated once.
    allocated: HashSet<String>,
}

/// A request's block hashes at the hash block size, read by index (a caller may convert them
/// lazily, so a hit search that stops early reads few).
pub trait HashList {
    /// Number of hashes.
    fn len(&self) -> usize;
    /// Whether there are none.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Hash `i` (`i < len`); `None` reads as a miss.
    fn get(&self, i: usize) -> Option<BlockHash>;
    /// The hashes as a slice, when they are held natively (a faster walk).
    fn as_slice(&self) -> Option<&[BlockHash]> {
        None
    }
}

impl HashList for &[BlockHash] {
    fn len(&self) -> usize {
        <[BlockHash]>::len(self)
    }
    fn get(&self, i: usize) -> Option<BlockHash> {
        <[BlockHash]>::get(self, i).copied()
    }
    fn as_slice(&self) -> Option<&[BlockHash]> {
        Some(self)
    }
}

/// A request's hashes at one group's block size (SPEC RH-3): entry `j` is entry
/// `(j + 1) * stride - 1` of the hash-block-size list.
#[derive(Clone, Copy)]
pub struct HashView<'a> {
    /// The hashes at the hash block size.
    pub hashes: &'a dyn HashList,
    /// Group block size over hash block size.
    pub stride: usize,
}

impl std::fmt::Debug for HashView<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "HashView(len={}, stride={})", self.len(), self.stride)
    }
}

impl HashView<'_> {
    /// Number of hashes at the group's block size.
    pub fn len(&self) -> usize {
        self.hashes.len() / self.stride
    }

    /// Whether the view is empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Hash `j` at the group's block size, if there is one.
    pub fn get(&self, j: usize) -> Option<BlockHash> {
        if j >= self.len() {
            return None;
        }
        self.hashes.get((j + 1) * self.stride - 1)
    }

    /// The hashes `start..end` at the group's block size, up to the first that cannot be
    /// read.
    pub fn range(&self, start: usize, end: usize) -> HashRange<'_> {
        let end = end.min(self.len());
        match self.hashes.as_slice() {
            Some(s) if self.stride == 1 => HashRange::Slice(s[start.min(end)..end].iter()),
            _ => HashRange::View(*self, start..end),
        }
    }
}

/// The iterator of [`HashView::range`].
pub enum HashRange<'a> {
    /// Native hashes at the group's block size.
    Slice(std::slice::Iter<'a, BlockHash>),
    /// Any other view, read entry by entry.
    View(HashView<'a>, std::ops::Range<usize>),
}

impl Iterator for HashRange<'_> {
    type Item = BlockHash;
    fn next(&mut self) -> Option<BlockHash> {
        match self {
            Self::Slice(it) => it.next().copied(),
            Self::View(view, r) => {
                let j = r.next()?;
                let h = view.get(j);
                if h.is_none() {
                    r.start = r.end; // stop at the first entry that cannot be read
                }
                h
            }
        }
    }
}

/// Per-group hit block ids, as a hit search returns them.
pub type HitBlocks = Vec<Vec<BlockId>>;

/// One group's caching, read and checked ([`SingleTypeManager::prepare_cache`]) and not yet
/// stored.
#[derive(Debug)]
pub(crate) struct GroupCache {
    slot: u32,
    cached: usize,
    full: usize,
    stored: Option<PreparedCache>,
}

/// The refusal to cache a cross-attention group's blocks (they are never cached).
pub(crate) fn cross_attention_caches_nothing() -> PoolError {
    PoolError::Invalid("cross-attention blocks are never cached; disable prefix caching".into())
}

/// The manager of one KV-cache group (SPEC STM-1..12 with the type's rules).
#[derive(Debug, Clone)]
pub struct SingleTypeManager {
    kind: Kind,
    block_size: usize,
    spec_block_size: usize,
    admission_cap: Option<usize>,
    enable_caching: bool,
    scheduler_block_size: usize,
    /// Whether this group's hits drop the EAGLE block (set by the coordinator).
    pub use_eagle: bool,
    /// The request tables.
    pub tables: BlockTables,
    mamba: MambaState,
    sink_blocks: Vec<BlockId>,
    /// The longest table a request may have (see [`GroupConfig::max_model_len`]).
    max_blocks: usize,
}

impl SingleTypeManager {
    /// Builds the manager; a sink group takes its blocks off the free queue now (SINK-1).
    ///
    /// # Errors
    /// [`PoolError::Config`] for a zero block size, a scheduler block size it does not
    /// divide, or a sink length that is not a positive multiple of the block size; the pool's
    /// error when it cannot provide the sink blocks.
    pub fn new(pool: &mut BlockPool, cfg: GroupConfig) -> Result<Self, PoolError> {
        let cp = cfg.dcp_world_size.max(1) * cfg.pcp_world_size.max(1);
        let block_size = cfg.spec_block_size * cp;
        if block_size == 0 {
            return Err(PoolError::Config("block_size must be positive".into()));
        }
        if matches!(cfg.kind, Kind::ChunkedLocal { chunk: 0 }) {
            return Err(PoolError::Config("a chunk of 0 tokens".into()));
        }
        let mut sink_blocks = Vec::new();
        if let Kind::Sink { sink_len } = cfg.kind {
            if sink_len == 0 || !sink_len.is_multiple_of(block_size) {
                return Err(PoolError::Config(format!(
                    "sink_len={sink_len} must be a positive multiple of block_size={block_size}"
                )));
            }
            // The pool has no "off the queue at ref 0" state: the sink blocks are ordinary
            // allocations, out of the queue for good.
            sink_blocks = pool.get_new_blocks(sink_len / block_size)?;
        }
        Ok(Self {
            kind: cfg.kind,
            block_size,
            spec_block_size: cfg.spec_block_size,
            admission_cap: cfg.admission_cap,
            enable_caching: cfg.enable_caching,
            scheduler_block_size: cfg.scheduler_block_size,
            use_eagle: false,
            tables: BlockTables::new(block_size, cfg.group_id, cfg.record_new_ids),
            mamba: MambaState::default(),
            sink_blocks,
            max_blocks: cfg
                .max_model_len
                .div_ceil(block_size)
                .saturating_add(match cfg.kind {
                    Kind::Mamba {
                        num_speculative_blocks,
                        ..
                    } => num_speculative_blocks,
                    _ => 0,
                })
                .saturating_add(1)
                .min(MAX_TABLE_BLOCKS),
        })
    }

    /// The attention type.
    pub fn kind(&self) -> Kind {
        self.kind
    }

    /// Tokens per block (`spec_block_size * dcp * pcp`).
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// The spec's block size.
    pub fn spec_block_size(&self) -> usize {
        self.spec_block_size
    }

    /// The group id.
    pub fn group_id(&self) -> u32 {
        self.tables.group_id()
    }

    /// The reserved sink blocks (SINK-1; empty for other types).
    pub fn sink_blocks(&self) -> &[BlockId] {
        &self.sink_blocks
    }

    /// The request's blocks (empty when unknown).
    pub fn blocks(&self, id: &str) -> &[BlockId] {
        self.tables.blocks(id)
    }

    /// Whether the request is running in this group (has a cached-block count).
    pub fn is_running(&self, id: &str) -> bool {
        self.tables.is_running(id)
    }

    /// The admission cap in blocks (SWA-1, CLA-1).
    pub fn admission_cap(&self) -> Option<usize> {
        self.admission_cap
    }

    /// Tokens outside the attention window after `n` computed tokens (STM-9, SWA-2, CLA-2,
    /// MAMBA-1; Mamba's `n - 1` is 0 for `n == 0`, which every rule reads alike).
    pub fn get_num_skipped_tokens(&self, n: usize) -> usize {
        match self.kind {
            Kind::SlidingWindow { window } => n.saturating_add(1).saturating_sub(window),
            Kind::ChunkedLocal { chunk } => n / chunk * chunk,
            Kind::Mamba { .. } => n.saturating_sub(1),
            _ => 0,
        }
    }

    fn mamba_params(&self) -> Option<(bool, usize)> {
        match self.kind {
            Kind::Mamba {
                mode,
                num_speculative_blocks,
            } => Some((mode == MambaMode::Align, num_speculative_blocks)),
            _ => None,
        }
    }

    // ------------------------------------------------------------------------------------
    // Capacity and allocation

    /// STM-2 (with MAMBA-4): blocks an allocation for `num_tokens` slots takes from the free
    /// queue. Negative only in Mamba's align mode, where the reference's count is too.
    ///
    /// # Errors
    /// [`PoolError::Invariant`] when a running request is given hits.
    #[allow(clippy::too_many_arguments)]
    pub fn get_num_blocks_to_allocate(
        &self,
        pool: &BlockPool,
        id: &str,
        mut num_tokens: usize,
        hits: &[BlockId],
        total_computed_tokens: usize,
        num_tokens_main_model: usize,
        apply_admission_cap: bool,
    ) -> Result<i64, PoolError> {
        if let Some((align, ns)) = self.mamba_params() {
            if let Some(&last) = hits.last() {
                if !self.mamba.cached_this_step.is_empty() {
                    let key = pool.primary_key(last).map(|(k, _)| k.hash);
                    if key.is_some_and(|k| self.mamba.cached_this_step.contains(&k)) {
                        return Ok(exact(pool.num_blocks()) + 1);
                    }
                }
            }
            if align {
                let required = cdiv(num_tokens_main_model, self.block_size).saturating_add(ns);
                let have = self.blocks(id).len();
                let mut new = exact(required) - exact(hits.len()) - exact(have);
                if new > 0 {
                    new = if self.mamba.allocated.contains(id) {
                        1
                    } else {
                        exact(ns).saturating_add(1)
                    };
                }
                return Ok(new.saturating_add(exact(pool.count_evictable(hits))));
            }
            num_tokens = num_tokens.saturating_add(self.spec_block_size.saturating_mul(ns));
        }
        let bs = self.block_size;
        let mut required = cdiv(num_tokens, bs);
        if let Some(cap) = self.admission_cap.filter(|_| apply_admission_cap) {
            required = required.min(cap);
        }
        let (have, running) = self
            .tables
            .get(id)
            .map_or((0, false), |r| (r.blocks.len(), r.num_cached.is_some()));
        if running {
            if !hits.is_empty() {
                return Err(PoolError::Invariant(
                    "a running request cannot have new prefix hits".into(),
                ));
            }
            return Ok(exact(required.saturating_sub(have)));
        }
        let skipped = self.get_num_skipped_tokens(total_computed_tokens) / bs;
        let new = required.saturating_sub(skipped.max(hits.len().saturating_add(have)));
        let start = skipped.saturating_sub(have).min(hits.len());
        Ok(exact(
            new.saturating_add(pool.count_evictable(&hits[start..])),
        ))
    }

    /// STM-4: a request with no blocks starts with its (touched) hits, after null blocks for
    /// the tokens outside the window.
    ///
    /// # Errors
    /// [`PoolError::Invariant`] when the request holds blocks, hits come with caching off, or
    /// a cross-attention group gets hits; nothing changes.
    pub fn add_local_computed_blocks(
        &mut self,
        pool: &mut BlockPool,
        id: &str,
        hits: &[BlockId],
        num_local_computed_tokens: usize,
        num_external_computed_tokens: usize,
    ) -> Result<(), PoolError> {
        let Some(skipped) = self.check_local_computed_blocks(
            pool,
            id,
            hits,
            num_local_computed_tokens,
            num_external_computed_tokens,
        )?
        else {
            return Ok(());
        };
        let hits = &hits[skipped.min(hits.len())..];
        if self.enable_caching {
            pool.touch(hits)?;
        }
        let e = self.tables.entry(id);
        e.blocks.resize(skipped, NULL);
        e.blocks.extend_from_slice(hits);
        e.num_cached = Some(e.blocks.len());
        Ok(())
    }

    /// [`Self::add_local_computed_blocks`]'s refusals, without changing anything: the number
    /// of leading blocks outside the window (null in the table), or `None` for a
    /// cross-attention group (it takes no hits and holds nothing for them).
    ///
    /// # Errors
    /// As [`Self::add_local_computed_blocks`].
    pub fn check_local_computed_blocks(
        &self,
        pool: &BlockPool,
        id: &str,
        hits: &[BlockId],
        num_local_computed_tokens: usize,
        num_external_computed_tokens: usize,
    ) -> Result<Option<usize>, PoolError> {
        if self.kind == Kind::CrossAttention {
            if !hits.is_empty() {
                return Err(PoolError::Invariant(
                    "cross-attention has no prefix hits".into(),
                ));
            }
            return Ok(None);
        }
        if !self.blocks(id).is_empty() {
            return Err(PoolError::Invariant(format!(
                "request {id} already holds blocks"
            )));
        }
        let total = num_local_computed_tokens.saturating_add(num_external_computed_tokens);
        let skipped = self.get_num_skipped_tokens(total) / self.block_size;
        self.check_table_len(skipped)?;
        let hits = &hits[skipped.min(hits.len())..];
        if self.enable_caching {
            pool.check_touch(hits)?;
        } else if !hits.is_empty() {
            return Err(PoolError::Invariant(
                "prefix hits given while prefix caching is off".into(),
            ));
        }
        Ok(Some(skipped))
    }

    /// STM-5: blocks for the tokens a KV connector computed.
    ///
    /// # Errors
    /// The pool's when it cannot provide them; nothing changes.
    pub fn allocate_external_computed_blocks(
        &mut self,
        pool: &mut BlockPool,
        id: &str,
        num_local_computed_tokens: usize,
        num_external_computed_tokens: usize,
    ) -> Result<(), PoolError> {
        if self.kind == Kind::CrossAttention {
            return Ok(());
        }
        let total = num_local_computed_tokens.saturating_add(num_external_computed_tokens);
        if self.external_tokens(total, num_external_computed_tokens) == 0 {
            return Ok(());
        }
        self.grow_to(pool, id, cdiv(total, self.block_size))
            .map(|_| ())
    }

    /// STM-5: of `ext` external tokens among `total` computed ones, those this group keeps
    /// blocks for (inside its window).
    pub(crate) fn external_tokens(&self, total: usize, ext: usize) -> usize {
        let skipped = self.get_num_skipped_tokens(total);
        if skipped > 0 {
            ext.min(total - skipped)
        } else {
            ext
        }
    }

    /// Refuses a table of `len` entries beyond the longest a sequence has (the reference would
    /// build a list that long).
    fn check_table_len(&self, len: usize) -> Result<(), PoolError> {
        if len > self.max_blocks {
            return Err(PoolError::Invalid(format!(
                "a table of {len} blocks is longer than max_model_len allows ({})",
                self.max_blocks
            )));
        }
        Ok(())
    }

    /// STM-3 (with MAMBA-5) without changing anything: how many blocks
    /// [`Self::allocate_new_blocks`] takes off the free queue for these counts once the
    /// request's table holds `have` blocks, and its refusals (an align-mode table longer than a
    /// sequence allows, a step placing more blocks than align mode allows), so that a caller
    /// can refuse before any group changes; with the table's length after the allocation.
    ///
    /// # Errors
    /// [`PoolError::Invalid`], [`PoolError::Invariant`], as `allocate_new_blocks` would.
    pub fn new_blocks_needed(
        &self,
        id: &str,
        have: usize,
        num_tokens: usize,
        num_tokens_main_model: usize,
    ) -> Result<(usize, usize), PoolError> {
        match self.mamba_params() {
            Some((true, ns)) => Ok(self
                .align_step(id, have, num_tokens_main_model, ns)?
                .map_or((0, have), |s| {
                    (s.new, s.prev.max(s.skipped) + s.moves + s.new)
                })),
            _ => {
                let target = self.growth_target(num_tokens);
                Ok((target.saturating_sub(have), have.max(target)))
            }
        }
    }

    /// The table length STM-3 grows to for `num_tokens` slots (MAMBA-5: plus the speculative
    /// blocks in full-state modes); align mode has its own rule ([`Self::align_step`]).
    #[inline]
    fn growth_target(&self, num_tokens: usize) -> usize {
        let n = match self.kind {
            Kind::Mamba {
                num_speculative_blocks: ns,
                ..
            } => num_tokens.saturating_add(self.block_size.saturating_mul(ns)),
            _ => num_tokens,
        };
        cdiv(n, self.block_size)
    }

    /// Grows the request's table to `want` blocks, recording the new ids; returns the index
    /// of the first new block.
    fn grow_to(&mut self, pool: &mut BlockPool, id: &str, want: usize) -> Result<usize, PoolError> {
        let slot = self.tables.entry_slot(id);
        Ok(self.tables.grow_slot(pool, slot, want)?.start)
    }

    /// STM-3 (with MAMBA-5): gives the request at least `num_tokens` slots; returns the range
    /// of its table that is new (in align mode, the blocks placed this call).
    ///
    /// # Errors
    /// The pool's when it cannot provide the blocks (nothing changes), or
    /// [`PoolError::Invariant`] when align mode would allocate more than its step allows.
    pub fn allocate_new_blocks(
        &mut self,
        pool: &mut BlockPool,
        id: &str,
        num_tokens: usize,
        num_tokens_main_model: usize,
    ) -> Result<std::ops::Range<usize>, PoolError> {
        if let Some((true, ns)) = self.mamba_params() {
            return self.allocate_align(pool, id, num_tokens_main_model, ns);
        }
        let want = self.growth_target(num_tokens);
        let have = self.grow_to(pool, id, want)?;
        Ok(have..have.max(want))
    }

    /// STM-2 and STM-3 (with MAMBA-4/5) for a running request that holds `have` blocks and
    /// takes no hits: the count [`Self::get_num_blocks_to_allocate`] gives for `num_tokens`
    /// slots and the table length [`Self::allocate_new_blocks`] grows to. `None` where the
    /// general rules are needed: cross-attention, and a Mamba align-mode step that places a
    /// state block (its moves and refusals are [`Self::allocate_align`]'s).
    #[inline]
    pub(crate) fn running_growth(
        &self,
        have: usize,
        num_tokens: usize,
        num_tokens_main_model: usize,
    ) -> Option<(i64, usize)> {
        let bs = self.block_size;
        match self.kind {
            Kind::CrossAttention => None,
            Kind::Mamba {
                mode: MambaMode::Align,
                num_speculative_blocks: ns,
            } => {
                let required = cdiv(num_tokens_main_model, bs).saturating_add(ns);
                // Negative when the request holds more: the reference's count is too.
                (required <= have).then(|| (exact(required) - exact(have), have))
            }
            Kind::Mamba {
                num_speculative_blocks: ns,
                ..
            } => {
                let counted = cdiv(
                    num_tokens.saturating_add(self.spec_block_size.saturating_mul(ns)),
                    bs,
                );
                let want = cdiv(num_tokens.saturating_add(bs.saturating_mul(ns)), bs);
                Some((exact(counted.saturating_sub(have)), want))
            }
            _ => {
                let want = cdiv(num_tokens, bs);
                Some((exact(want.saturating_sub(have)), want))
            }
        }
    }

    /// MAMBA-5 in align mode for a table of `prev` blocks, decided: `None` when it holds the
    /// blocks already,
    /// otherwise where the state block moves and how many blocks are new, or the refusals.
    fn align_step(
        &self,
        id: &str,
        prev: usize,
        num_tokens_main_model: usize,
        ns: usize,
    ) -> Result<Option<AlignStep>, PoolError> {
        let required = cdiv(num_tokens_main_model, self.block_size).saturating_add(ns);
        if required <= prev {
            return Ok(None);
        }
        self.check_table_len(required)?;
        let seen = self.mamba.allocated.contains(id);
        // The reference's -1 for no main-model tokens pads nothing and moves nothing, as 0.
        let skipped = required.saturating_sub(ns.saturating_add(1));
        let moves = if seen {
            (prev.saturating_sub(ns)..prev)
                .take_while(|&j| j < skipped)
                .count()
        } else {
            0
        };
        let new = required.saturating_sub(prev.max(skipped) + moves);
        // Refused before anything changes (the reference fails after moving blocks).
        if new > if seen { 1 } else { ns.saturating_add(1) } {
            return Err(PoolError::Invariant(format!(
                "Mamba align mode would allocate {new} blocks at once"
            )));
        }
        Ok(Some(AlignStep {
            prev,
            seen,
            skipped,
            moves,
            new,
        }))
    }

    /// MAMBA-5 in align mode: the state block moves to the step's boundary, the blocks
    /// behind it become null, and at most one block (the first time `1 + ns`) is new.
    fn allocate_align(
        &mut self,
        pool: &mut BlockPool,
        id: &str,
        num_tokens_main_model: usize,
        ns: usize,
    ) -> Result<std::ops::Range<usize>, PoolError> {
        let Some(AlignStep {
            prev,
            seen,
            skipped,
            moves,
            new: n,
        }) = self.align_step(id, self.blocks(id).len(), num_tokens_main_model, ns)?
        else {
            let len = self.tables.entry(id).blocks.len();
            return Ok(len..len);
        };
        if n > pool.get_num_free_blocks() {
            return Err(PoolError::NotEnoughFreeBlocks {
                requested: n,
                free: pool.get_num_free_blocks(),
            });
        }
        let last = if seen {
            prev.checked_sub(ns.saturating_add(1))
        } else {
            prev.checked_sub(1)
        };
        if let Some(last) = last {
            self.mamba.last_state_block_idx.insert(id.to_owned(), last);
        }
        let e = self.tables.entry(id);
        if prev < skipped {
            e.blocks.resize(skipped, NULL);
        }
        for j in prev.saturating_sub(ns)..prev.saturating_sub(ns) + moves {
            let b = e.blocks[j];
            e.blocks.push(b);
            e.blocks[j] = NULL;
        }
        if n > 0 {
            pool.get_new_blocks_into(n, &mut e.blocks)?;
        }
        self.mamba.allocated.insert(id.to_owned());
        Ok(prev..self.tables.blocks(id).len())
    }

    // ------------------------------------------------------------------------------------
    // Caching

    /// STM-6 (with SWA-4's and MAMBA-7's masks and MAMBA-6's bookkeeping): enters the
    /// request's newly full blocks into the prefix cache. `hashes` is the request's hash view
    /// at this group's block size.
    ///
    /// # Errors
    /// [`PoolError::Invalid`] for a cross-attention group (its blocks are never cached);
    /// [`PoolError::MissingBlocks`] when the request holds fewer blocks than are full; the
    /// pool's errors. Nothing changes then.
    #[allow(clippy::too_many_arguments)]
    pub fn cache_blocks<E: From<PoolError>>(
        &mut self,
        pool: &mut BlockPool,
        id: &str,
        num_tokens: usize,
        retention_interval: Option<usize>,
        num_prompt_tokens: usize,
        hashes: HashSource<'_, E>,
        meta: &mut dyn FnMut(&MetaRequest<'_>) -> Result<StoredMeta, E>,
    ) -> Result<(), E> {
        let slot = self.tables.slot_of(id);
        if let Some(c) = self.prepare_cache(
            pool,
            id,
            slot,
            num_tokens,
            retention_interval,
            num_prompt_tokens,
            hashes,
            meta,
        )? {
            self.commit_cache(pool, c);
        }
        Ok(())
    }

    /// [`Self::cache_blocks`] for the request whose entry is in `slot` (`None`: it has none,
    /// as [`BlockTables::resolve_cell`] or [`BlockTables::slot_of`] found it), read and
    /// checked without changing anything (`None`: nothing to cache); [`Self::commit_cache`]
    /// stores it.
    ///
    /// # Errors
    /// As [`Self::cache_blocks`].
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn prepare_cache<E: From<PoolError>>(
        &self,
        pool: &BlockPool,
        id: &str,
        slot: Option<u32>,
        num_tokens: usize,
        retention_interval: Option<usize>,
        num_prompt_tokens: usize,
        hashes: HashSource<'_, E>,
        meta: &mut dyn FnMut(&MetaRequest<'_>) -> Result<StoredMeta, E>,
    ) -> Result<Option<GroupCache>, E> {
        if self.kind == Kind::CrossAttention {
            return Err(cross_attention_caches_nothing().into());
        }
        let bs = self.block_size;
        let (cached, held) = slot.map_or((0, 0), |s| {
            let e = self.tables.at_slot(s);
            (e.num_cached.unwrap_or(0), e.blocks.len())
        });
        let full = num_tokens / bs;
        if cached >= full {
            return Ok(None);
        }
        // `held >= full > 0` below: the request has an entry.
        let (Some(slot), true) = (slot, held >= full) else {
            return Err(PoolError::MissingBlocks(format!(
                "request {id} holds {held} blocks, fewer than the {full} full ones"
            ))
            .into());
        };
        let mask =
            self.reachable_block_mask(cached, full, retention_interval, num_prompt_tokens)?;
        let new = &self.tables.at_slot(slot).blocks[cached..full];
        let stored = pool.prepare_full_blocks(
            new,
            cached,
            full,
            bs,
            self.group_id(),
            mask.as_deref(),
            hashes,
            meta,
        )?;
        Ok(Some(GroupCache {
            slot,
            cached,
            full,
            stored,
        }))
    }

    /// Stores what [`Self::prepare_cache`] read; the request's table is as it was then.
    pub(crate) fn commit_cache(&mut self, pool: &mut BlockPool, c: GroupCache) {
        if let Some(p) = c.stored {
            pool.commit_full_blocks(p);
        }
        let e = self.tables.at_slot_mut(c.slot);
        if matches!(self.kind, Kind::Mamba { .. }) {
            for &b in e.blocks[c.cached..c.full].iter().filter(|&&b| b != NULL) {
                if let Some((k, _)) = pool.primary_key(b) {
                    self.mamba.cached_this_step.insert(k.hash);
                }
            }
        }
        e.num_cached = Some(c.full);
    }

    /// Which of the blocks `start..end` caching stores (SWA-4, MAMBA-7); `None`: all.
    ///
    /// # Errors
    /// [`PoolError::Invariant`] when the scheduler block size is not a multiple of the block
    /// size.
    pub fn reachable_block_mask(
        &self,
        start: usize,
        end: usize,
        retention_interval: Option<usize>,
        num_prompt_tokens: usize,
    ) -> Result<Option<Vec<bool>>, PoolError> {
        let alignment = self.scheduler_block_size;
        let bs = self.spec_block_size;
        match self.kind {
            Kind::SlidingWindow { window } => {
                if !alignment.is_multiple_of(bs) {
                    return Err(PoolError::Invariant(
                        "alignment must be a multiple of the block size".into(),
                    ));
                }
                let need = sliding_window_need(window, bs, self.use_eagle);
                let shift = usize::from(self.use_eagle);
                let mut mask = vec![false; end - start];
                let segment = match retention_interval {
                    None => Some(alignment),
                    Some(0) => None,
                    Some(r) => Some(r),
                };
                if let Some(segment) = segment {
                    let per = segment / bs;
                    if need >= per {
                        return Ok(None);
                    }
                    for i in start.max(shift)..end {
                        if (i - shift) % per >= per - need {
                            mask[i - start] = true;
                        }
                    }
                }
                if retention_interval.is_some() && num_prompt_tokens > 0 {
                    let latest = (num_prompt_tokens - 1) / alignment * alignment;
                    let prompt_end = latest / bs + shift;
                    for i in start.max(prompt_end.saturating_sub(need))..end.min(prompt_end) {
                        mask[i - start] = true;
                    }
                }
                Ok(Some(mask))
            }
            Kind::Mamba { .. } => {
                let Some(interval) = retention_interval else {
                    return Ok(None);
                };
                let mut mask = vec![false; end - start];
                if interval != 0 {
                    let per = interval / bs;
                    if per <= 1 {
                        return Ok(None);
                    }
                    let first = (start + per) / per * per - 1;
                    for i in (first - start..mask.len()).step_by(per) {
                        mask[i] = true;
                    }
                }
                if num_prompt_tokens > 0 {
                    let latest = (num_prompt_tokens - 1) / alignment * alignment;
                    if let Some(boundary) = (latest / bs).checked_sub(1) {
                        if (start..end).contains(&boundary) {
                            mask[boundary - start] = true;
                        }
                    }
                }
                Ok(Some(mask))
            }
            _ => Ok(None),
        }
    }

    // ------------------------------------------------------------------------------------
    // Freeing

    /// STM-10 (with MAMBA-8): forgets the request; returns its blocks in allocation order.
    pub fn pop(&mut self, id: &str) -> Vec<BlockId> {
        if self.mamba_params().is_some_and(|(align, _)| align) {
            self.mamba.allocated.remove(id);
            self.mamba.last_state_block_idx.remove(id);
        }
        self.tables.pop(id)
    }

    /// MGR-20: frees the request's blocks, last first, placing the cached ones by
    /// `retention` (kvcore extension) read at `now`. Unknown ids do nothing.
    ///
    /// # Errors
    /// Only if the pool's counts were corrupted from outside; the state is then unchanged.
    pub fn free(
        &mut self,
        pool: &mut BlockPool,
        id: &str,
        retention: Retention,
        now: f64,
    ) -> Result<(), PoolError> {
        if !self.tables.contains(id) {
            return Ok(());
        }
        pool.free_blocks_retained(self.blocks(id).iter().rev().copied(), retention, now)?;
        self.pop(id);
        Ok(())
    }

    /// STM-8: frees `first..last` back to front, stopping at the first null, replacing them
    /// by the null block.
    fn remove_blocks_in_range(
        &mut self,
        pool: &mut BlockPool,
        slot: u32,
        first: usize,
        last: usize,
    ) -> Result<(), PoolError> {
        let e = self.tables.at_slot_mut(slot);
        let last = last.min(e.blocks.len());
        // Nothing to walk, or the walk would stop at its first block (known null).
        if first >= last || e.null_end == last {
            return Ok(());
        }
        let mut freed = Vec::new();
        for i in (first..last).rev() {
            let b = e.blocks[i];
            if b == NULL {
                break;
            }
            freed.push(b);
        }
        pool.free_blocks(&freed)?;
        for b in &mut e.blocks[last - freed.len()..last] {
            *b = NULL;
        }
        e.null_end = last;
        Ok(())
    }

    /// STM-7 (with RSWA-1, SWA-2, MAMBA-3): frees the blocks the attention no longer reads.
    ///
    /// # Errors
    /// Only if the pool's counts were corrupted from outside.
    pub fn remove_skipped_blocks(
        &mut self,
        pool: &mut BlockPool,
        id: &str,
        total_computed_tokens: usize,
        num_prompt_tokens: Option<usize>,
    ) -> Result<(), PoolError> {
        self.remove_skipped_at(pool, id, None, total_computed_tokens, num_prompt_tokens)
    }

    /// [`Self::remove_skipped_blocks`] with the request's slot when the caller resolved it.
    pub(crate) fn remove_skipped_at(
        &mut self,
        pool: &mut BlockPool,
        id: &str,
        slot: Option<u32>,
        total_computed_tokens: usize,
        num_prompt_tokens: Option<usize>,
    ) -> Result<(), PoolError> {
        let bs = self.block_size;
        match self.kind {
            Kind::Full | Kind::Sink { .. } | Kind::CrossAttention => Ok(()),
            Kind::ReferenceSlidingWindow { window } => {
                let Some(prompt) = num_prompt_tokens else {
                    return Ok(());
                };
                // STM-8 reads the table without creating an entry.
                let Some(slot) = slot.or_else(|| self.tables.slot_of(id)) else {
                    return Ok(());
                };
                let first = cdiv(prompt, bs);
                let window_start = prompt.max(total_computed_tokens.saturating_sub(window));
                self.remove_blocks_in_range(pool, slot, first, window_start / bs)
            }
            Kind::SlidingWindow { .. } => {
                let skipped = self.get_num_skipped_tokens(total_computed_tokens);
                if skipped == 0 {
                    return Ok(());
                }
                // The reference's default-dict read creates the entry.
                let slot = slot.unwrap_or_else(|| self.tables.entry_slot(id));
                self.remove_blocks_in_range(pool, slot, 0, skipped / bs)
            }
            Kind::ChunkedLocal { .. } => self.remove_base(pool, id, slot, total_computed_tokens),
            Kind::Mamba {
                mode,
                num_speculative_blocks,
            } => {
                let n = total_computed_tokens.saturating_sub(num_speculative_blocks);
                self.remove_base(pool, id, slot, n)?;
                if mode == MambaMode::Align {
                    let last = self.mamba.last_state_block_idx.get(id).copied();
                    if let Some(last) = last.filter(|&l| l + 1 < cdiv(n, bs)) {
                        let slot = slot.unwrap_or_else(|| self.tables.entry_slot(id));
                        let e = self.tables.at_slot_mut(slot);
                        if let Some(&b) = e.blocks.get(last).filter(|&&b| b != NULL) {
                            pool.free_blocks(&[b])?;
                            e.blocks[last] = NULL;
                        }
                    }
                }
                Ok(())
            }
        }
    }

    /// STM-7's base rule.
    fn remove_base(
        &mut self,
        pool: &mut BlockPool,
        id: &str,
        slot: Option<u32>,
        total_computed_tokens: usize,
    ) -> Result<(), PoolError> {
        let skipped = self.get_num_skipped_tokens(total_computed_tokens);
        if skipped == 0 {
            return Ok(());
        }
        let slot = slot.unwrap_or_else(|| self.tables.entry_slot(id));
        let n = (skipped / self.block_size).min(self.tables.at_slot(slot).blocks.len());
        self.remove_blocks_in_range(pool, slot, 0, n)
    }

    /// MGR-30: a new scheduler step (MAMBA-6 forgets the step's cached hashes).
    pub fn new_step_starts(&mut self) {
        self.mamba.cached_this_step.clear();
    }

    /// STM-12 / FA-2: the request's leading blocks shared by every request with an entry (0
    /// for types other than full attention).
    pub fn get_num_common_prefix_blocks(&mut self, pool: &BlockPool, id: &str) -> usize {
        if self.kind.is_full() {
            self.tables.get_num_common_prefix_blocks(pool, id)
        } else {
            0
        }
    }

    /// MGR-29: drains the recorded new block ids.
    pub fn take_new_block_ids(&mut self) -> Vec<BlockId> {
        self.tables.take_new_block_ids()
    }

    /// Checks the tables against the pool ([`BlockTables::check_invariants`]).
    ///
    /// # Errors
    /// A message naming the first violation.
    pub fn check_invariants(&self, pool: &BlockPool) -> Result<(), String> {
        self.tables.check_invariants(pool)
    }

    // ------------------------------------------------------------------------------------
    // Lookup

    /// The type's hit search (FA-1, SWA-3, CLA-3, MAMBA-2): the longest cached prefix of at
    /// most `max_length` tokens, per group of `group_ids` (which share this type and block
    /// size). `hashes` is the view at the spec's block size.
    ///
    /// # Errors
    /// [`PoolError::Invariant`] for lookups the type does not support (context parallelism
    /// for the window types, EAGLE with chunked local attention, an alignment other than the
    /// block size for chunked local attention); [`PoolError::Unsupported`] for
    /// cross-attention.
    #[allow(clippy::too_many_arguments)]
    pub fn find_longest_cache_hit(
        kind: Kind,
        pool: &BlockPool,
        hashes: HashView<'_>,
        max_length: usize,
        group_ids: &[u32],
        spec_block_size: usize,
        drop_eagle_block: bool,
        alignment_tokens: usize,
        context_parallel: usize,
    ) -> Result<HitBlocks, PoolError> {
        let empty = || vec![Vec::new(); group_ids.len()];
        let no_cp = || {
            if context_parallel == 1 {
                Ok(())
            } else {
                Err(PoolError::Invariant(
                    "this attention type's lookups need dcp == pcp == 1".into(),
                ))
            }
        };
        match kind {
            Kind::Full | Kind::ReferenceSlidingWindow { .. } | Kind::Sink { .. } => {
                let bs = spec_block_size * context_parallel;
                let max_blocks = max_length / bs;
                let mut hit = if max_blocks > 0 {
                    prefix_scan(pool, hashes.range(0, max_blocks), group_ids)
                } else {
                    empty()
                };
                let pop_all = |hit: &mut HitBlocks| {
                    hit.iter_mut().for_each(|h| {
                        h.pop();
                    })
                };
                if drop_eagle_block && hit.first().is_some_and(|h| !h.is_empty()) {
                    pop_all(&mut hit);
                }
                if bs != alignment_tokens {
                    while hit
                        .first()
                        .is_some_and(|h| !(h.len() * bs).is_multiple_of(alignment_tokens))
                    {
                        pop_all(&mut hit);
                    }
                }
                Ok(hit)
            }
            Kind::SlidingWindow { window } => {
                no_cp()?;
                let bs = spec_block_size;
                let need = sliding_window_need(window, bs, drop_eagle_block);
                let mut at =
                    |j: usize| -> Result<Option<BlockHash>, PoolError> { Ok(hashes.get(j)) };
                pool.sliding_window_hit(
                    max_length / bs,
                    &mut at,
                    group_ids,
                    need,
                    bs,
                    alignment_tokens,
                    drop_eagle_block,
                )
            }
            Kind::ChunkedLocal { chunk } => {
                if drop_eagle_block {
                    return Err(PoolError::Invariant(
                        "eagle is not supported with chunked local attention".into(),
                    ));
                }
                no_cp()?;
                let bs = spec_block_size;
                if bs != alignment_tokens {
                    return Err(PoolError::Invariant(
                        "chunked local attention needs alignment equal to its block size".into(),
                    ));
                }
                let max_blocks = max_length / bs;
                let start = max_length / chunk * chunk / bs;
                let hits = prefix_scan(pool, hashes.range(start, max_blocks), group_ids);
                Ok(hits
                    .into_iter()
                    .map(|h| {
                        let mut v = vec![NULL; start];
                        v.extend(h);
                        v
                    })
                    .collect())
            }
            Kind::Mamba { .. } => {
                no_cp()?;
                let bs = spec_block_size;
                let mut at =
                    |j: usize| -> Result<Option<BlockHash>, PoolError> { Ok(hashes.get(j)) };
                let found = pool.last_aligned_hit(
                    max_length / bs,
                    &mut at,
                    group_ids,
                    bs,
                    alignment_tokens,
                )?;
                Ok(match found {
                    None => empty(),
                    Some((i, hit)) => hit
                        .into_iter()
                        .map(|b| {
                            let mut v = vec![NULL; i];
                            v.push(b);
                            v
                        })
                        .collect(),
                })
            }
            Kind::CrossAttention => Err(PoolError::Unsupported(
                "cross-attention does not support prefix caching".into(),
            )),
        }
    }
}

/// FA-1's walk over a range of hashes, with the native slice walked directly (its iterator
/// inlines into the pool's chunked lookup).
fn prefix_scan(pool: &BlockPool, range: HashRange<'_>, group_ids: &[u32]) -> HitBlocks {
    match range {
        HashRange::Slice(it) => pool.longest_cached_prefix(it.copied(), group_ids),
        view => pool.longest_cached_prefix(view, group_ids),
    }
}

/// SWA-3: consecutive hit blocks that cover a window.
fn sliding_window_need(window: usize, block_size: usize, use_eagle: bool) -> usize {
    cdiv(window.saturating_sub(1), block_size) + usize::from(use_eagle)
}

#[cfg(test)]
#[path = "single_type_tests.rs"]
mod tests;

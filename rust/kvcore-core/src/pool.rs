//! The block pool (SPEC §1–4): blocks, reference counts, the free queue in eviction order, the
//! null block, the prefix-cache index and KV events.
//!
//! # Implementation
//! Blocks are plain indices. Per block the pool keeps a reference count and two queue links
//! (`prev`/`next` arrays with a head and a tail sentinel, as in slab's vacant chain), plus an
//! index into a small slab of primary keys that only hashed blocks use. The prefix-cache index
//! (the private `index` module) lists `(key, block)` pairs, each key's in insertion order; a
//! pair is named by the block's id for its primary key, or by an alias record (SPEC MAP-6: keys
//! of partial entries, rare) numbered after the blocks.
//!
//! # Invariants
//! Checked by [`BlockPool::check_invariants`]:
//! - a block is linked in the queue iff its `ref_cnt` is 0 and it is not the null block;
//! - the queue length equals the free count and the links are consistent both ways;
//! - every key in the index lists only blocks that hold it (primary or alias), and every key a
//!   block holds lists that block exactly once.

#[cfg(feature = "fuzzing")]
pub mod fuzzing;
mod index;
pub mod retention;

use hashbrown::{HashMap, HashSet};

use index::{mix, PrefixIndex};

use crate::error::PoolError;
use crate::events::{KvEvent, MetaRequest, StoredMeta};
use crate::hash::{BlockHash, BlockKey};
use crate::huge::HugePages;
use crate::prefetch::prefetch;
use retention::{Deadlines, Pins, Retention};

/// A vector on huge pages once it reaches 2 MiB (the per-block tables; see [`crate::huge`]).
type HugeVec<T> = allocator_api2::vec::Vec<T, HugePages>;

/// A block id (an index into the pool).
pub type BlockId = u32;

/// Marks "no link" / "no key" in the per-block arrays.
const NIL: u32 = u32::MAX;

/// Largest pool: pair ids (block ids, then alias records) must stay below `u32::MAX`.
const MAX_BLOCKS: i64 = 1 << 31;

/// Memory one block can take once the pool is fully cached: its node, its primary key, its
/// free-slot entry and up to four index slots (the index is at most half full and doubles).
/// A pool whose blocks would need more than the machine's memory is refused up front.
const BYTES_PER_BLOCK: u64 = (std::mem::size_of::<Node>()
    + std::mem::size_of::<Primary>()
    + std::mem::size_of::<u32>()
    + 4 * std::mem::size_of::<u64>()) as u64;

/// How many operations ahead a batch of index operations prefetches.
const PREFETCH_AHEAD: usize = 8;

/// The free queue's lists, evicted in order: level 0 holds blocks worth nothing (no key, or a
/// retention time to live that ran out), level `1 + p` cached blocks freed with retention
/// priority `p`. Level 0 followed by the default level is the reference's one queue.
const NUM_LEVELS: usize = 2 + retention::MAX_PRIORITY as usize;
const FRONT: usize = 0;
const DEFAULT_LEVEL: usize = 1 + retention::DEFAULT_PRIORITY as usize;

/// An alias key of a block (SPEC MAP-6); its pair id is `num_blocks + record index`.
#[derive(Debug, Clone, Copy)]
struct Alias {
    key: BlockKey,
    block: BlockId,
}

/// The primary key of a hashed block and the prefix length it covers (SPEC BLK-1).
#[derive(Debug, Clone, Copy)]
struct Primary {
    key: BlockKey,
    num_tokens: u32,
}

/// One block's state.
#[derive(Debug, Clone, Copy)]
struct Node {
    ref_cnt: i32,
    /// Queue links, `NIL` when not queued.
    prev: u32,
    next: u32,
    /// Slot in `primaries`, or `NIL`.
    primary_slot: u32,
}

const EMPTY_NODE: Node = Node {
    ref_cnt: 0,
    prev: NIL,
    next: NIL,
    primary_slot: NIL,
};

/// The block pool. See the module documentation.
#[derive(Debug, Clone)]
pub struct BlockPool {
    num_blocks: usize,
    enable_caching: bool,
    hash_block_size: usize,
    events_enabled: bool,
    /// Per block: its count, queue links and primary slot in one record, so that an operation
    /// on a block touches one cache line; indices `num_blocks` (head) and `num_blocks + 1`
    /// (tail) are the queue's sentinels.
    nodes: HugeVec<Node>,
    num_free: usize,
    primaries: HugeVec<Primary>,
    free_slots: Vec<u32>,
    index: PrefixIndex,
    /// Alias records (a slab: `free_aliases` lists the vacant ones) and each block's, oldest
    /// first.
    alias_records: HugeVec<Alias>,
    free_aliases: Vec<u32>,
    aliases: HashMap<BlockId, Vec<u32>>,
    events: Vec<KvEvent>,
    /// The operations a block-metrics collector follows, while recording is on.
    block_ops: Option<Vec<BlockOp>>,
    /// Bit `l` is set when level `l` may hold blocks (cleared lazily when found empty).
    levels: u128,
    /// Deadlines of freed blocks with a retention time to live.
    deadlines: Deadlines,
    pins: Pins,
    /// Router-exact events: `BlockStored` for a key's first block, `BlockRemoved` for its last.
    exact_events: bool,
}

/// A pool operation as a per-block metrics collector sees it (vLLM's `KVCacheMetricsCollector`
/// hooks), recorded in order only while [`BlockPool::record_block_ops`] is on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BlockOp {
    /// `get_new_blocks` handed the block out.
    Allocated(BlockId),
    /// `touch` took a reference on the block (the null block included).
    Accessed(BlockId),
    /// The block's prefix-cache keys were dropped, or would have been had it any: every block
    /// `get_new_blocks` takes with caching on (before its `Allocated`) and every block
    /// `evict_blocks` names.
    Evicted(BlockId),
    /// `reset_prefix_cache` cleared the cache.
    Reset,
}

/// What `cache_full_blocks` needs to know about the request's hashes.
pub struct HashSource<'a, E> {
    /// Number of entries in the (possibly block-size-adjusted) hash view; asked only when
    /// blocks are to be cached.
    pub len: &'a mut dyn FnMut() -> Result<usize, E>,
    /// Reads entry `i` of the view (`0 <= i < len`).
    pub get: &'a mut dyn FnMut(usize) -> Result<BlockHash, E>,
}

/// The keys and events one group's [`BlockPool::cache_full_blocks`] stores, read and checked
/// ([`BlockPool::prepare_full_blocks`]) and not yet stored.
#[derive(Debug)]
pub struct PreparedCache {
    /// (position, block, key, tokens covered) per block stored.
    stored: Vec<(usize, BlockId, BlockKey, u32)>,
    events: Vec<(Option<BlockHash>, Vec<BlockHash>, StoredMeta)>,
    block_size: u32,
    group_id: u32,
}

impl BlockPool {
    /// Builds a pool of `num_blocks` blocks; block 0 becomes the null block and the free queue
    /// is `[1..num_blocks-1]` (SPEC POOL-1).
    ///
    /// # Errors
    /// [`PoolError::InvalidPoolSize`] when `num_blocks <= 0` or `num_blocks > 2^31`;
    /// [`PoolError::Invalid`] when its blocks, fully cached, would need more memory than the
    /// machine has (96 bytes each on 64-bit targets; checked before allocating), or when the
    /// block table cannot be allocated (an error, not an abort).
    pub fn new(
        num_blocks: i64,
        enable_caching: bool,
        hash_block_size: usize,
        events_enabled: bool,
    ) -> Result<Self, PoolError> {
        if num_blocks <= 0 || num_blocks > MAX_BLOCKS {
            return Err(PoolError::InvalidPoolSize(num_blocks));
        }
        if hash_block_size == 0 {
            return Err(PoolError::Invalid(
                "hash_block_size must be positive".into(),
            ));
        }
        let n = num_blocks as usize;
        let need = (n as u64).saturating_mul(BYTES_PER_BLOCK);
        if let Some(mem) = crate::huge::physical_memory().filter(|&mem| need > mem) {
            return Err(PoolError::Invalid(format!(
                "a pool of {n} blocks needs up to {need} bytes, more than this machine's \
                 {mem} bytes of memory"
            )));
        }
        let head = n as u32;
        let tail = head + 1;
        let mut nodes = HugeVec::new_in(HugePages);
        nodes.try_reserve_exact(n + 2 * NUM_LEVELS).map_err(|_| {
            PoolError::Invalid(format!("cannot allocate the block table of {n} blocks"))
        })?;
        nodes.resize(n + 2 * NUM_LEVELS, EMPTY_NODE);
        for l in 1..NUM_LEVELS {
            let h = n + 2 * l;
            nodes[h].next = h as u32 + 1;
            nodes[h + 1].prev = h as u32;
        }
        // Level 0 is [1..n-1]; block 0 is the null block and never linked.
        let mut last = head;
        for b in 1..n as u32 {
            nodes[last as usize].next = b;
            nodes[b as usize].prev = last;
            last = b;
        }
        nodes[last as usize].next = tail;
        nodes[tail as usize].prev = last;
        Ok(Self {
            num_blocks: n,
            enable_caching,
            hash_block_size,
            events_enabled,
            nodes,
            num_free: n - 1,
            primaries: HugeVec::new_in(HugePages),
            free_slots: Vec::new(),
            index: PrefixIndex::new(),
            alias_records: HugeVec::new_in(HugePages),
            free_aliases: Vec::new(),
            aliases: HashMap::new(),
            events: Vec::new(),
            block_ops: None,
            levels: u128::from(n > 1),
            deadlines: Deadlines::new(),
            pins: Pins::new(),
            exact_events: false,
        })
    }

    // ----------------------------------------------------------------- accessors

    /// Number of blocks, the null block included.
    pub fn num_blocks(&self) -> usize {
        self.num_blocks
    }

    /// Whether prefix caching is on.
    pub fn enable_caching(&self) -> bool {
        self.enable_caching
    }

    /// Tokens per hash block.
    pub fn hash_block_size(&self) -> usize {
        self.hash_block_size
    }

    /// Whether KV events are recorded.
    pub fn events_enabled(&self) -> bool {
        self.events_enabled
    }

    /// The null block's id (always 0).
    pub const fn null_block() -> BlockId {
        0
    }

    /// Number of blocks in the free queue (SPEC POOL-2).
    #[inline]
    pub fn get_num_free_blocks(&self) -> usize {
        self.num_free
    }

    /// Fraction of the non-null blocks in use; `None` for a pool with only the null block, where
    /// the reference returns the integer 0 (SPEC POOL-3).
    pub fn get_usage(&self) -> Option<f64> {
        let total = self.num_blocks - 1;
        if total == 0 {
            None
        } else {
            Some(1.0 - self.num_free as f64 / total as f64)
        }
    }

    /// Checks that `id` names a block of this pool.
    ///
    /// # Errors
    /// [`PoolError::BlockOutOfRange`] otherwise.
    #[inline]
    pub fn check_id(&self, id: i64) -> Result<BlockId, PoolError> {
        if id < 0 || id as u64 >= self.num_blocks as u64 {
            Err(PoolError::BlockOutOfRange {
                block_id: id,
                num_blocks: self.num_blocks,
            })
        } else {
            Ok(id as BlockId)
        }
    }

    fn check_ids(&self, ids: &[BlockId]) -> Result<(), PoolError> {
        match ids.iter().find(|&&b| b as usize >= self.num_blocks) {
            Some(&b) => Err(PoolError::BlockOutOfRange {
                block_id: i64::from(b),
                num_blocks: self.num_blocks,
            }),
            None => Ok(()),
        }
    }

    /// The reference count of a block (the null block's may be negative, SPEC BLK-3).
    #[inline]
    pub fn ref_cnt(&self, block: BlockId) -> i32 {
        self.nodes[block as usize].ref_cnt
    }

    /// Whether `block` is the null block.
    #[inline]
    pub fn is_null(block: BlockId) -> bool {
        block == 0
    }

    /// The block's primary key and the number of tokens it covers, if it has one (`None` for
    /// an id outside the pool, which callers may hold from unchecked hits).
    pub fn primary_key(&self, block: BlockId) -> Option<(BlockKey, usize)> {
        let slot = self.nodes.get(block as usize)?.primary_slot;
        (slot != NIL).then(|| {
            let p = self.primaries[slot as usize];
            (p.key, p.num_tokens as usize)
        })
    }

    /// Whether the block has a primary key.
    #[inline]
    pub fn has_hash(&self, block: BlockId) -> bool {
        self.nodes[block as usize].primary_slot != NIL
    }

    /// The block's alias keys, oldest first (SPEC MAP-6).
    pub fn alias_keys(&self, block: BlockId) -> Vec<BlockKey> {
        self.aliases.get(&block).map_or_else(Vec::new, |ids| {
            ids.iter()
                .map(|&a| self.alias_records[a as usize].key)
                .collect()
        })
    }

    /// Whether `block` holds `key` (as primary or alias), which is exactly when the index lists
    /// it under `key`.
    fn holds(&self, block: BlockId, key: &BlockKey) -> bool {
        if self.primary_key(block).is_some_and(|(k, _)| k == *key) {
            return true;
        }
        !self.aliases.is_empty()
            && self.aliases.get(&block).is_some_and(|ids| {
                ids.iter()
                    .any(|&a| self.alias_records[a as usize].key == *key)
            })
    }

    /// Number of keys in the prefix-cache index (SPEC MAP-5).
    pub fn num_cached_keys(&self) -> usize {
        self.index.num_keys()
    }

    /// Whether the block is linked in the free queue.
    #[inline]
    fn is_queued(&self, block: BlockId) -> bool {
        let b = block as usize;
        self.nodes[b].prev != NIL || self.nodes[b].next != NIL
    }

    /// The free queue front to back (SPEC FQ-6): level by level, each front to back.
    pub fn all_free_block_ids(&self) -> Vec<BlockId> {
        let mut out = Vec::with_capacity(self.num_free);
        for l in 0..NUM_LEVELS {
            let (head, tail) = self.sentinels(l);
            let mut cur = self.nodes[head as usize].next;
            while cur != tail && cur != NIL {
                out.push(cur);
                cur = self.nodes[cur as usize].next;
            }
        }
        out
    }

    // ----------------------------------------------------------------- index

    /// The earliest inserted block still stored under `key` (SPEC MAP-2).
    #[inline]
    pub fn get_one_block(&self, key: &BlockKey) -> Option<BlockId> {
        let keys = PairKeys::of(self);
        self.index
            .first(mix(key), |p| keys.is(p, key))
            .map(|p| keys.block(p))
    }

    /// Every block stored under `key`, in insertion order (SPEC MAP-1).
    pub fn blocks_of(&self, key: &BlockKey) -> Vec<BlockId> {
        let keys = PairKeys::of(self);
        self.index
            .all(mix(key), |p| keys.is(p, key))
            .into_iter()
            .map(|p| keys.block(p))
            .collect()
    }

    /// Whether `key` lists `block` (SPEC MAP-7).
    pub fn contains(&self, key: &BlockKey, block: BlockId) -> bool {
        (block as usize) < self.num_blocks && self.holds(block, key)
    }

    /// `[MAP-2(hash‖g) for g in group_ids]`, or `None` when any group misses (SPEC POOL-4).
    pub fn get_cached_block(&self, hash: &BlockHash, group_ids: &[u32]) -> Option<Vec<BlockId>> {
        group_ids
            .iter()
            .map(|&g| self.get_one_block(&BlockKey::new(*hash, g)))
            .collect()
    }

    /// Walks `hashes` from the front and collects, per group, the cached block of each hash,
    /// stopping at the first hash that misses in any group (the full-attention hit search, SPEC
    /// FA-1, in one call).
    pub fn longest_cached_prefix(
        &self,
        hashes: impl IntoIterator<Item = BlockHash>,
        group_ids: &[u32],
    ) -> Vec<Vec<BlockId>> {
        if let [g] = group_ids {
            return vec![self.longest_prefix_in(hashes, *g)];
        }
        let mut out: Vec<Vec<BlockId>> = vec![Vec::new(); group_ids.len()];
        'outer: for h in hashes {
            let start = out.first().map_or(0, Vec::len);
            for (gi, &g) in group_ids.iter().enumerate() {
                match self.get_one_block(&BlockKey::new(h, g)) {
                    Some(b) => out[gi].push(b),
                    None => {
                        for v in out.iter_mut().take(gi) {
                            v.truncate(start);
                        }
                        break 'outer;
                    }
                }
            }
        }
        out
    }

    /// The sliding-window hit search (SPEC SWA-3) in one call: scans the first `max_blocks`
    /// hashes right to left for `need` consecutive blocks cached in every group, the run's end
    /// aligned to `alignment` tokens, and returns per group the hit blocks (the null block
    /// before the run). Without such a run it returns the leading run that was found, cut to
    /// the alignment; with `drop_eagle` the last hit block is dropped (EAGLE-1). `hash_at(i)` reads
    /// hash `i` (`None`: a hash no block can have, a miss).
    ///
    /// # Errors
    /// What `hash_at` returns.
    #[allow(clippy::too_many_arguments)]
    pub fn sliding_window_hit<E>(
        &self,
        max_blocks: usize,
        hash_at: &mut dyn FnMut(usize) -> Result<Option<BlockHash>, E>,
        group_ids: &[u32],
        need: usize,
        block_size: usize,
        alignment: usize,
        drop_eagle: bool,
    ) -> Result<Vec<Vec<BlockId>>, E> {
        let null = Self::null_block();
        let mut computed: Vec<Vec<BlockId>> = vec![vec![null; max_blocks]; group_ids.len()];
        if group_ids.is_empty() {
            return Ok(computed);
        }
        let misaligned = |blocks: usize| !(blocks * block_size).is_multiple_of(alignment);
        let mut run = 0usize;
        let mut found = false;
        for i in (0..max_blocks).rev() {
            let hit = hash_at(i)?.and_then(|h| self.get_cached_block(&h, group_ids));
            let Some(hit) = hit else {
                run = 0;
                continue;
            };
            if run == 0 && block_size != alignment {
                let kept = if drop_eagle { i } else { i + 1 };
                if misaligned(kept) {
                    continue;
                }
            }
            for (c, b) in computed.iter_mut().zip(hit) {
                c[i] = b;
            }
            run += 1;
            if run >= need {
                for c in &mut computed {
                    c.truncate(i + run);
                }
                found = true;
                break;
            }
        }
        let pop_all = |computed: &mut Vec<Vec<BlockId>>| {
            for c in computed.iter_mut() {
                c.pop();
            }
        };
        if !found {
            for c in &mut computed {
                c.truncate(run);
            }
            if block_size != alignment {
                while misaligned(computed[0].len()) {
                    pop_all(&mut computed);
                }
            }
        }
        if drop_eagle && !computed[0].is_empty() {
            pop_all(&mut computed);
            if block_size != alignment {
                while misaligned(computed[0].len()) {
                    pop_all(&mut computed);
                }
            }
        }
        Ok(computed)
    }

    /// The Mamba hit search (SPEC MAMBA-2) in one call: the last of the first `max_blocks`
    /// hashes whose block ends on an `alignment`-token boundary and is cached in every group,
    /// as its position and the block of each group. `hash_at(i)` reads hash `i` (`None`: a
    /// miss).
    ///
    /// # Errors
    /// What `hash_at` returns.
    pub fn last_aligned_hit<E>(
        &self,
        max_blocks: usize,
        hash_at: &mut dyn FnMut(usize) -> Result<Option<BlockHash>, E>,
        group_ids: &[u32],
        block_size: usize,
        alignment: usize,
    ) -> Result<Option<(usize, Vec<BlockId>)>, E> {
        for i in (0..max_blocks).rev() {
            if block_size != alignment && !((i + 1) * block_size).is_multiple_of(alignment) {
                continue;
            }
            if let Some(hit) = hash_at(i)?.and_then(|h| self.get_cached_block(&h, group_ids)) {
                if !hit.is_empty() {
                    return Ok(Some((i, hit)));
                }
            }
        }
        Ok(None)
    }

    /// [`Self::longest_cached_prefix`] for one group, looked up in chunks whose cache misses
    /// overlap: the chunk's index lines are prefetched together, then the blocks its tags point
    /// at, then those blocks' keys, and only then is each hit confirmed in order. Chunks start
    /// small (a miss on the first block wastes little) and double.
    fn longest_prefix_in(
        &self,
        hashes: impl IntoIterator<Item = BlockHash>,
        g: u32,
    ) -> Vec<BlockId> {
        let keys = PairKeys::of(self);
        let mut hashes = hashes.into_iter();
        let mut out = Vec::new();
        let mut chunk: Vec<(BlockKey, u64, Option<u32>)> = Vec::new();
        let mut size = 4;
        loop {
            chunk.clear();
            chunk.extend(hashes.by_ref().take(size).map(|h| {
                let key = BlockKey::new(h, g);
                let m = mix(&key);
                self.index.prefetch(m);
                (key, m, None)
            }));
            if chunk.is_empty() {
                return out;
            }
            for c in &mut chunk {
                c.2 = self.index.candidate(c.1);
                if let Some(p) = c.2 {
                    keys.prefetch_pair(p);
                }
            }
            for c in &chunk {
                if let Some(p) = c.2 {
                    keys.prefetch_key(p);
                }
            }
            for (key, m, _) in &chunk {
                match self.index.first(*m, |p| keys.is(p, key)) {
                    Some(p) => out.push(keys.block(p)),
                    None => return out,
                }
            }
            size = (size * 2).min(32);
        }
    }

    /// The mixed hashes of the primary keys of the first `n` queued blocks (the ones
    /// `get_new_blocks` evicts next; 0 for a block without a key). Their loads are independent
    /// of the queue walk, so they overlap.
    fn eviction_mixes(&self, n: usize) -> Vec<u64> {
        let mut out = Vec::with_capacity(n);
        let mut b = self.queue_after(self.num_blocks as u32);
        for i in 0..n {
            let slot = self.nodes[b as usize].primary_slot;
            out.push(self.primaries.get(slot as usize).map_or(0, |p| mix(&p.key)));
            if i + 1 < n {
                b = self.queue_after(b);
            }
        }
        out
    }

    /// Prefetches the index line of `mixes[i + PREFETCH_AHEAD]` (and, at `i == 0`, of the
    /// ones before it): a sliding window keeps a few misses in flight while each operation
    /// finds its own line cached. A wrong or stale hash only wastes the prefetch.
    #[inline]
    fn prefetch_window(&self, mixes: &[u64], i: usize) {
        if i == 0 {
            for &m in mixes.iter().take(PREFETCH_AHEAD) {
                self.index.prefetch(m);
            }
        }
        if let Some(&m) = mixes.get(i + PREFETCH_AHEAD) {
            self.index.prefetch(m);
        }
    }

    fn set_primary(&mut self, block: BlockId, key: BlockKey, num_tokens: u32) {
        let slot = slab_put(
            &mut self.primaries,
            &mut self.free_slots,
            Primary { key, num_tokens },
        );
        self.nodes[block as usize].primary_slot = slot;
    }

    fn clear_primary(&mut self, block: BlockId) {
        let slot = std::mem::replace(&mut self.nodes[block as usize].primary_slot, NIL);
        if slot != NIL {
            self.free_slots.push(slot);
        }
    }

    /// SPEC POOL-31: stores `block` under `key` unless it already is.
    fn insert_key(&mut self, key: BlockKey, block: BlockId, num_tokens: u32) {
        if self.holds(block, &key) {
            return;
        }
        let pair = if self.has_hash(block) {
            let a = slab_put(
                &mut self.alias_records,
                &mut self.free_aliases,
                Alias { key, block },
            );
            self.aliases.entry(block).or_default().push(a);
            // Below u32::MAX: at most 2^31 blocks and fewer than 2^31 live aliases (each
            // takes 44 bytes).
            self.num_blocks as u32 + a
        } else {
            self.set_primary(block, key, num_tokens);
            block
        };
        let keys = PairKeys::split(
            &self.nodes,
            &self.primaries,
            &self.alias_records,
            self.num_blocks,
        );
        self.index.insert(mix(&key), pair, |p| keys.is(p, &key));
    }

    /// Removes every key of `block` (primary first, then aliases), resets its hash and emits one
    /// `BlockRemoved` per key actually removed (SPEC POOL-6).
    fn remove_keys(&mut self, block: BlockId) {
        let primary = self.primary_key(block).map(|(k, _)| (block, k));
        // Aliases are rare: skip the probe while there are none.
        let aliases = if self.aliases.is_empty() {
            None
        } else {
            self.aliases.remove(&block)
        };
        if primary.is_none() && aliases.is_none() {
            return;
        }
        let n = self.num_blocks as u32;
        let alias_pairs = aliases
            .iter()
            .flatten()
            .map(|&a| (n + a, self.alias_records[a as usize].key))
            .collect::<Vec<_>>();
        let keys = PairKeys::split(
            &self.nodes,
            &self.primaries,
            &self.alias_records,
            self.num_blocks,
        );
        for (pair, key) in primary.into_iter().chain(alias_pairs) {
            if self.index.remove(mix(&key), pair, |p| keys.is(p, &key))
                && self.events_enabled
                && !(self.exact_events
                    && self.index.first(mix(&key), |p| keys.is(p, &key)).is_some())
            {
                self.events.push(KvEvent::BlockRemoved {
                    block_hash: key.hash,
                    group_idx: key.group_id,
                });
            }
        }
        self.free_aliases.extend(aliases.into_iter().flatten());
        self.clear_primary(block);
    }

    // ----------------------------------------------------------------- queue

    #[inline]
    fn unlink(&mut self, block: BlockId) {
        let b = block as usize;
        let (p, n) = (self.nodes[b].prev, self.nodes[b].next);
        self.nodes[p as usize].next = n;
        self.nodes[n as usize].prev = p;
        self.nodes[b].prev = NIL;
        self.nodes[b].next = NIL;
        self.num_free -= 1;
    }

    #[inline]
    fn link_after(&mut self, after: u32, block: BlockId) {
        let b = block as usize;
        let n = self.nodes[after as usize].next;
        self.nodes[b].prev = after;
        self.nodes[b].next = n;
        self.nodes[after as usize].next = block;
        self.nodes[n as usize].prev = block;
        self.num_free += 1;
    }

    /// The head and tail sentinels of level `l`.
    #[inline]
    fn sentinels(&self, l: usize) -> (u32, u32) {
        let h = (self.num_blocks + 2 * l) as u32;
        (h, h + 1)
    }

    /// Queues `b` at the back of level `l`.
    #[inline]
    fn link_back(&mut self, l: usize, b: BlockId) {
        let (_, tail) = self.sentinels(l);
        let last = self.nodes[tail as usize].prev;
        self.link_after(last, b);
        self.levels |= 1u128 << l;
    }

    /// Queues `blocks` at the back of level `l`, in order.
    #[inline]
    fn append_back(&mut self, l: usize, blocks: &[BlockId]) {
        if blocks.is_empty() {
            return;
        }
        let (_, tail) = self.sentinels(l);
        let mut last = self.nodes[tail as usize].prev;
        for &b in blocks {
            self.link_after(last, b);
            last = b;
        }
        self.levels |= 1u128 << l;
    }

    /// The block at the front of the queue (the next to evict); the queue must not be empty.
    #[inline]
    fn queue_front(&mut self) -> BlockId {
        debug_assert!(self.num_free > 0);
        loop {
            let l = self.levels.trailing_zeros() as usize;
            let (head, tail) = self.sentinels(l);
            let b = self.nodes[head as usize].next;
            if b != tail {
                return b;
            }
            self.levels &= !(1u128 << l);
        }
    }

    /// The queued block after `b` (a block or level 0's head) in eviction order, across
    /// levels; a tail sentinel when there is none.
    #[inline]
    fn queue_after(&self, b: u32) -> u32 {
        let next = self.nodes[b as usize].next;
        if (next as usize) < self.num_blocks {
            return next;
        }
        self.next_level_front(next)
    }

    /// [`Self::queue_after`] past the tail sentinel `tail` of a level: the front of the next
    /// level that holds blocks (found through the level bitmap), or `tail` when none does.
    #[cold]
    fn next_level_front(&self, tail: u32) -> u32 {
        let l = (tail as usize - self.num_blocks) / 2;
        // Bits above l; a set bit may name a level found empty later (cleared lazily).
        let mut rest = self.levels & !(u128::MAX >> (127 - l));
        while rest != 0 {
            let (head, t) = self.sentinels(rest.trailing_zeros() as usize);
            let first = self.nodes[head as usize].next;
            if first != t {
                return first;
            }
            rest &= rest - 1;
        }
        tail
    }

    /// Takes `b` out of the queue, forgetting any retention deadline it had.
    #[inline]
    fn dequeue(&mut self, b: BlockId) {
        self.unlink(b);
        if !self.deadlines.is_empty() {
            self.deadlines.remove(b);
        }
    }

    // ----------------------------------------------------------------- cache control

    /// Whether [`Self::expire`] may change anything at `now`.
    #[inline]
    pub fn needs_expire(&self, now: f64) -> bool {
        now >= self.deadlines.next_due() || now >= self.pins.next_due()
    }

    /// The earliest time at which [`Self::expire`] may change anything (`INFINITY`: never).
    pub fn next_expiry(&self) -> f64 {
        self.deadlines.next_due().min(self.pins.next_due())
    }

    /// Applies the deadlines due at `now` (kvcore extension): a freed block whose retention
    /// time to live ran out moves to the back of level 0 (ahead of every priority, behind
    /// blocks with no key), and an expired pin is released as by [`Self::unpin_prefix`].
    pub fn expire(&mut self, now: f64) {
        for b in self.deadlines.take_due(now) {
            if self.is_queued(b) {
                self.unlink(b);
                self.link_back(FRONT, b);
            }
        }
        for b in self.pins.take_due(now) {
            self.release_pinned(b);
        }
    }

    /// Number of pinned blocks.
    pub fn num_pinned_blocks(&self) -> usize {
        self.pins.len()
    }

    /// Whether `block` is pinned.
    pub fn is_pinned(&self, block: BlockId) -> bool {
        self.pins.contains(block)
    }

    /// Pins, per group, every cached copy of the leading hashes that have one, stopping at the
    /// first hash with none (kvcore extension). A pin holds a reference until `ttl_s` seconds
    /// after `now` (or until unpinned, without one); pinning a pinned block moves its deadline.
    /// Returns, per group, how many leading hashes are now pinned.
    ///
    /// # Errors
    /// [`PoolError::PinLimit`] when more than `max_pinned` blocks would be pinned,
    /// [`PoolError::Invalid`] for a negative or non-finite `ttl_s`; nothing changes.
    pub fn pin_prefix(
        &mut self,
        groups: &[(u32, &[BlockHash])],
        ttl_s: Option<f64>,
        now: f64,
        max_pinned: usize,
    ) -> Result<Vec<usize>, PoolError> {
        if let Some(t) = ttl_s {
            retention::check_ttl(t, "ttl_s")?;
        }
        let deadline = ttl_s.map(|t| now + t);
        let mut counts = Vec::with_capacity(groups.len());
        let mut blocks: Vec<BlockId> = Vec::new();
        for &(g, hashes) in groups {
            let mut n = 0;
            for h in hashes {
                let copies = self.blocks_of(&BlockKey::new(*h, g));
                if copies.is_empty() {
                    break;
                }
                blocks.extend(copies);
                n += 1;
            }
            counts.push(n);
        }
        blocks.sort_unstable();
        blocks.dedup();
        let new = blocks.iter().filter(|&&b| !self.pins.contains(b)).count();
        if self.pins.len() + new > max_pinned {
            return Err(PoolError::PinLimit {
                pinned: self.pins.len(),
                requested: new,
                max: max_pinned,
            });
        }
        if let Some(&b) = blocks.iter().find(|&&b| self.ref_cnt(b) == i32::MAX) {
            return Err(PoolError::Invalid(format!(
                "reference count of block {b} would overflow"
            )));
        }
        for b in blocks {
            if self.pins.set(b, deadline) {
                if self.nodes[b as usize].ref_cnt == 0 {
                    self.dequeue(b);
                }
                self.nodes[b as usize].ref_cnt += 1;
            }
        }
        Ok(counts)
    }

    /// Releases, per group, every pin on the cached copies of the leading hashes, walking them
    /// as [`Self::pin_prefix`] does (up to the first hash with no cached copy); a released block
    /// no one else holds joins the back of the default level, still cached (kvcore extension).
    /// Returns, per group, how many of those hashes had a pin released.
    pub fn unpin_prefix(&mut self, groups: &[(u32, &[BlockHash])]) -> Vec<usize> {
        let mut counts = Vec::with_capacity(groups.len());
        for &(g, hashes) in groups {
            let mut n = 0;
            for h in hashes {
                let copies = self.blocks_of(&BlockKey::new(*h, g));
                if copies.is_empty() {
                    break;
                }
                let mut released = false;
                for b in copies {
                    if self.pins.remove(b) {
                        self.release_pinned(b);
                        released = true;
                    }
                }
                n += usize::from(released);
            }
            counts.push(n);
        }
        counts
    }

    /// Makes every block cached so far unfindable while requests keep running (kvcore
    /// extension): all keys are dropped (one `AllBlocksCleared` event), pins are released, and
    /// held and free blocks alike stay where they are.
    pub fn invalidate_prefix_cache(&mut self) {
        for b in self.pins.take_all() {
            self.release_pinned(b);
        }
        self.clear_index();
    }

    /// Turns router-exact events on or off (kvcore extension): `BlockStored` names only keys
    /// that had no block before, `BlockRemoved` only keys whose last block left.
    pub fn set_exact_router_events(&mut self, on: bool) {
        self.exact_events = on;
    }

    /// Whether router-exact events are on.
    pub fn exact_router_events(&self) -> bool {
        self.exact_events
    }

    // ----------------------------------------------------------------- operations

    /// Pops `n` blocks from the front of the free queue, evicting their keys when caching is
    /// on, and hands them out with `ref_cnt = 1` (SPEC POOL-5, POOL-6).
    ///
    /// # Errors
    /// [`PoolError::NotEnoughFreeBlocks`] when `n` exceeds the free count; nothing changes
    /// (and nothing is allocated, whatever `n`).
    pub fn get_new_blocks(&mut self, n: usize) -> Result<Vec<BlockId>, PoolError> {
        // `get_new_blocks_into` checks `n` against the free count before reserving.
        let mut out = Vec::new();
        self.get_new_blocks_into(n, &mut out)?;
        Ok(out)
    }

    /// Like [`Self::get_new_blocks`], appending to `out`.
    ///
    /// # Errors
    /// As [`Self::get_new_blocks`].
    pub fn get_new_blocks_into(
        &mut self,
        n: usize,
        out: &mut Vec<BlockId>,
    ) -> Result<(), PoolError> {
        if n > self.num_free {
            return Err(PoolError::NotEnoughFreeBlocks {
                requested: n,
                free: self.num_free,
            });
        }
        out.reserve(n);
        let mixes = if self.enable_caching && n > 1 {
            self.eviction_mixes(n)
        } else {
            Vec::new()
        };
        // The level being emptied, as its sentinels: most pops take the next block of it.
        let (mut head, mut tail) = (NIL, NIL);
        let track = !self.deadlines.is_empty();
        for i in 0..n {
            self.prefetch_window(&mixes, i);
            let mut b = if head == NIL {
                tail
            } else {
                self.nodes[head as usize].next
            };
            if b == tail {
                b = self.queue_front();
                let l = self.levels.trailing_zeros() as usize;
                (head, tail) = self.sentinels(l);
            }
            self.unlink(b);
            if track {
                self.deadlines.remove(b);
            }
            if self.enable_caching {
                self.remove_keys(b);
            }
            debug_assert_eq!(self.nodes[b as usize].ref_cnt, 0);
            self.nodes[b as usize].ref_cnt = 1;
            out.push(b);
            if let Some(ops) = &mut self.block_ops {
                if self.enable_caching {
                    ops.push(BlockOp::Evicted(b));
                }
                ops.push(BlockOp::Allocated(b));
            }
        }
        Ok(())
    }

    /// Takes a reference on each block, dequeuing those that were free (SPEC POOL-9).
    ///
    /// # Errors
    /// [`PoolError::BlockOutOfRange`], or [`PoolError::NotFreeNorReferenced`] for a block with
    /// `ref_cnt == 0` outside the queue. All ids are checked before anything changes.
    pub fn touch(&mut self, blocks: &[BlockId]) -> Result<(), PoolError> {
        self.check_touch(blocks)?;
        for &b in blocks {
            if self.nodes[b as usize].ref_cnt == 0 && b != 0 {
                self.dequeue(b);
            }
            self.nodes[b as usize].ref_cnt += 1;
        }
        if let Some(ops) = &mut self.block_ops {
            ops.extend(blocks.iter().map(|&b| BlockOp::Accessed(b)));
        }
        Ok(())
    }

    /// [`Self::touch`]'s refusals, without changing anything.
    ///
    /// # Errors
    /// As [`Self::touch`].
    pub fn check_touch(&self, blocks: &[BlockId]) -> Result<(), PoolError> {
        self.check_ids(blocks)?;
        for &b in blocks {
            let rc = self.nodes[b as usize].ref_cnt;
            if rc == 0 && b != 0 && !self.is_queued(b) {
                return Err(PoolError::NotFreeNorReferenced(b));
            }
            if rc == i32::MAX {
                return Err(PoolError::Invalid(format!(
                    "reference count of block {b} would overflow"
                )));
            }
        }
        Ok(())
    }

    /// Drops one reference per listed block; blocks reaching 0 rejoin the queue, unhashed ones
    /// at the front and hashed ones at the back, each group in list order (SPEC POOL-10).
    ///
    /// # Errors
    /// [`PoolError::BlockOutOfRange`], or [`PoolError::DoubleFree`] when a non-null block would
    /// go below 0. All ids are checked before anything changes.
    pub fn free_blocks(&mut self, ordered: &[BlockId]) -> Result<(), PoolError> {
        self.free_blocks_iter(ordered.iter().copied())
    }

    /// [`Self::free_blocks`] over any re-iterable sequence (e.g. a reversed slice).
    ///
    /// # Errors
    /// As [`Self::free_blocks`].
    pub fn free_blocks_iter<I>(&mut self, ordered: I) -> Result<(), PoolError>
    where
        I: IntoIterator<Item = BlockId> + Clone,
    {
        self.free_blocks_retained(ordered, Retention::DEFAULT, 0.0)
    }

    /// [`Self::free_blocks_iter`] for a request with a retention (kvcore extension): cached
    /// blocks reaching 0 join the back of the retention priority's level, and with a time to
    /// live they expire `ttl_s` seconds after `now` (see [`Self::expire`]). With
    /// [`Retention::DEFAULT`] this is exactly `free_blocks`.
    ///
    /// # Errors
    /// As [`Self::free_blocks`].
    pub fn free_blocks_retained<I>(
        &mut self,
        ordered: I,
        retention: Retention,
        now: f64,
    ) -> Result<(), PoolError>
    where
        I: IntoIterator<Item = BlockId> + Clone,
    {
        self.validate_free(ordered.clone())?;
        let mut with_hash: Vec<BlockId> = Vec::new();
        let mut without_hash: Vec<BlockId> = Vec::new();
        for b in ordered {
            let rc = &mut self.nodes[b as usize].ref_cnt;
            *rc -= 1;
            if *rc == 0 && b != 0 {
                if self.nodes[b as usize].primary_slot == NIL {
                    without_hash.push(b);
                } else {
                    with_hash.push(b);
                }
            }
        }
        self.prepend_front(&without_hash);
        self.append_back(1 + usize::from(retention.priority()), &with_hash);
        if let Some(ttl) = retention.ttl_s() {
            for &b in &with_hash {
                self.deadlines.add(b, now, ttl);
            }
        }
        Ok(())
    }

    /// Queues `blocks` at the very front of the queue, in order (the reference's `prepend_n`).
    fn prepend_front(&mut self, blocks: &[BlockId]) {
        let mut after = self.num_blocks as u32;
        for &b in blocks {
            self.link_after(after, b);
            after = b;
        }
        if !blocks.is_empty() {
            self.levels |= 1u128 << FRONT;
        }
    }

    /// Drops one reference on `b` (held by a pin) and queues it when that was the last, at the
    /// back of the default level if cached, else at the front.
    fn release_pinned(&mut self, b: BlockId) {
        let rc = &mut self.nodes[b as usize].ref_cnt;
        *rc -= 1;
        if *rc == 0 {
            if self.has_hash(b) {
                self.link_back(DEFAULT_LEVEL, b);
            } else {
                self.prepend_front(&[b]);
            }
        }
    }

    /// Checks that freeing `ordered` takes no non-null block below 0, counting repeats, by
    /// decrementing tentatively and undoing the decrements afterwards.
    fn validate_free<I>(&mut self, ordered: I) -> Result<(), PoolError>
    where
        I: IntoIterator<Item = BlockId> + Clone,
    {
        let mut done = 0usize;
        let mut err = None;
        for b in ordered.clone() {
            if b as usize >= self.num_blocks {
                err = Some(PoolError::BlockOutOfRange {
                    block_id: i64::from(b),
                    num_blocks: self.num_blocks,
                });
                break;
            }
            let rc = self.nodes[b as usize].ref_cnt;
            if (b != 0 && rc <= 0) || rc == i32::MIN {
                err = Some(PoolError::DoubleFree(b));
                break;
            }
            self.nodes[b as usize].ref_cnt = rc - 1;
            done += 1;
        }
        for b in ordered.into_iter().take(done) {
            self.nodes[b as usize].ref_cnt += 1;
        }
        err.map_or(Ok(()), Err)
    }

    /// Stores the request's newly full blocks in the prefix cache (SPEC POOL-13..17):
    /// [`Self::prepare_full_blocks`], then [`Self::commit_full_blocks`].
    ///
    /// # Errors
    /// [`Self::prepare_full_blocks`]'s; nothing changes then.
    #[allow(clippy::too_many_arguments)]
    pub fn cache_full_blocks<E: From<PoolError>>(
        &mut self,
        new_blocks: &[BlockId],
        num_cached: usize,
        num_full: usize,
        block_size: usize,
        group_id: u32,
        mask: Option<&[bool]>,
        hashes: HashSource<'_, E>,
        meta: &mut dyn FnMut(&MetaRequest<'_>) -> Result<StoredMeta, E>,
    ) -> Result<(), E> {
        if let Some(p) = self.prepare_full_blocks(
            new_blocks, num_cached, num_full, block_size, group_id, mask, hashes, meta,
        )? {
            self.commit_full_blocks(p);
        }
        Ok(())
    }

    /// What [`Self::cache_full_blocks`] stores, read and checked without changing anything
    /// (`None`: nothing to store), so that a caller caching several groups can refuse before
    /// any of them changes.
    ///
    /// `new_blocks` is `blocks[num_cached..num_full]` of the request's list for the group; `hashes` is the hash view at
    /// `block_size` granularity (the caller builds the HBS view, SPEC RH-3). `meta` is called
    /// once, only when events are on, with the ranges the event describes.
    ///
    /// # Errors
    /// Every precondition: block ids, mask length, view length, promotions (SPEC POOL-16),
    /// and errors returned by `hashes` or `meta`.
    #[allow(clippy::too_many_arguments)]
    pub fn prepare_full_blocks<E: From<PoolError>>(
        &self,
        new_blocks: &[BlockId],
        num_cached: usize,
        num_full: usize,
        block_size: usize,
        group_id: u32,
        mask: Option<&[bool]>,
        hashes: HashSource<'_, E>,
        meta: &mut dyn FnMut(&MetaRequest<'_>) -> Result<StoredMeta, E>,
    ) -> Result<Option<PreparedCache>, E> {
        if num_cached >= num_full {
            return Ok(None);
        }
        if !block_size.is_multiple_of(self.hash_block_size) {
            return Err(PoolError::BlockSizeNotMultiple {
                block_size,
                hash_block_size: self.hash_block_size,
            }
            .into());
        }
        if new_blocks.len() != num_full - num_cached {
            return Err(PoolError::Invalid(format!(
                "{} blocks given for positions {num_cached}..{num_full}",
                new_blocks.len()
            ))
            .into());
        }
        if let Some(m) = mask {
            if m.len() != new_blocks.len() {
                return Err(PoolError::MaskLength {
                    expected: new_blocks.len(),
                    got: m.len(),
                }
                .into());
            }
        }
        let available = (hashes.len)()?;
        if available < num_full {
            return Err(PoolError::NotEnoughHashes {
                needed: num_full,
                available,
            }
            .into());
        }
        // Token offsets below are at most `num_full * block_size`, and events carry the block
        // size as u32 (a view of that many hashes at this block size never gets here).
        if num_full.checked_mul(block_size).is_none() || u32::try_from(block_size).is_err() {
            return Err(PoolError::Invalid(format!(
                "{num_full} blocks of {block_size} tokens exceed the token range"
            ))
            .into());
        }
        self.check_ids(new_blocks)?;
        // Gather keys and validate promotions before mutating anything.
        let mut stored: Vec<(usize, BlockId, BlockKey, u32)> = Vec::with_capacity(new_blocks.len());
        for (i, &blk) in new_blocks.iter().enumerate() {
            if blk == 0 || mask.is_some_and(|m| !m[i]) {
                continue;
            }
            let pos = num_cached + i;
            let covered = (pos + 1) * block_size;
            if let Some((_, have)) = self.primary_key(blk) {
                if have >= covered {
                    return Err(PoolError::NotAPromotion {
                        block_id: blk,
                        have,
                        covered,
                    }
                    .into());
                }
            }
            let covered = u32::try_from(covered)
                .map_err(|_| PoolError::Invalid("token count exceeds u32".into()))?;
            let hash = (hashes.get)(pos)?;
            stored.push((pos, blk, BlockKey::new(hash, group_id), covered));
        }
        // One event for the whole call; router-exact events describe each run of blocks
        // whose key had no block before instead.
        let mut events: Vec<(Option<BlockHash>, Vec<BlockHash>, StoredMeta)> = Vec::new();
        if self.events_enabled {
            let runs = if self.exact_events {
                self.new_key_runs(&stored)
            } else {
                vec![(num_cached, num_full, 0..stored.len())]
            };
            for (first, end, run) in runs {
                let parent = if first == 0 {
                    None
                } else {
                    Some((hashes.get)(first - 1)?)
                };
                let run = &stored[run];
                let ranges: Vec<(usize, usize)> = run
                    .iter()
                    .map(|s| (s.0 * block_size, (s.0 + 1) * block_size))
                    .collect();
                let req = MetaRequest {
                    token_range: (first * block_size, end * block_size),
                    block_ranges: &ranges,
                    first_mm_idx: 0,
                };
                let meta = meta(&req)?;
                events.push((parent, run.iter().map(|s| s.2.hash).collect(), meta));
            }
        }
        Ok(Some(PreparedCache {
            stored,
            events,
            block_size: block_size as u32,
            group_id,
        }))
    }

    /// Stores what [`Self::prepare_full_blocks`] read (nothing can fail any more).
    pub fn commit_full_blocks(&mut self, p: PreparedCache) {
        let PreparedCache {
            stored,
            events,
            block_size,
            group_id,
        } = p;
        let mixes: Vec<u64> = if stored.len() > 1 {
            stored.iter().map(|s| mix(&s.2)).collect()
        } else {
            Vec::new()
        };
        for (i, &(_, blk, key, covered)) in stored.iter().enumerate() {
            self.prefetch_window(&mixes, i);
            if self.has_hash(blk) {
                self.remove_keys(blk);
            }
            self.insert_key(key, blk, covered);
        }
        for (parent, block_hashes, meta) in events {
            self.events.push(KvEvent::BlockStored {
                block_hashes,
                parent_block_hash: parent,
                block_size,
                group_idx: group_id,
                meta,
            });
        }
    }

    /// For router-exact events: the runs of consecutive `stored` entries whose key has no
    /// block yet (nor an earlier entry of the call), as `(first position, end position, range
    /// of entries)`.
    fn new_key_runs(
        &self,
        stored: &[(usize, BlockId, BlockKey, u32)],
    ) -> Vec<(usize, usize, std::ops::Range<usize>)> {
        let mut seen: HashSet<BlockKey> = HashSet::new();
        let mut runs: Vec<(usize, usize, std::ops::Range<usize>)> = Vec::new();
        for (i, s) in stored.iter().enumerate() {
            let new = self.get_one_block(&s.2).is_none() && seen.insert(s.2);
            if new {
                match runs.last_mut() {
                    Some(run) if run.2.end == i && run.1 == s.0 => {
                        run.1 = s.0 + 1;
                        run.2.end = i + 1;
                    }
                    _ => runs.push((s.0, s.0 + 1, i..i + 1)),
                }
            }
        }
        runs
    }

    /// Registers a prefix boundary inside an existing block (SPEC POOL-30). `num_hashes` is
    /// `len(request.block_hashes)` and `hash_at(i)` reads entry `i` of it.
    ///
    /// Returns the key, or `None` for the null block.
    ///
    /// # Errors
    /// [`PoolError::InvalidPartial`] when a precondition of POOL-30 fails; nothing changes.
    #[allow(clippy::too_many_arguments)]
    pub fn cache_partial_block<E: From<PoolError>>(
        &mut self,
        block: BlockId,
        num_tokens: usize,
        group_id: u32,
        block_size: usize,
        num_hashes: usize,
        hash_at: &mut dyn FnMut(usize) -> Result<BlockHash, E>,
        meta: &mut dyn FnMut(&MetaRequest<'_>) -> Result<StoredMeta, E>,
    ) -> Result<Option<BlockKey>, E> {
        self.check_ids(&[block])?;
        if block == 0 {
            return Ok(None);
        }
        let hbs = self.hash_block_size;
        let fail = |m: String| -> E { PoolError::InvalidPartial(m).into() };
        if block_size <= hbs {
            return Err(fail(format!(
                "block_size {block_size} must exceed hash_block_size {hbs}"
            )));
        }
        if !block_size.is_multiple_of(hbs) {
            return Err(PoolError::BlockSizeNotMultiple {
                block_size,
                hash_block_size: hbs,
            }
            .into());
        }
        if num_tokens.is_multiple_of(block_size) {
            return Err(fail(format!(
                "num_tokens {num_tokens} is a multiple of block_size {block_size}: not partial"
            )));
        }
        if !num_tokens.is_multiple_of(hbs) {
            return Err(fail(format!(
                "num_tokens {num_tokens} is not a multiple of hash_block_size {hbs}"
            )));
        }
        let m = num_tokens / hbs;
        if m == 0 || m > num_hashes {
            return Err(fail(format!(
                "num_tokens {num_tokens} needs {m} block hashes, the request has {num_hashes}"
            )));
        }
        let num_tokens_u32 = u32::try_from(num_tokens)
            .map_err(|_| PoolError::Invalid("token count exceeds u32".into()))?;
        let hash = hash_at(m - 1)?;
        let key = BlockKey::new(hash, group_id);
        let primary = self.primary_key(block);
        let already = primary.is_some_and(|(k, _)| k == key) || self.contains(&key, block);
        let copy = self.exact_events && self.get_one_block(&key).is_some();
        let event = if self.events_enabled && !already && !copy {
            let parent = if m > 1 { Some(hash_at(m - 2)?) } else { None };
            let start = (m - 1) * hbs;
            let req = MetaRequest {
                token_range: (start, num_tokens),
                block_ranges: &[(start, num_tokens)],
                first_mm_idx: if start > 0 { -1 } else { 0 },
            };
            Some((parent, start, meta(&req)?))
        } else {
            None
        };
        if !already && primary.is_some_and(|(_, have)| have < num_tokens) {
            self.remove_keys(block);
        }
        self.insert_key(key, block, num_tokens_u32);
        if let Some((parent, start, meta)) = event {
            self.events.push(KvEvent::BlockStored {
                block_hashes: vec![hash],
                parent_block_hash: parent,
                block_size: (num_tokens - start) as u32,
                group_idx: group_id,
                meta,
            });
        }
        Ok(Some(key))
    }

    /// Drops the prefix-cache keys of the given blocks without touching their reference counts
    /// or queue positions (SPEC POOL-20).
    ///
    /// # Errors
    /// [`PoolError::BlockOutOfRange`] for any id outside the pool (negative ids included, a
    /// documented deviation); nothing changes.
    pub fn evict_blocks(&mut self, ids: &[i64]) -> Result<(), PoolError> {
        let checked = ids
            .iter()
            .map(|&i| self.check_id(i))
            .collect::<Result<Vec<_>, _>>()?;
        for b in checked {
            self.remove_keys(b);
            if let Some(ops) = &mut self.block_ops {
                ops.push(BlockOp::Evicted(b));
            }
        }
        Ok(())
    }

    /// Clears the prefix cache when no block but the null block is in use (SPEC POOL-21).
    ///
    /// Pins (kvcore extension) are released first when only they hold blocks; otherwise they
    /// stay and the reset is refused.
    pub fn reset_prefix_cache(&mut self) -> bool {
        let pinned_only = self
            .pins
            .blocks()
            .filter(|&b| self.nodes[b as usize].ref_cnt == 1)
            .count();
        // A pinned block another holder shares counts as used, so this fails while one exists.
        if self.num_blocks - self.num_free != 1 + pinned_only {
            return false;
        }
        for b in self.pins.take_all() {
            self.release_pinned(b);
        }
        self.clear_index();
        true
    }

    /// Drops every key (SPEC POOL-21's clearing, without its precondition).
    fn clear_index(&mut self) {
        self.index.clear();
        self.aliases.clear();
        self.alias_records.clear();
        self.free_aliases.clear();
        for node in &mut self.nodes {
            node.primary_slot = NIL;
        }
        self.primaries.clear();
        self.free_slots.clear();
        self.deadlines.clear();
        if self.events_enabled {
            self.events.push(KvEvent::AllBlocksCleared);
        }
        if let Some(ops) = &mut self.block_ops {
            ops.push(BlockOp::Reset);
        }
    }

    /// Starts (`true`) or stops recording [`BlockOp`]s; stopping drops what was not taken.
    pub fn record_block_ops(&mut self, on: bool) {
        self.block_ops = on.then(|| self.block_ops.take().unwrap_or_default());
    }

    /// Hands over the recorded [`BlockOp`]s in order (empty while recording is off).
    pub fn take_block_ops(&mut self) -> Vec<BlockOp> {
        self.block_ops
            .as_mut()
            .map(std::mem::take)
            .unwrap_or_default()
    }

    /// Whether events are waiting to be taken.
    pub fn has_pending_events(&self) -> bool {
        !self.events.is_empty()
    }

    /// Hands over the queued events in emission order (SPEC POOL-22).
    pub fn take_events(&mut self) -> Vec<KvEvent> {
        std::mem::take(&mut self.events)
    }

    /// Number of `ids` that sit in the free queue (`ref_cnt == 0`, not null): the blocks that
    /// touching them would dequeue (used by SPEC STM-2).
    pub fn count_evictable(&self, ids: &[BlockId]) -> usize {
        ids.iter()
            .filter(|&&b| {
                b != 0 && (b as usize) < self.num_blocks && self.nodes[b as usize].ref_cnt == 0
            })
            .count()
    }

    /// Checks every invariant of the pool; returns a description of the first violation.
    ///
    /// # Errors
    /// A message naming the broken invariant.
    pub fn check_invariants(&self) -> Result<(), String> {
        let n = self.num_blocks;
        let mut count = 0usize;
        let mut seen = vec![false; n];
        for l in 0..NUM_LEVELS {
            let (head, tail) = self.sentinels(l);
            if self.nodes[head as usize].prev != NIL || self.nodes[tail as usize].next != NIL {
                return Err("sentinel links corrupted".into());
            }
            let mut prev = head;
            let mut cur = self.nodes[head as usize].next;
            if cur != tail && self.levels & (1 << l) == 0 {
                return Err(format!("level {l} holds blocks but is marked empty"));
            }
            while cur != tail {
                if cur == NIL || cur as usize >= n {
                    return Err(format!("queue link to invalid block {cur}"));
                }
                if seen[cur as usize] {
                    return Err(format!("block {cur} linked twice"));
                }
                seen[cur as usize] = true;
                if self.nodes[cur as usize].prev != prev {
                    return Err(format!("block {cur} has a wrong prev link"));
                }
                if cur == 0 {
                    return Err("the null block is queued".into());
                }
                if self.nodes[cur as usize].ref_cnt != 0 {
                    return Err(format!(
                        "queued block {cur} has ref_cnt {}",
                        self.nodes[cur as usize].ref_cnt
                    ));
                }
                if self.pins.contains(cur) {
                    return Err(format!("pinned block {cur} is queued"));
                }
                count += 1;
                prev = cur;
                cur = self.nodes[cur as usize].next;
            }
            if self.nodes[tail as usize].prev != prev {
                return Err("tail sentinel's prev link is wrong".into());
            }
        }
        for b in self.pins.blocks() {
            if b == 0 || b as usize >= n || self.nodes[b as usize].ref_cnt < 1 {
                return Err(format!("pinned block {b} holds no reference"));
            }
        }
        if count != self.num_free {
            return Err(format!("free count {} but {count} queued", self.num_free));
        }
        for (b, &queued) in seen.iter().enumerate().skip(1) {
            let rc = self.nodes[b].ref_cnt;
            if rc < 0 {
                return Err(format!("block {b} has negative ref_cnt {rc}"));
            }
            if rc == 0 && !queued {
                return Err(format!("block {b} has ref_cnt 0 but is not queued"));
            }
            if !queued && (self.nodes[b].prev != NIL || self.nodes[b].next != NIL) {
                return Err(format!("block {b} has stale queue links"));
            }
        }
        self.check_index()?;
        let live_slots = self.nodes.iter().filter(|n| n.primary_slot != NIL).count();
        if live_slots + self.free_slots.len() != self.primaries.len() {
            return Err("primary key slab out of balance".into());
        }
        Ok(())
    }
}

impl BlockPool {
    /// The index part of [`Self::check_invariants`].
    fn check_index(&self) -> Result<(), String> {
        let n = self.num_blocks;
        let keys = PairKeys::of(self);
        let mut listed: HashMap<u32, usize> = HashMap::new();
        let mut distinct: HashSet<BlockKey> = HashSet::new();
        for (pair, tag, home, at) in self.index.entries() {
            let Some(key) = keys.key(pair) else {
                return Err(format!("index lists pair {pair}, which holds no key"));
            };
            let h = mix(&key);
            if PrefixIndex::tag_of(h) != tag || self.index.home_of(h) != home {
                return Err(format!("index slot {at} does not match its key"));
            }
            if !self.index.reachable(home, at) {
                return Err(format!("index slot {at} is cut off from its home"));
            }
            *listed.entry(pair).or_default() += 1;
            distinct.insert(key);
        }
        let mut held = 0usize;
        for b in 0..n as u32 {
            let aliases = self.aliases.get(&b).map_or(&[][..], Vec::as_slice);
            if !self.has_hash(b) && !aliases.is_empty() {
                return Err(format!("block {b} has aliases but no primary key"));
            }
            if b == 0 && self.has_hash(b) {
                return Err("the null block holds a key".into());
            }
            let pairs = self.has_hash(b).then_some(b).into_iter();
            for pair in pairs.chain(aliases.iter().map(|&a| n as u32 + a)) {
                if listed.get(&pair) != Some(&1) {
                    return Err(format!(
                        "block {b} holds a key the index does not list once"
                    ));
                }
                if keys.block(pair) != b {
                    return Err(format!("alias pair {pair} names another block"));
                }
                held += 1;
            }
        }
        if listed.len() != held || self.index.num_pairs() != held {
            return Err(format!(
                "index lists {} (key, block) pairs, blocks hold {held}",
                self.index.num_pairs()
            ));
        }
        if distinct.len() != self.index.num_keys() {
            return Err(format!(
                "index counts {} keys, lists {}",
                self.index.num_keys(),
                distinct.len()
            ));
        }
        let live_aliases: usize = self.aliases.values().map(Vec::len).sum();
        if live_aliases + self.free_aliases.len() != self.alias_records.len() {
            return Err("alias records out of balance".into());
        }
        Ok(())
    }
}

/// Stores `value` in a slab (`vacant` lists its free slots) and returns its slot.
fn slab_put<T>(items: &mut HugeVec<T>, vacant: &mut Vec<u32>, value: T) -> u32 {
    match vacant.pop() {
        Some(slot) => {
            items[slot as usize] = value;
            slot
        }
        None => {
            items.push(value);
            (items.len() - 1) as u32
        }
    }
}

/// Reads the key and block a pair id names: a block's primary key, or an alias record.
struct PairKeys<'a> {
    nodes: &'a [Node],
    primaries: &'a [Primary],
    aliases: &'a [Alias],
    num_blocks: usize,
}

impl<'a> PairKeys<'a> {
    fn of(pool: &'a BlockPool) -> Self {
        Self::split(
            &pool.nodes,
            &pool.primaries,
            &pool.alias_records,
            pool.num_blocks,
        )
    }

    fn split(
        nodes: &'a [Node],
        primaries: &'a [Primary],
        aliases: &'a [Alias],
        num_blocks: usize,
    ) -> Self {
        Self {
            nodes,
            primaries,
            aliases,
            num_blocks,
        }
    }

    #[inline]
    fn key(&self, pair: u32) -> Option<BlockKey> {
        let p = pair as usize;
        if p < self.num_blocks {
            let slot = self.nodes[p].primary_slot;
            (slot != NIL).then(|| self.primaries[slot as usize].key)
        } else {
            self.aliases.get(p - self.num_blocks).map(|a| a.key)
        }
    }

    /// Starts loading the record that names the pair's key.
    #[inline]
    fn prefetch_pair(&self, pair: u32) {
        let p = pair as usize;
        if p < self.num_blocks {
            prefetch(&raw const self.nodes[p]);
        } else if let Some(a) = self.aliases.get(p - self.num_blocks) {
            prefetch(a);
        }
    }

    /// Starts loading the pair's key (its record should be cached: see [`Self::prefetch_pair`]).
    #[inline]
    fn prefetch_key(&self, pair: u32) {
        let p = pair as usize;
        if p < self.num_blocks {
            let slot = self.nodes[p].primary_slot;
            if let Some(primary) = self.primaries.get(slot as usize) {
                prefetch(primary);
            }
        }
    }

    #[inline]
    fn is(&self, pair: u32, key: &BlockKey) -> bool {
        self.key(pair).is_some_and(|k| k == *key)
    }

    #[inline]
    fn block(&self, pair: u32) -> BlockId {
        let p = pair as usize;
        if p < self.num_blocks {
            pair
        } else {
            self.aliases[p - self.num_blocks].block
        }
    }
}

#[cfg(test)]
mod tests;

#[cfg(test)]
mod retention_tests;

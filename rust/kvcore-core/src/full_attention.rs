//! Per-request block tables of one full-attention KV-cache group and the request-level
//! allocation of a model with that single group: the scheduler's per-step hot path in one call.
//!
//! [`FullAttentionTables`] is the state of the reference's full-attention single-type manager
//! (SPEC §10–11: `req_to_blocks`, `num_cached_block`, recorded new block ids) with its
//! operations. [`UnitaryFullAttention`] adds the request-facing `allocate_slots` and hit search
//! of a manager whose only group is full attention (SPEC §8.1, COORD-7, FA-1), so a scheduler
//! step costs one boundary crossing per request.
//!
//! Request ids are strings, as in the reference. Nothing here knows about Python.

use std::sync::atomic::{AtomicU64, Ordering};

use hashbrown::HashMap;

use crate::error::PoolError;
use crate::events::{MetaRequest, StoredMeta};
use crate::hash::BlockHash;
use crate::pool::retention::Retention;
use crate::pool::{BlockId, BlockPool, HashSource};

#[inline]
fn cdiv(a: usize, b: usize) -> usize {
    a.div_ceil(b)
}

/// Whether `need` new blocks and `watermark` more fit in `free` blocks less `reserved`, in
/// exact arithmetic whatever the inputs (the reference compares Python ints).
#[inline]
fn fits(need: usize, watermark: usize, free: usize, reserved: i64) -> bool {
    need as i128 + watermark as i128 <= free as i128 - i128::from(reserved)
}

/// One request's state in a group: its blocks and, once it runs, how many leading blocks the
/// cache has processed (`None` = not in `num_cached_block`).
#[derive(Debug, Clone, Default)]
pub struct RequestBlocks {
    /// The block table, in allocation order.
    pub blocks: Vec<BlockId>,
    /// Leading blocks already processed by caching; `Some` means the request is running.
    pub num_cached: Option<usize>,
}

/// Where a request's entry lives in one [`FullAttentionTables`]: a caller that keeps it next
/// to the request (kvcore's native request does) skips the id lookup on the next call.
///
/// A hint is valid while the entry it names exists: removing an entry bumps its slot's
/// generation, so a stale hint is detected, and `uid` tells tables apart.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct SlotHint {
    /// The tables' unique id (never 0 for real tables).
    pub uid: u64,
    /// Index of the entry's slot.
    pub slot: u32,
    /// The slot's generation when the hint was taken.
    pub generation: u64,
}

#[derive(Debug, Clone, Default)]
struct Slot {
    generation: u64,
    entry: Option<RequestBlocks>,
}

static NEXT_UID: AtomicU64 = AtomicU64::new(1);

/// The block tables of one full-attention group (SPEC STM-1..10, FA-1, FA-2).
///
/// Entries live in a slab of slots; `index` maps request ids to slots.
#[derive(Debug)]
pub struct FullAttentionTables {
    block_size: usize,
    group_id: u32,
    record_new_ids: bool,
    uid: u64,
    index: HashMap<String, u32>,
    slots: Vec<Slot>,
    free_slots: Vec<u32>,
    new_block_ids: Vec<BlockId>,
}

impl Clone for FullAttentionTables {
    /// A copy with its own uid (hints of the original do not apply to it).
    fn clone(&self) -> Self {
        Self {
            block_size: self.block_size,
            group_id: self.group_id,
            record_new_ids: self.record_new_ids,
            uid: NEXT_UID.fetch_add(1, Ordering::Relaxed),
            index: self.index.clone(),
            slots: self.slots.clone(),
            free_slots: self.free_slots.clone(),
            new_block_ids: self.new_block_ids.clone(),
        }
    }
}

impl FullAttentionTables {
    /// Tables for group `group_id` with `block_size` tokens per block (already scaled by the
    /// context-parallel world sizes). `record_new_ids` is SPEC MGR-29's exact-type test.
    pub fn new(block_size: usize, group_id: u32, record_new_ids: bool) -> Self {
        Self {
            block_size,
            group_id,
            record_new_ids,
            uid: NEXT_UID.fetch_add(1, Ordering::Relaxed),
            index: HashMap::new(),
            slots: Vec::new(),
            free_slots: Vec::new(),
            new_block_ids: Vec::new(),
        }
    }

    fn slot_of(&self, id: &str) -> Option<u32> {
        self.index.get(id).copied()
    }

    fn at(&self, slot: u32) -> Option<&RequestBlocks> {
        self.slots.get(slot as usize).and_then(|s| s.entry.as_ref())
    }

    fn lookup(&self, id: &str) -> Option<&RequestBlocks> {
        self.slot_of(id).and_then(|s| self.at(s))
    }

    /// The slot of `hint` when it is still valid for these tables.
    fn hinted(&self, hint: Option<SlotHint>) -> Option<u32> {
        let h = hint?;
        let slot = self.slots.get(h.slot as usize)?;
        (h.uid == self.uid && slot.generation == h.generation && slot.entry.is_some())
            .then_some(h.slot)
    }

    /// A hint for the request's entry, if it has one. Valid until the entry is removed.
    pub fn hint(&self, id: &str) -> Option<SlotHint> {
        let slot = self.slot_of(id)?;
        Some(SlotHint {
            uid: self.uid,
            slot,
            generation: self.slots[slot as usize].generation,
        })
    }

    /// Prefetches the slot `hint` names (the first stage of a batch's pipeline).
    pub fn prefetch_slot(&self, hint: Option<SlotHint>) {
        if let Some(h) = hint.filter(|h| h.uid == self.uid) {
            if let Some(s) = self.slots.get(h.slot as usize) {
                crate::prefetch::prefetch(s);
            }
        }
    }

    /// Whether `hint` still names a live entry of these tables.
    pub fn hint_is_valid(&self, hint: Option<SlotHint>) -> bool {
        self.hinted(hint).is_some()
    }

    /// The request's blocks through a valid hint, else by id (empty when unknown).
    pub fn blocks_hinted(&self, id: &str, hint: Option<SlotHint>) -> &[BlockId] {
        match self.hinted(hint) {
            Some(s) => self.at(s).map_or(&[], |r| r.blocks.as_slice()),
            None => self.blocks(id),
        }
    }

    fn remove(&mut self, id: &str) -> Option<RequestBlocks> {
        let slot = self.index.remove(id)?;
        let s = &mut self.slots[slot as usize];
        s.generation = s.generation.wrapping_add(1);
        self.free_slots.push(slot);
        s.entry.take()
    }

    /// Tokens per block.
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// The request's blocks (empty when unknown).
    pub fn blocks(&self, id: &str) -> &[BlockId] {
        self.lookup(id).map_or(&[], |r| r.blocks.as_slice())
    }

    /// The request's state, if it has an entry.
    pub fn get(&self, id: &str) -> Option<&RequestBlocks> {
        self.lookup(id)
    }

    /// Number of requests with an entry (the reference's `len(req_to_blocks)`).
    pub fn num_entries(&self) -> usize {
        self.index.len()
    }

    /// Whether the request is running (has a `num_cached_block` entry).
    pub fn is_running(&self, id: &str) -> bool {
        self.lookup(id).is_some_and(|r| r.num_cached.is_some())
    }

    /// Whether the request has an entry (the reference's `id in req_to_blocks`).
    pub fn contains(&self, id: &str) -> bool {
        self.index.contains_key(id)
    }

    /// The group id.
    pub fn group_id(&self) -> u32 {
        self.group_id
    }

    /// The slot of the request's entry: through `hint` when it is valid, else by id.
    pub(crate) fn resolve(&self, id: &str, hint: Option<SlotHint>) -> Option<u32> {
        self.hinted(hint).or_else(|| self.slot_of(id))
    }

    /// The entry in `slot` (a slot [`Self::resolve`] returned, with no removal since).
    pub(crate) fn at_slot(&self, slot: u32) -> &RequestBlocks {
        self.at(slot).expect("a resolved slot holds an entry")
    }

    /// Grows the entry in `slot` to `want` blocks, recording the new ids; the range of its
    /// table that is new.
    pub(crate) fn grow_slot(
        &mut self,
        pool: &mut BlockPool,
        slot: u32,
        want: usize,
    ) -> Result<std::ops::Range<usize>, PoolError> {
        let e = self.slots[slot as usize]
            .entry
            .as_mut()
            .expect("a resolved slot holds an entry");
        let have = e.blocks.len();
        if want <= have {
            return Ok(have..have);
        }
        pool.get_new_blocks_into(want - have, &mut e.blocks)?;
        if self.record_new_ids {
            self.new_block_ids.extend_from_slice(&e.blocks[have..]);
        }
        Ok(have..want)
    }

    /// The request's state, mutable, if it has an entry.
    pub(crate) fn get_mut(&mut self, id: &str) -> Option<&mut RequestBlocks> {
        let slot = self.slot_of(id)?;
        self.slots[slot as usize].entry.as_mut()
    }

    /// Records `ids` as newly allocated when this group records them (SPEC MGR-29).
    pub(crate) fn record(&mut self, ids: &[BlockId]) {
        if self.record_new_ids {
            self.new_block_ids.extend_from_slice(ids);
        }
    }

    /// The request's entry, created empty when missing (the reference's default-dict read).
    pub(crate) fn entry(&mut self, id: &str) -> &mut RequestBlocks {
        let slot = self.entry_slot(id);
        self.slots[slot as usize]
            .entry
            .as_mut()
            .expect("a slot in the index holds an entry")
    }

    /// The slot of the request's entry, created empty when missing.
    fn entry_slot(&mut self, id: &str) -> u32 {
        match self.slot_of(id) {
            Some(s) => s,
            None => {
                let s = match self.free_slots.pop() {
                    Some(s) => s,
                    None => {
                        self.slots.push(Slot::default());
                        u32::try_from(self.slots.len() - 1).expect("fewer than 2^32 requests")
                    }
                };
                self.slots[s as usize].entry = Some(RequestBlocks::default());
                self.index.insert(id.to_owned(), s);
                s
            }
        }
    }

    /// SPEC STM-2 for full attention (no skipped tokens, no cap).
    ///
    /// # Errors
    /// [`PoolError::Invalid`] when a running request is given prefix hits.
    pub fn get_num_blocks_to_allocate(
        &self,
        pool: &BlockPool,
        id: &str,
        num_tokens: usize,
        hits: &[BlockId],
    ) -> Result<usize, PoolError> {
        let required = cdiv(num_tokens, self.block_size);
        let (have, running) = self
            .lookup(id)
            .map_or((0, false), |r| (r.blocks.len(), r.num_cached.is_some()));
        if running {
            if !hits.is_empty() {
                return Err(PoolError::Invariant(format!(
                    "request {id} is already running and cannot take prefix-cache hits"
                )));
            }
            return Ok(required.saturating_sub(have));
        }
        let new = required.saturating_sub(hits.len() + have);
        Ok(new + pool.count_evictable(hits))
    }

    /// SPEC STM-4: the request's table becomes its (touched) hits.
    ///
    /// # Errors
    /// When the request already has blocks, or hits are given with caching off; nothing changes.
    pub fn add_local_computed_blocks(
        &mut self,
        pool: &mut BlockPool,
        id: &str,
        hits: &[BlockId],
    ) -> Result<(), PoolError> {
        if !self.blocks(id).is_empty() {
            return Err(PoolError::Invalid(format!(
                "request {id} already holds blocks; prefix hits can only start a request"
            )));
        }
        if pool.enable_caching() {
            pool.touch(hits)?;
        } else if !hits.is_empty() {
            return Err(PoolError::Invalid(
                "prefix-cache hits given while prefix caching is disabled".into(),
            ));
        }
        let e = self.entry(id);
        e.blocks.extend_from_slice(hits);
        e.num_cached = Some(e.blocks.len());
        Ok(())
    }

    /// SPEC STM-5 for full attention: blocks for externally computed tokens.
    ///
    /// # Errors
    /// When the pool cannot provide the blocks; nothing changes.
    pub fn allocate_external_computed_blocks(
        &mut self,
        pool: &mut BlockPool,
        id: &str,
        num_local: usize,
        num_external: usize,
    ) -> Result<(), PoolError> {
        if num_external == 0 {
            return Ok(());
        }
        // Saturating: a sum past usize::MAX needs more blocks than any pool has either way.
        let want = cdiv(num_local.saturating_add(num_external), self.block_size);
        self.grow_to(pool, id, want)
    }

    /// Grows the request's table to `want` blocks (SPEC STM-3's core), recording new ids.
    fn grow_to(&mut self, pool: &mut BlockPool, id: &str, want: usize) -> Result<(), PoolError> {
        let record = self.record_new_ids;
        let slot = self.entry_slot(id) as usize;
        let e = self.slots[slot]
            .entry
            .as_mut()
            .expect("a slot in the index holds an entry");
        let have = e.blocks.len();
        if want <= have {
            return Ok(());
        }
        pool.get_new_blocks_into(want - have, &mut e.blocks)?;
        if record {
            self.new_block_ids.extend_from_slice(&e.blocks[have..]);
        }
        Ok(())
    }

    /// SPEC STM-3: allocates so the request has slots for `num_tokens` tokens; returns the new
    /// blocks as a range of its table.
    ///
    /// # Errors
    /// When the pool cannot provide the blocks; nothing changes.
    pub fn allocate_new_blocks(
        &mut self,
        pool: &mut BlockPool,
        id: &str,
        num_tokens: usize,
    ) -> Result<std::ops::Range<usize>, PoolError> {
        let want = cdiv(num_tokens, self.block_size);
        let have = self.entry(id).blocks.len();
        self.grow_to(pool, id, want)?;
        Ok(have..have.max(want))
    }

    /// SPEC STM-6: stores the request's newly full blocks in the prefix cache.
    ///
    /// # Errors
    /// Errors of [`BlockPool::cache_full_blocks`]; nothing changes.
    pub fn cache_blocks<E: From<PoolError>>(
        &mut self,
        pool: &mut BlockPool,
        id: &str,
        num_tokens: usize,
        hashes: HashSource<'_, E>,
        meta: &mut dyn FnMut(&MetaRequest<'_>) -> Result<StoredMeta, E>,
    ) -> Result<(), E> {
        let cached = self.lookup(id).and_then(|r| r.num_cached).unwrap_or(0);
        if cached >= num_tokens / self.block_size {
            return Ok(());
        }
        let slot = self.entry_slot(id);
        self.cache_blocks_at(pool, slot, id, num_tokens, hashes, meta)
    }

    /// [`Self::cache_blocks`] for the entry in `slot` (which holds the request `id`).
    fn cache_blocks_at<E: From<PoolError>>(
        &mut self,
        pool: &mut BlockPool,
        slot: u32,
        id: &str,
        num_tokens: usize,
        hashes: HashSource<'_, E>,
        meta: &mut dyn FnMut(&MetaRequest<'_>) -> Result<StoredMeta, E>,
    ) -> Result<(), E> {
        let (bs, gid) = (self.block_size, self.group_id);
        let e = self.slots[slot as usize]
            .entry
            .as_mut()
            .expect("a slot in the index holds an entry");
        let cached = e.num_cached.unwrap_or(0);
        let full = num_tokens / bs;
        if cached >= full {
            return Ok(());
        }
        let new = e.blocks.get(cached..full).ok_or_else(|| {
            PoolError::MissingBlocks(format!(
                "request {id} holds {} blocks, fewer than the {full} full ones",
                e.blocks.len()
            ))
        })?;
        pool.cache_full_blocks(new, cached, full, bs, gid, None, hashes, meta)?;
        e.num_cached = Some(full);
        Ok(())
    }

    /// SPEC STM-10: removes the request's state and returns its blocks in allocation order.
    pub fn pop(&mut self, id: &str) -> Vec<BlockId> {
        self.remove(id).map(|r| r.blocks).unwrap_or_default()
    }

    /// SPEC MGR-20: frees the request's blocks, last block first. Unknown ids do nothing.
    ///
    /// # Errors
    /// Only if the pool's counts were corrupted from outside; the state is then unchanged.
    pub fn free(&mut self, pool: &mut BlockPool, id: &str) -> Result<(), PoolError> {
        self.free_retained(pool, id, Retention::DEFAULT, 0.0)
    }

    /// [`Self::free`] with the request's retention (kvcore extension, see
    /// [`BlockPool::free_blocks_retained`]); `now` is the clock's reading.
    ///
    /// # Errors
    /// As [`Self::free`].
    pub fn free_retained(
        &mut self,
        pool: &mut BlockPool,
        id: &str,
        retention: Retention,
        now: f64,
    ) -> Result<(), PoolError> {
        let Some(r) = self.lookup(id) else {
            return Ok(());
        };
        pool.free_blocks_retained(r.blocks.iter().rev().copied(), retention, now)?;
        self.remove(id);
        Ok(())
    }

    /// SPEC FA-2: the request's leading blocks shared by every request with an entry. Like the
    /// reference, asking about an unknown id creates an empty entry.
    pub fn get_num_common_prefix_blocks(&mut self, pool: &BlockPool, id: &str) -> usize {
        self.entry(id);
        let n = self.index.len() as i64;
        self.blocks(id)
            .iter()
            .take_while(|&&b| i64::from(pool.ref_cnt(b)) == n)
            .count()
    }

    /// SPEC STM-10: drains the recorded new block ids.
    pub fn take_new_block_ids(&mut self) -> Vec<BlockId> {
        std::mem::take(&mut self.new_block_ids)
    }

    /// Every request id with an entry.
    pub fn request_ids(&self) -> impl Iterator<Item = &str> {
        self.index.keys().map(String::as_str)
    }

    /// Checks the tables' bookkeeping and their blocks against `pool`:
    /// - every id names a distinct slot holding an entry, and every other slot is vacant and
    ///   listed once among the free slots;
    /// - a running entry has processed no more blocks than it holds;
    /// - every block id (tables and recorded new ids) lies in the pool, and each non-null
    ///   block's reference count is at least its number of occurrences in the tables (each
    ///   occurrence owns a reference; others may be held outside).
    ///
    /// # Errors
    /// A message naming the first violation.
    pub fn check_invariants(&self, pool: &BlockPool) -> Result<(), String> {
        let n = self.slots.len();
        let mut live = vec![false; n];
        for (id, &slot) in &self.index {
            let s = slot as usize;
            if s >= n || self.slots[s].entry.is_none() {
                return Err(format!(
                    "request {id} maps to slot {slot}, which holds no entry"
                ));
            }
            if std::mem::replace(&mut live[s], true) {
                return Err(format!("slot {slot} is shared by two request ids"));
            }
        }
        let mut vacant = vec![false; n];
        for &slot in &self.free_slots {
            let s = slot as usize;
            if s >= n || live[s] || self.slots[s].entry.is_some() {
                return Err(format!("free slot {slot} is in use or out of range"));
            }
            if std::mem::replace(&mut vacant[s], true) {
                return Err(format!("slot {slot} is listed free twice"));
            }
        }
        if let Some(s) = (0..n).find(|&s| !live[s] && !vacant[s]) {
            return Err(format!("slot {s} is neither in use nor free"));
        }
        let mut owners = vec![0u64; pool.num_blocks()];
        for (id, &slot) in &self.index {
            let Some(e) = self.at(slot) else { continue };
            if e.num_cached.is_some_and(|c| c > e.blocks.len()) {
                return Err(format!(
                    "request {id} has {:?} cached blocks but holds {}",
                    e.num_cached,
                    e.blocks.len()
                ));
            }
            for &b in &e.blocks {
                let Some(count) = owners.get_mut(b as usize) else {
                    return Err(format!("request {id} holds block {b}, outside the pool"));
                };
                *count += 1;
            }
        }
        if let Some(&b) = self
            .new_block_ids
            .iter()
            .find(|&&b| b as usize >= pool.num_blocks())
        {
            return Err(format!("recorded new block {b} is outside the pool"));
        }
        for (b, &count) in owners.iter().enumerate().skip(1) {
            let rc = pool.ref_cnt(b as BlockId);
            if i64::from(rc) < count as i64 {
                return Err(format!(
                    "block {b} has reference count {rc} but {count} table entries"
                ));
            }
        }
        Ok(())
    }
}

/// What `allocate_slots` reads from the request (SPEC REQ-1).
#[derive(Debug, Clone, Copy)]
pub struct RequestView<'a> {
    /// `request.request_id`.
    pub id: &'a str,
    /// `request.num_computed_tokens`.
    pub num_computed_tokens: usize,
    /// `request.num_tokens`.
    pub num_tokens: usize,
    /// Whether `request.status` is WAITING or PREEMPTED (ALLOC-3).
    pub waiting_or_preempted: bool,
    /// Where the request's entry was last seen, if the caller kept it (see [`SlotHint`]).
    pub hint: Option<SlotHint>,
}

/// The arguments of `allocate_slots` (SPEC §8.1).
#[derive(Debug, Clone, Copy, Default)]
pub struct AllocateArgs<'a> {
    /// Tokens to compute this step.
    pub num_new_tokens: usize,
    /// New prefix-cache hit tokens.
    pub num_new_computed_tokens: usize,
    /// The hit blocks; `None` when the caller passed no hits object or the shared empty one
    /// (ALLOC-8's identity test).
    pub new_computed_blocks: Option<&'a [BlockId]>,
    /// Speculative slots.
    pub num_lookahead_tokens: usize,
    /// Tokens computed by a KV connector.
    pub num_external_computed_tokens: usize,
    /// Skip caching this step.
    pub delay_cache_blocks: bool,
    /// Admission gate on the whole sequence.
    pub full_sequence_must_fit: bool,
    /// Free blocks to leave for others.
    pub reserved_blocks: i64,
    /// Whether other requests are scheduled this step.
    pub has_scheduled_reqs: bool,
}

/// A manager whose only KV-cache group is full attention (SPEC COORD-7 with §8).
#[derive(Debug, Clone)]
pub struct UnitaryFullAttention {
    /// The group's tables.
    pub tables: FullAttentionTables,
    max_model_len: usize,
    watermark_blocks: usize,
    use_eagle: bool,
    /// The spec's block size: the tables' block size divided by the context-parallel world
    /// size (SPEC MGR-26 counts computed tokens in it).
    spec_block_size: usize,
}

impl UnitaryFullAttention {
    /// Builds the manager state. With caching on the block size must equal the pool's hash
    /// block size (COORD-7).
    ///
    /// # Errors
    /// [`PoolError::Invalid`] when the sizes disagree.
    pub fn new(
        pool: &BlockPool,
        block_size: usize,
        record_new_ids: bool,
        max_model_len: usize,
        watermark_blocks: usize,
        use_eagle: bool,
    ) -> Result<Self, PoolError> {
        if block_size == 0 {
            return Err(PoolError::Invalid("block_size must be positive".into()));
        }
        if pool.enable_caching() && block_size != pool.hash_block_size() {
            return Err(PoolError::Invalid(format!(
                "block_size {block_size} must equal hash_block_size {} for a single group",
                pool.hash_block_size()
            )));
        }
        Ok(Self {
            tables: FullAttentionTables::new(block_size, 0, record_new_ids),
            max_model_len,
            watermark_blocks,
            use_eagle,
            spec_block_size: block_size,
        })
    }

    /// Sets the spec's block size, for context parallelism: the tables' block size is
    /// `spec_block_size * dcp_world_size * pcp_world_size` (SPEC §18).
    ///
    /// # Errors
    /// [`PoolError::Invalid`] when `spec_block_size` is 0 or does not divide the block size.
    pub fn with_spec_block_size(mut self, spec_block_size: usize) -> Result<Self, PoolError> {
        if spec_block_size == 0 || !self.tables.block_size().is_multiple_of(spec_block_size) {
            return Err(PoolError::Invalid(format!(
                "spec block size {spec_block_size} must divide the block size {}",
                self.tables.block_size()
            )));
        }
        self.spec_block_size = spec_block_size;
        Ok(self)
    }

    /// SPEC MGR-26: the request's leading blocks that cover `num_computed_tokens` tokens, in
    /// the spec's block size (with context parallelism a block holds `dcp * pcp` times as many
    /// tokens, but the reference clips by the spec's size).
    pub fn block_ids_for_computed_tokens(
        &self,
        id: &str,
        num_computed_tokens: usize,
    ) -> &[BlockId] {
        let blocks = self.tables.blocks(id);
        let keep = num_computed_tokens
            .div_ceil(self.spec_block_size)
            .min(blocks.len());
        &blocks[..keep]
    }

    /// Checks the tables ([`FullAttentionTables::check_invariants`]) and the pool
    /// ([`BlockPool::check_invariants`]).
    ///
    /// # Errors
    /// A message naming the first violation.
    pub fn check_invariants(&self, pool: &BlockPool) -> Result<(), String> {
        self.tables.check_invariants(pool)?;
        pool.check_invariants()
    }

    /// Whether hits drop their last block (SPEC EAGLE-1).
    pub fn use_eagle(&self) -> bool {
        self.use_eagle
    }

    /// SPEC MGR-7 / FA-1: the cached prefix of `hashes` usable by a request of `num_tokens`
    /// tokens (one token less is searchable). Returns the hit blocks.
    pub fn find_longest_cache_hit(
        &self,
        pool: &BlockPool,
        hashes: impl IntoIterator<Item = BlockHash>,
        num_tokens: usize,
    ) -> Vec<BlockId> {
        let max_blocks = num_tokens.saturating_sub(1) / self.tables.block_size;
        let mut hit = pool
            .longest_cached_prefix(hashes.into_iter().take(max_blocks), &[0])
            .pop()
            .unwrap_or_default();
        if self.use_eagle && !hit.is_empty() {
            hit.pop();
        }
        hit
    }

    /// `allocate_slots` for a request that is already running and brings no hits: the same
    /// decisions as the general path (ALLOC-7, 9, 11) with one table lookup. `Ok(None)` means
    /// "not running", `Ok(Some(None))` "does not fit".
    #[allow(clippy::too_many_arguments, clippy::type_complexity)]
    fn allocate_running<E: From<PoolError>>(
        &mut self,
        pool: &mut BlockPool,
        req: RequestView<'_>,
        args: &AllocateArgs<'_>,
        total: usize,
        need_slot: usize,
        wm: usize,
        hashes: HashSource<'_, E>,
        meta: &mut dyn FnMut(&MetaRequest<'_>) -> Result<StoredMeta, E>,
    ) -> Result<Option<Option<std::ops::Range<usize>>>, E> {
        let t = &mut self.tables;
        let slot = match t.hinted(req.hint) {
            Some(s) => Some(s),
            None => t.slot_of(req.id),
        };
        let Some(e) = slot.and_then(|s| t.slots.get_mut(s as usize)?.entry.as_mut()) else {
            return Ok(None);
        };
        let Some(cached) = e.num_cached else {
            return Ok(None);
        };
        let have = e.blocks.len();
        let need = cdiv(need_slot, t.block_size).saturating_sub(have);
        if !fits(need, wm, pool.get_num_free_blocks(), args.reserved_blocks) {
            return Ok(Some(None));
        }
        if need > 0 {
            pool.get_new_blocks_into(need, &mut e.blocks)?;
            if t.record_new_ids {
                t.new_block_ids.extend_from_slice(&e.blocks[have..]);
            }
        }
        // Caching runs only when a block filled (rarely): the shared path's extra lookup is
        // not on the per-token path.
        if pool.enable_caching() && !args.delay_cache_blocks {
            let n = total
                .saturating_add(args.num_new_tokens)
                .min(req.num_tokens);
            if cached < n / t.block_size {
                let slot = slot.expect("the entry was found above");
                t.cache_blocks_at(pool, slot, req.id, n, hashes, meta)?;
            }
        }
        Ok(Some(Some(have..have + need)))
    }

    /// SPEC ALLOC-1..12: returns the range of newly allocated blocks in the request's table, or
    /// `None` when they do not fit. `hashes`/`meta` feed ALLOC-11's caching.
    ///
    /// # Errors
    /// Bad arguments (ALLOC-1, hits for a running request) before any change.
    pub fn allocate_slots<E: From<PoolError>>(
        &mut self,
        pool: &mut BlockPool,
        req: RequestView<'_>,
        args: AllocateArgs<'_>,
        hashes: HashSource<'_, E>,
        meta: &mut dyn FnMut(&MetaRequest<'_>) -> Result<StoredMeta, E>,
    ) -> Result<Option<std::ops::Range<usize>>, E> {
        let ext = args.num_external_computed_tokens;
        if args.num_new_tokens == 0 && ext == 0 {
            return Err(PoolError::Invalid(
                "num_new_tokens must be greater than 0 when there are no external computed tokens"
                    .into(),
            )
            .into());
        }
        let hits = args.new_computed_blocks.unwrap_or(&[]);
        // Token sums saturate: each is capped by `max_model_len` or `num_tokens` (at most
        // usize::MAX), so the capped value is the exact one. Block counts compare exactly.
        let local = req
            .num_computed_tokens
            .saturating_add(args.num_new_computed_tokens);
        let total = local.saturating_add(ext).min(self.max_model_len);
        let wm = if args.has_scheduled_reqs && req.waiting_or_preempted {
            self.watermark_blocks
        } else {
            0
        };
        let free = pool.get_num_free_blocks();
        if args.full_sequence_must_fit {
            let full = req.num_tokens.min(self.max_model_len);
            let need = self
                .tables
                .get_num_blocks_to_allocate(pool, req.id, full, hits)?;
            if !fits(need, wm, free, 0) {
                return Ok(None);
            }
        }
        let main = total.saturating_add(args.num_new_tokens);
        let need_slot = main
            .saturating_add(args.num_lookahead_tokens)
            .min(self.max_model_len);
        if args.new_computed_blocks.is_none() && ext == 0 && !args.full_sequence_must_fit {
            let reborrowed = HashSource {
                len: &mut *hashes.len,
                get: &mut *hashes.get,
            };
            if let Some(range) =
                self.allocate_running(pool, req, &args, total, need_slot, wm, reborrowed, meta)?
            {
                return Ok(range);
            }
        }
        // ALLOC-6: full attention skips nothing.
        let need = self
            .tables
            .get_num_blocks_to_allocate(pool, req.id, need_slot, hits)?;
        if !fits(need, wm, free, args.reserved_blocks) {
            return Ok(None);
        }
        if args.new_computed_blocks.is_some() || ext > 0 {
            // COORD-5: a running request takes no hits (checked above) and is left alone.
            if !self.tables.is_running(req.id) {
                self.tables.add_local_computed_blocks(pool, req.id, hits)?;
                self.tables
                    .allocate_external_computed_blocks(pool, req.id, local, ext)?;
            } else if !hits.is_empty() {
                return Err(PoolError::Invalid("hits for a running request".into()).into());
            }
        }
        let range = self.tables.allocate_new_blocks(pool, req.id, need_slot)?;
        if pool.enable_caching() && !args.delay_cache_blocks {
            let n = main.min(req.num_tokens);
            self.tables.cache_blocks(pool, req.id, n, hashes, meta)?;
        }
        Ok(Some(range))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn h(x: u8) -> BlockHash {
        BlockHash::from_slice(&[x; 32]).unwrap()
    }

    fn req(id: &str, computed: usize, tokens: usize) -> RequestView<'_> {
        RequestView {
            id,
            num_computed_tokens: computed,
            num_tokens: tokens,
            waiting_or_preempted: true,
            hint: None,
        }
    }

    fn alloc(
        m: &mut UnitaryFullAttention,
        p: &mut BlockPool,
        r: RequestView<'_>,
        args: AllocateArgs<'_>,
        hashes: &[BlockHash],
    ) -> Option<Vec<BlockId>> {
        let mut get = |i: usize| -> Result<BlockHash, PoolError> { Ok(hashes[i]) };
        let range = m
            .allocate_slots(
                p,
                r,
                args,
                HashSource {
                    len: &mut || Ok(hashes.len()),
                    get: &mut get,
                },
                &mut |_: &MetaRequest<'_>| Ok(StoredMeta::default()),
            )
            .unwrap()?;
        Some(m.tables.blocks(r.id)[range].to_vec())
    }

    /// Slot hints: valid while the entry lives, stale after a free (even when the slot is
    /// reused by another request), and never valid for other tables.
    #[test]
    fn slot_hints_follow_entries() {
        let mut p = BlockPool::new(20, false, 16, false).unwrap();
        let mut t = FullAttentionTables::new(16, 0, false);
        t.allocate_new_blocks(&mut p, "a", 20).unwrap();
        let ha = t.hint("a");
        assert!(t.hint_is_valid(ha));
        assert_eq!(t.blocks_hinted("zzz", ha), t.blocks("a"));
        t.free(&mut p, "a").unwrap();
        assert!(!t.hint_is_valid(ha));
        t.allocate_new_blocks(&mut p, "b", 40).unwrap();
        let hb = t.hint("b");
        assert_eq!(hb.map(|h| h.slot), ha.map(|h| h.slot), "the slot is reused");
        assert!(!t.hint_is_valid(ha) && t.hint_is_valid(hb));
        assert_eq!(t.blocks_hinted("a", ha), &[] as &[BlockId]);
        let other = FullAttentionTables::new(16, 0, false);
        assert!(!other.hint_is_valid(hb));
        assert!(!t.clone().hint_is_valid(hb), "a clone has its own uid");
        assert_eq!(t.hint("nobody"), None);
    }

    /// SPEC §19 S1 at the core level.
    #[test]
    fn scenario_s1_prefix_reuse_and_free_order() {
        let mut p = BlockPool::new(10, true, 16, true).unwrap();
        let mut m = UnitaryFullAttention::new(&p, 16, true, 1024, 0, false).unwrap();
        let hashes = [h(1), h(2)];
        let args = |n| AllocateArgs {
            num_new_tokens: n,
            has_scheduled_reqs: true,
            ..Default::default()
        };
        assert_eq!(
            alloc(&mut m, &mut p, req("r1", 0, 40), args(40), &hashes),
            Some(vec![1, 2, 3])
        );
        assert_eq!(m.tables.take_new_block_ids(), vec![1, 2, 3]);
        m.tables.free(&mut p, "r1").unwrap();
        assert_eq!(p.all_free_block_ids(), vec![3, 4, 5, 6, 7, 8, 9, 2, 1]);
        let hit = m.find_longest_cache_hit(&p, hashes, 40);
        assert_eq!(hit, vec![1, 2]);
        let a = AllocateArgs {
            num_new_tokens: 8,
            num_new_computed_tokens: 32,
            new_computed_blocks: Some(&hit),
            has_scheduled_reqs: true,
            ..Default::default()
        };
        assert_eq!(
            alloc(&mut m, &mut p, req("r2", 0, 40), a, &hashes),
            Some(vec![3])
        );
        assert_eq!(m.tables.blocks("r2"), &[1, 2, 3]);
        // MGR-7: a fully cached 32-token prompt hits only 16.
        let hit3 = m.find_longest_cache_hit(&p, hashes, 32);
        assert_eq!(hit3, vec![1]);
        let a3 = AllocateArgs {
            num_new_tokens: 16,
            num_new_computed_tokens: 16,
            new_computed_blocks: Some(&hit3),
            has_scheduled_reqs: true,
            ..Default::default()
        };
        assert_eq!(
            alloc(&mut m, &mut p, req("r3", 0, 32), a3, &hashes),
            Some(vec![4])
        );
        assert_eq!(m.tables.get_num_common_prefix_blocks(&p, "r2"), 1);
        m.tables.free(&mut p, "r2").unwrap();
        m.tables.free(&mut p, "r3").unwrap();
        assert_eq!(p.all_free_block_ids(), vec![3, 5, 6, 7, 8, 9, 2, 4, 1]);
        p.check_invariants().unwrap();
    }

    /// The manager's invariants hold through a request's lifecycle (hits shared by two
    /// requests, pop, free) and catch a reference dropped behind the tables' back.
    #[test]
    fn check_invariants_follows_lifecycles_and_catches_foreign_frees() {
        let mut p = BlockPool::new(10, true, 16, false).unwrap();
        let mut m = UnitaryFullAttention::new(&p, 16, true, 1024, 0, false).unwrap();
        m.check_invariants(&p).unwrap();
        let hashes = [h(1), h(2), h(3)];
        let args = |n| AllocateArgs {
            num_new_tokens: n,
            ..Default::default()
        };
        alloc(&mut m, &mut p, req("a", 0, 40), args(40), &hashes).unwrap();
        m.check_invariants(&p).unwrap();
        let hit = m.find_longest_cache_hit(&p, hashes, 48);
        let a = AllocateArgs {
            num_new_tokens: 16,
            num_new_computed_tokens: 32,
            new_computed_blocks: Some(&hit),
            ..Default::default()
        };
        alloc(&mut m, &mut p, req("b", 0, 48), a, &hashes).unwrap();
        m.check_invariants(&p).unwrap();
        let popped = m.tables.pop("b");
        m.check_invariants(&p).unwrap();
        p.free_blocks(&popped).unwrap();
        m.tables.get_num_common_prefix_blocks(&p, "nobody");
        m.check_invariants(&p).unwrap();
        // A reference dropped outside the tables leaves "a" owning a block it has no count for.
        let first = m.tables.blocks("a")[0];
        p.free_blocks(&[first]).unwrap();
        let err = m.check_invariants(&p).unwrap_err();
        assert!(err.contains("reference count"), "{err}");
        p.touch(&[first]).unwrap();
        m.tables.free(&mut p, "a").unwrap();
        m.tables.free(&mut p, "nobody").unwrap();
        m.check_invariants(&p).unwrap();
        assert_eq!(p.get_num_free_blocks(), 9);
    }

    /// Fuzz find (`fuzz/seeds/manager/crash-allocate-slots-token-sum-overflow`): token counts
    /// near `usize::MAX` overflowed the sums (a panic), and block counts above `i64::MAX`, a
    /// huge watermark or `reserved_blocks = i64::MIN` wrapped in the fit test (admitting
    /// requests that cannot fit, or a panic). Sums now saturate at their caps and the fit
    /// test is exact.
    #[test]
    fn allocate_slots_huge_counts_neither_panic_nor_wrap() {
        let fresh = || BlockPool::new(10, false, 16, false).unwrap();
        let mut p = fresh();
        let mut m = UnitaryFullAttention::new(&p, 16, false, 1024, 0, false).unwrap();
        // computed + new_computed overflowed; the capped total needs 64 blocks of 9.
        let a = AllocateArgs {
            num_new_tokens: 1,
            num_new_computed_tokens: 1,
            ..Default::default()
        };
        assert_eq!(
            alloc(&mut m, &mut p, req("x", usize::MAX, usize::MAX), a, &[]),
            None
        );
        let a = AllocateArgs {
            num_new_tokens: usize::MAX,
            num_lookahead_tokens: usize::MAX,
            num_external_computed_tokens: usize::MAX,
            ..Default::default()
        };
        assert_eq!(alloc(&mut m, &mut p, req("x", 5, usize::MAX), a, &[]), None);
        assert_eq!(p.get_num_free_blocks(), 9);
        let r = m
            .tables
            .allocate_external_computed_blocks(&mut p, "y", usize::MAX, usize::MAX);
        assert!(matches!(r, Err(PoolError::NotEnoughFreeBlocks { .. })));
        // A whole sequence of usize::MAX blocks does not fit (it wrapped to -1 and passed).
        let mut p = fresh();
        let mut m = UnitaryFullAttention::new(&p, 1, false, usize::MAX, 0, false).unwrap();
        let a = AllocateArgs {
            num_new_tokens: 4,
            full_sequence_must_fit: true,
            ..Default::default()
        };
        assert_eq!(alloc(&mut m, &mut p, req("x", 0, usize::MAX), a, &[]), None);
        // A watermark above i64::MAX leaves no room (it wrapped to a negative margin).
        let mut m = UnitaryFullAttention::new(&p, 16, false, 1024, usize::MAX, false).unwrap();
        let a = AllocateArgs {
            num_new_tokens: 16,
            has_scheduled_reqs: true,
            ..Default::default()
        };
        assert_eq!(alloc(&mut m, &mut p, req("x", 0, 16), a, &[]), None);
        // reserved_blocks = i64::MIN overflowed `free - reserved`; a negative reservation
        // only makes room.
        let a = AllocateArgs {
            num_new_tokens: 16,
            reserved_blocks: i64::MIN,
            ..Default::default()
        };
        let mut m = UnitaryFullAttention::new(&p, 16, false, 1024, 0, false).unwrap();
        assert_eq!(
            alloc(&mut m, &mut p, req("x", 0, 32), a, &[]),
            Some(vec![1])
        );
        let a = AllocateArgs {
            num_new_tokens: 16,
            reserved_blocks: i64::MIN,
            ..Default::default()
        };
        assert_eq!(
            alloc(&mut m, &mut p, req("x", 16, 32), a, &[]),
            Some(vec![2])
        );
        let a = AllocateArgs {
            num_new_tokens: 16,
            reserved_blocks: i64::MAX,
            ..Default::default()
        };
        assert_eq!(alloc(&mut m, &mut p, req("x", 32, 48), a, &[]), None);
        m.check_invariants(&p).unwrap();
    }

    #[test]
    fn mgr_26_counts_computed_tokens_in_the_spec_block_size() {
        // dcp_world_size 2: blocks of 32 tokens, the spec's 16 (the reference clips by 16).
        let mut p = BlockPool::new(10, false, 32, false).unwrap();
        let m = UnitaryFullAttention::new(&p, 32, false, 1024, 0, false)
            .unwrap()
            .with_spec_block_size(16)
            .unwrap();
        let mut m = m;
        let a = AllocateArgs {
            num_new_tokens: 150,
            ..Default::default()
        };
        let got = alloc(&mut m, &mut p, req("x", 0, 150), a, &[]).unwrap();
        assert_eq!(got.len(), 5);
        assert_eq!(m.block_ids_for_computed_tokens("x", 28), &got[..2]);
        assert_eq!(m.block_ids_for_computed_tokens("x", 75), &got[..5]);
        assert_eq!(m.block_ids_for_computed_tokens("x", 0), &[] as &[BlockId]);
        assert!(UnitaryFullAttention::new(&p, 32, false, 1024, 0, false)
            .unwrap()
            .with_spec_block_size(12)
            .is_err());
    }

    #[test]
    fn alloc_1_zero_tokens_rejected_and_capacity_none() {
        let mut p = BlockPool::new(5, true, 16, false).unwrap();
        let mut m = UnitaryFullAttention::new(&p, 16, true, 1024, 0, false).unwrap();
        let mut get = |_: usize| -> Result<BlockHash, PoolError> { Ok(h(0)) };
        let r = m.allocate_slots(
            &mut p,
            req("x", 0, 10),
            AllocateArgs::default(),
            HashSource {
                len: &mut || Ok(0),
                get: &mut get,
            },
            &mut |_: &MetaRequest<'_>| Ok(StoredMeta::default()),
        );
        assert!(r.is_err());
        let args = AllocateArgs {
            num_new_tokens: 100,
            ..Default::default()
        };
        assert_eq!(alloc(&mut m, &mut p, req("x", 0, 100), args, &[]), None);
        assert_eq!(p.get_num_free_blocks(), 4);
        assert!(m.tables.get("x").is_none());
    }
}

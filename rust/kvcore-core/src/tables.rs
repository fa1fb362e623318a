//! The per-request block tables of one KV-cache group: per request id, its block ids and,
//! once it runs, how many leading blocks caching has processed (the reference's
//! `req_to_blocks` and `num_cached_block`, SPEC STM-1), plus the recorded new block ids
//! (MGR-29). Entries live in a slab; a caller that keeps a [`SlotHint`] next to a request skips
//! the id lookup on the next call. The rules that change the tables are the group's
//! [`crate::single_type::SingleTypeManager`]'s.
//!
//! Request ids are strings, as in the reference. Nothing here knows about Python.

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

use hashbrown::HashMap;

use crate::error::PoolError;
use crate::pool::{BlockId, BlockPool};

/// One request's state in a group: its blocks and, once it runs, how many leading blocks the
/// cache has processed (`None` = not in `num_cached_block`).
#[derive(Debug, Clone, Default)]
pub struct RequestBlocks {
    /// The block table, in allocation order.
    pub blocks: Vec<BlockId>,
    /// Leading blocks already processed by caching; `Some` means the request is running.
    pub num_cached: Option<usize>,
    /// 0, or a length `n` with `blocks[n - 1]` null, so that STM-8's walk back from there
    /// stops at once without reading the table. Blocks only ever turn null in place; the
    /// undo of a refused allocation, which puts blocks back, resets it.
    pub(crate) null_end: usize,
}

/// Where a request's entry lives in one [`BlockTables`]: a caller that keeps it next
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

/// A [`SlotHint`] kept next to a request and refreshed by the manager through a shared borrow
/// (`RequestView::hints`). Its parts are separate relaxed atomics: a caller sharing one cell
/// between threads serialises the accesses (the Python bindings hold the GIL for each), so a
/// reader never sees the parts of two different hints.
#[derive(Debug, Default)]
pub struct HintCell {
    uid: AtomicU64,
    slot: AtomicU32,
    generation: AtomicU64,
}

impl HintCell {
    /// A cell holding `hint`.
    pub fn new(hint: Option<SlotHint>) -> Self {
        let cell = Self::default();
        cell.set(hint);
        cell
    }

    /// The stored hint (`None` when unset: uid 0 belongs to no tables).
    #[inline]
    pub fn get(&self) -> Option<SlotHint> {
        let uid = self.uid.load(Ordering::Relaxed);
        (uid != 0).then(|| SlotHint {
            uid,
            slot: self.slot.load(Ordering::Relaxed),
            generation: self.generation.load(Ordering::Relaxed),
        })
    }

    /// Stores `hint` (or clears the cell).
    #[inline]
    pub fn set(&self, hint: Option<SlotHint>) {
        let h = hint.unwrap_or_default();
        self.slot.store(h.slot, Ordering::Relaxed);
        self.generation.store(h.generation, Ordering::Relaxed);
        self.uid.store(h.uid, Ordering::Relaxed);
    }
}

#[derive(Debug, Clone, Default)]
struct Slot {
    generation: u64,
    entry: Option<RequestBlocks>,
}

static NEXT_UID: AtomicU64 = AtomicU64::new(1);

/// The block tables of one group (SPEC STM-1), with FA-2's common-prefix count.
///
/// Entries live in a slab of slots; `index` maps request ids to slots.
#[derive(Debug)]
pub struct BlockTables {
    block_size: usize,
    group_id: u32,
    record_new_ids: bool,
    uid: u64,
    index: HashMap<String, u32>,
    slots: Vec<Slot>,
    free_slots: Vec<u32>,
    new_block_ids: Vec<BlockId>,
}

impl Clone for BlockTables {
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

impl BlockTables {
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

    /// The slot of the request's entry, if it has one.
    #[inline]
    pub(crate) fn slot_of(&self, id: &str) -> Option<u32> {
        self.index.get(id).copied()
    }

    #[inline]
    fn at(&self, slot: u32) -> Option<&RequestBlocks> {
        self.slots.get(slot as usize).and_then(|s| s.entry.as_ref())
    }

    fn lookup(&self, id: &str) -> Option<&RequestBlocks> {
        self.slot_of(id).and_then(|s| self.at(s))
    }

    /// The slot of `hint` when it is still valid for these tables.
    #[inline]
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

    /// Stores in `cell` the hint of the entry in `slot` (a slot [`Self::resolve_cell`] or
    /// [`Self::slot_of`] returned) unless it holds that hint already.
    #[inline]
    pub(crate) fn refresh(&self, cell: &HintCell, slot: u32) {
        let fresh = SlotHint {
            uid: self.uid,
            slot,
            generation: self.slots[slot as usize].generation,
        };
        if cell.get() != Some(fresh) {
            cell.set(Some(fresh));
        }
    }

    /// The address of the slot `hint` names (0 when it names none of these tables'), for a
    /// later prefetch.
    pub fn slot_addr(&self, hint: Option<SlotHint>) -> usize {
        hint.filter(|h| h.uid == self.uid)
            .and_then(|h| self.slots.get(h.slot as usize))
            .map_or(0, |s| std::ptr::from_ref(s) as usize)
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
    #[inline]
    pub fn hint_is_valid(&self, hint: Option<SlotHint>) -> bool {
        self.hinted(hint).is_some()
    }

    /// The request's blocks through a valid hint, else by id (empty when unknown).
    #[inline]
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

    /// The slot of the request's entry: through the hint in `cell` when it is valid, else by
    /// id, and then the hint (if any) is refreshed.
    #[inline]
    pub(crate) fn resolve_cell(&self, id: &str, cell: Option<&HintCell>) -> Option<u32> {
        if let Some(slot) = self.hinted(cell.and_then(HintCell::get)) {
            return Some(slot);
        }
        let slot = self.slot_of(id)?;
        if let Some(cell) = cell {
            self.refresh(cell, slot);
        }
        Some(slot)
    }

    /// The entry in `slot` (a slot [`Self::resolve_cell`] returned, with no removal since).
    #[inline]
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

    /// The request's entry, created empty when missing (the reference's default-dict read).
    pub(crate) fn entry(&mut self, id: &str) -> &mut RequestBlocks {
        let slot = self.entry_slot(id);
        self.slots[slot as usize]
            .entry
            .as_mut()
            .expect("a slot in the index holds an entry")
    }

    /// The entry in `slot` (a slot [`Self::resolve_cell`] or [`Self::entry_slot`] returned, with
    /// no removal since), mutable.
    #[inline]
    pub(crate) fn at_slot_mut(&mut self, slot: u32) -> &mut RequestBlocks {
        self.slots[slot as usize]
            .entry
            .as_mut()
            .expect("a resolved slot holds an entry")
    }

    /// The slot of the request's entry, created empty when missing.
    pub(crate) fn entry_slot(&mut self, id: &str) -> u32 {
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

    /// SPEC STM-10: removes the request's state and returns its blocks in allocation order.
    pub fn pop(&mut self, id: &str) -> Vec<BlockId> {
        self.remove(id).map(|r| r.blocks).unwrap_or_default()
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

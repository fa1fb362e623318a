//! The prefix-cache index: a compact open-addressing table of `(key, block)` pairs.
//!
//! A hash map from a 36-byte key to its blocks costs two or three cache misses per probe once it
//! outgrows the caches (a 131072-block pool's map spans ~19 MB), and an admission probes it
//! twice per block (evicting one key, storing another). This table keeps one 8-byte slot per
//! pair — a 32-bit tag of the key and the pair's id — so the whole index of that pool is 2 MiB,
//! eight slots share a cache line, and a batch can prefetch the line each key starts at.
//!
//! The table does not store keys: a pair id names where the full key lives (the pool's primary
//! key of a block, or an alias record), and lookups confirm a tag match through a caller's
//! `is_key(pair)`. Evictions, which know their pair, never need that check.
//!
//! # Layout and order
//! Linear probing from the slot the key's mixed hash picks, at most half full, with
//! backward-shift deletion (no tombstones). The pairs of one key therefore sit in one run of
//! occupied slots in insertion order: an insertion lands after every occupied slot from its
//! start, and a deletion only moves later slots back without letting a pair pass another of
//! the same key. That order is the reference's per-key insertion order (SPEC MAP-1), which
//! [`PrefixIndex::first`] returns the head of (SPEC MAP-2).

use crate::hash::BlockKey;
use crate::huge::HugePages;
use crate::prefetch::prefetch;

type HugeVec<T> = allocator_api2::vec::Vec<T, HugePages>;

/// An empty slot; an occupied one is `tag << 32 | (pair + 1)`.
const EMPTY: u64 = 0;

/// Smallest table (slots).
const MIN_SLOTS: usize = 64;

/// Mixes a key into 64 well-spread bits: every digest byte, its length and the group id count.
#[inline]
pub(crate) fn mix(key: &BlockKey) -> u64 {
    const K: u64 = 0x9E37_79B9_7F4A_7C15;
    let words = key.hash.words();
    let mut h = (key.hash.len() as u64) << 32 ^ u64::from(key.group_id) ^ 0x243F_6A88_85A3_08D3;
    for w in words {
        h = (h ^ w).wrapping_mul(K);
        h ^= h >> 29;
    }
    h = h.wrapping_mul(0xD6E8_FEB8_6659_FD93);
    h ^ (h >> 32)
}

/// See the module documentation.
#[derive(Debug, Clone)]
pub(crate) struct PrefixIndex {
    slots: HugeVec<u64>,
    /// `64 - log2(slots.len())`: the home slot is the mixed hash's top bits.
    shift: u32,
    pairs: usize,
    keys: usize,
}

impl Default for PrefixIndex {
    fn default() -> Self {
        Self::new()
    }
}

impl PrefixIndex {
    pub(crate) fn new() -> Self {
        let mut slots = HugeVec::new_in(HugePages);
        slots.resize(MIN_SLOTS, EMPTY);
        Self {
            slots,
            shift: 64 - MIN_SLOTS.trailing_zeros(),
            pairs: 0,
            keys: 0,
        }
    }

    /// Number of distinct keys (SPEC MAP-5).
    pub(crate) fn num_keys(&self) -> usize {
        self.keys
    }

    /// Number of `(key, block)` pairs.
    pub(crate) fn num_pairs(&self) -> usize {
        self.pairs
    }

    #[inline]
    fn mask(&self) -> usize {
        self.slots.len() - 1
    }

    #[inline]
    fn home(&self, h: u64) -> usize {
        (h >> self.shift) as usize
    }

    /// The key's tag: the mixed hash's top 32 bits, of which the home is the top
    /// `64 - shift`, so a slot's home is known from the slot alone.
    #[inline]
    fn tag(h: u64) -> u64 {
        h >> 32
    }

    #[inline]
    fn slot_of(h: u64, pair: u32) -> u64 {
        (h & 0xFFFF_FFFF_0000_0000) | (u64::from(pair) + 1)
    }

    #[inline]
    fn pair_in(slot: u64) -> u32 {
        ((slot & 0xFFFF_FFFF) - 1) as u32
    }

    /// Whether occupied slot `s` holds a pair of the key with tag `tag` (`is_key` confirms).
    #[inline]
    fn of_key(s: u64, tag: u64, is_key: &impl Fn(u32) -> bool) -> bool {
        s >> 32 == tag && is_key(Self::pair_in(s))
    }

    /// Starts loading the line where the key with mixed hash `h` begins its probe.
    #[inline]
    pub(crate) fn prefetch(&self, h: u64) {
        prefetch(&raw const self.slots[self.home(h)]);
    }

    /// The earliest inserted pair of the key with mixed hash `h`, `is_key` telling whether a
    /// pair holds that key.
    #[inline]
    pub(crate) fn first(&self, h: u64, is_key: impl Fn(u32) -> bool) -> Option<u32> {
        let (mask, tag) = (self.mask(), Self::tag(h));
        let mut i = self.home(h);
        loop {
            let s = self.slots[i];
            if s == EMPTY {
                return None;
            }
            if Self::of_key(s, tag, &is_key) {
                return Some(Self::pair_in(s));
            }
            i = (i + 1) & mask;
        }
    }

    /// The first pair whose tag matches the key's, unconfirmed: what [`Self::first`] will most
    /// likely return, known without touching the pairs' keys (to prefetch them).
    #[inline]
    pub(crate) fn candidate(&self, h: u64) -> Option<u32> {
        let (mask, tag) = (self.mask(), Self::tag(h));
        let mut i = self.home(h);
        loop {
            let s = self.slots[i];
            if s == EMPTY {
                return None;
            }
            if s >> 32 == tag {
                return Some(Self::pair_in(s));
            }
            i = (i + 1) & mask;
        }
    }

    /// Every pair of the key, in insertion order.
    pub(crate) fn all(&self, h: u64, is_key: impl Fn(u32) -> bool) -> Vec<u32> {
        let (mask, tag) = (self.mask(), Self::tag(h));
        let mut out = Vec::new();
        let mut i = self.home(h);
        while self.slots[i] != EMPTY {
            let s = self.slots[i];
            if Self::of_key(s, tag, &is_key) {
                out.push(Self::pair_in(s));
            }
            i = (i + 1) & mask;
        }
        out
    }

    /// Appends `pair` as the key's newest pair. The caller guarantees the pair is not stored
    /// yet and that `is_key(pair)` already holds (so the key count stays exact).
    pub(crate) fn insert(&mut self, h: u64, pair: u32, is_key: impl Fn(u32) -> bool) {
        if (self.pairs + 1) * 2 > self.slots.len() {
            self.grow();
        }
        let (mask, tag) = (self.mask(), Self::tag(h));
        let mut i = self.home(h);
        let mut key_seen = false;
        loop {
            let s = self.slots[i];
            if s == EMPTY {
                break;
            }
            key_seen = key_seen || Self::of_key(s, tag, &is_key);
            i = (i + 1) & mask;
        }
        self.slots[i] = Self::slot_of(h, pair);
        self.pairs += 1;
        self.keys += usize::from(!key_seen);
    }

    /// Removes `pair`, stored under the key with mixed hash `h`; false when it is not there.
    /// `is_key` must still recognise the key's other pairs (for the key count).
    pub(crate) fn remove(&mut self, h: u64, pair: u32, is_key: impl Fn(u32) -> bool) -> bool {
        let (mask, tag) = (self.mask(), Self::tag(h));
        let want = Self::slot_of(h, pair);
        let mut i = self.home(h);
        let mut others = false;
        loop {
            let s = self.slots[i];
            if s == EMPTY {
                return false;
            }
            if s == want {
                break;
            }
            others = others || Self::of_key(s, tag, &is_key);
            i = (i + 1) & mask;
        }
        // Backward shift: move each later pair of the run into the hole unless its home lies
        // cyclically in (hole, position], where it would become unreachable.
        let mut hole = i;
        let mut j = (i + 1) & mask;
        loop {
            let s = self.slots[j];
            if s == EMPTY {
                break;
            }
            others = others || Self::of_key(s, tag, &is_key);
            let home = self.home(s);
            let stays = if hole <= j {
                hole < home && home <= j
            } else {
                hole < home || home <= j
            };
            if !stays {
                self.slots[hole] = s;
                hole = j;
            }
            j = (j + 1) & mask;
        }
        self.slots[hole] = EMPTY;
        self.pairs -= 1;
        self.keys -= usize::from(!others);
        true
    }

    /// Doubles the table, keeping each key's pairs in order: the old table is read from an
    /// empty slot onwards (around the end), so every run is read front to back.
    fn grow(&mut self) {
        let old = std::mem::replace(&mut self.slots, HugeVec::new_in(HugePages));
        let n = old.len() * 2;
        self.slots.resize(n, EMPTY);
        self.shift = 64 - n.trailing_zeros();
        let mask = n - 1;
        // At most half full, so an empty slot exists.
        let start = old.iter().position(|&s| s == EMPTY).unwrap_or(0);
        for k in 0..old.len() {
            let s = old[(start + k) % old.len()];
            if s == EMPTY {
                continue;
            }
            let mut i = self.home(s);
            while self.slots[i] != EMPTY {
                i = (i + 1) & mask;
            }
            self.slots[i] = s;
        }
    }

    /// Every stored pair id with its slot's home and position (for invariant checks).
    pub(crate) fn entries(&self) -> impl Iterator<Item = (u32, u64, usize, usize)> + '_ {
        self.slots
            .iter()
            .enumerate()
            .filter(|(_, &s)| s != EMPTY)
            .map(|(i, &s)| (Self::pair_in(s), s >> 32, self.home(s), i))
    }

    /// Whether every slot between `home` and `at` (cyclically, inclusive) is occupied.
    pub(crate) fn reachable(&self, home: usize, at: usize) -> bool {
        let mask = self.mask();
        let mut i = home;
        loop {
            if self.slots[i] == EMPTY {
                return false;
            }
            if i == at {
                return true;
            }
            i = (i + 1) & mask;
        }
    }

    /// The tag a key with mixed hash `h` carries (for invariant checks).
    pub(crate) fn tag_of(h: u64) -> u64 {
        Self::tag(h)
    }

    /// The home slot of a key with mixed hash `h` (for invariant checks).
    pub(crate) fn home_of(&self, h: u64) -> usize {
        self.home(h)
    }

    /// Drops every pair.
    pub(crate) fn clear(&mut self) {
        self.slots.clear();
        self.slots.resize(MIN_SLOTS, EMPTY);
        self.shift = 64 - MIN_SLOTS.trailing_zeros();
        self.pairs = 0;
        self.keys = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// Model: `(key, pair)` in insertion order; keys are raw mixed hashes.
    fn model_first(model: &[(u64, u32)], key: u64) -> Option<u32> {
        model.iter().find(|e| e.0 == key).map(|e| e.1)
    }

    fn check(ix: &PrefixIndex, model: &[(u64, u32)], keys: &[u64]) {
        let key_of = |p: u32| model.iter().find(|e| e.1 == p).map(|e| e.0);
        for &k in keys {
            let is_key = |p: u32| key_of(p) == Some(k);
            assert_eq!(ix.first(k, is_key), model_first(model, k));
            let want: Vec<u32> = model.iter().filter(|e| e.0 == k).map(|e| e.1).collect();
            assert_eq!(ix.all(k, is_key), want);
        }
        assert_eq!(ix.num_pairs(), model.len());
        let mut distinct: Vec<u64> = model.iter().map(|e| e.0).collect();
        distinct.sort_unstable();
        distinct.dedup();
        assert_eq!(ix.num_keys(), distinct.len());
        for (pair, _, home, at) in ix.entries() {
            assert!(ix.reachable(home, at), "pair {pair} unreachable");
        }
    }

    proptest! {
        /// Keys share homes and tags on purpose (few distinct top bits), so runs interleave
        /// pairs of many keys; inserts, removals and growth must keep each key's order.
        #[test]
        fn matches_an_ordered_model(
            ops in proptest::collection::vec((any::<bool>(), 0usize..12, 0u32..200), 1..400)
        ) {
            // 12 keys over 3 top-byte values and 2 tag values: heavy sharing.
            let keys: Vec<u64> = (0..12u64)
                .map(|i| ((i % 3) << 62) | ((i % 2) << 40) | (i << 8))
                .collect();
            let mut ix = PrefixIndex::new();
            let mut model: Vec<(u64, u32)> = Vec::new();
            for (insert, k, pair) in ops {
                let key = keys[k];
                let owner = model.iter().find(|e| e.1 == pair).map(|e| e.0);
                let key_of = |p: u32| model.iter().find(|e| e.1 == p).map(|e| e.0);
                if insert {
                    if owner.is_none() {
                        let is_key = |p: u32| key_of(p) == Some(key);
                        ix.insert(key, pair, is_key);
                        model.push((key, pair));
                    }
                } else if let Some(owner) = owner {
                    let is_key = |p: u32| key_of(p) == Some(owner);
                    prop_assert!(ix.remove(owner, pair, is_key));
                    model.retain(|e| e.1 != pair);
                } else {
                    prop_assert!(!ix.remove(key, pair, |_| false));
                }
                check(&ix, &model, &keys);
            }
        }
    }

    #[test]
    fn wraps_around_the_end_and_grows_in_order() {
        let mut ix = PrefixIndex::new();
        // Home = last slot of the 64-slot table for every key: runs wrap to slot 0.
        let key = |i: u64| (u64::MAX << 58) | (i << 32);
        let mut model = Vec::new();
        for p in 0..200u32 {
            let k = key(u64::from(p % 5));
            let is_key = |q: u32| q % 5 == p % 5 && q < p;
            ix.insert(k, p, is_key);
            model.push((k, p));
        }
        let keys: Vec<u64> = (0..5).map(key).collect();
        check(&ix, &model, &keys);
        for p in (0..200u32).step_by(3) {
            let k = key(u64::from(p % 5));
            assert!(ix.remove(k, p, |q| q % 5 == p % 5));
            model.retain(|e| e.1 != p);
        }
        check(&ix, &model, &keys);
        ix.clear();
        assert_eq!((ix.num_pairs(), ix.num_keys()), (0, 0));
    }

    #[test]
    fn mix_uses_every_byte_and_the_group() {
        use crate::hash::BlockHash;
        let a = BlockHash::from_slice(&[1u8; 32]).unwrap();
        let mut bytes = [1u8; 32];
        bytes[0] = 2;
        let b = BlockHash::from_slice(&bytes).unwrap();
        let short = BlockHash::from_slice(&[1u8; 31]).unwrap();
        let ka = BlockKey::new(a, 0);
        assert_ne!(mix(&ka), mix(&BlockKey::new(b, 0)));
        assert_ne!(mix(&ka), mix(&BlockKey::new(a, 1)));
        assert_ne!(mix(&ka), mix(&BlockKey::new(short, 0)));
    }
}

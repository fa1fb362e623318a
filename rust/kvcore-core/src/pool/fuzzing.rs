//! The prefix-cache index as the fuzz targets (`fuzz/`) drive it directly, behind the
//! `fuzzing` feature. Not a stable API: it forwards to the crate-private [`PrefixIndex`] with
//! its preconditions (see each method).

use super::index::{self, PrefixIndex};
use crate::hash::BlockKey;

/// The 64-bit mix of a key the pool files it under.
pub fn mix(key: &BlockKey) -> u64 {
    index::mix(key)
}

/// A bare prefix-cache index: pairs of a mixed key hash and a pair id (below `u32::MAX`).
#[derive(Debug, Clone, Default)]
pub struct Index(PrefixIndex);

impl Index {
    /// An empty index.
    pub fn new() -> Self {
        Self(PrefixIndex::new())
    }

    /// Appends `pair` under the key with mixed hash `h`. Preconditions: `pair < u32::MAX`, the
    /// pair is not stored yet, and `is_key(p)` tells whether stored pair `p` has this key.
    pub fn insert(&mut self, h: u64, pair: u32, is_key: impl Fn(u32) -> bool) {
        self.0.insert(h, pair, is_key);
    }

    /// Removes `pair` if it is stored under the key with mixed hash `h` (false otherwise).
    /// Precondition: `pair` is stored under that key or not at all.
    pub fn remove(&mut self, h: u64, pair: u32, is_key: impl Fn(u32) -> bool) -> bool {
        self.0.remove(h, pair, is_key)
    }

    /// The key's earliest inserted pair.
    pub fn first(&self, h: u64, is_key: impl Fn(u32) -> bool) -> Option<u32> {
        self.0.first(h, is_key)
    }

    /// The first pair whose tag matches the key's, unconfirmed.
    pub fn candidate(&self, h: u64) -> Option<u32> {
        self.0.candidate(h)
    }

    /// Every pair of the key, in insertion order.
    pub fn all(&self, h: u64, is_key: impl Fn(u32) -> bool) -> Vec<u32> {
        self.0.all(h, is_key)
    }

    /// Number of distinct keys.
    pub fn num_keys(&self) -> usize {
        self.0.num_keys()
    }

    /// Number of pairs.
    pub fn num_pairs(&self) -> usize {
        self.0.num_pairs()
    }

    /// Drops every pair.
    pub fn clear(&mut self) {
        self.0.clear();
    }

    /// Checks the table's layout: every stored pair's slot carries the tag and home of the key
    /// `key_of` names for it and is reachable from that home (every slot from the home to it
    /// is occupied), and the pair count matches. Linear in the table size.
    ///
    /// # Errors
    /// A message naming the first violation.
    pub fn check(&self, key_of: impl Fn(u32) -> Option<u64>) -> Result<(), String> {
        // The home of the largest hash is the last slot.
        let size = self.0.home_of(u64::MAX) + 1;
        let mut occupied = vec![false; size];
        let entries: Vec<(u32, u64, usize, usize)> = self.0.entries().collect();
        for &(pair, tag, home, at) in &entries {
            let h = key_of(pair).ok_or_else(|| format!("slot {at} holds unknown pair {pair}"))?;
            if PrefixIndex::tag_of(h) != tag || self.0.home_of(h) != home {
                return Err(format!("slot {at} (pair {pair}) does not match its key"));
            }
            occupied[at] = true;
        }
        if entries.len() != self.0.num_pairs() || 2 * entries.len() > size {
            return Err(format!(
                "{} of {size} slots occupied, {} pairs counted",
                entries.len(),
                self.0.num_pairs()
            ));
        }
        // Occupied slots ending at each slot, walking around from an empty one.
        let Some(empty) = occupied.iter().position(|&o| !o) else {
            return Err("no empty slot".into());
        };
        let mut run = vec![0usize; size];
        for k in 1..=size {
            let i = (empty + k) % size;
            if occupied[i] {
                run[i] = run[(i + size - 1) % size] + 1;
            }
        }
        for &(pair, _, home, at) in &entries {
            if (at + size - home) % size >= run[at] {
                return Err(format!("slot {at} (pair {pair}) is cut off from its home"));
            }
        }
        Ok(())
    }
}

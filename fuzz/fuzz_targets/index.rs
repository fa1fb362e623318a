//! The prefix-cache index (`pool/index.rs`, reached through the `fuzzing` feature) against a
//! model of `(key, pair)` entries in insertion order (a `HashMap` from pair to key for the
//! `is_key` confirmations): inserts (single and in bulk, so the table grows), removals of
//! stored and absent pairs, lookups and clears. Keys are raw mixed hashes chosen to collide:
//! shared homes, shared tags, homes at the last slot (runs wrap around), plus arbitrary ones
//! and real `mix` outputs. After every step each key's pairs come back in insertion order and
//! the table's layout is checked.

#![no_main]

use std::collections::HashMap;

use arbitrary::Arbitrary;
use kvcore_core::hash::{BlockHash, BlockKey};
use kvcore_core::pool::fuzzing::{mix, Index};
use libfuzzer_sys::fuzz_target;

#[derive(Debug, Clone, Copy, Arbitrary)]
enum KeyPick {
    /// One of 16 keys sharing homes and tags.
    Crafted(u8),
    /// One of 8 keys whose home is the table's last slot, whatever its size.
    Wrapping(u8),
    /// A pool key's mix.
    Mixed {
        hash: u8,
        group: u8,
    },
    Any(u64),
}

impl KeyPick {
    fn get(self) -> u64 {
        match self {
            Self::Crafted(i) => {
                let i = u64::from(i % 16);
                ((i % 3) << 62) | ((i % 2) << 40) | (i << 8)
            }
            Self::Wrapping(i) => (u64::MAX << 52) | (u64::from(i % 8) << 32),
            Self::Mixed { hash, group } => {
                let h = BlockHash::from_slice(&[hash % 6; 32]).unwrap();
                mix(&BlockKey::new(h, u32::from(group % 2)))
            }
            Self::Any(v) => v,
        }
    }
}

#[derive(Debug, Clone, Copy, Arbitrary)]
enum PairPick {
    Small(u8),
    Any(u32),
}

impl PairPick {
    fn get(self) -> u32 {
        match self {
            Self::Small(v) => u32::from(v),
            // Pair ids stay below u32::MAX (the pool's ids do).
            Self::Any(v) => v.min(u32::MAX - 1),
        }
    }
}

#[derive(Debug, Clone, Arbitrary)]
enum Op {
    Insert {
        key: KeyPick,
        pair: PairPick,
    },
    /// Inserts `count` consecutive fresh pairs under the key.
    InsertMany {
        key: KeyPick,
        start: u16,
        count: u8,
    },
    /// Removes the k-th stored pair (under its own key).
    RemoveStored {
        k: u16,
    },
    /// Removes a pair under a key; a pair stored under another key is left alone.
    Remove {
        key: KeyPick,
        pair: PairPick,
    },
    Lookup {
        key: KeyPick,
    },
    Clear,
    Clone,
}

struct Model {
    /// `(key, pair)` in insertion order.
    entries: Vec<(u64, u32)>,
    key_of: HashMap<u32, u64>,
}

impl Model {
    fn pairs(&self, key: u64) -> Vec<u32> {
        self.entries
            .iter()
            .filter(|e| e.0 == key)
            .map(|e| e.1)
            .collect()
    }
}

fn check_key(ix: &Index, m: &Model, key: u64) {
    let is_key = |p: u32| m.key_of.get(&p) == Some(&key);
    let want = m.pairs(key);
    assert_eq!(ix.all(key, is_key), want, "pairs of {key:#x}");
    assert_eq!(
        ix.first(key, is_key),
        want.first().copied(),
        "first of {key:#x}"
    );
    // The unconfirmed candidate carries the key's tag whenever the key is stored.
    match ix.candidate(key) {
        Some(p) => {
            let k = m.key_of.get(&p).expect("a candidate is a stored pair");
            assert_eq!(k >> 32, key >> 32, "candidate tag");
        }
        None => assert!(want.is_empty(), "no candidate for a stored key"),
    }
}

fn check(ix: &Index, m: &Model, keys: &[u64]) {
    assert_eq!(ix.num_pairs(), m.entries.len());
    let mut distinct: Vec<u64> = m.entries.iter().map(|e| e.0).collect();
    distinct.sort_unstable();
    distinct.dedup();
    assert_eq!(ix.num_keys(), distinct.len(), "distinct keys");
    if let Err(e) = ix.check(|p| m.key_of.get(&p).copied()) {
        panic!("index layout: {e}");
    }
    for &k in distinct.iter().chain(keys) {
        check_key(ix, m, k);
    }
}

/// Most pairs stored at once (the table grows to 1024 slots; checks stay fast).
const MAX_PAIRS: usize = 320;

fn insert(ix: &mut Index, m: &mut Model, key: u64, pair: u32) {
    // Precondition: the pair is not stored yet.
    if m.key_of.contains_key(&pair) || m.entries.len() >= MAX_PAIRS {
        return;
    }
    m.key_of.insert(pair, key);
    m.entries.push((key, pair));
    ix.insert(key, pair, |p| m.key_of.get(&p) == Some(&key));
}

fn remove(ix: &mut Index, m: &mut Model, key: u64, pair: u32) {
    match m.key_of.get(&pair) {
        Some(&k) if k == key => {
            assert!(ix.remove(key, pair, |p| m.key_of.get(&p) == Some(&key)));
            m.key_of.remove(&pair);
            m.entries.retain(|e| e.1 != pair);
        }
        Some(_) => {} // precondition: stored under this key or not at all
        None => assert!(!ix.remove(key, pair, |p| m.key_of.get(&p) == Some(&key))),
    }
}

fuzz_target!(|ops: Vec<Op>| {
    let mut ix = Index::new();
    let mut m = Model {
        entries: Vec::new(),
        key_of: HashMap::new(),
    };
    let mut keys: Vec<u64> = (0..16).map(|i| KeyPick::Crafted(i).get()).collect();
    keys.extend((0..8).map(|i| KeyPick::Wrapping(i).get()));
    for op in ops.into_iter().take(256) {
        match op {
            Op::Insert { key, pair } => insert(&mut ix, &mut m, key.get(), pair.get()),
            Op::InsertMany { key, start, count } => {
                let key = key.get();
                for p in 0..u32::from(count) {
                    insert(&mut ix, &mut m, key, u32::from(start) + p);
                }
            }
            Op::RemoveStored { k } => {
                if !m.entries.is_empty() {
                    let (key, pair) = m.entries[usize::from(k) % m.entries.len()];
                    remove(&mut ix, &mut m, key, pair);
                }
            }
            Op::Remove { key, pair } => remove(&mut ix, &mut m, key.get(), pair.get()),
            Op::Lookup { key } => {
                let key = key.get();
                check_key(&ix, &m, key);
                continue;
            }
            Op::Clear => {
                ix.clear();
                m.entries.clear();
                m.key_of.clear();
            }
            Op::Clone => ix = ix.clone(),
        }
        check(&ix, &m, &keys);
    }
    // Draining in a different order than insertion leaves an empty table.
    let mut left: Vec<(u64, u32)> = m.entries.clone();
    left.reverse();
    for (key, pair) in left {
        remove(&mut ix, &mut m, key, pair);
    }
    check(&ix, &m, &keys);
    assert_eq!((ix.num_pairs(), ix.num_keys()), (0, 0));
});

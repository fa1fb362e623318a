//! Cache control beyond LRU (kvcore extensions, docs/behaviour.md §21): the retention a request
//! gives its blocks when it frees them, the deadlines of retention times to live, and pins.
//!
//! The free queue itself ([`super::BlockPool`]) keeps one list per level; this module holds
//! the bookkeeping that decides when a block changes level or stops being pinned. Every
//! structure here is empty unless a request or a pin uses the extensions, and the pool then
//! skips it with one emptiness test.

use std::collections::VecDeque;

use hashbrown::HashMap;

use crate::error::PoolError;

use super::BlockId;

/// The priority of a request that names none (and of every block released by a pin).
pub const DEFAULT_PRIORITY: u8 = 50;

/// Highest retention priority.
pub const MAX_PRIORITY: u8 = 100;

/// Checks a time to live: a finite number of seconds, at least 0.
///
/// # Errors
/// [`PoolError::Invalid`] naming `what` otherwise.
pub fn check_ttl(ttl_s: f64, what: &str) -> Result<(), PoolError> {
    if ttl_s.is_finite() && ttl_s >= 0.0 {
        Ok(())
    } else {
        Err(PoolError::Invalid(format!(
            "{what} must be a finite number of seconds >= 0 or None, got {ttl_s}"
        )))
    }
}

/// How a request's freed blocks are kept: evicted lowest priority first, and, once `ttl_s`
/// seconds have passed since the free, the next to be evicted.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Retention {
    priority: u8,
    ttl_s: Option<f64>,
}

impl Default for Retention {
    fn default() -> Self {
        Self::DEFAULT
    }
}

impl Retention {
    /// Priority 50, no time to live: the reference's plain LRU.
    pub const DEFAULT: Self = Self {
        priority: DEFAULT_PRIORITY,
        ttl_s: None,
    };

    /// A retention of `priority` (0..=100) and an optional time to live in seconds (finite,
    /// non-negative).
    ///
    /// # Errors
    /// [`PoolError::Invalid`] for a priority or a time to live out of range.
    pub fn new(priority: i64, ttl_s: Option<f64>) -> Result<Self, PoolError> {
        let priority = u8::try_from(priority)
            .ok()
            .filter(|&p| p <= MAX_PRIORITY)
            .ok_or_else(|| {
                PoolError::Invalid(format!(
                    "retention_priority must be an int in 0..=100, got {priority}"
                ))
            })?;
        if let Some(t) = ttl_s {
            check_ttl(t, "retention_ttl_s")?;
        }
        Ok(Self { priority, ttl_s })
    }

    /// The priority.
    pub fn priority(&self) -> u8 {
        self.priority
    }

    /// The time to live in seconds, if any.
    pub fn ttl_s(&self) -> Option<f64> {
        self.ttl_s
    }

    /// Whether this is [`Self::DEFAULT`].
    pub fn is_default(&self) -> bool {
        self.priority == DEFAULT_PRIORITY && self.ttl_s.is_none()
    }
}

/// The deadlines of freed blocks with a time to live. One FIFO per distinct time to live: the
/// clock only moves forward, so each FIFO is in deadline order and expiring is O(1) per block.
/// A block's current deadline is in `deadline_of`; a FIFO entry whose deadline no longer
/// matches (the block was taken and freed again) is stale and dropped when reached.
#[derive(Debug, Clone, Default)]
pub(super) struct Deadlines {
    deadline_of: HashMap<BlockId, f64>,
    fifos: Vec<(u64, VecDeque<(f64, BlockId)>)>,
    /// No entry is due before this (`INFINITY` when there are none).
    next: f64,
}

impl Deadlines {
    pub(super) fn new() -> Self {
        Self {
            next: f64::INFINITY,
            ..Self::default()
        }
    }

    /// Whether any block has a deadline.
    #[inline]
    pub(super) fn is_empty(&self) -> bool {
        self.deadline_of.is_empty()
    }

    /// The earliest time at which [`Self::take_due`] may return something.
    pub(super) fn next_due(&self) -> f64 {
        self.next
    }

    /// Records that `block`, freed at `now`, expires after `ttl_s`.
    pub(super) fn add(&mut self, block: BlockId, now: f64, ttl_s: f64) {
        let deadline = now + ttl_s;
        self.deadline_of.insert(block, deadline);
        let key = ttl_s.to_bits();
        let fifo = match self.fifos.iter().position(|f| f.0 == key) {
            Some(i) => &mut self.fifos[i].1,
            None => {
                self.fifos.push((key, VecDeque::new()));
                &mut self.fifos.last_mut().expect("just pushed").1
            }
        };
        fifo.push_back((deadline, block));
        self.next = self.next.min(deadline);
    }

    /// Forgets the block's deadline (it left the free queue).
    #[inline]
    pub(super) fn remove(&mut self, block: BlockId) {
        self.deadline_of.remove(&block);
    }

    /// Removes and returns the blocks whose deadline is at or before `now`, earliest deadline
    /// first (blocks of one free keep their order).
    pub(super) fn take_due(&mut self, now: f64) -> Vec<BlockId> {
        let mut due: Vec<(f64, BlockId)> = Vec::new();
        if now < self.next {
            return Vec::new();
        }
        let mut next = f64::INFINITY;
        for (_, fifo) in &mut self.fifos {
            while let Some(&(deadline, block)) = fifo.front() {
                if deadline > now {
                    next = next.min(deadline);
                    break;
                }
                fifo.pop_front();
                if self.deadline_of.get(&block) == Some(&deadline) {
                    self.deadline_of.remove(&block);
                    due.push((deadline, block));
                }
            }
        }
        self.fifos.retain(|f| !f.1.is_empty());
        self.next = next;
        // Each FIFO is in deadline order; merging them is a stable sort of what is due.
        due.sort_by(|a, b| a.0.total_cmp(&b.0));
        due.into_iter().map(|(_, b)| b).collect()
    }

    /// Forgets everything.
    pub(super) fn clear(&mut self) {
        *self = Self::new();
    }
}

/// Pinned blocks and their deadlines (`None`: pinned until unpinned). A pin holds one
/// reference on its block, so a pinned block is never in the free queue.
#[derive(Debug, Clone, Default)]
pub(super) struct Pins {
    deadline_of: HashMap<BlockId, Option<f64>>,
    /// No pin expires before this (`INFINITY` when none can).
    next: f64,
}

impl Pins {
    pub(super) fn new() -> Self {
        Self {
            deadline_of: HashMap::new(),
            next: f64::INFINITY,
        }
    }

    pub(super) fn len(&self) -> usize {
        self.deadline_of.len()
    }

    pub(super) fn contains(&self, block: BlockId) -> bool {
        self.deadline_of.contains_key(&block)
    }

    pub(super) fn blocks(&self) -> impl Iterator<Item = BlockId> + '_ {
        self.deadline_of.keys().copied()
    }

    pub(super) fn next_due(&self) -> f64 {
        self.next
    }

    /// Pins `block` until `deadline`, or moves an existing pin's deadline there; returns
    /// whether the block was newly pinned.
    pub(super) fn set(&mut self, block: BlockId, deadline: Option<f64>) -> bool {
        if let Some(d) = deadline {
            self.next = self.next.min(d);
        }
        self.deadline_of.insert(block, deadline).is_none()
    }

    /// Drops the pin of `block`; returns whether it had one.
    pub(super) fn remove(&mut self, block: BlockId) -> bool {
        self.deadline_of.remove(&block).is_some()
    }

    /// Removes and returns the pins whose deadline is at or before `now` (a scan over the
    /// pins, only when one is due).
    pub(super) fn take_due(&mut self, now: f64) -> Vec<BlockId> {
        if now < self.next {
            return Vec::new();
        }
        let mut due: Vec<BlockId> = self
            .deadline_of
            .iter()
            .filter(|(_, d)| d.is_some_and(|d| d <= now))
            .map(|(&b, _)| b)
            .collect();
        due.sort_unstable();
        for b in &due {
            self.deadline_of.remove(b);
        }
        self.next = self
            .deadline_of
            .values()
            .flatten()
            .copied()
            .fold(f64::INFINITY, f64::min);
        due
    }

    /// Removes and returns every pin, in block order.
    pub(super) fn take_all(&mut self) -> Vec<BlockId> {
        let mut all: Vec<BlockId> = self.deadline_of.drain().map(|(b, _)| b).collect();
        all.sort_unstable();
        self.next = f64::INFINITY;
        all
    }
}

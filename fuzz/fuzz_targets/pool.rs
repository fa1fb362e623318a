//! The block pool against a plain model: free-queue order, reference counts, which keys map to
//! which blocks (in insertion order), primary and alias keys, and the events, after every
//! operation of an arbitrary sequence, misuse included (huge and zero counts, double frees,
//! unknown ids, duplicate and alias keys, failing callbacks); the recorded block-metrics
//! operations too.

#![no_main]

use std::collections::VecDeque;

use arbitrary::Arbitrary;
use kvcore_core::events::{KvEvent, MetaRequest, StoredMeta};
use kvcore_core::hash::{BlockHash, BlockKey};
use kvcore_core::pool::{BlockId, BlockOp, BlockPool, HashSource};
use kvcore_core::PoolError;
use libfuzzer_sys::fuzz_target;

/// Largest pool the target builds (a real allocation per block).
const MAX_POOL: usize = 48;
/// Largest pool size the core accepts (SPEC POOL-1).
const MAX_BLOCKS: i64 = 1 << 31;
/// Hash alphabet: 8 byte values in two digest lengths, plus the empty digest.
const NUM_HASHES: u8 = 17;
const NUM_GROUPS: u8 = 3;

#[derive(Debug, Clone, Copy, Arbitrary)]
enum Count {
    Small(u8),
    Medium(u16),
    Any(usize),
}

impl Count {
    fn get(self) -> usize {
        match self {
            Self::Small(v) => usize::from(v % 12),
            Self::Medium(v) => usize::from(v),
            Self::Any(v) => v,
        }
    }
}

#[derive(Debug, Clone, Copy, Arbitrary)]
enum IdPick {
    Near(u8),
    Any(u32),
}

impl IdPick {
    fn get(self, n: usize) -> BlockId {
        match self {
            Self::Near(v) => u32::from(v) % (n as u32 + 2),
            Self::Any(v) => v,
        }
    }
}

#[derive(Debug, Clone, Copy, Arbitrary)]
enum Id64 {
    Near(u8),
    Any(i64),
}

impl Id64 {
    fn get(self, n: usize) -> i64 {
        match self {
            Self::Near(v) => i64::from(v) % (n as i64 + 3) - 1,
            Self::Any(v) => v,
        }
    }
}

#[derive(Debug, Clone, Copy, Arbitrary)]
enum SizePick {
    /// `hbs * (k % 5)`: a multiple of the hash block size, zero included.
    Multiple(u8),
    Any(usize),
}

impl SizePick {
    fn get(self, hbs: usize) -> usize {
        match self {
            Self::Multiple(k) => hbs * usize::from(k % 5),
            Self::Any(v) => v,
        }
    }
}

fn hash_of(v: u8) -> BlockHash {
    let v = v % NUM_HASHES;
    let bytes: &[u8] = match v {
        16 => &[],
        _ if v < 8 => &[v + 1; 32],
        _ => &[v + 1; 16],
    };
    BlockHash::from_slice(bytes).unwrap()
}

fn all_keys() -> Vec<BlockKey> {
    (0..NUM_HASHES)
        .flat_map(|h| (0..u32::from(NUM_GROUPS)).map(move |g| BlockKey::new(hash_of(h), g)))
        .collect()
}

#[derive(Debug, Clone, Arbitrary)]
enum Blocks {
    /// A run of the blocks the harness holds references on.
    Held {
        start: u8,
        len: u8,
    },
    Ids(Vec<IdPick>),
}

#[derive(Debug, Clone, Arbitrary)]
struct Callbacks {
    hashes: Vec<u8>,
    len_fails: bool,
    /// Fail the k-th `get`/`hash_at` call.
    get_fails_at: Option<u8>,
    meta_fails: bool,
}

#[derive(Debug, Clone, Arbitrary)]
enum Op {
    Alloc {
        n: Count,
        into: bool,
    },
    /// Frees references the harness holds (valid, repeats included).
    FreeHeld {
        picks: Vec<u8>,
        reversed: bool,
    },
    /// Frees arbitrary ids (double frees, unknown ids, the null block).
    Free {
        ids: Vec<IdPick>,
        reversed: bool,
    },
    /// Touches blocks of the free queue (valid).
    TouchFree {
        picks: Vec<u8>,
    },
    /// Touches the cached block of each key (the hit path).
    TouchCached {
        keys: Vec<(u8, u8)>,
    },
    Touch {
        ids: Vec<IdPick>,
    },
    CacheFull {
        blocks: Blocks,
        num_cached: Count,
        /// `None`: `num_cached + len(blocks)` (consistent).
        num_full: Option<Count>,
        block_size: SizePick,
        group: u8,
        mask: Option<Vec<bool>>,
        cb: Callbacks,
    },
    CachePartial {
        block: Blocks,
        num_tokens: Count,
        group: u8,
        block_size: SizePick,
        num_hashes: Count,
        cb: Callbacks,
    },
    Evict {
        ids: Vec<Id64>,
    },
    Reset,
    TakeEvents,
    /// Starts or stops recording the block-metrics operations.
    RecordOps {
        on: bool,
    },
    TakeOps,
    Lookup {
        hashes: Vec<u8>,
        groups: Vec<u8>,
        evictable: Vec<IdPick>,
    },
    Clone,
}

#[derive(Debug, Arbitrary)]
struct Input {
    raw_size: i64,
    size: u8,
    caching: bool,
    hbs: u8,
    events: bool,
    ops: Vec<Op>,
}

/// The plain model.
struct Model {
    n: usize,
    caching: bool,
    hbs: usize,
    events_on: bool,
    rc: Vec<i64>,
    queue: VecDeque<BlockId>,
    primary: Vec<Option<(BlockKey, usize)>>,
    aliases: Vec<Vec<BlockKey>>,
    /// Every `(key, block)` pair of the index, in insertion order.
    pairs: Vec<(BlockKey, BlockId)>,
    events: Vec<KvEvent>,
    /// The recorded block operations while recording is on.
    ops: Option<Vec<BlockOp>>,
}

impl Model {
    fn new(n: usize, caching: bool, hbs: usize, events_on: bool) -> Self {
        Self {
            n,
            caching,
            hbs,
            events_on,
            rc: vec![0; n],
            queue: (1..n as u32).collect(),
            primary: vec![None; n],
            aliases: vec![Vec::new(); n],
            pairs: Vec::new(),
            events: Vec::new(),
            ops: None,
        }
    }

    fn holds(&self, b: BlockId, key: &BlockKey) -> bool {
        self.primary[b as usize].is_some_and(|(k, _)| k == *key)
            || self.aliases[b as usize].contains(key)
    }

    fn remove_keys(&mut self, b: BlockId) {
        let primary = self.primary[b as usize].take().map(|(k, _)| k);
        let aliases = std::mem::take(&mut self.aliases[b as usize]);
        for key in primary.into_iter().chain(aliases) {
            let pos = self
                .pairs
                .iter()
                .position(|&(k, x)| k == key && x == b)
                .expect("model: a held key is listed");
            self.pairs.remove(pos);
            if self.events_on {
                self.events.push(KvEvent::BlockRemoved {
                    block_hash: key.hash,
                    group_idx: key.group_id,
                });
            }
        }
    }

    fn insert_key(&mut self, key: BlockKey, b: BlockId, num_tokens: usize) {
        if self.holds(b, &key) {
            return;
        }
        if self.primary[b as usize].is_some() {
            self.aliases[b as usize].push(key);
        } else {
            self.primary[b as usize] = Some((key, num_tokens));
        }
        self.pairs.push((key, b));
    }

    fn blocks_of(&self, key: &BlockKey) -> Vec<BlockId> {
        self.pairs
            .iter()
            .filter(|(k, _)| k == key)
            .map(|&(_, b)| b)
            .collect()
    }

    fn first(&self, key: &BlockKey) -> Option<BlockId> {
        self.pairs.iter().find(|(k, _)| k == key).map(|&(_, b)| b)
    }

    fn num_keys(&self) -> usize {
        let mut keys: Vec<BlockKey> = Vec::new();
        for (k, _) in &self.pairs {
            if !keys.contains(k) {
                keys.push(*k);
            }
        }
        keys.len()
    }

    fn alloc(&mut self, k: usize) -> Result<Vec<BlockId>, PoolError> {
        if k > self.queue.len() {
            return Err(PoolError::NotEnoughFreeBlocks {
                requested: k,
                free: self.queue.len(),
            });
        }
        let got: Vec<BlockId> = self.queue.drain(..k).collect();
        for &b in &got {
            if self.caching {
                self.remove_keys(b);
                self.record(BlockOp::Evicted(b));
            }
            self.rc[b as usize] = 1;
            self.record(BlockOp::Allocated(b));
        }
        Ok(got)
    }

    fn out_of_range(&self, b: BlockId) -> PoolError {
        PoolError::BlockOutOfRange {
            block_id: i64::from(b),
            num_blocks: self.n,
        }
    }

    fn touch(&mut self, ids: &[BlockId]) -> Result<(), PoolError> {
        if let Some(&b) = ids.iter().find(|&&b| b as usize >= self.n) {
            return Err(self.out_of_range(b));
        }
        for &b in ids {
            if self.rc[b as usize] == 0 && b != 0 {
                let pos = self.queue.iter().position(|&x| x == b).unwrap();
                self.queue.remove(pos);
            }
            self.rc[b as usize] += 1;
        }
        for &b in ids {
            self.record(BlockOp::Accessed(b));
        }
        Ok(())
    }

    fn record(&mut self, op: BlockOp) {
        if let Some(ops) = &mut self.ops {
            ops.push(op);
        }
    }

    fn free(&mut self, ids: &[BlockId]) -> Result<(), PoolError> {
        let mut rc = self.rc.clone();
        for &b in ids {
            if b as usize >= self.n {
                return Err(self.out_of_range(b));
            }
            let r = &mut rc[b as usize];
            if (b != 0 && *r <= 0) || *r == i64::from(i32::MIN) {
                return Err(PoolError::DoubleFree(b));
            }
            *r -= 1;
        }
        let (mut front, mut back) = (Vec::new(), Vec::new());
        for &b in ids {
            self.rc[b as usize] -= 1;
            if self.rc[b as usize] == 0 && b != 0 {
                if self.primary[b as usize].is_some() {
                    back.push(b);
                } else {
                    front.push(b);
                }
            }
        }
        for b in front.into_iter().rev() {
            self.queue.push_front(b);
        }
        self.queue.extend(back);
        Ok(())
    }

    fn evict(&mut self, ids: &[i64]) -> Result<(), PoolError> {
        if let Some(&i) = ids.iter().find(|&&i| i < 0 || i as u64 >= self.n as u64) {
            return Err(PoolError::BlockOutOfRange {
                block_id: i,
                num_blocks: self.n,
            });
        }
        for &i in ids {
            self.remove_keys(i as BlockId);
            self.record(BlockOp::Evicted(i as BlockId));
        }
        Ok(())
    }

    fn reset(&mut self) -> bool {
        if self.n - self.queue.len() != 1 {
            return false;
        }
        self.pairs.clear();
        self.primary.iter_mut().for_each(|p| *p = None);
        self.aliases.iter_mut().for_each(Vec::clear);
        if self.events_on {
            self.events.push(KvEvent::AllBlocksCleared);
        }
        self.record(BlockOp::Reset);
        true
    }
}

fn injected() -> PoolError {
    PoolError::Invalid("injected".into())
}

/// Whether the pool's error is the one the model expects: exact for structured errors and
/// injected callback failures, by kind for messages.
fn same_error(got: &PoolError, want: &PoolError) -> bool {
    match want {
        PoolError::Invalid(m) if m == "injected" => got == want,
        PoolError::Invalid(_) | PoolError::InvalidPartial(_) => {
            std::mem::discriminant(got) == std::mem::discriminant(want)
        }
        _ => got == want,
    }
}

fn expect_same<T: PartialEq + std::fmt::Debug>(
    what: &str,
    got: &Result<T, PoolError>,
    want: &Result<T, PoolError>,
) {
    let ok = match (got, want) {
        (Ok(a), Ok(b)) => a == b,
        (Err(a), Err(b)) => same_error(a, b),
        _ => false,
    };
    assert!(ok, "{what}: pool {got:?}, model {want:?}");
}

/// A callback script: how many `get` calls so far and when they fail.
struct Script<'a> {
    cb: &'a Callbacks,
    gets: usize,
}

impl Script<'_> {
    fn hash(&mut self, i: usize) -> Result<BlockHash, PoolError> {
        let k = self.gets;
        self.gets += 1;
        if self.cb.get_fails_at.is_some_and(|f| usize::from(f) == k) {
            return Err(injected());
        }
        Ok(match self.cb.hashes.len() {
            0 => hash_of(0),
            len => hash_of(self.cb.hashes[i % len]),
        })
    }
}

/// The arguments of one `MetaRequest`, owned.
type MetaSeen = ((usize, usize), Vec<(usize, usize)>, i64);

fn meta_of(req: &MetaRequest<'_>) -> StoredMeta {
    StoredMeta {
        token_ids: vec![req.token_range.0 as i64, req.token_range.1 as i64].into(),
        lora_id: Some(req.first_mm_idx),
        lora_name: None,
        extra_keys: None,
    }
}

struct Harness {
    pool: BlockPool,
    model: Model,
    /// One entry per reference the harness holds.
    held: Vec<BlockId>,
    keys: Vec<BlockKey>,
    /// Steps taken (varies the blocks probed by `check`).
    steps: usize,
}

impl Harness {
    fn pick_blocks(&self, b: &Blocks) -> Vec<BlockId> {
        match b {
            Blocks::Held { start, len } => {
                if self.held.is_empty() {
                    return Vec::new();
                }
                let s = usize::from(*start) % self.held.len();
                let e = (s + usize::from(*len % 8)).min(self.held.len());
                self.held[s..e].to_vec()
            }
            Blocks::Ids(ids) => ids.iter().map(|i| i.get(self.model.n)).collect(),
        }
    }

    fn drop_held(&mut self, ids: &[BlockId]) {
        for b in ids {
            if let Some(pos) = self.held.iter().position(|x| x == b) {
                self.held.swap_remove(pos);
            }
        }
    }

    fn free(&mut self, ids: Vec<BlockId>, reversed: bool) {
        let got = if reversed {
            self.pool.free_blocks_iter(ids.iter().rev().copied())
        } else {
            self.pool.free_blocks(&ids)
        };
        let ordered: Vec<BlockId> = if reversed {
            ids.iter().rev().copied().collect()
        } else {
            ids.clone()
        };
        let want = self.model.free(&ordered);
        expect_same("free_blocks", &got, &want);
        if got.is_ok() {
            self.drop_held(&ids);
        }
    }

    fn touch(&mut self, ids: Vec<BlockId>) {
        let got = self.pool.touch(&ids);
        let want = self.model.touch(&ids);
        expect_same("touch", &got, &want);
        if got.is_ok() {
            self.held.extend(ids);
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn cache_full(
        &mut self,
        blocks: Vec<BlockId>,
        num_cached: usize,
        num_full: usize,
        block_size: usize,
        group: u32,
        mask: Option<Vec<bool>>,
        cb: &Callbacks,
    ) {
        let mut seen: Vec<MetaSeen> = Vec::new();
        let got = {
            let mut script = Script { cb, gets: 0 };
            let num_hashes = cb.hashes.len();
            let mut len = || -> Result<usize, PoolError> {
                if cb.len_fails {
                    Err(injected())
                } else {
                    Ok(num_hashes)
                }
            };
            let mut get = |i: usize| -> Result<BlockHash, PoolError> {
                assert!(
                    i < num_hashes,
                    "cache_full_blocks read hash {i} of {num_hashes}"
                );
                script.hash(i)
            };
            let mut meta = |r: &MetaRequest<'_>| -> Result<StoredMeta, PoolError> {
                seen.push((r.token_range, r.block_ranges.to_vec(), r.first_mm_idx));
                if cb.meta_fails {
                    Err(injected())
                } else {
                    Ok(meta_of(r))
                }
            };
            self.pool.cache_full_blocks(
                &blocks,
                num_cached,
                num_full,
                block_size,
                group,
                mask.as_deref(),
                HashSource {
                    len: &mut len,
                    get: &mut get,
                },
                &mut meta,
            )
        };
        let mut want_seen: Vec<MetaSeen> = Vec::new();
        let want = self.model_cache_full(
            &blocks,
            num_cached,
            num_full,
            block_size,
            group,
            mask.as_deref(),
            cb,
            &mut want_seen,
        );
        expect_same("cache_full_blocks", &got, &want);
        assert_eq!(seen, want_seen, "cache_full_blocks meta requests");
    }

    #[allow(clippy::too_many_arguments)]
    fn model_cache_full(
        &mut self,
        blocks: &[BlockId],
        num_cached: usize,
        num_full: usize,
        bs: usize,
        group: u32,
        mask: Option<&[bool]>,
        cb: &Callbacks,
        seen: &mut Vec<MetaSeen>,
    ) -> Result<(), PoolError> {
        let m = &mut self.model;
        if num_cached >= num_full {
            return Ok(());
        }
        if !bs.is_multiple_of(m.hbs) {
            return Err(PoolError::BlockSizeNotMultiple {
                block_size: bs,
                hash_block_size: m.hbs,
            });
        }
        if blocks.len() != num_full - num_cached {
            return Err(PoolError::Invalid("length".into()));
        }
        if let Some(mk) = mask {
            if mk.len() != blocks.len() {
                return Err(PoolError::MaskLength {
                    expected: blocks.len(),
                    got: mk.len(),
                });
            }
        }
        if cb.len_fails {
            return Err(injected());
        }
        if cb.hashes.len() < num_full {
            return Err(PoolError::NotEnoughHashes {
                needed: num_full,
                available: cb.hashes.len(),
            });
        }
        if num_full.checked_mul(bs).is_none() || u32::try_from(bs).is_err() {
            return Err(PoolError::Invalid("sizes overflow".into()));
        }
        if let Some(&b) = blocks.iter().find(|&&b| b as usize >= m.n) {
            return Err(m.out_of_range(b));
        }
        let mut script = Script { cb, gets: 0 };
        let mut stored = Vec::new();
        for (i, &b) in blocks.iter().enumerate() {
            if b == 0 || mask.is_some_and(|mk| !mk[i]) {
                continue;
            }
            let pos = num_cached + i;
            let covered = (pos + 1) * bs;
            if let Some((_, have)) = m.primary[b as usize] {
                if have >= covered {
                    return Err(PoolError::NotAPromotion {
                        block_id: b,
                        have,
                        covered,
                    });
                }
            }
            if u32::try_from(covered).is_err() {
                return Err(PoolError::Invalid("u32".into()));
            }
            let hash = script.hash(pos)?;
            stored.push((pos, b, BlockKey::new(hash, group), covered));
        }
        let event = if m.events_on {
            let parent = if num_cached == 0 {
                None
            } else {
                Some(script.hash(num_cached - 1)?)
            };
            let ranges: Vec<(usize, usize)> =
                stored.iter().map(|s| (s.0 * bs, (s.0 + 1) * bs)).collect();
            let req = MetaRequest {
                token_range: (num_cached * bs, num_full * bs),
                block_ranges: &ranges,
                first_mm_idx: 0,
            };
            seen.push((req.token_range, ranges.clone(), 0));
            if cb.meta_fails {
                return Err(injected());
            }
            Some((parent, meta_of(&req)))
        } else {
            None
        };
        for &(_, b, key, covered) in &stored {
            if m.primary[b as usize].is_some() {
                m.remove_keys(b);
            }
            m.insert_key(key, b, covered);
        }
        if let Some((parent, meta)) = event {
            m.events.push(KvEvent::BlockStored {
                block_hashes: stored.iter().map(|s| s.2.hash).collect(),
                parent_block_hash: parent,
                block_size: bs as u32,
                group_idx: group,
                meta,
            });
        }
        Ok(())
    }

    #[allow(clippy::too_many_arguments)]
    fn cache_partial(
        &mut self,
        block: BlockId,
        num_tokens: usize,
        group: u32,
        block_size: usize,
        num_hashes: usize,
        cb: &Callbacks,
    ) {
        let mut seen: Vec<MetaSeen> = Vec::new();
        let got = {
            let mut script = Script { cb, gets: 0 };
            let mut get = |i: usize| -> Result<BlockHash, PoolError> {
                assert!(
                    i < num_hashes,
                    "cache_partial_block read hash {i} of {num_hashes}"
                );
                script.hash(i)
            };
            let mut meta = |r: &MetaRequest<'_>| -> Result<StoredMeta, PoolError> {
                seen.push((r.token_range, r.block_ranges.to_vec(), r.first_mm_idx));
                if cb.meta_fails {
                    Err(injected())
                } else {
                    Ok(meta_of(r))
                }
            };
            self.pool.cache_partial_block(
                block, num_tokens, group, block_size, num_hashes, &mut get, &mut meta,
            )
        };
        let mut want_seen = Vec::new();
        let want = self.model_cache_partial(
            block,
            num_tokens,
            group,
            block_size,
            num_hashes,
            cb,
            &mut want_seen,
        );
        expect_same("cache_partial_block", &got, &want);
        assert_eq!(seen, want_seen, "cache_partial_block meta requests");
    }

    #[allow(clippy::too_many_arguments)]
    fn model_cache_partial(
        &mut self,
        b: BlockId,
        num_tokens: usize,
        group: u32,
        bs: usize,
        num_hashes: usize,
        cb: &Callbacks,
        seen: &mut Vec<MetaSeen>,
    ) -> Result<Option<BlockKey>, PoolError> {
        let m = &mut self.model;
        if b as usize >= m.n {
            return Err(m.out_of_range(b));
        }
        if b == 0 {
            return Ok(None);
        }
        let hbs = m.hbs;
        let partial = || PoolError::InvalidPartial(String::new());
        if bs <= hbs {
            return Err(partial());
        }
        if !bs.is_multiple_of(hbs) {
            return Err(PoolError::BlockSizeNotMultiple {
                block_size: bs,
                hash_block_size: hbs,
            });
        }
        if num_tokens.is_multiple_of(bs) || !num_tokens.is_multiple_of(hbs) {
            return Err(partial());
        }
        let k = num_tokens / hbs;
        if k == 0 || k > num_hashes {
            return Err(partial());
        }
        if u32::try_from(num_tokens).is_err() {
            return Err(PoolError::Invalid("u32".into()));
        }
        let mut script = Script { cb, gets: 0 };
        let hash = script.hash(k - 1)?;
        let key = BlockKey::new(hash, group);
        let primary = m.primary[b as usize];
        let already = m.holds(b, &key);
        let event = if m.events_on && !already {
            let parent = if k > 1 {
                Some(script.hash(k - 2)?)
            } else {
                None
            };
            let start = (k - 1) * hbs;
            let req = MetaRequest {
                token_range: (start, num_tokens),
                block_ranges: &[(start, num_tokens)],
                first_mm_idx: if start > 0 { -1 } else { 0 },
            };
            seen.push((req.token_range, req.block_ranges.to_vec(), req.first_mm_idx));
            if cb.meta_fails {
                return Err(injected());
            }
            Some((parent, start, meta_of(&req)))
        } else {
            None
        };
        if !already && primary.is_some_and(|(_, have)| have < num_tokens) {
            m.remove_keys(b);
        }
        m.insert_key(key, b, num_tokens);
        if let Some((parent, start, meta)) = event {
            m.events.push(KvEvent::BlockStored {
                block_hashes: vec![hash],
                parent_block_hash: parent,
                block_size: (num_tokens - start) as u32,
                group_idx: group,
                meta,
            });
        }
        Ok(Some(key))
    }

    /// The whole observable state against the model, and the pool's own invariants.
    fn check(&self) {
        let (p, m) = (&self.pool, &self.model);
        if let Err(e) = p.check_invariants() {
            panic!("pool invariants: {e}");
        }
        assert_eq!(p.get_num_free_blocks(), m.queue.len(), "free count");
        assert_eq!(
            p.all_free_block_ids(),
            m.queue.iter().copied().collect::<Vec<_>>(),
            "free queue order"
        );
        let total = m.n - 1;
        let usage = (total > 0).then(|| 1.0 - m.queue.len() as f64 / total as f64);
        assert_eq!(p.get_usage(), usage, "usage");
        let mut owners = vec![0i64; m.n];
        for &b in &self.held {
            owners[b as usize] += 1;
        }
        for b in 0..m.n as u32 {
            assert_eq!(i64::from(p.ref_cnt(b)), m.rc[b as usize], "ref_cnt of {b}");
            if b != 0 {
                assert_eq!(m.rc[b as usize], owners[b as usize], "owners of {b}");
            }
            assert_eq!(p.primary_key(b), m.primary[b as usize], "primary of {b}");
            assert_eq!(p.has_hash(b), m.primary[b as usize].is_some());
            assert_eq!(p.alias_keys(b), m.aliases[b as usize], "aliases of {b}");
        }
        assert_eq!(p.num_cached_keys(), m.num_keys(), "distinct keys");
        for (i, key) in self.keys.iter().enumerate() {
            let want = m.blocks_of(key);
            assert_eq!(p.blocks_of(key), want, "blocks of {key:?}");
            assert_eq!(p.get_one_block(key), m.first(key), "first block of {key:?}");
            // MAP-7 for the listed blocks and one other block per key (all of them would be
            // keys x blocks lookups per step).
            for &b in &want {
                assert!(p.contains(key, b), "{key:?} lists {b}");
            }
            let other = ((i + self.steps) % m.n) as u32;
            assert_eq!(
                p.contains(key, other),
                want.contains(&other),
                "{key:?} and {other}"
            );
        }
        assert!(!p.contains(&self.keys[0], m.n as u32));
        assert_eq!(p.has_pending_events(), !m.events.is_empty());
    }

    fn step(&mut self, op: Op) {
        let n = self.model.n;
        let hbs = self.model.hbs;
        match op {
            Op::Alloc { n: count, into } => {
                let k = count.get();
                let got = if into {
                    let mut out = vec![7];
                    self.pool
                        .get_new_blocks_into(k, &mut out)
                        .map(|()| out.split_off(1))
                } else {
                    self.pool.get_new_blocks(k)
                };
                let want = self.model.alloc(k);
                expect_same("get_new_blocks", &got, &want);
                if let Ok(ids) = got {
                    self.held.extend(ids);
                }
            }
            Op::FreeHeld { picks, reversed } => {
                let mut ids = Vec::new();
                for p in picks {
                    if self.held.is_empty() {
                        break;
                    }
                    let i = usize::from(p) % self.held.len();
                    ids.push(self.held.swap_remove(i));
                }
                self.held.extend(&ids);
                self.free(ids, reversed);
            }
            Op::Free { ids, reversed } => {
                let ids = ids.iter().map(|i| i.get(n)).collect();
                self.free(ids, reversed);
            }
            Op::TouchFree { picks } => {
                let q = &self.model.queue;
                let ids = picks
                    .iter()
                    .filter(|_| !q.is_empty())
                    .map(|&p| q[usize::from(p) % q.len()])
                    .collect();
                self.touch(ids);
            }
            Op::TouchCached { keys } => {
                let ids = keys
                    .iter()
                    .filter_map(|&(h, g)| {
                        let key = BlockKey::new(hash_of(h), u32::from(g % NUM_GROUPS));
                        self.pool.get_one_block(&key)
                    })
                    .collect();
                self.touch(ids);
            }
            Op::Touch { ids } => {
                let ids = ids.iter().map(|i| i.get(n)).collect();
                self.touch(ids);
            }
            Op::CacheFull {
                blocks,
                num_cached,
                num_full,
                block_size,
                group,
                mask,
                cb,
            } => {
                let blocks = self.pick_blocks(&blocks);
                let num_cached = num_cached.get();
                let num_full = num_full.map_or(num_cached.saturating_add(blocks.len()), Count::get);
                let bs = block_size.get(hbs);
                let group = u32::from(group % NUM_GROUPS);
                self.cache_full(blocks, num_cached, num_full, bs, group, mask, &cb);
            }
            Op::CachePartial {
                block,
                num_tokens,
                group,
                block_size,
                num_hashes,
                cb,
            } => {
                let Some(&b) = self.pick_blocks(&block).first() else {
                    return;
                };
                let group = u32::from(group % NUM_GROUPS);
                let bs = block_size.get(hbs);
                self.cache_partial(b, num_tokens.get(), group, bs, num_hashes.get(), &cb);
            }
            Op::Evict { ids } => {
                let ids: Vec<i64> = ids.iter().map(|i| i.get(n)).collect();
                let got = self.pool.evict_blocks(&ids);
                let want = self.model.evict(&ids);
                expect_same("evict_blocks", &got, &want);
            }
            Op::Reset => {
                assert_eq!(self.pool.reset_prefix_cache(), self.model.reset(), "reset");
            }
            Op::TakeEvents => {
                let got = self.pool.take_events();
                let want = std::mem::take(&mut self.model.events);
                assert_eq!(got, want, "events");
            }
            Op::Lookup {
                hashes,
                groups,
                evictable,
            } => {
                let hashes: Vec<BlockHash> = hashes.into_iter().map(hash_of).collect();
                let groups: Vec<u32> = groups
                    .into_iter()
                    .take(4)
                    .map(|g| u32::from(g % (NUM_GROUPS + 1)))
                    .collect();
                let mut want: Vec<Vec<BlockId>> = vec![Vec::new(); groups.len()];
                if !groups.is_empty() {
                    for h in &hashes {
                        let row: Option<Vec<BlockId>> = groups
                            .iter()
                            .map(|&g| self.model.first(&BlockKey::new(*h, g)))
                            .collect();
                        let Some(row) = row else { break };
                        for (w, b) in want.iter_mut().zip(row) {
                            w.push(b);
                        }
                    }
                }
                let got = self
                    .pool
                    .longest_cached_prefix(hashes.iter().copied(), &groups);
                assert_eq!(got, want, "longest_cached_prefix");
                if let Some(h) = hashes.first() {
                    let want: Option<Vec<BlockId>> = groups
                        .iter()
                        .map(|&g| self.model.first(&BlockKey::new(*h, g)))
                        .collect();
                    assert_eq!(self.pool.get_cached_block(h, &groups), want);
                }
                let ids: Vec<BlockId> = evictable.iter().map(|i| i.get(n)).collect();
                let want = ids
                    .iter()
                    .filter(|&&b| b != 0 && (b as usize) < n && self.model.rc[b as usize] == 0)
                    .count();
                assert_eq!(self.pool.count_evictable(&ids), want, "count_evictable");
            }
            Op::RecordOps { on } => {
                self.pool.record_block_ops(on);
                self.model.ops = on.then(|| self.model.ops.take().unwrap_or_default());
            }
            Op::TakeOps => {
                let want = self
                    .model
                    .ops
                    .as_mut()
                    .map(std::mem::take)
                    .unwrap_or_default();
                assert_eq!(self.pool.take_block_ops(), want, "block ops");
            }
            Op::Clone => {
                self.pool = self.pool.clone();
            }
        }
    }
}

fuzz_target!(|input: Input| {
    let Input {
        raw_size,
        size,
        caching,
        hbs,
        events,
        ops,
    } = input;
    // Sizes the core must refuse without allocating; valid ones are built small below.
    if raw_size <= 0 || raw_size > MAX_BLOCKS {
        assert_eq!(
            BlockPool::new(raw_size, caching, 16, events).unwrap_err(),
            PoolError::InvalidPoolSize(raw_size)
        );
    }
    let n = 1 + usize::from(size) % MAX_POOL;
    if hbs == 0 {
        assert!(matches!(
            BlockPool::new(n as i64, caching, 0, events),
            Err(PoolError::Invalid(_))
        ));
    }
    let hbs = [1, 2, 4, 16][usize::from(hbs % 4)];
    let pool = BlockPool::new(n as i64, caching, hbs, events).expect("a small pool");
    assert_eq!(
        (
            pool.num_blocks(),
            pool.enable_caching(),
            pool.hash_block_size(),
            pool.events_enabled()
        ),
        (n, caching, hbs, events)
    );
    let mut h = Harness {
        pool,
        model: Model::new(n, caching, hbs, events),
        held: Vec::new(),
        keys: all_keys(),
        steps: 0,
    };
    h.check();
    for op in ops.into_iter().take(256) {
        h.step(op);
        h.steps += 1;
        h.check();
    }
    // Everything the harness holds can be given back, after which the cache can be reset.
    let held = std::mem::take(&mut h.held);
    h.free(held, false);
    h.check();
    assert!(h.pool.reset_prefix_cache() && h.model.reset());
    assert_eq!(h.pool.take_events(), std::mem::take(&mut h.model.events));
    let ops = h.model.ops.as_mut().map(std::mem::take).unwrap_or_default();
    assert_eq!(h.pool.take_block_ops(), ops, "block ops");
    h.check();
});

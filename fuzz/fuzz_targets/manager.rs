//! The request-level manager (`coordinator::Coordinator` over one `single_type::SingleTypeManager`
//! per KV-cache group) driven through request lifecycles with arbitrary counts, in a
//! configuration the input chooses:
//!
//! - unitary full attention: one `Kind::Full` group, `Mode::Unitary` with prefix caching or
//!   `Mode::NoPrefixCache` without (any block size then), context parallelism, EAGLE; its raw
//!   sizes are first offered to `Coordinator::new`, which must refuse exactly the inconsistent
//!   ones;
//! - hybrid: one or two `Kind::Full` groups plus a `Kind::SlidingWindow` group, optionally a
//!   Mamba group (none / all / align mode, speculative blocks) or a chunked-local group, with
//!   `attention_groups` full-first, mixed block sizes, EAGLE per attention group, admission caps
//!   and a retention interval; `Mode::Hybrid` with caching, `Mode::NoPrefixCache` without. A few
//!   broken hybrid configurations must be refused by `Coordinator::new`.
//!
//! Operations: `allocate_slots` with hits (the coordinator's `find_longest_cache_hit` on the
//! request's hashes, the per-group lookup, cut ones, empty ones or arbitrary blocks), lookahead,
//! external tokens, `delay_cache_blocks`, `full_sequence_must_fit`, reserved blocks and huge
//! counts; a consistent scheduler (`Schedule`: prefill in chunks with the prefix hit, decode,
//! preemption on refusal, finish); caching, `remove_skipped_blocks`, `new_step_starts`,
//! preemption (free, with retention priorities), pop, common-prefix queries, recorded new block
//! ids, the lookups (checked against a model in unitary configurations, against the cache's keys
//! in hybrid ones), slot hints for group 0 (valid, stale and forged ones, through
//! `RequestView.hint`), and misuse of the per-group operations (`coord.groups[i]`'s
//! `add_local_computed_blocks`, `allocate_external_computed_blocks`, `allocate_new_blocks`,
//! `cache_blocks`) and of the coordinator's.
//!
//! Checked after every step: `Coordinator::check_invariants(&pool)` (every group's tables and
//! the pool), and every block's reference count equals its owners: its occurrences in every
//! group's tables plus the references the harness took over (popped tables, touched free
//! blocks); the null block too where no group can hold it without a reference (unitary). Also:
//! an `Err` documented as changing nothing (`allocate_slots`' `Invalid`, `Invariant` and
//! `NotEnoughFreeBlocks`; the per-group operations' errors) leaves tables, reference counts,
//! free queue order, cache keys, recorded ids and events as they were; a refused allocation
//! (`Ok(None)`) changes nothing but ALLOC-6's skipped blocks; new blocks come fresh off the free
//! queue; lookups change nothing; the consistent scheduler's allocations fail only with
//! `NotEnoughFreeBlocks`.

#![no_main]

use std::collections::HashSet;

use arbitrary::Arbitrary;
use kvcore_core::coordinator::{
    AllocateArgs, AttentionGroup, Coordinator, CoordinatorConfig, Mode, NewBlocks, RequestView,
};
use kvcore_core::events::{MetaRequest, StoredMeta};
use kvcore_core::hash::{BlockHash, BlockKey};
use kvcore_core::pool::retention::Retention;
use kvcore_core::pool::{BlockId, BlockPool, HashSource};
use kvcore_core::single_type::{GroupConfig, Kind, MambaMode};
use kvcore_core::tables::{HintCell, SlotHint};
use kvcore_core::PoolError;
use libfuzzer_sys::fuzz_target;

const MAX_POOL: usize = 64;
const NUM_REQUESTS: usize = 6;
/// Longest hash list a request gets, at the hash block size (more would only cost time).
const MAX_HASHES: usize = 256;
const NULL: BlockId = 0;

#[derive(Debug, Clone, Copy, Arbitrary)]
enum Count {
    Small(u8),
    Medium(u16),
    Any(usize),
}

impl Count {
    fn get(self) -> usize {
        match self {
            Self::Small(v) => usize::from(v % 80),
            Self::Medium(v) => usize::from(v % 4096),
            Self::Any(v) => v,
        }
    }
}

#[derive(Debug, Clone, Copy, Arbitrary)]
enum Signed {
    Small(i8),
    Any(i64),
}

impl Signed {
    fn get(self) -> i64 {
        match self {
            Self::Small(v) => i64::from(v % 8),
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
enum HintPick {
    None,
    Current,
    /// One of the hints seen earlier for this request (possibly stale).
    Old(u8),
    Forged {
        uid: u64,
        slot: u32,
        generation: u64,
    },
}

#[derive(Debug, Clone, Arbitrary)]
enum Hits {
    /// No hits object (ALLOC-8's `None`).
    Absent,
    /// The coordinator's hit over the request's hashes (`num_tokens - 1` tokens at most), as the
    /// scheduler finds it.
    Found,
    /// The hybrid per-group lookup (COORD-12): groups may disagree on the length.
    PerGroup,
    /// The coordinator's hit with one group's list cut (misuse).
    Cut { group: u8, keep: u8 },
    /// An empty list per group (ALLOC-8: registers the request as running).
    Empty,
    /// Arbitrary blocks per group (misuse: free, in use, null, out of range, a wrong number of
    /// groups).
    Ids(Vec<Vec<IdPick>>),
}

#[derive(Debug, Clone, Arbitrary)]
struct Alloc {
    req: u8,
    computed: Count,
    num_tokens: Count,
    /// `None`: `num_tokens`.
    prompt: Option<Count>,
    waiting: bool,
    hint: HintPick,
    new_tokens: Count,
    hits: Hits,
    /// `None`: the hits' tokens.
    new_computed: Option<Count>,
    lookahead: Count,
    external: Count,
    encoder: Count,
    delay_cache: bool,
    full_must_fit: bool,
    reserved: Signed,
    has_scheduled: bool,
    /// Truncates the request's hash list (misuse when shorter than its full blocks).
    hash_len: Option<u8>,
}

/// One step of a consistent scheduler for one request: a waiting request is admitted with its
/// prefix hit and prefills a chunk; a running one finishes its last chunk (or samples a token)
/// and schedules the next; a refusal preempts it; past the longest sequence it finishes.
#[derive(Debug, Clone, Arbitrary)]
struct Sched {
    req: u8,
    prompt_len: u8,
    chunk: u8,
    lookahead: u8,
    hint: HintPick,
    delay_cache: bool,
    full_must_fit: bool,
    reserved: u8,
    has_scheduled: bool,
}

#[derive(Debug, Clone, Arbitrary)]
enum Op {
    Allocate(Alloc),
    Schedule(Sched),
    /// Preemption or finish: frees the request's blocks in every group, last first.
    Free {
        req: u8,
        priority: Option<u8>,
    },
    /// Pops the request's tables; the harness owns the blocks until `FreeExternal`.
    Pop {
        req: u8,
    },
    FreeExternal {
        count: u8,
        reversed: bool,
    },
    /// Takes references on free blocks from outside the manager.
    TouchFree {
        picks: Vec<u8>,
    },
    CommonPrefix {
        req: u8,
    },
    TakeNewIds,
    NewStep,
    FindHit {
        req: u8,
        num_tokens: Count,
        /// `None`: `num_tokens - 1` (MGR-7).
        max: Option<Count>,
    },
    FindHitPerGroup {
        req: u8,
        num_tokens: Count,
    },
    NumToAllocate {
        req: u8,
        num_tokens: Count,
        hits: Hits,
        encoder: Count,
        total: Count,
        main: Count,
        cap: bool,
    },
    RemoveSkipped {
        req: u8,
        total: Count,
        prompt: Option<Count>,
    },
    CheckCacheable {
        req: u8,
        num_tokens: Count,
        held: bool,
        hits: Hits,
    },
    BlockIds {
        req: u8,
        computed: Count,
        clip: u8,
    },
    /// `Coordinator::cache_blocks` (errors may leave earlier groups cached: not compared).
    CoordCache {
        req: u8,
        num_tokens: Count,
        prompt: Count,
        hash_len: Option<u8>,
    },
    CoordAddComputed {
        req: u8,
        hits: Hits,
        local: Count,
        external: Count,
    },
    CoordAllocNew {
        req: u8,
        num_tokens: Count,
        main: Count,
        encoder: Count,
    },
    /// The per-group operations (documented as changing nothing when they fail).
    AddLocal {
        group: u8,
        req: u8,
        hits: Hits,
        local: Count,
        external: Count,
    },
    AllocExternal {
        group: u8,
        req: u8,
        local: Count,
        external: Count,
    },
    AllocNew {
        group: u8,
        req: u8,
        num_tokens: Count,
        main: Count,
    },
    CacheBlocks {
        group: u8,
        req: u8,
        num_tokens: Count,
        prompt: Count,
        hash_len: Option<u8>,
        /// Hands the group the hashes at the hash block size instead of its own (misuse when
        /// the sizes differ).
        raw_view: bool,
    },
    Evict {
        ids: Vec<IdPick>,
    },
    Reset,
    Clone,
}

#[derive(Debug, Clone, Copy, Arbitrary)]
enum Third {
    None,
    Mamba {
        mode: u8,
        spec_blocks: u8,
        /// `None`: the scheduler block size.
        size: Option<u8>,
    },
    Chunked {
        chunk: u8,
        cap: Option<u8>,
        /// `None`: the scheduler block size (what its lookup needs).
        size: Option<u8>,
    },
}

/// A configuration `Coordinator::new` must refuse.
#[derive(Debug, Clone, Copy, Arbitrary)]
enum BadHybrid {
    EmptyAttentionGroup,
    GroupTwice,
    GroupMissing,
    GroupOutOfRange,
    OneAttentionGroup,
    MixedSpecs,
    BlockSizeNotDividing,
    ContextParallel,
    EagleFlags,
}

#[derive(Debug, Clone, Arbitrary)]
struct HybridShape {
    full_size: u8,
    two_full: bool,
    swa_size: u8,
    window: u8,
    swa_cap: Option<u8>,
    third: Third,
    sbs: u8,
    /// EAGLE per attention group (bit i).
    eagle: u8,
    /// New block ids recorded per group (bit i).
    record: u8,
    retention: Option<u8>,
    bad: Option<BadHybrid>,
}

#[derive(Debug, Clone, Arbitrary)]
enum Shape {
    Unitary {
        block_size: u8,
        sbs: u8,
        dcp: bool,
        pcp: bool,
        record: bool,
        eagle: bool,
    },
    Hybrid(HybridShape),
}

#[derive(Debug, Arbitrary)]
struct Input {
    size: u8,
    caching: bool,
    hbs: u8,
    events: bool,
    max_model_len: Count,
    watermark: Count,
    shape: Shape,
    /// Per request, the seeds of its block hashes (few values: prompts share prefixes).
    prompts: [Vec<u8>; NUM_REQUESTS],
    ops: Vec<Op>,
}

fn request_id(r: u8) -> &'static str {
    ["r0", "r1", "r2", "r3", "r4", "r5"][usize::from(r) % NUM_REQUESTS]
}

/// The harness's own copy of a request id.
fn static_id(id: &str) -> &'static str {
    (0..NUM_REQUESTS as u8)
        .map(request_id)
        .find(|&r| r == id)
        .expect("a harness request id")
}

fn gcd(a: usize, b: usize) -> usize {
    if b == 0 {
        a
    } else {
        gcd(b, a % b)
    }
}

fn lcm(a: usize, b: usize) -> usize {
    a / gcd(a, b) * b
}

/// Chained block hashes from seeds: requests whose seeds agree up to a block share that
/// block's hash. Past its seeds a request's hashes are its own.
fn hashes_for(req: usize, seeds: &[u8], len: usize) -> Vec<BlockHash> {
    let mut out = Vec::with_capacity(len);
    let mut state: u64 = 0xcbf2_9ce4_8422_2325;
    for i in 0..len {
        let s = match seeds.get(i) {
            Some(&s) => u64::from(s % 3),
            None => 1000 + req as u64,
        };
        state = (state ^ s).wrapping_mul(0x0100_0000_01b3) ^ (i as u64) << 40;
        let mut bytes = [0u8; 16];
        bytes[..8].copy_from_slice(&state.to_le_bytes());
        bytes[8..].copy_from_slice(&(state.rotate_left(17) ^ 0x5555).to_le_bytes());
        out.push(BlockHash::from_slice(&bytes).unwrap());
    }
    out
}

/// One request's entry in one group: its id, blocks and cached-block count.
type Entry = (String, Vec<BlockId>, Option<usize>);

/// A block's primary key (with the tokens it covers) and alias keys.
type Keys = (Option<(BlockKey, usize)>, Vec<BlockKey>);

/// Every entry of every group's tables, every block's reference count, queue position and
/// keys, the recorded new ids and whether events are queued: what "nothing changes" compares.
#[derive(Debug, PartialEq)]
struct State {
    tables: Vec<Vec<Entry>>,
    ref_cnts: Vec<i32>,
    free: Vec<BlockId>,
    keys: Vec<Keys>,
    num_keys: usize,
    /// How many new block ids were recorded so far.
    new_ids: usize,
    events: bool,
}

impl State {
    fn entry(&self, g: usize, id: &str) -> Option<&Entry> {
        self.tables[g].iter().find(|e| e.0 == id)
    }

    /// The state without empty, not-running entries (the reference's default-dict reads).
    fn without_empty_entries(mut self) -> Self {
        for t in &mut self.tables {
            t.retain(|e| !e.1.is_empty() || e.2.is_some());
        }
        self
    }
}

/// A simulated request of the consistent scheduler.
#[derive(Debug, Clone, Copy, Default)]
struct Sim {
    /// Tokens computed before the last scheduled chunk.
    computed: usize,
    /// Tokens scheduled by the last allocation.
    pending: usize,
    tokens: usize,
    prompt: usize,
    /// Only `Schedule` changed the request since it was last freed.
    clean: bool,
}

const FRESH: Sim = Sim {
    computed: 0,
    pending: 0,
    tokens: 0,
    prompt: 0,
    clean: true,
};

struct Harness {
    pool: BlockPool,
    coord: Coordinator,
    prompts: [Vec<u8>; NUM_REQUESTS],
    /// References the harness owns (popped tables, touched blocks), one entry each.
    external: Vec<BlockId>,
    /// Hints taken earlier, with the request they were taken for (a hint is only ever
    /// passed for its own request: the core trusts a valid hint to name the request's entry).
    hints: Vec<(&'static str, Option<SlotHint>)>,
    sims: [Sim; NUM_REQUESTS],
    /// Whether a group records new ids.
    record: Vec<bool>,
    /// New block ids taken out of the coordinator by [`Self::state`], not yet by `TakeNewIds`.
    recorded: Vec<BlockId>,
    /// Whether the null block's count is exact: no group puts it in a table without a touch.
    exact_null: bool,
    /// Whether a lookup may fail for the configuration (chunked local attention with EAGLE or a
    /// block size other than the scheduler's).
    lookup_may_fail: bool,
    retention_interval: Option<usize>,
}

impl Harness {
    fn n(&self) -> usize {
        self.pool.num_blocks()
    }

    fn hbs(&self) -> usize {
        self.pool.hash_block_size()
    }

    fn ng(&self) -> usize {
        self.coord.num_groups()
    }

    fn hashes(&self, r: u8, num_tokens: usize, hash_len: Option<u8>) -> Vec<BlockHash> {
        let full = (num_tokens / self.hbs()).min(MAX_HASHES);
        let len = hash_len.map_or(full, |l| usize::from(l).min(full));
        let req = usize::from(r) % NUM_REQUESTS;
        hashes_for(req, &self.prompts[req], len)
    }

    /// The hashes at group `g`'s block size (SPEC RH-3).
    fn view(&self, g: usize, hashes: &[BlockHash]) -> Vec<BlockHash> {
        let stride = (self.coord.groups[g].spec_block_size() / self.hbs()).max(1);
        (0..hashes.len() / stride)
            .map(|j| hashes[(j + 1) * stride - 1])
            .collect()
    }

    fn state(&mut self) -> State {
        let n = self.n();
        let ids = self.coord.take_new_block_ids();
        self.recorded.extend(ids);
        let tables = self
            .coord
            .groups
            .iter()
            .map(|g| {
                let mut ids: Vec<&str> = g.tables.request_ids().collect();
                ids.sort_unstable();
                ids.into_iter()
                    .map(|id| {
                        let e = g.tables.get(id).expect("listed ids have entries");
                        (id.to_owned(), e.blocks.clone(), e.num_cached)
                    })
                    .collect()
            })
            .collect();
        State {
            tables,
            ref_cnts: (0..n).map(|b| self.pool.ref_cnt(b as BlockId)).collect(),
            free: self.pool.all_free_block_ids(),
            keys: (0..n)
                .map(|b| {
                    let b = b as BlockId;
                    (self.pool.primary_key(b), self.pool.alias_keys(b))
                })
                .collect(),
            num_keys: self.pool.num_cached_keys(),
            new_ids: self.recorded.len(),
            events: self.pool.has_pending_events(),
        }
    }

    /// The hits a `Hits` names and the tokens they cover; `None` for no hits object.
    fn hits(
        &mut self,
        hits: &Hits,
        r: u8,
        num_tokens: usize,
    ) -> Option<(Vec<Vec<BlockId>>, usize)> {
        let ng = self.ng();
        match hits {
            Hits::Absent => None,
            Hits::Found | Hits::Cut { .. } => {
                let hashes = self.hashes(r, num_tokens, None);
                let hl: &[BlockHash] = &hashes;
                let (mut blocks, len) = self
                    .coord
                    .find_longest_cache_hit(&self.pool, &hl, num_tokens.saturating_sub(1))
                    .ok()?;
                if let Hits::Cut { group, keep } = hits {
                    let g = usize::from(*group) % ng;
                    blocks[g].truncate(usize::from(*keep));
                }
                Some((blocks, len))
            }
            Hits::PerGroup => {
                let hashes = self.hashes(r, num_tokens, None);
                let hl: &[BlockHash] = &hashes;
                let (blocks, lens) = self
                    .coord
                    .find_longest_cache_hit_per_group(&self.pool, &hl, num_tokens.saturating_sub(1))
                    .ok()?;
                let len = lens.iter().copied().min().unwrap_or(0);
                Some((blocks, len))
            }
            Hits::Empty => Some((vec![Vec::new(); ng], 0)),
            Hits::Ids(ids) => {
                let n = self.n();
                let blocks: Vec<Vec<BlockId>> = ids
                    .iter()
                    .take(ng + 1)
                    .map(|g| g.iter().take(8).map(|i| i.get(n)).collect())
                    .collect();
                let len = blocks
                    .first()
                    .map_or(0, |b| b.len() * self.coord.groups[0].block_size());
                Some((blocks, len))
            }
        }
    }

    fn hint(&self, pick: HintPick, id: &str) -> Option<SlotHint> {
        let t = &self.coord.groups[0].tables;
        let own = t.hint(id);
        match pick {
            HintPick::None => None,
            HintPick::Current => own,
            HintPick::Old(i) => {
                let mine: Vec<Option<SlotHint>> = self
                    .hints
                    .iter()
                    .filter(|h| h.0 == id)
                    .map(|h| h.1)
                    .collect();
                mine.get(usize::from(i) % mine.len().max(1))
                    .copied()
                    .flatten()
            }
            HintPick::Forged {
                uid,
                slot,
                generation,
            } => {
                let h = Some(SlotHint {
                    uid,
                    slot,
                    generation,
                });
                // A forged hint that happens to name another live entry breaks the contract.
                if t.hint_is_valid(h) && h != own {
                    None
                } else {
                    h
                }
            }
        }
    }

    fn remember_hint(&mut self, id: &'static str) {
        let h = (id, self.coord.groups[0].tables.hint(id));
        if self.hints.len() < 32 {
            self.hints.push(h);
        } else {
            let i = h.1.map_or(0, |x| x.slot as usize) % 32;
            self.hints[i] = h;
        }
    }

    /// `allocate_slots` with its checks: what an `Err` documented as changing nothing, a
    /// refusal and a grant may change.
    fn allocate_checked(
        &mut self,
        req: RequestView<'_>,
        args: AllocateArgs<'_>,
        hashes: &[BlockHash],
    ) -> Result<Option<NewBlocks>, PoolError> {
        let id = static_id(req.id);
        let before = self.state();
        let mut get = |i: usize| -> Result<BlockHash, PoolError> {
            assert!(
                i < hashes.len(),
                "allocate_slots read hash {i} of {}",
                hashes.len()
            );
            Ok(hashes[i])
        };
        let result = self.coord.allocate_slots(
            &mut self.pool,
            req,
            args,
            HashSource {
                len: &mut || Ok(hashes.len()),
                get: &mut get,
            },
            &mut |_: &MetaRequest<'_>| Ok(StoredMeta::default()),
        );
        let after = self.state();
        let ng = self.ng();
        // Other requests are never touched.
        for g in 0..ng {
            let ids: HashSet<&str> = before.tables[g]
                .iter()
                .chain(&after.tables[g])
                .map(|e| e.0.as_str())
                .filter(|&x| x != id)
                .collect();
            for other in ids {
                assert_eq!(
                    before.entry(g, other),
                    after.entry(g, other),
                    "allocate_slots of {id} changed {other} in group {g}"
                );
            }
        }
        match &result {
            Ok(Some(ranges)) => {
                assert_eq!(ranges.len(), ng);
                let mut fresh = HashSet::new();
                // Blocks this request held in groups that skip (ALLOC-6 may free them).
                let skipped: HashSet<BlockId> = (0..ng)
                    .filter(|&g| self.coord.groups[g].kind().skips())
                    .filter_map(|g| before.entry(g, id))
                    .flat_map(|e| e.1.iter().copied())
                    .collect();
                for (g, range) in ranges.iter().enumerate() {
                    let kind = self.coord.groups[g].kind();
                    let a = after.entry(g, id).map_or(&[][..], |e| e.1.as_slice());
                    let b = before.entry(g, id).map_or(&[][..], |e| e.1.as_slice());
                    assert!(range.start <= range.end && range.end <= a.len());
                    if matches!(
                        kind,
                        Kind::Mamba {
                            mode: MambaMode::Align,
                            ..
                        }
                    ) {
                        // Align mode moves its state blocks and pads with nulls (MAMBA-5).
                        continue;
                    }
                    assert_eq!(
                        range.end,
                        a.len(),
                        "group {g}: the new blocks end the table"
                    );
                    for &x in &a[range.clone()] {
                        assert!(x != NULL, "group {g}: a new null block");
                        // Fresh off the queue: free before, or freed by this call's ALLOC-6.
                        assert!(
                            before.ref_cnts[x as usize] == 0 || skipped.contains(&x),
                            "new block {x} was in use"
                        );
                        assert_eq!(self.pool.ref_cnt(x), 1, "new block {x}");
                        assert!(fresh.insert(x), "new block {x} given twice");
                    }
                    if kind.skips() {
                        assert!(a.len() >= b.len());
                        for (i, (&x, &y)) in b.iter().zip(a).enumerate() {
                            assert!(x == y || y == NULL, "group {g}: block {i} {x} became {y}");
                        }
                    } else {
                        assert!(a.starts_with(b), "group {g}: the table lost its prefix");
                    }
                }
            }
            Ok(None) => {
                // Only ALLOC-6 (skipped blocks freed, kept on refusal) may have changed the
                // request's tables of the groups that skip.
                for g in 0..ng {
                    let (b, a) = (before.entry(g, id), after.entry(g, id));
                    if !self.coord.groups[g].kind().skips() {
                        assert_eq!(b, a, "a refused allocation changed group {g}");
                        continue;
                    }
                    match (b, a) {
                        (None, None) => {}
                        (None, Some(a)) => assert!(a.1.is_empty() && a.2.is_none()),
                        (Some(b), Some(a)) => {
                            assert_eq!(b.2, a.2);
                            assert_eq!(b.1.len(), a.1.len());
                            for (&x, &y) in b.1.iter().zip(&a.1) {
                                assert!(x == y || y == NULL, "refusal: {x} became {y}");
                            }
                        }
                        (Some(_), None) => panic!("a refused allocation removed an entry"),
                    }
                }
                for b in 1..self.n() {
                    assert!(
                        after.ref_cnts[b] <= before.ref_cnts[b],
                        "refusal took block {b}"
                    );
                }
                if !self.coord.has_skippers() {
                    assert_eq!(before, after, "a refused allocation changed something");
                }
            }
            Err(e) => {
                assert_eq!(
                    before, after,
                    "allocate_slots failed ({e}) and changed something"
                );
            }
        }
        self.remember_hint(id);
        result
    }

    fn allocate(&mut self, a: &Alloc) {
        let id = request_id(a.req);
        self.sims[usize::from(a.req) % NUM_REQUESTS].clean = false;
        let num_tokens = a.num_tokens.get();
        let hashes = self.hashes(a.req, num_tokens, a.hash_len);
        let hits = self.hits(&a.hits, a.req, num_tokens);
        let new_computed = a
            .new_computed
            .map_or_else(|| hits.as_ref().map_or(0, |h| h.1), Count::get);
        let cells = [HintCell::new(self.hint(a.hint, id))];
        let req = RequestView {
            id,
            num_computed_tokens: a.computed.get(),
            num_tokens,
            num_prompt_tokens: a.prompt.map_or(num_tokens, Count::get),
            waiting_or_preempted: a.waiting,
            hints: &cells,
        };
        let args = AllocateArgs {
            num_new_tokens: a.new_tokens.get(),
            num_new_computed_tokens: new_computed,
            new_computed_blocks: hits.as_ref().map(|h| h.0.as_slice()),
            num_lookahead_tokens: a.lookahead.get(),
            num_external_computed_tokens: a.external.get(),
            delay_cache_blocks: a.delay_cache,
            num_encoder_tokens: a.encoder.get(),
            full_sequence_must_fit: a.full_must_fit,
            reserved_blocks: a.reserved.get(),
            has_scheduled_reqs: a.has_scheduled,
        };
        let _ = self.allocate_checked(req, args, &hashes);
    }

    fn free_request(&mut self, id: &str) {
        self.coord
            .free(&mut self.pool, id, Retention::DEFAULT, 0.0)
            .expect("freeing a request's own blocks");
    }

    fn schedule(&mut self, s: &Sched) {
        let r = usize::from(s.req) % NUM_REQUESTS;
        let id = request_id(s.req);
        if !self.sims[r].clean {
            // Touched by raw operations: the scheduler aborts it and starts over.
            self.free_request(id);
            self.sims[r] = FRESH;
        }
        let limit = self.coord.max_model_len().min(MAX_HASHES * self.hbs());
        let sbs = self.coord.scheduler_block_size();
        let align = self.coord.groups.iter().any(|g| {
            matches!(
                g.kind(),
                Kind::Mamba {
                    mode: MambaMode::Align,
                    ..
                }
            )
        });
        let budget = 1 + usize::from(s.chunk) * 3;
        // Align mode schedules prefill chunks that end on scheduler blocks (but the last).
        let chunk = |start: usize, tokens: usize| -> usize {
            let n = (tokens - start).min(budget);
            if align && start + n < tokens {
                let end = (start + n) / sbs * sbs;
                if end > start {
                    end - start
                } else {
                    (tokens - start).min(sbs - start % sbs)
                }
            } else {
                n
            }
        };
        let sim = self.sims[r];
        let running = self.coord.is_running(id);
        let cells = [HintCell::new(self.hint(s.hint, id))];
        if !running {
            let tokens = if sim.tokens == 0 {
                1 + usize::from(s.prompt_len)
            } else {
                sim.tokens
            };
            if tokens > limit {
                self.free_request(id);
                self.sims[r] = FRESH;
                return;
            }
            let prompt = if sim.prompt == 0 { tokens } else { sim.prompt };
            let hashes = self.hashes(s.req, tokens, None);
            let hl: &[BlockHash] = &hashes;
            let Ok((hits, hit_len)) =
                self.coord
                    .find_longest_cache_hit(&self.pool, &hl, tokens - 1)
            else {
                assert!(self.lookup_may_fail, "a lookup failed");
                return;
            };
            let num_new = chunk(hit_len, tokens);
            let req = RequestView {
                id,
                num_computed_tokens: 0,
                num_tokens: tokens,
                num_prompt_tokens: prompt,
                waiting_or_preempted: true,
                hints: &cells,
            };
            let args = AllocateArgs {
                num_new_tokens: num_new,
                num_new_computed_tokens: hit_len,
                new_computed_blocks: Some(hits.as_slice()),
                num_lookahead_tokens: usize::from(s.lookahead % 8),
                delay_cache_blocks: s.delay_cache,
                full_sequence_must_fit: s.full_must_fit,
                reserved_blocks: i64::from(s.reserved % 4),
                has_scheduled_reqs: s.has_scheduled,
                ..AllocateArgs::default()
            };
            match self.allocate_checked(req, args, &hashes) {
                Ok(Some(_)) => {
                    self.sims[r] = Sim {
                        computed: hit_len,
                        pending: num_new,
                        tokens,
                        prompt,
                        clean: true,
                    };
                }
                Ok(None) | Err(PoolError::NotEnoughFreeBlocks { .. }) => {
                    self.sims[r] = Sim {
                        tokens,
                        prompt,
                        ..FRESH
                    };
                }
                Err(e) => panic!("admitting {id} ({tokens} tokens, hit {hit_len}): {e}"),
            }
        } else {
            let computed = sim.computed + sim.pending;
            let tokens = if computed >= sim.tokens {
                computed + 1
            } else {
                sim.tokens
            };
            if tokens > limit {
                self.free_request(id);
                self.sims[r] = FRESH;
                return;
            }
            let num_new = chunk(computed, tokens);
            let hashes = self.hashes(s.req, tokens, None);
            let req = RequestView {
                id,
                num_computed_tokens: computed,
                num_tokens: tokens,
                num_prompt_tokens: sim.prompt,
                waiting_or_preempted: false,
                hints: &cells,
            };
            let args = AllocateArgs {
                num_new_tokens: num_new,
                num_lookahead_tokens: usize::from(s.lookahead % 8),
                delay_cache_blocks: s.delay_cache,
                reserved_blocks: i64::from(s.reserved % 4),
                has_scheduled_reqs: s.has_scheduled,
                ..AllocateArgs::default()
            };
            match self.allocate_checked(req, args, &hashes) {
                Ok(Some(_)) => {
                    self.sims[r] = Sim {
                        computed,
                        pending: num_new,
                        tokens,
                        prompt: sim.prompt,
                        clean: true,
                    };
                }
                Ok(None) | Err(PoolError::NotEnoughFreeBlocks { .. }) => {
                    // Preempted: its blocks go back, it waits with all its tokens.
                    self.free_request(id);
                    self.sims[r] = Sim {
                        tokens,
                        prompt: sim.prompt,
                        ..FRESH
                    };
                }
                Err(e) => panic!("scheduling {id} ({computed}/{tokens} tokens): {e}"),
            }
        }
    }

    /// Checks a hit against the cache: every non-null block is cached under its position's
    /// hash in its group.
    fn check_hit_blocks(&self, blocks: &[Vec<BlockId>], hashes: &[BlockHash]) {
        assert_eq!(blocks.len(), self.ng());
        for (g, hit) in blocks.iter().enumerate() {
            let view = self.view(g, hashes);
            let gid = self.coord.groups[g].group_id();
            for (j, &b) in hit.iter().enumerate() {
                if b == NULL {
                    assert!(
                        !self.coord.groups[g].kind().is_full(),
                        "a null hit in full-attention group {g}"
                    );
                    continue;
                }
                let h = view.get(j).expect("a hit within the hashes");
                assert!(
                    self.pool.contains(&BlockKey::new(*h, gid), b),
                    "group {g}: hit block {b} at {j} is not cached under its hash"
                );
            }
        }
    }

    /// What a lookup must leave alone.
    fn pool_view(&self) -> (Vec<i32>, Vec<BlockId>, usize) {
        let n = self.n();
        (
            (0..n).map(|b| self.pool.ref_cnt(b as BlockId)).collect(),
            self.pool.all_free_block_ids(),
            self.pool.num_cached_keys(),
        )
    }

    fn find_hit(&mut self, r: u8, num_tokens: usize, max: usize) {
        let hashes = self.hashes(r, num_tokens, None);
        let hl: &[BlockHash] = &hashes;
        let before = self.pool_view();
        let got = self.coord.find_longest_cache_hit(&self.pool, &hl, max);
        assert_eq!(before, self.pool_view(), "a lookup changed the pool");
        let (blocks, len) = match got {
            Ok(x) => x,
            Err(e) => {
                assert!(self.lookup_may_fail, "lookup failed: {e}");
                return;
            }
        };
        assert_eq!(blocks.len(), self.ng());
        assert!(len <= max, "a hit of {len} tokens beyond {max}");
        match self.coord.mode() {
            Mode::NoPrefixCache => {
                assert_eq!(len, 0);
                assert!(blocks.iter().all(Vec::is_empty));
            }
            Mode::Unitary => {
                let g = &self.coord.groups[0];
                let bs = g.block_size();
                let mut want: Vec<BlockId> = hashes
                    .iter()
                    .take(max / bs)
                    .map_while(|h| self.pool.get_cached_block(h, &[0]).map(|v| v[0]))
                    .collect();
                if g.use_eagle {
                    want.pop();
                }
                assert_eq!(blocks[0], want, "longest cache hit");
                assert_eq!(len, want.len() * bs);
            }
            Mode::Hybrid => {
                self.check_hit_blocks(&blocks, &hashes);
                assert_eq!(len % self.coord.groups[0].spec_block_size(), 0);
                // A Mamba group ignores EAGLE's drop (MAMBA-2) but is searched with the
                // extended length (COORD-11), so with EAGLE on it the hit may pass the other
                // groups' blocks by up to one Mamba block; otherwise every group covers it.
                let overshoot = self
                    .coord
                    .groups
                    .iter()
                    .filter(|g| g.use_eagle && matches!(g.kind(), Kind::Mamba { .. }))
                    .map(|g| g.spec_block_size())
                    .max()
                    .unwrap_or(0);
                for (g, hit) in blocks.iter().enumerate() {
                    let bs = self.coord.groups[g].spec_block_size();
                    let covered = hit.len() * bs;
                    assert!(
                        covered <= len && len - covered <= overshoot,
                        "group {g}: {} hit blocks of {bs} tokens for a hit of {len}",
                        hit.len()
                    );
                }
            }
        }
    }

    /// Invariants after every step.
    fn check(&mut self) {
        if let Err(e) = self.coord.check_invariants(&self.pool) {
            panic!("coordinator invariants: {e}");
        }
        let n = self.n();
        let mut owners = vec![0i64; n];
        for (gi, g) in self.coord.groups.iter().enumerate() {
            let t = &g.tables;
            let ids: Vec<&str> = t.request_ids().collect();
            assert_eq!(ids.len(), t.num_entries());
            for id in ids {
                let entry = t.get(id).expect("listed ids have entries");
                assert!(t.contains(id));
                assert_eq!(entry.blocks, t.blocks(id));
                assert_eq!(entry.num_cached.is_some(), t.is_running(id));
                if gi == 0 {
                    let hint = t.hint(id);
                    assert!(t.hint_is_valid(hint));
                    assert_eq!(t.blocks_hinted("", hint), &entry.blocks[..]);
                }
                for &b in &entry.blocks {
                    owners[b as usize] += 1;
                }
            }
        }
        for &b in &self.external {
            owners[b as usize] += 1;
        }
        let first = if self.exact_null { 0 } else { 1 };
        for (b, &o) in owners.iter().enumerate().skip(first) {
            assert_eq!(
                i64::from(self.pool.ref_cnt(b as BlockId)),
                o,
                "block {b}: reference count against its owners"
            );
        }
        let in_use = owners.iter().skip(1).filter(|&&o| o > 0).count();
        assert_eq!(self.pool.get_num_free_blocks(), n - 1 - in_use);
        let t = &self.coord.groups[0].tables;
        for &(id, h) in &self.hints {
            // Stale hints are recognised as such; a valid one names its request's entry.
            if t.hint_is_valid(h) {
                assert_eq!(t.hint(id), h, "a valid hint of {id}");
            }
            t.prefetch_slot(h);
        }
    }

    /// A per-group operation that failed must have changed nothing, but for the empty entry
    /// its table read may have created (the reference's default dict does the same).
    fn unchanged_on_err<T>(&mut self, before: State, r: &Result<T, PoolError>, what: &str) {
        if let Err(e) = r {
            assert_eq!(
                before.without_empty_entries(),
                self.state().without_empty_entries(),
                "{what} failed ({e}) and changed something"
            );
        }
    }

    fn step(&mut self, op: Op) {
        let n = self.n();
        let ng = self.ng();
        match op {
            Op::Allocate(a) => self.allocate(&a),
            Op::Schedule(s) => self.schedule(&s),
            Op::Free { req, priority } => {
                let id = request_id(req);
                let retention = priority.map_or(Retention::DEFAULT, |p| {
                    Retention::new(i64::from(p % 101), None).expect("a priority in range")
                });
                self.coord
                    .free(&mut self.pool, id, retention, 0.0)
                    .expect("freeing a request's own blocks");
                assert!(self.coord.groups.iter().all(|g| !g.tables.contains(id)));
                self.sims[usize::from(req) % NUM_REQUESTS] = FRESH;
            }
            Op::Pop { req } => {
                let id = request_id(req);
                let want: Vec<BlockId> = self.coord.blocks(id).concat();
                let got = self.coord.pop(id);
                assert_eq!(got, want);
                assert!(self.coord.groups.iter().all(|g| !g.tables.contains(id)));
                self.external.extend(got);
                self.sims[usize::from(req) % NUM_REQUESTS] = FRESH;
            }
            Op::FreeExternal { count, reversed } => {
                let k = usize::from(count).min(self.external.len());
                let ids: Vec<BlockId> = self.external.drain(..k).collect();
                let r = if reversed {
                    self.pool.free_blocks_iter(ids.iter().rev().copied())
                } else {
                    self.pool.free_blocks(&ids)
                };
                r.expect("freeing references the harness owns");
            }
            Op::TouchFree { picks } => {
                let free = self.pool.all_free_block_ids();
                if free.is_empty() {
                    return;
                }
                let ids: Vec<BlockId> = picks
                    .iter()
                    .take(8)
                    .map(|&p| free[usize::from(p) % free.len()])
                    .collect();
                self.pool.touch(&ids).expect("touching free blocks");
                self.external.extend(ids);
            }
            Op::CommonPrefix { req } => {
                let id = request_id(req);
                let had: Vec<bool> = self
                    .coord
                    .groups
                    .iter()
                    .map(|g| g.tables.contains(id))
                    .collect();
                let got = self.coord.get_num_common_prefix_blocks(&self.pool, id);
                assert_eq!(got.len(), ng);
                let caching = self.coord.mode() != Mode::NoPrefixCache;
                for (i, g) in self.coord.groups.iter().enumerate() {
                    let want = if caching && g.kind().is_full() {
                        let entries = g.tables.num_entries() as i64;
                        g.blocks(id)
                            .iter()
                            .take_while(|&&b| i64::from(self.pool.ref_cnt(b)) == entries)
                            .count()
                    } else {
                        0
                    };
                    assert_eq!(got[i], want, "group {i}: common prefix blocks");
                    // FA-2: the query creates an entry in the groups it asks.
                    let asked = caching && g.kind().is_full();
                    assert_eq!(g.tables.contains(id), had[i] || asked);
                }
            }
            Op::TakeNewIds => {
                let mut ids = std::mem::take(&mut self.recorded);
                ids.extend(self.coord.take_new_block_ids());
                assert!(
                    self.record.iter().any(|&r| r) || ids.is_empty(),
                    "ids recorded while off"
                );
                assert!(ids.iter().all(|&b| b != NULL && (b as usize) < n));
                assert!(self.coord.take_new_block_ids().is_empty());
            }
            Op::NewStep => self.coord.new_step_starts(),
            Op::FindHit {
                req,
                num_tokens,
                max,
            } => {
                let num_tokens = num_tokens.get();
                let max = max.map_or(num_tokens.saturating_sub(1), Count::get);
                self.find_hit(req, num_tokens, max);
            }
            Op::FindHitPerGroup { req, num_tokens } => {
                let num_tokens = num_tokens.get();
                let hashes = self.hashes(req, num_tokens, None);
                let hl: &[BlockHash] = &hashes;
                let max = num_tokens.saturating_sub(1);
                let before = self.pool_view();
                let got = self
                    .coord
                    .find_longest_cache_hit_per_group(&self.pool, &hl, max);
                assert_eq!(before, self.pool_view(), "a lookup changed the pool");
                match got {
                    Ok((blocks, lens)) => {
                        assert_eq!(self.coord.mode(), Mode::Hybrid);
                        self.check_hit_blocks(&blocks, &hashes);
                        for (g, (hit, &len)) in blocks.iter().zip(&lens).enumerate() {
                            let bs = self.coord.groups[g].spec_block_size();
                            assert!(len <= max, "group {g}: a hit of {len} tokens beyond {max}");
                            assert_eq!(hit.len() * bs, len, "group {g}");
                        }
                    }
                    Err(e) => assert!(
                        self.coord.mode() != Mode::Hybrid || self.lookup_may_fail,
                        "per-group lookup failed: {e}"
                    ),
                }
            }
            Op::NumToAllocate {
                req,
                num_tokens,
                hits,
                encoder,
                total,
                main,
                cap,
            } => {
                let num_tokens = num_tokens.get();
                let hits = self.hits(&hits, req, num_tokens);
                let _ = self.coord.get_num_blocks_to_allocate(
                    &self.pool,
                    request_id(req),
                    num_tokens,
                    hits.as_ref().map(|h| h.0.as_slice()),
                    encoder.get(),
                    total.get(),
                    main.get(),
                    cap,
                );
            }
            Op::RemoveSkipped { req, total, prompt } => {
                self.sims[usize::from(req) % NUM_REQUESTS].clean = false;
                self.coord
                    .remove_skipped_blocks(
                        &mut self.pool,
                        request_id(req),
                        total.get(),
                        prompt.map(Count::get),
                    )
                    .expect("freeing skipped blocks the request owns");
            }
            Op::CheckCacheable {
                req,
                num_tokens,
                held,
                hits,
            } => {
                let num_tokens = num_tokens.get();
                let hits = self.hits(&hits, req, num_tokens);
                let num_hashes = self.hashes(req, num_tokens, None).len();
                // Not `held`: the lengths an allocation is about to leave.
                let lens = vec![num_tokens; ng];
                let _ = self.coord.check_cacheable(
                    request_id(req),
                    num_tokens,
                    (!held).then_some(&lens[..]),
                    hits.as_ref().map(|h| h.0.as_slice()),
                    num_hashes,
                );
            }
            Op::BlockIds {
                req,
                computed,
                clip,
            } => {
                let id = request_id(req);
                let clip: Vec<bool> = (0..ng).map(|i| clip >> i & 1 == 1).collect();
                let got = self
                    .coord
                    .block_ids_for_computed_tokens(id, computed.get(), &clip);
                assert_eq!(got.len(), ng);
                for (g, ids) in got.iter().enumerate() {
                    assert!(self.coord.groups[g].blocks(id).starts_with(ids));
                }
            }
            Op::CoordCache {
                req,
                num_tokens,
                prompt,
                hash_len,
            } => {
                self.sims[usize::from(req) % NUM_REQUESTS].clean = false;
                let num_tokens = num_tokens.get();
                let hashes = self.hashes(req, num_tokens, hash_len);
                let mut get = |i: usize| -> Result<BlockHash, PoolError> {
                    assert!(i < hashes.len());
                    Ok(hashes[i])
                };
                let view = RequestView {
                    id: request_id(req),
                    num_computed_tokens: num_tokens,
                    num_tokens,
                    num_prompt_tokens: prompt.get(),
                    waiting_or_preempted: false,
                    hints: &[],
                };
                let before = self.state();
                let r = self.coord.cache_blocks(
                    &mut self.pool,
                    &view,
                    num_tokens,
                    HashSource {
                        len: &mut || Ok(hashes.len()),
                        get: &mut get,
                    },
                    &mut |_: &MetaRequest<'_>| Ok(StoredMeta::default()),
                );
                if let Err(e) = r {
                    assert_eq!(
                        before,
                        self.state(),
                        "cache_blocks failed ({e}) and changed something"
                    );
                }
            }
            Op::CoordAddComputed {
                req,
                hits,
                local,
                external,
            } => {
                self.sims[usize::from(req) % NUM_REQUESTS].clean = false;
                let hits = self.hits(&hits, req, 1 << 20);
                let before = self.state();
                let r = self.coord.allocate_new_computed_blocks(
                    &mut self.pool,
                    request_id(req),
                    hits.as_ref().map(|h| h.0.as_slice()),
                    local.get(),
                    external.get(),
                );
                if let Err(e) = r {
                    assert_eq!(
                        before,
                        self.state(),
                        "allocate_new_computed_blocks failed ({e}) and changed something"
                    );
                }
            }
            Op::CoordAllocNew {
                req,
                num_tokens,
                main,
                encoder,
            } => {
                self.sims[usize::from(req) % NUM_REQUESTS].clean = false;
                let id = request_id(req);
                if let Ok(ranges) = self.coord.allocate_new_blocks(
                    &mut self.pool,
                    id,
                    num_tokens.get(),
                    main.get(),
                    encoder.get(),
                ) {
                    assert_eq!(ranges.len(), ng);
                    for (g, r) in ranges.iter().enumerate() {
                        assert!(r.start <= r.end && r.end <= self.coord.groups[g].blocks(id).len());
                    }
                }
            }
            Op::AddLocal {
                group,
                req,
                hits,
                local,
                external,
            } => {
                self.sims[usize::from(req) % NUM_REQUESTS].clean = false;
                let g = usize::from(group) % ng;
                let hits = self
                    .hits(&hits, req, 1 << 20)
                    .and_then(|h| h.0.into_iter().nth(g))
                    .unwrap_or_default();
                let before = self.state();
                let r = self.coord.groups[g].add_local_computed_blocks(
                    &mut self.pool,
                    request_id(req),
                    &hits,
                    local.get(),
                    external.get(),
                );
                self.unchanged_on_err(before, &r, "add_local_computed_blocks");
            }
            Op::AllocExternal {
                group,
                req,
                local,
                external,
            } => {
                self.sims[usize::from(req) % NUM_REQUESTS].clean = false;
                let g = usize::from(group) % ng;
                let before = self.state();
                let r = self.coord.groups[g].allocate_external_computed_blocks(
                    &mut self.pool,
                    request_id(req),
                    local.get(),
                    external.get(),
                );
                self.unchanged_on_err(before, &r, "allocate_external_computed_blocks");
            }
            Op::AllocNew {
                group,
                req,
                num_tokens,
                main,
            } => {
                self.sims[usize::from(req) % NUM_REQUESTS].clean = false;
                let g = usize::from(group) % ng;
                let id = request_id(req);
                let have = self.coord.groups[g].blocks(id).len();
                let before = self.state();
                let r = self.coord.groups[g].allocate_new_blocks(
                    &mut self.pool,
                    id,
                    num_tokens.get(),
                    main.get(),
                );
                self.unchanged_on_err(before, &r, "allocate_new_blocks");
                if let Ok(range) = r {
                    let len = self.coord.groups[g].blocks(id).len();
                    assert!(range.start <= range.end && range.end <= len);
                    if !matches!(
                        self.coord.groups[g].kind(),
                        Kind::Mamba {
                            mode: MambaMode::Align,
                            ..
                        }
                    ) {
                        assert_eq!(range.start, have);
                        assert_eq!(range.end, len);
                    }
                }
            }
            Op::CacheBlocks {
                group,
                req,
                num_tokens,
                prompt,
                hash_len,
                raw_view,
            } => {
                self.sims[usize::from(req) % NUM_REQUESTS].clean = false;
                let g = usize::from(group) % ng;
                let num_tokens = num_tokens.get();
                let hashes = self.hashes(req, num_tokens, hash_len);
                let hashes = if raw_view {
                    hashes
                } else {
                    self.view(g, &hashes)
                };
                let mut get = |i: usize| -> Result<BlockHash, PoolError> {
                    assert!(i < hashes.len());
                    Ok(hashes[i])
                };
                let before = self.state();
                let r = self.coord.groups[g].cache_blocks(
                    &mut self.pool,
                    request_id(req),
                    num_tokens,
                    self.retention_interval,
                    prompt.get(),
                    HashSource {
                        len: &mut || Ok(hashes.len()),
                        get: &mut get,
                    },
                    &mut |_: &MetaRequest<'_>| Ok(StoredMeta::default()),
                );
                self.unchanged_on_err(before, &r, "cache_blocks");
            }
            Op::Evict { ids } => {
                let ids: Vec<i64> = ids.iter().map(|i| i64::from(i.get(n))).collect();
                let _ = self.pool.evict_blocks(&ids);
            }
            Op::Reset => {
                let want = self.pool.get_num_free_blocks() == n - 1;
                assert_eq!(self.pool.reset_prefix_cache(), want);
            }
            Op::Clone => {
                self.pool = self.pool.clone();
                // A clone has its own uid: the old hints no longer apply.
                let old = self.coord.groups[0].tables.hint("r0");
                self.coord = self.coord.clone();
                assert!(old.is_none() || !self.coord.groups[0].tables.hint_is_valid(old));
            }
        }
        let _ = self.pool.take_events();
    }
}

fn group(kind: Kind, spec_block_size: usize, gid: usize, caching: bool, sbs: usize) -> GroupConfig {
    GroupConfig {
        kind,
        spec_block_size,
        dcp_world_size: 1,
        pcp_world_size: 1,
        group_id: gid as u32,
        record_new_ids: false,
        admission_cap: None,
        enable_caching: caching,
        scheduler_block_size: sbs,
        // The coordinator sets it from its own.
        max_model_len: 0,
    }
}

/// A hybrid configuration from `shape` (valid by construction) and whether its lookups may fail.
fn hybrid_config(
    shape: &HybridShape,
    caching: bool,
    hbs: usize,
    max_model_len: usize,
    watermark_blocks: usize,
) -> (CoordinatorConfig, bool) {
    let size = |x: u8| hbs << (x % 3);
    let full_bs = size(shape.full_size);
    let swa_bs = size(shape.swa_size);
    let mut sbs = full_bs.max(swa_bs);
    match shape.third {
        Third::Mamba { size: Some(s), .. } | Third::Chunked { size: Some(s), .. } => {
            sbs = sbs.max(size(s));
        }
        _ => {}
    }
    sbs <<= shape.sbs % 2;
    let mut kinds: Vec<(Kind, usize, Option<usize>)> = vec![(Kind::Full, full_bs, None)];
    if shape.two_full {
        kinds.push((Kind::Full, full_bs, None));
    }
    let window = 1 + usize::from(shape.window);
    kinds.push((
        Kind::SlidingWindow { window },
        swa_bs,
        shape.swa_cap.map(usize::from),
    ));
    let mut lookup_may_fail = false;
    let eagle_of = |ag: usize| shape.eagle >> ag & 1 == 1;
    match shape.third {
        Third::None => {}
        Third::Mamba {
            mode,
            spec_blocks,
            size: s,
        } => {
            let mode = [MambaMode::None, MambaMode::All, MambaMode::Align][usize::from(mode % 3)];
            kinds.push((
                Kind::Mamba {
                    mode,
                    num_speculative_blocks: usize::from(spec_blocks % 3),
                },
                s.map_or(sbs, size),
                None,
            ));
        }
        Third::Chunked {
            chunk,
            cap,
            size: s,
        } => {
            let bs = s.map_or(sbs, size);
            let chunk = if chunk < 192 {
                bs * (1 + usize::from(chunk % 4))
            } else {
                1 + usize::from(chunk % 64)
            };
            lookup_may_fail = bs != sbs || eagle_of(2);
            kinds.push((Kind::ChunkedLocal { chunk }, bs, cap.map(usize::from)));
        }
    }
    let num_full = 1 + usize::from(shape.two_full);
    let mut attention_groups = vec![AttentionGroup {
        group_ids: (0..num_full as u32).collect(),
        use_eagle: eagle_of(0),
        is_full: true,
    }];
    for (ag, gid) in (num_full..kinds.len()).enumerate() {
        attention_groups.push(AttentionGroup {
            group_ids: vec![gid as u32],
            use_eagle: eagle_of(ag + 1),
            is_full: false,
        });
    }
    let mut eagle_groups = vec![false; kinds.len()];
    for ag in &attention_groups {
        for &g in &ag.group_ids {
            eagle_groups[g as usize] = ag.use_eagle;
        }
    }
    let groups = kinds
        .iter()
        .enumerate()
        .map(|(i, &(kind, bs, cap))| GroupConfig {
            record_new_ids: shape.record >> i & 1 == 1,
            admission_cap: cap,
            ..group(kind, bs, i, caching, sbs)
        })
        .collect();
    let cfg = CoordinatorConfig {
        mode: if caching {
            Mode::Hybrid
        } else {
            Mode::NoPrefixCache
        },
        groups,
        eagle_groups,
        attention_groups,
        max_model_len,
        watermark_blocks,
        scheduler_block_size: sbs,
        retention_interval: shape.retention.map(|r| sbs * usize::from(r % 3)),
    };
    (cfg, lookup_may_fail && caching)
}

/// Breaks a valid hybrid configuration the way `bad` says.
fn break_config(mut cfg: CoordinatorConfig, bad: BadHybrid, hbs: usize) -> CoordinatorConfig {
    cfg.mode = Mode::Hybrid;
    let last = cfg.groups.len() as u32 - 1;
    match bad {
        BadHybrid::EmptyAttentionGroup => cfg.attention_groups[1].group_ids.clear(),
        BadHybrid::GroupTwice => cfg.attention_groups[1].group_ids.push(0),
        BadHybrid::GroupMissing => {
            let ag = cfg.attention_groups.len() - 1;
            cfg.attention_groups[ag].group_ids.retain(|&g| g != last);
            if cfg.attention_groups[ag].group_ids.is_empty() {
                cfg.attention_groups.pop();
            }
        }
        BadHybrid::GroupOutOfRange => cfg.attention_groups[1].group_ids.push(last + 1),
        BadHybrid::OneAttentionGroup => {
            cfg.attention_groups.truncate(1);
            cfg.groups.truncate(cfg.attention_groups[0].group_ids.len());
            cfg.eagle_groups.truncate(cfg.groups.len());
        }
        BadHybrid::MixedSpecs => {
            let g = cfg.attention_groups[1].group_ids[0];
            cfg.attention_groups[0].group_ids.push(g);
            cfg.attention_groups.remove(1);
            if cfg.attention_groups.len() < 2 {
                cfg.attention_groups.push(AttentionGroup {
                    group_ids: vec![],
                    use_eagle: false,
                    is_full: false,
                });
            }
        }
        BadHybrid::BlockSizeNotDividing => {
            cfg.groups[0].spec_block_size = cfg.scheduler_block_size * 2 + hbs;
        }
        BadHybrid::ContextParallel => cfg.groups[0].dcp_world_size = 2,
        BadHybrid::EagleFlags => {
            cfg.eagle_groups.push(false);
        }
    }
    cfg
}

fuzz_target!(|input: Input| {
    let Input {
        size,
        caching,
        hbs,
        events,
        max_model_len,
        watermark,
        shape,
        prompts,
        ops,
    } = input;
    let n = 1 + usize::from(size) % MAX_POOL;
    let hbs = [1, 2, 4, 16][usize::from(hbs % 4)];
    let mut pool = BlockPool::new(n as i64, caching, hbs, events).expect("a small pool");
    let mml = max_model_len.get();
    let wm = watermark.get();
    let (cfg, lookup_may_fail, exact_null) = match &shape {
        Shape::Unitary {
            block_size,
            sbs,
            dcp,
            pcp,
            record,
            eagle,
        } => {
            let (dcp, pcp) = (1 + usize::from(*dcp), 1 + usize::from(*pcp));
            let cp = dcp * pcp;
            let mode = if caching {
                Mode::Unitary
            } else {
                Mode::NoPrefixCache
            };
            let make = |spec: usize, sbs: usize, dcp: usize, pcp: usize| CoordinatorConfig {
                mode,
                groups: vec![GroupConfig {
                    dcp_world_size: dcp,
                    pcp_world_size: pcp,
                    record_new_ids: *record,
                    ..group(Kind::Full, spec, 0, caching, sbs)
                }],
                eagle_groups: vec![*eagle],
                attention_groups: Vec::new(),
                max_model_len: mml,
                watermark_blocks: wm,
                scheduler_block_size: sbs,
                retention_interval: None,
            };
            // The raw sizes: refused exactly when inconsistent.
            let (spec, raw_sbs) = (usize::from(block_size % 33), usize::from(sbs % 65));
            let valid = spec > 0
                && raw_sbs > 0
                && raw_sbs % hbs == 0
                && raw_sbs % spec == 0
                && (!caching || spec * cp == hbs);
            let made = Coordinator::new(&mut pool.clone(), make(spec, raw_sbs, dcp, pcp));
            assert_eq!(
                made.is_ok(),
                valid,
                "unitary block size {spec}, scheduler block size {raw_sbs}, hbs {hbs}, cp {cp}: {:?}",
                made.err()
            );
            let (spec, dcp, pcp) = if !caching {
                (spec.max(1), dcp, pcp)
            } else if hbs % cp == 0 {
                (hbs / cp, dcp, pcp)
            } else {
                (hbs, 1, 1)
            };
            let sbs = lcm(spec, hbs) << (sbs % 2);
            (make(spec, sbs, dcp, pcp), false, true)
        }
        Shape::Hybrid(h) => {
            let (cfg, may_fail) = hybrid_config(h, caching, hbs, mml, wm);
            if let Some(bad) = h.bad {
                let broken = break_config(cfg.clone(), bad, hbs);
                let made = Coordinator::new(&mut pool.clone(), broken.clone());
                assert!(
                    made.is_err(),
                    "a broken hybrid configuration accepted: {broken:?}"
                );
            }
            (cfg, may_fail, false)
        }
    };
    let record = cfg.groups.iter().map(|g| g.record_new_ids).collect();
    let retention_interval = cfg.retention_interval;
    let coord = Coordinator::new(&mut pool, cfg.clone())
        .unwrap_or_else(|e| panic!("a valid configuration refused ({e}): {cfg:?}"));
    let mut h = Harness {
        pool,
        coord,
        prompts,
        external: Vec::new(),
        hints: Vec::new(),
        sims: [FRESH; NUM_REQUESTS],
        record,
        recorded: Vec::new(),
        exact_null,
        lookup_may_fail,
        retention_interval,
    };
    h.check();
    for op in ops.into_iter().take(256) {
        h.step(op);
        h.check();
    }
    // Every request can be freed and every owned reference given back: the pool is whole.
    for r in 0..NUM_REQUESTS as u8 {
        h.free_request(request_id(r));
    }
    let ids: HashSet<String> = h
        .coord
        .groups
        .iter()
        .flat_map(|g| g.tables.request_ids().map(str::to_owned))
        .collect();
    for id in ids {
        h.free_request(&id);
    }
    let ext = std::mem::take(&mut h.external);
    h.pool.free_blocks(&ext).unwrap();
    h.check();
    assert_eq!(h.pool.get_num_free_blocks(), n - 1);
    assert!(h.coord.groups.iter().all(|g| g.tables.num_entries() == 0));
});

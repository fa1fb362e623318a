//! The request-level full-attention manager (`UnitaryFullAttention` and its
//! `FullAttentionTables`) driven through request lifecycles with arbitrary counts: allocation
//! with hits, lookahead and external tokens, caching, preemption (free), pop, common-prefix
//! queries, slot hints (stale ones included) and misuse of the table operations. After every
//! step the manager's and the pool's `check_invariants()` must hold, and every block's
//! reference count must equal its owners: its occurrences in the tables plus the references
//! the harness took over (popped tables, touched free blocks).

#![no_main]

use arbitrary::Arbitrary;
use kvcore_core::events::{MetaRequest, StoredMeta};
use kvcore_core::full_attention::{AllocateArgs, RequestView, SlotHint, UnitaryFullAttention};
use kvcore_core::hash::BlockHash;
use kvcore_core::pool::{BlockId, BlockPool, HashSource};
use kvcore_core::PoolError;
use libfuzzer_sys::fuzz_target;

const MAX_POOL: usize = 64;
const NUM_REQUESTS: usize = 6;
/// Longest hash list a request gets (more would only cost time).
const MAX_HASHES: usize = 256;

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
            Self::Medium(v) => usize::from(v),
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
    /// The cached prefix of the request's hashes, as the scheduler finds it.
    Found,
    /// Arbitrary blocks (misuse: free, in use, null, out of range).
    Ids(Vec<IdPick>),
}

#[derive(Debug, Clone, Arbitrary)]
struct Alloc {
    req: u8,
    computed: Count,
    num_tokens: Count,
    waiting: bool,
    hint: HintPick,
    new_tokens: Count,
    hits: Hits,
    /// `None`: the hits' tokens (`len * block_size`).
    new_computed: Option<Count>,
    lookahead: Count,
    external: Count,
    delay_cache: bool,
    full_must_fit: bool,
    reserved: Signed,
    has_scheduled: bool,
    /// Truncates the request's hash list (misuse when shorter than its full blocks).
    hash_len: Option<u8>,
}

#[derive(Debug, Clone, Arbitrary)]
enum Op {
    Allocate(Alloc),
    /// Preemption or finish: frees the request's blocks, last first.
    Free {
        req: u8,
    },
    /// Pops the request's table; the harness owns the blocks until `FreeExternal`.
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
    FindHit {
        req: u8,
        num_tokens: Count,
    },
    NumToAllocate {
        req: u8,
        num_tokens: Count,
        hits: Hits,
    },
    AddLocal {
        req: u8,
        hits: Hits,
    },
    AllocExternal {
        req: u8,
        local: Count,
        external: Count,
    },
    AllocNew {
        req: u8,
        num_tokens: Count,
    },
    CacheBlocks {
        req: u8,
        num_tokens: Count,
        hash_len: Option<u8>,
    },
    Evict {
        ids: Vec<IdPick>,
    },
    Reset,
    Clone,
}

#[derive(Debug, Arbitrary)]
struct Input {
    size: u8,
    caching: bool,
    hbs: u8,
    block_size: u8,
    events: bool,
    record: bool,
    max_model_len: Count,
    watermark: Count,
    eagle: bool,
    /// Per request, the seeds of its block hashes (few values: prompts share prefixes).
    prompts: [Vec<u8>; NUM_REQUESTS],
    ops: Vec<Op>,
}

fn request_id(r: u8) -> &'static str {
    ["r0", "r1", "r2", "r3", "r4", "r5"][usize::from(r) % NUM_REQUESTS]
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

struct Harness {
    pool: BlockPool,
    mgr: UnitaryFullAttention,
    prompts: [Vec<u8>; NUM_REQUESTS],
    /// References the harness owns (popped tables, touched blocks), one entry each.
    external: Vec<BlockId>,
    /// Hints taken earlier, with the request they were taken for (a hint is only ever
    /// passed for its own request: the core trusts a valid hint to name the request's entry).
    hints: Vec<(&'static str, Option<SlotHint>)>,
    record: bool,
}

impl Harness {
    fn n(&self) -> usize {
        self.pool.num_blocks()
    }

    fn bs(&self) -> usize {
        self.mgr.tables.block_size()
    }

    fn hashes(&self, r: u8, num_tokens: usize, hash_len: Option<u8>) -> Vec<BlockHash> {
        let full = (num_tokens / self.bs()).min(MAX_HASHES);
        let len = hash_len.map_or(full, |l| usize::from(l).min(full));
        let req = usize::from(r) % NUM_REQUESTS;
        hashes_for(req, &self.prompts[req], len)
    }

    fn hits(&self, hits: &Hits, r: u8, num_tokens: usize) -> Option<Vec<BlockId>> {
        match hits {
            Hits::Absent => None,
            Hits::Found => {
                let hashes = self.hashes(r, num_tokens, None);
                Some(
                    self.mgr
                        .find_longest_cache_hit(&self.pool, hashes, num_tokens),
                )
            }
            Hits::Ids(ids) => Some(ids.iter().map(|i| i.get(self.n())).collect()),
        }
    }

    fn hint(&self, pick: HintPick, id: &str) -> Option<SlotHint> {
        let own = self.mgr.tables.hint(id);
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
                if self.mgr.tables.hint_is_valid(h) && h != own {
                    None
                } else {
                    h
                }
            }
        }
    }

    fn remember_hint(&mut self, id: &'static str) {
        let h = (id, self.mgr.tables.hint(id));
        if self.hints.len() < 32 {
            self.hints.push(h);
        } else {
            let i = h.1.map_or(0, |x| x.slot as usize) % 32;
            self.hints[i] = h;
        }
    }

    fn allocate(&mut self, a: &Alloc) {
        let id = request_id(a.req);
        let num_tokens = a.num_tokens.get();
        let hashes = self.hashes(a.req, num_tokens, a.hash_len);
        let hits = self.hits(&a.hits, a.req, num_tokens);
        let bs = self.bs();
        let new_computed = a.new_computed.map_or_else(
            || hits.as_ref().map_or(0, |h| h.len().saturating_mul(bs)),
            Count::get,
        );
        let req = RequestView {
            id,
            num_computed_tokens: a.computed.get(),
            num_tokens,
            waiting_or_preempted: a.waiting,
            hint: self.hint(a.hint, id),
        };
        let args = AllocateArgs {
            num_new_tokens: a.new_tokens.get(),
            num_new_computed_tokens: new_computed,
            new_computed_blocks: hits.as_deref(),
            num_lookahead_tokens: a.lookahead.get(),
            num_external_computed_tokens: a.external.get(),
            delay_cache_blocks: a.delay_cache,
            full_sequence_must_fit: a.full_must_fit,
            reserved_blocks: a.reserved.get(),
            has_scheduled_reqs: a.has_scheduled,
        };
        let before = self.mgr.tables.blocks(id).to_vec();
        let free_before = self.pool.get_num_free_blocks();
        let mut get = |i: usize| -> Result<BlockHash, PoolError> {
            assert!(
                i < hashes.len(),
                "allocate_slots read hash {i} of {}",
                hashes.len()
            );
            Ok(hashes[i])
        };
        let result = self.mgr.allocate_slots(
            &mut self.pool,
            req,
            args,
            HashSource {
                len: &mut || Ok(hashes.len()),
                get: &mut get,
            },
            &mut |_: &MetaRequest<'_>| Ok(StoredMeta::default()),
        );
        let after = self.mgr.tables.blocks(id);
        match result {
            Ok(Some(range)) => {
                assert!(range.start <= range.end && range.end <= after.len());
                assert!(after.starts_with(&before) || before.is_empty());
            }
            Ok(None) => {
                assert_eq!(after, &before[..], "a refused allocation changed the table");
                assert_eq!(self.pool.get_num_free_blocks(), free_before);
            }
            Err(_) => {}
        }
        self.remember_hint(id);
    }

    /// Invariants after every step.
    fn check(&mut self) {
        if let Err(e) = self.mgr.check_invariants(&self.pool) {
            panic!("manager invariants: {e}");
        }
        let n = self.n();
        let mut owners = vec![0i64; n];
        let ids: Vec<String> = self.mgr.tables.request_ids().map(str::to_owned).collect();
        assert_eq!(ids.len(), self.mgr.tables.num_entries());
        for id in &ids {
            let entry = self.mgr.tables.get(id).expect("listed ids have entries");
            assert_eq!(entry.blocks, self.mgr.tables.blocks(id));
            assert_eq!(entry.num_cached.is_some(), self.mgr.tables.is_running(id));
            let hint = self.mgr.tables.hint(id);
            assert!(self.mgr.tables.hint_is_valid(hint));
            assert_eq!(self.mgr.tables.blocks_hinted("", hint), &entry.blocks[..]);
            for &b in &entry.blocks {
                owners[b as usize] += 1;
            }
        }
        for &b in &self.external {
            owners[b as usize] += 1;
        }
        for (b, &o) in owners.iter().enumerate() {
            assert_eq!(
                i64::from(self.pool.ref_cnt(b as BlockId)),
                o,
                "block {b}: reference count against its owners"
            );
        }
        let in_use = owners.iter().skip(1).filter(|&&o| o > 0).count();
        assert_eq!(self.pool.get_num_free_blocks(), n - 1 - in_use);
        for &(id, h) in &self.hints {
            // Stale hints are recognised as such; a valid one names its request's entry.
            if self.mgr.tables.hint_is_valid(h) {
                assert_eq!(self.mgr.tables.hint(id), h, "a valid hint of {id}");
            }
            self.mgr.tables.prefetch_slot(h);
        }
    }

    fn step(&mut self, op: Op) {
        let n = self.n();
        match op {
            Op::Allocate(a) => self.allocate(&a),
            Op::Free { req } => {
                let id = request_id(req);
                self.mgr
                    .tables
                    .free(&mut self.pool, id)
                    .expect("freeing a request's own blocks");
                assert!(self.mgr.tables.get(id).is_none());
            }
            Op::Pop { req } => {
                let id = request_id(req);
                let want = self.mgr.tables.blocks(id).to_vec();
                let got = self.mgr.tables.pop(id);
                assert_eq!(got, want);
                self.external.extend(got);
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
                let got = self.mgr.tables.get_num_common_prefix_blocks(&self.pool, id);
                let entries = self.mgr.tables.num_entries() as i64;
                let want = self
                    .mgr
                    .tables
                    .blocks(id)
                    .iter()
                    .take_while(|&&b| i64::from(self.pool.ref_cnt(b)) == entries)
                    .count();
                assert_eq!(got, want, "common prefix blocks");
                assert!(
                    self.mgr.tables.get(id).is_some(),
                    "the query creates an entry"
                );
            }
            Op::TakeNewIds => {
                let ids = self.mgr.tables.take_new_block_ids();
                assert!(self.record || ids.is_empty(), "ids recorded while off");
                assert!(ids.iter().all(|&b| b != 0 && (b as usize) < n));
                assert!(self.mgr.tables.take_new_block_ids().is_empty());
            }
            Op::FindHit { req, num_tokens } => {
                let num_tokens = num_tokens.get();
                let hashes = self.hashes(req, num_tokens, None);
                let got =
                    self.mgr
                        .find_longest_cache_hit(&self.pool, hashes.iter().copied(), num_tokens);
                let max = num_tokens.saturating_sub(1) / self.bs();
                let mut want: Vec<BlockId> = hashes
                    .iter()
                    .take(max)
                    .map_while(|h| self.pool.get_cached_block(h, &[0]).map(|v| v[0]))
                    .collect();
                if self.mgr.use_eagle() {
                    want.pop();
                }
                assert_eq!(got, want, "longest cache hit");
            }
            Op::NumToAllocate {
                req,
                num_tokens,
                hits,
            } => {
                let num_tokens = num_tokens.get();
                let hits = self.hits(&hits, req, num_tokens).unwrap_or_default();
                let _ = self.mgr.tables.get_num_blocks_to_allocate(
                    &self.pool,
                    request_id(req),
                    num_tokens,
                    &hits,
                );
            }
            Op::AddLocal { req, hits } => {
                let hits = self.hits(&hits, req, 1 << 20).unwrap_or_default();
                let _ = self.mgr.tables.add_local_computed_blocks(
                    &mut self.pool,
                    request_id(req),
                    &hits,
                );
            }
            Op::AllocExternal {
                req,
                local,
                external,
            } => {
                let _ = self.mgr.tables.allocate_external_computed_blocks(
                    &mut self.pool,
                    request_id(req),
                    local.get(),
                    external.get(),
                );
            }
            Op::AllocNew { req, num_tokens } => {
                let id = request_id(req);
                let have = self.mgr.tables.blocks(id).len();
                if let Ok(range) =
                    self.mgr
                        .tables
                        .allocate_new_blocks(&mut self.pool, id, num_tokens.get())
                {
                    assert_eq!(range.start, have);
                    assert_eq!(range.end, self.mgr.tables.blocks(id).len());
                }
            }
            Op::CacheBlocks {
                req,
                num_tokens,
                hash_len,
            } => {
                let num_tokens = num_tokens.get();
                let hashes = self.hashes(req, num_tokens, hash_len);
                let mut get = |i: usize| -> Result<BlockHash, PoolError> {
                    assert!(i < hashes.len());
                    Ok(hashes[i])
                };
                let _ = self.mgr.tables.cache_blocks(
                    &mut self.pool,
                    request_id(req),
                    num_tokens,
                    HashSource {
                        len: &mut || Ok(hashes.len()),
                        get: &mut get,
                    },
                    &mut |_: &MetaRequest<'_>| Ok(StoredMeta::default()),
                );
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
                let old = self.mgr.tables.hint("r0");
                self.mgr = self.mgr.clone();
                assert!(old.is_none() || !self.mgr.tables.hint_is_valid(old));
            }
        }
        let _ = self.pool.take_events();
    }
}

fuzz_target!(|input: Input| {
    let Input {
        size,
        caching,
        hbs,
        block_size,
        events,
        record,
        max_model_len,
        watermark,
        eagle,
        prompts,
        ops,
    } = input;
    let n = 1 + usize::from(size) % MAX_POOL;
    let hbs = [1, 2, 4, 16][usize::from(hbs % 4)];
    let pool = BlockPool::new(n as i64, caching, hbs, events).expect("a small pool");
    let bs = usize::from(block_size % 33);
    let made = UnitaryFullAttention::new(
        &pool,
        bs,
        record,
        max_model_len.get(),
        watermark.get(),
        eagle,
    );
    if bs == 0 || (caching && bs != hbs) {
        assert!(made.is_err(), "block size {bs} accepted (hbs {hbs})");
    }
    let bs = if caching || bs == 0 { hbs } else { bs };
    let mgr = UnitaryFullAttention::new(
        &pool,
        bs,
        record,
        max_model_len.get(),
        watermark.get(),
        eagle,
    )
    .expect("a valid manager");
    let mut h = Harness {
        pool,
        mgr,
        prompts,
        external: Vec::new(),
        hints: Vec::new(),
        record,
    };
    h.check();
    for op in ops.into_iter().take(256) {
        h.step(op);
        h.check();
    }
    // Every request can be freed and every owned reference given back: the pool is whole.
    for r in 0..NUM_REQUESTS as u8 {
        h.mgr.tables.free(&mut h.pool, request_id(r)).unwrap();
    }
    let ids: Vec<String> = h.mgr.tables.request_ids().map(str::to_owned).collect();
    for id in ids {
        h.mgr.tables.free(&mut h.pool, &id).unwrap();
    }
    let ext = std::mem::take(&mut h.external);
    h.pool.free_blocks(&ext).unwrap();
    h.check();
    assert_eq!(h.pool.get_num_free_blocks(), n - 1);
    assert_eq!(h.mgr.tables.num_entries(), 0);
});

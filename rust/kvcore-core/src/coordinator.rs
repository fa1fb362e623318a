//! The request-level manager of any KV-cache configuration (SPEC §8–9): one
//! [`SingleTypeManager`] per group sharing one pool, the coordinator rules over them (hit
//! search over all groups, including the hybrid fixed point; the caching lengths; summing and
//! applying the groups' allocations) and `allocate_slots`. The caller (the Python package)
//! chooses the configuration's policy: which coordinator ([`Mode`]), the groups' types and
//! which groups are looked up together ([`AttentionGroup`]).
//!
//! Request ids are strings, as in the reference. Nothing here knows about Python.

use std::cell::RefCell;
use std::ops::Range;

use crate::error::PoolError;
use crate::events::{MetaRequest, StoredMeta};
use crate::hash::BlockHash;
use crate::pool::retention::Retention;
use crate::pool::{BlockId, BlockPool, HashSource};
use crate::single_type::{
    cross_attention_caches_nothing, GroupCache, GroupConfig, HashList, HashView, HitBlocks, Kind,
    SingleTypeManager,
};
use crate::tables::HintCell;

#[inline]
fn cdiv(a: usize, b: usize) -> usize {
    a.div_ceil(b)
}

/// ALLOC-1's refusal of a call that computes nothing.
#[cold]
#[inline(never)]
fn no_new_tokens() -> PoolError {
    PoolError::Invalid(
        "num_new_tokens must be greater than 0 when there are no external computed tokens".into(),
    )
}

/// The token positions one `allocate_slots` call works with (ALLOC-2..4).
#[derive(Clone, Copy)]
struct TokenCounts {
    /// Computed tokens with the new local hits.
    local: usize,
    /// `local` with the external tokens, not capped.
    uncapped: usize,
    /// `uncapped` capped by `max_model_len`.
    total: usize,
    /// The watermark that applies to this call (MGR-1).
    wm: usize,
    /// Tokens computed after this step.
    main: usize,
    /// Tokens needing a slot (with the lookahead), capped by `max_model_len`.
    need_slot: usize,
    /// Whether this call caches full blocks.
    caching: bool,
    /// Tokens whose full blocks may be cached.
    to_cache: usize,
}

impl TokenCounts {
    #[inline]
    fn of(
        c: &Coordinator,
        pool: &BlockPool,
        req: &RequestView<'_>,
        args: &AllocateArgs<'_>,
    ) -> Self {
        let mml = c.max_model_len;
        // Token sums saturate: each is capped by `max_model_len` or `num_tokens`, so the
        // capped value is the exact one.
        let local = req
            .num_computed_tokens
            .saturating_add(args.num_new_computed_tokens);
        let uncapped = local.saturating_add(args.num_external_computed_tokens);
        let total = uncapped.min(mml);
        let wm = if args.has_scheduled_reqs && req.waiting_or_preempted {
            c.watermark_blocks
        } else {
            0
        };
        let main = total.saturating_add(args.num_new_tokens);
        Self {
            local,
            uncapped,
            total,
            wm,
            main,
            need_slot: main.saturating_add(args.num_lookahead_tokens).min(mml),
            caching: pool.enable_caching() && !args.delay_cache_blocks,
            to_cache: main.min(req.num_tokens),
        }
    }
}

/// Whether `need` blocks and `watermark` more fit in `free` blocks less `reserved`, in exact
/// arithmetic (the reference compares Python ints; Mamba's `need` may be negative). A negative
/// reservation reserves nothing (it frees no capacity either).
#[inline]
fn fits(need: i64, watermark: usize, free: usize, reserved: i64) -> bool {
    i128::from(need) + watermark as i128 <= free as i128 - i128::from(reserved.max(0))
}

/// Which coordinator the configuration uses (SPEC COORD-1).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// Prefix caching off, any number of groups (COORD-8).
    NoPrefixCache,
    /// One group (COORD-7).
    Unitary,
    /// Several groups of different specs (COORD-9..12).
    Hybrid,
}

/// Groups with equal specs, looked up together (SPEC COORD-9).
#[derive(Debug, Clone)]
pub struct AttentionGroup {
    /// Member group ids (indexes into the coordinator's groups).
    pub group_ids: Vec<u32>,
    /// Whether any member is an EAGLE group.
    pub use_eagle: bool,
    /// Whether the spec is a full-attention spec (the fixed point's full-attention rule).
    pub is_full: bool,
}

/// How the coordinator is built.
#[derive(Debug, Clone)]
pub struct CoordinatorConfig {
    /// The coordinator.
    pub mode: Mode,
    /// The groups, in group order.
    pub groups: Vec<GroupConfig>,
    /// Groups whose hits drop the EAGLE block.
    pub eagle_groups: Vec<bool>,
    /// Hybrid only: the attention groups, full-attention ones first.
    pub attention_groups: Vec<AttentionGroup>,
    /// Longest sequence.
    pub max_model_len: usize,
    /// Blocks kept free when admitting waiting requests (MGR-1).
    pub watermark_blocks: usize,
    /// The scheduling granularity.
    pub scheduler_block_size: usize,
    /// The sparse retention interval (RET-1), if set.
    pub retention_interval: Option<usize>,
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
    /// `request.num_prompt_tokens`.
    pub num_prompt_tokens: usize,
    /// Whether `request.status` is WAITING or PREEMPTED (ALLOC-3).
    pub waiting_or_preempted: bool,
    /// Where the request's entries were last seen, group by group from group 0, for as many
    /// groups as the caller keeps hints (none at all is fine). A successful `allocate_slots`
    /// refreshes the stale ones.
    pub hints: &'a [HintCell],
}

/// The arguments of `allocate_slots` (SPEC §8.1).
#[derive(Debug, Clone, Copy, Default)]
pub struct AllocateArgs<'a> {
    /// Tokens to compute this step.
    pub num_new_tokens: usize,
    /// New prefix-cache hit tokens.
    pub num_new_computed_tokens: usize,
    /// The hit blocks per group; `None` when the caller passed no hits object or the shared
    /// empty one (ALLOC-8's identity test).
    pub new_computed_blocks: Option<&'a [Vec<BlockId>]>,
    /// Speculative slots.
    pub num_lookahead_tokens: usize,
    /// Tokens computed by a KV connector.
    pub num_external_computed_tokens: usize,
    /// Skip caching this step.
    pub delay_cache_blocks: bool,
    /// Encoder tokens (cross-attention groups).
    pub num_encoder_tokens: usize,
    /// Admission gate on the whole sequence.
    pub full_sequence_must_fit: bool,
    /// Free blocks to leave for others (a negative count reserves none).
    pub reserved_blocks: i64,
    /// Whether other requests are scheduled this step.
    pub has_scheduled_reqs: bool,
}

impl AllocateArgs<'_> {
    /// A scheduled request's call that names only its token counts (the scheduler's
    /// `allocate_slots(request, n, num_lookahead_tokens=k)` for a running request): every
    /// other argument at its default.
    pub fn tokens(num_new_tokens: usize, num_lookahead_tokens: usize) -> Self {
        Self {
            num_new_tokens,
            num_lookahead_tokens,
            has_scheduled_reqs: true,
            ..Self::default()
        }
    }
}

/// The newly allocated blocks of one call: per group, a range of the request's table (held
/// inline for up to four groups whose bounds fit 32 bits, so that a decode step allocates
/// nothing on the heap for it and the value moves in a few words).
#[derive(Debug, Clone)]
pub struct NewBlocks(Ranges);

#[derive(Debug, Clone)]
enum Ranges {
    Inline { len: u8, ranges: [(u32, u32); 4] },
    Heap(Vec<(usize, usize)>),
}

impl Default for NewBlocks {
    fn default() -> Self {
        Self(Ranges::Inline {
            len: 0,
            ranges: [(0, 0); 4],
        })
    }
}

impl PartialEq for NewBlocks {
    fn eq(&self, other: &Self) -> bool {
        self.iter().eq(other.iter())
    }
}

impl Eq for NewBlocks {}

impl NewBlocks {
    #[inline]
    fn push(&mut self, r: Range<usize>) {
        if let Ranges::Inline { len, ranges } = &mut self.0 {
            if let (Some(slot), Ok(a), Ok(b)) = (
                ranges.get_mut(usize::from(*len)),
                u32::try_from(r.start),
                u32::try_from(r.end),
            ) {
                *slot = (a, b);
                *len += 1;
                return;
            }
            let mut heap: Vec<(usize, usize)> = self.iter().map(|r| (r.start, r.end)).collect();
            heap.push((r.start, r.end));
            self.0 = Ranges::Heap(heap);
            return;
        }
        if let Ranges::Heap(v) = &mut self.0 {
            v.push((r.start, r.end));
        }
    }

    /// Number of groups.
    pub fn len(&self) -> usize {
        match &self.0 {
            Ranges::Inline { len, .. } => usize::from(*len),
            Ranges::Heap(v) => v.len(),
        }
    }

    /// Whether there is no group.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The range of group `i`.
    pub fn get(&self, i: usize) -> Option<Range<usize>> {
        match &self.0 {
            Ranges::Inline { len, ranges } => (i < usize::from(*len)).then(|| {
                let (a, b) = ranges[i];
                a as usize..b as usize
            }),
            Ranges::Heap(v) => v.get(i).map(|&(a, b)| a..b),
        }
    }

    /// The ranges in group order.
    pub fn iter(&self) -> impl Iterator<Item = Range<usize>> + '_ {
        (0..self.len()).filter_map(|i| self.get(i))
    }
}

impl FromIterator<Range<usize>> for NewBlocks {
    fn from_iter<I: IntoIterator<Item = Range<usize>>>(iter: I) -> Self {
        let mut out = Self::default();
        for r in iter {
            out.push(r);
        }
        out
    }
}

/// Groups the running-request path serves (as many as a request keeps hints for and a
/// [`NewBlocks`] holds inline; more take the general rules).
const MAX_RUNNING_GROUPS: usize = 4;

/// One group's part of a running request's allocation ([`Coordinator::allocate_running`]).
#[derive(Debug, Clone, Copy, Default)]
struct RunningStep {
    slot: u32,
    have: usize,
    want: usize,
    /// The token count the group caches up to, and whether a block fills by then
    /// ([`block_fills`]).
    cache_len: usize,
    fills: bool,
}

/// Whether a group of block size `block_size` holding `cached` cached blocks of a request
/// fills a block when it caches up to `cache_len` tokens: `cached < cache_len / block_size`,
/// without the division.
#[inline]
fn block_fills(cached: usize, block_size: usize, cache_len: usize) -> bool {
    cached
        .checked_add(1)
        .and_then(|c| c.checked_mul(block_size))
        .is_some_and(|n| n <= cache_len)
}

/// The request-level manager; see the module docs.
#[derive(Debug, Clone)]
pub struct Coordinator {
    /// The groups' managers, in group order.
    pub groups: Vec<SingleTypeManager>,
    mode: Mode,
    attention: Vec<AttentionGroup>,
    simple: bool,
    max_model_len: usize,
    watermark_blocks: usize,
    scheduler_block_size: usize,
    hash_block_size: usize,
    retention_interval: Option<usize>,
    context_parallel: usize,
    skippers: Vec<usize>,
    /// Whether STM-2's count is exactly what an allocation without external tokens takes
    /// (every group of the base rules, none that skips).
    exact_count: bool,
    /// Set by each hybrid lookup: the longest hit seen minus the hit kept (COORD-11).
    pub num_uncached_common_prefix_tokens: usize,
}

/// What `remove_skipped_blocks` may change, so a refused allocation can undo it.
struct SkipUndo {
    had: Vec<bool>,
    saved: Vec<(usize, Option<Vec<BlockId>>)>,
}

impl Coordinator {
    /// Builds the managers (a sink group reserves its blocks now) and checks the
    /// configuration (COORD-2, COORD-7, COORD-9).
    ///
    /// # Errors
    /// [`PoolError::Config`] for inconsistent sizes or groups; the pool's error when it cannot
    /// provide sink blocks.
    pub fn new(pool: &mut BlockPool, cfg: CoordinatorConfig) -> Result<Self, PoolError> {
        let sbs = cfg.scheduler_block_size;
        let hbs = pool.hash_block_size();
        if hbs == 0 || sbs == 0 || !sbs.is_multiple_of(hbs) {
            return Err(PoolError::Config(format!(
                "scheduler_block_size={sbs} must be a multiple of hash_block_size={hbs}"
            )));
        }
        if cfg.eagle_groups.len() != cfg.groups.len() {
            return Err(PoolError::Config("one EAGLE flag per group".into()));
        }
        let cp = cfg
            .groups
            .first()
            .map_or(1, |g| g.dcp_world_size.max(1) * g.pcp_world_size.max(1));
        let mut groups = Vec::with_capacity(cfg.groups.len());
        for (g, &eagle) in cfg.groups.iter().zip(&cfg.eagle_groups) {
            if g.spec_block_size == 0 || !sbs.is_multiple_of(g.spec_block_size) {
                return Err(PoolError::Config(format!(
                    "scheduler_block_size={sbs} must be a multiple of every group block size"
                )));
            }
            let mut m = SingleTypeManager::new(
                pool,
                GroupConfig {
                    max_model_len: cfg.max_model_len,
                    ..*g
                },
            )?;
            m.use_eagle = eagle;
            groups.push(m);
        }
        match cfg.mode {
            Mode::Unitary => {
                if groups.len() != 1 {
                    return Err(PoolError::Config(
                        "the unitary coordinator needs exactly one group".into(),
                    ));
                }
                if pool.enable_caching() && hbs != groups[0].block_size() {
                    return Err(PoolError::Config(format!(
                        "one group needs hash_block_size ({hbs}) == block_size ({})",
                        groups[0].block_size()
                    )));
                }
            }
            Mode::Hybrid => {
                if groups.iter().any(|g| !g.block_size().is_multiple_of(hbs)) {
                    return Err(PoolError::Config(
                        "every group block size must be divisible by hash_block_size".into(),
                    ));
                }
                if cp != 1 {
                    return Err(PoolError::Config(
                        "hybrid KV cache groups do not support dcp/pcp > 1".into(),
                    ));
                }
                if cfg.attention_groups.len() < 2 {
                    return Err(PoolError::Config(
                        "the hybrid coordinator needs at least two attention groups".into(),
                    ));
                }
                let mut seen = vec![false; groups.len()];
                for ag in &cfg.attention_groups {
                    if ag.group_ids.is_empty() {
                        return Err(PoolError::Config("an empty attention group".into()));
                    }
                    let first = &groups[*ag.group_ids.first().unwrap_or(&0) as usize];
                    for &gid in &ag.group_ids {
                        let g = groups.get(gid as usize).ok_or_else(|| {
                            PoolError::Config(format!("attention group names group {gid}"))
                        })?;
                        if std::mem::replace(&mut seen[gid as usize], true)
                            || g.kind() != first.kind()
                            || g.spec_block_size() != first.spec_block_size()
                        {
                            return Err(PoolError::Config(
                                "attention groups must split the groups by equal specs".into(),
                            ));
                        }
                    }
                }
                if seen.iter().any(|s| !s) {
                    return Err(PoolError::Config(
                        "every group must be in an attention group".into(),
                    ));
                }
            }
            Mode::NoPrefixCache => {}
        }
        let simple = cfg.mode == Mode::Hybrid
            && cfg.attention_groups.len() == 2
            && cfg.attention_groups[0].is_full;
        let skippers: Vec<usize> = (0..groups.len())
            .filter(|&i| groups[i].kind().skips())
            .collect();
        let exact_count = skippers.is_empty() && groups.iter().all(|g| g.kind().base_allocation());
        Ok(Self {
            groups,
            mode: cfg.mode,
            attention: cfg.attention_groups,
            simple,
            max_model_len: cfg.max_model_len,
            watermark_blocks: cfg.watermark_blocks,
            scheduler_block_size: sbs,
            hash_block_size: hbs,
            retention_interval: cfg.retention_interval,
            context_parallel: cp,
            exact_count,
            skippers,
            num_uncached_common_prefix_tokens: 0,
        })
    }

    /// The coordinator.
    pub fn mode(&self) -> Mode {
        self.mode
    }

    /// Longest sequence.
    pub fn max_model_len(&self) -> usize {
        self.max_model_len
    }

    /// The scheduling granularity.
    pub fn scheduler_block_size(&self) -> usize {
        self.scheduler_block_size
    }

    /// Number of groups.
    pub fn num_groups(&self) -> usize {
        self.groups.len()
    }

    /// Whether a group's `remove_skipped_blocks` can change anything.
    pub fn has_skippers(&self) -> bool {
        !self.skippers.is_empty()
    }

    /// Whether any rule reads a request's prompt length: a group skipping after the prompt
    /// (RSWA-1) or caching with a retention interval (the latest prompt block is kept
    /// reachable). Without one, callers need not read it (it is then never used).
    pub fn reads_prompt_len(&self) -> bool {
        self.retention_interval.is_some()
            || self
                .skippers
                .iter()
                .any(|&i| self.groups[i].kind().skips_after_prompt())
    }

    /// Whether the request is running in some group.
    pub fn is_running(&self, id: &str) -> bool {
        self.groups.iter().any(|g| g.is_running(id))
    }

    /// The request's blocks per group (empty when unknown).
    pub fn blocks(&self, id: &str) -> Vec<&[BlockId]> {
        self.groups.iter().map(|g| g.blocks(id)).collect()
    }

    /// Per group, the indexes of the hash-block-size list that are the group's hashes (RH-3:
    /// every `block_size / hash_block_size`-th), for a list of `num_hashes` hashes.
    pub fn hash_indexes(&self, num_hashes: usize) -> Vec<Vec<usize>> {
        self.groups
            .iter()
            .map(|g| {
                let k = (g.block_size() / self.hash_block_size).max(1);
                (1..=num_hashes / k).map(|j| j * k - 1).collect()
            })
            .collect()
    }

    /// The hashes of group `g` as a view of the hash-block-size list.
    fn view<'h>(&self, hashes: &'h dyn HashList, spec_block_size: usize) -> HashView<'h> {
        HashView {
            hashes,
            stride: (spec_block_size / self.hash_block_size).max(1),
        }
    }

    // ------------------------------------------------------------------------------------
    // Lookup

    /// The longest prefix hit over all groups in at most `max_cache_hit_length` tokens
    /// (COORD-7, COORD-8, COORD-11): the hit blocks per group and the hit length.
    ///
    /// # Errors
    /// The groups' lookup errors (see [`SingleTypeManager::find_longest_cache_hit`]).
    pub fn find_longest_cache_hit(
        &mut self,
        pool: &BlockPool,
        hashes: &dyn HashList,
        max_cache_hit_length: usize,
    ) -> Result<(HitBlocks, usize), PoolError> {
        let max_cache_hit_length = self.searchable(hashes, max_cache_hit_length);
        let n = self.groups.len();
        match self.mode {
            Mode::NoPrefixCache => Ok((vec![Vec::new(); n], 0)),
            Mode::Unitary => {
                let g = &self.groups[0];
                let hit = SingleTypeManager::find_longest_cache_hit(
                    g.kind(),
                    pool,
                    HashView { hashes, stride: 1 },
                    max_cache_hit_length,
                    &[0],
                    g.spec_block_size(),
                    g.use_eagle,
                    g.block_size(),
                    self.context_parallel,
                )?;
                let len = hit[0].len() * g.block_size();
                Ok((hit, len))
            }
            Mode::Hybrid => self.hybrid_hit(pool, hashes, max_cache_hit_length),
        }
    }

    /// `max_len` capped where the hashes end: a hit never goes past the last full hash
    /// window, and every type's search gives the same result for any longer limit (full
    /// attention and the window types find misses there; chunked local attention's chunk start
    /// lies at or below the last hash boundary either way, since `num_tokens - 1` is at most
    /// `hash_block_size - 1` tokens past it). The cap keeps a caller's huge limit from sizing
    /// the searches' per-block buffers.
    fn searchable(&self, hashes: &dyn HashList, max_len: usize) -> usize {
        let hbs = self.hash_block_size;
        max_len.min(hashes.len().saturating_mul(hbs).saturating_add(hbs - 1))
    }

    /// COORD-11's fixed point.
    fn hybrid_hit(
        &mut self,
        pool: &BlockPool,
        hashes: &dyn HashList,
        max_len: usize,
    ) -> Result<(HitBlocks, usize), PoolError> {
        let mut res: Vec<Option<Vec<BlockId>>> = vec![None; self.groups.len()];
        let mut verified = vec![false; self.attention.len()];
        let mut hit_length = max_len;
        let mut longest = 0;
        let sbs = self.scheduler_block_size;
        loop {
            let mut cur = hit_length;
            for (idx, ag) in self.attention.iter().enumerate() {
                let rep = &self.groups[ag.group_ids[0] as usize];
                let bs = rep.spec_block_size();
                if ag.is_full && res[ag.group_ids[0] as usize].is_some() {
                    cur = cur / bs * bs;
                    continue;
                }
                let drop = ag.use_eagle && !verified[idx];
                let limit = if drop {
                    cur.saturating_add(bs).min(max_len)
                } else {
                    cur
                };
                let hit = SingleTypeManager::find_longest_cache_hit(
                    rep.kind(),
                    pool,
                    self.view(hashes, bs),
                    limit,
                    &ag.group_ids,
                    bs,
                    drop,
                    sbs,
                    1,
                )?;
                let new = hit.first().map_or(0, Vec::len) * bs;
                if drop {
                    verified[idx] = true;
                } else if new < cur {
                    verified.iter_mut().for_each(|v| *v = false);
                }
                cur = new;
                for (&gid, blocks) in ag.group_ids.iter().zip(hit) {
                    res[gid as usize] = Some(blocks);
                }
                longest = longest.max(cur);
            }
            if cur >= hit_length {
                break;
            }
            hit_length = cur;
            if self.simple {
                break;
            }
        }
        let first = &self.attention[0];
        if first.is_full {
            let bs = self.groups[first.group_ids[0] as usize].spec_block_size();
            for &gid in &first.group_ids {
                if let Some(kept) = res[gid as usize].as_mut() {
                    kept.truncate(hit_length / bs);
                }
            }
        }
        self.num_uncached_common_prefix_tokens = longest.saturating_sub(hit_length);
        Ok((
            res.into_iter().map(Option::unwrap_or_default).collect(),
            hit_length,
        ))
    }

    /// COORD-12: every attention group looked up on its own; hit blocks and hit length per
    /// group.
    ///
    /// # Errors
    /// The groups' lookup errors; [`PoolError::Invalid`] outside hybrid configurations.
    pub fn find_longest_cache_hit_per_group(
        &self,
        pool: &BlockPool,
        hashes: &dyn HashList,
        max_cache_hit_length: usize,
    ) -> Result<(HitBlocks, Vec<usize>), PoolError> {
        if self.mode != Mode::Hybrid {
            return Err(PoolError::Invalid(
                "per-group lookups need the hybrid coordinator".into(),
            ));
        }
        let max_cache_hit_length = self.searchable(hashes, max_cache_hit_length);
        let n = self.groups.len();
        let (mut blocks, mut lengths) = (vec![Vec::new(); n], vec![0; n]);
        for ag in &self.attention {
            let rep = &self.groups[ag.group_ids[0] as usize];
            let bs = rep.spec_block_size();
            let hit = SingleTypeManager::find_longest_cache_hit(
                rep.kind(),
                pool,
                self.view(hashes, bs),
                max_cache_hit_length,
                &ag.group_ids,
                bs,
                ag.use_eagle,
                self.scheduler_block_size,
                1,
            )?;
            let len = hit.first().map_or(0, Vec::len) * bs;
            for (&gid, b) in ag.group_ids.iter().zip(hit) {
                blocks[gid as usize] = b;
                lengths[gid as usize] = len;
            }
        }
        Ok((blocks, lengths))
    }

    // ------------------------------------------------------------------------------------
    // Counting and allocating

    /// COORD-3: the blocks an allocation takes from the free queue, summed over the groups
    /// (cross-attention groups count the encoder tokens).
    ///
    /// # Errors
    /// [`PoolError::Invariant`] when a running request is given hits.
    #[allow(clippy::too_many_arguments)]
    pub fn get_num_blocks_to_allocate(
        &self,
        pool: &BlockPool,
        id: &str,
        num_tokens: usize,
        hits: Option<&[Vec<BlockId>]>,
        num_encoder_tokens: usize,
        total_computed_tokens: usize,
        num_tokens_main_model: usize,
        apply_admission_cap: bool,
    ) -> Result<i64, PoolError> {
        let mut total = 0i64;
        for (i, g) in self.groups.iter().enumerate() {
            let n = if g.kind() == Kind::CrossAttention {
                g.get_num_blocks_to_allocate(
                    pool,
                    id,
                    num_encoder_tokens,
                    &[],
                    0,
                    num_encoder_tokens,
                    apply_admission_cap,
                )?
            } else {
                let h = hits.and_then(|h| h.get(i)).map_or(&[][..], Vec::as_slice);
                g.get_num_blocks_to_allocate(
                    pool,
                    id,
                    num_tokens,
                    h,
                    total_computed_tokens,
                    num_tokens_main_model,
                    apply_admission_cap,
                )?
            };
            total = total.saturating_add(n);
        }
        Ok(total)
    }

    /// COORD-5: a request that is not running takes its hits in every group, then blocks for
    /// external tokens; a running one is left alone.
    ///
    /// # Errors
    /// [`PoolError::Invariant`] for hits given to a running request; the groups' refusals
    /// ([`Self::check_new_computed_blocks`]); [`PoolError::NotEnoughFreeBlocks`] when the hits
    /// and the external tokens' blocks take more than are free. Nothing changes then.
    pub fn allocate_new_computed_blocks(
        &mut self,
        pool: &mut BlockPool,
        id: &str,
        hits: Option<&[Vec<BlockId>]>,
        num_local_computed_tokens: usize,
        num_external_computed_tokens: usize,
    ) -> Result<(), PoolError> {
        let any_hits = hits.is_some_and(|h| h.iter().any(|g| !g.is_empty()));
        if self.is_running(id) {
            if any_hits {
                return Err(PoolError::Invariant(
                    "a running request cannot have new prefix hits".into(),
                ));
            }
            return Ok(());
        }
        self.check_new_computed_blocks(
            pool,
            id,
            hits,
            num_local_computed_tokens,
            num_external_computed_tokens,
        )?;
        let mut lens = vec![0; self.groups.len()];
        let taken = self.computed_taken(
            pool,
            hits,
            num_local_computed_tokens.saturating_add(num_external_computed_tokens),
            num_external_computed_tokens,
            &mut lens,
        );
        let free = pool.get_num_free_blocks();
        if taken > free {
            return Err(PoolError::NotEnoughFreeBlocks {
                requested: taken,
                free,
            });
        }
        self.add_new_computed_blocks(
            pool,
            id,
            hits,
            num_local_computed_tokens,
            num_external_computed_tokens,
        )
    }

    /// [`Self::allocate_new_computed_blocks`]' changes, for a caller that has made its checks
    /// (a request not running, the groups' refusals, the blocks taken against the free ones):
    /// the allocation, which makes them before it changes anything.
    fn add_new_computed_blocks(
        &mut self,
        pool: &mut BlockPool,
        id: &str,
        hits: Option<&[Vec<BlockId>]>,
        num_local_computed_tokens: usize,
        num_external_computed_tokens: usize,
    ) -> Result<(), PoolError> {
        for (i, g) in self.groups.iter_mut().enumerate() {
            let h = hits.and_then(|h| h.get(i)).map_or(&[][..], Vec::as_slice);
            g.add_local_computed_blocks(
                pool,
                id,
                h,
                num_local_computed_tokens,
                num_external_computed_tokens,
            )?;
        }
        if num_external_computed_tokens > 0 {
            for g in &mut self.groups {
                g.allocate_external_computed_blocks(
                    pool,
                    id,
                    num_local_computed_tokens,
                    num_external_computed_tokens,
                )?;
            }
        }
        Ok(())
    }

    /// Every group's refusal of [`Self::allocate_new_computed_blocks`] for a request that is
    /// not running, found before any group changes (a later group's refusal would otherwise
    /// leave an earlier group's hits touched).
    ///
    /// # Errors
    /// The groups' ([`SingleTypeManager::check_local_computed_blocks`]).
    pub fn check_new_computed_blocks(
        &self,
        pool: &BlockPool,
        id: &str,
        hits: Option<&[Vec<BlockId>]>,
        num_local_computed_tokens: usize,
        num_external_computed_tokens: usize,
    ) -> Result<(), PoolError> {
        for (i, g) in self.groups.iter().enumerate() {
            let h = hits.and_then(|h| h.get(i)).map_or(&[][..], Vec::as_slice);
            g.check_local_computed_blocks(
                pool,
                id,
                h,
                num_local_computed_tokens,
                num_external_computed_tokens,
            )?;
        }
        Ok(())
    }

    /// COORD-3: gives every group enough slots; the new blocks per group.
    ///
    /// # Errors
    /// The pool's when it cannot provide the blocks.
    pub fn allocate_new_blocks(
        &mut self,
        pool: &mut BlockPool,
        id: &str,
        num_tokens: usize,
        num_tokens_main_model: usize,
        num_encoder_tokens: usize,
    ) -> Result<NewBlocks, PoolError> {
        self.groups
            .iter_mut()
            .map(|g| {
                let n = if g.kind() == Kind::CrossAttention {
                    num_encoder_tokens
                } else {
                    num_tokens
                };
                g.allocate_new_blocks(pool, id, n, num_tokens_main_model)
            })
            .collect()
    }

    // ------------------------------------------------------------------------------------
    // Caching

    /// The token count each group caches up to (COORD-6; hybrid: COORD-10's scheduler-aligned
    /// length plus the EAGLE block).
    #[inline]
    pub fn cache_length(&self, group: usize, num_computed_tokens: usize) -> usize {
        if self.mode != Mode::Hybrid {
            return num_computed_tokens;
        }
        let sbs = self.scheduler_block_size;
        let aligned = num_computed_tokens / sbs * sbs;
        let g = &self.groups[group];
        if g.use_eagle && aligned > 0 {
            num_computed_tokens.min(aligned.saturating_add(g.block_size()))
        } else {
            aligned
        }
    }

    /// COORD-6 / COORD-10: caches the request's full blocks in every group. `hashes` is the
    /// request's hash list at the hash block size.
    ///
    /// # Errors
    /// [`Self::check_cacheable`]'s refusals, before anything changes; the groups' caching
    /// errors (see [`SingleTypeManager::cache_blocks`]).
    pub fn cache_blocks<E: From<PoolError>>(
        &mut self,
        pool: &mut BlockPool,
        req: &RequestView<'_>,
        num_computed_tokens: usize,
        hashes: HashSource<'_, E>,
        meta: &mut dyn FnMut(&MetaRequest<'_>) -> Result<StoredMeta, E>,
    ) -> Result<(), E> {
        let num_hashes = (hashes.len)()?;
        self.check_cacheable(req.id, num_computed_tokens, None, None, num_hashes)?;
        self.cache_checked(pool, req, num_computed_tokens, hashes, meta)
    }

    /// [`Self::cache_blocks`] after its [`Self::check_cacheable`]: the allocation checks the
    /// table lengths it is about to leave before it changes anything, then caches here.
    fn cache_checked<E: From<PoolError>>(
        &mut self,
        pool: &mut BlockPool,
        req: &RequestView<'_>,
        num_computed_tokens: usize,
        hashes: HashSource<'_, E>,
        meta: &mut dyn FnMut(&MetaRequest<'_>) -> Result<StoredMeta, E>,
    ) -> Result<(), E> {
        let hashes = RefCell::new(hashes);
        let mut ready = Vec::with_capacity(self.groups.len());
        for i in 0..self.groups.len() {
            let n = self.cache_length(i, num_computed_tokens);
            let slot = self.groups[i].tables.slot_of(req.id);
            if let Some(c) = self.prepare_group(pool, i, slot, req, n, &hashes, meta)? {
                ready.push((i, c));
            }
        }
        for (i, c) in ready {
            self.groups[i].commit_cache(pool, c);
        }
        Ok(())
    }

    /// Reads and checks group `i`'s caching up to `n` tokens, at its block size, without
    /// changing anything (`None`: nothing to cache); `slot` is the request's entry in the
    /// group's tables (`None`: it has none). Every group is read before any is stored
    /// ([`SingleTypeManager::commit_cache`]), so that a later group's failure (a hash or the
    /// event metadata that cannot be read) leaves the earlier ones unchanged.
    #[allow(clippy::too_many_arguments)]
    fn prepare_group<E: From<PoolError>>(
        &self,
        pool: &BlockPool,
        i: usize,
        slot: Option<u32>,
        req: &RequestView<'_>,
        n: usize,
        hashes: &RefCell<HashSource<'_, E>>,
        meta: &mut dyn FnMut(&MetaRequest<'_>) -> Result<StoredMeta, E>,
    ) -> Result<Option<GroupCache>, E> {
        let g = &self.groups[i];
        let k = (g.block_size() / self.hash_block_size).max(1);
        let mut len = || -> Result<usize, E> {
            let mut h = hashes.borrow_mut();
            Ok((h.len)()? / k)
        };
        let mut get = |j: usize| -> Result<BlockHash, E> {
            let mut h = hashes.borrow_mut();
            (h.get)((j + 1) * k - 1)
        };
        g.prepare_cache(
            pool,
            req.id,
            slot,
            n,
            self.retention_interval,
            req.num_prompt_tokens,
            HashSource {
                len: &mut len,
                get: &mut get,
            },
            meta,
        )
    }

    /// Refuses, before anything changes, where [`Self::cache_blocks`] would fail part-way: a
    /// group caching `f` full blocks needs `f` blocks and `f` hashes at its block size, and
    /// a cross-attention group caches nothing. The blocks are the request's tables' (`lens`
    /// `None`) or, per group, the table lengths an allocation is about to leave. `hits` count
    /// as cached for a request that is not running (STM-4).
    ///
    /// # Errors
    /// [`PoolError::MissingBlocks`] or [`PoolError::Invalid`].
    pub fn check_cacheable(
        &self,
        id: &str,
        num_computed_tokens: usize,
        lens: Option<&[usize]>,
        hits: Option<&[Vec<BlockId>]>,
        num_hashes: usize,
    ) -> Result<(), PoolError> {
        for (i, g) in self.groups.iter().enumerate() {
            let bs = g.block_size();
            let full = self.cache_length(i, num_computed_tokens) / bs;
            let entry = g.tables.get(id);
            let cached = match entry.and_then(|r| r.num_cached) {
                Some(c) => c,
                None => hits.and_then(|h| h.get(i)).map_or(0, Vec::len),
            };
            if cached >= full {
                continue;
            }
            if g.kind() == Kind::CrossAttention {
                return Err(cross_attention_caches_nothing());
            }
            let have = match lens {
                Some(l) => l[i],
                None => entry.map_or(0, |r| r.blocks.len()),
            };
            if have < full {
                return Err(PoolError::MissingBlocks(format!(
                    "request {id} holds {have} blocks in group {i}, fewer than the {full} full \
                     ones"
                )));
            }
            if num_hashes / (bs / self.hash_block_size).max(1) < full {
                return Err(PoolError::Invalid(format!(
                    "request {id} has {num_hashes} block hashes, too few for its {full} full \
                     blocks of {bs} tokens"
                )));
            }
        }
        Ok(())
    }

    // ------------------------------------------------------------------------------------
    // Skipping and freeing

    /// MGR-22: frees the blocks outside every group's attention window.
    ///
    /// # Errors
    /// Only if the pool's counts were corrupted from outside.
    pub fn remove_skipped_blocks(
        &mut self,
        pool: &mut BlockPool,
        id: &str,
        total_computed_tokens: usize,
        num_prompt_tokens: Option<usize>,
    ) -> Result<(), PoolError> {
        for &i in &self.skippers {
            self.groups[i].remove_skipped_blocks(
                pool,
                id,
                total_computed_tokens,
                num_prompt_tokens,
            )?;
        }
        Ok(())
    }

    /// MGR-20: frees the request in every group, in group order.
    ///
    /// # Errors
    /// Only if the pool's counts were corrupted from outside.
    pub fn free(
        &mut self,
        pool: &mut BlockPool,
        id: &str,
        retention: Retention,
        now: f64,
    ) -> Result<(), PoolError> {
        for g in &mut self.groups {
            g.free(pool, id, retention, now)?;
        }
        Ok(())
    }

    /// MGR-21: forgets the request; all its blocks, group by group, in allocation order.
    pub fn pop(&mut self, id: &str) -> Vec<BlockId> {
        self.groups.iter_mut().flat_map(|g| g.pop(id)).collect()
    }

    /// MGR-22: per group, the leading blocks every tracked request shares (0 without caching).
    pub fn get_num_common_prefix_blocks(&mut self, pool: &BlockPool, id: &str) -> Vec<usize> {
        if self.mode == Mode::NoPrefixCache {
            return vec![0; self.groups.len()];
        }
        self.groups
            .iter_mut()
            .map(|g| g.get_num_common_prefix_blocks(pool, id))
            .collect()
    }

    /// MGR-29: the recorded new block ids, group by group.
    pub fn take_new_block_ids(&mut self) -> Vec<BlockId> {
        if let [g] = self.groups.as_mut_slice() {
            return g.take_new_block_ids();
        }
        self.groups
            .iter_mut()
            .flat_map(SingleTypeManager::take_new_block_ids)
            .collect()
    }

    /// MGR-30.
    pub fn new_step_starts(&mut self) {
        self.groups
            .iter_mut()
            .for_each(SingleTypeManager::new_step_starts);
    }

    /// Checks every group's tables and the pool.
    ///
    /// # Errors
    /// A message naming the first violation.
    pub fn check_invariants(&self, pool: &BlockPool) -> Result<(), String> {
        for g in &self.groups {
            g.check_invariants(pool)?;
        }
        pool.check_invariants()
    }

    // ------------------------------------------------------------------------------------
    // allocate_slots

    fn snapshot(&self, id: &str) -> SkipUndo {
        SkipUndo {
            had: self.groups.iter().map(|g| g.tables.contains(id)).collect(),
            saved: self
                .skippers
                .iter()
                .map(|&i| (i, self.groups[i].tables.get(id).map(|r| r.blocks.clone())))
                .collect(),
        }
    }

    /// Puts back what `remove_skipped_blocks` changed: touches the freed blocks again (which
    /// restores their counts and takes them off the queue's end) and drops created entries.
    fn restore(&mut self, pool: &mut BlockPool, id: &str, undo: SkipUndo) -> Result<(), PoolError> {
        let mut freed = Vec::new();
        for (i, old) in undo.saved {
            let Some(cur) = self.groups[i].tables.get_mut(id) else {
                continue;
            };
            let old = old.unwrap_or_default();
            freed.extend(
                old.iter()
                    .zip(&cur.blocks)
                    .filter(|(a, b)| a != b)
                    .map(|(a, _)| *a),
            );
            cur.blocks = old;
            cur.null_end = 0;
        }
        pool.touch(&freed)?;
        for (g, had) in self.groups.iter_mut().zip(undo.had) {
            if !had && g.tables.get(id).is_some_and(|r| r.blocks.is_empty()) {
                g.tables.pop(id);
            }
        }
        Ok(())
    }

    /// What an allocation takes off the free queue, known before anything changes: the hits it
    /// touches there and the external tokens' blocks ([`Self::computed_taken`]) and the blocks
    /// the new slots (STM-3, with MAMBA-5) take, with the groups' refusals of the counts
    /// ([`SingleTypeManager::new_blocks_needed`]); and each group's table length after it.
    #[allow(clippy::too_many_arguments)]
    fn blocks_taken(
        &self,
        pool: &BlockPool,
        id: &str,
        hits: Option<&[Vec<BlockId>]>,
        total: usize,
        ext: usize,
        need_slot: usize,
        main: usize,
        num_encoder_tokens: usize,
        computed: bool,
    ) -> Result<(usize, Vec<usize>), PoolError> {
        let mut lens: Vec<usize> = self.groups.iter().map(|g| g.blocks(id).len()).collect();
        let mut pops = if computed && !self.is_running(id) {
            self.computed_taken(pool, hits, total, ext, &mut lens)
        } else {
            0
        };
        for (g, len) in self.groups.iter().zip(&mut lens) {
            let n = if g.kind() == Kind::CrossAttention {
                num_encoder_tokens
            } else {
                need_slot
            };
            let (new, after) = g.new_blocks_needed(id, *len, n, main)?;
            pops = pops.saturating_add(new);
            *len = after;
        }
        Ok((pops, lens))
    }

    /// COORD-5 for a request that holds no blocks, without changing anything: the blocks its
    /// hits (STM-4) take off the free queue (touched there) and its external tokens' blocks
    /// (STM-5), `total` tokens computed; `lens` becomes each group's table length after them
    /// (cross-attention groups keep theirs).
    fn computed_taken(
        &self,
        pool: &BlockPool,
        hits: Option<&[Vec<BlockId>]>,
        total: usize,
        ext: usize,
        lens: &mut [usize],
    ) -> usize {
        let mut touched: Vec<BlockId> = Vec::new();
        let mut pops = 0usize;
        for (i, (g, len)) in self.groups.iter().zip(lens).enumerate() {
            if g.kind() == Kind::CrossAttention {
                continue;
            }
            let bs = g.block_size();
            let skipped_tokens = g.get_num_skipped_tokens(total);
            let skipped = skipped_tokens / bs;
            let h = hits.and_then(|h| h.get(i)).map_or(&[][..], Vec::as_slice);
            let h = &h[skipped.min(h.len())..];
            if pool.enable_caching() {
                touched.extend(h.iter().filter(|&&b| b != 0 && pool.ref_cnt(b) == 0));
            }
            *len = skipped + h.len();
            if g.external_tokens(total, ext) > 0 {
                let n = cdiv(total, bs).saturating_sub(*len);
                pops = pops.saturating_add(n);
                *len += n;
            }
        }
        touched.sort_unstable();
        touched.dedup();
        pops.saturating_add(touched.len())
    }

    /// One group's part of a running call: its slot (a stale hint is refreshed now, the entry
    /// outlives this call), the table length it grows to (skipping changes no table's
    /// length), whether a block fills (the request's hash list is read only then: rarely),
    /// and the blocks it counts against the free ones. `None`: the group needs the general
    /// rules.
    #[inline]
    fn running_step(
        &self,
        i: usize,
        g: &SingleTypeManager,
        req: &RequestView<'_>,
        t: &TokenCounts,
    ) -> Option<(i64, RunningStep)> {
        let slot = g.tables.resolve_cell(req.id, req.hints.get(i))?;
        let e = g.tables.at_slot(slot);
        // A request that never cached (with caching off, vLLM's scheduler never registers it:
        // ALLOC-8) counts as running in a full-attention group when the call caches nothing:
        // STM-2 and STM-3 then count and allocate alike for both.
        let cached = match e.num_cached {
            Some(c) => c,
            None if !t.caching && g.kind() == Kind::Full => 0,
            None => return None,
        };
        let have = e.blocks.len();
        let (count, want) = g.running_growth(have, t.need_slot, t.main)?;
        let cache_len = if t.caching {
            self.cache_length(i, t.to_cache)
        } else {
            0
        };
        let fills = t.caching && block_fills(cached, g.block_size(), cache_len);
        Some((
            count,
            RunningStep {
                slot,
                have,
                want,
                cache_len,
                fills,
            },
        ))
    }

    /// Whether [`Self::allocate_is_noop`] may hold for any call: not when a group skips blocks
    /// (its running calls remove them) or there are more groups than the running path takes.
    #[inline]
    pub fn noop_possible(&self) -> bool {
        self.skippers.is_empty() && self.groups.len() <= MAX_RUNNING_GROUPS
    }

    /// Whether the call names only token counts, which the running path may serve.
    #[inline]
    fn counts_only(args: &AllocateArgs<'_>) -> bool {
        args.new_computed_blocks.is_none()
            && args.num_external_computed_tokens == 0
            && !args.full_sequence_must_fit
    }

    /// Whether [`Self::allocate_slots`] with these arguments would allocate nothing and change
    /// nothing but stale hints (which this refreshes): a running request's call in which no
    /// group grows, fills a block or skips one, with no watermark or reservation to check.
    /// Most decode steps are such calls; a caller may answer them (no new blocks) without
    /// gathering what the call needs only when something happens. An invalid call (ALLOC-1)
    /// is not one.
    #[inline(always)]
    pub fn allocate_is_noop(
        &self,
        pool: &BlockPool,
        req: &RequestView<'_>,
        args: &AllocateArgs<'_>,
    ) -> bool {
        self.allocate_is_noop_reading(pool, req, args, || req.num_tokens)
    }

    /// [`Self::allocate_is_noop`] for a caller whose request's token count is costly to read:
    /// `req.num_tokens` may be any bound at or above the count (`usize::MAX`: unread), and
    /// `num_tokens` reads the count. The count only caps the tokens the call caches, so it is
    /// read only when a group fills a block with the bound; then the group's cache length is
    /// taken again with the count.
    #[inline(always)]
    pub fn allocate_is_noop_reading(
        &self,
        pool: &BlockPool,
        req: &RequestView<'_>,
        args: &AllocateArgs<'_>,
        num_tokens: impl Fn() -> usize,
    ) -> bool {
        if args.num_new_tokens == 0
            || !Self::counts_only(args)
            || args.reserved_blocks > 0
            || !self.noop_possible()
        {
            return false;
        }
        let t = TokenCounts::of(self, pool, req, args);
        t.wm == 0
            && self.groups.iter().enumerate().all(|(i, g)| {
                self.running_step(i, g, req, &t).is_some_and(|(count, s)| {
                    count <= 0
                        && s.want <= s.have
                        && !(s.fills && self.fills_counted(i, g, &s, t.to_cache, &num_tokens))
                })
            })
    }

    /// Whether group `i` (`g`), which fills a block of its step `s` caching up to `to_cache`
    /// tokens, still fills one when the request's count `num_tokens` caps that.
    #[cold]
    #[inline(never)]
    fn fills_counted(
        &self,
        i: usize,
        g: &SingleTypeManager,
        s: &RunningStep,
        to_cache: usize,
        num_tokens: &impl Fn() -> usize,
    ) -> bool {
        let counted = to_cache.min(num_tokens());
        counted == to_cache || {
            let cached = g.tables.at_slot(s.slot).num_cached.unwrap_or(0);
            block_fills(cached, g.block_size(), self.cache_length(i, counted))
        }
    }

    /// Whether [`Self::allocate_slots`] with these arguments may cache a full block (and so
    /// ask for its event metadata): `false` only for a call of a request running in every
    /// group, with token counts only, in which no group fills a block (or caching is off for
    /// the call). A caller that must gather what the metadata reads before the tables are
    /// held asks this first. Exact for such calls: a block fills when the tokens the call
    /// caches reach past the request's cached blocks, which may trail its computed tokens (a
    /// call made before the request's last token was appended caches one block short of it).
    pub fn may_cache_a_block(
        &self,
        pool: &BlockPool,
        req: &RequestView<'_>,
        args: &AllocateArgs<'_>,
    ) -> bool {
        if !Self::counts_only(args) || self.groups.len() > MAX_RUNNING_GROUPS {
            return true;
        }
        let t = TokenCounts::of(self, pool, req, args);
        t.caching
            && !self.groups.iter().enumerate().all(|(i, g)| {
                self.running_step(i, g, req, &t)
                    .is_some_and(|(_, s)| !s.fills)
            })
    }

    /// `allocate_slots` for a request running in every group without hits or external
    /// tokens: the general path's decisions with one table lookup per group, each group's
    /// counts from [`SingleTypeManager::running_growth`]. `Ok(None)`: not running, or a group
    /// needs the general rules (nothing changed); `Ok(Some(None))`: does not fit.
    fn allocate_running<E: From<PoolError>>(
        &mut self,
        pool: &mut BlockPool,
        req: &RequestView<'_>,
        args: &AllocateArgs<'_>,
        t: &TokenCounts,
        hashes: HashSource<'_, E>,
        meta: &mut dyn FnMut(&MetaRequest<'_>) -> Result<StoredMeta, E>,
    ) -> Result<Option<Option<NewBlocks>>, E> {
        let TokenCounts {
            total,
            wm,
            to_cache,
            ..
        } = *t;
        // One lookup per group ([`Self::running_step`]; the first four groups through the
        // caller's hints).
        let n = self.groups.len();
        if n > MAX_RUNNING_GROUPS {
            return Ok(None);
        }
        let mut steps = [RunningStep::default(); MAX_RUNNING_GROUPS];
        let mut need = 0i64;
        let mut fills = false;
        for (i, (g, step)) in self.groups.iter().zip(&mut steps).enumerate() {
            let Some((count, s)) = self.running_step(i, g, req, t) else {
                return Ok(None);
            };
            need = need.saturating_add(count);
            fills |= s.fills;
            *step = s;
        }
        let steps = &steps[..n];
        // A count short of what the groups take (Mamba's) may pass the check after the frees
        // and still not fit: the general rules undo the frees then.
        let pops = steps.iter().fold(0usize, |p, s| {
            p.saturating_add(s.want.saturating_sub(s.have))
        });
        if i64::try_from(pops).map_or(true, |p| p > need) && pops > pool.get_num_free_blocks() {
            return Ok(None);
        }
        if fills {
            let num_hashes = (hashes.len)()?;
            let mut lens = [0usize; MAX_RUNNING_GROUPS];
            for (l, s) in lens.iter_mut().zip(steps) {
                *l = s.want.max(s.have);
            }
            self.check_cacheable(req.id, to_cache, Some(&lens[..n]), None, num_hashes)?;
        }
        for &i in &self.skippers {
            self.groups[i].remove_skipped_at(
                pool,
                req.id,
                Some(steps[i].slot),
                total,
                Some(req.num_prompt_tokens),
            )?;
        }
        if (need > 0 || wm > 0 || args.reserved_blocks > 0)
            && !fits(need, wm, pool.get_num_free_blocks(), args.reserved_blocks)
        {
            return Ok(Some(None));
        }
        let mut out = NewBlocks::default();
        for (g, step) in self.groups.iter_mut().zip(steps) {
            // Most decode steps grow nothing.
            out.push(if step.want > step.have {
                g.tables.grow_slot(pool, step.slot, step.want)?
            } else {
                step.have..step.have
            });
        }
        if fills {
            let hashes = RefCell::new(hashes);
            let mut ready: [Option<GroupCache>; MAX_RUNNING_GROUPS] = Default::default();
            for (i, step) in steps.iter().enumerate().filter(|(_, s)| s.fills) {
                ready[i] = self.prepare_group(
                    pool,
                    i,
                    Some(step.slot),
                    req,
                    step.cache_len,
                    &hashes,
                    meta,
                )?;
            }
            for (g, c) in self.groups.iter_mut().zip(ready) {
                if let Some(c) = c {
                    g.commit_cache(pool, c);
                }
            }
        }
        Ok(Some(Some(out)))
    }

    /// Refreshes the request's stale hints after an allocation that succeeded.
    #[inline]
    fn refresh_hints(&self, req: &RequestView<'_>) {
        for (g, cell) in self.groups.iter().zip(req.hints) {
            if let Some(slot) = g.tables.slot_of(req.id) {
                g.tables.refresh(cell, slot);
            }
        }
    }

    /// SPEC ALLOC-1..13: the new blocks per group, or `None` when they do not fit. `hashes`
    /// (the request's hashes at the hash block size) and `meta` feed ALLOC-11's caching. A
    /// call that allocates refreshes the request's stale `hints` (a running request's, as
    /// its entries are found).
    ///
    /// # Errors
    /// Bad arguments before any change ([`PoolError::Invalid`], [`PoolError::Invariant`]);
    /// [`PoolError::NotEnoughFreeBlocks`] where the reference fails part-way (nothing
    /// changes); caching errors.
    #[inline]
    pub fn allocate_slots<E: From<PoolError>>(
        &mut self,
        pool: &mut BlockPool,
        req: RequestView<'_>,
        args: AllocateArgs<'_>,
        hashes: HashSource<'_, E>,
        meta: &mut dyn FnMut(&MetaRequest<'_>) -> Result<StoredMeta, E>,
    ) -> Result<Option<NewBlocks>, E> {
        if args.num_new_tokens == 0 && args.num_external_computed_tokens == 0 {
            return Err(no_new_tokens().into());
        }
        // A running request's call that names only token counts (every decode step) is
        // served by the running path; the rest of the rules are out of line.
        if Self::counts_only(&args) {
            let t = TokenCounts::of(self, pool, &req, &args);
            let reborrowed = HashSource {
                len: &mut *hashes.len,
                get: &mut *hashes.get,
            };
            if let Some(out) = self.allocate_running(pool, &req, &args, &t, reborrowed, meta)? {
                return Ok(out);
            }
        }
        self.allocate_general(pool, req, args, hashes, meta)
    }

    /// [`Self::allocate_slots`] for every call the running path does not serve (admissions,
    /// hits, external tokens, the whole-sequence gate, growth that does not fit).
    #[cold]
    #[inline(never)]
    fn allocate_general<E: From<PoolError>>(
        &mut self,
        pool: &mut BlockPool,
        req: RequestView<'_>,
        args: AllocateArgs<'_>,
        hashes: HashSource<'_, E>,
        meta: &mut dyn FnMut(&MetaRequest<'_>) -> Result<StoredMeta, E>,
    ) -> Result<Option<NewBlocks>, E> {
        let ext = args.num_external_computed_tokens;
        let hits = args.new_computed_blocks;
        if let Some(h) = hits {
            if let Some(&b) = h
                .iter()
                .flatten()
                .find(|&&b| b as usize >= pool.num_blocks())
            {
                return Err(PoolError::BlockOutOfRange {
                    block_id: i64::from(b),
                    num_blocks: pool.num_blocks(),
                }
                .into());
            }
            if h.len() != self.groups.len() {
                return Err(PoolError::Invalid(format!(
                    "new_computed_blocks has {} groups, the manager has {}",
                    h.len(),
                    self.groups.len()
                ))
                .into());
            }
            if h.iter().any(|g| !g.is_empty()) && self.is_running(req.id) {
                return Err(PoolError::Invariant(format!(
                    "request {} is running and cannot take new prefix hits",
                    req.id
                ))
                .into());
            }
        }
        let mml = self.max_model_len;
        let TokenCounts {
            local,
            uncapped,
            total,
            wm,
            main,
            need_slot,
            caching,
            to_cache,
        } = TokenCounts::of(self, pool, &req, &args);
        // Refusals the reference makes part-way (after freeing, touching or allocating) are
        // made here, before anything changes.
        if self.has_skippers() && uncapped > mml {
            return Err(PoolError::Invalid(format!(
                "computed tokens ({uncapped}) beyond max_model_len ({mml}) with sliding-window \
                 groups"
            ))
            .into());
        }
        if args.num_new_computed_tokens > 0 && hits.is_none() && self.has_skippers() {
            return Err(PoolError::Invalid(
                "num_new_computed_tokens must come with the hit blocks it counts".into(),
            )
            .into());
        }
        let computed = hits.is_some() || ext > 0;
        let running = self.is_running(req.id);
        if computed && !running && self.groups.iter().any(|g| !g.blocks(req.id).is_empty()) {
            return Err(PoolError::Invariant(format!(
                "request {} holds blocks and cannot take prefix hits or external tokens",
                req.id
            ))
            .into());
        }
        if computed && !running {
            self.check_new_computed_blocks(pool, req.id, hits, local, ext)?;
        }
        // What the allocation takes off the free queue (and the groups' refusals), known
        // before anything changes, where STM-2's count may be short of it.
        let taken = if ext > 0 || !self.exact_count || caching {
            Some(self.blocks_taken(
                pool,
                req.id,
                hits,
                uncapped,
                ext,
                need_slot,
                main,
                args.num_encoder_tokens,
                computed,
            )?)
        } else {
            None
        };
        let taken = match taken {
            Some((pops, lens)) => {
                if caching {
                    let num_hashes = (hashes.len)()?;
                    self.check_cacheable(req.id, to_cache, Some(&lens), hits, num_hashes)?;
                }
                Some(pops)
            }
            None => None,
        };
        if args.full_sequence_must_fit {
            let full = req.num_tokens.min(mml);
            let need = self.get_num_blocks_to_allocate(
                pool,
                req.id,
                full,
                hits,
                args.num_encoder_tokens,
                total,
                full,
                true,
            )?;
            if !fits(need, wm, pool.get_num_free_blocks(), 0) {
                return Ok(None);
            }
        }
        // `need` (STM-2) may undercount what is then taken: external-token blocks are not
        // capped by max_model_len, a window group pads its skipped blocks only from hits, and
        // Mamba's count may be short of (align mode: negative against) its allocation. The
        // reference then fails after ALLOC-6's frees; kvcore refuses and undoes them.
        let undo = (self.has_skippers()
            && (!running || taken.is_some_and(|t| t > pool.get_num_free_blocks())))
        .then(|| self.snapshot(req.id));
        self.remove_skipped_blocks(pool, req.id, total, Some(req.num_prompt_tokens))?;
        let need = self.get_num_blocks_to_allocate(
            pool,
            req.id,
            need_slot,
            hits,
            args.num_encoder_tokens,
            uncapped,
            main,
            false,
        )?;
        if !fits(need, wm, pool.get_num_free_blocks(), args.reserved_blocks) {
            return Ok(None);
        }
        let free = pool.get_num_free_blocks();
        if let Some(taken) = taken.filter(|&t| t > free) {
            if let Some(undo) = undo {
                self.restore(pool, req.id, undo)?;
            }
            return Err(PoolError::NotEnoughFreeBlocks {
                requested: taken,
                free,
            }
            .into());
        }
        // Checked above: the hits and external blocks (not running, the groups' refusals,
        // what they take against the free blocks) and the caching (`check_cacheable` of the
        // table lengths this leaves).
        if computed && !running {
            self.add_new_computed_blocks(pool, req.id, hits, local, ext)?;
        }
        let new =
            self.allocate_new_blocks(pool, req.id, need_slot, main, args.num_encoder_tokens)?;
        if caching {
            self.cache_checked(pool, &req, to_cache, hashes, meta)?;
        }
        self.refresh_hints(&req);
        Ok(Some(new))
    }

    /// MGR-26: per group, the leading block ids covering `num_computed_tokens`, in the spec's
    /// block size; Mamba, cross-attention and (with `clip[i] == false`) other groups give all.
    pub fn block_ids_for_computed_tokens(
        &self,
        id: &str,
        num_computed_tokens: usize,
        clip: &[bool],
    ) -> Vec<&[BlockId]> {
        self.groups
            .iter()
            .enumerate()
            .map(|(i, g)| {
                let blocks = g.blocks(id);
                if clip.get(i).copied().unwrap_or(false) {
                    let keep = num_computed_tokens
                        .div_ceil(g.spec_block_size())
                        .min(blocks.len());
                    &blocks[..keep]
                } else {
                    blocks
                }
            })
            .collect()
    }
}

#[cfg(test)]
#[path = "coordinator_tests.rs"]
mod tests;

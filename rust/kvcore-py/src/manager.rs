//! `kvcore._native.UnitaryFullAttention`: the request-facing calls of a model whose only
//! KV-cache group is full attention, one boundary crossing per call. `kvcore.KVCacheManager`
//! routes every call here for that configuration (the common case) and keeps its Python
//! coordinators for the others.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use kvcore_core::events::{MetaRequest, StoredMeta};
use kvcore_core::full_attention::{AllocateArgs, RequestView, UnitaryFullAttention};
use kvcore_core::hash::BlockHash;
use kvcore_core::pool::{BlockId, BlockPool, HashSource};
use kvcore_core::PoolError;
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::sync::GILOnceCell;
use pyo3::types::{PyDict, PyList, PyString, PyTuple};

use crate::args::{count_of, id_key, request_id_of, Count, Flag};
use crate::errors::{invalid, to_pyerr, Error};
use crate::pool::{
    cached_prefix, extract_ids, get_opt, list_or_copy, request_retention, stored_meta, to_hash,
    PyBlockPool, PyRetention,
};
use crate::request::{prefetch_ahead, CoreCast};
use crate::sync::{lock, GilCell, Guarded};

/// `RequestStatus.WAITING` and `RequestStatus.PREEMPTED` (SPEC REQ-3).
const WAITING: i64 = 1;
const PREEMPTED: i64 = 6;

/// Whether an allocation may take a request past a block boundary, so that it caches a block
/// (an upper bound: blocks left uncached by an earlier call are not counted).
fn may_fill_a_block(
    num_computed: usize,
    num_tokens: usize,
    block_size: usize,
    args: &AllocateArgs<'_>,
) -> bool {
    let total = num_computed
        .saturating_add(args.num_new_computed_tokens)
        .saturating_add(args.num_external_computed_tokens)
        .saturating_add(args.num_new_tokens)
        .min(num_tokens);
    total / block_size > num_computed / block_size
}

/// A plain copy of the request fields a `BlockStored` event reads (SPEC §17), taken before the
/// tables are held so that a request whose attributes run Python code is not read meanwhile.
fn event_snapshot<'py>(request: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyAny>> {
    static NAMESPACE: GILOnceCell<PyObject> = GILOnceCell::new();
    let py = request.py();
    let cls = NAMESPACE.get_or_try_init(py, || -> PyResult<PyObject> {
        Ok(py.import("types")?.getattr("SimpleNamespace")?.unbind())
    })?;
    let fields = PyDict::new(py);
    for name in [
        intern!(py, "all_token_ids"),
        intern!(py, "lora_request"),
        intern!(py, "cache_salt"),
        intern!(py, "mm_features"),
        intern!(py, "prompt_embeds"),
        intern!(py, "_prompt_embeds_per_block_hashes"),
    ] {
        if let Some(v) = get_opt(py, request, name)? {
            fields.set_item(name, v)?;
        }
    }
    cls.bind(py).call((), Some(&fields))
}

fn count(v: i64, what: &str) -> PyResult<usize> {
    usize::try_from(v).map_err(|_| invalid(format!("{what} must be non-negative, got {v}")))
}

/// Per-call state of a unitary full-attention manager; see the module docs.
#[pyclass(module = "kvcore._native", name = "UnitaryFullAttention", frozen)]
pub struct PyUnitaryFullAttention {
    /// The request tables, held by one call at a time ([`crate::sync`]); everything else is
    /// fixed at construction and read without holding anything.
    core: GilCell<UnitaryFullAttention>,
    pool: Py<PyBlockPool>,
    /// `kvcore.blocks.KVCacheBlocks`.
    blocks_cls: PyObject,
    /// The manager's shared empty result and its `.blocks` tuple (ALLOC-8's identity test).
    empty: PyObject,
    empty_blocks: PyObject,
    /// Recognises kvcore requests without pyo3's per-call type check.
    cast: CoreCast,
    /// The manager's `max_model_len` and watermark (for [`Self::check_external_fits`]).
    max_model_len: usize,
    watermark_blocks: usize,
    /// The pool's `enable_caching` (fixed at construction).
    caching: bool,
    /// The pool's deadline flag ([`PyBlockPool::deadline_flag`]).
    deadlines: Arc<AtomicBool>,
    /// The pool's `enable_kv_cache_events` and the tables' block size (fixed).
    events: bool,
    block_size: usize,
}

impl Guarded for PyUnitaryFullAttention {
    type State = UnitaryFullAttention;
    fn cell(&self) -> &GilCell<UnitaryFullAttention> {
        &self.core
    }
}

impl PyUnitaryFullAttention {
    /// Refuses, before anything changes, an allocation whose external-token blocks (SPEC
    /// STM-5, not capped by `max_model_len`) and new blocks do not fit although the capacity
    /// checks passed. That happens only when `local + ext` exceeds the capped slot count; the
    /// reference then raises ValueError from `get_new_blocks` after touching the hits.
    fn check_external_fits(
        &self,
        core: &UnitaryFullAttention,
        pool: &BlockPool,
        req: &RequestView<'_>,
        args: &AllocateArgs<'_>,
    ) -> PyResult<()> {
        let t = &core.tables;
        let ext = args.num_external_computed_tokens;
        if ext == 0 || t.is_running(req.id) || !t.blocks(req.id).is_empty() {
            return Ok(()); // nothing external, or a call that changes no table (or refuses)
        }
        let mml = self.max_model_len;
        let local = req
            .num_computed_tokens
            .saturating_add(args.num_new_computed_tokens);
        let total = local.saturating_add(ext).min(mml);
        let need_slot = total
            .saturating_add(args.num_new_tokens)
            .saturating_add(args.num_lookahead_tokens)
            .min(mml);
        if local.saturating_add(ext) <= need_slot {
            return Ok(()); // the capacity check counted every block
        }
        let hits = args.new_computed_blocks.unwrap_or(&[]);
        let wm = if args.has_scheduled_reqs && req.waiting_or_preempted {
            self.watermark_blocks as i128
        } else {
            0
        };
        let free = pool.get_num_free_blocks() as i128;
        // The checks that return None first (SPEC ALLOC-5, ALLOC-7).
        if args.full_sequence_must_fit {
            let full = req.num_tokens.min(mml);
            let need = t
                .get_num_blocks_to_allocate(pool, req.id, full, hits)
                .map_err(to_pyerr)?;
            if need as i128 + wm > free {
                return Ok(());
            }
        }
        let need = t
            .get_num_blocks_to_allocate(pool, req.id, need_slot, hits)
            .map_err(to_pyerr)?;
        if need as i128 + wm > free - i128::from(args.reserved_blocks) {
            return Ok(());
        }
        // Touching the hits takes the evictable ones out of the queue; then the external and
        // the new blocks are popped.
        let mut touched: Vec<BlockId> = hits
            .iter()
            .copied()
            .filter(|&b| b != 0 && pool.ref_cnt(b) == 0)
            .collect();
        touched.sort_unstable();
        touched.dedup();
        let free = pool.get_num_free_blocks() - touched.len();
        let bs = t.block_size();
        let ext_want = local.saturating_add(ext).div_ceil(bs);
        let pops = ext_want.saturating_sub(hits.len())
            + need_slot
                .div_ceil(bs)
                .saturating_sub(hits.len().max(ext_want));
        if pops > free {
            return Err(to_pyerr(PoolError::NotEnoughFreeBlocks {
                requested: pops,
                free,
            }));
        }
        Ok(())
    }

    fn make_blocks(&self, py: Python<'_>, ids: &[BlockId]) -> PyResult<PyObject> {
        if ids.is_empty() {
            return Ok(self.empty.clone_ref(py));
        }
        let list = PyList::new(py, ids)?;
        let groups = PyTuple::new(py, [list])?;
        self.blocks_cls.call1(py, (groups, self.pool.clone_ref(py)))
    }

    /// One allocation (SPEC ALLOC-1..12) with parsed arguments: the new block ids, or `None`
    /// when the request does not fit.
    ///
    /// The request is read before the tables are held (a duck-typed request's attributes
    /// are Python code), except its hash list's entries and, with events on, the fields an
    /// event carries, which the core asks for as it caches. `next` names the batch and the
    /// position of this request in it, to prefetch the following requests' state.
    fn allocate_inner<'py>(
        &self,
        slf: &Bound<'py, Self>,
        py: Python<'py>,
        request: &Bound<'py, PyAny>,
        args: AllocateArgs<'_>,
        next: Option<(&Bound<'py, PyList>, usize)>,
    ) -> PyResult<Option<Vec<BlockId>>> {
        // A kvcore Request keeps these four fields in its native base: read them directly.
        let request_core = self.cast.borrow(request)?;
        let id_obj;
        let id_key_obj;
        let (id, num_tokens, num_computed, status) = if let Some(c) = &request_core {
            (
                c.id.as_str(),
                count(c.num_tokens, "num_tokens")?,
                count(c.num_computed_tokens, "num_computed_tokens")?,
                c.status_value,
            )
        } else {
            id_obj = PyUnitaryFullAttention::request_id(request)?;
            let num_tokens = count_of(&request.getattr(intern!(py, "num_tokens"))?, "num_tokens")?;
            let num_computed = count_of(
                &request.getattr(intern!(py, "num_computed_tokens"))?,
                "num_computed_tokens",
            )?;
            let status: i64 = if args.has_scheduled_reqs {
                request
                    .getattr(intern!(py, "status"))?
                    .extract()
                    .unwrap_or(-1)
            } else {
                0
            };
            id_key_obj = id_key(&id_obj)?;
            (&*id_key_obj, num_tokens, num_computed, status)
        };
        let waiting_or_preempted =
            args.has_scheduled_reqs && (status == WAITING || status == PREEMPTED);
        let hint = request_core.as_ref().and_then(|c| c.table_hint.get());
        let view = RequestView {
            id,
            num_computed_tokens: num_computed,
            num_tokens,
            waiting_or_preempted,
            hint,
        };
        // A kvcore Request's native copy of its hashes, when it matches the list; checked only
        // when a block fills (the list's header is then read once).
        let mirror_cell: std::cell::OnceCell<Option<&[BlockHash]>> = std::cell::OnceCell::new();
        let mirror = || *mirror_cell.get_or_init(|| request_core.as_ref()?.mirrored_hashes(py));
        // Otherwise the hash list is read lazily, only when blocks fill.
        let hashes_obj: std::cell::OnceCell<Bound<'_, PyAny>> = std::cell::OnceCell::new();
        let fetch = || -> PyResult<&Bound<'_, PyAny>> {
            if let Some(h) = hashes_obj.get() {
                return Ok(h);
            }
            let h = list_or_copy(&request.getattr(intern!(py, "block_hashes"))?)?;
            Ok(hashes_obj.get_or_init(|| h))
        };
        let mut hash_len = || -> Result<usize, Error> {
            match mirror() {
                Some(m) => Ok(m.len()),
                None => Ok(fetch()?.len()?),
            }
        };
        let mut get = |i: usize| -> Result<BlockHash, Error> {
            match mirror() {
                Some(m) => Ok(m[i]),
                None => Ok(to_hash(&fetch()?.get_item(i)?)?),
            }
        };
        // With events on, a duck-typed request's event fields are copied now when this call
        // may fill a block: the core asks for them while the tables are held.
        let snapshot = if self.events
            && self.caching
            && !args.delay_cache_blocks
            && request_core.is_none()
            && may_fill_a_block(num_computed, num_tokens, self.block_size, &args)
        {
            Some(event_snapshot(request)?)
        } else {
            None
        };
        let meta_source = snapshot.as_ref().unwrap_or(request);
        let mut meta = |req: &MetaRequest<'_>| -> Result<StoredMeta, Error> {
            Ok(stored_meta(py, meta_source, req)?)
        };
        // The hash list itself is read now; only its entries are read while the tables are
        // held (indexing a list runs no Python code).
        if request_core.is_none() && self.caching && !args.delay_cache_blocks {
            fetch()?;
        }
        let mut core = lock(slf, "manager")?;
        if let Some((list, i)) = next {
            let tables = &core.tables;
            prefetch_ahead(list, i, &self.cast, |c| {
                tables.prefetch_slot(c.table_hint.get());
            });
        }
        if self.caching && !args.delay_cache_blocks {
            // SPEC POOL-15 before anything changes: the reference asserts on too few hashes
            // only when it caches, after allocating.
            let local = num_computed.saturating_add(args.num_new_computed_tokens);
            let total = local
                .saturating_add(args.num_external_computed_tokens)
                .min(self.max_model_len);
            let full = total.saturating_add(args.num_new_tokens).min(num_tokens)
                / core.tables.block_size();
            let have = match mirror() {
                Some(m) => m.len(),
                None => fetch()?.len()?,
            };
            if have < full {
                let cached = match core.tables.get(id).and_then(|r| r.num_cached) {
                    Some(c) => c,
                    None => args.new_computed_blocks.map_or(0, <[BlockId]>::len),
                };
                if cached < full {
                    return Err(invalid(format!(
                        "request {id} has {have} block hashes, too few for its {full} full blocks"
                    )));
                }
            }
        }
        let mut pool = lock(self.pool.bind(py), "pool")?;
        self.check_external_fits(&core, pool.core(), &view, &args)?;
        let res = core.allocate_slots::<Error>(
            pool.core_mut(),
            view,
            args,
            HashSource {
                len: &mut hash_len,
                get: &mut get,
            },
            &mut meta,
        );
        drop(pool);
        let res = res?;
        let tables = &core.tables;
        let hint = match &request_core {
            Some(c) if !tables.hint_is_valid(hint) => {
                let fresh = tables.hint(id);
                c.table_hint.set(fresh);
                fresh
            }
            _ => hint,
        };
        Ok(res.map(|range| tables.blocks_hinted(id, hint)[range].to_vec()))
    }
}

impl PyUnitaryFullAttention {
    /// The manager's pool.
    fn pool_of(slf: &Bound<'_, Self>) -> PyResult<Py<PyBlockPool>> {
        Ok(slf.get().pool.clone_ref(slf.py()))
    }

    /// Applies the retention and pin deadlines due now (kvcore extension: they change what is
    /// free), before the manager is held: the clock is Python code. One comparison when no
    /// deadline exists.
    fn expire_due(slf: &Bound<'_, Self>) -> PyResult<()> {
        PyBlockPool::expire_due(Self::pool_of(slf)?.bind(slf.py()))
    }

    fn request_id<'py>(request: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyString>> {
        let id = request.getattr(intern!(request.py(), "request_id"))?;
        Ok(request_id_of(&id)?.clone())
    }
}

#[pymethods]
impl PyUnitaryFullAttention {
    #[new]
    #[pyo3(signature = (pool, block_size, record_new_block_ids, max_model_len, watermark_blocks, use_eagle, blocks_cls, empty, spec_block_size = None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        pool: Py<PyBlockPool>,
        block_size: i64,
        record_new_block_ids: bool,
        max_model_len: i64,
        watermark_blocks: i64,
        use_eagle: bool,
        blocks_cls: PyObject,
        empty: PyObject,
        spec_block_size: Option<i64>,
    ) -> PyResult<Self> {
        let bs = count(block_size, "block_size")?;
        let mml = count(max_model_len, "max_model_len")?;
        let wm = count(watermark_blocks, "watermark_blocks")?;
        let held = lock(pool.bind(py), "pool")?;
        let caching = held.core().enable_caching();
        let events = held.core().events_enabled();
        let deadlines = held.deadline_flag();
        let core =
            UnitaryFullAttention::new(held.core(), bs, record_new_block_ids, mml, wm, use_eagle)
                .and_then(|c| {
                    c.with_spec_block_size(spec_block_size.map_or(bs, |v| v.max(0) as usize))
                })
                .map_err(Error::Pool)?;
        drop(held);
        let empty_blocks = empty.getattr(py, intern!(py, "blocks"))?;
        Ok(Self {
            core: GilCell::new(core),
            pool,
            blocks_cls,
            empty,
            empty_blocks,
            cast: CoreCast::default(),
            max_model_len: mml,
            watermark_blocks: wm,
            caching,
            deadlines,
            events,
            block_size: bs,
        })
    }

    /// SPEC MGR-6/7 without stats: `(hit blocks, hit tokens)`.
    fn get_computed_blocks(
        slf: &Bound<'_, Self>,
        py: Python<'_>,
        request: &Bound<'_, PyAny>,
    ) -> PyResult<(PyObject, usize)> {
        let me = slf.get();
        // The request is read first: nothing is held while a duck-typed request runs code.
        if !me.caching
            || request
                .getattr(intern!(py, "skip_reading_prefix_cache"))?
                .is_truthy()?
        {
            return Ok((me.empty.clone_ref(py), 0));
        }
        let request_core = me.cast.borrow(request)?;
        let num_tokens = match &request_core {
            Some(c) => count(c.num_tokens, "num_tokens")?,
            None => count_of(&request.getattr(intern!(py, "num_tokens"))?, "num_tokens")?,
        };
        if num_tokens == 0 {
            // The reference's walk over `num_tokens - 1` tokens raises ValueError (islice).
            return Err(invalid("a request without tokens has no prefix to look up"));
        }
        let mirror = request_core.as_ref().and_then(|c| c.mirrored_hashes(py));
        let hashes = match mirror {
            Some(_) => None,
            None => Some(list_or_copy(
                &request.getattr(intern!(py, "block_hashes"))?,
            )?),
        };
        let (mut hit, use_eagle, bs) = {
            let core = lock(slf, "manager")?;
            let bs = core.tables.block_size();
            let max_blocks = (num_tokens - 1) / bs;
            let pool = lock(me.pool.bind(py), "pool")?;
            let hit = match (mirror, &hashes) {
                (Some(m), _) => pool
                    .core()
                    .longest_cached_prefix(m.iter().take(max_blocks).copied(), &[0])
                    .pop()
                    .unwrap_or_default(),
                (None, Some(h)) => cached_prefix(pool.core(), h, max_blocks, &[0], 1)?
                    .pop()
                    .unwrap_or_default(),
                (None, None) => Vec::new(),
            };
            (hit, core.use_eagle(), bs)
        };
        if use_eagle && !hit.is_empty() {
            hit.pop();
        }
        let tokens = hit.len() * bs;
        Ok((me.make_blocks(py, &hit)?, tokens))
    }

    /// SPEC ALLOC-1..12 in one call; see `KVCacheManager.allocate_slots`.
    #[pyo3(
        signature = (request, num_new_tokens, num_new_computed_tokens = Count(0), new_computed_blocks = None, num_lookahead_tokens = Count(0), num_external_computed_tokens = Count(0), delay_cache_blocks = Flag(false), num_encoder_tokens = Count(0), full_sequence_must_fit = Flag(false), reserved_blocks = Count(0), has_scheduled_reqs = Flag(true)),
        text_signature = "($self, request, num_new_tokens, num_new_computed_tokens=0, new_computed_blocks=None, num_lookahead_tokens=0, num_external_computed_tokens=0, delay_cache_blocks=False, num_encoder_tokens=0, full_sequence_must_fit=False, reserved_blocks=0, has_scheduled_reqs=True)"
    )]
    #[allow(clippy::too_many_arguments)]
    fn allocate_slots(
        slf: &Bound<'_, Self>,
        py: Python<'_>,
        request: &Bound<'_, PyAny>,
        num_new_tokens: Count,
        num_new_computed_tokens: Count,
        new_computed_blocks: Option<&Bound<'_, PyAny>>,
        num_lookahead_tokens: Count,
        num_external_computed_tokens: Count,
        delay_cache_blocks: Flag,
        num_encoder_tokens: Count,
        full_sequence_must_fit: Flag,
        reserved_blocks: Count,
        has_scheduled_reqs: Flag,
    ) -> PyResult<Option<PyObject>> {
        let me = slf.get();
        if me.deadlines.load(Ordering::Relaxed) {
            // Retention or pin deadlines may be due (kvcore extension): apply them first.
            Self::expire_due(slf)?;
        }
        // Counts of any size (saturated far above any pool or sequence, see `COUNT_CAP`), flags
        // by their truth value, as the reference reads them.
        let _ = num_encoder_tokens;
        let (Count(num_new_tokens), Count(num_new_computed_tokens)) =
            (num_new_tokens, num_new_computed_tokens);
        let (Count(num_lookahead_tokens), Count(num_external_computed_tokens)) =
            (num_lookahead_tokens, num_external_computed_tokens);
        let reserved_blocks = reserved_blocks.0 as i64;
        let (Flag(delay_cache_blocks), Flag(full_sequence_must_fit), Flag(has_scheduled_reqs)) = (
            delay_cache_blocks,
            full_sequence_must_fit,
            has_scheduled_reqs,
        );
        // Hits: None or the shared empty instance mean "no hits object" (ALLOC-8).
        let mut hit_ids: Vec<BlockId> = Vec::new();
        let mut hits_given = false;
        if let Some(ncb) = new_computed_blocks.filter(|o| !o.is_none()) {
            let groups = ncb.getattr(intern!(py, "blocks"))?;
            if !groups.is(&me.empty_blocks) {
                hits_given = true;
                if groups.len()? != 1 {
                    return Err(invalid(
                        "new_computed_blocks must hold exactly one group for this manager",
                    ));
                }
                let pool = lock(me.pool.bind(py), "pool")?;
                hit_ids = extract_ids(pool.core().num_blocks(), &groups.get_item(0)?)?;
            }
        }
        let args = AllocateArgs {
            num_new_tokens,
            num_new_computed_tokens,
            new_computed_blocks: hits_given.then_some(hit_ids.as_slice()),
            num_lookahead_tokens,
            num_external_computed_tokens,
            delay_cache_blocks,
            full_sequence_must_fit,
            reserved_blocks,
            has_scheduled_reqs,
        };
        match me.allocate_inner(slf, py, request, args, None)? {
            None => Ok(None),
            Some(ids) => Ok(Some(me.make_blocks(py, &ids)?)),
        }
    }

    /// `allocate_slots(request, n, num_lookahead_tokens=num_lookahead_tokens)` for each pair
    /// in order, stopping at the first request that does not fit; see
    /// `KVCacheManager.allocate_slots_batch`.
    #[pyo3(
        signature = (requests, num_new_tokens, num_lookahead_tokens = Count(0), allow_none = Flag(false)),
        text_signature = "($self, requests, num_new_tokens, num_lookahead_tokens=0, allow_none=False)"
    )]
    fn allocate_slots_batch<'py>(
        slf: &Bound<'py, Self>,
        py: Python<'py>,
        requests: &Bound<'py, PyAny>,
        num_new_tokens: &Bound<'py, PyAny>,
        num_lookahead_tokens: Count,
        allow_none: Flag,
    ) -> PyResult<Bound<'py, PyList>> {
        let me = slf.get();
        if me.deadlines.load(Ordering::Relaxed) {
            // Retention or pin deadlines may be due (kvcore extension): apply them first.
            Self::expire_due(slf)?;
        }
        let (Count(lookahead), Flag(allow_none)) = (num_lookahead_tokens, allow_none);
        let counts = num_new_tokens
            .try_iter()?
            .map(|n| count_of(&n?, "num_new_tokens"))
            .collect::<PyResult<Vec<usize>>>()?;
        if counts.contains(&0) {
            // SPEC ALLOC-1 for every request before any is allocated.
            return Err(invalid(
                "num_new_tokens must be greater than 0 when there are no external computed tokens",
            ));
        }
        if requests.len()? != counts.len() {
            return Err(invalid(format!(
                "{} requests but {} token counts",
                requests.len()?,
                counts.len()
            )));
        }
        let out = PyList::empty(py);
        let list = requests.downcast_exact::<PyList>().ok();
        for (i, (request, n)) in requests.try_iter()?.zip(counts).enumerate() {
            let args = AllocateArgs {
                num_new_tokens: n,
                num_new_computed_tokens: 0,
                new_computed_blocks: None,
                num_lookahead_tokens: lookahead,
                num_external_computed_tokens: 0,
                delay_cache_blocks: false,
                full_sequence_must_fit: false,
                reserved_blocks: 0,
                has_scheduled_reqs: true,
            };
            match me.allocate_inner(slf, py, &request?, args, list.map(|l| (l, i)))? {
                None => break,
                Some(ids) if allow_none && ids.is_empty() => out.append(py.None())?,
                Some(ids) => out.append(PyTuple::new(py, [PyList::new(py, ids)?])?)?,
            }
        }
        Ok(out)
    }

    /// SPEC MGR-20.
    /// The request's `retention_priority` / `retention_ttl_s` (kvcore extension), or
    /// `retention` when given, place its cached blocks in the free queue.
    #[pyo3(signature = (request, retention = None))]
    fn free(
        slf: &Bound<'_, Self>,
        py: Python<'_>,
        request: &Bound<'_, PyAny>,
        retention: Option<&Bound<'_, PyRetention>>,
    ) -> PyResult<()> {
        // The request's fields and the clock are read before the manager is held.
        let id = Self::request_id(request)?;
        let retention = match retention {
            Some(r) => r.get().retention(),
            None => request_retention(request)?,
        };
        let now = if retention.ttl_s().is_some() {
            PyBlockPool::now(Self::pool_of(slf)?.bind(py))?
        } else {
            0.0
        };
        let mut core = lock(slf, "manager")?;
        let mut pool = lock(slf.get().pool.bind(py), "pool")?;
        Ok(core
            .tables
            .free_retained(pool.core_mut(), &id_key(&id)?, retention, now)
            .map(|()| pool.note_deadlines())
            .map_err(Error::Pool)?)
    }

    /// SPEC MGR-21: the request's blocks in allocation order, not freed.
    fn pop_blocks_for_free(
        slf: &Bound<'_, Self>,
        request: &Bound<'_, PyAny>,
    ) -> PyResult<Vec<BlockId>> {
        let id = Self::request_id(request)?;
        let key = id_key(&id)?;
        Ok(lock(slf, "manager")?.tables.pop(&key))
    }

    /// SPEC MGR-25.
    fn get_blocks(
        slf: &Bound<'_, Self>,
        py: Python<'_>,
        request_id: &Bound<'_, PyAny>,
    ) -> PyResult<PyObject> {
        let id = id_key(request_id_of(request_id)?)?;
        let ids = lock(slf, "manager")?.tables.blocks(&id).to_vec();
        slf.get().make_blocks(py, &ids)
    }

    /// SPEC MGR-25: a fresh list per group.
    fn get_block_ids<'py>(
        slf: &Bound<'py, Self>,
        py: Python<'py>,
        request_id: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyTuple>> {
        let id = id_key(request_id_of(request_id)?)?;
        let ids = lock(slf, "manager")?.tables.blocks(&id).to_vec();
        PyTuple::new(py, [PyList::new(py, ids)?])
    }

    /// SPEC MGR-26 for a single full-attention group.
    fn get_block_ids_for_computed_tokens<'py>(
        slf: &Bound<'py, Self>,
        py: Python<'py>,
        request_id: &Bound<'py, PyAny>,
        num_computed_tokens: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyTuple>> {
        let id = id_key(request_id_of(request_id)?)?;
        let n = count_of(num_computed_tokens, "num_computed_tokens")?;
        let ids = lock(slf, "manager")?
            .block_ids_for_computed_tokens(&id, n)
            .to_vec();
        PyTuple::new(py, [PyList::new(py, ids)?])
    }

    /// SPEC FA-2 (one value: the only group).
    fn get_num_common_prefix_blocks(
        slf: &Bound<'_, Self>,
        py: Python<'_>,
        request_id: &Bound<'_, PyAny>,
    ) -> PyResult<Vec<usize>> {
        let id = id_key(request_id_of(request_id)?)?;
        let mut core = lock(slf, "manager")?;
        let pool = lock(slf.get().pool.bind(py), "pool")?;
        Ok(vec![core
            .tables
            .get_num_common_prefix_blocks(pool.core(), &id)])
    }

    /// SPEC STM-6 through the manager (MGR-27); the caller checks that caching is on.
    fn cache_blocks(
        slf: &Bound<'_, Self>,
        py: Python<'_>,
        request: &Bound<'_, PyAny>,
        num_computed_tokens: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let n = count_of(num_computed_tokens, "num_computed_tokens")?;
        let id_obj = Self::request_id(request)?;
        let id = id_key(&id_obj)?;
        let hashes = list_or_copy(&request.getattr(intern!(py, "block_hashes"))?)?;
        let mut core = lock(slf, "manager")?;
        // Refused before the core looks the request up (which creates its entry): a request
        // must hold the blocks it caches (the reference fails on the missing blocks with
        // IndexError when events are on, and caches nothing for them otherwise).
        let tables = &core.tables;
        let full = n / tables.block_size();
        let cached = tables.get(&id).and_then(|r| r.num_cached).unwrap_or(0);
        if cached < full && tables.blocks(&id).len() < full {
            return Err(to_pyerr(PoolError::MissingBlocks(format!(
                "request {id_obj} holds {} blocks, fewer than the {full} full ones",
                tables.blocks(&id).len()
            ))));
        }
        let len = hashes.len()?;
        let mut get = |i: usize| -> Result<BlockHash, Error> { Ok(to_hash(&hashes.get_item(i)?)?) };
        let mut meta = |req: &MetaRequest<'_>| -> Result<StoredMeta, Error> {
            Ok(stored_meta(py, request, req)?)
        };
        let mut pool = lock(slf.get().pool.bind(py), "pool")?;
        Ok(core.tables.cache_blocks::<Error>(
            pool.core_mut(),
            &id,
            n,
            HashSource {
                len: &mut || Ok(len),
                get: &mut get,
            },
            &mut meta,
        )?)
    }

    /// SPEC MGR-29.
    fn take_new_block_ids(slf: &Bound<'_, Self>) -> PyResult<Vec<BlockId>> {
        Ok(lock(slf, "manager")?.tables.take_new_block_ids())
    }

    /// Number of requests with a block-table entry (`len(req_to_blocks)`).
    fn num_requests(slf: &Bound<'_, Self>) -> PyResult<usize> {
        Ok(lock(slf, "manager")?.tables.num_entries())
    }

    /// Whether the request is running (has a cached-block count).
    fn is_running(slf: &Bound<'_, Self>, request_id: &Bound<'_, PyAny>) -> PyResult<bool> {
        let id = id_key(request_id_of(request_id)?)?;
        Ok(lock(slf, "manager")?.tables.is_running(&id))
    }

    /// The request's cached-block count, or None when it is not running.
    fn num_cached_blocks(
        slf: &Bound<'_, Self>,
        request_id: &Bound<'_, PyAny>,
    ) -> PyResult<Option<usize>> {
        let id = id_key(request_id_of(request_id)?)?;
        Ok(lock(slf, "manager")?
            .tables
            .get(&id)
            .and_then(|r| r.num_cached))
    }
}

//! `kvcore._native.UnitaryFullAttention`: the request-facing calls of a model whose only
//! KV-cache group is full attention, one boundary crossing per call. `kvcore.KVCacheManager`
//! routes every call here for that configuration (the common case) and keeps its Python
//! coordinators for the others.

use kvcore_core::events::{MetaRequest, StoredMeta};
use kvcore_core::full_attention::{AllocateArgs, RequestView, UnitaryFullAttention};
use kvcore_core::hash::BlockHash;
use kvcore_core::pool::{BlockId, HashSource};
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyList, PyString, PyTuple};

use crate::errors::{invalid, Error};
use crate::pool::{cached_prefix, stored_meta, to_hash, PyBlockPool};
use crate::request::{prefetch_ahead, CoreCast};

/// `RequestStatus.WAITING` and `RequestStatus.PREEMPTED` (SPEC REQ-3).
const WAITING: i64 = 1;
const PREEMPTED: i64 = 6;

fn count(v: i64, what: &str) -> PyResult<usize> {
    usize::try_from(v).map_err(|_| invalid(format!("{what} must be non-negative, got {v}")))
}

/// Per-call state of a unitary full-attention manager; see the module docs.
#[pyclass(module = "kvcore._native", name = "UnitaryFullAttention")]
pub struct PyUnitaryFullAttention {
    core: UnitaryFullAttention,
    pool: Py<PyBlockPool>,
    /// `kvcore.blocks.KVCacheBlocks`.
    blocks_cls: PyObject,
    /// The manager's shared empty result and its `.blocks` tuple (ALLOC-8's identity test).
    empty: PyObject,
    empty_blocks: PyObject,
    /// Recognises kvcore requests without pyo3's per-call type check.
    cast: CoreCast,
}

impl PyUnitaryFullAttention {
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
    fn allocate_inner<'py>(
        &mut self,
        py: Python<'py>,
        request: &Bound<'py, PyAny>,
        args: AllocateArgs<'_>,
    ) -> PyResult<Option<Vec<BlockId>>> {
        // A kvcore Request keeps these four fields in its native base: read them directly.
        let core = self.cast.borrow(request)?;
        let id_obj;
        let (id, num_tokens, num_computed, status) = if let Some(c) = &core {
            (
                c.id.as_str(),
                count(c.num_tokens, "num_tokens")?,
                count(c.num_computed_tokens, "num_computed_tokens")?,
                c.status_value,
            )
        } else {
            id_obj = Self::request_id(request)?;
            let num_tokens: usize = request.getattr(intern!(py, "num_tokens"))?.extract()?;
            let num_computed: usize = request
                .getattr(intern!(py, "num_computed_tokens"))?
                .extract()?;
            let status: i64 = if args.has_scheduled_reqs {
                request.getattr(intern!(py, "status"))?.extract()?
            } else {
                0
            };
            (id_obj.to_str()?, num_tokens, num_computed, status)
        };
        let waiting_or_preempted =
            args.has_scheduled_reqs && (status == WAITING || status == PREEMPTED);
        let hint = core.as_ref().and_then(|c| c.table_hint.get());
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
        let mirror = || *mirror_cell.get_or_init(|| core.as_ref()?.mirrored_hashes(py));
        // Otherwise the hash list is read lazily, only when blocks fill.
        let hashes_obj: std::cell::OnceCell<Bound<'_, PyAny>> = std::cell::OnceCell::new();
        let fetch = || -> PyResult<&Bound<'_, PyAny>> {
            if let Some(h) = hashes_obj.get() {
                return Ok(h);
            }
            let h = request.getattr(intern!(py, "block_hashes"))?;
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
        let mut meta = |req: &MetaRequest<'_>| -> Result<StoredMeta, Error> {
            Ok(stored_meta(py, request, req)?)
        };
        let mut pool = self.pool.try_borrow_mut(py)?;
        let res = self.core.allocate_slots::<Error>(
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
        let tables = &self.core.tables;
        let hint = match &core {
            Some(c) if !tables.hint_is_valid(hint) => {
                let fresh = tables.hint(id);
                c.table_hint.set(fresh);
                fresh
            }
            _ => hint,
        };
        Ok(res.map(|range| tables.blocks_hinted(id, hint)[range].to_vec()))
    }

    fn request_id<'py>(request: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyString>> {
        Ok(request
            .getattr(intern!(request.py(), "request_id"))?
            .downcast_into::<PyString>()?)
    }
}

#[pymethods]
impl PyUnitaryFullAttention {
    #[new]
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
    ) -> PyResult<Self> {
        let bs = count(block_size, "block_size")?;
        let mml = count(max_model_len, "max_model_len")?;
        let wm = count(watermark_blocks, "watermark_blocks")?;
        let core = UnitaryFullAttention::new(
            pool.try_borrow(py)?.core(),
            bs,
            record_new_block_ids,
            mml,
            wm,
            use_eagle,
        )
        .map_err(Error::Pool)?;
        let empty_blocks = empty.getattr(py, intern!(py, "blocks"))?;
        Ok(Self {
            core,
            pool,
            blocks_cls,
            empty,
            empty_blocks,
            cast: CoreCast::default(),
        })
    }

    /// SPEC MGR-6/7 without stats: `(hit blocks, hit tokens)`.
    fn get_computed_blocks(
        &self,
        py: Python<'_>,
        request: &Bound<'_, PyAny>,
    ) -> PyResult<(PyObject, usize)> {
        let pool = self.pool.try_borrow(py)?;
        if !pool.core().enable_caching()
            || request
                .getattr(intern!(py, "skip_reading_prefix_cache"))?
                .is_truthy()?
        {
            return Ok((self.empty.clone_ref(py), 0));
        }
        let bs = self.core.tables.block_size();
        let core = self.cast.borrow(request)?;
        let mirror = core.as_ref().and_then(|c| c.mirrored_hashes(py));
        let mut hit = match (&core, mirror) {
            (Some(c), Some(m)) => {
                let max_blocks = count(c.num_tokens, "num_tokens")?.saturating_sub(1) / bs;
                let walk = m.iter().take(max_blocks).copied();
                pool.core()
                    .longest_cached_prefix(walk, &[0])
                    .pop()
                    .unwrap_or_default()
            }
            _ => {
                let num_tokens: usize = request.getattr(intern!(py, "num_tokens"))?.extract()?;
                let hashes = request.getattr(intern!(py, "block_hashes"))?;
                let max_blocks = num_tokens.saturating_sub(1) / bs;
                cached_prefix(pool.core(), &hashes, max_blocks, &[0], 1)?
                    .pop()
                    .unwrap_or_default()
            }
        };
        if self.core.use_eagle() && !hit.is_empty() {
            hit.pop();
        }
        let tokens = hit.len() * self.core.tables.block_size();
        Ok((self.make_blocks(py, &hit)?, tokens))
    }

    /// SPEC ALLOC-1..12 in one call; see `KVCacheManager.allocate_slots`.
    #[pyo3(signature = (request, num_new_tokens, num_new_computed_tokens = 0, new_computed_blocks = None, num_lookahead_tokens = 0, num_external_computed_tokens = 0, delay_cache_blocks = false, num_encoder_tokens = 0, full_sequence_must_fit = false, reserved_blocks = 0, has_scheduled_reqs = true))]
    #[allow(clippy::too_many_arguments)]
    fn allocate_slots(
        &mut self,
        py: Python<'_>,
        request: &Bound<'_, PyAny>,
        num_new_tokens: i64,
        num_new_computed_tokens: i64,
        new_computed_blocks: Option<&Bound<'_, PyAny>>,
        num_lookahead_tokens: i64,
        num_external_computed_tokens: i64,
        delay_cache_blocks: bool,
        num_encoder_tokens: i64,
        full_sequence_must_fit: bool,
        reserved_blocks: i64,
        has_scheduled_reqs: bool,
    ) -> PyResult<Option<PyObject>> {
        let _ = count(num_encoder_tokens, "num_encoder_tokens")?;
        if reserved_blocks < 0 {
            return Err(invalid("reserved_blocks must be non-negative"));
        }
        // Hits: None or the shared empty instance mean "no hits object" (ALLOC-8).
        let mut hit_ids: Vec<BlockId> = Vec::new();
        let mut hits_given = false;
        if let Some(ncb) = new_computed_blocks.filter(|o| !o.is_none()) {
            let groups = ncb.getattr(intern!(py, "blocks"))?;
            if !groups.is(&self.empty_blocks) {
                hits_given = true;
                if groups.len()? != 1 {
                    return Err(invalid(
                        "new_computed_blocks must hold exactly one group for this manager",
                    ));
                }
                let pool = self.pool.try_borrow(py)?;
                for b in groups.get_item(0)?.try_iter()? {
                    let id: i64 = b?.extract()?;
                    hit_ids.push(pool.core().check_id(id).map_err(Error::Pool)?);
                }
            }
        }
        let args = AllocateArgs {
            num_new_tokens: count(num_new_tokens, "num_new_tokens")?,
            num_new_computed_tokens: count(num_new_computed_tokens, "num_new_computed_tokens")?,
            new_computed_blocks: hits_given.then_some(hit_ids.as_slice()),
            num_lookahead_tokens: count(num_lookahead_tokens, "num_lookahead_tokens")?,
            num_external_computed_tokens: count(
                num_external_computed_tokens,
                "num_external_computed_tokens",
            )?,
            delay_cache_blocks,
            full_sequence_must_fit,
            reserved_blocks,
            has_scheduled_reqs,
        };
        match self.allocate_inner(py, request, args)? {
            None => Ok(None),
            Some(ids) => Ok(Some(self.make_blocks(py, &ids)?)),
        }
    }

    /// `allocate_slots(request, n, num_lookahead_tokens=num_lookahead_tokens)` for each pair
    /// in order, stopping at the first request that does not fit; see
    /// `KVCacheManager.allocate_slots_batch`.
    #[pyo3(signature = (requests, num_new_tokens, num_lookahead_tokens = 0, allow_none = false))]
    fn allocate_slots_batch<'py>(
        &mut self,
        py: Python<'py>,
        requests: &Bound<'py, PyAny>,
        num_new_tokens: &Bound<'py, PyAny>,
        num_lookahead_tokens: i64,
        allow_none: bool,
    ) -> PyResult<Bound<'py, PyList>> {
        let lookahead = count(num_lookahead_tokens, "num_lookahead_tokens")?;
        let counts = num_new_tokens
            .try_iter()?
            .map(|n| count(n?.extract::<i64>()?, "num_new_tokens"))
            .collect::<PyResult<Vec<usize>>>()?;
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
            if let Some(list) = list {
                let tables = &self.core.tables;
                prefetch_ahead(list, i, &self.cast, |c| {
                    tables.prefetch_slot(c.table_hint.get());
                });
            }
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
            match self.allocate_inner(py, &request?, args)? {
                None => break,
                Some(ids) if allow_none && ids.is_empty() => out.append(py.None())?,
                Some(ids) => out.append(PyTuple::new(py, [PyList::new(py, ids)?])?)?,
            }
        }
        Ok(out)
    }

    /// SPEC MGR-20.
    fn free(&mut self, py: Python<'_>, request: &Bound<'_, PyAny>) -> PyResult<()> {
        let id = Self::request_id(request)?;
        let mut pool = self.pool.try_borrow_mut(py)?;
        Ok(self
            .core
            .tables
            .free(pool.core_mut(), id.to_str()?)
            .map_err(Error::Pool)?)
    }

    /// SPEC MGR-21: the request's blocks in allocation order, not freed.
    fn pop_blocks_for_free(&mut self, request: &Bound<'_, PyAny>) -> PyResult<Vec<BlockId>> {
        let id = Self::request_id(request)?;
        Ok(self.core.tables.pop(id.to_str()?))
    }

    /// SPEC MGR-25.
    fn get_blocks(&self, py: Python<'_>, request_id: &str) -> PyResult<PyObject> {
        self.make_blocks(py, self.core.tables.blocks(request_id))
    }

    /// SPEC MGR-25: a fresh list per group.
    fn get_block_ids<'py>(
        &self,
        py: Python<'py>,
        request_id: &str,
    ) -> PyResult<Bound<'py, PyTuple>> {
        let list = PyList::new(py, self.core.tables.blocks(request_id))?;
        PyTuple::new(py, [list])
    }

    /// SPEC MGR-26 for a single full-attention group.
    fn get_block_ids_for_computed_tokens<'py>(
        &self,
        py: Python<'py>,
        request_id: &str,
        num_computed_tokens: i64,
    ) -> PyResult<Bound<'py, PyTuple>> {
        let n = count(num_computed_tokens, "num_computed_tokens")?;
        let blocks = self.core.tables.blocks(request_id);
        let keep = n.div_ceil(self.core.tables.block_size()).min(blocks.len());
        PyTuple::new(py, [PyList::new(py, &blocks[..keep])?])
    }

    /// SPEC FA-2 (one value: the only group).
    fn get_num_common_prefix_blocks(
        &mut self,
        py: Python<'_>,
        request_id: &str,
    ) -> PyResult<Vec<usize>> {
        let pool = self.pool.try_borrow(py)?;
        Ok(vec![self
            .core
            .tables
            .get_num_common_prefix_blocks(pool.core(), request_id)])
    }

    /// SPEC STM-6 through the manager (MGR-27); the caller checks that caching is on.
    fn cache_blocks(
        &mut self,
        py: Python<'_>,
        request: &Bound<'_, PyAny>,
        num_computed_tokens: i64,
    ) -> PyResult<()> {
        let n = count(num_computed_tokens, "num_computed_tokens")?;
        let id_obj = Self::request_id(request)?;
        let id = id_obj.to_str()?;
        let hashes = request.getattr(intern!(py, "block_hashes"))?;
        let len = hashes.len()?;
        let mut get = |i: usize| -> Result<BlockHash, Error> { Ok(to_hash(&hashes.get_item(i)?)?) };
        let mut meta = |req: &MetaRequest<'_>| -> Result<StoredMeta, Error> {
            Ok(stored_meta(py, request, req)?)
        };
        let mut pool = self.pool.try_borrow_mut(py)?;
        Ok(self.core.tables.cache_blocks::<Error>(
            pool.core_mut(),
            id,
            n,
            HashSource {
                len: &mut || Ok(len),
                get: &mut get,
            },
            &mut meta,
        )?)
    }

    /// SPEC MGR-29.
    fn take_new_block_ids(&mut self) -> Vec<BlockId> {
        self.core.tables.take_new_block_ids()
    }

    /// Number of requests with a block-table entry (`len(req_to_blocks)`).
    fn num_requests(&self) -> usize {
        self.core.tables.num_entries()
    }

    /// Whether the request is running (has a cached-block count).
    fn is_running(&self, request_id: &str) -> bool {
        self.core.tables.is_running(request_id)
    }

    /// The request's cached-block count, or None when it is not running.
    fn num_cached_blocks(&self, request_id: &str) -> Option<usize> {
        self.core.tables.get(request_id).and_then(|r| r.num_cached)
    }
}

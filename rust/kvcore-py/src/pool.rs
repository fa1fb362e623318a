//! `kvcore.BlockPool`: the Python face of [`kvcore_core::pool::BlockPool`].
//!
//! A block is its `int` id. Methods convert their arguments, call the core once and convert the
//! result; a batch of ids crosses the boundary as one list.

use kvcore_core::events::{Carried, MetaRequest, StoredMeta, TokenIds};
use kvcore_core::hash::BlockHash;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use kvcore_core::pool::retention::{Retention, DEFAULT_PRIORITY};
use kvcore_core::pool::{BlockId, BlockPool, HashSource};
use kvcore_core::PoolError;
use pyo3::exceptions::{PyAssertionError, PyIndexError, PyTypeError};
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::sync::GILOnceCell;
use pyo3::types::{PyBool, PyBytes, PyInt, PyList, PySlice, PyTuple};

use crate::args::{all_exact_i64s, exact_i64s, group_id_of, int_of, Flag, Int};
use crate::errors::{error, invalid, to_pyerr, type_error, Error, Kind};
use crate::events::{events_to_py, py_to_value, use_int_hashes, EventStyle};
use crate::plain::Fields;
use crate::request::PyRequestCore;
use crate::sync::{lock, GilCell, Guarded};

/// `v` as the id of a block of a pool of `num_blocks` blocks, if it names one.
#[inline]
fn in_pool(num_blocks: usize, v: i64) -> Option<BlockId> {
    (v >= 0 && (v as u64) < num_blocks as u64).then_some(v as BlockId)
}

/// One block id of a pool of `num_blocks` blocks: `BlockIdError` for an int that names no
/// block (of any size: the reference has no such block), `ArgumentTypeError` for a non-int.
#[inline]
fn block_id_of(num_blocks: usize, item: &Bound<'_, PyAny>) -> PyResult<BlockId> {
    match int_of(item, "a block id")? {
        Int::V(v) => in_pool(num_blocks, v).ok_or_else(|| {
            to_pyerr(PoolError::BlockOutOfRange {
                block_id: v,
                num_blocks,
            })
        }),
        _ => Err(error(
            Kind::BlockId,
            format!("block id {item} is out of range for a pool of {num_blocks} blocks"),
        )),
    }
}

/// Reads a sequence or iterable of block ids into core ids, checking their range against a
/// pool of `num_blocks` blocks.
pub(crate) fn extract_ids(num_blocks: usize, obj: &Bound<'_, PyAny>) -> PyResult<Vec<BlockId>> {
    if let Ok(list) = obj.downcast::<PyList>() {
        if let Some(ids) = exact_i64s(list, 0, crate::args::list_len(list)).and_then(|values| {
            values
                .into_iter()
                .map(|v| in_pool(num_blocks, v))
                .collect::<Option<Vec<BlockId>>>()
        }) {
            return Ok(ids);
        }
        // With the errors (a bad id, a non-int).
        let mut out = Vec::with_capacity(crate::args::list_len(list));
        for item in list.iter() {
            out.push(block_id_of(num_blocks, &item)?);
        }
        return Ok(out);
    }
    if let Ok(t) = obj.downcast::<PyTuple>() {
        let mut out = Vec::with_capacity(t.len());
        for item in t.iter() {
            out.push(block_id_of(num_blocks, &item)?);
        }
        return Ok(out);
    }
    let mut out = Vec::new();
    for item in obj.try_iter()? {
        out.push(block_id_of(num_blocks, &item?)?);
    }
    Ok(out)
}

/// Reads the ids of `evict_blocks` from an iterable, keeping their order, each checked as it
/// is read (the reference checks and evicts id by id): any id outside the pool, of any size,
/// is a `BlockIdError` (SPEC POOL-20: the reference asserts on an id at or above the pool size
/// and fails to index one below minus its size; kvcore also refuses the negative ids the
/// reference reads from the end).
fn extract_evict_ids(num_blocks: usize, obj: &Bound<'_, PyAny>) -> PyResult<Vec<i64>> {
    let mut out = Vec::new();
    for item in obj.try_iter()? {
        out.push(i64::from(block_id_of(num_blocks, &item?)?));
    }
    Ok(out)
}

/// The full-attention hit walk (SPEC FA-1) over a Python sequence of hashes: entry
/// `(i + 1) * stride - 1` for block `i < max_blocks`, read lazily so the walk stops reading at
/// the first miss. Returns one list per group.
pub fn cached_prefix(
    pool: &BlockPool,
    block_hashes: &Bound<'_, PyAny>,
    max_blocks: usize,
    group_ids: &[u32],
    stride: usize,
) -> PyResult<Vec<Vec<u32>>> {
    let n = (block_hashes.len()? / stride).min(max_blocks);
    let mut out: Vec<Vec<u32>> = vec![Vec::new(); group_ids.len()];
    for i in 0..n {
        let h = to_hash(&block_hashes.get_item((i + 1) * stride - 1)?)?;
        match pool.get_cached_block(&h, group_ids) {
            Some(found) => {
                for (dst, b) in out.iter_mut().zip(found) {
                    dst.push(b);
                }
            }
            None => break,
        }
    }
    Ok(out)
}

/// The pool's size, read under a borrow that ends at once.
fn num_blocks(slf: &Bound<'_, PyBlockPool>) -> PyResult<usize> {
    Ok(lock(slf, "pool")?.inner.num_blocks())
}

/// Converts a digest from Python bytes.
pub fn to_hash(obj: &Bound<'_, PyAny>) -> PyResult<BlockHash> {
    let b = obj
        .downcast::<PyBytes>()
        .map_err(|_| type_error("a block hash", "bytes", obj))?
        .as_bytes();
    BlockHash::from_slice(b).ok_or_else(|| to_pyerr(PoolError::InvalidHash(b.len())))
}

fn non_negative(v: i64, what: &str) -> PyResult<usize> {
    usize::try_from(v).map_err(|_| invalid(format!("{what} must be non-negative, got {v}")))
}

/// Request fields that events need (SPEC POOL-17, POOL-30).
pub fn stored_meta(
    py: Python<'_>,
    request: &Bound<'_, PyAny>,
    req: &MetaRequest<'_>,
) -> PyResult<StoredMeta> {
    let token_range = req.token_range;
    let extra_ranges = req.block_ranges;
    let first_mm_idx = req.first_mm_idx;
    let native = match request.downcast::<PyRequestCore>() {
        Ok(core) => core
            .try_borrow()?
            .int_window(token_range.0..token_range.1)
            .map(<[i64]>::to_vec),
        Err(_) => None,
    };
    let token_ids: Vec<i64> = match native {
        Some(window) => window,
        // A duck-typed request, or a range the buffer does not hold: as the reference, by slicing.
        _ => request
            .getattr(intern!(py, "all_token_ids"))?
            .get_item(PySlice::new(
                py,
                token_range.0 as isize,
                token_range.1 as isize,
                1,
            ))?
            .extract()?,
    };
    let lora = request.getattr(intern!(py, "lora_request"))?;
    let (lora_id, lora_name) = if lora.is_truthy()? {
        (
            lora.getattr(intern!(py, "adapter_id"))?
                .extract::<Option<i64>>()?,
            lora.getattr(intern!(py, "name"))?
                .extract::<Option<String>>()?,
        )
    } else {
        (None, None)
    };
    let mut meta = tokens_meta(token_ids.into(), req);
    meta.lora_id = lora_id;
    meta.lora_name = lora_name;
    if needs_extra_keys(py, request)? {
        let mut extra = Vec::with_capacity(extra_ranges.len());
        let gen = EXTRA_KEYS.get(py).ok_or_else(|| {
            invalid("no extra-key function is registered (import kvcore.hashing first)")
        })?;
        let gen = gen.bind(py);
        let mut mm_idx = first_mm_idx;
        for &(s, e) in extra_ranges {
            let out = gen.call1((request, s, e, mm_idx))?;
            let (keys, next): (Bound<'_, PyAny>, i64) = out.extract()?;
            mm_idx = next;
            extra.push(if keys.is_none() {
                None
            } else {
                Some(py_to_value(&keys)?)
            });
        }
        meta.extra_keys = (!extra.is_empty()).then_some(extra);
    }
    Ok(meta)
}

/// The metadata of blocks of `token_ids` with no LoRA and no extra keys.
pub(crate) fn tokens_meta(token_ids: TokenIds, req: &MetaRequest<'_>) -> StoredMeta {
    let n = req.block_ranges.len();
    StoredMeta {
        token_ids,
        lora_id: None,
        lora_name: None,
        extra_keys: (n > 0).then(|| vec![None; n]),
    }
}

/// [`stored_meta`] for a request whose only event field is its token list
/// ([`Fields::tokens_only`]): the range's tokens, sliced as the reference slices. The slice
/// itself is carried to the event (its ints are not made again), once every item is checked
/// to be an int64 as [`stored_meta`] reads it.
pub(crate) fn tokens_only_meta(
    tokens: &Bound<'_, PyList>,
    base: Option<&crate::plain::PlainState>,
    req: &MetaRequest<'_>,
) -> PyResult<StoredMeta> {
    let (start, end) = req.token_range;
    if let Some(held) = base.and_then(|b| b.take_window(tokens, start, end)) {
        return Ok(tokens_meta(
            TokenIds::Carried(Carried::new(TokenObjs(held))),
            req,
        ));
    }
    let slice = tokens.get_slice(start, end);
    if !all_exact_i64s(tokens, start, end) {
        // Anything else as `stored_meta` reads it (an int subclass, or the error).
        let ids: Vec<i64> = slice.extract()?;
        return Ok(tokens_meta(ids.into(), req));
    }
    if base.is_some() {
        crate::plain::PlainState::want_windows();
    }
    Ok(tokens_meta(
        TokenIds::Carried(Carried::new(slice.unbind())),
        req,
    ))
}

/// A request's token objects, in order, as a call took them from its token window
/// ([`crate::plain::PlainState::take_window`]): the items a slice of its list would hold.
struct TokenObjs(Vec<Py<PyAny>>);

/// The token ids of an event: its carried list or objects ([`tokens_only_meta`]), moved out
/// when the event is their only holder, or a list of its ids.
pub(crate) fn token_ids_into_py(py: Python<'_>, ids: TokenIds) -> PyResult<Bound<'_, PyAny>> {
    match ids {
        TokenIds::Ids(v) => Ok(PyList::new(py, v)?.into_any()),
        TokenIds::Carried(c) => match c.try_take::<Py<PyList>>() {
            Ok(list) => Ok(list.into_bound(py).into_any()),
            Err(c) => match c.try_take::<TokenObjs>() {
                Ok(objs) => Ok(PyList::new(py, objs.0)?.into_any()),
                Err(shared) => Ok(carried_list(py, &shared)?.into_any()),
            },
        },
    }
}

/// The token list [`tokens_only_meta`] carries (a new list of the objects it took from a
/// window).
fn carried_list<'py>(py: Python<'py>, c: &Carried) -> PyResult<Bound<'py, PyList>> {
    if let Some(l) = c.get::<Py<PyList>>() {
        return Ok(l.bind(py).clone());
    }
    if let Some(objs) = c.get::<TokenObjs>() {
        return PyList::new(py, objs.0.iter().map(|o| o.bind(py)));
    }
    Err(invalid(
        "an event carries token ids the bindings did not make",
    ))
}

/// A positive count.
fn positive(v: i64, what: &str) -> PyResult<usize> {
    usize::try_from(v)
        .ok()
        .filter(|&b| b > 0)
        .ok_or_else(|| invalid(format!("{what} must be positive, got {v}")))
}

/// `obj` itself when it is a list or a tuple (indexing one runs no Python code, so it may be
/// read while the pool or a manager is held), else a list copied from it.
pub(crate) fn list_or_copy<'py>(obj: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyAny>> {
    if obj.is_instance_of::<PyList>() || obj.is_instance_of::<PyTuple>() {
        return Ok(obj.clone());
    }
    let items = obj.try_iter()?.collect::<PyResult<Vec<_>>>()?;
    Ok(PyList::new(obj.py(), items)?.into_any())
}

/// `read` of item `i` of a sequence (`seq[i]`): an exact list's or tuple's item borrowed where
/// it sits (no index int made, no Python code run, its reference count not touched: with
/// thousands of requests an item's object has left the caches, and its count may sit on a
/// line the read does not need), any other sequence's through the sequence protocol. `read`
/// must run no Python code: it borrows the item.
#[inline]
pub(crate) fn read_seq_item<'py, R>(
    seq: &Bound<'py, PyAny>,
    i: usize,
    read: impl FnOnce(&Bound<'py, PyAny>) -> PyResult<R>,
) -> PyResult<R> {
    let py = seq.py();
    let Ok(at) = pyo3::ffi::Py_ssize_t::try_from(i) else {
        return read(&seq.get_item(i)?);
    };
    #[allow(unsafe_code)]
    // SAFETY: the GIL is held (`py`) and `seq` is a live exact list or tuple; the C getters
    // return the sequence's own (borrowed) reference to item `i`, or NULL with an
    // `IndexError` set when `i` is out of range (taken into the result). `read` runs no
    // Python code (its contract) and the borrow ends with it, so the item cannot be dropped
    // meanwhile.
    unsafe {
        let item = if seq.is_exact_instance_of::<PyList>() {
            pyo3::ffi::PyList_GetItem(seq.as_ptr(), at)
        } else if seq.is_exact_instance_of::<PyTuple>() {
            pyo3::ffi::PyTuple_GetItem(seq.as_ptr(), at)
        } else {
            return read(&seq.get_item(i)?);
        };
        if item.is_null() {
            return Err(PyErr::fetch(py));
        }
        read(&pyo3::Borrowed::from_ptr(py, item))
    }
}

/// `len(seq)`: an exact list's or tuple's read directly, any other through `len`.
#[inline]
pub(crate) fn seq_len(seq: &Bound<'_, PyAny>) -> PyResult<usize> {
    if let Ok(list) = seq.downcast_exact::<PyList>() {
        return Ok(crate::args::list_len(list));
    }
    if let Ok(tuple) = seq.downcast_exact::<PyTuple>() {
        return Ok(tuple.len());
    }
    seq.len()
}

/// Entry `i` of a hash sequence as a lookup key: `None` for bytes no block can be stored
/// under (a miss, as `get_cached_block` answers).
fn read_hash(hashes: &Bound<'_, PyAny>, i: usize) -> PyResult<Option<BlockHash>> {
    read_seq_item(hashes, i, |item| {
        let b = item
            .downcast::<PyBytes>()
            .map_err(|_| type_error("block_hash", "bytes", item))?;
        Ok(BlockHash::from_slice(b.as_bytes()))
    })
}

/// The Python function that computes a block's extra keys (SPEC XK-1), which
/// `kvcore.hashing` registers when it is imported: the bindings never import the package.
static EXTRA_KEYS: GILOnceCell<PyObject> = GILOnceCell::new();

/// Registers the extra-key function events use: `fn(request, start, end, start_mm_idx) ->
/// (keys or None, next_mm_idx)`. The first registration stays.
#[pyfunction]
pub fn register_extra_keys_fn(py: Python<'_>, func: PyObject) -> PyResult<()> {
    if !func.bind(py).is_callable() {
        return Err(type_error(
            "the extra-key function",
            "callable",
            func.bind(py),
        ));
    }
    let _ = EXTRA_KEYS.set(py, func);
    Ok(())
}

/// The part of `full` (the metadata of `full_range`, with one extra-key entry per range of
/// `full_blocks`) that `req` describes: its token window and the extra keys of its blocks.
fn sub_meta(
    py: Python<'_>,
    full: &StoredMeta,
    full_range: (usize, usize),
    full_blocks: &[(usize, usize)],
    req: &MetaRequest<'_>,
) -> PyResult<StoredMeta> {
    if req.token_range == full_range && req.block_ranges == full_blocks {
        return Ok(full.clone());
    }
    let lo = req.token_range.0.saturating_sub(full_range.0);
    let hi = req.token_range.1.saturating_sub(full_range.0);
    let token_ids = match &full.token_ids {
        TokenIds::Ids(ids) => TokenIds::Ids(ids.get(lo..hi.min(ids.len())).unwrap_or(&[]).to_vec()),
        TokenIds::Carried(c) => TokenIds::Carried(Carried::new(
            carried_list(py, c)?.get_slice(lo, hi).unbind(),
        )),
    };
    let extra_keys = full.extra_keys.as_ref().map(|keys| {
        full_blocks
            .iter()
            .zip(keys)
            .filter(|(r, _)| req.block_ranges.contains(r))
            .map(|(_, k)| k.clone())
            .collect::<Vec<_>>()
    });
    Ok(StoredMeta {
        token_ids,
        lora_id: full.lora_id,
        lora_name: full.lora_name.clone(),
        extra_keys: extra_keys.filter(|k| !k.is_empty()),
    })
}

/// `getattr(obj, name, None)` that lets other errors through.
pub(crate) fn get_opt<'py>(
    py: Python<'py>,
    obj: &Bound<'py, PyAny>,
    name: &Bound<'py, pyo3::types::PyString>,
) -> PyResult<Option<Bound<'py, PyAny>>> {
    match obj.getattr(name) {
        Ok(v) => Ok(Some(v)),
        Err(e) if e.is_instance_of::<pyo3::exceptions::PyAttributeError>(py) => Ok(None),
        Err(e) => Err(e),
    }
}

/// SPEC XK-3, plus prompt embeddings (which add a key to every block, XK-1).
fn needs_extra_keys(py: Python<'_>, request: &Bound<'_, PyAny>) -> PyResult<bool> {
    if let Some(mm) = get_opt(py, request, intern!(py, "mm_features"))? {
        if mm.is_truthy()? {
            return Ok(true);
        }
    }
    for name in [
        intern!(py, "lora_request"),
        intern!(py, "cache_salt"),
        intern!(py, "prompt_embeds"),
    ] {
        if let Some(v) = get_opt(py, request, name)? {
            if !v.is_none() {
                return Ok(true);
            }
        }
    }
    Ok(false)
}

/// The KV-cache block pool (SPEC §4). A block is its `int` id; block 0 is the null block.
#[pyclass(module = "kvcore._native", name = "BlockPool", frozen)]
pub struct PyBlockPool {
    state: GilCell<PoolState>,
}

impl PyBlockPool {
    /// Whether the pool has queued events.
    pub(crate) fn has_pending_events(slf: &Bound<'_, Self>) -> PyResult<bool> {
        Ok(lock(slf, "pool")?.inner.has_pending_events())
    }

    /// Drains the event queue into Python events ([`events_to_py`]).
    pub(crate) fn drain_events(
        slf: &Bound<'_, Self>,
        py: Python<'_>,
        style: &EventStyle<'_>,
    ) -> PyResult<(Py<PyList>, Vec<u32>)> {
        if !lock(slf, "pool")?.inner.has_pending_events() {
            return Ok((PyList::empty(py).unbind(), Vec::new()));
        }
        // Read the hash form first: a bad environment value must leave the queue intact.
        let as_int = use_int_hashes(py)?;
        // Building the Python events can run Python code (a collection, finalizers, the
        // given classes) and so switch threads: the pool is not borrowed while it does.
        let events = lock(slf, "pool")?.inner.take_events();
        events_to_py(py, events, as_int, style)
    }
}

impl Guarded for PyBlockPool {
    type State = PoolState;
    fn cell(&self) -> &GilCell<PoolState> {
        &self.state
    }
}

/// The state of a [`PyBlockPool`], held by one call at a time ([`crate::sync`]).
pub struct PoolState {
    inner: BlockPool,
    /// The clock retention and pin deadlines are read from (`time.monotonic` when `None`).
    clock: Option<PyObject>,
    /// Whether a retention or pin deadline may exist (shared with the managers of this pool,
    /// which test it without borrowing the pool).
    deadlines: Arc<AtomicBool>,
}

/// `kvcore._native.Retention`: a validated retention priority and time to live, the form in
/// which a request's retention reaches `BlockPool.free_blocks` (kvcore extension).
#[pyclass(module = "kvcore._native", name = "Retention", frozen)]
pub struct PyRetention {
    inner: Retention,
}

#[pymethods]
impl PyRetention {
    #[new]
    #[pyo3(signature = (priority = None, ttl_s = None))]
    fn new(
        priority: Option<&Bound<'_, PyAny>>,
        ttl_s: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Self> {
        Ok(Self {
            inner: retention_of(priority, ttl_s)?,
        })
    }

    /// The priority, 0..=100 (50 when none was given).
    #[getter]
    fn priority(&self) -> u8 {
        self.inner.priority()
    }

    /// The time to live in seconds, or None.
    #[getter]
    fn ttl_s(&self) -> Option<f64> {
        self.inner.ttl_s()
    }

    /// Whether this is priority 50 without a time to live (the reference's LRU).
    #[getter]
    fn is_default(&self) -> bool {
        self.inner.is_default()
    }

    fn __repr__(&self) -> String {
        match self.inner.ttl_s() {
            Some(t) => format!("Retention(priority={}, ttl_s={t:?})", self.inner.priority()),
            None => format!("Retention(priority={}, ttl_s=None)", self.inner.priority()),
        }
    }
}

impl PyRetention {
    /// The core retention.
    pub fn retention(&self) -> Retention {
        self.inner
    }
}

/// Reads a retention priority (None: 50; an int, not a bool) and time to live (None, or a
/// real number of seconds, not a bool) into a validated [`Retention`].
pub(crate) fn retention_of(
    priority: Option<&Bound<'_, PyAny>>,
    ttl_s: Option<&Bound<'_, PyAny>>,
) -> PyResult<Retention> {
    let priority = match priority.filter(|p| !p.is_none()) {
        None => i64::from(DEFAULT_PRIORITY),
        Some(p) if p.is_instance_of::<PyBool>() => {
            return Err(type_error("retention_priority", "an int", p))
        }
        Some(p) => match int_of(p, "retention_priority")? {
            Int::V(v) => v,
            _ => i64::MAX,
        },
    };
    let ttl = seconds_of(ttl_s, "retention_ttl_s")?;
    Ok(Retention::new(priority, ttl).map_err(Error::Pool)?)
}

/// Reads an optional time to live: None, or a real number of seconds (not a bool). Its range
/// is the core's to check.
fn seconds_of(obj: Option<&Bound<'_, PyAny>>, what: &str) -> PyResult<Option<f64>> {
    match obj.filter(|t| !t.is_none()) {
        None => Ok(None),
        Some(t) if t.is_instance_of::<PyBool>() => Err(type_error(what, "a number of seconds", t)),
        Some(t) => t
            .extract::<f64>()
            .map(Some)
            .map_err(|_| type_error(what, "a number of seconds", t)),
    }
}

/// Reads a request's retention from its `retention_priority` and `retention_ttl_s`
/// attributes (missing ones count as None).
pub(crate) fn request_retention(request: &Fields<'_, '_>) -> PyResult<Retention> {
    let py = request.request().py();
    let given = |name| -> PyResult<Option<Bound<'_, PyAny>>> {
        Ok(request.opt(name)?.filter(|v| !v.is_none()))
    };
    let p = given(intern!(py, "retention_priority"))?;
    let t = given(intern!(py, "retention_ttl_s"))?;
    if p.is_none() && t.is_none() {
        return Ok(Retention::DEFAULT);
    }
    retention_of(p.as_ref(), t.as_ref())
}

/// Reads one hash list per group for `pin_prefix` / `unpin_prefix`.
fn pin_groups(groups: &Bound<'_, PyAny>) -> PyResult<Vec<(u32, Vec<BlockHash>)>> {
    let mut out = Vec::new();
    for item in groups.try_iter()? {
        let item = item?;
        let (g, hashes): (Bound<'_, PyAny>, Bound<'_, PyAny>) = item.extract()?;
        let g = group_id_of(&g)?;
        let mut hs = Vec::new();
        for h in hashes.try_iter()? {
            hs.push(to_hash(&h?)?);
        }
        out.push((g, hs));
    }
    Ok(out)
}

#[pymethods]
impl PyBlockPool {
    #[new]
    #[pyo3(
        signature = (num_gpu_blocks, enable_caching, hash_block_size, enable_kv_cache_events = Flag(false), metrics_collector = None),
        text_signature = "(num_gpu_blocks, enable_caching, hash_block_size, enable_kv_cache_events=False, metrics_collector=None)"
    )]
    fn new(
        py: Python<'_>,
        num_gpu_blocks: &Bound<'_, PyAny>,
        enable_caching: Flag,
        hash_block_size: &Bound<'_, PyAny>,
        enable_kv_cache_events: Flag,
        metrics_collector: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Self> {
        let (Flag(enable_caching), Flag(enable_kv_cache_events)) =
            (enable_caching, enable_kv_cache_events);
        if metrics_collector.is_some_and(|m| !m.is_none()) {
            return Err(invalid(
                "kvcore's BlockPool does not take a metrics collector",
            ));
        }
        if !num_gpu_blocks.is_instance_of::<PyInt>() {
            return Err(invalid(format!(
                "num_gpu_blocks must be an int, got {}",
                num_gpu_blocks.get_type().name()?
            )));
        }
        let n: i64 = num_gpu_blocks
            .extract()
            .map_err(|_| to_pyerr(PoolError::InvalidPoolSize(i64::MAX)))?;
        let hbs = match int_of(hash_block_size, "hash_block_size")? {
            Int::V(v) if v > 0 && v <= i64::from(u32::MAX) => v as usize,
            _ => {
                return Err(invalid(format!(
                    "hash_block_size must be between 1 and 2**32 - 1, got {hash_block_size}"
                )))
            }
        };
        let inner = py
            .allow_threads(|| BlockPool::new(n, enable_caching, hbs, enable_kv_cache_events))
            .map_err(Error::Pool)?;
        Ok(Self {
            state: GilCell::new(PoolState {
                inner,
                clock: None,
                deadlines: Arc::new(AtomicBool::new(false)),
            }),
        })
    }

    /// Number of blocks, the null block included.
    #[getter]
    fn num_gpu_blocks(slf: &Bound<'_, Self>) -> PyResult<usize> {
        let me = lock(slf, "pool")?;
        Ok(me.inner.num_blocks())
    }

    /// Whether prefix caching is on.
    #[getter]
    fn enable_caching(slf: &Bound<'_, Self>) -> PyResult<bool> {
        let me = lock(slf, "pool")?;
        Ok(me.inner.enable_caching())
    }

    /// Tokens per hash block.
    #[getter]
    fn hash_block_size(slf: &Bound<'_, Self>) -> PyResult<usize> {
        let me = lock(slf, "pool")?;
        Ok(me.inner.hash_block_size())
    }

    /// Whether KV events are recorded.
    #[getter]
    fn enable_kv_cache_events(slf: &Bound<'_, Self>) -> PyResult<bool> {
        let me = lock(slf, "pool")?;
        Ok(me.inner.events_enabled())
    }

    /// The null block's id (0).
    #[getter]
    fn null_block(_slf: &Bound<'_, Self>) -> u32 {
        BlockPool::null_block()
    }

    /// A read-only view of the blocks: `blocks[i]` describes block `i`.
    #[getter]
    fn blocks(slf: Py<Self>) -> BlockList {
        BlockList { pool: slf }
    }

    /// SPEC POOL-2, after any pin whose time ran out is released (kvcore extension).
    fn get_num_free_blocks(slf: &Bound<'_, Self>) -> PyResult<usize> {
        Self::expire_flagged(slf)?;
        let me = lock(slf, "pool")?;
        Ok(me.inner.get_num_free_blocks())
    }

    /// SPEC POOL-3, after any pin whose time ran out is released (kvcore extension).
    fn get_usage(slf: &Bound<'_, Self>, py: Python<'_>) -> PyResult<PyObject> {
        Self::expire_flagged(slf)?;
        let usage = lock(slf, "pool")?.inner.get_usage();
        Ok(match usage {
            Some(u) => u.into_pyobject(py)?.into_any().unbind(),
            None => 0i64.into_pyobject(py)?.into_any().unbind(),
        })
    }

    // Methods that return lists take `slf` and end their borrow before the result becomes a
    // Python object: allocating one can run a collection, whose finalizers can switch threads,
    // and another thread must then find the pool free.
    fn get_new_blocks(slf: &Bound<'_, Self>, num_blocks: &Bound<'_, PyAny>) -> PyResult<Vec<u32>> {
        let mut me = lock(slf, "pool")?;
        let free = me.inner.get_num_free_blocks();
        let n = match int_of(num_blocks, "num_blocks")? {
            Int::V(v) if v < 0 => return Err(to_pyerr(PoolError::NegativeCount(v))),
            Int::Below => {
                return Err(error(
                    Kind::InvalidArgument,
                    format!("count must be non-negative, got {num_blocks}"),
                ))
            }
            Int::V(v) if (v as u64) <= free as u64 => v as usize,
            // Checked here, before the core reserves room for the result (SPEC POOL-5).
            _ => {
                return Err(error(
                    Kind::NoFreeBlocks,
                    format!("cannot get {num_blocks} free blocks from the pool ({free} free)"),
                ))
            }
        };
        Ok(me.inner.get_new_blocks(n).map_err(Error::Pool)?)
    }

    fn touch(slf: &Bound<'_, Self>, blocks: &Bound<'_, PyAny>) -> PyResult<()> {
        let ids = extract_ids(num_blocks(slf)?, blocks)?;
        Ok(lock(slf, "pool")?.inner.touch(&ids).map_err(Error::Pool)?)
    }

    /// SPEC POOL-10; `retention` (kvcore extension) places the cached blocks by priority and
    /// time to live.
    #[pyo3(signature = (ordered_blocks, retention = None))]
    fn free_blocks(
        slf: &Bound<'_, Self>,
        ordered_blocks: &Bound<'_, PyAny>,
        retention: Option<&Bound<'_, PyRetention>>,
    ) -> PyResult<()> {
        let ids = extract_ids(num_blocks(slf)?, ordered_blocks)?;
        let retention = retention.map_or(Retention::DEFAULT, |r| r.get().inner);
        let now = if retention.ttl_s().is_some() {
            Self::now(slf)?
        } else {
            0.0
        };
        let mut me = lock(slf, "pool")?;
        me.inner
            .free_blocks_retained(ids.iter().copied(), retention, now)
            .map_err(Error::Pool)?;
        me.note_deadlines();
        Ok(())
    }

    /// The clock deadlines are read from (kvcore extension): a callable returning seconds, or
    /// None for `time.monotonic`.
    #[getter]
    fn get_clock(slf: &Bound<'_, Self>, py: Python<'_>) -> PyResult<Option<PyObject>> {
        let me = lock(slf, "pool")?;
        Ok(me.clock.as_ref().map(|c| c.clone_ref(py)))
    }

    #[setter]
    fn set_clock(slf: &Bound<'_, Self>, clock: Option<PyObject>) -> PyResult<()> {
        let mut me = lock(slf, "pool")?;
        me.clock = clock;
        Ok(())
    }

    /// Router-exact events (kvcore extension): `BlockStored` for a key's first block only,
    /// `BlockRemoved` when its last block leaves.
    #[getter]
    fn get_exact_router_events(slf: &Bound<'_, Self>) -> PyResult<bool> {
        let me = lock(slf, "pool")?;
        Ok(me.inner.exact_router_events())
    }

    #[setter]
    fn set_exact_router_events(slf: &Bound<'_, Self>, on: Flag) -> PyResult<()> {
        let mut me = lock(slf, "pool")?;
        me.inner.set_exact_router_events(on.0);
        Ok(())
    }

    /// Applies the retention and pin deadlines that are due by the clock (kvcore extension);
    /// reads the clock only when a deadline exists.
    fn expire(slf: &Bound<'_, Self>) -> PyResult<()> {
        Self::expire_due(slf)
    }

    /// Pins every cached copy of the leading hashes of each `(group_id, hashes)` (kvcore
    /// extension); returns per group how many leading hashes are pinned.
    #[pyo3(signature = (groups, ttl_s = None, max_pinned = usize::MAX))]
    fn pin_prefix(
        slf: &Bound<'_, Self>,
        groups: &Bound<'_, PyAny>,
        ttl_s: Option<&Bound<'_, PyAny>>,
        max_pinned: usize,
    ) -> PyResult<Vec<usize>> {
        let groups = pin_groups(groups)?;
        let ttl = seconds_of(ttl_s, "ttl_s")?;
        let now = if ttl.is_some() { Self::now(slf)? } else { 0.0 };
        let views: Vec<(u32, &[BlockHash])> =
            groups.iter().map(|(g, h)| (*g, h.as_slice())).collect();
        let mut me = lock(slf, "pool")?;
        let counts = me
            .inner
            .pin_prefix(&views, ttl, now, max_pinned)
            .map_err(Error::Pool)?;
        me.note_deadlines();
        Ok(counts)
    }

    /// Releases the pins of the leading hashes of each `(group_id, hashes)` (kvcore
    /// extension); returns per group how many leading hashes were released.
    fn unpin_prefix(slf: &Bound<'_, Self>, groups: &Bound<'_, PyAny>) -> PyResult<Vec<usize>> {
        let groups = pin_groups(groups)?;
        let views: Vec<(u32, &[BlockHash])> =
            groups.iter().map(|(g, h)| (*g, h.as_slice())).collect();
        Ok(lock(slf, "pool")?.inner.unpin_prefix(&views))
    }

    /// Number of pinned blocks (kvcore extension).
    #[getter]
    fn num_pinned_blocks(slf: &Bound<'_, Self>) -> PyResult<usize> {
        let me = lock(slf, "pool")?;
        Ok(me.inner.num_pinned_blocks())
    }

    /// Whether each block is pinned (kvcore extension).
    fn are_pinned(slf: &Bound<'_, Self>, block_ids: &Bound<'_, PyAny>) -> PyResult<Vec<bool>> {
        let ids = extract_ids(num_blocks(slf)?, block_ids)?;
        let me = lock(slf, "pool")?;
        Ok(ids.iter().map(|&b| me.inner.is_pinned(b)).collect())
    }

    /// Makes every cached block unfindable while requests run (kvcore extension).
    fn invalidate_prefix_cache(slf: &Bound<'_, Self>) -> PyResult<()> {
        let mut me = lock(slf, "pool")?;
        me.inner.invalidate_prefix_cache();
        Ok(())
    }

    #[pyo3(signature = (request, blocks, num_cached_blocks, num_full_blocks, block_size, kv_cache_group_id, block_mask = None))]
    #[allow(clippy::too_many_arguments)]
    fn cache_full_blocks(
        slf: &Bound<'_, Self>,
        py: Python<'_>,
        request: &Bound<'_, PyAny>,
        blocks: &Bound<'_, PyAny>,
        num_cached_blocks: &Bound<'_, PyAny>,
        num_full_blocks: &Bound<'_, PyAny>,
        block_size: &Bound<'_, PyAny>,
        kv_cache_group_id: &Bound<'_, PyAny>,
        block_mask: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        // SPEC POOL-13, with Python's comparison (counts of any size).
        if num_cached_blocks.ge(num_full_blocks)? {
            return Ok(());
        }
        let nc = int_of(num_cached_blocks, "num_cached_blocks")?;
        let nf = int_of(num_full_blocks, "num_full_blocks")?;
        if nc.is_negative() || nf.is_negative() {
            return Err(invalid(format!(
                "block counts must be non-negative, got num_cached_blocks={num_cached_blocks}, \
                 num_full_blocks={num_full_blocks}"
            )));
        }
        let (n_blocks, hbs, events) = {
            let me = lock(slf, "pool")?;
            (
                me.inner.num_blocks(),
                me.inner.hash_block_size(),
                me.inner.events_enabled(),
            )
        };
        // Everything the core needs from Python is read first, so that no Python code runs
        // while the pool is borrowed (another thread could then be refused).
        let range = py
            .get_type::<PySlice>()
            .call1((num_cached_blocks, num_full_blocks))?;
        let seq = blocks.get_item(range)?;
        let seq_len = seq.len()?;
        let block_mask: Option<Vec<bool>> = match block_mask.filter(|m| !m.is_none()) {
            None => None,
            Some(m) => {
                // SPEC POOL-14. Entries must be bools (the reference reads any object for its
                // truth value; kvcore refuses what is not a bool, a documented deviation).
                if m.len()? != seq_len {
                    return Err(to_pyerr(PoolError::MaskLength {
                        expected: seq_len,
                        got: m.len()?,
                    }));
                }
                Some(
                    m.try_iter()?
                        .map(|x| {
                            let x = x?;
                            x.downcast::<PyBool>()
                                .map(|b| b.is_true())
                                .map_err(|_| type_error("block_mask entries", "bools", &x))
                        })
                        .collect::<PyResult<Vec<bool>>>()?,
                )
            }
        };
        let bs = match int_of(block_size, "block_size")? {
            Int::V(v) if v > 0 && (v as u64).is_multiple_of(hbs as u64) => usize::try_from(v).ok(),
            Int::V(v) if v > 0 => {
                return Err(to_pyerr(PoolError::BlockSizeNotMultiple {
                    block_size: v as usize,
                    hash_block_size: hbs,
                }))
            }
            Int::Above => None,
            _ => {
                return Err(invalid(format!(
                    "block_size must be positive, got {block_size}"
                )))
            }
        };
        let (Some(bs), Int::V(nc), Int::V(nf)) = (bs, nc, nf) else {
            // A block size or a count beyond 64 bits: the hash view is shorter than the count
            // (SPEC POOL-15), or the block size is not a multiple of the hash block size.
            return Err(invalid(format!(
                "the request has too few block hashes for num_full_blocks={num_full_blocks} \
                 at block_size={block_size}"
            )));
        };
        let (num_cached, num_full) = (nc as usize, nf as usize);
        if seq_len != num_full - num_cached {
            return Err(invalid(format!(
                "the request holds fewer than num_full_blocks={num_full} blocks"
            )));
        }
        // SPEC POOL-15, then the blocks (the reference reads them after its checks).
        let fine = request.getattr(intern!(py, "block_hashes"))?;
        let k = bs / hbs;
        let view_len = fine.len()? / k;
        if view_len < num_full {
            return Err(to_pyerr(PoolError::NotEnoughHashes {
                needed: num_full,
                available: view_len,
            }));
        }
        let new_ids = extract_ids(n_blocks, &seq)?;
        let first = if events {
            num_cached.saturating_sub(1)
        } else {
            num_cached
        };
        let mut hashes = Vec::new();
        for i in first..num_full {
            hashes.push(to_hash(&fine.get_item((i + 1) * k - 1)?)?);
        }
        // Read when the reference first builds a key (after the checks above).
        let kv_cache_group_id = group_id_of(kv_cache_group_id)?;
        let mask_ok = block_mask.as_ref().is_none_or(|m| m.len() == new_ids.len());
        let ranges: Vec<(usize, usize)> = if events && mask_ok {
            new_ids
                .iter()
                .enumerate()
                .filter(|&(i, &b)| b != 0 && block_mask.as_ref().is_none_or(|m| m[i]))
                .map(|(i, _)| ((num_cached + i) * bs, (num_cached + i + 1) * bs))
                .collect()
        } else {
            Vec::new()
        };
        let full_range = (num_cached * bs, num_full * bs);
        let meta_value = if events && mask_ok {
            let req = MetaRequest {
                token_range: full_range,
                block_ranges: &ranges,
                first_mm_idx: 0,
            };
            Some(stored_meta(py, request, &req)?)
        } else {
            None
        };
        let mut get = |i: usize| -> Result<BlockHash, Error> {
            hashes
                .get(i - first)
                .copied()
                .ok_or_else(|| invalid("hash view index out of range").into())
        };
        // The metadata of the whole call, read above; router-exact events ask for runs of it.
        let mut meta = |req: &MetaRequest<'_>| -> Result<StoredMeta, Error> {
            let full = meta_value
                .as_ref()
                .ok_or_else(|| invalid("event metadata was not read"))?;
            Ok(sub_meta(py, full, full_range, &ranges, req)?)
        };
        let mut me = lock(slf, "pool")?;
        Ok(me.inner.cache_full_blocks::<Error>(
            &new_ids,
            num_cached,
            num_full,
            bs,
            kv_cache_group_id,
            block_mask.as_deref(),
            HashSource {
                len: &mut || Ok(view_len),
                get: &mut get,
            },
            &mut meta,
        )?)
    }

    fn cache_partial_block<'py>(
        slf: &Bound<'py, Self>,
        py: Python<'py>,
        request: &Bound<'py, PyAny>,
        block: &Bound<'py, PyAny>,
        num_tokens: &Bound<'py, PyAny>,
        kv_cache_group_id: &Bound<'py, PyAny>,
        block_size: &Bound<'py, PyAny>,
    ) -> PyResult<Option<Bound<'py, PyBytes>>> {
        let (n_blocks, hbs, events) = {
            let me = lock(slf, "pool")?;
            (
                me.inner.num_blocks(),
                me.inner.hash_block_size(),
                me.inner.events_enabled(),
            )
        };
        let b = block_id_of(n_blocks, block)?;
        if b == 0 {
            return Ok(None); // SPEC POOL-30: the null block, whatever the other arguments
        }
        let partial = |m: String| to_pyerr(PoolError::InvalidPartial(m));
        let nt = match int_of(num_tokens, "num_tokens")? {
            Int::V(v) if v >= 0 => v as usize,
            // More tokens than any request has hashes for, or fewer than none.
            _ => return Err(partial(format!("num_tokens {num_tokens} is out of range"))),
        };
        let bs = match int_of(block_size, "block_size")? {
            Int::V(v) if v >= 0 => v as usize,
            Int::Above => {
                // Beyond 64 bits: only its remainder and its size matter (SPEC POOL-30), so
                // the core gets a stand-in that passes and fails the same checks.
                if !block_size.rem(hbs)?.eq(0)? {
                    return Err(to_pyerr(PoolError::BlockSizeNotMultiple {
                        block_size: usize::MAX,
                        hash_block_size: hbs,
                    }));
                }
                if nt == 0 {
                    return Err(partial(format!(
                        "num_tokens 0 is a multiple of block_size {block_size}: not partial"
                    )));
                }
                hbs * (nt / hbs + 2)
            }
            _ => {
                return Err(partial(format!(
                    "block_size {block_size} must exceed hash_block_size {hbs}"
                )))
            }
        };
        let kv_cache_group_id = group_id_of(kv_cache_group_id)?;
        let fine = request.getattr(intern!(py, "block_hashes"))?;
        let num_hashes = fine.len()?;
        // Read what the core may ask for while no borrow is held (see cache_full_blocks).
        let m = nt / hbs;
        let mut prefetched: Vec<(usize, BlockHash)> = Vec::new();
        for i in [m.wrapping_sub(1), m.wrapping_sub(2)] {
            if i < num_hashes && nt % hbs == 0 {
                prefetched.push((i, to_hash(&fine.get_item(i)?)?));
            }
        }
        let meta_value = if events && m >= 1 && m <= num_hashes && nt % hbs == 0 && b != 0 {
            let start = (m - 1) * hbs;
            let req = MetaRequest {
                token_range: (start, nt),
                block_ranges: &[(start, nt)],
                first_mm_idx: if start > 0 { -1 } else { 0 },
            };
            Some(stored_meta(py, request, &req)?)
        } else {
            None
        };
        let mut meta_slot = meta_value;
        let mut at = |i: usize| -> Result<BlockHash, Error> {
            prefetched
                .iter()
                .find(|(j, _)| *j == i)
                .map(|(_, h)| *h)
                .ok_or_else(|| invalid("block hash index out of range").into())
        };
        let mut meta = |_: &MetaRequest<'_>| -> Result<StoredMeta, Error> {
            meta_slot
                .take()
                .ok_or_else(|| invalid("event metadata requested twice").into())
        };
        let key = lock(slf, "pool")?.inner.cache_partial_block::<Error>(
            b,
            nt,
            kv_cache_group_id,
            bs,
            num_hashes,
            &mut at,
            &mut meta,
        )?;
        Ok(key.map(|k| PyBytes::new(py, &k.to_bytes())))
    }

    /// SPEC POOL-4, reading the groups one by one as the reference does: an empty list gives
    /// `[]` whatever the hash, a miss returns before later group ids are read, and a hash
    /// longer than any digest kvcore stores is a miss.
    fn get_cached_block(
        slf: &Bound<'_, Self>,
        block_hash: &Bound<'_, PyAny>,
        kv_cache_group_ids: &Bound<'_, PyAny>,
    ) -> PyResult<Option<Vec<u32>>> {
        // The group ids are taken from their iterable first (an iterator may run Python
        // code); each is converted when the walk reaches it, as the reference reads them.
        let gids = kv_cache_group_ids
            .try_iter()?
            .collect::<PyResult<Vec<Bound<'_, PyAny>>>>()?;
        let me = lock(slf, "pool")?;
        let mut hash: Option<Option<BlockHash>> = None;
        let mut out = Vec::new();
        for gid in gids {
            let gid = group_id_of(&gid)?;
            let h = match hash {
                Some(h) => h,
                None => {
                    let b = block_hash
                        .downcast::<PyBytes>()
                        .map_err(|_| type_error("block_hash", "bytes", block_hash))?;
                    *hash.insert(BlockHash::from_slice(b.as_bytes()))
                }
            };
            let Some(h) = h else {
                return Ok(None);
            };
            match me.inner.get_cached_block(&h, &[gid]) {
                Some(found) => out.extend(found),
                None => return Ok(None),
            }
        }
        Ok(Some(out))
    }

    #[pyo3(signature = (block_hashes, max_num_blocks, kv_cache_group_ids, stride = 1))]
    fn longest_cached_prefix(
        slf: &Bound<'_, Self>,
        block_hashes: &Bound<'_, PyAny>,
        max_num_blocks: i64,
        kv_cache_group_ids: Vec<u32>,
        stride: i64,
    ) -> PyResult<Vec<Vec<u32>>> {
        let stride = usize::try_from(stride)
            .ok()
            .filter(|&s| s > 0)
            .ok_or_else(|| invalid("stride must be positive"))?;
        let max = non_negative(max_num_blocks, "max_num_blocks")?;
        // A list or tuple is read lazily under the borrow (indexing one runs no Python code);
        // any other sequence is copied first.
        if block_hashes.is_instance_of::<PyList>() || block_hashes.is_instance_of::<PyTuple>() {
            let me = lock(slf, "pool")?;
            return cached_prefix(&me.inner, block_hashes, max, &kv_cache_group_ids, stride);
        }
        let copied = PyList::new(
            slf.py(),
            block_hashes.try_iter()?.collect::<PyResult<Vec<_>>>()?,
        )?;
        let me = lock(slf, "pool")?;
        cached_prefix(&me.inner, copied.as_any(), max, &kv_cache_group_ids, stride)
    }

    /// The sliding-window hit search (SPEC SWA-3) in one call; see
    /// `SlidingWindowManager.find_longest_cache_hit`.
    #[pyo3(signature = (block_hashes, max_num_blocks, kv_cache_group_ids, need, block_size, alignment_tokens, drop_eagle_block))]
    #[allow(clippy::too_many_arguments)]
    fn sliding_window_hit(
        slf: &Bound<'_, Self>,
        block_hashes: &Bound<'_, PyAny>,
        max_num_blocks: i64,
        kv_cache_group_ids: Vec<u32>,
        need: i64,
        block_size: i64,
        alignment_tokens: i64,
        drop_eagle_block: bool,
    ) -> PyResult<Vec<Vec<u32>>> {
        let max = non_negative(max_num_blocks, "max_num_blocks")?;
        let need = non_negative(need, "need")?;
        let bs = positive(block_size, "block_size")?;
        let alignment = non_negative(alignment_tokens, "alignment_tokens")?;
        let hashes = list_or_copy(block_hashes)?;
        let mut hash_at = |i: usize| read_hash(&hashes, i);
        let me = lock(slf, "pool")?;
        me.inner.sliding_window_hit(
            max,
            &mut hash_at,
            &kv_cache_group_ids,
            need,
            bs,
            alignment,
            drop_eagle_block,
        )
    }

    /// The Mamba hit search (SPEC MAMBA-2) in one call: `(position, blocks)` of the last
    /// aligned hit, or None; see `MambaManager.find_longest_cache_hit`.
    fn last_aligned_hit(
        slf: &Bound<'_, Self>,
        block_hashes: &Bound<'_, PyAny>,
        max_num_blocks: i64,
        kv_cache_group_ids: Vec<u32>,
        block_size: i64,
        alignment_tokens: i64,
    ) -> PyResult<Option<(usize, Vec<u32>)>> {
        let max = non_negative(max_num_blocks, "max_num_blocks")?;
        let bs = positive(block_size, "block_size")?;
        let alignment = non_negative(alignment_tokens, "alignment_tokens")?;
        let hashes = list_or_copy(block_hashes)?;
        let mut hash_at = |i: usize| read_hash(&hashes, i);
        let me = lock(slf, "pool")?;
        me.inner
            .last_aligned_hit(max, &mut hash_at, &kv_cache_group_ids, bs, alignment)
    }

    fn evict_blocks(slf: &Bound<'_, Self>, block_ids: &Bound<'_, PyAny>) -> PyResult<()> {
        let ids = extract_evict_ids(num_blocks(slf)?, block_ids)?;
        Ok(lock(slf, "pool")?
            .inner
            .evict_blocks(&ids)
            .map_err(Error::Pool)?)
    }

    fn reset_prefix_cache(slf: &Bound<'_, Self>, py: Python<'_>) -> PyResult<bool> {
        let (ok, used) = {
            let mut me = lock(slf, "pool")?;
            let ok = me.inner.reset_prefix_cache();
            (
                ok,
                me.inner.num_blocks() - me.inner.get_num_free_blocks() - 1,
            )
        };
        // Logging runs Python code: the pool is no longer borrowed.
        if !ok {
            py.import("logging")?
                .call_method1("getLogger", ("kvcore",))?
                .call_method1(
                    "warning",
                    (
                        "Failed to reset prefix cache because some blocks (%d) are not freed yet",
                        used,
                    ),
                )?;
        }
        Ok(ok)
    }

    fn take_events(slf: &Bound<'_, Self>, py: Python<'_>) -> PyResult<Py<PyList>> {
        Ok(Self::drain_events(slf, py, &EventStyle::default())?.0)
    }

    /// Starts or stops recording the operations a block-metrics collector follows.
    fn record_block_ops(slf: &Bound<'_, Self>, on: bool) -> PyResult<()> {
        let mut me = lock(slf, "pool")?;
        me.inner.record_block_ops(on);
        Ok(())
    }

    /// The recorded operations as `(kind, block_id)` pairs in pool order: kind 0 allocated,
    /// 1 accessed, 2 evicted, 3 the prefix cache was reset (block id 0).
    fn take_block_ops(slf: &Bound<'_, Self>) -> PyResult<Vec<(u8, u32)>> {
        use kvcore_core::pool::BlockOp;
        let ops = lock(slf, "pool")?.inner.take_block_ops();
        Ok(ops
            .into_iter()
            .map(|op| match op {
                BlockOp::Allocated(b) => (0, b),
                BlockOp::Accessed(b) => (1, b),
                BlockOp::Evicted(b) => (2, b),
                BlockOp::Reset => (3, 0),
            })
            .collect())
    }

    fn get_all_free_block_ids(slf: &Bound<'_, Self>) -> PyResult<Vec<u32>> {
        Ok(lock(slf, "pool")?.inner.all_free_block_ids())
    }

    fn get_ref_cnts(slf: &Bound<'_, Self>, block_ids: &Bound<'_, PyAny>) -> PyResult<Vec<i32>> {
        let ids = extract_ids(num_blocks(slf)?, block_ids)?;
        let me = lock(slf, "pool")?;
        Ok(ids.iter().map(|&b| me.inner.ref_cnt(b)).collect())
    }

    fn count_evictable(slf: &Bound<'_, Self>, block_ids: &Bound<'_, PyAny>) -> PyResult<usize> {
        let ids = extract_ids(num_blocks(slf)?, block_ids)?;
        Ok(lock(slf, "pool")?.inner.count_evictable(&ids))
    }

    fn get_block_hashes<'py>(
        slf: &Bound<'py, Self>,
        py: Python<'py>,
        block_ids: &Bound<'py, PyAny>,
    ) -> PyResult<Vec<Option<Bound<'py, PyBytes>>>> {
        let ids = extract_ids(num_blocks(slf)?, block_ids)?;
        let keys: Vec<_> = {
            let me = lock(slf, "pool")?;
            ids.iter()
                .map(|&b| me.inner.primary_key(b).map(|(k, _)| k.to_bytes()))
                .collect()
        };
        Ok(keys
            .into_iter()
            .map(|k| k.map(|k| PyBytes::new(py, &k)))
            .collect())
    }

    fn check_invariants(slf: &Bound<'_, Self>) -> PyResult<()> {
        let me = lock(slf, "pool")?;
        me.inner
            .check_invariants()
            .map_err(|m| PyAssertionError::new_err(format!("block pool invariant broken: {m}")))
    }

    fn __len__(slf: &Bound<'_, Self>) -> PyResult<usize> {
        let me = lock(slf, "pool")?;
        Ok(me.inner.num_blocks())
    }

    fn __repr__(slf: &Bound<'_, Self>) -> PyResult<String> {
        let me = lock(slf, "pool")?;
        Ok({
            format!(
                "BlockPool(num_gpu_blocks={}, free={}, cached_keys={}, enable_caching={})",
                me.inner.num_blocks(),
                me.inner.get_num_free_blocks(),
                me.inner.num_cached_keys(),
                if me.inner.enable_caching() {
                    "True"
                } else {
                    "False"
                },
            )
        })
    }
}

impl PyBlockPool {
    /// Reads the clock (no borrow of the pool is held while it runs).
    pub fn now(slf: &Bound<'_, Self>) -> PyResult<f64> {
        let py = slf.py();
        let clock = lock(slf, "pool")?.clock.as_ref().map(|c| c.clone_ref(py));
        let t = match clock {
            Some(c) => c.call0(py)?,
            None => py.import("time")?.getattr("monotonic")?.call0()?.unbind(),
        };
        let t = t.bind(py);
        let v = t
            .extract::<f64>()
            .ok()
            .filter(|v| !v.is_nan())
            .ok_or_else(|| invalid(format!("the clock must return seconds as a float, got {t}")))?;
        Ok(v)
    }

    /// [`Self::expire_due`] when the deadline flag says a deadline may exist (one load
    /// otherwise).
    fn expire_flagged(slf: &Bound<'_, Self>) -> PyResult<()> {
        let flagged = {
            let me = lock(slf, "pool")?;
            me.deadlines.load(Ordering::Relaxed)
        };
        if flagged {
            Self::expire_due(slf)?;
        }
        Ok(())
    }

    /// [`Self::expire`]: reads the clock only when a deadline exists, then applies what is
    /// due.
    pub fn expire_due(slf: &Bound<'_, Self>) -> PyResult<()> {
        let next = lock(slf, "pool")?.inner.next_expiry();
        if next == f64::INFINITY {
            return Ok(());
        }
        let now = Self::now(slf)?;
        let mut me = lock(slf, "pool")?;
        if me.inner.needs_expire(now) {
            me.inner.expire(now);
        }
        me.note_deadlines();
        Ok(())
    }
}

impl PoolState {
    /// Records whether a deadline exists now (after a call that may add or remove one).
    pub fn note_deadlines(&self) {
        self.deadlines
            .store(self.inner.next_expiry().is_finite(), Ordering::Relaxed);
    }

    /// The flag [`Self::note_deadlines`] keeps, for a manager of this pool.
    pub fn deadline_flag(&self) -> Arc<AtomicBool> {
        Arc::clone(&self.deadlines)
    }

    /// The core pool, for other binding modules.
    pub fn core(&self) -> &BlockPool {
        &self.inner
    }

    /// The core pool, mutably.
    pub fn core_mut(&mut self) -> &mut BlockPool {
        &mut self.inner
    }
}

/// The sequence behind `BlockPool.blocks`.
#[pyclass(module = "kvcore._native", name = "BlockList", frozen)]
pub struct BlockList {
    pool: Py<PyBlockPool>,
}

#[pymethods]
impl BlockList {
    fn __len__(&self, py: Python<'_>) -> PyResult<usize> {
        Ok(lock(self.pool.bind(py), "pool")?.inner.num_blocks())
    }

    /// `blocks[i]` (negative `i` counts from the end; an int of any size outside the pool
    /// raises IndexError, as on a list) or `blocks[a:b:c]`, a list of views.
    fn __getitem__(&self, py: Python<'_>, index: &Bound<'_, PyAny>) -> PyResult<PyObject> {
        let pool = lock(self.pool.bind(py), "pool")?;
        let n = pool.inner.num_blocks();
        if let Ok(slice) = index.downcast::<PySlice>() {
            let ix = slice.indices(n as isize)?;
            let views = (0..ix.slicelength)
                .map(|k| view_of(&pool.inner, (ix.start + k as isize * ix.step) as u32))
                .collect::<Vec<_>>();
            return Ok(views.into_pyobject(py)?.into_any().unbind());
        }
        let i = match int_of(index, "a block index") {
            Ok(Int::V(v)) if v < 0 => v.checked_add(n as i64).unwrap_or(-1),
            Ok(Int::V(v)) => v,
            Ok(_) => -1,
            Err(_) => {
                return Err(PyTypeError::new_err(format!(
                    "block indices must be integers or slices, not {}",
                    index.get_type().name()?
                )))
            }
        };
        if !(0..n as i64).contains(&i) {
            return Err(PyIndexError::new_err(format!(
                "block index {index} out of range for {n} blocks"
            )));
        }
        Ok(view_of(&pool.inner, i as u32)
            .into_pyobject(py)?
            .into_any()
            .unbind())
    }
}

/// The view of block `b`.
fn view_of(pool: &BlockPool, b: u32) -> KVCacheBlockView {
    let key = pool.primary_key(b);
    KVCacheBlockView {
        block_id: b,
        ref_cnt: pool.ref_cnt(b),
        block_hash: key.map(|(k, _)| k.to_bytes()),
        block_hash_num_tokens: key.map(|(_, n)| n),
    }
}

/// A snapshot of one block's state (SPEC BLK-1).
#[pyclass(module = "kvcore._native", name = "KVCacheBlockView", frozen, get_all)]
pub struct KVCacheBlockView {
    block_id: u32,
    ref_cnt: i32,
    block_hash: Option<Vec<u8>>,
    block_hash_num_tokens: Option<usize>,
}

#[pymethods]
impl KVCacheBlockView {
    /// Whether this is the null block.
    #[getter]
    fn is_null(&self) -> bool {
        self.block_id == 0
    }

    fn __repr__(&self) -> String {
        format!(
            "KVCacheBlockView(block_id={}, ref_cnt={}, hashed={})",
            self.block_id,
            self.ref_cnt,
            if self.block_hash.is_some() {
                "True"
            } else {
                "False"
            }
        )
    }
}

//! `kvcore._native.KVCacheManagerCore`: the request-level calls of every KV-cache
//! configuration, one boundary crossing per call, over [`kvcore_core::coordinator`].
//! `kvcore.KVCacheManager` is a Python subclass: its constructor chooses the configuration
//! (coordinator, group types, attention groups) and hands it to `_init_core`; the per-request
//! calls are this class's methods. Its `coordinator_*` and `group_*` methods answer the Python
//! coordinator classes and their single-type manager views.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};

use kvcore_core::coordinator::{
    AllocateArgs, AttentionGroup, Coordinator, CoordinatorConfig, Mode, NewBlocks, RequestView,
};
use kvcore_core::events::{MetaRequest, StoredMeta};
use kvcore_core::hash::BlockHash;
use kvcore_core::pool::retention::Retention;
use kvcore_core::pool::{BlockId, HashSource};
use kvcore_core::single_type::{GroupConfig, HashList, Kind, MambaMode};
use kvcore_core::tables::{HintCell, SlotHint};
use kvcore_core::PoolError;
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList, PyString, PyTuple, PyType};

use crate::args::{count_of, counts_of, id_key, request_id_of, Count, Flag};
use crate::errors::{invalid, to_pyerr, Error};
use crate::events::EventStyle;
use crate::plain::{Fields, PlainClass, PlainHints, Reader};
use crate::pool::{
    extract_ids, list_or_copy, request_retention, stored_meta, to_hash, tokens_only_meta,
    PyBlockPool, PyRetention,
};
use crate::request::{prefetch_ahead, CoreCast, PyRequestCore};
use crate::sync::{lock_cell, GilCell, Guarded};

/// `RequestStatus.WAITING` and `RequestStatus.PREEMPTED` (SPEC REQ-3).
const WAITING: i64 = 1;
const PREEMPTED: i64 = 6;

/// A Python list (or tuple) of hashes read lazily: a hit search that stops at the first miss
/// converts few. A bad entry reads as a miss and is reported after the search.
struct PyHashes<'a, 'py> {
    list: &'a Bound<'py, PyAny>,
    len: usize,
    err: std::cell::RefCell<Option<PyErr>>,
}

impl<'a, 'py> PyHashes<'a, 'py> {
    fn new(list: &'a Bound<'py, PyAny>) -> PyResult<Self> {
        Ok(Self {
            list,
            len: list.len()?,
            err: std::cell::RefCell::new(None),
        })
    }

    fn finish(self) -> PyResult<()> {
        self.err.into_inner().map_or(Ok(()), Err)
    }
}

impl HashList for PyHashes<'_, '_> {
    fn len(&self) -> usize {
        self.len
    }
    fn get(&self, i: usize) -> Option<BlockHash> {
        match self.list.get_item(i).and_then(|h| to_hash(&h)) {
            Ok(h) => Some(h),
            Err(e) => {
                self.err.borrow_mut().get_or_insert(e);
                None
            }
        }
    }
}

/// Reads a group description `(kind, param, spec_block_size, record_new_block_ids,
/// admission_cap)`.
fn group_config(
    t: &Bound<'_, PyAny>,
    group_id: u32,
    dcp: usize,
    pcp: usize,
    enable_caching: bool,
    scheduler_block_size: usize,
) -> PyResult<GroupConfig> {
    let (kind, param, bs, record, cap): (String, usize, usize, bool, Option<usize>) =
        t.extract()?;
    let kind = match kind.as_str() {
        "full" => Kind::Full,
        "reference_sliding_window" => Kind::ReferenceSlidingWindow { window: param },
        "sink" => Kind::Sink { sink_len: param },
        "sliding_window" => Kind::SlidingWindow { window: param },
        "chunked_local" => Kind::ChunkedLocal { chunk: param },
        "mamba_none" | "mamba_all" | "mamba_align" => Kind::Mamba {
            mode: match kind.as_str() {
                "mamba_none" => MambaMode::None,
                "mamba_all" => MambaMode::All,
                _ => MambaMode::Align,
            },
            num_speculative_blocks: param,
        },
        "cross_attention" => Kind::CrossAttention,
        other => {
            return Err(to_pyerr(PoolError::Config(format!(
                "unknown group kind {other:?}"
            ))))
        }
    };
    if matches!(
        kind,
        Kind::SlidingWindow { window: 0 } | Kind::ChunkedLocal { chunk: 0 }
    ) {
        return Err(to_pyerr(PoolError::Config(
            "a window or chunk of 0 tokens".into(),
        )));
    }
    Ok(GroupConfig {
        kind,
        spec_block_size: bs,
        dcp_world_size: dcp,
        pcp_world_size: pcp,
        group_id,
        record_new_ids: record,
        admission_cap: cap,
        enable_caching,
        scheduler_block_size,
        // Set by the coordinator from its own.
        max_model_len: 0,
    })
}

/// Where a duck-typed request's table key comes from: a plain request's kept key and hints,
/// or any other request's `request_id` str.
enum IdSource<'a, 'py> {
    Plain(Kept<'a>),
    Str(Bound<'py, PyString>),
}

/// A plain request's kept table key and hints: its state slot's, or its entry in the hint map
/// (held in place for the call).
enum Kept<'a> {
    State(crate::plain::StateRef<'a>),
    Map(std::cell::RefMut<'a, crate::plain::PlainEntry>),
}

impl Kept<'_> {
    /// The table key and the hints of the first `n` groups (of those kept).
    #[inline]
    fn key_hints(&self, n: usize) -> (&str, &[HintCell]) {
        let (key, hints) = match self {
            Kept::State(s) => (s.key(), s.hints),
            Kept::Map(e) => (e.key.as_str(), &e.hints[..]),
        };
        (key, &hints[..n.min(hints.len())])
    }

    /// Where the call notes its table slots for the pipeline of the hint map.
    #[inline]
    fn slot_cell(&self) -> Option<&std::cell::Cell<[usize; 2]>> {
        match self {
            Kept::State(_) => None,
            Kept::Map(e) => Some(&e.slot_addr),
        }
    }
}

/// Per-group block ids copied out of the core in one buffer (a call allocates at most the id
/// buffer and, with several groups, their ends; nothing when no block is new).
struct Flat {
    ids: Vec<BlockId>,
    num_groups: usize,
    /// Where each group ends in `ids`; empty for a single group and when `ids` is.
    ends: Vec<usize>,
}

impl Flat {
    /// The ids of `groups` ranges of the request's tables, in group order.
    fn of<'a>(num_groups: usize, groups: impl Iterator<Item = &'a [BlockId]>) -> Self {
        let mut ids = Vec::new();
        let mut ends = Vec::with_capacity(num_groups);
        for g in groups {
            ids.extend_from_slice(g);
            ends.push(ids.len());
        }
        if ids.is_empty() || num_groups == 1 {
            ends = Vec::new();
        }
        Self {
            ids,
            num_groups,
            ends,
        }
    }

    /// No new block in any of `num_groups` groups.
    fn empty(num_groups: usize) -> Self {
        Self {
            ids: Vec::new(),
            num_groups,
            ends: Vec::new(),
        }
    }

    /// A single group's ids.
    fn single(ids: Vec<BlockId>) -> Self {
        Self {
            ids,
            num_groups: 1,
            ends: Vec::new(),
        }
    }

    /// Each group's ids.
    fn groups(&self) -> Vec<&[BlockId]> {
        if self.ends.is_empty() {
            return match self.num_groups {
                1 => vec![self.ids.as_slice()],
                n => vec![&[][..]; n],
            };
        }
        let mut start = 0;
        self.ends
            .iter()
            .map(|&end| {
                let g = &self.ids[start..end];
                start = end;
                g
            })
            .collect()
    }

    fn is_empty(&self) -> bool {
        self.ids.is_empty()
    }
}

/// Everything fixed at `_init_core`, and the coordinator's state.
struct Inner {
    /// The coordinator, held by one call at a time ([`crate::sync`]).
    core: GilCell<Coordinator>,
    pool: Py<PyBlockPool>,
    /// `kvcore.blocks.KVCacheBlocks`.
    blocks_cls: PyObject,
    /// The manager's shared empty result and its `.blocks` tuple (ALLOC-8's identity test).
    empty: PyObject,
    empty_blocks: PyObject,
    /// Recognises kvcore requests without pyo3's per-call type check.
    cast: CoreCast,
    /// The pool's `enable_caching` and `enable_kv_cache_events`.
    caching: bool,
    events: bool,
    /// The pool's deadline flag ([`crate::pool::PoolState::deadline_flag`]).
    deadlines: Arc<AtomicBool>,
    num_groups: usize,
    /// Whether admissions keep a watermark of free blocks (`watermark_blocks > 0`).
    watermark: bool,
    /// Whether `allocate_slots` reads `num_prompt_tokens` (R-SWA, the retention masks).
    reads_prompt: bool,
    /// The coordinator's [`Coordinator::noop_possible`] (fixed by its configuration).
    noop_possible: bool,
    /// Per group, whether MGR-26 clips its block list.
    clip: Vec<bool>,
    /// The request classes read from their slots and instance dicts ([`crate::plain`]).
    plain: Vec<PlainClass>,
    /// Table keys and slot hints of that class's requests.
    plain_hints: PlainHints,
    /// The classes `take_events` builds the events as (`None`: kvcore's own).
    event_classes: Option<[PyObject; 3]>,
}

/// What [`Inner::answers_noop`] found.
// A call's return value, moved once to its caller and never stored: boxing the fields would
// cost an allocation on every call that allocates.
#[allow(clippy::large_enum_variant)]
enum Noop<'a, 'py> {
    /// The call is a no-op (answered: no new blocks).
    Yes,
    /// It is not (the batch's prefetch ran); a plain request's fields as read, which the
    /// whole path takes instead of reading them again.
    No(Option<PlainRead<'a, 'py>>),
    /// Not known: the whole path decides.
    Unknown,
}

/// A plain request's fields as [`Inner::answers_noop`] read them, its hint entry held.
struct PlainRead<'a, 'py> {
    plain: crate::plain::PlainRequest<'py>,
    entry: std::cell::RefMut<'a, crate::plain::PlainEntry>,
    num_computed_tokens: usize,
    /// 0 unless the configuration reads it (as [`Inner::num_prompt_tokens`]).
    num_prompt_tokens: usize,
}

/// Where a `BlockStored` event's request fields come from.
enum MetaSource<'a, 'py> {
    /// The request itself (a kvcore `Request` reads natively).
    Request(&'a Bound<'py, PyAny>),
    /// A copy of a duck-typed request's fields.
    Snapshot(Bound<'py, PyAny>),
    /// A plain request's token list: it has no other event field; and its native base, whose
    /// token window may hold the tokens ([`crate::plain::PlainState::take_window`]).
    Tokens(&'a Bound<'py, PyList>, Option<&'a crate::plain::PlainState>),
}

impl MetaSource<'_, '_> {
    fn meta(&self, req: &MetaRequest<'_>) -> PyResult<StoredMeta> {
        match self {
            MetaSource::Request(r) => stored_meta(r.py(), r, req),
            MetaSource::Snapshot(r) => stored_meta(r.py(), r, req),
            MetaSource::Tokens(t, base) => tokens_only_meta(t, *base, req),
        }
    }
}

impl Inner {
    /// The registered plain class that is `request`'s exact class, if any.
    #[inline(always)]
    fn plain_class(&self, request: &Bound<'_, PyAny>) -> Option<&PlainClass> {
        self.plain.iter().find(|p| p.is_class_of(request))
    }

    /// A request's fields for attribute reads ([`Fields::of`]).
    #[inline]
    fn fields<'a, 'py>(&self, request: &'a Bound<'py, PyAny>) -> Fields<'a, 'py> {
        Fields::of(self.plain_class(request), request, self.reads_prompt)
    }

    /// The source of a duck-typed request's event fields, read now (before the tables are
    /// held).
    fn meta_source<'a, 'py>(fields: &'a Fields<'a, 'py>) -> PyResult<MetaSource<'a, 'py>> {
        Ok(match fields.tokens_only()? {
            Some(tokens) => MetaSource::Tokens(tokens, fields.plain_base()),
            None => MetaSource::Snapshot(fields.event_snapshot()?),
        })
    }

    fn lock(&self, py: Python<'_>) -> PyResult<crate::sync::Held<'_, Coordinator>> {
        lock_cell(py, &self.core, "manager")
    }

    /// [`Coordinator::may_cache_a_block`], the manager and the pool held for the question only.
    fn may_cache_a_block(
        &self,
        py: Python<'_>,
        view: &RequestView<'_>,
        args: &AllocateArgs<'_>,
    ) -> PyResult<bool> {
        let core = self.lock(py)?;
        let pool = lock_cell(py, self.pool(py).get().cell(), "pool")?;
        Ok(core.may_cache_a_block(pool.core(), view, args))
    }

    fn pool<'py>(&self, py: Python<'py>) -> &Bound<'py, PyBlockPool> {
        self.pool.bind(py)
    }

    /// A `KVCacheBlocks` of copied-out ids; the shared empty one when all are empty.
    fn make_flat(&self, py: Python<'_>, flat: &Flat) -> PyResult<PyObject> {
        if flat.is_empty() {
            return Ok(self.empty.clone_ref(py));
        }
        self.make_blocks(py, &flat.groups())
    }

    /// A `KVCacheBlocks` of per-group ids; the shared empty one when all are empty.
    fn make_blocks(&self, py: Python<'_>, groups: &[&[BlockId]]) -> PyResult<PyObject> {
        if groups.iter().all(|g| g.is_empty()) {
            return Ok(self.empty.clone_ref(py));
        }
        let lists = groups
            .iter()
            .map(|g| PyList::new(py, g.iter()))
            .collect::<PyResult<Vec<_>>>()?;
        self.blocks_cls
            .call1(py, (PyTuple::new(py, lists)?, self.pool.clone_ref(py)))
    }

    /// Per-group id lists as a tuple.
    fn tuple_of<'py>(py: Python<'py>, groups: &[&[BlockId]]) -> PyResult<Bound<'py, PyTuple>> {
        let lists = groups
            .iter()
            .map(|g| PyList::new(py, g.iter()))
            .collect::<PyResult<Vec<_>>>()?;
        PyTuple::new(py, lists)
    }

    /// Reads per-group hit ids (`KVCacheBlocks.blocks` or a tuple of id sequences).
    fn read_groups(
        &self,
        py: Python<'_>,
        groups: &Bound<'_, PyAny>,
    ) -> PyResult<Vec<Vec<BlockId>>> {
        let num_blocks = lock_cell(py, self.pool(py).get().cell(), "pool")?
            .core()
            .num_blocks();
        groups
            .try_iter()?
            .map(|g| extract_ids(num_blocks, &g?))
            .collect()
    }

    /// The request's `num_prompt_tokens` when the configuration reads it (R-SWA, the retention
    /// masks), else 0: a kvcore `Request`'s from its native base.
    fn num_prompt_tokens(
        &self,
        core: Option<&PyRequestCore>,
        fields: &Fields<'_, '_>,
    ) -> PyResult<usize> {
        match (core, self.reads_prompt) {
            (_, false) => Ok(0),
            (Some(c), true) => count(c.num_prompt_tokens, "num_prompt_tokens"),
            (None, true) => count_of(
                &fields.get(intern!(fields.request().py(), "num_prompt_tokens"))?,
                "num_prompt_tokens",
            ),
        }
    }

    /// Applies the retention and pin deadlines due now (kvcore extension), before the
    /// manager is held: the clock is Python code. One load when no deadline exists.
    fn expire_due(&self, py: Python<'_>) -> PyResult<()> {
        if self.deadlines.load(Ordering::Relaxed) {
            PyBlockPool::expire_due(self.pool(py))?;
        }
        Ok(())
    }

    /// One allocation (SPEC ALLOC-1..13) with parsed arguments: the new block ids per group,
    /// or `None` when the request does not fit.
    ///
    /// The request is read before the tables are held (a duck-typed request's attributes are
    /// Python code), except its hash list's entries and, with events on, the fields an event
    /// carries, which the core asks for as it caches. `next` names the batch and the position
    /// of this request in it, to prefetch the following requests' state.
    #[inline]
    fn allocate<'py>(
        &self,
        py: Python<'py>,
        request: &Bound<'py, PyAny>,
        args: AllocateArgs<'_>,
        next: Option<(&Bound<'py, PyList>, usize)>,
    ) -> PyResult<Option<Flat>> {
        let Some((next, read)) = self.ask_noop(py, request, &args, next) else {
            return Ok(Some(Flat::empty(self.num_groups)));
        };
        self.allocate_whole(py, request, args, next, read)
    }

    /// Most decode calls change nothing: answered before anything a call that does needs is
    /// gathered (any other duck-typed request takes the whole path: its hash list is read
    /// first there, as on every call, so that a missing one raises alike). `None`: answered,
    /// no new blocks; else what the whole path takes: the batch's pipeline when it still has
    /// to run, and a plain request's fields as read.
    #[inline]
    #[allow(clippy::type_complexity)]
    fn ask_noop<'a, 'py, 'l>(
        &'a self,
        py: Python<'py>,
        request: &Bound<'py, PyAny>,
        args: &AllocateArgs<'_>,
        next: Option<(&'l Bound<'py, PyList>, usize)>,
    ) -> Option<(
        Option<(&'l Bound<'py, PyList>, usize)>,
        Option<PlainRead<'a, 'py>>,
    )> {
        if !self.noop_possible {
            return Some((next, None));
        }
        match self.answers_noop(py, request, args, next) {
            Noop::Yes => None,
            // The batch's prefetch ran.
            Noop::No(read) => Some((None, read)),
            Noop::Unknown => Some((next, None)),
        }
    }

    /// [`Self::allocate`] past the no-op answer: the request read the general way (a plain
    /// request's fields taken from `read` when the no-op question read them); `next` the
    /// batch's pipeline, when it still has to run.
    #[inline(never)]
    fn allocate_whole<'py>(
        &self,
        py: Python<'py>,
        request: &Bound<'py, PyAny>,
        args: AllocateArgs<'_>,
        next: Option<(&Bound<'py, PyList>, usize)>,
        read: Option<PlainRead<'_, 'py>>,
    ) -> PyResult<Option<Flat>> {
        let (fields, read) = match read {
            Some(r) => (
                Fields::Plain(r.plain),
                Some((r.entry, r.num_computed_tokens, r.num_prompt_tokens)),
            ),
            None => (self.fields(request), None),
        };
        // A kvcore Request keeps these four fields in its native base: read them directly.
        let request_core = if read.is_some() {
            None
        } else {
            self.cast.borrow(request)?
        };
        let mut known_prompt = None;
        let id_src;
        // Where a plain request's entry notes its table slot.
        let mut slot_cell: Option<&std::cell::Cell<[usize; 2]>> = None;
        let id_key_obj;
        // The table key and, where the request has them, its slot hints.
        let (id, hints, num_tokens, num_computed, status): (&str, &[HintCell], _, _, _) =
            if let Some(c) = &request_core {
                (
                    c.id.as_str(),
                    &c.hints[..self.num_groups.min(c.hints.len())],
                    count(c.num_tokens, "num_tokens")?,
                    count(c.num_computed_tokens, "num_computed_tokens")?,
                    c.status_value,
                )
            } else {
                // A plain request's key and hints are kept by the address of its id str
                // (read, not checked, when known: `PlainHints::entry`), unless another call
                // holds them.
                let mut known_computed = None;
                id_src = if let Some((entry, computed, prompt)) = read {
                    (known_computed, known_prompt) = (Some(computed), Some(prompt));
                    IdSource::Plain(Kept::Map(entry))
                } else if let Fields::Plain(p) = &fields {
                    // The fields a decode call reads, as read at their dict entries, when they
                    // are exact ints in range (else read below, which raises what is wrong).
                    let id = || fields.get(intern!(py, "request_id"));
                    let (addr, lines) = match p.decoded {
                        Some(d) => {
                            (known_computed, known_prompt) =
                                (Some(d.num_computed_tokens), Some(d.num_prompt_tokens));
                            (d.id_addr, d.lines)
                        }
                        None => (id()?.as_ptr() as usize, [0; crate::plain::LINES]),
                    };
                    if let Some(state) = p.kept_state(self.num_groups)? {
                        IdSource::Plain(Kept::State(state))
                    } else {
                        match self.plain_hints.entry(py, addr, id)? {
                            Some(entry) => {
                                entry.lines.set(lines);
                                IdSource::Plain(Kept::Map(entry))
                            }
                            None => IdSource::Str(request_id_of(&id()?)?.clone()),
                        }
                    }
                } else {
                    IdSource::Str(fields.request_id()?)
                };
                let num_tokens = fields.num_tokens()?;
                let num_computed = match known_computed {
                    Some(n) => n,
                    None => count_of(
                        &fields.get(intern!(py, "num_computed_tokens"))?,
                        "num_computed_tokens",
                    )?,
                };
                // The status only decides whether the watermark applies (MGR-1): unread
                // without one.
                let status: i64 = if args.has_scheduled_reqs && self.watermark {
                    fields.get(intern!(py, "status"))?.extract().unwrap_or(-1)
                } else {
                    0
                };
                let (key, hints): (&str, &[HintCell]) = match &id_src {
                    IdSource::Plain(kept) => {
                        slot_cell = kept.slot_cell();
                        kept.key_hints(self.num_groups)
                    }
                    IdSource::Str(id) => {
                        id_key_obj = id_key(id)?;
                        (&id_key_obj, &[])
                    }
                };
                (key, hints, num_tokens, num_computed, status)
            };
        let num_prompt_tokens = match known_prompt {
            Some(n) => n,
            None => self.num_prompt_tokens(request_core.as_deref(), &fields)?,
        };
        let waiting_or_preempted =
            args.has_scheduled_reqs && (status == WAITING || status == PREEMPTED);
        let view = RequestView {
            id,
            num_computed_tokens: num_computed,
            num_tokens,
            num_prompt_tokens,
            waiting_or_preempted,
            hints,
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
            let h = match fields.plain_hashes() {
                Some(h) => h?,
                None => list_or_copy(&fields.get(intern!(py, "block_hashes"))?)?,
            };
            Ok(hashes_obj.get_or_init(|| h))
        };
        let mut hash_len = || -> Result<usize, Error> {
            match mirror() {
                Some(m) => Ok(m.len()),
                None => Ok(crate::pool::seq_len(fetch()?)?),
            }
        };
        // A `kvcore.vllm.Request`'s window may hold the hash object (and its value).
        let base = fields.plain_base();
        let mut get = |i: usize| -> Result<BlockHash, Error> {
            match mirror() {
                Some(m) => Ok(m[i]),
                None => Ok(crate::pool::read_seq_item(fetch()?, i, |item| match base
                    .and_then(|b| b.window_hash(item, i))
                {
                    Some(h) => Ok(h),
                    None => to_hash(item),
                })?),
            }
        };
        // With events on, a duck-typed request's event fields are read now when this call
        // may cache a block (the core's answer, the tables held only for the question): the
        // core asks for them while the tables are held, when no Python code may run. A plain
        // request whose dict says, without running Python code, that its events need only its
        // tokens hands over its token list without the question.
        let may_cache: std::cell::OnceCell<bool> = std::cell::OnceCell::new();
        let may_cache_a_block = || -> PyResult<bool> {
            if let Some(&b) = may_cache.get() {
                return Ok(b);
            }
            let b = self.may_cache_a_block(py, &view, &args)?;
            Ok(*may_cache.get_or_init(|| b))
        };
        let source =
            if !(self.events && self.caching && !args.delay_cache_blocks && request_core.is_none())
            {
                MetaSource::Request(request)
            } else if let Some(tokens) = fields.quiet_tokens_only() {
                MetaSource::Tokens(tokens, fields.plain_base())
            } else if may_cache_a_block()? {
                Inner::meta_source(&fields)?
            } else {
                MetaSource::Request(request)
            };
        let mut meta =
            |req: &MetaRequest<'_>| -> Result<StoredMeta, Error> { Ok(source.meta(req)?) };
        // A duck-typed request's hash list is read now when the call may cache a block (as
        // the reference reads it only then); only its entries are read while the tables are
        // held (indexing a list runs no Python code). A plain request's is read from its dict
        // when the core asks for it (most decode steps fill no block and never do), which runs
        // no Python code either.
        if matches!(fields, Fields::Attrs(_))
            && request_core.is_none()
            && self.caching
            && !args.delay_cache_blocks
            && may_cache_a_block()?
        {
            fetch()?;
        }
        let mut core = self.lock(py)?;
        if let Some((list, i)) = next {
            self.prefetch_next(&core, list, i);
        }
        let mut pool = lock_cell(py, self.pool(py).get().cell(), "pool")?;
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
        let Some(ranges) = res? else {
            return Ok(None);
        };
        // The call refreshed the request's hints.
        let hint = hints.first().and_then(HintCell::get);
        Self::note_slot(&core, slot_cell, hints);
        // Most decode steps allocate nothing: no table is read again then.
        if ranges.iter().all(|r| r.is_empty()) {
            return Ok(Some(Flat::empty(core.groups.len())));
        }
        Ok(Some(Self::new_ids(&core, id, hint, &ranges)))
    }

    /// Whether the call is a no-op ([`Coordinator::allocate_is_noop`]), answered from the
    /// fewest reads: a kvcore request's native fields, or a plain request's dict entries and
    /// its entry in the hint map (refreshing its hints as a no-op call does). Anything unusual
    /// (another kind of request, a field of another type, a watermark) is `Unknown`, left to
    /// the whole path, which reads the request again and raises any error; a manager this
    /// thread's own call holds answers no (the whole path raises): nothing here raises or
    /// changes more than hints. Kept apart from that path so that a decode call runs little
    /// code (most of a call's time in a scheduler's step is fetching its code).
    #[inline(never)]
    fn answers_noop<'py>(
        &self,
        py: Python<'py>,
        request: &Bound<'py, PyAny>,
        args: &AllocateArgs<'_>,
        next: Option<(&Bound<'py, PyList>, usize)>,
    ) -> Noop<'_, 'py> {
        if self.watermark && args.has_scheduled_reqs {
            return Noop::Unknown;
        }
        // The request's fields, as the whole path reads them: a plain request's from its dict
        // and its entry in the hint map, a kvcore request's from its native base. Each kind in
        // a function of its own, so that a call runs the code of one.
        if let Some(plain) = self.plain_class(request) {
            return match (plain.reader(self.reads_prompt), self.reads_prompt) {
                (Reader::State, false) => self.state_noop::<false>(py, plain, request, args, next),
                (Reader::State, true) => self.state_noop::<true>(py, plain, request, args, next),
                (Reader::Dict, _) => self.plain_noop(py, plain, request, args, next),
                (Reader::Whole, _) => Noop::Unknown,
            };
        }
        match self.cast.borrow(request) {
            Ok(Some(c)) => self.core_request_noop(py, &c, args, next),
            _ => Noop::Unknown,
        }
    }

    /// [`Self::answers_noop`] for a request of the plain class `class`, read from its dict and
    /// its hint entry.
    #[inline(never)]
    fn plain_noop<'py>(
        &self,
        py: Python<'py>,
        class: &crate::plain::PlainClass,
        request: &Bound<'py, PyAny>,
        args: &AllocateArgs<'_>,
        next: Option<(&Bound<'py, PyList>, usize)>,
    ) -> Noop<'_, 'py> {
        let Some(plain) = class.read(request, self.reads_prompt) else {
            return Noop::Unknown;
        };
        let Some(d) = plain.decoded else {
            return Noop::Unknown;
        };
        let Ok(Some(entry)) = self.plain_hints.entry(py, d.id_addr, || {
            plain
                .to_owned()
                .ok_or_else(|| invalid("a plain request's instance dict cannot be read"))?
                .get(intern!(py, "request_id"))
        }) else {
            return Noop::Unknown;
        };
        entry.lines.set(d.lines);
        let hints = &entry.hints[..self.num_groups.min(entry.hints.len())];
        let view = RequestView {
            id: &entry.key,
            num_computed_tokens: d.num_computed_tokens,
            num_tokens: plain.num_tokens(),
            num_prompt_tokens: d.num_prompt_tokens,
            waiting_or_preempted: false,
            hints,
        };
        if self.decide_noop(py, &view, Some(&entry.slot_addr), args, next, || {
            view.num_tokens
        }) {
            return Noop::Yes;
        }
        // The whole path takes the fields as read here.
        let Some(owned) = plain.to_owned() else {
            return Noop::Unknown;
        };
        Noop::No(Some(PlainRead {
            plain: owned,
            entry,
            num_computed_tokens: d.num_computed_tokens,
            num_prompt_tokens: d.num_prompt_tokens,
        }))
    }

    /// [`Self::answers_noop`] for a request of the plain class `class` that keeps its decode
    /// fields and its [`crate::plain::PlainState`] in slots, read from them.
    #[inline(never)]
    fn state_noop<'py, const PROMPT: bool>(
        &self,
        py: Python<'py>,
        class: &crate::plain::PlainClass,
        request: &Bound<'py, PyAny>,
        args: &AllocateArgs<'_>,
        next: Option<(&Bound<'py, PyList>, usize)>,
    ) -> Noop<'_, 'py> {
        let (noop, noted) = {
            #[allow(unsafe_code)]
            // SAFETY: `class` is the request's exact class (`plain_class`), whose reader for
            // `PROMPT` (the manager's `reads_prompt`) is `Reader::State` (`answers_noop`).
            let Some(r) = (unsafe { class.read_state::<PROMPT>(request, self.num_groups) }) else {
                return Noop::Unknown;
            };
            let state = &r.state;
            let view = RequestView {
                id: state.key(),
                num_computed_tokens: r.num_computed_tokens,
                num_tokens: if r.noted { usize::MAX } else { r.num_tokens() },
                num_prompt_tokens: r.num_prompt_tokens,
                waiting_or_preempted: false,
                hints: &state.hints[..self.num_groups.min(state.hints.len())],
            };
            // A token list the base holds is read only when the answer needs its length
            // (`Coordinator::allocate_is_noop_reading`).
            (
                self.decide_noop(py, &view, None, args, next, || r.num_tokens()),
                r.noted,
            )
        };
        if !noted {
            class.note_tokens(request);
        }
        if noop {
            Noop::Yes
        } else {
            Noop::No(None)
        }
    }

    /// [`Self::answers_noop`] for a kvcore request, read from its native base `c`.
    #[inline(never)]
    fn core_request_noop<'py>(
        &self,
        py: Python<'py>,
        c: &PyRequestCore,
        args: &AllocateArgs<'_>,
        next: Option<(&Bound<'py, PyList>, usize)>,
    ) -> Noop<'_, 'py> {
        let (Ok(num_tokens), Ok(computed), Ok(prompt)) = (
            usize::try_from(c.num_tokens),
            usize::try_from(c.num_computed_tokens),
            usize::try_from(if self.reads_prompt {
                c.num_prompt_tokens
            } else {
                0
            }),
        ) else {
            return Noop::Unknown;
        };
        let view = RequestView {
            id: c.id.as_str(),
            num_computed_tokens: computed,
            num_tokens,
            num_prompt_tokens: prompt,
            waiting_or_preempted: false,
            hints: &c.hints[..self.num_groups.min(c.hints.len())],
        };
        if self.decide_noop(py, &view, None, args, next, || view.num_tokens) {
            Noop::Yes
        } else {
            Noop::No(None)
        }
    }

    /// The no-op question itself ([`Coordinator::allocate_is_noop`]) with the manager held
    /// (`false` when this thread's own call holds it), refreshing the hints and noting the slot of a
    /// plain request's entry when the answer is yes; runs the batch's prefetch. `num_tokens`:
    /// the request's token count, read only when the answer depends on it, where
    /// `view.num_tokens` may be a bound above it ([`Coordinator::allocate_is_noop_reading`]).
    /// Inlined in each kind's function, so that the view stays in registers.
    #[inline(always)]
    fn decide_noop(
        &self,
        py: Python<'_>,
        view: &RequestView<'_>,
        slot: Option<&std::cell::Cell<[usize; 2]>>,
        args: &AllocateArgs<'_>,
        next: Option<(&Bound<'_, PyList>, usize)>,
        num_tokens: impl Fn() -> usize,
    ) -> bool {
        let Ok(core) = self.lock(py) else {
            return false;
        };
        if let Some((list, i)) = next {
            self.prefetch_next(&core, list, i);
        }
        let noop = lock_cell(py, self.pool(py).get().cell(), "pool")
            .is_ok_and(|pool| core.allocate_is_noop_reading(pool.core(), view, args, num_tokens));
        if noop {
            Self::note_slot(&core, slot, view.hints);
        }
        noop
    }

    /// Notes where a plain request's table slots of the first two groups are (its hints'), for
    /// the call before it to prefetch next step ([`crate::plain::PlainHints::entry`]).
    #[inline]
    fn note_slot(
        core: &Coordinator,
        cell: Option<&std::cell::Cell<[usize; 2]>>,
        hints: &[HintCell],
    ) {
        if let Some(cell) = cell {
            let slot = |g: usize| match (core.groups.get(g), hints.get(g)) {
                (Some(group), Some(h)) => group.tables.slot_addr(h.get()),
                _ => 0,
            };
            cell.set([slot(0), slot(1)]);
        }
    }

    /// The new ids of an allocation: `ranges` of the request's tables, copied out.
    #[inline(never)]
    fn new_ids(core: &Coordinator, id: &str, hint: Option<SlotHint>, ranges: &NewBlocks) -> Flat {
        if let (1, Some(r)) = (ranges.len(), ranges.get(0)) {
            return Flat::single(core.groups[0].tables.blocks_hinted(id, hint)[r].to_vec());
        }
        let groups = ranges.iter().enumerate().map(|(i, r)| {
            let blocks = if i == 0 {
                core.groups[0].tables.blocks_hinted(id, hint)
            } else {
                core.groups[i].blocks(id)
            };
            &blocks[r]
        });
        Flat::of(ranges.len(), groups)
    }

    /// A batch's pipeline: prefetches the table slots of the requests after position `i`.
    #[inline(never)]
    fn prefetch_next(&self, core: &Coordinator, list: &Bound<'_, PyList>, i: usize) {
        let tables = &core.groups[0].tables;
        let more = core.groups.get(1..).unwrap_or_default();
        prefetch_ahead(list, i, &self.cast, |c| {
            tables.prefetch_slot(c.hints[0].get());
            for (g, h) in more.iter().zip(&c.hints[1..]) {
                g.tables.prefetch_slot(h.get());
            }
        });
    }

    /// `allocate_slots` with parsed arguments, as the Python caller sees it: the new blocks as
    /// a `KVCacheBlocks` (the shared empty one when there are none), or None.
    #[inline]
    fn allocate_call(
        &self,
        py: Python<'_>,
        request: &Bound<'_, PyAny>,
        args: AllocateArgs<'_>,
    ) -> PyResult<Option<PyObject>> {
        self.expire_due(py)?;
        // As `allocate`, the no-op answer being the shared empty result (no `Flat`).
        let Some((_, read)) = self.ask_noop(py, request, &args, None) else {
            return Ok(Some(self.empty.clone_ref(py)));
        };
        match self.allocate_whole(py, request, args, None, read)? {
            None => Ok(None),
            Some(flat) => Ok(Some(self.make_flat(py, &flat)?)),
        }
    }

    /// The request's hashes for a lookup: its native mirror, or its list read lazily.
    fn lookup<'py>(
        &self,
        py: Python<'py>,
        hashes: &Bound<'py, PyAny>,
        mirror: Option<&[BlockHash]>,
        max_len: usize,
    ) -> PyResult<(Vec<Vec<BlockId>>, usize)> {
        let mut core = self.lock(py)?;
        let pool = lock_cell(py, self.pool(py).get().cell(), "pool")?;
        match mirror {
            Some(m) => Ok(core
                .find_longest_cache_hit(pool.core(), &m, max_len)
                .map_err(to_pyerr)?),
            None => {
                let list = list_or_copy(hashes)?;
                let lazy = PyHashes::new(&list)?;
                let found = core.find_longest_cache_hit(pool.core(), &lazy, max_len);
                drop(pool);
                drop(core);
                lazy.finish()?;
                Ok(found.map_err(to_pyerr)?)
            }
        }
    }
}

/// Warns once per event whose group id the manager's metadata lacks (the reference's message).
#[cold]
#[inline(never)]
fn log_unknown_groups(py: Python<'_>, groups: &[u32]) -> PyResult<()> {
    let logger = py
        .import("logging")?
        .call_method1("getLogger", ("kvcore.manager",))?;
    for gid in groups {
        logger.call_method1("warning", ("Group index %s not in KV cache metadata", *gid))?;
    }
    Ok(())
}

fn count(v: i64, what: &str) -> PyResult<usize> {
    usize::try_from(v).map_err(|_| invalid(format!("{what} must be non-negative, got {v}")))
}

/// The request-level manager core; see the module docs.
#[pyclass(
    module = "kvcore._native",
    name = "KVCacheManagerCore",
    subclass,
    frozen
)]
pub struct PyManagerCore {
    inner: OnceLock<Inner>,
}

impl PyManagerCore {
    fn me(&self) -> PyResult<&Inner> {
        self.inner.get().ok_or_else(|| {
            to_pyerr(PoolError::Invariant(
                "KVCacheManagerCore used before _init_core".into(),
            ))
        })
    }
}

#[pymethods]
impl PyManagerCore {
    /// An uninitialised core; the subclass's constructor calls `_init_core`.
    #[new]
    #[pyo3(signature = (*_args, **_kwargs))]
    fn new(_args: &Bound<'_, PyTuple>, _kwargs: Option<&Bound<'_, PyDict>>) -> Self {
        Self {
            inner: OnceLock::new(),
        }
    }

    /// Builds the coordinator (once). `groups`: per group `(kind, param, spec_block_size,
    /// record_new_block_ids, admission_cap)`; `attention_groups`: hybrid only, `(group_ids,
    /// use_eagle, is_full)` with the full-attention ones first.
    #[pyo3(signature = (pool, mode, groups, eagle_groups, attention_groups, max_model_len, watermark_blocks, scheduler_block_size, retention_interval, dcp_world_size, pcp_world_size, clip, blocks_cls, empty, plain_requests = Vec::new(), event_classes = None))]
    #[allow(clippy::too_many_arguments)]
    fn _init_core(
        &self,
        py: Python<'_>,
        pool: Py<PyBlockPool>,
        mode: &str,
        groups: &Bound<'_, PyAny>,
        eagle_groups: Vec<bool>,
        attention_groups: Vec<(Vec<u32>, bool, bool)>,
        max_model_len: i64,
        watermark_blocks: i64,
        scheduler_block_size: i64,
        retention_interval: Option<usize>,
        dcp_world_size: i64,
        pcp_world_size: i64,
        clip: Vec<bool>,
        blocks_cls: PyObject,
        empty: PyObject,
        plain_requests: Vec<(Bound<'_, PyType>, Bound<'_, PyString>)>,
        event_classes: Option<[PyObject; 3]>,
    ) -> PyResult<()> {
        if self.inner.get().is_some() {
            return Err(to_pyerr(PoolError::Invariant(
                "the manager core is already initialised".into(),
            )));
        }
        let size = |v: i64, what: &str| {
            usize::try_from(v).map_err(|_| {
                to_pyerr(PoolError::Config(format!(
                    "{what} must be non-negative, got {v}"
                )))
            })
        };
        let max_model_len = size(max_model_len, "max_model_len")?;
        let watermark_blocks = size(watermark_blocks, "watermark_blocks")?;
        let scheduler_block_size = size(scheduler_block_size, "scheduler_block_size")?;
        let dcp_world_size = size(dcp_world_size, "dcp_world_size")?;
        let pcp_world_size = size(pcp_world_size, "pcp_world_size")?;
        let mode = match mode {
            "no_prefix_cache" => Mode::NoPrefixCache,
            "unitary" => Mode::Unitary,
            "hybrid" => Mode::Hybrid,
            other => {
                return Err(to_pyerr(PoolError::Config(format!(
                    "unknown coordinator {other:?}"
                ))))
            }
        };
        let mut held = lock_cell(py, pool.bind(py).get().cell(), "pool")?;
        let caching = held.core().enable_caching();
        let events = held.core().events_enabled();
        let deadlines = held.deadline_flag();
        let mut configs = Vec::new();
        for (i, g) in groups.try_iter()?.enumerate() {
            configs.push(group_config(
                &g?,
                i as u32,
                dcp_world_size,
                pcp_world_size,
                caching,
                scheduler_block_size,
            )?);
        }
        let cfg = CoordinatorConfig {
            mode,
            groups: configs,
            eagle_groups,
            attention_groups: attention_groups
                .into_iter()
                .map(|(group_ids, use_eagle, is_full)| AttentionGroup {
                    group_ids,
                    use_eagle,
                    is_full,
                })
                .collect(),
            max_model_len,
            watermark_blocks,
            scheduler_block_size,
            retention_interval,
        };
        let core = Coordinator::new(held.core_mut(), cfg).map_err(to_pyerr)?;
        drop(held);
        let plain = plain_requests
            .iter()
            .map(|(cls, tokens)| PlainClass::new(cls, tokens))
            .collect::<PyResult<Vec<_>>>()?;
        let reads_prompt = core.reads_prompt_len();
        let noop_possible = core.noop_possible();
        let num_groups = core.num_groups();
        let empty_blocks = empty.getattr(py, intern!(py, "blocks"))?;
        let inner = Inner {
            core: GilCell::new(core),
            pool,
            blocks_cls,
            empty,
            empty_blocks,
            cast: CoreCast::default(),
            caching,
            events,
            deadlines,
            num_groups,
            watermark: watermark_blocks > 0,
            reads_prompt,
            noop_possible,
            clip,
            plain,
            plain_hints: PlainHints::new(),
            event_classes,
        };
        self.inner
            .set(inner)
            .map_err(|_| invalid("the manager core is already initialised"))
    }

    /// SPEC MGR-6/7 without stats: `(hit blocks, hit tokens)`.
    fn _computed_blocks(
        slf: &Bound<'_, Self>,
        py: Python<'_>,
        request: &Bound<'_, PyAny>,
    ) -> PyResult<(PyObject, usize)> {
        let me = slf.get().me()?;
        let fields = me.fields(request);
        // The request is read first: nothing is held while a duck-typed request runs code.
        if !me.caching
            || fields
                .get(intern!(py, "skip_reading_prefix_cache"))?
                .is_truthy()?
        {
            return Ok((me.empty.clone_ref(py), 0));
        }
        let request_core = me.cast.borrow(request)?;
        let num_tokens = match &request_core {
            Some(c) => count(c.num_tokens, "num_tokens")?,
            None => fields.num_tokens()?,
        };
        if num_tokens == 0 {
            // The reference's walk over `num_tokens - 1` tokens raises ValueError (islice).
            return Err(invalid("a request without tokens has no prefix to look up"));
        }
        let mirror = request_core.as_ref().and_then(|c| c.mirrored_hashes(py));
        let hashes = match mirror {
            Some(_) => py.None().into_bound(py),
            None => fields.get(intern!(py, "block_hashes"))?,
        };
        let (hit, tokens) = me.lookup(py, &hashes, mirror, num_tokens - 1)?;
        let groups: Vec<&[BlockId]> = hit.iter().map(Vec::as_slice).collect();
        Ok((me.make_blocks(py, &groups)?, tokens))
    }

    /// SPEC ALLOC-1..13 in one call; see `KVCacheManager.allocate_slots`.
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
        let me = slf.get().me()?;
        // Hits: None or the shared empty instance mean "no hits object" (ALLOC-8).
        let mut hit_ids: Vec<Vec<BlockId>> = Vec::new();
        let mut hits_given = false;
        if let Some(ncb) = new_computed_blocks.filter(|o| !o.is_none()) {
            let groups = ncb.getattr(intern!(py, "blocks"))?;
            if !groups.is(&me.empty_blocks) {
                hits_given = true;
                hit_ids = me.read_groups(py, &groups)?;
            }
        }
        let args = AllocateArgs {
            num_new_tokens: num_new_tokens.0,
            num_new_computed_tokens: num_new_computed_tokens.0,
            new_computed_blocks: hits_given.then_some(hit_ids.as_slice()),
            num_lookahead_tokens: num_lookahead_tokens.0,
            num_external_computed_tokens: num_external_computed_tokens.0,
            delay_cache_blocks: delay_cache_blocks.0,
            num_encoder_tokens: num_encoder_tokens.0,
            full_sequence_must_fit: full_sequence_must_fit.0,
            reserved_blocks: reserved_blocks.0 as i64,
            has_scheduled_reqs: has_scheduled_reqs.0,
        };
        me.allocate_call(py, request, args)
    }

    /// `allocate_slots(request, n, num_lookahead_tokens=num_lookahead_tokens)` for each pair
    /// in order, stopping at the first request that does not fit; see
    /// `KVCacheManager.allocate_slots_batch`.
    #[pyo3(
        signature = (requests, num_new_tokens, num_lookahead_tokens = Count(0), allow_none = Flag(false)),
        text_signature = "($self, requests, num_new_tokens, num_lookahead_tokens=0, allow_none=False)"
    )]
    fn allocate_slots_batch<'py>(
        slf: &Bound<'_, Self>,
        py: Python<'py>,
        requests: &Bound<'py, PyAny>,
        num_new_tokens: &Bound<'py, PyAny>,
        num_lookahead_tokens: Count,
        allow_none: Flag,
    ) -> PyResult<Bound<'py, PyList>> {
        let me = slf.get().me()?;
        me.expire_due(py)?;
        let (Count(lookahead), Flag(allow_none)) = (num_lookahead_tokens, allow_none);
        let counts = counts_of(num_new_tokens, "num_new_tokens")?;
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
        let mut out: Vec<PyObject> = Vec::with_capacity(counts.len());
        let mut one = |request: &Bound<'py, PyAny>, n: usize, list| -> PyResult<bool> {
            match me.allocate(py, request, AllocateArgs::tokens(n, lookahead), list)? {
                None => return Ok(false),
                Some(flat) if allow_none && flat.is_empty() => out.push(py.None()),
                Some(flat) => out.push(Inner::tuple_of(py, &flat.groups())?.into_any().unbind()),
            }
            Ok(true)
        };
        if let Ok(list) = requests.downcast_exact::<PyList>() {
            // Indexed (the list's length is read again each time: a request's Python code
            // may change it), with the following requests' state prefetched.
            for (i, n) in counts.into_iter().enumerate() {
                let Ok(request) = list.get_item(i) else { break };
                if !one(&request, n, Some((list, i)))? {
                    break;
                }
            }
        } else {
            for (request, n) in requests.try_iter()?.zip(counts) {
                if !one(&request?, n, None)? {
                    break;
                }
            }
        }
        PyList::new(py, out)
    }

    /// SPEC MGR-20. The request's `retention_priority` / `retention_ttl_s` (kvcore extension),
    /// when it has them, place its cached blocks in the free queue.
    #[pyo3(text_signature = "($self, request)")]
    fn free(slf: &Bound<'_, Self>, py: Python<'_>, request: &Bound<'_, PyAny>) -> PyResult<()> {
        let fields = slf.get().me()?.fields(request);
        let id = fields.request_id()?;
        let retention = request_retention(&fields)?;
        slf.get().free_id(py, &id, retention)
    }

    /// SPEC MGR-20 with an explicit retention (kvcore extension, CC-1).
    fn _free_retained(
        &self,
        py: Python<'_>,
        request: &Bound<'_, PyAny>,
        retention: &Bound<'_, PyRetention>,
    ) -> PyResult<()> {
        let id = self.me()?.fields(request).request_id()?;
        self.free_id(py, &id, retention.get().retention())
    }

    /// SPEC MGR-21: the request's blocks, group by group in allocation order, not freed.
    #[pyo3(text_signature = "($self, request)")]
    fn pop_blocks_for_free(
        slf: &Bound<'_, Self>,
        py: Python<'_>,
        request: &Bound<'_, PyAny>,
    ) -> PyResult<Vec<BlockId>> {
        let me = slf.get().me()?;
        let id = me.fields(request).request_id()?;
        Ok(me.lock(py)?.pop(&id_key(&id)?))
    }

    /// SPEC MGR-25.
    #[pyo3(text_signature = "($self, request_id)")]
    fn get_blocks(
        slf: &Bound<'_, Self>,
        py: Python<'_>,
        request_id: &Bound<'_, PyAny>,
    ) -> PyResult<PyObject> {
        let id = id_key(request_id_of(request_id)?)?;
        let me = slf.get().me()?;
        let core = me.lock(py)?;
        let groups = core.blocks(&id);
        me.make_blocks(py, &groups)
    }

    /// SPEC MGR-25: a fresh list per group.
    #[pyo3(text_signature = "($self, request_id)")]
    fn get_block_ids<'py>(
        slf: &Bound<'_, Self>,
        py: Python<'py>,
        request_id: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyTuple>> {
        let id = id_key(request_id_of(request_id)?)?;
        let core = slf.get().me()?.lock(py)?;
        Inner::tuple_of(py, &core.blocks(&id))
    }

    /// SPEC MGR-26.
    #[pyo3(text_signature = "($self, request_id, num_computed_tokens)")]
    fn get_block_ids_for_computed_tokens<'py>(
        &self,
        py: Python<'py>,
        request_id: &Bound<'py, PyAny>,
        num_computed_tokens: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyTuple>> {
        let id = id_key(request_id_of(request_id)?)?;
        let n = count_of(num_computed_tokens, "num_computed_tokens")?;
        let me = self.me()?;
        let core = me.lock(py)?;
        Inner::tuple_of(py, &core.block_ids_for_computed_tokens(&id, n, &me.clip))
    }

    /// The pool's events in emission order (SPEC MGR-24): each `BlockStored` carries the
    /// spec kind and sliding window of its group from `self.kv_cache_event_metadata` (read
    /// when there are events), and all are built as the classes given at construction
    /// (kvcore's own by default). A group id the metadata has no entry for is logged and its
    /// fields left None.
    fn take_events(slf: &Bound<'_, Self>, py: Python<'_>) -> PyResult<Py<PyList>> {
        let me = slf.get().me()?;
        let pool = me.pool(py);
        if !PyBlockPool::has_pending_events(pool)? {
            return Ok(PyList::empty(py).unbind());
        }
        let group_meta: Vec<(PyObject, PyObject)> = slf
            .getattr(intern!(py, "kv_cache_event_metadata"))?
            .extract()?;
        let style = EventStyle {
            classes: me.event_classes.as_ref(),
            group_meta: Some(&group_meta),
        };
        let (events, unknown) = PyBlockPool::drain_events(pool, py, &style)?;
        if !unknown.is_empty() {
            log_unknown_groups(py, &unknown)?;
        }
        Ok(events)
    }

    /// SPEC MGR-22 / FA-2: one count per group.
    #[pyo3(text_signature = "($self, running_request_id)")]
    fn get_num_common_prefix_blocks(
        &self,
        py: Python<'_>,
        running_request_id: &Bound<'_, PyAny>,
    ) -> PyResult<Vec<usize>> {
        let id = id_key(request_id_of(running_request_id)?)?;
        let me = self.me()?;
        let mut core = me.lock(py)?;
        let pool = lock_cell(py, me.pool(py).get().cell(), "pool")?;
        Ok(core.get_num_common_prefix_blocks(pool.core(), &id))
    }

    /// SPEC MGR-27: caches the request's full blocks when caching is on.
    #[pyo3(text_signature = "($self, request, num_computed_tokens)")]
    fn cache_blocks(
        &self,
        py: Python<'_>,
        request: &Bound<'_, PyAny>,
        num_computed_tokens: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        if self.me()?.caching {
            self.coordinator_cache_blocks(py, request, num_computed_tokens)?;
        }
        Ok(())
    }

    /// SPEC MGR-22: frees the blocks outside the attention windows.
    #[pyo3(
        signature = (request_id, total_computed_tokens, num_prompt_tokens = None),
        text_signature = "($self, request_id, total_computed_tokens, num_prompt_tokens=None)"
    )]
    fn remove_skipped_blocks(
        &self,
        py: Python<'_>,
        request_id: &Bound<'_, PyAny>,
        total_computed_tokens: &Bound<'_, PyAny>,
        num_prompt_tokens: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        let id = id_key(request_id_of(request_id)?)?;
        let total = count_of(total_computed_tokens, "total_computed_tokens")?;
        let prompt = num_prompt_tokens
            .filter(|p| !p.is_none())
            .map(|p| count_of(p, "num_prompt_tokens"))
            .transpose()?;
        let me = self.me()?;
        let mut core = me.lock(py)?;
        let mut pool = lock_cell(py, me.pool(py).get().cell(), "pool")?;
        core.remove_skipped_blocks(pool.core_mut(), &id, total, prompt)
            .map_err(to_pyerr)
    }

    /// SPEC MGR-29: the ids allocated since the last call, group by group.
    #[pyo3(text_signature = "($self)")]
    fn take_new_block_ids(slf: &Bound<'_, Self>, py: Python<'_>) -> PyResult<Vec<BlockId>> {
        Ok(slf.get().me()?.lock(py)?.take_new_block_ids())
    }

    /// Replaces the manager's `prefix_cache_stats` by `fresh` and returns the stats it held
    /// (MGR-30), while holding the manager's state: a [`Self::_stats_call`] of another thread
    /// has ended or waits, so no lookup is counted into stats already handed out.
    #[pyo3(text_signature = "($self, fresh)")]
    fn _swap_stats(slf: &Bound<'_, Self>, fresh: &Bound<'_, PyAny>) -> PyResult<PyObject> {
        let py = slf.py();
        let _held = slf.get().me()?.lock(py)?;
        let name = intern!(py, "prefix_cache_stats");
        let old = slf.getattr(name)?;
        slf.setattr(name, fresh)?;
        Ok(old.unbind())
    }

    /// Calls `self.prefix_cache_stats.<method>(*args)`, unless the stats are None, while
    /// holding the manager's state, so that [`Self::_swap_stats`] waits for it (STAT-1).
    #[pyo3(signature = (method, *args), text_signature = "($self, method, *args)")]
    fn _stats_call(
        slf: &Bound<'_, Self>,
        method: &Bound<'_, PyString>,
        args: &Bound<'_, PyTuple>,
    ) -> PyResult<()> {
        let py = slf.py();
        let _held = slf.get().me()?.lock(py)?;
        let stats = slf.getattr(intern!(py, "prefix_cache_stats"))?;
        if !stats.is_none() {
            stats.call_method1(method, args)?;
        }
        Ok(())
    }

    /// SPEC MGR-30.
    #[pyo3(text_signature = "($self)")]
    fn new_step_starts(slf: &Bound<'_, Self>, py: Python<'_>) -> PyResult<()> {
        slf.get().me()?.lock(py)?.new_step_starts();
        Ok(())
    }

    // ----------------------------------------------------------------------------------------
    // The coordinator's calls (kvcore.coordinator)

    /// COORD-7/8/11: `(hit blocks per group, hit length)` for a hash list.
    fn coordinator_find_longest_cache_hit<'py>(
        &self,
        py: Python<'py>,
        block_hashes: &Bound<'py, PyAny>,
        max_cache_hit_length: Count,
    ) -> PyResult<(Bound<'py, PyTuple>, usize)> {
        let (hit, n) = self
            .me()?
            .lookup(py, block_hashes, None, max_cache_hit_length.0)?;
        let groups: Vec<&[BlockId]> = hit.iter().map(Vec::as_slice).collect();
        Ok((Inner::tuple_of(py, &groups)?, n))
    }

    /// COORD-12: `(hit blocks per group, hit length per group)`.
    fn coordinator_find_longest_cache_hit_per_group<'py>(
        &self,
        py: Python<'py>,
        block_hashes: &Bound<'py, PyAny>,
        max_cache_hit_length: Count,
    ) -> PyResult<(Bound<'py, PyTuple>, Vec<usize>)> {
        let me = self.me()?;
        let list = list_or_copy(block_hashes)?;
        let lazy = PyHashes::new(&list)?;
        let found = {
            let core = me.lock(py)?;
            let pool = lock_cell(py, me.pool(py).get().cell(), "pool")?;
            core.find_longest_cache_hit_per_group(pool.core(), &lazy, max_cache_hit_length.0)
        };
        lazy.finish()?;
        let (hit, lengths) = found.map_err(to_pyerr)?;
        let groups: Vec<&[BlockId]> = hit.iter().map(Vec::as_slice).collect();
        Ok((Inner::tuple_of(py, &groups)?, lengths))
    }

    /// The longest hit of the last hybrid lookup minus the hit kept (COORD-11).
    #[getter]
    fn num_uncached_common_prefix_tokens(&self, py: Python<'_>) -> PyResult<usize> {
        Ok(self.me()?.lock(py)?.num_uncached_common_prefix_tokens)
    }

    /// COORD-3.
    #[pyo3(signature = (request_id, num_tokens, new_computed_blocks, num_encoder_tokens, total_computed_tokens, num_tokens_main_model, apply_admission_cap = false))]
    #[allow(clippy::too_many_arguments)]
    fn coordinator_get_num_blocks_to_allocate(
        &self,
        py: Python<'_>,
        request_id: &Bound<'_, PyAny>,
        num_tokens: Count,
        new_computed_blocks: &Bound<'_, PyAny>,
        num_encoder_tokens: Count,
        total_computed_tokens: Count,
        num_tokens_main_model: Count,
        apply_admission_cap: bool,
    ) -> PyResult<i64> {
        let id = id_key(request_id_of(request_id)?)?;
        let me = self.me()?;
        let hits = me.read_groups(py, new_computed_blocks)?;
        let core = me.lock(py)?;
        let pool = lock_cell(py, me.pool(py).get().cell(), "pool")?;
        core.get_num_blocks_to_allocate(
            pool.core(),
            &id,
            num_tokens.0,
            Some(&hits),
            num_encoder_tokens.0,
            total_computed_tokens.0,
            num_tokens_main_model.0,
            apply_admission_cap,
        )
        .map_err(to_pyerr)
    }

    /// COORD-5.
    fn coordinator_allocate_new_computed_blocks(
        &self,
        py: Python<'_>,
        request_id: &Bound<'_, PyAny>,
        new_computed_blocks: &Bound<'_, PyAny>,
        num_local_computed_tokens: Count,
        num_external_computed_tokens: Count,
    ) -> PyResult<()> {
        let id = id_key(request_id_of(request_id)?)?;
        let me = self.me()?;
        let hits = me.read_groups(py, new_computed_blocks)?;
        let mut core = me.lock(py)?;
        let mut pool = lock_cell(py, me.pool(py).get().cell(), "pool")?;
        core.allocate_new_computed_blocks(
            pool.core_mut(),
            &id,
            Some(&hits),
            num_local_computed_tokens.0,
            num_external_computed_tokens.0,
        )
        .map_err(to_pyerr)
    }

    /// COORD-3: the new ids per group.
    #[pyo3(
        signature = (request_id, num_tokens, num_tokens_main_model, num_encoder_tokens = Count(0)),
        text_signature = "($self, request_id, num_tokens, num_tokens_main_model, num_encoder_tokens=0)"
    )]
    fn coordinator_allocate_new_blocks<'py>(
        &self,
        py: Python<'py>,
        request_id: &Bound<'py, PyAny>,
        num_tokens: Count,
        num_tokens_main_model: Count,
        num_encoder_tokens: Count,
    ) -> PyResult<Bound<'py, PyTuple>> {
        let id = id_key(request_id_of(request_id)?)?;
        let me = self.me()?;
        let mut core = me.lock(py)?;
        let mut pool = lock_cell(py, me.pool(py).get().cell(), "pool")?;
        let ranges = core
            .allocate_new_blocks(
                pool.core_mut(),
                &id,
                num_tokens.0,
                num_tokens_main_model.0,
                num_encoder_tokens.0,
            )
            .map_err(to_pyerr)?;
        drop(pool);
        let groups: Vec<&[BlockId]> = ranges
            .iter()
            .enumerate()
            .map(|(i, r)| &core.groups[i].blocks(&id)[r])
            .collect();
        Inner::tuple_of(py, &groups)
    }

    /// COORD-6 / COORD-10: caches the request's full blocks in every group, refusing first
    /// where it would fail part-way.
    fn coordinator_cache_blocks(
        &self,
        py: Python<'_>,
        request: &Bound<'_, PyAny>,
        num_computed_tokens: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let me = self.me()?;
        let n = count_of(num_computed_tokens, "num_computed_tokens")?;
        let fields = me.fields(request);
        let id_obj = fields.request_id()?;
        let id = id_key(&id_obj)?;
        let num_prompt_tokens =
            me.num_prompt_tokens(me.cast.borrow(request)?.as_deref(), &fields)?;
        let hashes = list_or_copy(&fields.get(intern!(py, "block_hashes"))?)?;
        let len = hashes.len()?;
        let source = if me.events && me.cast.cast(request).is_none() {
            Inner::meta_source(&fields)?
        } else {
            MetaSource::Request(request)
        };
        let mut get = |i: usize| -> Result<BlockHash, Error> { Ok(to_hash(&hashes.get_item(i)?)?) };
        let mut meta =
            |req: &MetaRequest<'_>| -> Result<StoredMeta, Error> { Ok(source.meta(req)?) };
        let mut core = me.lock(py)?;
        let view = RequestView {
            id: &id,
            num_computed_tokens: 0,
            num_tokens: 0,
            num_prompt_tokens,
            waiting_or_preempted: false,
            hints: &[],
        };
        let mut pool = lock_cell(py, me.pool(py).get().cell(), "pool")?;
        Ok(core.cache_blocks::<Error>(
            pool.core_mut(),
            &view,
            n,
            HashSource {
                len: &mut || Ok(len),
                get: &mut get,
            },
            &mut meta,
        )?)
    }

    /// MGR-20 by request id (the coordinator's `free`).
    #[pyo3(signature = (request_id, retention = None))]
    fn coordinator_free(
        &self,
        py: Python<'_>,
        request_id: &Bound<'_, PyAny>,
        retention: Option<&Bound<'_, PyRetention>>,
    ) -> PyResult<()> {
        let id = request_id_of(request_id)?;
        let retention = retention.map_or(Retention::DEFAULT, |r| r.get().retention());
        self.free_id(py, id, retention)
    }

    /// MGR-21 by request id.
    fn coordinator_pop_blocks_for_free(
        &self,
        py: Python<'_>,
        request_id: &Bound<'_, PyAny>,
    ) -> PyResult<Vec<BlockId>> {
        let id = id_key(request_id_of(request_id)?)?;
        Ok(self.me()?.lock(py)?.pop(&id))
    }

    // ----------------------------------------------------------------------------------------
    // One group's state (kvcore.single_type's views)

    /// Number of requests with an entry in group `group` (`len(req_to_blocks)`).
    fn group_num_requests(&self, py: Python<'_>, group: usize) -> PyResult<usize> {
        let core = self.me()?.lock(py)?;
        Ok(group_of(&core, group)?.tables.num_entries())
    }

    /// The request's blocks in group `group`, or None without an entry.
    fn group_blocks(
        &self,
        py: Python<'_>,
        group: usize,
        request_id: &Bound<'_, PyAny>,
    ) -> PyResult<Option<Vec<BlockId>>> {
        let id = id_key(request_id_of(request_id)?)?;
        let core = self.me()?.lock(py)?;
        let t = &group_of(&core, group)?.tables;
        Ok(t.contains(&id).then(|| t.blocks(&id).to_vec()))
    }

    /// The request's cached-block count in group `group`, or None when it is not running.
    fn group_num_cached_blocks(
        &self,
        py: Python<'_>,
        group: usize,
        request_id: &Bound<'_, PyAny>,
    ) -> PyResult<Option<usize>> {
        let id = id_key(request_id_of(request_id)?)?;
        let core = self.me()?.lock(py)?;
        Ok(group_of(&core, group)?
            .tables
            .get(&id)
            .and_then(|r| r.num_cached))
    }

    /// The ids of the requests with an entry in group `group`.
    fn group_request_ids(&self, py: Python<'_>, group: usize) -> PyResult<Vec<String>> {
        let core = self.me()?.lock(py)?;
        Ok(group_of(&core, group)?
            .tables
            .request_ids()
            .map(str::to_owned)
            .collect())
    }

    /// The reserved sink blocks of group `group` (SINK-1).
    fn group_sink_blocks(&self, py: Python<'_>, group: usize) -> PyResult<Vec<BlockId>> {
        let core = self.me()?.lock(py)?;
        Ok(group_of(&core, group)?.sink_blocks().to_vec())
    }

    /// Checks every group's tables and the pool; raises `InvariantViolationError` naming the
    /// first violation.
    fn check_invariants(&self, py: Python<'_>) -> PyResult<()> {
        let me = self.me()?;
        let core = me.lock(py)?;
        let pool = lock_cell(py, me.pool(py).get().cell(), "pool")?;
        core.check_invariants(pool.core())
            .map_err(|e| to_pyerr(PoolError::Invariant(e)))
    }

    /// Per group `(group id, the group's hashes)`: every `block_size / hash_block_size`-th of
    /// `block_hashes` (RH-3), as `pin_prefix` and `unpin_prefix` take them.
    fn _hashes_per_group<'py>(
        &self,
        py: Python<'py>,
        block_hashes: &Bound<'py, PyAny>,
    ) -> PyResult<Vec<(usize, Bound<'py, PyList>)>> {
        let list = list_or_copy(block_hashes)?;
        let indexes = self.me()?.lock(py)?.hash_indexes(list.len()?);
        indexes
            .into_iter()
            .enumerate()
            .map(|(gid, idx)| {
                let items = idx
                    .into_iter()
                    .map(|i| list.get_item(i))
                    .collect::<PyResult<Vec<_>>>()?;
                Ok((gid, PyList::new(py, items)?))
            })
            .collect()
    }

    /// Number of groups.
    #[getter]
    fn num_groups(&self) -> PyResult<usize> {
        Ok(self.me()?.num_groups)
    }

    /// How many plain requests' table keys and hints the manager keeps ([`PlainHints`]).
    #[getter]
    fn _num_plain_hints(&self, py: Python<'_>) -> PyResult<usize> {
        self.me()?.plain_hints.len(py)
    }
}

impl PyManagerCore {
    fn free_id(
        &self,
        py: Python<'_>,
        id: &Bound<'_, PyString>,
        retention: Retention,
    ) -> PyResult<()> {
        let me = self.me()?;
        // The clock is read before the manager is held.
        let now = if retention.ttl_s().is_some() {
            PyBlockPool::now(me.pool(py))?
        } else {
            0.0
        };
        let key = id_key(id)?;
        me.plain_hints.forget(id);
        let mut core = me.lock(py)?;
        let mut pool = lock_cell(py, me.pool(py).get().cell(), "pool")?;
        core.free(pool.core_mut(), &key, retention, now)
            .map_err(Error::Pool)?;
        pool.note_deadlines();
        Ok(())
    }
}

fn group_of(
    core: &Coordinator,
    group: usize,
) -> PyResult<&kvcore_core::single_type::SingleTypeManager> {
    core.groups
        .get(group)
        .ok_or_else(|| invalid(format!("no group {group}")))
}

/// The class's `allocate_slots` entry: a `METH_FASTCALL | METH_KEYWORDS` method installed over
/// the one pyo3 generates (see [`install_allocate_slots`]), which it keeps and calls for every
/// call but the scheduler's per-request shape.
///
/// vLLM's scheduler calls `allocate_slots(request, n, num_lookahead_tokens=k)` once per running
/// request and step. pyo3's generic parser matches the keyword against eleven parameter names
/// by string and fills nine defaults: about 500 instructions of a decode call's 2,800. This
/// entry recognises exactly that shape (two positional arguments, no keyword or the interned
/// `num_lookahead_tokens`, exact non-negative ints) and calls the same body with
/// [`AllocateArgs::tokens`]; anything else (other keywords, other types, a count pyo3 would
/// refuse) goes to pyo3's method unchanged, which parses it and raises its errors.
mod fast_entry {
    use std::ffi::CString;
    use std::panic::{catch_unwind, AssertUnwindSafe};

    use pyo3::exceptions::PyTypeError;
    use pyo3::ffi;
    use pyo3::intern;
    use pyo3::panic::PanicException;
    use pyo3::prelude::*;
    use pyo3::sync::GILOnceCell;
    use pyo3::types::{PyDict, PyString, PyTuple};

    use super::{AllocateArgs, PyManagerCore};
    use crate::args::{exact_int, COUNT_CAP};

    /// pyo3's `allocate_slots` method descriptor, which parses every other call shape.
    static GENERAL: GILOnceCell<PyObject> = GILOnceCell::new();

    /// Replaces `KVCacheManagerCore.allocate_slots` by the fast entry, with the same name,
    /// signature text and doc.
    pub(crate) fn install(py: Python<'_>) -> PyResult<()> {
        let ty = py.get_type::<PyManagerCore>();
        let name = intern!(py, "allocate_slots");
        let general = ty.getattr(name)?;
        let text_signature: String = general.getattr("__text_signature__")?.extract()?;
        let doc: String = general.getattr("__doc__")?.extract()?;
        let doc = CString::new(format!("allocate_slots{text_signature}\n--\n\n{doc}"))
            .map_err(|e| PyTypeError::new_err(e.to_string()))?;
        GENERAL
            .set(py, general.unbind())
            .map_err(|_| PyTypeError::new_err("allocate_slots is installed once"))?;
        // The method table entry must outlive the type: it is made once per process and kept.
        let def: &'static mut ffi::PyMethodDef = Box::leak(Box::new(ffi::PyMethodDef {
            ml_name: c"allocate_slots".as_ptr(),
            ml_meth: ffi::PyMethodDefPointer {
                PyCFunctionFastWithKeywords: allocate_slots,
            },
            ml_flags: ffi::METH_FASTCALL | ffi::METH_KEYWORDS,
            ml_doc: doc.into_raw(),
        }));
        #[allow(unsafe_code)]
        // SAFETY: the GIL is held; `ty` is a live type object and `def` a valid method entry
        // with 'static lifetime (leaked above, its name and doc NUL-terminated and never
        // freed). `PyDescr_NewMethod` returns a new reference or NULL with an exception set.
        let descr = unsafe {
            Bound::from_owned_ptr_or_err(py, ffi::PyDescr_NewMethod(ty.as_type_ptr(), def))
        }?;
        ty.setattr(name, descr)
    }

    /// The counts of the fast shape, or `None` when the call is anything else.
    fn fast_counts(
        py: Python<'_>,
        args: &[*mut ffi::PyObject],
        nargs: usize,
        kwnames: *mut ffi::PyObject,
    ) -> Option<(usize, usize)> {
        if nargs != 2 {
            return None;
        }
        let count = |ptr: *mut ffi::PyObject| -> Option<usize> {
            #[allow(unsafe_code)]
            // SAFETY: `ptr` is one of the call's arguments, which the caller keeps alive for
            // the duration of the call; it is only borrowed here.
            let obj = unsafe { pyo3::Borrowed::from_ptr(py, ptr) };
            // `count_of`'s rule for an exact int, read once.
            exact_int(&obj)?.count_capped(COUNT_CAP)
        };
        let lookahead = if kwnames.is_null() {
            0
        } else {
            #[allow(unsafe_code)]
            // SAFETY: for a METH_FASTCALL | METH_KEYWORDS method a non-NULL `kwnames` is a
            // tuple of str (CPython's calling convention), which the caller keeps alive for
            // the duration of the call; it is only borrowed here.
            let names = unsafe { pyo3::Borrowed::from_ptr(py, kwnames) };
            #[allow(unsafe_code)]
            // SAFETY: as above, `kwnames` is a tuple.
            let names = unsafe { names.downcast_unchecked::<PyTuple>() };
            if args.len() != 3
                || !names
                    .get_borrowed_item(0)
                    .ok()?
                    .is(intern!(py, "num_lookahead_tokens"))
            {
                return None;
            }
            count(args[2])?
        };
        Some((count(args[1])?, lookahead))
    }

    /// The call through pyo3's method: `general(self, *args, **kwargs)`.
    #[cold]
    #[inline(never)]
    fn general<'py>(
        slf: &Bound<'py, PyAny>,
        args: &[*mut ffi::PyObject],
        nargs: usize,
        kwnames: *mut ffi::PyObject,
    ) -> PyResult<Bound<'py, PyAny>> {
        let py = slf.py();
        #[allow(unsafe_code)]
        // SAFETY: every pointer in `args` is an argument of the current call (alive for its
        // duration); each is borrowed and then given its own reference by the tuple or dict.
        let borrow = |ptr: *mut ffi::PyObject| unsafe { pyo3::Borrowed::from_ptr(py, ptr) };
        let positional = std::iter::once(slf.clone())
            .chain(args[..nargs].iter().map(|&p| borrow(p).to_owned()))
            .collect::<Vec<_>>();
        let kwargs = PyDict::new(py);
        if !kwnames.is_null() {
            let names = borrow(kwnames);
            let names = names.downcast::<PyTuple>()?;
            for (name, &value) in names.iter().zip(&args[nargs..]) {
                kwargs.set_item(name.downcast_into::<PyString>()?, borrow(value))?;
            }
        }
        let general = GENERAL
            .get(py)
            .ok_or_else(|| PyTypeError::new_err("allocate_slots is not installed"))?;
        general
            .bind(py)
            .call(PyTuple::new(py, positional)?, Some(&kwargs))
    }

    /// The method body: the fast shape straight to [`super::Inner::allocate_call`], anything
    /// else through pyo3's method.
    fn call<'py>(
        slf: &Bound<'py, PyAny>,
        args: &[*mut ffi::PyObject],
        nargs: usize,
        kwnames: *mut ffi::PyObject,
    ) -> PyResult<Bound<'py, PyAny>> {
        let py = slf.py();
        let Some((n, lookahead)) = fast_counts(py, args, nargs, kwnames) else {
            return general(slf, args, nargs, kwnames);
        };
        #[allow(unsafe_code)]
        // SAFETY: a method descriptor checks that `self` is an instance of the class it was
        // made for (KVCacheManagerCore) before it calls the method.
        let me = unsafe { slf.downcast_unchecked::<PyManagerCore>() };
        #[allow(unsafe_code)]
        // SAFETY: `args[0]` is the call's first argument (`fast_counts` saw two positional
        // arguments), alive for the duration of the call.
        let request = unsafe { pyo3::Borrowed::from_ptr(py, args[0]) };
        let out = me
            .get()
            .me()?
            .allocate_call(py, &request, AllocateArgs::tokens(n, lookahead))?;
        Ok(match out {
            Some(blocks) => blocks.into_bound(py),
            None => py.None().into_bound(py),
        })
    }

    /// The C entry point.
    ///
    /// # Safety
    /// Called by CPython's method descriptor with the GIL held: `slf` an instance of the
    /// class, `args` pointing to `nargs` positional arguments followed by one value per name in
    /// `kwnames` (NULL when there are none), all alive for the duration of the call.
    #[allow(unsafe_code)]
    unsafe extern "C" fn allocate_slots(
        slf: *mut ffi::PyObject,
        args: *const *mut ffi::PyObject,
        nargs: ffi::Py_ssize_t,
        kwnames: *mut ffi::PyObject,
    ) -> *mut ffi::PyObject {
        // SAFETY: CPython calls a C method with the GIL held.
        let py = unsafe { Python::assume_gil_acquired() };
        let nargs = usize::try_from(nargs).unwrap_or(0);
        let nkw = if kwnames.is_null() {
            0
        } else {
            // SAFETY: a non-NULL `kwnames` of a fastcall method is a live tuple.
            usize::try_from(unsafe { ffi::PyTuple_Size(kwnames) }).unwrap_or(0)
        };
        let args: &[*mut ffi::PyObject] = if nargs + nkw == 0 {
            &[]
        } else {
            // SAFETY: `args` points to `nargs` positional and `nkw` keyword values.
            unsafe { std::slice::from_raw_parts(args, nargs + nkw) }
        };
        // SAFETY: `slf` is the live instance the method is called on, which the caller keeps
        // alive for the duration of the call; it is only borrowed here.
        let slf = unsafe { pyo3::Borrowed::from_ptr(py, slf) };
        let result = catch_unwind(AssertUnwindSafe(|| call(&slf, args, nargs, kwnames)))
            .unwrap_or_else(panicked);
        match result {
            Ok(obj) => obj.into_ptr(),
            Err(err) => raise(py, err),
        }
    }

    /// The error a caught panic becomes.
    #[cold]
    #[inline(never)]
    fn panicked<'py>(payload: Box<dyn std::any::Any + Send>) -> PyResult<Bound<'py, PyAny>> {
        let msg = payload
            .downcast_ref::<String>()
            .cloned()
            .or_else(|| payload.downcast_ref::<&str>().map(|s| (*s).to_owned()))
            .unwrap_or_else(|| "panic in allocate_slots".to_owned());
        Err(PanicException::new_err(msg))
    }

    /// Sets `err` as the current exception: the entry then returns NULL.
    #[cold]
    #[inline(never)]
    fn raise(py: Python<'_>, err: PyErr) -> *mut ffi::PyObject {
        err.restore(py);
        std::ptr::null_mut()
    }
}

pub(crate) use fast_entry::install as install_allocate_slots;

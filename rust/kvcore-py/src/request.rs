//! `kvcore._native.RequestCore`: the per-step state of a request, kept in one native object.
//!
//! `kvcore.request.Request` subclasses it. The fields every scheduler step reads or writes
//! (the id, token counts, status, token ids and block hashes) live here, so that
//! `append_output_token_ids` runs without a Python frame, the Rust manager reads a request's
//! counts straight from the struct instead of through attribute lookups, and block hashing
//! reads token ids from a native buffer instead of Python ints.

use std::sync::OnceLock;

use kvcore_core::hash::BlockHash;
use kvcore_core::prefetch::{prefetch, prefetch_lines};
use kvcore_core::tables::HintCell;
use pyo3::basic::CompareOp;
use pyo3::exceptions::PyIndexError;
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyInt, PyIterator, PyList, PySlice, PyString, PyTuple, PyType};
use pyo3::{PyTraverseError, PyVisit};

use crate::args::{exact_i64, id_key};
use crate::blocks::eq_result;
use crate::errors::{error, Kind};
use crate::hashing::{py_hash, tokens_any, PyRequestBlockHasher};
use crate::pool::to_hash;

/// Native base of `kvcore.request.Request`; see the module docs.
///
/// `repr(C)` with the fields every step reads first, so that a step's reads share the object's
/// first cache lines (the batch calls prefetch the whole object, for pyo3's borrow flag after
/// the struct).
#[pyclass(module = "kvcore._native", name = "RequestCore", subclass, weakref)]
#[repr(C)]
pub struct PyRequestCore {
    /// Prompt plus output tokens (kept equal to `len(all_token_ids)` by the appends).
    #[pyo3(get, set)]
    pub(crate) num_tokens: i64,
    /// Tokens whose KV is computed; the scheduler maintains it.
    #[pyo3(get, set)]
    pub(crate) num_computed_tokens: i64,
    /// The prompt's length (window groups and retention read it on every allocation).
    #[pyo3(get, set)]
    pub(crate) num_prompt_tokens: i64,
    /// `int(status)`, or -1 when the status is not an int.
    pub(crate) status_value: i64,
    /// Token count at which the next hash block is full.
    #[pyo3(get, set, name = "_next_hash_at")]
    next_hash_at: i64,
    /// The length `block_hashes` had when `next_hash_at` was computed: a list shortened or
    /// replaced since (the reference hashes from its current length) voids the threshold.
    hashes_len_at: usize,
    /// Prompt and output token ids (`all_token_ids` is a view of them); 0 (or the int's
    /// value) where `exotic` holds the token.
    tokens: Vec<i64>,
    /// The tokens that are ints of the int64 range but not exact ints (a bool, an int
    /// subclass), by position, in order. They are kept as given, so that views and hashes
    /// see what the reference sees (pickle and CBOR write `True`, not `1`); a window holding
    /// one is hashed and reported by the Python paths. Empty in practice.
    exotic: Vec<(usize, PyObject)>,
    /// Where the Rust manager last found this request's entries in groups 0 to 3 (skips the
    /// id lookups); the manager refreshes them.
    pub(crate) hints: [HintCell; 4],
    /// A native copy of `block_hashes`, kept as hashes are appended through this object; the
    /// Rust manager reads it instead of the list while their lengths agree.
    mirror: Vec<BlockHash>,
    request_id: Py<PyString>,
    /// UTF-8 copy of `request_id`, the key of the manager's block tables.
    pub(crate) id: String,
    status: PyObject,
    /// Where the output tokens start in `tokens` (the prompt length).
    output_start: usize,
    /// Hashes of the full hash blocks, append-only (SPEC RH-2).
    #[pyo3(get)]
    block_hashes: PyObject,
    /// The block hasher, or None.
    #[pyo3(get, set, name = "_block_hasher")]
    block_hasher: PyObject,
    /// The hasher's window size when it says it (appends skip the hasher until the next
    /// window is full), else None.
    #[pyo3(get, set, name = "_hash_block_size")]
    hash_block_size: Option<i64>,
}

#[pymethods]
impl PyRequestCore {
    /// Empty state; `kvcore.request.Request.__init__` fills it in.
    #[new]
    #[pyo3(signature = (*_args, **_kwargs))]
    fn new(
        py: Python<'_>,
        _args: &Bound<'_, PyTuple>,
        _kwargs: Option<&Bound<'_, PyDict>>,
    ) -> Self {
        Self {
            request_id: PyString::new(py, "").unbind(),
            id: String::new(),
            num_tokens: 0,
            num_computed_tokens: 0,
            num_prompt_tokens: 0,
            status: py.None(),
            status_value: -1,
            tokens: Vec::new(),
            exotic: Vec::new(),
            output_start: 0,
            block_hashes: PyList::empty(py).into_any().unbind(),
            mirror: Vec::new(),
            next_hash_at: 0,
            hashes_len_at: 0,
            block_hasher: py.None(),
            hash_block_size: None,
            hints: Default::default(),
        }
    }

    /// Lets the cycle collector see the objects this request holds (a hasher or a status
    /// object that refers back to the request would otherwise keep it alive forever).
    fn __traverse__(&self, visit: PyVisit<'_>) -> Result<(), PyTraverseError> {
        visit.call(&self.request_id)?;
        visit.call(&self.status)?;
        visit.call(&self.block_hashes)?;
        visit.call(&self.block_hasher)?;
        for (_, obj) in &self.exotic {
            visit.call(obj)?;
        }
        Ok(())
    }

    /// Breaks cycles through the objects that can hold one (status, hashes, hasher).
    fn __clear__(&mut self) {
        Python::with_gil(|py| {
            self.status = py.None();
            self.block_hashes = py.None();
            self.block_hasher = py.None();
            self.mirror.clear();
        });
        self.exotic.clear();
    }

    #[setter]
    fn set_block_hashes(&mut self, value: PyObject) {
        self.mirror.clear();
        self.block_hashes = value;
    }

    /// Unique id.
    #[getter]
    fn request_id(&self, py: Python<'_>) -> Py<PyString> {
        self.request_id.clone_ref(py)
    }

    #[setter]
    fn set_request_id(&mut self, value: Bound<'_, PyString>) -> PyResult<()> {
        self.id = id_key(&value)?.into_owned();
        self.request_id = value.unbind();
        for h in &self.hints {
            h.set(None);
        }
        Ok(())
    }

    /// The request status (SPEC REQ-3).
    #[getter]
    fn status(&self, py: Python<'_>) -> PyObject {
        self.status.clone_ref(py)
    }

    #[setter]
    fn set_status(&mut self, value: Bound<'_, PyAny>) {
        self.status_value = value.extract::<i64>().unwrap_or(-1);
        self.status = value.unbind();
    }

    /// Prompt and output token ids: a live, read-only view (use `append_output_token_ids`).
    #[getter]
    fn all_token_ids(slf: &Bound<'_, Self>) -> PyTokenIds {
        PyTokenIds {
            req: slf.clone().unbind(),
            output: false,
        }
    }

    /// Output token ids: a live, read-only view of `all_token_ids` after the prompt.
    #[getter]
    fn output_token_ids(slf: &Bound<'_, Self>) -> PyTokenIds {
        PyTokenIds {
            req: slf.clone().unbind(),
            output: true,
        }
    }

    /// Number of output tokens.
    #[getter]
    fn num_output_tokens(&self) -> usize {
        self.tokens.len().saturating_sub(self.output_start)
    }

    #[getter(_all_token_ids)]
    fn get_all(slf: &Bound<'_, Self>) -> PyTokenIds {
        Self::all_token_ids(slf)
    }

    /// Replaces the token ids (ints in the int64 range); all of them become the prompt
    /// (outputs are appended after). `num_tokens` is left to the caller.
    #[setter(_all_token_ids)]
    fn set_all(slf: &Bound<'_, Self>, value: Bound<'_, PyAny>) -> PyResult<()> {
        // Read before borrowing: iterating may run Python code.
        let (tokens, exotic) = token_vec(&value)?;
        let mut this = slf.try_borrow_mut()?;
        this.output_start = tokens.len();
        this.tokens = tokens;
        this.exotic = exotic;
        Ok(())
    }

    #[getter(_output_token_ids)]
    fn get_output(slf: &Bound<'_, Self>) -> PyTokenIds {
        Self::output_token_ids(slf)
    }

    /// Replaces the output tokens (the token ids after the prompt).
    #[setter(_output_token_ids)]
    fn set_output(slf: &Bound<'_, Self>, value: Bound<'_, PyAny>) -> PyResult<()> {
        let (tokens, exotic) = token_vec(&value)?;
        let mut this = slf.try_borrow_mut()?;
        let start = this.output_start.min(this.tokens.len());
        this.tokens.truncate(start);
        this.exotic.retain(|(i, _)| *i < start);
        this.exotic
            .extend(exotic.into_iter().map(|(i, obj)| (start + i, obj)));
        this.tokens.extend_from_slice(&tokens);
        Ok(())
    }

    /// Appends output tokens and hashes any newly completed blocks (SPEC RH-2).
    ///
    /// Takes one int or an iterable of ints (each within the int64 range; an int subclass such
    /// as `bool` is kept as given). When the token count reaches the next full hash block,
    /// `self.update_block_hashes()` runs. A bad token raises before anything is appended, and
    /// when the hasher raises the appended tokens are taken back.
    fn append_output_token_ids(
        slf: &Bound<'_, Self>,
        token_ids: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        Self::append_one(slf, token_ids)
    }

    /// Runs the block hasher and appends the hashes of new full blocks (SPEC RH-2).
    ///
    /// A native hasher (`kvcore.hashing.get_request_block_hasher` for the four hash functions)
    /// reads the tokens straight from this object; any other hasher is called as
    /// `hasher(request)`. Without a hasher, appends stop trying.
    fn update_block_hashes(slf: &Bound<'_, Self>) -> PyResult<()> {
        Self::update_hashes(slf)
    }
}

/// Downcasts to [`PyRequestCore`], remembering the first class that passed: the requests a
/// manager sees share one class, whose check (pyo3's lazy type object, then the subclass
/// walk) otherwise costs as much as the work of a decode step.
#[derive(Default)]
pub(crate) struct CoreCast {
    /// A class already checked to be `RequestCore` or a subclass. Held strongly, so that its
    /// address can name no other class while it is remembered.
    verified: OnceLock<Py<PyType>>,
    /// A class already checked not to be one (a duck-typed request class, e.g. vLLM's): a
    /// class cannot gain `RequestCore`'s layout later, so the subclass walk is not repeated.
    rejected: OnceLock<Py<PyType>>,
}

impl CoreCast {
    /// `obj` as a `RequestCore`, or `None` for any other object.
    #[inline]
    pub(crate) fn cast<'a, 'py>(
        &self,
        obj: &'a Bound<'py, PyAny>,
    ) -> Option<&'a Bound<'py, PyRequestCore>> {
        if let Some(t) = self.verified.get() {
            if std::ptr::eq(obj.get_type_ptr(), t.as_ptr().cast()) {
                #[allow(unsafe_code)]
                // SAFETY: `obj`'s class is `verified`, which passed `downcast::<PyRequestCore>`
                // in `check` (it is `RequestCore` or a subclass) and is kept alive by this
                // cache, so its address cannot have been reused by another class: `obj` has
                // `PyRequestCore`'s layout, which is all `downcast_unchecked` requires.
                return Some(unsafe { obj.downcast_unchecked::<PyRequestCore>() });
            }
        }
        self.check(obj)
    }

    /// [`Self::cast`] for a class other than the verified one (a duck-typed class, or a class
    /// seen the first time); kept out of line so that the verified test inlines small.
    #[inline(never)]
    fn check<'a, 'py>(&self, obj: &'a Bound<'py, PyAny>) -> Option<&'a Bound<'py, PyRequestCore>> {
        if let Some(t) = self.rejected.get() {
            if std::ptr::eq(obj.get_type_ptr(), t.as_ptr().cast()) {
                return None;
            }
        }
        let Ok(core) = obj.downcast::<PyRequestCore>() else {
            let _ = self.rejected.set(obj.get_type().unbind());
            return None;
        };
        let _ = self.verified.set(obj.get_type().unbind());
        Some(core)
    }

    /// A shared borrow of `request`'s native state when it is a kvcore `Request`, else `None`
    /// (a duck-typed request, read through attributes).
    pub(crate) fn borrow<'py>(
        &self,
        request: &Bound<'py, PyAny>,
    ) -> PyResult<Option<PyRef<'py, PyRequestCore>>> {
        match self.cast(request) {
            Some(c) => Ok(Some(c.try_borrow()?)),
            None => Ok(None),
        }
    }
}

impl PyRequestCore {
    /// The block hashes as native values, when the mirror matches the `block_hashes` list.
    pub(crate) fn mirrored_hashes(&self, py: Python<'_>) -> Option<&[BlockHash]> {
        let list = self.block_hashes.bind(py).downcast::<PyList>().ok()?;
        (crate::args::list_len(list) == self.mirror.len()).then_some(self.mirror.as_slice())
    }

    /// The token ids `range` as ints, or `None` when the range is past the end or holds a
    /// token that is not an int64 int (the callers then take the Python path).
    pub(crate) fn int_window(&self, range: std::ops::Range<usize>) -> Option<&[i64]> {
        if self
            .exotic
            .iter()
            .any(|(i, _)| range.start <= *i && *i < range.end)
        {
            return None;
        }
        self.tokens.get(range)
    }

    /// Prefetches where the next token id goes (a batch's second stage).
    fn prefetch_token_tail(&self) {
        prefetch(self.tokens.as_ptr().wrapping_add(self.tokens.len()));
    }

    /// `append_output_token_ids` without a Python call.
    fn append_one(slf: &Bound<'_, Self>, token_ids: &Bound<'_, PyAny>) -> PyResult<()> {
        let (tokens_before, exotic_before) = {
            let this = slf.try_borrow()?;
            (this.tokens.len(), this.exotic.len())
        };
        let need_hash = if let Ok(tok) = token_ids.downcast::<PyInt>() {
            let exact = exact_i64(tok.as_any());
            let value = match exact {
                Some(v) => v,
                None => int64_token(tok.as_any())?,
            };
            let mut this = slf.try_borrow_mut()?;
            if exact.is_none() {
                let at = this.tokens.len();
                this.exotic.push((at, tok.clone().into_any().unbind()));
            }
            this.tokens.push(value);
            this.num_tokens = this.tokens.len() as i64;
            this.num_tokens >= this.next_hash_at || this.hashes_moved(slf.py())
        } else {
            // Iterating may run Python code: no borrow is held while it does.
            let (values, exotic) = token_vec(token_ids)?;
            let mut this = slf.try_borrow_mut()?;
            let at = this.tokens.len();
            this.exotic
                .extend(exotic.into_iter().map(|(i, obj)| (at + i, obj)));
            this.tokens.extend_from_slice(&values);
            this.num_tokens = this.tokens.len() as i64;
            this.num_tokens >= this.next_hash_at || this.hashes_moved(slf.py())
        };
        if need_hash {
            if let Err(err) = Self::update_hashes(slf) {
                // The hasher failed (e.g. an extra key it cannot serialise): the call is
                // refused whole, so the tokens it appended are taken back (the reference keeps
                // them; a refused call here changes nothing).
                let mut this = slf.try_borrow_mut()?;
                this.tokens.truncate(tokens_before);
                this.exotic.truncate(exotic_before);
                this.num_tokens = this.tokens.len() as i64;
                return Err(err);
            }
        }
        Ok(())
    }

    /// The length of `block_hashes` (`usize::MAX` when it is not a list).
    fn hashes_len(&self, py: Python<'_>) -> usize {
        self.block_hashes
            .bind(py)
            .downcast::<PyList>()
            .map_or(usize::MAX, |l| l.len())
    }

    /// Whether `block_hashes` changed length since the hashing threshold was computed.
    #[inline]
    fn hashes_moved(&self, py: Python<'_>) -> bool {
        self.hashes_len(py) != self.hashes_len_at
    }

    /// `update_block_hashes` without a Python call.
    fn update_hashes(slf: &Bound<'_, Self>) -> PyResult<()> {
        let py = slf.py();
        let (hasher, hashes, num_tokens) = {
            let this = slf.try_borrow()?;
            if this.block_hasher.is_none(py) {
                drop(this);
                let mut this = slf.try_borrow_mut()?;
                this.next_hash_at = i64::MAX;
                this.hashes_len_at = this.hashes_len(py);
                return Ok(());
            }
            (
                this.block_hasher.clone_ref(py),
                this.block_hashes.clone_ref(py),
                this.num_tokens,
            )
        };
        let (hasher, hashes) = (hasher.bind(py), hashes.bind(py));
        let list = hashes.downcast::<PyList>().ok();
        let before = list.map(|l| l.len());
        let in_sync = before == Some(slf.try_borrow()?.mirror.len());
        let mut done = false;
        if let (Ok(native), Some(list)) = (hasher.downcast::<PyRequestBlockHasher>(), list) {
            let n = usize::try_from(num_tokens).unwrap_or(0);
            if let Some(new) = native.get().new_hashes_of(slf, list, n)? {
                for h in &new {
                    list.append(py_hash(py, h))?;
                }
                let mut this = slf.try_borrow_mut()?;
                if in_sync && this.block_hashes.is(hashes) {
                    this.mirror.extend_from_slice(&new);
                } else {
                    this.mirror.clear();
                }
                done = true;
            }
        }
        if !done {
            let new = hasher.call1((slf,))?;
            hashes.call_method1(intern!(py, "extend"), (new,))?;
            // Mirror what the Python hasher appended, or give the mirror up.
            let mut added = Vec::new();
            let mut ok = in_sync;
            if let (true, Some(list), Some(before)) = (ok, list, before) {
                for i in before..crate::args::list_len(list) {
                    match to_hash(&list.get_item(i)?) {
                        Ok(h) => added.push(h),
                        Err(_) => {
                            ok = false;
                            break;
                        }
                    }
                }
            }
            let mut this = slf.try_borrow_mut()?;
            if ok && this.block_hashes.is(hashes) {
                this.mirror.extend_from_slice(&added);
            } else {
                this.mirror.clear();
            }
        }
        let hbs = slf.try_borrow()?.hash_block_size;
        if let Some(hbs) = hbs {
            let n = hashes.len()?;
            let len = i64::try_from(n).unwrap_or(i64::MAX);
            let mut this = slf.try_borrow_mut()?;
            this.next_hash_at = len.saturating_add(1).saturating_mul(hbs);
            this.hashes_len_at = n;
        }
        Ok(())
    }
}

/// Appends `token_ids[i]` (an int or a sequence of ints) to `requests[i]` for every `i`, as
/// `requests[i].append_output_token_ids(token_ids[i])` does, in one call.
///
/// A request whose class keeps `RequestCore`'s own `append_output_token_ids` is appended to
/// natively; any other object (a duck-typed request, or a subclass overriding the method) has
/// its method called.
///
/// Raises:
///     InvalidArgumentError: The two sequences differ in length (nothing is appended).
///     TypeError: An entry is neither an int nor iterable; the requests before it keep their
///         tokens, as in the loop.
#[pyfunction]
pub fn append_output_token_ids_batch(
    requests: &Bound<'_, PyAny>,
    token_ids: &Bound<'_, PyAny>,
) -> PyResult<()> {
    let py = requests.py();
    let name = intern!(py, "append_output_token_ids");
    let (n, m) = (requests.len()?, token_ids.len()?);
    if n != m {
        return Err(crate::errors::invalid(format!(
            "{n} requests but {m} token entries"
        )));
    }
    let base = py.get_type::<PyRequestCore>().getattr(name)?;
    let mut last_type: Option<Bound<'_, PyType>> = None;
    let mut last_native = false;
    let list = requests.downcast_exact::<PyList>().ok();
    let cast = CoreCast::default();
    for (i, (request, tokens)) in requests.try_iter()?.zip(token_ids.try_iter()?).enumerate() {
        if let Some(list) = list {
            prefetch_ahead(list, i, &cast, |core| core.prefetch_token_tail());
        }
        let (request, tokens) = (request?, tokens?);
        let native = match &last_type {
            Some(t) if std::ptr::eq(t.as_type_ptr(), request.get_type_ptr()) => last_native,
            _ => {
                let ty = request.get_type();
                let native = cast.cast(&request).is_some() && ty.getattr(name)?.is(&base);
                last_type = Some(ty);
                last_native = native;
                native
            }
        };
        match cast.cast(&request).filter(|_| native) {
            Some(core) => PyRequestCore::append_one(core, &tokens)?,
            None => {
                request.call_method1(name, (tokens,))?;
            }
        }
    }
    Ok(())
}

/// How far ahead a batch prefetches request objects; the second stage runs half as far.
const AHEAD: usize = 8;

/// Cache lines a request object spans (header, `PyRequestCore`, pyo3's borrow flag).
const OBJECT_LINES: usize =
    (16 + std::mem::size_of::<PyRequestCore>() + 2 * std::mem::size_of::<usize>()).div_ceil(64);

/// A batch's prefetch pipeline over the requests in `list`, at iteration `i`: the object
/// `AHEAD` items on (first stage), and `second` on the native state of the one `AHEAD / 2` on,
/// whose lines the first stage fetched earlier.
pub(crate) fn prefetch_ahead(
    list: &Bound<'_, PyList>,
    i: usize,
    cast: &CoreCast,
    second: impl FnOnce(&PyRequestCore),
) {
    let n = crate::args::list_len(list);
    if i + AHEAD < n {
        // The whole object: pyo3 keeps the borrow flag after the struct, on its last line.
        prefetch_lines(list_item_addr(list, i + AHEAD), OBJECT_LINES);
    }
    if i + AHEAD / 2 < n {
        let ptr = list_item_addr(list, i + AHEAD / 2)
            .cast_mut()
            .cast::<pyo3::ffi::PyObject>();
        #[allow(unsafe_code)]
        // SAFETY: `i + AHEAD / 2 < len(list)`, so `ptr` is the list's own (borrowed) reference
        // to a live object, which the list keeps alive: nothing below runs Python code or
        // touches the list, and the reference is not kept past this block.
        let item = unsafe { pyo3::Borrowed::from_ptr(list.py(), ptr) };
        if let Some(core) = cast.cast(&item) {
            if let Ok(c) = core.try_borrow() {
                second(&c);
            }
        }
    }
}

/// The address of `list[i]` (`i < len(list)`), read without touching the object.
fn list_item_addr(list: &Bound<'_, PyList>, i: usize) -> *const u8 {
    #[allow(unsafe_code)]
    // SAFETY: `list` is a live list and the GIL is held; PyList_GetItem returns a borrowed
    // pointer (or NULL with an IndexError set when `i` is out of range, which callers rule
    // out). The pointer is only handed to `prefetch` as an address, never dereferenced, so
    // its lifetime does not matter.
    unsafe {
        pyo3::ffi::PyList_GetItem(list.as_ptr(), i as pyo3::ffi::Py_ssize_t).cast::<u8>()
    }
}

/// Token ids read from a list, tuple or any iterable, before anything changes: the int64
/// values, and the tokens that are not exact int64 ints by their position in `obj`.
type TokenRead = (Vec<i64>, Vec<(usize, PyObject)>);

/// Token ids from a list, tuple or any iterable (see [`TokenRead`]).
fn token_vec(obj: &Bound<'_, PyAny>) -> PyResult<TokenRead> {
    // Lists and tuples of exact int64 ints are read borrowed; anything else (an int subclass,
    // another object, another iterable) goes through the iterator.
    match tokens_any(obj) {
        Some(tokens) => Ok((tokens, Vec::new())),
        None => token_iter(obj),
    }
}

/// [`token_vec`] through the iterator protocol.
fn token_iter(obj: &Bound<'_, PyAny>) -> PyResult<TokenRead> {
    let mut out = Vec::new();
    let mut exotic = Vec::new();
    for item in obj.try_iter()? {
        let item = item?;
        match exact_i64(&item) {
            Some(v) => out.push(v),
            None => {
                let v = int64_token(&item)?;
                exotic.push((out.len(), item.clone().unbind()));
                out.push(v);
            }
        }
    }
    Ok((out, exotic))
}

/// A token that is not an exact int64 int: its value when it is an int (a bool, an int
/// subclass) in the int64 range. Token ids must be such ints (a documented deviation: the
/// reference stores any object): `InvalidArgumentError` beyond int64, `ArgumentTypeError` for
/// anything else.
fn int64_token(item: &Bound<'_, PyAny>) -> PyResult<i64> {
    if !item.is_instance_of::<PyInt>() {
        let name = item
            .get_type()
            .name()
            .map_or_else(|_| "?".to_owned(), |n| n.to_string());
        return Err(error(
            Kind::ArgumentType,
            format!("token ids must be ints, got {name}"),
        ));
    }
    item.extract::<i64>().map_err(|_| {
        error(
            Kind::InvalidArgument,
            format!("token id {item} is outside the int64 range"),
        )
    })
}

/// `Request.all_token_ids` and `Request.output_token_ids`: live, read-only views of a
/// request's token ids (all of them, or those after the prompt) that follow later appends.
/// Compare equal to a list (or another view) with the same items; indexing, slicing (a new
/// list), iteration, `in`, `index`, `count` and `len` work as on a list.
#[pyclass(module = "kvcore._native", name = "TokenIds", frozen, sequence)]
pub struct PyTokenIds {
    req: Py<PyRequestCore>,
    /// Whether the view starts after the prompt.
    output: bool,
}

impl PyTokenIds {
    /// Runs `f` on the request and the index where the view starts.
    fn with<R>(&self, py: Python<'_>, f: impl FnOnce(&PyRequestCore, usize) -> R) -> PyResult<R> {
        let this = self.req.bind(py).try_borrow()?;
        let start = if self.output {
            this.output_start.min(this.tokens.len())
        } else {
            0
        };
        Ok(f(&this, start))
    }

    /// The request's tokens `[a, b)` as a new list, exotic tokens as they were given.
    fn list_of<'py>(
        py: Python<'py>,
        this: &PyRequestCore,
        a: usize,
        b: usize,
    ) -> PyResult<Bound<'py, PyList>> {
        let list = PyList::new(py, &this.tokens[a..b])?;
        for (i, obj) in &this.exotic {
            if a <= *i && *i < b {
                list.set_item(i - a, obj.clone_ref(py))?;
            }
        }
        Ok(list)
    }

    /// Token `i` of the request as a Python object.
    fn item<'py>(py: Python<'py>, this: &PyRequestCore, i: usize) -> PyResult<Bound<'py, PyAny>> {
        if let Ok(k) = this.exotic.binary_search_by_key(&i, |(j, _)| *j) {
            return Ok(this.exotic[k].1.bind(py).clone());
        }
        Ok(this.tokens[i].into_pyobject(py)?.into_any())
    }

    /// The viewed token ids as a new list.
    fn tail<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        self.with(py, |this, start| {
            Self::list_of(py, this, start, this.tokens.len())
        })?
    }
}

#[pymethods]
impl PyTokenIds {
    fn __len__(&self, py: Python<'_>) -> PyResult<usize> {
        self.with(py, |this, start| this.tokens.len() - start)
    }

    fn __getitem__<'py>(
        &self,
        py: Python<'py>,
        index: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyAny>> {
        if let Ok(i) = index.extract::<isize>() {
            return self.with(py, |this, start| {
                let n = (this.tokens.len() - start) as isize;
                let j = if i < 0 { i + n } else { i };
                if (0..n).contains(&j) {
                    Self::item(py, this, start + j as usize)
                } else {
                    Err(PyIndexError::new_err("token index out of range"))
                }
            })?;
        }
        if let Ok(slice) = index.downcast::<PySlice>() {
            // Only the selected items become ints (the hasher and the event path slice windows).
            return self.with(py, |this, start| -> PyResult<Bound<'py, PyAny>> {
                let n = this.tokens.len() - start;
                let ix = slice.indices(n as isize)?;
                if ix.step == 1 {
                    let (a, b) = (ix.start as usize, ix.stop.max(ix.start) as usize);
                    return Ok(Self::list_of(py, this, start + a, start + b)?.into_any());
                }
                let picked = (0..ix.slicelength)
                    .map(|k| {
                        Self::item(py, this, start + (ix.start + k as isize * ix.step) as usize)
                    })
                    .collect::<PyResult<Vec<_>>>()?;
                Ok(PyList::new(py, picked)?.into_any())
            })?;
        }
        self.tail(py)?.as_any().get_item(index)
    }

    fn __iter__<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyIterator>> {
        self.tail(py)?.as_any().try_iter()
    }

    fn __contains__(&self, py: Python<'_>, value: &Bound<'_, PyAny>) -> PyResult<bool> {
        self.tail(py)?.contains(value)
    }

    /// Index of the first occurrence of `value` in `[start, stop)` (ValueError when absent).
    #[pyo3(signature = (value, start = 0, stop = None))]
    fn index<'py>(
        &self,
        py: Python<'py>,
        value: &Bound<'py, PyAny>,
        start: isize,
        stop: Option<isize>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let stop = stop.unwrap_or(isize::MAX);
        self.tail(py)?
            .call_method1(intern!(py, "index"), (value, start, stop))
    }

    /// Number of occurrences of `value`.
    fn count(&self, py: Python<'_>, value: &Bound<'_, PyAny>) -> PyResult<usize> {
        Ok(self
            .tail(py)?
            .iter()
            .filter(|x| x.eq(value).unwrap_or(false))
            .count())
    }

    fn __richcmp__(
        &self,
        py: Python<'_>,
        other: &Bound<'_, PyAny>,
        op: CompareOp,
    ) -> PyResult<PyObject> {
        let other_list = if let Ok(v) = other.downcast::<Self>() {
            v.get().tail(py)?
        } else if let Ok(l) = other.downcast::<PyList>() {
            l.clone()
        } else {
            return Ok(py.NotImplemented());
        };
        match op {
            CompareOp::Eq | CompareOp::Ne => {
                let equal = self.tail(py)?.eq(&other_list)?;
                Ok(eq_result(py, equal, op))
            }
            _ => Ok(py.NotImplemented()),
        }
    }

    fn __repr__(&self, py: Python<'_>) -> PyResult<String> {
        Ok(self.tail(py)?.repr()?.to_string())
    }
}

//! `kvcore._native.RequestCore`: the per-step state of a request, kept in one native object.
//!
//! `kvcore.request.Request` subclasses it. The fields every scheduler step reads or writes
//! (the id, token counts, status, token lists and block hashes) live here, so that
//! `append_output_token_ids` runs without a Python frame and the Rust manager reads a request's
//! counts straight from the struct instead of through attribute lookups.

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

use kvcore_core::full_attention::SlotHint;
use kvcore_core::hash::BlockHash;
use pyo3::basic::CompareOp;
use pyo3::exceptions::{PyIndexError, PyValueError};
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyInt, PyIterator, PyList, PyString, PyTuple, PyType};
use pyo3::{PyTraverseError, PyVisit};

use crate::blocks::eq_result;
use crate::hashing::{py_hash, PyRequestBlockHasher};
use crate::pool::to_hash;

/// Native base of `kvcore.request.Request`; see the module docs.
#[pyclass(module = "kvcore._native", name = "RequestCore", subclass, weakref)]
pub struct PyRequestCore {
    request_id: Py<PyString>,
    /// UTF-8 copy of `request_id`, the key of the manager's block tables.
    pub(crate) id: String,
    /// Prompt plus output tokens (kept equal to `len(all_token_ids)` by the appends).
    #[pyo3(get, set)]
    pub(crate) num_tokens: i64,
    /// Tokens whose KV is computed; the scheduler maintains it.
    #[pyo3(get, set)]
    pub(crate) num_computed_tokens: i64,
    status: PyObject,
    /// `int(status)`, or -1 when the status is not an int.
    pub(crate) status_value: i64,
    all: Py<PyList>,
    /// Where the output tokens start in `all` (the prompt length).
    output_start: usize,
    /// Hashes of the full hash blocks, append-only (SPEC RH-2).
    #[pyo3(get)]
    block_hashes: PyObject,
    /// A native copy of `block_hashes`, kept as hashes are appended through this object; the
    /// Rust manager reads it instead of the list while their lengths agree.
    mirror: Vec<BlockHash>,
    /// Token count at which the next hash block is full.
    #[pyo3(get, set, name = "_next_hash_at")]
    next_hash_at: i64,
    /// The block hasher, or None.
    #[pyo3(get, set, name = "_block_hasher")]
    block_hasher: PyObject,
    /// The hasher's window size when it says it (appends skip the hasher until the next
    /// window is full), else None.
    #[pyo3(get, set, name = "_hash_block_size")]
    hash_block_size: Option<i64>,
    /// Where the Rust manager last found this request's block table (skips the id lookup).
    pub(crate) table_hint: HintCell,
}

/// A [`SlotHint`] that can be updated through a shared borrow. The three parts are separate
/// atomics; they are only read and written with the GIL held (every access goes through a
/// `Bound` of this object), so a reader never sees parts of two different hints.
#[derive(Debug, Default)]
pub(crate) struct HintCell {
    uid: AtomicU64,
    slot: AtomicU32,
    generation: AtomicU64,
}

impl HintCell {
    /// The stored hint (`None` when unset: uid 0 belongs to no tables).
    pub(crate) fn get(&self) -> Option<SlotHint> {
        let uid = self.uid.load(Ordering::Relaxed);
        (uid != 0).then(|| SlotHint {
            uid,
            slot: self.slot.load(Ordering::Relaxed),
            generation: self.generation.load(Ordering::Relaxed),
        })
    }

    /// Stores `hint` (or clears it).
    pub(crate) fn set(&self, hint: Option<SlotHint>) {
        let h = hint.unwrap_or_default();
        self.slot.store(h.slot, Ordering::Relaxed);
        self.generation.store(h.generation, Ordering::Relaxed);
        self.uid.store(h.uid, Ordering::Relaxed);
    }
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
            status: py.None(),
            status_value: -1,
            all: PyList::empty(py).unbind(),
            output_start: 0,
            block_hashes: PyList::empty(py).into_any().unbind(),
            mirror: Vec::new(),
            next_hash_at: 0,
            block_hasher: py.None(),
            hash_block_size: None,
            table_hint: HintCell::default(),
        }
    }

    /// Lets the cycle collector see the objects this request holds (a hasher or a status
    /// object that refers back to the request would otherwise keep it alive forever).
    fn __traverse__(&self, visit: PyVisit<'_>) -> Result<(), PyTraverseError> {
        visit.call(&self.request_id)?;
        visit.call(&self.status)?;
        visit.call(&self.all)?;
        visit.call(&self.block_hashes)?;
        visit.call(&self.block_hasher)?;
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
        self.id = value.to_str()?.to_owned();
        self.request_id = value.unbind();
        self.table_hint.set(None);
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

    /// Prompt and output token ids; read-only by contract (use `append_output_token_ids`).
    #[getter]
    fn all_token_ids(&self, py: Python<'_>) -> Py<PyList> {
        self.all.clone_ref(py)
    }

    /// Output token ids: a live, read-only view of `all_token_ids` after the prompt.
    #[getter]
    fn output_token_ids(&self, py: Python<'_>) -> PyOutputTokenIds {
        PyOutputTokenIds {
            all: self.all.clone_ref(py),
            start: self.output_start,
        }
    }

    /// Number of output tokens.
    #[getter]
    fn num_output_tokens(&self, py: Python<'_>) -> usize {
        self.all.bind(py).len().saturating_sub(self.output_start)
    }

    #[getter(_all_token_ids)]
    fn get_all(&self, py: Python<'_>) -> Py<PyList> {
        self.all.clone_ref(py)
    }

    /// Replaces the token list; all of it becomes the prompt (outputs are appended after).
    #[setter(_all_token_ids)]
    fn set_all(&mut self, value: Bound<'_, PyList>) {
        self.output_start = value.len();
        self.all = value.unbind();
    }

    #[getter(_output_token_ids)]
    fn get_output(&self, py: Python<'_>) -> PyOutputTokenIds {
        self.output_token_ids(py)
    }

    /// Replaces the output tokens (the part of the token list after the prompt).
    #[setter(_output_token_ids)]
    fn set_output(&mut self, value: Bound<'_, PyAny>) -> PyResult<()> {
        let all = self.all.bind(value.py());
        all.set_slice(self.output_start.min(all.len()), all.len(), &value)
    }

    /// Appends output tokens and hashes any newly completed blocks (SPEC RH-2).
    ///
    /// One int is appended as is (an int subclass as a plain int); anything else is iterated
    /// into the token list (the outputs are its tail). When the token count reaches the next
    /// full hash block, `self.update_block_hashes()` runs.
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

impl PyRequestCore {
    /// A shared borrow of `request`'s native state when it is a kvcore `Request`, else `None`
    /// (a duck-typed request, read through attributes).
    pub(crate) fn borrow_of<'py>(
        request: &Bound<'py, PyAny>,
    ) -> PyResult<Option<PyRef<'py, Self>>> {
        match request.downcast::<Self>() {
            Ok(c) => Ok(Some(c.try_borrow()?)),
            Err(_) => Ok(None),
        }
    }

    /// The block hashes as native values, when the mirror matches the `block_hashes` list.
    pub(crate) fn mirrored_hashes(&self, py: Python<'_>) -> Option<&[BlockHash]> {
        let list = self.block_hashes.bind(py).downcast::<PyList>().ok()?;
        (list.len() == self.mirror.len()).then_some(self.mirror.as_slice())
    }

    /// `append_output_token_ids` without a Python call.
    fn append_one(slf: &Bound<'_, Self>, token_ids: &Bound<'_, PyAny>) -> PyResult<()> {
        let py = slf.py();
        let need_hash = if let Ok(tok) = token_ids.downcast::<PyInt>() {
            let tok = if tok.is_exact_instance_of::<PyInt>() {
                tok.clone()
            } else {
                py.get_type::<PyInt>()
                    .call1((tok,))?
                    .downcast_into::<PyInt>()?
            };
            // Appending an int to a list runs no Python code, so the borrow cannot be re-entered.
            let mut this = slf.try_borrow_mut()?;
            let all = this.all.bind(py);
            all.append(&tok)?;
            this.num_tokens = all.len() as i64;
            this.num_tokens >= this.next_hash_at
        } else {
            // Iterating may run Python code: no borrow is held while it does.
            let all = slf.try_borrow()?.all.clone_ref(py);
            all.bind(py)
                .call_method1(intern!(py, "extend"), (token_ids,))?;
            let n = all.bind(py).len() as i64;
            let mut this = slf.try_borrow_mut()?;
            this.num_tokens = n;
            n >= this.next_hash_at
        };
        if need_hash {
            Self::update_hashes(slf)?;
        }
        Ok(())
    }

    /// `update_block_hashes` without a Python call.
    fn update_hashes(slf: &Bound<'_, Self>) -> PyResult<()> {
        let py = slf.py();
        let (hasher, hashes, all, num_tokens) = {
            let this = slf.try_borrow()?;
            if this.block_hasher.is_none(py) {
                drop(this);
                slf.try_borrow_mut()?.next_hash_at = i64::MAX;
                return Ok(());
            }
            (
                this.block_hasher.clone_ref(py),
                this.block_hashes.clone_ref(py),
                this.all.clone_ref(py),
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
            if let Some(new) = native
                .get()
                .new_hashes(slf.as_any(), list, all.bind(py), n)?
            {
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
                for i in before..list.len() {
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
            let len = i64::try_from(hashes.len()?).unwrap_or(i64::MAX);
            slf.try_borrow_mut()?.next_hash_at = len.saturating_add(1).saturating_mul(hbs);
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
///     ValueError: The two sequences differ in length (nothing is appended).
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
        return Err(PyValueError::new_err(format!(
            "{n} requests but {m} token entries"
        )));
    }
    let base = py.get_type::<PyRequestCore>().getattr(name)?;
    let mut last_type: Option<Bound<'_, PyType>> = None;
    let mut last_native = false;
    for (request, tokens) in requests.try_iter()?.zip(token_ids.try_iter()?) {
        let (request, tokens) = (request?, tokens?);
        let ty = request.get_type();
        let native = match &last_type {
            Some(t) if t.is(&ty) => last_native,
            _ => {
                let native =
                    request.downcast::<PyRequestCore>().is_ok() && ty.getattr(name)?.is(&base);
                last_type = Some(ty);
                last_native = native;
                native
            }
        };
        if native {
            PyRequestCore::append_one(request.downcast::<PyRequestCore>()?, &tokens)?;
        } else {
            request.call_method1(name, (tokens,))?;
        }
    }
    Ok(())
}

/// `Request.output_token_ids`: a live, read-only view of the request's token list after the
/// prompt (it follows later appends). Compares equal to a list (or another view) with the same
/// items; indexing, slicing (a new list), iteration, `in`, `index`, `count` and `len` work as on
/// a list.
#[pyclass(module = "kvcore._native", name = "OutputTokenIds", frozen, sequence)]
pub struct PyOutputTokenIds {
    all: Py<PyList>,
    start: usize,
}

impl PyOutputTokenIds {
    /// The current output tokens as a new list.
    fn tail<'py>(&self, py: Python<'py>) -> Bound<'py, PyList> {
        let all = self.all.bind(py);
        let n = all.len();
        all.get_slice(self.start.min(n), n)
    }
}

#[pymethods]
impl PyOutputTokenIds {
    fn __len__(&self, py: Python<'_>) -> usize {
        self.all.bind(py).len().saturating_sub(self.start)
    }

    fn __getitem__<'py>(
        &self,
        py: Python<'py>,
        index: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyAny>> {
        if let Ok(i) = index.extract::<isize>() {
            let all = self.all.bind(py);
            let n = all.len().saturating_sub(self.start) as isize;
            let j = if i < 0 { i + n } else { i };
            if j < 0 || j >= n {
                return Err(PyIndexError::new_err("output token index out of range"));
            }
            return all.get_item(self.start + j as usize);
        }
        self.tail(py).as_any().get_item(index)
    }

    fn __iter__<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyIterator>> {
        self.tail(py).as_any().try_iter()
    }

    fn __contains__(&self, py: Python<'_>, value: &Bound<'_, PyAny>) -> PyResult<bool> {
        self.tail(py).contains(value)
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
        let tail = self.tail(py);
        let stop = stop.unwrap_or(isize::MAX);
        tail.call_method1(intern!(py, "index"), (value, start, stop))
    }

    /// Number of occurrences of `value`.
    fn count(&self, py: Python<'_>, value: &Bound<'_, PyAny>) -> PyResult<usize> {
        Ok(self
            .tail(py)
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
            v.get().tail(py)
        } else if let Ok(l) = other.downcast::<PyList>() {
            l.clone()
        } else {
            return Ok(py.NotImplemented());
        };
        match op {
            CompareOp::Eq | CompareOp::Ne => {
                let equal = self.tail(py).eq(&other_list)?;
                Ok(eq_result(py, equal, op))
            }
            _ => Ok(py.NotImplemented()),
        }
    }

    fn __repr__(&self, py: Python<'_>) -> PyResult<String> {
        Ok(self.tail(py).repr()?.to_string())
    }
}

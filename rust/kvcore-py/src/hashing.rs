//! Bindings of the block hashing of `kvcore_core::hashing` (SPEC §5).
//!
//! Every function returns `None` when the input has a shape the core does not serialise
//! byte-identically to CPython's `pickle` or to `cbor2` (an int beyond 64 bits, a `bool`, a
//! subclass, an object that occurs twice in one pickle, a list where pickle is used); the
//! Python layer (`kvcore.hashing`) then serialises with the Python library instead.

use kvcore_core::hash::BlockHash;
use kvcore_core::hashing::{new_full_windows, BlockHasher, HashError, HashFn};
use kvcore_core::value::Value;
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyInt, PyList, PyString, PyTuple, PyType};

use crate::args::{exact_i64, exact_i64s};
use crate::request::PyRequestCore;

/// Deepest nesting of tuples converted natively.
const MAX_DEPTH: usize = 32;

fn hash_fn(name: &str) -> PyResult<HashFn> {
    HashFn::from_name(name).map_err(to_py_err)
}

fn to_py_err(e: HashError) -> PyErr {
    crate::errors::invalid(e.to_string())
}

/// Converts Python objects into owned [`Value`]s, refusing what the core cannot reproduce.
struct Converter {
    /// Pickle mode: lists are refused and no memoisable object may occur twice.
    pickle: bool,
    /// Addresses of the memoisable objects seen so far (pickle mode only).
    seen: Vec<usize>,
}

impl Converter {
    fn new(hash_fn: HashFn) -> Self {
        Self {
            pickle: !hash_fn.is_cbor(),
            seen: Vec::new(),
        }
    }

    /// Records a memoisable object; `false` when it was already seen (CPython would write a
    /// back-reference).
    fn note(&mut self, obj: &Bound<'_, PyAny>) -> bool {
        if !self.pickle {
            return true;
        }
        let addr = obj.as_ptr() as usize;
        if self.seen.contains(&addr) {
            return false;
        }
        self.seen.push(addr);
        true
    }

    fn value(&mut self, obj: &Bound<'_, PyAny>, depth: usize) -> Option<Value> {
        if obj.is_none() {
            return Some(Value::None);
        }
        if obj.is_exact_instance_of::<PyInt>() {
            return obj.extract::<i64>().ok().map(Value::Int);
        }
        if let Ok(s) = obj.downcast_exact::<PyString>() {
            if !self.note(obj) {
                return None;
            }
            return s.to_str().ok().map(|s| Value::Str(s.to_owned()));
        }
        if let Ok(b) = obj.downcast_exact::<PyBytes>() {
            if !self.note(obj) {
                return None;
            }
            return Some(Value::Bytes(b.as_bytes().to_vec()));
        }
        if depth >= MAX_DEPTH {
            return None;
        }
        if let Ok(t) = obj.downcast_exact::<PyTuple>() {
            if !t.is_empty() && !self.note(obj) {
                return None;
            }
            return self.items(t.iter(), depth);
        }
        if !self.pickle {
            if let Ok(l) = obj.downcast_exact::<PyList>() {
                return self.items(l.iter(), depth);
            }
        }
        None
    }

    fn items<'py>(
        &mut self,
        iter: impl Iterator<Item = Bound<'py, PyAny>>,
        depth: usize,
    ) -> Option<Value> {
        iter.map(|x| self.value(&x, depth + 1))
            .collect::<Option<Vec<_>>>()
            .map(Value::Tuple)
    }

    /// The extra-keys argument: `None` or the items of an exact tuple.
    fn extra(&mut self, obj: &Bound<'_, PyAny>) -> Option<Option<Vec<Value>>> {
        if obj.is_none() {
            return Some(None);
        }
        match self.value(obj, 0)? {
            Value::Tuple(items) if obj.is_exact_instance_of::<PyTuple>() => Some(Some(items)),
            _ => None,
        }
    }
}

/// Token ids of a tuple of exact ints, or `None` if any is not a 64-bit int.
///
/// Items are read borrowed (no reference-count traffic): this loop is most of the cost of
/// hashing a prompt.
pub(crate) fn tokens_of(tuple: &Bound<'_, PyTuple>) -> Option<Vec<i64>> {
    let mut out = Vec::with_capacity(tuple.len());
    for item in tuple.iter_borrowed() {
        out.push(exact_i64(&item)?);
    }
    Some(out)
}

/// Token ids of a list or tuple of exact ints.
pub(crate) fn tokens_any(obj: &Bound<'_, PyAny>) -> Option<Vec<i64>> {
    if let Ok(tuple) = obj.downcast_exact::<PyTuple>() {
        return tokens_of(tuple);
    }
    let list = obj.downcast_exact::<PyList>().ok()?;
    exact_i64s(list, 0, crate::args::list_len(list))
}

pub(crate) fn py_hash<'py>(py: Python<'py>, h: &BlockHash) -> Bound<'py, PyBytes> {
    PyBytes::new(py, h.as_bytes())
}

/// `fn(obj)` for one of the four functions, or `None` when `obj` needs the Python serialiser.
#[pyfunction]
pub fn hash_object<'py>(
    py: Python<'py>,
    hash_fn_name: &str,
    obj: &Bound<'py, PyAny>,
) -> PyResult<Option<Bound<'py, PyBytes>>> {
    let f = hash_fn(hash_fn_name)?;
    let Some(value) = Converter::new(f).value(obj, 0) else {
        return Ok(None);
    };
    Ok(f.hash_value(&value).ok().map(|h| py_hash(py, &h)))
}

/// Digests already serialised bytes with the function's digest (SHA-256 or XXH3-128 BE).
#[pyfunction]
pub fn digest<'py>(
    py: Python<'py>,
    hash_fn_name: &str,
    data: &[u8],
) -> PyResult<Bound<'py, PyBytes>> {
    Ok(py_hash(py, &hash_fn(hash_fn_name)?.digest(data)))
}

/// One block hash (SPEC HASH-11), or `None` when an argument needs the Python serialiser.
#[pyfunction]
pub fn hash_block_tokens<'py>(
    py: Python<'py>,
    hash_fn_name: &str,
    none_hash: &[u8],
    parent: &Bound<'py, PyAny>,
    tokens: &Bound<'py, PyAny>,
    extra: &Bound<'py, PyAny>,
) -> PyResult<Option<Bound<'py, PyBytes>>> {
    let f = hash_fn(hash_fn_name)?;
    let mut conv = Converter::new(f);
    let parent_bytes: Option<&[u8]> = if parent.is_none() {
        None
    } else if let Ok(b) = parent.downcast_exact::<PyBytes>() {
        conv.note(parent);
        Some(b.as_bytes()).filter(|p| !p.is_empty())
    } else {
        return Ok(None);
    };
    let Some(toks) = tokens_any(tokens) else {
        return Ok(None);
    };
    if tokens.is_exact_instance_of::<PyTuple>() && !toks.is_empty() {
        conv.note(tokens);
    }
    let Some(extra) = conv.extra(extra) else {
        return Ok(None);
    };
    let mut hasher = BlockHasher::new(f, none_hash);
    Ok(hasher
        .hash_block(parent_bytes, &toks, extra.as_deref())
        .ok()
        .map(|h| py_hash(py, &h)))
}

/// Hashes the windows of `block_size` tokens of `token_ids` (a tuple whose length is a multiple
/// of `block_size`) as a chain from `parent` (SPEC RH-1), in one call with the GIL released.
///
/// `extras` is `None` (no window has extra keys) or one `tuple | None` per window. Returns
/// `None` when an argument needs the Python serialiser.
#[pyfunction]
#[pyo3(signature = (hash_fn_name, none_hash, parent, token_ids, block_size, extras=None))]
pub fn hash_request_blocks<'py>(
    py: Python<'py>,
    hash_fn_name: &str,
    none_hash: &[u8],
    parent: &Bound<'py, PyAny>,
    token_ids: &Bound<'py, PyTuple>,
    block_size: usize,
    extras: Option<&Bound<'py, PyList>>,
) -> PyResult<Option<Bound<'py, PyList>>> {
    let f = hash_fn(hash_fn_name)?;
    if block_size == 0 {
        return Err(to_py_err(HashError::ZeroBlockSize));
    }
    // An empty parent means NONE_HASH, as None does (SPEC HASH-11: `if not parent`).
    let parent_bytes: Option<Vec<u8>> = if parent.is_none() {
        None
    } else if let Ok(b) = parent.downcast_exact::<PyBytes>() {
        Some(b.as_bytes().to_vec()).filter(|p| !p.is_empty())
    } else {
        return Ok(None);
    };
    let Some(tokens) = tokens_of(token_ids) else {
        return Ok(None);
    };
    // Distinct extra-key tuples (consecutive windows usually share one object), converted once.
    let mut converted: Vec<Option<Vec<Value>>> = Vec::new();
    let mut which: Vec<usize> = Vec::new();
    if let Some(list) = extras {
        which.reserve(crate::args::list_len(list));
        let mut last_addr = 0usize;
        for (i, e) in list.iter().enumerate() {
            let addr = e.as_ptr() as usize;
            if i > 0 && addr == last_addr {
                which.push(converted.len() - 1);
                continue;
            }
            let mut conv = Converter::new(f);
            if i == 0 && !parent.is_none() {
                conv.note(parent);
            }
            let Some(x) = conv.extra(&e) else {
                return Ok(None);
            };
            converted.push(x);
            which.push(converted.len() - 1);
            last_addr = addr;
        }
    }
    let has_extras = extras.is_some();
    let none_hash = none_hash.to_vec();
    let result = py.allow_threads(move || {
        let per_block: Vec<Option<&[Value]>> =
            which.iter().map(|&k| converted[k].as_deref()).collect();
        let mut hasher = BlockHasher::new(f, &none_hash);
        hasher.hash_blocks(
            parent_bytes.as_deref(),
            &tokens,
            block_size,
            has_extras.then_some(per_block.as_slice()),
        )
    });
    match result {
        Ok(hashes) => Ok(Some(PyList::new(
            py,
            hashes.iter().map(|h| py_hash(py, h)),
        )?)),
        Err(HashError::Unsupported(_)) => Ok(None),
        Err(e) => Err(to_py_err(e)),
    }
}

/// Hashes above which the GIL is released while hashing.
const RELEASE_GIL_BLOCKS: usize = 32;

/// Whether the request may have extra hash keys (multimodal features, LoRA, a cache salt or
/// prompt embeddings): those requests are hashed by the Python fallback.
fn may_have_extra_keys(request: &Bound<'_, PyAny>) -> PyResult<bool> {
    let py = request.py();
    for name in [
        intern!(py, "mm_features"),
        intern!(py, "lora_request"),
        intern!(py, "cache_salt"),
    ] {
        if request.getattr(name)?.is_truthy()? {
            return Ok(true);
        }
    }
    Ok(match request.getattr(intern!(py, "prompt_embeds")) {
        Ok(v) => !v.is_none(),
        Err(_) => false,
    })
}

/// The request block hasher of `kvcore.hashing.get_request_block_hasher` for the four native
/// functions (SPEC RH-1): `hasher(request)` returns the hashes of the request's new full
/// windows after its existing `block_hashes`.
///
/// Requests with extra keys, or with tokens the core cannot serialise, go to `fallback` (the
/// Python hasher) so that every hash stays byte-identical.
#[pyclass(module = "kvcore._native", name = "RequestBlockHasher", frozen)]
pub struct PyRequestBlockHasher {
    f: HashFn,
    /// Tokens per hashed window.
    #[pyo3(get)]
    hash_block_size: usize,
    /// Returns the current NONE_HASH (read when a request's first window is hashed).
    none_hash: PyObject,
    fallback: PyObject,
    /// A read-only sequence class whose exact instances wrap a list in the named attribute
    /// and index it as that list (vLLM's `ConstantList`, `_x`): a request's `all_token_ids` of
    /// that class is read from the list it wraps.
    list_view: Option<(Py<PyType>, Py<PyString>)>,
}

impl PyRequestBlockHasher {
    /// A request's token ids as a list: `all_token_ids` itself, or the list a view of the
    /// registered class wraps; `None` for anything else (the Python hasher then reads them).
    fn token_list<'py>(&self, all: Bound<'py, PyAny>) -> PyResult<Option<Bound<'py, PyList>>> {
        if let Some((cls, attr)) = &self.list_view {
            if std::ptr::eq(all.get_type_ptr(), cls.as_ptr().cast()) {
                let inner = all.getattr(attr.bind(all.py()))?;
                return Ok(inner.downcast_into_exact::<PyList>().ok());
            }
        }
        Ok(all.downcast_into::<PyList>().ok())
    }

    /// The token range of the request's new full windows (SPEC RH-1, in the core).
    pub(crate) fn window(&self, done: usize, num_tokens: usize) -> Option<(usize, usize)> {
        new_full_windows(done, num_tokens, self.hash_block_size)
    }

    /// The parent of block `done` read from the hash list (`Some(None)` for the first block,
    /// and for an empty parent, which the reference replaces by NONE_HASH as it does None), or
    /// `None` when it is not bytes (the Python hasher then decides).
    fn parent_from_list(
        hashes: &Bound<'_, PyList>,
        done: usize,
    ) -> PyResult<Option<Option<Vec<u8>>>> {
        if done == 0 {
            return Ok(Some(None));
        }
        Ok(hashes
            .get_item(done - 1)?
            .downcast_exact::<PyBytes>()
            .ok()
            .map(|b| Some(b.as_bytes().to_vec()).filter(|p| !p.is_empty())))
    }

    /// Hashes the whole blocks of `tokens` chained from `parent` (the GIL released for long
    /// runs); `None` when the core cannot serialise them byte-identically.
    fn hash_window(
        &self,
        py: Python<'_>,
        parent: Option<Vec<u8>>,
        tokens: Vec<i64>,
    ) -> PyResult<Option<Vec<BlockHash>>> {
        let none_hash: Vec<u8> = if parent.is_none() {
            self.none_hash.call0(py)?.extract(py)?
        } else {
            Vec::new()
        };
        let hbs = self.hash_block_size;
        let (f, n) = (self.f, tokens.len() / hbs);
        let run = move || {
            BlockHasher::new(f, &none_hash).hash_blocks(parent.as_deref(), &tokens, hbs, None)
        };
        let result = if n > RELEASE_GIL_BLOCKS {
            py.allow_threads(run)
        } else {
            run()
        };
        match result {
            Ok(out) => Ok(Some(out)),
            Err(HashError::Unsupported(_)) => Ok(None),
            Err(e) => Err(to_py_err(e)),
        }
    }

    /// The new hashes of a duck-typed request whose token ids are a list, or `None` for the
    /// fallback. `hashes` is its `block_hashes` list, `all_tokens` its token list.
    fn new_hashes<'py>(
        &self,
        request: &Bound<'py, PyAny>,
        hashes: &Bound<'py, PyList>,
        all_tokens: &Bound<'py, PyList>,
        num_tokens: usize,
    ) -> PyResult<Option<Vec<BlockHash>>> {
        let done = hashes.len();
        let Some((start, end)) = self.window(done, num_tokens) else {
            return Ok(Some(Vec::new()));
        };
        if may_have_extra_keys(request)? {
            return Ok(None);
        }
        let Some(tokens) = exact_i64s(all_tokens, start, end) else {
            return Ok(None);
        };
        let Some(parent) = Self::parent_from_list(hashes, done)? else {
            return Ok(None);
        };
        self.hash_window(request.py(), parent, tokens)
    }

    /// The new hashes of a kvcore request, read from its native token ids, or `None` for the
    /// fallback.
    pub(crate) fn new_hashes_of(
        &self,
        request: &Bound<'_, PyRequestCore>,
        hashes: &Bound<'_, PyList>,
        num_tokens: usize,
    ) -> PyResult<Option<Vec<BlockHash>>> {
        let done = hashes.len();
        let Some((start, end)) = self.window(done, num_tokens) else {
            return Ok(Some(Vec::new()));
        };
        if may_have_extra_keys(request.as_any())? {
            return Ok(None);
        }
        // Copied out, so that no borrow is held while hashing (which may release the GIL).
        let tokens = {
            let this = request.try_borrow()?;
            // A window past the end, or holding a token that is not an int64 int (hashed by the
            // Python path as the reference hashes it).
            let Some(window) = this.int_window(start..end) else {
                return Ok(None);
            };
            window.to_vec()
        };
        // The parent is read from the list, as the reference reads `block_hashes[-1]` (the
        // native copy would miss an item replaced in place).
        let Some(parent) = Self::parent_from_list(hashes, done)? else {
            return Ok(None);
        };
        self.hash_window(request.py(), parent, tokens)
    }
}

#[pymethods]
impl PyRequestBlockHasher {
    #[new]
    #[pyo3(signature = (hash_fn_name, hash_block_size, none_hash, fallback, list_view = None))]
    fn new(
        hash_fn_name: &str,
        hash_block_size: usize,
        none_hash: PyObject,
        fallback: PyObject,
        list_view: Option<(Bound<'_, PyType>, Bound<'_, PyString>)>,
    ) -> PyResult<Self> {
        if hash_block_size == 0 {
            return Err(to_py_err(HashError::ZeroBlockSize));
        }
        Ok(Self {
            f: hash_fn(hash_fn_name)?,
            hash_block_size,
            none_hash,
            fallback,
            list_view: list_view.map(|(cls, attr)| (cls.unbind(), attr.unbind())),
        })
    }

    /// The hashes of the request's new full windows (SPEC RH-1).
    fn __call__<'py>(&self, request: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyAny>> {
        let py = request.py();
        let hashes = request.getattr(intern!(py, "block_hashes"))?;
        if let (Ok(core), Ok(h)) = (
            request.downcast::<PyRequestCore>(),
            hashes.downcast::<PyList>(),
        ) {
            let num_tokens: usize = request.getattr(intern!(py, "num_tokens"))?.extract()?;
            if let Some(out) = self.new_hashes_of(core, h, num_tokens)? {
                return Ok(PyList::new(py, out.iter().map(|x| py_hash(py, x)))?.into_any());
            }
            return self.fallback.bind(py).call1((request,));
        }
        // Any other request is read in the reference's order: its hashes and its count, and
        // its tokens only when a window is full (most appends fill none).
        let Ok(h) = hashes.downcast::<PyList>() else {
            return self.fallback.bind(py).call1((request,));
        };
        let Ok(num_tokens) = request
            .getattr(intern!(py, "num_tokens"))?
            .extract::<usize>()
        else {
            return self.fallback.bind(py).call1((request,));
        };
        if self.window(h.len(), num_tokens).is_none() {
            return Ok(PyList::empty(py).into_any());
        }
        let all = request.getattr(intern!(py, "all_token_ids"))?;
        if let Some(a) = self.token_list(all)? {
            if let Some(out) = self.new_hashes(request, h, &a, num_tokens)? {
                return Ok(PyList::new(py, out.iter().map(|x| py_hash(py, x)))?.into_any());
            }
        }
        self.fallback.bind(py).call1((request,))
    }
}

//! Conversion of core KV events into the Python event classes of `kvcore.events`.

use kvcore_core::events::KvEvent;
use kvcore_core::hash::BlockHash;
use kvcore_core::value::Value;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList, PyString, PyTuple};

use crate::pool::token_ids_into_py;

const MEDIUM_GPU: &str = "GPU";

/// Reads `VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES` the way the reference does (SPEC EVT-2): unset
/// means `"1"`; the value is parsed by Python's `int()` (so `"true"` raises ValueError).
pub fn use_int_hashes(py: Python<'_>) -> PyResult<bool> {
    // The process environment is what `os.environ` writes through to (putenv).
    match std::env::var("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES") {
        Err(std::env::VarError::NotPresent) => Ok(true),
        Ok(v) if v == "1" => Ok(true),
        Ok(v) if v == "0" => Ok(false),
        _ => {
            let os = py.import("os")?;
            let raw = os
                .getattr("environ")?
                .call_method1("get", ("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "1"))?;
            let as_int = py.import("builtins")?.getattr("int")?.call1((raw,))?;
            as_int.is_truthy()
        }
    }
}

fn external_hash<'py>(py: Python<'py>, h: &BlockHash, as_int: bool) -> PyResult<Bound<'py, PyAny>> {
    if as_int {
        Ok(h.event_int().into_pyobject(py)?.into_any())
    } else {
        Ok(PyBytes::new(py, h.as_bytes()).into_any())
    }
}

/// Converts a core [`Value`] into the Python object it came from.
pub fn value_to_py(py: Python<'_>, v: &Value) -> PyResult<PyObject> {
    Ok(match v {
        Value::None => py.None(),
        Value::Int(i) => i.into_pyobject(py)?.into_any().unbind(),
        Value::Str(s) => s.into_pyobject(py)?.into_any().unbind(),
        Value::Bytes(b) => PyBytes::new(py, b).into_any().unbind(),
        Value::Tuple(items) => {
            let objs = items
                .iter()
                .map(|x| value_to_py(py, x))
                .collect::<PyResult<Vec<_>>>()?;
            PyTuple::new(py, objs)?.into_any().unbind()
        }
    })
}

/// Base class of every KV cache event (SPEC EVT-1).
#[pyclass(module = "kvcore._native", name = "KVCacheEvent", subclass)]
pub struct KVCacheEvent;

#[pymethods]
impl KVCacheEvent {
    #[new]
    fn new() -> Self {
        Self
    }
}

/// Compares two events field by field with Python equality.
fn fields_eq(py: Python<'_>, a: &[&PyObject], b: &[&PyObject]) -> PyResult<bool> {
    for (x, y) in a.iter().zip(b) {
        if !x.bind(py).eq(y.bind(py))? {
            return Ok(false);
        }
    }
    Ok(true)
}

/// `tuple(x)` for lists (hashable form), `x` otherwise.
fn hashable<'py>(py: Python<'py>, x: &PyObject) -> PyResult<Bound<'py, PyAny>> {
    let b = x.bind(py);
    Ok(match b.downcast::<PyList>() {
        Ok(l) => l.to_tuple().into_any(),
        Err(_) => b.clone(),
    })
}

fn field_repr(py: Python<'_>, names: &[&str], values: &[&PyObject]) -> PyResult<String> {
    let mut parts = Vec::with_capacity(names.len());
    for (n, v) in names.iter().zip(values) {
        parts.push(format!("{n}={}", v.bind(py).repr()?));
    }
    Ok(parts.join(", "))
}

/// Blocks entered the prefix cache (SPEC EVT-1, POOL-17, POOL-30).
///
/// Fields follow the reference's order; the manager sets the two `kv_cache_spec_*` fields.
#[pyclass(module = "kvcore._native", name = "BlockStored", extends = KVCacheEvent, get_all, set_all)]
pub struct BlockStored {
    block_hashes: PyObject,
    parent_block_hash: PyObject,
    token_ids: PyObject,
    block_size: PyObject,
    lora_id: PyObject,
    medium: PyObject,
    lora_name: PyObject,
    extra_keys: PyObject,
    group_idx: PyObject,
    kv_cache_spec_kind: PyObject,
    kv_cache_spec_sliding_window: PyObject,
}

/// Every event field, in EVT-1 order (`BlockStored`'s order; `BlockRemoved` uses a subset).
pub(crate) const STORED_FIELDS: [&str; 11] = [
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
    "extra_keys",
    "group_idx",
    "kv_cache_spec_kind",
    "kv_cache_spec_sliding_window",
];

impl BlockStored {
    /// The event with its fields in EVT-1 order.
    fn from_values(v: [PyObject; 11]) -> Self {
        let [block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium, lora_name, extra_keys, group_idx, kv_cache_spec_kind, kv_cache_spec_sliding_window] =
            v;
        Self {
            block_hashes,
            parent_block_hash,
            token_ids,
            block_size,
            lora_id,
            medium,
            lora_name,
            extra_keys,
            group_idx,
            kv_cache_spec_kind,
            kv_cache_spec_sliding_window,
        }
    }

    fn values(&self) -> [&PyObject; 11] {
        [
            &self.block_hashes,
            &self.parent_block_hash,
            &self.token_ids,
            &self.block_size,
            &self.lora_id,
            &self.medium,
            &self.lora_name,
            &self.extra_keys,
            &self.group_idx,
            &self.kv_cache_spec_kind,
            &self.kv_cache_spec_sliding_window,
        ]
    }
}

#[pymethods]
impl BlockStored {
    /// Field names in order, for pattern matching and generic field access.
    #[classattr]
    #[allow(non_upper_case_globals)]
    const __match_args__: (
        &'static str,
        &'static str,
        &'static str,
        &'static str,
        &'static str,
        &'static str,
        &'static str,
        &'static str,
        &'static str,
        &'static str,
        &'static str,
    ) = (
        "block_hashes",
        "parent_block_hash",
        "token_ids",
        "block_size",
        "lora_id",
        "medium",
        "lora_name",
        "extra_keys",
        "group_idx",
        "kv_cache_spec_kind",
        "kv_cache_spec_sliding_window",
    );

    #[new]
    #[pyo3(signature = (block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium, lora_name, extra_keys = None, group_idx = None, kv_cache_spec_kind = None, kv_cache_spec_sliding_window = None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        block_hashes: PyObject,
        parent_block_hash: PyObject,
        token_ids: PyObject,
        block_size: PyObject,
        lora_id: PyObject,
        medium: PyObject,
        lora_name: PyObject,
        extra_keys: Option<PyObject>,
        group_idx: Option<PyObject>,
        kv_cache_spec_kind: Option<PyObject>,
        kv_cache_spec_sliding_window: Option<PyObject>,
    ) -> (Self, KVCacheEvent) {
        let or_none = |o: Option<PyObject>| o.unwrap_or_else(|| py.None());
        (
            Self::from_values([
                block_hashes,
                parent_block_hash,
                token_ids,
                block_size,
                lora_id,
                medium,
                lora_name,
                or_none(extra_keys),
                or_none(group_idx),
                or_none(kv_cache_spec_kind),
                or_none(kv_cache_spec_sliding_window),
            ]),
            KVCacheEvent,
        )
    }

    fn __eq__(&self, py: Python<'_>, other: &Bound<'_, PyAny>) -> PyResult<bool> {
        match other.downcast::<Self>() {
            Ok(o) => fields_eq(py, &self.values(), &o.borrow().values()),
            Err(_) => Ok(false),
        }
    }

    fn __hash__(&self, py: Python<'_>) -> PyResult<isize> {
        let mut items = Vec::with_capacity(11);
        for (i, v) in self.values().into_iter().enumerate() {
            // extra_keys hashes as a tuple when non-empty, else None (as the dataclass did).
            if i == 7 && !v.bind(py).is_truthy()? {
                items.push(py.None().into_bound(py));
            } else {
                items.push(hashable(py, v)?);
            }
        }
        PyTuple::new(py, items)?.hash()
    }

    fn __repr__(&self, py: Python<'_>) -> PyResult<String> {
        Ok(format!(
            "BlockStored({})",
            field_repr(py, &STORED_FIELDS, &self.values())?
        ))
    }

    fn __reduce__(slf: &Bound<'_, Self>) -> PyResult<(PyObject, Py<PyTuple>)> {
        let py = slf.py();
        let me = slf.borrow();
        let args = PyTuple::new(py, me.values())?;
        Ok((slf.get_type().into_any().unbind(), args.unbind()))
    }
}

/// A key left the prefix cache (SPEC EVT-1, POOL-6).
#[pyclass(module = "kvcore._native", name = "BlockRemoved", extends = KVCacheEvent, get_all, set_all)]
pub struct BlockRemoved {
    block_hashes: PyObject,
    medium: PyObject,
    group_idx: PyObject,
}

impl BlockRemoved {
    fn values(&self) -> [&PyObject; 3] {
        [&self.block_hashes, &self.medium, &self.group_idx]
    }
}

#[pymethods]
impl BlockRemoved {
    /// Field names in order, for pattern matching and generic field access.
    #[classattr]
    #[allow(non_upper_case_globals)]
    const __match_args__: (&'static str, &'static str, &'static str) =
        ("block_hashes", "medium", "group_idx");

    #[new]
    #[pyo3(signature = (block_hashes, medium, group_idx = None))]
    fn new(
        py: Python<'_>,
        block_hashes: PyObject,
        medium: PyObject,
        group_idx: Option<PyObject>,
    ) -> (Self, KVCacheEvent) {
        (
            Self {
                block_hashes,
                medium,
                group_idx: group_idx.unwrap_or_else(|| py.None()),
            },
            KVCacheEvent,
        )
    }

    fn __eq__(&self, py: Python<'_>, other: &Bound<'_, PyAny>) -> PyResult<bool> {
        match other.downcast::<Self>() {
            Ok(o) => fields_eq(py, &self.values(), &o.borrow().values()),
            Err(_) => Ok(false),
        }
    }

    fn __hash__(&self, py: Python<'_>) -> PyResult<isize> {
        let items = self
            .values()
            .into_iter()
            .map(|v| hashable(py, v))
            .collect::<PyResult<Vec<_>>>()?;
        PyTuple::new(py, items)?.hash()
    }

    fn __repr__(&self, py: Python<'_>) -> PyResult<String> {
        Ok(format!(
            "BlockRemoved({})",
            field_repr(py, &["block_hashes", "medium", "group_idx"], &self.values())?
        ))
    }

    fn __reduce__(slf: &Bound<'_, Self>) -> PyResult<(PyObject, Py<PyTuple>)> {
        let py = slf.py();
        let args = PyTuple::new(py, slf.borrow().values())?;
        Ok((slf.get_type().into_any().unbind(), args.unbind()))
    }
}

/// The whole prefix cache was cleared (SPEC EVT-1, POOL-21).
#[pyclass(module = "kvcore._native", name = "AllBlocksCleared", extends = KVCacheEvent)]
pub struct AllBlocksCleared;

#[pymethods]
impl AllBlocksCleared {
    /// No fields.
    #[classattr]
    fn __match_args__(py: Python<'_>) -> Py<PyTuple> {
        PyTuple::empty(py).unbind()
    }

    #[new]
    fn new() -> (Self, KVCacheEvent) {
        (Self, KVCacheEvent)
    }

    fn __eq__(&self, other: &Bound<'_, PyAny>) -> bool {
        other.is_instance_of::<Self>()
    }

    fn __hash__(&self, py: Python<'_>) -> PyResult<isize> {
        "AllBlocksCleared".into_pyobject(py)?.hash()
    }

    fn __repr__(&self) -> &'static str {
        "AllBlocksCleared()"
    }

    fn __reduce__(slf: &Bound<'_, Self>) -> PyResult<(PyObject, Py<PyTuple>)> {
        Ok((
            slf.get_type().into_any().unbind(),
            PyTuple::empty(slf.py()).unbind(),
        ))
    }
}

/// How [`events_to_py`] builds the Python events.
#[derive(Default)]
pub struct EventStyle<'a> {
    /// `None`: kvcore's own classes. Else the `(BlockStored, BlockRemoved, AllBlocksCleared)`
    /// classes to call with the same fields, positionally in the same order (`kvcore.vllm`
    /// passes vLLM's `vllm.distributed.kv_events` structs, which its publisher encodes).
    pub classes: Option<&'a [PyObject; 3]>,
    /// Per group, a `BlockStored`'s `(kv_cache_spec_kind, kv_cache_spec_sliding_window)`
    /// (SPEC MGR-24); `None`: both left None.
    pub group_meta: Option<&'a [(PyObject, PyObject)]>,
}

/// One event: `cls(*values)` with the given class, else kvcore's class that `make` builds
/// from the same values.
fn build<'py, T, const N: usize>(
    py: Python<'py>,
    cls: Option<&Bound<'py, PyAny>>,
    values: [Bound<'py, PyAny>; N],
    make: impl FnOnce([PyObject; N]) -> T,
) -> PyResult<Bound<'py, PyAny>>
where
    T: pyo3::PyClass<BaseType = KVCacheEvent>,
{
    match cls {
        Some(cls) => call_positional(cls, &values),
        None => {
            let event = make(values.map(Bound::unbind));
            Ok(Py::new(
                py,
                PyClassInitializer::from(KVCacheEvent).add_subclass(event),
            )?
            .into_bound(py)
            .into_any())
        }
    }
}

extern "C" {
    /// CPython's vectorcall entry point. It is a function exported by libpython from 3.11
    /// (the oldest version this module supports) and part of the stable ABI from 3.12, but
    /// pyo3's `abi3-py311` declarations only offer it from 3.12, so it is declared here.
    fn PyObject_Vectorcall(
        callable: *mut pyo3::ffi::PyObject,
        args: *const *mut pyo3::ffi::PyObject,
        nargsf: usize,
        kwnames: *mut pyo3::ffi::PyObject,
    ) -> *mut pyo3::ffi::PyObject;
}

/// `cls(*args)` by vectorcall: no argument tuple is made (an event class is called once per
/// event, and building and freeing an 11-item tuple cost more than the call).
fn call_positional<'py, const N: usize>(
    cls: &Bound<'py, PyAny>,
    args: &[Bound<'py, PyAny>; N],
) -> PyResult<Bound<'py, PyAny>> {
    let ptrs: [*mut pyo3::ffi::PyObject; N] = std::array::from_fn(|i| args[i].as_ptr());
    #[allow(unsafe_code)]
    // SAFETY: the GIL is held (`cls` is bound), `cls` and every argument are live objects
    // borrowed for the call (`args` keeps them alive until it returns), `ptrs` holds exactly
    // `N` pointers and `nargsf` says `N` with no offset flag (the callee may not write before
    // the array), and `kwnames` is NULL (no keywords). The call returns a new reference, or
    // NULL with an exception set, which `from_owned_ptr_or_err` turns into the error.
    unsafe {
        Bound::from_owned_ptr_or_err(
            cls.py(),
            PyObject_Vectorcall(cls.as_ptr(), ptrs.as_ptr(), N, std::ptr::null_mut()),
        )
    }
}

/// A list of `items`, made at its final size.
fn list_of<'py>(
    py: Python<'py>,
    mut items: impl ExactSizeIterator<Item = PyResult<Bound<'py, PyAny>>>,
) -> PyResult<Bound<'py, PyAny>> {
    if items.len() == 1 {
        // The common case (one block per event) without a vector.
        if let Some(item) = items.next() {
            return Ok(PyList::new(py, [item?])?.into_any());
        }
    }
    let mut all = Vec::with_capacity(items.len());
    for item in items {
        all.push(item?);
    }
    Ok(PyList::new(py, all)?.into_any())
}

/// Converts drained core events into a Python list of event objects, and the group ids of
/// `BlockStored` events `style.group_meta` has no entry for (their spec fields stay None).
/// `as_int` selects the integer form of hashes (SPEC EVT-2, see [`use_int_hashes`]).
pub fn events_to_py(
    py: Python<'_>,
    events: Vec<KvEvent>,
    as_int: bool,
    style: &EventStyle<'_>,
) -> PyResult<(Py<PyList>, Vec<u32>)> {
    let mut out = Vec::with_capacity(events.len());
    let mut unknown = Vec::new();
    let medium = PyString::new(py, MEDIUM_GPU).into_any();
    let none = || py.None().into_bound(py);
    // Every field is an owned `Bound`: moved into the event (or lent to the call), never
    // counted twice.
    for ev in events {
        let obj: Bound<'_, PyAny> = match ev {
            KvEvent::BlockStored {
                block_hashes,
                parent_block_hash,
                block_size,
                group_idx,
                meta,
            } => {
                let hashes = list_of(
                    py,
                    block_hashes.iter().map(|h| external_hash(py, h, as_int)),
                )?;
                let parent = match &parent_block_hash {
                    Some(h) => external_hash(py, h, as_int)?,
                    None => none(),
                };
                let extra = match &meta.extra_keys {
                    None => none(),
                    Some(keys) => list_of(
                        py,
                        keys.iter().map(|k| match k {
                            Some(v) => Ok(value_to_py(py, v)?.into_bound(py)),
                            None => Ok(none()),
                        }),
                    )?,
                };
                let (kind, window) = match style.group_meta {
                    None => (none(), none()),
                    Some(m) => match m.get(group_idx as usize) {
                        Some((k, w)) => (k.bind(py).clone(), w.bind(py).clone()),
                        None => {
                            unknown.push(group_idx);
                            (none(), none())
                        }
                    },
                };
                let lora_name = match meta.lora_name.as_deref() {
                    Some(v) => PyString::new(py, v).into_any(),
                    None => none(),
                };
                let lora_id = match meta.lora_id {
                    Some(v) => v.into_pyobject(py)?.into_any(),
                    None => none(),
                };
                let values: [Bound<'_, PyAny>; 11] = [
                    hashes,
                    parent,
                    token_ids_into_py(py, meta.token_ids)?,
                    block_size.into_pyobject(py)?.into_any(),
                    lora_id,
                    medium.clone(),
                    lora_name,
                    extra,
                    group_idx.into_pyobject(py)?.into_any(),
                    kind,
                    window,
                ];
                let cls = style.classes.map(|[c, _, _]| c.bind(py));
                build(py, cls, values, BlockStored::from_values)?
            }
            KvEvent::BlockRemoved {
                block_hash,
                group_idx,
            } => {
                let h = external_hash(py, &block_hash, as_int)?;
                let values: [Bound<'_, PyAny>; 3] = [
                    PyList::new(py, [h])?.into_any(),
                    medium.clone(),
                    group_idx.into_pyobject(py)?.into_any(),
                ];
                let cls = style.classes.map(|[_, c, _]| c.bind(py));
                build(py, cls, values, |[block_hashes, medium, group_idx]| {
                    BlockRemoved {
                        block_hashes,
                        medium,
                        group_idx,
                    }
                })?
            }
            KvEvent::AllBlocksCleared => match style.classes {
                None => Py::new(
                    py,
                    PyClassInitializer::from(KVCacheEvent).add_subclass(AllBlocksCleared),
                )?
                .into_bound(py)
                .into_any(),
                Some([_, _, cls]) => cls.bind(py).call0()?,
            },
        };
        out.push(obj);
    }
    Ok((PyList::new(py, out)?.unbind(), unknown))
}

/// Converts a Python extra-key value (None, int, str, bytes, tuple or list of those) into a
/// core [`Value`].
pub fn py_to_value(obj: &Bound<'_, PyAny>) -> PyResult<Value> {
    use pyo3::types::{PyInt, PyString};
    if obj.is_none() {
        Ok(Value::None)
    } else if let Ok(s) = obj.downcast::<PyString>() {
        Ok(Value::Str(s.to_str()?.to_owned()))
    } else if let Ok(b) = obj.downcast::<PyBytes>() {
        Ok(Value::Bytes(b.as_bytes().to_vec()))
    } else if obj.is_instance_of::<PyInt>() {
        Ok(Value::Int(obj.extract::<i64>()?))
    } else if let Ok(t) = obj.downcast::<PyTuple>() {
        Ok(Value::Tuple(
            t.iter().map(|x| py_to_value(&x)).collect::<PyResult<_>>()?,
        ))
    } else if let Ok(l) = obj.downcast::<PyList>() {
        Ok(Value::Tuple(
            l.iter().map(|x| py_to_value(&x)).collect::<PyResult<_>>()?,
        ))
    } else {
        Err(pyo3::exceptions::PyTypeError::new_err(format!(
            "unsupported extra-key value of type {}",
            obj.get_type().name()?
        )))
    }
}

//! `kvcore._native.KVCacheBlocksBase`: the storage and the per-step method of
//! `kvcore.blocks.KVCacheBlocks` (SPEC §7), which subclasses it.
//!
//! The scheduler calls `get_block_ids()` on every `allocate_slots` result, once per running
//! request and step; here it costs one native call instead of a Python frame.

use pyo3::basic::CompareOp;
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyList, PyTuple};

/// Block ids per KV cache group and the pool they belong to; see the module docs.
#[pyclass(module = "kvcore._native", name = "KVCacheBlocksBase", subclass)]
pub struct PyKVCacheBlocks {
    /// One sequence of block ids per group.
    #[pyo3(get, set)]
    blocks: Py<PyTuple>,
    /// The pool the ids belong to, or None.
    #[pyo3(get, set)]
    block_pool: PyObject,
}

/// A new list with the items of `group` (a list, a tuple or any iterable).
fn copy_group<'py>(group: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyList>> {
    if let Ok(list) = group.downcast::<PyList>() {
        return Ok(list.get_slice(0, crate::args::list_len(list)));
    }
    if let Ok(tuple) = group.downcast::<PyTuple>() {
        return Ok(tuple.to_list());
    }
    PyList::new(group.py(), group.try_iter()?.collect::<PyResult<Vec<_>>>()?)
}

/// Whether `group` is an empty list or tuple (false for anything else: other iterables are
/// only read by copying them).
fn known_empty(group: &Bound<'_, PyAny>) -> bool {
    if let Ok(list) = group.downcast::<PyList>() {
        return list.is_empty();
    }
    group.downcast::<PyTuple>().is_ok_and(|t| t.is_empty())
}

/// The result of `==` (`op` Eq) or `!=` (`op` Ne) given whether the operands are equal.
pub(crate) fn eq_result(py: Python<'_>, equal: bool, op: CompareOp) -> PyObject {
    PyBool::new(py, equal == matches!(op, CompareOp::Eq))
        .to_owned()
        .into_any()
        .unbind()
}

#[pymethods]
impl PyKVCacheBlocks {
    #[new]
    #[pyo3(signature = (blocks, block_pool = None))]
    fn new(blocks: &Bound<'_, PyAny>, block_pool: Option<PyObject>) -> PyResult<Self> {
        let py = blocks.py();
        let blocks = match blocks.downcast::<PyTuple>() {
            Ok(t) => t.clone(),
            Err(_) => PyTuple::new(py, blocks.try_iter()?.collect::<PyResult<Vec<_>>>()?)?,
        };
        Ok(Self {
            blocks: blocks.unbind(),
            block_pool: block_pool.unwrap_or_else(|| py.None()),
        })
    }

    /// Returns the ids as a tuple of new lists, one per group (SPEC KVB-2).
    ///
    /// Args:
    ///     allow_none: Return None instead when every group is empty.
    #[pyo3(signature = (allow_none = false))]
    fn get_block_ids<'py>(
        &self,
        py: Python<'py>,
        allow_none: bool,
    ) -> PyResult<Option<Bound<'py, PyTuple>>> {
        let groups = self.blocks.bind(py);
        // The scheduler asks with `allow_none` once per running request and step, mostly of
        // an empty result: answered without copying when every group is a list or a tuple.
        if allow_none && groups.iter().all(|g| known_empty(&g)) {
            return Ok(None);
        }
        let mut lists = Vec::with_capacity(groups.len());
        let mut any = false;
        for g in groups.iter() {
            let list = copy_group(&g)?;
            any |= !list.is_empty();
            lists.push(list);
        }
        if allow_none && !any {
            return Ok(None);
        }
        Ok(Some(PyTuple::new(py, lists)?))
    }

    fn __richcmp__(
        slf: &Bound<'_, Self>,
        other: &Bound<'_, PyAny>,
        op: CompareOp,
    ) -> PyResult<PyObject> {
        let py = slf.py();
        if !matches!(op, CompareOp::Eq | CompareOp::Ne) || !other.get_type().is(slf.get_type()) {
            return Ok(py.NotImplemented());
        }
        let other = other.downcast::<Self>()?;
        let a = slf.try_borrow()?.blocks.clone_ref(py);
        let b = other.try_borrow()?.blocks.clone_ref(py);
        Ok(eq_result(py, a.bind(py).eq(b.bind(py))?, op))
    }

    fn __repr__(slf: &Bound<'_, Self>) -> PyResult<String> {
        let name = slf.get_type().qualname()?;
        let blocks = slf.try_borrow()?.blocks.clone_ref(slf.py());
        Ok(format!("{name}(blocks={})", blocks.bind(slf.py()).repr()?))
    }
}

//! Conversion of core KV events into the Python event classes of `kvcore.events`.

use kvcore_core::events::KvEvent;
use kvcore_core::hash::BlockHash;
use kvcore_core::value::Value;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList, PyTuple};

const MEDIUM_GPU: &str = "GPU";

/// Reads `VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES` the way the reference does (SPEC EVT-2): unset
/// means `"1"`; the value is parsed by Python's `int()` (so `"true"` raises ValueError).
fn use_int_hashes(py: Python<'_>) -> PyResult<bool> {
    let os = py.import("os")?;
    let raw = os
        .getattr("environ")?
        .call_method1("get", ("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "1"))?;
    let as_int = py.import("builtins")?.getattr("int")?.call1((raw,))?;
    as_int.is_truthy()
}

fn external_hash(py: Python<'_>, h: &BlockHash, as_int: bool) -> PyResult<PyObject> {
    if as_int {
        Ok(h.event_int().into_pyobject(py)?.into_any().unbind())
    } else {
        Ok(PyBytes::new(py, h.as_bytes()).into_any().unbind())
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

/// Converts drained core events into a Python list of `kvcore.events` objects.
pub fn events_to_py(py: Python<'_>, events: Vec<KvEvent>) -> PyResult<Py<PyList>> {
    let out = PyList::empty(py);
    if events.is_empty() {
        return Ok(out.unbind());
    }
    let module = py.import("kvcore.events")?;
    let as_int = use_int_hashes(py)?;
    let stored_cls = module.getattr("BlockStored")?;
    let removed_cls = module.getattr("BlockRemoved")?;
    let cleared_cls = module.getattr("AllBlocksCleared")?;
    for ev in events {
        let obj = match ev {
            KvEvent::BlockStored {
                block_hashes,
                parent_block_hash,
                block_size,
                group_idx,
                meta,
            } => {
                let hashes = block_hashes
                    .iter()
                    .map(|h| external_hash(py, h, as_int))
                    .collect::<PyResult<Vec<_>>>()?;
                let parent = match &parent_block_hash {
                    Some(h) => external_hash(py, h, as_int)?,
                    None => py.None(),
                };
                let extra: PyObject = match &meta.extra_keys {
                    None => py.None(),
                    Some(keys) => {
                        let items = keys
                            .iter()
                            .map(|k| match k {
                                Some(v) => value_to_py(py, v),
                                None => Ok(py.None()),
                            })
                            .collect::<PyResult<Vec<_>>>()?;
                        PyList::new(py, items)?.into_any().unbind()
                    }
                };
                stored_cls.call1((
                    PyList::new(py, hashes)?,
                    parent,
                    PyList::new(py, &meta.token_ids)?,
                    block_size,
                    meta.lora_id,
                    MEDIUM_GPU,
                    meta.lora_name.as_deref(),
                    extra,
                    group_idx,
                ))?
            }
            KvEvent::BlockRemoved {
                block_hash,
                group_idx,
            } => {
                let h = external_hash(py, &block_hash, as_int)?;
                removed_cls.call1((PyList::new(py, [h])?, MEDIUM_GPU, group_idx))?
            }
            KvEvent::AllBlocksCleared => cleared_cls.call0()?,
        };
        out.append(obj)?;
    }
    Ok(out.unbind())
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

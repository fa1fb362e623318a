//! msgpack encoding of KV event batches (SPEC WIRE-2, WIRE-3), byte-identical to the
//! reference's msgspec encoder.
//!
//! The walk reads Python objects and streams them through the core's msgpack writer: events are
//! recognised by class name (so the reference's own event structs encode too), their fields are
//! read in EVT-1 order, and field values may be None, bool, int, float, str, bytes, bytearray,
//! list or tuple, nested. Like msgspec, only those exact types are accepted (a subclass of int
//! or str is a TypeError).

use kvcore_core::msgpack::{self as mp, LengthError};
use pyo3::exceptions::{PyOverflowError, PyRecursionError, PyTypeError};
use pyo3::prelude::*;
use pyo3::sync::GILOnceCell;
use pyo3::types::{
    PyBool, PyByteArray, PyBytes, PyFloat, PyInt, PyList, PyString, PyTuple, PyType,
};

use crate::events::STORED_FIELDS;

/// Nesting deeper than this raises RecursionError (a list that contains itself, say).
const MAX_DEPTH: usize = 1000;

fn length_err(e: LengthError) -> PyErr {
    PyOverflowError::new_err(e.to_string())
}

fn write_items<'py>(
    buf: &mut Vec<u8>,
    items: impl ExactSizeIterator<Item = Bound<'py, PyAny>>,
    depth: usize,
) -> PyResult<()> {
    mp::write_array_len(buf, items.len()).map_err(length_err)?;
    for item in items {
        write_value(buf, &item, depth + 1)?;
    }
    Ok(())
}

/// Appends one field value (SPEC WIRE-3 forms).
fn write_value(buf: &mut Vec<u8>, obj: &Bound<'_, PyAny>, depth: usize) -> PyResult<()> {
    if depth > MAX_DEPTH {
        return Err(PyRecursionError::new_err(
            "maximum recursion depth exceeded while encoding an object",
        ));
    }
    // Ints first: they are most of what an event holds.
    if obj.is_exact_instance_of::<PyInt>() {
        // `u64` first: CPython converts one-digit ints (token ids) and ints from 2**63 up
        // (half of all event hashes) without raising, while the `i64` route raises (and a
        // Python exception costs far more than the conversion) for every value from 2**63 up.
        // Only negative ints pay for a failed attempt.
        if let Ok(u) = obj.extract::<u64>() {
            mp::write_uint(buf, u);
        } else if let Ok(i) = obj.extract::<i64>() {
            mp::write_int(buf, i);
        } else {
            return Err(PyOverflowError::new_err(
                "can't serialize ints < -2**63 or > 2**64 - 1",
            ));
        }
    } else if obj.is_none() {
        mp::write_nil(buf);
    } else if let Ok(b) = obj.downcast_exact::<PyBool>() {
        mp::write_bool(buf, b.is_true());
    } else if let Ok(f) = obj.downcast_exact::<PyFloat>() {
        mp::write_f64(buf, f.value());
    } else if let Ok(s) = obj.downcast_exact::<PyString>() {
        mp::write_str(buf, s.to_str()?).map_err(length_err)?;
    } else if let Ok(b) = obj.downcast_exact::<PyBytes>() {
        mp::write_bin(buf, b.as_bytes()).map_err(length_err)?;
    } else if let Ok(b) = obj.downcast_exact::<PyByteArray>() {
        mp::write_bin(buf, &b.to_vec()).map_err(length_err)?;
    } else if let Ok(l) = obj.downcast_exact::<PyList>() {
        write_items(buf, l.iter(), depth)?;
    } else if let Ok(t) = obj.downcast_exact::<PyTuple>() {
        write_items(buf, t.iter(), depth)?;
    } else {
        return Err(PyTypeError::new_err(format!(
            "Encoding objects of type {} is unsupported",
            obj.get_type().name()?
        )));
    }
    Ok(())
}

/// The field names as Python strings, made once.
static FIELD_NAMES: GILOnceCell<Vec<Py<PyString>>> = GILOnceCell::new();

/// An event class, told apart by name.
#[derive(Clone, Copy)]
enum Kind {
    Stored,
    Removed,
    Cleared,
}

impl Kind {
    fn from_name(name: &str) -> Option<Self> {
        match name {
            "BlockStored" => Some(Self::Stored),
            "BlockRemoved" => Some(Self::Removed),
            "AllBlocksCleared" => Some(Self::Cleared),
            _ => None,
        }
    }

    fn name(self) -> &'static str {
        match self {
            Self::Stored => "BlockStored",
            Self::Removed => "BlockRemoved",
            Self::Cleared => "AllBlocksCleared",
        }
    }

    /// Indices into [`STORED_FIELDS`] of the required and the optional fields (SPEC EVT-1).
    fn fields(self) -> (&'static [usize], &'static [usize]) {
        match self {
            Self::Stored => (&[0, 1, 2, 3, 4, 5, 6], &[7, 8, 9, 10]),
            Self::Removed => (&[0, 5], &[8]),
            Self::Cleared => (&[], &[]),
        }
    }
}

/// Classifies events by class name, remembering the classes already seen in one batch.
#[derive(Default)]
struct KindCache<'py> {
    seen: Vec<(Bound<'py, PyType>, Kind)>,
}

impl<'py> KindCache<'py> {
    fn kind(&mut self, ev: &Bound<'py, PyAny>) -> PyResult<Kind> {
        let ty = ev.get_type();
        if let Some((_, k)) = self.seen.iter().find(|(t, _)| t.is(&ty)) {
            return Ok(*k);
        }
        let name = ty.name()?;
        let name = name.to_str()?;
        let Some(kind) = Kind::from_name(name) else {
            return Err(PyTypeError::new_err(format!(
                "cannot encode an event of type {name}: expected BlockStored, BlockRemoved or \
                 AllBlocksCleared"
            )));
        };
        self.seen.push((ty, kind));
        Ok(kind)
    }
}

/// Appends one event as a map: `"type"` first, then the fields in EVT-1 order; optional fields
/// that are None are left out, required ones are written as nil (SPEC WIRE-3).
fn write_event(
    buf: &mut Vec<u8>,
    ev: &Bound<'_, PyAny>,
    kind: Kind,
    names: &[Py<PyString>],
) -> PyResult<()> {
    let py = ev.py();
    let (required, optional) = kind.fields();
    let mut values = Vec::with_capacity(required.len() + optional.len());
    for &i in required {
        values.push((i, ev.getattr(names[i].bind(py))?));
    }
    for &i in optional {
        let v = ev.getattr(names[i].bind(py))?;
        if !v.is_none() {
            values.push((i, v));
        }
    }
    mp::write_map_len(buf, values.len() + 1).map_err(length_err)?;
    mp::write_str(buf, "type").map_err(length_err)?;
    mp::write_str(buf, kind.name()).map_err(length_err)?;
    for (i, v) in &values {
        mp::write_str(buf, STORED_FIELDS[*i]).map_err(length_err)?;
        write_value(buf, v, 1)?;
    }
    Ok(())
}

/// Encodes one event batch as the 3-array `[ts, [events], data_parallel_rank]` (SPEC WIRE-2).
///
/// `ts` and `data_parallel_rank` are written as the values they are (a float is float64, None
/// is nil), exactly as the reference writes its batch struct.
#[pyfunction]
#[pyo3(signature = (ts, events, data_parallel_rank=None))]
pub fn encode_event_batch<'py>(
    ts: &Bound<'py, PyAny>,
    events: &Bound<'py, PyAny>,
    data_parallel_rank: Option<&Bound<'py, PyAny>>,
) -> PyResult<Bound<'py, PyBytes>> {
    let py = ts.py();
    let events: Vec<Bound<'py, PyAny>> = if let Ok(l) = events.downcast::<PyList>() {
        l.iter().collect()
    } else if let Ok(t) = events.downcast::<PyTuple>() {
        t.iter().collect()
    } else {
        return Err(PyTypeError::new_err(format!(
            "events must be a list of events, not {}",
            events.get_type().name()?
        )));
    };
    let mut buf = Vec::with_capacity(16 + 64 * events.len());
    mp::write_array_len(&mut buf, 3).map_err(length_err)?;
    write_value(&mut buf, ts, 1)?;
    mp::write_array_len(&mut buf, events.len()).map_err(length_err)?;
    let names = FIELD_NAMES.get_or_init(py, || {
        STORED_FIELDS
            .iter()
            .map(|f| PyString::intern(py, f).unbind())
            .collect()
    });
    let mut kinds = KindCache::default();
    for ev in &events {
        let kind = kinds.kind(ev)?;
        write_event(&mut buf, ev, kind, names)?;
    }
    match data_parallel_rank {
        Some(r) => write_value(&mut buf, r, 1)?,
        None => mp::write_nil(&mut buf),
    }
    Ok(PyBytes::new(py, &buf))
}

/// Encodes one value (None, bool, int, float, str, bytes, bytearray, list or tuple, nested)
/// with the forms of SPEC WIRE-3.
#[pyfunction]
pub fn msgpack_encode<'py>(obj: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyBytes>> {
    let mut buf = Vec::new();
    write_value(&mut buf, obj, 0)?;
    Ok(PyBytes::new(obj.py(), &buf))
}

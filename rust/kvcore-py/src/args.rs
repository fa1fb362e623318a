//! Reading int arguments exactly.
//!
//! The reference takes Python ints of any size: a count of 2**63 or 10**30 is compared, sliced
//! or capped like any other, and a block id that large is simply not in the pool. A binding
//! that declared such an argument as `i64` would raise `OverflowError`, a class the
//! reference's callers do not expect, so the bindings read them through [`int_of`]: the value
//! when it fits 64 bits, else the side it overflows on, and the caller answers as the reference
//! does for a value that large (no such block, more blocks than are free, a count capped by
//! `max_model_len`).

use std::borrow::Cow;

use pyo3::exceptions::PyOverflowError;
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyString};

use crate::errors::type_error;

/// An int argument: its value, or the side of the 64-bit range it lies beyond.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Int {
    /// A value within `i64`.
    V(i64),
    /// Above `i64::MAX`.
    Above,
    /// Below `i64::MIN`.
    Below,
}

impl Int {
    /// The value as a count: `None` when negative; values beyond `i64` saturate at `cap`,
    /// as do values above it.
    pub fn count_capped(self, cap: usize) -> Option<usize> {
        match self {
            Int::V(v) if v < 0 => None,
            Int::V(v) => Some(usize::try_from(v).map_or(cap, |u| u.min(cap))),
            Int::Above => Some(cap),
            Int::Below => None,
        }
    }

    /// Whether the value is negative.
    pub fn is_negative(self) -> bool {
        matches!(self, Int::Below) || matches!(self, Int::V(v) if v < 0)
    }
}

/// Reads an int (or an object with `__index__`) exactly; see the module docs.
///
/// # Errors
/// `ArgumentTypeError` when `obj` is not an int.
#[inline]
pub fn int_of(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<Int> {
    match obj.extract::<i64>() {
        Ok(v) => Ok(Int::V(v)),
        Err(e) if e.is_instance_of::<PyOverflowError>(obj.py()) => {
            Ok(if obj.lt(0)? { Int::Below } else { Int::Above })
        }
        Err(_) => Err(type_error(what, "an int", obj)),
    }
}

/// A group id (`0..2**32`): `ArgumentTypeError` for a non-int, `ArgumentOverflowError` for an
/// int out of range (the reference's `int.to_bytes(4, "big")` raises OverflowError).
pub fn group_id_of(obj: &Bound<'_, PyAny>) -> PyResult<u32> {
    match int_of(obj, "kv_cache_group_id")? {
        Int::V(v) if (0..=i64::from(u32::MAX)).contains(&v) => Ok(v as u32),
        _ => Err(crate::errors::error(
            crate::errors::Kind::ArgumentOverflow,
            format!("kv_cache_group_id {obj} is outside 0..2**32"),
        )),
    }
}

/// The key of a request id in the Rust manager's tables: the id itself when it is valid
/// UTF-8 and does not start with NUL, else NUL followed by the hex digits of its
/// `surrogatepass` UTF-8 encoding. A Python `str` may hold lone surrogates (which have no
/// UTF-8 form); the mapping is injective, so every id keeps its own table entry, and the
/// common case borrows the id without copying.
pub fn id_key<'a>(id: &'a Bound<'_, PyString>) -> PyResult<Cow<'a, str>> {
    if let Ok(s) = id.to_str() {
        if !s.starts_with('\0') {
            return Ok(Cow::Borrowed(s));
        }
    }
    let bytes = id.call_method1(intern!(id.py(), "encode"), ("utf-8", "surrogatepass"))?;
    let bytes = bytes.downcast::<PyBytes>()?.as_bytes();
    let mut key = String::with_capacity(1 + 2 * bytes.len());
    key.push('\0');
    for b in bytes {
        key.push_str(&format!("{b:02x}"));
    }
    Ok(Cow::Owned(key))
}

/// A request id argument: `ArgumentTypeError` unless it is a `str`.
pub fn request_id_of<'a, 'py>(obj: &'a Bound<'py, PyAny>) -> PyResult<&'a Bound<'py, PyString>> {
    obj.downcast::<PyString>()
        .map_err(|_| type_error("request_id", "a str", obj))
}

/// Where token and block counts saturate: far above any pool (2**31 blocks) or sequence, so
/// that a count of 2**63 or 10**30 compares, caps and fails exactly as the reference's exact
/// int does, while sums of a few counts stay far from `usize::MAX`.
pub const COUNT_CAP: usize = 1 << 56;

/// A non-negative count of any size, saturated at [`COUNT_CAP`]: `InvalidArgumentError` when
/// negative, `ArgumentTypeError` when not an int.
pub fn count_of(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<usize> {
    int_of(obj, what)?
        .count_capped(COUNT_CAP)
        .ok_or_else(|| crate::errors::invalid(format!("{what} must be non-negative, got {obj}")))
}

/// A count argument read by [`count_of`] (usable with a default in a `#[pyo3(signature)]`).
#[derive(Clone, Copy, Debug)]
pub struct Count(pub usize);

impl<'py> FromPyObject<'py> for Count {
    fn extract_bound(obj: &Bound<'py, PyAny>) -> PyResult<Self> {
        count_of(obj, "a count").map(Count)
    }
}

/// A flag argument read by its truth value, as the reference reads its flags.
#[derive(Clone, Copy, Debug)]
pub struct Flag(pub bool);

impl<'py> FromPyObject<'py> for Flag {
    fn extract_bound(obj: &Bound<'py, PyAny>) -> PyResult<Self> {
        obj.is_truthy().map(Flag)
    }
}

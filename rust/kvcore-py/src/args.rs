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
use std::sync::atomic::{AtomicBool, Ordering};

use pyo3::exceptions::PyOverflowError;
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyInt, PyList, PyString, PyTuple};

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

/// An exact `int`'s value, read without running Python code or raising; `None` for any other
/// object (an `int` subclass, `bool`, an object with `__index__`).
#[inline(always)]
pub fn exact_int(obj: &Bound<'_, PyAny>) -> Option<Int> {
    if !obj.is_exact_instance_of::<PyInt>() {
        return None;
    }
    if INTS_ARE_311.load(Ordering::Relaxed) {
        #[allow(unsafe_code)]
        // SAFETY: `obj` is a live exact int, and `INTS_ARE_311` is set only where ints have
        // CPython 3.11's layout ([`probe_ints`]).
        if let Some(v) = unsafe { small_int_311(obj.as_ptr()) } {
            return Some(Int::V(v));
        }
    }
    exact_int_slow(obj)
}

/// Whether exact ints are read from their fields ([`small_int_311`]): CPython 3.11, its
/// layout checked at import ([`probe_ints`]).
#[inline]
pub(crate) fn ints_are_311() -> bool {
    INTS_ARE_311.load(Ordering::Relaxed)
}

/// [`exact_int`] as a count capped at [`COUNT_CAP`] ([`Int::count_capped`]), for a caller that
/// checked [`ints_are_311`] once for many calls: a one-digit positive int (below 2**30, so
/// under the cap), which most counts are, is read inline without asking again.
///
/// # Safety
/// [`ints_are_311`] returned true; the GIL is held.
#[allow(unsafe_code)]
#[inline(always)]
pub(crate) unsafe fn count_311(obj: &Bound<'_, PyAny>) -> Option<usize> {
    const _: () = assert!(COUNT_CAP >= 1 << long_layout::SHIFT);
    if !obj.is_exact_instance_of::<PyInt>() {
        return None;
    }
    // SAFETY: `obj` is a live exact int with 3.11's layout (the caller's contract): its
    // `ob_size` is its signed digit count, and a one-digit int has its digit where it is read.
    unsafe {
        let p = obj.as_ptr().cast::<u8>();
        if *p.add(long_layout::OB_SIZE).cast::<isize>() == 1 {
            return Some(*p.add(long_layout::OB_DIGIT).cast::<u32>() as usize);
        }
    }
    count_cold(obj)
}

/// [`count_311`] of an int other than one positive digit.
#[inline(never)]
fn count_cold(obj: &Bound<'_, PyAny>) -> Option<usize> {
    exact_int(obj)?.count_capped(COUNT_CAP)
}

/// [`exact_int`] through CPython's API.
#[inline(never)]
fn exact_int_slow(obj: &Bound<'_, PyAny>) -> Option<Int> {
    let mut overflow: std::os::raw::c_int = 0;
    #[allow(unsafe_code)]
    // SAFETY: `obj` is a live exact int and the GIL is held. For an int object the call only
    // reads its digits: it sets no error and returns the value, or -1 with `overflow` set to
    // the side it lies beyond when the value does not fit a C long long (64 bits on every
    // platform CPython supports).
    let value = unsafe { pyo3::ffi::PyLong_AsLongLongAndOverflow(obj.as_ptr(), &mut overflow) };
    Some(match overflow {
        0 => Int::V(value),
        o if o > 0 => Int::Above,
        _ => Int::Below,
    })
}

/// Whether exact ints are read by [`small_int_311`]: set at module import by [`probe_ints`].
static INTS_ARE_311: AtomicBool = AtomicBool::new(false);

/// CPython 3.11's int layout (`Include/cpython/longintrepr.h`): `ob_size` (the signed digit
/// count) after the object header, then 30-bit digits in `u32`s.
mod long_layout {
    pub(super) const OB_SIZE: usize = 16;
    pub(super) const OB_DIGIT: usize = 24;
    pub(super) const SHIFT: u32 = 30;
}

/// The value of an int of at most two digits, read from its fields (CPython's own
/// `PyLong_AsLongLongAndOverflow` is a call through the C API, for a decode call's three or
/// four small ints a tenth of its instructions); `None` for a bigger one.
///
/// # Safety
/// `obj` is a live exact int, the GIL is held, and ints have 3.11's layout ([`probe_ints`]).
#[allow(unsafe_code)]
#[inline(always)]
unsafe fn small_int_311(obj: *mut pyo3::ffi::PyObject) -> Option<i64> {
    use long_layout::*;
    // SAFETY: an int's `ob_size` is its signed digit count, and it has that many digits
    // (one, 0, when its size is 0): each digit read is within the object.
    unsafe {
        let p = obj.cast::<u8>();
        let size = *p.add(OB_SIZE).cast::<isize>();
        // A count of tokens is most often one positive digit: that case is read inline.
        if size == 1 {
            return Some(i64::from(*p.add(OB_DIGIT).cast::<u32>()));
        }
        small_int_311_sized(p, size)
    }
}

/// [`small_int_311`] of an int of `size` digits other than one, at `p`.
///
/// # Safety
/// As [`small_int_311`]'s; `size` is the int's `ob_size`.
#[allow(unsafe_code)]
#[inline(never)]
unsafe fn small_int_311_sized(p: *const u8, size: isize) -> Option<i64> {
    use long_layout::*;
    // SAFETY: the int has `|size|` digits (one, 0, when its size is 0): each digit read is
    // within the object.
    unsafe {
        let digit = |i: usize| i64::from(*p.add(OB_DIGIT).cast::<u32>().add(i));
        match size {
            0 => Some(0),
            1 => Some(digit(0)),
            -1 => Some(-digit(0)),
            2 => Some(digit(0) | digit(1) << SHIFT),
            -2 => Some(-(digit(0) | digit(1) << SHIFT)),
            _ => None,
        }
    }
}

/// Checks that this interpreter's ints have CPython 3.11's layout (the version, and
/// [`small_int_311`] reading probe values of every size it reads as CPython does), and turns
/// the direct read on when they do; the same for lists' item arrays ([`list_items_311`]).
pub(crate) fn probe_ints(py: Python<'_>) -> PyResult<()> {
    let version = py.version_info();
    if (version.major, version.minor) != (3, 11) {
        return Ok(());
    }
    let one = 1i64;
    let values = [
        0,
        one,
        -one,
        7,
        (one << 30) - 1,
        one << 30,
        -(one << 30),
        (one << 31) + 12345,
        (one << 60) - 1,
        -((one << 60) - 1),
    ];
    for v in values {
        let obj = v.into_pyobject(py)?;
        #[allow(unsafe_code)]
        // SAFETY: the version is 3.11 and `obj` a live exact int; the check below decides
        // whether the read is trusted.
        let read = unsafe { small_int_311(obj.as_ptr()) };
        if read != Some(v) || exact_int_slow(&obj) != Some(Int::V(v)) {
            return Ok(());
        }
    }
    // A three-digit int is left to CPython.
    let big = (1i64 << 61).into_pyobject(py)?;
    #[allow(unsafe_code)]
    // SAFETY: as above.
    if unsafe { small_int_311(big.as_ptr()) }.is_some() {
        return Ok(());
    }
    INTS_ARE_311.store(true, Ordering::Relaxed);
    // A list's item array, read where 3.11 keeps it, holds the items `PyList_GetItem` returns.
    let list = PyList::new(py, values)?;
    #[allow(unsafe_code)]
    // SAFETY: the version is 3.11, whose variable-size object header was just checked on ints
    // (`ob_size` where the direct read takes it): the word after it in a list is its item
    // array (`PyListObject` has no build variant in 3.11), here of `values.len()` items, read
    // only to be compared with what `PyList_GetItem` returns.
    let same = unsafe {
        let items = list_items_311(list.as_ptr());
        (0..values.len()).all(|i| {
            let expected = pyo3::ffi::PyList_GetItem(list.as_ptr(), i as pyo3::ffi::Py_ssize_t);
            !items.is_null() && *items.add(i) == expected
        })
    };
    LISTS_ARE_311.store(same, Ordering::Relaxed);
    Ok(())
}

/// An exact `int` within `i64` ([`exact_int`]); `None` for a bigger int or any other object.
#[inline]
pub fn exact_i64(obj: &Bound<'_, PyAny>) -> Option<i64> {
    match exact_int(obj)? {
        Int::V(v) => Some(v),
        _ => None,
    }
}

/// Items `start..end` of a list whose items there are all exact `int`s within `i64`, read
/// borrowed (no reference counting); `None` when the range is past the list's end or as soon
/// as an item is anything else (the caller then reads the list item by item, with its errors).
pub fn exact_i64s(list: &Bound<'_, PyList>, start: usize, end: usize) -> Option<Vec<i64>> {
    let mut out = Vec::with_capacity(end.saturating_sub(start));
    each_exact_i64(list, start, end, |v| out.push(v)).then_some(out)
}

/// Whether items `start..end` of `list` are all exact `int`s within `i64` ([`exact_i64s`]'s
/// check, nothing copied).
pub fn all_exact_i64s(list: &Bound<'_, PyList>, start: usize, end: usize) -> bool {
    each_exact_i64(list, start, end, |_| ())
}

/// Calls `f` with the values of items `start..end` of `list` in order while they are exact
/// `int`s within `i64`; `false` when the range is past the list's end or at the first item
/// that is not.
#[inline(always)]
fn each_exact_i64(
    list: &Bound<'_, PyList>,
    start: usize,
    end: usize,
    mut f: impl FnMut(i64),
) -> bool {
    let py = list.py();
    each_item(list, start, end, |_, item| {
        #[allow(unsafe_code)]
        // SAFETY: `item` is the list's own reference, valid while this closure runs no Python
        // code: `exact_i64` only reads an exact int's digits and `f` takes an `i64`.
        let item = unsafe { pyo3::Borrowed::from_ptr(py, item) };
        match exact_i64(&item) {
            Some(v) => {
                f(v);
                true
            }
            None => false,
        }
    })
}

/// Whether items `start..start + objs.len()` of `list` are the objects `objs` themselves
/// (compared by address, nothing read through them); `false` when the range is past the end.
pub fn list_items_are(list: &Bound<'_, PyList>, start: usize, objs: &[Py<PyAny>]) -> bool {
    let Some(end) = start.checked_add(objs.len()) else {
        return false;
    };
    each_item(list, start, end, |i, item| item == objs[i - start].as_ptr())
}

/// Calls `f` with the index and item pointer of items `start..end` of `list`, in order, while
/// it returns `true`; `false` when the range is past the list's end or once `f` returns
/// `false`. Each pointer is the list's own (borrowed) reference, valid while `f` runs no
/// Python code: read from the item array where lists have 3.11's layout, else by
/// `PyList_GetItem`.
#[inline(always)]
fn each_item(
    list: &Bound<'_, PyList>,
    start: usize,
    end: usize,
    mut f: impl FnMut(usize, *mut pyo3::ffi::PyObject) -> bool,
) -> bool {
    if start > end || end > list_len(list) {
        return false;
    }
    if LISTS_ARE_311.load(Ordering::Relaxed) {
        #[allow(unsafe_code)]
        // SAFETY: the GIL is held and lists have 3.11's layout (`LISTS_ARE_311`, probed):
        // `ob_item` points at the list's `len(list)` item pointers, each a reference the list
        // owns, and `start <= end <= len(list)`. The list is not changed meanwhile: `f` runs no
        // Python code (its contract).
        let items = unsafe { list_items_311(list.as_ptr()) };
        #[allow(unsafe_code)]
        // SAFETY: as above, `i < end <= len(list)`.
        return (start..end).all(|i| f(i, unsafe { *items.add(i) }));
    }
    (start..end).all(|i| {
        #[allow(unsafe_code)]
        // SAFETY: the GIL is held and `i < end <= len(list)`: `PyList_GetItem` returns the
        // list's own (borrowed) reference to item `i` without setting an error.
        let item = unsafe { pyo3::ffi::PyList_GetItem(list.as_ptr(), i as pyo3::ffi::Py_ssize_t) };
        f(i, item)
    })
}

/// Prefetches the line where `list`'s next item goes (its item array's end, where an append
/// writes), when lists have 3.11's layout; reads the list's header, nothing past it.
#[inline]
pub fn prefetch_list_tail(list: &Bound<'_, PyList>) {
    kvcore_core::prefetch::prefetch_line(list_end_addr(list) as *const u8);
}

/// The address where `list`'s next item goes (its item array's end), when lists have 3.11's
/// layout, else 0; reads the list's header, nothing past it. For prefetching only.
#[inline]
pub fn list_end_addr(list: &Bound<'_, PyList>) -> usize {
    if LISTS_ARE_311.load(Ordering::Relaxed) {
        #[allow(unsafe_code)]
        // SAFETY: the GIL is held and lists have 3.11's layout (`LISTS_ARE_311`, probed): the
        // word read is `ob_item`. The address is only prefetched, never read.
        let items = unsafe { list_items_311(list.as_ptr()) };
        items.wrapping_add(list_len(list)) as usize
    } else {
        0
    }
}

/// Whether [`each_exact_i64`] reads a list's items from its item array ([`list_items_311`]): set at
/// module import by [`probe_ints`].
static LISTS_ARE_311: AtomicBool = AtomicBool::new(false);

/// The length of a list, read from its header: `Py_SIZE`, a list's `ob_size`, which is its
/// length (pyo3's `len()` calls `PyList_Size` through the limited API, a call into CPython and
/// its code's cache lines on every decode call).
#[inline(always)]
pub(crate) fn list_len(list: &Bound<'_, PyList>) -> usize {
    #[allow(unsafe_code)]
    // SAFETY: `list` is a live list (any subclass shares its layout) and the GIL is held;
    // `PyVarObject`'s header is part of the stable ABI, and a list's `ob_size` is its length,
    // never negative.
    let n = unsafe { pyo3::ffi::Py_SIZE(list.as_ptr()) };
    usize::try_from(n).unwrap_or(0)
}

/// `PyListObject.ob_item` in CPython 3.11 (after the variable-size object header).
const LIST_OB_ITEM: usize = 24;

/// A list's item array (CPython 3.11's `ob_item`).
///
/// # Safety
/// `list` is a live list, the GIL is held, and lists have 3.11's layout ([`probe_ints`]).
#[allow(unsafe_code)]
#[inline(always)]
unsafe fn list_items_311(list: *mut pyo3::ffi::PyObject) -> *const *mut pyo3::ffi::PyObject {
    // SAFETY: the caller's contract: the word at `LIST_OB_ITEM` is `ob_item`.
    unsafe {
        *list
            .cast::<u8>()
            .add(LIST_OB_ITEM)
            .cast::<*const *mut pyo3::ffi::PyObject>()
    }
}

/// Reads an int (or an object with `__index__`) exactly; see the module docs. An exact `int`
/// is read directly ([`exact_int`]).
///
/// # Errors
/// `ArgumentTypeError` when `obj` is not an int.
#[inline]
pub fn int_of(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<Int> {
    if let Some(v) = exact_int(obj) {
        return Ok(v);
    }
    int_of_slow(obj, what)
}

/// [`int_of`] for objects other than exact ints: pyo3's conversion (which calls `__index__`).
#[inline(never)]
fn int_of_slow(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<Int> {
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

/// Counts from a list, a tuple (items read borrowed) or any iterable, each by [`count_of`].
///
/// # Errors
/// As [`count_of`] for the first bad item; the iterable's own errors.
pub fn counts_of(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<Vec<usize>> {
    if let Ok(list) = obj.downcast_exact::<PyList>() {
        if let Some(values) = exact_i64s(list, 0, list_len(list)) {
            if let Some(counts) = values
                .into_iter()
                .map(|v| Int::V(v).count_capped(COUNT_CAP))
                .collect::<Option<Vec<usize>>>()
            {
                return Ok(counts);
            }
        }
        // Indexed, with the errors: an `__index__` may change the list, so its length is
        // read each time.
        let mut out = Vec::with_capacity(list_len(list));
        let mut i = 0;
        while let Ok(item) = list.get_item(i) {
            out.push(count_of(&item, what)?);
            i += 1;
        }
        return Ok(out);
    }
    if let Ok(tuple) = obj.downcast_exact::<PyTuple>() {
        return tuple
            .iter_borrowed()
            .map(|item| count_of(&item, what))
            .collect();
    }
    obj.try_iter()?.map(|n| count_of(&n?, what)).collect()
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

//! Serialising calls from many threads on one pool or manager.
//!
//! A kvcore object's state is held for the duration of a call. Python can switch threads while
//! a call runs Python code (a duck-typed request's property, an event's metadata, a collection's
//! finalizer), and a second thread's call on the same object must then neither fail (PyO3's own
//! borrow check would raise `RuntimeError("Already borrowed")`) nor touch the state.
//! [`crate::pool::PyBlockPool`] and [`crate::manager::PyManagerCore`] therefore keep
//! their state in a [`GilCell`] and every method holds it through [`lock`]: a call that finds it
//! held by another thread waits with the GIL released until that call ends, so calls from many
//! threads are serialised and none fails. A call that finds it held by its own thread is a
//! re-entrant call (Python code run by the object's own call called back into it); it cannot
//! wait for itself and raises `InvariantViolationError` at once.

use std::cell::{Cell, RefCell, RefMut};
use std::ops::{Deref, DerefMut};

use pyo3::prelude::*;
use pyo3::PyClass;

use crate::errors::{error, Kind};

/// State that only the thread holding the GIL touches, one call at a time. The value first,
/// in declaration order (`repr(C)`), for callers that lay out what holds it.
#[repr(C)]
pub struct GilCell<T> {
    value: RefCell<T>,
    /// The Python thread state of the call holding `value` (0 when none does).
    owner: Cell<usize>,
}

// SAFETY: a `GilCell` is only reached through a `Bound` (see `lock`), which proves that the
// calling thread holds the GIL, and the GIL lets one thread run at a time, so the `RefCell` and
// the `Cell` are never accessed by two threads at once. A thread that waits for the cell
// releases the GIL only while it touches neither (`wait`). The value moves between threads
// with the pool or manager that owns it, which needs `T: Send`. (kvcore's extension is built
// for the limited API, which free-threaded CPython does not load, so there always is a GIL.)
#[allow(unsafe_code)]
unsafe impl<T: Send> Sync for GilCell<T> {}

impl<T> GilCell<T> {
    /// A cell holding `value`.
    pub fn new(value: T) -> Self {
        Self {
            value: RefCell::new(value),
            owner: Cell::new(0),
        }
    }
}

/// A [`RefCell`] that only the thread holding the GIL touches, taken only by
/// [`Self::try_borrow`] (never waited for, so it records no owner: a [`GilCell`] without its
/// owner word). A call that finds it held does without it: the key of a request's native
/// base, the plain-request hint map.
#[repr(transparent)]
pub struct GilRefCell<T>(RefCell<T>);

// SAFETY: as `GilCell`'s: reached only with the GIL held (`try_borrow` takes the token; the
// cycle collector's `try_borrow_in_gc` runs with the GIL held), one thread at a time, and never
// with the GIL released (nothing waits for it).
#[allow(unsafe_code)]
unsafe impl<T: Send> Sync for GilRefCell<T> {}

impl<T> GilRefCell<T> {
    /// A cell holding `value`.
    pub fn new(value: T) -> Self {
        Self(RefCell::new(value))
    }

    /// The value when no call holds it, else `None`.
    #[inline]
    pub fn try_borrow(&self, _py: Python<'_>) -> Option<RefMut<'_, T>> {
        self.0.try_borrow_mut().ok()
    }

    /// [`Self::try_borrow`] for the cycle collector's `__traverse__` and `__clear__`, which
    /// run with the GIL held but are given no token.
    #[inline]
    pub fn try_borrow_in_gc(&self) -> Option<RefMut<'_, T>> {
        self.0.try_borrow_mut().ok()
    }
}

/// A pyclass whose state lives in a [`GilCell`].
pub trait Guarded {
    /// The state.
    type State;
    /// The cell holding it.
    fn cell(&self) -> &GilCell<Self::State>;
}

/// The calling thread's Python thread state, which names it while it holds the GIL.
#[inline]
fn current_thread(_py: Python<'_>) -> usize {
    // SAFETY: `PyThreadState_Get` only reads the interpreter's current thread state, which is
    // valid while the GIL is held; the `Python` token proves the caller holds it.
    #[allow(unsafe_code)]
    let tstate = unsafe { pyo3::ffi::PyThreadState_Get() };
    tstate as usize
}

fn reentrant(what: &str) -> PyErr {
    error(
        Kind::InvariantViolation,
        format!(
            "re-entrant call: Python code run by a call on this {what} called it again (read \
             request attributes before the call, or call from another thread)"
        ),
    )
}

/// The state of a [`GilCell`], held by this call until
/// dropped.
pub struct Held<'a, T> {
    value: RefMut<'a, T>,
    /// Dropped after `value`: clears the owner.
    _owner: Release<'a>,
}

/// Clears a [`GilCell`]'s owner when its state is let go (after the borrow itself, the field
/// order of [`Held`]).
struct Release<'a>(&'a Cell<usize>);

impl Drop for Release<'_> {
    #[inline]
    fn drop(&mut self) {
        self.0.set(0);
    }
}

impl<T> Deref for Held<'_, T> {
    type Target = T;
    fn deref(&self) -> &T {
        &self.value
    }
}

impl<T> DerefMut for Held<'_, T> {
    fn deref_mut(&mut self) -> &mut T {
        &mut self.value
    }
}

/// Holds the state of `obj`, waiting (the GIL released) while another thread's call holds it.
///
/// # Errors
/// `InvariantViolationError` for a re-entrant call (this thread's call holds it).
#[inline]
pub fn lock<'a, T>(obj: &'a Bound<'_, T>, what: &str) -> PyResult<Held<'a, T::State>>
where
    T: PyClass<Frozen = pyo3::pyclass::boolean_struct::True> + Guarded + Sync,
{
    lock_cell(obj.py(), obj.get().cell(), what)
}

/// Holds `cell`, as [`lock`] does; `py` proves the GIL is held.
///
/// # Errors
/// `InvariantViolationError` for a re-entrant call (this thread's call holds it).
#[inline(always)]
pub fn lock_cell<'a, T>(py: Python<'_>, cell: &'a GilCell<T>, what: &str) -> PyResult<Held<'a, T>> {
    if let Ok(value) = cell.value.try_borrow_mut() {
        return Ok(hold(py, cell, value));
    }
    lock_cell_held(py, cell, what)
}

/// `cell`'s state `value`, borrowed by this call, with this thread recorded as its owner.
#[inline(always)]
fn hold<'a, T>(py: Python<'_>, cell: &'a GilCell<T>, value: RefMut<'a, T>) -> Held<'a, T> {
    cell.owner.set(current_thread(py));
    Held {
        value,
        _owner: Release(&cell.owner),
    }
}

/// [`lock_cell`] of a cell a call holds: out of line, as a call rarely finds one.
#[cold]
#[inline(never)]
fn lock_cell_held<'a, T>(
    py: Python<'_>,
    cell: &'a GilCell<T>,
    what: &str,
) -> PyResult<Held<'a, T>> {
    loop {
        if cell.owner.get() == current_thread(py) {
            return Err(reentrant(what));
        }
        // Another thread's call holds it and has let the GIL go (it runs Python code): let it
        // finish. Nothing of the cell is touched while the GIL is released.
        py.allow_threads(std::thread::yield_now);
        if let Ok(value) = cell.value.try_borrow_mut() {
            return Ok(hold(py, cell, value));
        }
    }
}

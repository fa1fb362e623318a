//! Serialising calls from many threads on one pool or manager.
//!
//! A kvcore object's state is borrowed for the duration of a call. Python can switch threads
//! while a call runs Python code (a duck-typed request's property, an event's metadata, a
//! collection's finalizer), and PyO3's own borrow check then refuses the other thread's call
//! with `RuntimeError("Already borrowed")`. The methods of [`crate::pool::PyBlockPool`] and
//! [`crate::manager::PyUnitaryFullAttention`] borrow through [`lock`] and [`lock_mut`]
//! instead: a call that finds the object held by another thread waits for it with the GIL
//! released, so calls from many threads are serialised and none fails. A call that finds the
//! object held by its own thread is a re-entrant call (Python code run by the object's own
//! call called back into it); it cannot wait for itself and raises `InvariantViolationError`
//! at once.

use std::cell::RefCell;
use std::ops::{Deref, DerefMut};

use pyo3::prelude::*;
use pyo3::{PyClass, PyRef, PyRefMut};

use crate::errors::{error, Kind};

thread_local! {
    /// The objects (by address) this thread holds a borrow of, innermost last.
    static HELD: RefCell<Vec<usize>> = const { RefCell::new(Vec::new()) };
}

fn key<T: PyClass>(obj: &Bound<'_, T>) -> usize {
    obj.as_ptr() as usize
}

fn held_here(k: usize) -> bool {
    HELD.with(|h| h.borrow().contains(&k))
}

fn enter(k: usize) {
    HELD.with(|h| h.borrow_mut().push(k));
}

fn leave(k: usize) {
    HELD.with(|h| {
        let mut h = h.borrow_mut();
        if let Some(i) = h.iter().rposition(|&x| x == k) {
            h.remove(i);
        }
    });
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

/// Waits, with the GIL released, for another thread's call to finish.
fn wait(py: Python<'_>) {
    py.allow_threads(std::thread::yield_now);
}

/// A shared borrow taken by [`lock`]; dereferences to the object.
pub struct Held<'py, T: PyClass> {
    guard: PyRef<'py, T>,
    key: usize,
}

impl<T: PyClass> Deref for Held<'_, T> {
    type Target = T;
    fn deref(&self) -> &T {
        &self.guard
    }
}

impl<T: PyClass> Drop for Held<'_, T> {
    fn drop(&mut self) {
        leave(self.key);
    }
}

/// A mutable borrow taken by [`lock_mut`]; dereferences to the object.
pub struct HeldMut<'py, T: PyClass<Frozen = pyo3::pyclass::boolean_struct::False>> {
    guard: PyRefMut<'py, T>,
    key: usize,
}

impl<T: PyClass<Frozen = pyo3::pyclass::boolean_struct::False>> Deref for HeldMut<'_, T> {
    type Target = T;
    fn deref(&self) -> &T {
        &self.guard
    }
}

impl<T: PyClass<Frozen = pyo3::pyclass::boolean_struct::False>> DerefMut for HeldMut<'_, T> {
    fn deref_mut(&mut self) -> &mut T {
        &mut self.guard
    }
}

impl<T: PyClass<Frozen = pyo3::pyclass::boolean_struct::False>> Drop for HeldMut<'_, T> {
    fn drop(&mut self) {
        leave(self.key);
    }
}

/// Borrows `obj` shared, waiting while another thread holds it mutably.
///
/// # Errors
/// `InvariantViolationError` for a re-entrant call (this thread holds it mutably).
pub fn lock<'py, T: PyClass>(obj: &Bound<'py, T>, what: &str) -> PyResult<Held<'py, T>> {
    let k = key(obj);
    loop {
        if let Ok(guard) = obj.try_borrow() {
            enter(k);
            return Ok(Held { guard, key: k });
        }
        if held_here(k) {
            return Err(reentrant(what));
        }
        wait(obj.py());
    }
}

/// Borrows `obj` mutably, waiting while another thread holds it.
///
/// # Errors
/// `InvariantViolationError` for a re-entrant call (this thread holds it).
pub fn lock_mut<'py, T: PyClass<Frozen = pyo3::pyclass::boolean_struct::False>>(
    obj: &Bound<'py, T>,
    what: &str,
) -> PyResult<HeldMut<'py, T>> {
    let k = key(obj);
    loop {
        if let Ok(guard) = obj.try_borrow_mut() {
            enter(k);
            return Ok(HeldMut { guard, key: k });
        }
        if held_here(k) {
            return Err(reentrant(what));
        }
        wait(obj.py());
    }
}

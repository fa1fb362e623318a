//! The one place where core errors become Python exceptions.
//!
//! Every exception kvcore raises derives from both `kvcore.KvcoreError` and the built-in class
//! a caller of the reference would catch (`ValueError`, `AssertionError`, `IndexError`...).

use pyo3::create_exception;
use pyo3::exceptions::PyException;

create_exception!(
    kvcore._native,
    KvcoreError,
    PyException,
    "Base class of every exception kvcore raises."
);

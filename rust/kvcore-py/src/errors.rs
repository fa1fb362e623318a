//! The one place where core errors become Python exceptions.
//!
//! Every exception kvcore raises derives from `kvcore.KvcoreError` and from each built-in class
//! a caller of the reference would catch for the same misuse (SPEC conventions): for example a
//! violated precondition that the reference `assert`s is both a `ValueError` and an
//! `AssertionError`. The classes are created once, at module initialisation, because PyO3's
//! `create_exception!` supports a single base only.

use kvcore_core::PoolError;
use pyo3::exceptions::PyAssertionError;
use pyo3::prelude::*;
use pyo3::sync::GILOnceCell;
use pyo3::types::{PyDict, PyTuple, PyType};

/// The exception classes of `kvcore._native`.
struct Classes {
    block_id: Py<PyType>,
    no_free_blocks: Py<PyType>,
    double_free: Py<PyType>,
    block_state: Py<PyType>,
    invalid_argument: Py<PyType>,
    argument_type: Py<PyType>,
    argument_overflow: Py<PyType>,
    invariant_violation: Py<PyType>,
    missing_blocks: Py<PyType>,
    invalid_config: Py<PyType>,
    unsupported: Py<PyType>,
}

static CLASSES: GILOnceCell<Classes> = GILOnceCell::new();

/// (name, bases after `KvcoreError`: built-in classes, or a class made earlier in this list,
/// docstring)
const SPECS: [(&str, &[&str], &str); 11] = [
    (
        "BlockIdError",
        &["IndexError", "AssertionError"],
        "A block id outside the pool.",
    ),
    (
        "NoFreeBlocksError",
        &["ValueError"],
        "More blocks were asked for than are free (SPEC POOL-5).",
    ),
    (
        "DoubleFreeError",
        &["ValueError"],
        "A block was freed more often than it was referenced.",
    ),
    (
        "BlockStateError",
        &["RuntimeError"],
        "A block is in a state the operation cannot accept (SPEC POOL-9).",
    ),
    (
        "InvalidArgumentError",
        &["ValueError", "AssertionError"],
        "An argument violates a precondition the reference asserts.",
    ),
    (
        "ArgumentTypeError",
        &["TypeError", "AttributeError"],
        "An argument of a type kvcore does not take. Also an AttributeError: the reference \
         fails on such an argument with one or the other, when it looks the object's \
         attributes or methods up.",
    ),
    (
        "ArgumentOverflowError",
        &["OverflowError", "ValueError"],
        "An int argument outside the range kvcore represents (a group id beyond 32 bits).",
    ),
    (
        "InvariantViolationError",
        &["AssertionError"],
        "A call that breaks a manager invariant where the reference asserts, e.g. prefix hits \
         for a request that is already running (SPEC COORD-5).",
    ),
    (
        "MissingBlocksError",
        &["InvalidArgumentError", "IndexError"],
        "A request holds fewer blocks than the call needs, e.g. caching blocks it was never \
         given (the reference fails indexing its block list).",
    ),
    (
        "InvalidConfigError",
        &["ValueError", "AssertionError"],
        "An inconsistent KV cache configuration (block sizes, groups, specs). The reference \
         asserts on most of these (COORD-2, COORD-7, COORD-9, SPEC-1) and raises ValueError on \
         others (CFG-2, the retention interval); this class satisfies both handlers.",
    ),
    (
        "UnsupportedError",
        &["NotImplementedError"],
        "An operation the configuration does not support, where the reference raises \
         NotImplementedError (prefix-cache lookups of cross-attention groups, XATTN-1).",
    ),
];

fn make_class<'py>(
    py: Python<'py>,
    name: &str,
    bases: Vec<Bound<'py, PyAny>>,
    doc: &str,
) -> PyResult<Py<PyType>> {
    let ns = PyDict::new(py);
    ns.set_item("__module__", "kvcore._native")?;
    ns.set_item("__doc__", doc)?;
    let ty = py
        .import("builtins")?
        .getattr("type")?
        .call1((name, PyTuple::new(py, bases)?, ns))?;
    Ok(ty.downcast_into::<PyType>()?.unbind())
}

/// Creates the exception classes and adds them to the module.
pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    let builtins = py.import("builtins")?;
    let base = make_class(
        py,
        "KvcoreError",
        vec![builtins.getattr("Exception")?],
        "Base class of every exception kvcore raises.",
    )?;
    let mut made: Vec<Py<PyType>> = Vec::new();
    for (name, extra, doc) in SPECS {
        let mut bases = Vec::new();
        for b in extra {
            match SPECS.iter().position(|s| s.0 == *b) {
                Some(i) => bases.push(made[i].bind(py).clone().into_any()),
                None => bases.push(builtins.getattr(*b)?),
            }
        }
        if !bases.iter().any(|b| {
            b.downcast::<PyType>()
                .is_ok_and(|t| t.is_subclass(base.bind(py)).unwrap_or(false))
        }) {
            bases.insert(0, base.bind(py).clone().into_any());
        }
        made.push(make_class(py, name, bases, doc)?);
    }
    m.add("KvcoreError", base.bind(py))?;
    for ((name, _, _), ty) in SPECS.iter().zip(&made) {
        m.add(*name, ty.bind(py))?;
    }
    let mut it = made.into_iter();
    let mut next = || it.next().expect("one class per SPECS entry");
    let classes = Classes {
        block_id: next(),
        no_free_blocks: next(),
        double_free: next(),
        block_state: next(),
        invalid_argument: next(),
        argument_type: next(),
        argument_overflow: next(),
        invariant_violation: next(),
        missing_blocks: next(),
        invalid_config: next(),
        unsupported: next(),
    };
    // A second initialisation of the module (sub-interpreters) keeps the first classes.
    let _ = CLASSES.set(py, classes);
    Ok(())
}

/// An error from the core or from Python, for closures the core calls back.
pub enum Error {
    /// A core error, mapped by [`to_pyerr`].
    Pool(PoolError),
    /// A Python exception raised while reading arguments.
    Py(PyErr),
}

impl From<PoolError> for Error {
    #[cold]
    #[inline(never)]
    fn from(e: PoolError) -> Self {
        Self::Pool(e)
    }
}

impl From<PyErr> for Error {
    #[cold]
    #[inline(never)]
    fn from(e: PyErr) -> Self {
        Self::Py(e)
    }
}

impl From<Error> for PyErr {
    #[cold]
    #[inline(never)]
    fn from(e: Error) -> PyErr {
        match e {
            Error::Pool(p) => to_pyerr(p),
            Error::Py(p) => p,
        }
    }
}

/// Maps a core error onto its exception class.
#[cold]
#[inline(never)]
pub fn to_pyerr(e: PoolError) -> PyErr {
    Python::with_gil(|py| {
        let Some(c) = CLASSES.get(py) else {
            return PyAssertionError::new_err(e.to_string());
        };
        let ty = match &e {
            PoolError::BlockOutOfRange { .. } => &c.block_id,
            PoolError::NotEnoughFreeBlocks { .. } => &c.no_free_blocks,
            PoolError::DoubleFree(_) => &c.double_free,
            PoolError::NotFreeNorReferenced(_) => &c.block_state,
            PoolError::InvalidPoolSize(_)
            | PoolError::NegativeCount(_)
            | PoolError::MaskLength { .. }
            | PoolError::NotEnoughHashes { .. }
            | PoolError::BlockSizeNotMultiple { .. }
            | PoolError::NotAPromotion { .. }
            | PoolError::InvalidPartial(_)
            | PoolError::InvalidHash(_)
            | PoolError::PinLimit { .. }
            | PoolError::Invalid(_) => &c.invalid_argument,
            PoolError::Invariant(_) => &c.invariant_violation,
            PoolError::MissingBlocks(_) => &c.missing_blocks,
            PoolError::Config(_) => &c.invalid_config,
            PoolError::Unsupported(_) => &c.unsupported,
        };
        PyErr::from_type(ty.bind(py).clone(), e.to_string())
    })
}

/// Raises `InvalidArgumentError` with a message.
#[cold]
#[inline(never)]
pub fn invalid(msg: impl Into<String>) -> PyErr {
    to_pyerr(PoolError::Invalid(msg.into()))
}

/// The exception classes a binding raises with its own message (not from a core error).
#[derive(Clone, Copy)]
pub enum Kind {
    /// `BlockIdError` (IndexError, AssertionError).
    BlockId,
    /// `NoFreeBlocksError` (ValueError).
    NoFreeBlocks,
    /// `InvalidArgumentError` (ValueError, AssertionError).
    InvalidArgument,
    /// `ArgumentTypeError` (TypeError, AttributeError).
    ArgumentType,
    /// `ArgumentOverflowError` (OverflowError, ValueError).
    ArgumentOverflow,
    /// `InvariantViolationError` (AssertionError).
    InvariantViolation,
}

/// An exception of class `kind` with a message.
#[cold]
#[inline(never)]
pub fn error(kind: Kind, msg: impl Into<String>) -> PyErr {
    let msg = msg.into();
    Python::with_gil(|py| {
        let Some(c) = CLASSES.get(py) else {
            return PyAssertionError::new_err(msg);
        };
        let ty = match kind {
            Kind::BlockId => &c.block_id,
            Kind::NoFreeBlocks => &c.no_free_blocks,
            Kind::InvalidArgument => &c.invalid_argument,
            Kind::ArgumentType => &c.argument_type,
            Kind::ArgumentOverflow => &c.argument_overflow,
            Kind::InvariantViolation => &c.invariant_violation,
        };
        PyErr::from_type(ty.bind(py).clone(), msg)
    })
}

/// Raises `ArgumentTypeError` naming what was expected and the type given.
#[cold]
#[inline(never)]
pub fn type_error(what: &str, expected: &str, got: &Bound<'_, PyAny>) -> PyErr {
    let name = got
        .get_type()
        .name()
        .map_or_else(|_| "?".to_owned(), |n| n.to_string());
    error(
        Kind::ArgumentType,
        format!("{what} must be {expected}, not {name}"),
    )
}

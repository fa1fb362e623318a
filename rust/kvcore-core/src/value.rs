//! A small dynamically typed value: the shapes that occur in block-hash inputs and in KV event
//! extra keys (`None`, int, str, bytes, tuple).

/// A value that can appear in a hash input triple or in an event's `extra_keys`.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Value {
    /// Python `None`.
    None,
    /// A Python `int` that fits in 64 signed bits.
    Int(i64),
    /// A Python `str`.
    Str(String),
    /// A Python `bytes`.
    Bytes(Vec<u8>),
    /// A Python `tuple` (or list, written as an array).
    Tuple(Vec<Value>),
}

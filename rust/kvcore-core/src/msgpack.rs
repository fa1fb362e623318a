//! A tiny msgpack writer: the encoding the KV event wire format uses (SPEC WIRE-2, WIRE-3).
//!
//! The reference publishes events with msgspec's msgpack encoder; this module writes the same
//! bytes. It only writes: consumers decode with any msgpack library.
//!
//! Two layers:
//! - free functions (`write_*`) append one item (or a container header) to a `Vec<u8>`, for
//!   callers that stream a structure they walk themselves (the Python bindings do);
//! - [`Value`], a small value tree, and [`encode`]/[`encode_into`] for everything else.
//!
//! ## Forms (the smallest one that fits, as msgspec picks them)
//! - ints: non-negative values always use the unsigned forms (positive fixint `00..7f`, then
//!   `cc`, `cd`, `ce`, `cf`); so every value from 2³² up is `cf` + 8 bytes. Negative values use
//!   negative fixint (down to −32), then `d0`, `d1`, `d2`, `d3`.
//! - floats: always float64 (`cb`).
//! - str: fixstr (< 32 bytes), `d9`, `da`, `db`; bin: `c4`, `c5`, `c6`.
//! - arrays: fixarray (< 16), `dc`, `dd`; maps: fixmap (< 16), `de`, `df`.
//!
//! ## Examples
//! ```
//! use kvcore_core::msgpack::{encode, Value};
//! let batch = Value::Array(vec![Value::Float(1.5), Value::Array(vec![]), Value::Nil]);
//! assert_eq!(encode(&batch).unwrap(), [0x93, 0xcb, 0x3f, 0xf8, 0, 0, 0, 0, 0, 0, 0x90, 0xc0]);
//! ```

use std::fmt;

use crate::value::Value as KeyValue;

/// A length that no msgpack header can carry (more than `u32::MAX` bytes or items).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LengthError {
    /// The length that did not fit.
    pub len: usize,
}

impl fmt::Display for LengthError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "msgpack cannot encode a length of {} (max 2**32 - 1)",
            self.len
        )
    }
}

impl std::error::Error for LengthError {}

fn len32(len: usize) -> Result<u32, LengthError> {
    u32::try_from(len).map_err(|_| LengthError { len })
}

/// Appends nil (`c0`).
pub fn write_nil(buf: &mut Vec<u8>) {
    buf.push(0xc0);
}

/// Appends a bool (`c2` false, `c3` true).
pub fn write_bool(buf: &mut Vec<u8>, v: bool) {
    buf.push(if v { 0xc3 } else { 0xc2 });
}

/// Appends a non-negative int in the smallest unsigned form.
pub fn write_uint(buf: &mut Vec<u8>, v: u64) {
    if v < 0x80 {
        buf.push(v as u8);
    } else if let Ok(b) = u8::try_from(v) {
        buf.extend_from_slice(&[0xcc, b]);
    } else if let Ok(h) = u16::try_from(v) {
        buf.push(0xcd);
        buf.extend_from_slice(&h.to_be_bytes());
    } else if let Ok(w) = u32::try_from(v) {
        buf.push(0xce);
        buf.extend_from_slice(&w.to_be_bytes());
    } else {
        buf.push(0xcf);
        buf.extend_from_slice(&v.to_be_bytes());
    }
}

/// Appends a signed int: the unsigned forms when it is non-negative, else the smallest signed
/// form (negative fixint down to −32, then `d0`..`d3`).
pub fn write_int(buf: &mut Vec<u8>, v: i64) {
    if let Ok(u) = u64::try_from(v) {
        write_uint(buf, u);
    } else if v >= -32 {
        // -32 <= v < 0: the negative fixint is the value's low byte (0xe0..0xff).
        buf.push(v.to_be_bytes()[7]);
    } else if let Ok(b) = i8::try_from(v) {
        buf.push(0xd0);
        buf.extend_from_slice(&b.to_be_bytes());
    } else if let Ok(h) = i16::try_from(v) {
        buf.push(0xd1);
        buf.extend_from_slice(&h.to_be_bytes());
    } else if let Ok(w) = i32::try_from(v) {
        buf.push(0xd2);
        buf.extend_from_slice(&w.to_be_bytes());
    } else {
        buf.push(0xd3);
        buf.extend_from_slice(&v.to_be_bytes());
    }
}

/// Appends a float as float64 (`cb`), whatever its value (NaN and infinities included).
pub fn write_f64(buf: &mut Vec<u8>, v: f64) {
    buf.push(0xcb);
    buf.extend_from_slice(&v.to_bits().to_be_bytes());
}

/// Appends a UTF-8 string (fixstr, `d9`, `da` or `db`).
pub fn write_str(buf: &mut Vec<u8>, s: &str) -> Result<(), LengthError> {
    let n = len32(s.len())?;
    if n < 32 {
        buf.push(0xa0 | n as u8);
    } else if let Ok(b) = u8::try_from(n) {
        buf.extend_from_slice(&[0xd9, b]);
    } else if let Ok(h) = u16::try_from(n) {
        buf.push(0xda);
        buf.extend_from_slice(&h.to_be_bytes());
    } else {
        buf.push(0xdb);
        buf.extend_from_slice(&n.to_be_bytes());
    }
    buf.extend_from_slice(s.as_bytes());
    Ok(())
}

/// Appends a byte string as bin (`c4`, `c5` or `c6`).
pub fn write_bin(buf: &mut Vec<u8>, b: &[u8]) -> Result<(), LengthError> {
    let n = len32(b.len())?;
    if let Ok(x) = u8::try_from(n) {
        buf.extend_from_slice(&[0xc4, x]);
    } else if let Ok(h) = u16::try_from(n) {
        buf.push(0xc5);
        buf.extend_from_slice(&h.to_be_bytes());
    } else {
        buf.push(0xc6);
        buf.extend_from_slice(&n.to_be_bytes());
    }
    buf.extend_from_slice(b);
    Ok(())
}

/// Appends an array header for `len` items (fixarray, `dc` or `dd`); the items follow.
pub fn write_array_len(buf: &mut Vec<u8>, len: usize) -> Result<(), LengthError> {
    let n = len32(len)?;
    if n < 16 {
        buf.push(0x90 | n as u8);
    } else if let Ok(h) = u16::try_from(n) {
        buf.push(0xdc);
        buf.extend_from_slice(&h.to_be_bytes());
    } else {
        buf.push(0xdd);
        buf.extend_from_slice(&n.to_be_bytes());
    }
    Ok(())
}

/// Appends a map header for `len` entries (fixmap, `de` or `df`); key, value pairs follow.
pub fn write_map_len(buf: &mut Vec<u8>, len: usize) -> Result<(), LengthError> {
    let n = len32(len)?;
    if n < 16 {
        buf.push(0x80 | n as u8);
    } else if let Ok(h) = u16::try_from(n) {
        buf.push(0xde);
        buf.extend_from_slice(&h.to_be_bytes());
    } else {
        buf.push(0xdf);
        buf.extend_from_slice(&n.to_be_bytes());
    }
    Ok(())
}

/// A msgpack value tree.
#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    /// nil.
    Nil,
    /// A bool.
    Bool(bool),
    /// A signed int (written in the unsigned forms when non-negative).
    Int(i64),
    /// An unsigned int (for values above `i64::MAX`, such as event hashes).
    UInt(u64),
    /// A float, written as float64.
    Float(f64),
    /// A UTF-8 string.
    Str(String),
    /// A byte string (bin).
    Bin(Vec<u8>),
    /// An array.
    Array(Vec<Value>),
    /// A map, entries in order.
    Map(Vec<(Value, Value)>),
}

/// Appends the encoding of `v` to `buf`.
///
/// # Errors
/// [`LengthError`] when a string, byte string or container is longer than `u32::MAX`; `buf`
/// then holds a partial encoding.
pub fn encode_into(buf: &mut Vec<u8>, v: &Value) -> Result<(), LengthError> {
    match v {
        Value::Nil => write_nil(buf),
        Value::Bool(b) => write_bool(buf, *b),
        Value::Int(i) => write_int(buf, *i),
        Value::UInt(u) => write_uint(buf, *u),
        Value::Float(f) => write_f64(buf, *f),
        Value::Str(s) => write_str(buf, s)?,
        Value::Bin(b) => write_bin(buf, b)?,
        Value::Array(items) => {
            write_array_len(buf, items.len())?;
            for x in items {
                encode_into(buf, x)?;
            }
        }
        Value::Map(entries) => {
            write_map_len(buf, entries.len())?;
            for (k, x) in entries {
                encode_into(buf, k)?;
                encode_into(buf, x)?;
            }
        }
    }
    Ok(())
}

/// Encodes `v` into a new buffer.
///
/// # Errors
/// [`LengthError`] when a string, byte string or container is longer than `u32::MAX`.
pub fn encode(v: &Value) -> Result<Vec<u8>, LengthError> {
    let mut buf = Vec::new();
    encode_into(&mut buf, v)?;
    Ok(buf)
}

impl From<&KeyValue> for Value {
    /// An extra-key value as it appears on the wire: tuples become arrays (SPEC WIRE-3).
    fn from(v: &KeyValue) -> Self {
        match v {
            KeyValue::None => Value::Nil,
            KeyValue::Int(i) => Value::Int(*i),
            KeyValue::Str(s) => Value::Str(s.clone()),
            KeyValue::Bytes(b) => Value::Bin(b.clone()),
            KeyValue::Tuple(items) => Value::Array(items.iter().map(Value::from).collect()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hex(b: &[u8]) -> String {
        b.iter().map(|x| format!("{x:02x}")).collect()
    }

    fn enc(v: &Value) -> String {
        hex(&encode(v).unwrap())
    }

    fn s(x: &str) -> Value {
        Value::Str(x.to_owned())
    }

    fn int_hex(v: i64) -> String {
        let mut b = Vec::new();
        write_int(&mut b, v);
        hex(&b)
    }

    fn uint_hex(v: u64) -> String {
        let mut b = Vec::new();
        write_uint(&mut b, v);
        hex(&b)
    }

    /// WIRE-3: non-negative ints use the unsigned forms at every boundary.
    #[test]
    fn unsigned_forms() {
        assert_eq!(uint_hex(0), "00");
        assert_eq!(uint_hex(127), "7f");
        assert_eq!(uint_hex(128), "cc80");
        assert_eq!(uint_hex(255), "ccff");
        assert_eq!(uint_hex(256), "cd0100");
        assert_eq!(uint_hex(65535), "cdffff");
        assert_eq!(uint_hex(65536), "ce00010000");
        assert_eq!(uint_hex(u32::MAX as u64), "ceffffffff");
        assert_eq!(uint_hex(1 << 32), "cf0000000100000000");
        assert_eq!(uint_hex(u64::MAX), "cfffffffffffffffff");
        // Signed ints that are non-negative take the same forms, never d0..d3.
        assert_eq!(int_hex(200), "ccc8");
        assert_eq!(int_hex(1 << 32), "cf0000000100000000");
        assert_eq!(int_hex(i64::MAX), "cf7fffffffffffffff");
    }

    /// WIRE-3: negative ints use negative fixint down to -32, then d0..d3.
    #[test]
    fn signed_forms() {
        assert_eq!(int_hex(-1), "ff");
        assert_eq!(int_hex(-13), "f3");
        assert_eq!(int_hex(-32), "e0");
        assert_eq!(int_hex(-33), "d0df");
        assert_eq!(int_hex(-128), "d080");
        assert_eq!(int_hex(-129), "d1ff7f");
        assert_eq!(int_hex(-32768), "d18000");
        assert_eq!(int_hex(-32769), "d2ffff7fff");
        assert_eq!(int_hex(i32::MIN as i64), "d280000000");
        assert_eq!(int_hex(i32::MIN as i64 - 1), "d3ffffffff7fffffff");
        assert_eq!(int_hex(i64::MIN), "d38000000000000000");
    }

    /// WIRE-3: floats are always float64.
    #[test]
    fn floats_are_f64() {
        assert_eq!(enc(&Value::Float(1.5)), "cb3ff8000000000000");
        assert_eq!(enc(&Value::Float(0.0)), "cb0000000000000000");
        assert_eq!(enc(&Value::Float(-2.0)), "cbc000000000000000");
    }

    #[test]
    fn scalars() {
        assert_eq!(enc(&Value::Nil), "c0");
        assert_eq!(enc(&Value::Bool(false)), "c2");
        assert_eq!(enc(&Value::Bool(true)), "c3");
    }

    /// WIRE-3: str and bin header forms at the length boundaries.
    #[test]
    fn str_and_bin_lengths() {
        let header = |v: &Value, n: usize| {
            let b = encode(v).unwrap();
            hex(&b[..b.len() - n])
        };
        for (n, want) in [
            (0, "a0"),
            (31, "bf"),
            (32, "d920"),
            (255, "d9ff"),
            (256, "da0100"),
            (65535, "daffff"),
            (65536, "db00010000"),
        ] {
            assert_eq!(header(&Value::Str("x".repeat(n)), n), want, "str {n}");
        }
        for (n, want) in [
            (0, "c400"),
            (1, "c401"),
            (255, "c4ff"),
            (256, "c50100"),
            (65535, "c5ffff"),
            (65536, "c600010000"),
        ] {
            assert_eq!(header(&Value::Bin(vec![7; n]), n), want, "bin {n}");
        }
        assert_eq!(enc(&s("GPU")), "a3475055");
        assert_eq!(enc(&Value::Bin(vec![1, 2])), "c4020102");
    }

    #[test]
    fn container_lengths() {
        let mut b = Vec::new();
        for (n, want) in [
            (0, "90"),
            (15, "9f"),
            (16, "dc0010"),
            (65535, "dcffff"),
            (65536, "dd00010000"),
        ] {
            b.clear();
            write_array_len(&mut b, n).unwrap();
            assert_eq!(hex(&b), want, "array {n}");
        }
        for (n, want) in [
            (0, "80"),
            (15, "8f"),
            (16, "de0010"),
            (65535, "deffff"),
            (65536, "df00010000"),
        ] {
            b.clear();
            write_map_len(&mut b, n).unwrap();
            assert_eq!(hex(&b), want, "map {n}");
        }
        let arr = Value::Array((0..16).map(Value::Int).collect());
        assert_eq!(enc(&arr), "dc0010000102030405060708090a0b0c0d0e0f");
    }

    #[test]
    fn length_overflow_is_an_error() {
        let mut b = Vec::new();
        let err = write_array_len(&mut b, usize::MAX).unwrap_err();
        assert_eq!(err.len, usize::MAX);
        assert!(err.to_string().contains("cannot encode"));
        assert!(write_map_len(&mut b, u32::MAX as usize).is_ok());
    }

    /// TV-B: `KVEventBatch(ts=1.5, events=[AllBlocksCleared()])` with rank None.
    #[test]
    fn tv_b_all_blocks_cleared_batch() {
        let batch = Value::Array(vec![
            Value::Float(1.5),
            Value::Array(vec![Value::Map(vec![(s("type"), s("AllBlocksCleared"))])]),
            Value::Nil,
        ]);
        assert_eq!(
            enc(&batch),
            "93cb3ff80000000000009181a474797065b0416c6c426c6f636b73436c6561726564c0"
        );
    }

    /// TV-B: a `BlockStored` carrying every optional field is a 12-entry fixmap.
    #[test]
    fn tv_b_block_stored() {
        let extra = KeyValue::Tuple(vec![
            KeyValue::Str("lora-a".into()),
            KeyValue::Tuple(vec![KeyValue::Str("img".into()), KeyValue::Int(-13)]),
            KeyValue::Bytes(vec![0]),
        ]);
        let ev = Value::Map(vec![
            (s("type"), s("BlockStored")),
            (
                s("block_hashes"),
                Value::Array(vec![Value::UInt(2758186210834249151)]),
            ),
            (s("parent_block_hash"), Value::UInt(3236607068019569386)),
            (s("token_ids"), Value::Array(vec![Value::Int(17)])),
            (s("block_size"), Value::Int(16)),
            (s("lora_id"), Value::Nil),
            (s("medium"), s("GPU")),
            (s("lora_name"), Value::Nil),
            (s("extra_keys"), Value::Array(vec![Value::from(&extra)])),
            (s("group_idx"), Value::Int(1)),
            (s("kv_cache_spec_kind"), s("sliding_window")),
            (s("kv_cache_spec_sliding_window"), Value::Int(32)),
        ]);
        assert_eq!(
            enc(&ev),
            "8ca474797065ab426c6f636b53746f726564ac626c6f636b5f68617368657391cf26470bbec927f5bf\
             b1706172656e745f626c6f636b5f68617368cf2ceabcfae6d332eaa9746f6b656e5f6964739111\
             aa626c6f636b5f73697a6510a76c6f72615f6964c0a66d656469756da3475055a96c6f72615f6e61\
             6d65c0aa65787472615f6b6579739193a66c6f72612d6192a3696d67f3c40100a967726f75705f69\
             647801b26b765f63616368655f737065635f6b696e64ae736c6964696e675f77696e646f77bc6b76\
             5f63616368655f737065635f736c6964696e675f77696e646f7720"
        );
    }

    #[test]
    fn key_value_conversion() {
        assert_eq!(Value::from(&KeyValue::None), Value::Nil);
        assert_eq!(enc(&Value::from(&KeyValue::Int(-1))), "ff");
        assert_eq!(
            enc(&Value::from(&KeyValue::Tuple(vec![]))),
            "90",
            "an empty tuple is an empty array"
        );
    }
}

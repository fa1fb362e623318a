//! CPython pickle protocol 5, byte for byte, for the shapes that occur in block-hash inputs
//! (SPEC HASH-4).
//!
//! The writer reproduces what `pickle.dumps(obj, protocol=5)` emits for `None`, `int` (64-bit),
//! `str`, `bytes` and `tuple`, including the frame header and the `MEMOIZE` opcode after every
//! memoised object. It assumes no object occurs twice by identity (CPython would then emit a
//! `BINGET` back-reference); the bindings check that before calling in. Payloads whose frame
//! would reach 64 KiB are refused, because CPython splits frames there.

use super::HashError;
use crate::value::Value;

const PROTO: u8 = 0x80;
const FRAME: u8 = 0x95;
const STOP: u8 = b'.';
const NONE: u8 = b'N';
const MEMOIZE: u8 = 0x94;
const MARK: u8 = b'(';
const TUPLE: u8 = b't';
const EMPTY_TUPLE: u8 = b')';
const TUPLE_N: [u8; 3] = [0x85, 0x86, 0x87];
const BININT1: u8 = b'K';
const BININT2: u8 = b'M';
const BININT: u8 = b'J';
const LONG1: u8 = 0x8a;
const SHORT_BINUNICODE: u8 = 0x8c;
const BINUNICODE: u8 = b'X';
const SHORT_BINBYTES: u8 = b'C';
const BINBYTES: u8 = b'B';

/// CPython's `FRAME_SIZE_TARGET`: a frame this long is committed and a new one started.
const FRAME_SIZE_TARGET: usize = 64 * 1024;
/// CPython's `FRAME_SIZE_MIN`: shorter frames are written without a frame header.
const FRAME_SIZE_MIN: usize = 4;
/// `PROTO 5` plus `FRAME` and its 8-byte length.
const HEADER_LEN: usize = 11;

/// Starts a pickle in `out` (cleared first); finish it with [`end`].
#[inline]
pub(crate) fn begin(out: &mut Vec<u8>) {
    out.clear();
    out.extend_from_slice(&[PROTO, 5, FRAME, 0, 0, 0, 0, 0, 0, 0, 0]);
}

/// Writes `STOP` and the frame length, or drops the frame header when the body is shorter
/// than CPython's minimum frame.
///
/// # Errors
/// [`HashError::Unsupported`] when the body reaches CPython's frame-splitting size.
#[inline]
pub(crate) fn end(out: &mut Vec<u8>) -> Result<(), HashError> {
    out.push(STOP);
    let body = out.len() - HEADER_LEN;
    if body >= FRAME_SIZE_TARGET {
        return Err(HashError::Unsupported("pickle larger than one frame"));
    }
    if body < FRAME_SIZE_MIN {
        out.drain(2..HEADER_LEN);
    } else {
        out[3..HEADER_LEN].copy_from_slice(&(body as u64).to_le_bytes());
    }
    Ok(())
}

/// Writes an int the way `save_long` does for protocol 2 and above.
///
/// Each branch appends a fixed-size array, which compiles to plain stores (a variable-length
/// copy would call `memmove` per token).
#[inline]
pub(crate) fn write_int(out: &mut Vec<u8>, v: i64) {
    if (0..=0xff).contains(&v) {
        out.extend_from_slice(&[BININT1, v as u8]);
    } else if (0..=0xffff).contains(&v) {
        let b = (v as u16).to_le_bytes();
        out.extend_from_slice(&[BININT2, b[0], b[1]]);
    } else if let Ok(v32) = i32::try_from(v) {
        let b = v32.to_le_bytes();
        out.extend_from_slice(&[BININT, b[0], b[1], b[2], b[3]]);
    } else {
        // Minimal two's-complement, little-endian: drop redundant sign bytes.
        let bytes = v.to_le_bytes();
        let mut n = 8;
        while n > 1 {
            let top = bytes[n - 1];
            let next_sign = bytes[n - 2] & 0x80;
            if (top == 0 && next_sign == 0) || (top == 0xff && next_sign != 0) {
                n -= 1;
            } else {
                break;
            }
        }
        out.extend_from_slice(&[LONG1, n as u8]);
        out.extend_from_slice(&bytes[..n]);
    }
}

#[inline]
fn write_sized(out: &mut Vec<u8>, short: u8, long: u8, data: &[u8]) -> Result<(), HashError> {
    if data.len() <= 0xff {
        out.extend_from_slice(&[short, data.len() as u8]);
    } else if data.len() < FRAME_SIZE_TARGET {
        out.push(long);
        out.extend_from_slice(&(data.len() as u32).to_le_bytes());
    } else {
        return Err(HashError::Unsupported("pickle larger than one frame"));
    }
    out.extend_from_slice(data);
    out.push(MEMOIZE);
    Ok(())
}

/// Writes a `bytes` object and memoises it.
#[inline]
pub(crate) fn write_bytes(out: &mut Vec<u8>, data: &[u8]) -> Result<(), HashError> {
    write_sized(out, SHORT_BINBYTES, BINBYTES, data)
}

/// Writes a tuple of ints (the block's token ids).
#[inline]
pub(crate) fn write_int_tuple(out: &mut Vec<u8>, tokens: &[i64]) {
    if tokens.is_empty() {
        out.push(EMPTY_TUPLE);
        return;
    }
    out.reserve(tokens.len() * 10 + 3);
    let long = tokens.len() > 3;
    if long {
        out.push(MARK);
    }
    for &t in tokens {
        write_int(out, t);
    }
    out.push(if long {
        TUPLE
    } else {
        TUPLE_N[tokens.len() - 1]
    });
    out.push(MEMOIZE);
}

/// Writes the items of a tuple followed by the tuple opcode (shared by [`write_value`] and the
/// block triple).
pub(crate) fn write_tuple(out: &mut Vec<u8>, items: &[Value]) -> Result<(), HashError> {
    if items.is_empty() {
        out.push(EMPTY_TUPLE);
        return Ok(());
    }
    let long = items.len() > 3;
    if long {
        out.push(MARK);
    }
    for item in items {
        write_value(out, item)?;
    }
    out.push(if long {
        TUPLE
    } else {
        TUPLE_N[items.len() - 1]
    });
    out.push(MEMOIZE);
    Ok(())
}

/// Writes any [`Value`] (without header or `STOP`).
///
/// # Errors
/// [`HashError::Unsupported`] for a payload CPython would split across frames.
pub(crate) fn write_value(out: &mut Vec<u8>, v: &Value) -> Result<(), HashError> {
    match v {
        Value::None => out.push(NONE),
        Value::Int(i) => write_int(out, *i),
        Value::Str(s) => write_sized(out, SHORT_BINUNICODE, BINUNICODE, s.as_bytes())?,
        Value::Bytes(b) => write_bytes(out, b)?,
        Value::Tuple(items) => write_tuple(out, items)?,
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dumps(v: &Value) -> Vec<u8> {
        let mut out = Vec::new();
        begin(&mut out);
        write_value(&mut out, v).unwrap();
        end(&mut out).unwrap();
        out
    }

    #[test]
    fn small_values_have_no_frame() {
        assert_eq!(dumps(&Value::None), b"\x80\x05N.");
        assert_eq!(dumps(&Value::Int(5)), b"\x80\x05K\x05.");
        assert_eq!(dumps(&Value::Tuple(vec![])), b"\x80\x05).");
    }

    #[test]
    fn seed_string_matches_hash_10() {
        assert_eq!(
            dumps(&Value::Str("0".into())),
            b"\x80\x05\x95\x05\x00\x00\x00\x00\x00\x00\x00\x8c\x010\x94."
        );
    }

    #[test]
    fn int_forms() {
        let enc = |v: i64| {
            let mut o = Vec::new();
            write_int(&mut o, v);
            o
        };
        assert_eq!(enc(255), [0x4b, 0xff]);
        assert_eq!(enc(256), [0x4d, 0x00, 0x01]);
        assert_eq!(enc(65536), [0x4a, 0x00, 0x00, 0x01, 0x00]);
        assert_eq!(enc(-1), [0x4a, 0xff, 0xff, 0xff, 0xff]);
        assert_eq!(enc(1 << 31), [0x8a, 5, 0, 0, 0, 0x80, 0]);
        assert_eq!(enc(-(1 << 31) - 1), [0x8a, 5, 0xff, 0xff, 0xff, 0x7f, 0xff]);
        assert_eq!(enc(1 << 33), [0x8a, 5, 0, 0, 0, 0, 2]);
        assert_eq!(
            enc(i64::MAX),
            [0x8a, 8, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x7f]
        );
        assert_eq!(enc(i64::MIN), [0x8a, 8, 0, 0, 0, 0, 0, 0, 0, 0x80]);
    }

    #[test]
    fn long_str_and_bytes() {
        let s = "x".repeat(256);
        let p = dumps(&Value::Str(s.clone()));
        assert_eq!(&p[11..16], &[b'X', 0, 1, 0, 0]);
        let b = dumps(&Value::Bytes(vec![7; 300]));
        assert_eq!(&b[11..16], &[b'B', 0x2c, 1, 0, 0]);
    }

    #[test]
    fn frame_limit_is_refused() {
        let mut out = Vec::new();
        begin(&mut out);
        assert!(write_value(&mut out, &Value::Bytes(vec![0; FRAME_SIZE_TARGET])).is_err());
    }
}

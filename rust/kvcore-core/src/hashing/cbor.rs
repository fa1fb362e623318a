//! Canonical CBOR (RFC 8949 §4.2.1 shortest forms) of block-hash inputs, byte-identical to
//! `cbor2.dumps(obj, canonical=True)` for `None`, 64-bit ints, `str`, `bytes` and tuples
//! (SPEC HASH-3).

use crate::value::Value;

const NULL: u8 = 0xf6;

/// Writes a head: major type `major` (0..=7) with argument `n` in its shortest form.
///
/// Each branch appends a fixed-size array (plain stores, no `memmove` call per token).
#[inline]
pub(crate) fn write_head(out: &mut Vec<u8>, major: u8, n: u64) {
    let m = major << 5;
    if n < 24 {
        out.push(m | n as u8);
    } else if n <= 0xff {
        out.extend_from_slice(&[m | 24, n as u8]);
    } else if n <= 0xffff {
        let b = (n as u16).to_be_bytes();
        out.extend_from_slice(&[m | 25, b[0], b[1]]);
    } else if n <= 0xffff_ffff {
        let b = (n as u32).to_be_bytes();
        out.extend_from_slice(&[m | 26, b[0], b[1], b[2], b[3]]);
    } else {
        let b = n.to_be_bytes();
        out.extend_from_slice(&[m | 27, b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7]]);
    }
}

/// Writes an int: major type 0 for `v >= 0`, else major type 1 with `-1 - v`.
#[inline]
pub(crate) fn write_int(out: &mut Vec<u8>, v: i64) {
    if v >= 0 {
        write_head(out, 0, v as u64);
    } else {
        write_head(out, 1, !v as u64);
    }
}

/// Writes a byte string.
#[inline]
pub(crate) fn write_bytes(out: &mut Vec<u8>, data: &[u8]) {
    write_head(out, 2, data.len() as u64);
    out.extend_from_slice(data);
}

/// Writes an array of ints (the block's token ids).
#[inline]
pub(crate) fn write_int_array(out: &mut Vec<u8>, tokens: &[i64]) {
    write_head(out, 4, tokens.len() as u64);
    // Room for the longest form of every int, then one fixed-size store per token (no length
    // or capacity check per byte), then cut to what was written.
    let start = out.len();
    out.resize(start + tokens.len() * 9, 0);
    let mut pos = start;
    for &t in tokens {
        if let Some(slot) = out.get_mut(pos..pos + 9) {
            if let Ok(slot) = <&mut [u8; 9]>::try_from(slot) {
                pos += encode_int(slot, t);
            }
        }
    }
    out.truncate(pos);
}

/// Encodes an int (major type 0, or 1 with `-1 - v`) at the front of `dst`; returns its length.
#[inline(always)]
fn encode_int(dst: &mut [u8; 9], v: i64) -> usize {
    let (m, n) = if v >= 0 {
        (0u8, v as u64)
    } else {
        (1 << 5, !v as u64)
    };
    if n < 24 {
        dst[0] = m | n as u8;
        1
    } else if n <= 0xff {
        dst[0] = m | 24;
        dst[1] = n as u8;
        2
    } else if n <= 0xffff {
        let b = (n as u16).to_be_bytes();
        dst[0] = m | 25;
        dst[1] = b[0];
        dst[2] = b[1];
        3
    } else if n <= 0xffff_ffff {
        dst[0] = m | 26;
        dst[1..5].copy_from_slice(&(n as u32).to_be_bytes());
        5
    } else {
        dst[0] = m | 27;
        dst[1..9].copy_from_slice(&n.to_be_bytes());
        9
    }
}

/// Writes any [`Value`]; a tuple becomes an array.
pub(crate) fn write_value(out: &mut Vec<u8>, v: &Value) {
    match v {
        Value::None => out.push(NULL),
        Value::Int(i) => write_int(out, *i),
        Value::Str(s) => {
            write_head(out, 3, s.len() as u64);
            out.extend_from_slice(s.as_bytes());
        }
        Value::Bytes(b) => write_bytes(out, b),
        Value::Tuple(items) => {
            write_head(out, 4, items.len() as u64);
            for item in items {
                write_value(out, item);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn enc(v: &Value) -> Vec<u8> {
        let mut o = Vec::new();
        write_value(&mut o, v);
        o
    }

    #[test]
    fn heads_use_shortest_form() {
        assert_eq!(enc(&Value::Int(23)), [0x17]);
        assert_eq!(enc(&Value::Int(24)), [0x18, 24]);
        assert_eq!(enc(&Value::Int(300)), [0x19, 1, 0x2c]);
        assert_eq!(enc(&Value::Int(70000)), [0x1a, 0, 1, 0x11, 0x70]);
        assert_eq!(enc(&Value::Int(1 << 33)), [0x1b, 0, 0, 0, 2, 0, 0, 0, 0]);
        assert_eq!(enc(&Value::Int(-13)), [0x2c]);
        assert_eq!(enc(&Value::Int(-1)), [0x20]);
        assert_eq!(
            enc(&Value::Int(i64::MIN)),
            [0x3b, 0x7f, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff]
        );
    }

    #[test]
    fn int_arrays_match_the_value_encoder_at_every_boundary() {
        let edges = [
            0,
            23,
            24,
            255,
            256,
            65535,
            65536,
            0xffff_ffff,
            1 << 32,
            i64::MAX,
            -1,
            -24,
            -25,
            -256,
            -257,
            -65536,
            -65537,
            -(1 << 32),
            -(1 << 32) - 1,
            i64::MIN,
        ];
        for len in [0, 1, 16, edges.len()] {
            let tokens: Vec<i64> = edges.iter().copied().cycle().take(len).collect();
            let mut fast = vec![0xaa];
            write_int_array(&mut fast, &tokens);
            let tuple = Value::Tuple(tokens.iter().map(|&t| Value::Int(t)).collect());
            let mut want = vec![0xaa];
            write_value(&mut want, &tuple);
            assert_eq!(fast, want, "{tokens:?}");
        }
    }

    #[test]
    fn seed_string_matches_hash_10() {
        assert_eq!(enc(&Value::Str("0".into())), [0x61, 0x30]);
        assert_eq!(enc(&Value::None), [0xf6]);
    }
}

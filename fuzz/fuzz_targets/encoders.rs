//! The hash-input encoders and the msgpack event encoder against well-kept decoders:
//! - pickle protocol 5 (`HashFn::Sha256`/`Xxhash`) of any supported value (`None`, 64-bit int,
//!   `str`, `bytes`, nested tuples) and of block triples reads back with `serde-pickle`; its
//!   frame header is right and it is refused exactly when CPython would split frames;
//! - canonical CBOR (`*_cbor`) reads back with `ciborium`, and `ciborium` re-encodes it to the
//!   same bytes (shortest forms);
//! - msgpack (`kvcore_core::msgpack`) of any value tree reads back with `rmpv`, which
//!   re-encodes it to the same bytes (smallest forms, non-negative ints unsigned);
//! - the digests and the block hasher agree with hashing the serialised bytes.

#![no_main]

use arbitrary::{Arbitrary, Result as AResult, Unstructured};
use kvcore_core::hashing::{BlockHasher, HashError, HashFn};
use kvcore_core::msgpack;
use kvcore_core::value::Value;
use libfuzzer_sys::fuzz_target;

/// Deepest nesting generated (the decoders have recursion limits of their own).
const MAX_DEPTH: usize = 24;
/// CPython's pickle frame size target.
const FRAME: usize = 64 * 1024;

const EDGES: [i64; 24] = [
    0,
    1,
    -1,
    23,
    24,
    -24,
    -25,
    -32,
    -33,
    127,
    128,
    255,
    256,
    65535,
    65536,
    i32::MAX as i64,
    i32::MIN as i64,
    1 << 31,
    -(1 << 31) - 1,
    u32::MAX as i64,
    1 << 32,
    -(1 << 32) - 1,
    i64::MAX,
    i64::MIN,
];

fn int(u: &mut Unstructured<'_>) -> AResult<i64> {
    Ok(match u.int_in_range(0u8..=3)? {
        0 => i64::arbitrary(u)?,
        1 => u
            .choose(&EDGES)?
            .saturating_add(i64::from(u.int_in_range(-1i8..=1)?)),
        2 => i64::from(u8::arbitrary(u)?),
        _ => *u.choose(&EDGES)?,
    })
}

/// Bytes, sometimes long runs (up to just past a pickle frame) from a few input bytes.
fn bytes(u: &mut Unstructured<'_>) -> AResult<Vec<u8>> {
    if u.ratio(1u8, 16)? {
        let len = u.int_in_range(250usize..=FRAME + 16)?;
        return Ok(vec![u8::arbitrary(u)?; len]);
    }
    Vec::<u8>::arbitrary(u)
}

fn text(u: &mut Unstructured<'_>) -> AResult<String> {
    if u.ratio(1u8, 16)? {
        let len = u.int_in_range(250usize..=FRAME + 16)?;
        let c = *u.choose(&["x", "é", "猫", "🦀"])?;
        return Ok(c.repeat(len / c.len()));
    }
    String::arbitrary(u)
}

fn value(u: &mut Unstructured<'_>, depth: usize) -> AResult<Value> {
    let max = if depth >= MAX_DEPTH { 3 } else { 4 };
    Ok(match u.int_in_range(0u8..=max)? {
        0 => Value::None,
        1 => Value::Int(int(u)?),
        2 => Value::Str(text(u)?),
        3 => Value::Bytes(bytes(u)?),
        _ => {
            let mut items = Vec::new();
            let n = u.int_in_range(0usize..=20)?;
            for _ in 0..n {
                if u.is_empty() {
                    break;
                }
                items.push(value(u, depth + 1)?);
            }
            Value::Tuple(items)
        }
    })
}

fn mp_value(u: &mut Unstructured<'_>, depth: usize) -> AResult<msgpack::Value> {
    use msgpack::Value as M;
    let max = if depth >= MAX_DEPTH { 6 } else { 8 };
    Ok(match u.int_in_range(0u8..=max)? {
        0 => M::Nil,
        1 => M::Bool(bool::arbitrary(u)?),
        2 => M::Int(int(u)?),
        3 => M::UInt(match u.int_in_range(0u8..=2)? {
            0 => u64::arbitrary(u)?,
            1 => (*u.choose(&EDGES)?) as u64,
            _ => u64::MAX - u64::from(u8::arbitrary(u)?),
        }),
        4 => M::Float(f64::from_bits(u64::arbitrary(u)?)),
        5 => M::Str(text(u)?),
        6 => M::Bin(bytes(u)?),
        7 => {
            let mut items = Vec::new();
            let n = u.int_in_range(0usize..=20)?;
            for _ in 0..n {
                if u.is_empty() {
                    break;
                }
                items.push(mp_value(u, depth + 1)?);
            }
            M::Array(items)
        }
        _ => {
            let mut entries = Vec::new();
            let n = u.int_in_range(0usize..=18)?;
            for _ in 0..n {
                if u.is_empty() {
                    break;
                }
                entries.push((mp_value(u, depth + 1)?, mp_value(u, depth + 1)?));
            }
            M::Map(entries)
        }
    })
}

// ------------------------------------------------------------------- pickle

/// The body length (opcodes after the frame header, STOP included) of the value's pickle, and
/// whether a single str/bytes reaches the frame size (both are refused).
fn pickle_len(v: &Value, too_long: &mut bool) -> usize {
    match v {
        Value::None => 1,
        Value::Int(i) => {
            if (0..=0xff).contains(i) {
                2
            } else if (0..=0xffff).contains(i) {
                3
            } else if i32::try_from(*i).is_ok() {
                5
            } else {
                // LONG1: minimal two's complement, at least 5 bytes here.
                let mut n = 8;
                let b = i.to_le_bytes();
                while n > 1
                    && ((b[n - 1] == 0 && b[n - 2] & 0x80 == 0)
                        || (b[n - 1] == 0xff && b[n - 2] & 0x80 != 0))
                {
                    n -= 1;
                }
                2 + n
            }
        }
        Value::Str(s) => sized_len(s.len(), too_long),
        Value::Bytes(b) => sized_len(b.len(), too_long),
        Value::Tuple(items) => {
            let inner: usize = items.iter().map(|x| pickle_len(x, too_long)).sum();
            match items.len() {
                0 => 1,
                1..=3 => inner + 2,
                _ => inner + 3,
            }
        }
    }
}

fn sized_len(n: usize, too_long: &mut bool) -> usize {
    if n >= FRAME {
        *too_long = true;
    }
    n + if n <= 0xff { 2 } else { 5 } + 1
}

fn from_pickle(v: &serde_pickle::Value) -> Option<Value> {
    use serde_pickle::Value as P;
    Some(match v {
        P::None => Value::None,
        P::I64(i) => Value::Int(*i),
        P::Int(big) => Value::Int(big.to_string().parse().ok()?),
        P::String(s) => Value::Str(s.clone()),
        P::Bytes(b) => Value::Bytes(b.clone()),
        P::Tuple(items) => Value::Tuple(items.iter().map(from_pickle).collect::<Option<_>>()?),
        _ => return None,
    })
}

/// Checks a pickle's frame header against its body length and decodes it.
fn read_pickle(bytes: &[u8], body: usize) -> Value {
    assert_eq!(&bytes[..2], &[0x80, 5], "protocol 5 header");
    if body >= 4 {
        assert_eq!(bytes[2], 0x95, "a frame");
        let len = u64::from_le_bytes(bytes[3..11].try_into().unwrap());
        assert_eq!(len as usize, body, "frame length");
        assert_eq!(bytes.len(), 11 + body);
    } else {
        assert_eq!(bytes.len(), 2 + body, "no frame below 4 bytes");
    }
    assert_eq!(bytes.last(), Some(&b'.'), "STOP");
    let decoded = serde_pickle::value_from_slice(bytes, serde_pickle::DeOptions::new())
        .unwrap_or_else(|e| panic!("serde-pickle rejects {bytes:02x?}: {e}"));
    from_pickle(&decoded).unwrap_or_else(|| panic!("unexpected pickle value {decoded:?}"))
}

fn check_pickle(f: HashFn, v: &Value) {
    let mut too_long = false;
    let body = pickle_len(v, &mut too_long) + 1;
    let mut out = vec![0xaa; 3];
    let r = f.serialize_value(v, &mut out);
    if too_long || body >= FRAME {
        assert!(
            matches!(r, Err(HashError::Unsupported(_))),
            "{r:?} for a {body}-byte body"
        );
        return;
    }
    r.unwrap_or_else(|e| panic!("pickle of a {body}-byte body refused: {e}"));
    assert_eq!(&read_pickle(&out, body), v, "pickle round trip");
    assert_eq!(f.hash_value(v).unwrap(), f.digest(&out));
}

// --------------------------------------------------------------------- cbor

fn from_cbor(v: &ciborium::Value) -> Option<Value> {
    use ciborium::Value as C;
    Some(match v {
        C::Null => Value::None,
        C::Integer(i) => Value::Int(i64::try_from(i128::from(*i)).ok()?),
        C::Text(s) => Value::Str(s.clone()),
        C::Bytes(b) => Value::Bytes(b.clone()),
        C::Array(items) => Value::Tuple(items.iter().map(from_cbor).collect::<Option<_>>()?),
        _ => return None,
    })
}

/// Decodes one CBOR item that must span all of `bytes` and be in canonical form.
fn read_cbor(bytes: &[u8]) -> ciborium::Value {
    let decoded: ciborium::Value = ciborium::de::from_reader(bytes)
        .unwrap_or_else(|e| panic!("ciborium rejects {bytes:02x?}: {e:?}"));
    let mut again = Vec::new();
    ciborium::ser::into_writer(&decoded, &mut again).unwrap();
    assert_eq!(again, bytes, "not canonical (or trailing bytes)");
    decoded
}

fn check_cbor(f: HashFn, v: &Value) {
    let mut out = vec![0xaa; 3];
    f.serialize_value(v, &mut out).unwrap();
    let decoded = read_cbor(&out);
    assert_eq!(from_cbor(&decoded).as_ref(), Some(v), "cbor round trip");
    assert_eq!(f.hash_value(v).unwrap(), f.digest(&out));
}

// ------------------------------------------------------------------ msgpack

fn from_rmpv(v: &rmpv::Value) -> Option<msgpack::Value> {
    use msgpack::Value as M;
    use rmpv::Value as R;
    Some(match v {
        R::Nil => M::Nil,
        R::Boolean(b) => M::Bool(*b),
        R::Integer(i) => match (i.as_u64(), i.as_i64()) {
            (Some(u), _) => M::UInt(u),
            (None, Some(s)) => M::Int(s),
            _ => return None,
        },
        R::F64(f) => M::Float(*f),
        R::String(s) => M::Str(s.as_str()?.to_owned()),
        R::Binary(b) => M::Bin(b.clone()),
        R::Array(items) => M::Array(items.iter().map(from_rmpv).collect::<Option<_>>()?),
        R::Map(entries) => M::Map(
            entries
                .iter()
                .map(|(k, x)| Some((from_rmpv(k)?, from_rmpv(x)?)))
                .collect::<Option<_>>()?,
        ),
        _ => return None,
    })
}

/// Whether rmpv's reading `got` is the tree `want`: non-negative `Int`s read back unsigned,
/// floats compare by their bits (NaN payloads included).
fn same(got: &msgpack::Value, want: &msgpack::Value) -> bool {
    use msgpack::Value as M;
    match (got, want) {
        (M::UInt(a), M::Int(b)) => u64::try_from(*b) == Ok(*a),
        (M::Float(a), M::Float(b)) => a.to_bits() == b.to_bits(),
        (M::Array(a), M::Array(b)) => {
            a.len() == b.len() && a.iter().zip(b).all(|(x, y)| same(x, y))
        }
        (M::Map(a), M::Map(b)) => {
            a.len() == b.len()
                && a.iter()
                    .zip(b)
                    .all(|((k, x), (l, y))| same(k, l) && same(x, y))
        }
        (M::Float(_), _) | (_, M::Float(_)) | (M::Array(_), _) | (M::Map(_), _) => false,
        (a, b) => a == b,
    }
}

fn check_msgpack(v: &msgpack::Value) {
    let bytes = msgpack::encode(v).unwrap();
    let mut prefixed = vec![0xc0];
    msgpack::encode_into(&mut prefixed, v).unwrap();
    assert_eq!(&prefixed[1..], &bytes[..], "encode_into appends");
    let mut rd = &bytes[..];
    let decoded = rmpv::decode::read_value(&mut rd)
        .unwrap_or_else(|e| panic!("rmpv rejects {bytes:02x?}: {e}"));
    assert!(rd.is_empty(), "trailing bytes after one value");
    let mut again = Vec::new();
    rmpv::encode::write_value(&mut again, &decoded).unwrap();
    assert_eq!(again, bytes, "not the smallest forms");
    let back = from_rmpv(&decoded).unwrap_or_else(|| panic!("unexpected {decoded:?}"));
    assert!(
        same(&back, v),
        "msgpack round trip: {back:?} read back for {v:?}"
    );
}

// -------------------------------------------------------------------- input

#[derive(Debug)]
enum Case {
    Value(u8, Value),
    Block {
        f: u8,
        parent: Vec<u8>,
        tokens: Vec<i64>,
        extra: Option<Vec<Value>>,
    },
    Chain {
        f: u8,
        none_hash: Vec<u8>,
        parent: Option<Vec<u8>>,
        tokens: Vec<i64>,
        block_size: usize,
        extras: Option<Vec<Option<Vec<Value>>>>,
    },
    Msgpack(msgpack::Value),
    KeyValue(Value),
    Name(String),
}

fn tokens(u: &mut Unstructured<'_>) -> AResult<Vec<i64>> {
    let n = u.int_in_range(0usize..=64)?;
    (0..n).map(|_| int(u)).collect()
}

fn extra(u: &mut Unstructured<'_>) -> AResult<Vec<Value>> {
    let n = u.int_in_range(0usize..=5)?;
    (0..n).map(|_| value(u, 1)).collect()
}

impl<'a> Arbitrary<'a> for Case {
    fn arbitrary(u: &mut Unstructured<'a>) -> AResult<Self> {
        Ok(match u.int_in_range(0u8..=5)? {
            0 => Case::Value(u8::arbitrary(u)?, value(u, 0)?),
            1 => Case::Block {
                f: u8::arbitrary(u)?,
                parent: Vec::<u8>::arbitrary(u)?,
                tokens: tokens(u)?,
                extra: if bool::arbitrary(u)? {
                    Some(extra(u)?)
                } else {
                    None
                },
            },
            2 => {
                let f = u8::arbitrary(u)?;
                let none_hash = Vec::<u8>::arbitrary(u)?;
                let parent = Option::<Vec<u8>>::arbitrary(u)?;
                let tokens = tokens(u)?;
                let block_size = u.int_in_range(0usize..=9)?;
                let extras = if bool::arbitrary(u)? {
                    let blocks = tokens.len().checked_div(block_size).unwrap_or(0);
                    let n = if u.ratio(1u8, 8)? { blocks + 1 } else { blocks };
                    let mut e = Vec::new();
                    for _ in 0..n {
                        e.push(if bool::arbitrary(u)? {
                            Some(extra(u)?)
                        } else {
                            None
                        });
                    }
                    Some(e)
                } else {
                    None
                };
                Case::Chain {
                    f,
                    none_hash,
                    parent,
                    tokens,
                    block_size,
                    extras,
                }
            }
            3 => Case::Msgpack(mp_value(u, 0)?),
            4 => Case::KeyValue(value(u, 0)?),
            _ => Case::Name(String::arbitrary(u)?),
        })
    }
}

fn hash_fn(f: u8) -> HashFn {
    HashFn::ALL[usize::from(f) % 4]
}

fn check_block(f: HashFn, parent: &[u8], tokens: &[i64], extra: Option<&[Value]>) -> Vec<u8> {
    let mut out = vec![0xaa; 5];
    let r = f.serialize_block(parent, tokens, extra, &mut out);
    let triple = Value::Tuple(vec![
        Value::Bytes(parent.to_vec()),
        Value::Tuple(tokens.iter().map(|&t| Value::Int(t)).collect()),
        extra.map_or(Value::None, |e| Value::Tuple(e.to_vec())),
    ]);
    // The triple serialises like the equivalent value.
    let mut as_value = Vec::new();
    let rv = f.serialize_value(&triple, &mut as_value);
    if f.is_cbor() {
        r.unwrap();
        assert_eq!(out, as_value, "cbor block triple");
        assert_eq!(from_cbor(&read_cbor(&out)).as_ref(), Some(&triple));
    } else {
        assert_eq!(
            r.is_ok(),
            rv.is_ok(),
            "pickle block triple: {r:?} vs {rv:?}"
        );
        if r.is_err() {
            return Vec::new();
        }
        // CPython writes the triple with TUPLE3 like any 3-tuple: same bytes.
        assert_eq!(out, as_value, "pickle block triple");
        let mut too_long = false;
        let body = pickle_len(&triple, &mut too_long) + 1;
        assert_eq!(read_pickle(&out, body), triple);
    }
    out
}

fuzz_target!(|case: Case| {
    match case {
        Case::Value(f, v) => {
            let f = hash_fn(f);
            if f.is_cbor() {
                check_cbor(f, &v);
            } else {
                check_pickle(f, &v);
            }
        }
        Case::Block {
            f,
            parent,
            tokens,
            extra,
        } => {
            let f = hash_fn(f);
            check_block(f, &parent, &tokens, extra.as_deref());
            // The hasher digests the same triple, an empty parent meaning NONE_HASH.
            let p = if parent.is_empty() {
                &b"none"[..]
            } else {
                &parent
            };
            let bytes = check_block(f, p, &tokens, extra.as_deref());
            let got =
                BlockHasher::new(f, b"none").hash_block(Some(&parent), &tokens, extra.as_deref());
            if bytes.is_empty() {
                assert!(matches!(got, Err(HashError::Unsupported(_))), "{got:?}");
            } else {
                let want = f.digest(&bytes);
                assert_eq!(want.len(), f.digest_len());
                assert_eq!(got, Ok(want));
            }
        }
        Case::Chain {
            f,
            none_hash,
            parent,
            tokens,
            block_size,
            extras,
        } => {
            let f = hash_fn(f);
            let mut hasher = BlockHasher::new(f, &none_hash);
            assert_eq!(hasher.hash_fn(), f);
            let views: Option<Vec<Option<&[Value]>>> = extras
                .as_ref()
                .map(|e| e.iter().map(|x| x.as_deref()).collect());
            let got = hasher.hash_blocks(parent.as_deref(), &tokens, block_size, views.as_deref());
            if block_size == 0 {
                assert_eq!(got, Err(HashError::ZeroBlockSize));
                return;
            }
            let blocks = tokens.len() / block_size;
            if let Some(e) = &views {
                if e.len() != blocks {
                    assert_eq!(
                        got,
                        Err(HashError::ExtrasLength {
                            blocks,
                            extras: e.len()
                        })
                    );
                    return;
                }
            }
            // One block at a time, each chained from the previous digest.
            let mut want = Vec::new();
            let mut one = BlockHasher::new(f, &none_hash);
            let mut prev: Option<Vec<u8>> = parent.clone();
            for (i, w) in tokens.chunks_exact(block_size).enumerate() {
                let x = views.as_ref().and_then(|e| e[i]);
                match one.hash_block(prev.as_deref(), w, x) {
                    Ok(h) => {
                        prev = Some(h.as_bytes().to_vec());
                        want.push(h);
                    }
                    Err(e) => {
                        assert_eq!(got, Err(e));
                        return;
                    }
                }
            }
            assert_eq!(got, Ok(want));
        }
        Case::Msgpack(v) => check_msgpack(&v),
        Case::KeyValue(v) => {
            let m = msgpack::Value::from(&v);
            check_msgpack(&m);
        }
        Case::Name(name) => {
            let known = ["sha256", "sha256_cbor", "xxhash", "xxhash_cbor"];
            match HashFn::from_name(&name) {
                Ok(f) => assert_eq!(f.name(), name),
                Err(e) => {
                    assert!(!known.contains(&name.as_str()));
                    assert_eq!(e, HashError::UnknownFunction(name));
                }
            }
        }
    }
});

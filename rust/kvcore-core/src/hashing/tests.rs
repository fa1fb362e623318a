//! Golden vectors shared with the Python tests (`tests/vectors/hashing.json`, generated from the
//! reference with `PYTHONHASHSEED=0`) and property tests.

use super::*;
use proptest::prelude::*;

const VECTORS: &str = include_str!("../../../../tests/vectors/hashing.json");

/// A minimal JSON tree: enough for the vectors file (no floats, no string escapes but `\u`).
#[derive(Debug, Clone)]
enum Json {
    Null,
    Int(i64),
    Str(String),
    Arr(Vec<Json>),
    Obj(Vec<(String, Json)>),
}

struct Parser<'a> {
    s: &'a [u8],
    i: usize,
}

impl Parser<'_> {
    fn ws(&mut self) {
        while self.s[self.i].is_ascii_whitespace() {
            self.i += 1;
        }
    }

    fn eat(&mut self, c: u8) {
        self.ws();
        assert_eq!(self.s[self.i] as char, c as char, "at byte {}", self.i);
        self.i += 1;
    }

    fn string(&mut self) -> String {
        self.eat(b'"');
        let mut out = String::new();
        loop {
            let c = self.s[self.i];
            self.i += 1;
            match c {
                b'"' => return out,
                b'\\' => {
                    let e = self.s[self.i];
                    self.i += 1;
                    match e {
                        b'u' => {
                            let hex = std::str::from_utf8(&self.s[self.i..self.i + 4]).unwrap();
                            self.i += 4;
                            let cp = u32::from_str_radix(hex, 16).unwrap();
                            out.push(char::from_u32(cp).unwrap());
                        }
                        b'n' => out.push('\n'),
                        other => out.push(other as char),
                    }
                }
                _ => {
                    // Copy one UTF-8 sequence.
                    let start = self.i - 1;
                    let mut end = self.i;
                    while end < self.s.len() && (self.s[end] & 0xc0) == 0x80 {
                        end += 1;
                    }
                    out.push_str(std::str::from_utf8(&self.s[start..end]).unwrap());
                    self.i = end;
                }
            }
        }
    }

    fn value(&mut self) -> Json {
        self.ws();
        match self.s[self.i] {
            b'n' => {
                self.i += 4;
                Json::Null
            }
            b'"' => Json::Str(self.string()),
            b'[' => {
                self.i += 1;
                let mut items = Vec::new();
                self.ws();
                if self.s[self.i] == b']' {
                    self.i += 1;
                    return Json::Arr(items);
                }
                loop {
                    items.push(self.value());
                    self.ws();
                    let c = self.s[self.i];
                    self.i += 1;
                    if c == b']' {
                        return Json::Arr(items);
                    }
                }
            }
            b'{' => {
                self.i += 1;
                let mut items = Vec::new();
                self.ws();
                if self.s[self.i] == b'}' {
                    self.i += 1;
                    return Json::Obj(items);
                }
                loop {
                    let k = self.string();
                    self.eat(b':');
                    items.push((k, self.value()));
                    self.ws();
                    let c = self.s[self.i];
                    self.i += 1;
                    if c == b'}' {
                        return Json::Obj(items);
                    }
                }
            }
            _ => {
                let start = self.i;
                while self.s[self.i] == b'-' || self.s[self.i].is_ascii_digit() {
                    self.i += 1;
                }
                let text = std::str::from_utf8(&self.s[start..self.i]).unwrap();
                Json::Int(text.parse().unwrap())
            }
        }
    }
}

impl Json {
    fn get(&self, key: &str) -> &Json {
        match self {
            Json::Obj(items) => &items.iter().find(|(k, _)| k == key).unwrap().1,
            _ => panic!("not an object"),
        }
    }
    fn str(&self) -> &str {
        match self {
            Json::Str(s) => s,
            _ => panic!("not a string: {self:?}"),
        }
    }
    fn arr(&self) -> &[Json] {
        match self {
            Json::Arr(a) => a,
            _ => panic!("not an array"),
        }
    }
    fn ints(&self) -> Vec<i64> {
        self.arr()
            .iter()
            .map(|x| match x {
                Json::Int(i) => *i,
                _ => panic!("not an int"),
            })
            .collect()
    }
    /// The vectors' encoding of a hash input value: `{"bytes": hex}` is bytes, arrays are tuples.
    fn to_value(&self) -> Value {
        match self {
            Json::Null => Value::None,
            Json::Int(i) => Value::Int(*i),
            Json::Str(s) => Value::Str(s.clone()),
            Json::Arr(a) => Value::Tuple(a.iter().map(Json::to_value).collect()),
            Json::Obj(_) => Value::Bytes(unhex(self.get("bytes").str())),
        }
    }
    fn extra(&self) -> Option<Vec<Value>> {
        match self.to_value() {
            Value::None => None,
            Value::Tuple(items) => Some(items),
            other => panic!("extra must be a tuple: {other:?}"),
        }
    }
}

fn as_refs(extras: &[Option<Vec<Value>>]) -> Vec<Option<&[Value]>> {
    extras.iter().map(|e| e.as_deref()).collect()
}

fn unhex(s: &str) -> Vec<u8> {
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
        .collect()
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn vectors() -> Json {
    Parser {
        s: VECTORS.as_bytes(),
        i: 0,
    }
    .value()
}

fn none_hash(v: &Json, f: HashFn) -> Vec<u8> {
    unhex(v.get("none_hash").get(f.name()).str())
}

fn seed_hash(f: HashFn) -> Vec<u8> {
    f.hash_value(&Value::Str("0".into()))
        .unwrap()
        .as_bytes()
        .to_vec()
}

/// SPEC HASH-10, TV-H NONE_HASH: the hash of the seed string "0".
#[test]
fn none_hash_vectors() {
    let v = vectors();
    for f in HashFn::ALL {
        assert_eq!(seed_hash(f), none_hash(&v, f), "{}", f.name());
    }
}

/// SPEC TV-H and HASH-2/3/4/11: every block vector, parent NONE_HASH or B1.
#[test]
fn block_vectors() {
    let v = vectors();
    let mut seen = 0;
    for b in v.get("blocks").arr() {
        let f = HashFn::from_name(b.get("fn").str()).unwrap();
        let mut hasher = BlockHasher::new(f, &none_hash(&v, f));
        let b1: Vec<i64> = (1..=16).collect();
        let parent = match b.get("parent").str() {
            "NONE" => None,
            "B1" => Some(hasher.hash_block(None, &b1, None).unwrap()),
            other => panic!("parent {other}"),
        };
        let extra = b.get("extra").extra();
        let h = hasher
            .hash_block(
                parent.as_ref().map(BlockHash::as_bytes),
                &b.get("tokens").ints(),
                extra.as_deref(),
            )
            .unwrap();
        assert_eq!(hex(h.as_bytes()), b.get("hash").str(), "{b:?}");
        seen += 1;
    }
    assert!(seen >= 4 * 20);
}

/// SPEC TV-B: exact serialised bytes.
#[test]
fn serialized_vectors() {
    let v = vectors();
    for s in v.get("serialized").arr() {
        let f = HashFn::from_name(s.get("fn").str()).unwrap();
        let extra = s.get("extra").extra();
        let mut out = Vec::new();
        f.serialize_block(
            &none_hash(&v, f),
            &s.get("tokens").ints(),
            extra.as_deref(),
            &mut out,
        )
        .unwrap();
        assert_eq!(hex(&out), s.get("bytes").str(), "{}", f.name());
    }
}

/// SPEC TV-R: chained request hashing with per-block extras.
#[test]
fn request_vectors() {
    let v = vectors();
    for r in v.get("requests").arr() {
        let f = HashFn::from_name(r.get("fn").str()).unwrap();
        let mut hasher = BlockHasher::new(f, &none_hash(&v, f));
        let extras: Vec<Option<Vec<Value>>> =
            r.get("extras").arr().iter().map(Json::extra).collect();
        let hbs = match r.get("hbs") {
            Json::Int(i) => *i as usize,
            _ => panic!(),
        };
        let got = hasher
            .hash_blocks(None, &r.get("tokens").ints(), hbs, Some(&as_refs(&extras)))
            .unwrap();
        let want: Vec<&str> = r.get("hashes").arr().iter().map(Json::str).collect();
        let got: Vec<String> = got.iter().map(|h| hex(h.as_bytes())).collect();
        assert_eq!(got, want, "{}", r.get("case").str());
    }
}

/// SPEC HASH-1: the XXH3-128 digest is big-endian.
#[test]
fn xxhash_digest_is_big_endian() {
    assert_eq!(
        hex(HashFn::Xxhash.digest(b"abc").as_bytes()),
        "06b05ab6733a618578af5f94892f3950"
    );
}

/// SPEC §5.1: names round-trip and unknown names are refused.
#[test]
fn names() {
    for f in HashFn::ALL {
        assert_eq!(HashFn::from_name(f.name()), Ok(f));
        assert_eq!(f.digest(b"").len(), f.digest_len());
    }
    let err = HashFn::from_name("md5").unwrap_err();
    assert_eq!(err.to_string(), "Unsupported hash function: md5");
}

/// SPEC HASH-11: an empty parent counts as no parent.
#[test]
fn empty_parent_is_none_hash() {
    let mut h = BlockHasher::new(HashFn::Sha256, &[9; 32]);
    let a = h.hash_block(None, &[1, 2, 3], None).unwrap();
    let b = h.hash_block(Some(b""), &[1, 2, 3], None).unwrap();
    let c = h.hash_block(Some(&[9; 32]), &[1, 2, 3], None).unwrap();
    assert_eq!(a, b);
    assert_eq!(a, c);
}

#[test]
fn hash_blocks_errors() {
    let mut h = BlockHasher::new(HashFn::XxhashCbor, &[0; 16]);
    assert_eq!(
        h.hash_blocks(None, &[1, 2, 3], 0, None),
        Err(HashError::ZeroBlockSize)
    );
    assert_eq!(
        h.hash_blocks(None, &[1, 2, 3], 2, Some(&[])),
        Err(HashError::ExtrasLength {
            blocks: 1,
            extras: 0
        })
    );
    assert!(h.hash_blocks(None, &[1], 2, None).unwrap().is_empty());
    let big = vec![1i64 << 40; 10_000];
    let mut p = BlockHasher::new(HashFn::Sha256, &[0; 32]);
    assert!(matches!(
        p.hash_block(None, &big, None),
        Err(HashError::Unsupported(_))
    ));
}

/// Decodes one pickled int opcode (test oracle for the int forms of SPEC HASH-4).
fn unpickle_int(b: &[u8]) -> i64 {
    match b[0] {
        b'K' => i64::from(b[1]),
        b'M' => i64::from(u16::from_le_bytes([b[1], b[2]])),
        b'J' => i64::from(i32::from_le_bytes([b[1], b[2], b[3], b[4]])),
        0x8a => {
            let n = b[1] as usize;
            let mut v: i64 = if b[1 + n] & 0x80 != 0 { -1 } else { 0 };
            for i in (0..n).rev() {
                v = (v << 8) | i64::from(b[2 + i]);
            }
            v
        }
        op => panic!("opcode {op:#x}"),
    }
}

fn value_strategy() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::None),
        any::<i64>().prop_map(Value::Int),
        ".{0,300}".prop_map(Value::Str),
        proptest::collection::vec(any::<u8>(), 0..300).prop_map(Value::Bytes),
    ];
    leaf.prop_recursive(3, 24, 5, |inner| {
        proptest::collection::vec(inner, 0..5).prop_map(Value::Tuple)
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]

    /// Pickle ints decode to themselves and use the shortest LONG1 form.
    #[test]
    fn pickle_int_round_trip(v in any::<i64>()) {
        let mut out = Vec::new();
        pickle::write_int(&mut out, v);
        prop_assert_eq!(unpickle_int(&out), v);
        if out[0] == 0x8a {
            let n = out[1] as usize;
            prop_assert_eq!(out.len(), n + 2);
            // One byte fewer could not hold v.
            let bits = 8 * (n as u32 - 1);
            prop_assert!(v >= 1i64 << (bits - 1) || v < -(1i64 << (bits - 1)));
        }
    }

    /// The chain over all windows equals hashing window by window (SPEC RH-1).
    #[test]
    fn hash_blocks_is_a_chain(
        tokens in proptest::collection::vec(any::<i64>(), 0..80),
        bs in 1usize..9,
        fi in 0usize..4,
        salt in proptest::option::of("[a-z]{0,4}"),
    ) {
        let f = HashFn::ALL[fi];
        let mut h = BlockHasher::new(f, &[3; 32]);
        let n = tokens.len() / bs;
        let extras: Vec<Option<Vec<Value>>> = (0..n)
            .map(|i| salt.clone().filter(|_| i == 0).map(|s| vec![Value::Str(s)]))
            .collect();
        let all = h.hash_blocks(None, &tokens, bs, Some(&as_refs(&extras))).unwrap();
        prop_assert_eq!(all.len(), n);
        let mut parent: Option<BlockHash> = None;
        for (i, w) in tokens.chunks_exact(bs).enumerate() {
            let one = h
                .hash_block(parent.as_ref().map(BlockHash::as_bytes), w, extras[i].as_deref())
                .unwrap();
            prop_assert_eq!(one, all[i]);
            parent = Some(one);
        }
    }

    /// Pickle frames: the length field counts the body, short bodies have no frame.
    #[test]
    fn pickle_frame_length(v in value_strategy()) {
        let mut out = Vec::new();
        HashFn::Sha256.serialize_value(&v, &mut out).unwrap();
        prop_assert_eq!(&out[..2], &[0x80u8, 5][..]);
        prop_assert_eq!(*out.last().unwrap(), b'.');
        if out[2] == 0x95 {
            let len = u64::from_le_bytes(out[3..11].try_into().unwrap()) as usize;
            prop_assert_eq!(len, out.len() - 11);
            prop_assert!(len >= 4);
        } else {
            prop_assert!(out.len() - 2 < 4);
        }
    }
}

//! Reading a Python request's fields: by attribute lookup (any duck-typed request), or, for a
//! request of a class registered as *plain*, straight from its instance dict.
//!
//! A plain class (vLLM's `Request`, registered by `kvcore.vllm`) keeps every field the
//! manager reads as an instance attribute that nothing on the class shadows, and its token
//! count is the length of one list attribute (vLLM's `num_tokens` property is
//! `len(self._all_token_ids)`). For such a request a field is one dict lookup instead of an
//! attribute lookup through the class (and a Python property call for `num_tokens`), no
//! Python code runs, and a `BlockStored` event of a request without LoRA, multimodal inputs,
//! cache salt or prompt embeddings reads its tokens from that list. The registration checks
//! the class, so a dict lookup finds exactly what `getattr` would; an instance that does not
//! fit (no dict, the token attribute not a list) is read by attribute lookup like any other.
//! On CPython 3.11 a decode call's fields are read at the dict entries where the previous
//! request had them, as CPython's own attribute cache reads them ([`DictHints`]).

use pyo3::exceptions::PyAttributeError;
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::sync::GILOnceCell;
use pyo3::types::{PyDict, PyList, PyString, PyTuple, PyType};
use pyo3::Borrowed;
use pyo3::{PyTraverseError, PyVisit};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicUsize, Ordering};
use std::sync::OnceLock;

use crate::args::{
    count_311, count_of, exact_int, ints_are_311, list_len, request_id_of, COUNT_CAP,
};
use crate::errors::invalid;
use crate::pool::get_opt;
use crate::sync::GilRefCell;
use std::cell::RefMut;

/// How many attributes [`field_names`] lists.
const FIELDS: usize = 13;

/// Indices into [`field_names`] (and [`Slots::fields`]) of the attributes read by name here.
mod field {
    pub(super) const REQUEST_ID: usize = 0;
    pub(super) const NUM_COMPUTED_TOKENS: usize = 1;
    pub(super) const NUM_PROMPT_TOKENS: usize = 3;
    pub(super) const BLOCK_HASHES: usize = 4;
    pub(super) const LORA_REQUEST: usize = 6;
    pub(super) const CACHE_SALT: usize = 7;
    pub(super) const MM_FEATURES: usize = 8;
    pub(super) const PROMPT_EMBEDS: usize = 9;
}

/// The attributes the manager reads from a request (besides `num_tokens`).
fn field_names(py: Python<'_>) -> [&Bound<'_, PyString>; FIELDS] {
    [
        intern!(py, "request_id"),
        intern!(py, "num_computed_tokens"),
        intern!(py, "status"),
        intern!(py, "num_prompt_tokens"),
        intern!(py, "block_hashes"),
        intern!(py, "skip_reading_prefix_cache"),
        intern!(py, "lora_request"),
        intern!(py, "cache_salt"),
        intern!(py, "mm_features"),
        intern!(py, "prompt_embeds"),
        intern!(py, "retention_priority"),
        intern!(py, "retention_ttl_s"),
        intern!(py, "_prompt_embeds_per_block_hashes"),
    ]
}

/// The index of the attribute `name` (interned: compared by address) in [`field_names`].
#[inline]
fn field_index(name: &Bound<'_, PyString>) -> Option<usize> {
    // The names' addresses, taken once: `intern!` holds each name for the process.
    static ADDRS: GILOnceCell<[usize; FIELDS]> = GILOnceCell::new();
    let py = name.py();
    let addrs = ADDRS.get_or_init(py, || field_names(py).map(|n| n.as_ptr() as usize));
    let n = name.as_ptr() as usize;
    addrs.iter().position(|&a| a == n)
}

/// A registered plain request class.
pub(crate) struct PlainClass {
    cls: Py<PyType>,
    /// The list attribute whose length is `num_tokens` and whose items are the token ids.
    tokens: Py<PyString>,
    /// Whether instance dicts are read by entry index ([`DictHints`]): CPython 3.11, whose
    /// dict layout that assumes, checked on probe dicts ([`dicts_are_311`]).
    hinted: bool,
    /// Whether an instance's made dict is read where CPython 3.11 keeps a managed dict
    /// ([`managed_dict`]): `hinted` and the class has one.
    managed: bool,
    /// The decode fields the class keeps in `__slots__`.
    slots: Slots,
    /// Whether the class derives from [`PlainState`] (`kvcore._native.PlainRequestBase`), so
    /// that its instances keep their key and hints in their native base.
    based: bool,
    /// How a decode call reads instances, without and with the prompt length.
    readers: [Reader; 2],
    /// Whether [`Self::read_state`] reads a count from its int's fields ([`ints_are_311`]).
    ints_311: bool,
    /// Whether a call's fields are read without the instance dict ([`Slots::whole`]): its
    /// [`PlainRequest`] reads the dict only for another field, when asked for it.
    dictless: bool,
}

/// How a decode call reads a plain class's instances ([`PlainClass::reader`]).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum Reader {
    /// From the slots and the native base ([`PlainClass::read_state`]): the class derives
    /// from [`PlainState`] and keeps every field the call reads in a slot.
    State,
    /// From the slots and the instance dict ([`PlainClass::read`]): the class has no native
    /// base.
    Dict,
    /// Not before the whole path: the class has a native base but keeps a field the call
    /// reads in its dict.
    Whole,
}

/// A request's key and hints, kept in its native base ([`PlainState`]): its key borrowed
/// from the base for the call (`RefMut`), its hints shared.
pub(crate) struct StateRef<'a> {
    kept: RefMut<'a, KeptId>,
    pub(crate) hints: &'a [kvcore_core::tables::HintCell],
}

impl StateRef<'_> {
    /// The table key.
    #[inline]
    pub(crate) fn key(&self) -> &str {
        &self.kept.key
    }
}

/// A decode call's fields of a request whose class keeps them all in slots, and its key and
/// hints ([`PlainClass::read_state`]); valid while no Python code runs.
pub(crate) struct StateRead<'a> {
    pub(crate) state: StateRef<'a>,
    /// The token list, an exact list.
    tokens: Borrowed<'a, 'a, PyAny>,
    /// Whether the base holds `tokens` as checked ([`PlainClass::note_tokens`]); else it was
    /// checked now.
    pub(crate) noted: bool,
    pub(crate) num_computed_tokens: usize,
    /// 0 unless asked for.
    pub(crate) num_prompt_tokens: usize,
}

impl StateRead<'_> {
    /// `num_tokens`: the token list's length (a read of the list's header, which with
    /// thousands of requests is no longer in the caches by the next step).
    #[inline]
    pub(crate) fn num_tokens(&self) -> usize {
        #[allow(unsafe_code)]
        // SAFETY: `read_state` found an exact list (checked now, or held by the base since it
        // was checked: that object, whose type cannot change).
        list_len(unsafe { self.tokens.downcast_unchecked::<PyList>() })
    }
}

/// Where a plain class keeps the fields the manager reads in `__slots__` (its own or a
/// base's): each field's byte offset in the instance, 0 for a field kept in the instance dict.
///
/// A slot is a pointer at a fixed offset in the object, so a request of such a class is read
/// without its dict: when all of a decode call's fields are slots ([`Slots::decode`]), the
/// call reads the object and the field values, and nothing else; when the fields of a call
/// that fills a block are too ([`Slots::whole`]), that call does not read the dict either.
/// `kvcore.vllm.Request` keeps all of those there.
#[derive(Clone, Copy, Default)]
pub(crate) struct Slots {
    /// By [`field_names`] index.
    fields: [u16; FIELDS],
    tokens: u16,
    /// The address of the class's token attribute name (compared only; the class holds it).
    tokens_name: usize,
}

impl Slots {
    /// Whether a decode call's fields are all slots (the prompt length only when `prompt`).
    #[inline]
    fn decode(&self, prompt: bool) -> bool {
        self.fields[field::REQUEST_ID] != 0
            && self.fields[field::NUM_COMPUTED_TOKENS] != 0
            && self.tokens != 0
            && (!prompt || self.fields[field::NUM_PROMPT_TOKENS] != 0)
    }

    /// Whether the fields a call reads when it fills and caches a block are slots as well:
    /// its decode fields with the prompt length, the hash list, and the fields that tell
    /// whether its `BlockStored` events need more than tokens ([`Fields::tokens_only`]).
    fn whole(&self) -> bool {
        self.decode(true)
            && [
                field::BLOCK_HASHES,
                field::LORA_REQUEST,
                field::CACHE_SALT,
                field::MM_FEATURES,
                field::PROMPT_EMBEDS,
            ]
            .iter()
            .all(|&f| self.fields[f] != 0)
    }

    /// The slot offset of the attribute `name` (interned: compared by address), 0 when it is
    /// not a slot.
    #[inline]
    fn offset(&self, name: &Bound<'_, PyString>) -> u16 {
        let n = name.as_ptr();
        if n as usize == self.tokens_name {
            return self.tokens;
        }
        field_index(name).map_or(0, |i| self.fields[i])
    }

    /// The offset `field` of `cls`'s instances, whose `slot` (the member descriptor a class in
    /// its MRO made for one of its `__slots__`) keeps it: found by setting the slot of a bare instance to
    /// a new object and looking for that object's address among the instance's words. One
    /// word exactly must hold it.
    fn probe(cls: &Bound<'_, PyType>, field: &str, slot: &Bound<'_, PyAny>) -> PyResult<u16> {
        let py = cls.py();
        let size: usize = cls.getattr(intern!(py, "__basicsize__"))?.extract()?;
        let bare = cls.call_method1(intern!(py, "__new__"), (cls,))?;
        let marker = PyList::empty(py);
        slot.call_method1(intern!(py, "__set__"), (&bare, &marker))?;
        let word = std::mem::size_of::<usize>();
        let header = std::mem::size_of::<pyo3::ffi::PyObject>();
        let found: Vec<usize> = (header / word..size / word)
            .map(|i| i * word)
            .filter(|&off| {
                #[allow(unsafe_code)]
                // SAFETY: `bare` is a live instance of `cls`, allocated with at least
                // `__basicsize__` bytes, pointer-aligned; `off + word` is within them.
                unsafe {
                    *bare.as_ptr().cast::<u8>().add(off).cast::<usize>() == marker.as_ptr() as usize
                }
            })
            .collect();
        slot.call_method1(intern!(py, "__delete__"), (&bare,))?;
        match found[..] {
            [off] => u16::try_from(off)
                .map_err(|_| invalid(format!("the slot {field} is past its instance's 64 KiB"))),
            _ => Err(invalid(format!(
                "{}'s slot {field} is not one word of its instances",
                cls.qualname()?
            ))),
        }
    }

    /// The value in the slot at `offset` of `obj`, borrowed; `None` while it is unset.
    ///
    /// # Safety
    /// `offset` is a slot offset of `obj`'s exact class ([`Slots::probe`]), nonzero, and the
    /// GIL is held. The value is borrowed from `obj`, which keeps it until Python code runs.
    #[allow(unsafe_code)]
    #[inline(always)]
    unsafe fn get<'a, 'py>(
        obj: &'a Bound<'py, PyAny>,
        offset: u16,
    ) -> Option<Borrowed<'a, 'py, PyAny>> {
        // SAFETY: an object slot is a pointer-aligned `PyObject *` within the object, null
        // while unset, else a strong reference the object holds.
        unsafe {
            let value = *obj
                .as_ptr()
                .cast::<u8>()
                .add(usize::from(offset))
                .cast::<*mut pyo3::ffi::PyObject>();
            (!value.is_null()).then(|| Borrowed::from_ptr(obj.py(), value))
        }
    }
}

/// Where a decode call's fields sit in a plain request's instance dict, read as CPython 3.11's
/// own attribute cache reads them (`LOAD_ATTR_WITH_HINT`): the entry at a remembered index,
/// taken when its key is the field's interned name, instead of a hash lookup.
///
/// A vLLM `Request` has more attributes than CPython shares between instances, so each
/// request's dict has a hash table of its own; the scheduler's code reads fields through its
/// attribute cache and never touches that table, so a hash lookup of each field from the
/// manager lands on lines nothing else keeps in the caches, one miss per call and field
/// (measured inside vLLM's step: the lookup of `request_id` alone cost a decode call about
/// 0.1 µs). Instances of one class set their attributes in the same order, so one index per
/// field serves them all (the indices are the process's, shared by plain classes: only
/// hints); a dict where the index does not name the field (another layout, a deleted
/// attribute) is read by hash lookup, which then refreshes the index.
struct DictHints {
    request_id: AtomicU32,
    num_computed_tokens: AtomicU32,
    num_prompt_tokens: AtomicU32,
    tokens: AtomicU32,
    /// The fields a call that caches a block reads ([`Fields::tokens_only`],
    /// [`Fields::plain_hashes`]).
    block_hashes: AtomicU32,
    lora_request: AtomicU32,
    cache_salt: AtomicU32,
    prompt_embeds: AtomicU32,
    mm_features: AtomicU32,
}

static DICT_HINTS: DictHints = DictHints {
    request_id: AtomicU32::new(0),
    num_computed_tokens: AtomicU32::new(0),
    num_prompt_tokens: AtomicU32::new(0),
    tokens: AtomicU32::new(0),
    block_hashes: AtomicU32::new(0),
    lora_request: AtomicU32::new(0),
    cache_salt: AtomicU32::new(0),
    prompt_embeds: AtomicU32::new(0),
    mm_features: AtomicU32::new(0),
};

/// CPython 3.11's dict layout (`Include/cpython/dictobject.h`, `Include/internal/pycore_dict.h`):
/// the byte offsets [`dict_get`] reads.
mod layout {
    /// `PyDictObject.ma_keys`.
    pub(super) const MA_KEYS: usize = 32;
    /// `PyDictObject.ma_values`.
    pub(super) const MA_VALUES: usize = 40;
    /// `PyDictKeysObject.dk_log2_index_bytes` (u8).
    pub(super) const DK_LOG2_INDEX_BYTES: usize = 9;
    /// `PyDictKeysObject.dk_kind` (u8): 1 unicode keys (combined), 2 split.
    pub(super) const DK_KIND: usize = 10;
    /// `PyDictKeysObject.dk_nentries` (`Py_ssize_t`).
    pub(super) const DK_NENTRIES: usize = 24;
    /// `PyDictKeysObject.dk_indices`, followed by the entries.
    pub(super) const DK_INDICES: usize = 32;
    pub(super) const KIND_UNICODE: u8 = 1;
    pub(super) const KIND_SPLIT: u8 = 2;
}

/// A 3.11 dict's entry table (its keys all str), read once for the fields of one call.
#[derive(Clone, Copy)]
struct Entries {
    /// The (key, value) entries.
    entries: *const [*mut pyo3::ffi::PyObject; 2],
    /// `dk_nentries`.
    len: usize,
    /// A split dict's values (null for a combined dict, whose values are in its entries).
    values: *const *mut pyo3::ffi::PyObject,
    /// The keys object (its address is a prefetch hint only).
    keys: usize,
}

impl Entries {
    /// `dict`'s entry table, when its keys object is of a kind whose keys are all str.
    ///
    /// # Safety
    /// The GIL is held, `dict` is a live exact dict, and CPython's dict layout is 3.11's
    /// ([`PlainClass::new`] checks the version and probe dicts before it allows this). The
    /// table is valid while the dict lives and no Python code runs (only Python code changes
    /// a dict this crate does not write).
    #[allow(unsafe_code)]
    #[inline]
    unsafe fn of(dict: *mut pyo3::ffi::PyObject) -> Option<Self> {
        use layout::*;
        // SAFETY (of every read): the caller guarantees 3.11's layout. `ma_keys` of a live
        // dict is a live keys object; a keys object of `dk_kind` 1 or 2 holds `dk_nentries`
        // 16-byte (key, value) entries after its `1 << dk_log2_index_bytes` index bytes, and
        // a split dict's `ma_values` a value for each of its shared keys' entries.
        unsafe {
            let d = dict.cast::<u8>();
            let keys = *d.add(MA_KEYS).cast::<*const u8>();
            let values = match *keys.add(DK_KIND) {
                KIND_UNICODE => std::ptr::null(),
                KIND_SPLIT => {
                    let values = *d.add(MA_VALUES).cast::<*const *mut pyo3::ffi::PyObject>();
                    if values.is_null() {
                        return None;
                    }
                    values
                }
                _ => return None,
            };
            let len = usize::try_from(*keys.add(DK_NENTRIES).cast::<isize>()).ok()?;
            let entries = keys
                .add(DK_INDICES + 1usize.checked_shl(u32::from(*keys.add(DK_LOG2_INDEX_BYTES)))?)
                .cast::<[*mut pyo3::ffi::PyObject; 2]>();
            Some(Self {
                entries,
                len,
                values,
                keys: keys as usize,
            })
        }
    }

    /// The value of entry `ix` when its key is `name`, and the address of the value's slot;
    /// `None` otherwise (the caller then looks the key up).
    ///
    /// # Safety
    /// As [`Entries::of`]: the dict `self` was read from lives and no Python code ran since.
    #[allow(unsafe_code)]
    #[inline(always)]
    unsafe fn get(
        &self,
        name: *mut pyo3::ffi::PyObject,
        ix: u32,
    ) -> Option<(*mut pyo3::ffi::PyObject, usize)> {
        let ix = ix as usize;
        if ix >= self.len {
            return None;
        }
        // SAFETY: `ix` is below `dk_nentries`, so entry `ix` (and a split dict's value `ix`)
        // is within the table `of` read. Nothing is written.
        unsafe {
            let entry = self.entries.add(ix);
            if (*entry)[0] != name {
                return None;
            }
            let slot: *const *mut pyo3::ffi::PyObject = if self.values.is_null() {
                std::ptr::addr_of!((*entry)[1])
            } else {
                self.values.add(ix)
            };
            let value = *slot;
            (!value.is_null()).then_some((value, slot as usize))
        }
    }

    /// The index of `name`'s entry, if the dict has one.
    ///
    /// # Safety
    /// As [`Entries::get`].
    #[allow(unsafe_code)]
    #[cold]
    #[inline(never)]
    unsafe fn find(&self, name: *mut pyo3::ffi::PyObject) -> Option<u32> {
        // SAFETY: every index read is below `dk_nentries`.
        unsafe {
            (0..self.len)
                .find(|&i| (*self.entries.add(i))[0] == name)
                .and_then(|i| u32::try_from(i).ok())
        }
    }
}

/// Where CPython 3.11 keeps the instance dict of a class with `Py_TPFLAGS_MANAGED_DICT`: the
/// third pointer-sized word before the object (`_PyObject_ManagedDictPointer`), null until
/// the dict is made.
const MANAGED_DICT_WORD: usize = 3;

/// `Py_TPFLAGS_MANAGED_DICT`.
const TPFLAGS_MANAGED_DICT: std::ffi::c_ulong = 1 << 4;

/// The instance dict of `obj` when it has been made: the managed dict pointer, borrowed.
///
/// # Safety
/// The GIL is held, `obj` is live, its type has `Py_TPFLAGS_MANAGED_DICT`, and the object
/// layout is CPython 3.11's ([`probe_dicts`] checked it on a probe instance).
#[allow(unsafe_code)]
#[inline]
unsafe fn managed_dict(obj: *mut pyo3::ffi::PyObject) -> *mut pyo3::ffi::PyObject {
    // SAFETY: an object of a type with a managed dict is allocated with two pointer-sized
    // words before its GC header (3.11's `_PyType_PreHeaderSize`), the dict and its values.
    unsafe {
        *obj.cast::<*mut pyo3::ffi::PyObject>()
            .wrapping_sub(MANAGED_DICT_WORD)
    }
}

/// Whether this interpreter's dicts have CPython 3.11's layout: the version, and entries
/// read by [`dict_get`] from a probe dict of each kind (a class's instance dict, whose keys
/// are shared, and a dict with keys of its own) that match its lookups.
fn dicts_are_311(py: Python<'_>) -> bool {
    static CHECKED: GILOnceCell<bool> = GILOnceCell::new();
    *CHECKED.get_or_init(py, || probe_dicts(py).unwrap_or(false))
}

/// [`dicts_are_311`]'s check.
fn probe_dicts(py: Python<'_>) -> PyResult<bool> {
    let version = py.version_info();
    if (version.major, version.minor) != (3, 11) {
        return Ok(false);
    }
    let locals = PyDict::new(py);
    py.run(
        c"class P:\n    def __init__(self):\n        self.a, self.b = 1, 2\nprobe = P()\nsplit = probe.__dict__\ncombined = {'x': 3, 'y': 4, 'b': 5}\n",
        None,
        Some(&locals),
    )?;
    let b = intern!(py, "b");
    for name in ["split", "combined"] {
        let Some(dict) = locals.get_item(name)? else {
            return Ok(false);
        };
        let dict = dict.downcast_into_exact::<PyDict>()?;
        let Some(expected) = dict.get_item(b)? else {
            return Ok(false);
        };
        #[allow(unsafe_code)]
        // SAFETY: the version is 3.11; `dict` is a live exact dict, and no Python code runs
        // between the reads.
        let found = unsafe {
            Entries::of(dict.as_ptr())
                .and_then(|e| e.find(b.as_ptr()).and_then(|ix| e.get(b.as_ptr(), ix)))
        };
        if found.map(|(v, _)| v) != Some(expected.as_ptr()) {
            return Ok(false);
        }
    }
    // The probe instance's dict, made by reading `__dict__`, where `managed_dict` reads it.
    let (Some(probe), Some(split)) = (locals.get_item("probe")?, locals.get_item("split")?) else {
        return Ok(false);
    };
    if !has_managed_dict(&probe.get_type()) {
        return Ok(false);
    }
    #[allow(unsafe_code)]
    // SAFETY: the version is 3.11 and the probe's type has a managed dict.
    let dict = unsafe { managed_dict(probe.as_ptr()) };
    Ok(dict == split.as_ptr())
}

/// Whether instances of `cls` have a `__dict__`.
fn has_instance_dict(cls: &Bound<'_, PyType>) -> PyResult<bool> {
    Ok(cls
        .getattr(intern!(cls.py(), "__dictoffset__"))?
        .extract::<isize>()?
        != 0)
}

/// Whether instances of `cls` keep their dict where [`managed_dict`] reads it.
fn has_managed_dict(cls: &Bound<'_, PyType>) -> bool {
    #[allow(unsafe_code)]
    // SAFETY: `cls` is a live type object; `PyType_GetFlags` only reads its flags.
    let flags = unsafe { pyo3::ffi::PyType_GetFlags(cls.as_type_ptr()) };
    flags & TPFLAGS_MANAGED_DICT != 0
}

impl PlainClass {
    /// Registers `cls`, whose `num_tokens` is `len(getattr(request, tokens))`.
    ///
    /// Refused (`InvalidArgumentError`) unless instances have a `__dict__`, attribute lookup
    /// is `object`'s (no `__getattribute__` or `__getattr__` of the class's own), and the
    /// fields read and `tokens` are instance attributes: in the dict, or in a slot (as the
    /// nearest class in its MRO that names them defines them, which attribute lookup finds).
    pub(crate) fn new(cls: &Bound<'_, PyType>, tokens: &Bound<'_, PyString>) -> PyResult<Self> {
        let py = cls.py();
        let object = py.get_type::<pyo3::types::PyAny>();
        let name = cls.qualname()?;
        if !has_instance_dict(cls)? {
            return Err(invalid(format!("{name} instances have no __dict__")));
        }
        if !cls
            .getattr(intern!(py, "__getattribute__"))?
            .is(&object.getattr(intern!(py, "__getattribute__"))?)
            || cls.hasattr(intern!(py, "__getattr__"))?
        {
            return Err(invalid(format!("{name} customises attribute lookup")));
        }
        let mut slots = Slots {
            tokens_name: tokens.as_ptr() as usize,
            ..Slots::default()
        };
        for (i, field) in field_names(py).into_iter().chain([tokens]).enumerate() {
            let at = match class_attr(cls, field)? {
                ClassAttr::Undefined => continue,
                ClassAttr::Slot(at) => at,
                ClassAttr::Other => {
                    return Err(invalid(format!(
                        "{name}'s class defines {field}: it is not a plain instance attribute"
                    )))
                }
            };
            if field.is(tokens) {
                slots.tokens = at;
            } else {
                slots.fields[i] = at;
            }
        }
        let hinted = dicts_are_311(py);
        let based = cls.is_subclass_of::<PlainState>()?;
        Ok(Self {
            cls: cls.clone().unbind(),
            tokens: tokens.clone().unbind(),
            hinted,
            managed: hinted && has_managed_dict(cls),
            slots,
            based,
            readers: [false, true].map(|prompt| match (based, slots.decode(prompt)) {
                (true, true) => Reader::State,
                (true, false) => Reader::Whole,
                (false, _) => Reader::Dict,
            }),
            ints_311: ints_are_311(),
            dictless: slots.whole(),
        })
    }

    /// How a decode call reads instances (`prompt`: with their prompt length).
    #[inline]
    pub(crate) fn reader(&self, prompt: bool) -> Reader {
        self.readers[usize::from(prompt)]
    }

    /// Whether `request`'s class is exactly this one.
    #[inline]
    pub(crate) fn is_class_of(&self, request: &Bound<'_, PyAny>) -> bool {
        std::ptr::eq(request.get_type_ptr(), self.cls.as_ptr().cast())
    }

    /// `request`'s fields: from its slots and dict when its class is exactly this one and the
    /// instance fits, else `None`. With them, what a decode call reads ([`Decoded`]; the
    /// prompt length only when `prompt`), read from the slots ([`Slots`]) when they hold them
    /// all, else at the dict's entries in one pass. Borrowed: no Python code may run while the
    /// view is used ([`PlainView::to_owned`] for longer).
    #[inline(always)]
    pub(crate) fn read<'a, 'py>(
        &'a self,
        request: &'a Bound<'py, PyAny>,
        prompt: bool,
    ) -> Option<PlainView<'a, 'py>> {
        if !self.is_class_of(request) {
            return None;
        }
        if self.slots.decode(prompt) {
            return self.read_slots(request, prompt);
        }
        let dict_any = instance_dict(request, self.managed)?;
        let dict = dict_any.downcast_exact::<PyDict>().ok()?;
        #[allow(unsafe_code)]
        // SAFETY: the GIL is held, `dict` is a live exact dict, and the layout is 3.11's
        // (`hinted`). The table is used only below, where no Python code runs.
        let entries = if self.hinted {
            unsafe { Entries::of(dict.as_ptr()) }
        } else {
            None
        };
        let (tokens, tokens_slot) = field_at(
            request,
            self.slots.tokens,
            dict,
            entries.as_ref(),
            self.tokens.bind(request.py()),
            &DICT_HINTS.tokens,
        )?;
        if !tokens.is_exact_instance_of::<PyList>() {
            return None;
        }
        #[allow(unsafe_code)]
        // SAFETY: the list is held by the dict or the request (`'a`) until Python code runs
        // (the view's contract).
        let tokens = unsafe { Borrowed::from_ptr(request.py(), tokens.as_ptr()) };
        let decoded = decode(request, &self.slots, dict, entries.as_ref(), prompt).map(|mut d| {
            d.lines = [
                (request.as_ptr() as usize).wrapping_sub(MANAGED_DICT_WORD * 8),
                dict.as_ptr() as usize,
                entries.map_or(0, |e| e.keys),
                tokens_slot,
                tokens.as_ptr() as usize,
                d.lines[0],
                d.lines[1],
                d.lines[2],
            ];
            d
        });
        Some(PlainView {
            request,
            dict: Some(dict_any),
            tokens,
            decoded,
            class: self,
        })
    }

    /// A decode call's fields of `request`, an instance of this class, which keeps them all in
    /// slots ([`Slots::decode`], the prompt length only when `prompt`) and derives from
    /// [`PlainState`]: read from the slots and the native base alone, when the counts are exact
    /// ints in range (`count_of`'s rule), the tokens an exact list, and the base keeps the key
    /// of the request's current `request_id`; else `None` (then the whole path reads the
    /// request, raises what is wrong, and keeps the key). The token list is not read when the
    /// base holds it as checked ([`Self::note_tokens`]).
    ///
    /// # Safety
    /// `request`'s exact class is this one, whose [`Self::reader`] for `PROMPT` is
    /// [`Reader::State`].
    #[allow(unsafe_code)]
    #[inline(always)]
    pub(crate) unsafe fn read_state<'a, const PROMPT: bool>(
        &self,
        request: &'a Bound<'_, PyAny>,
        groups: usize,
    ) -> Option<StateRead<'a>> {
        let s = &self.slots;
        debug_assert_eq!(self.reader(PROMPT), Reader::State);
        // SAFETY: slot offsets of the request's exact class, a subclass of `PlainState`, every
        // field read a slot (the caller's contract: `Reader::State`); the values are borrowed
        // from the request for the call.
        let (tokens, id, computed, prompt_len, base) = unsafe {
            (
                Slots::get(request, s.tokens)?,
                Slots::get(request, s.fields[field::REQUEST_ID])?,
                Slots::get(request, s.fields[field::NUM_COMPUTED_TOKENS]),
                if PROMPT {
                    Slots::get(request, s.fields[field::NUM_PROMPT_TOKENS])
                } else {
                    None
                },
                request.downcast_unchecked::<PlainState>().get(),
            )
        };
        let kept = base.kept.try_borrow(request.py())?;
        let kept = RefMut::filter_map(kept, |k| {
            k.as_mut()
                .filter(|k| std::ptr::eq(k.id.as_ptr(), id.as_ptr()))
        })
        .ok()?;
        // The list the base holds is that object while it holds it: an exact list still.
        let noted = kept
            .tokens
            .as_ref()
            .is_some_and(|t| std::ptr::eq(t.as_ptr(), tokens.as_ptr()));
        if !noted && !tokens.is_exact_instance_of::<PyList>() {
            return None;
        }
        Some(StateRead {
            tokens,
            noted,
            num_computed_tokens: self.slot_count(computed)?,
            num_prompt_tokens: if PROMPT {
                self.slot_count(prompt_len)?
            } else {
                0
            },
            state: StateRef {
                kept,
                hints: base.hints(groups),
            },
        })
    }

    /// Has the native base of `request` (an instance of this class, which keeps its decode
    /// fields in slots and derives from [`PlainState`]) hold its token list, when an exact list
    /// and the base keeps the key of its current `request_id`: [`Self::read_state`] then knows
    /// it for an exact list without reading it (its header is read only when a call needs its
    /// length). Holding the list keeps that object at its address, so a slot that still points
    /// there holds it. Runs no Python code while the base is borrowed: the list it replaces is
    /// let go after.
    pub(crate) fn note_tokens(&self, request: &Bound<'_, PyAny>) {
        if !self.based || self.slots.tokens == 0 {
            return;
        }
        #[allow(unsafe_code)]
        // SAFETY: a slot offset of the request's exact class (the caller's check), a subclass
        // of `PlainState` (`based`); the list is borrowed from the request until Python code
        // runs, and is given a reference of its own before.
        let (tokens, base) = unsafe {
            (
                Slots::get(request, self.slots.tokens),
                request.downcast_unchecked::<PlainState>().get(),
            )
        };
        let Some(tokens) = tokens else {
            return;
        };
        let Ok(tokens) = tokens.downcast_exact::<PyList>() else {
            return;
        };
        let replaced = {
            let Some(mut kept) = base.kept.try_borrow(request.py()) else {
                return;
            };
            let Some(kept) = kept.as_mut() else {
                return;
            };
            kept.tokens.replace(tokens.clone().unbind())
        };
        // Freeing a list frees its items, whose finalizers may run Python code.
        drop(replaced);
    }

    /// [`Self::read`] of a request whose decode fields are all slots: its dict is not read.
    #[inline(always)]
    fn read_slots<'a, 'py>(
        &'a self,
        request: &'a Bound<'py, PyAny>,
        prompt: bool,
    ) -> Option<PlainView<'a, 'py>> {
        let s = &self.slots;
        #[allow(unsafe_code)]
        // SAFETY: slot offsets of the request's exact class; the values are borrowed from the
        // request until Python code runs (the view's contract).
        let (tokens, computed, prompt_len, id) = unsafe {
            (
                Slots::get(request, s.tokens)?,
                Slots::get(request, s.fields[field::NUM_COMPUTED_TOKENS]),
                if prompt {
                    Slots::get(request, s.fields[field::NUM_PROMPT_TOKENS])
                } else {
                    None
                },
                Slots::get(request, s.fields[field::REQUEST_ID]),
            )
        };
        if !tokens.is_exact_instance_of::<PyList>() {
            return None;
        }
        let decoded = (|| {
            let num_prompt_tokens = if prompt {
                self.slot_count(prompt_len)?
            } else {
                0
            };
            let mut lines = [0; LINES];
            lines[0] = request.as_ptr() as usize;
            lines[4] = tokens.as_ptr() as usize;
            lines[7] = computed.map_or(0, |c| c.as_ptr() as usize);
            Some(Decoded {
                id_addr: id?.as_ptr() as usize,
                num_computed_tokens: self.slot_count(computed)?,
                num_prompt_tokens,
                lines,
            })
        })();
        Some(PlainView {
            request,
            dict: None,
            tokens,
            decoded,
            class: self,
        })
    }
}

impl PlainClass {
    /// A count read from a slot (`None`: unset), when an exact int in range (`count_of`'s
    /// rule); a one-digit int read inline where ints have 3.11's layout ([`count_311`]).
    #[inline(always)]
    fn slot_count(&self, value: Option<Borrowed<'_, '_, PyAny>>) -> Option<usize> {
        let value = value?;
        if self.ints_311 {
            #[allow(unsafe_code)]
            // SAFETY: `ints_311` is `ints_are_311()` (registration); the GIL is held.
            unsafe {
                count_311(&value)
            }
        } else {
            exact_int(&value)?.count_capped(COUNT_CAP)
        }
    }
}

/// `request`'s instance dict, borrowed from the request; `None` when it cannot be made.
/// `managed`: the class has a managed dict on 3.11 ([`PlainClass::managed`]).
#[inline(always)]
fn instance_dict<'a, 'py>(
    request: &'a Bound<'py, PyAny>,
    managed: bool,
) -> Option<Borrowed<'a, 'py, PyAny>> {
    let py = request.py();
    #[allow(unsafe_code)]
    // SAFETY: `request` is a live object of a registered class and the GIL is held (`py`).
    // Where the class has a managed dict on 3.11 (`managed`, checked on a probe), the made
    // dict is read where CPython keeps it. Otherwise (or before it is made) the class has a
    // `__dict__` slot (checked at registration), so `PyObject_GenericGetDict` returns a new
    // reference to the instance dict, made and stored in the instance when it had none, or
    // NULL with an exception set (then taken off the thread: the caller's general path
    // reports its own). Either way the instance holds a reference to its dict, which it keeps
    // until Python code replaces it: the dict is borrowed from the instance, for `'a` (the
    // caller's contract), and the new reference is let go at once.
    unsafe {
        let mut made = if managed {
            managed_dict(request.as_ptr())
        } else {
            std::ptr::null_mut()
        };
        if made.is_null() {
            let owned = Bound::from_owned_ptr_or_err(
                py,
                pyo3::ffi::PyObject_GenericGetDict(request.as_ptr(), std::ptr::null_mut()),
            )
            .ok()?;
            made = owned.as_ptr();
        }
        Some(Borrowed::from_ptr(py, made))
    }
}

/// What a decode call reads from a plain request, besides its token count (SPEC MGR-6's
/// counts; the prompt length 0 unless asked for), when the counts are exact ints in range
/// (`count_of`'s rule for them).
#[derive(Clone, Copy)]
pub(crate) struct Decoded {
    /// The address of the `request_id` value when read: only compared, never read through
    /// (an object found by it is kept alive by whoever noted the address; see
    /// [`PlainHints::entry`]).
    pub(crate) id_addr: usize,
    pub(crate) num_computed_tokens: usize,
    pub(crate) num_prompt_tokens: usize,
    /// Where this call read the request's fields (see [`Lines`]).
    pub(crate) lines: Lines,
}

/// How many addresses [`Lines`] holds.
pub(crate) const LINES: usize = 8;

/// The addresses a decode call of a plain request read (0: not known), noted with its hint
/// entry so that the call before the next one prefetches them: the object (from its managed
/// dict word), its dict, the dict's keys, the dict slot of its token list, the token list, the
/// dict slots of `num_computed_tokens` and `request_id`, and the `num_computed_tokens` int (above
/// 256 an object of its own, made by the scheduler's last update). Only ever prefetched: a stale
/// one costs a useless fetch.
pub(crate) type Lines = [usize; LINES];

/// The field `name` of a plain request: from its slot when the class keeps it in one
/// (`offset` nonzero), else by [`dict_get`]; with the address of its dict slot (0 otherwise).
/// Borrowed as [`dict_get`]'s.
#[inline(always)]
fn field_at<'a, 'py>(
    request: &'a Bound<'py, PyAny>,
    offset: u16,
    dict: &'a Bound<'py, PyDict>,
    entries: Option<&Entries>,
    name: &Bound<'py, PyString>,
    hint: &AtomicU32,
) -> Option<(Borrowed<'a, 'py, PyAny>, usize)> {
    if offset != 0 {
        #[allow(unsafe_code)]
        // SAFETY: `offset` is a slot offset of the request's exact class (the caller read the
        // request as its plain class's).
        return unsafe { Slots::get(request, offset) }.map(|v| (v, 0));
    }
    dict_get(dict, entries, name, hint).ok()?
}

/// A count field ([`field_at`]), its dict slot's address and the int's, when an exact int in
/// range.
#[inline(always)]
fn count_at<'py>(
    request: &Bound<'py, PyAny>,
    offset: u16,
    dict: &Bound<'py, PyDict>,
    entries: Option<&Entries>,
    name: &Bound<'py, PyString>,
    hint: &AtomicU32,
) -> Option<(usize, usize, usize)> {
    let (value, slot) = field_at(request, offset, dict, entries, name, hint)?;
    let count = exact_int(&value)?.count_capped(COUNT_CAP)?;
    Some((count, slot, value.as_ptr() as usize))
}

/// [`PlainClass::read`]'s decode fields, from the slots `slots` names and the dict; `None`
/// when one is missing or of another type (the caller then reads the request the general way,
/// which raises the error).
#[inline(always)]
fn decode<'py>(
    request: &Bound<'py, PyAny>,
    slots: &Slots,
    dict: &Bound<'py, PyDict>,
    entries: Option<&Entries>,
    prompt: bool,
) -> Option<Decoded> {
    let py = dict.py();
    let count = |offset, name, hint| count_at(request, offset, dict, entries, name, hint);
    let (num_computed_tokens, computed_slot, computed) = count(
        slots.fields[field::NUM_COMPUTED_TOKENS],
        intern!(py, "num_computed_tokens"),
        &DICT_HINTS.num_computed_tokens,
    )?;
    let num_prompt_tokens = if prompt {
        count(
            slots.fields[field::NUM_PROMPT_TOKENS],
            intern!(py, "num_prompt_tokens"),
            &DICT_HINTS.num_prompt_tokens,
        )?
        .0
    } else {
        0
    };
    let (id, id_slot) = field_at(
        request,
        slots.fields[field::REQUEST_ID],
        dict,
        entries,
        intern!(py, "request_id"),
        &DICT_HINTS.request_id,
    )?;
    let mut lines = [0; LINES];
    lines[..3].copy_from_slice(&[computed_slot, id_slot, computed]);
    Some(Decoded {
        id_addr: id.as_ptr() as usize,
        num_computed_tokens,
        num_prompt_tokens,
        lines,
    })
}

/// A plain request's instance dict and token list as [`PlainClass::read`] found them,
/// borrowed (no reference counted) from the request: valid while no Python code runs, which
/// could replace them. Its decode fields as read with them.
pub(crate) struct PlainView<'a, 'py> {
    request: &'a Bound<'py, PyAny>,
    /// The instance dict, when read (not for a request read from its slots alone).
    dict: Option<Borrowed<'a, 'py, PyAny>>,
    /// An exact list.
    tokens: Borrowed<'a, 'py, PyAny>,
    pub(crate) decoded: Option<Decoded>,
    /// The request's class.
    class: &'a PlainClass,
}

impl<'py> PlainView<'_, 'py> {
    /// The token list.
    #[inline]
    fn tokens(&self) -> &Bound<'py, PyList> {
        #[allow(unsafe_code)]
        // SAFETY: `read` checked that it is an exact list.
        unsafe {
            self.tokens.downcast_unchecked()
        }
    }

    /// `num_tokens`: the token list's length.
    #[inline]
    pub(crate) fn num_tokens(&self) -> usize {
        list_len(self.tokens())
    }

    /// The fields held (reference counted), for a path that may run Python code; `None` when
    /// the instance dict, not read yet, is not an exact dict or cannot be made.
    pub(crate) fn to_owned(&self) -> Option<PlainRequest<'py>> {
        let exact =
            |d: Borrowed<'_, 'py, PyAny>| Some(d.downcast_exact::<PyDict>().ok()?.to_owned());
        let dict = match self.dict {
            Some(d) => std::cell::OnceCell::from(Some(exact(d)?)),
            None if self.class.dictless => std::cell::OnceCell::new(),
            None => std::cell::OnceCell::from(Some(exact(instance_dict(
                self.request,
                self.class.managed,
            )?)?)),
        };
        Some(PlainRequest {
            request: self.request.clone(),
            dict,
            tokens: self.tokens().clone(),
            decoded: self.decoded,
            hinted: self.class.hinted,
            managed: self.class.managed,
            slots: self.class.slots,
            based: self.class.based,
        })
    }
}

/// A plain request's instance dict and token list, held, and its decode fields as read with
/// them.
pub(crate) struct PlainRequest<'py> {
    request: Bound<'py, PyAny>,
    /// The instance dict when an exact dict (`None`: read by attribute lookup): read with the
    /// request, or, for a class whose call fields are all slots ([`PlainClass::dictless`]),
    /// when a field kept there is first asked for ([`Self::dict`]).
    dict: std::cell::OnceCell<Option<Bound<'py, PyDict>>>,
    tokens: Bound<'py, PyList>,
    pub(crate) decoded: Option<Decoded>,
    hinted: bool,
    /// Whether the class has a managed dict on 3.11 ([`PlainClass::managed`]).
    managed: bool,
    /// The decode fields its class keeps in slots.
    slots: Slots,
    /// Whether its class derives from [`PlainState`].
    based: bool,
}

/// `dict[name]`, borrowed (no reference counted: valid until Python code runs, which could
/// replace it), and the address of its value's slot when read by entry index (0 otherwise):
/// by the entry `hint` names when the dict's `entries` (its table, read with no Python code
/// run since) were read and it is `name`'s, else by hash lookup (which then refreshes `hint`).
/// `Ok(None)` when the dict has no such key; the error of a failed lookup (a key of another
/// type whose `__eq__` raised, in a dict without a table).
#[inline(always)]
fn dict_get<'a, 'py>(
    dict: &'a Bound<'py, PyDict>,
    entries: Option<&Entries>,
    name: &Bound<'py, PyString>,
    hint: &AtomicU32,
) -> PyResult<Option<(Borrowed<'a, 'py, PyAny>, usize)>> {
    if let Some(e) = entries {
        #[allow(unsafe_code)]
        // SAFETY: `entries` is `dict`'s table, read with no Python code run since (the
        // caller's contract), and `dict` lives as long as `'a`: the value is borrowed from it.
        unsafe {
            if let Some((value, slot)) = e.get(name.as_ptr(), hint.load(Ordering::Relaxed)) {
                return Ok(Some((Borrowed::from_ptr(dict.py(), value), slot)));
            }
        }
    }
    dict_lookup(dict, entries, name, hint)
}

/// [`dict_get`] by hash lookup, refreshing `hint` (slot address 0).
#[cold]
#[inline(never)]
fn dict_lookup<'a, 'py>(
    dict: &'a Bound<'py, PyDict>,
    entries: Option<&Entries>,
    name: &Bound<'py, PyString>,
    hint: &AtomicU32,
) -> PyResult<Option<(Borrowed<'a, 'py, PyAny>, usize)>> {
    let py = dict.py();
    #[allow(unsafe_code)]
    // SAFETY: the GIL is held (`py`); `dict` is a live exact dict and `name` an exact str;
    // `entries` is that dict's table, read with no Python code run since: a lookup in a dict
    // of str keys (the only kind with a table) compares strs and runs none either. The lookup
    // returns a reference borrowed from the dict, which lives as long as `'a`, or NULL, with
    // the error set when it failed (taken off the thread into the result).
    unsafe {
        let item = pyo3::ffi::PyDict_GetItemWithError(dict.as_ptr(), name.as_ptr());
        if item.is_null() {
            return match PyErr::take(py) {
                Some(e) => Err(e),
                None => Ok(None),
            };
        }
        if let Some(ix) = entries.and_then(|e| e.find(name.as_ptr())) {
            hint.store(ix, Ordering::Relaxed);
        }
        Ok(Some((Borrowed::from_ptr(py, item), 0)))
    }
}

impl<'py> PlainRequest<'py> {
    /// The instance dict, read now if it was not (`None` when it is not an exact dict or
    /// cannot be made). Reading it runs no Python code where the class has a managed dict on
    /// 3.11, made by then (a vLLM request's, made by its constructor); a call that holds the
    /// manager's state asks for it only for fields a dictless class keeps in slots, so never.
    fn dict(&self) -> Option<&Bound<'py, PyDict>> {
        self.dict
            .get_or_init(|| {
                let d = instance_dict(&self.request, self.managed)?;
                Some(d.downcast_exact::<PyDict>().ok()?.to_owned())
            })
            .as_ref()
    }

    /// Whether the fields that tell what its `BlockStored` events need
    /// ([`Fields::tokens_only`]) are all slots: read without the dict.
    #[inline]
    fn event_fields_in_slots(&self) -> bool {
        [
            field::LORA_REQUEST,
            field::CACHE_SALT,
            field::PROMPT_EMBEDS,
            field::MM_FEATURES,
        ]
        .iter()
        .all(|&f| self.slots.fields[f] != 0)
    }

    /// The dict's entry table when it is read by index (its keys all str, so that no lookup in
    /// it runs Python code), read now: valid until Python code runs.
    #[inline]
    fn entries(&self) -> Option<Entries> {
        if !self.hinted {
            return None;
        }
        let dict = self.dict()?;
        #[allow(unsafe_code)]
        // SAFETY: the GIL is held, `dict` is a live exact dict (held), and the layout is
        // 3.11's (`hinted`).
        unsafe {
            Entries::of(dict.as_ptr())
        }
    }

    /// `f` of the attribute `name` (`None` when the request has none), read by [`dict_get`]
    /// with `entries`, this dict's table ([`Self::entries`], read with no Python code run
    /// since).
    #[inline(always)]
    fn peek<R>(
        &self,
        entries: Option<&Entries>,
        name: &Bound<'py, PyString>,
        hint: &AtomicU32,
        f: impl FnOnce(Option<&Bound<'py, PyAny>>) -> R,
    ) -> PyResult<R> {
        // The value is borrowed from the request or its held dict for `f`, which is given a
        // reference only for the call.
        let value = match self.slots.offset(name) {
            0 => {
                let dict = self
                    .dict()
                    .ok_or_else(|| invalid("a plain request's instance dict cannot be read"))?;
                dict_get(dict, entries, name, hint)?
            }
            #[allow(unsafe_code)]
            // SAFETY: a slot offset of the request's exact class (read as its plain class's).
            off => unsafe { Slots::get(&self.request, off) }.map(|v| (v, 0)),
        };
        Ok(f(value.as_ref().map(|(v, _)| &**v)))
    }

    /// The attribute `name` from its slot or the dict, or `None` when it has none
    /// ([`Self::peek`], the entry table read afresh: Python code may have run since the
    /// request was read).
    fn field(
        &self,
        name: &Bound<'py, PyString>,
        hint: &AtomicU32,
    ) -> PyResult<Option<Bound<'py, PyAny>>> {
        self.peek(self.entries().as_ref(), name, hint, |v| v.cloned())
    }

    /// The attribute `name`, from its slot or the dict: `AttributeError` when the request has
    /// none.
    pub(crate) fn get(&self, name: &Bound<'py, PyString>) -> PyResult<Bound<'py, PyAny>> {
        self.opt(name)?.ok_or_else(|| self.missing(name))
    }

    /// The attribute `name`, from its slot or the dict, or `None` when the request has none.
    pub(crate) fn opt(&self, name: &Bound<'py, PyString>) -> PyResult<Option<Bound<'py, PyAny>>> {
        match self.slots.offset(name) {
            0 => match self.dict() {
                Some(d) => d.get_item(name),
                None => get_opt(name.py(), &self.request, name),
            },
            #[allow(unsafe_code)]
            // SAFETY: a slot offset of the request's exact class (read as its plain class's).
            off => Ok(unsafe { Slots::get(&self.request, off) }.map(|v| v.to_owned())),
        }
    }

    /// The key and hints kept in the request's native base ([`PlainState`]) when its class
    /// derives from it, for the request's current `request_id` (kept now, its hints reset, when
    /// the base kept another id's or none); `None` when the class does not, or while another
    /// call holds the base's key. `ArgumentTypeError` for a `request_id` that is not a str.
    pub(crate) fn kept_state(&self, groups: usize) -> PyResult<Option<StateRef<'_>>> {
        if !self.based {
            return Ok(None);
        }
        let py = self.request.py();
        // The id in its slot is borrowed (its object not touched: only its address is compared
        // with the kept id's, unless it is another); else read as any field.
        #[allow(unsafe_code)]
        // SAFETY: a slot offset of the request's exact class (read as its plain class's); the
        // id is borrowed from the request, and no Python code runs while it is used below.
        let slotted = match self.slots.fields[field::REQUEST_ID] {
            0 => None,
            off => unsafe { Slots::get(&self.request, off) },
        };
        let read;
        let id: &Bound<'py, PyAny> = match &slotted {
            Some(id) => id,
            None => {
                read = self.get(intern!(py, "request_id"))?;
                &read
            }
        };
        #[allow(unsafe_code)]
        // SAFETY: the request's exact class derives from `PlainState` (`based`).
        let base = unsafe { self.request.downcast_unchecked::<PlainState>() }.get();
        let Some(mut kept) = base.kept.try_borrow(py) else {
            return Ok(None);
        };
        if !kept.as_ref().is_some_and(|k| k.id.is(id)) {
            let id = request_id_of(id)?;
            let key = crate::args::id_key(id)?.into_owned().into_boxed_str();
            base.reset_hints();
            // The id it replaces is let go: freeing a str runs no Python code.
            // The checked token list stays: it is the request's, whatever its id.
            let tokens = kept.as_mut().and_then(|k| k.tokens.take());
            *kept = Some(KeptId {
                id: id.clone().unbind(),
                key,
                tokens,
            });
        }
        Ok(RefMut::filter_map(kept, Option::as_mut)
            .ok()
            .map(|kept| StateRef {
                kept,
                hints: base.hints(groups),
            }))
    }

    /// The `AttributeError` of a missing attribute `name`.
    fn missing(&self, name: &Bound<'py, PyString>) -> PyErr {
        let cls = self
            .request
            .get_type()
            .name()
            .map_or_else(|_| "?".to_owned(), |n| n.to_string());
        PyAttributeError::new_err(format!("'{cls}' object has no attribute '{name}'"))
    }
}

/// How the nearest class in a class's MRO that names an attribute defines it ([`class_attr`]).
enum ClassAttr {
    /// No class names it: an instance attribute, kept in the instance dict.
    Undefined,
    /// A slot of the instances, at this offset ([`Slots::probe`]).
    Slot(u16),
    /// Anything else (a property, a method, a class attribute).
    Other,
}

/// How `cls` defines the attribute `name`, as attribute lookup finds it: by the nearest class
/// in its MRO whose `__dict__` names it.
fn class_attr(cls: &Bound<'_, PyType>, name: &Bound<'_, PyString>) -> PyResult<ClassAttr> {
    let py = cls.py();
    let member = py
        .import("types")?
        .getattr(intern!(py, "MemberDescriptorType"))?;
    for klass in cls.getattr(intern!(py, "__mro__"))?.try_iter()? {
        if let Ok(found) = klass?.getattr(intern!(py, "__dict__"))?.get_item(name) {
            return Ok(if found.get_type().is(&member) {
                ClassAttr::Slot(Slots::probe(cls, name.to_str()?, &found)?)
            } else {
                ClassAttr::Other
            });
        }
    }
    Ok(ClassAttr::Undefined)
}

/// A request's fields, read by attribute lookup or from a plain request's dict.
pub(crate) enum Fields<'a, 'py> {
    Attrs(&'a Bound<'py, PyAny>),
    Plain(PlainRequest<'py>),
}

impl<'a, 'py> Fields<'a, 'py> {
    /// `request`'s fields, from its dict when its class is `plain`.
    #[inline]
    pub(crate) fn of(
        plain: Option<&PlainClass>,
        request: &'a Bound<'py, PyAny>,
        prompt: bool,
    ) -> Self {
        match plain.and_then(|p| p.read(request, prompt)?.to_owned()) {
            Some(r) => Fields::Plain(r),
            None => Fields::Attrs(request),
        }
    }

    /// The attribute `name`: `AttributeError` when the request has none.
    pub(crate) fn get(&self, name: &Bound<'py, PyString>) -> PyResult<Bound<'py, PyAny>> {
        match self {
            Fields::Attrs(r) => r.getattr(name),
            Fields::Plain(p) => p.get(name),
        }
    }

    /// The attribute `name`, or `None` when the request has none.
    pub(crate) fn opt(&self, name: &Bound<'py, PyString>) -> PyResult<Option<Bound<'py, PyAny>>> {
        match self {
            Fields::Attrs(r) => get_opt(r.py(), r, name),
            Fields::Plain(p) => p.opt(name),
        }
    }

    /// `request.num_tokens` (the token list's length for a plain request).
    pub(crate) fn num_tokens(&self) -> PyResult<usize> {
        match self {
            Fields::Attrs(r) => count_of(&r.getattr(intern!(r.py(), "num_tokens"))?, "num_tokens"),
            Fields::Plain(p) => Ok(list_len(&p.tokens)),
        }
    }

    /// A plain request's `block_hashes` read without running Python code, so that it may be
    /// read while the manager's state is held: the instance dict's list or tuple itself
    /// (`InvalidArgumentError` for anything else; a plain class keeps a list there). `None`
    /// for any other request, whose attribute is read before the state is held.
    pub(crate) fn plain_hashes(&self) -> Option<PyResult<Bound<'py, PyAny>>> {
        let Fields::Plain(p) = self else {
            return None;
        };
        let py = p.tokens.py();
        let name = intern!(py, "block_hashes");
        let hashes = p
            .field(name, &DICT_HINTS.block_hashes)
            .and_then(|h| h.ok_or_else(|| p.missing(name)));
        Some(hashes.and_then(|h| {
            if h.is_exact_instance_of::<PyList>() || h.is_exact_instance_of::<PyTuple>() {
                Ok(h)
            } else {
                Err(invalid(format!(
                    "a plain request's block_hashes must be a list or a tuple, not {}",
                    h.get_type().name()?
                )))
            }
        }))
    }

    /// `request.request_id`, which must be a str.
    pub(crate) fn request_id(&self) -> PyResult<Bound<'py, PyString>> {
        let py = self.request().py();
        Ok(request_id_of(&self.get(intern!(py, "request_id"))?)?.clone())
    }

    /// A plain request's token list when it has none of the fields that give its blocks
    /// extra keys or a LoRA (SPEC §17): its `BlockStored` events then need nothing but tokens,
    /// read from the list without running Python code.
    pub(crate) fn tokens_only(&self) -> PyResult<Option<&Bound<'py, PyList>>> {
        let Fields::Plain(p) = self else {
            return Ok(None);
        };
        let py = p.tokens.py();
        // One read of the entry table for the four fields (unless all are slots): a lookup in
        // it runs no Python code.
        let entries = (!p.event_fields_in_slots()).then(|| p.entries()).flatten();
        let e = entries.as_ref();
        for (name, hint) in [
            (intern!(py, "lora_request"), &DICT_HINTS.lora_request),
            (intern!(py, "cache_salt"), &DICT_HINTS.cache_salt),
            (intern!(py, "prompt_embeds"), &DICT_HINTS.prompt_embeds),
        ] {
            if p.peek(e, name, hint, |v| v.is_some_and(|v| !v.is_none()))? {
                return Ok(None);
            }
        }
        let mm = intern!(py, "mm_features");
        let extra = p.peek(e, mm, &DICT_HINTS.mm_features, |mm| {
            mm.is_some_and(|mm| {
                !(mm.is_none() || mm.downcast::<PyList>().is_ok_and(|l| l.is_empty()))
            })
        })?;
        Ok((!extra).then_some(&p.tokens))
    }

    /// [`Self::tokens_only`] when it is known without running Python code or raising (a
    /// plain request whose dict has str keys only, so that its lookups compare strs): the
    /// token list, or `None` (then ask [`Self::tokens_only`] when the event fields are needed).
    pub(crate) fn quiet_tokens_only(&self) -> Option<&Bound<'py, PyList>> {
        let Fields::Plain(p) = self else {
            return None;
        };
        if !p.event_fields_in_slots() {
            p.entries()?;
        }
        self.tokens_only().ok().flatten()
    }

    /// A plain copy of the fields a `BlockStored` event reads (SPEC §17), taken before the
    /// tables are held so that a request whose attributes run Python code is not read
    /// meanwhile (a plain request's `all_token_ids` is its token list).
    pub(crate) fn event_snapshot(&self) -> PyResult<Bound<'py, PyAny>> {
        static NAMESPACE: GILOnceCell<PyObject> = GILOnceCell::new();
        let py = self.request().py();
        let cls = NAMESPACE.get_or_try_init(py, || -> PyResult<PyObject> {
            Ok(py.import("types")?.getattr("SimpleNamespace")?.unbind())
        })?;
        let fields = PyDict::new(py);
        let all = intern!(py, "all_token_ids");
        let tokens = match self {
            Fields::Attrs(_) => self.opt(all)?,
            Fields::Plain(p) => Some(p.tokens.clone().into_any()),
        };
        if let Some(v) = tokens {
            fields.set_item(all, v)?;
        }
        for name in [
            intern!(py, "lora_request"),
            intern!(py, "cache_salt"),
            intern!(py, "mm_features"),
            intern!(py, "prompt_embeds"),
            intern!(py, "_prompt_embeds_per_block_hashes"),
        ] {
            if let Some(v) = self.opt(name)? {
                fields.set_item(name, v)?;
            }
        }
        cls.bind(py).call((), Some(&fields))
    }

    /// A plain request's native base, when its class derives from [`PlainState`].
    pub(crate) fn plain_base(&self) -> Option<&PlainState> {
        let Fields::Plain(p) = self else {
            return None;
        };
        if !p.based {
            return None;
        }
        #[allow(unsafe_code)]
        // SAFETY: the request's exact class derives from `PlainState` (`based`).
        Some(unsafe { p.request.downcast_unchecked::<PlainState>() }.get())
    }

    /// The request object.
    pub(crate) fn request(&self) -> &Bound<'py, PyAny> {
        match self {
            Fields::Attrs(r) => r,
            Fields::Plain(p) => &p.request,
        }
    }
}

/// `kvcore._native.PlainRequestBase`: a native base for a plain request class
/// (`kvcore.vllm.Request`), where the manager keeps the request's table key and slot hints, as
/// kvcore's own `Request` keeps them in its native base: a decode call reads them from the
/// request object itself, with its fields (slots). The base keeps the id str its key was made
/// for; when the request's `request_id` is another object, the key is made again and the hints
/// reset. The hints are only hints: tables check a hint's owner and slot generation, so a
/// request shared by managers is answered right. It takes and ignores any constructor
/// arguments (its subclass's `__init__` reads them).
///
/// It also holds the request's token window ([`TokenWindow`]): the token objects of the block
/// the native append's hasher hashed last, and its last hashes, which the call that stores
/// that block takes where the lists still hold those objects.
///
/// And it holds where the request the native append served after this one last time keeps what
/// that append reads ([`PlainState::chain`]), which this one's next append prefetches.
///
/// Laid out in declaration order (`repr(C)`) and kept small (160 bytes with the object's
/// header: the window is out of line), so that what a decode call reads of the request (the
/// cell's flag, the id, the token list, the key, the first group's hint, then the subclass's
/// slots right after the base) spans few cache lines: the lines of its slots and its
/// reference count, which the scheduler's own code reads and writes every step, hold most of
/// it.
#[pyclass(module = "kvcore._native", name = "PlainRequestBase", subclass, frozen)]
#[repr(C)]
pub(crate) struct PlainState {
    /// The id the key was made for, and the key; held by a call for its length.
    kept: GilRefCell<Option<KeptId>>,
    /// The hint of a manager of one group (most models).
    hint: kvcore_core::tables::HintCell,
    /// One hint cell per group, the first [`INLINE_HINTS`] groups, for managers of several
    /// groups: made by the first such call (out of line, so that one group's calls read the
    /// fewest lines).
    hints: OnceLock<Box<[kvcore_core::tables::HintCell; INLINE_HINTS]>>,
    /// The objects of the blocks the native append hashed last ([`TokenWindow`]); made by
    /// the append once windows are wanted ([`WINDOWS`]), so without events there is none.
    /// Boxed: read and written at a block's end only.
    window: GilRefCell<Option<Box<TokenWindow>>>,
    /// The addresses [`PlainState::chain`] noted here: what the native append read of the
    /// request it served right after this one, last time. Only ever prefetched.
    next: [AtomicUsize; NEXT_LINES],
}

// The size the docs give (160 bytes with the object's 16-byte header).
const _: () = assert!(std::mem::size_of::<PlainState>() == 144);

/// The addresses a [`PlainState`] keeps of its successor's ([`PlainState::chain`]): the object,
/// the headers of its two token lists and its hash list, and both token lists' ends.
const NEXT_LINES: usize = 6;

/// The address of the [`PlainState`] of the request the native append served last (0: none).
/// Written by the append ([`PlainState::chain`]) and cleared by that base's `Drop`, both with
/// the GIL held; see [`PlainState::chain`] for why the address is always a live base.
static LAST_APPENDED: AtomicUsize = AtomicUsize::new(0);

/// The token objects at positions `start..` of a request's token list, noted by the native
/// append ([`PlainState::append_output_token_ids`]) when its hasher hashed the blocks they
/// fill (the items were just read then), each held: the later call that stores those blocks
/// hands them to its `BlockStored` event instead of slicing the list, whose int objects, with
/// thousands of requests, are no longer in the caches by then. Noted a block at a time, so
/// that an append that completes no block writes nothing here.
///
/// Only a hint: vLLM's code edits the list in place too (`del`, `extend`, `pop`), so a call
/// uses the window only where the list's items are these very objects, compared by address.
/// The window holds them, so no other object can have their addresses meanwhile, and ints do
/// not change: the same addresses are the same values. Each is an exact `int` within `i64`,
/// as the event's slice path requires.
///
/// It also keeps the last [`WINDOW_HASHES`] hashes the native append added to `block_hashes`
/// (their index there, the `bytes` object, held, and its value), which a call that stores a
/// block reads instead of the `bytes` where the list still holds that object at that index.
struct TokenWindow {
    start: usize,
    objs: Vec<Py<PyAny>>,
    hashes: Vec<(usize, Py<PyAny>, kvcore_core::hash::BlockHash)>,
}

/// The hashes a window keeps: a stored block's own and its parent's.
const WINDOW_HASHES: usize = 2;

/// The most tokens a window holds; a block past it starts the window again (a request whose
/// blocks are larger is read from its list). A request whose calls never take the window (its
/// events need more than tokens) holds this many references at most.
const WINDOW_CAP: usize = 256;

/// Whether a call has stored a block of a request with a native base by slicing its list,
/// events on: from then on the native append notes the blocks it hashes in the request's window
/// (made then). A process whose managers send no events makes none.
static WINDOWS: AtomicBool = AtomicBool::new(false);

impl PlainState {
    /// Items `start..end` of `tokens` (the request's token list), taken from the window when
    /// they are its objects; the window then keeps what follows `end`. `None` when the window
    /// does not cover the range or the list holds other objects there (the caller slices the
    /// list, then [`Self::want_windows`]). Runs no Python code.
    pub(crate) fn take_window(
        &self,
        tokens: &Bound<'_, PyList>,
        start: usize,
        end: usize,
    ) -> Option<Vec<Py<PyAny>>> {
        let mut cell = self.window.try_borrow(tokens.py())?;
        let w = cell.as_mut()?;
        let (lo, hi) = (start.checked_sub(w.start)?, end.checked_sub(w.start)?);
        if lo > hi || !crate::args::list_items_are(tokens, start, w.objs.get(lo..hi)?) {
            return None;
        }
        // What precedes the range goes (ints: freeing one runs no Python code).
        let mut rest = w.objs.split_off(hi);
        std::mem::swap(&mut rest, &mut w.objs);
        w.start = end;
        rest.drain(..lo);
        Some(rest)
    }

    /// The value of `item`, item `i` of the request's `block_hashes`, when the window keeps
    /// that very object at that index (else `None`: the caller reads the `bytes`). Runs no
    /// Python code.
    #[inline]
    pub(crate) fn window_hash(
        &self,
        item: &Bound<'_, PyAny>,
        i: usize,
    ) -> Option<kvcore_core::hash::BlockHash> {
        let cell = self.window.try_borrow(item.py())?;
        let w = cell.as_ref()?;
        w.hashes
            .iter()
            .find(|(at, obj, _)| *at == i && obj.as_ptr() == item.as_ptr())
            .map(|&(_, _, h)| h)
    }

    /// Notes in the window (when there is one) the hashes `new` (a list), just appended to
    /// `block_hashes` from index `at`: each exact `bytes` that is a valid hash, the last
    /// [`WINDOW_HASHES`] kept.
    fn window_note_hashes(&self, new: &Bound<'_, PyAny>, at: usize) {
        let Ok(new) = new.downcast_exact::<PyList>() else {
            return;
        };
        let Some(mut cell) = self.window.try_borrow(new.py()) else {
            return;
        };
        let Some(w) = cell.as_mut() else {
            return;
        };
        for (j, item) in new.iter().enumerate() {
            let Ok(b) = item.downcast_exact::<pyo3::types::PyBytes>() else {
                continue;
            };
            let Some(h) = kvcore_core::hash::BlockHash::from_slice(b.as_bytes()) else {
                continue;
            };
            if w.hashes.len() >= WINDOW_HASHES {
                w.hashes.remove(0);
            }
            w.hashes.push((at + j, item.unbind(), h));
        }
    }

    /// After a call that stored blocks by slicing the request's token list: from now on the
    /// native append notes the blocks it hashes ([`WINDOWS`]).
    pub(crate) fn want_windows() {
        WINDOWS.store(true, Ordering::Relaxed);
    }

    /// Notes items `from..to` of `tokens` (the blocks the native append's hasher just hashed)
    /// in the window, made now once windows are wanted ([`WINDOWS`]): pushed when the window
    /// ends at `from`, else the window starts again at `from`. An item that is not an exact int
    /// within `i64` starts it after that item.
    fn window_note(&self, tokens: &Bound<'_, PyList>, from: usize, to: usize) {
        if !WINDOWS.load(Ordering::Relaxed) || to.saturating_sub(from) > WINDOW_CAP {
            return;
        }
        let Some(mut cell) = self.window.try_borrow(tokens.py()) else {
            return;
        };
        let w = cell.get_or_insert_with(|| {
            Box::new(TokenWindow {
                start: from,
                objs: Vec::new(),
                hashes: Vec::new(),
            })
        });
        if w.start + w.objs.len() != from || w.objs.len() + (to - from) > WINDOW_CAP {
            w.objs.clear();
            w.start = from;
        }
        for i in from..to.min(list_len(tokens)) {
            let Ok(item) = tokens.get_item(i) else {
                break;
            };
            if crate::args::exact_i64(&item).is_some() {
                w.objs.push(item.unbind());
            } else {
                w.objs.clear();
                w.start = i + 1;
            }
        }
    }

    /// Prefetches what the native append read of the request it served after this one last
    /// time ([`Self::chain`]): the object with the words before it (its dict pointer and GC
    /// header) and its slots, its lists' headers and its token lists' ends. Called at the start
    /// of this request's append, so that they arrive while the rest of it, and the scheduler's
    /// code up to the next append, run.
    #[inline]
    fn prefetch_successor(&self) {
        use kvcore_core::prefetch::{prefetch, prefetch_line};
        let [object, output, all, hashes, output_end, all_end] = self
            .next
            .each_ref()
            .map(|a| a.load(Ordering::Relaxed) as *const u8);
        prefetch(object.wrapping_sub(32));
        prefetch(object.wrapping_add(96));
        prefetch_line(object.wrapping_add(224));
        for header in [output, all, hashes] {
            prefetch_list_header(header);
        }
        prefetch_line(output_end);
        prefetch_line(all_end);
    }

    /// Links the requests the native append serves, in the order it serves them: notes in
    /// the base the append served last (when another) where this request keeps what the append
    /// read now (`lists`: its token lists and hash list, the hash list's address 0 when not
    /// read), for that base's next append to prefetch; then this base is the last.
    ///
    /// A scheduler appends to its running requests in the same order step after step (the
    /// order it scheduled them), so the request appended after one last step is, but for
    /// those that finished or joined, the one appended after it next step. The addresses are
    /// only prefetched: a stale one (a request gone, a list replaced or grown elsewhere) costs
    /// a useless fetch, and the next step notes them again.
    fn chain(&self, request: &Bound<'_, PyAny>, lists: [&Bound<'_, PyAny>; 2], hashes: usize) {
        let me = std::ptr::from_ref(self) as usize;
        let prev = LAST_APPENDED.swap(me, Ordering::Relaxed);
        if prev == 0 || prev == me {
            return;
        }
        #[allow(unsafe_code)]
        // SAFETY: `prev` is the address of a live `PlainState`. It was stored by `chain` from a
        // base's `&self`, and a base clears it (`Drop`) before its memory is freed. The GIL
        // orders both: the swap above and `Drop` run with it held (every Python object is freed
        // with the GIL held), and no Python code runs between the swap and this borrow, so
        // nothing can free that base in between. Only its atomics are touched.
        let prev = unsafe { &*(prev as *const Self) };
        let end = |l: &Bound<'_, PyAny>| {
            l.downcast_exact::<PyList>()
                .map_or(0, |l| crate::args::list_end_addr(l))
        };
        let [output, all] = lists;
        let lines = [
            request.as_ptr() as usize,
            output.as_ptr() as usize,
            all.as_ptr() as usize,
            hashes,
            end(output),
            end(all),
        ];
        for (cell, line) in prev.next.iter().zip(lines) {
            cell.store(line, Ordering::Relaxed);
        }
    }

    /// The hints of a manager of `groups` groups (of the first [`INLINE_HINTS`]).
    #[inline]
    fn hints(&self, groups: usize) -> &[kvcore_core::tables::HintCell] {
        if groups <= 1 {
            std::slice::from_ref(&self.hint)
        } else {
            &self.hints.get_or_init(Default::default)[..groups.min(INLINE_HINTS)]
        }
    }

    /// Forgets every hint (the key changed).
    fn reset_hints(&self) {
        self.hint.set(None);
        for h in self.hints.get().into_iter().flat_map(|h| h.iter()) {
            h.set(None);
        }
    }
}

impl Drop for PlainState {
    /// A base being freed is no longer the last the append served ([`LAST_APPENDED`]).
    fn drop(&mut self) {
        let me = std::ptr::from_ref(self) as usize;
        let _ = LAST_APPENDED.compare_exchange(me, 0, Ordering::Relaxed, Ordering::Relaxed);
    }
}

/// A request id and its table key (`crate::args::id_key`), and the request's token list once
/// checked to be an exact list ([`PlainClass::note_tokens`]).
#[repr(C)]
struct KeptId {
    id: Py<PyString>,
    tokens: Option<Py<PyList>>,
    key: Box<str>,
}

#[pymethods]
impl PlainState {
    #[new]
    #[pyo3(signature = (*_args, **_kwargs))]
    fn new(_args: &Bound<'_, PyTuple>, _kwargs: Option<&Bound<'_, PyDict>>) -> Self {
        Self {
            kept: GilRefCell::new(None),
            hint: Default::default(),
            hints: OnceLock::new(),
            window: GilRefCell::new(None),
            next: Default::default(),
        }
    }

    /// Lets the cycle collector see the token list the base holds (a list may hold anything,
    /// the request too). A base a call has borrowed is skipped: the request holds that list
    /// too while the call reads it.
    fn __traverse__(&self, visit: PyVisit<'_>) -> Result<(), PyTraverseError> {
        if let Some(kept) = self.kept.try_borrow_in_gc() {
            if let Some(tokens) = kept.as_ref().and_then(|k| k.tokens.as_ref()) {
                visit.call(tokens)?;
            }
        }
        Ok(())
    }

    /// Lets go of the token list (breaks a cycle through it); the key stays.
    fn __clear__(&self) {
        let taken = self
            .kept
            .try_borrow_in_gc()
            .and_then(|mut k| k.as_mut().and_then(|k| k.tokens.take()));
        drop(taken);
    }

    /// Has [`Self::append_output_token_ids`] serve `cls` (`kvcore.vllm.Request`), whose append
    /// and `update_block_hashes` are vLLM's `Request`'s and whose `num_tokens` is the length
    /// of its `_all_token_ids`; `fallback` (vLLM's `append_output_token_ids`) serves any other
    /// class. Once per process: another class is refused (`InvalidArgumentError`).
    ///
    /// The attributes the append reads (`_output_token_ids`, `_all_token_ids`,
    /// `_block_hasher`, `block_hashes`) are read from their slots where the class keeps them
    /// in slots (`kvcore.vllm.Request` keeps all four there), else by attribute lookup.
    #[staticmethod]
    fn _serve_append(cls: &Bound<'_, PyType>, fallback: PyObject) -> PyResult<()> {
        let py = cls.py();
        let names = APPEND_FIELDS.map(|name| PyString::intern(py, name));
        let mut slots = [None; APPEND_FIELDS.len()];
        for (at, name) in slots.iter_mut().zip(&names) {
            if let ClassAttr::Slot(offset) = class_attr(cls, name)? {
                *at = Some(offset);
            }
        }
        let served = APPEND.get_or_init(py, || ServedAppend {
            cls: cls.clone().unbind(),
            fallback,
            names: names.map(Bound::unbind),
            slots,
        });
        if served.cls.bind(py).is(cls) {
            Ok(())
        } else {
            Err(invalid(
                "append_output_token_ids already serves another class",
            ))
        }
    }

    /// vLLM's `Request.append_output_token_ids`, natively, for the class it serves (see
    /// [`Self::_serve_append`]): the token (any `int`) appended to `_output_token_ids` and
    /// `_all_token_ids`, anything else extending them, then `update_block_hashes`: its hasher's
    /// new hashes extend `block_hashes`. kvcore's own hasher is not called when the request has
    /// no new full window (it would return none). Any other class's instance is handed to
    /// vLLM's method.
    #[pyo3(signature = (token_ids))]
    fn append_output_token_ids<'py>(
        slf: &Bound<'py, Self>,
        token_ids: &Bound<'py, PyAny>,
    ) -> PyResult<()> {
        let py = slf.py();
        let Some(served) = APPEND.get(py) else {
            return Err(invalid("append_output_token_ids serves no class"));
        };
        if !std::ptr::eq(slf.get_type_ptr(), served.cls.as_ptr().cast()) {
            served.fallback.bind(py).call1((slf, token_ids))?;
            return Ok(());
        }
        let read = |i: usize| served.read(slf, i);
        if token_ids.is_instance_of::<pyo3::types::PyInt>() {
            slf.get().prefetch_successor();
            // With thousands of requests, the lists have left the caches since the last step:
            // their headers are fetched together, then both lists' ends, instead of each
            // read waiting for the one before.
            served.prefetch_lists(slf);
            let (output, all) = (read(OUTPUT)?, read(ALL)?);
            for list in [&output, &all] {
                if let Ok(list) = list.downcast_exact::<PyList>() {
                    crate::args::prefetch_list_tail(list);
                }
            }
            list_append(&output, token_ids)?;
            list_append(&all, token_ids)?;
            slf.get()
                .chain(slf.as_any(), [&output, &all], served.address(slf, HASHES));
        } else {
            read(OUTPUT)?.call_method1(intern!(py, "extend"), (token_ids,))?;
            read(ALL)?.call_method1(intern!(py, "extend"), (token_ids,))?;
        }
        let hasher = read(HASHER)?;
        if hasher.is_none() {
            return Ok(());
        }
        let hashes = read(HASHES)?;
        // The tokens kvcore's own hasher is about to hash: noted in the window after it.
        let mut hashed = None;
        if let Ok(native) = hasher.downcast_exact::<crate::hashing::PyRequestBlockHasher>() {
            // What that hasher reads: the hash list's length and `num_tokens` (this class's
            // is the token list's length).
            if let (Ok(list), Ok(tokens)) = (
                hashes.downcast_exact::<PyList>(),
                read(ALL)?.downcast_into_exact::<PyList>(),
            ) {
                match native.get().window(list.len(), tokens.len()) {
                    None => return Ok(()),
                    Some(range) => hashed = Some((tokens, range)),
                }
            }
        }
        let new = hasher.call1((slf,))?;
        let at = hashes.downcast_exact::<PyList>().map(list_len);
        hashes.call_method1(intern!(py, "extend"), (&new,))?;
        if let Some((tokens, (from, to))) = hashed {
            slf.get().window_note(&tokens, from, to);
        }
        if let Ok(at) = at {
            slf.get().window_note_hashes(&new, at);
        }
        Ok(())
    }
}

/// Prefetches the header of the list at `list` (the fields an append reads, which may straddle
/// a line); 0 (not known) prefetches nothing. A hint only.
#[inline(always)]
fn prefetch_list_header(list: *const u8) {
    kvcore_core::prefetch::prefetch_line(list);
    kvcore_core::prefetch::prefetch_line(list.wrapping_add(39));
}

/// The class [`PlainState::append_output_token_ids`] serves, and vLLM's method for others.
struct ServedAppend {
    cls: Py<PyType>,
    fallback: PyObject,
    /// [`APPEND_FIELDS`], interned.
    names: [Py<PyString>; APPEND_FIELDS.len()],
    /// The slot offset of each of them the class keeps in a slot ([`Slots::probe`]); the
    /// others are read by attribute lookup.
    slots: [Option<u16>; APPEND_FIELDS.len()],
}

impl ServedAppend {
    /// Prefetches the headers of the lists a served request keeps in slots (the two token
    /// lists and the hash list): a hint only.
    #[inline]
    fn prefetch_lists(&self, request: &Bound<'_, PlainState>) {
        for i in [OUTPUT, ALL, HASHES] {
            prefetch_list_header(self.address(request, i) as *const u8);
        }
    }

    /// The address of the attribute [`APPEND_FIELDS`]`[i]` of `request`, an instance of the
    /// served class, where the class keeps it in a slot and the slot is set (else 0): for
    /// prefetching only.
    #[inline]
    fn address(&self, request: &Bound<'_, PlainState>, i: usize) -> usize {
        self.slots[i].map_or(0, |offset| {
            #[allow(unsafe_code)]
            // SAFETY: `offset` is a slot offset of the served class, `request`'s exact class
            // (the caller's check); only the value's address is taken.
            unsafe { Slots::get(request.as_any(), offset) }.map_or(0, |v| v.as_ptr() as usize)
        })
    }

    /// The attribute [`APPEND_FIELDS`]`[i]` of `request`, an instance of the served class:
    /// from its slot where the class keeps it in one, else (or while the slot is unset) by
    /// attribute lookup, which raises what vLLM's method would.
    #[inline]
    fn read<'py>(&self, request: &Bound<'py, PlainState>, i: usize) -> PyResult<Bound<'py, PyAny>> {
        let request = request.as_any();
        if let Some(offset) = self.slots[i] {
            #[allow(unsafe_code)]
            // SAFETY: `offset` is a slot offset of the served class, `request`'s exact class
            // (the caller's check); the value is owned before Python code runs.
            if let Some(v) = unsafe { Slots::get(request, offset) } {
                return Ok(v.to_owned());
            }
        }
        request.getattr(self.names[i].bind(request.py()))
    }
}

/// The attributes of a served request that [`PlainState::append_output_token_ids`] reads, by
/// their indices below.
const APPEND_FIELDS: [&str; 4] = [
    "_output_token_ids",
    "_all_token_ids",
    "_block_hasher",
    "block_hashes",
];
const OUTPUT: usize = 0;
const ALL: usize = 1;
const HASHER: usize = 2;
const HASHES: usize = 3;

static APPEND: GILOnceCell<ServedAppend> = GILOnceCell::new();

/// `target.append(item)`: natively for an exact list, else by calling its method.
#[inline]
fn list_append(target: &Bound<'_, PyAny>, item: &Bound<'_, PyAny>) -> PyResult<()> {
    match target.downcast_exact::<PyList>() {
        Ok(list) => list.append(item),
        Err(_) => target
            .call_method1(intern!(target.py(), "append"), (item,))
            .map(drop),
    }
}

/// A plain request's table key and slot hints, found by the address of its `request_id` str.
///
/// kvcore's own `Request` keeps its table slots in its native base, so a decode call finds its
/// tables without hashing its id; a plain request has no native part, so the manager keeps
/// the same for it here. An entry holds a reference to the id str, so that while the entry
/// lives no other object can have that address: a request whose `request_id` is that str has
/// exactly that id. The hints are only hints (the tables check a hint's slot generation), so a
/// stale entry answers nothing wrong; entries go when their request is freed, and those whose
/// id str nothing else holds are dropped when the map has grown (see [`PlainHints::entry`]).
///
/// The entries live in a slab, indexed by id address. A scheduler calls its running requests
/// in the same order every step, so each entry also notes which entry was found after it last
/// time, and each entry notes where its request's table slots (of the first two groups) and
/// what its call read ([`Lines`]: the object, its dict, keys and the fields' entries, which
/// with thousands of requests are no longer in the caches by the next step) were. The call
/// after an entry's checks the noted entry first (one comparison of addresses instead of a
/// hash lookup, whose probe lands on a line of the index that the scheduler's own work between
/// calls has pushed out of the caches), and the noted chain is a prefetch pipeline
/// ([`PlainMap::find`]): each call prefetches the entry two calls ahead, and reads the entry one
/// call ahead (fetched by the call before) to prefetch its slots and fields, so that they
/// arrive while the scheduler's own code runs up to that call. The addresses are only ever
/// prefetched (a stale one costs a useless fetch) and the noted entry is used only when its id
/// address is the call's. The map
/// is GIL-guarded state ([`GilRefCell`]): a call holds its request's entry in place for the call
/// ([`PlainHints::entry`]). A call that finds the map held (another
/// thread's call that let the GIL go, or a re-entrant one) does without it and reads the id,
/// as for any duck-typed request.
pub(crate) struct PlainHints {
    state: GilRefCell<PlainMap>,
}

struct PlainMap {
    /// Slab index of each entry, by the address of its id str.
    index: hashbrown::HashMap<usize, u32>,
    /// The entries (`None`: a free slot, listed in `free`).
    slab: Vec<Option<PlainEntry>>,
    free: Vec<u32>,
    /// The map's size that triggers the next sweep.
    sweep_at: usize,
    /// The slab index of the entry found last ([`NO_ENTRY`] when none).
    prev: u32,
}

/// No slab index.
const NO_ENTRY: u32 = u32::MAX;

/// Groups whose slot hints an entry keeps (inline, next to its table key, so that a decode call
/// reads one line of it); the tables of further groups are found by id.
const INLINE_HINTS: usize = 4;

/// One plain request's slot hints, table key and id (kept alive). Aligned to a cache line;
/// everything but the id, which a decode call does not read, in its first [`ENTRY_LINES`]
/// lines, which the call two before it prefetches.
#[repr(C, align(64))]
pub(crate) struct PlainEntry {
    /// The address of `id`: the call after this entry's predecessor compares it.
    id_addr: usize,
    /// The slab index of the entry found after this one last time: checked first by the next
    /// call, and its entry, slots and fields prefetched ahead of it. A hint for the cache and
    /// the lookup only.
    next: std::cell::Cell<u32>,
    /// The id's table key (`crate::args::id_key`).
    pub(crate) key: String,
    /// One hint cell per group, the first [`INLINE_HINTS`] groups.
    pub(crate) hints: [kvcore_core::tables::HintCell; INLINE_HINTS],
    /// Where this entry's request's table slots of the first two groups were on its last call.
    pub(crate) slot_addr: std::cell::Cell<[usize; 2]>,
    /// Where its request's fields were on its last call.
    pub(crate) lines: std::cell::Cell<Lines>,
    id: Py<PyString>,
}

/// The cache lines of a [`PlainEntry`] that a decode call reads.
const ENTRY_LINES: usize = std::mem::offset_of!(PlainEntry, id).div_ceil(64);

/// The smallest map size that triggers a sweep.
const SWEEP_MIN: usize = 1024;

impl PlainMap {
    /// The entry in slot `i`, if any.
    #[inline]
    fn at(&self, i: u32) -> Option<&PlainEntry> {
        self.slab.get(i as usize).and_then(Option::as_ref)
    }

    /// The slab index of the entry of the id at `addr`: the entry noted after `prev` when it
    /// is that id's, else found in the index (then noted as `prev`'s successor).
    ///
    /// Runs the prefetch pipeline along the noted successors: the next entry was fetched by
    /// the call before, so its noted table slots and request fields are read now and
    /// prefetched, to arrive while the scheduler's own code runs up to the next call; the entry
    /// after it is prefetched for the call after this one to read.
    #[inline(always)]
    fn find(&mut self, addr: usize) -> Option<u32> {
        let prev = std::mem::replace(&mut self.prev, NO_ENTRY);
        let noted = self.at(prev).map(|p| p.next.get());
        let i = match noted.filter(|&n| self.at(n).is_some_and(|e| e.id_addr == addr)) {
            Some(n) => n,
            None => {
                let i = *self.index.get(&addr)?;
                // (A second lookup of the entry found last notes nothing: an entry is not its
                // own successor.)
                if let Some(p) = self.at(prev).filter(|_| prev != i) {
                    p.next.set(i);
                }
                i
            }
        };
        self.prev = i;
        if let Some(next) = self.at(self.at(i)?.next.get()) {
            let [a, b] = next.slot_addr.get();
            kvcore_core::prefetch::prefetch(a as *const u8);
            kvcore_core::prefetch::prefetch(b as *const u8);
            // The object (its managed dict word lies before it), the dict and its keys, the
            // token list and an int may straddle a line; a dict entry (16 bytes, 16-aligned)
            // may not.
            let [object, dict, keys, tokens_slot, tokens, computed_slot, id_slot, computed] =
                next.lines.get();
            for line in [object, dict, keys, tokens, computed] {
                kvcore_core::prefetch::prefetch(line as *const u8);
            }
            for line in [tokens_slot, computed_slot, id_slot] {
                kvcore_core::prefetch::prefetch_line(line as *const u8);
            }
            let after = self.slab.as_ptr().wrapping_add(next.next.get() as usize);
            kvcore_core::prefetch::prefetch_lines(after, ENTRY_LINES);
        }
        Some(i)
    }
}

impl PlainHints {
    /// An empty map.
    pub(crate) fn new() -> Self {
        Self {
            state: GilRefCell::new(PlainMap {
                index: hashbrown::HashMap::new(),
                slab: Vec::new(),
                free: Vec::new(),
                sweep_at: SWEEP_MIN,
                prev: NO_ENTRY,
            }),
        }
    }

    /// The entry of the request whose `request_id` is the str at address `addr`, made on
    /// first use (from `id()`, which reads that str again) and held in place until dropped;
    /// `None` while the map is held by another call, or when `id()` finds another object.
    ///
    /// An entry found by address is that str's (the entry holds its str alive, so no other
    /// object has that address): nothing is read through `addr`. A new entry is made only for
    /// a str (`ArgumentTypeError` otherwise, as any `request_id` read).
    ///
    /// When the map has reached its sweep size, entries whose id str only the map still holds
    /// (their request is gone) are dropped first, and the next sweep size is twice what is
    /// left (at least [`SWEEP_MIN`]): the sweeps cost O(1) per entry made.
    pub(crate) fn entry<'a, 'py>(
        &'a self,
        py: Python<'py>,
        addr: usize,
        id: impl FnOnce() -> PyResult<Bound<'py, PyAny>>,
    ) -> PyResult<Option<RefMut<'a, PlainEntry>>> {
        let Some(mut state) = self.state.try_borrow(py) else {
            return Ok(None);
        };
        if let Some(i) = state.find(addr) {
            return Ok(RefMut::filter_map(state, |s| {
                s.slab.get_mut(i as usize).and_then(Option::as_mut)
            })
            .ok());
        }
        let id = id()?;
        if id.as_ptr() as usize != addr {
            return Ok(None);
        }
        let id = request_id_of(&id)?;
        let key = crate::args::id_key(id)?.into_owned();
        if state.index.len() >= state.sweep_at {
            let PlainMap {
                index, slab, free, ..
            } = &mut *state;
            index.retain(|_, &mut i| {
                let slot = &mut slab[i as usize];
                let keep = slot.as_ref().is_some_and(|e| e.id.get_refcnt(py) > 1);
                if !keep {
                    // Its id str goes with it: freeing a str runs no Python code.
                    *slot = None;
                    free.push(i);
                }
                keep
            });
            state.sweep_at = (2 * state.index.len()).max(SWEEP_MIN);
        }
        let entry = PlainEntry {
            id_addr: addr,
            next: std::cell::Cell::new(NO_ENTRY),
            slot_addr: std::cell::Cell::new([0; 2]),
            lines: std::cell::Cell::new([0; LINES]),
            key,
            hints: Default::default(),
            id: id.clone().unbind(),
        };
        let i = match state.free.pop() {
            Some(i) => {
                state.slab[i as usize] = Some(entry);
                i
            }
            None => {
                let Ok(i) = u32::try_from(state.slab.len()) else {
                    return Ok(None);
                };
                state.slab.push(Some(entry));
                i
            }
        };
        state.index.insert(addr, i);
        state.prev = i;
        Ok(RefMut::filter_map(state, |s| {
            s.slab.get_mut(i as usize).and_then(Option::as_mut)
        })
        .ok())
    }

    /// Drops the entry of `id`, if any (its request was freed). Left for the sweep while the
    /// map is held by another call (the entry's hints then only miss).
    pub(crate) fn forget(&self, id: &Bound<'_, PyString>) {
        let removed = self.state.try_borrow(id.py()).and_then(|mut s| {
            let i = s.index.remove(&(id.as_ptr() as usize))?;
            s.free.push(i);
            s.slab.get_mut(i as usize).and_then(Option::take)
        });
        // The id's reference is released after the map is.
        drop(removed);
    }

    /// How many entries the map holds (`InvariantViolationError` while a call holds it).
    pub(crate) fn len(&self, py: Python<'_>) -> PyResult<usize> {
        let state = self.state.try_borrow(py).ok_or_else(|| {
            crate::errors::error(
                crate::errors::Kind::InvariantViolation,
                "the plain request map is held by a call".to_owned(),
            )
        })?;
        Ok(state.index.len())
    }
}

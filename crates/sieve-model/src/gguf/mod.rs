//! GGUF v2/v3 reader, memory-mapped.
//!
//! File layout (all little-endian): magic `GGUF`, u32 version, u64 tensor count, u64 metadata
//! count; the metadata key/value pairs (key: u64 length + UTF-8; value: u32 type + payload);
//! the tensor infos (name, u32 n_dims, n_dims x u64 dims innermost-first, u32 ggml type, u64
//! offset relative to the data section); padding to `general.alignment` (default 32); the data.
//!
//! Everything read from the file is bounds- and overflow-checked: a truncated or corrupted file
//! gives [`ModelError::Malformed`] naming what was being read, and counts are checked against the
//! bytes left before anything is allocated, so a bogus count cannot trigger a giant allocation.
//!
//! [`GgufModel`] (in `model.rs`) turns a file into a [`crate::weights::TensorSource`].

mod model;

pub use model::GgufModel;

use crate::error::{ModelError, Result};
use crate::tokenizer::GgufTokenizerSpec;
use memmap2::Mmap;
use sieve_cpu::gguf_blocks::dequant::{self as quant, GgmlType};
use std::collections::HashMap;
use std::path::Path;

const MAGIC: &[u8; 4] = b"GGUF";
const DEFAULT_ALIGNMENT: u64 = 32;
/// GGML tensors have at most 4 dimensions.
const MAX_DIMS: u32 = 4;
/// Arrays of arrays are legal but never deep in practice; the cap keeps recursion bounded.
const MAX_ARRAY_DEPTH: usize = 8;

/// A metadata value. Arrays may nest.
#[derive(Clone, Debug, PartialEq)]
pub enum MetaValue {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    U64(u64),
    I64(i64),
    F32(f32),
    F64(f64),
    Bool(bool),
    String(String),
    Array(Vec<MetaValue>),
}

impl MetaValue {
    /// The GGUF name of the value's type, for error messages.
    pub fn type_name(&self) -> &'static str {
        match self {
            MetaValue::U8(_) => "u8",
            MetaValue::I8(_) => "i8",
            MetaValue::U16(_) => "u16",
            MetaValue::I16(_) => "i16",
            MetaValue::U32(_) => "u32",
            MetaValue::I32(_) => "i32",
            MetaValue::U64(_) => "u64",
            MetaValue::I64(_) => "i64",
            MetaValue::F32(_) => "f32",
            MetaValue::F64(_) => "f64",
            MetaValue::Bool(_) => "bool",
            MetaValue::String(_) => "string",
            MetaValue::Array(_) => "array",
        }
    }

    /// Any integer type holding a non-negative value.
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            MetaValue::U8(v) => Some(v.into()),
            MetaValue::U16(v) => Some(v.into()),
            MetaValue::U32(v) => Some(v.into()),
            MetaValue::U64(v) => Some(v),
            MetaValue::I8(v) => u64::try_from(v).ok(),
            MetaValue::I16(v) => u64::try_from(v).ok(),
            MetaValue::I32(v) => u64::try_from(v).ok(),
            MetaValue::I64(v) => u64::try_from(v).ok(),
            _ => None,
        }
    }

    /// Any integer type whose value fits in an i64.
    pub fn as_i64(&self) -> Option<i64> {
        match *self {
            MetaValue::U8(v) => Some(v.into()),
            MetaValue::U16(v) => Some(v.into()),
            MetaValue::U32(v) => Some(v.into()),
            MetaValue::U64(v) => i64::try_from(v).ok(),
            MetaValue::I8(v) => Some(v.into()),
            MetaValue::I16(v) => Some(v.into()),
            MetaValue::I32(v) => Some(v.into()),
            MetaValue::I64(v) => Some(v),
            _ => None,
        }
    }

    /// f32 or f64 (narrowed).
    pub fn as_f32(&self) -> Option<f32> {
        match *self {
            MetaValue::F32(v) => Some(v),
            MetaValue::F64(v) => Some(v as f32),
            _ => None,
        }
    }

    pub fn as_bool(&self) -> Option<bool> {
        match *self {
            MetaValue::Bool(v) => Some(v),
            _ => None,
        }
    }

    pub fn as_str(&self) -> Option<&str> {
        match self {
            MetaValue::String(s) => Some(s),
            _ => None,
        }
    }

    pub fn as_array(&self) -> Option<&[MetaValue]> {
        match self {
            MetaValue::Array(a) => Some(a),
            _ => None,
        }
    }
}

/// One entry of the tensor table.
#[derive(Clone, Debug, PartialEq)]
pub struct GgufTensorInfo {
    pub name: String,
    /// GGML `ne`: innermost (contiguous) dimension first. A 2-D weight with `dims == [K, M]` is the
    /// row-major `[M, K]` matrix.
    pub dims: Vec<u64>,
    pub ggml_type: GgmlType,
    /// Offset of the tensor's bytes from the start of the data section.
    pub offset: u64,
    pub n_bytes: u64,
}

impl GgufTensorInfo {
    pub fn n_elements(&self) -> u64 {
        // Checked at parse time not to overflow.
        self.dims.iter().product()
    }

    /// The shape in row-major (outermost-first) order, as Hugging Face lists it.
    pub fn shape(&self) -> Vec<usize> {
        // Each dim fits in usize: the element count was checked against the file size.
        self.dims.iter().rev().map(|&d| d as usize).collect()
    }
}

enum Storage {
    Mapped(Mmap),
    Owned(Vec<u8>),
}

impl Storage {
    fn bytes(&self) -> &[u8] {
        match self {
            Storage::Mapped(m) => m,
            Storage::Owned(v) => v,
        }
    }
}

/// A parsed GGUF file whose tensor data stays memory-mapped.
pub struct GgufFile {
    path: String,
    storage: Storage,
    version: u32,
    metadata: Vec<(String, MetaValue)>,
    metadata_index: HashMap<String, usize>,
    tensors: Vec<GgufTensorInfo>,
    tensor_index: HashMap<String, usize>,
    alignment: u64,
    data_offset: u64,
}

impl std::fmt::Debug for GgufFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GgufFile")
            .field("path", &self.path)
            .field("version", &self.version)
            .field("metadata_entries", &self.metadata.len())
            .field("tensors", &self.tensors.len())
            .field("alignment", &self.alignment)
            .finish()
    }
}

impl GgufFile {
    /// Memory-maps and parses `path`.
    pub fn open(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let label = path.display().to_string();
        let io_err = |source| ModelError::Io {
            path: label.clone(),
            source,
        };
        let file = crate::weights::open_regular(path)?;
        // SAFETY: the map is read-only; like every mmap-based model loader we rely on the file not
        // being truncated or rewritten by another process while it is open.
        let map = unsafe { Mmap::map(&file) }.map_err(io_err)?;
        Self::parse(Storage::Mapped(map), label)
    }

    /// Parses a GGUF image held in memory; `label` names it in error messages.
    pub fn from_bytes(bytes: Vec<u8>, label: &str) -> Result<Self> {
        Self::parse(Storage::Owned(bytes), label.to_string())
    }

    fn parse(storage: Storage, path: String) -> Result<Self> {
        let header = parse_header(storage.bytes(), &path)?;
        let mut metadata_index = HashMap::with_capacity(header.metadata.len());
        for (i, (key, _)) in header.metadata.iter().enumerate() {
            if metadata_index.insert(key.clone(), i).is_some() {
                return Err(malformed(&path, format!("duplicate metadata key '{key}'")));
            }
        }
        let mut tensor_index = HashMap::with_capacity(header.tensors.len());
        for (i, t) in header.tensors.iter().enumerate() {
            if tensor_index.insert(t.name.clone(), i).is_some() {
                return Err(malformed(
                    &path,
                    format!("duplicate tensor name '{}'", t.name),
                ));
            }
        }
        let mut file = GgufFile {
            path,
            storage,
            version: header.version,
            metadata: header.metadata,
            metadata_index,
            tensors: header.tensors,
            tensor_index,
            alignment: DEFAULT_ALIGNMENT,
            data_offset: 0,
        };
        file.alignment = match file.get("general.alignment") {
            None => DEFAULT_ALIGNMENT,
            Some(v) => match v.as_u64() {
                Some(a) if a.is_power_of_two() => a,
                _ => {
                    return Err(malformed(
                        &file.path,
                        format!("general.alignment must be a power of two, got {v:?}"),
                    ))
                }
            },
        };
        file.data_offset = align_up(header.end_of_tensor_infos as u64, file.alignment)
            .ok_or_else(|| malformed(&file.path, "data section offset overflows".into()))?;
        file.check_tensor_extents()?;
        Ok(file)
    }

    fn check_tensor_extents(&self) -> Result<()> {
        let file_len = self.storage.bytes().len() as u64;
        for t in &self.tensors {
            if !t.offset.is_multiple_of(self.alignment) {
                return Err(malformed(
                    &self.path,
                    format!(
                        "tensor '{}' offset {} is not a multiple of the alignment {}",
                        t.name, t.offset, self.alignment
                    ),
                ));
            }
            let end = self
                .data_offset
                .checked_add(t.offset)
                .and_then(|start| start.checked_add(t.n_bytes));
            match end {
                Some(end) if end <= file_len => {}
                _ => {
                    return Err(malformed(
                        &self.path,
                        format!(
                            "tensor '{}' ({} bytes at data offset {}) extends past the end of the \
                             {file_len}-byte file (data section starts at {})",
                            t.name, t.n_bytes, t.offset, self.data_offset
                        ),
                    ))
                }
            }
        }
        Ok(())
    }

    pub fn path(&self) -> &str {
        &self.path
    }

    pub fn version(&self) -> u32 {
        self.version
    }

    pub fn alignment(&self) -> u64 {
        self.alignment
    }

    /// Absolute file offset where the tensor data section begins.
    pub fn data_offset(&self) -> u64 {
        self.data_offset
    }

    /// All metadata entries, in file order.
    pub fn metadata(&self) -> impl Iterator<Item = (&str, &MetaValue)> {
        self.metadata.iter().map(|(k, v)| (k.as_str(), v))
    }

    pub fn get(&self, key: &str) -> Option<&MetaValue> {
        self.metadata_index.get(key).map(|&i| &self.metadata[i].1)
    }

    /// A non-negative integer of any width; `Ok(None)` when absent, an error when mistyped.
    pub fn get_u64(&self, key: &str) -> Result<Option<u64>> {
        self.typed(key, "a non-negative integer", MetaValue::as_u64)
    }

    /// A non-negative integer that fits in usize.
    pub fn get_usize(&self, key: &str) -> Result<Option<usize>> {
        match self.get_u64(key)? {
            None => Ok(None),
            Some(v) => usize::try_from(v)
                .map(Some)
                .map_err(|_| meta_err(key, format!("{v} does not fit in usize"))),
        }
    }

    /// A token id: a non-negative integer that fits in u32.
    pub fn get_u32(&self, key: &str) -> Result<Option<u32>> {
        match self.get_u64(key)? {
            None => Ok(None),
            Some(v) => u32::try_from(v)
                .map(Some)
                .map_err(|_| meta_err(key, format!("{v} does not fit in u32"))),
        }
    }

    pub fn get_f32(&self, key: &str) -> Result<Option<f32>> {
        self.typed(key, "a float", MetaValue::as_f32)
    }

    pub fn get_bool(&self, key: &str) -> Result<Option<bool>> {
        self.typed(key, "a bool", MetaValue::as_bool)
    }

    pub fn get_str(&self, key: &str) -> Result<Option<&str>> {
        self.typed(key, "a string", MetaValue::as_str)
    }

    /// An array whose elements all convert with `convert`.
    pub fn get_array<'a, T>(
        &'a self,
        key: &str,
        element: &str,
        convert: impl Fn(&'a MetaValue) -> Option<T>,
    ) -> Result<Option<Vec<T>>> {
        let Some(items) = self.typed(key, "an array", MetaValue::as_array)? else {
            return Ok(None);
        };
        items
            .iter()
            .enumerate()
            .map(|(i, v)| {
                convert(v).ok_or_else(|| {
                    meta_err(
                        key,
                        format!("element {i} is a {}, expected {element}", v.type_name()),
                    )
                })
            })
            .collect::<Result<Vec<T>>>()
            .map(Some)
    }

    pub fn get_string_array(&self, key: &str) -> Result<Option<Vec<String>>> {
        self.get_array(key, "a string", |v| v.as_str().map(str::to_owned))
    }

    fn typed<'a, T>(
        &'a self,
        key: &str,
        expected: &str,
        convert: impl Fn(&'a MetaValue) -> Option<T>,
    ) -> Result<Option<T>> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => convert(v).map(Some).ok_or_else(|| {
                let shown = match v {
                    MetaValue::Array(a) => format!("an array of {} elements", a.len()),
                    MetaValue::String(s) => format!("the string {s:?}"),
                    other => format!("{other:?}"),
                };
                meta_err(key, format!("expected {expected}, found {shown}"))
            }),
        }
    }

    /// `general.architecture`.
    pub fn architecture(&self) -> Result<&str> {
        self.get_str("general.architecture")?
            .ok_or_else(|| meta_err("general.architecture", "absent".into()))
    }

    pub fn tensors(&self) -> &[GgufTensorInfo] {
        &self.tensors
    }

    pub fn tensor_info(&self, name: &str) -> Option<&GgufTensorInfo> {
        self.tensor_index.get(name).map(|&i| &self.tensors[i])
    }

    /// The raw (possibly quantized) bytes of a tensor, borrowed from the map.
    pub fn tensor_bytes(&self, name: &str) -> Result<&[u8]> {
        let info = self
            .tensor_info(name)
            .ok_or_else(|| ModelError::MissingTensor(name.to_string()))?;
        // Extents were checked at open time against the file length.
        let start = (self.data_offset + info.offset) as usize;
        Ok(&self.storage.bytes()[start..start + info.n_bytes as usize])
    }

    /// A tensor dequantized to f32, flat, in GGML element order (innermost dimension fastest,
    /// which is row-major order of [`GgufTensorInfo::shape`]).
    pub fn tensor_f32(&self, name: &str) -> Result<Vec<f32>> {
        let bytes = self.tensor_bytes(name)?;
        let info = self
            .tensor_info(name)
            .ok_or_else(|| ModelError::MissingTensor(name.to_string()))?;
        quant::dequantize(info.ggml_type, bytes, info.n_elements() as usize).map_err(|e| match e {
            sieve_cpu::CpuError::Unsupported(m) => {
                ModelError::Unsupported(format!("tensor '{name}': {m}"))
            }
            other => other.into(),
        })
    }

    /// The tokenizer stored in `tokenizer.ggml.*` and `tokenizer.chat_template`.
    pub fn tokenizer_spec(&self) -> Result<GgufTokenizerSpec> {
        let model = self
            .get_str("tokenizer.ggml.model")?
            .ok_or_else(|| {
                meta_err(
                    "tokenizer.ggml.model",
                    "absent: no tokenizer in this file".into(),
                )
            })?
            .to_string();
        let tokens = self
            .get_string_array("tokenizer.ggml.tokens")?
            .ok_or_else(|| meta_err("tokenizer.ggml.tokens", "absent".into()))?;
        let merges = self
            .get_string_array("tokenizer.ggml.merges")?
            .unwrap_or_default();
        let token_types = self
            .get_array("tokenizer.ggml.token_type", "an i32", |v| {
                v.as_i64().and_then(|x| i32::try_from(x).ok())
            })?
            .unwrap_or_default();
        let scores = self
            .get_array("tokenizer.ggml.scores", "a float", MetaValue::as_f32)?
            .unwrap_or_default();
        for (key, len) in [
            ("tokenizer.ggml.token_type", token_types.len()),
            ("tokenizer.ggml.scores", scores.len()),
        ] {
            if len != 0 && len != tokens.len() {
                return Err(meta_err(
                    key,
                    format!("has {len} entries but there are {} tokens", tokens.len()),
                ));
            }
        }
        let token_id = |key: &str| -> Result<Option<u32>> {
            match self.get_u32(key)? {
                Some(id) if id as usize >= tokens.len() => Err(meta_err(
                    key,
                    format!(
                        "token id {id} is outside the {}-token vocabulary",
                        tokens.len()
                    ),
                )),
                other => Ok(other),
            }
        };
        Ok(GgufTokenizerSpec {
            model,
            pre: self
                .get_str("tokenizer.ggml.pre")?
                .unwrap_or_default()
                .to_string(),
            bos_token_id: token_id("tokenizer.ggml.bos_token_id")?,
            eos_token_id: token_id("tokenizer.ggml.eos_token_id")?,
            unknown_token_id: token_id("tokenizer.ggml.unknown_token_id")?,
            padding_token_id: token_id("tokenizer.ggml.padding_token_id")?,
            add_bos_token: self.get_bool("tokenizer.ggml.add_bos_token")?,
            add_eos_token: self.get_bool("tokenizer.ggml.add_eos_token")?,
            chat_template: self.get_str("tokenizer.chat_template")?.map(str::to_owned),
            tokens,
            merges,
            token_types,
            scores,
        })
    }
}

fn malformed(path: &str, reason: String) -> ModelError {
    ModelError::Malformed {
        path: path.to_string(),
        reason,
    }
}

fn meta_err(key: &str, reason: String) -> ModelError {
    ModelError::Metadata {
        key: key.to_string(),
        reason,
    }
}

fn align_up(value: u64, alignment: u64) -> Option<u64> {
    let rem = value % alignment;
    if rem == 0 {
        Some(value)
    } else {
        value.checked_add(alignment - rem)
    }
}

struct Header {
    version: u32,
    metadata: Vec<(String, MetaValue)>,
    tensors: Vec<GgufTensorInfo>,
    end_of_tensor_infos: usize,
}

/// A forward-only reader over the file image that names what it was reading when it runs out.
struct Cursor<'a> {
    bytes: &'a [u8],
    pos: usize,
    path: &'a str,
}

impl<'a> Cursor<'a> {
    fn remaining(&self) -> usize {
        self.bytes.len() - self.pos
    }

    fn take(&mut self, n: usize, what: &str) -> Result<&'a [u8]> {
        if n > self.remaining() {
            return Err(malformed(
                self.path,
                format!(
                    "truncated: {what} at byte {} needs {n} bytes, only {} left",
                    self.pos,
                    self.remaining()
                ),
            ));
        }
        let slice = &self.bytes[self.pos..self.pos + n];
        self.pos += n;
        Ok(slice)
    }

    fn array<const N: usize>(&mut self, what: &str) -> Result<[u8; N]> {
        let mut out = [0u8; N];
        out.copy_from_slice(self.take(N, what)?);
        Ok(out)
    }

    fn u32(&mut self, what: &str) -> Result<u32> {
        Ok(u32::from_le_bytes(self.array(what)?))
    }

    fn u64(&mut self, what: &str) -> Result<u64> {
        Ok(u64::from_le_bytes(self.array(what)?))
    }

    /// A length-prefixed UTF-8 string; the length is checked against the bytes left first.
    fn string(&mut self, what: &str) -> Result<String> {
        let len = self.u64(what)?;
        let len = usize::try_from(len)
            .ok()
            .filter(|&l| l <= self.remaining())
            .ok_or_else(|| {
                malformed(
                    self.path,
                    format!(
                        "{what} at byte {} claims {len} bytes, only {} left",
                        self.pos,
                        self.remaining()
                    ),
                )
            })?;
        let at = self.pos;
        let raw = self.take(len, what)?;
        String::from_utf8(raw.to_vec())
            .map_err(|_| malformed(self.path, format!("{what} at byte {at} is not valid UTF-8")))
    }

    /// Checks that `count` items of at least `min_size` bytes each can fit in what is left, so a
    /// corrupted count fails here instead of in an allocator.
    fn check_count(&self, count: u64, min_size: usize, what: &str) -> Result<usize> {
        let fits = usize::try_from(count)
            .ok()
            .and_then(|c| c.checked_mul(min_size))
            .is_some_and(|needed| needed <= self.remaining());
        if !fits {
            return Err(malformed(
                self.path,
                format!(
                    "{what} count {count} cannot fit in the {} bytes left at byte {}",
                    self.remaining(),
                    self.pos
                ),
            ));
        }
        Ok(count as usize)
    }

    fn value(&mut self, type_id: u32, key: &str, depth: usize) -> Result<MetaValue> {
        let what = || format!("value of '{key}'");
        Ok(match type_id {
            0 => MetaValue::U8(self.array::<1>(&what())?[0]),
            1 => MetaValue::I8(self.array::<1>(&what())?[0] as i8),
            2 => MetaValue::U16(u16::from_le_bytes(self.array(&what())?)),
            3 => MetaValue::I16(i16::from_le_bytes(self.array(&what())?)),
            4 => MetaValue::U32(self.u32(&what())?),
            5 => MetaValue::I32(i32::from_le_bytes(self.array(&what())?)),
            6 => MetaValue::F32(f32::from_le_bytes(self.array(&what())?)),
            7 => {
                let at = self.pos;
                match self.array::<1>(&what())?[0] {
                    0 => MetaValue::Bool(false),
                    1 => MetaValue::Bool(true),
                    b => {
                        return Err(malformed(
                            self.path,
                            format!("bool value of '{key}' at byte {at} is {b}, not 0 or 1"),
                        ))
                    }
                }
            }
            8 => MetaValue::String(self.string(&what())?),
            9 => {
                if depth >= MAX_ARRAY_DEPTH {
                    return Err(malformed(
                        self.path,
                        format!("'{key}' nests arrays deeper than {MAX_ARRAY_DEPTH} levels"),
                    ));
                }
                let element_type = self.u32(&format!("array element type of '{key}'"))?;
                let min_size = min_value_size(element_type).ok_or_else(|| {
                    malformed(
                        self.path,
                        format!("array '{key}' has unknown element type {element_type}"),
                    )
                })?;
                let count = self.u64(&format!("array length of '{key}'"))?;
                let count = self.check_count(count, min_size, &format!("array '{key}'"))?;
                let mut items = Vec::with_capacity(count);
                for _ in 0..count {
                    items.push(self.value(element_type, key, depth + 1)?);
                }
                MetaValue::Array(items)
            }
            10 => MetaValue::U64(self.u64(&what())?),
            11 => MetaValue::I64(i64::from_le_bytes(self.array(&what())?)),
            12 => MetaValue::F64(f64::from_le_bytes(self.array(&what())?)),
            other => {
                return Err(malformed(
                    self.path,
                    format!("metadata '{key}' has unknown value type {other}"),
                ))
            }
        })
    }
}

/// The fewest bytes a value of this type occupies, or `None` for an unknown type.
fn min_value_size(type_id: u32) -> Option<usize> {
    Some(match type_id {
        0 | 1 | 7 => 1,
        2 | 3 => 2,
        4..=6 => 4,
        8 => 8,     // length prefix
        9 => 4 + 8, // element type + count
        10..=12 => 8,
        _ => return None,
    })
}

fn parse_header<'a>(bytes: &'a [u8], path: &'a str) -> Result<Header> {
    let mut c = Cursor {
        bytes,
        pos: 0,
        path,
    };
    let magic = c.array::<4>("magic")?;
    if &magic != MAGIC {
        return Err(malformed(
            path,
            format!("not a GGUF file (magic {magic:02x?})"),
        ));
    }
    let version = c.u32("version")?;
    match version {
        2 | 3 => {}
        1 => {
            return Err(ModelError::Unsupported(
                "GGUF version 1 (only v2 and v3 are read)".into(),
            ))
        }
        v if v.swap_bytes() == 2 || v.swap_bytes() == 3 => {
            return Err(ModelError::Unsupported(format!(
                "big-endian GGUF file {path} (only little-endian files are read)"
            )))
        }
        v => {
            return Err(ModelError::Unsupported(format!(
                "GGUF version {v} in {path}"
            )))
        }
    }
    let tensor_count = c.u64("tensor count")?;
    let metadata_count = c.u64("metadata count")?;
    // Smallest metadata entry: empty key (8) + type (4) + a one-byte value.
    let metadata_count = c.check_count(metadata_count, 8 + 4 + 1, "metadata entry")?;
    let mut metadata = Vec::with_capacity(metadata_count);
    for i in 0..metadata_count {
        let key = c.string(&format!("key of metadata entry {i}"))?;
        let type_id = c.u32(&format!("value type of '{key}'"))?;
        let value = c.value(type_id, &key, 0)?;
        metadata.push((key, value));
    }
    // Smallest tensor info: empty name (8) + n_dims (4) + type (4) + offset (8).
    let tensor_count = c.check_count(tensor_count, 8 + 4 + 4 + 8, "tensor info")?;
    let mut tensors = Vec::with_capacity(tensor_count);
    for i in 0..tensor_count {
        let name = c.string(&format!("name of tensor {i}"))?;
        let n_dims = c.u32(&format!("dimension count of tensor '{name}'"))?;
        if n_dims > MAX_DIMS {
            return Err(malformed(
                path,
                format!("tensor '{name}' has {n_dims} dimensions, at most {MAX_DIMS} allowed"),
            ));
        }
        let mut dims = Vec::with_capacity(n_dims as usize);
        for d in 0..n_dims {
            dims.push(c.u64(&format!("dimension {d} of tensor '{name}'"))?);
        }
        let type_id = c.u32(&format!("type of tensor '{name}'"))?;
        let ggml_type = GgmlType::from_id(type_id).ok_or_else(|| {
            ModelError::Unsupported(format!(
                "tensor '{name}' in {path} has unknown ggml type id {type_id}"
            ))
        })?;
        let offset = c.u64(&format!("data offset of tensor '{name}'"))?;
        let n_elements = dims
            .iter()
            .try_fold(1u64, |acc, &d| acc.checked_mul(d))
            .ok_or_else(|| malformed(path, format!("tensor '{name}' dims {dims:?} overflow")))?;
        let block = ggml_type.block_size() as u64;
        if dims
            .first()
            .is_some_and(|&inner| !inner.is_multiple_of(block))
        {
            return Err(malformed(
                path,
                format!(
                    "tensor '{name}' row length {} is not a multiple of the {ggml_type} block size {block}",
                    dims[0]
                ),
            ));
        }
        let n_bytes = ggml_type.byte_size(n_elements).ok_or_else(|| {
            malformed(
                path,
                format!("tensor '{name}' dims {dims:?} do not form whole {ggml_type} blocks"),
            )
        })?;
        tensors.push(GgufTensorInfo {
            name,
            dims,
            ggml_type,
            offset,
            n_bytes,
        });
    }
    Ok(Header {
        version,
        metadata,
        tensors,
        end_of_tensor_infos: c.pos,
    })
}

#[cfg(test)]
pub(crate) mod test_support;
#[cfg(any(test, feature = "gguf-writer"))]
pub mod writer;

#[cfg(test)]
mod block_tests;
#[cfg(test)]
mod tests;

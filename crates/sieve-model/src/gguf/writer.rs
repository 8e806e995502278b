//! The GGUF v3 writer: builds small valid files. sieve-model's own tests read them back,
//! truncate and corrupt them; `sieve-fuzz` builds its seed corpus with it (through the
//! `gguf-writer` feature, so the writer is not part of an ordinary build of the library).

use super::MetaValue;
use sieve_cpu::gguf_blocks::dequant::GgmlType;

/// A GGUF v3 file under construction: metadata in insertion order, tensors with their raw bytes.
#[derive(Clone, Debug)]
pub struct GgufWriter {
    pub metadata: Vec<(String, MetaValue)>,
    pub tensors: Vec<(String, Vec<u64>, GgmlType, Vec<u8>)>,
    pub alignment: usize,
    pub version: u32,
}

impl Default for GgufWriter {
    fn default() -> Self {
        Self::new()
    }
}

impl GgufWriter {
    /// An empty v3 file with 32-byte alignment (the GGUF default).
    pub fn new() -> Self {
        GgufWriter {
            metadata: Vec::new(),
            tensors: Vec::new(),
            alignment: 32,
            version: 3,
        }
    }

    /// Appends a metadata pair, by value for chained building. A key given twice is written
    /// twice (readers' handling of duplicate keys is itself under test).
    pub fn meta(mut self, key: &str, value: MetaValue) -> Self {
        self.metadata.push((key.to_string(), value));
        self
    }

    /// `dims` innermost-first, as GGUF stores them.
    pub fn tensor(mut self, name: &str, dims: &[u64], ty: GgmlType, data: Vec<u8>) -> Self {
        self.tensors
            .push((name.to_string(), dims.to_vec(), ty, data));
        self
    }

    /// Sets a metadata pair in place, replacing an earlier value of the same key (so a copied
    /// file's keys can be rewritten).
    pub fn set_meta(&mut self, key: &str, value: MetaValue) -> &mut Self {
        self.metadata.retain(|(existing, _)| existing != key);
        self.metadata.push((key.to_string(), value));
        self
    }

    /// Appends a tensor in place; `dims` innermost-first, `data` its raw bytes in `ty`.
    pub fn push_tensor(
        &mut self,
        name: &str,
        dims: &[u64],
        ty: GgmlType,
        data: Vec<u8>,
    ) -> &mut Self {
        self.tensors
            .push((name.to_string(), dims.to_vec(), ty, data));
        self
    }

    pub fn f32_tensor(self, name: &str, dims: &[u64], values: &[f32]) -> Self {
        let data = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        self.tensor(name, dims, GgmlType::F32, data)
    }

    /// The file's bytes: header, metadata, tensor infos, then each tensor at its aligned offset.
    pub fn build(&self) -> Vec<u8> {
        let mut out = Vec::new();
        out.extend_from_slice(b"GGUF");
        out.extend_from_slice(&self.version.to_le_bytes());
        out.extend_from_slice(&(self.tensors.len() as u64).to_le_bytes());
        out.extend_from_slice(&(self.metadata.len() as u64).to_le_bytes());
        for (key, value) in &self.metadata {
            write_string(&mut out, key);
            out.extend_from_slice(&type_id(value).to_le_bytes());
            write_value(&mut out, value);
        }
        let mut offset = 0usize;
        let mut offsets = Vec::new();
        for (name, dims, ty, data) in &self.tensors {
            write_string(&mut out, name);
            out.extend_from_slice(&(dims.len() as u32).to_le_bytes());
            for d in dims {
                out.extend_from_slice(&d.to_le_bytes());
            }
            out.extend_from_slice(&ty.id().to_le_bytes());
            out.extend_from_slice(&(offset as u64).to_le_bytes());
            offsets.push(offset);
            offset = (offset + data.len()).div_ceil(self.alignment) * self.alignment;
        }
        let data_start = out.len().div_ceil(self.alignment) * self.alignment;
        out.resize(data_start, 0);
        for ((_, _, _, data), off) in self.tensors.iter().zip(offsets) {
            out.resize(data_start + off, 0);
            out.extend_from_slice(data);
        }
        out
    }
}

fn write_string(out: &mut Vec<u8>, s: &str) {
    out.extend_from_slice(&(s.len() as u64).to_le_bytes());
    out.extend_from_slice(s.as_bytes());
}

fn type_id(v: &MetaValue) -> u32 {
    match v {
        MetaValue::U8(_) => 0,
        MetaValue::I8(_) => 1,
        MetaValue::U16(_) => 2,
        MetaValue::I16(_) => 3,
        MetaValue::U32(_) => 4,
        MetaValue::I32(_) => 5,
        MetaValue::F32(_) => 6,
        MetaValue::Bool(_) => 7,
        MetaValue::String(_) => 8,
        MetaValue::Array(_) => 9,
        MetaValue::U64(_) => 10,
        MetaValue::I64(_) => 11,
        MetaValue::F64(_) => 12,
    }
}

fn write_value(out: &mut Vec<u8>, v: &MetaValue) {
    match v {
        MetaValue::U8(x) => out.push(*x),
        MetaValue::I8(x) => out.push(*x as u8),
        MetaValue::U16(x) => out.extend_from_slice(&x.to_le_bytes()),
        MetaValue::I16(x) => out.extend_from_slice(&x.to_le_bytes()),
        MetaValue::U32(x) => out.extend_from_slice(&x.to_le_bytes()),
        MetaValue::I32(x) => out.extend_from_slice(&x.to_le_bytes()),
        MetaValue::U64(x) => out.extend_from_slice(&x.to_le_bytes()),
        MetaValue::I64(x) => out.extend_from_slice(&x.to_le_bytes()),
        MetaValue::F32(x) => out.extend_from_slice(&x.to_le_bytes()),
        MetaValue::F64(x) => out.extend_from_slice(&x.to_le_bytes()),
        MetaValue::Bool(x) => out.push(*x as u8),
        MetaValue::String(s) => write_string(out, s),
        MetaValue::Array(items) => {
            // An empty array's element type is arbitrary; u8 keeps it readable.
            let element_type = items.first().map_or(0, type_id);
            out.extend_from_slice(&element_type.to_le_bytes());
            out.extend_from_slice(&(items.len() as u64).to_le_bytes());
            for item in items {
                write_value(out, item);
            }
        }
    }
}

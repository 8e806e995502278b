//! The `.sieve` packed-model container: named, checksummed sections in one memory-mappable file.
//!
//! `sieve pack` writes one of these (config, tokenizer, packed weights, activation thresholds);
//! `sieve generate` and `sieve eval ppl` read it. This module knows nothing about models: it
//! stores bytes under names and refuses a file whose version, table or any section checksum is
//! wrong, so a truncated or tampered file never reaches the model.
//!
//! Layout (little-endian):
//! ```text
//! 0    8   magic b"SIEVEPAK"
//! 8    4   container version (PACK_VERSION)
//! 12   4   section count S
//! 16   8   table length T in bytes
//! 24   8   FNV-1a 64 of the table
//! 32   T   table: S entries of
//!            u16 name length, name (UTF-8), u16 kind, u64 offset, u64 length, u64 FNV-1a 64
//! ...      section data, each starting at a multiple of ALIGN from the file start
//! ```

use crate::error::{ModelError, Result};
use memmap2::Mmap;
use sieve_formats::blob::{fnv1a64, ByteReader};
use std::collections::HashMap;
use std::path::{Path, PathBuf};

pub const MAGIC: &[u8; 8] = b"SIEVEPAK";
pub const PACK_VERSION: u32 = 1;
/// Sections start on 64-byte boundaries so f32/f16 arrays inside can be viewed in place.
pub const ALIGN: usize = 64;
const HEADER_LEN: usize = 32;

/// What a section holds; readers use it to refuse a section of the wrong kind.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u16)]
pub enum SectionKind {
    /// UTF-8 JSON.
    Json = 1,
    /// A `sieve_formats` blob (`WeightFormat::to_bytes`).
    Weight = 2,
    /// Little-endian f32 array.
    F32 = 3,
    /// Opaque bytes (e.g. a tokenizer.json).
    Bytes = 4,
}

impl SectionKind {
    fn from_u16(v: u16) -> Option<Self> {
        [Self::Json, Self::Weight, Self::F32, Self::Bytes]
            .into_iter()
            .find(|k| *k as u16 == v)
    }
}

struct PendingSection {
    name: String,
    kind: SectionKind,
    data: Vec<u8>,
}

/// Collects sections in memory, then writes the file atomically (temp file + rename).
#[derive(Default)]
pub struct PackWriter {
    sections: Vec<PendingSection>,
}

impl PackWriter {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn add(&mut self, name: &str, kind: SectionKind, data: Vec<u8>) -> Result<()> {
        if name.is_empty() || name.len() > u16::MAX as usize {
            return Err(ModelError::InvalidArgument(format!(
                "section name must be 1..65535 bytes, got {}",
                name.len()
            )));
        }
        if self.sections.iter().any(|s| s.name == name) {
            return Err(ModelError::InvalidArgument(format!(
                "duplicate section '{name}'"
            )));
        }
        self.sections.push(PendingSection {
            name: name.to_string(),
            kind,
            data,
        });
        Ok(())
    }

    pub fn add_json<T: serde::Serialize>(&mut self, name: &str, value: &T) -> Result<()> {
        let data = serde_json::to_vec(value)
            .map_err(|e| ModelError::InvalidArgument(format!("section '{name}': {e}")))?;
        self.add(name, SectionKind::Json, data)
    }

    pub fn add_f32(&mut self, name: &str, values: &[f32]) -> Result<()> {
        let data = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        self.add(name, SectionKind::F32, data)
    }

    /// Serializes the whole container.
    pub fn to_bytes(&self) -> Vec<u8> {
        let table_len: usize = self
            .sections
            .iter()
            .map(|s| 2 + s.name.len() + 2 + 8 + 8 + 8)
            .sum();
        let mut offset = align_up(HEADER_LEN + table_len);
        let mut table = Vec::with_capacity(table_len);
        let mut offsets = Vec::with_capacity(self.sections.len());
        for s in &self.sections {
            table.extend_from_slice(&(s.name.len() as u16).to_le_bytes());
            table.extend_from_slice(s.name.as_bytes());
            table.extend_from_slice(&(s.kind as u16).to_le_bytes());
            table.extend_from_slice(&(offset as u64).to_le_bytes());
            table.extend_from_slice(&(s.data.len() as u64).to_le_bytes());
            table.extend_from_slice(&fnv1a64(&s.data).to_le_bytes());
            offsets.push(offset);
            offset = align_up(offset + s.data.len());
        }
        let mut out = Vec::with_capacity(offset);
        out.extend_from_slice(MAGIC);
        out.extend_from_slice(&PACK_VERSION.to_le_bytes());
        out.extend_from_slice(&(self.sections.len() as u32).to_le_bytes());
        out.extend_from_slice(&(table.len() as u64).to_le_bytes());
        out.extend_from_slice(&fnv1a64(&table).to_le_bytes());
        out.extend_from_slice(&table);
        for (s, off) in self.sections.iter().zip(offsets) {
            out.resize(off, 0);
            out.extend_from_slice(&s.data);
        }
        out
    }

    /// Writes the container to `path` via a temporary file in the same directory
    /// ([`crate::output::PendingOutput`], checked against no inputs).
    pub fn write(&self, path: &Path) -> Result<()> {
        self.write_to(crate::output::PendingOutput::create(path, &[])?)
    }

    /// Writes the container into an output created (and checked) before the work began.
    pub fn write_to(&self, out: crate::output::PendingOutput) -> Result<()> {
        out.commit(&self.to_bytes())
    }
}

fn align_up(v: usize) -> usize {
    v.div_ceil(ALIGN) * ALIGN
}

#[derive(Clone, Debug)]
struct SectionEntry {
    kind: SectionKind,
    offset: usize,
    len: usize,
}

enum Backing {
    Mapped(Mmap),
    Owned(Vec<u8>),
}

impl Backing {
    fn bytes(&self) -> &[u8] {
        match self {
            Backing::Mapped(m) => m,
            Backing::Owned(v) => v,
        }
    }
}

/// A validated `.sieve` file: every section's checksum was verified on open.
pub struct PackFile {
    path: PathBuf,
    backing: Backing,
    names: Vec<String>,
    sections: HashMap<String, SectionEntry>,
}

impl std::fmt::Debug for PackFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PackFile")
            .field("path", &self.path)
            .field("sections", &self.names)
            .finish()
    }
}

impl PackFile {
    /// Memory-maps and validates a `.sieve` file.
    pub fn open(path: &Path) -> Result<Self> {
        let file = crate::weights::open_regular(path)?;
        // SAFETY: the map is read-only; a concurrent writer could change the bytes under us, which
        // the checksums below catch at open time (and pack files are written via rename).
        let map = unsafe { Mmap::map(&file) }.map_err(|source| ModelError::Io {
            path: path.display().to_string(),
            source,
        })?;
        Self::parse(path.to_path_buf(), Backing::Mapped(map))
    }

    /// Validates a container held in memory (tests, fuzzing).
    pub fn from_bytes(bytes: Vec<u8>) -> Result<Self> {
        Self::parse(PathBuf::from("<memory>"), Backing::Owned(bytes))
    }

    fn parse(path: PathBuf, backing: Backing) -> Result<Self> {
        let p = path.display().to_string();
        let bad = |reason: String| ModelError::Malformed {
            path: p.clone(),
            reason,
        };
        let bytes = backing.bytes();
        let mut r = ByteReader::new(bytes);
        let fe = |e: sieve_formats::FormatError| bad(format!("header: {e}"));
        if r.bytes(8).map_err(fe)? != MAGIC {
            return Err(bad("not a .sieve file (bad magic)".into()));
        }
        let version = r.u32().map_err(fe)?;
        if version != PACK_VERSION {
            return Err(bad(format!(
                "container version {version}, this build reads version {PACK_VERSION}; re-run `sieve pack`"
            )));
        }
        let count = r.u32().map_err(fe)? as usize;
        let table_len = r.usize().map_err(fe)?;
        let table_sum = r.u64().map_err(fe)?;
        let table = r
            .bytes(table_len)
            .map_err(|e| bad(format!("section table truncated: {e}")))?;
        if fnv1a64(table) != table_sum {
            return Err(bad(
                "section table checksum mismatch (file corrupted)".into()
            ));
        }
        let mut t = ByteReader::new(table);
        let mut names = Vec::with_capacity(count.min(table_len / 28 + 1));
        let mut sections = HashMap::new();
        let te = |e: sieve_formats::FormatError| bad(format!("section table: {e}"));
        for _ in 0..count {
            let name_len = t.u16().map_err(te)? as usize;
            let name = std::str::from_utf8(t.bytes(name_len).map_err(te)?)
                .map_err(|_| bad("section name is not UTF-8".into()))?
                .to_string();
            let kind_raw = t.u16().map_err(te)?;
            let kind = SectionKind::from_u16(kind_raw)
                .ok_or_else(|| bad(format!("section '{name}' has unknown kind {kind_raw}")))?;
            let offset = t.usize().map_err(te)?;
            let len = t.usize().map_err(te)?;
            let sum = t.u64().map_err(te)?;
            let end = offset
                .checked_add(len)
                .filter(|&e| e <= bytes.len())
                .ok_or_else(|| {
                    bad(format!(
                        "section '{name}' ({len} bytes at {offset}) extends past the end of the file ({} bytes): truncated",
                        bytes.len()
                    ))
                })?;
            if fnv1a64(&bytes[offset..end]) != sum {
                return Err(bad(format!(
                    "section '{name}' checksum mismatch (file corrupted or tampered)"
                )));
            }
            if sections
                .insert(name.clone(), SectionEntry { kind, offset, len })
                .is_some()
            {
                return Err(bad(format!("duplicate section '{name}'")));
            }
            names.push(name);
        }
        t.finish().map_err(te)?;
        Ok(Self {
            path,
            backing,
            names,
            sections,
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Section names in file order.
    pub fn names(&self) -> &[String] {
        &self.names
    }

    pub fn contains(&self, name: &str) -> bool {
        self.sections.contains_key(name)
    }

    /// The bytes of section `name`, which must be of `kind`.
    pub fn section(&self, name: &str, kind: SectionKind) -> Result<&[u8]> {
        let e = self
            .sections
            .get(name)
            .ok_or_else(|| ModelError::Malformed {
                path: self.path.display().to_string(),
                reason: format!("missing section '{name}'"),
            })?;
        if e.kind != kind {
            return Err(ModelError::Malformed {
                path: self.path.display().to_string(),
                reason: format!("section '{name}' is {:?}, expected {kind:?}", e.kind),
            });
        }
        Ok(&self.backing.bytes()[e.offset..e.offset + e.len])
    }

    pub fn json<T: serde::de::DeserializeOwned>(&self, name: &str) -> Result<T> {
        serde_json::from_slice(self.section(name, SectionKind::Json)?).map_err(|e| {
            ModelError::Malformed {
                path: self.path.display().to_string(),
                reason: format!("section '{name}': {e}"),
            }
        })
    }

    pub fn f32s(&self, name: &str) -> Result<Vec<f32>> {
        let b = self.section(name, SectionKind::F32)?;
        if b.len() % 4 != 0 {
            return Err(ModelError::Malformed {
                path: self.path.display().to_string(),
                reason: format!("section '{name}' length {} is not a multiple of 4", b.len()),
            });
        }
        Ok(b.chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn sample() -> Vec<u8> {
        let mut w = PackWriter::new();
        w.add_json("config", &serde_json::json!({"layers": 2}))
            .unwrap();
        w.add_f32("norm", &[1.0, -2.5, 3.25]).unwrap();
        w.add("blob", SectionKind::Bytes, vec![7u8; 100]).unwrap();
        w.to_bytes()
    }

    #[test]
    fn round_trip_and_alignment() {
        let p = PackFile::from_bytes(sample()).unwrap();
        assert_eq!(p.names(), ["config", "norm", "blob"]);
        assert_eq!(p.f32s("norm").unwrap(), vec![1.0, -2.5, 3.25]);
        let v: serde_json::Value = p.json("config").unwrap();
        assert_eq!(v["layers"], 2);
        assert_eq!(
            p.section("blob", SectionKind::Bytes).unwrap(),
            &[7u8; 100][..]
        );
        let e = p.sections.values().map(|e| e.offset % ALIGN).max().unwrap();
        assert_eq!(e, 0, "every section starts aligned");
    }

    #[test]
    fn wrong_kind_and_missing_section_are_errors() {
        let p = PackFile::from_bytes(sample()).unwrap();
        assert!(p.section("norm", SectionKind::Json).is_err());
        assert!(p.section("absent", SectionKind::Json).is_err());
    }

    #[test]
    fn duplicate_names_refused() {
        let mut w = PackWriter::new();
        w.add("a", SectionKind::Bytes, vec![]).unwrap();
        assert!(w.add("a", SectionKind::Bytes, vec![]).is_err());
    }

    #[test]
    fn every_truncation_is_refused() {
        let bytes = sample();
        for cut in 0..bytes.len() {
            // Cutting only alignment padding after the last section would still be valid; the
            // last section here ends the file, so every cut loses data.
            let r = PackFile::from_bytes(bytes[..cut].to_vec());
            assert!(r.is_err(), "truncation to {cut} bytes accepted");
        }
    }

    #[test]
    fn tampering_with_a_section_is_detected() {
        let mut bytes = sample();
        let last = bytes.len() - 1;
        bytes[last] ^= 1;
        let err = PackFile::from_bytes(bytes).unwrap_err().to_string();
        assert!(err.contains("checksum"), "{err}");
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]
        #[test]
        fn bit_flips_never_panic(pos in any::<prop::sample::Index>(), bit in 0u8..8) {
            let mut bytes = sample();
            let i = pos.index(bytes.len());
            bytes[i] ^= 1 << bit;
            // Any flip outside alignment padding must be caught; none may panic.
            let _ = PackFile::from_bytes(bytes);
        }

        #[test]
        fn random_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
            let _ = PackFile::from_bytes(bytes);
        }
    }
}

//! Serialization helpers shared by every format: a framed, checksummed blob and bounds-checked
//! little-endian readers, so that a truncated or corrupted blob is an error, never a panic.
//!
//! Blob layout (little-endian):
//! ```text
//! offset  size  field
//! 0       8     magic  b"SIEVEFMT"
//! 8       4     blob version (BLOB_VERSION)
//! 12      2     format tag (FormatKind as u16)
//! 14      2     reserved, 0
//! 16      8     payload length in bytes
//! 24      8     FNV-1a 64 checksum of the payload
//! 32      ...   payload, written by the format's `write_payload`
//! ```

use crate::error::{FormatError, Result};
use half::f16;

pub const MAGIC: &[u8; 8] = b"SIEVEFMT";
pub const BLOB_VERSION: u32 = 1;
pub const HEADER_LEN: usize = 32;

/// FNV-1a, 64-bit. Not cryptographic: it detects truncation, bit flips and torn writes.
pub fn fnv1a64(bytes: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &b in bytes {
        h ^= b as u64;
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

/// Frames `payload` with the header above.
pub fn frame(tag: u16, payload: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(HEADER_LEN + payload.len());
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&BLOB_VERSION.to_le_bytes());
    out.extend_from_slice(&tag.to_le_bytes());
    out.extend_from_slice(&0u16.to_le_bytes());
    out.extend_from_slice(&(payload.len() as u64).to_le_bytes());
    out.extend_from_slice(&fnv1a64(payload).to_le_bytes());
    out.extend_from_slice(payload);
    out
}

/// Checks magic, version, length and checksum; returns the format tag and the payload.
pub fn unframe(blob: &[u8]) -> Result<(u16, &[u8])> {
    let mut r = ByteReader::new(blob);
    let magic = r.bytes(8)?;
    if magic != MAGIC {
        return Err(FormatError::Corrupt(
            "bad magic, not a sieve format blob".into(),
        ));
    }
    let version = r.u32()?;
    if version != BLOB_VERSION {
        return Err(FormatError::Version {
            found: version,
            supported: BLOB_VERSION,
        });
    }
    let tag = r.u16()?;
    let reserved = r.u16()?;
    if reserved != 0 {
        return Err(FormatError::Corrupt(format!(
            "reserved header field is {reserved}, expected 0"
        )));
    }
    let len = r.u64()?;
    let stored = r.u64()?;
    let len = usize::try_from(len)
        .map_err(|_| FormatError::Corrupt(format!("payload length {len} does not fit memory")))?;
    let payload = r.bytes(len)?;
    if r.remaining() != 0 {
        return Err(FormatError::Corrupt(format!(
            "{} trailing bytes after the payload",
            r.remaining()
        )));
    }
    let computed = fnv1a64(payload);
    if computed != stored {
        return Err(FormatError::Checksum { stored, computed });
    }
    Ok((tag, payload))
}

/// Appends little-endian scalars and slices.
#[derive(Default)]
pub struct ByteWriter {
    pub buf: Vec<u8>,
}

impl ByteWriter {
    pub fn new() -> Self {
        Self::default()
    }
    pub fn u8(&mut self, v: u8) {
        self.buf.push(v);
    }
    pub fn u16(&mut self, v: u16) {
        self.buf.extend_from_slice(&v.to_le_bytes());
    }
    pub fn u32(&mut self, v: u32) {
        self.buf.extend_from_slice(&v.to_le_bytes());
    }
    pub fn u64(&mut self, v: u64) {
        self.buf.extend_from_slice(&v.to_le_bytes());
    }
    pub fn f32(&mut self, v: f32) {
        self.buf.extend_from_slice(&v.to_le_bytes());
    }
    /// Length-prefixed (u64) byte slice.
    pub fn bytes(&mut self, v: &[u8]) {
        self.u64(v.len() as u64);
        self.buf.extend_from_slice(v);
    }
    /// Length-prefixed (u64 element count) slices of scalars.
    pub fn u16s(&mut self, v: &[u16]) {
        self.u64(v.len() as u64);
        v.iter().for_each(|&x| self.u16(x));
    }
    pub fn u32s(&mut self, v: &[u32]) {
        self.u64(v.len() as u64);
        v.iter().for_each(|&x| self.u32(x));
    }
    pub fn u64s(&mut self, v: &[u64]) {
        self.u64(v.len() as u64);
        v.iter().for_each(|&x| self.u64(x));
    }
    pub fn f16s(&mut self, v: &[f16]) {
        self.u64(v.len() as u64);
        v.iter().for_each(|&x| self.u16(x.to_bits()));
    }
    pub fn f32s(&mut self, v: &[f32]) {
        self.u64(v.len() as u64);
        v.iter().for_each(|&x| self.f32(x));
    }
    pub fn into_inner(self) -> Vec<u8> {
        self.buf
    }
}

/// Bounds-checked little-endian reader: every read past the end is [`FormatError::Truncated`].
pub struct ByteReader<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> ByteReader<'a> {
    pub fn new(buf: &'a [u8]) -> Self {
        Self { buf, pos: 0 }
    }
    pub fn remaining(&self) -> usize {
        self.buf.len() - self.pos
    }
    pub fn position(&self) -> usize {
        self.pos
    }
    pub fn bytes(&mut self, n: usize) -> Result<&'a [u8]> {
        if n > self.remaining() {
            return Err(FormatError::Truncated {
                offset: self.pos,
                needed: n,
                available: self.remaining(),
            });
        }
        let s = &self.buf[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }
    fn array<const N: usize>(&mut self) -> Result<[u8; N]> {
        let mut a = [0u8; N];
        a.copy_from_slice(self.bytes(N)?);
        Ok(a)
    }
    pub fn u8(&mut self) -> Result<u8> {
        Ok(self.array::<1>()?[0])
    }
    pub fn u16(&mut self) -> Result<u16> {
        Ok(u16::from_le_bytes(self.array()?))
    }
    pub fn u32(&mut self) -> Result<u32> {
        Ok(u32::from_le_bytes(self.array()?))
    }
    pub fn u64(&mut self) -> Result<u64> {
        Ok(u64::from_le_bytes(self.array()?))
    }
    pub fn f32(&mut self) -> Result<f32> {
        Ok(f32::from_le_bytes(self.array()?))
    }
    /// A u64 used as a size; refused if it cannot be a real size.
    pub fn usize(&mut self) -> Result<usize> {
        let v = self.u64()?;
        usize::try_from(v).map_err(|_| FormatError::Corrupt(format!("size {v} too large")))
    }
    /// Reads an element count and checks that `count * elem_size` bytes remain, before allocating.
    fn count(&mut self, elem_size: usize) -> Result<usize> {
        let n = self.usize()?;
        let bytes = n
            .checked_mul(elem_size)
            .ok_or_else(|| FormatError::Corrupt(format!("element count {n} overflows")))?;
        if bytes > self.remaining() {
            return Err(FormatError::Truncated {
                offset: self.pos,
                needed: bytes,
                available: self.remaining(),
            });
        }
        Ok(n)
    }
    pub fn byte_vec(&mut self) -> Result<Vec<u8>> {
        let n = self.count(1)?;
        Ok(self.bytes(n)?.to_vec())
    }
    pub fn u16s(&mut self) -> Result<Vec<u16>> {
        let n = self.count(2)?;
        (0..n).map(|_| self.u16()).collect()
    }
    pub fn u32s(&mut self) -> Result<Vec<u32>> {
        let n = self.count(4)?;
        (0..n).map(|_| self.u32()).collect()
    }
    pub fn u64s(&mut self) -> Result<Vec<u64>> {
        let n = self.count(8)?;
        (0..n).map(|_| self.u64()).collect()
    }
    pub fn f16s(&mut self) -> Result<Vec<f16>> {
        let n = self.count(2)?;
        (0..n).map(|_| self.u16().map(f16::from_bits)).collect()
    }
    pub fn f32s(&mut self) -> Result<Vec<f32>> {
        let n = self.count(4)?;
        (0..n).map(|_| self.f32()).collect()
    }
    /// Errors unless every byte was consumed.
    pub fn finish(&self) -> Result<()> {
        if self.remaining() != 0 {
            return Err(FormatError::Corrupt(format!(
                "{} unread bytes at the end of the payload",
                self.remaining()
            )));
        }
        Ok(())
    }
}

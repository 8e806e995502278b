//! Mutations: generic byte-level ones, and structure-aware ones that rewrite the numeric fields
//! (counts, lengths, offsets, type ids, dimensions) a format walker located.

use sieve_formats::random::SplitMix64;

/// Values that break size arithmetic: zero, one, powers of two at type boundaries, maxima.
pub const INTERESTING: [u64; 16] = [
    0,
    1,
    2,
    3,
    7,
    255,
    256,
    65535,
    65536,
    0x7fff_ffff,
    0x8000_0000,
    0xffff_ffff,
    1 << 32,
    1 << 60,
    0x7fff_ffff_ffff_ffff,
    u64::MAX,
];

/// What a numeric field means, so the mutator can prefer plausible wrong values.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FieldKind {
    Count,
    Length,
    Offset,
    TypeId,
    Dim,
    Value,
}

/// A little-endian integer field at `offset`, `width` bytes (1, 2, 4 or 8).
#[derive(Clone, Copy, Debug)]
pub struct Field {
    pub offset: usize,
    pub width: usize,
    pub kind: FieldKind,
}

pub struct Mutator {
    pub rng: SplitMix64,
}

impl Mutator {
    pub fn new(seed: u64) -> Self {
        Self {
            rng: SplitMix64::new(seed),
        }
    }

    pub fn below(&mut self, n: usize) -> usize {
        if n == 0 {
            0
        } else {
            self.rng.below(n)
        }
    }

    fn chance(&mut self, percent: usize) -> bool {
        self.below(100) < percent
    }

    /// A value for a field: interesting constants, off-by-one from the old value, the file
    /// length, or random.
    pub fn value(&mut self, old: u64, kind: FieldKind, file_len: usize) -> u64 {
        match self.below(6) {
            0 | 1 => INTERESTING[self.below(INTERESTING.len())],
            2 => old.wrapping_add(1 + self.below(4) as u64),
            3 => old.wrapping_sub(1 + self.below(4) as u64),
            4 => match kind {
                FieldKind::Offset | FieldKind::Length => {
                    (file_len as u64).wrapping_add(self.below(64) as u64)
                }
                FieldKind::TypeId => self.below(40) as u64,
                _ => old.wrapping_mul(1 + self.below(1 << 16) as u64),
            },
            _ => self.rng.next_u64(),
        }
    }

    /// Rewrites one located field.
    pub fn rewrite_field(&mut self, data: &mut [u8], fields: &[Field]) -> bool {
        if fields.is_empty() {
            return false;
        }
        let f = fields[self.below(fields.len())];
        if f.offset + f.width > data.len() {
            return false;
        }
        let slot = &mut data[f.offset..f.offset + f.width];
        let mut buf = [0u8; 8];
        buf[..f.width].copy_from_slice(slot);
        let old = u64::from_le_bytes(buf);
        let new = self.value(old, f.kind, data.len()).to_le_bytes();
        data[f.offset..f.offset + f.width].copy_from_slice(&new[..f.width]);
        true
    }

    /// One generic mutation; `other` is a second corpus input to splice from.
    pub fn generic(&mut self, data: &mut Vec<u8>, other: &[u8]) {
        let len = data.len();
        match self.below(9) {
            0 if len > 0 => {
                let i = self.below(len);
                data[i] ^= 1 << self.below(8);
            }
            1 if len > 0 => {
                let i = self.below(len);
                data[i] = self.rng.next_u64() as u8;
            }
            2 if len >= 8 => {
                let width = [2, 4, 8][self.below(3)];
                let i = self.below(len - width + 1);
                let v = INTERESTING[self.below(INTERESTING.len())].to_le_bytes();
                data[i..i + width].copy_from_slice(&v[..width]);
            }
            3 => data.truncate(self.below(len + 1)),
            4 => {
                let n = 1 + self.below(64);
                for _ in 0..n {
                    data.push(self.rng.next_u64() as u8);
                }
            }
            5 if len > 1 => {
                let a = self.below(len);
                let b = (a + 1 + self.below(64)).min(len);
                data.drain(a..b);
            }
            6 if len > 1 => {
                let a = self.below(len);
                let b = (a + 1 + self.below(64)).min(len);
                let chunk = data[a..b].to_vec();
                let at = self.below(len);
                data.splice(at..at, chunk);
            }
            7 if !other.is_empty() && len > 0 => {
                let cut = self.below(len);
                let from = self.below(other.len());
                data.truncate(cut);
                data.extend_from_slice(&other[from..]);
            }
            _ if len > 0 => {
                let i = self.below(len);
                data[i] = data[i].wrapping_add(1);
            }
            _ => data.push(0),
        }
    }

    /// Replaces one run of ASCII digits in `data[range]` (JSON text) by a hostile number.
    pub fn json_number(&mut self, data: &mut Vec<u8>, range: std::ops::Range<usize>) -> bool {
        let range = range.start.min(data.len())..range.end.min(data.len());
        let runs: Vec<(usize, usize)> = {
            let mut runs = Vec::new();
            let mut i = range.start;
            while i < range.end {
                if data[i].is_ascii_digit() {
                    let s = i;
                    while i < range.end && data[i].is_ascii_digit() {
                        i += 1;
                    }
                    runs.push((s, i));
                } else {
                    i += 1;
                }
            }
            runs
        };
        if runs.is_empty() {
            return false;
        }
        let (s, e) = runs[self.below(runs.len())];
        let text = match self.below(6) {
            0 => "0".to_string(),
            1 => "-1".to_string(),
            2 => "1e300".to_string(),
            3 => "18446744073709551616".to_string(),
            _ => INTERESTING[self.below(INTERESTING.len())].to_string(),
        };
        data.splice(s..e, text.into_bytes());
        true
    }

    /// 1 to 4 stacked mutations, about half of them structure-aware when `fields` is not empty.
    pub fn stack(
        &mut self,
        data: &mut Vec<u8>,
        other: &[u8],
        fields: &dyn Fn(&[u8]) -> Vec<Field>,
    ) {
        let n = 1 + self.below(4);
        for _ in 0..n {
            if self.chance(55) {
                let located = fields(data);
                if self.rewrite_field(data, &located) {
                    continue;
                }
            }
            self.generic(data, other);
        }
    }
}

//! Checked size arithmetic: the one place where counts that come from a file or a flag become
//! allocation sizes.
//!
//! A count read from a model file (layers, rows, vocabulary) or given on the command line
//! (`--rows`, `--ctx`) is untrusted: multiplied unchecked it wraps (and then sizes a buffer too
//! small, or indexes past one), and passed to `vec!` it aborts the process when the allocator
//! refuses. Callers go through [`product`] to multiply, [`at_most`] to hold a count to a stated
//! limit, and [`zeroed_f32s`] to allocate a large buffer that may not fit, so each of these is
//! an error naming what was being sized.

use crate::error::{FormatError, Result};

/// The product of `factors`, or [`FormatError::Size`] naming `what` when it overflows `usize`.
pub fn product(what: &str, factors: &[usize]) -> Result<usize> {
    factors
        .iter()
        .try_fold(1usize, |acc, &f| acc.checked_mul(f))
        .ok_or_else(|| {
            FormatError::Size(format!(
                "{what}: {} overflows the address space",
                factors
                    .iter()
                    .map(usize::to_string)
                    .collect::<Vec<_>>()
                    .join(" x ")
            ))
        })
}

/// The bytes `count` elements of `T` occupy, checked.
pub fn bytes_of<T>(what: &str, count: usize) -> Result<usize> {
    product(what, &[count, std::mem::size_of::<T>()])
}

/// `value` when it is at most `limit`, else [`FormatError::Size`] stating the limit.
pub fn at_most(what: &str, value: usize, limit: usize) -> Result<usize> {
    if value > limit {
        return Err(FormatError::Size(format!(
            "{what} is {value}, above the limit of {limit}"
        )));
    }
    Ok(value)
}

/// A zero-filled `Vec<f32>` of `len` elements, or [`FormatError::Size`] when the size overflows
/// or the allocator refuses it (where `vec![0.0; len]` would abort the process). Zero pages come
/// from the allocator (`calloc`), so an unused tail costs no memory.
pub fn zeroed_f32s(what: &str, len: usize) -> Result<Vec<f32>> {
    if len == 0 {
        return Ok(Vec::new());
    }
    let bytes = bytes_of::<f32>(what, len)?;
    let layout = std::alloc::Layout::array::<f32>(len)
        .map_err(|_| FormatError::Size(format!("{what}: {bytes} bytes is not a valid size")))?;
    // SAFETY: `layout` has a non-zero size (len > 0); the pointer is checked for null; all-zero
    // bits are the f32 value 0.0, so every element is initialized; the Vec takes ownership with
    // the same length, capacity and layout the global allocator was asked for.
    unsafe {
        let ptr = std::alloc::alloc_zeroed(layout) as *mut f32;
        if ptr.is_null() {
            return Err(FormatError::Size(format!(
                "{what}: {bytes} bytes cannot be allocated"
            )));
        }
        Ok(Vec::from_raw_parts(ptr, len, len))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn product_checks_overflow_and_names_the_quantity() {
        assert_eq!(product("cache", &[3, 4, 5]).unwrap(), 60);
        assert_eq!(product("empty", &[]).unwrap(), 1);
        let err = product("rows x cols", &[1 << 63, 2])
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("rows x cols") && err.contains("overflows"),
            "{err}"
        );
        assert!(bytes_of::<f32>("kv", usize::MAX / 2).is_err());
        assert_eq!(bytes_of::<u16>("x", 10).unwrap(), 20);
    }

    #[test]
    fn at_most_states_the_limit() {
        assert_eq!(at_most("layers", 10, 10).unwrap(), 10);
        let err = at_most("layers", 11, 10).unwrap_err().to_string();
        assert!(err.contains("11") && err.contains("limit of 10"), "{err}");
    }

    #[test]
    fn zeroed_allocation_is_fallible() {
        let v = zeroed_f32s("small", 1000).unwrap();
        assert_eq!(v.len(), 1000);
        assert!(v.iter().all(|&x| x == 0.0));
        assert!(zeroed_f32s("none", 0).unwrap().is_empty());
        // 2^61 floats (8 EiB) overflow the byte count; 2^60 bytes no allocator grants.
        assert!(zeroed_f32s("huge", 1 << 62).is_err());
        assert!(zeroed_f32s("huge", 1 << 58).is_err());
    }
}

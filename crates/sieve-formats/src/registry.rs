//! Dispatch by [`FormatKind`]: encode with default options, and deserialize any blob.
//! Each format adds one arm to each function here.

use crate::blob::{self, ByteReader};
use crate::error::Result;
use crate::format::{FormatKind, WeightFormat};
use crate::matrix::DenseMatrix;

/// Encodes `w` in `kind` with that format's default options.
pub fn encode_default(kind: FormatKind, w: &DenseMatrix) -> Result<Box<dyn WeightFormat>> {
    Ok(match kind {
        FormatKind::Dense => Box::new(crate::dense::Dense::encode(w)?),
        FormatKind::IeBme => Box::new(crate::ie_bme::IeBme::encode(
            w,
            &crate::ie_bme::IeBmeOptions::default(),
        )?),
        FormatKind::RlcCsc => Box::new(crate::rlc_csc::RlcCsc::encode(
            w,
            &crate::rlc_csc::RlcCscOptions::default(),
        )?),
        FormatKind::TiledCbc => Box::new(crate::tiled_cbc::TiledCbc::encode(w)?),
        FormatKind::Slide => Box::new(crate::slide::Slide::encode(
            w,
            &crate::slide::SlideOptions::default(),
        )?),
        FormatKind::BalancedCbc => Box::new(crate::balanced_cbc::BalancedCbc::encode(w)?),
    })
}

/// Reads a blob written by [`WeightFormat::to_bytes`], checking its frame and checksum.
pub fn from_bytes(bytes: &[u8]) -> Result<Box<dyn WeightFormat>> {
    let (tag, payload) = blob::unframe(bytes)?;
    let kind = FormatKind::from_tag(tag)?;
    let mut r = ByteReader::new(payload);
    let w: Box<dyn WeightFormat> = match kind {
        FormatKind::Dense => Box::new(crate::dense::Dense::read_payload(&mut r)?),
        FormatKind::IeBme => Box::new(crate::ie_bme::IeBme::read_payload(&mut r)?),
        FormatKind::RlcCsc => Box::new(crate::rlc_csc::RlcCsc::read_payload(&mut r)?),
        FormatKind::TiledCbc => Box::new(crate::tiled_cbc::TiledCbc::read_payload(&mut r)?),
        FormatKind::Slide => Box::new(crate::slide::Slide::read_payload(&mut r)?),
        FormatKind::BalancedCbc => {
            Box::new(crate::balanced_cbc::BalancedCbc::read_payload(&mut r)?)
        }
    };
    r.finish()?;
    Ok(w)
}

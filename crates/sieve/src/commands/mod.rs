pub mod bench;
pub mod formats;

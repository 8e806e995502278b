pub mod bench;
pub mod bench_cpu;
pub mod eval;
pub mod formats;
pub mod generate;
pub mod model_path;
pub mod pack;
pub mod sim;

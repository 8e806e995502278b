//! A `.sieve` file from a model file (what `sieve pack` runs): the model pruned on calibration
//! text by the [`pipeline`](crate::pipeline), its TEAL thresholds, its LM head blocks and
//! tokenizer, and a [`Manifest`] saying how it was made, written through a temporary file.
//!
//! [`pack`] does every step in the order the command always has, so that every refusal comes
//! before any long work: the output is checked against the inputs (and its temporary file
//! created) before the model opens; the calibration shape is checked before the weights are
//! converted; the file is written only after pruning. The caller hears of each stage through
//! [`PackEvent`]s (to print, or to draw a progress bar) and gets the [`PipelineReport`] back.

use crate::methods::Method;
use crate::pattern::Pattern;
use crate::pipeline::{
    calibration_windows_from_file, check_calibration, prune_model, FormatChoice, PipelineOptions,
    PipelineReport, Progress, TealAllocation, ValueGrid,
};
use crate::sparsegpt::SparseGptOptions;
use crate::PruneError;
use serde::Serialize;
use sieve_model::generate::load_tokenizer;
use sieve_model::llama::Model;
use sieve_model::output::PendingOutput;
use sieve_model::packed::{
    add_head_blocks, add_model_sections, add_tokenizer_sections, HeadBlocks,
};
use sieve_model::packfile::PackWriter;
use sieve_model::weights::open_model;
use sieve_model::ModelError;
use std::path::{Path, PathBuf};
use thiserror::Error;

/// What to pack, already parsed and checked as options (`sieve pack`'s flags).
#[derive(Clone, Debug)]
pub struct PackOptions {
    /// The model file or directory to prune (not a pack).
    pub model: PathBuf,
    /// Calibration text.
    pub calib: PathBuf,
    /// The `.sieve` file to write.
    pub out: PathBuf,
    pub method: Method,
    pub pattern: Pattern,
    /// Weight sparsity per linear, in [0, 1).
    pub sp: f64,
    /// Target activation sparsity per linear input, in [0, 1) (0: no thresholds).
    pub dp: f64,
    pub format: FormatChoice,
    pub values: ValueGrid,
    /// The blocks a dense LM head is multiplied in when the pack is loaded.
    pub head: HeadBlocks,
    /// Calibration windows, and tokens per window.
    pub calib_samples: usize,
    pub calib_len: usize,
    /// Spread `dp` with TEAL's block-wise greedy allocation instead of every site at `dp`.
    pub teal_greedy: bool,
    /// Activation rows per input site kept for the dual-sparsity report.
    pub report_tokens: usize,
}

impl PackOptions {
    /// The pipeline's options for these (SparseGPT's defaults).
    pub fn pipeline_options(&self) -> PipelineOptions {
        PipelineOptions {
            method: self.method,
            pattern: self.pattern,
            sp: self.sp,
            dp: self.dp,
            format: self.format,
            sparsegpt: SparseGptOptions::default(),
            report_tokens: self.report_tokens,
            teal_allocation: if self.teal_greedy {
                TealAllocation::GREEDY_DEFAULT
            } else {
                TealAllocation::Uniform
            },
            values: self.values,
        }
    }
}

/// The stages of [`pack`], in order.
#[derive(Debug)]
pub enum PackEvent<'a> {
    /// A partial output left by a process that no longer runs was removed (before the model
    /// opens; once per file).
    StaleOutputRemoved(&'a Path),
    /// The calibration windows are cut (`windows` of `calib_len` tokens spread over the first
    /// `text_tokens` tokens of the text); pruning starts.
    Calibrated { windows: usize, text_tokens: usize },
    /// Pruning progress, from the pipeline.
    Progress(Progress<'a>),
    /// Pruning is done; the file is assembled and written.
    Pruned,
}

/// Why [`pack`] stopped: the model's or the pipeline's refusal, with the step it failed in
/// where that names a file. Each variant shows its cause as its `source()`, so a chain printer
/// shows `opening PATH: <cause>`.
#[derive(Debug, Error)]
pub enum PackError {
    #[error("opening {}", path.display())]
    Open {
        path: PathBuf,
        #[source]
        source: ModelError,
    },
    #[error("calibration windows from {}", path.display())]
    Calibration {
        path: PathBuf,
        #[source]
        source: PruneError,
    },
    #[error("writing {}", path.display())]
    Write {
        path: PathBuf,
        #[source]
        source: ModelError,
    },
    #[error(transparent)]
    Model(#[from] ModelError),
    #[error(transparent)]
    Prune(#[from] PruneError),
}

/// The `manifest` section of a pack: how the file was made (JSON, in this field order).
#[derive(Clone, Debug, Serialize)]
pub struct Manifest<'a> {
    /// The model path as given (resolved), shown with `Path::display`.
    pub source_model: String,
    pub method: Method,
    pub pattern: String,
    pub sp: f64,
    pub dp: f64,
    pub teal_greedy: bool,
    pub format: String,
    pub values: ValueGrid,
    pub head: HeadBlocks,
    pub calibration: CalibrationManifest,
    /// The workspace version that wrote the file (every crate shares it).
    pub sieve_version: &'static str,
    pub report: &'a PipelineReport,
}

/// The calibration part of a [`Manifest`].
#[derive(Clone, Debug, Serialize)]
pub struct CalibrationManifest {
    pub text: String,
    pub samples: usize,
    pub len: usize,
    /// How the windows are placed in the text: `spread` over it
    /// ([`crate::calib::Placement::Spread`], what [`calibration_windows_from_file`] cuts).
    pub placement: &'static str,
    pub report_tokens: usize,
}

impl<'a> Manifest<'a> {
    pub fn new(options: &PackOptions, report: &'a PipelineReport) -> Self {
        Self {
            source_model: options.model.display().to_string(),
            method: options.method,
            pattern: options.pattern.to_string(),
            sp: options.sp,
            dp: options.dp,
            teal_greedy: options.teal_greedy,
            format: options.format.to_string(),
            values: options.values,
            head: options.head,
            calibration: CalibrationManifest {
                text: options.calib.display().to_string(),
                samples: options.calib_samples,
                len: options.calib_len,
                placement: "spread",
                report_tokens: options.report_tokens,
            },
            sieve_version: env!("CARGO_PKG_VERSION"),
            report,
        }
    }
}

/// Prunes `options.model` on `options.calib` and writes `options.out` (module docs), telling
/// `on_event` of each stage; returns the pipeline's report.
pub fn pack(
    options: &PackOptions,
    on_event: &mut dyn FnMut(PackEvent<'_>),
) -> Result<PipelineReport, PackError> {
    // Checked before any work: the output is not an input nor a non-file, its directory takes
    // files.
    let out = PendingOutput::create(&options.out, &[&options.model, &options.calib])?;
    for stale in out.stale_removed() {
        on_event(PackEvent::StaleOutputRemoved(stale));
    }
    let source = open_model(&options.model).map_err(|source| PackError::Open {
        path: options.model.clone(),
        source,
    })?;
    check_calibration(source.config(), options.calib_samples, options.calib_len)?;
    let tokenizer = load_tokenizer(source.as_ref())?;
    let mut model = Model::from_source_f16(source.as_ref())?;
    let (windows, text_tokens) = calibration_windows_from_file(
        &tokenizer,
        &options.calib,
        options.calib_samples,
        options.calib_len,
    )
    .map_err(|source| PackError::Calibration {
        path: options.calib.clone(),
        source,
    })?;
    on_event(PackEvent::Calibrated {
        windows: windows.len(),
        text_tokens,
    });
    let report = prune_model(
        &mut model,
        &windows,
        &options.pipeline_options(),
        &mut |p| on_event(PackEvent::Progress(p)),
    )?;
    on_event(PackEvent::Pruned);

    let mut writer = PackWriter::new();
    add_model_sections(&mut writer, &model)?;
    add_head_blocks(&mut writer, options.head)?;
    add_tokenizer_sections(&mut writer, source.as_ref())?;
    drop(source);
    writer.add_json("manifest", &Manifest::new(options, &report))?;
    writer.write_to(out).map_err(|source| PackError::Write {
        path: options.out.clone(),
        source,
    })?;
    Ok(report)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pipeline::StageSeconds;

    fn options() -> PackOptions {
        PackOptions {
            model: "models/m.gguf".into(),
            calib: "data/valid.txt".into(),
            out: "m.sieve".into(),
            method: Method::SparseGpt,
            pattern: Pattern::parse_with_sp("2:4", 0.5).unwrap(),
            sp: 0.5,
            dp: 0.4,
            format: "tiled-cbc".parse().unwrap(),
            values: ValueGrid::F16,
            head: "q4_1".parse().unwrap(),
            calib_samples: 2,
            calib_len: 64,
            teal_greedy: true,
            report_tokens: 2048,
        }
    }

    fn empty_report() -> PipelineReport {
        PipelineReport {
            linears: Vec::new(),
            static_ratio: 0.5,
            dynamic_ratio: 0.4,
            overlap: 0.2,
            total: 0.7,
            independent_total: 0.7,
            stored_bytes: 10,
            dense_bytes: 20,
            bytes_per_token: 8.0,
            product_seconds: None,
            threads: 2,
            calibration_tokens: 128,
            seconds: 1.5,
            stage_seconds: StageSeconds::default(),
        }
    }

    /// The manifest's fields, their order and spellings are what packs on disk carry.
    #[test]
    fn manifest_fields_in_order() {
        let options = options();
        let report = empty_report();
        let json = serde_json::to_string(&Manifest::new(&options, &report)).unwrap();
        let head = json.split(",\"report\":").next().unwrap();
        assert_eq!(
            head,
            format!(
                "{{\"source_model\":\"models/m.gguf\",\"method\":\"sparse-gpt\",\"pattern\":\"2:4\",\
                 \"sp\":0.5,\"dp\":0.4,\"teal_greedy\":true,\"format\":\"tiled-cbc\",\
                 \"values\":\"f16\",\"head\":\"q4_1\",\"calibration\":{{\"text\":\"data/valid.txt\",\
                 \"samples\":2,\"len\":64,\"placement\":\"spread\",\"report_tokens\":2048}},\
                 \"sieve_version\":\"{}\"",
                env!("CARGO_PKG_VERSION")
            )
        );
        assert!(json.ends_with(&format!(
            ",\"report\":{}}}",
            serde_json::to_string(&report).unwrap()
        )));
    }

    #[test]
    fn teal_allocation_follows_teal_greedy() {
        let mut options = options();
        assert!(matches!(
            options.pipeline_options().teal_allocation,
            TealAllocation::Greedy { .. }
        ));
        options.teal_greedy = false;
        let p = options.pipeline_options();
        assert!(matches!(p.teal_allocation, TealAllocation::Uniform));
        assert_eq!((p.method, p.sp, p.dp), (Method::SparseGpt, 0.5, 0.4));
    }

    /// The output is checked (and refused) before the model is opened: a missing model is
    /// not what the error names.
    #[test]
    fn output_is_checked_before_the_model_opens() {
        let mut options = options();
        options.model = "/nonexistent/model.gguf".into();
        options.out = "/nonexistent-dir/out.sieve".into();
        let mut events = 0;
        let err = pack(&options, &mut |_| events += 1).unwrap_err();
        assert!(matches!(err, PackError::Model(_)), "{err}");
        assert!(
            err.to_string()
                .contains("output /nonexistent-dir/out.sieve"),
            "{err}"
        );
        assert_eq!(events, 0);
    }
}

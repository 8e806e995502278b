//! The `--json` and `--plot` files of the long-running commands (`sieve bench kernels | decode |
//! cpu`, `sieve sim celty`): checked and created, as temporary files beside their targets, before
//! any work starts, so that a missing directory, a path naming a directory or one of the
//! command's inputs, a plot that is not `.svg`, or one path given for both fails in the first
//! second instead of after minutes of measurement. Each file is renamed into place when its
//! content is written ([`PendingOutput`]); one never written (an error on the way) is removed.

use anyhow::{bail, Result};
use sieve_model::output::PendingOutput;
use std::path::Path;

pub struct ReportFiles {
    json: Option<PendingOutput>,
    plot: Option<PendingOutput>,
}

impl ReportFiles {
    /// Opens the report files asked for; `inputs` are the command's input files, which an
    /// output may not name.
    pub fn open(json: Option<&Path>, plot: Option<&Path>, inputs: &[&Path]) -> Result<Self> {
        if let Some(p) = plot {
            if p.extension().and_then(|e| e.to_str()) != Some("svg") {
                bail!("--plot {} must name an .svg file", p.display());
            }
        }
        if let (Some(j), Some(p)) = (json, plot) {
            if std::path::absolute(j)? == std::path::absolute(p)? {
                bail!("--json and --plot both name {}", j.display());
            }
        }
        Ok(Self {
            json: json.map(|p| PendingOutput::create(p, inputs)).transpose()?,
            plot: plot.map(|p| PendingOutput::create(p, inputs)).transpose()?,
        })
    }

    /// Writes the JSON report (if asked for); `text` is only built then.
    pub fn write_json(&mut self, text: impl FnOnce() -> Result<String>) -> Result<()> {
        if let Some(out) = self.json.take() {
            let path = out.target().display().to_string();
            out.commit(text()?.as_bytes())?;
            println!("json: {path}");
        }
        Ok(())
    }

    /// Writes the SVG plot (if asked for); `svg` is only built then.
    pub fn write_plot(&mut self, svg: impl FnOnce() -> Result<String>) -> Result<()> {
        if let Some(out) = self.plot.take() {
            let path = out.target().display().to_string();
            out.commit(svg()?.as_bytes())?;
            println!("plot: {path}");
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bad_report_paths_are_refused_before_any_work() {
        let dir = std::env::temp_dir().join(format!("sieve-report-files-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let input = dir.join("model.gguf");
        std::fs::write(&input, b"model").unwrap();
        let err = |j: Option<&Path>, p: Option<&Path>| {
            ReportFiles::open(j, p, &[&input])
                .err()
                .map(|e| format!("{e:#}"))
                .unwrap_or_default()
        };
        let missing = dir.join("no/such/dir/r.json");
        assert!(
            err(Some(&missing), None).contains("cannot be used"),
            "{}",
            err(Some(&missing), None)
        );
        assert!(err(Some(&dir), None).contains("directory"));
        assert!(err(Some(&input), None).contains("is the input"));
        assert!(err(None, Some(&dir.join("p.png"))).contains(".svg"));
        let same = dir.join("r.svg");
        assert!(err(Some(&same), Some(&same)).contains("both name"));
        // Good paths: nothing appears at the targets until written; writing renames into place.
        let (j, p) = (dir.join("r.json"), dir.join("r2.svg"));
        let mut files = ReportFiles::open(Some(&j), Some(&p), &[&input]).unwrap();
        assert!(!j.exists() && !p.exists());
        files.write_json(|| Ok("{}".into())).unwrap();
        files.write_plot(|| Ok("<svg/>".into())).unwrap();
        assert_eq!(std::fs::read_to_string(&j).unwrap(), "{}");
        assert_eq!(std::fs::read_to_string(&p).unwrap(), "<svg/>");
        // Opened but never written (the work failed): the temporary files are gone.
        let k = dir.join("k.json");
        drop(ReportFiles::open(Some(&k), None, &[]).unwrap());
        let left: Vec<_> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|n| n.ends_with(".part"))
            .collect();
        assert!(left.is_empty(), "{left:?}");
        assert!(!k.exists());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

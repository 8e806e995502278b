//! Output files that never destroy an input: checked before any work starts, written to a
//! temporary file beside the target and renamed over it only when complete.
//!
//! [`PendingOutput::create`] refuses a target that ends in `/`, is a directory or anything
//! else that is not a regular file (a character device, a FIFO), or is the same file (same
//! device and inode, so through symlinks and hard links too) as one of the command's inputs; it
//! then creates the temporary file at once, so a missing directory, a read-only file system or
//! a permission problem fails in the first second, not after the work. The temporary file is
//! removed when the output is dropped without [`PendingOutput::commit`] (any error, a panic
//! that unwinds) and by a SIGINT/SIGTERM handler, which then lets the signal end the process.

use crate::error::{ModelError, Result};
use std::io::Write;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

/// An output file being produced: a temporary file that becomes `target` on commit.
#[derive(Debug)]
pub struct PendingOutput {
    target: PathBuf,
    tmp: PathBuf,
    file: Option<std::fs::File>,
    cleanup_slot: Option<usize>,
    stale_removed: Vec<PathBuf>,
}

/// Removes `.NAME.PID.part` files in `dir` (this target's temporary files) whose process is
/// gone, and returns them. A process is gone when `/proc/PID` does not exist while `/proc` is
/// mounted; where that cannot be told (no `/proc`), nothing is removed. A live process with a
/// reused PID keeps its file: it may be another sieve writing the same target.
fn remove_stale_parts(dir: &Path, file_name: &std::ffi::OsStr) -> Vec<PathBuf> {
    let proc = Path::new("/proc");
    if !proc.join("self").exists() {
        return Vec::new();
    }
    let mut prefix = String::from(".");
    let Some(name) = file_name.to_str() else {
        return Vec::new();
    };
    prefix.push_str(name);
    prefix.push('.');
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut removed = Vec::new();
    for entry in entries.flatten() {
        let entry_name = entry.file_name();
        let Some(pid) = entry_name
            .to_str()
            .and_then(|n| n.strip_prefix(prefix.as_str()))
            .and_then(|rest| rest.strip_suffix(".part"))
            .and_then(|pid| pid.parse::<u32>().ok())
        else {
            continue;
        };
        if pid == std::process::id() || proc.join(pid.to_string()).exists() {
            continue;
        }
        // Only plain files, never through a symlink.
        let path = entry.path();
        let is_file = std::fs::symlink_metadata(&path).is_ok_and(|m| m.file_type().is_file());
        if is_file && std::fs::remove_file(&path).is_ok() {
            removed.push(path);
        }
    }
    removed
}

fn refuse(target: &Path, reason: impl Into<String>) -> ModelError {
    ModelError::InvalidArgument(format!("output {}: {}", target.display(), reason.into()))
}

impl PendingOutput {
    /// Checks `target` against `inputs` (files, or directories whose files are all inputs) and
    /// creates the temporary file.
    pub fn create(target: &Path, inputs: &[&Path]) -> Result<Self> {
        let shown = target.as_os_str().to_string_lossy();
        if shown.is_empty() {
            return Err(refuse(target, "the path is empty"));
        }
        if shown.ends_with('/') {
            return Err(refuse(
                target,
                "ends in '/', so it names a directory; give a file name",
            ));
        }
        let file_name = target
            .file_name()
            .ok_or_else(|| refuse(target, "does not name a file"))?;
        match std::fs::metadata(target) {
            Ok(meta) if meta.is_file() => {
                for input in inputs {
                    if is_or_holds(input, &meta) {
                        return Err(refuse(
                            target,
                            format!(
                                "is the input {}; writing it would destroy it (choose another \
                                 --out)",
                                input.display()
                            ),
                        ));
                    }
                }
            }
            Ok(meta) => {
                return Err(refuse(
                    target,
                    format!(
                        "is {}; the output must be a regular file",
                        crate::weights::file_kind(&meta)
                    ),
                ))
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(source) => {
                return Err(ModelError::Io {
                    path: target.display().to_string(),
                    source,
                })
            }
        }
        let dir = match target.parent() {
            Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
            _ => PathBuf::from("."),
        };
        match std::fs::metadata(&dir) {
            Ok(m) if m.is_dir() => {}
            Ok(m) => {
                return Err(refuse(
                    target,
                    format!(
                        "its directory {} is {}",
                        dir.display(),
                        crate::weights::file_kind(&m)
                    ),
                ))
            }
            Err(e) => {
                return Err(refuse(
                    target,
                    format!("its directory {} cannot be used: {e}", dir.display()),
                ))
            }
        }
        let stale_removed = remove_stale_parts(&dir, file_name);
        let mut tmp_name = std::ffi::OsString::from(".");
        tmp_name.push(file_name);
        tmp_name.push(format!(".{}.part", std::process::id()));
        let tmp = dir.join(tmp_name);
        let file = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&tmp)
            .map_err(|e| {
                refuse(
                    target,
                    format!("cannot create a file in {}: {e}", dir.display()),
                )
            })?;
        let cleanup_slot = signal_cleanup::register(&tmp);
        Ok(Self {
            target: target.to_path_buf(),
            tmp,
            file: Some(file),
            cleanup_slot,
            stale_removed,
        })
    }

    /// Temporary files of this target left by processes that no longer run (a `kill -9`, a
    /// power cut), removed when this output was created.
    pub fn stale_removed(&self) -> &[PathBuf] {
        &self.stale_removed
    }

    pub fn target(&self) -> &Path {
        &self.target
    }

    /// The temporary file (removed unless committed).
    pub fn temporary(&self) -> &Path {
        &self.tmp
    }

    /// Writes `bytes`, syncs them and renames the temporary file over the target. On any error
    /// the temporary file is removed (a full disk is left as it was).
    pub fn commit(mut self, bytes: &[u8]) -> Result<()> {
        let io = |source| ModelError::Io {
            path: self.target.display().to_string(),
            source,
        };
        let mut file = self
            .file
            .take()
            .ok_or_else(|| refuse(&self.target, "already written"))?;
        file.write_all(bytes).map_err(io)?;
        file.sync_all().map_err(io)?;
        drop(file);
        std::fs::rename(&self.tmp, &self.target).map_err(io)?;
        if let Some(slot) = self.cleanup_slot.take() {
            signal_cleanup::unregister(slot);
        }
        self.tmp = PathBuf::new();
        Ok(())
    }
}

impl Drop for PendingOutput {
    fn drop(&mut self) {
        if let Some(slot) = self.cleanup_slot.take() {
            signal_cleanup::unregister(slot);
        }
        if !self.tmp.as_os_str().is_empty() {
            self.file.take();
            let _ = std::fs::remove_file(&self.tmp);
        }
    }
}

/// Whether `input` is the file `out` (same device and inode), or a directory directly holding it.
fn is_or_holds(input: &Path, out: &std::fs::Metadata) -> bool {
    let same = |m: &std::fs::Metadata| m.dev() == out.dev() && m.ino() == out.ino();
    match std::fs::metadata(input) {
        Ok(m) if m.is_dir() => std::fs::read_dir(input).is_ok_and(|entries| {
            entries
                .flatten()
                .any(|e| std::fs::metadata(e.path()).is_ok_and(|m| same(&m)))
        }),
        Ok(m) => same(&m),
        Err(_) => false,
    }
}

/// Removal of pending temporary files when SIGINT or SIGTERM arrives. The handler only calls
/// async-signal-safe functions (`unlink`, `signal`, `raise`) on paths stored beforehand as C
/// strings in a fixed table of atomics; it then restores the default action and re-raises, so
/// the process ends by the signal as it would have without the handler.
mod signal_cleanup {
    use std::ffi::{c_char, c_int, CString};
    use std::os::unix::ffi::OsStrExt;
    use std::path::Path;
    use std::sync::atomic::{AtomicPtr, Ordering};
    use std::sync::Once;

    const SLOTS: usize = 16;
    const SIGINT: c_int = 2;
    const SIGTERM: c_int = 15;
    const SIG_DFL: usize = 0;

    static PATHS: [AtomicPtr<c_char>; SLOTS] =
        [const { AtomicPtr::new(std::ptr::null_mut()) }; SLOTS];
    static INSTALL: Once = Once::new();

    extern "C" {
        fn signal(signum: c_int, handler: usize) -> usize;
        fn unlink(path: *const c_char) -> c_int;
        fn raise(sig: c_int) -> c_int;
    }

    extern "C" fn on_signal(sig: c_int) {
        for slot in &PATHS {
            let p = slot.load(Ordering::SeqCst);
            if !p.is_null() {
                // SAFETY: `p` is a leaked, NUL-terminated CString that is never freed.
                unsafe { unlink(p) };
            }
        }
        // SAFETY: restoring the default action and re-raising are async-signal-safe.
        unsafe {
            signal(sig, SIG_DFL);
            raise(sig);
        }
    }

    /// Registers `path` for removal on a signal; `None` when the table is full (the file is
    /// still removed on drop).
    pub fn register(path: &Path) -> Option<usize> {
        INSTALL.call_once(|| {
            let handler = on_signal as extern "C" fn(c_int) as usize;
            // SAFETY: `on_signal` has the C signature `signal` expects.
            unsafe {
                signal(SIGINT, handler);
                signal(SIGTERM, handler);
            }
        });
        let c = CString::new(path.as_os_str().as_bytes()).ok()?;
        // Leaked on purpose: a handler running on another thread may still read the pointer
        // after the slot is cleared, so it must stay valid for the life of the process.
        let ptr = c.into_raw();
        PATHS.iter().position(|slot| {
            slot.compare_exchange(
                std::ptr::null_mut(),
                ptr,
                Ordering::SeqCst,
                Ordering::SeqCst,
            )
            .is_ok()
        })
    }

    pub fn unregister(slot: usize) {
        PATHS[slot].store(std::ptr::null_mut(), Ordering::SeqCst);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    struct TempDir(PathBuf);
    impl TempDir {
        fn new(tag: &str) -> Self {
            let dir = std::env::temp_dir().join(format!("sieve-out-{tag}-{}", std::process::id()));
            let _ = std::fs::remove_dir_all(&dir);
            std::fs::create_dir_all(&dir).unwrap();
            TempDir(dir)
        }
    }
    impl Drop for TempDir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    fn entries(dir: &Path) -> Vec<String> {
        let mut v: Vec<String> = std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        v.sort();
        v
    }

    #[test]
    fn part_files_of_dead_processes_are_removed_at_the_next_start() {
        // Issue 30: `kill -9` during `sieve pack` left `.NAME.PID.part` behind for good.
        let d = TempDir::new("stale");
        let mut dead = std::process::Command::new("true").spawn().unwrap();
        dead.wait().unwrap();
        let mut live = std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .unwrap();
        let write = |name: String| {
            std::fs::write(d.0.join(name), b"partial").unwrap();
        };
        write(format!(".out.sieve.{}.part", dead.id()));
        write(format!(".out.sieve.{}.part", live.id()));
        write(format!(".other.sieve.{}.part", dead.id()));
        write(".out.sieve.notapid.part".into());
        let target = d.0.join("out.sieve");
        let out = PendingOutput::create(&target, &[]).unwrap();
        assert_eq!(
            out.stale_removed(),
            &[d.0.join(format!(".out.sieve.{}.part", dead.id()))]
        );
        let left = entries(&d.0);
        assert!(
            left.contains(&format!(".out.sieve.{}.part", live.id())),
            "{left:?}"
        );
        assert!(
            left.contains(&format!(".other.sieve.{}.part", dead.id())),
            "{left:?}"
        );
        assert!(
            left.contains(&".out.sieve.notapid.part".to_string()),
            "{left:?}"
        );
        assert!(
            !left.contains(&format!(".out.sieve.{}.part", dead.id())),
            "{left:?}"
        );
        drop(out);
        let _ = live.kill();
        let _ = live.wait();
    }

    #[test]
    fn an_input_is_never_an_output() {
        let d = TempDir::new("inputs");
        let model = d.0.join("model.gguf");
        let calib = d.0.join("calib.txt");
        std::fs::write(&model, b"GGUF model").unwrap();
        std::fs::write(&calib, b"text").unwrap();
        let link = d.0.join("link.sieve");
        std::os::unix::fs::symlink(&model, &link).unwrap();
        let hard = d.0.join("hard.sieve");
        std::fs::hard_link(&calib, &hard).unwrap();
        for target in [&model, &calib, &link, &hard] {
            let err = PendingOutput::create(target, &[&model, &calib])
                .unwrap_err()
                .to_string();
            assert!(err.contains("is the input"), "{err}");
        }
        // A directory input covers the files in it.
        let inside = d.0.join("calib.txt");
        let err = PendingOutput::create(&inside, &[&d.0])
            .unwrap_err()
            .to_string();
        assert!(err.contains("is the input"), "{err}");
        assert_eq!(std::fs::read(&model).unwrap(), b"GGUF model");
        assert_eq!(std::fs::read(&calib).unwrap(), b"text");
    }

    #[test]
    fn non_regular_targets_and_bad_directories_are_refused_up_front() {
        let d = TempDir::new("kinds");
        let cases: [(PathBuf, &str); 5] = [
            (PathBuf::from("/dev/null"), "character device"),
            (d.0.clone(), "directory"),
            (
                PathBuf::from(format!("{}/", d.0.join("x").display())),
                "ends in '/'",
            ),
            (d.0.join("missing/out.sieve"), "cannot be used"),
            (PathBuf::from("/proc/self/out.sieve"), "cannot create"),
        ];
        for (target, want) in cases {
            let err = PendingOutput::create(&target, &[]).unwrap_err().to_string();
            assert!(err.contains(want), "{}: {err}", target.display());
        }
    }

    #[test]
    fn temporary_file_exists_during_work_and_never_after() {
        let d = TempDir::new("tmp");
        let target = d.0.join("out.sieve");
        let out = PendingOutput::create(&target, &[]).unwrap();
        assert!(out.temporary().is_file());
        assert_eq!(entries(&d.0).len(), 1);
        // An error before commit (dropping the output) removes the temporary file.
        drop(out);
        assert!(entries(&d.0).is_empty());
        std::fs::write(&target, b"old").unwrap();
        let out = PendingOutput::create(&target, &[]).unwrap();
        out.commit(b"new").unwrap();
        assert_eq!(std::fs::read(&target).unwrap(), b"new");
        assert_eq!(entries(&d.0), ["out.sieve"]);
    }
}

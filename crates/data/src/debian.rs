//! A real-text corpus from what every Debian system ships: the license texts under
//! `/usr/share/common-licenses/` and the packages' `/usr/share/doc/*/copyright` files, gathered
//! into one file with repeated paragraphs removed (most copyright files quote the same licenses).
//! Used by the Muon-versus-AdamW benchmark; the gathered text is not committed.

use anyhow::{bail, Context, Result};
use std::collections::HashSet;
use std::path::{Path, PathBuf};

/// What [`gather_debian_text`] did.
#[derive(Clone, Debug)]
pub struct GatherReport {
    pub files: usize,
    pub paragraphs_kept: usize,
    pub paragraphs_dropped: usize,
    /// Bytes written.
    pub bytes: usize,
}

/// The license and copyright files of this Debian system, sorted.
pub fn debian_text_files() -> Vec<PathBuf> {
    let mut files = Vec::new();
    if let Ok(rd) = std::fs::read_dir("/usr/share/common-licenses") {
        files.extend(rd.flatten().map(|e| e.path()).filter(|p| p.is_file()));
    }
    if let Ok(rd) = std::fs::read_dir("/usr/share/doc") {
        files.extend(
            rd.flatten()
                .map(|e| e.path().join("copyright"))
                .filter(|p| p.is_file()),
        );
    }
    files.sort();
    files
}

/// Concatenate `files`, keeping the first occurrence of each paragraph (blank-line separated,
/// compared with surrounding whitespace trimmed). Unreadable files are skipped; invalid UTF-8 is
/// replaced.
pub fn gather_dedup(files: &[PathBuf]) -> (String, GatherReport) {
    let mut seen = HashSet::new();
    let mut out = String::new();
    let (mut read, mut kept, mut dropped) = (0, 0, 0);
    for f in files {
        let Ok(bytes) = std::fs::read(f) else {
            continue;
        };
        read += 1;
        let text = String::from_utf8_lossy(&bytes).replace("\r\n", "\n");
        for para in text.split("\n\n") {
            let p = para.trim_matches(|c: char| c == '\n' || c == ' ' || c == '\t');
            if p.is_empty() {
                continue;
            }
            if seen.insert(p.to_string()) {
                out.push_str(p);
                out.push_str("\n\n");
                kept += 1;
            } else {
                dropped += 1;
            }
        }
    }
    let bytes = out.len();
    (
        out,
        GatherReport {
            files: read,
            paragraphs_kept: kept,
            paragraphs_dropped: dropped,
            bytes,
        },
    )
}

/// Gather this machine's license and copyright texts into `out` (see the module docs).
pub fn gather_debian_text(out: &Path) -> Result<GatherReport> {
    let files = debian_text_files();
    if files.is_empty() {
        bail!("no /usr/share/common-licenses/* or /usr/share/doc/*/copyright files here (not Debian?)");
    }
    let (text, report) = gather_dedup(&files);
    std::fs::write(out, text).with_context(|| format!("cannot write {}", out.display()))?;
    Ok(report)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_util::TempDir;

    #[test]
    fn repeated_paragraphs_are_kept_once() {
        let dir = TempDir::new("debian");
        let a = dir.path().join("a");
        let b = dir.path().join("b");
        std::fs::write(&a, "Header A\n\nThe same license.\nLine two.\n\n").unwrap();
        std::fs::write(&b, "Header B\r\n\r\n  The same license.\nLine two.\n").unwrap();
        let (text, r) = gather_dedup(&[a, b, dir.path().join("missing")]);
        assert_eq!(
            text,
            "Header A\n\nThe same license.\nLine two.\n\nHeader B\n\n"
        );
        assert_eq!(
            (r.files, r.paragraphs_kept, r.paragraphs_dropped),
            (2, 3, 1)
        );
        assert_eq!(r.bytes, text.len());
    }
}

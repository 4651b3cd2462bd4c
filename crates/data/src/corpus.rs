//! Reading user text: a text file, a JSONL file (the `"text"` field of each line), or a folder of
//! `.txt`/`.jsonl` files (recursively, in path order).

use anyhow::{bail, Context, Result};
use std::path::{Path, PathBuf};

/// Documents read from a file or folder.
pub(crate) struct TextSource {
    pub docs: Vec<Vec<u8>>,
    pub files: usize,
}

fn is_jsonl(p: &Path) -> bool {
    p.extension()
        .is_some_and(|e| e.eq_ignore_ascii_case("jsonl"))
}

fn is_text_in_folder(p: &Path) -> bool {
    p.extension()
        .is_some_and(|e| e.eq_ignore_ascii_case("txt") || e.eq_ignore_ascii_case("jsonl"))
}

pub(crate) fn is_token_file(p: &Path) -> bool {
    p.extension().is_some_and(|e| e.eq_ignore_ascii_case("bin"))
}

/// The files a source path stands for: itself, or the `.txt`/`.jsonl` files under a folder,
/// sorted so the corpus does not depend on directory order.
pub(crate) fn source_files(path: &Path) -> Result<Vec<PathBuf>> {
    let meta = std::fs::metadata(path)
        .with_context(|| format!("cannot read {}: no such file or directory", path.display()))?;
    if !meta.is_dir() {
        return Ok(vec![path.to_path_buf()]);
    }
    let mut out = Vec::new();
    collect(path, &mut out)?;
    out.sort();
    if out.is_empty() {
        bail!("folder {} holds no .txt or .jsonl files", path.display());
    }
    Ok(out)
}

fn collect(dir: &Path, out: &mut Vec<PathBuf>) -> Result<()> {
    let entries =
        std::fs::read_dir(dir).with_context(|| format!("cannot list folder {}", dir.display()))?;
    for entry in entries {
        let entry = entry.with_context(|| format!("cannot list folder {}", dir.display()))?;
        let path = entry.path();
        let ty = entry
            .file_type()
            .with_context(|| format!("cannot stat {}", path.display()))?;
        // Follow links to files but not to folders, so a link cycle cannot loop forever.
        if ty.is_dir() {
            collect(&path, out)?;
        } else if (ty.is_file() || (ty.is_symlink() && path.is_file())) && is_text_in_folder(&path)
        {
            out.push(path);
        }
    }
    Ok(())
}

/// The `"text"` fields of a JSONL file; blank lines are skipped.
fn read_jsonl(path: &Path, bytes: &[u8]) -> Result<Vec<Vec<u8>>> {
    let mut docs = Vec::new();
    for (i, line) in bytes.split(|&b| b == b'\n').enumerate() {
        if line.iter().all(|b| b.is_ascii_whitespace()) {
            continue;
        }
        let v: serde_json::Value = serde_json::from_slice(line)
            .with_context(|| format!("{}:{}: invalid JSON", path.display(), i + 1))?;
        match v.get("text") {
            Some(serde_json::Value::String(s)) => docs.push(s.clone().into_bytes()),
            Some(_) => bail!(
                "{}:{}: field \"text\" is not a string",
                path.display(),
                i + 1
            ),
            None => bail!("{}:{}: no \"text\" field", path.display(), i + 1),
        }
    }
    Ok(docs)
}

/// Read the documents of a text file, a JSONL file, or a folder of them.
pub(crate) fn read_text_source(path: &Path) -> Result<TextSource> {
    let files = source_files(path)?;
    let mut docs = Vec::new();
    for f in &files {
        if is_token_file(f) {
            bail!(
                "{} is a token file (.bin); text is needed here",
                f.display()
            );
        }
        let bytes = std::fs::read(f).with_context(|| format!("cannot read {}", f.display()))?;
        if is_jsonl(f) {
            docs.extend(read_jsonl(f, &bytes)?);
        } else {
            docs.push(bytes);
        }
    }
    Ok(TextSource {
        docs,
        files: files.len(),
    })
}

/// Join documents into one text, with a blank line between documents (a document that already
/// ends in newlines gets only what is missing).
pub(crate) fn join_docs(docs: &[Vec<u8>]) -> Vec<u8> {
    let mut out = Vec::with_capacity(docs.iter().map(|d| d.len() + 2).sum());
    for (i, d) in docs.iter().enumerate() {
        if d.is_empty() {
            continue;
        }
        if i > 0 && !out.is_empty() {
            let trailing = out
                .iter()
                .rev()
                .take(2)
                .take_while(|&&b| b == b'\n')
                .count();
            out.extend(std::iter::repeat_n(b'\n', 2 - trailing));
        }
        out.extend_from_slice(d);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_util::TempDir;

    #[test]
    fn jsonl_text_fields_are_read_in_order() {
        let dir = TempDir::new("jsonl");
        let p = dir.path().join("d.jsonl");
        std::fs::write(
            &p,
            "{\"text\": \"one\"}\n\n{\"text\": \"two\", \"id\": 3}\n",
        )
        .unwrap();
        let s = read_text_source(&p).unwrap();
        assert_eq!(s.docs, vec![b"one".to_vec(), b"two".to_vec()]);
        assert_eq!(join_docs(&s.docs), b"one\n\ntwo");
    }

    #[test]
    fn bad_jsonl_names_file_and_line() {
        let dir = TempDir::new("jsonl-bad");
        let p = dir.path().join("bad.jsonl");
        std::fs::write(&p, "{\"text\": \"ok\"}\n{\"text\": \n").unwrap();
        let e = format!("{:#}", read_text_source(&p).err().unwrap());
        assert!(
            e.contains("bad.jsonl:2") && e.contains("invalid JSON"),
            "{e}"
        );

        std::fs::write(&p, "{\"text\": \"ok\"}\n{\"txt\": \"typo\"}\n").unwrap();
        let e = format!("{:#}", read_text_source(&p).err().unwrap());
        assert!(
            e.contains("bad.jsonl:2") && e.contains("no \"text\" field"),
            "{e}"
        );

        std::fs::write(&p, "{\"text\": 5}\n").unwrap();
        let e = format!("{:#}", read_text_source(&p).err().unwrap());
        assert!(
            e.contains("bad.jsonl:1") && e.contains("not a string"),
            "{e}"
        );
    }

    #[test]
    fn folders_are_read_recursively_in_path_order() {
        let dir = TempDir::new("folder");
        std::fs::create_dir_all(dir.path().join("sub")).unwrap();
        std::fs::write(dir.path().join("b.txt"), "bee\n").unwrap();
        std::fs::write(dir.path().join("a.txt"), "ay").unwrap();
        std::fs::write(dir.path().join("sub/c.jsonl"), "{\"text\":\"sea\"}\n").unwrap();
        std::fs::write(dir.path().join("ignored.md"), "no").unwrap();
        let s = read_text_source(dir.path()).unwrap();
        assert_eq!(s.files, 3);
        assert_eq!(join_docs(&s.docs), b"ay\n\nbee\n\nsea");
    }

    #[test]
    fn missing_paths_and_empty_folders_are_named() {
        let dir = TempDir::new("missing");
        let e = format!(
            "{:#}",
            read_text_source(&dir.path().join("nope.txt"))
                .err()
                .unwrap()
        );
        assert!(e.contains("nope.txt") && e.contains("no such file"), "{e}");
        let e = format!("{:#}", read_text_source(dir.path()).err().unwrap());
        assert!(e.contains("no .txt or .jsonl"), "{e}");
    }
}

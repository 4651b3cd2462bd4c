//! Documents streamed from raw inputs, for `data prepare`: text files (any name), JSONL (a named
//! field), parquet (a named string column), each optionally `.gz` or `.zst`, and folders of them.
//! Nothing is read whole except a plain text file, which is one document.

use anyhow::{anyhow, bail, Context, Result};
use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// How a file is read, from its name.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    Text,
    Jsonl,
    Parquet,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Compression {
    None,
    Gzip,
    Zstd,
}

/// The format and compression a file name says, e.g. `a.jsonl.gz` → (Jsonl, Gzip). A name
/// without a known extension is text.
pub fn classify(path: &Path) -> Result<(Format, Compression)> {
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().to_ascii_lowercase())
        .unwrap_or_default();
    let (stem, comp) = if let Some(s) = name.strip_suffix(".gz") {
        (s, Compression::Gzip)
    } else if let Some(s) = name.strip_suffix(".zst") {
        (s, Compression::Zstd)
    } else {
        (name.as_str(), Compression::None)
    };
    let ext = stem.rsplit_once('.').map(|(_, e)| e).unwrap_or("");
    let format = match ext {
        "jsonl" | "ndjson" => Format::Jsonl,
        "parquet" => Format::Parquet,
        "bin" | "idx" | "gtok" | "npy" => bail!(
            "{} looks like tokens, not text; give it to training as data.path (or a \
             [[data.sources]] path) instead of preparing it",
            path.display()
        ),
        _ => Format::Text,
    };
    if format == Format::Parquet && comp != Compression::None {
        bail!(
            "{}: parquet compresses inside the file; an outer .gz/.zst is not read",
            path.display()
        );
    }
    Ok((format, comp))
}

/// The files an input path stands for: itself, or every file under a folder (recursively,
/// sorted by path; hidden names starting with '.' skipped), so the order never depends on the
/// directory's.
pub fn input_files(path: &Path) -> Result<Vec<PathBuf>> {
    let meta = std::fs::metadata(path)
        .with_context(|| format!("cannot read {}: no such file or directory", path.display()))?;
    if !meta.is_dir() {
        classify(path)?;
        return Ok(vec![path.to_path_buf()]);
    }
    let mut out = Vec::new();
    walk(path, &mut out)?;
    out.sort();
    if out.is_empty() {
        bail!("folder {} holds no files", path.display());
    }
    for f in &out {
        classify(f)?;
    }
    Ok(out)
}

fn walk(dir: &Path, out: &mut Vec<PathBuf>) -> Result<()> {
    let entries =
        std::fs::read_dir(dir).with_context(|| format!("cannot list folder {}", dir.display()))?;
    for entry in entries {
        let entry = entry.with_context(|| format!("cannot list folder {}", dir.display()))?;
        let path = entry.path();
        if entry.file_name().to_string_lossy().starts_with('.') {
            continue;
        }
        let ty = entry
            .file_type()
            .with_context(|| format!("cannot stat {}", path.display()))?;
        // Links to files are followed, links to folders not (a cycle cannot loop).
        if ty.is_dir() {
            walk(&path, out)?;
        } else if ty.is_file() || (ty.is_symlink() && path.is_file()) {
            out.push(path);
        }
    }
    Ok(())
}

/// Counts the bytes read from a file (compressed bytes, for progress).
struct Counting<R> {
    inner: R,
    count: Arc<AtomicU64>,
}

impl<R: Read> Read for Counting<R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.count.fetch_add(n as u64, Ordering::Relaxed);
        Ok(n)
    }
}

fn open_stream(path: &Path, comp: Compression, count: &Arc<AtomicU64>) -> Result<Box<dyn Read>> {
    let file =
        std::fs::File::open(path).with_context(|| format!("cannot open {}", path.display()))?;
    let raw = Counting {
        inner: file,
        count: count.clone(),
    };
    Ok(match comp {
        Compression::None => Box::new(raw),
        Compression::Gzip => Box::new(flate2::read::MultiGzDecoder::new(BufReader::new(raw))),
        Compression::Zstd => Box::new(
            zstd::stream::read::Decoder::new(raw)
                .with_context(|| format!("{}: not a zstd stream", path.display()))?,
        ),
    })
}

/// One open file's documents.
enum Open {
    /// A text file: its one document, not yet read.
    Text(Option<Box<dyn Read>>),
    Jsonl {
        lines: BufReader<Box<dyn Read>>,
        line: usize,
    },
    Parquet(ParquetDocs),
}

/// The documents of a list of files, in order. Empty documents are skipped.
pub struct DocStream {
    files: Vec<PathBuf>,
    next_file: usize,
    open: Option<(PathBuf, Open)>,
    field: String,
    column: String,
    /// Compressed bytes read so far, over all files.
    pub bytes_read: Arc<AtomicU64>,
}

impl DocStream {
    pub fn new(files: Vec<PathBuf>, field: &str, column: &str) -> Self {
        Self {
            files,
            next_file: 0,
            open: None,
            field: field.to_string(),
            column: column.to_string(),
            bytes_read: Arc::new(AtomicU64::new(0)),
        }
    }

    /// The file the last document came from.
    pub fn current_file(&self) -> Option<&Path> {
        self.open.as_ref().map(|(p, _)| p.as_path())
    }

    /// The next non-empty document, or None at the end of the last file.
    pub fn next_doc(&mut self) -> Result<Option<Vec<u8>>> {
        loop {
            if self.open.is_none() {
                let Some(path) = self.files.get(self.next_file).cloned() else {
                    return Ok(None);
                };
                self.next_file += 1;
                let (format, comp) = classify(&path)?;
                let open = match format {
                    Format::Text => Open::Text(Some(open_stream(&path, comp, &self.bytes_read)?)),
                    Format::Jsonl => Open::Jsonl {
                        lines: BufReader::with_capacity(
                            1 << 20,
                            open_stream(&path, comp, &self.bytes_read)?,
                        ),
                        line: 0,
                    },
                    Format::Parquet => {
                        Open::Parquet(ParquetDocs::open(&path, &self.column, &self.bytes_read)?)
                    }
                };
                self.open = Some((path, open));
            }
            let (path, open) = self.open.as_mut().expect("opened above");
            let doc = match open {
                Open::Text(r) => match r.take() {
                    Some(mut r) => {
                        let mut buf = Vec::new();
                        r.read_to_end(&mut buf)
                            .with_context(|| format!("cannot read {}", path.display()))?;
                        Some(buf)
                    }
                    None => None,
                },
                Open::Jsonl { lines, line } => next_jsonl(path, lines, line, &self.field)?,
                Open::Parquet(p) => p.next_doc()?,
            };
            match doc {
                Some(d) if d.is_empty() => continue,
                Some(d) => return Ok(Some(d)),
                None => self.open = None,
            }
        }
    }
}

/// The next line's `field`, as bytes; blank lines are skipped.
fn next_jsonl(
    path: &Path,
    lines: &mut BufReader<Box<dyn Read>>,
    line: &mut usize,
    field: &str,
) -> Result<Option<Vec<u8>>> {
    let mut buf = Vec::new();
    loop {
        buf.clear();
        let n = lines
            .read_until(b'\n', &mut buf)
            .with_context(|| format!("cannot read {}", path.display()))?;
        if n == 0 {
            return Ok(None);
        }
        *line += 1;
        if buf.iter().all(|b| b.is_ascii_whitespace()) {
            continue;
        }
        let v: serde_json::Value = serde_json::from_slice(&buf)
            .with_context(|| format!("{}:{}: invalid JSON", path.display(), line))?;
        return match v.get(field) {
            Some(serde_json::Value::String(s)) => Ok(Some(s.clone().into_bytes())),
            Some(serde_json::Value::Null) => Ok(Some(Vec::new())),
            Some(_) => bail!(
                "{}:{}: field \"{field}\" is not a string",
                path.display(),
                line
            ),
            None => bail!(
                "{}:{}: no \"{field}\" field (choose another with --field)",
                path.display(),
                line
            ),
        };
    }
}

/// A parquet file's string column, read a row group at a time.
struct ParquetDocs {
    reader: parquet::file::serialized_reader::SerializedFileReader<std::fs::File>,
    path: PathBuf,
    column: usize,
    group: usize,
    values: std::vec::IntoIter<Vec<u8>>,
}

impl ParquetDocs {
    fn open(path: &Path, column: &str, count: &Arc<AtomicU64>) -> Result<Self> {
        use parquet::file::reader::FileReader;
        let file =
            std::fs::File::open(path).with_context(|| format!("cannot open {}", path.display()))?;
        // Progress counts a parquet file as read once it is opened (it is read by row groups
        // through seeks, not as one stream).
        count.fetch_add(
            file.metadata().map(|m| m.len()).unwrap_or(0),
            Ordering::Relaxed,
        );
        let reader = parquet::file::serialized_reader::SerializedFileReader::new(file)
            .map_err(|e| anyhow!("{}: not a readable parquet file: {e}", path.display()))?;
        let schema = reader.metadata().file_metadata().schema_descr();
        let names: Vec<String> = schema.columns().iter().map(|c| c.path().string()).collect();
        let Some(idx) = names.iter().position(|n| n == column) else {
            bail!(
                "{}: no column \"{column}\" (it has {}; choose one with --column)",
                path.display(),
                names.join(", ")
            );
        };
        let c = schema.column(idx);
        if c.physical_type() != parquet::basic::Type::BYTE_ARRAY || c.max_rep_level() != 0 {
            bail!(
                "{}: column \"{column}\" is not a plain string column",
                path.display()
            );
        }
        Ok(Self {
            reader,
            path: path.to_path_buf(),
            column: idx,
            group: 0,
            values: Vec::new().into_iter(),
        })
    }

    fn next_doc(&mut self) -> Result<Option<Vec<u8>>> {
        use parquet::column::reader::ColumnReader;
        use parquet::file::reader::FileReader;
        loop {
            if let Some(v) = self.values.next() {
                return Ok(Some(v));
            }
            if self.group >= self.reader.num_row_groups() {
                return Ok(None);
            }
            let err = |e: parquet::errors::ParquetError| {
                anyhow!("{}: row group {}: {e}", self.path.display(), self.group)
            };
            let rg = self.reader.get_row_group(self.group).map_err(err)?;
            let rows = rg.metadata().num_rows() as usize;
            let ColumnReader::ByteArrayColumnReader(mut r) =
                rg.get_column_reader(self.column).map_err(err)?
            else {
                bail!(
                    "{}: the text column is not a byte array",
                    self.path.display()
                );
            };
            let mut vals = Vec::with_capacity(rows);
            let mut defs = Vec::with_capacity(rows);
            let mut read = 0;
            while read < rows {
                let (recs, _, _) = r
                    .read_records(rows - read, Some(&mut defs), None, &mut vals)
                    .map_err(err)?;
                if recs == 0 {
                    break;
                }
                read += recs;
            }
            // Nulls have no value; they are empty documents, skipped like blank JSONL lines.
            self.values = vals
                .into_iter()
                .map(|b| b.data().to_vec())
                .collect::<Vec<_>>()
                .into_iter();
            self.group += 1;
        }
    }
}

/// Write `docs` as a parquet file with one required string column `column`, `per_group` rows to
/// a row group (for tests here and in other crates: corpora made by the tests, not downloaded).
pub fn write_text_parquet(
    path: &Path,
    column: &str,
    docs: &[&str],
    per_group: usize,
) -> Result<()> {
    use parquet::data_type::{ByteArray, ByteArrayType};
    use parquet::file::writer::SerializedFileWriter;
    let schema = parquet::schema::parser::parse_message_type(&format!(
        "message doc {{ REQUIRED BYTE_ARRAY {column} (UTF8); }}"
    ))?;
    let props = parquet::file::properties::WriterProperties::builder()
        .set_compression(parquet::basic::Compression::SNAPPY)
        .build();
    let file =
        std::fs::File::create(path).with_context(|| format!("cannot create {}", path.display()))?;
    let mut w = SerializedFileWriter::new(file, Arc::new(schema), Arc::new(props))?;
    for chunk in docs.chunks(per_group.max(1)) {
        let mut rg = w.next_row_group()?;
        let mut col = rg.next_column()?.expect("one column");
        let vals: Vec<ByteArray> = chunk
            .iter()
            .map(|d| ByteArray::from(d.as_bytes()))
            .collect();
        col.typed::<ByteArrayType>()
            .write_batch(&vals, None, None)?;
        col.close()?;
        rg.close()?;
    }
    w.close()?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_util::TempDir;
    use std::io::Write;

    fn all(files: Vec<PathBuf>) -> Vec<String> {
        let mut s = DocStream::new(files, "text", "text");
        let mut out = Vec::new();
        while let Some(d) = s.next_doc().unwrap() {
            out.push(String::from_utf8(d).unwrap());
        }
        out
    }

    #[test]
    fn every_format_and_compression_reads_the_same_documents() {
        let dir = TempDir::new("inputs");
        let p = dir.path();
        let docs = ["one", "two, with \"quotes\"\nand a newline", "三"];
        let jsonl: String = docs
            .iter()
            .map(|d| serde_json::json!({ "text": d, "id": 1 }).to_string() + "\n")
            .collect();
        std::fs::write(p.join("a.jsonl"), &jsonl).unwrap();
        let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
        gz.write_all(jsonl.as_bytes()).unwrap();
        std::fs::write(p.join("b.jsonl.gz"), gz.finish().unwrap()).unwrap();
        std::fs::write(
            p.join("c.jsonl.zst"),
            zstd::encode_all(jsonl.as_bytes(), 3).unwrap(),
        )
        .unwrap();
        write_text_parquet(&p.join("d.parquet"), "text", &docs, 2).unwrap();
        std::fs::write(p.join("e"), "no extension").unwrap();
        std::fs::write(p.join(".hidden"), "skipped").unwrap();
        let files = input_files(p).unwrap();
        assert_eq!(files.len(), 5);
        let got = all(files);
        let mut want: Vec<String> = Vec::new();
        for _ in 0..4 {
            want.extend(docs.iter().map(|d| d.to_string()));
        }
        want.push("no extension".into());
        assert_eq!(got, want);
    }

    #[test]
    fn bad_inputs_are_named() {
        let dir = TempDir::new("inputs-bad");
        let p = dir.path();
        std::fs::write(p.join("x.jsonl"), "{\"content\": \"a\"}\n").unwrap();
        let mut s = DocStream::new(vec![p.join("x.jsonl")], "text", "text");
        let e = format!("{:#}", s.next_doc().unwrap_err());
        assert!(e.contains("x.jsonl:1") && e.contains("--field"), "{e}");
        let mut s = DocStream::new(vec![p.join("x.jsonl")], "content", "text");
        assert_eq!(s.next_doc().unwrap().unwrap(), b"a");

        write_text_parquet(&p.join("y.parquet"), "body", &["a"], 1).unwrap();
        let mut s = DocStream::new(vec![p.join("y.parquet")], "text", "text");
        let e = format!("{:#}", s.next_doc().unwrap_err());
        assert!(
            e.contains("y.parquet") && e.contains("no column \"text\""),
            "{e}"
        );

        std::fs::write(p.join("t.bin"), [0u8; 8]).unwrap();
        let e = format!("{:#}", input_files(p).unwrap_err());
        assert!(e.contains("t.bin") && e.contains("tokens"), "{e}");

        std::fs::write(p.join("z.jsonl.zst"), b"not zstd").unwrap();
        let mut s = DocStream::new(vec![p.join("z.jsonl.zst")], "text", "text");
        assert!(s.next_doc().is_err());
    }
}

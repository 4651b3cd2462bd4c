//! Reading and writing safetensors files a piece at a time, for the Hugging Face import and the
//! sharded export: a file's header is parsed once, and elements are then read by range with
//! positioned reads (`pread`). Nothing is mapped or read whole, so a process holds one tensor (or
//! one range of one) at a time, and its resident memory does not grow with the file: pages of a
//! mapping would count towards it as they are touched.

use anyhow::{bail, Context, Result};
use serde_json::{json, Map, Value};
use std::collections::HashMap;
use std::fs::File;
use std::io::Write;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

/// Element types the import converts to f32 exactly.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Dtype {
    F32,
    Bf16,
    F16,
}

impl Dtype {
    pub fn size(self) -> usize {
        match self {
            Dtype::F32 => 4,
            Dtype::Bf16 | Dtype::F16 => 2,
        }
    }
}

/// One tensor's place in a file.
#[derive(Clone, Debug)]
pub struct Entry {
    pub dtype: Dtype,
    pub shape: Vec<usize>,
    /// Byte offset of its first element in the file.
    pub start: u64,
}

impl Entry {
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }
}

/// An open safetensors file and its header.
pub struct StFile {
    pub path: PathBuf,
    file: File,
    pub tensors: HashMap<String, Entry>,
}

impl StFile {
    /// Open `path` and parse its header; a header that does not describe the file (truncated,
    /// overlapping or out-of-range tensors, a dtype other than F32/BF16/F16) is an error naming
    /// the file and tensor.
    pub fn open(path: &Path) -> Result<Self> {
        let file = File::open(path).with_context(|| format!("cannot open {}", path.display()))?;
        let len = file
            .metadata()
            .with_context(|| format!("cannot stat {}", path.display()))?
            .len();
        let bad =
            |why: String| anyhow::anyhow!("{} is not a safetensors file: {why}", path.display());
        let mut n = [0u8; 8];
        file.read_exact_at(&mut n, 0)
            .map_err(|_| bad(format!("{len} bytes, shorter than its header length")))?;
        let n = u64::from_le_bytes(n);
        if n > len.saturating_sub(8) || n > 100 << 20 {
            return Err(bad(format!("header length {n} in a file of {len} bytes")));
        }
        let mut h = vec![0u8; n as usize];
        file.read_exact_at(&mut h, 8)
            .map_err(|e| bad(format!("cannot read the header: {e}")))?;
        let header: Map<String, Value> =
            serde_json::from_slice(&h).map_err(|e| bad(format!("header is not JSON: {e}")))?;
        let base = 8 + n;
        let mut tensors = HashMap::new();
        let mut spans = Vec::new();
        for (name, v) in header {
            if name == "__metadata__" {
                continue;
            }
            let dtype = match v["dtype"].as_str() {
                Some("F32") => Dtype::F32,
                Some("BF16") => Dtype::Bf16,
                Some("F16") => Dtype::F16,
                other => bail!(
                    "{}: tensor {name} has dtype {}; ganymede reads F32, BF16 and F16",
                    path.display(),
                    other.unwrap_or("(none)")
                ),
            };
            let shape: Vec<usize> = serde_json::from_value(v["shape"].clone())
                .map_err(|_| bad(format!("tensor {name} has no valid shape")))?;
            let off: [u64; 2] = serde_json::from_value(v["data_offsets"].clone())
                .map_err(|_| bad(format!("tensor {name} has no valid data_offsets")))?;
            let want = shape.iter().product::<usize>() as u64 * dtype.size() as u64;
            if off[1] < off[0] || off[1] - off[0] != want || base + off[1] > len {
                return Err(bad(format!(
                    "tensor {name} (shape {shape:?}) at bytes {}..{} of a {}-byte data section (truncated?)",
                    off[0],
                    off[1],
                    len - base
                )));
            }
            spans.push((off[0], off[1]));
            tensors.insert(
                name,
                Entry {
                    dtype,
                    shape,
                    start: base + off[0],
                },
            );
        }
        spans.sort_unstable();
        if spans.windows(2).any(|w| w[1].0 < w[0].1) {
            return Err(bad("tensors overlap".into()));
        }
        Ok(Self {
            path: path.to_path_buf(),
            file,
            tensors,
        })
    }

    /// Elements `lo..hi` of tensor `e` (flattened, row-major) as f32, appended to `out`.
    pub fn read_into(&self, e: &Entry, lo: usize, hi: usize, out: &mut Vec<f32>) -> Result<()> {
        debug_assert!(lo <= hi && hi <= e.numel());
        let sz = e.dtype.size();
        let mut buf = vec![0u8; (hi - lo) * sz];
        self.file
            .read_exact_at(&mut buf, e.start + (lo * sz) as u64)
            .with_context(|| format!("cannot read {}", self.path.display()))?;
        match e.dtype {
            Dtype::F32 => out.extend(
                buf.chunks_exact(4)
                    .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])),
            ),
            Dtype::Bf16 => out.extend(
                buf.chunks_exact(2)
                    .map(|c| f32::from_bits(u32::from(u16::from_le_bytes([c[0], c[1]])) << 16)),
            ),
            Dtype::F16 => out.extend(
                buf.chunks_exact(2)
                    .map(|c| f16_to_f32(u16::from_le_bytes([c[0], c[1]]))),
            ),
        }
        Ok(())
    }
}

/// IEEE half to single precision (exact: every f16 is an f32).
fn f16_to_f32(h: u16) -> f32 {
    let sign = u32::from(h >> 15) << 31;
    let exp = u32::from((h >> 10) & 0x1f);
    let man = u32::from(h & 0x3ff);
    let bits = match (exp, man) {
        (0, 0) => sign,
        (0, m) => {
            // Subnormal: normalise the mantissa.
            let shift = m.leading_zeros() - 21;
            let m = (m << shift) & 0x3ff;
            sign | ((127 - 15 + 1 - shift) << 23) | (m << 13)
        }
        (0x1f, m) => sign | (0xff << 23) | (m << 13),
        (e, m) => sign | ((e + 127 - 15) << 23) | (m << 13),
    };
    f32::from_bits(bits)
}

/// A safetensors file written tensor by tensor: the header (every name, shape and offset) is
/// written first from the plan, then each tensor's f32 data in plan order. Written to a sibling
/// temporary file and renamed into place by [`StWriter::finish`].
pub struct StWriter {
    path: PathBuf,
    tmp: PathBuf,
    out: std::io::BufWriter<File>,
    /// (name, elements) still to come, in order.
    pending: std::collections::VecDeque<(String, usize)>,
    written: usize,
}

impl StWriter {
    pub fn create(
        path: &Path,
        plan: &[(String, Vec<usize>)],
        metadata: &[(&str, &str)],
    ) -> Result<Self> {
        let mut header = Map::new();
        if !metadata.is_empty() {
            let m: Map<String, Value> = metadata
                .iter()
                .map(|(k, v)| (k.to_string(), json!(v)))
                .collect();
            header.insert("__metadata__".into(), Value::Object(m));
        }
        let mut off = 0u64;
        for (name, shape) in plan {
            let bytes = shape.iter().product::<usize>() as u64 * 4;
            header.insert(
                name.clone(),
                json!({ "dtype": "F32", "shape": shape, "data_offsets": [off, off + bytes] }),
            );
            off += bytes;
        }
        let mut h = serde_json::to_vec(&Value::Object(header))?;
        // Data starts 8-aligned, as the format asks (padded with spaces).
        while !h.len().is_multiple_of(8) {
            h.push(b' ');
        }
        let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("file");
        let tmp = path.with_file_name(format!(".{name}.tmp-{}", std::process::id()));
        let f = File::create(&tmp).with_context(|| format!("cannot create {}", tmp.display()))?;
        let mut out = std::io::BufWriter::with_capacity(1 << 20, f);
        out.write_all(&(h.len() as u64).to_le_bytes())?;
        out.write_all(&h)?;
        Ok(Self {
            path: path.to_path_buf(),
            tmp,
            out,
            pending: plan
                .iter()
                .map(|(n, s)| (n.clone(), s.iter().product()))
                .collect(),
            written: 0,
        })
    }

    /// Append `data`, the next tensor of the plan (or the next part of it).
    pub fn write(&mut self, data: &[f32]) -> Result<()> {
        let Some((name, numel)) = self.pending.front() else {
            bail!("{}: more data than planned", self.path.display());
        };
        if self.written + data.len() > *numel {
            bail!(
                "{}: tensor {name} is given too many elements",
                self.path.display()
            );
        }
        let mut bytes = Vec::with_capacity(data.len() * 4);
        for x in data {
            bytes.extend_from_slice(&x.to_le_bytes());
        }
        self.out
            .write_all(&bytes)
            .with_context(|| format!("cannot write {}", self.tmp.display()))?;
        self.written += data.len();
        if self.written == *numel {
            self.pending.pop_front();
            self.written = 0;
        }
        Ok(())
    }

    /// Flush, sync and rename into place; every planned tensor must have been written.
    pub fn finish(self) -> Result<()> {
        if let Some((name, _)) = self.pending.front() {
            bail!("{}: tensor {name} was not written", self.path.display());
        }
        let f = self
            .out
            .into_inner()
            .map_err(|e| anyhow::anyhow!("cannot write {}: {}", self.tmp.display(), e.error()))?;
        f.sync_all()
            .with_context(|| format!("cannot sync {}", self.tmp.display()))?;
        std::fs::rename(&self.tmp, &self.path)
            .with_context(|| format!("cannot rename into {}", self.path.display()))?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn half_precision_converts_exactly() {
        // 1.0, -2.0, the largest f16, the smallest subnormal, a mid subnormal, infinity.
        let cases = [
            (0x3c00u16, 1.0f32),
            (0xc000, -2.0),
            (0x7bff, 65504.0),
            (0x0001, 2f32.powi(-24)),
            (0x0200, 2f32.powi(-15)),
            (0x7c00, f32::INFINITY),
        ];
        for (h, f) in cases {
            assert_eq!(f16_to_f32(h), f, "{h:#06x}");
        }
    }

    #[test]
    fn written_files_read_back_by_range_and_by_the_safetensors_crate() {
        let dir = std::env::temp_dir().join(format!("ganymede-stfile-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join("a.safetensors");
        let plan = vec![("x".to_string(), vec![2, 3]), ("y".to_string(), vec![5])];
        let mut w = StWriter::create(&p, &plan, &[("format", "pt")]).unwrap();
        w.write(&[1.0, 2.0, 3.0]).unwrap();
        w.write(&[4.0, 5.0, 6.0]).unwrap();
        assert!(w.write(&[0.0; 6]).is_err(), "y has five elements");
        let mut w = StWriter::create(&p, &plan, &[]).unwrap();
        w.write(&[1.0, 2.0, 3.0, 4.0, 5.0, 6.0]).unwrap();
        w.write(&[7.0, 8.0, 9.0, 10.0, 11.0]).unwrap();
        w.finish().unwrap();
        let bytes = std::fs::read(&p).unwrap();
        let all = ganymede_checkpoint::read_safetensors(&p).unwrap();
        assert_eq!(all["y"], (vec![5], vec![7.0, 8.0, 9.0, 10.0, 11.0]));
        let f = StFile::open(&p).unwrap();
        let mut out = vec![];
        f.read_into(&f.tensors["x"], 2, 5, &mut out).unwrap();
        f.read_into(&f.tensors["y"], 4, 5, &mut out).unwrap();
        assert_eq!(out, vec![3.0, 4.0, 5.0, 11.0]);
        // A truncated file is refused at open, naming it.
        std::fs::write(&p, &bytes[..bytes.len() - 4]).unwrap();
        let e = format!("{:#}", StFile::open(&p).err().unwrap());
        assert!(
            e.contains("a.safetensors") && e.contains("truncated"),
            "{e}"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

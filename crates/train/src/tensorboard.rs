//! TensorBoard event files, written directly: the TFRecord framing with its masked CRC32C, and
//! the few protobuf fields of an `Event` that scalars need. No crate and no protobuf compiler:
//! the format is three fields deep and stable since TensorFlow 1.
//!
//! A record is `u64 length (LE) | u32 masked CRC32C of the length bytes | data | u32 masked CRC32C
//! of the data`. The data is an `Event` (tensorflow/core/util/event.proto):
//! `wall_time` (1, double), `step` (2, int64), then `file_version` (3, string) for the first
//! event of a file or `summary` (5, Summary) with `value` (1, repeated Value) holding
//! `tag` (1, string) and `simple_value` (2, float).

use anyhow::{Context, Result};
use std::fs;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

/// CRC32C (Castagnoli, reflected polynomial 0x82F63B78), the checksum TFRecord uses.
pub fn crc32c(data: &[u8]) -> u32 {
    const TABLE: [u32; 256] = {
        let mut t = [0u32; 256];
        let mut i = 0;
        while i < 256 {
            let mut c = i as u32;
            let mut k = 0;
            while k < 8 {
                c = if c & 1 != 0 {
                    (c >> 1) ^ 0x82F6_3B78
                } else {
                    c >> 1
                };
                k += 1;
            }
            t[i] = c;
            i += 1;
        }
        t
    };
    let mut crc = !0u32;
    for &b in data {
        crc = TABLE[((crc ^ b as u32) & 0xff) as usize] ^ (crc >> 8);
    }
    !crc
}

/// TFRecord's masking: a CRC stored next to data that may itself hold CRCs is rotated and offset
/// so that a checksum of checksums is not trivially zero.
pub fn masked_crc32c(data: &[u8]) -> u32 {
    let c = crc32c(data);
    c.rotate_right(15).wrapping_add(0xa282_ead8)
}

/// One TFRecord around `data`.
pub fn record(data: &[u8]) -> Vec<u8> {
    let len = (data.len() as u64).to_le_bytes();
    let mut r = Vec::with_capacity(data.len() + 16);
    r.extend_from_slice(&len);
    r.extend_from_slice(&masked_crc32c(&len).to_le_bytes());
    r.extend_from_slice(data);
    r.extend_from_slice(&masked_crc32c(data).to_le_bytes());
    r
}

fn varint(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push((v as u8) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

/// A length-delimited field (wire type 2).
fn bytes_field(out: &mut Vec<u8>, field: u32, data: &[u8]) {
    varint(out, ((field << 3) | 2) as u64);
    varint(out, data.len() as u64);
    out.extend_from_slice(data);
}

fn event_head(wall_time: f64, step: i64) -> Vec<u8> {
    let mut e = vec![(1 << 3) | 1]; // wall_time: 64-bit
    e.extend_from_slice(&wall_time.to_le_bytes());
    if step != 0 {
        varint(&mut e, 2 << 3); // step: varint (proto3 omits zero)
        varint(&mut e, step as u64);
    }
    e
}

/// `Event { wall_time, file_version: "brain.Event:2" }`, the first event of every file.
pub fn file_version_event(wall_time: f64) -> Vec<u8> {
    let mut e = event_head(wall_time, 0);
    bytes_field(&mut e, 3, b"brain.Event:2");
    e
}

/// `Event { wall_time, step, summary { value { tag, simple_value } ... } }`.
pub fn scalars_event(wall_time: f64, step: i64, scalars: &[(String, f32)]) -> Vec<u8> {
    let mut summary = vec![];
    for (tag, v) in scalars {
        let mut value = vec![];
        bytes_field(&mut value, 1, tag.as_bytes());
        value.push((2 << 3) | 5); // simple_value: 32-bit
        value.extend_from_slice(&v.to_le_bytes());
        bytes_field(&mut summary, 1, &value);
    }
    let mut e = event_head(wall_time, step);
    bytes_field(&mut e, 5, &summary);
    e
}

fn now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

/// An event file in `dir`, named as TensorBoard expects (`events.out.tfevents.<time>.<host>`).
pub struct EventWriter {
    path: PathBuf,
    file: BufWriter<fs::File>,
}

impl EventWriter {
    /// Create `dir` and a new event file in it. A resumed run gets a file of its own; TensorBoard
    /// reads every file in the directory.
    pub fn create(dir: &Path) -> Result<Self> {
        fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
        let t = now();
        let host = fs::read_to_string("/etc/hostname")
            .map(|h| h.trim().to_string())
            .unwrap_or_else(|_| "localhost".into());
        let path = dir.join(format!(
            "events.out.tfevents.{}.{host}.{}",
            t as u64,
            std::process::id()
        ));
        let file =
            fs::File::create(&path).with_context(|| format!("cannot create {}", path.display()))?;
        let mut w = EventWriter {
            path,
            file: BufWriter::new(file),
        };
        w.write_event(&file_version_event(t))?;
        Ok(w)
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    fn write_event(&mut self, event: &[u8]) -> Result<()> {
        self.file
            .write_all(&record(event))
            .and_then(|_| self.file.flush())
            .with_context(|| format!("cannot write {}", self.path.display()))
    }

    /// One event holding all `scalars` of `step`, flushed so a live TensorBoard sees it.
    pub fn scalars(&mut self, step: i64, scalars: &[(String, f32)]) -> Result<()> {
        self.write_event(&scalars_event(now(), step, scalars))
    }
}

/// The numeric leaves of a JSON metrics line as (tag, value): top-level numbers by their key,
/// arrays as `key/i`, objects as `key/sub`; `step` is the event's step, not a scalar.
pub fn scalars_of(line: &serde_json::Value) -> Vec<(String, f32)> {
    fn walk(prefix: &str, v: &serde_json::Value, out: &mut Vec<(String, f32)>) {
        match v {
            serde_json::Value::Number(n) => {
                if let Some(x) = n.as_f64() {
                    out.push((prefix.to_string(), x as f32));
                }
            }
            serde_json::Value::Array(a) => {
                for (i, x) in a.iter().enumerate() {
                    walk(&format!("{prefix}/{i}"), x, out);
                }
            }
            serde_json::Value::Object(o) => {
                for (k, x) in o {
                    let tag = if prefix.is_empty() {
                        k.clone()
                    } else {
                        format!("{prefix}/{k}")
                    };
                    if prefix.is_empty() && k == "step" {
                        continue;
                    }
                    walk(&tag, x, out);
                }
            }
            _ => {}
        }
    }
    let mut out = vec![];
    walk("", line, &mut out);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn crc32c_known_vectors() {
        // RFC 3720 (iSCSI) appendix B.4 and the common check value.
        assert_eq!(crc32c(b"123456789"), 0xE306_9283);
        assert_eq!(crc32c(&[0u8; 32]), 0x8A91_36AA);
        assert_eq!(crc32c(&[0xffu8; 32]), 0x62A8_AB43);
        let ascending: Vec<u8> = (0..32).collect();
        assert_eq!(crc32c(&ascending), 0x46DD_794E);
        assert_eq!(crc32c(b""), 0);
    }

    #[test]
    fn masking_matches_tfrecord() {
        // From TensorFlow's Python `masked_crc32c` (tensorboard.compat...tensorflow_stub),
        // computed independently of this code.
        assert_eq!(masked_crc32c(b"123456789"), 0xC78A_B0E5);
    }

    #[test]
    fn record_framing() {
        let r = record(b"abc");
        assert_eq!(r.len(), 8 + 4 + 3 + 4);
        assert_eq!(&r[..8], &3u64.to_le_bytes());
        assert_eq!(&r[8..12], &masked_crc32c(&3u64.to_le_bytes()).to_le_bytes());
        assert_eq!(&r[12..15], b"abc");
        assert_eq!(&r[15..], &masked_crc32c(b"abc").to_le_bytes());
    }

    #[test]
    fn event_protobuf_bytes() {
        // Event { wall_time: 1.5, step: 300, summary { value { tag: "loss", simple_value: 2.0 } } }
        // written out by hand from event.proto / summary.proto.
        let e = scalars_event(1.5, 300, &[("loss".into(), 2.0)]);
        let mut want = vec![0x09];
        want.extend_from_slice(&1.5f64.to_le_bytes());
        want.extend_from_slice(&[0x10, 0xac, 0x02]); // step 300 = 0b10_0101100
        want.extend_from_slice(&[0x2a, 13]); // summary, 13 bytes
        want.extend_from_slice(&[0x0a, 11]); // value: tag 6 + simple_value 5 bytes
        want.extend_from_slice(&[0x0a, 4, b'l', b'o', b's', b's']); // tag
        want.push(0x15); // simple_value, fixed32
        want.extend_from_slice(&2.0f32.to_le_bytes());
        assert_eq!(e, want);
        let v = file_version_event(0.0);
        let mut want = vec![0x09];
        want.extend_from_slice(&0.0f64.to_le_bytes());
        want.extend_from_slice(&[0x1a, 13]);
        want.extend_from_slice(b"brain.Event:2");
        assert_eq!(v, want);
    }

    #[test]
    fn scalars_of_a_metrics_line() {
        let line = serde_json::json!({
            "step": 3, "loss": 2.5, "load_cv": [0.1, 0.2], "comm": {"ag": 10}, "name": "x"
        });
        let mut s = scalars_of(&line);
        s.sort_by(|a, b| a.0.cmp(&b.0));
        let tags: Vec<&str> = s.iter().map(|(t, _)| t.as_str()).collect();
        assert_eq!(tags, ["comm/ag", "load_cv/0", "load_cv/1", "loss"]);
        assert_eq!(s[3].1, 2.5);
    }
}

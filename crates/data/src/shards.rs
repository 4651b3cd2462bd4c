//! Token shards: what `ganymede data prepare` writes and training memory-maps.
//!
//! One file holds a run of whole documents:
//!
//! ```text
//! 0   magic "GNYMTOK\0"      8 bytes
//! 8   version                u32 (1)
//! 12  token width            u32 (2: u16 ids, 4: u32 ids)
//! 16  tokens                 u64
//! 24  documents              u64
//! 32  tokenizer hash         u64 (FNV-1a of its tokenizer.json; 0 for bytes)
//! 40  end-of-document id     u64 (u64::MAX: none)
//! 48  vocabulary size        u64
//! 56  reserved               u64 (0)
//! 64  tokens                 width * tokens bytes, zero-padded to a multiple of 8
//! ..  document offsets       u64 * (documents + 1): document i is tokens [o[i], o[i+1])
//! ```
//!
//! Little-endian throughout. The header says everything a reader needs, so a shard can be
//! checked alone; the document index sits after the tokens so a writer can stream them.

use anyhow::{bail, Context, Result};
use memmap2::Mmap;
use std::io::{Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

pub const SHARD_MAGIC: &[u8; 8] = b"GNYMTOK\0";
pub const SHARD_VERSION: u32 = 1;
pub const SHARD_EXT: &str = "gtok";
const HEADER: usize = 64;
/// Header value for "no end-of-document token".
pub const NO_EOD: u64 = u64::MAX;

/// FNV-1a, 64 bits: a stable fingerprint (not a defence against tampering) of a tokenizer file;
/// the seam's one implementation, so a header's hash agrees with every other crate's.
pub use ganymede_core::fnv1a64;

/// Fields of a shard's header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ShardHeader {
    pub width: u32,
    pub tokens: u64,
    pub documents: u64,
    pub tokenizer_hash: u64,
    pub eod: Option<u32>,
    pub vocab_size: u64,
}

impl ShardHeader {
    fn encode(&self) -> [u8; HEADER] {
        let mut h = [0u8; HEADER];
        h[0..8].copy_from_slice(SHARD_MAGIC);
        h[8..12].copy_from_slice(&SHARD_VERSION.to_le_bytes());
        h[12..16].copy_from_slice(&self.width.to_le_bytes());
        h[16..24].copy_from_slice(&self.tokens.to_le_bytes());
        h[24..32].copy_from_slice(&self.documents.to_le_bytes());
        h[32..40].copy_from_slice(&self.tokenizer_hash.to_le_bytes());
        let eod = self.eod.map_or(NO_EOD, |e| e as u64);
        h[40..48].copy_from_slice(&eod.to_le_bytes());
        h[48..56].copy_from_slice(&self.vocab_size.to_le_bytes());
        h
    }

    fn decode(path: &Path, b: &[u8]) -> Result<Self> {
        let name = path.display();
        if b.len() < HEADER || &b[0..8] != SHARD_MAGIC {
            bail!("{name} is not a ganymede token shard (no GNYMTOK header)");
        }
        let u32_at = |o: usize| u32::from_le_bytes(b[o..o + 4].try_into().unwrap());
        let u64_at = |o: usize| u64::from_le_bytes(b[o..o + 8].try_into().unwrap());
        let version = u32_at(8);
        if version != SHARD_VERSION {
            bail!("{name}: shard format version {version}; this build reads {SHARD_VERSION}");
        }
        let width = u32_at(12);
        if width != 2 && width != 4 {
            bail!("{name}: token width {width} bytes; expected 2 or 4");
        }
        let eod = u64_at(40);
        Ok(Self {
            width,
            tokens: u64_at(16),
            documents: u64_at(24),
            tokenizer_hash: u64_at(32),
            eod: (eod != NO_EOD).then_some(eod as u32),
            vocab_size: u64_at(48),
        })
    }

    fn token_bytes_padded(&self) -> u64 {
        (self.tokens * self.width as u64).div_ceil(8) * 8
    }

    /// The file size this header implies.
    fn file_len(&self) -> u64 {
        HEADER as u64 + self.token_bytes_padded() + 8 * (self.documents + 1)
    }
}

/// The smallest token width that holds every id below `vocab_size`.
pub fn width_for(vocab_size: u64) -> u32 {
    if vocab_size <= 1 << 16 {
        2
    } else {
        4
    }
}

/// Writes one shard, streaming tokens to a temporary file renamed into place by [`finish`], so a
/// shard that exists is complete (an interrupted writer leaves only its `.tmp`).
///
/// [`finish`]: ShardWriter::finish
pub struct ShardWriter {
    file: std::io::BufWriter<std::fs::File>,
    tmp: PathBuf,
    path: PathBuf,
    header: ShardHeader,
    offsets: Vec<u64>,
}

impl ShardWriter {
    pub fn create(
        path: &Path,
        width: u32,
        tokenizer_hash: u64,
        eod: Option<u32>,
        vocab_size: u64,
    ) -> Result<Self> {
        let tmp = path.with_extension(format!("{SHARD_EXT}.tmp"));
        let mut file = std::io::BufWriter::with_capacity(
            1 << 20,
            std::fs::File::create(&tmp)
                .with_context(|| format!("cannot create {}", tmp.display()))?,
        );
        file.write_all(&[0u8; HEADER])
            .with_context(|| format!("cannot write {}", tmp.display()))?;
        Ok(Self {
            file,
            tmp,
            path: path.to_path_buf(),
            header: ShardHeader {
                width,
                tokens: 0,
                documents: 0,
                tokenizer_hash,
                eod,
                vocab_size,
            },
            offsets: vec![0],
        })
    }

    /// Append one document's ids (its end-of-document token, if any, already included).
    pub fn push_document(&mut self, ids: &[u32]) -> Result<()> {
        let w = self.header.width;
        let res = if w == 2 {
            let mut buf = Vec::with_capacity(ids.len() * 2);
            for &t in ids {
                let t = u16::try_from(t).map_err(|_| {
                    anyhow::anyhow!("token id {t} does not fit this shard's 2-byte ids")
                })?;
                buf.extend_from_slice(&t.to_le_bytes());
            }
            self.file.write_all(&buf)
        } else {
            self.file.write_all(bytemuck::cast_slice(ids))
        };
        res.with_context(|| format!("cannot write {}", self.tmp.display()))?;
        self.header.tokens += ids.len() as u64;
        self.header.documents += 1;
        self.offsets.push(self.header.tokens);
        Ok(())
    }

    pub fn tokens(&self) -> u64 {
        self.header.tokens
    }

    pub fn documents(&self) -> u64 {
        self.header.documents
    }

    /// Pad, write the index and the header, flush to disk and rename into place.
    pub fn finish(mut self) -> Result<ShardHeader> {
        let ctx = |p: &Path| format!("cannot write {}", p.display());
        let pad = self.header.token_bytes_padded() - self.header.tokens * self.header.width as u64;
        self.file
            .write_all(&vec![0u8; pad as usize])
            .with_context(|| ctx(&self.tmp))?;
        for o in &self.offsets {
            self.file
                .write_all(&o.to_le_bytes())
                .with_context(|| ctx(&self.tmp))?;
        }
        let mut f = self
            .file
            .into_inner()
            .map_err(|e| e.into_error())
            .with_context(|| ctx(&self.tmp))?;
        f.seek(SeekFrom::Start(0)).with_context(|| ctx(&self.tmp))?;
        f.write_all(&self.header.encode())
            .with_context(|| ctx(&self.tmp))?;
        f.sync_all().with_context(|| ctx(&self.tmp))?;
        drop(f);
        std::fs::rename(&self.tmp, &self.path).with_context(|| {
            format!(
                "cannot rename {} to {}",
                self.tmp.display(),
                self.path.display()
            )
        })?;
        Ok(self.header)
    }
}

/// Ids stored 2 or 4 bytes wide, read as u32.
#[derive(Clone, Copy)]
pub enum Ids<'a> {
    U16(&'a [u16]),
    U32(&'a [u32]),
}

impl Ids<'_> {
    pub fn len(&self) -> usize {
        match self {
            Ids::U16(s) => s.len(),
            Ids::U32(s) => s.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn get(&self, i: usize) -> u32 {
        match self {
            Ids::U16(s) => s[i] as u32,
            Ids::U32(s) => s[i],
        }
    }

    /// Append ids `range` to `out`, widened to u32.
    pub fn extend_into(&self, range: std::ops::Range<usize>, out: &mut Vec<u32>) {
        match self {
            Ids::U16(s) => out.extend(s[range].iter().map(|&t| t as u32)),
            Ids::U32(s) => out.extend_from_slice(&s[range]),
        }
    }
}

/// A memory-mapped shard.
pub struct Shard {
    map: Mmap,
    pub header: ShardHeader,
    path: PathBuf,
}

impl Shard {
    /// Map `path` and check that its length matches its header and its index is in order.
    pub fn open(path: &Path) -> Result<Self> {
        let file =
            std::fs::File::open(path).with_context(|| format!("cannot open {}", path.display()))?;
        // Safety: read-only map of a file we never write while reading (the usual mmap contract).
        let map = unsafe { Mmap::map(&file) }
            .with_context(|| format!("cannot map {}", path.display()))?;
        let header = ShardHeader::decode(path, &map)?;
        if map.len() as u64 != header.file_len() {
            bail!(
                "{}: {} bytes, but its header ({} tokens, {} documents) implies {} (truncated or \
                 damaged)",
                path.display(),
                map.len(),
                header.tokens,
                header.documents,
                header.file_len()
            );
        }
        let s = Self {
            map,
            header,
            path: path.to_path_buf(),
        };
        let o = s.offsets();
        if o.first() != Some(&0)
            || o.last() != Some(&header.tokens)
            || o.windows(2).any(|w| w[0] > w[1])
        {
            bail!("{}: its document index is out of order", path.display());
        }
        Ok(s)
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn ids(&self) -> Ids<'_> {
        let n = self.header.tokens as usize;
        let bytes = &self.map[HEADER..HEADER + n * self.header.width as usize];
        // The map is page-aligned and the header 64 bytes, so these casts are aligned.
        match self.header.width {
            2 => Ids::U16(bytemuck::cast_slice(bytes)),
            _ => Ids::U32(bytemuck::cast_slice(bytes)),
        }
    }

    /// Document start offsets and the total: `documents + 1` values.
    pub fn offsets(&self) -> &[u64] {
        let start = HEADER + self.header.token_bytes_padded() as usize;
        bytemuck::cast_slice(&self.map[start..])
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_util::TempDir;

    #[test]
    fn tokenizer_hash_is_fnv1a64_of_the_published_test_vectors() {
        // Shard headers written before the hash moved to the core crate keep their meaning:
        // the published FNV-1a 64 vectors.
        assert_eq!(fnv1a64(b""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(fnv1a64(b"a"), 0xaf63_dc4c_8601_ec8c);
        assert_eq!(fnv1a64(b"foobar"), 0x8594_4171_f739_67e8);
    }

    #[test]
    fn shards_round_trip_at_both_widths() {
        let dir = TempDir::new("shard-rt");
        for (width, big) in [(2u32, 65_535u32), (4, 1 << 20)] {
            let p = dir.path().join(format!("s{width}.{SHARD_EXT}"));
            let mut w = ShardWriter::create(&p, width, 77, Some(3), big as u64 + 1).unwrap();
            let docs: Vec<Vec<u32>> = vec![vec![1, 2, 3], vec![], vec![big, 0, 3], vec![9]];
            for d in &docs {
                w.push_document(d).unwrap();
            }
            let h = w.finish().unwrap();
            assert!(!p.with_extension(format!("{SHARD_EXT}.tmp")).exists());
            let s = Shard::open(&p).unwrap();
            assert_eq!(s.header, h);
            assert_eq!(
                (h.tokens, h.documents, h.eod, h.tokenizer_hash),
                (7, 4, Some(3), 77)
            );
            assert_eq!(s.offsets(), &[0, 3, 3, 6, 7]);
            let mut all = Vec::new();
            s.ids().extend_into(0..7, &mut all);
            assert_eq!(all, docs.concat());
        }
    }

    #[test]
    fn a_two_byte_shard_refuses_a_wide_id() {
        let dir = TempDir::new("shard-wide");
        let p = dir.path().join("s.gtok");
        let mut w = ShardWriter::create(&p, 2, 0, None, 70_000).unwrap();
        let e = format!("{:#}", w.push_document(&[65_536]).unwrap_err());
        assert!(e.contains("65536") && e.contains("2-byte"), "{e}");
    }

    #[test]
    fn damaged_shards_are_named() {
        let dir = TempDir::new("shard-bad");
        let p = dir.path().join("s.gtok");
        let mut w = ShardWriter::create(&p, 2, 0, None, 100).unwrap();
        w.push_document(&[1, 2, 3, 4, 5]).unwrap();
        w.finish().unwrap();
        let bytes = std::fs::read(&p).unwrap();

        std::fs::write(&p, &bytes[..bytes.len() - 3]).unwrap();
        let e = format!("{:#}", Shard::open(&p).err().unwrap());
        assert!(e.contains("s.gtok") && e.contains("truncated"), "{e}");

        let mut bad = bytes.clone();
        bad[0] = b'X';
        std::fs::write(&p, &bad).unwrap();
        let e = format!("{:#}", Shard::open(&p).err().unwrap());
        assert!(e.contains("not a ganymede token shard"), "{e}");

        // An index whose last offset disagrees with the token count.
        let mut bad = bytes.clone();
        let n = bad.len();
        bad[n - 8] = 9;
        std::fs::write(&p, &bad).unwrap();
        let e = format!("{:#}", Shard::open(&p).err().unwrap());
        assert!(e.contains("out of order"), "{e}");
    }
}

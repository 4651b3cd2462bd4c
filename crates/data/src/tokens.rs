//! Token files: flat little-endian u32 ids, no header, memory-mapped for reading.

use anyhow::{bail, Context, Result};
use memmap2::Mmap;
use std::io::Write;
use std::path::{Path, PathBuf};

/// A read-only, memory-mapped token file.
pub struct TokenFile {
    map: Option<Mmap>, // None for an empty file, which cannot be mapped
    path: PathBuf,
}

impl TokenFile {
    /// Map `path`. Its length must be a multiple of 4 bytes.
    pub fn open(path: &Path) -> Result<Self> {
        let file = std::fs::File::open(path)
            .with_context(|| format!("cannot open token file {}", path.display()))?;
        let len = file
            .metadata()
            .with_context(|| format!("cannot stat token file {}", path.display()))?
            .len();
        if len % 4 != 0 {
            bail!(
                "token file {} is {len} bytes, not a whole number of 4-byte little-endian u32 \
                 tokens (truncated?)",
                path.display()
            );
        }
        let map = if len == 0 {
            None
        } else {
            // Safety: the map is read-only; the file must not be truncated while we hold it,
            // which is the usual contract for memory-mapped inputs (we never write a file we read).
            Some(
                unsafe { Mmap::map(&file) }
                    .with_context(|| format!("cannot map {}", path.display()))?,
            )
        };
        Ok(Self {
            map,
            path: path.to_path_buf(),
        })
    }

    pub fn tokens(&self) -> &[u32] {
        match &self.map {
            // Maps are page-aligned, so the cast cannot fail on alignment; the length was checked.
            Some(m) => bytemuck::cast_slice(&m[..]),
            None => &[],
        }
    }

    pub fn len(&self) -> usize {
        self.tokens().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn path(&self) -> &Path {
        &self.path
    }
}

// The on-disk format is little-endian; a cast is only a decode on little-endian machines.
#[cfg(not(target_endian = "little"))]
compile_error!("token files are read by casting little-endian bytes; add a byte-swapping path");

/// Write `tokens` to `path` as little-endian u32s, through a temporary name and a rename so a
/// reader never sees a partial file.
pub fn write_tokens(path: &Path, tokens: &[u32]) -> Result<()> {
    let tmp = path.with_extension("bin.tmp");
    let mut f = std::io::BufWriter::new(
        std::fs::File::create(&tmp)
            .with_context(|| format!("cannot create token file {}", tmp.display()))?,
    );
    f.write_all(bytemuck::cast_slice(tokens))
        .and_then(|_| f.flush())
        .with_context(|| format!("cannot write token file {}", tmp.display()))?;
    drop(f);
    std::fs::rename(&tmp, path)
        .with_context(|| format!("cannot rename {} to {}", tmp.display(), path.display()))?;
    Ok(())
}

/// Check every id is below `vocab_size`; the error names the file and the first bad position.
pub fn check_ids(tokens: &[u32], vocab_size: usize, origin: &str) -> Result<()> {
    if let Some((i, &t)) = tokens
        .iter()
        .enumerate()
        .find(|(_, &t)| t as usize >= vocab_size)
    {
        bail!("{origin}: token {i} has id {t}, outside model.vocab_size = {vocab_size}");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_util::TempDir;

    #[test]
    fn write_then_map_round_trips() {
        let dir = TempDir::new("tokens");
        let p = dir.path().join("t.bin");
        let toks: Vec<u32> = (0..1000).map(|i| i * 7919 % 100_003).collect();
        write_tokens(&p, &toks).unwrap();
        assert_eq!(std::fs::metadata(&p).unwrap().len(), 4000);
        // Little-endian on disk, whatever the host.
        let raw = std::fs::read(&p).unwrap();
        assert_eq!(u32::from_le_bytes(raw[4..8].try_into().unwrap()), toks[1]);
        let f = TokenFile::open(&p).unwrap();
        assert_eq!(f.tokens(), &toks[..]);
    }

    #[test]
    fn empty_file_maps_to_no_tokens() {
        let dir = TempDir::new("tokens-empty");
        let p = dir.path().join("e.bin");
        write_tokens(&p, &[]).unwrap();
        assert!(TokenFile::open(&p).unwrap().is_empty());
    }

    #[test]
    fn truncated_and_missing_files_are_named() {
        let dir = TempDir::new("tokens-bad");
        let p = dir.path().join("odd.bin");
        std::fs::write(&p, [1u8, 2, 3, 4, 5, 6]).unwrap();
        let e = format!("{:#}", TokenFile::open(&p).err().unwrap());
        assert!(e.contains("odd.bin") && e.contains("truncated"), "{e}");
        let e = format!(
            "{:#}",
            TokenFile::open(&dir.path().join("nope.bin")).err().unwrap()
        );
        assert!(e.contains("nope.bin"), "{e}");
    }

    #[test]
    fn ids_outside_the_vocabulary_are_reported() {
        assert!(check_ids(&[1, 2, 255], 256, "x").is_ok());
        let e = check_ids(&[1, 256, 3], 256, "data.path = f.bin")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("f.bin") && e.contains("token 1") && e.contains("256"),
            "{e}"
        );
    }
}

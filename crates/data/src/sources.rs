//! Training from token files that are already prepared, memory-mapped and never copied:
//! ganymede's shards (`data prepare`), Megatron's indexed datasets (`.bin` + `.idx`) and llm.c's
//! shards (header magic 20240520).
//!
//! Each source is one token stream (its files in path order) with document boundaries. Its
//! validation split is its last whole documents; the rest is cut into training windows of
//! `seq_len + 1` tokens at a stride of `seq_len` (Megatron's packing: documents run across
//! windows, separated by their end-of-document tokens).
//!
//! Order is stateless: global sequence `g` (= step × batch + row) goes to a source by a fixed
//! binary split of the weights (exact shares, no random drift) and to a window of that source
//! by a keyed permutation per epoch, so every window is seen once per epoch, the batch at a step
//! is a function of `(seed, step)` alone, and no rank reads another rank's windows.

use crate::prepare::{Manifest, MANIFEST_FILE};
use crate::rng::{keyed, mix};
use crate::shards::{Ids, Shard, SHARD_EXT};
use anyhow::{bail, Context, Result};
use memmap2::Mmap;
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

/// Megatron's `.idx` magic.
const MEGATRON_MAGIC: &[u8; 9] = b"MMIDIDX\x00\x00";
/// llm.c's shard magic and header size (256 i32s).
const LLMC_MAGIC: u32 = 20240520;
const LLMC_HEADER: usize = 1024;

/// One memory-mapped file of a source.
enum Segment {
    Shard(Shard),
    /// Megatron or llm.c: tokens at `start` in the map, with document starts.
    Raw {
        map: Mmap,
        start: usize,
        len: usize,
        width: u32,
        docs: Vec<u64>,
    },
}

impl Segment {
    fn ids(&self) -> Ids<'_> {
        match self {
            Segment::Shard(s) => s.ids(),
            Segment::Raw {
                map,
                start,
                len,
                width,
                ..
            } => {
                let b = &map[*start..*start + len * *width as usize];
                if *width == 2 {
                    Ids::U16(bytemuck::cast_slice(b))
                } else {
                    Ids::U32(bytemuck::cast_slice(b))
                }
            }
        }
    }

    /// Document starts, beginning with 0, ending with the token count.
    fn docs(&self) -> &[u64] {
        match self {
            Segment::Shard(s) => s.offsets(),
            Segment::Raw { docs, .. } => docs,
        }
    }
}

/// Is `path` a token file this module reads (rather than text for the older in-run path)?
pub fn is_prepared(path: &Path) -> bool {
    if path.is_dir() {
        return path.join(MANIFEST_FILE).exists()
            || path
                .parent()
                .is_some_and(|p| p.join(MANIFEST_FILE).exists())
            || list_llmc(path).is_ok_and(|v| !v.is_empty());
    }
    is_megatron(path) || is_llmc(path) || path.extension().is_some_and(|e| e == SHARD_EXT)
}

fn is_megatron(p: &Path) -> bool {
    p.extension().is_some_and(|e| e == "bin") && p.with_extension("idx").exists()
}

fn is_llmc(p: &Path) -> bool {
    let mut head = [0u8; 4];
    p.extension().is_some_and(|e| e == "bin")
        && std::fs::File::open(p)
            .and_then(|mut f| std::io::Read::read_exact(&mut f, &mut head))
            .is_ok()
        && u32::from_le_bytes(head) == LLMC_MAGIC
}

fn list_llmc(dir: &Path) -> Result<Vec<PathBuf>> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(dir)?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| is_llmc(p))
        .collect();
    v.sort();
    Ok(v)
}

fn map(path: &Path) -> Result<Mmap> {
    let f = std::fs::File::open(path).with_context(|| format!("cannot open {}", path.display()))?;
    // Safety: read-only map of an input we never write (the usual mmap contract).
    unsafe { Mmap::map(&f) }.with_context(|| format!("cannot map {}", path.display()))
}

/// A Megatron indexed dataset: `.idx` (sequence lengths, byte pointers, document starts in
/// sequences) and `.bin` (the tokens).
fn open_megatron(bin: &Path) -> Result<Segment> {
    let idx_path = bin.with_extension("idx");
    let idx =
        std::fs::read(&idx_path).with_context(|| format!("cannot read {}", idx_path.display()))?;
    let name = idx_path.display();
    if idx.len() < 34 || &idx[..9] != MEGATRON_MAGIC {
        bail!("{name} is not a Megatron index (no MMIDIDX header)");
    }
    let u64_at = |o: usize| u64::from_le_bytes(idx[o..o + 8].try_into().unwrap());
    let version = u64_at(9);
    if version != 1 {
        bail!("{name}: Megatron index version {version}; this build reads 1");
    }
    let width = match idx[17] {
        8 => 2u32, // uint16
        4 => 4,    // int32
        c => bail!("{name}: token dtype code {c}; this build reads uint16 (8) and int32 (4)"),
    };
    let (n_seq, n_doc) = (u64_at(18) as usize, u64_at(26) as usize);
    let need = 34 + n_seq * 4 + n_seq * 8 + n_doc * 8;
    if idx.len() < need {
        bail!(
            "{name}: {} bytes, fewer than its {n_seq} sequences and {n_doc} document entries need",
            idx.len()
        );
    }
    let lens: Vec<u64> = (0..n_seq)
        .map(|i| u32::from_le_bytes(idx[34 + 4 * i..38 + 4 * i].try_into().unwrap()) as u64)
        .collect();
    let doc_at = 34 + n_seq * 12;
    let mut seq_start = vec![0u64; n_seq + 1];
    for i in 0..n_seq {
        seq_start[i + 1] = seq_start[i] + lens[i];
    }
    let mut docs: Vec<u64> = (0..n_doc)
        .map(|i| {
            let s = u64_at(doc_at + 8 * i) as usize;
            seq_start[s.min(n_seq)]
        })
        .collect();
    let total = seq_start[n_seq];
    if docs.first() != Some(&0) {
        docs.insert(0, 0);
    }
    if docs.last() != Some(&total) {
        docs.push(total);
    }
    docs.dedup();
    let m = map(bin)?;
    if (m.len() as u64) < total * width as u64 {
        bail!(
            "{}: {} bytes, but its index lists {total} tokens of {width} bytes (truncated?)",
            bin.display(),
            m.len()
        );
    }
    Ok(Segment::Raw {
        map: m,
        start: 0,
        len: total as usize,
        width,
        docs,
    })
}

/// An llm.c shard: 256 i32s of header (magic, version, token count), then the tokens (u16 in
/// version 1, GPT-2's; u32 in version 2, Llama 3's). llm.c puts a delimiter at the start of each
/// document: GPT-2's `<|endoftext|>` (50256), or Llama 3's `<|begin_of_text|>` (128000).
fn open_llmc(path: &Path) -> Result<Segment> {
    let m = map(path)?;
    let name = path.display();
    if m.len() < LLMC_HEADER {
        bail!("{name}: shorter than llm.c's 1024-byte header");
    }
    let h = |i: usize| u32::from_le_bytes(m[4 * i..4 * i + 4].try_into().unwrap());
    let (version, n) = (h(1), h(2) as usize);
    let width = match version {
        1 => 2u32,
        2 => 4,
        v => bail!("{name}: llm.c shard version {v}; this build reads 1 and 2"),
    };
    if m.len() != LLMC_HEADER + n * width as usize {
        bail!(
            "{name}: {} bytes, but its header says {n} tokens of {width} bytes (truncated?)",
            m.len()
        );
    }
    let mut seg = Segment::Raw {
        map: m,
        start: LLMC_HEADER,
        len: n,
        width,
        docs: Vec::new(),
    };
    // GPT-2's end-of-text closes the document before it (as Megatron treats an end-of-document
    // token); Llama 3's begin-of-text opens the one after it.
    let ids = seg.ids();
    let mut starts = vec![0u64];
    for i in 0..n {
        let t = ids.get(i);
        if version == 1 && t == 50256 && i + 1 < n {
            starts.push(i as u64 + 1);
        } else if version == 2 && t == 128000 && i > 0 {
            starts.push(i as u64);
        }
    }
    starts.push(n as u64);
    if let Segment::Raw { docs, .. } = &mut seg {
        *docs = starts;
    }
    Ok(seg)
}

/// Where a source's tokens are and what they are.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct SourceFile {
    pub path: String,
    pub bytes: u64,
}

/// One source: files as one token stream.
pub struct Source {
    pub name: String,
    segments: Vec<Segment>,
    /// Token offset of each segment in the stream, and the total last.
    seg_start: Vec<u64>,
    pub files: Vec<SourceFile>,
    /// The tokenizer hash the shards carry (ganymede shards only).
    pub tokenizer_hash: Option<u64>,
    pub vocab_size: Option<u64>,
}

impl Source {
    fn new(name: String, paths: Vec<PathBuf>) -> Result<Self> {
        let mut segments = Vec::new();
        let mut files = Vec::new();
        let mut tokenizer_hash = None;
        let mut vocab_size = None;
        for p in &paths {
            let seg = if p.extension().is_some_and(|e| e == SHARD_EXT) {
                let s = Shard::open(p)?;
                if *tokenizer_hash.get_or_insert(s.header.tokenizer_hash) != s.header.tokenizer_hash
                {
                    bail!(
                        "{}: made with another tokenizer than the files before it in source {name}",
                        p.display()
                    );
                }
                vocab_size = Some(vocab_size.unwrap_or(0).max(s.header.vocab_size));
                Segment::Shard(s)
            } else if is_megatron(p) {
                open_megatron(p)?
            } else if is_llmc(p) {
                open_llmc(p)?
            } else {
                bail!(
                    "{}: not a token shard, Megatron .bin/.idx pair or llm.c shard",
                    p.display()
                );
            };
            let bytes = std::fs::metadata(p)
                .with_context(|| format!("cannot stat {}", p.display()))?
                .len();
            files.push(SourceFile {
                path: p.display().to_string(),
                bytes,
            });
            segments.push(seg);
        }
        let mut seg_start = vec![0u64];
        for s in &segments {
            seg_start.push(seg_start.last().unwrap() + s.ids().len() as u64);
        }
        Ok(Self {
            name,
            segments,
            seg_start,
            files,
            tokenizer_hash,
            vocab_size,
        })
    }

    pub fn tokens(&self) -> u64 {
        *self.seg_start.last().unwrap()
    }

    /// Append stream tokens `[a, b)` to `out`, across files.
    pub fn extend(&self, a: u64, b: u64, out: &mut Vec<u32>) {
        let mut s = self.seg_start.partition_point(|&x| x <= a) - 1;
        let mut pos = a;
        while pos < b {
            let (lo, hi) = (self.seg_start[s], self.seg_start[s + 1]);
            let end = b.min(hi);
            self.segments[s]
                .ids()
                .extend_into((pos - lo) as usize..(end - lo) as usize, out);
            pos = end;
            s += 1;
        }
    }

    /// Document starts over the whole stream (0 first, total last).
    pub fn doc_starts(&self) -> Vec<u64> {
        let mut out = vec![0u64];
        for (s, seg) in self.segments.iter().enumerate() {
            let base = self.seg_start[s];
            out.extend(seg.docs().iter().skip(1).map(|&d| base + d));
        }
        out.dedup();
        out
    }

    /// For each of the `n` tokens at `a ..` of the stream, where its document starts within
    /// that window (0 for the window's first document, which may have begun before it): the
    /// input a document-masked step attends from. Binary searches of the document index, so
    /// the cost is the window's, not the stream's.
    pub fn window_doc_starts(&self, a: u64, n: usize, out: &mut Vec<u32>) {
        let b = a + n as u64;
        let mut bounds = Vec::new();
        let first = self.seg_start.partition_point(|&x| x <= a) - 1;
        for s in first..self.segments.len() {
            let base = self.seg_start[s];
            if base >= b {
                break;
            }
            let docs = self.segments[s].docs();
            let lo = docs.partition_point(|&d| base + d <= a);
            bounds.extend(docs[lo..].iter().map(|&d| base + d).take_while(|&d| d < b));
        }
        let mut next = bounds.iter().peekable();
        let mut cur = 0u32;
        for i in 0..n as u64 {
            while next.next_if(|&&d| d <= a + i).is_some() {
                cur = i as u32;
            }
            out.push(cur);
        }
    }

    /// The first token of the validation split: the start of the first document at or after
    /// `(1 - val_fraction)` of the stream; with one document, that token itself.
    pub fn val_start(&self, val_fraction: f64) -> u64 {
        let total = self.tokens();
        let want = ((total as f64) * (1.0 - val_fraction)).round() as u64;
        let docs = self.doc_starts();
        let i = docs.partition_point(|&d| d < want);
        match docs.get(i) {
            Some(&d) if d < total => d,
            // The last document holds the cut: hold it out whole, if it is not the only one.
            _ => match docs.iter().rev().find(|&&d| d > 0 && d < total) {
                Some(&d) => d,
                None => want,
            },
        }
    }
}

/// Expand a configured path into named sources.
pub fn open_sources(path: &Path) -> Result<Vec<Source>> {
    if path.is_dir() && path.join(MANIFEST_FILE).exists() {
        let m = Manifest::read(path)?;
        return m.sources.iter().map(|s| manifest_source(path, s)).collect();
    }
    if let Some(parent) = path.parent().filter(|p| p.join(MANIFEST_FILE).exists()) {
        let m = Manifest::read(parent)?;
        let name = path
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        let Some(s) = m.sources.iter().find(|s| s.name == name) else {
            bail!(
                "{}: {} has no source {name} (it has {})",
                path.display(),
                parent.join(MANIFEST_FILE).display(),
                m.sources
                    .iter()
                    .map(|s| s.name.as_str())
                    .collect::<Vec<_>>()
                    .join(", ")
            );
        };
        return Ok(vec![manifest_source(parent, s)?]);
    }
    let name = path
        .file_stem()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "data".into());
    if path.is_dir() {
        let files = list_llmc(path)?;
        if files.is_empty() {
            bail!(
                "{}: a folder without {MANIFEST_FILE} or llm.c shards",
                path.display()
            );
        }
        return Ok(vec![Source::new(name, files)?]);
    }
    Ok(vec![Source::new(name, vec![path.to_path_buf()])?])
}

fn manifest_source(dir: &Path, s: &crate::prepare::SourceEntry) -> Result<Source> {
    let paths: Vec<PathBuf> = s.shards.iter().map(|f| dir.join(&f.file)).collect();
    let src = Source::new(s.name.clone(), paths)?;
    // The manifest's counts against the shards' own headers: a swapped or damaged shard shows.
    for (f, seg) in s.shards.iter().zip(&src.segments) {
        let Segment::Shard(sh) = seg else {
            unreachable!()
        };
        if sh.header.tokens != f.tokens || sh.header.documents != f.documents {
            bail!(
                "{}: holds {} tokens in {} documents, but {} lists {} in {}",
                sh.path().display(),
                sh.header.tokens,
                sh.header.documents,
                dir.join(MANIFEST_FILE).display(),
                f.tokens,
                f.documents
            );
        }
    }
    Ok(src)
}

/// A keyed permutation of `0..n` (a 4-round Feistel network on the smallest even bit width
/// that covers `n`, walking cycles until the value lands below `n`): O(1) state, the same on
/// every rank and after every resume.
pub fn permute(key: u64, n: u64, i: u64) -> u64 {
    assert!(i < n, "permute: {i} is not below {n}");
    if n == 1 {
        return 0;
    }
    let bits = (64 - (n - 1).leading_zeros()).max(2);
    let half = bits.div_ceil(2);
    let mask = (1u64 << half) - 1;
    let mut x = i;
    loop {
        let (mut l, mut r) = (x >> half, x & mask);
        for round in 0..4u64 {
            let f = mix(key ^ mix(r.wrapping_add(round << 56))) & mask;
            (l, r) = (r, l ^ f);
        }
        x = (l << half) | r;
        if x < n {
            return x;
        }
    }
}

/// Sources, their training windows and validation splits, and the mixture.
pub struct Mixture {
    pub sources: Vec<Source>,
    /// Normalised sampling weights.
    pub weights: Vec<f64>,
    /// First validation token of each source.
    val_start: Vec<u64>,
    seq_len: usize,
    seed: u64,
}

impl Mixture {
    /// `groups`: (sources of one configured entry, its weight if given). Without weights,
    /// sources are drawn in proportion to tokens^(1/temperature); a weighted entry that holds
    /// several sources splits its weight among them that way.
    pub fn new(
        groups: Vec<(Vec<Source>, Option<f64>)>,
        temperature: f64,
        val_fraction: f64,
        seq_len: usize,
        seed: u64,
    ) -> Result<Self> {
        let by_size = |s: &Source| (s.tokens() as f64).powf(1.0 / temperature);
        let total_w: f64 = groups.iter().filter_map(|g| g.1).sum();
        let mut sources = Vec::new();
        let mut weights = Vec::new();
        for (srcs, w) in groups {
            let inner: f64 = srcs.iter().map(by_size).sum();
            for s in srcs {
                let share = by_size(&s) / inner.max(f64::MIN_POSITIVE);
                weights.push(match w {
                    Some(w) => w / total_w * share,
                    None => by_size(&s),
                });
                sources.push(s);
            }
        }
        let sum: f64 = weights.iter().sum();
        for w in &mut weights {
            *w /= sum;
        }
        let mut names = std::collections::HashSet::new();
        for s in &mut sources {
            // Two entries may name sources alike (two `en` folders): keep names distinct.
            let mut name = s.name.clone();
            let mut k = 2;
            while !names.insert(name.clone()) {
                name = format!("{}-{k}", s.name);
                k += 1;
            }
            s.name = name;
        }
        let need = seq_len as u64 + 1;
        let mut val_start = Vec::new();
        for s in &sources {
            let v = s.val_start(val_fraction);
            let (nt, nv) = (v, s.tokens() - v);
            if nt < need {
                bail!(
                    "source {} ({}): its training split has {nt} tokens, fewer than one sequence \
                     (model.seq_len + 1 = {need})",
                    s.name,
                    s.files[0].path
                );
            }
            if nv < need {
                bail!(
                    "source {} ({}): its validation split (data.val_fraction = {val_fraction}, \
                     whole documents) has {nv} tokens, fewer than one sequence \
                     (model.seq_len + 1 = {need}); use more data or a larger data.val_fraction",
                    s.name,
                    s.files[0].path
                );
            }
            val_start.push(v);
        }
        Ok(Self {
            sources,
            weights,
            val_start,
            seq_len,
            seed,
        })
    }

    /// Training windows of source `s`: `seq_len + 1` tokens at a stride of `seq_len`.
    pub fn windows(&self, s: usize) -> u64 {
        (self.val_start[s] - 1) / self.seq_len as u64
    }

    /// Which source global sequence `g` comes from, and its ordinal among that source's draws:
    /// a binary split of the weights, each level giving its left side floor(g·a + ½) of the
    /// first g draws, so every source's count stays within one of its share at every g.
    pub fn pick(&self, g: u64) -> (usize, u64) {
        let (mut lo, mut hi, mut k) = (0, self.weights.len(), g);
        while hi - lo > 1 {
            let mid = (lo + hi) / 2;
            let left: f64 = self.weights[lo..mid].iter().sum();
            let a = left / (left + self.weights[mid..hi].iter().sum::<f64>());
            let before = |k: u64| (k as f64 * a + 0.5).floor() as u64;
            let (l0, l1) = (before(k), before(k + 1));
            if l1 > l0 {
                hi = mid;
                k = l0;
            } else {
                lo = mid;
                k -= l0;
            }
        }
        (lo, k)
    }

    /// Window of source `s` at its `k`-th draw: epoch `k / windows` in a fresh order each.
    pub fn window(&self, s: usize, k: u64) -> u64 {
        let n = self.windows(s);
        let (epoch, pos) = (k / n, k % n);
        permute(keyed(self.seed, s as u64, epoch), n, pos)
    }

    /// Append the inputs and targets of global sequence `g`.
    pub fn sequence(&self, g: u64, x: &mut Vec<u32>, y: &mut Vec<u32>) {
        let (s, k) = self.pick(g);
        let w = self.window(s, k);
        let a = w * self.seq_len as u64;
        let start = x.len();
        self.sources[s].extend(a, a + self.seq_len as u64 + 1, x);
        let last = x.pop().expect("a window has seq_len + 1 tokens");
        y.extend_from_slice(&x[start + 1..]);
        y.push(last);
    }

    /// Append the document starts ([`Source::window_doc_starts`]) of global sequence `g`'s
    /// inputs.
    pub fn sequence_doc_starts(&self, g: u64, out: &mut Vec<u32>) {
        let (s, k) = self.pick(g);
        let a = self.window(s, k) * self.seq_len as u64;
        self.sources[s].window_doc_starts(a, self.seq_len, out);
    }

    /// Validation windows of source `s` (consecutive, non-overlapping, `seq_len + 1` tokens).
    pub fn val_windows(&self, s: usize) -> u64 {
        (self.sources[s].tokens() - self.val_start[s]) / (self.seq_len as u64 + 1)
    }

    /// Validation window `w` of source `s`.
    pub fn val_sequence(&self, s: usize, w: u64, x: &mut Vec<u32>, y: &mut Vec<u32>) {
        let a = self.val_start[s] + w * (self.seq_len as u64 + 1);
        let start = x.len();
        self.sources[s].extend(a, a + self.seq_len as u64 + 1, x);
        let last = x.pop().expect("a window has seq_len + 1 tokens");
        y.extend_from_slice(&x[start + 1..]);
        y.push(last);
    }

    /// Append the document starts of validation window `w` of source `s`'s inputs.
    pub fn val_sequence_doc_starts(&self, s: usize, w: u64, out: &mut Vec<u32>) {
        let a = self.val_start[s] + w * (self.seq_len as u64 + 1);
        self.sources[s].window_doc_starts(a, self.seq_len, out);
    }

    /// Source `s`'s validation tokens.
    pub fn val_tokens(&self, s: usize) -> Vec<u32> {
        let mut v = Vec::new();
        self.sources[s].extend(self.val_start[s], self.sources[s].tokens(), &mut v);
        v
    }
}

#[cfg(test)]
mod tests;

//! Checkpoints: a directory per saved step holding `model.safetensors` (parameters and buffers),
//! `optimizer.safetensors` (optimizer state), `config.toml` and `manifest.json`.
//!
//! Layout inside a run directory:
//! ```text
//! RUN/checkpoints/step_00000100/{manifest.json, model.safetensors, optimizer.safetensors, config.toml}
//! RUN/checkpoints/latest            one line: the name of the newest complete checkpoint
//! ```
//! A checkpoint is written into a hidden temporary directory and renamed into place only once
//! every file is written and synced; `latest` is then replaced by write-to-temp plus rename. A
//! crash at any point therefore leaves `latest` naming a complete checkpoint.
//!
//! A sharded run may instead save per-rank shard files with a layout record ([`sharded`]);
//! [`read_tensors`] reads either kind whole, so every command takes every checkpoint.
//!
//! The manifest records every other file's size and XXH3-64 digest ([`FileDigest`]); reading a
//! checkpoint checks the files it reads against them, so a flipped or zeroed byte is an error
//! naming the file rather than a silently different model ([`set_verify`] turns it off).

pub mod sharded;
pub use sharded::{ShardedParam, ShardsManifest, SHARDS_FILE};

use anyhow::{bail, Context, Result};
use ganymede_config::JobConfig;
use ganymede_core::{Memory, ParamStore, Tensor};
use safetensors::tensor::{Dtype, TensorView};
use safetensors::SafeTensors;
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, HashMap};
use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};

/// Bumped whenever the on-disk layout changes incompatibly.
pub const FORMAT_VERSION: u32 = 1;
/// Complete checkpoints kept per run; older ones are deleted after a successful save.
pub const KEEP_LAST: usize = 3;

pub const MODEL_FILE: &str = "model.safetensors";
pub const OPTIMIZER_FILE: &str = "optimizer.safetensors";
pub const MANIFEST_FILE: &str = "manifest.json";
pub const CONFIG_FILE: &str = "config.toml";
/// A trained tokenizer travels with the checkpoint so eval, generate and export can use it.
pub const TOKENIZER_FILE: &str = "tokenizer.json";
const LATEST: &str = "latest";
const DIR_PREFIX: &str = "step_";

/// What is needed, beyond the tensors, to continue a run exactly where it stopped.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct Manifest {
    pub format_version: u32,
    /// Optimizer steps completed; training continues with step `step + 1`.
    pub step: usize,
    /// The optimizer's own step counter (bias corrections, momentum warm-up).
    pub optimizer_step: u64,
    /// The resolved job configuration, as TOML (also written next to it as `config.toml`).
    pub config: String,
    pub data: DataPosition,
    pub rng: RngState,
    /// Tokens consumed by training so far.
    pub tokens_seen: u64,
    /// Size and digest of every other file of the checkpoint, by file name (empty in
    /// checkpoints written before digests: those load unchecked).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub files: BTreeMap<String, FileDigest>,
}

/// A file's size and XXH3-64 digest. XXH3 runs at memory speed (see BENCHMARKS.md), so checking
/// a checkpoint costs a small share of reading it; it guards against corruption (bit rot, a
/// partial copy, an edited file), not against tampering.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct FileDigest {
    pub bytes: u64,
    /// 16 hex digits.
    pub xxh3: String,
}

impl FileDigest {
    pub fn of(bytes: &[u8]) -> FileDigest {
        FileDigest {
            bytes: bytes.len() as u64,
            xxh3: format!("{:016x}", twox_hash::XxHash3_64::oneshot(bytes)),
        }
    }
}

static VERIFY: AtomicBool = AtomicBool::new(true);

/// Whether reads check files against the manifest's digests (on by default; `--no-verify`).
pub fn set_verify(on: bool) {
    VERIFY.store(on, Ordering::Relaxed);
}

pub fn verify_enabled() -> bool {
    VERIFY.load(Ordering::Relaxed)
}

/// Check `bytes`, read from `path`, against the manifest's record of it (if any).
pub fn check_digest(path: &Path, bytes: &[u8], want: Option<&FileDigest>) -> Result<()> {
    let Some(want) = want.filter(|_| verify_enabled()) else {
        return Ok(());
    };
    compare_digest(path, &FileDigest::of(bytes), want)
}

/// Check the file `name` of `dir` against `digests` without holding it (read in 16 MiB pieces),
/// for readers that take a file by range.
pub fn verify_file(dir: &Path, name: &str, digests: &BTreeMap<String, FileDigest>) -> Result<()> {
    use std::hash::Hasher;
    use std::io::Read;
    let Some(want) = digests.get(name).filter(|_| verify_enabled()) else {
        return Ok(());
    };
    let path = dir.join(name);
    let mut f = fs::File::open(&path).with_context(|| format!("cannot read {}", path.display()))?;
    let mut h = twox_hash::XxHash3_64::with_seed(0);
    let mut buf = vec![0u8; 16 << 20];
    let mut n = 0u64;
    loop {
        let k = f
            .read(&mut buf)
            .with_context(|| format!("cannot read {}", path.display()))?;
        if k == 0 {
            break;
        }
        h.write(&buf[..k]);
        n += k as u64;
    }
    let got = FileDigest {
        bytes: n,
        xxh3: format!("{:016x}", h.finish()),
    };
    compare_digest(&path, &got, want)
}

fn compare_digest(path: &Path, got: &FileDigest, want: &FileDigest) -> Result<()> {
    if got.bytes != want.bytes {
        bail!(
            "checkpoint file {} holds {} bytes, its manifest records {}: truncated or corrupt (--no-verify reads it anyway)",
            path.display(),
            got.bytes,
            want.bytes
        );
    }
    if got.xxh3 != want.xxh3 {
        bail!(
            "checkpoint file {} is corrupt: its XXH3 digest is {}, its manifest records {} (--no-verify reads it anyway)",
            path.display(),
            got.xxh3,
            want.xxh3
        );
    }
    Ok(())
}

/// The digests a checkpoint's manifest records (none for a checkpoint without them).
pub fn file_digests(dir: &Path) -> Result<BTreeMap<String, FileDigest>> {
    Ok(read_manifest(dir)?.files)
}

/// Read the checkpoint file `name` of `dir`, checked against `digests`.
pub fn read_checked(
    dir: &Path,
    name: &str,
    digests: &BTreeMap<String, FileDigest>,
) -> Result<Vec<u8>> {
    let path = dir.join(name);
    let bytes = fs::read(&path).with_context(|| format!("cannot read {}", path.display()))?;
    check_digest(&path, &bytes, digests.get(name))?;
    Ok(bytes)
}

/// Check every recorded file of the checkpoint `dir` except those named in `skip` (which the
/// caller reads and checks itself).
fn verify_others(dir: &Path, digests: &BTreeMap<String, FileDigest>, skip: &[&str]) -> Result<()> {
    if !verify_enabled() {
        return Ok(());
    }
    for name in digests.keys() {
        if !skip.contains(&name.as_str()) && !name.ends_with(".safetensors") {
            read_checked(dir, name, digests)?;
        }
    }
    Ok(())
}

/// Where the data stream stands. Batches are a pure function of (seed, step), so the position
/// is the next step to draw.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct DataPosition {
    pub seed: u64,
    pub next_step: usize,
    /// What the run trained on (absent in checkpoints written before fingerprints).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fingerprint: Option<DataFingerprint>,
}

/// The tokenised splits a run trains and validates on: their lengths and XXH3-64 digests. A
/// resume on other tokens (an edited `data.path`, a truncated `data/train.bin`) would no longer
/// continue the same run.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct DataFingerprint {
    pub train_tokens: u64,
    pub train_xxh3: String,
    pub val_tokens: u64,
    pub val_xxh3: String,
}

impl DataFingerprint {
    pub fn of(train: &[u32], val: &[u32]) -> DataFingerprint {
        DataFingerprint {
            train_tokens: train.len() as u64,
            train_xxh3: tokens_digest(train),
            val_tokens: val.len() as u64,
            val_xxh3: tokens_digest(val),
        }
    }

    /// How `self` (now) differs from `then` (the checkpoint's), in words; None if it does not.
    pub fn difference(&self, then: &DataFingerprint) -> Option<String> {
        let split = |name: &str, n: u64, h: &str, n0: u64, h0: &str| {
            (n != n0 || h != h0).then(|| {
                format!("the {name} split is now {n} tokens (XXH3 {h}), the checkpoint's run had {n0} (XXH3 {h0})")
            })
        };
        let parts: Vec<String> = [
            split(
                "training",
                self.train_tokens,
                &self.train_xxh3,
                then.train_tokens,
                &then.train_xxh3,
            ),
            split(
                "validation",
                self.val_tokens,
                &self.val_xxh3,
                then.val_tokens,
                &then.val_xxh3,
            ),
        ]
        .into_iter()
        .flatten()
        .collect();
        (!parts.is_empty()).then(|| parts.join("; "))
    }
}

/// XXH3-64 of token ids as their little-endian bytes (the token files' layout), 16 hex digits.
fn tokens_digest(tokens: &[u32]) -> String {
    use std::hash::Hasher;
    let mut h = twox_hash::XxHash3_64::new();
    let mut buf = Vec::with_capacity(1 << 16);
    for chunk in tokens.chunks(1 << 14) {
        buf.clear();
        buf.extend(chunk.iter().flat_map(|t| t.to_le_bytes()));
        h.write(&buf);
    }
    format!("{:016x}", h.finish())
}

/// Random state. Parameter initialisation and batch sampling are keyed by the seed; nothing
/// else in a step draws random numbers, so the seed is the whole state.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct RngState {
    pub seed: u64,
}

/// Where a run stands when it saves: what a manifest records besides the config.
pub struct Position {
    /// Optimizer steps completed.
    pub step: usize,
    pub tokens_seen: u64,
    pub data_seed: u64,
    /// The run's data (None: not recorded).
    pub data: Option<DataFingerprint>,
}

impl Manifest {
    /// The manifest of a checkpoint taken at `at` (single-process and sharded runs alike).
    pub fn at(cfg: &JobConfig, at: &Position, optimizer_step: u64) -> Manifest {
        Manifest {
            format_version: FORMAT_VERSION,
            step: at.step,
            optimizer_step,
            config: cfg.to_toml(),
            data: DataPosition {
                seed: at.data_seed,
                next_step: at.step,
                fingerprint: at.data.clone(),
            },
            rng: RngState {
                seed: cfg.training.seed,
            },
            tokens_seen: at.tokens_seen,
            files: BTreeMap::new(),
        }
    }

    pub fn job_config(&self) -> Result<JobConfig> {
        JobConfig::from_toml_str(&self.config, "checkpoint manifest").map_err(anyhow::Error::from)
    }
}

/// The run's trained tokenizer, if it has one, as an extra file for a checkpoint (so eval, generate
/// and export find it next to the weights).
pub fn run_tokenizer_file(run_dir: &Path) -> Vec<(String, PathBuf)> {
    let tok = run_dir.join("data").join(ganymede_data::TOKENIZER_FILE);
    if tok.is_file() {
        vec![(TOKENIZER_FILE.to_string(), tok)]
    } else {
        vec![]
    }
}

/// Checkpoint directory name for a step (zero-padded so names sort by step).
pub fn dir_name(step: usize) -> String {
    format!("{DIR_PREFIX}{step:08}")
}

/// `RUN/checkpoints`.
pub fn checkpoints_root(run_dir: &Path) -> PathBuf {
    run_dir.join("checkpoints")
}

/// Named host tensors: (name, shape, values), in file order.
pub type NamedTensors = Vec<(String, Vec<usize>, Vec<f32>)>;

/// Serialise named f32 tensors to safetensors bytes.
pub fn to_safetensors_bytes(
    tensors: &[(String, Vec<usize>, Vec<f32>)],
    metadata: Option<HashMap<String, String>>,
) -> Result<Vec<u8>> {
    let bytes: Vec<Vec<u8>> = tensors
        .iter()
        .map(|(_, _, data)| data.iter().flat_map(|x| x.to_le_bytes()).collect())
        .collect();
    let mut views = Vec::with_capacity(tensors.len());
    for ((name, shape, _), b) in tensors.iter().zip(&bytes) {
        let view = TensorView::new(Dtype::F32, shape.clone(), b)
            .with_context(|| format!("tensor {name}"))?;
        views.push((name.clone(), view));
    }
    Ok(safetensors::serialize(views, metadata)?)
}

/// Write `bytes` to `path` and flush them to disk before returning.
fn write_synced(path: &Path, bytes: &[u8]) -> Result<()> {
    let mut f =
        fs::File::create(path).with_context(|| format!("cannot create {}", path.display()))?;
    f.write_all(bytes)
        .with_context(|| format!("cannot write {}", path.display()))?;
    f.sync_all()
        .with_context(|| format!("cannot sync {}", path.display()))?;
    Ok(())
}

/// Replace `path` atomically: write a sibling temporary file, sync it, rename over.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("file");
    let tmp = path.with_file_name(format!(".{name}.tmp-{}", std::process::id()));
    let r = write_synced(&tmp, bytes).and_then(|()| {
        fs::rename(&tmp, path).with_context(|| format!("cannot rename into {}", path.display()))
    });
    if r.is_err() {
        // No partial temporary file outlives a failed write (a full disk, say).
        let _ = fs::remove_file(&tmp);
    }
    r?;
    sync_dir(path.parent().unwrap_or(Path::new(".")));
    Ok(())
}

fn sync_dir(dir: &Path) {
    // Makes the rename durable on Linux; best effort elsewhere.
    if let Ok(d) = fs::File::open(dir) {
        let _ = d.sync_all();
    }
}

/// Download tensors from the backend into host vectors, named.
pub fn host_tensors<'a>(
    be: &dyn Memory,
    named: impl IntoIterator<Item = (String, &'a Tensor)>,
) -> NamedTensors {
    named
        .into_iter()
        .map(|(n, t)| (n, t.shape().to_vec(), be.download(t.view())))
        .collect()
}

/// Everything a checkpoint holds, on the host.
pub struct CheckpointData<'a> {
    pub manifest: &'a Manifest,
    pub params: NamedTensors,
    pub optimizer: NamedTensors,
    /// Extra files copied into the checkpoint (a trained tokenizer).
    pub extra_files: Vec<(String, PathBuf)>,
}

/// Save a checkpoint of `data.manifest.step` under `RUN/checkpoints`, atomically, then update
/// `latest` and prune old checkpoints (keeping the newest [`KEEP_LAST`]). Returns the checkpoint
/// directory.
pub fn save(run_dir: &Path, data: &CheckpointData) -> Result<PathBuf> {
    save_with(run_dir, data, &Retention::default())
}

/// Which older checkpoints a save keeps: the newest `keep_last` (the one just saved among
/// them), and every one whose step is a multiple of `keep_every` (0: none), which rotation
/// never removes.
#[derive(Clone, Copy, Debug)]
pub struct Retention {
    pub keep_last: usize,
    pub keep_every: usize,
}

impl Default for Retention {
    fn default() -> Self {
        Retention {
            keep_last: KEEP_LAST,
            keep_every: 0,
        }
    }
}

/// [`save`] with a retention policy.
pub fn save_with(run_dir: &Path, data: &CheckpointData, keep: &Retention) -> Result<PathBuf> {
    let root = checkpoints_root(run_dir);
    fs::create_dir_all(&root).with_context(|| format!("cannot create {}", root.display()))?;
    let name = dir_name(data.manifest.step);
    let final_dir = root.join(&name);
    let tmp = root.join(format!(".tmp-{name}-{}", std::process::id()));
    if tmp.exists() {
        fs::remove_dir_all(&tmp)?;
    }
    fs::create_dir(&tmp).with_context(|| format!("cannot create {}", tmp.display()))?;
    let r = write_files(&tmp, data);
    if r.is_err() {
        // A failed save (a full disk) leaves nothing behind; the previous checkpoint stands.
        let _ = fs::remove_dir_all(&tmp);
    }
    r?;

    if final_dir.exists() {
        // Re-saving the same step (a resumed run reaching it again): move the old one aside
        // first so a crash between the two renames still leaves one complete copy.
        let old = root.join(format!(".old-{name}-{}", std::process::id()));
        fs::rename(&final_dir, &old)?;
        fs::rename(&tmp, &final_dir)?;
        let _ = fs::remove_dir_all(&old);
    } else {
        fs::rename(&tmp, &final_dir)
            .with_context(|| format!("cannot rename into {}", final_dir.display()))?;
    }
    sync_dir(&root);
    write_atomic(&root.join(LATEST), format!("{name}\n").as_bytes())?;
    prune(&root, keep, data.manifest.step)?;
    Ok(final_dir)
}

/// Every file of a checkpoint into `tmp`, the manifest (with the others' digests) last.
fn write_files(tmp: &Path, data: &CheckpointData) -> Result<()> {
    let mut manifest = data.manifest.clone();
    let mut put = |name: &str, bytes: &[u8]| -> Result<()> {
        write_synced(&tmp.join(name), bytes)?;
        manifest
            .files
            .insert(name.to_string(), FileDigest::of(bytes));
        Ok(())
    };
    put(MODEL_FILE, &to_safetensors_bytes(&data.params, None)?)?;
    crash_point(data.manifest.step);
    put(
        OPTIMIZER_FILE,
        &to_safetensors_bytes(&data.optimizer, None)?,
    )?;
    put(CONFIG_FILE, data.manifest.config.as_bytes())?;
    for (fname, src) in &data.extra_files {
        let bytes = fs::read(src).with_context(|| format!("cannot read {}", src.display()))?;
        put(fname, &bytes)?;
    }
    // The manifest goes last: a directory with a manifest has every other file.
    write_synced(
        &tmp.join(MANIFEST_FILE),
        &serde_json::to_vec_pretty(&manifest)?,
    )?;
    sync_dir(tmp);
    Ok(())
}

/// A test hook: `GANYMEDE_CRASH_AT_CHECKPOINT=STEP` aborts the process half-way through writing
/// the checkpoint of STEP, as a power cut would, so tests can check the previous one survives.
fn crash_point(step: usize) {
    if let Ok(v) = std::env::var("GANYMEDE_CRASH_AT_CHECKPOINT") {
        if v.trim().parse::<usize>().ok() == Some(step) {
            eprintln!("GANYMEDE_CRASH_AT_CHECKPOINT: aborting while writing step {step}");
            std::process::abort();
        }
    }
}

/// Cut a run's history back to step `step`: `latest` names that checkpoint first (so a crash
/// part-way leaves it valid), then every checkpoint after it is deleted.
pub fn truncate_after(root: &Path, step: usize) -> Result<()> {
    write_atomic(
        &root.join(LATEST),
        format!("{}\n", dir_name(step)).as_bytes(),
    )?;
    for (s, p) in list(root) {
        if s > step {
            fs::remove_dir_all(&p).with_context(|| format!("cannot remove {}", p.display()))?;
        }
    }
    Ok(())
}

/// Complete checkpoints under `root`, oldest first.
pub fn list(root: &Path) -> Vec<(usize, PathBuf)> {
    let mut out = Vec::new();
    if let Ok(rd) = fs::read_dir(root) {
        for e in rd.flatten() {
            let name = e.file_name().to_string_lossy().to_string();
            if let Some(step) = name
                .strip_prefix(DIR_PREFIX)
                .and_then(|s| s.parse::<usize>().ok())
            {
                if e.path().join(MANIFEST_FILE).is_file() {
                    out.push((step, e.path()));
                }
            }
        }
    }
    out.sort();
    out
}

/// Keep the checkpoint of `current` and the `keep_last - 1` newest before it, and those
/// `keep_every` marks. Checkpoints after `current` (left by a run that was resumed from an
/// earlier step) are not touched.
fn prune(root: &Path, keep: &Retention, current: usize) -> Result<()> {
    let older: Vec<_> = list(root)
        .into_iter()
        .filter(|(s, _)| *s < current)
        .collect();
    let drop = older.len().saturating_sub(keep.keep_last.saturating_sub(1));
    for (s, p) in &older[..drop] {
        if keep.keep_every > 0 && s.is_multiple_of(keep.keep_every) {
            continue;
        }
        fs::remove_dir_all(p).with_context(|| format!("cannot remove {}", p.display()))?;
    }
    remove_leftovers(root);
    Ok(())
}

/// Remove what killed saves left under `root` (`.tmp-*`, `.old-*`, and sharded saves'
/// `.shards-*` staging folders), except this process's own. Only a writer holding the run's
/// lock may call this: another live writer's staging would go too.
pub fn remove_leftovers(root: &Path) {
    if let Ok(rd) = fs::read_dir(root) {
        for e in rd.flatten() {
            let n = e.file_name().to_string_lossy().to_string();
            let stale = (n.starts_with(".tmp-") || n.starts_with(".old-"))
                && !n.ends_with(&format!("-{}", std::process::id()));
            if stale || n.starts_with(".shards-") {
                let _ = fs::remove_dir_all(e.path());
            }
        }
    }
}

/// Find the checkpoint a path refers to: a checkpoint directory itself (it has a manifest), or
/// a run directory (its `checkpoints/latest`), or a run's `checkpoints` folder.
pub fn resolve(path: &Path) -> Result<PathBuf> {
    if !path.exists() {
        bail!("checkpoint {}: no such file or directory", path.display());
    }
    if path.join(MANIFEST_FILE).is_file() {
        return Ok(path.to_path_buf());
    }
    for root in [checkpoints_root(path), path.to_path_buf()] {
        let latest = root.join(LATEST);
        if latest.is_file() {
            let name = fs::read_to_string(&latest)
                .with_context(|| format!("cannot read {}", latest.display()))?;
            let dir = root.join(name.trim());
            if dir.join(MANIFEST_FILE).is_file() {
                return Ok(dir);
            }
            bail!(
                "checkpoint {}: {} names {}, which has no {MANIFEST_FILE}",
                path.display(),
                latest.display(),
                dir.display()
            );
        }
    }
    bail!(
        "checkpoint {}: not a checkpoint (no {MANIFEST_FILE}) nor a run directory (no checkpoints/{LATEST})",
        path.display()
    )
}

pub fn read_manifest(dir: &Path) -> Result<Manifest> {
    let p = dir.join(MANIFEST_FILE);
    let text = fs::read_to_string(&p).with_context(|| format!("cannot read {}", p.display()))?;
    let m: Manifest = serde_json::from_str(&text)
        .with_context(|| format!("checkpoint manifest {} is not valid", p.display()))?;
    if m.format_version != FORMAT_VERSION {
        bail!(
            "checkpoint manifest {}: format version {} (this build reads {FORMAT_VERSION})",
            p.display(),
            m.format_version
        );
    }
    Ok(m)
}

/// Tensors of a safetensors file on the host, by name: (shape, values).
pub type HostTensors = BTreeMap<String, (Vec<usize>, Vec<f32>)>;

/// Read every tensor of a safetensors file (f32 only). A truncated or corrupt file is an error
/// naming the file.
pub fn read_safetensors(path: &Path) -> Result<HostTensors> {
    let bytes = fs::read(path).with_context(|| format!("cannot read {}", path.display()))?;
    parse_safetensors(path, &bytes)
}

/// The checkpoint file `name` of `dir` as tensors, checked against `digests` first.
pub fn read_safetensors_checked(
    dir: &Path,
    name: &str,
    digests: &BTreeMap<String, FileDigest>,
) -> Result<HostTensors> {
    parse_safetensors(&dir.join(name), &read_checked(dir, name, digests)?)
}

fn parse_safetensors(path: &Path, bytes: &[u8]) -> Result<HostTensors> {
    let st = SafeTensors::deserialize(bytes).map_err(|e| {
        anyhow::anyhow!(
            "{} is not a readable safetensors file (truncated or corrupt?): {e:?}",
            path.display()
        )
    })?;
    let mut out = BTreeMap::new();
    for (name, view) in st.tensors() {
        if view.dtype() != Dtype::F32 {
            bail!(
                "{}: tensor {name} has dtype {:?}, expected F32",
                path.display(),
                view.dtype()
            );
        }
        let data: Vec<f32> = view
            .data()
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        out.insert(name, (view.shape().to_vec(), data));
    }
    Ok(out)
}

/// Every tensor of the checkpoint `dir`, whole: (parameters, optimizer state). A sharded
/// checkpoint's pieces are reassembled, so callers never see the difference. Every file is
/// checked against the manifest's digests.
pub fn read_tensors(dir: &Path) -> Result<(HostTensors, HostTensors)> {
    read_tensors_opt(dir, true)
}

/// The parameters of the checkpoint `dir` alone (what eval, generate and export need): a
/// gathered checkpoint's `optimizer.safetensors` is neither read nor required.
pub fn read_params(dir: &Path) -> Result<HostTensors> {
    Ok(read_tensors_opt(dir, false)?.0)
}

fn read_tensors_opt(dir: &Path, optimizer: bool) -> Result<(HostTensors, HostTensors)> {
    let manifest = read_manifest(dir)?;
    let digests = &manifest.files;
    verify_others(dir, digests, &[])?;
    if dir.join(SHARDS_FILE).is_file() {
        return sharded::read_whole(dir, &manifest);
    }
    let model = read_safetensors_checked(dir, MODEL_FILE, digests)?;
    let opt = if optimizer {
        read_safetensors_checked(dir, OPTIMIZER_FILE, digests)?
    } else {
        HostTensors::new()
    };
    Ok((model, opt))
}

/// Put host tensors into `targets`, which must match them exactly (same names, same shapes,
/// nothing missing, nothing extra); `what` names the source in errors.
pub fn upload_into<'a>(
    be: &dyn Memory,
    what: &Path,
    mut host: HostTensors,
    targets: impl IntoIterator<Item = (String, &'a mut Tensor)>,
) -> Result<()> {
    for (name, t) in targets {
        let Some((shape, data)) = host.remove(&name) else {
            bail!("{}: tensor {name} is missing", what.display());
        };
        if shape != t.shape() {
            bail!(
                "{}: tensor {name} has shape {shape:?}, the model expects {:?}",
                what.display(),
                t.shape()
            );
        }
        be.write(t.view_mut(), &data);
    }
    if let Some(extra) = host.keys().next() {
        bail!(
            "{}: unexpected tensor {extra} ({} not in the model)",
            what.display(),
            host.len()
        );
    }
    Ok(())
}

/// Load a checkpoint's parameters (gathered or sharded) into a store shaped by the model's specs.
pub fn load_params(be: &dyn Memory, dir: &Path, params: &mut ParamStore) -> Result<()> {
    let names: Vec<String> = params.specs().iter().map(|s| s.name.clone()).collect();
    let model = read_params(dir)?;
    upload_into(
        be,
        dir,
        model,
        names.into_iter().zip(params.tensors_mut().iter_mut()),
    )
}

/// Names of the `section.key` entries whose values differ between two configs (keys present in
/// only one count as differing).
pub fn config_diff(a: &JobConfig, b: &JobConfig) -> Vec<String> {
    let fa = flatten(&toml::Value::try_from(a).expect("config serialises"));
    let fb = flatten(&toml::Value::try_from(b).expect("config serialises"));
    let mut keys: Vec<&String> = fa.keys().chain(fb.keys()).collect();
    keys.sort();
    keys.dedup();
    keys.into_iter()
        .filter(|k| fa.get(*k) != fb.get(*k))
        .cloned()
        .collect()
}

fn flatten(v: &toml::Value) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    if let toml::Value::Table(t) = v {
        for (section, sv) in t {
            match sv {
                toml::Value::Table(inner) => {
                    for (k, x) in inner {
                        out.insert(format!("{section}.{k}"), x.to_string());
                    }
                }
                other => {
                    out.insert(section.clone(), other.to_string());
                }
            }
        }
    }
    out
}

/// Keys a resumed run may change without breaking the continuation: how long to train, how
/// often to save and log, and how many threads (the CPU kernels are deterministic in it).
pub fn resumable_difference(key: &str) -> bool {
    key == "training.steps"
        || key == "training.threads"
        || key.starts_with("checkpoint.")
        || key.starts_with("metrics.")
        // Checkpoints load at any rank count and mesh shape, on any device.
        || key.starts_with("parallelism.")
        || key.starts_with("device.")
        // Where activations and optimizer state live changes no arithmetic.
        || key == "activation_checkpoint.offload_fraction"
        || key == "optimizer.offload"
        // How much of the batch one pass holds (what a run that ran out of memory lowers): the
        // same data and steps; sums run in another order, and microbatches each balance their
        // own routing in the auxiliary loss.
        || key == "training.micro_batch_size"
        || key == "training.loss_chunk_tokens"
        || key == "training.moe_chunk_tokens"
        // The planner's assumption about the data; training reads the real boundaries.
        || key == "data.mean_document_tokens"
}

#[cfg(test)]
mod tests {
    use super::*;
    use ganymede_core::{Category, CpuBackend, ParamKind, ParamSpec};

    fn store(be: &CpuBackend, offset: f32) -> ParamStore {
        let specs = vec![
            ParamSpec::new("a.weight", &[2, 3], ParamKind::Matrix),
            ParamSpec::new("b", &[4], ParamKind::Vector),
        ];
        let mut s = ParamStore::zeros(be, &specs, Category::Params);
        for (i, t) in s.tensors_mut().iter_mut().enumerate() {
            let n = t.len();
            let v: Vec<f32> = (0..n).map(|j| offset + (i * 10 + j) as f32 * 0.1).collect();
            be.write(t.view_mut(), &v);
        }
        s
    }

    fn manifest(step: usize) -> Manifest {
        Manifest {
            format_version: FORMAT_VERSION,
            step,
            optimizer_step: step as u64,
            config: ganymede_config::preset("tiny").unwrap().to_toml(),
            data: DataPosition {
                seed: 1,
                next_step: step + 1,
                fingerprint: None,
            },
            rng: RngState { seed: 1 },
            tokens_seen: 0,
            files: BTreeMap::new(),
        }
    }

    fn save_store(be: &CpuBackend, run: &Path, s: &ParamStore, step: usize) -> PathBuf {
        let m = manifest(step);
        let data = CheckpointData {
            manifest: &m,
            params: host_tensors(be, s.iter().map(|(sp, t)| (sp.name.clone(), t))),
            optimizer: vec![],
            extra_files: vec![],
        };
        save(run, &data).unwrap()
    }

    fn tmpdir(tag: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("ganymede-ckpt-{tag}-{}", std::process::id()));
        let _ = fs::remove_dir_all(&d);
        fs::create_dir_all(&d).unwrap();
        d
    }

    #[test]
    fn round_trip_latest_and_pruning() {
        let be = CpuBackend::default();
        let run = tmpdir("rt");
        for step in 1..=5 {
            save_store(&be, &run, &store(&be, step as f32), step);
        }
        let latest = resolve(&run).unwrap();
        assert!(latest.ends_with(dir_name(5)));
        let mut m = read_manifest(&latest).unwrap();
        // Every other file's digest, as written.
        for f in [MODEL_FILE, OPTIMIZER_FILE, CONFIG_FILE] {
            let d = &m.files[f];
            assert_eq!(
                d,
                &FileDigest::of(&fs::read(latest.join(f)).unwrap()),
                "{f}"
            );
        }
        m.files.clear();
        assert_eq!(m, manifest(5));
        assert_eq!(list(&checkpoints_root(&run)).len(), KEEP_LAST);
        let mut back = store(&be, 0.0);
        load_params(&be, &latest, &mut back).unwrap();
        let want = store(&be, 5.0);
        for (a, b) in back.tensors().iter().zip(want.tensors()) {
            assert_eq!(be.download(a.view()), be.download(b.view()));
        }
        fs::remove_dir_all(&run).unwrap();
    }

    #[test]
    fn truncated_file_is_a_clear_error() {
        let be = CpuBackend::default();
        let run = tmpdir("trunc");
        let dir = save_store(&be, &run, &store(&be, 1.0), 1);
        let f = dir.join(MODEL_FILE);
        let bytes = fs::read(&f).unwrap();
        fs::write(&f, &bytes[..bytes.len() - 7]).unwrap();
        let err = load_params(&be, &dir, &mut store(&be, 0.0)).unwrap_err();
        let msg = format!("{err:#}");
        assert!(
            msg.contains("model.safetensors") && msg.contains("truncated"),
            "{msg}"
        );
        fs::remove_dir_all(&run).unwrap();
    }

    #[test]
    fn shape_mismatch_names_the_tensor() {
        let be = CpuBackend::default();
        let run = tmpdir("shape");
        let dir = save_store(&be, &run, &store(&be, 1.0), 1);
        let specs = vec![
            ParamSpec::new("a.weight", &[3, 2], ParamKind::Matrix),
            ParamSpec::new("b", &[4], ParamKind::Vector),
        ];
        let mut other = ParamStore::zeros(&be, &specs, Category::Params);
        let msg = format!("{:#}", load_params(&be, &dir, &mut other).unwrap_err());
        assert!(msg.contains("a.weight") && msg.contains("[2, 3]"), "{msg}");
        fs::remove_dir_all(&run).unwrap();
    }

    #[test]
    fn interrupted_save_keeps_previous() {
        let be = CpuBackend::default();
        let run = tmpdir("crash");
        save_store(&be, &run, &store(&be, 1.0), 1);
        // A crashed save leaves a temporary directory with partial files and no rename.
        let root = checkpoints_root(&run);
        let tmp = root.join(".tmp-step_00000002-999999");
        fs::create_dir_all(&tmp).unwrap();
        fs::write(tmp.join(MODEL_FILE), b"partial").unwrap();
        let latest = resolve(&run).unwrap();
        assert!(latest.ends_with(dir_name(1)));
        // The next successful save cleans the leftover.
        save_store(&be, &run, &store(&be, 2.0), 2);
        assert!(!tmp.exists());
        fs::remove_dir_all(&run).unwrap();
    }

    #[test]
    fn pruning_never_drops_the_new_checkpoint() {
        let be = CpuBackend::default();
        let run = tmpdir("prune");
        for step in [5, 6, 7, 1, 2] {
            save_store(&be, &run, &store(&be, step as f32), step);
        }
        // Resumed from step 1: the run's later checkpoints stay, the new one is `latest`.
        let steps: Vec<usize> = list(&checkpoints_root(&run)).iter().map(|c| c.0).collect();
        assert_eq!(steps, vec![1, 2, 5, 6, 7]);
        assert!(resolve(&run).unwrap().ends_with(dir_name(2)));
        fs::remove_dir_all(&run).unwrap();
    }

    #[test]
    fn a_changed_byte_is_named_unless_verification_is_off() {
        let be = CpuBackend::default();
        let run = tmpdir("digest");
        let dir = save_store(&be, &run, &store(&be, 1.0), 1);
        let f = dir.join(MODEL_FILE);
        let mut bytes = fs::read(&f).unwrap();
        let n = bytes.len();
        bytes[n - 3] ^= 1; // inside the last value: still a valid file
        fs::write(&f, &bytes).unwrap();
        let msg = format!(
            "{:#}",
            load_params(&be, &dir, &mut store(&be, 0.0)).unwrap_err()
        );
        assert!(
            msg.contains("model.safetensors") && msg.contains("corrupt"),
            "{msg}"
        );
        // The same file without the digest check loads (and differs from what was saved).
        set_verify(false);
        let r = load_params(&be, &dir, &mut store(&be, 0.0));
        set_verify(true);
        r.unwrap();
        fs::remove_dir_all(&run).unwrap();
    }

    #[test]
    fn retention_keeps_every_nth_and_truncation_moves_latest_first() {
        let be = CpuBackend::default();
        let run = tmpdir("keep");
        let keep = Retention {
            keep_last: 2,
            keep_every: 4,
        };
        for step in 1..=9 {
            let m = manifest(step);
            let s = store(&be, step as f32);
            let data = CheckpointData {
                manifest: &m,
                params: host_tensors(&be, s.iter().map(|(sp, t)| (sp.name.clone(), t))),
                optimizer: vec![],
                extra_files: vec![],
            };
            save_with(&run, &data, &keep).unwrap();
        }
        let root = checkpoints_root(&run);
        let steps: Vec<usize> = list(&root).iter().map(|c| c.0).collect();
        assert_eq!(steps, vec![4, 8, 9]);
        truncate_after(&root, 4).unwrap();
        let steps: Vec<usize> = list(&root).iter().map(|c| c.0).collect();
        assert_eq!(steps, vec![4]);
        assert!(resolve(&run).unwrap().ends_with(dir_name(4)));
        fs::remove_dir_all(&run).unwrap();
    }

    #[test]
    fn config_diff_names_keys() {
        let a = ganymede_config::preset("tiny").unwrap();
        let b = a
            .with_overrides(&["model.top_k=3".into(), "training.steps=5".into()])
            .unwrap();
        assert_eq!(config_diff(&a, &b), vec!["model.top_k", "training.steps"]);
        assert!(resumable_difference("training.steps"));
        assert!(resumable_difference("training.micro_batch_size"));
        assert!(!resumable_difference("training.batch_size"));
        assert!(!resumable_difference("model.top_k"));
        // Document masking changes what attention sees; the planner's mean length does not.
        assert!(!resumable_difference("data.document_mask"));
        assert!(resumable_difference("data.mean_document_tokens"));
    }
}

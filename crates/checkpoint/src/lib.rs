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
}

/// Where the data stream stands. Batches are a pure function of (seed, step), so the position
/// is the next step to draw.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct DataPosition {
    pub seed: u64,
    pub next_step: usize,
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
            },
            rng: RngState {
                seed: cfg.training.seed,
            },
            tokens_seen: at.tokens_seen,
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
    write_synced(&tmp, bytes)?;
    fs::rename(&tmp, path).with_context(|| format!("cannot rename into {}", path.display()))?;
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
/// `latest` and prune old checkpoints. Returns the checkpoint directory.
pub fn save(run_dir: &Path, data: &CheckpointData) -> Result<PathBuf> {
    let root = checkpoints_root(run_dir);
    fs::create_dir_all(&root).with_context(|| format!("cannot create {}", root.display()))?;
    let name = dir_name(data.manifest.step);
    let final_dir = root.join(&name);
    let tmp = root.join(format!(".tmp-{name}-{}", std::process::id()));
    if tmp.exists() {
        fs::remove_dir_all(&tmp)?;
    }
    fs::create_dir(&tmp).with_context(|| format!("cannot create {}", tmp.display()))?;

    write_synced(
        &tmp.join(MODEL_FILE),
        &to_safetensors_bytes(&data.params, None)?,
    )?;
    crash_point(data.manifest.step);
    write_synced(
        &tmp.join(OPTIMIZER_FILE),
        &to_safetensors_bytes(&data.optimizer, None)?,
    )?;
    write_synced(&tmp.join(CONFIG_FILE), data.manifest.config.as_bytes())?;
    for (fname, src) in &data.extra_files {
        let bytes = fs::read(src).with_context(|| format!("cannot read {}", src.display()))?;
        write_synced(&tmp.join(fname), &bytes)?;
    }
    // The manifest goes last: a directory with a manifest has every other file.
    let manifest = serde_json::to_vec_pretty(data.manifest)?;
    write_synced(&tmp.join(MANIFEST_FILE), &manifest)?;
    sync_dir(&tmp);

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
    prune(&root, KEEP_LAST, data.manifest.step)?;
    Ok(final_dir)
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

/// Keep the checkpoint of `current` and the `keep - 1` newest before it. Checkpoints after
/// `current` (left by a run that was resumed from an earlier step) are not touched.
fn prune(root: &Path, keep: usize, current: usize) -> Result<()> {
    let older: Vec<_> = list(root)
        .into_iter()
        .filter(|(s, _)| *s < current)
        .collect();
    let drop = older.len().saturating_sub(keep.saturating_sub(1));
    for (_, p) in &older[..drop] {
        fs::remove_dir_all(p).with_context(|| format!("cannot remove {}", p.display()))?;
    }
    // Leftovers of crashed saves.
    if let Ok(rd) = fs::read_dir(root) {
        for e in rd.flatten() {
            let n = e.file_name().to_string_lossy().to_string();
            if (n.starts_with(".tmp-") || n.starts_with(".old-"))
                && !n.ends_with(&format!("-{}", std::process::id()))
            {
                let _ = fs::remove_dir_all(e.path());
            }
        }
    }
    Ok(())
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
    let st = SafeTensors::deserialize(&bytes).map_err(|e| {
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
/// checkpoint's pieces are reassembled, so callers never see the difference.
pub fn read_tensors(dir: &Path) -> Result<(HostTensors, HostTensors)> {
    if dir.join(SHARDS_FILE).is_file() {
        return sharded::read_whole(dir);
    }
    Ok((
        read_safetensors(&dir.join(MODEL_FILE))?,
        read_safetensors(&dir.join(OPTIMIZER_FILE))?,
    ))
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
    let (model, _) = read_tensors(dir)?;
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
        // Accepting changed data is the user's explicit choice at a resume.
        || key == "data.allow_change"
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
            },
            rng: RngState { seed: 1 },
            tokens_seen: 0,
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
        assert_eq!(read_manifest(&latest).unwrap(), manifest(5));
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
    }
}

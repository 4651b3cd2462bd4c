//! Using a checkpoint: load its model, score token windows (`ganymede eval`), sample from it
//! (`ganymede generate`).

use crate::checkpoint;
use anyhow::{bail, Context, Result};
use ganymede_config::JobConfig;
use ganymede_core::{Backend, CpuBackend, ParamStore};
use ganymede_data::{
    check_ids, eval_windows, load_eval_tokens, num_eval_windows, ByteTokenizer, Dataset,
    HfTokenizer, TokenFile, Tokenizer,
};
use ganymede_model::{
    forward_loss, generate, generate_streaming, Model, Sampling, Tokens, Workspace,
};
use serde::Serialize;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// A model restored from a checkpoint, on the CPU backend.
pub struct Loaded {
    pub dir: PathBuf,
    pub cfg: JobConfig,
    pub be: CpuBackend,
    pub model: Model,
    pub params: ParamStore,
}

/// Load the checkpoint `path` refers to (a checkpoint or a run directory).
pub fn load(path: &Path) -> Result<Loaded> {
    let dir = checkpoint::resolve(path)?;
    let manifest = checkpoint::read_manifest(&dir)?;
    let cfg = manifest.job_config()?;
    crate::trainer::init_threads(cfg.training.threads);
    let be = CpuBackend::default();
    let model = Model::new(&cfg.model);
    let mut params = model.init_params(&be, 0);
    checkpoint::load_params(&be, &dir, &mut params)?;
    Ok(Loaded {
        dir,
        cfg,
        be,
        model,
        params,
    })
}

impl Loaded {
    /// The run directory holding this checkpoint, if it sits in one.
    pub fn run_dir(&self) -> Option<PathBuf> {
        let p = self.dir.parent()?;
        (p.file_name()? == "checkpoints").then(|| p.parent().map(Path::to_path_buf))?
    }

    /// The tokenizer the run trained with: the checkpoint's `tokenizer.json` if it has one,
    /// else what `data.tokenizer` names.
    pub fn tokenizer(&self) -> Result<Arc<dyn Tokenizer>> {
        let saved = self.dir.join(checkpoint::TOKENIZER_FILE);
        if saved.is_file() {
            return Ok(Arc::new(HfTokenizer::from_file(&saved)?));
        }
        match self.cfg.data.tokenizer.as_str() {
            "byte" => Ok(Arc::new(ByteTokenizer)),
            "bpe" => bail!(
                "checkpoint {} has no {} (its run trained a BPE tokenizer)",
                self.dir.display(),
                checkpoint::TOKENIZER_FILE
            ),
            path => Ok(Arc::new(
                HfTokenizer::from_file(Path::new(path))
                    .with_context(|| format!("data.tokenizer = {path}"))?,
            )),
        }
    }
}

/// What to evaluate on.
pub enum EvalSource {
    /// The run's validation split.
    Validation,
    /// Text (or a `.bin` token file) tokenised with the run's tokenizer.
    Data(PathBuf),
    /// A file of little-endian u32 token ids.
    Tokens(PathBuf),
}

#[derive(Clone, Copy, Debug, Serialize)]
pub struct EvalResult {
    /// Mean cross-entropy in nats per target token (auxiliary losses excluded).
    pub loss: f64,
    /// Targets scored.
    pub tokens: usize,
}

/// The tokens `source` names for the model in `l`.
pub fn eval_tokens(l: &Loaded, source: &EvalSource) -> Result<Vec<u32>> {
    let vocab = l.cfg.model.vocab_size;
    match source {
        EvalSource::Tokens(p) => {
            let tokens = TokenFile::open(p)?.tokens().to_vec();
            check_ids(&tokens, vocab, &p.display().to_string())?;
            Ok(tokens)
        }
        EvalSource::Data(p) => {
            if !p.exists() {
                bail!("--data {}: no such file or directory", p.display());
            }
            load_eval_tokens(p, &*l.tokenizer()?, vocab)
        }
        EvalSource::Validation => {
            // The run's own split when the checkpoint sits in its run directory; otherwise
            // rebuild it from the configuration (deterministic).
            if let Some(run) = l.run_dir() {
                let val = run.join("data").join(ganymede_data::VAL_FILE);
                if val.is_file() {
                    return Ok(TokenFile::open(&val)?.tokens().to_vec());
                }
            }
            let m = &l.cfg.model;
            let ds = Dataset::build(&l.cfg.data, m.vocab_size, m.seq_len, 0, None)?;
            Ok(ds.all_val_tokens())
        }
    }
}

/// Mean cross-entropy over consecutive windows of `seq_len + 1` tokens (a final partial window
/// is dropped), in batches of `training.batch_size` windows.
pub fn evaluate(l: &Loaded, tokens: &[u32]) -> Result<EvalResult> {
    let seq = l.cfg.model.seq_len;
    let n = num_eval_windows(tokens.len(), seq);
    if n == 0 {
        bail!(
            "eval: {} tokens are fewer than one window of model.seq_len + 1 = {}",
            tokens.len(),
            seq + 1
        );
    }
    let be: &dyn Backend = &l.be;
    let mode = l.cfg.activation_checkpoint.mode;
    let batch = l.cfg.training.batch_size.min(n);
    let windows: Vec<(&[u32], &[u32])> = eval_windows(tokens, seq).collect();
    let mut ws = Workspace::new(be, &l.model, batch, seq, mode);
    let mut tail_ws = None;
    let mut sum = 0.0f64;
    for chunk in windows.chunks(batch) {
        let x: Vec<u32> = chunk.iter().flat_map(|w| w.0.iter().copied()).collect();
        let y: Vec<u32> = chunk.iter().flat_map(|w| w.1.iter().copied()).collect();
        let ws = if chunk.len() == batch {
            &mut ws
        } else {
            tail_ws.get_or_insert_with(|| Workspace::new(be, &l.model, chunk.len(), seq, mode))
        };
        let tokens = Tokens {
            inputs: &x,
            targets: &y,
            doc_starts: None,
        };
        let out = forward_loss(be, &l.model, &l.params, ws, tokens);
        // The step's loss is a mean over its targets; weight by them for the global mean.
        sum += out.loss * (chunk.len() * seq) as f64;
    }
    let tokens = n * seq;
    Ok(EvalResult {
        loss: sum / tokens as f64,
        tokens,
    })
}

/// Sampling settings of `ganymede generate`.
#[derive(Clone, Debug)]
pub struct GenerateOptions {
    pub max_new_tokens: usize,
    pub temperature: f32,
    pub top_k: usize,
    pub seed: u64,
}

/// Continue `prompt`; returns the generated text (without the prompt).
pub fn generate_text(l: &Loaded, prompt: &str, o: &GenerateOptions) -> Result<String> {
    let tk = l.tokenizer()?;
    let ids = tk.encode_bytes(prompt.as_bytes())?;
    if ids.is_empty() {
        bail!("generate: the prompt is empty");
    }
    if !(o.temperature >= 0.0 && o.temperature.is_finite()) {
        bail!("generate: --temperature {} must be >= 0", o.temperature);
    }
    let sampling = Sampling {
        max_new_tokens: o.max_new_tokens,
        temperature: o.temperature,
        top_k: o.top_k,
        seed: o.seed,
    };
    let out = generate(&l.be, &l.model, &l.params, &ids, sampling);
    Ok(tk.decode(&out))
}

/// [`generate_text`] handing the text to `emit` as it is drawn, a piece per token once its
/// bytes make whole characters (an incomplete UTF-8 sequence waits for the next tokens), so a
/// long generation shows progress and an interrupted one keeps what it printed.
pub fn generate_stream(
    l: &Loaded,
    prompt: &str,
    o: &GenerateOptions,
    emit: &mut dyn FnMut(&str),
) -> Result<()> {
    let tk = l.tokenizer()?;
    let ids = tk.encode_bytes(prompt.as_bytes())?;
    if ids.is_empty() {
        bail!("generate: the prompt is empty");
    }
    if !(o.temperature >= 0.0 && o.temperature.is_finite()) {
        bail!("generate: --temperature {} must be >= 0", o.temperature);
    }
    let sampling = Sampling {
        max_new_tokens: o.max_new_tokens,
        temperature: o.temperature,
        top_k: o.top_k,
        seed: o.seed,
    };
    let mut pending: Vec<u32> = Vec::new();
    let mut on_token = |t: u32| {
        pending.push(t);
        let text = tk.decode(&pending);
        // A character is at most 4 bytes: past that, what decodes as U+FFFD is really invalid.
        if !text.ends_with('\u{FFFD}') || pending.len() >= 4 {
            emit(&text);
            pending.clear();
        }
    };
    generate_streaming(&l.be, &l.model, &l.params, &ids, sampling, &mut on_token);
    if !pending.is_empty() {
        emit(&tk.decode(&pending));
    }
    Ok(())
}

//! Named model and job shapes ("flavors").

use crate::{ConfigError, JobConfig};

pub const PRESETS: &[&str] = &[
    "tiny",
    "small",
    "medium",
    "large",
    "europa-1t",
    "europa-1t-slice",
];

const TINY: &str = r#"
# About 0.45M parameters: byte vocabulary, the default for `ganymede train`.
[model]
vocab_size = 256
hidden = 64
layers = 2
heads = 4
kv_heads = 2
head_dim = 16
experts = 8
top_k = 2
expert_hidden = 128
seq_len = 128
# Measured (BENCHMARKS.md, routing sweep): 0.001 left the busiest expert at ~2.7x the mean load;
# 0.03 keeps it near 1.1x at the same validation loss, and exports to Qwen3-MoE as is.
aux_loss_coef = 0.03

[training]
steps = 600
batch_size = 8

[optimizer]
lr = 0.01
warmup_steps = 30
"#;

const SMALL: &str = r#"
# About 15.5M parameters: a 4096-token BPE vocabulary trained on the corpus. For benchmarks.
[model]
vocab_size = 4096
hidden = 256
layers = 4
heads = 8
kv_heads = 4
head_dim = 32
experts = 16
top_k = 4
expert_hidden = 256
seq_len = 256
# Measured (BENCHMARKS.md, routing sweep, 60 steps): 0.03 balances better than 0.01 (1.4x
# against 1.7x the mean load by step 60) at a lower validation loss; 0.1 balances no better and
# costs loss.
aux_loss_coef = 0.03

[training]
steps = 200
batch_size = 8

[data]
tokenizer = "bpe"
"#;

const MEDIUM: &str = r#"
# About 1.31B total / 0.25B active parameters, sized for one GPU (an H200): the GPU speed
# comparison against PyTorch (issue 9). The byte tokenizer over the built-in corpus (ids below 256
# of the 32,768): only speed is measured at this size, and a 32,768-token BPE would need more text
# than the built-in corpus holds.
[model]
vocab_size = 32768
hidden = 1024
layers = 12
heads = 16
kv_heads = 4
head_dim = 64
experts = 64
top_k = 8
expert_hidden = 512
seq_len = 4096
aux_loss_coef = 0.03

[training]
steps = 100
batch_size = 4
# The GPU configuration PyTorch is run in beside it: bf16 GEMM operands over fp32 master
# weights (as autocast), and no activation checkpointing, which `ganymede plan --set
# device.kind=cuda` predicts at 35.5 GiB of an H200's 138.4 usable (with full checkpointing 22.0).
compute_dtype = "bf16"

[activation_checkpoint]
mode = "none"
"#;

const LARGE: &str = r#"
# About 5.08B total / 0.85B active parameters, the showcase shape for one H200 (issue 32): hidden
# 2048, 12 layers, 32 query / 4 KV heads of 64, 64 experts top-8 of hidden 1024, sequence 4096.
# One optimizer step is 32 sequences (131,072 tokens) in 16 microbatches of 2, as a real job
# accumulates gradients. Compute as `medium`'s: bf16 GEMM operands over fp32 master weights,
# every activation kept. `ganymede plan --preset large --cluster dgx-h200 --nodes 1
# --gpus-per-node 1` predicts 102.3 GiB of the H200's usable 138.4 with AdamW, 84.3 GiB with Muon.
# An 80 GB H100 cannot hold it with AdamW (fp32 weights, gradients and two moments are 16 bytes
# a parameter, 75.7 GiB before any activation): there `--set model.layers=8` (3.43B, 69.7 GiB
# with AdamW) keeps every per-layer shape.
[model]
vocab_size = 32768
hidden = 2048
layers = 12
heads = 32
kv_heads = 4
head_dim = 64
experts = 64
top_k = 8
expert_hidden = 1024
seq_len = 4096
aux_loss_coef = 0.03

[training]
steps = 50
batch_size = 32
micro_batch_size = 2
compute_dtype = "bf16"

[activation_checkpoint]
mode = "none"

[device]
kind = "cuda"
"#;

const EUROPA_1T: &str = r#"
# The write-up's ~1T model. The write-up gives layers, hidden, experts, top-k, expert hidden,
# vocabulary and sequence; the attention shape and the shared expert are our reconstruction:
# 48 query and 16 KV heads of dimension 128 plus one shared expert of hidden 1792 give
# 951.80B total / 32.77B active parameters with vocabulary 256,000 (the write-up: 951.9B / 32.8B).
# Every layer is MoE: total - active = 74 * 376 * 3 * 6144 * 1792 pins that.
[model]
vocab_size = 256000
hidden = 6144
layers = 74
heads = 48
kv_heads = 16
head_dim = 128
experts = 384
top_k = 8
expert_hidden = 1792
shared_experts = 1
shared_expert_hidden = 1792
seq_len = 65536

[training]
batch_size = 384

[parallelism]
dp_shard = 384
ep = 4
"#;

const EUROPA_1T_SLICE: &str = r#"
# One rank's share of one `europa-1t` decoder layer at the write-up's shapes, for one GPU
# (issue 37): hidden 6144, europa-1t's 48 query / 16 KV heads of 128, the 96 of 384 experts
# of 6144 x 1792 that one rank holds under ep = 4, top-8, one shared expert; one sequence of
# 65,536 tokens. All 8 of each token's routed rows land on this rank's 96 experts, so the
# experts see 65,536 x 8 rows, as many as a rank receives under the real job's balanced
# expert parallelism. The router picks among 96 instead of 384 (0.6 M of the layer's 2.9 B
# parameters). The vocabulary is small so that the embedding and head do not hide the layer.
# bf16 compute, full checkpointing with the block boundary offloaded, optimizer state in host
# memory: the write-up's policy.
[model]
vocab_size = 4096
hidden = 6144
layers = 1
heads = 48
kv_heads = 16
head_dim = 128
experts = 96
top_k = 8
expert_hidden = 1792
shared_experts = 1
shared_expert_hidden = 1792
seq_len = 65536

[training]
batch_size = 1
steps = 4
compute_dtype = "bf16"
loss_chunk_tokens = 4096

[activation_checkpoint]
mode = "full"
offload_fraction = 1.0

[optimizer]
offload = true
"#;

/// The job config of a named preset.
pub fn preset(name: &str) -> Result<JobConfig, ConfigError> {
    let text = match name {
        "tiny" => TINY,
        "small" => SMALL,
        "medium" => MEDIUM,
        "large" => LARGE,
        "europa-1t" => EUROPA_1T,
        "europa-1t-slice" => EUROPA_1T_SLICE,
        other => return Err(ConfigError::UnknownPreset(other.to_string())),
    };
    JobConfig::from_toml_str(text, &format!("preset {name}"))
}

//! The Hugging Face round trip: `train --init-from hf:DIR` reads a Qwen3 / Qwen3-MoE folder
//! (sharded or not, experts per expert or fused), `export --format hf` writes sharded safetensors
//! tensor by tensor, and sparse upcycling starts an MoE from a dense Qwen3.
//!
//! Folders made here in Rust (random f32 weights under `transformers`' names) hold the import and
//! export to bit-exactness through gathered and per-rank-shard checkpoints, the upcycled loss and
//! every refusal without Python; folders made by `transformers` itself
//! (`scripts/hf_roundtrip.py`) check the losses against `transformers` and that it loads the
//! export, and print SKIPPED without a Python that has it.

mod util;
use ganymede_train::st_file::{StFile, StWriter};
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use util::{fails, ganymede, ok, python_with_transformers, TempDir};

const VOCAB: usize = 320;
const SEQ: usize = 16;

/// The shape of the folders made here.
#[derive(Clone, Copy, PartialEq)]
enum Kind {
    /// Qwen3MoeForCausalLM: layer 0 dense (mlp_only_layers), layers 1-2 routed.
    Moe,
    /// Qwen3ForCausalLM: two dense layers.
    Dense,
}

const H: usize = 32;
const HEADS: usize = 4;
const KV: usize = 2;
const HD: usize = 8;
const FD: usize = 48;
const F: usize = 16;
const E: usize = 4;

fn config(kind: Kind) -> Value {
    let mut c = json!({
        "vocab_size": VOCAB,
        "hidden_size": H,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV,
        "head_dim": HD,
        "intermediate_size": FD,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "max_position_embeddings": 512,
        "tie_word_embeddings": false,
        "attention_bias": false,
        "use_sliding_window": false,
        "sliding_window": null,
        "rope_scaling": null,
    });
    match kind {
        Kind::Moe => {
            c["architectures"] = json!(["Qwen3MoeForCausalLM"]);
            c["model_type"] = json!("qwen3_moe");
            c["num_hidden_layers"] = json!(3);
            c["num_experts"] = json!(E);
            c["num_experts_per_tok"] = json!(2);
            c["moe_intermediate_size"] = json!(F);
            c["norm_topk_prob"] = json!(true);
            c["decoder_sparse_step"] = json!(1);
            c["mlp_only_layers"] = json!([0]);
        }
        Kind::Dense => {
            c["architectures"] = json!(["Qwen3ForCausalLM"]);
            c["model_type"] = json!("qwen3");
            c["num_hidden_layers"] = json!(2);
        }
    }
    c
}

/// Every tensor of the folder in `transformers`' per-expert names, with its values.
fn tensors(kind: Kind, seed: u32) -> Vec<(String, Vec<usize>, Vec<f32>)> {
    let mut x = seed.wrapping_mul(2_654_435_761).max(1);
    let mut t = |name: String, shape: Vec<usize>| {
        let n: usize = shape.iter().product();
        let norm = name.ends_with("norm.weight");
        let v = (0..n)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 17;
                x ^= x << 5;
                let r = x as f32 / u32::MAX as f32 - 0.5;
                if norm {
                    1.0 + 0.2 * r
                } else {
                    0.2 * r
                }
            })
            .collect();
        (name, shape, v)
    };
    let mut out = vec![t("model.embed_tokens.weight".into(), vec![VOCAB, H])];
    let layers = if kind == Kind::Moe { 3 } else { 2 };
    for l in 0..layers {
        let p = format!("model.layers.{l}");
        out.push(t(format!("{p}.input_layernorm.weight"), vec![H]));
        out.push(t(
            format!("{p}.self_attn.q_proj.weight"),
            vec![HEADS * HD, H],
        ));
        out.push(t(format!("{p}.self_attn.k_proj.weight"), vec![KV * HD, H]));
        out.push(t(format!("{p}.self_attn.v_proj.weight"), vec![KV * HD, H]));
        out.push(t(
            format!("{p}.self_attn.o_proj.weight"),
            vec![H, HEADS * HD],
        ));
        out.push(t(format!("{p}.self_attn.q_norm.weight"), vec![HD]));
        out.push(t(format!("{p}.self_attn.k_norm.weight"), vec![HD]));
        out.push(t(format!("{p}.post_attention_layernorm.weight"), vec![H]));
        if kind == Kind::Moe && l > 0 {
            out.push(t(format!("{p}.mlp.gate.weight"), vec![E, H]));
            for j in 0..E {
                out.push(t(
                    format!("{p}.mlp.experts.{j}.gate_proj.weight"),
                    vec![F, H],
                ));
                out.push(t(format!("{p}.mlp.experts.{j}.up_proj.weight"), vec![F, H]));
                out.push(t(
                    format!("{p}.mlp.experts.{j}.down_proj.weight"),
                    vec![H, F],
                ));
            }
        } else {
            out.push(t(format!("{p}.mlp.gate_proj.weight"), vec![FD, H]));
            out.push(t(format!("{p}.mlp.up_proj.weight"), vec![FD, H]));
            out.push(t(format!("{p}.mlp.down_proj.weight"), vec![H, FD]));
        }
    }
    out.push(t("model.norm.weight".into(), vec![H]));
    out.push(t("lm_head.weight".into(), vec![VOCAB, H]));
    out
}

/// The per-expert tensors of each routed layer fused as `transformers` 5 holds them:
/// `gate_up_proj` `[E, 2F, H]` (each expert's gate rows, then its up rows), `down_proj`
/// `[E, H, F]`.
fn fuse(ts: Vec<(String, Vec<usize>, Vec<f32>)>) -> Vec<(String, Vec<usize>, Vec<f32>)> {
    let get = |n: &str| ts.iter().find(|t| t.0 == n).unwrap().2.clone();
    let mut out: Vec<_> = ts
        .iter()
        .filter(|t| !t.0.contains(".mlp.experts."))
        .cloned()
        .collect();
    for l in 1..3 {
        let p = format!("model.layers.{l}.mlp.experts");
        let (mut gu, mut down) = (vec![], vec![]);
        for j in 0..E {
            gu.extend(get(&format!("{p}.{j}.gate_proj.weight")));
            gu.extend(get(&format!("{p}.{j}.up_proj.weight")));
            down.extend(get(&format!("{p}.{j}.down_proj.weight")));
        }
        out.push((format!("{p}.gate_up_proj"), vec![E, 2 * F, H], gu));
        out.push((format!("{p}.down_proj"), vec![E, H, F], down));
    }
    out
}

/// Write `ts` as a folder: `config.json`, the tokenizer, and `files` safetensors files (with an
/// index when more than one).
fn write_folder(
    dir: &Path,
    config: &Value,
    ts: &[(String, Vec<usize>, Vec<f32>)],
    files: usize,
    tokenizer: &Path,
) {
    std::fs::create_dir_all(dir).unwrap();
    std::fs::write(
        dir.join("config.json"),
        serde_json::to_string_pretty(config).unwrap(),
    )
    .unwrap();
    std::fs::copy(tokenizer, dir.join("tokenizer.json")).unwrap();
    let per = ts.len().div_ceil(files);
    let mut map = serde_json::Map::new();
    for (k, chunk) in ts.chunks(per).enumerate() {
        let name = if files == 1 {
            "model.safetensors".to_string()
        } else {
            format!("model-{:05}-of-{files:05}.safetensors", k + 1)
        };
        let plan: Vec<(String, Vec<usize>)> =
            chunk.iter().map(|t| (t.0.clone(), t.1.clone())).collect();
        let mut w = StWriter::create(&dir.join(&name), &plan, &[("format", "pt")]).unwrap();
        for t in chunk {
            w.write(&t.2).unwrap();
            map.insert(t.0.clone(), json!(name));
        }
        w.finish().unwrap();
    }
    if files > 1 {
        let index = json!({ "metadata": {}, "weight_map": map });
        std::fs::write(
            dir.join("model.safetensors.index.json"),
            serde_json::to_string(&index).unwrap(),
        )
        .unwrap();
    }
}

/// `ts` written as one BF16 `model.safetensors` (each value's upper 16 bits: exact for values
/// already rounded to bf16), with the config and tokenizer.
fn write_bf16_folder(
    dir: &Path,
    config: &Value,
    ts: &[(String, Vec<usize>, Vec<f32>)],
    tokenizer: &Path,
) {
    std::fs::create_dir_all(dir).unwrap();
    std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
    std::fs::copy(tokenizer, dir.join("tokenizer.json")).unwrap();
    let mut header = serde_json::Map::new();
    let mut data = Vec::new();
    for (name, shape, v) in ts {
        let start = data.len();
        for x in v {
            data.extend_from_slice(&((x.to_bits() >> 16) as u16).to_le_bytes());
        }
        header.insert(
            name.clone(),
            json!({ "dtype": "BF16", "shape": shape, "data_offsets": [start, data.len()] }),
        );
    }
    let mut h = serde_json::to_vec(&Value::Object(header)).unwrap();
    while !h.len().is_multiple_of(8) {
        h.push(b' ');
    }
    let mut file = (h.len() as u64).to_le_bytes().to_vec();
    file.extend_from_slice(&h);
    file.extend_from_slice(&data);
    std::fs::write(dir.join("model.safetensors"), file).unwrap();
}

/// Every tensor of a folder (through its index if it has one), as raw f32 bit patterns.
fn read_folder(dir: &Path) -> BTreeMap<String, (Vec<usize>, Vec<u32>)> {
    let index = dir.join("model.safetensors.index.json");
    let files: Vec<String> = if index.is_file() {
        let v: Value = serde_json::from_str(&std::fs::read_to_string(&index).unwrap()).unwrap();
        let mut f: Vec<String> = v["weight_map"]
            .as_object()
            .unwrap()
            .values()
            .map(|x| x.as_str().unwrap().to_string())
            .collect();
        f.sort();
        f.dedup();
        f
    } else {
        vec!["model.safetensors".into()]
    };
    let mut out = BTreeMap::new();
    for f in files {
        let st = StFile::open(&dir.join(f)).unwrap();
        for (name, e) in &st.tensors {
            let mut v = vec![];
            st.read_into(e, 0, e.numel(), &mut v).unwrap();
            out.insert(
                name.clone(),
                (e.shape.clone(), v.iter().map(|x| x.to_bits()).collect()),
            );
        }
    }
    out
}

fn assert_same_tensors(a: &Path, b: &Path) {
    let (x, y) = (read_folder(a), read_folder(b));
    assert_eq!(
        x.keys().collect::<Vec<_>>(),
        y.keys().collect::<Vec<_>>(),
        "{} and {} hold different tensors",
        a.display(),
        b.display()
    );
    for (k, v) in &x {
        assert!(
            v == &y[k],
            "{k} differs between {} and {}",
            a.display(),
            b.display()
        );
    }
}

/// A BPE tokenizer of at most 300 ids (below VOCAB) trained on the README.
fn tokenizer(d: &Path) -> PathBuf {
    let text = d.join("text.txt");
    std::fs::write(&text, include_str!("../../../README.md")).unwrap();
    let tok = d.join("tok.json");
    ok(ganymede(
        d,
        &[
            "tokenizer",
            "train",
            "--input",
            text.to_str().unwrap(),
            "--vocab-size",
            "300",
            "--out",
            tok.to_str().unwrap(),
        ],
        &[],
    ));
    tok
}

/// Token ids below 300 in windows of SEQ + 1.
fn token_file(d: &Path) -> PathBuf {
    let p = d.join("tokens.bin");
    let mut x = 12345u32;
    let ids: Vec<u8> = (0..(SEQ + 1) * 24)
        .flat_map(|_| {
            x = x.wrapping_mul(1_103_515_245).wrapping_add(12345);
            ((x >> 8) % 300).to_le_bytes()
        })
        .collect();
    std::fs::write(&p, ids).unwrap();
    p
}

fn s(p: &Path) -> String {
    p.display().to_string()
}

/// `train --init-from hf:DIR --stop-after 0`: the imported weights as a step-0 checkpoint.
fn import(d: &Path, hf: &Path, run: &Path, extra: &[&str]) -> String {
    let seq = format!("model.seq_len={SEQ}");
    let (hf_arg, run_arg) = (format!("hf:{}", s(hf)), s(run));
    let mut args = vec![
        "train",
        "--init-from",
        &hf_arg,
        "--set",
        &seq,
        "--stop-after",
        "0",
        "--out",
        &run_arg,
    ];
    args.extend_from_slice(extra);
    ok(ganymede(d, &args, &[]))
}

fn eval_loss(d: &Path, run: &Path, tokens: &Path) -> f64 {
    let out = ok(ganymede(
        d,
        &[
            "eval",
            "--checkpoint",
            &s(run),
            "--tokens",
            &s(tokens),
            "--json",
        ],
        &[],
    ));
    let v: Value = serde_json::from_str(out.trim()).unwrap();
    v["loss"].as_f64().unwrap()
}

fn export(d: &Path, run: &Path, out: &Path, shard: &str) -> String {
    ok(ganymede(
        d,
        &[
            "export",
            "--checkpoint",
            &s(run),
            "--out",
            &s(out),
            "--max-shard-size",
            shard,
            // Some tests export again over an earlier export of theirs (its stale shards must
            // go); a new or empty --out needs no --force.
            "--force",
        ],
        &[],
    ))
}

#[test]
fn import_then_export_is_bit_exact_from_gathered_and_per_rank_shard_checkpoints() {
    let d = TempDir::new("hf-rt");
    let tok = tokenizer(d.path());
    let ts = tensors(Kind::Moe, 1);
    let hf = d.path().join("hf");
    write_folder(&hf, &config(Kind::Moe), &ts, 4, &tok);

    // Gathered: one process.
    let run = d.path().join("run");
    import(d.path(), &hf, &run, &[]);
    let out = d.path().join("out");
    let said = export(d.path(), &run, &out, "20KB");
    assert!(said.contains("Qwen3MoeForCausalLM"), "{said}");
    assert_same_tensors(&hf, &out);
    // 20 KB files: the 40 KB embedding alone, several files and an index naming each tensor.
    let index: Value = serde_json::from_str(
        &std::fs::read_to_string(out.join("model.safetensors.index.json")).unwrap(),
    )
    .unwrap();
    let files: std::collections::BTreeSet<&str> = index["weight_map"]
        .as_object()
        .unwrap()
        .values()
        .map(|v| v.as_str().unwrap())
        .collect();
    assert!(files.len() >= 4, "{files:?}");
    for f in &files {
        let len = std::fs::metadata(out.join(f)).unwrap().len();
        let st = StFile::open(&out.join(f)).unwrap();
        assert!(
            len < 20_000 + 4096 || st.tensors.len() == 1,
            "{f}: {len} bytes with {} tensors",
            st.tensors.len()
        );
    }
    assert_eq!(
        index["metadata"]["total_size"].as_u64().unwrap(),
        ts.iter().map(|t| t.2.len() as u64 * 4).sum::<u64>()
    );
    let written: Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("config.json")).unwrap()).unwrap();
    assert_eq!(written["mlp_only_layers"], json!([0]));
    assert!(out.join("generation_config.json").is_file());
    // One large file: the shards and index of the previous export are gone.
    export(d.path(), &run, &out, "5GB");
    assert!(!out.join("model.safetensors.index.json").exists());
    assert_same_tensors(&hf, &out);

    // Per-rank shards: two ranks with expert parallelism each read their own parts, save their
    // own shards, and the export reads those by range.
    let run2 = d.path().join("run2");
    import(
        d.path(),
        &hf,
        &run2,
        &[
            "--ranks",
            "2",
            "--set",
            "parallelism.sharded_checkpoints=true",
            "--set",
            "parallelism.ep=2",
        ],
    );
    let ck = run2.join("checkpoints/step_00000000");
    assert!(
        ck.join("shards.json").is_file(),
        "not a per-rank checkpoint"
    );
    let out2 = d.path().join("out2");
    export(d.path(), &run2, &out2, "20KB");
    assert_same_tensors(&hf, &out2);

    // The same weights with fused experts, in one file: the same export.
    let fused = d.path().join("fused");
    write_folder(&fused, &config(Kind::Moe), &fuse(ts.clone()), 1, &tok);
    let run3 = d.path().join("run3");
    import(d.path(), &fused, &run3, &[]);
    let out3 = d.path().join("out3");
    export(d.path(), &run3, &out3, "1MB");
    assert_same_tensors(&hf, &out3);

    // BF16 weights import exactly (the export holds them in f32): the same values written as
    // BF16 and as F32 give the same export.
    let rounded: Vec<_> = ts
        .iter()
        .map(|(n, sh, v)| {
            let r = v.iter().map(|x| f32::from_bits(x.to_bits() & 0xffff_0000));
            (n.clone(), sh.clone(), r.collect::<Vec<f32>>())
        })
        .collect();
    let (b16, f32s) = (d.path().join("bf16"), d.path().join("f32-rounded"));
    write_bf16_folder(&b16, &config(Kind::Moe), &rounded, &tok);
    write_folder(&f32s, &config(Kind::Moe), &rounded, 2, &tok);
    let run5 = d.path().join("run5");
    import(d.path(), &b16, &run5, &[]);
    let out5 = d.path().join("out5");
    export(d.path(), &run5, &out5, "1MB");
    assert_same_tensors(&f32s, &out5);

    // Training continues from the import, on one rank and on two (from the per-rank shards).
    let t = ok(ganymede(
        d.path(),
        &["train", "--resume", &s(&run), "--steps", "3"],
        &[],
    ));
    assert!(t.contains("steps 1..3"), "{t}");
    let losses = util::losses(&run);
    assert_eq!(losses.len(), 3);
    assert!(losses.iter().all(|l| l.is_finite()), "{losses:?}");
    ok(ganymede(
        d.path(),
        &[
            "train",
            "--resume",
            &s(&run2),
            "--steps",
            "2",
            "--ranks",
            "2",
        ],
        &[],
    ));
    // Training straight from the folder on two ranks (no ep) starts where the per-rank-shard
    // checkpoint (ep 2) resumes: the same weights on the same batches. (Losses at another rank
    // count differ slightly: each rank draws its own part of the batch.)
    let l2 = util::losses(&run2);
    let run4 = d.path().join("run4");
    let seq = format!("model.seq_len={SEQ}");
    ok(ganymede(
        d.path(),
        &[
            "train",
            "--init-from",
            &format!("hf:{}", s(&hf)),
            "--set",
            &seq,
            "--steps",
            "2",
            "--ranks",
            "2",
            "--out",
            &s(&run4),
        ],
        &[],
    ));
    let l4 = util::losses(&run4);
    assert!((l2[0] - l4[0]).abs() < 1e-9 * l4[0], "{l2:?} vs {l4:?}");
}

#[test]
fn upcycled_moe_starts_at_the_dense_models_loss_and_trains() {
    let d = TempDir::new("hf-up");
    let tok = tokenizer(d.path());
    let tokens = token_file(d.path());
    let hf = d.path().join("dense");
    write_folder(&hf, &config(Kind::Dense), &tensors(Kind::Dense, 2), 3, &tok);
    let dense = d.path().join("run-dense");
    import(d.path(), &hf, &dense, &[]);
    let base = eval_loss(d.path(), &dense, &tokens);
    // The dense model exports as the dense architecture, tensor for tensor.
    let out = d.path().join("out");
    let said = export(d.path(), &dense, &out, "5GB");
    assert!(said.contains("Qwen3ForCausalLM"), "{said}");
    assert_same_tensors(&hf, &out);

    let cases: [&[&str]; 3] = [
        // Whole copies, renormalised top-2 of 4.
        &["model.experts=4", "model.top_k=2"],
        // Finer experts: each dense FFN of 48 cut into two of 24.
        &["model.experts=8", "model.top_k=2", "model.expert_hidden=24"],
        // Whole copies without renormalisation (the down projections scaled by E/k).
        &[
            "model.experts=4",
            "model.top_k=2",
            "model.norm_topk_prob=false",
        ],
    ];
    for (k, sets) in cases.iter().enumerate() {
        let run = d.path().join(format!("run-up{k}"));
        let mut extra = vec!["--set", "model.dense_layers=0"];
        for x in sets.iter() {
            extra.extend(["--set", x]);
        }
        import(d.path(), &hf, &run, &extra);
        let up = eval_loss(d.path(), &run, &tokens);
        let rel = (up - base).abs() / base;
        util::loud(&format!(
            "upcycled {sets:?}: loss {up:.9}, dense {base:.9}, relative {rel:.1e}"
        ));
        assert!(rel < 1e-5, "{sets:?}: upcycled {up} vs dense {base}");
        // The export is a Qwen3-MoE whose routers are zero and whose experts are the FFN.
        if k == 0 {
            let out = d.path().join("out-up");
            export(d.path(), &run, &out, "5GB");
            let t = read_folder(&out);
            assert!(t["model.layers.1.mlp.gate.weight"]
                .1
                .iter()
                .all(|&b| b == 0));
            let dense_gate = &read_folder(&hf)["model.layers.1.mlp.gate_proj.weight"];
            assert_eq!(
                &t["model.layers.1.mlp.experts.3.gate_proj.weight"],
                dense_gate
            );
        }
    }
    // Training runs from the upcycled model; its first loss is the dense model's first loss
    // (same weights in effect, same batch), and the router learns.
    let seq = format!("model.seq_len={SEQ}");
    let hf_arg = format!("hf:{}", s(&hf));
    let train = |run: &Path, extra: &[&str]| {
        let r = s(run);
        let mut a = vec![
            "train",
            "--init-from",
            &hf_arg,
            "--set",
            &seq,
            "--steps",
            "3",
            "--out",
            &r,
        ];
        a.extend_from_slice(extra);
        ok(ganymede(d.path(), &a, &[]));
        util::losses(run)
    };
    let ld = train(&d.path().join("t-dense"), &[]);
    let run = d.path().join("t-up");
    let lu = train(
        &run,
        &[
            "--set",
            "model.dense_layers=0",
            "--set",
            "model.experts=4",
            "--set",
            "model.top_k=2",
        ],
    );
    assert!((lu[0] - ld[0]).abs() < 1e-5 * ld[0], "{lu:?} vs {ld:?}");
    assert!(lu.iter().all(|l| l.is_finite()), "{lu:?}");
    let out = d.path().join("out-trained");
    export(d.path(), &run, &out, "5GB");
    let t = read_folder(&out);
    assert!(
        t["model.layers.0.mlp.gate.weight"]
            .1
            .iter()
            .any(|&b| b != 0),
        "the router did not train"
    );
}

#[test]
fn refusals_are_one_line_naming_the_field() {
    let d = TempDir::new("hf-refuse");
    let tok = tokenizer(d.path());
    let ts = tensors(Kind::Moe, 3);
    let try_import = |name: &str, config: &Value, ts: &[(String, Vec<usize>, Vec<f32>)], files| {
        let hf = d.path().join(name);
        write_folder(&hf, config, ts, files, &tok);
        hf
    };
    let run_err = |hf: &Path| {
        let (hf_arg, run) = (
            format!("hf:{}", s(hf)),
            s(&d.path()
                .join(format!("run-{}", hf.file_name().unwrap().to_string_lossy()))),
        );
        fails(ganymede(
            d.path(),
            &[
                "train",
                "--init-from",
                &hf_arg,
                "--stop-after",
                "0",
                "--out",
                &run,
            ],
            &[],
        ))
    };
    let mut c = config(Kind::Moe);
    c["architectures"] = json!(["LlamaForCausalLM"]);
    let e = run_err(&try_import("llama", &c, &ts, 1));
    assert!(
        e.contains("architectures") && e.contains("LlamaForCausalLM"),
        "{e}"
    );

    let mut c = config(Kind::Moe);
    c["use_sliding_window"] = json!(true);
    let e = run_err(&try_import("sliding", &c, &ts, 1));
    assert!(e.contains("use_sliding_window = true"), "{e}");

    let mut c = config(Kind::Moe);
    c["rope_scaling"] = json!({"rope_type": "yarn", "factor": 4.0});
    let e = run_err(&try_import("yarn", &c, &ts, 1));
    assert!(e.contains("rope_scaling") && e.contains("yarn"), "{e}");

    let mut c = config(Kind::Moe);
    c["mlp_only_layers"] = json!([1]);
    let e = run_err(&try_import("dense-middle", &c, &ts, 1));
    assert!(e.contains("mlp_only_layers = [1]"), "{e}");

    let hf = try_import("missing-shard", &config(Kind::Moe), &ts, 3);
    std::fs::remove_file(hf.join("model-00002-of-00003.safetensors")).unwrap();
    let e = run_err(&hf);
    assert!(
        e.contains("model-00002-of-00003.safetensors") && e.contains("missing"),
        "{e}"
    );

    let mut bad = ts.clone();
    let q = bad
        .iter_mut()
        .find(|t| t.0 == "model.layers.1.self_attn.q_proj.weight")
        .unwrap();
    q.1 = vec![H, HEADS * HD + 1];
    q.2 = vec![0.0; H * (HEADS * HD + 1)];
    let e = run_err(&try_import("shape", &config(Kind::Moe), &bad, 2));
    assert!(
        e.contains("model.layers.1.self_attn.q_proj.weight") && e.contains("shape"),
        "{e}"
    );

    let mut extra = ts.clone();
    extra.push((
        "model.layers.0.self_attn.q_proj.bias".into(),
        vec![HEADS * HD],
        vec![0.0; HEADS * HD],
    ));
    let e = run_err(&try_import("bias", &config(Kind::Moe), &extra, 1));
    assert!(e.contains("q_proj.bias") && e.contains("no place"), "{e}");

    // A tokenizer with more ids than the embedding has rows.
    let small = 200;
    let mut c = config(Kind::Moe);
    c["vocab_size"] = json!(small);
    let mut cut = ts.clone();
    for t in cut.iter_mut().filter(|t| t.1 == vec![VOCAB, H]) {
        t.1 = vec![small, H];
        t.2.truncate(small * H);
    }
    let e = run_err(&try_import("vocab", &c, &cut, 1));
    assert!(
        e.contains("vocab_size = 200") && e.contains("tokenizer.json"),
        "{e}"
    );

    // Upcycling needs experts that tile the dense FFN.
    let hf = d.path().join("dense");
    write_folder(&hf, &config(Kind::Dense), &tensors(Kind::Dense, 4), 1, &tok);
    let e = fails(ganymede(
        d.path(),
        &[
            "train",
            "--init-from",
            &format!("hf:{}", s(&hf)),
            "--set",
            "model.dense_layers=0",
            "--set",
            "model.expert_hidden=20",
            "--stop-after",
            "0",
            "--out",
            &s(&d.path().join("run-up")),
        ],
        &[],
    ));
    assert!(
        e.contains("model.expert_hidden = 20") && e.contains("48"),
        "{e}"
    );
    let e = fails(ganymede(
        d.path(),
        &["train", "--init-from", "dense", "--stop-after", "0"],
        &[],
    ));
    assert!(e.contains("hf:DIR"), "{e}");
}

fn skipped() {
    util::loud(
        "*** SKIPPED: HF round trip with transformers-made models (no Python with torch + \
         transformers + safetensors; set GANYMEDE_PYTHON) ***",
    );
}

fn script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/hf_roundtrip.py")
}

fn py_json(py: &str, args: &[&str]) -> Value {
    let o = Command::new(py)
        .arg(script())
        .args(args)
        .output()
        .expect("run python");
    let out = ok(o);
    serde_json::from_str(out.trim().lines().last().unwrap())
        .unwrap_or_else(|e| panic!("hf_roundtrip.py {args:?} printed {out}: {e}"))
}

/// Models made by `transformers` (random weights, saved sharded by `save_pretrained`): imported,
/// ganymede's loss is `transformers`' within 1e-5, training continues, the export gives back
/// every tensor bit for bit and loads in `transformers`.
#[test]
fn transformers_made_models_import_evaluate_train_and_export_exactly() {
    let Some(py) = python_with_transformers() else {
        skipped();
        return;
    };
    let d = TempDir::new("hf-py");
    let tok = tokenizer(d.path());
    let tokens = token_file(d.path());
    for (kind, extra) in [
        ("moe", &[][..]),
        ("dense", &[][..]),
        // transformers' in-memory layout (3-D experts) with tied embeddings.
        ("moe", &["--fused", "--tied"][..]),
    ] {
        let tag = format!("{kind}{}", extra.join(""));
        let hf = d.path().join(format!("hf-{tag}"));
        let mut a = vec![
            "make",
            kind,
            hf.to_str().unwrap(),
            "--tokenizer",
            tok.to_str().unwrap(),
            "--vocab",
            "320",
            "--max-shard-size",
            "40KB",
        ];
        a.extend_from_slice(extra);
        let made = py_json(&py, &a);
        if extra.is_empty() {
            assert!(
                made["files"].as_array().unwrap().len() > 1,
                "not sharded: {made}"
            );
        }
        let run = d.path().join(format!("run-{tag}"));
        import(d.path(), &hf, &run, &[]);
        let ours = eval_loss(d.path(), &run, &tokens);
        let out = d.path().join(format!("out-{tag}"));
        export(d.path(), &run, &out, "40KB");
        // transformers scores the folder, loads the export (no missing or unexpected weights) as
        // the same architecture and scores it, and compares the two folders' tensors.
        let seq = SEQ.to_string();
        let c = py_json(
            &py,
            &[
                "check",
                hf.to_str().unwrap(),
                out.to_str().unwrap(),
                tokens.to_str().unwrap(),
                &seq,
            ],
        );
        let theirs = c["loss"].as_f64().unwrap();
        let rel = (ours - theirs).abs() / theirs;
        util::loud(&format!(
            "HF import {tag}: ganymede {ours:.9}, transformers {theirs:.9}, relative {rel:.1e}"
        ));
        assert!(
            rel < 1e-5,
            "{tag}: ganymede {ours} vs transformers {theirs}"
        );
        let arch = if kind == "moe" {
            "Qwen3MoeForCausalLM"
        } else {
            "Qwen3ForCausalLM"
        };
        assert_eq!(c["architecture"], arch, "{c}");
        let again = c["export_loss"].as_f64().unwrap();
        assert!(
            (again - theirs).abs() < 1e-6 * theirs,
            "{tag}: {again} vs {theirs}"
        );
        if extra.is_empty() {
            // Bit for bit (the tied folder has no lm_head.weight; the export has one).
            assert_eq!(c["differ"], json!([]), "{tag}: {c}");
            assert!(c["tensors"].as_u64().unwrap() > 20, "{c}");
        }

        let t = ok(ganymede(
            d.path(),
            &["train", "--resume", &s(&run), "--steps", "3"],
            &[],
        ));
        assert!(t.contains("steps 1..3"), "{t}");
        let l = util::losses(&run);
        assert!(l.len() == 3 && l.iter().all(|x| x.is_finite()), "{l:?}");
    }
}

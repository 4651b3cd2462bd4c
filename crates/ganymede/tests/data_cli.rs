//! `ganymede data prepare` and training from its shards, through the binary: weighted sources
//! with per-source validation, a resume that is bit-identical, data that changed refused at
//! resume, the same step at 1 and 2 ranks, and memory that does not grow with the corpus.

mod util;

use std::io::Write;
use std::path::Path;
use util::{fails, ganymede, losses, ok, TempDir};

/// `langs` folders of generated documents: `en` as text files, `de` as JSONL.gz, `fr` as parquet.
fn corpus(root: &Path, docs: usize, words_per_doc: usize) {
    for (lang, w) in [
        (
            "en",
            ["the", "river", "runs", "past", "old", "mills", "and"],
        ),
        (
            "de",
            ["der", "Fluss", "läuft", "an", "alten", "Mühlen", "und"],
        ),
        (
            "fr",
            ["la", "rivière", "passe", "près", "des", "moulins", "et"],
        ),
    ] {
        let dir = root.join(lang);
        std::fs::create_dir_all(&dir).unwrap();
        let text: Vec<String> = (0..docs)
            .map(|i| {
                (0..words_per_doc + i % 13)
                    .map(|j| w[(i * 5 + j * j) % w.len()])
                    .collect::<Vec<_>>()
                    .join(" ")
            })
            .collect();
        match lang {
            "en" => {
                for (i, d) in text.iter().enumerate() {
                    std::fs::write(dir.join(format!("{i:06}")), d).unwrap();
                }
            }
            "de" => {
                let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
                for d in &text {
                    writeln!(gz, "{}", serde_json::json!({ "text": d })).unwrap();
                }
                std::fs::write(dir.join("all.jsonl.gz"), gz.finish().unwrap()).unwrap();
            }
            _ => {
                let refs: Vec<&str> = text.iter().map(|s| s.as_str()).collect();
                ganymede_data::write_text_parquet(&dir.join("all.parquet"), "text", &refs, 64)
                    .unwrap();
            }
        }
    }
}

fn args(v: &[&str]) -> Vec<String> {
    v.iter().map(|s| s.to_string()).collect()
}

fn prepare(cwd: &Path, corpus: &Path, out: &Path) -> String {
    ok(ganymede(
        cwd,
        &args(&[
            "data",
            "prepare",
            "--sources-in",
            &corpus.display().to_string(),
            "--out",
            &out.display().to_string(),
            "--eod",
            "id:256",
            "--shard-tokens",
            "30000",
            "--workers",
            "2",
        ]),
        &[],
    ))
}

fn train(cwd: &Path, job: &[String], out: &Path, extra: &[&str]) -> std::process::Output {
    let mut a = args(&["train", "--out", &out.display().to_string()]);
    a.extend(job.iter().cloned());
    a.extend(extra.iter().map(|s| s.to_string()));
    ganymede(cwd, &a, &[])
}

fn metric_lines(run: &Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(run.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

#[test]
fn prepare_then_train_on_weighted_sources() {
    let t = TempDir::new("data-cli");
    let root = t.path().join("corpus");
    corpus(&root, 400, 30);
    let prep = t.path().join("prep");
    let out = prepare(t.path(), &root, &prep);
    for lang in ["en", "de", "fr"] {
        assert!(out.contains(&format!("{lang}: 400 documents")), "{out}");
    }
    // A tiny model over bytes plus the end-of-document id, on two of the three sources.
    let sources = format!("data.sources={0}/en:0.3,{0}/fr:0.7", prep.display());
    let job: Vec<String> = [
        "model.vocab_size=257",
        "training.steps=6",
        "metrics.val_every=3",
        "metrics.val_batches=1",
        "checkpoint.interval=3",
        &sources,
    ]
    .iter()
    .flat_map(|s| ["--set".to_string(), s.to_string()])
    .collect();
    let config = &job;
    let run = t.path().join("run");
    let o = ok(train(t.path(), config, &run, &[]));
    assert!(o.contains("en (") && o.contains("weight 0.300"), "{o}");
    let m = metric_lines(&run);
    assert_eq!(m.len(), 6);
    for k in ["val_loss", "val_loss/en", "val_loss/fr"] {
        assert!(m[2].get(k).is_some_and(|v| v.is_f64()), "{k}: {}", m[2]);
    }
    assert!(m[2].get("val_loss/de").is_none());
    let (en, fr) = (
        m[2]["val_loss/en"].as_f64().unwrap(),
        m[2]["val_loss/fr"].as_f64().unwrap(),
    );
    let mean = m[2]["val_loss"].as_f64().unwrap();
    assert!(
        (mean - (0.3 * en + 0.7 * fr)).abs() < 1e-9,
        "{mean} {en} {fr}"
    );
    // Nothing was tokenised or copied into the run: only the record of the sources.
    let data_files: Vec<String> = std::fs::read_dir(run.join("data"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(
        data_files,
        vec!["sources.json".to_string()],
        "{data_files:?}"
    );

    // Killed while saving step 6, resumed from step 3: the same losses, bit for bit.
    let crashed = t.path().join("crashed");
    let mut a = args(&["train", "--out", &crashed.display().to_string()]);
    a.extend(job.iter().cloned());
    let r = ganymede(t.path(), &a, &[("GANYMEDE_CRASH_AT_CHECKPOINT", "6")]);
    assert!(!r.status.success());
    a = args(&["train", "--resume", &crashed.display().to_string()]);
    ok(ganymede(t.path(), &a, &[]));
    let (x, y) = (losses(&run), losses(&crashed));
    assert_eq!(x.len(), y.len());
    for (i, (p, q)) in x.iter().zip(&y).enumerate() {
        assert_eq!(p.to_bits(), q.to_bits(), "step {}: {p} vs {q}", i + 1);
    }

    // Two ranks train on the same global batches: the same first loss to rounding.
    let two = t.path().join("two");
    // (f32 gathers: the default bf16 ones round the weights each rank computes with.)
    let two_ranks = [
        "--ranks",
        "2",
        "--steps",
        "1",
        "--set",
        "parallelism.gather_dtype=f32",
    ];
    ok(train(t.path(), config, &two, &two_ranks));
    let (l1, l2) = (losses(&run)[0], losses(&two)[0]);
    assert!((l1 - l2).abs() <= 1e-6 * l1.abs(), "{l1} vs {l2}");

    // The data changed under a run: refused at resume, naming the file.
    let halted = t.path().join("halted");
    ok(train(t.path(), config, &halted, &["--stop-after", "3"]));
    std::fs::remove_dir_all(&prep).unwrap();
    std::fs::write(root.join("en").join("extra"), "one more document here").unwrap();
    prepare(t.path(), &root, &prep);
    let e = fails(ganymede(
        t.path(),
        &args(&["train", "--resume", &halted.display().to_string()]),
        &[],
    ));
    assert!(
        e.contains("changed") && e.contains("en/shard-") && e.contains("--allow-data-change"),
        "{e}"
    );
}

/// The peak resident memory `data prepare` reports of itself (its own VmHWM: a child's rusage
/// would also count the test process, whose pages a spawned child shares until it execs).
fn peak_rss_kib(cwd: &Path, a: &[String]) -> u64 {
    let out = ok(ganymede(cwd, a, &[]));
    let kib = out
        .split("peak memory ")
        .nth(1)
        .and_then(|r| r.split(" KiB").next())
        .and_then(|n| n.parse().ok());
    kib.unwrap_or_else(|| panic!("no peak memory in: {out}"))
}

#[test]
fn prepare_memory_does_not_grow_with_the_corpus() {
    let t = TempDir::new("data-rss");
    let mut peaks = Vec::new();
    // Both corpora fill the 4 MiB text batch many times over; the larger is 4x the smaller.
    for (i, docs) in [4000usize, 16000].into_iter().enumerate() {
        let root = t.path().join(format!("c{i}"));
        corpus(&root, docs, 400);
        let a = args(&[
            "data",
            "prepare",
            "--sources-in",
            &root.display().to_string(),
            "--out",
            &t.path().join(format!("p{i}")).display().to_string(),
            "--workers",
            "1",
            "--quiet",
        ]);
        peaks.push(peak_rss_kib(t.path(), &a));
    }
    let bytes = |i: usize| -> u64 {
        let p = t.path().join(format!("p{i}"));
        ganymede_data::Manifest::read(&p)
            .unwrap()
            .sources
            .iter()
            .map(|s| s.input_bytes)
            .sum()
    };
    // The larger corpus is about 35 MB of text, 140 MB as u32 ids: holding it would add far
    // more than the 8 MiB allowed here.
    assert!(bytes(1) > 30_000_000, "{}", bytes(1));
    assert!(
        peaks[1] < peaks[0] + 8 * 1024,
        "peak RSS grew with the corpus: {} KiB -> {} KiB",
        peaks[0],
        peaks[1]
    );
}

#[test]
fn a_resume_refuses_changed_text_and_rebuilds_a_damaged_split() {
    let t = TempDir::new("data-changed");
    let text = t.path().join("corpus.txt");
    let body: String = (0..3000)
        .map(|i| format!("line {i} of the corpus, with words that repeat.\n"))
        .collect();
    std::fs::write(&text, &body).unwrap();
    let run = t.path().join("run");
    let job = args(&[
        "train",
        "--steps",
        "6",
        "--set",
        &format!("data.path={}", text.display()),
        "--set",
        "checkpoint.interval=3",
        "--out",
        &run.display().to_string(),
    ]);
    let mut first = job.clone();
    first.extend(args(&["--stop-after", "3"]));
    ok(ganymede(t.path(), &first, &[]));
    let resume = args(&["train", "--resume", &run.display().to_string()]);

    // Edited after the run started: refused, naming the file.
    let mtime = std::fs::metadata(&text).unwrap().modified().unwrap();
    std::fs::write(&text, body.replace("line 7 ", "line seven ")).unwrap();
    let e = fails(ganymede(t.path(), &resume, &[]));
    assert!(
        e.contains("differ") && e.contains("corpus.txt") && e.contains("--allow-data-change"),
        "{e}"
    );
    // Restored, bytes and modification time: accepted again.
    std::fs::write(&text, &body).unwrap();
    let f = std::fs::OpenOptions::new().write(true).open(&text).unwrap();
    f.set_modified(mtime).unwrap();
    drop(f);

    // The run's own split cut short: rebuilt from the input, not trained on as it is, so the
    // continuation equals an uninterrupted run on the same text.
    let train_bin = run.join("data").join("train.bin");
    let f = std::fs::OpenOptions::new()
        .write(true)
        .open(&train_bin)
        .unwrap();
    f.set_len(1000).unwrap();
    drop(f);
    ok(ganymede(t.path(), &resume, &[]));
    assert!(std::fs::metadata(&train_bin).unwrap().len() > 1000);
    let straight = t.path().join("straight");
    let mut whole = job.clone();
    let n = whole.len();
    whole[n - 1] = straight.display().to_string();
    ok(ganymede(t.path(), &whole, &[]));
    let (a, b) = (losses(&straight), losses(&run));
    assert_eq!(a.len(), b.len());
    for (i, (x, y)) in a.iter().zip(&b).enumerate() {
        assert_eq!(x.to_bits(), y.to_bits(), "step {}: {x} vs {y}", i + 1);
    }
}

#[test]
fn changed_data_is_accepted_when_asked() {
    let t = TempDir::new("data-allowed");
    let text = t.path().join("corpus.txt");
    let body: String = (0..3000)
        .map(|i| format!("line {i} of another corpus.\n"))
        .collect();
    std::fs::write(&text, &body).unwrap();
    let run = t.path().join("run");
    ok(ganymede(
        t.path(),
        &args(&[
            "train",
            "--steps",
            "4",
            "--stop-after",
            "2",
            "--set",
            &format!("data.path={}", text.display()),
            "--out",
            &run.display().to_string(),
        ]),
        &[],
    ));
    std::fs::write(&text, body.clone() + &body).unwrap();
    let resume = args(&["train", "--resume", &run.display().to_string()]);
    fails(ganymede(t.path(), &resume, &[]));
    let mut allowed = resume.clone();
    allowed.push("--allow-data-change".into());
    let out = ok(ganymede(t.path(), &allowed, &[]));
    assert!(out.contains("step") && losses(&run).len() == 4, "{out}");
}

#[test]
fn tokenizer_train_reports_the_bytes_it_read_and_those_not_utf8() {
    let t = TempDir::new("tok-bytes");
    let p = t.path().join("mixed.txt");
    let mut bytes: Vec<u8> = b"plain words that repeat and repeat again. "
        .iter()
        .copied()
        .cycle()
        .take(20_000)
        .collect();
    bytes.extend(std::iter::repeat_n(0xFFu8, 1_200));
    std::fs::write(&p, &bytes).unwrap();
    let out = ok(ganymede(
        t.path(),
        &args(&[
            "tokenizer",
            "train",
            "--input",
            &p.display().to_string(),
            "--vocab-size",
            "300",
            "--out",
            &t.path().join("tok.json").display().to_string(),
        ]),
        &[],
    ));
    assert!(
        out.contains("(21200 bytes; 1200 of them not valid UTF-8"),
        "{out}"
    );
}

#[test]
fn document_masked_training_on_prepared_data() {
    let t = TempDir::new("data-cli-docmask");
    let root = t.path().join("corpus");
    corpus(&root, 200, 12);
    let prep = t.path().join("prep");
    prepare(t.path(), &root, &prep);
    let job = |mask: bool| -> Vec<String> {
        [
            "model.vocab_size=257".to_string(),
            "training.steps=2".to_string(),
            "metrics.val_batches=1".to_string(),
            format!("data.path={}", prep.display()),
            format!("data.document_mask={mask}"),
        ]
        .iter()
        .flat_map(|s| ["--set".to_string(), s.clone()])
        .collect()
    };
    // Windows of 128 tokens hold several documents of a few dozen bytes: masked attention
    // scores them otherwise than attention across their boundaries.
    let (masked, open) = (t.path().join("masked"), t.path().join("open"));
    ok(train(t.path(), &job(true), &masked, &[]));
    ok(train(t.path(), &job(false), &open, &[]));
    let (a, b) = (losses(&masked), losses(&open));
    assert_eq!(a.len(), 2);
    assert!(a.iter().all(|l| l.is_finite()));
    assert_ne!(a[0].to_bits(), b[0].to_bits(), "the mask changed nothing");
    // Two ranks: the same first loss to rounding (each rank's rows carry their starts).
    let two = t.path().join("two");
    let extra = [
        "--ranks",
        "2",
        "--steps",
        "1",
        "--set",
        "parallelism.gather_dtype=f32",
    ];
    ok(train(t.path(), &job(true), &two, &extra));
    let (l1, l2) = (a[0], losses(&two)[0]);
    assert!((l1 - l2).abs() <= 1e-6 * l1.abs(), "{l1} vs {l2}");
    // Text the run would tokenise itself has no document index: refused, naming the key.
    let text = t.path().join("text.txt");
    std::fs::write(&text, "plain text without documents. ".repeat(2000)).unwrap();
    let e = fails(train(
        t.path(),
        &[
            "--set".to_string(),
            format!("data.path={}", text.display()),
            "--set".to_string(),
            "data.document_mask=true".to_string(),
        ],
        &t.path().join("refused"),
        &[],
    ));
    assert!(e.contains("data.document_mask"), "{e}");
}

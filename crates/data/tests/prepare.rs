//! `data prepare` on a generated multilingual corpus: the same bytes at any worker count, an
//! interrupted run that resumes to the same bytes, and counts that match the inputs.

use ganymede_data::{prepare, write_text_parquet, EodSpec, Manifest, PrepareOptions, Shard};
use std::io::Write;
use std::path::{Path, PathBuf};

struct Tmp(PathBuf);
impl Drop for Tmp {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}
fn tmp(name: &str) -> Tmp {
    let p = std::env::temp_dir().join(format!("ganymede-prep-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&p);
    std::fs::create_dir_all(&p).unwrap();
    Tmp(p)
}

/// Three languages: English as .txt files, German as JSONL.gz, French as parquet.
fn corpus(root: &Path, docs_per_lang: usize) -> Vec<(String, Vec<String>)> {
    let words = [
        ("en", ["the", "river", "runs", "past", "old", "mills"]),
        ("de", ["der", "Fluss", "läuft", "an", "alten", "Mühlen"]),
        ("fr", ["la", "rivière", "passe", "près", "des", "moulins"]),
    ];
    let mut out = Vec::new();
    for (lang, w) in words {
        let docs: Vec<String> = (0..docs_per_lang)
            .map(|i| {
                (0..(5 + i % 37))
                    .map(|j| w[(i * 7 + j * 3) % w.len()])
                    .collect::<Vec<_>>()
                    .join(" ")
                    + &format!(" {i}.")
            })
            .collect();
        let dir = root.join(lang);
        std::fs::create_dir_all(&dir).unwrap();
        match lang {
            "en" => {
                for (i, d) in docs.iter().enumerate() {
                    // No extension on some: every file in a folder is text.
                    let name = if i % 3 == 0 {
                        format!("doc{i:05}")
                    } else {
                        format!("doc{i:05}.txt")
                    };
                    std::fs::write(dir.join(name), d).unwrap();
                }
            }
            "de" => {
                for (k, chunk) in docs.chunks(docs_per_lang / 2 + 1).enumerate() {
                    let mut gz =
                        flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
                    for d in chunk {
                        writeln!(gz, "{}", serde_json::json!({ "text": d })).unwrap();
                    }
                    std::fs::write(dir.join(format!("part{k}.jsonl.gz")), gz.finish().unwrap())
                        .unwrap();
                }
            }
            _ => {
                let refs: Vec<&str> = docs.iter().map(|s| s.as_str()).collect();
                write_text_parquet(&dir.join("data.parquet"), "text", &refs, 40).unwrap();
            }
        }
        out.push((lang.to_string(), docs));
    }
    out
}

fn opts(root: &Path, out: &Path, workers: usize) -> PrepareOptions {
    PrepareOptions {
        sources: ["en", "de", "fr"]
            .iter()
            .map(|l| (l.to_string(), root.join(l)))
            .collect(),
        tokenizer: "byte".into(),
        out: out.to_path_buf(),
        workers,
        field: "text".into(),
        column: "text".into(),
        shard_tokens: 4000,
        eod: EodSpec::Id(256),
        progress: false,
        refuse_invalid_utf8: false,
        stop_after_shards: None,
    }
}

/// Every file under `dir` (relative path, bytes), sorted.
fn files(dir: &Path) -> Vec<(String, Vec<u8>)> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                stack.push(p);
            } else {
                let rel = p.strip_prefix(dir).unwrap().display().to_string();
                out.push((rel, std::fs::read(&p).unwrap()));
            }
        }
    }
    out.sort();
    out
}

#[test]
fn shards_are_the_same_bytes_at_any_worker_count_and_after_an_interruption() {
    let t = tmp("workers");
    let root = t.0.join("corpus");
    let langs = corpus(&root, 300);
    let one = t.0.join("w1");
    let m = prepare(&opts(&root, &one, 1)).unwrap();
    let four = t.0.join("w4");
    prepare(&opts(&root, &four, 4)).unwrap();
    let a = files(&one);
    assert!(
        a.iter().filter(|f| f.0.ends_with(".gtok")).count() >= 6,
        "several shards"
    );
    assert_eq!(a, files(&four), "1 and 4 workers differ");

    // Counts match the inputs, and every document ends with the end-of-document id.
    for ((lang, docs), s) in langs.iter().zip(&m.sources) {
        assert_eq!(&s.name, lang);
        assert_eq!(s.documents, docs.len() as u64);
        let want: u64 = docs.iter().map(|d| d.len() as u64 + 1).sum();
        assert_eq!(s.tokens, want, "{lang}");
        let mut all = Vec::new();
        for sh in &s.shards {
            let shard = Shard::open(&one.join(&sh.file)).unwrap();
            let o = shard.offsets().to_vec();
            let ids = shard.ids();
            for w in o.windows(2) {
                assert_eq!(ids.get(w[1] as usize - 1), 256);
            }
            ids.extend_into(0..ids.len(), &mut all);
        }
        let want: Vec<u32> = docs
            .iter()
            .flat_map(|d| d.bytes().map(u32::from).chain([256]))
            .collect();
        assert_eq!(all, want, "{lang}: shards hold the documents in order");
    }
    assert_eq!(Manifest::read(&one).unwrap(), m);

    // Interrupted after three shards, then run again: the same bytes as the whole run.
    let cut = t.0.join("cut");
    let mut o = opts(&root, &cut, 2);
    o.stop_after_shards = Some(3);
    let e = format!("{:#}", prepare(&o).unwrap_err());
    assert!(e.contains("stopped"), "{e}");
    assert!(!cut.join("manifest.json").exists());
    // A shard being written when it died is left as a .tmp, which the restart removes.
    std::fs::write(cut.join("en").join("shard-00009.gtok.tmp"), b"partial").unwrap();
    o.stop_after_shards = None;
    prepare(&o).unwrap();
    assert_eq!(files(&cut), a, "the resumed preparation differs");
}

#[test]
fn prepare_refuses_what_would_mix_or_lose_work() {
    let t = tmp("refuse");
    let root = t.0.join("corpus");
    corpus(&root, 30);
    let out = t.0.join("out");
    prepare(&opts(&root, &out, 1)).unwrap();
    let e = format!("{:#}", prepare(&opts(&root, &out, 1)).unwrap_err());
    assert!(e.contains("already a prepared dataset"), "{e}");

    // An interrupted folder with other inputs.
    let cut = t.0.join("cut");
    let mut o = opts(&root, &cut, 1);
    o.shard_tokens = 100;
    o.stop_after_shards = Some(1);
    prepare(&o).unwrap_err();
    std::fs::write(root.join("en").join("new.txt"), "a new document").unwrap();
    o.stop_after_shards = None;
    let e = format!("{:#}", prepare(&o).unwrap_err());
    assert!(e.contains("new.txt") && e.contains("changed"), "{e}");

    let busy = t.0.join("busy");
    std::fs::create_dir_all(&busy).unwrap();
    std::fs::write(busy.join("notes.txt"), "mine").unwrap();
    let e = format!("{:#}", prepare(&opts(&root, &busy, 1)).unwrap_err());
    assert!(e.contains("not empty"), "{e}");
    assert_eq!(std::fs::read(busy.join("notes.txt")).unwrap(), b"mine");

    let mut o = opts(&root, &t.0.join("w0"), 0);
    let e = format!("{:#}", prepare(&o).unwrap_err());
    assert!(e.contains("--workers 0"), "{e}");
    o.workers = 1;
    o.eod = EodSpec::Token("<|nope|>".into());
    let e = format!("{:#}", prepare(&o).unwrap_err());
    assert!(e.contains("<|nope|>"), "{e}");
}

#[test]
fn batches_from_shards_are_the_same_at_any_rank_count_and_after_a_rebuild() {
    use ganymede_config::{DataConfig, SourceConfig};
    use ganymede_data::Dataset;
    let t = tmp("ranks");
    let root = t.0.join("corpus");
    corpus(&root, 200);
    let prep = t.0.join("prep");
    prepare(&opts(&root, &prep, 2)).unwrap();
    let data = DataConfig {
        sources: vec![
            SourceConfig {
                path: prep.join("en").display().to_string(),
                weight: Some(0.25),
            },
            SourceConfig {
                path: prep.join("fr").display().to_string(),
                weight: Some(0.75),
            },
        ],
        val_fraction: 0.1,
        ..DataConfig::default()
    };
    let run = t.0.join("run-data");
    let ds = Dataset::build(&data, 257, 24, 3, Some(&run)).unwrap();
    let again = Dataset::build(&data, 257, 24, 3, Some(&run)).unwrap();
    for step in [0u64, 1, 17] {
        let whole = ds.batch(step, 8, 24);
        assert_eq!(again.batch(step, 8, 24), whole, "a rebuilt dataset differs");
        for world in [2usize, 4] {
            let (mut x, mut y) = (Vec::new(), Vec::new());
            for rank in 0..world {
                let (a, b) = ds.batch_slice(step, 8, 24, rank, world);
                x.extend(a);
                y.extend(b);
            }
            assert_eq!((x, y), whole, "step {step} at {world} ranks");
        }
        assert_ne!(ds.batch(step + 1, 8, 24), whole);
    }
    // Without data.document_mask batches carry no document starts.
    assert!(ds.batch_doc_starts(0, 8, 24, 0, 1).is_none());
    // With it, each token's document start in its window: where a token follows the
    // end-of-document id (256) a document starts; the same at any rank count.
    let masked = Dataset::build(
        &DataConfig {
            document_mask: true,
            ..data.clone()
        },
        257,
        24,
        3,
        None,
    )
    .unwrap();
    let scan = |x: &[u32]| -> Vec<u32> {
        let mut out = Vec::new();
        for row in x.chunks(24) {
            let mut cur = 0;
            for i in 0..24 {
                if i > 0 && row[i - 1] == 256 {
                    cur = i as u32;
                }
                out.push(cur);
            }
        }
        out
    };
    for step in [0u64, 5] {
        let (x, _) = masked.batch(step, 8, 24);
        let whole = masked.batch_doc_starts(step, 8, 24, 0, 1).unwrap();
        assert_eq!(whole, scan(&x), "step {step}");
        assert!(
            whole.iter().any(|&d| d > 0),
            "no document boundary at step {step}"
        );
        let parts: Vec<u32> = (0..4)
            .flat_map(|r| masked.batch_doc_starts(step, 8, 24, r, 4).unwrap())
            .collect();
        assert_eq!(parts, whole);
        let (vx, _) = masked.val_batch_of(1, 2, 4, 24);
        assert_eq!(masked.val_doc_starts(Some(1), 2, 4, 24).unwrap(), scan(&vx));
    }
    // Per-source validation by name and weight; ids in range.
    let names: Vec<(String, f64)> = ds.val_sources();
    assert_eq!(names.len(), 2);
    assert_eq!((names[0].0.as_str(), names[1].0.as_str()), ("en", "fr"));
    assert!((names[0].1 - 0.25).abs() < 1e-12);
    let (vx, vy) = ds.val_batch_of(1, 0, 4, 24);
    assert_eq!((vx.len(), vy.len()), (96, 96));
    assert!(vx.iter().all(|&t| t < 257));
    // A model vocabulary smaller than the shards' is refused, naming the source.
    let e = format!(
        "{:#}",
        Dataset::build(&data, 256, 24, 3, None).err().unwrap()
    );
    assert!(
        e.contains("257") && e.contains("model.vocab_size = 256"),
        "{e}"
    );
}

#[test]
fn invalid_utf8_is_counted_or_refused_by_file() {
    let t = tmp("utf8");
    let root = t.0.join("corpus");
    std::fs::create_dir_all(root.join("x")).unwrap();
    std::fs::write(root.join("x").join("a.txt"), "fine text").unwrap();
    std::fs::write(root.join("x").join("b.txt"), b"bad \xff\xfe bytes").unwrap();
    let mut o = opts(&root, &t.0.join("out"), 1);
    o.sources = vec![("x".into(), root.join("x"))];
    let m = prepare(&o).unwrap();
    assert_eq!(m.sources[0].invalid_utf8_documents, 1);
    o.out = t.0.join("out2");
    o.refuse_invalid_utf8 = true;
    let e = format!("{:#}", prepare(&o).unwrap_err());
    assert!(e.contains("b.txt") && e.contains("not valid UTF-8"), "{e}");
}

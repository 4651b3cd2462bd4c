use super::*;
use crate::test_util::TempDir;

fn cfg(path: &str, tokenizer: &str) -> DataConfig {
    DataConfig {
        path: path.into(),
        tokenizer: tokenizer.into(),
        val_fraction: 0.1,
        builtin_bytes: 200_000,
        ..DataConfig::default()
    }
}

fn err(r: Result<Dataset>) -> String {
    format!("{:#}", r.err().expect("expected an error"))
}

#[test]
fn batches_depend_only_on_seed_and_step() {
    let ds = Dataset::build(&cfg("", "byte"), 256, 32, 5, None).unwrap();
    let (x, y) = ds.batch(3, 4, 32);
    assert_eq!((x.len(), y.len()), (128, 128));
    // A fresh dataset (as after a resume) gives the same batch; other steps and seeds do not.
    let again = Dataset::build(&cfg("", "byte"), 256, 32, 5, None).unwrap();
    assert_eq!(again.batch(3, 4, 32), (x.clone(), y.clone()));
    assert_ne!(ds.batch(4, 4, 32).0, x);
    let other_seed = Dataset::build(&cfg("", "byte"), 256, 32, 6, None).unwrap();
    assert_ne!(other_seed.batch(3, 4, 32).0, x);
    // Drawing other batches first changes nothing: there is no hidden state.
    let _ = ds.batch(100, 8, 32);
    assert_eq!(ds.batch(3, 4, 32).0, x);
    // Targets are the inputs shifted by one, row by row, and both come from the train split.
    for r in 0..4 {
        assert_eq!(x[r * 32 + 1..(r + 1) * 32], y[r * 32..(r + 1) * 32 - 1]);
        let row = &x[r * 32..(r + 1) * 32];
        let train = ds.train_tokens();
        assert!(train.windows(32).any(|w| w == row));
    }
}

#[test]
fn rank_slices_concatenate_to_the_global_batch() {
    let ds = Dataset::build(&cfg("", "byte"), 256, 16, 1, None).unwrap();
    let (x, y) = ds.batch(7, 8, 16);
    let mut xs = Vec::new();
    let mut ys = Vec::new();
    for rank in 0..4 {
        let (a, b) = ds.batch_slice(7, 8, 16, rank, 4);
        assert_eq!(a.len(), 2 * 16);
        xs.extend(a);
        ys.extend(b);
    }
    assert_eq!((xs, ys), (x, y));
}

#[test]
fn byte_splits_are_the_corpus_and_disjoint() {
    let dir = TempDir::new("split");
    let p = dir.path().join("ab.txt");
    // Train text is all 'a', held-out text all 'b': any leak shows.
    std::fs::write(&p, "a".repeat(9000) + &"b".repeat(1000)).unwrap();
    let ds = Dataset::build(&cfg(p.to_str().unwrap(), "byte"), 256, 64, 0, None).unwrap();
    assert_eq!(ds.train_tokens().len(), 9000);
    assert_eq!(ds.val_tokens().len(), 1000);
    assert!(ds.train_tokens().iter().all(|&t| t == b'a' as u32));
    assert!(ds.val_tokens().iter().all(|&t| t == b'b' as u32));
    for step in 0..200 {
        let (x, y) = ds.batch(step, 4, 64);
        assert!(x.iter().chain(&y).all(|&t| t == b'a' as u32), "step {step}");
    }
    for i in 0..20 {
        let (x, y) = ds.val_batch(i, 4, 64);
        assert!(x.iter().chain(&y).all(|&t| t == b'b' as u32));
    }
}

#[test]
fn builtin_split_covers_the_corpus() {
    let ds = Dataset::build(&cfg("", "byte"), 256, 32, 0, None).unwrap();
    let all: Vec<u32> = builtin_corpus(200_000, BUILTIN_SEED)
        .iter()
        .map(|&b| b as u32)
        .collect();
    assert_eq!([ds.train_tokens(), ds.val_tokens()].concat(), all);
    assert_eq!(ds.val_tokens().len(), 20_000);
    let floor = ds.entropy_floor_nats_per_token().unwrap();
    assert_eq!(floor, crate::builtin_entropy_nats_per_byte());
}

#[test]
fn val_batches_are_fixed_consecutive_windows() {
    let ds = Dataset::build(&cfg("", "byte"), 256, 10, 1, None).unwrap();
    let other = Dataset::build(&cfg("", "byte"), 256, 10, 2, None).unwrap();
    assert_eq!(ds.val_batch(0, 3, 10), other.val_batch(0, 3, 10));
    let v = ds.val_tokens();
    let (x, y) = ds.val_batch(1, 3, 10);
    // Batch 1 holds windows 3, 4, 5.
    assert_eq!(x[..10], v[33..43]);
    assert_eq!(y[..10], v[34..44]);
    let w = ds.num_val_windows(10);
    assert_eq!(w, 20_000 / 11);
    // Past the end it wraps around to the first windows.
    assert_eq!(ds.val_batch(w, 1, 10), ds.val_batch(0, 1, 10));
}

#[test]
fn eval_windows_drop_the_partial_tail() {
    let t: Vec<u32> = (0..10).collect();
    assert_eq!(num_eval_windows(10, 3), 2);
    let w: Vec<_> = eval_windows(&t, 3).collect();
    assert_eq!(w.len(), 2);
    assert_eq!(w[0], (&[0, 1, 2][..], &[1, 2, 3][..]));
    assert_eq!(w[1], (&[4, 5, 6][..], &[5, 6, 7][..]));
    assert_eq!(num_eval_windows(7, 3), 1);
    assert_eq!(num_eval_windows(3, 3), 0);
    assert_eq!(eval_windows(&t[..3], 3).count(), 0);
}

#[test]
fn data_folder_is_written_reused_and_rebuilt_when_inputs_change() {
    let dir = TempDir::new("cache");
    let data = dir.path().join("run/data");
    let c = cfg("", "byte");
    let a = Dataset::build(&c, 256, 32, 0, Some(&data)).unwrap();
    assert!(data.join(TRAIN_FILE).exists() && data.join(VAL_FILE).exists());
    assert!(!data.join(TOKENIZER_FILE).exists());
    let train_len = std::fs::metadata(data.join(TRAIN_FILE)).unwrap().len();
    assert_eq!(train_len as usize, a.train_tokens().len() * 4);
    let b = Dataset::build(&c, 256, 32, 0, Some(&data)).unwrap();
    assert!(
        matches!(b.train, Tokens::Mapped(_)),
        "second build maps the files"
    );
    assert_eq!(a.train_tokens(), b.train_tokens());
    assert_eq!(a.batch(9, 2, 32), b.batch(9, 2, 32));
    assert_eq!(load_run_tokenizer(&data).unwrap().vocab_size(), 256);

    let c2 = DataConfig {
        val_fraction: 0.2,
        ..c
    };
    let d = Dataset::build(&c2, 256, 32, 0, Some(&data)).unwrap();
    assert!(
        matches!(d.train, Tokens::Owned(_)),
        "changed config rebuilds"
    );
    assert_eq!(d.val_tokens().len(), 40_000);
}

#[test]
fn bpe_dataset_trains_saves_and_reloads_its_tokenizer() {
    let dir = TempDir::new("bpe-ds");
    let data = dir.path().join("data");
    let ds = Dataset::build(&cfg("", "bpe"), 512, 32, 0, Some(&data)).unwrap();
    let tk = ds.tokenizer();
    assert!(tk.vocab_size() > 256 && tk.vocab_size() <= 512);
    assert!(ds
        .train_tokens()
        .iter()
        .all(|&t| (t as usize) < tk.vocab_size()));
    // Words of the grammar become single tokens: far fewer tokens than bytes.
    assert!(
        ds.train_tokens().len() * 3 < 180_000,
        "{}",
        ds.train_tokens().len()
    );
    // The floor per token is the floor per byte times bytes per token.
    let per_token = ds.entropy_floor_nats_per_token().unwrap();
    let bytes_per_token = 20_000.0 / ds.val_tokens().len() as f64;
    assert!(bytes_per_token > 3.0, "{bytes_per_token}");
    let expect = crate::builtin_entropy_nats_per_byte() * bytes_per_token;
    assert!((per_token - expect).abs() < 1e-12);
    let reloaded = load_run_tokenizer(&data).unwrap();
    let text = "The cat sees a red ball near the garden. ";
    assert_eq!(reloaded.encode(text), tk.encode(text));
    assert_eq!(reloaded.decode(&reloaded.encode(text)), text);
    let again = Dataset::build(&cfg("", "bpe"), 512, 32, 0, Some(&data)).unwrap();
    assert!(matches!(again.train, Tokens::Mapped(_)));
    assert_eq!(again.train_tokens(), ds.train_tokens());
}

#[test]
fn token_files_are_used_as_they_are() {
    let dir = TempDir::new("bin-input");
    let p = dir.path().join("corpus.bin");
    let toks: Vec<u32> = (0..2000).map(|i| (i * 31) % 1000).collect();
    write_tokens(&p, &toks).unwrap();
    let ds = Dataset::build(&cfg(p.to_str().unwrap(), "byte"), 1000, 16, 0, None);
    // The byte tokenizer fits in 1000 ids, and the ids are all below 1000.
    let ds = ds.unwrap();
    assert_eq!([ds.train_tokens(), ds.val_tokens()].concat(), toks);
    assert_eq!(ds.entropy_floor_nats_per_token(), None);

    let e = err(Dataset::build(
        &cfg(p.to_str().unwrap(), "byte"),
        500,
        16,
        0,
        None,
    ));
    assert!(
        e.contains("corpus.bin") && e.contains("model.vocab_size = 500"),
        "{e}"
    );
    let e = err(Dataset::build(
        &cfg(p.to_str().unwrap(), "bpe"),
        1000,
        16,
        0,
        None,
    ));
    assert!(
        e.contains("data.tokenizer = bpe") && e.contains("corpus.bin"),
        "{e}"
    );
}

#[test]
fn errors_name_the_key_or_file() {
    let dir = TempDir::new("errors");
    let e = err(Dataset::build(
        &cfg("/no/such/corpus.txt", "byte"),
        256,
        16,
        0,
        None,
    ));
    assert!(e.contains("data.path = /no/such/corpus.txt"), "{e}");

    let empty = dir.path().join("empty.txt");
    std::fs::write(&empty, "").unwrap();
    let e = err(Dataset::build(
        &cfg(empty.to_str().unwrap(), "byte"),
        256,
        16,
        0,
        None,
    ));
    assert!(e.contains("empty.txt") && e.contains("empty"), "{e}");

    let short = dir.path().join("short.txt");
    std::fs::write(&short, "x".repeat(1000)).unwrap();
    let e = err(Dataset::build(
        &cfg(short.to_str().unwrap(), "byte"),
        256,
        128,
        0,
        None,
    ));
    assert!(
        e.contains("short.txt") && e.contains("validation split") && e.contains("129"),
        "{e}"
    );
    let e = err(Dataset::build(
        &cfg(short.to_str().unwrap(), "byte"),
        256,
        1000,
        0,
        None,
    ));
    assert!(
        e.contains("training split") && e.contains("model.seq_len"),
        "{e}"
    );

    let e = err(Dataset::build(&cfg("", "byte"), 100, 16, 0, None));
    assert!(
        e.contains("data.tokenizer = byte") && e.contains("model.vocab_size = 100"),
        "{e}"
    );

    // A tokenizer.json larger than the model's vocabulary.
    let tk =
        crate::train_bpe([String::from_utf8(builtin_corpus(50_000, 3)).unwrap()], 400).unwrap();
    let tk_path = dir.path().join("tok.json");
    tk.save(&tk_path).unwrap();
    let e = err(Dataset::build(
        &cfg("", tk_path.to_str().unwrap()),
        300,
        16,
        0,
        None,
    ));
    assert!(
        e.contains("tok.json") && e.contains("more than model.vocab_size = 300"),
        "{e}"
    );

    let e = err(Dataset::build(&cfg("", "/no/tok.json"), 300, 16, 0, None));
    assert!(e.contains("data.tokenizer = /no/tok.json"), "{e}");

    let bad_frac = DataConfig {
        val_fraction: 1.5,
        ..cfg("", "byte")
    };
    let e = err(Dataset::build(&bad_frac, 256, 16, 0, None));
    assert!(e.contains("data.val_fraction"), "{e}");
}

#[test]
fn eval_tokens_from_text_and_token_files() {
    let dir = TempDir::new("eval-tokens");
    let txt = dir.path().join("e.txt");
    std::fs::write(&txt, "hello").unwrap();
    let t = load_eval_tokens(&txt, &ByteTokenizer, 256).unwrap();
    assert_eq!(t, b"hello".iter().map(|&b| b as u32).collect::<Vec<_>>());
    let bin = dir.path().join("e.bin");
    write_tokens(&bin, &[1, 2, 300]).unwrap();
    assert_eq!(
        load_eval_tokens(&bin, &ByteTokenizer, 400).unwrap(),
        vec![1, 2, 300]
    );
    let e = format!(
        "{:#}",
        load_eval_tokens(&bin, &ByteTokenizer, 256).unwrap_err()
    );
    assert!(e.contains("e.bin") && e.contains("300"), "{e}");
}

#[test]
fn text_that_is_not_utf8_is_refused_when_asked() {
    let dir = TempDir::new("utf8");
    let p = dir.path().join("c.txt");
    let mut bytes = "some words repeat, some words repeat again. "
        .repeat(400)
        .into_bytes();
    bytes.extend([0xff, 0xfe]);
    bytes.extend(
        "and more words after the bad bytes. "
            .repeat(100)
            .into_bytes(),
    );
    std::fs::write(&p, &bytes).unwrap();
    let path = p.display().to_string();
    // Replaced (with a warning) by default.
    Dataset::build(&cfg(&path, "bpe"), 300, 16, 0, None).unwrap();
    let refuse = DataConfig {
        refuse_invalid_utf8: true,
        ..cfg(&path, "bpe")
    };
    let e = err(Dataset::build(&refuse, 300, 16, 0, None));
    assert!(
        e.contains("2 bytes are not valid UTF-8") && e.contains("c.txt"),
        "{e}"
    );
    // Bytes tokenise anything: nothing to refuse.
    let bytes_cfg = DataConfig {
        refuse_invalid_utf8: true,
        ..cfg(&path, "byte")
    };
    Dataset::build(&bytes_cfg, 256, 16, 0, None).unwrap();
}

#[test]
fn document_mask_refuses_data_without_document_boundaries() {
    let dir = TempDir::new("docmask");
    let p = dir.path().join("c.txt");
    std::fs::write(&p, "words without any document index. ".repeat(200)).unwrap();
    let path = p.display().to_string();
    let masked = |path: &str| DataConfig {
        document_mask: true,
        ..cfg(path, "byte")
    };
    for path in [path.as_str(), ""] {
        let e = err(Dataset::build(&masked(path), 256, 16, 0, None));
        assert!(
            e.contains("data.document_mask") && e.contains("data prepare"),
            "{path}: {e}"
        );
    }
    // The same text without the mask trains, and its batches carry no document starts.
    let ds = Dataset::build(&cfg(&path, "byte"), 256, 16, 0, None).unwrap();
    assert!(ds.batch_doc_starts(0, 2, 16, 0, 1).is_none());
}

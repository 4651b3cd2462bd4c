use super::*;
use crate::shards::ShardWriter;
use crate::test_util::TempDir;
use std::collections::HashSet;
use std::io::Write;

/// Documents of varied lengths, each ending with `eod`.
fn docs(n: usize, eod: u32) -> Vec<Vec<u32>> {
    (0..n)
        .map(|i| {
            let len = 3 + (i * 7919) % 41;
            let mut d: Vec<u32> = (0..len)
                .map(|j| ((i * 31 + j * 17) % 1000) as u32)
                .collect();
            d.push(eod);
            d
        })
        .collect()
}

fn write_shards(dir: &Path, docs: &[Vec<u32>], per_shard: usize) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for (k, chunk) in docs.chunks(per_shard).enumerate() {
        let p = dir.join(format!("s{k:03}.gtok"));
        let mut w = ShardWriter::create(&p, 2, 5, Some(50256), 50257).unwrap();
        for d in chunk {
            w.push_document(d).unwrap();
        }
        w.finish().unwrap();
        out.push(p);
    }
    out
}

/// A Megatron indexed dataset of `docs` (one sequence per document, uint16).
fn write_megatron(prefix: &Path, docs: &[Vec<u32>]) -> PathBuf {
    let bin = prefix.with_extension("bin");
    let mut b = Vec::new();
    for d in docs {
        for &t in d {
            b.extend_from_slice(&(t as u16).to_le_bytes());
        }
    }
    std::fs::write(&bin, b).unwrap();
    let mut idx = Vec::new();
    idx.extend_from_slice(MEGATRON_MAGIC);
    idx.extend_from_slice(&1u64.to_le_bytes());
    idx.push(8);
    idx.extend_from_slice(&(docs.len() as u64).to_le_bytes());
    idx.extend_from_slice(&(docs.len() as u64 + 1).to_le_bytes());
    for d in docs {
        idx.extend_from_slice(&(d.len() as i32).to_le_bytes());
    }
    let mut ptr = 0i64;
    for d in docs {
        idx.extend_from_slice(&ptr.to_le_bytes());
        ptr += 2 * d.len() as i64;
    }
    for i in 0..=docs.len() {
        idx.extend_from_slice(&(i as i64).to_le_bytes());
    }
    std::fs::write(prefix.with_extension("idx"), idx).unwrap();
    bin
}

/// An llm.c version-1 shard of `tokens`.
fn write_llmc(path: &Path, tokens: &[u32]) {
    let mut f = std::fs::File::create(path).unwrap();
    let mut h = [0i32; 256];
    h[0] = LLMC_MAGIC as i32;
    h[1] = 1;
    h[2] = tokens.len() as i32;
    f.write_all(bytemuck::cast_slice(&h)).unwrap();
    let t: Vec<u16> = tokens.iter().map(|&t| t as u16).collect();
    f.write_all(bytemuck::cast_slice(&t)).unwrap();
}

fn mixture(srcs: Vec<Source>, seq: usize) -> Mixture {
    Mixture::new(vec![(srcs, None)], 1.0, 0.1, seq, 9).unwrap()
}

#[test]
fn permute_is_a_bijection_and_depends_on_its_key() {
    for n in [1u64, 2, 3, 5, 64, 1000, 4097] {
        let seen: HashSet<u64> = (0..n).map(|i| permute(42, n, i)).collect();
        assert_eq!(seen.len() as u64, n, "n = {n}");
        assert!(seen.iter().all(|&x| x < n));
    }
    let a: Vec<u64> = (0..1000).map(|i| permute(1, 1000, i)).collect();
    let b: Vec<u64> = (0..1000).map(|i| permute(2, 1000, i)).collect();
    assert_ne!(a, b);
    // Not the identity, nor close to it.
    assert!(
        a.iter()
            .enumerate()
            .filter(|(i, &x)| *i as u64 == x)
            .count()
            < 20
    );
}

#[test]
fn the_same_tokens_give_the_same_windows_in_every_format() {
    let dir = TempDir::new("formats");
    let d = docs(300, 50256);
    let stream: Vec<u32> = d.concat();
    let shard_dir = dir.path().join("shards");
    std::fs::create_dir_all(&shard_dir).unwrap();
    let ours = Source::new("ours".into(), write_shards(&shard_dir, &d, 70)).unwrap();
    let mega = Source::new(
        "mega".into(),
        vec![write_megatron(&dir.path().join("m"), &d)],
    )
    .unwrap();
    let llmc_path = dir.path().join("l.bin");
    write_llmc(&llmc_path, &stream);
    let llmc = Source::new("llmc".into(), vec![llmc_path]).unwrap();
    for s in [&ours, &mega, &llmc] {
        assert_eq!(s.tokens(), stream.len() as u64);
        let mut all = Vec::new();
        s.extend(0, s.tokens(), &mut all);
        assert_eq!(all, stream, "{}", s.name);
        // Documents end after each end-of-document token in all three.
        assert_eq!(s.doc_starts(), ours.doc_starts(), "{}", s.name);
    }
    let seq = 32;
    let m: Vec<Mixture> = [ours, mega, llmc]
        .into_iter()
        .map(|s| mixture(vec![s], seq))
        .collect();
    for g in 0..200 {
        let mut want = (Vec::new(), Vec::new());
        m[0].sequence(g, &mut want.0, &mut want.1);
        for other in &m[1..] {
            let mut got = (Vec::new(), Vec::new());
            other.sequence(g, &mut got.0, &mut got.1);
            assert_eq!(got, want, "sequence {g}");
        }
    }
    assert_eq!(m[1].val_tokens(0), m[0].val_tokens(0));
    assert_eq!(m[2].val_tokens(0), m[0].val_tokens(0));
    // Document starts from each format's index agree with a scan of the window's tokens for
    // end-of-document tokens (a token after one starts a document), training and validation.
    let scan = |x: &[u32]| -> Vec<u32> {
        let mut cur = 0;
        (0..x.len())
            .map(|i| {
                if i > 0 && x[i - 1] == 50256 {
                    cur = i as u32;
                }
                cur
            })
            .collect()
    };
    let mut restarts = 0;
    for g in 0..200 {
        let (mut x, mut y) = (Vec::new(), Vec::new());
        m[0].sequence(g, &mut x, &mut y);
        let want = scan(&x);
        restarts += want.iter().filter(|&&d| d > 0).count();
        for mx in &m {
            let mut got = Vec::new();
            mx.sequence_doc_starts(g, &mut got);
            assert_eq!(got, want, "sequence {g}");
        }
    }
    assert!(restarts > 0, "no window crossed a document boundary");
    for w in 0..m[0].val_windows(0) {
        let (mut x, mut y) = (Vec::new(), Vec::new());
        m[0].val_sequence(0, w, &mut x, &mut y);
        for mx in &m {
            let mut got = Vec::new();
            mx.val_sequence_doc_starts(0, w, &mut got);
            assert_eq!(got, scan(&x), "validation window {w}");
        }
    }
}

#[test]
fn one_epoch_sees_every_window_once_and_the_next_in_another_order() {
    let dir = TempDir::new("epoch");
    let d = docs(400, 7);
    let src = Source::new("a".into(), write_shards(dir.path(), &d, 100)).unwrap();
    let seq = 16;
    let m = mixture(vec![src], seq);
    let n = m.windows(0);
    assert!(n > 100);
    let first: Vec<u64> = (0..n).map(|g| m.window(m.pick(g).0, m.pick(g).1)).collect();
    let set: HashSet<u64> = first.iter().copied().collect();
    assert_eq!(set.len() as u64, n);
    let second: Vec<u64> = (n..2 * n).map(|g| m.window(0, m.pick(g).1)).collect();
    assert_eq!(second.iter().copied().collect::<HashSet<_>>(), set);
    assert_ne!(second, first);
    // Windows are the training split's, at a stride of seq_len, inputs and targets offset by one.
    let train_end = m.val_start[0];
    let mut all = Vec::new();
    m.sources[0].extend(0, m.sources[0].tokens(), &mut all);
    for g in 0..50 {
        let (mut x, mut y) = (Vec::new(), Vec::new());
        m.sequence(g, &mut x, &mut y);
        let w = first[g as usize] as usize;
        assert_eq!(x, all[w * seq..w * seq + seq]);
        assert_eq!(y, all[w * seq + 1..w * seq + seq + 1]);
        assert!(((w * seq + seq + 1) as u64) <= train_end);
    }
}

#[test]
fn a_weighted_mixture_draws_its_shares_exactly() {
    let dir = TempDir::new("mix");
    let (da, db) = (dir.path().join("a"), dir.path().join("b"));
    std::fs::create_dir_all(&da).unwrap();
    std::fs::create_dir_all(&db).unwrap();
    let a = Source::new("a".into(), write_shards(&da, &docs(200, 7), 100)).unwrap();
    let b = Source::new("b".into(), write_shards(&db, &docs(500, 7), 100)).unwrap();
    let m = Mixture::new(
        vec![(vec![a], Some(0.3)), (vec![b], Some(0.7))],
        1.0,
        0.1,
        8,
        1,
    )
    .unwrap();
    let mut count = [0u64; 2];
    for g in 0..10_000 {
        let (s, k) = m.pick(g);
        // Each source's draws are numbered 0, 1, 2, ... in order: none skipped or repeated.
        assert_eq!(k, count[s], "draw {g}");
        count[s] += 1;
    }
    let share = count[0] as f64 / 10_000.0;
    assert!((share - 0.3).abs() < 0.01, "share {share}");
    // Exact to one draw at every prefix, not only at the end.
    let mut c = 0;
    for g in 0..10_000u64 {
        c += (m.pick(g).0 == 0) as u64;
        assert!((c as f64 - 0.3 * (g + 1) as f64).abs() <= 1.0, "prefix {g}");
    }

    // Three sources by temperature: T = 1 by size, a large T nearly uniform.
    let mk = |n: usize, name: &str| {
        let p = dir.path().join(name);
        std::fs::create_dir_all(&p).unwrap();
        Source::new(name.into(), write_shards(&p, &docs(n, 7), 1000)).unwrap()
    };
    let srcs = || vec![mk(100, "x"), mk(400, "y"), mk(1600, "z")];
    let by_size = Mixture::new(vec![(srcs(), None)], 1.0, 0.1, 8, 1).unwrap();
    let tokens: Vec<f64> = by_size.sources.iter().map(|s| s.tokens() as f64).collect();
    let total: f64 = tokens.iter().sum();
    for (w, t) in by_size.weights.iter().zip(&tokens) {
        assert!((w - t / total).abs() < 1e-12);
    }
    let flat = Mixture::new(vec![(srcs(), None)], 1e6, 0.1, 8, 1).unwrap();
    assert!(flat.weights.iter().all(|w| (w - 1.0 / 3.0).abs() < 1e-3));
}

#[test]
fn validation_holds_out_whole_documents() {
    let dir = TempDir::new("val");
    let d = docs(100, 7);
    let src = Source::new("a".into(), write_shards(dir.path(), &d, 30)).unwrap();
    let starts = src.doc_starts();
    for f in [0.05, 0.1, 0.3] {
        let v = src.val_start(f);
        assert!(starts.contains(&v), "{v} is not a document start");
        let want = (src.tokens() as f64 * (1.0 - f)).round() as u64;
        // The first document start at or after the cut.
        assert!(v >= want && starts.iter().all(|&s| s < want || s >= v));
    }
}

#[test]
fn damaged_and_foreign_files_are_refused_by_name() {
    let dir = TempDir::new("bad-src");
    let p = dir.path().join("x.bin");
    std::fs::write(&p, [1u8, 2, 3, 4, 5, 6, 7, 8]).unwrap();
    let e = format!(
        "{:#}",
        Source::new("x".into(), vec![p.clone()]).err().unwrap()
    );
    assert!(e.contains("x.bin") && e.contains("llm.c"), "{e}");

    write_llmc(&p, &[1, 2, 3, 4]);
    let bytes = std::fs::read(&p).unwrap();
    std::fs::write(&p, &bytes[..bytes.len() - 2]).unwrap();
    let e = format!(
        "{:#}",
        Source::new("x".into(), vec![p.clone()]).err().unwrap()
    );
    assert!(e.contains("x.bin") && e.contains("truncated"), "{e}");

    let bin = write_megatron(&dir.path().join("m"), &docs(10, 7));
    let b = std::fs::read(&bin).unwrap();
    std::fs::write(&bin, &b[..b.len() / 2]).unwrap();
    let e = format!("{:#}", Source::new("m".into(), vec![bin]).err().unwrap());
    assert!(e.contains("m.bin") && e.contains("truncated"), "{e}");
}

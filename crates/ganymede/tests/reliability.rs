//! Nothing lost, nothing silently wrong (docs/reliability.md): outputs that never overwrite a
//! run or a checkpoint, one writer per run directory, history kept on resume, a graceful stop on
//! real signals that resumes bit-identically, and checksummed checkpoints.

mod util;

use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};
use util::{fails, ganymede, losses, ok, TempDir};

fn s(p: &Path) -> String {
    p.display().to_string()
}

/// Arguments of a short tiny run into `out`, with extra `--set`s.
fn run_args(out: &Path, steps: usize, sets: &[&str]) -> Vec<String> {
    let mut a: Vec<String> = [
        "train",
        "--steps",
        &steps.to_string(),
        "--set",
        "data.builtin_bytes=200000",
        "--set",
        "metrics.val_every=0",
        "--out",
        &s(out),
    ]
    .iter()
    .map(|x| x.to_string())
    .collect();
    for e in sets {
        a.extend(["--set".to_string(), e.to_string()]);
    }
    a
}

fn train(dir: &Path, out: &Path, steps: usize, sets: &[&str]) -> PathBuf {
    ok(ganymede(dir, &run_args(out, steps, sets), &[]));
    out.to_path_buf()
}

/// Start `ganymede` with `args` in the background (output to files in `dir`).
fn spawn(dir: &Path, args: &[String]) -> Child {
    Command::new(env!("CARGO_BIN_EXE_ganymede"))
        .current_dir(dir)
        .args(args)
        .stdout(fs::File::create(dir.join("bg.out")).unwrap())
        .stderr(fs::File::create(dir.join("bg.err")).unwrap())
        .stdin(Stdio::null())
        .spawn()
        .expect("start ganymede")
}

/// Wait until `run`'s metrics hold at least `n` steps (the run is training, its handlers are
/// installed and its lock is held).
fn wait_for_steps(child: &mut Child, run: &Path, n: usize) {
    let t = Instant::now();
    loop {
        let lines = fs::read_to_string(run.join("metrics.jsonl"))
            .map(|t| t.lines().count())
            .unwrap_or(0);
        if lines >= n {
            return;
        }
        if let Some(st) = child.try_wait().unwrap() {
            panic!("the run ended ({st}) before step {n}");
        }
        assert!(
            t.elapsed() < Duration::from_secs(120),
            "no step {n} in 120 s"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
}

fn signal(child: &Child, sig: i32) {
    // SAFETY: kill(2) on our own child's pid.
    assert_eq!(unsafe { libc::kill(child.id() as i32, sig) }, 0);
}

fn wait_status(child: &mut Child) -> Option<i32> {
    child.wait().unwrap().code()
}

fn bg_output(dir: &Path) -> String {
    fs::read_to_string(dir.join("bg.out")).unwrap_or_default()
        + &fs::read_to_string(dir.join("bg.err")).unwrap_or_default()
}

fn assert_same_losses(a: &[f64], b: &[f64]) {
    assert_eq!(a.len(), b.len(), "{} vs {} steps", a.len(), b.len());
    for (i, (x, y)) in a.iter().zip(b).enumerate() {
        assert_eq!(x.to_bits(), y.to_bits(), "step {}: {x} vs {y}", i + 1);
    }
}

fn latest(run: &Path) -> String {
    fs::read_to_string(run.join("checkpoints/latest"))
        .unwrap()
        .trim()
        .to_string()
}

// ---- 1. Outputs never clobber -------------------------------------------------------------

#[test]
fn outputs_never_overwrite_a_checkpoint_a_run_or_a_file() {
    let tmp = TempDir::new("clobber");
    let d = tmp.path();
    let run = train(d, &d.join("run"), 2, &[]);
    let ckpt = run.join("checkpoints/step_00000002");
    let model = fs::read(ckpt.join("model.safetensors")).unwrap();
    let eval = |c: &Path| ok(ganymede(d, &["eval", "--checkpoint", &s(c), "--json"], &[]));
    let before = eval(&ckpt);

    // export onto the checkpoint itself, or onto the run: refused, even with --force.
    for target in [&ckpt, &run] {
        for force in [false, true] {
            let mut a = vec!["export", "--checkpoint", ckpt.to_str().unwrap()];
            let t = s(target);
            a.extend(["--out", &t]);
            if force {
                a.push("--force");
            }
            let e = fails(ganymede(d, &a, &[]));
            assert!(e.contains(&t) && e.contains("holds a"), "{e}");
        }
    }
    assert_eq!(fs::read(ckpt.join("model.safetensors")).unwrap(), model);
    assert_eq!(eval(&ckpt), before);

    // A non-empty folder: refused, then overwritten with --force.
    let hf = d.join("hf");
    fs::create_dir_all(&hf).unwrap();
    fs::write(hf.join("notes.txt"), "mine").unwrap();
    let exp = |force: bool| {
        let mut a = vec!["export", "--checkpoint", run.to_str().unwrap(), "--out"];
        let h = s(&hf);
        a.push(&h);
        if force {
            a.push("--force");
        }
        ganymede(d, &a, &[])
    };
    let e = fails(exp(false));
    assert!(e.contains("not empty") && e.contains("--force"), "{e}");
    assert!(!hf.join("model.safetensors").exists());
    ok(exp(true));
    assert!(hf.join("model.safetensors").is_file());

    // tokenizer train: an existing file is refused (and kept), --force overwrites; a run's own
    // file is refused even with --force.
    let text = d.join("corpus.txt");
    fs::write(&text, "the cat sat on the mat. ".repeat(200)).unwrap();
    let out = d.join("tok.json");
    fs::write(&out, "precious").unwrap();
    let tok = |out: &Path, force: bool| {
        let mut a = vec![
            "tokenizer".to_string(),
            "train".into(),
            "--input".into(),
            s(&text),
            "--vocab-size".into(),
            "300".into(),
            "--out".into(),
            s(out),
        ];
        if force {
            a.push("--force".into());
        }
        ganymede(d, &a, &[])
    };
    let e = fails(tok(&out, false));
    assert!(e.contains("tok.json") && e.contains("exists"), "{e}");
    assert_eq!(fs::read_to_string(&out).unwrap(), "precious");
    ok(tok(&out, true));
    assert!(fs::read_to_string(&out).unwrap().contains("\"model\""));
    let config = fs::read(run.join("config.toml")).unwrap();
    let e = fails(tok(&run.join("config.toml"), true));
    assert!(e.contains("config.toml") && e.contains("belongs to"), "{e}");
    assert_eq!(fs::read(run.join("config.toml")).unwrap(), config);

    // calibrate: refused before measuring anything.
    let cluster = d.join("cluster.toml");
    fs::write(&cluster, "mine").unwrap();
    let e = fails(ganymede(
        d,
        &["calibrate", "--quick", "--out", cluster.to_str().unwrap()],
        &[],
    ));
    assert!(e.contains("cluster.toml") && e.contains("--force"), "{e}");
    assert_eq!(fs::read_to_string(&cluster).unwrap(), "mine");

    // report rewrites its own page, but not someone else's report.html.
    let r = s(&run);
    ok(ganymede(d, &["report", &r], &[]));
    ok(ganymede(d, &["report", &r], &[]));
    fs::write(run.join("report.html"), "my notes").unwrap();
    let e = fails(ganymede(d, &["report", &r], &[]));
    assert!(e.contains("report.html") && e.contains("--force"), "{e}");
    assert_eq!(
        fs::read_to_string(run.join("report.html")).unwrap(),
        "my notes"
    );
    ok(ganymede(d, &["report", &r, "--force"], &[]));
}

// ---- 2. One writer per run directory ------------------------------------------------------

#[test]
fn a_run_directory_has_one_writer_and_a_killed_writer_does_not_block() {
    let tmp = TempDir::new("lock");
    let d = tmp.path();
    let run = d.join("run");
    let mut bg = spawn(
        d,
        &run_args(
            &run,
            100_000,
            &["checkpoint.interval=2", "metrics.log_every=1"],
        ),
    );
    wait_for_steps(&mut bg, &run, 3);
    // A resume of the live run, and a fresh run into it: one line naming the holder.
    let pid = format!("pid {}", bg.id());
    let e = fails(ganymede(d, &["train", "--resume", &s(&run)], &[]));
    assert!(e.contains("being written by") && e.contains(&pid), "{e}");
    let e = fails(ganymede(d, &run_args(&run, 4, &[]), &[]));
    assert!(e.contains("being written by") && e.contains(&pid), "{e}");
    // The holder, killed outright, leaves its lock file but not its lock.
    signal(&bg, libc::SIGKILL);
    bg.wait().unwrap();
    assert!(run.join("train.lock").is_file());
    let at: usize = latest(&run)["step_".len()..].parse().unwrap();
    let out = ok(ganymede(
        d,
        &[
            "train",
            "--resume",
            &s(&run),
            "--steps",
            &(at + 2).to_string(),
        ],
        &[],
    ));
    assert!(
        out.contains(&format!("steps {}..{}", at + 1, at + 2)),
        "{out}"
    );
}

// ---- 3. History kept ----------------------------------------------------------------------

#[test]
fn resuming_an_older_checkpoint_keeps_the_run_history_unless_told() {
    let tmp = TempDir::new("history");
    let d = tmp.path();
    let run = train(d, &d.join("run"), 20, &["checkpoint.interval=5"]);
    let config = fs::read(run.join("config.toml")).unwrap();
    let metrics = fs::read(run.join("metrics.jsonl")).unwrap();
    let old = run.join("checkpoints/step_00000010");
    let o = s(&old);

    // Into its own directory: refused, nothing written.
    let e = fails(ganymede(
        d,
        &["train", "--resume", &o, "--steps", "12"],
        &[],
    ));
    assert!(
        e.contains("step_00000020") && e.contains("--out") && e.contains("--truncate-history"),
        "{e}"
    );
    // Nothing left to run: refused before config.toml is rewritten.
    let e = fails(ganymede(
        d,
        &["train", "--resume", &s(&run), "--steps", "5"],
        &[],
    ));
    assert!(e.contains("nothing left to run"), "{e}");
    assert_eq!(fs::read(run.join("config.toml")).unwrap(), config);
    assert_eq!(fs::read(run.join("metrics.jsonl")).unwrap(), metrics);
    assert_eq!(latest(&run), "step_00000020");

    // A branch into a new directory leaves the run as it was.
    let branch = d.join("branch");
    ok(ganymede(
        d,
        &[
            "train",
            "--resume",
            &o,
            "--steps",
            "12",
            "--out",
            &s(&branch),
        ],
        &[],
    ));
    assert_eq!(losses(&branch).len(), 2);
    assert_eq!(fs::read(run.join("metrics.jsonl")).unwrap(), metrics);
    assert_eq!(latest(&run), "step_00000020");

    // --truncate-history cuts it, and says so by what is left.
    ok(ganymede(
        d,
        &[
            "train",
            "--resume",
            &o,
            "--steps",
            "12",
            "--truncate-history",
        ],
        &[],
    ));
    assert_eq!(latest(&run), "step_00000012");
    assert_eq!(losses(&run).len(), 12);
    assert!(!run.join("checkpoints/step_00000015").exists());
    assert!(!run.join("checkpoints/step_00000020").exists());
}

// ---- 4. Graceful stop -----------------------------------------------------------------------

/// Stop a run of `total` steps with `sig` once it has done a few, check the exit status and the
/// printed resume command, resume it, and compare every loss with an uninterrupted run.
fn stop_and_resume(tag: &str, sig: i32, extra: &[&str]) {
    let tmp = TempDir::new(tag);
    let d = tmp.path();
    let total = 60;
    let sets = ["metrics.log_every=1"];
    let straight = d.join("straight");
    let mut a = run_args(&straight, total, &sets);
    a.extend(extra.iter().map(|x| x.to_string()));
    ok(ganymede(d, &a, &[]));

    let run = d.join("run");
    let mut a = run_args(&run, total, &sets);
    a.extend(extra.iter().map(|x| x.to_string()));
    let mut bg = spawn(d, &a);
    wait_for_steps(&mut bg, &run, 3);
    signal(&bg, sig);
    let code = wait_status(&mut bg);
    let said = bg_output(d);
    assert_eq!(code, Some(75), "exit status {code:?}:\n{said}");
    let at: usize = latest(&run)["step_".len()..].parse().unwrap();
    assert!(at >= 3 && at < total, "stopped at {at}");
    assert_eq!(losses(&run).len(), at, "metrics end at the checkpoint");
    let resume = said
        .lines()
        .find_map(|l| l.split_once("resume with: ").map(|(_, c)| c.to_string()))
        .unwrap_or_else(|| panic!("no resume command:\n{said}"));
    assert!(resume.starts_with(&format!("ganymede train --resume {}", s(&run))));
    // Run the printed command (without the program name).
    let args: Vec<&str> = resume.split_whitespace().skip(1).collect();
    ok(ganymede(d, &args, &[]));
    assert_same_losses(&losses(&straight), &losses(&run));
}

#[test]
fn sigterm_stops_after_the_step_checkpoints_and_resumes_bit_identically() {
    stop_and_resume("sigterm", libc::SIGTERM, &[]);
}

#[test]
fn sigint_stops_two_ranks_at_the_same_step_and_resumes_bit_identically() {
    stop_and_resume("sigint2", libc::SIGINT, &["--ranks", "2"]);
}

#[test]
fn a_chosen_signal_stops_sharded_ranks_and_resumes_bit_identically() {
    stop_and_resume(
        "usr1",
        libc::SIGUSR1,
        &[
            "--ranks",
            "2",
            "--set",
            "parallelism.sharded_checkpoints=true",
            "--stop-signal",
            "USR1",
        ],
    );
}

#[test]
fn a_second_sigint_exits_at_once() {
    let tmp = TempDir::new("sigint-twice");
    let d = tmp.path();
    let run = d.join("run");
    // Slower steps (a larger batch), so the second signal lands while the first step's stop is
    // still pending; and it is sent only once the first has been taken (two pending SIGINTs
    // would merge into one).
    let mut bg = spawn(
        d,
        &run_args(
            &run,
            100_000,
            &["metrics.log_every=1", "training.batch_size=128"],
        ),
    );
    wait_for_steps(&mut bg, &run, 1);
    signal(&bg, libc::SIGINT);
    let t = Instant::now();
    while !bg_output(d).contains("stop requested") {
        assert!(t.elapsed() < Duration::from_secs(60), "{}", bg_output(d));
        std::thread::sleep(Duration::from_millis(1));
    }
    signal(&bg, libc::SIGINT);
    let code = wait_status(&mut bg);
    let said = bg_output(d);
    assert_eq!(code, Some(130), "{said}");
    assert!(said.contains("exiting at once"), "{said}");
    // (No stop checkpoint was written: the run had none before and made none.)
    assert!(!run.join("checkpoints/latest").exists());
}

// ---- 5. Checksums -------------------------------------------------------------------------

#[test]
fn corrupt_checkpoint_files_are_named_and_no_verify_reads_them() {
    let tmp = TempDir::new("digest");
    let d = tmp.path();
    let run = train(d, &d.join("run"), 3, &[]);
    let r = s(&run);
    let ckpt = run.join("checkpoints/step_00000003");
    let manifest: serde_json::Value =
        serde_json::from_str(&fs::read_to_string(ckpt.join("manifest.json")).unwrap()).unwrap();
    for f in ["model.safetensors", "optimizer.safetensors", "config.toml"] {
        let x = &manifest["files"][f];
        assert_eq!(x["xxh3"].as_str().unwrap().len(), 16, "{f}: {x}");
    }
    let eval = |extra: &[&str]| {
        let mut a = vec!["eval", "--checkpoint", &r, "--json"];
        a.extend(extra);
        ganymede(d, &a, &[])
    };
    let good = ok(eval(&[]));

    // Zeroed bytes in the middle of the weights (same size: the header still parses).
    let model = ckpt.join("model.safetensors");
    let mut b = fs::read(&model).unwrap();
    let mid = b.len() / 2;
    b[mid..mid + 64].fill(0);
    fs::write(&model, &b).unwrap();
    let e = fails(eval(&[]));
    assert!(
        e.contains("model.safetensors") && e.contains("corrupt"),
        "{e}"
    );
    for cmd in [
        vec!["train", "--resume", &r, "--steps", "5"],
        vec!["export", "--checkpoint", &r, "--out", "hf"],
        vec!["generate", "--checkpoint", &r, "--prompt", "a"],
    ] {
        let e = fails(ganymede(d, &cmd, &[]));
        assert!(
            e.contains("model.safetensors") && e.contains("corrupt"),
            "{cmd:?}: {e}"
        );
    }
    // --no-verify reads it: a different model, as the corruption made it.
    let bad = ok(eval(&["--no-verify"]));
    assert_ne!(good, bad);

    // eval, generate and export never read optimizer.safetensors: they need none.
    let run2 = train(d, &d.join("run2"), 3, &[]);
    let r2 = s(&run2);
    fs::remove_file(run2.join("checkpoints/step_00000003/optimizer.safetensors")).unwrap();
    ok(ganymede(d, &["eval", "--checkpoint", &r2], &[]));
    ok(ganymede(
        d,
        &["export", "--checkpoint", &r2, "--out", "hf2"],
        &[],
    ));
    ok(ganymede(
        d,
        &[
            "generate",
            "--checkpoint",
            &r2,
            "--prompt",
            "a",
            "--max-new-tokens",
            "4",
        ],
        &[],
    ));
    // A resume does need it, and says which file is missing.
    let e = fails(ganymede(
        d,
        &["train", "--resume", &r2, "--steps", "5"],
        &[],
    ));
    assert!(e.contains("optimizer.safetensors"), "{e}");
}

#[test]
fn an_edited_shard_layout_is_refused_with_or_without_verification() {
    let tmp = TempDir::new("shards");
    let d = tmp.path();
    let run = d.join("run");
    let mut a = run_args(&run, 2, &["parallelism.sharded_checkpoints=true"]);
    a.extend(["--ranks".into(), "2".into()]);
    ok(ganymede(d, &a, &[]));
    let ckpt = run.join("checkpoints/step_00000002");
    let shards = ckpt.join("shards.json");
    let text = fs::read_to_string(&shards).unwrap();
    assert!(text.contains("\"dp_shard\": 2"), "{text}");
    fs::write(&shards, text.replace("\"dp_shard\": 2", "\"dp_shard\": 1")).unwrap();
    let r = s(&run);
    let e = fails(ganymede(d, &["eval", "--checkpoint", &r], &[]));
    assert!(e.contains("shards.json") && e.contains("corrupt"), "{e}");
    let e = fails(ganymede(
        d,
        &["eval", "--checkpoint", &r, "--no-verify"],
        &[],
    ));
    assert!(
        e.contains("shards.json") && e.contains("dp_shard = 1"),
        "{e}"
    );

    // A killed sharded save's staging folder goes at the next run's start, at one rank too.
    fs::write(&shards, text).unwrap();
    let stage = run.join("checkpoints/.shards-step_00000003");
    fs::create_dir_all(&stage).unwrap();
    fs::write(stage.join("rank0.safetensors"), "partial").unwrap();
    ok(ganymede(d, &["train", "--resume", &r, "--steps", "3"], &[]));
    assert!(!stage.exists());
}

/// Rotation keeps the newest `keep_last` and every `keep_every`th, so a good early checkpoint
/// survives a run that went bad later.
#[test]
fn retention_keeps_the_newest_and_every_nth() {
    let tmp = TempDir::new("keep");
    let d = tmp.path();
    let run = train(
        d,
        &d.join("run"),
        12,
        &[
            "checkpoint.interval=2",
            "checkpoint.keep_last=2",
            "checkpoint.keep_every=4",
        ],
    );
    let mut kept: Vec<String> = fs::read_dir(run.join("checkpoints"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("step_"))
        .collect();
    kept.sort();
    assert_eq!(
        kept,
        [
            "step_00000004",
            "step_00000008",
            "step_00000010",
            "step_00000012"
        ]
    );
}

/// A run killed by too high a learning rate (loss pinned at ln 256, gradient norm 0) stops
/// before checkpointing the dead model, instead of rotating out the good checkpoints; with
/// `metrics.dead_check = "warn"` it says so once and goes on.
#[test]
fn a_dead_run_is_noticed() {
    let tmp = TempDir::new("dead");
    let d = tmp.path();
    let sets = [
        "optimizer.lr=1e3",
        "optimizer.warmup_steps=0",
        "checkpoint.interval=1",
    ];
    let run = d.join("run");
    let e = fails(ganymede(d, &run_args(&run, 10, &sets), &[]));
    assert!(
        e.contains("the run is dead at step") && e.contains("ln(vocab_size) = 5.5452"),
        "{e}"
    );
    let step: usize = e
        .split("the run is dead at step ")
        .nth(1)
        .and_then(|t| t.split(':').next())
        .and_then(|t| t.parse().ok())
        .unwrap();
    assert!(step < 10, "{e}");
    assert!(!run.join(format!("checkpoints/step_{step:08}")).exists());
    assert_eq!(latest(&run), format!("step_{:08}", step - 1));

    let mut a = run_args(&d.join("warned"), 5, &sets);
    a.extend(["--set".into(), "metrics.dead_check=warn".into()]);
    let o = ganymede(d, &a, &[]);
    let said = String::from_utf8_lossy(&o.stdout).to_string();
    ok(o);
    assert_eq!(
        said.matches("warning: the run is dead").count(),
        1,
        "{said}"
    );
}

/// A failure every rank shares is said once, with the ranks summarised.
#[test]
fn a_failure_of_every_rank_is_one_clause() {
    let tmp = TempDir::new("ranks-err");
    let d = tmp.path();
    let run = d.join("run");
    let mut a = run_args(&run, 2, &[]);
    a.extend(["--ranks".into(), "4".into()]);
    ok(ganymede(d, &a, &[]));
    let model = run.join("checkpoints/step_00000002/model.safetensors");
    let mut b = fs::read(&model).unwrap();
    let n = b.len();
    b[n - 8] ^= 0x40;
    fs::write(&model, &b).unwrap();
    let r = s(&run);
    let e = fails(ganymede(
        d,
        &["train", "--resume", &r, "--steps", "3", "--ranks", "4"],
        &[],
    ));
    assert!(e.contains("ranks 0-3: checkpoint file"), "{e}");
    assert_eq!(e.matches("model.safetensors").count(), 1, "{e}");
}

/// `generate` prints tokens as they are drawn: a run asked for a billion tokens shows text at
/// once (it printed nothing until the end), and is killed here.
#[test]
fn generate_streams_its_tokens() {
    use std::io::Read;
    let tmp = TempDir::new("stream");
    let d = tmp.path();
    let run = train(d, &d.join("run"), 2, &[]);
    let mut child = Command::new(env!("CARGO_BIN_EXE_ganymede"))
        .current_dir(d)
        .args([
            "generate",
            "--checkpoint",
            run.to_str().unwrap(),
            "--prompt",
            "the cat ",
            "--max-new-tokens",
            "1000000000",
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut out = child.stdout.take().unwrap();
    let mut got = Vec::new();
    let mut buf = [0u8; 256];
    let t = Instant::now();
    while got.len() < 40 && t.elapsed() < Duration::from_secs(60) {
        match out.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => got.extend_from_slice(&buf[..n]),
        }
    }
    let _ = child.kill();
    let _ = child.wait();
    assert!(got.len() >= 40, "{} bytes in 60 s", got.len());
    assert!(got.starts_with(b"the cat "));
}

/// A resume on other tokens than the checkpoint's run trained on is refused: an edited
/// `data.path` (it was tokenised again silently); `--allow-data-change` accepts a deliberate
/// change. A truncated `data/train.bin` (it trained on 250 tokens) is rebuilt.
#[test]
fn a_resume_on_changed_data_is_refused() {
    let tmp = TempDir::new("data-change");
    let d = tmp.path();
    let text = d.join("corpus.txt");
    let para = "the quick brown fox jumps over the lazy dog. a cat sat on a mat. ";
    fs::write(&text, para.repeat(800)).unwrap();
    let run = d.join("run");
    let path_set = format!("data.path={}", s(&text));
    let mut a = run_args(&run, 6, &[&path_set]);
    a.extend(["--stop-after".into(), "3".into()]);
    ok(ganymede(d, &a, &[]));
    fs::write(&text, para.replace("fox", "cat").repeat(800)).unwrap();
    let r = s(&run);
    let e = fails(ganymede(d, &["train", "--resume", &r], &[]));
    assert!(
        e.contains("the data differ")
            && e.contains("training split")
            && e.contains("corpus.txt")
            && e.contains("--allow-data-change"),
        "{e}"
    );
    ok(ganymede(
        d,
        &["train", "--resume", &r, "--allow-data-change"],
        &[],
    ));

    let run = d.join("run2");
    let mut a = run_args(&run, 6, &[]);
    a.extend(["--stop-after".into(), "3".into()]);
    ok(ganymede(d, &a, &[]));
    let bin = run.join("data/train.bin");
    fs::OpenOptions::new()
        .write(true)
        .open(&bin)
        .unwrap()
        .set_len(1000)
        .unwrap();
    // The run's own split cut short is rebuilt from its input (the data folder records the
    // split sizes), and the fingerprint then finds the same tokens: the resume goes on.
    ok(ganymede(d, &["train", "--resume", &s(&run)], &[]));
    assert!(fs::metadata(&bin).unwrap().len() > 1000);
}

/// A loss spike over the running median is reported once when it begins; a healthy run says
/// nothing.
#[test]
fn a_loss_spike_is_reported() {
    let tmp = TempDir::new("spike");
    let d = tmp.path();
    let run_out = |name: &str, sets: &[&str]| {
        let o = ganymede(d, &run_args(&d.join(name), 16, sets), &[]);
        let said = String::from_utf8_lossy(&o.stdout).to_string();
        ok(o);
        said
    };
    // lr 3 ramping up over 20 steps: the loss jumps past 3x its median (at step 12 here: 41.0
    // against a median of 8.6), once the first 10 steps are in the window.
    let said = run_out(
        "hot",
        &[
            "optimizer.lr=3",
            "optimizer.warmup_steps=20",
            "metrics.dead_check=off",
        ],
    );
    assert_eq!(
        said.matches("warning: loss spike at step").count(),
        1,
        "{said}"
    );
    let said = run_out("calm", &[]);
    assert!(!said.contains("loss spike"), "{said}");
    let e = fails(ganymede(
        d,
        &["train", "--set", "metrics.spike_factor=0.5"],
        &[],
    ));
    assert!(e.contains("metrics.spike_factor"), "{e}");
}

// ---- 6. Values and limits -------------------------------------------------------------------

#[test]
fn negative_numbers_and_thread_counts_get_clear_answers() {
    let tmp = TempDir::new("values");
    let d = tmp.path();
    let e = fails(ganymede(d, &["train", "--steps", "-5"], &[]));
    assert!(e.contains("--steps") && e.contains("-5"), "{e}");
    let e = fails(ganymede(
        d,
        &[
            "generate",
            "--checkpoint",
            "x",
            "--prompt",
            "a",
            "--temperature",
            "-1",
        ],
        &[],
    ));
    assert!(e.contains("--temperature") && e.contains("-1"), "{e}");
    for (set, key) in [
        ("model.init_std=-1", "model.init_std"),
        ("model.init_std=0", "model.init_std"),
        ("optimizer.eps=0", "optimizer.eps"),
        ("checkpoint.keep_last=0", "checkpoint.keep_last"),
    ] {
        let e = fails(ganymede(d, &["train", "--set", set], &[]));
        assert!(e.contains(key) && e.contains("must be"), "{set}: {e}");
    }
    // Values of the wrong type name their key (and, in a file, its line).
    for (set, key) in [
        ("training.batch_size=-1", "training.batch_size"),
        ("optimizer.lr=fast", "optimizer.lr"),
    ] {
        let e = fails(ganymede(d, &["train", "--set", set], &[]));
        assert!(e.contains(key), "{set}: {e}");
    }
    let job = d.join("job.toml");
    fs::write(&job, "[model]\nlayers = 2\nhidden = \"sixty-four\"\n").unwrap();
    let e = fails(ganymede(
        d,
        &["train", "--config", job.to_str().unwrap()],
        &[],
    ));
    assert!(
        e.contains("job.toml, line 3 (hidden = \"sixty-four\")") && e.contains("expected usize"),
        "{e}"
    );
    // Sizes past the machine's memory are refused before anything is allocated (they ended in
    // an allocation failure's abort).
    for set in ["training.batch_size=1000000000", "model.experts=100000000"] {
        let e = fails(ganymede(d, &["train", "--set", set], &[]));
        assert!(
            e.contains("does not fit in host memory") && e.contains("MemTotal"),
            "{set}: {e}"
        );
    }
    let e = fails(ganymede(
        d,
        &["train", "--trace", "/no/such/dir/t.json"],
        &[],
    ));
    assert!(
        e.contains("/no/such/dir") && e.contains("does not exist"),
        "{e}"
    );
    let e = fails(ganymede(d, &["train", "--stop-signal", "KILL"], &[]));
    assert!(e.contains("--stop-signal KILL"), "{e}");

    let cluster = d.join("c.toml");
    let o = ganymede(
        d,
        &[
            "calibrate",
            "--quick",
            "--threads",
            "100000",
            "--out",
            cluster.to_str().unwrap(),
        ],
        &[],
    );
    let err = String::from_utf8_lossy(&o.stderr).to_string();
    ok(o);
    assert!(err.contains("--threads 100000 capped"), "{err}");
    let cores = std::thread::available_parallelism().unwrap().get();
    let text = fs::read_to_string(&cluster).unwrap();
    assert!(text.contains(&format!("threads = {cores}\n")), "{text}");
}

//! `ganymede --help` and every command's help say what the command does.

mod util;

use util::{ganymede, ok, TempDir};

#[test]
fn every_command_is_described_by_its_own_purpose() {
    let t = TempDir::new("help");
    let top = ok(ganymede(t.path(), &["--help"], &[]));
    // (command, words its one-line description must hold)
    let want: &[(&str, &[&str])] = &[
        ("train", &["Train a model"]),
        ("eval", &["cross-entropy", "checkpoint"]),
        ("generate", &["continuation", "prompt"]),
        ("export", &["Export", "Hugging Face"]),
        ("tokenizer", &["Tokenizer"]),
        ("data", &["prepare", "shards"]),
        ("plan", &["memory", "step time"]),
        ("calibrate", &["Measure", "cluster file"]),
        ("device-check", &["GPU", "report.md"]),
        ("report", &["report.html"]),
    ];
    for (cmd, words) in want {
        let line = top
            .lines()
            .find(|l| l.trim_start().starts_with(&format!("{cmd} ")))
            .unwrap_or_else(|| panic!("{cmd} missing from --help:\n{top}"));
        for w in *words {
            assert!(line.contains(w), "{cmd}: {line:?} lacks {w:?}");
        }
        // Another command's words must not be here (a stray doc comment moves them).
        for (other, ow) in want.iter().filter(|(o, _)| o != cmd) {
            let own = ow.iter().all(|w| words.contains(w));
            if !own && ow.len() > 1 {
                assert!(
                    !ow.iter().all(|w| line.contains(w)),
                    "{cmd}'s description holds {other}'s: {line:?}"
                );
            }
        }
        let sub = ok(ganymede(t.path(), &[cmd, "--help"], &[]));
        assert!(
            words
                .iter()
                .all(|w| sub.lines().next().unwrap_or("").contains(w)),
            "{cmd} --help starts {:?}",
            sub.lines().next()
        );
    }
    // The preset lists come from the presets themselves.
    for cmd in ["train", "plan"] {
        let sub = ok(ganymede(t.path(), &[cmd, "--help"], &[]));
        for p in ganymede_config::PRESETS {
            assert!(sub.contains(p), "{cmd} --help does not list preset {p}");
        }
    }
}

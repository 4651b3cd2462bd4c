//! Every key of the resolved configuration is described in docs/config.md (in its section) and
//! listed in the README's one-line-per-key table, so a new key cannot land undocumented.

use std::path::Path;

fn repo_file(name: &str) -> String {
    let p = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../..")
        .join(name);
    std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
}

/// The text of docs/config.md between `## `[section]`` and the next `## ` heading.
fn section<'a>(doc: &'a str, name: &str) -> &'a str {
    let head = format!("## `[{name}]`");
    let start = doc
        .find(&head)
        .unwrap_or_else(|| panic!("docs/config.md has no heading {head}"));
    let rest = &doc[start + head.len()..];
    &rest[..rest.find("\n## ").unwrap_or(rest.len())]
}

#[test]
fn every_key_is_documented() {
    let doc = repo_file("docs/config.md");
    let readme = repo_file("README.md");
    let mut missing = Vec::new();
    let mut keys = 0;
    for name in ganymede_config::PRESETS {
        let job = ganymede_config::preset(name).unwrap();
        let value = toml::Value::try_from(&job).unwrap();
        for (sec, table) in value.as_table().unwrap() {
            let text = section(&doc, sec);
            for key in table.as_table().unwrap().keys() {
                keys += 1;
                if !text.contains(&format!("| `{key}`")) && !text.contains(&format!(", `{key}`")) {
                    missing.push(format!("docs/config.md [{sec}] {key}"));
                }
                if !readme.contains(&format!("| `{sec}.{key}` |")) {
                    missing.push(format!("README.md {sec}.{key}"));
                }
            }
        }
    }
    missing.sort();
    missing.dedup();
    assert!(keys > 60, "only {keys} keys walked");
    assert!(missing.is_empty(), "undocumented keys: {missing:?}");
}

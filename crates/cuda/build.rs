//! Builds the kernels' host version: kernels/*.cu through the shim (shim/cuda_shim.h) as one C++
//! translation unit, plus a table of every `extern "C"` kernel with its argument kinds, so a
//! launch from Rust is checked against the kernel's parameters.

use std::path::{Path, PathBuf};
use std::process::Command;

fn main() {
    let dir = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").unwrap());
    let out = PathBuf::from(std::env::var("OUT_DIR").unwrap());
    let kernels = dir.join("kernels");
    let shim = dir.join("shim");
    println!("cargo:rerun-if-changed={}", kernels.display());
    println!("cargo:rerun-if-changed={}", shim.display());

    let mut files: Vec<PathBuf> = std::fs::read_dir(&kernels)
        .expect("kernels/")
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "cu"))
        .collect();
    files.sort();
    for f in &files {
        println!("cargo:rerun-if-changed={}", f.display());
    }

    let mut prelude = format!(
        "#define GANY_HOST 1\n#include \"{}\"\n#include \"{}\"\n",
        shim.join("cuda_shim.h").display(),
        kernels.join("common.cuh").display()
    );
    for f in &files {
        prelude += &format!("#include \"{}\"\n", f.display());
    }
    let kernels_only = out.join("kernels_only.cpp");
    std::fs::write(&kernels_only, &prelude).unwrap();

    let mut build = cc::Build::new();
    build
        .cpp(true)
        .std("c++20")
        .opt_level(2)
        // Exactly the operations written: no contraction into fused multiply-adds.
        .flag_if_supported("-ffp-contract=off")
        // `#pragma unroll` is a hint for NVRTC only.
        .flag_if_supported("-Wno-unknown-pragmas")
        .include(&out);
    let table = kernel_table(&build, &kernels_only, &kernels);
    std::fs::write(out.join("kernel_table.inc"), table).unwrap();

    let unit = out.join("kernels_host.cpp");
    std::fs::write(
        &unit,
        format!(
            "{prelude}#include \"{}\"\n",
            shim.join("runtime.cpp").display()
        ),
    )
    .unwrap();
    build.file(&unit).compile("ganymede_kernels_host");
}

/// Preprocesses the kernels and lists each `extern "C" void name(params)` defined in a kernel
/// file as `GANY_KERNEL(name, "kinds")`.
fn kernel_table(build: &cc::Build, unit: &Path, kernels: &Path) -> String {
    let mut cmd = build.get_compiler().to_command();
    cmd.arg("-E").arg("-x").arg("c++").arg(unit);
    let out = run(cmd);
    // Keep only text that came from kernels/ (line markers: `# N "file" ...`).
    let mut text = String::new();
    let mut keep = false;
    let kdir = kernels.display().to_string();
    for line in out.lines() {
        if let Some(rest) = line.strip_prefix("# ") {
            if let Some(q) = rest.find('"') {
                keep = rest[q + 1..].starts_with(&kdir);
                continue;
            }
        }
        if keep {
            text.push_str(line);
            text.push('\n');
        }
    }
    let mut table = String::new();
    let mut rest = text.as_str();
    while let Some(at) = rest.find("extern \"C\"") {
        rest = &rest[at + "extern \"C\"".len()..];
        let head = rest.trim_start();
        let Some(after_void) = head.strip_prefix("void") else {
            continue;
        };
        let open = after_void.find('(').expect("kernel parameter list");
        let name = after_void[..open].trim();
        let close = after_void.find(')').expect("kernel parameter list");
        let kinds: String = after_void[open + 1..close]
            .split(',')
            .filter(|p| !p.trim().is_empty())
            .map(|p| kind(name, p))
            .collect();
        table += &format!("GANY_KERNEL({name}, \"{kinds}\")\n");
    }
    assert!(
        !table.is_empty(),
        "no kernels found in {}",
        kernels.display()
    );
    table
}

fn kind(kernel: &str, param: &str) -> char {
    if param.contains('*') {
        return 'p';
    }
    let words: Vec<&str> = param.split_whitespace().filter(|w| *w != "const").collect();
    let ty = words[..words.len() - 1].join(" ");
    match ty.as_str() {
        "int" => 'i',
        "unsigned" | "unsigned int" => 'u',
        "long long" => 'l',
        "float" => 'f',
        "double" => 'd',
        _ => panic!(
            "kernel {kernel}: parameter `{param}` has a type the host launcher does not know"
        ),
    }
}

fn run(mut cmd: Command) -> String {
    let out = cmd.output().expect("running the C++ preprocessor");
    if !out.status.success() {
        panic!(
            "{:?} failed:\n{}",
            cmd,
            String::from_utf8_lossy(&out.stderr)
        );
    }
    String::from_utf8(out.stdout).unwrap()
}

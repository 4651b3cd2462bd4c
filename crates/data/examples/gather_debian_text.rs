//! Gather this Debian machine's license and copyright texts into one deduplicated file, a small
//! real-text corpus for benchmarks. Do not commit the output.
//! `cargo run --release -p ganymede-data --example gather_debian_text -- OUT.txt`

fn main() -> anyhow::Result<()> {
    let out = std::env::args()
        .nth(1)
        .unwrap_or_else(|| "debian-licenses.txt".into());
    let r = ganymede_data::gather_debian_text(std::path::Path::new(&out))?;
    println!(
        "{out}: {} bytes from {} files ({} paragraphs kept, {} repeats dropped)",
        r.bytes, r.files, r.paragraphs_kept, r.paragraphs_dropped
    );
    Ok(())
}

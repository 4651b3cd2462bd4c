//! `cargo run -p ganymede-plan --example plan -- --preset europa-1t --cluster jupiter`:
//! the planner without the `ganymede` binary.

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    ganymede_plan::run_cli(&args)
}

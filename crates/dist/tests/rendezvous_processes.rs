//! The TCP store across real processes: this test binary starts three copies of itself as ranks
//! 1–3 with torchrun-style variables, acts as rank 0, and every child must print rank 0's bytes.

use ganymede_dist::rendezvous::{exchange, LaunchEnv};
use std::process::{Command, Stdio};
use std::time::Duration;

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

#[test]
#[ignore = "a rank started by ranks_in_separate_processes_get_rank_zeros_bytes"]
fn child_rank() {
    let env = LaunchEnv::from_env()
        .expect("launcher variables")
        .expect("RANK is set");
    let got = exchange(&env, &[], Duration::from_secs(30)).expect("rendezvous");
    println!("RDZV-GOT rank {} {}", env.rank, hex(&got));
}

#[test]
fn ranks_in_separate_processes_get_rank_zeros_bytes() {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let exe = std::env::current_exe().unwrap();
    let world = 4;
    let children: Vec<_> = (1..world)
        .map(|r| {
            Command::new(&exe)
                .args(["--exact", "child_rank", "--ignored", "--nocapture"])
                .env("RANK", r.to_string())
                .env("WORLD_SIZE", world.to_string())
                .env("LOCAL_RANK", r.to_string())
                .env("MASTER_ADDR", "127.0.0.1")
                .env("MASTER_PORT", port.to_string())
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    let id: Vec<u8> = (0..128u32).map(|i| (i * 7 + 3) as u8).collect();
    let root = LaunchEnv {
        rank: 0,
        world_size: world,
        local_rank: 0,
        master_addr: "127.0.0.1".into(),
        master_port: port,
        launcher: "torchrun",
    };
    let mine = exchange(&root, &id, Duration::from_secs(30)).unwrap();
    assert_eq!(mine, id);
    for (k, c) in children.into_iter().enumerate() {
        let out = c.wait_with_output().unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "rank {}: {text}{err}", k + 1);
        let want = format!("RDZV-GOT rank {} {}", k + 1, hex(&id));
        assert!(text.contains(&want), "rank {}: {text}", k + 1);
    }
}

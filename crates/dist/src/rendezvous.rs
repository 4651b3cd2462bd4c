//! How the processes of a job find each other without MPI: the launcher's variables
//! ([`LaunchEnv`]: torchrun-style or Slurm's) and a small TCP store on rank 0 ([`exchange`])
//! that hands every rank the same bytes (NCCL's unique id, for the NCCL group of issue 10).
//!
//! The store is a one-shot exchange, not a network collective: rank 0 listens on
//! `MASTER_PORT`, every other rank connects (retrying until the deadline, since rank 0 may start
//! last), says its rank, and reads rank 0's bytes. A rank that never arrives ends the job on
//! rank 0 with an error naming it; a rank 0 that never answers ends it on the others.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

/// Where this process sits in the job, from its launcher.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LaunchEnv {
    pub rank: usize,
    pub world_size: usize,
    /// The GPU this process uses.
    pub local_rank: usize,
    /// Host and port of rank 0's store.
    pub master_addr: String,
    pub master_port: u16,
    /// Which variables it came from (`torchrun` or `slurm`), for messages.
    pub launcher: &'static str,
}

/// The store's port when the launcher gives none (torchrun's default).
pub const DEFAULT_PORT: u16 = 29500;

/// A missing or malformed launcher variable, named.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum RendezvousError {
    #[error("{var} = {value:?}: {why}")]
    BadVar {
        var: &'static str,
        value: String,
        why: String,
    },
    #[error("{var} is not set ({launcher} launch: {needs})")]
    MissingVar {
        var: &'static str,
        launcher: &'static str,
        needs: &'static str,
    },
    #[error("rendezvous at {addr}: ranks {missing:?} of {world} did not arrive within {waited:?}")]
    NotArrived {
        addr: String,
        missing: Vec<usize>,
        world: usize,
        waited: Duration,
    },
    #[error("rank {rank}: could not reach rank 0's store at {addr} within {waited:?}: {last}")]
    Unreachable {
        rank: usize,
        addr: String,
        waited: Duration,
        last: String,
    },
    #[error("rendezvous at {addr}: {why}")]
    Protocol { addr: String, why: String },
}

fn parse<T: std::str::FromStr>(var: &'static str, value: &str) -> Result<T, RendezvousError> {
    value.trim().parse().map_err(|_| RendezvousError::BadVar {
        var,
        value: value.to_string(),
        why: "not a non-negative integer".into(),
    })
}

/// The first host of a Slurm node list: `gpu[003-006,010]` → `gpu003`, `a,b` → `a`,
/// `x[1-2],y[5]` → `x1`.
pub fn first_slurm_host(list: &str) -> Option<String> {
    let list = list.trim();
    let head_end = list.find([',', '[']).unwrap_or(list.len());
    let prefix = &list[..head_end];
    if list[head_end..].starts_with('[') {
        let inner = &list[head_end + 1..list[head_end..].find(']')? + head_end];
        let first = inner.split([',', '-']).next()?;
        return Some(format!("{prefix}{first}"));
    }
    (!prefix.is_empty()).then(|| prefix.to_string())
}

impl LaunchEnv {
    /// The launcher's variables through `get` (the environment, or a test's map): torchrun's
    /// `RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `MASTER_ADDR`, `MASTER_PORT` when `RANK` is set, else
    /// Slurm's `SLURM_PROCID`, `SLURM_NTASKS`, `SLURM_LOCALID` and the first host of
    /// `SLURM_JOB_NODELIST` (port `MASTER_PORT` or [`DEFAULT_PORT`]); `None` under neither.
    pub fn from_vars(
        get: impl Fn(&str) -> Option<String>,
    ) -> Result<Option<Self>, RendezvousError> {
        let need = |var: &'static str, launcher, needs| {
            get(var).ok_or(RendezvousError::MissingVar {
                var,
                launcher,
                needs,
            })
        };
        let port = |get_port: Option<String>| match get_port {
            Some(p) => parse::<u16>("MASTER_PORT", &p),
            None => Ok(DEFAULT_PORT),
        };
        let env = if let Some(rank) = get("RANK") {
            const NEEDS: &str = "RANK, WORLD_SIZE, MASTER_ADDR (LOCAL_RANK, MASTER_PORT optional)";
            LaunchEnv {
                rank: parse("RANK", &rank)?,
                world_size: parse("WORLD_SIZE", &need("WORLD_SIZE", "torchrun", NEEDS)?)?,
                local_rank: get("LOCAL_RANK")
                    .map(|v| parse("LOCAL_RANK", &v))
                    .transpose()?
                    .unwrap_or(0),
                master_addr: need("MASTER_ADDR", "torchrun", NEEDS)?,
                master_port: port(get("MASTER_PORT"))?,
                launcher: "torchrun",
            }
        } else if let Some(rank) = get("SLURM_PROCID") {
            const NEEDS: &str = "SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, SLURM_JOB_NODELIST";
            let list = need("SLURM_JOB_NODELIST", "slurm", NEEDS)?;
            let master_addr = match get("MASTER_ADDR") {
                Some(a) => a,
                None => first_slurm_host(&list).ok_or_else(|| RendezvousError::BadVar {
                    var: "SLURM_JOB_NODELIST",
                    value: list.clone(),
                    why: "no host in it".into(),
                })?,
            };
            LaunchEnv {
                rank: parse("SLURM_PROCID", &rank)?,
                world_size: parse("SLURM_NTASKS", &need("SLURM_NTASKS", "slurm", NEEDS)?)?,
                local_rank: parse("SLURM_LOCALID", &need("SLURM_LOCALID", "slurm", NEEDS)?)?,
                master_addr,
                master_port: port(get("MASTER_PORT"))?,
                launcher: "slurm",
            }
        } else {
            return Ok(None);
        };
        if env.world_size == 0 || env.rank >= env.world_size {
            let var = if env.launcher == "torchrun" {
                "RANK"
            } else {
                "SLURM_PROCID"
            };
            return Err(RendezvousError::BadVar {
                var,
                value: env.rank.to_string(),
                why: format!("not a rank of a world of {}", env.world_size),
            });
        }
        Ok(Some(env))
    }

    /// [`LaunchEnv::from_vars`] over this process's environment.
    pub fn from_env() -> Result<Option<Self>, RendezvousError> {
        Self::from_vars(|k| std::env::var(k).ok())
    }

    fn addr(&self) -> String {
        format!("{}:{}", self.master_addr, self.master_port)
    }
}

/// Tags the store's messages, so a stray connection (another job's port) is refused by name.
const MAGIC: &[u8; 8] = b"GANYMEDE";

/// Hand every rank rank 0's `payload` (ignored on other ranks), within `timeout`. Rank 0
/// returns once every rank has connected and been answered.
pub fn exchange(
    env: &LaunchEnv,
    payload: &[u8],
    timeout: Duration,
) -> Result<Vec<u8>, RendezvousError> {
    if env.world_size == 1 {
        return Ok(payload.to_vec());
    }
    let addr = env.addr();
    let deadline = Instant::now() + timeout;
    let protocol = |why: String| RendezvousError::Protocol {
        addr: addr.clone(),
        why,
    };
    if env.rank == 0 {
        let listener = TcpListener::bind(("0.0.0.0", env.master_port)).map_err(|e| {
            protocol(format!(
                "rank 0 cannot listen on port {}: {e}",
                env.master_port
            ))
        })?;
        listener
            .set_nonblocking(true)
            .map_err(|e| protocol(e.to_string()))?;
        let mut arrived = vec![false; env.world_size];
        arrived[0] = true;
        while arrived.iter().any(|a| !a) {
            match listener.accept() {
                Ok((mut s, _)) => {
                    s.set_nonblocking(false)
                        .map_err(|e| protocol(e.to_string()))?;
                    s.set_read_timeout(Some(Duration::from_secs(5))).ok();
                    let mut hello = [0u8; 16];
                    if s.read_exact(&mut hello).is_err() || &hello[..8] != MAGIC {
                        continue; // not one of ours; keep waiting for the real ranks
                    }
                    let r = u64::from_le_bytes(hello[8..].try_into().unwrap()) as usize;
                    if r == 0 || r >= env.world_size || arrived[r] {
                        return Err(protocol(format!(
                            "a process says it is rank {r} (world {}, already arrived: {})",
                            env.world_size,
                            r < env.world_size && arrived[r]
                        )));
                    }
                    let mut msg = Vec::with_capacity(8 + payload.len());
                    msg.extend_from_slice(&(payload.len() as u64).to_le_bytes());
                    msg.extend_from_slice(payload);
                    s.write_all(&msg)
                        .map_err(|e| protocol(format!("answering rank {r}: {e}")))?;
                    arrived[r] = true;
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    if Instant::now() >= deadline {
                        let missing = (0..env.world_size).filter(|&r| !arrived[r]).collect();
                        return Err(RendezvousError::NotArrived {
                            addr,
                            missing,
                            world: env.world_size,
                            waited: timeout,
                        });
                    }
                    std::thread::sleep(Duration::from_millis(10));
                }
                Err(e) => return Err(protocol(format!("accepting: {e}"))),
            }
        }
        return Ok(payload.to_vec());
    }
    // Other ranks: connect until rank 0 listens, say who we are, read its bytes.
    let target: Vec<SocketAddr> = (env.master_addr.as_str(), env.master_port)
        .to_socket_addrs()
        .map_err(|e| protocol(format!("resolving {}: {e}", env.master_addr)))?
        .collect();
    let mut last = String::from("no address");
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(RendezvousError::Unreachable {
                rank: env.rank,
                addr,
                waited: timeout,
                last,
            });
        }
        for a in &target {
            match TcpStream::connect_timeout(a, left.min(Duration::from_secs(1))) {
                Ok(mut s) => {
                    s.set_read_timeout(Some(left.max(Duration::from_millis(1))))
                        .ok();
                    let mut hello = Vec::with_capacity(16);
                    hello.extend_from_slice(MAGIC);
                    hello.extend_from_slice(&(env.rank as u64).to_le_bytes());
                    let got = s.write_all(&hello).and_then(|_| {
                        let mut len = [0u8; 8];
                        s.read_exact(&mut len)?;
                        let mut data = vec![0u8; u64::from_le_bytes(len) as usize];
                        s.read_exact(&mut data)?;
                        Ok(data)
                    });
                    match got {
                        Ok(data) => return Ok(data),
                        Err(e) => last = e.to_string(),
                    }
                }
                Err(e) => last = e.to_string(),
            }
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Rank 0's `bytes` (a fixed length on every rank) on every rank of a host group: how the
/// NCCL unique id travels when MPI launched the job. Each byte travels as one f32, exact and
/// safe from any reinterpretation of bit patterns on the way.
pub fn broadcast_bytes(pg: &dyn crate::ProcessGroup, bytes: &[u8]) -> crate::Result<Vec<u8>> {
    let mut v: Vec<f32> = bytes.iter().map(|&b| f32::from(b)).collect();
    pg.broadcast(ganymede_core::ViewMut::Host(&mut v), 0, crate::Phase::Other)?;
    Ok(v.iter().map(|&x| x as u8).collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn vars(kv: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let m: HashMap<String, String> = kv
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        move |k| m.get(k).cloned()
    }

    #[test]
    fn torchrun_and_slurm_variables() {
        let t = LaunchEnv::from_vars(vars(&[
            ("RANK", "5"),
            ("WORLD_SIZE", "8"),
            ("LOCAL_RANK", "1"),
            ("MASTER_ADDR", "node7"),
            ("MASTER_PORT", "31000"),
        ]))
        .unwrap()
        .unwrap();
        assert_eq!(
            (
                t.rank,
                t.world_size,
                t.local_rank,
                t.addr().as_str(),
                t.launcher
            ),
            (5, 8, 1, "node7:31000", "torchrun")
        );
        let s = LaunchEnv::from_vars(vars(&[
            ("SLURM_PROCID", "9"),
            ("SLURM_NTASKS", "384"),
            ("SLURM_LOCALID", "1"),
            ("SLURM_JOB_NODELIST", "jwb[0123-0218,0300]"),
        ]))
        .unwrap()
        .unwrap();
        assert_eq!(
            (
                s.rank,
                s.world_size,
                s.local_rank,
                s.addr().as_str(),
                s.launcher
            ),
            (9, 384, 1, "jwb0123:29500", "slurm")
        );
        assert_eq!(LaunchEnv::from_vars(vars(&[])).unwrap(), None);
        assert_eq!(first_slurm_host("a1,b2").as_deref(), Some("a1"));
        assert_eq!(first_slurm_host("gpu-x[7]").as_deref(), Some("gpu-x7"));
        assert_eq!(first_slurm_host("solo").as_deref(), Some("solo"));
    }

    #[test]
    fn bad_variables_are_named() {
        let e = LaunchEnv::from_vars(vars(&[("RANK", "3"), ("MASTER_ADDR", "h")])).unwrap_err();
        assert!(e.to_string().contains("WORLD_SIZE is not set"), "{e}");
        let e = LaunchEnv::from_vars(vars(&[
            ("RANK", "4"),
            ("WORLD_SIZE", "4"),
            ("MASTER_ADDR", "h"),
        ]))
        .unwrap_err();
        assert!(e.to_string().contains("RANK = \"4\""), "{e}");
        let e = LaunchEnv::from_vars(vars(&[
            ("RANK", "0"),
            ("WORLD_SIZE", "two"),
            ("MASTER_ADDR", "h"),
        ]))
        .unwrap_err();
        assert!(e.to_string().contains("WORLD_SIZE = \"two\""), "{e}");
    }

    /// A free loopback port (bound and released; the test's ranks take it next).
    fn free_port() -> u16 {
        TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port()
    }

    fn env(rank: usize, world: usize, port: u16) -> LaunchEnv {
        LaunchEnv {
            rank,
            world_size: world,
            local_rank: rank,
            master_addr: "127.0.0.1".into(),
            master_port: port,
            launcher: "torchrun",
        }
    }

    #[test]
    fn every_rank_gets_rank_zeros_bytes_whoever_starts_first() {
        let port = free_port();
        let id: Vec<u8> = (0..128u8).collect();
        // Ranks 1..4 start before rank 0 listens: they retry until it does.
        let others: Vec<_> = (1..4)
            .map(|r| {
                std::thread::spawn(move || exchange(&env(r, 4, port), &[], Duration::from_secs(20)))
            })
            .collect();
        std::thread::sleep(Duration::from_millis(200));
        let mine = exchange(&env(0, 4, port), &id, Duration::from_secs(20)).unwrap();
        assert_eq!(mine, id);
        for h in others {
            assert_eq!(h.join().unwrap().unwrap(), id);
        }
    }

    #[test]
    fn a_rank_that_never_arrives_is_named_and_a_silent_root_times_out() {
        let port = free_port();
        let h = std::thread::spawn(move || exchange(&env(1, 3, port), &[], Duration::from_secs(5)));
        let e = exchange(&env(0, 3, port), b"id", Duration::from_millis(1500)).unwrap_err();
        assert!(
            matches!(&e, RendezvousError::NotArrived { missing, .. } if missing == &vec![2]),
            "{e}"
        );
        assert!(
            e.to_string().contains("ranks [2] of 3 did not arrive"),
            "{e}"
        );
        h.join().unwrap().ok();
        // No rank 0 at all: the others give up by the deadline, naming the address.
        let port = free_port();
        let t = Instant::now();
        let e = exchange(&env(2, 3, port), &[], Duration::from_millis(800)).unwrap_err();
        assert!(t.elapsed() < Duration::from_secs(5));
        assert!(
            e.to_string().contains(&format!(
                "rank 2: could not reach rank 0's store at 127.0.0.1:{port}"
            )),
            "{e}"
        );
    }

    /// The NCCL id's path under MPI, run here over threads: every byte value arrives intact.
    #[test]
    fn broadcast_bytes_hands_rank_0s_bytes_to_all() {
        let id: Vec<u8> = (0..128u32).map(|i| (i * 37 + 255) as u8).collect();
        let outs = crate::run_threads(3, &crate::ThreadsConfig::default(), |g| {
            let mine: Vec<u8> = if g.rank() == 0 {
                id.clone()
            } else {
                vec![7; 128]
            };
            broadcast_bytes(&*g, &mine).unwrap()
        });
        for o in outs {
            assert_eq!(o.unwrap(), id);
        }
    }
}

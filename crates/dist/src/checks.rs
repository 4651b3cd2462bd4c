//! What every process group checks about a collective's arguments, and the bytes it counts for
//! it, in one place: the threads, MPI and NCCL groups refuse the same bad calls with the same
//! words and report the same volumes (the convention is [`volume`]'s). Each function takes
//! buffer lengths in elements and returns this rank's (sent, received) bytes.

use crate::error::{invalid, Result};
use crate::stats::{volume, Op};

/// This rank's part in a rooted collective: whether it is the root, and its bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Rooted {
    pub is_root: bool,
    pub vol: (u64, u64),
}

pub fn check_root(op: &'static str, root: usize, world: usize) -> Result<()> {
    if root >= world {
        return Err(invalid(
            op,
            format!("root {root} out of range for {world} ranks"),
        ));
    }
    Ok(())
}

fn check_len(op: &'static str, what: &str, got: usize, world: usize, piece: usize) -> Result<()> {
    if got != world * piece {
        return Err(invalid(
            op,
            format!("{what} has {got} elements, expected {world}×{piece}"),
        ));
    }
    Ok(())
}

/// `recv` holds every rank's `send`, in rank order.
pub fn all_gather(world: usize, send: usize, recv: usize, elem: usize) -> Result<(u64, u64)> {
    check_len("all_gather", "recv", recv, world, send)?;
    Ok(volume(Op::AllGather, world, send, elem, false))
}

/// `send` holds one `recv`-sized piece per rank.
pub fn reduce_scatter(world: usize, send: usize, recv: usize, elem: usize) -> Result<(u64, u64)> {
    check_len("reduce_scatter", "send", send, world, recv)?;
    Ok(volume(Op::ReduceScatter, world, recv, elem, false))
}

pub fn all_reduce(world: usize, len: usize, elem: usize) -> (u64, u64) {
    volume(Op::AllReduce, world, len, elem, false)
}

/// Broadcast or reduce of `len` elements in place.
pub fn in_place(
    op: Op,
    world: usize,
    rank: usize,
    root: usize,
    len: usize,
    elem: usize,
) -> Result<Rooted> {
    check_root(op.name(), root, world)?;
    let is_root = rank == root;
    Ok(Rooted {
        is_root,
        vol: volume(op, world, len, elem, is_root),
    })
}

/// Gather of `send` elements a rank into the root's `recv`, which only the root passes.
pub fn gather(
    world: usize,
    rank: usize,
    root: usize,
    send: usize,
    recv: Option<usize>,
    elem: usize,
) -> Result<Rooted> {
    rooted_pieces(Op::Gather, "recv", world, rank, root, send, recv, elem)
}

/// Scatter of the root's `send` (which only the root passes) into `recv` elements a rank.
pub fn scatter(
    world: usize,
    rank: usize,
    root: usize,
    send: Option<usize>,
    recv: usize,
    elem: usize,
) -> Result<Rooted> {
    rooted_pieces(Op::Scatter, "send", world, rank, root, recv, send, elem)
}

#[allow(clippy::too_many_arguments)]
fn rooted_pieces(
    op: Op,
    what: &str,
    world: usize,
    rank: usize,
    root: usize,
    piece: usize,
    whole: Option<usize>,
    elem: usize,
) -> Result<Rooted> {
    check_root(op.name(), root, world)?;
    let is_root = rank == root;
    match (whole, is_root) {
        (Some(n), true) => check_len(op.name(), what, n, world, piece)?,
        (None, false) => {}
        _ => {
            return Err(invalid(
                op.name(),
                format!("the root (only) passes a {what} buffer of {world}×{piece} elements"),
            ))
        }
    }
    Ok(Rooted {
        is_root,
        vol: volume(op, world, piece, elem, is_root),
    })
}

/// Variable all-to-all: one count per rank on each side, summing to the buffers' lengths. The
/// bytes are those that leave and reach this rank (its piece to itself is a copy).
pub fn alltoallv(
    world: usize,
    rank: usize,
    elem: usize,
    send: usize,
    send_counts: &[usize],
    recv: usize,
    recv_counts: &[usize],
) -> Result<(u64, u64)> {
    if send_counts.len() != world || recv_counts.len() != world {
        return Err(invalid(
            "alltoallv",
            format!("need {world} send and recv counts"),
        ));
    }
    if send_counts.iter().sum::<usize>() != send || recv_counts.iter().sum::<usize>() != recv {
        return Err(invalid(
            "alltoallv",
            "counts do not sum to the buffer lengths",
        ));
    }
    let others = |c: &[usize]| -> u64 {
        c.iter()
            .enumerate()
            .filter(|&(j, _)| j != rank)
            .map(|(_, &x)| (x * elem) as u64)
            .sum()
    };
    Ok((others(send_counts), others(recv_counts)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refusals_name_the_problem() {
        let e = all_gather(4, 3, 11, 4).unwrap_err().to_string();
        assert!(e.contains("recv has 11 elements, expected 4×3"), "{e}");
        let e = reduce_scatter(2, 5, 3, 4).unwrap_err().to_string();
        assert!(e.contains("send has 5 elements, expected 2×3"), "{e}");
        let e = in_place(Op::Broadcast, 2, 0, 2, 8, 4)
            .unwrap_err()
            .to_string();
        assert!(e.contains("root 2 out of range for 2 ranks"), "{e}");
        let e = gather(2, 1, 0, 3, Some(6), 4).unwrap_err().to_string();
        assert!(e.contains("the root (only) passes a recv buffer"), "{e}");
        let e = scatter(2, 0, 0, None, 3, 4).unwrap_err().to_string();
        assert!(e.contains("the root (only) passes a send buffer"), "{e}");
        let e = alltoallv(2, 0, 4, 3, &[1, 1], 2, &[1, 1])
            .unwrap_err()
            .to_string();
        assert!(e.contains("counts do not sum"), "{e}");
        let e = alltoallv(3, 0, 4, 2, &[1, 1], 2, &[1, 1])
            .unwrap_err()
            .to_string();
        assert!(e.contains("need 3 send and recv counts"), "{e}");
    }

    #[test]
    fn volumes_follow_the_convention() {
        // A piece of 3 f32 over 4 ranks: 3 pieces out and 3 in.
        assert_eq!(all_gather(4, 3, 12, 4).unwrap(), (36, 36));
        assert_eq!(reduce_scatter(4, 12, 3, 4).unwrap(), (36, 36));
        // The root of a gather receives the others' pieces; a leaf sends its own.
        assert_eq!(gather(4, 0, 0, 3, Some(12), 4).unwrap().vol, (0, 36));
        assert_eq!(gather(4, 2, 0, 3, None, 4).unwrap().vol, (12, 0));
        assert_eq!(scatter(4, 0, 0, Some(12), 3, 4).unwrap().vol, (36, 0));
        // The piece a rank sends itself is not counted.
        assert_eq!(
            alltoallv(3, 1, 2, 6, &[1, 2, 3], 3, &[1, 1, 1]).unwrap(),
            (8, 4)
        );
    }
}

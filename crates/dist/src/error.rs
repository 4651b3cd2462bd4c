//! Errors of the communication layer. Typed, because callers branch on them: a timeout or a dead
//! peer ends the job, a mismatch is a bug in the caller.

use std::time::Duration;

#[derive(Debug, thiserror::Error, Clone, PartialEq)]
pub enum CommError {
    /// A collective did not complete in time: some rank never arrived (stalled or died).
    #[error("{op} on group {group} timed out after {waited:?} on rank {rank}; ranks not arrived: {missing:?}")]
    Timeout {
        op: &'static str,
        group: String,
        rank: usize,
        waited: Duration,
        /// World ranks that had not joined, when the backend can tell (threads), else empty.
        missing: Vec<usize>,
    },
    /// Another rank panicked; the group is poisoned and every collective fails from now on.
    #[error("rank {rank} panicked: {message}")]
    PeerPanicked { rank: usize, message: String },
    /// Another rank finished (returned) without joining this collective.
    #[error("{op} on group {group}: rank {rank} exited without joining")]
    PeerExited {
        op: &'static str,
        group: String,
        rank: usize,
    },
    /// Ranks called different collectives, or incompatible sizes, at the same point.
    #[error("{op} on group {group}: {message}")]
    Mismatch {
        op: &'static str,
        group: String,
        message: String,
    },
    /// Bad arguments on this rank (buffer lengths, root out of range).
    #[error("{op}: {message}")]
    Invalid { op: &'static str, message: String },
    /// The buffer kind is not served by this backend (a device view on a host backend).
    #[error("{op}: {message}")]
    Unsupported { op: &'static str, message: String },
    /// Ranks were started with different configurations.
    #[error("configuration mismatch: rank {rank} has config hash {hash:016x}, rank 0 has {expected:016x}; start every rank with the same config")]
    ConfigMismatch {
        rank: usize,
        hash: u64,
        expected: u64,
    },
    /// An error reported by MPI.
    #[error("MPI: {0}")]
    Mpi(String),
    /// The communication library failed this collective (NCCL's asynchronous error, a peer's
    /// failure seen as a remote error); the communicator was aborted and the job must end.
    #[error(
        "{op} on group {group} failed on rank {rank}: {message}; the communicator was aborted"
    )]
    Aborted {
        op: &'static str,
        group: String,
        rank: usize,
        message: String,
    },
}

pub type Result<T, E = CommError> = std::result::Result<T, E>;

pub(crate) fn invalid(op: &'static str, message: impl Into<String>) -> CommError {
    CommError::Invalid {
        op,
        message: message.into(),
    }
}

//! Row-major GEMMs of the seam as column-major cuBLAS calls.
//!
//! A row-major matrix with row stride `ld` is, read column-major with the same `ld`, its
//! transpose. So the seam's `C = op(A)·op(B)` (row-major) is cuBLAS's `Cᵀ = op(B)ᵀ·op(A)ᵀ`
//! (column-major) on the same memory: swap the operands, swap `m` and `n`, keep each operand's
//! transpose flag and leading dimension. Nothing is copied or transposed in memory. These are
//! pure functions, tested in CI against the CPU backend through a column-major interpreter.

use ganymede_core::{Gemm, Syrk};

/// Which of the seam's operands a cuBLAS operand slot receives.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Operand {
    A,
    B,
}

/// One column-major `cublas*gemm` call: `C[m,n] = alpha · op(first)[m,k] · op(second)[k,n] +
/// beta · C`, where `first`/`second` are the seam's operands named by `operands`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct CublasGemm {
    /// The seam's operands passed as cuBLAS's `A` and `B`, in that order.
    pub operands: [Operand; 2],
    /// `CUBLAS_OP_T` for the first / second operand.
    pub transa: bool,
    pub transb: bool,
    pub m: i32,
    pub n: i32,
    pub k: i32,
    pub lda: i32,
    pub ldb: i32,
    pub ldc: i32,
    pub alpha: f32,
    pub beta: f32,
}

/// Why a seam GEMM has no cuBLAS equivalent: a dimension past `i32`, or a leading dimension
/// shorter than a row (the CPU backend panics on the latter too).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MapError(pub String);

impl std::fmt::Display for MapError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for MapError {}

fn int(name: &str, v: usize) -> Result<i32, MapError> {
    i32::try_from(v).map_err(|_| MapError(format!("{name} = {v} does not fit cuBLAS's int")))
}

/// Leading dimension of a row-major matrix of `cols` columns, as cuBLAS wants it: at least the
/// row length and at least 1 (cuBLAS rejects 0 even for empty matrices).
fn leading(name: &str, ld: usize, cols: usize) -> Result<i32, MapError> {
    if ld < cols {
        return Err(MapError(format!(
            "{name} = {ld} is shorter than a row of {cols} elements"
        )));
    }
    int(name, ld.max(1))
}

/// The seam's row-major [`Gemm`] as one column-major cuBLAS call on the same memory.
pub fn map_gemm(g: &Gemm) -> Result<CublasGemm, MapError> {
    let a_cols = if g.trans_a { g.m } else { g.k };
    let b_cols = if g.trans_b { g.k } else { g.n };
    Ok(CublasGemm {
        operands: [Operand::B, Operand::A],
        transa: g.trans_b,
        transb: g.trans_a,
        m: int("n", g.n)?,
        n: int("m", g.m)?,
        k: int("k", g.k)?,
        lda: leading("ldb", g.ldb, b_cols)?,
        ldb: leading("lda", g.lda, a_cols)?,
        ldc: leading("ldc", g.ldc, g.n)?,
        alpha: g.alpha,
        beta: g.beta,
    })
}

/// Element strides between the matrices of a strided batch, in the cuBLAS call's slot order.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BatchStrides {
    pub stride_a: i64,
    pub stride_b: i64,
    pub stride_c: i64,
    pub batch: i32,
}

/// A batch of equal-shaped seam GEMMs (`batch` of them, the i-th at `i · stride_*` elements
/// from each operand's start: an expert stack's matrices) as one
/// `cublas*gemmStridedBatched` call: [`map_gemm`] for the shape, the strides swapped with
/// the operands.
pub fn map_gemm_strided_batched(
    g: &Gemm,
    batch: usize,
    stride_a: usize,
    stride_b: usize,
    stride_c: usize,
) -> Result<(CublasGemm, BatchStrides), MapError> {
    let call = map_gemm(g)?;
    let long = |name: &str, v: usize| {
        i64::try_from(v).map_err(|_| MapError(format!("{name} = {v} does not fit an i64")))
    };
    Ok((
        call,
        BatchStrides {
            stride_a: long("stride_b", stride_b)?,
            stride_b: long("stride_a", stride_a)?,
            stride_c: long("stride_c", stride_c)?,
            batch: int("batch", batch)?,
        },
    ))
}

/// One column-major `cublas*syrk` call: `C[n,n] = alpha · op(A)·op(A)ᵀ + beta · C` on the
/// `upper` (else lower) triangle only; the other triangle is neither read nor written.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct CublasSyrk {
    pub upper: bool,
    /// `CUBLAS_OP_T`.
    pub trans: bool,
    pub n: i32,
    pub k: i32,
    pub lda: i32,
    pub ldc: i32,
    pub alpha: f32,
    pub beta: f32,
}

/// The seam's row-major [`Syrk`] as a column-major cuBLAS call. The row-major lower triangle
/// (the one the seam guarantees to read) is the column-major upper one; a backend then mirrors
/// it into the other triangle, as the seam asks both to hold the result.
pub fn map_syrk(s: &Syrk) -> Result<CublasSyrk, MapError> {
    let a_cols = if s.trans { s.n } else { s.k };
    Ok(CublasSyrk {
        upper: true,
        // Row-major A [n,k] reads column-major as Aᵀ [k,n]; op(A) = A needs the transpose back.
        trans: !s.trans,
        n: int("n", s.n)?,
        k: int("k", s.k)?,
        lda: leading("lda", s.lda, a_cols)?,
        ldc: leading("ldc", s.ldc, s.n)?,
        alpha: s.alpha,
        beta: s.beta,
    })
}

/// Independent seam GEMMs (the routed experts' GEMMs, one per expert, each over its own token
/// count) as one `cublasGemmGroupedBatchedEx` call: one cuBLAS group per non-empty GEMM.
#[derive(Clone, Debug, PartialEq)]
pub struct GroupedCall {
    /// Each problem's call, as [`map_gemm`] maps it.
    pub calls: Vec<CublasGemm>,
    /// Element offsets of each problem's operands in the call's slot order: cuBLAS's `A`, its
    /// `B`, and `C`.
    pub offsets: Vec<[usize; 3]>,
}

/// The seam's grouped GEMM (`(shape, a_offset, b_offset, c_offset)` per group, as
/// `NnOps::gemm_grouped` takes it) as one grouped cuBLAS call. GEMMs with no output (an expert
/// without tokens) are left out: cuBLAS needs nothing done for them.
pub fn map_gemm_grouped(groups: &[(Gemm, usize, usize, usize)]) -> Result<GroupedCall, MapError> {
    let mut out = GroupedCall {
        calls: Vec::new(),
        offsets: Vec::new(),
    };
    for &(g, ao, bo, co) in groups {
        if g.m == 0 || g.n == 0 {
            continue;
        }
        let call = map_gemm(&g)?;
        let off = |o: Operand| match o {
            Operand::A => ao,
            Operand::B => bo,
        };
        out.offsets
            .push([off(call.operands[0]), off(call.operands[1]), co]);
        out.calls.push(call);
    }
    int("groups", out.calls.len())?;
    Ok(out)
}

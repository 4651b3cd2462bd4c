//! The routed experts' grouped GEMM on the tensor cores: `gemm.cu`.

use super::*;
use ganymede_core::{ExpertGemm, Gemm, Routed};

/// `i64`s describing one group to `gemm_grouped_*` (gemm.cu's `gg_desc`).
const DESC: usize = 14;
/// Output rows and columns of one block's tile (gemm.cu's `GG_BM`, `GG_BN`).
const TILE: usize = 64;
/// Threads of one block (gemm.cu's `GG_THREADS`).
const THREADS: u32 = 128;

impl<L: Launcher> KernelOps<L> {
    /// [`ganymede_core::NnOps::gemm_grouped`] with bf16 inputs (or bf16 operands) in one
    /// launch, whatever the dtypes of A, B and C: each group's operands rounded to bf16 as they
    /// are loaded, products accumulated in f32 on the tensor cores (sm_80 on), C written in its
    /// dtype. The groups' shapes travel to the device as a small table, one upload, no wait.
    pub fn gemm_grouped_tc(
        &self,
        c: ViewMut,
        a: View,
        b: View,
        groups: &[(Gemm, usize, usize, usize)],
    ) {
        let (bf16, _) = ganymede_core::backend::grouped_casts(groups);
        assert!(
            bf16 || (a.dtype() == DType::BF16 && b.dtype() == DType::BF16),
            "gemm_grouped_tc: f32 operands without bf16 inputs (the tensor cores round them)"
        );
        let mut desc: Vec<i64> = Vec::with_capacity(groups.len() * DESC);
        let mut tiles = 0usize;
        for (i, &(g, ao, bo, co)) in groups.iter().enumerate() {
            let [la, lb, lc] = g.extents();
            assert!(
                ao + la <= a.len() && bo + lb <= b.len() && co + lc <= c.len(),
                "gemm_grouped_tc: group {i} ({g:?} at {ao}, {bo}, {co}) reaches past its views \
                 ({}, {}, {})",
                a.len(),
                b.len(),
                c.len()
            );
            let shape = [g.m, g.n, g.k, g.lda, g.ldb, g.ldc, ao, bo, co];
            desc.extend(shape.map(|x| x as i64));
            desc.extend([
                g.trans_a as i64,
                g.trans_b as i64,
                g.alpha.to_bits() as i64,
                g.beta.to_bits() as i64,
                tiles as i64,
            ]);
            if g.m > 0 && g.n > 0 {
                tiles += g.m.div_ceil(TILE) * g.n.div_ceil(TILE);
            }
        }
        if tiles == 0 {
            return;
        }
        let groups_arg = i32::try_from(groups.len()).expect("gemm_grouped_tc: groups beyond i32");
        let (_held, [table]) = self.scratch([desc.len() * 8]);
        self.put(table, &desc);
        const GROUPED: Family<8> = Family::new(&[
            &["gemm_grouped_"],
            &["f32", "bf16"],
            &["_"],
            &["f32", "bf16"],
            &["_"],
            &["f32", "bf16"],
        ]);
        let op = "gemm_grouped_tc";
        let k = GROUPED.get(&dtypes_at([&a, &b], &c, op));
        let args = [
            self.arg_mut(c),
            self.arg(a),
            self.arg(b),
            table.into(),
            groups_arg.into(),
        ];
        self.launch(k, cfg(grid(tiles, 1, 1), THREADS), &args);
    }
}

/// The dtype choices of a grouped kernel's A, B and C (f32 0, bf16 1).
fn dtypes_at(ab: [&View; 2], c: &ViewMut, op: &str) -> [usize; 3] {
    [
        dt_at(ab[0].dtype(), op),
        dt_at(ab[1].dtype(), op),
        dt_at(c.dtype(), op),
    ]
}

impl<L: Launcher> KernelOps<L> {
    /// [`ganymede_core::NnOps::gemm_experts`] with the offsets in device memory, bf16 inputs,
    /// on the tensor cores (as [`KernelOps::gemm_grouped_tc`]) in one launch, with no host
    /// read: each block finds its expert and tile from the offsets. `rows` bounds the
    /// dispatched rows (`offsets[E]`), which sizes the grid of a GEMM routed on `m`.
    pub fn gemm_experts_tc(
        &self,
        c: ViewMut,
        a: View,
        b: View,
        (offsets, rows): (View, usize),
        s: &ExpertGemm,
    ) {
        let op = "gemm_experts_tc";
        let g = s.gemm;
        assert!(
            g.bf16_inputs || (a.dtype() == DType::BF16 && b.dtype() == DType::BF16),
            "{op}: f32 operands without bf16 inputs (the tensor cores round them)"
        );
        assert_eq!(offsets.dtype(), DType::U32, "{op}: offsets are u32");
        let experts = offsets.len().checked_sub(1).expect("offsets are [E + 1]");
        // Every expert's block lies inside the views when the rows do (all of them at the
        // last expert: the largest offsets any expert's block can have).
        if experts > 0 {
            let (gm, ao, bo, co) = s.at(experts - 1, 0, rows);
            let [la, lb, lc] = gm.extents();
            assert!(
                ao + la <= a.len() && bo + lb <= b.len() && co + lc <= c.len(),
                "{op}: {rows} rows of {experts} experts ({s:?}) reach past the views ({}, {}, \
                 {})",
                a.len(),
                b.len(),
                c.len()
            );
        }
        let tiles = |x: usize| x.div_ceil(TILE);
        let (gx, gy) = match s.routed {
            Routed::M => (tiles(rows) + experts, tiles(g.n)),
            Routed::K => (experts * tiles(g.m), tiles(g.n)),
        };
        if experts == 0 || g.n == 0 || gx == 0 || (s.routed == Routed::K && g.m == 0) {
            return;
        }
        const EXPERTS: Family<8> = Family::new(&[
            &["gemm_experts_"],
            &["f32", "bf16"],
            &["_"],
            &["f32", "bf16"],
            &["_"],
            &["f32", "bf16"],
        ]);
        let k = EXPERTS.get(&dtypes_at([&a, &b], &c, op));
        let l = |x: usize| Arg::I64(x as i64);
        let args = [
            self.arg_mut(c),
            self.arg(a),
            self.arg(b),
            self.arg(offsets),
            i32_of(experts),
            Arg::I32((s.routed == Routed::K) as i32),
            l(g.m),
            l(g.n),
            l(g.k),
            l(g.lda),
            l(g.ldb),
            l(g.ldc),
            Arg::I32(g.trans_a as i32),
            Arg::I32(g.trans_b as i32),
            Arg::F32(g.alpha),
            Arg::F32(g.beta),
            l(s.a[0]),
            l(s.a[1]),
            l(s.b[0]),
            l(s.b[1]),
            l(s.c[0]),
            l(s.c[1]),
        ];
        self.launch(k, cfg(grid(gx, gy, 1), THREADS), &args);
    }
}

//! The routed experts' grouped GEMM on the tensor cores: `gemm.cu`.

use super::*;
use ganymede_core::Gemm;

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
        let at = [a, b].map(|v| dt_at(v.dtype(), op));
        let k = GROUPED.get(&[at[0], at[1], dt_at(c.dtype(), op)]);
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

//! GEMMs through cuBLAS (the row-major seam mapped by `cublas_map`), and the backend's small
//! kernels for the rest of `Blas`.

use super::memory::{place, place_mut, Place};
use super::CudaBackend;
use crate::cublas_map::{
    map_gemm, map_gemm_grouped, map_gemm_strided_batched, map_syrk, CublasGemm, Operand,
};
use cudarc::cublas::sys as blas_sys;
use ganymede_core::{Blas, CastSlot, Category, DType, Gemm, Memory, Syrk, Tensor, View, ViewMut};

/// The device arrays of pointers a grouped cuBLAS call reads (its `Aarray`, `Barray`,
/// `Carray`): one device buffer, written through the staging ring on the compute stream ahead
/// of each call. Stream order keeps a write behind the previous call's reads; the lock, held
/// from the write until the call is queued, keeps another thread's write from coming between.
/// It grows to the largest call and is then reused: after the first step, grouped GEMMs
/// allocate nothing.
#[derive(Default)]
pub struct PtrArrays {
    dev: Option<Tensor>,
}

/// The batched calls' operands: on the device, A and B of one type, C of it or f32.
fn check_operands(pa: &Place, pb: &Place, pc: &Place) {
    assert!(
        pa.on_device && pb.on_device && pc.on_device,
        "gemm on memory the device does not hold"
    );
    assert!(
        pa.dtype == pb.dtype && (pc.dtype == DType::F32 || pc.dtype == pa.dtype),
        "no CUDA gemm for {} × {} → {}",
        pa.dtype.name(),
        pb.dtype.name(),
        pc.dtype.name()
    );
}

/// A GEMM operand's data type in cuBLAS's terms.
fn cuda_type(d: DType) -> blas_sys::cudaDataType {
    match d {
        DType::BF16 => blas_sys::cudaDataType::CUDA_R_16BF,
        DType::F32 => blas_sys::cudaDataType::CUDA_R_32F,
        DType::F64 | DType::U32 => panic!("no CUDA gemm in {}", d.name()),
    }
}

impl CudaBackend {
    /// `batch` GEMMs of one shape, the i-th at element `i · stride_*` of each operand (an
    /// expert stack: experts' weights at a fixed stride, their tokens sorted into equal slots),
    /// as one `cublasGemmStridedBatchedEx` instead of `batch` launches. Dtypes as [`Blas::gemm`];
    /// f32 accumulation.
    pub fn gemm_strided_batched(
        &self,
        mut c: ViewMut,
        a: View,
        b: View,
        g: Gemm,
        batch: usize,
        strides: [usize; 3],
    ) {
        if g.m == 0 || g.n == 0 || batch == 0 {
            return;
        }
        let [sa, sb, sc] = strides;
        let [la, lb, lc] = g.extents();
        let last = batch - 1;
        assert!(a.len() >= last * sa + la, "batched gemm: A too small");
        assert!(b.len() >= last * sb + lb, "batched gemm: B too small");
        assert!(c.len() >= last * sc + lc, "batched gemm: C too small");
        assert!(sc >= lc, "batched gemm: the outputs overlap");
        let (call, st) = map_gemm_strided_batched(&g, batch, sa, sb, sc)
            .unwrap_or_else(|e| panic!("batched gemm {g:?}: {e}"));
        let (pa, pb, pc) = (place(&a), place(&b), place_mut(&mut c));
        check_operands(&pa, &pb, &pc);
        let addr = |o: Operand| match o {
            Operand::A => pa.addr,
            Operand::B => pb.addr,
        };
        let (alpha, beta) = (call.alpha, call.beta);
        self.bind();
        let _blas = self.blas_lock.lock().unwrap_or_else(|e| e.into_inner());
        // SAFETY: every matrix of the batch was checked against its view above; the handle is
        // bound to the compute stream.
        cublas(
            unsafe {
                cudarc::cublas::result::gemm_strided_batched_ex(
                    *self.blas.handle(),
                    op(call.transa),
                    op(call.transb),
                    call.m,
                    call.n,
                    call.k,
                    &alpha as *const f32 as *const _,
                    addr(call.operands[0]) as *const _,
                    cuda_type(pa.dtype),
                    call.lda,
                    st.stride_a,
                    addr(call.operands[1]) as *const _,
                    cuda_type(pb.dtype),
                    call.ldb,
                    st.stride_b,
                    &beta as *const f32 as *const _,
                    pc.addr as *mut _,
                    cuda_type(pc.dtype),
                    call.ldc,
                    st.stride_c,
                    st.batch,
                    blas_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                    blas_sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
                )
            },
            "gemmStridedBatchedEx",
        )
    }

    /// The seam's grouped GEMM (the routed experts', one GEMM per expert over its own tokens)
    /// as one `cublasGemmGroupedBatchedEx` call, instead of one launch per expert. Dtypes as
    /// [`Blas::gemm`]; f32 accumulation. Panics where cuBLAS refuses the call
    /// ([`CudaBackend::try_gemm_grouped_batched`] returns the refusal).
    pub fn gemm_grouped_batched(
        &self,
        c: ViewMut,
        a: View,
        b: View,
        groups: &[(Gemm, usize, usize, usize)],
    ) {
        cublas(
            self.try_gemm_grouped_batched(c, a, b, groups),
            "gemmGroupedBatchedEx",
        )
    }

    /// [`CudaBackend::gemm_grouped_batched`], with cuBLAS's status returned instead of a
    /// panic: its documented type combinations for this call are fewer than `GemmEx`'s (bf16
    /// operands with an f32 result may be refused), and a refused call writes nothing.
    pub fn try_gemm_grouped_batched(
        &self,
        mut c: ViewMut,
        a: View,
        b: View,
        groups: &[(Gemm, usize, usize, usize)],
    ) -> Result<(), cudarc::cublas::result::CublasError> {
        for &(g, ao, bo, co) in groups {
            let [la, lb, lc] = g.extents();
            if lc == 0 {
                continue;
            }
            assert!(a.len() >= ao + la, "grouped gemm: A too small {g:?}");
            assert!(b.len() >= bo + lb, "grouped gemm: B too small {g:?}");
            assert!(c.len() >= co + lc, "grouped gemm: C too small {g:?}");
        }
        let call = map_gemm_grouped(groups).unwrap_or_else(|e| panic!("grouped gemm: {e}"));
        let problems = call.calls.len();
        if problems == 0 {
            return Ok(());
        }
        let (pa, pb, pc) = (place(&a), place(&b), place_mut(&mut c));
        check_operands(&pa, &pb, &pc);
        let (ein, eout) = (pa.dtype.size() as u64, pc.dtype.size() as u64);
        let base = |o: Operand| match o {
            Operand::A => pa.addr,
            Operand::B => pb.addr,
        };
        // [cuBLAS A pointers | cuBLAS B pointers | C pointers].
        let mut ptrs = vec![0u64; 3 * problems];
        for (i, (cl, off)) in call.calls.iter().zip(&call.offsets).enumerate() {
            ptrs[i] = base(cl.operands[0]) + off[0] as u64 * ein;
            ptrs[problems + i] = base(cl.operands[1]) + off[1] as u64 * ein;
            ptrs[2 * problems + i] = pc.addr + off[2] as u64 * eout;
        }
        // Held until the call is queued: another thread's arrays must not replace these first.
        let (_arrays, dev) = self.pointer_arrays(&ptrs);
        let col = |f: &dyn Fn(&CublasGemm) -> i32| call.calls.iter().map(f).collect::<Vec<i32>>();
        let (m, n, k) = (col(&|x| x.m), col(&|x| x.n), col(&|x| x.k));
        let (lda, ldb, ldc) = (col(&|x| x.lda), col(&|x| x.ldb), col(&|x| x.ldc));
        let transa: Vec<_> = call.calls.iter().map(|x| op(x.transa)).collect();
        let transb: Vec<_> = call.calls.iter().map(|x| op(x.transb)).collect();
        let alpha: Vec<f32> = call.calls.iter().map(|x| x.alpha).collect();
        let beta: Vec<f32> = call.calls.iter().map(|x| x.beta).collect();
        let sizes = vec![1i32; problems];
        self.bind();
        let _blas = self.blas_lock.lock().unwrap_or_else(|e| e.into_inner());
        // SAFETY: every problem's operands were checked against their views above; the pointer
        // arrays were copied to `dev` on the compute stream, which this handle is bound to, ahead
        // of the call; the host arrays outlive the call (cuBLAS reads them before returning).
        unsafe {
            blas_sys::cublasGemmGroupedBatchedEx(
                *self.blas.handle(),
                transa.as_ptr(),
                transb.as_ptr(),
                m.as_ptr(),
                n.as_ptr(),
                k.as_ptr(),
                alpha.as_ptr() as *const _,
                dev as *const *const _,
                cuda_type(pa.dtype),
                lda.as_ptr(),
                (dev + 8 * problems as u64) as *const *const _,
                cuda_type(pb.dtype),
                ldb.as_ptr(),
                beta.as_ptr() as *const _,
                (dev + 16 * problems as u64) as *const *mut _,
                cuda_type(pc.dtype),
                ldc.as_ptr(),
                problems as i32,
                sizes.as_ptr(),
                blas_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
            )
        }
        .result()
    }

    /// `ptrs` in device memory, ordered before what the compute stream runs next: the device
    /// address of the copy (see [`PtrArrays`]), and the lock on the arrays, to be held until
    /// the call that reads them is queued.
    fn pointer_arrays(&self, ptrs: &[u64]) -> (std::sync::MutexGuard<'_, PtrArrays>, u64) {
        let mut arrays = self.grouped.lock().unwrap_or_else(|e| e.into_inner());
        let words = 2 * ptrs.len();
        if arrays.dev.as_ref().is_none_or(|t| t.len() < words) {
            // Freed in stream order: a call still reading the old arrays finishes first.
            arrays.dev = Some(self.zeros(&[words.next_power_of_two()], Category::Buffers));
        }
        let mut dv = arrays
            .dev
            .as_mut()
            .expect("pointer arrays")
            .slice_mut(0, words);
        let dev = place_mut(&mut dv);
        // SAFETY: u64s as bytes, read during the call.
        let bytes = unsafe {
            std::slice::from_raw_parts(ptrs.as_ptr() as *const u8, std::mem::size_of_val(ptrs))
        };
        assert!(
            self.stage(&dev, bytes),
            "grouped GEMM pointer arrays of {} bytes not staged",
            bytes.len()
        );
        let addr = dev.addr;
        (arrays, addr)
    }
}

fn cublas(r: Result<(), cudarc::cublas::result::CublasError>, what: &str) {
    r.unwrap_or_else(|e| panic!("cuBLAS {what}: {e}"))
}

/// What a bf16-input GEMM multiplies for `v`: `v` itself when it is bf16, else its cast in `s`.
fn operand<'a>(v: View<'a>, s: &'a CastSlot) -> View<'a> {
    if v.dtype() == DType::BF16 {
        v
    } else {
        s.view(v.len())
    }
}

fn op(t: bool) -> blas_sys::cublasOperation_t {
    if t {
        blas_sys::cublasOperation_t::CUBLAS_OP_T
    } else {
        blas_sys::cublasOperation_t::CUBLAS_OP_N
    }
}

impl CudaBackend {
    /// Run `f` on A and B as bf16 (`Gemm::bf16_inputs`): an f32 operand is cast (nearest even,
    /// the cast kernel) into a bf16 scratch of the backend's, a bf16 one passed as it is, so that
    /// cuBLAS multiplies bf16 × bf16 on tensor cores. The scratch is sized by the operand views,
    /// fixed buffers from step to step, so it grows in the first step only; it is charged to
    /// the ledger as buffers. The lock orders users on the host; the cast and the GEMM are both
    /// on the compute stream, so a later cast into the scratch runs after this GEMM read it.
    pub(crate) fn with_bf16_operands(
        &self,
        a: View,
        b: View,
        (na, nb): (usize, usize),
        unchanged: [bool; 2],
        f: impl FnOnce(View, View),
    ) {
        let mut slots = self.bf16_scratch.lock().unwrap_or_else(|e| e.into_inner());
        let [sa, sb] = &mut *slots;
        for (slot, v, n, same) in [
            (&mut *sa, a, na, unchanged[0]),
            (&mut *sb, b, nb, unchanged[1]),
        ] {
            if v.dtype() != DType::BF16 {
                self.cast_into_slot(slot, v, n, same);
            }
        }
        f(operand(a, sa), operand(b, sb))
    }

    /// [`Self::with_bf16_operands`] for one operand (a symmetric product's), cast once into the
    /// first slot; a bf16 operand is passed as it is.
    pub(crate) fn with_bf16_operand(&self, a: View, na: usize, f: impl FnOnce(View)) {
        if a.dtype() == DType::BF16 {
            return f(a);
        }
        let mut slots = self.bf16_scratch.lock().unwrap_or_else(|e| e.into_inner());
        self.cast_into_slot(&mut slots[0], a, na, false);
        f(slots[0].view(a.len()))
    }

    /// `f(a)`, with `a` cast to bf16 first when `bf16` (unless it is bf16 already).
    pub(crate) fn with_bf16_operand_if(&self, bf16: bool, a: View, f: impl FnOnce(View)) {
        if bf16 {
            self.with_bf16_operand(a, a.len(), f)
        } else {
            f(a)
        }
    }

    /// `n` values of `v` cast to bf16 into `slot` (grown to `v.len()` first if short), unless
    /// `unchanged` is promised and the slot holds them already (see `Gemm::unchanged`).
    fn cast_into_slot(&self, slot: &mut CastSlot, v: View, n: usize, unchanged: bool) {
        slot.cast_into(
            &v,
            n,
            unchanged,
            |len| self.zeros_of(&[len], DType::BF16, Category::Buffers),
            |t, n| Blas::cast(self, t.slice_mut(0, n), v.slice(0, n)),
        );
    }
}

impl Blas for CudaBackend {
    /// Tensor cores multiply bf16 at several times the f32 rate.
    fn native_bf16(&self) -> bool {
        true
    }
    /// f32 × f32 → f32 with `cublasSgemm`; bf16 × bf16 → f32 or bf16 with `cublasGemmEx`,
    /// accumulating in f32 (FSDP2's mixed precision). With `g.bf16_inputs`, f32 operands are
    /// cast to bf16 first (`with_bf16_operands`).
    fn gemm(&self, mut c: ViewMut, a: View, b: View, g: Gemm) {
        if g.m == 0 || g.n == 0 {
            return;
        }
        if g.bf16_inputs && (a.dtype() != DType::BF16 || b.dtype() != DType::BF16) {
            let [na, nb, _] = g.extents();
            return self.with_bf16_operands(a, b, (na, nb), g.unchanged, |a, b| {
                Blas::gemm(self, c, a, b, g)
            });
        }
        let [la, lb, lc] = g.extents();
        assert!(a.len() >= la, "gemm: A too small {g:?}");
        assert!(b.len() >= lb, "gemm: B too small {g:?}");
        assert!(c.len() >= lc, "gemm: C too small {g:?}");
        let call: CublasGemm = map_gemm(&g).unwrap_or_else(|e| panic!("gemm {g:?}: {e}"));
        let (pa, pb, pc) = (place(&a), place(&b), place_mut(&mut c));
        assert!(
            pa.on_device && pb.on_device && pc.on_device,
            "gemm on memory the device does not hold"
        );
        let addr = |o: Operand| match o {
            Operand::A => pa.addr,
            Operand::B => pb.addr,
        };
        let (first, second) = (addr(call.operands[0]), addr(call.operands[1]));
        let h = *self.blas.handle();
        self.bind();
        let _blas = self.blas_lock.lock().unwrap_or_else(|e| e.into_inner());
        let (alpha, beta) = (call.alpha, call.beta);
        match (pa.dtype, pb.dtype, pc.dtype) {
            (DType::F32, DType::F32, DType::F32) => cublas(
                // SAFETY: extents checked above; the handle is bound to the compute stream.
                unsafe {
                    cudarc::cublas::result::sgemm(
                        h,
                        op(call.transa),
                        op(call.transb),
                        call.m,
                        call.n,
                        call.k,
                        &alpha,
                        first as *const f32,
                        call.lda,
                        second as *const f32,
                        call.ldb,
                        &beta,
                        pc.addr as *mut f32,
                        call.ldc,
                    )
                },
                "sgemm",
            ),
            (DType::BF16, DType::BF16, out @ (DType::F32 | DType::BF16)) => {
                cublas(
                    // SAFETY: as above; alpha and beta are f32 for the f32 compute type.
                    unsafe {
                        cudarc::cublas::result::gemm_ex(
                            h,
                            op(call.transa),
                            op(call.transb),
                            call.m,
                            call.n,
                            call.k,
                            &alpha as *const f32 as *const _,
                            first as *const _,
                            cuda_type(DType::BF16),
                            call.lda,
                            second as *const _,
                            cuda_type(DType::BF16),
                            call.ldb,
                            &beta as *const f32 as *const _,
                            pc.addr as *mut _,
                            cuda_type(out),
                            call.ldc,
                            blas_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                            blas_sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
                        )
                    },
                    "gemmEx",
                )
            }
            (x, y, z) => panic!(
                "no CUDA gemm for {} × {} → {}",
                x.name(),
                y.name(),
                z.name()
            ),
        }
    }
    /// f32: `cublasSsyrk` on one triangle, then mirrored by a kernel that also adds the
    /// diagonal term (about half a GEMM's multiply-adds); bf16 inputs into f32: cuBLAS has no
    /// bf16 syrk, so a full bf16 × bf16 → f32 `cublasGemmEx` of the operand (cast once) with
    /// itself, whose lower triangle the same kernel mirrors, so that the result is exactly
    /// symmetric as the seam promises; other dtypes as a full GEMM.
    fn syrk(&self, mut c: ViewMut, a: View, s: Syrk) {
        if s.bf16_inputs && c.dtype() == DType::F32 {
            if s.n == 0 {
                return;
            }
            let [na, _] = s.extents();
            let ldc = s.ldc;
            let g = s.as_gemm();
            // Both operands the same bf16 view: the GEMM casts nothing more.
            self.with_bf16_operand(a, na, |a16| Blas::gemm(self, c.reborrow(), a16, a16, g));
            let pc = place_mut(&mut c);
            self.launch_u64(
                "ganymede_mirror_lower_f32",
                &[pc.addr, s.n as u64, ldc as u64, s.diag.to_bits() as u64],
                s.n * s.n,
            );
            return;
        }
        let (pc, pa) = (place_mut(&mut c), place(&a));
        if !(pc.dtype == DType::F32 && pa.dtype == DType::F32) {
            assert!(
                s.diag == 0.0,
                "CUDA syrk: a diagonal term on f32 only {s:?}"
            );
            return self.gemm(c, a, a, s.as_gemm());
        }
        if s.n == 0 {
            return;
        }
        let [la, lc] = s.extents();
        assert!(a.len() >= la, "syrk: A too small {s:?}");
        assert!(c.len() >= lc, "syrk: C too small {s:?}");
        assert!(
            pc.on_device && pa.on_device,
            "syrk on memory the device does not hold"
        );
        let call = map_syrk(&s).unwrap_or_else(|e| panic!("syrk {s:?}: {e}"));
        let (alpha, beta) = (call.alpha, call.beta);
        self.bind();
        let _blas = self.blas_lock.lock().unwrap_or_else(|e| e.into_inner());
        // SAFETY: extents checked above; the handle is bound to the compute stream.
        cublas(
            unsafe {
                blas_sys::cublasSsyrk_v2(
                    *self.blas.handle(),
                    if call.upper {
                        blas_sys::cublasFillMode_t::CUBLAS_FILL_MODE_UPPER
                    } else {
                        blas_sys::cublasFillMode_t::CUBLAS_FILL_MODE_LOWER
                    },
                    op(call.trans),
                    call.n,
                    call.k,
                    &alpha,
                    pa.addr as *const f32,
                    call.lda,
                    &beta,
                    pc.addr as *mut f32,
                    call.ldc,
                )
            }
            .result(),
            "ssyrk",
        );
        // The mapping's column-major upper triangle is the row-major lower one.
        debug_assert!(call.upper);
        self.launch_u64(
            "ganymede_mirror_lower_f32",
            &[pc.addr, s.n as u64, s.ldc as u64, s.diag.to_bits() as u64],
            s.n * s.n,
        );
    }
    fn axpy(&self, mut y: ViewMut, alpha: f32, x: View) {
        let (py, px) = (place_mut(&mut y), place(&x));
        assert_eq!(py.len, px.len, "axpy of different lengths");
        assert!(
            py.dtype == DType::F32 && px.dtype == DType::F32 && py.on_device && px.on_device,
            "CUDA axpy: f32 device memory only so far"
        );
        let n = i32::try_from(py.len).expect("axpy longer than cuBLAS's int");
        self.bind();
        let _blas = self.blas_lock.lock().unwrap_or_else(|e| e.into_inner());
        // SAFETY: both ranges hold n f32 on the device; the handle is on the compute stream.
        cublas(
            unsafe {
                blas_sys::cublasSaxpy_v2(
                    *self.blas.handle(),
                    n,
                    &alpha,
                    px.addr as *const f32,
                    1,
                    py.addr as *mut f32,
                    1,
                )
            }
            .result(),
            "saxpy",
        )
    }
    fn scale(&self, mut y: ViewMut, alpha: f32) {
        let py = place_mut(&mut y);
        assert!(
            py.dtype == DType::F32 && py.on_device,
            "CUDA scale: f32 device memory only so far"
        );
        let n = i32::try_from(py.len).expect("scale longer than cuBLAS's int");
        self.bind();
        let _blas = self.blas_lock.lock().unwrap_or_else(|e| e.into_inner());
        // SAFETY: as in axpy.
        cublas(
            unsafe {
                blas_sys::cublasSscal_v2(*self.blas.handle(), n, &alpha, py.addr as *mut f32, 1)
            }
            .result(),
            "sscal",
        )
    }
    fn sumsq(&self, x: View) -> f64 {
        let mut acc = self.zeros_of(&[1], DType::F64, Category::Buffers);
        self.sumsq_acc(acc.view_mut(), x);
        self.download_f64(acc.view())[0]
    }
    fn sumsq_acc(&self, mut acc: ViewMut, x: View) {
        let (pa, px) = (place_mut(&mut acc), place(&x));
        assert!(
            pa.dtype == DType::F64 && pa.len >= 1 && pa.on_device && px.on_device,
            "CUDA sumsq_acc: an f64 device accumulator and device memory"
        );
        let kernel = match px.dtype {
            DType::F32 => "ganymede_sumsq_acc_f32",
            DType::BF16 => "ganymede_sumsq_acc_bf16",
            DType::F64 | DType::U32 => panic!("no CUDA sumsq of {}", px.dtype.name()),
        };
        if px.len > 0 {
            self.launch3(kernel, [pa.addr, px.addr, px.len as u64], px.len);
        }
    }
    fn cast(&self, mut dst: ViewMut, src: View) {
        assert_eq!(dst.len(), src.len(), "cast between different lengths");
        let (pd, ps) = (place_mut(&mut dst), place(&src));
        match (ps.dtype, pd.dtype) {
            (a, b) if a == b => self.copy(dst, src),
            (DType::F32, DType::BF16) if pd.on_device && ps.on_device => self.launch3(
                "ganymede_cast_f32_to_bf16",
                [pd.addr, ps.addr, ps.len as u64],
                ps.len,
            ),
            (DType::BF16, DType::F32) if pd.on_device && ps.on_device => self.launch3(
                "ganymede_cast_bf16_to_f32",
                [pd.addr, ps.addr, ps.len as u64],
                ps.len,
            ),
            (a, b) => panic!(
                "no CUDA cast from {} to {} (device memory, f32 and bf16 only)",
                a.name(),
                b.name()
            ),
        }
    }
}

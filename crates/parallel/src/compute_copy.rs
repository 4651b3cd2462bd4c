//! The bf16 compute copy of whole parameters (world size 1 under
//! `training.compute_dtype = "bf16"`): what FSDP's gathers hand the model on more ranks, made
//! here by one cast per step instead of one per GEMM.
//!
//! The weights that only bf16-input GEMMs read ([`Model::bf16_weight`]) get a bf16 tensor each
//! (`Category::Buffers`, made once), written by the optimizer's update kernels as they update
//! the masters ([`ComputeCopy::update_with`]), or else cast from the f32 masters before the
//! first step that follows a change of them (a checkpoint load, an offloaded optimizer). For a
//! step, [`ComputeCopy::lend`] moves the f32 masters of the other parameters into the same
//! table (a swap, no copy) and moves them back when the step is done, so the optimizer always
//! sees every master in its own table.

use ganymede_core::{Backend, Category, DType, ParamStore, Tensor};
use ganymede_model::{Model, ParamSource};

pub struct ComputeCopy {
    /// Whether each parameter is read from its bf16 copy.
    bf16: Vec<bool>,
    /// The bf16 copies, and zero-length stand-ins where the masters are lent in.
    store: ParamStore,
    /// The masters changed since the copies were cast.
    stale: bool,
}

impl ComputeCopy {
    /// `None` unless some parameter is handed to the model in bf16.
    pub fn new(be: &dyn Backend, model: &Model) -> Option<Self> {
        let specs = model.param_specs();
        let bf16: Vec<bool> = (0..specs.len()).map(|i| model.bf16_weight(i)).collect();
        if !bf16.contains(&true) {
            return None;
        }
        let mut specs = specs.to_vec();
        let tensors = specs
            .iter_mut()
            .zip(&bf16)
            .map(|(s, &b)| match b {
                true => be.zeros_of(&s.shape, DType::BF16, Category::Buffers),
                false => {
                    s.shape = vec![0];
                    be.zeros(&[0], Category::Buffers)
                }
            })
            .collect();
        Some(ComputeCopy {
            bf16,
            store: ParamStore::from_tensors(specs, tensors),
            stale: true,
        })
    }

    /// The masters changed: cast them again before the next use.
    pub fn invalidate(&mut self) {
        self.stale = true;
    }

    /// An update of the masters by `step`, which gets the copies (zero-length stand-ins where a
    /// parameter has none) and returns whether it wrote each copied parameter's update there
    /// (`Optimizer::step_rounded`); if not, the copies are cast again before the next use.
    pub fn update_with(&mut self, step: impl FnOnce(&mut ParamStore) -> bool) {
        let written = step(&mut self.store);
        self.stale |= !written;
    }

    /// Cast the copies from `masters` if they are stale: what [`Self::lend`] does first, and
    /// what a step replayed as a CUDA graph (which holds no cast) does before it.
    pub fn refresh(&mut self, be: &dyn Backend, masters: &ParamStore) {
        if self.stale {
            for (i, &b) in self.bf16.iter().enumerate() {
                if b {
                    be.cast(self.store.get_mut(i).view_mut(), masters.get(i).view());
                }
            }
            self.stale = false;
        }
    }

    /// The table the model reads for one step: bf16 copies (cast first if stale) and, lent
    /// until the returned source is dropped, the other f32 masters of `masters`.
    pub fn lend<'a>(&'a mut self, be: &dyn Backend, masters: &'a mut ParamStore) -> Lent<'a> {
        self.refresh(be, masters);
        swap_unlisted(&self.bf16, &mut self.store, masters);
        Lent {
            copy: self,
            masters,
        }
    }
}

/// Swap the entries of `a` and `b` that are not bf16 copies.
fn swap_unlisted(bf16: &[bool], a: &mut ParamStore, b: &mut ParamStore) {
    for (i, &is_copy) in bf16.iter().enumerate() {
        if !is_copy {
            std::mem::swap::<Tensor>(a.get_mut(i), b.get_mut(i));
        }
    }
}

/// A step's parameter source over a [`ComputeCopy`]; gives the lent masters back when dropped.
pub struct Lent<'a> {
    copy: &'a mut ComputeCopy,
    masters: &'a mut ParamStore,
}

impl ParamSource for Lent<'_> {
    fn params(&self) -> &ParamStore {
        &self.copy.store
    }
}

impl Drop for Lent<'_> {
    fn drop(&mut self) {
        swap_unlisted(&self.copy.bf16, &mut self.copy.store, self.masters);
    }
}

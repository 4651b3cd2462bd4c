//! The one update rule of both optimizers. [`Step::update`] is one parameter's update, whether
//! the tensors are a whole parameter ([`crate::Optimizer`]) or a rank's shard of it
//! (`ganymede_parallel::optim`), and whether its state is resident or staged through a device
//! slot from host memory ([`StateView`]): AdamW's whole update, and for Muon the parameter
//! handed back ([`MuonParam`]) with its state, since Newton–Schulz needs whole matrices and each
//! optimizer brings them together its own way (scratch slots, or the FlexShard exchange). Muon's
//! two elementwise halves, Nesterov momentum before Newton–Schulz and the decayed update after,
//! are [`Step::momentum`] and [`Step::apply`].

use crate::{ParamState, UpdateRule};
use ganymede_config::OptimizerConfig;
use ganymede_core::{
    AdamWStep, AdamWTensor, Backend, Category, DType, DecayStep, DeviceRate, GradScale, Tensor,
    View, ViewMut,
};

/// One parameter's (or shard's) state as views, wherever it lives: its resident tensors
/// ([`ParamState::view_mut`]) or a device staging slot ([`StateView::staged`]).
pub enum StateView<'a> {
    Muon { momentum: ViewMut<'a> },
    AdamW { m: ViewMut<'a>, v: ViewMut<'a> },
    Frozen,
}

impl<'a> StateView<'a> {
    /// The state of a `rule` parameter staged in `slot`, its tensors one after another in
    /// [`ParamState::tensors`]'s order.
    pub fn staged(rule: &UpdateRule, slot: ViewMut<'a>) -> Self {
        match rule {
            UpdateRule::Muon { .. } => StateView::Muon { momentum: slot },
            UpdateRule::AdamW { .. } => {
                let n = slot.len() / 2;
                let (m, v) = slot.split_at(n);
                StateView::AdamW { m, v }
            }
            UpdateRule::Frozen => StateView::Frozen,
        }
    }
}

impl ParamState {
    /// Its resident tensors as views.
    pub fn view_mut(&mut self) -> StateView<'_> {
        match self {
            ParamState::Muon { momentum } => StateView::Muon {
                momentum: momentum.view_mut(),
            },
            ParamState::AdamW { m, v } => StateView::AdamW {
                m: m.view_mut(),
                v: v.view_mut(),
            },
            ParamState::Frozen => StateView::Frozen,
        }
    }
}

/// A gradient the update reads: a [`View`] of gradients the caller keeps (the single-process
/// optimizer's), or a [`ViewMut`] of a shard that becomes Muon's update in place (the sharded
/// optimizer's, so it holds no update buffer).
pub trait Grad<'a> {
    fn read(&self) -> View<'_>;
    /// Read-only for the rest of its borrow (an AdamW gradient, read by a later launch).
    fn into_read(self) -> View<'a>;
}

impl<'a> Grad<'a> for View<'a> {
    fn read(&self) -> View<'_> {
        *self
    }
    fn into_read(self) -> View<'a> {
        self
    }
}

impl<'a> Grad<'a> for ViewMut<'a> {
    fn read(&self) -> View<'_> {
        self.as_view()
    }
    fn into_read(self) -> View<'a> {
        self.into_view()
    }
}

/// A Muon parameter (or shard) whose update waits for Newton–Schulz: `count` matrices of
/// `rows × cols`, one after another in each view.
pub struct MuonParam<'a, G> {
    /// `None` where the optimizer updates the parameter later (host-resident shards are staged
    /// for [`Step::apply`] after the exchange).
    pub p: Option<ViewMut<'a>>,
    pub momentum: ViewMut<'a>,
    pub g: G,
    pub rows: usize,
    pub cols: usize,
    pub count: usize,
    pub scale: f64,
    /// The parameter's bf16 compute copy, written by the update (see `Optimizer::step_rounded`).
    pub rounded: Option<ViewMut<'a>>,
}

/// One step's constants and the update kernels they go to: its number (from 1), learning rate
/// and the gradients' factor (global-norm clipping's coefficient, or 1; on the host or the
/// device, see [`GradScale`]), which every update kernel applies as it reads a gradient.
#[derive(Clone, Copy)]
pub struct Step<'s> {
    cfg: Hyper,
    pub step: u64,
    pub lr: f64,
    pub grad_scale: GradScale<'s>,
    /// The learning rate and bias corrections also in device memory ([`RateBuffer`]).
    pub rate: Option<DeviceRate<'s>>,
    /// Newton–Schulz's products in bf16 (`optimizer.ns_dtype`, resolved for the backend).
    pub ns_bf16: bool,
}

/// One parameter for [`Step::update_all`]: its rule, state, parameter (`None` where staged
/// later), gradient and compute copy.
pub type UpdateOf<'a, 'r, G> = (
    &'r UpdateRule,
    StateView<'a>,
    Option<ViewMut<'a>>,
    G,
    Option<ViewMut<'a>>,
);

/// Where an optimizer keeps its step's [`DeviceRate`]: three f64 of device memory (buffers),
/// written by the host before each step's update, so that the update kernels' launches are the
/// same at every step, and a CUDA graph that replays the update reads each step's rate there
/// (issue 32).
pub struct RateBuffer {
    t: Tensor,
    /// A step was begun ([`Self::begin`]) and no update has used it yet.
    begun: bool,
}

impl RateBuffer {
    pub fn new(be: &dyn Backend) -> Self {
        RateBuffer {
            t: be.zeros_of(&[3], DType::F64, Category::Buffers),
            begun: false,
        }
    }
    /// Step `*step + 1`'s number into `step` and its rate (learning rate `lr`, bias corrections
    /// under `cfg`) into device memory, a write stream-ordered after the previous step's
    /// kernels that read it: ahead of the update, which may then be a graph's replay. A
    /// replay never takes the step ([`Self::for_update`]), so this overwrites an untaken one.
    pub fn begin(&mut self, be: &dyn Backend, cfg: &OptimizerConfig, step: &mut u64, lr: f64) {
        *step += 1;
        let t = *step as i32;
        let consts = AdamWStep::at_step(lr, (cfg.beta1, cfg.beta2), cfg.eps, 0.0, t);
        be.write_f64(self.t.view_mut(), &consts.rate_values());
        self.begun = true;
    }
    /// What an update's kernels read: the step begun ahead of it, or else one begun now (an
    /// update called on its own).
    pub fn for_update(
        &mut self,
        be: &dyn Backend,
        cfg: &OptimizerConfig,
        step: &mut u64,
        lr: f64,
    ) -> &Self {
        if !std::mem::take(&mut self.begun) {
            self.begin(be, cfg, step, lr);
            self.begun = false;
        }
        self
    }
    /// What [`Self::begin`] wrote, for [`Step::rate`].
    fn get(&self) -> DeviceRate<'_> {
        DeviceRate::new(self.t.view())
    }
}

/// The hyperparameters (`optimizer.*`) the kernels read, copied so that a step holds no borrow
/// of its optimizer.
#[derive(Clone, Copy)]
struct Hyper {
    beta1: f64,
    beta2: f64,
    eps: f64,
    momentum: f64,
    weight_decay: f64,
    ns_steps: crate::NsSteps,
}

impl<'s> Step<'s> {
    /// Step `step` at `lr`, whose rate [`RateBuffer::begin`] wrote into `rate` (device memory)
    /// for the kernels.
    pub fn new(
        be: &dyn Backend,
        cfg: &OptimizerConfig,
        step: u64,
        lr: f64,
        grad_scale: GradScale<'s>,
        rate: &'s RateBuffer,
    ) -> Self {
        Step {
            cfg: Hyper {
                beta1: cfg.beta1,
                beta2: cfg.beta2,
                eps: cfg.eps,
                momentum: cfg.momentum,
                weight_decay: cfg.weight_decay,
                ns_steps: crate::NsSteps::of(cfg),
            },
            step,
            lr,
            grad_scale,
            rate: Some(rate.get()),
            ns_bf16: crate::ns_bf16(cfg.ns_dtype, be),
        }
    }

    /// Newton–Schulz iterations and their quintics (`optimizer.ns_steps`,
    /// `optimizer.ns_coefficients`).
    pub fn ns_steps(&self) -> crate::NsSteps {
        self.cfg.ns_steps
    }

    /// AdamW's constants for a parameter of `weight_decay`, bias corrections included.
    pub fn adamw_consts(&self, weight_decay: f64) -> AdamWStep<'s> {
        let (cfg, t) = (self.cfg, self.step as i32);
        AdamWStep {
            grad_scale: self.grad_scale,
            rate: self.rate,
            ..AdamWStep::at_step(self.lr, (cfg.beta1, cfg.beta2), cfg.eps, weight_decay, t)
        }
    }

    /// One parameter's (or shard's) update under `rule` with its state `state`: AdamW's whole
    /// update of `p` (and of its compute copy `rounded`) here; a Muon parameter returned for
    /// its optimizer to run through [`Step::momentum`], Newton–Schulz and [`Step::apply`].
    pub fn update<'a, G: Grad<'a>>(
        &self,
        be: &dyn Backend,
        rule: &UpdateRule,
        state: StateView<'a>,
        p: Option<ViewMut<'a>>,
        g: G,
        rounded: Option<ViewMut<'a>>,
    ) -> Option<MuonParam<'a, G>> {
        match (*rule, state) {
            (UpdateRule::AdamW { weight_decay }, StateView::AdamW { m, v }) => {
                let p = p.expect("an AdamW update needs its parameter");
                let h = self.adamw_consts(weight_decay);
                be.adamw_step(p, m, v, g.read(), &h, rounded);
                None
            }
            (
                UpdateRule::Muon {
                    rows,
                    cols,
                    count,
                    scale,
                },
                StateView::Muon { momentum },
            ) => Some(MuonParam {
                p,
                momentum,
                g,
                rows,
                cols,
                count,
                scale,
                rounded,
            }),
            (UpdateRule::Frozen, StateView::Frozen) => None,
            (rule, _) => panic!("optimizer state does not match the rule {rule:?}"),
        }
    }

    /// [`Step::update`] of every parameter of `each` (rule, state, parameter, gradient, compute
    /// copy), the AdamW ones all in one [`ganymede_core::OptimOps::adamw_step_many`] (one launch
    /// on a GPU, whatever their number); the Muon ones returned.
    pub fn update_all<'a, 'r, G: Grad<'a>>(
        &self,
        be: &dyn Backend,
        each: impl IntoIterator<Item = UpdateOf<'a, 'r, G>>,
    ) -> Vec<MuonParam<'a, G>> {
        let (mut adamw, mut muon) = (Vec::new(), Vec::new());
        for (rule, state, p, g, rounded) in each {
            match (*rule, state) {
                (UpdateRule::AdamW { weight_decay }, StateView::AdamW { m, v }) => {
                    adamw.push(AdamWTensor {
                        param: p.expect("an AdamW update needs its parameter"),
                        m,
                        v,
                        grad: g.into_read(),
                        rounded,
                        weight_decay,
                    })
                }
                (_, state) => muon.extend(self.update(be, rule, state, p, g, rounded)),
            }
        }
        if !adamw.is_empty() {
            be.adamw_step_many(adamw, &self.adamw_consts(0.0));
        }
        muon
    }

    /// Muon's Nesterov momentum: `u`, holding the gradient, becomes the update Newton–Schulz
    /// orthogonalises.
    pub fn momentum(&self, be: &dyn Backend, momentum: ViewMut, u: ViewMut) {
        be.nesterov_momentum(momentum, u, self.cfg.momentum, self.grad_scale);
    }

    /// Muon's decayed update of `p` (and of its compute copy `rounded`) from the orthogonalised
    /// `u`, at `scale` ([`crate::muon_scale`]).
    pub fn apply(
        &self,
        be: &dyn Backend,
        p: ViewMut,
        u: View,
        scale: f64,
        rounded: Option<ViewMut>,
    ) {
        let h = DecayStep {
            lr: self.lr,
            scale,
            weight_decay: self.cfg.weight_decay,
            rate: self.rate,
            gate: self.grad_scale,
        };
        be.decay_update(p, u, &h, rounded);
    }
}

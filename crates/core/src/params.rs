//! Named parameter sets. The model declares its parameters as [`ParamSpec`]s (names follow the
//! Hugging Face Qwen3-MoE layout where one exists); the same specs shape the gradients, the
//! optimizer state and the checkpoints, and tell the optimizer which rule each tensor gets.

use crate::backend::Memory;
use crate::ledger::Category;
use crate::tensor::Tensor;
use serde::Serialize;
use std::collections::HashMap;

/// What a parameter is, which decides its optimizer and how it is sharded.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ParamKind {
    /// Token embedding `[V, H]` (AdamW).
    Embedding,
    /// Output projection `[V, H]` (AdamW).
    LmHead,
    /// Router `[E, H]` (AdamW, as in the write-up).
    Router,
    /// Norm gains and other vectors (AdamW).
    Vector,
    /// A dense 2-D weight `[out, in]` (Muon).
    Matrix,
    /// A stack of expert matrices `[E, out, in]`; Muon treats each `[out, in]` separately.
    Experts,
    /// State that is saved but not trained by gradients (e.g. the router's selection bias).
    Buffer,
}

impl ParamKind {
    /// Whether Muon (rather than AdamW) updates this parameter when the optimizer is Muon.
    pub fn is_muon(self) -> bool {
        matches!(self, ParamKind::Matrix | ParamKind::Experts)
    }
    pub fn is_trainable(self) -> bool {
        self != ParamKind::Buffer
    }
}

#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ParamSpec {
    pub name: String,
    pub shape: Vec<usize>,
    pub kind: ParamKind,
}

impl ParamSpec {
    pub fn new(name: impl Into<String>, shape: &[usize], kind: ParamKind) -> Self {
        Self {
            name: name.into(),
            shape: shape.to_vec(),
            kind,
        }
    }
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }
}

/// One tensor per spec, all of one ledger category (parameters, gradients, a moment, ...).
pub struct ParamStore {
    specs: Vec<ParamSpec>,
    tensors: Vec<Tensor>,
    index: HashMap<String, usize>,
}

impl ParamStore {
    /// Zero-filled tensors for every spec.
    pub fn zeros(be: &dyn Memory, specs: &[ParamSpec], category: Category) -> Self {
        let tensors = specs.iter().map(|s| be.zeros(&s.shape, category)).collect();
        Self::from_tensors(specs.to_vec(), tensors)
    }

    pub fn from_tensors(specs: Vec<ParamSpec>, tensors: Vec<Tensor>) -> Self {
        assert_eq!(specs.len(), tensors.len());
        let mut index = HashMap::new();
        for (i, s) in specs.iter().enumerate() {
            assert_eq!(s.shape, tensors[i].shape(), "shape of {}", s.name);
            assert!(
                index.insert(s.name.clone(), i).is_none(),
                "duplicate parameter {}",
                s.name
            );
        }
        Self {
            specs,
            tensors,
            index,
        }
    }

    pub fn specs(&self) -> &[ParamSpec] {
        &self.specs
    }
    pub fn len(&self) -> usize {
        self.specs.len()
    }
    pub fn is_empty(&self) -> bool {
        self.specs.is_empty()
    }
    pub fn numel(&self) -> usize {
        self.specs.iter().map(ParamSpec::numel).sum()
    }
    pub fn index_of(&self, name: &str) -> Option<usize> {
        self.index.get(name).copied()
    }
    pub fn get(&self, i: usize) -> &Tensor {
        &self.tensors[i]
    }
    pub fn get_mut(&mut self, i: usize) -> &mut Tensor {
        &mut self.tensors[i]
    }
    /// By name; panics if absent (names come from the model's own specs).
    pub fn by_name(&self, name: &str) -> &Tensor {
        let i = self
            .index_of(name)
            .unwrap_or_else(|| panic!("no parameter {name}"));
        &self.tensors[i]
    }
    pub fn by_name_mut(&mut self, name: &str) -> &mut Tensor {
        let i = self
            .index_of(name)
            .unwrap_or_else(|| panic!("no parameter {name}"));
        &mut self.tensors[i]
    }
    pub fn tensors(&self) -> &[Tensor] {
        &self.tensors
    }
    pub fn tensors_mut(&mut self) -> &mut [Tensor] {
        &mut self.tensors
    }
    pub fn iter(&self) -> impl Iterator<Item = (&ParamSpec, &Tensor)> {
        self.specs.iter().zip(&self.tensors)
    }
    pub fn iter_mut(&mut self) -> impl Iterator<Item = (&ParamSpec, &mut Tensor)> {
        self.specs.iter().zip(self.tensors.iter_mut())
    }
}

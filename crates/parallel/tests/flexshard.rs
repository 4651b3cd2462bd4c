//! FlexShard's placement policy (`ganymede_parallel::flexshard`): the plans it makes for the
//! `tiny` table and for dense matrices of many sizes, and the byte formulas of
//! `ganymede_dist::optimizer_bytes` against what the Muon exchange's collectives count under
//! those plans.

use ganymede_config::ParallelismConfig;
use ganymede_core::{ParamKind, ParamSpec, ViewMut};
use ganymede_dist::placement::{PlacementError, ShardGroup};
use ganymede_dist::{
    muon_exchange, optimizer_bytes, root_buffers, run_threads, threads, DeviceMesh, MeshShape,
    NsJob, Phase, Placement, Plan, Policy, ProcessGroup, ThreadsConfig,
};
use ganymede_parallel::flexshard::{ns_cost, ns_load, optimizer_bytes_compare, plan, ShardLayout};
use std::sync::Arc;
use std::time::Duration;

/// `f` on `n` thread ranks (a 10 s collective timeout): each rank's result, a rank's panic
/// re-raised with its message.
fn on_ranks<R: Send>(n: usize, f: impl Fn(Arc<dyn ProcessGroup>) -> R + Sync) -> Vec<R> {
    let cfg = ThreadsConfig {
        timeout: Duration::from_secs(10),
        trace: false,
    };
    let res = run_threads(n, &cfg, f).into_iter();
    res.map(|r| r.unwrap_or_else(|p| panic!("rank panicked: {}", threads::panic_message(&*p))))
        .collect()
}

/// The `tiny` preset's parameter table (as `ganymede_model::param_specs` lays it out; written
/// out here so this crate does not depend on the model).
fn tiny_specs(shared: bool) -> Vec<ParamSpec> {
    let (v, h, q, kv, hd, e, f) = (256, 64, 64, 32, 16, 8, 128);
    let mut s = vec![ParamSpec::new(
        "model.embed_tokens.weight",
        &[v, h],
        ParamKind::Embedding,
    )];
    for l in 0..2 {
        let p = format!("model.layers.{l}");
        let m = |n: &str, sh: &[usize], k| ParamSpec::new(format!("{p}.{n}"), sh, k);
        s.push(m("input_layernorm.weight", &[h], ParamKind::Vector));
        s.push(m("self_attn.q_proj.weight", &[q, h], ParamKind::Matrix));
        s.push(m("self_attn.k_proj.weight", &[kv, h], ParamKind::Matrix));
        s.push(m("self_attn.v_proj.weight", &[kv, h], ParamKind::Matrix));
        s.push(m("self_attn.o_proj.weight", &[h, q], ParamKind::Matrix));
        s.push(m("self_attn.q_norm.weight", &[hd], ParamKind::Vector));
        s.push(m("self_attn.k_norm.weight", &[hd], ParamKind::Vector));
        s.push(m(
            "post_attention_layernorm.weight",
            &[h],
            ParamKind::Vector,
        ));
        s.push(m("mlp.gate.weight", &[e, h], ParamKind::Router));
        s.push(m("mlp.experts.gate_proj", &[e, f, h], ParamKind::Experts));
        s.push(m("mlp.experts.up_proj", &[e, f, h], ParamKind::Experts));
        s.push(m("mlp.experts.down_proj", &[e, h, f], ParamKind::Experts));
        if shared {
            s.push(m(
                "mlp.shared_experts.gate_proj",
                &[1, f, h],
                ParamKind::Experts,
            ));
            s.push(m(
                "mlp.shared_experts.up_proj",
                &[1, f, h],
                ParamKind::Experts,
            ));
            s.push(m(
                "mlp.shared_experts.down_proj",
                &[1, h, f],
                ParamKind::Experts,
            ));
        }
        s.push(m("mlp.e_score_correction_bias", &[e], ParamKind::Buffer));
    }
    s.push(ParamSpec::new("model.norm.weight", &[h], ParamKind::Vector));
    s.push(ParamSpec::new("lm_head.weight", &[v, h], ParamKind::LmHead));
    s
}

#[test]
fn shard_layout_pads_evenly() {
    let l = ShardLayout::new(10, 3, 4);
    assert_eq!(l.rows_per_rank, 3);
    assert_eq!(l.shard_elems(), 9);
    assert_eq!(l.padded_elems(), 36);
    assert_eq!(l.range(0), 0..9);
    assert_eq!(l.range(3), 27..30);
    let l = ShardLayout::new(2, 5, 4);
    assert_eq!(l.range(2), 10..10);
    assert_eq!(ns_cost(32, 64), 32 * 32 * (2 * 64 + 32));
    assert_eq!(ns_cost(64, 32), ns_cost(32, 64));
}

#[test]
fn flexshard_places_tiny_as_designed() {
    let specs = tiny_specs(false);
    let p = plan(&specs, MeshShape::new(4, 1).unwrap(), Policy::FlexShard).unwrap();
    for pp in &p.params {
        match pp.kind {
            ParamKind::Experts => {
                assert_eq!(pp.placement, Placement::Expert { per_owner: 2 });
                assert_eq!(pp.shard_elems, 2 * 128 * 64);
            }
            ParamKind::Matrix => assert!(matches!(pp.placement, Placement::Owned(_))),
            _ => assert_eq!(pp.placement, Placement::Shard),
        }
    }
    // q [64,64] sharded 16 rows/rank; k [32,64] 8 rows/rank.
    let q = &p.params[2];
    assert_eq!(q.shard_elems, 16 * 64);
    // Experts are equal on every rank, so LPT spreads the 8 dense matrices: the two q and two o
    // (cost 64²·192) go to four different ranks, then the k/v (32²·160) fill the lightest.
    let load = ns_load(&p);
    let expert_load = 3 * 2 * ns_cost(128, 64) * 2;
    let dense: Vec<u64> = load.iter().map(|&l| l - expert_load).collect();
    let big = ns_cost(64, 64);
    let small = ns_cost(32, 64);
    assert_eq!(dense.iter().sum::<u64>(), 4 * big + 4 * small);
    assert!(dense.iter().all(|&d| d == big + small), "{dense:?}");

    // 8 experts over 3 ranks: 3, 3, 2 (the last rank holds one padding expert).
    let p3 = plan(&specs, MeshShape::new(3, 1).unwrap(), Policy::FlexShard).unwrap();
    assert_eq!(p3.params[10].placement, Placement::Expert { per_owner: 3 });
    // With ep = 2, each slice has 4 experts over efsdp = 2 ranks: 2 per owner.
    let p42 = plan(&specs, MeshShape::new(4, 2).unwrap(), Policy::FlexShard).unwrap();
    assert_eq!(p42.params[10].local_shape, vec![4, 128, 64]);
    assert_eq!(p42.params[10].group, ShardGroup::Efsdp);
    assert_eq!(p42.params[10].placement, Placement::Expert { per_owner: 2 });

    assert!(matches!(
        plan(&specs, MeshShape::new(3, 3).unwrap(), Policy::FlexShard),
        Err(PlacementError::ExpertsNotDivisible {
            experts: 8,
            ep: 3,
            ..
        })
    ));
}

#[test]
fn lpt_balances_within_the_largest_item() {
    // Dense matrices of many sizes, no experts: LPT's spread is at most the largest item.
    let specs: Vec<ParamSpec> = (0..23)
        .map(|i| {
            let (a, b) = (16 + (i * 37) % 200, 16 + (i * 53) % 300);
            ParamSpec::new(format!("m{i}"), &[a, b], ParamKind::Matrix)
        })
        .collect();
    for w in [2, 3, 4, 7] {
        let p = plan(&specs, MeshShape::new(w, 1).unwrap(), Policy::FlexShard).unwrap();
        let load = ns_load(&p);
        let max_item = specs
            .iter()
            .map(|s| ns_cost(s.shape[0], s.shape[1]))
            .max()
            .unwrap();
        let (lo, hi) = (*load.iter().min().unwrap(), *load.iter().max().unwrap());
        assert!(hi - lo <= max_item, "w={w}: {load:?}");
        // Graham's bound: LPT is within 4/3 of the best makespan, itself ≥ max(mean, largest).
        let total: u64 = load.iter().sum();
        let lower = max_item.max(total.div_ceil(w as u64));
        assert!(3 * hi <= 4 * lower, "w={w}: {load:?}");
        let naive = plan(&specs, MeshShape::new(w, 1).unwrap(), Policy::Naive).unwrap();
        assert_eq!(ns_load(&naive).iter().sum::<u64>(), total);
    }
}

#[test]
fn optimizer_byte_formulas_on_tiny() {
    let specs = tiny_specs(false);
    let shape = MeshShape::new(4, 1).unwrap();
    // Per matrix with shard bytes s: the gather sends 3s, the scatter 3s (all ranks together).
    let dense_shards = 2 * (16 * 64 + 8 * 64 + 8 * 64 + 16 * 64) * 4;
    // Expert stacks [8·128, 64] → 256 rows of 64 per rank; down [8·64, 128] → 128 rows of 128.
    let expert_shards = 2 * (2 * 256 * 64 + 128 * 128) * 4;
    let (naive, flex) = optimizer_bytes_compare(&specs, shape, 4).unwrap();
    assert_eq!(flex, 2 * 3 * dense_shards as u64);
    assert_eq!(naive, 2 * 3 * (dense_shards + expert_shards) as u64);
    // One rank: nothing moves.
    let (n1, f1) = optimizer_bytes_compare(&specs, MeshShape::new(1, 1).unwrap(), 4).unwrap();
    assert_eq!((n1, f1), (0, 0));
}

/// Run [`muon_exchange`] with an "orthogonalisation" of `x -> 2x + 1`; check every real element
/// was updated exactly once and padding left alone; return the counted optimizer bytes and the
/// number of matrices this rank orthogonalised.
fn run_exchange(mesh: &DeviceMesh, p: &Plan) -> ((u64, u64), usize) {
    mesh.dp_shard.ctx().stats.reset();
    let mut store: Vec<(usize, Vec<f32>, usize)> = Vec::new();
    for (i, pp) in p.params.iter().enumerate().filter(|(_, pp)| pp.is_muon()) {
        let g = match pp.group {
            ShardGroup::DpShard => &mesh.dp_shard,
            ShardGroup::Efsdp => &mesh.efsdp,
        };
        let real = match pp.placement {
            Placement::Expert { per_owner } => {
                let (e, m) = (pp.local_shape[0], pp.local_shape[1] * pp.local_shape[2]);
                let f = g.rank();
                e.min((f + 1) * per_owner).saturating_sub(f * per_owner) * m
            }
            _ => {
                let rows = pp.local_shape[0]
                    * if pp.local_shape.len() == 3 {
                        pp.local_shape[1]
                    } else {
                        1
                    };
                let numel: usize = pp.local_shape.iter().product();
                ShardLayout::new(rows, numel / rows, g.size())
                    .range(g.rank())
                    .len()
            }
        };
        let v: Vec<f32> = (0..pp.shard_elems)
            .map(|k| if k < real { (1 + k % 97) as f32 } else { -7.0 })
            .collect();
        store.push((i, v, real));
    }
    let mut matrices = 0;
    {
        let mut slices: Vec<(usize, ViewMut)> = store
            .iter_mut()
            .map(|(i, v, _)| (*i, ViewMut::Host(&mut v[..])))
            .collect();
        // Root buffers start as garbage: the exchange must not depend on their contents.
        let mut bufs: Vec<Vec<f32>> = root_buffers(p, mesh)
            .iter()
            .map(|&(_, n)| vec![f32::NAN; n])
            .collect();
        let mut roots: Vec<ViewMut> = bufs.iter_mut().map(|b| ViewMut::Host(&mut b[..])).collect();
        muon_exchange(p, mesh, &mut slices, &mut roots, &mut |job: NsJob| {
            assert_eq!(job.data.len(), job.count * job.rows * job.cols);
            matrices += job.count;
            for x in job.data.host::<f32>().iter_mut() {
                *x = 2.0 * *x + 1.0;
            }
        })
        .unwrap();
    }
    for (i, v, real) in &store {
        for (k, &x) in v.iter().enumerate() {
            let want = if k < *real {
                2.0 * (1 + k % 97) as f32 + 1.0
            } else {
                -7.0
            };
            assert_eq!(x, want, "{} element {k}", p.params[*i].name);
        }
    }
    (
        mesh.dp_shard.ctx().stats.snapshot().phase(Phase::Optimizer),
        matrices,
    )
}

#[test]
fn optimizer_byte_formulas_equal_the_counted_collectives() {
    for (dp, ep, shared) in [(4, 1, false), (3, 1, true), (4, 2, true), (2, 2, false)] {
        let specs = tiny_specs(shared);
        let shape = MeshShape::new(dp, ep).unwrap();
        for policy in [Policy::Naive, Policy::FlexShard] {
            let p = plan(&specs, shape, policy).unwrap();
            let want = optimizer_bytes(&p, 4);
            let par = ParallelismConfig {
                dp_shard: dp,
                ep,
                ..Default::default()
            };
            let res = on_ranks(dp, |pg| {
                let mesh = DeviceMesh::new(pg.clone(), &par).unwrap();
                run_exchange(&mesh, &p)
            });
            let got: Vec<(u64, u64)> = res.iter().map(|r| r.0).collect();
            assert_eq!(got, want, "dp={dp} ep={ep} {policy:?}");
            // Every matrix orthogonalised exactly once per expert-parallel slice.
            let per_slice: usize = p
                .params
                .iter()
                .filter(|pp| pp.is_muon())
                .map(|pp| match pp.group {
                    ShardGroup::Efsdp => pp.local_shape[0] * ep,
                    ShardGroup::DpShard => pp
                        .local_shape
                        .first()
                        .filter(|_| pp.local_shape.len() == 3)
                        .copied()
                        .unwrap_or(1),
                })
                .sum();
            assert_eq!(res.iter().map(|r| r.1).sum::<usize>(), per_slice);
            if policy == Policy::FlexShard && !shared {
                assert!(got.iter().all(|&(s, _)| s > 0), "dense matrices still move");
            }
        }
        let (naive, flex) = optimizer_bytes_compare(&specs, shape, 4).unwrap();
        // Experts move only in the naive plan, and only when their group has several ranks.
        if shape.efsdp() > 1 {
            assert!(flex < naive, "dp={dp} ep={ep}");
        } else {
            assert_eq!(flex, naive);
        }
    }
}

//! The write-up's numbers and hand-computed closed forms. Every expected value is derived in
//! the comment above it, not read off the planner.

use crate::cluster::Cluster;
use crate::params::{self, Handler};
use crate::plan::{ns_flops, plan, Layout, MemoryPolicy, NsOn, OptimizerSetup, Placement, Plan};
use crate::{
    fit_check, predict_cpu_ledger, predict_memory, sweep, PlanArgs, PlanError, SweepSpace,
};
use ganymede_config::{preset, AcMode, BoundaryDtype, JobConfig, OptimizerName};

const GIB: f64 = (1u64 << 30) as f64;

fn europa() -> JobConfig {
    preset("europa-1t").unwrap()
}

fn jupiter() -> Cluster {
    Cluster::preset("jupiter").unwrap()
}

/// The write-up's final setup: full AC, parameter offload, FlexShard, NS on the GPU.
fn final_setup(job: &JobConfig, offload: f64) -> (Layout, MemoryPolicy, OptimizerSetup) {
    let c = jupiter();
    let layout = Layout::from_job(job, &c);
    let policy = MemoryPolicy {
        param_offload: true,
        offload_fraction: offload,
        ..MemoryPolicy::from_job(job)
    };
    let opt = OptimizerSetup {
        placement: Placement::Flexshard,
        ns_on: NsOn::Gpu,
        ..OptimizerSetup::from_job(job)
    };
    (layout, policy, opt)
}

fn europa_plan(offload: f64) -> Plan {
    let job = europa();
    let (l, p, o) = final_setup(&job, offload);
    plan(&job, &jupiter(), &l, &p, &o).unwrap()
}

/// The GPU planner's loss chunk follows the job's `training.loss_chunk_tokens` where set (else
/// 4,096, the write-up's chunked loss): its logits, 2·C·V·4 bytes, scale with C.
#[test]
fn the_gpu_planners_loss_chunk_follows_the_job() {
    let base = europa();
    let mut half = europa();
    half.training.loss_chunk_tokens = 2048;
    assert_eq!(MemoryPolicy::from_job(&base).loss_chunk_tokens, 4096);
    assert_eq!(MemoryPolicy::from_job(&half).loss_chunk_tokens, 2048);
    let logits = |job: &JobConfig| {
        let (l, p, o) = final_setup(job, 0.73);
        plan(job, &jupiter(), &l, &p, &o).unwrap().memory.gpu.logits
    };
    let v = base.model.vocab_size as f64;
    assert_eq!(logits(&base), 2.0 * 4096.0 * v * 4.0);
    assert_eq!(logits(&half), 2.0 * 2048.0 * v * 4.0);
}

fn close(a: f64, b: f64, rel: f64) -> bool {
    ((a - b) / b).abs() <= rel
}

// ---------------------------------------------------------------- parameters

#[test]
fn tiny_parameters_by_hand() {
    // V=256, H=64, L=2, 4 heads / 2 KV heads of 16, 8 experts top-2 of hidden 128.
    // embedding 256·64 = 16,384; LM head 16,384; final norm 64.
    // per layer: q 64·64 + k 32·64 + v 32·64 + o 64·64 = 12,288; norms 2·64 + 2·16 = 160;
    // router 8·64 = 512; experts 8·3·128·64 = 196,608 → 209,568; two layers 419,136.
    // total 419,136 + 32,832 = 451,968.
    // active per layer 12,288 + 160 + 512 + 2·24,576 = 62,112 → 124,224 + 32,832 = 157,056.
    let p = params::count(&preset("tiny").unwrap().model);
    assert_eq!(p.total, 451_968);
    assert_eq!(p.active, 157_056);
    // Muon: attention + experts = 2·(12,288 + 196,608) = 417,792 in 2·(4 + 24) = 56 matrices.
    assert_eq!(p.muon, 417_792);
    assert_eq!(p.muon_matrices, 56);
    assert_eq!(p.adamw, 451_968 - 417_792);
}

#[test]
fn small_parameters_by_hand() {
    // V=4096, H=256, L=4, 8 heads / 4 KV heads of 32, 16 experts of hidden 256.
    // embedding + LM head 2·4096·256 = 2,097,152; final norm 256.
    // per layer: attention 2·256·256 + 2·128·256 = 196,608; norms 512 + 64 = 576;
    // router 16·256 = 4,096; experts 16·3·256·256 = 3,145,728 → 3,347,008; ×4 = 13,388,032.
    // total 15,485,440 (~15.5M).
    let p = params::count(&preset("small").unwrap().model);
    assert_eq!(p.total, 15_485_440);
}

#[test]
fn medium_is_the_size_issue_9_asks_for() {
    // embedding = LM head = 32,768·1,024 = 33,554,432; final norm 1,024.
    // per layer: attention 2·1024² + 2·256·1024 = 2,621,440; norms 2·1024 + 2·64 = 2,176;
    // router 64·1024 = 65,536; experts 64·3·512·1024 = 100,663,296 → 103,352,448, ×12 =
    // 1,240,229,376; total 1,307,339,264 (about 1.3B).
    // active per layer: 2,621,440 + 2,176 + 65,536 + 8·3·512·1024 = 15,272,064; ×12 =
    // 183,264,768; + 67,109,888 = 250,374,656 (about 0.25B).
    let p = params::count(&preset("medium").unwrap().model);
    assert_eq!(p.total, 1_307_339_264);
    assert_eq!(p.active, 250_374_656);
}

/// `medium` is the GPU speed comparison's job: it trains as PyTorch is run beside it (bf16 GEMM
/// operands, every activation kept), and this binary's own CUDA prediction fits one H200 that
/// way, as it would not on the 24 GiB of a smaller card.
#[test]
fn medium_runs_as_pytorch_does_and_fits_an_h200() {
    let job = preset("medium").unwrap();
    assert_eq!(
        job.training.compute_dtype,
        ganymede_config::ComputeDtype::Bf16
    );
    assert_eq!(job.activation_checkpoint.mode, AcMode::None);
    let mut cuda = job.clone();
    cuda.device.kind = ganymede_config::DeviceKind::Cuda;
    let h200 = Cluster::preset("dgx-h200").unwrap();
    let usable = h200.gpu.memory_bytes - h200.gpu.reserved_bytes;
    let fit = crate::fit::cuda_fit(&cuda, 1, 1, ("H200", usable));
    assert!(fit.fits, "{}", fit.message());
    let small_card = crate::fit::cuda_fit(&cuda, 1, 1, ("24 GiB", 24.0 * (1u64 << 30) as f64));
    assert!(!small_card.fits, "{}", small_card.message());
}

/// `large`, issue 32's showcase: its parameters by hand, 128k tokens an optimizer step in
/// microbatches of two sequences, and the trainer's own CUDA prediction fits one H200 with either
/// optimizer. An 80 GB H100 holds it with 8 of its 12 layers (the device check's variant there),
/// not whole with AdamW: fp32 weights, gradients and two moments alone are 75.7 GiB.
#[test]
fn large_fills_an_h200_and_fits_an_h100_at_eight_layers() {
    // embedding = LM head = 32,768·2,048 = 67,108,864; final norm 2,048.
    // per layer: attention 2·2048² + 2·256·2048 = 9,437,184; norms 2·2048 + 2·64 = 4,224;
    // router 64·2048 = 131,072; experts 64·3·1024·2048 = 402,653,184 → 412,225,664, ×12 =
    // 4,946,707,968; total 5,080,927,744.
    // active per layer: 9,437,184 + 4,224 + 131,072 + 8·3·1024·2048 = 59,904,128; ×12 =
    // 718,849,536; + 134,219,776 = 853,069,312.
    let job = preset("large").unwrap();
    let p = params::count(&job.model);
    assert_eq!(p.total, 5_080_927_744);
    assert_eq!(p.active, 853_069_312);
    let t = &job.training;
    assert_eq!(t.batch_size * job.model.seq_len, 131_072);
    assert_eq!((t.micro_batch(1), t.batch_size / t.micro_batch(1)), (2, 16));
    assert_eq!(t.compute_dtype, ganymede_config::ComputeDtype::Bf16);
    assert_eq!(job.activation_checkpoint.mode, AcMode::None);
    assert_eq!(job.device.kind, ganymede_config::DeviceKind::Cuda);
    let usable = |name: &str| {
        let c = Cluster::preset(name).unwrap();
        c.gpu.memory_bytes - c.gpu.reserved_bytes
    };
    let (h200, h100) = (("H200", usable("dgx-h200")), ("H100", usable("dgx-h100")));
    let with = |layers: usize, opt: OptimizerName| {
        let mut j = job.clone();
        j.model.layers = layers;
        j.optimizer.name = opt;
        j
    };
    use OptimizerName::{Adamw, Muon};
    for opt in [Adamw, Muon] {
        let fit = crate::fit::cuda_fit(&with(12, opt), 1, 1, h200);
        assert!(fit.fits, "{opt:?} on an H200: {}", fit.message());
        // Filled: more than half the H200 either way.
        assert!(
            fit.prediction.device_peak > 0.5 * h200.1,
            "{}",
            fit.message()
        );
        let fit = crate::fit::cuda_fit(&with(8, opt), 1, 1, h100);
        assert!(
            fit.fits,
            "{opt:?} at 8 layers on an H100: {}",
            fit.message()
        );
    }
    let fit = crate::fit::cuda_fit(&with(12, Adamw), 1, 1, h100);
    assert!(!fit.fits, "{}", fit.message());
    // The cluster planner agrees on the H200, one GPU.
    let c = Cluster::preset("dgx-h200").unwrap();
    let mut l = Layout::from_job(&job, &c);
    l.nodes = 1;
    l.gpus_per_node = 1;
    for opt in [Adamw, Muon] {
        let j = with(12, opt);
        let p = plan(
            &j,
            &c,
            &l,
            &MemoryPolicy::from_job(&j),
            &OptimizerSetup::from_job(&j),
        )
        .unwrap();
        assert!(p.fits, "{opt:?}: {}", p.verdict);
    }
}

#[test]
fn europa_total_and_active_parameters() {
    // embedding = LM head = 256,000·6,144 = 1,572,864,000; final norm 6,144.
    // per layer: attention 2·6144² + 2·2048·6144 = 100,663,296; norms 2·6144 + 2·128 = 12,544;
    // router 384·6144 = 2,359,296; one expert 3·1792·6144 = 33,030,144, 384 of them
    // 12,683,575,296; shared expert 33,030,144 → 12,819,640,576 per layer, ×74 =
    // 948,653,402,624; total 951,799,136,768.
    // active per layer: 100,663,296 + 12,544 + 2,359,296 + 9·33,030,144 = 400,306,432;
    // ×74 = 29,622,675,968; + 3,145,734,144 = 32,768,410,112.
    let p = params::count(&europa().model);
    assert_eq!(p.total, 951_799_136_768);
    assert_eq!(p.active, 32_768_410_112);
    // The write-up: 951.9B and 32.8B, within 0.1%.
    assert!(close(p.total as f64, 951.9e9, 1e-3));
    assert!(close(p.active as f64, 32.8e9, 1e-3));
    // total − active = 74·(384 − 8)·3·6144·1792 = 919,030,726,656 ≈ 919.0B.
    assert_eq!(p.total - p.active, 74 * 376 * 3 * 6144 * 1792);
    assert_eq!(p.total - p.active, 919_030_726_656);
    // Routed experts: 74·12,683,575,296 = 938,584,571,904, 98.61% of the total.
    assert_eq!(p.by_group.routed_experts, 938_584_571_904);
    let share = p.by_group.routed_experts as f64 / p.total as f64;
    assert!((share - 0.9861).abs() < 5e-5, "{share}");
}

#[test]
fn europa_with_a_256ki_vocabulary_gives_the_write_ups_exact_totals() {
    // Vocabulary 262,144 adds 2·6,144·6,144 = 75,497,472 to both counts:
    // 951,874,634,240 (951.9B) and 32,843,907,584 (32.8B).
    let mut m = europa().model;
    m.vocab_size = 262_144;
    let p = params::count(&m);
    assert_eq!(p.total, 951_874_634_240);
    assert_eq!(p.active, 32_843_907_584);
    assert_eq!((p.total as f64 / 1e8).round() / 10.0, 951.9);
    assert_eq!((p.active as f64 / 1e8).round() / 10.0, 32.8);
}

#[test]
fn muon_handles_every_matrix_but_router_embedding_and_lm_head() {
    for t in params::tensors(&europa().model) {
        let expect = match t.name {
            "embed_tokens" | "lm_head" | "router" => Handler::Adamw,
            _ if t.cols == 1 => Handler::Adamw,
            _ => Handler::Muon,
        };
        assert_eq!(t.handler(), expect, "{}", t.name);
    }
    // Muon: total − embedding − LM head − routers (74·2,359,296 = 174,587,904) − norms
    // (74·12,544 + 6,144 = 934,400) = 948,477,886,464, 99.65% (the write-up: "about 99.5%").
    let p = params::count(&europa().model);
    assert_eq!(p.muon, 948_477_886_464);
    assert!((p.muon_share - 0.99652).abs() < 1e-4);
    // Matrices: per layer 4 attention + 3·384 experts + 3 shared = 1,159; ×74 = 85,766.
    assert_eq!(p.muon_matrices, 85_766);
}

#[test]
fn dense_layers_are_counted_with_their_ffn() {
    // tiny with its first layer dense of hidden 96: that layer loses router (512) and experts
    // (196,608) and gains 3·96·64 = 18,432: 451,968 − 197,120 + 18,432 = 273,280.
    let mut m = preset("tiny").unwrap().model;
    m.dense_layers = 1;
    m.dense_hidden = 96;
    let p = params::count(&m);
    assert_eq!(p.total, 273_280);
    assert_eq!(p.by_group.dense_ffn, 18_432);
}

// ---------------------------------------------------------------- the write-up's numbers

#[test]
fn boundary_activations_at_65536_tokens() {
    // 74 × 65,536 × 6,144 × 2 = 59,592,671,232 bytes = 55.5 GiB.
    let p = europa_plan(1.0);
    assert_eq!(p.memory.boundary_activation_bytes, 59_592_671_232.0);
    assert!((p.memory.boundary_activation_bytes / GIB - 55.5).abs() < 0.01);
    // All 74 layers offloaded: all of it sits on the host, none on the GPU.
    assert_eq!(p.memory.offloaded_layers, 74);
    assert_eq!(p.memory.host.boundary_activations, 59_592_671_232.0);
    assert_eq!(p.memory.gpu.boundary_activations, 0.0);
}

#[test]
fn f32_boundaries_double_the_boundary_bytes_and_their_copies() {
    // The planner computes in bf16: `auto` and `bf16` keep the write-up's 2-byte boundaries;
    // `f32` doubles them (74 × 65,536 × 6,144 × 4 = 119,185,342,464 bytes, more than the
    // host's ~108 GiB per GPU) and the time of their copies.
    let job = europa();
    let at = |dtype: &str| {
        let set = format!("activation_checkpoint.boundary_dtype={dtype}");
        let job = job.with_overrides(&[set]).unwrap();
        let (l, p, o) = final_setup(&job, 1.0);
        (
            p.boundary_bytes,
            plan(&job, &jupiter(), &l, &p, &o).unwrap(),
        )
    };
    let (auto_bytes, auto) = at("auto");
    let (bf16_bytes, bf16) = at("bf16");
    let (f32_bytes, f32) = at("f32");
    assert_eq!((auto_bytes, bf16_bytes, f32_bytes), (2.0, 2.0, 4.0));
    assert_eq!(auto.memory.boundary_activation_bytes, 59_592_671_232.0);
    assert_eq!(bf16.memory, auto.memory);
    assert_eq!(f32.memory.boundary_activation_bytes, 119_185_342_464.0);
    assert_eq!(f32.memory.host.boundary_activations, 119_185_342_464.0);
    assert!(f32.memory.host.total() > jupiter().host.usable_bytes_per_gpu);
    assert!(auto.memory.host.total() <= jupiter().host.usable_bytes_per_gpu);
}

#[test]
fn tokens_per_step() {
    // 384 sequences × 65,536 = 25,165,824 tokens; 65,536 per GPU on 384 GPUs.
    let p = europa_plan(1.0);
    assert_eq!(p.tokens_per_step, 25_165_824);
    assert_eq!(p.tokens_per_gpu_per_step, 65_536);
    assert_eq!((p.layout.nodes, p.layout.gpus_per_node), (96, 4));
}

#[test]
fn muon_saves_one_fp32_state_per_muon_parameter() {
    // AdamW: 8 bytes per parameter; Muon: 4 per Muon parameter + 8 per the rest. Saving
    // 4 × 948,477,886,464 = 3,793,911,545,856 bytes ≈ 3.8 TB; / 384 ≈ 9.88 GB per GPU.
    let p = europa_plan(1.0);
    assert_eq!(p.optimizer.muon_saving_bytes, 3_793_911_545_856.0);
    assert!((p.optimizer.muon_saving_bytes / 1e12 - 3.8).abs() < 0.01);
    assert!((p.optimizer.muon_saving_per_gpu / 1e9 - 9.88).abs() < 0.01);
    assert_eq!(p.optimizer.adamw_state_bytes, 8.0 * 951_799_136_768.0);
}

#[test]
fn flexshard_optimizer_traffic_is_a_small_fraction_of_naive() {
    // Naive moves every Muon matrix; FlexShard only the dense ones: attention 100,663,296 +
    // shared 33,030,144 = 133,693,440 per layer, ×74 = 9,893,314,560; ratio
    // 9,893,314,560 / 948,477,886,464 = 1.043%.
    let p = europa_plan(1.0);
    let c = &p.communication;
    let ratio = c.optimizer_flexshard / c.optimizer_naive_muon;
    assert!((ratio - 9_893_314_560.0 / 948_477_886_464.0).abs() < 1e-12);
    assert!(ratio < 0.02);
    // Naive per GPU: gather + scatter of fp32, 2·4·948,477,886,464/384 · 383/384 ≈ 19.7 GB.
    let naive = 8.0 * 948_477_886_464.0 / 384.0 * 383.0 / 384.0;
    assert!(close(c.optimizer_naive_muon, naive, 1e-12));
    // Collectives: naive 2 per Muon matrix (171,532), FlexShard 2 per dense one (2·74·7).
    assert_eq!(c.optimizer_collectives_naive, 171_532);
    assert_eq!(c.optimizer_collectives_flexshard, 1_036);
    assert_eq!(c.optimizer_adamw, 0.0);
}

#[test]
fn flops_per_token_and_mfu_conventions() {
    // matmul: 6 × (32,768,410,112 − 1,572,864,000) = 187,173,276,672 ≈ 187 GFLOP.
    // causal attention: 6 · 65,536 · 48 · 128 · 74 = 178,778,013,696 ≈ 179 GFLOP.
    let p = europa_plan(1.0);
    let f = &p.flops;
    assert_eq!(f.matmul_per_token, 187_173_276_672.0);
    assert_eq!(f.attention_per_token, 178_778_013_696.0);
    assert_eq!(f.attention_per_token_noncausal, 2.0 * 178_778_013_696.0);
    // 1,300 tokens/s × 365.95 GFLOP = 475.7 TFLOP/s = 48.1% of 989; TorchTitan's convention
    // (attention not halved) 1,300 × 544.73 GFLOP / 989 TFLOP/s = 71.6%.
    let (mfu, tt) = f.mfu_at(1300.0, 989e12);
    assert!((mfu - 0.4810).abs() < 5e-4, "{mfu}");
    assert!((tt - 0.7160).abs() < 5e-4, "{tt}");
    // Full AC recomputes each layer's forward. Per layer the matmul parameters a token uses are
    // 400,306,432 − 12,544 norms = 400,293,888, so
    // 74 · (2 · 400,293,888 + 2 · 65,536 · 6,144) = 59,243,495,424 + 59,592,671,232.
    assert_eq!(
        f.recompute_per_token,
        74.0 * (2.0 * 400_293_888.0 + 2.0 * 65_536.0 * 6_144.0)
    );
    assert_eq!(
        f.model_per_step,
        (f.matmul_per_token + f.attention_per_token) * 25_165_824.0
    );
}

#[test]
fn document_masking_shortens_the_attention_span() {
    // 65,536-token windows of 2,048-token documents: each token attends 1,024 keys on average
    // instead of 32,768, so attention's FLOPs (forward, backward and the recompute's) are 1/32
    // of the causal window's; TorchTitan's convention does not mask. Documents longer than the
    // window change nothing.
    let base = europa_plan(1.0);
    let masked = |mean: usize| {
        let mut job = europa();
        job.data.document_mask = true;
        job.data.mean_document_tokens = mean;
        let (l, p, o) = final_setup(&job, 1.0);
        plan(&job, &jupiter(), &l, &p, &o).unwrap()
    };
    let p = masked(2048);
    let (f, b) = (&p.flops, &base.flops);
    assert_eq!(b.attention_span_per_token, 32_768.0);
    assert_eq!(f.attention_span_per_token, 1_024.0);
    assert_eq!(f.attention_per_token, b.attention_per_token / 32.0);
    assert_eq!(
        f.attention_per_token_noncausal,
        b.attention_per_token_noncausal
    );
    assert_eq!(f.matmul_per_token, b.matmul_per_token);
    // The recompute is one forward: a third of forward + backward.
    let attn_recompute = |f: &crate::plan::Flops| f.attention_per_token / 3.0;
    assert_eq!(
        b.recompute_per_token - f.recompute_per_token,
        attn_recompute(b) - attn_recompute(f)
    );
    assert!(p.time.step_s < base.time.step_s);
    assert_eq!(masked(100_000).flops, base.flops);
    let t = crate::render::table(&p);
    assert!(
        t.contains("attention span per token") && t.contains("1024 keys"),
        "{t}"
    );
}

#[test]
fn newton_schulz_flops_closed_form() {
    // 1792×6144, five steps: 5·(4·1792²·6144 + 2·1792³) = 5·(78,920,024,064 + 11,509,170,176)
    // = 452,145,971,200. Orientation does not matter.
    assert_eq!(ns_flops(1792, 6144, 5), 452_145_971_200.0);
    assert_eq!(ns_flops(6144, 1792, 5), 452_145_971_200.0);
}

// ---------------------------------------------------------------- memory

#[test]
fn state_shards_move_to_the_host_with_parameter_offload() {
    // 951,799,136,768 / 384 = 2,478,643,585.33 parameters per GPU; fp32 master and gradient
    // shards 4 bytes each; Muon state 4·948,477,886,464/384 + AdamW 8·3,321,250,304/384.
    let shard = 951_799_136_768.0 / 384.0;
    let state = (4.0 * 948_477_886_464.0 + 8.0 * 3_321_250_304.0) / 384.0;
    let on = europa_plan(1.0);
    assert!(close(on.memory.host.master_params, 4.0 * shard, 1e-12));
    assert!(close(on.memory.host.grads, 4.0 * shard, 1e-12));
    assert!(close(on.memory.host.optimizer_states, state, 1e-12));
    assert_eq!(on.memory.gpu.master_params, 0.0);
    let job = europa();
    let (l, mut pol, o) = final_setup(&job, 1.0);
    pol.param_offload = false;
    let off = plan(&job, &jupiter(), &l, &pol, &o).unwrap();
    assert!(close(off.memory.gpu.optimizer_states, state, 1e-12));
    assert_eq!(off.memory.host.optimizer_states, 0.0);
}

#[test]
fn unsharded_buffers_per_layer() {
    // With EP 4 a rank gathers the layer's dense part, 100,663,296 + 12,544 + 2,359,296 +
    // 33,030,144 = 136,065,280, and its 96 local experts, 96·33,030,144 = 3,170,893,824:
    // 3,306,959,104 parameters. bf16 × (1 + prefetch 1) layers + the LM head (1,572,864,000):
    // 2·(2·3,306,959,104 + 1,572,864,000) = 16,373,564,416 bytes.
    // Gradients of one layer: bf16 + fp32 = 6 bytes each: 19,841,754,624.
    let p = europa_plan(1.0);
    assert_eq!(p.memory.gpu.unsharded_params, 16_373_564_416.0);
    assert_eq!(p.memory.gpu.unsharded_grads, 19_841_754_624.0);
    // Without unshard_async_op one more set of layer buffers: 2·2·3,306,959,104 bytes
    // = 12.3 GiB (the write-up: it "frees ~14 GiB").
    let job = europa();
    let (l, mut pol, o) = final_setup(&job, 1.0);
    pol.unshard_async_op = false;
    let q = plan(&job, &jupiter(), &l, &pol, &o).unwrap();
    assert_eq!(q.memory.gpu.allocator_slack, 4.0 * 3_306_959_104.0);
    assert!(close(
        q.memory.gpu_total - p.memory.gpu_total,
        4.0 * 3_306_959_104.0,
        1e-12
    ));
}

#[test]
fn smallest_offload_fraction_is_tight() {
    let job = europa();
    let p = europa_plan(0.0);
    let f = p.memory.min_offload_fraction.expect("some fraction fits");
    assert!(f > 0.0 && f <= 1.0);
    let at = |x: f64| {
        let (l, pol, o) = final_setup(&job, x);
        plan(&job, &jupiter(), &l, &pol, &o).unwrap()
    };
    assert!(at(f).fits);
    // One layer fewer offloaded does not fit.
    assert!(!at(f - 1.0 / 74.0).fits);
    // Each offloaded layer moves 65,536·6,144·2 bytes from GPU to host.
    let (a, b) = (at(0.5), at(1.0));
    let moved = (74 - 37) as f64 * 65_536.0 * 6_144.0 * 2.0;
    assert!(close(a.memory.gpu_total - b.memory.gpu_total, moved, 1e-12));
    assert!(close(
        b.memory.host_total - a.memory.host_total,
        moved,
        1e-12
    ));
}

#[test]
fn no_checkpointing_at_65536_does_not_fit_on_jupiter() {
    let job = europa();
    let (l, mut pol, o) = final_setup(&job, 0.0);
    pol.ac = AcMode::None;
    let p = plan(&job, &jupiter(), &l, &pol, &o).unwrap();
    assert!(!p.fits);
    assert!(p.verdict.starts_with("does not fit"));
    assert!(p.memory.min_offload_fraction.is_none());
}

#[test]
fn without_parameter_offload_the_verdict_points_to_it() {
    // fp32 master, gradient and Muon shards (3 × ~9.9 GB) on the GPU leave no room at 65,536.
    let job = europa();
    let (l, mut pol, o) = final_setup(&job, 0.0);
    pol.param_offload = false;
    let p = plan(&job, &jupiter(), &l, &pol, &o).unwrap();
    assert!(!p.fits);
    assert!(p.memory.min_offload_fraction.is_none());
    assert!(
        p.verdict
            .contains("smallest change that fits: --param-offload --offload-fraction 0.730 ("),
        "{}",
        p.verdict
    );
}

#[test]
fn adamw_needs_twice_the_state() {
    let job = europa();
    let (l, pol, mut o) = final_setup(&job, 1.0);
    o.name = OptimizerName::Adamw;
    let p = plan(&job, &jupiter(), &l, &pol, &o).unwrap();
    assert_eq!(p.optimizer.state_bytes, 8.0 * 951_799_136_768.0);
    assert_eq!(p.communication.optimizer, 0.0);
    assert_eq!(p.time.newton_schulz_s, 0.0);
    let m = europa_plan(1.0);
    assert!(close(
        p.memory.host_total - m.memory.host_total,
        m.optimizer.muon_saving_per_gpu,
        1e-9
    ));
}

// ---------------------------------------------------------------- communication and time

#[test]
fn fsdp_traffic_closed_form() {
    // Experts: each GPU gathers its 96 local experts (3,170,893,824 params, bf16) over the 96
    // ranks holding the same expert slice, one per node: it brings 95/96 of them in through its
    // own adapter. Dense part (136,065,280 params) over all 384 ranks, 4 per node: the node
    // needs 95/96 of it once, a quarter per adapter.
    let e = 2.0 * 3_170_893_824.0;
    let d = 2.0 * 136_065_280.0;
    let ib_layer = e * 95.0 / 96.0 + d * 95.0 / 96.0 / 4.0;
    let nv_layer = d * 3.0 / 4.0;
    // Outside the layers (embedding, LM head, final norm: 3,145,734,144) like the dense part.
    let o = 2.0 * 3_145_734_144.0;
    let ag = 74.0 * (ib_layer + nv_layer) + o * 95.0 / 96.0 / 4.0 + o * 3.0 / 4.0;
    let p = europa_plan(1.0);
    assert!(close(p.communication.fsdp_all_gather_fwd, ag, 1e-12));
    assert!(close(p.communication.fsdp_all_gather_bwd, ag, 1e-12));
    // Keeping the last block unsharded from forward spares its backward gather.
    let job = europa();
    let (l, mut pol, o) = final_setup(&job, 1.0);
    pol.keep_last_block = true;
    let kept = plan(&job, &jupiter(), &l, &pol, &o).unwrap();
    let ag_bwd = ag - (ib_layer + nv_layer);
    assert!(close(kept.communication.fsdp_all_gather_bwd, ag_bwd, 1e-12));
    // The fp32 reduce-scatter moves twice the bytes.
    assert!(close(p.communication.fsdp_reduce_scatter, 2.0 * ag, 1e-12));
    // The expert all-to-all stays on NVLink: per layer 6 transfers (dispatch and combine in
    // forward, recompute and backward) of 65,536·8·6,144·2 · 3/4 bytes.
    assert!(p.communication.ep_on_nvlink);
    let a2a = 74.0 * 6.0 * 65_536.0 * 8.0 * 6_144.0 * 2.0 * 0.75;
    assert!(close(p.communication.ep_all_to_all, a2a, 1e-12));
}

#[test]
fn ep_across_nodes_puts_the_all_to_all_on_infiniband() {
    let job = europa();
    let (mut l, pol, o) = final_setup(&job, 1.0);
    l.ep = 8;
    let p = plan(&job, &jupiter(), &l, &pol, &o).unwrap();
    assert!(!p.communication.ep_on_nvlink);
    assert!(p.communication.ib_bytes > europa_plan(1.0).communication.ib_bytes);
}

#[test]
fn single_gpu_step_is_compute_plus_optimizer() {
    // tiny on one CPU "GPU": no communication; forward = L · c_fwd with
    // c_fwd = 2·N·(matmul params per layer)/gemm + 2·N·s·q_dim/attention; backward = 3·c_fwd
    // per layer (full AC) + the LM head's 6·V·H·N/gemm.
    // (`local` without its calibrated [cpu] section: the rate model every GPU cluster uses.)
    let job = preset("tiny").unwrap();
    let mut c = Cluster::preset("local").unwrap();
    c.cpu = None;
    let mut l = Layout::from_job(&job, &c);
    // The job's layout is what the trainer runs, the batch in one pass; the times below are
    // for 8 microbatches of one sequence (every term is linear in tokens, so the same).
    assert_eq!(
        (l.nodes, l.gpus_per_node, l.dp_shard, l.microbatches()),
        (1, 1, 1, 1)
    );
    l.micro_batch = 1;
    assert_eq!(l.microbatches(), 8);
    let pol = MemoryPolicy::from_job(&job);
    let o = OptimizerSetup::from_job(&job);
    let p = plan(&job, &c, &l, &pol, &o).unwrap();
    assert_eq!(p.communication.ib_bytes + p.communication.nvlink_bytes, 0.0);
    let gemm = 1.92e11 * 0.7;
    let attn = 1.92e11 * 0.3;
    let n = 128.0;
    // per layer: attention 12,288 + router 512 + 2 experts of 24,576 = 61,952.
    let c_fwd = 2.0 * n * 61_952.0 / gemm + 2.0 * n * 128.0 * 64.0 / attn;
    let head = 6.0 * 256.0 * 64.0 * n / gemm;
    assert!(close(p.time.forward_s, 8.0 * 2.0 * c_fwd, 1e-12));
    assert!(close(
        p.time.backward_s,
        8.0 * (2.0 * 3.0 * c_fwd + head),
        1e-12
    ));
    assert!(close(
        p.step_time_s,
        p.time.forward_s + p.time.backward_s + p.time.optimizer_s,
        1e-12
    ));
    assert!(close(p.tokens_per_s_per_gpu, 1024.0 / p.step_time_s, 1e-9));
}

#[test]
fn newton_schulz_on_the_cpu_is_slower_than_on_the_gpu() {
    let job = europa();
    let (l, pol, mut o) = final_setup(&job, 1.0);
    let gpu = plan(&job, &jupiter(), &l, &pol, &o).unwrap();
    o.ns_on = NsOn::Cpu;
    let cpu = plan(&job, &jupiter(), &l, &pol, &o).unwrap();
    // Same FLOPs, rates 989e12·0.8 vs 6.9e12·0.5: ratio 229.3.
    let ratio = cpu.time.newton_schulz_s / gpu.time.newton_schulz_s;
    assert!(close(ratio, 989e12 * 0.8 / (6.9e12 * 0.5), 1e-9));
    assert!(cpu.tokens_per_s_per_gpu < gpu.tokens_per_s_per_gpu);
}

#[test]
fn newton_schulz_in_f32_on_the_gpu_runs_at_the_f32_peak() {
    let mut job = europa();
    let (l, pol, o) = final_setup(&job, 1.0);
    let auto = plan(&job, &jupiter(), &l, &pol, &o).unwrap();
    job.optimizer.ns_dtype = ganymede_config::NsDtype::Bf16;
    let bf16 = plan(&job, &jupiter(), &l, &pol, &o).unwrap();
    job.optimizer.ns_dtype = ganymede_config::NsDtype::F32;
    let f32 = plan(&job, &jupiter(), &l, &pol, &o).unwrap();
    assert_eq!(auto.time.newton_schulz_s, bf16.time.newton_schulz_s);
    // Same FLOPs, rates 989e12·0.8 vs 67e12·0.8: ratio 14.76.
    let ratio = f32.time.newton_schulz_s / bf16.time.newton_schulz_s;
    assert!(close(ratio, 989.0 / 67.0, 1e-9), "{ratio}");
    // A cluster without the key: the f32 rate is `peak_flops`'s.
    let mut c = jupiter();
    c.gpu.peak_f32_flops = None;
    let same = plan(&job, &c, &l, &pol, &o).unwrap();
    assert!(close(
        same.time.newton_schulz_s,
        bf16.time.newton_schulz_s,
        1e-12
    ));
}

// ---------------------------------------------------------------- errors

fn err(f: impl FnOnce(&mut Layout)) -> PlanError {
    let job = europa();
    let (mut l, pol, o) = final_setup(&job, 1.0);
    f(&mut l);
    plan(&job, &jupiter(), &l, &pol, &o).unwrap_err()
}

#[test]
fn impossible_layouts_are_named() {
    assert!(matches!(
        err(|l| l.ep = 5),
        PlanError::EpExperts {
            ep: 5,
            experts: 384
        }
    ));
    assert!(matches!(err(|l| l.nodes = 95), PlanError::GpuCount { .. }));
    assert!(matches!(err(|l| l.ep = 3), PlanError::EpNode { .. }));
    assert!(matches!(
        err(|l| l.global_batch = 100),
        PlanError::Batch { .. }
    ));
    let e = err(|l| l.seq_len = 1 << 20);
    assert!(matches!(e, PlanError::SequenceTooLong { .. }), "{e}");
    assert!(e.to_string().contains("1048576"));
    let m = err(|l| l.nodes = 95).to_string();
    assert!(m.contains("384") && m.contains("95"), "{m}");
}

// ---------------------------------------------------------------- clusters

#[test]
fn cluster_presets_load_and_round_trip() {
    for name in crate::CLUSTERS {
        let c = Cluster::preset(name).unwrap();
        let back = Cluster::from_toml_str(&c.to_toml(), "round trip").unwrap();
        assert_eq!(c, back);
    }
    let j = jupiter();
    assert_eq!(j.gpus(), 384);
    assert_eq!(j.host.usable_bytes_per_gpu, 108.0 * GIB);
    assert_eq!(
        (j.links.d2h_bytes_per_s, j.links.h2d_bytes_per_s),
        (170e9, 415e9)
    );
}

#[test]
fn cluster_file_errors_name_file_and_key() {
    let dir = std::env::temp_dir().join(format!("ganymede-plan-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("bad.toml");
    let text = jupiter()
        .to_toml()
        .replace("memory_bytes =", "memroy_bytes =");
    std::fs::write(&path, text).unwrap();
    let e = Cluster::resolve(path.to_str().unwrap())
        .unwrap_err()
        .to_string();
    assert!(e.contains("bad.toml") && e.contains("memroy_bytes"), "{e}");
    let text = jupiter()
        .to_toml()
        .replace("ib_efficiency = 0.9", "ib_efficiency = 1.5");
    std::fs::write(&path, text).unwrap();
    let e = Cluster::resolve(path.to_str().unwrap())
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("links.ib_efficiency") && e.contains("bad.toml"),
        "{e}"
    );
    let e = Cluster::resolve("summit").unwrap_err().to_string();
    assert!(e.contains("jupiter"), "{e}");
    std::fs::remove_dir_all(&dir).ok();
}

// ---------------------------------------------------------------- CLI, JSON, sweep

#[test]
fn json_has_the_keys_the_issue_asks_for() {
    let args = PlanArgs::parse_flags(&[
        "--preset",
        "europa-1t",
        "--cluster",
        "jupiter",
        "--param-offload",
        "--offload-fraction",
        "1",
        "--json",
    ])
    .unwrap();
    let out = crate::cli::output(&args).unwrap();
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    for key in [
        "/params/total",
        "/params/active",
        "/tokens_per_step",
        "/memory/gpu/optimizer_states",
        "/memory/host/boundary_activations",
        "/memory/boundary_activation_bytes",
        "/optimizer/state_bytes",
        "/communication/fsdp_all_gather_fwd",
        "/communication/fsdp_reduce_scatter",
        "/communication/ep_all_to_all",
        "/communication/optimizer_naive_muon",
        "/communication/optimizer_flexshard",
        "/step_time_s",
        "/tokens_per_s_per_gpu",
        "/mfu",
        "/fits",
    ] {
        assert!(v.pointer(key).is_some(), "missing {key}");
    }
    assert_eq!(v["params"]["total"], 951_799_136_768u64);
    assert_eq!(v["tokens_per_step"], 25_165_824);
    assert_eq!(v["fits"], true);
}

#[test]
fn flags_override_the_job_config() {
    let args = PlanArgs::parse_flags(&[
        "--preset",
        "europa-1t",
        "--cluster",
        "jupiter",
        "--nodes",
        "48",
        "--seq-len",
        "32768",
        "--global-batch",
        "192",
        "--ep",
        "2",
        "--ac",
        "none",
        "--optimizer",
        "adamw",
        "--placement",
        "naive",
        "--ns-on",
        "cpu",
        "--set",
        "model.vocab_size=262144",
    ])
    .unwrap();
    let r = args.resolve().unwrap();
    assert_eq!(
        (r.layout.nodes, r.layout.gpus_per_node, r.layout.dp_shard),
        (48, 4, 192)
    );
    assert_eq!(
        (r.layout.ep, r.layout.seq_len, r.layout.global_batch),
        (2, 32768, 192)
    );
    assert_eq!(r.policy.ac, AcMode::None);
    assert_eq!(r.optimizer.name, OptimizerName::Adamw);
    assert_eq!(r.optimizer.placement, Placement::Naive);
    assert_eq!(r.optimizer.ns_on, NsOn::Cpu);
    assert_eq!(r.job.model.vocab_size, 262_144);
    // A dp_shard that disagrees with the GPU count is an error naming both.
    let bad = PlanArgs::parse_flags(&[
        "--preset",
        "europa-1t",
        "--cluster",
        "jupiter",
        "--nodes",
        "10",
        "--dp-shard",
        "384",
    ])
    .unwrap();
    let e = bad.plan().unwrap_err().to_string();
    assert!(e.contains("dp_shard = 384") && e.contains("40"), "{e}");
}

#[test]
fn table_shows_the_headline_numbers() {
    let t = crate::render::table(&europa_plan(1.0));
    for s in [
        "951.80B",
        "32.77B",
        "55.50 GiB",
        "25165824",
        "verdict: fits",
    ] {
        assert!(t.contains(s), "missing {s} in\n{t}");
    }
}

#[test]
fn sweep_ranks_fitting_layouts_by_throughput() {
    let job = europa();
    let (l, pol, o) = final_setup(&job, 1.0);
    let space = SweepSpace::around(&job, &l);
    // EP degrees that divide 384 experts and 384 ranks and tile 4-GPU nodes: 1, 2, 4, 8, ...
    assert_eq!(&space.ep[..4], &[1, 2, 4, 8]);
    let entries = sweep(&job, &jupiter(), &l, &pol, &o, &space);
    assert!(!entries.is_empty());
    assert!(entries.iter().all(|e| e.plan.fits));
    assert!(entries
        .windows(2)
        .all(|w| w[0].tokens_per_s_per_gpu >= w[1].tokens_per_s_per_gpu));
    // Nothing without checkpointing fits at this scale.
    assert!(entries.iter().all(|e| e.ac == AcMode::Full));
    // The fastest is the write-up's own layout: EP 4 inside the node, 65,536 tokens, parameter
    // offload, at the smallest offload fraction that fits (54 of 74 layers).
    let best = &entries[0];
    assert_eq!(
        (best.ep, best.seq_len, best.param_offload),
        (4, 65_536, true)
    );
    assert!((best.offload_fraction - 54.0 / 74.0).abs() < 1e-9);
    let json = crate::cli::output(
        &PlanArgs::parse_flags(&["--preset", "tiny", "--sweep", "--json"]).unwrap(),
    )
    .unwrap();
    let v: serde_json::Value = serde_json::from_str(&json).unwrap();
    assert!(v.as_array().is_some_and(|a| !a.is_empty()));
}

// ---------------------------------------------------------------- the CPU ledger

#[test]
fn cpu_ledger_params_grads_optimizer_exact() {
    // tiny: 451,968 parameters, 417,792 of them Muon's: params and grads 4 bytes each;
    // optimizer 4·417,792 + 8·34,176 = 1,944,576 bytes (Muon), 8·451,968 (AdamW).
    let mut job = preset("tiny").unwrap();
    let l = predict_cpu_ledger(&job, 1);
    assert_eq!(l.params, 4.0 * 451_968.0);
    assert_eq!(l.grads, 4.0 * 451_968.0);
    assert_eq!(l.optimizer, 1_944_576.0);
    job.optimizer.name = OptimizerName::Adamw;
    let a = predict_cpu_ledger(&job, 1);
    assert_eq!(a.optimizer, 8.0 * 451_968.0);
    // AdamW has no scratch: only the step's six f64 scalars (loss, norm, scale, and the
    // optimizer's rate: lr and two bias corrections), its routing ones (8·8·4) and the
    // driver's copy of the microbatch's loss and routing figures (8·33), and the place its
    // pass writes them first (8·33).
    assert_eq!(a.buffers, 48.0 + 256.0 + 2.0 * 264.0);
    // The DeepSeek selection bias adds [8] per MoE layer to params and grads, not to state.
    job.model.router_bias_update = 0.001;
    let b = predict_cpu_ledger(&job, 1);
    assert_eq!(b.params, 4.0 * (451_968.0 + 16.0));
    assert_eq!(b.optimizer, a.optimizer);
}

#[test]
fn cpu_ledger_activations_by_checkpointing_mode() {
    // tiny, batch 8 × 128 tokens: N = 1,024; H = Q = 64, K = 32, 4/2 heads, E = 8, k = 2,
    // F = 128, V = 256, no every-token SwiGLU (W = 0).
    // boundaries 4·N·3·64 = 786,432.
    // one set: attention 3·64 + 3·64 + 3·32 + 2·4 + 2 + 2 = 492, MoE 8 + 2 + 2·2·64 + 3·2·128
    // = 1,034, routing indices 3·2 = 6 → 1,532 per token → 4·N·1,532 = 6,275,072, plus the
    // counts and offsets 4·(2·8 + 1) = 68: 6,275,140 (two sets under none).
    // gradient scratch 2·64 + 2·64 + 3·32 + 1,034 = 1,386 → 5,677,056 (q's gradient in the
    // output gradient's buffer).
    // head 4·N·(64 + 256 + 7) + 4 = 1,339,396 (ids, targets and the ids' grouping).
    let mut job = preset("tiny").unwrap();
    job.activation_checkpoint.mode = AcMode::Full;
    let full = predict_cpu_ledger(&job, 1);
    let t = &full.activation_terms;
    assert_eq!(t.boundaries, 786_432.0);
    assert_eq!(t.layer_sets, 6_275_140.0);
    assert_eq!(t.grad_scratch, 5_677_056.0);
    assert_eq!(t.head, 1_339_396.0);
    assert_eq!(full.activations, 14_078_024.0);
    job.activation_checkpoint.mode = AcMode::None;
    let none = predict_cpu_ledger(&job, 1);
    assert_eq!(none.activations - full.activations, 6_275_140.0);
    // bf16 compute (f32 boundaries): each set's v, q and k after RoPE, and attention output
    // in bf16, 2·N·(2·64 + 2·32) = 393,216 bytes less; the scratch's four bf16 attention
    // gradients as much more. And the bf16 rows and GEMM outputs: each set's dispatched
    // inputs, gate, up, SwiGLU products and expert outputs, 2·N·2·(2·64 + 3·128) = 2,097,152
    // less, and the scratch's expert output, SwiGLU product, gate and up gradients,
    // 2·N·2·(64 + 3·128) = 1,835,008 less; and the head's logits, 2·N·256 = 524,288 less.
    job.training.compute_dtype = ganymede_config::ComputeDtype::Bf16;
    job.activation_checkpoint.boundary_dtype = BoundaryDtype::F32;
    let b = predict_cpu_ledger(&job, 1);
    let (tb, tn) = (&b.activation_terms, &none.activation_terms);
    assert_eq!(
        tn.layer_sets - tb.layer_sets,
        2.0 * (393_216.0 + 2_097_152.0)
    );
    assert_eq!(tn.grad_scratch - tb.grad_scratch, 1_835_008.0 - 393_216.0);
    assert_eq!(tb.boundaries, tn.boundaries);
    assert_eq!(tn.head - tb.head, 524_288.0);
    assert_eq!(
        none.activations - b.activations,
        393_216.0 + 2.0 * 2_097_152.0 + 1_835_008.0 + 524_288.0
    );
    // bf16 boundaries (`auto` under bf16 compute): 2·N·3·64 = 393,216 plus the f32 working
    // copy 4·N·64 = 262,144, 131,072 less than f32's 786,432.
    job.activation_checkpoint.boundary_dtype = BoundaryDtype::Auto;
    let b16 = predict_cpu_ledger(&job, 1);
    assert_eq!(b16.activation_terms.boundaries, 655_360.0);
    assert_eq!(b.activations - b16.activations, 131_072.0);
    job.activation_checkpoint.mode = AcMode::Full;
    // Under full checkpointing (one set) attention's bf16 tensors save what their gradients
    // add; the boundaries, the rows (one set's and the scratch's) and the logits save the rest.
    let full16 = predict_cpu_ledger(&job, 1).activations;
    assert_eq!(
        full16,
        full.activations - 131_072.0 - 2_097_152.0 - 1_835_008.0 - 524_288.0
    );
    // bf16 boundaries at f32 compute too, when asked (the rows stay f32).
    job.training.compute_dtype = ganymede_config::ComputeDtype::F32;
    job.activation_checkpoint.boundary_dtype = BoundaryDtype::Bf16;
    assert_eq!(
        predict_cpu_ledger(&job, 1).activations,
        full.activations - 131_072.0
    );
}

#[test]
fn cpu_ledger_muon_scratch() {
    // tiny's Muon matrices: 64×64, 32×64, 128×64, 64×128. Largest r·c 8,192, largest s² 4,096:
    // one slot 4·(8,192 + 2·4,096 + 8,192) = 98,304 bytes. All 56 matrices are small (NS of
    // 64×128: 5·(4·64²·128 + 2·64³) = 13,107,200 FLOPs), so two threads add one more slot.
    // Plus the step's six f64 scalars (loss, norm, scale, the optimizer's lr and bias
    // corrections), its routing sums and counts, 8·8·(2 + 2), and the driver's copy of the one
    // microbatch's loss and routing figures, 8·(1 + 32), and the place its pass writes them.
    let job = preset("tiny").unwrap();
    let scalars = 48.0 + 256.0 + 2.0 * 264.0;
    assert_eq!(predict_cpu_ledger(&job, 1).buffers, 98_304.0 + scalars);
    assert_eq!(
        predict_cpu_ledger(&job, 2).buffers,
        2.0 * 98_304.0 + scalars
    );
    // Four microbatches stash four copies (and write one place first).
    let mut job = job;
    job.training.micro_batch_size = 2;
    let four = 48.0 + 256.0 + 5.0 * 264.0;
    assert_eq!(predict_cpu_ledger(&job, 1).buffers, 98_304.0 + four);
}

#[test]
fn presets_validate_in_the_planner() {
    for name in ganymede_config::PRESETS {
        let job = preset(name).unwrap();
        // The europa-1t slice is one GPU's layer: an H200's (the slice's own test fits it).
        let c = if *name == "europa-1t" {
            jupiter()
        } else if *name == "europa-1t-slice" {
            Cluster::preset("dgx-h200").unwrap()
        } else {
            Cluster::preset("local").unwrap()
        };
        let l = Layout::from_job(&job, &c);
        let mut pol = MemoryPolicy::from_job(&job);
        pol.param_offload = true;
        pol.offload_fraction = 1.0;
        plan(&job, &c, &l, &pol, &OptimizerSetup::from_job(&job)).unwrap();
    }
}

// ---------------------------------------------------------------- issue 11 corrections

/// europa-1t on jupiter without host copies: FSDP traffic, the all-to-all and compute.
fn fsdp_only(cluster: &Cluster, keep_last_block: bool) -> Plan {
    let job = europa();
    let (l, mut pol, o) = final_setup(&job, 0.0);
    pol.param_offload = false;
    pol.keep_last_block = keep_last_block;
    plan(&job, cluster, &l, &pol, &o).unwrap()
}

#[test]
fn communication_bound_step_counts_each_gather_once() {
    // With compute free, forward + backward is the FSDP traffic on its link, end to end: every
    // gather and reduce-scatter once, nothing added for "the first gather / last reduce" (the
    // old model added one more gather and reduce-scatter per microbatch: ~0.85 s at europa-1t).
    // NVLink free too, so that the all-to-all (inside the node) takes no time and the
    // FSDP traffic runs on InfiniBand alone.
    let mut c = jupiter();
    c.gpu.peak_flops = 1e30;
    c.links.nvlink_bytes_per_s = 1e30;
    for keep in [false, true] {
        let p = fsdp_only(&c, keep);
        let fwd_bwd = p.step_time_s - p.time.optimizer_s;
        assert!(
            close(fwd_bwd, p.time.fsdp_comm_s, 1e-9),
            "keep {keep}: {fwd_bwd} vs {}",
            p.time.fsdp_comm_s
        );
        assert_eq!(p.time.bound, "communication");
    }
    // With communication free, it is compute alone.
    let mut c = jupiter();
    c.links.ib_bytes_per_s = 1e30;
    c.links.nvlink_bytes_per_s = 1e30;
    c.links.collective_latency_s = 0.0;
    let p = fsdp_only(&c, true);
    assert!(close(
        p.step_time_s - p.time.optimizer_s,
        p.time.compute_s,
        1e-9
    ));
    assert_eq!(p.time.bound, "compute");
}

#[test]
fn keeping_the_last_block_saves_one_gather_per_microbatch() {
    let c = jupiter();
    let (kept, resharded) = (fsdp_only(&c, true), fsdp_only(&c, false));
    // Per microbatch (one here), exactly one layer's gather: the forward gathers 74 layers plus
    // the embedding/head, so one layer is (fwd − outside)/74; the two backward figures differ
    // by it.
    let job = europa();
    let outside = params::count(&job.model).outside_layers as f64;
    let fwd = kept.communication.fsdp_all_gather_fwd;
    let o = 2.0 * outside * (95.0 / 96.0 / 4.0 + 3.0 / 4.0);
    let layer = (fwd - o) / 74.0;
    assert!(close(
        resharded.communication.fsdp_all_gather_bwd - kept.communication.fsdp_all_gather_bwd,
        layer,
        1e-9
    ));
    assert!(kept.communication.ib_bytes < resharded.communication.ib_bytes);
    assert!(kept.step_time_s < resharded.step_time_s);
}

#[test]
fn the_bound_label_weighs_the_gathers_the_time_model_uses() {
    // Sweep the InfiniBand efficiency through the point where communication overtakes compute.
    // The label must agree with the time model's own totals (two gathers and one reduce per
    // layer); with three gathers it said "communication" for a compute-bound band.
    let mut seen = (false, false);
    for i in 1..400 {
        let mut c = jupiter();
        c.links.ib_efficiency = i as f64 * 0.01;
        let p = fsdp_only(&c, false);
        let comm = p.time.fsdp_comm_s;
        let compute = p.time.compute_s + p.time.all_to_all_s;
        if (comm / compute - 1.0).abs() < 0.05 {
            continue; // the embedding/head terms the label leaves out decide near the tie
        }
        let expect = if comm > compute {
            seen.0 = true;
            "communication"
        } else {
            seen.1 = true;
            "compute"
        };
        assert_eq!(
            p.time.bound, expect,
            "ib efficiency {}",
            c.links.ib_efficiency
        );
    }
    assert_eq!(seen, (true, true), "the sweep crosses the tie");
}

#[test]
fn offload_fraction_is_whole_layers_by_the_shared_rule() {
    // 0.73 of 74 layers is 54 (0.73·74 = 54.02), as docs/planning.md says; the smallest fitting
    // fraction, printed, plans the same layer count back.
    let p = europa_plan(0.73);
    assert_eq!(p.memory.offloaded_layers, 54);
    let f = p.memory.min_offload_fraction.unwrap();
    let printed: f64 = format!("{f:.3}").parse().unwrap();
    let back = europa_plan(printed);
    assert_eq!(
        back.memory.offloaded_layers,
        ganymede_config::offloaded_layers(f, 74)
    );
    assert!(back.fits);
}

#[test]
fn a_layout_that_does_not_fit_says_so_first_with_a_fix_that_fits() {
    let flags = ["--preset", "europa-1t", "--cluster", "jupiter"];
    let args = PlanArgs::parse_flags(&flags).unwrap();
    let p = args.plan().unwrap();
    assert!(!p.fits);
    let fix = p.fit_fix.clone().expect("some policy fits");
    let t = crate::render::table(&p);
    let verdict = t.find("does not fit").expect("verdict printed");
    let tps = t.find("tokens/s per GPU").unwrap();
    assert!(verdict < tps, "verdict after throughput:\n{t}");
    assert!(t.contains(&fix.flags), "{t}");
    // The suggested flags, applied, fit and predict what the suggestion said.
    let mut more: Vec<String> = flags.iter().map(|s| s.to_string()).collect();
    more.extend(fix.flags.split(' ').map(String::from));
    let fixed = PlanArgs::parse_flags(&more).unwrap().plan().unwrap();
    assert!(fixed.fits, "{}", fixed.verdict);
    assert!(fixed.fit_fix.is_none());
    assert!(close(
        fixed.tokens_per_s_per_gpu,
        fix.tokens_per_s_per_gpu,
        1e-12
    ));
}

#[test]
fn gather_and_reduce_precision_scale_their_bytes() {
    // The final setup at its smallest fitting offload, with extra flags.
    let with = |extra: &[&str]| {
        let mut f = vec![
            "--preset",
            "europa-1t",
            "--cluster",
            "jupiter",
            "--param-offload",
            "--offload-fraction",
            "0.730",
        ];
        f.extend_from_slice(extra);
        PlanArgs::parse_flags(&f).unwrap().plan().unwrap()
    };
    let fp32 = with(&[]);
    let bf16 = with(&["--reduce-dtype", "bf16"]);
    let fp8 = with(&["--reduce-dtype", "bf16", "--gather-dtype", "fp8"]);
    let c = |p: &Plan| p.communication.clone();
    // bf16 halves the reduce-scatter; fp8 halves the layers' gathers (embedding and LM head
    // still travel in bf16, so the whole gather a little less than halves).
    assert!(close(
        c(&bf16).fsdp_reduce_scatter,
        c(&fp32).fsdp_reduce_scatter / 2.0,
        1e-12
    ));
    let outside = params::count(&europa().model).outside_layers as f64;
    let o = 2.0 * outside * (95.0 / 96.0 / 4.0 + 3.0 / 4.0);
    assert!(close(
        c(&fp8).fsdp_all_gather_fwd - o,
        (c(&bf16).fsdp_all_gather_fwd - o) / 2.0,
        1e-12
    ));
    assert!(fp32.tokens_per_s_per_gpu < bf16.tokens_per_s_per_gpu);
    assert!(bf16.tokens_per_s_per_gpu < fp8.tokens_per_s_per_gpu);
    // fp8 buffers: the unsharded layer copies take half the bytes.
    assert!(fp8.memory.gpu.unsharded_params < bf16.memory.gpu.unsharded_params);
}

#[test]
fn no_precision_combination_reaches_the_write_ups_1300_on_jupiter() {
    // docs/planning.md section 4a: over NDR200 the final setup stays below 1,300 tokens/s
    // (a 50.4 s step) with every reduce/gather precision and last-block policy; halving both
    // brings the link below compute, so the best case is compute-bound.
    let job = europa();
    for reduce in [4.0, 2.0] {
        for gather in [2.0, 1.0] {
            for keep in [false, true] {
                let (l, mut pol, o) = final_setup(&job, 54.0 / 74.0);
                (pol.reduce_bytes, pol.gather_bytes, pol.keep_last_block) = (reduce, gather, keep);
                let p = plan(&job, &jupiter(), &l, &pol, &o).unwrap();
                assert!(p.fits, "{reduce} {gather} {keep}: {}", p.verdict);
                assert!(p.tokens_per_s_per_gpu < 1300.0, "{reduce} {gather} {keep}");
                let expect = if reduce == 2.0 && gather == 1.0 {
                    "compute"
                } else {
                    "communication"
                };
                assert_eq!(p.time.bound, expect, "{reduce} {gather} {keep}");
            }
        }
    }
}

// ------------------------------------------------- the two-memory layout and the fit check

fn two_memory(name: &str, sets: &[&str]) -> JobConfig {
    let mut o: Vec<String> = vec!["device.kind=cpu-two-memory".into()];
    o.extend(sets.iter().map(|s| s.to_string()));
    JobConfig::load(Some(name), None, &o).unwrap()
}

/// The CUDA backend places bytes as the two-memory emulation does: at f32 compute (no cast
/// scratch, whose elements are 4 bytes on the CPU and 2 on a GPU) the predictions are equal,
/// the master shards on the host under optimizer offload on several ranks included, once
/// Muon's products are f32 and its stacks matrix by matrix (a GPU batches them and rounds their
/// operands to bf16 by default; the emulation does neither: below, and the two-memory test
/// `batched_stacks_are_on_the_ledger_as_the_planner_says` with `ns_batch = "on"`).
#[test]
fn a_cuda_job_is_placed_as_the_two_memory_emulation() {
    for (ranks, offload) in [(1, false), (1, true), (4, false), (4, true)] {
        let o = format!("optimizer.offload={offload}");
        let sets = [
            &o,
            "activation_checkpoint.offload_fraction=1",
            "optimizer.ns_dtype=f32",
            "optimizer.ns_batch=off",
        ];
        let emu = two_memory("tiny", &sets);
        let mut gpu = emu.clone();
        gpu.device.kind = ganymede_config::DeviceKind::Cuda;
        let (a, mut b) = (
            predict_memory(&emu, 1, ranks),
            predict_memory(&gpu, 1, ranks),
        );
        // Less the staging ring's pinned slots, which only the CUDA backend has.
        let staging = crate::fit::staging_bytes(&gpu, ranks);
        assert!(staging > 0.0);
        b.host.buffers -= staging;
        b.host_peak -= staging;
        assert_eq!(a, b, "{ranks} ranks, {o}");
        if ranks > 1 && offload {
            assert!(b.host.params > 0.0, "the master shards on the host");
        }
    }
}

/// The CUDA backend's staging ring on the host: 32 slots, each at the power of two (4 KiB at
/// least) above the step's largest staged write. tiny's 8 × 128 tokens make the ids' grouping
/// the largest, 4 (3 · 1,024 + 1) = 12,292 bytes, so 16 KiB slots: 512 KiB; on 4 ranks a
/// quarter of the tokens, 3,076 bytes, so 4 KiB slots.
#[test]
fn the_staging_ring_is_on_the_host() {
    let mut gpu = two_memory("tiny", &[]);
    gpu.device.kind = ganymede_config::DeviceKind::Cuda;
    assert_eq!(crate::fit::staging_bytes(&gpu, 1), 32.0 * 16_384.0);
    assert_eq!(crate::fit::staging_bytes(&gpu, 4), 32.0 * 4_096.0);
    let p = predict_memory(&gpu, 1, 1);
    assert_eq!(p.host.buffers, 32.0 * 16_384.0);
    assert_eq!(p.host_peak, p.host.total());
}

/// The fused attention backward's dq sums on a CUDA job's device under bf16 compute: tiny's
/// 8 × 128 tokens of 4 heads × 16, 4 bytes each, 256 KiB on one rank and a quarter on 4; none
/// under f32 compute or at head_dim 128 (the two-pass backward). Against the emulation (AdamW:
/// no batched Muon) the device also differs by the cast scratch's element size.
#[test]
fn the_dq_sums_are_on_a_cuda_device_under_bf16() {
    let emu = two_memory(
        "tiny",
        &["training.compute_dtype=bf16", "optimizer.name=adamw"],
    );
    let mut gpu = emu.clone();
    gpu.device.kind = ganymede_config::DeviceKind::Cuda;
    let dq = |job: &JobConfig, ranks| crate::fit::attention_dq_sums_bytes(job, ranks);
    assert_eq!(dq(&gpu, 1), 4.0 * 1024.0 * 64.0);
    assert_eq!(dq(&gpu, 4), 4.0 * 256.0 * 64.0);
    let (a, b) = (predict_memory(&emu, 1, 1), predict_memory(&gpu, 1, 1));
    let casts = crate::ledger::bf16_gemm_scratch(&gpu) - crate::ledger::bf16_gemm_scratch(&emu);
    assert!(casts < 0.0, "bf16 casts are 2 bytes on a GPU, 4 on the CPU");
    assert_eq!(b.device.buffers - a.device.buffers, dq(&gpu, 1) + casts);
    assert_eq!(b.device_peak - a.device_peak, dq(&gpu, 1) + casts);
    let mut f32_gpu = gpu.clone();
    f32_gpu.training.compute_dtype = ganymede_config::ComputeDtype::F32;
    assert_eq!(dq(&f32_gpu, 1), 0.0);
    let mut hd128 = gpu.clone();
    hd128.model.head_dim = 128;
    assert_eq!(dq(&hd128, 1), 0.0);
}

/// One GPU's Muon in bf16 (`ns_dtype = "auto"` there) batches an expert stack's products, and
/// the planner counts the stack slot against the same job run by the emulation (which does not
/// batch on the device): tiny's 8 experts of 128 x 64 (gate and up tall, down wide) in one
/// batch give a slot of 4 (65,536 + 2 x 32,768 + 65,536) bytes. Its iterates are kept in bf16
/// (issue 32: f32 A, bf16 A, B and two copies of X, the f32 set's bytes), so nothing is cast
/// into the GEMMs' bf16 scratch and no slot grows; AdamW has none of this (the host's staging
/// ring aside, see `the_staging_ring_is_on_the_host`).
#[test]
fn one_gpu_counts_batched_muon() {
    let emu = two_memory("tiny", &[]);
    let mut gpu = emu.clone();
    gpu.device.kind = ganymede_config::DeviceKind::Cuda;
    let (a, b) = (predict_memory(&emu, 1, 1), predict_memory(&gpu, 1, 1));
    let extra = 4.0 * (65_536.0 + 2.0 * 32_768.0 + 65_536.0);
    assert_eq!(b.device.buffers - a.device.buffers, extra);
    assert_eq!(b.device_peak - a.device_peak, extra);
    let mut adamw = gpu.clone();
    adamw.optimizer.name = OptimizerName::Adamw;
    let mut emu_adamw = emu.clone();
    emu_adamw.optimizer.name = OptimizerName::Adamw;
    let (mut g, e) = (
        predict_memory(&adamw, 1, 1),
        predict_memory(&emu_adamw, 1, 1),
    );
    // Only the staging ring (host) differs.
    g.host.buffers -= crate::fit::staging_bytes(&adamw, 1);
    g.host_peak = g.host.total();
    assert_eq!(g, e);
}

#[test]
fn one_memory_puts_everything_on_the_host_and_two_memory_on_the_device() {
    // Without offload the two-memory layout is the one-memory ledger moved to gpu0, whole.
    let job = preset("tiny").unwrap();
    let l = predict_cpu_ledger(&job, 1);
    let sum = l.params + l.grads + l.optimizer + l.activations + l.buffers;
    let one = predict_memory(&job, 1, 1);
    assert_eq!((one.device.total(), one.host.total()), (0.0, sum));
    assert_eq!(one.host.optimizer, l.optimizer);
    let two = predict_memory(&two_memory("tiny", &[]), 1, 1);
    assert_eq!((two.device.total(), two.host.total()), (sum, 0.0));
    assert_eq!(two.device.activations, l.activations);
}

/// Expert parallelism's own buffers follow `ep_capacity_factor`: per row of capacity, the kept
/// input and gate/up/SwiGLU rows (H + 3F f32, activations; one set under full checkpointing)
/// with two u32 row orders, and the all-to-all and gradient scratch (3H + 3F f32, buffers). (The
/// whole prediction is held against the ledger in crates/train/tests/expert_capacity.rs.)
#[test]
fn expert_parallel_buffers_follow_the_capacity_factor() {
    let at = |factor: &str| {
        let mut j = two_memory("tiny", &["parallelism.ep=2", factor]);
        j.parallelism.dp_shard = 4;
        let cap = crate::fit::ep_capacity_rows(&{
            let mut l = j.clone();
            l.training.batch_size /= 4;
            l
        })
        .unwrap();
        (predict_memory(&j, 1, 4), cap as f64)
    };
    let (a, ca) = at("parallelism.ep_capacity_factor=1.5");
    let (b, cb) = at("parallelism.ep_capacity_factor=2");
    let m = &two_memory("tiny", &[]).model;
    let (h, f) = (m.hidden as f64, m.expert_hidden as f64);
    // 2 sequences of 128 tokens a rank, top-2: 512 rows even, 1024 at most.
    assert_eq!((ca, cb), (768.0, 1024.0));
    assert_eq!(
        b.device.activations - a.device.activations,
        (4.0 * (h + 3.0 * f) + 8.0) * (cb - ca)
    );
    assert_eq!(
        b.device.buffers - a.device.buffers,
        4.0 * (cb - ca) * 3.0 * (h + f)
    );
    for cat in ["params", "grads", "optimizer"] {
        assert_eq!(a.device.get(cat), b.device.get(cat), "{cat}");
    }
}

#[test]
fn activation_offload_moves_whole_boundaries_and_keeps_two_pool_slots() {
    // small: L = 4, N = 8·256 = 2,048 tokens, H = 256: one boundary is 4·N·H = 2,097,152 bytes.
    // n offloaded layers put n boundaries on the host; the device keeps L + 1 − n of them plus
    // min(n, 2) pool slots, so it saves max(n − 2, 0) boundaries.
    let b = 2_097_152.0;
    let base = predict_memory(&two_memory("small", &[]), 1, 1);
    for (f, n, saved) in [
        ("0.25", 1.0, 0.0),
        ("0.5", 2.0, 0.0),
        ("0.75", 3.0, 1.0),
        ("1", 4.0, 2.0),
    ] {
        let set = format!("activation_checkpoint.offload_fraction={f}");
        let p = predict_memory(&two_memory("small", &[&set]), 1, 1);
        assert_eq!(p.host.activations, n * b, "{f}");
        assert_eq!(
            p.device.activations,
            base.device.activations - saved * b,
            "{f}"
        );
        assert_eq!(p.device.optimizer, base.device.optimizer);
    }
    // With bf16 boundaries (bf16 compute's default) a boundary and a pool slot are 2·N·H =
    // 1,048,576 bytes.
    let bf16 = ["training.compute_dtype=bf16"];
    let base = predict_memory(&two_memory("small", &bf16), 1, 1);
    for (f, n, saved) in [("0.5", 2.0, 0.0), ("1", 4.0, 2.0)] {
        let set = format!("activation_checkpoint.offload_fraction={f}");
        let p = predict_memory(&two_memory("small", &[bf16[0], &set]), 1, 1);
        assert_eq!(p.host.activations, n * b / 2.0, "bf16, {f}");
        assert_eq!(
            p.device.activations,
            base.device.activations - saved * b / 2.0,
            "bf16, {f}"
        );
    }
    // Only under full checkpointing.
    let none = two_memory(
        "small",
        &[
            "activation_checkpoint.mode=none",
            "activation_checkpoint.offload_fraction=1",
        ],
    );
    assert_eq!(predict_memory(&none, 1, 1).host.total(), 0.0);
}

#[test]
fn optimizer_offload_moves_the_state_and_adds_two_staging_slots() {
    // tiny: the largest tensor is a layer's routed experts, [8, 128, 64] = 65,536 elements:
    // Muon holds one f32 per element (the embedding's AdamW state, 2·256·64 = 32,768, is
    // smaller), so the device gains 2·4·65,536 = 524,288 bytes of buffers; under AdamW the
    // experts need 2·65,536 each: 1,048,576 bytes.
    let base = predict_memory(&two_memory("tiny", &[]), 1, 1);
    let p = predict_memory(&two_memory("tiny", &["optimizer.offload=true"]), 1, 1);
    assert_eq!(p.host.optimizer, 1_944_576.0);
    assert_eq!(p.device.optimizer, 0.0);
    assert_eq!(p.device.buffers, base.device.buffers + 524_288.0);
    assert_eq!(p.device.params, base.device.params);
    let adamw = two_memory("tiny", &["optimizer.offload=true", "optimizer.name=adamw"]);
    let a = predict_memory(&adamw, 1, 1);
    assert_eq!(a.device.buffers, 1_048_576.0 + 48.0 + 256.0 + 2.0 * 264.0);
    assert_eq!(a.host.optimizer, 8.0 * 451_968.0);
}

#[test]
fn the_fit_check_names_the_overflow_and_the_smallest_change() {
    // tiny, one thread: params and grads 1,807,872 each, optimizer 1,944,576, buffers 98,872
    // (Muon scratch, the step's f64 scalars, its routing sums and counts and their copy),
    // activations 14,078,024: 19,737,216 bytes. 0.018 GiB = 19,327,352 bytes: the first four
    // (5,659,192) fit, the activation workspace does not. Two layers: offloading them saves
    // nothing (two pool slots), so the fix is optimizer offload: 19,737,216 − 1,944,576 +
    // 524,288 = 18,316,928.
    assert!(
        fit_check(&two_memory("tiny", &[]), 1, 1).is_none(),
        "no capacity"
    );
    let c = fit_check(&two_memory("tiny", &["device.memory_gib=0.018"]), 1, 1).unwrap();
    assert!(!c.fits);
    assert_eq!(c.capacity, 19_327_352.0);
    assert_eq!(c.prediction.device.total(), 19_737_480.0);
    assert_eq!(c.overflow, vec![("activations", 14_078_024.0)]);
    let fix = c.fix.clone().unwrap();
    assert_eq!(fix.sets, vec!["optimizer.offload=true".to_string()]);
    assert_eq!(fix.device_peak, 18_317_192.0);
    let msg = c.message();
    assert!(
        msg.contains("activations 0.01311 GiB")
            && msg.contains("--set optimizer.offload=true")
            && msg.contains("exceeds device.memory_gib = 0.01800 GiB"),
        "{msg}"
    );
    // Applied, it fits.
    let ok = two_memory(
        "tiny",
        &["device.memory_gib=0.018", "optimizer.offload=true"],
    );
    assert!(fit_check(&ok, 1, 1).unwrap().fits);
    // 0.01 GiB = 10,737,418 bytes: no offload or checkpointing fits, microbatches of two
    // sequences do (a quarter of the activations).
    let c = fit_check(&two_memory("tiny", &["device.memory_gib=0.01"]), 1, 1).unwrap();
    let fix = c.fix.clone().expect("a smaller microbatch fits");
    assert_eq!(fix.sets, ["training.micro_batch_size=2"]);
    let two = two_memory("tiny", &["training.micro_batch_size=2"]);
    assert_eq!(fix.device_peak, predict_memory(&two, 1, 1).device_peak);
    // 0.004 GiB: even one sequence at a time with the optimizer offloaded exceeds it.
    let c = fit_check(&two_memory("tiny", &["device.memory_gib=0.004"]), 1, 1).unwrap();
    assert!(
        c.fix.is_none() && c.message().contains("nothing fits"),
        "{c:?}"
    );
}

#[test]
fn the_fit_check_prefers_the_fewest_offloaded_layers_then_optimizer_offload_then_both() {
    // Capacities read off the predictions of the layouts themselves: exactly the device peak
    // with 3 layers offloaded admits 0.750 (the fewest layers that fit; 1 and 2 save nothing);
    // one byte less needs all 4 (1.000). Below every activation-only layout but above optimizer
    // offload alone: optimizer offload. Below that: both, with the fewest layers.
    let peak = |sets: &[&str]| {
        predict_memory(&two_memory("small", sets), 1, 1)
            .device
            .total()
    };
    let fix_at = |cap: f64| {
        let gib = format!("device.memory_gib={}", cap / GIB);
        let c = fit_check(&two_memory("small", &[&gib]), 1, 1).unwrap();
        assert!(!c.fits, "{cap}");
        c.fix.map(|f| f.sets)
    };
    let s = |v: &[&str]| Some(v.iter().map(|x| x.to_string()).collect::<Vec<_>>());
    let three = peak(&["activation_checkpoint.offload_fraction=0.75"]);
    let four = peak(&["activation_checkpoint.offload_fraction=1"]);
    let opt = peak(&["optimizer.offload=true"]);
    assert!(four < three && opt < four, "{three} {four} {opt}");
    assert_eq!(
        fix_at(three + 0.5),
        s(&["activation_checkpoint.offload_fraction=0.750"])
    );
    assert_eq!(
        fix_at(three - 1.0),
        s(&["activation_checkpoint.offload_fraction=1.000"])
    );
    assert_eq!(fix_at(four - 1.0), s(&["optimizer.offload=true"]));
    let both3 = peak(&[
        "optimizer.offload=true",
        "activation_checkpoint.offload_fraction=0.75",
    ]);
    assert_eq!(
        fix_at(both3 + 0.5),
        s(&[
            "optimizer.offload=true",
            "activation_checkpoint.offload_fraction=0.750"
        ])
    );
    // Without checkpointing the first change that fits turns it on.
    let none_peak = predict_memory(
        &two_memory("small", &["activation_checkpoint.mode=none"]),
        1,
        1,
    )
    .device
    .total();
    let full_peak = peak(&[]);
    assert!(full_peak < none_peak);
    let gib = format!("device.memory_gib={}", (full_peak + 0.5) / GIB);
    let c = fit_check(
        &two_memory("small", &["activation_checkpoint.mode=none", &gib]),
        1,
        1,
    )
    .unwrap();
    assert_eq!(
        c.fix.map(|f| f.sets),
        s(&["activation_checkpoint.mode=full"])
    );
}

/// When no offload or checkpointing change fits, the fit check proposes token chunks: the
/// head's loss in chunks halving from 4,096 tokens to 1,024 first, then also the MoE layers'
/// experts in chunks halving from half the tokens, with those loss chunks (the largest that
/// fit), each with the offloads it still needs.
/// `small` at 4,096-token sequences (32,768 tokens a step); capacities read off the predictions.
#[test]
fn the_fit_check_proposes_token_chunks_when_offloading_is_not_enough() {
    let seq = "model.seq_len=4096";
    let peak = |sets: &[&str]| {
        let mut all = vec![seq];
        all.extend(sets);
        predict_memory(&two_memory("small", &all), 1, 1).device_peak
    };
    let fix_at = |cap: f64| {
        let gib = format!("device.memory_gib={}", cap / GIB);
        let c = fit_check(&two_memory("small", &[seq, &gib]), 1, 1).unwrap();
        assert!(!c.fits, "{cap}");
        c.fix.map(|f| (f.sets, f.device_peak))
    };
    let offloads = [
        "optimizer.offload=true",
        "activation_checkpoint.offload_fraction=1",
    ];
    let with_offloads = |sets: &[&'static str]| {
        let mut all = sets.to_vec();
        all.extend(offloads);
        peak(&all)
    };
    let loss = "training.loss_chunk_tokens=4096";
    let s = |v: &[&str]| v.iter().map(|x| x.to_string()).collect::<Vec<_>>();
    // The loss chunk alone fits where every offload without it does not.
    let cap = peak(&[loss]) + 0.5;
    assert!(
        with_offloads(&[]) > cap,
        "the premise: offloads are not enough"
    );
    assert_eq!(fix_at(cap), Some((s(&[loss]), peak(&[loss]))));
    // Below it with every offload, a smaller loss chunk (with what offload it still needs).
    let l2 = "training.loss_chunk_tokens=2048";
    let cap = with_offloads(&[loss]) - 1.0;
    assert!(with_offloads(&[l2]) <= cap, "the premise: 2,048 is enough");
    let (sets, p) = fix_at(cap).expect("a fix");
    assert_eq!((sets[0].as_str(), p <= cap), (l2, true), "{sets:?}");
    // Below every loss chunk (and below them with every offload), the MoE chunk too: 8,192
    // tokens, since 16,384 with every offload and the smallest loss chunk does not fit.
    let (m16, m8) = (
        "training.moe_chunk_tokens=16384",
        "training.moe_chunk_tokens=8192",
    );
    let l1 = "training.loss_chunk_tokens=1024";
    let cap = peak(&[loss, m8]) + 0.5;
    assert!(with_offloads(&[l1]) > cap && with_offloads(&[l1, m16]) > cap);
    assert_eq!(fix_at(cap), Some((s(&[loss, m8]), peak(&[loss, m8]))));
    // Below the smallest chunks with every offload, smaller microbatches: two sequences of
    // the eight, with the largest chunks that then fit (a microbatch's tokens are fewer).
    let floor = with_offloads(&[l1, "training.moe_chunk_tokens=1024"]);
    let (sets, p) = fix_at(floor - 1.0).expect("a smaller microbatch fits");
    assert_eq!(sets[0], "training.micro_batch_size=4", "{sets:?}");
    assert!(p < floor - 1.0);
}

/// On several ranks, when nothing else fits, one gradient set: a set is one block's full
/// gradients (`tiny` on 4 ranks: 8 experts of 3·128·64, q and o 64·64, k and v 32·64, the q/k
/// norms 16, the block's two norms 64, the router 8·64; f32, nothing padded), and it is
/// proposed only after every offload, with the ones still needed.
#[test]
fn the_fit_check_proposes_one_gradient_set_last() {
    // One sequence a rank, so no smaller microbatch is a candidate.
    let job = |sets: &[&str]| {
        let mut all = vec!["training.batch_size=4"];
        all.extend(sets);
        two_memory("tiny", &all)
    };
    let peak = |sets: &[&str]| predict_memory(&job(sets), 1, 4).device_peak;
    let one = "parallelism.gradient_sets=1";
    let p = predict_memory(&job(&[]), 1, 4);
    let q = predict_memory(&job(&[one]), 1, 4);
    let block = 8 * 3 * 128 * 64 + 2 * 64 * 64 + 2 * 32 * 64 + 2 * 16 + 2 * 64 + 8 * 64;
    let block = block as f64;
    assert_eq!(p.device.grads - q.device.grads, 4.0 * block);
    let all = [
        "training.loss_chunk_tokens=4096",
        "optimizer.offload=true",
        "activation_checkpoint.offload_fraction=1",
    ];
    // tiny's 128-token batch per rank is below every chunk: the candidates are the offloads.
    let floor = peak(&all[1..]);
    let cap = peak(&[one]) + 1.0;
    assert!(
        floor > cap,
        "the premise: every offload with two sets does not fit"
    );
    let gib = format!("device.memory_gib={}", cap / GIB);
    let c = fit_check(&job(&[&gib]), 1, 4).unwrap();
    let fix = c.fix.expect("one set fits");
    assert_eq!(fix.sets, vec![one.to_string()]);
    assert_eq!(fix.device_peak, peak(&[one]));
    // Below that, with the optimizer offloaded too.
    let cap = peak(&[one, all[1]]) + 1.0;
    assert!(peak(&[one]) > cap);
    let gib = format!("device.memory_gib={}", cap / GIB);
    let fix = fit_check(&job(&[&gib]), 1, 4).unwrap().fix.unwrap();
    assert_eq!(fix.sets, vec![one.to_string(), all[1].to_string()]);
}

#[test]
fn fsdp_divides_state_and_workspace_by_the_ranks_when_nothing_pads() {
    // tiny on 4 ranks: every dim 0 (256, 64, 32, 16, 8 experts) divides by 4, so the rank holds
    // a quarter of the optimizer state, 1,944,576 / 4 = 486,144 bytes, and the workspace of 2 of
    // the 8 sequences, linear in tokens but for the 68 bytes of per-expert counts and offsets and the 4 of the
    // ids' grouping's last segment end: (14,078,024 − 72) / 4 + 72 = 3,519,560. After initialisation the
    // parameters are a quarter too, but each tensor is drawn whole first: the peak is the
    // shards before the last layer's down_proj (everything but it, the final norm and the LM
    // head: 451,968 − 65,536 − 64 − 16,384 = 369,984 elements, a quarter each: 92,496) plus
    // that tensor whole (65,536): 158,032 elements, 632,128 bytes.
    let p = predict_memory(&two_memory("tiny", &[]), 1, 4);
    assert_eq!(p.device.optimizer, 486_144.0);
    assert_eq!(p.device.activations, 3_519_560.0);
    assert_eq!(p.device.params, 632_128.0);
    // The device's peak total is after initialisation: the shards (451,968 bytes) in place of
    // the initialisation moment.
    assert_eq!(p.device_peak, p.device.total() - 632_128.0 + 451_968.0);
}

// ---------------------------------------------------------------- HSDP

#[test]
fn hsdp_adds_one_gradient_all_reduce_across_replicas() {
    // Two replicas of europa's 384-way FSDP on 192 jupiter nodes, twice the global batch so
    // each GPU runs the same microbatches. Per GPU the memory is the 384-way plan's; the
    // gradient shards (fp32, 4·total/384 bytes) are all-reduced with the one GPU 384 ranks
    // away, on another node: a ring all-reduce of 2 ranks sends half the shard in its
    // reduce-scatter and half in its all-gather, all over InfiniBand.
    let job = europa();
    let (l, pol, o) = final_setup(&job, 1.0);
    let base = plan(&job, &jupiter(), &l, &pol, &o).unwrap();
    let mut l2 = l.clone();
    l2.dp_replicate = 2;
    l2.nodes *= 2;
    l2.global_batch *= 2;
    let h = plan(&job, &jupiter(), &l2, &pol, &o).unwrap();
    assert_eq!(h.microbatches, base.microbatches);
    assert_eq!(h.memory.gpu_total, base.memory.gpu_total);
    assert_eq!(h.tokens_per_gpu_per_step, base.tokens_per_gpu_per_step);
    let total = params::count(&job.model).total as f64;
    let shard = 4.0 * total / 384.0;
    assert!(
        close(h.communication.hsdp_all_reduce, shard, 1e-9),
        "{} vs {shard}",
        h.communication.hsdp_all_reduce
    );
    assert_eq!(base.communication.hsdp_all_reduce, 0.0);
    assert!(close(
        h.communication.ib_bytes - base.communication.ib_bytes,
        shard,
        1e-9
    ));
    let c = jupiter();
    let ib_rate = c.links.ib_bytes_per_s * c.links.ib_efficiency;
    let t = 2.0 * (shard / 2.0 / ib_rate + c.links.collective_latency_s);
    assert!(close(h.time.hsdp_all_reduce_s, t, 1e-12));
    assert!(close(h.step_time_s, base.step_time_s + t, 1e-12));
    // The GPU count must be dp_replicate × dp_shard.
    let mut bad = l2.clone();
    bad.nodes = l.nodes;
    let e = plan(&job, &jupiter(), &bad, &pol, &o)
        .unwrap_err()
        .to_string();
    assert!(e.contains("dp_replicate = 2"), "{e}");
}

#[test]
fn dp_replicate_flag_multiplies_the_gpus() {
    let args = PlanArgs::parse_flags(&[
        "--preset",
        "europa-1t",
        "--cluster",
        "jupiter",
        "--dp-replicate",
        "2",
        "--dp-shard",
        "384",
        "--global-batch",
        "768",
    ])
    .unwrap();
    let r = args.resolve().unwrap();
    assert_eq!(
        (r.layout.nodes, r.layout.dp_replicate, r.layout.dp_shard),
        (192, 2, 384)
    );
    let p = args.plan().unwrap();
    assert!(p.communication.hsdp_all_reduce > 0.0);
    let table = crate::render::table(&p);
    assert!(table.contains("2 replicas (HSDP) x FSDP 384"), "{table}");
    assert!(table.contains("HSDP all-reduce across replicas"), "{table}");
    // From the job config too.
    let args = PlanArgs::parse_flags(&[
        "--preset",
        "europa-1t",
        "--cluster",
        "jupiter",
        "--set",
        "parallelism.dp_replicate=2",
        "--global-batch",
        "768",
    ])
    .unwrap();
    let r = args.resolve().unwrap();
    assert_eq!((r.layout.nodes, r.layout.world()), (192, 768));
}

// ---------------------------------------------------------------- the CPU model (issue 11)

use crate::cluster::CpuSpec;
use crate::cpu_time::{layer_forward, layer_forward_chunked, ns_flops_cpu, syrk_madds};

/// A CPU with one GEMM rate at every size (`rate` on the pool, `rate / 2` on each of 2 threads,
/// so spreading a stack gives the same rate), `bw` bytes/s, no fixed costs.
fn flat_cpu(rate: f64, bw: f64) -> Cluster {
    let mut c = Cluster::preset("local").unwrap();
    c.cpu = Some(CpuSpec {
        cores: 2.0,
        threads: 2,
        gemm: vec![[1.0, rate]],
        gemm_one_thread: vec![[1.0, rate / 2.0]],
        attention: vec![],
        elementwise_bytes_per_s: bw,
        optimizer_bytes_per_s: 0.0,
        op_overhead_s: 0.0,
        sync_s: 0.0,
        calibrated: "test".into(),
    });
    c
}

#[test]
fn syrk_counts_the_strips_the_cpu_backend_computes() {
    // 256×256: strips of 64 rows; strip r computes 64 rows × (r+1)·64 columns × k:
    // 64·256·(64+128+192+256) = 10,485,760 = 0.625 of 256³.
    assert_eq!(syrk_madds(256, 256), 10_485_760.0);
    // 64 rows: one strip, the full square (64·64·1024).
    assert_eq!(syrk_madds(64, 1024), 4_194_304.0);
    // 1024: 16 strips of 64, 17/32 of the square: 1024³·17/32 = 570,425,344.
    assert_eq!(syrk_madds(1024, 1024), 570_425_344.0);
    // Newton–Schulz on 256×256, 5 steps: 2·syrk(X) + 2·syrk(A) + 2·s³ per step =
    // 5·(20,971,520 + 20,971,520 + 33,554,432) = 377,487,360, against the GEMM-equivalent
    // 5·6·256³ = 503,316,480.
    assert_eq!(ns_flops_cpu(256, 256, 5), 377_487_360.0);
    assert_eq!(ns_flops(256, 256, 5), 503_316_480.0);
}

#[test]
fn tiny_layer_forward_work_by_hand() {
    // tiny, 8 sequences of 128 = 1,024 tokens; H 64, q 64, kv 32, head 16 × 4, 8 experts top-2
    // of hidden 128.
    let job = preset("tiny").unwrap();
    let w = layer_forward(&job.model, 1024.0, 128.0, true);
    // projections 2·1024·(64·64 + 2·32·64 + 64·64) = 25,165,824; attention per (sequence,
    // head) two causal 128×64×16 products: 2·128·64·16·(2·8·4) = 16,777,216; router
    // 2·1024·8·64 = 1,048,576; experts (256 tokens each) gate+up 2·256·128·64·16 = 67,108,864,
    // down 2·256·64·128·8 = 33,554,432. Sum 143,654,912.
    assert_eq!(w.flops(), 143_654_912.0);
    assert_eq!(w.attention.flops(), 16_777_216.0);
    // Element-wise f32 bytes: attention side 1024·(2·64 + 2·96 + 2·96 + 3·64 + 2·64) = 1024·832;
    // MoE side 1024·(3·8 + 2·2·64 + 3·2·128 + 3·64 + 3·64) = 1024·1,432; × 4 bytes = 9,273,344.
    assert_eq!(w.elementwise_bytes, 9_273_344.0);
}

/// The MoE and loss chunks in the CPU time model, at flat rates (so only FLOPs count), `tiny`
/// (1,024 tokens, chunks of 256): under full checkpointing the MoE chunk adds nothing (the
/// recompute runs only the last chunk's experts) and the loss chunk recomputes three chunks'
/// logits (3·2·256·256·64); without checkpointing the backward also recomputes three chunks'
/// experts (two layers of 3/4 of 100,663,296 expert FLOPs).
#[test]
fn cpu_time_of_moe_and_loss_chunks_by_hand() {
    let rate = 1e11;
    let c = flat_cpu(rate, 1e10);
    let step = |moe: usize, loss: usize, ac: AcMode| {
        let mut job = preset("tiny").unwrap();
        job.training.moe_chunk_tokens = moe;
        job.training.loss_chunk_tokens = loss;
        let l = Layout::from_job(&job, &c);
        let mut pol = MemoryPolicy::from_job(&job);
        pol.ac = ac;
        let o = OptimizerSetup {
            name: OptimizerName::Adamw,
            ..OptimizerSetup::from_job(&job)
        };
        plan(&job, &c, &l, &pol, &o).unwrap().step_time_s
    };
    let chunked = layer_forward_chunked(&preset("tiny").unwrap().model, 1024.0, 128.0, true, 256.0);
    let whole = layer_forward(&preset("tiny").unwrap().model, 1024.0, 128.0, true);
    assert_eq!(chunked.flops(), whole.flops());
    let rows: Vec<f64> = chunked.gemms.iter().map(|g| g.m).collect();
    assert!(
        rows.contains(&64.0),
        "a chunk's 256·2/8 rows per expert: {rows:?}"
    );
    let full = AcMode::Full;
    assert!(close(step(256, 0, full), step(0, 0, full), 1e-12));
    let logits = 3.0 * 2.0 * 256.0 * 256.0 * 64.0 / rate;
    assert!(close(step(0, 256, full), step(0, 0, full) + logits, 1e-12));
    let experts = 2.0 * 0.75 * 100_663_296.0 / rate;
    let none = AcMode::None;
    assert!(close(step(256, 0, none), step(0, 0, none) + experts, 1e-12));
}

#[test]
fn cpu_step_of_tiny_by_hand() {
    let job = preset("tiny").unwrap();
    let (rate, bw) = (1e11, 1e10);
    let c = flat_cpu(rate, bw);
    let l = Layout::from_job(&job, &c);
    let pol = MemoryPolicy::from_job(&job); // full checkpointing
    let o = OptimizerSetup {
        name: OptimizerName::Adamw,
        ..OptimizerSetup::from_job(&job)
    };
    let p = plan(&job, &c, &l, &pol, &o).unwrap();
    let t = p.time.cpu.clone().expect("the CPU model ran");
    // GEMM FLOPs: per layer forward 143,654,912 (above), again as recompute, backward twice
    // every GEMM but attention's 16,777,216 (2.5×): 2·126,877,696 + 2.5·16,777,216 =
    // 295,698,432; two layers: 2·(2·143,654,912 + 295,698,432) = 1,166,016,512; LM head
    // 3·2·1024·256·64 = 100,663,296. Total 1,266,679,808.
    // Element-wise bytes: layers 2·9,273,344·(1 + 1 + 2) = 74,186,752; outside the layers
    // forward 4·1024·3·64 = 786,432, backward 4·1024·(3·256 + 6·64) = 4,718,592: 79,691,776.
    // Optimizer: AdamW 28 B per parameter, and 8 B of gradient passes (zero, norm; clipping is
    // in the update).
    let opt_bytes = (28.0 + 8.0) * p.params.total as f64;
    let want = 1_266_679_808.0 / rate + (79_691_776.0 + opt_bytes) / bw;
    assert!(
        close(p.step_time_s, want, 1e-12),
        "{} vs {want}: {t:?}",
        p.step_time_s
    );
    assert_eq!(t.share, 1.0);
    assert!(close(t.optimizer_s, opt_bytes / bw, 1e-12));

    // Four ranks as threads on the same 2 cores divide them: each rank has a quarter of the
    // tokens, and the four share the cores, so forward + backward take as long as on one rank
    // (every term here is linear in tokens); the collectives come on top.
    let mut l4 = l.clone();
    (l4.dp_shard, l4.gpus_per_node, l4.micro_batch) = (4, 4, 2);
    let p4 = plan(&job, &c, &l4, &pol, &o).unwrap();
    let t4 = p4.time.cpu.unwrap();
    assert_eq!(t4.share, 4.0);
    assert!(close(
        t4.forward_s + t4.backward_s,
        t.forward_s + t.backward_s,
        1e-12
    ));
    assert!(t4.comm_s > 0.0);

    // Muon adds Newton–Schulz at the syrk-counted FLOPs: with flat rates exactly their sum.
    let muon = OptimizerSetup {
        name: OptimizerName::Muon,
        ..o.clone()
    };
    let pm = plan(&job, &c, &l, &pol, &muon).unwrap();
    let ns: f64 = params::tensors(&job.model)
        .iter()
        .filter(|t| t.handler() == Handler::Muon)
        .map(|t| t.count as f64 * ns_flops_cpu(t.rows, t.cols, 5))
        .sum();
    let copies: f64 = params::tensors(&job.model)
        .iter()
        .filter(|t| t.handler() == Handler::Muon)
        .map(|t| {
            // Five steps: the normalisation and the copy back from scratch, each s·l read and
            // written (8 bytes per value).
            let (s, l) = (t.rows.min(t.cols) as f64, t.rows.max(t.cols) as f64);
            t.count as f64 * 2.0 * 8.0 * s * l
        })
        .sum();
    assert!(close(
        pm.time.newton_schulz_s,
        ns / rate + copies / bw,
        1e-12
    ));
}

#[test]
fn gpu_clusters_have_no_cpu_model() {
    for name in ["jupiter", "dgx-h100", "dgx-h200"] {
        assert!(Cluster::preset(name).unwrap().cpu.is_none());
    }
    let job = europa();
    let (l, pol, o) = final_setup(&job, 1.0);
    assert!(plan(&job, &jupiter(), &l, &pol, &o)
        .unwrap()
        .time
        .cpu
        .is_none());
}

#[test]
fn gemm_rate_interpolates_in_log_size() {
    let curve = [[1e6, 1e10], [1e8, 3e10]];
    assert_eq!(CpuSpec::rate(&curve, 1e3), 1e10);
    assert_eq!(CpuSpec::rate(&curve, 1e9), 3e10);
    // 1e7 is half-way in log(size): 2e10.
    assert!(close(CpuSpec::rate(&curve, 1e7), 2e10, 1e-12));
}

#[test]
fn cpu_section_round_trips_is_optional_and_bad_values_are_named() {
    let local = Cluster::preset("local").unwrap();
    assert!(local.cpu.is_some());
    let text = local.to_toml();
    assert_eq!(Cluster::from_toml_str(&text, "rt").unwrap(), local);
    // A file without [cpu] (every cluster file before it existed) still parses.
    let cut = &text[..text.find("\n[cpu]").unwrap()];
    assert!(Cluster::from_toml_str(cut, "old.toml")
        .unwrap()
        .cpu
        .is_none());
    let bad = |from: &str, to: &str| {
        assert!(text.contains(from), "{from}");
        Cluster::from_toml_str(&text.replacen(from, to, 1), "cal.toml")
            .unwrap_err()
            .to_string()
    };
    let e = bad("elementwise_bytes_per_s = ", "elementwise_bytes_per_s = -");
    assert!(
        e.contains("cal.toml") && e.contains("cpu.elementwise_bytes_per_s"),
        "{e}"
    );
    let e = bad("threads = 2", "threads = 0");
    assert!(e.contains("cpu.threads"), "{e}");
    let e = bad("gemm = [[", "gemm = [[1e12, 1.0], [");
    assert!(e.contains("cpu.gemm[1][0]") && e.contains("ascend"), "{e}");
    let e = bad("op_overhead_s", "op_overhaed_s");
    assert!(e.contains("cal.toml") && e.contains("op_overhaed_s"), "{e}");
}

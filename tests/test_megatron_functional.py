"""A held-out test of our own: GPT configs of Megatron-LM's functional tests (tests/fixtures/megatron_functional/
*.args, from tests/functional_tests/test_cases/{gpt,moe,mixtral,hybrid}/*/model_config.yaml at d98e8a64dd, sizes
shrunk only). Each is given as written, `--load` naming an empty directory as on Megatron's first CI run (a warning,
then from scratch): the ones whose features exist run 2 iterations on CPU ranks (gloo), `--transformer-impl
transformer_engine` included (our local layers run, and the start-up log says so); the MLA, MTP, muP, Mamba-hybrid
and FP8 ones, and Megatron's sinkhorn router, are refused in one pass, each flag by its reason. Mixtures of experts
run at EP >= 2 and log their balancing loss and per-layer expert loads (Mixtral's release config: its TP x PP x EP
layout shrunk to 4 ranks, as its header says; Qwen3-30B-A3B's modelopt MODEL_ARGS, with a launcher's lines).

World size = the layout's TP x PP x CP x DP with DP shrunk (1, or 2 where the config is TP1 PP1);
fixtures of one world size run one after the other in one set of rank processes. Those of 4 ranks and
more that add nothing the runs do not cover are parsed only (REFUSED with nothing refused): the suite's time."""

import math

import pytest

from megatron_zpp import training
from megatron_zpp.config import ConfigError
from megatron_zpp.config.arguments import parse_config
from tests.dist import run_distributed
from tests.megatron_fixtures import fixture_lines, tiny_dataset, tiny_gpt2_files, tiny_sentencepiece_model

FP8 = "FP8/FP4 and transformer-engine are not supported"
MLA = "multi-latent attention and DeepSeek sparse attention are not built"
MTP = "multi-token prediction is not built"
MUP = "the muP parametrization is not built"
HYBRID = "Mamba and Megatron's hybrid layer patterns are not built"
# fixture -> (world size, the flags refused as written -> a piece of their reason); all others run
RUNS = {
    "gpt3_mcore_tp1_pp2_fp16": (2, {}),
    "gpt3_mcore_tp1_pp2": (2, {}),
    "gpt3_mcore_te_tp1_pp2_rope_embeddings": (2, {}),
    "gpt3_mcore_tp1_pp1_dist_optimizer_overlap_grad_reduce_param_gather": (2, {}),
    "gpt3_mcore_te_tp1_pp1_uniform_full_recompute": (2, {}),
    # Megatron's GDN hybrid with MoE, read as ours (--attention-type gdn, --softmax-attention-every 3, its 2 key
    # heads under 4 value heads of 16 channels) at TP 2 + SP; Megatron's default LayerNorm with 1p: every norm, the
    # GDN output norm too (megatron-core's out_norm), a zero-centred LayerNorm with a bias
    "gpt3_mcore_te_tp2_pp1_gdn": (2, {}),
    "qwen3_30b_a3b_modelopt_conf": (2, {}),  # Qwen3-MoE's shape at EP 2 (the conf file's MODEL_ARGS)
    "gpt3_mcore_tp2_pp2_uninstall_te": (4, {}),
    "gpt3_mcore_te_tp1_pp4_vp1": (4, {}),
    "gpt3_mcore_te_tp1_pp4_vp1_uneven_pipeline": (4, {}),
    "gpt3_mcore_te_tp2_pp1_cp2_nondeterministic": (4, {}),
    "gpt3_mcore_te_tp4_pp1_dist_optimizer_overlap_grad_reduce_param_gather": (4, {}),
    "gpt3_7b_tp1_pp4_memory_speed": (4, {}),
    "gpt3_mcore_te_tp1_pp4_swiglu": (4, {}),
    # mixtures of experts: EP 4 x expert TP 1 beside TP 2 + SP; Mixtral's PP x EP (alltoall, grouped GEMM)
    "gpt3_mcore_te_tp2_pp1_te_8experts_etp1_ep4": (4, {}),
    "mixtral_8x7b_alltoall_tp2pp4ep4_release": (4, {}),
}
# MoE fixture -> (MoE layers, EP, whether it logs a balancing loss: not at Megatron's default --moe-aux-loss-coeff 0)
MOE_RUNS = {
    "gpt3_mcore_te_tp2_pp1_gdn": (6, 1, False),
    "gpt3_mcore_te_tp2_pp1_te_8experts_etp1_ep4": (2, 4, True),
    "mixtral_8x7b_alltoall_tp2pp4ep4_release": (4, 2, True),
    "qwen3_30b_a3b_modelopt_conf": (2, 2, True),
}
# the ones refused in one pass (checked without processes; their world size is the layout's)
REFUSED = {
    # nothing refused: the same model as gpt3_mcore_te_tp2_pp1_gdn (RUNS), parsed only
    "gpt3_mcore_te_tp2_pp1_gdn_no_nvrx_sync": (2, {}),
    # Megatron's S-BASE routing (sinkhorn) is not built; its top-1 then falls to the softmax router, where a
    # softmax over one score is 1 (Megatron refuses that too, but for sinkhorn)
    "gpt3_mcore_tp2_pp2_resume_torch_dist_te_2experts": (
        4,
        {
            "--moe-router-load-balancing-type": "invalid choice: 'sinkhorn'",
            "--moe-router-topk": "--moe-router-topk 1 with softmax needs --moe-router-pre-softmax",
        },
    ),
    # DeepSeek-V3's proxy (TP 2 x PP 4 x EP 16: 64 ranks): its MoE flags are built (sigmoid group-limited routing,
    # expert bias, seq-aux loss, shared expert, --moe-permute-fusion a no-op); MLA, MTP, the flex dispatcher and
    # the pipeline layout string are not, and without the layout its 14 layers do not split over 4 stages
    "deepseekv3_proxy_flex_tp1pp4emp16etp1cp1_release": (
        64,
        {f: MLA for f in "--multi-latent-attention --q-lora-rank --kv-lora-rank --qk-head-dim --v-head-dim".split()}
        | {f: MLA for f in "--qk-pos-emb-head-dim --rotary-scaling-factor --mscale --mscale-all-dim".split()}
        | {"--mtp-num-layers": MTP, "--mtp-loss-scaling-factor": MTP}
        | {
            "--pipeline-model-parallel-layout": "layout strings are not built",
            "--enable-experimental": "experimental code paths are not built",
            "--moe-flex-dispatcher-backend": "mixture of experts is not built",
            "--moe-token-dispatcher-type": "flex (DeepEP) is not built: use alltoall or allgather",
            "--num-layers": "--num-layers 14 is not divisible by --pipeline-model-parallel-size 4",
        },
    ),
    "gpt3_mcore_te_tp2_pp2_mla": (
        4,
        {f: MLA for f in "--multi-latent-attention --q-lora-rank --kv-lora-rank --qk-head-dim --v-head-dim".split()}
        | {"--qk-pos-emb-head-dim": MLA},
    ),
    "gpt3_mcore_te_tp1_pp1_mup": (2, {"--use-mup": MUP, "--mup-base-hidden-size": MUP}),
    "hybrid_mr_mcore_te_tp1_pp1_cp1_dgx_a100_1N8G": (
        2,
        {
            "--hybrid-layer-pattern": HYBRID,
            "--spec": HYBRID,
            "--check-weight-hash-across-dp-replicas-interval": "not built here",
        },
    ),
    "gpt3_mcore_te_tp2_pp1_multi_dist_optimizer_instances": (
        4,
        {"--num-distributed-optimizer-instances": "one distributed-optimizer instance only"},
    ),
    "gpt3_mcore_te_tp4_pp1_qk_layernorm_test_mode": (4, {"--test-mode": "in-model self-tests are not built"}),
    "gpt3_weekly_mcore_tp2_pp2_current_scaling_native_fp8_tp_pp_sp_tp_overlap": (
        4,
        {f: FP8 for f in "--tp-comm-overlap --tp-comm-overlap-cfg --fp8-format --fp8-recipe".split()}
        | {"--fp8-param-gather": FP8},
    ),
    # nothing refused: they parse as written (8 ranks each: the TP8 run takes 100 s on 8 CPU ranks here, so both are
    # left out of the suite; their features run in RUNS: TP2 x PP2, TP2 x CP2)
    "gpt3_15b_8t_release": (8, {}),
    "gpt3_mcore_te_tp2_pp2_cp2": (8, {}),
}


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    d = tmp_path_factory.mktemp("megatron_functional")
    vocab, merges, bpe = tiny_gpt2_files(d)
    spm = tiny_sentencepiece_model(d / "spm")  # the 15B config's GPTSentencePieceTokenizer
    from transformers import PreTrainedTokenizerFast

    hf = str(d / "hf")  # Qwen3's HuggingFaceTokenizer: the same BPE as a local HF directory
    PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, eos_token="<|endoftext|>").save_pretrained(hf)
    data = tiny_dataset(str(d / "text_document"), documents=200)
    return dict(data=data, vocab=vocab, merges=merges, spm=spm, hf=hf, root=d)


def paths_for(name: str, data: dict) -> dict:
    run = data["root"] / name
    (run / "load").mkdir(parents=True, exist_ok=True)  # Megatron's CI: --load an empty directory, first run
    return dict(
        load=run / "load",
        data=data["data"],
        vocab=data["vocab"],
        merges=data["merges"],
        spm=data["spm"],
        hf=data["hf"],
        tb=run / "tb",
        ckpt=run / "ckpt",
        cache=run / "cache",
        wandb=run / "wandb",
        wandb_name=name,
        tp_comm_cfg=run / "tp_comm_overlap_cfg.yaml",
    )


def refusals(name: str, world: int, data: dict) -> tuple[list[list[str]], dict[str, str]]:
    """The fixture's lines and flag -> reason of every refused one, from one parse_config (one pass)."""
    lines = fixture_lines(f"megatron_functional/{name}.args", **paths_for(name, data))
    try:
        parse_config([t for ln in lines for t in ln] + ["--device", "cpu", "--peak-tflops", "1"], world)
    except ConfigError as e:
        got = {}
        for line in str(e).splitlines():
            flag = line.split(":")[0].split()[0]
            got[flag if flag.startswith("--") else line] = line
        return lines, got
    return lines, {}


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_unbuilt_features_are_refused_in_one_pass(name, data):
    world, expected = REFUSED[name]
    _, got = refusals(name, world, data)
    assert sorted(got) == sorted(expected), name
    for flag, why in expected.items():
        assert why in got[flag], got[flag]


def _train_each(rank, world_size, argvs):
    out = []
    for argv in argvs:
        cfg = parse_config(argv, world_size)
        history = training.train(training.setup(cfg))
        moe = sorted(k for k in history[-1] if k.startswith("moe/") or k in ("load_balancing_loss", "z_loss"))
        out.append(([h["loss"] for h in history], cfg.megatron_noops, (moe, cfg.parallel.expert_model_parallel_size)))
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_functional_configs_run_two_iterations(world, data):
    names = [n for n, (w, _) in RUNS.items() if w == world]
    argvs = []
    for name in names:
        lines, got = refusals(name, world, data)
        assert sorted(got) == sorted(RUNS[name][1]), (name, got)
        kept = [ln for ln in lines if ln[0] not in got]
        argvs.append([t for ln in kept for t in ln] + ["--device", "cpu", "--peak-tflops", "1"])
    results = run_distributed(_train_each, world, argvs, timeout=400)
    for name, (losses, noops, (moe, ep)) in zip(names, results[0]):
        assert len(losses) == 2 and all(math.isfinite(x) for x in losses), (name, losses)
        assert "--use-mcore-models" in noops, name  # every config passes it; a no-op, logged
        layers, want_ep, balancing = MOE_RUNS.get(name, (0, 1, False))  # an MoE run logs its per-layer expert loads
        loads = [f"moe/expert_load_{m}/layer{i}" for m in ("max", "min") for i in range(layers)]
        aux = ["load_balancing_loss"] if balancing else []
        assert moe == (sorted([*aux, "moe/expert_load_max_over_mean", *loads]) if layers else []), name
        assert ep == want_ep, name

"""Megatron-LM's MoE example script (examples/mixtral/train_mixtral_8x7b_distributed.sh, its argument list kept in
tests/fixtures/megatron_mixtral_8x7b.args): every flag a setting or a no-op, with Megatron's meaning. Megatron's
values below were read from NVIDIA/Megatron-LM d98e8a64dd (the script, megatron/training/arguments.py's
validate_args and megatron/core/tokenizers/utils/build_tokenizer.py), not from our code. Megatron's MoE kernel
switches are no-ops. Its functional-test MoE configs run in tests/test_megatron_functional.py."""

import pytest

from megatron_zpp.config import ConfigError
from megatron_zpp.config.arguments import parse_config
from tests.megatron_fixtures import check_flag_by_flag, fixture_lines, tiny_dataset, tiny_sentencepiece_model

# in the script's order: settings ("ok") but the three no-ops
MIXTRAL = dict.fromkeys(
    (
        "--use-mcore-models --disable-bias-linear --seq-length --max-position-embeddings --num-layers --hidden-size "
        "--ffn-hidden-size --num-attention-heads --init-method-std --attention-dropout --hidden-dropout "
        "--normalization --position-embedding-type --swiglu --untie-embeddings-and-output-weights "
        "--group-query-attention --num-query-groups --no-masked-softmax-fusion --no-position-embedding "
        "--rotary-base --num-experts --moe-router-topk --moe-router-load-balancing-type --moe-aux-loss-coeff "
        "--moe-grouped-gemm --moe-token-dispatcher-type --overlap-param-gather --overlap-grad-reduce "
        "--tokenizer-type --tokenizer-model --data-path --split --micro-batch-size --global-batch-size --lr "
        "--train-iters --lr-decay-iters --lr-decay-style --min-lr --weight-decay --lr-warmup-iters --clip-grad "
        "--bf16 --tensor-model-parallel-size --pipeline-model-parallel-size --expert-model-parallel-size "
        "--use-distributed-optimizer --sequence-parallel --log-interval --save-interval --eval-interval "
        "--eval-iters --save --load --tensorboard-dir --no-load-optim --no-load-rng "
    ).split(),
    "ok",
) | {f: "noop" for f in ("--use-mcore-models", "--no-masked-softmax-fusion", "--no-position-embedding")}


def test_mixtral_8x7b_script_every_flag_with_megatrons_meaning(tmp_path):
    """examples/mixtral/train_mixtral_8x7b_distributed.sh at its layout (PP 4 x EP 8 = 32 ranks): every flag a
    setting or a no-op, with Megatron's meaning: RoPE kept under --no-position-embedding (Megatron's validate_args
    accepts it with rope only, where it changes nothing), Llama2Tokenizer a sentencepiece tokenizer whose
    end-of-document is its eos, the experts split 8 ways over the data-parallel ranks."""
    from megatron_zpp.data.tokenizer import build_tokenizer

    spm = tiny_sentencepiece_model(tmp_path / "spm")
    paths = dict(ckpt=tmp_path / "ckpt", spm=spm, data=tiny_dataset(str(tmp_path / "d")))
    kept = check_flag_by_flag(fixture_lines("megatron_mixtral_8x7b.args", **paths), MIXTRAL)
    cfg = parse_config([tok for ln in kept for tok in ln], 32)
    m, p = cfg.model, cfg.parallel
    assert m.position_embedding_type == "rope" and m.rotary_base == 1e6 and m.kv_heads == 2
    assert (m.num_experts, m.moe_router_topk, m.moe_router_load_balancing_type) == (8, 2, "aux_loss")
    assert m.moe_aux_loss_coeff == 1e-2 and m.moe_grouped_gemm and m.moe_token_dispatcher_type == "alltoall"
    assert (p.pipeline_model_parallel_size, p.expert_model_parallel_size, p.data_parallel_size) == (4, 8, 8)
    assert [m.is_moe_layer(i) for i in range(4)] == [True] * 4 and cfg.zero.zero_stage == 1
    tok = build_tokenizer(cfg.data.tokenizer_type, cfg.data.tokenizer_model)
    assert cfg.data.tokenizer_type == "Llama2Tokenizer" and tok.eod == tok.sp.eos_id() >= 0
    with pytest.raises(ConfigError, match="--no-position-embedding with --position-embedding-type learned_absolute"):
        parse_config(["--mock-data", "--no-position-embedding"], 1)


def test_megatrons_moe_kernel_switches_are_noops_and_te_cross_entropy_is_refused():
    """--moe-permute-fusion / --moe-router-fusion pick transformer-engine kernels of the same math as Megatron's
    unfused path (ours), --moe-shared-expert-overlap a side stream; DeepSeek-V3's --cross-entropy-fusion-impl native
    is Megatron's own fused cross-entropy, te is refused; the MoE options not built are refused by name."""
    from megatron_zpp.config.arguments import parse_args

    given = ["--moe-permute-fusion", "--moe-router-fusion", "--moe-shared-expert-overlap"]
    cfg = parse_args(given + ["--cross-entropy-fusion-impl", "native"])
    assert cfg.megatron_noops == given + ["--cross-entropy-fusion-impl native"]
    with pytest.raises(ConfigError) as info:
        parse_args(["--cross-entropy-fusion-impl", "te", "--moe-apply-probs-on-input", "--moe-input-jitter-eps", "0.1"])
    lines = str(info.value).splitlines()
    assert lines[0] == "--cross-entropy-fusion-impl te: transformer-engine's cross-entropy is not used here: use native"
    assert [ln.split(":")[0] for ln in lines[1:]] == ["--moe-apply-probs-on-input", "--moe-input-jitter-eps"]
    assert all("mixture of experts is not built" in ln for ln in lines[1:])

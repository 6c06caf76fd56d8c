"""bench/zero.py end to end at the smallest size: 2 ranks on loopback (no namespaces), one warmup and
one timed step, ours ZeRO-3 beside FSDP2 and DeepSpeed ZeRO-3, so that a change of defaults or of the
training loop cannot break the peer comparison silently. Every system trains the same model from the
same weights and tokens: their losses agree (fp32), and the run prints its table and its JSON line.
Without deepspeed in the venv its row must say so in one line instead."""

import importlib.util
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = "--num-layers 1 --hidden-size 64 --num-attention-heads 2 --seq-length 32 --vocab-size 256".split()


def test_zero_bench_runs_every_system_on_the_same_model(tmp_path):
    systems = ["ours-z3", "fsdp2", "ds-z3"]
    argv = [
        "--no-netns",
        "--rates",
        "unshaped",
        "--systems",
        *systems,
        "--dtype",
        "fp32",
        "--ranks",
        "2",
        "--lock-wait",
        "120",
    ]
    argv += ["--steps", "1", "--warmup", "1", "--repeats", "1", "--work-dir", str(tmp_path), *TINY]
    env = {**os.environ, "PYTHONPATH": ROOT}  # the ranks import this checkout's package
    res = subprocess.run(
        [sys.executable, os.path.join(ROOT, "bench", "zero.py"), *argv],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=400,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    out = res.stdout
    summary = json.loads(out.strip().splitlines()[-1])
    rows = summary["systems"]["fp32"]
    assert "== fp32, unshaped" in out and all(rows[n]["label"] in out for n in systems)
    ran = ["ours-z3", "fsdp2"]
    if importlib.util.find_spec("deepspeed") is not None:
        ran.append("ds-z3")
    else:
        assert rows["ds-z3"]["status"] == "failed" and "deepspeed is not installed" in rows["ds-z3"]["reason"]
        assert "Traceback" not in out
    for name in ran:
        assert rows[name]["status"] == "ok", (name, rows[name].get("reason"))
    losses = {n: rows[n]["repeats"][0]["losses"] for n in ran}
    assert all(len(v) == 2 for v in losses.values()), losses
    for name in ran[1:]:  # the same model, weights, tokens and optimizer: the same losses (fp32)
        for ours, peer in zip(losses["ours-z3"], losses[name]):
            assert abs(ours - peer) <= 1e-4 * abs(ours), (name, losses)
    assert summary["params"] > 0


def test_peer_model_is_ours_and_refuses_megatron_defaults():
    """The peers' PeerGPT built from the bench's flags has our parameter count and gives our loss on a
    batch (fp32); under Megatron's defaults (learned positions, biases, LayerNorm, GeLU) it refuses in
    one line naming every field it does not implement."""
    import pytest
    import torch

    from megatron_zpp.config.arguments import parse_args
    from megatron_zpp.data.tokenizer import pad_vocab_size
    from megatron_zpp.model import GPT, count_parameters, init_weights
    from megatron_zpp.testing.peers.model import LLAMA_FLAGS, build_peer_model, peer_shape_mismatch
    from megatron_zpp.validation import validate

    base = "--mock-data --micro-batch-size 2 --global-batch-size 2 --train-iters 1 --seed 3".split() + TINY
    cfg = validate(parse_args(base + LLAMA_FLAGS), 1)
    peer, vocab = build_peer_model(cfg)
    ours = GPT(cfg.model, vocab)
    init_weights(ours, cfg.train.seed)
    assert sum(p.numel() for p in peer.parameters()) == count_parameters(ours)
    x = torch.randint(0, cfg.model.vocab_size, (2, cfg.model.seq_length))
    y = torch.roll(x, -1, dims=1)
    ours.train()
    assert ours(x, y).mean().item() == pytest.approx(peer(x, y).item(), rel=1e-5)

    megatron = validate(parse_args(base), 1)
    why = peer_shape_mismatch(megatron.model)
    assert why and all(f in why for f in ("position_embedding_type", "add_bias_linear", "normalization", "activation"))
    with pytest.raises(SystemExit, match="error: the peers implement a Llama-like block only"):
        build_peer_model(megatron)
    assert vocab == pad_vocab_size(cfg.model.vocab_size, cfg.model.make_vocab_size_divisible_by, 1)


def test_deepspeed_missing_is_one_line(monkeypatch):
    """Without deepspeed in the venv the ds systems are refused in one line that says how to install it."""
    from importlib import metadata

    from megatron_zpp.testing.zero_bench import systems

    def not_installed(name):
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(metadata, "version", not_installed)
    why = systems.deepspeed_refusal()
    assert (
        why.startswith("deepspeed is not installed") and "install with bash bench/setup.sh" in why and "\n" not in why
    )

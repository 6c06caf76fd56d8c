"""The gradient reduction schedule is fixed by the program, not the data; --grad-reduce-in-bf16.

A toy chunk (embedding, three residual blocks, head) on 2 gloo ranks, 2 micro-batches per
rank, under every engine (plain DP with small buckets, ZeRO-1 with and without overlap,
ZeRO-2, ZeRO-3, ZeRO-3 keeping its weights for the step). Each case's reduced gradients
equal a single-process reference (autograd over all ranks' micro-batches, summed, / DP):

* a block unused in the last micro-batch of step 1 (its gradient must not be lost, nor
  leak into step 2: the probe once gave 3.0 for a true 2.0);
* a frozen block and a frozen norm bias (requires_grad=False): the engine builds, never
  reduces a wholly frozen unit (the ledger counts one reduction per trainable unit per
  micro-batch) and never steps a frozen weight;
* ranks whose micro-batches skip different blocks: the same collectives in the same order
  on both (no hang), and --check-collective-order's hashes agree.

The same cases with --grad-reduce-in-bf16 (plain DP, ZeRO-1/2/3): 2 bytes per element on
the wire (half the fp32 run's ledger bytes), and each reduced gradient within bf16
round-off of the exact mean: |got - mean| <= u * sum_{r,m} |g_rm| elementwise, u = 2^-8,
g_rm the gradient of rank r's micro-batch m (each reduced gradient rounded once, each of
the n-1 partial sums once: n u sum_r |g_r| on a sum, to first order, so u sum_r |g_r| on
the mean whatever n; ZeRO-2/3 reduce each micro-batch, plain DP and ZeRO-1 their fp32
accumulation, which the bound covers as |sum_m g_rm| <= sum_m |g_rm|).
"""

import pytest
import torch
import torch.nn.functional as F

from megatron_zpp import comm
from megatron_zpp.config import OptimConfig, ZeroConfig
from megatron_zpp.model import GPTParts
from megatron_zpp.topology import Topology, build_groups
from megatron_zpp.zero import DDPEngine, ZeroEngine
from tests.dist import run_distributed

V, H, LAYERS, MB = 16, 8, 3, 2


class Toy(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embedding = torch.nn.Embedding(V, H)
        self.layers = torch.nn.ModuleDict({str(i): torch.nn.Linear(H, H) for i in range(LAYERS)})
        self.final_norm = torch.nn.LayerNorm(H)
        self.output = torch.nn.Linear(H, V, bias=False)
        self.pre_process = self.post_process = True
        self.tied = False

    def parts(self) -> GPTParts:  # what the engines walk, as of a GPT chunk
        return GPTParts(
            self.embedding, None, list(self.layers.items()), self.final_norm, self.output, False, True, True
        )

    def forward(self, tokens, skip=()):
        h = self.embedding(tokens)
        for i, layer in self.layers.items():
            if int(i) not in skip:
                h = h + torch.tanh(layer(h))
        return F.cross_entropy(self.output(self.final_norm(h)).flatten(0, 1), tokens.flatten())


def tokens(step, rank, mb):
    return torch.randint(0, V, (2, 4), generator=torch.Generator().manual_seed(100 * step + 10 * rank + mb))


# per case: skips[step][rank][micro-batch] = the blocks that micro-batch does not use
ALL = [[(), ()], [(), ()]]
CASES = {
    "unused_in_last": [[[(), (1,)], [(), (1,)]], ALL],
    "ranks_differ": [[[(2,), ()], [(), (0,)]], [[(), (1, 2)], [(0,), ()]]],
    "frozen": [ALL, ALL],
}
ENGINES = {
    "ddp": dict(zero_stage=0, ddp_bucket_size=50),
    "zero1": dict(zero_stage=1),
    "zero1_no_overlap": dict(zero_stage=1, overlap_grad_reduce=False),
    "zero2": dict(zero_stage=2),
    "zero3": dict(zero_stage=3),
    "zero3_per_step": dict(zero_stage=3, zero_param_persistence="step"),
    "zero3_whole_chain": dict(zero_stage=3),  # the accelerator's schedule: each chain enqueued at once
    **{
        f"{name}_bf16": dict(
            zero_stage=stage, grad_reduce_in_bf16=True, **({"ddp_bucket_size": 50} if not stage else {})
        )
        for name, stage in (("ddp", 0), ("zero1", 1), ("zero2", 2), ("zero3", 3))
    },
}
BF16_U = 2.0**-8  # bf16's unit round-off (8 significant bits)


def freeze(model):
    for p in model.layers["1"].parameters():
        p.requires_grad_(False)
    model.final_norm.bias.requires_grad_(False)


def reduced_grads(engine, model, group) -> dict[str, torch.Tensor]:
    """The engine's reduced (mean over DP) gradient of every trainable parameter, in full."""
    if isinstance(engine, DDPEngine):
        engine.grads.finish()
        return {n: p.main_grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    engine._finish_grads()
    out, names = {}, {id(p): n for n, p in model.named_parameters()}
    for u in engine.units:
        full = torch.empty(u.padded)
        comm.all_gather(full, u.grad_shard, group, "test")
        for p, off, n, view in zip(u.params, u.offsets, u.numels, u._views):
            if p.requires_grad:
                out[names[id(p)]] = full[off : off + n].view(view.shape)
    return out


def _run(rank, world, case):
    groups = build_groups(Topology(world), rank)
    return {name: _train(rank, world, case, name, groups) for name in ENGINES}


def _train(rank, world, case, engine_name, groups):
    model, ref = Toy(), Toy()
    if case == "frozen":
        freeze(model), freeze(ref)
    frozen_before = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    zcfg = ZeroConfig(**{"overlap_grad_reduce": True, **ENGINES[engine_name]})
    ocfg = OptimConfig(clip_grad=1e9)
    engine = (DDPEngine if zcfg.zero_stage == 0 else ZeroEngine)([model], groups, ocfg, zcfg)
    if engine_name.endswith("whole_chain"):
        engine.enqueue_whole_chain = True
    comm.ORDER.enabled = True
    out = []
    for step, skips in enumerate(CASES[case]):
        engine.zero_grad()
        comm.LEDGER.reset()
        for mb in range(MB):
            engine.set_last_micro_batch(0, mb == MB - 1)
            model(tokens(step, rank, mb), skips[rank][mb]).backward()
        calls = sum(r.calls for k, r in comm.LEDGER.records.items() if k[1].startswith("zero_grad"))
        wire = sum(r.bytes for k, r in comm.LEDGER.records.items() if k[1].startswith(("zero_grad", "grad_")))
        got = reduced_grads(engine, model, groups.dp_cp)
        comm.check_collective_order(groups)
        grads = []  # each rank's and micro-batch's gradient, computed here in one process
        for r in range(world):
            for mb in range(MB):
                ref.zero_grad()
                ref(tokens(step, r, mb), skips[r][mb]).backward()
                grads.append(
                    {
                        n: torch.zeros_like(p) if p.grad is None else p.grad.clone()
                        for n, p in ref.named_parameters()
                        if p.requires_grad
                    }
                )
        want = {n: sum(g[n] for g in grads) / world for n in grads[0]}
        abs_sum = {n: sum(g[n].abs() for g in grads) for n in grads[0]}
        out.append((got, want, calls, wire, abs_sum))
        if step == 0:  # a real step between the two: frozen weights must not move
            engine.step(0.01)
            with engine.full_parameters():  # the step moved the weights: the reference takes them for step 2
                moved = {n: p.detach().clone() for n, p in model.named_parameters() if n in frozen_before}
                ref.load_state_dict({n: p.detach().clone() for n, p in model.named_parameters()})
    return out, {n: (frozen_before[n], moved[n]) for n in frozen_before}


@pytest.mark.parametrize("case", list(CASES))
def test_reduced_gradients_equal_the_reference(case):
    per_rank = run_distributed(_run, 2, case, timeout=300)
    for engine_name in ENGINES:
        for res in per_rank:
            steps, frozen = res[engine_name]
            for step, (got, want, calls, wire, abs_sum) in enumerate(steps):
                assert set(got) == set(want), (engine_name, step)
                for n, w in want.items():
                    if engine_name.endswith("_bf16"):  # each rank's gradient and each partial sum rounded to bf16
                        bound = BF16_U * abs_sum[n] + 1e-7  # first order: u * sum |g_rm| on the mean, any n
                        assert ((got[n] - w).abs() <= bound).all(), f"{engine_name} {step} {n}"
                    else:
                        torch.testing.assert_close(got[n], w, rtol=1e-5, atol=1e-7, msg=f"{engine_name} {step} {n}")
                if engine_name.endswith("_bf16"):  # 2 bytes per element on the wire, the fp32 run's half
                    assert wire == res[engine_name.removesuffix("_bf16")][0][step][3] / 2, engine_name
                if engine_name in (
                    "zero2",
                    "zero3",
                    "zero3_per_step",
                    "zero3_whole_chain",
                ):  # one reduce per trainable unit per mb
                    trainable_units = 1 + LAYERS + 1 - (case == "frozen")
                    assert calls == trainable_units * MB, (engine_name, case, calls)
            for n, (before, after) in frozen.items():
                torch.testing.assert_close(after, before, rtol=0, atol=0, msg=f"{engine_name}: frozen {n} moved")
            assert (case == "frozen") == bool(frozen)


def _diverge(rank, world):
    groups = build_groups(Topology(world), rank)
    comm.ORDER.enabled = True
    x = torch.ones(4)
    comm.all_reduce(x, groups.dp_cp, "same")
    comm.check_collective_order(groups)  # agrees
    comm.all_reduce(x, groups.dp_cp, "same")
    comm.all_reduce(x, groups.dp_cp, "phase_a" if rank == 0 else "phase_b")
    try:
        comm.check_collective_order(groups)
    except RuntimeError as e:
        return str(e)
    return None


def test_check_collective_order_names_the_first_divergence():
    for msg in run_distributed(_diverge, 2, timeout=60):
        assert msg is not None and "collective #1" in msg and "phase_a" in msg and "phase_b" in msg, msg

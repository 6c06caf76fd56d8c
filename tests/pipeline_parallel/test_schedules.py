"""Order of micro-batches in the 1F1B and interleaved 1F1B schedules, on a fake stage
and a fake link (no processes): each rank's schedule is checked on its own against
Megatron's rules, written out here, and so is the last-micro-batch announcement before
each backward (which lets the data-parallel engine overlap its gradient reduction)."""

from types import SimpleNamespace

import pytest
import torch

from megatron_zpp.pipeline_parallel.schedules import Stage, forward_backward_1f1b, forward_backward_interleaved


class FakeLink:
    """Hands out a fresh activation / gradient for every receive and remembers them."""

    def __init__(self, pp, rank):
        self.pp = SimpleNamespace(size=pp, rank=rank)
        self.acts, self.grads = [], []

    def exchange(self, send_next=None, send_prev=None, recv_prev=False, recv_next=False):
        act = torch.zeros(1, requires_grad=True) if recv_prev else None
        grad = torch.ones(1) if recv_next else None
        self.acts += [act] if recv_prev else []
        self.grads += [grad] if recv_next else []
        return act, grad


class FakeStage:
    """Records ("F", chunk, i) / ("B", chunk, i), i = the micro-batch's index within its chunk."""

    def __init__(self, num_chunks, m, forward_only=False):
        self.chunks, self.m, self.forward_only, self.losses = [None] * num_chunks, m, forward_only, []
        self.events, self.hiddens, self.out_grads, self.pairing_ok = [], [], [], True
        self.backwards, self.announced = [0] * num_chunks, []  # (chunk, last micro-batch?) before each backward
        self.on_backward = lambda c, last: self.announced.append((c, last))

    announce_backward = Stage.announce_backward  # the real counting, reported to on_backward

    def forward(self, chunk_id, hidden):
        i = sum(1 for e in self.events if e[:2] == ("F", chunk_id))
        self.events.append(("F", chunk_id, i))
        self.hiddens.append(hidden)
        return SimpleNamespace(chunk=chunk_id, index=i, hidden=hidden)

    def backward(self, hidden, out, grad):
        self.events.append(("B", out.chunk, out.index))
        self.pairing_ok &= hidden is out.hidden  # the input its own forward received
        self.out_grads.append(grad)
        return None if hidden is None else torch.ones(1)


def run(pp, rank, V, m, forward_only=False):
    link, stage = FakeLink(pp, rank), FakeStage(V, m, forward_only)
    if V == 1:
        forward_backward_1f1b(stage, link)
    else:
        forward_backward_interleaved(stage, link)
    return stage, link


def forwards(stage):
    return [e[1:] for e in stage.events if e[0] == "F"]


def backwards(stage):
    return [e[1:] for e in stage.events if e[0] == "B"]


def warmup_count(stage):
    return next(i for i, e in enumerate(stage.events) if e[0] == "B")


def megatron_order(pp, V, m, forward):
    """Virtual micro-batch k: chunk (k % (pp V)) // pp (reversed for backwards), micro-batch
    (k // (pp V)) pp + k % pp: groups of pp consecutive micro-batches per chunk."""
    out = []
    for k in range(m * V):
        c = (k % (pp * V)) // pp
        out.append((c if forward else V - 1 - c, (k // (pp * V)) * pp + k % pp))
    return out


def megatron_warmup(pp, rank, V, m):
    if m == pp:  # Megatron runs every forward first when M == PP
        return m * V
    return min((pp - rank - 1) * 2 + (V - 1) * pp, m * V)


CASES = [(pp, rank, V, m) for pp in (2, 4) for V in (2, 3) for m in (pp, 2 * pp, 3 * pp) for rank in range(pp)]
CASES_1F1B = [(pp, rank, m) for pp in (2, 4) for m in (1, pp - 1, pp, 2 * pp + 1) for rank in range(pp)]


def check_each_once_backward_after_forward(stage, V, m):
    every = sorted((c, i) for c in range(V) for i in range(m))
    assert sorted(forwards(stage)) == every
    assert sorted(backwards(stage)) == every
    done = set()
    for kind, c, i in stage.events:
        if kind == "F":
            done.add((c, i))
        else:
            assert (c, i) in done, f"backward of {(c, i)} before its forward"
    for c in range(V):  # activations of a chunk are freed first in, first out
        assert [i for cc, i in backwards(stage) if cc == c] == [i for cc, i in forwards(stage) if cc == c]
    assert stage.pairing_ok
    # before each backward the engine hears its chunk and whether it is the chunk's last micro-batch
    assert stage.announced == [(c, i == m - 1) for c, i in backwards(stage)]


def check_every_received_tensor_is_used(stage, link, pp, rank, V):
    # each received activation feeds exactly one forward, each received grad one backward:
    # a count mismatch here would be a hang (or a mixed-up tensor) between real stages
    used_acts = [h for h in stage.hiddens if h is not None]
    used_grads = [g for g in stage.out_grads if g is not None]
    assert [id(t) for t in used_acts] == [id(t) for t in link.acts]
    assert sorted(map(id, used_grads)) == sorted(map(id, link.grads))
    # only the very first chunk has no input, only the loss chunk no incoming grad
    first, last = rank == 0, rank == pp - 1
    assert all((h is None) == (first and c == 0) for h, (c, _) in zip(stage.hiddens, forwards(stage)))
    assert all((g is None) == (last and c == V - 1) for g, (c, _) in zip(stage.out_grads, backwards(stage)))


@pytest.mark.parametrize("pp,rank,V,m", CASES)
def test_interleaved_runs_each_chunk_microbatch_once_in_megatron_order(pp, rank, V, m):
    stage, link = run(pp, rank, V, m)
    check_each_once_backward_after_forward(stage, V, m)
    assert forwards(stage) == megatron_order(pp, V, m, forward=True)
    assert backwards(stage) == megatron_order(pp, V, m, forward=False)
    check_every_received_tensor_is_used(stage, link, pp, rank, V)


def test_interleaved_forward_chunks_come_in_groups_of_pp():
    stage, _ = run(pp=2, rank=0, V=2, m=4)
    assert [c for c, _ in forwards(stage)] == [0, 0, 1, 1, 0, 0, 1, 1]
    assert [c for c, _ in backwards(stage)] == [1, 1, 0, 0, 1, 1, 0, 0]


@pytest.mark.parametrize("pp,rank,V,m", CASES)
def test_interleaved_warmup_then_one_forward_one_backward(pp, rank, V, m):
    stage, _ = run(pp, rank, V, m)
    w, total = megatron_warmup(pp, rank, V, m), m * V
    # the first steady step forwards before it backwards: one more forward before the first B
    assert warmup_count(stage) == (w + 1 if w < total else total)
    # after warm-up: alternate F, B for the remaining forwards, then drain the backwards
    kinds = [e[0] for e in stage.events]
    assert kinds == ["F"] * w + ["F", "B"] * (total - w) + ["B"] * w


@pytest.mark.parametrize("pp,rank,m", CASES_1F1B)
def test_1f1b_warmup_alternation_and_live_activations(pp, rank, m):
    stage, link = run(pp, rank, 1, m)
    check_each_once_backward_after_forward(stage, 1, m)
    assert forwards(stage) == [(0, i) for i in range(m)]
    # pp - rank - 1 warm-up forwards, then F, B pairs, then the remaining backwards
    w = min(pp - rank - 1, m)
    assert warmup_count(stage) == min(pp - rank, m)
    assert [e[0] for e in stage.events] == ["F"] * w + ["F", "B"] * (m - w) + ["B"] * w
    alive = peak = 0
    for kind, _, _ in stage.events:
        alive += 1 if kind == "F" else -1
        peak = max(peak, alive)
    assert peak == min(pp - rank, m)
    check_every_received_tensor_is_used(stage, link, pp, rank, 1)


@pytest.mark.parametrize(
    "pp,rank,V,m", [(2, 0, 1, 3), (2, 1, 1, 3), (4, 2, 1, 4), (2, 0, 2, 4), (4, 3, 2, 8), (4, 1, 2, 4)]
)
def test_forward_only_runs_only_forwards_in_order(pp, rank, V, m):
    stage, link = run(pp, rank, V, m, forward_only=True)
    assert all(e[0] == "F" for e in stage.events)
    order = [(0, i) for i in range(m)] if V == 1 else megatron_order(pp, V, m, forward=True)
    assert forwards(stage) == order
    assert link.grads == []
    assert [id(h) for h in stage.hiddens if h is not None] == [id(t) for t in link.acts]

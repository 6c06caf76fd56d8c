"""megatron_zpp/comm.py: every wrapper gives the right result on gloo ranks, and the ledger
records the bytes of the closed forms in comm.py's docstring under the right link class.

Each multi-rank run records, per operation, this rank's result and a snapshot of the
ledger (reset before the operation); the tests below check both against values computed
here. Two runs in all (2 and 4 ranks), so the module stays fast.
"""

import json
import os

import pytest
import torch

from megatron_zpp import comm
from megatron_zpp.comm import CommLedger, model_bytes
from megatron_zpp.topology import Group, Topology, build_groups
from tests.dist import run_distributed

F32 = 4  # bytes per element


# ------------------------------------------------------------------ closed forms, stated


def ring_all_reduce(n, B):
    return 2 * (n - 1) / n * B


def ring_fraction(n, B):  # all-gather (B_out), reduce-scatter (B_in), all-to-all, broadcast
    return (n - 1) / n * B


# ------------------------------------------------------------------ in-rank driver


def _snap():
    """The ledger as plain data: {(role, phase, op, link): (bytes, gloo_bytes, calls)}."""
    return {k: (r.bytes, r.gloo_bytes, r.calls) for k, r in comm.LEDGER.records.items()}


def _exercise(g, rank, phase):
    """Run every wrapper over Group g; return {op: (result, ledger snapshot)}."""
    n, me = g.size, g.rank
    out = {}

    comm.LEDGER.reset()
    t = torch.arange(6, dtype=torch.float32) + 10 * rank
    comm.all_reduce(t, g, phase)
    out["all_reduce"] = (t.tolist(), _snap())

    comm.LEDGER.reset()
    inp = (torch.arange(6, dtype=torch.float32) + 100 * rank).reshape(2, 3)
    o = torch.empty(2 * n, 3)
    comm.all_gather(o, inp, g, phase)
    out["all_gather"] = (o.tolist(), _snap())

    comm.LEDGER.reset()
    inp = torch.arange(2 * n, dtype=torch.float32) * (rank + 1)
    o = torch.empty(2)
    comm.reduce_scatter(o, inp, g, phase)
    out["reduce_scatter"] = (o.tolist(), _snap())

    comm.LEDGER.reset()
    inp = torch.arange(2 * n, dtype=torch.float32) + 100 * rank
    o = torch.empty(2 * n)
    comm.all_to_all(o, inp, g, phase)
    out["all_to_all"] = (o.tolist(), _snap())

    comm.LEDGER.reset()
    t = torch.full((5,), float(rank))
    comm.broadcast(t, 1 % n, g, phase)  # from group rank 1 (0 for a size-1 group)
    out["broadcast"] = (t.tolist(), _snap())

    comm.LEDGER.reset()
    if n > 1:  # ring: send to the next group rank, receive from the previous one
        recv = torch.empty(7)
        sendbuf = torch.full((7,), float(rank))
        reqs = comm.p2p([comm.Send(sendbuf, (me + 1) % n), comm.Recv(recv, (me - 1) % n)], g, phase)
        for r in reqs:
            r.wait()
        out["p2p"] = (recv.tolist(), _snap())

        comm.LEDGER.reset()
        buf = torch.full((3,), float(rank))
        if me == 0:
            comm.send(buf, 1, g, phase).wait()
        elif me == 1:
            comm.recv(buf, 0, g).wait()
        out["send"] = (buf.tolist(), _snap())

    comm.LEDGER.reset()
    t = torch.ones(4) * (rank + 1)
    h = comm.all_reduce(t, g, phase, async_op=True)
    h.wait()
    out["all_reduce_async"] = (t.tolist(), _snap())
    return out


def _comm_2ranks(rank, world_size):
    comm.LEDGER.reset()
    topo = Topology(world_size, ranks_per_node=2)  # one node
    g = build_groups(topo, rank)
    res = {"dp": _exercise(g.dp, rank, "fwd"), "pp": _exercise(g.pp, rank, "fwd")}
    res["groups"] = {"dp": list(g.dp.ranks), "pp": list(g.pp.ranks)}
    # tagged streams between the same pair, one with its own ledger phase
    comm.LEDGER.reset()
    a, b = torch.empty(2), torch.empty(3)
    peer = 1 - g.dp.rank
    for r in comm.p2p(
        [
            comm.Send(torch.full((2,), 10.0 + rank), peer, 5, "act"),
            comm.Send(torch.full((3,), 20.0 + rank), peer, 6),
            comm.Recv(b, peer, 6),
            comm.Recv(a, peer, 5),
        ],
        g.dp,
        "grad",
    ):
        r.wait()
    res["tagged"] = (a.tolist(), b.tolist(), _snap())
    return res


def _comm_4ranks(rank, world_size, report_dir):
    comm.LEDGER.reset()
    # two emulated nodes of 2 ranks: tp {0,1},{2,3} intra_node; dp {0,2},{1,3} inter_node
    g = build_groups(Topology(world_size, tp=2, ranks_per_node=2), rank)
    # flat DP over all 4 ranks (inter_node), whose p2p peers are on either node
    flat = build_groups(Topology(world_size, ranks_per_node=2), rank)
    res = {
        "tp": _exercise(g.tp, rank, "bwd"),
        "dp": _exercise(g.dp, rank, "bwd"),
        "world": _exercise(flat.dp, rank, "fwd"),
    }
    res["groups"] = {"tp": list(g.tp.ranks), "dp": list(g.dp.ranks), "world": list(flat.dp.ranks)}
    res["uneven"] = _uneven(flat.dp, rank)

    # a report over two steps: all-reduce 1 KiB over all ranks twice, and a p2p ring twice
    comm.LEDGER.reset()
    for _ in range(2):
        comm.all_reduce(torch.zeros(256), flat.dp, "grad")
        recv = torch.empty(64)
        for r in comm.p2p(
            [comm.Send(torch.zeros(64), (rank + 1) % 4), comm.Recv(recv, (rank - 1) % 4)], flat.dp, "act"
        ):
            r.wait()
        comm.LEDGER.step()
    res["total_all"] = comm.LEDGER.total()
    res["total_send"] = comm.LEDGER.total(op="send")
    res["total_grad_inter"] = comm.LEDGER.total(phase="grad", link="inter_node")
    res["report"] = comm.gather_report(world_size)
    comm.write_report(os.path.join(report_dir, f"report_{rank}.json"), world_size, rank)
    return res


def _rows(src: int, dst: int) -> torch.Tensor:
    """The rows rank `src` sends rank `dst` in the uneven exchange: src + 2 dst rows (0 for src 0 to dst 0),
    each [src, dst, row index]."""
    n = src + 2 * dst
    return torch.tensor([[src, dst, i] for i in range(n)], dtype=torch.float32).reshape(n, 3)


def _uneven(group, rank):
    """all_to_all with split sizes, all_gather_v and reduce_scatter_v on 4 ranks; ledger and order records."""
    comm.LEDGER.reset()
    comm.ORDER.keep, comm.ORDER.seq = True, type(comm.ORDER.seq)(list)
    send = torch.cat([_rows(rank, j) for j in range(4)])
    recv = torch.empty(sum(len(_rows(j, rank)) for j in range(4)), 3)
    out_splits, in_splits = [len(_rows(j, rank)) for j in range(4)], [len(_rows(rank, j)) for j in range(4)]
    comm.all_to_all(recv, send, group, "moe_dispatch", output_split_sizes=out_splits, input_split_sizes=in_splits)
    counts = [1, 3, 0, 2]
    mine = torch.full((counts[rank], 2), float(rank))
    gathered = comm.all_gather_v(mine, counts, group, "moe_etp")
    full = torch.arange(6 * 2, dtype=torch.float32).view(6, 2) * (rank + 1)
    scattered = comm.reduce_scatter_v(full, counts, group, "moe_etp")
    order = comm.ORDER.seq.pop((group.role, group.ranks))
    comm.ORDER.keep = False
    ledger = {k[1] + "/" + k[2]: (r.bytes, r.gloo_bytes) for k, r in comm.LEDGER.records.items()}
    return recv.tolist(), gathered.tolist(), scattered.tolist(), ledger, order


@pytest.fixture(scope="module")
def two_ranks():
    return run_distributed(_comm_2ranks, 2)


@pytest.fixture(scope="module")
def report_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("comm_report"))


@pytest.fixture(scope="module")
def four_ranks(report_dir):
    return run_distributed(_comm_4ranks, 4, report_dir)


# ------------------------------------------------------------------ expected results


def expected(op, ranks, me):
    """The result group rank `me` should hold, computed from the inputs in _exercise."""
    n = len(ranks)
    r = ranks[me]
    if op == "all_reduce":
        return [float(sum(i + 10 * q for q in ranks)) for i in range(6)]
    if op == "all_gather":
        return [[float(100 * q + 3 * row + c) for c in range(3)] for q in ranks for row in range(2)]
    if op == "reduce_scatter":
        return [float(sum((2 * me + j) * (q + 1) for q in ranks)) for j in range(2)]
    if op == "all_to_all":
        return [float(100 * q + 2 * me + j) for q in ranks for j in range(2)]
    if op == "broadcast":
        return [float(ranks[1 % n])] * 5
    if op == "p2p":
        return [float(ranks[(me - 1) % n])] * 7
    if op == "send":
        return [float(ranks[0])] * 3 if me == 1 else [float(r)] * 3
    if op == "all_reduce_async":
        return [float(sum(q + 1 for q in ranks))] * 4
    raise KeyError(op)


def expected_ledger(op, role, phase, link, ranks, me, peer_link=None):
    """{key: (bytes, gloo_bytes, calls)} this rank's ledger should hold after `op`."""
    n = len(ranks)
    if n == 1:
        return {}
    if op in ("all_reduce", "all_reduce_async"):
        B = (6 if op == "all_reduce" else 4) * F32
        return {(role, phase, "all_reduce", link): (ring_all_reduce(n, B), ring_all_reduce(n, B), 1)}
    if op == "all_gather":
        B_out = 6 * n * F32
        return {(role, phase, "all_gather", link): (ring_fraction(n, B_out), ring_fraction(n, B_out), 1)}
    if op == "reduce_scatter":
        B_in = 2 * n * F32
        # on gloo: an all-to-all and a local sum, the bytes of a ring reduce-scatter (not gloo's all-reduce)
        return {(role, phase, "reduce_scatter", link): (ring_fraction(n, B_in), ring_fraction(n, B_in), 1)}
    if op == "all_to_all":
        B = 2 * n * F32
        return {(role, phase, "all_to_all", link): (ring_fraction(n, B), ring_fraction(n, B), 1)}
    if op == "broadcast":
        B = 5 * F32
        return {(role, phase, "broadcast", link): (ring_fraction(n, B), ring_fraction(n, B), 1)}
    if op == "p2p":
        return {(role, phase, "send", peer_link): (7 * F32, 7 * F32, 1)}
    if op == "send":
        return {(role, phase, "send", peer_link): (3 * F32, 3 * F32, 1)} if me == 0 else {}
    raise KeyError(op)


OPS = ["all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "p2p", "send", "all_reduce_async"]


def node2(r):  # ranks_per_node=2
    return r // 2


def check_run(results, role_key, role, phase, link):
    for rank, res in enumerate(results):
        ranks = res["groups"][role_key]
        me = ranks.index(rank)
        got = res[role_key]
        for op in OPS:
            if len(ranks) == 1 and op in ("p2p", "send"):
                assert op not in got
                continue
            value, ledger = got[op]
            assert value == expected(op, ranks, me), (role_key, op, rank)
            peer = ranks[(me + 1) % len(ranks)]
            peer_link = "intra_node" if node2(peer) == node2(rank) else "inter_node"
            assert ledger == expected_ledger(op, role, phase, link, ranks, me, peer_link), (role_key, op, rank)


# ------------------------------------------------------------------ 2 ranks


def test_two_ranks_groups(two_ranks):
    assert [r["groups"]["dp"] for r in two_ranks] == [[0, 1], [0, 1]]
    assert [r["groups"]["pp"] for r in two_ranks] == [[0], [1]]


def test_two_ranks_results_and_ledger(two_ranks):
    check_run(two_ranks, "dp", "dp", "fwd", "intra_node")


def test_two_ranks_concrete_bytes(two_ranks):
    # the closed forms at n=2, with numbers: all-reduce of 24 B sends 24 B; all-gather of
    # 48 B out sends 24 B; reduce-scatter of 16 B in sends 8 B (gloo too: all-to-all + sum); p2p 28 B
    dp = two_ranks[0]["dp"]
    assert dp["all_reduce"][1] == {("dp", "fwd", "all_reduce", "intra_node"): (24.0, 24.0, 1)}
    assert dp["all_gather"][1] == {("dp", "fwd", "all_gather", "intra_node"): (24.0, 24.0, 1)}
    assert dp["reduce_scatter"][1] == {("dp", "fwd", "reduce_scatter", "intra_node"): (8.0, 8.0, 1)}
    assert dp["all_to_all"][1] == {("dp", "fwd", "all_to_all", "intra_node"): (8.0, 8.0, 1)}
    assert dp["broadcast"][1] == {("dp", "fwd", "broadcast", "intra_node"): (10.0, 10.0, 1)}
    assert dp["p2p"][1] == {("dp", "fwd", "send", "intra_node"): (28.0, 28.0, 1)}


def test_p2p_tags_and_phase_override(two_ranks):
    for rank, res in enumerate(two_ranks):
        a, b, ledger = res["tagged"]
        assert a == [10.0 + (1 - rank)] * 2
        assert b == [20.0 + (1 - rank)] * 3
        assert ledger == {
            ("dp", "act", "send", "intra_node"): (8.0, 8.0, 1),
            ("dp", "grad", "send", "intra_node"): (12.0, 12.0, 1),
        }


def test_size1_group_copies_and_records_nothing(two_ranks):
    for rank, res in enumerate(two_ranks):
        pp = res["pp"]
        assert pp["all_reduce"] == ([float(i + 10 * rank) for i in range(6)], {})
        assert pp["all_gather"] == ([[100.0 * rank + 3 * row + c for c in range(3)] for row in range(2)], {})
        assert pp["reduce_scatter"] == ([0.0, float(rank + 1)], {})
        assert pp["all_to_all"] == ([100.0 * rank, 100.0 * rank + 1], {})
        assert pp["broadcast"] == ([float(rank)] * 5, {})
        assert pp["all_reduce_async"] == ([float(rank + 1)] * 4, {})
    check_run(two_ranks, "pp", "pp", "fwd", "intra_node")


# ------------------------------------------------------------------ 4 ranks, two emulated nodes


def test_four_ranks_groups(four_ranks):
    assert [r["groups"]["tp"] for r in four_ranks] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [r["groups"]["dp"] for r in four_ranks] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    assert all(r["groups"]["world"] == [0, 1, 2, 3] for r in four_ranks)


def test_four_ranks_intra_node_group(four_ranks):
    check_run(four_ranks, "tp", "tp", "bwd", "intra_node")


def test_four_ranks_inter_node_group(four_ranks):
    check_run(four_ranks, "dp", "dp", "bwd", "inter_node")
    # p2p inside {0,2}: the peer is on the other node
    for res in four_ranks:
        assert set(res["dp"]["p2p"][1]) == {("dp", "bwd", "send", "inter_node")}


def test_four_ranks_world_group(four_ranks):
    check_run(four_ranks, "world", "dp", "fwd", "inter_node")
    # ring 0->1->2->3->0 over two nodes of 2: 0->1 and 2->3 stay on the node, 1->2 and 3->0 cross
    links = [next(iter(r["world"]["p2p"][1]))[3] for r in four_ranks]
    assert links == ["intra_node", "inter_node", "intra_node", "inter_node"]
    # n=4: all-reduce of 24 B sends 2*3/4*24 = 36 B; reduce-scatter of 32 B in: 24 B
    r0 = four_ranks[0]["world"]
    assert r0["all_reduce"][1][("dp", "fwd", "all_reduce", "inter_node")] == (36.0, 36.0, 1)
    assert r0["reduce_scatter"][1][("dp", "fwd", "reduce_scatter", "inter_node")] == (24.0, 24.0, 1)
    assert r0["all_gather"][1][("dp", "fwd", "all_gather", "inter_node")] == (72.0, 72.0, 1)


def test_ledger_total_and_steps_in_run(four_ranks):
    ar = 2 * ring_all_reduce(4, 256 * F32)  # 2 steps x 1536 B
    sends = 2 * 64 * F32
    for res in four_ranks:
        assert res["total_grad_inter"] == ar == 3072.0
        assert res["total_send"] == sends
        assert res["total_all"] == ar + sends


def test_gather_report_shape_and_values(four_ranks):
    reports = [r["report"] for r in four_ranks]
    assert all(rep == reports[0] for rep in reports[1:])  # collective: every rank gets the same
    rep = reports[0]
    assert rep["world_size"] == 4 and rep["steps"] == 2
    assert isinstance(rep["byte_model"], str)
    recs = {(r["role"], r["phase"], r["op"], r["link"]): r for r in rep["records"]}
    assert set(recs) == {
        ("dp", "grad", "all_reduce", "inter_node"),
        ("dp", "act", "send", "intra_node"),
        ("dp", "act", "send", "inter_node"),
    }
    for r in rep["records"]:
        assert {
            "role",
            "phase",
            "op",
            "link",
            "bytes_per_rank_per_step",
            "gloo_bytes_per_rank_per_step",
            "max_rank_bytes_per_step",
            "calls_per_step",
        } <= set(r)
    ar = recs[("dp", "grad", "all_reduce", "inter_node")]
    assert ar["bytes_per_rank_per_step"] == pytest.approx(1536.0)
    assert ar["gloo_bytes_per_rank_per_step"] == pytest.approx(1536.0)
    assert ar["max_rank_bytes_per_step"] == pytest.approx(1536.0)
    assert ar["calls_per_step"] == 1
    # sends of 256 B per step: only ranks 0 and 2 send on the node -> mean over 4 ranks = 128 B
    for link in ("intra_node", "inter_node"):
        s = recs[("dp", "act", "send", link)]
        assert s["bytes_per_rank_per_step"] == pytest.approx(128.0)
        assert s["max_rank_bytes_per_step"] == pytest.approx(256.0)
        assert s["calls_per_step"] == 1


def test_write_report_on_rank0_only(four_ranks, report_dir):
    path = os.path.join(report_dir, "report_0.json")
    with open(path) as fh:
        written = json.load(fh)
    assert written["world_size"] == 4 and written["steps"] == 2
    assert written["records"] == four_ranks[0]["report"]["records"]
    for r in (1, 2, 3):
        assert not os.path.exists(os.path.join(report_dir, f"report_{r}.json"))


# ------------------------------------------------------------------ ledger, in process


def test_model_bytes_closed_forms():
    assert model_bytes("all_reduce", 4, 1000) == 1500.0
    assert model_bytes("all_reduce", 2, 1000) == 1000.0
    assert model_bytes("all_gather", 4, 1000) == 750.0
    assert model_bytes("reduce_scatter", 8, 1000) == 875.0
    assert model_bytes("all_to_all", 2, 1000) == 500.0
    assert model_bytes("broadcast", 5, 1000) == 800.0
    assert model_bytes("send", 2, 1000) == 1000.0
    for op in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "send"):
        assert model_bytes(op, 1, 1000) == 0.0


def test_ledger_add_total_step_reset():
    led = CommLedger()
    led.add("dp", "bwd", "reduce_scatter", "inter_node", 4, 400, gloo_op="all_reduce")  # 300 B, gloo 600 B
    led.add("dp", "bwd", "reduce_scatter", "inter_node", 4, 400, gloo_op="all_reduce")
    led.add("tp", "fwd", "all_reduce", "intra_node", 2, 100)  # 100 B
    led.add("pp", "fwd", "send", "inter_node", 2, 50)  # 50 B
    assert led.total() == 750.0
    assert led.total(role="dp") == 600.0
    assert led.total(link="inter_node") == 650.0
    assert led.total(phase="fwd", link="inter_node") == 50.0
    assert led.total(op="all_gather") == 0.0
    rec = led.records[("dp", "bwd", "reduce_scatter", "inter_node")]
    assert (rec.bytes, rec.gloo_bytes, rec.calls) == (600.0, 1200.0, 2)
    led.step()
    led.step()
    assert led.steps == 2
    rows = {(r["role"], r["op"]): r for r in led.local_rows()}
    assert rows[("dp", "reduce_scatter")]["bytes"] == 300.0
    assert rows[("dp", "reduce_scatter")]["gloo_bytes"] == 600.0
    assert rows[("dp", "reduce_scatter")]["calls"] == 1.0
    led.reset()
    assert led.steps == 0 and led.total() == 0.0 and led.local_rows() == []


def test_gather_report_single_process(tmp_path):
    saved = dict(comm.LEDGER.records), comm.LEDGER.steps
    try:
        comm.LEDGER.reset()
        comm.LEDGER.add("dp", "grad", "all_reduce", "intra_node", 2, 64)
        comm.LEDGER.step()
        rep = comm.gather_report(1)
        assert rep["world_size"] == 1 and rep["steps"] == 1
        assert rep["records"] == [
            {
                "role": "dp",
                "phase": "grad",
                "op": "all_reduce",
                "link": "intra_node",
                "bytes_per_rank_per_step": 64.0,
                "gloo_bytes_per_rank_per_step": 64.0,
                "max_rank_bytes_per_step": 64.0,
                "calls_per_step": 1.0,
            }
        ]
        path = tmp_path / "r.json"
        comm.write_report(str(path), 1, 0)
        assert json.loads(path.read_text())["records"] == rep["records"]
        comm.write_report(str(tmp_path / "other.json"), 1, 1)
        assert not (tmp_path / "other.json").exists()
    finally:
        comm.LEDGER.reset()
        comm.LEDGER.records.update(saved[0])
        comm.LEDGER.steps = saved[1]


def test_skipped_calls_on_none_group():
    comm.LEDGER.reset()
    t = torch.ones(3)
    assert comm.all_reduce(t, None, "fwd") is None
    assert comm.all_reduce(t, None, "fwd", async_op=True).wait()
    assert comm.broadcast(t, 0, None, "fwd") is None
    out = torch.empty(2, 3)
    comm.all_gather(out, torch.arange(6.0).reshape(2, 3), None, "fwd")
    assert out.tolist() == [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]]
    comm.reduce_scatter(out, torch.arange(6.0) * 2, None, "fwd")
    assert out.tolist() == [[0.0, 2.0, 4.0], [6.0, 8.0, 10.0]]
    assert comm.LEDGER.total() == 0.0 and not comm.LEDGER.records


def test_uneven_all_to_all_gather_and_reduce_scatter(four_ranks):
    """Rows reach their destinations in source order; the ledger counts the rows sent to the other ranks
    (never the own slice) exactly, the padded all-gather and reduce-scatter their padded buffers; the
    order records are the same on every rank although the row counts differ."""
    counts = [1, 3, 0, 2]
    for rank, res in enumerate(four_ranks):
        recv, gathered, scattered, ledger, order = res["uneven"]
        assert recv == torch.cat([_rows(j, rank) for j in range(4)]).tolist()
        assert gathered == [[float(r)] * 2 for r in range(4) for _ in range(counts[r])]
        full = torch.arange(12, dtype=torch.float32).view(6, 2) * 10  # sum over ranks of (rank + 1)
        assert scattered == torch.split(full, counts)[rank].tolist()
        sent_rows = sum(rank + 2 * j for j in range(4) if j != rank)
        assert ledger["moe_dispatch/all_to_all"] == (sent_rows * 3 * 4, sent_rows * 3 * 4)
        assert ledger["moe_etp/all_gather"][0] == 3 / 4 * (4 * 3 * 2 * 4)  # padded to 3 rows per rank
        assert ledger["moe_etp/reduce_scatter"][0] == 3 / 4 * (4 * 3 * 2 * 4)
        assert order == four_ranks[0]["uneven"][4] and order[0] == "all_to_all moe_dispatch v*3 x float32"


def test_all_to_all_wants_both_split_lists():
    g = Group("ep", (0, 1), 0, "intra_node")
    with pytest.raises(ValueError, match="output_split_sizes and input_split_sizes"):
        comm.all_to_all(torch.empty(2), torch.empty(2), g, "x", output_split_sizes=[1, 1])

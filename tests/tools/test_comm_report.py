"""tools/comm_report.py --summary: the ledger's rows folded into their parallelism axis and link class, the
sums computed here by hand from a small report (TP and CP inside the node, ZeRO++'s qwZ forward gathers and
qgZ's cross-node hop across it, hpZ's backward gathers inside, control-plane phases apart)."""

import json

from tools import comm_report


def row(role, phase, op, link, b):
    return {"role": role, "phase": phase, "op": op, "link": link, "bytes_per_rank_per_step": b,
            "gloo_bytes_per_rank_per_step": b, "max_rank_bytes_per_step": b, "calls_per_step": 1.0}  # fmt: skip


REPORT = {
    "world_size": 8,
    "steps": 10,
    "byte_model": "real fabric",
    "records": [
        row("tp", "tp_fwd_allreduce", "all_reduce", "intra_node", 2048.0),
        row("tp", "tp_bwd_allreduce", "all_reduce", "intra_node", 1024.0),
        row("cp", "cp_allscan_fwd", "send", "intra_node", 512.0),
        row("dp_cp", "zero_fwd_allgather", "all_gather", "inter_node", 3072.0),
        row("dp_hpz", "zero_bwd_allgather", "all_gather", "intra_node", 4096.0),
        row("dp_tier1", "qgz_grad", "all_to_all", "inter_node", 1024.0),
        row("dp_cp", "grad_norm", "all_reduce", "inter_node", 8.0),
        row("world", "step_check", "all_reduce", "inter_node", 16.0),
    ],
}


def test_summary_folds_rows_by_axis_and_link(tmp_path, capsys):
    path = tmp_path / "comm.json"
    path.write_text(json.dumps(REPORT))
    comm_report.main([str(path), "--summary"])
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) <= 12  # one screen
    by_axis = {ln.split()[0]: ln for ln in lines[2:]}
    assert set(by_axis) == {"TP", "CP", "DP/ZeRO", "control", "total", "across"}
    assert by_axis["TP"].split()[1:5] == ["3.0", "KiB", "0", "B"]  # 2048 + 1024 intra, nothing across
    assert "tp_fwd_allreduce all_reduce 2.0 KiB" in by_axis["TP"]
    assert by_axis["DP/ZeRO"].split()[1:5] == ["4.0", "KiB", "4.0", "KiB"]  # hpZ inside; qwZ 3 KiB + qgZ 1 KiB across
    assert by_axis["control"].split()[1:5] == ["0", "B", "24", "B"]  # grad_norm and step_check: not DP traffic
    assert by_axis["total"].split()[1:5] == ["7.5", "KiB", "4.0", "KiB"]
    assert by_axis["across"] == "across nodes: 35% of the bytes: zero_fwd_allgather 3.0 KiB, qgz_grad 1.0 KiB"

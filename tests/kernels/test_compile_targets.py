"""The kernels the interpreter cannot vouch for compile for real GPUs: a subprocess without TRITON_INTERPRET
drives the real launch wrappers on meta tensors (megatron_zpp/testing/triton_aot.py) and compiles each
launch for sm_90 down to a cubin with ptxas. Claims: every launch below compiles (constexpr rules: a
module float read in a kernel is a NameError only here), spills no register, stays under the shared
memory limit and within the grid limits. The cases are the heaviest of each family at production shapes
(stochastic rounding, int4, the widest norm rows, fp32 cross-entropy at 256K vocab);
tools/kernel_aot_report.py covers every kernel, dtype and width on sm_80 and sm_90."""

import json
import os
import subprocess
import sys
from pathlib import Path

SCRIPT = r"""
import json
import torch
from megatron_zpp.testing import triton_aot as aot
from megatron_zpp.kernels import cross_entropy as C, norm as N, quantize as Q

M = torch.device("meta")
e = lambda *s, dtype=torch.float32: torch.empty(*s, device=M, dtype=dtype)
r, m4, m8 = 8, 64 * 65536, 2048 * 2048
w4 = e(r, 4 * (m4 // 64) + m4 // 2, dtype=torch.uint8)
w8 = e(r, 4 * (m8 // 2048) + m8, dtype=torch.uint8)
out = []
with aot.recording(90) as launches:
    Q.quantize(e(r, m4, dtype=torch.bfloat16), m4, 0, m4, r, m4, w4, 64, 4, 7)
    Q.quantize(e(r, m8), m8, 0, m8, r, m8, w8, 2048, 8, 7)
    Q.dequantize_sum_quantize(w4, e(r, 4 * (m4 // r // 64) + m4 // r // 2, dtype=torch.uint8), m4, r, m4 // r, 64, 4, 7)
    x, w = e(32768, 32768), e(32768)
    N.norm_fwd(x, w, w, 1e-5)
    N.norm_bwd(x, x, w, e(32768), e(32768))
    C.ce_bwd(e(8192, 262144), e(8192, dtype=torch.int64), e(8192), e(8192), inplace=True)
for launch in launches:
    c = aot.compile_launch(launch, 90)
    out.append(dict(kernel=launch.kernel, spills=c.spills, registers=c.registers, shared=c.shared,
                    grid=aot.grid_problems(launch)))
print(json.dumps(out))
"""


def test_heaviest_launches_compile_for_sm90_without_spills(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)  # a cached kernel prints no ptxas report
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[2])
    done = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(results) == 7  # the norm backward of wide rows is two launches
    for r in results:
        assert r["spills"] == 0 and r["shared"] <= 232448 and not r["grid"], r

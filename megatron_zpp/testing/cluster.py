"""The emulated 2-node cluster of the benches (bench/zero.py, bench/cp.py, bench/parallel.py),
tools/calibrate_cluster.py and examples/reproduce: two network namespaces joined by a veth pair
whose both ends are shaped with `tc qdisc ... tbf` (root and iproute2 needed; without them the
benches say so and run on loopback, unshaped). Ranks inside one namespace talk over its loopback
(unshaped), ranks across over the veth. A lock keeps one bench at a time: a second would remove
the first one's namespaces. `start_nodes` launches one torchrun per node in its namespace."""

from __future__ import annotations

import atexit
import fcntl
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

# the checkout this package is in (installed editable): the ranks run its pretrain_gpt.py
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PRETRAIN_GPT = os.path.join(REPO_ROOT, "pretrain_gpt.py")

NAMESPACES = ("zpp_n0", "zpp_n1")
VETHS = ("zppv0", "zppv1")
ADDRS = ("10.231.77.1", "10.231.77.2")
LOCK = "/tmp/zpp_zero_bench.lock"  # one bench at a time: a second would delete the first one's namespaces


def log(msg: str) -> None:
    print(f"[cluster {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def parse_rate(rate: str) -> float | None:
    """'1gbit' -> bits/s; 'unshaped' -> None."""
    if rate in ("unshaped", "none", "0"):
        return None
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([kmg]?)bit", rate.lower())
    if not m:
        raise SystemExit(f"error: --rates {rate!r}: use e.g. 1gbit, 200mbit or unshaped")
    return float(m.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[m.group(2)]


def _sh(*cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    res = subprocess.run(cmd, capture_output=True, text=True)
    if check and res.returncode:
        raise RuntimeError(f"{' '.join(cmd)}: {res.stderr.strip() or res.stdout.strip()}")
    return res


class Cluster:
    """Two namespaces joined by a shaped veth pair, or (without root/iproute2) plain loopback."""

    def __init__(self, want_netns: bool, lock_fd: int):
        self.netns, self.reason, self.watchdog, self.lock_fd = False, "", None, lock_fd
        self.children: list[subprocess.Popen] = []
        if not want_netns:
            self.reason = "--no-netns"
        elif os.geteuid() != 0:
            self.reason = "not root (network namespaces and tc need root)"
        elif not (shutil.which("ip") and shutil.which("tc")):
            self.reason = "iproute2 (ip, tc) not installed"
        else:
            try:
                self._setup()
                self.netns = True
            except Exception as e:  # noqa: BLE001
                self.reason = f"namespace setup failed: {e}"
                self.cleanup()
        if not self.netns:
            log(f"NOTE: {self.reason}: all ranks run on loopback, UNSHAPED, whatever the rate says")

    def _setup(self) -> None:
        self.cleanup()  # stale namespaces of an interrupted run
        atexit.register(self.cleanup)
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, _raise_exit)
        # a watchdog removes the namespaces (and ends what runs in them) even if we are SIGKILLed
        script = f"while kill -0 {os.getpid()} 2>/dev/null; do sleep 1; done; " + "; ".join(
            f"for p in $(ip netns pids {ns} 2>/dev/null); do kill -9 $p; done; ip netns del {ns} 2>/dev/null"
            for ns in NAMESPACES
        )
        # it inherits the lock: no new bench can start before it has cleaned up
        self.watchdog = subprocess.Popen(
            ["bash", "-c", script],
            start_new_session=True,
            pass_fds=(self.lock_fd,),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for ns in NAMESPACES:
            _sh("ip", "netns", "add", ns)
        _sh("ip", "link", "add", VETHS[0], "type", "veth", "peer", "name", VETHS[1])
        for ns, dev, addr in zip(NAMESPACES, VETHS, ADDRS):
            _sh("ip", "link", "set", dev, "netns", ns)
            _sh("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
            _sh("ip", "-n", ns, "link", "set", dev, "up")
            _sh("ip", "-n", ns, "link", "set", "lo", "up")

    def shape(self, bits_per_s: float | None) -> None:
        if not self.netns:
            return
        for ns, dev in zip(NAMESPACES, VETHS):
            if bits_per_s is None:
                _sh("tc", "-n", ns, "qdisc", "del", "dev", dev, "root", check=False)
            else:
                burst = max(64 * 1024, int(bits_per_s / 8 * 0.002))  # 2 ms of traffic, >= 64 KiB
                _sh(
                    "tc",
                    "-n",
                    ns,
                    "qdisc",
                    "replace",
                    "dev",
                    dev,
                    "root",
                    "tbf",
                    "rate",
                    f"{int(bits_per_s)}bit",
                    "burst",
                    str(burst),
                    "latency",
                    "50ms",
                )

    def qdisc(self) -> str:
        if not self.netns:
            return "loopback (no shaping)"
        return "; ".join(
            _sh("tc", "-n", ns, "qdisc", "show", "dev", dev, check=False).stdout.strip()
            for ns, dev in zip(NAMESPACES, VETHS)
        )

    def prefix(self, node: int) -> list[str]:
        return ["ip", "netns", "exec", NAMESPACES[node]] if self.netns else []

    def tx_bytes(self, node: int) -> int:
        if not self.netns:
            return 0
        out = _sh("ip", "-n", NAMESPACES[node], "-s", "-j", "link", "show", VETHS[node]).stdout
        return int(json.loads(out)[0]["stats64"]["tx"]["bytes"])

    def check_paths(self, bits_per_s: float | None) -> dict:
        """Measure a 24 MiB TCP transfer node0 -> node1 (cross-node) and node0 -> node0 via
        its veth address (intra-node): rate, and how many bytes the veth carried."""
        if not self.netns:
            return {}
        self.shape(bits_per_s)
        code = (
            "import socket,sys,time\n"
            "mode,host=sys.argv[1],sys.argv[2]; N=24<<20\n"
            "if mode=='srv':\n"
            " s=socket.socket(); s.setsockopt(socket.SOL_SOCKET,socket.SO_REUSEADDR,1); s.bind((host,29571));"
            " s.listen(1); print('ready',flush=True); c,_=s.accept(); g=0\n"
            " while g<N:\n  b=c.recv(1<<20)\n  if not b: break\n  g+=len(b)\n"
            " c.sendall(b'k')\n"
            "else:\n"
            " s=socket.create_connection((host,29571)); buf=b'x'*(1<<20); t=time.perf_counter()\n"
            " for _ in range(N>>20): s.sendall(buf)\n"
            " s.recv(1); print(N*8/(time.perf_counter()-t))\n"
        )
        out = {}
        for name, srv_node in (("cross_node", 1), ("intra_node", 0)):
            before = self.tx_bytes(0)
            srv = subprocess.Popen(
                self.prefix(srv_node) + [sys.executable, "-c", code, "srv", ADDRS[srv_node]],
                stdout=subprocess.PIPE,
                text=True,
            )
            srv.stdout.readline()
            cli = subprocess.run(
                self.prefix(0) + [sys.executable, "-c", code, "cli", ADDRS[srv_node]],
                capture_output=True,
                text=True,
                timeout=120,
            )
            srv.wait(timeout=30)
            out[name] = {
                "mbit_per_s": round(float(cli.stdout.strip()) / 1e6, 1),
                "veth_tx_mb": round((self.tx_bytes(0) - before) / 1e6, 2),
            }
        return out

    def cleanup(self) -> None:
        for p in self.children:
            stop_process(p)
        self.children.clear()
        if shutil.which("ip") and os.geteuid() == 0:
            for ns in NAMESPACES:
                if _sh("ip", "netns", "pids", ns, check=False).returncode == 0:
                    for pid in _sh("ip", "netns", "pids", ns, check=False).stdout.split():
                        try:
                            os.kill(int(pid), signal.SIGKILL)  # ranks we launched there
                        except (OSError, ValueError):
                            pass
                    _sh("ip", "netns", "del", ns, check=False)
        if self.watchdog is not None and self.watchdog.poll() is None:
            self.watchdog.kill()
            self.watchdog.wait()
        self.watchdog = None


def take_lock() -> int:
    """One bench at a time (a second one would remove the first one's namespaces)."""
    fd = os.open(LOCK, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        holder = open(LOCK).read().strip()
        raise SystemExit(
            f"error: another emulated-cluster bench (bench/zero.py or bench/cp.py, pid {holder or '?'}) is running; "
            f"it holds {LOCK}"
        ) from None
    os.ftruncate(fd, 0)
    os.write(fd, str(os.getpid()).encode())
    return fd


def wait_for_lock(seconds: float, every_s: float = 1.0) -> int:
    """take_lock, retried every `every_s` while another bench holds it, for up to `seconds`."""
    deadline, said = time.time() + seconds, False
    while True:
        try:
            return take_lock()
        except SystemExit as e:
            if time.time() > deadline:
                raise SystemExit(f"{e} (waited {seconds:.0f} s)") from None
            if not said:
                log(f"waiting for the cluster lock: {e}")
                said = True
            time.sleep(every_s)


def _raise_exit(signum, frame):
    raise SystemExit(128 + signum)


def stop_process(p: subprocess.Popen) -> None:
    """End a process started with start_new_session (its whole group): SIGTERM, then SIGKILL after 5 s."""
    if p.poll() is None:
        try:
            os.killpg(p.pid, signal.SIGTERM)
            p.wait(timeout=5)
        except (OSError, subprocess.TimeoutExpired):
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except OSError:
                pass
            p.wait()


# ---------------------------------------------------------------- launching ranks on the cluster


def torchrun_args(cluster: Cluster, node: int, nodes: int, per_node: int, port: int) -> list[str]:
    """torchrun's flags for `node`: one torchrun per namespace, or all ranks on one loopback host."""
    if cluster.netns:
        where = f"--nnodes {nodes} --nproc-per-node {per_node} --node-rank {node} --master-addr {ADDRS[0]}"
    else:
        where = f"--nnodes 1 --nproc-per-node {nodes * per_node} --master-addr 127.0.0.1"
    return ["-m", "torch.distributed.run", *where.split(), "--master-port", str(port)]


def node_env(cluster: Cluster, env: dict, node: int) -> dict:
    """A node's environment: gloo on its veth (in a namespace), and which veth and node it is."""
    if not cluster.netns:
        return env
    return {**env, "GLOO_SOCKET_IFNAME": VETHS[node], "ZPP_VETH": VETHS[node], "ZPP_NODE": str(node)}


def launched_nodes(cluster: Cluster, nodes: int) -> int:
    """How many torchruns a launch of `nodes` emulated nodes starts: one per namespace, or one."""
    return nodes if cluster.netns else 1


def start_nodes(
    cluster: Cluster,
    cmd: list[str],
    env: dict,
    logs: list,
    nodes: int,
    per_node: int,
    port: int,
    cwd: str | None = None,
) -> list[subprocess.Popen]:
    """One torchrun per node (in its namespace; one for all ranks without namespaces: see
    launched_nodes) running `cmd` (python, script, flags), the i-th writing to logs[i]; the
    processes, also kept in cluster.children (cleanup ends them)."""
    procs = []
    for node in range(launched_nodes(cluster, nodes)):
        run_cmd = cluster.prefix(node) + [cmd[0], *torchrun_args(cluster, node, nodes, per_node, port), *cmd[1:]]
        p = subprocess.Popen(
            run_cmd,
            env=node_env(cluster, env, node),
            stdout=logs[node],
            stderr=subprocess.STDOUT,
            cwd=cwd,
            start_new_session=True,
        )
        procs.append(p)
        cluster.children.append(p)
    return procs


def stop_nodes(cluster: Cluster, procs: list[subprocess.Popen]) -> None:
    for p in procs:
        stop_process(p)
        cluster.children.remove(p)

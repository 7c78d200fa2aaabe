"""More than one machine, as users launch it: two torchrun agents on this machine
(``--nnodes 2 --node-rank 0/1``, one rendezvous endpoint on localhost, 2 ranks each)
run the 1d tp2 × dp2 fine-tune of examples/finetune.py exactly as one agent with 4
ranks does, with the tensor-parallel groups inside a node and dp across nodes."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
JOB = [str(ROOT / "examples" / "finetune.py"), "--task", "clm", "--mode", "1d", "--dp", "2", "--steps", "3",
       "--batch-size", "8"]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env() -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo", "HF_HUB_OFFLINE": "1",
            "PYTHONPATH": str(ROOT)}


def _losses(out: str) -> list[str]:
    return re.findall(r"step\s+\d+/\d+\s+loss (\S+)", out)


@pytest.mark.slow
def test_two_agents_equal_one():
    port = _port()
    agents = [subprocess.Popen([*TORCHRUN, "--nnodes", "2", "--node-rank", str(n), "--nproc-per-node", "2",
                                "--master-addr", "127.0.0.1", "--master-port", str(port), *JOB],
                               env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
              for n in (0, 1)]
    outs = [a.communicate(timeout=400) for a in agents]
    for a, (out, err) in zip(agents, outs):
        assert a.returncode == 0, err[-3000:]
    two = outs[0][0]                        # rank 0 lives on node 0 and prints
    assert "nodes: 2 nodes × 2 ranks · inside a node: tp · across nodes: dp" in two, two
    one = subprocess.run([*TORCHRUN, "--nproc-per-node", "4", "--master-port", str(_port()), *JOB], env=_env(),
                         capture_output=True, text=True, timeout=400)
    assert one.returncode == 0, one.stderr[-3000:]
    assert "nodes:" not in one.stdout       # one node: nothing crosses
    assert len(_losses(two)) == 3 and _losses(two) == _losses(one.stdout), (_losses(two), _losses(one.stdout))


def test_tensor_parallel_across_nodes_is_reported():
    from autoshard.ir.mesh import Mesh

    m = Mesh(axes=("dp", "tp"), sizes=(1, 4))
    assert m.across_nodes(2) == {"dp": False, "tp": True}
    assert m.placement(2) == "2 nodes × 2 ranks · inside a node: dp · across nodes: tp"
    assert Mesh(axes=("dep", "row", "col"), sizes=(2, 2, 2)).placement(4) == \
        "2 nodes × 4 ranks · inside a node: row, col · across nodes: dep"
    assert m.placement(4) == "" and m.placement(None) == ""

"""A rank killed mid-step: the others exit with a clear error within 60 s, the last
complete checkpoint loads, and training resumes from it exactly.

Ranks are plain processes with the torchrun environment (tests/fault_worker.py),
so the process group is the one autoshard makes, with AUTOSHARD_TIMEOUT.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
WORKER = HERE / "fault_worker.py"
EXIT_LIMIT_S = 60.0
TIMEOUT_S = "20"            # AUTOSHARD_TIMEOUT for the job: a stalled (not dead) rank errors after this


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(world: int, root: Path, *args: str, timeout_s: str | None = TIMEOUT_S,
            heartbeat_s: str | None = None) -> list[subprocess.Popen]:
    """``world`` worker processes; ``timeout_s=None`` leaves AUTOSHARD_TIMEOUT at its default,
    ``heartbeat_s=None`` AUTOSHARD_HEARTBEAT."""
    port = _port()
    procs = []
    for r in range(world):
        env = {**os.environ, "RANK": str(r), "WORLD_SIZE": str(world), "LOCAL_RANK": str(r),
               "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
               "AUTOSHARD_TIMEOUT": timeout_s, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo",
               "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(HERE.parent)}
        env = {k: v for k, v in env.items() if v is not None and k != "AUTOSHARD_HEARTBEAT"}
        if heartbeat_s is not None:
            env["AUTOSHARD_HEARTBEAT"] = heartbeat_s
        procs.append(subprocess.Popen([sys.executable, str(WORKER), str(root), *args], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    return procs


def _finish(procs, timeout: float):
    outs = []
    for p in procs:
        try:
            out, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            out, err = p.communicate()
        outs.append((p.returncode, out, err))
    return outs


def _records(out: str) -> list[dict]:
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def _signal_rank1_when_stalled(procs, root, sig, settle_s: float = 0.0):
    """Wait until rank 1 reports it stopped inside step 5, send it ``sig``, then wait
    for rank 0 to exit: (rc, stdout, stderr, seconds from the signal to the exit).
    Every process still running afterwards is killed."""
    try:
        deadline = time.monotonic() + 240
        while not (root / "stalled").exists():
            assert time.monotonic() < deadline, "rank 1 never reached step 5"
            assert procs[0].poll() is None and procs[1].poll() is None, _finish(procs, 5)
            time.sleep(0.1)
        time.sleep(settle_s)                             # rank 0 is now inside the backward all-reduce
        procs[1].send_signal(sig)
        t0 = time.monotonic()
        rc0, out0, err0 = _finish(procs[:1], EXIT_LIMIT_S + 30)[0]
        return rc0, out0, err0, time.monotonic() - t0
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()


@pytest.mark.slow
def test_killed_rank_errors_others_then_resume(tmp_path):
    """2 ranks, 1d. Steps 1-4 train and save step_0002, step_0004; in step 5 rank 1
    stops after its forward and is SIGKILLed; rank 0, waiting in the backward
    all-reduce, must exit with a CollectiveError within 60 s. A copy of step_0004
    without its manifest (a save killed before commit) is skipped. Resuming from
    the last complete checkpoint reproduces the step-5 forward loss exactly."""
    from autoshard.ir.errors import CheckpointError
    from autoshard.training.train import last_complete_state

    root = tmp_path / "ckpt"
    root.mkdir()
    procs = _launch(2, root, "--steps", "6", "--save-every", "2", "--stall-at", "5")
    rc0, out0, err0, elapsed = _signal_rank1_when_stalled(procs, root, signal.SIGKILL, settle_s=0.5)
    print(f"rank 0 exited {elapsed:.1f}s after rank 1 was killed")
    assert rc0 == 3, (rc0, err0[-3000:])
    assert elapsed < EXIT_LIMIT_S, elapsed
    assert "FAULT: rank 0: a collective failed during step 5: another rank died or stalled" in err0, err0[-3000:]
    assert "last_complete_state" in err0
    steps = _records(out0)
    assert [r["step"] for r in steps] == [1, 2, 3, 4]

    # a save killed before its manifest was committed, and one killed before train_state.json
    shutil.copytree(root / "step_0004", root / "step_0006")
    (root / "step_0006" / "manifest.json").unlink()
    shutil.copytree(root / "step_0004", root / "step_0008")
    (root / "step_0008" / "train_state.json").unlink()
    assert last_complete_state(root) == root / "step_0004"
    import autoshard.training.train as T

    with pytest.raises(CheckpointError, match="manifest missing, refusing an incomplete checkpoint"):
        T.load_state(root / "step_0006", None, mode="1d", example_inputs={}, lr=1e-3, steps=6)
    with pytest.raises(CheckpointError, match="train_state.json: missing: the save was killed"):
        T.load_state(root / "step_0008", None, mode="1d", example_inputs={}, lr=1e-3, steps=6)

    # resume: both ranks restart from step_0004 and finish; step 5 sees the weights of step 4
    (root / "stalled").unlink()
    res = _finish(_launch(2, root, "--steps", "6", "--save-every", "2", "--resume"), 240)
    for rc, out, err in res:
        assert rc == 0, err[-3000:]
    recs = [_records(out) for _, out, _ in res]
    assert recs[0][0] == {"resumed_from": str(root / "step_0004"), "step": 4}
    assert [r["step"] for r in recs[0][1:]] == [5, 6]
    assert recs[0][1:] == recs[1][1:]                    # loss is the global mean on every rank
    fwd5 = json.loads((root / "fwd5.json").read_text())["loss"]
    assert recs[0][1]["loss"] == pytest.approx(fwd5, rel=0, abs=1e-6)
    assert last_complete_state(root) == root / "step_0006"


@pytest.mark.slow
def test_stalled_rank_times_out_on_the_others(tmp_path):
    """Rank 1 frozen (SIGSTOP, its sockets stay open) in step 5: rank 0 gets no
    'connection closed', only the process group's timeout (AUTOSHARD_TIMEOUT=20 s)
    ends its wait, with a CollectiveError, well within 60 s."""
    root = tmp_path / "ckpt"
    root.mkdir()
    procs = _launch(2, root, "--steps", "6", "--save-every", "2", "--stall-at", "5")
    rc0, out0, err0, elapsed = _signal_rank1_when_stalled(procs, root, signal.SIGSTOP)
    print(f"rank 0 exited {elapsed:.1f}s after rank 1 froze (timeout {TIMEOUT_S}s)")
    assert rc0 == 3, (rc0, err0[-3000:])
    assert elapsed < EXIT_LIMIT_S, elapsed
    assert "FAULT: rank 0: a collective failed during step 5: another rank died or stalled" in err0, err0[-3000:]


@pytest.mark.slow
def test_frozen_rank_ends_the_job_by_heartbeat(tmp_path):
    """4 ranks with the default collective timeout (300 s): rank 1 frozen with SIGSTOP
    in step 5. The others' heartbeat (AUTOSHARD_HEARTBEAT, default 30 s; 12 s here) sees
    it stop beating and ends them within 60 s, naming rank 1 and the checkpoint to resume from."""
    root = tmp_path / "ckpt"
    root.mkdir()
    procs = _launch(4, root, "--steps", "6", "--save-every", "2", "--stall-at", "5", timeout_s=None,
                    heartbeat_s="12")
    rc0, out0, err0, elapsed = _signal_rank1_when_stalled(procs, root, signal.SIGSTOP)
    print(f"rank 0 exited {elapsed:.1f}s after rank 1 froze")
    assert elapsed < EXIT_LIMIT_S, elapsed
    assert rc0 == 1, (rc0, err0[-3000:])
    assert "CollectiveError on rank 0: rank(s) [1] of 4 sent no heartbeat for more than 12 s" in err0, err0[-3000:]
    assert f"the last complete checkpoint is {root / 'step_0004'}" in err0, err0[-3000:]

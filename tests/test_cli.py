"""The ``autoshard`` command line (autoshard/cli.py): plan, check, --help, exit codes."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import transformers

from autoshard.cli import KNOWN_MODELS, build_parser, main, resolve_model

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
            num_key_value_heads=4, vocab_size=128, max_position_embeddings=64)


@pytest.fixture(scope="module")
def config_json(tmp_path_factory):
    path = tmp_path_factory.mktemp("cli") / "config.json"
    transformers.LlamaConfig(**TINY).to_json_file(str(path))
    return str(path)


def test_plan_2d_prints_table_and_summary(config_json, tmp_path, capsys, monkeypatch):
    # in-process (a subprocess spent 10-40 s on imports and a cold capture); the console
    # script itself is run by test_console_script_help
    monkeypatch.setenv("COLUMNS", "250")
    out = tmp_path / "plan.json"
    assert main(["plan", config_json, "--world-size", "4", "--mode", "2d", "--batch-size", "4", "--seq-len", "16",
                 "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "autoshard plan" in text and "row[2] × col[2]" in text and "summa" in text
    for what in ("parameters", "activations", "comm bytes fwd / bwd", "comm time fwd / bwd", "predicted step",
                 "fallbacks"):
        assert what in text, what
    d = json.loads(out.read_text())
    assert d["summary"]["mode"] == "2d" and d["summary"]["world_size"] == 4
    assert d["summary"]["predicted_step_s"] > 0 and d["plan"]["mesh"]["sizes"] == [2, 2]


def test_help_explains_every_flag(capsys):
    with pytest.raises(SystemExit) as e:
        main(["plan", "--help"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    for flag in ("--world-size", "--mode", "--depth", "--dp", "--batch-size", "--seq-len", "--cluster", "--json",
                 "--all-nodes", "--all-layers", "examples:", "llama:7b"):
        assert flag in text, flag
    with pytest.raises(SystemExit):
        main(["check", "--help"])
    assert "exit status" in capsys.readouterr().out
    # every option has a help text
    for action in build_parser()._subparsers._group_actions[0].choices["plan"]._actions:
        assert action.help, action.dest


def test_console_script_help():
    exe = os.path.join(os.path.dirname(sys.executable), "autoshard")
    cmd = [exe, "--help"] if os.path.exists(exe) else [sys.executable, "-m", "autoshard.cli", "--help"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "plan" in r.stdout and "check" in r.stdout


@pytest.mark.parametrize("args,code", [
    (["--world-size", "4", "--mode", "2d", "--batch-size", "4"], 0),
    (["--world-size", "6", "--mode", "2d"], 1),                                      # not a square
    (["--world-size", "8", "--mode", "2.5d", "--depth", "2", "--batch-size", "2"], 1),  # batch 2 over 4 blocks
], ids=["ok-2d", "bad-world", "batch-does-not-split"])
def test_check_exit_codes(config_json, capsys, args, code):
    assert main(["check", config_json, *args]) == code
    out = capsys.readouterr().out
    assert ("✓" in out) if code == 0 else ("problem" in out)


def test_check_reports_memory_and_bad_input(config_json, tmp_path, capsys):
    cl = tmp_path / "small.json"
    cl.write_text(json.dumps({"name": "tiny", "ranks_per_node": 8, "intra_bw": 1e9, "intra_latency": 0,
                              "inter_bw": 1e9, "inter_latency": 0, "flops": 1e9, "memory_bytes": 1000}))
    assert main(["check", config_json, "-w", "2", "-m", "1d", "--cluster", str(cl)]) == 1
    assert "per rank, tiny has" in capsys.readouterr().out
    assert main(["check", "llama:nope", "-w", "2", "-m", "1d"]) == 2
    assert main(["check", config_json, "-w", "2", "-m", "1d", "--cluster", "tpu-v9"]) == 2


def test_plan_auto_writes_ranked_candidates(config_json, tmp_path, capsys):
    out = tmp_path / "auto.json"
    assert main(["plan", config_json, "-w", "4", "--mode", "auto", "--no-table", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "autoshard auto" in text and "chosen:" in text
    d = json.loads(out.read_text())
    ranks = [c["rank"] for c in d["search"]["candidates"] if c["rank"]]
    assert ranks == list(range(1, len(ranks) + 1))
    best = next(c for c in d["search"]["candidates"] if c["rank"] == 1)
    assert d["summary"]["mode"] == best["mode"]


class _Searched(Exception):
    pass


@pytest.mark.parametrize("command", ["plan", "check"])
def test_planning_commands_pause_the_collector_and_search_without_the_face(command, monkeypatch, capsys):
    """``plan`` and ``check`` run with the cyclic garbage collector paused (as
    ``autoshard.plan`` does; on again after, whatever happened), and ``--mode auto``
    plans through the search alone: ``autoshard.api`` (ShardedModule, the runtime) is
    never imported on that path."""
    import gc

    import autoshard.io.builder
    import autoshard.planning.search

    seen = []

    def search(model, **kw):
        seen.append(gc.isenabled())
        raise _Searched

    monkeypatch.setattr(autoshard.planning.search, "search", search)
    monkeypatch.setattr(autoshard.io.builder, "model_from", lambda cfg: cfg)
    monkeypatch.setitem(sys.modules, "autoshard.api", None)       # importing it raises ImportError
    assert gc.isenabled()
    argv = [command, "llama:tiny", "-w", "4", "--mode", "auto"]
    if command == "plan":
        with pytest.raises(_Searched):
            main(argv)
    else:   # check reports every planning error as a finding
        assert main(argv) == 1 and "_Searched" in capsys.readouterr().out
    assert seen == [False] and gc.isenabled()


def test_a_planning_command_line_leaves_the_heap_out_of_the_final_collection(monkeypatch, capsys):
    """``main()`` on the process's own command line (no ``argv``: the console script,
    ``python -m autoshard.cli``) freezes the heap after ``plan`` / ``check``, so the
    interpreter's shutdown collection does not walk it (1.2 s of a 7B plan); ``main(argv)``
    (a caller that goes on) leaves the collector as it was."""
    import gc

    import autoshard.cli as cli

    monkeypatch.setattr(cli, "cmd_check", lambda args: 0)
    monkeypatch.setattr(cli, "default_batch", lambda args: None)
    gc.unfreeze()
    try:
        assert main(["check", "llama:tiny", "-w", "4", "--mode", "1d"]) == 0 and gc.get_freeze_count() == 0
        monkeypatch.setattr(sys, "argv", ["autoshard", "check", "llama:tiny", "-w", "4", "--mode", "1d"])
        assert main() == 0 and gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()


def test_known_models():
    for name in ("llama:7b", "llama:13b", "llama:70b", "gpt2:small", "bert:base"):
        assert name in KNOWN_MODELS
    c = resolve_model("llama:70b")
    assert (c.hidden_size, c.num_hidden_layers, c.num_key_value_heads) == (8192, 80, 8)
    assert resolve_model("gpt2:small").n_embd == 768 and resolve_model("bert:base").hidden_size == 768


def test_help_imports_no_torch_and_names_match_the_registries():
    """`autoshard --help` runs without torch (why it takes well under 2 s); the mode and
    cluster names it lists are the policies' and the cost model's own."""
    r = subprocess.run([sys.executable, "-c",
                        "import sys\nfrom autoshard.cli import main\n"
                        "try:\n    main(['plan', '--help'])\nexcept SystemExit:\n    pass\n"
                        "assert 'torch' not in sys.modules, 'torch imported'\n"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "tensor-parallel mode, one of auto, 1d, 1d-sp, 2d, 2.5d, 3d" in " ".join(r.stdout.split())
    from autoshard.cli import CLUSTER_NAMES, MODE_NAMES
    from autoshard.planning.cost import CLUSTERS
    from autoshard.policies import POLICIES

    assert MODE_NAMES == ("auto", *POLICIES)
    assert CLUSTER_NAMES == tuple(CLUSTERS)


def test_help_states_each_default_once(capsys):
    with pytest.raises(SystemExit):
        main(["plan", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "(default: None)" not in text and "(default: False)" not in text
    assert "(default 1; searched with --mode auto)" in text and "default: the smallest batch" in text
    sub = build_parser()._subparsers._group_actions[0].choices["plan"]
    fmt = sub._get_formatter()
    for action in sub._actions:
        assert action.help is None or fmt._expand_help(action).lower().count("default") <= 1, action.dest


def test_bad_mode_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as e:
        main(["check", "llama:tiny", "-w", "2", "--mode", "4d"])
    assert e.value.code == 2 and "choose from auto, 1d, 1d-sp, 2d, 2.5d, 3d" in capsys.readouterr().err


def test_check_prints_verdict_first_and_groups_notes(capsys):
    """gpt2's vocabulary (50257) does not divide by 4: the verdict line comes first,
    then each kind of note once."""
    assert main(["check", "gpt2:small", "-w", "4", "-m", "1d"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].startswith("✓"), lines[:3]
    notes = [x for x in lines if x.lstrip().startswith("note")]
    assert notes and len(notes) == len(set(notes))
    assert any("vocab_size=50257" in x for x in notes)


def test_plan_a_decode_step(config_json, tmp_path, capsys):
    """``--step decode``: the generation step planned without processes, its KV cache per
    rank (fp32 [batch, kv heads, positions, head dim] × 2 × layers, split over tp) and its
    per-token collectives."""
    out = tmp_path / "decode.json"
    assert main(["plan", config_json, "-w", "2", "--mode", "1d", "-b", "4", "-s", "100", "--step", "decode",
                 "--no-table", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "decode step" in text and "KV cache of 128 positions" in text and "per token" in text
    from autoshard.ir.plan import ShardingPlan

    p = ShardingPlan.from_json(out.read_text())
    cfg = transformers.LlamaConfig(**TINY)
    kv = cfg.num_key_value_heads
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    dense = 2 * cfg.num_hidden_layers * 4 * kv * 128 * head_dim * 4
    assert p.state_bytes_per_rank == (dense // 2 if kv % 2 == 0 else dense)

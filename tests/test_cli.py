"""The command line as a user meets it, through ``prfaas.cli.main`` (the installed ``prfaas`` entry point): every
bad value of an option that parses a unit, a rate, a duration, a fraction or a path is one ``error:`` line on
stderr and exit status 2 (never a traceback, never work done first); every option has a help text; help shows
real type names; tables written to a pipe are not cut at 80 columns."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import typer

from prfaas.cli import app, main, polish
from tests.services.deploy import free_port

ROOT = Path(__file__).resolve().parents[1]
FIXTURE = str(ROOT / "tests" / "plan" / "fixtures" / "llama-3.2-1b.json")
NOWHERE = "/nonexistent/prfaas-test"
DEAD = "http://127.0.0.1:9"  # discard port: nothing answers, and no bad value may get as far as dialling it


@pytest.fixture(scope="module")
def profile(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("cli") / "profile.json"
    path.write_text(json.dumps({"model": "m", "dtype": "bfloat16", "hardware": "cpu",
                                "prefill": [{"seq_len": 1024, "seconds": 0.5}], "decode": [],
                                "kv": [{"seq_len": 1024, "codec": "none", "bytes": 1_000_000}]}))
    return str(path)


BAD: list[tuple[str, ...]] = [
    ("lab", "set", "--loss", "lots"), ("lab", "set", "--loss", "150%"), ("lab", "set", "--rate", "fast"),
    ("lab", "set", "--delay", "1parsec"), ("lab", "set", "--jitter", "some"), ("lab", "set", "--mtu", "9"),
    ("lab", "up", "--loss", "2"), ("lab", "up", "--rate", "fast"),
    ("up", "--port", "x"), ("up", "--prefill", "0"), ("up", "--config", NOWHERE), ("up", "--offload-threshold", "x"),
    ("up", "--max-restarts", "-1"), ("up", "--device", "tpu"), ("up", "--device", "cuda:x"),
    ("up", "--engine", "vllm", "--device", "cuda"),
    ("measure", "--device", "gpu0"), ("serve", "router", "--config", NOWHERE), ("serve", "router", "--port", "x"),
    ("bench", "run", "--target", DEAD, "--out", "{tmp}", "--duration", "lots"),
    ("bench", "run", "--target", DEAD, "--out", "{tmp}", "--input-len", "abc"),
    ("bench", "run", "--target", DEAD, "--out", "{tmp}", "--concurrency", "0"),
    ("bench", "run", "--target", DEAD, "--out", "{tmp}", "--network", "storm"),
    ("bench", "run", "--target", DEAD, "--out", "{tmp}", "--matrix", NOWHERE),
    ("bench", "run", "--target", DEAD, "--out", "{tmp}", "--requests", "0"),
    ("bench", "run", "--target", DEAD, "--out", "{tmp}", "--ca", NOWHERE),
    ("bench", "run", "--target", "lots", "--out", "{tmp}"),
    ("bench", "run", "--target", DEAD, "--out", "{tmp}", "--baseline", NOWHERE),
    ("bench", "transfer", "--size", "huge"), ("bench", "transfer", "--ca", NOWHERE),
    ("probe", "run", "127.0.0.1:9", "--duration", "x"), ("probe", "run", "127.0.0.1:9", "--warmup", "x"),
    ("probe", "run", "nohostport"), ("probe", "serve", "--port", "0", "--duration", "x"),
    ("admin", "drain", "prefill-1", "--router", DEAD, "--timeout", "lots"),
    ("admin", "drain-router", "--router", DEAD, "--timeout", "lots"),
    ("admin", "rollout", "new", "--router", DEAD, "--steps", "a,b"),
    ("admin", "rollout", "new", "--router", DEAD, "--hold", "x"),
    ("admin", "recommend", "--router", DEAD, "--profile", "{profile}", "--link", "fast"),
    ("admin", "recommend", "--router", DEAD, "--profile", "{profile}", "--local-prefill-budget", "x"),
    ("admin", "recommend", "--router", DEAD, "--profile", NOWHERE),
    ("admin", "recommend", "--router", DEAD, "--profile", "{profile}", "--signals", NOWHERE),
    ("admin", "recommend", "--router", DEAD, "--profile", "{profile}", "--utilisation", "2"),
    ("admin", "check", "--router", DEAD, "--ca", NOWHERE), ("admin", "weight", "m", "-1", "--router", DEAD),
    ("admin", "usage", NOWHERE), ("audit", "verify", NOWHERE), ("audit", "report", NOWHERE),
    ("plan", "kv", "--config", FIXTURE, "--seq-len", "abc"), ("plan", "kv", "--config", NOWHERE),
    ("plan", "capacity", "--profile", "{profile}", "--bandwidth", "fast"),
    ("plan", "capacity", "--profile", NOWHERE),
    ("plan", "link", "--config", FIXTURE, "--bandwidth", "fast"),
    ("plan", "link", "--config", FIXTURE, "--link", NOWHERE),
    ("plan", "capacity", "--profile", "{profile}", "--lengths", f"trace:{NOWHERE}"),
    ("plan", "capacity", "--profile", "{profile}", "--lengths", "hist:abc"),
    ("plan", "capacity", "--profile", "{profile}", "--local-profile", NOWHERE),
    ("plan", "capacity", "--profile", "{profile}", "--kv", NOWHERE), ("measure", "--seq-len", "abc"),
    ("serve", "prefill", "--router", DEAD, "--config", NOWHERE), ("serve", "decode", "--router", DEAD, "--port", "x"),
    ("serve", "prefill", "--router", DEAD, "--device", "gpu"),
    ("certs", "revoke", NOWHERE, "prefill-1"), ("certs", "issue", "--role", "prefill", "--name",
                                                                   "p", "--dir", NOWHERE, "--days", "0"),
]


def _main(argv: list[str], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> tuple[int, str]:
    monkeypatch.setattr(sys, "argv", ["prfaas", *argv])
    with pytest.raises(SystemExit) as done:
        main()
    return int(done.value.code or 0), capsys.readouterr().err


@pytest.mark.parametrize("argv", BAD, ids=[" ".join(a[:3]) + " " + a[-1] for a in BAD])
def test_a_bad_value_is_one_clear_line_and_exit_2(argv: tuple[str, ...], profile: str, tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str],
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PRFAAS_CA", raising=False)
    args = [a.replace("{tmp}", str(tmp_path / "out")).replace("{profile}", profile) for a in argv]
    code, err = _main(args, capsys, monkeypatch)
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: "), err
    assert "Traceback" not in err and "cannot reach the router" not in err and "cannot connect" not in err, err
    assert not (tmp_path / "out").exists()  # refused before any work


def _params() -> list[tuple[str, Any]]:
    command = typer.main.get_command(app)
    polish(command)
    out: list[tuple[str, Any]] = []

    def walk(cmd: Any, path: str) -> None:
        for name, sub in getattr(cmd, "commands", {}).items():
            walk(sub, f"{path} {name}")
        out.extend((path, p) for p in cmd.params)

    walk(command, "prfaas")
    return out


def test_every_option_and_argument_has_help_and_a_real_type_name() -> None:
    missing = [f"{path} {p.opts[0]}" for path, p in _params() if not p.help]
    assert not missing, f"no help text: {missing}"
    shown = {f"{path} {p.opts[0]}": p.display_type_rich(None) for path, p in _params()
             if p.param_type_name == "option"}
    flags = [k for k, v in shown.items() if v and "bool" in v]
    lists = [k for k, v in shown.items() if v and "list[" in v]
    assert not flags and not lists, (flags, lists)


def test_help_shows_defaults_and_no_bool_placeholder(capsys: pytest.CaptureFixture[str],
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "200")
    for argv in (["up", "--help"], ["bench", "run", "--help"], ["admin", "check", "--help"]):
        monkeypatch.setattr(sys, "argv", ["prfaas", *argv])
        with pytest.raises(SystemExit) as done:
            main()
        text = capsys.readouterr().out
        assert done.value.code == 0 and "<bool>" not in text and "list[" not in text, text
    monkeypatch.setattr(sys, "argv", ["prfaas", "up", "--help"])
    with pytest.raises(SystemExit):
        main()
    text = capsys.readouterr().out
    assert "offload_threshold_tokens, 256" in text and "prefill instances" in text


def test_a_table_written_to_a_pipe_keeps_whole_lines(profile: str) -> None:
    env = {"PATH": "/usr/bin:/bin"}  # no COLUMNS: rich falls back to 80 columns off a terminal
    done = subprocess.run([sys.executable, "-m", "prfaas", "plan", "capacity", "--profile", profile, "--bandwidth",
                           "1gbit", "--prfaas", "2", "--local", "4", "--lengths", "hist:1024=1"],
                          capture_output=True, text=True, timeout=120, env=env, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    assert max(map(len, done.stdout.splitlines())) > 80 and "…" not in done.stdout, done.stdout


def test_a_probe_to_nothing_says_it_cannot_connect_and_draws_nothing(capsys: pytest.CaptureFixture[str],
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    code, err = _main(["probe", "run", f"127.0.0.1:{free_port()}"], capsys, monkeypatch)
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1, err  # no progress bars before it
    assert lines[0].startswith("error: UNREACHABLE: cannot connect to a probe server") and "KV_" not in err, err

"""The command line: every command has --help, and `kvstore run` works on the default config."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from kvstore.cli.main import build_parser


def _run(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvstore", *args], capture_output=True, text=True, cwd=cwd, timeout=300)


def test_every_command_and_flag_has_help() -> None:
    parser = build_parser()
    sub = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
    assert {"config", "generate", "demo", "serve", "stats", "bench", "plan"} <= set(sub.choices)
    for name, cmd in sub.choices.items():
        text = cmd.format_help()
        assert text.startswith(f"usage: kvstore {name}") and cmd.description, name
        for action in cmd._actions:
            if action.option_strings and action.dest != "help":
                assert action.help, f"kvstore {name} {action.option_strings[0]} has no help text"


def test_help_from_the_console() -> None:
    res = _run("--help")
    assert res.returncode == 0 and "usage: kvstore" in res.stdout


def test_serve_refuses_a_config_without_host_tier(tmp_path: Path, capsys) -> None:  # noqa: ANN001
    from kvstore.cli.main import main

    cfg = tmp_path / "nohost.yaml"
    cfg.write_text("tiers: [lmdb]\n")
    assert main(["serve", "--config", str(cfg)]) == 2
    err = capsys.readouterr().err
    assert "lacks 'host'" in err and str(cfg) in err


@pytest.mark.parametrize("config", [
    "host:\n  capacity: 100\ndaemon:\n  layouts: model\n",  # no block of the model section's layout fits
    "tiers: [host, lmdb]\ndisk:\n  max_size: 4KiB\n",
    "tiers: [host, slab]\n",  # serving any layout (the default), the layouts share the disk through lmdb
    "tiers: [lmdb]\n",
    "tiers: [host, remote]\nremote:\n  write: write_back\n",
])
def test_config_check_refuses_what_serve_refuses_with_the_same_message(tmp_path: Path, capsys,  # noqa: ANN001
                                                                       config: str) -> None:
    """One list of checks (kvstore/config/serve_checks.py): a config `config check` passes, `serve` starts on."""
    from kvstore.cli.main import main

    cfg = tmp_path / "bad.yaml"
    cfg.write_text(config)
    assert main(["serve", "--config", str(cfg), "--socket", str(tmp_path / "s.sock")]) == 2
    served = capsys.readouterr().err
    assert main(["config", "check", str(cfg)]) == 2
    checked = capsys.readouterr().err
    assert str(cfg) in served and served.strip().removeprefix("error: ") in checked
    assert main(["config", "check", "--for", "engine", str(cfg)]) == 0  # an engine's embedded store gives its layout
    capsys.readouterr()


def test_a_decimal_size_is_said_back_in_binary_units(tmp_path: Path, capsys) -> None:  # noqa: ANN001
    from kvstore.cli.main import main

    cfg = tmp_path / "gb.yaml"
    cfg.write_text("host:\n  capacity: 4GB\n")
    assert main(["config", "check", str(cfg)]) == 0
    out = capsys.readouterr().out
    assert "host.capacity: 4GB is 4,000,000,000 bytes (3.73 GiB: decimal units); 4GiB would be 4,294,967,296" in out


def test_serve_refuses_remote_write_back_without_a_disk_tier_naming_the_fields(tmp_path: Path, capsys) -> None:  # noqa: ANN001
    from kvstore.cli.main import main

    cfg = tmp_path / "remote.yaml"
    cfg.write_text("tiers: [host, remote]\nremote:\n  write: write_back\n")
    assert main(["serve", "--config", str(cfg)]) == 2  # a daemon serves the remote tier, but write_back needs a disk
    err = capsys.readouterr().err
    assert "remote.write: write_back" in err and "tiers ['host', 'remote']" in err and str(cfg) in err


def test_version_prints_the_installed_version() -> None:
    import importlib.metadata

    res = _run("--version")
    assert res.returncode == 0 and res.stdout == f"kvstore {importlib.metadata.version('kvstore')}\n", res


def test_log_level_accepts_any_case() -> None:
    parser = build_parser()
    for given in ("debug", "Warning", "ERROR"):
        assert parser.parse_args(["serve", "--log-level", given]).log_level == given.upper()


def test_output_into_a_closed_pipe_exits_quietly() -> None:
    # `kvstore config check ... | head -1`: the reader is gone before the command writes (closed right away,
    # long before the interpreter has started), so every write meets a broken pipe.
    repo = Path(__file__).resolve().parent.parent
    proc = subprocess.Popen([sys.executable, "-m", "kvstore", "config", "check", "configs/default.yaml"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=repo)
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=60) == 1
    assert err == "", err


def test_config_check_shows_sizes_in_the_units_they_were_given(tmp_path: Path) -> None:
    cfg = tmp_path / "sizes.yaml"
    cfg.write_text("host:\n  capacity: 4GiB\ndisk:\n  max_size: 4GB\n  sync_bytes: 1500\npolicy:\n  max_inflight_bytes: 1000MB\n")
    res = _run("config", "check", str(cfg))
    assert res.returncode == 0, res.stderr
    shown = [line.strip() for line in res.stdout.splitlines()
             if line.strip().startswith(("capacity:", "max_size:", "sync_bytes:", "max_inflight_bytes:"))]
    # 4GB is 4 x 10^9 bytes: shown as 4GB (it was 3906250KiB); 1000MB is the same number as 1GB
    assert shown == ["capacity: 4GiB", "max_size: 4GB", "sync_bytes: 1500", "max_size: 8GiB",  # file: its default
                     "max_size: 8GiB",  # slab: its default
                     "max_inflight_bytes: 256MiB",  # remote: its default
                     "max_inflight_bytes: 1GB",
                     "max_inflight_bytes: 256MiB"], shown  # daemon: its default
    assert "3906250KiB" not in res.stdout


def test_stats_without_a_daemon_says_where_it_looked_and_why_a_relative_path_moves(tmp_path: Path, capsys,  # noqa: ANN001
                                                                                  monkeypatch) -> None:  # noqa: ANN001
    from kvstore.cli.main import main

    monkeypatch.chdir(tmp_path)
    assert main(["stats"]) != 0
    err = capsys.readouterr().err
    assert f"looked for {tmp_path / '.kvstore-data' / 'kvstore.sock'}" in err
    assert "is relative" in err and "KVSTORE_DAEMON__SOCKET_PATH" in err

import subprocess
import sys

from infinity.cli.main import main


def test_help_lists_commands(capsys):
    assert main([]) == 2
    out = capsys.readouterr().out
    assert "bench" in out


def test_console_entry_runs_as_module():
    proc = subprocess.run(
        [sys.executable, "-m", "infinity.cli.main", "--version"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("infinity ")

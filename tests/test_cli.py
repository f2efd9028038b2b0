"""The CLI: every subcommand registered, --help without importing torch, errors as exit codes."""

import subprocess
import sys

from kvcanary import cli


def test_help_lists_every_subcommand_and_does_not_import_torch():
    code = ("import sys; from kvcanary import cli\n"
            "try:\n    cli.main(['--help'])\nexcept SystemExit:\n    pass\n"
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    for name in ("bench", "demo", "recall", "selfcheck", "zoo"):
        assert name in out
    assert out.strip().endswith("False")


def test_selfcheck_json_exit_code(capsys):
    assert cli.main(["selfcheck", "--json"]) == 0
    assert '"ok": true' in capsys.readouterr().out


def test_library_errors_become_exit_code_2(capsys):
    assert cli.main(["selfcheck", "--device", "nonsense"]) == 2
    assert "kvcanary selfcheck: error:" in capsys.readouterr().err

"""CI's own script: a run whose tiers all pass must exit 0 (stop 46's CI passed every tier and still failed)."""
import re
import subprocess
from pathlib import Path

CI_SCRIPT = Path(__file__).resolve().parents[1] / ".ci" / "run"


def test_the_exit_trap_of_ci_run_keeps_a_passing_runs_status_zero():
    # The trap stops the background venv builds; after a passing run they have ended, so pkill and
    # kill find nothing and return 1. Under `set -e` that status would end the script.
    trap_line = next(line for line in CI_SCRIPT.read_text().splitlines() if re.match(r"trap .* EXIT", line))
    script = f"""set -euo pipefail
( true ) >/dev/null 2>&1 &
venvs=$!
{trap_line}
wait "$venvs"
echo tiers passed
"""
    done = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=30)
    assert done.stdout.strip() == "tiers passed"
    assert done.returncode == 0, done.stderr


def test_the_exit_trap_of_ci_run_keeps_a_failed_tiers_status():
    trap_line = next(line for line in CI_SCRIPT.read_text().splitlines() if re.match(r"trap .* EXIT", line))
    script = f"""set -euo pipefail
( sleep 30; true ) >/dev/null 2>&1 &  # its own output: a straggler must not hold our pipes
venvs=$!
{trap_line}
false
"""
    done = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=30)
    assert done.returncode == 1


def test_ci_run_fails_a_ray_tier_over_its_budget():
    """make test-ray must stay within 300 s: ci/run's tier() fails the run when it takes longer."""
    text = CI_SCRIPT.read_text()
    tier = text[text.index("declare -A budget"):text.index("\n}\n", text.index("tier() {")) + 3]
    assert "[test-ray]=300" in tier
    for seconds, status in ((0, 0), (2, 1)):
        script = f"""set -euo pipefail
make() {{ sleep {seconds}; }}
{tier}
budget[test-ray]=1
tier test-ray
echo passed
"""
        done = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=30)
        assert done.returncode == status, done.stdout + done.stderr
        assert ("over its budget of 1 s" in done.stdout) == bool(status)

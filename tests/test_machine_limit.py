"""`grpokit bench limit --smoke`: every field of the machine-limit benchmark is produced (its numbers are
recorded in docs/results/machine-limit.md, never asserted)."""

import json

import pytest

from run_helpers import cli

pytestmark = pytest.mark.slow


def test_the_limit_benchmark_writes_every_field(tmp_path):
    out = tmp_path / "limit.json"
    proc = cli("bench", "limit", "--smoke", "--json", str(out), timeout=120)
    result = json.loads(out.read_text())
    assert {"command", "machine", "bandwidth_bytes_per_s", "matmul_flops_per_s", "batch", "ways"} <= set(result)
    assert {"cpu", "cores", "torch", "transformers", "bf16_flags"} <= set(result["machine"])
    assert set(result["matmul_flops_per_s"]) == {"fp32", "bf16"}
    assert {(w["dtype"], w["shared_prefill"]) for w in result["ways"]} == {
        (d, s) for d in ("fp32", "bf16") for s in (False, True)}
    for way in result["ways"]:
        assert {"seconds", "tokens_per_s", "fraction_of_limit", "completion_tokens"} <= set(way)
        assert {"prefill_s", "decode_s", "total_s", "decode_steps"} <= set(way["bound"])
    assert proc.stdout.count("of the limit") == 4

"""scripts/gpu-check.sh, the prepared GPU check, dry-run on the CPU so it cannot rot between
the sessions that are lent a GPU: the tiny shape, CPU against CPU, every step of the path
(random-weight model written, two servers compared, speculation against plain decoding,
`profile`, decode- and verify-shaped) and the report."""

import json
import os
import subprocess

from engine_proc import ROOT, engine_bin


def test_gpu_check_dry_run_on_cpu(tmp_path):
    env = dict(os.environ, GPU_CHECK_BIN=str(engine_bin()), GPU_CHECK_DEVICE="cpu",
               GPU_CHECK_SHAPES="tiny,tiny", OUT=str(tmp_path / "out"),
               GPU_CHECK_WORK=str(tmp_path / "work"))
    r = subprocess.run([str(ROOT / "scripts" / "gpu-check.sh"), "run"], env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    report = json.loads((tmp_path / "out" / "gpu-check.json").read_text())
    assert report["failed"] == []
    a = report["agreement"]
    # The same binary on the same device: every position agrees, to the last bit.
    assert a["positions"] == 4 * 32 and a["positions_agreeing"] == a["positions"]
    assert a["max_abs_logprob_diff"] == 0.0
    ll = report["lossless"]
    assert ll["identical"] == ll["prompts"] == 6 and ll["draft_tokens"] > 0
    dl = report["lossless_dspark"]
    assert dl["identical"] == dl["prompts"] == 4 and dl["draft_tokens"] > 0
    assert sorted(int(b) for b in report["profile"]["sps"]) == [1, 2, 4, 8, 16, 32, 64, 128]
    assert sorted(int(b) for b in report["profile_verify4"]["sps"]) == [1, 4, 16, 64]
    md = (tmp_path / "out" / "gpu-check.md").read_text()
    assert "6 of 6 completions" in md and "SPS(B)" in md

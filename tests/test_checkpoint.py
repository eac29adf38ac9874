"""Checkpoints: atomic writes, manifests, the latest pointer, keep-last-K, and failures at save
time (a full disk, an unwritable directory) that must leave the previous checkpoint intact."""

import os
import resource
import signal
import subprocess

import pytest
import torch
from transformers import AutoModelForCausalLM

from grpokit.run.checkpoint import (
    LATEST,
    MANIFEST,
    CheckpointError,
    CheckpointManager,
    find_resume_checkpoint,
    save_checkpoint,
    verify_checkpoint,
)


def test_checkpoint_is_loadable_and_verified(tiny_model, tokenizer, tmp_path):
    path = save_checkpoint(tiny_model, tokenizer, tmp_path / "ckpt")
    assert verify_checkpoint(path) == []
    manifest = (path / MANIFEST).read_text()
    assert "model.safetensors" in manifest and "sha256" in manifest
    loaded = AutoModelForCausalLM.from_pretrained(path)
    for name, tensor in tiny_model.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[name], tensor, rtol=0, atol=0)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp dirs left behind


def test_manager_points_latest_last_and_keeps_the_newest_k(tiny_model, tokenizer, tmp_path):
    manager = CheckpointManager(tmp_path, keep_last=2)
    for step in (1, 2, 3, 4):
        manager.save(step, tiny_model, tokenizer)
    assert [p.name for p in manager.step_dirs()] == ["step-4", "step-3"]
    assert os.readlink(tmp_path / LATEST) == "step-4"  # a relative link: the run directory can move
    assert manager.latest() == tmp_path / "step-4"
    # from_pretrained loads the link, as users load checkpoints/latest
    AutoModelForCausalLM.from_pretrained(tmp_path / LATEST)


def test_a_corrupt_or_partial_checkpoint_falls_back_to_the_previous_good_one(tiny_model, tokenizer, tmp_path,
                                                                             capsys):
    checkpoints = tmp_path / "checkpoints"
    manager = CheckpointManager(checkpoints)
    for step in (2, 4):
        manager.save(step, tiny_model, tokenizer, extra=lambda d: (d / "trainer_state.pt").write_bytes(b"state"))
    weights = checkpoints / "step-4" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped byte: same size, wrong hash
    weights.write_bytes(bytes(data))
    assert find_resume_checkpoint(tmp_path) == checkpoints / "step-2"
    err = capsys.readouterr().err
    assert "skipping checkpoint" in err and "step-4" in err and "sha256" in err
    assert weights.exists()  # reported, never deleted: the user may want to inspect it

    (checkpoints / "step-2" / MANIFEST).unlink()  # a save that never finished
    assert "manifest.json is missing" in verify_checkpoint(checkpoints / "step-2")[0]
    with pytest.raises(CheckpointError, match="no intact checkpoint"):
        find_resume_checkpoint(tmp_path)
    with pytest.raises(CheckpointError, match="cannot resume from .*step-4.*sha256"):
        find_resume_checkpoint(tmp_path, checkpoints / "step-4")


def test_truncated_weights_are_detected_by_size(tiny_model, tokenizer, tmp_path):
    path = save_checkpoint(tiny_model, tokenizer, tmp_path / "c")
    weights = path / "model.safetensors"
    size = weights.stat().st_size
    with weights.open("r+b") as f:
        f.truncate(size // 3)
    assert any("bytes, the manifest says" in p for p in verify_checkpoint(path))


def test_a_full_disk_at_save_time_raises_and_keeps_the_previous_checkpoint(tiny_model, tokenizer, tmp_path):
    """RLIMIT_FSIZE makes the kernel refuse writes past a size (EFBIG): a real write failure,
    which works for any user, root included."""
    manager = CheckpointManager(tmp_path)
    good = manager.save(1, tiny_model, tokenizer)
    before = {p.name: p.read_bytes() for p in good.iterdir()}
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    old_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (4096, hard))
    try:
        with torch.no_grad():
            next(tiny_model.parameters()).add_(1.0)
        with pytest.raises(CheckpointError, match="could not write checkpoint .*step-2.*Earlier checkpoints are untouched"):
            manager.save(2, tiny_model, tokenizer)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, old_handler)
    assert manager.latest() == good
    assert {p.name: p.read_bytes() for p in good.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == [LATEST, "step-1"]  # temp dir cleaned up


@pytest.fixture
def small_tmpfs(tmp_path):
    mount_point = tmp_path / "tmpfs"
    mount_point.mkdir()
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1M", "tmpfs", str(mount_point)],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({proc.stderr.strip() or 'not permitted'}); "
                    "the RLIMIT_FSIZE test covers write failures")
    yield mount_point
    subprocess.run(["umount", "-l", str(mount_point)], check=False)


def test_a_really_full_filesystem_keeps_the_previous_checkpoint(tokenizer, small_tmpfs):
    from grpokit.models import build_tiny_model

    model = build_tiny_model(tokenizer, hidden_size=64, num_layers=2, num_heads=2, intermediate_size=256)
    size = sum(p.numel() * 4 for p in model.parameters())
    assert 300_000 < size < 900_000  # one checkpoint fits in 1 MB, two do not
    manager = CheckpointManager(small_tmpfs / "checkpoints")
    good = manager.save(1, model, tokenizer)
    with pytest.raises(CheckpointError, match="No space left on device"):
        manager.save(2, model, tokenizer)
    assert manager.latest() == good and verify_checkpoint(good) == []


def test_an_unwritable_run_directory_raises_and_keeps_the_previous_checkpoint(tiny_model, tokenizer, tmp_path,
                                                                              small_tmpfs):
    manager = CheckpointManager(small_tmpfs / "checkpoints")
    good = manager.save(1, tiny_model, tokenizer)
    subprocess.run(["mount", "-o", "remount,ro", str(small_tmpfs)], check=True)
    try:
        with pytest.raises(CheckpointError, match="Read-only file system"):
            manager.save(2, tiny_model, tokenizer)
        assert manager.latest() == good and verify_checkpoint(good) == []
    finally:
        subprocess.run(["mount", "-o", "remount,rw", str(small_tmpfs)], check=False)


@pytest.mark.skipif(os.geteuid() == 0, reason="root ignores directory permissions; the tmpfs test covers it")
def test_a_read_only_directory_raises_and_keeps_the_previous_checkpoint(tiny_model, tokenizer, tmp_path):
    manager = CheckpointManager(tmp_path / "checkpoints")
    good = manager.save(1, tiny_model, tokenizer)
    os.chmod(tmp_path / "checkpoints", 0o555)
    try:
        with pytest.raises(CheckpointError, match="Permission denied"):
            manager.save(2, tiny_model, tokenizer)
    finally:
        os.chmod(tmp_path / "checkpoints", 0o755)
    assert manager.latest() == good and verify_checkpoint(good) == []

"""The housekeeping of vLLM's CPU shared-memory segments (rollout/vllm_cpu_shm.py), on a folder
standing in for /dev/shm and this machine's real /proc. tests/test_vllm_distributed.py runs it
with two engines under torchrun, after planting a stale segment in /dev/shm."""

import mmap

from grpokit.rollout.vllm_cpu_shm import mapped_paths, remove_stale_segments, stale_segment_error, unlink_segments

ERRNO_17 = "RuntimeError: create shm in SHMManager failed. errno: 17"


def segment(folder, name, size=4096):
    path = folder / name
    path.write_bytes(b"\0" * size)
    return path


def test_a_segment_no_process_maps_is_removed_and_a_mapped_one_stays(tmp_path):
    stale = segment(tmp_path, "-tp:0-[0-1]-cpushm_0")
    live = segment(tmp_path, "-tp:0-[0-1]-cpushm_1")
    other = segment(tmp_path, "29500-tp:0-[0-1]-cpushm_0")  # a vLLM server's name, not an engine under torchrun
    with live.open("r+b") as handle, mmap.mmap(handle.fileno(), 0):  # a running engine maps its segment
        assert str(live) in mapped_paths()
        assert remove_stale_segments(tmp_path) == [stale]
    assert not stale.exists() and live.exists() and other.exists()
    assert remove_stale_segments(tmp_path) == [live]  # unmapped now: stale too


def test_nothing_is_removed_when_no_process_can_be_read(tmp_path):
    stale = segment(tmp_path, "-tp:0-[0-1]-cpushm_0")
    assert mapped_paths(tmp_path / "no-proc") is None
    assert remove_stale_segments(tmp_path, proc=tmp_path / "no-proc") == []
    assert stale.exists()
    assert remove_stale_segments(tmp_path / "no-shm") == []


def test_a_process_unlinks_its_own_segments_by_vllms_name(tmp_path):
    mine = segment(tmp_path, "-tp:0-[0-1]-cpushm_1")
    peer = segment(tmp_path, "-tp:0-[0-1]-cpushm_0")
    # vLLM's group name under external_launcher starts with the "//" of "env://"
    assert unlink_segments(["//-tp:0-[0-1]-cpushm_1", "//-pp:0-[0-1]-cpushm_1"], tmp_path) == ["//-tp:0-[0-1]-cpushm_1"]
    assert not mine.exists() and peer.exists()


def test_a_start_failing_on_an_existing_segment_names_it_and_the_fix(tmp_path):
    left = segment(tmp_path, "-tp:0-[0-1]-cpushm_0")
    error = stale_segment_error(ERRNO_17, tmp_path)
    assert isinstance(error, ValueError)
    assert str(left) in str(error) and "Remove it if no run uses it" in str(error)
    assert stale_segment_error("create shm in SHMManager failed. errno: 13", tmp_path) is None

"""Atomicity of k3.parallel.checkpoint's directory protocol (no processes needed): only complete `step-N`
directories count; a save killed mid-way leaves `step-N.tmp`, which is ignored."""
from k3.parallel.checkpoint import find_checkpoints, latest_checkpoint


def test_only_complete_checkpoints_count(tmp_path):
    assert latest_checkpoint(str(tmp_path / "nothing")) is None
    (tmp_path / "step-1").mkdir()
    (tmp_path / "step-1" / ".metadata").write_bytes(b"x")
    (tmp_path / "step-2.tmp").mkdir()                       # killed during dcp.save
    (tmp_path / "step-2.tmp" / ".metadata").write_bytes(b"x")
    (tmp_path / "step-3").mkdir()                           # no .metadata: not a DCP checkpoint
    (tmp_path / "step-10").mkdir()
    (tmp_path / "step-10" / ".metadata").write_bytes(b"x")
    assert [s for s, _ in find_checkpoints(str(tmp_path))] == [1, 10]     # numeric, not lexicographic order
    assert latest_checkpoint(str(tmp_path)).endswith("step-10")

"""k3 train option resolution."""
import pytest


def test_compile_choice_resolves_per_device():
    from k3.train.trainer import resolve_compile
    assert resolve_compile("auto", "cpu") == "none"
    assert resolve_compile("auto", "cuda") == "modules"
    assert resolve_compile("layers", "cpu") == "layers"
    with pytest.raises(ValueError, match="compile"):
        resolve_compile("fast", "cpu")


def test_init_flag_and_dcp_checkpoints(tmp_path):
    """`k3 train --init DIR` sets init_from; a DCP checkpoint (a .metadata file) is accepted by the config (the
    distributed trainer reads it) and refused by the single-process resolver with the way out."""
    import argparse
    from k3.errors import K3ConfigError
    from k3.train.cli import add_parser, build_train_config
    from k3.train.config import resolve_init_checkpoint
    dcp = tmp_path / "dcp"
    dcp.mkdir()
    (dcp / ".metadata").write_bytes(b"")
    sub = argparse.ArgumentParser().add_subparsers()
    args = add_parser(sub).parse_args(["--init", str(dcp), "--out", str(tmp_path / "run")])
    cfg = build_train_config(args)
    assert cfg.init_from == str(dcp)
    cfg.validate()
    assert resolve_init_checkpoint(str(dcp), allow_dcp=True) == str(dcp)
    with pytest.raises(K3ConfigError, match=r"is a DCP checkpoint: start from it under torchrun.*k3 convert"):
        resolve_init_checkpoint(str(dcp))
    with pytest.raises(K3ConfigError, match="holds no model"):
        resolve_init_checkpoint(str(tmp_path))


def test_vision_task_mesh_flags_need_torchrun(monkeypatch, capsys):
    """`k3 train --task vision-synth --dp-shard 2` without torchrun is refused before any work, naming the flag."""
    from k3.cli import main
    for v in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(v, raising=False)
    assert main(["train", "--task", "vision-synth", "--dp-shard", "2", "--steps", "1"]) != 0
    err = capsys.readouterr().err
    assert "--dp-shard 2: mesh flags need several processes" in err and "torchrun" in err

"""Configs that build on others (``base:``), the resolved config printed back, and each
field's meaning from the command line."""

from __future__ import annotations

import pytest
import yaml

from common.errors import UserError
from orchestration.cli import main
from pipeline.config import PRESET_CONFIGS, OptimSection, config_yaml, load_config
from pipeline.config_reference import field_comments


def _write(path, data) -> str:
    path.write_text(yaml.safe_dump(data))
    return str(path)


def test_a_config_replaces_its_base_field_by_field(tmp_path):
    _write(tmp_path / "base.yaml", {"train": {"max_steps": 7, "global_batch_size": 4}, "optim": {"lr": 0.5}})
    child = _write(tmp_path / "child.yaml", {"base": "base.yaml", "train": {"max_steps": 9}})
    config = load_config(child)
    assert (config.train.max_steps, config.train.global_batch_size, config.optim.lr) == (9, 4, 0.5)
    grandchild = _write(tmp_path / "g.yaml", {"base": "child.yaml", "optim": {"lr": 0.25}})
    assert (load_config(grandchild).train.max_steps, load_config(grandchild).optim.lr) == (9, 0.25)


def test_base_may_name_a_shipped_preset(tmp_path):
    child = _write(tmp_path / "mine.yaml", {"base": "tiny", "train": {"max_steps": 5}})
    tiny = load_config(PRESET_CONFIGS / "tiny.yaml")
    config = load_config(child)
    assert config.train.max_steps == 5 and config.optim == tiny.optim and config.model == tiny.model


@pytest.mark.parametrize("name", ["demo", "tiny-ar", "medium"])
def test_the_presets_that_build_on_others_resolve_to_their_base_with_their_own_fields(name):
    raw = yaml.safe_load((PRESET_CONFIGS / f"{name}.yaml").read_text())
    expected = load_config(PRESET_CONFIGS / f"{raw.pop('base')}.yaml").to_dict()
    for section, fields in raw.items():
        expected[section].update(fields)
    assert load_config(PRESET_CONFIGS / f"{name}.yaml").to_dict() == expected


def test_a_cycle_and_an_unknown_base_are_named(tmp_path):
    _write(tmp_path / "a.yaml", {"base": "b.yaml"})
    _write(tmp_path / "b.yaml", {"base": "a.yaml"})
    with pytest.raises(UserError, match=r"makes a cycle \(.*a.yaml -> .*b.yaml -> .*a.yaml\)"):
        load_config(tmp_path / "a.yaml")
    _write(tmp_path / "c.yaml", {"base": "nosuch"})
    with pytest.raises(UserError, match=r"c.yaml: base: 'nosuch' is neither a file next to it nor a preset"):
        load_config(tmp_path / "c.yaml")


def test_print_config_prints_yaml_that_reads_back_to_the_same_config(tmp_path, capsys):
    assert main(["train", "--config", str(PRESET_CONFIGS / "demo.yaml"), "--print-config",
                 "--optim.lr", "1e-4"]) == 0
    printed = capsys.readouterr().out
    expected = load_config(PRESET_CONFIGS / "demo.yaml", {"optim.lr": "1e-4"})
    path = tmp_path / "printed.yaml"
    path.write_text(printed)
    assert load_config(path) == expected and printed == config_yaml(expected)


def test_config_fields_prints_each_fields_meaning(capsys):
    assert main(["config", "fields", "optim.lr"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("optim.lr: float = 0.0003") and field_comments(OptimSection)["lr"] in out
    assert main(["config", "fields", "nosuch"]) == 2
    assert "no config section or field 'nosuch'" in capsys.readouterr().err

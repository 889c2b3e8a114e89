"""The training config (``pipeline.config``): the shipped configs, YAML and override errors that
name the file, line, column, field or flag; validation of each field and of the fields that go
together; configs that build on others (``base:``), the resolved config printed back, each
field's meaning from the command line, and the differences a resume checks."""

from __future__ import annotations

import logging
import resource
import subprocess
import sys

import pytest
import yaml

from common.errors import UserError
from model.transformer import preset
from orchestration.cli import main
from pipeline.config import (
    MAX_CONFIG_BYTES,
    PRESET_CONFIGS,
    Config,
    OptimSection,
    config_differences,
    config_yaml,
    load_config,
    parse_overrides,
)
from pipeline.config_reference import field_comments
from tests.support.cli_runner import cli_env
from tests.support.paths import REPO

CONFIGS = sorted((REPO / "configs").glob("*.yaml"))
TIMED = {"model.time_conditioning": "true"}  # uniform and learned need t (a config check)


def _write(path, data) -> str:
    path.write_text(yaml.safe_dump(data))
    return str(path)


# ------------------------------------------------------------------ the shipped configs
@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_shipped_configs_load_and_validate(path):
    config = load_config(path)
    assert config.model.preset in ("tiny", "small", "medium")


def test_paper_recipe_in_the_medium_config():
    config = load_config(REPO / "configs" / "medium.yaml")
    assert (config.optim.lr, config.optim.betas, config.optim.weight_decay) == (3e-4, (0.9, 0.999), 0.0)
    assert (config.train.global_batch_size, config.train.ema_decay) == (512, 0.9999)


# ------------------------------------------------------------------ YAML
def test_yaml_errors_name_the_file_and_field(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("optim:\n  learning_rate: 0.1\n")
    with pytest.raises(UserError, match=r"bad.yaml: unknown field optim.learning_rate"):
        load_config(path)
    path.write_text("train:\n  global_batch_size: many\n")
    with pytest.raises(UserError, match=r"field train.global_batch_size = 'many': expected an integer"):
        load_config(path)
    path.write_text("train:\n  zero_stage: 4\n")
    with pytest.raises(UserError, match=r"train.zero_stage = 4: choose one of \['auto', 1, 2, 3\]"):
        load_config(path)
    with pytest.raises(UserError, match="config file not found"):
        load_config(tmp_path / "missing.yaml")


def test_malformed_and_non_utf8_yaml_name_the_line_and_column(tmp_path):
    broken = tmp_path / "broken.yaml"
    broken.write_text("train:\n  max_steps: [1\n")
    with pytest.raises(UserError, match=r"broken.yaml line 3, column 1: not valid YAML: expected ',' or ']'.*"
                                        r"flow sequence at line 2, column 14"):
        load_config(broken)
    latin = tmp_path / "latin.yaml"
    latin.write_bytes(b"train:\n  max_steps: 5 # caf\xe9\n")
    with pytest.raises(UserError, match=r"latin.yaml line 2, column 21: byte 0xe9 is not UTF-8; save the file as UTF-8"):
        load_config(latin)


def test_a_config_path_to_something_huge_or_endless_is_refused_without_reading_it_all(tmp_path):
    """/dev/zero was read until the kernel killed the process (at 23.8 GB); the address space is
    capped here so that a regression fails instead of taking the machine's memory."""
    def capped() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))

    done = subprocess.run([sys.executable, "-m", "orchestration.cli", "config", "show", "--config", "/dev/zero"],
                          cwd=REPO, env=cli_env(), capture_output=True, text=True, timeout=120, preexec_fn=capped,
                          check=False)
    assert done.returncode == 2 and done.stderr == (
        "unmask config: error: /dev/zero: holds more than 1 MiB, the most unmask reads as a YAML config file; check "
        "that the path names a YAML config file\n"), done.stderr[-2000:]
    huge = tmp_path / "huge.yaml"
    with open(huge, "wb") as handle:
        handle.truncate(MAX_CONFIG_BYTES + 1)  # sparse: refused by its size, nothing read
    with pytest.raises(UserError, match="huge.yaml: holds more than 1 MiB, the most unmask reads as a YAML config"):
        load_config(huge)


def test_a_key_given_twice_is_refused_naming_it_and_both_lines(tmp_path):
    """PyYAML keeps the last of two equal keys: a second `train:` silently dropped the first's fields."""
    twice = tmp_path / "twice.yaml"
    twice.write_text("train:\n  max_steps: 5\nmodel:\n  preset: tiny\ntrain:\n  seed: 3\n")
    with pytest.raises(UserError, match=r"twice.yaml line 5, column 1: not valid YAML: the key 'train' is given "
                                        r"twice \(first at line 1\)"):
        load_config(twice)
    twice.write_text("optim:\n  lr: 0.1\n  warmup_steps: 5\n  lr: 0.2\n")
    with pytest.raises(UserError, match=r"line 4, column 3: .*the key 'lr' is given twice \(first at line 2\)"):
        load_config(twice)
    with pytest.raises(UserError, match=r"flag --model.schedule_args .*the key 'power' is given twice"):
        load_config(None, {"model.schedule_args": "{power: 2, power: 3}"})


def test_an_empty_config_warns_that_every_default_applies_and_goes_on(tmp_path, caplog):
    path = tmp_path / "empty.yaml"
    path.write_text("# nothing set yet\n")
    with caplog.at_level(logging.WARNING, logger="unmask.config"):
        config = load_config(path)
    assert config.train.max_steps == 1_000_000
    [record] = caplog.records
    assert record.levelno == logging.WARNING
    assert str(path) in record.getMessage() and "train.max_steps = 1000000" in record.getMessage()


# ------------------------------------------------------------------ overrides
def test_overrides_are_coerced_to_the_declared_types():
    overrides = parse_overrides(["--optim.lr", "1e-4", "--train.zero_stage=3", "--optim.betas", "[0.9, 0.95]",
                                 "--model.schedule_args", "{power: 2}", "--model.schedule", "polynomial"])
    config = load_config(None, overrides)
    assert config.optim.lr == 1e-4 and isinstance(config.optim.lr, float)  # YAML alone reads "1e-4" as text
    assert config.train.zero_stage == 3
    assert config.optim.betas == (0.9, 0.95)
    assert config.model.schedule_args == {"power": 2}
    with pytest.raises(UserError, match="unknown config override --optim.learning_rate"):
        load_config(None, {"optim.learning_rate": "1"})
    with pytest.raises(UserError, match="config overrides look like"):
        parse_overrides(["lr=3"])


def test_an_override_that_is_not_yaml_names_the_flag():
    with pytest.raises(UserError, match=r"flag --optim.betas '\[0.9': not a valid YAML value"):
        load_config(None, {"optim.betas": "[0.9"})


def test_a_config_override_given_twice_is_refused_as_a_yaml_key_given_twice():
    with pytest.raises(UserError, match=r"config override --train.max_steps is given twice \('5', then '7'\)"):
        parse_overrides(["--train.max_steps", "5", "--train.max_steps=7"])


# ------------------------------------------------------------------ validation
def test_validation_names_the_field():
    with pytest.raises(UserError, match=r"config field optim.lr = -1.0: must be a positive number"):
        load_config(None, {"optim.lr": "-1"})
    with pytest.raises(UserError, match=r"train.micro_batch_size = 5: must divide train.global_batch_size = 512"):
        load_config(None, {"train.micro_batch_size": "5"})
    with pytest.raises(UserError, match=r"model.schedule"):
        load_config(None, {"model.schedule": "sigmoid"})
    for process in ("uniform", "learned"):
        with pytest.raises(UserError, match=rf"model.time_conditioning = False: the {process} process needs it"):
            load_config(None, {"model.process": process})
        assert load_config(None, {"model.process": process, "model.time_conditioning": "true"}).model.time_conditioning


@pytest.mark.parametrize("size", ["0", "-4"])
def test_a_micro_batch_size_below_one_is_refused_before_any_arithmetic_on_it(size):
    """The >= 1 check is named; the divisibility check after it did a modulo by zero first."""
    with pytest.raises(UserError, match=rf"^config field train.micro_batch_size = {size}: must be >= 1$"):
        load_config(None, {"train.micro_batch_size": size})


def test_a_shuffle_window_below_one_global_batch_is_refused():
    """A window holds whole global batches: 1 or 7 sequences with a global batch of 8 would be one
    batch, i.e. no shuffling across batches, which the user did not ask for."""
    for window in ("1", "7"):
        with pytest.raises(UserError, match=rf"config field data.shuffle_window = {window}: is fewer sequences than "
                                            r"one global batch \(train.global_batch_size = 8\), and a window holds "
                                            r"whole global batches: it would be one batch; set at least 8"):
            load_config(None, {"data.shuffle_window": window, "train.global_batch_size": "8"})
    assert load_config(None, {"data.shuffle_window": "8", "train.global_batch_size": "8"}).data.shuffle_window == 8


def test_an_infinite_or_nan_config_number_is_refused(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("optim:\n  grad_clip: .inf\n")
    with pytest.raises(UserError, match=r"field optim.grad_clip = inf: expected a finite number"):
        load_config(path)
    with pytest.raises(UserError, match=r"flag --optim.lr = nan: expected a finite number"):
        load_config(None, {"optim.lr": ".nan"})


def test_the_process_is_refused_with_the_fields_it_cannot_go_with():
    with pytest.raises(UserError, match=r"model.process = 'uniform': the autoregressive baseline has no diffusion"):
        load_config(None, {"model.process": "uniform", "model.objective": "autoregressive"})
    with pytest.raises(UserError, match=r"train.chunked_cross_entropy = 8: applies to the absorbing process only"):
        load_config(None, {"model.process": "learned", "train.chunked_cross_entropy": "8", **TIMED})
    with pytest.raises(UserError, match=r"model.schedule_args \(model.process = learned\): .* linear or polynomial"):
        load_config(None, {"model.process": "learned", "model.schedule": "cosine", **TIMED})
    with pytest.raises(UserError, match=r"flag --model.process = 'masked': choose one of"):
        load_config(None, {"model.process": "masked"})


def test_the_compile_and_memory_fields_of_train_are_typed_validated_and_named_in_errors(tmp_path):
    defaults = Config().train
    assert (defaults.activation_checkpointing, defaults.compile, defaults.chunked_cross_entropy) == (False, "auto", 0)
    path = tmp_path / "c.yaml"
    path.write_text("train:\n  activation_checkpointing: auto\n  compile: true\n  chunked_cross_entropy: 2048\n")
    train = load_config(path).train
    assert (train.activation_checkpointing, train.compile, train.chunked_cross_entropy) == ("auto", True, 2048)
    assert load_config(None, {"train.activation_checkpointing": "true"}).train.activation_checkpointing is True
    cases = {
        ("train.activation_checkpointing", "sometimes"): r"--train.activation_checkpointing = 'sometimes': "
                                                          r"expected true or false, or choose one of \['auto'\]",
        ("train.compile", "fast"): r"--train.compile = 'fast': expected true or false, or choose one of \['auto'\]",
        ("train.chunked_cross_entropy", "many"): r"--train.chunked_cross_entropy = 'many': expected an integer",
        ("train.chunked_cross_entropy", "-1"): r"train.chunked_cross_entropy = -1: must be >= 0",
    }
    for (field, value), message in cases.items():
        with pytest.raises(UserError, match=message):
            load_config(None, {field: value})
    with pytest.raises(UserError, match="train.chunked_cross_entropy = 8: applies to the diffusion objective"):
        load_config(None, {"train.chunked_cross_entropy": "8", "model.objective": "autoregressive"})


def test_the_spec_of_each_process():
    """The learned process starts its exponents at model.schedule; the others use it as is."""
    network = preset("tiny", 64)
    learned = load_config(None, {"model.process": "learned", "model.schedule": "polynomial",
                                 "model.schedule_args": "{power: 2, endpoint_eps: 1.0e-3}", **TIMED})
    spec = learned.model.spec(network)
    assert (spec.process, spec.schedule, spec.schedule_args) == (
        "learned", "learned", {"initial_exponent": 2.0, "endpoint_eps": 1e-3})
    uniform = load_config(None, {"model.process": "uniform", "model.schedule": "cosine", **TIMED})
    uniform = uniform.model.spec(network)
    assert (uniform.process, uniform.schedule, uniform.schedule_args) == ("uniform", "cosine", {})
    assert Config().model.spec(network).process == "absorbing"  # the default


# ------------------------------------------------------------------ configs that build on others
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


# ------------------------------------------------------------------ what a resume compares
def test_config_differences_ignore_resume_safe_fields():
    a = Config().to_dict()
    b = load_config(None, {"train.max_steps": "7", "logging.every": "3", "optim.lr": "1e-4"}).to_dict()
    assert config_differences(a, b) == ["optim.lr: checkpoint 0.0003, now 0.0001"]

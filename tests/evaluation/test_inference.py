"""How evaluation, sampling and lm-eval run the network (``evaluation.inference``): on the GPU
when there is one unless told otherwise, and compiled when the work repays it or as told."""

from __future__ import annotations

import pytest
import torch

from evaluation.inference import COMPILE_MIN_TOKENS, should_compile

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.mark.parametrize("gpu", [True, False])
def test_every_command_runs_on_the_gpu_when_there_is_one_unless_told_otherwise(monkeypatch, gpu):
    from evaluation.downstream import lm_eval_model
    from evaluation.inference import resolve_device
    from orchestration.cli import build_parser

    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpu)
    expected = torch.device("cuda" if gpu else "cpu")
    assert resolve_device(None) == expected and lm_eval_model._device(None) == expected
    assert resolve_device("cpu") == torch.device("cpu")
    commands = build_parser()._subparsers._group_actions[0].choices
    with_device = {name: action for name, command in commands.items() for action in command._actions
                   if "--device" in action.option_strings}
    assert {"sample", "eval", "lm-eval"} <= with_device.keys()
    for name, action in with_device.items():   # unset, so that resolve_device decides
        assert action.default is None and "cuda when there is one" in action.help, name


def test_compile_auto_is_on_for_a_gpu_when_the_work_repays_it_and_on_or_off_as_told():
    """``unmask eval --compile``, ``unmask sample --compile`` and a plan's ``compile``."""
    cpu, cuda = torch.device("cpu"), torch.device("cuda")  # device objects only: nothing runs on them
    assert not should_compile("auto", cpu, 10**12)
    assert should_compile("auto", cuda, COMPILE_MIN_TOKENS) and not should_compile("auto", cuda, COMPILE_MIN_TOKENS - 1)
    assert should_compile("on", cpu, 1) and not should_compile("off", cuda, 10**12)
    with pytest.raises(ValueError, match="compile must be one of auto, on, off"):
        should_compile("yes", cpu, 1)

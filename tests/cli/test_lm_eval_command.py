"""`unmask lm-eval`'s --limit and --download, and the checks of ``evaluation.downstream.run``
behind them: a limit is a whole number of documents or a fraction of them (the command's usage
error, the library's refusal), and --download without a network fails at once in one line, the
probe going through the proxy the environment names."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from common.errors import UserError
from tests.support.cli_refusals import one_line_error as _error
from tests.support.cli_refusals import untrained_exports
from tests.support.cli_runner import unmask_in_process

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def exports(tmp_path_factory) -> dict[str, Path]:
    return untrained_exports(tmp_path_factory.mktemp("exports"))


# ------------------------------------------------------------------ --limit
@pytest.mark.parametrize("limit", ["abc", "1.5", "0", "nan"])
def test_lm_eval_limit_must_be_documents_or_a_fraction(exports, capsys, limit):
    """lm-eval would cut 1.5 to 1 document without a word: refused, as a word or a non-positive number."""
    with pytest.raises(SystemExit) as exited:   # argparse's usage error
        unmask_in_process(["lm-eval", str(exports["ar"]), "--tasks", "ptb_word_order", "--limit", limit])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert exited.value.code == 2 and err == (f"unmask lm-eval: error: argument --limit: '{limit}' is neither a whole "
                                              f"number of documents (>= 1) nor a fraction of them in (0, 1)")


def test_the_lm_eval_library_refuses_a_limit_lm_eval_would_cut():
    from evaluation.downstream.run import DownstreamConfig

    for limit in (1.5, 0, -2):
        with pytest.raises(UserError, match=r"--limit must be a whole number of documents N >= 1, or a fraction"):
            DownstreamConfig(tasks=("ptb_word_order",), limit=limit).check()
    for limit in (0.25, 3, 3.0):
        DownstreamConfig(tasks=("ptb_word_order",), limit=limit).check()


# ------------------------------------------------------------------ --download
def test_lm_eval_download_without_a_network_fails_at_once_in_one_line(exports, capsys, tmp_path, monkeypatch):
    with socket.socket() as unused:            # a loopback port nobody listens on: no network
        unused.bind(("127.0.0.1", 0))
        port = unused.getsockname()[1]
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{port}")
    for name in ("http_proxy", "https_proxy", "all_proxy", "HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY"):
        monkeypatch.delenv(name, raising=False)   # the probe goes to the endpoint itself
    err = _error(capsys, "lm-eval", str(exports["ar"]), "--tasks", "lambada_openai", "--download",
                 "--out", str(tmp_path / "report"))
    assert f"--download: the Hugging Face Hub at http://127.0.0.1:{port} cannot be reached" in err
    assert "leave --download out" in err


def test_the_hub_probe_goes_through_the_proxy_the_environment_names(monkeypatch):
    """Behind a proxy the Hub's host is not reached directly: the probe must not refuse --download there."""
    from evaluation.downstream.run import check_hub_reachable

    for name in ("no_proxy", "NO_PROXY", "all_proxy", "ALL_PROXY", "HTTPS_PROXY"):
        monkeypatch.delenv(name, raising=False)
    with socket.socket() as proxy:
        proxy.bind(("127.0.0.1", 0))
        proxy.listen()
        monkeypatch.setenv("HF_ENDPOINT", "https://hub.invalid")
        monkeypatch.setenv("https_proxy", f"http://127.0.0.1:{proxy.getsockname()[1]}")
        check_hub_reachable(timeout=5)
        monkeypatch.delenv("https_proxy")
        with pytest.raises(UserError, match="--download: the Hugging Face Hub at https://hub.invalid cannot be reached"):
            check_hub_reachable(timeout=5)


def test_lm_eval_gen_guidance_reaches_the_model_and_a_bad_weight_is_refused(exports, capsys):
    from evaluation.downstream.run import DownstreamConfig

    config = DownstreamConfig(tasks=("ptb_word_order",), gen_guidance=1.5)
    config.check()
    assert config.model_args("cpu")["gen_guidance"] == 1.5
    assert "gen_guidance" not in DownstreamConfig(tasks=("ptb_word_order",)).model_args("cpu")
    err = _error(capsys, "lm-eval", str(exports["diffusion"]), "--tasks", "ptb_word_order", "--gen-guidance", "-1")
    assert "--gen-guidance must be a number >= 0" in err


def test_lm_eval_guidance_of_loglikelihood_reaches_the_model_and_the_settings_and_a_bad_weight_is_refused(exports,
                                                                                                         capsys):
    from evaluation.downstream.run import DownstreamConfig, _settings

    config = DownstreamConfig(tasks=("ptb_word_order",), guidance=1.0)
    config.check()
    assert config.model_args("cpu")["guidance"] == 1.0
    assert "not a likelihood bound" in _settings(config, "cpu")["loglikelihood"]
    assert "guidance" not in DownstreamConfig(tasks=("ptb_word_order",)).model_args("cpu")
    err = _error(capsys, "lm-eval", str(exports["diffusion"]), "--tasks", "ptb_word_order", "--guidance", "-1")
    assert "--guidance must be a number >= 0" in err


def test_lm_eval_generation_blocks_reach_the_model_and_the_settings_and_need_each_other(exports, capsys):
    from evaluation.downstream.run import DownstreamConfig, _settings

    config = DownstreamConfig(tasks=("ptb_word_order",), gen_block_len=8, gen_whole_sequence=True, gen_dual_cache=2)
    config.check()
    blocks = {"gen_block_len": 8, "gen_whole_sequence": True, "gen_dual_cache": 2}
    assert {name: config.model_args("cpu")[name] for name in blocks} == blocks
    assert {name: _settings(config, "cpu")[name] for name in blocks} == blocks
    assert not set(blocks) & set(DownstreamConfig(tasks=("ptb_word_order",)).model_args("cpu"))
    err = _error(capsys, "lm-eval", str(exports["diffusion"]), "--tasks", "ptb_word_order", "--gen-dual-cache", "2")
    assert "--gen-dual-cache needs --gen-whole-sequence" in err
    err = _error(capsys, "lm-eval", str(exports["diffusion"]), "--tasks", "ptb_word_order", "--gen-whole-sequence")
    assert "--gen-whole-sequence needs --gen-block-len" in err

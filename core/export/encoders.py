"""BERT-family classifier runs (sentiment on all-MiniLM-L6-v2 or another BERT/RoBERTa folder)
written out as a Hugging Face folder that is also a sentence-transformers model.

The run classifies the mean of the encoder's last states (as sentence-transformers pools
MiniLM) with a linear layer. transformers' `BertForSequenceClassification` reads the first
token's state through a pooler (dense + tanh) that the run never had, so no stock transformers
head computes the run's probabilities; sentence-transformers composes exactly the run's
pipeline from the folder: the encoder (config.json with the run's labels as id2label,
model.safetensors, the tokenizer's files), mean pooling (1_Pooling) and the classifier as a
Dense layer without activation (2_Dense), whose outputs are the run's logits:

    SentenceTransformer(folder).encode(texts)  # [N, C] logits; softmax gives the run's probabilities
    AutoModel.from_pretrained(folder)           # the fine-tuned encoder, labels in its config
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np

from core.checkpoints import bert, hf_writer, pretrained
from core.checkpoints.pretrained import Checkpoint
from core.checkpoints.rules import fused_rows
from core.config import ModelConfig
from core.errors import UserError
from core.export.tensors import placed

HEAD = ("head.linear.kernel", "head.linear.bias")
# The source folder's files that describe the tokenizer, copied as they are.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json")


def write_hf(path: Path, checkpoint: Checkpoint, model: ModelConfig, params: dict, dtype: str, featurizer) -> None:
    classes = featurizer.classes  # the classifier's labels, in the order of its outputs
    rules = bert.rules(checkpoint)  # a bare encoder's names (BertModel's)
    if not set(HEAD) <= set(params) or not classes:
        raise UserError(
            "A sentence-transformers folder holds an encoder and a linear classifier over its mean-pooled "
            "states; this run's model has no such classifier."
        )
    family = pretrained.families()[checkpoint.reader]
    source = family.tensors(checkpoint)
    prefix = bert.name_prefix(checkpoint, set(source))
    source = {name.removeprefix(prefix): value for name, value in source.items()}
    where = "A sentence-transformers folder (an encoder, mean pooling and a linear classifier)"
    tensors = placed(params, rules, fused_rows(rules, model), where, base=source, beside=HEAD)
    # What the run has no use for (BERT's pooler) stays the source's, so that AutoModel loads whole.
    kept = {name: value for name, value in source.items() if name not in tensors and value.dtype.kind == "f"}
    path.mkdir()
    hf_writer.save_tensors(path / "model.safetensors", {**kept, **tensors}, dtype)
    config = json.loads((checkpoint.directory / "config.json").read_text())
    labels = dict(enumerate(classes))
    config.update(
        architectures=[{"bert": "BertModel"}.get(checkpoint.family, "RobertaModel")],
        id2label={str(i): label for i, label in labels.items()},
        label2id={label: i for i, label in labels.items()},
        torch_dtype=dtype,
    )
    hf_writer.write_json(path / "config.json", config)
    for name in TOKENIZER_FILES:
        if (checkpoint.directory / name).is_file():
            shutil.copyfile(checkpoint.directory / name, path / name)
    _sentence_transformers(path, model, params, dtype, len(classes))


def _sentence_transformers(path: Path, model: ModelConfig, params: dict, dtype: str, classes: int) -> None:
    """modules.json and the pooling and dense modules' folders: the run's pipeline."""
    modules = [
        ("", "sentence_transformers.models.Transformer"),
        ("1_Pooling", "sentence_transformers.models.Pooling"),
        ("2_Dense", "sentence_transformers.models.Dense"),
    ]
    hf_writer.write_json(
        path / "modules.json",
        [{"idx": i, "name": str(i), "path": folder, "type": kind} for i, (folder, kind) in enumerate(modules)],
    )
    hf_writer.write_json(path / "sentence_bert_config.json", {"max_seq_length": model.max_len, "do_lower_case": False})
    (path / "1_Pooling").mkdir()
    modes = ("cls_token", "mean_tokens", "max_tokens", "mean_sqrt_len_tokens")
    pooling = {f"pooling_mode_{mode}": mode == "mean_tokens" for mode in modes}
    hf_writer.write_json(path / "1_Pooling" / "config.json", {"word_embedding_dimension": model.d_model, **pooling})
    (path / "2_Dense").mkdir()
    dense = {"in_features": model.d_model, "out_features": classes, "bias": True}
    hf_writer.write_json(
        path / "2_Dense" / "config.json", {**dense, "activation_function": "torch.nn.modules.linear.Identity"}
    )
    kernel, bias = (np.asarray(params[name]) for name in HEAD)
    hf_writer.save_tensors(
        path / "2_Dense" / "model.safetensors", {"linear.weight": kernel.T, "linear.bias": bias}, dtype
    )

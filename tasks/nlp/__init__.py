"""Language tasks: sentencepiece tokenizer, text tables, sentiment classification."""

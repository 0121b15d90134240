"""What several domains share: table and hub readers (`tables`), the per-process file cache
(`cache`), hash and stratified splits (`splits`), tokenizers (`tokenizer`), the embedded
reviews (`reviews`), classification scores (`scoring`) and the task families built once
(`families`). A domain imports `core` and `tasks.common`, never another domain."""

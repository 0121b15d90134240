"""What several domains share: table and hub readers (`tables`), the per-process file cache
(`cache`), hash and stratified splits (`splits`), tokenizers (`tokenizer`), chat templates
(`chat`) and the tool calls chats carry (`tools`), the embedded
reviews (`reviews`), classification scores (`scoring`) and the task families built once
(`families`). A domain imports `core` and `tasks.common`, never another domain."""

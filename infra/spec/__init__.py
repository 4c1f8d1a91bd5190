"""The stack file: its typed schema (`schema`), loading (`stack_file`) and what is checked about it
beyond the schema (`stack_warnings`, `principals`), and where a model's weights come from
(`model_source`)."""

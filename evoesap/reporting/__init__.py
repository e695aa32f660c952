"""Pages from records: the report's tables and plots (`report`), the model card (`card`) and their templates
(`render`, `templates/`)."""

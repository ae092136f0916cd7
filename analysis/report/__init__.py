"""The report stage: read a sweep's curves from the store, fit and rank them (`build`), and render
the result as a table, Markdown, CSV, JSON, HTML and PNG plots (`render`, `plots`).

The only part of `analysis/` that reads the store; see docs/architecture.md.
"""
